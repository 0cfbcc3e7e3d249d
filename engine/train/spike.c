/* spike.c - see spike.h. */
#include "engine/train/spike.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/mt_status.h"

int mt_spike_init(mt_spike_detector *d, const mt_train_cfg *cfg)
{
    d->window = cfg->spike_window > 4 ? cfg->spike_window : 4;
    d->sigma = cfg->spike_sigma;
    d->grad_sigma = cfg->spike_grad_sigma;
    d->loss = calloc((size_t)d->window, sizeof *d->loss);
    d->gnorm = calloc((size_t)d->window, sizeof *d->gnorm);
    d->n = d->head = d->streak = 0;
    d->onset = 0;
    d->last = MT_SPIKE_OK;
    if (!d->loss || !d->gnorm) {
        mt_spike_free(d);
        return MT_ERR(MT_ENOMEM, "spike detector: out of memory");
    }
    return MT_OK;
}

void mt_spike_free(mt_spike_detector *d)
{
    free(d->loss);
    free(d->gnorm);
    d->loss = d->gnorm = NULL;
}

static void mean_std(const double *x, int n, double *mean, double *std)
{
    double s = 0, ss = 0;
    for (int i = 0; i < n; i++) s += x[i];
    *mean = s / n;
    for (int i = 0; i < n; i++) ss += (x[i] - *mean) * (x[i] - *mean);
    *std = sqrt(ss / n);
}

/* Is v a spike against history x? The threshold in *limit. */
static int beyond(const double *x, int n, double sigma, double v, double *mean, double *limit)
{
    double std;
    mean_std(x, n, mean, &std);
    double floor = 1e-3 * fabs(*mean);
    *limit = *mean + sigma * (std > floor ? std : floor);
    return v > *limit;
}

mt_spike_kind mt_spike_observe(mt_spike_detector *d, int64_t step, double loss, double gnorm,
                               char *why, size_t cap)
{
    mt_spike_kind k = MT_SPIKE_OK;
    double mean = 0, limit = 0;
    if (!isfinite(loss) || !isfinite(gnorm)) {
        k = MT_SPIKE_NONFINITE;
        if (why) snprintf(why, cap, "step %lld: loss %g, gradient norm %g", (long long)step, loss, gnorm);
    } else if (d->n >= d->window / 2) {
        if (d->sigma > 0 && beyond(d->loss, d->n, d->sigma, loss, &mean, &limit)) {
            k = MT_SPIKE_LOSS;
            if (why)
                snprintf(why, cap, "step %lld: loss %.4f above %.4f (mean %.4f of %d steps + %g "
                         "deviations)", (long long)step, loss, limit, mean, d->n, d->sigma);
        } else if (d->grad_sigma > 0 &&
                   beyond(d->gnorm, d->n, d->grad_sigma, gnorm, &mean, &limit)) {
            k = MT_SPIKE_GRAD;
            if (why)
                snprintf(why, cap, "step %lld: gradient norm %.4g above %.4g (mean %.4g of %d "
                         "steps + %g deviations)", (long long)step, gnorm, limit, mean, d->n,
                         d->grad_sigma);
        }
    }
    d->last = k;
    if (k != MT_SPIKE_OK) {
        if (d->streak++ == 0) d->onset = step;
        return k;
    }
    d->streak = 0;
    d->onset = 0;
    d->loss[d->head] = loss;
    d->gnorm[d->head] = gnorm;
    d->head = (d->head + 1) % d->window;
    if (d->n < d->window) d->n++;
    return k;
}

void mt_spike_clear_streak(mt_spike_detector *d)
{
    d->streak = 0;
    d->onset = 0;
}
