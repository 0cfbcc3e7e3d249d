/* cpu_moe.c - router (scores, group-limited top-k, weights) and its backward,
 * the sequence-wise balance loss, the expert-major index and the token
 * permutation to and from expert order.
 *
 * Permuted layout (moe_index): expert e's rows start at
 *   start[e] = sum_{e' < e} host_rows[e'],  host_rows[e] = ceil(counts[e] / align) * align,
 * so every segment start is a multiple of align. Inside a segment the first
 * counts[e] rows hold the assignments (n, k) with idx[n, k] = e in increasing
 * order of n (stable counting sort, so the layout is deterministic); the
 * remaining rows up to host_rows[e] are padding (src = -1), as are the rows
 * from sum_e host_rows[e] up to R_cap. */
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_impl.h"

/* Added to the normaliser of the top-k weights, as the reference
 * implementation (Hugging Face DeepSeek-V3) does: keeps all-zero sigmoid
 * scores from producing NaN. */
#define ROUTER_NORM_EPS 1e-20f

static int router_check(const char *op, const mt_router_cfg *c)
{
    CPU_REQUIRE(c != NULL, "%s: cfg is NULL", op);
    int E = c->n_experts, G = c->n_group;
    CPU_REQUIRE(E >= 1 && c->top_k >= 1 && c->top_k <= E, "%s: n_experts=%d top_k=%d", op, E,
                c->top_k);
    CPU_REQUIRE(c->score_fn == MT_SCORE_SIGMOID || c->score_fn == MT_SCORE_SOFTMAX,
                "%s: score_fn=%d unknown", op, (int)c->score_fn);
    CPU_REQUIRE(G >= 1 && E % G == 0, "%s: n_group=%d must divide n_experts=%d", op, G, E);
    if (G > 1)
        CPU_REQUIRE(c->topk_group >= 1 && c->topk_group <= G &&
                        c->top_k <= c->topk_group * (E / G),
                    "%s: topk_group=%d of n_group=%d cannot hold top_k=%d", op, c->topk_group,
                    G, c->top_k);
    return MT_OK;
}

static void router_scores(const mt_router_cfg *c, float *s, const float *logits)
{
    int E = c->n_experts;
    if (c->score_fn == MT_SCORE_SIGMOID) {
        for (int e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-logits[e]));
        return;
    }
    float mx = logits[0];
    for (int e = 1; e < E; e++) mx = fmaxf(mx, logits[e]);
    double sum = 0;
    for (int e = 0; e < E; e++) {
        s[e] = expf(logits[e] - mx);
        sum += s[e];
    }
    for (int e = 0; e < E; e++) s[e] = (float)(s[e] / sum);
}

/* Group score: sum of the group's two largest biased scores (group_by_top2,
 * groups of at least two) or its largest. */
static float group_score(const mt_router_cfg *c, const float *b, int n)
{
    float m1 = -INFINITY, m2 = -INFINITY;
    for (int e = 0; e < n; e++) {
        if (b[e] > m1) {
            m2 = m1;
            m1 = b[e];
        } else if (b[e] > m2) {
            m2 = b[e];
        }
    }
    return c->group_by_top2 && n >= 2 ? m1 + m2 : m1;
}

/* Index of the largest v[i] among i < n with ok[i]; ties to the lower index.
 * Returns -1 if none is allowed. */
