/* comm_nccl.c - device buffers through NCCL.
 *
 * One ncclComm per communicator (per process group): rank 0 of the group
 * makes a unique id, the group's mpi companion broadcasts it, every rank
 * joins with ncclCommInitRank on the CUDA device current at creation.
 * split splits the companion and makes a new ncclComm the same way.
 * NCCL reads its environment itself (NCCL_NVLS_ENABLE=0 turns NVLink
 * SHARP / multicast off); nothing here sets or overrides it.
 *
 * Collectives run on the communicator's side stream (comm_cuda.h): after
 * the compute stream's work so far, joined back unless the caller
 * overlaps.
 *  - i32 i64 f32 f64: NCCL's own reductions. Sums are in NCCL's ring or
 *    tree order (not rank order: mt_comm_rank_ordered = 0) and the same
 *    on every rank (reduce then broadcast of each element).
 *  - bf16 and e4m3, any op: widened to f32 in a device scratch buffer,
 *    reduced in f32, narrowed once (comm.h: never rounded per hop). This
 *    sends f32 (2x / 4x the bytes) and holds count f32 of scratch
 *    (size * count for reduce_scatter); the scratch grows to the largest
 *    op and is kept.
 *  - all_gather of equal contiguous blocks: ncclAllGather; the v-forms
 *    and all_to_all_v: ncclSend / ncclRecv in one group, the own block by
 *    a device copy. broadcast: ncclBroadcast. Data moves as bytes.
 *  - barrier: the companion's (host-level, as comm.h says).
 *  - pipeline messages (isend / recv_tag / wait_sends): see "pipeline
 *    messages" below.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "engine/parallel/comm_cuda.h"
#include "engine/parallel/comm_impl.h"

struct nccl_pipe;

typedef struct nccl_ctx {
    mt_comm_side side;
    ncclComm_t nc;
    float *scratch; /* device, for bf16 / e4m3 reductions */
    size_t cap;     /* elements */
    struct nccl_pipe *pipe; /* pipeline messages: NULL until pipe_open */
} nccl_ctx;

static nccl_ctx *CTX(mt_comm *c) { return c->ctx; }

static int native(mt_comm_dtype dt, ncclDataType_t *t)
{
    switch (dt) {
    case MT_COMM_I32: *t = ncclInt32; return 1;
    case MT_COMM_I64: *t = ncclInt64; return 1;
    case MT_COMM_F32: *t = ncclFloat32; return 1;
    case MT_COMM_F64: *t = ncclFloat64; return 1;
    default: return 0;
    }
}

static ncclRedOp_t red(mt_comm_op op)
{
    return op == MT_COMM_SUM ? ncclSum : op == MT_COMM_MAX ? ncclMax : ncclMin;
}

static int scratch(mt_comm *c, size_t n, float **out)
{
    nccl_ctx *x = CTX(c);
    if (n > x->cap) {
        MT_CUDA_CHECK(cudaStreamSynchronize(x->side.stream));
        if (x->scratch) cudaFree(x->scratch);
        x->scratch = NULL;
        x->cap = 0;
        cudaError_t e = cudaMalloc((void **)&x->scratch, n * sizeof(float));
        if (e != cudaSuccess)
            return MT_ERR(MT_ENOMEM, "comm nccl: %zu bytes of f32 scratch for a bf16/e4m3 reduction: %s",
                          n * sizeof(float), cudaGetErrorString(e));
        x->cap = n;
    }
    *out = x->scratch;
    return MT_OK;
}

static int dcopy(mt_comm *c, void *dst, const void *src, size_t bytes)
{
    if (bytes == 0 || dst == src) return MT_OK;
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, CTX(c)->side.stream));
    return MT_OK;
}

#define BEGIN(c)                                                                       \
    int rc = mt_comm_side_begin(&CTX(c)->side, (c)->stream);                           \
    if (rc < 0) return mt_comm_side_end(&CTX(c)->side, rc)
#define END(c) return mt_comm_side_end(&CTX(c)->side, rc)
#define S(c) (CTX(c)->side.stream)

/* NCCL status to ours, naming the call (and the peer when >= 0). */
static int nccl_fail(ncclResult_t e, const char *call, int peer)
{
    if (peer >= 0) return MT_ERR(MT_ENCCL, "%s with rank %d: %s", call, peer, ncclGetErrorString(e));
    return MT_ERR(MT_ENCCL, "%s: %s", call, ncclGetErrorString(e));
}
#define NC(stmt, call, peer)                                                           \
    do {                                                                               \
        ncclResult_t e_ = (stmt);                                                      \
        if (e_ != ncclSuccess) {                                                       \
            rc = nccl_fail(e_, call, peer);                                            \
            goto out;                                                                  \
        }                                                                              \
    } while (0)

static int nccl_all_reduce(mt_comm *c, const void *send, void *recv, size_t count,
                           mt_comm_dtype dt, mt_comm_op op)
{
    ncclDataType_t t;
    float *f = NULL;
    BEGIN(c);
    if (native(dt, &t)) {
        NC(ncclAllReduce(send, recv, count, t, red(op), CTX(c)->nc, S(c)), "ncclAllReduce", -1);
    } else {
        const int bf16 = dt == MT_COMM_BF16;
        MT_GOTO(scratch(c, count, &f), out);
        MT_GOTO(mt_comm_cuda_widen(f, send, bf16, count, S(c)), out);
        NC(ncclAllReduce(f, f, count, ncclFloat32, red(op), CTX(c)->nc, S(c)), "ncclAllReduce (f32)",
           -1);
        MT_GOTO(mt_comm_cuda_narrow(recv, bf16, f, count, S(c)), out);
    }
out:
    END(c);
}

static int nccl_reduce_scatter(mt_comm *c, const void *send, void *recv, size_t count,
                               mt_comm_dtype dt, mt_comm_op op)
{
    ncclDataType_t t;
    float *f = NULL;
    BEGIN(c);
    if (native(dt, &t)) {
        NC(ncclReduceScatter(send, recv, count, t, red(op), CTX(c)->nc, S(c)), "ncclReduceScatter",
           -1);
    } else {
        const int bf16 = dt == MT_COMM_BF16;
        const size_t all = count * (size_t)c->size;
        MT_GOTO(scratch(c, all, &f), out);
        MT_GOTO(mt_comm_cuda_widen(f, send, bf16, all, S(c)), out);
        float *own = f + (size_t)c->rank * count;
        NC(ncclReduceScatter(f, own, count, ncclFloat32, red(op), CTX(c)->nc, S(c)),
           "ncclReduceScatter (f32)", -1);
        MT_GOTO(mt_comm_cuda_narrow(recv, bf16, own, count, S(c)), out);
    }
out:
    END(c);
}

