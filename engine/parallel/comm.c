/* comm.c - the public side of comm.h: names, backend choice, the world
 * communicator, and one wrapper per op that checks the arguments, skips
 * what needs no communication, calls the backend and names the op, its
 * counts and the communicator in any error. No MPI or CUDA here: the
 * backends (comm_local.c, comm_mpi.c, comm_staged.c, comm_nccl.c) hold
 * those calls.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"
#include "engine/parallel/comm_impl.h"

/* ---- names ---------------------------------------------------------------------- */

static const size_t DT_SIZE[MT_COMM_DTYPE_COUNT] = {1, 4, 8, 4, 8, 2, 1};
static const char *const DT_NAME[MT_COMM_DTYPE_COUNT] = {"byte", "i32", "i64", "f32",
                                                          "f64",  "bf16", "e4m3"};
static const char *const OP_NAME[MT_COMM_OP_COUNT] = {"sum", "max", "min"};
static const char *const BACKEND_NAME[MT_COMM_BACKEND_COUNT] = {"auto", "local", "mpi", "staged",
                                                                "nccl"};

size_t mt_comm_dtype_size(mt_comm_dtype dt)
{
    return (unsigned)dt < MT_COMM_DTYPE_COUNT ? DT_SIZE[dt] : 0;
}

const char *mt_comm_dtype_name(mt_comm_dtype dt)
{
    return (unsigned)dt < MT_COMM_DTYPE_COUNT ? DT_NAME[dt] : "?";
}

const char *mt_comm_op_name(mt_comm_op op)
{
    return (unsigned)op < MT_COMM_OP_COUNT ? OP_NAME[op] : "?";
}

const char *mt_comm_backend_name(mt_comm_backend b)
{
    return (unsigned)b < MT_COMM_BACKEND_COUNT ? BACKEND_NAME[b] : "?";
}

int mt_comm_backend_parse(const char *text, mt_comm_backend *out)
{
    for (int b = 0; text && b < MT_COMM_BACKEND_COUNT; b++)
        if (strcmp(text, BACKEND_NAME[b]) == 0) {
            *out = (mt_comm_backend)b;
            return MT_OK;
        }
    return MT_ERR(MT_EINVAL, "comm backend '%s': expected auto, nccl, mpi, staged or local",
                  text ? text : "(null)");
}

/* ---- the world ---------------------------------------------------------------------- */

int mt_comm_world(mt_comm **out, const mt_comm_opts *o)
{
    *out = NULL;
    mt_comm_opts d = {MT_COMM_AUTO, MT_COMM_HOST, 0};
    if (!o) o = &d;
    if (o->mem != MT_COMM_HOST && o->mem != MT_COMM_DEVICE)
        return MT_ERR(MT_EINVAL, "comm: memory kind %d is neither host nor device", (int)o->mem);
    int init = 0, world = mt_comm_mpi_world_size(&init);
    mt_comm_backend b = o->backend;
    const char *mem = o->mem == MT_COMM_HOST ? "host" : "device";
    if (o->mem == MT_COMM_DEVICE && !mt_comm_cuda_built())
        return MT_ERR(MT_ENOTSUP, "comm %s: device buffers need a CUDA build (this one is CPU-only)",
                      mt_comm_backend_name(b));
    if (b == MT_COMM_AUTO) {
        if (world == 1 && (!init || o->mem == MT_COMM_DEVICE)) b = MT_COMM_LOCAL;
        else if (o->mem == MT_COMM_HOST) b = MT_COMM_MPI;
        else b = MT_COMM_NCCL; /* or staged, decided below */
    }
    if ((unsigned)b >= MT_COMM_BACKEND_COUNT)
        return MT_ERR(MT_EINVAL, "comm: backend %d is not one of comm.h's", (int)b);
    if (b == MT_COMM_LOCAL) {
        if (world != 1)
            return MT_ERR(MT_EINVAL, "comm local: a world of 1 only, this job has %d ranks", world);
        return mt_comm_local_create(out, o->mem);
    }
    if (!init)
        return MT_ERR(MT_ESTATE, "comm %s: MPI is not initialised (main calls MPI_Init_thread)",
                      mt_comm_backend_name(b));
    if (b == MT_COMM_MPI && o->mem != MT_COMM_HOST)
        return MT_ERR(MT_EINVAL, "comm mpi: host buffers only (asked for %s; use staged or nccl)", mem);
    if ((b == MT_COMM_STAGED || b == MT_COMM_NCCL) && o->mem != MT_COMM_DEVICE)
        return MT_ERR(MT_EINVAL, "comm %s: device buffers only (asked for %s; use mpi)",
                      mt_comm_backend_name(b), mem);
    mt_comm *host = NULL;
    MT_CHECK(mt_comm_mpi_create(&host, NULL, o->chunk_bytes));
    if (b == MT_COMM_MPI) {
        *out = host;
        return MT_OK;
    }
    if (o->backend == MT_COMM_AUTO) {
        int distinct = 0, rc = mt_comm_nccl_distinct_gpus(host, &distinct);
        if (rc < 0) {
            mt_comm_destroy(host);
            return rc;
        }
        b = distinct ? MT_COMM_NCCL : MT_COMM_STAGED;
    }
    return b == MT_COMM_NCCL ? mt_comm_nccl_create(out, host) : mt_comm_staged_create(out, host);
}

