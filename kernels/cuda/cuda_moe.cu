/* cuda_moe.cu - MoE routing on the GPU: router (scores, group-limited top-k,
 * weights) and its backward, the sequence-wise balance loss, the
 * expert-major index, and the token permutation to and from expert order.
 *
 * The same functions as kernels/cpu/cpu_moe.c (read its header for the
 * permuted layout). This file is compiled with --fmad=false (no fused
 * multiply-add, as the CPU oracle's -ffp-contract=off) and computes exp in
 * double rounded to float (cu_expf, as glibc's expf), so router scores and
 * therefore the discrete top-k choice match the CPU; sums the CPU does
 * sequentially where the order could change a rounding of the result are
 * done sequentially here as well (one lane), others in a fixed tree.
 *
 * Launch shapes:
 *   router_fwd/bwd   one warp per token, 4 warps per block, per-warp shared
 *                    arrays of E (selection masks, scores)
 *   aux_loss         warp per token (row sums, counts by integer atomics:
 *                    exact), [B, T/64, E/256] blocks for chunked P sums,
 *                    one block per sequence for f, P, L_b, one thread for the
 *                    loss, warp per token for dscores
 *   moe_index        block histogram (integer atomics: exact), one thread
 *                    for the E prefix sums, a stable radix sort of the
 *                    assignments by expert (CUB, scratch), one thread per
 *                    sorted assignment to write slot and src; then the
 *                    padded rows per expert are copied to the host (sync)
 *   moe_permute      one block per permuted row
 *   moe_permute_bwd, moe_unpermute: one block per token, k summed in order
 *   moe_unpermute_bwd: the rows of dyp no slot writes zeroed (a flag per
 *                     row), then one block per token
 */
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/cuda_impl.h"
#include "kernels/cuda/cuda_util.cuh"

/* As cpu_moe.c: added to the normaliser of the top-k weights (a float). */
#define ROUTER_NORM_EPS 1e-20f

#define ROUTER_WARPS 4

static int router_check(const char *op, const mt_router_cfg *c)
{
    CUDA_REQUIRE(c != NULL, "%s: cfg is NULL", op);
    int E = c->n_experts, G = c->n_group;
    CUDA_REQUIRE(E >= 1 && c->top_k >= 1 && c->top_k <= E, "%s: n_experts=%d top_k=%d", op, E,
                 c->top_k);
    CUDA_REQUIRE(c->score_fn == MT_SCORE_SIGMOID || c->score_fn == MT_SCORE_SOFTMAX,
                 "%s: score_fn=%d unknown", op, (int)c->score_fn);
    CUDA_REQUIRE(G >= 1 && E % G == 0, "%s: n_group=%d must divide n_experts=%d", op, G, E);
    if (G > 1)
        CUDA_REQUIRE(c->topk_group >= 1 && c->topk_group <= G &&
                         c->top_k <= c->topk_group * (E / G),
                     "%s: topk_group=%d of n_group=%d cannot hold top_k=%d", op, c->topk_group,
                     G, c->top_k);
    return MT_OK;
}

/* ---- router_fwd ---------------------------------------------------------------- */

/* Per-warp shared arrays of router_fwd (bytes, 8-aligned pieces). */
static size_t router_fwd_smem(int E, int G, int K)
{
    size_t b = 2 * sizeof(float) * (size_t)E    /* s, b */
               + sizeof(float) * (size_t)G       /* group scores */
               + sizeof(int) * (size_t)K         /* chosen experts */
               + (size_t)E + (size_t)G;          /* ok, gok */
    return (b + 15) / 16 * 16;
}

/* A candidate (v, i) beats (w, j): higher value, or equal and lower index;
 * i < 0 is no candidate. */
__device__ __forceinline__ int router_beats(float v, int i, float w, int j)
{
    if (i < 0) return 0;
    if (j < 0) return 1;
    return v > w || (v == w && i < j);
}

/* Token n per warp: scores, biased scores, group selection (one lane, as
 * the CPU's sequential loops), top-k by warp argmax (ties to the lower
 * index), weights (one lane). */
