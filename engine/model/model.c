/* model.c - building the model on a backend and running one micro-batch.
 *
 * Forward order (one pipeline stage holding everything):
 *   h0 = embed(ids); h_{l+1} = block_l(h_l); main head on h_L;
 *   MTP depth k on h_L (k = 1) or the previous depth's output, with its head.
 * Each head's backward runs right after its forward (the logits buffer then
 * holds their gradient), so one [N, V] buffer serves every head. Backward
 * then runs MTP depths D..1, blocks L-1..0 and the embedding.
 */
#include "engine/model/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/layers.h"
#include "kernels/mt_fp8.h"
#include "kernels/op_profile.h"
#include "base/mt_log.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"

/* ---- workspace ------------------------------------------------------------ */

void *mt_ws_get(mt_ws *ws, size_t bytes)
{
    size_t start = (ws->top + 255) & ~(size_t)255;
    if (start + bytes > ws->cap) {
        mt_err_at(MT_ENOMEM, __FILE__, __LINE__,
                  "step workspace exhausted: need %zu more bytes, capacity %zu", bytes, ws->cap);
        return NULL;
    }
    ws->top = start + bytes;
    if (ws->top > ws->peak) ws->peak = ws->top;
    return ws->base + start;
}

static size_t max_sz(size_t a, size_t b) { return a > b ? a : b; }

static size_t model_ws_bytes(const mt_model_config *c, const mt_model_opts *o, int N,
                             const mt_moe_dispatcher *disp)
{
    const size_t nd = (size_t)N * c->hidden_size * 4;
    size_t layer = max_sz(mt_mla_ws_bytes(c, N), mt_ffn_ws_bytes(N, c->hidden_size,
                                                                  c->intermediate_size));
    if (c->n_routed_experts > 0) {
        int align, src_align;
        int64_t R_cap, Rl_cap;
        mt_moe_caps(c, o, N, disp, &align, &src_align, &R_cap, &Rl_cap);
        layer = max_sz(layer, mt_moe_ws_bytes(c, N, R_cap, Rl_cap));
    }
    /* block: y / dxn2; MTP: dhin, dcat (2), demb; head: dhn */
    return 2 * nd + 4 * nd + nd + layer + 64 * 256;
}

/* ---- parameters ------------------------------------------------------------ */

static int64_t scale_count(int64_t rows, int64_t cols)
{
    return ((rows + 127) / 128) * ((cols + 127) / 128);
}

static int param_uses_fp8(const mt_model *m, const mt_param_desc *d)
{
    return m->opts.recipe == MT_RECIPE_FP8_BLOCKWISE && mt_param_kind_is_fp8(d->kind);
}

/* Lays the parameters out in table order over the flat buffers. */
static int params_alloc(mt_model *m)
{
    mt_backend *be = m->be;
    const size_t act = mt_act_size(be);
    int64_t n_act = 0, n_q = 0, n_s = 0, n_f32 = 0, n_grad = 0;
    m->params = calloc((size_t)m->table.n, sizeof *m->params);
    if (!m->params) return MT_ERR(MT_ENOMEM, "model: out of memory");
    for (int i = 0; i < m->table.n; i++) {
        const mt_param_desc *d = &m->table.p[i];
        int64_t n = mt_param_numel(d);
        if (d->kind == MT_PK_ROUTER_BIAS)
            n_f32 += n;
        else if (param_uses_fp8(m, d)) {
            n_q += n;
            n_s += scale_count(d->rows, d->cols);
        } else
            n_act += n;
        if (d->kind != MT_PK_ROUTER_BIAS) n_grad += n;
    }
    MT_CHECK(be->alloc(be, (size_t)(n_act > 0 ? n_act : 1) * act, &m->buf_act));
    MT_CHECK(be->alloc(be, (size_t)(n_q > 0 ? n_q : 1), (void **)&m->buf_q));
    MT_CHECK(be->alloc(be, (size_t)(n_q > 0 ? n_q : 1), (void **)&m->buf_qt));
    MT_CHECK(be->alloc(be, (size_t)(n_s > 0 ? n_s : 1) * 4, (void **)&m->buf_s));
    MT_CHECK(be->alloc(be, (size_t)(n_s > 0 ? n_s : 1) * 4, (void **)&m->buf_st));
    MT_CHECK(be->alloc(be, (size_t)(n_f32 > 0 ? n_f32 : 1) * 4, (void **)&m->buf_f32));
    m->grad_type = m->opts.grads_bf16 ? MT_C_BF16 : MT_C_F32;
    const size_t ge = mt_model_grad_size(m);
    MT_CHECK(be->alloc(be, (size_t)(n_grad > 0 ? n_grad : 1) * ge, &m->buf_grad));
    m->n_grad = n_grad;
    m->param_bytes = (size_t)n_act * act + 2 * (size_t)n_q + 8 * (size_t)n_s + 4 * (size_t)n_f32 +
                     ge * (size_t)n_grad;
    int64_t o_act = 0, o_q = 0, o_s = 0, o_f32 = 0, o_grad = 0;
    for (int i = 0; i < m->table.n; i++) {
        mt_param *p = &m->params[i];
        p->d = m->table.p[i];
        int64_t n = mt_param_numel(&p->d);
        p->index = o_grad;
        if (p->d.kind == MT_PK_ROUTER_BIAS) {
            p->wf = m->buf_f32 + o_f32;
            o_f32 += n;
            continue;
        }
        if (param_uses_fp8(m, &p->d)) {
            p->q = m->buf_q + o_q;
            p->qt = m->buf_qt + o_q;
            p->s = m->buf_s + o_s;
            p->st = m->buf_st + o_s;
            o_q += n;
            o_s += scale_count(p->d.rows, p->d.cols);
        } else {
            p->w = (char *)m->buf_act + (size_t)o_act * act;
            o_act += n;
        }
        p->grad = (char *)m->buf_grad + (size_t)o_grad * ge;
        o_grad += n;
    }
    return MT_OK;
}

int mt_model_set_param_dev(mt_model *m, int i, const float *dev)
{
    mt_backend *be = m->be;
    mt_param *p = &m->params[i];
    const int rows = (int)p->d.rows, cols = (int)p->d.cols;
    if (p->wf) return be->copy(be, p->wf, dev, (size_t)mt_param_numel(&p->d) * 4);
    if (p->q) {
        MT_CHECK(be->quant_blocks(be, p->q, p->s, dev, rows, cols));
        return be->transpose_blocks(be, p->qt, p->st, p->q, p->s, rows, cols);
    }
    return be->act_from_f32(be, p->w, dev, mt_param_numel(&p->d));
}

