/* test_ops_determinism.c - CPU results are bit-identical for any thread
 * count: each op runs on backends with 1, 2 and 3 threads (3 splits the work
 * unevenly) on inputs large enough to take the parallel paths, and the
 * outputs are compared byte for byte. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "op_ref.h"

#define NBE 3
static mt_backend *bes[NBE];

static int setup(void **state)
{
    (void)state;
    for (int i = 0; i < NBE; i++)
        if (mt_backend_cpu_create(&bes[i], i + 1) != MT_OK) return -1;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    for (int i = 0; i < NBE; i++) bes[i]->destroy(bes[i]);
    return 0;
}

/* out[i] holds backend i's result of `bytes`; all must equal out[0]. */
static void assert_all_equal(const char *what, void *out[NBE], size_t bytes)
{
    for (int i = 1; i < NBE; i++)
        if (memcmp(out[0], out[i], bytes) != 0)
            fail_msg("%s: %d threads differ from 1 thread", what, i + 1);
}

static void test_gemm_is_thread_count_invariant(void **state)
{
    (void)state;
    /* shapes: several macro tiles; a thin one where the tiles are cut down */
    const int shapes[][3] = {{300, 200, 300}, {7, 500, 800}, {130, 20, 2000}};
    for (int si = 0; si < 3; si++)
        for (int t = 0; t < 4; t++) {
            int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2], ta = t & 1, tb = t >> 1;
            float *A = ref_floats((int64_t)M * K), *B = ref_floats((int64_t)N * K);
            ref_fill_normal(A, (int64_t)M * K, 401, 1.0f);
            ref_fill_normal(B, (int64_t)N * K, 402, 1.0f);
            void *C[NBE];
            for (int i = 0; i < NBE; i++) {
                C[i] = ref_floats((int64_t)M * N);
                REF_OK(bes[i]->gemm(bes[i], C[i], 1, N, A, ta ? M : K, ta, B, tb ? N : K, tb, M,
                                    N, K, 1.0f, 0));
            }
            assert_all_equal("gemm", C, sizeof(float) * M * N);
            for (int i = 0; i < NBE; i++) free(C[i]);
            free(A), free(B);
        }
}

static void test_gemm_grouped_and_fp8_are_thread_count_invariant(void **state)
{
    (void)state;
    static const int rows[] = {100, 0, 37, 260};
    const int G = 4, M = 397, N = 96, K = 200, KB = 2, NB = 1;
    float *x = ref_floats(M * K), *w = ref_floats(G * N * K), *dy = ref_floats(M * N);
    float *sa = ref_floats(KB * M), *sb = ref_floats(G * NB * KB);
    uint8_t *qa = ref_alloc(M * K), *qb = ref_alloc(G * N * K);
    ref_fill_normal(x, M * K, 411, 1.0f);
    ref_fill_normal(w, G * N * K, 412, 0.1f);
    ref_fill_normal(dy, M * N, 413, 1.0f);
    mt_backend *b0 = bes[0];
    REF_OK(b0->quant_rows(b0, qa, sa, x, K, rows, G, K));
    for (int g = 0; g < G; g++)
        REF_OK(b0->quant_blocks(b0, qb + g * N * K, sb + g * NB * KB, w + g * N * K, N, K));
    void *y[NBE], *dw[NBE], *y8[NBE];
    for (int i = 0; i < NBE; i++) {
        mt_backend *b = bes[i];
        y[i] = ref_floats(M * N), dw[i] = ref_floats(G * N * K), y8[i] = ref_floats(M * N);
        REF_OK(b->gemm_grouped(b, 0, y[i], 0, N, 0, x, K, 0, w, K, 0, N * K, rows, G, N, K,
                               1.0f, 0));
        REF_OK(b->gemm_grouped(b, 1, dw[i], 1, K, N * K, dy, N, 0, x, K, 0, 0, rows, G, N, K,
                               1.0f, 0));
        REF_OK(b->gemm_fp8(b, 0, y8[i], 0, N, 0, qa, sa, qb, sb, N * K, NB * KB, rows, G, N, K, 0));
    }
    assert_all_equal("gemm_grouped", y, sizeof(float) * M * N);
    assert_all_equal("gemm_grouped reduce", dw, sizeof(float) * G * N * K);
    assert_all_equal("gemm_fp8", y8, sizeof(float) * M * N);
    for (int i = 0; i < NBE; i++) free(y[i]), free(dw[i]), free(y8[i]);
    free(x), free(w), free(dy), free(sa), free(sb), free(qa), free(qb);
}

