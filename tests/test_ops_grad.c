/* test_ops_grad.c - every backward op of the CPU backend equals central finite
 * differences of its forward op.
 *
 * Each test builds a scalar loss L = sum R (.) y of a forward output y with
 * fixed random weights R, runs the backward op with dy = R, and compares each
 * input gradient with (L(x + eps) - L(x - eps)) / 2 eps, computed with the
 * forward op itself in fp32 (round_bf16 = 0) and the loss summed in double.
 * A gradient element passes when |fd - grad| <= atol + rtol * max(|fd|, |grad|);
 * each test states eps, rtol and atol. Linear ops use a large eps (no
 * truncation error), smooth non-linear ones eps = 1e-2 (truncation error
 * ~eps^2 ~ 1e-4 relative, fp32 noise of the loss / 2 eps ~ 1e-5).
 */
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
    if (mt_backend_cpu_create(&be, 2) != MT_OK) return -1;
    be->round_bf16 = 0;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    be->destroy(be);
    return 0;
}

/* ---- GEMM ------------------------------------------------------------------- */

typedef struct gemm_ctx {
    float *A, *B, *C, *R;
    int lda, ldb, ldc, ta, tb, M, N, K;
    float alpha;
} gemm_ctx;

static double gemm_loss(void *p)
{
    gemm_ctx *c = p;
    REF_OK(be->gemm(be, c->C, 0, c->ldc, c->A, c->lda, c->ta, c->B, c->ldb, c->tb, c->M, c->N,
                    c->K, c->alpha, 0));
    double s = 0;
    for (int m = 0; m < c->M; m++) s += ref_dot(c->C + m * c->ldc, c->R + m * c->ldc, c->N);
    return s;
}

/* C = alpha A op B with padded strides; dA and dB (same storage as A and B,
 * zero in the padding) come from the backward GEMMs:
 *   dA = alpha R B  (ta 0) or its transpose (ta 1),  dB = alpha R^T A likewise.
 * Linear in A and B: eps = 0.25, rtol = 1e-4, atol = 1e-4. */
static void test_gemm_grads_match_fd_all_transposes(void **state)
{
    (void)state;
    const int M = 5, N = 7, K = 9;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            gemm_ctx c = {.ta = ta, .tb = tb, .M = M, .N = N, .K = K, .alpha = 0.75f};
            c.lda = (ta ? M : K) + 2;
            c.ldb = (tb ? N : K) + 3;
            c.ldc = N + 1;
            int64_t na = (int64_t)(ta ? K : M) * c.lda, nb = (int64_t)(tb ? K : N) * c.ldb;
            c.A = ref_floats(na);
            c.B = ref_floats(nb);
            c.C = ref_floats((int64_t)M * c.ldc);
            c.R = ref_floats((int64_t)M * c.ldc);
            ref_fill_uniform(c.A, na, 11, -1, 1);
            ref_fill_uniform(c.B, nb, 12, -1, 1);
            ref_fill_uniform(c.R, (int64_t)M * c.ldc, 13, -1, 1);
            float *dA = ref_floats(na), *dB = ref_floats(nb);
            if (!ta) /* dA[m, k] = alpha sum_n R[m, n] B(n, k) */
                REF_OK(be->gemm(be, dA, 0, c.lda, c.R, c.ldc, 0, c.B, c.ldb, !tb, M, K, N,
                                c.alpha, 0));
            else /* dA[k, m] = alpha sum_n B(n, k) R[m, n] */
                REF_OK(be->gemm(be, dA, 0, c.lda, c.B, c.ldb, !tb, c.R, c.ldc, 0, K, M, N,
                                c.alpha, 0));
            if (!tb) /* dB[n, k] = alpha sum_m R[m, n] A(m, k) */
                REF_OK(be->gemm(be, dB, 0, c.ldb, c.R, c.ldc, 1, c.A, c.lda, !ta, N, K, M,
                                c.alpha, 0));
            else /* dB[k, n] = alpha sum_m A(m, k) R[m, n] */
                REF_OK(be->gemm(be, dB, 0, c.ldb, c.A, c.lda, !ta, c.R, c.ldc, 1, K, N, M,
                                c.alpha, 0));
            printf(" ta=%d tb=%d\n", ta, tb);
            assert_true(ref_fd_check("gemm dA", c.A, na, dA, gemm_loss, &c, 0.25, 1e-4, 1e-4, 0));
            assert_true(ref_fd_check("gemm dB", c.B, nb, dB, gemm_loss, &c, 0.25, 1e-4, 1e-4, 0));
            free(c.A), free(c.B), free(c.C), free(c.R), free(dA), free(dB);
        }
}

typedef struct grouped_ctx {
    float *A, *B, *C, *R;
    int lda, ldb, ldc, tb, N, K, G;
    int64_t b_stride;
    const int *rows;
} grouped_ctx;