/* ---- properties ---------------------------------------------------------------------- */

int mt_comm_rank(const mt_comm *c) { return c->rank; }
int mt_comm_size(const mt_comm *c) { return c->size; }
mt_comm_mem mt_comm_mem_kind(const mt_comm *c) { return c->mem; }
mt_comm_backend mt_comm_backend_of(const mt_comm *c) { return c->backend; }
int mt_comm_rank_ordered(const mt_comm *c) { return c->rank_ordered; }
mt_comm *mt_comm_host(mt_comm *c) { return c->host; }

void mt_comm_destroy(mt_comm *c)
{
    if (!c) return;
    mt_comm *host = c->host;
    c->iface->destroy(c);
    if (host && host != c) mt_comm_destroy(host);
}

/* ---- argument checks and error context ---------------------------------------------- */

#define CTX_FMT "comm %s %d/%d "
#define CTX_ARGS(c) mt_comm_backend_name((c)->backend), (c)->rank, (c)->size

static int check_dt(const mt_comm *c, const char *what, mt_comm_dtype dt)
{
    if ((unsigned)dt >= MT_COMM_DTYPE_COUNT)
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: dtype %d is not one of comm.h's", CTX_ARGS(c), what,
                      (int)dt);
    return MT_OK;
}

static int check_reduce(const mt_comm *c, const char *what, mt_comm_dtype dt, mt_comm_op op)
{
    MT_CHECK(check_dt(c, what, dt));
    if ((unsigned)op >= MT_COMM_OP_COUNT)
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: op %d is not sum, max or min", CTX_ARGS(c), what,
                      (int)op);
    if (dt == MT_COMM_BYTE)
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: byte buffers are moved, not reduced (%s)",
                      CTX_ARGS(c), what, mt_comm_op_name(op));
    return MT_OK;
}

static int check_rank(const mt_comm *c, const char *what, const char *role, int r)
{
    if (r < 0 || r >= c->size)
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: %s %d outside the group's ranks 0..%d", CTX_ARGS(c),
                      what, role, r, c->size - 1);
    return MT_OK;
}

static int check_buf(const mt_comm *c, const char *what, const char *name, const void *p, size_t n)
{
    if (!p && n > 0)
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: %s is NULL for %zu elements", CTX_ARGS(c), what, name,
                      n);
    return MT_OK;
}

/* [a, a + na) and [b, b + nb) in bytes share a byte. */
static int overlaps(const void *a, size_t na, const void *b, size_t nb)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return na > 0 && nb > 0 && x < y + nb && y < x + na;
}

/* After a backend call: name the op, and join the compute stream unless the
 * caller overlaps. */
static int finish(mt_comm *c, int rc, const char *what)
{
    if (rc < 0) return mt_err_wrap(rc, CTX_FMT "%s", CTX_ARGS(c), what);
    if (c->iface->join && !c->overlap) {
        rc = c->iface->join(c);
        if (rc < 0) return mt_err_wrap(rc, CTX_FMT "%s: joining the compute stream", CTX_ARGS(c), what);
    }
    return MT_OK;
}

/* ---- collectives ---------------------------------------------------------------------- */

