/* cuda_prof.cu - the op profile of the CUDA backend (kernels/op_profile.h).
 *
 * With MOETRAIN_OP_PROFILE set, cuda_prof_install keeps a copy of the op
 * table and puts a wrapper in front of every op: the wrapper records a CUDA
 * event on the main stream, calls the op, records a second event and files
 * the pair under (phase, op, shape). The ops that fan out over the expert
 * streams join the main stream before returning, so the pair brackets all
 * of their work. Pairs are resolved (one synchronisation) at the end of
 * each step and whenever the event pool fills.
 *
 * Work per call, for the rates: GEMMs 2*M*N*K FLOPs (FP8 or BF16), attention
 * the causal half of the score matrix (forward B*H*T^2*(Dqk+Dv), backward
 * 2.5x: the convention of tests/bench/RESULTS.md), every other op the bytes
 * it must read and write at least (act values 2 bytes, f32 4, e4m3 1).
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_impl.h"
#include "kernels/op_profile.h"
#include "base/mt_log.h"

#define PROF_EVENTS 8192   /* event pool: PROF_EVENTS / 2 calls between resolutions */
#define PROF_ENTRIES 2048  /* distinct (phase, op, shape) */

enum { W_NONE = 0, W_BYTES, W_BF16, W_FP8 }; /* what a call's work counts */

typedef struct prof_entry {
    const char *phase; /* a mark literal, or "-" */
    const char *op;    /* the ops.h name */
    char shape[72];
    int kind;          /* W_* */
    int64_t calls;
    double ms, work;   /* work: FLOPs or bytes, summed */
} prof_entry;

struct cuda_prof {
    mt_backend orig;   /* the ops without wrappers */
    int from_step;     /* first recorded step (1-based) */
    int steps_begun, steps_recorded;
    int recording;
    const char *phase;
    double step_ms;    /* device time of the recorded steps */
    cudaEvent_t step_ev[2];
    cudaEvent_t ev[PROF_EVENTS];
    int n_ev;
    int pend[PROF_EVENTS / 2]; /* entry of each recorded pair */
    prof_entry e[PROF_ENTRIES];
    int n_e, overflow;
};

/* ---- recording ---------------------------------------------------------------- */

static void prof_flush(cuda_prof *p)
{
    if (p->n_ev == 0) return;
    cudaEventSynchronize(p->ev[p->n_ev - 1]);
    for (int i = 0; i + 1 < p->n_ev; i += 2) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, p->ev[i], p->ev[i + 1]) == cudaSuccess && p->pend[i / 2] >= 0)
            p->e[p->pend[i / 2]].ms += ms;
    }
    cudaGetLastError();
    p->n_ev = 0;
}

/* The slot of the call's first event, or -1 when not recording. */
static int prof_begin(mt_backend *be)
{
    cuda_prof *p = cuda_of(be)->prof;
    if (!p->recording) return -1;
    if (p->n_ev + 2 > PROF_EVENTS) prof_flush(p);
    cudaEventRecord(p->ev[p->n_ev], cuda_stream(be));
    return p->n_ev;
}

static uint64_t str_hash(uint64_t h, const char *s)
{
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h;
}

static int prof_entry_of(cuda_prof *p, const char *op, const char *shape, int kind)
{
    const char *phase = p->phase ? p->phase : "-";
    uint64_t h = str_hash(str_hash(str_hash(1469598103934665603ULL, phase), op), shape);
    for (int probe = 0; probe < PROF_ENTRIES; probe++) {
        prof_entry *e = &p->e[(h + (uint64_t)probe) % PROF_ENTRIES];
        if (!e->op) {
            if (p->n_e >= PROF_ENTRIES * 3 / 4) break; /* keep probes short */
            e->phase = phase;
            e->op = op;
            snprintf(e->shape, sizeof e->shape, "%s", shape);
            e->kind = kind;
            p->n_e++;
            return (int)(e - p->e);
        }
        if (!strcmp(e->phase, phase) && !strcmp(e->op, op) && !strcmp(e->shape, shape))
            return (int)(e - p->e);
    }
    p->overflow++;
    return -1;
}

