/* comm_staged.c - device buffers through pinned host memory and the mpi
 * backend: each op copies its device input to a pinned buffer on the side
 * stream (after the compute stream's work so far), waits for it, runs the
 * host op of its mpi companion (same group, same chunking), and copies the
 * result back on the side stream. NCCL refuses two ranks on one GPU; this
 * backend does not care, so tests run several ranks on one device.
 *
 * Results are the mpi backend's: rank-ordered, bit for bit (comm.h). The
 * host blocks while MPI runs; the compute stream keeps running what was
 * enqueued before the op. Receive buffers are written block by block
 * (gathers, all-to-all), so bytes between blocks stay untouched.
 * One pinned buffer per communicator, grown to the largest op (its
 * send + receive bytes) and kept; a grow waits for the side stream first.
 */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"
#include "engine/parallel/comm_cuda.h"
#include "engine/parallel/comm_impl.h"

typedef struct staged_ctx {
    mt_comm_side side;
    char *pinned;
    size_t cap;
} staged_ctx;

static staged_ctx *CTX(mt_comm *c) { return c->ctx; }

static int pinned(mt_comm *c, size_t bytes, char **out)
{
    staged_ctx *x = CTX(c);
    if (bytes > x->cap) {
        size_t cap = bytes + bytes / 4 + 4096;
        MT_CUDA_CHECK(cudaStreamSynchronize(x->side.stream));
        if (x->pinned) cudaFreeHost(x->pinned);
        x->pinned = NULL;
        x->cap = 0;
        cudaError_t e = cudaHostAlloc((void **)&x->pinned, cap, cudaHostAllocPortable);
        if (e != cudaSuccess)
            return MT_ERR(MT_ENOMEM, "comm staged: %zu bytes of pinned host memory: %s", cap,
                          cudaGetErrorString(e));
        x->cap = cap;
    }
    *out = x->pinned;
    return MT_OK;
}

static int down(mt_comm *c, void *host, const void *dev, size_t bytes)
{
    if (bytes == 0) return MT_OK;
    MT_CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, CTX(c)->side.stream));
    return MT_OK;
}

static int up(mt_comm *c, void *dev, const void *host, size_t bytes)
{
    if (bytes == 0) return MT_OK;
    MT_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, CTX(c)->side.stream));
    return MT_OK;
}

/* The host may touch the pinned buffer once the side stream is idle: the
 * copies down of this op and the copies up of the previous one are done.
 * Every op waits before its host part. */
static int wait_down(mt_comm *c) { return mt_comm_side_sync(&CTX(c)->side); }

/* Extent in elements of the blocks (counts[r] at displs[r]). */
static size_t extent(const size_t *counts, const size_t *displs, int n)
{
    size_t e = 0;
    for (int r = 0; r < n; r++)
        if (counts[r] > 0 && displs[r] + counts[r] > e) e = displs[r] + counts[r];
    return e;
}

static int up_blocks(mt_comm *c, char *dev, const char *host, const size_t *counts,
                     const size_t *displs, size_t es)
{
    for (int r = 0; r < c->size; r++)
        MT_CHECK(up(c, dev + displs[r] * es, host + displs[r] * es, counts[r] * es));
    return MT_OK;
}

#define BEGIN(c)                                                                       \
    int rc = mt_comm_side_begin(&CTX(c)->side, (c)->stream);                           \
    if (rc < 0) return mt_comm_side_end(&CTX(c)->side, rc)
#define END(c) return mt_comm_side_end(&CTX(c)->side, rc)

static int staged_all_reduce(mt_comm *c, const void *send, void *recv, size_t count,
                             mt_comm_dtype dt, mt_comm_op op)
{
    const size_t b = count * mt_comm_dtype_size(dt);
    mt_comm *h = c->host;
    char *H = NULL;
    BEGIN(c);
    MT_GOTO(pinned(c, b, &H), out);
    MT_GOTO(down(c, H, send, b), out);
    MT_GOTO(wait_down(c), out);
    MT_GOTO(h->iface->all_reduce(h, H, H, count, dt, op), out);
    MT_GOTO(up(c, recv, H, b), out);
out:
    END(c);
}

