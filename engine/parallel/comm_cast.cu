/* comm_cast.cu - f32 <-> bf16 / e4m3 casts for the nccl backend's
 * rounded-once sums (comm_cuda.h). The conversions are those of the CUDA
 * kernels (kernels/cuda/cuda_impl.h), bit-identical to kernels/mt_fp8.h:
 * __float2bfloat16_rn, and __nv_cvt_float_to_fp8 with __NV_SATFINITE. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "base/mt_status.h"

__global__ void comm_widen(float *dst, const void *src, int bf16, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        if (bf16) {
            dst[i] = __bfloat162float(((const __nv_bfloat16 *)src)[i]);
        } else {
            __half_raw h = __nv_cvt_fp8_to_halfraw(((const __nv_fp8_storage_t *)src)[i], __NV_E4M3);
            dst[i] = __half2float(__half(h));
        }
    }
}

__global__ void comm_narrow(void *dst, int bf16, const float *src, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        if (bf16) ((__nv_bfloat16 *)dst)[i] = __float2bfloat16_rn(src[i]);
        else ((uint8_t *)dst)[i] = (uint8_t)__nv_cvt_float_to_fp8(src[i], __NV_SATFINITE, __NV_E4M3);
    }
}

static unsigned grid_for(size_t n)
{
    size_t b = (n + 255) / 256;
    return (unsigned)(b < 4096 ? (b ? b : 1) : 4096);
}

extern "C" int mt_comm_cuda_widen(float *dst, const void *src, int bf16, size_t n,
                                  cudaStream_t stream)
{
    if (n == 0) return MT_OK;
    comm_widen<<<grid_for(n), 256, 0, stream>>>(dst, src, bf16, n);
    MT_CUDA_CHECK(cudaGetLastError());
    return MT_OK;
}

extern "C" int mt_comm_cuda_narrow(void *dst, int bf16, const float *src, size_t n,
                                   cudaStream_t stream)
{
    if (n == 0) return MT_OK;
    comm_narrow<<<grid_for(n), 256, 0, stream>>>(dst, bf16, src, n);
    MT_CUDA_CHECK(cudaGetLastError());
    return MT_OK;
}

/* dst[i] = rows[0][i] + rows[1][i] + ... in f32, in row order (the
 * rank-ordered sum of comm.h); rows are bf16 or f32, `stride` elements
 * apart. */
__global__ void comm_sum_rows(float *dst, const void *rows, int bf16, int nrows, size_t stride,
                              size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float a = 0.0f;
        for (int r = 0; r < nrows; r++) {
            const size_t j = (size_t)r * stride + i;
            float x = bf16 ? __bfloat162float(((const __nv_bfloat16 *)rows)[j]) : ((const float *)rows)[j];
            a = r == 0 ? x : __fadd_rn(a, x);
        }
        dst[i] = a;
    }
}

extern "C" int mt_comm_cuda_sum_rows(float *dst, const void *rows, int bf16, int nrows,
                                     size_t stride, size_t n, cudaStream_t stream)
{
    if (n == 0) return MT_OK;
    comm_sum_rows<<<grid_for(n), 256, 0, stream>>>(dst, rows, bf16, nrows, stride, n);
    MT_CUDA_CHECK(cudaGetLastError());
    return MT_OK;
}
