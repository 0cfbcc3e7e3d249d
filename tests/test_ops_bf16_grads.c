/* test_ops_bf16_grads.c - bf16 gradient accumulators (precision.grads bf16)
 * on the CPU backend, the oracle the CUDA backend is checked against
 * (tests/test_ops_cuda.c).
 *
 * ops.h's rule: an op adding into a bf16 accumulator computes its
 * contribution in fp32, adds it to the accumulator's value in fp32 and rounds
 * the sum to bf16 once per call. So each op, run on a bf16 accumulator,
 * must give exactly the bf16 rounding of the same op run on an f32
 * accumulator that starts from the bf16 values (the f32 path's last add is
 * the same float add). The optimizer ops must read bf16 gradients as their
 * exact f32 widening. Every check here is bit-exact.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "kernels/mt_fp8.h"
#include "op_ref.h"

static mt_backend *be;

static int setup(void **state)
{
    (void)state;
    if (mt_backend_cpu_create(&be, 2) != MT_OK) return -1;
    be->round_bf16 = 1; /* as in the bf16 and fp8 recipes */
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    be->destroy(be);
    return 0;
}

/* An accumulator pair: bf16 bits and their f32 widening. */
typedef struct acc_pair {
    int64_t n;
    uint16_t *b;
    float *f;
} acc_pair;

static acc_pair acc_new(int64_t n, uint64_t seed, float sigma)
{
    acc_pair a = {n, ref_alloc(2 * (size_t)n), ref_floats(n)};
    ref_fill_normal(a.f, n, seed, sigma);
    for (int64_t i = 0; i < n; i++) {
        a.b[i] = mt_bf16_from_f32(a.f[i]);
        a.f[i] = mt_bf16_to_f32(a.b[i]);
    }
    return a;
}

static void acc_free(acc_pair *a)
{
    free(a->b);
    free(a->f);
}

/* Every bf16 element equals the bf16 rounding of the f32 element. */
static void assert_rounds_to(const char *what, const acc_pair *a)
{
    for (int64_t i = 0; i < a->n; i++) {
        const uint16_t want = mt_bf16_from_f32(a->f[i]);
        if (a->b[i] != want)
            fail_msg("%s: element %lld is 0x%04x, the f32 path rounds to 0x%04x (%.9g)", what,
                     (long long)i, a->b[i], want, a->f[i]);
    }
}

static float *act_rand(int64_t n, uint64_t seed)
{
    float *x = ref_floats(n);
    ref_fill_normal(x, n, seed, 1.0f);
    ref_round_bf16(x, n);
    return x;
}

/* dW += dy^T x, four times (micro-batches): after each call the bf16
 * accumulator is the rounding of the f32 path from the same start, and the
 * next call starts from the rounded value (no hidden precision). */
static void test_gemm_weight_grad_rounds_once_per_call(void **state)
{
    (void)state;
    const int M = 67, N = 40, K = 33; /* dW [N, K] from dy [M, N], x [M, K] */
    acc_pair c = acc_new((int64_t)N * K, 1, 0.5f);
    for (int mb = 0; mb < 4; mb++) {
        float *dy = act_rand((int64_t)M * N, 10 + mb), *x = act_rand((int64_t)M * K, 20 + mb);
        REF_OK(be->gemm(be, c.f, MT_C_F32, K, dy, N, 1, x, K, 1, N, K, M, 0.25f, 1));
        REF_OK(be->gemm(be, c.b, MT_C_BF16, K, dy, N, 1, x, K, 1, N, K, M, 0.25f, 1));
        assert_rounds_to("gemm", &c);
        for (int64_t i = 0; i < c.n; i++) c.f[i] = mt_bf16_to_f32(c.b[i]);
        free(dy), free(x);
    }
    /* accumulate = 0 overwrites with the rounded product */
    float *dy = act_rand((int64_t)M * N, 30), *x = act_rand((int64_t)M * K, 31);
    REF_OK(be->gemm(be, c.f, MT_C_F32, K, dy, N, 1, x, K, 1, N, K, M, 1.0f, 0));
    REF_OK(be->gemm(be, c.b, MT_C_BF16, K, dy, N, 1, x, K, 1, N, K, M, 1.0f, 0));
    assert_rounds_to("gemm (no accumulate)", &c);
    free(dy), free(x);
    acc_free(&c);
}

/* Grouped weight gradients (bf16 recipe experts) with a padded ldc and a
 * segment stride: each segment's C_g, and nothing between them, as f32. */
static void test_grouped_weight_grad_rounds_once(void **state)
{
    (void)state;
    const int rows[] = {37, 0, 130, 5}, G = 4, N = 24, K = 20, ldc = K + 3;
    const int64_t cstride = (int64_t)N * ldc + 5;
    int M = 0;
    for (int g = 0; g < G; g++) M += rows[g];
    float *A = act_rand((int64_t)M * N, 40), *B = act_rand((int64_t)M * K, 41);
    acc_pair c = acc_new(cstride * G, 42, 1.0f);
    REF_OK(be->gemm_grouped(be, 1, c.f, MT_C_F32, ldc, cstride, A, N, 0, B, K, 0, 0, rows, G, N,
                            K, 1.0f, 1));
    REF_OK(be->gemm_grouped(be, 1, c.b, MT_C_BF16, ldc, cstride, A, N, 0, B, K, 0, 0, rows, G, N,
                            K, 1.0f, 1));
    assert_rounds_to("gemm_grouped", &c);
    free(A), free(B);
    acc_free(&c);
}

/* FP8 expert weight gradients (quant_cols_t operands), segments with
 * partial 128-row tiles. */
