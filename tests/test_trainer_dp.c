/* test_trainer_dp.c - data parallelism is one rank, spread out.
 *
 * Run under mpirun with N ranks (N divides 4; also alone). Properties, for
 * the fp32 recipe (no rounding but the summation order) and the
 * fp8-blockwise recipe (E4M3 weights re-quantised after every update):
 *   1. the job of N data-parallel ranks (runtime/, dp = N) trains like the
 *      same job on one rank: per-step loss and gradient norm, and every
 *      main parameter after the last step, within the rounding of the
 *      gradient summation order (fp32: 1e-5 relative loss, parameters 3e-5
 *      = 1 % of one step's lr; fp8: 1e-3 and 3e-4);
 *   2. every rank holds bit-identical parameters after every run (the same
 *      update everywhere);
 *   3. each step consumes the global batch once: consumed_samples is
 *      global_batch_size per step on every rank.
 * The reference trainer runs on each rank by itself (no communicator).
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "engine/train/trainer.h"
#include "runtime/runtime.h"
#include "test_util.h"

#define STEPS 3

static int failures;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "rank %d: FAIL %s:%d: ", rank_, __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
            failures++;                                                    \
        }                                                                  \
    } while (0)

static int rank_;

static void die(const char *what, int rc)
{
    fprintf(stderr, "rank %d: %s: %d %s\n", rank_, what, rc, mt_errmsg());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static void load_job(mt_jobspec *j, const char *examples, const char *corpus,
                     const char *recipe, int world)
{
    char path[1200], data[1200], rec[64];
    snprintf(path, sizeof path, "%s/tiny-cpu.json", examples);
    snprintf(data, sizeof data, "data.path=%s", corpus);
    snprintf(rec, sizeof rec, "precision.recipe=%s", recipe);
    const char *sets[] = {data, rec, "batch.seq_len=32", "batch.micro_batch_size=1",
                          "batch.global_batch_size=4", "train.steps=3",
                          "lr_schedule.warmup_steps=1", "data.valid_interval=0",
                          "train.log_interval=1000"};
    int rc = mt_jobspec_load(j, path, sets, (int)(sizeof sets / sizeof *sets));
    if (rc == MT_OK) rc = mt_jobspec_admit(j, world);
    if (rc < 0) die("job", rc);
}

/* The f32 main copy of every parameter (CPU backend: host memory). */
static float *main_params(const mt_trainer *t, size_t *n)
{
    *n = (size_t)(t->opt->hi - t->opt->lo);
    float *p = malloc(*n * sizeof *p);
    if (!p) die("out of memory", MT_ENOMEM);
    memcpy(p, t->opt->master, *n * sizeof *p);
    return p;
}

