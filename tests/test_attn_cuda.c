/* test_attn_cuda.c - the CUDA attention ops (kernels/cuda/cuda_attn.cu):
 *   1. rope and mla_kv_fwd / mla_kv_bwd against the CPU oracle (round_bf16):
 *      the same fp32 operations in the same order, so at most 1 bf16 ulp
 *      (expected 0; the count of differing elements is printed);
 *   2. the own attention kernels against the CPU oracle at small shapes,
 *      relative norm error < 5e-3 for o, dq, dk, dv and max |lse diff| < 1e-3
 *      (bf16 storage of o and the gradients dominates); the own backward
 *      must be bitwise repeatable;
 *   3. cuDNN against the CPU oracle at a small DeepSeek-V3 head shape and
 *      against the own kernels at B=1 T=4096 H=16 Dqk=192 Dv=128: relative
 *      norm error < 1e-2 for o, dq, dk, dv and max |lse diff| < 1e-3; the
 *      deterministic cuDNN backward must be bitwise repeatable; the dQ-atomic
 *      variant (MOETRAIN_ATTN_DETERMINISTIC=0) is compared too;
 *   4. timings (cudaEvent on the backend's stream, after warm-up) of both
 *      paths at B=1 T=4096 H=128 Dqk=192 Dv=128, with causal FLOPs
 *      2*B*H*T*T/2*(Dqk+Dv) forward and 2.5x that backward.
 * One line per check with its error and PASS/FAIL; every check runs; the
 * exit status is 1 if any failed, 77 (skipped) without a GPU.
 */
#define _POSIX_C_SOURCE 200809L /* setenv, clock_gettime */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_attn.h"
#include "base/mt_clock.h"
#include "base/mt_log.h"
#include "op_ref.h"

static mt_backend *gpu, *cpu;
static int n_fail, n_pass;

/* ---- reporting -------------------------------------------------------------- */

static void check(const char *what, double err, double tol)
{
    int ok = err <= tol; /* false for NaN */
    printf("%s  %-64s err %.3e  tol %.1e\n", ok ? "PASS" : "FAIL", what, err, tol);
    if (ok)
        n_pass++;
    else
        n_fail++;
}

/* A failed op call: prints its status and message; returns 1 if rc failed. */
static int failed(const char *what, int rc)
{
    if (rc == MT_OK) return 0;
    printf("FAIL  %-64s %s: %s\n", what, mt_strstatus(rc), mt_errmsg());
    n_fail++;
    return 1;
}

/* ---- metrics ------------------------------------------------------------------ */

/* ||a - b|| / ||b|| in double; NaN anywhere gives NaN. */
static double relnorm(const float *a, const float *b, int64_t n)
{
    double e = 0, r = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        e += d * d;
        r += (double)b[i] * b[i];
    }
    return sqrt(e) / fmax(sqrt(r), 1e-30);
}

static double maxabs(const float *a, const float *b, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d != d) return d;
        if (d > m) m = d;
    }
    return m;
}

/* max |a - b| in bf16 ulps of b; *ndiff = elements that differ at all. */
static double max_ulps(const float *a, const float *b, int64_t n, int64_t *ndiff)
{
    double m = 0;
    *ndiff = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d != d) return d;
        if (d > 0) (*ndiff)++;
        d /= ref_bf16_ulp(b[i]);
        if (d > m) m = d;
    }
    return m;
}

/* ---- device buffers -------------------------------------------------------- */

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    if (gpu->alloc(gpu, bytes, &p) != MT_OK) {
        fprintf(stderr, "test_attn_cuda: device alloc of %zu bytes: %s\n", bytes, mt_errmsg());
        exit(1);
    }
    return p;
}

