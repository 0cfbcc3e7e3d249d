/* control_term.h - the engine loop's SIGTERM decision (service/preempt.h)
 * for the resident job, taken on rank 0 at the first step boundary after
 * the signal and sent to every rank in the shutdown command's `save`. */
#ifndef MT_CONTROL_TERM_H
#define MT_CONTROL_TERM_H

#include "engine/train/jobspec.h"
#include "service/control_ckpt.h"

/* The shutdown record's save value: 1 save now (within the grace period),
 * -1 exit without saving (too late; exit status 75), 0 nothing to decide
 * (no resident job, or it has no checkpoint.dir): as
 * checkpoint.save_on_stop. Logs the decision. `resident`: a job is built. */
int ctl_term_save_flag(const mt_jobspec *job, ctl_ckpt *ck, int resident);

#endif
