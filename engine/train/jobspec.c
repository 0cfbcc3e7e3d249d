/* jobspec.c - the job spec field table, parsing, overrides and validation. */
#define _POSIX_C_SOURCE 200809L
#include "engine/train/jobspec.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/mt_status.h"
#include "engine/parallel/sharding.h"

static const char *const backend_names[] = {"cpu", "cuda", NULL};
/* mt_comm_backend order (engine/parallel/comm.h) */
static const char *const comm_names[] = {"auto", "local", "mpi", "staged", "nccl", NULL};
_Static_assert(MT_COMM_BACKEND_COUNT == 5, "comm_names follows mt_comm_backend");
static const char *const recipe_names[] = {"fp8-blockwise", "bf16", "fp32", NULL};
static const char *const main_names[] = {"fp32", "bf16", "none", NULL};
static const char *const grads_names[] = {"fp32", "bf16", NULL};
static const char *const decay_names[] = {"cosine", "linear", "wsd", "constant", NULL};
static const char *const init_names[] = {"random", "checkpoint", "hf", NULL};
static const char *const resume_names[] = {"never", "auto", NULL};
static const char *const grad_reduce_names[] = {"fp32", "bf16", NULL};
static const char *const ep_overlap_names[] = {"none", "halves", NULL}; /* mt_ep_overlap */
static const char *const fault_names[] = {"none", "nan_grad", "loss_scale", NULL};

#define O(m) offsetof(mt_jobspec, m)
#define SZ(m) sizeof(((mt_jobspec *)0)->m)
#define I(path, m, dflt, lo, hi, doc) {path, MT_FT_INT, O(m), 0, dflt, lo, hi, NULL, 0, doc}
#define L(path, m, dflt, lo, hi, doc) {path, MT_FT_I64, O(m), 0, dflt, lo, hi, NULL, 0, doc}
#define D(path, m, dflt, lo, hi, doc) {path, MT_FT_F64, O(m), 0, dflt, lo, hi, NULL, 0, doc}
#define B(path, m, dflt, doc) {path, MT_FT_BOOL, O(m), 0, dflt, MT_NO_RANGE, NULL, 0, doc}
#define S(path, m, dflt, doc) {path, MT_FT_STR, O(m), SZ(m), dflt, MT_NO_RANGE, NULL, 0, doc}
#define E(path, m, dflt, names, doc) \
    {path, MT_FT_ENUM, O(m), 0, dflt, MT_NO_RANGE, names, 0, doc}

