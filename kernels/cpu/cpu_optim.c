/* cpu_optim.c - optimizer ops: deterministic sum of squares (gradient
 * norm), scaling, and AdamW with bf16 moments. */
#include <stdlib.h>

#include "kernels/cpu/cpu_impl.h"
#include "base/mt_rng.h"

/* sumsq sums fixed chunks of this many values (each in double, in order) and
 * then the chunk sums in order: the result does not depend on threads. */
#define SUMSQ_CHUNK 65536

static int cpu_sumsq(mt_backend *be, float *out, const void *g, int g_bf16, int64_t n)
{
    CPU_REQUIRE(n >= 0, "sumsq: n=%lld is negative", (long long)n);
    CPU_REQUIRE(out != NULL && (n == 0 || g != NULL), "sumsq: NULL pointer");
    int64_t chunks = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
    double *part = malloc(sizeof(double) * (size_t)(chunks > 0 ? chunks : 1));
    if (!part) return MT_ERR(MT_ENOMEM, "sumsq: out of memory");
#pragma omp parallel for num_threads(cpu_team(be, n))
    for (int64_t c = 0; c < chunks; c++) {
        int64_t i0 = c * SUMSQ_CHUNK, len = n - i0 < SUMSQ_CHUNK ? n - i0 : SUMSQ_CHUNK;
        if (g_bf16) {
            const uint16_t *gb = (const uint16_t *)g + i0;
            double acc = 0;
            for (int64_t i = 0; i < len; i++) {
                const double x = mt_bf16_to_f32(gb[i]);
                acc += x * x;
            }
            part[c] = acc;
        } else {
            const float *gf = (const float *)g + i0;
            part[c] = cpu_dot_f64(gf, gf, len);
        }
    }
    double s = 0;
    for (int64_t c = 0; c < chunks; c++) s += part[c];
    out[0] = (float)s;
    free(part);
    return MT_OK;
}

static int cpu_scale_f32(mt_backend *be, float *x, int64_t n, float a)
{
    CPU_REQUIRE(n >= 0, "scale_f32: n=%lld is negative", (long long)n);
    if (n == 0) return MT_OK;
    CPU_REQUIRE(x != NULL, "scale_f32: x is NULL");
#pragma omp parallel for num_threads(cpu_team(be, n))
    for (int64_t i = 0; i < n; i++) x[i] *= a;
    return MT_OK;
}

/* One AdamW element, every step in fp32 in the order ops.h writes it; the
 * new moments are used unrounded and stored rounded to bf16. Returns p. */
static inline float adamw_one(const mt_adamw_hp *hp, float p, uint16_t *m, uint16_t *v,
                              float grad)
{
    float g = grad * hp->grad_scale;
    float mi = hp->beta1 * mt_bf16_to_f32(*m) + (1.0f - hp->beta1) * g;
    float vi = hp->beta2 * mt_bf16_to_f32(*v) + (1.0f - hp->beta2) * (g * g);
    *m = mt_bf16_from_f32(mi);
    *v = mt_bf16_from_f32(vi);
    float upd = mi / hp->bc1 / (sqrtf(vi / hp->bc2) + hp->eps) + hp->weight_decay * p;
    return p - hp->lr * upd;
}

/* Gradient element i (f32, or bf16 bits when hp->grad_bf16). */
static inline float grad_at(const mt_adamw_hp *hp, const void *grad, int64_t i)
{
    return hp->grad_bf16 ? mt_bf16_to_f32(((const uint16_t *)grad)[i]) : ((const float *)grad)[i];
}

/* The arguments of adamw and adamw_sr (op names the caller); the pointers
 * are checked only when there are elements. */
static int adamw_args(const char *op, int64_t n, const mt_adamw_hp *hp, int pointers)
{
    CPU_REQUIRE(n >= 0, "%s: n=%lld is negative", op, (long long)n);
    CPU_REQUIRE(hp != NULL, "%s: hp is NULL", op);
    if (n == 0) return MT_OK;
    CPU_REQUIRE(pointers, "%s: NULL pointer", op);
    CPU_REQUIRE(hp->bc1 > 0 && hp->bc2 > 0, "%s: bias corrections bc1=%g bc2=%g must be > 0", op,
                hp->bc1, hp->bc2);
    return MT_OK;
}

