/* cuda_rope_mla.cu - rotary embedding and the MLA key/value assembly of the
 * CUDA backend (ops.h: rope, mla_kv_fwd, mla_kv_bwd), act = bf16, with the
 * semantics of kernels/cpu/cpu_attn.c.
 */
#include "kernels/cuda/cuda_impl.h"

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

/* The same rotation, 4 pairs per thread with vector accesses: pairs 4q ..
 * 4q + 3 of head h of token n; interleaved, the 8 values are one 16-byte
 * load and store, otherwise the a and b halves are two 8-byte ones; cos and
 * sin are one float4 each. Launch: threadIdx.x + blockIdx.x * blockDim.x =
 * the (h, q) slot of a token (h * Q + q, one 32-bit division per thread),
 * threadIdx.y + blockIdx.y * blockDim.y the first token, stepping by the
 * grid's tokens: no 64-bit divisions (the element kernel spends more on its
 * three than on its 2-byte loads). Each element is computed by the same
 * operations as rope_kernel's (bit-identical). */
static __device__ __forceinline__ void rope_unpack4(uint2 v, float *f)
{
    f[0] = __uint_as_float(v.x << 16), f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16), f[3] = __uint_as_float(v.y & 0xffff0000u);
}

static __device__ __forceinline__ uint32_t rope_pack2(float lo, float hi)
{
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *(const uint32_t *)&b;
}

template <int IL>
static __global__ void __launch_bounds__(256)
rope_vec_kernel(bf16 *x, int N, int T, int W, int Q, int ld, int hs, int off, int half,
                const float *__restrict__ cos_t, const float *__restrict__ sin_t, int inverse)
{
    const int slot = blockIdx.x * blockDim.x + threadIdx.x;
    if (slot >= W) return;
    const int h = slot / Q, q = slot - h * Q, i0 = 4 * q;
    for (int n = blockIdx.y * blockDim.y + threadIdx.y; n < N; n += gridDim.y * blockDim.y) {
        bf16 *p = x + (int64_t)n * ld + (int64_t)h * hs + off;
        const int64_t ci = (int64_t)(n % T) * half + i0;
        const float4 c4 = *(const float4 *)(cos_t + ci), s4 = *(const float4 *)(sin_t + ci);
        const float c[4] = {c4.x, c4.y, c4.z, c4.w};
        float s[4] = {s4.x, s4.y, s4.z, s4.w};
        if (inverse)
#pragma unroll
            for (int j = 0; j < 4; j++) s[j] = -s[j];
        float x0[4], x1[4], o0[4], o1[4];
        if (IL) {
            const uint4 v = *(const uint4 *)(p + 2 * i0);
            rope_unpack4(make_uint2(v.x, v.y), x0); /* x0 holds e0 e1 e2 e3 for now */
            rope_unpack4(make_uint2(v.z, v.w), x1); /* e4 .. e7 */
            const float e[8] = {x0[0], x0[1], x0[2], x0[3], x1[0], x1[1], x1[2], x1[3]};
#pragma unroll
            for (int j = 0; j < 4; j++) x0[j] = e[2 * j], x1[j] = e[2 * j + 1];
        } else {
            rope_unpack4(*(const uint2 *)(p + i0), x0);
            rope_unpack4(*(const uint2 *)(p + half + i0), x1);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            o0[j] = __fsub_rn(__fmul_rn(x0[j], c[j]), __fmul_rn(x1[j], s[j]));
            o1[j] = __fadd_rn(__fmul_rn(x0[j], s[j]), __fmul_rn(x1[j], c[j]));
        }
        if (IL) {
            *(uint4 *)(p + 2 * i0) = make_uint4(rope_pack2(o0[0], o1[0]), rope_pack2(o0[1], o1[1]),
                                                rope_pack2(o0[2], o1[2]), rope_pack2(o0[3], o1[3]));
        } else {
            *(uint2 *)(p + i0) = make_uint2(rope_pack2(o0[0], o0[1]), rope_pack2(o0[2], o0[3]));
            *(uint2 *)(p + half + i0) = make_uint2(rope_pack2(o1[0], o1[1]), rope_pack2(o1[2], o1[3]));
        }
    }
}

/* The vector kernel applies when R % 8 == 0 (4-pair groups), cos and sin
 * are 16-byte aligned and every head's slice starts aligned for its
 * accesses: 16 bytes interleaved, 8 otherwise. */
