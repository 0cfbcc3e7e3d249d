/* cuda_attn.cu - rotary embedding, MLA key/value assembly and causal softmax
 * attention (forward and backward) on the CUDA backend, act = bf16.
 *
 * Attention has two paths with the semantics of kernels/cpu/cpu_attn.c:
 *  - cuDNN (the fast path): the SDPA forward and backward written as composite
 *    operation graphs of the cuDNN backend API, the way cudnn-frontend lowers
 *    its sdpa / sdpa_backward nodes for cuDNN 9.x (matmul, pointwise and
 *    reduction operations with a generated causal mask); cuDNN's runtime
 *    fusion engine compiles each into one flash-attention kernel. One plan is
 *    built per (direction, B, T, H, Dqk, Dv, scale, determinism) and cached.
 *  - own kernels (fallback and cross-check): FlashAttention-2 style tiles of
 *    64 queries x 64 keys in shared memory, fp32 SIMT arithmetic, online
 *    softmax in the forward; the backward recomputes P from lse and computes
 *    dK, dV per key tile (iterating over queries) and dQ per query tile
 *    (iterating over keys), so no sum depends on timing.
 * MOETRAIN_ATTN=own|cudnn forces a path (cuda_attn.h).
 *
 * Layouts (ops.h): q, k [B*T, H, Dqk]; v, o [B*T, H, Dv]; lse [B, H, T] f32,
 * lse[t] = log sum_u exp(scale q_t . k_u) over u <= t (natural log).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_attn.h"
#include "kernels/cuda/cuda_impl.h"
#include "base/mt_log.h"

/* ======================================================================== */
/* rope and MLA key/value assembly                                          */
/* ======================================================================== */

/* One thread per rotated pair (n, h, i), i fastest: pairs of one head are
 * neighbours in memory. Products and sums are separate IEEE operations
 * (__fmul_rn etc. stop FMA contraction), exactly as the CPU computes them. */
static __global__ void rope_kernel(bf16 *x, int64_t pairs, int T, int H, int ld, int hs, int off,
                            int half, const float *cos_t, const float *sin_t, int interleave,
                            int inverse)
{
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < pairs;
         e += (int64_t)gridDim.x * blockDim.x) {
        int i = (int)(e % half);
        int64_t nh = e / half;
        int h = (int)(nh % H);
        int64_t n = nh / H;
        bf16 *p = x + n * ld + (int64_t)h * hs + off;
        int a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + half;
        int64_t ci = (n % T) * half + i;
        float c = cos_t[ci], s = inverse ? -sin_t[ci] : sin_t[ci];
        float x0 = cuda_ld(p, a), x1 = cuda_ld(p, b);
        cuda_st(p, a, __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
        cuda_st(p, b, __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
    }
}

static int cuda_rope(mt_backend *be, void *x, int N, int T, int H, int ld, int hs, int off, int R,
                     const float *cos_t, const float *sin_t, int interleave, int inverse)
{
    CUDA_REQUIRE(N >= 0 && T >= 1 && H >= 1, "rope: N=%d T=%d H=%d", N, T, H);
    CUDA_REQUIRE(R >= 2 && R % 2 == 0, "rope: R=%d must be even and >= 2", R);
    CUDA_REQUIRE(off >= 0 && hs >= 0 && ld >= 1, "rope: ld=%d hs=%d off=%d", ld, hs, off);
    if (N == 0) return MT_OK;
    CUDA_REQUIRE(x && cos_t && sin_t, "rope: NULL pointer");
    int64_t pairs = (int64_t)N * H * (R / 2);
    rope_kernel<<<cuda_grid(pairs, 256), 256, 0, cuda_stream(be)>>>(
        (bf16 *)x, pairs, T, H, ld, hs, off, R / 2, cos_t, sin_t, interleave, inverse);
    CUDA_LAUNCH_CHECK("rope");
    return MT_OK;
}

/* One thread per element of a (n, h) row of k and v together:
 * j < Dn: k <- kvb[:Dn]; j < Dn + R: k <- kpe (shared by the heads);
 * else v <- kvb[Dn:]. Writes are contiguous per row. */
static __global__ void mla_kv_fwd_kernel(bf16 *k, bf16 *v, const bf16 *kvb, const bf16 *kpe,
                                  int ld_kpe, int64_t total, int H, int Dn, int R, int Dv)
{
    const int W = Dn + R + Dv;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        int j = (int)(e % W);
        int64_t nh = e / W, n = nh / H;
        if (j < Dn)
            k[nh * (Dn + R) + j] = kvb[nh * (Dn + Dv) + j];
        else if (j < Dn + R)
            k[nh * (Dn + R) + j] = kpe[n * ld_kpe + (j - Dn)];
        else
            v[nh * Dv + (j - Dn - R)] = kvb[nh * (Dn + Dv) + Dn + (j - Dn - R)];
    }
}

/* dkvb[n, h] = [dk[n, h, :Dn], dv[n, h]], one thread per element. */
static __global__ void mla_kv_bwd_copy_kernel(bf16 *dkvb, const bf16 *dk, const bf16 *dv, int64_t total,
                                       int Dn, int R, int Dv)
{
    const int W = Dn + Dv;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        int j = (int)(e % W);
        int64_t nh = e / W;
        dkvb[e] = j < Dn ? dk[nh * (Dn + R) + j] : dv[nh * Dv + (j - Dn)];
    }
}

/* dkpe[n, d] = sum over heads in order of dk[n, h, Dn + d] (fp32, the CPU's
 * sequence of additions), one thread per (n, d). */
static __global__ void mla_kv_bwd_pe_kernel(bf16 *dkpe, int ld_dkpe, const bf16 *dk, int64_t total,
                                     int H, int Dn, int R)
{
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        int d = (int)(e % R);
        int64_t n = e / R;
        const bf16 *src = dk + n * H * (Dn + R) + Dn + d;
        float sum = 0.0f;
        for (int h = 0; h < H; h++) sum = __fadd_rn(sum, cuda_ld(src, (int64_t)h * (Dn + R)));
        cuda_st(dkpe, n * ld_dkpe + d, sum);
    }
}

static int mla_check(const char *op, int N, int H, int Dn, int R, int Dv)
{
    CUDA_REQUIRE(N >= 0 && H >= 1 && Dn >= 0 && R >= 1 && Dv >= 1,
                 "%s: N=%d H=%d Dn=%d R=%d Dv=%d", op, N, H, Dn, R, Dv);
    return MT_OK;
}

static int cuda_mla_kv_fwd(mt_backend *be, void *k, void *v, const void *kvb, const void *kpe,
                           int ld_kpe, int N, int H, int Dn, int R, int Dv)
{
    MT_CHECK(mla_check("mla_kv_fwd", N, H, Dn, R, Dv));
    CUDA_REQUIRE(ld_kpe >= R, "mla_kv_fwd: ld_kpe=%d < R=%d", ld_kpe, R);
    if (N == 0) return MT_OK;
    CUDA_REQUIRE(k && v && kvb && kpe, "mla_kv_fwd: NULL pointer");
    int64_t total = (int64_t)N * H * (Dn + R + Dv);
    mla_kv_fwd_kernel<<<cuda_grid(total, 256), 256, 0, cuda_stream(be)>>>(
        (bf16 *)k, (bf16 *)v, (const bf16 *)kvb, (const bf16 *)kpe, ld_kpe, total, H, Dn, R, Dv);
    CUDA_LAUNCH_CHECK("mla_kv_fwd");
    return MT_OK;
}

static int cuda_mla_kv_bwd(mt_backend *be, void *dkvb, void *dkpe, int ld_dkpe, const void *dk,
                           const void *dv, int N, int H, int Dn, int R, int Dv)
{
    MT_CHECK(mla_check("mla_kv_bwd", N, H, Dn, R, Dv));
    CUDA_REQUIRE(ld_dkpe >= R, "mla_kv_bwd: ld_dkpe=%d < R=%d", ld_dkpe, R);
    if (N == 0) return MT_OK;
    CUDA_REQUIRE(dkvb && dkpe && dk && dv, "mla_kv_bwd: NULL pointer");
    int64_t total = (int64_t)N * H * (Dn + Dv), pe = (int64_t)N * R;
    mla_kv_bwd_copy_kernel<<<cuda_grid(total, 256), 256, 0, cuda_stream(be)>>>(
        (bf16 *)dkvb, (const bf16 *)dk, (const bf16 *)dv, total, Dn, R, Dv);
    CUDA_LAUNCH_CHECK("mla_kv_bwd (copy)");
    mla_kv_bwd_pe_kernel<<<cuda_grid(pe, 256), 256, 0, cuda_stream(be)>>>(
        (bf16 *)dkpe, ld_dkpe, (const bf16 *)dk, pe, H, Dn, R);
    CUDA_LAUNCH_CHECK("mla_kv_bwd (dkpe)");
    return MT_OK;
}

/* ======================================================================== */
/* own attention kernels                                                    */
/* ======================================================================== */

/* Tiles of 64 queries x 64 keys, 256 threads as 16 x 16: thread (ty, tx)
 * owns rows ty*4 + i (i < 4) of every 64-row tile and either columns
 * tx + 16 j (j < 4) of a 64 x 64 score tile or columns tx*4 + 64 c + jj of a
 * feature tile (c < NC = ceil(D / 64) chunks). The 16 threads of a row group
 * are 16 consecutive lanes, so row reductions are 4 xor-shuffles.
 *
 * Shared tiles hold fp32 rows [64][ld], ld = 64 NC + 4 (columns >= D are
 * zero): ld = 4 mod 32 makes both float4 access patterns conflict-free
 * (8 consecutive rows at one column, or 16 consecutive float4 of one row). */
#define ATT_TILE 64
#define ATT_NT 256
#define ATT_LDP (ATT_TILE + 4) /* score tiles [64][68] */

static inline int att_nc(int D) { return (D + 63) / 64; }
static inline int att_ld(int D) { return 64 * att_nc(D) + 4; }