static void prof_end(mt_backend *be, int slot, const char *op, int kind, double work,
                     const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void prof_end(mt_backend *be, int slot, const char *op, int kind, double work,
                     const char *fmt, ...)
{
    cuda_prof *p = cuda_of(be)->prof;
    cudaEventRecord(p->ev[slot + 1], cuda_stream(be));
    char shape[72];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(shape, sizeof shape, fmt, ap);
    va_end(ap);
    int i = prof_entry_of(p, op, shape, kind);
    p->pend[slot / 2] = i;
    p->n_ev = slot + 2;
    if (i >= 0) {
        p->e[i].calls++;
        p->e[i].work += work;
    }
}

void mt_op_profile_mark(mt_backend *be, const char *mark)
{
    if (!be || be->kind != MT_BE_CUDA || !cuda_of(be) || !cuda_of(be)->prof || !mark) return;
    cuda_prof *p = cuda_of(be)->prof;
    cudaStream_t s = cuda_stream(be);
    if (!strcmp(mark, "step")) {
        p->steps_begun++;
        p->phase = NULL;
        if (p->steps_begun >= p->from_step) {
            p->recording = 1;
            cudaEventRecord(p->step_ev[0], s);
        }
    } else if (!strcmp(mark, "end")) {
        if (!p->recording) return;
        cudaEventRecord(p->step_ev[1], s);
        prof_flush(p);
        cudaEventSynchronize(p->step_ev[1]);
        float ms = 0;
        if (cudaEventElapsedTime(&ms, p->step_ev[0], p->step_ev[1]) == cudaSuccess) {
            p->step_ms += ms;
            p->steps_recorded++;
        }
        cudaGetLastError();
        p->recording = 0;
        p->phase = NULL;
    } else {
        p->phase = mark;
    }
}

/* ---- wrappers --------------------------------------------------------------------
 * PROF(name, (params), (args), work...): the work statements set `kind`, `w`
 * and the shape string with SHAPE(fmt, ...). */

#define SHAPE(...) snprintf(shape, sizeof shape, __VA_ARGS__)
#define PROF(name, PARAMS, ARGS, ...)                                          \
    static int p_##name PARAMS                                                 \
    {                                                                          \
        int slot_ = prof_begin(be);                                            \
        int rc_ = cuda_of(be)->prof->orig.name ARGS;                           \
        if (slot_ >= 0) {                                                      \
            int kind = W_NONE;                                                 \
            double w = 0;                                                      \
            char shape[72] = "";                                               \
            __VA_ARGS__;                                                       \
            prof_end(be, slot_, #name, kind, w, "%s", shape);                  \
        }                                                                      \
        return rc_;                                                            \
    }

static int64_t seg_total(const int *rows, int G)
{
    int64_t t = 0;
    for (int g = 0; rows && g < G; g++) t += rows[g];
    return t;
}

/* A grouped GEMM's shape; with several segments the total rows (which
 * routing changes from call to call) stay out of the name, so the calls of
 * one projection land in one entry. */
static void prof_shape_grouped(char *shape, size_t n, int reduce, const int *rows, int G, int N,
                               int K, int acc)
{
    if (G > 1)
        snprintf(shape, n, "%s G=%d N=%d K=%d%s", reduce ? "wgrad" : "rows", G, N, K, acc ? " +=" : "");
    else
        snprintf(shape, n, "%s M=%lld N=%d K=%d%s", reduce ? "wgrad" : "rows",
                 (long long)seg_total(rows, G), N, K, acc ? " +=" : "");
}

static void prof_shape_rows(char *shape, size_t n, const int *rows, int G, int K)
{
    if (G > 1)
        snprintf(shape, n, "G=%d x%d", G, K);
    else
        snprintf(shape, n, "%lldx%d", (long long)seg_total(rows, G), K);
}

PROF(upload, (mt_backend *be, void *dst, const void *src, size_t bytes), (be, dst, src, bytes),
     kind = W_BYTES; w = (double)bytes)
PROF(download, (mt_backend *be, void *dst, const void *src, size_t bytes), (be, dst, src, bytes),
     kind = W_BYTES; w = (double)bytes)
PROF(copy, (mt_backend *be, void *dst, const void *src, size_t bytes), (be, dst, src, bytes),
     kind = W_BYTES; w = 2.0 * bytes)
PROF(zero, (mt_backend *be, void *ptr, size_t bytes), (be, ptr, bytes),
     kind = W_BYTES; w = (double)bytes)
PROF(act_from_f32, (mt_backend *be, void *dst, const float *src, int64_t n), (be, dst, src, n),
     kind = W_BYTES; w = 6.0 * n; SHAPE("n=%lld", (long long)n))
PROF(act_to_f32, (mt_backend *be, float *dst, const void *src, int64_t n), (be, dst, src, n),
     kind = W_BYTES; w = 6.0 * n; SHAPE("n=%lld", (long long)n))
PROF(add, (mt_backend *be, void *y, const void *a, const void *b, int64_t n), (be, y, a, b, n),
     kind = W_BYTES; w = 6.0 * n; SHAPE("n=%lld", (long long)n))
PROF(copy2d,
     (mt_backend *be, void *dst, int ldd, const void *src, int lds, int rows, int cols, int acc),
     (be, dst, ldd, src, lds, rows, cols, acc),
     kind = W_BYTES; w = 2.0 * rows * cols * (2 + acc); SHAPE("%dx%d%s", rows, cols, acc ? " +=" : ""))
PROF(gemm,
     (mt_backend *be, void *C, int c_f32, int ldc, const void *A, int lda, int ta, const void *B,
      int ldb, int tb, int M, int N, int K, float alpha, int acc),
     (be, C, c_f32, ldc, A, lda, ta, B, ldb, tb, M, N, K, alpha, acc),
     kind = W_BF16; w = 2.0 * M * N * K;
     SHAPE("M=%d N=%d K=%d t%d%d%s%s", M, N, K, ta, tb,
           c_f32 == MT_C_F32 ? " f32" : c_f32 == MT_C_BF16 ? " bf16" : "", acc ? " +=" : ""))
PROF(gemm_grouped,
     (mt_backend *be, int reduce, void *C, int c_f32, int ldc, int64_t c_stride, const void *A,
      int lda, int ta, const void *B, int ldb, int tb, int64_t b_stride, const int *rows, int G,
      int N, int K, float alpha, int acc),
     (be, reduce, C, c_f32, ldc, c_stride, A, lda, ta, B, ldb, tb, b_stride, rows, G, N, K, alpha,
      acc),
     kind = W_BF16; w = 2.0 * seg_total(rows, G) * N * K;
     prof_shape_grouped(shape, sizeof shape, reduce, rows, G, N, K, 0))
PROF(quant_rows,
     (mt_backend *be, uint8_t *q, float *s, const void *x, int ldx, const int *rows, int G, int K),
     (be, q, s, x, ldx, rows, G, K),
     kind = W_BYTES; w = 3.0 * seg_total(rows, G) * K; prof_shape_rows(shape, sizeof shape, rows, G, K))
PROF(quant_cols_t,
     (mt_backend *be, uint8_t *q, float *s, const void *x, int ldx, const int *rows, int G, int K),
     (be, q, s, x, ldx, rows, G, K),
     kind = W_BYTES; w = 3.0 * seg_total(rows, G) * K; prof_shape_rows(shape, sizeof shape, rows, G, K))
PROF(quant_rows_cols_t,
     (mt_backend *be, uint8_t *q, float *s, uint8_t *qt, float *st, const void *x, int ldx,
      const int *rows, int G, int K),
     (be, q, s, qt, st, x, ldx, rows, G, K),
     kind = W_BYTES; w = 4.0 * seg_total(rows, G) * K; prof_shape_rows(shape, sizeof shape, rows, G, K))
PROF(quant_blocks, (mt_backend *be, uint8_t *q, float *s, const float *wt, int N, int K),
     (be, q, s, wt, N, K), kind = W_BYTES; w = 5.0 * N * K; SHAPE("%dx%d", N, K))
PROF(transpose_blocks,
     (mt_backend *be, uint8_t *qt, float *st, const uint8_t *q, const float *s, int N, int K),
     (be, qt, st, q, s, N, K), kind = W_BYTES; w = 2.0 * N * K; SHAPE("%dx%d", N, K))
PROF(dequant_blocks, (mt_backend *be, float *wt, const uint8_t *q, const float *s, int N, int K),
     (be, wt, q, s, N, K), kind = W_BYTES; w = 5.0 * N * K; SHAPE("%dx%d", N, K))
PROF(gemm_fp8,
     (mt_backend *be, int reduce, void *C, int c_f32, int ldc, int64_t c_stride, const uint8_t *A,
      const float *sa, const uint8_t *B, const float *sb, int64_t b_stride, int64_t sb_stride,
      const int *rows, int G, int N, int K, int acc),
     (be, reduce, C, c_f32, ldc, c_stride, A, sa, B, sb, b_stride, sb_stride, rows, G, N, K, acc),
     kind = W_FP8; w = 2.0 * seg_total(rows, G) * N * K;
     prof_shape_grouped(shape, sizeof shape, reduce, rows, G, N, K, acc))
PROF(rmsnorm_fwd,
     (mt_backend *be, void *y, int ldy, float *rstd, const void *x, int ldx, const void *wt, int M,
      int D, float eps),
     (be, y, ldy, rstd, x, ldx, wt, M, D, eps), kind = W_BYTES; w = 4.0 * M * D; SHAPE("%dx%d", M, D))
PROF(rmsnorm_bwd,
     (mt_backend *be, void *dx, int lddx, int acc, void *dw, int dw_type, const void *dy,
      int lddy, const void *x, int ldx, const void *wt, const float *rstd, int M, int D),
     (be, dx, lddx, acc, dw, dw_type, dy, lddy, x, ldx, wt, rstd, M, D),
     kind = W_BYTES; w = 2.0 * M * D * (3 + acc); SHAPE("%dx%d%s", M, D, acc ? " +=" : ""))
PROF(swiglu_fwd, (mt_backend *be, void *h, const void *gu, int M, int F), (be, h, gu, M, F),
     kind = W_BYTES; w = 6.0 * M * F; SHAPE("%dx%d", M, F))
PROF(swiglu_bwd, (mt_backend *be, void *dgu, const void *dh, const void *gu, int M, int F),
     (be, dgu, dh, gu, M, F), kind = W_BYTES; w = 10.0 * M * F; SHAPE("%dx%d", M, F))
PROF(embedding_fwd, (mt_backend *be, void *y, const void *table, const int32_t *ids, int M, int D),
     (be, y, table, ids, M, D), kind = W_BYTES; w = 4.0 * M * D; SHAPE("%dx%d", M, D))
PROF(embedding_bwd,
     (mt_backend *be, void *dt, int dt_type, const void *dy, const int32_t *ids, int M, int D),
     (be, dt, dt_type, dy, ids, M, D), kind = W_BYTES; w = 10.0 * M * D; SHAPE("%dx%d", M, D))
PROF(rope,
     (mt_backend *be, void *x, int N, int T, int H, int ld, int hs, int off, int R,
      const float *cos_t, const float *sin_t, int interleave, int inverse),
     (be, x, N, T, H, ld, hs, off, R, cos_t, sin_t, interleave, inverse),
     kind = W_BYTES; w = 4.0 * N * H * R; SHAPE("N=%d H=%d R=%d%s", N, H, R, inverse ? " inv" : ""))
PROF(attn_fwd,
     (mt_backend *be, void *o, float *lse, const void *q, const void *k, const void *v, int B,
      int T, int H, int Dqk, int Dv, float scale),
     (be, o, lse, q, k, v, B, T, H, Dqk, Dv, scale),
     kind = W_BF16; w = (double)B * H * T * T * (Dqk + Dv);
     SHAPE("B=%d T=%d H=%d Dqk=%d Dv=%d", B, T, H, Dqk, Dv))
PROF(attn_bwd,
     (mt_backend *be, void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
      const void *v, const void *o, const float *lse, int B, int T, int H, int Dqk, int Dv,
      float scale),
     (be, dq, dk, dv, dout, q, k, v, o, lse, B, T, H, Dqk, Dv, scale),
     kind = W_BF16; w = 2.5 * B * H * T * T * (Dqk + Dv);
     SHAPE("B=%d T=%d H=%d Dqk=%d Dv=%d", B, T, H, Dqk, Dv))
PROF(mla_kv_fwd,
     (mt_backend *be, void *k, void *v, const void *kvb, const void *kpe, int ld_kpe, int N, int H,
      int Dn, int R, int Dv),
     (be, k, v, kvb, kpe, ld_kpe, N, H, Dn, R, Dv),
     kind = W_BYTES; w = 2.0 * N * H * (2.0 * (Dn + Dv) + R); SHAPE("N=%d H=%d", N, H))
PROF(mla_kv_bwd,
     (mt_backend *be, void *dkvb, void *dkpe, int ld_dkpe, const void *dk, const void *dv, int N,
      int H, int Dn, int R, int Dv),
     (be, dkvb, dkpe, ld_dkpe, dk, dv, N, H, Dn, R, Dv),
     kind = W_BYTES; w = 2.0 * N * H * (2.0 * (Dn + Dv) + R); SHAPE("N=%d H=%d", N, H))
PROF(router_fwd,
     (mt_backend *be, int32_t *idx, float *wt, float *scores, const float *logits,
      const float *bias, int N, const mt_router_cfg *cfg),
     (be, idx, wt, scores, logits, bias, N, cfg),
     kind = W_BYTES; w = 8.0 * N * cfg->n_experts; SHAPE("N=%d E=%d", N, cfg->n_experts))
PROF(router_bwd,
     (mt_backend *be, float *dlogits, const float *dw, const float *dscores, const float *scores,
      const int32_t *idx, int N, const mt_router_cfg *cfg),
     (be, dlogits, dw, dscores, scores, idx, N, cfg),
     kind = W_BYTES; w = 12.0 * N * cfg->n_experts; SHAPE("N=%d E=%d", N, cfg->n_experts))
PROF(aux_loss,
     (mt_backend *be, float *loss, float *dscores, const float *scores, const int32_t *idx, int B,
      int T, float alpha, float gs, const mt_router_cfg *cfg),
     (be, loss, dscores, scores, idx, B, T, alpha, gs, cfg),
     kind = W_BYTES; w = 8.0 * B * T * cfg->n_experts; SHAPE("N=%d E=%d", B * T, cfg->n_experts))
PROF(moe_index,
     (mt_backend *be, int32_t *slot, int32_t *src, int32_t *counts, int *host_rows,
      const int32_t *idx, int N, int K, int E, int align, int R_cap),
     (be, slot, src, counts, host_rows, idx, N, K, E, align, R_cap),
     SHAPE("N=%d K=%d E=%d", N, K, E))
PROF(moe_permute, (mt_backend *be, void *xp, const void *x, const int32_t *src, int R, int D),
     (be, xp, x, src, R, D), kind = W_BYTES; w = 4.0 * R * D; SHAPE("R=%d D=%d", R, D))
PROF(moe_permute_bwd,
     (mt_backend *be, void *dx, int acc, const void *dxp, const int32_t *slot, int N, int K, int D),
     (be, dx, acc, dxp, slot, N, K, D),
     kind = W_BYTES; w = 2.0 * N * D * (K + 1 + acc); SHAPE("N=%d K=%d D=%d%s", N, K, D, acc ? " +=" : ""))
PROF(moe_unpermute,
     (mt_backend *be, void *y, int acc, const void *yp, const int32_t *slot, const float *wt, int N,
      int K, int D),
     (be, y, acc, yp, slot, wt, N, K, D),
     kind = W_BYTES; w = 2.0 * N * D * (K + 1 + acc); SHAPE("N=%d K=%d D=%d%s", N, K, D, acc ? " +=" : ""))
PROF(moe_unpermute_bwd,
     (mt_backend *be, void *dyp, float *dw, const void *dy, const void *yp, const int32_t *slot,
      const float *wt, int N, int K, int D, int R),
     (be, dyp, dw, dy, yp, slot, wt, N, K, D, R),
     kind = W_BYTES; w = 2.0 * D * ((double)R + (double)N * K + N); SHAPE("N=%d K=%d D=%d", N, K, D))
PROF(xent,
     (mt_backend *be, float *loss, void *logits, const int32_t *tgt, int M, int V, int ignore,
      float gs),
     (be, loss, logits, tgt, M, V, ignore, gs), kind = W_BYTES; w = 4.0 * M * V; SHAPE("%dx%d", M, V))
PROF(sumsq, (mt_backend *be, float *out, const void *g, int g_bf16, int64_t n),
     (be, out, g, g_bf16, n), kind = W_BYTES; w = (g_bf16 ? 2.0 : 4.0) * n)
PROF(scale_f32, (mt_backend *be, float *x, int64_t n, float a), (be, x, n, a),
     kind = W_BYTES; w = 8.0 * n)
PROF(adamw,
     (mt_backend *be, void *pp, int p_bf16, uint16_t *m, uint16_t *v, const void *grad, int64_t n,
      const mt_adamw_hp *hp, void *act),
     (be, pp, p_bf16, m, v, grad, n, hp, act), kind = W_BYTES;
     w = ((p_bf16 ? 16.0 : 20.0) - (hp->grad_bf16 ? 2.0 : 0.0) + (act ? 2.0 : 0.0)) * n;
     SHAPE("%s", act ? "+ act copy" : ""))
PROF(adamw_fp8,
     (mt_backend *be, void *pp, int p_bf16, uint16_t *m, uint16_t *v, const void *grad, int N,
      int K, const mt_adamw_hp *hp, uint8_t *q, float *s, uint8_t *qt, float *st),
     (be, pp, p_bf16, m, v, grad, N, K, hp, q, s, qt, st),
     kind = W_BYTES; w = ((p_bf16 ? 18.0 : 22.0) - (hp->grad_bf16 ? 2.0 : 0.0)) * N * K;
     SHAPE("%s%s", p_bf16 ? "bf16 main" : "f32 main", hp->grad_bf16 ? " bf16 grads" : ""))
PROF(adamw_fp8_sr,
     (mt_backend *be, uint8_t *q, float *s, uint16_t *m, uint16_t *v, const void *grad, int N,
      int K, const mt_adamw_hp *hp, uint64_t seed, int slab_rows, uint8_t *qt, float *st),
     (be, q, s, m, v, grad, N, K, hp, seed, slab_rows, qt, st),
     kind = W_BYTES; w = (11.0 + (hp->grad_bf16 ? 2.0 : 4.0)) * N * K;
     SHAPE("%dx%d%s", N, K, hp->grad_bf16 ? " bf16 grads" : ""))
PROF(adamw_fp8_sr_n, (mt_backend *be, int n, const mt_adamw_fp8_sr_arg *wt, const mt_adamw_hp *hp),
     (be, n, wt, hp), kind = W_BYTES;
     for (int i = 0; i < n; i++) w += (11.0 + (hp->grad_bf16 ? 2.0 : 4.0)) * wt[i].N * wt[i].K;
     SHAPE("%d weights%s", n, hp->grad_bf16 ? ", bf16 grads" : ""))
PROF(adamw_sr,
     (mt_backend *be, void *wt, uint16_t *m, uint16_t *v, const void *grad, int64_t n,
      const mt_adamw_hp *hp, uint64_t seed),
     (be, wt, m, v, grad, n, hp, seed), kind = W_BYTES;
     w = (12.0 + (hp->grad_bf16 ? 2.0 : 4.0)) * n; SHAPE("%s", hp->grad_bf16 ? "bf16 grads" : ""))
PROF(adamw_fp8_n, (mt_backend *be, int n, const mt_adamw_fp8_arg *wt, const mt_adamw_hp *hp),
     (be, n, wt, hp), kind = W_BYTES;
     for (int i = 0; i < n; i++) w += ((wt[i].p_bf16 ? 18.0 : 22.0) - (hp->grad_bf16 ? 2.0 : 0.0)) *
                                      wt[i].N * wt[i].K;
     SHAPE("%d weights%s", n, hp->grad_bf16 ? ", bf16 grads" : ""))
PROF(act_from_f32_sr, (mt_backend *be, void *dst, const float *src, int64_t n, uint64_t seed),
     (be, dst, src, n, seed), kind = W_BYTES; w = 6.0 * n)
PROF(quant_blocks_sr,
     (mt_backend *be, uint8_t *q, float *s, const float *wt, int N, int K, uint64_t seed),
     (be, q, s, wt, N, K, seed), kind = W_BYTES; w = 5.0 * N * K)
PROF(bf16_to_f32, (mt_backend *be, float *dst, const uint16_t *src, int64_t n), (be, dst, src, n),
     kind = W_BYTES; w = 6.0 * n)

/* ---- ceilings: measured on the device when the report is made -------------------- */

typedef struct prof_ceil {
    double copy_gbs, bf16_tflops, fp8_tflops;
} prof_ceil;

__global__ void k_prof_fill_bf16(bf16 *p, int64_t n, uint64_t seed)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    uint64_t h = (uint64_t)i * 0x9E3779B97F4A7C15ULL ^ seed;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 29;
    p[i] = __float2bfloat16_rn((float)(h >> 40) / (float)(1 << 24) * 2.0f - 1.0f);
}

/* Random e4m3 codes with the top exponent bit clear: finite, |x| < 2. */
__global__ void k_prof_fill_e4m3(uint8_t *p, int64_t n, uint64_t seed)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    uint64_t h = (uint64_t)i * 0x9E3779B97F4A7C15ULL ^ seed;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    p[i] = (uint8_t)((h >> 24) & 0xBF);
}

