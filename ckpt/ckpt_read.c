/* ckpt_read.c - opening a checkpoint and reading hyperslabs of global
 * tensors; conversions shared by every tensor source. */
#define _GNU_SOURCE /* O_DIRECT */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "ckpt/ckpt_internal.h"
#include "ckpt/xxh64.h"
#include "kernels/mt_fp8.h"
#include "base/mt_clock.h"
#include "base/mt_log.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"

int mt_ckpt_find(const mt_ckpt *ck, const char *name)
{
    size_t h = (size_t)mt_hash_str(name) & (size_t)(ck->hash_cap - 1);
    while (ck->hash[h]) {
        if (!strcmp(ck->tensors[ck->hash[h] - 1].name, name)) return ck->hash[h] - 1;
        h = (h + 1) & (size_t)(ck->hash_cap - 1);
    }
    return -1;
}

const char *mt_ckpt_dir(const mt_ckpt *ck) { return ck->dir; }
const mt_ckpt_meta *mt_ckpt_get_meta(const mt_ckpt *ck) { return &ck->meta; }
int mt_ckpt_n_tensors(const mt_ckpt *ck) { return ck->n_tensors; }
const mt_ckpt_tensor *mt_ckpt_tensor_at(const mt_ckpt *ck, int i) { return &ck->tensors[i]; }
int mt_ckpt_n_pieces(const mt_ckpt *ck) { return ck->n_pieces; }
const mt_ckpt_piece_rec *mt_ckpt_piece_at(const mt_ckpt *ck, int i) { return &ck->pieces[i]; }

int64_t mt_ckpt_bytes(const mt_ckpt *ck)
{
    int64_t n = 0;
    for (int i = 0; i < ck->n_pieces; i++) n += ck->pieces[i].nbytes;
    return n;
}

int ck_file_index(const mt_ckpt *ck, int rank)
{
    for (int i = 0; i < ck->n_files; i++)
        if (ck->file_rank[i] == rank) return i;
    return -1;
}

static void pf_stop(mt_ckpt *ck);

void mt_ckpt_close(mt_ckpt *ck)
{
    if (!ck) return;
    pf_stop(ck);
    ck_lock();
    for (int i = 0; i < ck->n_files; i++) {
        if (ck->file_h && ck->file_h[i] >= 0) H5Fclose(ck->file_h[i]);
        if (ck->file_fd && ck->file_fd[i] >= 0) close(ck->file_fd[i]);
        if (ck->file_dfd && ck->file_dfd[i] >= 0) close(ck->file_dfd[i]);
    }
    ck_unlock();
    if (ck->lock_fd >= 0) close(ck->lock_fd); /* releases the shared lock */
    mt_ckpt_meta_free(&ck->meta);
    free(ck->tensors);
    free(ck->pieces);
    free(ck->file_rank);
    free(ck->file_bytes);
    free(ck->file_h);
    free(ck->file_fd);
    free(ck->file_dfd);
    free(ck->file_base);
    free(ck->piece_file);
    free(ck->hash);
    free(ck->skip);
    for (int i = 0; i < ck->n_bufs; i++) free(ck->bufs[i]);
    free(ck->bufs);
    free(ck);
}

/* Reads a compound table of the index into rows (malloc'd). */
static int read_table(hid_t g, const char *path, const char *name, hid_t type, size_t row,
                      void **rows, int *n)
{
    char eb[256];
    hid_t ds = H5Dopen2(g, name, H5P_DEFAULT);
    if (ds < 0)
        return MT_ERR(MT_ECORRUPT, "%s: table %s missing (%s)", path, name, ck_h5_errstr(eb, sizeof eb));
    hid_t sp = H5Dget_space(ds);
    hssize_t np = H5Sget_simple_extent_npoints(sp);
    H5Sclose(sp);
    void *buf = calloc((size_t)(np > 0 ? np : 1), row);
    int rc = MT_OK;
    if (!buf) rc = MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    else if (np > 0 && H5Dread(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) < 0)
        rc = MT_ERR(MT_ECORRUPT, "%s: table %s unreadable (%s)", path, name,
                    ck_h5_errstr(eb, sizeof eb));
    H5Dclose(ds);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    *rows = buf;
    *n = (int)np;
    return MT_OK;
}

/* Piece i's row of the chunks table, checked: chunks of whole rows, each
 * inside its file as the files table sizes it, none overlapping. */
static int chunks_of_row(mt_ckpt *ck, int i, const chunk_row *c, const char *path)
{
    mt_ckpt_piece_rec *r = &ck->pieces[i];
    const int64_t fb = ck->file_bytes[ck->piece_file[i]];
    int ok = c->rows >= 1 && c->rows <= r->count[0] && c->addr >= 0 && c->stride >= 0 && c->stride <= fb;
    if (ok) {
        const int64_t n = (r->count[0] + c->rows - 1) / c->rows;
        const int64_t cb = r->nbytes / r->count[0] * c->rows + 4; /* stored, with its checksum */
        ok = c->stride >= cb && c->addr <= fb && (fb - c->addr - cb) / c->stride >= n - 1 &&
             fb - c->addr >= cb;
    }
    if (!ok)
        return MT_ERR(MT_ECORRUPT,
                      "%s: tensor %s: piece %d: chunks table row (%lld rows, at %lld, every %lld "
                      "bytes) does not fit the piece and its file",
                      path, r->tensor, i, (long long)c->rows, (long long)c->addr, (long long)c->stride);
    r->chunk_rows = c->rows;
    r->chunk_addr = c->addr;
    r->chunk_stride = c->stride;
    return MT_OK;
}