int mt_comm_all_reduce(mt_comm *c, const void *send, void *recv, size_t count, mt_comm_dtype dt,
                       mt_comm_op op)
{
    char what[96];
    snprintf(what, sizeof what, "all_reduce(%s %s, count %zu)", mt_comm_dtype_name(dt),
             mt_comm_op_name(op), count);
    MT_CHECK(check_reduce(c, what, dt, op));
    MT_CHECK(check_buf(c, what, "send", send, count));
    MT_CHECK(check_buf(c, what, "recv", recv, count));
    size_t b = count * DT_SIZE[dt];
    if (send != recv && overlaps(send, b, recv, b))
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: send and recv overlap but are not equal (in place)",
                      CTX_ARGS(c), what);
    if (count == 0) return MT_OK;
    return finish(c, c->iface->all_reduce(c, send, recv, count, dt, op), what);
}

int mt_comm_reduce_scatter(mt_comm *c, const void *send, void *recv, size_t count,
                           mt_comm_dtype dt, mt_comm_op op)
{
    char what[112];
    snprintf(what, sizeof what, "reduce_scatter(%s %s, %zu per rank of %d)", mt_comm_dtype_name(dt),
             mt_comm_op_name(op), count, c->size);
    MT_CHECK(check_reduce(c, what, dt, op));
    MT_CHECK(check_buf(c, what, "send", send, count));
    MT_CHECK(check_buf(c, what, "recv", recv, count));
    size_t es = DT_SIZE[dt], b = count * es;
    const char *own = (const char *)send + (size_t)c->rank * b;
    if ((const char *)recv != own && overlaps(send, b * (size_t)c->size, recv, b))
        return MT_ERR(MT_EINVAL,
                      CTX_FMT "%s: recv overlaps send but is not its block of this rank (in place)",
                      CTX_ARGS(c), what);
    if (count == 0) return MT_OK;
    return finish(c, c->iface->reduce_scatter(c, send, recv, count, dt, op), what);
}

/* Through gather_v with equal blocks (counts and displs on the stack for
 * groups up to 64, on the heap above). */
int mt_comm_all_gather(mt_comm *c, const void *send, void *recv, size_t count, mt_comm_dtype dt)
{
    char what[96];
    snprintf(what, sizeof what, "all_gather(%s, %zu per rank of %d)", mt_comm_dtype_name(dt), count,
             c->size);
    MT_CHECK(check_dt(c, what, dt));
    MT_CHECK(check_buf(c, what, "send", send, count));
    MT_CHECK(check_buf(c, what, "recv", recv, count));
    size_t es = DT_SIZE[dt], b = count * es;
    const char *own = (const char *)recv + (size_t)c->rank * b;
    if ((const char *)send != own && overlaps(send, b, recv, b * (size_t)c->size))
        return MT_ERR(MT_EINVAL,
                      CTX_FMT "%s: send overlaps recv but is not this rank's block (in place)",
                      CTX_ARGS(c), what);
    if (count == 0) return MT_OK;
    size_t stack[2 * 64], *cd = stack;
    if (c->size > 64) {
        cd = malloc(2 * (size_t)c->size * sizeof *cd);
        if (!cd) return MT_ERR(MT_ENOMEM, CTX_FMT "%s: out of memory", CTX_ARGS(c), what);
    }
    for (int r = 0; r < c->size; r++) {
        cd[r] = count;
        cd[c->size + r] = (size_t)r * count;
    }
    int rc = c->iface->gather_v(c, send, count, recv, cd, cd + c->size, dt, -1);
    if (cd != stack) free(cd);
    return finish(c, rc, what);
}

static int gather_v_common(mt_comm *c, const char *what, const void *send, size_t send_count,
                           void *recv, const size_t *counts, const size_t *displs,
                           mt_comm_dtype dt, int root)
{
    MT_CHECK(check_dt(c, what, dt));
    MT_CHECK(check_buf(c, what, "send", send, send_count));
    if (root >= 0) MT_CHECK(check_rank(c, what, "root", root));
    if (root < 0 || c->rank == root) {
        if (!counts || !displs)
            return MT_ERR(MT_EINVAL, CTX_FMT "%s: counts and displs are needed", CTX_ARGS(c), what);
        if (counts[c->rank] != send_count)
            return MT_ERR(MT_EINVAL, CTX_FMT "%s: send_count %zu but counts[%d] = %zu", CTX_ARGS(c),
                          what, send_count, c->rank, counts[c->rank]);
        size_t total = 0;
        for (int r = 0; r < c->size; r++) total += counts[r];
        MT_CHECK(check_buf(c, what, "recv", recv, total));
    }
    return finish(c, c->iface->gather_v(c, send, send_count, recv, counts, displs, dt, root), what);
}

