/* ckpt_write.c - shard files and the index (FORMAT.md). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt/ckpt_internal.h"
#include "ckpt/xxh64.h"
#include "base/mt_fs.h"
#include "base/mt_status.h"

/* ---- shard files ------------------------------------------------------------------ */

/* Bytes of one chunk of a [rows, cols] piece, and the rows it holds. */
static size_t chunk_bytes(const mt_tensor_desc *d, int64_t *rows_per_chunk)
{
    const size_t es = mt_dtype_size(d->dtype);
    const int64_t rows = d->count[0], cols = d->ndim == 1 ? 1 : d->count[1];
    int64_t cr = ck_chunk_rows(rows, cols, es);
    if (rows_per_chunk) *rows_per_chunk = cr;
    return (size_t)cr * (size_t)cols * es;
}

/* Writes rows [a, a + nr) of the piece from src: chunk by chunk, each
 * copied into cbuf (padded with zeros to a whole chunk, as HDF5 stores edge
 * chunks), its Fletcher32 appended little-endian, written raw. */
static int write_rows(hid_t ds, const char *path, const mt_tensor_desc *d, int64_t a, int64_t nr,
                      const char *src, char *cbuf, mt_xxh64 *h)
{
    int64_t cr;
    const size_t cb = chunk_bytes(d, &cr);
    const size_t rb = (size_t)(d->ndim == 1 ? 1 : d->count[1]) * mt_dtype_size(d->dtype);
    char eb[256];
    for (int64_t r = 0; r < nr; r += cr) {
        const int64_t n = nr - r < cr ? nr - r : cr;
        const size_t bytes = (size_t)n * rb;
        memcpy(cbuf, src + (size_t)r * rb, bytes);
        if (bytes < cb) memset(cbuf + bytes, 0, cb - bytes);
        uint32_t f = ck_fletcher32(cbuf, cb);
        for (int k = 0; k < 4; k++) cbuf[cb + (size_t)k] = (char)((f >> (8 * k)) & 0xff);
        hsize_t off[2] = {(hsize_t)(a + r), 0};
        if ((a + r) % cr != 0 || H5Dwrite_chunk(ds, H5P_DEFAULT, 0, off, cb + 4, cbuf) < 0)
            return MT_ERR(MT_EIO, "%s: tensor %s: write failed at row %lld (%s)", path, d->name,
                          (long long)(a + r), ck_h5_errstr(eb, sizeof eb));
        mt_xxh64_update(h, cbuf, bytes);
    }
    return MT_OK;
}