static __device__ __forceinline__ float f4_at(const float4 &v, int i)
{
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* dst [64][ld] = rows t0.. of one head of a [B*T, H, D] bf16 tensor; src
 * points at (b, t = 0, h), rows are H*D apart. Rows >= nvalid and columns in
 * [D, ld - 4) are zero. */
static __device__ void att_load_rows(float *dst, int ld, const bf16 *src, int t0, int nvalid,
                              int64_t rstride, int D)
{
    const int W = ld - 4;
    for (int e = threadIdx.x; e < ATT_TILE * W; e += ATT_NT) {
        int r = e / W, c = e - r * W;
        float x = 0.0f;
        if (r < nvalid && c < D) x = __bfloat162float(src[(int64_t)(t0 + r) * rstride + c]);
        dst[r * ld + c] = x;
    }
}

/* acc[i][j] += sum_k A[ty*4+i][k] B[tx+16j][k] over k < K4 (a multiple of 4;
 * the zero padding covers it): a tile of A B^T, both row-major in smem. */
static __device__ __forceinline__ void att_mm_abt(float (&acc)[4][4], const float *A, const float *B,
                                           int ld, int K4, int ty, int tx)
{
    for (int k = 0; k < K4; k += 4) {
        float4 a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = *(const float4 *)(A + (ty * 4 + i) * ld + k);
#pragma unroll
        for (int j = 0; j < 4; j++) b[j] = *(const float4 *)(B + (tx + 16 * j) * ld + k);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                acc[i][j] = fmaf(a[i].x, b[j].x, acc[i][j]);
                acc[i][j] = fmaf(a[i].y, b[j].y, acc[i][j]);
                acc[i][j] = fmaf(a[i].z, b[j].z, acc[i][j]);
                acc[i][j] = fmaf(a[i].w, b[j].w, acc[i][j]);
            }
    }
}

/* acc[i][4c+jj] += sum_{k<64} P[ty*4+i][k] F[k][tx*4 + 64c + jj]: a score
 * tile P [64][ATT_LDP] times a feature tile F [64][ldf]. */
template <int NC>
static __device__ __forceinline__ void att_mm_pf(float (&acc)[4][NC * 4], const float *P,
                                          const float *F, int ldf, int ty, int tx)
{
    for (int k = 0; k < ATT_TILE; k += 4) {
        float4 a[4];
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = *(const float4 *)(P + (ty * 4 + i) * ATT_LDP + k);
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
            for (int c = 0; c < NC; c++) {
                float4 f = *(const float4 *)(F + (k + kk) * ldf + tx * 4 + 64 * c);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float p = f4_at(a[i], kk);
                    acc[i][4 * c + 0] = fmaf(p, f.x, acc[i][4 * c + 0]);
                    acc[i][4 * c + 1] = fmaf(p, f.y, acc[i][4 * c + 1]);
                    acc[i][4 * c + 2] = fmaf(p, f.z, acc[i][4 * c + 2]);
                    acc[i][4 * c + 3] = fmaf(p, f.w, acc[i][4 * c + 3]);
                }
            }
    }
}

/* Stores rows ty*4+i (< nvalid) of a feature accumulator times mul as bf16
 * into [B*T, H, D] rows (dst at (b, t0, h)). */
template <int NC>
static __device__ __forceinline__ void att_store_rows(bf16 *dst, int64_t rstride, int nvalid, int D,
                                               const float (&acc)[4][NC * 4],
                                               const float (&mul)[4], int ty, int tx)
{
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = ty * 4 + i;
        if (r >= nvalid) continue;
#pragma unroll
        for (int c = 0; c < NC; c++)
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                int col = tx * 4 + 64 * c + jj;
                if (col < D) cuda_st(dst, (int64_t)r * rstride + col, acc[i][4 * c + jj] * mul[i]);
            }
    }
}

static __device__ __forceinline__ float att_row_max16(float x)
{
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

static __device__ __forceinline__ float att_row_sum16(float x)
{
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* Shape of one launch: grid (ceil(T / 64), B * H). */
typedef struct att_args {
    int T, H, Dqk, Dv;
    float scale;
} att_args;

/* Forward: one block per (query tile, b, h), heaviest (last) tiles first.
 * smem: Qs [64][ldk], Ks [64][ldk], Vs [64][ldv], Ps [64][68]. */
template <int NCV>
static __global__ void __launch_bounds__(ATT_NT, 1)
    att_fwd_kernel(bf16 *o, float *lse, const bf16 *q, const bf16 *k, const bf16 *v, att_args a)
{
    extern __shared__ float4 att_smem4[];
    const int ldk = 64 * ((a.Dqk + 63) / 64) + 4, ldv = 64 * NCV + 4;
    float *Qs = (float *)att_smem4, *Ks = Qs + ATT_TILE * ldk, *Vs = Ks + ATT_TILE * ldk;
    float *Ps = Vs + ATT_TILE * ldv;
    const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
    const int qb = gridDim.x - 1 - blockIdx.x, q0 = qb * ATT_TILE;
    const int b = blockIdx.y / a.H, h = blockIdx.y % a.H;
    const int64_t rk = (int64_t)a.H * a.Dqk, rv = (int64_t)a.H * a.Dv;
    const bf16 *qh = q + ((int64_t)b * a.T * a.H + h) * a.Dqk;
    const bf16 *kh = k + ((int64_t)b * a.T * a.H + h) * a.Dqk;
    const bf16 *vh = v + ((int64_t)b * a.T * a.H + h) * a.Dv;
    const int K4 = (a.Dqk + 3) & ~3;

    att_load_rows(Qs, ldk, qh, q0, min(ATT_TILE, a.T - q0), rk, a.Dqk);
    float m[4], l[4], acc[4][NCV * 4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < NCV * 4; c++) acc[i][c] = 0.0f;
    }
    for (int kb = 0; kb <= qb; kb++) {
        const int u0 = kb * ATT_TILE, nk = min(ATT_TILE, a.T - u0);
        __syncthreads(); /* previous tile's Vs, Ps reads are done */
        att_load_rows(Ks, ldk, kh, u0, nk, rk, a.Dqk);
        att_load_rows(Vs, ldv, vh, u0, nk, rv, a.Dv);
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) s[i][j] = 0.0f;
        att_mm_abt(s, Qs, Ks, ldk, K4, ty, tx);
        /* online softmax: scores of keys u > t (and of padding) are -inf */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int t = q0 + ty * 4 + i;
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int u = u0 + tx + 16 * j;
                s[i][j] = (u <= t && u < a.T) ? s[i][j] * a.scale : -INFINITY;
                mx = fmaxf(mx, s[i][j]);
            }
            mx = att_row_max16(mx);
            const float mnew = fmaxf(m[i], mx);
            const float msub = mnew == -INFINITY ? 0.0f : mnew; /* rows with no key yet */
            const float alpha = expf(m[i] - msub);
            float rs = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float p = expf(s[i][j] - msub);
                Ps[(ty * 4 + i) * ATT_LDP + tx + 16 * j] = p;
                rs += p;
            }
            rs = att_row_sum16(rs);
            l[i] = l[i] * alpha + rs;
            m[i] = mnew;
#pragma unroll
            for (int c = 0; c < NCV * 4; c++) acc[i][c] *= alpha;
        }
        __syncthreads();
        att_mm_pf<NCV>(acc, Ps, Vs, ldv, ty, tx);
    }
    const int nq = min(ATT_TILE, a.T - q0);
    float inv[4];
#pragma unroll
    for (int i = 0; i < 4; i++) inv[i] = 1.0f / l[i];
    att_store_rows<NCV>(o + ((int64_t)b * a.T * a.H + h) * a.Dv + (int64_t)q0 * rv, rv, nq, a.Dv,
                        acc, inv, ty, tx);
    if (tx == 0)
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (ty * 4 + i < nq)
                lse[((int64_t)b * a.H + h) * a.T + q0 + ty * 4 + i] = m[i] + logf(l[i]);
}

/* D[b, h, t] = dO[t, h] . O[t, h] (fp32), one warp per (token, head) row. */
static __global__ void att_bwd_dot_kernel(float *Dsum, const bf16 *dout, const bf16 *o, int64_t rows,
                                   int T, int H, int Dv)
{
    const int lane = threadIdx.x & 31;
    for (int64_t r = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5; r < rows;
         r += ((int64_t)gridDim.x * blockDim.x) >> 5) {
        const bf16 *g = dout + r * Dv, *y = o + r * Dv;
        float s = 0.0f;
        for (int j = lane; j < Dv; j += 32) s = fmaf(cuda_ld(g, j), cuda_ld(y, j), s);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) {
            int64_t n = r / H;
            int h = (int)(r % H);
            Dsum[((n / T) * H + h) * T + n % T] = s;
        }
    }
}

/* dK, dV of one key tile (b, h, keys u0..u0+63): iterate over the query tiles
 * from the diagonal on; in transposed orientation (rows = keys, columns =
 * queries) recompute S^T, P^T = exp(scale S^T - lse), dP^T = V dO^T,
 * dS^T = P^T (dP^T - D); then dV += P^T dO, dK += dS^T Q (scaled at the end).
 * smem: Ks, Qs [64][ldk]; Vs, dOs [64][ldv]; Ps, dSs [64][68]; Ls, Ds [64]. */
