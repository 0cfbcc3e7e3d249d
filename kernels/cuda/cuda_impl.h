/* cuda_impl.h - private state and helpers of the CUDA backend.
 *
 * Every op of struct mt_backend (kernels/ops.h) has a CUDA implementation in
 * the cuda_*.cu files beside this header; each file installs its function
 * pointers with a cuda_install_* call from mt_backend_cuda_create. The CPU
 * backend is the oracle: tests/test_ops_cuda.c compares every op with it.
 *
 * Rules all CUDA ops follow:
 *  - act buffers are bf16 (__nv_bfloat16); f32, i32, e4m3 buffers as ops.h.
 *    Arithmetic inside a kernel is fp32; a stored act value is rounded to
 *    nearest even (__float2bfloat16_rn), so results match the CPU backend
 *    with round_bf16 up to the order of fp32 operations.
 *  - FP8 conversions use __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)
 *    (round to nearest even, saturating) on x / s computed with __fdiv_rn:
 *    bit-identical to mt_e4m3_from_f32 on the CPU.
 *  - Everything is enqueued on the backend's main stream (cuda_stream(be));
 *    host-visible results (download) synchronise. An op that needs
 *    temporaries takes them from cuda_scratch(), never from cudaMalloc: the
 *    arena is sized when the backend is created.
 *  - Deterministic: no floating-point atomics; reductions over rows use a
 *    fixed tree per output (results do not depend on timing).
 *  - Arguments are checked cheaply (CUDA_REQUIRE); every launch is followed
 *    by CUDA_LAUNCH_CHECK so a bad configuration fails with the op's name.
 */
#ifndef MT_CUDA_IMPL_H
#define MT_CUDA_IMPL_H

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/mt_fp8.h"
#include "base/mt_status.h"
#include "kernels/ops.h"

typedef __nv_bfloat16 bf16;

#define CUDA_EXPERT_STREAMS 4   /* streams for per-expert GEMMs */
#define CUDA_LT_WORKSPACE (32u << 20)

/* One free or used range of the arena. */
typedef struct cuda_block {
    size_t off, size;
    int used;
} cuda_block;

typedef struct cuda_gemm_cache cuda_gemm_cache; /* cuda_gemm.cu */
typedef struct cuda_attn_cache cuda_attn_cache; /* cuda_attn_impl.h */
typedef struct cuda_prof cuda_prof;             /* cuda_prof.cu */

typedef struct cuda_impl {
    int device;
    int sm_count;
    cudaStream_t stream;                          /* main stream: every op */
    cudaStream_t xstream[CUDA_EXPERT_STREAMS];    /* grouped GEMM fan-out */
    cudaEvent_t xevent[CUDA_EXPERT_STREAMS + 1];
    cublasLtHandle_t lt;
    void *lt_ws[CUDA_EXPERT_STREAMS + 1];         /* cuBLASLt workspace per stream */
    cudnnHandle_t dnn;
    /* arena: one cudaMalloc at creation, first-fit over a block list */
    char *arena;
    size_t arena_cap, in_use, peak;
    cuda_block *blocks;
    int n_blocks, cap_blocks;
    /* scratch for an op's temporaries (stream-ordered, reused by every op) */
    char *scratch;
    size_t scratch_cap;
    cuda_gemm_cache *gemm;
    cuda_attn_cache *attn;
    cuda_prof *prof;           /* the op profile, when MOETRAIN_OP_PROFILE is set */
    cudaEvent_t *marks;        /* [cap_marks] timing events of mt_backend.mark */
    int cap_marks;
} cuda_impl;

static inline cuda_impl *cuda_of(const mt_backend *be) { return (cuda_impl *)be->impl; }
static inline cudaStream_t cuda_stream(const mt_backend *be) { return cuda_of(be)->stream; }

/* Device scratch of at least `bytes` for the current op, or NULL with an
 * error set when the scratch reserved at creation is too small. */
void *cuda_scratch(mt_backend *be, size_t bytes);

/* Fan-out over the expert streams (grouped GEMMs, adamw_fp8_n): cuda_fan_out
 * makes expert streams 0..S-1 wait for the main stream's work so far;
 * cuda_fan_in makes the main stream wait for theirs (before the op returns,
 * so ops stay ordered on the main stream). S <= CUDA_EXPERT_STREAMS. */
int cuda_fan_out(mt_backend *be, int S);
int cuda_fan_in(mt_backend *be, int S);


/* Grid size for n elements at `threads` per block (at least 1 block). */
static inline unsigned cuda_grid(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    if (b > 0x7fffffff) b = 0x7fffffff;
    return (unsigned)b;
}

#define CUDA_REQUIRE(cond, ...)                                                \
    do {                                                                       \
        if (!(cond)) return MT_ERR(MT_EINVAL, __VA_ARGS__);                    \
    } while (0)

