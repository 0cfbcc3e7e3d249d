/* test_trainer_pp.c - pipeline parallelism is one rank, cut into stages.
 *
 *   mpirun -np 2|4 test_trainer_pp EXAMPLES_DIR [ep] [--gpu nccl|staged]
 *
 * Run under mpirun with 2 or 4 ranks. A tiny model with 4 decoder layers
 * (dense layer 0, MoE 1-3) and MTP depth 1, the fp32 recipe, 4 micro-batches
 * per step, 3 steps. Each layout trains through the runtime and is compared
 * with the same job on one rank (run by each rank by itself):
 *   np 2: pp=2 1F1B; pp=2 vpp=2 interleaved; pp=2 DualPipeV (also with whole
 *         backwards in its BWD_IN, property 5); explicit
 *         stage layouts (parallel.pp_layers): 1F1B with 1 + 3 layers,
 *         DualPipeV with 0,2,2,0 (stage 0: the embedding and the head +
 *         MTP only; stage 1: every decoder layer)
 *   np 4: pp=2 x dp=2 (1F1B); pp=4 1F1B (one layer per stage); pp=2 x dp=2
 *         DualPipeV (global batch 8, one rank's too: 4 micro-batches a stage)
 *   np 4, argument "ep": pp=2 x ep=2 (dp 2 on each stage, refolded as ep 2,
 *         edp 1): 1F1B, and DualPipeV (global batch 8) with whole and split
 *         backwards; each stage's MoE layers send their tokens over the
 *         stage's ep group, the bounds of pp=2 x dp=2 (measured: losses
 *         and norms within 5.0e-7 relative, parameters 2.3e-5 for 1F1B;
 *         8.4e-7 and 1.9e-5 for DualPipeV, whose norm bound is 2e-6).
 * Properties:
 *   1. every rank logs the global loss and gradient norm of each step, equal
 *      to one rank's within 1e-6 relative (the norm of pp=2 x dp=2 DualPipeV
 *      within 2e-6: its third step's is 1.3e-6 off with whole backwards as
 *      with the split, from 8 micro-batches summed over two orders and the
 *      dp reduction) (the losses come from the last
 *      stage; the norm sums each stage's part: only the summation order of
 *      the norm and of the embedding gradient (first stage + the last
 *      stage's replica) differ from one rank);
 *   2. after the last step every parameter a rank holds (its stage's layers,
 *      the embedding replica included) equals one rank's within 3e-5
 *      (absolute, as test_trainer_dp: 1 % of one step's lr of 3e-3; Adam
 *      divides by the gradient's scale, so a rounding difference of a
 *      near-zero gradient moves its parameter by a fraction of lr; the clip
 *      scale follows the norm's rounding, and DualPipeV accumulates the
 *      micro-batches' gradients in another order);
 *   3. the validation loss (forward only through the stages) equals one
 *      rank's within 1e-6 relative, on every rank;
 *   4. the stages hold disjoint parts of the model's decoder layers that
 *      cover them all (with parallel.pp_layers: as many as it gives each
 *      stage), and the step reports a measured idle fraction in
 *      [0, 1] next to the table's predicted bubble; the measured costs
 *      (issue 17): every chunk's forward and backward took time, every
 *      stage holds the same gathered per-chunk costs, the idle predicted
 *      from them is in [0, 1] and is the simulator's on them, and the
 *      simulator given equal per-chunk costs predicts the table's idle;
 *   5. DualPipeV's backward split (BWD_IN defers the weight-gradient GEMMs,
 *      BWD_W runs them) trains bit for bit as the same table run with whole
 *      backwards in BWD_IN (the pipeline's bwd_whole): every step's loss,
 *      MTP loss and gradient norm, and every parameter after the last step
 *      (pp=2, and pp=2 x dp=2 where BWD_W's layer marks start the gradient
 *      buckets' reductions; pp=2 x ep=2, whose BWD_IN runs the experts'
 *      backward exchanges and BWD_W their deferred weight GEMMs);
 *   6. pp x ep: a stage's rank holds only the n_routed_experts / ep experts
 *      of its ep rank (every MoE layer of its chunks), and it sent and
 *      received tokens.
 *
 * --gpu COMM: the CUDA backend, parallel.comm COMM (nccl: a GPU per rank,
 * pipeline messages over NCCL links; staged: through host memory, ranks
 * sharing a GPU where there are fewer GPUs than ranks), the bf16 recipe
 * (CUDA activations are bf16), the layouts above except property 5's
 * bit-identity (GPU kernels may add in any order); the one-rank reference runs on the rank's GPU in a 2 GB arena
 * made before the job's. Bounds are test_trainer_dp_gpu's for bf16 (loss,
 * mtp and valid loss 1e-3 relative, norm 1e-2, parameters 1e-2): a wrong
 * or stale message moves the loss by far more. Exit 77 without a CUDA
 * device, or for nccl with fewer GPUs than ranks.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "engine/parallel/moe_a2a.h"
#include "engine/train/trainer.h"
#include "runtime/runtime.h"
#include "mpi_check.h"
#include "test_util.h"

#define STEPS 3

/* --gpu COMM: NULL on the CPU */
static const char *GPU_COMM;

