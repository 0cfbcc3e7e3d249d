/* test_ops_cuda.c - every op of ops.h on the CUDA backend against the CPU
 * backend (the oracle, round_bf16 = 1), on identical inputs.
 *
 * Inputs are drawn with the counter-based mt_hash_* generators; act inputs
 * are rounded to bf16 first, so both backends hold exactly the same values
 * (the CPU as floats, CUDA as bf16). Each op runs on both backends and every
 * output buffer is downloaded (padding included: ops must not write outside
 * their outputs) and compared. One line per op, shape and output:
 *
 *   PASS|FAIL  op  shape  output: measured errors [first bad element: cpu vs gpu]
 *
 * A last section runs the ops whose reductions could depend on timing (dw of
 * rmsnorm, embedding_bwd, sumsq, aux_loss, moe_index, weight-gradient GEMMs,
 * attention backward) twice on the GPU and requires bit-identical results.
 *
 * The program continues after failures, prints a summary and exits 1 if any
 * comparison failed, 77 (skipped) without a CUDA device.
 *
 * Tolerances (stated per check, printed with the measurement):
 *  - exact: integer outputs (router idx, moe_index slot/src/counts/rows),
 *    FP8 codes and scales, copies and permutations, SR roundings, AdamW
 *    (the CUDA kernels follow the CPU's operation order with IEEE intrinsics).
 *  - act (bf16) outputs: |gpu - cpu| <= a * ulp(|cpu_i|) + b * ulp(max |cpu|)
 *    element-wise (ulp = bf16 spacing), and ||gpu - cpu|| / ||cpu|| <= rel.
 *    Element-wise ops that compute the CPU's formula in the same order
 *    (differing only in glibc's vs CUDA's exp, or in the order of a double
 *    sum) use a = 1 (one rounding boundary), b = 0; GEMMs and attention, whose
 *    fp32 sums run in another order, use b = 4 (fp32 noise ~1e-6 relative can
 *    move an output across one bf16 rounding boundary at most, but elements
 *    much smaller than the maximum see it relative to the maximum's scale) and
 *    rel = 1e-2 (bf16 storage alone is ~2e-3); cuDNN attention rounds P and
 *    dS to bf16 inside (FlashAttention), hence b = 8 there.
 *  - f32 outputs: |gpu - cpu| <= rtol * max |cpu| element-wise: 1e-5 for
 *    reductions both backends do in double (f32 rounding of the result),
 *    1e-4 for fp32 GEMM accumulation in another order (K up to 1024),
 *    5e-3 for FP8 GEMMs (Hopper's FP8 tensor-core accumulation keeps ~14
 *    bits inside each 128-wide K block; the block scales are exact).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cuda/cuda_attn.h"
#include "kernels/mt_fp8.h"
#include "base/mt_clock.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "kernels/ops.h"
#include "op_ref.h"

/* ---- backends and counters -------------------------------------------------------- */

static mt_backend *BE[2]; /* [0] CPU (oracle), [1] CUDA */
static const char *gpu_label = "cuda";
static int n_pass, n_fail;

static void die(const char *what, int rc)
{
    fprintf(stderr, "FATAL: %s -> %s: %s\n", what, mt_strstatus(rc), mt_errmsg());
    exit(1);
}

#define MUST(stmt)                                                                  \
    do {                                                                            \
        int must_rc_ = (stmt);                                                      \
        if (must_rc_ != MT_OK) die(#stmt, must_rc_);                                \
    } while (0)

/* Runs `call` on both backends (`be` and `s` are visible to it: s = 0 CPU,
 * 1 CUDA). ok becomes 0 and a FAIL line is printed if either returns an
 * error. */
#define BOTH(ok, op, shape, call)                                                   \
    do {                                                                            \
        (ok) = 1;                                                                   \
        for (int s = 0; s < 2; s++) {                                               \
            mt_backend *be = BE[s];                                                 \
            int both_rc_ = (call);                                                  \
            if (both_rc_ == MT_OK && s == 1) both_rc_ = be->sync(be);               \
            if (both_rc_ != MT_OK) {                                                \
                printf("FAIL  %-18s %-46s %s returned %s: %s\n", (op), (shape),    \
                       s ? gpu_label : "cpu", mt_strstatus(both_rc_), mt_errmsg()); \
                n_fail++;                                                           \
                (ok) = 0;                                                           \
                break;                                                              \
            }                                                                       \
        }                                                                           \
    } while (0)

/* ---- buffers on both backends ------------------------------------------------------- */

typedef enum { T_ACT, T_F32, T_I32, T_U8, T_U16 } tkind;

typedef struct tb {
    tkind k;
    int64_t n;
    void *p[2];
} tb;

static size_t esize(const mt_backend *be, tkind k)
{
    switch (k) {
    case T_ACT: return (size_t)be->act_bytes;
    case T_F32:
    case T_I32: return 4;
    case T_U16: return 2;
    default: return 1;
    }
}

/* Zero-filled buffer of n elements on both backends. */
static tb tb_new(tkind k, int64_t n)
{
    tb b = {k, n, {NULL, NULL}};
    for (int s = 0; s < 2; s++)
        MUST(BE[s]->alloc(BE[s], esize(BE[s], k) * (size_t)(n > 0 ? n : 1), &b.p[s]));
    return b;
}

static void tb_free(tb *b)
{
    for (int s = 0; s < 2; s++)
        if (b->p[s]) BE[s]->free(BE[s], b->p[s]);
    b->p[0] = b->p[1] = NULL;
}

/* Sets the buffer on both backends: host floats for act and f32, raw
 * elements otherwise. act values go through act_from_f32 (bf16-valued input
 * passes unchanged on both). */
static void tb_put(tb *b, const void *host)
{
    for (int s = 0; s < 2; s++) {
        mt_backend *be = BE[s];
        if (b->k != T_ACT) {
            MUST(be->upload(be, b->p[s], host, esize(be, b->k) * (size_t)b->n));
            continue;
        }
        float *tmp;
        MUST(be->alloc(be, 4 * (size_t)b->n, (void **)&tmp));
        MUST(be->upload(be, tmp, host, 4 * (size_t)b->n));
        MUST(be->act_from_f32(be, b->p[s], tmp, b->n));
        MUST(be->sync(be));
        be->free(be, tmp);
    }
}

/* Host copy of side s: floats for act and f32, raw elements otherwise. */
static void tb_get(const tb *b, int s, void *host)
{
    mt_backend *be = BE[s];
    if (b->k != T_ACT) {
        MUST(be->download(be, host, b->p[s], esize(be, b->k) * (size_t)b->n));
        return;
    }
    float *tmp;
    MUST(be->alloc(be, 4 * (size_t)b->n, (void **)&tmp));
    MUST(be->act_to_f32(be, tmp, b->p[s], b->n));
    MUST(be->download(be, host, tmp, 4 * (size_t)b->n));
    be->free(be, tmp);
}

/* A buffer holding the given host values on both backends. */
static tb tb_from(tkind k, int64_t n, const void *host)
{
    tb b = tb_new(k, n);
    tb_put(&b, host);
    return b;
}

/* Random bf16-valued floats: normal(0, sigma). */
static float *rnd_act(int64_t n, uint64_t seed, float sigma)
{
    float *x = ref_floats(n > 0 ? n : 1);
    ref_fill_normal(x, n, seed, sigma);
    ref_round_bf16(x, n);
    return x;
}

static float *rnd_f32(int64_t n, uint64_t seed, float sigma)
{
    float *x = ref_floats(n > 0 ? n : 1);
    ref_fill_normal(x, n, seed, sigma);
    return x;
}

static tb act_rand(int64_t n, uint64_t seed, float sigma)
{
    float *h = rnd_act(n, seed, sigma);
    tb b = tb_from(T_ACT, n, h);
    free(h);
    return b;
}

static tb f32_rand(int64_t n, uint64_t seed, float sigma)
{
    float *h = rnd_f32(n, seed, sigma);
    tb b = tb_from(T_F32, n, h);
    free(h);
    return b;
}

/* ---- comparisons -------------------------------------------------------------------- */

static void verdict(int ok, const char *op, const char *shape, const char *out, const char *msg)
{
    printf("%s  %-18s %-46s %-6s %s\n", ok ? "PASS" : "FAIL", op, shape, out, msg);
    if (ok)
        n_pass++;
    else
        n_fail++;
}

/* Position text of flat index i in rows of `cols` elements. */
static void pos_text(char *buf, size_t cap, int64_t i, int64_t cols)
{
    if (cols > 0)
        snprintf(buf, cap, "[%lld] (r%lld,c%lld)", (long long)i, (long long)(i / cols),
                 (long long)(i % cols));
    else
        snprintf(buf, cap, "[%lld]", (long long)i);
}

/* act (bf16) output; see the header for a, b, rel. */
static int check_act_host(const char *op, const char *shape, const char *out, const float *c,
                          const float *g, int64_t n, int64_t cols, double a, double bmax,
                          double rel)
{
    double mx = 0, se = 0, sc = 0, worst = 0, worst_d = 0;
    int64_t bad = -1, ndiff = 0, nbad = 0, wi = -1;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(c[i])) mx = fmax(mx, fabs(c[i]));
    const double umax = ref_bf16_ulp(mx);
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)g[i] - (double)c[i]);
        int same = (isnan(c[i]) && isnan(g[i])) || c[i] == g[i];
        if (!same) ndiff++;
        double tol = a * ref_bf16_ulp(c[i]) + bmax * umax;
        int ok_i = same || d <= tol;
        if (!ok_i) {
            nbad++;
            if (bad < 0) bad = i;
        }
        if (!same && isfinite(d)) {
            se += d * d;
            if (d / umax > worst) worst = d / umax, worst_d = d, wi = i;
        }
        if (isfinite(c[i])) sc += (double)c[i] * c[i];
    }
    double r = sc > 0 ? sqrt(se / sc) : sqrt(se);
    int ok = nbad == 0 && r <= rel;
    char msg[512], p[64];
    int len = snprintf(msg, sizeof msg,
                       "rel %.2e max_abs %.2e (%.2f ulp@max %.3g) differ %lld/%lld tol %g ulp_own+%g "
                       "ulp_max rel<=%.0e",
                       r, worst_d, worst, mx, (long long)ndiff, (long long)n, a, bmax, rel);
    if (!ok) {
        int64_t at = bad >= 0 ? bad : wi;
        if (at >= 0) {
            pos_text(p, sizeof p, at, cols);
            snprintf(msg + len, sizeof msg - (size_t)len, "; %lld bad, first %s cpu=%.8g gpu=%.8g",
                     (long long)nbad, p, c[at], g[at]);
        }
    }
    verdict(ok, op, shape, out, msg);
    return ok;
}

static int check_act(const char *op, const char *shape, const char *out, const tb *b, int64_t cols,
                     double a, double bmax, double rel)
{
    float *c = ref_floats(b->n), *g = ref_floats(b->n);
    tb_get(b, 0, c);
    tb_get(b, 1, g);
    int ok = check_act_host(op, shape, out, c, g, b->n, cols, a, bmax, rel);
    free(c);
    free(g);
    return ok;
}

/* f32 output: |gpu - cpu| <= rtol * max |cpu| element-wise. */
static int check_f32(const char *op, const char *shape, const char *out, const tb *b, int64_t cols,
                     double rtol)
{
    float *c = ref_floats(b->n), *g = ref_floats(b->n);
    tb_get(b, 0, c);
    tb_get(b, 1, g);
    double mx = 0, se = 0, sc = 0, worst = 0;
    int64_t bad = -1, ndiff = 0, nbad = 0;
    for (int64_t i = 0; i < b->n; i++)
        if (isfinite(c[i])) mx = fmax(mx, fabs(c[i]));
    const double tol = rtol * mx;
    for (int64_t i = 0; i < b->n; i++) {
        int same = (isnan(c[i]) && isnan(g[i])) || c[i] == g[i];
        double d = fabs((double)g[i] - (double)c[i]);
        if (!same) ndiff++;
        if (!same && !(d <= tol)) {
            nbad++;
            if (bad < 0) bad = i;
        }
        if (!same && isfinite(d)) {
            se += d * d;
            worst = fmax(worst, d);
        }
        if (isfinite(c[i])) sc += (double)c[i] * c[i];
    }
    double r = sc > 0 ? sqrt(se / sc) : sqrt(se);
    int ok = nbad == 0;
    char msg[512], p[64];
    int len = snprintf(msg, sizeof msg,
                       "rel %.2e max_abs %.2e (%.2e of max %.3g) differ %lld/%lld tol %.0e*max", r,
                       worst, mx > 0 ? worst / mx : worst, mx, (long long)ndiff, (long long)b->n,
                       rtol);
    if (!ok) {
        pos_text(p, sizeof p, bad, cols);
        snprintf(msg + len, sizeof msg - (size_t)len, "; %lld bad, first %s cpu=%.9g gpu=%.9g",
                 (long long)nbad, p, c[bad], g[bad]);
    }
    verdict(ok, op, shape, out, msg);
    free(c);
    free(g);
    return ok;
}

/* A bf16 gradient accumulator (T_U16 bits on both backends), compared as
 * act values with the same a, b, rel rule. */
static int check_bf16(const char *op, const char *shape, const char *out, const tb *b,
                      int64_t cols, double a, double bmax, double rel)
{
    uint16_t *ch = ref_alloc(2 * (size_t)b->n), *gh = ref_alloc(2 * (size_t)b->n);
    tb_get(b, 0, ch);
    tb_get(b, 1, gh);
    float *c = ref_floats(b->n), *g = ref_floats(b->n);
    for (int64_t i = 0; i < b->n; i++) c[i] = mt_bf16_to_f32(ch[i]), g[i] = mt_bf16_to_f32(gh[i]);
    int ok = check_act_host(op, shape, out, c, g, b->n, cols, a, bmax, rel);
    free(ch), free(gh), free(c), free(g);
    return ok;
}

/* Host floats h [n] as f32, or as bf16 bits (rounded to nearest even). */
static tb tb_from_floats(const float *h, int64_t n, int bf16)
{
    if (!bf16) return tb_from(T_F32, n, h);
    uint16_t *u = ref_alloc(2 * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) u[i] = mt_bf16_from_f32(h[i]);
    tb b = tb_from(T_U16, n, u);
    free(u);
    return b;
}

/* Random bf16 bits (precision.grads bf16 accumulators): normal(0, sigma). */
static tb bf16_rand(int64_t n, uint64_t seed, float sigma)
{
    float *h = rnd_f32(n, seed, sigma);
    tb b = tb_from_floats(h, n, 1);
    free(h);
    return b;
}

/* A C buffer of mt_c_type t with random values. */
static tb c_rand(int t, int64_t n, uint64_t seed)
{
    return t == MT_C_F32 ? f32_rand(n, seed, 1.0f) : t == MT_C_BF16 ? bf16_rand(n, seed, 1.0f)
                                                                    : act_rand(n, seed, 1.0f);
}

static const char *c_name(int t) { return t == MT_C_F32 ? "f32" : t == MT_C_BF16 ? "bf16" : "act"; }

/* Checks a GEMM output of type t: f32 with rtol, act and bf16 with the act rule. */
static void check_c(const char *op, const char *sh, int t, const tb *C, int64_t cols, double rtol)
{
    if (t == MT_C_F32)
        check_f32(op, sh, "C", C, cols, rtol);
    else if (t == MT_C_BF16)
        check_bf16(op, sh, "C", C, cols, 1, 4, 1e-2);
    else
        check_act(op, sh, "C", C, cols, 1, 4, 1e-2);
}

/* Bit-exact comparison of raw host arrays of n elements of `es` bytes
 * (act/f32 compared as float bits). */
static int check_exact_host(const char *op, const char *shape, const char *out, const void *c,
                            const void *g, int64_t n, size_t es, int is_float, int64_t cols)
{
    int64_t bad = -1, ndiff = 0;
    const unsigned char *a = c, *b = g;
    for (int64_t i = 0; i < n; i++)
        if (memcmp(a + i * es, b + i * es, es) != 0) {
            ndiff++;
            if (bad < 0) bad = i;
        }
    char msg[400], p[64];
    int len = snprintf(msg, sizeof msg, "exact: %lld/%lld differ", (long long)ndiff, (long long)n);
    if (bad >= 0) {
        pos_text(p, sizeof p, bad, cols);
        if (is_float) {
            float x, y;
            memcpy(&x, a + bad * es, 4);
            memcpy(&y, b + bad * es, 4);
            snprintf(msg + len, sizeof msg - (size_t)len, "; first %s cpu=%.9g (0x%08x) gpu=%.9g (0x%08x)",
                     p, x, mt_f32_bits(x), y, mt_f32_bits(y));
        } else {
            long long x = 0, y = 0;
            if (es == 4) {
                int32_t u, v;
                memcpy(&u, a + bad * es, 4);
                memcpy(&v, b + bad * es, 4);
                x = u, y = v;
            } else if (es == 2) {
                uint16_t u, v;
                memcpy(&u, a + bad * es, 2);
                memcpy(&v, b + bad * es, 2);
                x = u, y = v;
            } else {
                x = a[bad], y = b[bad];
            }
            snprintf(msg + len, sizeof msg - (size_t)len, "; first %s cpu=%lld (0x%llx) gpu=%lld (0x%llx)", p,
                     x, (unsigned long long)x, y, (unsigned long long)y);
        }
    }
    verdict(ndiff == 0, op, shape, out, msg);
    return ndiff == 0;
}