/* Device bf16 copy of x[n]. */
static void *dev_bf16(const float *x, int64_t n)
{
    uint16_t *h = ref_alloc(sizeof(uint16_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) h[i] = mt_bf16_from_f32(x[i]);
    void *d = dev_alloc(sizeof(uint16_t) * (size_t)n);
    if (gpu->upload(gpu, d, h, sizeof(uint16_t) * (size_t)n) != MT_OK) {
        fprintf(stderr, "test_attn_cuda: upload: %s\n", mt_errmsg());
        exit(1);
    }
    free(h);
    return d;
}

static void *dev_f32(const float *x, int64_t n)
{
    void *d = dev_alloc(sizeof(float) * (size_t)n);
    if (gpu->upload(gpu, d, x, sizeof(float) * (size_t)n) != MT_OK) {
        fprintf(stderr, "test_attn_cuda: upload: %s\n", mt_errmsg());
        exit(1);
    }
    return d;
}

/* Host float copy of a device bf16 buffer. */
static float *host_bf16(const void *d, int64_t n)
{
    uint16_t *h = ref_alloc(sizeof(uint16_t) * (size_t)n);
    float *x = ref_floats(n);
    if (gpu->download(gpu, h, d, sizeof(uint16_t) * (size_t)n) != MT_OK)
        fprintf(stderr, "test_attn_cuda: download: %s\n", mt_errmsg());
    for (int64_t i = 0; i < n; i++) x[i] = mt_bf16_to_f32(h[i]);
    free(h);
    return x;
}

static float *host_f32(const void *d, int64_t n)
{
    float *x = ref_floats(n);
    if (gpu->download(gpu, x, d, sizeof(float) * (size_t)n) != MT_OK)
        fprintf(stderr, "test_attn_cuda: download: %s\n", mt_errmsg());
    return x;
}

/* Normal(0, sigma) values rounded to bf16 (what the GPU holds). */
static float *rand_act(int64_t n, uint64_t seed, float sigma)
{
    float *x = ref_floats(n);
    ref_fill_normal(x, n, seed, sigma);
    ref_round_bf16(x, n);
    return x;
}

static void set_path(const char *mode, int deterministic)
{
    setenv("MOETRAIN_ATTN", mode, 1);
    setenv("MOETRAIN_ATTN_DETERMINISTIC", deterministic ? "1" : "0", 1);
}

/* ---- 1. rope and mla_kv ------------------------------------------------------ */

static void test_rope(int B, int T, int H, int hs, int off, int R, int extra)
{
    const int N = B * T, ld = H * hs + extra;
    float *ct = ref_floats((int64_t)T * R / 2), *st = ref_floats((int64_t)T * R / 2);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < R / 2; i++) { /* YaRN-like: an mscale folded in */
            double ang = t * pow(10000.0, -2.0 * i / R);
            ct[t * R / 2 + i] = (float)(1.07 * cos(ang));
            st[t * R / 2 + i] = (float)(1.07 * sin(ang));
        }
    void *dct = dev_f32(ct, (int64_t)T * R / 2), *dst = dev_f32(st, (int64_t)T * R / 2);
    for (int il = 0; il < 2; il++)
        for (int inv = 0; inv < 2; inv++) {
            char what[128];
            snprintf(what, sizeof what, "rope B%d T%d H%d hs%d off%d R%d interleave%d inverse%d (ulps)",
                     B, T, H, hs, off, R, il, inv);
            float *x = rand_act((int64_t)N * ld, 11 + 2 * il + inv, 1.0f);
            void *dx = dev_bf16(x, (int64_t)N * ld);
            int rc = gpu->rope(gpu, dx, N, T, H, ld, hs, off, R, dct, dst, il, inv);
            if (!failed(what, rc) && !failed(what, cpu->rope(cpu, x, N, T, H, ld, hs, off, R, ct,
                                                              st, il, inv))) {
                float *g = host_bf16(dx, (int64_t)N * ld);
                int64_t nd;
                double u = max_ulps(g, x, (int64_t)N * ld, &nd);
                printf("INFO  %-64s %lld of %lld elements differ\n", what, (long long)nd,
                       (long long)N * ld);
                check(what, u, 1.0);
                free(g);
            }
            gpu->free(gpu, dx);
            free(x);
        }
    gpu->free(gpu, dct), gpu->free(gpu, dst);
    free(ct), free(st);
}

/* k, v from kv_b's output and the shared rope key (inside a [N, KL + R] kva
 * buffer as in layer_mla.c), then the inverse into a pre-filled d_kva. */
