/* cuda_fp8.cu - FP8 E4M3 quantisation on the GPU: 1x128 row tiles
 * (quant_rows), 128x1 column tiles written transposed (quant_cols_t), both
 * from one read (quant_rows_cols_t),
 * 128x128 weight blocks (quant_blocks, and its stochastic-rounding variant),
 * the exact block transpose, dequantisation, and stochastic rounding to bf16
 * (act_from_f32_sr).
 *
 * Bit-exact with kernels/cpu/cpu_fp8.c: the same tiles, the same scale
 * s = amax / 448 (cuda_scale_of), the same code e4m3(x / s) with an IEEE
 * division and a round-to-nearest-even saturating conversion (cuda_e4m3),
 * the same scale layouts (ops.h), and for stochastic rounding the same
 * random bits (mt_hash_u64 of kernels/mt_rng.h, re-implemented in
 * cuda_impl.h with identical constants: the header's functions are
 * host-only C).
 *
 * Launch shapes:
 *   quant_rows        one warp per 1x128 tile, 8 tiles per 256-thread block;
 *                     full tiles: a half-warp per tile, a warp per strip of
 *                     8 consecutive tiles of one row
 *   quant_cols_t      one 256-thread block per (128-row tile, 64 columns)
 *   quant_rows_cols_t one 256-thread block per (128-row tile, 128 columns)
 *   quant_blocks(_sr) one 256-thread block per 128x128 block
 *   transpose_blocks  32x32 byte tiles, 32x8 threads
 *   dequant_blocks, act_from_f32_sr: element-wise grid-stride loops
 */
#include "kernels/cuda/cuda_impl.h"
#include "kernels/cuda/cuda_util.cuh"

/* ---- quant_rows ------------------------------------------------------------------ */

#define QR_WARPS 8

/* bf16 bits -> float, the low and high halves of a 32-bit word. */
__device__ __forceinline__ float fp8_bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float fp8_bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

/* Tile t = m * KB + kb of x [M, K] (ldx), one warp. A full tile whose source
 * is 8-byte and destination 4-byte aligned (the common case): lane l holds
 * elements 4l .. 4l + 3, read as one 8-byte word and stored as one 4-byte
 * word of codes. Otherwise lane l holds k0 + l + 32 j (j < 4). The amax and
 * the codes do not depend on which lane holds what. Scale of segment g at
 * s + KB r_g + kb rows[g] + (m - r_g). */
__global__ void __launch_bounds__(QR_WARPS * 32)
quant_rows_kernel(uint8_t *__restrict__ q, float *__restrict__ s, const bf16 *__restrict__ x,
                  int ldx, int M, int K, int KB, const __grid_constant__ fp8_segs segs)
{
    const int lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * QR_WARPS + (threadIdx.x >> 5);
    if (t >= (int64_t)M * KB) return; /* whole warps leave together */
    const int m = (int)(t / KB), kb = (int)(t % KB);
    const int k0 = kb * MT_QTILE, n = min(MT_QTILE, K - k0);
    const bf16 *xt = x + (int64_t)m * ldx + k0;
    uint8_t *qt = q + (int64_t)m * K + k0;
    const bool vec = n == MT_QTILE && ((uintptr_t)xt & 7) == 0 && ((uintptr_t)qt & 3) == 0;
    float v[4], amax = 0.0f;
    if (vec) {
        const uint2 w = *(const uint2 *)(xt + 4 * lane);
        v[0] = fp8_bf16_lo(w.x), v[1] = fp8_bf16_hi(w.x);
        v[2] = fp8_bf16_lo(w.y), v[3] = fp8_bf16_hi(w.y);
#pragma unroll
        for (int j = 0; j < 4; j++) amax = fmaxf(amax, fabsf(v[j]));
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int k = lane + 32 * j;
            v[j] = k < n ? cuda_ld(xt, k) : 0.0f;
            amax = fmaxf(amax, fabsf(v[j]));
        }
    }
    amax = cu_warp_max(amax);
    const float sc = cuda_scale_of(amax);
    if (vec) {
        uint32_t c = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) c |= (uint32_t)cuda_e4m3(v[j], sc) << (8 * j);
        *(uint32_t *)(qt + 4 * lane) = c;
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int k = lane + 32 * j;
            if (k < n) qt[k] = cuda_e4m3(v[j], sc);
        }
    }
    if (lane == 0) {
        int g = fp8_seg_find(segs.start, segs.G, m);
        int r0 = segs.start[g], rows = segs.start[g + 1] - r0;
        s[(int64_t)KB * r0 + (int64_t)kb * rows + (m - r0)] = sc;
    }
}

