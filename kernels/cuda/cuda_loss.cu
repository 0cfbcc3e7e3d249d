/* cuda_loss.cu - cross-entropy fused with the head's softmax, and the
 * optimizer ops: deterministic sum of squares, scaling, AdamW with bf16
 * moments (alone, fused with the FP8 re-quantisation, or in place on the
 * FP8 codes), bf16 -> f32.
 *
 * The same functions as kernels/cpu/cpu_loss.c and cpu_optim.c. This file
 * is compiled with --fmad=false (no fused multiply-add, as the CPU oracle's
 * -ffp-contract=off); AdamW spells every step with the IEEE round-to-nearest
 * intrinsics in the CPU's order, so it is bit-identical to the CPU (the
 * bf16 stores round to nearest even on both). xent uses CUDA's expf (within
 * 2 ulp): its gradient is stored in bf16 and its loss sums V terms, so the
 * difference from glibc's expf is far below the comparison tolerance.
 *
 * Launch shapes:
 *   xent         one block per row: max, sum of exp, then the gradient
 *                written in place; 1024 threads, 16-byte accesses and
 *                float arithmetic per element when V % 8 == 0, else 512
 *                threads and double
 *   sumsq        P <= 4096 blocks each summing a fixed contiguous range in
 *                double (fixed tree), then one block adding the P partials
 *                (fixed tree): deterministic for a given n
 *   scale_f32, adamw, bf16_to_f32: element-wise grid-stride
 *   adamw_fp8    one 256-thread block per 128x128 weight block: AdamW,
 *                block amax, quantise, and the transposed copy via shared
 *                memory (one pass instead of adamw + quant + transpose);
 *                full blocks with 16-byte accesses
 *   adamw        groups of 8 elements with 16-byte accesses where every array
 *                is 16-byte aligned, else of 4 where 8-byte aligned (the act
 *                copy, when asked, written from the same registers)
 *   adamw_fp8_sr one block per 128x128 block of a weight with no main copy:
 *                dequantise, AdamW into a shared f32 tile, block amax,
 *                stochastic rounding, the transposed copy from the tile;
 *                512 threads, a warp a row with 4-element accesses where N
 *                and K are multiples of 4, else 256, a thread a column;
 *                adamw_fp8_sr_n: a launch a weight on the expert streams
 */
#include "kernels/cuda/cuda_impl.h"
#include "kernels/cuda/cuda_util.cuh"

/* ---- xent ------------------------------------------------------------------------- */

#define XENT_THREADS 512

/* Row m of logits [M, V] (in place): loss = mx + log(sum exp(x - mx)) - x[tgt]
 * and x = grad_scale * (softmax - onehot). A target outside [0, V) that is
 * not `ignore` (the CPU rejects it on the host) gives a NaN loss and leaves
 * the row unchanged. */
__global__ void __launch_bounds__(XENT_THREADS)
xent_kernel(float *__restrict__ loss, bf16 *__restrict__ logits, const int32_t *__restrict__ tgt,
            int V, int ignore, float grad_scale)
{
    __shared__ float shf[32];
    __shared__ double shd[32];
    const int m = blockIdx.x;
    bf16 *x = logits + (int64_t)m * V;
    const int t = tgt[m];
    if (t == ignore) {
        for (int j = threadIdx.x; j < V; j += blockDim.x) x[j] = __float2bfloat16_rn(0.0f);
        if (threadIdx.x == 0) loss[m] = 0.0f;
        return;
    }
    if (t < 0 || t >= V) {
        if (threadIdx.x == 0) loss[m] = __int_as_float(0x7fc00000); /* NaN */
        return;
    }
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, cuda_ld(x, j));
    mx = cu_block_max(mx, shf);
    const float xt = cuda_ld(x, t);
    double acc = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) acc += (double)expf(cuda_ld(x, j) - mx);
    const double sum = cu_block_sum(acc, shd); /* all reads of x are done */
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float p = (float)((double)expf(cuda_ld(x, j) - mx) / sum);
        cuda_st(x, j, grad_scale * (j == t ? p - 1.0f : p));
    }
    if (threadIdx.x == 0) loss[m] = (float)((double)mx + log(sum) - (double)xt);
}

/* xent_kernel with 16-byte accesses (V % 8 == 0, 16-byte aligned rows) and
 * float arithmetic per element: thread t holds the 8 logits of chunks t, t
 * + 1024, ...; the sum of exp adds each chunk's 8 terms in float, then the
 * chunk sums in double, and each probability is exp(x - max) times the
 * float reciprocal of that sum. xent_kernel (and the CPU) convert every
 * term to double and divide in double: on an H200 those conversions and
 * divisions bounded the proxy's head (8192 x 129280: 3.0 ms a call, 37 %
 * of the copy; 2.0 ms like this). Here p is within about 1 float ulp of
 * theirs (so the bf16 gradient differs from theirs by one bf16 ulp where p
 * lies that close to a bf16 rounding boundary) and the sum within a few
 * float ulps (the loss: a few 1e-7 relative). Those few gradient elements
 * are enough to move a training run's later losses in their fourth digit
 * (tests/bench/RESULTS.md), as any other rounding would. */
#define XENT_VEC_THREADS 1024

__global__ void __launch_bounds__(XENT_VEC_THREADS)
xent_vec_kernel(float *__restrict__ loss, bf16 *__restrict__ logits,
                const int32_t *__restrict__ tgt, int V, int ignore, float grad_scale)
{
    __shared__ float shf[32];
    __shared__ double shd[32];
    const int m = blockIdx.x;
    bf16 *x = logits + (int64_t)m * V;
    uint4 *x8 = (uint4 *)x;
    const int V8 = V / 8;
    const int t = tgt[m];
    if (t == ignore) {
        for (int j = threadIdx.x; j < V8; j += blockDim.x) x8[j] = make_uint4(0, 0, 0, 0);
        if (threadIdx.x == 0) loss[m] = 0.0f;
        return;
    }
    if (t < 0 || t >= V) {
        if (threadIdx.x == 0) loss[m] = __int_as_float(0x7fc00000); /* NaN */
        return;
    }
    float mx = -INFINITY, v[8];
#pragma unroll 4
    for (int j = threadIdx.x; j < V8; j += blockDim.x) {
        cu_bf16x8_unpack(x8[j], v);
#pragma unroll
        for (int i = 0; i < 8; i++) mx = fmaxf(mx, v[i]);
    }
    mx = cu_block_max(mx, shf);
    const float xt = cuda_ld(x, t);
    double acc = 0.0;
#pragma unroll 2
    for (int j = threadIdx.x; j < V8; j += blockDim.x) {
        cu_bf16x8_unpack(x8[j], v);
        float e8 = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) e8 += expf(v[i] - mx);
        acc += (double)e8;
    }
    const double sum = cu_block_sum(acc, shd); /* all reads of x are done */
    const float rs = (float)(1.0 / sum);
#pragma unroll 2
    for (int j = threadIdx.x; j < V8; j += blockDim.x) {
        cu_bf16x8_unpack(x8[j], v);
        uint32_t o[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float g[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int col = 8 * j + 2 * i + h;
                const float p = expf(v[2 * i + h] - mx) * rs;
                g[h] = grad_scale * (col == t ? p - 1.0f : p);
            }
            const __nv_bfloat162 b = __floats2bfloat162_rn(g[0], g[1]);
            o[i] = *(const uint32_t *)&b;
        }
        x8[j] = make_uint4(o[0], o[1], o[2], o[3]);
    }
    if (threadIdx.x == 0) loss[m] = (float)((double)mx + log(sum) - (double)xt);
}

static int cuda_xent(mt_backend *be, float *loss, void *logits, const int32_t *tgt, int M, int V,
                     int ignore, float grad_scale)
{
    CUDA_REQUIRE(M >= 0 && V >= 1, "xent: M=%d V=%d", M, V);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(loss && logits && tgt, "xent: NULL pointer");
    if (V % 8 == 0 && (uintptr_t)logits % 16 == 0)
        xent_vec_kernel<<<M, XENT_VEC_THREADS, 0, cuda_stream(be)>>>(loss, (bf16 *)logits, tgt, V,
                                                                     ignore, grad_scale);
    else
        xent_kernel<<<M, XENT_THREADS, 0, cuda_stream(be)>>>(loss, (bf16 *)logits, tgt, V, ignore,
                                                             grad_scale);
    CUDA_LAUNCH_CHECK("xent");
    return MT_OK;
}

/* ---- vocabulary-parallel parts (ops.h) ---------------------------------------------- */

/* One block per row: (max, sum of exp in double, the target's logit or 0). */
__global__ void __launch_bounds__(XENT_THREADS)
xent_part_stats_kernel(float *__restrict__ stats, const bf16 *__restrict__ logits,
                       const int32_t *__restrict__ tgt, int V, int v_lo)
{
    __shared__ float shf[32];
    __shared__ double shd[32];
    const int m = blockIdx.x;
    const bf16 *x = logits + (int64_t)m * V;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, cuda_ld(x, j));
    mx = cu_block_max(mx, shf);
    double acc = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) acc += (double)expf(cuda_ld(x, j) - mx);
    const double sum = cu_block_sum(acc, shd);
    if (threadIdx.x == 0) {
        const int t = tgt[m] - v_lo;
        stats[3 * m] = mx;
        stats[3 * m + 1] = (float)sum;
        stats[3 * m + 2] = t >= 0 && t < V ? cuda_ld(x, t) : 0.0f;
    }
}

