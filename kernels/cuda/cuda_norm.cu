/* cuda_norm.cu - RMSNorm forward / backward, SwiGLU forward / backward and
 * the embedding lookup and its gradient on the GPU.
 *
 * Same functions as kernels/cpu/cpu_norm.c, operation for operation (this
 * file is compiled with --fmad=false, as the CPU oracle is with
 * -ffp-contract=off, so a * b + c is never fused): row statistics in double,
 * element values in float, act stores rounded to nearest bf16. Only the
 * order of the double sums differs from the CPU (a fixed tree here), which
 * moves results by far less than a bf16 or f32 rounding step.
 *
 * Launch shapes:
 *   rmsnorm_fwd        one 256-thread block per row (16-byte aligned rows:
 *                      the row staged in shared memory by cp.async, 16-byte
 *                      stores; the same sums, bit-identical)
 *   rmsnorm_bwd        dx: one 256-thread block per row (staged likewise);
 *                      dw: a [D / 256, RC] grid of column threads (aligned
 *                      rows: [D / 512, RC] of 64 threads with 8 columns
 *                      each), each summing one chunk of rows in order into
 *                      a double partial (scratch), then one thread per
 *                      column adds the RC partials in order (deterministic,
 *                      no atomics). Aligned rows and dx apart from dy and
 *                      x: both in one launch, each chunk's dw blocks beside
 *                      its dx blocks, so dy and x come from HBM once
 *   swiglu_fwd/bwd     element-wise grid-stride
 *   embedding_fwd      one block per row (16-byte vectors when aligned)
 *   embedding_bwd      stable radix sort of (id, row) pairs (CUB, scratch),
 *                      then one block per distinct id adding its rows into
 *                      dtable in increasing row order: the CPU's order, so
 *                      the f32 sums are bit-identical (a bf16 dtable: the
 *                      same f32 sum from the row's value, rounded once)
 */
#include <cub/device/device_radix_sort.cuh>
#include <cuda_pipeline.h>

#include "kernels/cuda/cuda_impl.h"
#include "kernels/cuda/cuda_util.cuh"

#define NORM_THREADS 256

/* ---- RMSNorm ------------------------------------------------------------------- */

/* y = x * rstd * w, rstd = 1 / sqrt(mean x^2 + eps) (mean in double). */
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_fwd_kernel(bf16 *__restrict__ y, int ldy, float *__restrict__ rstd,
                   const bf16 *__restrict__ x, int ldx, const bf16 *__restrict__ w, int D,
                   float eps)
{
    __shared__ double sh[32];
    const int m = blockIdx.x;
    const bf16 *xr = x + (int64_t)m * ldx;
    bf16 *yr = y + (int64_t)m * ldy;
    double acc = 0.0;
    for (int k = threadIdx.x; k < D; k += blockDim.x) {
        double v = (double)cuda_ld(xr, k);
        acc += v * v;
    }
    const double ms = cu_block_sum(acc, sh) / D;
    const float r = (float)(1.0 / sqrt(ms + (double)eps));
    if (threadIdx.x == 0) rstd[m] = r;
    for (int k = threadIdx.x; k < D; k += blockDim.x) cuda_st(yr, k, cuda_ld(xr, k) * r * cuda_ld(w, k));
}

/* dx[m] = r (w dy - x c), c = r^2 / D * sum_k w dy x (all in double as the
 * CPU), stored (or added to dx in float) rounded to bf16. No __restrict__:
 * dx may alias dy or x (each element is read before it is written). */
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_bwd_dx_kernel(bf16 *dx, int lddx, int accumulate, const bf16 *dy, int lddy,
                      const bf16 *x, int ldx, const bf16 *w, const float *rstd, int D)
{
    __shared__ double sh[32];
    const int m = blockIdx.x;
    const bf16 *dyr = dy + (int64_t)m * lddy, *xr = x + (int64_t)m * ldx;
    bf16 *dxr = dx + (int64_t)m * lddx;
    double acc = 0.0;
    for (int k = threadIdx.x; k < D; k += blockDim.x)
        acc += (double)cuda_ld(w, k) * (double)cuda_ld(dyr, k) * (double)cuda_ld(xr, k);
    const double s = cu_block_sum(acc, sh); /* every thread has read its dy before any write */
    const float r = rstd[m];
    const double c = (double)r * (double)r / D * s;
    for (int k = threadIdx.x; k < D; k += blockDim.x) {
        float v = (float)((double)r * ((double)cuda_ld(w, k) * (double)cuda_ld(dyr, k) -
                                       (double)cuda_ld(xr, k) * c));
        cuda_st(dxr, k, accumulate ? cuda_ld(dxr, k) + v : v);
    }
}

