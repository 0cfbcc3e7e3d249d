/* linear.c - y = x W^T in the recipe's precision, forward and backward.
 *
 * fp8-blockwise (DESIGN.md numerics), for FP8-eligible weights:
 *   forward   y  = Q_row(x) . Wq^T                 x tiles 1x128 along K
 *   data grad dx = Q_row(dy) . (Wq^T)^T            the exact transposed copy qt
 *   weight    dW += Q_colT(dy)^T . Q_colT(x)       both re-quantised along M
 * bf16 / fp32 recipes, and non-FP8 weights: act GEMMs with fp32 accumulation.
 *
 * Two projections of one input (gate and up of a SwiGLU FFN or of the
 * experts; q_a and kv_a of MLA) run as a pair: x is quantised once for both
 * forwards (Q_row(x)) and once for both weight gradients (Q_colT(x)). The
 * GEMMs and their order are those of two single calls, so the results are
 * bit-identical; what goes is a pass over x (and over the experts' permuted
 * rows, 34 k x 7168 in the DeepSeek-V3 proxy) per pair and direction.
 *
 * In the backward each dy is read once for both of its FP8 forms
 * (quant_rows_cols_t: Q_row(dy) for the data gradient, Q_colT(dy) kept for
 * the weight gradient), unless the weight gradients are deferred (a split
 * backward keeps dy itself).
 */
#include "engine/model/layers.h"
#include "kernels/mt_fp8.h"
#include "base/mt_status.h"

#include <stdlib.h>
#include <string.h>

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
    /* backward: Q_row(dy), Q_colT(dy), Q_colT(x) with their scales; a pair
     * (lin_bwd) holds Q_colT of both dy with Q_row(dy_2), then Q_colT(x);
     * + slack */
    return 3 * (size_t)(M * mx) + 2 * rows_scale_bytes(M, mx) + 3 * colt_scale_bytes(M, mx, 1) +
           4096;
}

/* The projections of one call: n weights sharing the input x, each with its
 * output (forward) or output gradient (backward). Segmented over expert
 * rows when grouped (w = the first expert's param of a contiguous run). */
typedef struct lin_set {
    int n;
    mt_param *w[2];
    void *y[2];       /* forward: y_i [M, N_i] (ldy); backward: dy_i */
    int ldy[2];
    const int *rows;  /* segments: rows[G] (grouped) or {M} */
    int G;
    int grouped;
} lin_set;

/* Element strides between consecutive experts' tensors of one projection. */
static int64_t expert_stride(const mt_param *w) { return w->d.rows * w->d.cols; }
static int64_t expert_scale_stride(int64_t rows, int64_t cols)
{
    return ((rows + 127) / 128) * ((cols + 127) / 128);
}

static int64_t rows_total(const int *rows, int G)
{
    int64_t M = 0;
    for (int g = 0; g < G; g++) M += rows[g];
    return M;
}

/* The set shares one FP8 quantisation of x: every weight FP8, same K. */
static int set_shares_fp8(const mt_ctx *c, const lin_set *l)
{
    for (int i = 0; i < l->n; i++)
        if (!mt_linear_is_fp8(c, l->w[i]) || l->w[i]->d.cols != l->w[0]->d.cols) return 0;
    return 1;
}

/* The FP8 GEMMs of a set that shares FP8, from its quantised input. */
static int lin_fwd_q(const mt_ctx *c, const lin_set *l, const uint8_t *xq, const float *xs)
{
    mt_backend *be = c->be;
    const int K = (int)l->w[0]->d.cols;
    for (int i = 0; i < l->n; i++) {
        const mt_param *w = l->w[i];
        const int N = (int)w->d.rows;
        MT_CHECK(be->gemm_fp8(be, 0, l->y[i], 0, l->ldy[i], 0, xq, xs, w->q, w->s,
                              l->grouped ? expert_stride(w) : 0,
                              l->grouped ? expert_scale_stride(N, K) : 0, l->rows, l->G, N, K,
                              0));
    }
    return MT_OK;
}

