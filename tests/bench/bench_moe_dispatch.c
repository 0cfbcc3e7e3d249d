/* bench_moe_dispatch.c - expert-parallel dispatch + combine on the CPU
 * through MPI (engine/parallel/moe_a2a.h), at DeepSeek-V3 shapes by default.
 *
 *   mpirun -np P bench_moe_dispatch [--tokens N] [--hidden D] [--experts E]
 *       [--topk K] [--align A] [--wire bf16|f32|fp8] [--iters I] [--threads T]
 *       [--gpu staged|nccl|local]
 *
 * Defaults: 4096 tokens per rank, hidden 7168, top-8 of 256 experts
 * (uniform random routes, distinct per token), align 128 (the FP8 GEMM's
 * segment padding, filled on arrival, never sent), bf16 wire, 3 timed
 * iterations after one warm-up. Each iteration runs the MoE layer's path
 * around the experts: dispatch (counts, then the rows gathered from the
 * tokens straight into the wire buffer, the exchange, the unpack
 * expert-contiguous), combine (pack, rows back into the source layout), and
 * the weighted unpermute, the "experts" being the identity. Reported per phase:
 * the slowest rank's time (ms), and for the exchanges the bytes that left
 * each rank, as GB/s per rank; then the plain all_to_all_v of the same
 * payload from packed buffers (MPI's own ceiling here).
 * --wire fp8: the FP8 payload of the fp8 recipe - the tokens quantised
 * once (quant_rows, timed within dispatch), rows travel as e4m3 with their
 * 1x128 scales (dispatch_fp8) and arrive as e4m3 rows + scales for the
 * GEMMs and dequantised act rows; combine stays bf16.
 * --gpu BACKEND: the CUDA backend's buffers through a device communicator
 * (rank r on GPU r % devices; nccl wants a GPU per rank), each phase
 * timed after the device finished it.
 *
 *   ... --layer [--ffn F] [--shared-ffn S]
 *
 * The MoE layer's forward around real experts (parallel.ep_overlap,
 * engine/model/layer_moe.c): counts, dispatch, the local experts (grouped
 * GEMMs gate/up [2F, D], SwiGLU, down [D, F] in the act type, random
 * weights), combine, and the shared expert on the tokens (one FFN of S
 * columns, default F; 0: none); timed as a whole (slowest rank, mean of
 * the iterations), each iteration running it with ep_overlap = none and
 * with halves (the first half of every rank's experts travels beside the
 * shared expert, then the second beside the first half's experts, the
 * first half's outputs travel back beside the second half's experts), in
 * alternating order. Also timed alone: the exchanges (none without the
 * experts) and the experts (routed on the local layout, and shared); and
 * whether halves gave none's combined rows bit for bit. bf16 or f32 wire
 * (the FP8 payload: not in this mode).
 */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/mt_clock.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "engine/parallel/comm.h"
#include "engine/parallel/moe_a2a.h"
#include "kernels/mt_fp8.h"
#include "kernels/ops.h"

static int rank_;

static void die(const char *what, int rc)
{
    fprintf(stderr, "rank %d: %s: %d %s\n", rank_, what, rc, mt_errmsg());
    MPI_Abort(MPI_COMM_WORLD, 1);
}
#define MUST(x)                                                                           \
    do {                                                                                  \
        int rc_ = (x);                                                                    \
        if (rc_ < 0) die(#x, rc_);                                                        \
    } while (0)

/* Rank r's routes: K distinct experts per token, uniform. */
static void routes_of(int r, int N, int K, int E, int32_t *idx)
{
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            int32_t e;
            int dup;
            uint64_t a = 0;
            do {
                e = (int32_t)(mt_hash_u64(0xbe4c4ULL + (uint64_t)r, (uint64_t)n * 1024 + a++) % E);
                dup = 0;
                for (int j = 0; j < k; j++) dup |= idx[n * K + j] == e;
            } while (dup);
            idx[n * K + k] = e;
        }
}

static void *bbuf(mt_backend *be, size_t bytes)
{
    void *p;
    MUST(be->alloc(be, bytes ? bytes : 1, &p));
    return p;
}

/* First row of local expert e's segment. */
static int64_t seg_row(const mt_moe_plan *p, int e)
{
    int64_t r = 0;
    for (int g = 0; g < e; g++) r += p->local_rows[g];
    return r;
}

/* Local experts [e0, e1) on their segments of xl into the same rows of yl:
 * gup = xl W1^T (W1 [2F, D] per expert), hp = silu(gate) * up, yl = hp W2^T
 * (W2 [D, F]). */
