/* test_moe_dispatch.c - the expert-parallel dispatcher against a plain
 * reference (engine/parallel/moe_a2a.h).
 *
 * Run under mpirun with P ranks (P divides 12; also alone); with
 * `--gpu staged|nccl|local` on the CUDA backend's device buffers through a
 * device communicator (bf16 wire only: the act type; skipped without a GPU,
 * nccl also with fewer GPUs than ranks). Every rank
 * builds every rank's routes from seeds, so each can compute by itself what
 * it must receive and get back. For each route pattern (random; skewed: all
 * ranks route every token to rank 0's experts, so rank 0 receives
 * everything and the others nothing; holes: no rank routes to the last
 * rank's experts and the last rank has no tokens at all), each wire (f32
 * on the fp32 recipe: the direct path the GPU takes, here in host memory;
 * bf16 on rounded activations: converted on the CPU, direct on the GPU)
 * and each padding (1 and 8), properties:
 *   1. dispatch (rows gathered from the tokens by the source layout's
 *      src, as the MoE layer does; the xp argument poisoned): the local
 *      layout holds, for each local expert e, every source's rows for e in
 *      source-rank order (each source's rows in token order), each
 *      source's chunk followed by zero rows up to a multiple of align;
 *      local_rows and Rl say so. Bit-exact (bf16 values travel as bf16);
 *   2. combine: with an "expert" that scales each row by (e + 1) (its
 *      padding rows poisoned with NaN, which must never travel), the
 *      weighted unpermute gives sum_k w[n, k] (idx[n, k] + 1) x[n] on every
 *      rank, bit-exact against the same sum computed plainly;
 *   3. the backward's dispatch (count = 0, the forward's plan) moves a new
 *      payload given in the source layout (xp) identically;
 *   4. the byte counters count only what left this rank;
 *   5. the FP8 payload (dispatch_fp8, run_fp8_case);
 *   7. expert tensor parallelism (etp 2 where the ranks are even): the
 *      same properties with two slices per owner: each slice receives all
 *      of its owner's rows (1., 3.: the same layout), combine sums the
 *      slices' halves into the whole (2.), and each owner's run leaves the
 *      source once per slice (4.);
 *   6. --gpu: the dispatcher ordered the ep group's device ops on the
 *      backend's stream (no host waits around exchanges; the properties
 *      above hold by device-side events alone), unless MT_COMM_HOST_SYNC=1;
 *   8. parts (parallel.ep_overlap = halves; etp 1, at least 2 local
 *      experts): every exchange above run as two parts of the local
 *      experts, [0, E_local / 2) then the rest, each started and finished
 *      apart (counts, dispatch_start / dispatch_fp8_start / combine_start,
 *      finish), meets the same properties 1 to 5 bit for bit: the same
 *      layouts, sums and byte counts as the whole exchanges.
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "engine/parallel/comm.h"
#include "engine/parallel/moe_a2a.h"
#include "kernels/mt_fp8.h"
#include "kernels/ops.h"
#include "mpi_check.h"

#define E 12
#define K 3
#define D 20

static int size_;

#define MUST(x)                                                                           \
    do {                                                                                  \
        int rc_ = (x);                                                                    \
        if (rc_ < 0) die(#x, rc_);                                                        \
    } while (0)

enum { PAT_RANDOM = 0, PAT_SKEWED, PAT_HOLES, PAT_COUNT };
static const char *const PAT_NAME[PAT_COUNT] = {"random", "skewed", "holes"};

/* Tokens per rank: differ by rank (still one N per rank for its layer). */
static int tokens_of(int r, int pat) { return pat == PAT_HOLES && r == size_ - 1 ? 0 : 5 + 3 * r; }

