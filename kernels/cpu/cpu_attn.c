/* cpu_attn.c - rotary embedding, causal softmax attention (forward and
 * backward) and MLA key/value assembly.
 *
 * Attention runs one (sequence, head) pair per work item. Keys are copied
 * transposed ([D][T]) so that the scores of one query are computed with the
 * inner loop over keys and the outputs with the inner loop over features:
 * both vectorise without reassociating any sum, so every value is a fixed
 * sequential sum (features in order for scores, keys in order for outputs,
 * queries in order for dk and dv). */
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_impl.h"

static int cpu_rope(mt_backend *be, void *x, int N, int T, int H, int ld, int hs, int off, int R,
                    const float *cos_t, const float *sin_t, int interleave, int inverse)
{
    CPU_REQUIRE(N >= 0 && T >= 1 && H >= 1, "rope: N=%d T=%d H=%d", N, T, H);
    CPU_REQUIRE(R >= 2 && R % 2 == 0, "rope: R=%d must be even and >= 2", R);
    CPU_REQUIRE(off >= 0 && hs >= 0 && ld >= 1, "rope: ld=%d hs=%d off=%d", ld, hs, off);
    if (N == 0) return MT_OK;
    CPU_REQUIRE(x && cos_t && sin_t, "rope: NULL pointer");
    float *xf = x;
    int half = R / 2;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)N * H * R))
    for (int n = 0; n < N; n++) {
        const float *c = cos_t + (int64_t)(n % T) * half, *s = sin_t + (int64_t)(n % T) * half;
        for (int h = 0; h < H; h++) {
            float *p = xf + (int64_t)n * ld + (int64_t)h * hs + off;
            for (int i = 0; i < half; i++) {
                int a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + half;
                float x0 = p[a], x1 = p[b], sn = inverse ? -s[i] : s[i];
                p[a] = cpu_act(be, x0 * c[i] - x1 * sn);
                p[b] = cpu_act(be, x0 * sn + x1 * c[i]);
            }
        }
    }
    return MT_OK;
}

/* Shape of one attention call and the row addressing of [B*T, H, D] tensors. */
typedef struct attn_dims {
    int B, T, H, Dqk, Dv;
    float scale;
} attn_dims;

static inline int64_t row_qk(const attn_dims *a, int b, int t, int h)
{
    return (((int64_t)b * a->T + t) * a->H + h) * a->Dqk;
}

static inline int64_t row_v(const attn_dims *a, int b, int t, int h)
{
    return (((int64_t)b * a->T + t) * a->H + h) * a->Dv;
}

static int attn_check(const char *op, const attn_dims *a)
{
    CPU_REQUIRE(a->B >= 0 && a->T >= 1 && a->H >= 1 && a->Dqk >= 1 && a->Dv >= 1,
                "%s: B=%d T=%d H=%d Dqk=%d Dv=%d", op, a->B, a->T, a->H, a->Dqk, a->Dv);
    return MT_OK;
}

/* kt [Dqk][T] = keys of pair (b, h) transposed; kc [T][Dqk] (optional) and
 * vt [Dv][T] / vc [T][Dv] (optional) likewise. */
static void attn_gather(const attn_dims *a, int b, int h, const float *k, const float *v,
                        float *kt, float *kc, float *vt, float *vc)
{
    int T = a->T;
    for (int u = 0; u < T; u++) {
        const float *kr = k + row_qk(a, b, u, h), *vr = v + row_v(a, b, u, h);
        for (int d = 0; d < a->Dqk; d++) kt[(int64_t)d * T + u] = kr[d];
        if (kc) memcpy(kc + (int64_t)u * a->Dqk, kr, sizeof(float) * (size_t)a->Dqk);
        if (vt)
            for (int j = 0; j < a->Dv; j++) vt[(int64_t)j * T + u] = vr[j];
        if (vc) memcpy(vc + (int64_t)u * a->Dv, vr, sizeof(float) * (size_t)a->Dv);
    }
}

