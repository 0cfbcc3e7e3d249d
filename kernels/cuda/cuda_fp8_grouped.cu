/* cuda_fp8_grouped.cu - the routed experts' FP8 GEMM (forward and data
 * gradient: gemm_fp8 with reduce = 0) as one persistent Hopper kernel over
 * every expert segment, instead of a cuBLASLt call per expert; and the
 * same pipeline for the weight gradient (reduce = 1, k_fp8_wgrad below:
 * K = each expert's tokens).
 *
 * Contract (ops.h's gemm_fp8, reduce = 0):
 *   A  [M, K] e4m3, K contiguous (quant_rows output), M = sum of rows[g];
 *      segment g (rows r_g .. r_g + rows[g]) has VEC128 scales [KB, rows[g]]
 *      at sa + KB * r_g: sa_g(i, kb) = sa[KB * r_g + kb * rows[g] + i].
 *   B_g [N, K] e4m3 at B + g * b_stride, K contiguous, BLK128 scales
 *      [NB, KB] at sb + g * sb_stride.
 *   C  [M, N] bf16 or fp32 (ldc): C[r_g + i, n] (+)= sum_kb sa_g(i, kb)
 *      sb_g(n / 128, kb) sum_{k in kb} A[r_g + i, k] B_g[n, k], a bf16 C
 *      rounded once after the addition.
 * Each 128-wide K block is summed by the tensor cores (wgmma, fp32 out) and
 * promoted into an fp32 accumulator in registers with its two scales, as
 * DeepSeek-V3's recipe says (the tensor cores' fp8 sums keep fewer bits
 * than fp32, so no sum runs longer than 128 products).
 *
 * Shape of the kernel: a CTA per SM, looping over 128 x 192 output tiles
 * (tile t: m-tile t / NT over all segments in order, n-tile t % NT, so the
 * CTAs running together share their expert's B_g through L2).
 *  - Warp 0 of warpgroup 0, one thread, is the producer: it moves A's 128 x
 *    128-byte block and B's 192 x 128 into a ring of GF_STAGES shared-memory
 *    slots with TMA (128-byte swizzle, the layout wgmma reads), signalling a
 *    "full" mbarrier per slot with the bytes it expects.
 *  - Warpgroups 1 and 2 each own 64 rows of the tile: per K block they wait
 *    for the slot, issue 4 wgmma m64n192k32, wait for them, free the slot
 *    (the "empty" mbarrier, one arrival per consumer warp) and fold the
 *    block into their accumulator with sa * sb, the scales of a block
 *    GF_AHEAD blocks on already loading. A tile's 192 columns span two of
 *    B's 128-column scale blocks (the first 128 or 64 columns in the
 *    first). At the tile's end they write the accumulator to a staging
 *    tile in shared memory and go on with the next tile. The consumers
 *    hold 2 x 96 fp32 values a thread: setmaxnreg gives their warpgroups
 *    232 registers a thread and the producer's 40.
 *  - C's tile goes through shared memory by TMA where every segment is
 *    whole 128-row tiles (what fp8 routing makes) and C's rows are whole
 *    16-byte pieces (cuda_fp8_grouped_c_tma): one thread of warpgroup 0,
 *    the mover, loads the tile's old values while the consumers compute it
 *    (where C accumulates) and stores their results, which they write in
 *    place in C's type (gf_c_move, gf_c_put). The TMA store clips at the
 *    tensor's ends, not at a segment's, hence the whole tiles.
 *    (RESULTS.md, nineteenth round: against the staging form below, kv_b
 *    492 -> 757-767 TFLOPS, the experts' down projection 912 -> 985, the
 *    accumulating data gradient 734 -> 828-878; the proxy's expert GEMMs
 *    2.5 ms a step less.)
 *  - Otherwise warps 1..3 of warpgroup 0 store a fp32 staging tile to C as
 *    whole rows (16-byte accesses) while the consumers compute the next
 *    one; two more mbarriers hand the staging tile over. Where C
 *    accumulates, the consumers add its old values before staging
 *    (seventeenth round: all loads of a thread in flight at once, one
 *    memory latency a tile; read by the storers, a row at a time, it ran
 *    2.5x slower).
 * TMA fills rows past a tensor's end with zeros; rows of a tile past its
 * segment's end are computed and not stored (with the segment's last
 * row's scales).
 *
 * Why 192 columns (tests/bench/RESULTS.md, sixteenth round): in the tile
 * model DeepGEMM's heuristic uses (shared memory serves 128 bytes a cycle
 * per SM), a 128 x 128 tile's K block moves 80 KB through shared memory
 * (48 KB read by wgmma, 32 KB written by TMA), 640 cycles against 512 of
 * tensor work; 128 x 192 moves 104 KB, 832 cycles against 768. Measured:
 * about 5 % faster on the experts' shapes. Halving B's L2 reads instead
 * (TMA multicast across a cluster of 2) gained nothing.
 *
 * Requirements (cuda_fp8_grouped_fits): Hopper (sm_90a), K % 16 == 0 and
 * 16-byte aligned A and B with b_stride % 16 == 0 (TMA's global strides),
 * N even, ldc % 4 == 0 and C 16-byte aligned (the row stores), at most
 * FP8_SEG_MAX segments. Other shapes run on cuBLASLt (cuda_gemm.cu).
 * Deterministic: fixed tiles, fixed order of the K blocks.
 */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_impl.h"
#include "kernels/cuda/cuda_util.cuh"
#include "base/mt_log.h"

#define GF_BM 128      /* tile rows: 2 consumer warpgroups x 64 */
#define GF_BN 192      /* tile columns: one wgmma n192, spanning two scale blocks of B */
#define GF_BK 128      /* bytes (e4m3 values) per K block: one scale block */
#define GF_THREADS 384 /* the producer's warpgroup + 2 consumer warpgroups */
#define GF_STAGES 3    /* ring slots (40 KB each; a fourth leaves no room for the
                        * fp32 staging tile in 227 KB) */
#define GF_AHEAD 3     /* K blocks the consumers' scale loads run ahead (measured on
                        * an H200: 1 block ahead left the consumers waiting on them,
                        * 3 gained 2-11 % on the experts' shapes) */
#define GF_ACC (GF_BN / 2) /* fp32 values of a 64 x GF_BN wgmma result a thread holds */
#define GF_NJ (GF_BN / 8)  /* their 8-column groups (4 values each: 2 rows x 2 columns) */
#define GF_SLOT_A (GF_BM * GF_BK)
#define GF_SLOT_B (GF_BN * GF_BK)
#define GF_STAGE_LD (GF_BN + 8) /* staging row stride in floats: a warp's 8-row
                                  * fragment writes spread over the banks */