static int write_piece(hid_t f, const char *path, const mt_tensor_desc *d, int i,
                       mt_ckpt_fill_fn fill, void *ctx, void *band, char *cbuf,
                       mt_ckpt_piece_rec *rec, mt_progress *prog)
{
    const size_t es = mt_dtype_size(d->dtype);
    const int nd = d->ndim;
    const int64_t rows = d->count[0], cols = nd == 1 ? 1 : d->count[1];
    if (nd < 1 || nd > 2 || rows <= 0 || cols <= 0 || !es)
        return MT_ERR(MT_EINVAL, "%s: tensor %s: bad piece (ndim %d, count %lld x %lld, dtype %d)",
                      path, d->name, nd, (long long)rows, (long long)cols, (int)d->dtype);
    if (!d->data && !fill)
        return MT_ERR(MT_EINVAL, "%s: tensor %s: no data and no fill function", path, d->name);
    char eb[256];
    int rc = MT_OK;
    int64_t cr;
    chunk_bytes(d, &cr);
    hsize_t dims[2] = {(hsize_t)rows, (hsize_t)cols};
    hsize_t ch[2] = {(hsize_t)cr, (hsize_t)cols};
    hid_t type = ck_h5_type(d->dtype), sp = H5Screate_simple(nd, dims, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE), ds = -1;
    /* chunks are written raw: allocate them as they come */
    if (type < 0 || sp < 0 || dcpl < 0 || H5Pset_chunk(dcpl, nd, ch) < 0 ||
        H5Pset_fletcher32(dcpl) < 0 || H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER) < 0 ||
        H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_INCR) < 0) {
        rc = MT_ERR(MT_EHDF5, "%s: tensor %s: cannot set up the dataset", path, d->name);
        goto out;
    }
    ds = H5Dcreate2(f, d->name, type, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    if (ds < 0) {
        rc = MT_ERR(MT_EHDF5, "%s: tensor %s: cannot create the dataset (%s)", path, d->name,
                    ck_h5_errstr(eb, sizeof eb));
        goto out;
    }
    int64_t gshape[2] = {d->shape[0], d->shape[1]}, off[2] = {d->off[0], d->off[1]};
    if ((rc = ck_attr_str(ds, "dtype", mt_dtype_name(d->dtype))) < 0 ||
        (rc = ck_attr_i64(ds, "global_shape", gshape, nd)) < 0 ||
        (rc = ck_attr_i64(ds, "offset", off, nd)) < 0)
        goto out;
    mt_xxh64 h;
    mt_xxh64_init(&h, 0);
    const size_t row_bytes = (size_t)cols * es;
    if (d->data) {
        rc = write_rows(ds, path, d, 0, rows, d->data, cbuf, &h);
        mt_progress_add(prog, (int64_t)rows * (int64_t)row_bytes);
    } else {
        /* bands: a power of two >= the chunk rows (also powers of two) */
        const int64_t br = ck_band_rows(rows, cols, es);
        for (int64_t a = 0; a < rows && rc == MT_OK; a += br) {
            int64_t nr = rows - a < br ? rows - a : br;
            mt_tensor_desc bd = *d;
            bd.off[0] = d->off[0] + a;
            bd.count[0] = nr;
            bd.data = band;
            if ((rc = fill(ctx, i, &bd, band)) < 0) break;
            rc = write_rows(ds, path, d, a, nr, band, cbuf, &h);
            mt_progress_add(prog, nr * (int64_t)row_bytes);
        }
    }
    if (rc < 0) goto out;
    uint64_t hv = mt_xxh64_digest(&h);
    if ((rc = ck_attr_u64(ds, "xxh64", hv)) < 0) goto out;
    memset(rec, 0, sizeof *rec);
    snprintf(rec->tensor, sizeof rec->tensor, "%s", d->name);
    for (int k = 0; k < 2; k++) {
        rec->off[k] = k < nd ? d->off[k] : 0;
        rec->count[k] = k < nd ? d->count[k] : 1;
    }
    rec->nbytes = (int64_t)rows * (int64_t)row_bytes;
    rec->xxh64 = hv;
out:
    if (ds >= 0 && H5Dclose(ds) < 0 && rc == MT_OK)
        rc = MT_ERR(MT_EIO, "%s: tensor %s: close failed", path, d->name);
    if (dcpl >= 0) H5Pclose(dcpl);
    if (sp >= 0) H5Sclose(sp);
    if (type >= 0) H5Tclose(type);
    return rc;
}

/* userblock: bytes reserved at the start of the file (the index's seal). */
static hid_t create_file(const char *path, hsize_t userblock)
{
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS), fcpl = H5Pcreate(H5P_FILE_CREATE);
    if (fapl < 0 || fcpl < 0 || (userblock && H5Pset_userblock(fcpl, userblock) < 0)) {
        if (fapl >= 0) H5Pclose(fapl);
        if (fcpl >= 0) H5Pclose(fcpl);
        return -1;
    }
    /* the 1.10 format: virtual datasets, compact chunk indexes (HDF5 >= 1.10 reads it) */
    H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_V110);
    /* metadata in 64 KB blocks: less seeking on shards with many pieces */
    H5Pset_meta_block_size(fapl, 64 << 10);
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, fcpl, fapl);
    H5Pclose(fapl);
    H5Pclose(fcpl);
    return f;
}