/* s[u] = scale * (q . k_u) for u <= t, features summed in order. */
static void attn_scores(const attn_dims *a, const float *q, const float *kt, int t, float *s)
{
    int T = a->T;
    for (int u = 0; u <= t; u++) s[u] = 0.0f;
    for (int d = 0; d < a->Dqk; d++) {
        float qd = q[d];
        const float *kr = kt + (int64_t)d * T;
        for (int u = 0; u <= t; u++) s[u] += qd * kr[u];
    }
    for (int u = 0; u <= t; u++) s[u] *= a->scale;
}

static void attn_fwd_pair(const mt_backend *be, const attn_dims *a, int b, int h, float *o,
                          float *lse, const float *q, const float *k, const float *v, float *w)
{
    int T = a->T, Dv = a->Dv;
    float *kt = w, *vc = kt + (int64_t)a->Dqk * T, *s = vc + (int64_t)T * Dv, *acc = s + T;
    attn_gather(a, b, h, k, v, kt, NULL, NULL, vc);
    for (int t = 0; t < T; t++) {
        attn_scores(a, q + row_qk(a, b, t, h), kt, t, s);
        float mx = s[0];
        for (int u = 1; u <= t; u++) mx = fmaxf(mx, s[u]);
        double l = 0;
        for (int u = 0; u <= t; u++) {
            s[u] = expf(s[u] - mx);
            l += s[u];
        }
        for (int j = 0; j < Dv; j++) acc[j] = 0.0f;
        for (int u = 0; u <= t; u++) {
            float p = s[u];
            const float *vr = vc + (int64_t)u * Dv;
            for (int j = 0; j < Dv; j++) acc[j] += p * vr[j];
        }
        float *orow = o + row_v(a, b, t, h);
        for (int j = 0; j < Dv; j++) orow[j] = cpu_act(be, (float)(acc[j] / l));
        lse[((int64_t)b * a->H + h) * T + t] = (float)(mx + log(l));
    }
}

static int cpu_attn_fwd(mt_backend *be, void *o, float *lse, const void *q, const void *k,
                        const void *v, int B, int T, int H, int Dqk, int Dv, float scale)
{
    attn_dims a = {B, T, H, Dqk, Dv, scale};
    MT_CHECK(attn_check("attn_fwd", &a));
    if (B == 0) return MT_OK;
    CPU_REQUIRE(o && lse && q && k && v, "attn_fwd: NULL pointer");
    int pairs = B * H;
    int nt = cpu_team(be, (int64_t)pairs * T * T * (Dqk + Dv) / 2);
    if (nt > pairs) nt = pairs;
    size_t per = (size_t)T * (Dqk + Dv) + T + Dv + 16;
    float *mem = cpu_scratch(sizeof(float) * per * (size_t)nt);
    if (!mem) return MT_ERR(MT_ENOMEM, "attn_fwd: out of memory for T=%d", T);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int pr = 0; pr < pairs; pr++)
        attn_fwd_pair(be, &a, pr / H, pr % H, o, lse, q, k, v, mem + per * cpu_thread_id());
    free(mem);
    return MT_OK;
}

/* Scratch layout of one backward pair. */
typedef struct attn_bwd_ws {
    float *kt, *kc, *vt, *dk, *dv, *p, *dp, *dq;
} attn_bwd_ws;

static size_t attn_bwd_ws_floats(const attn_dims *a)
{
    size_t T = (size_t)a->T;
    return 3 * T * a->Dqk + 2 * T * a->Dv + 2 * T + a->Dqk + 16;
}

static attn_bwd_ws attn_bwd_ws_at(const attn_dims *a, float *w)
{
    int64_t T = a->T;
    attn_bwd_ws s;
    s.kt = w;
    s.kc = s.kt + T * a->Dqk;
    s.dk = s.kc + T * a->Dqk;
    s.vt = s.dk + T * a->Dqk;
    s.dv = s.vt + T * a->Dv;
    s.p = s.dv + T * a->Dv;
    s.dp = s.p + T;
    s.dq = s.dp + T;
    return s;
}

