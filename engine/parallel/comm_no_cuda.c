/* comm_no_cuda.c - the device side of the comm layer in a CPU-only build:
 * no device buffers, and the staged and nccl backends say ENOTSUP. */
#include "base/mt_status.h"
#include "engine/parallel/comm_impl.h"

int mt_comm_cuda_built(void) { return 0; }

int mt_comm_cuda_copy(void *dst, const void *src, size_t bytes, void *stream)
{
    (void)dst, (void)src, (void)bytes, (void)stream;
    return MT_ERR(MT_ENOTSUP, "comm: device copies need a CUDA build");
}

int mt_comm_cuda_stream_sync(void *stream)
{
    (void)stream;
    return MT_ERR(MT_ENOTSUP, "comm: device streams need a CUDA build");
}

int mt_comm_staged_create(mt_comm **out, mt_comm *host)
{
    *out = NULL;
    mt_comm_destroy(host);
    return MT_ERR(MT_ENOTSUP, "comm staged: needs a CUDA build (this one is CPU-only)");
}

int mt_comm_nccl_create(mt_comm **out, mt_comm *host)
{
    *out = NULL;
    mt_comm_destroy(host);
    return MT_ERR(MT_ENOTSUP, "comm nccl: needs a CUDA build (this one is CPU-only)");
}

int mt_comm_nccl_distinct_gpus(mt_comm *host, int *distinct)
{
    (void)host;
    *distinct = 0;
    return MT_ERR(MT_ENOTSUP, "comm: GPU backends need a CUDA build");
}