/* Routes of rank r: N x K distinct experts. */
static void routes_of(int r, int pat, int N, int32_t *idx)
{
    const int El = E / size_;
    for (int n = 0; n < N; n++) {
        for (int k = 0; k < K; k++) {
            int32_t e;
            int dup;
            uint64_t a = 0;
            do {
                uint64_t h = mt_hash_u64(0xd15ba7c4ULL + (uint64_t)pat * 977 + (uint64_t)r,
                                         (uint64_t)(n * K + k) * 131 + a++);
                if (pat == PAT_SKEWED)
                    e = (int32_t)(h % (uint64_t)El); /* rank 0's experts only */
                else if (pat == PAT_HOLES && size_ > 1)
                    e = (int32_t)(h % (uint64_t)(E - El)); /* never the last rank's */
                else
                    e = (int32_t)(h % E);
                dup = 0;
                for (int j = 0; j < k; j++) dup |= idx[n * K + j] == e;
            } while (dup && a < 1000);
            if (dup) e = (int32_t)((idx[n * K] + k) % E); /* El < K on rank 0 only: rare */
            idx[n * K + k] = e;
        }
    }
}

/* Activations of rank r, token n: distinct, and bf16 values when rounded. */
static float x_of(int r, int n, int d, int round)
{
    float v = (float)mt_hash_normal(0x5eedULL + (uint64_t)r, (uint64_t)n * D + d);
    return round ? mt_bf16_round(v) : v;
}

static float w_of(int r, int n, int k) { return 0.25f + 0.125f * (float)((r + n + k) % 5); }

static int64_t padded_of(int64_t n, int align) { return (n + align - 1) / align * align; }

typedef struct routed {
    int N;
    int32_t idx[64 * K];
} routed;

/* Backend buffers from host values and back (act: the backend's type). */
static void *be_buf(mt_backend *be, size_t bytes)
{
    void *p;
    MUST(be->alloc(be, bytes ? bytes : 1, &p));
    return p;
}

static void *be_raw(mt_backend *be, const void *host, size_t bytes)
{
    void *p = be_buf(be, bytes);
    if (bytes) MUST(be->upload(be, p, host, bytes));
    return p;
}

static void to_act(mt_backend *be, void *dst, const float *host, size_t n)
{
    if (!n) return;
    float *f = be_raw(be, host, n * 4);
    MUST(be->act_from_f32(be, dst, f, (int64_t)n));
    be->free(be, f);
}

static void *be_act(mt_backend *be, const float *host, size_t n)
{
    void *p = be_buf(be, n * mt_act_size(be));
    to_act(be, p, host, n);
    return p;
}

static void from_act(mt_backend *be, float *host, const void *src, size_t n)
{
    if (!n) return;
    float *f = be_buf(be, n * 4);
    MUST(be->act_to_f32(be, f, src, (int64_t)n));
    MUST(be->download(be, host, f, n * 4));
    be->free(be, f);
}

/* 8.: the exchanges as two parts of the local experts (the MoE layer's
 * halves), else whole. */
static int parts_;

static void x_dispatch(mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p, int count,
                       void **xl, void *xl_buf, const void *xp, const void *x,
                       const int32_t *src, const int *rows, int Dm)
{
    if (!parts_) {
        MUST(d->dispatch(d, be, p, count, xl, xl_buf, xp, x, src, rows, Dm));
        return;
    }
    const int h = d->E_local / 2, lo[2] = {0, h}, hi[2] = {h, d->E_local};
    if (count) MUST(d->counts(d, be, p, rows));
    for (int k = 0; k < 2; k++) {
        MUST(d->dispatch_start(d, be, p, lo[k], hi[k], xl_buf, xp, x, src, Dm));
        MUST(d->finish(d));
    }
    *xl = xl_buf;
}

static void x_combine(mt_moe_dispatcher *d, mt_backend *be, const mt_moe_plan *p, void *yp,
                      const void *yl, int Dm)
{
    if (!parts_) {
        MUST(d->combine(d, be, p, yp, yl, Dm));
        return;
    }
    const int h = d->E_local / 2, lo[2] = {0, h}, hi[2] = {h, d->E_local};
    for (int k = 0; k < 2; k++) {
        MUST(d->combine_start(d, be, p, lo[k], hi[k], yp, yl, Dm));
        MUST(d->finish(d));
    }
}

