/* tp.c - the tensor-parallel pieces the layers share (layers.h).
 *
 * Vocabulary-parallel cross-entropy: each rank holds V / tp rows of the
 * head, so its logits are [N, V / tp]. Per row it computes (max, sum of
 * exp below the max, the target's logit if it owns the target) over its
 * columns; the [tp, N, 3] statistics are gathered (N * 3 floats per rank,
 * never a logit), and every rank combines them in rank order, so the loss
 * is the same on every rank and its gradient columns are its own.
 *
 * Sequence parallelism: rank r holds rows [r N / tp, (r + 1) N / tp) between
 * the regions, so an all-gather of every rank's rows is the full [N, D] in
 * row order and a reduce-scatter of a full partial sum leaves each rank its
 * rows of the sum.
 */
#include "engine/model/layers.h"
#include "base/mt_status.h"

int mt_tp_sum(const mt_ctx *c, void *x, int64_t n)
{
    if (!mt_tp_on(c)) return MT_OK;
    return c->tp->sum_act(c->tp, x, n);
}

int mt_tp_gather_rows(const mt_ctx *c, const void *rows, void *full, int D)
{
    return c->tp->gather_act(c->tp, rows, full, (int64_t)mt_tp_rows(c) * D);
}

int mt_tp_scatter_rows(const mt_ctx *c, const void *full, void *rows, int D)
{
    return c->tp->reduce_scatter_act(c->tp, full, rows, (int64_t)mt_tp_rows(c) * D);
}

int mt_tp_xent(const mt_ctx *c, float *loss, void *logits, const int32_t *tgt, int N, int V,
               int v_lo, float grad_scale)
{
    mt_backend *be = c->be;
    if (!mt_tp_on(c)) return be->xent(be, loss, logits, tgt, N, V, MT_IGNORE, grad_scale);
    const int P = c->tp->size;
    size_t mark = mt_ws_mark(c->ws);
    float *st, *all;
    MT_WS(st, c->ws, (size_t)N * 3 * 4);
    MT_WS(all, c->ws, (size_t)P * N * 3 * 4);
    MT_CHECK(be->xent_part_stats(be, st, logits, tgt, N, V, v_lo, MT_IGNORE));
    MT_CHECK(c->tp->gather_f32(c->tp, st, all, (int64_t)N * 3));
    MT_CHECK(be->xent_part_finish(be, loss, logits, all, P, tgt, N, V, v_lo, MT_IGNORE,
                                  grad_scale));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}
