/* trainer.c - see trainer.h. */
#define _POSIX_C_SOURCE 200809L
#include "engine/train/trainer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/parallel/sharding.h"
#include "engine/train/grad_buckets.h"
#include "engine/train/lr_schedule.h"
#include "engine/train/spike.h"
#include "engine/train/trainer_ep.h"
#include "engine/train/trainer_tp.h"
#include "kernels/op_profile.h"
#include "base/mt_clock.h"
#include "base/mt_log.h"
#include "base/mt_status.h"

void mt_router_bias_update(float *bias, const int64_t *load, int E, double gamma)
{
    double mean = 0;
    for (int e = 0; e < E; e++) mean += (double)load[e];
    mean /= E;
    for (int e = 0; e < E; e++) {
        double d = mean - (double)load[e];
        bias[e] += (float)(gamma * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0));
    }
}

/* The model's options from the job: precision, batch shape, recompute and
 * loss weights. */
void mt_trainer_model_opts(mt_model_opts *o, const mt_jobspec *j)
{
    memset(o, 0, sizeof *o);
    o->recipe = j->precision.recipe;
    o->micro_batch = j->batch.micro_batch_size;
    o->seq_len = j->batch.seq_len;
    o->recompute_mla_up = j->precision.recompute_mla_up;
    o->recompute_moe_act = j->precision.recompute_moe_act;
    o->grads_bf16 = j->precision.grads == 1;
    o->mtp_weight = j->loss.mtp_weight;
    o->aux_alpha = j->loss.aux_alpha;
    o->expert_align = 0;
    o->ep_overlap = j->ep_overlap == MT_EP_OVERLAP_HALVES;
}

static int open_data(mt_trainer *t)
{
    const mt_jobspec *j = &t->job;
    MT_CHECK(mt_indexed_open(j->data.path, &t->data));
    mt_samples_config sc = {
        .split_ratios = j->data.split,
        .split = MT_SPLIT_TRAIN,
        .seq_len = j->batch.seq_len,
        .num_samples = j->train.steps * j->batch.global_batch_size,
        .eod_token = mt_jobspec_eod(j),
        .seed = (uint64_t)j->train.seed,
    };
    int rc = mt_samples_open(t->data, &sc, &t->train);
    if (rc < 0) return mt_err_wrap(rc, "train split of %s", j->data.path);
    if (j->data.valid_interval > 0) {
        sc.split = MT_SPLIT_VALID;
        sc.num_samples = (int64_t)j->data.valid_batches * j->batch.micro_batch_size;
        rc = mt_samples_open(t->data, &sc, &t->valid);
        if (rc < 0) return mt_err_wrap(rc, "valid split of %s", j->data.path);
    }
    return MT_OK;
}

int mt_trainer_create(mt_trainer **out, const mt_jobspec *job, mt_backend *be)
{
    return mt_trainer_create_in(out, job, be, NULL);
}

/* A group of the layout: its size must be the layout's; its memory the
 * backend's (gradients are reduced where they are). */
static int check_group(const char *what, mt_comm *g, int want_size, mt_backend *be)
{
    const int n = g ? mt_comm_size(g) : 1;
    if (n != want_size)
        return MT_ERR(MT_EINVAL, "trainer: the %s group has %d ranks, the layout %d", what, n,
                      want_size);
    const mt_comm_mem want = be->kind == MT_BE_CPU ? MT_COMM_HOST : MT_COMM_DEVICE;
    if (g && mt_comm_mem_kind(g) != want)
        return MT_ERR(MT_EINVAL, "trainer: the %s backend's %s group needs %s memory", be->name,
                      what, want == MT_COMM_HOST ? "host" : "device");
    return MT_OK;
}

/* ZeRO-1 ownership of the model's (local) parameters: owner[i] from the
 * full table's rule (mt_zero_owners), keep[i] when this rank is the owner
 * in the parameter's group (dp for dense, edp for routed experts). */
static int own_params(mt_trainer *t, mt_comm *edp)
{
    const mt_model *m = t->model;
    mt_param_table full;
    MT_CHECK(mt_params_build(&full, &t->job.model, 0, -1));
    int *all = malloc((size_t)(full.n > 0 ? full.n : 1) * sizeof *all);
    const size_t n = (size_t)(m->table.n > 0 ? m->table.n : 1);
    t->owner = malloc(n * sizeof *t->owner);
    t->keep = malloc(n);
    int rc = all && t->owner && t->keep ? MT_OK : MT_ERR(MT_ENOMEM, "trainer: out of memory");
    if (rc == MT_OK) rc = mt_zero_owners(&t->job.model, &t->job.parallel, all);
    const int edp_rank = edp ? mt_comm_rank(edp) : 0;
    for (int i = 0; rc == MT_OK && i < m->table.n; i++) {
        const int gi = m->global_param ? m->global_param[i] : i;
        t->owner[i] = all[gi];
        /* with ep 1 and tp 1 the edp group is the dp group */
        const int me = m->params[i].d.expert >= 0 &&
                               (t->job.parallel.ep > 1 || t->job.parallel.etp > 1 || t->tp_size > 1)
                           ? edp_rank : t->dp_rank;
        t->keep[i] = t->owner[i] >= 0 && t->owner[i] == me;
    }
    free(all);
    mt_params_free(&full);
    return rc;
}