static int check_exact(const char *op, const char *shape, const char *out, const tb *b, int64_t cols)
{
    size_t es = (b->k == T_ACT || b->k == T_F32) ? 4 : esize(BE[0], b->k);
    void *c = ref_alloc(es * (size_t)b->n), *g = ref_alloc(es * (size_t)b->n);
    tb_get(b, 0, c);
    tb_get(b, 1, g);
    int ok = check_exact_host(op, shape, out, c, g, b->n, es, b->k == T_ACT || b->k == T_F32, cols);
    free(c);
    free(g);
    return ok;
}

/* ---- memory, conversions, add, copy2d ------------------------------------------------ */

static void test_memory_and_elementwise(void)
{
    const int64_t n = 100003;
    char sh[96];
    snprintf(sh, sizeof sh, "n=%lld", (long long)n);
    /* act_from_f32 rounding (ties, subnormals, large values) and act_to_f32 */
    float *h = rnd_f32(n, 1, 3.0f);
    for (int64_t i = 0; i < 2000; i++) { /* exact bf16 ties: both neighbours even/odd */
        uint32_t u = (mt_f32_bits(h[i]) & 0xffff0000u) | 0x8000u;
        h[i] = mt_bits_f32(u);
    }
    h[2000] = 0x1p-130f;
    h[2001] = -0x1.fffffep127f;
    h[2002] = 0.0f;
    h[2003] = -0.0f;
    {
        tb a = tb_new(T_ACT, n);
        tb f = tb_from(T_F32, n, h);
        int ok;
        BOTH(ok, "act_from_f32", sh, be->act_from_f32(be, a.p[s], f.p[s], n));
        if (ok) check_exact("act_from_f32", sh, "y", &a, 0);
        tb g = tb_new(T_F32, n);
        BOTH(ok, "act_to_f32", sh, be->act_to_f32(be, g.p[s], a.p[s], n));
        if (ok) check_exact("act_to_f32", sh, "y", &g, 0);
        /* add, in place too */
        tb b2 = act_rand(n, 2, 2.0f), y = tb_new(T_ACT, n);
        BOTH(ok, "add", sh, be->add(be, y.p[s], a.p[s], b2.p[s], n));
        if (ok) check_exact("add", sh, "y", &y, 0);
        BOTH(ok, "add", "in place y=a", be->add(be, a.p[s], a.p[s], b2.p[s], n));
        if (ok) check_exact("add", "in place y=a", "y", &a, 0);
        /* copy, zero, upload/download round trip */
        BOTH(ok, "copy", sh, be->copy(be, y.p[s], b2.p[s], (size_t)n * be->act_bytes));
        if (ok) check_exact("copy", sh, "dst", &y, 0);
        BOTH(ok, "zero", "n/2", be->zero(be, y.p[s], (size_t)(n / 2) * be->act_bytes));
        if (ok) check_exact("zero", "n/2", "dst", &y, 0);
        tb_free(&a), tb_free(&f), tb_free(&g), tb_free(&b2), tb_free(&y);
    }
    free(h);
    /* copy2d with strides, set and accumulate */
    const int rows = 77, cols = 130, lds = 150, ldd = 141;
    for (int acc = 0; acc < 2; acc++) {
        tb src = act_rand((int64_t)rows * lds, 3, 1.0f), dst = act_rand((int64_t)rows * ldd, 4, 1.0f);
        snprintf(sh, sizeof sh, "%dx%d lds=%d ldd=%d acc=%d", rows, cols, lds, ldd, acc);
        int ok;
        BOTH(ok, "copy2d", sh, be->copy2d(be, dst.p[s], ldd, src.p[s], lds, rows, cols, acc));
        if (ok) check_exact("copy2d", sh, "dst", &dst, ldd);
        tb_free(&src), tb_free(&dst);
    }
    size_t in_use, peak;
    BE[1]->mem_stats(BE[1], &in_use, &peak);
    printf("INFO  mem_stats          cuda in_use %zu bytes, peak %zu bytes\n", in_use, peak);
}

/* ---- marks (the pipeline's device timing) --------------------------------------------- */

/* Property: on both backends marks_read gives mark 0 at 0 and the marks in
 * the stream's order (non-decreasing), a mark after queued work later than
 * the one before it, and marks past the first 64 (more events made on the
 * way) read as the first ones do; a read past the marks made is refused. */
static void test_marks(void)
{
    const int n = 130;
    double t[130];
    for (int s = 0; s < 2; s++) {
        mt_backend *be = BE[s];
        const char *who = s ? gpu_label : "cpu";
        const int64_t len = (int64_t)1 << 22;
        void *a = NULL, *b = NULL;
        MUST(be->alloc(be, (size_t)len * be->act_bytes, &a));
        MUST(be->alloc(be, (size_t)len * be->act_bytes, &b));
        int rc = be->mark(be, 0);
        for (int k = 0; rc == MT_OK && k < 20; k++) rc = be->add(be, b, a, b, len);
        for (int i = 1; rc == MT_OK && i < n; i++) rc = be->mark(be, i);
        if (rc == MT_OK) rc = be->marks_read(be, n, t);
        int ok = rc == MT_OK && t[0] == 0 && t[1] > 0;
        for (int i = 1; ok && i < n; i++) ok = t[i] >= t[i - 1];
        printf("%s  %-18s %-46s %s: marks 0..%d, the 20 adds before mark 1: %.3g ms\n",
               ok ? "PASS" : "FAIL", "marks", "130 marks", who, n - 1,
               rc == MT_OK ? 1e3 * t[1] : -1.0);
        if (ok) n_pass++;
        else n_fail++;
        rc = be->marks_read(be, 100000, t);
        printf("%s  %-18s %-46s %s: reading 100000 marks %s\n", rc == MT_EINVAL ? "PASS" : "FAIL",
               "marks", "past the marks made", who, rc == MT_EINVAL ? "refused" : "not refused");
        if (rc == MT_EINVAL) n_pass++;
        else n_fail++;
        be->free(be, a);
        be->free(be, b);
    }
}

/* ---- GEMM --------------------------------------------------------------------------- */

static void test_gemm_one(int M, int N, int K, int ta, int tb_, int c_f32, int acc, float alpha,
                          int pad)
{
    const int lda = (ta ? M : K) + pad, ldb = (tb_ ? N : K) + pad, ldc = N + pad;
    const int64_t na = (int64_t)(ta ? K : M) * lda, nb = (int64_t)(tb_ ? K : N) * ldb;
    tb A = act_rand(na, 10 + M, 1.0f), B = act_rand(nb, 20 + N, 1.0f);
    tb C = c_rand(c_f32, (int64_t)M * ldc, 30);
    char sh[128];
    snprintf(sh, sizeof sh, "M%d N%d K%d ta%d tb%d %s acc%d a%.2g ld+%d", M, N, K, ta, tb_,
             c_name(c_f32), acc, alpha, pad);
    int ok;
    BOTH(ok, "gemm", sh,
         be->gemm(be, C.p[s], c_f32, ldc, A.p[s], lda, ta, B.p[s], ldb, tb_, M, N, K, alpha, acc));
    if (ok) check_c("gemm", sh, c_f32, &C, ldc, 1e-4);
    tb_free(&A), tb_free(&B), tb_free(&C);
}

static void test_gemm(void)
{
    const int shapes[][3] = {{1, 1, 1}, {37, 53, 71}, {128, 256, 512}, {300, 200, 130}, {64, 96, 1000}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb_ = 0; tb_ < 2; tb_++) {
                const int *d = shapes[i];
                test_gemm_one(d[0], d[1], d[2], ta, tb_, 0, 0, 1.0f, 0);
                if (i == 1 || i == 3) {
                    test_gemm_one(d[0], d[1], d[2], ta, tb_, 1, 1, 0.5f, 3);
                    test_gemm_one(d[0], d[1], d[2], ta, tb_, 0, 1, 1.0f, 8);
                }
            }
    /* the model's shapes: y = x W^T, dx = dy W, dW += dy^T x (f32) */
    test_gemm_one(256, 384, 128, 0, 0, 0, 0, 1.0f, 0);
    test_gemm_one(256, 128, 384, 0, 1, 0, 1, 1.0f, 0);
    test_gemm_one(384, 128, 256, 1, 1, 1, 1, 1.0f, 0);
    /* bf16 gradient accumulators (precision.grads bf16): dW += dy^T x into
     * bf16 bits, on cuBLASLt (aligned) and the fallback kernel (odd) */
    test_gemm_one(384, 128, 256, 1, 1, MT_C_BF16, 1, 1.0f, 0);
    test_gemm_one(37, 53, 71, 1, 1, MT_C_BF16, 1, 1.0f, 3);
    test_gemm_one(300, 200, 130, 1, 1, MT_C_BF16, 0, 1.0f, 0);
}

static void test_gemm_grouped(void)
{
    const int rows[] = {37, 0, 130, 5}, G = 4, N = 96, K = 72;
    int M = 0;
    for (int g = 0; g < G; g++) M += rows[g];
    char sh[128];
    int ok;
    /* reduce 0: C[r_g + i] = A[r_g + i] op(B_g) */
    for (int ta = 0; ta < 2; ta++)
        for (int tb_ = 0; tb_ < 2; tb_++)
            for (int c_f32 = 0; c_f32 < 2; c_f32++) {
                const int lda = (ta ? M : K) + 2, ldb = (tb_ ? N : K) + 1, ldc = N + 3;
                const int64_t bstride = (int64_t)(tb_ ? K : N) * ldb + 5;
                tb A = act_rand((int64_t)(ta ? K : M) * lda, 40, 1.0f);
                tb B = act_rand(bstride * G, 41, 1.0f);
                tb C = c_f32 ? f32_rand((int64_t)M * ldc, 42, 1.0f)
                             : act_rand((int64_t)M * ldc, 42, 1.0f);
                snprintf(sh, sizeof sh, "red0 rows{37,0,130,5} N%d K%d ta%d tb%d %s acc%d", N, K,
                         ta, tb_, c_f32 ? "f32" : "act", c_f32);
                BOTH(ok, "gemm_grouped", sh,
                     be->gemm_grouped(be, 0, C.p[s], c_f32, ldc, 0, A.p[s], lda, ta, B.p[s], ldb,
                                      tb_, bstride, rows, G, N, K, 0.75f, c_f32));
                if (ok) {
                    if (c_f32)
                        check_f32("gemm_grouped", sh, "C", &C, ldc, 1e-4);
                    else
                        check_act("gemm_grouped", sh, "C", &C, ldc, 1, 4, 1e-2);
                }
                tb_free(&A), tb_free(&B), tb_free(&C);
            }
    /* reduce 1: C_g[N, K] = sum_i A[r_g + i, :N]^T B[r_g + i, :K] */
    for (int c_f32 = 0; c_f32 < 3; c_f32++) {
        const int lda = N + 4, ldb = K + 2, ldc = K + 1;
        const int64_t cstride = (int64_t)N * ldc + 7;
        tb A = act_rand((int64_t)M * lda, 43, 1.0f), B = act_rand((int64_t)M * ldb, 44, 1.0f);
        tb C = c_rand(c_f32, cstride * G, 45);
        snprintf(sh, sizeof sh, "red1 rows{37,0,130,5} N%d K%d %s acc1", N, K, c_name(c_f32));
        BOTH(ok, "gemm_grouped", sh,
             be->gemm_grouped(be, 1, C.p[s], c_f32, ldc, cstride, A.p[s], lda, 0, B.p[s], ldb, 0,
                              0, rows, G, N, K, 1.0f, 1));
        if (ok) check_c("gemm_grouped", sh, c_f32, &C, ldc, 1e-4);
        tb_free(&A), tb_free(&B), tb_free(&C);
    }
}

/* ---- FP8 quantisation -------------------------------------------------------------- */

static int sum_tiles(const int *rows, int G)
{
    int t = 0;
    for (int g = 0; g < G; g++) t += mt_ceil_div(rows[g], MT_QTILE);
    return t;
}

static void test_quant_rows_cols(const int *rows, int G, int K, int ldx, float *xh_opt)
{
    int M = 0;
    for (int g = 0; g < G; g++) M += rows[g];
    const int KB = mt_ceil_div(K, MT_QTILE);
    char sh[128], rs[64] = "";
    int l = 0;
    for (int g = 0; g < G && l < 50; g++) l += snprintf(rs + l, sizeof rs - (size_t)l, "%s%d", g ? "," : "", rows[g]);
    snprintf(sh, sizeof sh, "rows{%s} K%d ldx%d", rs, K, ldx);
    float *xh = xh_opt;
    if (!xh) { /* tiles of varied magnitude, one all-zero tile */
        xh = rnd_act((int64_t)M * ldx, 50 + K, 1.0f);
        for (int64_t i = 0; i < (int64_t)M * ldx; i++) {
            int ex = (int)(mt_hash_u64(51, (uint64_t)(i / 97)) % 13) - 6;
            xh[i] = mt_bf16_round(ldexpf(xh[i], ex));
        }
        for (int k = 0; k < K && k < 128 && M > 0; k++) xh[k] = 0.0f; /* row 0, tile 0 */
    }
    tb x = tb_from(T_ACT, (int64_t)M * ldx, xh);
    tb q = tb_new(T_U8, (int64_t)M * K + 1), sc = tb_new(T_F32, (int64_t)KB * M + 1);
    int ok;
    BOTH(ok, "quant_rows", sh, be->quant_rows(be, q.p[s], sc.p[s], x.p[s], ldx, rows, G, K));
    if (ok) {
        check_exact("quant_rows", sh, "q", &q, K);
        check_exact("quant_rows", sh, "s", &sc, 0);
    }
    tb_free(&q), tb_free(&sc);
    const int tiles = sum_tiles(rows, G);
    q = tb_new(T_U8, (int64_t)M * K + 1);
    sc = tb_new(T_F32, (int64_t)tiles * K + 1);
    BOTH(ok, "quant_cols_t", sh, be->quant_cols_t(be, q.p[s], sc.p[s], x.p[s], ldx, rows, G, K));
    if (ok) {
        check_exact("quant_cols_t", sh, "q", &q, 0);
        check_exact("quant_cols_t", sh, "s", &sc, K);
    }
    /* both from one read: the same four outputs (the CPU's is the two
     * calls; the GPU's own kernel where K % 128 == 0 and ldx % 8 == 0) */
    tb_free(&q), tb_free(&sc);
    tb qr = tb_new(T_U8, (int64_t)M * K + 1), sr = tb_new(T_F32, (int64_t)KB * M + 1);
    q = tb_new(T_U8, (int64_t)M * K + 1);
    sc = tb_new(T_F32, (int64_t)tiles * K + 1);
    BOTH(ok, "quant_rows_cols_t", sh,
         be->quant_rows_cols_t(be, qr.p[s], sr.p[s], q.p[s], sc.p[s], x.p[s], ldx, rows, G, K));
    if (ok) {
        check_exact("quant_rows_cols_t", sh, "q", &qr, K);
        check_exact("quant_rows_cols_t", sh, "s", &sr, 0);
        check_exact("quant_rows_cols_t", sh, "qt", &q, 0);
        check_exact("quant_rows_cols_t", sh, "st", &sc, K);
    }
    tb_free(&qr), tb_free(&sr);
    tb_free(&q), tb_free(&sc), tb_free(&x);
    if (!xh_opt) free(xh);
}

/* Every 509th float up to 448 (both signs), every midpoint between adjacent
 * e4m3 codes and its two float neighbours, quantised at scale 1 (each 128
 * tile holds a 448): the hardware conversion must round exactly as
 * mt_e4m3_from_f32. Values are not bf16 here, so this goes through
 * quant_blocks (f32 input). */
static void test_e4m3_encoder(void)
{
    const uint32_t top = 0x43e00000u; /* 448 */
    int64_t n = 2 * (top / 509 + 1) + 3 * 2 * 0x7e;
    const int per = 127, K = 128;
    const int64_t N = (n + per - 1) / per;
    float *w = ref_floats(N * K);
    int64_t j = 0;
    float *vals = ref_floats(n);
    for (uint32_t u = 0; u <= top; u += 509) {
        vals[j++] = mt_bits_f32(u);
        vals[j++] = -mt_bits_f32(u);
    }
    for (int c = 0; c < 0x7e; c++) {
        float mid = (mt_e4m3_to_f32((uint8_t)c) + mt_e4m3_to_f32((uint8_t)(c + 1))) / 2;
        const float v[3] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
        for (int i = 0; i < 3; i++) vals[j++] = v[i], vals[j++] = -v[i];
    }
    n = j;
    /* a 448 in every row: every 128x128 block's scale is 1 */
    for (int64_t r = 0; r < N; r++) {
        w[r * K] = 448.0f;
        for (int i = 0; i < per; i++) {
            int64_t idx = r * per + i;
            w[r * K + 1 + i] = idx < n ? vals[idx] : 0.0f;
        }
    }
    char sh[96];
    snprintf(sh, sizeof sh, "encoder sweep %lld values (N%lld K%d)", (long long)n, (long long)N, K);
    tb wf = tb_from(T_F32, N * K, w);
    tb q = tb_new(T_U8, N * K), sc = tb_new(T_F32, mt_ceil_div((int)N, 128));
    int ok;
    BOTH(ok, "quant_blocks", sh, be->quant_blocks(be, q.p[s], sc.p[s], wf.p[s], (int)N, K));
    if (ok) {
        check_exact("quant_blocks", sh, "q", &q, K);
        check_exact("quant_blocks", sh, "s", &sc, 0);
    }
    tb_free(&wf), tb_free(&q), tb_free(&sc);
    free(w);
    free(vals);
}

