/* cpu_fp8.c - FP8 E4M3 quantisation (1x128 rows, 128x1 columns transposed,
 * 128x128 blocks), block transpose and dequantisation, and the grouped FP8
 * GEMM. Scalar rules (scale, rounding, saturation) are those of mt_fp8.h,
 * applied bit for bit; layouts are those of ops.h. */
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_impl.h"
#include "base/mt_rng.h"

/* e4m3 code of x: the rule of mt_e4m3_from_f32 (round to nearest even,
 * subnormals in steps of 2^-9, saturation at +-448, NaN -> 0x7f | sign)
 * in integer and IEEE-add steps with no branch or library call, so that the
 * quantisation loops vectorise (selects are written as masks and minima:
 * GCC does not if-convert them otherwise). Bit-identical to
 * mt_e4m3_from_f32 for every finite and NaN float (checked over all 2^32
 * inputs); infinities saturate, as the rule says. */
static inline uint8_t e4m3_encode(float x)
{
    uint32_t u = mt_f32_bits(x), a = u & 0x7fffffffu;
    /* |x| < 2^-6: |x| + 2^14 rounds |x| to a multiple of 2^-9 (RNE); the
     * low bits are the code 0..8. Larger |x| give larger values here. */
    uint32_t sub = mt_f32_bits(fabsf(x) + 0x1p14f) - 0x46800000u;
    /* |x| >= 2^-6: round the mantissa to 3 bits (RNE, carrying into the
     * exponent) and rebias the exponent from 127 to 7; all-ones below 2^-6 */
    uint32_t nrm = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    nrm |= 0u - (uint32_t)(a < 0x3c800000u);
    uint32_t c = sub < nrm ? sub : nrm;
    c = c > 0x7eu ? 0x7eu : c;             /* saturate at 448 */
    c |= 0u - (uint32_t)(a > 0x7f800000u); /* NaN */
    return (uint8_t)(((u >> 24) & 0x80u) | (c & 0x7fu));
}

/* max |x[i]|, i < n (NaNs ignored, like fmaxf), in 8 lanes. */
static float amax_f32(const float *x, int n)
{
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0}, m = 0.0f;
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            float a = fabsf(x[i + j]);
            lane[j] = a > lane[j] ? a : lane[j];
        }
    for (int j = 0; j < 8; j++) m = lane[j] > m ? lane[j] : m;
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
    }
    return m;
}

/* q[i] = e4m3(x[i] / s), IEEE division as the rule says. */
static void encode_run(uint8_t *restrict q, const float *restrict x, int n, float s)
{
    for (int i = 0; i < n; i++) q[i] = e4m3_encode(x[i] / s);
}

/* Segment starts r_g, g <= G, of a host rows[] array (rows checked). */
static int64_t *seg_starts(const int *rows, int G)
{
    int64_t *r = malloc(sizeof(int64_t) * (size_t)(G + 1));
    if (!r) return NULL;
    r[0] = 0;
    for (int g = 0; g < G; g++) r[g + 1] = r[g] + rows[g];
    return r;
}

/* Segment of global row m: the g with r[g] <= m < r[g + 1] (rows[g] > 0). */
static int seg_of(const int64_t *r, int G, int64_t m)
{
    int lo = 0, hi = G - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (r[mid] <= m) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static int cpu_quant_rows(mt_backend *be, uint8_t *q, float *s, const void *x, int ldx,
                          const int *rows, int G, int K)
{
    int M;
    MT_CHECK(mt_segments_total("quant_rows", rows, G, &M));
    CPU_REQUIRE(K >= 1 && ldx >= K, "quant_rows: K=%d ldx=%d", K, ldx);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(q && s && x, "quant_rows: NULL pointer");
    int64_t *r = seg_starts(rows, G);
    if (!r) return MT_ERR(MT_ENOMEM, "quant_rows: out of memory");
    const float *xf = x;
    int KB = mt_ceil_div(K, MT_QTILE);
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)M * K))
    for (int64_t m = 0; m < M; m++) {
        int g = seg_of(r, G, m);
        int64_t i = m - r[g];
        float *sg = s + KB * r[g]; /* [KB, rows[g]] */
        for (int kb = 0; kb < KB; kb++) {
            int k0 = kb * MT_QTILE, n = K - k0 < MT_QTILE ? K - k0 : MT_QTILE;
            const float *xt = xf + m * ldx + k0;
            float sc = mt_fp8_scale(amax_f32(xt, n));
            sg[kb * rows[g] + i] = sc;
            encode_run(q + m * K + k0, xt, n, sc);
        }
    }
    free(r);
    return MT_OK;
}

