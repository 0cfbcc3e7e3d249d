/* comm_mpi.c - the MPI backend: host buffers (the CPU backend), and the
 * transport of the staged backend.
 *
 * Each communicator owns an MPI_Comm (a dup of the parent, or a split)
 * with MPI_ERRORS_RETURN, so a failure comes back as a status naming the
 * call and the peer instead of aborting the job.
 *
 * Large messages: MPI counts are int, ours are size_t. Every transfer is
 * cut into messages of at most chunk_bytes (default INT_MAX rounded down
 * to 8); data moves as MPI_BYTE, native reductions as the MPI type in
 * chunks of chunk_bytes / element size.
 *
 * Reductions:
 *  - integers (SUM as the unsigned type, so overflow wraps), and MAX / MIN
 *    of F32 / F64: MPI_Allreduce, exact whatever its algorithm;
 *  - everything else (float sums, and any op on BF16 / E4M3, which MPI has
 *    no type for): rank-ordered, in our own code. reduce_scatter: every rank
 *    sends block j of its input to rank j and combines the blocks it
 *    receives in rank order (comm_reduce.c: accumulate in F32 / F64, round
 *    once). all_reduce: the same over a balanced split of the vector into
 *    size blocks, then an all-gather of the blocks. The result is the
 *    sequential sum x_0 + x_1 + ... on every rank, bit for bit, and moves
 *    the same bytes as a ring all-reduce (2 (n - 1) / n of the vector).
 *
 * Gathers, all-to-all and send / recv are point to point (MPI_Isend /
 * MPI_Irecv of the chunks, then MPI_Waitall), which handles displacements
 * beyond INT_MAX too. Each collective uses its own tag (a counter that all
 * ranks advance in step), so a message left over by a failed op cannot be
 * taken by a later one; send / recv use tag 0.
 * A receive checks the received length: a peer sending more than expected
 * is MPI_ERR_TRUNCATE, less is reported with both lengths.
 */
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"
#include "engine/parallel/comm_impl.h"

#define TAG_P2P 0
#define TAG_SPAN 30000 /* collective tags 1..TAG_SPAN; MPI_TAG_UB >= 32767 */
#define TAG_PIPE (TAG_SPAN + 1) /* pipeline tags TAG_PIPE + [0, MT_COMM_MAX_TAG) <= 32767 */
_Static_assert(TAG_PIPE + MT_COMM_MAX_TAG <= 32767, "pipeline tags beyond MPI's guaranteed bound");
#define CHUNK_DEFAULT ((size_t)INT_MAX & ~(size_t)7)

struct reqset;

typedef struct mpi_ctx {
    MPI_Comm comm;
    unsigned seq;      /* collectives issued: the next tag */
    void *scratch;     /* reduction buffers */
    size_t scratch_cap;
    struct reqset *pending; /* pipeline isends in flight */
    void **outbox;     /* [n_out] copies of their data, freed by wait_sends */
    int n_out, cap_out;
} mpi_ctx;

static mpi_ctx *CTX(mt_comm *c) { return c->ctx; }

