/* test_ops_optim.c - optimizer ops of the CPU backend: AdamW with bf16
 * moments against fp64, sum of squares and scaling, stochastic rounding to
 * bf16 and to e4m3 (neighbours only, unbiased, the documented random bits),
 * bf16 master copies. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

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

static uint16_t *bf16_fill(int64_t n, uint64_t seed, float lo, float hi)
{
    float *f = ref_floats(n);
    uint16_t *h = ref_alloc(sizeof(uint16_t) * (size_t)n);
    ref_fill_uniform(f, n, seed, lo, hi);
    for (int64_t i = 0; i < n; i++) h[i] = mt_bf16_from_f32(f[i]);
    free(f);
    return h;
}

/* One step on f32 and on bf16 parameters: the moments are the bf16 roundings
 * of the fp32 moments (within one bf16 ulp of fp64), and p is within one ulp
 * of its storage type plus 1e-5 relative of the update of the fp64 formula. */
static void test_adamw_matches_fp64_formula(void **state)
{
    (void)state;
    const int64_t n = 5000;
    const mt_adamw_hp hp = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                            .weight_decay = 0.1f, .bc1 = 1 - 0.9f * 0.9f * 0.9f,
                            .bc2 = 1 - 0.95f * 0.95f * 0.95f, .grad_scale = 0.5f};
    for (int p_bf16 = 0; p_bf16 < 2; p_bf16++) {
        float *p = ref_floats(n), *grad = ref_floats(n);
        uint16_t *m = bf16_fill(n, 501, -0.01f, 0.01f), *v = bf16_fill(n, 502, 0, 1e-4f);
        uint16_t *m0 = ref_alloc(2 * n), *v0 = ref_alloc(2 * n), *pb = ref_alloc(2 * n);
        memcpy(m0, m, 2 * n), memcpy(v0, v, 2 * n);
        ref_fill_uniform(p, n, 503, -1, 1);
        ref_fill_normal(grad, n, 504, 0.02f);
        for (int64_t i = 0; i < n; i++) {
            pb[i] = mt_bf16_from_f32(p[i]);
            if (p_bf16) p[i] = mt_bf16_to_f32(pb[i]);
        }
        float *p0 = ref_dup(p, n);
        REF_OK(be->adamw(be, p_bf16 ? (void *)pb : (void *)p, p_bf16, m, v, grad, n, &hp, NULL));
        for (int64_t i = 0; i < n; i++) {
            double g = (double)grad[i] * hp.grad_scale;
            double mm = hp.beta1 * (double)mt_bf16_to_f32(m0[i]) + (1 - (double)hp.beta1) * g;
            double vv = hp.beta2 * (double)mt_bf16_to_f32(v0[i]) + (1 - (double)hp.beta2) * g * g;
            double upd = mm / hp.bc1 / (sqrt(vv / hp.bc2) + hp.eps) +
                         hp.weight_decay * (double)p0[i];
            double pp = p0[i] - hp.lr * upd;
            assert_true(fabs(mt_bf16_to_f32(m[i]) - mm) <= ref_bf16_ulp(mm));
            assert_true(fabs(mt_bf16_to_f32(v[i]) - vv) <= ref_bf16_ulp(vv));
            double got = p_bf16 ? mt_bf16_to_f32(pb[i]) : p[i];
            double ulp = p_bf16 ? ref_bf16_ulp(pp) : fabs(pp) * 0x1p-23;
            if (fabs(got - pp) > ulp + 1e-5 * hp.lr * fabs(upd))
                fail_msg("adamw p_bf16=%d [%lld]: %.9g vs %.9g", p_bf16, (long long)i, got, pp);
        }
        free(p), free(grad), free(m), free(v), free(m0), free(v0), free(pb), free(p0);
    }
}

