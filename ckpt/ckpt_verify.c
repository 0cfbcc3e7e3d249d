/* ckpt_verify.c - mt_ckpt_verify: every byte of every shard file read and
 * checked (Fletcher32 of each chunk, XXH64 of each piece), the datasets'
 * attributes, the files' sizes and contents, the index's virtual datasets.
 *
 * The data is checked at disk speed across files and pieces (issue 23: a
 * 4-rank checkpoint verified at 73 % of dd when the pieces were checked
 * one after another): this thread walks the pieces in index order, asks
 * a thread of its own for each piece's attributes and chunk addresses
 * (HDF5 under its lock, up to 256 pieces ahead of the reads), and hands
 * the chunks to the pool's workers with at most `window` chunks
 * in flight (MT_CKPT_VERIFY_CHUNKS; default 2 x workers + 2, so the memory
 * is window x the largest chunk: about 136 MB with 16 workers and 4 MB
 * chunks, never the model). A worker preads its chunk (O_DIRECT as the
 * loader does, MT_CKPT_DIRECT_READ), checks its Fletcher32, then feeds the
 * piece's XXH64 in chunk order: whichever worker completes the chunk that
 * is next in its piece hashes it and the ready ones after it, so no task
 * waits for another and pieces of every file hash side by side. A piece's
 * result is its first failing chunk in row order, else its XXH64: what a
 * reader checking the chunks one by one finds. Problems are reported in
 * piece order, each piece as soon as it and those before it are done, so
 * the report (and the error's first problem) does not depend on the
 * workers' timing: MT_CKPT_VERIFY_CHUNKS=1 (one chunk at a time) gives the
 * same report, which the tests compare. The metadata thread then checks
 * the files' objects and the index's virtual datasets while the last
 * chunks are read; their problems are reported after the data's.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt/ckpt_internal.h"
#include "ckpt/xxh64.h"
#include "base/mt_clock.h"
#include "base/mt_log.h"
#include "base/mt_status.h"

void ck_problem(ck_problems *v, const char *file, const char *tensor, const char *fmt, ...)
{
    char msg[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!v->n)
        snprintf(v->first, sizeof v->first, "%s%s%s%s%s", file, tensor && tensor[0] ? ": tensor " : "",
                 tensor ? tensor : "", ": ", msg);
    v->n++;
    if (v->report) v->report(v->ctx, file, tensor ? tensor : "", msg);
}

/* ---- the pieces' data, in parallel ----------------------------------------------------- */

enum { SLOT_FREE = 0, SLOT_READING, SLOT_READY };

struct vrun;

/* A piece being checked: from its first chunk handed out to its last hashed. */
typedef struct vact {
    int p;                 /* piece, -1: entry free */
    int fi;
    int64_t cr, rows;      /* rows per chunk, rows of the piece */
    size_t row, cb;        /* bytes of a row; data bytes of a stored chunk */
    int64_t n, next;       /* chunks; the next one to hash */
    int64_t fail;          /* the first chunk (in row order) that failed; n: none */
    int hashing;           /* a worker is hashing it */
    int cut;               /* fewer chunks handed out (out of memory): no verdict */
    mt_xxh64 h;
    char path[4300];
    char msg[600];         /* the failure of chunk `fail` */
} vact;

typedef struct vslot {
    struct vrun *run;
    vact *a;
    int state;
    int64_t c, addr;       /* chunk index in the piece, file offset */
    char *buf;             /* ck_chunk_buf_alloc(cap) */
    size_t cap;
    const char *data;      /* the chunk in buf once read */
    int rc;
    char msg[600];
} vslot;

typedef struct vrun {
    mt_ckpt *ck;
    pthread_mutex_t mu;
    pthread_cond_t cv;     /* a slot freed, a piece finished */
    int window, free_slots, busy_acts;
    vslot *slots;          /* [window] */
    vact *acts;            /* [window + 1] */
    char **msg;            /* [n_pieces][2]: attributes, data; malloc'd text or NULL */
    char *finished;        /* [n_pieces] */
    int64_t done_bytes;    /* hashed or skipped, for the progress */
    /* the metadata thread (meta_main): pieces [taken, meta_next) have
     * their metadata in ahead[], at most META_AHEAD of them; then the
     * late checks; stop: the dispatcher gave up (mu) */
    char *bad;             /* [n_files]: missing or truncated files (its own) */
    struct pmeta *ahead;   /* [META_AHEAD]: piece p at p % META_AHEAD */
    int meta_next, taken, stop;
    struct late_buf *late;
    /* where the time goes (MOETRAIN_LOG=debug): the metadata thread in
     * HDF5, the dispatcher waiting for metadata and for a free slot */
    double meta_ms, meta_wait_ms, slot_wait_ms;
    int64_t chunks;
} vrun;