static void test_mla_kv(int N, int H, int Dn, int R, int Dv, int KL)
{
    const int ldk = KL + R;
    char what[128];
    float *kvb = rand_act((int64_t)N * H * (Dn + Dv), 21, 1.0f), *kva = rand_act((int64_t)N * ldk, 22, 1.0f);
    float *k = ref_floats((int64_t)N * H * (Dn + R)), *v = ref_floats((int64_t)N * H * Dv);
    void *dkvb = dev_bf16(kvb, (int64_t)N * H * (Dn + Dv)), *dkva = dev_bf16(kva, (int64_t)N * ldk);
    void *dk = dev_alloc(2 * (size_t)N * H * (Dn + R)), *dv = dev_alloc(2 * (size_t)N * H * Dv);
    snprintf(what, sizeof what, "mla_kv_fwd N%d H%d Dn%d R%d Dv%d ld_kpe%d", N, H, Dn, R, Dv, ldk);
    int rc = gpu->mla_kv_fwd(gpu, dk, dv, dkvb, (char *)dkva + 2 * (size_t)KL, ldk, N, H, Dn, R, Dv);
    if (!failed(what, rc) &&
        !failed(what, cpu->mla_kv_fwd(cpu, k, v, kvb, kva + KL, ldk, N, H, Dn, R, Dv))) {
        float *gk = host_bf16(dk, (int64_t)N * H * (Dn + R)), *gv = host_bf16(dv, (int64_t)N * H * Dv);
        char w2[160];
        snprintf(w2, sizeof w2, "%s k (max abs)", what);
        check(w2, maxabs(gk, k, (int64_t)N * H * (Dn + R)), 0.0);
        snprintf(w2, sizeof w2, "%s v (max abs)", what);
        check(w2, maxabs(gv, v, (int64_t)N * H * Dv), 0.0);
        free(gk), free(gv);
    }
    /* backward: dkvb and dkpe (summed over heads) into d_kva, whose other columns must stay */
    float *gdk = rand_act((int64_t)N * H * (Dn + R), 23, 1.0f), *gdv = rand_act((int64_t)N * H * Dv, 24, 1.0f);
    float *dkvb_ref = ref_floats((int64_t)N * H * (Dn + Dv)), *dkva_ref = rand_act((int64_t)N * ldk, 25, 1.0f);
    void *ddk = dev_bf16(gdk, (int64_t)N * H * (Dn + R)), *ddv = dev_bf16(gdv, (int64_t)N * H * Dv);
    void *ddkva = dev_bf16(dkva_ref, (int64_t)N * ldk), *ddkvb = dev_alloc(2 * (size_t)N * H * (Dn + Dv));
    snprintf(what, sizeof what, "mla_kv_bwd N%d H%d Dn%d R%d Dv%d ld_dkpe%d", N, H, Dn, R, Dv, ldk);
    rc = gpu->mla_kv_bwd(gpu, ddkvb, (char *)ddkva + 2 * (size_t)KL, ldk, ddk, ddv, N, H, Dn, R, Dv);
    if (!failed(what, rc) && !failed(what, cpu->mla_kv_bwd(cpu, dkvb_ref, dkva_ref + KL, ldk, gdk,
                                                          gdv, N, H, Dn, R, Dv))) {
        float *g1 = host_bf16(ddkvb, (int64_t)N * H * (Dn + Dv)), *g2 = host_bf16(ddkva, (int64_t)N * ldk);
        char w2[160];
        int64_t nd;
        snprintf(w2, sizeof w2, "%s dkvb (max abs)", what);
        check(w2, maxabs(g1, dkvb_ref, (int64_t)N * H * (Dn + Dv)), 0.0);
        snprintf(w2, sizeof w2, "%s d_kva with dkpe (ulps)", what);
        check(w2, max_ulps(g2, dkva_ref, (int64_t)N * ldk, &nd), 1.0);
        free(g1), free(g2);
    }
    gpu->free(gpu, dkvb), gpu->free(gpu, dkva), gpu->free(gpu, dk), gpu->free(gpu, dv);
    gpu->free(gpu, ddk), gpu->free(gpu, ddv), gpu->free(gpu, ddkva), gpu->free(gpu, ddkvb);
    free(kvb), free(kva), free(k), free(v), free(gdk), free(gdv), free(dkvb_ref), free(dkva_ref);
}

/* ---- 2, 3. attention against the CPU oracle ---------------------------------- */

