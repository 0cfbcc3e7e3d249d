/* test_ops_fp8.c - number formats and GEMM numerics of the CPU backend:
 * e4m3 and bf16 scalar rules, 1x128 / 128x1 / 128x128 quantisation and its
 * scale layouts, the exact block transpose, the FP8 GEMM (against a
 * bit-exact emulation of its definition and against an fp64 reference), and
 * the float GEMM against fp64 (fp32 and bf16-rounded outputs).
 *
 * Tolerances: an fp32 sum of K terms is within K * 2^-24 * sum |terms| of the
 * exact sum (ref_f32_sum_slack); a bf16-rounded output adds one bf16 ulp of
 * |ref| (rounding to nearest is half an ulp; the other half covers the fp32
 * result sitting near a rounding boundary).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <float.h>

#include "op_ref.h"

static mt_backend *be;

static int setup(void **state)
{
    (void)state;
    return mt_backend_cpu_create(&be, 2) == MT_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    be->destroy(be);
    return 0;
}

/* ---- scalar formats ----------------------------------------------------------- */

static int is_nan_code(int q) { return (q & 0x7f) == 0x7f; }

static void test_e4m3_round_trip_all_finite_codes(void **state)
{
    (void)state;
    int finite = 0;
    uint8_t codes[256];
    float s[2] = {1.0f, 1.0f}, w[256]; /* 1 x 2 blocks */
    for (int q = 0; q < 256; q++) codes[q] = (uint8_t)q;
    REF_OK(be->dequant_blocks(be, w, codes, s, 1, 256)); /* the backend's decoder */
    for (int q = 0; q < 256; q++) {
        float v = mt_e4m3_to_f32((uint8_t)q);
        if (is_nan_code(q)) {
            assert_true(isnan(v) && isnan(w[q]));
            continue;
        }
        finite++;
        assert_int_equal(mt_e4m3_from_f32(v), q);
        assert_true(w[q] == v);
    }
    assert_int_equal(finite, 254);
    assert_true(mt_e4m3_to_f32(0x7e) == 448.0f);
    assert_true(mt_e4m3_to_f32(0x01) == 0x1p-9f);
    assert_true(mt_e4m3_to_f32(0x08) == 0x1p-6f);
}

/* Midpoints of adjacent codes go to the even code; a hair off goes to the
 * nearer one. Both signs. */
static void test_e4m3_rounds_ties_to_even(void **state)
{
    (void)state;
    for (int q = 0; q < 0x7e; q++) {
        float lo = mt_e4m3_to_f32((uint8_t)q), hi = mt_e4m3_to_f32((uint8_t)(q + 1));
        float mid = (lo + hi) / 2; /* exact: few significant bits */
        int even = (q % 2 == 0) ? q : q + 1;
        for (int sg = 0; sg < 2; sg++) {
            float f = sg ? -1.0f : 1.0f;
            int sb = sg ? 0x80 : 0;
            assert_int_equal(mt_e4m3_from_f32(f * mid), even | sb);
            assert_int_equal(mt_e4m3_from_f32(f * nextafterf(mid, 0.0f)), q | sb);
            assert_int_equal(mt_e4m3_from_f32(f * nextafterf(mid, INFINITY)), (q + 1) | sb);
        }
    }
}

static void test_e4m3_saturates_finite_values(void **state)
{
    (void)state;
    const float big[] = {448.0f, 448.5f, 463.9f, 464.0f, 480.0f, 1e6f, FLT_MAX};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        assert_int_equal(mt_e4m3_from_f32(big[i]), 0x7e);
        assert_int_equal(mt_e4m3_from_f32(-big[i]), 0xfe);
    }
}

/* "anything beyond +-448 becomes +-448" (mt_fp8.h) includes infinities, as
 * the hardware's saturating conversion does. */
static void test_e4m3_saturates_infinity(void **state)
{
    (void)state;
    volatile float inf = INFINITY; /* opaque: the encoder is checked as run, not as folded */
    assert_int_equal(mt_e4m3_from_f32(inf), 0x7e);
    assert_int_equal(mt_e4m3_from_f32(-inf), 0xfe);
}

static void test_e4m3_nan_encodes_as_nan(void **state)
{
    (void)state;
    assert_int_equal(mt_e4m3_from_f32(NAN), 0x7f);
    assert_int_equal(mt_e4m3_from_f32(-NAN), 0xff);
    assert_true(isnan(mt_e4m3_to_f32(0x7f)) && isnan(mt_e4m3_to_f32(0xff)));
}

