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
#include "service/board.h"
#include "service/metrics_hub.h"
#include "service/svc_types.h"

typedef struct ctl_ckpt ctl_ckpt;

/* Before the job starts, on every rank. With the workdir `root` (rank 0 of
 * the daemon; NULL elsewhere) the job's checkpoint.dir (made if missing)
 * and, for a checkpoint start, init.path are confined to it again
 * (service/workdir.h) and held open; *use is the spec to start the job
 * with: the held folders by the names that reach them (/proc/self/fd/N),
 * so renaming a folder or replacing it by a symbolic link later cannot make
 * a save write outside. Without root *use is *spec. */
int ctl_ckpt_open(ctl_ckpt **out, const char *root, const mt_jobspec *spec, mt_jobspec *use);

/* The records of the started job's checkpoint policy (the job, started by
 * the runtime from *use, has restored its state already; not owned). */
int ctl_ckpt_attach(ctl_ckpt *ck, mt_job *job);

/* rc, with the held folders' names in the last error said as their
 * canonical paths (for errors of the job's start and saves). */
int ctl_ckpt_said(const ctl_ckpt *ck, int rc);

/* text (a message of the job's: a rollback's line) with the held folders'
 * names said as their canonical paths. ck may be NULL. */
void ctl_ckpt_say(const ctl_ckpt *ck, const char *text, char *out, size_t cap);

/* After the job's end (a save in flight writes through the held folder):
 * lets the folders go and frees. NULL is fine. */
void ctl_ckpt_close(ctl_ckpt *ck);

/* After a step of the job: a save committed since the last look (the
 * policy saves every checkpoint.interval steps) in *saved (valid set), or
 * valid 0. */
void ctl_ckpt_newly_saved(ctl_ckpt *ck, svc_ckpt *saved);

/* Waits for the save in flight (all ranks): *saved (valid set) if it
 * committed; its failure otherwise. */
int ctl_ckpt_finish(ctl_ckpt *ck, svc_ckpt *saved);

/* Saves now (ROOT/step_NNNNNNNN of the current step). All ranks. A save
 * still in flight is finished first: *earlier (valid set) if it committed. */
int ctl_ckpt_save(ctl_ckpt *ck, svc_ckpt *earlier, svc_ckpt *saved);

/* Expected seconds of a save now: the last committed save's snapshot stall
 * plus write time; -1 when this job has not saved yet. */
double ctl_ckpt_save_estimate_s(ctl_ckpt *ck);

/* Committed checkpoints under a job's checkpoint directory, oldest first.
 * With the workdir `root` (NULL: no confinement) the directory is confined
 * to it and a step that is a link leading out is left out (and logged). */
int ctl_ckpt_list(const char *root, const char *dir, svc_ckpt **out, int *n);

/* The canonical path of checkpoint `name` ("latest": the newest) under dir;
 * with `root`, confined: inside the workdir, an index, no link among its
 * files. MT_ENOTFOUND if there is none. */
int ctl_ckpt_find(const char *root, const char *dir, const char *name, char *path, size_t cap);

/* ---- the background reshard (rank 0) ------------------------------------------ */

typedef struct ctl_reshard ctl_reshard;

int ctl_reshard_create(ctl_reshard **out, metrics_hub *hub);
/* Waits for a running reshard, then frees. */
void ctl_reshard_destroy(ctl_reshard *r);

/* Starts rewriting checkpoint `src` as `dst` (a new checkpoint directory)
 * for `layout` (0 fields: as the source); MT_ESTATE while one runs. With
 * the workdir `root` both are confined and held until the rewrite ends;
 * dst is created here (an existing name, a link included, is refused). */
int ctl_reshard_start(ctl_reshard *r, const char *root, const char *src, const char *dst,
                      const char *src_name, const char *dst_name, const mt_layout *layout,
                      uint64_t run_id, const char *job);

/* Progress of the current or last reshard. */
void ctl_reshard_get(ctl_reshard *r, svc_reshard *out);

/* ---- reading saves back (rank 0) ---------------------------------------------- */

/* Each checkpoint the daemon saves is verified once committed (every
 * dataset read back against its checksums, the index's coverage:
 * mt_ckpt_verify) by a thread of rank 0 while training goes on, when it is
 * at most max_bytes: the cheap case. Larger ones are "skipped" (reading
 * them back would compete with training for the disk; moetrain-ckpt
 * verify is the tool). Results go to the board (board_set_verify). What
 * is read is confined to the workdir `root` and held open while read. */
typedef struct ctl_verifier ctl_verifier;

int ctl_verifier_create(ctl_verifier **out, board *b, const char *root, int64_t max_bytes);
/* Finishes the verify running (the queued ones are dropped), then frees. */
void ctl_verifier_destroy(ctl_verifier *v);

/* Notes the saved checkpoint *c on the board with c->verify set to
 * "running" (queued) or "skipped: ...", then reads it back. */
void ctl_verifier_submit(ctl_verifier *v, svc_ckpt *c);

#endif
