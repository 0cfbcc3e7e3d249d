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
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/mt_status.h"
#include "engine/parallel/comm_cuda.h"
#include "engine/parallel/comm_impl.h"

typedef struct nccl_ctx {
    mt_comm_side side;
    ncclComm_t nc;
    float *scratch; /* device, for bf16 / e4m3 reductions */
    size_t cap;     /* elements */
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

static void nccl_destroy(mt_comm *c)
{
    nccl_ctx *x = CTX(c);
    if (x->side.stream) cudaStreamSynchronize(x->side.stream);
    if (x->nc) ncclCommDestroy(x->nc);
    if (x->scratch) cudaFree(x->scratch);
    mt_comm_side_free(&x->side);
    free(x);
    free(c);
}

static int nccl_join(mt_comm *c) { return mt_comm_side_join(&CTX(c)->side, c->stream); }

static int nccl_sync(mt_comm *c)
{
    MT_CHECK(mt_comm_side_sync(&CTX(c)->side));
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
    nccl_req *q = calloc(1, sizeof *q);
    int rc = MT_OK;
    if (!piece || !q) rc = MT_ERR(MT_ENOMEM, "comm nccl: owner op: out of memory");
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
    if (rc != MT_OK) {
        free(q);
        return rc;
    }
    q->h.test = nccl_req_test;
    q->h.wait = nccl_req_wait;
    q->h.free = nccl_req_free;
    q->dev = c;
    *out = &q->h;
    return MT_OK;
}

/* all_to_all_v started: enqueued on the side stream as the blocking form
 * is; the compute stream waits for it at mt_comm_wait (comm.c's join), so
 * the kernels enqueued meanwhile run beside it. */
static int nccl_all_to_all_v_start(mt_comm *c, const void *send, const size_t *send_counts,
                                   const size_t *send_displs, void *recv,
                                   const size_t *recv_counts, const size_t *recv_displs,
                                   mt_comm_dtype dt, mt_comm_req **out)
{
    nccl_req *q = calloc(1, sizeof *q);
    if (!q) return MT_ERR(MT_ENOMEM, "comm nccl: out of memory");
    int rc = nccl_all_to_all_v(c, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                               dt);
    if (rc != MT_OK) {
        free(q);
        return rc;
    }
    q->h.test = nccl_req_test;
    q->h.wait = nccl_req_wait;
    q->h.free = nccl_req_free;
    q->dev = c;
    *out = &q->h;
    return MT_OK;
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