/* shared memory: the ring, the fp32 staging tile, 2 x GF_STAGES + 2
 * barriers, and slack to align the ring to 1024 bytes (the swizzle period) */
#define GF_SMEM                                                                \
    (GF_STAGES * (GF_SLOT_A + GF_SLOT_B) + GF_BM * GF_STAGE_LD * 4 + (2 * GF_STAGES + 2) * 8 + 1024)
/* C's tile through shared memory by TMA instead (the weight-gradient
 * kernel always, the forward one where every segment is whole 128-row
 * tiles): chunks of 128 rows x 128 bytes, TMA's 128-byte-swizzled box */
#define GF_CCHUNK 16384
#define GF_CTILE (GF_BN / 32 * GF_CCHUNK) /* 6 fp32 chunks, or 3 of bf16 in its first half */
#define GF_SMEM_TC                                                                                 \
    (GF_STAGES * (GF_SLOT_A + GF_SLOT_B) + GF_CTILE + (2 * GF_STAGES + 2) * 8 + 1024)

typedef struct gf_params {
    void *C;
    const float *sa, *sb;
    int64_t sb_stride;
    int c_f32, ldc, accumulate;
    int N, KB, NT, tiles;
    fp8_segs segs; /* start[g]: segment g's first row; tile[g]: its first m-tile */
} gf_params;

/* the segment table counts tiles of the quantisers' 128 rows */
static_assert(GF_BM == MT_QTILE, "m-tiles are the segment table's tiles");

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GF_DEVICE 1
#endif

#ifdef GF_DEVICE
__device__ __forceinline__ uint32_t gf_smem(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void gf_bar_init(uint64_t *bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(gf_smem(bar)), "r"(count));
}

__device__ __forceinline__ void gf_bar_expect(uint64_t *bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(gf_smem(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void gf_bar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(gf_smem(bar)) : "memory");
}

/* Waits until the barrier's phase of parity `ph` has completed. */
__device__ __forceinline__ void gf_bar_wait(uint64_t *bar, uint32_t ph)
{
    uint32_t a = gf_smem(bar), done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(a), "r"(ph)
                     : "memory");
    } while (!done);
}

/* TMA: a box of the tensor map at coordinates (x innermost) into shared
 * memory, completing `bar`'s expected bytes. */
__device__ __forceinline__ void gf_tma_2d(void *dst, const CUtensorMap *map, int x, int y,
                                          uint64_t *bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" ::"r"(gf_smem(dst)),
                 "l"((uint64_t)map), "r"(x), "r"(y), "r"(gf_smem(bar))
                 : "memory");
}

__device__ __forceinline__ void gf_tma_3d(void *dst, const CUtensorMap *map, int x, int y, int z,
                                          uint64_t *bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(gf_smem(dst)),
                 "l"((uint64_t)map), "r"(x), "r"(y), "r"(z), "r"(gf_smem(bar))
                 : "memory");
}

/* wgmma shared-memory descriptor of a K-major tile written by TMA with the
 * 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart (the
 * stride byte offset), the leading offset unused for this layout; the tile
 * base is 1024-byte aligned, so stepping K by 32 values adds 32 bytes to the
 * start address and the hardware applies the swizzle. */
__device__ __forceinline__ uint64_t gf_desc(const void *p)
{
    uint64_t a = gf_smem(p);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

/* Keeps the compiler from moving accumulator accesses across wgmma's
 * asynchronous reads and writes of them. */
__device__ __forceinline__ void gf_fence_acc(float (&d)[GF_ACC])
{
#pragma unroll
    for (int i = 0; i < GF_ACC; i++) asm volatile("" : "+f"(d[i])::"memory");
}

static_assert(GF_BN == 192, "gf_wgmma_k32 is written for wgmma n192");
/* D[64 x 192] (+)= A[64 x 32] B[192 x 32]^T, e4m3 in, fp32 out, both operands
 * K-major in shared memory (descriptors below); scale_d 0 starts a new sum. */
__device__ __forceinline__ void gf_wgmma_k32(float (&d)[GF_ACC], uint64_t da, uint64_t db, int scale_d)
{
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(da), "l"(db), "r"(scale_d));
}

/* Tile t's segment g, first row inside the segment, first column. */
__device__ __forceinline__ void gf_tile(const gf_params &p, int t, int &g, int &row0, int &n0)
{
    const int mt = t / p.NT;
    n0 = (t - mt * p.NT) * GF_BN;
    g = fp8_seg_find(p.segs.tile, p.segs.G, mt);
    row0 = (mt - p.segs.tile[g]) * GF_BM;
}

/* Rows of the staging tile to C's tile at Ct (ldc; `rows` x `cols` of it
 * inside C, cols even): warp w of `nw` takes rows w, w + nw, ...; lane l
 * the column groups 4 q .. 4 q + 3 for q = l and l + 32 < 48 (16 bytes of
 * fp32, 8 of bf16). The staging tile already holds C's old values where C
 * accumulates (the consumers added them). */
__device__ __forceinline__ void gf_store_tile(void *Ct, int c_f32, int ldc, int rows, int cols,
                                              const float *staging, int w, int nw, int lane)
{
    rows = min(GF_BM, rows);
    for (int cq = lane; cq < GF_BN / 4; cq += 32) {
        const int n = 4 * cq;
        if (n >= cols) break;
        const bool four = n + 4 <= cols; /* cols even: else 2 columns left */
        for (int rr = w; rr < rows; rr += nw) {
            const float4 v = *(const float4 *)(staging + rr * GF_STAGE_LD + 4 * cq);
            const int64_t ci = (int64_t)rr * ldc + n;
            if (c_f32) {
                float *c = (float *)Ct + ci;
                if (four) *(float4 *)c = v;
                else *(float2 *)c = make_float2(v.x, v.y);
            } else {
                bf16 *c = (bf16 *)Ct + ci;
                const __nv_bfloat162 w0 = __floats2bfloat162_rn(v.x, v.y);
                if (four) {
                    const __nv_bfloat162 w1 = __floats2bfloat162_rn(v.z, v.w);
                    uint2 raw;
                    raw.x = *(const uint32_t *)&w0, raw.y = *(const uint32_t *)&w1;
                    *(uint2 *)c = raw;
                } else {
                    *(__nv_bfloat162 *)c = w0;
                }
            }
        }
    }
}

/* C's tile of grouped tile (g, row0, n0): its first element, rows and
 * columns inside C. */