static int nccl_gather_v(mt_comm *c, const void *send, size_t send_count, void *recv,
                         const size_t *counts, const size_t *displs, mt_comm_dtype dt, int root)
{
    const int n = c->size, me = c->rank, receives = root < 0 || me == root;
    const size_t es = mt_comm_dtype_size(dt);
    int equal = root < 0;
    for (int r = 0; r < n && equal; r++) equal = counts[r] == send_count && displs[r] == (size_t)r * send_count;
    BEGIN(c);
    if (equal && send_count == 0) goto out;
    if (equal) {
        NC(ncclAllGather(send, recv, send_count * es, ncclUint8, CTX(c)->nc, S(c)), "ncclAllGather",
           -1);
        goto out;
    }
    NC(ncclGroupStart(), "ncclGroupStart", -1);
    for (int r = 0; r < n; r++) {
        if (r == me) continue;
        if (receives && counts[r] > 0)
            NC(ncclRecv((char *)recv + displs[r] * es, counts[r] * es, ncclUint8, r, CTX(c)->nc, S(c)),
               "ncclRecv", r);
        if (send_count > 0 && (root < 0 || r == root))
            NC(ncclSend(send, send_count * es, ncclUint8, r, CTX(c)->nc, S(c)), "ncclSend", r);
    }
    NC(ncclGroupEnd(), "ncclGroupEnd (gather)", -1);
    if (receives) MT_GOTO(dcopy(c, (char *)recv + displs[me] * es, send, send_count * es), out);
out:
    END(c);
}

static int nccl_all_to_all_v(mt_comm *c, const void *send, const size_t *send_counts,
                             const size_t *send_displs, void *recv, const size_t *recv_counts,
                             const size_t *recv_displs, mt_comm_dtype dt)
{
    const int n = c->size, me = c->rank;
    const size_t es = mt_comm_dtype_size(dt);
    BEGIN(c);
    NC(ncclGroupStart(), "ncclGroupStart", -1);
    for (int p = 0; p < n; p++) {
        if (p == me) continue;
        if (recv_counts[p] > 0)
            NC(ncclRecv((char *)recv + recv_displs[p] * es, recv_counts[p] * es, ncclUint8, p,
                        CTX(c)->nc, S(c)),
               "ncclRecv", p);
        if (send_counts[p] > 0)
            NC(ncclSend((const char *)send + send_displs[p] * es, send_counts[p] * es, ncclUint8, p,
                        CTX(c)->nc, S(c)),
               "ncclSend", p);
    }
    NC(ncclGroupEnd(), "ncclGroupEnd (all_to_all_v)", -1);
    MT_GOTO(dcopy(c, (char *)recv + recv_displs[me] * es, (const char *)send + send_displs[me] * es,
                  send_counts[me] * es),
            out);
out:
    END(c);
}

static int nccl_broadcast(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int root)
{
    BEGIN(c);
    NC(ncclBroadcast(buf, buf, count * mt_comm_dtype_size(dt), ncclUint8, root, CTX(c)->nc, S(c)),
       "ncclBroadcast", root);
out:
    END(c);
}

static int nccl_sendrecv(mt_comm *c, const void *send, size_t send_count, int dst, void *recv,
                         size_t recv_count, int src, mt_comm_dtype dt)
{
    const size_t es = mt_comm_dtype_size(dt);
    BEGIN(c);
    if (dst == c->rank) { /* src too: comm.c checked */
        MT_GOTO(dcopy(c, recv, send, send_count * es), out);
        goto out;
    }
    NC(ncclGroupStart(), "ncclGroupStart", -1);
    if (src != MT_COMM_NO_PEER && recv_count > 0)
        NC(ncclRecv(recv, recv_count * es, ncclUint8, src, CTX(c)->nc, S(c)), "ncclRecv", src);
    if (dst != MT_COMM_NO_PEER && send_count > 0)
        NC(ncclSend(send, send_count * es, ncclUint8, dst, CTX(c)->nc, S(c)), "ncclSend", dst);
    NC(ncclGroupEnd(), "ncclGroupEnd (sendrecv)", -1);
out:
    END(c);
}

static int nccl_barrier(mt_comm *c) { return c->host->iface->barrier(c->host); }

static int nccl_split(mt_comm *c, int color, int key, mt_comm **out)
{
    mt_comm *h = NULL;
    MT_CHECK(c->host->iface->split(c->host, color, key, &h));
    if (!h) return MT_OK;
    /* A group of one rank moves nothing: a local communicator, without an
     * ncclComm's device buffers (a job's groups of one rank were failing
     * ncclCommInitRank once the backend's arena held the device memory). */
    if (mt_comm_size(h) == 1) {
        mt_comm_destroy(h);
        return mt_comm_local_create(out, MT_COMM_DEVICE);
    }
    int cur = 0;
    MT_CUDA_CHECK(cudaGetDevice(&cur));
    if (cur != CTX(c)->side.device) MT_CUDA_CHECK(cudaSetDevice(CTX(c)->side.device));
    int rc = mt_comm_nccl_create(out, h);
    if (cur != CTX(c)->side.device) cudaSetDevice(cur);
    return rc;
}

static void pipe_close(mt_comm *c);

static void nccl_destroy(mt_comm *c)
{
    nccl_ctx *x = CTX(c);
    pipe_close(c);
    if (x->side.stream) cudaStreamSynchronize(x->side.stream);
    if (x->nc) ncclCommDestroy(x->nc);
    if (x->scratch) cudaFree(x->scratch);
    mt_comm_side_free(&x->side);
    free(x);
    free(c);
}

static int nccl_join(mt_comm *c) { return mt_comm_side_join(&CTX(c)->side, c->stream); }

static int pipe_sync(mt_comm *c);

static int nccl_sync(mt_comm *c)
{
    MT_CHECK(mt_comm_side_sync(&CTX(c)->side));
    MT_CHECK(pipe_sync(c));
    ncclResult_t async = ncclSuccess;
    ncclResult_t e = ncclCommGetAsyncError(CTX(c)->nc, &async);
    if (e != ncclSuccess) return nccl_fail(e, "ncclCommGetAsyncError", -1);
    if (async != ncclSuccess) return nccl_fail(async, "NCCL (asynchronous error)", -1);
    return MT_OK;
}

/* ---- nonblocking owner collectives ------------------------------------------------------- */