__global__ void k_prof_fill_f32(float *p, int64_t n, float v)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median over 5 timings of 4 back-to-back runs, after 2 warm-up runs; ms per run. */
typedef int (*prof_run_fn)(mt_backend *be, void *arg);
static double prof_time(mt_backend *be, prof_run_fn fn, void *arg)
{
    cudaStream_t s = cuda_stream(be);
    cudaEvent_t a, b;
    if (cudaEventCreate(&a) != cudaSuccess) return NAN;
    if (cudaEventCreate(&b) != cudaSuccess) {
        cudaEventDestroy(a);
        return NAN;
    }
    double t[5];
    int bad = fn(be, arg) < 0 || fn(be, arg) < 0;
    for (int r = 0; r < 5 && !bad; r++) {
        cudaEventRecord(a, s);
        for (int i = 0; i < 4; i++) bad |= fn(be, arg) < 0;
        cudaEventRecord(b, s);
        cudaEventSynchronize(b);
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        t[r] = ms / 4;
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    if (bad) return NAN;
    qsort(t, 5, sizeof t[0], cmp_double);
    return t[2];
}

#define CEIL_N 8192
typedef struct ceil_args {
    char *x, *y, *z;        /* bf16 [N, N] each, or e4m3 + scales */
    float *sa, *sb;
    size_t copy_bytes;
} ceil_args;

static int run_copy(mt_backend *be, void *arg)
{
    ceil_args *c = (ceil_args *)arg;
    MT_CUDA_CHECK(cudaMemcpyAsync(c->z, c->x, c->copy_bytes, cudaMemcpyDeviceToDevice, cuda_stream(be)));
    return MT_OK;
}
static int run_bf16(mt_backend *be, void *arg)
{
    ceil_args *c = (ceil_args *)arg;
    const int n = CEIL_N;
    return cuda_of(be)->prof->orig.gemm(be, c->z, 0, n, c->x, n, 0, c->y, n, 0, n, n, n, 1.0f, 0);
}
static int run_fp8(mt_backend *be, void *arg)
{
    ceil_args *c = (ceil_args *)arg;
    const int n = CEIL_N, rows[1] = {CEIL_N};
    return cuda_of(be)->prof->orig.gemm_fp8(be, 0, c->z, 0, n, 0, (const uint8_t *)c->x, c->sa,
                                            (const uint8_t *)c->y, c->sb, 0, 0, rows, 1, n, n, 0);
}

/* Uses the upper half of the op scratch (the lower half is the FP8 GEMM's
 * own C^T scratch); ceilings stay NaN if the scratch is too small. */
static void prof_ceilings(mt_backend *be, prof_ceil *out)
{
    cuda_impl *c = cuda_of(be);
    out->copy_gbs = out->bf16_tflops = out->fp8_tflops = NAN;
    const size_t mat = (size_t)CEIL_N * CEIL_N * 2; /* 128 MB */
    if (c->scratch_cap / 2 < 3 * mat + (64u << 20)) return;
    cudaStream_t s = cuda_stream(be);
    char *base = c->scratch + c->scratch_cap / 2 + (64u << 20);
    ceil_args a;
    memset(&a, 0, sizeof a);
    a.x = base, a.y = base + mat, a.z = base + 2 * mat;
    const int64_t n = (int64_t)CEIL_N * CEIL_N;
    k_prof_fill_bf16<<<cuda_grid(n, 256), 256, 0, s>>>((bf16 *)a.x, n, 1);
    k_prof_fill_bf16<<<cuda_grid(n, 256), 256, 0, s>>>((bf16 *)a.y, n, 2);
    a.copy_bytes = mat; /* x -> z: 128 MB read, 128 MB written (past the L2) */
    double ms = prof_time(be, run_copy, &a);
    out->copy_gbs = 2.0 * a.copy_bytes / (ms * 1e-3) / 1e9;
    ms = prof_time(be, run_bf16, &a);
    out->bf16_tflops = 2.0 * n * CEIL_N / (ms * 1e-3) / 1e12;
    /* FP8: codes in x and y (half of each buffer), scales after them */
    k_prof_fill_e4m3<<<cuda_grid(n, 256), 256, 0, s>>>((uint8_t *)a.x, n, 3);
    k_prof_fill_e4m3<<<cuda_grid(n, 256), 256, 0, s>>>((uint8_t *)a.y, n, 4);
    a.sa = (float *)(a.x + n);
    a.sb = (float *)(a.y + n);
    const int64_t ns = (int64_t)(CEIL_N / 128) * CEIL_N;
    k_prof_fill_f32<<<cuda_grid(ns, 256), 256, 0, s>>>(a.sa, ns, 0.01f);
    k_prof_fill_f32<<<cuda_grid(ns, 256), 256, 0, s>>>(a.sb, ns, 0.02f);
    ms = prof_time(be, run_fp8, &a);
    out->fp8_tflops = 2.0 * n * CEIL_N / (ms * 1e-3) / 1e12;
    cudaStreamSynchronize(s);
    cudaGetLastError();
}

/* ---- report ------------------------------------------------------------------------ */

static int cmp_entry_ms(const void *a, const void *b)
{
    const prof_entry *x = *(const prof_entry *const *)a, *y = *(const prof_entry *const *)b;
    return x->ms < y->ms ? 1 : x->ms > y->ms ? -1 : 0;
}

/* "TFLOPS 123.4 (45 %)" or "GB/s ..." for an entry: its rate and fraction of the ceiling. */
static void rate_of(const prof_entry *e, double ms, const prof_ceil *cl, double *rate,
                    double *frac, const char **unit)
{
    *rate = *frac = NAN;
    *unit = "";
    if (e->kind == W_NONE || ms <= 0) return;
    if (e->kind == W_BYTES) {
        *rate = e->work / (ms * 1e-3) / 1e9;
        *frac = *rate / cl->copy_gbs;
        *unit = "GB/s";
    } else {
        *rate = e->work / (ms * 1e-3) / 1e12;
        *frac = *rate / (e->kind == W_FP8 ? cl->fp8_tflops : cl->bf16_tflops);
        *unit = e->kind == W_FP8 ? "TFLOPS fp8" : "TFLOPS bf16";
    }
}

typedef struct prof_group {
    const char *name;
    double ms;
    int64_t calls;
} prof_group;

static void group_add(prof_group *g, int *n, int cap, const char *name, double ms, int64_t calls)
{
    for (int i = 0; i < *n; i++)
        if (!strcmp(g[i].name, name)) {
            g[i].ms += ms;
            g[i].calls += calls;
            return;
        }
    if (*n >= cap) return;
    g[*n].name = name;
    g[*n].ms = ms;
    g[*n].calls = calls;
    (*n)++;
}

static int cmp_group(const void *a, const void *b)
{
    const prof_group *x = (const prof_group *)a, *y = (const prof_group *)b;
    return x->ms < y->ms ? 1 : x->ms > y->ms ? -1 : 0;
}

static void prof_report(mt_backend *be)
{
    cuda_prof *p = cuda_of(be)->prof;
    prof_flush(p);
    if (p->steps_recorded == 0) {
        MT_LOGI("op profile: no step recorded (MOETRAIN_OP_PROFILE=%d: from step %d on)",
                p->from_step, p->from_step);
        return;
    }
    prof_ceil cl;
    prof_ceilings(be, &cl);
    const double S = p->steps_recorded, step = p->step_ms / S;
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, cuda_of(be)->device);
    prof_entry **v = (prof_entry **)malloc(sizeof *v * (size_t)(p->n_e + 1));
    if (!v) return;
    int n = 0;
    double ops_ms = 0;
    for (int i = 0; i < PROF_ENTRIES; i++)
        if (p->e[i].op) {
            v[n++] = &p->e[i];
            ops_ms += p->e[i].ms;
        }
    qsort(v, (size_t)n, sizeof *v, cmp_entry_ms);
    MT_LOGI("op profile: %s, steps %d..%d (%d recorded); ceilings measured now: copy %.0f GB/s, "
            "bf16 GEMM %.0f TFLOPS, fp8 GEMM %.0f TFLOPS (8192^3)",
            prop.name, p->from_step, p->from_step + p->steps_recorded - 1, p->steps_recorded,
            cl.copy_gbs, cl.bf16_tflops, cl.fp8_tflops);
    MT_LOGI("op profile: step %.2f ms on the device; ops %.2f ms (%.1f %%), between ops %.2f ms "
            "(launch gaps, host synchronisation)%s",
            step, ops_ms / S, 100 * ops_ms / p->step_ms, step - ops_ms / S,
            p->overflow ? "; some calls not filed (table full)" : "");
    /* by phase, then by op name */
    prof_group g[256];
    int ng = 0;
    for (int i = 0; i < n; i++) group_add(g, &ng, 256, v[i]->phase, v[i]->ms, v[i]->calls);
    qsort(g, (size_t)ng, sizeof g[0], cmp_group);
    MT_LOGI("op profile by phase:   %-12s %10s %7s %9s", "phase", "ms/step", "share", "calls/step");
    for (int i = 0; i < ng; i++)
        MT_LOGI("op profile by phase:   %-12s %10.2f %6.1f%% %9.0f", g[i].name, g[i].ms / S,
                100 * g[i].ms / p->step_ms, g[i].calls / S);
    ng = 0;
    for (int i = 0; i < n; i++) group_add(g, &ng, 256, v[i]->op, v[i]->ms, v[i]->calls);
    qsort(g, (size_t)ng, sizeof g[0], cmp_group);
    MT_LOGI("op profile by op:      %-18s %10s %7s %9s", "op", "ms/step", "share", "calls/step");
    for (int i = 0; i < ng; i++)
        MT_LOGI("op profile by op:      %-18s %10.2f %6.1f%% %9.0f", g[i].name, g[i].ms / S,
                100 * g[i].ms / p->step_ms, g[i].calls / S);
    MT_LOGI("op profile top: %-9s %-17s %-36s %6s %9s %6s %9s %-11s %6s", "phase", "op", "shape",
            "calls", "ms/step", "share", "rate", "unit", "of ceil");
    for (int i = 0; i < n && i < 60; i++) {
        const prof_entry *e = v[i];
        double rate, frac;
        const char *unit;
        rate_of(e, e->ms, &cl, &rate, &frac, &unit);
        MT_LOGI("op profile top: %-9s %-17s %-36s %6.0f %9.3f %5.1f%% %9.1f %-11s %5.1f%%", e->phase,
                e->op, e->shape, e->calls / S, e->ms / S, 100 * e->ms / p->step_ms, rate, unit,
                100 * frac);
    }
    const char *out = getenv("MOETRAIN_OP_PROFILE_OUT");
    FILE *f = out && *out ? fopen(out, "w") : NULL;
    if (f) {
        fprintf(f, "# op profile: %s, %d steps from step %d, step %.3f ms; ceilings copy %.1f GB/s "
                   "bf16 %.1f TFLOPS fp8 %.1f TFLOPS\n",
                prop.name, p->steps_recorded, p->from_step, step, cl.copy_gbs, cl.bf16_tflops,
                cl.fp8_tflops);
        fprintf(f, "phase\top\tshape\tcalls_per_step\tms_per_step\tshare\trate\tunit\tof_ceiling\n");
        for (int i = 0; i < n; i++) {
            const prof_entry *e = v[i];
            double rate, frac;
            const char *unit;
            rate_of(e, e->ms, &cl, &rate, &frac, &unit);
            fprintf(f, "%s\t%s\t%s\t%.2f\t%.4f\t%.4f\t%.2f\t%s\t%.4f\n", e->phase, e->op, e->shape,
                    e->calls / S, e->ms / S, e->ms / p->step_ms, rate, unit, frac);
        }
        fclose(f);
    } else if (out && *out) {
        MT_LOGW("op profile: cannot write %s", out);
    }
    free(v);
}