typedef struct attn_case {
    int B, T, H, Dqk, Dv;
    float scale;
    int64_t nq, nv, nl;
    float *q, *k, *v, *dout;                 /* host inputs (bf16 values) */
    void *dq_, *dk_, *dv_, *ddout;           /* device inputs */
    void *o, *lse, *gq, *gk, *gv;            /* device outputs */
} attn_case;

static void case_init(attn_case *c, int B, int T, int H, int Dqk, int Dv, uint64_t seed)
{
    memset(c, 0, sizeof *c);
    c->B = B, c->T = T, c->H = H, c->Dqk = Dqk, c->Dv = Dv;
    c->scale = 1.0f / sqrtf((float)Dqk);
    c->nq = (int64_t)B * T * H * Dqk, c->nv = (int64_t)B * T * H * Dv, c->nl = (int64_t)B * H * T;
    c->q = rand_act(c->nq, seed, 1.0f), c->k = rand_act(c->nq, seed + 1, 1.0f);
    c->v = rand_act(c->nv, seed + 2, 1.0f), c->dout = rand_act(c->nv, seed + 3, 1.0f);
    c->dq_ = dev_bf16(c->q, c->nq), c->dk_ = dev_bf16(c->k, c->nq);
    c->dv_ = dev_bf16(c->v, c->nv), c->ddout = dev_bf16(c->dout, c->nv);
    c->o = dev_alloc(2 * (size_t)c->nv), c->lse = dev_alloc(4 * (size_t)c->nl);
    c->gq = dev_alloc(2 * (size_t)c->nq), c->gk = dev_alloc(2 * (size_t)c->nq);
    c->gv = dev_alloc(2 * (size_t)c->nv);
}

static void case_free(attn_case *c)
{
    void *d[] = {c->dq_, c->dk_, c->dv_, c->ddout, c->o, c->lse, c->gq, c->gk, c->gv};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) gpu->free(gpu, d[i]);
    free(c->q), free(c->k), free(c->v), free(c->dout);
}

static int case_fwd(attn_case *c)
{
    return gpu->attn_fwd(gpu, c->o, c->lse, c->dq_, c->dk_, c->dv_, c->B, c->T, c->H, c->Dqk,
                         c->Dv, c->scale);
}

static int case_bwd(attn_case *c)
{
    return gpu->attn_bwd(gpu, c->gq, c->gk, c->gv, c->ddout, c->dq_, c->dk_, c->dv_, c->o, c->lse,
                         c->B, c->T, c->H, c->Dqk, c->Dv, c->scale);
}

/* Compares forward and backward of one path with the CPU. The backward on
 * both sides takes the CPU's o and lse, so only the backward differs. */
