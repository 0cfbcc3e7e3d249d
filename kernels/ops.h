/* ops.h - the op API: every computation of the model and optimizer, behind
 * one interface with a CPU backend (kernels/cpu: plain C, the oracle) and a
 * CUDA backend (kernels/cuda).
 *
 * Data conventions
 *  - Matrices are row-major; "[M, K]" means M rows of K contiguous elements
 *    unless a row stride (ld*, in elements) says otherwise.
 *  - "act" buffers hold activations, activation gradients and the compute
 *    copies of non-linear parameters in the backend's activation type:
 *    float on the CPU, bf16 on CUDA (be->act_bytes is 4 or 2). When
 *    be->round_bf16 is set the CPU rounds every act value it stores to the
 *    nearest bf16 (round to nearest even), so it computes what the GPU
 *    computes: fp32 arithmetic inside an op, bf16 storage between ops.
 *  - "f32" buffers are float on every backend (weight gradients, norms'
 *    statistics, router scores, losses); "i32" are int32; "e4m3" are FP8
 *    E4M3 bytes. All of these live in the backend's memory (device memory
 *    on CUDA) unless marked "host".
 *  - Gradient accumulators are "f32" or "bf16" (precision.grads): bf16 bits
 *    (uint16) on every backend, so a gradient buffer has one layout
 *    everywhere. An op that adds into a bf16 accumulator computes its
 *    contribution in fp32, adds it to the accumulator's value in fp32 and
 *    rounds the sum to the nearest bf16 (even) once per call: what cuBLASLt
 *    does with a bf16 C/D, beta = 1 and fp32 compute. Ops taking a
 *    gradient name its type with an mt_c_type (MT_C_F32 or MT_C_BF16).
 *  - Reductions are deterministic: results do not depend on thread count or
 *    launch configuration (no floating-point atomics).
 *
 * FP8 (DESIGN.md numerics; mt_fp8.h has the scalar rules)
 *  - Quantisation tiles: activations 1x128 along the reduction dimension,
 *    weights 128x128 blocks. A tile's scale is s = amax / 448 (float, not
 *    rounded to a power of two; s = 1 for an all-zero tile) and a value is
 *    stored as e4m3(x / s), round to nearest even, saturating at +-448. The
 *    dequantised value is q * s (s is DeepSeek-V3's weight_scale_inv). Last
 *    tiles may be partial.
 *  - Scale layouts (those of cuBLASLt 13.1):
 *      VEC128 of a [M, K] operand: s[kb * M + m], kb = k / 128   ([KB, M])
 *      BLK128 of a [N, K] operand: s[nb * KB + kb]              ([NB, KB])
 *    with KB = ceil(K / 128), NB = ceil(N / 128).
 *  - GEMMs are "TN": both operands K-contiguous. C[m, n] = sum over K-tiles
 *    kb of (sum_{k in kb} qa[m, k] * qb[n, k]) * sa(m, kb) * sb(n, kb), the
 *    inner sums and the accumulation in fp32.
 *
 * Segments (MoE): a grouped op works on G consecutive row segments; segment
 * g covers rows [r_g, r_g + rows[g]) with r_g = rows[0] + ... + rows[g-1].
 * rows[] is a host array. Per-segment FP8 scales are packed one segment after
 * the other (offsets stated at each op).
 */
#ifndef MT_OPS_H
#define MT_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "base/mt_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { MT_BE_CPU = 0, MT_BE_CUDA = 1 } mt_be_kind;

typedef enum { MT_SCORE_SIGMOID = 0, MT_SCORE_SOFTMAX = 1 } mt_score_fn;

/* Element type of a GEMM output C or of a gradient accumulator:
 * act (the backend's activation type), f32, or bf16 bits on every backend
 * (CPU included; on CUDA the same as act). */
typedef enum { MT_C_ACT = 0, MT_C_F32 = 1, MT_C_BF16 = 2 } mt_c_type;

/* Router settings (DeepSeekMoE, DESIGN.md). */
typedef struct mt_router_cfg {
    int n_experts;        /* E */
    int top_k;            /* K */
    int n_group;          /* groups; 1: no group limit */
    int topk_group;       /* groups kept per token */
    mt_score_fn score_fn; /* sigmoid (V3) or softmax (V2) */
    int group_by_top2;    /* group score: sum of its top-2 (noaux_tc) or its max */
    int norm_topk;        /* normalise the K weights to sum 1 */
    float scaling;        /* routed_scaling_factor, applied after normalising */
} mt_router_cfg;