static int cpu_adamw(mt_backend *be, void *p, int p_bf16, uint16_t *m, uint16_t *v,
                     const void *grad, int64_t n, const mt_adamw_hp *hp, void *act)
{
    MT_CHECK(adamw_args("adamw", n, hp, p && m && v && grad));
    if (n == 0) return MT_OK;
    float *a = act; /* the CPU's act type is float (cpu_act rounds) */
    if (p_bf16) {
        uint16_t *pb = p;
#pragma omp parallel for num_threads(cpu_team(be, n))
        for (int64_t i = 0; i < n; i++) {
            pb[i] = mt_bf16_from_f32(adamw_one(hp, mt_bf16_to_f32(pb[i]), m + i, v + i,
                                             grad_at(hp, grad, i)));
            if (a) a[i] = cpu_act(be, mt_bf16_to_f32(pb[i]));
        }
    } else {
        float *pf = p;
#pragma omp parallel for num_threads(cpu_team(be, n))
        for (int64_t i = 0; i < n; i++) {
            pf[i] = adamw_one(hp, pf[i], m + i, v + i, grad_at(hp, grad, i));
            if (a) a[i] = cpu_act(be, pf[i]);
        }
    }
    return MT_OK;
}

/* The reference: the three ops in sequence (ops.h defines the fused op so). */
static int cpu_adamw_fp8(mt_backend *be, void *p, int p_bf16, uint16_t *m, uint16_t *v,
                         const void *grad, int N, int K, const mt_adamw_hp *hp, uint8_t *q,
                         float *s, uint8_t *qt, float *st)
{
    CPU_REQUIRE(N >= 1 && K >= 1, "adamw_fp8: N=%d K=%d", N, K);
    CPU_REQUIRE(q && s && qt && st, "adamw_fp8: NULL pointer");
    const int64_t n = (int64_t)N * K;
    MT_CHECK(cpu_adamw(be, p, p_bf16, m, v, grad, n, hp, NULL));
    const float *w = p;
    float *tmp = NULL;
    if (p_bf16) {
        tmp = malloc((size_t)n * sizeof *tmp);
        if (!tmp) return MT_ERR(MT_ENOMEM, "adamw_fp8: out of memory (%lld elements)", (long long)n);
        const uint16_t *pb = p;
        for (int64_t i = 0; i < n; i++) tmp[i] = mt_bf16_to_f32(pb[i]);
        w = tmp;
    }
    int rc = be->quant_blocks(be, q, s, w, N, K);
    if (rc == MT_OK) rc = be->transpose_blocks(be, qt, st, q, s, N, K);
    free(tmp);
    return rc;
}

static int cpu_adamw_fp8_n(mt_backend *be, int n, const mt_adamw_fp8_arg *w,
                           const mt_adamw_hp *hp)
{
    CPU_REQUIRE(n >= 0, "adamw_fp8_n: n=%d is negative", n);
    CPU_REQUIRE(hp != NULL && (n == 0 || w != NULL), "adamw_fp8_n: NULL pointer");
    for (int i = 0; i < n; i++) {
        mt_adamw_hp h = *hp;
        h.weight_decay = w[i].weight_decay;
        MT_CHECK(cpu_adamw_fp8(be, w[i].p, w[i].p_bf16, w[i].m, w[i].v, w[i].grad, w[i].N,
                               w[i].K, &h, w[i].q, w[i].s, w[i].qt, w[i].st));
    }
    return MT_OK;
}

static int sr_check(const uint8_t *q, const float *s, const uint16_t *m, const uint16_t *v,
                    const void *grad, int N, int K, const mt_adamw_hp *hp, int slab_rows,
                    const uint8_t *qt, const float *st)
{
    CPU_REQUIRE(N >= 1 && K >= 1, "adamw_fp8_sr: N=%d K=%d", N, K);
    CPU_REQUIRE(hp && q && s && m && v && grad && qt && st, "adamw_fp8_sr: NULL pointer");
    CPU_REQUIRE(slab_rows >= N || (slab_rows > 0 && slab_rows % MT_QTILE == 0),
                "adamw_fp8_sr: slabs of %d rows (N=%d): whole 128-row blocks or the weight",
                slab_rows, N);
    return MT_OK;
}