__global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_fwd_kernel(int32_t *__restrict__ idx, float *__restrict__ wout, float *__restrict__ scores,
                  const float *__restrict__ logits, const float *__restrict__ bias, int N,
                  mt_router_cfg c, size_t per_warp)
{
    extern __shared__ __align__(16) unsigned char router_sm[];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int n = blockIdx.x * ROUTER_WARPS + wid;
    if (n >= N) return; /* whole warp */
    const int E = c.n_experts, G = c.n_group, K = c.top_k, gsz = E / G;
    unsigned char *base = router_sm + per_warp * wid;
    float *s = (float *)base, *b = s + E, *gsc = b + E;
    int *sel = (int *)(gsc + G);
    unsigned char *ok = (unsigned char *)(sel + K), *gok = ok + E;
    const float *lg = logits + (int64_t)n * E;
    float *so = scores + (int64_t)n * E;

    /* scores */
    if (c.score_fn == MT_SCORE_SIGMOID) {
        for (int e = lane; e < E; e += 32) s[e] = 1.0f / (1.0f + cu_expf(-lg[e]));
    } else {
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32) mx = fmaxf(mx, lg[e]);
        mx = cu_warp_max(mx);
        for (int e = lane; e < E; e += 32) s[e] = cu_expf(lg[e] - mx);
        __syncwarp();
        double sum = 0.0; /* in expert order, as the CPU */
        if (lane == 0)
            for (int e = 0; e < E; e++) sum += (double)s[e];
        sum = __shfl_sync(CU_FULL, sum, 0);
        __syncwarp();
        for (int e = lane; e < E; e += 32) s[e] = (float)((double)s[e] / sum);
    }
    for (int e = lane; e < E; e += 32) {
        so[e] = s[e];
        b[e] = bias ? s[e] + bias[e] : s[e];
    }
    __syncwarp();

    /* groups: the topk_group groups with the highest score (sum of the top
     * two biased scores, or the maximum), chosen in order by one lane */
    if (G > 1) {
        for (int g = lane; g < G; g += 32) {
            float m1 = -INFINITY, m2 = -INFINITY;
            for (int e = 0; e < gsz; e++) {
                float v = b[g * gsz + e];
                if (v > m1) {
                    m2 = m1;
                    m1 = v;
                } else if (v > m2) {
                    m2 = v;
                }
            }
            gsc[g] = c.group_by_top2 && gsz >= 2 ? m1 + m2 : m1;
            gok[g] = 0;
        }
        __syncwarp();
        if (lane == 0)
            for (int i = 0; i < c.topk_group; i++) {
                int best = -1;
                for (int g = 0; g < G; g++)
                    if (!gok[g] && (best < 0 || gsc[g] > gsc[best])) best = g;
                gok[best] = 1;
            }
        __syncwarp();
        for (int e = lane; e < E; e += 32) ok[e] = gok[e / gsz];
    } else {
        for (int e = lane; e < E; e += 32) ok[e] = 1;
    }
    __syncwarp();

    /* top-k: each lane's best allowed expert (its experts in increasing
     * order, strict > keeps the lower index), then a warp argmax */
    for (int k = 0; k < K; k++) {
        float bv = 0.0f;
        int bi = -1;
        for (int e = lane; e < E; e += 32)
            if (ok[e] && (bi < 0 || b[e] > bv)) {
                bv = b[e];
                bi = e;
            }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(CU_FULL, bv, o);
            int oi = __shfl_xor_sync(CU_FULL, bi, o);
            if (router_beats(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            sel[k] = bi;
            ok[bi] = 0;
            idx[(int64_t)n * K + k] = bi;
        }
        __syncwarp();
    }

    /* weights: unbiased scores of the chosen, normalised by their sum in
     * order + eps, times scaling */
    if (lane == 0) {
        float den = 0.0f;
        for (int k = 0; k < K; k++) den += s[sel[k]];
        den += ROUTER_NORM_EPS;
        for (int k = 0; k < K; k++)
            wout[(int64_t)n * K + k] =
                c.norm_topk ? s[sel[k]] / den * c.scaling : s[sel[k]] * c.scaling;
    }
}

static int cuda_router_fwd(mt_backend *be, int32_t *idx, float *w, float *scores,
                           const float *logits, const float *bias, int N, const mt_router_cfg *cfg)
{
    MT_CHECK(router_check("router_fwd", cfg));
    CUDA_REQUIRE(N >= 0, "router_fwd: N=%d", N);
    if (N == 0) return MT_OK;
    CUDA_REQUIRE(idx && w && scores && logits, "router_fwd: NULL pointer");
    const size_t per = router_fwd_smem(cfg->n_experts, cfg->n_group, cfg->top_k);
    CUDA_REQUIRE(per * ROUTER_WARPS <= 48 * 1024, "router_fwd: n_experts=%d too many",
                 cfg->n_experts);
    router_fwd_kernel<<<mt_ceil_div(N, ROUTER_WARPS), ROUTER_WARPS * 32, per * ROUTER_WARPS,
                        cuda_stream(be)>>>(idx, w, scores, logits, bias, N, *cfg, per);
    CUDA_LAUNCH_CHECK("router_fwd");
    return MT_OK;
}

/* ---- router_bwd ---------------------------------------------------------------- */

/* dlogits of token n (warp): gs[e] = dscores + d w / d s through the
 * normalisation (double, sums in order by lane 0), then through the score
 * function. gs lives in per-warp shared memory (E doubles). */
__global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_bwd_kernel(float *__restrict__ dlogits, const float *__restrict__ dw,
                  const float *__restrict__ dscores, const float *__restrict__ scores,
                  const int32_t *__restrict__ idx, int N, mt_router_cfg c)
{
    extern __shared__ __align__(16) unsigned char router_sm[];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int n = blockIdx.x * ROUTER_WARPS + wid;
    if (n >= N) return;
    const int E = c.n_experts, K = c.top_k;
    double *gs = (double *)router_sm + (size_t)E * wid;
    const float *s = scores + (int64_t)n * E;
    const float *dwn = dw + (int64_t)n * K;
    const int32_t *in = idx + (int64_t)n * K;

    for (int e = lane; e < E; e += 32) gs[e] = dscores ? (double)dscores[(int64_t)n * E + e] : 0.0;
    __syncwarp();
    if (lane == 0) {
        if (c.norm_topk) {
            /* w_k = scaling * s_k / den, den = sum_j s_j + eps */
            float den = 0.0f;
            for (int k = 0; k < K; k++) den += s[in[k]];
            double d = (double)den + (double)ROUTER_NORM_EPS, dot = 0.0;
            for (int k = 0; k < K; k++) dot += (double)dwn[k] * (double)s[in[k]];
            for (int k = 0; k < K; k++)
                if (in[k] >= 0 && in[k] < E)
                    gs[in[k]] += (double)c.scaling * ((double)dwn[k] / d - dot / (d * d));
        } else {
            for (int k = 0; k < K; k++)
                if (in[k] >= 0 && in[k] < E) gs[in[k]] += (double)c.scaling * (double)dwn[k];
        }
    }
    __syncwarp();
    float *dl = dlogits + (int64_t)n * E;
    if (c.score_fn == MT_SCORE_SIGMOID) {
        for (int e = lane; e < E; e += 32) {
            double se = (double)s[e];
            dl[e] = (float)(gs[e] * se * (1.0 - se));
        }
    } else {
        double dot = 0.0;
        if (lane == 0)
            for (int e = 0; e < E; e++) dot += gs[e] * (double)s[e];
        dot = __shfl_sync(CU_FULL, dot, 0);
        for (int e = lane; e < E; e += 32) dl[e] = (float)((double)s[e] * (gs[e] - dot));
    }
}