static void test_attention_is_thread_count_invariant(void **state)
{
    (void)state;
    const int B = 2, T = 64, H = 4, Dqk = 24, Dv = 16;
    const int64_t nq = (int64_t)B * T * H * Dqk, nv = (int64_t)B * T * H * Dv;
    float *q = ref_floats(nq), *k = ref_floats(nq), *v = ref_floats(nv), *dout = ref_floats(nv);
    ref_fill_normal(q, nq, 421, 1.0f);
    ref_fill_normal(k, nq, 422, 1.0f);
    ref_fill_normal(v, nv, 423, 1.0f);
    ref_fill_normal(dout, nv, 424, 1.0f);
    void *o[NBE], *lse[NBE], *dq[NBE], *dk[NBE], *dv[NBE];
    for (int i = 0; i < NBE; i++) {
        mt_backend *b = bes[i];
        o[i] = ref_floats(nv), lse[i] = ref_floats(B * H * T);
        dq[i] = ref_floats(nq), dk[i] = ref_floats(nq), dv[i] = ref_floats(nv);
        REF_OK(b->attn_fwd(b, o[i], lse[i], q, k, v, B, T, H, Dqk, Dv, 0.2f));
        REF_OK(b->attn_bwd(b, dq[i], dk[i], dv[i], dout, q, k, v, o[i], lse[i], B, T, H, Dqk, Dv,
                           0.2f));
    }
    assert_all_equal("attn o", o, sizeof(float) * nv);
    assert_all_equal("attn lse", lse, sizeof(float) * B * H * T);
    assert_all_equal("attn dq", dq, sizeof(float) * nq);
    assert_all_equal("attn dk", dk, sizeof(float) * nq);
    assert_all_equal("attn dv", dv, sizeof(float) * nv);
    for (int i = 0; i < NBE; i++) free(o[i]), free(lse[i]), free(dq[i]), free(dk[i]), free(dv[i]);
    free(q), free(k), free(v), free(dout);
}

static void test_reductions_are_thread_count_invariant(void **state)
{
    (void)state;
    const int M = 2000, D = 96, V = 50;
    const int64_t n = 1000007;
    float *dy = ref_floats(M * D), *x = ref_floats(M * D), *w = ref_floats(D), *g = ref_floats(n);
    float *y = ref_floats(M * D), *rstd = ref_floats(M);
    int32_t *ids = ref_alloc(sizeof(int32_t) * M);
    ref_fill_normal(dy, M * D, 431, 1.0f);
    ref_fill_normal(x, M * D, 432, 1.0f);
    ref_fill_uniform(w, D, 433, 0.5f, 1.5f);
    ref_fill_normal(g, n, 434, 1.0f);
    ref_fill_ids(ids, M, 435, V);
    REF_OK(bes[0]->rmsnorm_fwd(bes[0], y, D, rstd, x, D, w, M, D, 1e-6f));
    void *dt[NBE], *dx[NBE], *dw[NBE], *ss[NBE];
    for (int i = 0; i < NBE; i++) {
        mt_backend *b = bes[i];
        dt[i] = ref_floats(V * D), dx[i] = ref_floats(M * D), dw[i] = ref_floats(D);
        ss[i] = ref_floats(1);
        REF_OK(b->embedding_bwd(b, dt[i], MT_C_F32, dy, ids, M, D));
        REF_OK(b->rmsnorm_bwd(b, dx[i], D, 0, dw[i], MT_C_F32, dy, D, x, D, w, rstd, M, D));
        REF_OK(b->sumsq(b, ss[i], g, 0, n));
    }
    assert_all_equal("embedding_bwd", dt, sizeof(float) * V * D);
    assert_all_equal("rmsnorm_bwd dx", dx, sizeof(float) * M * D);
    assert_all_equal("rmsnorm_bwd dw", dw, sizeof(float) * D);
    assert_all_equal("sumsq", ss, sizeof(float));
    double ref = ref_dot(g, g, n);
    assert_float_equal(*(float *)ss[0], ref, 1e-6 * ref);
    for (int i = 0; i < NBE; i++) free(dt[i]), free(dx[i]), free(dw[i]), free(ss[i]);
    free(dy), free(x), free(w), free(g), free(y), free(rstd), free(ids);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemm_is_thread_count_invariant),
        cmocka_unit_test(test_gemm_grouped_and_fp8_are_thread_count_invariant),
        cmocka_unit_test(test_attention_is_thread_count_invariant),
        cmocka_unit_test(test_reductions_are_thread_count_invariant),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