static void experts(mt_backend *be, const mt_moe_plan *p, int e0, int e1, void *yl,
                    const void *xl, void *gup, void *hp, const void *w1, const void *w2, int D,
                    int F)
{
    const size_t act = mt_act_size(be);
    const int64_t r0 = seg_row(p, e0), Rl = seg_row(p, e1) - r0;
    if (Rl == 0) return;
    const int *rows = p->local_rows + e0, G = e1 - e0;
    char *g = (char *)gup + (size_t)r0 * 2 * F * act, *h = (char *)hp + (size_t)r0 * F * act;
    MUST(be->gemm_grouped(be, 0, g, 0, 2 * F, 0, (const char *)xl + (size_t)r0 * D * act, D, 0,
                          (const char *)w1 + (size_t)e0 * 2 * F * D * act, D, 0,
                          (int64_t)2 * F * D, rows, G, 2 * F, D, 1.0f, 0));
    MUST(be->swiglu_fwd(be, h, g, (int)Rl, F));
    MUST(be->gemm_grouped(be, 0, (char *)yl + (size_t)r0 * D * act, 0, D, 0, h, F, 0,
                          (const char *)w2 + (size_t)e0 * D * F * act, F, 0, (int64_t)D * F, rows,
                          G, D, F, 1.0f, 0));
}

/* The shared expert (Fs = 0: none) on the N tokens: ys = down(silu(gate x)
 * * up x), W [2 Fs, D] and [D, Fs]. */
typedef struct shared_ffn {
    int Fs;
    void *w1, *w2, *gu, *h, *y;
} shared_ffn;

static void shared_fwd(mt_backend *be, const shared_ffn *s, const void *x, int N, int D)
{
    if (!s->Fs) return;
    MUST(be->gemm(be, s->gu, 0, 2 * s->Fs, x, D, 0, s->w1, D, 0, N, 2 * s->Fs, D, 1.0f, 0));
    MUST(be->swiglu_fwd(be, s->h, s->gu, N, s->Fs));
    MUST(be->gemm(be, s->y, 0, D, s->h, s->Fs, 0, s->w2, s->Fs, 0, N, D, s->Fs, 1.0f, 0));
}

/* One forward of the layer's exchanges and experts; mode 0: none, 1:
 * halves (the shared expert beside the first dispatch, as the layer does),
 * 2: the exchanges alone, 3: the experts alone, routed (on the layout the
 * last dispatch left) and shared. */
static void layer_fwd(mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p, int mode,
                      void *yp, void *xl, void *yl, void *gup, void *hp, const void *w1,
                      const void *w2, const shared_ffn *sh, const void *x, const int32_t *src,
                      const int *rows, int N, int D, int F)
{
    const int El = d->E_local, h = El / 2;
    void *out;
    if (mode == 3) {
        experts(be, p, 0, El, yl, xl, gup, hp, w1, w2, D, F);
        shared_fwd(be, sh, x, N, D);
        return;
    }
    if (mode != 1) {
        MUST(d->dispatch(d, be, p, 1, &out, xl, NULL, x, src, rows, D));
        if (mode == 0) experts(be, p, 0, El, yl, xl, gup, hp, w1, w2, D, F);
        MUST(d->combine(d, be, p, yp, yl, D));
        if (mode == 0) shared_fwd(be, sh, x, N, D);
        return;
    }
    MUST(d->counts(d, be, p, rows));
    MUST(d->dispatch_start(d, be, p, 0, h, xl, NULL, x, src, D));
    shared_fwd(be, sh, x, N, D);
    MUST(d->finish(d));
    MUST(d->dispatch_start(d, be, p, h, El, xl, NULL, x, src, D));
    experts(be, p, 0, h, yl, xl, gup, hp, w1, w2, D, F);
    MUST(d->finish(d));
    MUST(d->combine_start(d, be, p, 0, h, yp, yl, D));
    experts(be, p, h, El, yl, xl, gup, hp, w1, w2, D, F);
    MUST(d->finish(d));
    MUST(d->combine_start(d, be, p, h, El, yp, yl, D));
    MUST(d->finish(d));
}