static int lin_fwd(const mt_ctx *c, const lin_set *l, const void *x, int ldx)
{
    mt_backend *be = c->be;
    const int K = (int)l->w[0]->d.cols;
    const int64_t M = rows_total(l->rows, l->G);
    if (!set_shares_fp8(c, l)) {
        for (int i = 0; i < l->n; i++) {
            const mt_param *w = l->w[i];
            const int N = (int)w->d.rows, Ki = (int)w->d.cols;
            if (mt_linear_is_fp8(c, w)) {
                lin_set one = {1, {l->w[i]}, {l->y[i]}, {l->ldy[i]}, l->rows, l->G, l->grouped};
                MT_CHECK(lin_fwd(c, &one, x, ldx));
            } else if (l->grouped) {
                MT_CHECK(be->gemm_grouped(be, 0, l->y[i], 0, l->ldy[i], 0, x, ldx, 0, w->w, Ki, 0,
                                          expert_stride(w), l->rows, l->G, N, Ki, 1.0f, 0));
            } else {
                MT_CHECK(be->gemm(be, l->y[i], 0, l->ldy[i], x, ldx, 0, w->w, Ki, 0, (int)M, N, Ki,
                                  1.0f, 0));
            }
        }
        return MT_OK;
    }
    size_t mark = mt_ws_mark(c->ws);
    uint8_t *xq;
    float *xs;
    MT_WS(xq, c->ws, (size_t)(M * K));
    MT_WS(xs, c->ws, rows_scale_bytes(M, K));
    int rc = be->quant_rows(be, xq, xs, x, ldx, l->rows, l->G, K);
    if (rc == MT_OK) rc = lin_fwd_q(c, l, xq, xs);
    mt_ws_release(c->ws, mark);
    return rc;
}

/* dx (+)= dy_i W_i from Q_row(dy_i), with W_i's exact transposed copy. */
static int lin_dgrad_q(const mt_ctx *c, const lin_set *l, int i, const uint8_t *dyq,
                       const float *dys, void *dx, int lddx, int acc)
{
    const mt_param *w = l->w[i];
    const int N = (int)w->d.rows, K = (int)w->d.cols;
    return c->be->gemm_fp8(c->be, 0, dx, 0, lddx, 0, dyq, dys, w->qt, w->st,
                           l->grouped ? expert_stride(w) : 0,
                           l->grouped ? expert_scale_stride(K, N) : 0, l->rows, l->G, K, N, acc);
}

/* dx (= or +=) sum_i dy_i W_i, in the order of the set (each a GEMM that
 * accumulates into the previous ones' sum). */
static int lin_dgrad(const mt_ctx *c, const lin_set *l, void *dx, int lddx, int accumulate)
{
    mt_backend *be = c->be;
    const int64_t M = rows_total(l->rows, l->G);
    for (int i = 0; i < l->n; i++) {
        mt_param *w = l->w[i];
        const int N = (int)w->d.rows, K = (int)w->d.cols, acc = accumulate || i > 0;
        if (!mt_linear_is_fp8(c, w)) {
            if (l->grouped)
                MT_CHECK(be->gemm_grouped(be, 0, dx, 0, lddx, 0, l->y[i], l->ldy[i], 0, w->w, K, 1,
                                          expert_stride(w), l->rows, l->G, K, N, 1.0f, acc));
            else
                MT_CHECK(be->gemm(be, dx, 0, lddx, l->y[i], l->ldy[i], 0, w->w, K, 1, (int)M, K, N,
                                  1.0f, acc));
            continue;
        }
        size_t mark = mt_ws_mark(c->ws);
        uint8_t *dyq;
        float *dys;
        MT_WS(dyq, c->ws, (size_t)(M * N));
        MT_WS(dys, c->ws, rows_scale_bytes(M, N));
        int rc = be->quant_rows(be, dyq, dys, l->y[i], l->ldy[i], l->rows, l->G, N);
        if (rc == MT_OK) rc = lin_dgrad_q(c, l, i, dyq, dys, dx, lddx, acc);
        mt_ws_release(c->ws, mark);
        MT_CHECK(rc);
    }
    return MT_OK;
}