static int staged_reduce_scatter(mt_comm *c, const void *send, void *recv, size_t count,
                                 mt_comm_dtype dt, mt_comm_op op)
{
    const size_t b = count * mt_comm_dtype_size(dt);
    mt_comm *h = c->host;
    char *H = NULL;
    BEGIN(c);
    MT_GOTO(pinned(c, b * (size_t)c->size, &H), out);
    MT_GOTO(down(c, H, send, b * (size_t)c->size), out);
    MT_GOTO(wait_down(c), out);
    char *own = H + (size_t)c->rank * b;
    MT_GOTO(h->iface->reduce_scatter(h, H, own, count, dt, op), out);
    MT_GOTO(up(c, recv, own, b), out);
out:
    END(c);
}

static int staged_gather_v(mt_comm *c, const void *send, size_t send_count, void *recv,
                           const size_t *counts, const size_t *displs, mt_comm_dtype dt, int root)
{
    const size_t es = mt_comm_dtype_size(dt), sb = send_count * es;
    const int receives = root < 0 || c->rank == root;
    mt_comm *h = c->host;
    char *H = NULL;
    BEGIN(c);
    if (receives) {
        /* the own block goes where it lands: an in-place gather on the host */
        MT_GOTO(pinned(c, extent(counts, displs, c->size) * es, &H), out);
        char *own = H + displs[c->rank] * es;
        MT_GOTO(down(c, own, send, sb), out);
        MT_GOTO(wait_down(c), out);
        MT_GOTO(h->iface->gather_v(h, own, send_count, H, counts, displs, dt, root), out);
        MT_GOTO(up_blocks(c, recv, H, counts, displs, es), out);
    } else {
        MT_GOTO(pinned(c, sb, &H), out);
        MT_GOTO(down(c, H, send, sb), out);
        MT_GOTO(wait_down(c), out);
        MT_GOTO(h->iface->gather_v(h, H, send_count, NULL, counts, displs, dt, root), out);
    }
out:
    END(c);
}

static int staged_all_to_all_v(mt_comm *c, const void *send, const size_t *send_counts,
                               const size_t *send_displs, void *recv, const size_t *recv_counts,
                               const size_t *recv_displs, mt_comm_dtype dt)
{
    const size_t es = mt_comm_dtype_size(dt);
    const size_t se = extent(send_counts, send_displs, c->size) * es;
    const size_t re = extent(recv_counts, recv_displs, c->size) * es;
    mt_comm *h = c->host;
    char *H = NULL;
    BEGIN(c);
    MT_GOTO(pinned(c, se + re, &H), out);
    MT_GOTO(down(c, H, send, se), out);
    MT_GOTO(wait_down(c), out);
    MT_GOTO(h->iface->all_to_all_v(h, H, send_counts, send_displs, H + se, recv_counts,
                                   recv_displs, dt),
            out);
    MT_GOTO(up_blocks(c, recv, H + se, recv_counts, recv_displs, es), out);
out:
    END(c);
}

static int staged_broadcast(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int root)
{
    const size_t b = count * mt_comm_dtype_size(dt);
    mt_comm *h = c->host;
    char *H = NULL;
    BEGIN(c);
    MT_GOTO(pinned(c, b, &H), out);
    if (c->rank == root) MT_GOTO(down(c, H, buf, b), out);
    /* also off the root: the previous op's copy up may still read H */
    MT_GOTO(wait_down(c), out);
    MT_GOTO(h->iface->broadcast(h, H, count, dt, root), out);
    if (c->rank != root) MT_GOTO(up(c, buf, H, b), out);
out:
    END(c);
}

static int staged_sendrecv(mt_comm *c, const void *send, size_t send_count, int dst, void *recv,
                           size_t recv_count, int src, mt_comm_dtype dt)
{
    const size_t es = mt_comm_dtype_size(dt), sb = send_count * es, rb = recv_count * es;
    mt_comm *h = c->host;
    char *H = NULL;
    BEGIN(c);
    MT_GOTO(pinned(c, sb + rb, &H), out);
    MT_GOTO(down(c, H, send, sb), out);
    MT_GOTO(wait_down(c), out);
    MT_GOTO(h->iface->sendrecv(h, H, send_count, dst, H + sb, recv_count, src, dt), out);
    MT_GOTO(up(c, recv, H + sb, rb), out);
out:
    END(c);
}

