/* ckpt_write.c - shard files and the index (FORMAT.md). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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

static size_t row_bytes(const mt_tensor_desc *d)
{
    return (size_t)(d->ndim == 1 ? 1 : d->count[1]) * mt_dtype_size(d->dtype);
}

/* The shard-map row of descriptor d written by rank, its checksum aside
 * (zero): as the writer records it and as the index is begun from. */
static void piece_rec_of(const mt_tensor_desc *d, int rank, mt_ckpt_piece_rec *rec)
{
    memset(rec, 0, sizeof *rec);
    snprintf(rec->tensor, sizeof rec->tensor, "%s", d->name);
    rec->rank = rank;
    for (int k = 0; k < 2; k++) {
        rec->off[k] = k < d->ndim ? d->off[k] : 0;
        rec->count[k] = k < d->ndim ? d->count[k] : 1;
    }
    rec->nbytes = d->count[0] * (int64_t)row_bytes(d);
}

/* userblock: bytes reserved at the start of the file (the index's seal);
 * shard: through the driver whose chunk writes the writer hands to workers
 * (ckpt_vfd.c). */
static hid_t create_file(const char *path, hsize_t userblock, int shard)
{
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS), fcpl = H5Pcreate(H5P_FILE_CREATE);
    if (fapl < 0 || fcpl < 0 || (userblock && H5Pset_userblock(fcpl, userblock) < 0) ||
        (shard && ck_vfd_id() >= 0 && H5Pset_driver(fapl, ck_vfd_id(), NULL) < 0)) {
        if (fapl >= 0) H5Pclose(fapl);
        if (fcpl >= 0) H5Pclose(fcpl);
        return -1;
    }
    /* the 1.10 format: virtual datasets, compact chunk indexes (HDF5 >= 1.10 reads it) */
    H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_V110);
    /* metadata in 64 KB blocks: less seeking on shards with many pieces */
    H5Pset_meta_block_size(fapl, 64 << 10);
    /* O_DIRECT chunk writes need block-aligned chunks (<= 4 KB of padding
     * per chunk of 1 MB or more) */
    if (shard && ck_io_direct()) H5Pset_alignment(fapl, (hsize_t)1 << 20, CK_DIRECT_ALIGN);
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, fcpl, fapl);
    H5Pclose(fapl);
    H5Pclose(fcpl);
    return f;
}

/* Writing a shard is a pipeline (issue 23): the pieces' chunks go through
 * a ring of chunk buffers,
 *   producer thread   fill() band by band (or the resident data), hands
 *                     each chunk's rows to a worker;
 *   workers (pool)    copy the rows into the chunk buffer, zero-pad it as
 *                     HDF5 stores edge chunks, append its Fletcher32;
 *   hasher thread     the piece's XXH64, chunk after chunk in order;
 *   this thread       HDF5: creates each piece's dataset, hands each
 *                     chunk to H5Dwrite_chunk in order, closes the dataset
 *                     once its XXH64 is known; the file driver leaves the
 *                     chunk's pwrite to a worker (ckpt_vfd.c), so several
 *                     chunks are copied into the page cache at once;
 *                     asks the kernel to start writing back every
 *                     CK_WRITEBACK_BYTES, so that the final fsync does not
 *                     find the whole file dirty.
 * The file is the one the serial writer produced, byte for byte. */
#define CK_WRITEBACK_BYTES ((int64_t)64 << 20)
/* Memory of the pipeline: two bands of half CK_BAND_BYTES (one filled while
 * the other is cut into chunks) and chunk buffers of at most
 * PIPE_SLOT_BYTES in all (at least 6): 128 MB, never the model. */
#define PIPE_BAND_BYTES (CK_BAND_BYTES / 2)
#define PIPE_SLOT_BYTES ((size_t)64 << 20)

enum { SLOT_FREE = 0, SLOT_QUEUED, SLOT_READY };

typedef struct wslot {
    int state;
    int piece;
    int64_t row, nrows;   /* rows [row, row + nrows) of the piece */
    const char *src;      /* their bytes (resident data or a band buffer) */
    int band;             /* band buffer of src, -1: resident */
    size_t bytes, cb;     /* data bytes; chunk bytes (zero-padded) */
    int first, last;      /* first / last chunk of its piece */
    int written, hashed;  /* HDF5 call made; XXH64 updated */
    int io;               /* its pwrite is with a worker */
    int64_t addr;         /* where (file offset) */
    int fd, dfd;          /* the file; its O_DIRECT descriptor or -1 */
    char *buf;            /* cb + 4 */
} wslot;

