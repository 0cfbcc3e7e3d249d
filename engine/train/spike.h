/* spike.h - the loss-spike detector of a job (train.spike_* fields).
 *
 * It keeps the loss and gradient norm of the last `spike_window` accepted
 * steps. A step is abnormal when its loss or gradient norm is NaN / Inf, or
 * when (with at least half a window of history) its loss exceeds
 *     mean + spike_sigma * max(std, 1e-3 * |mean|)
 * of that history (the floor keeps a flat history from calling noise a
 * spike), or its gradient norm does likewise with spike_grad_sigma. Drops
 * are never spikes. Abnormal steps do not enter the history, so the
 * baseline is the training before the trouble. `streak` counts
 * consecutive abnormal steps and `onset` is the first of them: a rollback
 * goes to a checkpoint saved before the onset.
 *
 * The history is not saved in checkpoints: after a resume the detector
 * needs half a window of steps before it judges spikes (non-finite values
 * count at once).
 */
#ifndef MT_SPIKE_H
#define MT_SPIKE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/train/jobspec.h"

typedef enum {
    MT_SPIKE_OK = 0,
    MT_SPIKE_NONFINITE, /* loss or gradient norm NaN / Inf */
    MT_SPIKE_LOSS,      /* loss beyond spike_sigma deviations */
    MT_SPIKE_GRAD,      /* gradient norm beyond spike_grad_sigma deviations */
} mt_spike_kind;

typedef struct mt_spike_detector {
    int window;             /* history length, steps */
    double sigma, grad_sigma;
    double *loss, *gnorm;   /* rings [window] of accepted steps */
    int n, head;            /* entries held, next slot */
    int streak;             /* consecutive abnormal steps */
    int64_t onset;          /* step of the first of them; 0: none */
    mt_spike_kind last;     /* verdict of the last step observed */
} mt_spike_detector;

int mt_spike_init(mt_spike_detector *d, const mt_train_cfg *cfg);
void mt_spike_free(mt_spike_detector *d);

/* Judges step `step` (1-based) with its loss and gradient norm; `why` (may
 * be NULL) gets one sentence on an abnormal step. */
mt_spike_kind mt_spike_observe(mt_spike_detector *d, int64_t step, double loss, double gnorm,
                               char *why, size_t cap);

/* After a rollback: the streak is over; the history (training before the
 * onset) stays the baseline. */
void mt_spike_clear_streak(mt_spike_detector *d);

#endif