static int cuda_router_bwd(mt_backend *be, float *dlogits, const float *dw, const float *dscores,
                           const float *scores, const int32_t *idx, int N,
                           const mt_router_cfg *cfg)
{
    MT_CHECK(router_check("router_bwd", cfg));
    CUDA_REQUIRE(N >= 0, "router_bwd: N=%d", N);
    if (N == 0) return MT_OK;
    CUDA_REQUIRE(dlogits && dw && scores && idx, "router_bwd: NULL pointer");
    const size_t smem = sizeof(double) * (size_t)cfg->n_experts * ROUTER_WARPS;
    CUDA_REQUIRE(smem <= 48 * 1024, "router_bwd: n_experts=%d too many", cfg->n_experts);
    router_bwd_kernel<<<mt_ceil_div(N, ROUTER_WARPS), ROUTER_WARPS * 32, smem, cuda_stream(be)>>>(
        dlogits, dw, dscores, scores, idx, N, *cfg);
    CUDA_LAUNCH_CHECK("router_bwd");
    return MT_OK;
}

/* ---- aux_loss ------------------------------------------------------------------ */

#define AUX_TCHUNK 64 /* tokens per partial sum of P */

/* Token t (warp): rowsum[t] = sum_e s[t, e] (double, fixed tree), and the
 * selection counts cnt[b, e] += 1 for its K experts (integer atomics:
 * exact, so the result does not depend on their order). */
__global__ void aux_rows_kernel(double *__restrict__ rowsum, int *__restrict__ cnt,
                                const float *__restrict__ scores, const int32_t *__restrict__ idx,
                                int N, int T, int E, int K)
{
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= N) return;
    const float *s = scores + (int64_t)t * E;
    double acc = 0.0;
    for (int e = lane; e < E; e += 32) acc += (double)s[e];
    acc = cu_warp_sum(acc);
    if (lane == 0) rowsum[t] = acc;
    const int b = t / T;
    for (int k = lane; k < K; k += 32) {
        int e = idx[(int64_t)t * K + k];
        if (e >= 0 && e < E) atomicAdd(&cnt[b * E + e], 1);
    }
}

/* part[b, ch, e] = sum over tokens t of chunk ch of sequence b (in order)
 * of s[t, e] / rowsum[t] (double). */
__global__ void aux_p_part_kernel(double *__restrict__ part, const float *__restrict__ scores,
                                  const double *__restrict__ rowsum, int T, int E, int CH)
{
    const int b = blockIdx.x, ch = blockIdx.y, e = blockIdx.z * blockDim.x + threadIdx.x;
    if (e >= E) return;
    const int t0 = ch * AUX_TCHUNK, t1 = min(T, t0 + AUX_TCHUNK);
    double acc = 0.0;
    for (int t = t0; t < t1; t++) {
        const int64_t r = (int64_t)b * T + t;
        acc += (double)scores[r * E + e] / rowsum[r];
    }
    part[((int64_t)b * CH + ch) * E + e] = acc;
}

/* Sequence b (one block): f[b, e] = E / (K T) * count, p = mean over tokens
 * (chunks in order), then L[b] = sum_e f p in expert order (thread 0). */
__global__ void aux_seq_kernel(double *__restrict__ f, double *__restrict__ L,
                               const int *__restrict__ cnt, const double *__restrict__ part, int T,
                               int E, int K, int CH)
{
    extern __shared__ double aux_fp[]; /* [E] f * p */
    const int b = blockIdx.x;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        double p = 0.0;
        for (int ch = 0; ch < CH; ch++) p += part[((int64_t)b * CH + ch) * E + e];
        double fe = (double)cnt[b * E + e] * ((double)E / ((double)K * T));
        p /= T;
        f[b * E + e] = fe;
        aux_fp[e] = fe * p;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double acc = 0.0;
        for (int e = 0; e < E; e++) acc += aux_fp[e];
        L[b] = acc;
    }
}

/* loss[0] += alpha * mean_b L_b (sequences in order). */
__global__ void aux_loss_total_kernel(float *loss, const double *__restrict__ L, int B, float alpha)
{
    double acc = 0.0;
    for (int b = 0; b < B; b++) acc += L[b];
    loss[0] = (float)((double)loss[0] + (double)alpha * acc / B);
}

/* dscores[t, e] = gscale (f_e - sum_i f_i s'(t, i)) / (T rowsum[t]). */
__global__ void aux_dscores_kernel(float *__restrict__ dscores, const float *__restrict__ scores,
                                   const double *__restrict__ rowsum, const double *__restrict__ f,
                                   int N, int T, int E, double gscale)
{
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= N) return;
    const int b = t / T;
    const float *s = scores + (int64_t)t * E;
    const double *fb = f + (int64_t)b * E;
    const double sum = rowsum[t];
    double fs = 0.0;
    for (int e = lane; e < E; e += 32) fs += fb[e] * (double)s[e] / sum;
    fs = cu_warp_sum(fs);
    for (int e = lane; e < E; e += 32)
        dscores[(int64_t)t * E + e] = (float)(gscale * (fb[e] - fs) / ((double)T * sum));
}