static char *dup_msg(const char *s)
{
    char *d = strdup(s);
    return d ? d : strdup("out of memory");
}

/* The piece's outcome into run->msg (mu held): its first failing chunk,
 * else its XXH64 against the index. Frees the entry. */
static void act_finish(vrun *run, vact *a)
{
    const mt_ckpt_piece_rec *r = &run->ck->pieces[a->p];
    char m[1024];
    if (a->cut) {
        /* no verdict: verify fails with the error that cut it */
    } else if (a->fail < a->n) {
        run->msg[2 * a->p + 1] = dup_msg(a->msg);
    } else if (mt_xxh64_digest(&a->h) != r->xxh64) {
        ck_piece_hash_msg(m, sizeof m, a->path, r, mt_xxh64_digest(&a->h));
        run->msg[2 * a->p + 1] = dup_msg(m);
    }
    run->finished[a->p] = 1;
    a->p = -1;
    run->busy_acts--;
    pthread_cond_broadcast(&run->cv);
}

static vslot *slot_of(vrun *run, const vact *a, int64_t c)
{
    for (int i = 0; i < run->window; i++)
        if (run->slots[i].a == a && run->slots[i].c == c && run->slots[i].state != SLOT_FREE)
            return &run->slots[i];
    return NULL;
}

/* Hashes the chunks of a that are ready, in order, from a->next (mu held;
 * released around each hash). */
static void act_hash(vrun *run, vact *a)
{
    a->hashing = 1;
    vslot *s;
    while (a->next < a->n && (s = slot_of(run, a, a->next)) && s->state == SLOT_READY) {
        const int64_t nr = a->rows - s->c * a->cr < a->cr ? a->rows - s->c * a->cr : a->cr;
        const size_t bytes = (size_t)nr * a->row;
        if (a->fail > s->c) { /* no failure before it: its bytes count */
            pthread_mutex_unlock(&run->mu);
            mt_xxh64_update(&a->h, s->data, bytes);
            pthread_mutex_lock(&run->mu);
        }
        s->state = SLOT_FREE;
        s->a = NULL;
        run->free_slots++;
        run->done_bytes += (int64_t)bytes;
        a->next++;
        pthread_cond_broadcast(&run->cv);
    }
    a->hashing = 0;
    if (a->next == a->n) act_finish(run, a);
}

static void chunk_task(void *arg)
{
    vslot *s = arg;
    vrun *run = s->run;
    vact *a = s->a;
    int err = 0;
    const char *data = ck_chunk_pread(run->ck, a->fi, s->buf, a->cb + 4, s->addr, &err);
    s->rc = ck_chunk_check(data, err, a->cb, a->path, run->ck->pieces[a->p].tensor, s->c * a->cr,
                           s->msg, sizeof s->msg);
    pthread_mutex_lock(&run->mu);
    s->data = data;
    s->state = SLOT_READY;
    if (s->rc < 0 && s->c < a->fail) {
        a->fail = s->c;
        snprintf(a->msg, sizeof a->msg, "%s", s->msg);
    }
    if (!a->hashing && s->c == a->next) act_hash(run, a);
    pthread_mutex_unlock(&run->mu);
}

/* Reports the problems of the finished pieces from *rep on, in order,
 * and the progress (this thread only). */
static void flush(vrun *run, int *rep, ck_problems *v, mt_progress *prog, int64_t *shown)
{
    pthread_mutex_lock(&run->mu);
    const int64_t done = run->done_bytes;
    int upto = *rep;
    while (upto < run->ck->n_pieces && run->finished[upto]) upto++;
    pthread_mutex_unlock(&run->mu);
    if (done > *shown) {
        mt_progress_add(prog, done - *shown);
        *shown = done;
    }
    for (; *rep < upto; (*rep)++) {
        const mt_ckpt_piece_rec *r = &run->ck->pieces[*rep];
        char name[32], path[4300];
        ck_shard_name(name, sizeof name, r->rank);
        snprintf(path, sizeof path, "%s/%s", run->ck->dir, name);
        for (int k = 0; k < 2; k++) {
            char *m = run->msg[2 * *rep + k];
            if (m) ck_problem(v, path, r->tensor, "%s", m);
            free(m);
            run->msg[2 * *rep + k] = NULL;
        }
    }
}