/* part[rc, k] = sum over rows m of chunk rc (in order) of dy x rstd, double. */
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_bwd_dw_part_kernel(double *__restrict__ part, const bf16 *__restrict__ dy, int lddy,
                           const bf16 *__restrict__ x, int ldx, const float *__restrict__ rstd,
                           int M, int D, int rows_per)
{
    const int k = blockIdx.x * blockDim.x + threadIdx.x, rc = blockIdx.y;
    if (k >= D) return;
    const int m0 = rc * rows_per, m1 = min(M, m0 + rows_per);
    double acc = 0.0;
    for (int m = m0; m < m1; m++)
        acc += (double)cuda_ld(dy, (int64_t)m * lddy + k) * (double)cuda_ld(x, (int64_t)m * ldx + k) *
               (double)rstd[m];
    part[(int64_t)rc * D + k] = acc;
}

/* dw[k] = dw[k] + sum_rc part[rc, k] (chunks in order); a bf16 dw gets
 * the float sum rounded to bf16, as the CPU. The partials are loaded 8 at
 * a time before they are added (in the same order): one dependent L2 load
 * per chunk made this small kernel latency bound (64 chunks ~ 64 L2
 * round trips). */
#define DW_SUM_THREADS 64

__global__ void __launch_bounds__(DW_SUM_THREADS)
rmsnorm_bwd_dw_sum_kernel(void *__restrict__ dw, int dw_bf16, const double *__restrict__ part,
                          int RC, int D)
{
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= D) return;
    double acc = 0.0;
    int rc = 0;
    for (; rc + 8 <= RC; rc += 8) {
        double p[8];
#pragma unroll
        for (int i = 0; i < 8; i++) p[i] = part[(int64_t)(rc + i) * D + k];
#pragma unroll
        for (int i = 0; i < 8; i++) acc += p[i];
    }
    for (; rc < RC; rc++) acc += part[(int64_t)rc * D + k];
    if (dw_bf16) {
        bf16 *d = (bf16 *)dw;
        d[k] = __float2bfloat16_rn((float)((double)__bfloat162float(d[k]) + acc));
    } else {
        float *d = (float *)dw;
        d[k] = (float)((double)d[k] + acc);
    }
}

/* ---- RMSNorm, 16-byte paths ------------------------------------------------------
 * Taken when every row starts 16-byte aligned (bases aligned, leading
 * dimensions multiples of 8; w aligned) and a block's staged rows fit the
 * default 48 KiB of shared memory (D <= 24576 forward, D <= 8192 backward).
 * D % 8 != 0 is fine: the last D % 8 elements of a row go one by one.
 *
 * The element kernels above are latency bound: each thread has one 2-byte
 * load of each operand in flight and reads every row twice. Here a block
 * first copies its row(s) into shared memory with asynchronous 16-byte
 * copies (cp.async: the whole row in flight at once, each byte read from
 * global memory once), then thread t sums the elements k = t, t + 256, ...
 * from shared memory in the same order as above, so the row sums go through
 * the same cu_block_sum tree (bit-identical rstd, s and c); the outputs are
 * written 8 per thread with 16-byte stores, each element by the same
 * expression as the element kernels. */

/* Queues the asynchronous copy of row g [D] into sm [D] (16-byte pieces, the
 * tail element-wise; g and sm 16-byte aligned). The caller commits, waits
 * and synchronises the block before reading sm. */
__device__ __forceinline__ void norm_stage_row(bf16 *sm, const bf16 *g, int D)
{
    const int D8 = D >> 3;
    for (int c = threadIdx.x; c < D8; c += blockDim.x)
        __pipeline_memcpy_async(sm + 8 * c, g + 8 * c, 16);
    for (int k = 8 * D8 + threadIdx.x; k < D; k += blockDim.x) sm[k] = g[k];
}

__device__ __forceinline__ void norm_stage_wait(void)
{
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
}

/* Elements of shared memory per staged row: D rounded up to 8, so the next
 * row starts 16-byte aligned. */
__host__ __device__ static inline int norm_row_pad(int D) { return (D + 7) & ~7; }

extern __shared__ __align__(16) unsigned char norm_smem[];

