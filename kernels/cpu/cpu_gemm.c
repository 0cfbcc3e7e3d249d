/* cpu_gemm.c - blocked GEMM engine (float and e4m3 operands), gemm, gemm_grouped.
 *
 * Structure (BLIS-like): the output of every problem is cut into macro tiles
 * of mc x nc; a thread owns a tile, walks K in blocks of KC (128 for FP8, one
 * quantisation tile), packs the A rows into MR-row panels [kc][MR] and the B
 * columns into NR-column panels [kc][NR], and runs an MR x NR register-tiled
 * micro-kernel that accumulates into an fp32 tile buffer. The buffer holds the
 * running sums exactly, so each output element is the same fma chain over
 * k = 0..K-1 whatever the tile sizes and the thread count: results are
 * bit-identical for any number of threads.
 */
#include <stdlib.h>
#include <string.h>

#if defined(__FMA__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "kernels/cpu/cpu_impl.h"

#define MR 6    /* micro-tile rows */
#define NR 16   /* micro-tile columns (two 8-float vectors) */
#define KC 256  /* K block of the float GEMM */
#define KT8 128 /* K block of the FP8 GEMM: one quantisation tile */
#define MC 96   /* macro-tile rows (multiple of MR) */
#define NC 256  /* macro-tile columns (multiple of NR) */

typedef float v8f __attribute__((vector_size(32)));