/* A piece that is not in moetrain's chunk layout (a file another tool
 * rewrote): read through HDF5 band by band (bounded memory), its XXH64
 * over the bands. NULL if it is intact, else the problem (malloc'd). */
static char *check_through_hdf5(mt_ckpt *ck, int p, const char *path)
{
    const mt_ckpt_piece_rec *r = &ck->pieces[p];
    const mt_ckpt_tensor *x = &ck->tensors[mt_ckpt_find(ck, r->tensor)];
    const size_t es = mt_dtype_size(x->dtype);
    const int64_t cols = x->ndim == 2 ? r->count[1] : 1;
    const int64_t br = ck_band_rows(r->count[0], cols, es);
    void *buf = malloc((size_t)br * (size_t)cols * es);
    if (!buf) return dup_msg("out of memory");
    mt_xxh64 h;
    mt_xxh64_init(&h, 0);
    char *bad = NULL;
    for (int64_t a = 0; a < r->count[0] && !bad; a += br) {
        const int64_t nr = r->count[0] - a < br ? r->count[0] - a : br;
        mt_tensor_desc d;
        mt_tensor_desc_slab(&d, r->tensor, x->dtype, x->ndim, x->shape, r->off[0] + a, r->off[1],
                            nr, cols, buf);
        /* only this piece: other pieces of the tensor do not intersect it */
        if (ck_read_piece(ck, p, &d) < 0) bad = dup_msg(mt_errmsg());
        else mt_xxh64_update(&h, buf, (size_t)nr * (size_t)cols * es);
    }
    free(buf);
    if (!bad && mt_xxh64_digest(&h) != r->xxh64) {
        char m[1024];
        ck_piece_hash_msg(m, sizeof m, path, r, mt_xxh64_digest(&h));
        bad = dup_msg(m);
    }
    return bad;
}

/* The attributes of piece p against the index, then its chunks (HDF5 lock
 * held). 1: chunks in *addr, *cr rows each; 0: go through HDF5; -1: no
 * data to check (problem recorded). */
static int piece_meta(vrun *run, int p, int64_t *cr, int64_t **addr)
{
    mt_ckpt *ck = run->ck;
    const mt_ckpt_piece_rec *r = &ck->pieces[p];
    const mt_ckpt_tensor *x = &ck->tensors[mt_ckpt_find(ck, r->tensor)];
    char m[900], eb[256];
    hid_t f;
    if (ck_piece_file(ck, p, &f) < 0) {
        run->msg[2 * p] = dup_msg(mt_errmsg());
        return -1;
    }
    hid_t ds = H5Dopen2(f, r->tensor, H5P_DEFAULT);
    if (ds < 0) {
        snprintf(m, sizeof m, "dataset missing (%s)", ck_h5_errstr(eb, sizeof eb));
        run->msg[2 * p] = dup_msg(m);
        return -1;
    }
    int64_t gs[2] = {0, 0}, off[2] = {0, 0};
    char dt[16] = "";
    if (ck_attr_read_str(ds, "dtype", dt, sizeof dt) < 0 || strcmp(dt, mt_dtype_name(x->dtype)) ||
        ck_attr_read_i64(ds, "global_shape", gs, x->ndim) < 0 || gs[0] != x->shape[0] ||
        (x->ndim == 2 && gs[1] != x->shape[1]) || ck_attr_read_i64(ds, "offset", off, x->ndim) < 0 ||
        off[0] != r->off[0] || (x->ndim == 2 && off[1] != r->off[1])) {
        snprintf(m, sizeof m, "dataset attributes (dtype %s, global_shape, offset) disagree with the index",
                 dt);
        run->msg[2 * p] = dup_msg(m);
    }
    H5Dclose(ds);
    if (ck_piece_chunks(ck, p, cr, addr) < 0) {
        run->msg[2 * p + 1] = dup_msg(mt_errmsg());
        return -1;
    }
    /* a load reads the chunks where the index says (FORMAT.md, `chunks`) */
    if (r->chunk_rows > 0) {
        int64_t k = 0, n = *cr > 0 ? (r->count[0] + *cr - 1) / *cr : 0;
        while (k < n && (*addr)[k] == r->chunk_addr + k * r->chunk_stride) k++;
        if (*cr != r->chunk_rows || k < n) {
            snprintf(m, sizeof m,
                     "the index's chunks table (%lld rows a chunk, at %lld, every %lld bytes) "
                     "disagrees with the dataset's chunks (%lld rows a chunk; chunk %lld at %lld)",
                     (long long)r->chunk_rows, (long long)r->chunk_addr, (long long)r->chunk_stride,
                     (long long)*cr, (long long)k, (long long)(k < n ? (*addr)[k] : -1));
            if (!run->msg[2 * p]) run->msg[2 * p] = dup_msg(m);
        }
    }
    return *cr > 0;
}