/* The quantisers' codes at scales whose reciprocal is inexact (3, 5, 1000 /
 * 448, 0.01 / 448): every bf16 value up to each scale's amax, both signs,
 * 127 a row after the row's amax. At scale 3 every e4m3 midpoint times 3 is
 * a bf16 value, so x / s lands exactly on the ties, where a code computed
 * as x * (1 / s) would differ. The codes must equal the CPU's IEEE
 * division; quant_cols_t sees the same values in 128x1 tiles. */
static void test_e4m3_reciprocal_scales(void)
{
    const float lead[] = {1344.0f, 2240.0f, 1000.0f, 0.01f};
    const int per = 127, K = 128;
    int64_t n = 0, cap = 0;
    for (int i = 0; i < 4; i++) cap += 2 * (int64_t)(mt_bf16_from_f32(lead[i]) + 1) + per;
    float *vals = ref_floats(cap);
    int *row_lead = malloc(sizeof(int) * (size_t)(cap / per + 8));
    int rows = 0;
    for (int i = 0; i < 4; i++) {
        const int64_t first = n;
        const uint16_t top = mt_bf16_from_f32(lead[i]);
        for (uint32_t h = 0; h <= top; h++) {
            vals[n++] = mt_bf16_to_f32((uint16_t)h);
            vals[n++] = -mt_bf16_to_f32((uint16_t)h);
        }
        for (int64_t j = first; j < n; j += per) row_lead[rows++] = i;
        while (n % per) vals[n++] = 0.0f; /* each leader's values start a row */
    }
    const int rows4 = (rows + 3) / 4 * 4; /* quant_cols_t's path for segments of 4s */
    float *x = ref_floats((int64_t)rows4 * K);
    for (int r = rows; r < rows4; r++) /* extra rows: a 448 and zeros */
        for (int k = 0; k < K; k++) x[(int64_t)r * K + k] = k ? 0.0f : 448.0f;
    for (int r = 0; r < rows; r++) {
        x[(int64_t)r * K] = lead[row_lead[r]];
        for (int i = 0; i < per; i++) x[(int64_t)r * K + 1 + i] = vals[(int64_t)r * per + i];
    }
    const int segs[] = {rows, rows4};
    test_quant_rows_cols(segs, 1, K, K, x);
    test_quant_rows_cols(segs + 1, 1, K, K, x);
    free(x), free(vals), free(row_lead);
}

/* Zero rows, as the fp8 recipe pads every expert segment with (whole
 * 128-row tiles of quant_rows, 4-row groups of quant_cols_t, which skip
 * the division for them): +0 and -0 alternating, next to nonzero rows in
 * the same column tiles; codes must be zeros of the values' signs. */
static void test_quant_zero_rows(void)
{
    const int rows[] = {4, 0, 132, 256}, G = 4, K = 256, M = 392;
    float *x = rnd_act((int64_t)M * K, 77, 1.0f);
    for (int r = 0; r < M; r++) {
        const int zero = (r >= 4 + 64 && r < 4 + 132) || (r >= 136 + 128) || r == 1;
        if (zero)
            for (int k = 0; k < K; k++) x[(int64_t)r * K + k] = (k + r) % 2 ? -0.0f : 0.0f;
    }
    test_quant_rows_cols(rows, G, K, K, x);
    free(x);
}

static void test_quant_blocks_family(int N, int K, uint64_t seed)
{
    const int NB = mt_ceil_div(N, 128), KB = mt_ceil_div(K, 128);
    char sh[96];
    snprintf(sh, sizeof sh, "N%d K%d", N, K);
    float *w = rnd_f32((int64_t)N * K, seed, 0.02f);
    for (int64_t i = 0; i < (int64_t)N * K; i++) { /* blocks of varied magnitude */
        int n = (int)(i / K), k = (int)(i % K);
        w[i] = ldexpf(w[i], (int)((n / 128 * 7 + k / 128 * 3) % 9) - 4);
    }
    if (N > 128 && K > 128) /* one all-zero block: scale 1 */
        for (int n = 128; n < N && n < 256; n++)
            for (int k = 0; k < 128; k++) w[(int64_t)n * K + k] = 0.0f;
    tb wf = tb_from(T_F32, (int64_t)N * K, w);
    tb q = tb_new(T_U8, (int64_t)N * K), sc = tb_new(T_F32, (int64_t)NB * KB);
    int ok;
    BOTH(ok, "quant_blocks", sh, be->quant_blocks(be, q.p[s], sc.p[s], wf.p[s], N, K));
    if (ok) {
        check_exact("quant_blocks", sh, "q", &q, K);
        check_exact("quant_blocks", sh, "s", &sc, KB);
    }
    /* transpose and dequantise the CPU's codes on both */
    uint8_t *qh = ref_alloc((size_t)N * K);
    float *sh_ = ref_floats((int64_t)NB * KB);
    tb_get(&q, 0, qh);
    tb_get(&sc, 0, sh_);
    tb_put(&q, qh);
    tb_put(&sc, sh_);
    tb qt = tb_new(T_U8, (int64_t)N * K), st = tb_new(T_F32, (int64_t)NB * KB);
    BOTH(ok, "transpose_blocks", sh, be->transpose_blocks(be, qt.p[s], st.p[s], q.p[s], sc.p[s], N, K));
    if (ok) {
        check_exact("transpose_blocks", sh, "qt", &qt, N);
        check_exact("transpose_blocks", sh, "st", &st, NB);
    }
    tb wd = tb_new(T_F32, (int64_t)N * K);
    BOTH(ok, "dequant_blocks", sh, be->dequant_blocks(be, wd.p[s], q.p[s], sc.p[s], N, K));
    if (ok) check_exact("dequant_blocks", sh, "w", &wd, K);
    /* stochastic rounding */
    tb q2 = tb_new(T_U8, (int64_t)N * K), s2 = tb_new(T_F32, (int64_t)NB * KB);
    BOTH(ok, "quant_blocks_sr", sh,
         be->quant_blocks_sr(be, q2.p[s], s2.p[s], wf.p[s], N, K, 0x5eed0000ull + seed));
    if (ok) {
        check_exact("quant_blocks_sr", sh, "q", &q2, K);
        check_exact("quant_blocks_sr", sh, "s", &s2, KB);
    }
    tb_free(&wf), tb_free(&q), tb_free(&sc), tb_free(&qt), tb_free(&st), tb_free(&wd);
    tb_free(&q2), tb_free(&s2);
    free(w), free(qh), free(sh_);
}

static void test_fp8_quant(void)
{
    const int r1[] = {1}, r2[] = {300}, r3[] = {5, 0, 130, 257}, r4[] = {0, 128, 0};
    test_quant_rows_cols(r1, 1, 1, 1, NULL);
    test_quant_rows_cols(r2, 1, 520, 520, NULL);
    test_quant_rows_cols(r2, 1, 256, 300, NULL);
    test_quant_rows_cols(r3, 4, 200, 210, NULL);
    test_quant_rows_cols(r4, 3, 384, 384, NULL);
    /* aligned rows and segments of 4: the kernels' vector paths, with a
     * partial 64-column tile and partial 128-row tiles */
    const int r5[] = {4, 0, 132, 256};
    test_quant_rows_cols(r5, 4, 320, 328, NULL);
    test_quant_rows_cols(r5, 4, 256, 256, NULL);
    test_quant_rows_cols(r2, 1, 7168, 7168, NULL);
    test_quant_rows_cols(r1, 1, 384, 384, NULL); /* 3 tiles: a warp's last tiles empty */
    /* quant_rows_cols_t's kernel with segments that are not multiples of 4
     * (the transposed codes a byte at a time) and padded rows */
    test_quant_rows_cols(r3, 4, 256, 264, NULL);
    test_e4m3_encoder();
    test_e4m3_reciprocal_scales();
    test_quant_zero_rows();
    test_quant_blocks_family(1, 1, 60);
    test_quant_blocks_family(130, 300, 61);
    test_quant_blocks_family(384, 256, 62);
    test_quant_blocks_family(200, 1000, 63);
}

/* ---- FP8 GEMM ------------------------------------------------------------------------ */

/* The CPU's quantisation of host x [M, K] (ldx = K) uploaded to both sides,
 * so the GEMM sees identical operands. */
static void quant_both(const float *xh, int M, int K, const int *rows, int G, int cols_t, tb *q,
                       tb *s)
{
    const int KB = mt_ceil_div(K, MT_QTILE);
    const int64_t ns = cols_t ? (int64_t)sum_tiles(rows, G) * K : (int64_t)KB * M;
    mt_backend *cpu = BE[0];
    float *x;
    MUST(cpu->alloc(cpu, 4 * (size_t)M * K + 4, (void **)&x));
    memcpy(x, xh, 4 * (size_t)M * K); /* CPU backend memory is host memory */
    *q = tb_new(T_U8, (int64_t)M * K + 1);
    *s = tb_new(T_F32, ns + 1);
    if (cols_t)
        MUST(cpu->quant_cols_t(cpu, q->p[0], s->p[0], x, K, rows, G, K));
    else
        MUST(cpu->quant_rows(cpu, q->p[0], s->p[0], x, K, rows, G, K));
    uint8_t *qh = ref_alloc((size_t)M * K + 1);
    float *sh = ref_floats(ns + 1);
    tb_get(q, 0, qh);
    tb_get(s, 0, sh);
    tb_put(q, qh);
    tb_put(s, sh);
    free(qh), free(sh);
    cpu->free(cpu, x);
}

/* ldc = N + pad: an odd pad misaligns C's rows, which cuBLASLt's direct FP8
 * order (C written in place) cannot take, so such cases run the swapped
 * order or the fallback kernel; pad 0 or 8 with K < 4096 runs the direct
 * order, K >= 4096 the swapped one (cuda_gemm.cu, fp8_direct_pays). */
static void test_gemm_fp8_rows(const int *rows, int G, int N, int K, int c_f32, int acc, int pad)
{
    int M = 0;
    for (int g = 0; g < G; g++) M += rows[g];
    const int NB = mt_ceil_div(N, 128), KB = mt_ceil_div(K, 128), ldc = N + pad;
    char sh[128], rs[64] = "";
    int l = 0;
    for (int g = 0; g < G && l < 50; g++) l += snprintf(rs + l, sizeof rs - (size_t)l, "%s%d", g ? "," : "", rows[g]);
    snprintf(sh, sizeof sh, "red0 rows{%s} N%d K%d ldc%d %s acc%d", rs, N, K, ldc, c_f32 ? "f32" : "act", acc);
    float *xh = rnd_act((int64_t)M * K, 70 + G, 1.0f);
    tb qa, sa;
    quant_both(xh, M, K, rows, G, 0, &qa, &sa);
    /* G expert weights [N, K] quantised per 128x128 block by the CPU */
    const int64_t bstride = (int64_t)N * K, sbstride = (int64_t)NB * KB;
    float *w = rnd_f32(bstride * G, 71, 0.05f);
    tb wf = tb_from(T_F32, bstride * G, w);
    tb qb = tb_new(T_U8, bstride * G), sb = tb_new(T_F32, sbstride * G);
    for (int g = 0; g < G; g++)
        MUST(BE[0]->quant_blocks(BE[0], (uint8_t *)qb.p[0] + g * bstride,
                                 (float *)sb.p[0] + g * sbstride, (float *)wf.p[0] + g * bstride,
                                 N, K));
    uint8_t *qbh = ref_alloc((size_t)(bstride * G));
    float *sbh = ref_floats(sbstride * G);
    tb_get(&qb, 0, qbh);
    tb_get(&sb, 0, sbh);
    tb_put(&qb, qbh);
    tb_put(&sb, sbh);
    tb C = c_f32 ? f32_rand((int64_t)M * ldc + 1, 72, 1.0f) : act_rand((int64_t)M * ldc + 1, 72, 1.0f);
    int ok;
    BOTH(ok, "gemm_fp8", sh,
         be->gemm_fp8(be, 0, C.p[s], c_f32, ldc, 0, qa.p[s], sa.p[s], qb.p[s], sb.p[s], bstride,
                      sbstride, rows, G, N, K, acc));
    if (ok) {
        if (c_f32)
            check_f32("gemm_fp8", sh, "C", &C, ldc, 5e-3);
        else
            check_act("gemm_fp8", sh, "C", &C, ldc, 1, 4, 1e-2);
    }
    tb_free(&qa), tb_free(&sa), tb_free(&wf), tb_free(&qb), tb_free(&sb), tb_free(&C);
    free(xh), free(w), free(qbh), free(sbh);
}

static void test_gemm_fp8_reduce(const int *rows, int G, int N, int K, int c_f32, int acc, int pad)
{
    int M = 0;
    for (int g = 0; g < G; g++) M += rows[g];
    const int ldc = K + pad;
    /* each C_g 16-byte aligned unless pad (the grouped kernel's requirement) */
    const int64_t cstride = (int64_t)N * ldc + (pad % 4 ? 3 : 8);
    char sh[128], rs[64] = "";
    int l = 0;
    for (int g = 0; g < G && l < 50; g++) l += snprintf(rs + l, sizeof rs - (size_t)l, "%s%d", g ? "," : "", rows[g]);
    snprintf(sh, sizeof sh, "red1 rows{%s} N%d K%d ldc%d %s acc%d", rs, N, K, ldc, c_name(c_f32), acc);
    float *dy = rnd_act((int64_t)M * N, 80 + G, 1.0f), *x = rnd_act((int64_t)M * K, 81 + G, 1.0f);
    tb qa, sa, qb, sb;
    quant_both(dy, M, N, rows, G, 1, &qa, &sa);
    quant_both(x, M, K, rows, G, 1, &qb, &sb);
    tb C = c_rand(c_f32, cstride * G, 82);
    int ok;
    BOTH(ok, "gemm_fp8", sh,
         be->gemm_fp8(be, 1, C.p[s], c_f32, ldc, cstride, qa.p[s], sa.p[s], qb.p[s], sb.p[s], 0, 0,
                      rows, G, N, K, acc));
    if (ok) check_c("gemm_fp8", sh, c_f32, &C, ldc, 5e-3);
    tb_free(&qa), tb_free(&sa), tb_free(&qb), tb_free(&sb), tb_free(&C);
    free(dy), free(x);
}