/* rmsnorm_fwd_kernel with the row staged: smem [D8 pad] bf16. */
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_fwd_vec_kernel(bf16 *__restrict__ y, int ldy, float *__restrict__ rstd,
                       const bf16 *__restrict__ x, int ldx, const bf16 *__restrict__ w, int D,
                       float eps)
{
    __shared__ double sh[32];
    bf16 *sx = (bf16 *)norm_smem;
    const int m = blockIdx.x;
    const bf16 *xr = x + (int64_t)m * ldx;
    bf16 *yr = y + (int64_t)m * ldy;
    norm_stage_row(sx, xr, D);
    norm_stage_wait();
    double acc = 0.0;
    for (int k = threadIdx.x; k < D; k += NORM_THREADS) {
        double v = (double)__bfloat162float(sx[k]);
        acc += v * v;
    }
    const double ms = cu_block_sum(acc, sh) / D;
    const float r = (float)(1.0 / sqrt(ms + (double)eps));
    if (threadIdx.x == 0) rstd[m] = r;
    const int D8 = D >> 3;
    for (int c = threadIdx.x; c < D8; c += NORM_THREADS) {
        float xv[8], wv[8], o[8];
        cu_bf16x8_unpack(((const uint4 *)sx)[c], xv);
        cu_bf16x8_unpack(((const uint4 *)w)[c], wv);
#pragma unroll
        for (int j = 0; j < 8; j++) o[j] = xv[j] * r * wv[j];
        ((uint4 *)yr)[c] = cu_bf16x8_pack(o);
    }
    for (int k = 8 * D8 + threadIdx.x; k < D; k += NORM_THREADS)
        cuda_st(yr, k, __bfloat162float(sx[k]) * r * cuda_ld(w, k));
}

/* rmsnorm_bwd_dx_kernel's row m with dy, x and w staged: smem 3 x [D pad]
 * bf16, sh the reduction's 32 doubles. No __restrict__ on dx, dy, x: dx may
 * alias dy or x; the block reads all of its row of dy and x (the staging)
 * before any thread writes. Contains __syncthreads: the whole block calls. */
__device__ __forceinline__ void norm_bwd_dx_row(int m, bf16 *dx, int lddx, int accumulate,
                                                const bf16 *dy, int lddy, const bf16 *x, int ldx,
                                                const bf16 *w, const float *rstd, int D, double *sh)
{
    const int Dp = norm_row_pad(D);
    bf16 *sdy = (bf16 *)norm_smem, *sx = sdy + Dp, *sw = sx + Dp;
    const bf16 *dyr = dy + (int64_t)m * lddy, *xr = x + (int64_t)m * ldx;
    bf16 *dxr = dx + (int64_t)m * lddx;
    norm_stage_row(sdy, dyr, D);
    norm_stage_row(sx, xr, D);
    norm_stage_row(sw, w, D);
    norm_stage_wait();
    double acc = 0.0;
    for (int k = threadIdx.x; k < D; k += NORM_THREADS)
        acc += (double)__bfloat162float(sw[k]) * (double)__bfloat162float(sdy[k]) *
               (double)__bfloat162float(sx[k]);
    const double s = cu_block_sum(acc, sh);
    const float r = rstd[m];
    const double c = (double)r * (double)r / D * s;
    const int D8 = D >> 3;
    for (int q = threadIdx.x; q < D8; q += NORM_THREADS) {
        float wv[8], dyv[8], xv[8], o[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        cu_bf16x8_unpack(((const uint4 *)sw)[q], wv);
        cu_bf16x8_unpack(((const uint4 *)sdy)[q], dyv);
        cu_bf16x8_unpack(((const uint4 *)sx)[q], xv);
        if (accumulate) cu_bf16x8_unpack(((const uint4 *)dxr)[q], o);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float v = (float)((double)r * ((double)wv[j] * (double)dyv[j] - (double)xv[j] * c));
            o[j] = accumulate ? o[j] + v : v;
        }
        ((uint4 *)dxr)[q] = cu_bf16x8_pack(o);
    }
    for (int k = 8 * D8 + threadIdx.x; k < D; k += NORM_THREADS) {
        float v = (float)((double)r * ((double)__bfloat162float(sw[k]) * (double)__bfloat162float(sdy[k]) -
                                       (double)__bfloat162float(sx[k]) * c));
        cuda_st(dxr, k, accumulate ? cuda_ld(dxr, k) + v : v);
    }
}

__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_bwd_dx_vec_kernel(bf16 *dx, int lddx, int accumulate, const bf16 *dy, int lddy,
                          const bf16 *x, int ldx, const bf16 *w, const float *rstd, int D)
{
    __shared__ double sh[32];
    norm_bwd_dx_row(blockIdx.x, dx, lddx, accumulate, dy, lddy, x, ldx, w, rstd, D, sh);
}

/* rmsnorm_bwd_dw_part_kernel with 8 consecutive columns per thread (16-byte
 * loads) and DW_UNROLL rows loaded before they are added: each column's sum
 * still runs over the chunk's rows in order, the same expression, so part
 * is bit-identical. Chunks are taken last first (rc = RC - 1 - blockIdx.y):
 * the dx kernel has just read the last rows, which are the ones still in L2. */