/* The first step from zero moments moves every weight by lr * sign(g). */
static void test_adamw_first_step_is_sign_descent(void **state)
{
    (void)state;
    const int64_t n = 100;
    const mt_adamw_hp hp = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-12f,
                            .bc1 = 0.1f, .bc2 = 0.05f, .grad_scale = 1.0f};
    float *p = ref_floats(n), *g = ref_floats(n);
    uint16_t *m = ref_alloc(2 * n), *v = ref_alloc(2 * n);
    ref_fill_normal(g, n, 511, 1.0f);
    REF_OK(be->adamw(be, p, 0, m, v, g, n, &hp, NULL));
    for (int64_t i = 0; i < n; i++) assert_float_equal(p[i], g[i] > 0 ? -1e-3 : 1e-3, 1e-8);
    free(p), free(g), free(m), free(v);
}

/* The act copy adamw writes beside the update is act_from_f32 of the
 * updated weight (bf16 main: of its rounded value), and the update itself
 * is the same with or without it. */
static void test_adamw_act_copy_is_act_from_f32_of_the_update(void **state)
{
    (void)state;
    const int64_t n = 1001;
    const mt_adamw_hp hp = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                            .weight_decay = 0.1f, .bc1 = 0.1f, .bc2 = 0.05f, .grad_scale = 1.0f};
    const size_t act = (size_t)be->act_bytes;
    for (int p_bf16 = 0; p_bf16 < 2; p_bf16++) {
        float *p1 = ref_floats(n), *p2 = ref_floats(n), *g = ref_floats(n), *f = ref_floats(n);
        uint16_t *m1 = ref_alloc(2 * n), *v1 = ref_alloc(2 * n), *m2 = ref_alloc(2 * n),
                 *v2 = ref_alloc(2 * n);
        void *a1 = ref_alloc(act * n), *a2 = ref_alloc(act * n);
        ref_fill_uniform(p1, n, 531, -1, 1);
        ref_fill_normal(g, n, 532, 0.02f);
        if (p_bf16) { /* bf16 bits in the first half of each array */
            uint16_t *b = (uint16_t *)p1;
            for (int64_t i = 0; i < n; i++) b[i] = mt_bf16_from_f32(p1[i]);
        }
        memcpy(p2, p1, 4 * n);
        REF_OK(be->adamw(be, p1, p_bf16, m1, v1, g, n, &hp, NULL));
        for (int64_t i = 0; i < n; i++)
            f[i] = p_bf16 ? mt_bf16_to_f32(((uint16_t *)p1)[i]) : p1[i];
        REF_OK(be->act_from_f32(be, a1, f, n));
        REF_OK(be->adamw(be, p2, p_bf16, m2, v2, g, n, &hp, a2));
        assert_memory_equal(p1, p2, (p_bf16 ? 2 : 4) * n);
        assert_memory_equal(m1, m2, 2 * n);
        assert_memory_equal(v1, v2, 2 * n);
        assert_memory_equal(a1, a2, act * n);
        free(p1), free(p2), free(g), free(f), free(m1), free(v1), free(m2), free(v2);
        free(a1), free(a2);
    }
}

/* adamw_sr (a weight of the act type with no main copy) is act_to_f32,
 * adamw and act_from_f32_sr in sequence, bit for bit: weight and moments,
 * with bf16 rounding of the acts (round_bf16) and without. */
