/* layer_mla.c - multi-head latent attention (DeepSeek-V2/V3), with its input
 * RMSNorm.
 *
 *   xn  = norm(x)                                   [N, D]
 *   q   = q_b(norm(q_a(xn)))  or  q_proj(xn)        [N, H, Dn + R]
 *   kva = kv_a(xn)                                  [N, KL + R]
 *   kv  = kv_b(norm(kva[:, :KL]))                   [N, H, Dn + Dv]
 *   RoPE on q[..., Dn:] and on kva[:, KL:] (the key part shared by all heads)
 *   k   = [kv[..., :Dn], kva[:, KL:]],  v = kv[..., Dn:]
 *   y   = o_proj(attention(q, k, v))                [N, D]
 * With recompute_mla_up the up-projection outputs (q, kv -> k, v) are not
 * kept; backward recomputes them from the saved compressed vectors.
 * Tensor parallelism: H is this rank's heads (q_b / q_proj and kv_b
 * column-parallel, o_proj row-parallel); y is summed over the tp group, and
 * in backward the gradients entering the column-parallel projections'
 * inputs (d qan, d kvn with the shared rope key's) are summed there, so
 * everything below (q_a, kv_a, their norms, the input norm) computes the
 * same gradient on every tp rank without a reduction of its own.
 * Sequence parallelism: x, y, dx, dy are this rank's rows; the input norm
 * runs on them and its output is gathered (a->xn holds every row), y is
 * reduce-scattered, dy gathered; the input norm's gradient is then this
 * rank's rows' share (the trainer sums it over tp).
 */
#include <string.h>

#include "engine/model/layers.h"
#include "base/mt_status.h"

#define ALLOC(p, bytes) MT_CHECK(be->alloc(be, (bytes), (void **)&(p)))

int mt_mla_init(mt_mla *a, mt_backend *be, const mt_model_config *cfg, int N, int B, int T,
                int recompute)
{
    const size_t act = mt_act_size(be);
    a->D = cfg->hidden_size;
    a->H = cfg->num_attention_heads;
    a->Dn = cfg->qk_nope_head_dim;
    a->R = cfg->qk_rope_head_dim;
    a->Dv = cfg->v_head_dim;
    a->QL = cfg->q_lora_rank;
    a->KL = cfg->kv_lora_rank;
    const size_t n = (size_t)N, H = (size_t)a->H, dqk = (size_t)(a->Dn + a->R);
    ALLOC(a->xn, n * a->D * act);
    ALLOC(a->rstd_in, n * 4);
    if (a->QL > 0) {
        ALLOC(a->qa, n * a->QL * act);
        ALLOC(a->qan, n * a->QL * act);
        ALLOC(a->rstd_q, n * 4);
    }
    ALLOC(a->kva, n * (a->KL + a->R) * act);
    ALLOC(a->rstd_kv, n * 4);
    ALLOC(a->kvn, n * a->KL * act);
    if (!recompute) {
        ALLOC(a->qh, n * H * dqk * act);
        ALLOC(a->k, n * H * dqk * act);
        ALLOC(a->v, n * H * a->Dv * act);
    }
    ALLOC(a->o_attn, n * H * a->Dv * act);
    ALLOC(a->lse, (size_t)B * H * T * 4);
    return MT_OK;
}

void mt_mla_free(mt_mla *a, mt_backend *be)
{
    void *bufs[] = {a->xn, a->rstd_in, a->qa, a->qan, a->rstd_q, a->qh, a->kva,
                    a->rstd_kv, a->kvn, a->k, a->v, a->o_attn, a->lse};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    memset(a, 0, sizeof *a);
}

