/* cuda_attn.cu - causal softmax attention (forward and backward) on the CUDA
 * backend, act = bf16: path selection, cuDNN launches, the ops.
 *
 * Attention has two paths with the semantics of kernels/cpu/cpu_attn.c:
 *  - cuDNN (the fast path): the SDPA forward and backward written as composite
 *    operation graphs of the cuDNN backend API, the way cudnn-frontend lowers
 *    its sdpa / sdpa_backward nodes for cuDNN 9.x (matmul, pointwise and
 *    reduction operations with a generated causal mask); cuDNN's runtime
 *    fusion engine compiles each into one flash-attention kernel. One plan is
 *    built per (direction, B, T, H, Dqk, Dv, scale, determinism) and cached.
 *  - own kernels (fallback and cross-check): FlashAttention-2 style tiles of
 *    64 queries x 64 keys in shared memory, fp32 SIMT arithmetic, online
 *    softmax in the forward; the backward recomputes P from lse and computes
 *    dK, dV per key tile (iterating over queries) and dQ per query tile
 *    (iterating over keys), so no sum depends on timing.
 * MOETRAIN_ATTN=own|cudnn forces a path (cuda_attn.h). The files of the
 * attention: cuda_attn_impl.h lists them.
 *
 * Layouts (ops.h): q, k [B*T, H, Dqk]; v, o [B*T, H, Dv]; lse [B, H, T] f32,
 * lse[t] = log sum_u exp(scale q_t . k_u) over u <= t (natural log).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_attn.h"
#include "kernels/cuda/cuda_attn_impl.h"
#include "base/mt_log.h"

/* ======================================================================== */
/* path selection and the attention ops                                     */
/* ======================================================================== */

typedef enum { ATT_AUTO = 0, ATT_OWN, ATT_CUDNN } att_mode;

static att_mode att_mode_env(void)
{
    const char *s = getenv("MOETRAIN_ATTN");
    if (s && !strcmp(s, "own")) return ATT_OWN;
    if (s && !strcmp(s, "cudnn")) return ATT_CUDNN;
    return ATT_AUTO;
}

static int att_det_env(void)
{
    const char *s = getenv("MOETRAIN_ATTN_DETERMINISTIC");
    return !(s && !strcmp(s, "0"));
}

static attn_key att_key(int bwd, int B, int T, int H, int Dqk, int Dv, float scale, int det)
{
    attn_key k;
    memset(&k, 0, sizeof k); /* the key is compared with memcmp */
    k.bwd = bwd, k.B = B, k.T = T, k.H = H, k.Dqk = Dqk, k.Dv = Dv, k.det = bwd ? det : 0;
    memcpy(&k.scale_bits, &scale, sizeof scale);
    return k;
}

static int att_aligned(const void *const *ptrs, int n)
{
    for (int i = 0; i < n; i++)
        if ((uintptr_t)ptrs[i] & 15) return 0;
    return 1;
}

/* Outcome of trying cuDNN: ran, or not (why filled), or an error (< 0). */
typedef struct att_try {
    int ran;
    int short_scratch; /* not run only because the plan's workspace exceeds the scratch */
    char why[1100];
} att_try;

/* Looks up the plan and the scratch it needs; *p is NULL when cuDNN cannot
 * run this call (t->why says why). */
static void *att_dnn_prepare(mt_backend *be, const attn_key *k, attn_plan **pp, att_try *t)
{
    attn_plan *p = att_plan_get(be, k);
    *pp = NULL;
    if (p->state < 0) {
        snprintf(t->why, sizeof t->why, "%s", p->why);
        return NULL;
    }
    size_t need = p->aux_bytes + att_align(p->ws_bytes) + 256, have = cuda_of(be)->scratch_cap;
    t->short_scratch = 0;
    if (need > have) {
        t->short_scratch = 1;
        snprintf(t->why, sizeof t->why,
                 "the plan needs %zu MiB of scratch (%zu bytes workspace + %zu aux), the backend "
                 "reserved %zu MiB (MOETRAIN_CUDA_SCRATCH_MB)%s",
                 (need + (1u << 20) - 1) >> 20, p->ws_bytes, p->aux_bytes, have >> 20,
                 k->bwd && k->det ? "; MOETRAIN_ATTN_DETERMINISTIC=0 needs less" : "");
        return NULL;
    }
    void *ws = cuda_scratch(be, need);
    if (!ws) {
        snprintf(t->why, sizeof t->why, "scratch: %s", mt_errmsg());
        return NULL;
    }
    *pp = p;
    return ws;
}

