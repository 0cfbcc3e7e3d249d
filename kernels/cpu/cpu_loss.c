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

void cpu_install_loss(mt_backend *be)
{
    be->xent = cpu_xent;
}
