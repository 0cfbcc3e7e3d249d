/* layer_block.c - a decoder layer: pre-norm MLA and pre-norm FFN or MoE, each
 * with a residual connection.
 *
 *   mid = x + mla(x)                (the MLA layer owns its input norm)
 *   out = mid + ffn(norm(mid))      (dense FFN or DeepSeekMoE)
 *
 * Sequence parallelism (engine/model/tp.h): x, mid, out and their gradients
 * are this rank's rows; the norm runs on them and is gathered (b->xn2 holds
 * every row) for the FFN / MoE region, whose partial output and input
 * gradient are reduce-scattered. The MoE layer's terms (layers.h): the
 * shared experts' columns on every row plus the routed experts of the
 * rank's share of the rows (its own rows), so each token reaches the
 * routed experts once over the tp group. Without sequence parallelism
 * the MoE's terms are all-reduced here (the dense FFN sums inside).
 */
#include <string.h>

#include "engine/model/layers.h"
#include "kernels/op_profile.h"
#include "base/mt_status.h"

/* First parameter of `layer` with `role` (lowest expert for expert roles). */
static mt_param *find_role(mt_param *params, const mt_param_table *t, int layer,
                           mt_param_role role)
{
    for (int i = 0; i < t->n; i++)
        if (t->p[i].layer == layer && t->p[i].role == role) return &params[i];
    return NULL;
}

int mt_block_bind(mt_block *b, mt_param *params, const mt_param_table *t, int layer)
{
    mt_mla *a = &b->attn;
#define BIND(dst, role, required)                                                      \
    do {                                                                               \
        (dst) = find_role(params, t, layer, role);                                     \
        if ((required) && !(dst))                                                      \
            return MT_ERR(MT_EINVAL, "layer %d: parameter role %d missing", layer, role); \
    } while (0)
    BIND(a->in_norm, MT_PR_INPUT_NORM, 1);
    BIND(a->q_a, MT_PR_Q_A, 0);
    BIND(a->q_a_norm, MT_PR_Q_A_NORM, 0);
    BIND(a->q_b, MT_PR_Q_B, 0);
    BIND(a->q, MT_PR_Q, 0);
    BIND(a->kv_a, MT_PR_KV_A, 1);
    BIND(a->kv_a_norm, MT_PR_KV_A_NORM, 1);
    BIND(a->kv_b, MT_PR_KV_B, 1);
    BIND(a->o, MT_PR_O, 1);
    BIND(b->post_norm, MT_PR_POST_ATTN_NORM, 1);
    if (b->is_moe) {
        mt_moe *m = &b->moe;
        BIND(m->router, MT_PR_ROUTER, 1);
        BIND(m->bias, MT_PR_ROUTER_BIAS, 0);
        BIND(m->exp_gate, MT_PR_EXP_GATE, 1);
        BIND(m->exp_up, MT_PR_EXP_UP, 1);
        BIND(m->exp_down, MT_PR_EXP_DOWN, 1);
        BIND(m->shared.gate, MT_PR_SH_GATE, 0);
        BIND(m->shared.up, MT_PR_SH_UP, 0);
        BIND(m->shared.down, MT_PR_SH_DOWN, 0);
    } else {
        BIND(b->ffn.gate, MT_PR_GATE, 1);
        BIND(b->ffn.up, MT_PR_UP, 1);
        BIND(b->ffn.down, MT_PR_DOWN, 1);
    }
#undef BIND
    return MT_OK;
}

int mt_block_init(mt_block *b, mt_backend *be, const mt_model_config *cfg,
                  const mt_model_opts *o, int layer, int N, mt_moe_dispatcher *disp)
{
    const size_t act = mt_act_size(be);
    /* tensor parallelism: this rank's heads and FFN columns (the parameter
     * table's parts, mt_params_tp_local) */
    const int tp = o->tp ? o->tp->size : 1;
    mt_model_config lc = *cfg;
    lc.num_attention_heads /= tp;
    b->layer = layer;
    b->is_moe = mt_config_layer_is_moe(cfg, layer);
    MT_CHECK(mt_mla_init(&b->attn, be, &lc, N, o->micro_batch, o->seq_len, o->recompute_mla_up));
    MT_CHECK(be->alloc(be, (size_t)N * cfg->hidden_size * act, &b->mid));
    MT_CHECK(be->alloc(be, (size_t)N * cfg->hidden_size * act, &b->xn2));
    MT_CHECK(be->alloc(be, (size_t)N * 4, (void **)&b->rstd2));
    if (b->is_moe) {
        MT_CHECK(mt_moe_init(&b->moe, be, cfg, o, N, disp));
        if (tp > 1 && b->moe.has_shared) { /* the shared experts' columns of this rank */
            mt_ffn_free(&b->moe.shared, be);
            MT_CHECK(mt_ffn_init(&b->moe.shared, be, N, cfg->hidden_size,
                                 cfg->moe_intermediate_size * cfg->n_shared_experts / tp,
                                 o->recompute_moe_act));
            b->moe.shared.no_sum = 1; /* summed with the routed terms (mt_block_fwd) */
        }
        return MT_OK;
    }
    MT_CHECK(mt_ffn_init(&b->ffn, be, N, cfg->hidden_size, cfg->intermediate_size / tp,
                         o->recompute_moe_act));
    b->ffn.no_sum = tp > 1 && o->tp->sp; /* reduce-scattered here */
    return MT_OK;
}