template <int NCK, int NCV>
static __global__ void __launch_bounds__(ATT_NT, 1)
    att_bwd_dkdv_kernel(bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q, const bf16 *k,
                        const bf16 *v, const float *lse, const float *Dsum, att_args a)
{
    extern __shared__ float4 att_smem4[];
    const int ldk = 64 * NCK + 4, ldv = 64 * NCV + 4;
    float *Ks = (float *)att_smem4, *Qs = Ks + ATT_TILE * ldk, *Vs = Qs + ATT_TILE * ldk;
    float *dOs = Vs + ATT_TILE * ldv, *Ps = dOs + ATT_TILE * ldv, *dSs = Ps + ATT_TILE * ATT_LDP;
    float *Ls = dSs + ATT_TILE * ATT_LDP, *Ds = Ls + ATT_TILE;
    const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
    const int kb = blockIdx.x, u0 = kb * ATT_TILE, nk = min(ATT_TILE, a.T - u0);
    const int b = blockIdx.y / a.H, h = blockIdx.y % a.H;
    const int64_t rk = (int64_t)a.H * a.Dqk, rv = (int64_t)a.H * a.Dv;
    const int64_t hk = ((int64_t)b * a.T * a.H + h) * a.Dqk, hv = ((int64_t)b * a.T * a.H + h) * a.Dv;
    const float *lse_bh = lse + ((int64_t)b * a.H + h) * a.T, *D_bh = Dsum + ((int64_t)b * a.H + h) * a.T;
    const int K4 = (a.Dqk + 3) & ~3, V4 = (a.Dv + 3) & ~3;
    const int nqb = (a.T + ATT_TILE - 1) / ATT_TILE;

    att_load_rows(Ks, ldk, k + hk, u0, nk, rk, a.Dqk);
    att_load_rows(Vs, ldv, v + hv, u0, nk, rv, a.Dv);
    float gk[4][NCK * 4], gv[4][NCV * 4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
        for (int c = 0; c < NCK * 4; c++) gk[i][c] = 0.0f;
#pragma unroll
        for (int c = 0; c < NCV * 4; c++) gv[i][c] = 0.0f;
    }
    for (int qb = kb; qb < nqb; qb++) {
        const int q0 = qb * ATT_TILE, nq = min(ATT_TILE, a.T - q0);
        __syncthreads(); /* previous tile's reads of Qs, dOs, Ps, dSs are done */
        att_load_rows(Qs, ldk, q + hk, q0, nq, rk, a.Dqk);
        att_load_rows(dOs, ldv, dout + hv, q0, nq, rv, a.Dv);
        if (tid < ATT_TILE) {
            Ls[tid] = tid < nq ? lse_bh[q0 + tid] : 0.0f;
            Ds[tid] = tid < nq ? D_bh[q0 + tid] : 0.0f;
        }
        __syncthreads();
        float st[4][4], dpt[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) st[i][j] = dpt[i][j] = 0.0f;
        att_mm_abt(st, Ks, Qs, ldk, K4, ty, tx);  /* S^T[u][t] */
        att_mm_abt(dpt, Vs, dOs, ldv, V4, ty, tx); /* dP^T[u][t] */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int u = u0 + ty * 4 + i;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int tl = tx + 16 * j, t = q0 + tl;
                float p = (t >= u && t < a.T) ? expf(st[i][j] * a.scale - Ls[tl]) : 0.0f;
                Ps[(ty * 4 + i) * ATT_LDP + tl] = p;
                dSs[(ty * 4 + i) * ATT_LDP + tl] = p * (dpt[i][j] - Ds[tl]);
            }
        }
        __syncthreads();
        att_mm_pf<NCV>(gv, Ps, dOs, ldv, ty, tx);
        att_mm_pf<NCK>(gk, dSs, Qs, ldk, ty, tx);
    }
    float one[4] = {1.0f, 1.0f, 1.0f, 1.0f}, sc[4] = {a.scale, a.scale, a.scale, a.scale};
    att_store_rows<NCV>(dv + hv + (int64_t)u0 * rv, rv, nk, a.Dv, gv, one, ty, tx);
    att_store_rows<NCK>(dk + hk + (int64_t)u0 * rk, rk, nk, a.Dqk, gk, sc, ty, tx);
}

/* dQ of one query tile: iterate over key tiles up to the diagonal;
 * S = Q K^T, P = exp(scale S - lse), dP = dO V^T, dS = P (dP - D),
 * dQ += dS K (scaled at the end). Heaviest tiles first.
 * smem: Qs, Ks [64][ldk]; dOs, Vs [64][ldv]; dSs [64][68]. */
template <int NCK>
static __global__ void __launch_bounds__(ATT_NT, 1)
    att_bwd_dq_kernel(bf16 *dq, const bf16 *dout, const bf16 *q, const bf16 *k, const bf16 *v,
                      const float *lse, const float *Dsum, att_args a)
{
    extern __shared__ float4 att_smem4[];
    const int ldk = 64 * NCK + 4, ldv = 64 * ((a.Dv + 63) / 64) + 4;
    float *Qs = (float *)att_smem4, *Ks = Qs + ATT_TILE * ldk, *dOs = Ks + ATT_TILE * ldk;
    float *Vs = dOs + ATT_TILE * ldv, *dSs = Vs + ATT_TILE * ldv;
    const int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
    const int qb = gridDim.x - 1 - blockIdx.x, q0 = qb * ATT_TILE, nq = min(ATT_TILE, a.T - q0);
    const int b = blockIdx.y / a.H, h = blockIdx.y % a.H;
    const int64_t rk = (int64_t)a.H * a.Dqk, rv = (int64_t)a.H * a.Dv;
    const int64_t hk = ((int64_t)b * a.T * a.H + h) * a.Dqk, hv = ((int64_t)b * a.T * a.H + h) * a.Dv;
    const int64_t bh = ((int64_t)b * a.H + h) * a.T;
    const int K4 = (a.Dqk + 3) & ~3, V4 = (a.Dv + 3) & ~3;

    att_load_rows(Qs, ldk, q + hk, q0, nq, rk, a.Dqk);
    att_load_rows(dOs, ldv, dout + hv, q0, nq, rv, a.Dv);
    float lrow[4], drow[4], gq[4][NCK * 4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int t = q0 + ty * 4 + i;
        lrow[i] = t < a.T ? lse[bh + t] : 0.0f;
        drow[i] = t < a.T ? Dsum[bh + t] : 0.0f;
#pragma unroll
        for (int c = 0; c < NCK * 4; c++) gq[i][c] = 0.0f;
    }
    for (int kb = 0; kb <= qb; kb++) {
        const int u0 = kb * ATT_TILE, nk = min(ATT_TILE, a.T - u0);
        __syncthreads(); /* previous tile's reads of Ks, Vs, dSs are done */
        att_load_rows(Ks, ldk, k + hk, u0, nk, rk, a.Dqk);
        att_load_rows(Vs, ldv, v + hv, u0, nk, rv, a.Dv);
        __syncthreads();
        float s[4][4], dp[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) s[i][j] = dp[i][j] = 0.0f;
        att_mm_abt(s, Qs, Ks, ldk, K4, ty, tx);
        att_mm_abt(dp, dOs, Vs, ldv, V4, ty, tx);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int t = q0 + ty * 4 + i;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int u = u0 + tx + 16 * j;
                float p = (u <= t && t < a.T) ? expf(s[i][j] * a.scale - lrow[i]) : 0.0f;
                dSs[(ty * 4 + i) * ATT_LDP + tx + 16 * j] = p * (dp[i][j] - drow[i]);
            }
        }
        __syncthreads();
        att_mm_pf<NCK>(gq, dSs, Ks, ldk, ty, tx);
    }
    float sc[4] = {a.scale, a.scale, a.scale, a.scale};
    att_store_rows<NCK>(dq + hk + (int64_t)q0 * rk, rk, nq, a.Dqk, gq, sc, ty, tx);
}

/* ---- own-kernel launchers ------------------------------------------------ */

static size_t att_fwd_smem(int Dqk, int Dv)
{
    return sizeof(float) * ATT_TILE * (size_t)(2 * att_ld(Dqk) + att_ld(Dv) + ATT_LDP);
}

static size_t att_dkdv_smem(int Dqk, int Dv)
{
    return sizeof(float) *
           (ATT_TILE * (size_t)(2 * att_ld(Dqk) + 2 * att_ld(Dv) + 2 * ATT_LDP) + 2 * ATT_TILE);
}

static size_t att_dq_smem(int Dqk, int Dv)
{
    return sizeof(float) * ATT_TILE * (size_t)(2 * att_ld(Dqk) + 2 * att_ld(Dv) + ATT_LDP);
}

/* Kernel signatures, one table entry per template instance. */
typedef void (*att_fwd_fn)(bf16 *, float *, const bf16 *, const bf16 *, const bf16 *, att_args);
typedef void (*att_dkdv_fn)(bf16 *, bf16 *, const bf16 *, const bf16 *, const bf16 *, const bf16 *,
                            const float *, const float *, att_args);
typedef void (*att_dq_fn)(bf16 *, const bf16 *, const bf16 *, const bf16 *, const bf16 *,
                          const float *, const float *, att_args);

static const att_fwd_fn att_fwd_tab[4] = {att_fwd_kernel<1>, att_fwd_kernel<2>, att_fwd_kernel<3>,
                                          att_fwd_kernel<4>};
static const att_dq_fn att_dq_tab[4] = {att_bwd_dq_kernel<1>, att_bwd_dq_kernel<2>,
                                        att_bwd_dq_kernel<3>, att_bwd_dq_kernel<4>};
static const att_dkdv_fn att_dkdv_tab[4][4] = {
    {att_bwd_dkdv_kernel<1, 1>, att_bwd_dkdv_kernel<1, 2>, att_bwd_dkdv_kernel<1, 3>, att_bwd_dkdv_kernel<1, 4>},
    {att_bwd_dkdv_kernel<2, 1>, att_bwd_dkdv_kernel<2, 2>, att_bwd_dkdv_kernel<2, 3>, att_bwd_dkdv_kernel<2, 4>},
    {att_bwd_dkdv_kernel<3, 1>, att_bwd_dkdv_kernel<3, 2>, att_bwd_dkdv_kernel<3, 3>, att_bwd_dkdv_kernel<3, 4>},
    {att_bwd_dkdv_kernel<4, 1>, att_bwd_dkdv_kernel<4, 2>, att_bwd_dkdv_kernel<4, 3>, att_bwd_dkdv_kernel<4, 4>}};

/* Lets a kernel use `smem` bytes of dynamic shared memory (above 48 KiB). */
static int att_smem_allow(const void *kern, size_t smem, const char *op)
{
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess)
        return MT_ERR(MT_ECUDA, "%s: cudaFuncSetAttribute(MaxDynamicSharedMemorySize = %zu): %s", op,
                      smem, cudaGetErrorString(e));
    return MT_OK;
}

static int att_smem_optin(mt_backend *be);

static int att_own_check(mt_backend *be, const char *op, int B, int H, int Dqk, int Dv, size_t smem)
{
    CUDA_REQUIRE((int64_t)B * H <= 65535, "%s: B*H=%lld exceeds the grid limit 65535", op,
                 (long long)B * H);
    if (Dqk > 256 || Dv > 256 || smem > (size_t)att_smem_optin(be))
        return MT_ERR(MT_ENOTSUP,
                      "%s: own kernel: Dqk=%d Dv=%d need %zu bytes of shared memory per block "
                      "(device limit %d; dims up to 256)",
                      op, Dqk, Dv, smem, att_smem_optin(be));
    return MT_OK;
}