/* Full tiles with 16-byte loads (K % 128 == 0, 16-byte aligned rows): a
 * warp per strip of 2 * QRV_PAIRS consecutive tiles of one row, a
 * half-warp per tile, 8 elements per lane; the warp's 32 lanes read 512
 * contiguous bytes per load and issue all QRV_PAIRS loads before the first
 * reduction. The row, its segment and the strip's first tile come from one
 * 32-bit division per warp. Same amax, scale and codes as quant_rows_kernel:
 * bit-identical. On an H200 ([65536, 7168], the proxy's expert rows): 0.590
 * ms with a tile pair per half-warp pair and 64-bit index arithmetic per
 * tile, 0.384-0.396 ms as strips of 8 tiles (2 tiles 0.426, 16 tiles 0.412). */
#define QRV_PAIRS 4

__global__ void __launch_bounds__(QR_WARPS * 32)
quant_rows_vec_kernel(uint8_t *__restrict__ q, float *__restrict__ s, const bf16 *__restrict__ x,
                      int ldx, int M, int K, int KB, int strips,
                      const __grid_constant__ fp8_segs segs)
{
    const int lane = threadIdx.x & 31, hl = lane & 15, half = lane >> 4;
    const int w = blockIdx.x * QR_WARPS + (threadIdx.x >> 5);
    if (w >= M * strips) return; /* whole warps leave together */
    const int m = w / strips, kb0 = (w - m * strips) * (2 * QRV_PAIRS) + half;
    const bf16 *xr = x + (int64_t)m * ldx + 8 * hl;
    uint8_t *qr = q + (int64_t)m * K + 8 * hl;
    uint4 v8[QRV_PAIRS];
#pragma unroll
    for (int i = 0; i < QRV_PAIRS; i++) {
        const int kb = kb0 + 2 * i;
        v8[i] = make_uint4(0, 0, 0, 0);
        if (kb < KB) v8[i] = *(const uint4 *)(xr + kb * MT_QTILE);
    }
    const int g = fp8_seg_find(segs.start, segs.G, m);
    const int r0 = segs.start[g], rows = segs.start[g + 1] - r0;
    float *sr = s + (int64_t)KB * r0 + (m - r0);
#pragma unroll
    for (int i = 0; i < QRV_PAIRS; i++) {
        const int kb = kb0 + 2 * i;
        float v[8], amax = 0.0f;
        cu_bf16x8_unpack(v8[i], v);
#pragma unroll
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
        for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(CU_FULL, amax, o));
        if (kb >= KB) continue;
        const float sc = cuda_scale_of(amax);
        uint32_t c[2] = {0, 0};
#pragma unroll
        for (int j = 0; j < 8; j++) c[j >> 2] |= (uint32_t)cuda_e4m3(v[j], sc) << (8 * (j & 3));
        *(uint2 *)(qr + kb * MT_QTILE) = make_uint2(c[0], c[1]);
        if (hl == 0) sr[(int64_t)kb * rows] = sc;
    }
}

