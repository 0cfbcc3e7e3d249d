/* bench_ops_cuda.c - per-op throughput of the CUDA backend at DeepSeek-V3
 * shapes, against the ceilings measured on the same kind of GPU.
 *
 *   bench_ops_cuda [--iters N] [--only gemm|wgrad|mem|optim]
 *
 * GEMMs (forward shapes, then weight gradients) print TFLOPS and the ratio
 * to the FP8 block-scaled (1240-1440) or BF16 (890) ceilings; memory-bound
 * ops (rmsnorm_bwd and rope at the proxy shapes too) and the optimizer
 * print GB/s (bytes read + written once) and the
 * ratio to a device-to-device copy measured here. MOETRAIN_FP8_GEMM=
 * direct|swap compares the FP8 operand orders, =own the grouped FP8
 * kernel (kernels/cuda/cuda_gemm.cu, cuda_fp8_grouped.cu). Timing: wall time
 * of N back-to-back calls after warm-up and a synchronisation, median of 5.
 * Results: tests/bench/RESULTS.md.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/mt_clock.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "kernels/ops.h"

static mt_backend *be;
static int iters = 10;
#define CK(x)                                                                  \
    do {                                                                       \
        if ((x) < 0) {                                                         \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, mt_errmsg());   \
            exit(2);                                                           \
        }                                                                      \
    } while (0)

/* Random f32 values on the device: a block of 2^20 normal draws repeated. */
static float *dev_random_f32(int64_t n, uint64_t seed, float scale)
{
    enum { BLK = 1 << 20 };
    float *h = malloc((size_t)n * 4), *d;
    for (int64_t i = 0; i < n && i < BLK; i++) h[i] = scale * (float)mt_hash_normal(seed, (uint64_t)i);
    for (int64_t i = BLK; i < n; i += BLK) memcpy(h + i, h, (size_t)(n - i < BLK ? n - i : BLK) * 4);
    CK(be->alloc(be, (size_t)n * 4, (void **)&d));
    CK(be->upload(be, d, h, (size_t)n * 4));
    free(h);
    return d;
}

/* Random act values: a block of 2^20 normal draws repeated (throughput does
 * not depend on the values, only on them not being zeros). */
static void *dev_random_act(int64_t n, uint64_t seed, float scale)
{
    float *d = dev_random_f32(n, seed, scale);
    void *a;
    CK(be->alloc(be, (size_t)n * 2, &a));
    CK(be->act_from_f32(be, a, d, n));
    be->free(be, d);
    return a;
}

static void *dev_alloc(size_t bytes)
{
    void *p;
    CK(be->alloc(be, bytes, &p));
    return p;
}

/* Median milliseconds per call of fn over `iters` back-to-back calls (the
 * host only enqueues; one synchronisation per repeat), 5 repeats. */
typedef void (*op_fn)(void *ctx);
static double time_ms(op_fn fn, void *ctx)
{
    for (int i = 0; i < 3; i++) fn(ctx);
    CK(be->sync(be));
    double t[5];
    for (int r = 0; r < 5; r++) {
        double t0 = mt_now_s();
        for (int i = 0; i < iters; i++) fn(ctx);
        CK(be->sync(be));
        t[r] = (mt_now_s() - t0) * 1e3 / iters;
    }
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (t[j] < t[i]) {
                double x = t[i];
                t[i] = t[j];
                t[j] = x;
            }
    return t[2];
}

/* Row counts of G segments averaging `per` rows: equal, or (skew) the
 * routed experts' unequal loads as the DeepSeek-V3 proxy sees them (up to
 * 4x the mean in its early steps: weights 4 1 2 1 3 1 2 repeated), each
 * rounded to whole 128-row tiles as the fp8 recipe pads them. Returns the
 * total. */
static int64_t bench_rows(int *rows, int G, int per, int skew)
{
    static const int weight[7] = {4, 1, 2, 1, 3, 1, 2}; /* mean 2; 7: not a stream pattern */
    int64_t total = 0;
    for (int g = 0; g < G; g++) {
        rows[g] = skew ? (int)(((int64_t)per * weight[g % 7] / 2 + 127) / 128 * 128) : per;
        total += rows[g];
    }
    return total;
}

/* ---- GEMMs ----------------------------------------------------------------- */

typedef struct gemm_ctx {
    int fp8, M, N, K, G, acc; /* acc: C += (the backward's data gradients) */
    void *A, *B, *C;
    uint8_t *qa, *qb;
    float *sa, *sb;
    int *rows;
} gemm_ctx;