size_t mt_mla_ws_bytes(const mt_model_config *cfg, int N)
{
    const size_t n = (size_t)N, H = cfg->num_attention_heads;
    const size_t dqk = cfg->qk_nope_head_dim + cfg->qk_rope_head_dim, dv = cfg->v_head_dim;
    const size_t D = cfg->hidden_size, QL = cfg->q_lora_rank, KL = cfg->kv_lora_rank;
    const size_t R = cfg->qk_rope_head_dim;
    /* backward, at most live at once (act <= 4 bytes): d_o, dq, dk, dv, dkv,
     * d_kva, d_kvn, d_qan, d_qa, dxn, recomputed q, k, v, kv; plus the
     * largest linear's transient. */
    size_t acts = n * H * (dv + 3 * dqk + 2 * dv + 2 * (cfg->qk_nope_head_dim + dv)) +
                  n * (2 * (KL + R) + 2 * KL + 2 * QL + D);
    size_t lin = mt_linear_ws_bytes(N, D > H * dqk ? D : H * dqk, D > H * dqk ? D : H * dqk);
    return 4 * acts + lin + 64 * 256;
}

/* q [N, H, Dn + R] from the saved compressed query (or xn), RoPE applied. */
static int mla_queries(const mt_ctx *c, mt_mla *a, void *q)
{
    mt_backend *be = c->be;
    const int N = c->N, dqk = a->Dn + a->R;
    if (a->QL > 0)
        MT_CHECK(mt_linear_fwd(c, a->q_b, q, a->H * dqk, a->qan, a->QL, N));
    else
        MT_CHECK(mt_linear_fwd(c, a->q, q, a->H * dqk, a->xn, a->D, N));
    return be->rope(be, q, N, c->T, a->H, a->H * dqk, dqk, a->Dn, a->R, c->rope_cos, c->rope_sin,
                    c->rope_interleave, 0);
}

/* k, v from the saved normed kv and the rotated shared rope key; kv scratch [N, H, Dn+Dv]. */
static int mla_keys_values(const mt_ctx *c, mt_mla *a, void *k, void *v, void *kv)
{
    mt_backend *be = c->be;
    const int N = c->N;
    MT_CHECK(mt_linear_fwd(c, a->kv_b, kv, a->H * (a->Dn + a->Dv), a->kvn, a->KL, N));
    const char *kpe = (const char *)a->kva + (size_t)a->KL * mt_act_size(be);
    return be->mla_kv_fwd(be, k, v, kv, kpe, a->KL + a->R, N, a->H, a->Dn, a->R, a->Dv);
}

int mt_mla_fwd(const mt_ctx *c, mt_mla *a, void *y, const void *x)
{
    mt_backend *be = c->be;
    const int N = c->N, D = a->D, H = a->H, dqk = a->Dn + a->R, KL = a->KL, R = a->R;
    const size_t act = mt_act_size(be);
    size_t mark = mt_ws_mark(c->ws);
    void *q = a->qh, *k = a->k, *v = a->v, *kv;
    if (!q) MT_WS(q, c->ws, (size_t)N * H * dqk * act);
    if (!k) MT_WS(k, c->ws, (size_t)N * H * dqk * act);
    if (!v) MT_WS(v, c->ws, (size_t)N * H * a->Dv * act);
    MT_WS(kv, c->ws, (size_t)N * H * (a->Dn + a->Dv) * act);

    if (mt_tp_sp(c)) {
        /* sequence parallelism: the norm on this rank's rows, then every
         * row for the region (x and y hold this rank's rows) */
        void *xl;
        MT_WS(xl, c->ws, (size_t)mt_tp_rows(c) * D * act);
        MT_CHECK(be->rmsnorm_fwd(be, xl, D, a->rstd_in, x, D, a->in_norm->w, mt_tp_rows(c), D,
                                 c->rms_eps));
        MT_CHECK(mt_tp_gather_rows(c, xl, a->xn, D));
    } else {
        MT_CHECK(be->rmsnorm_fwd(be, a->xn, D, a->rstd_in, x, D, a->in_norm->w, N, D,
                                 c->rms_eps));
    }
    if (a->QL > 0) {
        /* q_a and kv_a read the same xn: one quantisation for both */
        MT_CHECK(mt_linear_fwd2(c, a->q_a, a->qa, a->QL, a->kv_a, a->kva, KL + R, a->xn, D, N));
        MT_CHECK(be->rmsnorm_fwd(be, a->qan, a->QL, a->rstd_q, a->qa, a->QL, a->q_a_norm->w, N,
                                 a->QL, c->rms_eps));
    } else {
        MT_CHECK(mt_linear_fwd(c, a->kv_a, a->kva, KL + R, a->xn, D, N));
    }
    MT_CHECK(mla_queries(c, a, q));
    MT_CHECK(be->rmsnorm_fwd(be, a->kvn, KL, a->rstd_kv, a->kva, KL + R, a->kv_a_norm->w, N, KL,
                             c->rms_eps));
    char *kpe = (char *)a->kva + (size_t)KL * act;
    MT_CHECK(be->rope(be, kpe, N, c->T, 1, KL + R, R, 0, R, c->rope_cos, c->rope_sin,
                      c->rope_interleave, 0));
    MT_CHECK(mla_keys_values(c, a, k, v, kv));
    MT_CHECK(be->attn_fwd(be, a->o_attn, a->lse, q, k, v, c->B, c->T, H, dqk, a->Dv,
                          c->attn_scale));
    if (mt_tp_sp(c)) { /* row-parallel o_proj: this rank's rows of the sum */
        void *yf;
        MT_WS(yf, c->ws, (size_t)N * D * act);
        MT_CHECK(mt_linear_fwd(c, a->o, yf, D, a->o_attn, H * a->Dv, N));
        MT_CHECK(mt_tp_scatter_rows(c, yf, y, D));
    } else {
        MT_CHECK(mt_linear_fwd(c, a->o, y, D, a->o_attn, H * a->Dv, N));
        MT_CHECK(mt_tp_sum(c, y, (int64_t)N * D)); /* row-parallel o_proj: partial sums */
    }
    mt_ws_release(c->ws, mark);
    return MT_OK;
}