static int mpi_fail(int code, const char *call, int peer)
{
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (MPI_Error_string(code, s, &n) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", code);
    if (peer >= 0) return MT_ERR(MT_EMPI, "%s with rank %d: %s", call, peer, s);
    return MT_ERR(MT_EMPI, "%s: %s", call, s);
}

static int next_tag(mt_comm *c) { return 1 + (int)(CTX(c)->seq++ % TAG_SPAN); }

static void *scratch(mt_comm *c, size_t bytes)
{
    mpi_ctx *x = CTX(c);
    if (bytes > x->scratch_cap) {
        void *p = realloc(x->scratch, bytes);
        if (!p) return NULL;
        x->scratch = p;
        x->scratch_cap = bytes;
    }
    return x->scratch;
}

/* ---- requests: chunked non-blocking messages -------------------------------------------- */

typedef struct reqset {
    MPI_Request *req;
    int *peer;      /* per request */
    long long *expect; /* receives: expected bytes; sends: -1 */
    int n, cap;
} reqset;

static void reqset_free(reqset *s)
{
    free(s->req);
    free(s->peer);
    free(s->expect);
    memset(s, 0, sizeof *s);
}

static int reqset_grow(reqset *s)
{
    if (s->n < s->cap) return MT_OK;
    int cap = s->cap ? 2 * s->cap : 16;
    MPI_Request *r = realloc(s->req, (size_t)cap * sizeof *r);
    if (r) s->req = r;
    int *p = realloc(s->peer, (size_t)cap * sizeof *p);
    if (p) s->peer = p;
    long long *e = realloc(s->expect, (size_t)cap * sizeof *e);
    if (e) s->expect = e;
    if (!r || !p || !e) return MT_ERR(MT_ENOMEM, "out of memory for %d MPI requests", cap);
    s->cap = cap;
    return MT_OK;
}

static int post_send(mt_comm *c, reqset *s, const void *buf, size_t bytes, int peer, int tag)
{
    const char *p = buf;
    for (size_t off = 0; off < bytes; off += c->chunk_bytes) {
        size_t m = bytes - off < c->chunk_bytes ? bytes - off : c->chunk_bytes;
        MT_CHECK(reqset_grow(s));
        int e = MPI_Isend(p + off, (int)m, MPI_BYTE, peer, tag, CTX(c)->comm, &s->req[s->n]);
        if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Isend", peer);
        s->peer[s->n] = peer;
        s->expect[s->n++] = -1;
    }
    return MT_OK;
}

static int post_recv(mt_comm *c, reqset *s, void *buf, size_t bytes, int peer, int tag)
{
    char *p = buf;
    for (size_t off = 0; off < bytes; off += c->chunk_bytes) {
        size_t m = bytes - off < c->chunk_bytes ? bytes - off : c->chunk_bytes;
        MT_CHECK(reqset_grow(s));
        int e = MPI_Irecv(p + off, (int)m, MPI_BYTE, peer, tag, CTX(c)->comm, &s->req[s->n]);
        if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Irecv", peer);
        s->peer[s->n] = peer;
        s->expect[s->n++] = (long long)m;
    }
    return MT_OK;
}

/* Waits for every request of s (test: only if all are complete, *done
 * says), checks received lengths, empties s. */
static int finish_all(reqset *s, int test, int *done)
{
    if (done) *done = 1;
    if (s->n == 0) return MT_OK;
    MPI_Status *st = malloc((size_t)s->n * sizeof *st);
    if (!st) return MT_ERR(MT_ENOMEM, "out of memory for %d MPI statuses", s->n);
    int flag = 1, e, rc = MT_OK;
    if (test) {
        e = MPI_Testall(s->n, s->req, &flag, st);
        if (e == MPI_SUCCESS && !flag) { /* nothing was modified */
            *done = 0;
            free(st);
            return MT_OK;
        }
    } else {
        e = MPI_Waitall(s->n, s->req, st);
    }
    for (int i = 0; i < s->n && rc == MT_OK; i++) {
        const char *call = s->expect[i] < 0 ? "MPI_Isend" : "MPI_Irecv";
        if (e == MPI_ERR_IN_STATUS && st[i].MPI_ERROR != MPI_SUCCESS &&
            st[i].MPI_ERROR != MPI_ERR_PENDING)
            rc = mpi_fail(st[i].MPI_ERROR, call, s->peer[i]);
        else if (e == MPI_SUCCESS && s->expect[i] >= 0) {
            int got = 0;
            MPI_Get_count(&st[i], MPI_BYTE, &got);
            if ((long long)got != s->expect[i])
                rc = MT_ERR(MT_EMPI, "MPI_Irecv with rank %d: %d bytes arrived, %lld expected",
                            s->peer[i], got, s->expect[i]);
        }
    }
    if (rc == MT_OK && e != MPI_SUCCESS) rc = mpi_fail(e, test ? "MPI_Testall" : "MPI_Waitall", -1);
    free(st);
    s->n = 0;
    return rc;
}

static int wait_all(reqset *s) { return finish_all(s, 0, NULL); }

/* ---- native reductions ------------------------------------------------------------------ */

static int native_type(mt_comm_dtype dt, mt_comm_op op, MPI_Datatype *t)
{
    switch (dt) {
    case MT_COMM_I32: *t = op == MT_COMM_SUM ? MPI_UINT32_T : MPI_INT32_T; return 1;
    case MT_COMM_I64: *t = op == MT_COMM_SUM ? MPI_UINT64_T : MPI_INT64_T; return 1;
    case MT_COMM_F32: *t = MPI_FLOAT; return op != MT_COMM_SUM;
    case MT_COMM_F64: *t = MPI_DOUBLE; return op != MT_COMM_SUM;
    default: return 0;
    }
}

static MPI_Op mpi_op(mt_comm_op op)
{
    return op == MT_COMM_SUM ? MPI_SUM : op == MT_COMM_MAX ? MPI_MAX : MPI_MIN;
}

/* MPI_IN_PLACE is never used: MPI wants it on all ranks or none, and
 * comm.h lets each rank choose; an in-place chunk is copied aside first. */
static int native_all_reduce(mt_comm *c, const void *send, void *recv, size_t count,
                             mt_comm_dtype dt, MPI_Datatype t, mt_comm_op op)
{
    size_t es = mt_comm_dtype_size(dt), step = c->chunk_bytes / es;
    if (step == 0) step = 1;
    char *tmp = NULL;
    if (send == recv) {
        tmp = scratch(c, (count < step ? count : step) * es);
        if (!tmp) return MT_ERR(MT_ENOMEM, "out of memory for an in-place all-reduce");
    }
    for (size_t i = 0; i < count; i += step) {
        size_t m = count - i < step ? count - i : step;
        const char *s = (const char *)send + i * es;
        if (tmp) s = memcpy(tmp, s, m * es);
        int e = MPI_Allreduce(s, (char *)recv + i * es, (int)m, t, mpi_op(op), CTX(c)->comm);
        if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Allreduce", -1);
    }
    return MT_OK;
}

/* ---- rank-ordered reduction --------------------------------------------------------------- */

/* Rank j's block of send is [off(j), off(j) + len(j)) elements, where
 * off / len come from blocks(): equal blocks of `count` (reduce_scatter) or
 * the balanced split of `count` (all_reduce). The own block, reduced over
 * all ranks in rank order, is written to out. */
typedef struct blocks {
    size_t count;
    int equal;
} blocks;

static size_t blk_off(const blocks *b, int n, int j)
{
    return b->equal ? (size_t)j * b->count : mt_comm_block_off(b->count, n, j);
}

static size_t blk_len(const blocks *b, int n, int j) { return blk_off(b, n, j + 1) - blk_off(b, n, j); }

static int ordered_reduce(mt_comm *c, const void *send, void *out, const blocks *b,
                          mt_comm_dtype dt, mt_comm_op op)
{
    const int n = c->size, me = c->rank, tag = next_tag(c);
    const size_t es = mt_comm_dtype_size(dt), len = blk_len(b, n, me);
    const char *in = send;
    /* acc [len] accumulation type, then two receive buffers [len] */
    size_t acc_b = (len * mt_comm_acc_size(dt) + 63) & ~(size_t)63, tmp_b = (len * es + 63) & ~(size_t)63;
    char *acc = scratch(c, acc_b + 2 * tmp_b + 1);
    if (!acc) return MT_ERR(MT_ENOMEM, "out of memory for the reduction of %zu elements", len);
    char *tmp[2] = {acc + acc_b, acc + acc_b + tmp_b};
    reqset sends = {0}, rq[2] = {{0}, {0}};
    int rc = MT_OK;
    for (int j = 0; j < n && rc == MT_OK; j++)
        if (j != me && blk_len(b, n, j) > 0)
            rc = post_send(c, &sends, in + blk_off(b, n, j) * es, blk_len(b, n, j) * es, j, tag);
    /* remote ranks in order; the k-th arrives in tmp[k % 2] while the
     * (k - 1)-th is being added */
    int k = 0, first = 1;
    if (rc == MT_OK && len > 0 && n > 1)
        rc = post_recv(c, &rq[0], tmp[0], len * es, me == 0 ? 1 : 0, tag);
    for (int r = 0; r < n && rc == MT_OK && len > 0; r++) {
        const void *x = in + blk_off(b, n, me) * es;
        if (r != me) {
            rc = wait_all(&rq[k % 2]);
            if (rc < 0) break;
            int nr = r + 1 == me ? r + 2 : r + 1;
            if (nr < n) rc = post_recv(c, &rq[(k + 1) % 2], tmp[(k + 1) % 2], len * es, nr, tag);
            if (rc < 0) break;
            x = tmp[k % 2];
            k++;
        }
        if (first) mt_comm_acc_load(acc, x, len, dt);
        else mt_comm_acc_add(acc, x, len, dt, op);
        first = 0;
    }
    int rs = wait_all(&sends);
    if (rc == MT_OK) rc = rs;
    if (rc == MT_OK && len > 0) mt_comm_acc_store(out, acc, len, dt);
    reqset_free(&sends);
    reqset_free(&rq[0]);
    reqset_free(&rq[1]);
    return rc;
}

/* ---- the ops ---------------------------------------------------------------------------- */

static int mpi_gather_v(mt_comm *c, const void *send, size_t send_count, void *recv,
                        const size_t *counts, const size_t *displs, mt_comm_dtype dt, int root);

static int mpi_all_reduce(mt_comm *c, const void *send, void *recv, size_t count,
                          mt_comm_dtype dt, mt_comm_op op)
{
    MPI_Datatype t;
    if (native_type(dt, op, &t)) return native_all_reduce(c, send, recv, count, dt, t, op);
    const int n = c->size;
    const size_t es = mt_comm_dtype_size(dt);
    blocks b = {count, 0};
    char *own = (char *)recv + blk_off(&b, n, c->rank) * es;
    MT_CHECK(ordered_reduce(c, send, own, &b, dt, op));
    size_t *cd = malloc(2 * (size_t)n * sizeof *cd);
    if (!cd) return MT_ERR(MT_ENOMEM, "out of memory");
    for (int j = 0; j < n; j++) {
        cd[j] = blk_len(&b, n, j);
        cd[n + j] = blk_off(&b, n, j);
    }
    int rc = mpi_gather_v(c, own, cd[c->rank], recv, cd, cd + n, dt, -1);
    free(cd);
    return rc;
}

static int mpi_reduce_scatter(mt_comm *c, const void *send, void *recv, size_t count,
                              mt_comm_dtype dt, mt_comm_op op)
{
    blocks b = {count, 1};
    MPI_Datatype t;
    const size_t es = mt_comm_dtype_size(dt);
    /* Exact types whose blocks fit one MPI call: MPI_Reduce_scatter_block.
     * The choice depends only on arguments every rank shares (not on
     * whether this rank works in place), so all ranks take the same path. */
    if (c->size > 1 && native_type(dt, op, &t) && count * es <= c->chunk_bytes) {
        int in_place = (const char *)send + (size_t)c->rank * count * es == (const char *)recv;
        void *dst = in_place ? scratch(c, count * es) : recv;
        if (!dst) return MT_ERR(MT_ENOMEM, "out of memory for an in-place reduce-scatter");
        int e = MPI_Reduce_scatter_block(send, dst, (int)count, t, mpi_op(op), CTX(c)->comm);
        if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Reduce_scatter_block", -1);
        if (in_place) memcpy(recv, dst, count * es);
        return MT_OK;
    }
    return ordered_reduce(c, send, recv, &b, dt, op);
}

static int mpi_gather_v(mt_comm *c, const void *send, size_t send_count, void *recv,
                        const size_t *counts, const size_t *displs, mt_comm_dtype dt, int root)
{
    const int n = c->size, me = c->rank, tag = next_tag(c);
    const size_t es = mt_comm_dtype_size(dt);
    reqset s = {0};
    int rc = MT_OK;
    if (root < 0 || me == root)
        for (int r = 0; r < n && rc == MT_OK; r++)
            if (r != me && counts[r] > 0)
                rc = post_recv(c, &s, (char *)recv + displs[r] * es, counts[r] * es, r, tag);
    for (int r = 0; r < n && rc == MT_OK && send_count > 0; r++)
        if (r != me && (root < 0 || r == root))
            rc = post_send(c, &s, send, send_count * es, r, tag);
    if (rc == MT_OK && (root < 0 || me == root)) {
        char *dst = (char *)recv + displs[me] * es;
        if (dst != (const char *)send && send_count > 0) memmove(dst, send, send_count * es);
    }
    int rw = wait_all(&s);
    reqset_free(&s);
    return rc < 0 ? rc : rw;
}

/* Posts the messages of an all_to_all_v into s (receives first) and moves
 * the own block; the caller waits for s. */
static int a2a_post(mt_comm *c, reqset *s, const void *send, const size_t *send_counts,
                    const size_t *send_displs, void *recv, const size_t *recv_counts,
                    const size_t *recv_displs, mt_comm_dtype dt)
{
    const int n = c->size, me = c->rank, tag = next_tag(c);
    const size_t es = mt_comm_dtype_size(dt);
    int rc = MT_OK;
    for (int p = 0; p < n && rc == MT_OK; p++)
        if (p != me && recv_counts[p] > 0)
            rc = post_recv(c, s, (char *)recv + recv_displs[p] * es, recv_counts[p] * es, p, tag);
    for (int p = 0; p < n && rc == MT_OK; p++)
        if (p != me && send_counts[p] > 0)
            rc = post_send(c, s, (const char *)send + send_displs[p] * es, send_counts[p] * es, p,
                           tag);
    if (rc == MT_OK && send_counts[me] > 0)
        memmove((char *)recv + recv_displs[me] * es, (const char *)send + send_displs[me] * es,
                send_counts[me] * es);
    return rc;
}

static int mpi_all_to_all_v(mt_comm *c, const void *send, const size_t *send_counts,
                            const size_t *send_displs, void *recv, const size_t *recv_counts,
                            const size_t *recv_displs, mt_comm_dtype dt)
{
    reqset s = {0};
    int rc = a2a_post(c, &s, send, send_counts, send_displs, recv, recv_counts, recv_displs, dt);
    int rw = wait_all(&s);
    reqset_free(&s);
    return rc < 0 ? rc : rw;
}

/* all_to_all_v started: every message posted, MPI progresses them. */
typedef struct mpi_a2a_req {
    mt_comm_req h;
    reqset rs;
} mpi_a2a_req;

static void mpi_a2a_free(mt_comm_req *r)
{
    reqset_free(&((mpi_a2a_req *)r)->rs);
    free(r);
}

static int mpi_a2a_test(mt_comm_req *r, int *done)
{
    return finish_all(&((mpi_a2a_req *)r)->rs, 1, done);
}

static int mpi_a2a_wait(mt_comm_req *r) { return wait_all(&((mpi_a2a_req *)r)->rs); }

static int mpi_all_to_all_v_start(mt_comm *c, const void *send, const size_t *send_counts,
                                  const size_t *send_displs, void *recv,
                                  const size_t *recv_counts, const size_t *recv_displs,
                                  mt_comm_dtype dt, mt_comm_req **out)
{
    mpi_a2a_req *q = calloc(1, sizeof *q);
    if (!q) return MT_ERR(MT_ENOMEM, "out of memory");
    q->h.test = mpi_a2a_test;
    q->h.wait = mpi_a2a_wait;
    q->h.free = mpi_a2a_free;
    int rc = a2a_post(c, &q->rs, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                      dt);
    if (rc < 0) {
        wait_all(&q->rs); /* what was posted, before the caller's buffers go */
        mpi_a2a_free(&q->h);
        return rc;
    }
    *out = &q->h;
    return MT_OK;
}

static int mpi_broadcast(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int root)
{
    size_t bytes = count * mt_comm_dtype_size(dt);
    for (size_t off = 0; off < bytes; off += c->chunk_bytes) {
        size_t m = bytes - off < c->chunk_bytes ? bytes - off : c->chunk_bytes;
        int e = MPI_Bcast((char *)buf + off, (int)m, MPI_BYTE, root, CTX(c)->comm);
        if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Bcast", root);
    }
    return MT_OK;
}

static int mpi_sendrecv(mt_comm *c, const void *send, size_t send_count, int dst, void *recv,
                        size_t recv_count, int src, mt_comm_dtype dt)
{
    const size_t es = mt_comm_dtype_size(dt);
    reqset s = {0};
    int rc = MT_OK;
    if (src != MT_COMM_NO_PEER && recv_count > 0)
        rc = post_recv(c, &s, recv, recv_count * es, src, TAG_P2P);
    if (rc == MT_OK && dst != MT_COMM_NO_PEER && send_count > 0)
        rc = post_send(c, &s, send, send_count * es, dst, TAG_P2P);
    int rw = wait_all(&s);
    reqset_free(&s);
    return rc < 0 ? rc : rw;
}

/* Pipeline messages: the data is copied to an outbox buffer so the caller
 * may reuse its own at once (the schedule's buffered sends). */
static int mpi_isend(mt_comm *c, const void *buf, size_t count, mt_comm_dtype dt, int peer,
                     int tag)
{
    mpi_ctx *x = CTX(c);
    const size_t bytes = count * mt_comm_dtype_size(dt);
    if (!x->pending && !(x->pending = calloc(1, sizeof *x->pending)))
        return MT_ERR(MT_ENOMEM, "out of memory for pipeline sends");
    if (x->n_out == x->cap_out) {
        int cap = x->cap_out ? 2 * x->cap_out : 16;
        void **o = realloc(x->outbox, (size_t)cap * sizeof *o);
        if (!o) return MT_ERR(MT_ENOMEM, "out of memory for %d pipeline sends", cap);
        x->outbox = o;
        x->cap_out = cap;
    }
    void *copy = malloc(bytes);
    if (!copy) return MT_ERR(MT_ENOMEM, "out of memory for a pipeline send of %zu bytes", bytes);
    memcpy(copy, buf, bytes);
    x->outbox[x->n_out++] = copy;
    return post_send(c, x->pending, copy, bytes, peer, TAG_PIPE + tag);
}

static int mpi_wait_sends(mt_comm *c)
{
    mpi_ctx *x = CTX(c);
    int rc = x->pending ? wait_all(x->pending) : MT_OK;
    for (int i = 0; i < x->n_out; i++) free(x->outbox[i]);
    x->n_out = 0;
    return rc;
}

static int mpi_recv_tag(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int peer, int tag)
{
    reqset s = {0};
    int rc = post_recv(c, &s, buf, count * mt_comm_dtype_size(dt), peer, TAG_PIPE + tag);
    int rw = wait_all(&s);
    reqset_free(&s);
    return rc < 0 ? rc : rw;
}

static int mpi_barrier(mt_comm *c)
{
    int e = MPI_Barrier(CTX(c)->comm);
    return e == MPI_SUCCESS ? MT_OK : mpi_fail(e, "MPI_Barrier", -1);
}

static int wrap(mt_comm **out, MPI_Comm comm, size_t chunk_bytes);

static int mpi_split(mt_comm *c, int color, int key, mt_comm **out)
{
    MPI_Comm nc = MPI_COMM_NULL;
    int e = MPI_Comm_split(CTX(c)->comm, color == MT_COMM_NO_COLOR ? MPI_UNDEFINED : color, key, &nc);
    if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Comm_split", -1);
    if (nc == MPI_COMM_NULL) return MT_OK;
    return wrap(out, nc, c->chunk_bytes);
}

static void mpi_destroy(mt_comm *c)
{
    mpi_ctx *x = CTX(c);
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && x->comm != MPI_COMM_NULL) MPI_Comm_free(&x->comm);
    if (x->pending) reqset_free(x->pending);
    free(x->pending);
    for (int i = 0; i < x->n_out; i++) free(x->outbox[i]);
    free(x->outbox);
    free(x->scratch);
    free(x);
    free(c);
}