/* Everything is enqueued at start on the side stream, after the compute
 * stream's work so far: reduce_owned packs each owner's segments in the
 * wire type (narrowed for bf16), sends them with ncclSend, the owner
 * receives one row per rank ([size][own], its own row packed locally) and
 * adds the rows in rank order in f32 (mt_comm_cuda_sum_rows): the same
 * sum as the host backends, bit for bit. gather_owned: ncclSend of the
 * packed own bytes to every peer, ncclRecv of each owner's, unpacked by
 * device copies. Temporary buffers are stream-ordered (cudaMallocAsync /
 * cudaFreeAsync), bounded by cutting the segments into pieces that run one
 * after another (owned_piece_elems). wait: nothing left but the join
 * comm.c does. */
typedef struct nccl_req {
    mt_comm_req h;
    mt_comm *dev;
} nccl_req;

static void nccl_req_free(mt_comm_req *r) { free(r); }

static int nccl_req_test(mt_comm_req *r, int *done)
{
    cudaError_t e = cudaStreamQuery(CTX(((nccl_req *)r)->dev)->side.stream);
    *done = e == cudaSuccess;
    if (e != cudaSuccess && e != cudaErrorNotReady)
        return MT_ERR(MT_ECUDA, "cudaStreamQuery(side stream): %s", cudaGetErrorString(e));
    return MT_OK;
}

static int nccl_req_wait(mt_comm_req *r)
{
    (void)r;
    return MT_OK;
}

/* A request for work already enqueued on the side stream: *out, or
 * MT_ENOMEM. */
static int nccl_req_new(mt_comm *c, mt_comm_req **out)
{
    nccl_req *q = calloc(1, sizeof *q);
    if (!q) return MT_ERR(MT_ENOMEM, "comm nccl: out of memory");
    q->h.test = nccl_req_test;
    q->h.wait = nccl_req_wait;
    q->h.free = nccl_req_free;
    q->dev = c;
    *out = &q->h;
    return MT_OK;
}

#define CU(stmt)                                                                       \
    do {                                                                               \
        cudaError_t e_ = (stmt);                                                       \
        if (e_ != cudaSuccess) {                                                       \
            rc = MT_ERR(MT_ECUDA, "%s: %s", #stmt, cudaGetErrorString(e_));            \
            goto out;                                                                  \
        }                                                                              \
    } while (0)

/* One piece of an owner op, enqueued on the side stream (see above). */
static int nccl_owned_piece(mt_comm *c, const mt_comm_seg *segs, int n, int reduce,
                            mt_comm_dtype wire)
{
    const int me = c->rank, size = c->size, bf16 = wire == MT_COMM_BF16;
    const size_t es = reduce ? mt_comm_dtype_size(wire) : 1;
    mt_comm_owned_plan plan = {0};
    size_t *off = NULL, others = 0;
    char *sendbuf = NULL, *rows = NULL;
    BEGIN(c);
    MT_GOTO(mt_comm_owned_plan_make(&plan, segs, n, size), out);
    off = calloc((size_t)size, sizeof *off);
    if (!off) {
        rc = MT_ERR(MT_ENOMEM, "out of memory");
        goto out;
    }
    const size_t own = plan.total[me];
    for (int o = 0; o < size; o++)
        if (o != me) {
            off[o] = others * es;
            others += plan.total[o];
        }
    const size_t sbytes = (reduce ? others : own) * es + 16;
    const size_t rbytes = (reduce ? (size_t)size * own : others) * es + 16;
    CU(cudaMallocAsync((void **)&sendbuf, sbytes, S(c)));
    CU(cudaMallocAsync((void **)&rows, rbytes, S(c)));
    for (int k = 0; k < n; k++) {
        const mt_comm_seg *g = &segs[k];
        char *dst = NULL;
        if (reduce) dst = g->owner == me ? rows + ((size_t)me * own + plan.pos[k]) * es
                                         : sendbuf + off[g->owner] + plan.pos[k] * es;
        else if (g->owner == me) dst = sendbuf + plan.pos[k];
        if (!dst) continue;
        if (reduce && bf16) MT_GOTO(mt_comm_cuda_narrow(dst, 1, g->buf, g->count, S(c)), out);
        else MT_GOTO(dcopy(c, dst, g->buf, g->count * es), out);
    }
    NC(ncclGroupStart(), "ncclGroupStart", -1);
    for (int p = 0; p < size; p++) {
        if (p == me) continue;
        if (reduce) {
            if (plan.total[p] > 0)
                NC(ncclSend(sendbuf + off[p], plan.total[p] * es, ncclUint8, p, CTX(c)->nc, S(c)),
                   "ncclSend", p);
            if (own > 0)
                NC(ncclRecv(rows + (size_t)p * own * es, own * es, ncclUint8, p, CTX(c)->nc, S(c)),
                   "ncclRecv", p);
        } else {
            if (own > 0) NC(ncclSend(sendbuf, own, ncclUint8, p, CTX(c)->nc, S(c)), "ncclSend", p);
            if (plan.total[p] > 0)
                NC(ncclRecv(rows + off[p], plan.total[p], ncclUint8, p, CTX(c)->nc, S(c)),
                   "ncclRecv", p);
        }
    }
    NC(ncclGroupEnd(), "ncclGroupEnd (owned)", -1);
    for (int k = 0; k < n; k++) {
        const mt_comm_seg *g = &segs[k];
        if (reduce && g->owner == me)
            MT_GOTO(mt_comm_cuda_sum_rows(g->buf, rows + plan.pos[k] * es, bf16, size, own,
                                          g->count, S(c)),
                    out);
        else if (!reduce && g->owner != me)
            MT_GOTO(dcopy(c, g->buf, rows + off[g->owner] + plan.pos[k], g->count), out);
    }
out:
    if (sendbuf) cudaFreeAsync(sendbuf, S(c));
    if (rows) cudaFreeAsync(rows, S(c));
    free(off);
    mt_comm_owned_plan_free(&plan);
    END(c);
}

/* Elements of buf one piece moves at most (MT_COMM_OWNED_PIECE overrides,
 * for tests): the temporaries of a piece are about size x piece x wire
 * bytes on an owner (every rank's row) and a piece's worth to send, all
 * stream-ordered beside the backend's arena; a 926 M-element embedding in
 * one piece asked for 7.4 GB (the DSV3 proxy at ep = 2 on H200s,
 * 2026-11-26). Cutting a segment is exact: the sums are elementwise. */
static size_t owned_piece_elems(int reduce)
{
    const char *e = getenv("MT_COMM_OWNED_PIECE");
    size_t v = e && *e ? (size_t)strtoull(e, NULL, 10) : 0;
    return v ? v : reduce ? (size_t)16 << 20 : (size_t)64 << 20;
}

/* The segments cut into pieces of at most owned_piece_elems() elements,
 * each enqueued in turn (the same cuts on every rank: they depend on the
 * counts alone); one request, done when the side stream is. */
static int nccl_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, int reduce,
                            mt_comm_dtype wire, mt_comm_req **out)
{
    const size_t cap = owned_piece_elems(reduce);
    const size_t bes = reduce ? 4 : 1; /* bytes of a buf element: f32 gradients, or bytes */
    mt_comm_seg *piece = malloc((size_t)(n > 0 ? n : 1) * sizeof *piece);
    int rc = MT_OK;
    if (!piece) rc = MT_ERR(MT_ENOMEM, "comm nccl: owner op: out of memory");
    int k = 0;
    size_t at = 0; /* elements of segs[k] already in earlier pieces */
    while (rc == MT_OK && k < n) {
        int m = 0;
        size_t tot = 0;
        while (k < n && tot < cap) {
            const mt_comm_seg *g = &segs[k];
            size_t take = g->count - at;
            if (take > cap - tot) take = cap - tot;
            piece[m++] = (mt_comm_seg){(char *)g->buf + at * bes, take, g->owner};
            tot += take;
            at += take;
            if (at == g->count) k++, at = 0;
        }
        rc = nccl_owned_piece(c, piece, m, reduce, wire);
    }
    free(piece);
    return rc != MT_OK ? rc : nccl_req_new(c, out);
}