static int att_own_fwd(mt_backend *be, bf16 *o, float *lse, const bf16 *q, const bf16 *k,
                       const bf16 *v, int B, int T, int H, int Dqk, int Dv, float scale)
{
    const size_t smem = att_fwd_smem(Dqk, Dv);
    MT_CHECK(att_own_check(be, "attn_fwd", B, H, Dqk, Dv, smem));
    att_args a = {T, H, Dqk, Dv, scale};
    dim3 grid((unsigned)((T + ATT_TILE - 1) / ATT_TILE), (unsigned)(B * H));
    att_fwd_fn f = att_fwd_tab[att_nc(Dv) - 1];
    MT_CHECK(att_smem_allow((const void *)f, smem, "attn_fwd (own)"));
    f<<<grid, ATT_NT, smem, cuda_stream(be)>>>(o, lse, q, k, v, a);
    CUDA_LAUNCH_CHECK("attn_fwd (own)");
    return MT_OK;
}

static int att_own_bwd(mt_backend *be, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout,
                       const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *o,
                       const float *lse, int B, int T, int H, int Dqk, int Dv, float scale)
{
    const size_t s_kv = att_dkdv_smem(Dqk, Dv), s_q = att_dq_smem(Dqk, Dv);
    MT_CHECK(att_own_check(be, "attn_bwd", B, H, Dqk, Dv, s_kv > s_q ? s_kv : s_q));
    float *Dsum = (float *)cuda_scratch(be, sizeof(float) * (size_t)B * H * T);
    if (!Dsum) return mt_err_wrap(MT_ENOMEM, "attn_bwd (own): D = dO.O [B, H, T]");
    cudaStream_t st = cuda_stream(be);
    const int64_t rows = (int64_t)B * T * H;
    att_bwd_dot_kernel<<<cuda_grid(rows * 32, 256), 256, 0, st>>>(Dsum, dout, o, rows, T, H, Dv);
    CUDA_LAUNCH_CHECK("attn_bwd (own, dO.O)");

    att_args a = {T, H, Dqk, Dv, scale};
    dim3 grid((unsigned)((T + ATT_TILE - 1) / ATT_TILE), (unsigned)(B * H));
    att_dkdv_fn fkv = att_dkdv_tab[att_nc(Dqk) - 1][att_nc(Dv) - 1];
    MT_CHECK(att_smem_allow((const void *)fkv, s_kv, "attn_bwd (own, dK dV)"));
    fkv<<<grid, ATT_NT, s_kv, st>>>(dk, dv, dout, q, k, v, lse, Dsum, a);
    CUDA_LAUNCH_CHECK("attn_bwd (own, dK dV)");
    att_dq_fn fq = att_dq_tab[att_nc(Dqk) - 1];
    MT_CHECK(att_smem_allow((const void *)fq, s_q, "attn_bwd (own, dQ)"));
    fq<<<grid, ATT_NT, s_q, st>>>(dq, dout, q, k, v, lse, Dsum, a);
    CUDA_LAUNCH_CHECK("attn_bwd (own, dQ)");
    return MT_OK;
}

/* ======================================================================== */
/* cuDNN graphs                                                             */
/* ======================================================================== */

/* The graphs follow cudnn-frontend's CompositeSDPANode / CompositeSDPABackwardNode
 * for bf16 I/O with fp32 intermediates and compute, causal mask "top left"
 * (right bound 0) and no padding mask, dropout, bias or GQA. Tensors are
 * [B, H, T, D] views of our [B*T, H, D] buffers: strides [T*H*D, D, H*D, 1];
 * K enters as K^T ([B, H, Dqk, T], strides 2 and 3 swapped), and the backward
 * takes V^T likewise. Virtual score tensors are [B, H, T, T]; per-row
 * statistics [B, H, T, 1] with strides [H*T, T, 1, 1] (lse's layout). */

enum { /* unique ids of the non-virtual tensors (the variant pack) */
       UID_Q = 1,
       UID_K,
       UID_V,
       UID_O,
       UID_STATS,
       UID_DO,
       UID_DQ,
       UID_DK,
       UID_DV,
       UID_SCALE,   /* by value: attn scale (f32) */
       UID_NEG_INF, /* by value: the masked score (f32 -inf) */
       UID_ONE,     /* by value: 1.0f (the dropout-less softmax_sum scale) */
       UID_SOFTMAX_SUM, /* bwd: sum_j dO O per row, f32 [B, H, T, 1] in scratch */
       UID_DQ_ACCUM,    /* bwd, non-deterministic: f32 dQ accumulator in scratch */
       UID_VIRTUAL = 100 };

#define ATT_MAX_DESCS 160
#define ATT_MAX_OPS 40
#define ATT_CACHE 16

typedef struct attn_key {
    int bwd, B, T, H, Dqk, Dv, det;
    uint32_t scale_bits;
} attn_key;

typedef struct attn_plan {
    attn_key key;
    int state;  /* 0 empty, 1 ready, -1 cuDNN cannot serve this key */
    int warned; /* the fallback warning was logged */
    cudnnBackendDescriptor_t plan;
    cudnnBackendDescriptor_t *descs; /* every descriptor of the graph, destroyed with the plan */
    int n_descs;
    size_t ws_bytes;  /* engine workspace */
    size_t aux_bytes; /* our scratch tensors in front of it (bwd) */
    int64_t engine;   /* engine global index, -1 if unknown */
    float scale, neg_inf, one; /* by-value scalars (host memory read at execute) */
    char why[1024];            /* state -1: the error */
} attn_plan;

struct cuda_attn_cache {
    attn_plan plans[ATT_CACHE];
    int evict; /* next slot to reuse when full */
    cudnnHandle_t handle;
    int own_handle;
    int smem_optin;
    size_t version; /* cudnnGetVersion() of the loaded library */
    char last_path[1200];
};

static cuda_attn_cache *att_cache(mt_backend *be) { return cuda_of(be)->attn; }
static int att_smem_optin(mt_backend *be) { return att_cache(be)->smem_optin; }

/* ---- error reporting ------------------------------------------------------ */

/* Records "attn cudnn: <what>: <status>: <cuDNN's last error text>". */
static int dnn_fail(const char *file, int line, cudnnStatus_t st, const char *what)
{
    char last[512];
    last[0] = '\0';
    cudnnGetLastErrorString(last, sizeof last);
    for (char *c = last; *c; c++) /* one-line messages */
        if (*c == '\n') *c = ' ';
    return mt_err_at(MT_ECUDNN, file, line, "attn cudnn: %s: %s%s%s", what,
                     cudnnGetErrorString(st), last[0] ? ": " : "", last);
}

#define DNN_OK(stmt, ...)                                                                \
    do {                                                                                 \
        cudnnStatus_t st_ = (stmt);                                                      \
        if (st_ != CUDNN_STATUS_SUCCESS) {                                               \
            char w_[320];                                                                \
            snprintf(w_, sizeof w_, __VA_ARGS__);                                        \
            return dnn_fail(__FILE__, __LINE__, st_, w_);                                \
        }                                                                                \
    } while (0)

/* Sets an attribute; a failure names the descriptor (ctx) and the attribute. */
#define DNN_SET(desc, attr, type, n, ptr, ctx)                                           \
    DNN_OK(cudnnBackendSetAttribute((desc), (attr), (type), (n), (ptr)), "%s: set %s", (ctx), #attr)

/* ---- graph builder -------------------------------------------------------- */

typedef cudnnBackendDescriptor_t dnn_desc;

typedef struct dnn_graph {
    cudnnHandle_t h;
    const char *name; /* "fwd" / "bwd" */
    size_t version;
    dnn_desc keep[ATT_MAX_DESCS];
    int n_keep;
    dnn_desc ops[ATT_MAX_OPS];
    int n_ops;
    int64_t next_uid;
} dnn_graph;

static int dnn_create(dnn_graph *g, cudnnBackendDescriptorType_t type, const char *ctx,
                      dnn_desc *out)
{
    if (g->n_keep >= ATT_MAX_DESCS)
        return MT_ERR(MT_EGENERIC, "attn cudnn: %s: descriptor table full", ctx);
    DNN_OK(cudnnBackendCreateDescriptor(type, out), "%s: create descriptor", ctx);
    g->keep[g->n_keep++] = *out;
    return MT_OK;
}

static int dnn_add_op(dnn_graph *g, dnn_desc op, const char *ctx)
{
    if (g->n_ops >= ATT_MAX_OPS) return MT_ERR(MT_EGENERIC, "attn cudnn: %s: op table full", ctx);
    g->ops[g->n_ops++] = op;
    return MT_OK;
}

/* A 4-d tensor; uid < 0 gives a virtual tensor with the next virtual uid. */
static int dnn_tensor(dnn_graph *g, const char *name, int64_t uid, cudnnDataType_t dt,
                      const int64_t dim[4], const int64_t str[4], int by_value, dnn_desc *out)
{
    const bool is_virtual = uid < 0, is_by_value = by_value != 0;
    if (uid < 0) uid = g->next_uid++;
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s graph: tensor %s (uid %lld)", g->name, name, (long long)uid);
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, ctx, out));
    const int64_t align = 16;
    DNN_SET(*out, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, ctx);
    DNN_SET(*out, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim, ctx);
    DNN_SET(*out, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str, ctx);
    DNN_SET(*out, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, ctx);
    DNN_SET(*out, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, ctx);
    if (is_virtual) DNN_SET(*out, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, ctx);
    if (is_by_value)
        DNN_SET(*out, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &is_by_value, ctx);
    DNN_OK(cudnnBackendFinalize(*out), "%s: finalize", ctx);
    return MT_OK;
}

