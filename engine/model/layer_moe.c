/* layer_moe.c - DeepSeekMoE: sigmoid router with group-limited top-k and an
 * aux-loss-free selection bias, shared experts, local routed experts behind
 * a dispatcher, sequence-wise balance loss. No token is dropped.
 *
 *   logits = xn Wg^T (fp32)                       [N, E]
 *   idx, w = router(logits, bias)                 [N, K]
 *   xp     = permute(xn)  (expert-major)          [R, D] source layout
 *   xl     = dispatch(xp)                         [Rl, D] rows of local experts, padded
 *            (under expert parallelism the rows are gathered from xn
 *            straight into the wire buffer: xp is never written; under
 *            the fp8 recipe xn is quantised first and the rows travel and
 *            reach the gate/up GEMMs as e4m3 with their 1x128 scales, xl
 *            being their dequantised values for the weight gradient)
 *   yl     = down_e(silu(gate_e(xl)) * up_e(xl))  per local expert segment
 *   yp     = combine(yl)                          [R, D]
 *   y      = shared(xn) + sum_k w[n, k] yp[slot[n, k]]
 *
 * Tensor parallelism (layers.h, mt_moe_fwd): the router and the balance
 * loss on all N rows, everything from the index on (permute, dispatch,
 * experts, combine, unpermute) on this rank's share [lo, lo + Ns) only,
 * with slot / src / idx / w of the share; y and dxn are this rank's terms
 * of a sum over tp (the shared experts' columns, the share's rows).
 */
#include <stdlib.h>
#include <string.h>

#include "engine/model/layers.h"
#include "base/mt_status.h"

#define ALLOC(p, bytes) MT_CHECK(be->alloc(be, (bytes), (void **)&(p)))

void mt_moe_caps(const mt_model_config *cfg, const mt_model_opts *o, int N,
                 const mt_moe_dispatcher *disp, int *align, int *src_align, int64_t *R_cap,
                 int64_t *Rl_cap)
{
    const int E = cfg->n_routed_experts, K = cfg->num_experts_per_tok;
    /* tensor parallelism: a rank routes its share of the rows, ceil(N / tp)
     * at most (mt_tp_share), and so does every source of its ep group */
    const int tp = o->tp ? o->tp->size : 1;
    N = (N + tp - 1) / tp;
    *align = o->expert_align > 0 ? o->expert_align
             : o->recipe == MT_RECIPE_FP8_BLOCKWISE ? 128
                                                    : 1;
    /* Rows that travel carry no padding: the receiver pads its segments. */
    *src_align = disp->ep > 1 ? 1 : *align;
    /* Every assignment plus the worst-case padding of each expert. */
    *R_cap = (int64_t)N * K + (int64_t)E * (*src_align - 1);
    *Rl_cap = disp->ep > 1 ? mt_moe_local_rows_cap(disp, N, K, *align) : *R_cap;
}