/* Reads and checks index.h5 into ck (the lock is held). */
static int read_index(mt_ckpt *ck)
{
    char path[4200], eb[256], fmt[64];
    snprintf(path, sizeof path, "%s/%s", ck->dir, CK_INDEX);
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0)
        return MT_ERR(MT_ECORRUPT, "%s: cannot open (%s)", path, ck_h5_errstr(eb, sizeof eb));
    int rc = MT_OK;
    hid_t g = -1, tt = ck_tensor_row_type(), pt = ck_piece_row_type(), ft = ck_file_row_type(),
          ct = ck_chunk_row_type();
    tensor_row *tr = NULL;
    piece_row *pr = NULL;
    file_row *fr = NULL;
    chunk_row *cr = NULL;
    int nt = 0, np = 0, nf = 0, nc = 0;
    int64_t ver = 0;
    if (ck_attr_read_str(f, "format", fmt, sizeof fmt) < 0 || strcmp(fmt, MT_CKPT_FORMAT) != 0) {
        rc = MT_ERR(MT_ECORRUPT, "%s: not a moetrain checkpoint index (format attribute)", path);
        goto out;
    }
    if (ck_attr_read_i64(f, "format_version", &ver, 1) < 0 || ver < 1) {
        rc = MT_ERR(MT_ECORRUPT, "%s: format_version missing", path);
        goto out;
    }
    if (ver > MT_CKPT_FORMAT_VERSION) {
        rc = MT_ERR(MT_ENOTSUP, "%s: format version %lld is newer than this build reads (%d)",
                    path, (long long)ver, MT_CKPT_FORMAT_VERSION);
        goto out;
    }
    g = H5Gopen2(f, CK_META_GROUP, H5P_DEFAULT);
    if (g < 0) {
        rc = MT_ERR(MT_ECORRUPT, "%s: group %s missing", path, CK_META_GROUP);
        goto out;
    }
    int64_t pos[3];
    char *lj = NULL, *oj = NULL;
    if ((rc = ck_attr_read_i64(g, "step_samples_tokens", pos, 3)) < 0 ||
        (rc = ck_read_string(g, "config", &ck->meta.config_json)) < 0 ||
        (rc = ck_read_string(g, "job", &ck->meta.job_json)) < 0 ||
        (rc = ck_read_string(g, "state", &ck->meta.state_json)) < 0 ||
        (rc = ck_read_string(g, "layout", &lj)) < 0 || (rc = ck_read_string(g, "contents", &oj)) < 0) {
        free(lj);
        rc = mt_err_wrap(MT_ECORRUPT, "%s", path);
        goto out;
    }
    ck->meta.step = pos[0];
    ck->meta.consumed_samples = pos[1];
    ck->meta.consumed_tokens = pos[2];
    rc = ck_layout_from_json(lj, &ck->meta.layout);
    if (rc == MT_OK) rc = ck_opts_from_json(oj, &ck->meta.opts);
    free(lj);
    free(oj);
    if (rc < 0) {
        rc = mt_err_wrap(MT_ECORRUPT, "%s", path);
        goto out;
    }
    if ((rc = read_table(g, path, "tensors", tt, sizeof *tr, (void **)&tr, &nt)) < 0 ||
        (rc = read_table(g, path, "pieces", pt, sizeof *pr, (void **)&pr, &np)) < 0 ||
        (rc = read_table(g, path, "files", ft, sizeof *fr, (void **)&fr, &nf)) < 0)
        goto out;
    /* the pieces' chunk addresses: indexes written before them have none;
     * MT_CKPT_INDEX_CHUNKS=0 leaves them unread (found through HDF5, as
     * before the table: for measurements) */
    const char *ic = getenv("MT_CKPT_INDEX_CHUNKS");
    if (!(ic && !strcmp(ic, "0")) && H5Lexists(g, "chunks", H5P_DEFAULT) > 0 &&
        ((rc = read_table(g, path, "chunks", ct, sizeof *cr, (void **)&cr, &nc)) < 0 ||
         (nc != np && (rc = MT_ERR(MT_ECORRUPT, "%s: chunks table has %d rows for %d pieces", path, nc,
                                   np)) < 0)))
        goto out;
    ck->n_tensors = nt;
    ck->n_pieces = np;
    ck->n_files = nf;
    ck->tensors = calloc((size_t)nt + 1, sizeof *ck->tensors);
    ck->pieces = calloc((size_t)np + 1, sizeof *ck->pieces);
    ck->piece_file = calloc((size_t)np + 1, sizeof *ck->piece_file);
    ck->file_rank = calloc((size_t)nf + 1, sizeof *ck->file_rank);
    ck->file_bytes = calloc((size_t)nf + 1, sizeof *ck->file_bytes);
    ck->file_h = malloc(((size_t)nf + 1) * sizeof *ck->file_h);
    ck->file_fd = malloc(((size_t)nf + 1) * sizeof *ck->file_fd);
    ck->file_dfd = malloc(((size_t)nf + 1) * sizeof *ck->file_dfd);
    ck->file_base = calloc((size_t)nf + 1, sizeof *ck->file_base);
    ck->pf = calloc((size_t)np + 1, sizeof *ck->pf);
    ck->pf_cursor = calloc((size_t)nf + 1, sizeof *ck->pf_cursor);
    ck->pf_low = calloc((size_t)nf + 1, sizeof *ck->pf_low);
    ck->hash_cap = 16;
    while (ck->hash_cap < 2 * nt) ck->hash_cap *= 2;
    ck->hash = calloc((size_t)ck->hash_cap, sizeof *ck->hash);
    if (!ck->tensors || !ck->pieces || !ck->piece_file || !ck->file_rank || !ck->file_bytes ||
        !ck->file_h || !ck->file_fd || !ck->file_dfd || !ck->file_base || !ck->pf || !ck->pf_cursor || !ck->pf_low || !ck->hash) {
        rc = MT_ERR(MT_ENOMEM, "%s: out of memory", path);
        goto out;
    }
    for (int i = 0; i < nf; i++) {
        ck->file_rank[i] = fr[i].rank;
        ck->file_bytes[i] = fr[i].bytes;
        ck->file_h[i] = -1;
        ck->file_fd[i] = -1;
        ck->file_dfd[i] = -1;
        char want[32];
        ck_shard_name(want, sizeof want, fr[i].rank);
        if (strcmp(want, fr[i].name) != 0 || ck_file_index(ck, fr[i].rank) != i) {
            rc = MT_ERR(MT_ECORRUPT, "%s: files table: entry %d (%s, rank %d) is inconsistent", path,
                        i, fr[i].name, fr[i].rank);
            goto out;
        }
    }
    for (int t = 0; t < nt; t++) {
        mt_ckpt_tensor *x = &ck->tensors[t];
        snprintf(x->name, sizeof x->name, "%s", tr[t].name);
        int dt = mt_dtype_parse(tr[t].dtype);
        x->dtype = dt >= 0 ? (mt_dtype)dt : MT_DT_U8;
        x->ndim = tr[t].ndim;
        x->shape[0] = tr[t].shape[0];
        x->shape[1] = tr[t].shape[1];
        x->first_piece = (int)tr[t].first_piece;
        x->n_pieces = (int)tr[t].n_pieces;
        if (dt < 0 || x->ndim < 1 || x->ndim > 2 || x->shape[0] <= 0 || x->shape[1] <= 0 ||
            (x->ndim == 1 && x->shape[1] != 1) || tr[t].first_piece < 0 || tr[t].n_pieces < 1 ||
            tr[t].first_piece + tr[t].n_pieces > np) {
            rc = MT_ERR(MT_ECORRUPT,
                        "%s: tensor %s: inconsistent table row (dtype %s, ndim %d, shape [%lld, "
                        "%lld], pieces %lld + %lld of %d)",
                        path, x->name, tr[t].dtype, x->ndim, (long long)x->shape[0],
                        (long long)x->shape[1], (long long)tr[t].first_piece,
                        (long long)tr[t].n_pieces, np);
            goto out;
        }
        size_t h = (size_t)mt_hash_str(x->name) & (size_t)(ck->hash_cap - 1);
        while (ck->hash[h]) {
            if (!strcmp(ck->tensors[ck->hash[h] - 1].name, x->name)) {
                rc = MT_ERR(MT_ECORRUPT, "%s: tensor %s listed twice", path, x->name);
                goto out;
            }
            h = (h + 1) & (size_t)(ck->hash_cap - 1);
        }
        ck->hash[h] = t + 1;
    }
    for (int i = 0; i < np; i++) {
        mt_ckpt_piece_rec *r = &ck->pieces[i];
        if (pr[i].tensor < 0 || pr[i].tensor >= nt) {
            rc = MT_ERR(MT_ECORRUPT, "%s: piece %d refers to tensor %d of %d", path, i, pr[i].tensor, nt);
            goto out;
        }
        const mt_ckpt_tensor *x = &ck->tensors[pr[i].tensor];
        snprintf(r->tensor, sizeof r->tensor, "%s", x->name);
        r->rank = pr[i].rank;
        for (int k = 0; k < 2; k++) {
            r->off[k] = pr[i].offset[k];
            r->count[k] = pr[i].count[k];
        }
        r->nbytes = pr[i].nbytes;
        r->xxh64 = pr[i].xxh64;
        ck->piece_file[i] = ck_file_index(ck, r->rank);
        if (i < x->first_piece || i >= x->first_piece + x->n_pieces || ck->piece_file[i] < 0 ||
            r->nbytes != r->count[0] * r->count[1] * (int64_t)mt_dtype_size(x->dtype)) {
            rc = MT_ERR(MT_ECORRUPT,
                        "%s: tensor %s: piece %d (rank %d, %lld bytes) is inconsistent with the "
                        "tensor and file tables",
                        path, x->name, i, r->rank, (long long)r->nbytes);
            goto out;
        }
        if (cr && cr[i].rows != 0 && (rc = chunks_of_row(ck, i, &cr[i], path)) < 0) goto out;
    }
    /* coverage: every tensor tiled exactly by its pieces */
    for (int t = 0; t < nt && rc == MT_OK; t++) {
        const mt_ckpt_tensor *x = &ck->tensors[t];
        const mt_ckpt_piece_rec **pp = malloc((size_t)x->n_pieces * sizeof *pp);
        if (!pp) {
            rc = MT_ERR(MT_ENOMEM, "out of memory");
            break;
        }
        for (int k = 0; k < x->n_pieces; k++) pp[k] = &ck->pieces[x->first_piece + k];
        char msg[512];
        if (ck_check_tiling(x->ndim, x->shape, pp, x->n_pieces, msg, sizeof msg))
            rc = MT_ERR(MT_ECORRUPT, "%s: tensor %s: %s", path, x->name, msg);
        free((void *)pp);
    }
out:
    free(tr);
    free(pr);
    free(fr);
    free(cr);
    H5Tclose(tt);
    H5Tclose(pt);
    H5Tclose(ft);
    H5Tclose(ct);
    if (g >= 0) H5Gclose(g);
    H5Fclose(f);
    return rc;
}

int ck_read_index_locked(mt_ckpt *ck)
{
    ck_lock();
    int rc = read_index(ck);
    ck_unlock();
    return rc;
}

/* The first tensor with a piece in file i (for messages). */
static const char *first_tensor_of_file(const mt_ckpt *ck, int fi, int *count)
{
    const char *first = "(none)";
    int n = 0;
    for (int p = 0; p < ck->n_pieces; p++)
        if (ck->piece_file[p] == fi) {
            if (!n) first = ck->pieces[p].tensor;
            n++;
        }
    *count = n;
    return first;
}

/* Every shard file present with its recorded size. */
static int check_files(const mt_ckpt *ck)
{
    for (int i = 0; i < ck->n_files; i++) {
        char name[32], p[4300];
        ck_shard_name(name, sizeof name, ck->file_rank[i]);
        snprintf(p, sizeof p, "%s/%s", ck->dir, name);
        int n;
        const char *t = first_tensor_of_file(ck, i, &n);
        struct stat st;
        if (stat(p, &st) != 0)
            return MT_ERR(MT_ECORRUPT, "%s: missing shard file, holds tensor %s (and %d more pieces)",
                          p, t, n - 1);
        if ((int64_t)st.st_size != ck->file_bytes[i])
            return MT_ERR(MT_ECORRUPT,
                          "%s: %lld bytes, the index records %lld: truncated or replaced; holds "
                          "tensor %s (and %d more pieces)",
                          p, (long long)st.st_size, (long long)ck->file_bytes[i], t, n - 1);
    }
    return MT_OK;
}

/* Our own descriptors of piece p's file (its chunks' preads), opened on
 * first use (HDF5 lock held: the reader and the read-ahead's thread). */
static int piece_fd(mt_ckpt *ck, int p)
{
    const int fi = ck->piece_file[p];
    if (ck->file_fd[fi] >= 0) return MT_OK;
    char name[32], path[4300];
    ck_shard_name(name, sizeof name, ck->file_rank[fi]);
    snprintf(path, sizeof path, "%s/%s", ck->dir, name);
    ck->file_fd[fi] = open(path, O_RDONLY | O_CLOEXEC);
    if (ck->file_fd[fi] < 0)
        return MT_ERR(MT_EIO, "%s: cannot open: %s, needed for tensor %s", path, strerror(errno),
                      ck->pieces[p].tensor);
    if (ck_io_direct_read()) {
        ck->file_dfd[fi] = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
        if (ck->file_dfd[fi] < 0) ck_io_direct_refused(path, "reads", errno);
    }
    return MT_OK;
}

int ck_piece_file(mt_ckpt *ck, int p, hid_t *out)
{
    int fi = ck->piece_file[p];
    if (ck->file_h[fi] < 0) {
        char name[32], path[4300], eb[256];
        ck_shard_name(name, sizeof name, ck->file_rank[fi]);
        snprintf(path, sizeof path, "%s/%s", ck->dir, name);
        hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
        if (f < 0)
            return MT_ERR(MT_ECORRUPT, "%s: cannot open (%s), needed for tensor %s", path,
                          ck_h5_errstr(eb, sizeof eb), ck->pieces[p].tensor);
        ck->file_h[fi] = f;
        /* chunk addresses are relative to the end of the user block */
        hid_t fcpl = H5Fget_create_plist(f);
        hsize_t ub = 0;
        if (fcpl >= 0) {
            H5Pget_userblock(fcpl, &ub);
            H5Pclose(fcpl);
        }
        ck->file_base[fi] = (int64_t)ub;
    }
    MT_CHECK(piece_fd(ck, p));
    *out = ck->file_h[fi];
    return MT_OK;
}

/* The descriptors for piece p's chunks whose offsets the index records:
 * the file opened without HDF5 (takes the lock). */
static int piece_fd_locked(mt_ckpt *ck, int p)
{
    ck_lock();
    const int rc = piece_fd(ck, p);
    ck_unlock();
    return rc;
}

/* Locks dir shared and checks it is still the directory at that path
 * (retention renames before it deletes). 1 ok, 0 gone. */