int mt_grad_accumulate(const mt_ctx *c, mt_param *w, int n, int *accumulate)
{
    const size_t ge = mt_c_size(c->be, c->grad_type);
    int stale = 0;
    for (int g = 0; g < n; g++) stale += w[g].grad_stale != 0;
    *accumulate = stale < n;
    for (int g = 0; g < n; g++) {
        if (w[g].grad_stale && stale < n)
            MT_CHECK(c->be->zero(c->be, w[g].grad, (size_t)mt_param_numel(&w[g].d) * ge));
        w[g].grad_stale = 0;
    }
    return MT_OK;
}

/* The weights a set's i-th weight-gradient call writes: its run of experts
 * (grouped) or the one weight. */
static int set_acc(const mt_ctx *c, const lin_set *l, int i, int *accumulate)
{
    return mt_grad_accumulate(c, l->w[i], l->grouped ? l->G : 1, accumulate);
}

/* dW_i (+)= Q_colT(dy_i)^T Q_colT(x): the gradient's first write of the
 * step (set_acc) or an accumulation. */
static int lin_wgrad_q(const mt_ctx *c, const lin_set *l, int i, const uint8_t *dyt,
                       const float *dyts, const uint8_t *xt, const float *xts)
{
    mt_param *w = l->w[i];
    const int N = (int)w->d.rows, K = (int)w->d.cols;
    int acc = 1;
    MT_CHECK(set_acc(c, l, i, &acc));
    return c->be->gemm_fp8(c->be, 1, w->grad, c->grad_type, K, l->grouped ? expert_stride(w) : 0,
                           dyt, dyts, xt, xts, 0, 0, l->rows, l->G, N, K, acc);
}

/* dW_i += dy_i^T x with both operands quantised along the M (token) axis;
 * Q_colT(x) once for the set when it shares FP8. */
static int lin_wgrad_now(const mt_ctx *c, const lin_set *l, const void *x, int ldx)
{
    mt_backend *be = c->be;
    const int64_t M = rows_total(l->rows, l->G);
    if (!set_shares_fp8(c, l)) {
        for (int i = 0; i < l->n; i++) {
            mt_param *w = l->w[i];
            const int N = (int)w->d.rows, K = (int)w->d.cols;
            if (mt_linear_is_fp8(c, w)) {
                lin_set one = {1, {l->w[i]}, {l->y[i]}, {l->ldy[i]}, l->rows, l->G, l->grouped};
                MT_CHECK(lin_wgrad_now(c, &one, x, ldx));
                continue;
            }
            int acc;
            MT_CHECK(set_acc(c, l, i, &acc));
            if (l->grouped) {
                MT_CHECK(be->gemm_grouped(be, 1, w->grad, c->grad_type, K, expert_stride(w),
                                          l->y[i], l->ldy[i], 0, x, ldx, 0, 0, l->rows, l->G, N,
                                          K, 1.0f, acc));
            } else {
                MT_CHECK(be->gemm(be, w->grad, c->grad_type, K, l->y[i], l->ldy[i], 1, x, ldx, 1,
                                  N, K, (int)M, 1.0f, acc));
            }
        }
        return MT_OK;
    }
    const int K = (int)l->w[0]->d.cols;
    size_t mark = mt_ws_mark(c->ws);
    uint8_t *xt;
    float *xts;
    MT_WS(xt, c->ws, (size_t)(M * K));
    MT_WS(xts, c->ws, colt_scale_bytes(M, K, l->G));
    int rc = be->quant_cols_t(be, xt, xts, x, ldx, l->rows, l->G, K);
    for (int i = 0; i < l->n && rc == MT_OK; i++) {
        const int N = (int)l->w[i]->d.rows;
        size_t mark_i = mt_ws_mark(c->ws);
        uint8_t *dyt = mt_ws_get(c->ws, (size_t)(M * N));
        float *dyts = dyt ? mt_ws_get(c->ws, colt_scale_bytes(M, N, l->G)) : NULL;
        if (!dyts) {
            rc = MT_ENOMEM;
            break;
        }
        rc = be->quant_cols_t(be, dyt, dyts, l->y[i], l->ldy[i], l->rows, l->G, N);
        if (rc == MT_OK) rc = lin_wgrad_q(c, l, i, dyt, dyts, xt, xts);
        mt_ws_release(c->ws, mark_i);
    }
    mt_ws_release(c->ws, mark);
    return rc;
}