/* Pointwise y = mode(x [, b [, t]]) computed in `prec`; axis >= 0 for GEN_INDEX. */
static int dnn_pointwise(dnn_graph *g, const char *name, cudnnPointwiseMode_t mode,
                         cudnnDataType_t prec, int64_t axis, dnn_desc x, dnn_desc b, dnn_desc t,
                         dnn_desc y)
{
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s graph: pointwise %s", g->name, name);
    dnn_desc pw, op;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, ctx, &pw));
    DNN_SET(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, ctx);
    DNN_SET(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, ctx);
    if (axis >= 0) DNN_SET(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, ctx);
    DNN_OK(cudnnBackendFinalize(pw), "%s: finalize pointwise descriptor", ctx);
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, ctx, &op));
    DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, ctx);
    if (b) DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, ctx);
    if (t) DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, ctx);
    const float one = 1.0f;
    DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, ctx);
    DNN_OK(cudnnBackendFinalize(op), "%s: finalize operation", ctx);
    return dnn_add_op(g, op, ctx);
}

/* Batched c = a b over the two last dims, fp32 compute. */
static int dnn_matmul(dnn_graph *g, const char *name, dnn_desc a, dnn_desc b, dnn_desc c)
{
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s graph: matmul %s", g->name, name);
    dnn_desc mm, op;
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, ctx, &mm));
    DNN_SET(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, ctx);
    DNN_OK(cudnnBackendFinalize(mm), "%s: finalize matmul descriptor", ctx);
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, ctx, &op));
    DNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm, ctx);
    DNN_OK(cudnnBackendFinalize(op), "%s: finalize operation", ctx);
    return dnn_add_op(g, op, ctx);
}

/* y = reduce(x) over the dims where y has extent 1, fp32 compute. */
static int dnn_reduce(dnn_graph *g, const char *name, cudnnReduceTensorOp_t red, dnn_desc x,
                      dnn_desc y)
{
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s graph: reduction %s", g->name, name);
    dnn_desc rd, op;
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, ctx, &rd));
    DNN_SET(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, ctx);
    DNN_SET(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red, ctx);
    if (g->version >= 91100) { /* the attribute exists from 9.11; frontend sets it false */
        const bool det = false;
        DNN_SET(rd, CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1, &det, ctx);
    }
    DNN_OK(cudnnBackendFinalize(rd), "%s: finalize reduction descriptor", ctx);
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, ctx, &op));
    DNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, ctx);
    DNN_OK(cudnnBackendFinalize(op), "%s: finalize operation", ctx);
    return dnn_add_op(g, op, ctx);
}

/* y = x with other dims/strides (a transpose view), no data movement. */
static int dnn_reshape(dnn_graph *g, const char *name, dnn_desc x, dnn_desc y)
{
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s graph: reshape %s", g->name, name);
    dnn_desc op;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, ctx, &op));
    DNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, ctx);
    DNN_OK(cudnnBackendFinalize(op), "%s: finalize operation", ctx);
    return dnn_add_op(g, op, ctx);
}

/* ---- shapes ---------------------------------------------------------------- */

/* [B, H, T, D] view of a [B*T, H, D] buffer; transposed: [B, H, D, T]. */
static void att_view(int64_t dim[4], int64_t str[4], const attn_key *k, int D, int transposed)
{
    const int64_t B = k->B, H = k->H, T = k->T;
    dim[0] = B, dim[1] = H, dim[2] = T, dim[3] = D;
    str[0] = T * H * D, str[1] = D, str[2] = H * D, str[3] = 1;
    if (transposed) {
        int64_t x = dim[2];
        dim[2] = dim[3], dim[3] = x;
        x = str[2];
        str[2] = str[3], str[3] = x;
    }
}

typedef struct att_shapes {
    int64_t s_dim[4], s_str[4];   /* scores [B, H, T, T] */
    int64_t st_dim[4], st_str[4]; /* transposed scores [B, H, T(k), T(q)] */
    int64_t r_dim[4], r_str[4];   /* row statistics [B, H, T, 1] */
    int64_t one[4];               /* scalars {1, 1, 1, 1} */
} att_shapes;

static void att_shapes_of(att_shapes *s, const attn_key *k)
{
    const int64_t B = k->B, H = k->H, T = k->T;
    const int64_t sd[4] = {B, H, T, T}, ss[4] = {H * T * T, T * T, T, 1};
    const int64_t ts[4] = {H * T * T, T * T, 1, T};
    const int64_t rd[4] = {B, H, T, 1}, rs[4] = {H * T, T, 1, 1};
    for (int i = 0; i < 4; i++) {
        s->s_dim[i] = s->st_dim[i] = sd[i];
        s->s_str[i] = ss[i];
        s->st_str[i] = ts[i];
        s->r_dim[i] = rd[i];
        s->r_str[i] = rs[i];
        s->one[i] = 1;
    }
}

/* Causal mask as the frontend's top-left diagonal band (right bound 0):
 * keep[t][u] = row index >= column index, masked scores become -inf. */
static int att_graph_causal(dnn_graph *g, const att_shapes *s, dnn_desc x, dnn_desc neg_inf,
                            dnn_desc *y)
{
    dnn_desc row, col, keep;
    MT_CHECK(dnn_tensor(g, "row_index", -1, CUDNN_DATA_INT32, s->s_dim, s->s_str, 0, &row));
    MT_CHECK(dnn_tensor(g, "col_index", -1, CUDNN_DATA_INT32, s->s_dim, s->s_str, 0, &col));
    MT_CHECK(dnn_tensor(g, "causal_keep", -1, CUDNN_DATA_BOOLEAN, s->s_dim, s->s_str, 0, &keep));
    MT_CHECK(dnn_tensor(g, "s_masked", -1, CUDNN_DATA_FLOAT, s->s_dim, s->s_str, 0, y));
    MT_CHECK(dnn_pointwise(g, "gen_row_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, 2, x,
                           NULL, NULL, row));
    MT_CHECK(dnn_pointwise(g, "gen_col_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, 3, x,
                           NULL, NULL, col));
    MT_CHECK(dnn_pointwise(g, "row_ge_col", CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, -1, row,
                           col, NULL, keep));
    return dnn_pointwise(g, "binary_select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, -1,
                         x, neg_inf, keep, *y);
}

/* Forward: S = Q K^T; S *= scale; causal mask; M = max S; E = exp(S - M);
 * Z = sum E; Stats = M + log Z (the lse output); P = E / Z (bf16); O = P V. */
static int att_graph_fwd(dnn_graph *g, const attn_key *k)
{
    att_shapes s;
    att_shapes_of(&s, k);
    int64_t qd[4], qs[4], ktd[4], kts[4], vd[4], vs[4];
    att_view(qd, qs, k, k->Dqk, 0);
    att_view(ktd, kts, k, k->Dqk, 1);
    att_view(vd, vs, k, k->Dv, 0);
    dnn_desc Q, KT, V, O, Stats, Scale, NegInf;
    MT_CHECK(dnn_tensor(g, "Q", UID_Q, CUDNN_DATA_BFLOAT16, qd, qs, 0, &Q));
    MT_CHECK(dnn_tensor(g, "K^T", UID_K, CUDNN_DATA_BFLOAT16, ktd, kts, 0, &KT));
    MT_CHECK(dnn_tensor(g, "V", UID_V, CUDNN_DATA_BFLOAT16, vd, vs, 0, &V));
    MT_CHECK(dnn_tensor(g, "O", UID_O, CUDNN_DATA_BFLOAT16, vd, vs, 0, &O));
    MT_CHECK(dnn_tensor(g, "Stats", UID_STATS, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &Stats));
    MT_CHECK(dnn_tensor(g, "attn_scale", UID_SCALE, CUDNN_DATA_FLOAT, s.one, s.one, 1, &Scale));
    MT_CHECK(dnn_tensor(g, "neg_inf", UID_NEG_INF, CUDNN_DATA_FLOAT, s.one, s.one, 1, &NegInf));

    dnn_desc S, Ss, Sm, M, Sub, E, Z, LogZ, P;
    MT_CHECK(dnn_tensor(g, "s", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &S));
    MT_CHECK(dnn_tensor(g, "s_scaled", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &Ss));
    MT_CHECK(dnn_matmul(g, "bmm1 Q K^T", Q, KT, S));
    MT_CHECK(dnn_pointwise(g, "attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, S, Scale,
                           NULL, Ss));
    MT_CHECK(att_graph_causal(g, &s, Ss, NegInf, &Sm));
    MT_CHECK(dnn_tensor(g, "max", -1, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &M));
    MT_CHECK(dnn_tensor(g, "sub_max", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &Sub));
    MT_CHECK(dnn_tensor(g, "exp", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &E));
    MT_CHECK(dnn_tensor(g, "sum_exp", -1, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &Z));
    MT_CHECK(dnn_tensor(g, "log_sum", -1, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &LogZ));
    MT_CHECK(dnn_tensor(g, "p", -1, CUDNN_DATA_BFLOAT16, s.s_dim, s.s_str, 0, &P));
    MT_CHECK(dnn_reduce(g, "max", CUDNN_REDUCE_TENSOR_MAX, Sm, M));
    MT_CHECK(dnn_pointwise(g, "sub", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, -1, Sm, M, NULL, Sub));
    MT_CHECK(dnn_pointwise(g, "exp", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, -1, Sub, NULL, NULL, E));
    MT_CHECK(dnn_reduce(g, "sum", CUDNN_REDUCE_TENSOR_ADD, E, Z));
    MT_CHECK(dnn_pointwise(g, "log", CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, -1, Z, NULL, NULL, LogZ));
    MT_CHECK(dnn_pointwise(g, "stats", CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, -1, M, LogZ, NULL,
                           Stats));
    MT_CHECK(dnn_pointwise(g, "div", CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, -1, E, Z, NULL, P));
    return dnn_matmul(g, "bmm2 P V", P, V, O);
}

/* Backward (frontend order): softmax_sum = (sum_j dO O) * 1 (stored);
 * S = Q K^T * scale - Stats, causal mask, P = exp(S); dV = P^T dO;
 * dP = dO V^T; dS = (dP - softmax_sum) P * scale; dK = dS^T Q; dQ = dS K
 * (directly in bf16 when deterministic; else into an fp32 accumulator and an
 * identity to dQ). */