/* Pipeline messages through the host communicator (which copies a send
 * out at once, so the pinned buffer is free again when isend returns). */
static int staged_isend(mt_comm *c, const void *buf, size_t count, mt_comm_dtype dt, int peer,
                        int tag)
{
    const size_t bytes = count * mt_comm_dtype_size(dt);
    mt_comm *h = c->host;
    char *H = NULL;
    BEGIN(c);
    MT_GOTO(pinned(c, bytes, &H), out);
    MT_GOTO(down(c, H, buf, bytes), out);
    MT_GOTO(wait_down(c), out);
    MT_GOTO(h->iface->isend(h, H, count, dt, peer, tag), out);
out:
    END(c);
}

static int staged_recv_tag(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int peer,
                           int tag)
{
    const size_t bytes = count * mt_comm_dtype_size(dt);
    mt_comm *h = c->host;
    char *H = NULL;
    BEGIN(c);
    MT_GOTO(pinned(c, bytes, &H), out);
    /* the previous op's copy up may still read H (it waits on the side
     * stream behind the compute stream's work): two receives in a row, as
     * a pipeline stage does, would land the second message in the first's
     * buffer */
    MT_GOTO(wait_down(c), out);
    MT_GOTO(h->iface->recv_tag(h, H, count, dt, peer, tag), out);
    MT_GOTO(up(c, buf, H, bytes), out);
out:
    END(c);
}

static int staged_wait_sends(mt_comm *c) { return c->host->iface->wait_sends(c->host); }

static int staged_barrier(mt_comm *c) { return c->host->iface->barrier(c->host); }

static int staged_split(mt_comm *c, int color, int key, mt_comm **out)
{
    mt_comm *h = NULL;
    MT_CHECK(c->host->iface->split(c->host, color, key, &h));
    if (!h) return MT_OK;
    /* the new communicator lives on this one's device */
    int cur = 0;
    MT_CUDA_CHECK(cudaGetDevice(&cur));
    if (cur != CTX(c)->side.device) MT_CUDA_CHECK(cudaSetDevice(CTX(c)->side.device));
    int rc = mt_comm_staged_create(out, h);
    if (cur != CTX(c)->side.device) cudaSetDevice(cur);
    return rc;
}

static void staged_destroy(mt_comm *c)
{
    staged_ctx *x = CTX(c);
    mt_comm_side_free(&x->side);
    if (x->pinned) cudaFreeHost(x->pinned);
    free(x);
    free(c);
}

static int staged_join(mt_comm *c) { return mt_comm_side_join(&CTX(c)->side, c->stream); }
static int staged_sync(mt_comm *c) { return mt_comm_side_sync(&CTX(c)->side); }

/* ---- nonblocking owner collectives ------------------------------------------------------- */

/* start: the segments go down to a host mirror of the request's own
 * (pageable, so several requests can be in flight), the host waits for
 * the copies, and the mpi companion's op starts on the mirror. wait: the
 * companion's op completes, and the segments it wrote (reduce: those this
 * rank owns; gather: the others') go back up on the side stream. */
typedef struct staged_req {
    mt_comm_req h;
    mt_comm *dev;
    mt_comm_req *inner;
    int reduce;
    mt_comm_seg *segs;     /* device segments */
    mt_comm_seg *hsegs;    /* their host mirrors */
    int n;
    char *mirror;
} staged_req;

static void staged_req_free(mt_comm_req *r)
{
    staged_req *q = (staged_req *)r;
    if (q->inner) q->inner->free(q->inner);
    free(q->segs);
    free(q->hsegs);
    free(q->mirror);
    free(q);
}

static int staged_req_test(mt_comm_req *r, int *done)
{
    staged_req *q = (staged_req *)r;
    return q->inner->test(q->inner, done);
}