static int64_t param_stage = MT_PARAM_STAGE;

void mt_param_stage_set(int64_t elems) { param_stage = elems > 0 ? elems : MT_PARAM_STAGE; }

int64_t mt_param_stage_rows(const mt_param_desc *d)
{
    if (mt_param_numel(d) <= param_stage) return d->rows;
    int64_t r = param_stage / d->cols / 128 * 128;
    return r < 128 ? 128 : r;
}

int64_t mt_params_stage_elems(const mt_param_table *t)
{
    int64_t mx = 1;
    for (int i = 0; i < t->n; i++) {
        const int64_t r = mt_param_stage_rows(&t->p[i]);
        const int64_t e = (r < t->p[i].rows ? r : t->p[i].rows) * t->p[i].cols;
        if (e > mx) mx = e;
    }
    return mx;
}

/* Slab [r0, r0 + nr) of parameter p from / to the f32 values at dev. FP8:
 * the slab's 128x128 blocks (r0 is a multiple of 128), whose scales start at
 * block row r0 / 128; the transpose is the caller's. */
static int slab_set(mt_backend *be, mt_param *p, int64_t r0, int nr, const float *dev)
{
    const int cols = (int)p->d.cols;
    if (p->wf) return be->copy(be, p->wf + r0 * cols, dev, (size_t)nr * cols * 4);
    if (p->q) {
        const int64_t KB = (cols + 127) / 128;
        return be->quant_blocks(be, p->q + r0 * cols, p->s + r0 / 128 * KB, dev, nr, cols);
    }
    return be->act_from_f32(be, (char *)p->w + (size_t)(r0 * cols) * mt_act_size(be), dev,
                            (int64_t)nr * cols);
}

static int slab_get(mt_backend *be, const mt_param *p, int64_t r0, int nr, float *dev)
{
    const int cols = (int)p->d.cols;
    if (p->q) {
        const int64_t KB = (cols + 127) / 128;
        return be->dequant_blocks(be, dev, p->q + r0 * cols, p->s + r0 / 128 * KB, nr, cols);
    }
    return be->act_to_f32(be, dev, (const char *)p->w + (size_t)(r0 * cols) * mt_act_size(be),
                          (int64_t)nr * cols);
}

int mt_model_set_param(mt_model *m, int i, const float *host)
{
    if (i < 0 || i >= m->table.n) return MT_ERR(MT_EINVAL, "set_param: index %d out of range", i);
    mt_backend *be = m->be;
    mt_param *p = &m->params[i];
    const int64_t rows = p->d.rows, cols = p->d.cols, sr = mt_param_stage_rows(&p->d);
    float *tmp;
    MT_CHECK(be->alloc(be, (size_t)((sr < rows ? sr : rows) * cols) * 4, (void **)&tmp));
    int rc = MT_OK;
    for (int64_t r0 = 0; r0 < rows && rc == MT_OK; r0 += sr) {
        const int nr = (int)(rows - r0 < sr ? rows - r0 : sr);
        rc = be->upload(be, tmp, host + r0 * cols, (size_t)(nr * cols) * 4);
        if (rc == MT_OK) rc = slab_set(be, p, r0, nr, tmp);
    }
    if (rc == MT_OK && p->q)
        rc = be->transpose_blocks(be, p->qt, p->st, p->q, p->s, (int)rows, (int)cols);
    be->free(be, tmp);
    return rc;
}

int mt_model_get_param(mt_model *m, int i, float *host)
{
    if (i < 0 || i >= m->table.n) return MT_ERR(MT_EINVAL, "get_param: index %d out of range", i);
    mt_backend *be = m->be;
    mt_param *p = &m->params[i];
    const int64_t rows = p->d.rows, cols = p->d.cols, sr = mt_param_stage_rows(&p->d);
    if (p->wf) return be->download(be, host, p->wf, (size_t)(rows * cols) * 4);
    float *tmp;
    MT_CHECK(be->alloc(be, (size_t)((sr < rows ? sr : rows) * cols) * 4, (void **)&tmp));
    int rc = MT_OK;
    for (int64_t r0 = 0; r0 < rows && rc == MT_OK; r0 += sr) {
        const int nr = (int)(rows - r0 < sr ? rows - r0 : sr);
        rc = slab_get(be, p, r0, nr, tmp);
        if (rc == MT_OK) rc = be->download(be, host + r0 * cols, tmp, (size_t)(nr * cols) * 4);
    }
    be->free(be, tmp);
    return rc;
}

/* FNV-1a of a parameter name: the per-tensor stream of the initialiser. */
static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ULL;
    return h;
}

float mt_model_init_value(const mt_param_desc *d, double std, uint64_t seed, int64_t i)
{
    /* element i of a tensor-parallel part is element off + [r, c] of the
     * full tensor: the same values whatever the split */
    if (d->full_cols > 0 && (d->off[0] || d->off[1] || d->full_cols != d->cols))
        i = (d->off[0] + i / d->cols) * d->full_cols + d->off[1] + i % d->cols;
    switch (d->kind) {
    case MT_PK_NORM: return 1.0f;
    case MT_PK_ROUTER_BIAS: return 0.0f;
    default: return (float)(std * mt_hash_normal(seed ^ name_hash(d->name), (uint64_t)i));
    }
}

int mt_model_init_random(mt_model *m, uint64_t seed)
{
    int64_t mx = 1;
    for (int i = 0; i < m->table.n; i++)
        if (mt_param_numel(&m->table.p[i]) > mx) mx = mt_param_numel(&m->table.p[i]);
    float *host = malloc((size_t)mx * sizeof *host);
    if (!host) return MT_ERR(MT_ENOMEM, "init: out of memory");
    int rc = MT_OK;
    for (int i = 0; i < m->table.n && rc == MT_OK; i++) {
        const mt_param_desc *d = &m->table.p[i];
        for (int64_t j = 0; j < mt_param_numel(d); j++)
            host[j] = mt_model_init_value(d, m->cfg.initializer_range, seed, j);
        rc = mt_model_set_param(m, i, host);
    }
    free(host);
    return rc;
}

int mt_model_zero_grads(mt_model *m)
{
    for (int i = 0; i < m->table.n; i++) m->params[i].grad_stale = 0;
    return m->be->zero(m->be, m->buf_grad, (size_t)m->n_grad * mt_model_grad_size(m));
}

/* Gradients whose only writers are weight-gradient GEMMs (linear.c's, the
 * head's): the ones deferred zeroing leaves to them. */