__device__ __forceinline__ void *gf_c_tile(const gf_params &p, int g, int row0, int n0, int &rows,
                                           int &cols)
{
    rows = p.segs.start[g + 1] - p.segs.start[g] - row0;
    cols = p.N - n0;
    return (char *)p.C + (((int64_t)p.segs.start[g] + row0) * p.ldc + n0) * (p.c_f32 ? 4 : 2);
}

/* A pair of C's elements (float2 for fp32 C, __nv_bfloat162 for bf16):
 * its scalar type, zero, value in fp32, and the pair of a float2 (rounded
 * to nearest even for bf16). */
template <typename T> struct gf_pair;
template <> struct gf_pair<float2> {
    typedef float elem;
    static __device__ __forceinline__ float2 zero() { return make_float2(0.0f, 0.0f); }
    static __device__ __forceinline__ float2 f32(float2 v) { return v; }
    static __device__ __forceinline__ float2 of(float2 v) { return v; }
};
template <> struct gf_pair<__nv_bfloat162> {
    typedef bf16 elem;
    static __device__ __forceinline__ __nv_bfloat162 zero()
    {
        return __floats2bfloat162_rn(0.0f, 0.0f);
    }
    static __device__ __forceinline__ float2 f32(__nv_bfloat162 v) { return __bfloat1622float2(v); }
    static __device__ __forceinline__ __nv_bfloat162 of(float2 v)
    {
        return __floats2bfloat162_rn(v.x, v.y);
    }
};

/* acc (+)= C's old values at this thread's fragment (rows ra and ra + 8 of
 * the tile, columns 8 j + ct + {0, 1}; the tile at Ct, `rows` x `cols` of
 * it inside C), where C accumulates, T being C's
 * element pair (kept as loaded: a bf16 C's 48 pairs take 48 registers).
 * The consumers do it, not the storers: all 48 loads of a thread are
 * issued before the first is used (into registers the wgmma products no
 * longer need), so a tile pays one memory latency; the storers, with one
 * load in flight a lane, paid one a row and fell behind the consumers on
 * short K. The sum is the one the storers made (fp32, then C's rounding). */
template <typename T>
__device__ __forceinline__ void gf_acc_add_c(const void *Ct, int ldc, int rows, int cols,
                                             float (&acc)[GF_ACC], int rt, int ct)
{
    typedef typename gf_pair<T>::elem E;
    T old[2 * GF_NJ];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < GF_NJ; j++) {
            const int r = rt + 8 * h, n = 8 * j + ct;
            old[GF_NJ * h + j] = gf_pair<T>::zero();
            if (r < rows && n < cols)
                old[GF_NJ * h + j] = *(const T *)((const E *)Ct + (int64_t)r * ldc + n);
        }
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < GF_NJ; j++) {
            const float2 o = gf_pair<T>::f32(old[GF_NJ * h + j]);
            acc[4 * j + 2 * h] += o.x;
            acc[4 * j + 2 * h + 1] += o.y;
        }
}

/* Byte offset of C's element (r, c) of the tile in its chunked copy:
 * chunk c / (128 / esize), row r 128 bytes, the 16-byte unit XOR r % 8
 * (TMA's 128-byte swizzle; chunks are 1024-byte aligned). A warp's float2
 * (bf16x2) accesses at rows r..r+7 then hit distinct units: 2 (1)
 * wavefronts for 256 (128) bytes. */
__device__ __forceinline__ uint32_t gf_c_off(int r, int c, int esize)
{
    const int per = 128 / esize, b = (c % per) * esize;
    return (uint32_t)((c / per) * GF_CCHUNK + r * 128 + (((b >> 4) ^ (r & 7)) << 4) + (b & 15));
}

/* TMA store of a box from shared memory (bulk group of this thread). */
__device__ __forceinline__ void gf_tma_store_3d(const CUtensorMap *map, const void *src, int x, int y,
                                                int z)
{
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::
                     "l"((uint64_t)map),
                 "r"(gf_smem(src)), "r"(x), "r"(y), "r"(z)
                 : "memory");
}

/* The mover's part of tile ti (one thread of the producer's warpgroup; C's
 * tile at box coordinates (x0, y0, z) of `map`): once the previous tile's
 * store has read the area, the tile's old values in by TMA where C
 * accumulates (the consumers compute meanwhile), else the area marked
 * free, through c_full; once the consumers have written the results
 * (st_full), their store by TMA, which clips rows and columns past C's
 * ends (columns only to the next 16 bytes: the callers' fits ask whole
 * 16-byte rows). */
__device__ __forceinline__ void gf_c_move(const CUtensorMap *map, uint8_t *ctile, uint64_t *c_full,
                                          uint64_t *st_full, uint32_t ti, int x0, int y0, int z,
                                          int c_f32, int accumulate)
{
    const int nch = c_f32 ? GF_BN / 32 : GF_BN / 64, chw = c_f32 ? 32 : 64;
    if (ti > 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    if (accumulate) {
        gf_bar_expect(c_full, (uint32_t)(nch * GF_CCHUNK));
        for (int ch = 0; ch < nch; ch++)
            gf_tma_3d(ctile + ch * GF_CCHUNK, map, x0 + ch * chw, y0, z, c_full);
    } else {
        gf_bar_arrive(c_full);
    }
    gf_bar_wait(st_full, ti & 1);
    for (int ch = 0; ch < nch; ch++)
        gf_tma_store_3d(map, ctile + ch * GF_CCHUNK, x0 + ch * chw, y0, z);
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

/* A consumer's part: once c_full says the area is free (and holds the old
 * values where C accumulates), its fragment's sums in C's type at their
 * places (each thread its own; T is C's element pair, gf_pair), the sum in
 * fp32 and rounded once for a bf16 C; then st_full for the mover. */
template <typename T>
__device__ __forceinline__ void gf_c_put_as(const float (&acc)[GF_ACC], uint8_t *ctile,
                                            int accumulate, int rt, int ct)
{
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < GF_NJ; j++) {
            T *e = (T *)(ctile + gf_c_off(rt + 8 * h, 8 * j + ct, (int)sizeof(T) / 2));
            float2 v = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            if (accumulate) {
                const float2 o = gf_pair<T>::f32(*e);
                v.x += o.x, v.y += o.y;
            }
            *e = gf_pair<T>::of(v);
        }
}

__device__ __forceinline__ void gf_c_put(const float (&acc)[GF_ACC], uint8_t *ctile,
                                         uint64_t *c_full, uint64_t *st_full, uint32_t ti,
                                         int c_f32, int accumulate, int rt, int ct, int lane)
{
    gf_bar_wait(c_full, ti & 1);
    if (c_f32) gf_c_put_as<float2>(acc, ctile, accumulate, rt, ct);
    else gf_c_put_as<__nv_bfloat162>(acc, ctile, accumulate, rt, ct);
    /* the generic writes before the mover's TMA store reads them */
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) gf_bar_arrive(st_full);
}