/* One block per row: the parts' statistics combined in part order (every
 * thread the same sums), then the loss and the gradient in place. */
__global__ void __launch_bounds__(XENT_THREADS)
xent_part_finish_kernel(float *__restrict__ loss, bf16 *__restrict__ logits,
                        const float *__restrict__ stats, int P, const int32_t *__restrict__ tgt,
                        int M, int V, int v_lo, int ignore, float grad_scale)
{
    const int m = blockIdx.x;
    bf16 *x = logits + (int64_t)m * V;
    if (tgt[m] == ignore) {
        for (int j = threadIdx.x; j < V; j += blockDim.x) x[j] = __float2bfloat16_rn(0.0f);
        if (threadIdx.x == 0) loss[m] = 0.0f;
        return;
    }
    float mx = stats[3 * m];
    for (int p = 1; p < P; p++) mx = fmaxf(mx, stats[((int64_t)p * M + m) * 3]);
    double sum = 0.0, xt = 0.0;
    for (int p = 0; p < P; p++) {
        const float *s = stats + ((int64_t)p * M + m) * 3;
        sum += (double)s[1] * exp((double)s[0] - (double)mx);
        xt += s[2];
    }
    const int t = tgt[m] - v_lo;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float p = (float)((double)expf(cuda_ld(x, j) - mx) / sum);
        cuda_st(x, j, grad_scale * (j == t ? p - 1.0f : p));
    }
    if (threadIdx.x == 0) loss[m] = (float)((double)mx + log(sum) - xt);
}

static int cuda_xent_part_stats(mt_backend *be, float *stats, const void *logits,
                                const int32_t *tgt, int M, int V, int v_lo, int ignore)
{
    (void)ignore;
    CUDA_REQUIRE(M >= 0 && V >= 1 && v_lo >= 0, "xent_part_stats: M=%d V=%d v_lo=%d", M, V, v_lo);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(stats && logits && tgt, "xent_part_stats: NULL pointer");
    xent_part_stats_kernel<<<M, XENT_THREADS, 0, cuda_stream(be)>>>(stats, (const bf16 *)logits,
                                                                    tgt, V, v_lo);
    CUDA_LAUNCH_CHECK("xent_part_stats");
    return MT_OK;
}

static int cuda_xent_part_finish(mt_backend *be, float *loss, void *logits, const float *stats,
                                 int P, const int32_t *tgt, int M, int V, int v_lo, int ignore,
                                 float grad_scale)
{
    CUDA_REQUIRE(M >= 0 && V >= 1 && P >= 1 && v_lo >= 0,
                 "xent_part_finish: M=%d V=%d P=%d v_lo=%d", M, V, P, v_lo);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(loss && logits && stats && tgt, "xent_part_finish: NULL pointer");
    xent_part_finish_kernel<<<M, XENT_THREADS, 0, cuda_stream(be)>>>(
        loss, (bf16 *)logits, stats, P, tgt, M, V, v_lo, ignore, grad_scale);
    CUDA_LAUNCH_CHECK("xent_part_finish");
    return MT_OK;
}

/* ---- sumsq, scale_f32 ---------------------------------------------------------------- */

#define SUMSQ_THREADS 256
#define SUMSQ_MAX_PARTS 4096
#define SUMSQ_MIN_PART 8192 /* elements per partial, at least */

/* part[p] = sum of g[i]^2 (double) over i in [p * len, min(n, (p + 1) len)).
 * With vec (g 16-byte aligned, len a multiple of 8) each thread loads 16
 * bytes at a time: the 2-byte loads of bf16 gradients held the kernel at a
 * third of the copy bandwidth (11.2 ms for the proxy's 7.4 G gradients on
 * an H200). The order of the additions is fixed by n either way. */
__global__ void __launch_bounds__(SUMSQ_THREADS)
sumsq_part_kernel(double *__restrict__ part, const void *__restrict__ g, int g_bf16, int vec,
                  int64_t n, int64_t len)
{
    __shared__ double sh[32];
    const int64_t i0 = (int64_t)blockIdx.x * len;
    const int64_t i1 = min(n, i0 + len);
    double acc = 0.0;
    int64_t i = i0;
    if (vec) {
        const int per = g_bf16 ? 8 : 4; /* elements in 16 bytes */
        const int64_t v1 = i0 + (i1 - i0) / per * per;
        const uint4 *q = (const uint4 *)((const char *)g + i0 * (g_bf16 ? 2 : 4));
        const int64_t nv = (v1 - i0) / per;
        for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
            const uint4 w = __ldg(q + j);
            if (g_bf16) {
                float x[8];
                cu_bf16x8_unpack(w, x);
#pragma unroll
                for (int k = 0; k < 8; k++) acc += (double)x[k] * (double)x[k];
            } else {
                const float x[4] = {__uint_as_float(w.x), __uint_as_float(w.y),
                                    __uint_as_float(w.z), __uint_as_float(w.w)};
#pragma unroll
                for (int k = 0; k < 4; k++) acc += (double)x[k] * (double)x[k];
            }
        }
        i = v1;
    }
    for (i += threadIdx.x; i < i1; i += blockDim.x) {
        double v = g_bf16 ? (double)__bfloat162float(((const bf16 *)g)[i])
                          : (double)((const float *)g)[i];
        acc += v * v;
    }
    acc = cu_block_sum(acc, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

/* out[0] = (float) sum of the P partials (one block, fixed tree). */
__global__ void __launch_bounds__(1024)
sumsq_final_kernel(float *__restrict__ out, const double *__restrict__ part, int P)
{
    __shared__ double sh[32];
    double acc = 0.0;
    for (int p = threadIdx.x; p < P; p += blockDim.x) acc += part[p];
    acc = cu_block_sum(acc, sh);
    if (threadIdx.x == 0) out[0] = (float)acc;
}

static int cuda_sumsq(mt_backend *be, float *out, const void *g, int g_bf16, int64_t n)
{
    CUDA_REQUIRE(n >= 0, "sumsq: n=%lld is negative", (long long)n);
    CUDA_REQUIRE(out != NULL && (n == 0 || g != NULL), "sumsq: NULL pointer");
    cudaStream_t st = cuda_stream(be);
    if (n == 0) {
        MT_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), st));
        return MT_OK;
    }
    int64_t P = (n + SUMSQ_MIN_PART - 1) / SUMSQ_MIN_PART;
    if (P > SUMSQ_MAX_PARTS) P = SUMSQ_MAX_PARTS;
    const int64_t len = ((n + P - 1) / P + 7) & ~(int64_t)7; /* whole 16-byte loads per part */
    P = (n + len - 1) / len;
    const int vec = ((uintptr_t)g & 15) == 0;
    double *part = (double *)cuda_scratch(be, sizeof(double) * (size_t)P);
    if (!part) return mt_err_wrap(MT_ENOMEM, "sumsq: %lld partial sums", (long long)P);
    sumsq_part_kernel<<<(unsigned)P, SUMSQ_THREADS, 0, st>>>(part, g, g_bf16, vec, n, len);
    CUDA_LAUNCH_CHECK("sumsq");
    sumsq_final_kernel<<<1, 1024, 0, st>>>(out, part, (int)P);
    CUDA_LAUNCH_CHECK("sumsq");
    return MT_OK;
}

__global__ void scale_f32_kernel(float *__restrict__ x, int64_t n, float a)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = x[i] * a;
}

static int cuda_scale_f32(mt_backend *be, float *x, int64_t n, float a)
{
    CUDA_REQUIRE(n >= 0, "scale_f32: n=%lld is negative", (long long)n);
    if (n == 0) return MT_OK;
    CUDA_REQUIRE(x != NULL, "scale_f32: x is NULL");
    scale_f32_kernel<<<cuda_grid(n, 256), 256, 0, cuda_stream(be)>>>(x, n, a);
    CUDA_LAUNCH_CHECK("scale_f32");
    return MT_OK;
}

/* ---- AdamW ------------------------------------------------------------------------------ */

