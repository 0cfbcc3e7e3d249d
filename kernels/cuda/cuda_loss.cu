/* cuda_loss.cu - cross-entropy fused with the head's softmax, and the
 * optimizer ops: deterministic sum of squares, scaling, AdamW with bf16
 * moments, bf16 -> f32.
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
 *   xent         one 512-thread block per row: max, sum of exp (double),
 *                then the gradient written in place
 *   sumsq        P <= 4096 blocks each summing a fixed contiguous range in
 *                double (fixed tree), then one block adding the P partials
 *                (fixed tree): deterministic for a given n
 *   scale_f32, adamw, bf16_to_f32: element-wise grid-stride
 *   adamw_fp8    one 256-thread block per 128x128 weight block: AdamW,
 *                block amax, quantise, and the transposed copy via shared
 *                memory (one pass instead of adamw + quant + transpose)
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

static int cuda_xent(mt_backend *be, float *loss, void *logits, const int32_t *tgt, int M, int V,
                     int ignore, float grad_scale)
{
    CUDA_REQUIRE(M >= 0 && V >= 1, "xent: M=%d V=%d", M, V);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(loss && logits && tgt, "xent: NULL pointer");
    xent_kernel<<<M, XENT_THREADS, 0, cuda_stream(be)>>>(loss, (bf16 *)logits, tgt, V, ignore,
                                                         grad_scale);
    CUDA_LAUNCH_CHECK("xent");
    return MT_OK;
}

/* ---- sumsq, scale_f32 ---------------------------------------------------------------- */

#define SUMSQ_THREADS 256
#define SUMSQ_MAX_PARTS 4096
#define SUMSQ_MIN_PART 8192 /* elements per partial, at least */

/* part[p] = sum of g[i]^2 (double) over i in [p * len, min(n, (p + 1) len)). */
__global__ void __launch_bounds__(SUMSQ_THREADS)
sumsq_part_kernel(double *__restrict__ part, const float *__restrict__ g, int64_t n, int64_t len)
{
    __shared__ double sh[32];
    const int64_t i0 = (int64_t)blockIdx.x * len;
    const int64_t i1 = min(n, i0 + len);
    double acc = 0.0;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        double v = (double)g[i];
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

static int cuda_sumsq(mt_backend *be, float *out, const float *g, int64_t n)
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
    const int64_t len = (n + P - 1) / P;
    P = (n + len - 1) / len;
    double *part = (double *)cuda_scratch(be, sizeof(double) * (size_t)P);
    if (!part) return mt_err_wrap(MT_ENOMEM, "sumsq: %lld partial sums", (long long)P);
    sumsq_part_kernel<<<(unsigned)P, SUMSQ_THREADS, 0, st>>>(part, g, n, len);
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

/* mt_bf16_from_f32: round to nearest even, quiet NaN. */
__device__ __forceinline__ uint16_t loss_bf16_rne(float x)
{
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One element, cpu_optim.c's adamw_one step for step:
 *   g = grad gs; m' = b1 m + (1 - b1) g; v' = b2 v + (1 - b2) g^2
 *   p - lr ((m' / bc1) / (sqrt(v' / bc2) + eps) + wd p)
 * with m', v' used unrounded and stored rounded to bf16. */
__device__ __forceinline__ float adamw_val(const mt_adamw_hp &hp, float p, uint16_t m, uint16_t v,
                                           float grad, uint16_t *m_out, uint16_t *v_out)
{
    const float g = __fmul_rn(grad, hp.grad_scale);
    const float mi = __fadd_rn(__fmul_rn(hp.beta1, loss_bf16_val(m)),
                               __fmul_rn(__fsub_rn(1.0f, hp.beta1), g));
    const float vi = __fadd_rn(__fmul_rn(hp.beta2, loss_bf16_val(v)),
                               __fmul_rn(__fsub_rn(1.0f, hp.beta2), __fmul_rn(g, g)));
    *m_out = loss_bf16_rne(mi);
    *v_out = loss_bf16_rne(vi);
    const float den = __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, hp.bc2)), hp.eps);
    const float upd = __fadd_rn(__fdiv_rn(__fdiv_rn(mi, hp.bc1), den), __fmul_rn(hp.weight_decay, p));
    return __fsub_rn(p, __fmul_rn(hp.lr, upd));
}

__device__ __forceinline__ float adamw_one(const mt_adamw_hp &hp, float p, uint16_t *m,
                                           uint16_t *v, float grad)
{
    return adamw_val(hp, p, *m, *v, grad, m, v);
}