static int cuda_aux_loss(mt_backend *be, float *loss, float *dscores, const float *scores,
                         const int32_t *idx, int B, int T, float alpha, float grad_scale,
                         const mt_router_cfg *cfg)
{
    MT_CHECK(router_check("aux_loss", cfg));
    CUDA_REQUIRE(B >= 1 && T >= 1, "aux_loss: B=%d T=%d", B, T);
    CUDA_REQUIRE(loss && scores && idx, "aux_loss: NULL pointer");
    const int E = cfg->n_experts, K = cfg->top_k, N = B * T, CH = mt_ceil_div(T, AUX_TCHUNK);
    CUDA_REQUIRE(sizeof(double) * (size_t)E <= 48 * 1024, "aux_loss: n_experts=%d too many", E);
    cudaStream_t st = cuda_stream(be);
    const size_t need = cu_align256(sizeof(double) * (size_t)N) +
                        cu_align256(sizeof(int) * (size_t)B * E) +
                        cu_align256(sizeof(double) * (size_t)B * CH * E) +
                        cu_align256(sizeof(double) * (size_t)B * E) +
                        cu_align256(sizeof(double) * (size_t)B);
    char *base = (char *)cuda_scratch(be, need);
    if (!base) return mt_err_wrap(MT_ENOMEM, "aux_loss: B=%d T=%d E=%d", B, T, E);
    cu_carve cv = {base, 0};
    double *rowsum = (double *)cu_take(&cv, sizeof(double) * (size_t)N);
    int *cnt = (int *)cu_take(&cv, sizeof(int) * (size_t)B * E);
    double *part = (double *)cu_take(&cv, sizeof(double) * (size_t)B * CH * E);
    double *f = (double *)cu_take(&cv, sizeof(double) * (size_t)B * E);
    double *L = (double *)cu_take(&cv, sizeof(double) * (size_t)B);

    MT_CUDA_CHECK(cudaMemsetAsync(cnt, 0, sizeof(int) * (size_t)B * E, st));
    aux_rows_kernel<<<mt_ceil_div(N, 8), 256, 0, st>>>(rowsum, cnt, scores, idx, N, T, E, K);
    CUDA_LAUNCH_CHECK("aux_loss");
    CUDA_REQUIRE(CH <= 65535 && mt_ceil_div(E, 256) <= 65535, "aux_loss: T=%d E=%d too large", T,
                 E);
    dim3 pg((unsigned)B, (unsigned)CH, (unsigned)mt_ceil_div(E, 256));
    aux_p_part_kernel<<<pg, 256, 0, st>>>(part, scores, rowsum, T, E, CH);
    CUDA_LAUNCH_CHECK("aux_loss");
    aux_seq_kernel<<<B, 256, sizeof(double) * (size_t)E, st>>>(f, L, cnt, part, T, E, K, CH);
    CUDA_LAUNCH_CHECK("aux_loss");
    aux_loss_total_kernel<<<1, 1, 0, st>>>(loss, L, B, alpha);
    CUDA_LAUNCH_CHECK("aux_loss");
    if (dscores) {
        const double gscale = (double)grad_scale * (double)alpha / B;
        aux_dscores_kernel<<<mt_ceil_div(N, 8), 256, 0, st>>>(dscores, scores, rowsum, f, N, T, E,
                                                              gscale);
        CUDA_LAUNCH_CHECK("aux_loss");
    }
    return MT_OK;
}

/* ---- moe_index ----------------------------------------------------------------- */

/* counts[e] = assignments to expert e (shared histogram per block, then
 * integer atomics: exact). */