static void test_gemm_fp8(void)
{
    const int r1[] = {200}, r2[] = {128}, r3[] = {130, 0, 77, 256}, r4[] = {1, 383};
    const int r5[] = {256, 0, 128, 384}, r6[] = {512};
    /* misaligned C: swapped order or fallback */
    test_gemm_fp8_rows(r1, 1, 300, 260, 0, 0, 2);
    test_gemm_fp8_rows(r2, 1, 256, 512, 0, 1, 2);
    test_gemm_fp8_rows(r2, 1, 256, 512, 1, 1, 2);
    test_gemm_fp8_rows(r3, 4, 128, 384, 0, 0, 2);
    test_gemm_fp8_rows(r4, 2, 96, 200, 0, 1, 2);
    test_gemm_fp8_reduce(r1, 1, 300, 260, 1, 1, 1);
    test_gemm_fp8_reduce(r2, 1, 256, 128, 1, 0, 1);
    test_gemm_fp8_reduce(r3, 4, 128, 384, 1, 1, 1);
    test_gemm_fp8_reduce(r4, 2, 96, 200, 0, 0, 1);
    /* aligned C, K < 4096: direct order (expanded block scales, C in place) */
    test_gemm_fp8_rows(r2, 1, 256, 512, 0, 0, 0);
    test_gemm_fp8_rows(r2, 1, 256, 512, 0, 1, 8);
    test_gemm_fp8_rows(r2, 1, 384, 640, 1, 1, 0);
    test_gemm_fp8_rows(r5, 4, 256, 384, 0, 0, 0);
    test_gemm_fp8_rows(r5, 4, 256, 384, 0, 1, 0);
    test_gemm_fp8_reduce(r2, 1, 256, 128, 1, 0, 0);
    test_gemm_fp8_reduce(r5, 4, 256, 384, 1, 1, 0);
    test_gemm_fp8_reduce(r6, 1, 384, 256, 0, 1, 0);
    /* bf16 gradient accumulators: the expert weight gradient dW_g += into
     * bf16 (direct order: cuBLASLt's D in place, beta 1), and misaligned */
    test_gemm_fp8_reduce(r5, 4, 256, 384, MT_C_BF16, 1, 0);
    test_gemm_fp8_reduce(r6, 1, 384, 256, MT_C_BF16, 1, 0);
    test_gemm_fp8_reduce(r3, 4, 128, 384, MT_C_BF16, 1, 1);
    test_gemm_fp8_reduce(r2, 1, 256, 128, MT_C_BF16, 0, 0);
    /* aligned C, K >= 4096: swapped order */
    test_gemm_fp8_rows(r6, 1, 256, 4096, 0, 0, 0);
    test_gemm_fp8_rows(r5, 4, 128, 4224, 0, 1, 8);
    /* Cases for the grouped kernel (cuda_fp8_grouped.cu, MOETRAIN_FP8_GEMM=own:
     * K % 16 == 0, N even, ldc % 4 == 0; cuBLASLt runs them otherwise and
     * by default): row tiles cut by their segment's end, empty segments,
     * partial N tiles (a 2-column tail among them) and K blocks (TMA's zero
     * fill), and more tiles than SMs, so CTAs loop and the ring of slots
     * wraps across tiles. main runs all of test_gemm_fp8 on that kernel
     * once more, the G = 1 cases too. */
    const int r7[] = {3, 129, 250}, r8[] = {600, 300, 0, 450, 520};
    test_gemm_fp8_rows(r7, 3, 300, 272, 1, 1, 0);
    test_gemm_fp8_rows(r7, 3, 300, 272, 0, 1, 4);
    test_gemm_fp8_rows(r7, 3, 298, 272, 1, 1, 2);
    test_gemm_fp8_rows(r7, 3, 298, 272, 0, 0, 6);
    test_gemm_fp8_rows(r8, 5, 1024, 512, 0, 0, 0);
    test_gemm_fp8_rows(r8, 5, 1152, 640, 1, 1, 4);
    /* more groups than expert streams (the CUDA backend's stream g % 4), of
     * unequal sizes out of order, empty ones and a 1-row one among them,
     * every segment with its own offsets and scales */
    const int r9[] = {0, 384, 128, 0, 640, 256, 128, 512, 1};
    test_gemm_fp8_rows(r9, 9, 256, 384, 0, 1, 0);
    test_gemm_fp8_rows(r9, 9, 128, 4224, 1, 0, 0);
    /* C's tiles by TMA (every segment whole 128-row tiles, C's rows whole
     * 16-byte pieces): N cut by the tile (1096 = 5 x 192 + 136; 3080 = 16 x
     * 192 + 8, 204 tiles, more than SMs), empty segments, the padding past
     * N left as it was, f32 and bf16 C with and without accumulation */
    const int rt1[] = {256, 0, 128, 640, 128, 384};
    test_gemm_fp8_rows(rt1, 6, 1096, 512, 0, 1, 8);
    test_gemm_fp8_rows(rt1, 6, 1096, 512, 1, 0, 4);
    test_gemm_fp8_rows(rt1, 6, 3080, 256, 0, 0, 0);
    test_gemm_fp8_rows(rt1, 6, 3080, 256, 1, 1, 0);
    test_gemm_fp8_reduce(r8, 5, 256, 384, 1, 1, 0);
    test_gemm_fp8_reduce(r9, 9, 128, 256, MT_C_BF16, 1, 0);
    test_gemm_fp8_reduce(r9, 9, 128, 256, 1, 0, 1);
    /* Cases for the weight-gradient kernel (cuda_fp8_wgrad, =own: segments
     * of whole 128-row blocks, N and K multiples of 4, aligned C): empty
     * groups, row tiles cut by N (1100 = 8 x 128 + 76) and column tiles by
     * K (772 = 4 x 192 + 4 for f32 C, 776 for bf16: C's rows are stored by
     * TMA, which writes whole 16-byte pieces), more tiles than SMs (6 x 9 x
     * 5 = 270, the ring wrapping across tiles of different K lengths), f32
     * and bf16 C with and without accumulation, C's rows longer than K with
     * the padding left as it was (ldc 776, 784; and ldc 776 over K 772 in
     * bf16, where the kernel would write into the padding, so another path
     * takes it); and more groups than one launch takes (70: launches of 64
     * and 6). */
    const int rw1[] = {256, 0, 128, 640, 128, 384};
    test_gemm_fp8_reduce(rw1, 6, 1100, 772, 1, 1, 0);
    test_gemm_fp8_reduce(rw1, 6, 1100, 772, 1, 0, 4);
    test_gemm_fp8_reduce(rw1, 6, 1100, 776, MT_C_BF16, 1, 0);
    test_gemm_fp8_reduce(rw1, 6, 1100, 776, MT_C_BF16, 0, 8);
    test_gemm_fp8_reduce(rw1, 6, 1100, 776, MT_C_BF16, 1, 8);
    test_gemm_fp8_reduce(rw1, 6, 1100, 772, MT_C_BF16, 0, 4);
    int rw2[70];
    for (int g = 0; g < 70; g++) rw2[g] = g % 3 == 1 ? 0 : 128 * (1 + g % 4);
    test_gemm_fp8_reduce(rw2, 70, 132, 196, 1, 1, 0);
    test_gemm_fp8_reduce(rw2, 70, 132, 200, MT_C_BF16, 0, 0);
    /* segments of a few rows after whole tiles, on both sides of the
     * backend's smallest cuBLASLt row count (16), in both orders */
    const int r10[] = {512, 16, 1, 17, 8, 32, 2, 128};
    test_gemm_fp8_rows(r10, 8, 256, 384, 0, 1, 0);
    test_gemm_fp8_rows(r10, 8, 256, 384, 1, 0, 0);
    test_gemm_fp8_rows(r10, 8, 128, 4224, 0, 0, 0);
    test_gemm_fp8_rows(r10, 8, 128, 4224, 1, 1, 0);
}

/* ---- norms, SwiGLU, embedding ------------------------------------------------------------- */

/* prop names what the shape exercises (which CUDA kernel path). */
static void test_rmsnorm(int M, int D, int pad, const char *prop)
{
    const int ld = D + pad;
    char sh[96];
    snprintf(sh, sizeof sh, "M%d D%d ld%d %s", M, D, ld, prop);
    float *wh = rnd_act(D, 90, 0.3f);
    for (int k = 0; k < D; k++) wh[k] = mt_bf16_round(1.0f + wh[k]);
    tb x = act_rand((int64_t)M * ld, 91, 2.0f), w = tb_from(T_ACT, D, wh);
    tb y = act_rand((int64_t)M * ld, 92, 1.0f), rstd = tb_new(T_F32, M);
    int ok;
    BOTH(ok, "rmsnorm_fwd", sh, be->rmsnorm_fwd(be, y.p[s], ld, rstd.p[s], x.p[s], ld, w.p[s], M, D, 1e-6f));
    if (ok) {
        check_act("rmsnorm_fwd", sh, "y", &y, ld, 1, 0, 1e-2);
        check_f32("rmsnorm_fwd", sh, "rstd", &rstd, 0, 1e-6);
    }
    /* the backward from the CPU's rstd on both */
    float *rh = ref_floats(M);
    tb_get(&rstd, 0, rh);
    tb_put(&rstd, rh);
    for (int acc = 0; acc < 2; acc++) {
        char s2[112];
        snprintf(s2, sizeof s2, "%s acc%d", sh, acc);
        tb dy = act_rand((int64_t)M * ld, 93, 1.0f), dx = act_rand((int64_t)M * ld, 94, 1.0f);
        tb dw = f32_rand(D, 95, 1.0f);
        BOTH(ok, "rmsnorm_bwd", s2,
             be->rmsnorm_bwd(be, dx.p[s], ld, acc, dw.p[s], MT_C_F32, dy.p[s], ld, x.p[s], ld, w.p[s],
                             rstd.p[s], M, D));
        if (ok) {
            check_act("rmsnorm_bwd", s2, "dx", &dx, ld, 1, 0, 1e-2);
            check_f32("rmsnorm_bwd", s2, "dw", &dw, 0, 1e-5);
        }
        tb_free(&dy), tb_free(&dx), tb_free(&dw);
    }
    {   /* a bf16 dw (precision.grads bf16): the same double sums, rounded
         * through float to bf16: one rounding boundary apart at most */
        char s2[112];
        snprintf(s2, sizeof s2, "%s dw bf16", sh);
        tb dy = act_rand((int64_t)M * ld, 93, 1.0f), dx = act_rand((int64_t)M * ld, 94, 1.0f);
        tb dw = bf16_rand(D, 96, 1.0f);
        BOTH(ok, "rmsnorm_bwd", s2,
             be->rmsnorm_bwd(be, dx.p[s], ld, 1, dw.p[s], MT_C_BF16, dy.p[s], ld, x.p[s], ld,
                             w.p[s], rstd.p[s], M, D));
        if (ok) check_bf16("rmsnorm_bwd", s2, "dw", &dw, 0, 1, 0, 1e-2);
        tb_free(&dy), tb_free(&dx), tb_free(&dw);
    }
    tb_free(&x), tb_free(&w), tb_free(&y), tb_free(&rstd);
    free(wh), free(rh);
}

static void test_rmsnorm_shapes(void)
{
    test_rmsnorm(7, 100, 0, "unaligned rows: element kernels");
    test_rmsnorm(5, 512, 3, "ld%8!=0: element kernels");
    test_rmsnorm(300, 1024, 24, "ld>D: 16-byte kernels");
    test_rmsnorm(64, 7168, 0, "DSV3 hidden: 16-byte kernels");
    test_rmsnorm(37, 100, 4, "D%8=4 tail, ld>D: 16-byte kernels");
    test_rmsnorm(300, 512, 64, "kv_a ld576: 16-byte, 12-row last chunk");
    test_rmsnorm(2100, 520, 0, "33-row chunks, D/8 odd: 16-byte");
    test_rmsnorm(3, 12288, 0, "bwd rows past shared memory: element dx");
    test_rmsnorm(4096, 256, 8, "64 chunks: fused bwd, 16-byte");
}

static void test_swiglu(int M, int F)
{
    char sh[64];
    snprintf(sh, sizeof sh, "M%d F%d", M, F);
    tb gu = act_rand((int64_t)M * 2 * F, 100, 3.0f), h = tb_new(T_ACT, (int64_t)M * F);
    int ok;
    BOTH(ok, "swiglu_fwd", sh, be->swiglu_fwd(be, h.p[s], gu.p[s], M, F));
    if (ok) check_act("swiglu_fwd", sh, "h", &h, F, 1, 0, 1e-2);
    tb dh = act_rand((int64_t)M * F, 101, 1.0f), dgu = tb_new(T_ACT, (int64_t)M * 2 * F);
    BOTH(ok, "swiglu_bwd", sh, be->swiglu_bwd(be, dgu.p[s], dh.p[s], gu.p[s], M, F));
    if (ok) check_act("swiglu_bwd", sh, "dgu", &dgu, 2 * F, 1, 0, 1e-2);
    tb_free(&gu), tb_free(&h), tb_free(&dh), tb_free(&dgu);
}

static void test_embedding(int V, int D, int M)
{
    char sh[64];
    snprintf(sh, sizeof sh, "V%d D%d M%d", V, D, M);
    int32_t *ids = ref_alloc(4 * (size_t)M);
    ref_fill_ids(ids, M, 110 + V, V);
    if (M > 10) for (int m = 0; m < M / 3; m++) ids[m * 3] = 7 % V; /* a frequent token */
    tb id = tb_from(T_I32, M, ids), table = act_rand((int64_t)V * D, 111, 1.0f);
    tb y = tb_new(T_ACT, (int64_t)M * D);
    int ok;
    BOTH(ok, "embedding_fwd", sh, be->embedding_fwd(be, y.p[s], table.p[s], id.p[s], M, D));
    if (ok) check_exact("embedding_fwd", sh, "y", &y, D);
    tb dy = act_rand((int64_t)M * D, 112, 1.0f), dt = f32_rand((int64_t)V * D, 113, 0.1f);
    BOTH(ok, "embedding_bwd", sh, be->embedding_bwd(be, dt.p[s], MT_C_F32, dy.p[s], id.p[s], M, D));
    if (ok) check_exact("embedding_bwd", sh, "dtable", &dt, D); /* same f32 adds in row order */
    /* bf16 table: the same f32 adds from the row's value, rounded once */
    tb dtb = bf16_rand((int64_t)V * D, 114, 0.1f);
    char s2[80];
    snprintf(s2, sizeof s2, "%s bf16", sh);
    BOTH(ok, "embedding_bwd", s2,
         be->embedding_bwd(be, dtb.p[s], MT_C_BF16, dy.p[s], id.p[s], M, D));
    if (ok) check_exact("embedding_bwd", s2, "dtable", &dtb, D);
    tb_free(&id), tb_free(&table), tb_free(&y), tb_free(&dy), tb_free(&dt), tb_free(&dtb);
    free(ids);
}

/* ---- attention --------------------------------------------------------------------------- */

static void test_rope(int B, int T, int H, int hs, int off, int R, int extra)
{
    const int N = B * T, ld = H * hs + extra, half = R / 2;
    float *ct = ref_floats((int64_t)T * half), *st = ref_floats((int64_t)T * half);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double ang = t / pow(10000.0, 2.0 * i / R);
            ct[t * half + i] = (float)(1.1 * cos(ang));
            st[t * half + i] = (float)(1.1 * sin(ang));
        }
    tb c = tb_from(T_F32, (int64_t)T * half, ct), sn = tb_from(T_F32, (int64_t)T * half, st);
    for (int il = 0; il < 2; il++)
        for (int inv = 0; inv < 2; inv++) {
            char sh[112];
            snprintf(sh, sizeof sh, "B%d T%d H%d ld%d hs%d off%d R%d il%d inv%d", B, T, H, ld, hs,
                     off, R, il, inv);
            tb x = act_rand((int64_t)N * ld, 120 + il, 1.0f);
            int ok;
            BOTH(ok, "rope", sh,
                 be->rope(be, x.p[s], N, T, H, ld, hs, off, R, c.p[s], sn.p[s], il, inv));
            if (ok) check_act("rope", sh, "x", &x, ld, 1, 0, 1e-2);
            tb_free(&x);
        }
    tb_free(&c), tb_free(&sn);
    free(ct), free(st);
}

static void test_attn_shape(int B, int T, int H, int Dqk, int Dv, const char *mode)
{
    const int N = B * T;
    const float scale = 1.0f / sqrtf((float)Dqk);
    char sh[112];
    snprintf(sh, sizeof sh, "B%d T%d H%d Dqk%d Dv%d [%s]", B, T, H, Dqk, Dv, mode);
    if (strcmp(mode, "auto"))
        setenv("MOETRAIN_ATTN", mode, 1);
    else
        unsetenv("MOETRAIN_ATTN");
    tb q = act_rand((int64_t)N * H * Dqk, 130, 1.0f), k = act_rand((int64_t)N * H * Dqk, 131, 1.0f);
    tb v = act_rand((int64_t)N * H * Dv, 132, 1.0f);
    tb o = tb_new(T_ACT, (int64_t)N * H * Dv), lse = tb_new(T_F32, (int64_t)B * H * T);
    int ok;
    const int cudnn = !strcmp(mode, "own") ? 0 : 1;
    const double b_ulp = cudnn ? 8 : 4;
    BOTH(ok, "attn_fwd", sh,
         be->attn_fwd(be, o.p[s], lse.p[s], q.p[s], k.p[s], v.p[s], B, T, H, Dqk, Dv, scale));
    if (ok) {
        printf("INFO  attn_fwd           %-46s path: %s\n", sh, cuda_attn_last_path(BE[1]));
        check_act("attn_fwd", sh, "o", &o, H * Dv, 1, b_ulp, 1e-2);
        check_f32("attn_fwd", sh, "lse", &lse, T, 1e-4);
    }
    /* backward from the CPU's o and lse on both */
    float *oh = ref_floats((int64_t)N * H * Dv), *lh = ref_floats((int64_t)B * H * T);
    tb_get(&o, 0, oh);
    tb_get(&lse, 0, lh);
    tb_put(&o, oh);
    tb_put(&lse, lh);
    tb dout = act_rand((int64_t)N * H * Dv, 133, 1.0f);
    tb dq = tb_new(T_ACT, (int64_t)N * H * Dqk), dk = tb_new(T_ACT, (int64_t)N * H * Dqk);
    tb dv = tb_new(T_ACT, (int64_t)N * H * Dv);
    BOTH(ok, "attn_bwd", sh,
         be->attn_bwd(be, dq.p[s], dk.p[s], dv.p[s], dout.p[s], q.p[s], k.p[s], v.p[s], o.p[s],
                      lse.p[s], B, T, H, Dqk, Dv, scale));
    if (ok) {
        printf("INFO  attn_bwd           %-46s path: %s\n", sh, cuda_attn_last_path(BE[1]));
        check_act("attn_bwd", sh, "dq", &dq, H * Dqk, 1, b_ulp, 1e-2);
        check_act("attn_bwd", sh, "dk", &dk, H * Dqk, 1, b_ulp, 1e-2);
        check_act("attn_bwd", sh, "dv", &dv, H * Dv, 1, b_ulp, 1e-2);
    }
    unsetenv("MOETRAIN_ATTN");
    tb_free(&q), tb_free(&k), tb_free(&v), tb_free(&o), tb_free(&lse);
    tb_free(&dout), tb_free(&dq), tb_free(&dk), tb_free(&dv);
    free(oh), free(lh);
}