static void x_dispatch_fp8(mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p, uint8_t *ql,
                           float *sl, void *xl_buf, const uint8_t *xq, const float *xs, int N,
                           const int32_t *src, const int *rows, int Dm)
{
    if (!parts_) {
        MUST(d->dispatch_fp8(d, be, p, ql, sl, xl_buf, xq, xs, N, src, rows, Dm));
        return;
    }
    const int h = d->E_local / 2, lo[2] = {0, h}, hi[2] = {h, d->E_local};
    MUST(d->counts(d, be, p, rows));
    for (int k = 0; k < 2; k++) {
        MUST(d->dispatch_fp8_start(d, be, p, lo[k], hi[k], ql, sl, xl_buf, xq, xs, N, src, Dm));
        MUST(d->finish(d));
    }
}

static void run_case(mt_comm *c, mt_backend *be, int pat, mt_comm_dtype wire, int align, int T)
{
    /* T slices per owner (etp): rank t + T o holds slice t of owner o's
     * experts and receives all of their rows */
    const int El = E / (size_ / T), round = wire == MT_COMM_BF16;
    char what[112];
    snprintf(what, sizeof what, "%s, %s wire, align %d, etp %d%s", PAT_NAME[pat],
             mt_comm_dtype_name(wire), align, T, parts_ ? ", in two parts" : "");
    /* every rank's routes */
    routed *all = calloc((size_t)size_, sizeof *all);
    if (!all) die("out of memory", MT_ENOMEM);
    for (int r = 0; r < size_; r++) {
        all[r].N = tokens_of(r, pat);
        routes_of(r, pat, all[r].N, all[r].idx);
    }
    const int N = all[rank_].N;
    const int32_t *idx = all[rank_].idx;

    if (be->kind == MT_BE_CPU) be->round_bf16 = round;
    mt_moe_dispatcher *d;
    MUST(mt_moe_dispatch_a2a_etp(&d, c, E, T, wire));
    CHECK(d->e_lo == rank_ / T * El && d->E_local == El && d->ep == size_ && d->etp == T &&
          d->etp_rank == rank_ % T, "%s: experts [%d, +%d), slice %d of %d", what, d->e_lo,
          d->E_local, d->etp_rank, d->etp);
    mt_moe_plan plan;
    MUST(mt_moe_plan_init(&plan, size_, El, align));
    plan.Rl_cap = mt_moe_local_rows_cap(d, 64, K, align);

    /* source layout by the backend's own ops, as the MoE layer builds it;
     * host copies (h*) for the reference, backend buffers (b*) for the ops */
    const int R_cap = N * K + 1;
    const size_t act = mt_act_size(be), lcap = (size_t)plan.Rl_cap * D;
    int rows[E];
    float *x = malloc(sizeof(float) * (size_t)(N * D + 1));
    float *xp = malloc(sizeof(float) * (size_t)(R_cap * D));
    float *y = malloc(sizeof(float) * (size_t)(N * D + 1));
    float *w = malloc(sizeof(float) * (size_t)(N * K + 1));
    float *xl_h = malloc(sizeof(float) * lcap), *yl = malloc(sizeof(float) * lcap);
    float *want = malloc(sizeof(float) * lcap);
    float *poison = malloc(sizeof(float) * (lcap > (size_t)R_cap * D ? lcap : (size_t)R_cap * D));
    if (!x || !xp || !y || !w || !xl_h || !yl || !want || !poison) die("out of memory", MT_ENOMEM);
    for (size_t i = 0; i < lcap || i < (size_t)R_cap * D; i++) poison[i] = NAN;
    for (int n = 0; n < N; n++) {
        for (int j = 0; j < D; j++) x[n * D + j] = x_of(rank_, n, j, round);
        for (int k = 0; k < K; k++) w[n * K + k] = w_of(rank_, n, k);
    }
    int32_t *b_idx = be_raw(be, idx, sizeof(int32_t) * (size_t)N * K);
    int32_t *b_slot = be_buf(be, sizeof(int32_t) * (size_t)(N * K + 1));
    int32_t *b_src = be_buf(be, sizeof(int32_t) * (size_t)R_cap);
    int32_t *b_counts = be_buf(be, sizeof(int32_t) * E);
    float *b_w = be_raw(be, w, sizeof(float) * (size_t)N * K);
    void *b_x = be_act(be, x, (size_t)N * D), *b_xp = be_buf(be, (size_t)R_cap * D * act);
    void *b_yp = be_buf(be, (size_t)R_cap * D * act), *b_y = be_buf(be, (size_t)(N + 1) * D * act);
    void *b_xl = be_buf(be, lcap * act), *b_yl = be_buf(be, lcap * act);
    MUST(be->moe_index(be, b_slot, b_src, b_counts, rows, b_idx, N, K, E, 1, R_cap));
    int R = 0;
    for (int e = 0; e < E; e++) R += rows[e];
    MUST(be->moe_permute(be, b_xp, b_x, b_src, R, D));
    from_act(be, xp, b_xp, (size_t)R * D);

    /* 1. dispatch against the plain layout */
    int64_t s0, r0;
    mt_moe_a2a_bytes(d, &s0, &r0);
    void *xl = NULL;
    to_act(be, b_xl, poison, lcap);
    /* the forward gathers from the tokens (the layer's way); xp is poisoned */
    void *b_poisoned = be_act(be, poison, (size_t)R_cap * D);
    x_dispatch(d, be, &plan, 1, &xl, b_xl, b_poisoned, b_x, b_src, rows, D);
    be->free(be, b_poisoned);
    CHECK(xl == b_xl, "%s: dispatch did not use the local buffer", what);
    int64_t at = 0, expect_recv = 0;
    for (int e = 0; e < El; e++) {
        const int g = d->e_lo + e;
        int64_t first = at;
        for (int q = 0; q < size_; q++) {
            int64_t got = 0;
            for (int n = 0; n < all[q].N; n++)
                for (int k = 0; k < K; k++)
                    if (all[q].idx[n * K + k] == g) {
                        for (int j = 0; j < D; j++) want[at * D + j] = x_of(q, n, j, round);
                        at++;
                        got++;
                    }
            for (; got % align; got++, at++)
                for (int j = 0; j < D; j++) want[at * D + j] = 0.0f;
            CHECK(padded_of(plan.from[q * El + e], align) == got,
                  "%s: expert %d: %lld rows from rank %d, want %lld with padding", what, g,
                  (long long)plan.from[q * El + e], q, (long long)got);
            if (q != rank_) expect_recv += plan.from[q * El + e];
        }
        CHECK(plan.local_rows[e] == at - first, "%s: expert %d: %d local rows, want %lld", what,
              g, plan.local_rows[e], (long long)(at - first));
    }
    CHECK(plan.Rl == at && plan.R == R, "%s: Rl %d (want %lld), R %d (want %d)", what, plan.Rl,
          (long long)at, plan.R, R);
    from_act(be, xl_h, b_xl, (size_t)at * D);
    if (plan.Rl == at)
        CHECK(memcmp(xl_h, want, sizeof(float) * (size_t)(at * D)) == 0,
              "%s: the local layout differs from the plain one", what);
    int64_t s1, r1;
    mt_moe_a2a_bytes(d, &s1, &r1);
    int64_t expect_sent = 0; /* each owner's run once per slice */
    for (int q = 0; q < size_; q++)
        if (q != rank_) expect_sent += plan.sent[q];
    for (int q = 0; q < size_; q++)
        CHECK(plan.sent[q] == plan.sent[q / T * T], "%s: slices %d and %d of one owner get %lld "
              "and %lld rows", what, q / T * T, q, (long long)plan.sent[q / T * T],
              (long long)plan.sent[q]);
    const int64_t cnt_bytes = (int64_t)(size_ - 1) * El * 8, ws = (int64_t)mt_comm_dtype_size(wire);
    CHECK(s1 - s0 == expect_sent * D * ws + cnt_bytes && r1 - r0 == expect_recv * D * ws + cnt_bytes,
          "%s: byte counters %lld sent, %lld received; want %lld, %lld", what,
          (long long)(s1 - s0), (long long)(r1 - r0), (long long)(expect_sent * D * ws + cnt_bytes),
          (long long)(expect_recv * D * ws + cnt_bytes));

    /* 2. the scaling "experts", padding poisoned, then combine and unpermute;
     * with T slices each returns 1 / T of the output (exact: T is 1 or 2),
     * and combine's sum over the slices gives the whole */
    at = 0;
    for (int e = 0; e < El; e++)
        for (int q = 0; q < size_; q++) {
            const int64_t used = plan.from[q * El + e];
            for (int64_t i = 0; i < padded_of(used, align); i++, at++)
                for (int j = 0; j < D; j++) {
                    float v = xl_h[at * D + j] * (float)(d->e_lo + e + 1);
                    v = round ? mt_bf16_round(v) : v;
                    yl[at * D + j] = i < used ? v / (float)T : NAN;
                }
        }
    to_act(be, b_yl, yl, (size_t)at * D);
    to_act(be, b_yp, poison, (size_t)R_cap * D);
    x_combine(d, be, &plan, b_yp, b_yl, D);
    if (N > 0) MUST(be->moe_unpermute(be, b_y, 0, b_yp, b_slot, b_w, N, K, D));
    from_act(be, y, b_y, (size_t)N * D);
    int bad = 0;
    for (int n = 0; n < N; n++)
        for (int j = 0; j < D; j++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) {
                float v = x[n * D + j] * (float)(idx[n * K + k] + 1);
                acc += w[n * K + k] * (round ? mt_bf16_round(v) : v);
            }
            if (round) acc = mt_bf16_round(acc);
            bad += memcmp(&acc, &y[n * D + j], sizeof acc) != 0;
        }
    CHECK(bad == 0, "%s: %d combined values differ from the plain sum", what, bad);

    /* 3. the backward's dispatch reuses the plan */
    for (int i = 0; i < R * D; i++) xp[i] = round ? mt_bf16_round(-2.0f * xp[i]) : -2.0f * xp[i];
    to_act(be, b_xp, xp, (size_t)R * D);
    to_act(be, b_xl, poison, lcap);
    int64_t s2, r2;
    mt_moe_a2a_bytes(d, &s2, &r2);
    x_dispatch(d, be, &plan, 0, &xl, b_xl, b_xp, NULL, NULL, rows, D);
    for (int64_t i = 0; i < at * D; i++) want[i] = -2.0f * want[i] + 0.0f; /* padding: +0 */
    from_act(be, xl_h, b_xl, (size_t)at * D);
    CHECK(memcmp(xl_h, want, sizeof(float) * (size_t)(at * D)) == 0,
          "%s: the backward's dispatch differs from the forward's layout", what);
    int64_t s3, r3;
    mt_moe_a2a_bytes(d, &s3, &r3);
    CHECK(s3 - s2 == expect_sent * D * ws, "%s: the backward's dispatch exchanged counts again",
          what);

    mt_moe_plan_free(&plan);
    d->destroy(d);
    void *bufs[] = {b_idx, b_slot, b_src, b_counts, b_w, b_x, b_xp, b_yp, b_y, b_xl, b_yl};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) be->free(be, bufs[i]);
    free(x);
    free(xp);
    free(y);
    free(w);
    free(xl_h);
    free(yl);
    free(want);
    free(poison);
    free(all);
}

