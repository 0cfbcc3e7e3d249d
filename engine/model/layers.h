/* layers.h - forward / backward of each layer (engine-internal).
 *
 * Every function takes the run context and its own layer struct; inputs and
 * outputs are [N, *] act buffers of the backend. A backward reads what its
 * forward saved and accumulates parameter gradients (f32, +=). "accumulate"
 * on an input gradient means dx += ..., otherwise dx = ....
 */
#ifndef MT_LAYERS_H
#define MT_LAYERS_H

#include "engine/model/model.h"

/* ---- workspace (model.c) ---- */
/* Transient buffer of `bytes` (256-byte aligned) or NULL with an error set. */
void *mt_ws_get(mt_ws *ws, size_t bytes);
static inline size_t mt_ws_mark(const mt_ws *ws) { return ws->top; }
static inline void mt_ws_release(mt_ws *ws, size_t mark) { ws->top = mark; }

#define MT_WS(ptr, ws, bytes)                                                  \
    do {                                                                       \
        (ptr) = mt_ws_get((ws), (bytes));                                      \
        if (!(ptr)) return MT_ENOMEM;                                          \
    } while (0)

/* ---- tp.c: tensor-parallel pieces (no-ops / the plain op without tp) ---- */
/* Is the context tensor-parallel (a tp group of more than one rank)? */
static inline int mt_tp_on(const mt_ctx *c) { return c->tp && c->tp->size > 1; }
/* x act [n] summed over the tp group, in place (the end of a region). */
int mt_tp_sum(const mt_ctx *c, void *x, int64_t n);
/* Sequence parallelism (tp.h): between the regions a rank holds rows
 * [row0, row0 + rows) of the N tokens, stored at the start of the [N, *]
 * buffers; inside a region every row. Without it: all N rows. */
static inline int mt_tp_sp(const mt_ctx *c) { return mt_tp_on(c) && c->tp->sp; }
static inline int mt_tp_rows(const mt_ctx *c) { return mt_tp_sp(c) ? c->N / c->tp->size : c->N; }
static inline int mt_tp_row0(const mt_ctx *c)
{
    return mt_tp_sp(c) ? c->tp->rank * (c->N / c->tp->size) : 0;
}
/* The token rows [*lo, *lo + *n) of the N whose routed-expert work this rank
 * does (router top-k, dispatch, experts, combine): under tensor parallelism
 * its 1/tp share (rows [r N / tp, (r + 1) N / tp): under sequence
 * parallelism its own rows), so that no token reaches the experts twice;
 * without it all N. */
static inline void mt_tp_share(const mt_ctx *c, int *lo, int *n)
{
    if (!mt_tp_on(c)) {
        *lo = 0;
        *n = c->N;
        return;
    }
    const int64_t P = c->tp->size, r = c->tp->rank;
    *lo = (int)(r * c->N / P);
    *n = (int)((r + 1) * c->N / P) - *lo;
}
/* Region entry: full [N, D] act = every rank's rows [rows, D] (all-gather). */
int mt_tp_gather_rows(const mt_ctx *c, const void *rows, void *full, int D);
/* Region exit: rows [rows, D] act = this rank's rows of the sum over the
 * group of full [N, D] (reduce-scatter). */
int mt_tp_scatter_rows(const mt_ctx *c, const void *full, void *rows, int D);
/* Cross-entropy of logits [N, V] (this rank's vocabulary columns [v_lo, v_lo
 * + V)) in place, as be->xent: vocabulary-parallel under tp (statistics
 * gathered over the group, no full row anywhere). */
int mt_tp_xent(const mt_ctx *c, float *loss, void *logits, const int32_t *tgt, int N, int V,
               int v_lo, float grad_scale);

/* ---- linear.c: y = x W^T in the recipe's precision ---- */
int mt_linear_fwd(const mt_ctx *c, const mt_param *w, void *y, int ldy, const void *x, int ldx,
                  int M);
/* dx (= or += with accumulate; dx NULL: skip) and dW += dy^T x. */
int mt_linear_bwd(const mt_ctx *c, mt_param *w, void *dx, int lddx, int accumulate,
                  const void *dy, int lddy, const void *x, int ldx, int M);
/* Grouped over expert segments: w = first expert's param of a contiguous run. */
int mt_linear_grouped_fwd(const mt_ctx *c, const mt_param *w, void *y, int ldy, const void *x,
                          int ldx, const int *rows, int G);
int mt_linear_grouped_bwd(const mt_ctx *c, mt_param *w, void *dx, int lddx, int accumulate,
                          const void *dy, int lddy, const void *x, int ldx, const int *rows,
                          int G);