__device__ __forceinline__ float loss_bf16_val(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

/* One element, cpu_optim.c's adamw_one step for step:
 *   g = grad gs; m' = b1 m + (1 - b1) g; v' = b2 v + (1 - b2) g^2
 *   p - lr ((m' / bc1) / (sqrt(v' / bc2) + eps) + wd p)
 * with m', v' used unrounded and stored rounded to bf16. */
/* The hyper-parameters and the reciprocals of the bias corrections (IEEE,
 * once a thread) for cuda_div_by. */
struct aw_hp : mt_adamw_hp {
    float r1, r2;
};

__device__ __forceinline__ aw_hp aw_of(const mt_adamw_hp &h)
{
    aw_hp k;
    static_cast<mt_adamw_hp &>(k) = h;
    k.r1 = __frcp_rn(h.bc1);
    k.r2 = __frcp_rn(h.bc2);
    return k;
}

/* The operations are those written above, each rounded once. With D, the
 * two divisions by the bias corrections go through cuda_div_by and zeros
 * (the moments of a vocabulary's rows that saw no token) pass sqrt and the
 * last division as the quotients they are: the same bits, without the
 * division's slow path. adamw takes D (issue 18: it was bound by its
 * instructions, 69 % of the issue slots busy at 33 % of the DRAM bandwidth
 * on the proxy's embedding; 15.5 -> 10.6 ms a step); adamw_fp8, at 88 % of
 * the copy already, ran 3 % slower with it and does not. */
template <int D>
__device__ __forceinline__ float adamw_val(const aw_hp &hp, float p, uint16_t m, uint16_t v,
                                           float grad, uint16_t *m_out, uint16_t *v_out)
{
    const float g = __fmul_rn(grad, hp.grad_scale);
    const float mi = __fadd_rn(__fmul_rn(hp.beta1, loss_bf16_val(m)),
                               __fmul_rn(__fsub_rn(1.0f, hp.beta1), g));
    const float vi = __fadd_rn(__fmul_rn(hp.beta2, loss_bf16_val(v)),
                               __fmul_rn(__fsub_rn(1.0f, hp.beta2), __fmul_rn(g, g)));
    *m_out = cuda_bf16_rne(mi);
    *v_out = cuda_bf16_rne(vi);
    if (!D) {
        const float den = __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, hp.bc2)), hp.eps);
        const float upd =
            __fadd_rn(__fdiv_rn(__fdiv_rn(mi, hp.bc1), den), __fmul_rn(hp.weight_decay, p));
        return __fsub_rn(p, __fmul_rn(hp.lr, upd));
    }
    const float vh = cuda_div_by(vi, hp.bc2, hp.r2), mh = cuda_div_by(mi, hp.bc1, hp.r1);
    const float den = __fadd_rn(vh == 0.0f ? vh : __fsqrt_rn(vh), hp.eps);
    const float q = mh == 0.0f && den > 0.0f && den < INFINITY ? mh : __fdiv_rn(mh, den);
    const float upd = __fadd_rn(q, __fmul_rn(hp.weight_decay, p));
    return __fsub_rn(p, __fmul_rn(hp.lr, upd));
}

/* Gradient element i: f32, or bf16 bits when hp.grad_bf16. */
__device__ __forceinline__ float grad_at(const mt_adamw_hp &hp, const void *g, int64_t i)
{
    return hp.grad_bf16 ? loss_bf16_val(((const uint16_t *)g)[i]) : ((const float *)g)[i];
}

/* Four gradient elements from one 16-byte (f32) or 8-byte (bf16) load. */
__device__ __forceinline__ void grad_at4(const mt_adamw_hp &hp, const void *g, int64_t i, float *x)
{
    if (hp.grad_bf16) {
        const uint2 w = *(const uint2 *)((const uint16_t *)g + i);
        x[0] = loss_bf16_val((uint16_t)w.x), x[1] = loss_bf16_val((uint16_t)(w.x >> 16));
        x[2] = loss_bf16_val((uint16_t)w.y), x[3] = loss_bf16_val((uint16_t)(w.y >> 16));
    } else {
        const float4 w = *(const float4 *)((const float *)g + i);
        x[0] = w.x, x[1] = w.y, x[2] = w.z, x[3] = w.w;
    }
}

__device__ __forceinline__ float adamw_one(const aw_hp &hp, float p, uint16_t *m,
                                           uint16_t *v, float grad)
{
    return adamw_val<1>(hp, p, *m, *v, grad, m, v);
}

/* Two f32 values as the act copy's bf16 pair (act_from_f32's rounding). */
__device__ __forceinline__ uint32_t aw_act2(float a, float b)
{
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(a)) |
           (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(b)) << 16;
}

/* A bf16 p's rounding: to nearest (adamw), or stochastic with element i's
 * random bits (adamw_sr: act_from_f32_sr's rounding, ms = fp8_mix64(seed)). */
template <int SR>
__device__ __forceinline__ uint16_t aw_round(float x, uint64_t ms, int64_t i)
{
    return SR ? cuda_bf16_sr(x, (uint32_t)fp8_hash_mixed(ms, (uint64_t)i)) : cuda_bf16_rne(x);
}

/* Four consecutive elements from 16-byte (f32) / 8-byte (bf16) words; the
 * element arithmetic is adamw_one's, so results are bit-identical. */
template <int SR>
__device__ __forceinline__ void adamw_vec4(const aw_hp &hp, void *p, int p_bf16,
                                           uint16_t *__restrict__ m, uint16_t *__restrict__ v,
                                           const void *__restrict__ grad, uint16_t *act, int64_t i,
                                           uint64_t ms)
{
    float pv[4], gv[4];
    uint16_t mv[4], vv[4];
    grad_at4(hp, grad, i, gv);
    const uint2 m2 = *(const uint2 *)(m + i), v2 = *(const uint2 *)(v + i);
    mv[0] = (uint16_t)m2.x, mv[1] = (uint16_t)(m2.x >> 16), mv[2] = (uint16_t)m2.y, mv[3] = (uint16_t)(m2.y >> 16);
    vv[0] = (uint16_t)v2.x, vv[1] = (uint16_t)(v2.x >> 16), vv[2] = (uint16_t)v2.y, vv[3] = (uint16_t)(v2.y >> 16);
    if (p_bf16) {
        const uint2 p2 = *(const uint2 *)((uint16_t *)p + i);
        pv[0] = loss_bf16_val((uint16_t)p2.x), pv[1] = loss_bf16_val((uint16_t)(p2.x >> 16));
        pv[2] = loss_bf16_val((uint16_t)p2.y), pv[3] = loss_bf16_val((uint16_t)(p2.y >> 16));
    } else {
        const float4 p4 = *(const float4 *)((float *)p + i);
        pv[0] = p4.x, pv[1] = p4.y, pv[2] = p4.z, pv[3] = p4.w;
    }
    uint16_t mo[4], vo[4];
#pragma unroll
    for (int j = 0; j < 4; j++) pv[j] = adamw_val<1>(hp, pv[j], mv[j], vv[j], gv[j], &mo[j], &vo[j]);
    *(uint2 *)(m + i) = make_uint2(mo[0] | (uint32_t)mo[1] << 16, mo[2] | (uint32_t)mo[3] << 16);
    *(uint2 *)(v + i) = make_uint2(vo[0] | (uint32_t)vo[1] << 16, vo[2] | (uint32_t)vo[3] << 16);
    if (p_bf16) {
        uint16_t h[4];
#pragma unroll
        for (int j = 0; j < 4; j++) h[j] = aw_round<SR>(pv[j], ms, i + j);
        *(uint2 *)((uint16_t *)p + i) = make_uint2(h[0] | (uint32_t)h[1] << 16, h[2] | (uint32_t)h[3] << 16);
        if (act) *(uint2 *)(act + i) = make_uint2(h[0] | (uint32_t)h[1] << 16, h[2] | (uint32_t)h[3] << 16);
    } else {
        *(float4 *)((float *)p + i) = make_float4(pv[0], pv[1], pv[2], pv[3]);
        if (act)
            *(uint2 *)(act + i) = make_uint2(aw_act2(pv[0], pv[1]), aw_act2(pv[2], pv[3]));
    }
}