static int att_graph_bwd(dnn_graph *g, const attn_key *k)
{
    att_shapes s;
    att_shapes_of(&s, k);
    int64_t qd[4], qs[4], ktd[4], kts[4], vd[4], vs[4], vtd[4], vts[4];
    att_view(qd, qs, k, k->Dqk, 0);
    att_view(ktd, kts, k, k->Dqk, 1);
    att_view(vd, vs, k, k->Dv, 0);
    att_view(vtd, vts, k, k->Dv, 1);
    dnn_desc Q, KT, VT, O, dO, Stats, dQ, dK, dV, Scale, NegInf, One, SoftSum;
    MT_CHECK(dnn_tensor(g, "Q", UID_Q, CUDNN_DATA_BFLOAT16, qd, qs, 0, &Q));
    MT_CHECK(dnn_tensor(g, "K^T", UID_K, CUDNN_DATA_BFLOAT16, ktd, kts, 0, &KT));
    MT_CHECK(dnn_tensor(g, "V^T", UID_V, CUDNN_DATA_BFLOAT16, vtd, vts, 0, &VT));
    MT_CHECK(dnn_tensor(g, "O", UID_O, CUDNN_DATA_BFLOAT16, vd, vs, 0, &O));
    MT_CHECK(dnn_tensor(g, "dO", UID_DO, CUDNN_DATA_BFLOAT16, vd, vs, 0, &dO));
    MT_CHECK(dnn_tensor(g, "Stats", UID_STATS, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &Stats));
    MT_CHECK(dnn_tensor(g, "dQ", UID_DQ, CUDNN_DATA_BFLOAT16, qd, qs, 0, &dQ));
    MT_CHECK(dnn_tensor(g, "dK", UID_DK, CUDNN_DATA_BFLOAT16, qd, qs, 0, &dK));
    MT_CHECK(dnn_tensor(g, "dV", UID_DV, CUDNN_DATA_BFLOAT16, vd, vs, 0, &dV));
    MT_CHECK(dnn_tensor(g, "attn_scale", UID_SCALE, CUDNN_DATA_FLOAT, s.one, s.one, 1, &Scale));
    MT_CHECK(dnn_tensor(g, "neg_inf", UID_NEG_INF, CUDNN_DATA_FLOAT, s.one, s.one, 1, &NegInf));
    MT_CHECK(dnn_tensor(g, "one", UID_ONE, CUDNN_DATA_FLOAT, s.one, s.one, 1, &One));
    MT_CHECK(dnn_tensor(g, "softmax_sum", UID_SOFTMAX_SUM, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0,
                        &SoftSum));

    /* softmax_sum = rowsum(dO * O) * 1 */
    dnn_desc dOO, dOOsum;
    MT_CHECK(dnn_tensor(g, "dO_O", -1, CUDNN_DATA_FLOAT, vd, vs, 0, &dOO));
    MT_CHECK(dnn_tensor(g, "dO_O_sum", -1, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &dOOsum));
    MT_CHECK(dnn_pointwise(g, "mul_dO_O", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, dO, O, NULL,
                           dOO));
    MT_CHECK(dnn_reduce(g, "reduce_dO_O", CUDNN_REDUCE_TENSOR_ADD, dOO, dOOsum));
    MT_CHECK(dnn_pointwise(g, "scale_dropout_inv", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1,
                           dOOsum, One, NULL, SoftSum));

    /* P = exp(mask(scale Q K^T - Stats)) */
    dnn_desc S, Ss, Sd, Sm, P, PT;
    MT_CHECK(dnn_tensor(g, "s", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &S));
    MT_CHECK(dnn_tensor(g, "s_scaled", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &Ss));
    MT_CHECK(dnn_tensor(g, "s_sub_stats", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &Sd));
    MT_CHECK(dnn_matmul(g, "matmul_Q_KT", Q, KT, S));
    MT_CHECK(dnn_pointwise(g, "mul_s_attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, S,
                           Scale, NULL, Ss));
    MT_CHECK(dnn_pointwise(g, "sub_s_m", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, -1, Ss, Stats,
                           NULL, Sd));
    MT_CHECK(att_graph_causal(g, &s, Sd, NegInf, &Sm));
    MT_CHECK(dnn_tensor(g, "p", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &P));
    MT_CHECK(dnn_pointwise(g, "exp_s", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, -1, Sm, NULL, NULL, P));

    /* dV = P^T dO */
    MT_CHECK(dnn_tensor(g, "p^T", -1, CUDNN_DATA_BFLOAT16, s.st_dim, s.st_str, 0, &PT));
    MT_CHECK(dnn_reshape(g, "reshape_p", P, PT));
    MT_CHECK(dnn_matmul(g, "matmul_pT_dO", PT, dO, dV));

    /* dS = (dO V^T - softmax_sum) P scale */
    dnn_desc dP, dPs, dPm, dS, dST;
    MT_CHECK(dnn_tensor(g, "dp", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &dP));
    MT_CHECK(dnn_tensor(g, "dp_sub", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &dPs));
    MT_CHECK(dnn_tensor(g, "dp_mul_p", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &dPm));
    MT_CHECK(dnn_tensor(g, "ds", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &dS));
    MT_CHECK(dnn_matmul(g, "matmul_dO_VT", dO, VT, dP));
    MT_CHECK(dnn_pointwise(g, "sub_dP_softmax_sum", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, -1, dP,
                           SoftSum, NULL, dPs));
    MT_CHECK(dnn_pointwise(g, "mul_dP_exp_s", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, dPs, P,
                           NULL, dPm));
    MT_CHECK(dnn_pointwise(g, "mul_dS_attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, dPm,
                           Scale, NULL, dS));

    /* dK = dS^T Q */
    MT_CHECK(dnn_tensor(g, "ds^T", -1, CUDNN_DATA_BFLOAT16, s.st_dim, s.st_str, 0, &dST));
    MT_CHECK(dnn_reshape(g, "reshape_dS", dS, dST));
    MT_CHECK(dnn_matmul(g, "matmul_dST_Q", dST, Q, dK));

    /* dQ = dS K (K as a view of K^T) */
    dnn_desc Kv;
    MT_CHECK(dnn_tensor(g, "k", -1, CUDNN_DATA_BFLOAT16, qd, qs, 0, &Kv));
    MT_CHECK(dnn_reshape(g, "reshape_k", KT, Kv));
    if (k->det) return dnn_matmul(g, "matmul_dS_K", dS, Kv, dQ);
    const int64_t B = k->B, H = k->H, T = k->T, D = k->Dqk;
    const int64_t ad[4] = {B, H, T, D}, as[4] = {H * T * D, T * D, D, 1};
    dnn_desc dQacc;
    MT_CHECK(dnn_tensor(g, "dQ_accum", UID_DQ_ACCUM, CUDNN_DATA_FLOAT, ad, as, 0, &dQacc));
    MT_CHECK(dnn_matmul(g, "matmul_dS_K", dS, Kv, dQacc));
    return dnn_pointwise(g, "identity_dQ", CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, -1, dQacc,
                         NULL, NULL, dQ);
}

/* ---- plans ------------------------------------------------------------------- */

static size_t att_align(size_t x) { return (x + 255) & ~(size_t)255; }

/* Scratch tensors the backward graph keeps outside the engine workspace. */
static size_t att_aux_bytes(const attn_key *k)
{
    if (!k->bwd) return 0;
    size_t rows = (size_t)k->B * k->H * k->T;
    return att_align(rows * sizeof(float)) + (k->det ? 0 : att_align(rows * k->Dqk * sizeof(float)));
}

static void att_plan_release(attn_plan *p)
{
    for (int i = p->n_descs - 1; i >= 0; i--) cudnnBackendDestroyDescriptor(p->descs[i]);
    free(p->descs);
    memset(p, 0, sizeof *p);
}

/* The engine's global index of a config (for the log), -1 if unavailable. */
static int64_t att_engine_index(dnn_desc cfg)
{
    dnn_desc eng = NULL;
    int64_t n = 0, idx = -1;
    if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &eng) != CUDNN_STATUS_SUCCESS)
        return -1;
    if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                 &n, &eng) != CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                                 &idx) != CUDNN_STATUS_SUCCESS)
        idx = -1;
    cudnnBackendDestroyDescriptor(eng);
    return idx;
}

/* Operation graph -> heuristics (mode A) -> the first engine config whose
 * execution plan finalizes. */
static int att_graph_plan(dnn_graph *g, attn_plan *p)
{
    char ctx[64];
    snprintf(ctx, sizeof ctx, "%s graph: operation graph", g->name);
    dnn_desc opg, heur, plan;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, ctx, &opg));
    DNN_SET(opg, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &g->h, ctx);
    DNN_SET(opg, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g->n_ops, g->ops, ctx);
    DNN_OK(cudnnBackendFinalize(opg), "%s: finalize the graph of %d operations", ctx, g->n_ops);

    snprintf(ctx, sizeof ctx, "%s graph: heuristics", g->name);
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, ctx, &heur));
    DNN_SET(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &opg, ctx);
    DNN_SET(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, ctx);
    DNN_OK(cudnnBackendFinalize(heur), "%s: finalize", ctx);
    int64_t count = 0;
    DNN_OK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, NULL),
           "%s: count of CUDNN_ATTR_ENGINEHEUR_RESULTS", ctx);
    if (count <= 0)
        return MT_ERR(MT_ECUDNN, "attn cudnn: %s: heuristics returned no engine config", ctx);
    if (count > 32) count = 32;
    dnn_desc cfg[32];
    int64_t made = 0;
    for (; made < count; made++)
        if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfg[made]) !=
            CUDNN_STATUS_SUCCESS)
            break;
    int64_t got = 0;
    cudnnStatus_t st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, made, &got, cfg);
    int rc = MT_OK, chosen = -1;
    char first_err[400] = "";
    if (st != CUDNN_STATUS_SUCCESS) {
        rc = dnn_fail(__FILE__, __LINE__, st, "get CUDNN_ATTR_ENGINEHEUR_RESULTS");
        got = 0;
    } else if (got == 0) { /* the configs failed cuDNN's own support checks: keep its reasons */
        char last[360] = "";
        cudnnGetLastErrorString(last, sizeof last);
        for (char *c = last; *c; c++)
            if (*c == '\n') *c = ' ';
        snprintf(first_err, sizeof first_err, "no viable config: %s", last);
    }
    for (int64_t i = 0; i < got && chosen < 0; i++) {
        if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan) !=
            CUDNN_STATUS_SUCCESS)
            break;
        st = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &g->h);
        if (st == CUDNN_STATUS_SUCCESS)
            st = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                          CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg[i]);
        if (st == CUDNN_STATUS_SUCCESS) st = cudnnBackendFinalize(plan);
        int64_t ws = 0, nws = 0;
        if (st == CUDNN_STATUS_SUCCESS)
            st = cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                          CUDNN_TYPE_INT64, 1, &nws, &ws);
        if (st == CUDNN_STATUS_SUCCESS) {
            chosen = (int)i;
            p->plan = plan;
            p->ws_bytes = (size_t)ws;
            p->engine = att_engine_index(cfg[i]);
            break;
        }
        if (!first_err[0]) {
            char last[320] = "";
            cudnnGetLastErrorString(last, sizeof last);
            for (char *c = last; *c; c++)
                if (*c == '\n') *c = ' ';
            snprintf(first_err, sizeof first_err, "config %lld: %s: %s", (long long)i,
                     cudnnGetErrorString(st), last);
        }
        cudnnBackendDestroyDescriptor(plan);
    }
    for (int64_t i = 0; i < made; i++) /* keep the chosen config alive with the plan */
        if (i == chosen) {
            if (g->n_keep < ATT_MAX_DESCS) g->keep[g->n_keep++] = cfg[i];
            else cudnnBackendDestroyDescriptor(cfg[i]);
        } else {
            cudnnBackendDestroyDescriptor(cfg[i]);
        }
    if (chosen < 0) {
        if (rc < 0) return rc;
        return MT_ERR(MT_ECUDNN, "attn cudnn: %s graph: none of %lld engine configs (%lld from "
                      "heuristics mode A) finalizes; first failure: %s", g->name, (long long)got,
                      (long long)count, first_err);
    }
    if (g->n_keep < ATT_MAX_DESCS) g->keep[g->n_keep++] = plan;
    return MT_OK;
}