/* ---- install / destroy ------------------------------------------------------------ */

int cuda_prof_install(mt_backend *be)
{
    const char *env = getenv("MOETRAIN_OP_PROFILE");
    if (!env || !*env || !strcmp(env, "0")) return MT_OK;
    cuda_impl *c = cuda_of(be);
    cuda_prof *p = (cuda_prof *)calloc(1, sizeof *p);
    if (!p) return MT_ERR(MT_ENOMEM, "op profile: out of host memory");
    c->prof = p;
    int from = atoi(env);
    p->from_step = from > 0 ? from : 1;
    for (int i = 0; i < 2; i++) MT_CUDA_CHECK(cudaEventCreate(&p->step_ev[i]));
    for (int i = 0; i < PROF_EVENTS; i++) MT_CUDA_CHECK(cudaEventCreate(&p->ev[i]));
    p->orig = *be;
#define WRAP(name) be->name = p_##name
    WRAP(upload); WRAP(download); WRAP(copy); WRAP(zero);
    WRAP(act_from_f32); WRAP(act_to_f32); WRAP(add); WRAP(copy2d);
    WRAP(gemm); WRAP(gemm_grouped); WRAP(quant_rows); WRAP(quant_cols_t); WRAP(quant_rows_cols_t);
    WRAP(quant_blocks); WRAP(transpose_blocks); WRAP(dequant_blocks); WRAP(gemm_fp8);
    WRAP(rmsnorm_fwd); WRAP(rmsnorm_bwd); WRAP(swiglu_fwd); WRAP(swiglu_bwd);
    WRAP(embedding_fwd); WRAP(embedding_bwd); WRAP(rope); WRAP(attn_fwd); WRAP(attn_bwd);
    WRAP(mla_kv_fwd); WRAP(mla_kv_bwd); WRAP(router_fwd); WRAP(router_bwd); WRAP(aux_loss);
    WRAP(moe_index); WRAP(moe_permute); WRAP(moe_permute_bwd); WRAP(moe_unpermute);
    WRAP(moe_unpermute_bwd); WRAP(xent); WRAP(sumsq); WRAP(scale_f32); WRAP(adamw); WRAP(adamw_fp8_sr); WRAP(adamw_fp8_sr_n); WRAP(adamw_sr);
    WRAP(adamw_fp8); WRAP(adamw_fp8_n); WRAP(act_from_f32_sr); WRAP(quant_blocks_sr); WRAP(bf16_to_f32);
#undef WRAP
    MT_LOGI("op profile: on, from step %d (MOETRAIN_OP_PROFILE)", p->from_step);
    return MT_OK;
}

void cuda_prof_destroy(mt_backend *be)
{
    cuda_impl *c = cuda_of(be);
    if (!c || !c->prof) return;
    prof_report(be);
    cuda_prof *p = c->prof;
    for (int i = 0; i < 2; i++)
        if (p->step_ev[i]) cudaEventDestroy(p->step_ev[i]);
    for (int i = 0; i < PROF_EVENTS; i++)
        if (p->ev[i]) cudaEventDestroy(p->ev[i]);
    *be = p->orig; /* the ops without wrappers, for the rest of the teardown */
    free(p);
    c->prof = NULL;
}