__global__ void moe_hist_kernel(int32_t *__restrict__ counts, const int32_t *__restrict__ idx,
                                int64_t NK, int E)
{
    extern __shared__ int moe_h[];
    for (int e = threadIdx.x; e < E; e += blockDim.x) moe_h[e] = 0;
    __syncthreads();
    for (int64_t a = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; a < NK;
         a += (int64_t)gridDim.x * blockDim.x) {
        int e = idx[a];
        if (e >= 0 && e < E) atomicAdd(&moe_h[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        if (moe_h[e]) atomicAdd(&counts[e], moe_h[e]);
}

/* rows[e] = counts padded to align; pstart = padded starts, ustart =
 * unpadded starts (positions in the sorted assignment list). */
__global__ void moe_prefix_kernel(int *__restrict__ rows, int *__restrict__ pstart,
                                  int *__restrict__ ustart, const int32_t *__restrict__ counts,
                                  int E, int align)
{
    int p = 0, u = 0;
    for (int e = 0; e < E; e++) {
        int r = (counts[e] + align - 1) / align * align;
        rows[e] = r;
        pstart[e] = p;
        ustart[e] = u;
        p += r;
        u += counts[e];
    }
}

/* Sorted assignment j (stable by assignment index within an expert): row
 * pstart[e] + (j - ustart[e]) of the permuted buffer. */
__global__ void moe_slot_kernel(int32_t *__restrict__ slot, int32_t *__restrict__ src,
                                const int32_t *__restrict__ key, const int32_t *__restrict__ asg,
                                const int *__restrict__ pstart, const int *__restrict__ ustart,
                                int NK, int K, int E)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= NK) return;
    const int e = key[j], a = asg[j];
    if (e < 0 || e >= E) return; /* rejected on the CPU; here: left unassigned */
    const int r = pstart[e] + (j - ustart[e]);
    slot[a] = r;
    src[r] = a / K;
}

__global__ void moe_iota_kernel(int32_t *v, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = i;
}

static int cuda_moe_index(mt_backend *be, int32_t *slot, int32_t *src, int32_t *counts,
                          int *host_rows, const int32_t *idx, int N, int K, int E, int align,
                          int R_cap)
{
    CUDA_REQUIRE(N >= 0 && K >= 1 && E >= 1 && align >= 1, "moe_index: N=%d K=%d E=%d align=%d",
                 N, K, E, align);
    const int64_t need_rows = (int64_t)N * K + (int64_t)E * (align - 1);
    CUDA_REQUIRE(R_cap >= need_rows, "moe_index: R_cap=%d < N*K + E*(align-1) = %lld", R_cap,
                 (long long)need_rows);
    CUDA_REQUIRE(src && counts && host_rows && (N == 0 || (slot && idx)),
                 "moe_index: NULL pointer");
    CUDA_REQUIRE(sizeof(int) * (size_t)E <= 48 * 1024, "moe_index: E=%d too many", E);
    cudaStream_t st = cuda_stream(be);
    const int NK = N * K; /* <= R_cap: fits int */
    int bits = 1;
    while (bits < 31 && (1 << bits) < E) bits++;
    size_t temp = 0;
    if (NK > 0)
        MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs((void *)NULL, temp, (const int32_t *)NULL,
                                                      (int32_t *)NULL, (const int32_t *)NULL,
                                                      (int32_t *)NULL, NK, 0, bits, st));
    const size_t vec = cu_align256(sizeof(int32_t) * (size_t)(NK > 0 ? NK : 1));
    const size_t evec = cu_align256(sizeof(int) * (size_t)E);
    char *base = (char *)cuda_scratch(be, 3 * vec + 3 * evec + cu_align256(temp));
    if (!base) return mt_err_wrap(MT_ENOMEM, "moe_index: sorting %d assignments", NK);
    cu_carve cv = {base, 0};
    int32_t *key = (int32_t *)cu_take(&cv, vec);
    int32_t *asg_in = (int32_t *)cu_take(&cv, vec);
    int32_t *asg = (int32_t *)cu_take(&cv, vec);
    int *rows = (int *)cu_take(&cv, evec);
    int *pstart = (int *)cu_take(&cv, evec);
    int *ustart = (int *)cu_take(&cv, evec);
    void *tmp = cu_take(&cv, temp);

    MT_CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(int32_t) * (size_t)E, st));
    MT_CUDA_CHECK(cudaMemsetAsync(src, 0xff, sizeof(int32_t) * (size_t)R_cap, st)); /* -1 */
    if (NK > 0) {
        int hb = mt_ceil_div(NK, 256);
        if (hb > 1024) hb = 1024;
        moe_hist_kernel<<<hb, 256, sizeof(int) * (size_t)E, st>>>(counts, idx, NK, E);
        CUDA_LAUNCH_CHECK("moe_index");
    }
    moe_prefix_kernel<<<1, 1, 0, st>>>(rows, pstart, ustart, counts, E, align);
    CUDA_LAUNCH_CHECK("moe_index");
    if (NK > 0) {
        /* keys: the expert of each assignment; values: the assignment index
         * a = n K + k. The radix sort is stable, so each expert's
         * assignments stay in increasing a, i.e. increasing token n. */
        moe_iota_kernel<<<cuda_grid(NK, 256), 256, 0, st>>>(asg_in, NK);
        CUDA_LAUNCH_CHECK("moe_index");
        MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(tmp, temp, idx, key,
                                                      (const int32_t *)asg_in, asg, NK, 0, bits,
                                                      st));
        moe_slot_kernel<<<cuda_grid(NK, 256), 256, 0, st>>>(slot, src, key, asg, pstart, ustart,
                                                            NK, K, E);
        CUDA_LAUNCH_CHECK("moe_index");
    }
    /* the host needs the padded rows to launch the expert GEMMs */
    MT_CUDA_CHECK(cudaMemcpyAsync(host_rows, rows, sizeof(int) * (size_t)E,
                                  cudaMemcpyDeviceToHost, st));
    MT_CUDA_CHECK(cudaStreamSynchronize(st));
    return MT_OK;
}

/* ---- permutation --------------------------------------------------------------- */

/* Rows are copied as 16-byte vectors when D % 8 == 0 and both bases are
 * 16-byte aligned (vec), else element by element. */
static int moe_vec_ok(const void *a, const void *b, int D)
{
    return D % 8 == 0 && ((uintptr_t)a % 16) == 0 && ((uintptr_t)b % 16) == 0;
}

/* xp[r] = x[src[r]], or zeros where src[r] < 0 (block r). */
__global__ void moe_permute_kernel(bf16 *__restrict__ xp, const bf16 *__restrict__ x,
                                   const int32_t *__restrict__ src, int D, int vec)
{
    const int r = blockIdx.x;
    const int sr = src[r];
    bf16 *dst = xp + (int64_t)r * D;
    if (vec) {
        uint4 *d4 = (uint4 *)dst;
        const uint4 *s4 = (const uint4 *)(x + (int64_t)sr * D);
        for (int i = threadIdx.x; i < D / 8; i += blockDim.x)
            d4[i] = sr >= 0 ? s4[i] : make_uint4(0, 0, 0, 0);
    } else {
        const bf16 *s = x + (int64_t)sr * D;
        for (int k = threadIdx.x; k < D; k += blockDim.x)
            dst[k] = sr >= 0 ? s[k] : __float2bfloat16_rn(0.0f);
    }
}