int mt_moe_init(mt_moe *m, mt_backend *be, const mt_model_config *cfg, const mt_model_opts *o,
                int N, mt_moe_dispatcher *disp)
{
    const size_t act = mt_act_size(be);
    const int E = cfg->n_routed_experts, K = cfg->num_experts_per_tok;
    m->D = cfg->hidden_size;
    /* expert tensor parallelism: this rank's F / etp columns of every local
     * expert (gate / up rows, down columns: mt_params_etp_local) */
    m->F = cfg->moe_intermediate_size / (disp->etp > 1 ? disp->etp : 1);
    m->disp = disp;
    m->E_local = disp->E_local;
    int64_t R_cap, Rl_cap;
    mt_moe_caps(cfg, o, N, disp, &m->align, &m->src_align, &R_cap, &Rl_cap);
    if (Rl_cap > 0x7fffffff || R_cap > 0x7fffffff)
        return MT_ERR(MT_EINVAL, "moe: %lld rows per micro-batch are too many (N %d, K %d, ep %d)",
                      (long long)Rl_cap, N, K, disp->ep);
    m->R_cap = (int)R_cap;
    m->Rl_cap = (int)Rl_cap;
    m->rc.n_experts = E;
    m->rc.top_k = K;
    m->rc.n_group = cfg->topk_method == MT_TOPK_GREEDY ? 1 : cfg->n_group;
    m->rc.topk_group = cfg->topk_method == MT_TOPK_GREEDY ? 1 : cfg->topk_group;
    m->rc.score_fn = cfg->scoring_func == MT_SCORING_SOFTMAX ? MT_SCORE_SOFTMAX : MT_SCORE_SIGMOID;
    m->rc.group_by_top2 = cfg->topk_method == MT_TOPK_NOAUX_TC;
    m->rc.norm_topk = cfg->norm_topk_prob;
    m->rc.scaling = (float)cfg->routed_scaling_factor;
    const size_t n = (size_t)N, R = (size_t)m->R_cap, Rl = (size_t)m->Rl_cap;
    ALLOC(m->logits, n * E * 4);
    ALLOC(m->scores, n * E * 4);
    ALLOC(m->idx, n * K * 4);
    ALLOC(m->w, n * K * 4);
    ALLOC(m->dscores, n * E * 4);
    ALLOC(m->slot, n * K * 4);
    ALLOC(m->src, R * 4);
    ALLOC(m->counts, (size_t)E * 4);
    ALLOC(m->aux_loss, 4);
    /* rows that travel are gathered straight from xn into the wire buffer:
     * the source layout of the forward is never written */
    if (disp->ep > 1)
        ALLOC(m->xl_buf, Rl * m->D * act);
    else
        ALLOC(m->xp, R * m->D * act);
    /* the FP8 payload: the tokens are quantised once, before they travel,
     * and the expert GEMMs take the e4m3 rows as they arrive */
    m->fp8_wire = disp->ep > 1 && disp->dispatch_fp8 && o->recipe == MT_RECIPE_FP8_BLOCKWISE;
    if (m->fp8_wire) {
        ALLOC(m->xl_q, Rl * m->D);
        ALLOC(m->xl_s, Rl * (size_t)((m->D + 127) / 128) * 4);
    }
    ALLOC(m->gup, Rl * 2 * m->F * act);
    if (!o->recompute_moe_act) ALLOC(m->hp, Rl * m->F * act);
    ALLOC(m->yp, R * m->D * act);
    m->rows = calloc((size_t)E, sizeof *m->rows);
    m->load = calloc((size_t)E, sizeof *m->load);
    if (!m->rows || !m->load) return MT_ERR(MT_ENOMEM, "moe: out of memory");
    /* parallel.ep_overlap = halves: only where rows travel */
    m->halves = o->ep_overlap && disp->ep > 1;
    if (m->halves) {
        if (!disp->dispatch_start || !disp->combine_start || !disp->finish || !disp->counts ||
            (m->fp8_wire && !disp->dispatch_fp8_start))
            return MT_ERR(MT_ENOTSUP, "moe: parallel.ep_overlap halves: this dispatcher cannot "
                          "exchange parts of the experts");
        if (disp->etp > 1)
            return MT_ERR(MT_ENOTSUP, "moe: parallel.ep_overlap halves with etp %d: expert "
                          "tensor parallelism exchanges whole layers only so far", disp->etp);
        if (disp->E_local < 2)
            return MT_ERR(MT_EINVAL, "moe: parallel.ep_overlap halves needs at least 2 local "
                          "experts (%d)", disp->E_local);
        m->half = disp->E_local / 2;
    }
    MT_CHECK(mt_moe_plan_init(&m->plan, disp->ep, disp->E_local, m->align));
    m->plan.Rl_cap = m->Rl_cap;
    m->has_shared = cfg->n_shared_experts > 0;
    if (m->has_shared)
        MT_CHECK(mt_ffn_init(&m->shared, be, N, m->D,
                             cfg->moe_intermediate_size * cfg->n_shared_experts,
                             o->recompute_moe_act));
    return MT_OK;
}

void mt_moe_free(mt_moe *m, mt_backend *be)
{
    void *bufs[] = {m->logits, m->scores, m->idx, m->w, m->dscores, m->slot, m->src,
                    m->counts, m->aux_loss, m->xp, m->xl_buf, m->gup, m->hp, m->yp,
                    m->xl_q, m->xl_s};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    free(m->rows);
    free(m->load);
    mt_moe_plan_free(&m->plan);
    if (m->has_shared) mt_ffn_free(&m->shared, be);
    memset(m, 0, sizeof *m);
}