static int grad_gemm_written(const mt_param_desc *d)
{
    return d->kind == MT_PK_LINEAR || d->kind == MT_PK_LINEAR_BF16 || d->kind == MT_PK_HEAD;
}

/* Zeroes the gradients of the params that `pick` selects, a memset per run
 * of consecutive ones (gradients lie in table order, mt_param.index). */
static int zero_grad_runs(mt_model *m, int (*pick)(const mt_param *))
{
    const size_t ge = mt_model_grad_size(m);
    int i = 0;
    while (i < m->table.n) {
        const mt_param *p = &m->params[i];
        if (!p->grad || !pick(p)) {
            i++;
            continue;
        }
        int64_t n = 0;
        int j = i;
        for (; j < m->table.n && m->params[j].grad && pick(&m->params[j]); j++)
            n += mt_param_numel(&m->params[j].d);
        MT_CHECK(m->be->zero(m->be, p->grad, (size_t)n * ge));
        for (int k = i; k < j; k++) m->params[k].grad_stale = 0;
        i = j;
    }
    return MT_OK;
}

static int pick_eager(const mt_param *p) { return !grad_gemm_written(&p->d); }
static int pick_stale(const mt_param *p) { return p->grad_stale; }

int mt_model_zero_grads_deferred(mt_model *m)
{
    /* gradients read during the backward (the hook's reductions and sums),
     * or a backward run chunk by chunk (no whole-model step settles them) */
    if (m->opts.on_layer_grads || m->n_chunks != 1 || !m->chunks[0].s.first ||
        !m->chunks[0].s.last)
        return mt_model_zero_grads(m);
    for (int i = 0; i < m->table.n; i++)
        m->params[i].grad_stale = m->params[i].grad && grad_gemm_written(&m->params[i].d);
    return zero_grad_runs(m, pick_eager);
}

int mt_model_grads_settle(mt_model *m) { return zero_grad_runs(m, pick_stale); }

/* ---- build ------------------------------------------------------------------ */

/* global_param: the local table is the full table without the other ranks'
 * experts, in the same order, so one walk over both pairs them up. */
static int global_params(mt_model *m)
{
    mt_param_table full;
    MT_CHECK(mt_params_build(&full, &m->cfg, 0, -1));
    m->global_param = malloc((size_t)(m->table.n > 0 ? m->table.n : 1) * sizeof *m->global_param);
    int rc = m->global_param ? MT_OK : MT_ERR(MT_ENOMEM, "model: out of memory");
    int i = 0;
    for (int g = 0; g < full.n && i < m->table.n && rc == MT_OK; g++)
        if (strcmp(full.p[g].name, m->table.p[i].name) == 0) m->global_param[i++] = g;
    if (rc == MT_OK && i != m->table.n)
        rc = MT_ERR(MT_EINVAL, "model: parameter %s is not in the full table",
                    m->table.p[i].name);
    m->n_params_global = full.n;
    mt_params_free(&full);
    return rc;
}

static mt_param *param_by_role(mt_model *m, int layer, mt_param_role role)
{
    for (int i = 0; i < m->table.n; i++)
        if (m->table.p[i].layer == layer && m->table.p[i].role == role) return &m->params[i];
    return NULL;
}

/* The slot's own copies of a chunk's layers and residual stream. Slot 0
 * uses the model's structs (m->blocks, m->head, m->mtp); the others get
 * their own, bound to the same parameters, with the expert-load counters
 * shared with slot 0 (loads are per layer, not per micro-batch). */
static int slot_init(mt_model *m, const mt_chunk *ch, mt_chunk_slot *sl, int s)
{
    mt_backend *be = m->be;
    const mt_model_config *c = &m->cfg;
    const int N = m->ctx.N, D = c->hidden_size, L = c->num_hidden_layers;
    const int lo = ch->s.layer_lo, n = ch->s.layer_hi - lo;
    const size_t act = mt_act_size(be), nd = (size_t)N * D * act;
    sl->blocks = s == 0 ? m->blocks + lo : calloc((size_t)(n > 0 ? n : 1), sizeof *sl->blocks);
    sl->h = calloc((size_t)n + 1, sizeof *sl->h);
    if (!sl->blocks || !sl->h) return MT_ERR(MT_ENOMEM, "model: out of memory");
    for (int i = 0; i < n; i++) {
        mt_block *b = &sl->blocks[i];
        MT_CHECK(mt_block_init(b, be, c, &m->opts, lo + i, N, m->disp));
        MT_CHECK(mt_block_bind(b, m->params, &m->table, lo + i));
        if (s > 0 && b->is_moe) {
            free(b->moe.load);
            b->moe.load = m->blocks[lo + i].moe.load;
        }
    }
    for (int i = 0; i <= n; i++) MT_CHECK(be->alloc(be, nd, &sl->h[i]));
    MT_CHECK(be->alloc(be, nd, &sl->dh));
    MT_CHECK(be->alloc(be, (size_t)N * 4, (void **)&sl->ids));
    MT_CHECK(be->alloc(be, (size_t)N * 4, (void **)&sl->tgt));
    if (!ch->s.last) return MT_OK;
    const int K = m->n_mtp;
    if (s == 0) {
        sl->head = &m->head;
        sl->mtp = m->mtp;
        sl->mtp_head = m->mtp_head;
    } else {
        sl->head = calloc(1, sizeof *sl->head);
        sl->mtp = calloc((size_t)(K > 0 ? K : 1), sizeof *sl->mtp);
        sl->mtp_head = calloc((size_t)(K > 0 ? K : 1), sizeof *sl->mtp_head);
    }
    sl->dmtp = calloc((size_t)(K > 0 ? K : 1), sizeof *sl->dmtp);
    if (!sl->head || !sl->mtp || !sl->mtp_head || !sl->dmtp)
        return MT_ERR(MT_ENOMEM, "model: out of memory");
    sl->head->norm = param_by_role(m, -1, MT_PR_FINAL_NORM);
    sl->head->head = c->tie_word_embeddings ? m->embed : param_by_role(m, -1, MT_PR_HEAD);
    MT_CHECK(mt_head_init(sl->head, be, N, D));
    sl->head->v_lo = m->v_lo;
    for (int k = 0; k < K; k++) {
        mt_mtp *p = &sl->mtp[k];
        const int l = L + k;
        MT_CHECK(mt_mtp_init(p, be, c, &m->opts, k + 1, N, m->disp));
        MT_CHECK(mt_block_bind(&p->block, m->params, &m->table, l));
        if (s > 0 && p->block.is_moe) {
            free(p->block.moe.load);
            p->block.moe.load = m->mtp[k].block.moe.load;
        }
        p->enorm = param_by_role(m, l, MT_PR_MTP_ENORM);
        p->hnorm = param_by_role(m, l, MT_PR_MTP_HNORM);
        p->eh = param_by_role(m, l, MT_PR_MTP_EH);
        p->norm = param_by_role(m, l, MT_PR_MTP_NORM);
        sl->mtp_head[k].norm = p->norm;
        sl->mtp_head[k].head = sl->head->head;
        MT_CHECK(mt_head_init(&sl->mtp_head[k], be, N, D));
        sl->mtp_head[k].v_lo = m->v_lo;
        MT_CHECK(be->alloc(be, nd, &sl->dmtp[k]));
    }
    return MT_OK;
}