static double grouped_loss(void *p)
{
    grouped_ctx *c = p;
    REF_OK(be->gemm_grouped(be, 0, c->C, 0, c->ldc, 0, c->A, c->lda, 0, c->B, c->ldb, c->tb,
                            c->b_stride, c->rows, c->G, c->N, c->K, 1.0f, 0));
    int M = 0;
    for (int g = 0; g < c->G; g++) M += c->rows[g];
    double s = 0;
    for (int m = 0; m < M; m++) s += ref_dot(c->C + m * c->ldc, c->R + m * c->ldc, c->N);
    return s;
}

/* Expert GEMM y[r_g + i] = x[r_g + i] W_g^T (W_g stored [N, K] or, tb, [K, N])
 * over segments {3, 0, 4, 2}: dx from gemm_grouped reduce = 0 (dx = dy W_g),
 * dW_g from reduce = 1 (dW_g = dy_g^T x_g; the empty segment's dW is 0).
 * Linear: eps = 0.25, rtol = 1e-4, atol = 1e-4. */
static void test_gemm_grouped_grads_match_fd_both_modes(void **state)
{
    (void)state;
    static const int rows[] = {3, 0, 4, 2};
    const int G = 4, M = 9, N = 5, K = 6;
    for (int tb = 0; tb < 2; tb++) {
        grouped_ctx c = {.lda = K + 1, .ldc = N + 2, .tb = tb, .N = N, .K = K, .G = G,
                         .rows = rows};
        c.ldb = (tb ? N : K) + 1;
        int64_t wsz = (int64_t)(tb ? K : N) * c.ldb;
        c.b_stride = wsz + 3;
        int64_t na = (int64_t)M * c.lda, nb = c.b_stride * G;
        c.A = ref_floats(na);
        c.B = ref_floats(nb);
        c.C = ref_floats((int64_t)M * c.ldc);
        c.R = ref_floats((int64_t)M * c.ldc);
        ref_fill_uniform(c.A, na, 21, -1, 1);
        ref_fill_uniform(c.B, nb, 22, -1, 1);
        ref_fill_uniform(c.R, (int64_t)M * c.ldc, 23, -1, 1);
        float *dA = ref_floats(na), *dB = ref_floats(nb);
        /* dx[r, k] = sum_n dy[r, n] W_g(n, k): B'(k, n) = W_g(n, k) flips tb */
        REF_OK(be->gemm_grouped(be, 0, dA, 0, c.lda, 0, c.R, c.ldc, 0, c.B, c.ldb, !tb,
                                c.b_stride, rows, G, K, N, 1.0f, 0));
        if (!tb) /* dW_g[n, k] = sum_i dy[r_g + i, n] x[r_g + i, k] */
            REF_OK(be->gemm_grouped(be, 1, dB, 1, c.ldb, c.b_stride, c.R, c.ldc, 0, c.A, c.lda,
                                    0, 0, rows, G, N, K, 1.0f, 0));
        else /* dW_g[k, n] = sum_i x[r_g + i, k] dy[r_g + i, n] */
            REF_OK(be->gemm_grouped(be, 1, dB, 1, c.ldb, c.b_stride, c.A, c.lda, 0, c.R, c.ldc,
                                    0, 0, rows, G, K, N, 1.0f, 0));
        printf(" tb=%d\n", tb);
        assert_true(ref_fd_check("grouped dx", c.A, na, dA, grouped_loss, &c, 0.25, 1e-4, 1e-4, 0));
        assert_true(ref_fd_check("grouped dW", c.B, nb, dB, grouped_loss, &c, 0.25, 1e-4, 1e-4, 0));
        free(c.A), free(c.B), free(c.C), free(c.R), free(dA), free(dB);
    }
}

/* ---- RMSNorm, SwiGLU, embedding --------------------------------------------- */

typedef struct norm_ctx {
    float *x, *w, *y, *rstd, *R;
    int M, D, ldx, ldy;
} norm_ctx;

static double norm_loss(void *p)
{
    norm_ctx *c = p;
    REF_OK(be->rmsnorm_fwd(be, c->y, c->ldy, c->rstd, c->x, c->ldx, c->w, c->M, c->D, 1e-5f));
    double s = 0;
    for (int m = 0; m < c->M; m++) s += ref_dot(c->y + m * c->ldy, c->R + m * c->ldy, c->D);
    return s;
}

/* dx (strided, = and += modes) and dw (+=) of y = x rstd w.
 * eps = 1e-2, rtol = 2e-3, atol = 1e-4. */
