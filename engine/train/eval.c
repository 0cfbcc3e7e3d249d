/* eval.c - see eval.h. */
#define _POSIX_C_SOURCE 200809L
#include "engine/train/eval.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/mt_clock.h"
#include "base/mt_fs.h"
#include "base/mt_log.h"
#include "base/mt_npy.h"
#include "base/mt_status.h"
#include "engine/data/data_indexed.h"
#include "engine/data/data_samples.h"
#include "engine/model/model.h"

/* ---- the sequences to score --------------------------------------------------------- */

typedef struct token_source {
    char what[4200];     /* for messages: the token file, or "valid split of DATA" */
    int64_t n;           /* sequences */
    int L;               /* tokens per sequence (T + 1) */
    int32_t *rows;       /* token file: [n, L] in memory */
    mt_indexed *ds;      /* valid split: read on demand */
    mt_samples *samples;
} token_source;

static void source_close(token_source *s)
{
    free(s->rows);
    if (s->samples) mt_samples_close(s->samples);
    if (s->ds) mt_indexed_close(s->ds);
}

/* Text: one sequence per line of whitespace-separated ids. */
static int read_text_tokens(token_source *s, const char *path)
{
    char *text = mt_read_text_file(path);
    if (!text) return MT_ERR(MT_EIO, "%s: cannot read: %s", path, strerror(errno));
    int64_t cap = 0, n = 0, L = -1, first_line = 0;
    int rc = MT_OK;
    int lineno = 0;
    char *p = text;
    while (*p && rc == MT_OK) {
        char *eol = strchr(p, '\n');
        if (eol) *eol = '\0';
        lineno++;
        char *q = p;
        while (*q == ' ' || *q == '\t' || *q == '\r') q++;
        if (*q && *q != '#') {
            int64_t len = 0;
            for (;;) {
                while (*q == ' ' || *q == '\t' || *q == '\r' || *q == ',') q++;
                if (!*q) break;
                char *end;
                errno = 0;
                long long v = strtoll(q, &end, 10);
                if (end == q || errno || v < INT32_MIN || v > INT32_MAX ||
                    (*end && !strchr(" \t\r,", *end))) {
                    int wl = (int)strcspn(q, " \t\r,");
                    rc = MT_ERR(MT_EINVAL, "%s:%d: \"%.*s\" is not a token id", path, lineno,
                                wl > 40 ? 40 : wl, q);
                    break;
                }
                if (n * (L > 0 ? L : 1) + len >= cap) {
                    cap = cap ? 2 * cap : 4096;
                    int32_t *r = realloc(s->rows, (size_t)cap * 4);
                    if (!r) {
                        rc = MT_ERR(MT_ENOMEM, "%s: out of memory", path);
                        break;
                    }
                    s->rows = r;
                }
                s->rows[(L > 0 ? n * L : 0) + len++] = (int32_t)v;
                q = end;
            }
            if (rc == MT_OK && L < 0) {
                L = len;
                first_line = lineno;
            } else if (rc == MT_OK && len != L) {
                rc = MT_ERR(MT_EINVAL, "%s:%d: %lld tokens, but line %lld has %lld (every sequence "
                            "must have the same length)", path, lineno, (long long)len,
                            (long long)first_line, (long long)L);
            }
            if (rc == MT_OK) n++;
        }
        p = eol ? eol + 1 : p + strlen(p);
    }
    free(text);
    if (rc == MT_OK && n == 0) rc = MT_ERR(MT_EINVAL, "%s: no sequences", path);
    s->n = n;
    s->L = (int)(L > INT_MAX ? -1 : L);
    return rc;
}

static int open_token_file(token_source *s, const char *path)
{
    snprintf(s->what, sizeof s->what, "%s", path);
    FILE *f = fopen(path, "rb");
    if (!f) return MT_ERR(MT_EIO, "%s: cannot open: %s", path, strerror(errno));
    char head[6] = {0};
    size_t got = fread(head, 1, 6, f);
    fclose(f);
    if (got == 6 && memcmp(head, "\x93NUMPY", 6) == 0) {
        int64_t rows, cols;
        MT_CHECK(mt_npy_read_int32(path, &s->rows, &rows, &cols));
        if (rows == 0) return MT_ERR(MT_EINVAL, "%s: no sequences", path);
        if (cols > INT_MAX) return MT_ERR(MT_EINVAL, "%s: sequences of %lld tokens", path, (long long)cols);
        s->n = rows;
        s->L = (int)cols;
        return MT_OK;
    }
    return read_text_tokens(s, path);
}