static int cuda_moe_permute(mt_backend *be, void *xp, const void *x, const int32_t *src, int R,
                            int D)
{
    CUDA_REQUIRE(R >= 0 && D >= 1, "moe_permute: R=%d D=%d", R, D);
    if (R == 0) return MT_OK;
    CUDA_REQUIRE(xp && src && x, "moe_permute: NULL pointer");
    moe_permute_kernel<<<R, 128, 0, cuda_stream(be)>>>((bf16 *)xp, (const bf16 *)x, src, D,
                                                       moe_vec_ok(xp, x, D));
    CUDA_LAUNCH_CHECK("moe_permute");
    return MT_OK;
}

/* y[n] (= or +=) sum_k w[n, k] yp[slot[n, k]] (w NULL: weights 1), k in
 * order in float from 0, as the CPU's gather_rows (block n). */
__global__ void moe_gather_kernel(bf16 *y, int accumulate, const bf16 *__restrict__ yp,
                                  const int32_t *__restrict__ slot, const float *__restrict__ w,
                                  int K, int D)
{
    const int n = blockIdx.x;
    const int32_t *sl = slot + (int64_t)n * K;
    bf16 *yr = y + (int64_t)n * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int k = 0; k < K; k++) {
            float v = cuda_ld(yp, (int64_t)sl[k] * D + d);
            acc += w ? w[(int64_t)n * K + k] * v : v;
        }
        cuda_st(yr, d, accumulate ? cuda_ld(yr, d) + acc : acc);
    }
}

/* moe_gather_kernel with 8 consecutive d per thread (16-byte loads and
 * stores; D % 8 == 0, aligned rows): each of the 8 sums is the same
 * sequence of float operations as moe_gather_kernel's, so bit-identical. */
__global__ void moe_gather_vec_kernel(bf16 *y, int accumulate, const bf16 *__restrict__ yp,
                                      const int32_t *__restrict__ slot,
                                      const float *__restrict__ w, int K, int D)
{
    const int n = blockIdx.x;
    const int32_t *sl = slot + (int64_t)n * K;
    uint4 *yr = (uint4 *)(y + (int64_t)n * D);
    for (int c = threadIdx.x; c < D / 8; c += blockDim.x) {
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, v[8];
        for (int k = 0; k < K; k++) {
            cu_bf16x8_unpack(((const uint4 *)(yp + (int64_t)sl[k] * D))[c], v);
            if (w) {
                const float wk = w[(int64_t)n * K + k];
#pragma unroll
                for (int i = 0; i < 8; i++) acc[i] += wk * v[i];
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) acc[i] += v[i];
            }
        }
        if (accumulate) {
            cu_bf16x8_unpack(yr[c], v);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = v[i] + acc[i];
        }
        yr[c] = cu_bf16x8_pack(acc);
    }
}

static int moe_gather(mt_backend *be, const char *op, void *y, int accumulate, const void *yp,
                      const int32_t *slot, const float *w, int N, int K, int D)
{
    if (moe_vec_ok(y, yp, D))
        moe_gather_vec_kernel<<<N, 128, 0, cuda_stream(be)>>>((bf16 *)y, accumulate,
                                                              (const bf16 *)yp, slot, w, K, D);
    else
        moe_gather_kernel<<<N, 256, 0, cuda_stream(be)>>>((bf16 *)y, accumulate, (const bf16 *)yp,
                                                          slot, w, K, D);
    CUDA_LAUNCH_CHECK(op);
    return MT_OK;
}

static int cuda_moe_permute_bwd(mt_backend *be, void *dx, int accumulate, const void *dxp,
                                const int32_t *slot, int N, int K, int D)
{
    CUDA_REQUIRE(N >= 0 && K >= 1 && D >= 1, "moe_permute_bwd: N=%d K=%d D=%d", N, K, D);
    if (N == 0) return MT_OK;
    CUDA_REQUIRE(dx && dxp && slot, "moe_permute_bwd: NULL pointer");
    return moe_gather(be, "moe_permute_bwd", dx, accumulate, dxp, slot, NULL, N, K, D);
}

static int cuda_moe_unpermute(mt_backend *be, void *y, int accumulate, const void *yp,
                              const int32_t *slot, const float *w, int N, int K, int D)
{
    CUDA_REQUIRE(N >= 0 && K >= 1 && D >= 1, "moe_unpermute: N=%d K=%d D=%d", N, K, D);
    if (N == 0) return MT_OK;
    CUDA_REQUIRE(y && yp && slot && w, "moe_unpermute: NULL pointer");
    return moe_gather(be, "moe_unpermute", y, accumulate, yp, slot, w, N, K, D);
}

/* Token n (block): dyp[slot[n, k]] = w[n, k] dy[n] (rounded to bf16), and
 * dw[n, k] = dy[n] . yp[slot[n, k]] in double (fixed tree). dyp was zeroed
 * before, so padding rows stay zero. */