static int cuda_quant_rows(mt_backend *be, uint8_t *q, float *s, const void *x, int ldx,
                           const int *rows, int G, int K)
{
    fp8_segs segs; /* 8 KB, copied into the launch's parameters */
    int M;
    MT_CHECK(fp8_segs_fill("quant_rows", &segs, rows, G, &M));
    CUDA_REQUIRE(K >= 1 && ldx >= K, "quant_rows: K=%d ldx=%d", K, ldx);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(q && s && x, "quant_rows: NULL pointer");
    const int KB = mt_ceil_div(K, MT_QTILE);
    const int64_t tiles = (int64_t)M * KB;
    CUDA_REQUIRE(tiles / QR_WARPS < 0x7fffffff, "quant_rows: %lld tiles is too many",
                 (long long)tiles);
    const int strips = mt_ceil_div(KB, 2 * QRV_PAIRS);
    if (K % MT_QTILE == 0 && ldx % 8 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)q % 8 == 0 &&
        (int64_t)M * strips < 0x7fffffff - QR_WARPS)
        quant_rows_vec_kernel<<<cuda_grid((int64_t)M * strips, QR_WARPS), QR_WARPS * 32, 0,
                                cuda_stream(be)>>>(q, s, (const bf16 *)x, ldx, M, K, KB, strips,
                                                   segs);
    else
        quant_rows_kernel<<<cuda_grid(tiles, QR_WARPS), QR_WARPS * 32, 0, cuda_stream(be)>>>(
            q, s, (const bf16 *)x, ldx, M, K, KB, segs);
    CUDA_LAUNCH_CHECK("quant_rows");
    return MT_OK;
}

/* ---- quant_cols_t ------------------------------------------------------------------ */

#define QC_COLS 64

/* The transposed codes of a tile held as bf16 bits in shared memory (rows
 * of LD values): columns k0 .. k0 + nk - 1 (scales scl) of rows i0 .. i0 +
 * n - 1 of a segment of `rows` rows, whose codes q_g [K, rows] start at qg;
 * 256 threads. Each column's codes are contiguous in q_g: with `words`
 * (segment start and length multiples of 4, q 4-byte aligned) a warp
 * writes 4 rows x 32 of one column as 32 4-byte words, else a thread a
 * byte. */
template <int LD>
__device__ __forceinline__ void qc_put_codes_t(uint8_t *qg, int rows, bool words, int i0, int n,
                                               int k0, int nk, const uint16_t (*tile)[LD],
                                               const float *scl, int tid)
{
    if (words) {
        const int r4 = (tid % 32) * 4;
        if (r4 >= n) return;
        for (int c = tid / 32; c < nk; c += 256 / 32) {
            const float sc = scl[c];
            uint32_t w = 0;
#pragma unroll
            for (int j = 0; j < 4; j++)
                w |= (uint32_t)cuda_e4m3(fp8_bf16_lo(tile[r4 + j][c]), sc) << (8 * j);
            *(uint32_t *)(qg + (int64_t)(k0 + c) * rows + i0 + r4) = w;
        }
    } else {
        const int r = tid % MT_QTILE;
        if (r >= n) return;
        for (int c = tid / MT_QTILE; c < nk; c += 256 / MT_QTILE)
            qg[(int64_t)(k0 + c) * rows + i0 + r] = cuda_e4m3(fp8_bf16_lo(tile[r][c]), scl[c]);
    }
}

/* Block (it, kc): 128-row tile `it` of all segments (tiles numbered segment
 * after segment), columns k0 = kc * 64 .. +63. Tile `it` is tile ib = it -
 * tile[g] of segment g, rows r_g + ib * 128 .. + n - 1. Its per-column
 * scales go to s + K * it (= s + K * (tile[g] + ib) as ops.h states), its
 * codes to q_g [K, rows[g]] at q + K r_g, column i0 + i of row k. */
