/* bench_dp_overlap.c - how much of the data-parallel gradient reduction the
 * backward hides on the CPU (issue 13), by timestamps.
 *
 *   mpirun -np N bench_dp_overlap JOB.json DATA_PREFIX [STEPS] [--set K=V ...]
 *
 * Trains the job at dp = N for STEPS steps (default 20) after 2 warm-up
 * steps, alternating two modes step by step: overlap on (buckets start
 * from the model's per-layer hook during the last micro-batch's backward)
 * and off (MOETRAIN_GRAD_OVERLAP=0's behaviour: every bucket starts after
 * the backward). Each step records, per rank, the time from the end of its
 * backward to the end of the reduction (grad_buckets wait_ms: includes
 * waiting for a slower rank's backward) and, by CLOCK_MONOTONIC
 * timestamps shared by the ranks of one host, the time from the end of the
 * LAST rank's backward to the end of the slowest rank's reduction: the
 * part of the communication no backward hid, free of the ranks' skew. With
 * all of it exposed when off, the hidden fraction is 1 - exposed(on) /
 * exposed(off).
 */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "engine/train/grad_buckets.h"
#include "engine/train/trainer.h"
#include "runtime/runtime.h"

static int rank_;

static void die(const char *what, int rc)
{
    fprintf(stderr, "rank %d: %s: %d %s\n", rank_, what, rc, mt_errmsg());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_dp_overlap JOB.json DATA_PREFIX [STEPS] [--set K=V ...]\n");
        return 2;
    }
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    mt_runtime *rt;
    int rc = mt_runtime_create(&rt);
    if (rc < 0) die("runtime", rc);
    rank_ = rt->rank;
    mt_log_set_rank(rt->rank);
    int steps = 20, n_sets = 0;
    const char *sets[64];
    char data[1200], nsteps[64];
    snprintf(data, sizeof data, "data.path=%s", argv[2]);
    sets[n_sets++] = data;
    for (int a = 3; a < argc && n_sets < 60; a++) {
        if (!strcmp(argv[a], "--set") && a + 1 < argc) sets[n_sets++] = argv[++a];
        else steps = atoi(argv[a]);
    }
    snprintf(nsteps, sizeof nsteps, "train.steps=%d", steps + 2);
    sets[n_sets++] = nsteps;
    sets[n_sets++] = "data.valid_interval=0";
    sets[n_sets++] = "train.log_interval=1000000";
    mt_jobspec j;
    if ((rc = mt_jobspec_load(&j, argv[1], sets, n_sets)) < 0) die("job", rc);
    if ((rc = mt_jobspec_admit(&j, rt->size)) < 0) die("admit", rc);
    mt_job_opts jo = {.threads = 1};
    mt_job *job;
    if ((rc = mt_job_start(&job, rt, &j, &jo)) < 0) die("mt_job_start", rc);
    mt_grad_buckets *gb = job->trainer->gb;
    if (!gb) die("the job has no data-parallel group (run under mpirun -np 2 or more)", MT_EINVAL);
    double sum[2][3] = {{0, 0, 0}, {0, 0, 0}}; /* [overlap][exposed ms, step ms, skew-free ms] */
    int cnt[2] = {0, 0};
    for (int s = 0; s < steps + 2; s++) {
        const int on = s % 2 == 0;
        gb->overlap = on;
        mt_step_metrics m;
        if ((rc = mt_job_step(job, &m)) < 0) die("step", rc);
        if (s < 2) continue;
        sum[on][0] += gb->wait_ms;
        sum[on][1] += m.step_ms;
        /* the last backward of all ranks ends at max(t_finish); what is
         * left after it (to the slowest rank's end) cannot hide behind any
         * backward: the reduction's exposed part, without the ranks' skew */
        double t[2] = {gb->t_finish_ms, gb->t_done_ms}, tmax[2];
        if (mt_comm_all_reduce(rt->world, t, tmax, 2, MT_COMM_F64, MT_COMM_MAX) < 0)
            die("all_reduce", MT_EGENERIC);
        sum[on][2] += tmax[1] - tmax[0];
        cnt[on]++;
    }
    double mean[6] = {sum[1][0] / cnt[1], sum[0][0] / cnt[0], sum[1][1] / cnt[1],
                      sum[0][1] / cnt[0], sum[1][2] / cnt[1], sum[0][2] / cnt[0]};
    double worst[6];
    if (mt_comm_all_reduce(rt->world, mean, worst, 6, MT_COMM_F64, MT_COMM_MAX) < 0)
        die("all_reduce", MT_EGENERIC);
    if (rt->rank == 0) {
        printf("%s at dp %d: %d buckets (parallel.bucket_mb %.3g, grad_reduce %s), %d steps each "
               "mode\n", j.name, rt->size, gb->n, j.bucket_mb,
               j.grad_reduce == MT_GRAD_BF16 ? "bf16" : "fp32", cnt[1]);
        printf("reduction exposed after the backward (slowest rank's mean): overlap on %.2f ms, "
               "off %.2f ms; hidden %.0f %%\n", worst[0], worst[1],
               worst[1] > 0 ? 100.0 * (1.0 - worst[0] / worst[1]) : 0.0);
        printf("reduction left after the last rank's backward (timestamps, mean): overlap on "
               "%.2f ms, off %.2f ms; hidden %.0f %%\n", worst[4], worst[5],
               worst[5] > 0 ? 100.0 * (1.0 - worst[4] / worst[5]) : 0.0);
        printf("step time (slowest rank's mean): overlap on %.1f ms, off %.1f ms\n", worst[2],
               worst[3]);
    }
    if ((rc = mt_job_end(job)) < 0) die("mt_job_end", rc);
    mt_runtime_destroy(rt);
    MPI_Finalize();
    return 0;
}
