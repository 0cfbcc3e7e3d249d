/* test_ops_router.c - MoE routing of the CPU backend: the group-limited top-k
 * selection against a brute-force reference, the bias's role (selection
 * only), the expert-major index and the permutation round trip. */
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

/* a beats b: higher value, or equal value and lower index. */
static int beats(const float *v, int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a < b); }

/* Brute-force selection of one token from its biased scores b[E]: among all
 * subsets of topk_group groups, the kept one is the subset whose every
 * member beats every non-member by group score; then the top_k experts of
 * the kept groups in order (repeatedly the allowed expert beating all
 * others). */
static void ref_select(const mt_router_cfg *c, const float *b, int32_t *idx)
{
    int E = c->n_experts, G = c->n_group, gs = E / G;
    float gsc[64];
    unsigned char ok[256];
    for (int g = 0; g < G; g++) {
        float v[256];
        for (int i = 0; i < gs; i++) v[i] = b[g * gs + i];
        for (int i = 0; i < gs; i++) /* sort the group descending */
            for (int j = i + 1; j < gs; j++)
                if (v[j] > v[i]) {
                    float t = v[i];
                    v[i] = v[j];
                    v[j] = t;
                }
        gsc[g] = c->group_by_top2 && gs >= 2 ? v[0] + v[1] : v[0];
    }
    int keep = G == 1 ? 1 : c->topk_group, found = 0;
    for (uint64_t set = 0; set < (1ull << G); set++) {
        if (__builtin_popcountll(set) != keep) continue;
        int valid = 1;
        for (int g = 0; g < G && valid; g++)
            for (int h = 0; h < G && valid; h++)
                if ((set >> g & 1) && !(set >> h & 1) && !beats(gsc, g, h)) valid = 0;
        if (!valid) continue;
        found++;
        for (int e = 0; e < E; e++) ok[e] = (set >> (e / gs)) & 1;
    }
    assert_int_equal(found, 1);
    for (int k = 0; k < c->top_k; k++) {
        for (int e = 0; e < E; e++) {
            if (!ok[e]) continue;
            int best = 1;
            for (int f = 0; f < E && best; f++)
                if (ok[f] && f != e && beats(b, f, e)) best = 0;
            if (best) {
                idx[k] = e;
                ok[e] = 0;
                break;
            }
        }
    }
}

/* Logits and bias from small discrete sets, so equal biased scores (ties)
 * are frequent. */
static void tie_prone_inputs(float *logits, float *bias, int N, int E, uint64_t seed)
{
    for (int i = 0; i < N * E; i++)
        logits[i] = 0.5f * (float)((int)(mt_hash_u64(seed, (uint64_t)i) % 5) - 2);
    for (int e = 0; e < E; e++) bias[e] = 0.125f * (float)(mt_hash_u64(seed + 1, (uint64_t)e) % 3);
}

static void check_token_weights(const mt_router_cfg *c, const float *s, const int32_t *idx,
                                const float *w)
{
    double den = 0;
    for (int k = 0; k < c->top_k; k++) den += s[idx[k]];
    for (int k = 0; k < c->top_k; k++) {
        double ref = (c->norm_topk ? s[idx[k]] / den : s[idx[k]]) * c->scaling;
        assert_float_equal(w[k], ref, 1e-6 * fabs(ref));
    }
}

/* Chosen experts equal the brute-force reference on 400 tie-prone tokens
 * and 400 continuous ones per configuration (grouped top-2 and max group
 * scores, no group limit, softmax scoring); scores match fp64 within 1e-6
 * relative, weights are the normalised unbiased scores times scaling. */
