/* test_trainer_dp_gpu.c - data parallelism on one GPU shared by two ranks
 * through the host-staged backend is one rank (issue 13).
 *
 *   mpirun -np 2 test_trainer_dp_gpu EXAMPLES_DIR
 *
 * The tiny-cpu job with backend cuda, parallel.comm staged (ranks sharing a
 * GPU: NCCL refuses duplicate devices), 0.1 MB gradient buckets (reduced
 * into their owners from inside the backward), 3 steps of 4 sequences,
 * fp8-blockwise and bf16 recipes, against the same job on one rank (each
 * rank runs the reference itself, on the same GPU). Properties:
 *   1. per-step loss within 1e-3 relative and gradient norm within 1e-2 of
 *      one rank's (the order the GPU kernels accumulate the micro-batches
 *      in differs between one rank's 4 and two ranks' 2 + 2), and every
 *      main parameter this rank keeps within 1e-3 under fp8 (a third of
 *      one step's lr: the CPU's fp8 bound is 3e-4, the GPU's kernels add
 *      their own accumulation order; a gradient reduced over one rank's
 *      half of the batch only would move parameters by about lr) and 1e-2
 *      under bf16 (bf16 activations round each rank's partial sums
 *      differently, and Adam turns a near-zero gradient whose sign flips
 *      into a full lr step the other way: 3 steps of lr 3e-3; measured on
 *      an H100: 4.4e-3);
 *   2. the ranks compute with bit-identical weights (the owners' gathered
 *      compute copies) and keep disjoint optimizer state adding up to one
 *      rank's (ZeRO-1);
 *   3. the gradient buckets are ordered on the backend's stream, no host
 *      fences, unless MT_COMM_HOST_SYNC=1 (then they are, and 1-2 hold
 *      the same).
 * Exit 77 (ctest: skipped), printing "skipped", without a CUDA device or
 * not on exactly 2 ranks; never passes without having run.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "engine/train/grad_buckets.h"
#include "engine/train/trainer.h"
#include "runtime/runtime.h"
#include "mpi_check.h"
#include "test_util.h"

#define STEPS 3


static void load_job(mt_jobspec *j, const char *examples, const char *corpus, const char *recipe,
                     int world)
{
    char path[1200], data[1200], rec[64];
    snprintf(path, sizeof path, "%s/tiny-cpu.json", examples);
    snprintf(data, sizeof data, "data.path=%s", corpus);
    snprintf(rec, sizeof rec, "precision.recipe=%s", recipe);
    const char *sets[] = {data, rec, "backend=cuda", "parallel.comm=staged",
                          "parallel.bucket_mb=0.1", "batch.seq_len=32",
                          "batch.micro_batch_size=1", "batch.global_batch_size=4", "train.steps=3",
                          "lr_schedule.warmup_steps=1", "data.valid_interval=0",
                          "train.log_interval=1000"};
    int n = (int)(sizeof sets / sizeof *sets);
    if (world == 1) sets[3] = "parallel.comm=auto"; /* one rank: local */
    int rc = mt_jobspec_load(j, path, sets, n);
    if (rc == MT_OK) rc = mt_jobspec_admit(j, world);
    if (rc < 0) die("job", rc);
}

/* The f32 main copy (device) of the trainer's optimizer, on the host. */
static float *master_host(mt_trainer *t)
{
    float *h = malloc((size_t)(t->opt->n_state > 0 ? t->opt->n_state : 1) * sizeof *h);
    if (!h) die("out of memory", MT_ENOMEM);
    int rc = t->be->download(t->be, h, t->opt->master, (size_t)t->opt->n_state * sizeof *h);
    if (rc < 0) die("download", rc);
    return h;
}