/* Property 4's measured costs on this stage after a step. */
static void check_measured_costs(const mt_trainer *t, const mt_step_metrics *mp, const char *name,
                                 int step)
{
    const mt_pipeline *pl = t->pipe;
    const int C = pl->C, pp = pl->layout.pp;
    CHECK(mp->pp_bubble_measured >= 0 && mp->pp_bubble_measured <= 1 &&
              mp->pp_bubble_measured == pl->measured_idle[pl->stage],
          "%s step %d: idle predicted from measured costs %.3f (stage's %.3f)", name, step,
          mp->pp_bubble_measured, pl->measured_idle[pl->stage]);
    double v[64], hi[64], lo[64];
    if (C * 4 > 64 || pp > 16) die("the test keeps 16 chunks", MT_EINVAL);
    for (int c = 0; c < C; c++) {
        const mt_sched_costs *k = &pl->chunk_costs[c];
        CHECK(k->f > 0 && k->b + k->b_in > 0 && k->p2p == 0,
              "%s step %d: chunk %d's measured costs F %g B %g Bi %g W %g", name, step, c, k->f,
              k->b, k->b_in, k->w);
        v[c * 4] = k->f, v[c * 4 + 1] = k->b, v[c * 4 + 2] = k->b_in, v[c * 4 + 3] = k->w;
    }
    int rc = mt_comm_all_reduce(mt_comm_host(t->pp), v, hi, C * 4, MT_COMM_F64, MT_COMM_MAX);
    if (rc == MT_OK)
        rc = mt_comm_all_reduce(mt_comm_host(t->pp), v, lo, C * 4, MT_COMM_F64, MT_COMM_MIN);
    if (rc < 0) die("all_reduce of the measured costs", rc);
    for (int i = 0; i < C * 4; i++)
        CHECK(hi[i] == lo[i], "%s step %d: the stages hold different costs of chunk %d (kind "
              "%d): %g .. %g", name, step, i / 4, i % 4, lo[i], hi[i]);
    double bubble, idle[16], eq_bubble, eq_idle[16];
    rc = mt_schedule_predict_chunks(&pl->sched, pl->chunk_costs, &bubble, idle);
    if (rc < 0) die("mt_schedule_predict_chunks", rc);
    CHECK(bubble == pl->measured_bubble, "%s step %d: measured-cost bubble %.6f, simulated %.6f",
          name, step, pl->measured_bubble, bubble);
    for (int st = 0; st < pp; st++)
        CHECK(idle[st] == pl->measured_idle[st] && idle[st] >= 0 && idle[st] <= 1,
              "%s step %d: stage %d's idle from measured costs %.6f, simulated %.6f", name,
              step, st, pl->measured_idle[st], idle[st]);
    mt_sched_costs eq[16];
    for (int c = 0; c < C; c++) mt_sched_costs_default(&eq[c]);
    rc = mt_schedule_predict_chunks(&pl->sched, eq, &eq_bubble, eq_idle);
    if (rc < 0) die("mt_schedule_predict_chunks", rc);
    CHECK(fabs(eq_bubble - pl->predicted_bubble) < 1e-12,
          "%s: equal chunk costs predict bubble %.6f, the table %.6f", name, eq_bubble,
          pl->predicted_bubble);
    for (int st = 0; st < pp; st++)
        CHECK(fabs(eq_idle[st] - pl->predicted_idle[st]) < 1e-12,
              "%s: equal chunk costs predict stage %d idle %.6f, the table %.6f", name, st,
              eq_idle[st], pl->predicted_idle[st]);
}