/* AdamW hyper-parameters of one update (DESIGN.md: BF16 moments). */
typedef struct mt_adamw_hp {
    float lr;
    float beta1, beta2, eps;
    float weight_decay;  /* decoupled: p -= lr * wd * p */
    float bc1, bc2;      /* bias corrections 1 - beta1^t, 1 - beta2^t */
    float grad_scale;    /* gradient multiplier (global-norm clipping) */
    int grad_bf16;       /* the gradient is bf16 bits (precision.grads bf16), else f32 */
} mt_adamw_hp;

/* One FP8 weight of adamw_fp8_n: adamw_fp8's arguments, and the weight's
 * own decoupled decay (0 for the weights that take none). */
typedef struct mt_adamw_fp8_arg {
    void *p;
    int p_bf16;
    uint16_t *m, *v;
    const void *grad;
    int N, K;
    float weight_decay;
    uint8_t *q;
    float *s;
    uint8_t *qt;
    float *st;
} mt_adamw_fp8_arg;

/* One FP8 weight of adamw_fp8_sr_n: adamw_fp8_sr's arguments, and the
 * weight's own decoupled decay. */
typedef struct mt_adamw_fp8_sr_arg {
    uint8_t *q;
    float *s;
    uint16_t *m, *v;
    const void *grad;
    int N, K;
    float weight_decay;
    uint64_t seed;
    int slab_rows;
    uint8_t *qt;
    float *st;
} mt_adamw_fp8_sr_arg;

typedef struct mt_backend mt_backend;

struct mt_backend {
    mt_be_kind kind;
    const char *name;
    int act_bytes;  /* 4 (CPU float) or 2 (CUDA bf16) */
    int round_bf16; /* CPU: round stored act values to bf16 (recipes bf16 and fp8) */
    double peak_tflops; /* dense BF16 peak of one device for MFU; 0: unknown */
    void *impl;     /* backend-private state */

    /* ---- memory ------------------------------------------------------- */
    int (*alloc)(mt_backend *be, size_t bytes, void **p); /* zero-filled */
    void (*free)(mt_backend *be, void *p);
    int (*upload)(mt_backend *be, void *dst, const void *host_src, size_t bytes);
    int (*download)(mt_backend *be, void *host_dst, const void *src, size_t bytes);
    int (*copy)(mt_backend *be, void *dst, const void *src, size_t bytes);
    int (*zero)(mt_backend *be, void *p, size_t bytes);
    int (*sync)(mt_backend *be);
    /* The compute stream: every op of this backend is enqueued on it, in
     * call order (CUDA: a cudaStream_t of the backend's device, created
     * non-blocking, so the legacy default stream does NOT order against
     * it; fan-outs inside an op join back before the op returns). Work
     * that other code enqueues on it runs after the backend's earlier ops
     * and before its later ones; e.g. mt_comm_set_stream(c, be->stream(be))
     * orders a device communicator's ops with the backend's kernels
     * without host waits. NULL on the CPU backend (ops complete on return). */
    void *(*stream)(mt_backend *be);
    /* Host memory the backend copies to and from at full speed: page-locked
     * on CUDA (cudaHostAlloc: device copies run at PCIe / NVLink-C2C speed,
     * ~20 GB/s on H100, against ~1-2 GB/s through pageable memory, which
     * the driver stages in pieces); plain 64-byte aligned malloc on the CPU.
     * For large host copies of device state that are reused (checkpoint
     * snapshots, restore staging); not counted by mem_stats. host_free
     * takes NULL. An upload from such memory is truly asynchronous: the
     * caller must not overwrite the source before a sync (pageable sources
     * are staged before upload returns). */
    int (*host_alloc)(mt_backend *be, size_t bytes, void **p);
    void (*host_free)(mt_backend *be, void *p);
    /* Device timestamps (the pipeline's measured idle, issue 15): mark(be, i)
     * records mark i (0 <= i, growing as needed) at this point of the
     * compute stream, reached when the backend's earlier ops have completed
     * (CUDA: a timing event recorded on the stream, no host wait; CPU: the
     * host clock now, its ops having completed on return). marks_read(be, n,
     * t) waits for marks 0..n-1, recorded since the last read, and gives
     * their times t[n] in seconds after mark 0. */
    int (*mark)(mt_backend *be, int i);
    int (*marks_read)(mt_backend *be, int n, double *t);
    /* Bytes the backend holds now and at most so far (arena use on CUDA). */
    void (*mem_stats)(mt_backend *be, size_t *in_use, size_t *peak);
    void (*destroy)(mt_backend *be);