/* ---- the backward split: weight gradients deferred (model.h, mt_wdefer) ---- */

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

/* The next record of d, grown as needed (kept zeroed past d->n). */
static mt_wdefer_rec *defer_next(mt_wdefer *d)
{
    if (d->n == d->cap) {
        int cap = d->cap ? 2 * d->cap : 16;
        mt_wdefer_rec *r = realloc(d->r, (size_t)cap * sizeof *r);
        if (!r) return NULL;
        memset(r + d->cap, 0, (size_t)(cap - d->cap) * sizeof *r);
        d->r = r;
        d->cap = cap;
    }
    mt_wdefer_rec *r = &d->r[d->n++];
    r->mark = 0;
    return r;
}

int mt_wdefer_mark(mt_wdefer *d, int layer)
{
    mt_wdefer_rec *r = defer_next(d);
    if (!r) return MT_ERR(MT_ENOMEM, "backward split: out of memory for a layer mark");
    r->mark = 1;
    r->layer = layer;
    return MT_OK;
}

/* Records dW_i += dy_i^T x of the set: packed copies of dy_i [M, N_i] and
 * x [M, K] (act) in the record's own memory, the segment rows on the host. */
static int lin_wgrad_defer(const mt_ctx *c, const lin_set *l, const void *x, int ldx)
{
    mt_backend *be = c->be;
    mt_wdefer *d = c->defer;
    const int64_t M = rows_total(l->rows, l->G);
    const int K = (int)l->w[0]->d.cols;
    const size_t act = mt_act_size(be);
    size_t need = align256((size_t)M * K * act);
    for (int i = 0; i < l->n; i++) need += align256((size_t)M * l->w[i]->d.rows * act);
    mt_wdefer_rec *r = defer_next(d);
    if (!r) return MT_ERR(MT_ENOMEM, "backward split: out of memory for a record");
    if (r->cap < need) {
        if (r->buf) be->free(be, r->buf);
        r->buf = NULL;
        r->cap = 0;
        MT_CHECK(be->alloc(be, need, &r->buf));
        r->cap = need;
    }
    if (r->rows_cap < l->G) {
        int *rows = realloc(r->rows, (size_t)l->G * sizeof *rows);
        if (!rows) return MT_ERR(MT_ENOMEM, "backward split: out of memory (%d segments)", l->G);
        r->rows = rows;
        r->rows_cap = l->G;
    }
    memcpy(r->rows, l->rows, (size_t)l->G * sizeof *r->rows);
    r->n = l->n;
    r->G = l->G;
    r->grouped = l->grouped;
    char *p = r->buf;
    r->x = p;
    p += align256((size_t)M * K * act);
    if (M > 0) MT_CHECK(be->copy2d(be, r->x, K, x, ldx, (int)M, K, 0));
    for (int i = 0; i < l->n; i++) {
        const int N = (int)l->w[i]->d.rows;
        r->w[i] = l->w[i];
        r->dy[i] = p;
        p += align256((size_t)M * N * act);
        if (M > 0) MT_CHECK(be->copy2d(be, r->dy[i], N, l->y[i], l->ldy[i], (int)M, N, 0));
    }
    d->used += need;
    return MT_OK;
}

/* dW_i += dy_i^T x now, or recorded for later under a split backward. */
static int lin_wgrad(const mt_ctx *c, const lin_set *l, const void *x, int ldx)
{
    return c->defer ? lin_wgrad_defer(c, l, x, ldx) : lin_wgrad_now(c, l, x, ldx);
}