/* Two projections of one input x [M, K] (gate and up; q_a and kv_a), x
 * quantised once: y_i = x W_i^T. Results as two single calls. */
int mt_linear_fwd2(const mt_ctx *c, const mt_param *w1, void *y1, int ldy1, const mt_param *w2,
                   void *y2, int ldy2, const void *x, int ldx, int M);
/* dx (= or +=) dy1 W1 + dy2 W2 (in that order), dW_i += dy_i^T x. */
int mt_linear_bwd2(const mt_ctx *c, mt_param *w1, const void *dy1, int lddy1, mt_param *w2,
                   const void *dy2, int lddy2, void *dx, int lddx, int accumulate, const void *x,
                   int ldx, int M);
int mt_linear_grouped_fwd2(const mt_ctx *c, const mt_param *w1, void *y1, int ldy1,
                           const mt_param *w2, void *y2, int ldy2, const void *x, int ldx,
                           const int *rows, int G);
/* mt_linear_grouped_fwd2 from an input quantised already (FP8 weights of
 * K = w1's columns): xq [M, K] e4m3 with quant_rows' per-segment scales xs,
 * as lin_fwd would make them - the same GEMMs, without that pass. */
int mt_linear_grouped_fwd2_q(const mt_ctx *c, const mt_param *w1, void *y1, int ldy1,
                             const mt_param *w2, void *y2, int ldy2, const uint8_t *xq,
                             const float *xs, const int *rows, int G);
int mt_linear_grouped_bwd2(const mt_ctx *c, mt_param *w1, const void *dy1, int lddy1,
                           mt_param *w2, const void *dy2, int lddy2, void *dx, int lddx,
                           int accumulate, const void *x, int ldx, const int *rows, int G);
/* The backward split (model.h, mt_wdefer): with c->defer set the backwards
 * above record their weight-gradient GEMMs instead of running them. */
int mt_wdefer_mark(mt_wdefer *d, int layer);
/* Runs a GEMM record (not a mark) as the backward would have. */
int mt_wdefer_replay(const mt_ctx *c, const mt_wdefer_rec *r);
void mt_wdefer_free(mt_wdefer *d, mt_backend *be);
/* Backend bytes the list holds (capacity). */
size_t mt_wdefer_bytes(const mt_wdefer *d);
/* Does this parameter compute in FP8 under the context's recipe? */
int mt_linear_is_fp8(const mt_ctx *c, const mt_param *w);
/* Transient bytes a linear of [M, in] -> [M, out] needs at most. */
size_t mt_linear_ws_bytes(int64_t M, int64_t in, int64_t out);
/* Whether a weight-gradient GEMM into the gradients of w[0..n) (a run of
 * experts, or one weight) adds to them (*accumulate 1) or writes them (0:
 * all stale, mt_model_zero_grads_deferred). Marks them written; in a run
 * of stale and written ones (one GEMM call shares beta) the stale ones are
 * zeroed first. */
int mt_grad_accumulate(const mt_ctx *c, mt_param *w, int n, int *accumulate);

/* ---- layer_mla.c ---- */
int mt_mla_init(mt_mla *a, mt_backend *be, const mt_model_config *cfg, int N, int B, int T,
                int recompute);
void mt_mla_free(mt_mla *a, mt_backend *be);
/* y [N, D] = attn(norm(x)) (no residual). */
int mt_mla_fwd(const mt_ctx *c, mt_mla *a, void *y, const void *x);
/* dx += d/dx of the layer given dy. */
int mt_mla_bwd(const mt_ctx *c, mt_mla *a, void *dx, const void *dy, const void *x);
size_t mt_mla_ws_bytes(const mt_model_config *cfg, int N);

/* ---- layer_ffn.c ---- */
int mt_ffn_init(mt_ffn *f, mt_backend *be, int N, int D, int F, int recompute);
void mt_ffn_free(mt_ffn *f, mt_backend *be);
/* y [N, D] (= or += with accumulate) = down(silu(gate(xn)) * up(xn)). */
int mt_ffn_fwd(const mt_ctx *c, mt_ffn *f, void *y, int accumulate, const void *xn);
int mt_ffn_bwd(const mt_ctx *c, mt_ffn *f, void *dxn, int accumulate, const void *dy,
               const void *xn);
size_t mt_ffn_ws_bytes(int N, int D, int F);

/* ---- layer_moe.c ---- */
int mt_moe_init(mt_moe *m, mt_backend *be, const mt_model_config *cfg, const mt_model_opts *o,
                int N, mt_moe_dispatcher *disp);