#define DW_THREADS 64
#define DW_UNROLL 8

/* part[rc, k0 .. k0 + 7] (fewer at the end of the row), k0 < D. */
__device__ __forceinline__ void norm_bwd_dw_cols(double *__restrict__ part, const bf16 *__restrict__ dy,
                                                 int lddy, const bf16 *__restrict__ x, int ldx,
                                                 const float *__restrict__ rstd, int M, int D,
                                                 int rows_per, int rc, int k0)
{
    const int m0 = rc * rows_per, m1 = min(M, m0 + rows_per);
    if (k0 + 8 <= D) {
        double acc[8];
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] = 0.0;
        int m = m0;
        for (; m + DW_UNROLL <= m1; m += DW_UNROLL) {
            uint4 a[DW_UNROLL], b[DW_UNROLL];
            float r[DW_UNROLL];
#pragma unroll
            for (int i = 0; i < DW_UNROLL; i++) {
                a[i] = *(const uint4 *)(dy + (int64_t)(m + i) * lddy + k0);
                b[i] = *(const uint4 *)(x + (int64_t)(m + i) * ldx + k0);
                r[i] = rstd[m + i];
            }
#pragma unroll
            for (int i = 0; i < DW_UNROLL; i++) {
                float dyv[8], xv[8];
                cu_bf16x8_unpack(a[i], dyv);
                cu_bf16x8_unpack(b[i], xv);
#pragma unroll
                for (int j = 0; j < 8; j++) acc[j] += (double)dyv[j] * (double)xv[j] * (double)r[i];
            }
        }
        for (; m < m1; m++) {
            float dyv[8], xv[8];
            cu_bf16x8_unpack(*(const uint4 *)(dy + (int64_t)m * lddy + k0), dyv);
            cu_bf16x8_unpack(*(const uint4 *)(x + (int64_t)m * ldx + k0), xv);
            const float r = rstd[m];
#pragma unroll
            for (int j = 0; j < 8; j++) acc[j] += (double)dyv[j] * (double)xv[j] * (double)r;
        }
#pragma unroll
        for (int j = 0; j < 8; j++) part[(int64_t)rc * D + k0 + j] = acc[j];
    } else { /* the last D % 8 columns, one at a time (a scalar sum each) */
        for (int k = k0; k < D; k++) {
            double a = 0.0;
            for (int m = m0; m < m1; m++)
                a += (double)cuda_ld(dy, (int64_t)m * lddy + k) * (double)cuda_ld(x, (int64_t)m * ldx + k) *
                     (double)rstd[m];
            part[(int64_t)rc * D + k] = a;
        }
    }
}

__global__ void __launch_bounds__(DW_THREADS)
rmsnorm_bwd_dw_part_vec_kernel(double *__restrict__ part, const bf16 *__restrict__ dy, int lddy,
                               const bf16 *__restrict__ x, int ldx, const float *__restrict__ rstd,
                               int M, int D, int rows_per)
{
    const int k0 = 8 * (blockIdx.x * DW_THREADS + threadIdx.x);
    if (k0 < D)
        norm_bwd_dw_cols(part, dy, lddy, x, ldx, rstd, M, D, rows_per, gridDim.y - 1 - blockIdx.y, k0);
}

/* dx and the dw partials in one launch, when dx overlaps neither dy nor x
 * (dw reads only dy, x and rstd, so it does not wait for dx). The blocks
 * come in one group per row chunk rc: TPC blocks of its dw partials (256
 * threads x 8 columns, norm_bwd_dw_cols), then the chunk's rows (one dx
 * block each, norm_bwd_dx_row). Blocks start roughly in index order, so a
 * chunk's dx blocks read its rows of dy and x while its dw blocks do, and
 * one of the two reads comes from L2 (a chunk: 64 rows, 1.8 MB at D = 7168,
 * against 117 MB for a pass over dy and x at M = 4096): HBM sees dy and x
 * once instead of twice. The dw blocks go first because they run longest
 * (64 rows each): last, they would make a tail. The same functions as the
 * two kernels: bit-identical. */
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_bwd_fused_kernel(bf16 *__restrict__ dx, int lddx, int accumulate,
                         const bf16 *__restrict__ dy, int lddy, const bf16 *__restrict__ x,
                         int ldx, const bf16 *__restrict__ w, const float *__restrict__ rstd,
                         double *__restrict__ part, int M, int D, int rows_per, int TPC)
{
    __shared__ double sh[32];
    const int G = rows_per + TPC; /* blocks of a full chunk's group */
    const int rc = blockIdx.x / G, local = blockIdx.x - rc * G;
    if (local < TPC) {
        const int k0 = 8 * (local * NORM_THREADS + threadIdx.x);
        if (k0 < D) norm_bwd_dw_cols(part, dy, lddy, x, ldx, rstd, M, D, rows_per, rc, k0);
        return;
    }
    /* block-uniform: the whole block takes this branch (__syncthreads inside) */
    norm_bwd_dx_row(rc * rows_per + local - TPC, dx, lddx, accumulate, dy, lddy, x, ldx, w, rstd,
                    D, sh);
}