    /* ---- conversions and elementwise ----------------------------------- */
    /* dst act[n] = src f32[n] (rounded as the backend stores act values). */
    int (*act_from_f32)(mt_backend *be, void *dst, const float *src, int64_t n);
    /* dst f32[n] = src act[n]. */
    int (*act_to_f32)(mt_backend *be, float *dst, const void *src, int64_t n);
    /* y act[n] = a + b; y may alias a or b. */
    int (*add)(mt_backend *be, void *y, const void *a, const void *b, int64_t n);
    /* 2-D copy of act values: dst[r * ldd + c] = src[r * lds + c], c < cols.
     * accumulate: dst += src. */
    int (*copy2d)(mt_backend *be, void *dst, int ldd, const void *src, int lds, int rows,
                  int cols, int accumulate);

    /* ---- GEMM --------------------------------------------------------- */
    /* C[M, N] = alpha * sum_k A(m, k) * B(n, k)  (+ C if accumulate), fp32
     * accumulation. A(m, k) = A[m * lda + k], or A[k * lda + m] if ta;
     * B(n, k) = B[n * ldb + k], or B[k * ldb + n] if tb. A, B act. C of
     * type c_f32 (an mt_c_type: act, f32 or bf16 bits) with row stride ldc;
     * a bf16 C is rounded once per call after adding (the data conventions'
     * gradient rule).
     *   y = x W^T: ta 0 tb 0;  dx = dy W: tb 1;  dW = dy^T x: ta 1 tb 1. */
    int (*gemm)(mt_backend *be, void *C, int c_f32, int ldc, const void *A, int lda, int ta,
                const void *B, int ldb, int tb, int M, int N, int K, float alpha,
                int accumulate);
    /* The same GEMM over G row segments (MoE experts).
     * reduce = 0: rows of A(m, k) (as gemm, ta allowed) and C are
     *   segmented; B_g = B + g * b_stride:
     *   C[r_g + i, :] = A(r_g + i, :) op(B_g)         (M = r_G total rows)
     * reduce = 1: the reduction dimension is segmented (weight gradients):
     *   C_g = C + g * c_stride: C_g[N, K] = sum_{i < rows[g]} A(r_g + i, n) B(r_g + i, k)
     *   with A [sum rows, N] (lda), B [sum rows, K] (ldb): ta, tb ignored. */
    int (*gemm_grouped)(mt_backend *be, int reduce, void *C, int c_f32, int ldc,
                        int64_t c_stride, const void *A, int lda, int ta, const void *B,
                        int ldb, int tb, int64_t b_stride, const int *rows, int G, int N,
                        int K, float alpha, int accumulate);