/* Every job spec field: the one place defaults and ranges are written. */
static const mt_field job_fields[] = {
    S("name", name, "job", "job name shown in logs and status"),
    E("backend", backend, "cpu", backend_names, "where the engine runs"),
    I("parallel.tp", parallel.tp, "1", 1, 1024, "tensor parallel size"),
    I("parallel.pp", parallel.pp, "1", 1, 1024, "pipeline parallel size"),
    I("parallel.vpp", parallel.vpp, "1", 1, 64, "virtual stages per pipeline rank"),
    I("parallel.ep", parallel.ep, "1", 1, 4096, "expert parallel size"),
    I("parallel.etp", parallel.etp, "1", 1, 1024, "expert tensor parallel size"),
    I("parallel.dp", parallel.dp, "0", 0, 1 << 20, "data parallel size; 0: world/(tp*pp)"),
    B("parallel.sequence_parallel", parallel.sequence_parallel, "false",
      "tensor parallelism: split activations along the sequence between tp regions"),
    E("parallel.schedule", parallel.schedule, "1f1b", mt_pp_schedule_names, "pipeline schedule"),
    S("parallel.pp_layers", pp_layers, "",
      "decoder layers of each pipeline chunk in chunk order, \"1,2,1\" (pp x vpp entries, "
      "0 allowed: the embedding or the head and MTP alone); empty: balanced"),
    E("parallel.comm", comm, "auto", comm_names,
      "collectives: auto (cpu: mpi; cuda: nccl, or staged when ranks share a GPU), mpi "
      "(cuda: staged through host memory), nccl, staged, local (one rank)"),
    D("parallel.bucket_mb", bucket_mb, "25", 0, 1e6,
      "data parallelism: gradients are reduced into their owners in buckets of about this many "
      "MB, each started as soon as the backward has finished its parameters; 0: one bucket "
      "per layer"),
    E("parallel.grad_reduce", grad_reduce, "fp32", grad_reduce_names,
      "wire type of the gradient reduction: fp32, or bf16 (rounded for the transfer, summed "
      "in fp32 by the owner)"),
    E("parallel.ep_overlap", ep_overlap, "none", ep_overlap_names,
      "expert parallelism: none, or halves (each MoE layer's exchanges in two parts, the "
      "first half of every rank's experts and the second, so that one part travels while "
      "the other's experts (or the shared expert) compute; bit-identical results)"),
    E("precision.recipe", precision.recipe, "fp8-blockwise", recipe_names,
      "linear-layer precision"),
    E("precision.main_params", precision.main_params, "fp32", main_names,
      "optimizer's high-precision weight copy"),
    E("precision.grads", precision.grads, "fp32", grads_names,
      "gradient accumulators: fp32, or bf16 (half the memory; each accumulation rounded to bf16)"),
    B("precision.recompute_mla_up", precision.recompute_mla_up, "false",
      "recompute MLA up-projections in backward"),
    B("precision.recompute_moe_act", precision.recompute_moe_act, "false",
      "recompute expert activations in backward"),
    D("optimizer.lr", optimizer.lr, "3e-4", 0, 10, "peak learning rate"),
    D("optimizer.min_lr", optimizer.min_lr, "3e-5", 0, 10, "learning rate at the end of decay"),
    D("optimizer.beta1", optimizer.beta1, "0.9", 0, 0.999999, "AdamW beta1"),
    D("optimizer.beta2", optimizer.beta2, "0.95", 0, 0.999999999, "AdamW beta2"),
    D("optimizer.eps", optimizer.eps, "1e-8", 1e-30, 1, "AdamW epsilon"),
    D("optimizer.weight_decay", optimizer.weight_decay, "0.1", 0, 10,
      "decoupled weight decay (not on norms and biases)"),
    D("optimizer.clip_grad", optimizer.clip_grad, "1.0", 0, 1e9, "global grad-norm clip; 0: off"),
    E("lr_schedule.decay", lr_schedule.decay, "cosine", decay_names, "shape after warmup"),
    L("lr_schedule.warmup_steps", lr_schedule.warmup_steps, "0", 0, 1LL << 40,
      "linear warmup steps"),
    L("lr_schedule.decay_steps", lr_schedule.decay_steps, "0", 0, 1LL << 40,
      "steps to min_lr after warmup; 0: until train.steps"),
    D("lr_schedule.wsd_decay_fraction", lr_schedule.wsd_decay_fraction, "0.2", 0, 1,
      "WSD: share of decay_steps spent decaying"),
    I("batch.micro_batch_size", batch.micro_batch_size, "1", 1, 1 << 20,
      "sequences per micro-batch"),
    I("batch.global_batch_size", batch.global_batch_size, "8", 1, 1 << 24,
      "sequences per optimizer step"),
    I("batch.seq_len", batch.seq_len, "4096", 2, 1 << 24, "tokens per sequence"),
    S("data.path", data.path, NULL, "Megatron dataset prefix (.bin/.idx)"),
    S("data.split", data.split, "98,1,1", "train,valid,test weights"),
    I("data.eod_token", data.eod_token, "-1", -1, 1 << 30, "end-of-document id; -1: vocab-1"),
    I("data.valid_interval", data.valid_interval, "0", 0, 1 << 30,
      "steps between validation passes; 0: never"),
    I("data.valid_batches", data.valid_batches, "4", 1, 1 << 20,
      "micro-batches per validation pass"),
    D("loss.mtp_weight", loss.mtp_weight, "0.3", 0, 100, "lambda, weight of the MTP loss"),
    D("loss.aux_alpha", loss.aux_alpha, "0.0001", 0, 100,
      "alpha, sequence-wise balance loss"),
    D("loss.bias_update_rate", loss.bias_update_rate, "0.001", 0, 10,
      "gamma, aux-loss-free router bias step"),
    S("checkpoint.dir", checkpoint.dir, "", "checkpoint directory; empty: none"),
    L("checkpoint.interval", checkpoint.interval, "0", 0, 1LL << 40,
      "steps between saves; 0: none"),
    I("checkpoint.keep_last", checkpoint.keep_last, "0", 0, 1 << 20,
      "checkpoints kept; 0: all"),
    B("checkpoint.async", checkpoint.async, "true", "write in the background"),
    B("checkpoint.save_on_stop", checkpoint.save_on_stop, "false", "save when stopped"),
    E("checkpoint.resume", checkpoint.resume, "never", resume_names,
      "auto: start from the newest checkpoint in checkpoint.dir that verifies"),
    E("init.kind", init.kind, "random", init_names, "initial weights"),
    S("init.path", init.path, "", "checkpoint or Hugging Face directory"),
    B("init.fallback", init.fallback, "false",
      "a damaged checkpoint: start from the newest older one that loads"),
    L("train.steps", train.steps, NULL, 1, 1LL << 40, "optimizer steps"),
    L("train.seed", train.seed, "1234", 0, 1LL << 62, "seed of initialisation and data order"),
    I("train.log_interval", train.log_interval, "1", 1, 1 << 30, "steps between log lines"),
    I("train.max_bad_steps", train.max_bad_steps, "5", 1, 1 << 20,
      "consecutive NaN/Inf steps that fail the job (or roll it back)"),
    D("train.term_grace_s", train.term_grace_s, "25", 0, 86400,
      "SIGTERM: save a checkpoint and exit within this many seconds; 0: exit without saving"),
    D("train.step_timeout_s", train.step_timeout_s, "600", 0, 1e7,
      "a step or save taking longer ends every rank (exit 75); 0: no watchdog"),
    I("train.max_rollbacks", train.max_rollbacks, "3", 0, 1 << 20,
      "rollbacks to the last good checkpoint before the job fails; 0: none"),
    I("train.spike_window", train.spike_window, "100", 4, 1 << 20,
      "steps of loss and grad-norm history the spike detector keeps"),
    D("train.spike_sigma", train.spike_sigma, "6", 0, 1e6,
      "a loss above mean + sigma * std of the history is a spike; 0: off"),
    D("train.spike_grad_sigma", train.spike_grad_sigma, "0", 0, 1e6,
      "the same for the gradient norm; 0: off"),
    I("train.spike_persist", train.spike_persist, "3", 1, 1 << 20,
      "consecutive spiky steps that trigger a rollback"),
    E("train.fault.kind", train.fault.kind, "none", fault_names,
      "test only (MOETRAIN_ALLOW_FAULTS=1): fault in the data of train.fault.step"),
    L("train.fault.step", train.fault.step, "0", 0, 1LL << 40,
      "1-based step of the uninterrupted run whose data is bad; 0: none"),
    I("train.fault.steps", train.fault.steps, "1", 1, 1 << 20, "consecutive steps of bad data"),
    D("train.fault.scale", train.fault.scale, "1000", 0, 1e30, "loss_scale: loss factor"),
    I("train.fault.rank", train.fault.rank, "-1", -1, 1 << 20, "rank with the fault; -1: all"),
};
#define N_JOB_FIELDS ((int)(sizeof job_fields / sizeof job_fields[0]))
_Static_assert(N_JOB_FIELDS == 67, "job spec field table changed: update docs and tests");