static void test_bf16_rounds_ties_to_even(void **state)
{
    (void)state;
    /* bf16 has 7 fraction bits: neighbours of 1 are 1 and 1 + 2^-7 */
    assert_true(mt_bf16_round(1.0f + 0x1p-8f) == 1.0f);                /* tie, even down */
    assert_true(mt_bf16_round(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);  /* tie, even up */
    assert_true(mt_bf16_round(nextafterf(1.0f + 0x1p-8f, 2.0f)) == 1.0f + 0x1p-7f);
    assert_true(mt_bf16_round(nextafterf(1.0f + 0x1p-8f, 0.0f)) == 1.0f);
    assert_true(mt_bf16_round(-(1.0f + 3 * 0x1p-8f)) == -(1.0f + 0x1p-6f));
    assert_true(mt_bf16_round(0x1p-130f + 0x1p-138f) == 0x1p-130f);    /* subnormal tie */
    assert_true(isinf(mt_bf16_round(FLT_MAX)));                        /* overflows as IEEE */
    assert_true(isnan(mt_bf16_round(NAN)));
    for (int i = 0; i < 1000; i++) {
        float x = (float)mt_hash_normal(7, (uint64_t)i) * 100.0f;
        float r = mt_bf16_round(x);
        assert_int_equal(mt_f32_bits(r) & 0xffffu, 0);
        assert_true(fabsf(r - x) <= (float)ref_bf16_ulp(x) / 2);
    }
}

/* ---- quantisation ------------------------------------------------------------------- */

/* Half an e4m3 ulp at |y| (y = x / s, |y| <= 448). */
static double e4m3_half_ulp(double y)
{
    y = fabs(y);
    if (y < 0x1p-6) return 0x1p-10; /* subnormal spacing 2^-9 */
    int e;
    frexp(y, &e); /* y in [2^(e-1), 2^e): spacing 2^(e-1-3) */
    return ldexp(1.0, e - 5);
}

/* Tiles of varied magnitude: x = N(0, 1) * 2^(tile-dependent exponent),
 * with the element range [zero0, zero1) set to 0 (an all-zero tile). */
static void fill_tiles(float *x, int64_t n, uint64_t seed, int64_t zero0, int64_t zero1)
{
    ref_fill_normal(x, n, seed, 1.0f);
    for (int64_t i = 0; i < n; i++) {
        int ex = (int)(mt_hash_u64(seed + 1, (uint64_t)(i / 97)) % 13) - 6;
        x[i] = ldexpf(x[i], ex);
        if (i >= zero0 && i < zero1) x[i] = 0.0f;
    }
}

/* Checks one tile: its scale is mt_fp8_scale(amax), every code is
 * e4m3(x / s), and |q s - x| <= half an ulp at the scale (plus 2^-20 |x| for
 * the division's rounding). Values at x[i * xs], codes at q[i * qs]. */
static void check_tile(const float *x, int64_t xs, const uint8_t *q, int64_t qs, int n, float s)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i * xs]));
    assert_true(s == mt_fp8_scale(amax));
    for (int i = 0; i < n; i++) {
        float xv = x[i * xs];
        uint8_t c = q[i * qs];
        assert_int_equal(c, mt_e4m3_from_f32(xv / s));
        double err = fabs((double)mt_e4m3_to_f32(c) * s - xv);
        assert_true(err <= e4m3_half_ulp(xv / s) * s + 0x1p-20 * fabs(xv));
    }
}

/* The quantisers encode exactly as mt_e4m3_from_f32: every 509th float of
 * magnitude <= 448 (both signs), every midpoint between adjacent codes and
 * its two float neighbours, and NaN, quantised at scale 1 (each tile holds a
 * 448), come out as the scalar rule's codes. */