    /* ---- FP8 ---------------------------------------------------------- */
    /* Row-wise 1x128 quantisation of x [M, K] (ldx) per segment:
     * q [M, K] e4m3 (contiguous); segment g's VEC128 scales [KB, rows[g]] at
     * s + KB * r_g. G = 1, rows = {M} for an unsegmented tensor. */
    int (*quant_rows)(mt_backend *be, uint8_t *q, float *s, const void *x, int ldx,
                      const int *rows, int G, int K);
    /* Transposed quantisation for weight gradients: tiles of 128 along the
     * rows of x [M, K] (ldx). Segment g becomes q_g [K, rows[g]] e4m3 at
     * q + K * r_g, with VEC128 scales [ceil(rows[g] / 128), K] at
     * s + K * (sum_{h<g} ceil(rows[h] / 128)). */
    int (*quant_cols_t)(mt_backend *be, uint8_t *q, float *s, const void *x, int ldx,
                        const int *rows, int G, int K);
    /* Both of the above from one read of x: q, s as quant_rows; qt, st as
     * quant_cols_t (the same bits as the two calls). The backward's data
     * and weight gradients take dy in both forms. */
    int (*quant_rows_cols_t)(mt_backend *be, uint8_t *q, float *s, uint8_t *qt, float *st,
                             const void *x, int ldx, const int *rows, int G, int K);
    /* Weight quantisation, 128x128 blocks: w [N, K] f32 -> q [N, K] e4m3,
     * BLK128 scales s [NB, KB]. */
    int (*quant_blocks)(mt_backend *be, uint8_t *q, float *s, const float *w, int N, int K);
    /* Exact transpose of a block-quantised weight: qt [K, N], st [KB, NB]. */
    int (*transpose_blocks)(mt_backend *be, uint8_t *qt, float *st, const uint8_t *q,
                            const float *s, int N, int K);
    /* dst f32 [N, K] = dequantised block-quantised q, s. */
    int (*dequant_blocks)(mt_backend *be, float *w, const uint8_t *q, const float *s, int N,
                          int K);
    /* Grouped FP8 GEMM (TN), C act or f32 (ldc), accumulate as gemm.
     * reduce = 0 (forward, data gradient): A = quant_rows output [M, K] with
     *   its per-segment scales; B_g = B + g * b_stride e4m3 [N, K] with BLK128
     *   scales at sb + g * sb_stride;  C[r_g + i, :] = A_g B_g^T.
     * reduce = 1 (weight gradient): A = quant_cols_t output of dy (N columns),
     *   B = quant_cols_t output of x (K columns);  C_g = C + g * c_stride:
     *   C_g[N, K] = sum over the segment's rows. */
    int (*gemm_fp8)(mt_backend *be, int reduce, void *C, int c_f32, int ldc, int64_t c_stride,
                    const uint8_t *A, const float *sa, const uint8_t *B, const float *sb,
                    int64_t b_stride, int64_t sb_stride, const int *rows, int G, int N, int K,
                    int accumulate);

    /* ---- normalisation, activation, embedding ---------------------------- */
    /* y = x * rstd * w, rstd[m] = 1 / sqrt(mean_k x[m, k]^2 + eps).
     * x [M, D] (ldx), y [M, D] (ldy) act, w [D] act, rstd [M] f32 out. */
    int (*rmsnorm_fwd)(mt_backend *be, void *y, int ldy, float *rstd, const void *x, int ldx,
                       const void *w, int M, int D, float eps);
    /* dx (= or += if accumulate) and dw [D] (+=) of type dw_type (MT_C_F32
     * or MT_C_BF16): dw = dw + sum over rows (the sum in double, stored
     * through float, then rounded to bf16 when dw is bf16). */
    int (*rmsnorm_bwd)(mt_backend *be, void *dx, int lddx, int accumulate, void *dw, int dw_type,
                       const void *dy, int lddy, const void *x, int ldx, const void *w,
                       const float *rstd, int M, int D);
    /* h [M, F] = silu(gu[:, :F]) * gu[:, F:], gu [M, 2F] act. */
    int (*swiglu_fwd)(mt_backend *be, void *h, const void *gu, int M, int F);
    /* dgu [M, 2F] from dh [M, F] and gu. */
    int (*swiglu_bwd)(mt_backend *be, void *dgu, const void *dh, const void *gu, int M, int F);
    /* y [M, D] = table[ids[m]], table [V, D] act, ids i32; ids[m] < 0 gives a
     * zero row (a vocabulary-parallel embedding's tokens of other ranks). */
    int (*embedding_fwd)(mt_backend *be, void *y, const void *table, const int32_t *ids, int M,
                         int D);
    /* dtable [V, D] += scatter of dy [M, D] by ids; dtable of type dt_type
     * (MT_C_F32 or MT_C_BF16); rows with ids[m] < 0 are skipped (another
     * rank's part of a vocabulary-parallel table). Row v's additions are
     * made in fp32 in increasing m, starting from dtable's value; a bf16 row
     * is rounded once at the end. */
    int (*embedding_bwd)(mt_backend *be, void *dtable, int dt_type, const void *dy,
                         const int32_t *ids, int M, int D);

