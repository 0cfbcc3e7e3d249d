/* job_resume.h - checkpoint.resume = auto (moetraind --resume auto).
 *
 * A job that may be restarted (Slurm --requeue, a Kubernetes Job's retry,
 * systemd Restart=) names its checkpoint.dir and resume auto; each start
 * then continues from the newest checkpoint there that verifies, falling
 * back to the one before when the newest is damaged (set aside as
 * step_N.damaged, see ckpt.h), and starts as init says when there is none.
 * Every case is one log line on rank 0:
 *
 *   resume auto: continuing from DIR/step_00000040 (step 40)
 *   resume auto: no checkpoint in DIR verifies: starting as init.kind=random
 *
 * Rank 0 looks and verifies; the others follow its choice (one broadcast
 * on the world's host communicator).
 */
#ifndef MT_JOB_RESUME_H
#define MT_JOB_RESUME_H

#include <stddef.h>
#include <stdint.h>

#include "engine/parallel/comm.h"
#include "engine/train/jobspec.h"

/* The newest checkpoint under root with step < below (below < 0: any) that
 * verifies: rank 0 looks (setting damaged ones aside), every rank of
 * `world` (host communicator; NULL: one rank) gets its choice. *step = -1
 * when none. Collective. */
int mt_job_pick_checkpoint(const char *root, int64_t below, mt_comm *world, char *path,
                           size_t cap, int64_t *step);

/* path as operators know it, for log lines: a folder the daemon holds open
 * is reached through /proc/self/fd/N (service/control_ckpt.h); this says
 * its canonical path instead (path itself when it cannot be resolved). */
void mt_job_path_shown(const char *path, char *out, size_t cap);

/* With checkpoint.resume = auto, rewrites job->init to the checkpoint found
 * (init.kind = checkpoint, init.path = its directory); otherwise leaves it.
 * Collective over `world` (NULL: one rank). */
int mt_job_resume_auto(mt_jobspec *job, mt_comm *world);

#endif
