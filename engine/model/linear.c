/* linear.c - y = x W^T in the recipe's precision, forward and backward.
 *
 * fp8-blockwise (DESIGN.md numerics), for FP8-eligible weights:
 *   forward   y  = Q_row(x) . Wq^T                 x tiles 1x128 along K
 *   data grad dx = Q_row(dy) . (Wq^T)^T            the exact transposed copy qt
 *   weight    dW += Q_colT(dy)^T . Q_colT(x)       both re-quantised along M
 * bf16 / fp32 recipes, and non-FP8 weights: act GEMMs with fp32 accumulation.
 */
#include "engine/model/layers.h"
#include "kernels/mt_fp8.h"
#include "base/mt_status.h"

int mt_linear_is_fp8(const mt_ctx *c, const mt_param *w)
{
    return c->recipe == MT_RECIPE_FP8_BLOCKWISE && mt_param_kind_is_fp8(w->d.kind);
}

static size_t rows_scale_bytes(int64_t M, int64_t K) { return 4 * (size_t)(M * ((K + 127) / 128)); }
static size_t colt_scale_bytes(int64_t M, int64_t K, int G)
{
    /* Each segment may end in a partial tile: one extra tile row per segment. */
    return 4 * (size_t)(K * ((M + 127) / 128 + G));
}

size_t mt_linear_ws_bytes(int64_t M, int64_t in, int64_t out)
{
    int64_t mx = in > out ? in : out;
    /* backward: Q_row(dy), Q_colT(dy), Q_colT(x) with their scales, + slack */
    return 3 * (size_t)(M * mx) + 2 * rows_scale_bytes(M, mx) + 2 * colt_scale_bytes(M, mx, 1) +
           4096;
}

int mt_linear_fwd(const mt_ctx *c, const mt_param *w, void *y, int ldy, const void *x, int ldx,
                  int M)
{
    mt_backend *be = c->be;
    const int N = (int)w->d.rows, K = (int)w->d.cols;
    if (!mt_linear_is_fp8(c, w))
        return be->gemm(be, y, 0, ldy, x, ldx, 0, w->w, K, 0, M, N, K, 1.0f, 0);
    size_t mark = mt_ws_mark(c->ws);
    uint8_t *xq;
    float *xs;
    MT_WS(xq, c->ws, (size_t)M * K);
    MT_WS(xs, c->ws, rows_scale_bytes(M, K));
    int rows[1] = {M};
    int rc = be->quant_rows(be, xq, xs, x, ldx, rows, 1, K);
    if (rc == MT_OK)
        rc = be->gemm_fp8(be, 0, y, 0, ldy, 0, xq, xs, w->q, w->s, 0, 0, rows, 1, N, K, 0);
    mt_ws_release(c->ws, mark);
    return rc;
}

/* dW += dy^T x with both operands quantised along the M (token) axis. */
static int fp8_wgrad(const mt_ctx *c, mt_param *w, const void *dy, int lddy, const void *x,
                     int ldx, const int *rows, int G, int64_t c_stride)
{
    mt_backend *be = c->be;
    const int N = (int)w->d.rows, K = (int)w->d.cols;
    int64_t M = 0;
    for (int g = 0; g < G; g++) M += rows[g];
    size_t mark = mt_ws_mark(c->ws);
    uint8_t *dyt, *xt;
    float *dyts, *xts;
    int rc;
    MT_WS(dyt, c->ws, (size_t)(M * N));
    MT_WS(dyts, c->ws, colt_scale_bytes(M, N, G));
    MT_WS(xt, c->ws, (size_t)(M * K));
    MT_WS(xts, c->ws, colt_scale_bytes(M, K, G));
    rc = be->quant_cols_t(be, dyt, dyts, dy, lddy, rows, G, N);
    if (rc == MT_OK) rc = be->quant_cols_t(be, xt, xts, x, ldx, rows, G, K);
    if (rc == MT_OK)
        rc = be->gemm_fp8(be, 1, w->grad, 1, K, c_stride, dyt, dyts, xt, xts, 0, 0, rows, G, N,
                          K, 1);
    mt_ws_release(c->ws, mark);
    return rc;
}