int mt_comm_all_gather_v(mt_comm *c, const void *send, size_t send_count, void *recv,
                         const size_t *counts, const size_t *displs, mt_comm_dtype dt)
{
    char what[96];
    snprintf(what, sizeof what, "all_gather_v(%s, %zu from rank %d)", mt_comm_dtype_name(dt),
             send_count, c->rank);
    return gather_v_common(c, what, send, send_count, recv, counts, displs, dt, -1);
}

int mt_comm_gather_v(mt_comm *c, const void *send, size_t send_count, void *recv,
                     const size_t *counts, const size_t *displs, mt_comm_dtype dt, int root)
{
    char what[96];
    snprintf(what, sizeof what, "gather_v(%s, %zu from rank %d to root %d)", mt_comm_dtype_name(dt),
             send_count, c->rank, root);
    if (root < 0) return MT_ERR(MT_EINVAL, CTX_FMT "%s: root must be a rank", CTX_ARGS(c), what);
    return gather_v_common(c, what, send, send_count, recv, counts, displs, dt, root);
}

/* The checks of all_to_all_v (and its started form); names the op in what. */
static int a2a_check(mt_comm *c, char *what, size_t what_cap, const char *op, const void *send,
                     const size_t *send_counts, const size_t *send_displs, const void *recv,
                     const size_t *recv_counts, const size_t *recv_displs, mt_comm_dtype dt)
{
    size_t ns = 0, nr = 0;
    if (send_counts && recv_counts)
        for (int p = 0; p < c->size; p++) {
            ns += send_counts[p];
            nr += recv_counts[p];
        }
    snprintf(what, what_cap, "%s(%s, %zu elements sent, %zu received)", op,
             mt_comm_dtype_name(dt), ns, nr);
    MT_CHECK(check_dt(c, what, dt));
    if (!send_counts || !send_displs || !recv_counts || !recv_displs)
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: counts and displs are needed on every rank",
                      CTX_ARGS(c), what);
    MT_CHECK(check_buf(c, what, "send", send, ns));
    MT_CHECK(check_buf(c, what, "recv", recv, nr));
    if (send_counts[c->rank] != recv_counts[c->rank])
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: to itself %zu sent but %zu received", CTX_ARGS(c), what,
                      send_counts[c->rank], recv_counts[c->rank]);
    return MT_OK;
}

int mt_comm_all_to_all_v(mt_comm *c, const void *send, const size_t *send_counts,
                         const size_t *send_displs, void *recv, const size_t *recv_counts,
                         const size_t *recv_displs, mt_comm_dtype dt)
{
    char what[128];
    MT_CHECK(a2a_check(c, what, sizeof what, "all_to_all_v", send, send_counts, send_displs, recv,
                       recv_counts, recv_displs, dt));
    return finish(c,
                  c->iface->all_to_all_v(c, send, send_counts, send_displs, recv, recv_counts,
                                         recv_displs, dt),
                  what);
}

int mt_comm_all_to_all_v_start(mt_comm *c, const void *send, const size_t *send_counts,
                               const size_t *send_displs, void *recv, const size_t *recv_counts,
                               const size_t *recv_displs, mt_comm_dtype dt, mt_comm_req **req)
{
    *req = NULL;
    char what[80]; /* a request's what[] */
    MT_CHECK(a2a_check(c, what, sizeof what, "all_to_all_v_start", send, send_counts, send_displs,
                       recv, recv_counts, recv_displs, dt));
    if (!c->iface->all_to_all_v_start) /* done at once (local) */
        return finish(c,
                      c->iface->all_to_all_v(c, send, send_counts, send_displs, recv, recv_counts,
                                             recv_displs, dt),
                      what);
    int rc = c->iface->all_to_all_v_start(c, send, send_counts, send_displs, recv, recv_counts,
                                          recv_displs, dt, req);
    if (rc < 0) {
        *req = NULL;
        return mt_err_wrap(rc, CTX_FMT "%s", CTX_ARGS(c), what);
    }
    (*req)->c = c;
    snprintf((*req)->what, sizeof (*req)->what, "%s", what);
    return MT_OK;
}

