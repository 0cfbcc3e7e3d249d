/* cpu_norm.c - RMSNorm, SwiGLU and the embedding lookup, forward and backward.
 *
 * Row statistics and weight-gradient reductions are summed in double in a
 * fixed order (rows in order, columns split between threads), so results do
 * not depend on the thread count. */
#include <stdlib.h>

#include "kernels/cpu/cpu_impl.h"

/* Columns per work item of the column-parallel reductions over rows. */
#define COL_CHUNK 16

static int cpu_rmsnorm_fwd(mt_backend *be, void *y, int ldy, float *rstd, const void *x,
                           int ldx, const void *w, int M, int D, float eps)
{
    CPU_REQUIRE(M >= 0 && D >= 1, "rmsnorm_fwd: M=%d D=%d", M, D);
    CPU_REQUIRE(ldy >= D && ldx >= D, "rmsnorm_fwd: ldy=%d ldx=%d < D=%d", ldy, ldx, D);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(y && rstd && x && w, "rmsnorm_fwd: NULL pointer");
    const float *xf = x, *wf = w;
    float *yf = y;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)M * D))
    for (int m = 0; m < M; m++) {
        const float *xr = xf + (int64_t)m * ldx;
        float *yr = yf + (int64_t)m * ldy;
        double ms = cpu_dot_f64(xr, xr, D) / D;
        float r = (float)(1.0 / sqrt(ms + (double)eps));
        rstd[m] = r;
        for (int k = 0; k < D; k++) yr[k] = cpu_act(be, xr[k] * r * wf[k]);
    }
    return MT_OK;
}

/* dx[m] = r (w dy - x c), c = r^2 / D * sum_k w_k dy_k x_k. */
static void rmsnorm_bwd_row(const mt_backend *be, float *dx, int accumulate, const float *dy,
                            const float *x, const float *w, float r, int D)
{
    double s = 0;
    for (int k = 0; k < D; k++) s += (double)w[k] * dy[k] * x[k];
    double c = (double)r * r / D * s;
    for (int k = 0; k < D; k++) {
        float v = (float)(r * ((double)w[k] * dy[k] - (double)x[k] * c));
        dx[k] = cpu_act(be, accumulate ? dx[k] + v : v);
    }
}

static int cpu_rmsnorm_bwd(mt_backend *be, void *dx, int lddx, int accumulate, float *dw,
                           const void *dy, int lddy, const void *x, int ldx, const void *w,
                           const float *rstd, int M, int D)
{
    CPU_REQUIRE(M >= 0 && D >= 1, "rmsnorm_bwd: M=%d D=%d", M, D);
    CPU_REQUIRE(lddx >= D && lddy >= D && ldx >= D, "rmsnorm_bwd: lddx=%d lddy=%d ldx=%d < D=%d",
                lddx, lddy, ldx, D);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(dx && dw && dy && x && w && rstd, "rmsnorm_bwd: NULL pointer");
    float *dxf = dx;
    const float *dyf = dy, *xf = x, *wf = w;
    int nt = cpu_team(be, (int64_t)M * D);
#pragma omp parallel for num_threads(nt)
    for (int m = 0; m < M; m++)
        rmsnorm_bwd_row(be, dxf + (int64_t)m * lddx, accumulate, dyf + (int64_t)m * lddy,
                        xf + (int64_t)m * ldx, wf, rstd[m], D);
    /* dw[k] += sum over rows in order of dy x rstd, columns split in chunks */
    int chunks = mt_ceil_div(D, COL_CHUNK);
#pragma omp parallel for num_threads(nt)
    for (int ch = 0; ch < chunks; ch++) {
        int k0 = ch * COL_CHUNK, n = D - k0 < COL_CHUNK ? D - k0 : COL_CHUNK;
        double acc[COL_CHUNK] = {0};
        for (int m = 0; m < M; m++) {
            const float *dyr = dyf + (int64_t)m * lddy + k0, *xr = xf + (int64_t)m * ldx + k0;
            double r = rstd[m];
            for (int j = 0; j < n; j++) acc[j] += (double)dyr[j] * xr[j] * r;
        }
        for (int j = 0; j < n; j++) dw[k0 + j] = (float)((double)dw[k0 + j] + acc[j]);
    }
    return MT_OK;
}

static inline float sigmoidf(float g) { return 1.0f / (1.0f + expf(-g)); }

