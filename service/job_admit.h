/* job_admit.h - a StartJob request turned into a validated job spec.
 *
 * The spec is parsed by the one job spec parser (engine/train/jobspec.c), so its
 * errors name the field. On top of it the service confines what the job
 * writes or restores to the workdir:
 *   - checkpoint.dir: relative paths are relative to the workdir, absolute
 *     ones must lie inside it; empty means WORKDIR/checkpoints/<name>, so
 *     every job can save on request;
 *   - init.path of a checkpoint start likewise, and `from_checkpoint` names
 *     a checkpoint of the job ("latest" or a name from ListCheckpoints);
 *   - the job name must be a plain name (it names a directory).
 * Data and model paths are inputs that are only read; they resolve against
 * base_dir (the client's job file folder) or the workdir.
 * The spec is parsed once; the confined paths are written into the parsed
 * job and checked again, and the job is admitted for `world` ranks
 * (mt_jobspec_admit): a layout the ranks cannot run, or one the trainer
 * cannot (mt_jobspec_check_runnable: sequence parallelism without tp), is
 * refused here with MT_EINVAL naming the field.
 */
#ifndef MT_JOB_ADMIT_H
#define MT_JOB_ADMIT_H

#include <stddef.h>

#include "engine/train/jobspec.h"

typedef struct job_request {
    const char *json;             /* the spec document, or NULL / "" */
    const char *path;             /* spec file relative to the workdir (when no json) */
    const char *base_dir;         /* absolute; NULL / "": the workdir */
    const char *const *sets;      /* "key.path=value" */
    int n_sets;
    const char *from_checkpoint;  /* NULL / "", "latest" or a name */
    /* Finds checkpoint `name` ("latest" allowed) in the job's checkpoint
     * directory `dir`; MT_ENOTFOUND if there is none. */
    int (*find_checkpoint)(void *arg, const char *dir, const char *name, char *path, size_t cap);
    void *find_arg;
    int world;                    /* ranks that will run the job; 0: 1 */
} job_request;

int job_admit(const char *workdir, const job_request *r, mt_jobspec *out);

#endif