size_t mt_moe_ws_bytes(const mt_model_config *cfg, int N, int64_t R_cap, int64_t Rl_cap)
{
    const size_t n = (size_t)N, R = (size_t)R_cap, Rl = (size_t)Rl_cap, D = cfg->hidden_size;
    const size_t F = cfg->moe_intermediate_size, E = cfg->n_routed_experts;
    const size_t K = cfg->num_experts_per_tok;
    /* backward: dyp, dxp [R, D]; dyl [Rl, D] (dxl reuses it); hp, dhp [Rl, F],
     * dgup [Rl, 2F]; dw, dlogits, dlog_act. Forward: yl [Rl, D], hp. */
    size_t mine = 4 * (R * 2 * D + Rl * (D + 4 * F) + n * (K + 2 * E + D));
    size_t lin = 3 * Rl * (D > 2 * F ? D : 2 * F) + 64 * Rl +
                 4 * (Rl / 128 + E + 2) * (D + 2 * F) * 2;
    size_t shared = cfg->n_shared_experts > 0
                        ? mt_ffn_ws_bytes(N, (int)D, (int)F * cfg->n_shared_experts)
                        : 0;
    /* the FP8 payload: the tokens quantised before dispatch */
    const size_t fp8_tok = n * D + 4 * n * ((D + 127) / 128);
    return mine + lin + shared + fp8_tok + 32 * 256;
}

static int sum_rows(const int *rows, int n)
{
    int s = 0;
    for (int i = 0; i < n; i++) s += rows[i];
    return s;
}

/* First row of local expert e's segment in the local layout. */
static int seg_row(const mt_moe *m, int e)
{
    int r = 0;
    for (int g = 0; g < e; g++) r += m->plan.local_rows[g];
    return r;
}

/* Runs local experts [e0, e1) on their segments of xl [Rl, D] into the
 * same rows of yl [Rl, D]. Every row's output is its own (the GEMMs'
 * sums run along the features), so parts compute what one call would. */
static int experts_fwd(const mt_ctx *c, mt_moe *m, int e0, int e1, void *yl, const void *xl)
{
    mt_backend *be = c->be;
    const int F = m->F, D = m->D, G = e1 - e0, r0 = seg_row(m, e0);
    const int Rl = seg_row(m, e1) - r0;
    const int *rows = m->plan.local_rows + e0;
    const size_t act = mt_act_size(be);
    size_t mark = mt_ws_mark(c->ws);
    void *hp = m->hp ? (char *)m->hp + (size_t)r0 * F * act : NULL;
    void *gup = (char *)m->gup + (size_t)r0 * 2 * F * act;
    if (!hp) MT_WS(hp, c->ws, (size_t)Rl * F * act);
    if (m->fp8_wire) /* xl's e4m3 rows and scales came with the dispatch */
        MT_CHECK(mt_linear_grouped_fwd2_q(c, m->exp_gate + e0, gup, 2 * F, m->exp_up + e0,
                                          (char *)gup + (size_t)F * act, 2 * F,
                                          m->xl_q + (size_t)r0 * D,
                                          m->xl_s + (size_t)((D + 127) / 128) * r0, rows, G));
    else
        MT_CHECK(mt_linear_grouped_fwd2(c, m->exp_gate + e0, gup, 2 * F, m->exp_up + e0,
                                        (char *)gup + (size_t)F * act, 2 * F,
                                        (const char *)xl + (size_t)r0 * D * act, D, rows, G));
    MT_CHECK(be->swiglu_fwd(be, hp, gup, Rl, F));
    MT_CHECK(mt_linear_grouped_fwd(c, m->exp_down + e0, (char *)yl + (size_t)r0 * D * act, D, hp,
                                   F, rows, G));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}

/* The forward's exchanges and experts in two parts (parallel.ep_overlap =
 * halves), A = local experts [0, h), B = [h, E_local):
 *   dispatch A beside the shared expert (y_shared not NULL: y = shared(xn)
 *   is computed there) | dispatch B beside experts A | combine A beside
 *   experts B | combine B.
 * Every row lands where the plain path puts it and is computed alike, so
 * yp is the plain path's, bit for bit. xt [Nt, D]: the tokens this rank
 * routes (its tp share); xq, xs: them quantised (the FP8 payload), else
 * NULL. */