/* The executor's plan of this stage, the model's chunks, and the group of
 * the two stages holding the embedding when the last stage has a replica. */
static int pipeline_init(mt_trainer *t, mt_comm *pp, mt_model_opts *mo)
{
    const mt_layout *l = &t->job.parallel;
    const mt_model_config *c = &t->job.model;
    const int stage = mt_comm_rank(pp), last = mt_layout_stage_of_chunk(l, mt_layout_chunks(l) - 1);
    if (mt_comm_backend_of(pp) == MT_COMM_LOCAL)
        return MT_ERR(MT_ENOTSUP, "parallel.pp %d: the local backend has no pipeline messages "
                      "(engine/parallel/comm.h); use parallel.comm=nccl or staged on CUDA, mpi "
                      "on the cpu", l->pp);
    t->pp = pp;
    t->pipe = calloc(1, sizeof *t->pipe);
    t->mb_stats = calloc((size_t)t->accum, sizeof *t->mb_stats);
    if (!t->pipe || !t->mb_stats) return MT_ERR(MT_ENOMEM, "trainer: out of memory");
    MT_CHECK(mt_pipeline_create(t->pipe, l, c, stage, t->accum, pp));
    mt_pipeline_model_opts(t->pipe, mo);
    if (last != 0 && (c->num_nextn_predict_layers > 0 || c->tie_word_embeddings))
        MT_CHECK(mt_comm_split(pp, stage == 0 || stage == last ? 0 : MT_COMM_NO_COLOR, stage,
                               &t->emb));
    MT_LOGI("pipeline stage %d of %d: %d chunk(s), %d micro-batches per step, predicted "
            "bubble %.3f (stage idle %.3f)", stage, l->pp, t->pipe->n_local, t->accum,
            t->pipe->predicted_bubble, t->pipe->predicted_idle[stage]);
    return MT_OK;
}