static int lock_dir(mt_ckpt *ck)
{
    int fd = open(ck->dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return 0;
    if (flock(fd, LOCK_SH) != 0) {
        close(fd);
        return 0;
    }
    struct stat a, b;
    if (fstat(fd, &a) != 0 || stat(ck->dir, &b) != 0 || a.st_ino != b.st_ino || a.st_dev != b.st_dev) {
        close(fd);
        return 0;
    }
    ck->lock_fd = fd;
    return 1;
}

int mt_ckpt_open(mt_ckpt **out, const char *path)
{
    *out = NULL;
    mt_ckpt *ck = calloc(1, sizeof *ck);
    if (!ck) return MT_ERR(MT_ENOMEM, "out of memory");
    ck->lock_fd = -1;
    ck->reader_rank = -1;
    int rc = MT_OK;
    for (int attempt = 0;; attempt++) {
        if ((rc = mt_ckpt_resolve(path, ck->dir, sizeof ck->dir)) < 0) goto fail;
        if (lock_dir(ck)) break;
        if (attempt == 3) {
            rc = MT_ERR(MT_EIO, "%s: checkpoint removed while opening", ck->dir);
            goto fail;
        }
    }
    char ipath[4200], why[256];
    snprintf(ipath, sizeof ipath, "%s/%s", ck->dir, CK_INDEX);
    int seal = ck_index_check(ipath, why, sizeof why);
    ck_lock();
    rc = read_index(ck);
    ck_unlock();
    /* a damage the index's own checks name (table, tensor) is the better message */
    if (rc < 0) goto fail;
    if (seal == -1) {
        rc = MT_ERR(MT_ECORRUPT,
                    "%s: %s; the checkpoint is refused (moetrain-ckpt verify lists what differs)",
                    ipath, why);
        goto fail;
    }
    if (seal < 0) {
        rc = seal;
        goto fail;
    }
    if (seal == 1)
        MT_LOGW("checkpoint: %s has no seal (written by an older moetrain): its contents are "
                "checked, not its bytes",
                ipath);
    if ((rc = check_files(ck)) < 0) goto fail;
    /* open every shard now: a damaged superblock shows here, naming a tensor */
    ck_lock();
    for (int p = 0; p < ck->n_pieces && rc == MT_OK; p++) {
        hid_t f;
        rc = ck_piece_file(ck, p, &f);
    }
    ck_unlock();
    if (rc < 0) goto fail;
    *out = ck;
    return MT_OK;
fail:
    mt_ckpt_close(ck);
    return rc;
}

void mt_ckpt_set_reader_rank(mt_ckpt *ck, int rank) { ck->reader_rank = rank; }

/* ---- raw reads ---------------------------------------------------------------------- */

/* Stored chunks of at least this many bytes are read with O_DIRECT (when
 * on, from the reader's own shard): the kernel's copy out of the page
 * cache is saved, the request goes to the disk whole. Smaller ones are
 * left to the page cache and its read-ahead. */
#define CK_DIRECT_READ_MIN ((size_t)1 << 20)

/* Bytes of a buffer for one stored chunk of n bytes (ck_chunk_pread: whole
 * blocks around it); allocate it CK_DIRECT_ALIGN-aligned. */
static size_t chunk_buf_bytes(size_t n) { return n + 2 * CK_DIRECT_ALIGN; }

char *ck_chunk_buf_alloc(size_t n)
{
    void *b = NULL;
    return posix_memalign(&b, CK_DIRECT_ALIGN, chunk_buf_bytes(n)) == 0 ? b : NULL;
}

/* Whether stored chunks of n bytes in file fi are read with O_DIRECT. */
static int chunk_direct(const mt_ckpt *ck, int fi, size_t n)
{
    return ck->file_dfd[fi] >= 0 && n >= CK_DIRECT_READ_MIN &&
           (ck->reader_rank < 0 || ck->file_rank[fi] == ck->reader_rank);
}

/* Reads the n stored bytes at offset addr of file fi into buf (of
 * chunk_buf_bytes(n), aligned): where they start in buf, or NULL with
 * *err = errno (0: the file ends before them). O_DIRECT reads whole blocks
 * around them; a refusal or a short read is retried through the page
 * cache, which then gives the error. */
char *ck_chunk_pread(const mt_ckpt *ck, int fi, char *buf, size_t n, int64_t addr, int *err)
{
    const int dfd = ck->file_dfd[fi];
    if (chunk_direct(ck, fi, n)) {
        const int64_t a0 = addr - addr % CK_DIRECT_ALIGN;
        const size_t lead = (size_t)(addr - a0), need = lead + n;
        const size_t len = (need + CK_DIRECT_ALIGN - 1) / CK_DIRECT_ALIGN * CK_DIRECT_ALIGN;
        size_t got = 0;
        ssize_t k = 0;
        while (got < need) {
            k = pread(dfd, buf + got, len - got, (off_t)(a0 + (int64_t)got));
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) break;
            got += (size_t)k;
            if (got % CK_DIRECT_ALIGN) break; /* the end of the file */
        }
        if (got >= need) return buf + lead;
        if (k < 0 && errno == EINVAL) {
            char name[32];
            ck_shard_name(name, sizeof name, ck->file_rank[fi]);
            ck_io_direct_refused(name, "reads", errno);
        }
    }
    size_t got = 0;
    while (got < n) {
        ssize_t k = pread(ck->file_fd[fi], buf + got, n - got, (off_t)(addr + (int64_t)got));
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            *err = k < 0 ? errno : 0;
            return NULL;
        }
        got += (size_t)k;
    }
    return buf;
}

/* A stored chunk as read (buf: NULL if unreadable, err its errno or 0 for
 * a file that ends before it; cb bytes of data, then their Fletcher32
 * little-endian) checked: MT_OK, or MT_EIO / MT_ECORRUPT with the problem
 * in msg, naming the file, the tensor and the chunk's first row. */
/* ck_chunk_check with the stored checksum's 4 bytes at tail. */
static int chunk_check_tail(const char *buf, const uint8_t *t, int err, size_t cb, const char *path,
                            const char *tensor, int64_t row, char *msg, size_t cap)
{
    if (!buf) {
        snprintf(msg, cap, "%s: tensor %s: chunk at row %lld unreadable: %s", path, tensor,
                 (long long)row, err ? strerror(err) : "the file ends before it: truncated");
        return err ? MT_EIO : MT_ECORRUPT;
    }
    uint32_t want = (uint32_t)t[0] | (uint32_t)t[1] << 8 | (uint32_t)t[2] << 16 | (uint32_t)t[3] << 24;
    if (ck_fletcher32(buf, cb) != want) {
        snprintf(msg, cap, "%s: tensor %s: chunk at row %lld fails its Fletcher32 checksum: data corrupted",
                 path, tensor, (long long)row);
        return MT_ECORRUPT;
    }
    return MT_OK;
}

int ck_chunk_check(const char *buf, int err, size_t cb, const char *path, const char *tensor,
                   int64_t row, char *msg, size_t cap)
{
    return chunk_check_tail(buf, buf ? (const uint8_t *)buf + cb : NULL, err, cb, path, tensor, row, msg,
                            cap);
}

void ck_piece_hash_msg(char *msg, size_t cap, const char *path, const mt_ckpt_piece_rec *r,
                       uint64_t got)
{
    snprintf(msg, cap,
             "%s: tensor %s: piece [%lld:%lld, %lld:%lld] xxh64 %016llx, the index records %016llx: "
             "data corrupted",
             path, r->tensor, (long long)r->off[0], (long long)(r->off[0] + r->count[0]),
             (long long)r->off[1], (long long)(r->off[1] + r->count[1]), (unsigned long long)got,
             (unsigned long long)r->xxh64);
}

/* Rows per chunk when a shard dataset can be read chunk by chunk with our
 * own Fletcher32 check: chunked, full-width chunks, exactly the Fletcher32
 * filter (how moetrain writes them); 0 otherwise (read through HDF5). */
static int64_t direct_chunk_rows(hid_t ds, int nd, int64_t cols)
{
    hid_t dcpl = H5Dget_create_plist(ds);
    int64_t cr = 0;
    hsize_t ch[2] = {0, 0};
    unsigned flags;
    size_t nelem = 0;
    unsigned cd[4];
    char nm[64];
    unsigned conf;
    if (dcpl >= 0 && H5Pget_layout(dcpl) == H5D_CHUNKED && H5Pget_chunk(dcpl, 2, ch) == nd &&
        H5Pget_nfilters(dcpl) == 1 &&
        H5Pget_filter2(dcpl, 0, &flags, &nelem, cd, sizeof nm, nm, &conf) == H5Z_FILTER_FLETCHER32 &&
        (nd == 1 || (int64_t)ch[1] == cols))
        cr = (int64_t)ch[0];
    if (dcpl >= 0) H5Pclose(dcpl);
    return cr;
}

/* Parallel chunk reads of one piece: the chunks' file addresses come from
 * HDF5 (its lock held), their bytes by pread on our own descriptor in the
 * pool's workers, which check each chunk's Fletcher32 and copy its rows
 * into the destination; the caller hashes the rows in order (a piece read
 * whole) while later chunks are still in flight. */
typedef struct rchunk {
    struct rpipe *p;
    int64_t c;             /* chunk index in the piece */
    int64_t addr;          /* file offset of the stored chunk */
    char *buf;
    int done, rc;
    char msg[512];
} rchunk;

typedef struct rpipe {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    const mt_ckpt *ck;
    int fi;                /* file index */
    const char *path;
    const mt_ckpt_piece_rec *r;
    size_t es, cb;         /* element bytes; chunk bytes without the checksum */
    int64_t cr, cols;      /* rows per chunk; columns of the piece */
    int64_t r0, r1;        /* rows of the piece read */
    hsize_t c0, nc;        /* columns of the piece read */
    char *dst;
    hsize_t mo[2];
    size_t ldd;
} rpipe;

