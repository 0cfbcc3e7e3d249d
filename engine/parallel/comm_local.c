/* comm_local.c - the backend of a world of one rank: every op is a copy
 * (or nothing, in place). Single-rank runs use it so that the engine calls
 * the same collectives at any size; tests use it as the simplest backend.
 *
 * Host buffers are copied with memmove; device buffers with
 * cudaMemcpyAsync on the compute stream (comm_cuda.c), so an op is ordered
 * like any kernel on that stream and there is nothing to join.
 * A one-element "reduction" is the element itself: rounding a BF16 or E4M3
 * value once through F32 gives it back, so a copy is the comm.h result.
 */
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"
#include "engine/parallel/comm_impl.h"

static int copy(mt_comm *c, void *dst, const void *src, size_t count, mt_comm_dtype dt)
{
    size_t b = count * mt_comm_dtype_size(dt);
    if (b == 0 || dst == src) return MT_OK;
    if (c->mem == MT_COMM_DEVICE) return mt_comm_cuda_copy(dst, src, b, c->stream);
    memmove(dst, src, b);
    return MT_OK;
}

static int local_all_reduce(mt_comm *c, const void *send, void *recv, size_t count,
                            mt_comm_dtype dt, mt_comm_op op)
{
    (void)op;
    return copy(c, recv, send, count, dt);
}

static int local_reduce_scatter(mt_comm *c, const void *send, void *recv, size_t count,
                                mt_comm_dtype dt, mt_comm_op op)
{
    (void)op;
    return copy(c, recv, send, count, dt);
}

static int local_gather_v(mt_comm *c, const void *send, size_t send_count, void *recv,
                          const size_t *counts, const size_t *displs, mt_comm_dtype dt, int root)
{
    (void)counts;
    (void)root;
    return copy(c, (char *)recv + displs[0] * mt_comm_dtype_size(dt), send, send_count, dt);
}

static int local_all_to_all_v(mt_comm *c, const void *send, const size_t *send_counts,
                              const size_t *send_displs, void *recv, const size_t *recv_counts,
                              const size_t *recv_displs, mt_comm_dtype dt)
{
    (void)recv_counts; /* equal to send_counts[0]: comm.c checked */
    size_t es = mt_comm_dtype_size(dt);
    return copy(c, (char *)recv + recv_displs[0] * es, (const char *)send + send_displs[0] * es,
                send_counts[0], dt);
}

static int local_broadcast(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int root)
{
    (void)c, (void)buf, (void)count, (void)dt, (void)root;
    return MT_OK;
}

static int local_sendrecv(mt_comm *c, const void *send, size_t send_count, int dst, void *recv,
                          size_t recv_count, int src, mt_comm_dtype dt)
{
    /* comm.c lets through only src = dst = 0 with equal counts */
    (void)dst, (void)src, (void)recv_count;
    return copy(c, recv, send, send_count, dt);
}

static int local_barrier(mt_comm *c)
{
    (void)c;
    return MT_OK;
}

static int local_split(mt_comm *c, int color, int key, mt_comm **out)
{
    (void)key;
    *out = NULL;
    if (color == MT_COMM_NO_COLOR) return MT_OK;
    return mt_comm_local_create(out, c->mem);
}

static void local_destroy(mt_comm *c) { free(c); }

static int local_sync(mt_comm *c)
{
    return c->mem == MT_COMM_DEVICE ? mt_comm_cuda_stream_sync(c->stream) : MT_OK;
}

static const mt_comm_iface LOCAL_IFACE = {
    .all_reduce = local_all_reduce,
    .reduce_scatter = local_reduce_scatter,
    .gather_v = local_gather_v,
    .all_to_all_v = local_all_to_all_v,
    .broadcast = local_broadcast,
    .sendrecv = local_sendrecv,
    .barrier = local_barrier,
    .split = local_split,
    .destroy = local_destroy,
    .join = NULL, /* ops run on the compute stream itself */
    .sync = local_sync,
};

int mt_comm_local_create(mt_comm **out, mt_comm_mem mem)
{
    *out = NULL;
    if (mem == MT_COMM_DEVICE && !mt_comm_cuda_built())
        return MT_ERR(MT_ENOTSUP, "comm local: device buffers need a CUDA build");
    mt_comm *c = calloc(1, sizeof *c);
    if (!c) return MT_ERR(MT_ENOMEM, "comm local: out of memory");
    mt_comm_init_fields(c, &LOCAL_IFACE, MT_COMM_LOCAL, mem, 0, 1);
    if (mem == MT_COMM_DEVICE) {
        /* control scalars of the same (one-rank) group, in host memory */
        int rc = mt_comm_local_create(&c->host, MT_COMM_HOST);
        if (rc < 0) {
            free(c);
            return rc;
        }
    }
    *out = c;
    return MT_OK;
}