__global__ void moe_unpermute_bwd_kernel(bf16 *__restrict__ dyp, float *__restrict__ dw,
                                         const bf16 *__restrict__ dy, const bf16 *__restrict__ yp,
                                         const int32_t *__restrict__ slot,
                                         const float *__restrict__ w, int K, int D, int R)
{
    __shared__ double sh[32];
    const int n = blockIdx.x;
    const bf16 *d = dy + (int64_t)n * D;
    for (int k = 0; k < K; k++) {
        const int64_t a = (int64_t)n * K + k;
        const int r = slot[a];
        if (r < 0 || r >= R) continue; /* rejected on the CPU; uniform over the block */
        const float wa = w[a];
        bf16 *g = dyp + (int64_t)r * D;
        const bf16 *y = yp + (int64_t)r * D;
        double acc = 0.0;
        for (int j = threadIdx.x; j < D; j += blockDim.x) {
            const float dj = cuda_ld(d, j);
            cuda_st(g, j, wa * dj);
            acc += (double)dj * (double)cuda_ld(y, j);
        }
        acc = cu_block_sum(acc, sh);
        if (threadIdx.x == 0) dw[a] = (float)acc;
    }
}

/* moe_unpermute_bwd_kernel with 8 consecutive j per thread (16-byte
 * accesses): the same dyp values; each dw sums its products in another
 * order (per-thread partial sums of 8-element chunks, then the same fixed
 * block tree), still in double and deterministic. */
__global__ void moe_unpermute_bwd_vec_kernel(bf16 *__restrict__ dyp, float *__restrict__ dw,
                                             const bf16 *__restrict__ dy,
                                             const bf16 *__restrict__ yp,
                                             const int32_t *__restrict__ slot,
                                             const float *__restrict__ w, int K, int D, int R)
{
    __shared__ double sh[32];
    const int n = blockIdx.x;
    const uint4 *d = (const uint4 *)(dy + (int64_t)n * D);
    for (int k = 0; k < K; k++) {
        const int64_t a = (int64_t)n * K + k;
        const int r = slot[a];
        if (r < 0 || r >= R) continue; /* rejected on the CPU; uniform over the block */
        const float wa = w[a];
        uint4 *g = (uint4 *)(dyp + (int64_t)r * D);
        const uint4 *y = (const uint4 *)(yp + (int64_t)r * D);
        double acc = 0.0;
        for (int c = threadIdx.x; c < D / 8; c += blockDim.x) {
            float dj[8], yj[8], gj[8];
            cu_bf16x8_unpack(d[c], dj);
            cu_bf16x8_unpack(y[c], yj);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                gj[i] = wa * dj[i];
                acc += (double)dj[i] * (double)yj[i];
            }
            g[c] = cu_bf16x8_pack(gj);
        }
        acc = cu_block_sum(acc, sh);
        if (threadIdx.x == 0) dw[a] = (float)acc;
    }
}

/* used[slot[a]] = 1 for every valid slot a < N K. */
__global__ void moe_mark_slots_kernel(uint8_t *__restrict__ used, const int32_t *__restrict__ slot,
                                      int64_t NK, int R)
{
    for (int64_t a = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; a < NK;
         a += (int64_t)gridDim.x * blockDim.x) {
        const int r = slot[a];
        if (r >= 0 && r < R) used[r] = 1;
    }
}

/* Row r of dyp [R, D] zeroed unless a slot writes it (a block per row). */
__global__ void moe_zero_unused_kernel(bf16 *__restrict__ dyp, const uint8_t *__restrict__ used,
                                       int D)
{
    const int r = blockIdx.x;
    if (used[r]) return;
    bf16 *g = dyp + (int64_t)r * D;
    for (int j = threadIdx.x; j < D; j += blockDim.x) g[j] = __float2bfloat16_rn(0.0f);
}

static int cuda_moe_unpermute_bwd(mt_backend *be, void *dyp, float *dw, const void *dy,
                                  const void *yp, const int32_t *slot, const float *w, int N,
                                  int K, int D, int R)
{
    CUDA_REQUIRE(N >= 0 && K >= 1 && D >= 1 && R >= 0, "moe_unpermute_bwd: N=%d K=%d D=%d R=%d",
                 N, K, D, R);
    if (R > 0) CUDA_REQUIRE(dyp != NULL, "moe_unpermute_bwd: dyp is NULL");
    if (N > 0) CUDA_REQUIRE(dw && dy && yp && slot && w, "moe_unpermute_bwd: NULL pointer");
    cudaStream_t st = cuda_stream(be);
    /* Only the rows no slot writes (the padding of the experts' segments)
     * are zeroed: a memset of all R rows wrote the 2 R D bytes once more
     * (the proxy's 68,608 x 7168: 0.98 GB, about a quarter of the op). */
    if (R > 0) {
        uint8_t *used = (uint8_t *)cuda_scratch(be, (size_t)R);
        if (!used) return mt_err_wrap(MT_ENOMEM, "moe_unpermute_bwd: %d row flags", R);
        MT_CUDA_CHECK(cudaMemsetAsync(used, 0, (size_t)R, st));
        if (N > 0) {
            const int64_t NK = (int64_t)N * K;
            moe_mark_slots_kernel<<<cuda_grid(NK, 256), 256, 0, st>>>(used, slot, NK, R);
            CUDA_LAUNCH_CHECK("moe_unpermute_bwd (mark)");
        }
        moe_zero_unused_kernel<<<R, 128, 0, st>>>((bf16 *)dyp, used, D);
        CUDA_LAUNCH_CHECK("moe_unpermute_bwd (zero)");
    }
    if (N == 0) return MT_OK;
    if (moe_vec_ok(dyp, dy, D) && moe_vec_ok(yp, yp, D))
        moe_unpermute_bwd_vec_kernel<<<N, 128, 0, st>>>((bf16 *)dyp, dw, (const bf16 *)dy,
                                                        (const bf16 *)yp, slot, w, K, D, R);
    else
        moe_unpermute_bwd_kernel<<<N, 256, 0, st>>>((bf16 *)dyp, dw, (const bf16 *)dy,
                                                    (const bf16 *)yp, slot, w, K, D, R);
    CUDA_LAUNCH_CHECK("moe_unpermute_bwd");
    return MT_OK;
}