static int moe_fwd_halves(const mt_ctx *c, mt_moe *m, void *yl, const void *xt, int Nt,
                          const uint8_t *xq, const float *xs, void *y_shared, const void *xn)
{
    mt_backend *be = c->be;
    mt_moe_dispatcher *d = m->disp;
    const int N = Nt, D = m->D, h = m->half, El = m->E_local;
    const int lo[2] = {0, h}, hi[2] = {h, El};
    for (int k = 0; k < 2; k++) {
        if (m->fp8_wire)
            MT_CHECK(d->dispatch_fp8_start(d, be, &m->plan, lo[k], hi[k], m->xl_q, m->xl_s,
                                           m->xl_buf, xq, xs, N, m->src, D));
        else
            MT_CHECK(d->dispatch_start(d, be, &m->plan, lo[k], hi[k], m->xl_buf, NULL, xt,
                                       m->src, D));
        if (k == 0 && y_shared) MT_CHECK(mt_ffn_fwd(c, &m->shared, y_shared, 0, xn));
        if (k == 0) MT_CHECK(d->finish(d)); /* A arrived; B travels from here */
    }
    m->xl = m->xl_buf;
    for (int k = 0; k < 2; k++) {
        MT_CHECK(experts_fwd(c, m, lo[k], hi[k], yl, m->xl));
        MT_CHECK(d->finish(d)); /* k = 0: dispatch B; k = 1: combine A */
        MT_CHECK(d->combine_start(d, be, &m->plan, lo[k], hi[k], m->yp, yl, D));
    }
    return d->finish(d);
}

int mt_moe_fwd(const mt_ctx *c, mt_moe *m, void *y, const void *xn, double aux_alpha,
               float grad_scale)
{
    mt_backend *be = c->be;
    const int N = c->N, D = m->D, E = m->rc.n_experts, K = m->rc.top_k;
    const size_t act = mt_act_size(be);
    int lo, Ns; /* the rows this rank routes (all N without tp) */
    mt_tp_share(c, &lo, &Ns);
    const void *xs_in = (const char *)xn + (size_t)lo * D * act;
    MT_CHECK(be->gemm(be, m->logits, 1, E, xn, D, 0, m->router->w, D, 0, N, E, D, 1.0f, 0));
    MT_CHECK(be->router_fwd(be, m->idx, m->w, m->scores, m->logits, m->bias ? m->bias->wf : NULL,
                            N, &m->rc));
    m->aux_on = aux_alpha > 0;
    if (m->aux_on)
        MT_CHECK(be->aux_loss(be, m->aux_loss, m->dscores, m->scores, m->idx, c->B, c->T,
                              (float)aux_alpha, grad_scale, &m->rc));
    MT_CHECK(be->moe_index(be, m->slot, m->src, m->counts, m->rows, m->idx + (size_t)lo * K,
                           Ns, K, E, m->src_align, m->R_cap));
    int32_t counts[4096];
    if (E > 4096) return MT_ERR(MT_ENOTSUP, "moe: more than 4096 experts");
    MT_CHECK(be->download(be, counts, m->counts, (size_t)E * 4));
    for (int e = 0; e < E; e++) m->load[e] += counts[e];
    m->R = sum_rows(m->rows, E);
    const int moves = m->disp->ep > 1;
    if (!moves) MT_CHECK(be->moe_permute(be, m->xp, xs_in, m->src, m->R, D));
    /* halves: the shared expert beside the first dispatch (not under tp:
     * its sums over the tp group stay out of an exchange's way) */
    const int shared_beside = m->halves && m->has_shared && !mt_tp_on(c);
    if (m->halves) {
        size_t mk = mt_ws_mark(c->ws);
        uint8_t *xq = NULL;
        float *xs = NULL;
        if (m->fp8_wire) { /* quantised once, before the rows travel (as below) */
            const int KB = (D + 127) / 128, one[1] = {Ns};
            MT_WS(xq, c->ws, (size_t)Ns * D + 1);
            MT_WS(xs, c->ws, (size_t)KB * Ns * 4 + 4);
            if (Ns > 0) MT_CHECK(be->quant_rows(be, xq, xs, xs_in, D, one, 1, D));
        }
        MT_CHECK(m->disp->counts(m->disp, be, &m->plan, m->rows));
        void *yl;
        MT_WS(yl, c->ws, (size_t)m->plan.Rl * D * act);
        MT_CHECK(moe_fwd_halves(c, m, yl, xs_in, Ns, xq, xs, shared_beside ? y : NULL, xn));
        mt_ws_release(c->ws, mk);
    } else {
        if (m->fp8_wire) {
            /* quantised once, before the rows travel (1x128 tiles per
             * token: the tiles quant_rows of the local rows would make) */
            const int KB = (D + 127) / 128, one[1] = {Ns};
            size_t mk = mt_ws_mark(c->ws);
            uint8_t *xq;
            float *xs;
            MT_WS(xq, c->ws, (size_t)Ns * D + 1);
            MT_WS(xs, c->ws, (size_t)KB * Ns * 4 + 4);
            if (Ns > 0) MT_CHECK(be->quant_rows(be, xq, xs, xs_in, D, one, 1, D));
            MT_CHECK(m->disp->dispatch_fp8(m->disp, be, &m->plan, m->xl_q, m->xl_s, m->xl_buf,
                                           xq, xs, Ns, m->src, m->rows, D));
            mt_ws_release(c->ws, mk);
            m->xl = m->xl_buf;
        } else {
            MT_CHECK(m->disp->dispatch(m->disp, be, &m->plan, 1, &m->xl, m->xl_buf, m->xp,
                                       moves ? xs_in : NULL, m->src, m->rows, D));
        }
        size_t mark = mt_ws_mark(c->ws);
        void *yl = m->yp; /* identity: the experts write yp directly */
        if (moves) MT_WS(yl, c->ws, (size_t)m->plan.Rl * D * act);
        MT_CHECK(experts_fwd(c, m, 0, m->E_local, yl, m->xl));
        MT_CHECK(m->disp->combine(m->disp, be, &m->plan, m->yp, yl, D));
        mt_ws_release(c->ws, mark);
    }
    /* the rows outside the share are the shared experts' alone (or zero) */
    if (m->has_shared && !shared_beside) MT_CHECK(mt_ffn_fwd(c, &m->shared, y, 0, xn));
    else if (!m->has_shared && Ns < N) MT_CHECK(be->zero(be, y, (size_t)N * D * act));
    return be->moe_unpermute(be, (char *)y + (size_t)lo * D * act, m->has_shared, m->yp,
                             m->slot, m->w + (size_t)lo * K, Ns, K, D);
}