static void run_recipe(mt_runtime *rt, const char *examples, const char *corpus, const char *recipe)
{
    mt_jobspec jd, j1;
    load_job(&jd, examples, corpus, recipe, rt->size);
    load_job(&j1, examples, corpus, recipe, 1);
    /* the one-rank reference runs first, on this rank's share of the GPU,
     * and is gone before the job takes its share (two full shares and a
     * reference do not fit one GPU); its metrics, main copy and state
     * offsets are kept on the host */
    int rc;
    const int ndev = mt_cuda_device_count(); /* the runtime's rule: rank % devices */
    mt_backend *be;
    rc = mt_backend_cuda_create_shared(&be, rt->rank % ndev, (rt->size + ndev - 1) / ndev);
    if (rc < 0) die("reference backend", rc);
    mt_trainer *ref;
    if ((rc = mt_trainer_create(&ref, &j1, be)) < 0) die("reference trainer", rc);
    mt_step_metrics m1s[STEPS];
    for (int s = 0; s < STEPS; s++)
        if ((rc = mt_trainer_step(ref, &m1s[s])) < 0) die("reference step", rc);
    float *b = master_host(ref);
    const int n_ref_params = ref->model->table.n;
    const int64_t ref_state = ref->opt->n_state;
    int64_t *ref_off = malloc((size_t)n_ref_params * sizeof *ref_off);
    if (!ref_off) die("out of memory", MT_ENOMEM);
    for (int i = 0; i < n_ref_params; i++) ref_off[i] = ref->opt->off[i];
    mt_trainer_destroy(ref);
    be->destroy(be);

    mt_job_opts jo = {.threads = 1};
    mt_job *job;
    rc = mt_job_start(&job, rt, &jd, &jo);
    if (rc < 0) die("mt_job_start", rc);
    for (int s = 0; s < STEPS; s++) {
        mt_step_metrics md, m1 = m1s[s];
        if ((rc = mt_job_step(job, &md)) < 0) die("dp step", rc);
        CHECK(fabs(md.loss - m1.loss) <= 1e-3 * fabs(m1.loss), "%s step %d: loss %.9g vs one "
              "rank %.9g", recipe, s + 1, md.loss, m1.loss);
        CHECK(fabs(md.grad_norm - m1.grad_norm) <= 1e-2 * m1.grad_norm, "%s step %d: grad norm "
              "%.9g vs one rank %.9g", recipe, s + 1, md.grad_norm, m1.grad_norm);
        if (rt->rank == 0)
            printf("%s step %d: loss %.9f (one rank %.9f), grad norm %.9g (%.9g)\n", recipe, s + 1,
                   md.loss, m1.loss, md.grad_norm, m1.grad_norm);
    }
    mt_trainer *t = job->trainer;
    CHECK(t->gb && t->gb->n > 1 && t->gb->started_early == t->gb->n,
          "%s: %d of %d buckets started during the backward", recipe,
          t->gb ? t->gb->started_early : -1, t->gb ? t->gb->n : -1);
    /* 3. the buckets are ordered on the backend's stream (no host fences)
     * unless MT_COMM_HOST_SYNC=1 asks for them */
    CHECK(t->gb && t->gb->host_wait == mt_comm_host_sync_forced(), "%s: buckets host-fenced %d, "
          "MT_COMM_HOST_SYNC=1 %d (the runtime sets the backend's stream on device groups)",
          recipe, t->gb ? t->gb->host_wait : -1, mt_comm_host_sync_forced());
    /* 1. main parameters this rank keeps */
    float *a = master_host(t);
    double worst = 0;
    int64_t kept = 0, total = 0;
    for (int i = 0; i < t->model->table.n; i++) {
        if (t->opt->off[i] < 0) continue;
        const int64_t n = mt_param_numel(&t->model->params[i].d);
        for (int64_t k = 0; k < n; k++)
            worst = fmax(worst, fabs((double)a[t->opt->off[i] + k] - b[ref_off[i] + k]));
        kept += n;
    }
    const double bound = strcmp(recipe, "bf16") == 0 ? 1e-2 : 1e-3; /* property 1 */
    CHECK(worst <= bound, "%s: parameters differ from one rank's by up to %.3g", recipe, worst);
    if (rt->rank == 0)
        printf("%s: largest main-parameter difference to one rank %.3g\n", recipe, worst);
    free(a);
    free(b);
    /* 2. ZeRO-1 state adds up; the compute copies are the same bits everywhere */
    if (mt_comm_all_reduce(rt->world, &kept, &total, 1, MT_COMM_I64, MT_COMM_SUM) < 0)
        die("all_reduce", MT_EGENERIC);
    CHECK(total == ref_state && kept < total, "%s: this rank keeps %lld, all %lld, one "
          "rank %lld state elements", recipe, (long long)kept, (long long)total,
          (long long)ref_state);
    mt_model *m = t->model;
    size_t n = 0;
    for (int i = 0; i < m->table.n; i++) n += (size_t)mt_param_numel(&m->params[i].d);
    float *pd = malloc(n * sizeof *pd), *hi = malloc(n * sizeof *hi), *lo = malloc(n * sizeof *lo);
    if (!pd || !hi || !lo) die("out of memory", MT_ENOMEM);
    size_t off = 0;
    for (int i = 0; i < m->table.n; i++) {
        if ((rc = mt_model_get_param(m, i, pd + off)) < 0) die("get_param", rc);
        off += (size_t)mt_param_numel(&m->params[i].d);
    }
    if (mt_comm_all_reduce(rt->world, pd, hi, n, MT_COMM_F32, MT_COMM_MAX) < 0 ||
        mt_comm_all_reduce(rt->world, pd, lo, n, MT_COMM_F32, MT_COMM_MIN) < 0)
        die("all_reduce", MT_EGENERIC);
    size_t differ = 0;
    for (size_t i = 0; i < n; i++) differ += memcmp(&hi[i], &lo[i], sizeof *hi) != 0;
    CHECK(differ == 0, "%s: %zu weights differ between the ranks", recipe, differ);
    free(pd), free(hi), free(lo);
    free(ref_off);
    if ((rc = mt_job_end(job)) < 0) die("mt_job_end", rc);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) {
        fprintf(stderr, "usage: mpirun -np 2 test_trainer_dp_gpu EXAMPLES_DIR\n");
        return 2;
    }
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    int size = 0, world_rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    rank_ = world_rank;
    if (mt_cuda_device_count() == 0 || size != 2) {
        if (world_rank == 0)
            printf("test_trainer_dp_gpu: skipped (%s)\n",
                   size != 2 ? "needs exactly 2 ranks" : "no CUDA device");
        MPI_Finalize();
        return 77;
    }
    mt_runtime *rt;
    int rc = mt_runtime_create(&rt);
    if (rc < 0) die("runtime", rc);
    mt_log_set_rank(rt->rank);
    char tmp[1024], corpus[1100];
    mt_test_tmpdir(tmp, sizeof tmp, "test_trainer_dp_gpu");
    snprintf(corpus, sizeof corpus, "%s/syn", tmp);
    if (mt_test_synth(corpus, "--vocab 64 --tokens 60000 --seed 11") != 0) die("synth", MT_EIO);
    run_recipe(rt, argv[1], corpus, "fp8-blockwise");
    run_recipe(rt, argv[1], corpus, "bf16");
    int all_ok = mt_runtime_agree(rt, failures == 0);
    if (rt->rank == 0)
        printf("test_trainer_dp_gpu: 2 ranks on one GPU (staged): %s\n",
               all_ok == 1 ? "equal to one rank" : "FAILED");
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", tmp);
    mt_runtime_destroy(rt);
    MPI_Finalize();
    return all_ok == 1 ? 0 : 1;
}