/* 5. The FP8 payload: tokens of Dq values quantised once (quant_rows, one
 * segment), dispatched as e4m3 rows with their scales; on arrival the e4m3
 * rows and scales are bit for bit quant_rows of the plain local layout over
 * the plan's local segments (the tiles are per row), the act rows their
 * dequantised values, and only W = mt_fp8_wire_row_bytes(Dq) bytes per row
 * left the rank. Dq: several 128-tiles, a partial last one; odd Dq (not
 * a multiple of 4) pads the wire rows. */
static void run_fp8_case(mt_comm *c, mt_backend *be, int pat, int align, int Dq)
{
    const int El = E / size_, KB = (Dq + 127) / 128;
    char what[112];
    snprintf(what, sizeof what, "fp8 payload, %s, align %d, hidden %d%s", PAT_NAME[pat], align,
             Dq, parts_ ? ", in two parts" : "");
    routed *all = calloc((size_t)size_, sizeof *all);
    if (!all) die("out of memory", MT_ENOMEM);
    for (int r = 0; r < size_; r++) {
        all[r].N = tokens_of(r, pat);
        routes_of(r, pat, all[r].N, all[r].idx);
    }
    const int N = all[rank_].N;
    if (be->kind == MT_BE_CPU) be->round_bf16 = 1;
    mt_moe_dispatcher *d;
    MUST(mt_moe_dispatch_a2a(&d, c, E, MT_COMM_BF16));
    mt_moe_plan plan;
    MUST(mt_moe_plan_init(&plan, size_, El, align));
    plan.Rl_cap = mt_moe_local_rows_cap(d, 64, K, align);
    const size_t act = mt_act_size(be), Rc = (size_t)plan.Rl_cap;
    /* tokens: bf16 values of varied magnitude per 128-tile */
    float *x = malloc(sizeof(float) * ((size_t)N * Dq + 1));
    float *want = calloc(Rc * Dq, sizeof(float));
    if (!x || !want) die("out of memory", MT_ENOMEM);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < Dq; j++)
            x[(size_t)n * Dq + j] = mt_bf16_round(x_of(rank_, n, j % D, 1) * (float)(1 + j / 128));
    int rows[E];
    int32_t *b_idx = be_raw(be, all[rank_].idx, sizeof(int32_t) * (size_t)N * K);
    int32_t *b_slot = be_buf(be, sizeof(int32_t) * (size_t)(N * K + 1));
    int32_t *b_src = be_buf(be, sizeof(int32_t) * (size_t)(N * K + 1));
    int32_t *b_counts = be_buf(be, sizeof(int32_t) * E);
    void *b_x = be_act(be, x, (size_t)N * Dq);
    uint8_t *b_xq = be_buf(be, (size_t)N * Dq + 1);
    float *b_xs = be_buf(be, 4 * ((size_t)N * KB + 1));
    uint8_t *b_ql = be_buf(be, Rc * Dq), *b_rq = be_buf(be, Rc * Dq);
    float *b_sl = be_buf(be, 4 * Rc * KB), *b_rs = be_buf(be, 4 * Rc * KB);
    void *b_xl = be_buf(be, Rc * Dq * act), *b_want = be_buf(be, Rc * Dq * act);
    MUST(be->moe_index(be, b_slot, b_src, b_counts, rows, b_idx, N, K, E, 1, N * K + 1));
    int one[1] = {N};
    if (N > 0) MUST(be->quant_rows(be, b_xq, b_xs, b_x, Dq, one, 1, Dq));
    int64_t s0, r0, s1, r1;
    mt_moe_a2a_bytes(d, &s0, &r0);
    x_dispatch_fp8(d, be, &plan, b_ql, b_sl, b_xl, b_xq, b_xs, N, b_src, rows, Dq);
    mt_moe_a2a_bytes(d, &s1, &r1);
    /* the plain local layout, then quant_rows over the plan's segments */
    int64_t at = 0, recv = 0;
    for (int e = 0; e < El; e++)
        for (int q = 0; q < size_; q++) {
            int64_t got = 0;
            for (int n = 0; n < all[q].N; n++)
                for (int k = 0; k < K; k++)
                    if (all[q].idx[n * K + k] == d->e_lo + e) {
                        for (int j = 0; j < Dq; j++)
                            want[at * Dq + j] =
                                mt_bf16_round(x_of(q, n, j % D, 1) * (float)(1 + j / 128));
                        at++;
                        got++;
                    }
            if (q != rank_) recv += got;
            for (; got % align; got++) at++; /* zero rows (calloc) */
        }
    CHECK(plan.Rl == at, "%s: Rl %d, want %lld", what, plan.Rl, (long long)at);
    const int64_t Rl = plan.Rl < at ? plan.Rl : at;
    to_act(be, b_want, want, (size_t)Rl * Dq);
    if (Rl > 0) MUST(be->quant_rows(be, b_rq, b_rs, b_want, Dq, plan.local_rows, El, Dq));
    uint8_t *ql = malloc((size_t)Rl * Dq + 1), *rq = malloc((size_t)Rl * Dq + 1);
    float *sl = malloc(4 * ((size_t)Rl * KB + 1)), *rs = malloc(4 * ((size_t)Rl * KB + 1));
    float *xl = malloc(4 * ((size_t)Rl * Dq + 1));
    if (!ql || !rq || !sl || !rs || !xl) die("out of memory", MT_ENOMEM);
    if (Rl > 0) {
        MUST(be->download(be, ql, b_ql, (size_t)Rl * Dq));
        MUST(be->download(be, rq, b_rq, (size_t)Rl * Dq));
        MUST(be->download(be, sl, b_sl, 4 * (size_t)Rl * KB));
        MUST(be->download(be, rs, b_rs, 4 * (size_t)Rl * KB));
    }
    from_act(be, xl, b_xl, (size_t)Rl * Dq);
    CHECK(memcmp(ql, rq, (size_t)Rl * Dq) == 0, "%s: e4m3 rows differ from quant_rows of the "
          "local layout", what);
    CHECK(memcmp(sl, rs, 4 * (size_t)Rl * KB) == 0, "%s: scales differ from quant_rows' "
          "per-segment layout", what);
    int bad = 0;
    int64_t r_g = 0;
    for (int e = 0; e < El; e++) {
        for (int64_t i = 0; i < plan.local_rows[e] && r_g + i < Rl; i++)
            for (int j = 0; j < Dq; j++) {
                const int64_t row = r_g + i;
                const float sc = rs[KB * r_g + (int64_t)(j / 128) * plan.local_rows[e] + i];
                const float v = mt_bf16_round(mt_e4m3_to_f32(rq[row * Dq + j]) * sc);
                bad += memcmp(&v, &xl[row * Dq + j], 4) != 0;
            }
        r_g += plan.local_rows[e];
    }
    CHECK(bad == 0, "%s: %d act values differ from the dequantised e4m3 rows", what, bad);
    const int64_t W = (int64_t)mt_fp8_wire_row_bytes(Dq), cnt = (int64_t)(size_ - 1) * El * 8;
    int64_t R = 0;
    for (int e = 0; e < E; e++) R += rows[e];
    CHECK(s1 - s0 == (R - plan.sent[rank_]) * W + cnt && r1 - r0 == recv * W + cnt,
          "%s: byte counters %lld sent, %lld received; want %lld, %lld", what,
          (long long)(s1 - s0), (long long)(r1 - r0), (long long)((R - plan.sent[rank_]) * W + cnt),
          (long long)(recv * W + cnt));
    mt_moe_plan_free(&plan);
    d->destroy(d);
    void *bufs[] = {b_idx, b_slot, b_src, b_counts, b_x, b_xq, b_xs, b_ql, b_rq, b_sl, b_rs,
                    b_xl, b_want};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) be->free(be, bufs[i]);
    free(x);
    free(want);
    free(ql);
    free(rq);
    free(sl);
    free(rs);
    free(xl);
    free(all);
}

