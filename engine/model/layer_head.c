/* layer_head.c - final RMSNorm, output head and cross-entropy (main model and
 * each MTP module's shared_head), with the loss gradient fused into the
 * softmax: after the forward the logits buffer holds dL/dlogits.
 * Tensor parallelism: the head holds vocabulary rows [v_lo, v_lo + V) and
 * the logits are those columns (mt_tp_xent); the hidden state's gradient
 * is summed over the tp group.
 */
#include <stdlib.h>
#include <string.h>

#include "engine/model/layers.h"
#include "base/mt_status.h"

int mt_head_init(mt_head *h, mt_backend *be, int N, int D)
{
    MT_CHECK(be->alloc(be, (size_t)N * D * mt_act_size(be), &h->hn));
    MT_CHECK(be->alloc(be, (size_t)N * 4, (void **)&h->rstd));
    MT_CHECK(be->alloc(be, (size_t)N * 4, (void **)&h->loss));
    return MT_OK;
}

void mt_head_free(mt_head *h, mt_backend *be)
{
    if (h->hn) be->free(be, h->hn);
    if (h->rstd) be->free(be, h->rstd);
    if (h->loss) be->free(be, h->loss);
    h->hn = NULL;
    h->rstd = h->loss = NULL;
}

int mt_head_logits(const mt_ctx *c, mt_head *h, void *logits, const void *x, int V)
{
    mt_backend *be = c->be;
    const int N = c->N, D = (int)h->norm->d.cols;
    if (mt_tp_sp(c)) { /* sequence parallelism: norm of this rank's rows, gathered */
        size_t mark = mt_ws_mark(c->ws);
        void *hl;
        MT_WS(hl, c->ws, (size_t)mt_tp_rows(c) * D * mt_act_size(be));
        MT_CHECK(be->rmsnorm_fwd(be, hl, D, h->rstd, x, D, h->norm->w, mt_tp_rows(c), D,
                                 c->rms_eps));
        MT_CHECK(mt_tp_gather_rows(c, hl, h->hn, D));
        mt_ws_release(c->ws, mark);
    } else {
        MT_CHECK(be->rmsnorm_fwd(be, h->hn, D, h->rstd, x, D, h->norm->w, N, D, c->rms_eps));
    }
    return be->gemm(be, logits, 0, V, h->hn, D, 0, h->head->w, D, 0, N, V, D, 1.0f, 0);
}

int mt_head_loss(const mt_ctx *c, mt_head *h, void *logits, const int32_t *tgt, int V,
                 float grad_scale, float *host_loss, double *loss_sum, int64_t *count,
                 const int32_t *host_tgt)
{
    mt_backend *be = c->be;
    const int N = c->N;
    MT_CHECK(mt_tp_xent(c, h->loss, logits, tgt, N, V, h->v_lo, grad_scale));
    MT_CHECK(be->download(be, host_loss, h->loss, (size_t)N * 4));
    /* Fixed order in double: the same sum on every backend and layout. */
    double s = 0;
    int64_t n = 0;
    for (int i = 0; i < N; i++)
        if (host_tgt[i] != MT_IGNORE) {
            s += host_loss[i];
            n++;
        }
    *loss_sum = s;
    *count = n;
    return MT_OK;
}

int mt_head_fwd(const mt_ctx *c, mt_head *h, void *logits, const void *x, const int32_t *tgt,
                int V, float grad_scale, float *host_loss, double *loss_sum, int64_t *count,
                const int32_t *host_tgt)
{
    MT_CHECK(mt_head_logits(c, h, logits, x, V));
    return mt_head_loss(c, h, logits, tgt, V, grad_scale, host_loss, loss_sum, count, host_tgt);
}

int mt_head_bwd(const mt_ctx *c, mt_head *h, void *dx, int accumulate, const void *logits,
                const void *x, int V)
{
    mt_backend *be = c->be;
    const int N = c->N, D = (int)h->norm->d.cols;
    size_t mark = mt_ws_mark(c->ws);
    void *dhn;
    MT_WS(dhn, c->ws, (size_t)N * D * mt_act_size(be));
    MT_CHECK(be->gemm(be, dhn, 0, D, logits, V, 0, h->head->w, D, 1, N, D, V, 1.0f, 0));
    int acc;
    MT_CHECK(mt_grad_accumulate(c, h->head, 1, &acc));
    MT_CHECK(be->gemm(be, h->head->grad, c->grad_type, D, logits, V, 1, h->hn, D, 1, V, D, N, 1.0f,
                      acc));
    /* vocabulary-parallel: each rank's dhn is its columns' share (sequence
     * parallelism: this rank's rows of the sum) */
    if (mt_tp_sp(c)) {
        void *dl;
        MT_WS(dl, c->ws, (size_t)mt_tp_rows(c) * D * mt_act_size(be));
        MT_CHECK(mt_tp_scatter_rows(c, dhn, dl, D));
        dhn = dl;
    } else {
        MT_CHECK(mt_tp_sum(c, dhn, (int64_t)N * D));
    }
    MT_CHECK(be->rmsnorm_bwd(be, dx, D, accumulate, h->norm->grad, c->grad_type, dhn, D, x, D, h->norm->w,
                             h->rstd, mt_tp_rows(c), D));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}