/* Shapes the graphs (as built here) cannot take; NULL if fine. */
static const char *att_dnn_unsupported(const attn_key *k, size_t version, char *buf, size_t n)
{
    if (k->Dqk % 8 || k->Dv % 8 || k->Dqk > 256 || k->Dv > 256)
        snprintf(buf, n, "head dims Dqk=%d Dv=%d: cuDNN needs multiples of 8 up to 256", k->Dqk, k->Dv);
    else if (k->bwd && k->T < 2)
        snprintf(buf, n, "T=%d: the cuDNN backward needs T >= 2", k->T);
    else if (k->bwd && version <= 91500 && k->T % 128)
        snprintf(buf, n, "T=%d is not a multiple of 128: the cuDNN %zu backward then needs a "
                         "padding-mask workaround this graph does not build", k->T, version);
    else
        return NULL;
    return buf;
}

/* Builds the plan of p->key into p (state 1), or records why not (state -1). */
static void att_plan_build(cuda_attn_cache *c, attn_plan *p)
{
    char buf[300];
    const char *bad = att_dnn_unsupported(&p->key, c->version, buf, sizeof buf);
    if (bad) {
        snprintf(p->why, sizeof p->why, "%s", bad);
        p->state = -1;
        return;
    }
    dnn_graph *g = (dnn_graph *)calloc(1, sizeof *g);
    if (!g) {
        snprintf(p->why, sizeof p->why, "out of host memory for the graph builder");
        p->state = -1;
        return;
    }
    g->h = c->handle;
    g->name = p->key.bwd ? "bwd" : "fwd";
    g->version = c->version;
    g->next_uid = UID_VIRTUAL;
    int rc = p->key.bwd ? att_graph_bwd(g, &p->key) : att_graph_fwd(g, &p->key);
    if (rc == MT_OK) rc = att_graph_plan(g, p);
    if (rc == MT_OK) {
        p->descs = (dnn_desc *)malloc(sizeof(dnn_desc) * (size_t)g->n_keep);
        if (!p->descs) rc = MT_ERR(MT_ENOMEM, "attn cudnn: out of host memory");
    }
    if (rc != MT_OK) {
        snprintf(p->why, sizeof p->why, "%s", mt_errmsg());
        for (int i = g->n_keep - 1; i >= 0; i--) cudnnBackendDestroyDescriptor(g->keep[i]);
        p->plan = NULL;
        p->state = -1;
        free(g);
        return;
    }
    memcpy(p->descs, g->keep, sizeof(dnn_desc) * (size_t)g->n_keep);
    p->n_descs = g->n_keep;
    p->aux_bytes = att_aux_bytes(&p->key);
    p->state = 1;
    MT_LOGI("attn: cuDNN %s plan B=%d T=%d H=%d Dqk=%d Dv=%d%s: engine %lld, %d operations, "
            "workspace %zu + aux %zu bytes",
            g->name, p->key.B, p->key.T, p->key.H, p->key.Dqk, p->key.Dv,
            p->key.bwd ? (p->key.det ? " deterministic" : " dQ-atomic") : "", (long long)p->engine,
            g->n_ops, p->ws_bytes, p->aux_bytes);
    free(g);
}

static int att_handle(mt_backend *be, cudnnHandle_t *h)
{
    cuda_attn_cache *c = att_cache(be);
    if (!c->handle) {
        if (cuda_of(be)->dnn) {
            c->handle = cuda_of(be)->dnn;
        } else {
            MT_CUDNN_CHECK(cudnnCreate(&c->handle));
            c->own_handle = 1;
        }
    }
    *h = c->handle;
    return MT_OK;
}

/* The cached plan of a key, built on first use (never NULL). */
static attn_plan *att_plan_get(mt_backend *be, const attn_key *k)
{
    cuda_attn_cache *c = att_cache(be);
    for (int i = 0; i < ATT_CACHE; i++)
        if (c->plans[i].state != 0 && !memcmp(&c->plans[i].key, k, sizeof *k)) return &c->plans[i];
    attn_plan *p = NULL;
    for (int i = 0; i < ATT_CACHE && !p; i++)
        if (c->plans[i].state == 0) p = &c->plans[i];
    if (!p) {
        p = &c->plans[c->evict];
        c->evict = (c->evict + 1) % ATT_CACHE;
        att_plan_release(p);
    }
    p->key = *k;
    p->engine = -1;
    cudnnHandle_t h;
    if (att_handle(be, &h) != MT_OK) {
        snprintf(p->why, sizeof p->why, "%s", mt_errmsg());
        p->state = -1;
        return p;
    }
    att_plan_build(c, p);
    return p;
}

/* Executes a ready plan with (uid, pointer) pairs and the workspace. */
static int att_plan_run(mt_backend *be, attn_plan *p, const int64_t *uids, void **ptrs, int n,
                        void *ws)
{
    const char *dir = p->key.bwd ? "bwd" : "fwd";
    dnn_desc vp = NULL;
    int rc = MT_OK;
    cudnnStatus_t st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
    const char *what = "create the variant pack";
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "set CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS";
        st = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    }
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "set CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS";
        st = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
    }
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "set CUDNN_ATTR_VARIANT_PACK_WORKSPACE";
        st = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    }
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "finalize the variant pack";
        st = cudnnBackendFinalize(vp);
    }
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "cudnnSetStream";
        st = cudnnSetStream(att_cache(be)->handle, cuda_stream(be));
    }
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "cudnnBackendExecute";
        st = cudnnBackendExecute(att_cache(be)->handle, p->plan, vp);
    }
    if (st != CUDNN_STATUS_SUCCESS) {
        char w[160];
        snprintf(w, sizeof w, "%s graph B=%d T=%d H=%d: %s", dir, p->key.B, p->key.T, p->key.H, what);
        rc = dnn_fail(__FILE__, __LINE__, st, w);
    }
    if (vp) cudnnBackendDestroyDescriptor(vp);
    return rc;
}

/* ======================================================================== */
/* path selection and the attention ops                                     */
/* ======================================================================== */

typedef enum { ATT_AUTO = 0, ATT_OWN, ATT_CUDNN } att_mode;

static att_mode att_mode_env(void)
{
    const char *s = getenv("MOETRAIN_ATTN");
    if (s && !strcmp(s, "own")) return ATT_OWN;
    if (s && !strcmp(s, "cudnn")) return ATT_CUDNN;
    return ATT_AUTO;
}

static int att_det_env(void)
{
    const char *s = getenv("MOETRAIN_ATTN_DETERMINISTIC");
    return !(s && !strcmp(s, "0"));
}

static attn_key att_key(int bwd, int B, int T, int H, int Dqk, int Dv, float scale, int det)
{
    attn_key k;
    memset(&k, 0, sizeof k); /* the key is compared with memcmp */
    k.bwd = bwd, k.B = B, k.T = T, k.H = H, k.Dqk = Dqk, k.Dv = Dv, k.det = bwd ? det : 0;
    memcpy(&k.scale_bits, &scale, sizeof scale);
    return k;
}

static int att_aligned(const void *const *ptrs, int n)
{
    for (int i = 0; i < n; i++)
        if ((uintptr_t)ptrs[i] & 15) return 0;
    return 1;
}

/* Outcome of trying cuDNN: ran, or not (why filled), or an error (< 0). */
typedef struct att_try {
    int ran;
    char why[1100];
} att_try;

/* Looks up the plan and the scratch it needs; *p is NULL when cuDNN cannot
 * run this call (t->why says why). */
static void *att_dnn_prepare(mt_backend *be, const attn_key *k, attn_plan **pp, att_try *t)
{
    attn_plan *p = att_plan_get(be, k);
    *pp = NULL;
    if (p->state < 0) {
        snprintf(t->why, sizeof t->why, "%s", p->why);
        return NULL;
    }
    size_t need = p->aux_bytes + att_align(p->ws_bytes) + 256, have = cuda_of(be)->scratch_cap;
    if (need > have) {
        snprintf(t->why, sizeof t->why,
                 "the plan needs %zu MiB of scratch (%zu bytes workspace + %zu aux), the backend "
                 "reserved %zu MiB (MOETRAIN_CUDA_SCRATCH_MB)%s",
                 (need + (1u << 20) - 1) >> 20, p->ws_bytes, p->aux_bytes, have >> 20,
                 k->bwd && k->det ? "; MOETRAIN_ATTN_DETERMINISTIC=0 needs less" : "");
        return NULL;
    }
    void *ws = cuda_scratch(be, need);
    if (!ws) {
        snprintf(t->why, sizeof t->why, "scratch: %s", mt_errmsg());
        return NULL;
    }
    *pp = p;
    return ws;
}