static int is_abs(const char *p) { return p[0] == '/'; }

/* Rewrites a relative path string at `path` in the tree against base_dir. */
static int resolve_path_field(json_t *root, const char *path, const char *base_dir)
{
    json_t *v = mt_json_get_path(root, path);
    if (!v || !json_is_string(v) || !base_dir) return MT_OK;
    const char *s = json_string_value(v);
    if (!*s || is_abs(s)) return MT_OK;
    char buf[MT_PATH_CAP];
    int n = snprintf(buf, sizeof buf, "%s/%s", base_dir, s);
    if (n < 0 || (size_t)n >= sizeof buf) return MT_ERR(MT_EINVAL, "%s: path too long", path);
    const mt_field *f = mt_fields_find(job_fields, N_JOB_FIELDS, path);
    return mt_json_set_text(root, path, f, buf, "");
}

/* Applies one "a.b.c=value" override to the job tree or the model tree. */
static int apply_set(json_t *job, json_t *model, const char *set)
{
    const char *eq = strchr(set, '=');
    if (!eq || eq == set)
        return MT_ERR(MT_EINVAL, "--set %s: expected key.path=value", set);
    char key[256];
    size_t klen = (size_t)(eq - set);
    if (klen >= sizeof key) return MT_ERR(MT_EINVAL, "--set %s: key too long", set);
    memcpy(key, set, klen);
    key[klen] = '\0';
    const char *val = eq + 1;
    if (strncmp(key, "model.", 6) == 0) {
        int n;
        const mt_field *t = mt_config_fields(&n);
        const char *sub = key + 6;
        const mt_field *f = mt_fields_find(t, n, sub);
        if (f) return mt_json_set_text(model, sub, f, val, "model");
        if (strncmp(sub, "rope_scaling.", 13) == 0) {
            /* Numbers only; the YaRN table validates them. */
            mt_field rf = {sub, MT_FT_F64, 0, 0, "0", MT_NO_RANGE, NULL, 0, NULL};
            if (strcmp(sub + 13, "type") == 0) rf.type = MT_FT_STR;
            return mt_json_set_text(model, sub, &rf, val, "model");
        }
        return MT_ERR(MT_EINVAL, "--set %s: unknown field", key);
    }
    const mt_field *f = mt_fields_find(job_fields, N_JOB_FIELDS, key);
    if (!f) return MT_ERR(MT_EINVAL, "--set %s: unknown field", key);
    return mt_json_set_text(job, key, f, val, "");
}