/* ---- nonblocking owner collectives ------------------------------------------------------- */

/* Point to point, all posted at start: reduce_owned sends each owner its
 * segments packed in the wire type and the owner receives one row per
 * peer, [size][own] with its own row packed likewise, and adds the rows in
 * rank order at the end (comm_reduce.c arithmetic, F32 accumulation, no
 * final rounding: the result is F32). gather_owned: the owner sends its
 * packed bytes to every peer, which unpacks them at the end. Progress:
 * MPI's, driven by mt_comm_test and the wait. One tag per op. */
typedef struct mpi_req {
    mt_comm_req h;
    reqset rs;
    int reduce, me, size, done;
    mt_comm_dtype wire;
    mt_comm_seg *segs;
    int n;
    mt_comm_owned_plan plan;
    char *sendbuf, *rows;
    size_t *off; /* [size]: byte offset of each other owner's pack in sendbuf / rows */
} mpi_req;

static void mpi_req_free(mt_comm_req *r)
{
    mpi_req *q = (mpi_req *)r;
    reqset_free(&q->rs);
    mt_comm_owned_plan_free(&q->plan);
    free(q->segs);
    free(q->sendbuf);
    free(q->rows);
    free(q->off);
    free(q);
}

/* One segment's contribution into a pack: F32 as is, BF16 rounded. */
static void pack_wire(void *dst, const float *src, size_t n, mt_comm_dtype wire)
{
    if (wire == MT_COMM_F32) {
        memcpy(dst, src, n * 4);
        return;
    }
    mt_comm_acc_store(dst, src, n, MT_COMM_BF16);
}