static void test_quant_encoder_matches_scalar_rule(void **state)
{
    (void)state;
    const uint32_t top = 0x43e00000u; /* 448 */
    int64_t n = 2 * (top / 509 + 1) + 3 * 2 * 0x7e + 2, per = 127;
    int64_t M = (n + per - 1) / per;
    float *x = ref_floats(M * 128), *s = ref_floats(M);
    uint8_t *q = ref_alloc(M * 128);
    int64_t j = 0;
    for (uint32_t u = 0; u <= top; u += 509) {
        x[j++] = mt_bits_f32(u);
        x[j++] = -mt_bits_f32(u);
    }
    for (int c = 0; c < 0x7e; c++) {
        float mid = (mt_e4m3_to_f32((uint8_t)c) + mt_e4m3_to_f32((uint8_t)(c + 1))) / 2;
        const float v[3] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
        for (int i = 0; i < 3; i++) x[j++] = v[i], x[j++] = -v[i];
    }
    x[j++] = NAN;
    x[j++] = -NAN;
    /* spread the values over rows of 127, column 0 of each row is 448 */
    float *tiles = ref_floats(M * 128);
    for (int64_t m = 0; m < M; m++) {
        tiles[m * 128] = 448.0f;
        for (int i = 0; i < per; i++)
            tiles[m * 128 + 1 + i] = m * per + i < j ? x[m * per + i] : 0.0f;
    }
    int rows[] = {(int)M};
    REF_OK(be->quant_rows(be, q, s, tiles, 128, rows, 1, 128));
    for (int64_t i = 0; i < M * 128; i++) {
        uint8_t want = mt_e4m3_from_f32(tiles[i]);
        if (q[i] != want) fail_msg("quant_rows: %a -> %02x, rule %02x", tiles[i], q[i], want);
    }
    for (int64_t m = 0; m < M; m++) assert_true(s[m] == 1.0f);
    REF_OK(be->quant_blocks(be, q, s, tiles, (int)M, 128));
    for (int64_t i = 0; i < M * 128; i++) assert_int_equal(q[i], mt_e4m3_from_f32(tiles[i]));
    free(x), free(s), free(q), free(tiles);
}

/* Segments {3, 0, 4} of x [7, 300] (ldx 305): tiles 128, 128, 44; scales of
 * segment g at s + KB r_g as [KB, rows[g]]. */
static void test_quant_rows_error_within_half_ulp(void **state)
{
    (void)state;
    static const int rows[] = {3, 0, 4};
    const int G = 3, M = 7, K = 300, ldx = 305, KB = 3;
    float *x = ref_floats(M * ldx), *s = ref_floats(KB * M);
    uint8_t *q = ref_alloc(M * K);
    fill_tiles(x, M * ldx, 201, 4 * ldx + 128, 4 * ldx + 256); /* row 4, tile 1 zero */
    REF_OK(be->quant_rows(be, q, s, x, ldx, rows, G, K));
    int r = 0;
    for (int g = 0; g < G; r += rows[g], g++)
        for (int i = 0; i < rows[g]; i++)
            for (int kb = 0; kb < KB; kb++) {
                int k0 = kb * 128, n = K - k0 < 128 ? K - k0 : 128;
                float sc = s[KB * r + kb * rows[g] + i];
                check_tile(x + (r + i) * ldx + k0, 1, q + (r + i) * K + k0, 1, n, sc);
            }
    assert_true(s[KB * 3 + 1 * 4 + 1] == 1.0f); /* the zero tile */
    free(x), free(s), free(q);
}

/* Segments {130, 0, 5, 129} of x [264, 20] (ldx 23): segment g becomes
 * q_g [20, rows[g]] at q + 20 r_g with scales [ceil(rows[g]/128), 20] at
 * s + 20 * (tiles before g); row tiles 128 + 2, 5, 128 + 1. */
static void test_quant_cols_t_error_within_half_ulp(void **state)
{
    (void)state;
    static const int rows[] = {130, 0, 5, 129};
    const int G = 4, M = 264, K = 20, ldx = 23;
    float *x = ref_floats(M * ldx), *s = ref_floats(5 * K);
    uint8_t *q = ref_alloc(M * K);
    fill_tiles(x, M * ldx, 202, 0, 0);
    for (int i = 130; i < 135; i++) x[i * ldx + 7] = 0.0f; /* segment 2, column 7: zero tile */
    REF_OK(be->quant_cols_t(be, q, s, x, ldx, rows, G, K));
    int r = 0, tiles = 0;
    for (int g = 0; g < G; r += rows[g], tiles += mt_ceil_div(rows[g], 128), g++)
        for (int ib = 0; ib < mt_ceil_div(rows[g], 128); ib++) {
            int i0 = ib * 128, n = rows[g] - i0 < 128 ? rows[g] - i0 : 128;
            for (int k = 0; k < K; k++) {
                float sc = s[K * tiles + ib * K + k];
                check_tile(x + (r + i0) * ldx + k, ldx, q + K * r + k * rows[g] + i0, 1, n, sc);
            }
        }
    assert_true(s[K * 2 + 7] == 1.0f);
    free(x), free(s), free(q);
}