static int att_dnn_fwd(mt_backend *be, void *o, float *lse, const void *q, const void *k,
                       const void *v, int B, int T, int H, int Dqk, int Dv, float scale, att_try *t)
{
    const void *all[] = {o, lse, q, k, v};
    t->ran = 0;
    t->short_scratch = 0;
    if (!att_aligned(all, 5)) {
        snprintf(t->why, sizeof t->why, "a tensor is not 16-byte aligned");
        return MT_OK;
    }
    attn_key key = att_key(0, B, T, H, Dqk, Dv, scale, 0);
    attn_plan *p;
    void *ws = att_dnn_prepare(be, &key, &p, t);
    if (!p) return MT_OK;
    p->scale = scale, p->neg_inf = -INFINITY, p->one = 1.0f;
    int64_t uids[] = {UID_Q, UID_K, UID_V, UID_O, UID_STATS, UID_SCALE, UID_NEG_INF};
    void *ptrs[] = {(void *)q, (void *)k, (void *)v, o, lse, &p->scale, &p->neg_inf};
    MT_CHECK(att_plan_run(be, p, uids, ptrs, 7, ws));
    t->ran = 1;
    return MT_OK;
}

static int att_dnn_bwd(mt_backend *be, void *dq, void *dk, void *dv, const void *dout,
                       const void *q, const void *k, const void *v, const void *o,
                       const float *lse, int B, int T, int H, int Dqk, int Dv, float scale,
                       att_try *t)
{
    const void *all[] = {dq, dk, dv, dout, q, k, v, o, lse};
    t->ran = 0;
    t->short_scratch = 0;
    if (!att_aligned(all, 9)) {
        snprintf(t->why, sizeof t->why, "a tensor is not 16-byte aligned");
        return MT_OK;
    }
    attn_key key = att_key(1, B, T, H, Dqk, Dv, scale, att_det_env());
    attn_plan *p;
    char *ws = (char *)att_dnn_prepare(be, &key, &p, t);
    if (!p) return MT_OK;
    p->scale = scale, p->neg_inf = -INFINITY, p->one = 1.0f;
    const size_t rows = (size_t)B * H * T;
    char *softsum = ws, *dq_acc = ws + att_align(rows * sizeof(float));
    int64_t uids[] = {UID_Q,     UID_K,       UID_V,   UID_O,           UID_DO,   UID_STATS, UID_DQ,
                      UID_DK,    UID_DV,      UID_SCALE, UID_NEG_INF, UID_ONE, UID_SOFTMAX_SUM,
                      UID_DQ_ACCUM};
    void *ptrs[] = {(void *)q, (void *)k, (void *)v,  (void *)o,   (void *)dout, (void *)lse, dq,
                    dk,        dv,        &p->scale, &p->neg_inf, &p->one,      softsum,     dq_acc};
    const int n = p->key.det ? 13 : 14;
    MT_CHECK(att_plan_run(be, p, uids, ptrs, n, ws + p->aux_bytes));
    t->ran = 1;
    return MT_OK;
}

/* After a cuDNN try: "cudnn", or the fallback (warned once per shape in auto
 * mode; an error when cuDNN is forced). */
static int att_after_try(mt_backend *be, const char *op, att_mode mode, const attn_key *k,
                         const att_try *t)
{
    cuda_attn_cache *c = att_cache(be);
    if (t->ran) {
        snprintf(c->last_path, sizeof c->last_path, "cudnn");
        return 1;
    }
    if (mode == ATT_CUDNN)
        return MT_ERR(MT_ENOTSUP, "%s: MOETRAIN_ATTN=cudnn but cuDNN cannot run B=%d T=%d H=%d "
                      "Dqk=%d Dv=%d: %s", op, k->B, k->T, k->H, k->Dqk, k->Dv, t->why);
    snprintf(c->last_path, sizeof c->last_path, "own (%s)", t->why);
    for (int i = 0; i < ATT_CACHE; i++) {
        attn_plan *p = &c->plans[i];
        if (p->state != 0 && !memcmp(&p->key, k, sizeof *k)) {
            if (p->warned) return 0;
            p->warned = 1;
            break;
        }
    }
    MT_LOGW("%s: cuDNN not used for B=%d T=%d H=%d Dqk=%d Dv=%d (%s); using the own kernel", op,
            k->B, k->T, k->H, k->Dqk, k->Dv, t->why);
    return 0;
}