/* Standard softmax backward for one (b, h):
 *   P = exp(S - lse), dV = P^T dO, dP = dO V^T, D_t = dO_t . O_t,
 *   dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q. */
static void attn_bwd_pair(const mt_backend *be, const attn_dims *a, int b, int h, float *dq,
                          float *dk, float *dv, const float *dout, const float *q,
                          const float *k, const float *v, const float *o, const float *lse,
                          float *w)
{
    int T = a->T, Dqk = a->Dqk, Dv = a->Dv;
    attn_bwd_ws s = attn_bwd_ws_at(a, w);
    attn_gather(a, b, h, k, v, s.kt, s.kc, s.vt, NULL);
    memset(s.dk, 0, sizeof(float) * (size_t)T * Dqk);
    memset(s.dv, 0, sizeof(float) * (size_t)T * Dv);
    for (int t = 0; t < T; t++) {
        const float *qt = q + row_qk(a, b, t, h), *dot = dout + row_v(a, b, t, h);
        float l = lse[((int64_t)b * a->H + h) * T + t];
        attn_scores(a, qt, s.kt, t, s.p);
        for (int u = 0; u <= t; u++) s.p[u] = expf(s.p[u] - l);
        float Dt = (float)cpu_dot_f64(dot, o + row_v(a, b, t, h), Dv);
        for (int u = 0; u <= t; u++) s.dp[u] = 0.0f;
        for (int j = 0; j < Dv; j++) {
            float g = dot[j];
            const float *vr = s.vt + (int64_t)j * T;
            for (int u = 0; u <= t; u++) s.dp[u] += g * vr[u];
        }
        for (int d = 0; d < Dqk; d++) s.dq[d] = 0.0f;
        for (int u = 0; u <= t; u++) {
            float ds = s.p[u] * (s.dp[u] - Dt), c = a->scale * ds, pu = s.p[u];
            const float *kr = s.kc + (int64_t)u * Dqk;
            float *dkr = s.dk + (int64_t)u * Dqk, *dvr = s.dv + (int64_t)u * Dv;
            for (int d = 0; d < Dqk; d++) s.dq[d] += ds * kr[d];
            for (int d = 0; d < Dqk; d++) dkr[d] += c * qt[d];
            for (int j = 0; j < Dv; j++) dvr[j] += pu * dot[j];
        }
        float *dqr = dq + row_qk(a, b, t, h);
        for (int d = 0; d < Dqk; d++) dqr[d] = cpu_act(be, a->scale * s.dq[d]);
    }
    for (int u = 0; u < T; u++) {
        float *dkr = dk + row_qk(a, b, u, h), *dvr = dv + row_v(a, b, u, h);
        for (int d = 0; d < Dqk; d++) dkr[d] = cpu_act(be, s.dk[(int64_t)u * Dqk + d]);
        for (int j = 0; j < Dv; j++) dvr[j] = cpu_act(be, s.dv[(int64_t)u * Dv + j]);
    }
}

static int cpu_attn_bwd(mt_backend *be, void *dq, void *dk, void *dv, const void *dout,
                        const void *q, const void *k, const void *v, const void *o,
                        const float *lse, int B, int T, int H, int Dqk, int Dv, float scale)
{
    attn_dims a = {B, T, H, Dqk, Dv, scale};
    MT_CHECK(attn_check("attn_bwd", &a));
    if (B == 0) return MT_OK;
    CPU_REQUIRE(dq && dk && dv && dout && q && k && v && o && lse, "attn_bwd: NULL pointer");
    int pairs = B * H;
    int nt = cpu_team(be, (int64_t)pairs * T * T * (Dqk + Dv));
    if (nt > pairs) nt = pairs;
    size_t per = attn_bwd_ws_floats(&a);
    float *mem = cpu_scratch(sizeof(float) * per * (size_t)nt);
    if (!mem) return MT_ERR(MT_ENOMEM, "attn_bwd: out of memory for T=%d", T);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int pr = 0; pr < pairs; pr++)
        attn_bwd_pair(be, &a, pr / H, pr % H, dq, dk, dv, dout, q, k, v, o, lse,
                      mem + per * cpu_thread_id());
    free(mem);
    return MT_OK;
}

