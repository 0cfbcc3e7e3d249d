/* cpu_loss.c - cross-entropy fused with the softmax of the output head. */
#include <stdlib.h>

#include "kernels/cpu/cpu_impl.h"

/* One row of xent: returns the loss and overwrites x [V] with the gradient. */
static float xent_row(const mt_backend *be, float *x, int V, int tgt, float grad_scale)
{
    float mx = x[0];
    for (int j = 1; j < V; j++) mx = fmaxf(mx, x[j]);
    float xt = x[tgt];
    double sum = 0;
    for (int j = 0; j < V; j++) {
        x[j] = expf(x[j] - mx);
        sum += x[j];
    }
    for (int j = 0; j < V; j++) {
        float p = (float)(x[j] / sum);
        x[j] = cpu_act(be, grad_scale * (j == tgt ? p - 1.0f : p));
    }
    return (float)((double)mx + log(sum) - (double)xt);
}

static int cpu_xent(mt_backend *be, float *loss, void *logits, const int32_t *tgt, int M, int V,
                    int ignore, float grad_scale)
{
    CPU_REQUIRE(M >= 0 && V >= 1, "xent: M=%d V=%d", M, V);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(loss && logits && tgt, "xent: NULL pointer");
    for (int m = 0; m < M; m++)
        CPU_REQUIRE(tgt[m] == ignore || (tgt[m] >= 0 && tgt[m] < V),
                    "xent: tgt[%d]=%d out of [0, %d) and not ignore=%d", m, (int)tgt[m], V,
                    ignore);
    float *lg = logits;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)M * V))
    for (int m = 0; m < M; m++) {
        float *x = lg + (int64_t)m * V;
        if (tgt[m] == ignore) {
            loss[m] = 0.0f;
            for (int j = 0; j < V; j++) x[j] = 0.0f;
        } else {
            loss[m] = xent_row(be, x, V, tgt[m], grad_scale);
        }
    }
    return MT_OK;
}

/* ---- vocabulary-parallel parts (ops.h) ---------------------------------- */

static int cpu_xent_part_stats(mt_backend *be, float *stats, const void *logits,
                               const int32_t *tgt, int M, int V, int v_lo, int ignore)
{
    CPU_REQUIRE(M >= 0 && V >= 1 && v_lo >= 0, "xent_part_stats: M=%d V=%d v_lo=%d", M, V, v_lo);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(stats && logits && tgt, "xent_part_stats: NULL pointer");
    const float *lg = logits;
    (void)ignore;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)M * V))
    for (int m = 0; m < M; m++) {
        const float *x = lg + (int64_t)m * V;
        float mx = x[0];
        for (int j = 1; j < V; j++) mx = fmaxf(mx, x[j]);
        double sum = 0;
        for (int j = 0; j < V; j++) sum += expf(x[j] - mx);
        const int t = tgt[m] - v_lo;
        stats[3 * m] = mx;
        stats[3 * m + 1] = (float)sum;
        stats[3 * m + 2] = t >= 0 && t < V ? x[t] : 0.0f;
    }
    return MT_OK;
}

static int cpu_xent_part_finish(mt_backend *be, float *loss, void *logits, const float *stats,
                                int P, const int32_t *tgt, int M, int V, int v_lo, int ignore,
                                float grad_scale)
{
    CPU_REQUIRE(M >= 0 && V >= 1 && P >= 1 && v_lo >= 0, "xent_part_finish: M=%d V=%d P=%d v_lo=%d",
                M, V, P, v_lo);
    if (M == 0) return MT_OK;
    CPU_REQUIRE(loss && logits && stats && tgt, "xent_part_finish: NULL pointer");
    float *lg = logits;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)M * V))
    for (int m = 0; m < M; m++) {
        float *x = lg + (int64_t)m * V;
        if (tgt[m] == ignore) {
            loss[m] = 0.0f;
            for (int j = 0; j < V; j++) x[j] = 0.0f;
            continue;
        }
        float mx = stats[3 * m];
        for (int p = 1; p < P; p++) mx = fmaxf(mx, stats[((int64_t)p * M + m) * 3]);
        double sum = 0, xt = 0;
        for (int p = 0; p < P; p++) {
            const float *s = stats + ((int64_t)p * M + m) * 3;
            sum += (double)s[1] * exp((double)s[0] - (double)mx);
            xt += s[2];
        }
        const int t = tgt[m] - v_lo;
        for (int j = 0; j < V; j++) {
            float p = (float)(expf(x[j] - mx) / sum);
            x[j] = cpu_act(be, grad_scale * (j == t ? p - 1.0f : p));
        }
        loss[m] = (float)((double)mx + log(sum) - xt);
    }
    return MT_OK;
}

void cpu_install_loss(mt_backend *be)
{
    be->xent = cpu_xent;
    be->xent_part_stats = cpu_xent_part_stats;
    be->xent_part_finish = cpu_xent_part_finish;
}