/* Columns encoded per pass of quant_cols_t: the codes of CT columns x 128
 * rows are gathered in a small buffer and written out transposed. */
#define CT 64

/* One row tile (rows i0..i0+n-1 of segment g, n <= 128) of quant_cols_t:
 * per-column scales sg [K], codes into qg [K, rows] at column offset i0.
 * ws: K floats + CT * 128 bytes. */
static void quant_cols_tile(uint8_t *qg, int rows, int i0, float *sg, const float *xs, int ldx,
                            int n, int K, float *ws)
{
    float *cm = ws;
    uint8_t *tq = (uint8_t *)(ws + K);
    for (int k = 0; k < K; k++) cm[k] = 0.0f;
    for (int i = 0; i < n; i++) {
        const float *xr = xs + (int64_t)i * ldx;
        for (int k = 0; k < K; k++) {
            float a = fabsf(xr[k]);
            cm[k] = a > cm[k] ? a : cm[k];
        }
    }
    for (int k = 0; k < K; k++) sg[k] = mt_fp8_scale(cm[k]);
    for (int k0 = 0; k0 < K; k0 += CT) {
        int nk = K - k0 < CT ? K - k0 : CT;
        for (int i = 0; i < n; i++) {
            const float *xr = xs + (int64_t)i * ldx + k0;
            for (int kk = 0; kk < nk; kk++)
                tq[kk * MT_QTILE + i] = e4m3_encode(xr[kk] / sg[k0 + kk]);
        }
        for (int kk = 0; kk < nk; kk++)
            memcpy(qg + (int64_t)(k0 + kk) * rows + i0, tq + kk * MT_QTILE, (size_t)n);
    }
}

static int cpu_quant_cols_t(mt_backend *be, uint8_t *q, float *s, const void *x, int ldx,
                            const int *rows, int G, int K)
{
    int M;
    MT_CHECK(mt_segments_total("quant_cols_t", rows, G, &M));
    CPU_REQUIRE(K >= 1 && ldx >= K, "quant_cols_t: K=%d ldx=%d", K, ldx);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(q && s && x, "quant_cols_t: NULL pointer");
    /* work items: (segment g, row tile ib); tb[g] = tiles before segment g */
    int nt = cpu_team(be, (int64_t)M * K);
    size_t per = ((size_t)K * sizeof(float) + CT * MT_QTILE + 63) / 64 * 64;
    int64_t *r = seg_starts(rows, G), *tb = seg_starts(rows, G);
    unsigned char *ws = cpu_scratch(per * (size_t)nt);
    if (!r || !tb || !ws) {
        free(r);
        free(tb);
        free(ws);
        return MT_ERR(MT_ENOMEM, "quant_cols_t: out of memory");
    }
    for (int g = 0; g < G; g++) tb[g + 1] = tb[g] + mt_ceil_div(rows[g], MT_QTILE);
    const float *xf = x;
    int64_t items = tb[G];
#pragma omp parallel for num_threads(nt)
    for (int64_t it = 0; it < items; it++) {
        int g = seg_of(tb, G, it);
        int i0 = (int)(it - tb[g]) * MT_QTILE;
        int n = rows[g] - i0 < MT_QTILE ? rows[g] - i0 : MT_QTILE;
        /* segment g: codes [K, rows[g]] at q + K r_g; this tile's [K] scales */
        quant_cols_tile(q + K * r[g], rows[g], i0, s + K * (tb[g] + i0 / MT_QTILE),
                        xf + (r[g] + i0) * ldx, ldx, n, K,
                        (float *)(ws + per * (size_t)cpu_thread_id()));
    }
    free(r);
    free(tb);
    free(ws);
    return MT_OK;
}

/* The reference of the one-read form: the two quantisations in turn. */
static int cpu_quant_rows_cols_t(mt_backend *be, uint8_t *q, float *s, uint8_t *qt, float *st,
                                 const void *x, int ldx, const int *rows, int G, int K)
{
    MT_CHECK(cpu_quant_rows(be, q, s, x, ldx, rows, G, K));
    return cpu_quant_cols_t(be, qt, st, x, ldx, rows, G, K);
}

/* quant_blocks and quant_blocks_sr: per 128x128 block, s = scale of the
 * block amax, q = e4m3(w / s) rounded to nearest even, or stochastically by
 * mt_e4m3_from_f32_sr with u = mt_hash_uniform(seed, n * K + k) for element
 * (n, k) (the top 53 bits of mt_hash_u64). */