static void slot_free(mt_model *m, const mt_chunk *ch, mt_chunk_slot *sl, int s)
{
    mt_backend *be = m->be;
    const int n = ch->s.layer_hi - ch->s.layer_lo;
    for (int i = 0; sl->blocks && i < n; i++) {
        if (s > 0) sl->blocks[i].moe.load = NULL; /* slot 0's */
        mt_block_free(&sl->blocks[i], be);
    }
    for (int i = 0; sl->h && i <= n; i++)
        if (sl->h[i]) be->free(be, sl->h[i]);
    void *bufs[] = {sl->dh, sl->ids, sl->tgt};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    for (int k = 0; sl->dmtp && k < m->n_mtp; k++) {
        if (s > 0) sl->mtp[k].block.moe.load = NULL;
        mt_mtp_free(&sl->mtp[k], be);
        mt_head_free(&sl->mtp_head[k], be);
        if (sl->dmtp[k]) be->free(be, sl->dmtp[k]);
    }
    if (sl->head) mt_head_free(sl->head, be);
    if (s > 0) {
        free(sl->blocks);
        free(sl->head);
        free(sl->mtp);
        free(sl->mtp_head);
    }
    free(sl->h);
    free(sl->dmtp);
}

/* This rank's chunks from the options (default: one chunk of everything). */
static int model_chunks(mt_model *m)
{
    const mt_model_config *c = &m->cfg;
    const mt_model_opts *o = &m->opts;
    const int L = c->num_hidden_layers, K = c->num_nextn_predict_layers;
    m->n_chunks = o->n_chunks > 0 ? o->n_chunks : 1;
    m->chunks = calloc((size_t)m->n_chunks, sizeof *m->chunks);
    m->local = calloc((size_t)(L + K + 1), 1);
    if (!m->chunks || !m->local) return MT_ERR(MT_ENOMEM, "model: out of memory");
    for (int i = 0; i < m->n_chunks; i++) {
        mt_chunk *ch = &m->chunks[i];
        if (o->n_chunks > 0) {
            ch->s = o->chunks[i];
            ch->id = o->chunk_ids ? o->chunk_ids[i] : i;
            ch->n_slots = o->chunk_slots ? o->chunk_slots[i] : 1;
        } else {
            ch->s = (mt_stage){0, L, 1, 1};
            ch->n_slots = 1;
        }
        if (ch->s.layer_lo < 0 || ch->s.layer_hi < ch->s.layer_lo || ch->s.layer_hi > L ||
            ch->n_slots < 1)
            return MT_ERR(MT_EINVAL, "model: chunk %d has layers [%d, %d) of %d and %d slots",
                          ch->id, ch->s.layer_lo, ch->s.layer_hi, L, ch->n_slots);
        for (int l = ch->s.layer_lo; l < ch->s.layer_hi; l++) {
            if (m->local[l]) return MT_ERR(MT_EINVAL, "model: layer %d is in two chunks", l);
            m->local[l] = 1;
        }
        m->has_first |= ch->s.first;
        m->has_last |= ch->s.last;
    }
    for (int k = 0; k < K; k++) m->local[L + k] = (unsigned char)m->has_last;
    m->embed_replica = m->has_last && !m->has_first && (K > 0 || c->tie_word_embeddings);
    return MT_OK;
}

/* Keeps the parameters of this rank's chunks in the table (in order). */
static void params_filter(mt_model *m)
{
    int n = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mt_param_desc *d = &m->table.p[i];
        int keep = d->layer >= 0 ? m->local[d->layer]
                   : d->role == MT_PR_EMBED ? m->has_first || m->embed_replica
                                            : m->has_last; /* final norm, head */
        if (keep) m->table.p[n++] = *d;
    }
    m->table.n = n;
}

static int model_build_layers(mt_model *m)
{
    mt_backend *be = m->be;
    const mt_model_config *c = &m->cfg;
    const int N = m->ctx.N, L = c->num_hidden_layers;
    const size_t act = mt_act_size(be);
    m->embed = param_by_role(m, -1, MT_PR_EMBED);
    m->n_blocks = L;
    m->n_mtp = c->num_nextn_predict_layers;
    m->blocks = calloc((size_t)(L > 0 ? L : 1), sizeof *m->blocks);
    m->mtp = calloc((size_t)(m->n_mtp > 0 ? m->n_mtp : 1), sizeof *m->mtp);
    m->mtp_head = calloc((size_t)(m->n_mtp > 0 ? m->n_mtp : 1), sizeof *m->mtp_head);
    if (!m->blocks || !m->mtp || !m->mtp_head) return MT_ERR(MT_ENOMEM, "model: out of memory");
    for (int i = 0; i < m->n_chunks; i++) {
        mt_chunk *ch = &m->chunks[i];
        ch->slots = calloc((size_t)ch->n_slots, sizeof *ch->slots);
        if (!ch->slots) return MT_ERR(MT_ENOMEM, "model: out of memory");
        for (int s = 0; s < ch->n_slots; s++) MT_CHECK(slot_init(m, ch, &ch->slots[s], s));
    }
    if (m->has_last)
        MT_CHECK(be->alloc(be, (size_t)N * m->V_local * act, &m->logits));
    return MT_OK;
}

int mt_model_embed_index(const mt_model *m)
{
    return m->embed ? (int)(m->embed - m->params) : -1;
}

int mt_model_grad_ready(const mt_model *m, int i)
{
    const mt_param_desc *d = &m->params[i].d;
    if (d->layer >= 0) return d->layer;
    const int head = d->role == MT_PR_FINAL_NORM ||
                     (d->role == MT_PR_HEAD && !m->cfg.tie_word_embeddings);
    return head ? MT_LAYER_HEAD : -1;
}