#define CUDA_LAUNCH_CHECK(op)                                                  \
    do {                                                                       \
        cudaError_t e_ = cudaGetLastError();                                   \
        if (e_ != cudaSuccess)                                                 \
            return mt_err_at(MT_ECUDA, __FILE__, __LINE__, "%s: launch: %s",   \
                             (op), cudaGetErrorString(e_));                    \
    } while (0)

/* Scalar conversions used by kernels. */
__device__ __forceinline__ float cuda_ld(const bf16 *p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void cuda_st(bf16 *p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
/* The IEEE quotient is what the CPU computes; exact alternatives measured
 * slower on an H200 ([65536, 7168] bf16 through quant_rows' strips, 0.384
 * ms dividing): x * (1 / s) with a check for an e4m3 rounding boundary
 * nearby 0.466 ms, converting x * (1 / s)'s neighbours 8 floats either side
 * 0.596. A zero dividend takes the division's slow path, but skipping it
 * for zeros did not pay even on the proxy's zero-padded expert rows: a test
 * per element, quant_rows and quant_cols_t 21.7-22.0 and 24.8-25.4 ms a
 * step against 19.1 and 22.3 without (one host); a test per zero tile of
 * quant_rows and per 4-row group of quant_cols_t, 17.8 and 22.7 ms against
 * 17.9-19.1 and 21.9-22.3 without (other hosts), and 2 % and 8 % slower on
 * zero-free data (bench_ops_cuda, one host). */
__device__ __forceinline__ uint8_t cuda_e4m3(float x, float s)
{
    return (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(x, s), __NV_SATFINITE, __NV_E4M3);
}
/* x / c, the IEEE quotient, for a divisor shared by many dividends, given
 * r = __frcp_rn(c): y = x r corrected by one FMA (Markstein) is correctly
 * rounded when r is and nothing underflows or overflows, which the ranges
 * tested here guarantee (checked against the division on 3.4 G quotients:
 * every significand of a binade over 400 divisors); a zero dividend gives
 * itself (c > 0), where the division would take its slow path; the rest
 * (tiny, huge, non-finite) divides. Where the divisions bound the op
 * (adamw). Not for the quantisers: through it quant_rows and quant_cols_t
 * ran 6-13 % slower on an H200 (0.433 against 0.384 ms at [65536, 7168];
 * tests/bench/RESULTS.md), adamw_fp8's codes 3 % slower. */
__device__ __forceinline__ float cuda_div_by(float x, float c, float r)
{
    const float ax = fabsf(x);
    if (ax >= 0x1p-100f && ax <= 0x1p100f && c >= 0x1p-20f && c <= 0x1p20f) {
        const float y = __fmul_rn(x, r);
        return __fmaf_rn(__fmaf_rn(-y, c, x), r, y);
    }
    if (x == 0.0f && c > 0.0f && c < INFINITY) return x;
    return __fdiv_rn(x, c);
}
__device__ __forceinline__ float cuda_e4m3_val(uint8_t q)
{
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q, __NV_E4M3);
    return __half2float(*reinterpret_cast<__half *>(&h));
}
__device__ __forceinline__ float cuda_scale_of(float amax)
{
    float s = amax / MT_E4M3_MAX;
    return s > 0.0f ? s : 1.0f;
}

/* mt_bf16_from_f32: round to nearest even, quiet NaN. The conversion
 * instruction rounds every number as the CPU's integer rounding does; a NaN
 * keeps its sign and payload (quietened) where the instruction gives the
 * canonical one. */
__device__ __forceinline__ uint16_t cuda_bf16_rne(float x)
{
    const uint16_t h = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    return isnan(x) ? (uint16_t)((__float_as_uint(x) >> 16) | 0x40) : h;
}

/* mt_bf16_from_f32_sr: add 16 random bits below the bf16 mantissa, truncate. */
__device__ __forceinline__ uint16_t cuda_bf16_sr(float x, uint32_t rnd)
{
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return cuda_bf16_rne(x); /* Inf, NaN */
    u += rnd & 0xffffu;
    return (uint16_t)(u >> 16);
}

/* mt_rng.h's hash and mt_fp8.h's stochastic rounding on the device, with
 * identical constants (the headers' functions are host-only C): the random
 * bits of quant_blocks_sr, adamw_fp8_sr and act_from_f32_sr. */
__device__ __forceinline__ uint64_t fp8_mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* mt_hash_u64(seed, counter) from m = fp8_mix64(seed): the half that does
 * not depend on the counter, hoisted out of the per-element loops. */
#define FP8_HASH_K 0xd1342543de82ef95ULL /* mt_hash_u64's counter multiplier */
__device__ __forceinline__ uint64_t fp8_hash_mixed(uint64_t m, uint64_t counter)
{
    return fp8_mix64(m ^ (counter * FP8_HASH_K));
}

/* mt_e4m3_from_f32_sr: one of the two neighbouring codes of x (already
 * divided by the scale), the upper with probability p = (|x| - lo) /
 * (hi - lo), for u = (h >> 11) 2^-53 (mt_hash_uniform of the hash h): u < p.
 * The CPU takes p as a double quotient; here no double division: adjacent
 * e4m3 values differ by a power of two and lo >= |x| / 2 (or lo = 0), so
 * |x| - lo and its quotient by hi - lo are exact in float, the CPU's p is
 * that exact value, and u < p compares (h >> 11) with p 2^53, both exact
 * in double. Bit-identical (test_ops_cuda: quant_blocks_sr, adamw_fp8_sr);
 * the double division bound adamw_fp8_sr. The power of two hi - lo (2^-9
 * .. 2^5) has its reciprocal's exponent bits as 254 minus its own: the
 * value __frcp_rn gives, without its instructions; and of the two
 * neighbours only the one that is not the nearest code is converted. */
__device__ __forceinline__ uint8_t fp8_e4m3_sr_bits(float x, uint64_t h)
{
    const uint8_t sign = (uint8_t)((__float_as_uint(x) >> 24) & 0x80u);
    if (isnan(x)) return (uint8_t)(0x7f | sign);
    const float a = fabsf(x);
    /* the nearest code (positive codes are monotone) */
    const uint8_t c = (uint8_t)__nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E4M3);
    if (c == 0x7e && a >= MT_E4M3_MAX) return (uint8_t)(sign | c);
    const float v = cuda_e4m3_val(c);
    if (v == a) return (uint8_t)(sign | c);
    const bool above = v > a; /* then c is the upper neighbour */
    const uint8_t lo = above ? (uint8_t)(c - 1) : c;
    const float o = cuda_e4m3_val(above ? (uint8_t)(c - 1) : (uint8_t)(c + 1));
    const float lv = above ? o : v, hv = above ? v : o;
    const float rd = __uint_as_float(0x7f000000u - __float_as_uint(__fsub_rn(hv, lv)));
    const float p = __fmul_rn(__fsub_rn(a, lv), rd);
    return (uint8_t)(sign | ((double)(h >> 11) < (double)p * 0x1p53 ? lo + 1 : lo));
}

