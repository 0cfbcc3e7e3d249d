/* metrics.c - metric sinks: log line and JSONL file. */
#include "engine/train/metrics.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_fs.h"
#include "base/mt_log.h"
#include "base/mt_status.h"

void mt_metrics_load_stats(const int64_t *load, int E, double *min_r, double *max_r, double *cv)
{
    double sum = 0, mn = INFINITY, mx = 0;
    for (int e = 0; e < E; e++) {
        sum += (double)load[e];
        if (load[e] < mn) mn = (double)load[e];
        if (load[e] > mx) mx = (double)load[e];
    }
    double mean = E > 0 ? sum / E : 0;
    double var = 0;
    for (int e = 0; e < E; e++) var += ((double)load[e] - mean) * ((double)load[e] - mean);
    var = E > 0 ? var / E : 0;
    *min_r = mean > 0 ? mn / mean : 0;
    *max_r = mean > 0 ? mx / mean : 0;
    *cv = mean > 0 ? sqrt(var) / mean : 0;
}

/* JSON has no NaN: unmeasured values are null. */
static int num(char *buf, size_t cap, const char *key, double v)
{
    if (!isfinite(v)) return snprintf(buf, cap, ",\"%s\":null", key);
    return snprintf(buf, cap, ",\"%s\":%.9g", key, v);
}

int mt_metrics_to_json(const mt_step_metrics *m, char *buf, size_t cap)
{
    size_t n = 0;
#define PUT(...)                                                   \
    do {                                                           \
        int w_ = snprintf(buf + n, n < cap ? cap - n : 0, __VA_ARGS__); \
        if (w_ > 0) n += (size_t)w_;                               \
    } while (0)
#define NUM(key, v)                                                \
    do {                                                           \
        int w_ = num(buf + n, n < cap ? cap - n : 0, key, v);      \
        if (w_ > 0) n += (size_t)w_;                               \
    } while (0)
    PUT("{\"step\":%lld,\"total_steps\":%lld", (long long)m->step, (long long)m->total_steps);
    NUM("loss", m->loss);
    NUM("mtp_loss", m->mtp_loss);
    NUM("aux_loss", m->aux_loss);
    NUM("lr", m->lr);
    NUM("grad_norm", m->grad_norm);
    NUM("valid_loss", m->valid_loss);
    NUM("step_ms", m->step_ms);
    NUM("compute_ms", m->compute_ms);
    if (m->pp_size > 1) {
        PUT(",\"pp_stage\":%d", m->pp_stage);
        NUM("pp_idle", m->pp_idle);
        NUM("pp_bubble", m->pp_bubble);
        NUM("pp_bubble_measured", m->pp_bubble_measured);
    }
    NUM("tokens_per_s", m->tokens_per_s);
    NUM("tflops", m->tflops);
    NUM("mfu", m->mfu);
    PUT(",\"tokens\":%lld,\"samples\":%lld,\"mem_in_use\":%zu,\"mem_peak\":%zu",
        (long long)m->tokens, (long long)m->samples, m->mem_in_use, m->mem_peak);
    PUT(",\"skipped\":%s,\"skipped_total\":%lld", m->skipped ? "true" : "false",
        (long long)m->skipped_total);
    PUT(",\"spike\":%d,\"rollbacks_total\":%lld", m->spike, (long long)m->rollbacks_total);
    PUT(",\"expert_load\":[");
    for (int i = 0; i < m->n_moe; i++) {
        PUT("%s{\"layer\":%d", i ? "," : "", m->moe_layer[i]);
        NUM("min", m->load_min[i]);
        NUM("max", m->load_max[i]);
        NUM("cv", m->load_cv[i]);
        PUT("}");
    }
    PUT("]}");
#undef PUT
#undef NUM
    return (int)(n < cap ? n : cap - 1);
}

/* ---- log line ------------------------------------------------------------- */