/* parallel.pp_layers "a,b,c" into the layout (checked against the model
 * with the layout: sharding.c, mt_layout_validate). */
static int parse_pp_layers(mt_jobspec *j)
{
    mt_layout *l = &j->parallel;
    l->n_pp_layers = 0;
    const char *s = j->pp_layers;
    while (*s == ' ') s++;
    if (!*s) return MT_OK;
    for (;;) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 0 || v > 1 << 20)
            return MT_ERR(MT_EINVAL, "parallel.pp_layers: \"%s\" must be a comma-separated "
                          "list of layer counts >= 0 (entry %d)", j->pp_layers, l->n_pp_layers);
        if (l->n_pp_layers == MT_LAYOUT_MAX_CHUNKS)
            return MT_ERR(MT_EINVAL, "parallel.pp_layers: more than %d entries",
                          MT_LAYOUT_MAX_CHUNKS);
        l->pp_layers[l->n_pp_layers++] = (int)v;
        while (*end == ' ') end++;
        if (!*end) return MT_OK;
        if (*end != ',')
            return MT_ERR(MT_EINVAL, "parallel.pp_layers: \"%s\" must be a comma-separated "
                          "list of layer counts >= 0 (entry %d)", j->pp_layers, l->n_pp_layers);
        s = end + 1;
    }
}

int mt_jobspec_from_json(mt_jobspec *j, json_t *root, const char *base_dir,
                         const char *const *sets, int n_sets)
{
    int rc = MT_OK;
    json_t *job = NULL, *model = NULL;
    memset(j, 0, sizeof *j);
    MT_CHECK(mt_fields_defaults(job_fields, N_JOB_FIELDS, j));
    if (!json_is_object(root)) return MT_ERR(MT_EINVAL, "job spec: must be a JSON object");

    job = json_deep_copy(root);
    json_t *m = json_object_get(job, "model");
    if (!m) {
        rc = MT_ERR(MT_EINVAL, "model: required field is missing");
        goto out;
    }
    int model_strict = 1;
    if (json_is_string(m)) {
        /* A config.json by path, as downloaded: unknown keys are tolerated. */
        const char *mp = json_string_value(m);
        if (base_dir && !is_abs(mp))
            snprintf(j->model_path, sizeof j->model_path, "%s/%s", base_dir, mp);
        else
            snprintf(j->model_path, sizeof j->model_path, "%s", mp);
        rc = mt_json_load_file(j->model_path, &model);
        if (rc < 0) {
            rc = mt_err_wrap(rc, "model");
            goto out;
        }
        model_strict = 0;
    } else if (json_is_object(m)) {
        model = json_deep_copy(m);
    } else {
        rc = MT_ERR(MT_EINVAL, "model: must be a config object or a path to config.json");
        goto out;
    }
    json_object_del(job, "model");

    MT_GOTO(resolve_path_field(job, "data.path", base_dir), out);
    MT_GOTO(resolve_path_field(job, "checkpoint.dir", base_dir), out);
    MT_GOTO(resolve_path_field(job, "init.path", base_dir), out);
    for (int i = 0; i < n_sets; i++) MT_GOTO(apply_set(job, model, sets[i]), out);

    MT_GOTO(mt_fields_parse(job_fields, N_JOB_FIELDS, j, job, "", 1, NULL), out);
    MT_GOTO(parse_pp_layers(j), out);
    MT_GOTO(mt_config_from_json(&j->model, model, "model", model_strict), out);
    MT_GOTO(mt_jobspec_validate(j, 1), out);
out:
    json_decref(job);
    json_decref(model);
    return rc;
}