/* Local experts [e0, e1)'s backward on their segments: dyl [Rl, D] ->
 * dxl [Rl, D] (the same rows); their gradients +=. Each expert's weight
 * gradient sums its own segment's rows, so parts sum what one call would.
 * dxl may be dyl: dyl is last read before dxl is first written. */
static int experts_bwd(const mt_ctx *c, mt_moe *m, int e0, int e1, void *dxl, const void *dyl,
                       const void *xl)
{
    mt_backend *be = c->be;
    const int F = m->F, D = m->D, G = e1 - e0, r0 = seg_row(m, e0);
    const int Rl = seg_row(m, e1) - r0;
    const int *rows = m->plan.local_rows + e0;
    const size_t act = mt_act_size(be), off = (size_t)r0 * D * act;
    const void *gup = (const char *)m->gup + (size_t)r0 * 2 * F * act;
    size_t mark = mt_ws_mark(c->ws);
    void *hp = m->hp ? (char *)m->hp + (size_t)r0 * F * act : NULL, *dhp, *dgup;
    if (!hp) {
        MT_WS(hp, c->ws, (size_t)Rl * F * act);
        MT_CHECK(be->swiglu_fwd(be, hp, gup, Rl, F));
    }
    MT_WS(dhp, c->ws, (size_t)Rl * F * act);
    MT_WS(dgup, c->ws, (size_t)Rl * 2 * F * act);
    MT_CHECK(mt_linear_grouped_bwd(c, m->exp_down + e0, dhp, F, 0, (const char *)dyl + off, D, hp,
                                   F, rows, G));
    MT_CHECK(be->swiglu_bwd(be, dgup, dhp, gup, Rl, F));
    MT_CHECK(mt_linear_grouped_bwd2(c, m->exp_gate + e0, dgup, 2 * F, m->exp_up + e0,
                                    (char *)dgup + (size_t)F * act, 2 * F, (char *)dxl + off, D,
                                    0, (const char *)xl + off, D, rows, G));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}

/* The backward's exchanges and experts in two parts (as moe_fwd_halves):
 * dispatch dyp A beside the shared expert's backward (shared: dxn =
 * shared's input gradient of dy is computed there) | dispatch B beside
 * experts A's backward | combine dxl A beside B's | combine B. dyl_buf
 * [Rl, D] holds dyl, then dxl in place. */