void mt_block_free(mt_block *b, mt_backend *be)
{
    mt_mla_free(&b->attn, be);
    if (b->is_moe)
        mt_moe_free(&b->moe, be);
    else
        mt_ffn_free(&b->ffn, be);
    if (b->mid) be->free(be, b->mid);
    if (b->xn2) be->free(be, b->xn2);
    if (b->rstd2) be->free(be, b->rstd2);
    memset(b, 0, sizeof *b);
}

int mt_block_fwd(const mt_ctx *c, mt_block *b, void *out, const void *x, double aux_alpha,
                 float aux_grad_scale)
{
    mt_backend *be = c->be;
    const int N = c->N, D = b->attn.D, Nl = mt_tp_rows(c), sp = mt_tp_sp(c);
    const size_t act = mt_act_size(be);
    const int64_t nd = (int64_t)N * D, ndl = (int64_t)Nl * D;
    size_t mark = mt_ws_mark(c->ws);
    void *y, *yl;
    MT_WS(y, c->ws, (size_t)nd * act);
    mt_op_profile_mark(be, "fwd.attn");
    MT_CHECK(mt_mla_fwd(c, &b->attn, y, x));
    mt_op_profile_mark(be, b->is_moe ? "fwd.moe" : "fwd.ffn");
    MT_CHECK(be->add(be, b->mid, x, y, ndl));
    if (sp) { /* sequence parallelism: the norm on this rank's rows, gathered */
        void *xl;
        MT_WS(xl, c->ws, (size_t)ndl * act);
        MT_CHECK(be->rmsnorm_fwd(be, xl, D, b->rstd2, b->mid, D, b->post_norm->w, Nl, D,
                                 c->rms_eps));
        MT_CHECK(mt_tp_gather_rows(c, xl, b->xn2, D));
    } else {
        MT_CHECK(be->rmsnorm_fwd(be, b->xn2, D, b->rstd2, b->mid, D, b->post_norm->w, N, D,
                                 c->rms_eps));
    }
    yl = y;
    if (b->is_moe) {
        /* this rank's term: its shared-expert columns, its rows' experts */
        MT_CHECK(mt_moe_fwd(c, &b->moe, y, b->xn2, aux_alpha, aux_grad_scale));
        if (!sp) MT_CHECK(mt_tp_sum(c, y, nd));
    } else {
        MT_CHECK(mt_ffn_fwd(c, &b->ffn, y, 0, b->xn2));
    }
    if (sp) { /* the terms' sum, this rank's rows of it */
        MT_WS(yl, c->ws, (size_t)ndl * act);
        MT_CHECK(mt_tp_scatter_rows(c, y, yl, D));
    }
    MT_CHECK(be->add(be, out, b->mid, yl, ndl));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}

int mt_block_bwd(const mt_ctx *c, mt_block *b, void *dx, const void *dout, const void *x)
{
    mt_backend *be = c->be;
    const int N = c->N, D = b->attn.D, Nl = mt_tp_rows(c), sp = mt_tp_sp(c);
    const size_t act = mt_act_size(be), bytes = (size_t)N * D * act;
    const size_t bytes_l = (size_t)Nl * D * act;
    size_t mark = mt_ws_mark(c->ws);
    void *dxn2, *dl, *dfull = (void *)dout;
    MT_WS(dxn2, c->ws, bytes);
    if (sp) { /* sequence parallelism: every row of the gradient for the region */
        MT_WS(dfull, c->ws, bytes);
        MT_CHECK(mt_tp_gather_rows(c, dout, dfull, D));
    }
    mt_op_profile_mark(be, b->is_moe ? "bwd.moe" : "bwd.ffn");
    if (b->is_moe) {
        MT_CHECK(mt_moe_bwd(c, &b->moe, dxn2, dfull, b->xn2));
        if (!sp) MT_CHECK(mt_tp_sum(c, dxn2, (int64_t)N * D));
    } else {
        MT_CHECK(mt_ffn_bwd(c, &b->ffn, dxn2, 0, dfull, b->xn2));
    }
    dl = dxn2;
    if (sp) { /* column-parallel gate / up, the share's rows: this rank's rows of the sum */
        MT_WS(dl, c->ws, bytes_l);
        MT_CHECK(mt_tp_scatter_rows(c, dxn2, dl, D));
    }
    /* d mid = dout + norm'(dxn2), built in dx (the residual passes through) */
    if (dx != dout) MT_CHECK(be->copy(be, dx, dout, bytes_l));
    MT_CHECK(be->rmsnorm_bwd(be, dx, D, 1, b->post_norm->grad, c->grad_type, dl, D, b->mid, D, b->post_norm->w,
                             b->rstd2, Nl, D));
    /* d x = d mid + mla'(d mid): mla_bwd reads dy before it accumulates into dx */
    mt_op_profile_mark(be, "bwd.attn");
    MT_CHECK(mt_mla_bwd(c, &b->attn, dx, dx, x));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}