static int open_valid_split(token_source *s, const mt_jobspec *j)
{
    snprintf(s->what, sizeof s->what, "valid split of %s", j->data.path);
    int rc = mt_indexed_open(j->data.path, &s->ds);
    if (rc < 0) return mt_err_wrap(rc, "data.path");
    mt_samples_config sc = {
        .split_ratios = j->data.split,
        .split = MT_SPLIT_VALID,
        .seq_len = j->batch.seq_len,
        .num_samples = (int64_t)j->data.valid_batches * j->batch.micro_batch_size,
        .eod_token = mt_jobspec_eod(j),
        .seed = (uint64_t)j->train.seed,
    };
    rc = mt_samples_open(s->ds, &sc, &s->samples);
    if (rc < 0) return mt_err_wrap(rc, "%s", s->what);
    s->n = mt_samples_count(s->samples);
    s->L = j->batch.seq_len + 1;
    return MT_OK;
}

static int source_get(const token_source *s, int64_t i, int32_t *out)
{
    if (s->rows) {
        memcpy(out, s->rows + i * s->L, (size_t)s->L * 4);
        return MT_OK;
    }
    return mt_samples_get(s->samples, i, out);
}

/* ---- scoring ------------------------------------------------------------------------ */

static int check_tokens(const token_source *s, int64_t seq, const int32_t *row, int64_t V)
{
    for (int t = 0; t < s->L; t++)
        if (row[t] < 0 || row[t] >= V)
            return MT_ERR(MT_EINVAL, "%s: sequence %lld, position %d: token %d is outside the "
                          "vocabulary [0, %lld)", s->what, (long long)seq, t, row[t], (long long)V);
    return MT_OK;
}

typedef struct load_progress {
    mt_eval_progress_fn fn;
    void *ctx;
} load_progress;

static void on_load(void *ctx, int done, int total)
{
    load_progress *lp = ctx;
    lp->fn(lp->ctx, "load", done, total);
}