static void attn_vs_cpu(const char *mode, int B, int T, int H, int Dqk, int Dv, double tol)
{
    attn_case c;
    case_init(&c, B, T, H, Dqk, Dv, 100 + T + Dqk);
    char sh[96], what[160];
    snprintf(sh, sizeof sh, "B%d T%d H%d Dqk%d Dv%d", B, T, H, Dqk, Dv);
    set_path(mode, 1);
    float *o_ref = ref_floats(c.nv), *lse_ref = ref_floats(c.nl);
    float *dq_ref = ref_floats(c.nq), *dk_ref = ref_floats(c.nq), *dv_ref = ref_floats(c.nv);
    snprintf(what, sizeof what, "cpu attn %s", sh);
    if (failed(what, cpu->attn_fwd(cpu, o_ref, lse_ref, c.q, c.k, c.v, B, T, H, Dqk, Dv, c.scale)) ||
        failed(what, cpu->attn_bwd(cpu, dq_ref, dk_ref, dv_ref, c.dout, c.q, c.k, c.v, o_ref,
                                   lse_ref, B, T, H, Dqk, Dv, c.scale)))
        goto out;

    snprintf(what, sizeof what, "attn_fwd %-5s vs cpu %s", mode, sh);
    if (!failed(what, case_fwd(&c))) {
        printf("INFO  %-64s path: %s\n", what, cuda_attn_last_path(gpu));
        float *o = host_bf16(c.o, c.nv), *lse = host_f32(c.lse, c.nl);
        char w2[200];
        snprintf(w2, sizeof w2, "%s o (rel norm)", what);
        check(w2, relnorm(o, o_ref, c.nv), tol);
        snprintf(w2, sizeof w2, "%s lse (max abs)", what);
        check(w2, maxabs(lse, lse_ref, c.nl), 1e-3);
        free(o), free(lse);
    }
    /* backward from the CPU's forward outputs */
    void *o_cpu = dev_bf16(o_ref, c.nv), *lse_cpu = dev_f32(lse_ref, c.nl);
    gpu->free(gpu, c.o), gpu->free(gpu, c.lse);
    c.o = o_cpu, c.lse = lse_cpu;
    snprintf(what, sizeof what, "attn_bwd %-5s vs cpu %s", mode, sh);
    if (!failed(what, case_bwd(&c))) {
        printf("INFO  %-64s path: %s\n", what, cuda_attn_last_path(gpu));
        float *gq = host_bf16(c.gq, c.nq), *gk = host_bf16(c.gk, c.nq), *gv = host_bf16(c.gv, c.nv);
        char w2[200];
        snprintf(w2, sizeof w2, "%s dq (rel norm)", what);
        check(w2, relnorm(gq, dq_ref, c.nq), tol);
        snprintf(w2, sizeof w2, "%s dk (rel norm)", what);
        check(w2, relnorm(gk, dk_ref, c.nq), tol);
        snprintf(w2, sizeof w2, "%s dv (rel norm)", what);
        check(w2, relnorm(gv, dv_ref, c.nv), tol);
        /* repeatability: a second run must give the same bits */
        if (!failed(what, case_bwd(&c))) {
            float *hq = host_bf16(c.gq, c.nq), *hk = host_bf16(c.gk, c.nq), *hv = host_bf16(c.gv, c.nv);
            double d = maxabs(hq, gq, c.nq) + maxabs(hk, gk, c.nq) + maxabs(hv, gv, c.nv);
            snprintf(w2, sizeof w2, "attn_bwd %-5s repeat %s (bitwise, max abs)", mode, sh);
            check(w2, d, 0.0);
            free(hq), free(hk), free(hv);
        }
        free(gq), free(gk), free(gv);
    }
out:
    free(o_ref), free(lse_ref), free(dq_ref), free(dk_ref), free(dv_ref);
    case_free(&c);
}

/* cuDNN against the own kernels at a DeepSeek-V3 head shape. */
static void attn_cudnn_vs_own(int B, int T, int H, int Dqk, int Dv)
{
    attn_case c;
    case_init(&c, B, T, H, Dqk, Dv, 300);
    char sh[96], what[200];
    snprintf(sh, sizeof sh, "B%d T%d H%d Dqk%d Dv%d", B, T, H, Dqk, Dv);
    float *o_own = NULL, *lse_own = NULL, *g_own[3] = {NULL, NULL, NULL};

    set_path("own", 1);
    snprintf(what, sizeof what, "attn own (reference for cudnn) %s", sh);
    if (failed(what, case_fwd(&c))) goto out;
    o_own = host_bf16(c.o, c.nv), lse_own = host_f32(c.lse, c.nl);
    if (failed(what, case_bwd(&c))) goto out;
    g_own[0] = host_bf16(c.gq, c.nq), g_own[1] = host_bf16(c.gk, c.nq), g_own[2] = host_bf16(c.gv, c.nv);

    set_path("cudnn", 1);
    snprintf(what, sizeof what, "attn_fwd cudnn vs own %s", sh);
    double t0 = mt_now_s();
    if (!failed(what, case_fwd(&c))) {
        gpu->sync(gpu);
        printf("INFO  %-64s first call (plan build) %.2f s\n", what, mt_now_s() - t0);
        float *o = host_bf16(c.o, c.nv), *lse = host_f32(c.lse, c.nl);
        char w2[240];
        snprintf(w2, sizeof w2, "%s o (rel norm)", what);
        check(w2, relnorm(o, o_own, c.nv), 1e-2);
        snprintf(w2, sizeof w2, "%s lse (max abs)", what);
        check(w2, maxabs(lse, lse_own, c.nl), 1e-3);
        free(o), free(lse);
    }
    /* backward from the own forward's o and lse on both paths */
    gpu->upload(gpu, c.lse, lse_own, 4 * (size_t)c.nl);
    void *o_b = dev_bf16(o_own, c.nv);
    gpu->free(gpu, c.o);
    c.o = o_b;
    for (int det = 1; det >= 0; det--) {
        set_path("cudnn", det);
        const char *var = det ? "deterministic" : "dQ-atomic";
        snprintf(what, sizeof what, "attn_bwd cudnn %s vs own %s", var, sh);
        t0 = mt_now_s();
        if (failed(what, case_bwd(&c))) continue;
        gpu->sync(gpu);
        printf("INFO  %-64s first call (plan build) %.2f s\n", what, mt_now_s() - t0);
        float *g[3] = {host_bf16(c.gq, c.nq), host_bf16(c.gk, c.nq), host_bf16(c.gv, c.nv)};
        const char *name[3] = {"dq", "dk", "dv"};
        const int64_t n[3] = {c.nq, c.nq, c.nv};
        char w2[240];
        for (int i = 0; i < 3; i++) {
            snprintf(w2, sizeof w2, "%s %s (rel norm)", what, name[i]);
            check(w2, relnorm(g[i], g_own[i], n[i]), 1e-2);
        }
        if (!failed(what, case_bwd(&c))) {
            float *h[3] = {host_bf16(c.gq, c.nq), host_bf16(c.gk, c.nq), host_bf16(c.gv, c.nv)};
            double d = 0;
            for (int i = 0; i < 3; i++) d += maxabs(h[i], g[i], n[i]);
            snprintf(w2, sizeof w2, "attn_bwd cudnn %s repeat %s (bitwise, max abs)", var, sh);
            if (det)
                check(w2, d, 0.0);
            else
                printf("INFO  %-64s %.3e (not required to be 0)\n", w2, d);
            for (int i = 0; i < 3; i++) free(h[i]);
        }
        for (int i = 0; i < 3; i++) free(g[i]);
    }
out:
    free(o_own), free(lse_own);
    for (int i = 0; i < 3; i++) free(g_own[i]);
    case_free(&c);
}