static void load_job(mt_jobspec *j, const char *examples, const char *corpus,
                     const char *layout_sets, int world)
{
    char path[1200], data[1200];
    snprintf(path, sizeof path, "%s/tiny-cpu.json", examples);
    snprintf(data, sizeof data, "data.path=%s", corpus);
    static char comm[64];
    snprintf(comm, sizeof comm, "parallel.comm=%s", GPU_COMM ? GPU_COMM : "auto");
    const char *sets[24] = {data, GPU_COMM ? "precision.recipe=bf16" : "precision.recipe=fp32",
                            "model.num_hidden_layers=4",
                            "model.hidden_size=64", "model.intermediate_size=128",
                            "batch.seq_len=16", "batch.micro_batch_size=1",
                            "batch.global_batch_size=4", "train.steps=3",
                            "lr_schedule.warmup_steps=1", "data.valid_interval=1000",
                            "data.valid_batches=2", "train.log_interval=1000"};
    int n = 13;
    if (GPU_COMM) {
        sets[n++] = "backend=cuda";
        if (world > 1) sets[n++] = comm;
    }
    static char buf[256]; /* the sets point into it until mt_jobspec_load returns */
    snprintf(buf, sizeof buf, "%s", layout_sets);
    for (char *tok = strtok(buf, " "); tok && n < 24; tok = strtok(NULL, " ")) sets[n++] = tok;
    int rc = mt_jobspec_load(j, path, sets, n);
    if (rc == MT_OK) rc = mt_jobspec_admit(j, world);
    if (rc < 0) die("job", rc);
}

/* Largest difference between the parameters this rank holds and the same
 * parameters (by global index) of the one-rank trainer. */
static double params_diff(mt_trainer *t, mt_trainer *ref)
{
    mt_model *m = t->model, *r = ref->model;
    double worst = 0;
    for (int i = 0; i < m->table.n; i++) {
        const int g = m->global_param[i];
        const int64_t n = mt_param_numel(&m->params[i].d);
        float *a = malloc((size_t)n * sizeof *a), *b = malloc((size_t)n * sizeof *b);
        if (!a || !b) die("out of memory", MT_ENOMEM);
        CHECK(strcmp(m->params[i].d.name, r->params[g].d.name) == 0, "parameter %s is %s",
              m->params[i].d.name, r->params[g].d.name);
        if (mt_model_get_param(m, i, a) < 0 || mt_model_get_param(r, g, b) < 0)
            die("get_param", MT_EGENERIC);
        for (int64_t k = 0; k < n; k++) worst = fmax(worst, fabs((double)a[k] - b[k]));
        free(a);
        free(b);
    }
    return worst;
}

/* What a run leaves for the next one to compare with (property 5). */
static struct {
    double loss[STEPS], mtp[STEPS], norm[STEPS];
    float *params;
    int64_t n;
} prev;

/* Every parameter this rank holds, in table order, as host f32. */
static float *params_flat(mt_model *m, int64_t *n_out)
{
    int64_t n = 0;
    for (int i = 0; i < m->table.n; i++) n += mt_param_numel(&m->params[i].d);
    float *a = malloc((size_t)(n > 0 ? n : 1) * sizeof *a);
    if (!a) die("out of memory", MT_ENOMEM);
    int64_t at = 0;
    for (int i = 0; i < m->table.n; i++) {
        if (mt_model_get_param(m, i, a + at) < 0) die("get_param", MT_EGENERIC);
        at += mt_param_numel(&m->params[i].d);
    }
    *n_out = n;
    return a;
}

