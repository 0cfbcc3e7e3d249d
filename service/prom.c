/* prom.c - see prom.h. */
#define _POSIX_C_SOURCE 200809L
#include "service/prom.h"

#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"
#include "service/board.h"

#ifndef MOETRAIN_VERSION
#define MOETRAIN_VERSION "dev"
#endif

typedef struct buf {
    char *p;
    size_t n, cap;
    int oom;
} buf;

static void put(buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(buf *b, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int w = vsnprintf(b->p + b->n, b->cap - b->n, fmt, ap);
        va_end(ap);
        if (w < 0) return;
        if ((size_t)w < b->cap - b->n) {
            b->n += (size_t)w;
            return;
        }
        size_t cap = 2 * b->cap + (size_t)w;
        char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
}

static void head(buf *b, const char *name, const char *type, const char *help)
{
    put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void value(buf *b, double v)
{
    if (isnan(v)) put(b, " NaN\n");
    else if (isinf(v)) put(b, v > 0 ? " +Inf\n" : " -Inf\n");
    else put(b, " %.17g\n", v);
}

static void gauge(buf *b, const char *name, const char *help, double v)
{
    head(b, name, "gauge", help);
    put(b, "%s", name);
    value(b, v);
}

static void counter(buf *b, const char *name, const char *help, unsigned long long v)
{
    head(b, name, "counter", help);
    put(b, "%s %llu\n", name, v);
}

static void lower(char *s)
{
    for (; *s; s++) *s = (char)tolower((unsigned char)*s);
}

/* Per-expert series (two per expert and MoE layer) are exported while MoE
 * layers x routed experts stays at or below this: every label pair is a
 * series Prometheus keeps. A model past it (DeepSeek-V3: 59 MoE layers
 * with MTP x 256 experts = 15104) exports only the per-layer ratios, and
 * the dashboard's /api/experts has every expert. */
#define PROM_EXPERT_SERIES_MAX 1024

/* The last step's tokens per routed expert and router bias, by layer and
 * expert, when few enough. */
static void experts(buf *b, board *bd)
{
    board_experts e;
    if (!bd || board_get_experts(bd, &e) < 0) return;
    const long cells = (long)e.n_layers * e.n_experts;
    const int capped = cells > PROM_EXPERT_SERIES_MAX;
    gauge(b, "moetrain_expert_series_capped",
          "1 when the per-expert series are left out: MoE layers x routed experts exceeds "
          "1024.", capped);
    if (e.step > 0 && cells > 0 && !capped) {
        head(b, "moetrain_expert_tokens", "gauge",
             "Tokens routed to each routed expert of a MoE layer in the last step (global batch).");
        for (int l = 0; l < e.n_layers; l++)
            for (int x = 0; x < e.n_experts; x++)
                put(b, "moetrain_expert_tokens{layer=\"%d\",expert=\"%d\"} %lld\n", e.layer[l], x,
                    (long long)e.load[(size_t)l * e.n_experts + x]);
        if (e.have_bias) {
            head(b, "moetrain_router_bias", "gauge",
                 "Router bias of each routed expert of a MoE layer after the last step "
                 "(aux-loss-free balancing).");
            for (int l = 0; l < e.n_layers; l++)
                for (int x = 0; x < e.n_experts; x++) {
                    put(b, "moetrain_router_bias{layer=\"%d\",expert=\"%d\"}", e.layer[l], x);
                    value(b, e.bias[(size_t)l * e.n_experts + x]);
                }
        }
    }
    board_experts_free(&e);
}

/* Every rank's last step, labelled by rank, and the slowest rank. */
static void ranks(buf *b, board *bd)
{
    board_ranks br;
    if (!bd || board_get_ranks(bd, &br) < 0) return;
    if (br.n > 0) {
        static const char *const names[4] = {
            "moetrain_rank_step_duration_seconds", "moetrain_rank_compute_duration_seconds",
            "moetrain_rank_memory_in_use_bytes", "moetrain_rank_memory_peak_bytes"};
        static const char *const helps[4] = {
            "Wall time of each rank's last step.",
            "Each rank's own work in its last step, until its gradients were ready for the "
            "data-parallel reduction (the slowest rank has the longest).",
            "Backend memory in use on each rank after its last step.",
            "Peak backend memory of each rank."};
        for (int k = 0; k < 4; k++) {
            head(b, names[k], "gauge", helps[k]);
            for (int i = 0; i < br.n; i++) {
                const board_rank *r = &br.r[i];
                double v = k == 0 ? r->step_ms * 1e-3 : k == 1 ? r->compute_ms * 1e-3
                         : k == 2 ? (double)r->mem_in_use : (double)r->mem_peak;
                put(b, "%s{rank=\"%d\"}", names[k], r->rank);
                value(b, v);
            }
        }
        if (br.r[0].pp_size > 1) { /* pipeline: each stage's idle next to the prediction */
            static const char *const pn[3] = {
                "moetrain_rank_pipeline_idle_ratio", "moetrain_rank_pipeline_predicted_idle_ratio",
                "moetrain_rank_pipeline_measured_cost_idle_ratio"};
            static const char *const ph[3] = {
                "Fraction of each rank's last step its device spent outside the pipeline's "
                "compute actions (waiting for activations, gradients or sends).",
                "The schedule table's predicted idle fraction of each rank's pipeline stage "
                "(simulator: forward 1, backward 2 per chunk, equal stages).",
                "The predicted idle fraction of each rank's pipeline stage, simulated with "
                "the last step's measured per-chunk forward and backward times."};
            for (int k = 0; k < 3; k++) {
                head(b, pn[k], "gauge", ph[k]);
                for (int i = 0; i < br.n; i++) {
                    const board_rank *r = &br.r[i];
                    put(b, "%s{rank=\"%d\",stage=\"%d\"}", pn[k], r->rank, r->pp_stage);
                    value(b, k == 0 ? r->pp_idle : k == 1 ? r->pp_bubble : r->pp_bubble_measured);
                }
            }
        }
        gauge(b, "moetrain_slowest_rank",
              "The rank with the longest own work (compute) in the last step.", br.slowest);
    }
    board_ranks_free(&br);
}

int prom_render(service *svc, char **out, size_t *len)
{
    control_status *st = malloc(sizeof *st);
    buf b = {malloc(16384), 0, 16384, 0};
    if (!st || !b.p) {
        free(st);
        free(b.p);
        return MT_ERR(MT_ENOMEM, "metrics: out of memory");
    }
    control_get_status(svc->ctl, st);
    const mt_step_metrics *m = &st->last;
    int have = st->have_metrics;

    head(&b, "moetrain_info", "gauge", "Build and engine of this daemon (always 1).");
    put(&b, "moetrain_info{version=\"%s\",backend=\"%s\"} 1\n", MOETRAIN_VERSION,
        st->backend[0] ? st->backend : "none");
    gauge(&b, "moetrain_start_time_seconds", "When the daemon started (Unix time).",
          st->started_unix);
    gauge(&b, "moetrain_ranks", "MPI ranks of the engine.", st->ranks);
    head(&b, "moetrain_job_state", "gauge", "1 for the job's current state, 0 for the others.");
    for (int s = SVC_IDLE; s <= SVC_FAILED; s++) {
        char name[16];
        snprintf(name, sizeof name, "%s", svc_state_name((svc_state)s));
        lower(name);
        put(&b, "moetrain_job_state{state=\"%s\"} %d\n", name, st->state == (svc_state)s);
    }
    counter(&b, "moetrain_jobs_started_total", "Jobs started by this daemon.",
            (unsigned long long)st->run_id);
    counter(&b, "moetrain_steps_total", "Optimizer steps completed by the current job.",
            (unsigned long long)(st->step > 0 ? st->step : 0));
    gauge(&b, "moetrain_job_target_steps", "Steps the current job runs to (train.steps).",
          (double)st->total_steps);
    counter(&b, "moetrain_tokens_total", "Training tokens consumed by the current job.",
            (unsigned long long)(st->tokens > 0 ? st->tokens : 0));
    if (have) {
        counter(&b, "moetrain_samples_total", "Training sequences consumed by the current job.",
                (unsigned long long)m->samples);
        counter(&b, "moetrain_skipped_steps_total",
                "Steps skipped for a non-finite loss or gradient.",
                (unsigned long long)m->skipped_total);
        counter(&b, "moetrain_rollbacks_total",
                "Rollbacks to the last good checkpoint after a loss spike or a NaN streak.",
                (unsigned long long)m->rollbacks_total);
        gauge(&b, "moetrain_loss", "LM loss of the last step.", m->loss);
        gauge(&b, "moetrain_mtp_loss", "Mean MTP loss of the last step.", m->mtp_loss);
        gauge(&b, "moetrain_aux_loss", "Sequence-wise balance loss of the last step (with alpha).",
              m->aux_loss);
        gauge(&b, "moetrain_learning_rate", "Learning rate of the last step.", m->lr);
        gauge(&b, "moetrain_grad_norm", "Global gradient norm of the last step, before clipping.",
              m->grad_norm);
        gauge(&b, "moetrain_step_duration_seconds", "Wall time of the last step.",
              m->step_ms * 1e-3);
        gauge(&b, "moetrain_tokens_per_second", "Training throughput of the last step.",
              m->tokens_per_s);
        gauge(&b, "moetrain_model_flops_per_second",
              "Model FLOPs per second per GPU (per rank on the CPU) of the last step.",
              m->tflops * 1e12);
        if (isfinite(m->mfu))
            gauge(&b, "moetrain_mfu_ratio", "Model FLOPs utilisation of the last step.", m->mfu);
        gauge(&b, "moetrain_memory_in_use_bytes", "Backend memory in use.", (double)m->mem_in_use);
        gauge(&b, "moetrain_memory_peak_bytes", "Peak backend memory.", (double)m->mem_peak);
        static const char *const names[3] = {"moetrain_expert_load_max_ratio",
                                             "moetrain_expert_load_min_ratio",
                                             "moetrain_expert_load_cv"};
        static const char *const helps[3] = {
            "Most loaded routed expert of a MoE layer over the mean load, last step.",
            "Least loaded routed expert of a MoE layer over the mean load, last step.",
            "Coefficient of variation of the routed experts' loads of a MoE layer, last step."};
        for (int k = 0; k < 3 && m->n_moe > 0; k++) {
            head(&b, names[k], "gauge", helps[k]);
            for (int i = 0; i < m->n_moe && i < MT_METRICS_MAX_MOE; i++) {
                double v = k == 0 ? m->load_max[i] : k == 1 ? m->load_min[i] : m->load_cv[i];
                put(&b, "%s{layer=\"%d\"}", names[k], m->moe_layer[i]);
                value(&b, v);
            }
        }
    }
    ranks(&b, control_board(svc->ctl));
    experts(&b, control_board(svc->ctl));
    if (isfinite(st->last_valid_loss))
        gauge(&b, "moetrain_valid_loss", "LM loss of the last validation pass.",
              st->last_valid_loss);
    counter(&b, "moetrain_checkpoints_saved_total", "Checkpoints saved since the daemon started.",
            (unsigned long long)st->ckpt_saved_total);
    if (st->last_ckpt.valid)
        gauge(&b, "moetrain_checkpoint_last_step", "Step of the last checkpoint saved.",
              (double)st->last_ckpt.step);
    gauge(&b, "moetrain_reshard_active", "1 while a checkpoint reshard runs.", st->reshard.active);
    gauge(&b, "moetrain_reshard_progress_ratio", "Progress of the current or last reshard.",
          st->reshard.progress);
    gauge(&b, "moetrain_metrics_subscribers", "StreamMetrics calls open.",
          atomic_load(&svc->subscribers));
    uint64_t published, missed;
    hub_stats(svc->hub, &published, &missed);
    counter(&b, "moetrain_metrics_events_total", "Events published to the metrics stream.",
            (unsigned long long)published);
    counter(&b, "moetrain_metrics_missed_events_total",
            "Events subscribers missed because they fell behind the retention ring.",
            (unsigned long long)missed);
    head(&b, "moetrain_rpc_calls_total", "counter", "RPCs answered, by method and status code.");
    int n;
    const rpc_method *t = rpc_methods(&n);
    for (int i = 0; i < n && i < svc->n_methods; i++)
        for (int code = 0; code < RPC_N_CODES; code++) {
            unsigned long v = atomic_load(&svc->calls[i * RPC_N_CODES + code]);
            if (v)
                put(&b, "moetrain_rpc_calls_total{method=\"%s\",code=\"%s\"} %lu\n",
                    t[i].path + 1, rpc_code_name(code), v);
        }
    free(st);
    if (b.oom) {
        free(b.p);
        return MT_ERR(MT_ENOMEM, "metrics: out of memory");
    }
    *out = b.p;
    *len = b.n;
    return MT_OK;
}