static int moe_bwd_halves(const mt_ctx *c, mt_moe *m, void *dxp, void *dyl_buf, const void *dyp,
                          int shared, void *dxn, const void *dy, const void *xn)
{
    mt_backend *be = c->be;
    mt_moe_dispatcher *d = m->disp;
    const int D = m->D, h = m->half, El = m->E_local;
    const int lo[2] = {0, h}, hi[2] = {h, El};
    MT_CHECK(d->dispatch_start(d, be, &m->plan, 0, h, dyl_buf, dyp, NULL, NULL, D));
    if (shared) MT_CHECK(mt_ffn_bwd(c, &m->shared, dxn, 0, dy, xn));
    MT_CHECK(d->finish(d));
    MT_CHECK(d->dispatch_start(d, be, &m->plan, h, El, dyl_buf, dyp, NULL, NULL, D));
    for (int k = 0; k < 2; k++) {
        MT_CHECK(experts_bwd(c, m, lo[k], hi[k], dyl_buf, dyl_buf, m->xl));
        MT_CHECK(d->finish(d)); /* k = 0: dispatch B; k = 1: combine A */
        MT_CHECK(d->combine_start(d, be, &m->plan, lo[k], hi[k], dxp, dyl_buf, D));
    }
    return d->finish(d);
}

int mt_moe_bwd(const mt_ctx *c, mt_moe *m, void *dxn, const void *dy, const void *xn)
{
    mt_backend *be = c->be;
    const int N = c->N, D = m->D, E = m->rc.n_experts, K = m->rc.top_k;
    const size_t act = mt_act_size(be), R = (size_t)m->R;
    int lo, Ns; /* the forward's share (mt_tp_share) */
    mt_tp_share(c, &lo, &Ns);
    const size_t lo_d = (size_t)lo * D * act;
    size_t mark = mt_ws_mark(c->ws);
    void *dyp, *dxp, *dlog_act, *dyl_buf = NULL;
    float *dw, *dlogits;
    MT_WS(dyp, c->ws, R * D * act);
    MT_WS(dxp, c->ws, R * D * act);
    if (m->disp->ep > 1) MT_WS(dyl_buf, c->ws, (size_t)m->plan.Rl * D * act);
    MT_WS(dw, c->ws, (size_t)Ns * K * 4 + 4);
    MT_WS(dlogits, c->ws, (size_t)Ns * E * 4 + 4);
    MT_WS(dlog_act, c->ws, (size_t)Ns * E * act + 4);

    /* halves: the shared expert's backward beside the first dispatch (not
     * under tp, as in the forward); dxn is written (=) before the routed
     * part adds to it either way */
    const int shared_beside = m->halves && m->has_shared && !mt_tp_on(c);
    if (m->has_shared && !shared_beside) MT_CHECK(mt_ffn_bwd(c, &m->shared, dxn, 0, dy, xn));
    else if (!m->has_shared && Ns < N) MT_CHECK(be->zero(be, dxn, (size_t)N * D * act));
    MT_CHECK(be->moe_unpermute_bwd(be, dyp, dw, (const char *)dy + lo_d, m->yp, m->slot,
                                   m->w + (size_t)lo * K, Ns, K, D, m->R));
    /* The reverse of combine is a dispatch of the gradients (with the
     * forward's plan), and the reverse of dispatch a combine. */
    if (m->halves) {
        MT_CHECK(moe_bwd_halves(c, m, dxp, dyl_buf, dyp, shared_beside, dxn, dy, xn));
    } else {
        void *dyl;
        MT_CHECK(m->disp->dispatch(m->disp, be, &m->plan, 0, &dyl, dyl_buf, dyp, NULL, NULL,
                                   m->rows, D));
        void *dxl = dyl == dyp ? dxp : dyl;
        MT_CHECK(experts_bwd(c, m, 0, m->E_local, dxl, dyl, m->xl));
        MT_CHECK(m->disp->combine(m->disp, be, &m->plan, dxp, dxl, D));
    }
    void *dxs = (char *)dxn + lo_d;
    MT_CHECK(be->moe_permute_bwd(be, dxs, m->has_shared || Ns < N, dxp, m->slot, Ns, K, D));
    /* router: gradient through the chosen weights and the balance loss, of
     * the share's rows (each row's is its own: the other ranks do theirs) */
    MT_CHECK(be->router_bwd(be, dlogits, dw, m->aux_on ? m->dscores + (size_t)lo * E : NULL,
                            m->scores + (size_t)lo * E, m->idx + (size_t)lo * K, Ns, &m->rc));
    MT_CHECK(be->act_from_f32(be, dlog_act, dlogits, (int64_t)Ns * E));
    MT_CHECK(be->gemm(be, dxs, 0, D, dlog_act, E, 0, m->router->w, D, 1, Ns, D, E, 1.0f, 1));
    MT_CHECK(be->gemm(be, m->router->grad, c->grad_type, D, dlog_act, E, 1,
                      (const char *)xn + lo_d, D, 1, E, D, Ns, 1.0f, 1));
    mt_ws_release(c->ws, mark);
    return MT_OK;
}