/* w [200, 300]: blocks 2 x 3 with partial last row and column blocks,
 * scales [NB, KB]. */
static void test_quant_blocks_error_within_half_ulp(void **state)
{
    (void)state;
    const int N = 200, K = 300, NB = 2, KB = 3;
    float *w = ref_floats(N * K), *s = ref_floats(NB * KB), *blk = ref_floats(128 * 128);
    uint8_t *q = ref_alloc(N * K), *qb = ref_alloc(128 * 128);
    ref_fill_normal(w, N * K, 203, 0.02f);
    for (int n = 128; n < 200; n++) w[n * K + 5] *= 1000.0f; /* block (1, 0) much larger */
    REF_OK(be->quant_blocks(be, q, s, w, N, K));
    for (int nb = 0; nb < NB; nb++)
        for (int kb = 0; kb < KB; kb++) {
            int nn = N - nb * 128 < 128 ? N - nb * 128 : 128;
            int nk = K - kb * 128 < 128 ? K - kb * 128 : 128;
            for (int i = 0; i < nn; i++)
                for (int k = 0; k < nk; k++) {
                    blk[i * nk + k] = w[(nb * 128 + i) * K + kb * 128 + k];
                    qb[i * nk + k] = q[(nb * 128 + i) * K + kb * 128 + k];
                }
            check_tile(blk, 1, qb, 1, nn * nk, s[nb * KB + kb]);
        }
    free(w), free(s), free(blk), free(q), free(qb);
}

/* Values c * 2^p, with one 448 * 2^p per tile, have scale 2^p exactly and
 * come back bit for bit through every quantiser. */
static void test_quant_round_trip_exact_for_representable_values(void **state)
{
    (void)state;
    const int M = 130, K = 200, KB = 2;
    float *x = ref_floats(M * K), *back = ref_floats(M * K), *s = ref_floats(KB * M + 2 * K);
    uint8_t *q = ref_alloc(M * K);
    for (int i = 0; i < M * K; i++) {
        uint8_t c = (uint8_t)(mt_hash_u64(204, (uint64_t)i) & 0xff);
        if (is_nan_code(c)) c = 0x7e;
        x[i] = ldexpf(mt_e4m3_to_f32(c), -4);
    }
    /* every row tile, column tile and block holds a 448 * 2^-4 */
    for (int m = 0; m < M; m++) x[m * K + (m % 128)] = x[m * K + 128 + (m % 72)] = 28.0f;
    for (int k = 0; k < K; k++) x[(k % 128) * K + k] = x[128 * K + k] = 28.0f;
    int rows[] = {M};
    REF_OK(be->quant_rows(be, q, s, x, K, rows, 1, K));
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++)
            back[m * K + k] = mt_e4m3_to_f32(q[m * K + k]) * s[(k / 128) * M + m];
    assert_memory_equal(back, x, sizeof(float) * M * K);
    REF_OK(be->quant_cols_t(be, q, s, x, K, rows, 1, K));
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++)
            back[m * K + k] = mt_e4m3_to_f32(q[k * M + m]) * s[(m / 128) * K + k];
    assert_memory_equal(back, x, sizeof(float) * M * K);
    REF_OK(be->quant_blocks(be, q, s, x, M, K));
    REF_OK(be->dequant_blocks(be, back, q, s, M, K));
    assert_memory_equal(back, x, sizeof(float) * M * K);
    free(x), free(back), free(s), free(q);
}