int mt_trainer_create_in(mt_trainer **out, const mt_jobspec *job, mt_backend *be,
                         const mt_trainer_groups *g)
{
    *out = NULL;
    const mt_layout *l = &job->parallel;
    if (l->dp < 1)
        return MT_ERR(MT_EINVAL, "trainer: job %s is not admitted (parallel.dp is %d): "
                      "mt_jobspec_admit resolves the layout for the ranks", job->name, l->dp);
    MT_CHECK(mt_jobspec_check_runnable(l));
    mt_comm *dp = g ? g->dp : NULL, *ep = g ? g->ep : NULL, *edp = g ? g->edp : NULL;
    mt_comm *tp = g ? g->tp : NULL;
    if ((l->ep > 1 || l->etp > 1) && !ep)
        return MT_ERR(MT_EINVAL, "trainer: parallel.ep %d, etp %d needs the expert-parallel "
                      "group (mt_trainer_create_in; the runtime builds it from the layout)",
                      l->ep, l->etp);
    mt_comm *pp = g ? g->pp : NULL;
    if (l->pp > 1 && !pp)
        return MT_ERR(MT_EINVAL, "trainer: parallel.pp %d needs the pipeline group "
                      "(mt_trainer_create_in; the runtime builds it from the layout)", l->pp);
    MT_CHECK(check_group("pipeline", l->pp > 1 ? pp : NULL, l->pp, be));
    if (l->tp > 1 && !tp)
        return MT_ERR(MT_EINVAL, "trainer: parallel.tp %d needs the tensor-parallel group "
                      "(mt_trainer_create_in; the runtime builds it from the layout)", l->tp);
    MT_CHECK(check_group("data-parallel", dp, l->dp, be));
    /* the token exchange: ep x etp ranks (groups.h: exp) */
    MT_CHECK(check_group("expert-parallel", ep, l->ep * l->etp, be));
    if (l->ep > 1 || l->etp > 1 || l->tp > 1)
        MT_CHECK(check_group("expert-data-parallel", edp, mt_layout_edp(l), be));
    MT_CHECK(check_group("tensor-parallel", tp, l->tp, be));
    mt_trainer *t = calloc(1, sizeof *t);
    if (!t) return MT_ERR(MT_ENOMEM, "trainer: out of memory");
    int rc = MT_OK;
    t->job = *job;
    t->be = be;
    t->dp = dp;
    t->dp_rank = dp ? mt_comm_rank(dp) : 0;
    t->dp_size = dp ? mt_comm_size(dp) : 1;
    t->accum = mt_jobspec_grad_accum(job);
    t->flops_per_token = mt_model_flops_per_token(&job->model, job->batch.seq_len);
    t->peak_tflops = be->peak_tflops;
    const char *prof = getenv("MOETRAIN_PROFILE");
    t->profile = prof && *prof && strcmp(prof, "0") != 0;
    MT_GOTO(mt_spike_init(&t->spike, &job->train), fail);
    MT_GOTO(open_data(t), fail);
    mt_model_opts mo;
    mt_trainer_model_opts(&mo, job);
    if (l->ep > 1 || l->etp > 1) MT_GOTO(mt_trainer_ep_init(t, ep, edp, &mo), fail);
    if (l->pp > 1) MT_GOTO(pipeline_init(t, pp, &mo), fail);
    /* routed experts go over edp under ep or tp (the sharding map's folding) */
    const int expert_split = l->ep > 1 || l->etp > 1 || l->tp > 1;
    if (dp || (expert_split && edp)) { /* gradients reduced in buckets from inside the backward */
        if (!(t->gb = calloc(1, sizeof *t->gb))) {
            rc = MT_ERR(MT_ENOMEM, "trainer: out of memory");
            goto fail;
        }
        mo.on_layer_grads = mt_grad_buckets_layer_done;
        mo.on_layer_grads_arg = t->gb;
    }
    if (l->tp > 1) { /* its hook fixes the layer's gradients, then calls the buckets' */
        MT_GOTO(mt_trainer_tp_init(t, tp, &mo), fail);
        t->edp = edp; /* the routed experts' ZeRO-1 group (trainer.h) */
    }
    MT_GOTO(mt_model_create(&t->model, &job->model, &mo, be), fail);
    /* ZeRO-1: this rank keeps the optimizer state of the parameters it owns
     * (owners in the full table's numbering; the model's table lacks the
     * other ranks' experts) */
    MT_GOTO(own_params(t, edp), fail);
    MT_GOTO(mt_optimizer_create(&t->opt, t->model, job, t->keep), fail);
    MT_GOTO(mt_trainer_tp_bind(t), fail);
    if (t->gb)
        MT_GOTO(mt_grad_buckets_build(t->gb, t->model, t->owner, dp, edp, expert_split, job),
                fail);
    const int E = job->model.n_routed_experts;
    if ((dp || l->tp > 1) && E > 0 && !(t->load_sum = calloc((size_t)E, sizeof *t->load_sum))) {
        rc = MT_ERR(MT_ENOMEM, "trainer: out of memory");
        goto fail;
    }
    /* checkpoint / hf: the caller restores the state (engine/train/train_state.h) */
    if (job->init.kind == MT_INIT_RANDOM)
        MT_GOTO(mt_optimizer_init_random(t->opt, t->model, (uint64_t)job->train.seed), fail);
    t->tokens = malloc((size_t)job->batch.micro_batch_size * (job->batch.seq_len + 1) * 4);
    t->bias_host = malloc((size_t)(job->model.n_routed_experts + 1) * 4);
    if (!t->tokens || !t->bias_host) {
        rc = MT_ERR(MT_ENOMEM, "trainer: out of memory");
        goto fail;
    }
    size_t in_use, peak;
    be->mem_stats(be, &in_use, &peak);
    const size_t wb = t->model->param_bytes, ob = mt_optimizer_state_bytes(t->opt);
    MT_LOGI("job %s: %d layers (+%d MTP), %lld parameters, %s recipe, main params %s, "
            "gradients %s, %d micro-batch(es) of %d x %d per step, %.1f MB on %s (weights and gradients "
            "%.1f MB, optimizer state %.1f MB (ZeRO-1: %lld of %lld parameter elements, dp "
            "rank %d of %d), activations and workspace %.1f MB)",
            job->name, job->model.num_hidden_layers, job->model.num_nextn_predict_layers,
            (long long)mt_params_numel(&t->model->table),
            job->precision.recipe == MT_RECIPE_FP8_BLOCKWISE ? "fp8-blockwise"
            : job->precision.recipe == MT_RECIPE_BF16        ? "bf16"
                                                             : "fp32",
            job->precision.main_params == MT_MAIN_FP32   ? "fp32"
            : job->precision.main_params == MT_MAIN_BF16 ? "bf16"
                                                         : "none",
            t->model->grad_type == MT_C_BF16 ? "bf16" : "fp32", t->accum, job->batch.micro_batch_size, job->batch.seq_len, in_use / 1e6, be->name,
            wb / 1e6, ob / 1e6, (long long)t->opt->n_state, (long long)t->model->n_grad,
            t->dp_rank, t->dp_size, (double)(in_use - wb - ob) / 1e6);
    *out = t;
    return MT_OK;
fail:
    mt_trainer_destroy(t);
    return rc;
}

