/* control_term.c - see control_term.h. */
#include "service/control_term.h"

#include <stdio.h>

#include "base/mt_log.h"
#include "service/preempt.h"

int ctl_term_save_flag(const mt_jobspec *job, ctl_ckpt *ck, int resident)
{
    if (!resident) {
        MT_LOGI("SIGTERM: no job is running: shutting down");
        return 0;
    }
    if (!job->checkpoint.dir[0]) {
        MT_LOGI("SIGTERM: stopping at this step boundary (the job has no checkpoint.dir: "
                "nothing to save)");
        return 0;
    }
    char why[512];
    double elapsed = preempt_elapsed_s();
    preempt_verdict v = preempt_decide(elapsed < 0 ? 0 : elapsed, ctl_ckpt_save_estimate_s(ck),
                                       job->train.term_grace_s, why, sizeof why);
    MT_LOGI("SIGTERM: stopping at this step boundary: %s", why);
    return v == PREEMPT_SAVE ? 1 : -1;
}