/* The reference: ops.h's sequence, slab by slab. */
static int cpu_adamw_fp8_sr(mt_backend *be, uint8_t *q, float *s, uint16_t *m, uint16_t *v,
                            const void *grad, int N, int K, const mt_adamw_hp *hp, uint64_t seed,
                            int slab_rows, uint8_t *qt, float *st)
{
    MT_CHECK(sr_check(q, s, m, v, grad, N, K, hp, slab_rows, qt, st));
    const int sr = slab_rows < N ? slab_rows : N;
    const int64_t KB = (K + MT_QTILE - 1) / MT_QTILE;
    const size_t ge = hp->grad_bf16 ? 2 : 4;
    float *w = malloc((size_t)sr * (size_t)K * sizeof *w);
    if (!w) return MT_ERR(MT_ENOMEM, "adamw_fp8_sr: out of memory (%d x %d)", sr, K);
    int rc = MT_OK;
    for (int r0 = 0; r0 < N && rc == MT_OK; r0 += sr) {
        const int nr = N - r0 < sr ? N - r0 : sr;
        const int64_t e0 = (int64_t)r0 * K, n = (int64_t)nr * K;
        const uint64_t sd = slab_rows >= N ? seed : mt_hash_u64(seed, (uint64_t)(r0 / sr) + 1);
        float *sb = s + r0 / MT_QTILE * KB;
        rc = be->dequant_blocks(be, w, q + e0, sb, nr, K);
        if (rc == MT_OK)
            rc = cpu_adamw(be, w, 0, m + e0, v + e0, (const char *)grad + (size_t)e0 * ge, n, hp,
                           NULL);
        if (rc == MT_OK) rc = be->quant_blocks_sr(be, q + e0, sb, w, nr, K, sd);
    }
    free(w);
    MT_CHECK(rc);
    return be->transpose_blocks(be, qt, st, q, s, N, K);
}

static int cpu_adamw_fp8_sr_n(mt_backend *be, int n, const mt_adamw_fp8_sr_arg *w,
                              const mt_adamw_hp *hp)
{
    CPU_REQUIRE(n >= 0, "adamw_fp8_sr_n: n=%d is negative", n);
    CPU_REQUIRE(hp != NULL && (n == 0 || w != NULL), "adamw_fp8_sr_n: NULL pointer");
    for (int i = 0; i < n; i++) /* every weight checked before any is updated */
        MT_CHECK(sr_check(w[i].q, w[i].s, w[i].m, w[i].v, w[i].grad, w[i].N, w[i].K, hp,
                          w[i].slab_rows, w[i].qt, w[i].st));
    for (int i = 0; i < n; i++) {
        mt_adamw_hp h = *hp;
        h.weight_decay = w[i].weight_decay;
        MT_CHECK(cpu_adamw_fp8_sr(be, w[i].q, w[i].s, w[i].m, w[i].v, w[i].grad, w[i].N, w[i].K,
                                  &h, w[i].seed, w[i].slab_rows, w[i].qt, w[i].st));
    }
    return MT_OK;
}

/* The act type is float here (cpu_act rounds): element by element, the
 * sequence of ops.h (act_to_f32 is a copy, act_from_f32_sr rounds only
 * with round_bf16). */
static int cpu_adamw_sr(mt_backend *be, void *w, uint16_t *m, uint16_t *v, const void *grad,
                        int64_t n, const mt_adamw_hp *hp, uint64_t seed)
{
    MT_CHECK(adamw_args("adamw_sr", n, hp, w && m && v && grad));
    if (n == 0) return MT_OK;
    float *y = w;
#pragma omp parallel for num_threads(cpu_team(be, n))
    for (int64_t i = 0; i < n; i++)
        y[i] = cpu_act_sr(be, adamw_one(hp, y[i], m + i, v + i, grad_at(hp, grad, i)), seed, i);
    return MT_OK;
}

void cpu_install_optim(mt_backend *be)
{
    be->sumsq = cpu_sumsq;
    be->scale_f32 = cpu_scale_f32;
    be->adamw = cpu_adamw;
    be->adamw_fp8 = cpu_adamw_fp8;
    be->adamw_fp8_n = cpu_adamw_fp8_n;
    be->adamw_fp8_sr = cpu_adamw_fp8_sr;
    be->adamw_fp8_sr_n = cpu_adamw_fp8_sr_n;
    be->adamw_sr = cpu_adamw_sr;
}