static void test_mla_kv(int N, int H, int Dn, int R, int Dv, int ld_kpe)
{
    char sh[96];
    snprintf(sh, sizeof sh, "N%d H%d Dn%d R%d Dv%d ld_kpe%d", N, H, Dn, R, Dv, ld_kpe);
    tb kvb = act_rand((int64_t)N * H * (Dn + Dv), 140, 1.0f), kpe = act_rand((int64_t)N * ld_kpe, 141, 1.0f);
    tb k = tb_new(T_ACT, (int64_t)N * H * (Dn + R)), v = tb_new(T_ACT, (int64_t)N * H * Dv);
    int ok;
    BOTH(ok, "mla_kv_fwd", sh,
         be->mla_kv_fwd(be, k.p[s], v.p[s], kvb.p[s], kpe.p[s], ld_kpe, N, H, Dn, R, Dv));
    if (ok) {
        check_exact("mla_kv_fwd", sh, "k", &k, H * (Dn + R));
        check_exact("mla_kv_fwd", sh, "v", &v, H * Dv);
    }
    tb dk = act_rand((int64_t)N * H * (Dn + R), 142, 1.0f), dv = act_rand((int64_t)N * H * Dv, 143, 1.0f);
    tb dkvb = tb_new(T_ACT, (int64_t)N * H * (Dn + Dv)), dkpe = act_rand((int64_t)N * ld_kpe, 144, 1.0f);
    BOTH(ok, "mla_kv_bwd", sh,
         be->mla_kv_bwd(be, dkvb.p[s], dkpe.p[s], ld_kpe, dk.p[s], dv.p[s], N, H, Dn, R, Dv));
    if (ok) {
        check_exact("mla_kv_bwd", sh, "dkvb", &dkvb, H * (Dn + Dv));
        check_act("mla_kv_bwd", sh, "dkpe", &dkpe, ld_kpe, 1, 0, 1e-2); /* sum over heads */
    }
    tb_free(&kvb), tb_free(&kpe), tb_free(&k), tb_free(&v);
    tb_free(&dk), tb_free(&dv), tb_free(&dkvb), tb_free(&dkpe);
}

static void test_attention(void)
{
    test_rope(2, 37, 3, 12, 8, 4, 0);       /* MLA q: [N, H, Dn + R], rope part at Dn */
    test_rope(2, 37, 1, 20, 16, 4, 0);      /* kv_a output: [N, KL + R] */
    test_rope(1, 128, 4, 192, 128, 64, 5);  /* DeepSeek-V3 head, padded rows (element kernel) */
    /* the vector kernel: aligned head slices, R % 8 == 0 */
    test_rope(1, 128, 4, 192, 128, 64, 0);  /* DeepSeek-V3 q heads, aligned */
    test_rope(2, 37, 1, 576, 512, 64, 0);   /* DeepSeek-V3 kv_a's rope key (ld 576), 8 slots a token */
    test_rope(2, 37, 3, 12, 4, 8, 0);       /* 8-byte aligned only: il0 vector, il1 element kernel */
    test_rope(1, 16, 40, 64, 0, 64, 0);     /* 320 slots a token: a partial second block */
    const char *modes[] = {"own", "auto"};
    for (int m = 0; m < 2; m++) {
        test_attn_shape(2, 37, 3, 192, 128, modes[m]);
        test_attn_shape(1, 128, 2, 192, 128, modes[m]);
        test_attn_shape(2, 200, 2, 192, 128, modes[m]);
        test_attn_shape(3, 1, 2, 12, 8, modes[m]);
        test_attn_shape(2, 64, 4, 24, 16, modes[m]);
    }
    test_mla_kv(37, 3, 8, 4, 8, 20);
    test_mla_kv(100, 4, 128, 64, 128, 576);
}

/* ---- MoE -------------------------------------------------------------------------------- */

static mt_router_cfg rcfg(int E, int K, int G, int TG, mt_score_fn fn, int top2, int norm, float sc)
{
    mt_router_cfg c = {E, K, G, TG, fn, top2, norm, sc};
    return c;
}

static void cfg_text(char *buf, size_t cap, const mt_router_cfg *c, int N, const char *extra)
{
    snprintf(buf, cap, "N%d E%d K%d G%d/%d %s%s%s %s", N, c->n_experts, c->top_k, c->n_group,
             c->topk_group, c->score_fn == MT_SCORE_SIGMOID ? "sig" : "smax",
             c->group_by_top2 ? " top2" : "", c->norm_topk ? " norm" : "", extra);
}

/* Router forward on both; returns the CPU's idx / scores / w (host) for
 * the later MoE tests, which then start from identical selections. */
static void test_router(const mt_router_cfg *c, int N, int ties, int use_bias, int32_t **idx_out,
                        float **scores_out, float **w_out)
{
    const int E = c->n_experts, K = c->top_k;
    char sh[112];
    cfg_text(sh, sizeof sh, c, N, ties ? "ties" : (use_bias ? "bias" : ""));
    float *lg = rnd_f32((int64_t)N * E, 150 + E, 2.0f), *bh = ref_floats(E);
    for (int e = 0; e < E; e++) bh[e] = 0.05f * (float)((e * 7) % 5) - 0.1f;
    if (ties) /* few distinct values: equal biased scores are frequent */
        for (int64_t i = 0; i < (int64_t)N * E; i++)
            lg[i] = (float)(mt_hash_u64(151, (uint64_t)i) % 4) - 1.5f;
    tb l = tb_from(T_F32, (int64_t)N * E, lg), b = tb_from(T_F32, E, bh);
    tb idx = tb_new(T_I32, (int64_t)N * K), w = tb_new(T_F32, (int64_t)N * K);
    tb sc = tb_new(T_F32, (int64_t)N * E);
    int ok;
    BOTH(ok, "router_fwd", sh,
         be->router_fwd(be, idx.p[s], w.p[s], sc.p[s], l.p[s], use_bias || ties ? b.p[s] : NULL, N, c));
    if (ok) {
        check_exact("router_fwd", sh, "idx", &idx, K);
        check_f32("router_fwd", sh, "scores", &sc, E, 1e-6);
        check_f32("router_fwd", sh, "w", &w, K, 1e-6);
    }
    if (idx_out) {
        *idx_out = ref_alloc(4 * (size_t)N * K);
        *scores_out = ref_floats((int64_t)N * E);
        *w_out = ref_floats((int64_t)N * K);
        tb_get(&idx, 0, *idx_out);
        tb_get(&sc, 0, *scores_out);
        tb_get(&w, 0, *w_out);
    }
    tb_free(&l), tb_free(&b), tb_free(&idx), tb_free(&w), tb_free(&sc);
    free(lg), free(bh);
}

static void test_router_bwd_aux(const mt_router_cfg *c, int B, int T, const int32_t *idxh,
                                const float *sch)
{
    const int E = c->n_experts, K = c->top_k, N = B * T;
    char sh[112];
    cfg_text(sh, sizeof sh, c, N, "");
    tb idx = tb_from(T_I32, (int64_t)N * K, idxh), sc = tb_from(T_F32, (int64_t)N * E, sch);
    /* aux_loss: loss accumulates onto 0.25 */
    const float l0 = 0.25f;
    tb loss = tb_from(T_F32, 1, &l0), ds = tb_new(T_F32, (int64_t)N * E);
    char sh2[128];
    snprintf(sh2, sizeof sh2, "B%d T%d E%d K%d a0.01 gs0.5", B, T, E, K);
    int ok;
    BOTH(ok, "aux_loss", sh2,
         be->aux_loss(be, loss.p[s], ds.p[s], sc.p[s], idx.p[s], B, T, 0.01f, 0.5f, c));
    if (ok) {
        check_f32("aux_loss", sh2, "loss", &loss, 0, 1e-6);
        check_f32("aux_loss", sh2, "dscore", &ds, E, 1e-5);
    }
    /* router_bwd without and with dscores (the CPU's, on both) */
    float *dsh = ref_floats((int64_t)N * E);
    tb_get(&ds, 0, dsh);
    tb_put(&ds, dsh);
    tb dw = f32_rand((int64_t)N * K, 160, 1.0f), dl = tb_new(T_F32, (int64_t)N * E);
    for (int with = 0; with < 2; with++) {
        char sh3[128];
        snprintf(sh3, sizeof sh3, "%s%s", sh, with ? " +dscores" : "");
        BOTH(ok, "router_bwd", sh3,
             be->router_bwd(be, dl.p[s], dw.p[s], with ? ds.p[s] : NULL, sc.p[s], idx.p[s], N, c));
        if (ok) check_f32("router_bwd", sh3, "dlogit", &dl, E, 1e-5);
    }
    tb_free(&idx), tb_free(&sc), tb_free(&loss), tb_free(&ds), tb_free(&dw), tb_free(&dl);
    free(dsh);
}

static void test_moe_index_permute(const int32_t *idxh, const float *wh, int N, int K, int E,
                                   int align, int D)
{
    const int R_cap = N * K + E * (align - 1);
    char sh[96];
    snprintf(sh, sizeof sh, "N%d K%d E%d align%d", N, K, E, align);
    tb idx = N > 0 ? tb_from(T_I32, (int64_t)N * K, idxh) : tb_new(T_I32, 1);
    tb slot = tb_new(T_I32, (int64_t)N * K), src = tb_new(T_I32, R_cap), cnt = tb_new(T_I32, E);
    int *rows[2] = {ref_alloc(4 * (size_t)E), ref_alloc(4 * (size_t)E)};
    int ok;
    BOTH(ok, "moe_index", sh,
         be->moe_index(be, slot.p[s], src.p[s], cnt.p[s], rows[s], idx.p[s], N, K, E, align, R_cap));
    if (!ok) goto out;
    check_exact("moe_index", sh, "slot", &slot, K);
    check_exact("moe_index", sh, "src", &src, 0);
    check_exact("moe_index", sh, "counts", &cnt, 0);
    check_exact_host("moe_index", sh, "rows", rows[0], rows[1], E, 4, 0, 0);
    if (N == 0) goto out;
    int R = 0;
    for (int e = 0; e < E; e++) R += rows[0][e];
    /* permutations with the CPU's index on both */
    int32_t *slh = ref_alloc(4 * (size_t)N * K), *srh = ref_alloc(4 * (size_t)R_cap);
    tb_get(&slot, 0, slh);
    tb_get(&src, 0, srh);
    tb_put(&slot, slh);
    tb_put(&src, srh);
    snprintf(sh, sizeof sh, "N%d K%d E%d align%d R%d D%d", N, K, E, align, R, D);
    tb x = act_rand((int64_t)N * D, 170, 1.0f), xp = act_rand((int64_t)R * D, 171, 1.0f);
    BOTH(ok, "moe_permute", sh, be->moe_permute(be, xp.p[s], x.p[s], src.p[s], R, D));
    if (ok) check_exact("moe_permute", sh, "xp", &xp, D);
    tb w = tb_from(T_F32, (int64_t)N * K, wh);
    for (int acc = 0; acc < 2; acc++) {
        char s2[128];
        snprintf(s2, sizeof s2, "%s acc%d", sh, acc);
        tb dx = act_rand((int64_t)N * D, 172, 1.0f);
        BOTH(ok, "moe_permute_bwd", s2, be->moe_permute_bwd(be, dx.p[s], acc, xp.p[s], slot.p[s], N, K, D));
        if (ok) check_act("moe_permute_bwd", s2, "dx", &dx, D, 1, 0, 1e-2);
        tb y = act_rand((int64_t)N * D, 173, 1.0f);
        BOTH(ok, "moe_unpermute", s2, be->moe_unpermute(be, y.p[s], acc, xp.p[s], slot.p[s], w.p[s], N, K, D));
        if (ok) check_act("moe_unpermute", s2, "y", &y, D, 1, 0, 1e-2);
        tb_free(&dx), tb_free(&y);
    }
    tb dy = act_rand((int64_t)N * D, 174, 1.0f), dyp = act_rand((int64_t)R * D, 175, 1.0f);
    tb dw = tb_new(T_F32, (int64_t)N * K);
    BOTH(ok, "moe_unpermute_bwd", sh,
         be->moe_unpermute_bwd(be, dyp.p[s], dw.p[s], dy.p[s], xp.p[s], slot.p[s], w.p[s], N, K, D, R));
    if (ok) {
        check_act("moe_unpermute_bwd", sh, "dyp", &dyp, D, 1, 0, 1e-2);
        check_f32("moe_unpermute_bwd", sh, "dw", &dw, K, 1e-5);
    }
    tb_free(&x), tb_free(&xp), tb_free(&w), tb_free(&dy), tb_free(&dyp), tb_free(&dw);
    free(slh), free(srh);
out:
    tb_free(&idx), tb_free(&slot), tb_free(&src), tb_free(&cnt);
    free(rows[0]), free(rows[1]);
}

static void test_moe(void)
{
    /* DeepSeek-V3: 256 experts in 8 groups, top-4 groups by top-2 sums, top-8 */
    mt_router_cfg v3 = rcfg(256, 8, 8, 4, MT_SCORE_SIGMOID, 1, 1, 2.5f);
    mt_router_cfg v2 = rcfg(64, 6, 1, 1, MT_SCORE_SOFTMAX, 0, 0, 1.0f);
    mt_router_cfg grp_max = rcfg(64, 6, 8, 3, MT_SCORE_SOFTMAX, 0, 1, 1.0f);
    mt_router_cfg tiny = rcfg(8, 2, 4, 2, MT_SCORE_SIGMOID, 1, 1, 1.5f);
    mt_router_cfg k1 = rcfg(16, 1, 1, 1, MT_SCORE_SIGMOID, 0, 1, 1.0f);
    int32_t *idx;
    float *sc, *w;
    /* B x T = 4 x 256 tokens */
    test_router(&v3, 1024, 0, 1, &idx, &sc, &w);
    test_router_bwd_aux(&v3, 4, 256, idx, sc);
    test_moe_index_permute(idx, w, 1024, 8, 256, 1, 256);
    test_moe_index_permute(idx, w, 1024, 8, 256, 128, 200);
    free(idx), free(sc), free(w);
    test_router(&v3, 1000, 1, 1, NULL, NULL, NULL);
    test_router(&v2, 999, 0, 0, &idx, &sc, &w);
    test_router_bwd_aux(&v2, 3, 333, idx, sc);
    test_moe_index_permute(idx, w, 999, 6, 64, 16, 72);
    free(idx), free(sc), free(w);
    test_router(&grp_max, 500, 1, 0, NULL, NULL, NULL);
    test_router(&tiny, 16, 0, 1, &idx, &sc, &w);
    test_router_bwd_aux(&tiny, 2, 8, idx, sc);
    test_moe_index_permute(idx, w, 16, 2, 8, 128, 32);
    test_moe_index_permute(idx, w, 16, 2, 8, 128, 30); /* D % 8 != 0: the element kernels */
    free(idx), free(sc), free(w);
    test_router(&k1, 300, 0, 0, &idx, &sc, &w);
    test_router_bwd_aux(&k1, 1, 300, idx, sc);
    free(idx), free(sc), free(w);
    test_moe_index_permute(NULL, NULL, 0, 8, 16, 4, 64); /* no tokens */
}

/* ---- loss and optimizer ------------------------------------------------------------------- */

static void test_xent(int M, int V, float gscale)
{
    char sh[64];
    snprintf(sh, sizeof sh, "M%d V%d gs%.2g", M, V, gscale);
    const int ignore = -100;
    int32_t *t = ref_alloc(4 * (size_t)M);
    ref_fill_ids(t, M, 180, V);
    t[M / 2] = ignore;
    tb tg = tb_from(T_I32, M, t), lg = act_rand((int64_t)M * V, 181, 3.0f), loss = tb_new(T_F32, M);
    int ok;
    BOTH(ok, "xent", sh, be->xent(be, loss.p[s], lg.p[s], tg.p[s], M, V, ignore, gscale));
    if (ok) {
        check_f32("xent", sh, "loss", &loss, 0, 1e-5);
        check_act("xent", sh, "grad", &lg, V, 2, 0, 1e-2);
    }
    tb_free(&tg), tb_free(&lg), tb_free(&loss);
    free(t);
}

/* The vocabulary-parallel parts: this part's statistics (targets across the
 * whole vocabulary, so some rows hold theirs and some not), then the finish
 * from them and a second part's statistics (host values: max, sum, target
 * logit), as mt_tp_xent combines P = 2 parts. */