int mt_comm_broadcast(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int root)
{
    char what[96];
    snprintf(what, sizeof what, "broadcast(%s, count %zu, root %d)", mt_comm_dtype_name(dt), count,
             root);
    MT_CHECK(check_dt(c, what, dt));
    MT_CHECK(check_rank(c, what, "root", root));
    MT_CHECK(check_buf(c, what, "buf", buf, count));
    if (count == 0) return MT_OK;
    return finish(c, c->iface->broadcast(c, buf, count, dt, root), what);
}

static int p2p(mt_comm *c, const char *what, const void *send, size_t send_count, int dst,
               void *recv, size_t recv_count, int src, mt_comm_dtype dt)
{
    MT_CHECK(check_dt(c, what, dt));
    if (dst != MT_COMM_NO_PEER) MT_CHECK(check_rank(c, what, "destination", dst));
    if (src != MT_COMM_NO_PEER) MT_CHECK(check_rank(c, what, "source", src));
    if ((dst == c->rank) != (src == c->rank))
        return MT_ERR(MT_EINVAL,
                      CTX_FMT "%s: a message to the own rank needs sendrecv with src = dst = %d",
                      CTX_ARGS(c), what, c->rank);
    if (dst == c->rank && send_count != recv_count)
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: to itself %zu sent but %zu received", CTX_ARGS(c), what,
                      send_count, recv_count);
    if (dst == MT_COMM_NO_PEER) send_count = 0;
    if (src == MT_COMM_NO_PEER) recv_count = 0;
    MT_CHECK(check_buf(c, what, "send", send, send_count));
    MT_CHECK(check_buf(c, what, "recv", recv, recv_count));
    if (send_count == 0 && recv_count == 0) return MT_OK;
    return finish(c, c->iface->sendrecv(c, send, send_count, dst, recv, recv_count, src, dt), what);
}

int mt_comm_send(mt_comm *c, const void *buf, size_t count, mt_comm_dtype dt, int peer)
{
    char what[80];
    snprintf(what, sizeof what, "send(%s, count %zu, to rank %d)", mt_comm_dtype_name(dt), count,
             peer);
    if (peer == MT_COMM_NO_PEER) return MT_ERR(MT_EINVAL, CTX_FMT "%s: no peer", CTX_ARGS(c), what);
    return p2p(c, what, buf, count, peer, NULL, 0, MT_COMM_NO_PEER, dt);
}

int mt_comm_recv(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int peer)
{
    char what[80];
    snprintf(what, sizeof what, "recv(%s, count %zu, from rank %d)", mt_comm_dtype_name(dt), count,
             peer);
    if (peer == MT_COMM_NO_PEER) return MT_ERR(MT_EINVAL, CTX_FMT "%s: no peer", CTX_ARGS(c), what);
    return p2p(c, what, NULL, 0, MT_COMM_NO_PEER, buf, count, peer, dt);
}

int mt_comm_sendrecv(mt_comm *c, const void *send, size_t send_count, int dst, void *recv,
                     size_t recv_count, int src, mt_comm_dtype dt)
{
    char what[128];
    snprintf(what, sizeof what, "sendrecv(%s, %zu to rank %d, %zu from rank %d)",
             mt_comm_dtype_name(dt), send_count, dst, recv_count, src);
    return p2p(c, what, send, send_count, dst, recv, recv_count, src, dt);
}

static int p2p_tag(mt_comm *c, const char *what, const void *buf, size_t count,
                   mt_comm_dtype dt, int peer, int tag, int have)
{
    MT_CHECK(check_dt(c, what, dt));
    MT_CHECK(check_rank(c, what, "peer", peer));
    if (peer == c->rank)
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: a pipeline message to the own rank", CTX_ARGS(c),
                      what);
    if (tag < 0 || tag >= MT_COMM_MAX_TAG)
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: tag %d outside [0, %d)", CTX_ARGS(c), what, tag,
                      MT_COMM_MAX_TAG);
    if (!have)
        return MT_ERR(MT_ENOTSUP, CTX_FMT "%s: the %s backend has no pipeline messages",
                      CTX_ARGS(c), what, mt_comm_backend_name(c->backend));
    if (!c->pipe_open)
        return MT_ERR(MT_ESTATE, CTX_FMT "%s: pipeline messages need mt_comm_pipe_open first "
                      "(collective over the group)", CTX_ARGS(c), what);
    return check_buf(c, what, "buffer", buf, count);
}