int mt_model_create(mt_model **out, const mt_model_config *cfg, const mt_model_opts *opts,
                    mt_backend *be)
{
    *out = NULL;
    if (opts->recipe == MT_RECIPE_FP32 && be->kind != MT_BE_CPU)
        return MT_ERR(MT_ENOTSUP, "precision.recipe \"fp32\" runs on the cpu backend only");
    if (opts->micro_batch < 1 || opts->seq_len < 1)
        return MT_ERR(MT_EINVAL, "model: micro-batch %d x sequence %d", opts->micro_batch,
                      opts->seq_len);
    mt_model *m = calloc(1, sizeof *m);
    if (!m) return MT_ERR(MT_ENOMEM, "model: out of memory");
    int rc;
    m->cfg = *cfg;
    m->opts = *opts;
    m->be = be;
    be->round_bf16 = opts->recipe != MT_RECIPE_FP32;
    const int B = opts->micro_batch, T = opts->seq_len, N = B * T;
    const int R = cfg->qk_rope_head_dim;
    MT_GOTO(model_chunks(m), fail);
    if (opts->dispatcher) {
        m->disp = opts->dispatcher;
    } else {
        MT_GOTO(mt_moe_dispatch_identity(&m->disp, cfg->n_routed_experts), fail);
        m->own_disp = 1;
    }
    if (m->disp->E != cfg->n_routed_experts || m->disp->e_lo < 0 || m->disp->E_local < 0 ||
        m->disp->e_lo + m->disp->E_local > cfg->n_routed_experts) {
        rc = MT_ERR(MT_EINVAL, "model: the dispatcher's experts [%d, %d) of %d do not fit "
                    "n_routed_experts %d", m->disp->e_lo, m->disp->e_lo + m->disp->E_local,
                    m->disp->E, cfg->n_routed_experts);
        goto fail;
    }
    MT_GOTO(mt_params_build(&m->table, cfg, m->disp->e_lo, m->disp->e_lo + m->disp->E_local),
            fail);
    params_filter(m);
    if (opts->tp && opts->tp->size > 1) {
        const int tp = opts->tp->size;
        const int64_t sh = (int64_t)cfg->moe_intermediate_size * cfg->n_shared_experts;
        if (cfg->num_attention_heads % tp || cfg->intermediate_size % tp || sh % tp ||
            cfg->vocab_size < tp) {
            rc = MT_ERR(MT_EINVAL, "model: tp %d must divide num_attention_heads %d, "
                        "intermediate_size %d and the shared experts' width %lld", tp,
                        cfg->num_attention_heads, cfg->intermediate_size, (long long)sh);
            goto fail;
        }
        if (opts->tp->sp && (opts->micro_batch * opts->seq_len) % tp) {
            rc = MT_ERR(MT_EINVAL, "model: sequence parallelism splits the %d x %d tokens of a "
                        "micro-batch over tp %d: they do not divide", opts->micro_batch,
                        opts->seq_len, tp);
            goto fail;
        }
        mt_params_tp_local(&m->table, tp, opts->tp->rank);
    }
    if (m->disp->etp > 1) { /* this rank's slice of every local expert */
        if (cfg->moe_intermediate_size % m->disp->etp) {
            rc = MT_ERR(MT_EINVAL, "model: etp %d must divide moe_intermediate_size %d",
                        m->disp->etp, cfg->moe_intermediate_size);
            goto fail;
        }
        mt_params_etp_local(&m->table, m->disp->etp, m->disp->etp_rank);
    }
    /* this rank's vocabulary rows: the embedding's, or the head's on a last
     * stage without an embedding (the two split alike) */
    m->v_lo = 0;
    m->V_local = (int)cfg->vocab_size;
    for (int i = 0; i < m->table.n; i++)
        if (m->table.p[i].layer == -1 &&
            (m->table.p[i].role == MT_PR_EMBED || m->table.p[i].role == MT_PR_HEAD)) {
            m->v_lo = (int)m->table.p[i].off[0];
            m->V_local = (int)m->table.p[i].rows;
            break;
        }
    MT_GOTO(global_params(m), fail);
    MT_GOTO(params_alloc(m), fail);

    mt_ctx *c = &m->ctx;
    c->be = be;
    c->recipe = opts->recipe;
    c->B = B;
    c->T = T;
    c->N = N;
    c->ws = &m->ws;
    c->rope_interleave = cfg->rope_interleave;
    c->recompute_mla_up = opts->recompute_mla_up;
    c->recompute_moe_act = opts->recompute_moe_act;
    c->grad_type = opts->grads_bf16 ? MT_C_BF16 : MT_C_F32;
    c->rms_eps = (float)cfg->rms_norm_eps;
    c->tp = opts->tp;
    {
        float *ct = malloc((size_t)T * (R / 2) * 4), *st = malloc((size_t)T * (R / 2) * 4);
        rc = ct && st ? mt_rope_tables(cfg, T, ct, st, &c->attn_scale)
                      : MT_ERR(MT_ENOMEM, "model: out of memory");
        if (rc == MT_OK) rc = be->alloc(be, (size_t)T * (R / 2) * 4, (void **)&m->rope_cos);
        if (rc == MT_OK) rc = be->alloc(be, (size_t)T * (R / 2) * 4, (void **)&m->rope_sin);
        if (rc == MT_OK) rc = be->upload(be, m->rope_cos, ct, (size_t)T * (R / 2) * 4);
        if (rc == MT_OK) rc = be->upload(be, m->rope_sin, st, (size_t)T * (R / 2) * 4);
        free(ct);
        free(st);
        if (rc < 0) goto fail;
        c->rope_cos = m->rope_cos;
        c->rope_sin = m->rope_sin;
    }
    MT_GOTO(model_build_layers(m), fail);
    m->ws.be = be;
    m->ws.cap = model_ws_bytes(cfg, opts, N, m->disp);
    MT_GOTO(be->alloc(be, m->ws.cap, (void **)&m->ws.base), fail);
    m->host_tok = malloc((size_t)B * (T + 1) * 4);
    m->host_i32 = malloc((size_t)N * 4);
    m->host_tgt = malloc((size_t)N * 4);
    m->host_loss = malloc((size_t)N * 4);
    if (!m->host_tok || !m->host_i32 || !m->host_tgt || !m->host_loss) {
        rc = MT_ERR(MT_ENOMEM, "model: out of memory");
        goto fail;
    }
    *out = m;
    return MT_OK;
fail:
    mt_model_destroy(m);
    return rc;
}