static int rope_vec_ok(const void *x, int ld, int hs, int off, int R, const float *cos_t,
                       const float *sin_t, int interleave)
{
    const int a = interleave ? 8 : 4; /* elements */
    return R % 8 == 0 && ((uintptr_t)cos_t & 15) == 0 && ((uintptr_t)sin_t & 15) == 0 &&
           ((uintptr_t)x & (2 * a - 1)) == 0 && ld % a == 0 && hs % a == 0 && off % a == 0;
}

static int cuda_rope(mt_backend *be, void *x, int N, int T, int H, int ld, int hs, int off, int R,
                     const float *cos_t, const float *sin_t, int interleave, int inverse)
{
    CUDA_REQUIRE(N >= 0 && T >= 1 && H >= 1, "rope: N=%d T=%d H=%d", N, T, H);
    CUDA_REQUIRE(R >= 2 && R % 2 == 0, "rope: R=%d must be even and >= 2", R);
    CUDA_REQUIRE(off >= 0 && hs >= 0 && ld >= 1, "rope: ld=%d hs=%d off=%d", ld, hs, off);
    if (N == 0) return MT_OK;
    CUDA_REQUIRE(x && cos_t && sin_t, "rope: NULL pointer");
    if (rope_vec_ok(x, ld, hs, off, R, cos_t, sin_t, interleave)) {
        /* W = H * R / 8 slots per token: blocks of up to 256 slots in x,
         * 256 / W tokens in y when a token has fewer */
        const int Q = R / 8, W = H * Q;
        const int bx = W < 256 ? W : 256, by = 256 / bx;
        const int64_t gy = mt_ceil_div(N, by);
        const dim3 grid((unsigned)mt_ceil_div(W, bx), (unsigned)(gy < 65535 ? gy : 65535));
        if (interleave)
            rope_vec_kernel<1><<<grid, dim3((unsigned)bx, (unsigned)by), 0, cuda_stream(be)>>>(
                (bf16 *)x, N, T, W, Q, ld, hs, off, R / 2, cos_t, sin_t, inverse);
        else
            rope_vec_kernel<0><<<grid, dim3((unsigned)bx, (unsigned)by), 0, cuda_stream(be)>>>(
                (bf16 *)x, N, T, W, Q, ld, hs, off, R / 2, cos_t, sin_t, inverse);
        CUDA_LAUNCH_CHECK("rope");
        return MT_OK;
    }
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

/* ---- 16-byte paths ------------------------------------------------------------
 * When Dn, R, Dv (and the kpe row stride) are multiples of 8 and every
 * buffer is 16-byte aligned (the DeepSeek-V3 shapes), the copies move 8 bf16
 * per thread: a block holds 256 / chunks rows of (n, h), one thread per
 * 16-byte chunk of a row (threadIdx.x) and one row per threadIdx.y, so no
 * thread divides by a non-constant. The same values land in the same places
 * as in the element kernels above. */

/* k and v of row nh = blockIdx.x * blockDim.y + threadIdx.y; chunk j = 8 threadIdx.x
 * of [k_nope | k_pe | v]. */
static __global__ void mla_kv_fwd_vec_kernel(bf16 *__restrict__ k, bf16 *__restrict__ v,
                                             const bf16 *__restrict__ kvb,
                                             const bf16 *__restrict__ kpe, int ld_kpe, int64_t NH,
                                             int H, int Dn, int R, int Dv)
{
    const int64_t nh = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    if (nh >= NH) return;
    const int j = 8 * threadIdx.x;
    if (j < Dn) {
        *(uint4 *)(k + nh * (Dn + R) + j) = *(const uint4 *)(kvb + nh * (Dn + Dv) + j);
    } else if (j < Dn + R) {
        const int64_t n = nh / H;
        *(uint4 *)(k + nh * (Dn + R) + j) = *(const uint4 *)(kpe + n * ld_kpe + (j - Dn));
    } else {
        const int jv = j - Dn - R;
        *(uint4 *)(v + nh * Dv + jv) = *(const uint4 *)(kvb + nh * (Dn + Dv) + Dn + jv);
    }
}

/* dkvb row nh = [dk[nh, :Dn], dv[nh]]: chunk j = 8 threadIdx.x. */
static __global__ void mla_kv_bwd_copy_vec_kernel(bf16 *__restrict__ dkvb,
                                                  const bf16 *__restrict__ dk,
                                                  const bf16 *__restrict__ dv, int64_t NH, int Dn,
                                                  int R, int Dv)
{
    const int64_t nh = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    if (nh >= NH) return;
    const int j = 8 * threadIdx.x;
    *(uint4 *)(dkvb + nh * (Dn + Dv) + j) =
        j < Dn ? *(const uint4 *)(dk + nh * (Dn + R) + j) : *(const uint4 *)(dv + nh * Dv + (j - Dn));
}

/* dkpe[n, d], d = 2 i and 2 i + 1 per thread (one 4-byte load per head):
 * each sum runs over the heads in order in fp32, as mla_kv_bwd_pe_kernel's. */
static __global__ void mla_kv_bwd_pe2_kernel(bf16 *__restrict__ dkpe, int ld_dkpe,
                                             const bf16 *__restrict__ dk, int64_t total, int H,
                                             int Dn, int R)
{
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= total) return;
    const int half = R / 2;
    const int d = 2 * (int)(e % half);
    const int64_t n = e / half;
    const bf16 *src = dk + n * H * (Dn + R) + Dn + d;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 8
    for (int h = 0; h < H; h++) {
        const __nv_bfloat162 w = *(const __nv_bfloat162 *)(src + (int64_t)h * (Dn + R));
        s0 = __fadd_rn(s0, __low2float(w));
        s1 = __fadd_rn(s1, __high2float(w));
    }
    cuda_st(dkpe, n * ld_dkpe + d, s0);
    cuda_st(dkpe, n * ld_dkpe + d + 1, s1);
}