void mt_trainer_destroy(mt_trainer *t)
{
    if (!t) return;
    for (int i = 0; i < t->n_sinks; i++) t->sinks[i]->close(t->sinks[i]);
    mt_optimizer_destroy(t->opt);
    if (t->gb) mt_grad_buckets_free(t->gb);
    free(t->gb);
    mt_model_destroy(t->model);
    mt_trainer_ep_free(t); /* the dispatcher after the model that uses it */
    if (t->pipe) mt_pipeline_free(t->pipe);
    free(t->pipe);
    free(t->mb_stats);
    if (t->emb) mt_comm_destroy(t->emb);
    mt_trainer_tp_free(t);
    if (t->valid) mt_samples_close(t->valid);
    if (t->train) mt_samples_close(t->train);
    if (t->data) mt_indexed_close(t->data);
    free(t->tokens);
    free(t->bias_host);
    free(t->load_sum);
    free(t->owner);
    free(t->keep);
    free(t->moe_layer);
    free(t->moe_load);
    free(t->moe_bias);
    mt_spike_free(&t->spike);
    free(t);
}

int mt_trainer_add_sink(mt_trainer *t, mt_metrics_sink *s)
{
    if (t->n_sinks == MT_TRAINER_MAX_SINKS)
        return MT_ERR(MT_EINVAL, "trainer: more than %d metric sinks", MT_TRAINER_MAX_SINKS);
    t->sinks[t->n_sinks++] = s;
    return MT_OK;
}

/* Reads micro-batch samples [first, first + micro_batch) of a split;
 * indices past the split's samples (after a rollback skipped data) wrap. */
static int load_batch_into(mt_trainer *t, mt_samples *s, int64_t first, int32_t *tokens)
{
    const int B = t->job.batch.micro_batch_size, T = t->job.batch.seq_len;
    const int64_t n = mt_samples_count(s);
    for (int b = 0; b < B; b++)
        MT_CHECK(mt_samples_get(s, (first + b) % n, tokens + (size_t)b * (T + 1)));
    return MT_OK;
}

static int load_batch(mt_trainer *t, mt_samples *s, int64_t first)
{
    return load_batch_into(t, s, first, t->tokens);
}

/* train.fault: does micro-batch [first, first + B) hold bad data here? The
 * bad data is that of steps [step, step + steps) of the uninterrupted run. */
static int faulty(const mt_trainer *t, int64_t first, int B)
{
    const mt_fault_cfg *f = &t->job.train.fault;
    if (f->kind == MT_FAULT_NONE || (f->rank >= 0 && f->rank != t->rank)) return 0;
    const int64_t gbs = t->job.batch.global_batch_size;
    const int64_t lo = (f->step - 1) * gbs, hi = (f->step - 1 + f->steps) * gbs;
    return first < hi && first + B > lo;
}

/* The executor's micro-batch mb of the step (train) and its loss weight:
 * the same data and weights as the one-rank loop below. */
static int pipe_batch(void *ctx, int mb, int32_t *tokens, double *weight)
{
    mt_trainer *t = ctx;
    const int B = t->job.batch.micro_batch_size, n_mb = t->accum * t->dp_size;
    const int64_t mb_first = t->batch_first + (int64_t)mb * B;
    MT_CHECK(load_batch_into(t, t->train, mb_first, tokens));
    double w = 1.0 / n_mb;
    if (faulty(t, mb_first, B)) { /* test-only fault injection */
        if (t->job.train.fault.kind == MT_FAULT_NAN_GRAD) w = NAN;
        else w *= t->job.train.fault.scale;
    }
    *weight = w;
    return MT_OK;
}

/* ... and of validation: batch mb of the valid split. */
static int pipe_valid_batch(void *ctx, int mb, int32_t *tokens, double *weight)
{
    mt_trainer *t = ctx;
    *weight = 1.0;
    return load_batch_into(t, t->valid, (int64_t)mb * t->job.batch.micro_batch_size, tokens);
}

void mt_trainer_rollback_done(mt_trainer *t)
{
    t->consumed_samples = t->rollback.samples;
    t->rollbacks++;
    t->bad_in_row = 0;
    t->rollback.pending = 0;
    mt_spike_clear_streak(&t->spike);
}