static void test_xent_part(int M, int V, int v_lo, float gscale)
{
    char sh[64];
    snprintf(sh, sizeof sh, "M%d V%d v_lo%d gs%.2g", M, V, v_lo, gscale);
    const int ignore = -100, Vall = v_lo + V + 7;
    int32_t *t = ref_alloc(4 * (size_t)M);
    ref_fill_ids(t, M, 182, Vall);
    t[M / 2] = ignore;
    tb tg = tb_from(T_I32, M, t), lg = act_rand((int64_t)M * V, 183, 3.0f);
    tb st = tb_new(T_F32, 3 * (int64_t)M), loss = tb_new(T_F32, M);
    int ok;
    BOTH(ok, "xent_part_stats", sh,
         be->xent_part_stats(be, st.p[s], lg.p[s], tg.p[s], M, V, v_lo, ignore));
    if (ok) check_f32("xent_part_stats", sh, "stats", &st, 0, 1e-5);
    float *all = ref_alloc(4 * 6 * (size_t)M);
    MUST(BE[0]->download(BE[0], all, st.p[0], 12 * (size_t)M)); /* part 0: the CPU's */
    for (int m = 0; m < M; m++) { /* part 1: a plausible other part */
        all[3 * (M + m)] = (float)(4.0 * mt_hash_uniform(184, (uint64_t)m));
        all[3 * (M + m) + 1] = 1.0f + (float)(20.0 * mt_hash_uniform(185, (uint64_t)m));
        all[3 * (M + m) + 2] = t[m] >= v_lo && t[m] < v_lo + V ? 0.0f : 1.5f;
    }
    tb sa = tb_from(T_F32, 6 * (int64_t)M, all);
    BOTH(ok, "xent_part_finish", sh,
         be->xent_part_finish(be, loss.p[s], lg.p[s], sa.p[s], 2, tg.p[s], M, V, v_lo, ignore,
                              gscale));
    if (ok) {
        check_f32("xent_part_finish", sh, "loss", &loss, 0, 1e-5);
        check_act("xent_part_finish", sh, "grad", &lg, V, 2, 0, 1e-2);
    }
    tb_free(&tg), tb_free(&lg), tb_free(&st), tb_free(&loss), tb_free(&sa);
    free(t);
    free(all);
}

/* A main copy of n random values: f32, or bf16 bits when bf16. */
static tb main_copy_rand(int64_t n, uint64_t seed, int bf16)
{
    float *ph = rnd_f32(n, seed, 0.05f);
    tb p = tb_from_floats(ph, n, bf16);
    free(ph);
    return p;
}

/* AdamW hyper-parameters of step `step` (bias corrections for it). */
static mt_adamw_hp adamw_hp_at(int step)
{
    mt_adamw_hp hp = {3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0, 0, 0.7f, 0};
    hp.bc1 = 1.0f - powf(0.9f, (float)step);
    hp.bc2 = 1.0f - powf(0.95f, (float)step);
    return hp;
}

/* Gradients in rows of `row` elements scaled 0, 1e-14, 1e-28 and 1 in turn
 * (normal draws of sigma 1e-3): zero rows (a vocabulary row that saw no
 * token: zero moments), 1e-17 ones (v below 2^-100) and 1e-31 ones (m below
 * it, v zero) among ordinary ones, so that every path of adamw's divisions
 * (cuda_div_by's product, its zeros, its division) runs. */
static tb grad_rows_rand(int64_t n, int64_t row, uint64_t seed, int bf16)
{
    static const float row_scale[4] = {0.0f, 1e-14f, 1e-28f, 1.0f};
    float *h = rnd_f32(n, seed, 1e-3f);
    for (int64_t e = 0; e < n; e++) h[e] *= row_scale[(e / row) % 4];
    tb g = tb_from_floats(h, n, bf16);
    free(h);
    return g;
}

/* An optimizer case's gradients (f32, or bf16 when bf16): dense normal
 * values of scale 1e-3, or grad_rows_rand's rows of `row` elements when
 * row > 0. */
static tb adamw_grad_rand(int64_t n, int64_t row, uint64_t seed, int bf16)
{
    if (row > 0) return grad_rows_rand(n, row, seed, bf16);
    return bf16 ? bf16_rand(n, seed, 1e-3f) : f32_rand(n, seed, 1e-3f);
}

static void test_optimizer(void)
{
    const int64_t sizes[] = {1, 1000, 5000003};
    for (size_t i = 0; i < 3; i++) {
        const int64_t n = sizes[i];
        char sh[64];
        snprintf(sh, sizeof sh, "n=%lld", (long long)n);
        tb g = f32_rand(n, 190 + i, 1e-2f), out = tb_new(T_F32, 1);
        int ok;
        BOTH(ok, "sumsq", sh, be->sumsq(be, out.p[s], g.p[s], 0, n));
        if (ok) check_f32("sumsq", sh, "out", &out, 0, 1e-6);
        BOTH(ok, "scale_f32", sh, be->scale_f32(be, g.p[s], n, -0.37f));
        if (ok) check_exact("scale_f32", sh, "x", &g, 0);
        tb gb = bf16_rand(n, 195 + i, 1e-2f); /* bf16 gradients: the same double sums */
        char s2[80];
        snprintf(s2, sizeof s2, "%s bf16", sh);
        BOTH(ok, "sumsq", s2, be->sumsq(be, out.p[s], gb.p[s], 1, n));
        if (ok) check_f32("sumsq", s2, "out", &out, 0, 1e-6);
        if (n > 1) { /* not 16-byte aligned: the element loads */
            snprintf(s2, sizeof s2, "%s bf16 from element 1", sh);
            BOTH(ok, "sumsq", s2, be->sumsq(be, out.p[s], (const char *)gb.p[s] + 2, 1, n - 1));
            if (ok) check_f32("sumsq", s2, "out", &out, 0, 1e-6);
        }
        tb_free(&g), tb_free(&out), tb_free(&gb);
    }
    {
        tb out = tb_new(T_F32, 1);
        const float one = 1.0f;
        tb_put(&out, &one);
        int ok;
        BOTH(ok, "sumsq", "n=0", be->sumsq(be, out.p[s], NULL, 0, 0));
        if (ok) check_exact("sumsq", "n=0", "out", &out, 0);
        tb_free(&out);
    }
    /* AdamW: three steps, f32 and bf16 master, outputs fed back; from
     * element 0 (16-byte aligned: 8 elements a thread) and from element 4
     * (the moments 8-byte aligned: 4 a thread); dense gradients, and rows
     * of zero and tiny ones (grad_rows_rand) */
    const int64_t n = 300007;
    for (int pg = 0; pg < 16; pg++) {
        const int pb = pg & 1, gbf = (pg >> 1) & 1, off = pg & 4; /* bf16 master; bf16 gradients */
        const int rows = pg & 8;
        char sh[96];
        snprintf(sh, sizeof sh, "n=%lld %s master%s, 3 steps%s%s", (long long)n,
                 pb ? "bf16" : "f32", gbf ? " bf16 grads" : "", off ? ", from element 4" : "",
                 rows ? ", zero and tiny rows" : "");
        tb p = main_copy_rand(n, 200, pb);
        tb m = tb_new(T_U16, n), v = tb_new(T_U16, n), a = tb_new(T_ACT, n);
        int ok = 1;
        for (int step = 1; step <= 3 && ok; step++) {
            mt_adamw_hp hp = adamw_hp_at(step);
            hp.grad_bf16 = gbf;
            tb g = adamw_grad_rand(n, rows ? 1000 : 0, 210 + step, gbf);
            /* the weight's act copy from the last step's pass */
            BOTH(ok, "adamw", sh,
                 be->adamw(be, (char *)p.p[s] + off * (pb ? 2 : 4), pb, (uint16_t *)m.p[s] + off,
                           (uint16_t *)v.p[s] + off, (const char *)g.p[s] + off * (gbf ? 2 : 4),
                           n - off, &hp,
                           step == 3 ? (char *)a.p[s] + off * BE[s]->act_bytes : NULL));
            tb_free(&g);
        }
        if (ok) {
            check_exact("adamw", sh, "p", &p, 0);
            check_exact("adamw", sh, "m", &m, 0);
            check_exact("adamw", sh, "v", &v, 0);
            check_exact("adamw", sh, "act copy", &a, 0);
        }
        tb_free(&p), tb_free(&m), tb_free(&v), tb_free(&a);
    }
    /* adamw_sr: a weight of the act type with no main copy, updated in
     * place with stochastic rounding, 3 steps of other seeds; from element
     * 0 (8 elements a thread), 4 (4 a thread) and 1 (one a thread); f32 and
     * bf16 gradients, dense and with zero and tiny rows */
    for (int pg = 0; pg < 12; pg++) {
        const int gbf = pg & 1, rows = pg & 2, off = (int[]){0, 4, 1}[pg >> 2];
        char sh[96];
        snprintf(sh, sizeof sh, "n=%lld%s, 3 steps, from element %d%s", (long long)n,
                 gbf ? " bf16 grads" : "", off, rows ? ", zero and tiny rows" : "");
        tb w = act_rand(n, 230, 0.05f);
        tb m = tb_new(T_U16, n), v = tb_new(T_U16, n);
        int ok = 1;
        for (int step = 1; step <= 3 && ok; step++) {
            mt_adamw_hp hp = adamw_hp_at(step);
            hp.grad_bf16 = gbf;
            tb g = adamw_grad_rand(n, rows ? 1000 : 0, 235 + step, gbf);
            BOTH(ok, "adamw_sr", sh,
                 be->adamw_sr(be, (char *)w.p[s] + off * BE[s]->act_bytes,
                              (uint16_t *)m.p[s] + off, (uint16_t *)v.p[s] + off,
                              (const char *)g.p[s] + off * (gbf ? 2 : 4), n - off, &hp,
                              0x5eedull * (uint64_t)(step + 3 * pg)));
            tb_free(&g);
        }
        if (ok) {
            check_exact("adamw_sr", sh, "w", &w, 0);
            check_exact("adamw_sr", sh, "m", &m, 0);
            check_exact("adamw_sr", sh, "v", &v, 0);
        }
        tb_free(&w), tb_free(&m), tb_free(&v);
    }
    /* adamw_fp8: the fused update + re-quantisation, f32 and bf16 master, at
     * shapes with partial 128x128 blocks and with whole ones only; every
     * output bit-exact */
    {
        const int shp[][2] = {{128, 128}, {200, 300}, {7, 130}, {384, 1000}, {256, 640}};
        for (size_t i = 0; i < sizeof shp / sizeof shp[0]; i++)
            for (int pg = 0; pg < 4; pg++) {
                const int pb = pg & 1, gbf = pg >> 1; /* bf16 master; bf16 gradients */
                const int N = shp[i][0], K = shp[i][1];
                const int64_t n = (int64_t)N * K, nsc = (int64_t)mt_ceil_div(N, 128) * mt_ceil_div(K, 128);
                char sh[96];
                snprintf(sh, sizeof sh, "%dx%d %s master%s, 2 steps", N, K, pb ? "bf16" : "f32",
                         gbf ? " bf16 grads" : "");
                tb p = main_copy_rand(n, 230 + i, pb);
                tb m = tb_new(T_U16, n), v = tb_new(T_U16, n), q = tb_new(T_U8, n), qt = tb_new(T_U8, n);
                tb sc = tb_new(T_F32, nsc), st = tb_new(T_F32, nsc);
                int ok = 1;
                for (int step = 1; step <= 2 && ok; step++) {
                    mt_adamw_hp hp = adamw_hp_at(step);
                    hp.grad_bf16 = gbf;
                    tb g = adamw_grad_rand(n, 0, 240 + step, gbf);
                    BOTH(ok, "adamw_fp8", sh, be->adamw_fp8(be, p.p[s], pb, m.p[s], v.p[s], g.p[s], N, K,
                                                            &hp, q.p[s], sc.p[s], qt.p[s], st.p[s]));
                    tb_free(&g);
                }
                if (ok) {
                    check_exact("adamw_fp8", sh, "p", &p, 0);
                    check_exact("adamw_fp8", sh, "m", &m, 0);
                    check_exact("adamw_fp8", sh, "v", &v, 0);
                    check_exact("adamw_fp8", sh, "q", &q, 0);
                    check_exact("adamw_fp8", sh, "s", &sc, 0);
                    check_exact("adamw_fp8", sh, "qt", &qt, 0);
                    check_exact("adamw_fp8", sh, "st", &st, 0);
                }
                tb_free(&p), tb_free(&m), tb_free(&v), tb_free(&q), tb_free(&qt);
                tb_free(&sc), tb_free(&st);
            }
    }
    /* adamw_fp8_sr: a weight with no main copy (its e4m3 codes and block
     * scales, from quant_blocks) updated in place with stochastic rounding,
     * 3 steps of other seeds; one slab, and slabs of 128 and 256 rows (the
     * last one short); partial blocks; f32 and bf16 gradients; every
     * output bit-exact */
    {
        /* N and K multiples of 4 take the vector kernel, the others (7 x 130,
         * 384 x 130, 6 x 260) the scalar one */
        const int shp[][3] = {{128, 128, 128}, {200, 300, 200}, {7, 130, 7}, {384, 1000, 384},
                              {512, 256, 128}, {384, 130, 256}, {260, 388, 128}, {4, 8, 4},
                              {6, 260, 6}};
        for (size_t i = 0; i < sizeof shp / sizeof shp[0]; i++)
            for (int gbf = 0; gbf < 2; gbf++) {
                const int N = shp[i][0], K = shp[i][1], slab = shp[i][2];
                const int64_t n = (int64_t)N * K, nsc = (int64_t)mt_ceil_div(N, 128) * mt_ceil_div(K, 128);
                char sh[96];
                snprintf(sh, sizeof sh, "%dx%d slabs of %d%s, 3 steps", N, K, slab,
                         gbf ? " bf16 grads" : "");
                tb w = f32_rand(n, 260 + i, 0.05f);
                tb m = tb_new(T_U16, n), v = tb_new(T_U16, n), q = tb_new(T_U8, n), qt = tb_new(T_U8, n);
                tb sc = tb_new(T_F32, nsc), st = tb_new(T_F32, nsc);
                int ok;
                BOTH(ok, "quant_blocks", sh, be->quant_blocks(be, q.p[s], sc.p[s], w.p[s], N, K));
                for (int step = 1; step <= 3 && ok; step++) {
                    mt_adamw_hp hp = adamw_hp_at(step);
                    hp.grad_bf16 = gbf;
                    tb g = adamw_grad_rand(n, 0, 270 + step, gbf);
                    const uint64_t seed = 0x5eedull * (uint64_t)(step + 7 * i);
                    BOTH(ok, "adamw_fp8_sr", sh,
                         be->adamw_fp8_sr(be, q.p[s], sc.p[s], m.p[s], v.p[s], g.p[s], N, K, &hp,
                                          seed, slab, qt.p[s], st.p[s]));
                    tb_free(&g);
                }
                if (ok) {
                    check_exact("adamw_fp8_sr", sh, "m", &m, 0);
                    check_exact("adamw_fp8_sr", sh, "v", &v, 0);
                    check_exact("adamw_fp8_sr", sh, "q", &q, 0);
                    check_exact("adamw_fp8_sr", sh, "s", &sc, 0);
                    check_exact("adamw_fp8_sr", sh, "qt", &qt, 0);
                    check_exact("adamw_fp8_sr", sh, "st", &st, 0);
                }
                tb_free(&w), tb_free(&m), tb_free(&v), tb_free(&q), tb_free(&qt);
                tb_free(&sc), tb_free(&st);
            }
        tb q = tb_new(T_U8, 256 * 256), sc = tb_new(T_F32, 4), m = tb_new(T_U16, 256 * 256);
        mt_adamw_hp hp = adamw_hp_at(1);
        int ok;
        /* slabs that cut 128-row blocks are refused on both backends */
        for (int s = 0; s < 2; s++) {
            mt_backend *be = BE[s];
            ok = be->adamw_fp8_sr(be, q.p[s], sc.p[s], m.p[s], m.p[s], m.p[s], 256, 256, &hp, 1, 100,
                                  q.p[s], sc.p[s]) == MT_EINVAL;
            verdict(ok, "adamw_fp8_sr", "slabs of 100 rows", s ? "cuda" : "cpu", "refused (EINVAL)");
        }
        tb_free(&q), tb_free(&sc), tb_free(&m);
    }
    /* adamw_fp8_sr_n: seven weights with no main copy in one call (more
     * than the four expert streams they fan out over): vector- and
     * scalar-kernel shapes, one slab and slabs of 128 rows, partial blocks,
     * decays and seeds of their own, 2 steps, f32 and bf16 gradients; every
     * output bit-exact against the CPU, whose call is adamw_fp8_sr weight by
     * weight. Then a call whose fifth weight cuts 128-row blocks is refused
     * on both backends before any weight changes. */
    for (int gbf = 0; gbf < 2; gbf++) {
        enum { W = 7 };
        const int shp[W][3] = {{256, 640, 256}, {200, 300, 200}, {7, 130, 7}, {384, 1000, 128},
                               {128, 128, 128}, {384, 130, 128}, {260, 388, 128}};
        tb m[W], v[W], q[W], qt[W], sc[W], st[W];
        char sh[96];
        snprintf(sh, sizeof sh, "%d weights, slabs and decays mixed%s, 2 steps", W,
                 gbf ? ", bf16 grads" : "");
        int ok = 1;
        for (int i = 0; i < W; i++) {
            const int N = shp[i][0], K = shp[i][1];
            const int64_t n = (int64_t)N * K, nsc = (int64_t)mt_ceil_div(N, 128) * mt_ceil_div(K, 128);
            tb w = f32_rand(n, 290 + i, 0.05f);
            m[i] = tb_new(T_U16, n), v[i] = tb_new(T_U16, n), q[i] = tb_new(T_U8, n);
            qt[i] = tb_new(T_U8, n), sc[i] = tb_new(T_F32, nsc), st[i] = tb_new(T_F32, nsc);
            BOTH(ok, "quant_blocks", sh,
                 be->quant_blocks(be, q[i].p[s], sc[i].p[s], w.p[s], N, K));
            tb_free(&w);
        }
        for (int step = 1; step <= 2 && ok; step++) {
            mt_adamw_hp hp = adamw_hp_at(step);
            hp.grad_bf16 = gbf;
            tb g[W];
            for (int i = 0; i < W; i++)
                g[i] = adamw_grad_rand((int64_t)shp[i][0] * shp[i][1], i % 3 == 2 ? shp[i][1] : 0,
                                       300 + 10 * step + i, gbf);
            mt_adamw_fp8_sr_arg a[2][W];
            for (int s = 0; s < 2; s++)
                for (int i = 0; i < W; i++)
                    a[s][i] = (mt_adamw_fp8_sr_arg){
                        .q = q[i].p[s], .s = sc[i].p[s], .m = m[i].p[s], .v = v[i].p[s],
                        .grad = g[i].p[s], .N = shp[i][0], .K = shp[i][1],
                        .weight_decay = i % 3 ? 0.1f : 0.0f,
                        .seed = 0x5eedull * (uint64_t)(step + 11 * i), .slab_rows = shp[i][2],
                        .qt = qt[i].p[s], .st = st[i].p[s]};
            BOTH(ok, "adamw_fp8_sr_n", sh, be->adamw_fp8_sr_n(be, W, a[s], &hp));
            for (int i = 0; i < W; i++) tb_free(&g[i]);
        }
        for (int i = 0; i < W && ok; i++) {
            check_exact("adamw_fp8_sr_n", sh, "m", &m[i], 0);
            check_exact("adamw_fp8_sr_n", sh, "v", &v[i], 0);
            check_exact("adamw_fp8_sr_n", sh, "q", &q[i], 0);
            check_exact("adamw_fp8_sr_n", sh, "s", &sc[i], 0);
            check_exact("adamw_fp8_sr_n", sh, "qt", &qt[i], 0);
            check_exact("adamw_fp8_sr_n", sh, "st", &st[i], 0);
        }
        if (gbf == 0 && ok) { /* refused whole: weight 4 with slabs of 100 rows */
            mt_adamw_hp hp = adamw_hp_at(3);
            tb g[W];
            for (int i = 0; i < W; i++)
                g[i] = adamw_grad_rand((int64_t)shp[i][0] * shp[i][1], 0, 330 + i, 0);
            for (int s = 0; s < 2; s++) {
                mt_backend *be = BE[s];
                const size_t n0 = (size_t)shp[0][0] * shp[0][1];
                uint8_t *before = ref_alloc(n0), *after = ref_alloc(n0);
                tb_get(&q[0], s, before);
                mt_adamw_fp8_sr_arg a[W];
                for (int i = 0; i < W; i++)
                    a[i] = (mt_adamw_fp8_sr_arg){
                        .q = q[i].p[s], .s = sc[i].p[s], .m = m[i].p[s], .v = v[i].p[s],
                        .grad = g[i].p[s], .N = shp[i][0], .K = shp[i][1], .weight_decay = 0.0f,
                        .seed = 3, .slab_rows = i == 4 ? 100 : shp[i][2], .qt = qt[i].p[s],
                        .st = st[i].p[s]};
                const int refused = be->adamw_fp8_sr_n(be, W, a, &hp) == MT_EINVAL;
                MUST(be->sync(be));
                /* weight 0's codes unchanged: nothing ran before the refusal */
                tb_get(&q[0], s, after);
                const int same = memcmp(before, after, n0) == 0;
                free(before), free(after);
                verdict(refused && same, "adamw_fp8_sr_n", "weight 4 in slabs of 100 rows",
                        s ? "cuda" : "cpu", "refused (EINVAL), no weight updated");
            }
            for (int i = 0; i < W; i++) tb_free(&g[i]);
        }
        for (int i = 0; i < W; i++) {
            tb_free(&m[i]), tb_free(&v[i]), tb_free(&q[i]), tb_free(&qt[i]);
            tb_free(&sc[i]), tb_free(&st[i]);
        }
    }
    /* adamw_fp8_n: six weights in one call (more than the four expert
     * streams they fan out over), f32 and bf16 masters and decays mixed,
     * whole and partial blocks, gradients with zero and tiny rows
     * (grad_rows_rand); then 70 small weights (more than two of the CUDA
     * backend's launches of 32 weights, so blocks of a launch belong to
     * weights of every size); every output bit-exact against the CPU */
    for (int cfg = 0; cfg < 3; cfg++) {
        enum { WMAX = 70 };
        const int gbf = cfg == 1, W = cfg < 2 ? 6 : WMAX;
        const int big[6][2] = {{256, 640}, {200, 300}, {128, 128}, {7, 130}, {384, 1000}, {256, 256}};
        const int small[5][2] = {{128, 128}, {7, 130}, {256, 384}, {130, 7}, {129, 257}};
        int shp[WMAX][2];
        for (int i = 0; i < W; i++) {
            shp[i][0] = W == 6 ? big[i][0] : small[i % 5][0];
            shp[i][1] = W == 6 ? big[i][1] : small[i % 5][1];
        }
        tb p[WMAX], m[WMAX], v[WMAX], q[WMAX], qt[WMAX], sc[WMAX], st[WMAX];
        char sh[96];
        snprintf(sh, sizeof sh, "%d weights, mixed masters%s, 2 steps", W, gbf ? ", bf16 grads" : "");
        for (int i = 0; i < W; i++) {
            const int64_t n = (int64_t)shp[i][0] * shp[i][1];
            const int64_t nsc = (int64_t)mt_ceil_div(shp[i][0], 128) * mt_ceil_div(shp[i][1], 128);
            p[i] = main_copy_rand(n, 260 + i, i % 2);
            m[i] = tb_new(T_U16, n), v[i] = tb_new(T_U16, n), q[i] = tb_new(T_U8, n);
            qt[i] = tb_new(T_U8, n), sc[i] = tb_new(T_F32, nsc), st[i] = tb_new(T_F32, nsc);
        }
        int ok = 1;
        for (int step = 1; step <= 2 && ok; step++) {
            mt_adamw_hp hp = adamw_hp_at(step);
            hp.grad_bf16 = gbf;
            tb g[WMAX];
            for (int i = 0; i < W; i++) {
                const int64_t n = (int64_t)shp[i][0] * shp[i][1];
                g[i] = adamw_grad_rand(n, i % 6 >= 4 ? shp[i][1] : 0, 270 + 10 * step + i, gbf);
            }
            mt_adamw_fp8_arg a[2][WMAX];
            for (int s = 0; s < 2; s++)
                for (int i = 0; i < W; i++)
                    a[s][i] = (mt_adamw_fp8_arg){
                        .p = p[i].p[s], .p_bf16 = i % 2, .m = m[i].p[s], .v = v[i].p[s],
                        .grad = g[i].p[s], .N = shp[i][0], .K = shp[i][1],
                        .weight_decay = i % 3 ? 0.1f : 0.0f, .q = q[i].p[s], .s = sc[i].p[s],
                        .qt = qt[i].p[s], .st = st[i].p[s]};
            BOTH(ok, "adamw_fp8_n", sh, be->adamw_fp8_n(be, W, a[s], &hp));
            for (int i = 0; i < W; i++) tb_free(&g[i]);
        }
        for (int i = 0; i < W; i++) {
            if (ok) {
                check_exact("adamw_fp8_n", sh, "p", &p[i], 0);
                check_exact("adamw_fp8_n", sh, "m", &m[i], 0);
                check_exact("adamw_fp8_n", sh, "v", &v[i], 0);
                check_exact("adamw_fp8_n", sh, "q", &q[i], 0);
                check_exact("adamw_fp8_n", sh, "s", &sc[i], 0);
                check_exact("adamw_fp8_n", sh, "qt", &qt[i], 0);
                check_exact("adamw_fp8_n", sh, "st", &st[i], 0);
            }
            tb_free(&p[i]), tb_free(&m[i]), tb_free(&v[i]), tb_free(&q[i]), tb_free(&qt[i]);
            tb_free(&sc[i]), tb_free(&st[i]);
        }
    }
    /* bf16 -> f32: every code */
    {
        uint16_t *h = ref_alloc(2 * 65536);
        for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
        tb src = tb_from(T_U16, 65536, h), dst = tb_new(T_F32, 65536);
        int ok;
        BOTH(ok, "bf16_to_f32", "all 65536 codes", be->bf16_to_f32(be, dst.p[s], src.p[s], 65536));
        if (ok) check_exact("bf16_to_f32", "all 65536 codes", "dst", &dst, 256);
        tb_free(&src), tb_free(&dst);
        free(h);
    }
    /* act_from_f32_sr: values between bf16 neighbours, exact bf16 values, ties */
    {
        const int64_t n2 = 200003;
        float *h = rnd_f32(n2, 220, 5.0f);
        for (int64_t i = 0; i < n2; i += 7) h[i] = mt_bf16_round(h[i]);
        tb src = tb_from(T_F32, n2, h), dst = tb_new(T_ACT, n2);
        int ok;
        BOTH(ok, "act_from_f32_sr", "n=200003", be->act_from_f32_sr(be, dst.p[s], src.p[s], n2, 0xabcdef12345ull));
        if (ok) check_exact("act_from_f32_sr", "n=200003", "dst", &dst, 0);
        tb_free(&src), tb_free(&dst);
        free(h);
    }
}

