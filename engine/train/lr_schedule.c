/* lr_schedule.c - see lr_schedule.h. */
#include "engine/train/lr_schedule.h"

#include <math.h>

double mt_lr_at(const mt_lr_schedule *s, double lr, double min_lr, int64_t total_steps,
                int64_t step)
{
    if (step < s->warmup_steps) return lr * (double)(step + 1) / (double)s->warmup_steps;
    int64_t decay = s->decay_steps > 0 ? s->decay_steps : total_steps - s->warmup_steps;
    double p = decay > 0 ? (double)(step - s->warmup_steps) / (double)decay : 1.0;
    if (p > 1) p = 1;
    switch (s->decay) {
    case MT_LR_COSINE: return min_lr + (lr - min_lr) * 0.5 * (1.0 + cos(3.14159265358979323846 * p));
    case MT_LR_LINEAR: return lr - (lr - min_lr) * p;
    case MT_LR_WSD: {
        double f = s->wsd_decay_fraction;
        if (f <= 0 || p < 1.0 - f) return p >= 1.0 && f <= 0 ? min_lr : lr;
        return lr - (lr - min_lr) * (p - (1.0 - f)) / f;
    }
    case MT_LR_CONSTANT: return lr;
    }
    return lr;
}
