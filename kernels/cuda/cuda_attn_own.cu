/* cuda_attn_own.cu - the own causal attention kernels of the CUDA backend:
 * the fallback where cuDNN cannot serve a shape, and the cross-check of the
 * cuDNN path (MOETRAIN_ATTN=own). FlashAttention-2 style tiles of 64
 * queries x 64 keys in shared memory, fp32 SIMT arithmetic, online softmax
 * in the forward; the backward recomputes P from lse and computes dK, dV per
 * key tile (iterating over queries) and dQ per query tile (iterating over
 * keys), so no sum depends on timing. Semantics of kernels/cpu/cpu_attn.c;
 * layouts as cuda_attn.cu says.
 */
#include <math.h>

#include "kernels/cuda/cuda_attn_impl.h"

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

int att_own_fwd(mt_backend *be, bf16 *o, float *lse, const bf16 *q, const bf16 *k,
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

int att_own_bwd(mt_backend *be, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout,
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