/* MT_CKPT_VERIFY_CHUNKS, else 2 x the workers + 2. */
static int verify_window(void)
{
    const char *e = getenv("MT_CKPT_VERIFY_CHUNKS");
    int n = e ? atoi(e) : 0;
    if (n >= 1) return n > 1024 ? 1024 : n;
    return 2 * ck_io_threads() + 2;
}

/* The pieces' HDF5 metadata ahead of their chunks, on a thread of its own.
 * Asked piece by piece right before each piece's chunks, it ran in series
 * with the reads (230-340 ms of a 1.2-1.8 s cold verify of 448 pieces on
 * the VM); asked by the dispatcher while it would otherwise wait for a
 * slot, its cold reads queued behind the window's chunk reads (415-563 ms
 * of HDF5 on the 16-core host) while the slots they freed stayed empty.
 * HDF5 calls hold ck_lock, as everywhere. */
enum { META_AHEAD = 256 };

typedef struct pmeta {
    int go;                /* piece_meta's answer; -1 also for a bad file's piece */
    int64_t cr, *addr;     /* rows per chunk, chunk addresses (malloc'd) */
} pmeta;

static void meta_one(vrun *run, int p, pmeta *m)
{
    mt_ckpt *ck = run->ck;
    const int fi = ck->piece_file[p];
    m->go = -1;
    m->cr = 0;
    m->addr = NULL;
    if (run->bad[fi]) return;
    const double t0 = mt_now_ms();
    ck_lock();
    m->go = piece_meta(run, p, &m->cr, &m->addr);
    /* an unopenable file: one report, not one per piece */
    hid_t f;
    if (m->go < 0 && ck_piece_file(ck, p, &f) < 0) run->bad[fi] = 1;
    ck_unlock();
    run->meta_ms += mt_now_ms() - t0;
}

/* Problems of the checks after the data (the shard files' extra objects,
 * the index's virtual datasets), kept to be reported after the data's:
 * they run while the last chunks are read. */
typedef struct late_buf {
    int n, cap, lost;      /* lost: problems not kept (out of memory) */
    char **line;           /* [n]: "file\0tensor\0message" */
} late_buf;

static void late_keep(void *ctx, const char *file, const char *tensor, const char *msg)
{
    late_buf *b = ctx;
    if (b->n == b->cap) {
        const int cap = b->cap ? 2 * b->cap : 16;
        char **l = realloc(b->line, (size_t)cap * sizeof *l);
        if (!l) {
            b->lost++;
            return;
        }
        b->line = l;
        b->cap = cap;
    }
    const size_t a = strlen(file) + 1, t = strlen(tensor) + 1, m = strlen(msg) + 1;
    char *x = malloc(a + t + m);
    if (!x) {
        b->lost++;
        return;
    }
    memcpy(x, file, a);
    memcpy(x + a, tensor, t);
    memcpy(x + a + t, msg, m);
    b->line[b->n++] = x;
}

static void verify_extras(mt_ckpt *ck, ck_problems *v);
static void verify_vds(mt_ckpt *ck, ck_problems *v);

/* The metadata thread: every piece's metadata in order, at most
 * META_AHEAD pieces ahead of the dispatcher, then the late checks. */