static int argmax_allowed(const float *v, const unsigned char *ok, int n)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (ok[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* Selection of one token: idx[K] from biased scores b[E]. Scratch: gsc
 * [n_group] group scores, ok [E] and gok [n_group] masks of what may still
 * be chosen. */
static void router_select(const mt_router_cfg *c, const float *b, int32_t *idx, float *gsc,
                          unsigned char *ok, unsigned char *gok)
{
    int E = c->n_experts, G = c->n_group, gs = E / G;
    if (G > 1) {
        for (int g = 0; g < G; g++) {
            gsc[g] = group_score(c, b + g * gs, gs);
            gok[g] = 1;
        }
        memset(ok, 0, (size_t)E);
        for (int i = 0; i < c->topk_group; i++) {
            int g = argmax_allowed(gsc, gok, G);
            gok[g] = 0;
            memset(ok + g * gs, 1, (size_t)gs);
        }
    } else {
        memset(ok, 1, (size_t)E);
    }
    for (int k = 0; k < c->top_k; k++) {
        int e = argmax_allowed(b, ok, E);
        ok[e] = 0;
        idx[k] = e;
    }
}

/* w[k] = s[idx[k]] (/ (sum + eps) if norm_topk) * scaling. */
static void router_weights(const mt_router_cfg *c, const float *s, const int32_t *idx, float *w)
{
    float den = 0.0f;
    for (int k = 0; k < c->top_k; k++) den += s[idx[k]];
    den += ROUTER_NORM_EPS;
    for (int k = 0; k < c->top_k; k++)
        w[k] = c->norm_topk ? s[idx[k]] / den * c->scaling : s[idx[k]] * c->scaling;
}

static int cpu_router_fwd(mt_backend *be, int32_t *idx, float *w, float *scores,
                          const float *logits, const float *bias, int N, const mt_router_cfg *cfg)
{
    MT_CHECK(router_check("router_fwd", cfg));
    CPU_REQUIRE(N >= 0, "router_fwd: N=%d", N);
    if (N == 0) return MT_OK;
    CPU_REQUIRE(idx && w && scores && logits, "router_fwd: NULL pointer");
    int E = cfg->n_experts, K = cfg->top_k, G = cfg->n_group;
    int nt = cpu_team(be, (int64_t)N * E * (K + 4));
    size_t per = (size_t)(E + G) * sizeof(float) + (size_t)(E + G) + 64;
    per = (per + 63) / 64 * 64;
    unsigned char *mem = cpu_scratch(per * (size_t)nt);
    if (!mem) return MT_ERR(MT_ENOMEM, "router_fwd: out of memory");
#pragma omp parallel for num_threads(nt)
    for (int n = 0; n < N; n++) {
        unsigned char *ws = mem + per * (size_t)cpu_thread_id();
        float *b = (float *)ws, *gsc = b + E;
        unsigned char *ok = (unsigned char *)(gsc + G), *gok = ok + E;
        float *s = scores + (int64_t)n * E;
        router_scores(cfg, s, logits + (int64_t)n * E);
        for (int e = 0; e < E; e++) b[e] = bias ? s[e] + bias[e] : s[e];
        router_select(cfg, b, idx + (int64_t)n * K, gsc, ok, gok);
        router_weights(cfg, s, idx + (int64_t)n * K, w + (int64_t)n * K);
    }
    free(mem);
    return MT_OK;
}

/* dlogits of one token; gs [E] double scratch. */
static void router_bwd_token(const mt_router_cfg *c, float *dl, const float *dw,
                             const float *dscores, const float *s, const int32_t *idx,
                             double *gs)
{
    int E = c->n_experts, K = c->top_k;
    for (int e = 0; e < E; e++) gs[e] = dscores ? dscores[e] : 0.0;
    if (c->norm_topk) {
        /* w_k = scaling * s_k / den, den = sum_j s_j + eps */
        float den = 0.0f;
        for (int k = 0; k < K; k++) den += s[idx[k]];
        double d = (double)den + ROUTER_NORM_EPS, dot = 0;
        for (int k = 0; k < K; k++) dot += (double)dw[k] * s[idx[k]];
        for (int k = 0; k < K; k++) gs[idx[k]] += c->scaling * (dw[k] / d - dot / (d * d));
    } else {
        for (int k = 0; k < K; k++) gs[idx[k]] += (double)c->scaling * dw[k];
    }
    if (c->score_fn == MT_SCORE_SIGMOID) {
        for (int e = 0; e < E; e++) dl[e] = (float)(gs[e] * s[e] * (1.0 - s[e]));
    } else {
        double dot = 0;
        for (int e = 0; e < E; e++) dot += gs[e] * s[e];
        for (int e = 0; e < E; e++) dl[e] = (float)(s[e] * (gs[e] - dot));
    }
}

static int cpu_router_bwd(mt_backend *be, float *dlogits, const float *dw, const float *dscores,
                          const float *scores, const int32_t *idx, int N,
                          const mt_router_cfg *cfg)
{
    MT_CHECK(router_check("router_bwd", cfg));
    CPU_REQUIRE(N >= 0, "router_bwd: N=%d", N);
    if (N == 0) return MT_OK;
    CPU_REQUIRE(dlogits && dw && scores && idx, "router_bwd: NULL pointer");
    int E = cfg->n_experts, K = cfg->top_k;
    for (int64_t i = 0; i < (int64_t)N * K; i++)
        CPU_REQUIRE(idx[i] >= 0 && idx[i] < E, "router_bwd: idx[%lld]=%d out of [0, %d)",
                    (long long)i, (int)idx[i], E);
    int nt = cpu_team(be, (int64_t)N * E * 4);
    double *mem = cpu_scratch(sizeof(double) * (size_t)E * nt);
    if (!mem) return MT_ERR(MT_ENOMEM, "router_bwd: out of memory");
#pragma omp parallel for num_threads(nt)
    for (int n = 0; n < N; n++) {
        int64_t o = (int64_t)n * E;
        router_bwd_token(cfg, dlogits + o, dw + (int64_t)n * K, dscores ? dscores + o : NULL,
                         scores + o, idx + (int64_t)n * K, mem + (size_t)E * cpu_thread_id());
    }
    free(mem);
    return MT_OK;
}

/* Balance loss of sequence b; writes its dscores rows (if any) and returns
 * L_b. f [E], p [E] double scratch. */
static double aux_loss_seq(const mt_router_cfg *c, float *dscores, const float *scores,
                           const int32_t *idx, int T, double gscale, double *f, double *p)
{
    int E = c->n_experts, K = c->top_k;
    for (int e = 0; e < E; e++) f[e] = p[e] = 0;
    for (int t = 0; t < T; t++) {
        for (int k = 0; k < K; k++) f[idx[(int64_t)t * K + k]] += 1;
        const float *s = scores + (int64_t)t * E;
        double sum = 0;
        for (int e = 0; e < E; e++) sum += s[e];
        for (int e = 0; e < E; e++) p[e] += s[e] / sum;
    }
    double L = 0;
    for (int e = 0; e < E; e++) {
        f[e] *= (double)E / ((double)K * T);
        p[e] /= T;
        L += f[e] * p[e];
    }
    if (!dscores) return L;
    /* dL/ds(t, j) = (f_j - sum_i f_i s'(t, i)) / (T S_t) */
    for (int t = 0; t < T; t++) {
        const float *s = scores + (int64_t)t * E;
        double sum = 0, fs = 0;
        for (int e = 0; e < E; e++) sum += s[e];
        for (int e = 0; e < E; e++) fs += f[e] * s[e] / sum;
        for (int e = 0; e < E; e++)
            dscores[(int64_t)t * E + e] = (float)(gscale * (f[e] - fs) / (T * sum));
    }
    return L;
}

static int cpu_aux_loss(mt_backend *be, float *loss, float *dscores, const float *scores,
                        const int32_t *idx, int B, int T, float alpha, float grad_scale,
                        const mt_router_cfg *cfg)
{
    MT_CHECK(router_check("aux_loss", cfg));
    CPU_REQUIRE(B >= 1 && T >= 1, "aux_loss: B=%d T=%d", B, T);
    CPU_REQUIRE(loss && scores && idx, "aux_loss: NULL pointer");
    int E = cfg->n_experts, K = cfg->top_k;
    for (int64_t i = 0; i < (int64_t)B * T * K; i++)
        CPU_REQUIRE(idx[i] >= 0 && idx[i] < E, "aux_loss: idx[%lld]=%d out of [0, %d)",
                    (long long)i, (int)idx[i], E);
    double *mem = malloc(sizeof(double) * ((size_t)B + 2 * (size_t)E * B));
    if (!mem) return MT_ERR(MT_ENOMEM, "aux_loss: out of memory");
    double *Lb = mem, gscale = (double)grad_scale * alpha / B;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)B * T * E))
    for (int b = 0; b < B; b++) {
        int64_t o = (int64_t)b * T;
        double *f = mem + B + (size_t)2 * E * b;
        Lb[b] = aux_loss_seq(cfg, dscores ? dscores + o * E : NULL, scores + o * E,
                             idx + o * K, T, gscale, f, f + E);
    }
    double L = 0;
    for (int b = 0; b < B; b++) L += Lb[b];
    loss[0] = (float)((double)loss[0] + (double)alpha * L / B);
    free(mem);
    return MT_OK;
}

