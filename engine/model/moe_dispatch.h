/* moe_dispatch.h - moving routed tokens to the ranks that own their experts.
 *
 * The MoE layer permutes its N tokens' N * K assignments into expert-major
 * order (xp [R, D], rows[E] per global expert: the source layout); the
 * dispatcher turns that buffer into the rows of this rank's local experts
 * (xl [Rl, D], one segment per local expert padded to `align` rows: the
 * local layout, what the grouped expert GEMMs read) and combine brings the
 * experts' outputs back into the source layout. Backward runs the same two
 * exchanges for the gradients: dispatch dyp -> dyl, combine dxl -> dxp.
 *
 * Expert ownership (engine/parallel/sharding.h): with EP ranks, rank r of
 * the ep group owns the E / EP consecutive experts [r E / EP, (r + 1) E / EP),
 * so the source layout is already grouped by destination rank: the block
 * for rank p is the contiguous rows of p's experts.
 *
 * On one rank (ep = 1, the identity) nothing moves: xl is xp itself and
 * the segments are the source's. Under expert parallelism
 * (engine/parallel/moe_a2a.h) a dispatch first exchanges the per-expert
 * row counts, then the rows (all-to-all-v over the ep group); on arrival
 * the rows from every source are laid out expert-contiguous (source rank
 * order within an expert, each source's rows in their order), each
 * source's chunk zero-padded to `align` (a local expert's segment is its
 * chunks). No row is ever dropped.
 */
#ifndef MT_MOE_DISPATCH_H
#define MT_MOE_DISPATCH_H

#include <stdint.h>

#include "kernels/ops.h"

typedef struct mt_moe_dispatcher mt_moe_dispatcher;

/* What one MoE layer's forward dispatch moved (host arrays), kept for its
 * combine and for the backward's exchanges. One per MoE layer: the forward
 * of every layer runs before any backward. */
typedef struct mt_moe_plan {
    int ep, E_local;    /* peers, local experts */
    int align;          /* local segments padded to a multiple of this (>= 1) */
    int R;              /* rows of the source layout (sum of rows[E]) */
    int Rl;             /* rows of the local layout, padding included */
    int64_t Rl_cap;     /* rows the caller's local buffers hold (a dispatch refuses more) */
    int *local_rows;    /* [E_local]: padded rows of each local expert's segment */
    int64_t *from;      /* [ep * E_local]: rows from peer q for local expert e at q * E_local + e */
    int64_t *sent;      /* [ep]: source rows sent to peer p (the rows of p's experts) */
    int64_t *to;        /* [ep * E_local]: rows sent to peer p for its local expert e at
                           p * E_local + e */
} mt_moe_plan;

int mt_moe_plan_init(mt_moe_plan *p, int ep, int E_local, int align);
void mt_moe_plan_free(mt_moe_plan *p);

