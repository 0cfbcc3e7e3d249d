/* layer_ffn.c - SwiGLU feed-forward: the dense FFN and the shared experts.
 *
 *   gu = [gate(xn), up(xn)]   [N, 2F]
 *   h  = silu(gu[:, :F]) * gu[:, F:]   [N, F]
 *   y  = down(h)              [N, D]
 * With recompute (the MoE activation memory saver) h is rebuilt from gu in
 * backward instead of being kept.
 * Tensor parallelism: F is this rank's columns of gate / up and rows of
 * down; y and dxn are summed over the tp group.
 */
#include <string.h>

#include "engine/model/layers.h"
#include "base/mt_status.h"

int mt_ffn_init(mt_ffn *f, mt_backend *be, int N, int D, int F, int recompute)
{
    const size_t act = mt_act_size(be);
    f->D = D;
    f->F = F;
    MT_CHECK(be->alloc(be, (size_t)N * 2 * F * act, &f->gu));
    if (!recompute) MT_CHECK(be->alloc(be, (size_t)N * F * act, &f->h));
    return MT_OK;
}

void mt_ffn_free(mt_ffn *f, mt_backend *be)
{
    if (f->gu) be->free(be, f->gu);
    if (f->h) be->free(be, f->h);
    f->gu = f->h = NULL;
}

size_t mt_ffn_ws_bytes(int N, int D, int F)
{
    /* h (recompute), y (accumulate), dh, dgu, and one linear's transient */
    return 4 * (size_t)N * (F + D + F + 2 * (size_t)F) +
           mt_linear_ws_bytes(N, D > F ? D : F, D > F ? D : F) + 8 * 256;
}

int mt_ffn_fwd(const mt_ctx *c, mt_ffn *f, void *y, int accumulate, const void *xn)
{
    mt_backend *be = c->be;
    const int N = c->N, D = f->D, F = f->F;
    const size_t act = mt_act_size(be);
    size_t mark = mt_ws_mark(c->ws);
    void *h = f->h, *out = y;
    if (!h) MT_WS(h, c->ws, (size_t)N * F * act);
    if (accumulate) MT_WS(out, c->ws, (size_t)N * D * act);
    MT_CHECK(mt_linear_fwd2(c, f->gate, f->gu, 2 * F, f->up, (char *)f->gu + (size_t)F * act,
                            2 * F, xn, D, N));
    MT_CHECK(be->swiglu_fwd(be, h, f->gu, N, F));
    MT_CHECK(mt_linear_fwd(c, f->down, out, D, h, F, N));
    if (!f->no_sum) MT_CHECK(mt_tp_sum(c, out, (int64_t)N * D)); /* row-parallel down: partial sums */
    if (accumulate) MT_CHECK(be->add(be, y, y, out, (int64_t)N * D));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}

int mt_ffn_bwd(const mt_ctx *c, mt_ffn *f, void *dxn, int accumulate, const void *dy,
               const void *xn)
{
    mt_backend *be = c->be;
    const int N = c->N, D = f->D, F = f->F;
    const size_t act = mt_act_size(be);
    size_t mark = mt_ws_mark(c->ws);
    void *h = f->h, *dh, *dgu;
    if (!h) {
        MT_WS(h, c->ws, (size_t)N * F * act);
        MT_CHECK(be->swiglu_fwd(be, h, f->gu, N, F));
    }
    MT_WS(dh, c->ws, (size_t)N * F * act);
    MT_WS(dgu, c->ws, (size_t)N * 2 * F * act);
    MT_CHECK(mt_linear_bwd(c, f->down, dh, F, 0, dy, D, h, F, N));
    MT_CHECK(be->swiglu_bwd(be, dgu, dh, f->gu, N, F));
    /* column-parallel gate / up: each rank's input gradient is a partial
     * sum, summed over the group before it meets other contributions */
    const int sum = mt_tp_on(c) && !f->no_sum;
    void *dx = dxn;
    if (sum && accumulate) MT_WS(dx, c->ws, (size_t)N * D * act);
    MT_CHECK(mt_linear_bwd2(c, f->gate, dgu, 2 * F, f->up, (char *)dgu + (size_t)F * act, 2 * F,
                            dx, D, sum ? 0 : accumulate, xn, D, N));
    if (sum) MT_CHECK(mt_tp_sum(c, dx, (int64_t)N * D));
    if (dx != dxn) MT_CHECK(be->add(be, dxn, dxn, dx, (int64_t)N * D));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}
