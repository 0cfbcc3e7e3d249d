/* ckpt_ops.c - whole-checkpoint operations: writing from a tensor source
 * (reshard, import), diff (verify: ckpt_verify.c). One process plays every
 * rank; memory is bounded by one band (CK_BAND_BYTES), never the model. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt/ckpt_internal.h"
#include "ckpt/xxh64.h"
#include "base/mt_fs.h"
#include "base/mt_log.h"
#include "base/mt_status.h"

/* ---- writing from a source ----------------------------------------------------------- */

int mt_ckpt_out_path(const char *out, int64_t step, char *dir, size_t cap, char *root,
                     size_t rcap, int *is_root)
{
    const char *base = strrchr(out, '/');
    base = base ? base + 1 : out;
    size_t n = strspn(base + (strncmp(base, "step_", 5) ? 0 : 5), "0123456789");
    *is_root = !(strncmp(base, "step_", 5) == 0 && n >= 8 && base[5 + n] == '\0');
    if (*is_root) {
        snprintf(root, rcap, "%s", out);
        return mt_ckpt_step_path(dir, cap, out, step, 0);
    }
    snprintf(dir, cap, "%s", out);
    snprintf(root, rcap, "%.*s", (int)(base - out > 1 ? base - out - 1 : base - out), out);
    if (!root[0]) snprintf(root, rcap, ".");
    return MT_OK;
}

typedef struct src_fill {
    const mt_shard_map *map;
    const mt_tensor_source *src;
    const int *pieces;   /* this rank's piece indices */
} src_fill;

int ck_read_map_band(const mt_shard_map *m, const mt_tensor_source *src, int ti,
                     mt_tensor_desc *d)
{
    const mt_shard_tensor *t = &m->tensors[ti];
    if (t->role == MT_TS_WEIGHT && t->dtype == MT_DT_E4M3) return mt_source_read_fp8(src, d, NULL);
    if (t->role != MT_TS_SCALE) return mt_source_read(src, d);
    /* scales: stored ones as they are; otherwise from quantising the weight */
    mt_dtype dt;
    int nd;
    int64_t shape[2];
    if (src->info(src->impl, t->name, &dt, &nd, shape) == MT_OK) return mt_source_read(src, d);
    const mt_shard_tensor *w = &m->tensors[m->param_tensor[t->param][MT_TS_WEIGHT]];
    mt_tensor_desc q = *d;
    snprintf(q.name, sizeof q.name, "%s", w->name);
    q.dtype = MT_DT_E4M3;
    q.shape[0] = w->shape[0];
    q.shape[1] = w->shape[1];
    q.off[1] = d->off[1] * 128;
    int64_t end = (d->off[1] + d->count[1]) * 128;
    q.count[1] = (end < w->shape[1] ? end : w->shape[1]) - q.off[1];
    /* one row of scales (128 weight rows) at a time: the quantised bytes
     * are thrown away, so they need no more than one block row */
    q.data = malloc((size_t)(128 * q.count[1]));
    if (!q.data) return MT_ERR(MT_ENOMEM, "%s: out of memory", t->name);
    const int64_t dcols = d->ndim == 2 ? d->count[1] : 1;
    int rc = MT_OK;
    for (int64_t i = 0; i < d->count[0] && rc == MT_OK; i++) {
        q.off[0] = (d->off[0] + i) * 128;
        q.count[0] = (q.off[0] + 128 < w->shape[0] ? q.off[0] + 128 : w->shape[0]) - q.off[0];
        rc = mt_source_read_fp8(src, &q, (float *)d->data + i * dcols);
    }
    free(q.data);
    return rc;
}

static int fill_from_source(void *ctx, int i, const mt_tensor_desc *band, void *buf)
{
    src_fill *sf = ctx;
    mt_tensor_desc d = *band;
    d.data = buf;
    return ck_read_map_band(sf->map, sf->src, sf->map->pieces[sf->pieces[i]].tensor, &d);
}