/* Refusals that name what is wrong. */
static void refusals(mt_comm *c)
{
    mt_moe_dispatcher *d;
    if (size_ > 1) {
        int rc = mt_moe_dispatch_a2a(&d, c, E + 1, MT_COMM_F32);
        CHECK(rc == MT_EINVAL && strstr(mt_errmsg(), "does not divide"),
              "ep %d over %d experts not refused: %d %s", size_, E + 1, rc, mt_errmsg());
    }
    int rc = mt_moe_dispatch_a2a(&d, c, E, MT_COMM_E4M3);
    CHECK(rc == MT_EINVAL && strstr(mt_errmsg(), "e4m3"), "an e4m3 wire not refused: %d %s", rc,
          mt_errmsg());
    /* a bf16 wire would round the fp32 recipe's activations */
    mt_backend *be;
    MUST(mt_backend_cpu_create(&be, 1));
    be->round_bf16 = 0;
    MUST(mt_moe_dispatch_a2a(&d, c, E, MT_COMM_BF16));
    mt_moe_plan plan;
    MUST(mt_moe_plan_init(&plan, size_, E / size_, 1));
    int rows[E] = {0};
    float xp[1] = {0}, xl_buf[1];
    void *xl;
    rc = d->dispatch(d, be, &plan, 1, &xl, xl_buf, xp, NULL, NULL, rows, D);
    CHECK(rc == MT_EINVAL && strstr(mt_errmsg(), "fp32"), "bf16 wire on unrounded values: %d %s",
          rc, mt_errmsg());
    mt_moe_plan_free(&plan);
    d->destroy(d);
    be->destroy(be);
    mt_err_clear();
}

