/* ckpt_run.c - a foreground job runner with the checkpoint policy, for the
 * checkpoint tests: what moetraind's foreground mode does with
 * runtime/job_checkpoint.h (create the trainer, restore per init.kind,
 * after_step on every step, save on stop, close), without the service.
 *
 *   ckpt_run --job JOB.json [--set key.path=value ...] [--metrics-jsonl FILE]
 *            [--threads N] [--stop-after N]
 *
 * --stop-after N behaves as a SIGTERM after N steps of this run. Under
 * mpirun the ranks run the job's layout (dp = N unless --set parallel...
 * says otherwise) and write their own shards; rank 0 writes the metrics.
 * Exit status: 0 completed or stopped, 1 usage, 2 failed.
 */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/train/jobspec.h"
#include "engine/train/metrics.h"
#include "engine/train/trainer.h"
#include "base/mt_log.h"
#include "base/mt_status.h"
#include "kernels/ops.h"
#include "runtime/runtime.h"

static volatile sig_atomic_t stop_requested = 0;

static void on_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
}

int main(int argc, char **argv)
{
    const char *job_path = NULL, *jsonl = NULL, *sets[128];
    int n_sets = 0, threads = 0;
    long stop_after = -1;
    for (int i = 1; i < argc; i++) {
        int has = i + 1 < argc;
        if (!strcmp(argv[i], "--job") && has) job_path = argv[++i];
        else if (!strcmp(argv[i], "--set") && has && n_sets < 128) sets[n_sets++] = argv[++i];
        else if (!strcmp(argv[i], "--metrics-jsonl") && has) jsonl = argv[++i];
        else if (!strcmp(argv[i], "--threads") && has) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--stop-after") && has) stop_after = atol(argv[++i]);
        else {
            fprintf(stderr, "usage: ckpt_run --job JOB.json [--set k=v ...] [--metrics-jsonl F] "
                            "[--threads N] [--stop-after N]\n");
            return 1;
        }
    }
    if (!job_path) return 1;
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    mt_runtime *rt = NULL;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    mt_jobspec job;
    mt_job *jb = NULL;
    mt_trainer *t = NULL;
    mt_metrics_sink *s;
    int rc;
    MT_GOTO(mt_runtime_create(&rt), out);
    mt_log_set_rank(rt->rank);
    MT_GOTO(mt_jobspec_load(&job, job_path, sets, n_sets), out);
    MT_GOTO(mt_jobspec_admit(&job, rt->size), out);
    mt_job_opts jo = {.threads = threads};
    MT_GOTO(mt_job_start(&jb, rt, &job, &jo), out);
    t = jb->trainer;
    MT_GOTO(mt_metrics_log_sink(&s, job.train.log_interval), out);
    MT_GOTO(mt_trainer_add_sink(t, s), out);
    if (jsonl && rt->rank == 0) { /* the metrics are global: rank 0 writes them */
        MT_GOTO(mt_metrics_jsonl_sink(&s, jsonl), out);
        MT_GOTO(mt_trainer_add_sink(t, s), out);
    }
    long done = 0;
    while (t->step < job.train.steps && rc == MT_OK) {
        if (stop_after >= 0 && done == stop_after) stop_requested = 1;
        if (stop_requested) {
            MT_LOGI("stopped at step %lld", (long long)t->step);
            if (job.checkpoint.save_on_stop) rc = mt_job_save(jb);
            break;
        }
        MT_GOTO(mt_job_step(jb, NULL), out);
        done++;
    }
out:
    if (rc < 0) MT_LOGE("%s", mt_errmsg());
    int crc = mt_job_end(jb);
    if (crc < 0) MT_LOGE("%s", mt_errmsg());
    if (rc == MT_OK) rc = crc;
    mt_runtime_destroy(rt);
    MPI_Finalize();
    return rc < 0 ? 2 : 0;
}