typedef struct log_sink {
    mt_metrics_sink s;
    int interval;
} log_sink;

static int log_emit(mt_metrics_sink *s, const mt_step_metrics *m)
{
    int interval = ((log_sink *)s->impl)->interval;
    int due = m->skipped || m->step % interval == 0 || m->step == 1 ||
              m->step == m->total_steps || isfinite(m->valid_loss);
    if (!due) return MT_OK;
    double lmax = 0;
    for (int i = 0; i < m->n_moe; i++)
        if (m->load_max[i] > lmax) lmax = m->load_max[i];
    char mfu[32], extra[192] = "";
    if (isfinite(m->mfu))
        snprintf(mfu, sizeof mfu, "%.1f%%", 100 * m->mfu);
    else
        snprintf(mfu, sizeof mfu, "-");
    if (isfinite(m->valid_loss)) snprintf(extra, sizeof extra, " | valid %.4f", m->valid_loss);
    if (m->pp_size > 1) {
        size_t k = strlen(extra);
        snprintf(extra + k, sizeof extra - k, " | stage %d idle %.1f%% (predicted %.1f%% from "
                 "measured costs, %.1f%% with equal costs)", m->pp_stage, 100 * m->pp_idle,
                 100 * m->pp_bubble_measured, 100 * m->pp_bubble);
    }
    MT_LOGI("step %6lld/%lld | loss %.4f | mtp %.4f | aux %.2e | lr %.3e | gnorm %.3f | "
            "%.0f ms | %.0f tok/s | %.2f TFLOPS | MFU %s | load max %.2f%s%s",
            (long long)m->step, (long long)m->total_steps, m->loss, m->mtp_loss, m->aux_loss,
            m->lr, m->grad_norm, m->step_ms, m->tokens_per_s, m->tflops, mfu, lmax, extra,
            m->skipped ? " | SKIPPED (non-finite)" : "");
    return MT_OK;
}

static void log_close(mt_metrics_sink *s) { free(s->impl); }

int mt_metrics_log_sink(mt_metrics_sink **out, int interval)
{
    log_sink *l = calloc(1, sizeof *l);
    if (!l) return MT_ERR(MT_ENOMEM, "metrics: out of memory");
    l->interval = interval > 0 ? interval : 1;
    l->s.emit = log_emit;
    l->s.close = log_close;
    l->s.impl = l;
    *out = &l->s;
    return MT_OK;
}

/* ---- JSONL file --------------------------------------------------------------- */

typedef struct jsonl_sink {
    mt_metrics_sink s;
    FILE *f;
    char path[1024];
} jsonl_sink;

static int jsonl_emit(mt_metrics_sink *s, const mt_step_metrics *m)
{
    jsonl_sink *j = s->impl;
    char line[16384];
    int n = mt_metrics_to_json(m, line, sizeof line);
    if (fwrite(line, 1, (size_t)n, j->f) != (size_t)n || fputc('\n', j->f) == EOF ||
        fflush(j->f) != 0)
        return MT_ERR(MT_EIO, "%s: cannot write metrics", j->path);
    return MT_OK;
}

static void jsonl_close(mt_metrics_sink *s)
{
    jsonl_sink *j = s->impl;
    if (j->f) fclose(j->f);
    free(j);
}

int mt_metrics_jsonl_sink(mt_metrics_sink **out, const char *path)
{
    MT_CHECK(mt_mkdir_parent(path));
    jsonl_sink *j = calloc(1, sizeof *j);
    if (!j) return MT_ERR(MT_ENOMEM, "metrics: out of memory");
    snprintf(j->path, sizeof j->path, "%s", path);
    j->f = fopen(path, "w");
    if (!j->f) {
        free(j);
        return MT_ERR(MT_EIO, "%s: cannot create metrics file", path);
    }
    j->s.emit = jsonl_emit;
    j->s.close = jsonl_close;
    j->s.impl = j;
    *out = &j->s;
    return MT_OK;
}