void mt_trainer_rollback_cancel(mt_trainer *t)
{
    t->skipped_total++;
    t->bad_in_row = 0;
    t->rollback.pending = 0;
    mt_spike_clear_streak(&t->spike);
}

int mt_trainer_validate(mt_trainer *t, double *loss)
{
    if (!t->valid) return MT_ERR(MT_ESTATE, "validation: the job has no valid split");
    const int B = t->job.batch.micro_batch_size;
    double sum = 0;
    if (t->pipe) { /* the loss comes from the last stage; every rank gets it */
        const int n = t->job.data.valid_batches;
        mt_mb_stats *st = calloc((size_t)n, sizeof *st);
        if (!st) return MT_ERR(MT_ENOMEM, "validation: out of memory");
        int rc = mt_pipeline_forward(t->pipe, t->model, n, pipe_valid_batch, t, st);
        for (int i = 0; i < n; i++) sum += st[i].loss;
        free(st);
        MT_CHECK(rc);
        MT_CHECK(mt_comm_all_reduce(mt_comm_host(t->pp), &sum, &sum, 1, MT_COMM_F64,
                                    MT_COMM_SUM));
        *loss = sum / n;
        return MT_OK;
    }
    for (int i = 0; i < t->job.data.valid_batches; i++) {
        mt_mb_stats st;
        MT_CHECK(load_batch(t, t->valid, (int64_t)i * B));
        MT_CHECK(mt_model_step(t->model, t->tokens, 0, 1.0, &st));
        sum += st.loss;
    }
    *loss = sum / t->job.data.valid_batches;
    return MT_OK;
}

/* Keeps layer l's global loads and its router bias (after the update:
 * `bias`, or NULL to read it) as MoE record i (t->moe_*). */
static int record_moe(mt_trainer *t, int i, int l, const int64_t *load, const float *bias)
{
    mt_model *m = t->model;
    const size_t E = (size_t)m->cfg.n_routed_experts, L = (size_t)(m->n_blocks + m->n_mtp);
    if (!t->moe_load) {
        t->moe_layer = calloc(L, sizeof *t->moe_layer);
        t->moe_load = calloc(L * E, sizeof *t->moe_load);
        t->moe_bias = calloc(L * E, sizeof *t->moe_bias);
        if (!t->moe_layer || !t->moe_load || !t->moe_bias)
            return MT_ERR(MT_ENOMEM, "trainer: out of memory for the expert loads");
    }
    t->moe_layer[i] = l;
    memcpy(t->moe_load + (size_t)i * E, load, E * sizeof *load);
    t->moe_have_bias = m->cfg.topk_method == MT_TOPK_NOAUX_TC;
    if (bias) memcpy(t->moe_bias + (size_t)i * E, bias, E * sizeof *bias);
    else if (t->moe_have_bias) MT_CHECK(mt_model_get_router_bias(m, l, t->moe_bias + (size_t)i * E));
    t->n_moe_rec = i + 1;
    t->moe_step = t->step + 1;
    return MT_OK;
}

/* Per-layer expert load statistics of the step into the metrics, and the
 * router bias update. */
static int balance_step(mt_trainer *t, mt_step_metrics *mt)
{
    mt_model *m = t->model;
    const int E = m->cfg.n_routed_experts;
    const double gamma = t->job.loss.bias_update_rate;
    mt->n_moe = 0;
    int rec = 0;
    for (int l = 0; l < m->n_blocks + m->n_mtp; l++) {
        const int64_t *load = mt_model_expert_load(m, l);
        if (!load) continue;
        /* every rank sees the loads of the whole global batch: the tp
         * ranks' shares of the rows, then the dp ranks' batches */
        if (t->tp_size > 1) {
            MT_CHECK(mt_comm_all_reduce(mt_comm_host(t->tpc), load, t->load_sum, (size_t)E,
                                        MT_COMM_I64, MT_COMM_SUM));
            load = t->load_sum;
        }
        if (t->dp) {
            MT_CHECK(mt_comm_all_reduce(mt_comm_host(t->dp), load, t->load_sum, (size_t)E,
                                        MT_COMM_I64, MT_COMM_SUM));
            load = t->load_sum;
        }
        if (mt->n_moe < MT_METRICS_MAX_MOE) {
            int i = mt->n_moe++;
            mt->moe_layer[i] = l;
            mt_metrics_load_stats(load, E, &mt->load_min[i], &mt->load_max[i], &mt->load_cv[i]);
        }
        const int update = gamma > 0 && m->cfg.topk_method == MT_TOPK_NOAUX_TC;
        if (update) {
            MT_CHECK(mt_model_get_router_bias(m, l, t->bias_host));
            mt_router_bias_update(t->bias_host, load, E, gamma);
            MT_CHECK(mt_model_set_router_bias(m, l, t->bias_host));
        }
        MT_CHECK(record_moe(t, rec++, l, load, update ? t->bias_host : NULL));
    }
    mt_model_reset_load(m);
    return MT_OK;
}

