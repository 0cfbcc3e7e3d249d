/* moe_dispatch.h - moving routed tokens to the ranks that own their experts.
 *
 * The MoE layer permutes its tokens into expert-major order (padded segments
 * per global expert, rows[E]); the dispatcher turns that buffer into the rows
 * of this rank's local experts and back. On one rank (ep = 1) it is the
 * identity; under expert parallelism it is an all-to-all of the segments
 * (comm layer). Backward runs the same exchanges in the other direction.
 */
#ifndef MT_MOE_DISPATCH_H
#define MT_MOE_DISPATCH_H

#include "kernels/ops.h"

typedef struct mt_moe_dispatcher mt_moe_dispatcher;

struct mt_moe_dispatcher {
    int E;        /* global experts */
    int e_lo;     /* first local expert */
    int E_local;  /* local experts */
    /* xl [Rl, D] = rows of local experts gathered from every rank's xp [R, D];
     * local_rows[E_local] (host) out. xl may alias xp when nothing moves. */
    int (*dispatch)(mt_moe_dispatcher *d, mt_backend *be, void **xl, int *local_rows,
                    void *xp, const int *rows, int D);
    /* yp [R, D] = this rank's rows back from every rank's yl [Rl, D]. */
    int (*combine)(mt_moe_dispatcher *d, mt_backend *be, void *yp, const void *yl,
                   const int *rows, int D);
    void (*destroy)(mt_moe_dispatcher *d);
    void *impl;
};

/* The single-rank dispatcher: all experts are local, nothing moves. */
int mt_moe_dispatch_identity(mt_moe_dispatcher **out, int E);

#endif