typedef struct wpipe {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    const char *path;
    const mt_tensor_desc *d;
    int n;
    mt_ckpt_fill_fn fill;
    void *fill_ctx;
    wslot *slot;
    int nslots;
    int64_t n_chunks;     /* total, known when the producer is done (-1 before) */
    int64_t produced;     /* chunks handed out */
    int inflight;         /* worker tasks running */
    int band_refs[2];     /* chunks whose rows are in band buffer b, not yet copied */
    void *band[2];
    mt_xxh64 *hash;       /* [n] */
    uint64_t *digest;     /* [n] */
    int failed;
    int err;
    char msg[1024];
} wpipe;

/* Records the first failure (its message copied: mt_errmsg is per thread). */
static void pipe_fail(wpipe *p, int rc)
{
    pthread_mutex_lock(&p->mu);
    if (!p->failed) {
        p->failed = 1;
        p->err = rc;
        snprintf(p->msg, sizeof p->msg, "%s", mt_errmsg());
    }
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

typedef struct wtask {
    wpipe *p;
    wslot *s;
} wtask;

static void prepare_task(void *arg)
{
    wtask *t = arg;
    wslot *s = t->s;
    memcpy(s->buf, s->src, s->bytes);
    if (s->bytes < s->cb) memset(s->buf + s->bytes, 0, s->cb - s->bytes);
    uint32_t f = ck_fletcher32(s->buf, s->cb);
    for (int k = 0; k < 4; k++) s->buf[s->cb + (size_t)k] = (char)((f >> (8 * k)) & 0xff);
    wpipe *p = t->p;
    pthread_mutex_lock(&p->mu);
    s->state = SLOT_READY;
    if (s->band >= 0) p->band_refs[s->band]--;
    p->inflight--;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Producer: hands chunk rows [row, row + nrows) of piece i to a free slot
 * (in ring order). 0, or -1 once the pipeline failed. */
static int produce(wpipe *p, wtask *tasks, int i, int64_t row, int64_t nrows, const char *src,
                   int band, int first, int last)
{
    const int64_t seq = p->produced;
    wslot *s = &p->slot[seq % p->nslots];
    pthread_mutex_lock(&p->mu);
    while (s->state != SLOT_FREE && !p->failed) pthread_cond_wait(&p->cv, &p->mu);
    if (p->failed) {
        pthread_mutex_unlock(&p->mu);
        return -1;
    }
    s->state = SLOT_QUEUED;
    s->piece = i;
    s->row = row;
    s->nrows = nrows;
    s->src = src;
    s->band = band;
    s->bytes = (size_t)nrows * row_bytes(&p->d[i]);
    s->cb = chunk_bytes(&p->d[i], NULL);
    s->first = first;
    s->last = last;
    s->written = s->hashed = 0;
    if (band >= 0) p->band_refs[band]++;
    p->inflight++;
    p->produced++;
    pthread_mutex_unlock(&p->mu);
    wtask *t = &tasks[seq % p->nslots];
    t->p = p;
    t->s = s;
    ck_pool_submit(prepare_task, t);
    return 0;
}

typedef struct producer_arg {
    wpipe *p;
    wtask *tasks;
} producer_arg;

static void *producer_main(void *arg)
{
    producer_arg *a = arg;
    wpipe *p = a->p;
    int band_no = 0, rc = MT_OK;
    for (int i = 0; i < p->n && rc == MT_OK; i++) {
        const mt_tensor_desc *d = &p->d[i];
        const size_t rb = row_bytes(d), es = mt_dtype_size(d->dtype);
        const int64_t rows = d->count[0], cols = d->ndim == 1 ? 1 : d->count[1];
        int64_t cr;
        chunk_bytes(d, &cr);
        /* bands: a power of two >= the chunk rows (also powers of two) */
        const int64_t br = d->data ? rows : ck_band_rows_within(rows, cols, es, PIPE_BAND_BYTES);
        for (int64_t a0 = 0; a0 < rows && rc == MT_OK; a0 += br) {
            const int64_t nr = rows - a0 < br ? rows - a0 : br;
            const char *src = d->data;
            int b = -1;
            if (!d->data) {
                b = band_no++ % 2;
                pthread_mutex_lock(&p->mu);
                while (p->band_refs[b] && !p->failed) pthread_cond_wait(&p->cv, &p->mu);
                int failed = p->failed;
                pthread_mutex_unlock(&p->mu);
                if (failed) {
                    rc = MT_EGENERIC;
                    break;
                }
                mt_tensor_desc bd = *d;
                bd.off[0] = d->off[0] + a0;
                bd.count[0] = nr;
                bd.data = p->band[b];
                if ((rc = p->fill(p->fill_ctx, i, &bd, p->band[b])) < 0) {
                    pipe_fail(p, rc);
                    break;
                }
                src = p->band[b];
            } else {
                src = (const char *)d->data + (size_t)a0 * rb;
            }
            for (int64_t r = 0; r < nr && rc == MT_OK; r += cr) {
                const int64_t n = nr - r < cr ? nr - r : cr;
                if (produce(p, a->tasks, i, a0 + r, n, src + (size_t)r * rb, b, a0 + r == 0,
                            a0 + r + n == rows) < 0)
                    rc = MT_EGENERIC;
            }
        }
    }
    pthread_mutex_lock(&p->mu);
    p->n_chunks = p->produced;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* Waits until slot seq is ready (or the pipeline is over: 0 returned). */
static wslot *wait_ready(wpipe *p, int64_t seq, int *hashed_too)
{
    wslot *s = &p->slot[seq % p->nslots];
    pthread_mutex_lock(&p->mu);
    for (;;) {
        if (p->failed || (p->n_chunks >= 0 && seq >= p->n_chunks)) {
            s = NULL;
            break;
        }
        if (seq < p->produced && s->state == SLOT_READY && (!hashed_too || s->hashed)) break;
        pthread_cond_wait(&p->cv, &p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return s;
}

/* Marks the writer's or the hasher's part of a slot done; frees it after
 * both and its pwrite. */
static void slot_done(wpipe *p, wslot *s, int hasher)
{
    pthread_mutex_lock(&p->mu);
    if (hasher) s->hashed = 1;
    else s->written = 1;
    if (s->hashed && s->written && !s->io) s->state = SLOT_FREE;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

typedef struct iotask {
    wpipe *p;
    wslot *s;
} iotask;

/* A worker writes a chunk the driver left to us. */
static void write_task(void *arg)
{
    iotask *t = arg;
    wpipe *p = t->p;
    wslot *s = t->s;
    const char *b = s->buf;
    size_t n = s->cb + 4;
    off_t at = (off_t)s->addr;
    int err = 0, fd = s->fd;
    if (s->dfd >= 0 && s->addr % CK_DIRECT_ALIGN == 0 && s->cb % CK_DIRECT_ALIGN == 0 &&
        (uintptr_t)b % CK_DIRECT_ALIGN == 0) {
        /* the chunk's data past the page cache, its checksum through it;
         * anything short of the whole data goes again through the page cache */
        ssize_t k;
        do k = pwrite(s->dfd, b, s->cb, at);
        while (k < 0 && errno == EINTR);
        if (k == (ssize_t)s->cb) {
            b += s->cb;
            n -= s->cb;
            at += (off_t)s->cb;
        } else if (k < 0 && errno == EINVAL) {
            ck_io_direct_refused(p->path, "writes", errno);
        }
    }
    while (n) {
        ssize_t k = pwrite(fd, b, n, at);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            err = k < 0 ? errno : ENOSPC;
            break;
        }
        b += k;
        n -= (size_t)k;
        at += k;
    }
    if (err) pipe_fail(p, MT_ERR(MT_EIO, "%s: tensor %s: write of %zu bytes at %lld failed: %s",
                                 p->path, p->d[s->piece].name, s->cb + 4, (long long)s->addr,
                                 strerror(err)));
    pthread_mutex_lock(&p->mu);
    s->io = 0;
    if (s->hashed && s->written) s->state = SLOT_FREE;
    p->inflight--;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void *hasher_main(void *arg)
{
    wpipe *p = arg;
    for (int64_t seq = 0;; seq++) {
        wslot *s = wait_ready(p, seq, NULL);
        if (!s) break;
        if (s->first) mt_xxh64_init(&p->hash[s->piece], 0);
        mt_xxh64_update(&p->hash[s->piece], s->buf, s->bytes);
        if (s->last) p->digest[s->piece] = mt_xxh64_digest(&p->hash[s->piece]);
        slot_done(p, s, 1);
    }
    return NULL;
}

/* Creates piece i's dataset with its attributes (HDF5 lock held). */
static int open_piece(hid_t f, const char *path, const mt_tensor_desc *d, hid_t *out)
{
    const int nd = d->ndim;
    const int64_t rows = d->count[0], cols = nd == 1 ? 1 : d->count[1];
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
out:
    if (rc < 0 && ds >= 0) H5Dclose(ds);
    else *out = ds;
    if (dcpl >= 0) H5Pclose(dcpl);
    if (sp >= 0) H5Sclose(sp);
    if (type >= 0) H5Tclose(type);
    return rc;
}

/* Checks the descriptors before anything starts. */
static int check_pieces(const char *path, const mt_tensor_desc *d, int n, mt_ckpt_fill_fn fill)
{
    for (int i = 0; i < n; i++) {
        const size_t es = mt_dtype_size(d[i].dtype);
        const int nd = d[i].ndim;
        const int64_t rows = d[i].count[0], cols = nd == 1 ? 1 : d[i].count[1];
        if (nd < 1 || nd > 2 || rows <= 0 || cols <= 0 || !es)
            return MT_ERR(MT_EINVAL, "%s: tensor %s: bad piece (ndim %d, count %lld x %lld, dtype %d)",
                          path, d[i].name, nd, (long long)rows, (long long)cols, (int)d[i].dtype);
        if (!d[i].data && !fill)
            return MT_ERR(MT_EINVAL, "%s: tensor %s: no data and no fill function", path, d[i].name);
    }
    return MT_OK;
}

/* The writer: this thread, in ring order (see the pipeline above). */
static int write_chunks(wpipe *p, hid_t f, int wfd, mt_ckpt_piece_rec *recs, mt_progress *prog)
{
    iotask *io = calloc((size_t)p->nslots, sizeof *io);
    if (!io) return MT_ERR(MT_ENOMEM, "%s: out of memory", p->path);
    hid_t ds = -1;
    char eb[256];
    int rc = MT_OK;
    int64_t since_wb = 0;
    /* the current piece's chunks as placed: the first's offset, the step
     * between them while equal (-1: unequal or not known) */
    int64_t at0 = -1, step = 0;
    for (int64_t seq = 0; rc == MT_OK; seq++) {
        wslot *s = wait_ready(p, seq, NULL);
        if (!s) break;
        const mt_tensor_desc *d = &p->d[s->piece];
        int64_t cr;
        chunk_bytes(d, &cr);
        ck_lock();
        if (s->first) rc = open_piece(f, p->path, d, &ds);
        hsize_t off[2] = {(hsize_t)s->row, 0};
        ck_vfd_expect(s->buf, s->cb + 4);
        if (rc == MT_OK && (s->row % cr != 0 || H5Dwrite_chunk(ds, H5P_DEFAULT, 0, off, s->cb + 4, s->buf) < 0))
            rc = MT_ERR(MT_EIO, "%s: tensor %s: write failed at row %lld (%s)", p->path, d->name,
                        (long long)s->row, ck_h5_errstr(eb, sizeof eb));
        int fd, dfd;
        int64_t addr;
        const int deferred = ck_vfd_take(&fd, &dfd, &addr);
        ck_unlock();
        const int64_t k = s->row / cr; /* the chunk's index in its piece */
        if (s->first) at0 = deferred ? addr : -1, step = 0;
        else if (!deferred || at0 < 0) at0 = -1;
        else if (k == 1) step = addr - at0;
        else if (addr != at0 + k * step) at0 = -1;
        if (deferred && rc == MT_OK) {
            pthread_mutex_lock(&p->mu);
            s->io = 1;
            s->fd = fd;
            s->dfd = dfd;
            s->addr = addr;
            p->inflight++;
            pthread_mutex_unlock(&p->mu);
            iotask *t = &io[seq % p->nslots];
            t->p = p;
            t->s = s;
            ck_pool_submit(write_task, t);
        }
        mt_progress_add(prog, (int64_t)s->bytes);
        since_wb += (int64_t)s->cb;
        if (wfd >= 0 && since_wb >= CK_WRITEBACK_BYTES) {
            /* start writing back what is dirty; returns without waiting */
            sync_file_range(wfd, 0, 0, SYNC_FILE_RANGE_WRITE);
            since_wb = 0;
        }
        if (rc == MT_OK && s->last) {
            /* the piece's XXH64 comes from the hasher, in order */
            if (!wait_ready(p, seq, &(int){1})) rc = MT_EGENERIC;
            ck_lock();
            if (rc == MT_OK) rc = ck_attr_u64(ds, "xxh64", p->digest[s->piece]);
            if (H5Dclose(ds) < 0 && rc == MT_OK)
                rc = MT_ERR(MT_EIO, "%s: tensor %s: close failed", p->path, d->name);
            ck_unlock();
            ds = -1;
            mt_ckpt_piece_rec *rec = &recs[s->piece];
            piece_rec_of(d, 0, rec); /* its rank: after the pipeline */
            rec->xxh64 = p->digest[s->piece];
            if (at0 >= 0 && (k == 0 || step >= (int64_t)s->cb + 4)) {
                rec->chunk_rows = cr;
                rec->chunk_addr = at0;
                rec->chunk_stride = k == 0 ? (int64_t)s->cb + 4 : step;
            }
        }
        slot_done(p, s, 0);
    }
    if (ds >= 0) {
        ck_lock();
        H5Dclose(ds);
        ck_unlock();
    }
    /* the chunks' pwrites end before the file closes (and io[] goes) */
    pthread_mutex_lock(&p->mu);
    while (p->inflight) pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    free(io);
    return rc;
}

int mt_ckpt_write_shard(const char *dir, int rank, const mt_tensor_desc *d, int n,
                        mt_ckpt_fill_fn fill, void *ctx, mt_ckpt_piece_rec *recs,
                        mt_progress *prog)
{
    char name[32], path[4200], eb[256];
    ck_shard_name(name, sizeof name, rank);
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path)
        return MT_ERR(MT_EINVAL, "%s: path too long", dir);
    MT_CHECK(check_pieces(path, d, n, fill));
    /* buffers: the ring of chunks, two bands for the pieces filled band by band */
    size_t band = 0, chunk = 0;
    for (int i = 0; i < n; i++) {
        const size_t es = mt_dtype_size(d[i].dtype);
        const int64_t cols = d[i].ndim == 1 ? 1 : d[i].count[1];
        const size_t c = chunk_bytes(&d[i], NULL) + 4;
        chunk = c > chunk ? c : chunk;
        if (d[i].data) continue;
        const size_t b = (size_t)ck_band_rows_within(d[i].count[0], cols, es, PIPE_BAND_BYTES) *
                         (size_t)cols * es;
        band = b > band ? b : band;
    }
    wpipe p;
    memset(&p, 0, sizeof p);
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    p.path = path;
    p.d = d;
    p.n = n;
    p.fill = fill;
    p.fill_ctx = ctx;
    p.n_chunks = -1;
    p.nslots = ck_io_threads() + 4;
    if ((size_t)p.nslots * chunk > PIPE_SLOT_BYTES) p.nslots = (int)(PIPE_SLOT_BYTES / chunk);
    if (p.nslots < 6) p.nslots = 6;
    p.slot = calloc((size_t)p.nslots, sizeof *p.slot);
    wtask *tasks = calloc((size_t)p.nslots, sizeof *tasks);
    p.hash = calloc((size_t)n + 1, sizeof *p.hash);
    p.digest = calloc((size_t)n + 1, sizeof *p.digest);
    int rc = MT_OK;
    if (!p.slot || !tasks || !p.hash || !p.digest) rc = MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    for (int k = 0; k < p.nslots && rc == MT_OK; k++)
        if (posix_memalign((void **)&p.slot[k].buf, 4096, chunk ? chunk : 4) != 0)
            rc = MT_ERR(MT_ENOMEM, "%s: out of memory for %d chunk buffers of %zu bytes", path,
                        p.nslots, chunk);
    for (int b = 0; b < 2 && band && rc == MT_OK; b++)
        if (!(p.band[b] = malloc(band)))
            rc = MT_ERR(MT_ENOMEM, "%s: out of memory for a %zu-byte band", path, band);
    hid_t f = -1;
    if (rc == MT_OK) {
        ck_lock();
        f = create_file(path, 0, 1);
        int64_t r64 = rank, ver = MT_CKPT_FORMAT_VERSION;
        if (f < 0)
            rc = MT_ERR(MT_EIO, "%s: cannot create (%s)", path, ck_h5_errstr(eb, sizeof eb));
        if (rc == MT_OK) rc = ck_attr_str(f, "format", MT_CKPT_FORMAT);
        if (rc == MT_OK) rc = ck_attr_i64(f, "format_version", &ver, 1);
        if (rc == MT_OK) rc = ck_attr_i64(f, "rank", &r64, 1);
        ck_unlock();
    }
    if (rc == MT_OK) {
        const char *wb = getenv("MT_CKPT_WRITEBACK");
        int wfd = wb && !strcmp(wb, "0") ? -1 : open(path, O_RDONLY);
        producer_arg pa = {&p, tasks};
        pthread_t prod, hasher;
        int have_prod = pthread_create(&prod, NULL, producer_main, &pa) == 0;
        int have_hasher = have_prod && pthread_create(&hasher, NULL, hasher_main, &p) == 0;
        if (!have_prod || !have_hasher) {
            rc = MT_ERR(MT_EGENERIC, "%s: cannot start the writer threads", path);
            pipe_fail(&p, rc);
        } else {
            rc = write_chunks(&p, f, wfd, recs, prog);
            if (rc < 0) pipe_fail(&p, rc);
        }
        if (have_prod) pthread_join(prod, NULL);
        if (have_hasher) pthread_join(hasher, NULL);
        /* the workers hold buffers until their tasks end */
        pthread_mutex_lock(&p.mu);
        while (p.inflight) pthread_cond_wait(&p.cv, &p.mu);
        pthread_mutex_unlock(&p.mu);
        if (wfd >= 0) close(wfd);
        if (p.failed) rc = MT_ERR(p.err < 0 ? p.err : MT_EIO, "%s", p.msg);
        for (int i = 0; i < n && rc == MT_OK; i++) recs[i].rank = rank;
    }
    if (f >= 0) {
        ck_lock();
        if (H5Fclose(f) < 0 && rc == MT_OK)
            rc = MT_ERR(MT_EIO, "%s: close failed (%s)", path, ck_h5_errstr(eb, sizeof eb));
        ck_unlock();
    }
    for (int k = 0; p.slot && k < p.nslots; k++) free(p.slot[k].buf);
    free(p.slot);
    free(tasks);
    free(p.band[0]);
    free(p.band[1]);
    free(p.hash);
    free(p.digest);
    pthread_mutex_destroy(&p.mu);
    pthread_cond_destroy(&p.cv);
    /* one fsync per file, at the end */
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

hid_t ck_chunk_row_type(void)
{
    hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(chunk_row));
    H5Tinsert(t, "rows", HOFFSET(chunk_row, rows), H5T_STD_I64LE);
    H5Tinsert(t, "addr", HOFFSET(chunk_row, addr), H5T_STD_I64LE);
    H5Tinsert(t, "stride", HOFFSET(chunk_row, stride), H5T_STD_I64LE);
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

/* The index's rows of the pieces recs[n] (grouped by tensor in the order
 * of recs) and of the tensors of map, every tensor's tiling checked. */
static int index_rows(const char *path, const mt_shard_map *map, const mt_ckpt_piece_rec *recs, int n,
                      tensor_row **trp, piece_row **prp, chunk_row **crp)
{
    int *order = NULL, *first = NULL;
    MT_CHECK(collect(map, recs, n, &order, &first));
    tensor_row *tr = calloc((size_t)map->n_tensors + 1, sizeof *tr);
    piece_row *pr = calloc((size_t)n + 1, sizeof *pr);
    chunk_row *cr = crp ? calloc((size_t)n + 1, sizeof *cr) : NULL;
    const mt_ckpt_piece_rec **pp = malloc((size_t)(n + 1) * sizeof *pp);
    int rc = MT_OK;
    if (!tr || !pr || !pp || (crp && !cr)) rc = MT_ERR(MT_ENOMEM, "index: out of memory");
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
            if (cr && r->chunk_rows > 0)
                cr[k] = (chunk_row){r->chunk_rows, r->chunk_addr, r->chunk_stride};
        }
    }
    free(order);
    free(first);
    free((void *)pp);
    if (rc < 0) {
        free(tr);
        free(pr);
        free(cr);
        return rc;
    }
    *trp = tr;
    *prp = pr;
    if (crp) *crp = cr;
    return MT_OK;
}

/* The shard files of recs[n] with their sizes now (truncation shows at
 * load). */
static int index_files(const char *dir, const mt_ckpt_piece_rec *recs, int n, file_row **frp, int *nf)
{
    int max_rank = -1, rc = MT_OK;
    for (int i = 0; i < n; i++) max_rank = recs[i].rank > max_rank ? recs[i].rank : max_rank;
    char *seen = calloc((size_t)max_rank + 2, 1);
    file_row *fr = calloc((size_t)max_rank + 2, sizeof *fr);
    *nf = 0;
    if (!seen || !fr) rc = MT_ERR(MT_ENOMEM, "index: out of memory");
    for (int i = 0; i < n && rc == MT_OK; i++) seen[recs[i].rank] = 1;
    for (int r = 0; r <= max_rank && rc == MT_OK; r++) {
        if (!seen[r]) continue;
        file_row *x = &fr[(*nf)++];
        ck_shard_name(x->name, sizeof x->name, r);
        x->rank = r;
        char sp[4300];
        snprintf(sp, sizeof sp, "%s/%s", dir, x->name);
        struct stat st;
        if (stat(sp, &st) != 0) rc = MT_ERR(MT_EIO, "%s: missing: %s", sp, strerror(errno));
        x->bytes = (int64_t)st.st_size;
    }
    free(seen);
    if (rc < 0) {
        free(fr);
        return rc;
    }
    *frp = fr;
    return MT_OK;
}

/* An index being written: open from its begin to its finish. */
struct mt_ckpt_index {
    char dir[4096], path[4200];
    const mt_shard_map *map;
    hid_t f, g;
    tensor_row *tr;
    piece_row *pr;       /* the rows the virtual datasets were made of */
    int n;
};

/* Creates the index with what does not depend on the pieces' checksums or
 * the files' sizes: metadata, the tensor table, one virtual dataset per
 * global tensor over its pieces (pr). */
static int index_open(mt_ckpt_index *ix, const mt_ckpt_meta *meta)
{
    char eb[256];
    const mt_shard_map *map = ix->map;
    int rc = MT_OK;
    ck_lock();
    ix->f = create_file(ix->path, CK_INDEX_USERBLOCK, 0);
    if (ix->f < 0) {
        ck_unlock();
        return MT_ERR(MT_EIO, "%s: cannot create (%s)", ix->path, ck_h5_errstr(eb, sizeof eb));
    }
    int64_t ver = MT_CKPT_FORMAT_VERSION;
    char *lj = ck_layout_json(&meta->layout), *oj = ck_opts_json(&meta->opts);
    int64_t pos[3] = {meta->step, meta->consumed_samples, meta->consumed_tokens};
    if (!lj || !oj) rc = MT_ERR(MT_ENOMEM, "index: out of memory");
    if (rc == MT_OK) rc = ck_attr_str(ix->f, "format", MT_CKPT_FORMAT);
    if (rc == MT_OK) rc = ck_attr_i64(ix->f, "format_version", &ver, 1);
    if (rc == MT_OK) rc = ck_attr_i64(ix->f, "step", &meta->step, 1);
    if (rc == MT_OK) {
        ix->g = H5Gcreate2(ix->f, CK_META_GROUP, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        if (ix->g < 0) rc = MT_ERR(MT_EHDF5, "%s: cannot create group %s", ix->path, CK_META_GROUP);
    }
    if (rc == MT_OK) rc = ck_attr_i64(ix->g, "step_samples_tokens", pos, 3);
    if (rc == MT_OK) rc = ck_write_string(ix->g, "config", meta->config_json ? meta->config_json : "{}");
    if (rc == MT_OK) rc = ck_write_string(ix->g, "job", meta->job_json ? meta->job_json : "null");
    if (rc == MT_OK) rc = ck_write_string(ix->g, "state", meta->state_json ? meta->state_json : "{}");
    if (rc == MT_OK) rc = ck_write_string(ix->g, "layout", lj);
    if (rc == MT_OK) rc = ck_write_string(ix->g, "contents", oj);
    free(lj);
    free(oj);
    hid_t tt = ck_tensor_row_type();
    if (rc == MT_OK) rc = write_table(ix->g, "tensors", tt, ix->tr, (size_t)map->n_tensors);
    H5Tclose(tt);
    for (int t = 0; t < map->n_tensors && rc == MT_OK; t++)
        rc = write_vds(ix->f, &map->tensors[t], ix->pr + ix->tr[t].first_piece, (int)ix->tr[t].n_pieces);
    ck_unlock();
    return rc;
}

static void index_free(mt_ckpt_index *ix)
{
    ck_lock();
    if (ix->g >= 0) H5Gclose(ix->g);
    if (ix->f >= 0) H5Fclose(ix->f);
    ck_unlock();
    free(ix->tr);
    free(ix->pr);
    free(ix);
}

/* The pieces' rows pr[n] (with their checksums) and the files' table, then
 * the index closed, sealed and fsynced; ix freed. */
static int index_close(mt_ckpt_index *ix, const piece_row *pr, const chunk_row *cr, int n,
                       const file_row *fr, int nf)
{
    char eb[256], path[4200];
    snprintf(path, sizeof path, "%s", ix->path);
    int rc = MT_OK;
    ck_lock();
    hid_t pt = ck_piece_row_type(), ft = ck_file_row_type(), ct = ck_chunk_row_type();
    rc = write_table(ix->g, "pieces", pt, pr, (size_t)n);
    if (rc == MT_OK) rc = write_table(ix->g, "files", ft, fr, (size_t)nf);
    if (rc == MT_OK) rc = write_table(ix->g, "chunks", ct, cr, (size_t)n);
    H5Tclose(pt);
    H5Tclose(ft);
    H5Tclose(ct);
    H5Gclose(ix->g);
    ix->g = -1;
    if (H5Fclose(ix->f) < 0 && rc == MT_OK)
        rc = MT_ERR(MT_EIO, "%s: close failed (%s)", path, ck_h5_errstr(eb, sizeof eb));
    ix->f = -1;
    ck_unlock();
    index_free(ix);
    if (rc == MT_OK) rc = ck_index_seal(path);
    if (rc == MT_OK) rc = mt_fsync_path(path);
    return rc;
}

static int index_new(mt_ckpt_index **out, const char *dir, const mt_shard_map *map)
{
    mt_ckpt_index *ix = calloc(1, sizeof *ix);
    if (!ix) return MT_ERR(MT_ENOMEM, "index: out of memory");
    snprintf(ix->dir, sizeof ix->dir, "%s", dir);
    snprintf(ix->path, sizeof ix->path, "%s/%s", dir, CK_INDEX);
    ix->map = map;
    ix->f = ix->g = -1;
    *out = ix;
    return MT_OK;
}

int mt_ckpt_write_index(const char *dir, const mt_ckpt_meta *meta, const mt_shard_map *map,
                        const mt_ckpt_piece_rec *recs, int n)
{
    mt_ckpt_index *ix = NULL; /* set by index_new on success */
    MT_CHECK(index_new(&ix, dir, map));
    file_row *fr = NULL;
    chunk_row *cr = NULL;
    int nf = 0;
    int rc = index_rows(ix->path, map, recs, n, &ix->tr, &ix->pr, &cr);
    ix->n = n;
    if (rc == MT_OK) rc = index_files(dir, recs, n, &fr, &nf);
    if (rc == MT_OK) rc = index_open(ix, meta);
    if (rc < 0) {
        free(fr);
        free(cr);
        index_free(ix);
        return rc;
    }
    rc = index_close(ix, ix->pr, cr, n, fr, nf);
    free(fr);
    free(cr);
    return rc;
}

int mt_ckpt_index_begin(mt_ckpt_index **out, const char *dir, const mt_ckpt_meta *meta,
                        const mt_shard_map *map)
{
    *out = NULL;
    mt_ckpt_index *ix = NULL;
    MT_CHECK(index_new(&ix, dir, map));
    /* the pieces as their writers will record them, checksums aside */
    mt_ckpt_piece_rec *recs = calloc((size_t)map->n_pieces + 1, sizeof *recs);
    int rc = recs ? MT_OK : MT_ERR(MT_ENOMEM, "index: out of memory");
    for (int p = 0; p < map->n_pieces && rc == MT_OK; p++) {
        mt_tensor_desc d;
        mt_shard_piece_desc(map, p, &d);
        piece_rec_of(&d, map->pieces[p].writer, &recs[p]);
    }
    if (rc == MT_OK) rc = index_rows(ix->path, map, recs, map->n_pieces, &ix->tr, &ix->pr, NULL);
    ix->n = map->n_pieces;
    free(recs);
    if (rc == MT_OK) rc = index_open(ix, meta);
    if (rc < 0) {
        index_free(ix);
        return rc;
    }
    *out = ix;
    return MT_OK;
}

/* Whether rows a[n] and b[n] of one tensor are the same pieces (any
 * order), checksums aside. */
static int same_pieces(const piece_row *a, const piece_row *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        int64_t j = 0;
        while (j < n && !(a[i].rank == b[j].rank && a[i].offset[0] == b[j].offset[0] &&
                          a[i].offset[1] == b[j].offset[1] && a[i].count[0] == b[j].count[0] &&
                          a[i].count[1] == b[j].count[1] && a[i].nbytes == b[j].nbytes))
            j++;
        if (j == n) return 0;
    }
    return 1;
}

int mt_ckpt_index_finish(mt_ckpt_index *ix, const mt_ckpt_piece_rec *recs, int n)
{
    tensor_row *tr = NULL;
    piece_row *pr = NULL;
    chunk_row *cr = NULL;
    file_row *fr = NULL;
    int nf = 0;
    int rc = index_rows(ix->path, ix->map, recs, n, &tr, &pr, &cr);
    /* the virtual datasets were made from the map: the written pieces must be its pieces */
    if (rc == MT_OK && n != ix->n)
        rc = MT_ERR(MT_EINVAL, "%s: %d pieces written, the shard map has %d", ix->path, n, ix->n);
    for (int t = 0; t < ix->map->n_tensors && rc == MT_OK; t++)
        if (tr[t].n_pieces != ix->tr[t].n_pieces ||
            !same_pieces(pr + tr[t].first_piece, ix->pr + ix->tr[t].first_piece, tr[t].n_pieces))
            rc = MT_ERR(MT_EINVAL, "%s: tensor %s: the pieces written are not the shard map's", ix->path,
                        tr[t].name);
    if (rc == MT_OK) rc = index_files(ix->dir, recs, n, &fr, &nf);
    if (rc == MT_OK) rc = index_close(ix, pr, cr, n, fr, nf);
    else index_free(ix);
    free(tr);
    free(pr);
    free(cr);
    free(fr);
    return rc;
}

void mt_ckpt_index_abort(mt_ckpt_index *ix)
{
    if (ix) index_free(ix);
}