static int mla_aligned16(const void *const *ptrs, int n)
{
    for (int i = 0; i < n; i++)
        if ((uintptr_t)ptrs[i] & 15) return 0;
    return 1;
}

/* Block shape of the 16-byte copies: chunks of a row in x, rows in y. */
static dim3 mla_vec_block(int chunks) { return dim3((unsigned)chunks, (unsigned)(256 / chunks > 0 ? 256 / chunks : 1)); }

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
    const void *ptrs[] = {k, v, kvb, kpe};
    if (Dn % 8 == 0 && R % 8 == 0 && Dv % 8 == 0 && ld_kpe % 8 == 0 && mla_aligned16(ptrs, 4) &&
        (Dn + R + Dv) / 8 <= 256) {
        const int64_t NH = (int64_t)N * H;
        const dim3 blk = mla_vec_block((Dn + R + Dv) / 8);
        mla_kv_fwd_vec_kernel<<<cuda_grid(NH, (int)blk.y), blk, 0, cuda_stream(be)>>>(
            (bf16 *)k, (bf16 *)v, (const bf16 *)kvb, (const bf16 *)kpe, ld_kpe, NH, H, Dn, R, Dv);
        CUDA_LAUNCH_CHECK("mla_kv_fwd");
        return MT_OK;
    }
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
    const void *ptrs[] = {dkvb, dk, dv};
    if (Dn % 8 == 0 && R % 8 == 0 && Dv % 8 == 0 && mla_aligned16(ptrs, 3) && (Dn + Dv) / 8 <= 256) {
        const int64_t NH = (int64_t)N * H, pe2 = (int64_t)N * (R / 2);
        const dim3 blk = mla_vec_block((Dn + Dv) / 8);
        mla_kv_bwd_copy_vec_kernel<<<cuda_grid(NH, (int)blk.y), blk, 0, cuda_stream(be)>>>(
            (bf16 *)dkvb, (const bf16 *)dk, (const bf16 *)dv, NH, Dn, R, Dv);
        CUDA_LAUNCH_CHECK("mla_kv_bwd (copy)");
        mla_kv_bwd_pe2_kernel<<<cuda_grid(pe2, 256), 256, 0, cuda_stream(be)>>>(
            (bf16 *)dkpe, ld_dkpe, (const bf16 *)dk, pe2, H, Dn, R);
        CUDA_LAUNCH_CHECK("mla_kv_bwd (dkpe)");
        return MT_OK;
    }
    int64_t total = (int64_t)N * H * (Dn + Dv), pe = (int64_t)N * R;
    mla_kv_bwd_copy_kernel<<<cuda_grid(total, 256), 256, 0, cuda_stream(be)>>>(
        (bf16 *)dkvb, (const bf16 *)dk, (const bf16 *)dv, total, Dn, R, Dv);
    CUDA_LAUNCH_CHECK("mla_kv_bwd (copy)");
    mla_kv_bwd_pe_kernel<<<cuda_grid(pe, 256), 256, 0, cuda_stream(be)>>>(
        (bf16 *)dkpe, ld_dkpe, (const bf16 *)dk, pe, H, Dn, R);
    CUDA_LAUNCH_CHECK("mla_kv_bwd (dkpe)");
    return MT_OK;
}

void cuda_install_rope_mla(mt_backend *be)
{
    be->rope = cuda_rope;
    be->mla_kv_fwd = cuda_mla_kv_fwd;
    be->mla_kv_bwd = cuda_mla_kv_bwd;
}