static void test_fp8_weight_grad_rounds_once(void **state)
{
    (void)state;
    const int rows[] = {130, 0, 77, 256}, G = 4, N = 128, K = 256;
    int M = 0, tiles = 0;
    for (int g = 0; g < G; g++) M += rows[g], tiles += (rows[g] + 127) / 128;
    float *dy = act_rand((int64_t)M * N, 50), *x = act_rand((int64_t)M * K, 51);
    uint8_t *qa = ref_alloc((size_t)M * N), *qb = ref_alloc((size_t)M * K);
    float *sa = ref_floats((int64_t)tiles * N), *sb = ref_floats((int64_t)tiles * K);
    REF_OK(be->quant_cols_t(be, qa, sa, dy, N, rows, G, N));
    REF_OK(be->quant_cols_t(be, qb, sb, x, K, rows, G, K));
    const int64_t cstride = (int64_t)N * K;
    acc_pair c = acc_new(cstride * G, 52, 1.0f);
    REF_OK(be->gemm_fp8(be, 1, c.f, MT_C_F32, K, cstride, qa, sa, qb, sb, 0, 0, rows, G, N, K, 1));
    REF_OK(be->gemm_fp8(be, 1, c.b, MT_C_BF16, K, cstride, qa, sa, qb, sb, 0, 0, rows, G, N, K, 1));
    assert_rounds_to("gemm_fp8", &c);
    free(dy), free(x), free(qa), free(qb), free(sa), free(sb);
    acc_free(&c);
}

/* RMSNorm gain gradient: dw = bf16(float(dw + double sum)). */
static void test_rmsnorm_dw_rounds_once(void **state)
{
    (void)state;
    const int M = 50, D = 70;
    float *x = act_rand((int64_t)M * D, 60), *dy = act_rand((int64_t)M * D, 61);
    float *w = act_rand(D, 62), *rstd = ref_floats(M), *y = ref_floats((int64_t)M * D);
    float *dx = ref_floats((int64_t)M * D);
    REF_OK(be->rmsnorm_fwd(be, y, D, rstd, x, D, w, M, D, 1e-6f));
    acc_pair dw = acc_new(D, 63, 1.0f);
    REF_OK(be->rmsnorm_bwd(be, dx, D, 0, dw.f, MT_C_F32, dy, D, x, D, w, rstd, M, D));
    REF_OK(be->rmsnorm_bwd(be, dx, D, 0, dw.b, MT_C_BF16, dy, D, x, D, w, rstd, M, D));
    assert_rounds_to("rmsnorm_bwd dw", &dw);
    free(x), free(dy), free(w), free(rstd), free(y), free(dx);
    acc_free(&dw);
}

/* Embedding gradient with repeated ids: each row's adds in fp32 in row
 * order, one rounding per row and call (not one per token). */
static void test_embedding_grad_rounds_once_per_row(void **state)
{
    (void)state;
    const int V = 11, D = 300, M = 64; /* D > the CPU's column chunk */
    int32_t *ids = ref_alloc(4 * (size_t)M);
    ref_fill_ids(ids, M, 70, V);
    for (int m = 0; m < M; m += 3) ids[m] = 4; /* a frequent token */
    float *dy = act_rand((int64_t)M * D, 71);
    acc_pair t = acc_new((int64_t)V * D, 72, 0.1f);
    REF_OK(be->embedding_bwd(be, t.f, MT_C_F32, dy, ids, M, D));
    REF_OK(be->embedding_bwd(be, t.b, MT_C_BF16, dy, ids, M, D));
    assert_rounds_to("embedding_bwd", &t);
    free(ids), free(dy);
    acc_free(&t);
}

/* Gradient norm and AdamW read bf16 gradients as their f32 widening. */
static void test_optimizer_reads_bf16_grads_exactly(void **state)
{
    (void)state;
    const int64_t n = 100003;
    acc_pair g = acc_new(n, 80, 1e-2f);
    float s_f = 0, s_b = 0;
    REF_OK(be->sumsq(be, &s_f, g.f, 0, n));
    REF_OK(be->sumsq(be, &s_b, g.b, 1, n));
    assert_true(s_f == s_b);
    assert_true(s_f > 0);
    mt_adamw_hp hp = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                      .weight_decay = 0.1f, .bc1 = 0.1f, .bc2 = 0.05f, .grad_scale = 0.5f};
    float *p1 = ref_floats(n), *p2 = ref_floats(n);
    ref_fill_normal(p1, n, 81, 1.0f);
    memcpy(p2, p1, 4 * (size_t)n);
    uint16_t *m1 = ref_alloc(2 * (size_t)n), *v1 = ref_alloc(2 * (size_t)n);
    uint16_t *m2 = ref_alloc(2 * (size_t)n), *v2 = ref_alloc(2 * (size_t)n);
    REF_OK(be->adamw(be, p1, 0, m1, v1, g.f, n, &hp, NULL));
    hp.grad_bf16 = 1;
    REF_OK(be->adamw(be, p2, 0, m2, v2, g.b, n, &hp, NULL));
    assert_memory_equal(p1, p2, 4 * (size_t)n);
    assert_memory_equal(m1, m2, 2 * (size_t)n);
    assert_memory_equal(v1, v2, 2 * (size_t)n);
    free(p1), free(p2), free(m1), free(v1), free(m2), free(v2);
    acc_free(&g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemm_weight_grad_rounds_once_per_call),
        cmocka_unit_test(test_grouped_weight_grad_rounds_once),
        cmocka_unit_test(test_fp8_weight_grad_rounds_once),
        cmocka_unit_test(test_rmsnorm_dw_rounds_once),
        cmocka_unit_test(test_embedding_grad_rounds_once_per_row),
        cmocka_unit_test(test_optimizer_reads_bf16_grads_exactly),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