/* The barriers both kernels use, initialised by thread 0 before any use:
 * full[s] (the producer's TMA bytes), empty[s] (the 8 consumer warps),
 * st_full (the consumer warps wrote the tile), and with staging st_empty
 * (the 3 storer warps drained it: last = 3), with C's tile by TMA c_full
 * (the mover: last = 1). */
__device__ __forceinline__ void gf_bars_init(uint64_t *full, uint64_t *empty, uint64_t *st_full,
                                             uint64_t *st_empty, int last)
{
    if (threadIdx.x == 0) {
        for (int s = 0; s < GF_STAGES; s++) {
            gf_bar_init(&full[s], 1);
            gf_bar_init(&empty[s], 8);
        }
        gf_bar_init(st_full, 8);
        gf_bar_init(st_empty, last);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

/* A consumer's tile to the staging area once the storers have drained the
 * previous one (ti: the CTA's tile count), handed to them through st_full. */
__device__ __forceinline__ void gf_stage(const float (&acc)[GF_ACC], float *staging,
                                         uint64_t *st_full, uint64_t *st_empty, uint32_t ti,
                                         int rt, int ct, int lane)
{
    gf_bar_wait(st_empty, (ti & 1) ^ 1);
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < GF_NJ; j++)
            *(float2 *)(staging + (rt + 8 * h) * GF_STAGE_LD + 8 * j + ct) =
                make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    __syncwarp();
    if (lane == 0) gf_bar_arrive(st_full);
}

/* Register budgets by warpgroup: the producer's (one TMA thread, three
 * storer warps) needs few; a consumer holds 2 x 96 fp32 values a thread.
 * 40 x 128 + 232 x 256 <= 65536. */
__device__ __forceinline__ void gf_setmaxnreg_dec(void)
{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
}

__device__ __forceinline__ void gf_setmaxnreg_inc(void)
{
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
}

/* acc += d x (sa sb): the columns 8 j + ct + {0, 1} with j < EDGE_J (the
 * tile's edge between B's scale blocks at 64 or 128 columns, over 8) take
 * B's first block's scale, the rest its second's. */
template <int EDGE_J>
__device__ __forceinline__ void gf_promote(float (&acc)[GF_ACC], const float (&d)[GF_ACC], float fa0,
                                           float fb0, float fa1, float fb1)
{
#pragma unroll
    for (int j = 0; j < GF_NJ; j++) {
        const float fa = j < EDGE_J ? fa0 : fa1, fb = j < EDGE_J ? fb0 : fb1;
        acc[4 * j + 0] += d[4 * j + 0] * fa;
        acc[4 * j + 1] += d[4 * j + 1] * fa;
        acc[4 * j + 2] += d[4 * j + 2] * fb;
        acc[4 * j + 3] += d[4 * j + 3] * fb;
    }
}
#endif

/* TC: C's tile through shared memory by TMA (map_c, gf_c_move and
 * gf_c_put; every segment whole 128-row tiles), else through the staging
 * tile and the storer warps (map_c unused). */
template <bool TC>
__global__ void __launch_bounds__(GF_THREADS, 1)
k_fp8_grouped(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
              const __grid_constant__ CUtensorMap map_c, const __grid_constant__ gf_params p)
{
#ifdef GF_DEVICE
    extern __shared__ uint8_t gf_raw[];
    uint8_t *base = gf_raw + ((1024 - (gf_smem(gf_raw) & 1023)) & 1023);
    uint8_t *slot_a = base, *slot_b = base + GF_STAGES * GF_SLOT_A;
    uint8_t *ctile = slot_b + GF_STAGES * GF_SLOT_B; /* 1024-byte aligned */
    float *staging = (float *)ctile;
    uint64_t *full = (uint64_t *)(ctile + (TC ? GF_CTILE : GF_BM * GF_STAGE_LD * 4));
    uint64_t *empty = full + GF_STAGES;
    /* st_empty is c_full with TC */
    uint64_t *st_full = empty + GF_STAGES, *st_empty = st_full + 1;
    const int wg = threadIdx.x / 128, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    gf_bars_init(full, empty, st_full, st_empty, TC ? 1 : 3);

    if (wg == 0) gf_setmaxnreg_dec();
    if (wg == 0 && warp == 0) {
        if (lane != 0) return;
        /* the producer */
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_a) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_b) : "memory");
        uint32_t it = 0;
        for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
            int g, row0, n0;
            gf_tile(p, t, g, row0, n0);
            const int arow = p.segs.start[g] + row0;
            for (int kb = 0; kb < p.KB; kb++, it++) {
                const int s = it % GF_STAGES;
                gf_bar_wait(&empty[s], ((it / GF_STAGES) & 1) ^ 1);
                gf_bar_expect(&full[s], GF_SLOT_A + GF_SLOT_B);
                gf_tma_2d(slot_a + s * GF_SLOT_A, &map_a, kb * GF_BK, arow, &full[s]);
                gf_tma_3d(slot_b + s * GF_SLOT_B, &map_b, kb * GF_BK, n0, g, &full[s]);
            }
        }
        return;
    }
    if (wg == 0 && TC) {
        /* C's mover, one thread */
        if (warp != 1 || lane != 0) return;
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&map_c) : "memory");
        uint32_t ti = 0;
        for (int t = blockIdx.x; t < p.tiles; t += gridDim.x, ti++) {
            int g, row0, n0;
            gf_tile(p, t, g, row0, n0);
            gf_c_move(&map_c, ctile, st_empty, st_full, ti, n0, p.segs.start[g] + row0, 0, p.c_f32,
                      p.accumulate);
        }
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        return;
    }
    if (wg == 0) {
        /* the storers */
        uint32_t ti = 0;
        for (int t = blockIdx.x; t < p.tiles; t += gridDim.x, ti++) {
            int g, row0, n0;
            gf_tile(p, t, g, row0, n0);
            int rows, cols;
            void *Ct = gf_c_tile(p, g, row0, n0, rows, cols);
            gf_bar_wait(st_full, ti & 1);
            gf_store_tile(Ct, p.c_f32, p.ldc, rows, cols, staging, warp - 1, 3, lane);
            __syncwarp();
            if (lane == 0) gf_bar_arrive(st_empty);
        }
        return;
    }

    /* consumers: warpgroup cw owns rows cw * 64 .. + 63 of each tile; this
     * thread's accumulator rows are ra and ra + 8, its columns
     * 8 j + 2 (lane % 4) + {0, 1} for j < GF_NJ (wgmma's fp32 fragment: value
     * 4 j + 2 h + e is row ra + 8 h, column 8 j + 2 (lane % 4) + e). */
    gf_setmaxnreg_inc();
    const int cw = wg - 1, rt = cw * 64 + warp * 16 + (lane >> 2), ct = 2 * (lane & 3);
    /* descriptors of slot 0; slot s is (s * slot bytes) >> 4 further */
    const uint64_t da0 = gf_desc(slot_a + cw * 64 * GF_BK), db0 = gf_desc(slot_b);
    uint32_t s = 0, ph = 0, ti = 0; /* the ring slot and its phase parity */
    for (int t = blockIdx.x; t < p.tiles; t += gridDim.x, ti++) {
        int g, row0, n0;
        gf_tile(p, t, g, row0, n0);
        const int Mg = p.segs.start[g + 1] - p.segs.start[g];
        const int ra = row0 + rt, rb = ra + 8;
        const float *sag = p.sa + (int64_t)p.KB * p.segs.start[g];
        /* scale pointers advanced a block at a time; rows past the
         * segment's end read its last row's scales (finite; those rows
         * are not stored), so no load is predicated */
        const float *pa = sag + min(ra, Mg - 1), *pa8 = sag + min(rb, Mg - 1);
        /* the tile's columns span B's scale blocks n0 / 128 and the next
         * (its first `edge` columns in the first) */
        const int nb = n0 / 128, edge = 128 * (nb + 1) - n0;
        const float *sbg = p.sb + g * p.sb_stride + (int64_t)nb * p.KB;
        /* no second block past N: its columns are not stored */
        const float *pb = sbg, *pb1 = 128 * (nb + 1) < p.N ? sbg + p.KB : sbg;
        float acc[GF_ACC], d[GF_ACC];
#pragma unroll
        for (int i = 0; i < GF_ACC; i++) acc[i] = d[i] = 0.0f;
        /* block kb's scales in registers GF_AHEAD blocks ahead: their load
         * takes longer than a block's tensor work */
        float q_a[GF_AHEAD], q_a8[GF_AHEAD], q_b[GF_AHEAD], q_b1[GF_AHEAD];
#pragma unroll
        for (int i = 0; i < GF_AHEAD; i++) {
            const bool in = i < p.KB;
            q_a[i] = in ? __ldg(pa) : 0.0f;
            q_a8[i] = in ? __ldg(pa8) : 0.0f;
            q_b[i] = in ? __ldg(pb) : 0.0f;
            q_b1[i] = in ? __ldg(pb1) : 0.0f;
            if (in) pa += Mg, pa8 += Mg, pb++, pb1++;
        }
        for (int kb = 0; kb < p.KB; kb++) {
            const float s_a = q_a[0], s_a8 = q_a8[0], s_b = q_b[0], s_b1 = q_b1[0];
#pragma unroll
            for (int i = 0; i + 1 < GF_AHEAD; i++)
                q_a[i] = q_a[i + 1], q_a8[i] = q_a8[i + 1], q_b[i] = q_b[i + 1],
                q_b1[i] = q_b1[i + 1];
            if (kb + GF_AHEAD < p.KB) {
                q_a[GF_AHEAD - 1] = __ldg(pa), q_a8[GF_AHEAD - 1] = __ldg(pa8);
                q_b[GF_AHEAD - 1] = __ldg(pb), q_b1[GF_AHEAD - 1] = __ldg(pb1);
                pa += Mg, pa8 += Mg, pb++, pb1++;
            }
            gf_bar_wait(&full[s], ph);
            const uint64_t da = da0 + ((s * GF_SLOT_A) >> 4), db = db0 + ((s * GF_SLOT_B) >> 4);
            gf_fence_acc(d);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int k = 0; k < GF_BK / 32; k++) gf_wgmma_k32(d, da + 2 * k, db + 2 * k, k);
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            gf_fence_acc(d);
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            gf_fence_acc(d);
            __syncwarp();
            if (lane == 0) gf_bar_arrive(&empty[s]);
            const float fa = s_a * s_b, fb = s_a8 * s_b, fa1 = s_a * s_b1, fb1 = s_a8 * s_b1;
            if (edge == 128) gf_promote<16>(acc, d, fa, fb, fa1, fb1);
            else gf_promote<8>(acc, d, fa, fb, fa1, fb1);
            if (++s == GF_STAGES) s = 0, ph ^= 1;
        }
        if (TC) {
            gf_c_put(acc, ctile, st_empty, st_full, ti, p.c_f32, p.accumulate, rt, ct, lane);
            continue;
        }
        if (p.accumulate) {
            int rows, cols;
            const void *Ct = gf_c_tile(p, g, row0, n0, rows, cols);
            if (p.c_f32) gf_acc_add_c<float2>(Ct, p.ldc, rows, cols, acc, rt, ct);
            else gf_acc_add_c<__nv_bfloat162>(Ct, p.ldc, rows, cols, acc, rt, ct);
        }
        gf_stage(acc, staging, st_full, st_empty, ti, rt, ct, lane);
    }