__global__ void __launch_bounds__(256)
quant_cols_t_kernel(uint8_t *__restrict__ q, float *__restrict__ s, const bf16 *__restrict__ x,
                    int ldx, int K, const __grid_constant__ fp8_segs segs)
{
    /* the bf16 bits (exact as floats): 17 KB, so 8 blocks of 256 threads fit
     * an SM (6 with the 33 KB of floats; on an H200 [4096, 7168] took 0.042
     * ms against 0.048, the proxy's quant_cols_t 27.0 ms a step against
     * 29.1); +2: conflict-free column reads */
    __shared__ __align__(16) uint16_t tile[MT_QTILE][QC_COLS + 2];
    __shared__ float scl[QC_COLS];
    const int it = blockIdx.x, k0 = blockIdx.y * QC_COLS;
    const int g = fp8_seg_find(segs.tile, segs.G, it);
    const int r0 = segs.start[g], rows = segs.start[g + 1] - r0;
    const int i0 = (it - segs.tile[g]) * MT_QTILE, n = min(MT_QTILE, rows - i0);
    const int nk = min(QC_COLS, K - k0);
    const int tid = threadIdx.x;

    /* load: full column ranges from a 16-byte-aligned source as 8 bf16 per
     * thread (thread t: columns 8 (t % 8) .. + 7 of rows t / 8 + 32 i, its 4
     * loads issued together), the column maxima of its rows kept in
     * registers and reduced over the warp's lanes, then over the 8 warps
     * (pmax); else 4 rows x 64 columns per pass, one value per thread, and
     * the column maxima read back from the tile. Coalesced along k either
     * way; the maxima (and so scales and codes) are the same either way. */
    const bf16 *xb = x + (int64_t)(r0 + i0) * ldx + k0;
    const int lane = tid & 31, wp = tid >> 5;
    if (nk == QC_COLS && (ldx & 7) == 0 && ((uintptr_t)xb & 15) == 0) {
        __shared__ float pmax[256 / 32][QC_COLS];
        const int c8 = (tid % 8) * 8;
        uint4 w[MT_QTILE / 32];
#pragma unroll
        for (int i = 0; i < MT_QTILE / 32; i++) {
            const int r = tid / 8 + 32 * i;
            w[i] = make_uint4(0, 0, 0, 0);
            if (r < n) w[i] = *(const uint4 *)(xb + (int64_t)r * ldx + c8);
        }
        float a[8];
#pragma unroll
        for (int j = 0; j < 8; j++) a[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < MT_QTILE / 32; i++) {
            const uint32_t u[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
            const int r = tid / 8 + 32 * i;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                *(uint32_t *)&tile[r][c8 + 2 * j] = u[j];
                a[2 * j] = fmaxf(a[2 * j], fabsf(fp8_bf16_lo(u[j])));
                a[2 * j + 1] = fmaxf(a[2 * j + 1], fabsf(fp8_bf16_hi(u[j])));
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            a[j] = fmaxf(a[j], __shfl_xor_sync(CU_FULL, a[j], 8));
            a[j] = fmaxf(a[j], __shfl_xor_sync(CU_FULL, a[j], 16));
        }
        if (lane < 8)
#pragma unroll
            for (int j = 0; j < 8; j++) pmax[wp][c8 + j] = a[j];
        __syncthreads();
        if (tid < QC_COLS) {
            float m = pmax[0][tid];
#pragma unroll
            for (int i = 1; i < 256 / 32; i++) m = fmaxf(m, pmax[i][tid]);
            scl[tid] = cuda_scale_of(m);
        }
    } else {
        const int c = tid % QC_COLS;
        for (int r = tid / QC_COLS; r < MT_QTILE; r += 256 / QC_COLS)
            tile[r][c] = (r < n && c < nk)
                             ? (uint16_t)(__float_as_uint(cuda_ld(xb, (int64_t)r * ldx + c)) >> 16)
                             : 0;
        __syncthreads();
        /* column maxima: warp w owns columns w * 8 .. w * 8 + 7 */
        for (int cc = 0; cc < QC_COLS / 8; cc++) {
            const int c = wp * (QC_COLS / 8) + cc;
            float a = 0.0f;
            for (int r = lane; r < MT_QTILE; r += 32) a = fmaxf(a, fabsf(fp8_bf16_lo(tile[r][c])));
            a = cu_warp_max(a);
            if (lane == 0) scl[c] = cuda_scale_of(a);
        }
    }
    __syncthreads();
    if (tid < nk) s[(int64_t)K * it + k0 + tid] = scl[tid];
    /* codes (expert segments are padded to 128 rows: the word path) */
    qc_put_codes_t<QC_COLS + 2>(q + (int64_t)K * r0, rows,
                                (rows & 3) == 0 && (r0 & 3) == 0 && ((uintptr_t)q & 3) == 0, i0, n,
                                k0, nk, tile, scl, tid);
}

static int cuda_quant_cols_t(mt_backend *be, uint8_t *q, float *s, const void *x, int ldx,
                             const int *rows, int G, int K)
{
    fp8_segs segs;
    int M;
    MT_CHECK(fp8_segs_fill("quant_cols_t", &segs, rows, G, &M));
    CUDA_REQUIRE(K >= 1 && ldx >= K, "quant_cols_t: K=%d ldx=%d", K, ldx);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(q && s && x, "quant_cols_t: NULL pointer");
    const int tiles = segs.tile[G], kcs = mt_ceil_div(K, QC_COLS);
    CUDA_REQUIRE(kcs <= 65535, "quant_cols_t: K=%d too large", K);
    dim3 grid((unsigned)tiles, (unsigned)kcs);
    quant_cols_t_kernel<<<grid, 256, 0, cuda_stream(be)>>>(q, s, (const bf16 *)x, ldx, K, segs);
    CUDA_LAUNCH_CHECK("quant_cols_t");
    return MT_OK;
}

/* ---- quant_rows_cols_t: both from one read -------------------------------------- */

/* Block (it, kb): 128-row tile `it` (as quant_cols_t numbers them) and the
 * 128 columns k0 = 128 kb .. + 127, which are one row tile of quant_rows:
 * the block reads its 32 KB of x once and writes both forms. Full column
 * tiles only (K % 128 == 0, rows 16-byte aligned; the host sends the rest
 * to the two kernels above). Thread t holds 8 columns 8 (t % 16) .. + 7 of
 * rows t / 16 + 16 i (i < 8): a row's 128 values are in one half-warp, so
 * its amax is 4 shuffles, and its 8 codes a thread go out as one 8-byte
 * word; the column maxima are a shuffle across the half-warps and a pass
 * over the 8 warps' partial maxima; the transposed codes are written from
 * the tile in shared memory, as quant_cols_t does. Same amax, scales and
 * codes as quant_rows_kernel and quant_cols_t_kernel: bit-identical. */
__global__ void __launch_bounds__(256)
quant_rows_cols_t_kernel(uint8_t *__restrict__ q, float *__restrict__ s, uint8_t *__restrict__ qt,
                         float *__restrict__ st, const bf16 *__restrict__ x, int ldx, int K,
                         const __grid_constant__ fp8_segs segs)
{
    /* +2: conflict-free column reads (a row is 65 words) */
    __shared__ __align__(16) uint16_t tile[MT_QTILE][MT_QTILE + 2];
    __shared__ float pmax[256 / 32][MT_QTILE];
    __shared__ float scl[MT_QTILE];
    const int it = blockIdx.x, kb = blockIdx.y, k0 = kb * MT_QTILE, KB = K / MT_QTILE;
    const int g = fp8_seg_find(segs.tile, segs.G, it);
    const int r0 = segs.start[g], rows = segs.start[g + 1] - r0;
    const int i0 = (it - segs.tile[g]) * MT_QTILE, n = min(MT_QTILE, rows - i0);
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, c8 = (tid & 15) * 8;
    const bf16 *xb = x + (int64_t)(r0 + i0) * ldx + k0 + c8;
    uint4 w[MT_QTILE / 16];
#pragma unroll
    for (int i = 0; i < MT_QTILE / 16; i++) {
        const int r = (tid >> 4) + 16 * i;
        w[i] = make_uint4(0, 0, 0, 0);
        if (r < n) w[i] = *(const uint4 *)(xb + (int64_t)r * ldx);
    }
    float a[8];
#pragma unroll
    for (int j = 0; j < 8; j++) a[j] = 0.0f;
    float *sg = s + (int64_t)KB * r0 + (int64_t)kb * rows; /* [KB, rows] of segment g */
#pragma unroll
    for (int i = 0; i < MT_QTILE / 16; i++) {
        const int r = (tid >> 4) + 16 * i;
        const uint32_t u[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
        float v[8], amax = 0.0f;
        cu_bf16x8_unpack(w[i], v);
#pragma unroll
        for (int j = 0; j < 4; j++) *(uint32_t *)&tile[r][c8 + 2 * j] = u[j];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            amax = fmaxf(amax, fabsf(v[j]));
            a[j] = fmaxf(a[j], fabsf(v[j]));
        }
        for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(CU_FULL, amax, o));
        if (r >= n) continue; /* rows past the segment's end are the next one's */
        const float sc = cuda_scale_of(amax);
        uint32_t c[2] = {0, 0};
#pragma unroll
        for (int j = 0; j < 8; j++) c[j >> 2] |= (uint32_t)cuda_e4m3(v[j], sc) << (8 * (j & 3));
        *(uint2 *)(q + (int64_t)(r0 + i0 + r) * K + k0 + c8) = make_uint2(c[0], c[1]);
        if ((tid & 15) == 0) sg[i0 + r] = sc;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) a[j] = fmaxf(a[j], __shfl_xor_sync(CU_FULL, a[j], 16));
    if (lane < 16)
#pragma unroll
        for (int j = 0; j < 8; j++) pmax[wp][c8 + j] = a[j];
    __syncthreads();
    if (tid < MT_QTILE) {
        float m = pmax[0][tid];
#pragma unroll
        for (int i = 1; i < 256 / 32; i++) m = fmaxf(m, pmax[i][tid]);
        scl[tid] = cuda_scale_of(m);
        st[(int64_t)K * it + k0 + tid] = scl[tid];
    }
    __syncthreads();
    /* the transposed codes: q_g [K, rows] at qt + K r0, as quant_cols_t */
    qc_put_codes_t<MT_QTILE + 2>(qt + (int64_t)K * r0, rows,
                                 (rows & 3) == 0 && (r0 & 3) == 0 && ((uintptr_t)qt & 3) == 0, i0,
                                 n, k0, MT_QTILE, tile, scl, tid);
}