/* Rows of p (leading dimension ld) all start 16-byte aligned. */
static int norm_rows16(const void *p, int ld) { return ((uintptr_t)p & 15) == 0 && ld % 8 == 0; }

/* Whether the [M, D] bf16 rows of a (lda) and b (ldb) share any byte. */
static int norm_overlap(const void *a, int lda, const void *b, int ldb, int M, int D)
{
    const char *a0 = (const char *)a, *b0 = (const char *)b;
    const char *a1 = a0 + 2 * ((int64_t)(M - 1) * lda + D);
    const char *b1 = b0 + 2 * ((int64_t)(M - 1) * ldb + D);
    return a0 < b1 && b0 < a1;
}

/* Shared memory of the staged rows: the default limit, no opt-in needed. */
#define NORM_VEC_SMEM ((size_t)48 << 10)

static int cuda_rmsnorm_fwd(mt_backend *be, void *y, int ldy, float *rstd, const void *x, int ldx,
                            const void *w, int M, int D, float eps)
{
    CUDA_REQUIRE(M >= 0 && D >= 1, "rmsnorm_fwd: M=%d D=%d", M, D);
    CUDA_REQUIRE(ldy >= D && ldx >= D, "rmsnorm_fwd: ldy=%d ldx=%d < D=%d", ldy, ldx, D);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(y && rstd && x && w, "rmsnorm_fwd: NULL pointer");
    const size_t smem = sizeof(bf16) * (size_t)norm_row_pad(D);
    if (norm_rows16(y, ldy) && norm_rows16(x, ldx) && norm_rows16(w, 0) && smem <= NORM_VEC_SMEM)
        rmsnorm_fwd_vec_kernel<<<M, NORM_THREADS, smem, cuda_stream(be)>>>(
            (bf16 *)y, ldy, rstd, (const bf16 *)x, ldx, (const bf16 *)w, D, eps);
    else
        rmsnorm_fwd_kernel<<<M, NORM_THREADS, 0, cuda_stream(be)>>>(
            (bf16 *)y, ldy, rstd, (const bf16 *)x, ldx, (const bf16 *)w, D, eps);
    CUDA_LAUNCH_CHECK("rmsnorm_fwd");
    return MT_OK;
}

/* Row chunks of the dw reduction: at most 64 (bounds the scratch to
 * 64 * D doubles), at least 32 rows each. */
#define DW_MAX_CHUNKS 64
#define DW_MIN_ROWS 32