/* all_to_all_v started: enqueued on the side stream as the blocking form
 * is; the compute stream waits for it at mt_comm_wait (comm.c's join), so
 * the kernels enqueued meanwhile run beside it. */
static int nccl_all_to_all_v_start(mt_comm *c, const void *send, const size_t *send_counts,
                                   const size_t *send_displs, void *recv,
                                   const size_t *recv_counts, const size_t *recv_displs,
                                   mt_comm_dtype dt, mt_comm_req **out)
{
    int rc = nccl_all_to_all_v(c, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                               dt);
    return rc != MT_OK ? rc : nccl_req_new(c, out);
}

static int nccl_reduce_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_dtype wire,
                                   mt_comm_req **req)
{
    return nccl_owned_start(c, segs, n, 1, wire, req);
}

static int nccl_gather_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_req **req)
{
    return nccl_owned_start(c, segs, n, 0, MT_COMM_BYTE, req);
}

/* ---- pipeline messages ------------------------------------------------------------------- */

/* NCCL has no tags, matches the sends and receives of two ranks in the
 * order they are issued, an ncclSend does not complete (its kernel waits
 * on the GPU) until the peer's ncclRecv runs, and the operations of one
 * ncclComm run one after another on the device. The pipeline executor
 * sends and receives in orders that MPI's buffered sends accept but one
 * queue per rank would deadlock: 1F1B on two stages, stage 0 sends
 * activations 0 and 1, then waits for gradient 0, which stage 1 sends
 * before it takes activation 1 (stage 0's queue: send a0, send a1, recv
 * g0; stage 1's: recv a0, send g0, recv a1 - a1 and g0 wait for each
 * other). So:
 *  - links: one per ring neighbour (rank +-1 mod size), each with two
 *    2-rank NCCL communicators of its own, one per direction ("to": this
 *    rank's sends to the peer only; "from": its receives from the peer
 *    only), each on a non-blocking stream of its own. The k-th send of a
 *    queue meets the k-th receive of the peer's: nothing in a queue waits
 *    for a message issued later. pipe_open makes them (collective; the
 *    edges of the ring are taken in one global order, so the blocking
 *    2-rank inits cannot wait on each other in a cycle) and moves one byte
 *    each way, so that NCCL connects the pair there: a first-use connection
 *    is a host handshake that would block isend until the peer's first
 *    receive.
 *  - tags travel on the host: isend enqueues the ncclSend, then announces
 *    (tag, bytes) to the peer over a private MPI communicator (a dup of
 *    the companion); recv_tag takes the peer's announcements in order and
 *    posts an ncclRecv into a pool buffer for each (so receives follow the
 *    sender's order, as NCCL needs) until the wanted tag has come; the
 *    others stay in the pool until asked for (the oldest first for a tag
 *    that comes twice, as MPI orders them). The host waits for the
 *    sender's isend call, never for data: the compute stream waits for the
 *    arrival (an event) and copies the message out.
 *  - isend copies buf into a pool buffer on the compute stream (so the
 *    caller's later work may overwrite buf); the "to" stream waits for
 *    the copy and sends. The compute stream never waits for a send, so a
 *    send waiting for its receiver holds back no compute; wait_sends is
 *    the one place that waits for sends (the host, polling, with a warning
 *    naming the peer, tag and bytes while one is not taken).
 * Every device wait then points at work issued earlier on the same host,
 * or at the matching operation of the peer, which its host issues when it
 * reaches the call that MPI's buffered sends need too: a schedule that
 * runs on the mpi backend runs here. Not covered: device-wide waits
 * (cudaDeviceSynchronize, cudaFree) during a step, which would wait for an
 * undelivered send and so for the peer's host (the engine waits on
 * streams); NCCL_LAUNCH_ORDER_IMPLICIT=1, which runs the kernels of all
 * communicators of the device in launch order (a later receive behind an
 * earlier send); and streams that share a hardware queue (more streams
 * than CUDA_DEVICE_MAX_CONNECTIONS, default 8), where work queued behind a
 * waiting send may wait with it - if a run hangs with sends "not taken"
 * (wait_sends warns), CUDA_DEVICE_MAX_CONNECTIONS=32 is the first thing
 * to try.
 * Pool (bounded): a buffer is held by a send until its ncclSend has
 * completed (an event query, never a wait), by a receive from its post
 * until recv_tag copies it out (free at once then: later users wait for
 * the copy by event). So it holds at most the most messages in flight at
 * once (sent and not yet received, plus received ahead of their recv_tag),
 * for a pipeline schedule a few per neighbour and micro-batch in flight;
 * buffers are kept, and one too small is regrown (all of a pipeline's
 * messages are msg_bytes). */

typedef enum { PB_FREE = 0, PB_SENDING, PB_ARRIVED } pipe_state;

typedef struct pipe_buf {
    char *dev;
    size_t cap;
    cudaEvent_t ev;   /* sending: the send done; arrived: the data in; free: its last read */
    pipe_state state;
    int peer, tag;
    size_t bytes;
    long long seq;    /* sending / arrived: the message's number on its link */
} pipe_buf;