static int quant_blocks_any(mt_backend *be, const char *op, uint8_t *q, float *s,
                            const float *w, int N, int K, int sr, uint64_t seed)
{
    CPU_REQUIRE(N >= 1 && K >= 1, "%s: N=%d K=%d", op, N, K);
    CPU_REQUIRE(q && s && w, "%s: NULL pointer", op);
    int NB = mt_ceil_div(N, MT_QTILE), KB = mt_ceil_div(K, MT_QTILE);
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)N * K))
    for (int64_t b = 0; b < (int64_t)NB * KB; b++) {
        int nb = (int)(b / KB), kb = (int)(b % KB);
        int n0 = nb * MT_QTILE, k0 = kb * MT_QTILE;
        int nn = N - n0 < MT_QTILE ? N - n0 : MT_QTILE, nk = K - k0 < MT_QTILE ? K - k0 : MT_QTILE;
        const float *wb = w + (int64_t)n0 * K + k0;
        float amax = 0.0f;
        for (int i = 0; i < nn; i++) {
            float a = amax_f32(wb + (int64_t)i * K, nk);
            amax = a > amax ? a : amax;
        }
        float sc = mt_fp8_scale(amax);
        s[b] = sc; /* s[nb * KB + kb] */
        for (int i = 0; i < nn; i++) {
            int64_t off = (int64_t)(n0 + i) * K + k0;
            if (!sr) {
                encode_run(q + off, w + off, nk, sc);
                continue;
            }
            for (int k = 0; k < nk; k++)
                q[off + k] = mt_e4m3_from_f32_sr(w[off + k] / sc,
                                                 mt_hash_uniform(seed, (uint64_t)(off + k)));
        }
    }
    return MT_OK;
}

static int cpu_quant_blocks(mt_backend *be, uint8_t *q, float *s, const float *w, int N, int K)
{
    return quant_blocks_any(be, "quant_blocks", q, s, w, N, K, 0, 0);
}

static int cpu_quant_blocks_sr(mt_backend *be, uint8_t *q, float *s, const float *w, int N,
                               int K, uint64_t seed)
{
    return quant_blocks_any(be, "quant_blocks_sr", q, s, w, N, K, 1, seed);
}

static int cpu_transpose_blocks(mt_backend *be, uint8_t *qt, float *st, const uint8_t *q,
                                const float *s, int N, int K)
{
    CPU_REQUIRE(N >= 1 && K >= 1, "transpose_blocks: N=%d K=%d", N, K);
    CPU_REQUIRE(qt && st && q && s, "transpose_blocks: NULL pointer");
    int NB = mt_ceil_div(N, MT_QTILE), KB = mt_ceil_div(K, MT_QTILE);
    for (int kb = 0; kb < KB; kb++)
        for (int nb = 0; nb < NB; nb++) st[kb * NB + nb] = s[nb * KB + kb];
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)N * K))
    for (int k = 0; k < K; k++)
        for (int n = 0; n < N; n++) qt[(int64_t)k * N + n] = q[(int64_t)n * K + k];
    return MT_OK;
}

static int cpu_dequant_blocks(mt_backend *be, float *w, const uint8_t *q, const float *s, int N,
                              int K)
{
    CPU_REQUIRE(N >= 1 && K >= 1, "dequant_blocks: N=%d K=%d", N, K);
    CPU_REQUIRE(w && q && s, "dequant_blocks: NULL pointer");
    const float *lut = cpu_of(be)->e4m3_lut;
    int KB = mt_ceil_div(K, MT_QTILE);
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)N * K))
    for (int n = 0; n < N; n++) {
        const float *sn = s + (n / MT_QTILE) * KB;
        for (int k = 0; k < K; k++)
            w[(int64_t)n * K + k] = lut[q[(int64_t)n * K + k]] * sn[k / MT_QTILE];
    }
    return MT_OK;
}

/* Per-segment problems of the forward / data-gradient FP8 GEMM:
 * C[r_g + i, :] = A_g B_g^T with VEC128 A scales and BLK128 B scales. */