static int cpu_swiglu_fwd(mt_backend *be, void *h, const void *gu, int M, int F)
{
    CPU_REQUIRE(M >= 0 && F >= 1, "swiglu_fwd: M=%d F=%d", M, F);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(h && gu, "swiglu_fwd: NULL pointer");
    float *hf = h;
    const float *guf = gu;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)M * F))
    for (int m = 0; m < M; m++) {
        const float *g = guf + (int64_t)m * 2 * F, *u = g + F;
        float *hr = hf + (int64_t)m * F;
        for (int f = 0; f < F; f++) hr[f] = cpu_act(be, g[f] * sigmoidf(g[f]) * u[f]);
    }
    return MT_OK;
}

static int cpu_swiglu_bwd(mt_backend *be, void *dgu, const void *dh, const void *gu, int M,
                          int F)
{
    CPU_REQUIRE(M >= 0 && F >= 1, "swiglu_bwd: M=%d F=%d", M, F);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(dgu && dh && gu, "swiglu_bwd: NULL pointer");
    float *dguf = dgu;
    const float *dhf = dh, *guf = gu;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)M * F))
    for (int m = 0; m < M; m++) {
        const float *g = guf + (int64_t)m * 2 * F, *u = g + F, *d = dhf + (int64_t)m * F;
        float *dg = dguf + (int64_t)m * 2 * F, *du = dg + F;
        for (int f = 0; f < F; f++) {
            float sg = sigmoidf(g[f]), silu = g[f] * sg;
            /* d silu / dg = sg (1 + g (1 - sg)) */
            dg[f] = cpu_act(be, d[f] * u[f] * (sg * (1.0f + g[f] * (1.0f - sg))));
            du[f] = cpu_act(be, d[f] * silu);
        }
    }
    return MT_OK;
}

/* ids must be >= 0; the table's row count V is not passed, so the upper
 * bound is the caller's to keep. */

static int cpu_embedding_fwd(mt_backend *be, void *y, const void *table, const int32_t *ids,
                             int M, int D)
{
    CPU_REQUIRE(M >= 0 && D >= 1, "embedding_fwd: M=%d D=%d", M, D);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(y && table && ids, "embedding_fwd: NULL pointer");
    float *yf = y;
    const float *tf = table;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)M * D))
    for (int m = 0; m < M; m++) {
        float *dst = yf + (int64_t)m * D;
        if (ids[m] < 0) { /* another rank's part of the vocabulary */
            for (int k = 0; k < D; k++) dst[k] = 0.0f;
            continue;
        }
        const float *src = tf + (int64_t)ids[m] * D;
        for (int k = 0; k < D; k++) dst[k] = cpu_act(be, src[k]);
    }
    return MT_OK;
}

/* dtable[ids[m]] += dy[m], summed over m in order for every element:
 * threads split the columns, never the tokens. */
static int cpu_embedding_bwd(mt_backend *be, float *dtable, const void *dy, const int32_t *ids,
                             int M, int D)
{
    CPU_REQUIRE(M >= 0 && D >= 1, "embedding_bwd: M=%d D=%d", M, D);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(dtable && dy && ids, "embedding_bwd: NULL pointer");
    const float *dyf = dy;
    int chunks = mt_ceil_div(D, COL_CHUNK);
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)M * D))
    for (int ch = 0; ch < chunks; ch++) {
        int k0 = ch * COL_CHUNK, n = D - k0 < COL_CHUNK ? D - k0 : COL_CHUNK;
        for (int m = 0; m < M; m++) {
            if (ids[m] < 0) continue; /* another rank's part of the vocabulary */
            float *dst = dtable + (int64_t)ids[m] * D + k0;
            const float *src = dyf + (int64_t)m * D + k0;
            for (int j = 0; j < n; j++) dst[j] += src[j];
        }
    }
    return MT_OK;
}

void cpu_install_norm(mt_backend *be)
{
    be->rmsnorm_fwd = cpu_rmsnorm_fwd;
    be->rmsnorm_bwd = cpu_rmsnorm_bwd;
    be->swiglu_fwd = cpu_swiglu_fwd;
    be->swiglu_bwd = cpu_swiglu_bwd;
    be->embedding_fwd = cpu_embedding_fwd;
    be->embedding_bwd = cpu_embedding_bwd;
}