#endif
}

/* ---- the weight gradient: K = each segment's tokens --------------------- */

/* gemm_fp8 with reduce = 1 on the same pipeline: C_g[N, K] (+)= sum over
 * the segment's 128-token blocks kb of sa_g(n, kb) sb_g(k, kb) sum_t
 * A_g[n, t] B_g[k, t], with A_g = dy_g^T [N, Mg] and B_g = x_g^T [K, Mg]
 * (quant_cols_t outputs, tokens contiguous) and their VEC128 scales
 * [T_g, N] and [T_g, K] (T_g = Mg / 128 blocks). Tiles of 128 rows of N x
 * 192 columns of K, group by group (the CTAs running together share the
 * group's operands through L2); a tile's K loop is its group's T_g blocks.
 * Every segment must be whole 128-token blocks (fp8 routing pads them:
 * layer_moe.c), so each A_g and B_g is a 2-D tensor with a 16-byte row
 * pitch: a tensor map per group, in the launch's parameters. Both
 * operands' scales vary along the tile (rows of A_g, columns of B_g): the
 * producer brings each block's 128 + 192 of them into the slot with A and
 * B (TMA, out-of-range columns zero), and the consumers promote with a
 * scale per row and per column, freeing the slot after that.
 * C's tile goes through shared memory both ways by TMA: a thread of the
 * producer's warpgroup (the mover) loads the tile's old values, where C
 * accumulates, while the consumers compute it, and stores their results
 * (TMA clips rows past N and columns past K); the consumers add and write
 * in place, in C's type. The first form, with the consumers loading C
 * after the tile's last block and the storer warps writing it, ran at
 * 440-510 TFLOPS on the proxy's experts against cuBLASLt's 665-695
 * (H200, tests/bench/RESULTS.md, eighteenth round; Nsight Compute: the
 * tensor pipe 36 % busy, L1 70 %); this one at 564-570 against 673-676
 * (nineteenth round; tensor pipe 44 %). Still slower, so cuda_gemm.cu
 * runs it with MOETRAIN_FP8_GEMM=own only. */