static int attn_check(const char *op, int B, int T, int H, int Dqk, int Dv)
{
    CUDA_REQUIRE(B >= 0 && T >= 1 && H >= 1 && Dqk >= 1 && Dv >= 1,
                 "%s: B=%d T=%d H=%d Dqk=%d Dv=%d", op, B, T, H, Dqk, Dv);
    return MT_OK;
}

static int cuda_attn_fwd(mt_backend *be, void *o, float *lse, const void *q, const void *k,
                         const void *v, int B, int T, int H, int Dqk, int Dv, float scale)
{
    MT_CHECK(attn_check("attn_fwd", B, T, H, Dqk, Dv));
    if (B == 0) return MT_OK;
    CUDA_REQUIRE(o && lse && q && k && v, "attn_fwd: NULL pointer");
    att_mode mode = att_mode_env();
    if (mode != ATT_OWN) {
        att_try t;
        MT_CHECK(att_dnn_fwd(be, o, lse, q, k, v, B, T, H, Dqk, Dv, scale, &t));
        attn_key key = att_key(0, B, T, H, Dqk, Dv, scale, 0);
        int r = att_after_try(be, "attn_fwd", mode, &key, &t);
        if (r != 0) return r < 0 ? r : MT_OK;
    } else {
        snprintf(att_cache(be)->last_path, sizeof att_cache(be)->last_path, "own");
    }
    return att_own_fwd(be, (bf16 *)o, lse, (const bf16 *)q, (const bf16 *)k, (const bf16 *)v, B,
                       T, H, Dqk, Dv, scale);
}

/* The deterministic cuDNN backward's workspace grows with B x H x T^2 (8 GiB
 * at B = 2, T = 4096, H = 128): when the batch's plan does not fit the
 * scratch, the samples go through in chunks of the largest size whose plan
 * does (halving from B). Samples are independent, and the layouts put
 * sample b at rows b T of q, k, v, o and at b H T of lse. */
static int att_dnn_bwd_chunked(mt_backend *be, void *dq, void *dk, void *dv, const void *dout,
                               const void *q, const void *k, const void *v, const void *o,
                               const float *lse, int B, int T, int H, int Dqk, int Dv, float scale,
                               att_try *t)
{
    MT_CHECK(att_dnn_bwd(be, dq, dk, dv, dout, q, k, v, o, lse, B, T, H, Dqk, Dv, scale, t));
    for (int bc = B / 2; !t->ran && t->short_scratch && bc >= 1; bc /= 2) {
        att_try c;
        /* the first chunk decides: every chunk but a shorter last one has its shape */
        MT_CHECK(att_dnn_bwd(be, dq, dk, dv, dout, q, k, v, o, lse, bc, T, H, Dqk, Dv, scale, &c));
        if (!c.ran) {
            if (!c.short_scratch) *t = c;
            continue;
        }
        const size_t qr = (size_t)T * H * Dqk, vr = (size_t)T * H * Dv, lr = (size_t)H * T;
        for (int b0 = bc; b0 < B; b0 += bc) {
            const int n = B - b0 < bc ? B - b0 : bc;
            const size_t b = (size_t)b0;
            MT_CHECK(att_dnn_bwd(be, (bf16 *)dq + b * qr, (bf16 *)dk + b * qr, (bf16 *)dv + b * vr,
                                 (const bf16 *)dout + b * vr, (const bf16 *)q + b * qr,
                                 (const bf16 *)k + b * qr, (const bf16 *)v + b * vr,
                                 (const bf16 *)o + b * vr, lse + b * lr, n, T, H, Dqk, Dv, scale, &c));
            if (!c.ran)
                return MT_ERR(MT_ECUDA, "attn_bwd: cuDNN ran samples 0..%d of %d but not %d..%d: %s",
                              b0 - 1, B, b0, b0 + n - 1, c.why);
        }
        t->ran = 1;
    }
    return MT_OK;
}