static int cuda_rmsnorm_bwd(mt_backend *be, void *dx, int lddx, int accumulate, void *dw,
                            int dw_type, const void *dy, int lddy, const void *x, int ldx, const void *w,
                            const float *rstd, int M, int D)
{
    CUDA_REQUIRE(M >= 0 && D >= 1, "rmsnorm_bwd: M=%d D=%d", M, D);
    CUDA_REQUIRE(lddx >= D && lddy >= D && ldx >= D,
                 "rmsnorm_bwd: lddx=%d lddy=%d ldx=%d < D=%d", lddx, lddy, ldx, D);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(dx && dw && dy && x && w && rstd, "rmsnorm_bwd: NULL pointer");
    CUDA_REQUIRE(dw_type == MT_C_F32 || dw_type == MT_C_BF16, "rmsnorm_bwd: dw_type=%d", dw_type);
    cudaStream_t st = cuda_stream(be);
    int rows_per = mt_ceil_div(M, DW_MAX_CHUNKS);
    if (rows_per < DW_MIN_ROWS) rows_per = DW_MIN_ROWS;
    const int RC = mt_ceil_div(M, rows_per);
    double *part = (double *)cuda_scratch(be, sizeof(double) * (size_t)RC * D);
    if (!part) return mt_err_wrap(MT_ENOMEM, "rmsnorm_bwd: %d x %d partial sums", RC, D);
    const size_t smem = 3 * sizeof(bf16) * (size_t)norm_row_pad(D);
    const int rows_vec = norm_rows16(dy, lddy) && norm_rows16(x, ldx);
    const int dx_vec = rows_vec && norm_rows16(dx, lddx) && norm_rows16(w, 0) && smem <= NORM_VEC_SMEM;
    if (dx_vec && !norm_overlap(dx, lddx, dy, lddy, M, D) && !norm_overlap(dx, lddx, x, ldx, M, D)) {
        const int TPC = mt_ceil_div(mt_ceil_div(D, 8), NORM_THREADS);
        const int64_t blocks = (int64_t)M + (int64_t)RC * TPC;
        rmsnorm_bwd_fused_kernel<<<(unsigned)blocks, NORM_THREADS, smem, st>>>(
            (bf16 *)dx, lddx, accumulate, (const bf16 *)dy, lddy, (const bf16 *)x, ldx,
            (const bf16 *)w, rstd, part, M, D, rows_per, TPC);
        CUDA_LAUNCH_CHECK("rmsnorm_bwd");
    } else {
        /* dx first, then dw, as the CPU (matters only if dx aliases dy) */
        if (dx_vec)
            rmsnorm_bwd_dx_vec_kernel<<<M, NORM_THREADS, smem, st>>>(
                (bf16 *)dx, lddx, accumulate, (const bf16 *)dy, lddy, (const bf16 *)x, ldx,
                (const bf16 *)w, rstd, D);
        else
            rmsnorm_bwd_dx_kernel<<<M, NORM_THREADS, 0, st>>>(
                (bf16 *)dx, lddx, accumulate, (const bf16 *)dy, lddy, (const bf16 *)x, ldx,
                (const bf16 *)w, rstd, D);
        CUDA_LAUNCH_CHECK("rmsnorm_bwd");
        if (rows_vec) {
            dim3 grid((unsigned)mt_ceil_div(mt_ceil_div(D, 8), DW_THREADS), (unsigned)RC);
            rmsnorm_bwd_dw_part_vec_kernel<<<grid, DW_THREADS, 0, st>>>(
                part, (const bf16 *)dy, lddy, (const bf16 *)x, ldx, rstd, M, D, rows_per);
        } else {
            dim3 grid((unsigned)mt_ceil_div(D, NORM_THREADS), (unsigned)RC);
            rmsnorm_bwd_dw_part_kernel<<<grid, NORM_THREADS, 0, st>>>(
                part, (const bf16 *)dy, lddy, (const bf16 *)x, ldx, rstd, M, D, rows_per);
        }
        CUDA_LAUNCH_CHECK("rmsnorm_bwd");
    }
    rmsnorm_bwd_dw_sum_kernel<<<mt_ceil_div(D, DW_SUM_THREADS), DW_SUM_THREADS, 0, st>>>(
        dw, dw_type == MT_C_BF16, part, RC, D);
    CUDA_LAUNCH_CHECK("rmsnorm_bwd");
    return MT_OK;
}

/* ---- SwiGLU ---------------------------------------------------------------------- */

__device__ __forceinline__ float norm_sigmoid(float g) { return 1.0f / (1.0f + cu_expf(-g)); }

/* h [M, F] = silu(g) * u, g = gu[:, :F], u = gu[:, F:]: (g * sigmoid(g)) * u. */
__global__ void swiglu_fwd_kernel(bf16 *__restrict__ h, const bf16 *__restrict__ gu, int M, int F)
{
    const int64_t total = (int64_t)M * F;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = i / F, f = i % F;
        const float g = cuda_ld(gu, m * 2 * F + f), u = cuda_ld(gu, m * 2 * F + F + f);
        cuda_st(h, i, g * norm_sigmoid(g) * u);
    }
}

/* dg = dh u sg (1 + g (1 - sg)), du = dh silu(g), as the CPU groups them. */
__global__ void swiglu_bwd_kernel(bf16 *__restrict__ dgu, const bf16 *__restrict__ dh,
                                  const bf16 *__restrict__ gu, int M, int F)
{
    const int64_t total = (int64_t)M * F;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = i / F, f = i % F;
        const float g = cuda_ld(gu, m * 2 * F + f), u = cuda_ld(gu, m * 2 * F + F + f);
        const float d = cuda_ld(dh, i);
        const float sg = norm_sigmoid(g), silu = g * sg;
        cuda_st(dgu, m * 2 * F + f, d * u * (sg * (1.0f + g * (1.0f - sg))));
        cuda_st(dgu, m * 2 * F + F + f, d * silu);
    }
}

/* The same with 8 consecutive f per thread (16-byte accesses; F % 8 == 0
 * and 16-byte aligned bases): one index division per 8 elements, each
 * element computed as above (bit-identical). */