static void test_router_selection_matches_brute_force(void **state)
{
    (void)state;
    const mt_router_cfg cfgs[] = {
        {8, 2, 4, 2, MT_SCORE_SIGMOID, 1, 1, 2.5f},
        {32, 8, 8, 4, MT_SCORE_SIGMOID, 1, 1, 2.5f},
        {32, 8, 8, 4, MT_SCORE_SIGMOID, 0, 1, 1.0f},
        {16, 4, 1, 1, MT_SCORE_SIGMOID, 1, 0, 1.0f},
        {64, 6, 1, 1, MT_SCORE_SOFTMAX, 1, 0, 1.0f},
        {64, 6, 8, 3, MT_SCORE_SOFTMAX, 0, 1, 1.0f},
    };
    const int N = 400;
    for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++)
        for (int ties = 0; ties < 2; ties++) {
            const mt_router_cfg *c = &cfgs[ci];
            int E = c->n_experts, K = c->top_k;
            float *logits = ref_floats(N * E), *bias = ref_floats(E), *s = ref_floats(N * E);
            float *w = ref_floats(N * K), b[256];
            int32_t *idx = ref_alloc(sizeof(int32_t) * N * K), ref[16];
            if (ties) {
                tie_prone_inputs(logits, bias, N, E, 300 + ci);
            } else {
                ref_fill_normal(logits, N * E, 310 + ci, 1.5f);
                ref_fill_uniform(bias, E, 320 + ci, -0.2f, 0.2f);
            }
            REF_OK(be->router_fwd(be, idx, w, s, logits, bias, N, c));
            for (int n = 0; n < N; n++) {
                const float *sn = s + n * E, *ln = logits + n * E;
                double z = 0;
                for (int e = 0; e < E; e++) z += exp(ln[e]);
                for (int e = 0; e < E; e++) {
                    double r = c->score_fn == MT_SCORE_SIGMOID ? 1 / (1 + exp(-(double)ln[e]))
                                                               : exp(ln[e]) / z;
                    assert_float_equal(sn[e], r, 1e-6 * r);
                    b[e] = sn[e] + bias[e];
                }
                ref_select(c, b, ref);
                if (memcmp(ref, idx + n * K, sizeof(int32_t) * K) != 0)
                    fail_msg("cfg %zu ties %d token %d: expert %d != reference %d ...", ci, ties,
                             n, idx[n * K], ref[0]);
                check_token_weights(c, sn, idx + n * K, w + n * K);
            }
            free(logits), free(bias), free(s), free(w), free(idx);
        }
}

/* A bias favouring some experts changes which experts win but the weights
 * stay the normalised unbiased scores of the winners: tokens whose selection
 * is unchanged get bit-identical weights. */
static void test_router_bias_changes_selection_not_weights(void **state)
{
    (void)state;
    const mt_router_cfg c = {32, 8, 8, 4, MT_SCORE_SIGMOID, 1, 1, 2.5f};
    const int N = 200, E = 32, K = 8;
    float *logits = ref_floats(N * E), *bias = ref_floats(E), *s0 = ref_floats(N * E);
    float *s1 = ref_floats(N * E), *w0 = ref_floats(N * K), *w1 = ref_floats(N * K);
    int32_t *i0 = ref_alloc(sizeof(int32_t) * N * K), *i1 = ref_alloc(sizeof(int32_t) * N * K);
    ref_fill_normal(logits, N * E, 330, 1.0f);
    for (int e = 0; e < E; e++) bias[e] = (e % 5 == 0) ? 0.3f : 0.0f;
    REF_OK(be->router_fwd(be, i0, w0, s0, logits, NULL, N, &c));
    REF_OK(be->router_fwd(be, i1, w1, s1, logits, bias, N, &c));
    assert_memory_equal(s0, s1, sizeof(float) * N * E); /* scores are unbiased */
    int changed = 0;
    for (int n = 0; n < N; n++) {
        check_token_weights(&c, s1 + n * E, i1 + n * K, w1 + n * K);
        if (memcmp(i0 + n * K, i1 + n * K, sizeof(int32_t) * K) != 0)
            changed++;
        else
            assert_memory_equal(w0 + n * K, w1 + n * K, sizeof(float) * K);
    }
    assert_true(changed > N / 4);
    free(logits), free(bias), free(s0), free(s1), free(w0), free(w1), free(i0), free(i1);
}

/* K distinct experts per token, uniformly drawn. */
static void random_assignments(int32_t *idx, int N, int K, int E, uint64_t seed)
{
    mt_rng r;
    mt_rng_seed(&r, seed);
    int64_t perm[256];
    for (int n = 0; n < N; n++) {
        for (int e = 0; e < E; e++) perm[e] = e;
        mt_rng_shuffle_i64(&r, perm, E);
        for (int k = 0; k < K; k++) idx[n * K + k] = (int32_t)perm[k];
    }
}

typedef struct index_out {
    int32_t *slot, *src, counts[64];
    int rows[64];
} index_out;

/* Checks the layout documented in cpu_moe.c: segments padded to align,
 * stable by token, padding and unused rows -1, slot and src consistent. */
static void check_index(const index_out *o, const int32_t *idx, int N, int K, int E, int align,
                        int R_cap)
{
    int start = 0;
    for (int e = 0; e < E; e++) {
        int cnt = 0;
        for (int a = 0; a < N * K; a++) cnt += idx[a] == e;
        assert_int_equal(o->counts[e], cnt);
        assert_int_equal(o->rows[e], (cnt + align - 1) / align * align);
        assert_int_equal(start % align, 0);
        int prev = -1;
        for (int r = start; r < start + o->rows[e]; r++) {
            if (r < start + cnt) {
                assert_true(o->src[r] > prev); /* increasing tokens */
                prev = o->src[r];
            } else {
                assert_int_equal(o->src[r], -1);
            }
        }
        start += o->rows[e];
    }
    for (int r = start; r < R_cap; r++) assert_int_equal(o->src[r], -1);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            int r = o->slot[n * K + k], e = idx[n * K + k], s0 = 0;
            for (int f = 0; f < e; f++) s0 += o->rows[f];
            assert_true(r >= s0 && r < s0 + o->counts[e]);
            assert_int_equal(o->src[r], n);
        }
}