/* how: 0 as configured; 1 the split run with whole backwards (kept for the
 * next run); 2 compared bit for bit with the previous run (property 5). */
static void run_layout_how(mt_runtime *rt, const char *examples, const char *corpus,
                           const char *layout_sets, const char *name, int how, double norm_tol);

static void run_layout(mt_runtime *rt, const char *examples, const char *corpus,
                       const char *layout_sets, const char *name)
{
    run_layout_how(rt, examples, corpus, layout_sets, name, 0, 1e-6);
}

static void run_layout_how(mt_runtime *rt, const char *examples, const char *corpus,
                           const char *layout_sets, const char *name, int how, double norm_tol)
{
    mt_jobspec jp, j1;
    load_job(&jp, examples, corpus, layout_sets, rt->size);
    char ref_sets[256] = ""; /* the one-rank job takes the layout's batch.* settings */
    char copy[256];
    snprintf(copy, sizeof copy, "%s", layout_sets);
    for (char *tok = strtok(copy, " "); tok; tok = strtok(NULL, " "))
        if (strncmp(tok, "batch.", 6) == 0) {
            strncat(ref_sets, " ", sizeof ref_sets - strlen(ref_sets) - 1);
            strncat(ref_sets, tok, sizeof ref_sets - strlen(ref_sets) - 1);
        }
    load_job(&j1, examples, corpus, ref_sets, 1);
    /* the reference's backend first: on a GPU the job's arena takes what
     * is left (the runtime's rule: rank r on device r % devices) */
    mt_backend *be;
    int rc = GPU_COMM ? mt_backend_cuda_create(&be, rt->rank % mt_cuda_device_count(),
                                               (size_t)2048 << 20)
                      : mt_backend_cpu_create(&be, 1);
    if (rc < 0) die("backend", rc);
    mt_job_opts jo = {.threads = 1};
    mt_job *job;
    rc = mt_job_start(&job, rt, &jp, &jo);
    if (rc < 0) die("mt_job_start", rc);
    if (how == 1) job->trainer->pipe->bwd_whole = 1;
    /* bounds: see the header (GPU: test_trainer_dp_gpu's for bf16) */
    const double tol_loss = GPU_COMM ? 1e-3 : 1e-6, tol_par = GPU_COMM ? 1e-2 : 3e-5;
    if (GPU_COMM) norm_tol = 1e-2;
    mt_trainer *ref;
    if ((rc = mt_trainer_create(&ref, &j1, be)) < 0) die("reference trainer", rc);

    double worst_loss = 0;
    for (int s = 0; s < STEPS; s++) {
        mt_step_metrics mp, m1;
        if ((rc = mt_job_step(job, &mp)) < 0) die("pipeline step", rc);
        if ((rc = mt_trainer_step(ref, &m1)) < 0) die("reference step", rc);
        if (how == 1) {
            prev.loss[s] = mp.loss;
            prev.mtp[s] = mp.mtp_loss;
            prev.norm[s] = mp.grad_norm;
        } else if (how == 2) {
            CHECK(mp.loss == prev.loss[s] && mp.mtp_loss == prev.mtp[s] &&
                      mp.grad_norm == prev.norm[s],
                  "%s step %d: split backward loss %.17g mtp %.17g norm %.17g, whole backward "
                  "%.17g %.17g %.17g", name, s + 1, mp.loss, mp.mtp_loss, mp.grad_norm,
                  prev.loss[s], prev.mtp[s], prev.norm[s]);
        }
        const double dl = fabs(mp.loss - m1.loss) / fabs(m1.loss);
        const double dn = fabs(mp.grad_norm - m1.grad_norm) / m1.grad_norm;
        const double dm = fabs(mp.mtp_loss - m1.mtp_loss) / fabs(m1.mtp_loss);
        worst_loss = fmax(worst_loss, fmax(dl, fmax(dn, dm)));
        CHECK(dl <= tol_loss && dm <= tol_loss, "%s step %d: loss %.9g mtp %.9g vs one rank %.9g %.9g",
              name, s + 1, mp.loss, mp.mtp_loss, m1.loss, m1.mtp_loss);
        CHECK(dn <= norm_tol, "%s step %d: grad norm %.9g vs one rank %.9g", name, s + 1,
              mp.grad_norm, m1.grad_norm);
        CHECK(mp.pp_idle >= 0 && mp.pp_idle <= 1 && mp.pp_bubble >= 0 && mp.pp_bubble < 1,
              "%s step %d: idle %.3f predicted bubble %.3f", name, s + 1, mp.pp_idle,
              mp.pp_bubble);
        check_measured_costs(job->trainer, &mp, name, s + 1);
        if (rt->rank == 0)
            printf("%s step %d: loss %.9f (one rank %.9f), mtp %.9f (%.9f), grad norm %.9g "
                   "(%.9g), idle %.3f (predicted %.3f from measured costs, %.3f with equal "
                   "costs)\n", name, s + 1, mp.loss, m1.loss, mp.mtp_loss, m1.mtp_loss,
                   mp.grad_norm, m1.grad_norm, mp.pp_idle, mp.pp_bubble_measured, mp.pp_bubble);
    }
    mt_trainer *t = job->trainer;
    if (how == 1) {
        free(prev.params);
        prev.params = params_flat(t->model, &prev.n);
    } else if (how == 2) {
        int64_t n;
        float *a = params_flat(t->model, &n);
        CHECK(n == prev.n && memcmp(a, prev.params, (size_t)n * sizeof *a) == 0,
              "%s: parameters after the split backward differ from the whole backward's "
              "(%lld vs %lld values)", name, (long long)n, (long long)prev.n);
        if (rt->rank == 0 && n == prev.n)
            printf("%s: split backward bit-identical to whole backward (%lld parameter values "
                   "on rank 0)\n", name, (long long)n);
        free(a);
    }
    double worst = params_diff(t, ref);
    CHECK(worst <= tol_par, "%s: parameters differ from one rank's by up to %.3g", name, worst);
    /* the stages' decoder layers are disjoint and cover the model */
    const int L = t->job.model.num_hidden_layers;
    int *have = calloc((size_t)L, sizeof *have), *sum = calloc((size_t)L, sizeof *sum);
    for (int l = 0; l < L; l++) have[l] = t->model->local[l] && t->dp_rank == 0;
    if (mt_comm_all_reduce(rt->world, have, sum, (size_t)L, MT_COMM_I32, MT_COMM_SUM) < 0)
        die("all_reduce", MT_EGENERIC);
    for (int l = 0; l < L; l++) CHECK(sum[l] == 1, "%s: layer %d is on %d stages", name, l, sum[l]);
    /* an explicit stage layout is the one the stages hold */
    const mt_layout *lay = &t->job.parallel;
    if (lay->n_pp_layers > 0) {
        int want = 0, held = 0;
        for (int k = 0; k < lay->n_pp_layers; k++)
            if (mt_layout_stage_of_chunk(lay, k) == t->pipe->stage) want += lay->pp_layers[k];
        for (int l = 0; l < L; l++) held += t->model->local[l];
        CHECK(held == want, "%s: stage %d holds %d decoder layers, parallel.pp_layers gives %d",
              name, t->pipe->stage, held, want);
    }
    free(have);
    free(sum);
    /* pp x ep: the stage's model holds only its ep rank's experts, and its
     * tokens did travel (the exchanges match only if every ep rank of the
     * stage ran the same actions) */
    if (lay->ep > 1) {
        const int E = t->job.model.n_routed_experts, per = E / lay->ep;
        const int er = mt_comm_rank(t->ep);
        int foreign = 0, n_exp = 0;
        for (int i = 0; i < t->model->table.n; i++) {
            const int e = t->model->params[i].d.expert;
            if (e < 0) continue;
            n_exp++;
            foreign += e < er * per || e >= (er + 1) * per;
        }
        CHECK(n_exp > 0 && foreign == 0, "%s: stage %d ep rank %d holds %d expert parameters, "
              "%d of other ep ranks' experts", name, t->pipe->stage, er, n_exp, foreign);
        for (int l = 0; l < L; l++)
            if (t->model->local[l] && t->model->blocks[l].is_moe)
                CHECK(t->model->blocks[l].moe.E_local == per, "%s: layer %d holds %d experts, "
                      "not %d / ep %d", name, l, t->model->blocks[l].moe.E_local, E, lay->ep);
        int64_t sent, received;
        mt_moe_a2a_bytes(t->disp, &sent, &received);
        CHECK(sent > 0 && received > 0, "%s: stage %d ep rank %d exchanged %lld / %lld bytes",
              name, t->pipe->stage, er, (long long)sent, (long long)received);
    }
    /* validation through the stages */
    double vp, v1;
    if ((rc = mt_trainer_validate(t, &vp)) < 0) die("validate", rc);
    if ((rc = mt_trainer_validate(ref, &v1)) < 0) die("validate (one rank)", rc);
    CHECK(fabs(vp - v1) <= tol_loss * fabs(v1), "%s: valid loss %.9g vs one rank %.9g", name, vp, v1);
    double w[2] = {worst, worst_loss}, wmax[2];
    if (mt_comm_all_reduce(rt->world, w, wmax, 2, MT_COMM_F64, MT_COMM_MAX) < 0)
        die("all_reduce", MT_EGENERIC);
    if (rt->rank == 0)
        printf("%s: largest relative loss / mtp / norm difference %.3g, largest parameter "
               "difference %.3g (all ranks), valid loss %.9f (one rank %.9f)\n", name, wmax[1],
               wmax[0], vp, v1);
    mt_trainer_destroy(ref);
    be->destroy(be);
    if ((rc = mt_job_end(job)) < 0) die("mt_job_end", rc);
}