static int staged_req_wait(mt_comm_req *r)
{
    staged_req *q = (staged_req *)r;
    mt_comm *c = q->dev;
    MT_CHECK(q->inner->wait(q->inner));
    BEGIN(c);
    for (int k = 0; k < q->n && rc == MT_OK; k++) {
        const int mine = q->segs[k].owner == c->rank;
        const size_t bytes = q->hsegs[k].count * (q->reduce ? 4 : 1);
        if (q->reduce == mine) rc = up(c, q->segs[k].buf, q->hsegs[k].buf, bytes);
    }
    /* the mirror is freed with the request: the copies up must be done */
    if (rc == MT_OK) rc = wait_down(c);
    END(c);
}

static int staged_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, int reduce,
                              mt_comm_dtype wire, mt_comm_req **out)
{
    const size_t es = reduce ? 4 : 1; /* the segments hold f32 (reduce) or bytes */
    mt_comm *h = c->host;
    staged_req *q = calloc(1, sizeof *q);
    if (!q) return MT_ERR(MT_ENOMEM, "out of memory");
    q->h.test = staged_req_test;
    q->h.wait = staged_req_wait;
    q->h.free = staged_req_free;
    q->dev = c;
    q->reduce = reduce;
    q->n = n;
    size_t total = 0;
    for (int k = 0; k < n; k++) total += segs[k].count * es;
    q->segs = malloc((size_t)n * sizeof *segs);
    q->hsegs = malloc((size_t)n * sizeof *segs);
    q->mirror = malloc(total + 1);
    if (!q->segs || !q->hsegs || !q->mirror) {
        staged_req_free(&q->h);
        return MT_ERR(MT_ENOMEM, "comm staged: out of memory for a %zu-byte mirror", total);
    }
    memcpy(q->segs, segs, (size_t)n * sizeof *segs);
    BEGIN(c);
    size_t off = 0;
    for (int k = 0; k < n; k++) {
        q->hsegs[k] = segs[k];
        q->hsegs[k].buf = q->mirror + off;
        off += segs[k].count * es;
        /* a gather sends only what this rank owns */
        if ((reduce || segs[k].owner == c->rank) && rc == MT_OK)
            rc = down(c, q->hsegs[k].buf, segs[k].buf, segs[k].count * es);
    }
    if (rc == MT_OK) rc = wait_down(c);
    if (rc == MT_OK)
        rc = reduce ? h->iface->reduce_owned_start(h, q->hsegs, n, wire, &q->inner)
                    : h->iface->gather_owned_start(h, q->hsegs, n, &q->inner);
    if (rc == MT_OK) {
        q->inner->c = h;
        *out = &q->h;
    } else {
        staged_req_free(&q->h);
    }
    END(c);
}

static int staged_reduce_owned_start(mt_comm *c, const mt_comm_seg *segs, int n,
                                     mt_comm_dtype wire, mt_comm_req **req)
{
    return staged_owned_start(c, segs, n, 1, wire, req);
}

static int staged_gather_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_req **req)
{
    return staged_owned_start(c, segs, n, 0, MT_COMM_BYTE, req);
}

/* all_to_all_v started: the send blocks go down to a host mirror of the
 * request's own (pageable, like the owner ops': the communicator's pinned
 * buffer stays free for other ops) and the mpi companion's exchange
 * starts on it; wait completes that exchange and copies the received
 * blocks up on the side stream. */
typedef struct staged_a2a_req {
    mt_comm_req h;
    mt_comm *dev;
    mt_comm_req *inner;
    char *mirror;     /* [se + re]: send blocks, then receive blocks */
    size_t se, es;
    void *recv;
    size_t *rc, *rd;  /* [size]: the receive blocks */
} staged_a2a_req;

static void staged_a2a_free(mt_comm_req *r)
{
    staged_a2a_req *q = (staged_a2a_req *)r;
    if (q->inner) q->inner->free(q->inner);
    free(q->mirror);
    free(q->rc);
    free(q->rd);
    free(q);
}

static int staged_a2a_test(mt_comm_req *r, int *done)
{
    staged_a2a_req *q = (staged_a2a_req *)r;
    return q->inner->test(q->inner, done);
}