static int cpu_moe_index(mt_backend *be, int32_t *slot, int32_t *src, int32_t *counts,
                         int *host_rows, const int32_t *idx, int N, int K, int E, int align,
                         int R_cap)
{
    (void)be;
    CPU_REQUIRE(N >= 0 && K >= 1 && E >= 1 && align >= 1, "moe_index: N=%d K=%d E=%d align=%d",
                N, K, E, align);
    int64_t need = (int64_t)N * K + (int64_t)E * (align - 1);
    CPU_REQUIRE(R_cap >= need, "moe_index: R_cap=%d < N*K + E*(align-1) = %lld", R_cap,
                (long long)need);
    CPU_REQUIRE(src && counts && host_rows && (N == 0 || (slot && idx)),
                "moe_index: NULL pointer");
    int64_t NK = (int64_t)N * K;
    for (int64_t a = 0; a < NK; a++)
        CPU_REQUIRE(idx[a] >= 0 && idx[a] < E, "moe_index: idx[%lld]=%d out of [0, %d)",
                    (long long)a, (int)idx[a], E);
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)E);
    if (!fill) return MT_ERR(MT_ENOMEM, "moe_index: out of memory");
    for (int e = 0; e < E; e++) counts[e] = 0;
    for (int64_t a = 0; a < NK; a++) counts[idx[a]]++;
    int64_t start = 0;
    for (int e = 0; e < E; e++) {
        host_rows[e] = mt_ceil_div(counts[e], align) * align;
        fill[e] = start;
        start += host_rows[e];
    }
    for (int r = 0; r < R_cap; r++) src[r] = -1;
    for (int64_t a = 0; a < NK; a++) {
        int64_t r = fill[idx[a]]++;
        slot[a] = (int32_t)r;
        src[r] = (int32_t)(a / K);
    }
    free(fill);
    return MT_OK;
}

