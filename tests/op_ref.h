/* op_ref.h - shared helpers of the op tests: deterministic inputs, fp64
 * references and a finite-difference driver.
 *
 * Inputs come from the counter-based mt_hash_* draws, so a value depends only
 * on (seed, index): the CUDA op tests generate exactly the inputs the CPU op
 * tests use and compare the two backends element by element.
 *
 * Header-only; include it after <cmocka.h> (REF_OK uses fail_msg). On the
 * CPU backend, backend memory is host memory, so CPU tests hand malloc'd
 * buffers straight to the ops.
 */
#ifndef MT_OP_REF_H
#define MT_OP_REF_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/mt_fp8.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "kernels/ops.h"

/* Fails the current test unless stmt returns MT_OK, printing the message. */
#define REF_OK(stmt)                                                              \
    do {                                                                          \
        int ref_rc_ = (stmt);                                                     \
        if (ref_rc_ != MT_OK)                                                     \
            fail_msg("%s -> %s: %s", #stmt, mt_strstatus(ref_rc_), mt_errmsg());  \
    } while (0)

/* malloc that aborts the test run on failure, zero-filled. */
static inline void *ref_alloc(size_t bytes)
{
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
        abort();
    }
    return p;
}

static inline float *ref_floats(int64_t n) { return (float *)ref_alloc(sizeof(float) * (size_t)n); }

static inline float *ref_dup(const float *x, int64_t n)
{
    float *y = ref_floats(n);
    memcpy(y, x, sizeof(float) * (size_t)n);
    return y;
}

/* x[i] = lo + (hi - lo) * u(seed, i), u uniform in [0, 1). */
static inline void ref_fill_uniform(float *x, int64_t n, uint64_t seed, float lo, float hi)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(lo + (hi - lo) * mt_hash_uniform(seed, (uint64_t)i));
}

/* x[i] = sigma * N(0, 1) draw (seed, i). */
static inline void ref_fill_normal(float *x, int64_t n, uint64_t seed, float sigma)
{
    for (int64_t i = 0; i < n; i++) x[i] = (float)(sigma * mt_hash_normal(seed, (uint64_t)i));
}

/* Integers uniform in [0, V). */
static inline void ref_fill_ids(int32_t *x, int64_t n, uint64_t seed, int V)
{
    for (int64_t i = 0; i < n; i++) x[i] = (int32_t)(mt_hash_u64(seed, (uint64_t)i) % (uint64_t)V);
}

/* x[i] rounded to bf16 (inputs as a bf16 backend would hold them). */
static inline void ref_round_bf16(float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) x[i] = mt_bf16_round(x[i]);
}

/* sum a[i] b[i] in double. */
static inline double ref_dot(const float *a, const float *b, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

/* fp64 GEMM with the ops.h operand conventions:
 * C[m * N + n] = sum_k A(m, k) B(n, k), A(m, k) = A[m * lda + k] or
 * A[k * lda + m] if ta, B likewise. absC (optional) = sum_k |A(m, k) B(n, k)|,
 * the scale of the fp32 rounding error. */
static inline void ref_gemm_f64(double *C, double *absC, const float *A, int lda, int ta,
                                const float *B, int ldb, int tb, int M, int N, int K)
{
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = 0, a = 0;
            for (int k = 0; k < K; k++) {
                double x = ta ? A[(int64_t)k * lda + m] : A[(int64_t)m * lda + k];
                double y = tb ? B[(int64_t)k * ldb + n] : B[(int64_t)n * ldb + k];
                s += x * y;
                a += fabs(x * y);
            }
            C[(int64_t)m * N + n] = s;
            if (absC) absC[(int64_t)m * N + n] = a;
        }
}

/* Spacing of bf16 values at |x| (2^(e - 7) for |x| in [2^e, 2^(e+1))). */
static inline double ref_bf16_ulp(double x)
{
    x = fabs(x);
    if (x < 0x1p-126) return 0x1p-133;
    int e;
    frexp(x, &e); /* x = f 2^e, f in [0.5, 1) */
    return ldexp(1.0, e - 1 - 7);
}

/* Bound on the error of an fp32 sum of K terms whose absolute values sum to
 * `abs`: K * 2^-24 * abs (each of the K additions rounds by at most 2^-24 of
 * a partial sum bounded by abs). */
static inline double ref_f32_sum_slack(int K, double abs) { return (double)K * 0x1p-24 * abs; }

/* ---- finite differences ----------------------------------------------------- */

/* A scalar loss of the inputs the check perturbs (evaluated in place). */
typedef double (*ref_loss_fn)(void *ctx);

/* Central differences: for each i, the loss at x[i] +- eps (the float
 * values actually stored; h is their difference) against grad[i]. Passes when
 * |fd - grad| <= atol + rtol * max(|fd|, |grad|) everywhere. Checks at most
 * max_checks indices spread over x (all if max_checks <= 0). Prints the worst
 * element; returns 1 if all pass. */
static inline int ref_fd_check(const char *what, float *x, int64_t n, const float *grad,
                               ref_loss_fn loss, void *ctx, double eps, double rtol, double atol,
                               int64_t max_checks)
{
    int64_t step = (max_checks > 0 && n > max_checks) ? (n + max_checks - 1) / max_checks : 1;
    double worst = -1, wfd = 0, wg = 0;
    int64_t wi = -1;
    int ok = 1;
    for (int64_t i = 0; i < n; i += step) {
        float x0 = x[i];
        float xp = (float)(x0 + eps), xm = (float)(x0 - eps);
        x[i] = xp;
        double fp = loss(ctx);
        x[i] = xm;
        double fm = loss(ctx);
        x[i] = x0;
        double fd = (fp - fm) / ((double)xp - (double)xm);
        double err = fabs(fd - grad[i]);
        double tol = atol + rtol * fmax(fabs(fd), fabs((double)grad[i]));
        if (err > tol) ok = 0;
        if (err / tol > worst) {
            worst = err / tol;
            wfd = fd;
            wg = grad[i];
            wi = i;
        }
    }
    printf("  fd %-24s n=%-6lld worst [%lld] fd=% .6e grad=% .6e (err/tol %.3f) %s\n", what,
           (long long)n, (long long)wi, wfd, wg, worst, ok ? "ok" : "FAIL");
    return ok;
}

#endif