int mt_ckpt_write_shard(const char *dir, int rank, const mt_tensor_desc *d, int n,
                        mt_ckpt_fill_fn fill, void *ctx, mt_ckpt_piece_rec *recs,
                        mt_progress *prog)
{
    char name[32], path[4200], eb[256];
    ck_shard_name(name, sizeof name, rank);
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path)
        return MT_ERR(MT_EINVAL, "%s: path too long", dir);
    ck_lock();
    int rc = MT_OK;
    hid_t f = create_file(path, 0);
    if (f < 0) {
        rc = MT_ERR(MT_EIO, "%s: cannot create (%s)", path, ck_h5_errstr(eb, sizeof eb));
        goto out;
    }
    int64_t r64 = rank, ver = MT_CKPT_FORMAT_VERSION;
    if ((rc = ck_attr_str(f, "format", MT_CKPT_FORMAT)) < 0 ||
        (rc = ck_attr_i64(f, "format_version", &ver, 1)) < 0 ||
        (rc = ck_attr_i64(f, "rank", &r64, 1)) < 0)
        goto out;
    /* one band buffer for the pieces filled band by band, one chunk buffer */
    size_t band = 0, chunk = 0;
    for (int i = 0; i < n; i++) {
        const size_t es = mt_dtype_size(d[i].dtype);
        const int64_t cols = d[i].ndim == 1 ? 1 : d[i].count[1];
        const size_t c = chunk_bytes(&d[i], NULL) + 4;
        chunk = c > chunk ? c : chunk;
        if (d[i].data) continue;
        const size_t b = (size_t)ck_band_rows(d[i].count[0], cols, es) * (size_t)cols * es;
        band = b > band ? b : band;
    }
    void *buf = band ? malloc(band) : NULL;
    char *cbuf = malloc(chunk ? chunk : 4);
    if ((band && !buf) || !cbuf) {
        free(buf);
        free(cbuf);
        rc = MT_ERR(MT_ENOMEM, "%s: out of memory for a %zu-byte band", path, band);
        goto out;
    }
    for (int i = 0; i < n && rc == MT_OK; i++) {
        rc = write_piece(f, path, &d[i], i, fill, ctx, buf, cbuf, &recs[i], prog);
        if (rc == MT_OK) recs[i].rank = rank;
    }
    free(buf);
    free(cbuf);
out:
    if (f >= 0 && H5Fclose(f) < 0 && rc == MT_OK)
        rc = MT_ERR(MT_EIO, "%s: close failed (%s)", path, ck_h5_errstr(eb, sizeof eb));
    ck_unlock();
    if (rc == MT_OK) rc = mt_fsync_path(path);
    return rc;
}

/* ---- index --------------------------------------------------------------------------- */

static hid_t str_type(size_t n)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, n);
    H5Tset_strpad(t, H5T_STR_NULLTERM);
    return t;
}

static hid_t arr2(hid_t base)
{
    hsize_t two = 2;
    return H5Tarray_create2(base, 1, &two);
}

hid_t ck_tensor_row_type(void)
{
    hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(tensor_row));
    hid_t s1 = str_type(MT_TENSOR_NAME_CAP), s2 = str_type(8), a = arr2(H5T_STD_I64LE);
    H5Tinsert(t, "name", HOFFSET(tensor_row, name), s1);
    H5Tinsert(t, "dtype", HOFFSET(tensor_row, dtype), s2);
    H5Tinsert(t, "ndim", HOFFSET(tensor_row, ndim), H5T_STD_I32LE);
    H5Tinsert(t, "shape", HOFFSET(tensor_row, shape), a);
    H5Tinsert(t, "first_piece", HOFFSET(tensor_row, first_piece), H5T_STD_I64LE);
    H5Tinsert(t, "n_pieces", HOFFSET(tensor_row, n_pieces), H5T_STD_I64LE);
    H5Tclose(s1);
    H5Tclose(s2);
    H5Tclose(a);
    return t;
}

hid_t ck_piece_row_type(void)
{
    hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(piece_row));
    hid_t a = arr2(H5T_STD_I64LE);
    H5Tinsert(t, "tensor", HOFFSET(piece_row, tensor), H5T_STD_I32LE);
    H5Tinsert(t, "rank", HOFFSET(piece_row, rank), H5T_STD_I32LE);
    H5Tinsert(t, "offset", HOFFSET(piece_row, offset), a);
    H5Tinsert(t, "count", HOFFSET(piece_row, count), a);
    H5Tinsert(t, "nbytes", HOFFSET(piece_row, nbytes), H5T_STD_I64LE);
    H5Tinsert(t, "xxh64", HOFFSET(piece_row, xxh64), H5T_STD_U64LE);
    H5Tclose(a);
    return t;
}

