/* test_model_cuda.c - the whole model and the training loop on the CUDA
 * backend against the CPU backend (the oracle).
 *
 *  1. Same weights (mt_model_init_random: a pure function of seed, name and
 *     index), same router bias, same tokens: one forward + backward per
 *     recipe (fp8-blockwise, bf16) and per model: test_model.c's tiny
 *     config (top-2 routing) and the demo model of deploy/examples
 *     (tiny-cpu.json) with every token routed to all 8 experts (see
 *     demo_config: top-2 routing at this size always has near ties that a
 *     last-bit difference flips). A fast-path step where a token's chosen
 *     experts differ between the backends moves to the next seed (up to 3
 *     times, reported; see compare_step). Each runs twice: on the backend's fast
 *     paths (cuBLASLt, cuDNN attention where it builds) and on its
 *     reference paths (a second backend created with MOETRAIN_GEMM=fallback,
 *     and MOETRAIN_ATTN=own: fp32 SIMT arithmetic). Checks:
 *       - compute copies of every parameter bit-identical (FP8 blocks are
 *         quantised on each backend: quant_blocks is exact);
 *       - LM, MTP, aux and total loss within 1e-3 relative (fp8 on the fast
 *         paths: demo 3e-3, measured 3.0e-4 to 8.4e-4 on an H200; tiny 1e-2,
 *         measured 3.5e-3: a mean over 16 tokens, not 512);
 *       - every parameter gradient within a relative norm error
 *         ||g_gpu - g_cpu|| / ||g_cpu||; each tensor's error is printed, the
 *         five worst at the end. Tolerances, with the worst tensor measured
 *         on an H200 in brackets:
 *                        fast paths             reference paths
 *           bf16         3e-2 (1.9e-2)          1.5e-2 (7.0e-3)
 *           fp8          tiny 2e-1 (1.2e-1),    6e-2 (3.1e-2)
 *                        demo 2e-1 (1.4e-1)
 *         The backends differ only in the order of fp32 sums (cuDNN also
 *         rounds P and dS to bf16), which moves a bf16 rounding by an ulp
 *         here and there; FP8 re-quantisation of slightly different values
 *         amplifies that about 4x (an e4m3 step is 16 bf16 ulps, so a
 *         1-ulp change flips a code 1 time in 16 and the flip is 16 times
 *         larger). On the reference paths the tiny model's gradients are
 *         bit-identical to the CPU's. Layout or scale bugs give O(1) errors.
 *       - the residual stream after every layer and the experts each MoE
 *         layer chose (printed, not checked: they show where a divergence
 *         starts; a different choice changes that token's gradients).
 *  2. 100 optimizer steps of the demo job (deploy/examples/tiny-cpu.json,
 *     seq_len 128, global batch 8, fp8-blockwise, fp32 main params) on both
 *     backends over a synthetic corpus written by this test (first-order Markov
 *     tokens, engine/data_indexed writer). Both curves are printed every 10
 *     steps; the mean loss of the last 10 steps must agree within 2%
 *     relative (rounding differences make the two trajectories drift apart
 *     slowly, they do not change what is learnt), and the GPU run must have
 *     learnt (last-10 mean below the first-10 mean by 0.3 nats).
 *
 * Usage: test_model_cuda EXAMPLES_DIR (deploy/examples). Exits 77 without a
 * CUDA device, 1 if any check failed. MT_TEST_GPU_IS_CPU=1 runs the "cuda"
 * side on a second CPU backend (a self-check of this program: all equal).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/data/data_indexed.h"
#include "kernels/mt_fp8.h"
#include "engine/model/layers.h"
#include "engine/model/model.h"
#include "engine/model/param_table.h"
#include "engine/train/trainer.h"
#include "base/mt_clock.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "test_util.h"
#include "tiny_model.h"

static mt_backend *BE[2]; /* [0] CPU, [1] CUDA */
static int n_pass, n_fail;

static void die(const char *what, int rc)
{
    fprintf(stderr, "FATAL: %s -> %s: %s\n", what, mt_strstatus(rc), mt_errmsg());
    exit(1);
}