static int cuda_quant_rows_cols_t(mt_backend *be, uint8_t *q, float *s, uint8_t *qt, float *st,
                                  const void *x, int ldx, const int *rows, int G, int K)
{
    fp8_segs segs;
    int M;
    MT_CHECK(fp8_segs_fill("quant_rows_cols_t", &segs, rows, G, &M));
    CUDA_REQUIRE(K >= 1 && ldx >= K, "quant_rows_cols_t: K=%d ldx=%d", K, ldx);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(q && s && qt && st && x, "quant_rows_cols_t: NULL pointer");
    if (K % MT_QTILE != 0 || ldx % 8 != 0 || (uintptr_t)x % 16 != 0 || (uintptr_t)q % 8 != 0) {
        MT_CHECK(cuda_quant_rows(be, q, s, x, ldx, rows, G, K));
        return cuda_quant_cols_t(be, qt, st, x, ldx, rows, G, K);
    }
    const int KB = K / MT_QTILE;
    CUDA_REQUIRE(KB <= 65535, "quant_rows_cols_t: K=%d too large", K);
    dim3 grid((unsigned)segs.tile[G], (unsigned)KB);
    quant_rows_cols_t_kernel<<<grid, 256, 0, cuda_stream(be)>>>(q, s, qt, st, (const bf16 *)x, ldx,
                                                                K, segs);
    CUDA_LAUNCH_CHECK("quant_rows_cols_t");
    return MT_OK;
}