static void test_rmsnorm_grads_match_fd(void **state)
{
    (void)state;
    norm_ctx c = {.M = 4, .D = 10, .ldx = 13, .ldy = 11};
    c.x = ref_floats(c.M * c.ldx);
    c.w = ref_floats(c.D);
    c.y = ref_floats(c.M * c.ldy);
    c.R = ref_floats(c.M * c.ldy);
    c.rstd = ref_floats(c.M);
    ref_fill_uniform(c.x, c.M * c.ldx, 31, -2, 2);
    ref_fill_uniform(c.w, c.D, 32, 0.5f, 1.5f);
    ref_fill_uniform(c.R, c.M * c.ldy, 33, -1, 1);
    norm_loss(&c);
    const int lddx = 12;
    float *dx = ref_floats(c.M * lddx), *dw = ref_floats(c.D), *dxx = ref_floats(c.M * c.ldx);
    REF_OK(be->rmsnorm_bwd(be, dx, lddx, 0, dw, MT_C_F32, c.R, c.ldy, c.x, c.ldx, c.w, c.rstd, c.M, c.D));
    for (int m = 0; m < c.M; m++) memcpy(dxx + m * c.ldx, dx + m * lddx, sizeof(float) * c.D);
    assert_true(ref_fd_check("rmsnorm dx", c.x, c.M * c.ldx, dxx, norm_loss, &c, 1e-2, 2e-3,
                             1e-4, 0));
    assert_true(ref_fd_check("rmsnorm dw", c.w, c.D, dw, norm_loss, &c, 1e-2, 2e-3, 1e-4, 0));

    /* accumulate: dx += v (the same v), dw += the same sums again */
    float *dx2 = ref_dup(dx, c.M * lddx), *dw2 = ref_dup(dw, c.D);
    REF_OK(be->rmsnorm_bwd(be, dx2, lddx, 1, dw2, MT_C_F32, c.R, c.ldy, c.x, c.ldx, c.w, c.rstd, c.M, c.D));
    for (int m = 0; m < c.M; m++)
        for (int k = 0; k < c.D; k++) assert_true(dx2[m * lddx + k] == dx[m * lddx + k] * 2.0f);
    for (int k = 0; k < c.D; k++) assert_float_equal(dw2[k], 2 * dw[k], 1e-6 * fabs(dw[k]) + 1e-12);
    free(c.x), free(c.w), free(c.y), free(c.R), free(c.rstd), free(dx), free(dw), free(dxx);
    free(dx2), free(dw2);
}

typedef struct swiglu_ctx {
    float *gu, *h, *R;
    int M, F;
} swiglu_ctx;

static double swiglu_loss(void *p)
{
    swiglu_ctx *c = p;
    REF_OK(be->swiglu_fwd(be, c->h, c->gu, c->M, c->F));
    return ref_dot(c->h, c->R, c->M * c->F);
}

/* dgu of h = silu(g) u. eps = 1e-2, rtol = 2e-3, atol = 1e-4. */
static void test_swiglu_grads_match_fd(void **state)
{
    (void)state;
    swiglu_ctx c = {.M = 3, .F = 5};
    c.gu = ref_floats(c.M * 2 * c.F);
    c.h = ref_floats(c.M * c.F);
    c.R = ref_floats(c.M * c.F);
    ref_fill_uniform(c.gu, c.M * 2 * c.F, 41, -3, 3);
    ref_fill_uniform(c.R, c.M * c.F, 42, -1, 1);
    float *dgu = ref_floats(c.M * 2 * c.F);
    REF_OK(be->swiglu_bwd(be, dgu, c.R, c.gu, c.M, c.F));
    assert_true(ref_fd_check("swiglu dgu", c.gu, c.M * 2 * c.F, dgu, swiglu_loss, &c, 1e-2, 2e-3,
                             1e-4, 0));
    free(c.gu), free(c.h), free(c.R), free(dgu);
}

typedef struct emb_ctx {
    float *table, *y, *R;
    int32_t *ids;
    int M, D;
} emb_ctx;

static double emb_loss(void *p)
{
    emb_ctx *c = p;
    REF_OK(be->embedding_fwd(be, c->y, c->table, c->ids, c->M, c->D));
    return ref_dot(c->y, c->R, c->M * c->D);
}

/* dtable += scatter of dy by ids, with repeated ids and an unused row.
 * Linear: eps = 0.25, rtol = 1e-4, atol = 1e-5. */
static void test_embedding_grad_matches_fd(void **state)
{
    (void)state;
    static int32_t ids[] = {2, 0, 2, 5, 1, 2, 0, 3};
    const int V = 7, M = 8, D = 5;
    emb_ctx c = {.ids = ids, .M = M, .D = D};
    c.table = ref_floats(V * D);
    c.y = ref_floats(M * D);
    c.R = ref_floats(M * D);
    ref_fill_uniform(c.table, V * D, 51, -1, 1);
    ref_fill_uniform(c.R, M * D, 52, -1, 1);
    float *dt = ref_floats(V * D);
    REF_OK(be->embedding_bwd(be, dt, MT_C_F32, c.R, ids, M, D));
    assert_true(ref_fd_check("embedding dtable", c.table, V * D, dt, emb_loss, &c, 0.25, 1e-4,
                             1e-5, 0));
    free(c.table), free(c.y), free(c.R), free(dt);
}