void mt_moe_free(mt_moe *m, mt_backend *be);
/* y [N, D] = shared(xn) + sum_k w_k expert_k(xn); aux loss accumulated.
 * Tensor parallelism: y is this rank's term of a sum over the tp group (its
 * shared-expert columns on every row plus the routed experts of its share
 * of the rows, mt_tp_share, zero elsewhere), and so is the backward's dxn;
 * the caller sums them (all-reduce, or reduce-scatter under sequence
 * parallelism). The router and the balance loss run on every row (the
 * sequence-wise loss needs whole sequences; [N, E] against the experts'
 * [N K / tp, 3 D F]), its backward on the share only (the router's weight
 * gradient is a term of a sum over tp too: trainer_tp.c). */
int mt_moe_fwd(const mt_ctx *c, mt_moe *m, void *y, const void *xn, double aux_alpha,
               float grad_scale);
int mt_moe_bwd(const mt_ctx *c, mt_moe *m, void *dxn, const void *dy, const void *xn);
/* Expert segment padding (align: local layout, src_align: source layout)
 * and the row capacities of the source and local layouts of a micro-batch
 * of N tokens under a dispatcher (under tp of a rank's share of them). */
void mt_moe_caps(const mt_model_config *cfg, const mt_model_opts *o, int N,
                 const mt_moe_dispatcher *disp, int *align, int *src_align, int64_t *R_cap,
                 int64_t *Rl_cap);
size_t mt_moe_ws_bytes(const mt_model_config *cfg, int N, int64_t R_cap, int64_t Rl_cap);

/* ---- layer_block.c ---- */
int mt_block_init(mt_block *b, mt_backend *be, const mt_model_config *cfg,
                  const mt_model_opts *o, int layer, int N, mt_moe_dispatcher *disp);
void mt_block_free(mt_block *b, mt_backend *be);
/* out = block(x); x and out are [N, D] and must differ. */
int mt_block_fwd(const mt_ctx *c, mt_block *b, void *out, const void *x, double aux_alpha,
                 float aux_grad_scale);
/* dx = d/dx given dout (dx and dout may alias: the residual passes through). */
int mt_block_bwd(const mt_ctx *c, mt_block *b, void *dx, const void *dout, const void *x);
/* Binds the block's parameter pointers from the model's table. */
int mt_block_bind(mt_block *b, mt_param *params, const mt_param_table *t, int layer);

/* ---- layer_head.c ---- */
int mt_head_init(mt_head *h, mt_backend *be, int N, int D);
void mt_head_free(mt_head *h, mt_backend *be);
/* Final norm, logits and fused cross-entropy of hidden x [N, D] against
 * tgt [N]; loss per token in h->loss; logits [N, V] left holding their
 * gradient (grad_scale per token). Returns the loss sum on the host. */
int mt_head_fwd(const mt_ctx *c, mt_head *h, void *logits, const void *x, const int32_t *tgt,
                int V, float grad_scale, float *host_loss, double *loss_sum, int64_t *count,
                const int32_t *host_tgt);
/* mt_head_fwd in its two halves, for a caller that reads the logits
 * between them (scoring): logits [N, V] act = head(norm(x)), then the loss
 * (the logits overwritten by their gradient). */
int mt_head_logits(const mt_ctx *c, mt_head *h, void *logits, const void *x, int V);
int mt_head_loss(const mt_ctx *c, mt_head *h, void *logits, const int32_t *tgt, int V,
                 float grad_scale, float *host_loss, double *loss_sum, int64_t *count,
                 const int32_t *host_tgt);
/* dx (= or +=) from the logits' gradient; head and norm gradients +=. */
int mt_head_bwd(const mt_ctx *c, mt_head *h, void *dx, int accumulate, const void *logits,
                const void *x, int V);

/* ---- layer_mtp.c ---- */
int mt_mtp_init(mt_mtp *p, mt_backend *be, const mt_model_config *cfg, const mt_model_opts *o,
                int depth, int N, mt_moe_dispatcher *disp);
void mt_mtp_free(mt_mtp *p, mt_backend *be);
/* hout = block(eh_proj([enorm(emb(ids)), hnorm(h)])). */
int mt_mtp_fwd(const mt_ctx *c, mt_mtp *p, const mt_param *embed, const void *h,
               double aux_alpha, float aux_grad_scale);
/* dh (+=) and dembed from dhout. */
int mt_mtp_bwd(const mt_ctx *c, mt_mtp *p, mt_param *embed, void *dh, const void *dhout,
               const void *h);

/* ---- rope_table.c ---- */
/* cos / sin f32 [T, R/2] (host) with YaRN frequencies and attention factor;
 * *attn_scale = softmax scale incl. mscale^2. */
int mt_rope_tables(const mt_model_config *cfg, int T, float *cos_t, float *sin_t,
                   float *attn_scale);

#endif