static void fp8_probs_rows(cpu_gemm_prob *pr, void *C, int c_f32, size_t ce, int ldc,
                           const uint8_t *A,
                           const float *sa, const uint8_t *B, const float *sb, int64_t b_stride,
                           int64_t sb_stride, const int *rows, int G, int N, int K,
                           int accumulate)
{
    int KB = mt_ceil_div(K, MT_QTILE);
    int64_t r = 0;
    for (int g = 0; g < G; r += rows[g], g++) {
        pr[g] = (cpu_gemm_prob){
            .M = rows[g], .N = N, .K = K,
            .A8 = A + r * K, .a_rs = K, .a_cs = 1,
            .B8 = B + g * b_stride, .b_rs = K, .b_cs = 1,
            .C = (char *)C + (size_t)(r * ldc) * ce, .c_f32 = c_f32, .ldc = ldc,
            .accumulate = accumulate,
            .sa = sa + KB * r, .sa_ks = rows[g],
            .sb = sb + g * sb_stride, .sb_ks = 1, .sb_ndiv = MT_QTILE, .sb_ns = KB,
        };
    }
}

/* Per-segment problems of the weight-gradient FP8 GEMM: both operands come
 * from quant_cols_t (A: [N, rows[g]], B: [K, rows[g]], VEC128 scales). */
static void fp8_probs_reduce(cpu_gemm_prob *pr, void *C, int c_f32, size_t ce, int ldc,
                             int64_t c_stride,
                             const uint8_t *A, const float *sa, const uint8_t *B,
                             const float *sb, const int *rows, int G, int N, int K,
                             int accumulate)
{
    int64_t r = 0, tb = 0;
    for (int g = 0; g < G; r += rows[g], tb += mt_ceil_div(rows[g], MT_QTILE), g++) {
        pr[g] = (cpu_gemm_prob){
            .M = N, .N = K, .K = rows[g],
            .A8 = A + N * r, .a_rs = rows[g], .a_cs = 1,
            .B8 = B + K * r, .b_rs = rows[g], .b_cs = 1,
            .C = (char *)C + (size_t)(g * c_stride) * ce, .c_f32 = c_f32, .ldc = ldc,
            .accumulate = accumulate,
            .sa = sa + N * tb, .sa_ks = N,
            .sb = sb + K * tb, .sb_ks = K, .sb_ndiv = 1, .sb_ns = 1,
        };
    }
}

static int cpu_gemm_fp8(mt_backend *be, int reduce, void *C, int c_f32, int ldc,
                        int64_t c_stride, const uint8_t *A, const float *sa, const uint8_t *B,
                        const float *sb, int64_t b_stride, int64_t sb_stride, const int *rows,
                        int G, int N, int K, int accumulate)
{
    int total;
    MT_CHECK(mt_segments_total("gemm_fp8", rows, G, &total));
    CPU_REQUIRE(N >= 1 && K >= 1, "gemm_fp8: N=%d K=%d", N, K);
    CPU_REQUIRE(C && A && sa && B && sb, "gemm_fp8: NULL operand or scale");
    if (reduce)
        CPU_REQUIRE(ldc >= K && c_stride >= 0, "gemm_fp8: reduce: ldc=%d < K=%d or c_stride=%lld",
                    ldc, K, (long long)c_stride);
    else
        CPU_REQUIRE(ldc >= N && b_stride >= 0 && sb_stride >= 0,
                    "gemm_fp8: ldc=%d < N=%d or negative b_stride/sb_stride", ldc, N);
    cpu_gemm_prob *pr = calloc((size_t)G, sizeof *pr);
    if (!pr) return MT_ERR(MT_ENOMEM, "gemm_fp8: out of memory");
    if (reduce)
        fp8_probs_reduce(pr, C, c_f32, mt_c_size(be, c_f32), ldc, c_stride, A, sa, B, sb, rows,
                         G, N, K, accumulate);
    else
        fp8_probs_rows(pr, C, c_f32, mt_c_size(be, c_f32), ldc, A, sa, B, sb, b_stride,
                       sb_stride, rows, G, N, K,
                       accumulate);
    int rc = cpu_gemm_run(be, "gemm_fp8", pr, G);
    free(pr);
    return rc;
}

void cpu_install_fp8(mt_backend *be)
{
    be->quant_rows = cpu_quant_rows;
    be->quant_cols_t = cpu_quant_cols_t;
    be->quant_rows_cols_t = cpu_quant_rows_cols_t;
    be->quant_blocks = cpu_quant_blocks;
    be->quant_blocks_sr = cpu_quant_blocks_sr;
    be->transpose_blocks = cpu_transpose_blocks;
    be->dequant_blocks = cpu_dequant_blocks;
    be->gemm_fp8 = cpu_gemm_fp8;
}