/* x[0..7] = f[0..7], two 16-byte loads (f 16-byte aligned). */
__device__ __forceinline__ void aw_f32x8_load(const float *f, float *x)
{
    const float4 a = ((const float4 *)f)[0], b = ((const float4 *)f)[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

/* Eight consecutive elements, every load issued before the arithmetic:
 * 16-byte words of the moments and bf16 gradients (two of f32 ones and of
 * an f32 parameter). adamw_vec4's 8-byte loads keep about 40 bytes a thread
 * in flight: on one H200 the proxy's adamw (its 1.85 G embedding and head
 * elements, f32 main, bf16 gradients) took 17.3 ms a step 4-wide and 15.2
 * ms 8-wide. The element arithmetic is adamw_one's: bit-identical. */
template <int SR>
__device__ __forceinline__ void adamw_vec8(const aw_hp &hp, void *p, int p_bf16,
                                           uint16_t *__restrict__ m, uint16_t *__restrict__ v,
                                           const void *__restrict__ grad, uint16_t *act, int64_t i,
                                           uint64_t ms)
{
    float pv[8], gv[8];
    uint16_t mv[8], vv[8];
    const uint4 m4 = *(const uint4 *)(m + i), v4 = *(const uint4 *)(v + i);
    if (hp.grad_bf16) {
        cu_bf16x8_unpack(*(const uint4 *)((const uint16_t *)grad + i), gv);
    } else {
        aw_f32x8_load((const float *)grad + i, gv);
    }
    if (p_bf16) {
        cu_bf16x8_unpack(*(const uint4 *)((const uint16_t *)p + i), pv);
    } else {
        aw_f32x8_load((const float *)p + i, pv);
    }
    const uint32_t mw[4] = {m4.x, m4.y, m4.z, m4.w}, vw[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        mv[2 * j] = (uint16_t)mw[j], mv[2 * j + 1] = (uint16_t)(mw[j] >> 16);
        vv[2 * j] = (uint16_t)vw[j], vv[2 * j + 1] = (uint16_t)(vw[j] >> 16);
    }
    uint16_t mo[8], vo[8];
#pragma unroll
    for (int j = 0; j < 8; j++) pv[j] = adamw_val<1>(hp, pv[j], mv[j], vv[j], gv[j], &mo[j], &vo[j]);
    uint32_t mq[4], vq[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        mq[j] = mo[2 * j] | (uint32_t)mo[2 * j + 1] << 16;
        vq[j] = vo[2 * j] | (uint32_t)vo[2 * j + 1] << 16;
    }
    *(uint4 *)(m + i) = make_uint4(mq[0], mq[1], mq[2], mq[3]);
    *(uint4 *)(v + i) = make_uint4(vq[0], vq[1], vq[2], vq[3]);
    if (p_bf16) {
        uint32_t h[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            h[j] = aw_round<SR>(pv[2 * j], ms, i + 2 * j) |
                   (uint32_t)aw_round<SR>(pv[2 * j + 1], ms, i + 2 * j + 1) << 16;
        *(uint4 *)((uint16_t *)p + i) = make_uint4(h[0], h[1], h[2], h[3]);
        if (act) *(uint4 *)(act + i) = make_uint4(h[0], h[1], h[2], h[3]);
    } else {
        float4 *o = (float4 *)((float *)p + i);
        o[0] = make_float4(pv[0], pv[1], pv[2], pv[3]);
        o[1] = make_float4(pv[4], pv[5], pv[6], pv[7]);
        if (act)
            *(uint4 *)(act + i) = make_uint4(aw_act2(pv[0], pv[1]), aw_act2(pv[2], pv[3]),
                                             aw_act2(pv[4], pv[5]), aw_act2(pv[6], pv[7]));
    }
}

/* Element i of the scalar path: p updated, and its act copy when act. */
template <int SR>
__device__ __forceinline__ void adamw_elem(const aw_hp &hp, void *p, int p_bf16, uint16_t *m,
                                           uint16_t *v, const void *grad, uint16_t *act, int64_t i,
                                           uint64_t ms)
{
    float pn;
    if (p_bf16) {
        uint16_t *pb = (uint16_t *)p;
        pb[i] = aw_round<SR>(adamw_one(hp, loss_bf16_val(pb[i]), m + i, v + i, grad_at(hp, grad, i)),
                             ms, i);
        pn = loss_bf16_val(pb[i]);
    } else {
        float *pf = (float *)p;
        pf[i] = pn = adamw_one(hp, pf[i], m + i, v + i, grad_at(hp, grad, i));
    }
    if (act) act[i] = __bfloat16_as_ushort(__float2bfloat16_rn(pn));
}

/* Groups of 8 elements (vec 2: every array 16-byte aligned) or 4 (vec 1:
 * aligned for adamw_vec4), else one element per thread. act (bf16 bits,
 * or NULL): the updated weight's compute copy, written in the same pass.
 * SR (adamw_sr): a bf16 p rounded stochastically with the bits of
 * mt_hash_u64(seed, i), where adamw rounds to nearest. */
template <int SR>
__global__ void adamw_kernel(void *p, int p_bf16, uint16_t *__restrict__ m, uint16_t *__restrict__ v,
                             const void *__restrict__ grad, uint16_t *__restrict__ act, int64_t n,
                             mt_adamw_hp hp0, int vec, uint64_t seed)
{
    const aw_hp hp = aw_of(hp0);
    const uint64_t ms = SR ? fp8_mix64(seed) : 0; /* the seed's half of the hash, once */
    if (vec) {
        const int w = vec == 2 ? 8 : 4;
        for (int64_t iw = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; iw < n / w;
             iw += (int64_t)gridDim.x * blockDim.x) {
            if (vec == 2) adamw_vec8<SR>(hp, p, p_bf16, m, v, grad, act, 8 * iw, ms);
            else adamw_vec4<SR>(hp, p, p_bf16, m, v, grad, act, 4 * iw, ms);
        }
        /* the n % w last elements */
        const int64_t i = n / w * w + (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) adamw_elem<SR>(hp, p, p_bf16, m, v, grad, act, i, ms);
        return;
    }
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        adamw_elem<SR>(hp, p, p_bf16, m, v, grad, act, i, ms);
}

/* adamw (sr 0) and adamw_sr (sr 1: p bf16, no act copy) */
static int adamw_launch(mt_backend *be, const char *op, void *p, int p_bf16, uint16_t *m,
                        uint16_t *v, const void *grad, int64_t n, const mt_adamw_hp *hp, void *act,
                        int sr, uint64_t seed)
{
    CUDA_REQUIRE(n >= 0, "%s: n=%lld is negative", op, (long long)n);
    CUDA_REQUIRE(hp != NULL, "%s: hp is NULL", op);
    if (n == 0) return MT_OK;
    CUDA_REQUIRE(p && m && v && grad, "%s: NULL pointer", op);
    CUDA_REQUIRE(hp->bc1 > 0 && hp->bc2 > 0, "%s: bias corrections bc1=%g bc2=%g must be > 0", op,
                 hp->bc1, hp->bc2);
    const int vec4 = ((uintptr_t)p % (p_bf16 ? 8 : 16)) == 0 && (uintptr_t)m % 8 == 0 &&
                     (uintptr_t)v % 8 == 0 && (uintptr_t)grad % (hp->grad_bf16 ? 8 : 16) == 0 &&
                     (uintptr_t)act % 8 == 0;
    const int vec8 =
        ((uintptr_t)p | (uintptr_t)m | (uintptr_t)v | (uintptr_t)grad | (uintptr_t)act) % 16 == 0;
    const int vec = vec8 ? 2 : vec4;
    const int64_t per = vec ? 4 * vec : 1; /* elements a thread */
    const dim3 grid = cuda_grid((n + per - 1) / per, 256);
    if (sr)
        adamw_kernel<1><<<grid, 256, 0, cuda_stream(be)>>>(p, p_bf16, m, v, grad,
                                                           (uint16_t *)act, n, *hp, vec, seed);
    else
        adamw_kernel<0><<<grid, 256, 0, cuda_stream(be)>>>(p, p_bf16, m, v, grad,
                                                           (uint16_t *)act, n, *hp, vec, seed);
    CUDA_LAUNCH_CHECK(op);
    return MT_OK;
}

static int cuda_adamw(mt_backend *be, void *p, int p_bf16, uint16_t *m, uint16_t *v,
                      const void *grad, int64_t n, const mt_adamw_hp *hp, void *act)
{
    return adamw_launch(be, "adamw", p, p_bf16, m, v, grad, n, hp, act, 0, 0);
}

/* The act type is bf16 here: the weight is a bf16 p with stochastic rounding. */
static int cuda_adamw_sr(mt_backend *be, void *w, uint16_t *m, uint16_t *v, const void *grad,
                         int64_t n, const mt_adamw_hp *hp, uint64_t seed)
{
    return adamw_launch(be, "adamw_sr", w, 1, m, v, grad, n, hp, NULL, 1, seed);
}

/* ---- adamw_fp8 ---------------------------------------------------------------------------- */

/* One 256-thread block per 128x128 block b = nb * KB + kb of p [N, K]:
 * thread t updates column t % 128 of rows t / 128, + 2, ..., in chunks of
 * AQ_CHUNK rows whose loads are all issued before the first store; the
 * block max of |p'| gives the scale; each thread then re-reads the values it
 * wrote (from L2: 64 KB per block, just written) to store the codes in q and,
 * through a shared tile, in qt [K, N]. Holding the 64 values in registers
 * instead costs 126 registers and ran at half the speed (2 blocks per SM;
 * tests/bench/RESULTS.md). Element order and arithmetic as adamw_kernel
 * then quant_blocks_kernel: bit-identical. */
#define AQ_CHUNK 8

/* A full 128x128 block with 16-byte accesses (the common case: weight dims
 * are multiples of 128 in every DeepSeek-V3 model). Thread t owns columns
 * 4 (t % 32) .. + 3 of rows t / 32 + 8 j (j < 16): a warp reads a 512-byte
 * f32 row segment (or 256 bytes of bf16) with one 16-byte (8-byte) load per
 * thread, and the moments with 8-byte loads; AQ_VROWS rows are loaded before
 * the first store (2, not 4: fewer registers, more blocks resident; on an
 * H200 [18432, 7168] took 1.351 ms with 2 rows, 1.554 with 4, 1.977 with 8,
 * and the proxy's adamw_fp8 41.7 ms a step against 45.2). The codes go to
 * q as 4-byte words and through the shared tile to qt, whose rows get
 * 4-byte words too. The arithmetic of each element and the block amax are
 * adamw_fp8_kernel's: bit-identical. */
#define AQ_VROWS 2

__device__ __forceinline__ void aq_unpack_bf16x4(uint2 w, float *x)
{
    x[0] = loss_bf16_val((uint16_t)w.x), x[1] = loss_bf16_val((uint16_t)(w.x >> 16));
    x[2] = loss_bf16_val((uint16_t)w.y), x[3] = loss_bf16_val((uint16_t)(w.y >> 16));
}

__device__ __forceinline__ uint2 aq_pack_u16x4(const uint16_t *h)
{
    return make_uint2(h[0] | (uint32_t)h[1] << 16, h[2] | (uint32_t)h[3] << 16);
}

__device__ __forceinline__ void adamw_fp8_full_block(
    void *p, int p_bf16, uint16_t *__restrict__ m, uint16_t *__restrict__ v,
    const void *__restrict__ grad, int N, int K, int NB, int KB, int nb, int kb,
    const aw_hp &hp,
    uint8_t *__restrict__ q, float *__restrict__ s, uint8_t *__restrict__ qt,
    float *__restrict__ st, uint8_t (*tile)[MT_QTILE + 4], float *sh)
{
    const int n0 = nb * MT_QTILE, k0 = kb * MT_QTILE;
    const int c0 = 4 * (threadIdx.x & 31), r0 = threadIdx.x >> 5;
    float *__restrict__ pf = (float *)p;
    uint16_t *__restrict__ pb = (uint16_t *)p;
    float amax = 0.0f;
    for (int j0 = 0; j0 < MT_QTILE / 8; j0 += AQ_VROWS) {
        float pv[AQ_VROWS][4], gv[AQ_VROWS][4];
        uint2 mv[AQ_VROWS], vv[AQ_VROWS];
#pragma unroll
        for (int jj = 0; jj < AQ_VROWS; jj++) {
            const int64_t i = (int64_t)(n0 + r0 + 8 * (j0 + jj)) * K + k0 + c0;
            if (p_bf16) {
                aq_unpack_bf16x4(*(const uint2 *)(pb + i), pv[jj]);
            } else {
                const float4 w = *(const float4 *)(pf + i);
                pv[jj][0] = w.x, pv[jj][1] = w.y, pv[jj][2] = w.z, pv[jj][3] = w.w;
            }
            grad_at4(hp, grad, i, gv[jj]);
            mv[jj] = *(const uint2 *)(m + i);
            vv[jj] = *(const uint2 *)(v + i);
        }
#pragma unroll
        for (int jj = 0; jj < AQ_VROWS; jj++) {
            const int64_t i = (int64_t)(n0 + r0 + 8 * (j0 + jj)) * K + k0 + c0;
            const uint16_t mi[4] = {(uint16_t)mv[jj].x, (uint16_t)(mv[jj].x >> 16),
                                    (uint16_t)mv[jj].y, (uint16_t)(mv[jj].y >> 16)};
            const uint16_t vi[4] = {(uint16_t)vv[jj].x, (uint16_t)(vv[jj].x >> 16),
                                    (uint16_t)vv[jj].y, (uint16_t)(vv[jj].y >> 16)};
            uint16_t mo[4], vo[4], h[4];
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                x[e] = adamw_val<0>(hp, pv[jj][e], mi[e], vi[e], gv[jj][e], &mo[e], &vo[e]);
                if (p_bf16) {
                    h[e] = cuda_bf16_rne(x[e]);
                    x[e] = loss_bf16_val(h[e]);
                }
                amax = fmaxf(amax, fabsf(x[e]));
            }
            *(uint2 *)(m + i) = aq_pack_u16x4(mo);
            *(uint2 *)(v + i) = aq_pack_u16x4(vo);
            if (p_bf16)
                *(uint2 *)(pb + i) = aq_pack_u16x4(h);
            else
                *(float4 *)(pf + i) = make_float4(x[0], x[1], x[2], x[3]);
        }
    }
    amax = cu_block_max(amax, sh);
    const float sc = cuda_scale_of(amax);
    if (threadIdx.x == 0) {
        s[(int64_t)nb * KB + kb] = sc;
        st[(int64_t)kb * NB + nb] = sc;
    }
    /* codes from the values just written (ld.global.cg: from L2) */
    for (int j = 0; j < MT_QTILE / 8; j++) {
        const int r = r0 + 8 * j;
        const int64_t i = (int64_t)(n0 + r) * K + k0 + c0;
        float x[4];
        if (p_bf16) {
            aq_unpack_bf16x4(__ldcg((const uint2 *)(pb + i)), x);
        } else {
            const float4 w = __ldcg((const float4 *)(pf + i));
            x[0] = w.x, x[1] = w.y, x[2] = w.z, x[3] = w.w;
        }
        uint32_t code = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) code |= (uint32_t)cuda_e4m3(x[e], sc) << (8 * e);
        *(uint32_t *)(q + i) = code;
        *(uint32_t *)&tile[r][c0] = code;
    }
    __syncthreads();
    /* qt [K, N]: row k0 + kk holds tile column kk; 4 consecutive n per thread */
    for (int j = 0; j < MT_QTILE / 8; j++) {
        const int kk = r0 + 8 * j;
        const uint32_t code = (uint32_t)tile[c0][kk] | (uint32_t)tile[c0 + 1][kk] << 8 |
                              (uint32_t)tile[c0 + 2][kk] << 16 | (uint32_t)tile[c0 + 3][kk] << 24;
        *(uint32_t *)(qt + (int64_t)(k0 + kk) * N + n0 + c0) = code;
    }
}

/* One weight of an adamw_fp8 launch: its arrays, shape, decay, and the
 * first block (of the launch's grid) that is its block 0. */
struct aq_weight {
    void *p;
    uint16_t *m, *v;
    const void *grad;
    uint8_t *q;
    float *s;
    uint8_t *qt;
    float *st;
    int N, K, NB, KB;
    float weight_decay;
    int p_bf16, vec;
    int b0;
};

/* The weights of one launch, passed by value: 32 x 96 bytes keeps the
 * parameters under the classic 4 KB (__grid_constant__ lets a block index
 * them in place instead of copying them to local memory). */
#define AQ_TABLE 32
struct aq_table {
    int n;
    aq_weight w[AQ_TABLE];
};

/* Block b of weight a (128x128 block nb = b / KB, kb = b % KB). */
__device__ __forceinline__ void adamw_fp8_block(const aq_weight &a, const aw_hp &hp, int b,
                                                uint8_t (*tile)[MT_QTILE + 4], float *sh)
{
    void *p = a.p;
    uint16_t *__restrict__ m = a.m, *__restrict__ v = a.v;
    const void *__restrict__ grad = a.grad;
    uint8_t *__restrict__ q = a.q, *__restrict__ qt = a.qt;
    float *__restrict__ s = a.s, *__restrict__ st = a.st;
    const int N = a.N, K = a.K, NB = a.NB, KB = a.KB, p_bf16 = a.p_bf16;
    const int nb = b / KB, kb = b % KB;
    const int n0 = nb * MT_QTILE, k0 = kb * MT_QTILE;
    const int nn = min(MT_QTILE, N - n0), nk = min(MT_QTILE, K - k0);
    if (a.vec && nn == MT_QTILE && nk == MT_QTILE) {
        adamw_fp8_full_block(p, p_bf16, m, v, grad, N, K, NB, KB, nb, kb, hp, q, s, qt, st, tile,
                             sh);
        return;
    }
    const int c = threadIdx.x % MT_QTILE, r1 = threadIdx.x / MT_QTILE;
    float amax = 0.0f;
    float *__restrict__ pf = (float *)p;
    uint16_t *__restrict__ pb = (uint16_t *)p;
    if (c < nk)
        for (int j0 = r1; j0 < nn; j0 += 2 * AQ_CHUNK) {
            float pv[AQ_CHUNK], gv[AQ_CHUNK];
            uint16_t mv[AQ_CHUNK], vv[AQ_CHUNK];
#pragma unroll
            for (int jj = 0; jj < AQ_CHUNK; jj++) {
                const int r = j0 + 2 * jj;
                pv[jj] = gv[jj] = 0.0f;
                mv[jj] = vv[jj] = 0;
                if (r >= nn) continue;
                const int64_t i = (int64_t)(n0 + r) * K + k0 + c;
                pv[jj] = p_bf16 ? loss_bf16_val(pb[i]) : pf[i];
                mv[jj] = m[i];
                vv[jj] = v[i];
                gv[jj] = grad_at(hp, grad, i);
            }
#pragma unroll
            for (int jj = 0; jj < AQ_CHUNK; jj++) {
                const int r = j0 + 2 * jj;
                if (r >= nn) continue;
                const int64_t i = (int64_t)(n0 + r) * K + k0 + c;
                float x = adamw_val<0>(hp, pv[jj], mv[jj], vv[jj], gv[jj], m + i, v + i);
                if (p_bf16) {
                    const uint16_t h = cuda_bf16_rne(x);
                    pb[i] = h;
                    x = loss_bf16_val(h);
                } else {
                    pf[i] = x;
                }
                amax = fmaxf(amax, fabsf(x));
            }
        }
    amax = cu_block_max(amax, sh);
    const float sc = cuda_scale_of(amax);
    if (threadIdx.x == 0) {
        s[b] = sc;
        st[(int64_t)kb * NB + nb] = sc;
    }
    /* each thread re-reads what it wrote (ld.global.cg: from L2) */
    if (c < nk)
        for (int r = r1; r < nn; r += 2) {
            const int64_t i = (int64_t)(n0 + r) * K + k0 + c;
            const float x = p_bf16 ? loss_bf16_val(__ldcg(pb + i)) : __ldcg(pf + i);
            const uint8_t code = cuda_e4m3(x, sc);
            q[i] = code;
            tile[r][c] = code;
        }
    __syncthreads();
    for (int kk = r1; kk < nk; kk += 2)
        if (c < nn) qt[(int64_t)(k0 + kk) * N + n0 + c] = tile[c][kk];
}

/* One grid over the blocks of up to AQ_TABLE weights, in table order, so
 * the proxy's 320 FP8 weights are 10 launches instead of 320. On an H200
 * the proxy's adamw_fp8_n took 35.0-35.3 ms a step against 36.6 for the
 * kernel of one weight a launch (same calls, tests/bench/RESULTS.md); a
 * table of one weight a launch measured the same as 32, so the gain is
 * this kernel's, not the batching's. It runs at 78 % of the copy there
 * (3.1 TB/s), 88 % on the bench's [18432, 7168] with f32 gradients. */
__global__ void __launch_bounds__(256)
adamw_fp8_kernel(const __grid_constant__ aq_table t, mt_adamw_hp hp0)
{
    __shared__ float sh[32];
    __shared__ __align__(16) uint8_t tile[MT_QTILE][MT_QTILE + 4];
    const int b = blockIdx.x;
    int w = 0;
    while (w + 1 < t.n && b >= t.w[w + 1].b0) w++;
    hp0.weight_decay = t.w[w].weight_decay;
    const aw_hp hp = aw_of(hp0);
    adamw_fp8_block(t.w[w], hp, b - t.w[w].b0, tile, sh);
}

/* Checks one weight's arguments and fills its table entry (all but b0). */
static int aq_weight_of(void *p, int p_bf16, uint16_t *m, uint16_t *v, const void *grad, int N,
                        int K, float weight_decay, const mt_adamw_hp *hp, uint8_t *q, float *s,
                        uint8_t *qt, float *st, aq_weight *a)
{
    CUDA_REQUIRE(N >= 1 && K >= 1, "adamw_fp8: N=%d K=%d", N, K);
    CUDA_REQUIRE(p && m && v && grad && q && s && qt && st, "adamw_fp8: NULL pointer");
    const int NB = mt_ceil_div(N, MT_QTILE), KB = mt_ceil_div(K, MT_QTILE);
    CUDA_REQUIRE((int64_t)NB * KB < (1 << 30), "adamw_fp8: %d x %d blocks", NB, KB);
    /* 16-byte accesses need K % 4 == 0 (row starts), N % 4 == 0 (qt rows)
     * and aligned arrays */
    const int vec = K % 4 == 0 && N % 4 == 0 && (uintptr_t)p % (p_bf16 ? 8 : 16) == 0 &&
                    (uintptr_t)grad % (hp->grad_bf16 ? 8 : 16) == 0 && (uintptr_t)m % 8 == 0 &&
                    (uintptr_t)v % 8 == 0 && (uintptr_t)q % 4 == 0 && (uintptr_t)qt % 4 == 0;
    *a = aq_weight{p, m, v, grad, q, s, qt, st, N, K, NB, KB, weight_decay, p_bf16, vec, 0};
    return MT_OK;
}

static int aq_check_hp(const mt_adamw_hp *hp)
{
    CUDA_REQUIRE(hp != NULL, "adamw_fp8: hp is NULL");
    CUDA_REQUIRE(hp->bc1 > 0 && hp->bc2 > 0, "adamw_fp8: bias corrections bc1=%g bc2=%g must be > 0",
                 hp->bc1, hp->bc2);
    return MT_OK;
}

/* Enqueues table t (its b0 set here) on `stream`. */
static int aq_launch(cudaStream_t stream, aq_table *t, const mt_adamw_hp *hp)
{
    int64_t blocks = 0;
    for (int i = 0; i < t->n; i++) {
        t->w[i].b0 = (int)blocks;
        blocks += (int64_t)t->w[i].NB * t->w[i].KB;
    }
    CUDA_REQUIRE(blocks < INT32_MAX, "adamw_fp8: %lld blocks in one launch", (long long)blocks);
    adamw_fp8_kernel<<<(unsigned)blocks, 256, 0, stream>>>(*t, *hp);
    CUDA_LAUNCH_CHECK("adamw_fp8");
    return MT_OK;
}

static int cuda_adamw_fp8(mt_backend *be, void *p, int p_bf16, uint16_t *m, uint16_t *v,
                          const void *grad, int N, int K, const mt_adamw_hp *hp, uint8_t *q,
                          float *s, uint8_t *qt, float *st)
{
    MT_CHECK(aq_check_hp(hp));
    aq_table t;
    t.n = 1;
    MT_CHECK(aq_weight_of(p, p_bf16, m, v, grad, N, K, hp->weight_decay, hp, q, s, qt, st,
                          &t.w[0]));
    return aq_launch(cuda_stream(be), &t, hp);
}

/* The weights in launches of up to AQ_TABLE, launch j on expert stream
 * j % 4, joined back into the main stream at the end. */
static int cuda_adamw_fp8_n(mt_backend *be, int n, const mt_adamw_fp8_arg *w,
                            const mt_adamw_hp *hp)
{
    CUDA_REQUIRE(n >= 0, "adamw_fp8_n: n=%d is negative", n);
    CUDA_REQUIRE(hp != NULL && (n == 0 || w != NULL), "adamw_fp8_n: NULL pointer");
    if (n == 0) return MT_OK;
    MT_CHECK(aq_check_hp(hp));
    /* every weight checked before anything is enqueued */
    static_assert(sizeof(aq_table) + sizeof(mt_adamw_hp) <= 4096, "adamw_fp8 parameters");
    const int L = mt_ceil_div(n, AQ_TABLE);
    aq_table *t = (aq_table *)malloc((size_t)L * sizeof *t);
    CUDA_REQUIRE(t != NULL, "adamw_fp8_n: out of host memory for %d tables", L);
    int rc = MT_OK;
    for (int i = 0; i < n && rc == MT_OK; i++) {
        aq_table *ti = &t[i / AQ_TABLE];
        ti->n = i % AQ_TABLE + 1;
        rc = aq_weight_of(w[i].p, w[i].p_bf16, w[i].m, w[i].v, w[i].grad, w[i].N, w[i].K,
                          w[i].weight_decay, hp, w[i].q, w[i].s, w[i].qt, w[i].st,
                          &ti->w[i % AQ_TABLE]);
    }
    if (rc != MT_OK) {
        free(t);
        return rc;
    }
    cuda_impl *c = cuda_of(be);
    const int S = L < CUDA_EXPERT_STREAMS ? L : CUDA_EXPERT_STREAMS;
    rc = S > 1 ? cuda_fan_out(be, S) : MT_OK;
    for (int j = 0; j < L && rc == MT_OK; j++)
        rc = aq_launch(S > 1 ? c->xstream[j % S] : cuda_stream(be), &t[j], hp);
    free(t);
    if (S == 1) return rc;
    /* joined even after an error: the main stream never runs ahead of them */
    const int rc2 = cuda_fan_in(be, S);
    return rc != MT_OK ? rc : rc2;
}

/* ---- adamw_fp8_sr --------------------------------------------------------------------- */

/* The update of an FP8 weight with no main copy (main_params none), one
 * 256-thread block per 128x128 block b = nb * KB + kb of q [N, K]: thread t
 * owns column t % 128 of rows t / 128, + 2, ...; it dequantises each code
 * with the block's old scale, updates it (adamw_val) and keeps the value in
 * a shared f32 tile; the block max gives the new scale; each thread then
 * rounds its values stochastically with quant_blocks_sr's random bits (the
 * slab's seed, the element's index from the slab's start) into q, and
 * leaves each code in its float's first byte for the transposed stores to
 * qt. The element arithmetic is dequant_blocks', adamw's and
 * quant_blocks_sr's: bit-identical to the three ops and transpose_blocks in
 * sequence, which took four passes over the weight (on an H100 the
 * proxy's quant_blocks_sr alone ran at 22 % of the copy, 42.8 ms a step). */
#define AS_LD (MT_QTILE + 1) /* floats a tile row: column reads meet no bank conflict */
#define AS_CHUNK 8           /* rows loaded before the first update */

/* Shared by both adamw_fp8_sr kernels. The block's new scale from the max
 * of its updated values, published by thread 0 in s (where every thread
 * has already read the old one: cu_block_max synchronises) and in st. */
__device__ __forceinline__ float as_new_scale(float amax, float *sh, float *s, float *st, int b,
                                              int nb, int kb, int NB)
{
    const float sc = cuda_scale_of(cu_block_max(amax, sh));
    if (threadIdx.x == 0) {
        s[b] = sc;
        st[(int64_t)kb * NB + nb] = sc;
    }
    return sc;
}

/* Slabs are whole 128-row blocks (or the whole weight): the seed of the
 * slab holding row n0, mixed once (fp8_hash_mixed's m), and its first
 * element (the random bits number elements from there). */
__device__ __forceinline__ uint64_t as_slab_seed(uint64_t seed, int slab_rows, int N, int K,
                                                 int n0, int64_t *base)
{
    const int slab = slab_rows >= N ? 0 : n0 / slab_rows;
    *base = (int64_t)slab * slab_rows * K;
    return fp8_mix64(slab_rows >= N ? seed
                                    : fp8_hash_mixed(fp8_mix64(seed), (uint64_t)slab + 1));
}

__global__ void __launch_bounds__(256)
adamw_fp8_sr_kernel(uint8_t *__restrict__ q, float *__restrict__ s, uint16_t *__restrict__ m,
                    uint16_t *__restrict__ v, const void *__restrict__ grad, int N, int K,
                    int NB, int KB, mt_adamw_hp hp0, uint64_t seed, int slab_rows,
                    uint8_t *__restrict__ qt, float *__restrict__ st)
{
    extern __shared__ float as_tile[]; /* [MT_QTILE][AS_LD] */
    __shared__ float sh[32];
    const aw_hp hp = aw_of(hp0);
    const int b = blockIdx.x, nb = b / KB, kb = b % KB;
    const int n0 = nb * MT_QTILE, k0 = kb * MT_QTILE;
    const int nn = min(MT_QTILE, N - n0), nk = min(MT_QTILE, K - k0);
    const int c = threadIdx.x % MT_QTILE, r1 = threadIdx.x / MT_QTILE;
    const float s_old = s[b];
    float amax = 0.0f;
    if (c < nk)
        for (int j0 = r1; j0 < nn; j0 += 2 * AS_CHUNK) {
            uint8_t qv[AS_CHUNK];
            uint16_t mv[AS_CHUNK], vv[AS_CHUNK];
            float gv[AS_CHUNK];
#pragma unroll
            for (int jj = 0; jj < AS_CHUNK; jj++) {
                const int r = j0 + 2 * jj;
                qv[jj] = 0, mv[jj] = vv[jj] = 0, gv[jj] = 0.0f;
                if (r >= nn) continue;
                const int64_t i = (int64_t)(n0 + r) * K + k0 + c;
                qv[jj] = q[i], mv[jj] = m[i], vv[jj] = v[i], gv[jj] = grad_at(hp, grad, i);
            }
#pragma unroll
            for (int jj = 0; jj < AS_CHUNK; jj++) {
                const int r = j0 + 2 * jj;
                if (r >= nn) continue;
                const int64_t i = (int64_t)(n0 + r) * K + k0 + c;
                const float p = cuda_e4m3_val(qv[jj]) * s_old;
                const float x = adamw_val<1>(hp, p, mv[jj], vv[jj], gv[jj], m + i, v + i);
                as_tile[r * AS_LD + c] = x;
                amax = fmaxf(amax, fabsf(x));
            }
        }
    const float sc = as_new_scale(amax, sh, s, st, b, nb, kb, NB);
    int64_t base;
    const uint64_t ms = as_slab_seed(seed, slab_rows, N, K, n0, &base);
    const float rsc = __frcp_rn(sc); /* x / sc as cuda_div_by's IEEE quotient */
    if (c < nk)
        for (int r = r1; r < nn; r += 2) {
            const int64_t i = (int64_t)(n0 + r) * K + k0 + c;
            float *e = &as_tile[r * AS_LD + c];
            const uint8_t code = fp8_e4m3_sr_bits(cuda_div_by(*e, sc, rsc),
                                                  fp8_hash_mixed(ms, (uint64_t)(i - base)));
            q[i] = code;
            *(uint8_t *)e = code;
        }
    __syncthreads();
    for (int kk = r1; kk < nk; kk += 2)
        if (c < nn) qt[(int64_t)(k0 + kk) * N + n0 + c] = *(const uint8_t *)&as_tile[c * AS_LD + kk];
}

/* The same update with vector accesses, for N % 4 == 0 and K % 4 == 0 (every
 * FP8 weight of the proxy). The scalar kernel above took 12 memory
 * instructions per element (a byte, or two, a thread each), which bound it
 * at 21-25 % of the copy on the proxy (tests/bench/RESULTS.md, thirteenth
 * round); here a warp owns a row of the block, lane l its columns 4 l ..
 * 4 l + 3: 4 codes, 4 moments of each kind and 4 gradients per load, a
 * float4 into the tile. The codes of row r then go into the first 128
 * bytes of the row's own tile space (its floats are in registers by then),
 * word w at w ^ (r / 4 % 32), so that the transposed stores read a 4 x 4
 * byte block per lane (rows 4 l .. 4 l + 3 of one word column) without a
 * bank conflict, transpose it in registers and write 4 codes to each of 4
 * rows of qt. Element arithmetic, random bits and scales are the scalar
 * kernel's: the outputs are the same bits (test_ops_cuda).
 * 16 warps a block (warp w: rows w, w + 16, ...), 2 rows loaded ahead, at
 * most 64 registers: 2 blocks and 32 warps an SM, where 8 warps of 80
 * registers gave 3 blocks and 24 warps; the kernel is bound by its
 * instructions (Nsight Compute: the ALU pipe the busiest, no warp eligible
 * in a third of the cycles at 24), and on an H200 the [7168, 2048] update
 * took 0.127 ms against 0.150, [18432, 7168] 1.006 against 1.113. */
#define AV_WARPS 16
#define AV_AHEAD 2 /* rows a warp loads before updating them */

/* Rows a0..a3 (byte j of a_i = column j) to columns: byte i of c_j = a_i's byte j. */
__device__ __forceinline__ void av_transpose4(const uint32_t a[4], uint32_t c[4])
{
    const uint32_t t0 = __byte_perm(a[0], a[1], 0x5140), t1 = __byte_perm(a[0], a[1], 0x7362);
    const uint32_t t2 = __byte_perm(a[2], a[3], 0x5140), t3 = __byte_perm(a[2], a[3], 0x7362);
    c[0] = __byte_perm(t0, t2, 0x5410), c[1] = __byte_perm(t0, t2, 0x7632);
    c[2] = __byte_perm(t1, t3, 0x5410), c[3] = __byte_perm(t1, t3, 0x7632);
}

__global__ void __launch_bounds__(32 * AV_WARPS, 2)
adamw_fp8_sr_vec_kernel(uint8_t *__restrict__ q, float *__restrict__ s, uint16_t *__restrict__ m,
                        uint16_t *__restrict__ v, const void *__restrict__ grad, int N, int K,
                        int NB, int KB, mt_adamw_hp hp0, uint64_t seed, int slab_rows,
                        uint8_t *__restrict__ qt, float *__restrict__ st)
{
    extern __shared__ float4 av_tile[]; /* [MT_QTILE][MT_QTILE / 4] */
    __shared__ float sh[32];
    const aw_hp hp = aw_of(hp0);
    const int b = blockIdx.x, nb = b / KB, kb = b % KB;
    const int n0 = nb * MT_QTILE, k0 = kb * MT_QTILE;
    const int nn = min(MT_QTILE, N - n0), nk = min(MT_QTILE, K - k0); /* multiples of 4 */
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, c = 4 * lane;
    const bool col_in = c < nk;
    const float s_old = s[b];
    float amax = 0.0f;
    if (col_in)
        for (int r0 = w; r0 < nn; r0 += AV_WARPS * AV_AHEAD) {
            uint32_t qv[AV_AHEAD];
            uint2 mv[AV_AHEAD], vv[AV_AHEAD];
            float gv[AV_AHEAD][4];
#pragma unroll
            for (int jj = 0; jj < AV_AHEAD; jj++) {
                const int r = r0 + AV_WARPS * jj;
                if (r >= nn) continue;
                const int64_t i = (int64_t)(n0 + r) * K + k0 + c;
                qv[jj] = *(const uint32_t *)(q + i);
                mv[jj] = *(const uint2 *)(m + i);
                vv[jj] = *(const uint2 *)(v + i);
                grad_at4(hp, grad, i, gv[jj]);
            }
#pragma unroll
            for (int jj = 0; jj < AV_AHEAD; jj++) {
                const int r = r0 + AV_WARPS * jj;
                if (r >= nn) continue;
                const int64_t i = (int64_t)(n0 + r) * K + k0 + c;
                const uint16_t mi[4] = {(uint16_t)mv[jj].x, (uint16_t)(mv[jj].x >> 16),
                                        (uint16_t)mv[jj].y, (uint16_t)(mv[jj].y >> 16)};
                const uint16_t vi[4] = {(uint16_t)vv[jj].x, (uint16_t)(vv[jj].x >> 16),
                                        (uint16_t)vv[jj].y, (uint16_t)(vv[jj].y >> 16)};
                uint16_t mo[4], vo[4];
                float x[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float p = cuda_e4m3_val((uint8_t)(qv[jj] >> (8 * e))) * s_old;
                    x[e] = adamw_val<1>(hp, p, mi[e], vi[e], gv[jj][e], &mo[e], &vo[e]);
                    amax = fmaxf(amax, fabsf(x[e]));
                }
                *(uint2 *)(m + i) = make_uint2(mo[0] | (uint32_t)mo[1] << 16, mo[2] | (uint32_t)mo[3] << 16);
                *(uint2 *)(v + i) = make_uint2(vo[0] | (uint32_t)vo[1] << 16, vo[2] | (uint32_t)vo[3] << 16);
                av_tile[r * (MT_QTILE / 4) + lane] = make_float4(x[0], x[1], x[2], x[3]);
            }
        }
    const float sc = as_new_scale(amax, sh, s, st, b, nb, kb, NB);
    int64_t base;
    const uint64_t ms = as_slab_seed(seed, slab_rows, N, K, n0, &base);
    const float rsc = __frcp_rn(sc);
    for (int r = w; r < nn; r += AV_WARPS) { /* warp-uniform: every lane meets __syncwarp */
        float4 x4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (col_in) x4 = av_tile[r * (MT_QTILE / 4) + lane];
        __syncwarp(); /* the row's floats are read before its codes overwrite them */
        if (!col_in) continue;
        const int64_t i = (int64_t)(n0 + r) * K + k0 + c;
        const float x[4] = {x4.x, x4.y, x4.z, x4.w};
        /* fp8_hash_mixed(ms, i + e - base): the counter's product once */
        const uint64_t kc = (uint64_t)(i - base) * FP8_HASH_K;
        uint32_t codes = 0;
#pragma unroll
        for (int e = 0; e < 4; e++)
            codes |= (uint32_t)fp8_e4m3_sr_bits(cuda_div_by(x[e], sc, rsc),
                                                fp8_mix64(ms ^ (kc + (uint64_t)e * FP8_HASH_K)))
                     << (8 * e);
        *(uint32_t *)(q + i) = codes;
        ((uint32_t *)&av_tile[r * (MT_QTILE / 4)])[lane ^ ((r >> 2) & 31)] = codes;
    }
    __syncthreads();
    /* lane l: rows 4 l .. 4 l + 3 of the block (qt's columns n0 + 4 l ..),
     * word columns kc = w, w + AV_WARPS, ... (qt's rows k0 + 4 kc ..) */
    if (c < nn)
        for (int kc = w; 4 * kc < nk; kc += AV_WARPS) {
            uint32_t a[4], col[4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                a[i] = ((const uint32_t *)&av_tile[(c + i) * (MT_QTILE / 4)])[kc ^ lane];
            av_transpose4(a, col);
#pragma unroll
            for (int j = 0; j < 4; j++)
                *(uint32_t *)(qt + (int64_t)(k0 + 4 * kc + j) * N + n0 + c) = col[j];
        }
}

/* Checks one weight's arguments (nothing enqueued). */
static int as_check(const uint8_t *q, const float *s, const uint16_t *m, const uint16_t *v,
                    const void *grad, int N, int K, const mt_adamw_hp *hp, int slab_rows,
                    const uint8_t *qt, const float *st)
{
    CUDA_REQUIRE(N >= 1 && K >= 1, "adamw_fp8_sr: N=%d K=%d", N, K);
    CUDA_REQUIRE(hp && q && s && m && v && grad && qt && st, "adamw_fp8_sr: NULL pointer");
    CUDA_REQUIRE(hp->bc1 > 0 && hp->bc2 > 0,
                 "adamw_fp8_sr: bias corrections bc1=%g bc2=%g must be > 0", hp->bc1, hp->bc2);
    CUDA_REQUIRE(slab_rows >= N || (slab_rows > 0 && slab_rows % MT_QTILE == 0),
                 "adamw_fp8_sr: slabs of %d rows (N=%d): whole 128-row blocks or the weight",
                 slab_rows, N);
    return MT_OK;
}

/* Enqueues one checked weight's update on `stream`. */
static int as_launch(cudaStream_t stream, uint8_t *q, float *s, uint16_t *m, uint16_t *v,
                     const void *grad, int N, int K, const mt_adamw_hp *hp, uint64_t seed,
                     int slab_rows, uint8_t *qt, float *st)
{
    const int NB = mt_ceil_div(N, MT_QTILE), KB = mt_ceil_div(K, MT_QTILE);
    const unsigned blocks = (unsigned)((int64_t)NB * KB);
    /* the vector kernel's accesses: 4 codes, 4 bf16 moments and 4
     * gradients a thread, 4 codes of qt; the scalar one takes the rest */
    const int vec = N % 4 == 0 && K % 4 == 0 && (uintptr_t)q % 4 == 0 &&
                    (uintptr_t)qt % 4 == 0 && (uintptr_t)m % 8 == 0 && (uintptr_t)v % 8 == 0 &&
                    (uintptr_t)grad % (hp->grad_bf16 ? 8 : 16) == 0;
    if (vec) {
        const size_t smem = sizeof(float) * MT_QTILE * MT_QTILE;
        MT_CUDA_CHECK(cudaFuncSetAttribute(adamw_fp8_sr_vec_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        adamw_fp8_sr_vec_kernel<<<blocks, 32 * AV_WARPS, smem, stream>>>(
            q, s, m, v, grad, N, K, NB, KB, *hp, seed, slab_rows, qt, st);
    } else {
        const size_t smem = sizeof(float) * MT_QTILE * AS_LD;
        MT_CUDA_CHECK(cudaFuncSetAttribute(adamw_fp8_sr_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        adamw_fp8_sr_kernel<<<blocks, 256, smem, stream>>>(
            q, s, m, v, grad, N, K, NB, KB, *hp, seed, slab_rows, qt, st);
    }
    CUDA_LAUNCH_CHECK("adamw_fp8_sr");
    return MT_OK;
}

static int cuda_adamw_fp8_sr(mt_backend *be, uint8_t *q, float *s, uint16_t *m, uint16_t *v,
                             const void *grad, int N, int K, const mt_adamw_hp *hp,
                             uint64_t seed, int slab_rows, uint8_t *qt, float *st)
{
    MT_CHECK(as_check(q, s, m, v, grad, N, K, hp, slab_rows, qt, st));
    return as_launch(cuda_stream(be), q, s, m, v, grad, N, K, hp, seed, slab_rows, qt, st);
}

/* Weight i on expert stream i % S, joined back into the main stream at the
 * end: a launch of one weight leaves SMs idle in its last wave (the
 * experts' [2048, 7168]: 896 blocks at 2 an SM, 3.4 waves on 132 SMs),
 * which the next weight's blocks fill when they are on another stream. */
static int cuda_adamw_fp8_sr_n(mt_backend *be, int n, const mt_adamw_fp8_sr_arg *w,
                               const mt_adamw_hp *hp)
{
    CUDA_REQUIRE(n >= 0, "adamw_fp8_sr_n: n=%d is negative", n);
    CUDA_REQUIRE(hp != NULL && (n == 0 || w != NULL), "adamw_fp8_sr_n: NULL pointer");
    /* every weight checked before anything is enqueued */
    for (int i = 0; i < n; i++)
        MT_CHECK(as_check(w[i].q, w[i].s, w[i].m, w[i].v, w[i].grad, w[i].N, w[i].K, hp,
                          w[i].slab_rows, w[i].qt, w[i].st));
    if (n == 0) return MT_OK;
    cuda_impl *c = cuda_of(be);
    const int S = n < CUDA_EXPERT_STREAMS ? n : CUDA_EXPERT_STREAMS;
    int rc = S > 1 ? cuda_fan_out(be, S) : MT_OK;
    for (int i = 0; i < n && rc == MT_OK; i++) {
        mt_adamw_hp h = *hp;
        h.weight_decay = w[i].weight_decay;
        rc = as_launch(S > 1 ? c->xstream[i % S] : cuda_stream(be), w[i].q, w[i].s, w[i].m,
                       w[i].v, w[i].grad, w[i].N, w[i].K, &h, w[i].seed, w[i].slab_rows,
                       w[i].qt, w[i].st);
    }
    if (S == 1) return rc;
    /* joined even after an error: the main stream never runs ahead of them */
    const int rc2 = cuda_fan_in(be, S);
    return rc != MT_OK ? rc : rc2;
}

/* ---- bf16_to_f32 ------------------------------------------------------------------------ */

__global__ void bf16_to_f32_kernel(float *__restrict__ dst, const uint16_t *__restrict__ src,
                                   int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = loss_bf16_val(src[i]);
}

static int cuda_bf16_to_f32(mt_backend *be, float *dst, const uint16_t *src, int64_t n)
{
    CUDA_REQUIRE(n >= 0, "bf16_to_f32: n=%lld is negative", (long long)n);
    if (n == 0) return MT_OK;
    CUDA_REQUIRE(dst && src, "bf16_to_f32: NULL pointer");
    bf16_to_f32_kernel<<<cuda_grid(n, 256), 256, 0, cuda_stream(be)>>>(dst, src, n);
    CUDA_LAUNCH_CHECK("bf16_to_f32");
    return MT_OK;
}

void cuda_install_loss(mt_backend *be)
{
    be->xent = cuda_xent;
    be->xent_part_stats = cuda_xent_part_stats;
    be->xent_part_finish = cuda_xent_part_finish;
    be->sumsq = cuda_sumsq;
    be->scale_f32 = cuda_scale_f32;
    be->adamw = cuda_adamw;
    be->adamw_fp8 = cuda_adamw_fp8;
    be->adamw_fp8_n = cuda_adamw_fp8_n;
    be->adamw_fp8_sr = cuda_adamw_fp8_sr;
    be->adamw_fp8_sr_n = cuda_adamw_fp8_sr_n;
    be->adamw_sr = cuda_adamw_sr;
    be->bf16_to_f32 = cuda_bf16_to_f32;
}