static void read_task(void *arg)
{
    rchunk *k = arg;
    rpipe *p = k->p;
    int err = 0;
    const char *buf = ck_chunk_pread(p->ck, p->fi, k->buf, p->cb + 4, k->addr, &err);
    int rc = ck_chunk_check(buf, err, p->cb, p->path, p->r->tensor, k->c * p->cr, k->msg, sizeof k->msg);
    if (rc == MT_OK) {
        const int64_t a = k->c * p->cr > p->r0 ? k->c * p->cr : p->r0;
        const int64_t b = (k->c + 1) * p->cr < p->r1 ? (k->c + 1) * p->cr : p->r1;
        const size_t row = (size_t)p->nc * p->es;
        if (p->c0 == 0 && (int64_t)p->nc == p->cols && p->ldd == p->nc) {
            memcpy(p->dst + ((size_t)(p->mo[0] + (hsize_t)(a - p->r0)) * p->ldd + p->mo[1]) * p->es,
                   buf + (size_t)(a - k->c * p->cr) * row, (size_t)(b - a) * row);
        } else {
            for (int64_t i = a; i < b; i++)
                memcpy(p->dst + (((size_t)(p->mo[0] + (hsize_t)(i - p->r0))) * p->ldd + p->mo[1]) * p->es,
                       buf + ((size_t)(i - k->c * p->cr) * (size_t)p->cols + p->c0) * p->es, row);
        }
    }
    pthread_mutex_lock(&p->mu);
    k->rc = rc;
    k->done = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* At least n raw chunk buffers of `bytes` in ck. */
static int ensure_bufs(mt_ckpt *ck, int n, size_t bytes, const char *path)
{
    if (ck->buf_cap < bytes) {
        for (int i = 0; i < ck->n_bufs; i++) free(ck->bufs[i]);
        free(ck->bufs);
        ck->bufs = NULL;
        ck->n_bufs = 0;
        ck->buf_cap = bytes;
    }
    if (ck->n_bufs >= n) return MT_OK;
    char **b = realloc(ck->bufs, (size_t)n * sizeof *b);
    if (!b) return MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    ck->bufs = b;
    for (; ck->n_bufs < n; ck->n_bufs++)
        if (!(ck->bufs[ck->n_bufs] = ck_chunk_buf_alloc(ck->buf_cap)))
            return MT_ERR(MT_ENOMEM, "%s: out of memory for chunk buffers of %zu bytes", path, bytes);
    return MT_OK;
}

/* Chunk addresses of rows [r0, r1) of a direct-read dataset (lock held);
 * each must be stored whole with its checksum, unfiltered by HDF5. */
static int chunk_addrs(hid_t ds, const char *path, const mt_ckpt_piece_rec *r, int64_t cr,
                       size_t cb, int64_t base, int64_t r0, int64_t r1, int64_t *addr)
{
    char eb[256];
    for (int64_t c = r0 / cr, k = 0; c * cr < r1; c++, k++) {
        hsize_t off[2] = {(hsize_t)(c * cr), 0}, size = 0;
        haddr_t a = HADDR_UNDEF;
        unsigned mask = 0;
        if (H5Dget_chunk_info_by_coord(ds, off, &mask, &a, &size) < 0 || a == HADDR_UNDEF)
            return MT_ERR(MT_ECORRUPT, "%s: tensor %s: chunk at row %lld missing (%s): the file is damaged",
                          path, r->tensor, (long long)(c * cr), ck_h5_errstr(eb, sizeof eb));
        if (size != cb + 4 || mask != 0)
            return MT_ERR(MT_ECORRUPT, "%s: tensor %s: chunk at row %lld is %llu bytes, not %zu: "
                                       "the file is damaged",
                          path, r->tensor, (long long)(c * cr), (unsigned long long)size, cb + 4);
        addr[k] = base + (int64_t)a;
    }
    return MT_OK;
}

/* Offsets of the stored chunks first .. first + n - 1 of a piece whose
 * chunks the index records (chunk_rows > 0). */
static void index_chunk_addrs(const mt_ckpt_piece_rec *r, int64_t first, int64_t n, int64_t *addr)
{
    for (int64_t k = 0; k < n; k++) addr[k] = r->chunk_addr + (first + k) * r->chunk_stride;
}

/* Reads rows fo[0] .. + cnt[0], columns fo[1] .. + cnt[1] of a piece
 * (chunk addresses addr[], from chunk fo[0] / cr on) into dst at row
 * mo[0], column mo[1] of a [*, ldd] buffer; h, if given, hashes the rows
 * in order (cnt covers the piece's columns). */
static int read_chunks(mt_ckpt *ck, int fi, const char *path, const mt_ckpt_piece_rec *r,
                       size_t es, int64_t cr, const int64_t *addr, const hsize_t fo[2],
                       const hsize_t cnt[2], char *dst, const hsize_t mo[2], size_t ldd, mt_xxh64 *h)
{
    rpipe p;
    memset(&p, 0, sizeof p);
    p.ck = ck;
    p.fi = fi;
    p.path = path;
    p.r = r;
    p.es = es;
    p.cols = r->count[1];
    p.cb = (size_t)cr * (size_t)p.cols * es;
    p.cr = cr;
    p.r0 = (int64_t)fo[0];
    p.r1 = p.r0 + (int64_t)cnt[0];
    p.c0 = fo[1];
    p.nc = cnt[1];
    p.dst = dst;
    p.mo[0] = mo[0];
    p.mo[1] = mo[1];
    p.ldd = ldd;
    const int64_t first = p.r0 / cr, n = (p.r1 + cr - 1) / cr - first;
    const int depth = (int)(n < ck_io_threads() + 2 ? n : ck_io_threads() + 2);
    MT_CHECK(ensure_bufs(ck, depth, p.cb + 4, path));
    rchunk *k = calloc((size_t)depth, sizeof *k);
    if (!k) return MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    int rc = MT_OK;
    int64_t next = 0; /* chunks handed out */
    const size_t row = (size_t)p.nc * es;
    for (int64_t c = 0; c < n; c++) {
        /* keep `depth` chunks in flight */
        for (; next < n && next < c + depth && rc == MT_OK; next++) {
            rchunk *x = &k[next % depth];
            x->p = &p;
            x->c = first + next;
            x->addr = addr[next];
            x->buf = ck->bufs[next % depth];
            x->done = 0;
            ck_pool_submit(read_task, x);
        }
        if (c >= next) break; /* failed before handing it out */
        rchunk *x = &k[c % depth];
        pthread_mutex_lock(&p.mu);
        while (!x->done) pthread_cond_wait(&p.cv, &p.mu);
        pthread_mutex_unlock(&p.mu);
        if (x->rc < 0 && rc == MT_OK) rc = MT_ERR(x->rc, "%s", x->msg);
        if (rc == MT_OK && h) {
            const int64_t a = x->c * cr > p.r0 ? x->c * cr : p.r0;
            const int64_t b = (x->c + 1) * cr < p.r1 ? (x->c + 1) * cr : p.r1;
            const char *base = dst + ((size_t)(mo[0] + (hsize_t)(a - p.r0)) * ldd + mo[1]) * es;
            if (ldd == p.nc) mt_xxh64_update(h, base, (size_t)(b - a) * row);
            else
                for (int64_t i = 0; i < b - a; i++) mt_xxh64_update(h, base + (size_t)i * ldd * es, row);
        }
    }
    /* tasks still running use the buffers */
    pthread_mutex_lock(&p.mu);
    for (int64_t c = 0; c < next; c++)
        while (!k[c % depth].done && c + depth >= next) pthread_cond_wait(&p.cv, &p.mu);
    pthread_mutex_unlock(&p.mu);
    pthread_mutex_destroy(&p.mu);
    pthread_cond_destroy(&p.cv);
    free(k);
    return rc;
}

/* Opens piece p's dataset and checks its shape and element size against
 * the index (HDF5 lock held). */
static int open_piece_ds(mt_ckpt *ck, int p, const char *path, hid_t *out)
{
    const mt_ckpt_piece_rec *r = &ck->pieces[p];
    const mt_ckpt_tensor *x = &ck->tensors[mt_ckpt_find(ck, r->tensor)];
    const size_t es = mt_dtype_size(x->dtype);
    const int nd = x->ndim;
    char eb[256];
    hid_t f;
    *out = -1;
    MT_CHECK(ck_piece_file(ck, p, &f));
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS);
    /* a 16 MB chunk cache: bands that cut chunks do not re-read them */
    H5Pset_chunk_cache(dapl, 521, 16u << 20, 1.0);
    hid_t ds = H5Dopen2(f, r->tensor, dapl);
    H5Pclose(dapl);
    if (ds < 0)
        return MT_ERR(MT_ECORRUPT, "%s: tensor %s: dataset missing (%s)", path, r->tensor,
                      ck_h5_errstr(eb, sizeof eb));
    hid_t fsp = H5Dget_space(ds), ftype = H5Dget_type(ds);
    hsize_t dims[2] = {0, 0};
    int rc = MT_OK;
    if (H5Sget_simple_extent_ndims(fsp) != nd || H5Sget_simple_extent_dims(fsp, dims, NULL) != nd ||
        (int64_t)dims[0] != r->count[0] || (nd == 2 && (int64_t)dims[1] != r->count[1]) ||
        H5Tget_size(ftype) != es)
        rc = MT_ERR(MT_ECORRUPT,
                    "%s: tensor %s: dataset is [%llu, %llu] of %zu-byte elements, the index says "
                    "[%lld, %lld] %s",
                    path, r->tensor, (unsigned long long)dims[0], (unsigned long long)dims[1],
                    H5Tget_size(ftype), (long long)r->count[0], (long long)r->count[1],
                    mt_dtype_name(x->dtype));
    H5Sclose(fsp);
    H5Tclose(ftype);
    if (rc < 0) H5Dclose(ds);
    else *out = ds;
    return rc;
}

int ck_piece_chunks(mt_ckpt *ck, int p, int64_t *cr, int64_t **addr)
{
    const mt_ckpt_piece_rec *r = &ck->pieces[p];
    const mt_ckpt_tensor *x = &ck->tensors[mt_ckpt_find(ck, r->tensor)];
    const size_t es = mt_dtype_size(x->dtype);
    char name[32], path[4300];
    ck_shard_name(name, sizeof name, r->rank);
    snprintf(path, sizeof path, "%s/%s", ck->dir, name);
    *cr = 0;
    *addr = NULL;
    hid_t ds = -1;
    int rc = open_piece_ds(ck, p, path, &ds);
    if (rc == MT_OK && (*cr = direct_chunk_rows(ds, x->ndim, r->count[1])) > 0) {
        *addr = malloc((size_t)((r->count[0] + *cr - 1) / *cr + 1) * sizeof **addr);
        rc = *addr ? chunk_addrs(ds, path, r, *cr, (size_t)*cr * (size_t)r->count[1] * es,
                                 ck->file_base[ck->piece_file[p]], 0, r->count[0], *addr)
                   : MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    }
    if (ds >= 0) H5Dclose(ds);
    if (rc < 0) {
        free(*addr);
        *addr = NULL;
        *cr = 0;
    }
    return rc;
}

/* ---- read-ahead of whole pieces ---------------------------------------------------
 *
 * A load takes its pieces whole, in about the order they were written (a
 * rank's pieces in tensor order), and converts and uploads each before it
 * asks for the next: read on demand, the disk would idle through every
 * conversion, and a piece's own chunks would be the only reads in flight.
 * So the first whole read of a piece also starts the pieces after it in
 * the same file, up to PF_BYTES held (the piece asked for, and the next one
 * when nothing else is held, whatever their size up to the largest piece
 * read ahead): a thread of the read-ahead's own starts each piece, its
 * chunk addresses from the index's chunks table (or HDF5's chunk index,
 * under its lock, for an index without one), then every chunk is a pool task that
 * preads it in place into the piece's memory (the checksum aside, so no
 * copy), checks its Fletcher32 and, when it is the next chunk of its piece
 * to hash, feeds the piece's XXH64 with it and the ready chunks after it:
 * no task waits for another, and the pool keeps as many reads in flight as
 * it has workers, across pieces; the kernel reads the file on ahead of
 * them (ckpt_kahead.c). A later whole read of the piece waits for it and
 * copies it out. Larger pieces are read directly into the caller's memory,
 * their chunks in parallel, and the read-ahead goes on after them.
 * (Issue 23, one rank, 3.06 GB, on a lent 16-core host: before, one task
 * per piece read its chunks one after another and pieces over 16 MB were
 * read when asked: loads of 2.13-2.37 s; the chunks in parallel alone
 * 2.16-2.33 s; with the kernel's read-ahead 2.06-2.14 s, dd's rate. The
 * chunks table took the pieces' HDF5 metadata, 0.5-1.5 s of the starting
 * thread's time a rank, to about 1 ms; 4-rank loads alternating with and
 * without it: 2.03 against 2.14 s on average over 11 pairs.) */