static inline v8f v8_load(const float *p)
{
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void v8_store(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f v8_splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* a * b + c; fused where the hardware has FMA (ops are not contracted
 * otherwise: kernels/cpu is built with -ffp-contract=off). */
static inline v8f v8_fma(v8f a, v8f b, v8f c)
{
#ifdef __FMA__
    return _mm256_fmadd_ps(a, b, c);
#else
    return a * b + c;
#endif
}

/* c[MR, NR] (row stride ldc) += a-panel [kc][MR] x b-panel [kc][NR]. */
static void ukr_f32(int kc, const float *restrict a, const float *restrict b,
                    float *restrict c, int ldc)
{
    v8f acc[MR][2];
    for (int i = 0; i < MR; i++) {
        acc[i][0] = v8_load(c + i * ldc);
        acc[i][1] = v8_load(c + i * ldc + 8);
    }
    for (int k = 0; k < kc; k++) {
        v8f b0 = v8_load(b + k * NR), b1 = v8_load(b + k * NR + 8);
        for (int i = 0; i < MR; i++) {
            v8f ai = v8_splat(a[k * MR + i]);
            acc[i][0] = v8_fma(ai, b0, acc[i][0]);
            acc[i][1] = v8_fma(ai, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < MR; i++) {
        v8_store(c + i * ldc, acc[i][0]);
        v8_store(c + i * ldc + 8, acc[i][1]);
    }
}

/* FP8 tile: t = a-panel x b-panel from zero (each product of e4m3 values is
 * exact in fp32, so the fma chain is the plain sum in k order), then
 * c[i, j] += (t[i, j] * sa[i]) * sb[j]. */
static void ukr_fp8(int kc, const float *restrict a, const float *restrict b,
                    float *restrict c, int ldc, const float *sa, const float *sb)
{
    v8f acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = v8_splat(0.0f);
    for (int k = 0; k < kc; k++) {
        v8f b0 = v8_load(b + k * NR), b1 = v8_load(b + k * NR + 8);
        for (int i = 0; i < MR; i++) {
            v8f ai = v8_splat(a[k * MR + i]);
            acc[i][0] = v8_fma(ai, b0, acc[i][0]);
            acc[i][1] = v8_fma(ai, b1, acc[i][1]);
        }
    }
    v8f sb0 = v8_load(sb), sb1 = v8_load(sb + 8);
    for (int i = 0; i < MR; i++) {
        v8f si = v8_splat(sa[i]);
        v8_store(c + i * ldc, v8_load(c + i * ldc) + (acc[i][0] * si) * sb0);
        v8_store(c + i * ldc + 8, v8_load(c + i * ldc + 8) + (acc[i][1] * si) * sb1);
    }
}

/* Packs rows r0..r0+nr-1 (nr <= W) of an operand, k0..k0+kc-1, as a panel
 * [kc][W], zero-padding rows nr..W-1. The operand element (r, k) is at
 * r * rs + k * cs of x (float) or of x8 (e4m3 codes decoded with lut). */
static void pack_panel(float *restrict dst, int W, const float *x, const uint8_t *x8,
                       const float *lut, int64_t rs, int64_t cs, int r0, int nr, int k0, int kc)
{
    if (nr < W) memset(dst, 0, sizeof(float) * (size_t)W * (size_t)kc);
    if (x8) {
        for (int i = 0; i < nr; i++) {
            const uint8_t *row = x8 + (int64_t)(r0 + i) * rs + (int64_t)k0 * cs;
            for (int k = 0; k < kc; k++) dst[k * W + i] = lut[row[k * cs]];
        }
    } else if (cs == 1) {
        for (int i = 0; i < nr; i++) {
            const float *row = x + (int64_t)(r0 + i) * rs + k0;
            for (int k = 0; k < kc; k++) dst[k * W + i] = row[k];
        }
    } else {
        /* rs == 1: the operand is stored transposed, rows are contiguous per k */
        for (int k = 0; k < kc; k++) {
            const float *col = x + (int64_t)(k0 + k) * cs + r0;
            for (int i = 0; i < nr; i++) dst[k * W + i] = col[i * rs];
        }
    }
}

/* Per-thread buffers of one cpu_gemm_run. */
typedef struct gemm_bufs {
    float *ap;  /* [mc / MR][kc][MR] */
    float *bp;  /* [nc / NR][kc][NR] */
    float *acc; /* [mc][nc] */
    float *sa;  /* [mc] FP8 row scales of the current K tile */
    float *sb;  /* [nc] FP8 column scales of the current K tile */
} gemm_bufs;

/* Stores acc into C: alpha * acc (float GEMM) or acc (FP8), plus C if
 * accumulate; act outputs rounded as the backend stores them (act and f32
 * are both float on the CPU). */
static void store_tile(const mt_backend *be, const cpu_gemm_prob *p, int m0, int mb, int n0,
                       int nb, const float *acc, int ldacc)
{
    int fp8 = p->A8 != NULL, round = p->c_f32 == MT_C_ACT && be->round_bf16;
    if (p->c_f32 == MT_C_BF16) { /* bf16 bits: add in fp32, round once */
        for (int i = 0; i < mb; i++) {
            const float *ar = acc + (int64_t)i * ldacc;
            uint16_t *c = (uint16_t *)p->C + (int64_t)(m0 + i) * p->ldc + n0;
            for (int j = 0; j < nb; j++) {
                float v = fp8 ? ar[j] : p->alpha * ar[j];
                c[j] = mt_bf16_from_f32(p->accumulate ? mt_bf16_to_f32(c[j]) + v : v);
            }
        }
        return;
    }
    for (int i = 0; i < mb; i++) {
        const float *ar = acc + (int64_t)i * ldacc;
        float *c = (float *)p->C + (int64_t)(m0 + i) * p->ldc + n0;
        for (int j = 0; j < nb; j++) {
            float v = fp8 ? ar[j] : p->alpha * ar[j];
            v = p->accumulate ? c[j] + v : v;
            c[j] = round ? mt_bf16_round(v) : v;
        }
    }
}

/* Gathers the FP8 scales of K tile kb for the tile's rows and columns;
 * padding entries are 0 (their products are discarded anyway). */
static void gather_scales(const cpu_gemm_prob *p, int m0, int mb, int mpad, int n0, int nb,
                          int npad, int kb, float *sa, float *sb)
{
    for (int i = 0; i < mpad; i++) sa[i] = i < mb ? p->sa[kb * p->sa_ks + m0 + i] : 0.0f;
    for (int j = 0; j < npad; j++)
        sb[j] = j < nb ? p->sb[kb * p->sb_ks + (int64_t)((n0 + j) / p->sb_ndiv) * p->sb_ns]
                       : 0.0f;
}

static void run_tile(const mt_backend *be, const cpu_gemm_prob *p, int m0, int mb, int n0,
                     int nb, const gemm_bufs *w)
{
    const float *lut = cpu_of(be)->e4m3_lut;
    int fp8 = p->A8 != NULL;
    int mp = (mb + MR - 1) / MR, np = (nb + NR - 1) / NR, ldacc = np * NR;
    int kstep = fp8 ? KT8 : KC;
    memset(w->acc, 0, sizeof(float) * (size_t)mp * MR * (size_t)ldacc);
    for (int k0 = 0; k0 < p->K; k0 += kstep) {
        int kc = p->K - k0 < kstep ? p->K - k0 : kstep;
        for (int jr = 0; jr < np; jr++) {
            int nr = nb - jr * NR < NR ? nb - jr * NR : NR;
            pack_panel(w->bp + (int64_t)jr * NR * kc, NR, p->B, p->B8, lut, p->b_rs, p->b_cs,
                       n0 + jr * NR, nr, k0, kc);
        }
        for (int ir = 0; ir < mp; ir++) {
            int mr = mb - ir * MR < MR ? mb - ir * MR : MR;
            pack_panel(w->ap + (int64_t)ir * MR * kc, MR, p->A, p->A8, lut, p->a_rs, p->a_cs,
                       m0 + ir * MR, mr, k0, kc);
        }
        if (fp8) gather_scales(p, m0, mb, mp * MR, n0, nb, np * NR, k0 / KT8, w->sa, w->sb);
        for (int jr = 0; jr < np; jr++) {
            const float *bp = w->bp + (int64_t)jr * NR * kc;
            for (int ir = 0; ir < mp; ir++) {
                const float *ap = w->ap + (int64_t)ir * MR * kc;
                float *c = w->acc + (int64_t)ir * MR * ldacc + jr * NR;
                if (fp8)
                    ukr_fp8(kc, ap, bp, c, ldacc, w->sa + ir * MR, w->sb + jr * NR);
                else
                    ukr_f32(kc, ap, bp, c, ldacc);
            }
        }
    }
    store_tile(be, p, m0, mb, n0, nb, w->acc, ldacc);
}

static int round_up(int x, int m) { return (x + m - 1) / m * m; }
static int imin(int a, int b) { return a < b ? a : b; }
static int imax(int a, int b) { return a > b ? a : b; }

/* Tile edges: the defaults, cut down (keeping results unchanged) so that a
 * single small problem still gives every thread work. */
static void choose_tiles(const cpu_gemm_prob *probs, int P, int threads, int *mc, int *nc)
{
    *mc = MC;
    *nc = NC;
    if (P != 1 || threads == 1) return;
    int M = probs[0].M, N = probs[0].N;
    for (;;) {
        int64_t tiles = (int64_t)((M + *mc - 1) / *mc) * ((N + *nc - 1) / *nc);
        if (tiles >= 2 * threads) return;
        if (*nc > 4 * NR && *nc >= N / 2)
            *nc = round_up(*nc / 2, NR);
        else if (*mc > 4 * MR && *mc >= M / 2)
            *mc = round_up(*mc / 2, MR);
        else
            return;
    }
}

int cpu_gemm_run(mt_backend *be, const char *op, const cpu_gemm_prob *probs, int P)
{
    int threads = cpu_of(be)->threads, mc, nc;
    choose_tiles(probs, P, threads, &mc, &nc);

    /* tile counts and buffer sizes */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(P + 1));
    if (!first) return MT_ERR(MT_ENOMEM, "%s: out of memory", op);
    int64_t total = 0;
    double flops = 0;
    int kmax = 1, mmax = MR, nmax = NR;
    for (int i = 0; i < P; i++) {
        const cpu_gemm_prob *p = &probs[i];
        first[i] = total;
        if (p->M > 0 && p->N > 0)
            total += (int64_t)((p->M + mc - 1) / mc) * ((p->N + nc - 1) / nc);
        flops += 2.0 * p->M * p->N * p->K;
        kmax = imax(kmax, imin(p->K, p->A8 ? KT8 : KC));
        mmax = imax(mmax, imin(round_up(p->M, MR), mc));
        nmax = imax(nmax, imin(round_up(p->N, NR), nc));
    }
    first[P] = total;
    int nt = flops < 4e5 ? 1 : threads;
    if (nt > total) nt = total > 0 ? (int)total : 1;

    size_t n_ap = (size_t)mmax * kmax, n_bp = (size_t)nmax * kmax;
    size_t n_acc = (size_t)mmax * nmax;
    size_t per = (n_ap + n_bp + n_acc + mmax + nmax + 15) / 16 * 16;
    float *mem = cpu_scratch(sizeof(float) * per * (size_t)nt);
    if (!mem) {
        free(first);
        return MT_ERR(MT_ENOMEM, "%s: out of memory for GEMM buffers", op);
    }

#pragma omp parallel num_threads(nt)
    {
        float *base = mem + per * (size_t)cpu_thread_id();
        gemm_bufs w = {base, base + n_ap, base + n_ap + n_bp, base + n_ap + n_bp + n_acc,
                       base + n_ap + n_bp + n_acc + mmax};
        int pi = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < total; t++) {
            while (first[pi + 1] <= t) pi++; /* t only grows within a thread */
            const cpu_gemm_prob *p = &probs[pi];
            int64_t local = t - first[pi];
            int tn = (p->N + nc - 1) / nc;
            int im = (int)(local / tn), jn = (int)(local % tn);
            int m0 = im * mc, n0 = jn * nc;
            int mb = p->M - m0 < mc ? p->M - m0 : mc, nb = p->N - n0 < nc ? p->N - n0 : nc;
            run_tile(be, p, m0, mb, n0, nb, &w);
        }
    }
    free(mem);
    free(first);
    return MT_OK;
}

/* ---- ops ------------------------------------------------------------------- */

static int cpu_gemm(mt_backend *be, void *C, int c_f32, int ldc, const void *A, int lda, int ta,
                    const void *B, int ldb, int tb, int M, int N, int K, float alpha,
                    int accumulate)
{
    CPU_REQUIRE(M >= 0 && N >= 0 && K >= 0, "gemm: M=%d N=%d K=%d", M, N, K);
    if (M == 0 || N == 0) return MT_OK;
    CPU_REQUIRE(C && A && B, "gemm: NULL operand (C %p, A %p, B %p)", C, A, B);
    CPU_REQUIRE(ldc >= N, "gemm: ldc=%d < N=%d", ldc, N);
    CPU_REQUIRE(lda >= (ta ? M : K) && lda >= 1, "gemm: lda=%d too small (ta=%d M=%d K=%d)",
                lda, ta, M, K);
    CPU_REQUIRE(ldb >= (tb ? N : K) && ldb >= 1, "gemm: ldb=%d too small (tb=%d N=%d K=%d)",
                ldb, tb, N, K);
    cpu_gemm_prob p = {
        .M = M, .N = N, .K = K, .A = A, .B = B,
        .a_rs = ta ? 1 : lda, .a_cs = ta ? lda : 1,
        .b_rs = tb ? 1 : ldb, .b_cs = tb ? ldb : 1,
        .C = C, .c_f32 = c_f32, .ldc = ldc, .accumulate = accumulate, .alpha = alpha,
    };
    return cpu_gemm_run(be, "gemm", &p, 1);
}

static int cpu_gemm_grouped(mt_backend *be, int reduce, void *C, int c_f32, int ldc,
                            int64_t c_stride, const void *A, int lda, int ta, const void *B,
                            int ldb, int tb, int64_t b_stride, const int *rows, int G, int N,
                            int K, float alpha, int accumulate)
{
    int total;
    MT_CHECK(mt_segments_total("gemm_grouped", rows, G, &total));
    CPU_REQUIRE(N >= 1 && K >= 1, "gemm_grouped: N=%d K=%d", N, K);
    CPU_REQUIRE(C && A && B, "gemm_grouped: NULL operand (C %p, A %p, B %p)", C, A, B);
    cpu_gemm_prob *pr = calloc((size_t)G, sizeof *pr);
    if (!pr) return MT_ERR(MT_ENOMEM, "gemm_grouped: out of memory");
    const float *a = A, *b = B;
    char *c = C;
    const size_t ce = mt_c_size(be, c_f32); /* bytes of a C element */
    int64_t r = 0;
    if (!reduce) {
        /* C[r_g + i, :N] = A(r_g + i, :K) op(B_g) */
        if (ldc < N || lda < (ta ? total : K) || ldb < (tb ? N : K) || b_stride < 0) {
            free(pr);
            return MT_ERR(MT_EINVAL, "gemm_grouped: ldc=%d lda=%d ldb=%d b_stride=%lld too "
                          "small (N=%d K=%d rows=%d ta=%d tb=%d)", ldc, lda, ldb,
                          (long long)b_stride, N, K, total, ta, tb);
        }
        for (int g = 0; g < G; r += rows[g], g++) {
            pr[g] = (cpu_gemm_prob){
                .M = rows[g], .N = N, .K = K,
                .A = ta ? a + r : a + r * lda, .a_rs = ta ? 1 : lda, .a_cs = ta ? lda : 1,
                .B = b + g * b_stride, .b_rs = tb ? 1 : ldb, .b_cs = tb ? ldb : 1,
                .C = c + (size_t)(r * ldc) * ce, .c_f32 = c_f32, .ldc = ldc,
                .accumulate = accumulate,
                .alpha = alpha,
            };
        }
    } else {
        /* C_g[N, K] = sum_i A[r_g + i, :N]^T B[r_g + i, :K] */
        if (ldc < K || lda < N || ldb < K || c_stride < 0) {
            free(pr);
            return MT_ERR(MT_EINVAL, "gemm_grouped: reduce: ldc=%d lda=%d ldb=%d c_stride=%lld "
                          "too small (N=%d K=%d)", ldc, lda, ldb, (long long)c_stride, N, K);
        }
        for (int g = 0; g < G; r += rows[g], g++) {
            pr[g] = (cpu_gemm_prob){
                .M = N, .N = K, .K = rows[g],
                .A = a + r * lda, .a_rs = 1, .a_cs = lda,
                .B = b + r * ldb, .b_rs = 1, .b_cs = ldb,
                .C = c + (size_t)(g * c_stride) * ce, .c_f32 = c_f32, .ldc = ldc,
                .accumulate = accumulate,
                .alpha = alpha,
            };
        }
    }
    int rc = cpu_gemm_run(be, "gemm_grouped", pr, G);
    free(pr);
    return rc;
}

void cpu_install_gemm(mt_backend *be)
{
    be->gemm = cpu_gemm;
    be->gemm_grouped = cpu_gemm_grouped;
}