__global__ void swiglu_fwd_vec_kernel(bf16 *__restrict__ h, const bf16 *__restrict__ gu, int M,
                                      int F)
{
    const int F8 = F / 8;
    const int64_t total = (int64_t)M * F8;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = i / F8, c = i % F8;
        const uint4 *row = (const uint4 *)(gu + m * 2 * F);
        float g[8], u[8], o[8];
        cu_bf16x8_unpack(row[c], g);
        cu_bf16x8_unpack(row[F8 + c], u);
#pragma unroll
        for (int j = 0; j < 8; j++) o[j] = g[j] * norm_sigmoid(g[j]) * u[j];
        ((uint4 *)h)[i] = cu_bf16x8_pack(o);
    }
}

__global__ void swiglu_bwd_vec_kernel(bf16 *__restrict__ dgu, const bf16 *__restrict__ dh,
                                      const bf16 *__restrict__ gu, int M, int F)
{
    const int F8 = F / 8;
    const int64_t total = (int64_t)M * F8;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t m = i / F8, c = i % F8;
        const uint4 *row = (const uint4 *)(gu + m * 2 * F);
        uint4 *drow = (uint4 *)(dgu + m * 2 * F);
        float g[8], u[8], d[8], dg[8], du[8];
        cu_bf16x8_unpack(row[c], g);
        cu_bf16x8_unpack(row[F8 + c], u);
        cu_bf16x8_unpack(((const uint4 *)dh)[i], d);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float sg = norm_sigmoid(g[j]), silu = g[j] * sg;
            dg[j] = d[j] * u[j] * (sg * (1.0f + g[j] * (1.0f - sg)));
            du[j] = d[j] * silu;
        }
        drow[c] = cu_bf16x8_pack(dg);
        drow[F8 + c] = cu_bf16x8_pack(du);
    }
}

static int norm_vec8(const void *a, const void *b, const void *c, int F)
{
    return F % 8 == 0 && (uintptr_t)a % 16 == 0 && (uintptr_t)b % 16 == 0 && (uintptr_t)c % 16 == 0;
}

static int cuda_swiglu_fwd(mt_backend *be, void *h, const void *gu, int M, int F)
{
    CUDA_REQUIRE(M >= 0 && F >= 1, "swiglu_fwd: M=%d F=%d", M, F);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(h && gu, "swiglu_fwd: NULL pointer");
    if (norm_vec8(h, gu, gu, F))
        swiglu_fwd_vec_kernel<<<cuda_grid((int64_t)M * F / 8, 256), 256, 0, cuda_stream(be)>>>(
            (bf16 *)h, (const bf16 *)gu, M, F);
    else
        swiglu_fwd_kernel<<<cuda_grid((int64_t)M * F, 256), 256, 0, cuda_stream(be)>>>(
            (bf16 *)h, (const bf16 *)gu, M, F);
    CUDA_LAUNCH_CHECK("swiglu_fwd");
    return MT_OK;
}

static int cuda_swiglu_bwd(mt_backend *be, void *dgu, const void *dh, const void *gu, int M, int F)
{
    CUDA_REQUIRE(M >= 0 && F >= 1, "swiglu_bwd: M=%d F=%d", M, F);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(dgu && dh && gu, "swiglu_bwd: NULL pointer");
    if (norm_vec8(dgu, dh, gu, F))
        swiglu_bwd_vec_kernel<<<cuda_grid((int64_t)M * F / 8, 256), 256, 0, cuda_stream(be)>>>(
            (bf16 *)dgu, (const bf16 *)dh, (const bf16 *)gu, M, F);
    else
        swiglu_bwd_kernel<<<cuda_grid((int64_t)M * F, 256), 256, 0, cuda_stream(be)>>>(
            (bf16 *)dgu, (const bf16 *)dh, (const bf16 *)gu, M, F);
    CUDA_LAUNCH_CHECK("swiglu_bwd");
    return MT_OK;
}

/* ---- embedding ------------------------------------------------------------------- */

/* y[m] = table[ids[m]]; vec: rows are whole 16-byte vectors (D % 8 == 0 and
 * both bases 16-byte aligned). Negative ids (which the CPU rejects on the
 * host) give zero rows instead of reading out of bounds. */
__global__ void embedding_fwd_kernel(bf16 *__restrict__ y, const bf16 *__restrict__ table,
                                     const int32_t *__restrict__ ids, int D, int vec)
{
    const int m = blockIdx.x;
    const int id = ids[m];
    bf16 *dst = y + (int64_t)m * D;
    if (vec) {
        uint4 *d4 = (uint4 *)dst;
        const uint4 *s4 = (const uint4 *)(table + (int64_t)id * D);
        for (int i = threadIdx.x; i < D / 8; i += blockDim.x) d4[i] = id >= 0 ? s4[i] : make_uint4(0, 0, 0, 0);
    } else {
        const bf16 *src = table + (int64_t)id * D;
        for (int k = threadIdx.x; k < D; k += blockDim.x) dst[k] = id >= 0 ? src[k] : __float2bfloat16_rn(0.0f);
    }
}