static int cpu_moe_permute(mt_backend *be, void *xp, const void *x, const int32_t *src, int R,
                           int D)
{
    CPU_REQUIRE(R >= 0 && D >= 1, "moe_permute: R=%d D=%d", R, D);
    if (R == 0) return MT_OK;
    CPU_REQUIRE(xp && src && x, "moe_permute: NULL pointer");
    float *y = xp;
    const float *xf = x;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)R * D))
    for (int r = 0; r < R; r++) {
        float *dst = y + (int64_t)r * D;
        if (src[r] < 0) {
            memset(dst, 0, sizeof(float) * (size_t)D);
            continue;
        }
        const float *s = xf + (int64_t)src[r] * D;
        for (int d = 0; d < D; d++) dst[d] = cpu_act(be, s[d]);
    }
    return MT_OK;
}

static int check_slots(const char *op, const int32_t *slot, int64_t n, int64_t R)
{
    for (int64_t a = 0; a < n; a++)
        CPU_REQUIRE(slot[a] >= 0 && slot[a] < R, "%s: slot[%lld]=%d out of range", op,
                    (long long)a, (int)slot[a]);
    return MT_OK;
}

/* y[n] (= or +=) sum_k w[n, k] * yp[slot[n, k]] (w NULL: weights 1), summed
 * over k in order in fp32. */