/* Installers, one per file. */
void cuda_install_backend(mt_backend *be); /* memory, conversions, add, copy2d */
int cuda_install_gemm(mt_backend *be);     /* gemm, gemm_grouped, gemm_fp8 (creates caches) */
void cuda_install_fp8(mt_backend *be);     /* quant_*, transpose/dequant_blocks, *_sr */
void cuda_install_norm(mt_backend *be);    /* rmsnorm, swiglu, embedding */
int cuda_install_attn(mt_backend *be);     /* attn_fwd/bwd (creates the cuDNN plan cache) */
void cuda_install_rope_mla(mt_backend *be); /* rope, mla_kv_fwd/bwd */
void cuda_install_moe(mt_backend *be);     /* router, aux_loss, moe_index, permutes */
void cuda_install_loss(mt_backend *be);    /* xent, sumsq, scale_f32, adamw*, bf16_to_f32 */
/* The op profile (kernels/op_profile.h): wraps every op installed before it. */
int cuda_prof_install(mt_backend *be);
void cuda_prof_destroy(mt_backend *be); /* logs the report */
void cuda_gemm_destroy(mt_backend *be);
/* The grouped FP8 GEMM kernel (cuda_fp8_grouped.cu, MOETRAIN_FP8_GEMM=own):
 * _init says whether it can run here (1) and prepares it; _fits whether a
 * call's shapes and alignments suit it; cuda_fp8_grouped runs gemm_fp8's
 * reduce = 0 case with it, cuda_fp8_wgrad the reduce = 1 case (weight
 * gradients) on its k-grouped form (segments of whole 128-row blocks). */
int cuda_fp8_grouped_init(void);
int cuda_fp8_grouped_fits(const void *C, int c_f32, int ldc, const uint8_t *A, const uint8_t *B,
                          int64_t b_stride, int G, int N, int K);
/* whether cuda_fp8_grouped moves C's tiles by TMA (every segment whole
 * 128-row tiles, C's rows whole 16-byte pieces): the form that also
 * accumulates at the speed it writes */
int cuda_fp8_grouped_c_tma(const void *C, int c_f32, int ldc, const int *rows, int G, int N);
int cuda_fp8_grouped(mt_backend *be, void *C, int c_f32, int ldc, const uint8_t *A,
                     const float *sa, const uint8_t *B, const float *sb, int64_t b_stride,
                     int64_t sb_stride, const int *rows, int G, int N, int K, int accumulate);
int cuda_fp8_wgrad_fits(const void *C, int c_f32, int ldc, int64_t c_stride, const uint8_t *A,
                        const float *sa, const uint8_t *B, const float *sb, const int *rows, int G,
                        int N, int K);
int cuda_fp8_wgrad(mt_backend *be, void *C, int c_f32, int ldc, int64_t c_stride,
                   const uint8_t *A, const float *sa, const uint8_t *B, const float *sb,
                   const int *rows, int G, int N, int K, int accumulate);
void cuda_attn_destroy(mt_backend *be);

#endif
