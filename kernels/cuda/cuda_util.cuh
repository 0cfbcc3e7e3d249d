/* cuda_util.cuh - small device helpers shared by the element-wise, norm,
 * MoE and loss kernels (cuda_fp8.cu, cuda_norm.cu, cuda_moe.cu,
 * cuda_loss.cu, cuda_fp8_grouped.cu): fixed-tree warp and block
 * reductions, 16-byte bf16 vector conversions, a correctly-rounded-in-
 * practice expf, scratch carving, and the expert segments' table.
 *
 * Determinism: every reduction here is a fixed butterfly / tree over lanes
 * and warps for a given blockDim, so a result depends only on the launch
 * shape, which the launchers derive from the problem shape alone.
 */
#ifndef MT_CUDA_UTIL_CUH
#define MT_CUDA_UTIL_CUH

#include "kernels/cuda/cuda_impl.h"

#define CU_WARP 32
#define CU_FULL 0xffffffffu

/* 8 bf16 of a 16-byte vector to floats (exact), element 2i in the low half
 * of word i; and back, rounded to nearest even (__floats2bfloat162_rn). */
__device__ __forceinline__ void cu_bf16x8_unpack(const uint4 &w, float *x)
{
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[2 * i] = __uint_as_float(u[i] << 16);
        x[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint4 cu_bf16x8_pack(const float *x)
{
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
        o[i] = *(const uint32_t *)&b;
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

__device__ __forceinline__ float cu_warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(CU_FULL, v, o));
    return v;
}

__device__ __forceinline__ double cu_warp_sum(double v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(CU_FULL, v, o);
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024) in a fixed
 * tree; every thread gets the result. sh: __shared__ double[32]. Contains
 * __syncthreads: call from all threads. */
__device__ __forceinline__ double cu_block_sum(double v, double *sh)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = cu_warp_sum(v);
    __syncthreads(); /* sh may still be read by a previous call */
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    double t = lane < nw ? sh[lane] : 0.0;
    return cu_warp_sum(t);
}

/* Max over the block (NaNs ignored as fmaxf does); sh: __shared__ float[32]. */
__device__ __forceinline__ float cu_block_max(float v, float *sh)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = cu_warp_max(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    float t = lane < nw ? sh[lane] : -INFINITY;
    return cu_warp_max(t);
}

/* expf as the CPU backend's glibc computes it: exp in double rounded once to
 * float. glibc's expf is within 0.502 ulp (correctly rounded but for inputs
 * whose exact result lies within ~0.002 ulp of a rounding boundary), and so
 * is this, so the two agree on all but a vanishing fraction of inputs where
 * CUDA's expf (2 ulp) would differ often. Used where a score decides a
 * discrete choice (router) or where the op is cheap relative to memory. */
__device__ __forceinline__ float cu_expf(float x) { return (float)exp((double)x); }

/* Carves consecutive 256-byte aligned pieces out of one scratch buffer. */
typedef struct cu_carve {
    char *base;
    size_t off;
} cu_carve;

static inline size_t cu_align256(size_t b) { return (b + 255) & ~(size_t)255; }

static inline void *cu_take(cu_carve *c, size_t bytes)
{
    void *p = c->base + c->off;
    c->off += cu_align256(bytes);
    return p;
}

/* ---- segment tables ------------------------------------------------------- */

/* Segments of a grouped quantisation or FP8 GEMM (cuda_fp8.cu,
 * cuda_fp8_grouped.cu), passed by value (kernel parameters
 * may be up to 32 KB on sm_70+ since CUDA 12.1; __grid_constant__ reads
 * them in place without a local copy). start[g] = r_g (g <= G); tile[g] =
 * 128-row tiles of the segments before g (quant_cols_t). */
#define FP8_SEG_MAX 1024

typedef struct fp8_segs {
    int G;
    int start[FP8_SEG_MAX + 1];
    int tile[FP8_SEG_MAX + 1];
} fp8_segs;

/* Largest g < G with t[g] <= v: the segment holding row (or tile) v when
 * t is a non-decreasing prefix array and v < t[G]. Empty segments are
 * skipped because a later segment starts at the same value. */
__device__ __forceinline__ int fp8_seg_find(const int *t, int G, int64_t v)
{
    int lo = 0, hi = G - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (t[mid] <= v) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Host: fills the table from rows[G] (checked); *total = their sum. */
static inline int fp8_segs_fill(const char *op, fp8_segs *t, const int *rows, int G, int *total)
{
    MT_CHECK(mt_segments_total(op, rows, G, total));
    CUDA_REQUIRE(G <= FP8_SEG_MAX, "%s: G=%d segments, at most %d supported", op, G,
                 FP8_SEG_MAX);
    t->G = G;
    t->start[0] = 0;
    t->tile[0] = 0;
    for (int g = 0; g < G; g++) {
        t->start[g + 1] = t->start[g] + rows[g];
        t->tile[g + 1] = t->tile[g] + mt_ceil_div(rows[g], MT_QTILE);
    }
    return MT_OK;
}

#endif