static int staged_a2a_wait(mt_comm_req *r)
{
    staged_a2a_req *q = (staged_a2a_req *)r;
    mt_comm *c = q->dev;
    MT_CHECK(q->inner->wait(q->inner));
    BEGIN(c);
    MT_GOTO(up_blocks(c, q->recv, q->mirror + q->se, q->rc, q->rd, q->es), out);
    /* the mirror is freed with the request: the copies up must be done */
    MT_GOTO(wait_down(c), out);
out:
    END(c);
}

static int staged_all_to_all_v_start(mt_comm *c, const void *send, const size_t *send_counts,
                                     const size_t *send_displs, void *recv,
                                     const size_t *recv_counts, const size_t *recv_displs,
                                     mt_comm_dtype dt, mt_comm_req **out)
{
    const size_t es = mt_comm_dtype_size(dt);
    const size_t se = extent(send_counts, send_displs, c->size) * es;
    const size_t re = extent(recv_counts, recv_displs, c->size) * es;
    mt_comm *h = c->host;
    staged_a2a_req *q = calloc(1, sizeof *q);
    if (!q) return MT_ERR(MT_ENOMEM, "comm staged: out of memory");
    q->h.test = staged_a2a_test;
    q->h.wait = staged_a2a_wait;
    q->h.free = staged_a2a_free;
    q->dev = c;
    q->se = se;
    q->es = es;
    q->recv = recv;
    q->mirror = malloc(se + re + 1);
    q->rc = malloc((size_t)c->size * sizeof *q->rc);
    q->rd = malloc((size_t)c->size * sizeof *q->rd);
    if (!q->mirror || !q->rc || !q->rd) {
        staged_a2a_free(&q->h);
        return MT_ERR(MT_ENOMEM, "comm staged: out of memory for a %zu-byte mirror", se + re);
    }
    memcpy(q->rc, recv_counts, (size_t)c->size * sizeof *q->rc);
    memcpy(q->rd, recv_displs, (size_t)c->size * sizeof *q->rd);
    BEGIN(c);
    MT_GOTO(down(c, q->mirror, send, se), out);
    MT_GOTO(wait_down(c), out);
    MT_GOTO(h->iface->all_to_all_v_start(h, q->mirror, send_counts, send_displs, q->mirror + se,
                                         recv_counts, recv_displs, dt, &q->inner),
            out);
    q->inner->c = h;
out:
    if (rc == MT_OK) *out = &q->h;
    else staged_a2a_free(&q->h);
    END(c);
}

static const mt_comm_iface STAGED_IFACE = {
    .all_reduce = staged_all_reduce,
    .reduce_scatter = staged_reduce_scatter,
    .gather_v = staged_gather_v,
    .all_to_all_v = staged_all_to_all_v,
    .broadcast = staged_broadcast,
    .sendrecv = staged_sendrecv,
    .isend = staged_isend,
    .recv_tag = staged_recv_tag,
    .wait_sends = staged_wait_sends,
    .barrier = staged_barrier,
    .split = staged_split,
    .destroy = staged_destroy,
    .reduce_owned_start = staged_reduce_owned_start,
    .gather_owned_start = staged_gather_owned_start,
    .all_to_all_v_start = staged_all_to_all_v_start,
    .join = staged_join,
    .sync = staged_sync,
};

int mt_comm_staged_create(mt_comm **out, mt_comm *host)
{
    *out = NULL;
    mt_comm *c = calloc(1, sizeof *c);
    staged_ctx *x = calloc(1, sizeof *x);
    int rc = c && x ? mt_comm_side_init(&x->side) : MT_ERR(MT_ENOMEM, "comm staged: out of memory");
    if (rc < 0) {
        if (x) mt_comm_side_free(&x->side);
        free(x);
        free(c);
        mt_comm_destroy(host);
        return rc;
    }
    mt_comm_init_fields(c, &STAGED_IFACE, MT_COMM_STAGED, MT_COMM_DEVICE, host->rank, host->size);
    c->chunk_bytes = host->chunk_bytes;
    c->host = host;
    c->ctx = x;
    *out = c;
    return MT_OK;
}