/* ---- determinism: the same CUDA op twice on the same inputs ------------------------- */

/* Bit-compares n bytes of two CUDA buffers; `how` names the two runs. */
static void gpu_same_bytes(const char *how, const char *op, const char *shape, const char *out,
                           const void *x, const void *y, size_t bytes)
{
    mt_backend *g = BE[1];
    unsigned char *a = ref_alloc(bytes), *b = ref_alloc(bytes);
    MUST(g->download(g, a, x, bytes));
    MUST(g->download(g, b, y, bytes));
    size_t nd = 0, first = 0;
    for (size_t i = 0; i < bytes; i++)
        if (a[i] != b[i] && nd++ == 0) first = i;
    char msg[160];
    snprintf(msg, sizeof msg, "%s: %zu of %zu bytes differ", how, nd, bytes);
    if (nd) snprintf(msg + strlen(msg), sizeof msg - strlen(msg), " (first at byte %zu)", first);
    verdict(nd == 0, op, shape, out, msg);
    free(a), free(b);
}

static void det_check(const char *op, const char *shape, const char *out, const void *x,
                      const void *y, size_t bytes)
{
    gpu_same_bytes("run twice", op, shape, out, x, y, bytes);
}

#define GPU_OK(stmt)                                                                       \
    do {                                                                                   \
        int g_rc_ = (stmt);                                                                \
        if (g_rc_ == MT_OK) g_rc_ = BE[1]->sync(BE[1]);                                    \
        if (g_rc_ != MT_OK) {                                                              \
            printf("FAIL  %-18s %s -> %s: %s\n", "determinism", #stmt, mt_strstatus(g_rc_), \
                   mt_errmsg());                                                           \
            n_fail++;                                                                      \
            return;                                                                        \
        }                                                                                  \
    } while (0)

static void test_determinism(void)
{
    mt_backend *g = BE[1];
    /* rmsnorm_bwd dw (chunked partial sums) */
    {
        const int M = 4096, D = 1024;
        tb x = act_rand((int64_t)M * D, 300, 1.0f), w = act_rand(D, 301, 1.0f), dy = act_rand((int64_t)M * D, 302, 1.0f);
        tb rs = f32_rand(M, 303, 1.0f), dx = tb_new(T_ACT, (int64_t)M * D);
        tb dw1 = tb_new(T_F32, D), dw2 = tb_new(T_F32, D);
        GPU_OK(g->rmsnorm_bwd(g, dx.p[1], D, 0, dw1.p[1], MT_C_F32, dy.p[1], D, x.p[1], D, w.p[1], rs.p[1], M, D));
        GPU_OK(g->rmsnorm_bwd(g, dx.p[1], D, 0, dw2.p[1], MT_C_F32, dy.p[1], D, x.p[1], D, w.p[1], rs.p[1], M, D));
        det_check("rmsnorm_bwd", "M4096 D1024", "dw", dw1.p[1], dw2.p[1], 4 * (size_t)D);
        tb_free(&x), tb_free(&w), tb_free(&dy), tb_free(&rs), tb_free(&dx), tb_free(&dw1), tb_free(&dw2);
    }
    /* embedding_bwd with many repeated ids */
    {
        const int V = 1000, D = 256, M = 8192;
        int32_t *ids = ref_alloc(4 * (size_t)M);
        ref_fill_ids(ids, M, 310, 37);
        tb id = tb_from(T_I32, M, ids), dy = act_rand((int64_t)M * D, 311, 1.0f);
        tb t1 = tb_new(T_F32, (int64_t)V * D), t2 = tb_new(T_F32, (int64_t)V * D);
        GPU_OK(g->embedding_bwd(g, t1.p[1], MT_C_F32, dy.p[1], id.p[1], M, D));
        GPU_OK(g->embedding_bwd(g, t2.p[1], MT_C_F32, dy.p[1], id.p[1], M, D));
        det_check("embedding_bwd", "V1000 D256 M8192 (37 ids)", "dtable", t1.p[1], t2.p[1], 4 * (size_t)V * D);
        tb_free(&id), tb_free(&dy), tb_free(&t1), tb_free(&t2);
        free(ids);
    }
    /* sumsq over many partials */
    {
        const int64_t n = 40000001;
        tb x = f32_rand(n, 320, 1.0f), o1 = tb_new(T_F32, 1), o2 = tb_new(T_F32, 1);
        GPU_OK(g->sumsq(g, o1.p[1], x.p[1], 0, n));
        GPU_OK(g->sumsq(g, o2.p[1], x.p[1], 0, n));
        det_check("sumsq", "n=40000001", "out", o1.p[1], o2.p[1], 4);
        tb_free(&x), tb_free(&o1), tb_free(&o2);
    }
    /* aux_loss (integer-atomic counts, chunked P sums) */
    {
        const int B = 2, T = 2048, E = 256, K = 8, N = B * T;
        mt_router_cfg c = rcfg(E, K, 8, 4, MT_SCORE_SIGMOID, 1, 1, 2.5f);
        tb lg = f32_rand((int64_t)N * E, 330, 2.0f), idx = tb_new(T_I32, (int64_t)N * K);
        tb w = tb_new(T_F32, (int64_t)N * K), sc = tb_new(T_F32, (int64_t)N * E);
        GPU_OK(g->router_fwd(g, idx.p[1], w.p[1], sc.p[1], lg.p[1], NULL, N, &c));
        tb l1 = tb_new(T_F32, 1), l2 = tb_new(T_F32, 1);
        tb d1 = tb_new(T_F32, (int64_t)N * E), d2 = tb_new(T_F32, (int64_t)N * E);
        GPU_OK(g->aux_loss(g, l1.p[1], d1.p[1], sc.p[1], idx.p[1], B, T, 1e-3f, 1.0f, &c));
        GPU_OK(g->aux_loss(g, l2.p[1], d2.p[1], sc.p[1], idx.p[1], B, T, 1e-3f, 1.0f, &c));
        det_check("aux_loss", "B2 T2048 E256 K8", "loss", l1.p[1], l2.p[1], 4);
        det_check("aux_loss", "B2 T2048 E256 K8", "dscore", d1.p[1], d2.p[1], 4 * (size_t)N * E);
        /* moe_index (radix sort, integer atomics) */
        const int align = 128, R_cap = N * K + E * (align - 1);
        tb sl1 = tb_new(T_I32, (int64_t)N * K), sl2 = tb_new(T_I32, (int64_t)N * K);
        tb sr1 = tb_new(T_I32, R_cap), sr2 = tb_new(T_I32, R_cap), cn = tb_new(T_I32, E);
        int *rows = ref_alloc(4 * (size_t)E);
        GPU_OK(g->moe_index(g, sl1.p[1], sr1.p[1], cn.p[1], rows, idx.p[1], N, K, E, align, R_cap));
        GPU_OK(g->moe_index(g, sl2.p[1], sr2.p[1], cn.p[1], rows, idx.p[1], N, K, E, align, R_cap));
        det_check("moe_index", "N4096 K8 E256 align128", "slot", sl1.p[1], sl2.p[1], 4 * (size_t)N * K);
        det_check("moe_index", "N4096 K8 E256 align128", "src", sr1.p[1], sr2.p[1], 4 * (size_t)R_cap);
        tb_free(&lg), tb_free(&idx), tb_free(&w), tb_free(&sc), tb_free(&l1), tb_free(&l2);
        tb_free(&d1), tb_free(&d2), tb_free(&sl1), tb_free(&sl2), tb_free(&sr1), tb_free(&sr2), tb_free(&cn);
        free(rows);
    }
    /* weight-gradient GEMMs (f32 out) and the attention backward */
    {
        const int rows[] = {1000, 0, 3000}, G = 3, N = 256, K = 384, M = 4000;
        tb A = act_rand((int64_t)M * N, 340, 1.0f), Bm = act_rand((int64_t)M * K, 341, 1.0f);
        tb C1 = tb_new(T_F32, (int64_t)G * N * K), C2 = tb_new(T_F32, (int64_t)G * N * K);
        GPU_OK(g->gemm_grouped(g, 1, C1.p[1], 1, K, (int64_t)N * K, A.p[1], N, 0, Bm.p[1], K, 0, 0, rows, G, N, K, 1.0f, 0));
        GPU_OK(g->gemm_grouped(g, 1, C2.p[1], 1, K, (int64_t)N * K, A.p[1], N, 0, Bm.p[1], K, 0, 0, rows, G, N, K, 1.0f, 0));
        det_check("gemm_grouped", "red1 rows{1000,0,3000} N256 K384 f32", "C", C1.p[1], C2.p[1], 4 * (size_t)G * N * K);
        tb_free(&A), tb_free(&Bm), tb_free(&C1), tb_free(&C2);
    }
    const char *modes[] = {"own", "auto"};
    for (int m = 0; m < 2; m++) {
        const int B = 2, T = 512, H = 4, Dqk = 192, Dv = 128, N = B * T;
        if (!strcmp(modes[m], "own")) setenv("MOETRAIN_ATTN", "own", 1); else unsetenv("MOETRAIN_ATTN");
        tb q = act_rand((int64_t)N * H * Dqk, 350, 1.0f), k = act_rand((int64_t)N * H * Dqk, 351, 1.0f);
        tb v = act_rand((int64_t)N * H * Dv, 352, 1.0f), o = tb_new(T_ACT, (int64_t)N * H * Dv);
        tb lse = tb_new(T_F32, (int64_t)B * H * T), dout = act_rand((int64_t)N * H * Dv, 353, 1.0f);
        tb dq[2] = {tb_new(T_ACT, (int64_t)N * H * Dqk), tb_new(T_ACT, (int64_t)N * H * Dqk)};
        tb dk[2] = {tb_new(T_ACT, (int64_t)N * H * Dqk), tb_new(T_ACT, (int64_t)N * H * Dqk)};
        tb dv[2] = {tb_new(T_ACT, (int64_t)N * H * Dv), tb_new(T_ACT, (int64_t)N * H * Dv)};
        const float scale = 1.0f / sqrtf((float)Dqk);
        GPU_OK(g->attn_fwd(g, o.p[1], lse.p[1], q.p[1], k.p[1], v.p[1], B, T, H, Dqk, Dv, scale));
        for (int r = 0; r < 2; r++)
            GPU_OK(g->attn_bwd(g, dq[r].p[1], dk[r].p[1], dv[r].p[1], dout.p[1], q.p[1], k.p[1], v.p[1], o.p[1], lse.p[1], B, T, H, Dqk, Dv, scale));
        char sh[96];
        snprintf(sh, sizeof sh, "B2 T512 H4 Dqk192 Dv128 [%s: %s]", modes[m], cuda_attn_last_path(g));
        det_check("attn_bwd", sh, "dq", dq[0].p[1], dq[1].p[1], 2 * (size_t)N * H * Dqk);
        det_check("attn_bwd", sh, "dk", dk[0].p[1], dk[1].p[1], 2 * (size_t)N * H * Dqk);
        det_check("attn_bwd", sh, "dv", dv[0].p[1], dv[1].p[1], 2 * (size_t)N * H * Dv);
        tb_free(&q), tb_free(&k), tb_free(&v), tb_free(&o), tb_free(&lse), tb_free(&dout);
        for (int r = 0; r < 2; r++) tb_free(&dq[r]), tb_free(&dk[r]), tb_free(&dv[r]);
    }
    unsetenv("MOETRAIN_ATTN");
}