hid_t ck_file_row_type(void)
{
    hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(file_row));
    hid_t s = str_type(32);
    H5Tinsert(t, "name", HOFFSET(file_row, name), s);
    H5Tinsert(t, "rank", HOFFSET(file_row, rank), H5T_STD_I32LE);
    H5Tinsert(t, "bytes", HOFFSET(file_row, bytes), H5T_STD_I64LE);
    H5Tclose(s);
    return t;
}

static int write_table(hid_t loc, const char *name, hid_t type, const void *rows, size_t n)
{
    hsize_t dims = n, ch = n < 4096 ? (n > 0 ? n : 1) : 4096;
    hid_t sp = H5Screate_simple(1, &dims, NULL), dcpl = H5Pcreate(H5P_DATASET_CREATE), ds = -1;
    int rc = MT_OK;
    if (sp < 0 || dcpl < 0 || H5Pset_chunk(dcpl, 1, &ch) < 0 || H5Pset_fletcher32(dcpl) < 0)
        rc = MT_ERR(MT_EHDF5, "index table %s: cannot set up", name);
    if (rc == MT_OK) ds = H5Dcreate2(loc, name, type, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    if (rc == MT_OK && (ds < 0 || (n && H5Dwrite(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows) < 0)))
        rc = MT_ERR(MT_EIO, "index table %s: cannot write", name);
    if (ds >= 0) H5Dclose(ds);
    if (dcpl >= 0) H5Pclose(dcpl);
    if (sp >= 0) H5Sclose(sp);
    return rc;
}

/* The virtual dataset of tensor t over its pieces. Missing sources read as
 * NaN (e4m3 0x7f, bf16 0x7fc0), not zero, so a gap cannot pass for data. */
static int write_vds(hid_t f, const mt_shard_tensor *t, const piece_row *pr, int n)
{
    const int nd = t->ndim;
    hsize_t dims[2] = {(hsize_t)t->shape[0], (hsize_t)(nd == 1 ? 1 : t->shape[1])};
    hid_t type = ck_h5_type(t->dtype), vs = H5Screate_simple(nd, dims, NULL);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    int rc = MT_OK;
    union {
        float f;
        uint16_t h;
        uint8_t b;
        uint64_t z;
    } fillv = {.z = 0};
    if (t->dtype == MT_DT_F32) fillv.f = NAN;
    if (t->dtype == MT_DT_BF16) fillv.h = 0x7fc0;
    if (t->dtype == MT_DT_E4M3) fillv.b = 0x7f;
    if (type < 0 || vs < 0 || dcpl < 0 || H5Pset_fill_value(dcpl, type, &fillv) < 0) {
        rc = MT_ERR(MT_EHDF5, "index: tensor %s: cannot set up the virtual dataset", t->name);
        goto out;
    }
    for (int i = 0; i < n && rc == MT_OK; i++) {
        hsize_t off[2] = {(hsize_t)pr[i].offset[0], (hsize_t)pr[i].offset[1]};
        hsize_t cnt[2] = {(hsize_t)pr[i].count[0], (hsize_t)pr[i].count[1]};
        char fname[32];
        ck_shard_name(fname, sizeof fname, pr[i].rank);
        hid_t ss = H5Screate_simple(nd, cnt, NULL);
        if (ss < 0 || H5Sselect_hyperslab(vs, H5S_SELECT_SET, off, NULL, cnt, NULL) < 0 ||
            H5Pset_virtual(dcpl, vs, fname, t->name, ss) < 0)
            rc = MT_ERR(MT_EHDF5, "index: tensor %s: cannot map the piece of %s", t->name, fname);
        if (ss >= 0) H5Sclose(ss);
    }
    if (rc == MT_OK) {
        H5Sselect_all(vs);
        hid_t ds = H5Dcreate2(f, t->name, type, vs, H5P_DEFAULT, dcpl, H5P_DEFAULT);
        if (ds < 0) rc = MT_ERR(MT_EHDF5, "index: tensor %s: cannot create the virtual dataset", t->name);
        else H5Dclose(ds);
    }
out:
    if (dcpl >= 0) H5Pclose(dcpl);
    if (vs >= 0) H5Sclose(vs);
    if (type >= 0) H5Tclose(type);
    return rc;
}

/* Shard-map rows of tensor t in the order of recs; checks the tiling. */
static int collect(const mt_shard_map *map, const mt_ckpt_piece_rec *recs, int n, int **order,
                   int **first)
{
    int *cnt = calloc((size_t)map->n_tensors + 1, sizeof *cnt);
    int *ord = malloc((size_t)(n > 0 ? n : 1) * sizeof *ord);
    int *tix = malloc((size_t)(n > 0 ? n : 1) * sizeof *tix);
    if (!cnt || !ord || !tix) {
        free(cnt);
        free(ord);
        free(tix);
        return MT_ERR(MT_ENOMEM, "index: out of memory");
    }
    int rc = MT_OK;
    for (int i = 0; i < n && rc == MT_OK; i++) {
        tix[i] = mt_shard_map_find(map, recs[i].tensor);
        if (tix[i] < 0)
            rc = MT_ERR(MT_EINVAL, "index: piece of unknown tensor %s from rank %d", recs[i].tensor,
                        recs[i].rank);
        else
            cnt[tix[i] + 1]++;
    }
    for (int t = 0; t < map->n_tensors && rc == MT_OK; t++) cnt[t + 1] += cnt[t];
    if (rc == MT_OK) {
        int *fill = malloc((size_t)(map->n_tensors > 0 ? map->n_tensors : 1) * sizeof *fill);
        if (!fill) rc = MT_ERR(MT_ENOMEM, "index: out of memory");
        else {
            memcpy(fill, cnt, (size_t)map->n_tensors * sizeof *fill);
            for (int i = 0; i < n; i++) ord[fill[tix[i]]++] = i;
            free(fill);
        }
    }
    free(tix);
    if (rc < 0) {
        free(cnt);
        free(ord);
        return rc;
    }
    *order = ord;
    *first = cnt;
    return MT_OK;
}

int mt_ckpt_write_index(const char *dir, const mt_ckpt_meta *meta, const mt_shard_map *map,
                        const mt_ckpt_piece_rec *recs, int n)
{
    char path[4200], eb[256];
    snprintf(path, sizeof path, "%s/%s", dir, CK_INDEX);
    int *order = NULL, *first = NULL;
    MT_CHECK(collect(map, recs, n, &order, &first));
    tensor_row *tr = calloc((size_t)map->n_tensors + 1, sizeof *tr);
    piece_row *pr = calloc((size_t)n + 1, sizeof *pr);
    const mt_ckpt_piece_rec **pp = malloc((size_t)(n + 1) * sizeof *pp);
    file_row *fr = NULL;
    int n_files = 0, rc = MT_OK;
    hid_t f = -1, g = -1;
    if (!tr || !pr || !pp) {
        rc = MT_ERR(MT_ENOMEM, "index: out of memory");
        goto out;
    }
    /* tensors and pieces, with the tiling of each tensor checked */
    for (int t = 0; t < map->n_tensors && rc == MT_OK; t++) {
        const mt_shard_tensor *st = &map->tensors[t];
        int k0 = first[t], k1 = first[t + 1];
        for (int k = k0; k < k1; k++) pp[k - k0] = &recs[order[k]];
        char msg[512];
        if (ck_check_tiling(st->ndim, st->shape, pp, k1 - k0, msg, sizeof msg)) {
            rc = MT_ERR(MT_EINVAL, "%s: tensor %s: %s", path, st->name, msg);
            break;
        }
        snprintf(tr[t].name, sizeof tr[t].name, "%s", st->name);
        snprintf(tr[t].dtype, sizeof tr[t].dtype, "%s", mt_dtype_name(st->dtype));
        tr[t].ndim = st->ndim;
        tr[t].shape[0] = st->shape[0];
        tr[t].shape[1] = st->ndim == 1 ? 1 : st->shape[1];
        tr[t].first_piece = k0;
        tr[t].n_pieces = k1 - k0;
        for (int k = k0; k < k1; k++) {
            const mt_ckpt_piece_rec *r = &recs[order[k]];
            pr[k].tensor = t;
            pr[k].rank = r->rank;
            for (int j = 0; j < 2; j++) {
                pr[k].offset[j] = r->off[j];
                pr[k].count[j] = r->count[j];
            }
            pr[k].nbytes = r->nbytes;
            pr[k].xxh64 = r->xxh64;
        }
    }
    if (rc < 0) goto out;
    /* shard files with their sizes now (truncation shows at load) */
    int max_rank = -1;
    for (int i = 0; i < n; i++) max_rank = recs[i].rank > max_rank ? recs[i].rank : max_rank;
    char *seen = calloc((size_t)max_rank + 2, 1);
    fr = calloc((size_t)max_rank + 2, sizeof *fr);
    if (!seen || !fr) {
        free(seen);
        rc = MT_ERR(MT_ENOMEM, "index: out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) seen[recs[i].rank] = 1;
    for (int r = 0; r <= max_rank && rc == MT_OK; r++) {
        if (!seen[r]) continue;
        file_row *x = &fr[n_files++];
        ck_shard_name(x->name, sizeof x->name, r);
        x->rank = r;
        char sp[4300];
        snprintf(sp, sizeof sp, "%s/%s", dir, x->name);
        struct stat st;
        if (stat(sp, &st) != 0) rc = MT_ERR(MT_EIO, "%s: missing: %s", sp, strerror(errno));
        x->bytes = (int64_t)st.st_size;
    }
    free(seen);
    if (rc < 0) goto out;

    ck_lock();
    f = create_file(path, CK_INDEX_USERBLOCK);
    if (f < 0) {
        rc = MT_ERR(MT_EIO, "%s: cannot create (%s)", path, ck_h5_errstr(eb, sizeof eb));
        goto unlock;
    }
    int64_t ver = MT_CKPT_FORMAT_VERSION;
    char *lj = ck_layout_json(&meta->layout), *oj = ck_opts_json(&meta->opts);
    int64_t pos[3] = {meta->step, meta->consumed_samples, meta->consumed_tokens};
    if (!lj || !oj) rc = MT_ERR(MT_ENOMEM, "index: out of memory");
    if (rc == MT_OK) rc = ck_attr_str(f, "format", MT_CKPT_FORMAT);
    if (rc == MT_OK) rc = ck_attr_i64(f, "format_version", &ver, 1);
    if (rc == MT_OK) rc = ck_attr_i64(f, "step", &meta->step, 1);
    if (rc == MT_OK) {
        g = H5Gcreate2(f, CK_META_GROUP, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        if (g < 0) rc = MT_ERR(MT_EHDF5, "%s: cannot create group %s", path, CK_META_GROUP);
    }
    if (rc == MT_OK) rc = ck_attr_i64(g, "step_samples_tokens", pos, 3);
    if (rc == MT_OK) rc = ck_write_string(g, "config", meta->config_json ? meta->config_json : "{}");
    if (rc == MT_OK) rc = ck_write_string(g, "job", meta->job_json ? meta->job_json : "null");
    if (rc == MT_OK) rc = ck_write_string(g, "state", meta->state_json ? meta->state_json : "{}");
    if (rc == MT_OK) rc = ck_write_string(g, "layout", lj);
    if (rc == MT_OK) rc = ck_write_string(g, "contents", oj);
    free(lj);
    free(oj);
    hid_t tt = ck_tensor_row_type(), pt = ck_piece_row_type(), ft = ck_file_row_type();
    if (rc == MT_OK) rc = write_table(g, "tensors", tt, tr, (size_t)map->n_tensors);
    if (rc == MT_OK) rc = write_table(g, "pieces", pt, pr, (size_t)n);
    if (rc == MT_OK) rc = write_table(g, "files", ft, fr, (size_t)n_files);
    H5Tclose(tt);
    H5Tclose(pt);
    H5Tclose(ft);
    for (int t = 0; t < map->n_tensors && rc == MT_OK; t++)
        rc = write_vds(f, &map->tensors[t], pr + tr[t].first_piece, (int)tr[t].n_pieces);
    if (g >= 0) H5Gclose(g);
    if (H5Fclose(f) < 0 && rc == MT_OK)
        rc = MT_ERR(MT_EIO, "%s: close failed (%s)", path, ck_h5_errstr(eb, sizeof eb));
    f = -1;
unlock:
    ck_unlock();
    if (rc == MT_OK) rc = ck_index_seal(path);
    if (rc == MT_OK) rc = mt_fsync_path(path);
out:
    free(order);
    free(first);
    free(tr);
    free(pr);
    free((void *)pp);
    free(fr);
    return rc;
}