/* moe_index gives the same layout every time (and with 1 thread), follows
 * the documented padded layout, and rejects a too small R_cap. */
static void test_moe_index_is_deterministic_and_padded(void **state)
{
    (void)state;
    const int N = 300, K = 4, E = 16;
    int32_t *idx = ref_alloc(sizeof(int32_t) * N * K);
    random_assignments(idx, N, K, E - 1, 340); /* expert E - 1 gets no tokens */
    mt_backend *be1;
    REF_OK(mt_backend_cpu_create(&be1, 1));
    const int aligns[] = {1, 8, 16};
    for (int ai = 0; ai < 3; ai++) {
        int align = aligns[ai], R_cap = N * K + E * (align - 1) + 3;
        index_out o[3];
        for (int i = 0; i < 3; i++) {
            o[i].slot = ref_alloc(sizeof(int32_t) * N * K);
            o[i].src = ref_alloc(sizeof(int32_t) * R_cap);
            mt_backend *b = i == 2 ? be1 : be;
            REF_OK(b->moe_index(b, o[i].slot, o[i].src, o[i].counts, o[i].rows, idx, N, K, E,
                                align, R_cap));
        }
        check_index(&o[0], idx, N, K, E, align, R_cap);
        assert_int_equal(o[0].rows[E - 1], 0);
        for (int i = 1; i < 3; i++) {
            assert_memory_equal(o[i].slot, o[0].slot, sizeof(int32_t) * N * K);
            assert_memory_equal(o[i].src, o[0].src, sizeof(int32_t) * R_cap);
            assert_memory_equal(o[i].counts, o[0].counts, sizeof(int32_t) * E);
            assert_memory_equal(o[i].rows, o[0].rows, sizeof(int) * E);
        }
        int rc = be->moe_index(be, o[0].slot, o[0].src, o[0].counts, o[0].rows, idx, N, K, E,
                               align, N * K + E * (align - 1) - 1);
        assert_int_equal(rc, MT_EINVAL);
        assert_true(strstr(mt_errmsg(), "R_cap") != NULL);
        for (int i = 0; i < 3; i++) free(o[i].slot), free(o[i].src);
    }
    be1->destroy(be1);
    free(idx);
}

/* unpermute(permute(x), w = 1) = K x exactly (values k / 64: every sum is
 * exact), and the padding rows of the permuted buffer are zero. */
static void test_permute_unpermute_round_trip(void **state)
{
    (void)state;
    const int N = 100, K = 3, E = 8, D = 24, align = 16;
    const int R = N * K + E * (align - 1);
    int32_t *idx = ref_alloc(sizeof(int32_t) * N * K), *slot = ref_alloc(sizeof(int32_t) * N * K);
    int32_t *src = ref_alloc(sizeof(int32_t) * R), counts[8];
    int rows[8];
    random_assignments(idx, N, K, E, 350);
    REF_OK(be->moe_index(be, slot, src, counts, rows, idx, N, K, E, align, R));
    float *x = ref_floats(N * D), *xp = ref_floats(R * D), *y = ref_floats(N * D);
    float *w = ref_floats(N * K);
    for (int i = 0; i < N * D; i++)
        x[i] = (float)((int)(mt_hash_u64(351, (uint64_t)i) % 257) - 128) / 64;
    for (int i = 0; i < N * K; i++) w[i] = 1.0f;
    ref_fill_uniform(xp, R * D, 352, 7, 8); /* stale values must be overwritten */
    REF_OK(be->moe_permute(be, xp, x, src, R, D));
    int padding = 0;
    for (int r = 0; r < R; r++) {
        if (src[r] >= 0) {
            assert_memory_equal(xp + r * D, x + src[r] * D, sizeof(float) * D);
        } else {
            padding++;
            for (int d = 0; d < D; d++) assert_true(xp[r * D + d] == 0.0f);
        }
    }
    assert_int_equal(padding, R - N * K);
    REF_OK(be->moe_unpermute(be, y, 0, xp, slot, w, N, K, D));
    for (int i = 0; i < N * D; i++) assert_true(y[i] == K * x[i]);
    free(idx), free(slot), free(src), free(x), free(xp), free(y), free(w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_router_selection_matches_brute_force),
        cmocka_unit_test(test_router_bias_changes_selection_not_weights),
        cmocka_unit_test(test_moe_index_is_deterministic_and_padded),
        cmocka_unit_test(test_permute_unpermute_round_trip),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
