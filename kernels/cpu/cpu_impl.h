/* cpu_impl.h - private state and helpers of the CPU backend (the oracle).
 *
 * Every op of struct mt_backend is implemented in plain C (C11 + OpenMP) in
 * the cpu_*.c files beside this header; each file installs its function
 * pointers with a cpu_install_* call from mt_backend_cpu_create.
 *
 * Rules all CPU ops follow (ops.h states the contract):
 *  - act buffers are float; with be->round_bf16 every act value an op stores
 *    goes through cpu_act() (round to nearest even bf16), f32 outputs never.
 *  - Results do not depend on the thread count: parallel loops only split
 *    independent outputs; reductions run in a fixed order per output.
 *  - Arguments are checked cheaply; failures return MT_EINVAL with a message
 *    naming the op.
 */
#ifndef MT_CPU_IMPL_H
#define MT_CPU_IMPL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/mt_fp8.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "kernels/ops.h"

typedef struct cpu_impl {
    int threads;            /* worker threads of parallel regions (>= 1) */
    atomic_size_t in_use;   /* bytes allocated now */
    atomic_size_t peak;     /* most bytes allocated at once */
    float e4m3_lut[256];    /* e4m3 code -> value (no scale) */
    double *marks;          /* [cap_marks] host clock of each mark, seconds */
    int cap_marks;
} cpu_impl;

static inline cpu_impl *cpu_of(const mt_backend *be) { return (cpu_impl *)be->impl; }

/* Index of the calling thread in the current parallel region (0 outside). */
int cpu_thread_id(void);

/* Below this many elements of work a loop runs on one thread: a parallel
 * region costs a few microseconds. */
#define CPU_PAR_MIN 16384

/* Threads for a loop over `work` elements. */
static inline int cpu_team(const mt_backend *be, int64_t work)
{
    return work < CPU_PAR_MIN ? 1 : cpu_of(be)->threads;
}

/* The value an act buffer stores for v. */
static inline float cpu_act(const mt_backend *be, float v)
{
    return be->round_bf16 ? mt_bf16_round(v) : v;
}

/* The value an act buffer stores for element i of act_from_f32_sr(seed):
 * v rounded to bf16 stochastically with the low 32 bits of
 * mt_hash_u64(seed, i) when acts are bf16-valued (round_bf16), else v. */
static inline float cpu_act_sr(const mt_backend *be, float v, uint64_t seed, int64_t i)
{
    return be->round_bf16
               ? mt_bf16_to_f32(mt_bf16_from_f32_sr(v, (uint32_t)mt_hash_u64(seed, (uint64_t)i)))
               : v;
}

/* sum_i a[i] * b[i] in double, in a fixed order (8 lanes over i mod 8, then
 * the lanes and the tail in order), so results do not depend on threads. */
static inline double cpu_dot_f64(const float *a, const float *b, int64_t n)
{
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += (double)a[i + j] * (double)b[i + j];
    double s = 0;
    for (int j = 0; j < 8; j++) s += lane[j];
    for (; i < n; i++) s += (double)a[i] * (double)b[i];
    return s;
}

/* Fails with MT_EINVAL and the formatted message unless cond holds. */
#define CPU_REQUIRE(cond, ...)                                                 \
    do {                                                                       \
        if (!(cond)) return MT_ERR(MT_EINVAL, __VA_ARGS__);                    \
    } while (0)

/* 64-byte aligned scratch memory (not counted in mem_stats); NULL on failure. */
void *cpu_scratch(size_t bytes);


/* ---- GEMM engine shared by gemm, gemm_grouped and gemm_fp8 ------------- */

/* One GEMM problem: C[M, N] (ldc) = alpha * sum_k A(m, k) B(n, k) (+ C).
 * Operands are float (A, B) or e4m3 codes (A8, B8, decoded by the LUT); an
 * element is at m * rs + k * cs (one of the two strides is 1). */
typedef struct cpu_gemm_prob {
    int M, N, K;
    const float *A, *B;         /* float operands, or NULL */
    const uint8_t *A8, *B8;     /* e4m3 operands (gemm_fp8), or NULL */
    int64_t a_rs, a_cs, b_rs, b_cs;
    void *C;                    /* of type c_f32 (mt_c_type: act, f32, bf16 bits) */
    int c_f32, ldc, accumulate;
    float alpha;                /* float GEMM only */
    /* FP8 scales per 128-wide K tile kb:
     *   sa(m, kb) = sa[kb * sa_ks + m]
     *   sb(n, kb) = sb[kb * sb_ks + (n / sb_ndiv) * sb_ns] */
    const float *sa, *sb;
    int64_t sa_ks, sb_ks, sb_ns;
    int sb_ndiv;
} cpu_gemm_prob;

/* Runs P problems; each output element is computed the same way whatever
 * the blocking and thread count:
 *  float: acc = fma chain over k = 0..K-1 from 0 (mul + add without FMA
 *         hardware), C = alpha * acc (+ C);
 *  fp8:   acc = sum over tiles of (tile sum in k order * sa) * sb, C = acc (+ C). */
int cpu_gemm_run(mt_backend *be, const char *op, const cpu_gemm_prob *probs, int P);

void cpu_install_gemm(mt_backend *be);
void cpu_install_fp8(mt_backend *be);
void cpu_install_norm(mt_backend *be);
void cpu_install_attn(mt_backend *be);
void cpu_install_moe(mt_backend *be);
void cpu_install_loss(mt_backend *be);
void cpu_install_optim(mt_backend *be);

#endif