#define MUST(stmt)                                                                  \
    do {                                                                            \
        int must_rc_ = (stmt);                                                      \
        if (must_rc_ != MT_OK) die(#stmt, must_rc_);                                \
    } while (0)

static void verdict(int ok, const char *what, const char *msg)
{
    printf("%s  %-58s %s\n", ok ? "PASS" : "FAIL", what, msg);
    if (ok)
        n_pass++;
    else
        n_fail++;
}

/* ---- configs ------------------------------------------------------------------------ */

/* The demo model (deploy/examples/tiny-cpu.json): head dims 48 / 32, so
 * cuBLASLt and cuDNN take the shapes the tiny config leaves to fallbacks.
 * Here every token is routed to all 8 experts (top_k = 8 of 4 groups of
 * 2): with 512 tokens per MoE layer a top-2 choice always has some near
 * ties, which a last-bit difference decides either way and which then
 * changes that token's whole gradient path (seen: 1-6% of the choices on
 * an H200, all gradients 10-50% off). Dense routing keeps every continuous
 * part of the MoE (weights, normalisation, aux loss, permutation, grouped
 * GEMMs) and removes the discrete one, which the tiny model, the op tests
 * (exact idx) and the training run cover. */
static void demo_config(mt_model_config *c)
{
    mt_config_defaults(c);
    c->vocab_size = 64;
    c->hidden_size = 128;
    c->intermediate_size = 256;
    c->moe_intermediate_size = 64;
    c->num_hidden_layers = 2;
    c->num_attention_heads = 4;
    c->q_lora_rank = 64;
    c->kv_lora_rank = 64;
    c->qk_nope_head_dim = 32;
    c->qk_rope_head_dim = 16;
    c->v_head_dim = 32;
    c->n_routed_experts = 8;
    c->n_shared_experts = 1;
    c->num_experts_per_tok = 8;
    c->n_group = 4;
    c->topk_group = 4;
    c->first_k_dense_replace = 1;
    c->num_nextn_predict_layers = 1;
    c->max_position_embeddings = 1024;
    c->initializer_range = 0.1;
}

/* ---- 1. one micro-batch, forward and backward ----------------------------------------- */

static const char *recipe_name(mt_recipe r)
{
    return r == MT_RECIPE_FP8_BLOCKWISE ? "fp8" : r == MT_RECIPE_BF16 ? "bf16" : "fp32";
}

static mt_block *block_at(mt_model *m, int l)
{
    return l < m->n_blocks ? &m->blocks[l] : &m->mtp[l - m->n_blocks].block;
}

/* Host floats of an act buffer of backend s. */
static void get_act(int s, const void *p, int64_t n, float *host)
{
    mt_backend *be = BE[s];
    float *tmp;
    MUST(be->alloc(be, 4 * (size_t)n, (void **)&tmp));
    MUST(be->act_to_f32(be, tmp, p, n));
    MUST(be->download(be, host, tmp, 4 * (size_t)n));
    be->free(be, tmp);
}

typedef struct grad_err {
    double rel;
    int i;
} grad_err;

static int by_rel_desc(const void *a, const void *b)
{
    double x = ((const grad_err *)a)->rel, y = ((const grad_err *)b)->rel;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Tolerances of one comparison: loss (relative) and gradients (relative
 * norm error per tensor). */
typedef struct step_tol {
    double loss, grad;
} step_tol;

/* compare_step's gradient accumulators: f32, or bf16 (precision.grads). */
static int grads_bf16;

/* Parameter gradient p (n elements) of model m on side s, as f32. */
static void get_grad(int s, const mt_model *m, const mt_param *p, int64_t n, float *host)
{
    if (m->grad_type != MT_C_BF16) {
        MUST(BE[s]->download(BE[s], host, p->grad, sizeof(float) * (size_t)n));
        return;
    }
    uint16_t *h = malloc(2 * (size_t)n);
    MUST(BE[s]->download(BE[s], h, p->grad, 2 * (size_t)n));
    for (int64_t j = 0; j < n; j++) host[j] = mt_bf16_to_f32(h[j]);
    free(h);
}

static void compare_step(const char *model_name, const mt_model_config *c, mt_recipe recipe,
                         int B, int T, uint64_t seed, const char *paths, step_tol tol, int retries)
{
    mt_model_opts o;
    memset(&o, 0, sizeof o);
    o.recipe = recipe;
    o.micro_batch = B;
    o.seq_len = T;
    o.mtp_weight = 0.3;
    o.aux_alpha = 0.05;
    o.grads_bf16 = grads_bf16;
    const double gtol = tol.grad;
    char tag[128], what[200], msg[400];
    snprintf(tag, sizeof tag, "%s %s%s B%d T%d [%s]", model_name, recipe_name(recipe),
             grads_bf16 ? " bf16-grads" : "", B, T, paths);
    printf("---- model step: %s\n", tag);

    mt_model *m[2];
    for (int s = 0; s < 2; s++) {
        int rc = mt_model_create(&m[s], c, &o, BE[s]);
        if (rc != MT_OK) {
            snprintf(what, sizeof what, "%s: create on %s", tag, s ? "cuda" : "cpu");
            snprintf(msg, sizeof msg, "%s: %s", mt_strstatus(rc), mt_errmsg());
            verdict(0, what, msg);
            if (s) mt_model_destroy(m[0]);
            return;
        }
        MUST(mt_model_init_random(m[s], seed));
    }
    /* a non-zero router bias, so selection and weights differ */
    float *bias = malloc(sizeof(float) * (size_t)c->n_routed_experts);
    for (int e = 0; e < c->n_routed_experts; e++) bias[e] = 0.05f * (float)(e % 3);
    const int L = m[0]->n_blocks + m[0]->n_mtp;
    for (int l = 0; l < L; l++)
        if (block_at(m[0], l)->is_moe)
            for (int s = 0; s < 2; s++) MUST(mt_model_set_router_bias(m[s], l, bias));
    free(bias);

    /* compute copies of every parameter */
    int64_t mx = 1;
    for (int i = 0; i < m[0]->table.n; i++)
        if (mt_param_numel(&m[0]->table.p[i]) > mx) mx = mt_param_numel(&m[0]->table.p[i]);
    float *a = malloc(sizeof(float) * (size_t)mx), *b = malloc(sizeof(float) * (size_t)mx);
    int ndiff_t = 0, first_bad = -1;
    for (int i = 0; i < m[0]->table.n; i++) {
        const int64_t n = mt_param_numel(&m[0]->table.p[i]);
        MUST(mt_model_get_param(m[0], i, a));
        MUST(mt_model_get_param(m[1], i, b));
        if (memcmp(a, b, sizeof(float) * (size_t)n) != 0) {
            ndiff_t++;
            if (first_bad < 0) first_bad = i;
        }
    }
    snprintf(what, sizeof what, "%s: parameters' compute copies", tag);
    snprintf(msg, sizeof msg, "%d tensors, %d differ%s%s", m[0]->table.n, ndiff_t,
             first_bad >= 0 ? ", first " : "", first_bad >= 0 ? m[0]->table.p[first_bad].name : "");
    verdict(ndiff_t == 0, what, msg);

    /* one micro-batch */
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B * (T + 1));
    mt_rng r;
    mt_rng_seed(&r, seed + 100);
    for (int i = 0; i < B * (T + 1); i++) tok[i] = (int32_t)mt_rng_below(&r, (uint64_t)c->vocab_size);
    mt_mb_stats st[2];
    for (int s = 0; s < 2; s++) {
        MUST(mt_model_zero_grads(m[s]));
        int rc = mt_model_step(m[s], tok, 1, 1.0, &st[s]);
        if (rc != MT_OK) {
            snprintf(what, sizeof what, "%s: step on %s", tag, s ? "cuda" : "cpu");
            snprintf(msg, sizeof msg, "%s: %s", mt_strstatus(rc), mt_errmsg());
            verdict(0, what, msg);
            goto out;
        }
        MUST(BE[s]->sync(BE[s]));
    }
    /* expert selections. A token whose top-k differs between the backends
     * (a near tie in the router scores, moved by a last-bit difference
     * upstream) has other experts' outputs and gradients, which on a model
     * of 16 tokens moves every gradient by 10-40 % and the loss of its
     * layer by far more than the tolerance: the comparison only means
     * something where both chose the same experts. On the fast paths such a
     * step is reported and the comparison moves to the next seed (at most
     * `retries` times); the reference paths must agree outright. */
    int nflip = 0;
    const int NK = m[0]->ctx.N * c->num_experts_per_tok;
    int32_t *sel[2] = {malloc(4 * (size_t)NK), malloc(4 * (size_t)NK)};
    for (int l = 0; l < L; l++) {
        mt_block *b0 = block_at(m[0], l), *b1 = block_at(m[1], l);
        if (!b0->is_moe) continue;
        MUST(BE[0]->download(BE[0], sel[0], b0->moe.idx, 4 * (size_t)NK));
        MUST(BE[1]->download(BE[1], sel[1], b1->moe.idx, 4 * (size_t)NK));
        /* per token: the chosen set (sorted) and the order (descending score) */
        const int K = c->num_experts_per_tok;
        int nset = 0, norder = 0;
        for (int t = 0; t < m[0]->ctx.N; t++) {
            int32_t *x = sel[0] + (int64_t)t * K, *y = sel[1] + (int64_t)t * K;
            int same_order = memcmp(x, y, 4 * (size_t)K) == 0;
            for (int i = 0; i < K; i++) /* insertion sort both */
                for (int j = i; j > 0 && x[j] < x[j - 1]; j--) {
                    int32_t u = x[j]; x[j] = x[j - 1]; x[j - 1] = u;
                }
            for (int i = 0; i < K; i++)
                for (int j = i; j > 0 && y[j] < y[j - 1]; j--) {
                    int32_t u = y[j]; y[j] = y[j - 1]; y[j - 1] = u;
                }
            if (memcmp(x, y, 4 * (size_t)K) != 0)
                nset++, nflip++;
            else
                norder += !same_order;
        }
        printf("INFO  %s: MoE layer %d: %d of %d tokens chose other experts, %d the same in "
               "another order\n", tag, l, nset, m[0]->ctx.N, norder);
    }
    free(sel[0]), free(sel[1]);

    if (nflip > 0 && retries > 0) {
        printf("INFO  %s: seed %llu: %d token choices differ, comparing on seed %llu instead\n", tag,
               (unsigned long long)seed, nflip, (unsigned long long)(seed + 1));
        free(tok), free(a), free(b);
        mt_model_destroy(m[0]);
        mt_model_destroy(m[1]);
        compare_step(model_name, c, recipe, B, T, seed + 1, paths, tol, retries - 1);
        return;
    }
    const char *ln[4] = {"loss", "mtp_loss", "aux_loss", "total"};
    const double lc[4] = {st[0].loss, st[0].mtp_loss, st[0].aux_loss, st[0].total};
    const double lg[4] = {st[1].loss, st[1].mtp_loss, st[1].aux_loss, st[1].total};
    for (int k = 0; k < 4; k++) {
        double rel = fabs(lg[k] - lc[k]) / fmax(fabs(lc[k]), 1e-30);
        snprintf(what, sizeof what, "%s: %s", tag, ln[k]);
        snprintf(msg, sizeof msg, "cpu %.7f cuda %.7f rel %.2e (tol %.0e)", lc[k], lg[k], rel,
                 tol.loss);
        verdict(rel <= tol.loss || (lc[k] == 0 && lg[k] == 0), what, msg);
    }

    /* residual stream after each decoder layer (h[0]: embedding) */
    {
        const int64_t n = (int64_t)m[0]->ctx.N * c->hidden_size;
        float *hc = malloc(4 * (size_t)n), *hg = malloc(4 * (size_t)n);
        for (int l = 0; l <= m[0]->n_blocks; l++) {
            /* the whole model is one chunk in one slot (model.h) */
            get_act(0, m[0]->chunks[0].slots[0].h[l], n, hc);
            get_act(1, m[1]->chunks[0].slots[0].h[l], n, hg);
            double se = 0, sc = 0;
            int64_t nd = 0;
            for (int64_t j = 0; j < n; j++) {
                double d = (double)hg[j] - hc[j];
                se += d * d, sc += (double)hc[j] * hc[j];
                nd += hg[j] != hc[j];
            }
            printf("INFO  %s: residual h[%d]: rel %.2e, %lld of %lld values differ\n", tag, l,
                   sc > 0 ? sqrt(se / sc) : sqrt(se), (long long)nd, (long long)n);
        }
        free(hc), free(hg);
    }

    /* gradients */
    grad_err *errs = calloc((size_t)m[0]->table.n, sizeof *errs);
    int ne = 0, nbad = 0;
    double se_all = 0, sc_all = 0;
    for (int i = 0; i < m[0]->table.n; i++) {
        mt_param *p0 = &m[0]->params[i], *p1 = &m[1]->params[i];
        if (!p0->grad) continue; /* router bias */
        const int64_t n = mt_param_numel(&p0->d);
        get_grad(0, m[0], p0, n, a);
        get_grad(1, m[1], p1, n, b);
        double se = 0, sc = 0, worst = 0;
        int64_t wi = 0;
        for (int64_t j = 0; j < n; j++) {
            double d = (double)b[j] - (double)a[j];
            se += d * d;
            sc += (double)a[j] * a[j];
            if (!(fabs(d) <= worst)) worst = fabs(d), wi = j;
        }
        se_all += se, sc_all += sc;
        double rel = sc > 0 ? sqrt(se / sc) : sqrt(se);
        int ok = rel <= gtol;
        snprintf(what, sizeof what, "%s: grad %s", tag, p0->d.name);
        snprintf(msg, sizeof msg, "rel %.2e (tol %.0e) |cpu| %.3e max_abs %.2e at [%lld] cpu %.6g cuda %.6g",
                 rel, gtol, sqrt(sc), worst, (long long)wi, a[wi], b[wi]);
        verdict(ok, what, msg);
        nbad += !ok;
        errs[ne].rel = rel;
        errs[ne].i = i;
        ne++;
    }
    qsort(errs, (size_t)ne, sizeof *errs, by_rel_desc);
    printf("INFO  %s: %d gradients, %d over tolerance; all together rel %.2e; worst:", tag, ne,
           nbad, sc_all > 0 ? sqrt(se_all / sc_all) : 0.0);
    for (int k = 0; k < ne && k < 5; k++)
        printf(" %s %.2e%s", m[0]->table.p[errs[k].i].name, errs[k].rel, k + 1 < ne && k < 4 ? "," : "");
    printf("\n");
    free(errs);

    /* deferred zeroing (model.h): the step again on the cuda side from
     * gradient memory full of NaN, each linear weight's and the head's
     * first weight-gradient GEMM writing instead of adding to zeros: the
     * gradients just compared, bit for bit */
    {
        const size_t ge = mt_model_grad_size(m[1]), gbytes = (size_t)m[1]->n_grad * ge;
        unsigned char *g1 = malloc(gbytes), *g2 = malloc(gbytes);
        mt_mb_stats s2;
        MUST(BE[1]->download(BE[1], g1, m[1]->buf_grad, gbytes));
        memset(g2, 0xff, gbytes);
        MUST(BE[1]->upload(BE[1], m[1]->buf_grad, g2, gbytes));
        MUST(mt_model_zero_grads_deferred(m[1]));
        MUST(mt_model_step(m[1], tok, 1, 1.0, &s2));
        MUST(BE[1]->sync(BE[1]));
        MUST(BE[1]->download(BE[1], g2, m[1]->buf_grad, gbytes));
        int64_t nd = 0;
        for (int64_t j = 0; j < m[1]->n_grad; j++) nd += memcmp(g1 + j * ge, g2 + j * ge, ge) != 0;
        snprintf(what, sizeof what, "%s: deferred zeroing", tag);
        snprintf(msg, sizeof msg, "%lld of %lld gradient elements differ from the zeroed step's, "
                 "total %.9g against %.9g", (long long)nd, (long long)m[1]->n_grad, s2.total,
                 st[1].total);
        verdict(nd == 0 && s2.total == st[1].total, what, msg);
        free(g1), free(g2);
    }
out:
    free(tok), free(a), free(b);
    mt_model_destroy(m[0]);
    mt_model_destroy(m[1]);
}

/* ---- 2. training ------------------------------------------------------------------------- */

/* A first-order Markov corpus over V tokens (V - 1 is the end-of-document
 * token): each token has 4 preferred successors taking 85% of the mass, the
 * rest uniform; documents of 200..1200 tokens. Entropy about 2.1 nats
 * against ln 64 = 4.16 for uniform guessing: the demo model learns much of
 * it within 100 steps. */
static void write_corpus(const char *prefix, int V, int64_t tokens, uint64_t seed)
{
    mt_indexed_writer *w;
    MUST(mt_indexed_writer_create(prefix, mt_idx_dtype_for_vocab(V), &w));
    mt_rng r;
    mt_rng_seed(&r, seed);
    int32_t *doc = malloc(sizeof(int32_t) * 1200);
    int64_t done = 0;
    while (done < tokens) {
        int n = 200 + (int)mt_rng_below(&r, 1001);
        int32_t a = (int32_t)mt_rng_below(&r, (uint64_t)(V - 1));
        for (int i = 0; i < n; i++) {
            int32_t t;
            if (mt_rng_uniform(&r) < 0.85) {
                uint64_t h = mt_hash_u64(seed, (uint64_t)a * 4 + mt_rng_below(&r, 4));
                t = (int32_t)(h % (uint64_t)(V - 1));
            } else {
                t = (int32_t)mt_rng_below(&r, (uint64_t)(V - 1));
            }
            doc[i] = t;
            a = t;
        }
        doc[n - 1] = V - 1;
        MUST(mt_indexed_writer_add_document(w, doc, n));
        done += n;
    }
    MUST(mt_indexed_writer_finish(w));
    mt_indexed_writer_free(w);
    free(doc);
}

static double *train_curve(const char *examples, const char *corpus, const char *backend, int s,
                           int steps, double *secs)
{
    char path[1200], data[1200], st[64], be_set[64];
    snprintf(path, sizeof path, "%s/tiny-cpu.json", examples);
    snprintf(data, sizeof data, "data.path=%s", corpus);
    snprintf(st, sizeof st, "train.steps=%d", steps);
    snprintf(be_set, sizeof be_set, "backend=%s", backend);
    const char *sets[] = {data, st, be_set, "data.valid_interval=0", "lr_schedule.warmup_steps=10"};
    mt_jobspec j;
    int rc = mt_jobspec_load(&j, path, sets, 5);
    if (rc == MT_OK) rc = mt_jobspec_admit(&j, 1);
    if (rc != MT_OK) die("mt_jobspec_load(tiny-cpu.json)", rc);
    mt_trainer *t;
    rc = mt_trainer_create(&t, &j, BE[s]);
    if (rc != MT_OK) {
        char msg[400];
        snprintf(msg, sizeof msg, "%s: %s", mt_strstatus(rc), mt_errmsg());
        verdict(0, backend, msg);
        return NULL;
    }
    double *loss = calloc((size_t)steps, sizeof *loss), t0 = mt_now_s();
    for (int k = 0; k < steps; k++) {
        mt_step_metrics mm;
        rc = mt_trainer_step(t, &mm);
        if (rc != MT_OK) {
            char what[100], msg[400];
            snprintf(what, sizeof what, "training on %s: step %d", backend, k + 1);
            snprintf(msg, sizeof msg, "%s: %s", mt_strstatus(rc), mt_errmsg());
            verdict(0, what, msg);
            free(loss);
            mt_trainer_destroy(t);
            return NULL;
        }
        loss[k] = mm.loss;
    }
    *secs = mt_now_s() - t0;
    mt_trainer_destroy(t);
    return loss;
}

static void compare_training(const char *examples)
{
    printf("---- training: deploy/examples/tiny-cpu.json, 100 steps, cpu vs cuda\n");
    char tmp[1024], corpus[1100];
    mt_test_tmpdir(tmp, sizeof tmp, "test_model_cuda");
    snprintf(corpus, sizeof corpus, "%s/markov", tmp);
    write_corpus(corpus, 64, 400000, 77);
    const int steps = 100;
    double ts[2] = {0, 0};
    double *lc = train_curve(examples, corpus, "cpu", 0, steps, &ts[0]);
    double *lg = train_curve(examples, corpus, "cuda", 1, steps, &ts[1]);
    if (!lc || !lg) {
        free(lc), free(lg);
        return;
    }
    printf("INFO  step   loss cpu    loss cuda   rel diff   (%.1f s on cpu, %.1f s on cuda)\n",
           ts[0], ts[1]);
    for (int k = 0; k < steps; k++)
        if (k == 0 || (k + 1) % 10 == 0)
            printf("INFO  %4d   %.6f    %.6f    %.2e\n", k + 1, lc[k], lg[k],
                   fabs(lg[k] - lc[k]) / lc[k]);
    double c_last = 0, g_last = 0, g_first = 0;
    for (int k = 0; k < 10; k++) {
        c_last += lc[steps - 10 + k] / 10;
        g_last += lg[steps - 10 + k] / 10;
        g_first += lg[k] / 10;
    }
    char msg[300];
    double rel = fabs(g_last - c_last) / c_last;
    snprintf(msg, sizeof msg, "last-10 mean loss cpu %.5f cuda %.5f rel %.2e (tol 2e-2)", c_last,
             g_last, rel);
    verdict(rel <= 2e-2, "training: final loss cpu vs cuda", msg);
    snprintf(msg, sizeof msg, "first-10 mean %.5f -> last-10 mean %.5f (must drop by 0.3)",
             g_first, g_last);
    verdict(g_last < g_first - 0.3, "training: cuda run learns", msg);
    free(lc), free(lg);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) {
        fprintf(stderr, "usage: test_model_cuda EXAMPLES_DIR\n");
        return 1;
    }
    /* MT_TEST_GPU_IS_CPU=1: the "cuda" side is a second CPU backend, to
     * check this program itself on a machine without a GPU (all equal). */
    const char *fake = getenv("MT_TEST_GPU_IS_CPU");
    if (mt_cuda_device_count() == 0 && !(fake && *fake == '1')) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    MUST(mt_backend_cpu_create(&BE[0], 0));
    if (fake && *fake == '1')
        MUST(mt_backend_cpu_create(&BE[1], 0));
    else
        MUST(mt_backend_cuda_create(&BE[1], 0, (size_t)16 << 30));
    double t0 = mt_now_s();
    mt_model_config tiny, demo;
    mt_test_tiny_config(&tiny);
    demo_config(&demo);
    const mt_recipe recipes[2] = {MT_RECIPE_FP8_BLOCKWISE, MT_RECIPE_BF16};
    /* the backend's own choice of paths: cuBLASLt where it runs, cuDNN
     * attention where it builds */
    for (int r = 0; r < 2; r++) {
        int fp8 = recipes[r] == MT_RECIPE_FP8_BLOCKWISE;
        step_tol tt = {fp8 ? 1e-2 : 1e-3, fp8 ? 2e-1 : 3e-2}, td = {fp8 ? 3e-3 : 1e-3, fp8 ? 2e-1 : 3e-2};
        compare_step("tiny", &tiny, recipes[r], 2, 8, 7, "fast paths", tt, 3);
        compare_step("demo(top8 of 8)", &demo, recipes[r], 4, 128, 42, "fast paths", td, 3);
    }
    /* bf16 gradient accumulators (precision.grads bf16): the CPU rounds
     * after each accumulation as cuBLASLt's bf16 D does; the tolerances of
     * the f32 runs hold (bf16 storage adds ~2e-3 relative per rounding) */
    grads_bf16 = 1;
    for (int r = 0; r < 2; r++) {
        int fp8 = recipes[r] == MT_RECIPE_FP8_BLOCKWISE;
        step_tol td = {fp8 ? 3e-3 : 1e-3, fp8 ? 2e-1 : 3e-2};
        compare_step("demo(top8 of 8)", &demo, recipes[r], 4, 128, 42, "fast paths", td, 3);
    }
    grads_bf16 = 0;
    /* the reference paths: the GEMM fallback kernels (MOETRAIN_GEMM=fallback,
     * read when a backend is created) and the own attention kernels
     * (MOETRAIN_ATTN=own): fp32 SIMT arithmetic throughout, far closer to
     * the CPU, so a model-level bug cannot hide behind the fast paths'
     * rounding noise */
    if (!(fake && *fake == '1')) {
        mt_backend *fast = BE[1];
        setenv("MOETRAIN_GEMM", "fallback", 1);
        int rc = mt_backend_cuda_create(&BE[1], 0, (size_t)8 << 30);
        unsetenv("MOETRAIN_GEMM");
        if (rc != MT_OK) {
            char msg[400];
            snprintf(msg, sizeof msg, "%s: %s", mt_strstatus(rc), mt_errmsg());
            verdict(0, "reference paths: second CUDA backend", msg);
            BE[1] = fast;
        } else {
            setenv("MOETRAIN_ATTN", "own", 1);
            for (int r = 0; r < 2; r++) {
                int fp8 = recipes[r] == MT_RECIPE_FP8_BLOCKWISE;
                step_tol tr = {1e-3, fp8 ? 6e-2 : 1.5e-2};
                compare_step("tiny", &tiny, recipes[r], 2, 8, 7, "reference paths", tr, 0);
                compare_step("demo(top8 of 8)", &demo, recipes[r], 4, 128, 42, "reference paths", tr, 0);
            }
            unsetenv("MOETRAIN_ATTN");
            BE[1]->destroy(BE[1]);
            BE[1] = fast;
        }
    }
    compare_training(argv[1]);
    printf("==== test_model_cuda: %d passed, %d failed (%.1f s)\n", n_pass, n_fail, mt_now_s() - t0);
    BE[1]->destroy(BE[1]);
    BE[0]->destroy(BE[0]);
    return n_fail ? 1 : 0;
}