/* The deterministic cuDNN backward whose whole-batch plan needs more
 * workspace than the scratch (B x H x T^2 x 2 bytes) still runs on cuDNN,
 * in chunks of samples (forced: MOETRAIN_ATTN=cudnn fails otherwise), and
 * each sample's gradients are those of the sample's own B = 1 call, bit for
 * bit. */
static void attn_bwd_chunks(int B, int T, int H, int Dqk, int Dv)
{
    attn_case c;
    case_init(&c, B, T, H, Dqk, Dv, 500);
    char sh[96], what[240];
    snprintf(sh, sizeof sh, "B%d T%d H%d Dqk%d Dv%d", B, T, H, Dqk, Dv);
    size_t need = 0, have = 0;
    set_path("cudnn", 1);
    if (failed("attn plan bytes", cuda_attn_plan_bytes(gpu, 1, B, T, H, Dqk, Dv, c.scale, &need, &have)))
        goto out;
    snprintf(what, sizeof what, "attn_bwd %s plan (%zu MiB) exceeds the scratch (%zu MiB)", sh,
             need >> 20, have >> 20);
    check(what, need > have ? 0.0 : 1.0, 0.0);
    snprintf(what, sizeof what, "attn_fwd cudnn %s", sh);
    if (failed(what, case_fwd(&c))) goto out;
    snprintf(what, sizeof what, "attn_bwd cudnn deterministic %s in chunks", sh);
    if (failed(what, case_bwd(&c))) goto out;
    printf("INFO  %-64s path: %s\n", what, cuda_attn_last_path(gpu));
    float *g[3] = {host_bf16(c.gq, c.nq), host_bf16(c.gk, c.nq), host_bf16(c.gv, c.nv)};
    const int64_t per[3] = {c.nq / B, c.nq / B, c.nv / B};
    double d = 0;
    for (int b = 0; b < B; b++) {
        const size_t qo = (size_t)b * (size_t)per[0], vo = (size_t)b * (size_t)per[2];
        const size_t lo = (size_t)b * (size_t)H * (size_t)T;
        if (failed("attn_bwd one sample",
                   gpu->attn_bwd(gpu, c.gq, c.gk, c.gv, (char *)c.ddout + 2 * vo,
                                 (char *)c.dq_ + 2 * qo, (char *)c.dk_ + 2 * qo,
                                 (char *)c.dv_ + 2 * vo, (char *)c.o + 2 * vo,
                                 (float *)c.lse + lo, 1, T, H, Dqk, Dv, c.scale)))
            break;
        float *h[3] = {host_bf16(c.gq, per[0]), host_bf16(c.gk, per[1]), host_bf16(c.gv, per[2])};
        const size_t off[3] = {qo, qo, vo};
        for (int i = 0; i < 3; i++) {
            d += maxabs(h[i], g[i] + off[i], per[i]);
            free(h[i]);
        }
    }
    snprintf(what, sizeof what, "attn_bwd %s chunks = each sample alone (bitwise, max abs)", sh);
    check(what, d, 0.0);
    for (int i = 0; i < 3; i++) free(g[i]);
out:
    case_free(&c);
}