int mt_comm_pipe_open(mt_comm *c)
{
    if (c->pipe_open) return MT_OK;
    int rc = c->iface->pipe_open ? c->iface->pipe_open(c) : MT_OK;
    if (rc < 0) return mt_err_wrap(rc, CTX_FMT "pipe_open", CTX_ARGS(c));
    c->pipe_open = 1;
    return MT_OK;
}

int mt_comm_isend(mt_comm *c, const void *buf, size_t count, mt_comm_dtype dt, int peer, int tag)
{
    char what[96];
    snprintf(what, sizeof what, "isend(%s, count %zu, to rank %d, tag %d)",
             mt_comm_dtype_name(dt), count, peer, tag);
    MT_CHECK(p2p_tag(c, what, buf, count, dt, peer, tag, c->iface->isend != NULL));
    if (count == 0) return MT_OK;
    return finish(c, c->iface->isend(c, buf, count, dt, peer, tag), what);
}

int mt_comm_recv_tag(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int peer, int tag)
{
    char what[96];
    snprintf(what, sizeof what, "recv(%s, count %zu, from rank %d, tag %d)",
             mt_comm_dtype_name(dt), count, peer, tag);
    MT_CHECK(p2p_tag(c, what, buf, count, dt, peer, tag, c->iface->recv_tag != NULL));
    if (count == 0) return MT_OK;
    return finish(c, c->iface->recv_tag(c, buf, count, dt, peer, tag), what);
}

int mt_comm_wait_sends(mt_comm *c)
{
    if (!c->iface->wait_sends) return MT_OK;
    int rc = c->iface->wait_sends(c);
    if (rc < 0) return mt_err_wrap(rc, CTX_FMT "wait_sends", CTX_ARGS(c));
    return MT_OK;
}

int mt_comm_barrier(mt_comm *c)
{
    int rc = c->iface->barrier(c);
    if (rc < 0) return mt_err_wrap(rc, CTX_FMT "barrier", CTX_ARGS(c));
    return MT_OK;
}

int mt_comm_split(mt_comm *c, int color, int key, mt_comm **out)
{
    *out = NULL;
    if (color < 0 && color != MT_COMM_NO_COLOR)
        return MT_ERR(MT_EINVAL, CTX_FMT "split: color %d (>= 0, or MT_COMM_NO_COLOR)", CTX_ARGS(c),
                      color);
    int rc = c->iface->split(c, color, key, out);
    if (rc < 0) return mt_err_wrap(rc, CTX_FMT "split(color %d, key %d)", CTX_ARGS(c), color, key);
    return MT_OK;
}

int mt_comm_agree(mt_comm *c, int ok)
{
    int32_t mine = ok ? 1 : 0, all = 0;
    int rc = mt_comm_all_reduce(c->host, &mine, &all, 1, MT_COMM_I32, MT_COMM_MIN);
    if (rc < 0) return mt_err_wrap(rc, "agreeing whether every rank succeeded");
    return all == 1;
}

/* ---- device stream ordering ------------------------------------------------------------ */

int mt_comm_set_stream(mt_comm *c, void *stream)
{
    if (c->mem != MT_COMM_DEVICE) return MT_OK;
    /* ops issued on the old stream stay ordered for whoever joins it */
    if (c->iface->join && c->overlap) MT_CHECK(c->iface->join(c));
    c->stream = stream;
    return MT_OK;
}

void *mt_comm_stream(const mt_comm *c) { return c->mem == MT_COMM_DEVICE ? c->stream : NULL; }

int mt_comm_host_sync_forced(void)
{
    /* -1 unread; a race between two first calls reads the same value */
    static _Atomic int forced = -1;
    int v = atomic_load(&forced);
    if (v < 0) {
        const char *e = getenv("MT_COMM_HOST_SYNC");
        v = e && strcmp(e, "1") == 0;
        atomic_store(&forced, v);
    }
    return v;
}

int mt_comm_set_overlap(mt_comm *c, int on)
{
    c->overlap = c->mem == MT_COMM_DEVICE && on;
    return MT_OK;
}

