/* job_rollback.c - see job_rollback.h. */
#define _POSIX_C_SOURCE 200809L
#include "runtime/job_rollback.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/ckpt.h"
#include "engine/train/train_state.h"
#include "base/mt_log.h"
#include "base/mt_status.h"
#include "runtime/job_checkpoint.h"
#include "runtime/job_resume.h"

/* Rank 0: moves the committed checkpoints of steps >= onset aside. */
static int set_aside_from(const char *root, int64_t onset, int *n)
{
    int64_t *steps;
    int k;
    *n = 0;
    MT_CHECK(mt_ckpt_list(root, &steps, &k));
    int rc = MT_OK;
    for (int i = 0; i < k && rc == MT_OK; i++) {
        if (steps[i] < onset) continue;
        char moved[MT_PATH_CAP + 64];
        rc = mt_ckpt_set_aside(root, steps[i], "rolledback", moved, sizeof moved);
        if (rc == MT_OK) {
            MT_LOGI("rollback: step_%08lld was saved after the abnormal steps began: moved to %s",
                    (long long)steps[i], moved);
            (*n)++;
        }
    }
    free(steps);
    return rc;
}

int mt_job_rollback(mt_job_ckpt *jc, mt_trainer *t, mt_comm *world, mt_rollback_result *r,
                    char *msg, size_t cap)
{
    const int rank = world ? mt_comm_rank(world) : 0;
    memset(r, 0, sizeof *r);
    if (cap) msg[0] = '\0';
    if (!t->rollback.pending) return MT_ERR(MT_ESTATE, "rollback: none was asked for");
    int rc = mt_job_ckpt_wait(jc);
    if (rc < 0) { /* the previous checkpoint stays the newest: fine here */
        MT_LOGW("rollback: the save in flight failed: %s", mt_errmsg());
        mt_err_clear();
    }
    const char *root = t->job.checkpoint.dir;
    if (!root[0]) return MT_OK;
    int64_t step = -1;
    MT_CHECK(mt_job_pick_checkpoint(root, t->rollback.onset, world, r->path, sizeof r->path,
                                    &step));
    if (step < 0) return MT_OK;
    /* the bad stretch's checkpoints go aside before anything is restored */
    rc = rank == 0 ? set_aside_from(root, t->rollback.onset, &r->set_aside) : MT_OK;
    if (world && mt_comm_size(world) > 1) {
        int ok = mt_comm_agree(world, rc == MT_OK);
        if (rc == MT_OK && ok != 1) rc = MT_ERR(MT_EIO, "rollback: rank 0 failed to set aside");
    }
    MT_CHECK(rc);
    /* every rank opens it or none restores: the restore is collective */
    mt_ckpt *ck = NULL;
    rc = mt_ckpt_open(&ck, r->path);
    if (world && mt_comm_size(world) > 1) {
        int ok = mt_comm_agree(world, rc == MT_OK);
        if (rc == MT_OK && ok != 1) rc = MT_ERR(MT_EIO, "another rank cannot open %s", r->path);
    }
    if (rc < 0) {
        mt_ckpt_close(ck);
        return mt_err_wrap(rc, "rollback");
    }
    mt_ckpt_set_reader_rank(ck, rank);
    const mt_ckpt_meta *m = mt_ckpt_get_meta(ck);
    mt_tensor_reader rd = mt_job_ckpt_reader(jc, ck);
    void *stage_mem;
    size_t stage_bytes;
    mt_job_ckpt_stage_mem(jc, &stage_mem, &stage_bytes); /* the save in flight ended above */
    rc = mt_train_state_restore_staged(t, &rd, m->state_json, stage_mem, stage_bytes);
    mt_ckpt_close(ck);
    /* every rank restored, or the job ends on all of them */
    if (world && mt_comm_size(world) > 1) {
        int ok = mt_comm_agree(world, rc == MT_OK);
        if (rc == MT_OK && ok != 1) rc = MT_ERR(MT_EIO, "another rank failed to restore");
    }
    if (rc < 0) return mt_err_wrap(rc, "rollback: restoring %s", r->path);
    r->rolled_back = 1;
    r->restored_step = t->step;
    r->skip_from = t->consumed_samples;
    r->skip_to = t->rollback.samples;
    mt_job_ckpt_rewind(jc, t->step);
    const int64_t gbs = t->job.batch.global_batch_size;
    snprintf(msg, cap,
             "rollback %lld of %d: %s; restored step %lld from %s; skipped samples [%lld, %lld) "
             "(the data of %lld steps)%s",
             (long long)t->rollbacks + 1, t->job.train.max_rollbacks, t->rollback.why,
             (long long)r->restored_step, r->path, (long long)r->skip_from, (long long)r->skip_to,
             (long long)((r->skip_to - r->skip_from) / (gbs > 0 ? gbs : 1)),
             r->set_aside ? "; checkpoints of the abnormal steps set aside as step_N.rolledback"
                          : "");
    mt_trainer_rollback_done(t);
    if (rank == 0) MT_LOGW("%s", msg);
    return MT_OK;
}