static void gather_rows(const mt_backend *be, float *y, int accumulate, const float *yp,
                        const int32_t *slot, const float *w, int N, int K, int D)
{
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)N * K * D))
    for (int n = 0; n < N; n++) {
        const int32_t *sl = slot + (int64_t)n * K;
        float *yr = y + (int64_t)n * D;
        for (int d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) {
                float v = yp[(int64_t)sl[k] * D + d];
                acc += w ? w[(int64_t)n * K + k] * v : v;
            }
            yr[d] = cpu_act(be, accumulate ? yr[d] + acc : acc);
        }
    }
}

static int cpu_moe_permute_bwd(mt_backend *be, void *dx, int accumulate, const void *dxp,
                               const int32_t *slot, int N, int K, int D)
{
    CPU_REQUIRE(N >= 0 && K >= 1 && D >= 1, "moe_permute_bwd: N=%d K=%d D=%d", N, K, D);
    if (N == 0) return MT_OK;
    CPU_REQUIRE(dx && dxp && slot, "moe_permute_bwd: NULL pointer");
    MT_CHECK(check_slots("moe_permute_bwd", slot, (int64_t)N * K, INT32_MAX));
    gather_rows(be, dx, accumulate, dxp, slot, NULL, N, K, D);
    return MT_OK;
}

static int cpu_moe_unpermute(mt_backend *be, void *y, int accumulate, const void *yp,
                             const int32_t *slot, const float *w, int N, int K, int D)
{
    CPU_REQUIRE(N >= 0 && K >= 1 && D >= 1, "moe_unpermute: N=%d K=%d D=%d", N, K, D);
    if (N == 0) return MT_OK;
    CPU_REQUIRE(y && yp && slot && w, "moe_unpermute: NULL pointer");
    MT_CHECK(check_slots("moe_unpermute", slot, (int64_t)N * K, INT32_MAX));
    gather_rows(be, y, accumulate, yp, slot, w, N, K, D);
    return MT_OK;
}

static int cpu_moe_unpermute_bwd(mt_backend *be, void *dyp, float *dw, const void *dy,
                                 const void *yp, const int32_t *slot, const float *w, int N,
                                 int K, int D, int R)
{
    CPU_REQUIRE(N >= 0 && K >= 1 && D >= 1 && R >= 0, "moe_unpermute_bwd: N=%d K=%d D=%d R=%d",
                N, K, D, R);
    if (R > 0) CPU_REQUIRE(dyp != NULL, "moe_unpermute_bwd: dyp is NULL");
    if (N > 0) CPU_REQUIRE(dw && dy && yp && slot && w, "moe_unpermute_bwd: NULL pointer");
    MT_CHECK(check_slots("moe_unpermute_bwd", slot, (int64_t)N * K, R));
    float *g = dyp;
    const float *dyf = dy, *ypf = yp;
    if (R > 0) memset(g, 0, sizeof(float) * (size_t)R * D);
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)N * K * D))
    for (int n = 0; n < N; n++) {
        const float *d = dyf + (int64_t)n * D;
        for (int k = 0; k < K; k++) {
            int64_t a = (int64_t)n * K + k, r = slot[a];
            float *gr = g + r * D;
            for (int j = 0; j < D; j++) gr[j] = cpu_act(be, w[a] * d[j]);
            dw[a] = (float)cpu_dot_f64(d, ypf + r * D, D);
        }
    }
    return MT_OK;
}