static int mpi_req_complete(mpi_req *q, int test, int *done)
{
    if (q->done) {
        if (done) *done = 1;
        return MT_OK;
    }
    int fin = 1;
    MT_CHECK(finish_all(&q->rs, test, &fin));
    if (done) *done = fin;
    if (!fin) return MT_OK;
    q->done = 1;
    const size_t *tot = q->plan.total;
    for (int k = 0; k < q->n; k++) {
        const mt_comm_seg *g = &q->segs[k];
        if (q->reduce && g->owner == q->me) {
            const size_t es = mt_comm_dtype_size(q->wire), own = tot[q->me];
            for (int r = 0; r < q->size; r++) {
                const char *x = q->rows + ((size_t)r * own + q->plan.pos[k]) * es;
                if (r == 0) mt_comm_acc_load(g->buf, x, g->count, q->wire);
                else mt_comm_acc_add(g->buf, x, g->count, q->wire, MT_COMM_SUM);
            }
        } else if (!q->reduce && g->owner != q->me) {
            memcpy(g->buf, q->rows + q->off[g->owner] + q->plan.pos[k], g->count);
        }
    }
    return MT_OK;
}

static int mpi_req_test(mt_comm_req *r, int *done)
{
    return mpi_req_complete((mpi_req *)r, 1, done);
}
static int mpi_req_wait(mt_comm_req *r) { return mpi_req_complete((mpi_req *)r, 0, NULL); }