static void test_adamw_sr_is_the_sequence_of_three_ops(void **state)
{
    (void)state;
    const int64_t n = 3001;
    const mt_adamw_hp hp = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                            .weight_decay = 0.1f, .bc1 = 0.1f, .bc2 = 0.05f, .grad_scale = 1.0f};
    const uint64_t seed = 0x5eed5;
    for (int round = 0; round < 2; round++) {
        be->round_bf16 = round;
        float *w1 = ref_floats(n), *w2 = ref_floats(n), *g = ref_floats(n), *f = ref_floats(n);
        uint16_t *m1 = bf16_fill(n, 541, -0.01f, 0.01f), *v1 = bf16_fill(n, 542, 0, 1e-4f);
        uint16_t *m2 = ref_alloc(2 * n), *v2 = ref_alloc(2 * n);
        memcpy(m2, m1, 2 * n), memcpy(v2, v1, 2 * n);
        ref_fill_uniform(w1, n, 543, -1, 1);
        for (int64_t i = 0; round && i < n; i++) w1[i] = mt_bf16_round(w1[i]);
        ref_fill_normal(g, n, 544, 0.02f);
        memcpy(w2, w1, 4 * n);
        REF_OK(be->act_to_f32(be, f, w1, n));
        REF_OK(be->adamw(be, f, 0, m1, v1, g, n, &hp, NULL));
        REF_OK(be->act_from_f32_sr(be, w1, f, n, seed));
        REF_OK(be->adamw_sr(be, w2, m2, v2, g, n, &hp, seed));
        assert_memory_equal(w1, w2, 4 * n);
        assert_memory_equal(m1, m2, 2 * n);
        assert_memory_equal(v1, v2, 2 * n);
        /* with bf16 acts each weight is a bf16 neighbour of its f32 update,
         * the upper one about half the time (the updates' fractions are
         * spread) */
        int64_t up = 0;
        for (int64_t i = 0; round && i < n; i++) {
            assert_true(w2[i] == mt_bf16_round(w2[i]));
            assert_true(fabs((double)w2[i] - f[i]) < ref_bf16_ulp(f[i]));
            up += fabsf(w2[i]) > fabsf(f[i]);
        }
        assert_true(!round || (up > 0.4 * n && up < 0.6 * n));
        free(w1), free(w2), free(g), free(f), free(m1), free(v1), free(m2), free(v2);
    }
    be->round_bf16 = 0;
}

static void test_sumsq_and_scale(void **state)
{
    (void)state;
    const int64_t n = 300001;
    float *g = ref_floats(n), *h;
    ref_fill_normal(g, n, 521, 3.0f);
    h = ref_dup(g, n);
    float out = -1;
    REF_OK(be->sumsq(be, &out, g, 0, n));
    double ref = ref_dot(g, g, n);
    assert_float_equal(out, ref, 1e-6 * ref);
    REF_OK(be->sumsq(be, &out, g, 0, 0));
    assert_true(out == 0.0f);
    REF_OK(be->scale_f32(be, g, n, -0.37f));
    for (int64_t i = 0; i < n; i++) assert_true(g[i] == h[i] * -0.37f);
    free(g), free(h);
}

static void test_bf16_to_f32_is_exact(void **state)
{
    (void)state;
    uint16_t h[65536];
    float f[65536];
    for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    REF_OK(be->bf16_to_f32(be, f, h, 65536));
    for (int i = 0; i < 65536; i++) assert_int_equal(mt_f32_bits(f[i]), (uint32_t)i << 16);
}

/* act_from_f32_sr (round_bf16): element i is mt_bf16_from_f32_sr(x, low 32
 * bits of mt_hash_u64(seed, i)), one of its two bf16 neighbours; the mean is
 * unbiased (within 5 sigma); bf16 values pass unchanged; fp32 acts
 * (round_bf16 = 0) are not rounded. */
static void test_act_stochastic_rounding_is_unbiased_and_documented(void **state)
{
    (void)state;
    const int64_t n = 200000;
    const uint64_t seed = 531;
    const float lo = 1.0f, hi = 1.0f + 0x1p-7f, x = 1.0f + 0.3f * 0x1p-7f;
    float *src = ref_floats(n), *dst = ref_floats(n), *dst2 = ref_floats(n);
    for (int64_t i = 0; i < n; i++) src[i] = (i % 2) ? -x : x;
    be->round_bf16 = 1;
    REF_OK(be->act_from_f32_sr(be, dst, src, n, seed));
    REF_OK(be->act_from_f32_sr(be, dst2, src, n, seed));
    assert_memory_equal(dst, dst2, sizeof(float) * n);
    int64_t up = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(dst[i]);
        assert_true(a == lo || a == hi);
        assert_true((dst[i] < 0) == (src[i] < 0));
        uint16_t want = mt_bf16_from_f32_sr(src[i], (uint32_t)mt_hash_u64(seed, (uint64_t)i));
        assert_true(dst[i] == mt_bf16_to_f32(want));
        up += a == hi;
    }
    double frac = (double)up / n, sigma = sqrt(0.3 * 0.7 / n);
    assert_true(fabs(frac - 0.3) < 5 * sigma);
    for (int64_t i = 0; i < n; i++) src[i] = mt_bf16_round(src[i] * 3.7f);
    REF_OK(be->act_from_f32_sr(be, dst, src, n, seed));
    assert_memory_equal(dst, src, sizeof(float) * n);
    be->round_bf16 = 0;
    src[0] = x;
    REF_OK(be->act_from_f32_sr(be, dst, src, 1, seed));
    assert_true(dst[0] == x);
    free(src), free(dst), free(dst2);
}