int mt_trainer_step(mt_trainer *t, mt_step_metrics *out)
{
    const mt_jobspec *j = &t->job;
    mt_model *m = t->model;
    const int B = j->batch.micro_batch_size;
    mt_step_metrics mt;
    memset(&mt, 0, sizeof mt);
    double t0 = mt_now_s();
    if (t->step >= j->train.steps)
        return MT_ERR(MT_ESTATE, "the job has completed its %lld steps", (long long)j->train.steps);
    if (t->rollback.pending)
        return MT_ERR(MT_ESTATE, "step %lld asked for a rollback that did not happen: %s",
                      (long long)t->rollback.step, t->rollback.why);

    /* MOETRAIN_PROFILE=1: synchronise after each phase and log its time. */
    const int profile = t->profile;
    double tp[4] = {0, 0, 0, 0};
    mt_op_profile_mark(t->be, "step");
    mt_op_profile_mark(t->be, "zero_grads");
    /* deferred where the model allows it (model.h) */
    MT_CHECK(mt_model_zero_grads_deferred(m));
    mt_model_reset_load(m);
    /* micro-batches of the whole global batch; this rank's are a contiguous
     * share of them */
    const int n_mb = t->accum * t->dp_size;
    const int64_t first = t->consumed_samples + (int64_t)t->dp_rank * t->accum * B;
    double ls[3] = {0, 0, 0}; /* LM, MTP and aux loss: means over the global batch */
    if (t->pipe) { /* the same micro-batches and weights through the executor */
        t->batch_first = first;
        MT_CHECK(mt_pipeline_step(t->pipe, m, pipe_batch, t, t->mb_stats));
        for (int i = 0; i < t->accum; i++) {
            const mt_mb_stats *st = &t->mb_stats[i];
            const int fault = faulty(t, first + (int64_t)i * B, B) &&
                              j->train.fault.kind != MT_FAULT_NAN_GRAD;
            ls[0] += (fault ? j->train.fault.scale : 1.0) * st->loss / n_mb;
            ls[1] += st->mtp_loss / n_mb;
            ls[2] += st->aux_loss / n_mb;
        }
    }
    for (int i = 0; !t->pipe && i < t->accum; i++) {
        mt_mb_stats st;
        const int64_t mb_first = first + (int64_t)i * B; /* global sample index */
        MT_CHECK(load_batch(t, t->train, mb_first));
        double weight = 1.0 / n_mb, lfactor = 1.0;
        if (faulty(t, mb_first, B)) { /* test-only fault injection */
            if (j->train.fault.kind == MT_FAULT_NAN_GRAD) weight = NAN;
            else lfactor = j->train.fault.scale;
            weight *= lfactor;
        }
        double ta = profile ? mt_now_s() : 0;
        if (t->tp_size > 1) mt_trainer_tp_arm(t, i == t->accum - 1); /* fixes before the buckets */
        if (t->gb && i == t->accum - 1) mt_grad_buckets_arm(t->gb); /* reduce during its backward */
        MT_CHECK(mt_model_step(m, t->tokens, 1, weight, &st));
        if (profile) {
            MT_CHECK(t->be->sync(t->be));
            tp[0] += mt_now_s() - ta;
        }
        ls[0] += lfactor * st.loss / n_mb;
        ls[1] += st.mtp_loss / n_mb;
        ls[2] += st.aux_loss / n_mb;
    }
    t->consumed_samples += (int64_t)n_mb * B;
    if (t->tp_size > 1) /* what the backward did not fix: before the norm and the reductions */
        MT_CHECK(mt_trainer_tp_grads(t));
    /* This rank's own work, before it waits for the others in the gradient
     * reduction: the one time that names a straggler (the step times of
     * all ranks end together; with ep > 1 the expert dispatch inside the
     * forward waits for the expert group too). A device backend has to
     * finish the work to be timed: this waits for the backend's stream
     * only (timing, not ordering: buckets started during the backward go
     * on running on the groups' streams, grad_buckets.h). */
    if (t->dp) MT_CHECK(t->be->sync(t->be));
    mt.compute_ms = (mt_now_s() - t0) * 1e3;
    if (t->gb) {
        double tr = profile ? mt_now_s() : 0;
        MT_CHECK(mt_grad_buckets_finish(t->gb)); /* what the backward did not start */
        if (t->dp) /* tp ranks have the same losses */
            MT_CHECK(mt_comm_all_reduce(mt_comm_host(t->dp), ls, ls, 3, MT_COMM_F64,
                                        MT_COMM_SUM));
        if (profile) {
            MT_CHECK(t->be->sync(t->be));
            tp[2] = mt_now_s() - tr;
        }
    }
    if (t->pipe) { /* trainer.h "Pipeline parallelism": reductions over the stages */
        const int e = mt_model_embed_index(m);
        if (t->emb && e >= 0)
            MT_CHECK(mt_comm_all_reduce(t->emb, m->params[e].grad, m->params[e].grad,
                                        (size_t)mt_param_numel(&m->params[e].d), MT_COMM_F32,
                                        MT_COMM_SUM));
        MT_CHECK(mt_comm_all_reduce(mt_comm_host(t->pp), ls, ls, 3, MT_COMM_F64, MT_COMM_SUM));
    }
    const double loss = ls[0], mtp = ls[1], aux = ls[2];
    mt_op_profile_mark(t->be, "optim");
    double sumsq;
    if (t->pipe) { /* trainer.h "Reductions": over dp, then tp, then the stages */
        const unsigned char *count = t->in_norm ? t->in_norm : t->gb ? t->keep : NULL;
        MT_CHECK(mt_pipeline_grad_sumsq(t->pipe, m, count, t->dp, t->tpc, t->opt->sumsq,
                                        &sumsq));
    } else if (t->gb) { /* each rank has the summed gradients of what it owns (trainer.h) */
        const unsigned char *count = t->in_norm ? t->in_norm : t->keep;
        MT_CHECK(mt_grad_owned_sumsq(t->be, m, count, t->opt->sumsq, &sumsq));
        if (t->dp)
            MT_CHECK(mt_comm_all_reduce(mt_comm_host(t->dp), &sumsq, &sumsq, 1, MT_COMM_F64,
                                        MT_COMM_SUM));
        if (t->tpc)
            MT_CHECK(mt_comm_all_reduce(mt_comm_host(t->tpc), &sumsq, &sumsq, 1, MT_COMM_F64,
                                        MT_COMM_SUM));
        /* an f32 like one rank's (be->sumsq): the partial sums' different
         * rounding stays below its resolution, so the clip scale is
         * usually the one rank's bit for bit (fp8: no flipped roundings) */
        sumsq = (double)(float)sumsq;
    } else {
        MT_CHECK(mt_optimizer_grad_sumsq(t->opt, m, &sumsq));
    }
    double norm = sqrt(sumsq);
    double lr = mt_lr_at(&j->lr_schedule, j->optimizer.lr, j->optimizer.min_lr, j->train.steps,
                         t->step);
    mt.skipped = !isfinite(loss) || !isfinite(mtp) || !isfinite(norm);
    char why[256] = "";
    mt.spike = (int)mt_spike_observe(&t->spike, t->step + 1, isfinite(mtp) ? loss : NAN, norm,
                                     why, sizeof why);
    int rollback = 0;
    if (mt.skipped) {
        t->skipped_total++;
        t->bad_in_row++;
        mt_model_reset_load(m);
        if (t->bad_in_row >= j->train.max_bad_steps) {
            if (j->train.max_rollbacks == 0)
                return MT_ERR(MT_ENUMERIC,
                              "step %lld: loss or gradients non-finite in %d steps in a row "
                              "(train.max_bad_steps); lower optimizer.lr or check the data",
                              (long long)t->step + 1, t->bad_in_row);
            rollback = 1;
        }
    } else if (mt.spike != MT_SPIKE_OK && t->spike.streak >= j->train.spike_persist) {
        if (j->train.max_rollbacks > 0) rollback = 1;
        else if (t->spike.streak == j->train.spike_persist)
            MT_LOGW("%s: %d abnormal steps since step %lld (train.max_rollbacks 0: no rollback)",
                    why, t->spike.streak, (long long)t->spike.onset);
    }
    if (rollback) {
        /* The step is not applied; the caller restores a checkpoint from
         * before the onset (trainer.h "Rollback"). */
        if (t->rollbacks >= j->train.max_rollbacks)
            return MT_ERR(MT_ENUMERIC,
                          "%s: %d abnormal steps since step %lld, and the job rolled back %lld "
                          "time(s) already (train.max_rollbacks); lower optimizer.lr or check "
                          "the data", why, t->spike.streak, (long long)t->spike.onset,
                          (long long)t->rollbacks);
        if (mt.skipped) t->skipped_total--; /* counted as rolled back instead */
        mt_model_reset_load(m);
        t->rollback.pending = 1;
        t->rollback.nonfinite = mt.skipped;
        t->rollback.onset = t->spike.onset;
        t->rollback.step = t->step + 1;
        t->rollback.samples = t->consumed_samples;
        snprintf(t->rollback.why, sizeof t->rollback.why, "%s; %d abnormal steps since step %lld",
                 why, t->spike.streak, (long long)t->spike.onset);
        MT_LOGW("%s: rolling back", t->rollback.why);
        if (out) memset(out, 0, sizeof *out);
        return MT_OK;
    }
    if (mt.skipped) {
        /* counted above */
    } else {
        t->bad_in_row = 0;
        double clip = j->optimizer.clip_grad;
        double scale = clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
        double tu = profile ? mt_now_s() : 0;
        MT_CHECK(mt_optimizer_update(t->opt, m, lr, scale));
        if (t->gb) MT_CHECK(mt_grad_buckets_share(t->gb)); /* owners' new compute copies */
        if (profile) {
            MT_CHECK(t->be->sync(t->be));
            tp[1] = mt_now_s() - tu;
        }
        MT_CHECK(balance_step(t, &mt));
    }
    t->step++;
    MT_CHECK(t->be->sync(t->be));
    mt_op_profile_mark(t->be, "end");
    double dt = mt_now_s() - t0;
    if (profile)
        MT_LOGI("profile step %lld: forward+backward %.1f ms (%d micro-batches), gradient "
                "reduction after the backward %.1f ms (%d of %d buckets started during it), "
                "optimizer and weight gather %.1f ms, rest %.1f ms", (long long)t->step,
                1e3 * tp[0], t->accum, 1e3 * tp[2], t->gb ? t->gb->started_early : 0,
                t->gb ? t->gb->n : 0, 1e3 * tp[1], 1e3 * (dt - tp[0] - tp[1] - tp[2]));

    mt.step = t->step;
    mt.total_steps = j->train.steps;
    mt.loss = loss;
    mt.mtp_loss = mtp;
    mt.aux_loss = aux;
    mt.lr = lr;
    mt.grad_norm = norm;
    mt.valid_loss = NAN;
    mt.step_ms = dt * 1e3;
    if (!t->dp) mt.compute_ms = mt.step_ms; /* nothing to wait for: the whole step is its own */
    mt.pp_size = t->pipe ? t->pipe->layout.pp : 0;
    mt.pp_stage = t->pipe ? t->pipe->stage : 0;
    mt.pp_idle = t->pipe ? t->pipe->last_idle : NAN;
    mt.pp_bubble = t->pipe ? t->pipe->predicted_idle[t->pipe->stage] : NAN;
    mt.pp_bubble_measured = t->pipe ? t->pipe->measured_idle[t->pipe->stage] : NAN;
    const double tokens = (double)n_mb * B * j->batch.seq_len; /* all ranks */
    mt.tokens_per_s = tokens / dt;
    mt.tflops = t->flops_per_token * tokens / dt / 1e12 / t->dp_size /
                (t->pipe ? t->pipe->layout.pp : 1) /
                (t->tp_size > 1 ? t->tp_size : 1); /* per rank */
    mt.mfu = t->peak_tflops > 0 ? mt.tflops / t->peak_tflops : NAN;
    mt.samples = t->consumed_samples;
    mt.tokens = t->consumed_samples * j->batch.seq_len;
    mt.skipped_total = t->skipped_total;
    mt.rollbacks_total = t->rollbacks;
    t->be->mem_stats(t->be, &mt.mem_in_use, &mt.mem_peak);
    if (t->valid && j->data.valid_interval > 0 &&
        (t->step % j->data.valid_interval == 0 || t->step == j->train.steps))
        MT_CHECK(mt_trainer_validate(t, &mt.valid_loss));
    for (int i = 0; i < t->n_sinks; i++) MT_CHECK(t->sinks[i]->emit(t->sinks[i], &mt));
    t->last = mt;
    if (out) *out = mt;
    return MT_OK;
}

int mt_trainer_run(mt_trainer *t, volatile sig_atomic_t *stop)
{
    while (t->step < t->job.train.steps) {
        if (stop && *stop) {
            MT_LOGI("stop requested: stopping at step %lld of %lld", (long long)t->step,
                    (long long)t->job.train.steps);
            return MT_EINTR;
        }
        MT_CHECK(mt_trainer_step(t, NULL));
        if (t->rollback.pending) /* only a caller with checkpoints can roll back */
            return MT_ERR(MT_ENUMERIC, "%s; no checkpoints here to roll back to", t->rollback.why);
    }
    return MT_OK;
}