/* ---- 4. timings ------------------------------------------------------------------ */

/* Fills without per-element hashing: a 1 Mi pool of normals, tiled. */
static void *dev_pool_bf16(int64_t n, uint64_t seed)
{
    const int64_t P = 1 << 20;
    float *pool = rand_act(P, seed, 1.0f), *x = ref_floats(n);
    for (int64_t i = 0; i < n; i++) x[i] = pool[(i * 7 + (i >> 20)) % P];
    void *d = dev_bf16(x, n);
    free(pool), free(x);
    return d;
}

/* ms per call of fwd (bwd = 0) or bwd, cudaEvent-timed after `warm` calls. */
static int time_attn(attn_case *c, int bwd, int warm, int iters, double *ms)
{
    cudaStream_t st = (cudaStream_t)cuda_attn_stream(gpu);
    for (int i = 0; i < warm; i++) MT_CHECK(bwd ? case_bwd(c) : case_fwd(c));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    cudaEventRecord(e0, st);
    for (int i = 0; i < iters; i++) MT_CHECK(bwd ? case_bwd(c) : case_fwd(c));
    cudaEventRecord(e1, st);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    *ms = t / iters;
    return MT_OK;
}

static void attn_timing(int B, int T, int H, int Dqk, int Dv)
{
    attn_case c;
    memset(&c, 0, sizeof c);
    c.B = B, c.T = T, c.H = H, c.Dqk = Dqk, c.Dv = Dv, c.scale = 1.0f / sqrtf((float)Dqk);
    c.nq = (int64_t)B * T * H * Dqk, c.nv = (int64_t)B * T * H * Dv, c.nl = (int64_t)B * H * T;
    c.dq_ = dev_pool_bf16(c.nq, 401), c.dk_ = dev_pool_bf16(c.nq, 402);
    c.dv_ = dev_pool_bf16(c.nv, 403), c.ddout = dev_pool_bf16(c.nv, 404);
    c.o = dev_alloc(2 * (size_t)c.nv), c.lse = dev_alloc(4 * (size_t)c.nl);
    c.gq = dev_alloc(2 * (size_t)c.nq), c.gk = dev_alloc(2 * (size_t)c.nq), c.gv = dev_alloc(2 * (size_t)c.nv);
    const double fwd_flop = 2.0 * B * H * (double)T * T / 2 * (Dqk + Dv), bwd_flop = 2.5 * fwd_flop;
    char sh[96];
    snprintf(sh, sizeof sh, "B%d T%d H%d Dqk%d Dv%d", B, T, H, Dqk, Dv);

    /* scratch each cuDNN plan needs against what the backend has */
    for (int v = 0; v < 3; v++) {
        set_path("cudnn", v != 2);
        size_t need = 0, have = 0;
        int rc = cuda_attn_plan_bytes(gpu, v > 0, B, T, H, Dqk, Dv, c.scale, &need, &have);
        const char *name = v == 0 ? "fwd" : v == 1 ? "bwd deterministic" : "bwd dQ-atomic";
        if (rc != MT_OK)
            printf("INFO  cudnn plan %-18s %s: not available: %s\n", name, sh, mt_errmsg());
        else
            printf("INFO  cudnn plan %-18s %s: scratch need %zu MiB, have %zu MiB (estimate %zu MiB)\n",
                   name, sh, need >> 20, have >> 20, cuda_attn_scratch_bytes(B, T, H, Dqk, Dv) >> 20);
    }
    static const struct {
        const char *mode;
        int det, warm, iters;
    } runs[] = {{"own", 1, 1, 2}, {"cudnn", 1, 2, 10}, {"cudnn", 0, 2, 10}};
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        set_path(runs[r].mode, runs[r].det);
        const char *var = strcmp(runs[r].mode, "cudnn") ? "" : runs[r].det ? " det" : " dQ-atomic";
        char what[160];
        double ms;
        if (runs[r].det) { /* the forward has one variant */
            snprintf(what, sizeof what, "time attn_fwd %s %s", runs[r].mode, sh);
            if (!failed(what, time_attn(&c, 0, runs[r].warm, runs[r].iters, &ms)))
                printf("TIME  %-64s %9.3f ms  %7.1f TFLOPS  (%s)\n", what, ms,
                       fwd_flop / (ms * 1e9), cuda_attn_last_path(gpu));
        }
        snprintf(what, sizeof what, "time attn_bwd %s%s %s", runs[r].mode, var, sh);
        if (!failed(what, time_attn(&c, 1, runs[r].warm, runs[r].iters, &ms)))
            printf("TIME  %-64s %9.3f ms  %7.1f TFLOPS  (%s)\n", what, ms, bwd_flop / (ms * 1e9),
                   cuda_attn_last_path(gpu));
    }
    void *d[] = {c.dq_, c.dk_, c.dv_, c.ddout, c.o, c.lse, c.gq, c.gk, c.gv};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) gpu->free(gpu, d[i]);
}