/* quant_blocks_sr: the scales are quant_blocks' scales; element (n, k) is
 * mt_e4m3_from_f32_sr(w / s, mt_hash_uniform(seed, n K + k)), one of the two
 * e4m3 neighbours of w / s; unbiased in the normal and the subnormal range
 * (within 5 sigma); e4m3 values unchanged. */
static void test_quant_blocks_stochastic_rounding_is_unbiased_and_documented(void **state)
{
    (void)state;
    const int N = 256, K = 300;
    const uint64_t seed = 541;
    /* scale 1 in every block (a 448 in each); values 1.3 (between 1.25 and
     * 1.375, 40% up), 2.7 * 2^-9 (between codes 2 and 3, 70% up), and e4m3
     * values */
    float *w = ref_floats(N * K), *s = ref_floats(6), *s_rne = ref_floats(6);
    uint8_t *q = ref_alloc(N * K), *q2 = ref_alloc(N * K);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            int i = n * K + k;
            w[i] = (k % 3 == 0)   ? 1.3f
                   : (k % 3 == 1) ? -2.7f * 0x1p-9f
                                  : mt_e4m3_to_f32((uint8_t)(i % 120));
        }
    for (int nb = 0; nb < 2; nb++)
        for (int kb = 0; kb < 3; kb++) w[(nb * 128) * K + kb * 128 + 2] = 448.0f;
    REF_OK(be->quant_blocks(be, q, s_rne, w, N, K));
    REF_OK(be->quant_blocks_sr(be, q, s, w, N, K, seed));
    REF_OK(be->quant_blocks_sr(be, q2, s, w, N, K, seed));
    assert_memory_equal(q, q2, (size_t)N * K);
    assert_memory_equal(s, s_rne, sizeof(float) * 6);
    int64_t up[2] = {0, 0}, cnt[2] = {0, 0};
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            int i = n * K + k;
            float y = w[i]; /* scale 1 */
            assert_int_equal(q[i], mt_e4m3_from_f32_sr(y, mt_hash_uniform(seed, (uint64_t)i)));
            uint8_t lo = mt_e4m3_from_f32(y), hi = lo;
            if (mt_e4m3_to_f32(lo) != y) { /* the neighbours in magnitude */
                if (fabsf(mt_e4m3_to_f32(lo)) > fabsf(y)) lo--;
                hi = lo + 1;
            }
            assert_true(q[i] == lo || q[i] == hi);
            if (k % 3 < 2) {
                up[k % 3] += q[i] == hi;
                cnt[k % 3]++;
            }
        }
    const double p[2] = {0.4, 0.7};
    for (int c = 0; c < 2; c++) {
        double frac = (double)up[c] / cnt[c], sigma = sqrt(p[c] * (1 - p[c]) / cnt[c]);
        if (fabs(frac - p[c]) > 5 * sigma)
            fail_msg("class %d: %.4f up, expected %.2f", c, frac, p[c]);
    }
    free(w), free(s), free(s_rne), free(q), free(q2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_adamw_matches_fp64_formula),
        cmocka_unit_test(test_adamw_first_step_is_sign_descent),
        cmocka_unit_test(test_adamw_act_copy_is_act_from_f32_of_the_update),
        cmocka_unit_test(test_adamw_sr_is_the_sequence_of_three_ops),
        cmocka_unit_test(test_sumsq_and_scale),
        cmocka_unit_test(test_bf16_to_f32_is_exact),
        cmocka_unit_test(test_act_stochastic_rounding_is_unbiased_and_documented),
        cmocka_unit_test(test_quant_blocks_stochastic_rounding_is_unbiased_and_documented),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
