/* layer_block.c - a decoder layer: pre-norm MLA and pre-norm FFN or MoE, each
 * with a residual connection.
 *
 *   mid = x + mla(x)                (the MLA layer owns its input norm)
 *   out = mid + ffn(norm(mid))      (dense FFN or DeepSeekMoE)
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
    b->layer = layer;
    b->is_moe = mt_config_layer_is_moe(cfg, layer);
    MT_CHECK(mt_mla_init(&b->attn, be, cfg, N, o->micro_batch, o->seq_len, o->recompute_mla_up));
    MT_CHECK(be->alloc(be, (size_t)N * cfg->hidden_size * act, &b->mid));
    MT_CHECK(be->alloc(be, (size_t)N * cfg->hidden_size * act, &b->xn2));
    MT_CHECK(be->alloc(be, (size_t)N * 4, (void **)&b->rstd2));
    if (b->is_moe) return mt_moe_init(&b->moe, be, cfg, o, N, disp);
    return mt_ffn_init(&b->ffn, be, N, cfg->hidden_size, cfg->intermediate_size,
                       o->recompute_moe_act);
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
    const int N = c->N, D = b->attn.D;
    const int64_t nd = (int64_t)N * D;
    size_t mark = mt_ws_mark(c->ws);
    void *y;
    MT_WS(y, c->ws, (size_t)nd * mt_act_size(be));
    mt_op_profile_mark(be, "fwd.attn");
    MT_CHECK(mt_mla_fwd(c, &b->attn, y, x));
    mt_op_profile_mark(be, b->is_moe ? "fwd.moe" : "fwd.ffn");
    MT_CHECK(be->add(be, b->mid, x, y, nd));
    MT_CHECK(be->rmsnorm_fwd(be, b->xn2, D, b->rstd2, b->mid, D, b->post_norm->w, N, D,
                             c->rms_eps));
    if (b->is_moe)
        MT_CHECK(mt_moe_fwd(c, &b->moe, y, b->xn2, aux_alpha, aux_grad_scale));
    else
        MT_CHECK(mt_ffn_fwd(c, &b->ffn, y, 0, b->xn2));
    MT_CHECK(be->add(be, out, b->mid, y, nd));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}

int mt_block_bwd(const mt_ctx *c, mt_block *b, void *dx, const void *dout, const void *x)
{
    mt_backend *be = c->be;
    const int N = c->N, D = b->attn.D;
    const size_t bytes = (size_t)N * D * mt_act_size(be);
    size_t mark = mt_ws_mark(c->ws);
    void *dxn2;
    MT_WS(dxn2, c->ws, bytes);
    mt_op_profile_mark(be, b->is_moe ? "bwd.moe" : "bwd.ffn");
    if (b->is_moe)
        MT_CHECK(mt_moe_bwd(c, &b->moe, dxn2, dout, b->xn2));
    else
        MT_CHECK(mt_ffn_bwd(c, &b->ffn, dxn2, 0, dout, b->xn2));
    /* d mid = dout + norm'(dxn2), built in dx (the residual passes through) */
    if (dx != dout) MT_CHECK(be->copy(be, dx, dout, bytes));
    MT_CHECK(be->rmsnorm_bwd(be, dx, D, 1, b->post_norm->grad, c->grad_type, dxn2, D, b->mid, D,
                             b->post_norm->w, b->rstd2, N, D));
    /* d x = d mid + mla'(d mid): mla_bwd reads dy before it accumulates into dx */
    mt_op_profile_mark(be, "bwd.attn");
    MT_CHECK(mt_mla_bwd(c, &b->attn, dx, dx, x));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}