static void layer_bench(mt_comm *c, mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p,
                        int64_t Rl, const void *x, const int32_t *src, const int *rows, int N,
                        int D, int F, int Fs, int K, int iters, const char *gpu, int threads,
                        mt_comm_dtype wire)
{
    const int El = d->E_local, P = mt_comm_size(c);
    const size_t act = mt_act_size(be);
    const int64_t R = (int64_t)N * K;
    if (El < 2) die("--layer: halves needs 2 local experts or more (--experts / ranks)", MT_EINVAL);
    /* weights: small random values (bf16 numbers), per local expert, and
     * the shared expert's */
    shared_ffn sh = {.Fs = Fs};
    const size_t n1 = (size_t)El * 2 * F * D, n2 = (size_t)El * D * F;
    const size_t n3 = (size_t)2 * Fs * D, n4 = (size_t)D * Fs;
    const size_t nmax = n1 > n2 ? (n1 > n3 ? n1 : n3) : (n2 > n3 ? n2 : n3);
    float *hw = malloc(sizeof(float) * nmax);
    if (!hw) die("out of memory", MT_ENOMEM);
    void *w1 = bbuf(be, act * n1), *w2 = bbuf(be, act * n2);
    if (Fs) {
        sh.w1 = bbuf(be, act * n3);
        sh.w2 = bbuf(be, act * n4);
        sh.gu = bbuf(be, act * N * 2 * Fs);
        sh.h = bbuf(be, act * N * Fs);
        sh.y = bbuf(be, act * N * D);
    }
    float *tmp = bbuf(be, 4 * nmax);
    void *dst[4] = {w1, w2, sh.w1, sh.w2};
    const size_t cnt[4] = {n1, n2, n3, n4};
    for (int pass = 0; pass < (Fs ? 4 : 2); pass++) {
        const size_t n = cnt[pass];
        const float scale = 1.0f / (float)(pass == 1 ? F : pass == 3 ? Fs : D);
        for (size_t i = 0; i < n; i++)
            hw[i] = mt_bf16_round(scale * (float)mt_hash_normal(99 + (uint64_t)rank_ * 4 + pass, i));
        MUST(be->upload(be, tmp, hw, 4 * n));
        MUST(be->act_from_f32(be, dst[pass], tmp, (int64_t)n));
    }
    be->free(be, tmp);
    free(hw);
    void *xl = bbuf(be, act * Rl * D), *yl = bbuf(be, act * Rl * D);
    void *gup = bbuf(be, act * Rl * 2 * F), *hp = bbuf(be, act * Rl * F);
    /* yp of none, of halves, of the exchanges alone */
    void *yp[3] = {bbuf(be, act * R * D), bbuf(be, act * R * D), bbuf(be, act * R * D)};
    double t[4] = {0};
    for (int it = 0; it <= iters; it++) {
        /* none and halves in alternating order, then the parts alone */
        const int order[4] = {it % 2, 1 - it % 2, 2, 3};
        for (int k = 0; k < 4; k++) {
            const int mode = order[k];
            MUST(be->sync(be));
            MUST(mt_comm_barrier(c));
            const double t0 = mt_now_s();
            layer_fwd(d, be, p, mode, yp[mode < 3 ? mode : 2], xl, yl, gup, hp, w1, w2, &sh, x,
                      src, rows, N, D, F);
            MUST(be->sync(be));
            MUST(mt_comm_sync(c));
            MUST(mt_comm_barrier(c));
            if (it > 0) t[mode] += mt_now_s() - t0;
        }
    }
    /* halves against none, bit for bit (the last iteration's) */
    char *a = malloc(act * R * D + 1), *b = malloc(act * R * D + 1);
    if (!a || !b) die("out of memory", MT_ENOMEM);
    MUST(be->download(be, a, yp[0], act * R * D));
    MUST(be->download(be, b, yp[1], act * R * D));
    int same = memcmp(a, b, act * R * D) == 0, all_same;
    free(a);
    free(b);
    /* host values: through the host side of a device communicator */
    mt_comm *hc = mt_comm_host(c);
    MUST(mt_comm_all_reduce(hc, &same, &all_same, 1, MT_COMM_I32, MT_COMM_MIN));
    double tmax[4];
    for (int k = 0; k < 4; k++) t[k] /= iters;
    MUST(mt_comm_all_reduce(hc, t, tmax, 4, MT_COMM_F64, MT_COMM_MAX));
    if (rank_ == 0) {
        printf("MoE layer forward (--layer): ranks %d, tokens/rank %d, hidden %d, ffn %d, top-%d "
               "of %d experts (%d per rank), shared ffn %d, %s wire, %d iterations, %s\n", P, N,
               D, F, K, d->E, El, Fs, mt_comm_dtype_name(wire), iters,
               gpu ? "CUDA backend" : "CPU backend");
        if (gpu) printf("device communicator: %s\n", gpu);
        else printf("%d thread(s)/rank\n", threads);
        printf("ep_overlap none %.2f ms | halves %.2f ms (%.1f %% of none) | exchanges alone "
               "%.2f ms | experts alone %.2f ms | halves == none bit for bit: %s\n",
               1e3 * tmax[0], 1e3 * tmax[1], 100.0 * tmax[1] / tmax[0], 1e3 * tmax[2],
               1e3 * tmax[3], all_same ? "yes" : "NO");
    }
    void *bufs[] = {w1, w2, xl, yl, gup, hp, yp[0], yp[1], yp[2], sh.w1, sh.w2, sh.gu, sh.h, sh.y};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        if (bufs[i]) be->free(be, bufs[i]);
}