/* dequant(transpose_blocks(q)) == transpose(dequant(q)), bit for bit. */
static void test_transpose_blocks_is_exact(void **state)
{
    (void)state;
    const int N = 260, K = 150, NB = 3, KB = 2;
    float *w = ref_floats(N * K), *s = ref_floats(NB * KB), *st = ref_floats(NB * KB);
    float *d = ref_floats(N * K), *dt = ref_floats(N * K);
    uint8_t *q = ref_alloc(N * K), *qt = ref_alloc(N * K);
    fill_tiles(w, N * K, 205, 0, 0);
    REF_OK(be->quant_blocks(be, q, s, w, N, K));
    REF_OK(be->transpose_blocks(be, qt, st, q, s, N, K));
    REF_OK(be->dequant_blocks(be, d, q, s, N, K));
    REF_OK(be->dequant_blocks(be, dt, qt, st, K, N));
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) assert_true(dt[k * N + n] == d[n * K + k]);
    for (int kb = 0; kb < KB; kb++)
        for (int nb = 0; nb < NB; nb++) assert_true(st[kb * NB + nb] == s[nb * KB + kb]);
    free(w), free(s), free(st), free(d), free(dt), free(q), free(qt);
}

/* ---- FP8 GEMM -------------------------------------------------------------------------- */

/* The definition, evaluated directly: for each 128-wide tile the fp32 sum of
 * the e4m3 products in k order, times sa then sb, added in tile order. a(k),
 * b(k): codes at a[k * as], b[k * bs]; sa(kb), sb(kb) at sa[kb * sas], ... */
static float fp8_dot_spec(const uint8_t *a, int64_t as, const uint8_t *b, int64_t bs, int K,
                          const float *sa, int64_t sas, const float *sb, int64_t sbs)
{
    float acc = 0.0f;
    for (int kb = 0; kb * 128 < K; kb++) {
        float t = 0.0f;
        for (int k = kb * 128; k < K && k < kb * 128 + 128; k++)
            t += mt_e4m3_to_f32(a[k * as]) * mt_e4m3_to_f32(b[k * bs]);
        acc += (t * sa[kb * sas]) * sb[kb * sbs];
    }
    return acc;
}

/* Same operands in fp64 after dequantisation; *abs = sum of |products|. */
static double fp8_dot_f64(const uint8_t *a, int64_t as, const uint8_t *b, int64_t bs, int K,
                          const float *sa, int64_t sas, const float *sb, int64_t sbs, double *abs)
{
    double s = 0;
    *abs = 0;
    for (int k = 0; k < K; k++) {
        double p = (double)mt_e4m3_to_f32(a[k * as]) * sa[(k / 128) * sas] *
                   mt_e4m3_to_f32(b[k * bs]) * sb[(k / 128) * sbs];
        s += p;
        *abs += fabs(p);
    }
    return s;
}

/* Checks one output: equal to the emulated definition (rounded as stored)
 * and within the stated tolerance of fp64. */
static void check_fp8_out(float got, float spec, double ref, double abs, int K, int rounded)
{
    if (rounded) spec = mt_bf16_round(spec);
    assert_true(got == spec);
    double tol = ref_f32_sum_slack(K + 3 * mt_ceil_div(K, 128), abs) +
                 (rounded ? ref_bf16_ulp(ref) : 0);
    if (fabs(got - ref) > tol) fail_msg("fp8 gemm: got %.9g ref %.9g tol %.3g", got, ref, tol);
}

/* Forward / data-gradient FP8 GEMM over segments {5, 130, 0, 77} with
 * N = 150, K = 300 and per-expert weights: f32 output, bf16-rounded act
 * output, and accumulate. */