int main(int argc, char **argv)
{
    /* --gpu BACKEND: device buffers of the CUDA backend (ranks share GPUs
     * round-robin) through a device communicator: staged, nccl or local */
    const char *gpu = argc > 2 && !strcmp(argv[1], "--gpu") ? argv[2] : NULL;
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    int world_rank = 0, world_size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    rank_ = world_rank;
    const int ndev = gpu ? mt_cuda_device_count() : 0;
    if (gpu && (ndev < 1 || (!strcmp(gpu, "nccl") && ndev < world_size))) {
        if (world_rank == 0)
            fprintf(stderr, "SKIP: %d CUDA device(s) for %d rank(s) on %s\n", ndev, world_size,
                    gpu);
        MPI_Finalize();
        return 77;
    }
    mt_comm *c;
    mt_comm_opts o = {.backend = MT_COMM_MPI, .mem = MT_COMM_HOST};
    if (gpu) {
        o.mem = MT_COMM_DEVICE;
        MUST(mt_comm_backend_parse(gpu, &o.backend));
    }
    mt_backend *be;
    if (gpu) {
        const int sharers = (world_size + ndev - 1) / ndev;
        MUST(mt_backend_cuda_create_shared(&be, world_rank % ndev, sharers));
    } else {
        MUST(mt_backend_cpu_create(&be, 1));
    }
    MUST(mt_comm_world(&c, &o));
    rank_ = mt_comm_rank(c);
    size_ = mt_comm_size(c);
    if (E % size_ != 0) {
        if (rank_ == 0) fprintf(stderr, "SKIP: %d ranks do not divide %d experts\n", size_, E);
        mt_comm_destroy(c);
        be->destroy(be);
        MPI_Finalize();
        return 77;
    }
    /* the CUDA backend's act values are bf16: only the bf16 wire fits;
     * 8.: parts where etp = 1 leaves two local experts or more */
    for (parts_ = 0; parts_ <= (E / size_ >= 2); parts_++) {
        for (int pat = 0; pat < PAT_COUNT; pat++)
            for (int wi = gpu ? 1 : 0; wi < 2; wi++)
                for (int align = 1; align <= 8; align += 7)
                    for (int T = 1; T <= (parts_ ? 1 : 2); T++)
                        if (size_ % T == 0 && E % (size_ / T) == 0)
                            run_case(c, be, pat, wi ? MT_COMM_BF16 : MT_COMM_F32, align, T);
        for (int pat = 0; pat < PAT_COUNT; pat++) {
            run_fp8_case(c, be, pat, 8, 300);
            run_fp8_case(c, be, pat, 128, 258);
        }
    }
    parts_ = 0;
    if (!gpu) refusals(c);
    else /* 6. */
        CHECK(mt_comm_stream(c) == (mt_comm_host_sync_forced() ? NULL : be->stream(be)),
              "the ep group's compute stream is %p, the backend's %p (MT_COMM_HOST_SYNC=1: %d)",
              mt_comm_stream(c), be->stream(be), mt_comm_host_sync_forced());
    int ok = mt_comm_agree(c, failures == 0);
    if (rank_ == 0)
        printf("test_moe_dispatch: %d rank%s%s%s, %d route patterns x (%d wire(s) x 2 paddings "
               "+ the FP8 payload x 2 widths): %s\n", size_, size_ == 1 ? "" : "s", gpu ? ", device buffers over " : "",
               gpu ? gpu : "", PAT_COUNT, gpu ? 1 : 2,
               ok == 1 ? "equal to the plain reference" : "FAILED");
    mt_comm_destroy(c);
    be->destroy(be);
    MPI_Finalize();
    return ok == 1 ? 0 : 1;
}
