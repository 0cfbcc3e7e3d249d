/* jobspec.h - a training job: model, layout, precision, optimizer, schedule,
 * batch, data, checkpoint policy, initialisation.
 *
 * The job spec is a JSON document (deploy/examples/); the protobuf
 * JobSpec of the service carries the same fields. Every field is listed once,
 * with its default and range, in the table in jobspec.c; `moetraind
 * --help-job` prints it. --set overrides use the same dotted paths
 * ("train.steps=50", "model.num_hidden_layers=2").
 */
#ifndef MT_JOBSPEC_H
#define MT_JOBSPEC_H

#include <jansson.h>
#include <stdint.h>

#include "engine/model/config.h"
#include "engine/parallel/comm.h"
#include "engine/parallel/layout.h"

#define MT_PATH_CAP 1024

typedef enum { MT_BACKEND_CPU = 0, MT_BACKEND_CUDA } mt_backend_kind;
/* High-precision main copy of the weights held by the optimizer. */
typedef enum { MT_MAIN_FP32 = 0, MT_MAIN_BF16, MT_MAIN_NONE } mt_main_params;
typedef enum { MT_LR_COSINE = 0, MT_LR_LINEAR, MT_LR_WSD, MT_LR_CONSTANT } mt_lr_decay;
typedef enum { MT_INIT_RANDOM = 0, MT_INIT_CHECKPOINT, MT_INIT_HF } mt_init_kind;
/* checkpoint.resume: auto starts from the newest checkpoint of
 * checkpoint.dir that verifies (runtime/job_resume.h), whatever init says. */
typedef enum { MT_RESUME_NEVER = 0, MT_RESUME_AUTO } mt_resume_mode;
/* train.fault.kind: test-only fault injection (engine/train/spike.h). */
typedef enum { MT_FAULT_NONE = 0, MT_FAULT_NAN_GRAD, MT_FAULT_LOSS_SCALE } mt_fault_kind;

typedef struct mt_precision {
    mt_recipe recipe;
    mt_main_params main_params;
    int recompute_mla_up;   /* recompute q_b / kv_b outputs in backward */
    int recompute_moe_act;  /* recompute expert SwiGLU outputs in backward */
    int grads;              /* gradient accumulators: 0 fp32, 1 bf16 (rounded after each add) */
} mt_precision;

typedef struct mt_optimizer_cfg {
    double lr, min_lr;
    double beta1, beta2, eps;
    double weight_decay;    /* not applied to norms and biases */
    double clip_grad;       /* global-norm clip; 0: off */
} mt_optimizer_cfg;

typedef struct mt_lr_schedule {
    mt_lr_decay decay;
    int64_t warmup_steps;
    int64_t decay_steps;     /* 0: until train.steps */
    double wsd_decay_fraction; /* WSD: final fraction of decay_steps spent decaying */
} mt_lr_schedule;

typedef struct mt_batch {
    int micro_batch_size;    /* sequences per micro-batch per data-parallel rank */
    int global_batch_size;   /* sequences per optimizer step, all ranks */
    int seq_len;             /* tokens per sequence */
} mt_batch;

typedef struct mt_data_cfg {
    char path[MT_PATH_CAP];  /* Megatron dataset prefix (PREFIX.bin / PREFIX.idx) */
    char split[64];          /* train,valid,test weights, "98,1,1" */
    int eod_token;           /* -1: vocab_size - 1 */
    int valid_interval;      /* steps between validation passes; 0: never */
    int valid_batches;       /* micro-batches per validation pass */
} mt_data_cfg;

typedef struct mt_loss_cfg {
    double mtp_weight;       /* lambda: weight of the mean MTP loss */
    double aux_alpha;        /* alpha: sequence-wise balance loss */
    double bias_update_rate; /* gamma: aux-loss-free router bias step */
} mt_loss_cfg;

typedef struct mt_ckpt_cfg {
    char dir[MT_PATH_CAP];   /* "" : no checkpoints */
    int64_t interval;        /* steps between saves; 0: none */
    int keep_last;           /* retention; 0: keep all */
    int async;               /* save from a host snapshot in the background */
    int save_on_stop;        /* save when the job is stopped */
    mt_resume_mode resume;   /* auto: continue from the newest verified checkpoint */
} mt_ckpt_cfg;

typedef struct mt_init_cfg {
    mt_init_kind kind;
    char path[MT_PATH_CAP];  /* checkpoint or HF directory */
    int fallback;            /* a damaged checkpoint: start from the newest older one that loads */
} mt_init_cfg;

/* Test-only: the data of steps [step, step + steps) of the uninterrupted
 * run is "bad" (tied to the samples, so skipping them after a rollback
 * removes the fault). Refused unless MOETRAIN_ALLOW_FAULTS=1. */
typedef struct mt_fault_cfg {
    mt_fault_kind kind;      /* nan_grad: NaN gradients; loss_scale: loss and gradients x scale */
    int64_t step;            /* 1-based step whose data is bad; 0: none */
    int steps;               /* consecutive steps of bad data */
    double scale;            /* loss_scale factor */
    int rank;                /* rank that sees the fault; -1: every rank */
} mt_fault_cfg;