#define GW_MAX 64 /* groups a launch (2 tensor maps each: 16 KB of parameters) */
#define GW_SA (GF_BM * 4)
#define GW_SB (GF_BN * 4)
#define GW_SMEM (GF_SMEM_TC + GF_STAGES * (GW_SA + GW_SB))

typedef struct gw_params {
    CUtensorMap map_a[GW_MAX], map_b[GW_MAX]; /* A_g [N, Mg], B_g [K, Mg] e4m3 */
    CUtensorMap map_sa, map_sb;               /* all scales: [T, N], [T, K] f32 */
    CUtensorMap map_c;                        /* C_g [G][N, K] (ldc, c_stride) */
    void *C;
    int64_t c_stride;
    int c_f32, ldc, accumulate;
    int N, K, MT, NT, tiles;
    int G;
    int tile0[GW_MAX + 1]; /* group g's first block in the scale tensors */
} gw_params;

#ifdef GF_DEVICE
/* Tile t: group g, first row of N, first column of K. */
__device__ __forceinline__ void gw_tile(const gw_params &p, int t, int &g, int &m0, int &n0)
{
    const int per = p.MT * p.NT;
    g = t / per;
    const int r = t - g * per, mt = r / p.NT;
    m0 = mt * GF_BM;
    n0 = (r - mt * p.NT) * GF_BN;
}

/* acc += d x (sa_row sb_col): rows ra, ra + 8 (s_a, s_a8), columns
 * 8 j + ct + {0, 1} with their scales from the slot's sb row. */
__device__ __forceinline__ void gw_promote(float (&acc)[GF_ACC], const float (&d)[GF_ACC], float s_a,
                                           float s_a8, const float *sbs, int ct)
{
#pragma unroll
    for (int j = 0; j < GF_NJ; j++) {
        const float2 b = *(const float2 *)(sbs + 8 * j + ct);
        acc[4 * j + 0] += d[4 * j + 0] * (s_a * b.x);
        acc[4 * j + 1] += d[4 * j + 1] * (s_a * b.y);
        acc[4 * j + 2] += d[4 * j + 2] * (s_a8 * b.x);
        acc[4 * j + 3] += d[4 * j + 3] * (s_a8 * b.y);
    }
}
#endif

__global__ void __launch_bounds__(GF_THREADS, 1) k_fp8_wgrad(const __grid_constant__ gw_params p)
{
#ifdef GF_DEVICE
    extern __shared__ uint8_t gf_raw[];
    uint8_t *base = gf_raw + ((1024 - (gf_smem(gf_raw) & 1023)) & 1023);
    uint8_t *slot_a = base, *slot_b = base + GF_STAGES * GF_SLOT_A;
    uint8_t *ctile = slot_b + GF_STAGES * GF_SLOT_B; /* 1024-byte aligned */
    float *ring_sa = (float *)(ctile + GF_CTILE), *ring_sb = ring_sa + GF_STAGES * GF_BM;
    uint64_t *full = (uint64_t *)(ring_sb + GF_STAGES * GF_BN), *empty = full + GF_STAGES;
    /* c_full: C's tile area is free (the last store has read it) and, where
     * C accumulates, holds the tile's old values; st_full: the consumers
     * wrote the tile's results into it */
    uint64_t *st_full = empty + GF_STAGES, *c_full = st_full + 1;
    const int wg = threadIdx.x / 128, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    gf_bars_init(full, empty, st_full, c_full, 1);

    if (wg == 0) gf_setmaxnreg_dec();
    if (wg == 0 && warp == 0) {
        if (lane != 0) return;
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&p.map_sa) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&p.map_sb) : "memory");
        uint32_t it = 0;
        for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
            int g, m0, n0;
            gw_tile(p, t, g, m0, n0);
            const int T0 = p.tile0[g], T = p.tile0[g + 1] - T0;
            for (int kb = 0; kb < T; kb++, it++) {
                const int s = it % GF_STAGES;
                gf_bar_wait(&empty[s], ((it / GF_STAGES) & 1) ^ 1);
                gf_bar_expect(&full[s], GF_SLOT_A + GF_SLOT_B + GW_SA + GW_SB);
                gf_tma_2d(slot_a + s * GF_SLOT_A, &p.map_a[g], kb * GF_BK, m0, &full[s]);
                gf_tma_2d(slot_b + s * GF_SLOT_B, &p.map_b[g], kb * GF_BK, n0, &full[s]);
                gf_tma_2d(ring_sa + s * GF_BM, &p.map_sa, m0, T0 + kb, &full[s]);
                gf_tma_2d(ring_sb + s * GF_BN, &p.map_sb, n0, T0 + kb, &full[s]);
            }
        }
        return;
    }
    if (wg == 0) {
        /* C's mover, one thread: C's old tile in by TMA while the consumers
         * compute it (where C accumulates), their results out by TMA
         * (rows past N and columns past K are neither read nor written) */
        if (warp != 1 || lane != 0) return;
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&p.map_c) : "memory");
        uint32_t ti = 0;
        for (int t = blockIdx.x; t < p.tiles; t += gridDim.x, ti++) {
            int g, m0, n0;
            gw_tile(p, t, g, m0, n0);
            gf_c_move(&p.map_c, ctile, c_full, st_full, ti, n0, m0, g, p.c_f32, p.accumulate);
        }
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        return;
    }

    gf_setmaxnreg_inc();
    const int cw = wg - 1, rt = cw * 64 + warp * 16 + (lane >> 2), ct = 2 * (lane & 3);
    const uint64_t da0 = gf_desc(slot_a + cw * 64 * GF_BK), db0 = gf_desc(slot_b);
    uint32_t s = 0, ph = 0, ti = 0;
    for (int t = blockIdx.x; t < p.tiles; t += gridDim.x, ti++) {
        int g, m0, n0;
        gw_tile(p, t, g, m0, n0);
        const int T = p.tile0[g + 1] - p.tile0[g];
        float acc[GF_ACC], d[GF_ACC];
#pragma unroll
        for (int i = 0; i < GF_ACC; i++) acc[i] = d[i] = 0.0f;
        for (int kb = 0; kb < T; kb++) {
            gf_bar_wait(&full[s], ph);
            const uint64_t da = da0 + ((s * GF_SLOT_A) >> 4), db = db0 + ((s * GF_SLOT_B) >> 4);
            gf_fence_acc(d);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int k = 0; k < GF_BK / 32; k++) gf_wgmma_k32(d, da + 2 * k, db + 2 * k, k);
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            gf_fence_acc(d);
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            gf_fence_acc(d);
            const float *sas = ring_sa + s * GF_BM;
            gw_promote(acc, d, sas[rt], sas[rt + 8], ring_sb + s * GF_BN, ct);
            __syncwarp();
            if (lane == 0) gf_bar_arrive(&empty[s]); /* the slot's scales read */
            if (++s == GF_STAGES) s = 0, ph ^= 1;
        }
        gf_c_put(acc, ctile, c_full, st_full, ti, p.c_f32, p.accumulate, rt, ct, lane);
    }