static int mla_check(const char *op, int N, int H, int Dn, int R, int Dv)
{
    CPU_REQUIRE(N >= 0 && H >= 1 && Dn >= 0 && R >= 1 && Dv >= 1,
                "%s: N=%d H=%d Dn=%d R=%d Dv=%d", op, N, H, Dn, R, Dv);
    return MT_OK;
}

static int cpu_mla_kv_fwd(mt_backend *be, void *k, void *v, const void *kvb, const void *kpe,
                          int ld_kpe, int N, int H, int Dn, int R, int Dv)
{
    MT_CHECK(mla_check("mla_kv_fwd", N, H, Dn, R, Dv));
    CPU_REQUIRE(ld_kpe >= R, "mla_kv_fwd: ld_kpe=%d < R=%d", ld_kpe, R);
    if (N == 0) return MT_OK;
    CPU_REQUIRE(k && v && kvb && kpe, "mla_kv_fwd: NULL pointer");
    float *kf = k, *vf = v;
    const float *src = kvb, *pe = kpe;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)N * H * (Dn + R + Dv)))
    for (int n = 0; n < N; n++) {
        const float *per = pe + (int64_t)n * ld_kpe;
        for (int h = 0; h < H; h++) {
            int64_t nh = (int64_t)n * H + h;
            const float *s = src + nh * (Dn + Dv);
            float *kr = kf + nh * (Dn + R), *vr = vf + nh * Dv;
            for (int d = 0; d < Dn; d++) kr[d] = cpu_act(be, s[d]);
            for (int d = 0; d < R; d++) kr[Dn + d] = cpu_act(be, per[d]);
            for (int j = 0; j < Dv; j++) vr[j] = cpu_act(be, s[Dn + j]);
        }
    }
    return MT_OK;
}

static int cpu_mla_kv_bwd(mt_backend *be, void *dkvb, void *dkpe, int ld_dkpe, const void *dk,
                          const void *dv, int N, int H, int Dn, int R, int Dv)
{
    MT_CHECK(mla_check("mla_kv_bwd", N, H, Dn, R, Dv));
    CPU_REQUIRE(ld_dkpe >= R, "mla_kv_bwd: ld_dkpe=%d < R=%d", ld_dkpe, R);
    if (N == 0) return MT_OK;
    CPU_REQUIRE(dkvb && dkpe && dk && dv, "mla_kv_bwd: NULL pointer");
    float *dst = dkvb, *dpe = dkpe;
    const float *dkf = dk, *dvf = dv;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)N * H * (Dn + R + Dv)))
    for (int n = 0; n < N; n++) {
        float *per = dpe + (int64_t)n * ld_dkpe;
        for (int d = 0; d < R; d++) {
            float sum = 0.0f; /* heads in order */
            for (int h = 0; h < H; h++) sum += dkf[((int64_t)n * H + h) * (Dn + R) + Dn + d];
            per[d] = cpu_act(be, sum);
        }
        for (int h = 0; h < H; h++) {
            int64_t nh = (int64_t)n * H + h;
            const float *kr = dkf + nh * (Dn + R), *vr = dvf + nh * Dv;
            float *o = dst + nh * (Dn + Dv);
            for (int d = 0; d < Dn; d++) o[d] = cpu_act(be, kr[d]);
            for (int j = 0; j < Dv; j++) o[Dn + j] = cpu_act(be, vr[j]);
        }
    }
    return MT_OK;
}

void cpu_install_attn(mt_backend *be)
{
    be->rope = cpu_rope;
    be->attn_fwd = cpu_attn_fwd;
    be->attn_bwd = cpu_attn_bwd;
    be->mla_kv_fwd = cpu_mla_kv_fwd;
    be->mla_kv_bwd = cpu_mla_kv_bwd;
}