static void test_gemm_fp8_rows_matches_reference(void **state)
{
    (void)state;
    static const int rows[] = {5, 130, 0, 77};
    const int G = 4, M = 212, N = 150, K = 300, KB = 3, NB = 2, ldc = 151;
    float *x = ref_floats(M * K), *w = ref_floats(G * N * K), *sa = ref_floats(KB * M);
    float *sb = ref_floats(G * NB * KB), *C = ref_floats(M * ldc), *Ca = ref_floats(M * ldc);
    uint8_t *qa = ref_alloc(M * K), *qb = ref_alloc(G * N * K);
    fill_tiles(x, M * K, 211, 0, 0);
    ref_fill_normal(w, G * N * K, 212, 0.05f);
    REF_OK(be->quant_rows(be, qa, sa, x, K, rows, G, K));
    for (int g = 0; g < G; g++)
        REF_OK(be->quant_blocks(be, qb + g * N * K, sb + g * NB * KB, w + g * N * K, N, K));
    for (int variant = 0; variant < 3; variant++) {
        int c_f32 = variant == 0, acc = variant == 2;
        be->round_bf16 = !c_f32;
        ref_fill_uniform(C, M * ldc, 213, -1, 1);
        memcpy(Ca, C, sizeof(float) * M * ldc);
        REF_OK(be->gemm_fp8(be, 0, C, c_f32, ldc, 0, qa, sa, qb, sb, N * K, NB * KB, rows, G, N,
                            K, acc));
        int r = 0;
        for (int g = 0; g < G; r += rows[g], g++)
            for (int i = 0; i < rows[g]; i++)
                for (int n = 0; n < N; n++) {
                    const uint8_t *a = qa + (r + i) * K, *b = qb + g * N * K + n * K;
                    const float *sai = sa + KB * r + i, *sbn = sb + g * NB * KB + (n / 128) * KB;
                    double abs, ref = fp8_dot_f64(a, 1, b, 1, K, sai, rows[g], sbn, 1, &abs);
                    float spec = fp8_dot_spec(a, 1, b, 1, K, sai, rows[g], sbn, 1);
                    float old = Ca[(r + i) * ldc + n];
                    if (acc) spec += old, ref += old, abs += fabs(old);
                    check_fp8_out(C[(r + i) * ldc + n], spec, ref, abs, K, !c_f32);
                }
        assert_true(C[ldc * M - 1] == Ca[ldc * M - 1]); /* column N of ldc untouched */
    }
    be->round_bf16 = 0;
    free(x), free(w), free(sa), free(sb), free(C), free(Ca), free(qa), free(qb);
}

/* Weight-gradient FP8 GEMM: dW_g [N, K] = dy_g^T x_g from the quant_cols_t
 * outputs of dy [M, N] and x [M, K], segments {5, 200, 0, 77}, C strided
 * per expert (c_stride > N * ldc). */
static void test_gemm_fp8_reduce_matches_reference(void **state)
{
    (void)state;
    static const int rows[] = {5, 200, 0, 77};
    const int G = 4, M = 282, N = 70, K = 130, ldc = 131, tiles = 1 + 2 + 0 + 1;
    const int64_t cs = N * ldc + 5;
    float *dy = ref_floats(M * N), *x = ref_floats(M * K), *sa = ref_floats(tiles * N);
    float *sb = ref_floats(tiles * K), *C = ref_floats(G * cs);
    uint8_t *qa = ref_alloc(M * N), *qb = ref_alloc(M * K);
    fill_tiles(dy, M * N, 221, 0, 0);
    fill_tiles(x, M * K, 222, 0, 0);
    REF_OK(be->quant_cols_t(be, qa, sa, dy, N, rows, G, N));
    REF_OK(be->quant_cols_t(be, qb, sb, x, K, rows, G, K));
    ref_fill_uniform(C, G * cs, 223, -1, 1);
    REF_OK(be->gemm_fp8(be, 1, C, 1, ldc, cs, qa, sa, qb, sb, 0, 0, rows, G, N, K, 0));
    int r = 0, tb = 0;
    for (int g = 0; g < G; r += rows[g], tb += mt_ceil_div(rows[g], 128), g++)
        for (int n = 0; n < N; n++)
            for (int k = 0; k < K; k++) {
                const uint8_t *a = qa + N * r + n * rows[g], *b = qb + K * r + k * rows[g];
                const float *san = sa + N * tb + n, *sbk = sb + K * tb + k;
                double abs, ref = fp8_dot_f64(a, 1, b, 1, rows[g], san, N, sbk, K, &abs);
                float spec = fp8_dot_spec(a, 1, b, 1, rows[g], san, N, sbk, K);
                check_fp8_out(C[g * cs + n * ldc + k], spec, ref, abs, rows[g], 0);
            }
    assert_true(C[2 * cs + 3] == 0.0f); /* empty segment: zero gradient */
    free(dy), free(x), free(sa), free(sb), free(C), free(qa), free(qb);
}

/* ---- float GEMM ---------------------------------------------------------------------------- */

/* Sizes crossing every blocking edge (several macro tiles, K blocks, partial
 * micro tiles), all transposes, padded strides; fp32 output within the fp32
 * summation slack of fp64. */