typedef struct mt_train_cfg {
    int64_t steps;
    int64_t seed;
    int log_interval;
    int max_bad_steps;       /* consecutive NaN/Inf steps before the job fails (or rolls back) */
    /* operations (README "Operations") */
    double term_grace_s;     /* SIGTERM: save and exit within this; 0: exit without saving */
    double step_timeout_s;   /* a step (or save) longer than this ends every rank; 0: off */
    int max_rollbacks;       /* rollbacks before a spike fails the job; 0: no rollback */
    int spike_window;        /* steps of loss / grad-norm history the detector keeps */
    double spike_sigma;      /* loss above mean + sigma * std is a spike; 0: off */
    double spike_grad_sigma; /* the same for the gradient norm; 0: off */
    int spike_persist;       /* consecutive spiky steps that trigger a rollback */
    mt_fault_cfg fault;
} mt_train_cfg;

/* parallel.grad_reduce: the type data-parallel gradients travel in
 * (summed in f32 at their owner either way). */
typedef enum { MT_GRAD_FP32 = 0, MT_GRAD_BF16 } mt_grad_reduce;

/* parallel.ep_overlap: how a MoE layer's expert exchanges meet its compute
 * (engine/model/layer_moe.c): none, one exchange after another; halves,
 * two parts of each rank's experts pipelined (mt_model_opts.ep_overlap). */
typedef enum { MT_EP_OVERLAP_NONE = 0, MT_EP_OVERLAP_HALVES } mt_ep_overlap;

typedef struct mt_jobspec {
    char name[128];
    mt_backend_kind backend;
    char model_path[MT_PATH_CAP]; /* config.json the model came from, or "" (inline) */
    mt_model_config model;
    mt_layout parallel;         /* dp 0 until mt_jobspec_admit resolves it */
    char pp_layers[1024];       /* parallel.pp_layers as written ("1,2,1"; "": balanced),
                                   parsed into parallel.pp_layers */
    mt_comm_backend comm;       /* parallel.comm: the backend of the job's collectives */
    double bucket_mb;           /* parallel.bucket_mb: gradient bucket size, MB (1e6 bytes) */
    mt_grad_reduce grad_reduce; /* parallel.grad_reduce: the gradients' wire type */
    mt_ep_overlap ep_overlap;   /* parallel.ep_overlap: exchanges pipelined with the experts */
    mt_precision precision;
    mt_optimizer_cfg optimizer;
    mt_lr_schedule lr_schedule;
    mt_batch batch;
    mt_data_cfg data;
    mt_loss_cfg loss;
    mt_ckpt_cfg checkpoint;
    mt_init_cfg init;
    mt_train_cfg train;
} mt_jobspec;

/* Parses a job spec JSON document. `base_dir` resolves a relative model path
 * and relative data / checkpoint paths (NULL: the working directory).
 * `sets` are "dotted.path=value" overrides applied before validation. */
int mt_jobspec_from_json(mt_jobspec *j, json_t *root, const char *base_dir,
                         const char *const *sets, int n_sets);

/* Loads a job spec file; relative paths in it are relative to its folder. */
int mt_jobspec_load(mt_jobspec *j, const char *path, const char *const *sets, int n_sets);

/* Cross-field and environment checks (divisibility, sequence length, data
 * files present when `check_files`). Called by the parsers. The layout is
 * checked by admission, once the number of ranks is known. */
int mt_jobspec_validate(const mt_jobspec *j, int check_files);

/* The complete job spec with every default filled in, model inline. */
json_t *mt_jobspec_to_json(const mt_jobspec *j);

/* Prints every field with type, default and meaning. */
void mt_jobspec_print_fields(FILE *out);

/* Admission: the job as `world` ranks will run it. Resolves the layout
 * (derives dp, checks tp * pp * dp == world and the expert folding), checks
 * it against the model (FP8 block boundaries with the fp8 recipe) and the
 * batch against the resolved dp. Refused before anything runs; the message
 * names the layout, the numbers and the world size; a layout the trainer
 * does not run yet (mt_jobspec_check_runnable) is refused too. */
int mt_jobspec_admit(mt_jobspec *j, int world);

/* MT_OK when the trainer can run layout `l`: every combination of data,
 * tensor, pipeline, expert and expert tensor parallelism the layout admits
 * runs; what is left is sequence parallelism without tp (MT_EINVAL naming
 * the field). Admission refuses such a layout (EINVAL) before any rank
 * builds anything; the trainer checks it again. */
int mt_jobspec_check_runnable(const mt_layout *l);

/* Micro-batches per optimizer step on each data-parallel rank. Needs an
 * admitted job (dp resolved). */
static inline int mt_jobspec_grad_accum(const mt_jobspec *j)
{
    return j->batch.global_batch_size / (j->batch.micro_batch_size * j->parallel.dp);
}

static inline int mt_jobspec_eod(const mt_jobspec *j)
{
    return j->data.eod_token >= 0 ? j->data.eod_token : (int)(j->model.vocab_size - 1);
}

#endif