#define PF_BYTES_DEFAULT_MB 256
#define PF_PIECE_MAX_DEFAULT_MB 256

/* MT_CKPT_READAHEAD_MB (bytes held ahead) and MT_CKPT_READAHEAD_PIECE_MB
 * (the largest piece read ahead), else the defaults: for measurements of
 * the load against dd (tests/bench/bench_ckpt). Read when asked, as the
 * other MT_CKPT_ knobs are. */
static int64_t env_mb(const char *name, int dflt)
{
    const char *e = getenv(name);
    const long v = e ? atol(e) : 0;
    return (int64_t)(v > 0 ? v : dflt) << 20;
}

static int64_t pf_bytes(void) { return env_mb("MT_CKPT_READAHEAD_MB", PF_BYTES_DEFAULT_MB); }

static int64_t pf_piece_max(void)
{
    return env_mb("MT_CKPT_READAHEAD_PIECE_MB", PF_PIECE_MAX_DEFAULT_MB);
}

/* Pieces in flight at most: enough to keep the workers busy on small
 * pieces (a piece of a few kilobytes is one short read), few enough that
 * the tasks of the piece asked for are not queued behind many others. */
static int pf_max_running(void) { return 4 * ck_io_threads(); }

enum { PF_NONE = 0, PF_RUNNING, PF_READY };
enum { CH_PENDING = 0, CH_OK, CH_FAILED };

typedef struct pf_arg {
    mt_ckpt *ck;
    int p;
    int64_t c;             /* chunk of the piece; -1: the piece's start */
} pf_arg;

/* A piece being read ahead (all of it under pf_mu but the chunks' bytes). */
struct pf_run {
    int fi;
    size_t cb;             /* data bytes of a stored chunk */
    int64_t cr, n;         /* rows per chunk, chunks */
    int64_t *addr;         /* [n] file offsets of the stored chunks */
    uint8_t *cst;          /* [n] CH_* */
    pf_arg *task;          /* [n] the chunks' task arguments */
    int64_t finished;      /* chunks checked or failed */
    int64_t next;          /* the next chunk to hash */
    int64_t fail;          /* the first failed chunk in row order; n: none */
    int fail_rc;
    int hashing;           /* a worker is hashing */
    mt_xxh64 h;
    char path[4300];
};

/* Piece p is done (pf_mu held): its verdict, then its memory goes back if
 * the reader went past it. */
static void pf_done(mt_ckpt *ck, int p, int rc)
{
    struct ck_pf *e = &ck->pf[p];
    struct pf_run *u = e->run;
    if (rc == MT_OK && u->fail < u->n) rc = u->fail_rc; /* its message is in e->msg */
    if (rc == MT_OK && u->cr > 0) {
        const uint64_t got = mt_xxh64_digest(&u->h);
        if (got != ck->pieces[p].xxh64) {
            ck_piece_hash_msg(e->msg, sizeof e->msg, u->path, &ck->pieces[p], got);
            rc = MT_ECORRUPT;
        }
    }
    free(u->addr);
    free(u->cst);
    free(u->task);
    free(u);
    e->run = NULL;
    e->rc = rc;
    e->state = PF_READY;
    if (e->drop) { /* the reader went past it */
        free(e->data);
        e->data = NULL;
        e->drop = 0;
        e->state = PF_NONE;
        ck->pf_held -= ck->pieces[p].nbytes;
    }
    ck->pf_running--;
    pthread_cond_broadcast(&ck->pf_cv);
}

/* Hashes the piece's checked chunks that are next in row order, while
 * there are any (pf_mu held, released while hashing; one worker at a
 * time), then finishes the piece if nothing of it is left. */
static void pf_advance(mt_ckpt *ck, int p)
{
    struct ck_pf *e = &ck->pf[p];
    struct pf_run *u = e->run;
    if (!u->hashing) {
        u->hashing = 1;
        for (;;) {
            int64_t c1 = u->next;
            while (c1 < u->n && c1 < u->fail && u->cst[c1] == CH_OK) c1++;
            if (c1 == u->next) break;
            const size_t a = (size_t)u->next * u->cb;
            const size_t b = c1 == u->n ? (size_t)ck->pieces[p].nbytes : (size_t)c1 * u->cb;
            pthread_mutex_unlock(&ck->pf_mu);
            mt_xxh64_update(&u->h, e->data + a, b - a);
            pthread_mutex_lock(&ck->pf_mu);
            u->next = c1;
        }
        u->hashing = 0;
    }
    if (u->finished == u->n && !u->hashing && (u->fail < u->n || u->next == u->n)) pf_done(ck, p, MT_OK);
}

/* One chunk of a piece read ahead: its rows in place in the piece's memory
 * (the stored chunk's padding rows, for the last, in the slack allocated
 * after the piece), its checksum aside; then checked and hashed in order. */
static void pf_chunk_task(void *arg)
{
    pf_arg *t = arg;
    mt_ckpt *ck = t->ck;
    const int p = t->p;
    const int64_t c = t->c;
    struct ck_pf *e = &ck->pf[p];
    struct pf_run *u = e->run; /* set before the chunks' tasks, freed after the last */
    char *dst = e->data + (size_t)c * u->cb;
    uint8_t tail[4];
    int err = 0;
    const char *got = NULL;
    if (chunk_direct(ck, u->fi, u->cb + 4)) {
        /* whole aligned blocks into a buffer of its own, then the copy */
        char *buf = ck_chunk_buf_alloc(u->cb + 4);
        err = ENOMEM;
        if (buf && (got = ck_chunk_pread(ck, u->fi, buf, u->cb + 4, u->addr[c], &err))) {
            memcpy(dst, got, u->cb);
            memcpy(tail, got + u->cb, 4);
            got = dst;
        }
        free(buf);
    } else {
        size_t done = 0;
        const size_t want = u->cb + 4;
        while (done < want) {
            struct iovec v[2];
            int nv = 0;
            if (done < u->cb) v[nv++] = (struct iovec){dst + done, u->cb - done};
            const size_t t0 = done > u->cb ? done - u->cb : 0;
            v[nv++] = (struct iovec){tail + t0, 4 - t0};
            const ssize_t k = preadv(ck->file_fd[u->fi], v, nv, (off_t)(u->addr[c] + (int64_t)done));
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) {
                err = k < 0 ? errno : 0;
                break;
            }
            done += (size_t)k;
        }
        if (done == want) got = dst;
    }
    char msg[512];
    const int rc = chunk_check_tail(got, tail, err, u->cb, u->path, ck->pieces[p].tensor, c * u->cr, msg,
                                    sizeof msg);
    pthread_mutex_lock(&ck->pf_mu);
    u->cst[c] = rc == MT_OK ? CH_OK : CH_FAILED;
    u->finished++;
    if (rc < 0 && c < u->fail) {
        u->fail = c;
        u->fail_rc = rc;
        snprintf(e->msg, sizeof e->msg, "%s", msg);
    }
    pf_advance(ck, p);
    pthread_mutex_unlock(&ck->pf_mu);
}

/* Bytes [a, b) of file fi are being read ahead through the page cache:
 * the kernel reads on past them (ckpt_kahead.c) if the file is read whole,
 * as the reader's own shard is (or every file when the reader's rank is
 * unset); of other ranks' shards a rank reads only some pieces. */
static void pf_kernel_ahead(mt_ckpt *ck, int fi, int64_t a, int64_t b)
{
    if (ck->reader_rank >= 0 && ck->file_rank[fi] != ck->reader_rank) return;
    pthread_mutex_lock(&ck->pf_mu);
    if (!ck->pf_kahead_tried) {
        ck->pf_kahead_tried = 1;
        ck->pf_kahead = ck_kahead_start(ck->file_fd, ck->n_files);
    }
    ck_kahead *k = ck->pf_kahead;
    pthread_mutex_unlock(&ck->pf_mu);
    ck_kahead_want(k, fi, a, b);
}

/* The start of a piece read ahead: its chunks' addresses from the index,
 * or else its dataset checked against the index and the addresses from
 * HDF5 (under its lock), then a task per chunk; a dataset not written by
 * moetrain is read here through HDF5 (and its filter) and hashed whole. */