static void *meta_main(void *arg)
{
    vrun *run = arg;
    const int n = run->ck->n_pieces;
    for (int p = 0; p < n; p++) {
        pthread_mutex_lock(&run->mu);
        while (!run->stop && p >= run->taken + META_AHEAD) pthread_cond_wait(&run->cv, &run->mu);
        const int stop = run->stop;
        pthread_mutex_unlock(&run->mu);
        if (stop) return NULL;
        pmeta m;
        meta_one(run, p, &m);
        pthread_mutex_lock(&run->mu);
        run->ahead[p % META_AHEAD] = m;
        run->meta_next = p + 1;
        pthread_cond_broadcast(&run->cv);
        pthread_mutex_unlock(&run->mu);
    }
    ck_problems lv = {late_keep, run->late, 0, ""};
    verify_extras(run->ck, &lv);
    verify_vds(run->ck, &lv);
    return NULL;
}

/* Waits for a change (a slot freed, a piece finished, metadata ready), mu
 * held; the time into *ms. */
static void wait_timed(vrun *run, double *ms)
{
    const double t0 = mt_now_ms();
    pthread_cond_wait(&run->cv, &run->mu);
    *ms += mt_now_ms() - t0;
}

/* Frees what verify_data allocated (any of it NULL): the chunk addresses
 * looked up and never handed out (a run cut short), the messages not yet
 * reported, the chunk buffers, the arrays. */
static void vrun_free(vrun *run)
{
    for (int p = run->meta_next - 1; run->ahead && p >= run->taken; p--)
        free(run->ahead[p % META_AHEAD].addr);
    for (int i = 0; run->msg && i < 2 * run->ck->n_pieces; i++) free(run->msg[i]);
    for (int i = 0; run->slots && i < run->window; i++) free(run->slots[i].buf);
    free(run->slots);
    free(run->acts);
    free(run->msg);
    free(run->finished);
    free(run->ahead);
}

/* Checks the data of every piece not in a bad file, then the shard files'
 * extra objects and the index's virtual datasets (verify_extras,
 * verify_vds); problems reported in that order, the pieces' in piece
 * order. bad[fi]: the file is missing or truncated (set here when a file
 * cannot be opened: one report, not one per piece). */
