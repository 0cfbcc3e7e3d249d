/* runtime.c - see runtime.h. */
#include "runtime/runtime.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "kernels/ops.h"
#include "runtime/job_rollback.h"

int mt_runtime_create(mt_runtime **out)
{
    *out = NULL;
    mt_runtime *rt = calloc(1, sizeof *rt);
    if (!rt) return MT_ERR(MT_ENOMEM, "runtime: out of memory");
    mt_comm_opts o = {.backend = MT_COMM_AUTO, .mem = MT_COMM_HOST};
    int rc = mt_comm_world(&rt->world, &o);
    if (rc < 0) {
        free(rt);
        return mt_err_wrap(rc, "runtime: the world communicator");
    }
    rt->rank = mt_comm_rank(rt->world);
    rt->size = mt_comm_size(rt->world);
    *out = rt;
    return MT_OK;
}

void mt_runtime_destroy(mt_runtime *rt)
{
    if (!rt) return;
    mt_comm_destroy(rt->world);
    free(rt);
}

int mt_runtime_agree(mt_runtime *rt, int ok) { return mt_comm_agree(rt->world, ok); }

int mt_runtime_share(mt_runtime *rt, void *buf, size_t bytes)
{
    return mt_comm_broadcast(rt->world, buf, bytes, MT_COMM_BYTE, 0);
}

/* ---- a job ----------------------------------------------------------------------------- */

/* CUDA: rank r on device r % n; when there are more ranks than devices
 * (tests: several ranks on one GPU through the staged backend) each takes
 * its share of the device's memory. Assumes the ranks of one host, as the
 * rank-to-device rule does. */
static int make_backend(const mt_jobspec *j, int threads, int rank, int world, mt_backend **be)
{
    if (j->backend == MT_BACKEND_CUDA) {
        int n = mt_cuda_device_count();
        if (n <= 0)
            return MT_ERR(MT_ENOTSUP, "backend \"cuda\": no CUDA device (this build or this "
                                      "machine); use --set backend=cpu");
        const int sharers = world > n ? (world + n - 1) / n : 1;
        /* memory left outside the arena: NCCL allocates buffers for each
         * communicator of a multi-rank job (world, dp, tp, pp, ep, edp) and
         * the nccl comm backend its temporaries, beside the arena; 1.5 GB
         * was too little for ep = 2 on an H200 (2026-11-26: "unhandled cuda
         * error" in ncclGroupEnd, cudaMallocAsync out of memory).
         * MOETRAIN_CUDA_RESERVE_MB overrides. */
        const char *r = getenv("MOETRAIN_CUDA_RESERVE_MB");
        size_t reserve = world > 1 && sharers == 1 ? (size_t)4096 << 20 : 0;
        if (r && *r) reserve = (size_t)strtoull(r, NULL, 10) << 20;
        return mt_backend_cuda_create_reserve(be, rank % n, sharers, reserve);
    }
    return mt_backend_cpu_create(be, threads);
}

/* The groups live on the memory the backend computes in: gradients are
 * reduced where they are. parallel.comm picks the backend; "mpi" for a CUDA
 * job means MPI through host memory (staged). */
static int make_groups(mt_job *j)
{
    mt_comm *world = j->rt->world;
    const mt_comm_backend want = j->spec.comm;
    if (j->be->kind == MT_BE_CPU) {
        if (want == MT_COMM_NCCL || want == MT_COMM_STAGED)
            return MT_ERR(MT_EINVAL, "parallel.comm %s needs backend cuda (device buffers)",
                          mt_comm_backend_name(want));
        if (want == MT_COMM_LOCAL && j->rt->size > 1)
            return MT_ERR(MT_EINVAL, "parallel.comm local runs one rank, not %d", j->rt->size);
    } else {
        mt_comm_opts o = {.backend = want == MT_COMM_MPI ? MT_COMM_STAGED : want,
                          .mem = MT_COMM_DEVICE};
        MT_CHECK(mt_comm_world(&j->dev_world, &o));
        world = j->dev_world;
    }
    MT_CHECK(mt_groups_build(&j->groups, world, &j->spec.parallel));
    j->have_groups = 1;
    /* Device groups order their ops on the backend's compute stream: an op
     * starts after the kernels enqueued before it, and the kernels after
     * it wait for it (device-side events, comm.h), so gradient buckets and
     * expert exchanges need no host waits. MT_COMM_HOST_SYNC=1 leaves them
     * on the default stream: their users then fence on the host. */
    if (j->be->kind != MT_BE_CPU && !mt_comm_host_sync_forced()) {
        void *s = j->be->stream(j->be);
        MT_CHECK(mt_comm_set_stream(j->dev_world, s));
        for (int k = 0; k < MT_GROUP_COUNT; k++)
            if (j->groups.g[k]) MT_CHECK(mt_comm_set_stream(j->groups.g[k], s));
    }
    return MT_OK;
}