void mt_model_destroy(mt_model *m)
{
    if (!m) return;
    mt_backend *be = m->be;
    for (int i = 0; m->chunks && i < m->n_chunks; i++)
        for (int sl = 0; m->chunks[i].slots && sl < m->chunks[i].n_slots; sl++)
            slot_free(m, &m->chunks[i], &m->chunks[i].slots[sl], sl);
    for (int i = 0; m->chunks && i < m->n_chunks; i++) free(m->chunks[i].slots);
    void *bufs[] = {m->logits, m->rope_cos, m->rope_sin,
                    m->buf_act, m->buf_q, m->buf_qt, m->buf_s, m->buf_st, m->buf_f32,
                    m->buf_grad, m->ws.base};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    if (m->disp && m->own_disp) m->disp->destroy(m->disp);
    for (int i = 0; i < m->n_defer; i++) mt_wdefer_free(&m->defer[i], be);
    free(m->defer);
    free(m->defer_busy);
    free(m->chunks);
    free(m->local);
    free(m->global_param);
    free(m->blocks);
    free(m->mtp);
    free(m->mtp_head);
    free(m->params);
    free(m->host_tok);
    free(m->host_i32);
    free(m->host_tgt);
    free(m->host_loss);
    mt_params_free(&m->table);
    free(m);
}

/* ---- one micro-batch ------------------------------------------------------- */

/* ids[b, t] = tokens[b, t + k]; tgt[b, t] = tokens[b, t + k + 1] or ignore. */
static void shift_tokens(const int32_t *tokens, int B, int T, int k, int32_t *ids, int32_t *tgt)
{
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const int32_t *row = tokens + (size_t)b * (T + 1);
            ids[b * T + t] = t + k <= T ? row[t + k] : 0;
            tgt[b * T + t] = t + k + 1 <= T ? row[t + k + 1] : MT_IGNORE;
        }
}

static int moe_aux_sum(mt_model *m, mt_block *b, double *sum)
{
    if (!b->is_moe || !b->moe.aux_on) return MT_OK;
    float v;
    MT_CHECK(m->be->download(m->be, &v, b->moe.aux_loss, 4));
    *sum += v;
    return m->be->zero(m->be, b->moe.aux_loss, 4);
}

/* Host f32 [N, V] copy of the logits buffer (act [N, V]). */
static int download_logits(mt_model *m, float *out, int64_t n)
{
    mt_backend *be = m->be;
    if (mt_act_size(be) == 4) return be->download(be, out, m->logits, (size_t)n * 4);
    uint16_t *raw = malloc((size_t)n * 2); /* bf16 bits */
    if (!raw) return MT_ERR(MT_ENOMEM, "logits: out of memory (%lld values)", (long long)n);
    int rc = be->download(be, raw, m->logits, (size_t)n * 2);
    for (int64_t i = 0; rc == MT_OK && i < n; i++) out[i] = mt_bf16_to_f32(raw[i]);
    free(raw);
    return rc;
}

/* Vocabulary-parallel embedding: token ids as rows of this rank's part of
 * the table, -1 (a zero row, no gradient) for the other ranks' tokens. */
static void local_ids(const mt_model *m, int32_t *ids, int N)
{
    if (!mt_tp_on(&m->ctx)) return;
    for (int i = 0; i < N; i++)
        ids[i] = ids[i] >= m->v_lo && ids[i] < m->v_lo + m->V_local ? ids[i] - m->v_lo : -1;
}

/* The backward is done with layer `layer`'s gradients (mt_model_opts). */
static int layer_grads_final(mt_model *m, int layer)
{
    return m->opts.on_layer_grads ? m->opts.on_layer_grads(m->opts.on_layer_grads_arg, layer) : MT_OK;
}

/* Layer `layer`'s gradients are final once the work recorded so far has
 * run: now, or as a mark in the deferral list of a split backward. */
static int layer_done(mt_model *m, int layer)
{
    if (m->ctx.defer) return mt_wdefer_mark(m->ctx.defer, layer);
    return layer_grads_final(m, layer);
}

/* The one forward of training, validation and scoring, for chunk ci in
 * slot `slot`; `so` (scoring outputs) may be NULL. */