#endif
}

/* ---- host ------------------------------------------------------------- */

typedef CUresult (*gf_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                 const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                 const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* cuTensorMapEncodeTiled from the driver, found once per process (a
 * process-wide handle: the driver's entry point does not depend on the
 * backend); NULL if the driver has none. */
static gf_encode_fn gf_encode(void)
{
    static gf_encode_fn fn;
    static int looked;
    if (!looked) {
        void *f = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (gf_encode_fn)f;
        looked = 1;
    }
    return fn;
}

/* C's groups as a 3-D tensor {K, N, G}: G groups of N rows of K values
 * (rows ldc, groups c_stride elements apart), boxes of 128 rows x 128
 * bytes with the 128-byte swizzle (gf_c_off's layout). */
static int gf_map_c(CUtensorMap *m, void *C, int c_f32, int ldc, int64_t c_stride, int N, int K,
                    int G)
{
    const int64_t e = c_f32 ? 4 : 2;
    const cuuint64_t dim[3] = {(cuuint64_t)K, (cuuint64_t)N, (cuuint64_t)G},
                     str[2] = {(cuuint64_t)(ldc * e), (cuuint64_t)(c_stride * e)};
    const cuuint32_t box[3] = {(cuuint32_t)(128 / e), GF_BM, 1}, one[3] = {1, 1, 1};
    const CUresult r = gf_encode()(m, c_f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                            : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                   3, C, dim, str, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                   CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CUDA_REQUIRE(r == CUDA_SUCCESS, "gemm_fp8: tensor map of C [%d, %d, %d] (ldc %d): CUresult %d",
                 G, N, K, ldc, (int)r);
    return MT_OK;
}

int cuda_fp8_grouped_init(void)
{
    if (!gf_encode()) return 0;
    if (cudaFuncSetAttribute(k_fp8_grouped<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             GF_SMEM) != cudaSuccess ||
        cudaFuncSetAttribute(k_fp8_grouped<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             GF_SMEM_TC) != cudaSuccess ||
        cudaFuncSetAttribute(k_fp8_wgrad, cudaFuncAttributeMaxDynamicSharedMemorySize, GW_SMEM) !=
            cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return 1;
}

int cuda_fp8_grouped_fits(const void *C, int c_f32, int ldc, const uint8_t *A, const uint8_t *B,
                          int64_t b_stride, int G, int N, int K)
{
    (void)c_f32;
    return G >= 1 && G <= FP8_SEG_MAX && K > 0 && K % 16 == 0 && N > 0 && N % 2 == 0 &&
           ldc % 4 == 0 && (uintptr_t)A % 16 == 0 && (uintptr_t)B % 16 == 0 &&
           (G == 1 || (b_stride % 16 == 0 && b_stride >= (int64_t)N * K)) &&
           (uintptr_t)C % 16 == 0;
}

int cuda_fp8_grouped_c_tma(const void *C, int c_f32, int ldc, const int *rows, int G, int N)
{
    const int esize = c_f32 ? 4 : 2;
    if ((uintptr_t)C % 16 || (N * esize) % 16 || (ldc * esize) % 16) return 0;
    for (int g = 0; g < G; g++)
        if (rows[g] % GF_BM) return 0;
    return 1;
}

int cuda_fp8_grouped(mt_backend *be, void *C, int c_f32, int ldc, const uint8_t *A,
                     const float *sa, const uint8_t *B, const float *sb, int64_t b_stride,
                     int64_t sb_stride, const int *rows, int G, int N, int K, int accumulate)
{
    cuda_impl *c = cuda_of(be);
    gf_encode_fn enc = gf_encode();
    CUDA_REQUIRE(enc, "gemm_fp8: the driver has no cuTensorMapEncodeTiled");
    gf_params p; /* about 8 KB, copied into the launch's parameters */
    int M;
    MT_CHECK(fp8_segs_fill("gemm_fp8", &p.segs, rows, G, &M));
    p.C = C, p.sa = sa, p.sb = sb, p.sb_stride = sb_stride;
    p.c_f32 = c_f32, p.ldc = ldc, p.accumulate = accumulate;
    p.N = N, p.KB = (K + GF_BK - 1) / GF_BK, p.NT = (N + GF_BN - 1) / GF_BN;
    const int64_t tiles = (int64_t)p.segs.tile[G] * p.NT;
    CUDA_REQUIRE(tiles < INT32_MAX, "gemm_fp8: %lld output tiles is too many", (long long)tiles);
    p.tiles = (int)tiles;
    if (p.tiles == 0) return MT_OK;

    CUtensorMap map_a, map_b;
    const cuuint32_t box_a[2] = {GF_BK, GF_BM}, one[3] = {1, 1, 1};
    const cuuint64_t dim_a[2] = {(cuuint64_t)K, (cuuint64_t)M}, str_a[1] = {(cuuint64_t)K};
    CUresult r = enc(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, (void *)A, dim_a, str_a, box_a, one,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CUDA_REQUIRE(r == CUDA_SUCCESS, "gemm_fp8: tensor map of A [%lld, %d]: CUresult %d",
                 (long long)M, K, (int)r);
    const cuuint32_t box_b[3] = {GF_BK, GF_BN, 1};
    const cuuint64_t dim_b[3] = {(cuuint64_t)K, (cuuint64_t)N, (cuuint64_t)G},
                     str_b[2] = {(cuuint64_t)K, (cuuint64_t)(G > 1 ? b_stride : (int64_t)N * K)};
    r = enc(&map_b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, (void *)B, dim_b, str_b, box_b, one,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CUDA_REQUIRE(r == CUDA_SUCCESS, "gemm_fp8: tensor map of B [%d, %d, %d]: CUresult %d", G, N, K,
                 (int)r);
    CUtensorMap map_c;
    const int tc = cuda_fp8_grouped_c_tma(C, c_f32, ldc, rows, G, N);
    if (tc) MT_CHECK(gf_map_c(&map_c, C, c_f32, ldc, (int64_t)M * ldc, M, N, 1));
    else memset(&map_c, 0, sizeof map_c);
    const int grid = p.tiles < c->sm_count ? p.tiles : c->sm_count;
    if (tc)
        k_fp8_grouped<true><<<grid, GF_THREADS, GF_SMEM_TC, c->stream>>>(map_a, map_b, map_c, p);
    else
        k_fp8_grouped<false><<<grid, GF_THREADS, GF_SMEM, c->stream>>>(map_a, map_b, map_c, p);
    CUDA_LAUNCH_CHECK("gemm_fp8 (grouped kernel)");
    return MT_OK;
}

int cuda_fp8_wgrad_fits(const void *C, int c_f32, int ldc, int64_t c_stride, const uint8_t *A,
                        const float *sa, const uint8_t *B, const float *sb, const int *rows, int G,
                        int N, int K)
{
    /* C's rows and groups 16-byte aligned (TMA's strides), and its rows'
     * K values whole 16-byte pieces: a TMA store clips columns past K only
     * to the next 16 bytes, which would overwrite the padding up to ldc */
    const int esize = c_f32 ? 4 : 2;
    if (G < 1 || N < 4 || K < 4 || N % 4 || (K * esize) % 16 || (ldc * esize) % 16 ||
        (uintptr_t)C % 16 ||
        (uintptr_t)A % 16 || (uintptr_t)B % 16 || (uintptr_t)sa % 16 || (uintptr_t)sb % 16 ||
        (G > 1 && (c_stride * esize) % 16))
        return 0;
    for (int g = 0; g < G; g++)
        if (rows[g] % GF_BK) return 0;
    return 1;
}

/* A 2-D tensor map: dims {inner, outer} of `esize`-byte elements, rows
 * `pitch` bytes apart, box {box_x, box_y}. */
static int gw_map(CUtensorMap *m, const void *base, CUtensorMapDataType type, int64_t inner,
                  int64_t outer, int64_t pitch, int box_x, int box_y, CUtensorMapSwizzle sw)
{
    const cuuint64_t dim[2] = {(cuuint64_t)inner, (cuuint64_t)outer}, str[1] = {(cuuint64_t)pitch};
    const cuuint32_t box[2] = {(cuuint32_t)box_x, (cuuint32_t)box_y}, one[2] = {1, 1};
    const CUresult r = gf_encode()(m, type, 2, (void *)base, dim, str, box, one,
                                   CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
                                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CUDA_REQUIRE(r == CUDA_SUCCESS, "gemm_fp8: tensor map [%lld, %lld] (pitch %lld): CUresult %d",
                 (long long)outer, (long long)inner, (long long)pitch, (int)r);
    return MT_OK;
}

int cuda_fp8_wgrad(mt_backend *be, void *C, int c_f32, int ldc, int64_t c_stride,
                   const uint8_t *A, const float *sa, const uint8_t *B, const float *sb,
                   const int *rows, int G, int N, int K, int accumulate)
{
    cuda_impl *c = cuda_of(be);
    CUDA_REQUIRE(gf_encode(), "gemm_fp8: the driver has no cuTensorMapEncodeTiled");
    int64_t blocks = 0; /* the scale tensors' rows: every group's 128-token blocks */
    for (int g = 0; g < G; g++) blocks += rows[g] / GF_BK;
    CUDA_REQUIRE(blocks < INT32_MAX, "gemm_fp8: %lld token blocks is too many", (long long)blocks);
    /* 17 KB, copied into the launch; tensor maps are 64-byte aligned */
    gw_params *p = (gw_params *)aligned_alloc(64, (sizeof(gw_params) + 63) / 64 * 64);
    CUDA_REQUIRE(p != NULL, "gemm_fp8: out of host memory");
    int rc = MT_OK;
    int64_t r = 0, blk = 0;
    for (int g0 = 0; g0 < G && rc == MT_OK; g0 += GW_MAX) {
        const int n = G - g0 < GW_MAX ? G - g0 : GW_MAX;
        memset(p, 0, sizeof *p);
        rc = gw_map(&p->map_sa, sa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, N, blocks > 0 ? blocks : 1,
                    (int64_t)N * 4, GF_BM, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
        if (rc == MT_OK)
            rc = gw_map(&p->map_sb, sb, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, K, blocks > 0 ? blocks : 1,
                        (int64_t)K * 4, GF_BN, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
        p->tile0[0] = (int)blk;
        for (int g = 0; g < n && rc == MT_OK; g++) {
            const int Mg = rows[g0 + g];
            if (Mg > 0) {
                rc = gw_map(&p->map_a[g], A + (int64_t)N * r, CU_TENSOR_MAP_DATA_TYPE_UINT8, Mg, N,
                            Mg, GF_BK, GF_BM, CU_TENSOR_MAP_SWIZZLE_128B);
                if (rc == MT_OK)
                    rc = gw_map(&p->map_b[g], B + (int64_t)K * r, CU_TENSOR_MAP_DATA_TYPE_UINT8, Mg,
                                K, Mg, GF_BK, GF_BN, CU_TENSOR_MAP_SWIZZLE_128B);
            }
            r += Mg;
            blk += Mg / GF_BK;
            p->tile0[g + 1] = (int)blk;
        }
        if (rc != MT_OK) break;
        p->C = (char *)C + g0 * c_stride * (c_f32 ? 4 : 2);
        rc = gf_map_c(&p->map_c, p->C, c_f32, ldc, n > 1 ? c_stride : (int64_t)N * ldc, N, K, n);
        if (rc != MT_OK) break;
        p->c_stride = c_stride, p->c_f32 = c_f32, p->ldc = ldc, p->accumulate = accumulate;
        p->N = N, p->K = K, p->MT = (N + GF_BM - 1) / GF_BM, p->NT = (K + GF_BN - 1) / GF_BN;
        p->G = n;
        const int64_t tiles = (int64_t)n * p->MT * p->NT;
        if (tiles >= INT32_MAX) {
            rc = MT_ERR(MT_EINVAL, "gemm_fp8: %lld output tiles is too many", (long long)tiles);
            break;
        }
        p->tiles = (int)tiles;
        const int grid = p->tiles < c->sm_count ? p->tiles : c->sm_count;
        k_fp8_wgrad<<<grid, GF_THREADS, GW_SMEM, c->stream>>>(*p);
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            rc = mt_err_at(MT_ECUDA, __FILE__, __LINE__, "gemm_fp8 (wgrad kernel): %s",
                           cudaGetErrorString(e));
    }
    free(p);
    return rc;
}