static int cuda_attn_bwd(mt_backend *be, void *dq, void *dk, void *dv, const void *dout,
                         const void *q, const void *k, const void *v, const void *o,
                         const float *lse, int B, int T, int H, int Dqk, int Dv, float scale)
{
    MT_CHECK(attn_check("attn_bwd", B, T, H, Dqk, Dv));
    if (B == 0) return MT_OK;
    CUDA_REQUIRE(dq && dk && dv && dout && q && k && v && o && lse, "attn_bwd: NULL pointer");
    att_mode mode = att_mode_env();
    if (mode != ATT_OWN) {
        att_try t;
        MT_CHECK(att_dnn_bwd_chunked(be, dq, dk, dv, dout, q, k, v, o, lse, B, T, H, Dqk, Dv, scale,
                                     &t));
        attn_key key = att_key(1, B, T, H, Dqk, Dv, scale, att_det_env());
        int r = att_after_try(be, "attn_bwd", mode, &key, &t);
        if (r != 0) return r < 0 ? r : MT_OK;
    } else {
        snprintf(att_cache(be)->last_path, sizeof att_cache(be)->last_path, "own");
    }
    return att_own_bwd(be, (bf16 *)dq, (bf16 *)dk, (bf16 *)dv, (const bf16 *)dout, (const bf16 *)q,
                       (const bf16 *)k, (const bf16 *)v, (const bf16 *)o, lse, B, T, H, Dqk, Dv,
                       scale);
}

/* ======================================================================== */
/* install, destroy, C helpers                                              */
/* ======================================================================== */

int cuda_install_attn(mt_backend *be)
{
    cuda_impl *ci = cuda_of(be);
    cuda_attn_cache *c = (cuda_attn_cache *)calloc(1, sizeof *c);
    if (!c) return MT_ERR(MT_ENOMEM, "attn: out of host memory for the plan cache");
    ci->attn = c;
    c->version = cudnnGetVersion();
    snprintf(c->last_path, sizeof c->last_path, "none");
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&c->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                         ci->device));
    be->attn_fwd = cuda_attn_fwd;
    be->attn_bwd = cuda_attn_bwd;
    return MT_OK;
}

void cuda_attn_destroy(mt_backend *be)
{
    cuda_impl *ci = cuda_of(be);
    cuda_attn_cache *c = ci ? ci->attn : NULL;
    if (!c) return;
    for (int i = 0; i < ATT_CACHE; i++)
        if (c->plans[i].state != 0) att_plan_release(&c->plans[i]);
    if (c->own_handle) cudnnDestroy(c->handle);
    free(c);
    ci->attn = NULL;
}

extern "C" size_t cuda_attn_scratch_bytes(int B, int T, int H, int Dqk, int Dv)
{
    (void)Dv;
    const size_t rows = (size_t)B * H * T, t128 = ((size_t)T + 127) / 128 * 128;
    const size_t own = att_align(rows * sizeof(float));
    size_t dnn = att_align(rows * sizeof(float)) + ((size_t)32 << 20); /* softmax_sum + margin */
    if (att_det_env())
        dnn += (size_t)B * H * t128 * t128 * 2; /* the deterministic backward's dP workspace */
    else
        dnn += att_align(rows * (size_t)Dqk * sizeof(float)); /* dQ_accum */
    return dnn > own ? dnn : own;
}

extern "C" int cuda_attn_plan_bytes(mt_backend *be, int bwd, int B, int T, int H, int Dqk, int Dv,
                                    float scale, size_t *need, size_t *have)
{
    *need = 0;
    *have = cuda_of(be)->scratch_cap;
    MT_CHECK(attn_check("attn plan", B, T, H, Dqk, Dv));
    attn_key key = att_key(bwd != 0, B, T, H, Dqk, Dv, scale, att_det_env());
    attn_plan *p = att_plan_get(be, &key);
    if (p->state < 0) return MT_ERR(MT_ENOTSUP, "attn plan (%s): %s", bwd ? "bwd" : "fwd", p->why);
    *need = p->aux_bytes + att_align(p->ws_bytes) + 256;
    return MT_OK;
}

extern "C" const char *cuda_attn_last_path(mt_backend *be)
{
    cuda_attn_cache *c = att_cache(be);
    return c ? c->last_path : "none";
}

extern "C" void *cuda_attn_stream(mt_backend *be) { return (void *)cuda_stream(be); }