static int chunk_fwd(mt_model *m, int ci, int slot, const int32_t *tokens, int backward,
                     double loss_scale, mt_mb_stats *st, const mt_score_out *so)
{
    mt_backend *be = m->be;
    mt_ctx *c = &m->ctx;
    const int N = c->N, B = c->B, T = c->T, D = m->cfg.hidden_size;
    const int V = (int)m->cfg.vocab_size, Vl = m->V_local;
    const double alpha = m->opts.aux_alpha, lambda = m->opts.mtp_weight;
    const float aux_gs = backward ? (float)loss_scale : 0.0f;
    memset(st, 0, sizeof *st);
    if (ci < 0 || ci >= m->n_chunks || slot < 0 || slot >= m->chunks[ci].n_slots)
        return MT_ERR(MT_EINVAL, "model: chunk %d slot %d is not on this rank", ci, slot);
    const mt_chunk *ch = &m->chunks[ci];
    mt_chunk_slot *sl = &ch->slots[slot];
    const int n = ch->s.layer_hi - ch->s.layer_lo;
    m->ws.top = 0;
    for (int i = 0; i < B * (T + 1); i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return MT_ERR(MT_EINVAL, "token %d at position %d is outside the vocabulary [0, %d)",
                          tokens[i], i, V);

    if (so && so->logits && mt_tp_on(c))
        return MT_ERR(MT_ENOTSUP, "scoring: the full logits are not gathered under tensor "
                      "parallelism (each rank holds vocabulary rows [%d, %d))", m->v_lo,
                      m->v_lo + Vl);

    /* main model */
    if (ch->s.first) {
        mt_op_profile_mark(be, "fwd.embed");
        shift_tokens(tokens, B, T, 0, m->host_i32, m->host_tgt);
        local_ids(m, m->host_i32, N);
        MT_CHECK(be->upload(be, sl->ids, m->host_i32, (size_t)N * 4));
        /* vocabulary-parallel: one rank's row each, summed (sequence
         * parallelism: this rank's rows of the sum; dh serves as the full
         * partial) */
        if (mt_tp_sp(c)) {
            MT_CHECK(be->embedding_fwd(be, sl->dh, m->embed->w, sl->ids, N, D));
            MT_CHECK(mt_tp_scatter_rows(c, sl->dh, sl->h[0], D));
        } else {
            MT_CHECK(be->embedding_fwd(be, sl->h[0], m->embed->w, sl->ids, N, D));
            MT_CHECK(mt_tp_sum(c, sl->h[0], (int64_t)N * D));
        }
    }
    for (int i = 0; i < n; i++)
        MT_CHECK(mt_block_fwd(c, &sl->blocks[i], sl->h[i + 1], sl->h[i], alpha, aux_gs));
    for (int i = 0; i < n; i++) MT_CHECK(moe_aux_sum(m, &sl->blocks[i], &st->aux_loss));
    if (!ch->s.last) {
        st->total = st->aux_loss;
        return MT_OK;
    }
    double sum;
    int64_t cnt;
    float gs = backward ? (float)(loss_scale / N) : 0.0f;
    mt_op_profile_mark(be, "fwd.head");
    shift_tokens(tokens, B, T, 0, m->host_i32, m->host_tgt);
    MT_CHECK(be->upload(be, sl->tgt, m->host_tgt, (size_t)N * 4));
    MT_CHECK(mt_head_logits(c, sl->head, m->logits, sl->h[n], Vl));
    if (so && so->logits) MT_CHECK(download_logits(m, so->logits, (int64_t)N * V));
    MT_CHECK(mt_head_loss(c, sl->head, m->logits, sl->tgt, Vl, gs, m->host_loss, &sum, &cnt,
                          m->host_tgt));
    if (so && so->tok_loss) memcpy(so->tok_loss, m->host_loss, (size_t)N * sizeof(float));
    st->loss = sum / (double)cnt;
    st->tokens = cnt;
    mt_op_profile_mark(be, "bwd.head");
    if (backward) MT_CHECK(mt_head_bwd(c, sl->head, sl->dh, 0, m->logits, sl->h[n], Vl));

    /* MTP depths */
    for (int k = 0; k < m->n_mtp; k++) {
        mt_mtp *p = &sl->mtp[k];
        const void *hprev = k == 0 ? sl->h[n] : sl->mtp[k - 1].hout;
        mt_op_profile_mark(be, "fwd.mtp");
        shift_tokens(tokens, B, T, k + 1, m->host_i32, m->host_tgt);
        local_ids(m, m->host_i32, N);
        MT_CHECK(be->upload(be, p->ids, m->host_i32, (size_t)N * 4));
        MT_CHECK(be->upload(be, p->tgt, m->host_tgt, (size_t)N * 4));
        MT_CHECK(mt_mtp_fwd(c, p, m->embed, hprev, alpha, aux_gs));
        int valid = B * (T - k - 1);
        if (valid <= 0) return MT_ERR(MT_EINVAL, "MTP depth %d needs sequences longer than %d", k + 1, T);
        gs = backward ? (float)(loss_scale * lambda / m->n_mtp / valid) : 0.0f;
        MT_CHECK(mt_head_fwd(c, &sl->mtp_head[k], m->logits, p->hout, p->tgt, Vl, gs,
                             m->host_loss, &sum, &cnt, m->host_tgt));
        st->mtp_loss += sum / (double)cnt / m->n_mtp;
        if (backward)
            MT_CHECK(mt_head_bwd(c, &sl->mtp_head[k], sl->dmtp[k], 0, m->logits, p->hout, Vl));
    }
    if (backward) MT_CHECK(layer_done(m, MT_LAYER_HEAD)); /* the final norm's and head's */
    for (int k = 0; k < m->n_mtp; k++) MT_CHECK(moe_aux_sum(m, &sl->mtp[k].block, &st->aux_loss));
    st->total = st->loss + lambda * st->mtp_loss + st->aux_loss;
    return MT_OK;
}

int mt_model_chunk_fwd(mt_model *m, int ci, int slot, const int32_t *tokens, int backward,
                       double loss_scale, mt_mb_stats *st)
{
    return chunk_fwd(m, ci, slot, tokens, backward, loss_scale, st, NULL);
}

static int chunk_bwd(mt_model *m, int ci, int slot)
{
    mt_backend *be = m->be;
    mt_ctx *c = &m->ctx;
    if (ci < 0 || ci >= m->n_chunks || slot < 0 || slot >= m->chunks[ci].n_slots)
        return MT_ERR(MT_EINVAL, "model: chunk %d slot %d is not on this rank", ci, slot);
    const mt_chunk *ch = &m->chunks[ci];
    mt_chunk_slot *sl = &ch->slots[slot];
    const int n = ch->s.layer_hi - ch->s.layer_lo;
    m->ws.top = 0;
    if (ch->s.last) {
        mt_op_profile_mark(be, "bwd.mtp");
        for (int k = m->n_mtp - 1; k >= 0; k--) {
            mt_mtp *p = &sl->mtp[k];
            void *dprev = k == 0 ? sl->dh : sl->dmtp[k - 1];
            const void *hprev = k == 0 ? sl->h[n] : sl->mtp[k - 1].hout;
            MT_CHECK(mt_mtp_bwd(c, p, m->embed, dprev, sl->dmtp[k], hprev));
            MT_CHECK(layer_done(m, p->block.layer));
        }
    }
    for (int i = n - 1; i >= 0; i--) {
        MT_CHECK(mt_block_bwd(c, &sl->blocks[i], sl->dh, sl->dh, sl->h[i]));
        MT_CHECK(layer_done(m, sl->blocks[i].layer));
    }
    if (ch->s.first) {
        mt_op_profile_mark(be, "bwd.embed");
        const int D = m->cfg.hidden_size;
        if (mt_tp_sp(c)) { /* every row's gradient for the tokens' rows (h[0] is free now) */
            MT_CHECK(mt_tp_gather_rows(c, sl->dh, sl->h[0], D));
            MT_CHECK(be->embedding_bwd(be, m->embed->grad, m->grad_type, sl->h[0], sl->ids, c->N, D));
        } else {
            MT_CHECK(be->embedding_bwd(be, m->embed->grad, m->grad_type, sl->dh, sl->ids, c->N, D));
        }
        MT_CHECK(layer_done(m, -1));
    }
    return MT_OK;
}

int mt_model_chunk_bwd(mt_model *m, int ci, int slot)
{
    return chunk_bwd(m, ci, slot);
}

int mt_model_chunk_bwd_in(mt_model *m, int ci, int slot, int *handle)
{
    int h = 0;
    while (h < m->n_defer && m->defer_busy[h]) h++;
    if (h == m->n_defer) { /* the pool grows to the most pending at once */
        mt_wdefer *d = realloc(m->defer, (size_t)(h + 1) * sizeof *d);
        if (d) m->defer = d;
        unsigned char *b = realloc(m->defer_busy, (size_t)(h + 1));
        if (b) m->defer_busy = b;
        if (!d || !b) return MT_ERR(MT_ENOMEM, "model: out of memory for a deferral list");
        memset(&m->defer[h], 0, sizeof m->defer[h]);
        m->defer_busy[h] = 0;
        m->n_defer = h + 1;
    }
    mt_wdefer *d = &m->defer[h];
    d->n = 0;
    d->used = 0;
    m->ctx.defer = d;
    int rc = chunk_bwd(m, ci, slot);
    m->ctx.defer = NULL;
    MT_CHECK(rc);
    m->defer_busy[h] = 1;
    *handle = h;
    size_t pending = 0;
    for (int i = 0; i < m->n_defer; i++)
        if (m->defer_busy[i]) pending += m->defer[i].used;
    if (pending > m->defer_peak) m->defer_peak = pending;
    return MT_OK;
}

int mt_model_chunk_bwd_w(mt_model *m, int handle)
{
    if (handle < 0 || handle >= m->n_defer || !m->defer_busy[handle])
        return MT_ERR(MT_EINVAL, "model: weight-gradient part of deferral %d, which is not "
                      "pending (%d lists)", handle, m->n_defer);
    mt_wdefer *d = &m->defer[handle];
    m->ws.top = 0;
    for (int i = 0; i < d->n; i++) {
        const mt_wdefer_rec *r = &d->r[i];
        if (r->mark) MT_CHECK(layer_grads_final(m, r->layer));
        else MT_CHECK(mt_wdefer_replay(&m->ctx, r));
    }
    d->n = 0;
    d->used = 0;
    m->defer_busy[handle] = 0;
    return MT_OK;
}

void mt_model_defer_reset(mt_model *m)
{
    for (int i = 0; i < m->n_defer; i++) {
        m->defer[i].n = 0;
        m->defer[i].used = 0;
        m->defer_busy[i] = 0;
    }
}

size_t mt_model_defer_bytes(const mt_model *m)
{
    size_t b = 0;
    for (int i = 0; i < m->n_defer; i++) b += mt_wdefer_bytes(&m->defer[i]);
    return b;
}

/* The whole model on one rank: its one chunk. */
static int model_step(mt_model *m, const int32_t *tokens, int backward, double loss_scale,
                      mt_mb_stats *st, const mt_score_out *so)
{
    if (m->n_chunks != 1 || !m->chunks[0].s.first || !m->chunks[0].s.last)
        return MT_ERR(MT_EINVAL, "model: a whole-model step on a pipeline stage (this rank "
                      "holds %d of the chunks); the pipeline executor runs them", m->n_chunks);
    MT_CHECK(chunk_fwd(m, 0, 0, tokens, backward, loss_scale, st, so));
    if (!backward) return MT_OK;
    MT_CHECK(mt_model_chunk_bwd(m, 0, 0));
    return mt_model_grads_settle(m);
}

int mt_model_step(mt_model *m, const int32_t *tokens, int backward, double loss_scale,
                  mt_mb_stats *st)
{
    return model_step(m, tokens, backward, loss_scale, st, NULL);
}

int mt_model_score(mt_model *m, const int32_t *tokens, const mt_score_out *so, mt_mb_stats *st)
{
    return model_step(m, tokens, 0, 1.0, st, so);
}

/* ---- router state ------------------------------------------------------------ */

static mt_block *block_of_layer(const mt_model *m, int layer)
{
    if (layer < 0 || layer >= m->n_blocks + m->n_mtp || !m->local[layer]) return NULL;
    if (layer >= 0 && layer < m->n_blocks) return &m->blocks[layer];
    int k = layer - m->n_blocks;
    if (k >= 0 && k < m->n_mtp) return &m->mtp[k].block;
    return NULL;
}

const int64_t *mt_model_expert_load(const mt_model *m, int layer)
{
    mt_block *b = block_of_layer(m, layer);
    return b && b->is_moe ? b->moe.load : NULL;
}

void mt_model_reset_load(mt_model *m)
{
    const int E = m->cfg.n_routed_experts;
    for (int l = 0; l < m->n_blocks + m->n_mtp; l++) {
        mt_block *b = block_of_layer(m, l);
        if (b && b->is_moe) memset(b->moe.load, 0, (size_t)E * sizeof *b->moe.load);
    }
}

int mt_model_get_router_bias(mt_model *m, int layer, float *host)
{
    mt_block *b = block_of_layer(m, layer);
    if (!b || !b->is_moe || !b->moe.bias)
        return MT_ERR(MT_EINVAL, "layer %d has no router bias", layer);
    return m->be->download(m->be, host, b->moe.bias->wf, (size_t)m->cfg.n_routed_experts * 4);
}

int mt_model_set_router_bias(mt_model *m, int layer, const float *host)
{
    mt_block *b = block_of_layer(m, layer);
    if (!b || !b->is_moe || !b->moe.bias)
        return MT_ERR(MT_EINVAL, "layer %d has no router bias", layer);
    return m->be->upload(m->be, b->moe.bias->wf, host, (size_t)m->cfg.n_routed_experts * 4);
}

/* ---- FLOPs ------------------------------------------------------------------- */

/* Multiply-adds per token of one decoder layer's linears (active experts only). */
static double layer_linear_macs(const mt_model_config *c, int l)
{
    const double D = c->hidden_size, H = c->num_attention_heads;
    const double dqk = mt_config_qk_head_dim(c), dv = c->v_head_dim;
    const double QL = c->q_lora_rank, KL = c->kv_lora_rank, R = c->qk_rope_head_dim;
    double a = QL > 0 ? D * QL + QL * H * dqk : D * H * dqk;
    a += D * (KL + R) + KL * H * (c->qk_nope_head_dim + dv) + H * dv * D;
    if (mt_config_layer_is_moe(c, l)) {
        const double F = c->moe_intermediate_size;
        a += D * c->n_routed_experts; /* router */
        a += 3.0 * D * F * (c->num_experts_per_tok + c->n_shared_experts);
    } else {
        a += 3.0 * D * c->intermediate_size;
    }
    return a;
}

double mt_model_flops_per_token(const mt_model_config *c, int T)
{
    const double D = c->hidden_size, V = (double)c->vocab_size, H = c->num_attention_heads;
    const double attn = H * (mt_config_qk_head_dim(c) + c->v_head_dim) * (T + 1) / 2.0;
    double macs = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) macs += layer_linear_macs(c, l) + attn;
    macs += D * V; /* head */
    for (int k = 0; k < c->num_nextn_predict_layers; k++)
        macs += layer_linear_macs(c, c->num_hidden_layers + k) + attn + 2 * D * D + D * V;
    /* 2 FLOPs per multiply-add, forward + 2x backward */
    return 6.0 * macs;
}