static int verify_data(mt_ckpt *ck, char *bad, ck_problems *v, mt_progress *prog)
{
    const double t0 = mt_now_ms();
    vrun run;
    late_buf late = {0, 0, 0, NULL};
    memset(&run, 0, sizeof run);
    run.ck = ck;
    run.bad = bad;
    run.late = &late;
    run.window = verify_window();
    run.free_slots = run.window;
    run.slots = calloc((size_t)run.window, sizeof *run.slots);
    run.acts = calloc((size_t)run.window + 1, sizeof *run.acts);
    run.msg = calloc(2 * (size_t)ck->n_pieces + 1, sizeof *run.msg);
    run.finished = calloc((size_t)ck->n_pieces + 1, 1);
    run.ahead = calloc(META_AHEAD, sizeof *run.ahead);
    if (!run.slots || !run.acts || !run.msg || !run.finished || !run.ahead) {
        vrun_free(&run);
        return MT_ERR(MT_ENOMEM, "%s: out of memory", ck->dir);
    }
    for (int i = 0; i <= run.window; i++) run.acts[i].p = -1;
    for (int i = 0; i < run.window; i++) run.slots[i].run = &run;
    pthread_mutex_init(&run.mu, NULL);
    pthread_cond_init(&run.cv, NULL);
    int rep = 0, rc = MT_OK;
    int64_t shown = 0;
    pthread_t meta;
    if (pthread_create(&meta, NULL, meta_main, &run) != 0) {
        pthread_mutex_destroy(&run.mu);
        pthread_cond_destroy(&run.cv);
        vrun_free(&run);
        return MT_ERR(MT_EIO, "%s: cannot start the metadata thread", ck->dir);
    }
    for (int p = 0; p < ck->n_pieces && rc == MT_OK; p++) {
        const mt_ckpt_piece_rec *r = &ck->pieces[p];
        char name[32], path[4300];
        ck_shard_name(name, sizeof name, r->rank);
        snprintf(path, sizeof path, "%s/%s", ck->dir, name);
        pthread_mutex_lock(&run.mu);
        while (run.meta_next <= p) wait_timed(&run, &run.meta_wait_ms);
        pmeta *pm = &run.ahead[p % META_AHEAD];
        const int go = pm->go;
        const int64_t cr = pm->cr;
        int64_t *addr = pm->addr;
        pm->addr = NULL;
        run.taken = p + 1;
        pthread_cond_broadcast(&run.cv);
        pthread_mutex_unlock(&run.mu);
        if (go == 0) run.msg[2 * p + 1] = check_through_hdf5(ck, p, path);
        if (go <= 0) {
            pthread_mutex_lock(&run.mu);
            run.finished[p] = 1;
            if (go == 0) run.done_bytes += r->nbytes;
            pthread_mutex_unlock(&run.mu);
            flush(&run, &rep, v, prog, &shown);
            continue;
        }
        const int fi = ck->piece_file[p];
        /* chunks of the piece, window permitting; an entry is free here
         * (every busy one holds a slot), the wait is for safety's sake */
        const mt_ckpt_tensor *x = &ck->tensors[mt_ckpt_find(ck, r->tensor)];
        pthread_mutex_lock(&run.mu);
        vact *a = NULL;
        for (;;) {
            for (int i = 0; i <= run.window && !a; i++)
                if (run.acts[i].p < 0) a = &run.acts[i];
            if (a) break;
            pthread_cond_wait(&run.cv, &run.mu);
        }
        a->p = p;
        a->fi = fi;
        a->cr = cr;
        a->rows = r->count[0];
        a->row = (size_t)(x->ndim == 2 ? r->count[1] : 1) * mt_dtype_size(x->dtype);
        a->cb = (size_t)cr * a->row;
        a->n = (r->count[0] + cr - 1) / cr;
        a->next = 0;
        a->fail = a->n;
        a->hashing = 0;
        mt_xxh64_init(&a->h, 0);
        snprintf(a->path, sizeof a->path, "%s", path);
        a->msg[0] = '\0';
        a->cut = 0;
        run.busy_acts++;
        pthread_mutex_unlock(&run.mu);
        /* a piece finishes when its n-th chunk is hashed: never before
         * this loop has handed them all out */
        const int64_t n = a->n;
        for (int64_t c = 0; c < n; c++) {
            pthread_mutex_lock(&run.mu);
            while (!run.free_slots) {
                wait_timed(&run, &run.slot_wait_ms);
                pthread_mutex_unlock(&run.mu);
                flush(&run, &rep, v, prog, &shown);
                pthread_mutex_lock(&run.mu);
            }
            run.chunks++;
            vslot *s = NULL;
            for (int i = 0; i < run.window && !s; i++)
                if (run.slots[i].state == SLOT_FREE) s = &run.slots[i];
            run.free_slots--;
            /* claimed with its chunk under the lock: a hasher looking for
             * chunk c finds it (not ready yet) or nothing stale */
            s->state = SLOT_READING;
            s->a = a;
            s->c = c;
            s->addr = addr[c];
            s->data = NULL;
            pthread_mutex_unlock(&run.mu);
            if (s->cap < a->cb + 4) {
                free(s->buf);
                s->cap = 0;
                if (!(s->buf = ck_chunk_buf_alloc(a->cb + 4))) {
                    rc = MT_ERR(MT_ENOMEM, "%s: out of memory for chunk buffers of %zu bytes", path,
                                a->cb + 4);
                    /* the chunks handed out finish it, reporting nothing:
                     * verify fails with this error, not a damage */
                    pthread_mutex_lock(&run.mu);
                    s->state = SLOT_FREE;
                    s->a = NULL;
                    run.free_slots++;
                    a->n = c;
                    a->cut = 1;
                    pthread_mutex_unlock(&run.mu);
                    break;
                }
                s->cap = a->cb + 4;
            }
            ck_pool_submit(chunk_task, s);
        }
        free(addr);
        pthread_mutex_lock(&run.mu);
        /* cut short with every chunk handed out hashed: nobody else ends it */
        if (a->p == p && !a->hashing && a->next == a->n) act_finish(&run, a);
        pthread_mutex_unlock(&run.mu);
        flush(&run, &rep, v, prog, &shown);
    }
    /* the pieces in flight */
    pthread_mutex_lock(&run.mu);
    while (run.busy_acts) {
        wait_timed(&run, &run.slot_wait_ms);
        pthread_mutex_unlock(&run.mu);
        flush(&run, &rep, v, prog, &shown);
        pthread_mutex_lock(&run.mu);
    }
    pthread_mutex_unlock(&run.mu);
    flush(&run, &rep, v, prog, &shown);
    const double t_data = mt_now_ms() - t0;
    pthread_mutex_lock(&run.mu);
    run.stop = rc != MT_OK; /* else the late checks run to their end */
    pthread_cond_broadcast(&run.cv);
    pthread_mutex_unlock(&run.mu);
    pthread_join(meta, NULL);
    for (int i = 0; i < late.n; i++) {
        const char *f = late.line[i], *t = f + strlen(f) + 1, *m = t + strlen(t) + 1;
        if (rc == MT_OK) ck_problem(v, f, t, "%s", m);
        free(late.line[i]);
    }
    free(late.line);
    if (rc == MT_OK && late.lost) /* never a clean verdict over a problem not kept */
        ck_problem(v, ck->dir, "", "%d problem(s) of the files' objects or virtual datasets not "
                   "reported: out of memory", late.lost);
    MT_LOGD("verify %s: %d pieces, %lld chunks (window %d): data %.1f ms, all %.1f ms; metadata "
            "thread %.1f ms in HDF5; dispatcher %.1f ms waiting for metadata, %.1f ms for a free "
            "slot",
            ck->dir, ck->n_pieces, (long long)run.chunks, run.window, t_data, mt_now_ms() - t0,
            run.meta_ms, run.meta_wait_ms, run.slot_wait_ms);
    pthread_mutex_destroy(&run.mu);
    pthread_cond_destroy(&run.cv);
    vrun_free(&run);
    return rc;
}