/* FP8 wire rows (ops.h): KB float scales, then D e4m3 values (padded). */
static int cpu_moe_pack_fp8(mt_backend *be, uint8_t *wire, const uint8_t *q, const float *s,
                            const int32_t *src, int N, int R, int D)
{
    CPU_REQUIRE(R >= 0 && N >= 0 && D >= 1, "moe_pack_fp8: N=%d R=%d D=%d", N, R, D);
    if (R == 0) return MT_OK;
    CPU_REQUIRE(wire && q && s && src, "moe_pack_fp8: NULL pointer");
    const int KB = (D + 127) / 128;
    const size_t W = mt_fp8_wire_row_bytes(D);
    for (int r = 0; r < R; r++)
        CPU_REQUIRE(src[r] >= 0 && src[r] < N, "moe_pack_fp8: src[%d]=%d outside [0, %d)", r,
                    src[r], N);
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)R * D))
    for (int r = 0; r < R; r++) {
        uint8_t *row = wire + (size_t)r * W;
        const int64_t t = src[r];
        for (int kb = 0; kb < KB; kb++) memcpy(row + 4 * kb, &s[(int64_t)kb * N + t], 4);
        memcpy(row + 4 * KB, q + t * D, (size_t)D);
        memset(row + 4 * KB + D, 0, W - 4 * (size_t)KB - (size_t)D);
    }
    return MT_OK;
}

static int cpu_moe_unpack_fp8(mt_backend *be, uint8_t *q, float *s, void *x, const uint8_t *wire,
                              const int32_t *info, int M, int D)
{
    CPU_REQUIRE(M >= 0 && D >= 1, "moe_unpack_fp8: M=%d D=%d", M, D);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(q && s && x && wire && info, "moe_unpack_fp8: NULL pointer");
    const int KB = (D + 127) / 128;
    const size_t W = mt_fp8_wire_row_bytes(D);
    float *xf = x;
    float val[256]; /* every e4m3 code's value: ldexpf per element is slow */
    for (int i = 0; i < 256; i++) val[i] = mt_e4m3_to_f32((uint8_t)i);
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)M * D))
    for (int j = 0; j < M; j++) {
        const int32_t wr = info[3 * j], base = info[3 * j + 1], stride = info[3 * j + 2];
        uint8_t *qj = q + (int64_t)j * D;
        float *xj = xf + (int64_t)j * D;
        if (wr < 0) {
            memset(qj, 0, (size_t)D);
            for (int kb = 0; kb < KB; kb++) s[base + (int64_t)kb * stride] = 1.0f;
            memset(xj, 0, sizeof(float) * (size_t)D);
            continue;
        }
        const uint8_t *row = wire + (size_t)wr * W;
        memcpy(qj, row + 4 * KB, (size_t)D);
        for (int kb = 0; kb < KB; kb++) {
            float v;
            memcpy(&v, row + 4 * kb, 4);
            s[base + (int64_t)kb * stride] = v;
            const int k1 = (kb + 1) * 128 < D ? (kb + 1) * 128 : D;
            for (int k = kb * 128; k < k1; k++) xj[k] = cpu_act(be, val[qj[k]] * v);
        }
    }
    return MT_OK;
}

void cpu_install_moe(mt_backend *be)
{
    be->moe_pack_fp8 = cpu_moe_pack_fp8;
    be->moe_unpack_fp8 = cpu_moe_unpack_fp8;
    be->router_fwd = cpu_router_fwd;
    be->router_bwd = cpu_router_bwd;
    be->aux_loss = cpu_aux_loss;
    be->moe_index = cpu_moe_index;
    be->moe_permute = cpu_moe_permute;
    be->moe_permute_bwd = cpu_moe_permute_bwd;
    be->moe_unpermute = cpu_moe_unpermute;
    be->moe_unpermute_bwd = cpu_moe_unpermute_bwd;
}