static void release(mt_job *j)
{
    mt_job_ckpt_close(j->ckpt);
    mt_trainer_destroy(j->trainer);
    if (j->have_groups) mt_groups_free(&j->groups);
    mt_comm_destroy(j->dev_world);
    if (j->be) j->be->destroy(j->be);
    free(j);
}

/* Every rank's rc agreed: this rank's failure, or `why` where only another
 * rank failed (collective). */
static int agreed(mt_runtime *rt, int rc, const char *why)
{
    int ok = mt_runtime_agree(rt, rc == MT_OK);
    return rc == MT_OK && ok != 1 ? MT_ERR(MT_EGENERIC, "%s", why) : rc;
}

int mt_job_start(mt_job **out, mt_runtime *rt, const mt_jobspec *spec, const mt_job_opts *o)
{
    *out = NULL;
    mt_job *j = calloc(1, sizeof *j);
    int rc = j ? MT_OK : MT_ERR(MT_ENOMEM, "job: out of memory");
    if (j) {
        j->spec = *spec;
        j->rt = rt;
    }
    const mt_layout *l = &spec->parallel;
    if (rc == MT_OK && (l->dp < 1 || mt_layout_world(l) != rt->size))
        rc = MT_ERR(MT_EINVAL, "job %s: its layout covers %d ranks, %d run it (admit the job "
                    "for this world first)", spec->name, l->dp > 0 ? mt_layout_world(l) : 0,
                    rt->size);
    if (rc == MT_OK) rc = make_backend(spec, o ? o->threads : 0, rt->rank, rt->size, &j->be);
    /* every rank reaches the group building (collective) or none does */
    rc = agreed(rt, rc, "the job failed to start on another rank");
    if (rc == MT_OK) rc = make_groups(j);
    rc = agreed(rt, rc, "the job failed to start on another rank");
    /* the trainer joins its groups at creation: ZeRO-1 owners follow the dp
     * (edp) rank, and under expert parallelism the model holds only its
     * experts */
    if (rc == MT_OK) {
        mt_trainer_groups tg = {
            .dp = l->dp > 1 ? j->groups.g[MT_GROUP_DP] : NULL,
            /* the token exchange: ep, or ep x etp (groups.h) */
            .ep = l->etp > 1  ? j->groups.g[MT_GROUP_EXP]
                  : l->ep > 1 ? j->groups.g[MT_GROUP_EP]
                              : NULL,
            .edp = l->ep > 1 || l->etp > 1 || l->tp > 1 ? j->groups.g[MT_GROUP_EDP] : NULL,
            .tp = l->tp > 1 ? j->groups.g[MT_GROUP_TP] : NULL,
            .pp = l->pp > 1 ? j->groups.g[MT_GROUP_PP] : NULL,
        };
        rc = mt_trainer_create_in(&j->trainer, &j->spec, j->be, &tg);
        if (rc == MT_OK) j->trainer->rank = rt->rank; /* train.fault.rank */
    }
    if (rc == MT_OK) rc = mt_job_ckpt_open(&j->ckpt, &j->spec, rt->world);
    rc = agreed(rt, rc, "the job failed to start on another rank");
    if (rc == MT_OK) rc = mt_job_ckpt_restore(j->ckpt, j->trainer);
    rc = agreed(rt, rc, "the job's initial state failed to load on another rank");
    if (rc < 0) {
        if (j) release(j);
        return rc;
    }
    *out = j;
    return MT_OK;
}

/* The rollback the trainer asked for (runtime/job_rollback.h). */
static int roll_back(mt_job *j)
{
    mt_trainer *t = j->trainer;
    mt_rollback_result r;
    MT_CHECK(mt_job_rollback(j->ckpt, t, j->rt->world, &r, j->rollback_note,
                             sizeof j->rollback_note));
    if (r.rolled_back) return MT_OK;
    if (t->rollback.nonfinite)
        return MT_ERR(MT_ENUMERIC, "%s, and no checkpoint from before step %lld to roll back to",
                      t->rollback.why, (long long)t->rollback.onset);
    snprintf(j->rollback_note, sizeof j->rollback_note,
             "%s; no checkpoint from before step %lld to roll back to: step %lld is dropped, "
             "training goes on", t->rollback.why, (long long)t->rollback.onset,
             (long long)t->rollback.step);
    if (j->rt->rank == 0) MT_LOGW("%s", j->rollback_note);
    mt_trainer_rollback_cancel(t);
    return MT_OK;
}

int mt_job_step(mt_job *j, mt_step_metrics *m)
{
    j->rollback_note[0] = '\0';
    MT_CHECK(mt_trainer_step(j->trainer, m));
    if (j->trainer->rollback.pending) return roll_back(j);
    return mt_job_ckpt_after_step(j->ckpt, j->trainer);
}

int mt_job_save(mt_job *j) { return mt_job_ckpt_save_now(j->ckpt, j->trainer); }

int mt_job_end(mt_job *j)
{
    if (!j) return MT_OK;
    int rc = mt_job_ckpt_close(j->ckpt);
    j->ckpt = NULL;
    release(j);
    return rc;
}
