/* job_resume.c - see job_resume.h. */
#define _XOPEN_SOURCE 700 /* realpath */
#include "runtime/job_resume.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "ckpt/ckpt.h"

static const char *init_name(mt_init_kind k)
{
    return k == MT_INIT_HF ? "hf" : k == MT_INIT_CHECKPOINT ? "checkpoint" : "random";
}

void mt_job_path_shown(const char *path, char *out, size_t cap)
{
    char *real = realpath(path, NULL);
    snprintf(out, cap, "%s", real ? real : path);
    free(real);
}

int mt_job_pick_checkpoint(const char *root, int64_t below, mt_comm *world, char *path,
                           size_t cap, int64_t *step)
{
    const int rank = world ? mt_comm_rank(world) : 0;
    const int size = world ? mt_comm_size(world) : 1;
    *step = -1;
    if (cap) path[0] = '\0';
    int rc = MT_OK;
    /* rank 0 verifies and sets damaged ones aside; the others follow */
    if (rank == 0) rc = mt_ckpt_find_resumable(root, below, 1, path, cap, step);
    if (size > 1) {
        int64_t msg[2] = {rc, *step};
        int brc = mt_comm_broadcast(world, msg, 2, MT_COMM_I64, 0);
        if (brc < 0) return mt_err_wrap(brc, "choosing a checkpoint in %s", root);
        if (rank != 0 && msg[0] < 0)
            return MT_ERR(MT_EIO, "rank 0 could not choose a checkpoint in %s", root);
        *step = msg[1];
        if (rank != 0 && *step >= 0) MT_CHECK(mt_ckpt_step_path(path, cap, root, *step, 0));
    }
    return rc;
}

int mt_job_resume_auto(mt_jobspec *job, mt_comm *world)
{
    if (job->checkpoint.resume != MT_RESUME_AUTO) return MT_OK;
    const int rank = world ? mt_comm_rank(world) : 0;
    const char *root = job->checkpoint.dir;
    if (!root[0]) {
        if (rank == 0)
            MT_LOGW("resume auto: the job has no checkpoint.dir: starting as init.kind=%s",
                    init_name(job->init.kind));
        return MT_OK;
    }
    char path[MT_PATH_CAP] = "";
    int64_t step = -1;
    int rc = mt_job_pick_checkpoint(root, -1, world, path, sizeof path, &step);
    if (rc < 0) return mt_err_wrap(rc, "resume auto: checkpoint.dir %s", root);
    char shown[MT_PATH_CAP];
    if (step < 0) {
        mt_job_path_shown(root, shown, sizeof shown);
        if (rank == 0)
            MT_LOGI("resume auto: no checkpoint in %s verifies: starting as init.kind=%s%s%s", shown,
                    init_name(job->init.kind), job->init.path[0] ? " from " : "", job->init.path);
        return MT_OK;
    }
    mt_job_path_shown(path, shown, sizeof shown);
    if (rank == 0)
        MT_LOGI("resume auto: continuing from %s (step %lld)", shown, (long long)step);
    job->init.kind = MT_INIT_CHECKPOINT;
    snprintf(job->init.path, sizeof job->init.path, "%s", path);
    return MT_OK;
}
