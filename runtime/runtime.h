/* runtime.h - a job from admission to its last step, on every rank.
 *
 * The floor between the engine (and ckpt/) and the service: the service
 * keeps the network surface and the control state machine and drives jobs
 * only through this interface; tools and tests use it the same way.
 *
 * mt_runtime is the process: its rank in the world, the world's host
 * communicator (MPI when MPI is initialised and several ranks run, a local
 * one otherwise) and the two things every decision point needs: agreeing
 * (did every rank succeed?) and sharing rank 0's bytes (commands, job
 * specs).
 *
 * mt_job is one job on this rank: its admitted spec, backend, process
 * groups (from the layout), trainer (joined to the data-parallel group) and
 * checkpoint policy (restored at start). Start, step, save and end are
 * collective: every rank calls them in the same order.
 */
#ifndef MT_RUNTIME_H
#define MT_RUNTIME_H

#include <stddef.h>

#include "engine/parallel/comm.h"
#include "engine/parallel/groups.h"
#include "engine/train/jobspec.h"
#include "engine/train/trainer.h"
#include "runtime/job_checkpoint.h"

typedef struct mt_runtime {
    mt_comm *world;   /* host buffers; owned */
    int rank, size;
} mt_runtime;

/* The process's runtime: MPI must be initialised by main when it runs under
 * mpirun (MPI_Init_thread); without MPI the world is this process alone. */
int mt_runtime_create(mt_runtime **out);
void mt_runtime_destroy(mt_runtime *rt);

/* 1 when every rank passed ok != 0, 0 when one did not, < 0 if the agreement
 * itself failed (treat as not agreed). Collective. */
int mt_runtime_agree(mt_runtime *rt, int ok);

/* buf [bytes] of rank 0 to every rank. Collective. */
int mt_runtime_share(mt_runtime *rt, void *buf, size_t bytes);

typedef struct mt_job_opts {
    int threads;      /* CPU backend threads; 0: all cores */
} mt_job_opts;

typedef struct mt_job {
    mt_jobspec spec;           /* admitted: the layout covers the world */
    mt_runtime *rt;
    mt_backend *be;
    mt_comm *dev_world;        /* device buffers (CUDA jobs of several ranks); owned */
    mt_groups groups;          /* from the layout, host or device as the backend */
    int have_groups;
    mt_trainer *trainer;
    mt_job_ckpt *ckpt;
    /* The last mt_job_step's rollback (issue 20; runtime/job_rollback.h),
     * one line, "" when none: the step was not applied and the job went
     * back to a checkpoint from before the abnormal steps, or, for a spike
     * with no checkpoint before it, the step was dropped. */
    char rollback_note[1024];
} mt_job;

/* Builds the job on every rank (collective): checks that the spec was
 * admitted for this world, makes the backend (CUDA: device rank % devices),
 * the process groups, the trainer, and the checkpoint policy, and restores
 * the initial state (init.kind). Every rank agrees on the outcome: if one
 * fails all do, and nothing is held. */
int mt_job_start(mt_job **out, mt_runtime *rt, const mt_jobspec *spec, const mt_job_opts *o);

/* One optimizer step, then the checkpoint policy's save when due.
 * Collective. *m (may be NULL): the step's metrics. When the trainer asks
 * for a rollback (a persistent loss spike or a NaN / Inf streak,
 * engine/train/trainer.h) the job rolls back here instead and says so in
 * j->rollback_note; a NaN / Inf streak with no checkpoint before it, or one
 * rollback more than train.max_rollbacks, fails the step. */
int mt_job_step(mt_job *j, mt_step_metrics *m);

/* Saves the current step now and waits (collective). */
int mt_job_save(mt_job *j);

/* Waits for a save in flight and frees everything (collective); returns the
 * save's status. NULL is fine. */
int mt_job_end(mt_job *j);

#endif