int mt_comm_join(mt_comm *c)
{
    if (!c->iface->join) return MT_OK;
    int rc = c->iface->join(c);
    if (rc < 0) return mt_err_wrap(rc, CTX_FMT "join", CTX_ARGS(c));
    return MT_OK;
}

int mt_comm_sync(mt_comm *c)
{
    if (!c->iface->sync) return MT_OK;
    int rc = c->iface->sync(c);
    if (rc < 0) return mt_err_wrap(rc, CTX_FMT "sync", CTX_ARGS(c));
    return MT_OK;
}

/* ---- nonblocking owner collectives ----------------------------------------------------- */

int mt_comm_owned_plan_make(mt_comm_owned_plan *p, const mt_comm_seg *segs, int n, int size)
{
    memset(p, 0, sizeof *p);
    p->n = n;
    p->size = size;
    p->total = calloc((size_t)size, sizeof *p->total);
    p->pos = calloc((size_t)(n > 0 ? n : 1), sizeof *p->pos);
    if (!p->total || !p->pos) {
        mt_comm_owned_plan_free(p);
        return MT_ERR(MT_ENOMEM, "out of memory for a plan of %d segments", n);
    }
    for (int k = 0; k < n; k++) {
        p->pos[k] = p->total[segs[k].owner];
        p->total[segs[k].owner] += segs[k].count;
    }
    return MT_OK;
}

void mt_comm_owned_plan_free(mt_comm_owned_plan *p)
{
    free(p->total);
    free(p->pos);
    p->total = p->pos = NULL;
}

static int check_segs(const mt_comm *c, const char *what, const mt_comm_seg *segs, int n)
{
    if (n < 0 || (n > 0 && !segs))
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: %d segments at %p", CTX_ARGS(c), what, n,
                      (const void *)segs);
    for (int k = 0; k < n; k++) {
        MT_CHECK(check_rank(c, what, "owner", segs[k].owner));
        MT_CHECK(check_buf(c, what, "segment buf", segs[k].buf, segs[k].count));
    }
    return MT_OK;
}

static int start_owned(mt_comm *c, const mt_comm_seg *segs, int n, int reduce, mt_comm_dtype wire,
                       mt_comm_req **req)
{
    *req = NULL;
    char what[80];
    size_t total = 0;
    for (int k = 0; k < n && segs; k++) total += segs[k].count;
    snprintf(what, sizeof what, "%s_owned(%s, %d segments, %zu elements)",
             reduce ? "reduce" : "gather", mt_comm_dtype_name(wire), n, total);
    if (reduce && wire != MT_COMM_F32 && wire != MT_COMM_BF16)
        return MT_ERR(MT_EINVAL, CTX_FMT "%s: the wire type must be f32 or bf16", CTX_ARGS(c),
                      what);
    MT_CHECK(check_segs(c, what, segs, n));
    if (c->size == 1 || total == 0) return MT_OK; /* nothing moves, nothing is rounded */
    const mt_comm_iface *f = c->iface;
    int rc = reduce ? f->reduce_owned_start(c, segs, n, wire, req)
                    : f->gather_owned_start(c, segs, n, req);
    if (rc < 0) {
        *req = NULL;
        return mt_err_wrap(rc, CTX_FMT "%s", CTX_ARGS(c), what);
    }
    (*req)->c = c;
    snprintf((*req)->what, sizeof (*req)->what, "%s", what);
    return MT_OK;
}

int mt_comm_reduce_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_dtype wire,
                               mt_comm_req **req)
{
    return start_owned(c, segs, n, 1, wire, req);
}

int mt_comm_gather_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_req **req)
{
    return start_owned(c, segs, n, 0, MT_COMM_BYTE, req);
}

int mt_comm_test(mt_comm_req *r, int *done)
{
    *done = 1;
    if (!r) return MT_OK;
    int rc = r->test(r, done);
    if (rc < 0) return mt_err_wrap(rc, CTX_FMT "%s: test", CTX_ARGS(r->c), r->what);
    return MT_OK;
}

int mt_comm_wait(mt_comm_req *r)
{
    if (!r) return MT_OK;
    mt_comm *c = r->c;
    char what[80];
    snprintf(what, sizeof what, "%s", r->what);
    int rc = r->wait(r);
    r->free(r);
    if (rc < 0) return mt_err_wrap(rc, CTX_FMT "%s: wait", CTX_ARGS(c), what);
    return finish(c, MT_OK, what);
}