    /* ---- attention ---------------------------------------------------- */
    /* In-place rotary embedding of R dims of H heads of N = B * T tokens:
     * for token n (position n % T), head h, the R values at
     * x + n * ld + h * hs + off are rotated pairwise by angles of position
     * and frequency: pairs (2i, 2i+1) if interleave, else (i, i + R/2).
     * cos/sin f32 [T, R/2] (YaRN mscale folded in). inverse: rotate by -angle
     * (the backward). */
    int (*rope)(mt_backend *be, void *x, int N, int T, int H, int ld, int hs, int off, int R,
                const float *cos_t, const float *sin_t, int interleave, int inverse);
    /* Causal softmax attention per sequence b < B and head h < H:
     * o[t] = sum_{u <= t} softmax_u(scale * q[t] . k[u]) v[u].
     * q, k [B*T, H, Dqk], v, o [B*T, H, Dv] act; lse [B, H, T] f32 out:
     * the log-sum-exp of the scaled scores of each query. */
    int (*attn_fwd)(mt_backend *be, void *o, float *lse, const void *q, const void *k,
                    const void *v, int B, int T, int H, int Dqk, int Dv, float scale);
    int (*attn_bwd)(mt_backend *be, void *dq, void *dk, void *dv, const void *dout,
                    const void *q, const void *k, const void *v, const void *o,
                    const float *lse, int B, int T, int H, int Dqk, int Dv, float scale);
    /* MLA key/value assembly. kvb [N, H, Dn + Dv] (kv_b output), kpe rows of
     * R values at kpe + n * ld_kpe (shared by all heads):
     *   k[n, h] = [kvb[n, h, :Dn], kpe[n]]  ([N, H, Dn + R]),  v[n, h] = kvb[n, h, Dn:]. */
    int (*mla_kv_fwd)(mt_backend *be, void *k, void *v, const void *kvb, const void *kpe,
                      int ld_kpe, int N, int H, int Dn, int R, int Dv);
    /* Inverse: dkvb = [dk[..., :Dn], dv]; dkpe[n] (=) sum_h dk[n, h, Dn:]. */
    int (*mla_kv_bwd)(mt_backend *be, void *dkvb, void *dkpe, int ld_dkpe, const void *dk,
                      const void *dv, int N, int H, int Dn, int R, int Dv);

    /* ---- MoE ---------------------------------------------------------- */
    /* Router: scores [N, E] f32 = score_fn(logits); selection by the biased
     * scores (scores + bias, bias [E] f32 or NULL), group-limited: keep the
     * topk_group groups with the highest group score, then the top_k experts
     * among them; ties go to the lower index. idx [N, K] i32 in descending
     * biased-score order; w [N, K] f32 = unbiased scores of the chosen,
     * normalised if norm_topk (divided by their sum + 1e-20, also for K = 1),
     * times scaling. */
    int (*router_fwd)(mt_backend *be, int32_t *idx, float *w, float *scores,
                      const float *logits, const float *bias, int N, const mt_router_cfg *cfg);
    /* dlogits [N, E] f32 = d/dlogits of (sum w * dw + sum scores * dscores)
     * (dscores [N, E] f32 may be NULL). Selection is treated as constant. */
    int (*router_bwd)(mt_backend *be, float *dlogits, const float *dw, const float *dscores,
                      const float *scores, const int32_t *idx, int N, const mt_router_cfg *cfg);
    /* Sequence-wise balance loss (DeepSeek-V3 eq. 17-20) over B sequences of
     * T tokens: f_i = E / (K T) * #{t : i chosen}, P_i = mean_t s'(t, i) with
     * s' = scores / sum_j scores; L_b = sum_i f_i P_i. loss f32[1] +=
     * alpha * mean_b L_b; dscores [N, E] f32 (=) grad_scale * dloss/dscores. */
    int (*aux_loss)(mt_backend *be, float *loss, float *dscores, const float *scores,
                    const int32_t *idx, int B, int T, float alpha, float grad_scale,
                    const mt_router_cfg *cfg);
    /* Expert-major order of the N*K assignments, stable by token within an
     * expert, each expert's segment padded with empty rows to a multiple of
     * `align`. Outputs: slot [N, K] i32 (row of assignment (n, k) in the
     * permuted buffer), src [R_cap] i32 (token of each permuted row, -1 for
     * padding and unused rows), counts [E] i32 (assignments per expert, not
     * padded). host_rows [E] (host): padded rows per expert. Synchronises:
     * the host needs the rows to launch expert GEMMs. R_cap >= N*K + E*(align-1). */
    int (*moe_index)(mt_backend *be, int32_t *slot, int32_t *src, int32_t *counts,
                     int *host_rows, const int32_t *idx, int N, int K, int E, int align,
                     int R_cap);
    /* xp [R, D] = x[src[r]] (zero rows where src < 0); x [N, D] act. */
    int (*moe_permute)(mt_backend *be, void *xp, const void *x, const int32_t *src, int R,
                       int D);
    /* dx [N, D] (= or +=) sum_k dxp[slot[n, k]]. */
    int (*moe_permute_bwd)(mt_backend *be, void *dx, int accumulate, const void *dxp,
                           const int32_t *slot, int N, int K, int D);
    /* y [N, D] (= or +=) sum_k w[n, k] * yp[slot[n, k]]. */
    int (*moe_unpermute)(mt_backend *be, void *y, int accumulate, const void *yp,
                         const int32_t *slot, const float *w, int N, int K, int D);
    /* dyp [R, D] = w[n, k] dy[n] at row slot[n, k], zero elsewhere;
     * dw [N, K] f32 = dy[n] . yp[slot[n, k]]. */
    int (*moe_unpermute_bwd)(mt_backend *be, void *dyp, float *dw, const void *dy,
                             const void *yp, const int32_t *slot, const float *w, int N, int K,
                             int D, int R);

