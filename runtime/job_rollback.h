/* job_rollback.h - rolling a job back to its last good checkpoint.
 *
 * When the trainer asks (engine/train/trainer.h "Rollback": a loss spike
 * that persists, or a streak of NaN / Inf steps), the job
 *   1. waits for the save in flight;
 *   2. takes the newest checkpoint of checkpoint.dir saved before the
 *      first abnormal step that verifies (rank 0 chooses, damaged ones are
 *      set aside as step_N.damaged);
 *   3. sets aside the checkpoints saved during the abnormal steps
 *      (step_N.rolledback: kept for inspection, never resumed from);
 *   4. restores the trainer from it and continues with the data after the
 *      abnormal steps: the data read since the checkpoint is skipped;
 *   5. reports it in one line (log, metrics stream, dashboard), and the
 *      count in the step metrics (Prometheus moetrain_rollbacks_total).
 * After train.max_rollbacks rollbacks the next trigger fails the job.
 */
#ifndef MT_JOB_ROLLBACK_H
#define MT_JOB_ROLLBACK_H

#include <stddef.h>
#include <stdint.h>

#include "engine/parallel/comm.h"
#include "engine/train/trainer.h"
#include "runtime/job_checkpoint.h"

typedef struct mt_rollback_result {
    int rolled_back;            /* 0: no checkpoint before the onset (nothing changed) */
    int64_t restored_step;
    char path[MT_PATH_CAP + 32];
    int64_t skip_from, skip_to; /* samples skipped: [skip_from, skip_to) */
    int set_aside;              /* checkpoints of the abnormal steps set aside */
} mt_rollback_result;

/* Performs the rollback the trainer asked for (t->rollback.pending); every
 * rank of `world` (host communicator; NULL: one rank). With no checkpoint
 * before the onset, r->rolled_back = 0 and the trainer is untouched (the
 * caller decides: runtime.h mt_job_step). A one-line account goes to msg. */
int mt_job_rollback(mt_job_ckpt *jc, mt_trainer *t, mt_comm *world, mt_rollback_result *r,
                    char *msg, size_t cap);

#endif
