/* lr_schedule.h - learning rate as a pure function of the step.
 *
 * Step s counts optimizer updates from 0. Warmup: lr * (s + 1) / warmup for
 * s < warmup. Then, with p = (s - warmup) / decay_steps clamped to [0, 1]
 * (decay_steps 0 means total_steps - warmup):
 *   cosine    min + (lr - min) * (1 + cos(pi p)) / 2
 *   linear    lr - (lr - min) * p
 *   wsd       lr until p reaches 1 - f, then linear to min over the last
 *             fraction f = wsd_decay_fraction (warmup-stable-decay)
 *   constant  lr
 */
#ifndef MT_LR_SCHEDULE_H
#define MT_LR_SCHEDULE_H

#include <stdint.h>

#include "engine/train/jobspec.h"

double mt_lr_at(const mt_lr_schedule *s, double lr, double min_lr, int64_t total_steps,
                int64_t step);

#endif