int main(void)
{
    if (mt_cuda_device_count() == 0) {
        printf("test_attn_cuda: no CUDA device, skipped\n");
        return 77;
    }
    /* The deterministic cuDNN backward at T=4096 H=128 keeps dP in its
     * workspace (~4 GiB): reserve enough scratch unless the caller chose. */
    setenv("MOETRAIN_CUDA_SCRATCH_MB", "4608", 0);
    mt_log_set_level(MT_LOG_INFO);
    const double t0 = mt_now_s();
    if (mt_backend_cuda_create(&gpu, 0, 0) != MT_OK) {
        printf("FAIL  mt_backend_cuda_create: %s\n", mt_errmsg());
        return 1;
    }
    if (mt_backend_cpu_create(&cpu, 0) != MT_OK) {
        printf("FAIL  mt_backend_cpu_create: %s\n", mt_errmsg());
        return 1;
    }
    cpu->round_bf16 = 1;

    /* 1. rope (queries: H heads inside q rows; keys: the shared kpe columns) and mla_kv */
    test_rope(2, 64, 3, 24, 16, 8, 0);
    test_rope(2, 64, 1, 8, 0, 8, 32);
    test_mla_kv(96, 4, 16, 8, 12, 32);  /* element kernels: Dv not a multiple of 8 */
    test_mla_kv(64, 4, 16, 8, 16, 32);  /* 16-byte kernels */
    test_mla_kv(33, 8, 128, 64, 128, 512); /* DeepSeek-V3 head dims, rows not a multiple of the block's */

    /* 2. own kernels against the CPU */
    attn_vs_cpu("own", 2, 128, 4, 48, 32, 5e-3);
    attn_vs_cpu("own", 2, 256, 4, 192, 128, 5e-3);
    attn_vs_cpu("own", 2, 200, 3, 48, 32, 5e-3); /* T not a multiple of the tile */
    attn_vs_cpu("own", 1, 77, 2, 20, 12, 5e-3);  /* odd head dims */

    /* 3. cuDNN against the CPU and the own kernels */
    attn_vs_cpu("cudnn", 2, 256, 4, 192, 128, 1e-2);
    attn_cudnn_vs_own(1, 4096, 16, 192, 128);
    attn_bwd_chunks(4, 4096, 40, 192, 128); /* 5.4 GB of workspace for B = 4, 2.7 for B = 2 */

    /* 4. timings at the DeepSeek-V3 shape */
    attn_timing(1, 4096, 128, 192, 128);

    unsetenv("MOETRAIN_ATTN");
    unsetenv("MOETRAIN_ATTN_DETERMINISTIC");
    gpu->destroy(gpu);
    cpu->destroy(cpu);
    printf("test_attn_cuda: %d passed, %d failed (%.1f s)\n", n_pass, n_fail, mt_now_s() - t0);
    return n_fail ? 1 : 0;
}