int mt_mla_bwd(const mt_ctx *c, mt_mla *a, void *dx, const void *dy, const void *x)
{
    mt_backend *be = c->be;
    const int N = c->N, D = a->D, H = a->H, Dn = a->Dn, R = a->R, Dv = a->Dv;
    const int dqk = Dn + R, KL = a->KL, QL = a->QL;
    const size_t act = mt_act_size(be), n = (size_t)N;
    size_t mark = mt_ws_mark(c->ws);
    void *q = a->qh, *k = a->k, *v = a->v;
    void *d_o, *dq, *dk, *dv, *dkv, *d_kva, *d_kvn, *dxn;
    if (mt_tp_sp(c)) { /* every row of the output gradient for the region */
        void *dyf;
        MT_WS(dyf, c->ws, n * D * act);
        MT_CHECK(mt_tp_gather_rows(c, dy, dyf, D));
        dy = dyf;
    }
    if (!q) {
        /* recompute_mla_up: rebuild what the forward did not keep */
        void *kv;
        MT_WS(q, c->ws, n * H * dqk * act);
        MT_WS(k, c->ws, n * H * dqk * act);
        MT_WS(v, c->ws, n * H * Dv * act);
        MT_WS(kv, c->ws, n * H * (Dn + Dv) * act);
        MT_CHECK(mla_queries(c, a, q));
        MT_CHECK(mla_keys_values(c, a, k, v, kv));
    }
    MT_WS(d_o, c->ws, n * H * Dv * act);
    MT_WS(dq, c->ws, n * H * dqk * act);
    MT_WS(dk, c->ws, n * H * dqk * act);
    MT_WS(dv, c->ws, n * H * Dv * act);
    MT_WS(dkv, c->ws, n * H * (Dn + Dv) * act);
    MT_WS(d_kva, c->ws, n * (KL + R) * act);
    MT_WS(d_kvn, c->ws, n * KL * act);
    MT_WS(dxn, c->ws, n * D * act);

    MT_CHECK(mt_linear_bwd(c, a->o, d_o, H * Dv, 0, dy, D, a->o_attn, H * Dv, N));
    MT_CHECK(be->attn_bwd(be, dq, dk, dv, d_o, q, k, v, a->o_attn, a->lse, c->B, c->T, H, dqk, Dv,
                          c->attn_scale));
    /* keys and values back to kv_b's output and the shared rope key */
    char *dkpe = (char *)d_kva + (size_t)KL * act;
    MT_CHECK(be->mla_kv_bwd(be, dkv, dkpe, KL + R, dk, dv, N, H, Dn, R, Dv));
    if (mt_tp_on(c)) {
        /* this rank's heads give partial sums of the compressed kv's and the
         * shared rope key's gradients: kv_b's input gradient goes beside
         * the rope key's in d_kva, summed over the group at once */
        MT_CHECK(mt_linear_bwd(c, a->kv_b, d_kva, KL + R, 0, dkv, H * (Dn + Dv), a->kvn, KL, N));
        MT_CHECK(mt_tp_sum(c, d_kva, (int64_t)N * (KL + R)));
        MT_CHECK(be->copy2d(be, d_kvn, KL, d_kva, KL + R, N, KL, 0));
        MT_CHECK(be->rope(be, dkpe, N, c->T, 1, KL + R, R, 0, R, c->rope_cos, c->rope_sin,
                          c->rope_interleave, 1));
    } else {
        MT_CHECK(be->rope(be, dkpe, N, c->T, 1, KL + R, R, 0, R, c->rope_cos, c->rope_sin,
                          c->rope_interleave, 1));
        MT_CHECK(mt_linear_bwd(c, a->kv_b, d_kvn, KL, 0, dkv, H * (Dn + Dv), a->kvn, KL, N));
    }
    MT_CHECK(be->rmsnorm_bwd(be, d_kva, KL + R, 0, a->kv_a_norm->grad, d_kvn, KL, a->kva, KL + R,
                             a->kv_a_norm->w, a->rstd_kv, N, KL));
    /* queries */
    MT_CHECK(be->rope(be, dq, N, c->T, H, H * dqk, dqk, Dn, R, c->rope_cos, c->rope_sin,
                      c->rope_interleave, 1));
    if (QL > 0) {
        void *d_qan, *d_qa;
        MT_WS(d_qan, c->ws, n * QL * act);
        MT_WS(d_qa, c->ws, n * QL * act);
        MT_CHECK(mt_linear_bwd(c, a->q_b, d_qan, QL, 0, dq, H * dqk, a->qan, QL, N));
        MT_CHECK(mt_tp_sum(c, d_qan, (int64_t)N * QL)); /* column-parallel q_b's entry */
        MT_CHECK(be->rmsnorm_bwd(be, d_qa, QL, 0, a->q_a_norm->grad, d_qan, QL, a->qa, QL,
                                 a->q_a_norm->w, a->rstd_q, N, QL));
        /* dxn = d_kva kv_a + d_qa q_a, one quantisation of xn for both weight gradients */
        MT_CHECK(mt_linear_bwd2(c, a->kv_a, d_kva, KL + R, a->q_a, d_qa, QL, dxn, D, 0, a->xn, D,
                                N));
    } else {
        MT_CHECK(mt_linear_bwd(c, a->kv_a, dxn, D, 0, d_kva, KL + R, a->xn, D, N));
        if (mt_tp_on(c)) { /* column-parallel q_proj: its share summed before it joins */
            void *dxq;
            MT_WS(dxq, c->ws, n * D * act);
            MT_CHECK(mt_linear_bwd(c, a->q, dxq, D, 0, dq, H * dqk, a->xn, D, N));
            MT_CHECK(mt_tp_sum(c, dxq, (int64_t)N * D));
            MT_CHECK(be->add(be, dxn, dxn, dxq, (int64_t)N * D));
        } else {
            MT_CHECK(mt_linear_bwd(c, a->q, dxn, D, 1, dq, H * dqk, a->xn, D, N));
        }
    }
    /* sequence parallelism: dxn is the same on every rank (summed at the
     * column-parallel entries); this rank's rows go through its norm */
    MT_CHECK(be->rmsnorm_bwd(be, dx, D, 1, a->in_norm->grad,
                             (char *)dxn + (size_t)mt_tp_row0(c) * D * act, D, x, D,
                             a->in_norm->w, a->rstd_in, mt_tp_rows(c), D));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}
