/* ckpt_hf.c - Hugging Face import / export (hf.h). */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt/ckpt_internal.h"
#include "ckpt/hf.h"
#include "ckpt/safetensors.h"
#include "kernels/mt_fp8.h"
#include "base/mt_fs.h"
#include "base/mt_log.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"

#define HF_INDEX "model.safetensors.index.json"

struct mt_hf {
    char dir[4096];
    mt_model_config cfg;
    int n_files;
    mt_st_file **files;
    int n;            /* tensors over all files */
    int *tfile;       /* [n] file of tensor k */
    int *tidx;        /* [n] index in that file */
    int hash_cap;
    int *hash;        /* name -> k + 1 */
};

static const mt_st_tensor *hf_tensor(const mt_hf *h, int k) { return &h->files[h->tfile[k]]->t[h->tidx[k]]; }

static int hf_find(const mt_hf *h, const char *name)
{
    size_t i = (size_t)mt_hash_str(name) & (size_t)(h->hash_cap - 1);
    while (h->hash[i]) {
        if (!strcmp(hf_tensor(h, h->hash[i] - 1)->name, name)) return h->hash[i] - 1;
        i = (i + 1) & (size_t)(h->hash_cap - 1);
    }
    return -1;
}

void mt_hf_close(mt_hf *h)
{
    if (!h) return;
    for (int i = 0; i < h->n_files; i++) mt_st_close(h->files[i]);
    free(h->files);
    free(h->tfile);
    free(h->tidx);
    free(h->hash);
    free(h);
}

const mt_model_config *mt_hf_config(const mt_hf *h) { return &h->cfg; }

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The shard file names: those of the index's weight_map, else *.safetensors. */
static int list_files(const char *dir, char ***names, int *n)
{
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir, HF_INDEX);
    *names = NULL;
    *n = 0;
    int cap = 0;
    json_error_t e;
    json_t *idx = access(p, F_OK) == 0 ? json_load_file(p, 0, &e) : NULL;
    if (access(p, F_OK) == 0 && !idx) return MT_ERR(MT_ECORRUPT, "%s: %s (line %d)", p, e.text, e.line);
    if (idx) {
        json_t *wm = json_object_get(idx, "weight_map");
        if (!json_is_object(wm)) {
            json_decref(idx);
            return MT_ERR(MT_ECORRUPT, "%s: no weight_map object", p);
        }
        const char *k;
        json_t *v;
        json_object_foreach(wm, k, v)
        {
            const char *f = json_string_value(v);
            if (!f) continue;
            int dup = 0;
            for (int i = 0; i < *n && !dup; i++) dup = !strcmp((*names)[i], f);
            if (dup) continue;
            if (*n == cap) {
                cap = cap ? 2 * cap : 16;
                *names = realloc(*names, (size_t)cap * sizeof **names);
            }
            (*names)[(*n)++] = strdup(f);
        }
        json_decref(idx);
    } else {
        DIR *d = opendir(dir);
        if (!d) return MT_ERR(MT_EIO, "%s: cannot list: %s", dir, strerror(errno));
        struct dirent *de;
        while ((de = readdir(d))) {
            size_t l = strlen(de->d_name);
            if (l < 12 || strcmp(de->d_name + l - 12, ".safetensors")) continue;
            if (*n == cap) {
                cap = cap ? 2 * cap : 16;
                *names = realloc(*names, (size_t)cap * sizeof **names);
            }
            (*names)[(*n)++] = strdup(de->d_name);
        }
        closedir(d);
    }
    if (*n == 0) return MT_ERR(MT_ENOTFOUND, "%s: no safetensors files", dir);
    qsort(*names, (size_t)*n, sizeof **names, cmp_str);
    return MT_OK;
}