int main(int argc, char **argv)
{
    int ep_mode = 0, bad = argc < 2;
    for (int i = 2; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "ep")) ep_mode = 1;
        else if (!strcmp(argv[i], "--gpu") && i + 1 < argc) GPU_COMM = argv[++i];
        else bad = 1;
    }
    if (bad) {
        fprintf(stderr, "usage: test_trainer_pp EXAMPLES_DIR [ep] [--gpu nccl|staged]\n");
        return 2;
    }
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    mt_runtime *rt;
    int rc = mt_runtime_create(&rt);
    if (rc < 0) die("runtime", rc);
    rank_ = rt->rank;
    mt_log_set_rank(rt->rank);
    if ((rt->size != 2 && rt->size != 4) || (ep_mode && rt->size != 4)) {
        if (rt->rank == 0)
            fprintf(stderr, "SKIP: needs %s ranks, not %d\n", ep_mode ? "4" : "2 or 4", rt->size);
        mt_runtime_destroy(rt);
        MPI_Finalize();
        return 77;
    }
    if (GPU_COMM) {
        const int ndev = mt_cuda_device_count();
        const int nccl = strcmp(GPU_COMM, "nccl") == 0;
        if (ndev == 0 || (nccl && ndev < rt->size)) {
            if (rt->rank == 0)
                printf("test_trainer_pp --gpu %s: skipped (%d CUDA devices, %d ranks)\n",
                       GPU_COMM, ndev, rt->size);
            mt_runtime_destroy(rt);
            MPI_Finalize();
            return 77;
        }
    }
    char tmp[1024], corpus[1100], tmpname[64];
    snprintf(tmpname, sizeof tmpname, "test_trainer_pp%s%s", GPU_COMM ? "_gpu_" : "",
             GPU_COMM ? GPU_COMM : "");
    mt_test_tmpdir(tmp, sizeof tmp, tmpname);
    snprintf(corpus, sizeof corpus, "%s/syn", tmp);
    if (mt_test_synth(corpus, "--vocab 64 --tokens 60000 --seed 11") != 0) die("synth", MT_EIO);

    if (ep_mode) {
        /* pp x ep: each stage's 2 ranks exchange their tokens over the
         * stage's ep group, at the same actions of the stage's table */
        run_layout(rt, argv[1], corpus, "parallel.pp=2 parallel.dp=2 parallel.ep=2",
                   "pp2xep2-1f1b");
        if (!GPU_COMM)
            run_layout_how(rt, argv[1], corpus, "parallel.pp=2 parallel.vpp=2 parallel.dp=2 "
                           "parallel.ep=2 parallel.schedule=dualpipev batch.global_batch_size=8",
                           "pp2xep2-dualpipev-whole-bwd", 1, 2e-6);
        run_layout_how(rt, argv[1], corpus, "parallel.pp=2 parallel.vpp=2 parallel.dp=2 "
                       "parallel.ep=2 parallel.schedule=dualpipev batch.global_batch_size=8",
                       "pp2xep2-dualpipev", GPU_COMM ? 0 : 2, 2e-6);
    } else if (rt->size == 2) {
        run_layout(rt, argv[1], corpus, "parallel.pp=2 parallel.schedule=1f1b", "pp2-1f1b");
        run_layout(rt, argv[1], corpus, "parallel.pp=2 parallel.vpp=2 parallel.schedule=interleaved",
                   "pp2-vpp2-interleaved");
        if (!GPU_COMM)
            run_layout_how(rt, argv[1], corpus, "parallel.pp=2 parallel.vpp=2 "
                           "parallel.schedule=dualpipev", "pp2-dualpipev-whole-bwd", 1, 1e-6);
        run_layout_how(rt, argv[1], corpus, "parallel.pp=2 parallel.vpp=2 "
                       "parallel.schedule=dualpipev", "pp2-dualpipev", GPU_COMM ? 0 : 2, 1e-6);
        /* flexible stage layouts: 1 + 3 layers; DualPipeV with the embedding
         * and the head + MTP in chunks of their own (no decoder layer) */
        run_layout(rt, argv[1], corpus, "parallel.pp=2 parallel.pp_layers=1,3",
                   "pp2-layers-1,3");
        run_layout(rt, argv[1], corpus, "parallel.pp=2 parallel.vpp=2 parallel.schedule=dualpipev "
                   "parallel.pp_layers=0,2,2,0", "pp2-dualpipev-layers-0,2,2,0");
    } else {
        run_layout(rt, argv[1], corpus, "parallel.pp=2 parallel.dp=2", "pp2xdp2-1f1b");
        run_layout(rt, argv[1], corpus, "parallel.pp=4 parallel.dp=1", "pp4-1f1b");
        /* the split's layer marks start the gradient buckets in BWD_W */
        if (!GPU_COMM)
            run_layout_how(rt, argv[1], corpus, "parallel.pp=2 parallel.vpp=2 parallel.dp=2 "
                           "parallel.schedule=dualpipev batch.global_batch_size=8",
                           "pp2xdp2-dualpipev-whole-bwd", 1, 2e-6);
        run_layout_how(rt, argv[1], corpus, "parallel.pp=2 parallel.vpp=2 parallel.dp=2 "
                       "parallel.schedule=dualpipev batch.global_batch_size=8",
                       "pp2xdp2-dualpipev", GPU_COMM ? 0 : 2, 2e-6);
    }

    free(prev.params);
    int all_ok = mt_runtime_agree(rt, failures == 0);
    if (rt->rank == 0)
        printf("test_trainer_pp%s%s: %d ranks: %s\n", GPU_COMM ? " --gpu " : "",
               GPU_COMM ? GPU_COMM : "", rt->size,
               all_ok == 1 ? "equal to one rank" : "FAILED");
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", tmp);
    mt_runtime_destroy(rt);
    MPI_Finalize();
    return all_ok == 1 ? 0 : 1;
}