static void test_gemm_matches_fp64_all_transposes(void **state)
{
    (void)state;
    const int M = 203, N = 290, K = 601;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            int lda = (ta ? M : K) + 1, ldb = (tb ? N : K) + 2, ldc = N + 3;
            int64_t na = (int64_t)(ta ? K : M) * lda, nb = (int64_t)(tb ? K : N) * ldb;
            float *A = ref_floats(na), *B = ref_floats(nb), *C = ref_floats(M * ldc);
            double *ref = ref_alloc(sizeof(double) * M * N);
            double *abs = ref_alloc(sizeof(double) * M * N);
            ref_fill_normal(A, na, 231, 1.0f);
            ref_fill_normal(B, nb, 232, 1.0f);
            REF_OK(be->gemm(be, C, 1, ldc, A, lda, ta, B, ldb, tb, M, N, K, 0.5f, 0));
            ref_gemm_f64(ref, abs, A, lda, ta, B, ldb, tb, M, N, K);
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n++) {
                    double tol = ref_f32_sum_slack(K + 1, 0.5 * abs[m * N + n]);
                    if (fabs(C[m * ldc + n] - 0.5 * ref[m * N + n]) > tol)
                        fail_msg("gemm ta=%d tb=%d [%d, %d]: %.9g vs %.9g", ta, tb, m, n,
                                 C[m * ldc + n], 0.5 * ref[m * N + n]);
                }
            free(A), free(B), free(C), free(ref), free(abs);
        }
}

/* round_bf16: act outputs are bf16 values within one bf16 ulp (+ fp32
 * slack) of fp64; f32 outputs of the same product are not rounded. */
static void test_gemm_bf16_rounding_matches_fp64(void **state)
{
    (void)state;
    const int M = 37, N = 45, K = 300;
    float *A = ref_floats(M * K), *B = ref_floats(N * K), *C = ref_floats(M * N);
    double *ref = ref_alloc(sizeof(double) * M * N), *abs = ref_alloc(sizeof(double) * M * N);
    ref_fill_normal(A, M * K, 241, 1.0f);
    ref_fill_normal(B, N * K, 242, 1.0f);
    ref_round_bf16(A, M * K);
    ref_round_bf16(B, N * K);
    ref_gemm_f64(ref, abs, A, K, 0, B, K, 0, M, N, K);
    be->round_bf16 = 1;
    REF_OK(be->gemm(be, C, 0, N, A, K, 0, B, K, 0, M, N, K, 1.0f, 0));
    for (int i = 0; i < M * N; i++) {
        assert_int_equal(mt_f32_bits(C[i]) & 0xffffu, 0);
        double tol = ref_bf16_ulp(ref[i]) + ref_f32_sum_slack(K, abs[i]);
        if (fabs(C[i] - ref[i]) > tol) fail_msg("gemm bf16 [%d]: %.9g vs %.9g", i, C[i], ref[i]);
    }
    REF_OK(be->gemm(be, C, 1, N, A, K, 0, B, K, 0, M, N, K, 1.0f, 0));
    int unrounded = 0;
    for (int i = 0; i < M * N; i++) unrounded += (mt_f32_bits(C[i]) & 0xffffu) != 0;
    assert_true(unrounded > M * N / 2);
    be->round_bf16 = 0;
    free(A), free(B), free(C), free(ref), free(abs);
}

/* accumulate adds alpha * (the product the non-accumulating call stores). */
static void test_gemm_accumulate_adds_to_c(void **state)
{
    (void)state;
    const int M = 20, N = 33, K = 70;
    float *A = ref_floats(M * K), *B = ref_floats(K * N), *C0 = ref_floats(M * N);
    float *P = ref_floats(M * N), *C = ref_floats(M * N);
    ref_fill_normal(A, M * K, 251, 1.0f);
    ref_fill_normal(B, K * N, 252, 1.0f);
    ref_fill_normal(C0, M * N, 253, 1.0f);
    memcpy(C, C0, sizeof(float) * M * N);
    REF_OK(be->gemm(be, P, 1, N, A, K, 0, B, N, 1, M, N, K, -1.5f, 0));
    REF_OK(be->gemm(be, C, 1, N, A, K, 0, B, N, 1, M, N, K, -1.5f, 1));
    for (int i = 0; i < M * N; i++) assert_true(C[i] == C0[i] + P[i]);
    free(A), free(B), free(C0), free(P), free(C);
}

