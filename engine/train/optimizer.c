/* optimizer.c - AdamW with BF16 moments over a shard of the flat parameters. */
#include "engine/train/optimizer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/mt_fp8.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"

static size_t master_elem(mt_main_params p) { return p == MT_MAIN_FP32 ? 4 : 2; }

/* Does this rank keep parameter i's state? */
static int in_shard(const mt_optimizer *o, int i) { return o->off[i] >= 0; }

int mt_optimizer_create(mt_optimizer **out, mt_model *m, const mt_jobspec *j,
                        const unsigned char *keep)
{
    mt_backend *be = m->be;
    *out = NULL;
    mt_optimizer *o = calloc(1, sizeof *o);
    if (!o) return MT_ERR(MT_ENOMEM, "optimizer: out of memory");
    o->off = malloc((size_t)(m->table.n > 0 ? m->table.n : 1) * sizeof *o->off);
    o->fp8 = malloc((size_t)(m->table.n > 0 ? m->table.n : 1) * sizeof *o->fp8);
    o->fp8_sr = malloc((size_t)(m->table.n > 0 ? m->table.n : 1) * sizeof *o->fp8_sr);
    if (!o->off || !o->fp8 || !o->fp8_sr) {
        free(o->off);
        free(o->fp8);
        free(o->fp8_sr);
        free(o);
        return MT_ERR(MT_ENOMEM, "optimizer: out of memory");
    }
    o->n_params = m->table.n;
    o->be = be;
    o->main = j->precision.main_params;
    o->cfg = j->optimizer;
    o->seed = mt_hash_u64((uint64_t)j->train.seed, 0x5eed0f0a);
    /* the kept parameters' state, packed in table order */
    for (int i = 0; i < m->table.n; i++) {
        const mt_param *p = &m->params[i];
        const int kept = p->grad && (!keep || keep[i]);
        o->off[i] = kept ? o->n_state : -1;
        if (kept) o->n_state += mt_param_numel(&p->d);
    }
    const size_t n = (size_t)(o->n_state > 0 ? o->n_state : 1);
    /* the f32 scratch: a bf16 main copy is widened whole for the compute
     * copies; fp32 and none stage slabs (model.h: MT_PARAM_STAGE) */
    int64_t mx = 1;
    for (int i = 0; i < m->table.n; i++)
        if (mt_param_numel(&m->table.p[i]) > mx) mx = mt_param_numel(&m->table.p[i]);
    if (o->main != MT_MAIN_BF16) mx = mt_params_stage_elems(&m->table);
    o->tmp_n = mx;
    int rc = MT_OK;
    if (o->main != MT_MAIN_NONE) MT_GOTO(be->alloc(be, n * master_elem(o->main), &o->master), fail);
    MT_GOTO(be->alloc(be, n * 2, (void **)&o->m), fail);
    MT_GOTO(be->alloc(be, n * 2, (void **)&o->v), fail);
    MT_GOTO(be->alloc(be, (size_t)mx * 4, (void **)&o->tmp), fail);
    MT_GOTO(be->alloc(be, 4, (void **)&o->sumsq), fail);
    *out = o;
    return MT_OK;
fail:
    mt_optimizer_destroy(o);
    return rc;
}

void mt_optimizer_destroy(mt_optimizer *o)
{
    if (!o) return;
    void *bufs[] = {o->master, o->m, o->v, o->tmp, o->sumsq};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) o->be->free(o->be, bufs[i]);
    free(o->off);
    free(o->fp8);
    free(o->fp8_sr);
    free(o);
}

size_t mt_optimizer_state_bytes(const mt_optimizer *o)
{
    size_t n = (size_t)o->n_state;
    return n * (4 + (o->main == MT_MAIN_NONE ? 0 : master_elem(o->main)));
}

/* Device address of parameter i's main copy. */
static void *master_of(const mt_optimizer *o, int i)
{
    return (char *)o->master + (size_t)o->off[i] * master_elem(o->main);
}