/* ---- attention ------------------------------------------------------------------ */

typedef struct rope_ctx {
    float *x, *y, *R, *cs, *sn;
    int N, T, H, ld, hs, off, Rd, interleave;
} rope_ctx;

static double rope_loss(void *p)
{
    rope_ctx *c = p;
    memcpy(c->y, c->x, sizeof(float) * c->N * c->ld);
    REF_OK(be->rope(be, c->y, c->N, c->T, c->H, c->ld, c->hs, c->off, c->Rd, c->cs, c->sn,
                    c->interleave, 0));
    return ref_dot(c->y, c->R, c->N * c->ld);
}

/* rope is an orthogonal map, so its gradient is rope(inverse) of dy; checked
 * by finite differences over the whole strided buffer (untouched values pass
 * dy through) and by inverse(forward(x)) = x. Linear: eps = 0.25,
 * rtol = 1e-4, atol = 1e-5; round trip within 1e-6. */
static void test_rope_inverse_is_transpose(void **state)
{
    (void)state;
    for (int il = 0; il < 2; il++) {
        rope_ctx c = {.N = 6, .T = 3, .H = 2, .ld = 30, .hs = 12, .off = 2, .Rd = 8,
                      .interleave = il};
        int n = c.N * c.ld, half = c.Rd / 2;
        c.x = ref_floats(n);
        c.y = ref_floats(n);
        c.R = ref_floats(n);
        c.cs = ref_floats(c.T * half);
        c.sn = ref_floats(c.T * half);
        for (int t = 0; t < c.T; t++)
            for (int i = 0; i < half; i++) {
                double ang = (t + 0.5) * pow(10.0, -(double)i / half) * 1.3;
                c.cs[t * half + i] = (float)cos(ang);
                c.sn[t * half + i] = (float)sin(ang);
            }
        ref_fill_uniform(c.x, n, 61, -1, 1);
        ref_fill_uniform(c.R, n, 62, -1, 1);
        float *g = ref_dup(c.R, n);
        REF_OK(be->rope(be, g, c.N, c.T, c.H, c.ld, c.hs, c.off, c.Rd, c.cs, c.sn, il, 1));
        printf(" interleave=%d\n", il);
        assert_true(ref_fd_check("rope dx", c.x, n, g, rope_loss, &c, 0.25, 1e-4, 1e-5, 0));
        float *rt = ref_dup(c.x, n);
        REF_OK(be->rope(be, rt, c.N, c.T, c.H, c.ld, c.hs, c.off, c.Rd, c.cs, c.sn, il, 0));
        REF_OK(be->rope(be, rt, c.N, c.T, c.H, c.ld, c.hs, c.off, c.Rd, c.cs, c.sn, il, 1));
        for (int i = 0; i < n; i++) assert_float_equal(rt[i], c.x[i], 1e-6);
        free(c.x), free(c.y), free(c.R), free(c.cs), free(c.sn), free(g), free(rt);
    }
}

typedef struct attn_ctx {
    float *q, *k, *v, *o, *lse, *R;
    int B, T, H, Dqk, Dv;
    float scale;
} attn_ctx;

static double attn_loss(void *p)
{
    attn_ctx *c = p;
    REF_OK(be->attn_fwd(be, c->o, c->lse, c->q, c->k, c->v, c->B, c->T, c->H, c->Dqk, c->Dv,
                        c->scale));
    return ref_dot(c->o, c->R, (int64_t)c->B * c->T * c->H * c->Dv);
}

static attn_ctx attn_make(int B, int T, int H, int Dqk, int Dv, uint64_t seed)
{
    attn_ctx c = {.B = B, .T = T, .H = H, .Dqk = Dqk, .Dv = Dv, .scale = 0.45f};
    int64_t nq = (int64_t)B * T * H * Dqk, nv = (int64_t)B * T * H * Dv;
    c.q = ref_floats(nq);
    c.k = ref_floats(nq);
    c.v = ref_floats(nv);
    c.o = ref_floats(nv);
    c.R = ref_floats(nv);
    c.lse = ref_floats((int64_t)B * H * T);
    ref_fill_uniform(c.q, nq, seed, -1.5f, 1.5f);
    ref_fill_uniform(c.k, nq, seed + 1, -1.5f, 1.5f);
    ref_fill_uniform(c.v, nv, seed + 2, -1, 1);
    ref_fill_uniform(c.R, nv, seed + 3, -1, 1);
    return c;
}

static void attn_free(attn_ctx *c)
{
    free(c->q), free(c->k), free(c->v), free(c->o), free(c->R), free(c->lse);
}