    /* FP8 rows of the expert dispatch (the FP8 payload: quantised once,
     * before the rows travel). A wire row holds a token's KB = ceil(D / 128)
     * VEC128 scales (float) then its D e4m3 values padded to 4 bytes:
     * mt_fp8_wire_row_bytes(D) bytes, 4-byte aligned.
     * moe_pack_fp8: wire row r < R = token src[r] of q [N, D] e4m3 with its
     * scales s [KB, N] (quant_rows of the N tokens, G = 1); src[r] in [0, N). */
    int (*moe_pack_fp8)(mt_backend *be, uint8_t *wire, const uint8_t *q, const float *s,
                        const int32_t *src, int N, int R, int D);
    /* moe_unpack_fp8: local row j < M from wire row info[3j] (-1: padding:
     * zero values, scales 1, what quant_rows gives a zero row) into q [M, D]
     * e4m3 with its scales at s[info[3j + 1] + kb * info[3j + 2]] (quant_rows'
     * per-segment layout: base KB r_g + (j - r_g), stride rows[g]), and
     * x [M, D] act = the dequantised values q * s (rounded as act is stored).
     * info [3M] i32 in the backend's memory. */
    int (*moe_unpack_fp8)(mt_backend *be, uint8_t *q, float *s, void *x, const uint8_t *wire,
                          const int32_t *info, int M, int D);

    /* ---- loss ------------------------------------------------------------ */
    /* Cross-entropy fused with the softmax of the head, in place:
     * loss [M] f32 = logsumexp(logits[m]) - logits[m, tgt[m]] (0 if tgt is
     * `ignore`); logits [M, V] act is overwritten with
     * grad_scale * (softmax(logits[m]) - onehot(tgt[m])) (zero row if ignored). */
    int (*xent)(mt_backend *be, float *loss, void *logits, const int32_t *tgt, int M, int V,
                int ignore, float grad_scale);
    /* The same over a vocabulary split into parts (tensor parallelism): this
     * rank's logits [M, V] act are columns [v_lo, v_lo + V) of the full
     * vocabulary; no rank holds a whole row.
     * xent_part_stats: stats [M, 3] f32 = (mx_m = max_j x[m, j],
     *   s_m = sum_j exp(x[m, j] - mx_m) (double, rounded once),
     *   x[m, tgt[m] - v_lo] if v_lo <= tgt[m] < v_lo + V, else 0); ignored
     *   rows and targets outside this part are fine (tgt is a full id).
     * xent_part_finish: from all P parts' stats [P, M, 3] (part order):
     *   MX = max_p mx, S = sum_p s_p exp(mx_p - MX) (p in order, double),
     *   t = sum_p t_p; loss [M] = MX + log(S) - t (0 if tgt is ignore);
     *   logits overwritten with grad_scale * (exp(x - MX) / S - onehot(tgt -
     *   v_lo)) (zero row if ignored). Every part computes the same loss.
     *   P = 1, v_lo = 0 is xent up to rounding. */
    int (*xent_part_stats)(mt_backend *be, float *stats, const void *logits, const int32_t *tgt,
                           int M, int V, int v_lo, int ignore);
    int (*xent_part_finish)(mt_backend *be, float *loss, void *logits, const float *stats, int P,
                            const int32_t *tgt, int M, int V, int v_lo, int ignore,
                            float grad_scale);