typedef struct pipe_link {
    int peer;
    int lo_first;          /* this rank is the edge's lower rank: "to" was made first */
    ncclComm_t to, from;   /* 2 ranks each: the sender is rank 0, the receiver rank 1 */
    cudaStream_t sto, sfrom;
    long long sent, received; /* messages so far */
} pipe_link;

typedef struct nccl_pipe {
    mt_comm *ann;   /* mpi, private: the announcements, and the ids at open */
    pipe_link link[2];
    int n_link;
    pipe_buf *buf;
    int n_buf, cap_buf;
} nccl_pipe;

/* An announcement: the next message on the link has this tag and size. */
typedef struct pipe_note {
    int64_t tag;
    int64_t bytes;
} pipe_note;
#define PIPE_NOTE_TAG 0 /* the only tag of the private communicator */

static int dev_enter(nccl_ctx *x, int *saved)
{
    MT_CUDA_CHECK(cudaGetDevice(saved));
    if (*saved != x->side.device) MT_CUDA_CHECK(cudaSetDevice(x->side.device));
    return MT_OK;
}

static void dev_leave(nccl_ctx *x, int saved)
{
    if (saved != x->side.device) cudaSetDevice(saved);
}

static int pipe_link_of(mt_comm *c, int peer, pipe_link **out)
{
    nccl_pipe *p = CTX(c)->pipe;
    if (!p) /* comm.c refuses before pipe_open; this is a second guard */
        return MT_ERR(MT_ESTATE, "comm nccl: pipeline messages before pipe_open");
    for (int i = 0; i < p->n_link; i++)
        if (p->link[i].peer == peer) {
            *out = &p->link[i];
            return MT_OK;
        }
    const int n = c->size, me = c->rank;
    return MT_ERR(MT_ENOTSUP, "comm nccl: pipeline messages go between ring neighbours (rank %d's "
                  "are %d and %d of %d); rank %d is not one (use parallel.comm=staged)",
                  me, (me + n - 1) % n, (me + 1) % n, n, peer);
}

/* The oldest arrived message (peer, tag), or -1. */
static int pool_find(const nccl_pipe *p, int peer, int tag)
{
    int k = -1;
    for (int i = 0; i < p->n_buf; i++) {
        const pipe_buf *b = &p->buf[i];
        if (b->state == PB_ARRIVED && b->peer == peer && b->tag == tag &&
            (k < 0 || b->seq < p->buf[k].seq))
            k = i;
    }
    return k;
}

/* Index of a free pool buffer of at least `bytes` that work on stream s
 * may write (s waits for its last read): the smallest that fits, else a
 * free one regrown, else a new one (allocations are stream-ordered on s:
 * no device-wide wait). */
static int pool_take(nccl_pipe *p, size_t bytes, cudaStream_t s, int *out)
{
    int fit = -1, small = -1, rc = MT_OK;
    for (int i = 0; i < p->n_buf; i++) {
        pipe_buf *b = &p->buf[i];
        if (b->state == PB_SENDING) {
            cudaError_t e = cudaEventQuery(b->ev);
            if (e == cudaSuccess) b->state = PB_FREE;
            else if (e != cudaErrorNotReady)
                return MT_ERR(MT_ECUDA, "pipeline send to rank %d (tag %d, %zu bytes): %s", b->peer,
                              b->tag, b->bytes, cudaGetErrorString(e));
        }
        if (b->state != PB_FREE) continue;
        if (b->cap >= bytes) {
            if (fit < 0 || b->cap < p->buf[fit].cap) fit = i;
        } else if (small < 0) {
            small = i;
        }
    }
    const size_t cap = (bytes + 255) / 256 * 256;
    if (fit < 0 && small < 0) {
        if (p->n_buf == p->cap_buf) {
            int nc = p->cap_buf ? 2 * p->cap_buf : 8;
            pipe_buf *nb = realloc(p->buf, (size_t)nc * sizeof *nb);
            if (!nb)
                return MT_ERR(MT_ENOMEM, "comm nccl: out of memory for %d pipeline buffers", nc);
            p->buf = nb;
            p->cap_buf = nc;
        }
        pipe_buf *b = &p->buf[p->n_buf];
        memset(b, 0, sizeof *b);
        CU(cudaEventCreateWithFlags(&b->ev, cudaEventDisableTiming));
        p->n_buf++; /* an event never recorded: waiting for it waits for nothing */
        small = p->n_buf - 1;
    }
    if (fit < 0) {
        pipe_buf *b = &p->buf[small];
        CU(cudaStreamWaitEvent(s, b->ev, 0));
        if (b->dev) CU(cudaFreeAsync(b->dev, s));
        b->dev = NULL;
        b->cap = 0;
        cudaError_t e = cudaMallocAsync((void **)&b->dev, cap, s);
        if (e != cudaSuccess) {
            b->dev = NULL;
            return MT_ERR(MT_ENOMEM, "comm nccl: a %zu-byte pipeline buffer (%d in the pool): %s",
                          cap, p->n_buf, cudaGetErrorString(e));
        }
        b->cap = cap;
        fit = small;
    } else {
        CU(cudaStreamWaitEvent(s, p->buf[fit].ev, 0));
    }
    *out = fit;
out:
    return rc;
}

static int nccl_isend(mt_comm *c, const void *buf, size_t count, mt_comm_dtype dt, int peer,
                      int tag)
{
    nccl_ctx *x = CTX(c);
    nccl_pipe *p = x->pipe;
    const size_t bytes = count * mt_comm_dtype_size(dt);
    cudaStream_t cs = (cudaStream_t)c->stream;
    pipe_link *L = NULL;
    int saved = 0, k = -1;
    MT_CHECK(pipe_link_of(c, peer, &L));
    MT_CHECK(dev_enter(x, &saved));
    int rc = pool_take(p, bytes, cs, &k);
    if (rc < 0) goto out;
    pipe_buf *b = &p->buf[k];
    CU(cudaMemcpyAsync(b->dev, buf, bytes, cudaMemcpyDeviceToDevice, cs));
    CU(cudaEventRecord(b->ev, cs));
    CU(cudaStreamWaitEvent(L->sto, b->ev, 0));
    ncclResult_t e = ncclSend(b->dev, bytes, ncclUint8, 1, L->to, L->sto);
    if (e != ncclSuccess) {
        rc = MT_ERR(MT_ENCCL, "ncclSend of pipeline message %lld to rank %d (tag %d, %zu "
                    "bytes): %s", L->sent, peer, tag, bytes, ncclGetErrorString(e));
        goto out;
    }
    CU(cudaEventRecord(b->ev, L->sto));
    b->state = PB_SENDING;
    b->peer = peer;
    b->tag = tag;
    b->bytes = bytes;
    b->seq = L->sent++;
    MT_LOGD("comm nccl %d/%d: pipeline send %lld to rank %d: tag %d, %zu bytes (pool buffer %d "
            "of %d)", c->rank, c->size, b->seq, peer, tag, bytes, k, p->n_buf);
    const pipe_note note = {tag, (int64_t)bytes};
    rc = p->ann->iface->isend(p->ann, &note, sizeof note, MT_COMM_BYTE, peer, PIPE_NOTE_TAG);
    if (rc < 0)
        rc = mt_err_wrap(rc, "comm nccl: announcing pipeline message %lld (tag %d, %zu bytes) to "
                         "rank %d", b->seq, tag, bytes, peer);
out:
    dev_leave(x, saved);
    return rc;
}