int mt_jobspec_load(mt_jobspec *j, const char *path, const char *const *sets, int n_sets)
{
    json_t *root;
    MT_CHECK(mt_json_load_file(path, &root));
    char dir[MT_PATH_CAP];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    else
        snprintf(dir, sizeof dir, ".");
    int rc = mt_jobspec_from_json(j, root, dir, sets, n_sets);
    json_decref(root);
    if (rc < 0) return mt_err_wrap(rc, "job spec %s", path);
    return MT_OK;
}

static int file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

#define BAD(field, ...) mt_err_at(MT_EINVAL, __FILE__, __LINE__, field ": " __VA_ARGS__)

/* The batch against a data-parallel size (dp 0: not known yet; the batch
 * must at least hold whole micro-batches). */
static int check_batch(const mt_jobspec *j, int dp)
{
    if (dp < 1) dp = 1;
    if (j->batch.global_batch_size % (j->batch.micro_batch_size * dp))
        return BAD("batch.global_batch_size",
                   "%d is not divisible by batch.micro_batch_size %d x data-parallel size %d",
                   j->batch.global_batch_size, j->batch.micro_batch_size, dp);
    return MT_OK;
}

/* The layout against the model (sizes that divide, FP8 128x128 blocks). */
static int check_layout(const mt_jobspec *j)
{
    int rc = mt_layout_validate(&j->parallel, &j->model,
                                j->precision.recipe == MT_RECIPE_FP8_BLOCKWISE);
    return rc < 0 ? mt_err_wrap(rc, "parallel") : MT_OK;
}

int mt_jobspec_check_runnable(const mt_layout *l)
{
    if (l->sequence_parallel && l->tp < 2)
        return MT_ERR(MT_EINVAL, "parallel.sequence_parallel needs parallel.tp > 1 (it is %d)",
                      l->tp);
    return MT_OK;
}

int mt_jobspec_admit(mt_jobspec *j, int world)
{
    MT_CHECK(mt_layout_resolve(&j->parallel, world));
    MT_CHECK(check_layout(j));
    /* not runnable is invalid input here: refused before anything runs */
    if (mt_jobspec_check_runnable(&j->parallel) < 0) return MT_EINVAL;
    /* bf16 accumulators can be reduced across ranks once the owned
     * reduction (mt_comm_reduce_owned_start), the tp gradient sums and the
     * pipeline's embedding-replica sum take bf16 buffers; they sum f32
     * buffers so far */
    const mt_layout *l = &j->parallel;
    if (j->precision.grads == 1 && mt_layout_world(l) > 1)
        return BAD("precision.grads", "bf16 runs on one rank only so far (layout dp=%d tp=%d "
                   "pp=%d ep=%d: the gradient reductions take f32 buffers): use fp32",
                   l->dp, l->tp, l->pp, l->ep);
    return check_batch(j, j->parallel.dp);
}