/* o and lse against an fp64 evaluation of the definition; rel 1e-5. */
static void test_attention_forward_matches_fp64_reference(void **state)
{
    (void)state;
    attn_ctx c = attn_make(2, 7, 3, 5, 4, 70);
    attn_loss(&c);
    double worst = 0;
    for (int b = 0; b < c.B; b++)
        for (int h = 0; h < c.H; h++)
            for (int t = 0; t < c.T; t++) {
                double s[16], mx = -INFINITY, l = 0;
                const float *qt = c.q + ((b * c.T + t) * c.H + h) * c.Dqk;
                for (int u = 0; u <= t; u++) {
                    const float *ku = c.k + ((b * c.T + u) * c.H + h) * c.Dqk;
                    s[u] = c.scale * ref_dot(qt, ku, c.Dqk);
                    mx = fmax(mx, s[u]);
                }
                for (int u = 0; u <= t; u++) l += exp(s[u] - mx);
                double lse = mx + log(l);
                worst = fmax(worst, fabs(lse - c.lse[(b * c.H + h) * c.T + t]) / fabs(lse));
                for (int j = 0; j < c.Dv; j++) {
                    double o = 0;
                    for (int u = 0; u <= t; u++)
                        o += exp(s[u] - lse) * c.v[((b * c.T + u) * c.H + h) * c.Dv + j];
                    double got = c.o[((b * c.T + t) * c.H + h) * c.Dv + j];
                    assert_float_equal(got, o, 1e-5 * (1 + fabs(o)));
                }
            }
    assert_true(worst < 1e-5);
    attn_free(&c);
}

/* dq, dk, dv of causal attention with Dqk != Dv and two sequences.
 * eps = 1e-2, rtol = 2e-3, atol = 1e-4. */
static void test_attention_grads_match_fd(void **state)
{
    (void)state;
    attn_ctx c = attn_make(2, 5, 2, 6, 4, 71);
    int64_t nq = (int64_t)c.B * c.T * c.H * c.Dqk, nv = (int64_t)c.B * c.T * c.H * c.Dv;
    attn_loss(&c);
    float *dq = ref_floats(nq), *dk = ref_floats(nq), *dv = ref_floats(nv);
    REF_OK(be->attn_bwd(be, dq, dk, dv, c.R, c.q, c.k, c.v, c.o, c.lse, c.B, c.T, c.H, c.Dqk,
                        c.Dv, c.scale));
    assert_true(ref_fd_check("attention dq", c.q, nq, dq, attn_loss, &c, 1e-2, 2e-3, 1e-4, 0));
    assert_true(ref_fd_check("attention dk", c.k, nq, dk, attn_loss, &c, 1e-2, 2e-3, 1e-4, 0));
    assert_true(ref_fd_check("attention dv", c.v, nv, dv, attn_loss, &c, 1e-2, 2e-3, 1e-4, 0));
    free(dq), free(dk), free(dv);
    attn_free(&c);
}

typedef struct mla_ctx {
    float *kvb, *kpe, *k, *v, *Rk, *Rv;
    int N, H, Dn, R, Dv, ld;
} mla_ctx;

static double mla_loss(void *p)
{
    mla_ctx *c = p;
    REF_OK(be->mla_kv_fwd(be, c->k, c->v, c->kvb, c->kpe, c->ld, c->N, c->H, c->Dn, c->R, c->Dv));
    return ref_dot(c->k, c->Rk, c->N * c->H * (c->Dn + c->R)) +
           ref_dot(c->v, c->Rv, c->N * c->H * c->Dv);
}

/* dkvb and the head-summed dkpe (strided). Linear: eps = 0.25, rtol = 1e-4,
 * atol = 1e-5. */
static void test_mla_kv_grads_match_fd(void **state)
{
    (void)state;
    mla_ctx c = {.N = 3, .H = 2, .Dn = 3, .R = 2, .Dv = 4, .ld = 5};
    int nkvb = c.N * c.H * (c.Dn + c.Dv), nk = c.N * c.H * (c.Dn + c.R), nv = c.N * c.H * c.Dv;
    c.kvb = ref_floats(nkvb);
    c.kpe = ref_floats(c.N * c.ld);
    c.k = ref_floats(nk);
    c.v = ref_floats(nv);
    c.Rk = ref_floats(nk);
    c.Rv = ref_floats(nv);
    ref_fill_uniform(c.kvb, nkvb, 81, -1, 1);
    ref_fill_uniform(c.kpe, c.N * c.ld, 82, -1, 1);
    ref_fill_uniform(c.Rk, nk, 83, -1, 1);
    ref_fill_uniform(c.Rv, nv, 84, -1, 1);
    float *dkvb = ref_floats(nkvb), *dkpe = ref_floats(c.N * c.ld);
    REF_OK(be->mla_kv_bwd(be, dkvb, dkpe, c.ld, c.Rk, c.Rv, c.N, c.H, c.Dn, c.R, c.Dv));
    assert_true(ref_fd_check("mla dkvb", c.kvb, nkvb, dkvb, mla_loss, &c, 0.25, 1e-4, 1e-5, 0));
    assert_true(ref_fd_check("mla dkpe", c.kpe, c.N * c.ld, dkpe, mla_loss, &c, 0.25, 1e-4,
                             1e-5, 0));
    free(c.kvb), free(c.kpe), free(c.k), free(c.v), free(c.Rk), free(c.Rv), free(dkvb), free(dkpe);
}