    /* ---- optimizer ---------------------------------------------------- */
    /* out f32[1] = sum of squares of g [n] f32, or bf16 bits when g_bf16
     * (deterministic). */
    int (*sumsq)(mt_backend *be, float *out, const void *g, int g_bf16, int64_t n);
    /* x f32 [n] *= a. */
    int (*scale_f32)(mt_backend *be, float *x, int64_t n, float a);
    /* AdamW on n elements, every step in fp32:
     *   g = grad * grad_scale; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2
     *   p -= lr * (m / bc1 / (sqrt(v / bc2) + eps) + wd * p)
     * m, v are bf16 bits (round to nearest even on store); p is f32, or bf16
     * bits when p_bf16 (round to nearest even). grad is f32, or bf16 bits
     * when hp->grad_bf16. act, when not NULL: [n] of the act type, set to
     * act_from_f32 of the updated p (bf16: of its rounded value), the
     * weight's compute copy written in the same pass over p. */
    int (*adamw)(mt_backend *be, void *p, int p_bf16, uint16_t *m, uint16_t *v,
                 const void *grad, int64_t n, const mt_adamw_hp *hp, void *act);
    /* AdamW of an FP8 weight's main copy fused with its re-quantisation:
     * p [N, K] (f32, or bf16 bits when p_bf16), m, v, grad as adamw; then
     * q, s = quant_blocks(p) and qt, st = transpose_blocks(q, s), all from
     * the updated p (bf16: its rounded value). Bit-identical to those three
     * ops in sequence; one pass over memory instead of three on the GPU. */
    int (*adamw_fp8)(mt_backend *be, void *p, int p_bf16, uint16_t *m, uint16_t *v,
                     const void *grad, int N, int K, const mt_adamw_hp *hp, uint8_t *q,
                     float *s, uint8_t *qt, float *st);
    /* adamw_fp8 of n weights that share no memory, each with hp but its own
     * weight_decay: the same bits as n adamw_fp8 calls; the backend may run
     * them at once (CUDA: over the expert streams, joined before the next
     * op). The optimizer's FP8 weights in one call. */
    int (*adamw_fp8_n)(mt_backend *be, int n, const mt_adamw_fp8_arg *w, const mt_adamw_hp *hp);
    /* AdamW of an FP8 weight that has no main copy (main_params none):
     * q [N, K] with its block scales s is the weight; slab by slab (rows
     * [r0, r0 + slab_rows), or the whole weight when slab_rows >= N;
     * otherwise slab_rows is a multiple of 128):
     *   w = dequant_blocks(q, s); adamw(w, m, v, grad, hp);
     *   q, s = quant_blocks_sr(w, sd), sd = seed for one slab, else
     *   mt_hash_u64(seed, r0 / slab_rows + 1) (elements numbered from the
     *   slab's start)
     * then qt, st = transpose_blocks(q, s). Bit-identical to those ops in
     * sequence; one pass on the GPU. */
    int (*adamw_fp8_sr)(mt_backend *be, uint8_t *q, float *s, uint16_t *m, uint16_t *v,
                        const void *grad, int N, int K, const mt_adamw_hp *hp, uint64_t seed,
                        int slab_rows, uint8_t *qt, float *st);
    /* adamw_fp8_sr of n weights in one call, each with its own decay (hp's
     * weight_decay is not read): the same bits as n adamw_fp8_sr calls in
     * any order (the weights share no memory). The GPU runs them on the
     * expert streams, one weight's last blocks beside the next one's first. */
    int (*adamw_fp8_sr_n)(mt_backend *be, int n, const mt_adamw_fp8_sr_arg *w,
                          const mt_adamw_hp *hp);
    /* AdamW of a weight of the act type that has no main copy (main_params
     * none: embedding, head, norms): w [n] act is the weight, updated in
     * place as
     *   x = act_to_f32(w); adamw(x, m, v, grad, n, hp); w = act_from_f32_sr(x, seed)
     * (elements numbered from w). Bit-identical to those ops in sequence;
     * one pass on the GPU instead of three and no f32 copy. */
    int (*adamw_sr)(mt_backend *be, void *w, uint16_t *m, uint16_t *v, const void *grad,
                    int64_t n, const mt_adamw_hp *hp, uint64_t seed);
    /* Stochastic rounding (the main_params "none" mode, where the compute
     * copy is the only copy of a weight). The random bits of element i are
     * mt_hash_u64(seed, i) on every backend, so results are bit-identical.
     * act_from_f32_sr: dst act = src rounded to bf16 up or down with
     * probability proportional to closeness (CPU: stored as float), adding
     * the low 16 bits of mt_hash_u64(seed, i) below the bf16
     * mantissa (mt_bf16_from_f32_sr).
     * quant_blocks_sr: as quant_blocks, with each q rounded to one of its two
     * neighbouring e4m3 values likewise (scales from the block amax): element
     * (n, k) goes up when mt_hash_uniform(seed, n * K + k) < its fraction
     * (mt_e4m3_from_f32_sr). */
    int (*act_from_f32_sr)(mt_backend *be, void *dst, const float *src, int64_t n,
                           uint64_t seed);
    int (*quant_blocks_sr)(mt_backend *be, uint8_t *q, float *s, const float *w, int N, int K,
                           uint64_t seed);
    /* dst f32 [n] = bf16 bits src [n] (a bf16 master copy). */
    int (*bf16_to_f32)(mt_backend *be, float *dst, const uint16_t *src, int64_t n);
};