/* Both gradients of a set: dx (= or +=) sum_i dy_i W_i, then dW_i +=
 * dy_i^T x. Where the set shares FP8, dx is wanted and the weight
 * gradients are not deferred, each dy_i is quantised in both forms by one
 * read (quant_rows_cols_t): the row form for its data gradient at once,
 * the transposed form kept for its weight gradient after all data
 * gradients. The GEMMs, their order and their operands' bits are those of
 * lin_dgrad then lin_wgrad_now; what goes is a pass over each dy_i. */
static int lin_bwd(const mt_ctx *c, const lin_set *l, void *dx, int lddx, int accumulate,
                   const void *x, int ldx)
{
    if (!dx || c->defer || !set_shares_fp8(c, l)) {
        if (dx) MT_CHECK(lin_dgrad(c, l, dx, lddx, accumulate));
        return lin_wgrad(c, l, x, ldx);
    }
    mt_backend *be = c->be;
    const int64_t M = rows_total(l->rows, l->G);
    const int K = (int)l->w[0]->d.cols;
    size_t mark = mt_ws_mark(c->ws);
    uint8_t *dyt[2], *xt = NULL;
    float *dyts[2], *xts = NULL;
    for (int i = 0; i < l->n; i++) {
        const int N = (int)l->w[i]->d.rows;
        MT_WS(dyt[i], c->ws, (size_t)(M * N));
        MT_WS(dyts[i], c->ws, colt_scale_bytes(M, N, l->G));
    }
    int rc = MT_OK;
    for (int i = 0; i < l->n && rc == MT_OK; i++) {
        const int N = (int)l->w[i]->d.rows;
        size_t mark_i = mt_ws_mark(c->ws);
        uint8_t *dyq = mt_ws_get(c->ws, (size_t)(M * N));
        float *dys = dyq ? mt_ws_get(c->ws, rows_scale_bytes(M, N)) : NULL;
        rc = dys ? be->quant_rows_cols_t(be, dyq, dys, dyt[i], dyts[i], l->y[i], l->ldy[i],
                                         l->rows, l->G, N)
                 : MT_ENOMEM;
        if (rc == MT_OK) rc = lin_dgrad_q(c, l, i, dyq, dys, dx, lddx, accumulate || i > 0);
        mt_ws_release(c->ws, mark_i);
    }
    if (rc == MT_OK) {
        xt = mt_ws_get(c->ws, (size_t)(M * K));
        xts = xt ? mt_ws_get(c->ws, colt_scale_bytes(M, K, l->G)) : NULL;
        rc = xts ? be->quant_cols_t(be, xt, xts, x, ldx, l->rows, l->G, K) : MT_ENOMEM;
    }
    for (int i = 0; i < l->n && rc == MT_OK; i++) rc = lin_wgrad_q(c, l, i, dyt[i], dyts[i], xt, xts);
    mt_ws_release(c->ws, mark);
    return rc;
}

int mt_wdefer_replay(const mt_ctx *c, const mt_wdefer_rec *r)
{
    lin_set l = {r->n, {r->w[0], r->w[1]}, {r->dy[0], r->dy[1]}, {0, 0}, r->rows, r->G,
                 r->grouped};
    for (int i = 0; i < r->n; i++) l.ldy[i] = (int)r->w[i]->d.rows;
    return lin_wgrad_now(c, &l, r->x, (int)r->w[0]->d.cols);
}

void mt_wdefer_free(mt_wdefer *d, mt_backend *be)
{
    for (int i = 0; i < d->cap; i++) {
        if (d->r[i].buf) be->free(be, d->r[i].buf);
        free(d->r[i].rows);
    }
    free(d->r);
    memset(d, 0, sizeof *d);
}

size_t mt_wdefer_bytes(const mt_wdefer *d)
{
    size_t b = 0;
    for (int i = 0; i < d->cap; i++) b += d->r[i].cap;
    return b;
}