/* ---- router and balance loss ------------------------------------------------------ */

typedef struct router_ctx {
    mt_router_cfg cfg;
    float *logits, *bias, *w, *scores, *Rw, *Rs;
    int32_t *idx, *idx0;
    int N, changed;
} router_ctx;

static double router_loss(void *p)
{
    router_ctx *c = p;
    int E = c->cfg.n_experts, K = c->cfg.top_k;
    REF_OK(be->router_fwd(be, c->idx, c->w, c->scores, c->logits, c->bias, c->N, &c->cfg));
    if (memcmp(c->idx, c->idx0, sizeof(int32_t) * c->N * K) != 0) c->changed = 1;
    double s = ref_dot(c->w, c->Rw, c->N * K);
    if (c->Rs) s += ref_dot(c->scores, c->Rs, c->N * E);
    return s;
}

/* Logits of each token: a random permutation of E values 4 / E apart in
 * [-2, 2] plus a little jitter, so that a perturbation of 1e-2 cannot change
 * which experts win. */
static void separated_logits(float *logits, int N, int E, uint64_t seed)
{
    int64_t perm[64];
    mt_rng r;
    mt_rng_seed(&r, seed);
    for (int n = 0; n < N; n++) {
        for (int e = 0; e < E; e++) perm[e] = e;
        mt_rng_shuffle_i64(&r, perm, E);
        for (int e = 0; e < E; e++)
            logits[n * E + e] = (float)(-2.0 + 4.0 * (perm[e] + 0.5) / E +
                                        0.2 / E * (mt_rng_uniform(&r) - 0.5));
    }
}

/* dlogits of sum w Rw (+ sum scores Rs) for sigmoid and softmax scoring,
 * grouped and ungrouped, normalised or not, with and without dscores. The
 * perturbation (eps = 1e-2 on logits) must not change the
 * selection, which is asserted. eps = 1e-2, rtol = 2e-3, atol = 2e-5. */
static void test_router_grads_match_fd(void **state)
{
    (void)state;
    const mt_router_cfg cfgs[] = {
        {8, 2, 4, 2, MT_SCORE_SIGMOID, 1, 1, 2.5f},
        {8, 3, 1, 1, MT_SCORE_SIGMOID, 0, 0, 1.5f},
        {8, 3, 1, 1, MT_SCORE_SOFTMAX, 0, 0, 1.0f},
        {16, 4, 4, 2, MT_SCORE_SOFTMAX, 1, 1, 1.0f},
    };
    for (int ci = 0; ci < 4; ci++)
        for (int with_ds = 0; with_ds < 2; with_ds++) {
            router_ctx c = {.cfg = cfgs[ci], .N = 4};
            int E = c.cfg.n_experts, K = c.cfg.top_k, N = c.N;
            c.logits = ref_floats(N * E);
            c.bias = ref_floats(E);
            c.w = ref_floats(N * K);
            c.scores = ref_floats(N * E);
            c.Rw = ref_floats(N * K);
            c.Rs = with_ds ? ref_floats(N * E) : NULL;
            c.idx = ref_alloc(sizeof(int32_t) * N * K);
            c.idx0 = ref_alloc(sizeof(int32_t) * N * K);
            separated_logits(c.logits, N, E, 90 + ci);
            /* sigmoid: a small bias (selection only); softmax: none */
            if (c.cfg.score_fn == MT_SCORE_SIGMOID) {
                ref_fill_uniform(c.bias, E, 95 + ci, -0.01f, 0.01f);
            } else {
                free(c.bias);
                c.bias = NULL;
            }
            ref_fill_uniform(c.Rw, N * K, 99, -1, 1);
            if (c.Rs) ref_fill_uniform(c.Rs, N * E, 98, -1, 1);
            REF_OK(be->router_fwd(be, c.idx0, c.w, c.scores, c.logits, c.bias, N, &c.cfg));
            float *dl = ref_floats(N * E);
            REF_OK(be->router_bwd(be, dl, c.Rw, c.Rs, c.scores, c.idx0, N, &c.cfg));
            printf(" cfg %d dscores=%d\n", ci, with_ds);
            assert_true(ref_fd_check("router dlogits", c.logits, N * E, dl, router_loss, &c, 1e-2,
                                     2e-3, 2e-5, 0));
            assert_false(c.changed);
            free(c.logits), free(c.bias), free(c.w), free(c.scores), free(c.Rw), free(c.Rs);
            free(c.idx), free(c.idx0), free(dl);
        }
}