/* Bad arguments fail with EINVAL and a message naming the op. */
static void test_ops_reject_bad_arguments(void **state)
{
    (void)state;
    float x[16] = {0};
    int rows[] = {2, -1};
    assert_int_equal(be->gemm(be, x, 1, 2, x, 1, 0, x, 2, 0, 2, 2, 2, 1.0f, 0), MT_EINVAL);
    assert_true(strstr(mt_errmsg(), "gemm") != NULL);
    assert_int_equal(be->gemm(be, NULL, 1, 2, x, 2, 0, x, 2, 0, 2, 2, 2, 1.0f, 0), MT_EINVAL);
    assert_int_equal(be->quant_rows(be, (uint8_t *)x, x, x, 4, rows, 2, 4), MT_EINVAL);
    assert_true(strstr(mt_errmsg(), "quant_rows") != NULL);
    assert_int_equal(be->swiglu_fwd(be, x, x, 2, 0), MT_EINVAL);
    assert_int_equal(be->attn_fwd(be, x, x, x, x, x, 1, 0, 1, 1, 1, 1.0f), MT_EINVAL);
    int32_t bad_tgt[] = {9};
    assert_int_equal(be->xent(be, x, x, bad_tgt, 1, 4, -100, 1.0f), MT_EINVAL);
    assert_true(strstr(mt_errmsg(), "xent") != NULL);
    mt_backend *cu = NULL;
    if (mt_cuda_device_count() == 0) {
        int rc = mt_backend_cuda_create(&cu, 0, 0);
        assert_true(rc == MT_ENOTSUP || rc < 0);
        assert_null(cu);
    }
}

/* Every op of struct mt_backend is set: the struct is data fields, then
 * function pointers from `alloc` to its end. */
static void test_cpu_backend_implements_every_op(void **state)
{
    (void)state;
    size_t first = offsetof(mt_backend, alloc);
    size_t n = (sizeof(mt_backend) - first) / sizeof(void (*)(void));
    assert_true(n >= 40);
    for (size_t i = 0; i < n; i++) {
        void (*fn)(void);
        memcpy(&fn, (const char *)be + first + i * sizeof fn, sizeof fn);
        if (!fn) fail_msg("function pointer %zu after alloc is NULL", i);
    }
    assert_int_equal(be->kind, MT_BE_CPU);
    assert_int_equal(be->act_bytes, 4);
}

/* alloc zero-fills and mem_stats tracks bytes in use and the peak. */
static void test_memory_accounting(void **state)
{
    (void)state;
    size_t use0, peak0, use, peak;
    be->mem_stats(be, &use0, &peak0);
    void *a, *b;
    REF_OK(be->alloc(be, 1000, &a));
    REF_OK(be->alloc(be, 3000, &b));
    for (int i = 0; i < 1000; i++) assert_int_equal(((unsigned char *)a)[i], 0);
    be->mem_stats(be, &use, &peak);
    assert_int_equal(use, use0 + 4000);
    assert_true(peak >= use0 + 4000);
    be->free(be, a);
    be->free(be, b);
    be->mem_stats(be, &use, &peak);
    assert_int_equal(use, use0);
    assert_true(peak >= use0 + 4000);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_e4m3_round_trip_all_finite_codes),
        cmocka_unit_test(test_e4m3_rounds_ties_to_even),
        cmocka_unit_test(test_e4m3_saturates_finite_values),
        cmocka_unit_test(test_e4m3_saturates_infinity),
        cmocka_unit_test(test_e4m3_nan_encodes_as_nan),
        cmocka_unit_test(test_bf16_rounds_ties_to_even),
        cmocka_unit_test(test_quant_encoder_matches_scalar_rule),
        cmocka_unit_test(test_quant_rows_error_within_half_ulp),
        cmocka_unit_test(test_quant_cols_t_error_within_half_ulp),
        cmocka_unit_test(test_quant_blocks_error_within_half_ulp),
        cmocka_unit_test(test_quant_round_trip_exact_for_representable_values),
        cmocka_unit_test(test_transpose_blocks_is_exact),
        cmocka_unit_test(test_gemm_fp8_rows_matches_reference),
        cmocka_unit_test(test_gemm_fp8_reduce_matches_reference),
        cmocka_unit_test(test_gemm_matches_fp64_all_transposes),
        cmocka_unit_test(test_gemm_bf16_rounding_matches_fp64),
        cmocka_unit_test(test_gemm_accumulate_adds_to_c),
        cmocka_unit_test(test_ops_reject_bad_arguments),
        cmocka_unit_test(test_cpu_backend_implements_every_op),
        cmocka_unit_test(test_memory_accounting),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