int mt_optimizer_set_param(mt_optimizer *o, mt_model *m, int i, const float *host)
{
    mt_backend *be = o->be;
    mt_param *p = &m->params[i];
    if (!o->master || !in_shard(o, i)) return mt_model_set_param(m, i, host);
    const int64_t n = mt_param_numel(&p->d);
    if (o->main == MT_MAIN_FP32) {
        MT_CHECK(be->upload(be, master_of(o, i), host, (size_t)n * 4));
        return mt_model_set_param_dev(m, i, master_of(o, i));
    }
    /* bf16 main copy: round once, and compute from the rounded value */
    uint16_t *h = malloc((size_t)n * 2);
    float *f = malloc((size_t)n * 4);
    if (!h || !f) {
        free(h);
        free(f);
        return MT_ERR(MT_ENOMEM, "optimizer: out of memory");
    }
    for (int64_t k = 0; k < n; k++) {
        h[k] = mt_bf16_from_f32(host[k]);
        f[k] = mt_bf16_to_f32(h[k]);
    }
    int rc = be->upload(be, master_of(o, i), h, (size_t)n * 2);
    if (rc == MT_OK) rc = be->upload(be, o->tmp, f, (size_t)n * 4);
    free(h);
    free(f);
    MT_CHECK(rc);
    return mt_model_set_param_dev(m, i, o->tmp);
}

int mt_optimizer_init_random(mt_optimizer *o, mt_model *m, uint64_t seed)
{
    int64_t mx = 1;
    for (int i = 0; i < m->table.n; i++)
        if (mt_param_numel(&m->table.p[i]) > mx) mx = mt_param_numel(&m->table.p[i]);
    float *host = malloc((size_t)mx * 4);
    if (!host) return MT_ERR(MT_ENOMEM, "optimizer: out of memory");
    int rc = MT_OK;
    for (int i = 0; i < m->table.n && rc == MT_OK; i++) {
        const mt_param_desc *d = &m->table.p[i];
        const int64_t n = mt_param_numel(d);
        /* Each value is a pure function of (seed, name, index): threads only
         * change the speed (billions of values for the full-size models). */
#pragma omp parallel for schedule(static) if (n > 65536)
        for (int64_t k = 0; k < n; k++)
            host[k] = mt_model_init_value(d, m->cfg.initializer_range, seed, k);
        rc = mt_optimizer_set_param(o, m, i, host);
    }
    free(host);
    return rc;
}

int mt_optimizer_grad_sumsq(mt_optimizer *o, mt_model *m, double *sumsq)
{
    mt_backend *be = o->be;
    float v;
    MT_CHECK(be->sumsq(be, o->sumsq, m->buf_grad, m->grad_type == MT_C_BF16, m->n_grad));
    MT_CHECK(be->download(be, &v, o->sumsq, 4));
    *sumsq = v;
    return MT_OK;
}

/* none: the compute copy is the weight. Update it and round back, slab by
 * slab (mt_param_stage_rows: FP8 slabs are whole 128-row blocks). The
 * stochastic rounding's seed is the parameter's for a tensor of one slab,
 * and mt_hash_u64(that seed, slab + 1) for each slab of a larger one (the
 * ops number their elements from the slab's start). FP8: the arguments of
 * adamw_fp8_sr (the slabs' dequantisation, update and rounding and the
 * transpose in one op) into o->fp8_sr[*n_sr], for one adamw_fp8_sr_n call
 * of all of them; act: adamw_sr, the update and the rounding in one op,
 * slab by slab. */