/* ---- the files and the index ----------------------------------------------------------- */

static herr_t count_cb(hid_t g, const char *name, const H5L_info_t *info, void *data)
{
    (void)g;
    (void)name;
    (void)info;
    (*(int *)data)++;
    return 0;
}

/* Objects in each shard file beyond the index's pieces. */
static void verify_extras(mt_ckpt *ck, ck_problems *v)
{
    for (int fi = 0; fi < ck->n_files; fi++) {
        int want = 0, have = 0;
        for (int p = 0; p < ck->n_pieces; p++) want += ck->piece_file[p] == fi;
        int p0 = -1;
        for (int p = 0; p < ck->n_pieces && p0 < 0; p++)
            if (ck->piece_file[p] == fi) p0 = p;
        if (p0 < 0) continue;
        hid_t f;
        ck_lock();
        if (ck_piece_file(ck, p0, &f) == MT_OK) {
            hsize_t idx = 0;
            H5Literate(f, H5_INDEX_NAME, H5_ITER_NATIVE, &idx, count_cb, &have);
        }
        ck_unlock();
        char name[32], path[4300];
        ck_shard_name(name, sizeof name, ck->file_rank[fi]);
        snprintf(path, sizeof path, "%s/%s", ck->dir, name);
        if (have != want)
            ck_problem(v, path, "", "holds %d datasets, the index lists %d pieces in it", have, want);
    }
}

/* Virtual datasets of the index against the shard map. */
static void verify_vds(mt_ckpt *ck, ck_problems *v)
{
    char path[4300], eb[256];
    snprintf(path, sizeof path, "%s/%s", ck->dir, CK_INDEX);
    ck_lock();
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0) {
        ck_problem(v, path, "", "cannot open (%s)", ck_h5_errstr(eb, sizeof eb));
        ck_unlock();
        return;
    }
    for (int t = 0; t < ck->n_tensors; t++) {
        const mt_ckpt_tensor *x = &ck->tensors[t];
        hid_t ds = H5Dopen2(f, x->name, H5P_DEFAULT);
        if (ds < 0) {
            ck_problem(v, path, x->name, "virtual dataset missing");
            continue;
        }
        hid_t dcpl = H5Dget_create_plist(ds), sp = H5Dget_space(ds);
        hsize_t dims[2] = {0, 0};
        size_t cnt = 0;
        int nd = H5Sget_simple_extent_dims(sp, dims, NULL);
        if (H5Pget_layout(dcpl) != H5D_VIRTUAL || H5Pget_virtual_count(dcpl, &cnt) < 0 ||
            nd != x->ndim || (int64_t)dims[0] != x->shape[0] ||
            (nd == 2 && (int64_t)dims[1] != x->shape[1]) || (int)cnt != x->n_pieces) {
            ck_problem(v, path, x->name, "virtual dataset disagrees with the tensor table (shape or "
                                         "%zu mappings for %d pieces)",
                       cnt, x->n_pieces);
        } else {
            for (size_t i = 0; i < cnt; i++) {
                const mt_ckpt_piece_rec *r = &ck->pieces[x->first_piece + (int)i];
                char fn[64] = "", dn[MT_TENSOR_NAME_CAP + 8] = "", want[32];
                H5Pget_virtual_filename(dcpl, i, fn, sizeof fn);
                H5Pget_virtual_dsetname(dcpl, i, dn, sizeof dn);
                hid_t vs = H5Pget_virtual_vspace(dcpl, i);
                hsize_t s[2] = {0, 0}, e[2] = {0, 0};
                H5Sget_select_bounds(vs, s, e);
                H5Sclose(vs);
                ck_shard_name(want, sizeof want, r->rank);
                if (strcmp(fn, want) || strcmp(dn, x->name) || (int64_t)s[0] != r->off[0] ||
                    (int64_t)e[0] != r->off[0] + r->count[0] - 1 ||
                    (nd == 2 && ((int64_t)s[1] != r->off[1] ||
                                 (int64_t)e[1] != r->off[1] + r->count[1] - 1)))
                    ck_problem(v, path, x->name, "virtual mapping %zu (%s) disagrees with the shard map",
                               i, fn);
            }
        }
        H5Sclose(sp);
        H5Pclose(dcpl);
        H5Dclose(ds);
    }
    H5Fclose(f);
    ck_unlock();
}