static int rows_vec_ok(const void *a, const void *b, int D)
{
    return D % 8 == 0 && ((uintptr_t)a % 16) == 0 && ((uintptr_t)b % 16) == 0;
}

static int cuda_embedding_fwd(mt_backend *be, void *y, const void *table, const int32_t *ids,
                              int M, int D)
{
    CUDA_REQUIRE(M >= 0 && D >= 1, "embedding_fwd: M=%d D=%d", M, D);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(y && table && ids, "embedding_fwd: NULL pointer");
    embedding_fwd_kernel<<<M, 128, 0, cuda_stream(be)>>>((bf16 *)y, (const bf16 *)table, ids, D,
                                                         rows_vec_ok(y, table, D));
    CUDA_LAUNCH_CHECK("embedding_fwd");
    return MT_OK;
}

__global__ void iota_kernel(int32_t *v, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = i;
}

/* Block j handles sorted position j if it starts a run of equal ids: for
 * each column, dtable[id, k] += dy[m, k] for the run's rows m in increasing
 * order (the sort is stable), one float add at a time as the CPU. */
__global__ void embedding_bwd_kernel(void *__restrict__ dtable, int dt_bf16,
                                     const bf16 *__restrict__ dy,
                                     const int32_t *__restrict__ key, const int32_t *__restrict__ row,
                                     int M, int D)
{
    const int j = blockIdx.x;
    const int id = key[j];
    if (id < 0 || (j > 0 && key[j - 1] == id)) return;
    int end = j + 1;
    while (end < M && key[end] == id) end++;
    for (int k = threadIdx.x; k < D; k += blockDim.x) {
        const int64_t e = (int64_t)id * D + k;
        float acc = dt_bf16 ? __bfloat162float(((bf16 *)dtable)[e]) : ((float *)dtable)[e];
        for (int i = j; i < end; i++) acc += cuda_ld(dy, (int64_t)row[i] * D + k);
        if (dt_bf16)
            ((bf16 *)dtable)[e] = __float2bfloat16_rn(acc); /* one rounding per call */
        else
            ((float *)dtable)[e] = acc;
    }
}

static int cuda_embedding_bwd(mt_backend *be, void *dtable, int dt_type, const void *dy,
                              const int32_t *ids, int M, int D)
{
    CUDA_REQUIRE(M >= 0 && D >= 1, "embedding_bwd: M=%d D=%d", M, D);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(dtable && dy && ids, "embedding_bwd: NULL pointer");
    CUDA_REQUIRE(dt_type == MT_C_F32 || dt_type == MT_C_BF16, "embedding_bwd: dt_type=%d",
                 dt_type);
    cudaStream_t st = cuda_stream(be);
    size_t temp = 0;
    MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs((void *)NULL, temp, (const int32_t *)NULL,
                                                  (int32_t *)NULL, (const int32_t *)NULL,
                                                  (int32_t *)NULL, M, 0, 32, st));
    const size_t vec = cu_align256(sizeof(int32_t) * (size_t)M);
    char *base = (char *)cuda_scratch(be, 3 * vec + cu_align256(temp));
    if (!base) return mt_err_wrap(MT_ENOMEM, "embedding_bwd: sorting %d ids", M);
    cu_carve cv = {base, 0};
    int32_t *key = (int32_t *)cu_take(&cv, sizeof(int32_t) * (size_t)M);
    int32_t *row_in = (int32_t *)cu_take(&cv, sizeof(int32_t) * (size_t)M);
    int32_t *row = (int32_t *)cu_take(&cv, sizeof(int32_t) * (size_t)M);
    void *tmp = cu_take(&cv, temp);
    iota_kernel<<<cuda_grid(M, 256), 256, 0, st>>>(row_in, M);
    CUDA_LAUNCH_CHECK("embedding_bwd");
    MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(tmp, temp, ids, key, (const int32_t *)row_in,
                                                  row, M, 0, 32, st));
    embedding_bwd_kernel<<<M, 128, 0, st>>>(dtable, dt_type == MT_C_BF16, (const bf16 *)dy, key,
                                            row, M, D);
    CUDA_LAUNCH_CHECK("embedding_bwd");
    return MT_OK;
}

void cuda_install_norm(mt_backend *be)
{
    be->rmsnorm_fwd = cuda_rmsnorm_fwd;
    be->rmsnorm_bwd = cuda_rmsnorm_bwd;
    be->swiglu_fwd = cuda_swiglu_fwd;
    be->swiglu_bwd = cuda_swiglu_bwd;
    be->embedding_fwd = cuda_embedding_fwd;
    be->embedding_bwd = cuda_embedding_bwd;
}