/* ---- vector paths against the element kernels (cuda only) -------------------------------
 * rmsnorm and rope have 16-byte kernels for aligned rows / head slices and
 * element kernels for the rest. The same op on the same values, once at an
 * aligned address and once one element (2 bytes) past it, runs one and the
 * other. Property: both give the same bytes - the vector kernels keep every
 * operation and its order (sums included), so the GPU results did not move. */

/* n act values h on the GPU, `shift` elements into a fresh allocation (*base
 * to free). */
static void *gpu_act_at(void **base, int shift, const float *h, int64_t n)
{
    mt_backend *g = BE[1];
    float *tmp;
    MUST(g->alloc(g, 2 * (size_t)(n + 8), base));
    MUST(g->alloc(g, 4 * (size_t)n, (void **)&tmp));
    MUST(g->upload(g, tmp, h, 4 * (size_t)n));
    void *p = (char *)*base + 2 * (size_t)shift;
    MUST(g->act_from_f32(g, p, tmp, n));
    MUST(g->sync(g));
    g->free(g, tmp);
    return p;
}

static void *gpu_f32(const float *h, int64_t n)
{
    mt_backend *g = BE[1];
    void *p;
    MUST(g->alloc(g, 4 * (size_t)n, &p));
    MUST(g->upload(g, p, h, 4 * (size_t)n));
    return p;
}

static void same_bytes(const char *op, const char *shape, const char *out, const void *x,
                       const void *y, size_t bytes)
{
    gpu_same_bytes("16-byte vs element kernels", op, shape, out, x, y, bytes);
}

#define VEC_OK(stmt)                                                                       \
    do {                                                                                   \
        int v_rc_ = (stmt);                                                                \
        if (v_rc_ == MT_OK) v_rc_ = BE[1]->sync(BE[1]);                                    \
        if (v_rc_ != MT_OK) {                                                              \
            printf("FAIL  %-18s %s -> %s: %s\n", "vector paths", #stmt, mt_strstatus(v_rc_), \
                   mt_errmsg());                                                           \
            n_fail++;                                                                      \
            ok = 0;                                                                        \
        }                                                                                  \
    } while (0)

/* rmsnorm_fwd, then rmsnorm_bwd with dx accumulated and with dx stored, on
 * [M, D] rows of leading dimension ld: y, rstd, dx (both) and dw (both)
 * compared, padding included. alias: dx is dy (both backward calls write
 * into dy; the aligned side then runs the separate dx and dw kernels, as
 * the fused one needs dx apart from dy and x). */
static void vec_rmsnorm(int M, int D, int ld, int alias, const char *prop)
{
    mt_backend *g = BE[1];
    char sh[96];
    snprintf(sh, sizeof sh, "M%d D%d ld%d %s", M, D, ld, prop);
    const int64_t n = (int64_t)M * ld;
    float *xh = rnd_act(n, 400, 2.0f), *wh = rnd_act(D, 401, 0.3f), *dyh = rnd_act(n, 402, 1.0f);
    float *dxh = rnd_act(n, 403, 1.0f), *dwh = rnd_f32(D, 404, 1.0f);
    for (int k = 0; k < D; k++) wh[k] = mt_bf16_round(1.0f + wh[k]);
    enum { X, W, Y, DY, DX, DXZ, NB };
    void *base[2][NB], *p[2][NB], *rstd[2], *dw[2], *dwz[2];
    const float *src[NB] = {xh, wh, dxh, dyh, dxh, dxh};
    int ok = 1;
    for (int v = 0; v < 2; v++) { /* v = 0 aligned, 1 one element off */
        for (int i = 0; i < NB; i++) p[v][i] = gpu_act_at(&base[v][i], v, src[i], i == W ? D : n);
        MUST(g->alloc(g, 4 * (size_t)M, &rstd[v]));
        dw[v] = gpu_f32(dwh, D);
        dwz[v] = gpu_f32(dwh, D);
        VEC_OK(g->rmsnorm_fwd(g, p[v][Y], ld, rstd[v], p[v][X], ld, p[v][W], M, D, 1e-6f));
        VEC_OK(g->rmsnorm_bwd(g, p[v][alias ? DY : DX], ld, 1, dw[v], MT_C_F32, p[v][DY], ld,
                              p[v][X], ld, p[v][W], rstd[v], M, D));
        VEC_OK(g->rmsnorm_bwd(g, p[v][alias ? DY : DXZ], ld, 0, dwz[v], MT_C_F32, p[v][DY], ld,
                              p[v][X], ld, p[v][W], rstd[v], M, D));
    }
    if (ok) {
        same_bytes("rmsnorm_fwd", sh, "y", p[0][Y], p[1][Y], 2 * (size_t)n);
        same_bytes("rmsnorm_fwd", sh, "rstd", rstd[0], rstd[1], 4 * (size_t)M);
        if (alias) {
            same_bytes("rmsnorm_bwd", sh, "dx(=dy)", p[0][DY], p[1][DY], 2 * (size_t)n);
        } else {
            same_bytes("rmsnorm_bwd", sh, "dx+=", p[0][DX], p[1][DX], 2 * (size_t)n);
            same_bytes("rmsnorm_bwd", sh, "dx=", p[0][DXZ], p[1][DXZ], 2 * (size_t)n);
        }
        same_bytes("rmsnorm_bwd", sh, "dw", dw[0], dw[1], 4 * (size_t)D);
        same_bytes("rmsnorm_bwd", sh, "dw(2)", dwz[0], dwz[1], 4 * (size_t)D);
    }
    for (int v = 0; v < 2; v++) {
        for (int i = 0; i < NB; i++) g->free(g, base[v][i]);
        g->free(g, rstd[v]), g->free(g, dw[v]), g->free(g, dwz[v]);
    }
    free(xh), free(wh), free(dyh), free(dxh), free(dwh);
}

/* rope, all four (interleave, inverse), on N = B T tokens of rows ld = H hs
 * + extra: the whole buffer compared (the untouched parts too). */
static void vec_rope(int B, int T, int H, int hs, int off, int R, int extra, const char *prop)
{
    mt_backend *g = BE[1];
    const int N = B * T, ld = H * hs + extra, half = R / 2;
    const int64_t n = (int64_t)N * ld;
    float *ct = ref_floats((int64_t)T * half), *st = ref_floats((int64_t)T * half);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double ang = t / pow(10000.0, 2.0 * i / R);
            ct[t * half + i] = (float)(1.1 * cos(ang));
            st[t * half + i] = (float)(1.1 * sin(ang));
        }
    void *c = gpu_f32(ct, (int64_t)T * half), *s = gpu_f32(st, (int64_t)T * half);
    float *xh = rnd_act(n, 410, 1.0f);
    for (int il = 0; il < 2; il++)
        for (int inv = 0; inv < 2; inv++) {
            char sh[112];
            snprintf(sh, sizeof sh, "B%d T%d H%d ld%d hs%d off%d R%d il%d inv%d %s", B, T, H, ld, hs,
                     off, R, il, inv, prop);
            void *base[2], *x[2];
            int ok = 1;
            for (int v = 0; v < 2; v++) {
                x[v] = gpu_act_at(&base[v], v, xh, n);
                if (ok) VEC_OK(g->rope(g, x[v], N, T, H, ld, hs, off, R, c, s, il, inv));
            }
            if (ok) same_bytes("rope", sh, "x", x[0], x[1], 2 * (size_t)n);
            g->free(g, base[0]), g->free(g, base[1]);
        }
    g->free(g, c), g->free(g, s);
    free(ct), free(st), free(xh);
}

static void test_vector_paths(void)
{
    /* dx apart from dy and x: the fused backward kernel */
    vec_rmsnorm(64, 7168, 7168, 0, "DSV3 hidden");
    vec_rmsnorm(300, 512, 576, 0, "kv_a ld576, 12-row last chunk");
    vec_rmsnorm(2100, 520, 520, 0, "33-row chunks, D/8 odd");
    vec_rmsnorm(4096, 64, 64, 0, "64 chunks of 64 rows");
    vec_rmsnorm(37, 100, 104, 0, "D%8=4 tail");
    vec_rmsnorm(5, 7, 8, 0, "D<8: tail only");
    vec_rmsnorm(3, 12288, 12288, 0, "bwd rows past shared memory");
    /* dx is dy: the separate 16-byte dx and dw kernels */
    vec_rmsnorm(300, 512, 576, 1, "dx=dy, kv_a ld576");
    vec_rmsnorm(2100, 520, 520, 1, "dx=dy, 33-row chunks");
    vec_rmsnorm(37, 100, 104, 1, "dx=dy, D%8=4 tail");
    vec_rope(1, 128, 4, 192, 128, 64, 0, "DSV3 q heads");
    vec_rope(2, 37, 1, 576, 512, 64, 0, "kv_a rope key");
    vec_rope(2, 37, 3, 12, 4, 8, 0, "8-byte aligned");
    vec_rope(1, 16, 40, 64, 0, 64, 8, "320 slots, padded rows");
}

/* ---- main ----------------------------------------------------------------------------------- */

#define SECTION(name, call)                                                           \
    do {                                                                              \
        double t0_ = mt_now_s();                                                      \
        printf("---- %s\n", (name));                                                  \
        call;                                                                         \
        printf("---- %s: %.1f s\n", (name), mt_now_s() - t0_);                        \
        fflush(stdout);                                                               \
    } while (0)

/* BE[1] = a CUDA backend created with var=value in the environment (GPU
 * results labelled `label`); 0 with a failure counted if it cannot be. */
static int second_backend(const char *var, const char *value, const char *label)
{
    setenv(var, value, 1);
    int rc = mt_backend_cuda_create(&BE[1], 0, (size_t)4 << 30);
    unsetenv(var);
    if (rc != MT_OK) {
        printf("FAIL  %-18s %-46s creating a backend with %s=%s: %s: %s\n", "backend", "-", var,
               value, mt_strstatus(rc), mt_errmsg());
        n_fail++;
        return 0;
    }
    gpu_label = label;
    return 1;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (mt_cuda_device_count() == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    MUST(mt_backend_cpu_create(&BE[0], 0));
    BE[0]->round_bf16 = 1;
    MUST(mt_backend_cuda_create(&BE[1], 0, (size_t)16 << 30));
    double t0 = mt_now_s();
    SECTION("memory and element-wise", test_memory_and_elementwise());
    SECTION("marks", test_marks());
    SECTION("gemm", test_gemm());
    SECTION("gemm_grouped", test_gemm_grouped());
    SECTION("fp8 quantisation", test_fp8_quant());
    SECTION("gemm_fp8", test_gemm_fp8());
    SECTION("rmsnorm", test_rmsnorm_shapes());
    SECTION("swiglu", (test_swiglu(33, 200), test_swiglu(1000, 1024), test_swiglu(7, 13)));
    SECTION("embedding", (test_embedding(50, 64, 300), test_embedding(1000, 100, 77),
                          test_embedding(129280, 64, 512)));
    SECTION("attention", test_attention());
    SECTION("moe", test_moe());
    /* 600 rows of 2056 (the 16-byte path with float arithmetic), an
     * ignored row in the middle */
    SECTION("xent", (test_xent(5, 129280, 1.0f), test_xent(64, 1000, 0.5f), test_xent(3, 1, 1.0f),
                     test_xent(600, 2056, 0.25f)));
    SECTION("xent_part", (test_xent_part(5, 64640, 64640, 1.0f), test_xent_part(64, 500, 0, 0.5f),
                          test_xent_part(3, 1, 2, 1.0f)));
    SECTION("optimizer", test_optimizer());
    SECTION("determinism (cuda, the same op twice)", test_determinism());
    SECTION("vector paths (cuda, bit-identical to the element kernels)", test_vector_paths());

    /* The GEMMs again on cuBLASLt's fallback kernels, and the FP8 GEMMs on
     * the grouped kernel (cuda_fp8_grouped.cu) wherever it fits: both
     * settings are read when a backend is created. */
    mt_backend *main_gpu = BE[1];
    if (second_backend("MOETRAIN_GEMM", "fallback", "cuda-fallback")) {
        SECTION("gemm (MOETRAIN_GEMM=fallback)", test_gemm());
        SECTION("gemm_grouped (fallback)", test_gemm_grouped());
        SECTION("gemm_fp8 (fallback)", test_gemm_fp8());
        BE[1]->destroy(BE[1]);
    }
    if (second_backend("MOETRAIN_FP8_GEMM", "own", "cuda-own")) {
        SECTION("gemm_fp8 (MOETRAIN_FP8_GEMM=own)", test_gemm_fp8());
        BE[1]->destroy(BE[1]);
    }
    BE[1] = main_gpu;
    gpu_label = "cuda";
    printf("==== test_ops_cuda: %d passed, %d failed (%.1f s)\n", n_pass, n_fail, mt_now_s() - t0);
    BE[1]->destroy(BE[1]);
    BE[0]->destroy(BE[0]);
    return n_fail ? 1 : 0;
}
