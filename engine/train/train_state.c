/* train_state.c - see train_state.h. */
#include "engine/train/train_state.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/train/lr_schedule.h"
#include "kernels/mt_fp8.h"
#include "base/mt_clock.h"
#include "base/mt_log.h"
#include "base/mt_status.h"

void mt_train_state_opts(const mt_jobspec *j, mt_shard_opts *o)
{
    memset(o, 0, sizeof *o);
    o->fp8 = j->precision.recipe == MT_RECIPE_FP8_BLOCKWISE;
    o->act_dtype = j->precision.recipe == MT_RECIPE_FP32 ? MT_DT_F32 : MT_DT_BF16;
    o->optimizer = 1;
    o->has_main = j->precision.main_params != MT_MAIN_NONE;
    o->main_dtype = j->precision.main_params == MT_MAIN_BF16 ? MT_DT_BF16 : MT_DT_F32;
}

char *mt_train_state_config_json(const mt_model_config *c)
{
    json_t *o = mt_config_to_json(c);
    char *s = o ? json_dumps(o, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

/* ---- snapshot ------------------------------------------------------------------ */

static const char *main_name(mt_main_params p)
{
    return p == MT_MAIN_FP32 ? "fp32" : p == MT_MAIN_BF16 ? "bf16" : "none";
}

static char *state_json(const mt_trainer *t)
{
    const mt_jobspec *j = &t->job;
    const mt_optimizer *o = t->opt;
    char seed[32];
    snprintf(seed, sizeof seed, "0x%016" PRIx64, o->seed);
    const int64_t samples = j->train.steps * j->batch.global_batch_size;
    double lr = mt_lr_at(&j->lr_schedule, j->optimizer.lr, j->optimizer.min_lr, j->train.steps,
                         t->step);
    static const char *const decay[] = {"cosine", "linear", "wsd", "constant"};
    json_t *s = json_pack(
        "{s:I,s:I,s:I,s:I,s:i,"
        "s:{s:I,s:s,s:s,s:I},"
        "s:{s:s,s:s,s:I,s:I,s:I,s:i,s:I},"
        "s:{s:s,s:I,s:I,s:f,s:f,s:f,s:I,s:I,s:f},"
        "s:{s:I,s:s},"
        "s:{s:f}}",
        "step", (json_int_t)t->step, "consumed_samples", (json_int_t)t->consumed_samples,
        "consumed_tokens", (json_int_t)(t->consumed_samples * j->batch.seq_len), "skipped_total",
        (json_int_t)t->skipped_total, "bad_in_row", t->bad_in_row,
        "optimizer", "step", (json_int_t)o->step, "sr_seed", seed, "main_params",
        main_name(o->main), "state_elements", (json_int_t)o->n_state,
        "data", "path", j->data.path, "split", j->data.split, "seq_len",
        (json_int_t)j->batch.seq_len, "num_samples", (json_int_t)samples, "seed",
        (json_int_t)j->train.seed, "eod", mt_jobspec_eod(j), "next_sample",
        (json_int_t)t->consumed_samples,
        "lr_schedule", "decay", decay[j->lr_schedule.decay], "warmup_steps",
        (json_int_t)j->lr_schedule.warmup_steps, "decay_steps",
        (json_int_t)j->lr_schedule.decay_steps, "wsd_decay_fraction",
        j->lr_schedule.wsd_decay_fraction, "lr", j->optimizer.lr, "min_lr", j->optimizer.min_lr,
        "total_steps", (json_int_t)j->train.steps, "next_step", (json_int_t)t->step, "next_lr", lr,
        "rng", "train_seed", (json_int_t)j->train.seed, "sr_seed", seed,
        "router", "bias_update_rate", j->loss.bias_update_rate);
    char *text = s ? json_dumps(s, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref(s);
    return text;
}

static void slab_free(mt_train_snapshot *s)
{
    if (s->slab) {
        if (s->slab_pinned) s->be->host_free(s->be, s->slab);
        else free(s->slab);
    }
    s->slab = NULL;
    s->slab_bytes = 0;
    s->slab_pinned = 0;
}

void mt_train_snapshot_free(mt_train_snapshot *s)
{
    if (!s) return;
    free(s->params);
    slab_free(s); /* act, q, s, f32, m, v, master point into it (or, borrowed, at the trainer) */
    free(s->state_json);
    free(s->config_json);
    free(s->job_json);
    memset(s, 0, sizeof *s);
}

/* The regions of a snapshot, in slab order. */
enum { R_ACT, R_Q, R_S, R_F32, R_M, R_V, R_MAIN, R_N };

/* Host copy of `bytes` of backend memory at src into dst. */
static int copy_region(mt_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!bytes) return MT_OK;
    if (be->kind == MT_BE_CPU && bytes >= ((size_t)64 << 20)) {
        /* host to host: the stall of an async save is this copy; split it
         * over the cores in 16 MB blocks */
        const size_t blk = (size_t)16 << 20;
        const int64_t nb = (int64_t)((bytes + blk - 1) / blk);
        int rc = MT_OK;
#pragma omp parallel for schedule(static) reduction(min : rc)
        for (int64_t k = 0; k < nb; k++) {
            const size_t o = (size_t)k * blk, n = bytes - o < blk ? bytes - o : blk;
            int r = be->download(be, (char *)dst + o, (const char *)src + o, n);
            rc = r < rc ? r : rc;
        }
        return rc < 0 ? MT_ERR(rc, "checkpoint snapshot: host copy failed") : MT_OK;
    }
    /* device to host: one DMA at link speed into the page-locked slab (a
     * pageable destination would be staged by the driver at a fraction) */
    int rc = be->download(be, dst, src, bytes);
    return rc < 0 ? mt_err_wrap(rc, "checkpoint snapshot: copy of %zu MB to the host", bytes >> 20)
                  : MT_OK;
}

/* The slab for regions of bytes[R_N]: kept when the previous snapshot's is
 * the same size, else allocated from the backend's host memory (plain
 * memory, with a warning, where page-locking fails). dst[r]: where region
 * r starts (page aligned; NULL for an empty region). */
static int slab_reserve(mt_backend *be, mt_train_snapshot *s, const size_t bytes[R_N],
                        void *dst[R_N])
{
    const size_t align = 4096;
    size_t off[R_N], total = 0;
    for (int r = 0; r < R_N; r++) {
        off[r] = total;
        total += (bytes[r] + align - 1) / align * align;
    }
    if (!s->slab || s->slab_bytes != total || s->be != be) {
        slab_free(s);
        void *p = NULL;
        int rc = be->host_alloc(be, total, &p);
        if (rc == MT_OK) {
            s->slab_pinned = 1;
        } else {
            MT_LOGW("checkpoint snapshot: %s; the snapshot goes through pageable memory "
                    "(slower device-to-host copies)", mt_errmsg());
            mt_err_clear();
            p = aligned_alloc(align, total ? total : align);
            if (!p)
                return MT_ERR(MT_ENOMEM, "checkpoint snapshot: out of host memory (%zu MB)",
                              total >> 20);
            s->slab_pinned = 0;
        }
        s->slab = p;
        s->slab_bytes = total;
        s->be = be;
    }
    for (int r = 0; r < R_N; r++) dst[r] = bytes[r] ? (char *)s->slab + off[r] : NULL;
    return MT_OK;
}

/* Fills s->params (offsets of every parameter in the state buffers) and
 * the bytes of each region and its source in the backend's memory; a
 * snapshot of another trainer (or a view turned copy) is freed first. */
static int prepare(mt_trainer *t, mt_train_snapshot *s, int borrow, size_t bytes[R_N],
                   const void *src[R_N])
{
    mt_model *m = t->model;
    mt_optimizer *o = t->opt;
    mt_backend *be = m->be;
    const size_t act = (size_t)be->act_bytes;
    if (s->borrowed != borrow) mt_train_snapshot_free(s); /* a view's buffers are not ours */
    /* indexed like the sharding map (the full table): under expert
     * parallelism the other ranks' experts are absent here (offsets -1) */
    const int n_glob = m->n_params_global;
    if (!(s->params && s->n_params == n_glob && s->trainer == t)) {
        mt_train_snapshot_free(s);
        s->params = calloc((size_t)(n_glob > 0 ? n_glob : 1), sizeof *s->params);
        if (!s->params) return MT_ERR(MT_ENOMEM, "checkpoint snapshot: out of memory");
    }
    s->borrowed = borrow; /* after any free (which zeroes s) */
    s->trainer = t;
    s->n_params = n_glob;
    for (int g = 0; g < n_glob; g++) {
        mt_snap_param *sp = &s->params[g];
        sp->q_off = sp->s_off = sp->act_off = sp->f32_off = sp->opt_off = -1;
    }
    int64_t n_act = 0, n_q = 0, n_s = 0, n_f = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mt_param *p = &m->params[i];
        mt_snap_param *sp = &s->params[m->global_param[i]];
        const int64_t n = mt_param_numel(&p->d);
        if (p->q) {
            sp->q_off = p->q - m->buf_q;
            sp->s_off = p->s - m->buf_s;
            int64_t nb = ((p->d.rows + 127) / 128) * ((p->d.cols + 127) / 128);
            if (sp->q_off + n > n_q) n_q = sp->q_off + n;
            if (sp->s_off + nb > n_s) n_s = sp->s_off + nb;
        } else if (p->wf) {
            sp->f32_off = p->wf - m->buf_f32;
            if (sp->f32_off + n > n_f) n_f = sp->f32_off + n;
        } else {
            sp->act_off = (int64_t)(((const char *)p->w - (const char *)m->buf_act) / (ptrdiff_t)act);
            if (sp->act_off + n > n_act) n_act = sp->act_off + n;
        }
        sp->opt_off = o->off[i];
        sp->off[0] = p->d.off[0];
        sp->off[1] = p->d.off[1];
        sp->rows = p->d.rows;
        sp->cols = p->d.cols;
    }
    s->act_bytes = (int)act;
    s->master_bytes = o->main == MT_MAIN_FP32 ? 4 : 2;
    const size_t nopt = (size_t)o->n_state;
    bytes[R_ACT] = (size_t)n_act * act, src[R_ACT] = m->buf_act;
    bytes[R_Q] = (size_t)n_q, src[R_Q] = m->buf_q;
    bytes[R_S] = (size_t)n_s * 4, src[R_S] = m->buf_s;
    bytes[R_F32] = (size_t)n_f * 4, src[R_F32] = m->buf_f32;
    bytes[R_M] = nopt * 2, src[R_M] = o->m;
    bytes[R_V] = nopt * 2, src[R_V] = o->v;
    bytes[R_MAIN] = o->master ? nopt * (size_t)s->master_bytes : 0, src[R_MAIN] = o->master;
    return MT_OK;
}

static int snapshot(mt_trainer *t, mt_train_snapshot *s, int borrow)
{
    mt_backend *be = t->model->be;
    size_t bytes[R_N];
    const void *src[R_N];
    void *dst[R_N];
    int rc = MT_OK;
    MT_CHECK(prepare(t, s, borrow, bytes, src));
    free(s->state_json);
    free(s->config_json);
    free(s->job_json);
    s->state_json = s->config_json = s->job_json = NULL;
    s->bytes = 0;
    for (int r = 0; r < R_N; r++) s->bytes += bytes[r];
    if (borrow) {
        /* a view: the backend's buffers are host memory */
        for (int r = 0; r < R_N; r++) dst[r] = bytes[r] ? (void *)src[r] : NULL;
    } else {
        MT_GOTO(slab_reserve(be, s, bytes, dst), fail);
    }
    s->act = dst[R_ACT];
    s->q = dst[R_Q];
    s->s = dst[R_S];
    s->f32 = dst[R_F32];
    s->m = dst[R_M];
    s->v = dst[R_V];
    s->master = dst[R_MAIN];
    MT_GOTO(be->sync(be), fail);
    for (int r = 0; r < R_N && !borrow; r++) MT_GOTO(copy_region(be, dst[r], src[r], bytes[r]), fail);
    s->step = t->step;
    s->consumed_samples = t->consumed_samples;
    s->consumed_tokens = t->consumed_samples * t->job.batch.seq_len;
    s->state_json = state_json(t);
    s->config_json = mt_train_state_config_json(&t->job.model);
    json_t *jj = mt_jobspec_to_json(&t->job);
    s->job_json = jj ? json_dumps(jj, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref(jj);
    if (!s->state_json || !s->config_json || !s->job_json) {
        rc = MT_ERR(MT_ENOMEM, "checkpoint snapshot: out of memory");
        goto fail;
    }
    return MT_OK;
fail:
    mt_train_snapshot_free(s);
    return rc;
}

int mt_train_state_snapshot_reserve(mt_trainer *t, mt_train_snapshot *s)
{
    size_t bytes[R_N];
    const void *src[R_N];
    void *dst[R_N];
    int rc = prepare(t, s, 0, bytes, src);
    if (rc == MT_OK) rc = slab_reserve(t->model->be, s, bytes, dst);
    if (rc < 0) mt_train_snapshot_free(s);
    return rc;
}

int mt_train_state_snapshot(mt_trainer *t, mt_train_snapshot *s) { return snapshot(t, s, 0); }

int mt_train_state_view(mt_trainer *t, mt_train_snapshot *s)
{
    if (t->model->be->kind != MT_BE_CPU)
        return MT_ERR(MT_ENOTSUP, "checkpoint snapshot: a view needs host memory (%s backend)",
                      t->model->be->name);
    return snapshot(t, s, 1);
}

/* Converts n elements of a source type to the band dtype. Source types:
 * 0 float, 1 bf16 bits, 2 bytes (e4m3). */
enum { SRC_F32 = 0, SRC_BF16, SRC_BYTE };

static int convert_run(void *dst, mt_dtype dt, const void *src, int st, int64_t n)
{
    if ((dt == MT_DT_E4M3 && st == SRC_BYTE) || (dt == MT_DT_F32 && st == SRC_F32) ||
        (dt == MT_DT_BF16 && st == SRC_BF16)) {
        memcpy(dst, src, (size_t)n * mt_dtype_size(dt));
    } else if (dt == MT_DT_BF16 && st == SRC_F32) {
        const float *x = src;
        uint16_t *y = dst;
        for (int64_t k = 0; k < n; k++) y[k] = mt_bf16_from_f32(x[k]);
    } else if (dt == MT_DT_F32 && st == SRC_BF16) {
        const uint16_t *x = src;
        float *y = dst;
        for (int64_t k = 0; k < n; k++) y[k] = mt_bf16_to_f32(x[k]);
    } else {
        return MT_ERR(MT_EINVAL, "checkpoint snapshot: cannot store a %s tensor from this copy",
                      mt_dtype_name(dt));
    }
    return MT_OK;
}

/* Where a tensor of the map lives in the snapshot (locate()). */
typedef struct snap_loc {
    const mt_shard_tensor *t; /* the map's entry */
    const void *base;         /* the parameter's row-major copy (this rank's slab of it) */
    int st;                   /* its element type (SRC_*) */
    size_t es;                /* and size in bytes */
    int64_t so[2];            /* the slab's first row and column in the full tensor */
    int64_t ld;               /* its row length (scale tensors: in blocks) */
} snap_loc;

static int locate(const mt_train_snapshot *s, const mt_shard_map *map, const mt_tensor_desc *band,
                  snap_loc *l)
{
    memset(l, 0, sizeof *l);
    int ti = mt_shard_map_find(map, band->name);
    if (ti < 0) return MT_ERR(MT_EINVAL, "checkpoint snapshot: unknown tensor %s", band->name);
    const mt_shard_tensor *t = &map->tensors[ti];
    if (map->n_params != s->n_params || t->param >= s->n_params)
        return MT_ERR(MT_EINVAL, "checkpoint snapshot: %d parameters, the map has %d", s->n_params,
                      map->n_params);
    const mt_snap_param *sp = &s->params[t->param];
    l->t = t;
    const int scale = t->role == MT_TS_SCALE;
    l->so[0] = t->ndim == 1 ? sp->off[1] : scale ? sp->off[0] / 128 : sp->off[0];
    l->so[1] = t->ndim == 1 ? 0 : scale ? sp->off[1] / 128 : sp->off[1];
    l->ld = t->ndim == 1 ? 1 : scale ? (sp->cols + 127) / 128 : sp->cols;
    l->st = SRC_F32;
    l->es = 4;
    switch (t->role) {
    case MT_TS_WEIGHT:
        if (sp->q_off >= 0) l->base = s->q + sp->q_off, l->st = SRC_BYTE, l->es = 1;
        else if (sp->f32_off >= 0) l->base = s->f32 + sp->f32_off;
        else if (sp->act_off >= 0) {
            l->es = (size_t)s->act_bytes;
            l->st = s->act_bytes == 4 ? SRC_F32 : SRC_BF16;
            l->base = (const char *)s->act + (size_t)sp->act_off * l->es;
        }
        break;
    case MT_TS_SCALE:
        if (sp->s_off >= 0) l->base = s->s + sp->s_off;
        break;
    case MT_TS_EXP_AVG:
    case MT_TS_EXP_AVG_SQ:
        if (sp->opt_off >= 0) {
            l->base = (t->role == MT_TS_EXP_AVG ? s->m : s->v) + sp->opt_off;
            l->st = SRC_BF16;
            l->es = 2;
        }
        break;
    case MT_TS_MAIN:
        if (sp->opt_off >= 0 && s->master) {
            l->es = (size_t)s->master_bytes;
            l->st = l->es == 4 ? SRC_F32 : SRC_BF16;
            l->base = (const char *)s->master + (size_t)sp->opt_off * l->es;
        }
        break;
    default:
        break;
    }
    if (!l->base)
        return MT_ERR(MT_EINVAL, "checkpoint snapshot: tensor %s (%s) is not in this rank's state",
                      t->name, mt_tensor_role_name(t->role));
    return MT_OK;
}

static int same_type(mt_dtype dt, int st)
{
    return (dt == MT_DT_E4M3 && st == SRC_BYTE) || (dt == MT_DT_F32 && st == SRC_F32) ||
           (dt == MT_DT_BF16 && st == SRC_BF16);
}

int mt_train_snapshot_fill(const mt_train_snapshot *s, const mt_shard_map *map,
                           const mt_tensor_desc *band, void *buf)
{
    snap_loc l;
    MT_CHECK(locate(s, map, band, &l));
    const mt_shard_tensor *t = l.t;
    const int64_t *so = l.so;
    const int64_t C = l.ld;
    /* row-major [rows, C] slab starting at so of the full tensor (1-D: [n, 1]);
     * the band is rows x cols of the full tensor inside the slab */
    const int64_t c0 = t->ndim == 2 ? band->off[1] - so[1] : 0, nc = t->ndim == 2 ? band->count[1] : 1;
    const int64_t r0 = band->off[0] - so[0];
    if (r0 < 0 || c0 < 0 || (t->ndim == 2 && c0 + nc > C))
        return MT_ERR(MT_EINVAL, "checkpoint snapshot: band [%lld, %lld] of %s is outside this "
                      "rank's slab at [%lld, %lld]", (long long)band->off[0],
                      (long long)band->off[1], band->name, (long long)so[0], (long long)so[1]);
    const size_t os = mt_dtype_size(band->dtype);
    for (int64_t i = 0; i < band->count[0]; i++) {
        const char *src = (const char *)l.base + ((size_t)(r0 + i) * (size_t)C + (size_t)c0) * l.es;
        MT_CHECK(convert_run((char *)buf + (size_t)i * (size_t)nc * os, band->dtype, src, l.st, nc));
    }
    return MT_OK;
}

const void *mt_train_snapshot_direct(const mt_train_snapshot *s, const mt_shard_map *map,
                                     const mt_tensor_desc *d)
{
    snap_loc l;
    if (locate(s, map, d, &l) < 0) {
        mt_err_clear();
        return NULL;
    }
    /* whole rows of the same type are contiguous in the snapshot (a slab
     * of whole rows: tensor parallelism split the rows, or nothing) */
    if (!same_type(d->dtype, l.st) || (l.t->ndim == 2 && (d->count[1] != l.t->shape[1] ||
                                                          l.ld != l.t->shape[1])))
        return NULL;
    if (d->off[0] < l.so[0]) return NULL;
    return (const char *)l.base + (size_t)(d->off[0] - l.so[0]) * (size_t)l.ld * l.es;
}

/* ---- restore -------------------------------------------------------------------- */

/* The tensor of a parameter this rank holds: the whole tensor, or under
 * tensor parallelism its slab (load-time resharding reads the hyperslab, so
 * a checkpoint saved at another tp loads here). */
static void param_desc(mt_tensor_desc *d, const mt_param_desc *p, const char *name, mt_dtype dt,
                       void *data)
{
    if (p->ndim == 1 || (p->rows == p->full_rows && p->cols == p->full_cols)) {
        mt_tensor_desc_whole(d, name, dt, p->ndim, p->rows, p->cols, data);
        return;
    }
    const int64_t shape[2] = {p->full_rows, p->full_cols};
    mt_tensor_desc_slab(d, name, dt, 2, shape, p->off[0], p->off[1], p->rows, p->cols, data);
}

typedef struct scalars {
    int64_t step, samples, skipped, opt_step;
    int bad_in_row, has_opt;
    uint64_t sr_seed;
    int64_t seq_len, num_samples, seed;
} scalars;

static int parse_state(const char *text, scalars *sc)
{
    memset(sc, 0, sizeof *sc);
    sc->seq_len = sc->num_samples = sc->seed = -1;
    if (!text) return MT_OK;
    json_error_t e;
    json_t *o = json_loads(text, 0, &e);
    if (!o) return MT_ERR(MT_ECORRUPT, "checkpoint state: %s", e.text);
    json_int_t step = 0, samples = 0, skipped = 0;
    int bad = 0;
    json_t *opt = NULL, *data = NULL;
    int rc = MT_OK;
    if (json_unpack_ex(o, &e, 0, "{s:I,s:I,s?I,s?i,s?o,s?o}", "step", &step, "consumed_samples",
                       &samples, "skipped_total", &skipped, "bad_in_row", &bad, "optimizer", &opt,
                       "data", &data) != 0) {
        rc = MT_ERR(MT_ECORRUPT, "checkpoint state: %s", e.text);
        goto out;
    }
    sc->step = step;
    sc->samples = samples;
    sc->skipped = skipped;
    sc->bad_in_row = bad;
    if (opt) {
        json_int_t ostep = 0;
        const char *seed = NULL;
        if (json_unpack_ex(opt, &e, 0, "{s:I,s:s}", "step", &ostep, "sr_seed", &seed) != 0) {
            rc = MT_ERR(MT_ECORRUPT, "checkpoint state.optimizer: %s", e.text);
            goto out;
        }
        sc->has_opt = 1;
        sc->opt_step = ostep;
        sc->sr_seed = strtoull(seed, NULL, 16);
    }
    if (data) {
        json_int_t a = -1, b = -1, c = -1;
        json_unpack(data, "{s?I,s?I,s?I}", "seq_len", &a, "num_samples", &b, "seed", &c);
        sc->seq_len = a;
        sc->num_samples = b;
        sc->seed = c;
    }
out:
    json_decref(o);
    return rc;
}

/* Reads a tensor of a whole parameter, naming it on failure. */
static int read_whole(const mt_tensor_reader *r, mt_tensor_desc *d)
{
    int rc = r->read(r->ctx, d);
    return rc < 0 ? mt_err_wrap(rc, "restoring %s", d->name) : MT_OK;
}

/* Parameter i's compute copy from the reader: FP8 bytes and scales exactly
 * as stored (the transpose rebuilt), router bias f32, other weights through
 * f32 (exact for bf16 values) into act. dev_tmp: device f32 scratch of
 * tmp_n elements; host / hs: host scratch of its values / block scales. */
/* Where a restore reads a tensor the backend keeps at dev: dev itself when
 * the backend's memory is host memory (CPU: no upload copy), else the host
 * staging buffer. */
static void *read_into(const mt_backend *be, void *dev, void *host)
{
    return be->kind == MT_BE_CPU ? dev : host;
}

/* The staging buffers of a restore (the largest parameter's values and
 * block scales: bounded, never the whole model) come from the backend's
 * host memory, page-locked on CUDA (or from memory the caller lends: the
 * job's reserved snapshot slab): the reader fills them and the uploads
 * from them are DMA at link speed instead of the driver's pageable
 * staging. Such an upload is asynchronous: a buffer is written again only
 * once its uploads are done. With two sets (lent memory that holds two)
 * the reads alternate between them and wait, before their own uploads,
 * for the previous ones (stage_ready), so each upload runs during the
 * next read; with one set stage_next waits before the set is rewritten. */
typedef struct stage {
    mt_backend *be;
    void *host[2];   /* largest parameter x 4 bytes */
    float *hs[2];    /* its block scales */
    int n, cur;      /* sets (1 or 2), the one in use */
    int pinned;      /* own sets from be->host_alloc (else malloc: pinning failed) */
    int borrowed;    /* carved from the caller's memory: not ours to free */
} stage;

static int stage_open(stage *st, mt_backend *be, size_t host_bytes, size_t scale_bytes,
                      void *lend, size_t lend_bytes)
{
    memset(st, 0, sizeof *st);
    st->be = be;
    host_bytes = (host_bytes + 4095) / 4096 * 4096;
    scale_bytes = (scale_bytes + 4095) / 4096 * 4096;
    const size_t set = host_bytes + scale_bytes;
    if (lend && lend_bytes >= set) {
        st->n = lend_bytes >= 2 * set ? 2 : 1;
        for (int k = 0; k < st->n; k++) {
            st->host[k] = (char *)lend + (size_t)k * set;
            st->hs[k] = (float *)((char *)lend + (size_t)k * set + host_bytes);
        }
        st->borrowed = 1;
        return MT_OK;
    }
    st->n = 1;
    int rc = be->host_alloc(be, host_bytes, &st->host[0]);
    if (rc == MT_OK) rc = be->host_alloc(be, scale_bytes, (void **)&st->hs[0]);
    if (rc == MT_OK) {
        st->pinned = 1;
        return MT_OK;
    }
    MT_LOGW("restore: %s; staging through pageable memory (slower uploads)", mt_errmsg());
    mt_err_clear();
    be->host_free(be, st->host[0]);
    st->host[0] = malloc(host_bytes);
    st->hs[0] = malloc(scale_bytes);
    if (!st->host[0] || !st->hs[0]) {
        free(st->host[0]);
        free(st->hs[0]);
        st->host[0] = st->hs[0] = NULL;
        return MT_ERR(MT_ENOMEM, "restore: out of host memory (%zu MB of staging)", set >> 20);
    }
    return MT_OK;
}

static void stage_close(stage *st)
{
    if (!st->borrowed && st->pinned) {
        st->be->host_free(st->be, st->host[0]);
        st->be->host_free(st->be, st->hs[0]);
    } else if (!st->borrowed) {
        free(st->host[0]);
        free(st->hs[0]);
    }
    memset(st->host, 0, sizeof st->host);
    memset(st->hs, 0, sizeof st->hs);
}

/* The set the next read fills (values, block scales), free of uploads. */
static int stage_next(stage *st, void **host, float **hs)
{
    if (st->n == 2) st->cur ^= 1; /* its uploads were waited for by stage_ready since */
    else if (st->be->kind != MT_BE_CPU) MT_CHECK(st->be->sync(st->be));
    *host = st->host[st->cur];
    if (hs) *hs = st->hs[st->cur];
    return MT_OK;
}

/* After a read, before its uploads: the previous set's uploads are over
 * (they ran during the read), so the next stage_next may hand that set out
 * (no-op on the CPU, whose uploads complete on return). */
static int stage_ready(stage *st)
{
    return st->n == 2 && st->be->kind != MT_BE_CPU ? st->be->sync(st->be) : MT_OK;
}

/* Uploads n bytes from src to dev unless they were read there. */
static int upload_unless(mt_backend *be, void *dev, const void *src, size_t n)
{
    return src == dev ? MT_OK : be->upload(be, dev, src, n);
}

/* Where parameter i's compute copy is read (as stored: e4m3 bytes + f32
 * block scales, or f32 values) before it is installed: buf[0] of bytes[0]
 * (and buf[1] of bytes[1], the scales; else NULL / 0). */
static void param_bufs(mt_model *m, int i, void *host, float *hs, void *buf[2], size_t bytes[2])
{
    mt_backend *be = m->be;
    const mt_param *p = &m->params[i];
    const mt_param_desc *pd = &p->d;
    const int64_t n = mt_param_numel(pd);
    buf[1] = NULL;
    bytes[1] = 0;
    if (p->q) {
        const int64_t nb = ((pd->rows + 127) / 128) * ((pd->cols + 127) / 128);
        buf[0] = read_into(be, p->q, host);
        bytes[0] = (size_t)n;
        buf[1] = read_into(be, p->s, hs);
        bytes[1] = (size_t)nb * 4;
    } else {
        buf[0] = p->wf ? read_into(be, p->wf, host) : host;
        bytes[0] = (size_t)n * 4;
    }
}

/* Reads parameter i's compute copy from the reader into param_bufs. */
static int read_param(mt_model *m, const mt_tensor_reader *r, int i, void *buf[2])
{
    const mt_param *p = &m->params[i];
    const mt_param_desc *pd = &p->d;
    mt_tensor_desc d;
    if (p->q) {
        param_desc(&d, pd, pd->name, MT_DT_E4M3, buf[0]);
        int rc = r->read_fp8(r->ctx, &d, buf[1]);
        return rc < 0 ? mt_err_wrap(rc, "restoring %s", pd->name) : MT_OK;
    }
    param_desc(&d, pd, pd->name, MT_DT_F32, buf[0]);
    return read_whole(r, &d);
}

/* Installs what read_param read into buf: uploads (unless read in place),
 * the FP8 transpose rebuilt, or the f32 values converted to the activation
 * dtype through dev_tmp in pieces of tmp_n elements (element-wise). */
static int install_param(mt_model *m, int i, void *buf[2], float *dev_tmp, int64_t tmp_n)
{
    mt_backend *be = m->be;
    mt_param *p = &m->params[i];
    const mt_param_desc *pd = &p->d;
    const int64_t n = mt_param_numel(pd);
    if (p->q) {
        const int64_t nb = ((pd->rows + 127) / 128) * ((pd->cols + 127) / 128);
        MT_CHECK(upload_unless(be, p->q, buf[0], (size_t)n));
        MT_CHECK(upload_unless(be, p->s, buf[1], (size_t)nb * 4));
        return be->transpose_blocks(be, p->qt, p->st, p->q, p->s, (int)pd->rows, (int)pd->cols);
    }
    if (p->wf) return upload_unless(be, p->wf, buf[0], (size_t)n * 4);
    for (int64_t k = 0; k < n; k += tmp_n) {
        const int64_t c = n - k < tmp_n ? n - k : tmp_n;
        MT_CHECK(be->upload(be, dev_tmp, (const float *)buf[0] + k, (size_t)c * 4));
        MT_CHECK(be->act_from_f32(be, (char *)p->w + (size_t)k * mt_act_size(be), dev_tmp, c));
    }
    return MT_OK;
}

static int load_param(mt_model *m, const mt_tensor_reader *r, int i, stage *st, float *dev_tmp,
                      int64_t tmp_n)
{
    void *host, *buf[2];
    float *hs;
    size_t bytes[2];
    MT_CHECK(stage_next(st, &host, &hs));
    param_bufs(m, i, host, hs, buf, bytes);
    MT_CHECK(read_param(m, r, i, buf));
    MT_CHECK(stage_ready(st));
    return install_param(m, i, buf, dev_tmp, tmp_n);
}

/* ---- replicated weights read once per replica group (issue 23) -------------------- */

/* The ranks holding parameter i exactly as this rank does (same tensor,
 * same hyperslab): the dp group, or for routed experts under ep, etp or tp
 * the edp group (the ZeRO-1 grouping of own_params, trainer.c). Host side
 * of the communicator; NULL when this rank is the only replica. */
static mt_comm *replica_group(const mt_trainer *t, int i)
{
    const mt_layout *l = &t->job.parallel;
    const int expert = t->model->params[i].d.expert >= 0 && (l->ep > 1 || l->etp > 1 || t->tp_size > 1);
    mt_comm *g = expert ? t->edp : t->dp;
    return g && mt_comm_size(g) > 1 ? mt_comm_host(g) : NULL;
}

/* Who reads what: reader[i] = the rank of group[i] that reads parameter
 * i's compute copy, -1 with group[i] NULL for a weight read here. The same
 * on every replica (from the table, the layout and the ZeRO-1 owners alone):
 * each weight goes to the replica with the fewest bytes to read so far,
 * counting the optimizer state each one reads for the parameters it owns
 * (ties: the lowest rank). At most two groups (dp, edp). */
typedef struct share_plan {
    mt_comm **group; /* [params] */
    int *reader;     /* [params] */
    int n_shared, n_mine;           /* weights with replicas; of them read here */
    int64_t bytes_mine, bytes_recv; /* bytes sent from here / received (as sent) */
} share_plan;

static void share_plan_free(share_plan *sp)
{
    free(sp->group);
    free(sp->reader);
}

static int share_plan_build(share_plan *sp, const mt_trainer *t, int has_opt)
{
    const mt_model *m = t->model;
    const int np = m->table.n > 0 ? m->table.n : 1;
    memset(sp, 0, sizeof *sp);
    sp->group = calloc((size_t)np, sizeof *sp->group);
    sp->reader = malloc((size_t)np * sizeof *sp->reader);
    mt_comm *gs[2] = {NULL, NULL};
    int64_t *load[2] = {NULL, NULL};
    int rc = sp->group && sp->reader ? MT_OK : MT_ERR(MT_ENOMEM, "restore: out of memory");
    const int64_t ob = t->opt->main == MT_MAIN_FP32 ? 8 : t->opt->master ? 6 : 4;
    for (int i = 0; i < m->table.n && rc == MT_OK; i++) {
        sp->reader[i] = -1;
        mt_comm *g = replica_group(t, i);
        if (!g) continue;
        int k = gs[0] == g ? 0 : gs[1] == g ? 1 : !gs[0] ? 0 : 1;
        if (!gs[k]) {
            gs[k] = g;
            load[k] = calloc((size_t)mt_comm_size(g), sizeof *load[k]);
            if (!load[k]) {
                rc = MT_ERR(MT_ENOMEM, "restore: out of memory");
                break;
            }
        }
        const int gn = mt_comm_size(g);
        int best = 0;
        for (int q = 1; q < gn; q++)
            if (load[k][q] < load[k][best]) best = q;
        const mt_param *p = &m->params[i];
        const int64_t n = mt_param_numel(&p->d);
        sp->group[i] = g;
        sp->reader[i] = best;
        const int64_t sent = p->q ? n + ((p->d.rows + 127) / 128) * ((p->d.cols + 127) / 128) * 4 : 4 * n;
        sp->n_shared++;
        if (best == mt_comm_rank(g)) {
            sp->n_mine++;
            sp->bytes_mine += sent;
        } else {
            sp->bytes_recv += sent;
        }
        load[k][best] += p->q ? n : 2 * n; /* stored e4m3, or bf16 / f32 (a proxy) */
        const int own = t->owner ? t->owner[i] : -1;
        if (has_opt && own >= 0 && own < gn) load[k][own] += ob * n;
    }
    free(load[0]);
    free(load[1]);
    if (rc < 0) share_plan_free(sp);
    return rc;
}

/* Parameter i through its replica group: the reader reads it (or, having
 * failed before with `failed` < 0 and message why, passes that on), sends
 * its status and then its bytes (as stored: the receivers convert them as
 * a reader would, so the installed bits are the same); every replica
 * installs them. A failure on the reader fails every replica of the group
 * at this parameter with the reader's message (naming the piece). */
static int load_param_shared(mt_model *m, const mt_tensor_reader *r, int i, mt_comm *g, int reader,
                             int failed, const char *why, stage *st, float *dev_tmp, int64_t tmp_n)
{
    void *host, *buf[2];
    float *hs;
    size_t bytes[2];
    MT_CHECK(stage_next(st, &host, &hs));
    param_bufs(m, i, host, hs, buf, bytes);
    const int me = mt_comm_rank(g);
    int32_t status = MT_OK;
    char msg[1024] = "";
    if (me == reader) {
        status = failed < 0 ? failed : read_param(m, r, i, buf);
        if (status < 0) snprintf(msg, sizeof msg, "%s", failed < 0 ? why : mt_errmsg());
    }
    MT_CHECK(mt_comm_broadcast(g, &status, 1, MT_COMM_I32, reader));
    if (status < 0) {
        MT_CHECK(mt_comm_broadcast(g, msg, sizeof msg, MT_COMM_BYTE, reader));
        if (me == reader) return failed < 0 ? failed : status;
        return MT_ERR(status, "%s (read by replica %d of %d)", msg, reader, mt_comm_size(g));
    }
    for (int k = 0; k < 2; k++)
        if (bytes[k]) MT_CHECK(mt_comm_broadcast(g, buf[k], bytes[k], MT_COMM_BYTE, reader));
    MT_CHECK(stage_ready(st));
    return install_param(m, i, buf, dev_tmp, tmp_n);
}

/* Parameter i: its compute copy (through its replica group when sp says
 * so), then the optimizer state this rank keeps. failed < 0 (message why):
 * this rank failed before; it reads nothing more but still takes its part
 * in the replica groups (passing the failure on where it is the reader),
 * so that no replica waits for it. */
static int restore_param(mt_trainer *t, const mt_tensor_reader *r, int i, const scalars *sc,
                         stage *st, const share_plan *sp, int failed, const char *why)
{
    mt_model *m = t->model;
    mt_optimizer *o = t->opt;
    mt_backend *be = m->be;
    mt_param *p = &m->params[i];
    const mt_param_desc *pd = &p->d;
    const int64_t n = mt_param_numel(pd);
    mt_tensor_desc d;
    void *host;
    if (sp && sp->group[i])
        MT_CHECK(load_param_shared(m, r, i, sp->group[i], sp->reader[i], failed, why, st, o->tmp,
                                   o->tmp_n));
    if (failed < 0) return failed;
    if (!sp || !sp->group[i]) MT_CHECK(load_param(m, r, i, st, o->tmp, o->tmp_n));
    if (o->off[i] < 0) return MT_OK; /* another rank keeps its state (ZeRO-1) */
    const int64_t off = o->off[i];
    const size_t mb = o->main == MT_MAIN_FP32 ? 4 : 2;
    char name[MT_TENSOR_NAME_CAP];
    if (!sc->has_opt) {
        /* weights only (an import): zero moments, main params = the weights */
        MT_CHECK(be->zero(be, o->m + off, (size_t)n * 2));
        MT_CHECK(be->zero(be, o->v + off, (size_t)n * 2));
        if (!o->master) return MT_OK;
        MT_CHECK(stage_next(st, &host, NULL));
        float *f = host;
        MT_CHECK(mt_model_get_param(m, i, f));
        if (o->main == MT_MAIN_BF16) {
            uint16_t *h = host;
            for (int64_t k = 0; k < n; k++) h[k] = mt_bf16_from_f32(f[k]);
        }
        MT_CHECK(stage_ready(st));
        return be->upload(be, (char *)o->master + (size_t)off * mb, host, (size_t)n * mb);
    }
    MT_CHECK(mt_param_optim_name(name, sizeof name, "exp_avg", pd->name));
    MT_CHECK(stage_next(st, &host, NULL));
    void *mv = read_into(be, o->m + off, host);
    param_desc(&d, pd, name, MT_DT_BF16, mv);
    MT_CHECK(read_whole(r, &d));
    MT_CHECK(stage_ready(st));
    MT_CHECK(upload_unless(be, o->m + off, mv, (size_t)n * 2));
    MT_CHECK(mt_param_optim_name(name, sizeof name, "exp_avg_sq", pd->name));
    MT_CHECK(stage_next(st, &host, NULL));
    mv = read_into(be, o->v + off, host);
    param_desc(&d, pd, name, MT_DT_BF16, mv);
    MT_CHECK(read_whole(r, &d));
    MT_CHECK(stage_ready(st));
    MT_CHECK(upload_unless(be, o->v + off, mv, (size_t)n * 2));
    if (!o->master) return MT_OK;
    MT_CHECK(mt_param_optim_name(name, sizeof name, "main", pd->name));
    MT_CHECK(stage_next(st, &host, NULL));
    void *master = (char *)o->master + (size_t)off * mb, *mm = read_into(be, master, host);
    param_desc(&d, pd, name, o->main == MT_MAIN_FP32 ? MT_DT_F32 : MT_DT_BF16, mm);
    int rc = r->read(r->ctx, &d);
    if (rc == MT_ENOTFOUND) {
        /* saved with main_params none: start the main copy from the weights */
        mt_err_clear();
        mm = host;
        float *f = host;
        MT_CHECK(mt_model_get_param(m, i, f));
        if (o->main == MT_MAIN_BF16)
            for (int64_t k = 0; k < n; k++) ((uint16_t *)host)[k] = mt_bf16_from_f32(f[k]);
    } else if (rc < 0) {
        return mt_err_wrap(rc, "restoring %s", name);
    }
    MT_CHECK(stage_ready(st));
    return upload_unless(be, master, mm, (size_t)n * mb);
}

/* Elements of the largest parameter and block scales of the largest weight. */
static void largest_param(const mt_model *m, int64_t *numel, int64_t *blocks)
{
    *numel = *blocks = 1;
    for (int i = 0; i < m->table.n; i++) {
        const mt_param_desc *d = &m->table.p[i];
        int64_t nb = ((d->rows + 127) / 128) * ((d->cols + 127) / 128);
        if (mt_param_numel(d) > *numel) *numel = mt_param_numel(d);
        if (nb > *blocks) *blocks = nb;
    }
}

int mt_train_state_load_weights(mt_model *m, const mt_tensor_reader *r,
                                void (*progress)(void *ctx, int done, int total), void *ctx)
{
    int64_t mx, mxs;
    largest_param(m, &mx, &mxs);
    stage st;
    float *dev = NULL;
    const int64_t dn = mt_params_stage_elems(&m->table);
    int rc = stage_open(&st, m->be, (size_t)mx * 4, (size_t)mxs * 4, NULL, 0);
    if (rc == MT_OK) rc = m->be->alloc(m->be, (size_t)dn * 4, (void **)&dev);
    for (int i = 0; i < m->table.n && rc == MT_OK; i++) {
        rc = load_param(m, r, i, &st, dev, dn);
        if (progress) progress(ctx, i + 1, m->table.n);
    }
    int rs = m->be->sync(m->be); /* also before the staging is freed */
    if (rc == MT_OK) rc = rs;
    if (dev) m->be->free(m->be, dev);
    stage_close(&st);
    return rc;
}

/* A reader that times its reads: a restore's time split into waiting for
 * the checkpoint's bytes and the rest (conversions, installs, uploads,
 * replica exchanges), logged at MOETRAIN_LOG=debug per rank (issue 23:
 * where a multi-rank load's time goes). */
typedef struct timed_reader {
    const mt_tensor_reader *in;
    double ms;
    int64_t reads, bytes;
} timed_reader;

static int timed_read(void *ctx, mt_tensor_desc *d)
{
    timed_reader *tr = ctx;
    const double t0 = mt_now_ms();
    const int rc = tr->in->read(tr->in->ctx, d);
    tr->ms += mt_now_ms() - t0;
    tr->reads++;
    if (rc == MT_OK) tr->bytes += (int64_t)mt_tensor_desc_bytes(d);
    return rc;
}

static int timed_read_fp8(void *ctx, mt_tensor_desc *q, float *s)
{
    timed_reader *tr = ctx;
    const double t0 = mt_now_ms();
    const int rc = tr->in->read_fp8(tr->in->ctx, q, s);
    tr->ms += mt_now_ms() - t0;
    tr->reads++;
    if (rc == MT_OK) /* the e4m3 bytes and one f32 scale per 128 x 128 block */
        tr->bytes += (int64_t)mt_tensor_desc_bytes(q) +
                     (int64_t)mt_ceil_div((int)q->count[0], 128) *
                         mt_ceil_div(q->ndim == 2 ? (int)q->count[1] : 1, 128) * 4;
    return rc;
}

static void timed_skip(void *ctx, const char *name)
{
    timed_reader *tr = ctx;
    tr->in->skip(tr->in->ctx, name);
}

int mt_train_state_restore(mt_trainer *t, const mt_tensor_reader *r, const char *state_json)
{
    return mt_train_state_restore_staged(t, r, state_json, NULL, 0);
}

int mt_train_state_restore_staged(mt_trainer *t, const mt_tensor_reader *r_in,
                                  const char *state_json, void *stage_mem, size_t stage_bytes)
{
    mt_model *m = t->model;
    scalars sc;
    MT_CHECK(parse_state(state_json, &sc));
    const double t0 = mt_now_ms();
    timed_reader tr = {r_in, 0, 0, 0};
    const mt_tensor_reader timed = {&tr, timed_read, r_in->read_fp8 ? timed_read_fp8 : NULL,
                                    r_in->skip ? timed_skip : NULL, r_in->shared};
    const mt_tensor_reader *r = &timed;
    int64_t mx, mxs;
    largest_param(m, &mx, &mxs);
    stage st;
    int rc = stage_open(&st, m->be, (size_t)mx * 4, (size_t)mxs * 4, stage_mem, stage_bytes);
    if (rc < 0) {
        stage_close(&st);
        return rc;
    }
    /* a shared source: each replicated weight read by one replica and sent
     * to the others; the readers' plan is the same on every replica */
    share_plan plan, *sp = NULL;
    if (r->shared && (t->dp || t->edp)) {
        rc = share_plan_build(&plan, t, sc.has_opt);
        if (rc == MT_OK) sp = &plan;
        for (int i = 0; sp && r->skip && i < m->table.n; i++)
            if (sp->group[i] && sp->reader[i] != mt_comm_rank(sp->group[i]))
                r->skip(r->ctx, m->params[i].d.name);
    }
    /* with replica groups every rank goes through every parameter, also
     * after a failure (restore_param): the groups' broadcasts must match */
    char why[2048] = "";
    for (int i = 0; i < m->table.n && (rc == MT_OK || sp); i++) {
        const int ri = restore_param(t, r, i, &sc, &st, sp, rc, why);
        if (ri < 0 && rc == MT_OK) {
            rc = ri;
            snprintf(why, sizeof why, "%s", mt_errmsg());
        }
    }
    int rs = m->be->sync(m->be); /* the last uploads, before the staging is freed */
    stage_close(&st);
    const int shared = sp != NULL;
    if (sp && rc == MT_OK)
        MT_LOGI("restore: %d of %d replicated weights read here (%.1f MB), %.1f MB received from "
                "the other replicas", sp->n_mine, sp->n_shared, (double)sp->bytes_mine / 1e6,
                (double)sp->bytes_recv / 1e6);
    if (sp) share_plan_free(sp);
    if (rc == MT_OK) {
        const double all = mt_now_ms() - t0;
        MT_LOGD("restore: %lld reads, %.1f MB, %.1f ms waiting for them (%.0f MB/s); %.1f ms the "
                "rest (conversions, installs, uploads, replica exchanges) of %.1f ms",
                (long long)tr.reads, (double)tr.bytes / 1e6, tr.ms,
                tr.ms > 0 ? (double)tr.bytes / 1e3 / tr.ms : 0.0, all - tr.ms, all);
    }
    /* later broadcasts may have left other messages: the first failure's */
    if (rc < 0) return shared ? MT_ERR(rc, "%s", why) : rc;
    MT_CHECK(rs);
    const mt_jobspec *j = &t->job;
    t->step = sc.step;
    t->consumed_samples = sc.samples;
    t->skipped_total = sc.skipped;
    t->bad_in_row = sc.bad_in_row;
    if (sc.has_opt) {
        t->opt->step = sc.opt_step;
        t->opt->seed = sc.sr_seed; /* the stochastic-rounding stream continues */
    }
    const int64_t samples = j->train.steps * j->batch.global_batch_size;
    if ((sc.num_samples >= 0 && sc.num_samples != samples) || (sc.seq_len >= 0 && sc.seq_len != j->batch.seq_len) ||
        (sc.seed >= 0 && sc.seed != j->train.seed))
        MT_LOGW("restore: the data order differs from the saved run (num_samples %lld -> %lld, "
                "seq_len %lld -> %d, seed %lld -> %lld): training continues, not bit-identically",
                (long long)sc.num_samples, (long long)samples, (long long)sc.seq_len,
                j->batch.seq_len, (long long)sc.seed, (long long)j->train.seed);
    return MT_OK;
}