static int mpi_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, int reduce,
                           mt_comm_dtype wire, mt_comm_req **out)
{
    const int me = c->rank, size = c->size, tag = next_tag(c);
    const size_t es = reduce ? mt_comm_dtype_size(wire) : 1;
    mpi_req *q = calloc(1, sizeof *q);
    if (!q) return MT_ERR(MT_ENOMEM, "out of memory");
    q->h.test = mpi_req_test;
    q->h.wait = mpi_req_wait;
    q->h.free = mpi_req_free;
    q->reduce = reduce;
    q->me = me;
    q->size = size;
    q->wire = wire;
    q->n = n;
    int rc = mt_comm_owned_plan_make(&q->plan, segs, n, size);
    q->segs = malloc((size_t)n * sizeof *segs);
    q->off = calloc((size_t)size, sizeof *q->off);
    if (rc == MT_OK && (!q->segs || !q->off)) rc = MT_ERR(MT_ENOMEM, "out of memory");
    if (rc < 0) {
        mpi_req_free(&q->h);
        return rc;
    }
    memcpy(q->segs, segs, (size_t)n * sizeof *segs);
    const size_t *tot = q->plan.total, own = tot[me];
    size_t others = 0;
    for (int o = 0; o < size; o++)
        if (o != me) {
            q->off[o] = others * es;
            others += tot[o];
        }
    if (reduce) {
        /* sendbuf: the contributions to each other owner; rows [size][own] */
        q->sendbuf = malloc(others * es + 1);
        q->rows = malloc((size_t)size * own * es + 1);
    } else {
        /* sendbuf: own bytes; rows: the other owners' bytes at off[o] */
        q->sendbuf = malloc(own + 1);
        q->rows = malloc(others + 1);
    }
    if (!q->sendbuf || !q->rows) rc = MT_ERR(MT_ENOMEM, "out of memory for %zu + %zu elements",
                                            others, own);
    for (int k = 0; rc == MT_OK && k < n; k++) {
        const mt_comm_seg *g = &segs[k];
        if (reduce && g->owner != me)
            pack_wire(q->sendbuf + q->off[g->owner] + q->plan.pos[k] * es, g->buf, g->count, wire);
        else if (reduce)
            pack_wire(q->rows + ((size_t)me * own + q->plan.pos[k]) * es, g->buf, g->count, wire);
        else if (g->owner == me)
            memcpy(q->sendbuf + q->plan.pos[k], g->buf, g->count);
    }
    for (int p = 0; rc == MT_OK && p < size; p++) {
        if (p == me) continue;
        if (reduce) {
            if (tot[p] > 0) rc = post_send(c, &q->rs, q->sendbuf + q->off[p], tot[p] * es, p, tag);
            if (rc == MT_OK && own > 0)
                rc = post_recv(c, &q->rs, q->rows + (size_t)p * own * es, own * es, p, tag);
        } else {
            if (own > 0) rc = post_send(c, &q->rs, q->sendbuf, own, p, tag);
            if (rc == MT_OK && tot[p] > 0)
                rc = post_recv(c, &q->rs, q->rows + q->off[p], tot[p], p, tag);
        }
    }
    if (rc < 0) {
        wait_all(&q->rs); /* what was posted, before the buffers go */
        mpi_req_free(&q->h);
        return rc;
    }
    *out = &q->h;
    return MT_OK;
}