typedef struct aux_ctx {
    mt_router_cfg cfg;
    float *scores;
    int32_t *idx;
    int B, T;
    float alpha;
} aux_ctx;

static double aux_loss_of(void *p)
{
    aux_ctx *c = p;
    float loss = 0;
    REF_OK(be->aux_loss(be, &loss, NULL, c->scores, c->idx, c->B, c->T, c->alpha, 1.0f, &c->cfg));
    return loss;
}

/* dscores = grad_scale * dloss/dscores of the sequence-wise balance loss; the
 * loss is added to what the output holds. eps = 1e-2, rtol = 2e-3, atol = 1e-6. */
static void test_aux_loss_grad_matches_fd(void **state)
{
    (void)state;
    aux_ctx c = {.cfg = {8, 2, 1, 1, MT_SCORE_SIGMOID, 1, 1, 1.0f}, .B = 2, .T = 4, .alpha = 0.3f};
    int N = c.B * c.T, E = 8, K = 2;
    float *logits = ref_floats(N * E), *w = ref_floats(N * K);
    c.scores = ref_floats(N * E);
    c.idx = ref_alloc(sizeof(int32_t) * N * K);
    ref_fill_uniform(logits, N * E, 111, -2, 2);
    REF_OK(be->router_fwd(be, c.idx, w, c.scores, logits, NULL, N, &c.cfg));
    const float gscale = 1.75f;
    float loss = 0.5f, *ds = ref_floats(N * E);
    REF_OK(be->aux_loss(be, &loss, ds, c.scores, c.idx, c.B, c.T, c.alpha, gscale, &c.cfg));
    assert_float_equal(loss - 0.5f, aux_loss_of(&c), 1e-6);
    for (int i = 0; i < N * E; i++) ds[i] /= gscale;
    assert_true(ref_fd_check("aux_loss dscores", c.scores, N * E, ds, aux_loss_of, &c, 1e-2, 2e-3,
                             1e-6, 0));
    free(logits), free(w), free(c.scores), free(c.idx), free(ds);
}

/* ---- MoE permutation ---------------------------------------------------------------- */

typedef struct perm_ctx {
    float *x, *xp, *Rp, *yp, *y, *Ry, *w;
    int32_t *src, *slot;
    int N, K, D, R;
} perm_ctx;

static double permute_loss(void *p)
{
    perm_ctx *c = p;
    REF_OK(be->moe_permute(be, c->xp, c->x, c->src, c->R, c->D));
    return ref_dot(c->xp, c->Rp, c->R * c->D);
}

static double unpermute_loss(void *p)
{
    perm_ctx *c = p;
    REF_OK(be->moe_unpermute(be, c->y, 0, c->yp, c->slot, c->w, c->N, c->K, c->D));
    return ref_dot(c->y, c->Ry, c->N * c->D);
}

/* permute's dx = moe_permute_bwd(dxp); unpermute's dyp and dw from
 * moe_unpermute_bwd (padding rows get zero gradient); accumulate modes add
 * exactly. Linear in each input: eps = 0.25, rtol = 1e-4, atol = 1e-5. */
