/* control_ckpt.h - the engine loop's view of checkpoints: the job's
 * checkpoint hooks (runtime/job_checkpoint.h: restore at start, the
 * periodic policy after each step, save on request, close), listing, and
 * the background reshard. Turns their results into svc_ckpt records. */
#ifndef MT_CONTROL_CKPT_H
#define MT_CONTROL_CKPT_H

#include <stddef.h>

#include "engine/train/jobspec.h"
#include "engine/train/trainer.h"
#include "runtime/runtime.h"
#include "service/metrics_hub.h"
#include "service/svc_types.h"

typedef struct ctl_ckpt ctl_ckpt;

/* The records of a running job's checkpoint policy (the job, started by
 * the runtime, has restored its state already; not owned). */
int ctl_ckpt_open(ctl_ckpt **out, mt_job *job);
void ctl_ckpt_close(ctl_ckpt *ck);

/* After a step of the job: a save committed since the last look (the
 * policy saves every checkpoint.interval steps) in *saved (valid set), or
 * valid 0. */
void ctl_ckpt_newly_saved(ctl_ckpt *ck, svc_ckpt *saved);

/* Saves now (ROOT/step_NNNNNNNN of the current step). All ranks. */
int ctl_ckpt_save(ctl_ckpt *ck, svc_ckpt *saved);

/* Committed checkpoints under a job's checkpoint directory, oldest first. */
int ctl_ckpt_list(const char *dir, svc_ckpt **out, int *n);

/* Path of checkpoint `name` ("latest": the newest) under dir. */
int ctl_ckpt_find(const char *dir, const char *name, char *path, size_t cap);

/* ---- the background reshard (rank 0) ------------------------------------------ */

typedef struct ctl_reshard ctl_reshard;

int ctl_reshard_create(ctl_reshard **out, metrics_hub *hub);
/* Waits for a running reshard, then frees. */
void ctl_reshard_destroy(ctl_reshard *r);

/* Starts rewriting checkpoint `src` as `dst` (a new checkpoint directory)
 * for `layout` (0 fields: as the source); MT_ESTATE while one runs. */
int ctl_reshard_start(ctl_reshard *r, const char *src, const char *dst, const char *src_name,
                      const char *dst_name, const mt_layout *layout, uint64_t run_id,
                      const char *job);

/* Progress of the current or last reshard. */
void ctl_reshard_get(ctl_reshard *r, svc_reshard *out);

#endif
