/* tp.h - what a tensor-parallel model needs from its tp group.
 *
 * The model (engine/model) may not reach other ranks itself: as with the
 * MoE dispatcher, engine/parallel implements this table over the comm
 * interface (engine/parallel/tp_comm.h) and hands it in through
 * mt_model_opts.tp. Every op is collective over the tp group, and its
 * result is the same, bit for bit, on every rank (comm.h's rule): this is
 * what keeps the replicated parameters' gradients identical on the tp ranks
 * without a reduction of their own.
 *
 * Buffers are backend memory; act buffers hold the backend's act elements
 * (f32 on the CPU, bf16 on CUDA; sums in f32, rounded once).
 */
#ifndef MT_MODEL_TP_H
#define MT_MODEL_TP_H

#include <stdint.h>

#include "kernels/ops.h"

typedef struct mt_tp mt_tp;

struct mt_tp {
    int size, rank;
    /* Sequence parallelism (parallel.sequence_parallel): between the
     * tensor-parallel regions every rank holds rows [rank N / size,
     * (rank + 1) N / size) of the N tokens; regions start with an all-gather
     * and end with a reduce-scatter (N must divide by size). */
    int sp;
    /* x act [n] = the sum over the group (in place). */
    int (*sum_act)(mt_tp *t, void *x, int64_t n);
    /* recv f32 [size, n] = every rank's send f32 [n], in rank order. */
    int (*gather_f32)(mt_tp *t, const float *send, float *recv, int64_t n);
    /* recv act [size, n] = every rank's send act [n] (sequence parallelism). */
    int (*gather_act)(mt_tp *t, const void *send, void *recv, int64_t n);
    /* recv act [n] = the sum over the group of block `rank` of send act
     * [size, n] (sequence parallelism). */
    int (*reduce_scatter_act)(mt_tp *t, const void *send, void *recv, int64_t n);
    void (*destroy)(mt_tp *t);
    void *impl;
};

#endif