int mt_ckpt_write_from_source(const char *out, const mt_ckpt_meta *meta, const mt_shard_map *map,
                              const mt_tensor_source *src, int flags, mt_progress *prog)
{
    char dir[4200], root[4200], work[4300];
    int is_root;
    MT_CHECK(mt_ckpt_out_path(out, meta->step, dir, sizeof dir, root, sizeof root, &is_root));
    /* refused before an hour of writing, not at the commit */
    if (access(dir, F_OK) == 0 && !(flags & MT_CKPT_OVERWRITE))
        return MT_ERR(MT_EINVAL,
                      "%s exists: a committed checkpoint is replaced only when asked (overwrite); "
                      "choose another output",
                      dir);
    if (is_root) {
        MT_CHECK(mt_ckpt_begin(root, meta->step, work, sizeof work));
    } else {
        snprintf(work, sizeof work, "%s.partial", dir);
        MT_CHECK(mt_mkdir_p(root));
        if (access(work, F_OK) == 0) {
            MT_LOGI("checkpoint: removing %s left by an interrupted run", work);
            MT_CHECK(ck_rm_rf(work));
        }
        if (mkdir(work, 0755) != 0) return MT_ERR(MT_EIO, "%s: cannot create: %s", work, strerror(errno));
    }
    mt_ckpt_piece_rec *recs = calloc((size_t)map->n_pieces + 1, sizeof *recs);
    mt_tensor_desc *descs = calloc((size_t)map->n_pieces + 1, sizeof *descs);
    if (!recs || !descs) {
        free(recs);
        free(descs);
        return MT_ERR(MT_ENOMEM, "out of memory");
    }
    int rc = MT_OK, k = 0;
    for (int r = 0; r < map->world && rc == MT_OK; r++) {
        int n;
        const int *idx = mt_shard_map_rank_pieces(map, r, &n);
        if (!n) continue;
        for (int i = 0; i < n; i++) mt_shard_piece_desc(map, idx[i], &descs[i]);
        src_fill sf = {map, src, idx};
        rc = mt_ckpt_write_shard(work, r, descs, n, fill_from_source, &sf, recs + k, prog);
        k += n;
    }
    if (rc == MT_OK) rc = mt_ckpt_write_index(work, meta, map, recs, k);
    free(recs);
    free(descs);
    if (rc < 0) return rc;
    if (is_root) return mt_ckpt_commit_ex(root, meta->step, 0, flags);
    return ck_commit_dir(root, work, dir, flags);
}

/* The job spec JSON with its parallel section set to the layout. */
static char *job_with_layout(const char *job, const mt_layout *l)
{
    json_error_t e;
    json_t *j = job ? json_loads(job, 0, &e) : NULL;
    if (!j || !json_is_object(j)) {
        json_decref(j);
        return job ? strdup(job) : NULL;
    }
    json_t *p = json_object_get(j, "parallel");
    if (json_is_object(p)) {
        json_object_set_new(p, "tp", json_integer(l->tp));
        json_object_set_new(p, "pp", json_integer(l->pp));
        json_object_set_new(p, "vpp", json_integer(l->vpp));
        json_object_set_new(p, "ep", json_integer(l->ep));
        json_object_set_new(p, "etp", json_integer(l->etp));
        json_object_set_new(p, "dp", json_integer(l->dp));
    }
    char *s = json_dumps(j, JSON_SORT_KEYS | JSON_COMPACT);
    json_decref(j);
    return s;
}

int mt_ckpt_reshard(const char *in, const char *out, const mt_layout *layout, int flags,
                    mt_progress *prog)
{
    mt_ckpt *ck;
    MT_CHECK(mt_ckpt_open(&ck, in));
    mt_ckpt_meta meta;
    mt_shard_map map;
    memset(&map, 0, sizeof map);
    int rc = mt_ckpt_meta_copy(&meta, mt_ckpt_get_meta(ck));
    if (rc < 0) goto out0;
    mt_model_config c;
    if ((rc = ck_meta_config(&meta, &c)) < 0) goto out;
    if ((rc = mt_shard_map_build(&map, &c, layout, &meta.opts)) < 0) goto out;
    meta.layout = *layout;
    char *job = job_with_layout(meta.job_json, layout);
    free(meta.job_json);
    meta.job_json = job;
    mt_tensor_source src = mt_ckpt_source(ck);
    mt_progress_start(prog, "reshard", mt_shard_map_bytes(&map), prog ? prog->enabled : 0);
    rc = mt_ckpt_write_from_source(out, &meta, &map, &src, flags, prog);
    mt_progress_end(prog);
out:
    mt_shard_map_free(&map);
    mt_ckpt_meta_free(&meta);
out0:
    mt_ckpt_close(ck);
    return rc;
}

/* ---- diff ----------------------------------------------------------------------------------- */