int mt_linear_bwd(const mt_ctx *c, mt_param *w, void *dx, int lddx, int accumulate,
                  const void *dy, int lddy, const void *x, int ldx, int M)
{
    mt_backend *be = c->be;
    const int N = (int)w->d.rows, K = (int)w->d.cols;
    int rows[1] = {M};
    if (!mt_linear_is_fp8(c, w)) {
        if (dx) MT_CHECK(be->gemm(be, dx, 0, lddx, dy, lddy, 0, w->w, K, 1, M, K, N, 1.0f, accumulate));
        return be->gemm(be, w->grad, 1, K, dy, lddy, 1, x, ldx, 1, N, K, M, 1.0f, 1);
    }
    if (dx) {
        size_t mark = mt_ws_mark(c->ws);
        uint8_t *dyq;
        float *dys;
        MT_WS(dyq, c->ws, (size_t)M * N);
        MT_WS(dys, c->ws, rows_scale_bytes(M, N));
        int rc = be->quant_rows(be, dyq, dys, dy, lddy, rows, 1, N);
        if (rc == MT_OK)
            rc = be->gemm_fp8(be, 0, dx, 0, lddx, 0, dyq, dys, w->qt, w->st, 0, 0, rows, 1, K, N,
                              accumulate);
        mt_ws_release(c->ws, mark);
        MT_CHECK(rc);
    }
    return fp8_wgrad(c, w, dy, lddy, x, ldx, rows, 1, 0);
}

/* Element strides between consecutive experts' tensors of one projection. */
static int64_t expert_stride(const mt_param *w) { return w->d.rows * w->d.cols; }
static int64_t expert_scale_stride(int64_t rows, int64_t cols)
{
    return ((rows + 127) / 128) * ((cols + 127) / 128);
}

int mt_linear_grouped_fwd(const mt_ctx *c, const mt_param *w, void *y, int ldy, const void *x,
                          int ldx, const int *rows, int G)
{
    mt_backend *be = c->be;
    const int N = (int)w->d.rows, K = (int)w->d.cols;
    int64_t M = 0;
    for (int g = 0; g < G; g++) M += rows[g];
    if (!mt_linear_is_fp8(c, w))
        return be->gemm_grouped(be, 0, y, 0, ldy, 0, x, ldx, 0, w->w, K, 0, expert_stride(w),
                                rows, G, N, K, 1.0f, 0);
    size_t mark = mt_ws_mark(c->ws);
    uint8_t *xq;
    float *xs;
    MT_WS(xq, c->ws, (size_t)(M * K));
    MT_WS(xs, c->ws, rows_scale_bytes(M, K));
    int rc = be->quant_rows(be, xq, xs, x, ldx, rows, G, K);
    if (rc == MT_OK)
        rc = be->gemm_fp8(be, 0, y, 0, ldy, 0, xq, xs, w->q, w->s, expert_stride(w),
                          expert_scale_stride(N, K), rows, G, N, K, 0);
    mt_ws_release(c->ws, mark);
    return rc;
}

int mt_linear_grouped_bwd(const mt_ctx *c, mt_param *w, void *dx, int lddx, int accumulate,
                          const void *dy, int lddy, const void *x, int ldx, const int *rows,
                          int G)
{
    mt_backend *be = c->be;
    const int N = (int)w->d.rows, K = (int)w->d.cols;
    int64_t M = 0;
    for (int g = 0; g < G; g++) M += rows[g];
    if (!mt_linear_is_fp8(c, w)) {
        if (dx)
            MT_CHECK(be->gemm_grouped(be, 0, dx, 0, lddx, 0, dy, lddy, 0, w->w, K, 1,
                                      expert_stride(w), rows, G, K, N, 1.0f, accumulate));
        return be->gemm_grouped(be, 1, w->grad, 1, K, expert_stride(w), dy, lddy, 0, x, ldx, 0,
                                0, rows, G, N, K, 1.0f, 1);
    }
    if (dx) {
        size_t mark = mt_ws_mark(c->ws);
        uint8_t *dyq;
        float *dys;
        MT_WS(dyq, c->ws, (size_t)(M * N));
        MT_WS(dys, c->ws, rows_scale_bytes(M, N));
        int rc = be->quant_rows(be, dyq, dys, dy, lddy, rows, G, N);
        if (rc == MT_OK)
            rc = be->gemm_fp8(be, 0, dx, 0, lddx, 0, dyq, dys, w->qt, w->st, expert_stride(w),
                              expert_scale_stride(K, N), rows, G, K, N, accumulate);
        mt_ws_release(c->ws, mark);
        MT_CHECK(rc);
    }
    return fp8_wgrad(c, w, dy, lddy, x, ldx, rows, G, expert_stride(w));
}