static void pf_start(mt_ckpt *ck, int p)
{
    struct ck_pf *e = &ck->pf[p];
    struct pf_run *u = e->run;
    const mt_ckpt_piece_rec *r = &ck->pieces[p];
    const mt_ckpt_tensor *x = &ck->tensors[mt_ckpt_find(ck, r->tensor)];
    const size_t es = mt_dtype_size(x->dtype);
    char name[32], eb[256];
    ck_shard_name(name, sizeof name, r->rank);
    snprintf(u->path, sizeof u->path, "%s/%s", ck->dir, name);
    u->fi = ck->piece_file[p];
    const int64_t rows = r->count[0];
    const double t0 = mt_now_ms();
    int rc = MT_OK;
    if (r->chunk_rows > 0) { /* recorded in the index: no HDF5 metadata to read */
        u->cr = r->chunk_rows;
        u->n = (rows + u->cr - 1) / u->cr;
        u->cb = (size_t)u->cr * (size_t)r->count[1] * es;
        u->addr = malloc((size_t)(u->n + 1) * sizeof *u->addr);
        if (!u->addr) rc = MT_ERR(MT_ENOMEM, "%s: out of memory", u->path);
        else if ((rc = piece_fd_locked(ck, p)) == MT_OK) index_chunk_addrs(r, 0, u->n, u->addr);
    } else {
        hid_t ds = -1;
        ck_lock();
        rc = open_piece_ds(ck, p, u->path, &ds);
        if (rc == MT_OK && (u->cr = direct_chunk_rows(ds, x->ndim, r->count[1])) > 0) {
            u->n = (rows + u->cr - 1) / u->cr;
            u->cb = (size_t)u->cr * (size_t)r->count[1] * es;
            u->addr = malloc((size_t)(u->n + 1) * sizeof *u->addr);
            rc = u->addr ? chunk_addrs(ds, u->path, r, u->cr, u->cb, ck->file_base[u->fi], 0, rows, u->addr)
                         : MT_ERR(MT_ENOMEM, "%s: out of memory", u->path);
        } else if (rc == MT_OK) {
            hid_t type = ck_h5_type(x->dtype);
            if (H5Dread(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, e->data) < 0)
                rc = MT_ERR(MT_ECORRUPT, "%s: tensor %s: read failed: %s", u->path, r->tensor,
                            ck_h5_errstr(eb, sizeof eb));
            H5Tclose(type);
        }
        if (ds >= 0) H5Dclose(ds);
        ck_unlock();
    }
    const double ms = mt_now_ms() - t0;
    pthread_mutex_lock(&ck->pf_mu);
    ck->pf_meta_ms += ms;
    ck->pf_pieces++;
    ck->pf_chunks += u->n;
    pthread_mutex_unlock(&ck->pf_mu);
    if (rc == MT_OK && u->cr > 0) {
        /* the last stored chunk is whole: room for its padding rows */
        char *d = realloc(e->data, (size_t)u->n * u->cb + 1);
        u->cst = calloc((size_t)u->n + 1, 1);
        u->task = malloc((size_t)(u->n + 1) * sizeof *u->task);
        if (d) e->data = d;
        if (!d || !u->cst || !u->task)
            rc = MT_ERR(MT_ENOMEM, "%s: tensor %s: out of memory", u->path, r->tensor);
    }
    if (rc == MT_OK && u->cr > 0 && u->n > 0) {
        u->fail = u->n;
        mt_xxh64_init(&u->h, 0);
        /* u goes when the last chunk is done: nothing of it after its task */
        const int64_t n = u->n;
        pf_arg *task = u->task;
        for (int64_t c = 0; c < n; c++) task[c] = (pf_arg){ck, p, c};
        if (!chunk_direct(ck, u->fi, u->cb + 4))
            pf_kernel_ahead(ck, u->fi, u->addr[0], u->addr[n - 1] + (int64_t)u->cb + 4);
        for (int64_t c = 0; c < n; c++) ck_pool_submit(pf_chunk_task, &task[c]);
        return;
    }
    if (rc < 0) snprintf(e->msg, sizeof e->msg, "%s", mt_errmsg());
    else if (u->cr == 0) { /* read through HDF5: its hash now */
        const uint64_t got = mt_xxh64_oneshot(e->data, (size_t)r->nbytes, 0);
        if (got != r->xxh64) {
            ck_piece_hash_msg(e->msg, sizeof e->msg, u->path, r, got);
            rc = MT_ECORRUPT;
        }
    } else { /* no rows: the hash of nothing */
        mt_xxh64_init(&u->h, 0);
        u->fail = u->n;
    }
    pthread_mutex_lock(&ck->pf_mu);
    if (rc < 0 || u->cr == 0) u->cr = 0, u->fail = u->n = 0; /* pf_done: no chunk verdict, no hash */
    pf_done(ck, p, rc);
    pthread_mutex_unlock(&ck->pf_mu);
}

/* The read-ahead's metadata thread: the pieces' starts in launch order.
 * On the pool's workers, the starts of the pieces launched together queued
 * on the HDF5 lock (cold metadata reads under it) and held the workers
 * the chunks' reads need; here they run one after another, as the lock
 * has them run anyway, while the workers read. */
static void *pf_meta_main(void *arg)
{
    mt_ckpt *ck = arg;
    pthread_mutex_lock(&ck->pf_mu);
    for (;;) {
        while (ck->pf_qhead == ck->pf_qtail && !ck->pf_quit) pthread_cond_wait(&ck->pf_cv, &ck->pf_mu);
        if (ck->pf_qhead == ck->pf_qtail) break; /* quitting, nothing queued */
        const int p = ck->pf_queue[ck->pf_qhead++ % (ck->n_pieces + 1)];
        pthread_mutex_unlock(&ck->pf_mu);
        pf_start(ck, p);
        pthread_mutex_lock(&ck->pf_mu);
    }
    pthread_mutex_unlock(&ck->pf_mu);
    return NULL;
}

static void pf_start_task(void *arg)
{
    pf_arg *t = arg;
    mt_ckpt *ck = t->ck;
    const int p = t->p;
    free(t);
    pf_start(ck, p);
}

/* Starts piece q (pf_mu held): on the metadata thread, or a pool task if
 * that thread could not start. 0, or -1 without memory. */
static int pf_launch(mt_ckpt *ck, int q)
{
    struct ck_pf *e = &ck->pf[q];
    if (!ck->pf_queue && (ck->pf_queue = malloc((size_t)(ck->n_pieces + 1) * sizeof *ck->pf_queue)))
        ck->pf_meta_on = pthread_create(&ck->pf_meta, NULL, pf_meta_main, ck) == 0;
    pf_arg *a = ck->pf_meta_on ? NULL : malloc(sizeof *a);
    struct pf_run *u = calloc(1, sizeof *u);
    e->data = malloc((size_t)ck->pieces[q].nbytes + 1);
    if ((!ck->pf_meta_on && !a) || !u || !e->data) {
        free(a);
        free(u);
        free(e->data);
        e->data = NULL;
        return -1;
    }
    e->run = u;
    e->state = PF_RUNNING;
    e->drop = 0;
    e->rc = MT_OK;
    e->msg[0] = 0;
    ck->pf_held += ck->pieces[q].nbytes;
    ck->pf_running++;
    if (ck->pf_meta_on) {
        /* a piece is launched once until taken or dropped: the ring of
         * n_pieces + 1 never overflows */
        ck->pf_queue[ck->pf_qtail++ % (ck->n_pieces + 1)] = q;
        pthread_cond_broadcast(&ck->pf_cv);
    } else {
        *a = (pf_arg){ck, q, -1};
        ck_pool_submit(pf_start_task, a);
    }
    return 0;
}

/* Whether piece q is for the read-ahead: small, and in the reader's own
 * shard or not optimizer state (FORMAT.md: a parameter's optimizer state
 * has one owner, who reads it; weights in another rank's shard may be
 * replicas this rank holds too, written by one replica of the group), and
 * not a tensor another replica reads for this one (mt_ckpt_skip_fn). Every
 * piece when the reader's rank is unset and nothing is skipped. */
static int pf_wanted(const mt_ckpt *ck, int q)
{
    if (ck->pieces[q].nbytes > pf_piece_max()) return 0;
    /* a weight another replica reads (mt_ckpt_skip_fn), in any shard: the
     * writer's own shard holds the weights its replicas read */
    const int x = ck->skip ? mt_ckpt_find(ck, ck->pieces[q].tensor) : -1;
    if (x >= 0 && ck->skip[x]) return 0;
    return ck->reader_rank < 0 || ck->file_rank[ck->piece_file[q]] == ck->reader_rank ||
           strncmp(ck->pieces[q].tensor, "optimizer.", 10) != 0;
}

void mt_ckpt_skip_fn(void *ctx, const char *name)
{
    mt_ckpt *ck = ctx;
    if (!ck->skip && !(ck->skip = calloc((size_t)(ck->n_tensors > 0 ? ck->n_tensors : 1), 1)))
        return; /* only a hint */
    char scale[MT_TENSOR_NAME_CAP + 16];
    int x = mt_ckpt_find(ck, name);
    if (x >= 0) ck->skip[x] = 1;
    if (mt_shard_scale_name(scale, sizeof scale, name) == MT_OK && (x = mt_ckpt_find(ck, scale)) >= 0)
        ck->skip[x] = 1;
}

/* Tops up the read-ahead of file fi after piece `after` (pf_mu held). */
static void pf_more(mt_ckpt *ck, int fi, int after)
{
    int q = ck->pf_cursor[fi] > after + 1 ? ck->pf_cursor[fi] : after + 1;
    const int limit = pf_max_running();
    for (; q < ck->n_pieces; q++) {
        if (ck->piece_file[q] != fi || ck->pf[q].state != PF_NONE || !pf_wanted(ck, q)) continue;
        if ((ck->pf_held > 0 && ck->pf_held + ck->pieces[q].nbytes > pf_bytes()) || ck->pf_running >= limit)
            break;
        if (pf_launch(ck, q) < 0) break;
    }
    ck->pf_cursor[fi] = q;
}

static void pf_init(mt_ckpt *ck)
{
    if (!ck->pf_on) {
        pthread_mutex_init(&ck->pf_mu, NULL);
        pthread_cond_init(&ck->pf_cv, NULL);
        ck->pf_on = 1;
    }
}

/* The reader is past piece p of its file (pf_mu held): the pieces before
 * p read ahead and not taken go (their memory back to the read-ahead),
 * the read-ahead tops up after p. */
static void pf_past(mt_ckpt *ck, int p)
{
    const int fi = ck->piece_file[p];
    for (int q = ck->pf_low[fi]; q < p; q++) {
        struct ck_pf *s = &ck->pf[q];
        if (ck->piece_file[q] != fi || s->state == PF_NONE) continue;
        if (s->state == PF_RUNNING) {
            s->drop = 1;
            continue;
        }
        free(s->data);
        s->data = NULL;
        s->state = PF_NONE;
        ck->pf_held -= ck->pieces[q].nbytes;
    }
    if (p + 1 > ck->pf_low[fi]) ck->pf_low[fi] = p + 1;
    pf_more(ck, fi, p);
}

/* Piece p whole through the read-ahead: its bytes (the caller frees them),
 * or NULL with *rc set; 0 returned if p is not for the read-ahead. */
static int pf_take(mt_ckpt *ck, int p, char **data, int *rc)
{
    /* in another rank's shard this rank reads only some pieces (the
     * replicated weights among that rank's optimizer state): reading its
     * optimizer state ahead would fetch, check and hold pieces nobody here
     * takes, and fill the read-ahead's budget (issue 23: the 4-rank load) */
    if (!pf_wanted(ck, p) || getenv("MT_CKPT_NO_READAHEAD")) return 0;
    pf_init(ck);
    struct ck_pf *e = &ck->pf[p];
    pthread_mutex_lock(&ck->pf_mu);
    e->drop = 0; /* skipped before, wanted now */
    if (e->state == PF_NONE && pf_launch(ck, p) < 0) {
        pthread_mutex_unlock(&ck->pf_mu);
        return 0; /* no memory for it: read it directly */
    }
    pf_more(ck, ck->piece_file[p], p);
    const double t0 = mt_now_ms();
    while (e->state != PF_READY) pthread_cond_wait(&ck->pf_cv, &ck->pf_mu);
    ck->pf_wait_ms += mt_now_ms() - t0;
    *rc = e->rc;
    *data = e->data;
    if (e->rc < 0) {
        *rc = MT_ERR(e->rc, "%s", e->msg);
        free(e->data);
        *data = NULL;
    }
    e->data = NULL;
    e->state = PF_NONE;
    ck->pf_held -= ck->pieces[p].nbytes;
    pf_past(ck, p);
    pthread_mutex_unlock(&ck->pf_mu);
    return 1;
}

/* After piece p was read whole without the read-ahead (larger than it
 * takes): the pieces after it are read while the caller converts p. */