static void test_moe_permute_grads_match_fd(void **state)
{
    (void)state;
    static const int32_t idx[] = {0, 2, 2, 3, 1, 0, 3, 2, 0, 1};
    perm_ctx c = {.N = 5, .K = 2, .D = 3};
    const int E = 4, align = 4;
    c.R = c.N * c.K + E * (align - 1);
    int32_t counts[4];
    int rows[4];
    c.src = ref_alloc(sizeof(int32_t) * c.R);
    c.slot = ref_alloc(sizeof(int32_t) * c.N * c.K);
    REF_OK(be->moe_index(be, c.slot, c.src, counts, rows, idx, c.N, c.K, E, align, c.R));
    int ND = c.N * c.D, RD = c.R * c.D;
    c.x = ref_floats(ND), c.xp = ref_floats(RD), c.Rp = ref_floats(RD);
    c.yp = ref_floats(RD), c.y = ref_floats(ND), c.Ry = ref_floats(ND);
    c.w = ref_floats(c.N * c.K);
    ref_fill_uniform(c.x, ND, 121, -1, 1);
    ref_fill_uniform(c.Rp, RD, 122, -1, 1);
    ref_fill_uniform(c.yp, RD, 123, -1, 1);
    ref_fill_uniform(c.Ry, ND, 124, -1, 1);
    ref_fill_uniform(c.w, c.N * c.K, 125, 0, 1);

    float *dx = ref_floats(ND);
    REF_OK(be->moe_permute_bwd(be, dx, 0, c.Rp, c.slot, c.N, c.K, c.D));
    assert_true(ref_fd_check("permute dx", c.x, ND, dx, permute_loss, &c, 0.25, 1e-4, 1e-5, 0));

    float *dyp = ref_floats(RD), *dw = ref_floats(c.N * c.K);
    ref_fill_uniform(dyp, RD, 126, 5, 6); /* stale values must be overwritten */
    REF_OK(be->moe_unpermute_bwd(be, dyp, dw, c.Ry, c.yp, c.slot, c.w, c.N, c.K, c.D, c.R));
    assert_true(ref_fd_check("unpermute dyp", c.yp, RD, dyp, unpermute_loss, &c, 0.25, 1e-4,
                             1e-5, 0));
    assert_true(ref_fd_check("unpermute dw", c.w, c.N * c.K, dw, unpermute_loss, &c, 0.25, 1e-4,
                             1e-5, 0));

    /* accumulate: base + the same fp32 sum */
    float *dx2 = ref_dup(dx, ND), *y2 = ref_floats(ND);
    REF_OK(be->moe_permute_bwd(be, dx2, 1, c.Rp, c.slot, c.N, c.K, c.D));
    unpermute_loss(&c);
    memcpy(y2, c.y, sizeof(float) * ND);
    REF_OK(be->moe_unpermute(be, y2, 1, c.yp, c.slot, c.w, c.N, c.K, c.D));
    for (int i = 0; i < ND; i++) {
        assert_true(dx2[i] == 2.0f * dx[i]);
        assert_true(y2[i] == 2.0f * c.y[i]);
    }
    free(c.x), free(c.xp), free(c.Rp), free(c.yp), free(c.y), free(c.Ry), free(c.w);
    free(c.src), free(c.slot), free(dx), free(dyp), free(dw), free(dx2), free(y2);
}

/* ---- cross-entropy ------------------------------------------------------------------ */

typedef struct xent_ctx {
    float *logits, *work, *loss;
    int32_t *tgt;
    int M, V;
    float gscale;
} xent_ctx;

static double xent_loss(void *p)
{
    xent_ctx *c = p;
    memcpy(c->work, c->logits, sizeof(float) * c->M * c->V);
    REF_OK(be->xent(be, c->loss, c->work, c->tgt, c->M, c->V, -100, c->gscale));
    double s = 0;
    for (int m = 0; m < c->M; m++) s += c->loss[m];
    return c->gscale * s;
}

/* The in-place gradient grad_scale (softmax - onehot) against differences of
 * grad_scale * sum of the losses; an ignored row has loss 0 and a zero
 * gradient. eps = 1e-2, rtol = 2e-3, atol = 1e-5. */
static void test_xent_grad_matches_fd(void **state)
{
    (void)state;
    static int32_t tgt[] = {3, -100, 0, 6};
    xent_ctx c = {.tgt = tgt, .M = 4, .V = 7, .gscale = 0.5f};
    c.logits = ref_floats(c.M * c.V);
    c.work = ref_floats(c.M * c.V);
    c.loss = ref_floats(c.M);
    ref_fill_uniform(c.logits, c.M * c.V, 131, -3, 3);
    xent_loss(&c);
    float *g = ref_dup(c.work, c.M * c.V);
    assert_true(c.loss[1] == 0.0f);
    for (int j = 0; j < c.V; j++) assert_true(g[c.V + j] == 0.0f);
    /* loss of row 0 against fp64 */
    double mx = -INFINITY, s = 0;
    for (int j = 0; j < c.V; j++) mx = fmax(mx, c.logits[j]);
    for (int j = 0; j < c.V; j++) s += exp(c.logits[j] - mx);
    assert_float_equal(c.loss[0], mx + log(s) - c.logits[3], 1e-6);
    assert_true(ref_fd_check("xent dlogits", c.logits, c.M * c.V, g, xent_loss, &c, 1e-2, 2e-3,
                             1e-5, 0));
    free(c.logits), free(c.work), free(c.loss), free(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemm_grads_match_fd_all_transposes),
        cmocka_unit_test(test_gemm_grouped_grads_match_fd_both_modes),
        cmocka_unit_test(test_rmsnorm_grads_match_fd),
        cmocka_unit_test(test_swiglu_grads_match_fd),
        cmocka_unit_test(test_embedding_grad_matches_fd),
        cmocka_unit_test(test_rope_inverse_is_transpose),
        cmocka_unit_test(test_attention_forward_matches_fp64_reference),
        cmocka_unit_test(test_attention_grads_match_fd),
        cmocka_unit_test(test_mla_kv_grads_match_fd),
        cmocka_unit_test(test_router_grads_match_fd),
        cmocka_unit_test(test_aux_loss_grad_matches_fd),
        cmocka_unit_test(test_moe_permute_grads_match_fd),
        cmocka_unit_test(test_xent_grad_matches_fd),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