__global__ void adamw_kernel(void *p, int p_bf16, uint16_t *__restrict__ m, uint16_t *__restrict__ v,
                             const float *__restrict__ grad, int64_t n, mt_adamw_hp hp)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (p_bf16) {
            uint16_t *pb = (uint16_t *)p;
            pb[i] = loss_bf16_rne(adamw_one(hp, loss_bf16_val(pb[i]), m + i, v + i, grad[i]));
        } else {
            float *pf = (float *)p;
            pf[i] = adamw_one(hp, pf[i], m + i, v + i, grad[i]);
        }
    }
}

static int cuda_adamw(mt_backend *be, void *p, int p_bf16, uint16_t *m, uint16_t *v,
                      const float *grad, int64_t n, const mt_adamw_hp *hp)
{
    CUDA_REQUIRE(n >= 0, "adamw: n=%lld is negative", (long long)n);
    CUDA_REQUIRE(hp != NULL, "adamw: hp is NULL");
    if (n == 0) return MT_OK;
    CUDA_REQUIRE(p && m && v && grad, "adamw: NULL pointer");
    CUDA_REQUIRE(hp->bc1 > 0 && hp->bc2 > 0, "adamw: bias corrections bc1=%g bc2=%g must be > 0",
                 hp->bc1, hp->bc2);
    adamw_kernel<<<cuda_grid(n, 256), 256, 0, cuda_stream(be)>>>(p, p_bf16, m, v, grad, n, *hp);
    CUDA_LAUNCH_CHECK("adamw");
    return MT_OK;
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

__global__ void __launch_bounds__(256)
adamw_fp8_kernel(void *p, int p_bf16, uint16_t *__restrict__ m, uint16_t *__restrict__ v,
                 const float *__restrict__ grad, int N, int K, int NB, int KB, mt_adamw_hp hp,
                 uint8_t *__restrict__ q, float *__restrict__ s, uint8_t *__restrict__ qt,
                 float *__restrict__ st)
{
    __shared__ float sh[32];
    __shared__ uint8_t tile[MT_QTILE][MT_QTILE + 4];
    const int b = blockIdx.x, nb = b / KB, kb = b % KB;
    const int n0 = nb * MT_QTILE, k0 = kb * MT_QTILE;
    const int nn = min(MT_QTILE, N - n0), nk = min(MT_QTILE, K - k0);
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
                gv[jj] = grad[i];
            }
#pragma unroll
            for (int jj = 0; jj < AQ_CHUNK; jj++) {
                const int r = j0 + 2 * jj;
                if (r >= nn) continue;
                const int64_t i = (int64_t)(n0 + r) * K + k0 + c;
                float x = adamw_val(hp, pv[jj], mv[jj], vv[jj], gv[jj], m + i, v + i);
                if (p_bf16) {
                    const uint16_t h = loss_bf16_rne(x);
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

static int cuda_adamw_fp8(mt_backend *be, void *p, int p_bf16, uint16_t *m, uint16_t *v,
                          const float *grad, int N, int K, const mt_adamw_hp *hp, uint8_t *q,
                          float *s, uint8_t *qt, float *st)
{
    CUDA_REQUIRE(N >= 1 && K >= 1, "adamw_fp8: N=%d K=%d", N, K);
    CUDA_REQUIRE(hp != NULL, "adamw_fp8: hp is NULL");
    CUDA_REQUIRE(p && m && v && grad && q && s && qt && st, "adamw_fp8: NULL pointer");
    CUDA_REQUIRE(hp->bc1 > 0 && hp->bc2 > 0, "adamw_fp8: bias corrections bc1=%g bc2=%g must be > 0",
                 hp->bc1, hp->bc2);
    const int NB = mt_ceil_div(N, MT_QTILE), KB = mt_ceil_div(K, MT_QTILE);
    adamw_fp8_kernel<<<(unsigned)((int64_t)NB * KB), 256, 0, cuda_stream(be)>>>(
        p, p_bf16, m, v, grad, N, K, NB, KB, *hp, q, s, qt, st);
    CUDA_LAUNCH_CHECK("adamw_fp8");
    return MT_OK;
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
    be->sumsq = cuda_sumsq;
    be->scale_f32 = cuda_scale_f32;
    be->adamw = cuda_adamw;
    be->adamw_fp8 = cuda_adamw_fp8;
    be->bf16_to_f32 = cuda_bf16_to_f32;
}