/* ---- quant_blocks, quant_blocks_sr ----------------------------------------------------- */

/* Block b = nb * KB + kb of w [N, K] f32: thread t reads column t % 128 of
 * rows t / 128, + 2, ... (512 contiguous bytes per row per warp pair).
 * sr: element (n, k) rounds stochastically with mt_hash_uniform(seed, n K + k). */
__global__ void __launch_bounds__(256)
quant_blocks_kernel(uint8_t *__restrict__ q, float *__restrict__ s, const float *__restrict__ w,
                    int N, int K, int KB, int sr, uint64_t seed)
{
    __shared__ float sh[32];
    const int b = blockIdx.x, nb = b / KB, kb = b % KB;
    const int n0 = nb * MT_QTILE, k0 = kb * MT_QTILE;
    const int nn = min(MT_QTILE, N - n0), nk = min(MT_QTILE, K - k0);
    const int c = threadIdx.x % MT_QTILE, r1 = threadIdx.x / MT_QTILE;
    float amax = 0.0f;
    if (c < nk)
        for (int r = r1; r < nn; r += 2)
            amax = fmaxf(amax, fabsf(w[(int64_t)(n0 + r) * K + k0 + c]));
    amax = cu_block_max(amax, sh);
    const float sc = cuda_scale_of(amax);
    if (threadIdx.x == 0) s[b] = sc; /* s[nb * KB + kb] */
    if (c >= nk) return;
    const uint64_t ms = fp8_mix64(seed);
    for (int r = r1; r < nn; r += 2) {
        const int64_t off = (int64_t)(n0 + r) * K + k0 + c;
        const float v = w[off];
        q[off] = sr ? fp8_e4m3_sr_bits(__fdiv_rn(v, sc), fp8_hash_mixed(ms, (uint64_t)off))
                    : cuda_e4m3(v, sc);
    }
}