static int update_in_place(mt_optimizer *o, mt_model *m, int i, const mt_adamw_hp *hp,
                           int *n_sr)
{
    mt_backend *be = o->be;
    mt_param *p = &m->params[i];
    const int64_t rows = p->d.rows, cols = p->d.cols, off = o->off[i];
    const int64_t sr = mt_param_stage_rows(&p->d);
    const size_t ge = mt_model_grad_size(m), act = mt_act_size(be);
    const uint64_t seed = mt_hash_u64(o->seed, (uint64_t)o->step * 1000003u + (uint64_t)i);
    if (p->q) {
        o->fp8_sr[(*n_sr)++] = (mt_adamw_fp8_sr_arg){
            .q = p->q, .s = p->s, .m = o->m + off, .v = o->v + off, .grad = p->grad,
            .N = (int)rows, .K = (int)cols, .weight_decay = hp->weight_decay, .seed = seed,
            .slab_rows = (int)(sr < rows ? sr : rows), .qt = p->qt, .st = p->st};
        return MT_OK;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += sr) {
        const int nr = (int)(rows - r0 < sr ? rows - r0 : sr);
        const int64_t e0 = r0 * cols, n = (int64_t)nr * cols;
        const uint64_t sd = sr >= rows ? seed : mt_hash_u64(seed, (uint64_t)(r0 / sr) + 1);
        MT_CHECK(be->adamw_sr(be, (char *)p->w + (size_t)e0 * act, o->m + off + e0,
                              o->v + off + e0, (const char *)p->grad + (size_t)e0 * ge, n, hp,
                              sd));
    }
    return MT_OK;
}

int mt_optimizer_update(mt_optimizer *o, mt_model *m, double lr, double grad_scale)
{
    mt_backend *be = o->be;
    const int t = (int)(o->step + 1);
    mt_adamw_hp hp = {
        .lr = (float)lr,
        .beta1 = (float)o->cfg.beta1,
        .beta2 = (float)o->cfg.beta2,
        .eps = (float)o->cfg.eps,
        .bc1 = (float)(1.0 - pow(o->cfg.beta1, t)),
        .bc2 = (float)(1.0 - pow(o->cfg.beta2, t)),
        .grad_scale = (float)grad_scale,
        .grad_bf16 = m->grad_type == MT_C_BF16,
    };
    int n_fp8 = 0, n_sr = 0;
    for (int i = 0; i < m->table.n; i++) {
        mt_param *p = &m->params[i];
        if (!in_shard(o, i)) continue;
        hp.weight_decay = p->d.weight_decay ? (float)o->cfg.weight_decay : 0.0f;
        const int64_t n = mt_param_numel(&p->d), off = o->off[i];
        if (o->main == MT_MAIN_NONE) {
            MT_CHECK(update_in_place(o, m, i, &hp, &n_sr));
            continue;
        }
        void *w = master_of(o, i);
        if (p->q) { /* FP8 weight: update and re-quantise in one pass, all of them in one call */
            o->fp8[n_fp8++] = (mt_adamw_fp8_arg){
                .p = w, .p_bf16 = o->main == MT_MAIN_BF16, .m = o->m + off, .v = o->v + off,
                .grad = p->grad, .N = (int)p->d.rows, .K = (int)p->d.cols,
                .weight_decay = hp.weight_decay, .q = p->q, .s = p->s, .qt = p->qt, .st = p->st};
            continue;
        }
        /* A weight of the act type (embedding, head, norms): its compute
         * copy comes out of the same pass over the main copy. */
        if (p->w) {
            MT_CHECK(be->adamw(be, w, o->main == MT_MAIN_BF16, o->m + off, o->v + off, p->grad,
                               n, &hp, p->w));
            continue;
        }
        MT_CHECK(be->adamw(be, w, o->main == MT_MAIN_BF16, o->m + off, o->v + off, p->grad, n,
                           &hp, NULL));
        const float *wf = w;
        if (o->main == MT_MAIN_BF16) {
            MT_CHECK(be->bf16_to_f32(be, o->tmp, w, n));
            wf = o->tmp;
        }
        MT_CHECK(mt_model_set_param_dev(m, i, wf));
    }
    MT_CHECK(be->adamw_fp8_n(be, n_fp8, o->fp8, &hp));
    MT_CHECK(be->adamw_fp8_sr_n(be, n_sr, o->fp8_sr, &hp));
    o->step++;
    return MT_OK;
}