static int nccl_recv_tag(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int peer, int tag)
{
    nccl_ctx *x = CTX(c);
    nccl_pipe *p = x->pipe;
    const size_t bytes = count * mt_comm_dtype_size(dt);
    cudaStream_t cs = (cudaStream_t)c->stream;
    pipe_link *L = NULL;
    int saved = 0;
    MT_CHECK(pipe_link_of(c, peer, &L));
    MT_CHECK(dev_enter(x, &saved));
    int rc = MT_OK, k = pool_find(p, peer, tag);
    while (k < 0) {
        pipe_note note = {-1, -1};
        rc = p->ann->iface->recv_tag(p->ann, &note, sizeof note, MT_COMM_BYTE, peer, PIPE_NOTE_TAG);
        if (rc < 0) {
            rc = mt_err_wrap(rc, "comm nccl: waiting for rank %d's next pipeline message (%lld "
                             "received from it so far; this receive wants tag %d)", peer,
                             L->received, tag);
            goto out;
        }
        if (note.tag < 0 || note.tag >= MT_COMM_MAX_TAG || note.bytes <= 0) {
            rc = MT_ERR(MT_EMPI, "comm nccl: rank %d announced pipeline message %lld with tag "
                        "%lld and %lld bytes", peer, L->received, (long long)note.tag,
                        (long long)note.bytes);
            goto out;
        }
        int j = -1;
        MT_GOTO(pool_take(p, (size_t)note.bytes, L->sfrom, &j), out);
        pipe_buf *b = &p->buf[j];
        ncclResult_t e = ncclRecv(b->dev, (size_t)note.bytes, ncclUint8, 0, L->from, L->sfrom);
        if (e != ncclSuccess) {
            rc = MT_ERR(MT_ENCCL, "ncclRecv of pipeline message %lld from rank %d (tag %lld, %lld "
                        "bytes): %s", L->received, peer, (long long)note.tag,
                        (long long)note.bytes, ncclGetErrorString(e));
            goto out;
        }
        CU(cudaEventRecord(b->ev, L->sfrom));
        b->state = PB_ARRIVED;
        b->peer = peer;
        b->tag = (int)note.tag;
        b->bytes = (size_t)note.bytes;
        b->seq = L->received++;
        MT_LOGD("comm nccl %d/%d: pipeline receive %lld from rank %d posted: tag %d, %zu bytes "
                "(pool buffer %d of %d; wanted: tag %d)", c->rank, c->size, b->seq, peer, b->tag,
                b->bytes, j, p->n_buf, tag);
        if (b->tag == tag) k = pool_find(p, peer, tag);
    }
    pipe_buf *b = &p->buf[k];
    if (b->bytes != bytes) {
        rc = MT_ERR(MT_EINVAL, "comm nccl: rank %d sent %zu bytes with tag %d (its message %lld); "
                    "this receive takes %zu", peer, b->bytes, tag, b->seq, bytes);
        goto out;
    }
    CU(cudaStreamWaitEvent(cs, b->ev, 0));
    CU(cudaMemcpyAsync(buf, b->dev, bytes, cudaMemcpyDeviceToDevice, cs));
    CU(cudaEventRecord(b->ev, cs));
    b->state = PB_FREE;
out:
    dev_leave(x, saved);
    return rc;
}

static double pipe_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The host polls each send's event (a 20 us nap between polls, so a wait
 * costs no core), checks the link's NCCL for an asynchronous error, and
 * warns, naming the message, while a send is not taken (60 s, then every
 * doubling). */
static int nccl_wait_sends(mt_comm *c)
{
    nccl_ctx *x = CTX(c);
    nccl_pipe *p = x->pipe;
    if (!p) return MT_OK;
    int saved = 0, rc = MT_OK;
    MT_CHECK(dev_enter(x, &saved));
    const double t0 = pipe_now();
    double warn = 60;
    for (int i = 0; i < p->n_buf && rc == MT_OK; i++) {
        pipe_buf *b = &p->buf[i];
        while (b->state == PB_SENDING) {
            cudaError_t e = cudaEventQuery(b->ev);
            if (e == cudaSuccess) {
                b->state = PB_FREE;
                break;
            }
            if (e != cudaErrorNotReady) {
                rc = MT_ERR(MT_ECUDA, "pipeline message %lld to rank %d (tag %d, %zu bytes): %s",
                            b->seq, b->peer, b->tag, b->bytes, cudaGetErrorString(e));
                break;
            }
            pipe_link *L = NULL;
            for (int l = 0; l < p->n_link; l++)
                if (p->link[l].peer == b->peer) L = &p->link[l];
            ncclResult_t async = ncclSuccess;
            if (L && ncclCommGetAsyncError(L->to, &async) == ncclSuccess && async != ncclSuccess &&
                async != ncclInProgress) {
                rc = MT_ERR(MT_ENCCL, "pipeline message %lld to rank %d (tag %d, %zu bytes): %s",
                            b->seq, b->peer, b->tag, b->bytes, ncclGetErrorString(async));
                break;
            }
            const double t = pipe_now() - t0;
            if (t > warn) {
                MT_LOGW("comm nccl %d/%d: pipeline message %lld to rank %d (tag %d, %zu bytes) "
                        "not taken after %.0f s: rank %d has not asked for it yet", c->rank,
                        c->size, b->seq, b->peer, b->tag, b->bytes, t, b->peer);
                warn *= 2;
            }
            struct timespec nap = {0, 20000};
            nanosleep(&nap, NULL);
        }
    }
    dev_leave(x, saved);
    if (rc < 0) return rc;
    rc = p->ann->iface->wait_sends(p->ann);
    return rc < 0 ? mt_err_wrap(rc, "comm nccl: the pipeline announcements") : MT_OK;
}