static int att_dnn_fwd(mt_backend *be, void *o, float *lse, const void *q, const void *k,
                       const void *v, int B, int T, int H, int Dqk, int Dv, float scale, att_try *t)
{
    const void *all[] = {o, lse, q, k, v};
    t->ran = 0;
    if (!att_aligned(all, 5)) {
        snprintf(t->why, sizeof t->why, "a tensor is not 16-byte aligned");
        return MT_OK;
    }
    attn_key key = att_key(0, B, T, H, Dqk, Dv, scale, 0);
    attn_plan *p;
    void *ws = att_dnn_prepare(be, &key, &p, t);
    if (!p) return MT_OK;
    p->scale = scale, p->neg_inf = -INFINITY, p->one = 1.0f;
    int64_t uids[] = {UID_Q, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE, UID_NEG_INF};
    void *ptrs[] = {(void *)q, (void *)k, (void *)v, o, lse, &p->scale, &p->neg_inf};
    MT_CHECK(att_plan_run(be, p, uids, ptrs, 7, ws));
    t->ran = 1;
    return MT_OK;
}

static int att_dnn_bwd(mt_backend *be, void *dq, void *dk, void *dv, const void *dout,
                       const void *q, const void *k, const void *v, const void *o,
                       const float *lse, int B, int T, int H, int Dqk, int Dv, float scale,
                       att_try *t)
{
    const void *all[] = {dq, dk, dv, dout, q, k, v, o, lse};
    t->ran = 0;
    if (!att_aligned(all, 9)) {
        snprintf(t->why, sizeof t->why, "a tensor is not 16-byte aligned");
        return MT_OK;
    }
    attn_key key = att_key(1, B, T, H, Dqk, Dv, scale, att_det_env());
    attn_plan *p;
    char *ws = (char *)att_dnn_prepare(be, &key, &p, t);
    if (!p) return MT_OK;
    p->scale = scale, p->neg_inf = -INFINITY, p->one = 1.0f;
    const size_t rows = (size_t)B * H * T;
    char *softsum = ws, *dq_acc = ws + att_align(rows * sizeof(float));
    int64_t uids[] = {UID_Q,     UID_K,       UID_V,   UID_O,           UID_DO,   UID_STATS, UID_DQ,
                      UID_DK,    UID_DV,      UID_SCALE, UID_NEG_INF, UID_ONE, UID_SOFTMAX_SUM,
                      UID_DQ_ACCUM};
    void *ptrs[] = {(void *)q, (void *)k, (void *)v,  (void *)o,   (void *)dout, (void *)lse, dq,
                    dk,        dv,        &p->scale, &p->neg_inf, &p->one,      softsum,     dq_acc};
    const int n = p->key.det ? 13 : 14;
    MT_CHECK(att_plan_run(be, p, uids, ptrs, n, ws + p->aux_bytes));
    t->ran = 1;
    return MT_OK;
}

/* After a cuDNN try: "cudnn", or the fallback (warned once per shape in auto
 * mode; an error when cuDNN is forced). */
static int att_after_try(mt_backend *be, const char *op, att_mode mode, const attn_key *k,
                         const att_try *t)
{
    cuda_attn_cache *c = att_cache(be);
    if (t->ran) {
        snprintf(c->last_path, sizeof c->last_path, "cudnn");
        return 1;
    }
    if (mode == ATT_CUDNN)
        return MT_ERR(MT_ENOTSUP, "%s: MOETRAIN_ATTN=cudnn but cuDNN cannot run B=%d T=%d H=%d "
                      "Dqk=%d Dv=%d: %s", op, k->B, k->T, k->H, k->Dqk, k->Dv, t->why);
    snprintf(c->last_path, sizeof c->last_path, "own (%s)", t->why);
    for (int i = 0; i < ATT_CACHE; i++) {
        attn_plan *p = &c->plans[i];
        if (p->state != 0 && !memcmp(&p->key, k, sizeof *k)) {
            if (p->warned) return 0;
            p->warned = 1;
            break;
        }
    }
    MT_LOGW("%s: cuDNN not used for B=%d T=%d H=%d Dqk=%d Dv=%d (%s); using the own kernel", op,
            k->B, k->T, k->H, k->Dqk, k->Dv, t->why);
    return 0;
}

static int attn_check(const char *op, int B, int T, int H, int Dqk, int Dv)
{
    CUDA_REQUIRE(B >= 0 && T >= 1 && H >= 1 && Dqk >= 1 && Dv >= 1,
                 "%s: B=%d T=%d H=%d Dqk=%d Dv=%d", op, B, T, H, Dqk, Dv);
    return MT_OK;
}

static int cuda_attn_fwd(mt_backend *be, void *o, float *lse, const void *q, const void *k,
                         const void *v, int B, int T, int H, int Dqk, int Dv, float scale)
{
    MT_CHECK(attn_check("attn_fwd", B, T, H, Dqk, Dv));
    if (B == 0) return MT_OK;
    CUDA_REQUIRE(o && lse && q && k && v, "attn_fwd: NULL pointer");
    att_mode mode = att_mode_env();
    if (mode != ATT_OWN) {
        att_try t;
        MT_CHECK(att_dnn_fwd(be, o, lse, q, k, v, B, T, H, Dqk, Dv, scale, &t));
        attn_key key = att_key(0, B, T, H, Dqk, Dv, scale, 0);
        int r = att_after_try(be, "attn_fwd", mode, &key, &t);
        if (r != 0) return r < 0 ? r : MT_OK;
    } else {
        snprintf(att_cache(be)->last_path, sizeof att_cache(be)->last_path, "own");
    }
    return att_own_fwd(be, (bf16 *)o, lse, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, B,
                       T, H, Dqk, Dv, scale);
}

static int cuda_attn_bwd(mt_backend *be, void *dq, void *dk, void *dv, const void *dout,
                         const void *q, const void *k, const void *v, const void *o,
                         const float *lse, int B, int T, int H, int Dqk, int Dv, float scale)
{
    MT_CHECK(attn_check("attn_bwd", B, T, H, Dqk, Dv));
    if (B == 0) return MT_OK;
    CUDA_REQUIRE(dq && dk && dv && dout && q && k && v && o && lse, "attn_bwd: NULL pointer");
    att_mode mode = att_mode_env();
    if (mode != ATT_OWN) {
        att_try t;
        MT_CHECK(att_dnn_bwd(be, dq, dk, dv, dout, q, k, v, o, lse, B, T, H, Dqk, Dv, scale, &t));
        attn_key key = att_key(1, B, T, H, Dqk, Dv, scale, att_det_env());
        int r = att_after_try(be, "attn_bwd", mode, &key, &t);
        if (r != 0) return r < 0 ? r : MT_OK;
    } else {
        snprintf(att_cache(be)->last_path, sizeof att_cache(be)->last_path, "own");
    }
    return att_own_bwd(be, (bf16 *)dq, (bf16 *)dk, (bf16 *)dv, (const bf16 *)dout, (const bf16 *)q,
                       (const bf16 *)k, (const bf16 *)v, (const bf16 *)o, lse, B, T, H, Dqk, Dv,
                       scale);
}

/* ======================================================================== */
/* install, destroy, C helpers                                              */
/* ======================================================================== */

int cuda_install_attn(mt_backend *be)
{
    cuda_impl *ci = cuda_of(be);
    cuda_attn_cache *c = (cuda_attn_cache *)calloc(1, sizeof *c);
    if (!c) return MT_ERR(MT_ENOMEM, "attn: out of host memory for the plan cache");
    ci->attn = c;
    c->version = cudnnGetVersion();
    snprintf(c->last_path, sizeof c->last_path, "none");
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&c->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                         ci->device));
    be->rope = cuda_rope;
    be->attn_fwd = cuda_attn_fwd;
    be->attn_bwd = cuda_attn_bwd;
    be->mla_kv_fwd = cuda_mla_kv_fwd;
    be->mla_kv_bwd = cuda_mla_kv_bwd;
    return MT_OK;
}

void cuda_attn_destroy(mt_backend *be)
{
    cuda_impl *ci = cuda_of(be);
    cuda_attn_cache *c = ci ? ci->attn : NULL;
    if (!c) return;
    for (int i = 0; i < ATT_CACHE; i++)
        if (c->plans[i].state != 0) att_plan_release(&c->plans[i]);
    if (c->own_handle) cudnnDestroy(c->handle);
    free(c);
    ci->attn = NULL;
}

extern "C" size_t cuda_attn_scratch_bytes(int B, int T, int H, int Dqk, int Dv)
{
    (void)Dv;
    const size_t rows = (size_t)B * H * T, t128 = ((size_t)T + 127) / 128 * 128;
    const size_t own = att_align(rows * sizeof(float));
    size_t dnn = att_align(rows * sizeof(float)) + ((size_t)32 << 20); /* softmax_sum + margin */
    if (att_det_env())
        dnn += (size_t)B * H * t128 * t128 * 2; /* the deterministic backward's dP workspace */
    else
        dnn += att_align(rows * (size_t)Dqk * sizeof(float)); /* dQ_accum */
    return dnn > own ? dnn : own;
}

extern "C" int cuda_attn_plan_bytes(mt_backend *be, int bwd, int B, int T, int H, int Dqk, int Dv,
                                    float scale, size_t *need, size_t *have)
{
    *need = 0;
    *have = cuda_of(be)->scratch_cap;
    MT_CHECK(attn_check("attn plan", B, T, H, Dqk, Dv));
    attn_key key = att_key(bwd != 0, B, T, H, Dqk, Dv, scale, att_det_env());
    attn_plan *p = att_plan_get(be, &key);
    if (p->state < 0) return MT_ERR(MT_ENOTSUP, "attn plan (%s): %s", bwd ? "bwd" : "fwd", p->why);
    *need = p->aux_bytes + att_align(p->ws_bytes) + 256;
    return MT_OK;
}

extern "C" const char *cuda_attn_last_path(mt_backend *be)
{
    cuda_attn_cache *c = att_cache(be);
    return c ? c->last_path : "none";
}

extern "C" void *cuda_attn_stream(mt_backend *be) { return (void *)cuda_stream(be); }
