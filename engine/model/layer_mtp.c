/* layer_mtp.c - a multi-token prediction module (DeepSeek-V3 section 2.2):
 * depth k combines the previous depth's hidden state with the embedding of
 * the token k ahead and runs one decoder block; its own shared_head.norm and
 * the shared output head predict the token k + 1 ahead.
 *
 *   cat  = [enorm(emb(t_{i+k})), hnorm(h_{k-1})]   [N, 2D]
 *          (embedding first, as in the released checkpoint's eh_proj)
 *   hin  = eh_proj(cat)                             [N, D]
 *   hout = block(hin)                               [N, D]
 */
#include <string.h>

#include "engine/model/layers.h"
#include "base/mt_status.h"

int mt_mtp_init(mt_mtp *p, mt_backend *be, const mt_model_config *cfg, const mt_model_opts *o,
                int depth, int N, mt_moe_dispatcher *disp)
{
    const size_t act = mt_act_size(be), n = (size_t)N, D = (size_t)cfg->hidden_size;
    p->depth = depth;
    MT_CHECK(be->alloc(be, n * D * act, &p->emb));
    MT_CHECK(be->alloc(be, n * 2 * D * act, &p->cat));
    MT_CHECK(be->alloc(be, n * 4, (void **)&p->rstd_e));
    MT_CHECK(be->alloc(be, n * 4, (void **)&p->rstd_h));
    MT_CHECK(be->alloc(be, n * D * act, &p->hin));
    MT_CHECK(be->alloc(be, n * D * act, &p->hout));
    MT_CHECK(be->alloc(be, n * 4, (void **)&p->ids));
    MT_CHECK(be->alloc(be, n * 4, (void **)&p->tgt));
    return mt_block_init(&p->block, be, cfg, o, cfg->num_hidden_layers + depth - 1, N, disp);
}

void mt_mtp_free(mt_mtp *p, mt_backend *be)
{
    void *bufs[] = {p->emb, p->cat, p->rstd_e, p->rstd_h, p->hin, p->hout, p->ids, p->tgt};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    mt_block_free(&p->block, be);
    memset(p, 0, sizeof *p);
}

int mt_mtp_fwd(const mt_ctx *c, mt_mtp *p, const mt_param *embed, const void *h,
               double aux_alpha, float aux_grad_scale)
{
    mt_backend *be = c->be;
    const int N = c->N, D = (int)embed->d.cols, Nl = mt_tp_rows(c);
    char *cat_h = (char *)p->cat + (size_t)D * mt_act_size(be);
    /* vocabulary-parallel: one rank's row each, summed (sequence
     * parallelism: this rank's rows of the sum; everything up to the
     * block's regions runs on them) */
    if (mt_tp_sp(c)) {
        size_t mark = mt_ws_mark(c->ws);
        void *ef;
        MT_WS(ef, c->ws, (size_t)N * D * mt_act_size(be));
        MT_CHECK(be->embedding_fwd(be, ef, embed->w, p->ids, N, D));
        MT_CHECK(mt_tp_scatter_rows(c, ef, p->emb, D));
        mt_ws_release(c->ws, mark);
    } else {
        MT_CHECK(be->embedding_fwd(be, p->emb, embed->w, p->ids, N, D));
        MT_CHECK(mt_tp_sum(c, p->emb, (int64_t)N * D));
    }
    MT_CHECK(be->rmsnorm_fwd(be, p->cat, 2 * D, p->rstd_e, p->emb, D, p->enorm->w, Nl, D,
                             c->rms_eps));
    MT_CHECK(be->rmsnorm_fwd(be, cat_h, 2 * D, p->rstd_h, h, D, p->hnorm->w, Nl, D, c->rms_eps));
    MT_CHECK(mt_linear_fwd(c, p->eh, p->hin, D, p->cat, 2 * D, Nl));
    return mt_block_fwd(c, &p->block, p->hout, p->hin, aux_alpha, aux_grad_scale);
}

int mt_mtp_bwd(const mt_ctx *c, mt_mtp *p, mt_param *embed, void *dh, const void *dhout,
               const void *h)
{
    mt_backend *be = c->be;
    const int N = c->N, D = (int)embed->d.cols, Nl = mt_tp_rows(c);
    const size_t act = mt_act_size(be);
    size_t mark = mt_ws_mark(c->ws);
    void *dhin, *dcat, *demb, *demb_full;
    MT_WS(dhin, c->ws, (size_t)N * D * act);
    MT_WS(dcat, c->ws, (size_t)N * 2 * D * act);
    MT_WS(demb, c->ws, (size_t)N * D * act);
    demb_full = demb;
    MT_CHECK(mt_block_bwd(c, &p->block, dhin, dhout, p->hin));
    MT_CHECK(mt_linear_bwd(c, p->eh, dcat, 2 * D, 0, dhin, D, p->cat, 2 * D, Nl));
    MT_CHECK(be->rmsnorm_bwd(be, demb, D, 0, p->enorm->grad, dcat, 2 * D, p->emb, D, p->enorm->w,
                             p->rstd_e, Nl, D));
    if (mt_tp_sp(c)) { /* the embedding's gradient needs every row's token */
        MT_WS(demb_full, c->ws, (size_t)N * D * act);
        MT_CHECK(mt_tp_gather_rows(c, demb, demb_full, D));
    }
    MT_CHECK(be->embedding_bwd(be, embed->grad, demb_full, p->ids, N, D));
    MT_CHECK(be->rmsnorm_bwd(be, dh, D, 1, p->hnorm->grad, (char *)dcat + (size_t)D * act, 2 * D,
                             h, D, p->hnorm->w, p->rstd_h, Nl, D));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}