/* Backends. The CPU backend uses `threads` worker threads (0: all cores). */
int mt_backend_cpu_create(mt_backend **out, int threads);
/* The CUDA backend on `device`, with a memory arena of arena_bytes (0: all
 * but a reserve of the free memory). Returns MT_ENOTSUP in CPU-only builds. */
int mt_backend_cuda_create(mt_backend **out, int device, size_t arena_bytes);
/* The same for `sharers` processes using the device at once (several ranks
 * on one GPU, as the tests run): an arena of total / sharers less the
 * reserve. */
int mt_backend_cuda_create_shared(mt_backend **out, int device, int sharers);
/* As mt_backend_cuda_create_shared, leaving `reserve` bytes of the device
 * outside the arena (0: the default 1.5 GB). A rank among several needs
 * more beside the arena: NCCL's buffers for each communicator and the comm
 * layer's stream-ordered temporaries (engine/parallel/comm_nccl.c). */
int mt_backend_cuda_create_reserve(mt_backend **out, int device, int sharers, size_t reserve);
/* Number of CUDA devices usable now (0 without a driver or in CPU-only builds). */
int mt_cuda_device_count(void);

/* Checks a host rows[G] array of segment sizes (non-negative, total fits an
 * int) and returns the total in *total; MT_EINVAL naming `op` otherwise. */
static inline int mt_segments_total(const char *op, const int *rows, int G, int *total)
{
    *total = 0;
    if (G < 1 || !rows) return MT_ERR(MT_EINVAL, "%s: %d segments (rows %p)", op, G, (const void *)rows);
    int64_t sum = 0;
    for (int g = 0; g < G; g++) {
        if (rows[g] < 0) return MT_ERR(MT_EINVAL, "%s: rows[%d]=%d is negative", op, g, rows[g]);
        sum += rows[g];
    }
    if (sum > 0x7fffffff) return MT_ERR(MT_EINVAL, "%s: %lld rows in all is too many", op, (long long)sum);
    *total = (int)sum;
    return MT_OK;
}

/* Bytes of one FP8 wire row of D values (moe_pack_fp8). */
static inline size_t mt_fp8_wire_row_bytes(int D)
{
    return 4 * (size_t)((D + 127) / 128) + 4 * (size_t)((D + 3) / 4);
}

/* Bytes of one act element. */
static inline size_t mt_act_size(const mt_backend *be) { return (size_t)be->act_bytes; }

/* Bytes of one element of a C / gradient of type t on backend be. */
static inline size_t mt_c_size(const mt_backend *be, int t)
{
    return t == MT_C_F32 ? 4 : t == MT_C_BF16 ? 2 : mt_act_size(be);
}

#ifdef __cplusplus
}
#endif

#endif