static int diff_tensor(mt_ckpt *a, mt_ckpt *b, const mt_ckpt_tensor *x, ck_problems *v)
{
    const size_t es = mt_dtype_size(x->dtype);
    const int64_t cols = x->ndim == 2 ? x->shape[1] : 1;
    const int64_t br = ck_band_rows(x->shape[0], cols, es);
    const size_t bytes = (size_t)br * (size_t)cols * es;
    char *ba = malloc(bytes), *bb = malloc(bytes);
    int rc = MT_OK;
    if (!ba || !bb) rc = MT_ERR(MT_ENOMEM, "out of memory");
    mt_tensor_source sa = mt_ckpt_source(a), sb = mt_ckpt_source(b);
    for (int64_t r = 0; r < x->shape[0] && rc == MT_OK; r += br) {
        int64_t nr = x->shape[0] - r < br ? x->shape[0] - r : br;
        mt_tensor_desc d;
        mt_tensor_desc_slab(&d, x->name, x->dtype, x->ndim, x->shape, r, 0, nr, cols, ba);
        if ((rc = sa.read_raw(sa.impl, &d)) < 0) break;
        d.data = bb;
        if ((rc = sb.read_raw(sb.impl, &d)) < 0) break;
        size_t n = (size_t)nr * (size_t)cols * es;
        if (memcmp(ba, bb, n) != 0) {
            size_t k = 0;
            while (ba[k] == bb[k]) k++;
            int64_t e = (int64_t)(k / es);
            if (x->ndim == 1)
                ck_problem(v, b->dir, x->name, "differs first at [%lld]", (long long)(r + e));
            else
                ck_problem(v, b->dir, x->name, "differs first at [%lld, %lld]",
                        (long long)(r + e / cols), (long long)(e % cols));
            break;
        }
    }
    free(ba);
    free(bb);
    return rc;
}

int mt_ckpt_diff(const char *pa, const char *pb, int weights_only, int meta_too,
                 mt_ckpt_report_fn report, void *ctx)
{
    mt_ckpt *a, *b;
    MT_CHECK(mt_ckpt_open(&a, pa));
    int rc = mt_ckpt_open(&b, pb);
    if (rc < 0) {
        mt_ckpt_close(a);
        return rc;
    }
    ck_problems v = {report, ctx, 0, ""};
    for (int t = 0; t < a->n_tensors && rc == MT_OK; t++) {
        const mt_ckpt_tensor *x = &a->tensors[t];
        if (weights_only && !strncmp(x->name, "optimizer.", 10)) continue;
        int u = mt_ckpt_find(b, x->name);
        if (u < 0) {
            ck_problem(&v, b->dir, x->name, "missing");
            continue;
        }
        const mt_ckpt_tensor *y = &b->tensors[u];
        if (y->dtype != x->dtype || y->ndim != x->ndim || y->shape[0] != x->shape[0] ||
            y->shape[1] != x->shape[1]) {
            ck_problem(&v, b->dir, x->name, "%s [%lld, %lld] vs %s [%lld, %lld]", mt_dtype_name(x->dtype),
                    (long long)x->shape[0], (long long)x->shape[1], mt_dtype_name(y->dtype),
                    (long long)y->shape[0], (long long)y->shape[1]);
            continue;
        }
        rc = diff_tensor(a, b, x, &v);
    }
    for (int t = 0; t < b->n_tensors && rc == MT_OK; t++) {
        const mt_ckpt_tensor *y = &b->tensors[t];
        if (weights_only && !strncmp(y->name, "optimizer.", 10)) continue;
        if (mt_ckpt_find(a, y->name) < 0) ck_problem(&v, a->dir, y->name, "missing");
    }
    if (rc == MT_OK && meta_too) {
        const mt_ckpt_meta *x = &a->meta, *y = &b->meta;
        if (x->step != y->step || x->consumed_samples != y->consumed_samples ||
            x->consumed_tokens != y->consumed_tokens)
            ck_problem(&v, b->dir, "", "step / consumed samples / tokens differ");
        if (strcmp(x->config_json, y->config_json)) ck_problem(&v, b->dir, "", "model config differs");
        if (strcmp(x->state_json, y->state_json)) ck_problem(&v, b->dir, "", "trainer state differs");
    }
    mt_ckpt_close(a);
    mt_ckpt_close(b);
    if (rc < 0) return rc;
    if (v.n) return MT_ERR(MT_ECORRUPT, "%s (%d difference%s)", v.first, v.n, v.n > 1 ? "s" : "");
    return MT_OK;
}