static void pf_after(mt_ckpt *ck, int p)
{
    if (getenv("MT_CKPT_NO_READAHEAD")) return;
    pf_init(ck);
    pthread_mutex_lock(&ck->pf_mu);
    pf_past(ck, p);
    pthread_mutex_unlock(&ck->pf_mu);
}

/* Waits for the read-ahead's tasks (they use ck) and frees what they read. */
static void pf_stop(mt_ckpt *ck)
{
    if (ck->pf_on) {
        pthread_mutex_lock(&ck->pf_mu);
        while (ck->pf_running) pthread_cond_wait(&ck->pf_cv, &ck->pf_mu);
        ck->pf_quit = 1;
        pthread_cond_broadcast(&ck->pf_cv);
        pthread_mutex_unlock(&ck->pf_mu);
        if (ck->pf_meta_on) pthread_join(ck->pf_meta, NULL);
        pthread_mutex_destroy(&ck->pf_mu);
        pthread_cond_destroy(&ck->pf_cv);
        if (ck->pf_pieces)
            MT_LOGD("checkpoint %s: read ahead %lld pieces (%lld chunks), %.1f ms of their HDF5 "
                    "metadata on %s; the reader waited %.1f ms for them and copied them out in %.1f ms",
                    ck->dir, (long long)ck->pf_pieces, (long long)ck->pf_chunks, ck->pf_meta_ms,
                    ck->pf_meta_on ? "a thread of its own" : "the workers", ck->pf_wait_ms, ck->pf_copy_ms);
    }
    free(ck->pf_queue);
    ck_kahead_stop(ck->pf_kahead);
    ck->pf_queue = NULL;
    ck->pf_kahead = NULL;
    ck->pf_meta_on = ck->pf_kahead_tried = 0;
    for (int q = 0; ck->pf && q < ck->n_pieces; q++) free(ck->pf[q].data);
    free(ck->pf);
    free(ck->pf_cursor);
    free(ck->pf_low);
    ck->pf_low = NULL;
    ck->pf = NULL;
    ck->pf_cursor = NULL;
    ck->pf_on = 0;
}

int ck_check_piece(mt_ckpt *ck, int p, int *rc)
{
    char *data = NULL;
    if (!pf_take(ck, p, &data, rc)) return 0;
    free(data);
    return 1;
}

/* Reads the intersection of piece p with d into d->data. A piece read
 * whole is checked against its xxh64. */
int ck_read_piece(mt_ckpt *ck, int p, mt_tensor_desc *d)
{
    const mt_ckpt_piece_rec *r = &ck->pieces[p];
    const int nd = d->ndim;
    int64_t lo[2], hi[2];
    for (int k = 0; k < 2; k++) {
        int64_t dlo = k < nd ? d->off[k] : 0, dhi = dlo + (k < nd ? d->count[k] : 1);
        lo[k] = r->off[k] > dlo ? r->off[k] : dlo;
        hi[k] = r->off[k] + r->count[k] < dhi ? r->off[k] + r->count[k] : dhi;
        if (lo[k] >= hi[k]) return MT_OK;
    }
    char name[32], path[4300], eb[256];
    ck_shard_name(name, sizeof name, r->rank);
    snprintf(path, sizeof path, "%s/%s", ck->dir, name);
    const mt_ckpt_tensor *x = &ck->tensors[mt_ckpt_find(ck, r->tensor)];
    const size_t es = mt_dtype_size(x->dtype);
    const int64_t dc1 = nd == 2 ? d->count[1] : 1, d1 = nd == 2 ? d->off[1] : 0;
    const int whole = lo[0] == r->off[0] && hi[0] == r->off[0] + r->count[0] &&
                      lo[1] == r->off[1] && hi[1] == r->off[1] + r->count[1];
    hsize_t fo[2] = {(hsize_t)(lo[0] - r->off[0]), (hsize_t)(lo[1] - r->off[1])};
    hsize_t cnt[2] = {(hsize_t)(hi[0] - lo[0]), (hsize_t)(hi[1] - lo[1])};
    hsize_t mdims[2] = {(hsize_t)d->count[0], (hsize_t)dc1};
    hsize_t mo[2] = {(hsize_t)(lo[0] - d->off[0]), (hsize_t)(lo[1] - d1)};
    int rc = MT_OK;
    char *ready = NULL;
    if (whole && pf_take(ck, p, &ready, &rc)) {
        if (rc < 0) return rc;
        const double t0 = mt_now_ms();
        const size_t row = (size_t)cnt[1] * es;
        if (mo[1] == 0 && (int64_t)cnt[1] == dc1)
            memcpy((char *)d->data + (size_t)mo[0] * row, ready, (size_t)cnt[0] * row);
        else
            for (hsize_t i = 0; i < cnt[0]; i++)
                memcpy((char *)d->data + ((size_t)(mo[0] + i) * (size_t)dc1 + mo[1]) * es, ready + i * row,
                       row);
        free(ready);
        ck->pf_copy_ms += mt_now_ms() - t0;
        return MT_OK;
    }
    int64_t *addr = NULL, cr = r->chunk_rows;
    int direct = 0;
    hid_t ds = -1, fsp = -1, type = -1, msp = -1;
    if (cr > 0) { /* recorded in the index: no HDF5 metadata to read */
        const int64_t c0 = (int64_t)fo[0] / cr, c1 = ((int64_t)(fo[0] + cnt[0]) + cr - 1) / cr;
        if ((rc = piece_fd_locked(ck, p)) < 0) return rc;
        if (!(addr = malloc((size_t)(c1 - c0 + 1) * sizeof *addr)))
            return MT_ERR(MT_ENOMEM, "%s: out of memory", path);
        index_chunk_addrs(r, c0, c1 - c0, addr);
        direct = 1;
        goto read;
    }
    ck_lock();
    if ((rc = open_piece_ds(ck, p, path, &ds)) < 0) goto unlock;
    fsp = H5Dget_space(ds);
    type = ck_h5_type(x->dtype);
    cr = direct_chunk_rows(ds, nd, r->count[1]);
    if (cr > 0) {
        /* moetrain's own chunks: addresses now, bytes in parallel after the lock */
        const int64_t r0 = (int64_t)fo[0], r1 = r0 + (int64_t)cnt[0];
        addr = malloc((size_t)((r1 + cr - 1) / cr - r0 / cr + 1) * sizeof *addr);
        if (!addr) rc = MT_ERR(MT_ENOMEM, "%s: out of memory", path);
        else rc = chunk_addrs(ds, path, r, cr, (size_t)cr * (size_t)r->count[1] * es,
                              ck->file_base[ck->piece_file[p]], r0, r1, addr);
        direct = 1;
        goto unlock;
    }
    msp = H5Screate_simple(nd, mdims, NULL);
    if (msp < 0 || H5Sselect_hyperslab(fsp, H5S_SELECT_SET, fo, NULL, cnt, NULL) < 0 ||
        H5Sselect_hyperslab(msp, H5S_SELECT_SET, mo, NULL, cnt, NULL) < 0) {
        rc = MT_ERR(MT_EHDF5, "%s: tensor %s: cannot select the hyperslab", path, r->tensor);
        goto unlock;
    }
    if (H5Dread(ds, type, msp, fsp, H5P_DEFAULT, d->data) < 0)
        rc = MT_ERR(MT_ECORRUPT, "%s: tensor %s: read failed: %s", path, r->tensor,
                    ck_h5_errstr(eb, sizeof eb));
unlock:
    if (msp >= 0) H5Sclose(msp);
    if (fsp >= 0) H5Sclose(fsp);
    if (type >= 0) H5Tclose(type);
    if (ds >= 0) H5Dclose(ds);
    ck_unlock();
    if (rc < 0) {
        free(addr);
        return rc;
    }
read:;
    mt_xxh64 h;
    mt_xxh64_init(&h, 0);
    const size_t rb = (size_t)cnt[1] * es;
    const char *base = (const char *)d->data + ((size_t)mo[0] * (size_t)dc1 + mo[1]) * es;
    if (direct) {
        rc = read_chunks(ck, ck->piece_file[p], path, r, es, cr, addr, fo, cnt, (char *)d->data, mo,
                         (size_t)dc1, whole ? &h : NULL);
        free(addr);
    } else if (whole) {
        if ((int64_t)cnt[1] == dc1)
            mt_xxh64_update(&h, base, (size_t)cnt[0] * rb);
        else
            for (hsize_t i = 0; i < cnt[0]; i++) mt_xxh64_update(&h, base + i * (size_t)dc1 * es, rb);
    }
    if (rc == MT_OK && whole) {
        uint64_t got = mt_xxh64_digest(&h);
        if (got != r->xxh64) {
            char msg[1024];
            ck_piece_hash_msg(msg, sizeof msg, path, r, got);
            rc = MT_ERR(MT_ECORRUPT, "%s", msg);
        }
    }
    if (rc == MT_OK && whole) pf_after(ck, p);
    return rc;
}

static int ckpt_read_raw(void *impl, mt_tensor_desc *d)
{
    mt_ckpt *ck = impl;
    int t = mt_ckpt_find(ck, d->name);
    if (t < 0) return MT_ERR(MT_ENOTFOUND, "%s: no tensor %s", ck->dir, d->name);
    const mt_ckpt_tensor *x = &ck->tensors[t];
    if (d->dtype != x->dtype || d->ndim != x->ndim)
        return MT_ERR(MT_EINVAL, "%s: tensor %s is %dD %s, asked for %dD %s", ck->dir, d->name,
                      x->ndim, mt_dtype_name(x->dtype), d->ndim, mt_dtype_name(d->dtype));
    for (int k = 0; k < x->ndim; k++)
        if (d->off[k] < 0 || d->count[k] <= 0 || d->off[k] + d->count[k] > x->shape[k])
            return MT_ERR(MT_EINVAL, "%s: tensor %s: hyperslab outside the shape", ck->dir, d->name);
    int rc = MT_OK;
    for (int p = x->first_piece; p < x->first_piece + x->n_pieces && rc == MT_OK; p++)
        rc = ck_read_piece(ck, p, d);
    return rc;
}

static int ckpt_info(void *impl, const char *name, mt_dtype *dt, int *ndim, int64_t shape[2])
{
    mt_ckpt *ck = impl;
    int t = mt_ckpt_find(ck, name);
    if (t < 0) return MT_ENOTFOUND;
    *dt = ck->tensors[t].dtype;
    *ndim = ck->tensors[t].ndim;
    shape[0] = ck->tensors[t].shape[0];
    shape[1] = ck->tensors[t].shape[1];
    return MT_OK;
}

mt_tensor_source mt_ckpt_source(mt_ckpt *ck)
{
    mt_tensor_source s = {ck, ck->dir, ckpt_info, ckpt_read_raw};
    return s;
}

int mt_ckpt_read_fn(void *ctx, mt_tensor_desc *d)
{
    mt_tensor_source s = mt_ckpt_source(ctx);
    return mt_source_read(&s, d);
}