int mt_jobspec_validate(const mt_jobspec *j, int check_files)
{
    const mt_model_config *c = &j->model;
    MT_CHECK(check_batch(j, j->parallel.dp));
    if (j->ep_overlap == MT_EP_OVERLAP_HALVES && j->parallel.ep > 1) {
        if (j->parallel.etp > 1)
            return BAD("parallel.ep_overlap", "halves with parallel.etp %d: expert tensor "
                       "parallelism exchanges whole layers only so far; use none",
                       j->parallel.etp);
        if (c->n_routed_experts / j->parallel.ep < 2)
            return BAD("parallel.ep_overlap", "halves needs at least 2 experts per rank "
                       "(model.n_routed_experts %d / parallel.ep %d); use none",
                       c->n_routed_experts, j->parallel.ep);
    }
    if (j->batch.seq_len > c->max_position_embeddings)
        return BAD("batch.seq_len", "%d exceeds model.max_position_embeddings %lld",
                   j->batch.seq_len, (long long)c->max_position_embeddings);
    if (j->optimizer.min_lr > j->optimizer.lr)
        return BAD("optimizer.min_lr", "%g exceeds optimizer.lr %g", j->optimizer.min_lr,
                   j->optimizer.lr);
    int eod = mt_jobspec_eod(j);
    if (eod < 0 || eod >= c->vocab_size)
        return BAD("data.eod_token", "%d is outside the vocabulary [0, %lld)", eod,
                   (long long)c->vocab_size);
    int w[3], nw = sscanf(j->data.split, "%d,%d,%d", &w[0], &w[1], &w[2]);
    if (nw < 1 || w[0] <= 0 || (nw > 1 && w[1] < 0) || (nw > 2 && w[2] < 0))
        return BAD("data.split", "\"%s\" must be train[,valid[,test]] weights, train > 0",
                   j->data.split);
    if (j->data.valid_interval > 0 && (nw < 2 || w[1] == 0))
        return BAD("data.valid_interval", "validation needs a non-empty valid split in data.split");
    if (j->lr_schedule.warmup_steps > j->train.steps)
        return BAD("lr_schedule.warmup_steps", "%lld exceeds train.steps %lld",
                   (long long)j->lr_schedule.warmup_steps, (long long)j->train.steps);
    if (j->checkpoint.interval > 0 && !j->checkpoint.dir[0])
        return BAD("checkpoint.interval", "set, but checkpoint.dir is empty");
    if (j->init.kind != MT_INIT_RANDOM && !j->init.path[0])
        return BAD("init.path", "required when init.kind is \"%s\"",
                   j->init.kind == MT_INIT_HF ? "hf" : "checkpoint");
    if (j->train.fault.kind != MT_FAULT_NONE) {
        if (j->train.fault.step == 0)
            return BAD("train.fault.step", "required (> 0) when train.fault.kind is set");
        /* A job spec can come over the network: faults only where the
         * operator allowed them for this process. */
        const char *allow = getenv("MOETRAIN_ALLOW_FAULTS");
        if (!allow || strcmp(allow, "1") != 0)
            return BAD("train.fault.kind", "fault injection is refused: it is for tests; set "
                                           "MOETRAIN_ALLOW_FAULTS=1 in moetraind's environment");
    }
    if (check_files) {
        char f[MT_PATH_CAP + 8];
        const char *ext[] = {".idx", ".bin"};
        for (int i = 0; i < 2; i++) {
            snprintf(f, sizeof f, "%s%s", j->data.path, ext[i]);
            if (!file_exists(f)) return BAD("data.path", "%s does not exist", f);
        }
    }
    return MT_OK;
}

json_t *mt_jobspec_to_json(const mt_jobspec *j)
{
    json_t *root = mt_fields_to_json(job_fields, N_JOB_FIELDS, j);
    json_object_set_new(root, "model", mt_config_to_json(&j->model));
    return root;
}

void mt_jobspec_print_fields(FILE *out)
{
    int n;
    const mt_field *t = mt_config_fields(&n);
    fprintf(out, "Job spec fields (JSON paths, also for --set key.path=value):\n");
    mt_fields_print_doc(job_fields, N_JOB_FIELDS, "", out);
    fprintf(out, "\nmodel: a config.json path or an inline object (Hugging Face DeepSeek-V3 "
                 "names):\n");
    mt_fields_print_doc(t, n, "model", out);
    fprintf(out, "  model.rope_scaling: null or {\"type\": \"yarn\", factor, beta_fast, "
                 "beta_slow, mscale, mscale_all_dim, original_max_position_embeddings}\n");
}