int mt_ckpt_verify(const char *path, mt_ckpt_report_fn report, void *ctx, mt_progress *prog)
{
    ck_problems v = {report, ctx, 0, ""};
    const double t0 = mt_now_ms();
    mt_ckpt *ck = calloc(1, sizeof *ck);
    if (!ck) return MT_ERR(MT_ENOMEM, "out of memory");
    ck->lock_fd = -1;
    /* no reader's rank: every shard alike (O_DIRECT reads as a load's own shard) */
    ck->reader_rank = -1;
    int rc = mt_ckpt_resolve(path, ck->dir, sizeof ck->dir);
    if (rc < 0) {
        free(ck);
        return rc;
    }
    rc = ck_read_index_locked(ck);
    if (rc < 0) {
        ck_problem(&v, ck->dir, "", "%s", mt_errmsg());
        mt_ckpt_close(ck);
        return MT_ERR(MT_ECORRUPT, "%s", v.first);
    }
    /* the index's own checksum: any byte changed since the commit */
    char ipath[4300], why[256];
    snprintf(ipath, sizeof ipath, "%s/%s", ck->dir, CK_INDEX);
    int seal = ck_index_check(ipath, why, sizeof why);
    if (seal == -1) ck_problem(&v, ipath, "", "%s", why);
    else if (seal < 0) ck_problem(&v, ipath, "", "%s", mt_errmsg());
    /* files: missing or truncated ones are reported, their pieces skipped */
    char *bad = calloc((size_t)ck->n_files + 1, 1);
    if (!bad) {
        mt_ckpt_close(ck);
        return MT_ERR(MT_ENOMEM, "out of memory");
    }
    for (int i = 0; i < ck->n_files; i++) {
        char name[32], p[4300];
        ck_shard_name(name, sizeof name, ck->file_rank[i]);
        snprintf(p, sizeof p, "%s/%s", ck->dir, name);
        struct stat st;
        const char *t = "";
        for (int k = 0; k < ck->n_pieces && !t[0]; k++)
            if (ck->piece_file[k] == i) t = ck->pieces[k].tensor;
        if (stat(p, &st) != 0) {
            ck_problem(&v, p, t, "shard file missing");
            bad[i] = 1;
        } else if ((int64_t)st.st_size != ck->file_bytes[i]) {
            ck_problem(&v, p, t, "%lld bytes, the index records %lld: truncated or replaced",
                       (long long)st.st_size, (long long)ck->file_bytes[i]);
            bad[i] = 1;
        }
    }
    mt_progress_start(prog, "verify", mt_ckpt_bytes(ck), prog ? prog->enabled : 0);
    MT_LOGD("verify %s: index and files %.1f ms", ck->dir, mt_now_ms() - t0);
    rc = verify_data(ck, bad, &v, prog);
    mt_progress_end(prog);
    free(bad);
    mt_ckpt_close(ck);
    if (rc < 0) return rc;
    if (v.n) return MT_ERR(MT_ECORRUPT, "%s (%d problem%s)", v.first, v.n, v.n > 1 ? "s" : "");
    return MT_OK;
}