/* FP8 wire rows (ops.h): KB float scales, then D e4m3 values padded to 4
 * bytes. One block per row; bytes move as 32-bit words when D % 4 == 0
 * (the source rows then 4-byte aligned too), one by one otherwise. */
__global__ void moe_pack_fp8_kernel(uint8_t *__restrict__ wire, const uint8_t *__restrict__ q,
                                    const float *__restrict__ s, const int32_t *__restrict__ src,
                                    int N, int D, int KB, int64_t W)
{
    const int r = blockIdx.x;
    const int64_t t = src[r];
    uint8_t *row = wire + (int64_t)r * W;
    float *sc = (float *)row;
    for (int kb = threadIdx.x; kb < KB; kb += blockDim.x) sc[kb] = s[(int64_t)kb * N + t];
    uint8_t *dst = row + 4 * KB;
    const uint8_t *from = q + t * D;
    const int Dp = (int)(W - 4 * KB);
    if ((D & 3) == 0) {
        for (int i = threadIdx.x; i < D / 4; i += blockDim.x)
            ((uint32_t *)dst)[i] = ((const uint32_t *)from)[i];
    } else {
        for (int i = threadIdx.x; i < Dp; i += blockDim.x) dst[i] = i < D ? from[i] : 0;
    }
}

__global__ void moe_unpack_fp8_kernel(uint8_t *__restrict__ q, float *__restrict__ s,
                                      bf16 *__restrict__ x, const uint8_t *__restrict__ wire,
                                      const int32_t *__restrict__ info, int D, int KB, int64_t W)
{
    const int j = blockIdx.x;
    const int32_t wr = info[3 * j], base = info[3 * j + 1], stride = info[3 * j + 2];
    uint8_t *qj = q + (int64_t)j * D;
    bf16 *xj = x + (int64_t)j * D;
    if (wr < 0) {
        for (int kb = threadIdx.x; kb < KB; kb += blockDim.x) s[base + (int64_t)kb * stride] = 1.0f;
        for (int k = threadIdx.x; k < D; k += blockDim.x) {
            qj[k] = 0;
            xj[k] = __float2bfloat16_rn(0.0f);
        }
        return;
    }
    const uint8_t *row = wire + (int64_t)wr * W;
    const float *sc = (const float *)row;
    for (int kb = threadIdx.x; kb < KB; kb += blockDim.x) s[base + (int64_t)kb * stride] = sc[kb];
    const uint8_t *from = row + 4 * KB;
    for (int k = threadIdx.x; k < D; k += blockDim.x) {
        const uint8_t v = from[k];
        qj[k] = v;
        xj[k] = __float2bfloat16_rn(__fmul_rn(cuda_e4m3_val(v), sc[k / 128]));
    }
}

static int cuda_moe_pack_fp8(mt_backend *be, uint8_t *wire, const uint8_t *q, const float *s,
                             const int32_t *src, int N, int R, int D)
{
    CUDA_REQUIRE(R >= 0 && N >= 0 && D >= 1, "moe_pack_fp8: N=%d R=%d D=%d", N, R, D);
    if (R == 0) return MT_OK;
    CUDA_REQUIRE(wire && q && s && src, "moe_pack_fp8: NULL pointer");
    const int KB = (D + 127) / 128;
    moe_pack_fp8_kernel<<<R, 128, 0, cuda_stream(be)>>>(wire, q, s, src, N, D, KB,
                                                        (int64_t)mt_fp8_wire_row_bytes(D));
    CUDA_LAUNCH_CHECK("moe_pack_fp8");
    return MT_OK;
}

static int cuda_moe_unpack_fp8(mt_backend *be, uint8_t *q, float *s, void *x, const uint8_t *wire,
                               const int32_t *info, int M, int D)
{
    CUDA_REQUIRE(M >= 0 && D >= 1, "moe_unpack_fp8: M=%d D=%d", M, D);
    if (M == 0) return MT_OK;
    CUDA_REQUIRE(q && s && x && wire && info, "moe_unpack_fp8: NULL pointer");
    const int KB = (D + 127) / 128;
    moe_unpack_fp8_kernel<<<M, 128, 0, cuda_stream(be)>>>(q, s, (bf16 *)x, wire, info, D, KB,
                                                          (int64_t)mt_fp8_wire_row_bytes(D));
    CUDA_LAUNCH_CHECK("moe_unpack_fp8");
    return MT_OK;
}

void cuda_install_moe(mt_backend *be)
{
    be->moe_pack_fp8 = cuda_moe_pack_fp8;
    be->moe_unpack_fp8 = cuda_moe_unpack_fp8;
    be->router_fwd = cuda_router_fwd;
    be->router_bwd = cuda_router_bwd;
    be->aux_loss = cuda_aux_loss;
    be->moe_index = cuda_moe_index;
    be->moe_permute = cuda_moe_permute;
    be->moe_permute_bwd = cuda_moe_permute_bwd;
    be->moe_unpermute = cuda_moe_unpermute;
    be->moe_unpermute_bwd = cuda_moe_unpermute_bwd;
}
