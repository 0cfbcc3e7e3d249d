/* job_checkpoint.h - the checkpoint policy of a running job.
 *
 * open(job) reads the job's checkpoint section (dir, interval, keep_last,
 * async, save_on_stop) and init section; restore() loads the initial state
 * when init.kind is "checkpoint" (init.path: a step directory, or a root
 * whose newest committed checkpoint is taken) or "hf" (a Hugging Face
 * directory, imported on the fly). A damaged checkpoint (its index seal,
 * a piece's checksum) fails the restore with MT_ECORRUPT naming the file;
 * with init.fallback the newest older committed step of the same root
 * that loads is taken instead, and damaged steps of the job's own
 * checkpoint.dir it stepped over are renamed step_N.damaged (kept, out of
 * the history). after_step() saves every `interval`
 * steps; save_now() saves at once (stop, RPC); close() waits for the save
 * in flight.
 *
 * Asynchronous saves (checkpoint.async): at the step boundary the state is
 * copied to host memory (the stall), then a background thread writes this
 * rank's shard file, and (rank 0) the index, commits and applies retention
 * while training continues. At most one save is in flight: a save that
 * falls due while the previous one is still writing waits for it. Under
 * several ranks each rank writes its own shard; the pieces' records are
 * gathered to rank 0 at the first step boundary after every rank finished,
 * and rank 0 writes the index and commits in the background.
 *
 * A failed save (disk full...) is logged and counted; training continues
 * and the previous checkpoint stays the newest committed one. save_now(),
 * wait() and close() return the failure.
 *
 * Safety: a job that starts from scratch (or from an older step) refuses a
 * checkpoint.dir that already holds newer checkpoints, so histories never
 * mix and retention never removes another run's state.
 */
#ifndef MT_JOB_CHECKPOINT_H
#define MT_JOB_CHECKPOINT_H

#include <stdint.h>

#include "engine/train/jobspec.h"
#include "engine/train/trainer.h"
#include "engine/parallel/comm.h"

typedef struct mt_job_ckpt_stats {
    int64_t saves;           /* committed saves */
    int64_t failures;        /* saves that failed */
    int64_t last_step;       /* step of the last committed save; -1: none */
    char last_path[MT_PATH_CAP + 32]; /* its directory, ROOT/step_NNNNNNNN */
    double last_stall_ms;    /* training blocked by the last save (snapshot, wait) */
    double last_write_ms;    /* snapshot to commit of the last save */
    int64_t last_bytes;      /* bytes of the last snapshot */
    int in_flight;           /* a save is being written */
    int64_t restored_step;   /* step restored at start; -1: none */
} mt_job_ckpt_stats;

typedef struct mt_job_ckpt mt_job_ckpt;

/* The policy of an admitted job run by the ranks of `world` (a host
 * communicator, not owned; NULL: one rank). */
int mt_job_ckpt_open(mt_job_ckpt **out, const mt_jobspec *job, mt_comm *world);

/* The reader of a job's restore from checkpoint ck, which every rank of
 * the job reads at once (mt_train_state_restore is then collective over
 * the trainer's groups): replicated weights read once per replica group
 * when the ranks span several hosts (or MT_CKPT_SHARED_LOAD=1), else every
 * rank reads all it holds (job_checkpoint.c, decide_share_load). */
struct mt_ckpt;
struct mt_tensor_reader mt_job_ckpt_reader(const mt_job_ckpt *jc, struct mt_ckpt *ck);

/* Restores the trainer per init.kind (nothing for random); then checks
 * checkpoint.dir holds no checkpoint newer than the start step. */
int mt_job_ckpt_restore(mt_job_ckpt *jc, mt_trainer *t);

/* After each optimizer step: advances a save in flight; starts a save when
 * step % interval == 0. */
int mt_job_ckpt_after_step(mt_job_ckpt *jc, mt_trainer *t);

/* Saves the current step now (unless it is already saved) and waits. */
int mt_job_ckpt_save_now(mt_job_ckpt *jc, mt_trainer *t);

/* Waits for the save in flight; returns its status. */
int mt_job_ckpt_wait(mt_job_ckpt *jc);
/* Host memory idle between saves that may stage a restore (the snapshot's
 * slab, page-locked on a GPU, when one is held and no save writes from
 * it): *mem, *bytes; NULL, 0 otherwise. Valid until the next save. */
void mt_job_ckpt_stage_mem(mt_job_ckpt *jc, void **mem, size_t *bytes);

void mt_job_ckpt_get_stats(mt_job_ckpt *jc, mt_job_ckpt_stats *s);

/* The trainer went back to committed step `step` (a rollback,
 * runtime/job_rollback.h): it is the last saved step again. */
void mt_job_ckpt_rewind(mt_job_ckpt *jc, int64_t step);

/* Waits for the save in flight and frees; returns its status. NULL is fine. */
int mt_job_ckpt_close(mt_job_ckpt *jc);

#endif