struct mt_moe_dispatcher {
    int E;        /* global experts */
    int e_lo;     /* first local expert */
    int E_local;  /* local experts */
    int ep;       /* ranks of the exchange (ep x etp, moe_a2a.h); 1: the identity */
    /* Expert tensor parallelism: each local expert is one of etp slices
     * (gate / up rows, down columns: part etp_rank of etp); every slice
     * receives all the expert's rows and combine sums the slices' partial
     * outputs. 1 / 0: whole experts. */
    int etp, etp_rank;
    /* xl = rows of the local experts gathered from every rank's source
     * layout (rows[E] host): xp [R, D], or, when x is not NULL, row r taken
     * from x [N, D] at src[r] (the layer's permutation fused into the pack:
     * the source layout is never written; the identity needs xp and ignores
     * x). count = 1 (forward): the row counts are exchanged and recorded in
     * the plan (local_rows, Rl, from, sent); count = 0 (backward): the plan
     * of the forward is reused, so the rows must have the forward's layout.
     * The identity sets *xl = xp (no copy); others write xl_buf [Rl, D] and
     * set *xl = xl_buf. Collective over the ep group. */
    int (*dispatch)(mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p, int count, void **xl,
                    void *xl_buf, const void *xp, const void *x, const int32_t *src,
                    const int *rows, int D);
    /* The forward's dispatch with the FP8 payload (NULL where not offered:
     * the identity). The tokens come quantised once, xq [N, D] e4m3 with
     * their VEC128 scales xs [KB, N] (quant_rows, G = 1); row r of the
     * source layout is token src[r]. Rows travel as e4m3 plus their 1x128
     * scales (mt_fp8_wire_row_bytes(D) bytes each). Counts are exchanged
     * and recorded as dispatch with count = 1 does. On arrival, the local
     * layout three ways: ql [Rl, D] e4m3 with its scales sl in quant_rows'
     * per-segment layout over plan->local_rows (what quant_rows of the
     * local rows gives, bit for bit: the tiles are per row), and
     * xl_buf [Rl, D] act = the dequantised values (the weight gradient's
     * input in the backward). Collective over the ep group. */
    int (*dispatch_fp8)(mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p, uint8_t *ql,
                        float *sl, void *xl_buf, const uint8_t *xq, const float *xs, int N,
                        const int32_t *src, const int *rows, int D);
    /* yp [R, D] (source layout) = this rank's rows back from every rank's
     * yl [Rl, D] (local layout; padding rows are not sent). Collective. */
    int (*combine)(mt_moe_dispatcher *d, mt_backend *be, const mt_moe_plan *p, void *yp,
                   const void *yl, int D);
    /* Overlap (parallel.ep_overlap = halves, engine/model/layer_moe.c):
     * the exchanges above cut into parts of the local experts and started
     * apart from their finish, so that the caller computes while a part
     * travels. NULL on the identity (nothing travels). A part [e0, e1) of
     * the local experts moves the rows of every owner's experts e0..e1-1
     * (local index): a dispatch lands them in the local layout's segments
     * [e0, e1) (contiguous rows: local_rows[e0] + ... after the segments
     * before), a combine lands them at their rows of the source layout.
     * The results of the parts [0, h) and [h, E_local) together are those
     * of the whole exchange, bit for bit (the same rows at the same
     * places). One exchange is in flight per dispatcher: each start is
     * followed by finish before the next start (or count exchange).
     *   counts:   the forward's count exchange alone (the plan, as dispatch
     *             with count = 1 fills it); collective;
     *   dispatch_start, dispatch_fp8_start, combine_start: pack the part
     *             and start its exchange (arguments as dispatch with
     *             count = 0, dispatch_fp8 and combine; the plan is read);
     *   finish:   waits for the exchange in flight and unpacks it.
     * Between a start and its finish the caller must not touch the part's
     * output rows (and, for a backward dispatch, xp). Device ep groups:
     * the exchange runs on the group's side stream and the backend's
     * stream waits for it at finish only (comm.h, mt_comm_all_to_all_v_start).
     * Expert tensor parallelism (etp > 1) takes whole exchanges only. */
    int (*counts)(mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p, const int *rows);
    int (*dispatch_start)(mt_moe_dispatcher *d, mt_backend *be, const mt_moe_plan *p, int e0,
                          int e1, void *xl_buf, const void *xp, const void *x,
                          const int32_t *src, int D);
    int (*dispatch_fp8_start)(mt_moe_dispatcher *d, mt_backend *be, const mt_moe_plan *p, int e0,
                              int e1, uint8_t *ql, float *sl, void *xl_buf, const uint8_t *xq,
                              const float *xs, int N, const int32_t *src, int D);
    int (*combine_start)(mt_moe_dispatcher *d, mt_backend *be, const mt_moe_plan *p, int e0,
                         int e1, void *yp, const void *yl, int D);
    int (*finish)(mt_moe_dispatcher *d);
    void (*destroy)(mt_moe_dispatcher *d);
    void *impl;
};

/* The single-rank dispatcher: all experts are local, nothing moves. */
int mt_moe_dispatch_identity(mt_moe_dispatcher **out, int E);

/* Rows of the local layout at most: every source's N * K assignments may
 * go to this rank's experts (skewed routing), plus the padding of each
 * (source, local expert) chunk. The identity needs N * K + E * (align - 1),
 * the source's own. */
static inline int64_t mt_moe_local_rows_cap(const mt_moe_dispatcher *d, int N, int K, int align)
{
    return (int64_t)d->ep * N * K + (int64_t)d->ep * d->E_local * (align - 1);
}

#endif