/* mt_comm_sync: the receives too (they need no host: each was posted
 * after its send) and the compute stream, where recv_tag copies a message
 * out (a caller fencing on the host, MT_COMM_HOST_SYNC, reads it after
 * the sync); not the sends (wait_sends). */
static int pipe_sync(mt_comm *c)
{
    nccl_pipe *p = CTX(c)->pipe;
    if (p) MT_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)c->stream));
    for (int l = 0; p && l < p->n_link; l++) {
        pipe_link *L = &p->link[l];
        MT_CUDA_CHECK(cudaStreamSynchronize(L->sfrom));
        ncclComm_t both[2] = {L->to, L->from};
        for (int d = 0; d < 2; d++) {
            ncclResult_t async = ncclSuccess;
            ncclResult_t e = both[d] ? ncclCommGetAsyncError(both[d], &async) : ncclSuccess;
            if (e != ncclSuccess)
                return nccl_fail(e, "ncclCommGetAsyncError (pipeline link)", L->peer);
            if (async != ncclSuccess && async != ncclInProgress)
                return nccl_fail(async, d ? "pipeline receives" : "pipeline sends", L->peer);
        }
    }
    return MT_OK;
}

/* The communicator for messages src -> dst (ranks of c; this rank is one
 * of them): src makes the id and sends it to dst on the private
 * communicator (with its success, so dst never waits in the init for a
 * src that gave up), both join; then one byte src -> dst, waited for, so
 * that NCCL connects the pair now. */
static int pipe_comm_init(mt_comm *c, nccl_pipe *p, int src, int dst, ncclComm_t *out,
                          cudaStream_t s, char *byte)
{
    const int sender = c->rank == src;
    struct {
        int32_t ok;
        ncclUniqueId id;
    } msg;
    memset(&msg, 0, sizeof msg);
    char why[160] = "";
    int rc;
    if (sender) {
        ncclResult_t e = ncclGetUniqueId(&msg.id);
        msg.ok = e == ncclSuccess;
        if (!msg.ok) snprintf(why, sizeof why, ": ncclGetUniqueId: %s", ncclGetErrorString(e));
        rc = p->ann->iface->sendrecv(p->ann, &msg, sizeof msg, dst, NULL, 0, MT_COMM_NO_PEER,
                                     MT_COMM_BYTE);
    } else {
        rc = p->ann->iface->sendrecv(p->ann, NULL, 0, MT_COMM_NO_PEER, &msg, sizeof msg, src,
                                     MT_COMM_BYTE);
    }
    if (rc < 0) return mt_err_wrap(rc, "pipeline link %d -> %d: passing the unique id", src, dst);
    if (!msg.ok)
        return MT_ERR(MT_ENCCL, "pipeline link %d -> %d: rank %d could not make a unique id%s", src,
                      dst, src, why);
    ncclResult_t e = ncclCommInitRank(out, 2, msg.id, sender ? 0 : 1);
    if (e != ncclSuccess) {
        *out = NULL;
        return MT_ERR(MT_ENCCL, "pipeline link %d -> %d: ncclCommInitRank(2 ranks, rank %d): %s",
                      src, dst, sender ? 0 : 1, ncclGetErrorString(e));
    }
    e = sender ? ncclSend(byte, 1, ncclUint8, 1, *out, s)
               : ncclRecv(byte, 1, ncclUint8, 0, *out, s);
    if (e != ncclSuccess)
        return MT_ERR(MT_ENCCL, "pipeline link %d -> %d: connecting (%s of one byte): %s", src, dst,
                      sender ? "ncclSend" : "ncclRecv", ncclGetErrorString(e));
    cudaError_t ce = cudaStreamSynchronize(s);
    if (ce != cudaSuccess)
        return MT_ERR(MT_ECUDA, "pipeline link %d -> %d: connecting: %s", src, dst,
                      cudaGetErrorString(ce));
    return MT_OK;
}

static int nccl_pipe_open(mt_comm *c)
{
    nccl_ctx *x = CTX(c);
    const int n = c->size, me = c->rank;
    if (x->pipe) return MT_ERR(MT_ESTATE, "comm nccl: pipe_open after a failed one");
    nccl_pipe *p = calloc(1, sizeof *p);
    if (!p) return MT_ERR(MT_ENOMEM, "comm nccl: out of memory");
    x->pipe = p; /* from here on destroy frees what exists */
    MT_CHECK(mt_comm_mpi_create(&p->ann, mt_comm_mpi_handle(c->host), 0));
    int saved = 0, rc = MT_OK;
    char *byte = NULL;
    MT_CHECK(dev_enter(x, &saved));
    CU(cudaMalloc((void **)&byte, 16));
    /* the ring's edges i = (i, i + 1 mod n), one for two ranks, in order */
    const int n_edge = n == 2 ? 1 : n > 2 ? n : 0;
    for (int i = 0; i < n_edge && rc == MT_OK; i++) {
        const int a = i, b = (i + 1) % n;
        if (me != a && me != b) continue;
        const int lo = a < b ? a : b, hi = a < b ? b : a;
        pipe_link *L = &p->link[p->n_link++];
        L->peer = me == a ? b : a;
        L->lo_first = me == lo;
        CU(cudaStreamCreateWithFlags(&L->sto, cudaStreamNonBlocking));
        CU(cudaStreamCreateWithFlags(&L->sfrom, cudaStreamNonBlocking));
        for (int d = 0; d < 2 && rc == MT_OK; d++) {
            const int src = d == 0 ? lo : hi, dst = d == 0 ? hi : lo;
            const int sender = me == src;
            rc = pipe_comm_init(c, p, src, dst, sender ? &L->to : &L->from,
                                sender ? L->sto : L->sfrom, byte);
        }
    }
out:
    if (byte) cudaFree(byte);
    dev_leave(x, saved);
    if (rc == MT_OK && p->n_link > 0) {
        char who[48];
        if (p->n_link > 1)
            snprintf(who, sizeof who, "ranks %d and %d", p->link[0].peer, p->link[1].peer);
        else
            snprintf(who, sizeof who, "rank %d", p->link[0].peer);
        MT_LOGI("comm nccl %d/%d: pipeline links with %s ready (two 2-rank NCCL communicators "
                "each)", me, n, who);
    }
    return rc;
}

/* Collective (mt_comm_destroy): the links in the order they were made.
 * Sends never taken (a failed step): the links are aborted instead, so
 * that destroy does not wait for a peer that will not come. */