static void run_recipe(mt_runtime *rt, const char *examples, const char *corpus,
                       const char *recipe, double loss_tol, double param_tol)
{
    mt_jobspec jd, j1;
    load_job(&jd, examples, corpus, recipe, rt->size);
    load_job(&j1, examples, corpus, recipe, 1);
    CHECK(jd.parallel.dp == rt->size, "dp %d, world %d", jd.parallel.dp, rt->size);

    mt_job_opts jo = {.threads = 1};
    mt_job *job;
    int rc = mt_job_start(&job, rt, &jd, &jo);
    if (rc < 0) die("mt_job_start", rc);
    mt_backend *be;
    if ((rc = mt_backend_cpu_create(&be, 1)) < 0) die("backend", rc);
    mt_trainer *ref;
    if ((rc = mt_trainer_create(&ref, &j1, be)) < 0) die("reference trainer", rc);

    for (int s = 0; s < STEPS; s++) {
        mt_step_metrics md, m1;
        if ((rc = mt_job_step(job, &md)) < 0) die("dp step", rc);
        if ((rc = mt_trainer_step(ref, &m1)) < 0) die("reference step", rc);
        double dl = fabs(md.loss - m1.loss), dn = fabs(md.grad_norm - m1.grad_norm);
        CHECK(dl <= loss_tol * fabs(m1.loss), "%s step %d: loss %.9g vs one rank %.9g", recipe,
              s + 1, md.loss, m1.loss);
        CHECK(dn <= 10 * loss_tol * m1.grad_norm, "%s step %d: grad norm %.9g vs one rank %.9g",
              recipe, s + 1, md.grad_norm, m1.grad_norm);
        CHECK(job->trainer->consumed_samples == (int64_t)(s + 1) * 4,
              "%s step %d: consumed %lld samples", recipe, s + 1,
              (long long)job->trainer->consumed_samples);
        if (rt->rank == 0)
            printf("%s step %d: loss %.9f (one rank %.9f), grad norm %.6g (%.6g)\n", recipe, s + 1,
                   md.loss, m1.loss, md.grad_norm, m1.grad_norm);
    }
    size_t n, n1;
    float *pd = main_params(job->trainer, &n), *p1 = main_params(ref, &n1);
    CHECK(n == n1, "%zu vs %zu parameters", n, n1);
    double worst = 0;
    for (size_t i = 0; i < n && i < n1; i++) worst = fmax(worst, fabs((double)pd[i] - p1[i]));
    CHECK(worst <= param_tol, "%s: parameters differ from one rank's by up to %.3g", recipe, worst);
    if (rt->rank == 0) printf("%s: largest parameter difference to one rank %.3g\n", recipe, worst);

    /* bit-identical on every rank: the max and min over ranks agree */
    float *hi = malloc(n * sizeof *hi), *lo = malloc(n * sizeof *lo);
    if (!hi || !lo) die("out of memory", MT_ENOMEM);
    if (mt_comm_all_reduce(rt->world, pd, hi, n, MT_COMM_F32, MT_COMM_MAX) < 0 ||
        mt_comm_all_reduce(rt->world, pd, lo, n, MT_COMM_F32, MT_COMM_MIN) < 0)
        die("all_reduce", MT_EGENERIC);
    size_t differ = 0;
    for (size_t i = 0; i < n; i++) differ += memcmp(&hi[i], &lo[i], sizeof *hi) != 0;
    CHECK(differ == 0, "%s: %zu parameters differ between ranks", recipe, differ);
    free(hi);
    free(lo);
    free(pd);
    free(p1);
    mt_trainer_destroy(ref);
    be->destroy(be);
    if ((rc = mt_job_end(job)) < 0) die("mt_job_end", rc);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: test_trainer_dp EXAMPLES_DIR\n");
        return 2;
    }
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    mt_runtime *rt;
    int rc = mt_runtime_create(&rt);
    if (rc < 0) die("runtime", rc);
    rank_ = rt->rank;
    mt_log_set_rank(rt->rank);
    if (4 % rt->size != 0) {
        if (rt->rank == 0) fprintf(stderr, "SKIP: %d ranks do not divide the batch of 4\n", rt->size);
        mt_runtime_destroy(rt);
        MPI_Finalize();
        return 77;
    }
    /* every rank writes the same corpus (same seed) into its own folder */
    char tmp[1024], corpus[1100];
    mt_test_tmpdir(tmp, sizeof tmp, "test_trainer_dp");
    snprintf(corpus, sizeof corpus, "%s/syn", tmp);
    if (mt_test_synth(corpus, "--vocab 64 --tokens 60000 --seed 11") != 0) die("synth", MT_EIO);

    /* parameters: Adam divides by the gradient scale, so a rounding difference
     * in a near-zero gradient moves its parameter by up to a fraction of lr
     * (3e-3): bounds of 1 % (fp32) and 10 % (fp8) of one step */
    run_recipe(rt, argv[1], corpus, "fp32", 1e-5, 3e-5);
    run_recipe(rt, argv[1], corpus, "fp8-blockwise", 1e-3, 3e-4);

    int all_ok = mt_runtime_agree(rt, failures == 0);
    if (rt->rank == 0)
        printf("test_trainer_dp: %d rank%s: %s\n", rt->size, rt->size == 1 ? "" : "s",
               all_ok == 1 ? "equal to one rank" : "FAILED");
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", tmp);
    mt_runtime_destroy(rt);
    MPI_Finalize();
    return all_ok == 1 ? 0 : 1;
}