static int mpi_reduce_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_dtype wire,
                                  mt_comm_req **req)
{
    return mpi_owned_start(c, segs, n, 1, wire, req);
}

static int mpi_gather_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_req **req)
{
    return mpi_owned_start(c, segs, n, 0, MT_COMM_BYTE, req);
}

static const mt_comm_iface MPI_IFACE = {
    .all_reduce = mpi_all_reduce,
    .reduce_scatter = mpi_reduce_scatter,
    .gather_v = mpi_gather_v,
    .all_to_all_v = mpi_all_to_all_v,
    .broadcast = mpi_broadcast,
    .sendrecv = mpi_sendrecv,
    .isend = mpi_isend,
    .recv_tag = mpi_recv_tag,
    .wait_sends = mpi_wait_sends,
    .barrier = mpi_barrier,
    .split = mpi_split,
    .destroy = mpi_destroy,
    .reduce_owned_start = mpi_reduce_owned_start,
    .gather_owned_start = mpi_gather_owned_start,
    .all_to_all_v_start = mpi_all_to_all_v_start,
    .join = NULL,
    .sync = NULL,
};

/* Takes ownership of comm (freed on failure too). */
static int wrap(mt_comm **out, MPI_Comm comm, size_t chunk_bytes)
{
    *out = NULL;
    int rank = 0, size = 0, e = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    if (e == MPI_SUCCESS) e = MPI_Comm_rank(comm, &rank);
    if (e == MPI_SUCCESS) e = MPI_Comm_size(comm, &size);
    mt_comm *c = calloc(1, sizeof *c);
    mpi_ctx *x = calloc(1, sizeof *x);
    if (e != MPI_SUCCESS || !c || !x) {
        free(c);
        free(x);
        MPI_Comm_free(&comm);
        return e != MPI_SUCCESS ? mpi_fail(e, "MPI_Comm_set_errhandler", -1)
                                : MT_ERR(MT_ENOMEM, "comm mpi: out of memory");
    }
    x->comm = comm;
    mt_comm_init_fields(c, &MPI_IFACE, MT_COMM_MPI, MT_COMM_HOST, rank, size);
    c->chunk_bytes = chunk_bytes ? chunk_bytes : CHUNK_DEFAULT;
    if (c->chunk_bytes > CHUNK_DEFAULT) c->chunk_bytes = CHUNK_DEFAULT;
    c->ctx = x;
    *out = c;
    return MT_OK;
}

int mt_comm_mpi_create(mt_comm **out, const void *mpi_comm, size_t chunk_bytes)
{
    *out = NULL;
    MPI_Comm parent = mpi_comm ? *(const MPI_Comm *)mpi_comm : MPI_COMM_WORLD, dup = MPI_COMM_NULL;
    int e = MPI_Comm_dup(parent, &dup);
    if (e != MPI_SUCCESS) return mpi_fail(e, "comm mpi: MPI_Comm_dup", -1);
    return wrap(out, dup, chunk_bytes);
}

const void *mt_comm_mpi_handle(const mt_comm *c) { return &((const mpi_ctx *)c->ctx)->comm; }

int mt_comm_mpi_world_size(int *initialised)
{
    int init = 0, fin = 0, n = 1;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    *initialised = init && !fin;
    if (*initialised) MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
}