static int quant_blocks_any(mt_backend *be, const char *op, uint8_t *q, float *s,
                            const float *w, int N, int K, int sr, uint64_t seed)
{
    CUDA_REQUIRE(N >= 1 && K >= 1, "%s: N=%d K=%d", op, N, K);
    CUDA_REQUIRE(q && s && w, "%s: NULL pointer", op);
    const int NB = mt_ceil_div(N, MT_QTILE), KB = mt_ceil_div(K, MT_QTILE);
    quant_blocks_kernel<<<(unsigned)((int64_t)NB * KB), 256, 0, cuda_stream(be)>>>(
        q, s, w, N, K, KB, sr, seed);
    CUDA_LAUNCH_CHECK(op);
    return MT_OK;
}

static int cuda_quant_blocks(mt_backend *be, uint8_t *q, float *s, const float *w, int N, int K)
{
    return quant_blocks_any(be, "quant_blocks", q, s, w, N, K, 0, 0);
}

static int cuda_quant_blocks_sr(mt_backend *be, uint8_t *q, float *s, const float *w, int N,
                                int K, uint64_t seed)
{
    return quant_blocks_any(be, "quant_blocks_sr", q, s, w, N, K, 1, seed);
}

/* ---- transpose_blocks, dequant_blocks ------------------------------------------------- */

/* qt [K, N] = q [N, K]^T through a 32 x 32 shared tile (32 x 8 threads). */
__global__ void __launch_bounds__(256)
transpose_q_kernel(uint8_t *__restrict__ qt, const uint8_t *__restrict__ q, int N, int K)
{
    __shared__ uint8_t t[32][33];
    const int kt = blockIdx.x * 32, nt = blockIdx.y * 32;
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    for (int j = ty; j < 32; j += 8) {
        int n = nt + j, k = kt + tx;
        if (n < N && k < K) t[j][tx] = q[(int64_t)n * K + k];
    }
    __syncthreads();
    for (int j = ty; j < 32; j += 8) {
        int k = kt + j, n = nt + tx;
        if (n < N && k < K) qt[(int64_t)k * N + n] = t[tx][j];
    }
}

/* st [KB, NB] = s [NB, KB]^T */
__global__ void transpose_s_kernel(float *__restrict__ st, const float *__restrict__ s, int NB,
                                   int KB)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= NB * KB) return;
    const int kb = i / NB, nb = i % NB;
    st[i] = s[(int64_t)nb * KB + kb];
}