int main(int argc, char **argv)
{
    const char *gpu = NULL;
    int N = 4096, D = 7168, E = 256, K = 8, align = 128, iters = 3, threads = 1;
    int layer = 0, F = 2048, Fs = -1; /* Fs -1: one shared expert of F */
    mt_comm_dtype wire = MT_COMM_BF16;
    int fp8 = 0;
    for (int i = 1; i < argc; i++) {
        int has = i + 1 < argc;
        if (!strcmp(argv[i], "--tokens") && has) N = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--hidden") && has) D = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--experts") && has) E = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--topk") && has) K = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--align") && has) align = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && has) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && has) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--gpu") && has) gpu = argv[++i];
        else if (!strcmp(argv[i], "--layer")) layer = 1;
        else if (!strcmp(argv[i], "--ffn") && has) F = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--shared-ffn") && has) Fs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--wire") && has) {
            ++i;
            wire = !strcmp(argv[i], "f32") ? MT_COMM_F32 : MT_COMM_BF16;
            fp8 = !strcmp(argv[i], "fp8");
        } else {
            fprintf(stderr, "usage: bench_moe_dispatch [--tokens N] [--hidden D] [--experts E] "
                            "[--topk K] [--align A] [--wire bf16|f32|fp8] [--iters I] [--threads T] "
                            "[--gpu staged|nccl|local] [--layer [--ffn F] [--shared-ffn S]]\n");
            return 2;
        }
    }
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    int world_rank = 0, world_size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    rank_ = world_rank;
    mt_backend *be;
    mt_comm_opts o = {.backend = MT_COMM_MPI, .mem = MT_COMM_HOST};
    if (gpu) { /* rank r on device r % devices, as the runtime places them */
        const int ndev = mt_cuda_device_count();
        if (ndev < 1) die("--gpu: no CUDA device", MT_ENOTSUP);
        if (wire == MT_COMM_F32 && !fp8) die("--gpu: the act rows are bf16 (--wire bf16|fp8)", MT_EINVAL);
        MUST(mt_backend_cuda_create_shared(&be, world_rank % ndev, (world_size + ndev - 1) / ndev));
        o.mem = MT_COMM_DEVICE;
        MUST(mt_comm_backend_parse(gpu, &o.backend));
    } else {
        MUST(mt_backend_cpu_create(&be, threads));
        be->round_bf16 = wire == MT_COMM_BF16;
    }
    mt_comm *c;
    MUST(mt_comm_world(&c, &o));
    rank_ = mt_comm_rank(c);
    const int P = mt_comm_size(c);
    if (E % P != 0 || K > E || N < 1 || iters < 1) die("shape (E % P, K <= E)", MT_EINVAL);
    const size_t act = mt_act_size(be);
    mt_moe_dispatcher *d;
    MUST(mt_moe_dispatch_a2a(&d, c, E, wire));
    const int El = E / P;

    /* every rank's routes, so each knows what it will receive */
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)N * K);
    int64_t Rl = 0;
    if (!idx) die("out of memory", MT_ENOMEM);
    for (int r = 0; r < P; r++) {
        routes_of(r, N, K, E, idx);
        int64_t *per = calloc((size_t)El, sizeof *per);
        for (int64_t a = 0; a < (int64_t)N * K; a++)
            if (idx[a] / El == rank_) per[idx[a] % El]++;
        for (int e = 0; e < El; e++) Rl += (per[e] + align - 1) / align * align;
        free(per);
    }
    routes_of(rank_, N, K, E, idx);

    /* the backend's buffers (device memory with --gpu) */
    const int64_t R = (int64_t)N * K;
    const int KB = (D + 127) / 128;
    const size_t W = mt_fp8_wire_row_bytes(D);
    int *rows = malloc(sizeof(int) * (size_t)E);
    float *h = malloc(sizeof(float) * (size_t)(R > (int64_t)N * D ? R : (int64_t)N * D));
    if (!rows || !h) die("out of memory", MT_ENOMEM);
    int32_t *slot = bbuf(be, 4 * (size_t)R), *src = bbuf(be, 4 * (size_t)R);
    int32_t *counts = bbuf(be, 4 * (size_t)E), *didx = bbuf(be, 4 * (size_t)R);
    float *w = bbuf(be, 4 * (size_t)R), *tmp = bbuf(be, 4 * (size_t)N * D);
    void *x = bbuf(be, act * N * D), *y = bbuf(be, act * N * D);
    void *xp = bbuf(be, (act > W / D + 1 ? act : W / D + 1) * R * D); /* yp; the bare send */
    void *xl = bbuf(be, act * Rl * D);                                /* local layout */
    uint8_t *xq = fp8 ? bbuf(be, (size_t)N * D) : NULL, *ql = fp8 ? bbuf(be, (size_t)Rl * D) : NULL;
    float *xs = fp8 ? bbuf(be, 4 * (size_t)N * KB) : NULL, *sl = fp8 ? bbuf(be, 4 * (size_t)Rl * KB) : NULL;
    for (int64_t i = 0; i < (int64_t)N * D; i++)
        h[i] = mt_bf16_round((float)mt_hash_normal(7 + (uint64_t)rank_, (uint64_t)i));
    MUST(be->upload(be, tmp, h, 4 * (size_t)N * D));
    MUST(be->act_from_f32(be, x, tmp, (int64_t)N * D));
    for (int64_t a = 0; a < R; a++) h[a] = 1.0f / K;
    MUST(be->upload(be, w, h, 4 * (size_t)R));
    MUST(be->upload(be, didx, idx, 4 * (size_t)R));
    MUST(be->moe_index(be, slot, src, counts, rows, didx, N, K, E, 1, (int)R));
    mt_moe_plan plan;
    MUST(mt_moe_plan_init(&plan, P, El, align));
    plan.Rl_cap = Rl;
    if (layer) {
        if (fp8) die("--layer: a bf16 or f32 wire (the FP8 payload is not in this mode)", MT_EINVAL);
        layer_bench(c, d, be, &plan, Rl, x, src, rows, N, D, F, Fs < 0 ? F : Fs, K, iters, gpu,
                    threads, wire);
        mt_moe_plan_free(&plan);
        d->destroy(d);
        void *bufs[] = {slot, src, counts, didx, w, tmp, x, y, xp, xl};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) be->free(be, bufs[i]);
        mt_comm_destroy(c);
        be->destroy(be);
        free(idx);
        free(rows);
        free(h);
        MPI_Finalize();
        return 0;
    }

    double t[5] = {0}, best_a2a = 1e30, tquant = 0;
    int64_t s0 = 0, r0 = 0, s1, r1;
    for (int it = 0; it <= iters; it++) {
        double ts[5];
        MUST(be->sync(be));
        MUST(mt_comm_barrier(c));
        ts[0] = ts[1] = mt_now_s();
        void *out;
        if (it == 1) mt_moe_a2a_bytes(d, &s0, &r0);
        /* the layer's forward: rows gathered from the tokens into the wire */
        if (fp8) { /* quantised once, then e4m3 rows + scales travel */
            int one[1] = {N};
            const double tq0 = mt_now_s();
            MUST(be->quant_rows(be, xq, xs, x, D, one, 1, D));
            MUST(be->sync(be));
            if (it > 0) tquant += mt_now_s() - tq0;
            MUST(d->dispatch_fp8(d, be, &plan, ql, sl, xl, xq, xs, N, src, rows, D));
        } else {
            MUST(d->dispatch(d, be, &plan, 1, &out, xl, NULL, x, src, rows, D));
        }
        MUST(be->sync(be));
        MUST(mt_comm_barrier(c)); /* phases timed apart */
        ts[2] = mt_now_s();
        MUST(d->combine(d, be, &plan, xp, xl, D));
        MUST(be->sync(be));
        MUST(mt_comm_barrier(c));
        ts[3] = mt_now_s();
        MUST(be->moe_unpermute(be, y, 0, xp, slot, w, N, K, D));
        MUST(be->sync(be));
        ts[4] = mt_now_s();
        if (it == 0) continue; /* warm-up: buffers grown, pages touched */
        for (int k = 0; k < 4; k++) t[k] += ts[k + 1] - ts[k];
        /* the bare exchange of the same payload, from packed buffers */
        size_t *sc = calloc((size_t)P, sizeof *sc), *sd = calloc((size_t)P, sizeof *sd);
        size_t *rc = calloc((size_t)P, sizeof *rc), *rd = calloc((size_t)P, sizeof *rd);
        size_t so = 0, ro = 0;
        for (int q = 0; q < P; q++) {
            int64_t in = 0;
            for (int e = 0; e < El; e++) in += plan.from[q * El + e];
            const size_t per = fp8 ? W : (size_t)D; /* elements per row */
            sc[q] = (size_t)plan.sent[q] * per;
            sd[q] = so;
            rc[q] = (size_t)in * per;
            rd[q] = ro;
            so += sc[q];
            ro += rc[q];
        }
        MUST(mt_comm_barrier(c));
        double ta = mt_now_s();
        MUST(mt_comm_all_to_all_v(c, xp, sc, sd, xl, rc, rd, fp8 ? MT_COMM_BYTE : wire));
        MUST(mt_comm_sync(c));
        MUST(mt_comm_barrier(c));
        double tb = mt_now_s() - ta;
        best_a2a = tb < best_a2a ? tb : best_a2a;
        free(sc);
        free(sd);
        free(rc);
        free(rd);
    }
    mt_moe_a2a_bytes(d, &s1, &r1);
    double tmax[4];
    for (int k = 0; k < 4; k++) t[k] /= iters;
    /* host values: through the host side of a device communicator */
    mt_comm *hc = mt_comm_host(c);
    MUST(mt_comm_all_reduce(hc, t, tmax, 4, MT_COMM_F64, MT_COMM_MAX));
    double a2a_max, quant_max, tq = tquant / iters;
    MUST(mt_comm_all_reduce(hc, &tq, &quant_max, 1, MT_COMM_F64, MT_COMM_MAX));
    MUST(mt_comm_all_reduce(hc, &best_a2a, &a2a_max, 1, MT_COMM_F64, MT_COMM_MAX));
    /* bytes that left this rank per exchange (dispatch = combine in volume
     * when routes are balanced; counts included); the FP8 dispatch is
     * smaller than the bf16 combine: dispatch's share by the row sizes */
    const double per_it = (double)(s1 - s0) / iters;
    const double fd = fp8 ? (double)W / (double)(W + 2 * (size_t)D) : 0.5;
    int64_t mine[2] = {(int64_t)(per_it * fd), (int64_t)(per_it * (1 - fd))}, most2[2];
    MUST(mt_comm_all_reduce(hc, mine, most2, 2, MT_COMM_I64, MT_COMM_MAX));
    const int64_t most = most2[0], most_c = most2[1];
    if (rank_ == 0) {
        printf("ranks %d, tokens/rank %d, hidden %d, top-%d of %d experts, align %d, %s wire, "
               "%d iterations, %s\n", P, N, D, K, E, align,
               fp8 ? "fp8 (e4m3 + 1x128 scales)" : mt_comm_dtype_name(wire), iters,
               gpu ? "CUDA backend" : "CPU backend");
        if (gpu) printf("device communicator: %s\n", gpu);
        else printf("%d thread(s)/rank\n", threads);
        printf("off-rank payload per rank (max): dispatch %.1f MB, combine %.1f MB\n",
               most / 1e6, most_c / 1e6);
        if (fp8) printf("of the dispatch: quant_rows of the tokens %.1f ms\n", 1e3 * quant_max);
        printf("dispatch %.1f ms (%.2f GB/s/rank) | combine %.1f ms "
               "(%.2f GB/s/rank) | unpermute %.1f ms | dispatch+combine %.1f ms | bare "
               "all_to_all_v of the dispatch payload %.1f ms (%.2f GB/s/rank)\n",
               1e3 * tmax[1], most / tmax[1] / 1e9, 1e3 * tmax[2],
               most_c / tmax[2] / 1e9, 1e3 * tmax[3], 1e3 * (tmax[1] + tmax[2]), 1e3 * a2a_max,
               most / a2a_max / 1e9);
    }
    mt_moe_plan_free(&plan);
    d->destroy(d);
    void *bufs[] = {slot, src, counts, didx, w, tmp, x, y, xp, xl, xq, xs, ql, sl};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    mt_comm_destroy(c);
    be->destroy(be);
    free(idx);
    free(rows);
    free(h);
    MPI_Finalize();
    return 0;
}