int mt_ckpt_read_fp8_fn(void *ctx, mt_tensor_desc *q, float *sc)
{
    mt_tensor_source s = mt_ckpt_source(ctx);
    return mt_source_read_fp8(&s, q, sc);
}

int mt_ckpt_map(const mt_ckpt *ck, mt_shard_map *map)
{
    mt_model_config c;
    MT_CHECK(ck_meta_config(&ck->meta, &c));
    int rc = mt_shard_map_build(map, &c, &ck->meta.layout, &ck->meta.opts);
    if (rc < 0) return mt_err_wrap(rc, "%s", ck->dir);
    return MT_OK;
}

/* ---- conversions on any source ---------------------------------------------------------- */

/* Scale blocks covering a 2-D hyperslab: rows [r0, r1) x cols [c0, c1). */
static void block_range(const mt_tensor_desc *d, int64_t *r0, int64_t *r1, int64_t *c0, int64_t *c1)
{
    *r0 = d->off[0] / 128;
    *r1 = (d->off[0] + d->count[0] + 127) / 128;
    *c0 = d->off[1] / 128;
    *c1 = (d->off[1] + d->count[1] + 127) / 128;
}

/* Reads the scales of a stored-e4m3 weight hyperslab into sc [r1-r0, c1-c0]. */
static int read_scales(const mt_tensor_source *s, const mt_tensor_desc *q, float *sc)
{
    mt_tensor_desc sd;
    memset(&sd, 0, sizeof sd);
    MT_CHECK(mt_shard_scale_name(sd.name, sizeof sd.name, q->name));
    mt_dtype dt;
    int nd;
    int64_t shape[2];
    if (s->info(s->impl, sd.name, &dt, &nd, shape) < 0)
        return MT_ERR(MT_ECORRUPT, "%s: tensor %s is e4m3 but %s is missing", s->what, q->name, sd.name);
    if (dt != MT_DT_F32 || nd != 2)
        return MT_ERR(MT_ECORRUPT, "%s: %s is not a 2-D f32 tensor", s->what, sd.name);
    int64_t r0, r1, c0, c1;
    block_range(q, &r0, &r1, &c0, &c1);
    sd.dtype = MT_DT_F32;
    sd.ndim = 2;
    sd.shape[0] = shape[0];
    sd.shape[1] = shape[1];
    sd.off[0] = r0;
    sd.off[1] = c0;
    sd.count[0] = r1 - r0;
    sd.count[1] = c1 - c0;
    sd.data = sc;
    return s->read_raw(s->impl, &sd);
}

/* Rows per strip of a conversion: temporaries of at most CK_STRIP_BYTES of
 * f32 whatever the hyperslab (a whole tensor read converted must not cost
 * another tensor or two of memory). */
static int64_t strip_rows(int64_t rows, int64_t cols)
{
    int64_t n = (int64_t)(CK_STRIP_BYTES / 4) / (cols > 0 ? cols : 1);
    return n < 1 ? 1 : n > rows ? rows : n;
}

int mt_source_read(const mt_tensor_source *s, mt_tensor_desc *d)
{
    mt_dtype st;
    int nd;
    int64_t shape[2];
    if (s->info(s->impl, d->name, &st, &nd, shape) < 0)
        return MT_ERR(MT_ENOTFOUND, "%s: no tensor %s", s->what, d->name);
    if (nd != d->ndim || shape[0] != d->shape[0] || (nd == 2 && shape[1] != d->shape[1]))
        return MT_ERR(MT_EINVAL, "%s: tensor %s is [%lld, %lld], expected [%lld, %lld]", s->what,
                      d->name, (long long)shape[0], (long long)(nd == 2 ? shape[1] : 1),
                      (long long)d->shape[0], (long long)(d->ndim == 2 ? d->shape[1] : 1));
    if (st == d->dtype) return s->read_raw(s->impl, d);
    const int fl = d->dtype == MT_DT_F32 || d->dtype == MT_DT_BF16;
    if (!fl || (st != MT_DT_F32 && st != MT_DT_BF16 && st != MT_DT_E4M3))
        return MT_ERR(MT_ENOTSUP, "%s: tensor %s: cannot convert %s to %s", s->what, d->name,
                      mt_dtype_name(st), mt_dtype_name(d->dtype));
    if (st == MT_DT_E4M3 && d->ndim != 2)
        return MT_ERR(MT_ECORRUPT, "%s: tensor %s: 1-D e4m3", s->what, d->name);
    /* strips of whole rows of the hyperslab, converted into place */
    const int64_t R = d->count[0], C = d->ndim == 2 ? d->count[1] : 1;
    const int64_t sr = strip_rows(R, C);
    const size_t os = mt_dtype_size(d->dtype);
    int64_t KB = 0;
    if (st == MT_DT_E4M3) {
        int64_t r0, r1, c0, c1;
        block_range(d, &r0, &r1, &c0, &c1);
        KB = c1 - c0;
    }
    void *raw = malloc((size_t)(sr * C) * mt_dtype_size(st) + 1);
    float *f = st == MT_DT_E4M3 ? malloc((size_t)(sr * C) * 4 + 1) : NULL;
    /* scale rows a strip can touch: ceil(sr / 128) + 1 */
    float *sc = st == MT_DT_E4M3 ? malloc((size_t)((sr + 127) / 128 + 1) * (size_t)KB * 4 + 1) : NULL;
    int rc = MT_OK;
    if (!raw || (st == MT_DT_E4M3 && (!f || !sc)))
        rc = MT_ERR(MT_ENOMEM, "%s: tensor %s: out of memory", s->what, d->name);
    for (int64_t r = 0; r < R && rc == MT_OK; r += sr) {
        mt_tensor_desc part = *d;
        part.dtype = st;
        part.off[0] = d->off[0] + r;
        part.count[0] = R - r < sr ? R - r : sr;
        part.data = raw;
        const int64_t n = part.count[0] * C;
        char *out = (char *)d->data + (size_t)(r * C) * os;
        if ((rc = s->read_raw(s->impl, &part)) < 0) break;
        if (st != MT_DT_E4M3) {
            ck_convert(out, d->dtype, raw, st, n);
            continue;
        }
        /* e4m3: dequantise with its block scales, q * s in float as dequant_blocks */
        int64_t r0, r1, c0, c1;
        block_range(&part, &r0, &r1, &c0, &c1);
        if ((rc = read_scales(s, &part, sc)) < 0) break;
        const uint8_t *q = raw;
        for (int64_t i = 0; i < part.count[0]; i++) {
            const float *srow = sc + ((part.off[0] + i) / 128 - r0) * KB;
            for (int64_t j = 0; j < C; j++)
                f[i * C + j] = mt_e4m3_to_f32(q[i * C + j]) * srow[(d->off[1] + j) / 128 - c0];
        }
        ck_convert(out, d->dtype, f, MT_DT_F32, n);
    }
    free(raw);
    free(f);
    free(sc);
    return rc;
}

/* The project's block quantisation (kernels/mt_fp8.h; cpu quant_blocks):
 * per 128 x 128 block s = amax / 448, q = e4m3(x / s). */
static void quantise_blocks(uint8_t *q, float *sc, const float *w, int64_t R, int64_t C)
{
    const int64_t RB = (R + 127) / 128, CB = (C + 127) / 128;
    for (int64_t rb = 0; rb < RB; rb++)
        for (int64_t cb = 0; cb < CB; cb++) {
            int64_t i0 = rb * 128, j0 = cb * 128;
            int64_t ni = R - i0 < 128 ? R - i0 : 128, nj = C - j0 < 128 ? C - j0 : 128;
            float amax = 0.0f;
            for (int64_t i = 0; i < ni; i++)
                for (int64_t j = 0; j < nj; j++) {
                    float a = fabsf(w[(i0 + i) * C + j0 + j]);
                    amax = a > amax ? a : amax;
                }
            float s = mt_fp8_scale(amax);
            if (sc) sc[rb * CB + cb] = s;
            for (int64_t i = 0; i < ni; i++)
                for (int64_t j = 0; j < nj; j++)
                    q[(i0 + i) * C + j0 + j] = mt_e4m3_from_f32(w[(i0 + i) * C + j0 + j] / s);
        }
}

int mt_source_read_fp8(const mt_tensor_source *s, mt_tensor_desc *q, float *s_out)
{
    mt_dtype st;
    int nd;
    int64_t shape[2];
    if (s->info(s->impl, q->name, &st, &nd, shape) < 0)
        return MT_ERR(MT_ENOTFOUND, "%s: no tensor %s", s->what, q->name);
    if (nd != 2 || q->ndim != 2 || q->dtype != MT_DT_E4M3)
        return MT_ERR(MT_EINVAL, "%s: tensor %s: FP8 reads are of 2-D e4m3 weights", s->what, q->name);
    if (q->off[0] % 128 || q->off[1] % 128)
        return MT_ERR(MT_EINVAL, "%s: tensor %s: FP8 hyperslab at [%lld, %lld] cuts a 128x128 block",
                      s->what, q->name, (long long)q->off[0], (long long)q->off[1]);
    for (int k = 0; k < 2; k++)
        if ((q->off[k] + q->count[k]) % 128 && q->off[k] + q->count[k] != shape[k])
            return MT_ERR(MT_EINVAL, "%s: tensor %s: FP8 hyperslab ends inside a 128x128 block",
                          s->what, q->name);
    if (st == MT_DT_E4M3) {
        MT_CHECK(mt_source_read(s, q));
        return s_out ? read_scales(s, q, s_out) : MT_OK;
    }
    /* quantised from the stored values one row of 128 x 128 blocks at a
     * time (the hyperslab starts on a block row): bounded temporaries */
    const int64_t R = q->count[0], C = q->count[1], CB = (C + 127) / 128;
    float *f = malloc((size_t)(128 * C) * 4);
    float *tmp = s_out ? NULL : malloc((size_t)CB * 4);
    if (!f || (!s_out && !tmp)) {
        free(f);
        free(tmp);
        return MT_ERR(MT_ENOMEM, "%s: tensor %s: out of memory", s->what, q->name);
    }
    int rc = MT_OK;
    for (int64_t rb = 0; rb * 128 < R && rc == MT_OK; rb++) {
        mt_tensor_desc fd = *q;
        fd.dtype = MT_DT_F32;
        fd.off[0] = q->off[0] + rb * 128;
        fd.count[0] = R - rb * 128 < 128 ? R - rb * 128 : 128;
        fd.data = f;
        if ((rc = mt_source_read(s, &fd)) == MT_OK)
            quantise_blocks((uint8_t *)q->data + (size_t)(rb * 128 * C), s_out ? s_out + rb * CB : tmp,
                            f, fd.count[0], C);
    }
    free(f);
    free(tmp);
    return rc;
}