static void pipe_close(mt_comm *c)
{
    nccl_ctx *x = CTX(c);
    nccl_pipe *p = x->pipe;
    if (!p) return;
    int saved = 0, stuck = 0;
    if (dev_enter(x, &saved) < 0) mt_err_clear();
    for (int i = 0; i < p->n_buf; i++)
        if (p->buf[i].state == PB_SENDING && cudaEventQuery(p->buf[i].ev) != cudaSuccess) stuck++;
    if (stuck)
        MT_LOGW("comm nccl %d/%d: destroyed with %d pipeline message(s) not taken; aborting its "
                "pipeline links", c->rank, c->size, stuck);
    for (int l = 0; l < p->n_link; l++) {
        pipe_link *L = &p->link[l];
        if (!stuck && L->sto) cudaStreamSynchronize(L->sto);
        if (!stuck && L->sfrom) cudaStreamSynchronize(L->sfrom);
        ncclComm_t order[2] = {L->lo_first ? L->to : L->from, L->lo_first ? L->from : L->to};
        for (int d = 0; d < 2; d++) {
            if (!order[d]) continue;
            if (stuck) ncclCommAbort(order[d]);
            else ncclCommDestroy(order[d]);
        }
    }
    for (int i = 0; i < p->n_buf; i++) {
        if (p->buf[i].dev) cudaFree(p->buf[i].dev);
        if (p->buf[i].ev) cudaEventDestroy(p->buf[i].ev);
    }
    for (int l = 0; l < p->n_link; l++) {
        if (p->link[l].sto) cudaStreamDestroy(p->link[l].sto);
        if (p->link[l].sfrom) cudaStreamDestroy(p->link[l].sfrom);
    }
    dev_leave(x, saved);
    mt_comm_destroy(p->ann);
    free(p->buf);
    free(p);
    x->pipe = NULL;
}

static const mt_comm_iface NCCL_IFACE = {
    .all_reduce = nccl_all_reduce,
    .reduce_scatter = nccl_reduce_scatter,
    .gather_v = nccl_gather_v,
    .all_to_all_v = nccl_all_to_all_v,
    .broadcast = nccl_broadcast,
    .reduce_owned_start = nccl_reduce_owned_start,
    .gather_owned_start = nccl_gather_owned_start,
    .all_to_all_v_start = nccl_all_to_all_v_start,
    .sendrecv = nccl_sendrecv,
    .isend = nccl_isend,
    .recv_tag = nccl_recv_tag,
    .wait_sends = nccl_wait_sends,
    .pipe_open = nccl_pipe_open,
    .barrier = nccl_barrier,
    .split = nccl_split,
    .destroy = nccl_destroy,
    .join = nccl_join,
    .sync = nccl_sync,
};

int mt_comm_nccl_create(mt_comm **out, mt_comm *host)
{
    *out = NULL;
    /* rank 0 makes the id; its success travels with it so that no rank
     * waits in ncclCommInitRank for one that gave up */
    struct {
        int32_t ok;
        ncclUniqueId id;
    } msg;
    memset(&msg, 0, sizeof msg);
    char why[160] = "";
    if (host->rank == 0) {
        ncclResult_t e = ncclGetUniqueId(&msg.id);
        msg.ok = e == ncclSuccess;
        if (!msg.ok) snprintf(why, sizeof why, "ncclGetUniqueId: %s", ncclGetErrorString(e));
    }
    int rc = host->iface->broadcast(host, &msg, sizeof msg, MT_COMM_BYTE, 0);
    if (rc < 0) {
        mt_comm_destroy(host);
        return mt_err_wrap(rc, "comm nccl: broadcasting the unique id");
    }
    if (!msg.ok) {
        mt_comm_destroy(host);
        return MT_ERR(MT_ENCCL, "comm nccl: rank 0 could not make a unique id%s%s", why[0] ? ": " : "",
                      why);
    }
    mt_comm *c = calloc(1, sizeof *c);
    nccl_ctx *x = calloc(1, sizeof *x);
    rc = c && x ? mt_comm_side_init(&x->side) : MT_ERR(MT_ENOMEM, "comm nccl: out of memory");
    if (rc == MT_OK) {
        ncclResult_t e = ncclCommInitRank(&x->nc, host->size, msg.id, host->rank);
        if (e != ncclSuccess) {
            x->nc = NULL;
            rc = MT_ERR(MT_ENCCL, "comm nccl: ncclCommInitRank(%d ranks, rank %d, device %d): %s",
                        host->size, host->rank, x->side.device, ncclGetErrorString(e));
        }
    }
    if (rc < 0) {
        if (x) mt_comm_side_free(&x->side);
        free(x);
        free(c);
        mt_comm_destroy(host);
        return rc;
    }
    mt_comm_init_fields(c, &NCCL_IFACE, MT_COMM_NCCL, MT_COMM_DEVICE, host->rank, host->size);
    c->host = host;
    c->ctx = x;
    *out = c;
    return MT_OK;
}

int mt_comm_nccl_distinct_gpus(mt_comm *host, int *distinct)
{
    /* (host name, PCI bus id) of every rank's current device */
    typedef struct {
        char host[64];
        char bus[32];
    } where;
    *distinct = 0;
    where me;
    memset(&me, 0, sizeof me);
    if (gethostname(me.host, sizeof me.host - 1) != 0) snprintf(me.host, sizeof me.host, "?");
    int dev = 0;
    MT_CUDA_CHECK(cudaGetDevice(&dev));
    MT_CUDA_CHECK(cudaDeviceGetPCIBusId(me.bus, (int)sizeof me.bus - 1, dev));
    const int n = host->size;
    where *all = calloc((size_t)n, sizeof *all);
    size_t *cd = calloc(2 * (size_t)n, sizeof *cd);
    if (!all || !cd) {
        free(all), free(cd);
        return MT_ERR(MT_ENOMEM, "comm: out of memory");
    }
    for (int r = 0; r < n; r++) {
        cd[r] = sizeof me;
        cd[n + r] = (size_t)r * sizeof me;
    }
    int rc = host->iface->gather_v(host, &me, sizeof me, all, cd, cd + n, MT_COMM_BYTE, -1);
    if (rc == MT_OK) {
        *distinct = 1;
        for (int i = 0; i < n && *distinct; i++)
            for (int j = i + 1; j < n && *distinct; j++)
                if (!strcmp(all[i].host, all[j].host) && !strcmp(all[i].bus, all[j].bus)) *distinct = 0;
    }
    free(all), free(cd);
    return rc;
}
