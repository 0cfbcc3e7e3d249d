/* comm_cuda.c - device copies for the local backend and the side stream
 * of the staged and nccl backends (comm_cuda.h). */
#include <cuda_runtime.h>

#include "base/mt_status.h"
#include "engine/parallel/comm_cuda.h"

int mt_comm_cuda_built(void) { return 1; }

int mt_comm_cuda_copy(void *dst, const void *src, size_t bytes, void *stream)
{
    if (bytes == 0 || dst == src) return MT_OK;
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)stream));
    return MT_OK;
}

int mt_comm_cuda_stream_sync(void *stream)
{
    MT_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)stream));
    return MT_OK;
}

int mt_comm_side_init(mt_comm_side *s)
{
    s->stream = NULL;
    s->ready = s->done = NULL;
    MT_CUDA_CHECK(cudaGetDevice(&s->device));
    s->saved_device = s->device;
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&s->ready, cudaEventDisableTiming));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming));
    /* nothing issued yet: joining before the first op waits for nothing */
    MT_CUDA_CHECK(cudaEventRecord(s->done, s->stream));
    return MT_OK;
}

void mt_comm_side_free(mt_comm_side *s)
{
    if (s->stream) cudaStreamSynchronize(s->stream);
    if (s->ready) cudaEventDestroy(s->ready);
    if (s->done) cudaEventDestroy(s->done);
    if (s->stream) cudaStreamDestroy(s->stream);
    s->stream = NULL;
    s->ready = s->done = NULL;
}

int mt_comm_side_begin(mt_comm_side *s, void *compute)
{
    MT_CUDA_CHECK(cudaGetDevice(&s->saved_device));
    if (s->saved_device != s->device) MT_CUDA_CHECK(cudaSetDevice(s->device));
    MT_CUDA_CHECK(cudaEventRecord(s->ready, (cudaStream_t)compute));
    MT_CUDA_CHECK(cudaStreamWaitEvent(s->stream, s->ready, 0));
    return MT_OK;
}

int mt_comm_side_end(mt_comm_side *s, int rc)
{
    if (rc == MT_OK) {
        cudaError_t e = cudaEventRecord(s->done, s->stream);
        if (e != cudaSuccess)
            rc = MT_ERR(MT_ECUDA, "cudaEventRecord(done, side stream): %s", cudaGetErrorString(e));
    }
    if (s->saved_device != s->device) cudaSetDevice(s->saved_device);
    return rc;
}

int mt_comm_side_join(mt_comm_side *s, void *compute)
{
    MT_CUDA_CHECK(cudaStreamWaitEvent((cudaStream_t)compute, s->done, 0));
    return MT_OK;
}

int mt_comm_side_sync(mt_comm_side *s)
{
    MT_CUDA_CHECK(cudaStreamSynchronize(s->stream));
    return MT_OK;
}