int mt_hf_open(mt_hf **out, const char *dir)
{
    *out = NULL;
    mt_hf *h = calloc(1, sizeof *h);
    if (!h) return MT_ERR(MT_ENOMEM, "out of memory");
    snprintf(h->dir, sizeof h->dir, "%s", dir);
    char p[4400];
    snprintf(p, sizeof p, "%s/config.json", dir);
    char **names = NULL;
    int nn = 0, rc = mt_config_load(&h->cfg, p);
    if (rc < 0) goto fail;
    if ((rc = list_files(dir, &names, &nn)) < 0) goto fail;
    h->files = calloc((size_t)nn, sizeof *h->files);
    if (!h->files) {
        rc = MT_ERR(MT_ENOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < nn && rc == MT_OK; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        rc = mt_st_open(&h->files[i], p);
        if (rc == MT_OK) {
            h->n_files++;
            h->n += h->files[i]->n;
        }
    }
    if (rc < 0) goto fail;
    h->tfile = malloc((size_t)(h->n + 1) * sizeof *h->tfile);
    h->tidx = malloc((size_t)(h->n + 1) * sizeof *h->tidx);
    h->hash_cap = 16;
    while (h->hash_cap < 2 * h->n) h->hash_cap *= 2;
    h->hash = calloc((size_t)h->hash_cap, sizeof *h->hash);
    if (!h->tfile || !h->tidx || !h->hash) {
        rc = MT_ERR(MT_ENOMEM, "out of memory");
        goto fail;
    }
    int k = 0;
    for (int f = 0; f < h->n_files; f++)
        for (int i = 0; i < h->files[f]->n; i++, k++) {
            h->tfile[k] = f;
            h->tidx[k] = i;
            if (hf_find(h, h->files[f]->t[i].name) >= 0) {
                rc = MT_ERR(MT_ECORRUPT, "%s: tensor %s in two files", dir, h->files[f]->t[i].name);
                goto fail;
            }
            size_t j = (size_t)mt_hash_str(h->files[f]->t[i].name) & (size_t)(h->hash_cap - 1);
            while (h->hash[j]) j = (j + 1) & (size_t)(h->hash_cap - 1);
            h->hash[j] = k + 1;
        }
    for (int i = 0; i < nn; i++) free(names[i]);
    free(names);
    *out = h;
    return MT_OK;
fail:
    for (int i = 0; i < nn; i++) free(names[i]);
    free(names);
    mt_hf_close(h);
    return mt_err_wrap(rc, "Hugging Face directory %s", dir);
}

static int hf_dtype(const char *st, mt_dtype *dt)
{
    if (!strcmp(st, "F8_E4M3")) *dt = MT_DT_E4M3;
    else if (!strcmp(st, "BF16")) *dt = MT_DT_BF16;
    else if (!strcmp(st, "F32") || !strcmp(st, "F16")) *dt = MT_DT_F32; /* F16 widened on read */
    else if (!strcmp(st, "I32")) *dt = MT_DT_I32;
    else if (!strcmp(st, "I64")) *dt = MT_DT_I64;
    else if (!strcmp(st, "U8")) *dt = MT_DT_U8;
    else return 0;
    return 1;
}

static int hf_info(void *impl, const char *name, mt_dtype *dt, int *ndim, int64_t shape[2])
{
    mt_hf *h = impl;
    int k = hf_find(h, name);
    if (k < 0) return MT_ENOTFOUND;
    const mt_st_tensor *t = hf_tensor(h, k);
    if (!hf_dtype(t->dtype, dt) || t->ndim < 1 || t->ndim > 2) return MT_ENOTFOUND;
    *ndim = t->ndim;
    shape[0] = t->shape[0];
    shape[1] = t->ndim == 2 ? t->shape[1] : 1;
    return MT_OK;
}

/* IEEE half -> float, exact. */
static float half_to_f32(uint16_t h)
{
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {
        float v = ldexpf((float)m, -24);
        return s ? -v : v;
    }
    if (e == 31) return mt_bits_f32(s | 0x7f800000u | (m << 13));
    return mt_bits_f32(s | ((e + 112) << 23) | (m << 13));
}

/* F16 -> F32 of n elements. */
static void widen_f16(float *dst, const uint8_t *src, int64_t n)
{
    for (int64_t j = 0; j < n; j++) {
        uint16_t v;
        memcpy(&v, src + 2 * j, 2);
        dst[j] = half_to_f32(v);
    }
}

/* Reads with pread into the caller's buffer (mapped pages would stay
 * resident: an import touching every byte of a model through a mapping
 * grows to the model's size). Whole rows in one read; a column slice row
 * by row; F16 through a bounded staging buffer. */
static int hf_read_raw(void *impl, mt_tensor_desc *d)
{
    mt_hf *h = impl;
    int k = hf_find(h, d->name);
    if (k < 0) return MT_ERR(MT_ENOTFOUND, "%s: no tensor %s", h->dir, d->name);
    const mt_st_file *f = h->files[h->tfile[k]];
    const mt_st_tensor *t = &f->t[h->tidx[k]];
    const int f16 = !strcmp(t->dtype, "F16");
    const size_t es = mt_st_dtype_size(t->dtype), os = mt_dtype_size(d->dtype);
    const int64_t C = t->ndim == 2 ? t->shape[1] : 1;
    const int64_t rows = d->count[0], cols = d->ndim == 2 ? d->count[1] : 1, c0 = d->ndim == 2 ? d->off[1] : 0;
    if (d->ndim != t->ndim || d->off[0] < 0 || c0 < 0 || rows < 0 || cols < 0 ||
        d->off[0] + rows > t->shape[0] || c0 + cols > C || (f16 ? 4 : es) != os)
        return MT_ERR(MT_EINVAL, "%s: tensor %s: hyperslab or type outside the stored %s tensor",
                      f->path, d->name, t->dtype);
    const uint64_t base = t->begin + (uint64_t)d->off[0] * (uint64_t)C * es;
    uint8_t *dst = d->data;
    if (!f16 && cols == C) return mt_st_read(f, dst, (size_t)rows * (size_t)C * es, base);
    if (!f16) {
        for (int64_t i = 0; i < rows; i++)
            MT_CHECK(mt_st_read(f, dst + (size_t)i * (size_t)cols * es, (size_t)cols * es,
                                base + ((uint64_t)i * (uint64_t)C + (uint64_t)c0) * es));
        return MT_OK;
    }
    /* F16: rows of the slice, up to 4 MB at a time, widened into place */
    const size_t rb = (size_t)cols * 2;
    int64_t per = (int64_t)((4u << 20) / rb);
    per = per < 1 ? 1 : per > rows ? rows : per;
    uint8_t *stage = malloc((size_t)per * rb + 1);
    if (!stage) return MT_ERR(MT_ENOMEM, "%s: out of memory", f->path);
    int rc = MT_OK;
    for (int64_t i = 0; i < rows && rc == MT_OK; i += per) {
        const int64_t n = rows - i < per ? rows - i : per;
        if (cols == C) {
            rc = mt_st_read(f, stage, (size_t)n * rb, base + (uint64_t)i * (uint64_t)C * 2);
        } else {
            for (int64_t r = 0; r < n && rc == MT_OK; r++)
                rc = mt_st_read(f, stage + (size_t)r * rb, rb,
                                base + ((uint64_t)(i + r) * (uint64_t)C + (uint64_t)c0) * 2);
        }
        if (rc == MT_OK) widen_f16((float *)(dst + (size_t)i * (size_t)cols * 4), stage, n * cols);
    }
    free(stage);
    return rc;
}

mt_tensor_source mt_hf_source(mt_hf *h)
{
    mt_tensor_source s = {h, h->dir, hf_info, hf_read_raw};
    return s;
}

int mt_hf_read_fn(void *ctx, mt_tensor_desc *d)
{
    mt_tensor_source s = mt_hf_source(ctx);
    return mt_source_read(&s, d);
}

int mt_hf_read_fp8_fn(void *ctx, mt_tensor_desc *q, float *sc)
{
    mt_tensor_source s = mt_hf_source(ctx);
    return mt_source_read_fp8(&s, q, sc);
}

/* ---- import ----------------------------------------------------------------------------- */

int mt_hf_import(const char *hf_dir, const char *out, const mt_shard_opts *opts,
                 const mt_layout *layout, int flags, mt_progress *prog)
{
    mt_hf *h;
    MT_CHECK(mt_hf_open(&h, hf_dir));
    mt_shard_opts o = *opts;
    o.optimizer = o.has_main = 0;
    mt_shard_map map;
    int rc = mt_shard_map_build(&map, &h->cfg, layout, &o);
    if (rc < 0) {
        mt_hf_close(h);
        return rc;
    }
    /* every parameter must be there; extra tensors (the MTP copies) are not used */
    for (int t = 0; t < map.n_tensors && rc == MT_OK; t++) {
        const mt_shard_tensor *x = &map.tensors[t];
        if (hf_find(h, x->name) >= 0 || x->role == MT_TS_SCALE) continue;
        rc = MT_ERR(MT_ENOTFOUND, "%s: tensor %s missing", hf_dir, x->name);
    }
    int unused = 0;
    for (int k = 0; k < h->n && rc == MT_OK; k++)
        if (mt_shard_map_find(&map, hf_tensor(h, k)->name) < 0) unused++;
    if (unused) MT_LOGI("import: %d tensors of %s are copies or not parameters; not imported", unused, hf_dir);
    mt_ckpt_meta meta;
    memset(&meta, 0, sizeof meta);
    meta.layout = *layout;
    meta.opts = o;
    json_t *cj = mt_config_to_json(&h->cfg);
    meta.config_json = json_dumps(cj, JSON_SORT_KEYS | JSON_COMPACT);
    json_decref(cj);
    meta.job_json = strdup("null");
    json_t *sj = json_pack("{s:I,s:I,s:I,s:{s:s,s:s}}", "step", (json_int_t)0, "consumed_samples",
                           (json_int_t)0, "consumed_tokens", (json_int_t)0, "source", "kind",
                           "huggingface", "path", hf_dir);
    meta.state_json = json_dumps(sj, JSON_SORT_KEYS | JSON_COMPACT);
    json_decref(sj);
    if (rc == MT_OK && (!meta.config_json || !meta.job_json || !meta.state_json))
        rc = MT_ERR(MT_ENOMEM, "out of memory");
    if (rc == MT_OK) {
        mt_tensor_source src = mt_hf_source(h);
        mt_progress_start(prog, "import", mt_shard_map_bytes(&map), prog ? prog->enabled : 0);
        rc = mt_ckpt_write_from_source(out, &meta, &map, &src, flags, prog);
        mt_progress_end(prog);
    }
    mt_ckpt_meta_free(&meta);
    mt_shard_map_free(&map);
    mt_hf_close(h);
    return rc;
}

/* ---- export ----------------------------------------------------------------------------- */

typedef struct xentry {
    int tensor;        /* map tensor (the source of an alias) */
    const char *name;  /* exported name */
    int shard;
} xentry;

static const char *st_dtype(mt_dtype d)
{
    switch (d) {
    case MT_DT_E4M3: return "F8_E4M3";
    case MT_DT_BF16: return "BF16";
    case MT_DT_F32: return "F32";
    case MT_DT_I32: return "I32";
    case MT_DT_I64: return "I64";
    default: return "U8";
    }
}

static int64_t tensor_bytes(const mt_shard_tensor *t)
{
    return t->shape[0] * t->shape[1] * (int64_t)mt_dtype_size(t->dtype);
}

/* Streams map tensor t from the source into the writer, band by band. */
static int export_tensor(mt_st_writer *w, const mt_shard_map *m, const mt_tensor_source *src, int t,
                         mt_progress *prog)
{
    const mt_shard_tensor *x = &m->tensors[t];
    const size_t es = mt_dtype_size(x->dtype);
    const int64_t cols = x->ndim == 2 ? x->shape[1] : 1;
    const int64_t br = ck_band_rows(x->shape[0], cols, es);
    void *buf = malloc((size_t)br * (size_t)cols * es);
    if (!buf) return MT_ERR(MT_ENOMEM, "out of memory");
    int rc = MT_OK;
    for (int64_t r = 0; r < x->shape[0] && rc == MT_OK; r += br) {
        int64_t nr = x->shape[0] - r < br ? x->shape[0] - r : br;
        mt_tensor_desc d;
        mt_tensor_desc_slab(&d, x->name, x->dtype, x->ndim, x->shape, r, 0, nr, cols, buf);
        rc = ck_read_map_band(m, src, t, &d);
        if (rc == MT_OK) rc = mt_st_writer_write(w, buf, (size_t)nr * (size_t)cols * es);
        mt_progress_add(prog, nr * cols * (int64_t)es);
    }
    free(buf);
    return rc;
}

static int write_json_file(const char *path, json_t *o)
{
    char tmp[4400];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (json_dump_file(o, tmp, JSON_INDENT(2) | JSON_SORT_KEYS) != 0)
        return MT_ERR(MT_EIO, "%s: cannot write", tmp);
    MT_CHECK(mt_fsync_path(tmp));
    if (rename(tmp, path) != 0) return MT_ERR(MT_EIO, "%s: cannot rename: %s", path, strerror(errno));
    return mt_fsync_parent(path);
}

static int export_config(const char *out_dir, const mt_model_config *c)
{
    json_t *o = mt_config_to_json(c);
    json_object_set_new(o, "architectures", json_pack("[s]", "DeepseekV3ForCausalLM"));
    json_object_set_new(o, "model_type", json_string("deepseek_v3"));
    json_object_set_new(o, "torch_dtype", json_string("bfloat16"));
    json_object_set_new(o, "quantization_config",
                        json_pack("{s:s,s:s,s:s,s:[i,i]}", "activation_scheme", "dynamic", "fmt",
                                  "e4m3", "quant_method", "fp8", "weight_block_size", 128, 128));
    char p[4400];
    snprintf(p, sizeof p, "%s/config.json", out_dir);
    int rc = write_json_file(p, o);
    json_decref(o);
    return rc;
}

int mt_hf_export(const char *ckpt, const char *out_dir, int64_t max_shard_bytes, mt_progress *prog)
{
    mt_ckpt *ck;
    MT_CHECK(mt_ckpt_open(&ck, ckpt));
    mt_model_config c;
    mt_shard_map map;
    memset(&map, 0, sizeof map);
    xentry *xs = NULL;
    int rc = ck_meta_config(mt_ckpt_get_meta(ck), &c);
    /* the release's layout: FP8 linears, BF16 elsewhere, one rank, weights */
    mt_shard_opts o = {.fp8 = 1, .act_dtype = MT_DT_BF16};
    mt_layout one;
    mt_layout_default(&one);
    if (rc == MT_OK) rc = mt_shard_map_build(&map, &c, &one, &o);
    if (rc == MT_OK) rc = mt_mkdir_p(out_dir);
    const int nx = map.n_tensors + map.n_aliases;
    if (rc == MT_OK && !(xs = calloc((size_t)nx + 1, sizeof *xs))) rc = MT_ERR(MT_ENOMEM, "out of memory");
    if (rc < 0) goto out;
    int shards = 0;
    int64_t in_shard = 0, total = 0;
    for (int i = 0; i < nx; i++) {
        int t = i < map.n_tensors ? i : map.aliases[i - map.n_tensors].source;
        xs[i].tensor = t;
        xs[i].name = i < map.n_tensors ? map.tensors[t].name : map.aliases[i - map.n_tensors].name;
        int64_t b = tensor_bytes(&map.tensors[t]);
        if (shards == 0 || (in_shard > 0 && in_shard + b > max_shard_bytes)) {
            shards++;
            in_shard = 0;
        }
        xs[i].shard = shards - 1;
        in_shard += b;
        total += b;
    }
    mt_tensor_source src = mt_ckpt_source(ck);
    json_t *wm = json_object();
    mt_progress_start(prog, "export", total, prog ? prog->enabled : 0);
    for (int s = 0, i = 0; s < shards && rc == MT_OK; s++) {
        char fname[64], p[4400];
        snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", s + 1, shards);
        snprintf(p, sizeof p, "%s/%s", out_dir, fname);
        int i0 = i;
        while (i < nx && xs[i].shard == s) i++;
        mt_st_tensor *e = calloc((size_t)(i - i0), sizeof *e);
        if (!e) {
            rc = MT_ERR(MT_ENOMEM, "out of memory");
            break;
        }
        for (int k = i0; k < i; k++) {
            const mt_shard_tensor *x = &map.tensors[xs[k].tensor];
            mt_st_tensor *y = &e[k - i0];
            snprintf(y->name, sizeof y->name, "%s", xs[k].name);
            snprintf(y->dtype, sizeof y->dtype, "%s", st_dtype(x->dtype));
            y->ndim = x->ndim;
            y->shape[0] = x->shape[0];
            y->shape[1] = x->shape[1];
            json_object_set_new(wm, xs[k].name, json_string(fname));
        }
        mt_st_writer *w = NULL;
        rc = mt_st_writer_open(&w, p, e, i - i0);
        free(e);
        for (int k = i0; k < i && rc == MT_OK; k++) rc = export_tensor(w, &map, &src, xs[k].tensor, prog);
        if (rc == MT_OK) rc = mt_st_writer_close(w);
        else if (w) mt_st_writer_abort(w);
        if (rc < 0) rc = mt_err_wrap(rc, "%s", p);
    }
    mt_progress_end(prog);
    if (rc == MT_OK) {
        json_t *idx = json_pack("{s:{s:I},s:o}", "metadata", "total_size", (json_int_t)total,
                                "weight_map", wm);
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", out_dir, HF_INDEX);
        rc = write_json_file(p, idx);
        json_decref(idx);
    } else {
        json_decref(wm);
    }
    if (rc == MT_OK) rc = export_config(out_dir, &c);
out:
    free(xs);
    mt_shard_map_free(&map);
    mt_ckpt_close(ck);
    return rc;
}