static int cuda_transpose_blocks(mt_backend *be, uint8_t *qt, float *st, const uint8_t *q,
                                 const float *s, int N, int K)
{
    CUDA_REQUIRE(N >= 1 && K >= 1, "transpose_blocks: N=%d K=%d", N, K);
    CUDA_REQUIRE(qt && st && q && s, "transpose_blocks: NULL pointer");
    const int NB = mt_ceil_div(N, MT_QTILE), KB = mt_ceil_div(K, MT_QTILE);
    CUDA_REQUIRE(mt_ceil_div(N, 32) <= 65535, "transpose_blocks: N=%d too large", N);
    dim3 grid((unsigned)mt_ceil_div(K, 32), (unsigned)mt_ceil_div(N, 32));
    transpose_q_kernel<<<grid, 256, 0, cuda_stream(be)>>>(qt, q, N, K);
    CUDA_LAUNCH_CHECK("transpose_blocks");
    transpose_s_kernel<<<cuda_grid((int64_t)NB * KB, 256), 256, 0, cuda_stream(be)>>>(st, s, NB,
                                                                                       KB);
    CUDA_LAUNCH_CHECK("transpose_blocks");
    return MT_OK;
}

/* w [N, K] = e4m3 value of q times its block's scale (one float product, as
 * the CPU's table lookup times scale). */
__global__ void dequant_blocks_kernel(float *__restrict__ w, const uint8_t *__restrict__ q,
                                      const float *__restrict__ s, int N, int K, int KB)
{
    const int64_t total = (int64_t)N * K;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int n = (int)(i / K), k = (int)(i % K);
        w[i] = cuda_e4m3_val(q[i]) * s[(int64_t)(n / MT_QTILE) * KB + k / MT_QTILE];
    }
}

static int cuda_dequant_blocks(mt_backend *be, float *w, const uint8_t *q, const float *s, int N,
                               int K)
{
    CUDA_REQUIRE(N >= 1 && K >= 1, "dequant_blocks: N=%d K=%d", N, K);
    CUDA_REQUIRE(w && q && s, "dequant_blocks: NULL pointer");
    const int KB = mt_ceil_div(K, MT_QTILE);
    dequant_blocks_kernel<<<cuda_grid((int64_t)N * K, 256), 256, 0, cuda_stream(be)>>>(w, q, s, N,
                                                                                       K, KB);
    CUDA_LAUNCH_CHECK("dequant_blocks");
    return MT_OK;
}

/* ---- act_from_f32_sr ------------------------------------------------------------------ */

/* dst bf16 [n] = src rounded stochastically with the low 16 of the low 32
 * bits of mt_hash_u64(seed, i), as the CPU with round_bf16 does. */
__global__ void act_from_f32_sr_kernel(uint16_t *__restrict__ dst, const float *__restrict__ src,
                                       int64_t n, uint64_t seed)
{
    const uint64_t ms = fp8_mix64(seed);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = cuda_bf16_sr(src[i], (uint32_t)fp8_hash_mixed(ms, (uint64_t)i));
}

static int cuda_act_from_f32_sr(mt_backend *be, void *dst, const float *src, int64_t n,
                                uint64_t seed)
{
    CUDA_REQUIRE(n >= 0, "act_from_f32_sr: n=%lld is negative", (long long)n);
    if (n == 0) return MT_OK;
    CUDA_REQUIRE(dst && src, "act_from_f32_sr: NULL pointer");
    act_from_f32_sr_kernel<<<cuda_grid(n, 256), 256, 0, cuda_stream(be)>>>((uint16_t *)dst, src,
                                                                           n, seed);
    CUDA_LAUNCH_CHECK("act_from_f32_sr");
    return MT_OK;
}

void cuda_install_fp8(mt_backend *be)
{
    be->quant_rows = cuda_quant_rows;
    be->quant_cols_t = cuda_quant_cols_t;
    be->quant_rows_cols_t = cuda_quant_rows_cols_t;
    be->quant_blocks = cuda_quant_blocks;
    be->quant_blocks_sr = cuda_quant_blocks_sr;
    be->transpose_blocks = cuda_transpose_blocks;
    be->dequant_blocks = cuda_dequant_blocks;
    be->act_from_f32_sr = cuda_act_from_f32_sr;
}