int mt_eval_run(const mt_eval_request *req, const mt_model_config *cfg,
                const mt_tensor_reader *weights, mt_backend *be, mt_eval_progress_fn progress,
                void *ctx, volatile sig_atomic_t *stop, mt_eval_result *res)
{
    memset(res, 0, sizeof *res);
    const double t0 = mt_now_s();
    if (!req->tokens_path && !req->job)
        return MT_ERR(MT_EINVAL, "nothing to score: give a token file or a job (its valid split)");
    if (req->recipe == MT_RECIPE_FP32 && be->kind != MT_BE_CPU)
        return MT_ERR(MT_EINVAL, "fp32 runs on the CPU backend only (%s activations are bf16)",
                      be->name);
    token_source src;
    memset(&src, 0, sizeof src);
    mt_model *m = NULL;
    mt_npy_writer *w_loss = NULL, *w_logits = NULL, *w_tok = NULL;
    int32_t *tok = NULL;
    float *loss = NULL, *logits = NULL;
    int rc = req->tokens_path ? open_token_file(&src, req->tokens_path) : open_valid_split(&src, req->job);
    if (rc < 0) goto out;
    if (src.L < 2) {
        rc = MT_ERR(MT_EINVAL, "%s: sequences of %d token(s): at least 2 are needed (inputs and a "
                    "next token)", src.what, src.L);
        goto out;
    }
    const int T = src.L - 1;
    const int64_t V = cfg->vocab_size;
    if (T > cfg->max_position_embeddings) {
        rc = MT_ERR(MT_EINVAL, "%s: sequences of %d tokens exceed max_position_embeddings %lld + 1",
                    src.what, src.L, (long long)cfg->max_position_embeddings);
        goto out;
    }
    if (cfg->num_nextn_predict_layers >= T) {
        rc = MT_ERR(MT_EINVAL, "%s: sequences of %d tokens are too short for %d MTP depth(s)",
                    src.what, src.L, cfg->num_nextn_predict_layers);
        goto out;
    }
    int B = req->micro_batch > 0 ? req->micro_batch : req->job ? req->job->batch.micro_batch_size : 1;
    if (B > src.n) B = (int)src.n;
    if (req->job && !req->tokens_path && src.n % B)
        MT_LOGW("eval: %lld sequences are not a multiple of %d per forward", (long long)src.n, B);

    mt_model_opts mo;
    if (req->job) {
        mt_trainer_model_opts(&mo, req->job);
    } else {
        memset(&mo, 0, sizeof mo);
        mo.mtp_weight = 0.3;
    }
    mo.recipe = req->recipe;
    mo.micro_batch = B;
    mo.seq_len = T;
    rc = mt_model_create(&m, cfg, &mo, be);
    if (rc < 0) goto out;
    load_progress lp = {progress, ctx};
    rc = mt_train_state_load_weights(m, weights, progress ? on_load : NULL, &lp);
    if (rc < 0) goto out;

    const int64_t S = src.n;
    const size_t NV = (size_t)B * T * (size_t)V;
    tok = malloc((size_t)B * src.L * 4);
    loss = malloc((size_t)B * T * 4);
    if (req->logits_path) logits = malloc(NV * 4);
    if (!tok || !loss || (req->logits_path && !logits)) {
        rc = MT_ERR(MT_ENOMEM, "eval: out of memory (%d x %d tokens%s)", B, T,
                    req->logits_path ? " with their logits" : "");
        goto out;
    }
    int64_t shape[3] = {S, T, V}, tshape[2] = {S, src.L};
    if (req->loss_path && (rc = mt_npy_create(&w_loss, req->loss_path, "<f4", 2, shape)) < 0) goto out;
    if (req->logits_path && (rc = mt_npy_create(&w_logits, req->logits_path, "<f4", 3, shape)) < 0)
        goto out;
    if (req->tokens_out_path &&
        (rc = mt_npy_create(&w_tok, req->tokens_out_path, "<i4", 2, tshape)) < 0)
        goto out;

    double sum = 0;
    if (progress) progress(ctx, "score", 0, S * T);
    for (int64_t first = 0; first < S; first += B) {
        if (stop && *stop) {
            rc = MT_ERR(MT_EINTR, "eval: stopped after %lld of %lld sequences", (long long)first,
                        (long long)S);
            goto out;
        }
        const int rows = S - first < B ? (int)(S - first) : B;
        for (int b = 0; b < B; b++) {
            /* a short last batch is padded with copies of its first row; their
             * results are dropped (each token's loss depends only on its own
             * sequence: no token dropping, attention within the sequence) */
            int32_t *row = tok + (size_t)b * src.L;
            if (b >= rows) {
                memcpy(row, tok, (size_t)src.L * 4);
                continue;
            }
            if ((rc = source_get(&src, first + b, row)) < 0) goto out;
            if ((rc = check_tokens(&src, first + b, row, V)) < 0) goto out;
        }
        mt_score_out so = {loss, logits};
        mt_mb_stats st;
        if ((rc = mt_model_score(m, tok, &so, &st)) < 0) goto out;
        /* fixed order in double, as the trainer sums its losses */
        for (int64_t i = 0; i < (int64_t)rows * T; i++) sum += loss[i];
        if (w_loss && (rc = mt_npy_write(w_loss, loss, (int64_t)rows * T)) < 0) goto out;
        if (w_logits && (rc = mt_npy_write(w_logits, logits, (int64_t)rows * T * V)) < 0) goto out;
        if (w_tok && (rc = mt_npy_write(w_tok, tok, (int64_t)rows * src.L)) < 0) goto out;
        res->sequences += rows;
        res->tokens += (int64_t)rows * T;
        if (progress) progress(ctx, "score", res->tokens, S * T);
    }
    res->loss = sum / (double)res->tokens;
    res->seq_len = T;
    rc = mt_npy_close(w_loss, 0);
    w_loss = NULL;
    int r2 = mt_npy_close(w_logits, rc < 0);
    w_logits = NULL;
    if (rc == MT_OK) rc = r2;
    r2 = mt_npy_close(w_tok, rc < 0);
    w_tok = NULL;
    if (rc == MT_OK) rc = r2;
out:
    mt_npy_close(w_loss, 1);
    mt_npy_close(w_logits, 1);
    mt_npy_close(w_tok, 1);
    free(tok);
    free(loss);
    free(logits);
    mt_model_destroy(m);
    source_close(&src);
    res->seconds = mt_now_s() - t0;
    return rc;
}