static void run_gemm(void *p)
{
    gemm_ctx *g = p;
    if (!g->fp8) {
        CK(be->gemm(be, g->C, 0, g->N, g->A, g->K, 0, g->B, g->K, 0, g->M, g->N, g->K, 1.0f, 0));
        return;
    }
    int64_t bstride = (int64_t)g->N * g->K, sstride = (int64_t)((g->N + 127) / 128) * ((g->K + 127) / 128);
    CK(be->gemm_fp8(be, 0, g->C, 0, g->N, 0, g->qa, g->sa, g->qb, g->sb, bstride, sstride, g->rows,
                    g->G, g->N, g->K, g->acc));
}

static void bench_gemm_rows(const char *what, int fp8, int M, int N, int K, int G, int skew,
                            int acc, double ceiling)
{
    gemm_ctx g = {fp8, M, N, K, G, acc, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    g.rows = malloc((size_t)G * sizeof *g.rows);
    const int64_t Mt = bench_rows(g.rows, G, M, skew);
    g.A = dev_random_act(Mt * K, 1, 1.0f);
    g.B = dev_random_act((int64_t)G * N * K, 2, 0.02f);
    g.C = dev_alloc((size_t)Mt * N * 2);
    if (fp8) {
        const int KB = (K + 127) / 128, NB = (N + 127) / 128;
        float *wf = dev_alloc((size_t)N * K * 4);
        g.qa = dev_alloc((size_t)Mt * K);
        g.sa = dev_alloc((size_t)Mt * KB * 4);
        g.qb = dev_alloc((size_t)G * N * K);
        g.sb = dev_alloc((size_t)G * NB * KB * 4);
        CK(be->quant_rows(be, g.qa, g.sa, g.A, K, g.rows, G, K));
        for (int e = 0; e < G; e++) {
            CK(be->act_to_f32(be, wf, (char *)g.B + (size_t)e * N * K * 2, (int64_t)N * K));
            CK(be->quant_blocks(be, g.qb + (size_t)e * N * K, g.sb + (size_t)e * NB * KB, wf, N, K));
        }
        be->free(be, wf);
    }
    double ms = time_ms(run_gemm, &g);
    double tf = 2.0 * Mt * N * K / (ms * 1e-3) / 1e12;
    printf("  %-34s M=%-6d N=%-6d K=%-6d G=%-3d %8.3f ms %7.1f TFLOPS  %4.0f%% of %4.0f\n", what, M,
           N, K, G, ms, tf, 100 * tf / ceiling, ceiling);
    be->free(be, g.A);
    be->free(be, g.B);
    be->free(be, g.C);
    if (fp8) {
        be->free(be, g.qa);
        be->free(be, g.sa);
        be->free(be, g.qb);
        be->free(be, g.sb);
    }
    free(g.rows);
}

static void bench_gemm(const char *what, int fp8, int M, int N, int K, int G, double ceiling)
{
    bench_gemm_rows(what, fp8, M, N, K, G, 0, 0, ceiling);
}

/* Weight gradients: dW[g] (fp32, [N, K]) += dy_g^T x_g over M tokens per group,
 * both operands re-quantised 128x1 along the tokens, as engine/model/linear.c does.
 * The fp32 read-modify-write of dW is part of the time. */
typedef struct wgrad_ctx {
    int M, N, K, G;
    uint8_t *dyt, *xt;
    float *dyts, *xts, *dw;
    int *rows;
} wgrad_ctx;

static void run_wgrad(void *p)
{
    wgrad_ctx *w = p;
    CK(be->gemm_fp8(be, 1, w->dw, 1, w->K, (int64_t)w->N * w->K, w->dyt, w->dyts, w->xt, w->xts,
                    0, 0, w->rows, w->G, w->N, w->K, 1));
}

static void bench_wgrad(const char *what, int M, int N, int K, int G, int skew, double ceiling)
{
    wgrad_ctx w = {M, N, K, G, NULL, NULL, NULL, NULL, NULL, NULL};
    w.rows = malloc((size_t)G * sizeof *w.rows);
    const int64_t Mt = bench_rows(w.rows, G, M, skew);
    int64_t tiles = 0;
    for (int i = 0; i < G; i++) tiles += (w.rows[i] + 127) / 128;
    void *dy = dev_random_act(Mt * N, 3, 1.0f), *x = dev_random_act(Mt * K, 4, 1.0f);
    w.dyt = dev_alloc((size_t)(Mt * N));
    w.xt = dev_alloc((size_t)(Mt * K));
    w.dyts = dev_alloc((size_t)(tiles * N * 4));
    w.xts = dev_alloc((size_t)(tiles * K * 4));
    w.dw = dev_alloc((size_t)G * N * K * 4);
    CK(be->zero(be, w.dw, (size_t)G * N * K * 4));
    CK(be->quant_cols_t(be, w.dyt, w.dyts, dy, N, w.rows, G, N));
    CK(be->quant_cols_t(be, w.xt, w.xts, x, K, w.rows, G, K));
    double ms = time_ms(run_wgrad, &w);
    double tf = 2.0 * Mt * N * K / (ms * 1e-3) / 1e12;
    printf("  %-34s M=%-6d N=%-6d K=%-6d G=%-3d %8.3f ms %7.1f TFLOPS  %4.0f%% of %4.0f\n", what, M,
           N, K, G, ms, tf, 100 * tf / ceiling, ceiling);
    void *bufs[] = {dy, x, w.dyt, w.xt, w.dyts, w.xts, w.dw};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(be, bufs[i]);
    free(w.rows);
}

/* ---- memory-bound ops ------------------------------------------------------------ */

typedef struct mem_ctx {
    int kind, M, D;
    void *x, *y, *w;
    uint8_t *q;
    float *s, *rstd, *dw;
    void *x2;
    int rows[1];
    const int *grows; /* kinds 6, 7, 10: G segments */
    int G;
    uint8_t *q2; /* kinds 9, 10: the transposed form */
    float *s2;
} mem_ctx;

static void run_mem(void *p)
{
    mem_ctx *c = p;
    switch (c->kind) {
    case 0: CK(be->copy(be, c->y, c->x, (size_t)c->M * c->D * 2)); break;
    case 1: CK(be->quant_rows(be, c->q, c->s, c->x, c->D, c->rows, 1, c->D)); break;
    case 2: CK(be->quant_cols_t(be, c->q, c->s, c->x, c->D, c->rows, 1, c->D)); break;
    case 3: CK(be->rmsnorm_fwd(be, c->y, c->D, c->rstd, c->x, c->D, c->w, c->M, c->D, 1e-6f)); break;
    case 4: CK(be->swiglu_fwd(be, c->y, c->x, c->M, c->D / 2)); break;
    case 5: /* the residual stream's norms: dx += */
        CK(be->rmsnorm_bwd(be, c->y, c->D, 1, c->dw, MT_C_F32, c->x, c->D, c->x2, c->D, c->w,
                           c->rstd, c->M, c->D));
        break;
    case 6: CK(be->quant_rows(be, c->q, c->s, c->x, c->D, c->grows, c->G, c->D)); break;
    case 7: CK(be->quant_cols_t(be, c->q, c->s, c->x, c->D, c->grows, c->G, c->D)); break;
    case 9:
        CK(be->quant_rows_cols_t(be, c->q, c->s, c->q2, c->s2, c->x, c->D, c->rows, 1, c->D));
        break;
    case 10:
        CK(be->quant_rows_cols_t(be, c->q, c->s, c->q2, c->s2, c->x, c->D, c->grows, c->G, c->D));
        break;
    case 8: /* in place: from the second call on, softmax of the last gradient */
        CK(be->xent(be, c->rstd, c->x, (const int32_t *)c->y, c->M, c->D, -100, 1.0f / c->M));
        break;
    }
}

static double copy_gbs;

static void bench_mem(const char *what, int kind, int M, int D, double bytes)
{
    mem_ctx c = {kind, M, D, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, {M}, NULL, 0, NULL, NULL};
    c.x = dev_random_act((int64_t)M * D, 3, 1.0f);
    c.x2 = kind == 5 ? dev_random_act((int64_t)M * D, 5, 1.0f) : NULL;
    c.dw = dev_alloc((size_t)D * 4);
    CK(be->zero(be, c.dw, (size_t)D * 4));
    /* rmsnorm_bwd's dx is accumulated into: random values */
    c.y = kind == 5 ? dev_random_act((int64_t)M * D, 7, 1.0f) : dev_alloc((size_t)M * D * 2);
    if (kind == 8) { /* targets: row m -> m * 7919 % D */
        int32_t *t = malloc((size_t)M * 4);
        for (int m = 0; m < M; m++) t[m] = (int32_t)((int64_t)m * 7919 % D);
        CK(be->upload(be, c.y, t, (size_t)M * 4));
        free(t);
    }
    c.w = dev_random_act(D, 4, 1.0f);
    c.q = dev_alloc((size_t)M * D);
    c.s = dev_alloc((size_t)(M + 128) * (D / 128 + 2) * 4);
    c.rstd = dev_alloc((size_t)M * 4);
    if (kind == 9) {
        c.q2 = dev_alloc((size_t)M * D);
        c.s2 = dev_alloc((size_t)(M + 128) * (D / 128 + 2) * 4);
    }
    {
        float *r = malloc((size_t)M * 4);
        for (int m = 0; m < M; m++) r[m] = 0.05f;
        CK(be->upload(be, c.rstd, r, (size_t)M * 4));
        free(r);
    }
    double ms = time_ms(run_mem, &c);
    double gbs = bytes / (ms * 1e-3) / 1e9;
    if (kind == 0) copy_gbs = gbs;
    printf("  %-34s M=%-6d D=%-6d %8.3f ms %7.0f GB/s  %4.0f%% of copy\n", what, M, D, ms, gbs,
           copy_gbs > 0 ? 100 * gbs / copy_gbs : 100.0);
    be->free(be, c.x);
    be->free(be, c.y);
    be->free(be, c.w);
    be->free(be, c.q);
    be->free(be, c.s);
    be->free(be, c.rstd);
    be->free(be, c.dw);
    if (c.q2) be->free(be, c.q2);
    if (c.s2) be->free(be, c.s2);
    if (c.x2) be->free(be, c.x2);
}

/* The quantisers on the routed experts' rows as the MoE layer lays them out:
 * 32 segments of unequal size (the proxy's load reaches 4x the mean), each
 * padded with zero rows to whole 128-row tiles, values of magnitude `scale`
 * (1: activations; 1e-7: the gradients' range). Bytes: the tokens' rows
 * only, as the op profile counts them. */
static void bench_mem_grouped(const char *what, int kind, int tokens, int D, float scale)
{
    enum { G = 32 };
    static const int weight[8] = {4, 1, 2, 1, 1, 3, 1, 1}; /* sums to 14 */
    int tok[G], rows[G], M = 0, used = 0;
    for (int g = 0; g < G; g++) {
        tok[g] = g == G - 1 ? tokens - used : (int)((int64_t)tokens * weight[g % 8] / (14 * 4));
        used += tok[g];
        rows[g] = (tok[g] + 127) / 128 * 128;
        M += rows[g];
    }
    mem_ctx c = {kind, M, D, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, {M}, rows, G, NULL, NULL};
    c.x = dev_random_act((int64_t)M * D, 3, scale);
    for (int g = 0, r0 = 0; g < G; r0 += rows[g], g++)
        if (rows[g] > tok[g])
            CK(be->zero(be, (char *)c.x + (size_t)(r0 + tok[g]) * D * 2,
                        (size_t)(rows[g] - tok[g]) * D * 2));
    c.q = dev_alloc((size_t)M * D);
    c.s = dev_alloc((size_t)(M + 128) * (D / 128 + 2) * 4);
    if (kind == 10) { /* both forms: 4 bytes an element */
        c.q2 = dev_alloc((size_t)M * D);
        c.s2 = dev_alloc((size_t)(M + 128) * (D / 128 + 2) * 4);
    }
    double ms = time_ms(run_mem, &c);
    double gbs = (kind == 10 ? 4.0 : 3.0) * tokens * D / (ms * 1e-3) / 1e9;
    printf("  %-34s M=%-6d D=%-6d %8.3f ms %7.0f GB/s  %4.0f%% of copy\n", what, M, D, ms, gbs,
           copy_gbs > 0 ? 100 * gbs / copy_gbs : 100.0);
    be->free(be, c.x);
    be->free(be, c.q);
    be->free(be, c.s);
    if (c.q2) be->free(be, c.q2);
    if (c.s2) be->free(be, c.s2);
}

/* RoPE in place on the rope slices of N tokens: H heads of hs values
 * (rows of H hs), the R rotated ones at off; interleaved pairs (the HF
 * default). GB/s counts 4 N H R bytes (the slices read and written), as the
 * op profile does. */
typedef struct rope_ctx {
    int N, T, H, hs, off, R;
    void *x;
    float *c, *s;
} rope_ctx;

static void run_rope(void *p)
{
    rope_ctx *r = p;
    CK(be->rope(be, r->x, r->N, r->T, r->H, r->H * r->hs, r->hs, r->off, r->R, r->c, r->s, 1, 0));
}

static void bench_rope(const char *what, int N, int H, int hs, int off, int R)
{
    rope_ctx r = {N, N, H, hs, off, R, NULL, NULL, NULL};
    r.x = dev_random_act((int64_t)N * H * hs, 6, 1.0f);
    const size_t nt = (size_t)N * (R / 2);
    float *h = malloc(nt * 4 * 2);
    for (size_t i = 0; i < nt; i++) { /* a rotation: the values stay bounded */
        const double ang = 0.001 * (double)i;
        h[i] = (float)cos(ang), h[nt + i] = (float)sin(ang);
    }
    r.c = dev_alloc(nt * 4);
    r.s = dev_alloc(nt * 4);
    CK(be->upload(be, r.c, h, nt * 4));
    CK(be->upload(be, r.s, h + nt, nt * 4));
    free(h);
    double ms = time_ms(run_rope, &r);
    const double gbs = 4.0 * N * H * R / (ms * 1e-3) / 1e9;
    printf("  %-34s N=%-6d H=%-6d %8.3f ms %7.0f GB/s  %4.0f%% of copy\n", what, N, H, ms, gbs,
           copy_gbs > 0 ? 100 * gbs / copy_gbs : 100.0);
    be->free(be, r.x);
    be->free(be, r.c);
    be->free(be, r.s);
}

/* ---- optimizer ------------------------------------------------------------------ */

/* AdamW of one FP8 weight [N, K] with an fp32 main copy: the three ops
 * (adamw, quant_blocks, transpose_blocks) against the fused adamw_fp8.
 * GB/s counts the fused op's traffic, 22 bytes per parameter (grad f32,
 * main f32 read + write, m and v bf16 read + write, q and qt written).
 * fused = 2: adamw_fp8_sr, the weight with no main copy (main_params none)
 * and bf16 gradients, as the proxy's H100 setting runs it: 13 bytes per
 * parameter (q read + written, qt written, m and v bf16 read + written,
 * the gradient read). */
typedef struct optim_ctx {
    int N, K, fused;
    float *p, *g, *s, *st;
    uint16_t *m, *v;
    uint8_t *q, *qt;
} optim_ctx;

static void run_optim(void *p)
{
    optim_ctx *o = p;
    mt_adamw_hp hp = {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 0.5f, 1.0f, 0};
    if (o->fused == 2) {
        hp.grad_bf16 = 1;
        CK(be->adamw_fp8_sr(be, o->q, o->s, o->m, o->v, o->g, o->N, o->K, &hp, 0x5eed, o->N,
                            o->qt, o->st));
        return;
    }
    if (o->fused) {
        CK(be->adamw_fp8(be, o->p, 0, o->m, o->v, o->g, o->N, o->K, &hp, o->q, o->s, o->qt, o->st));
        return;
    }
    CK(be->adamw(be, o->p, 0, o->m, o->v, o->g, (int64_t)o->N * o->K, &hp, NULL));
    CK(be->quant_blocks(be, o->q, o->s, o->p, o->N, o->K));
    CK(be->transpose_blocks(be, o->qt, o->st, o->q, o->s, o->N, o->K));
}

static void bench_optim(const char *what, int N, int K, int fused)
{
    const int64_t n = (int64_t)N * K, nsc = (int64_t)((N + 127) / 128) * ((K + 127) / 128);
    optim_ctx o = {N, K, fused, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    /* weights and gradients of a trained model's scale: zeros would time
     * the divisions' zero paths instead (the moments start at zero and are
     * not after the warm-up calls) */
    o.p = dev_random_f32(n, 11, 0.02f);
    o.g = fused == 2 ? dev_random_act(n, 12, 1e-4f) : dev_random_f32(n, 12, 1e-4f);
    o.m = dev_alloc((size_t)n * 2);
    o.v = dev_alloc((size_t)n * 2);
    o.q = dev_alloc((size_t)n);
    o.qt = dev_alloc((size_t)n);
    o.s = dev_alloc((size_t)nsc * 4);
    o.st = dev_alloc((size_t)nsc * 4);
    CK(be->zero(be, o.m, (size_t)n * 2));
    CK(be->zero(be, o.v, (size_t)n * 2));
    if (fused == 2) CK(be->quant_blocks(be, o.q, o.s, o.p, N, K));
    double ms = time_ms(run_optim, &o);
    const double bytes = (fused == 2 ? 13.0 : 22.0) * n, gbs = bytes / (ms * 1e-3) / 1e9;
    printf("  %-34s N=%-6d K=%-6d %8.3f ms %7.0f GB/s  %4.0f%% of copy\n", what, N, K, ms, gbs,
           copy_gbs > 0 ? 100 * gbs / copy_gbs : 0);
    void *bufs[] = {o.p, o.g, o.m, o.v, o.q, o.qt, o.s, o.st};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(be, bufs[i]);
}

/* One MoE layer's experts with no main copy: E weights [N, K] updated by
 * adamw_fp8_sr one call after another (one_call = 0, as the optimizer did)
 * or by one adamw_fp8_sr_n (the calls overlap on the expert streams); 13
 * bytes a parameter as above. */
typedef struct experts_ctx {
    int E, N, K, one_call;
    void *g; /* bf16 gradients */
    uint16_t *m, *v;
    uint8_t *q, *qt;
    float *s, *st;
    mt_adamw_fp8_sr_arg *a;
} experts_ctx;

static void run_experts(void *p)
{
    experts_ctx *o = p;
    mt_adamw_hp hp = {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 0.5f, 1.0f, 1};
    if (o->one_call) {
        CK(be->adamw_fp8_sr_n(be, o->E, o->a, &hp));
        return;
    }
    for (int e = 0; e < o->E; e++) {
        const mt_adamw_fp8_sr_arg *w = &o->a[e];
        CK(be->adamw_fp8_sr(be, w->q, w->s, w->m, w->v, w->grad, w->N, w->K, &hp, w->seed,
                            w->slab_rows, w->qt, w->st));
    }
}

static void bench_optim_experts(const char *what, int E, int N, int K, int one_call)
{
    const int64_t n = (int64_t)N * K, nsc = (int64_t)((N + 127) / 128) * ((K + 127) / 128);
    experts_ctx o = {E, N, K, one_call, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    float *w0 = dev_random_f32(n, 11, 0.02f);
    o.g = dev_random_act(n * E, 12, 1e-4f);
    o.m = dev_alloc((size_t)(n * E) * 2);
    o.v = dev_alloc((size_t)(n * E) * 2);
    o.q = dev_alloc((size_t)(n * E));
    o.qt = dev_alloc((size_t)(n * E));
    o.s = dev_alloc((size_t)(nsc * E) * 4);
    o.st = dev_alloc((size_t)(nsc * E) * 4);
    CK(be->zero(be, o.m, (size_t)(n * E) * 2));
    CK(be->zero(be, o.v, (size_t)(n * E) * 2));
    o.a = malloc((size_t)E * sizeof *o.a);
    if (!o.a) exit(1);
    for (int e = 0; e < E; e++) {
        CK(be->quant_blocks(be, o.q + n * e, o.s + nsc * e, w0, N, K));
        o.a[e] = (mt_adamw_fp8_sr_arg){
            .q = o.q + n * e, .s = o.s + nsc * e, .m = o.m + n * e, .v = o.v + n * e,
            .grad = (const uint16_t *)o.g + n * e, .N = N, .K = K, .weight_decay = 0.1f,
            .seed = 0x5eedull + (uint64_t)e, .slab_rows = N, .qt = o.qt + n * e,
            .st = o.st + nsc * e};
    }
    double ms = time_ms(run_experts, &o);
    const double gbs = 13.0 * n * E / (ms * 1e-3) / 1e9;
    printf("  %-34s E=%-4d N=%-6d K=%-6d %8.3f ms %7.0f GB/s  %4.0f%% of copy\n", what, E, N, K, ms,
           gbs, copy_gbs > 0 ? 100 * gbs / copy_gbs : 0);
    void *bufs[] = {w0, o.g, o.m, o.v, o.q, o.qt, o.s, o.st};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) be->free(be, bufs[i]);
    free(o.a);
}

/* The optimizer's passes outside adamw_fp8 at the proxy's sizes: sumsq over
 * n bf16 gradients (2 bytes an element read), adamw of an f32 main copy
 * with bf16 gradients (18 bytes: main read + written, m and v bf16 read +
 * written, the gradient read). */
typedef struct pass_ctx {
    int64_t n;
    int sumsq;
    float *p, *out;
    uint16_t *g, *m, *v;
} pass_ctx;

static void run_pass(void *ctx)
{
    pass_ctx *c = ctx;
    mt_adamw_hp hp = {1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 0.5f, 1.0f, 1};
    if (c->sumsq) CK(be->sumsq(be, c->out, c->g, 1, c->n));
    else CK(be->adamw(be, c->p, 0, c->m, c->v, c->g, c->n, &hp, NULL));
}

static void bench_pass(const char *what, int sumsq, int64_t n)
{
    pass_ctx c = {n, sumsq, NULL, NULL, NULL, NULL, NULL};
    c.g = dev_random_act(n, 9, 1e-3f);
    c.out = dev_alloc(4);
    if (!sumsq) {
        c.p = dev_random_f32(n, 13, 0.02f);
        c.m = dev_alloc((size_t)n * 2);
        c.v = dev_alloc((size_t)n * 2);
        CK(be->zero(be, c.m, (size_t)n * 2));
        CK(be->zero(be, c.v, (size_t)n * 2));
    }
    const double ms = time_ms(run_pass, &c), gbs = (sumsq ? 2.0 : 18.0) * n / (ms * 1e-3) / 1e9;
    printf("  %-34s n=%-13lld %8.3f ms %7.0f GB/s  %4.0f%% of copy\n", what, (long long)n, ms, gbs,
           copy_gbs > 0 ? 100 * gbs / copy_gbs : 0);
    void *bufs[] = {c.g, c.out, c.p, c.m, c.v};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
}

int main(int argc, char **argv)
{
    const char *only = NULL; /* gemm | wgrad | mem | optim */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else {
            fprintf(stderr, "usage: bench_ops_cuda [--iters N] [--only gemm|wgrad|mem|optim]\n");
            return 1;
        }
    }
#define SECTION(name) (!only || !strcmp(only, name))
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (mt_cuda_device_count() <= 0) {
        fprintf(stderr, "bench_ops_cuda: no CUDA device\n");
        return 77;
    }
    CK(mt_backend_cuda_create(&be, 0, (size_t)40 << 30));
    if (SECTION("gemm")) {
        const char *order = getenv("MOETRAIN_FP8_GEMM");
        printf("GEMMs (DeepSeek-V3 proxy shapes, 4096 tokens; FP8 operand order: %s)\n",
               !order || !strcmp(order, "auto") ? "auto (direct below K 4096 and for weight gradients)"
               : !strcmp(order, "swap")         ? "swapped, C^T transposed"
                                                : order);
        bench_gemm("bf16 8192^3 (ceiling check)", 0, 8192, 8192, 8192, 1, 890);
        bench_gemm("fp8 8192^3", 1, 8192, 8192, 8192, 1, 1340);
        bench_gemm("fp8 q_a  [4096,7168]x[1536]", 1, 4096, 1536, 7168, 1, 1340);
        bench_gemm("fp8 q_b  [4096,1536]x[24576]", 1, 4096, 24576, 1536, 1, 1340);
        bench_gemm("fp8 kv_b [4096,512]x[32768]", 1, 4096, 32768, 512, 1, 1340);
        bench_gemm("fp8 o    [4096,16384]x[7168]", 1, 4096, 7168, 16384, 1, 1340);
        bench_gemm("fp8 dense gate [4096,7168]x[18432]", 1, 4096, 18432, 7168, 1, 1340);
        bench_gemm("fp8 dense down [4096,18432]x[7168]", 1, 4096, 7168, 18432, 1, 1340);
        bench_gemm("fp8 experts gate 32x[1024,7168]x[2048]", 1, 1024, 2048, 7168, 32, 1340);
        bench_gemm("fp8 experts down 32x[1024,2048]x[7168]", 1, 1024, 7168, 2048, 32, 1340);
        bench_gemm("fp8 experts gate 32x[2048,7168]x[2048]", 1, 2048, 2048, 7168, 32, 1340);
        bench_gemm("fp8 experts down 32x[2048,2048]x[7168]", 1, 2048, 7168, 2048, 32, 1340);
        /* the proxy's unequal loads, 2048 rows an expert on average */
        bench_gemm_rows("fp8 experts gate, unequal loads", 1, 2048, 2048, 7168, 32, 1, 0, 1340);
        bench_gemm_rows("fp8 experts down, unequal loads", 1, 2048, 7168, 2048, 32, 1, 0, 1340);
        /* accumulating into bf16 C, as the backward's data gradients do
         * (C's read is part of the time): the experts' dx of the gate
         * projection, the attention's dx of q_a */
        bench_gemm_rows("fp8 experts dx +=, unequal loads", 1, 2048, 7168, 2048, 32, 1, 1, 1340);
        bench_gemm_rows("fp8 q_a dx += [4096,1536]x[7168]", 1, 4096, 7168, 1536, 1, 0, 1, 1340);
        bench_gemm("bf16 head [4096,7168]x[129280]", 0, 4096, 129280, 7168, 1, 890);
    }
    if (SECTION("wgrad")) {
        printf("weight gradients (fp8, fp32 dW accumulated)\n");
        bench_wgrad("wgrad o    [7168,16384] over 4096", 4096, 7168, 16384, 1, 0, 1340);
        bench_wgrad("wgrad dense gate [18432,7168]", 4096, 18432, 7168, 1, 0, 1340);
        bench_wgrad("wgrad experts gate 32x[2048,7168]", 1024, 2048, 7168, 32, 0, 1340);
        bench_wgrad("wgrad experts down 32x[7168,2048]", 1024, 7168, 2048, 32, 0, 1340);
        /* the proxy's unequal loads, 2048 rows an expert on average */
        bench_wgrad("wgrad experts gate, unequal loads", 2048, 2048, 7168, 32, 1, 1340);
        bench_wgrad("wgrad experts down, unequal loads", 2048, 7168, 2048, 32, 1, 1340);
    }
    if (SECTION("mem") || SECTION("optim")) {
        printf("memory-bound ops (bf16 activations)\n");
        bench_mem("d2d copy (ceiling check)", 0, 4096, 7168, 2.0 * 4096 * 7168 * 2);
    }
    if (SECTION("mem")) {
        bench_mem("quant_rows 1x128", 1, 4096, 7168, 4096.0 * 7168 * 3);
        bench_mem("quant_cols_t 128x1", 2, 4096, 7168, 4096.0 * 7168 * 3);
        /* the proxy's routed-expert rows (8192 tokens x top-8) */
        bench_mem("quant_rows experts' x", 1, 65536, 7168, 65536.0 * 7168 * 3);
        bench_mem("quant_cols_t experts' x", 2, 65536, 7168, 65536.0 * 7168 * 3);
        bench_mem("quant_rows experts' dy", 1, 65536, 2048, 65536.0 * 2048 * 3);
        bench_mem("quant_cols_t experts' dy", 2, 65536, 2048, 65536.0 * 2048 * 3);
        bench_mem_grouped("quant_rows 32 segments x", 6, 65536, 7168, 1.0f);
        bench_mem_grouped("quant_cols_t 32 segments x", 7, 65536, 7168, 1.0f);
        bench_mem_grouped("quant_cols_t 32 segments dy 1e-7", 7, 65536, 7168, 1e-7f);
        bench_mem_grouped("quant_cols_t 32 segments dy 1e-7", 7, 65536, 2048, 1e-7f);
        /* both forms of dy from one read (the backward's data and weight
         * gradients), against quant_rows + quant_cols_t above */
        bench_mem_grouped("quant_rows 32 segments dy 1e-7", 6, 65536, 7168, 1e-7f);
        bench_mem_grouped("quant_rows_cols_t 32 seg dy 1e-7", 10, 65536, 7168, 1e-7f);
        bench_mem_grouped("quant_rows 32 segments dy 1e-7", 6, 65536, 2048, 1e-7f);
        bench_mem_grouped("quant_rows_cols_t 32 seg dy 1e-7", 10, 65536, 2048, 1e-7f);
        bench_mem("quant_rows_cols_t [4096, 32768]", 9, 4096, 32768, 4096.0 * 32768 * 4);
        bench_mem("quant_rows [4096, 32768]", 1, 4096, 32768, 4096.0 * 32768 * 3);
        bench_mem("quant_cols_t [4096, 32768]", 2, 4096, 32768, 4096.0 * 32768 * 3);
        bench_mem("rmsnorm_fwd", 3, 4096, 7168, 4096.0 * 7168 * 4);
        bench_mem("rmsnorm_fwd q_a", 3, 4096, 1536, 4096.0 * 1536 * 4);
        bench_mem("rmsnorm_fwd kv_a", 3, 4096, 512, 4096.0 * 512 * 4);
        /* bytes as the op profile counts them: dy, x read, dx read and
         * written (the dw partials read dy and x again, from L2 when the
         * two run fused: not counted) */
        bench_mem("rmsnorm_bwd dx+= dw", 5, 4096, 7168, 4096.0 * 7168 * 8);
        bench_mem("rmsnorm_bwd q_a dx+= dw", 5, 4096, 1536, 4096.0 * 1536 * 8);
        bench_rope("rope q 128 heads (192, pe at 128)", 4096, 128, 192, 128, 64);
        bench_rope("rope kv_a key (576, pe at 512)", 4096, 1, 576, 512, 64);
        bench_mem("swiglu_fwd", 4, 4096, 4096, 4096.0 * 4096 * 3);
        /* bytes as the op profile counts them: the logits read, the
         * gradient written in their place */
        bench_mem("xent (proxy head) ", 8, 8192, 129280, 8192.0 * 129280 * 4);
    }
    if (SECTION("optim")) {
        printf("optimizer (fp32 main copy, FP8 weight re-quantised)\n");
        bench_optim("adamw + quant + transpose [7168,2048]", 7168, 2048, 0);
        bench_optim("adamw_fp8 fused [7168,2048]", 7168, 2048, 1);
        bench_optim("adamw + quant + transpose [18432,7168]", 18432, 7168, 0);
        bench_optim("adamw_fp8 fused [18432,7168]", 18432, 7168, 1);
        bench_optim("adamw_fp8_sr bf16 grads [7168,2048]", 7168, 2048, 2);
        bench_optim("adamw_fp8_sr bf16 grads [18432,7168]", 18432, 7168, 2);
        bench_optim("adamw_fp8_sr bf16 grads [2048,7164]", 2048, 7164, 2);
        bench_optim("adamw_fp8_sr (scalar) [2048,7166]", 2048, 7166, 2);
        bench_optim_experts("adamw_fp8_sr x 32 experts, calls", 32, 2048, 7168, 0);
        bench_optim_experts("adamw_fp8_sr_n 32 experts", 32, 2048, 7168, 1);
        bench_optim_experts("adamw_fp8_sr x 32 experts, calls", 32, 7168, 2048, 0);
        bench_optim_experts("adamw_fp8_sr_n 32 experts", 32, 7168, 2048, 1);
        bench_pass("sumsq bf16 gradients", 1, (int64_t)1 << 30);
        bench_pass("adamw f32 main, bf16 gradients", 0, (int64_t)926679040);
    }
    be->destroy(be);
    return 0;
}