int mt_linear_fwd(const mt_ctx *c, const mt_param *w, void *y, int ldy, const void *x, int ldx,
                  int M)
{
    int rows[1] = {M};
    lin_set l = {1, {(mt_param *)w}, {y}, {ldy}, rows, 1, 0};
    return lin_fwd(c, &l, x, ldx);
}

int mt_linear_bwd(const mt_ctx *c, mt_param *w, void *dx, int lddx, int accumulate,
                  const void *dy, int lddy, const void *x, int ldx, int M)
{
    int rows[1] = {M};
    lin_set l = {1, {w}, {(void *)dy}, {lddy}, rows, 1, 0};
    return lin_bwd(c, &l, dx, lddx, accumulate, x, ldx);
}

int mt_linear_fwd2(const mt_ctx *c, const mt_param *w1, void *y1, int ldy1, const mt_param *w2,
                   void *y2, int ldy2, const void *x, int ldx, int M)
{
    int rows[1] = {M};
    lin_set l = {2, {(mt_param *)w1, (mt_param *)w2}, {y1, y2}, {ldy1, ldy2}, rows, 1, 0};
    return lin_fwd(c, &l, x, ldx);
}

int mt_linear_bwd2(const mt_ctx *c, mt_param *w1, const void *dy1, int lddy1, mt_param *w2,
                   const void *dy2, int lddy2, void *dx, int lddx, int accumulate, const void *x,
                   int ldx, int M)
{
    int rows[1] = {M};
    lin_set l = {2, {w1, w2}, {(void *)dy1, (void *)dy2}, {lddy1, lddy2}, rows, 1, 0};
    return lin_bwd(c, &l, dx, lddx, accumulate, x, ldx);
}

int mt_linear_grouped_fwd(const mt_ctx *c, const mt_param *w, void *y, int ldy, const void *x,
                          int ldx, const int *rows, int G)
{
    lin_set l = {1, {(mt_param *)w}, {y}, {ldy}, rows, G, 1};
    return lin_fwd(c, &l, x, ldx);
}

int mt_linear_grouped_bwd(const mt_ctx *c, mt_param *w, void *dx, int lddx, int accumulate,
                          const void *dy, int lddy, const void *x, int ldx, const int *rows,
                          int G)
{
    lin_set l = {1, {w}, {(void *)dy}, {lddy}, rows, G, 1};
    return lin_bwd(c, &l, dx, lddx, accumulate, x, ldx);
}

int mt_linear_grouped_fwd2(const mt_ctx *c, const mt_param *w1, void *y1, int ldy1,
                           const mt_param *w2, void *y2, int ldy2, const void *x, int ldx,
                           const int *rows, int G)
{
    lin_set l = {2, {(mt_param *)w1, (mt_param *)w2}, {y1, y2}, {ldy1, ldy2}, rows, G, 1};
    return lin_fwd(c, &l, x, ldx);
}

int mt_linear_grouped_fwd2_q(const mt_ctx *c, const mt_param *w1, void *y1, int ldy1,
                             const mt_param *w2, void *y2, int ldy2, const uint8_t *xq,
                             const float *xs, const int *rows, int G)
{
    lin_set l = {2, {(mt_param *)w1, (mt_param *)w2}, {y1, y2}, {ldy1, ldy2}, rows, G, 1};
    if (!set_shares_fp8(c, &l))
        return MT_ERR(MT_EINVAL, "linear: %s and %s do not share an FP8 input (a quantised "
                      "input needs FP8 weights of one width)", w1->d.name, w2->d.name);
    return lin_fwd_q(c, &l, xq, xs);
}

int mt_linear_grouped_bwd2(const mt_ctx *c, mt_param *w1, const void *dy1, int lddy1,
                           mt_param *w2, const void *dy2, int lddy2, void *dx, int lddx,
                           int accumulate, const void *x, int ldx, const int *rows, int G)
{
    lin_set l = {2, {w1, w2}, {(void *)dy1, (void *)dy2}, {lddy1, lddy2}, rows, G, 1};
    return lin_bwd(c, &l, dx, lddx, accumulate, x, ldx);
}
