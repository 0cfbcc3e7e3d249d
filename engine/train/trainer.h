/* trainer.h - the training loop of one job on one rank.
 *
 * Data parallelism: with a dp communicator (mt_trainer_create_dp) each of the
 * DP ranks reads its contiguous share of the step's global batch (rank d:
 * samples [consumed + d * A * B, consumed + (d + 1) * A * B), A = global /
 * (B * DP) micro-batches of B sequences), scales its gradients by 1 / (A *
 * DP) and the gradients are summed over the group, so every rank holds the
 * gradient of the whole global batch, as one rank would. Losses and expert
 * loads are summed likewise. ZeRO-1: each parameter's optimizer state lives
 * on one rank of the group (mt_zero_owners); the owner updates it and
 * broadcasts its new compute copies, so every rank computes with the same
 * weights. Reductions: gradients F32 sum in rank order (host backends);
 * losses F64 sum; expert loads I64 sum; the gradient norm is computed by
 * every rank from the summed gradients, so the clip and the NaN/Inf skip
 * agree everywhere. Tensor,
 * pipeline and expert parallelism are not in the trainer yet: a layout that
 * needs them is refused.
 *
 * A step: gradient accumulation over micro-batches to the global batch,
 * loss = LM + lambda * MTP + alpha * sequence-aux; a non-finite loss or
 * gradient skips the step (max_bad_steps in a row fail the job); global-norm
 * clipping; AdamW on this rank's shard; the router's aux-loss-free bias
 * update from the step's expert loads; validation every valid_interval
 * steps; metrics to every registered sink. The loop stops at train.steps or
 * at a step boundary once *stop becomes non-zero.
 */
#ifndef MT_TRAINER_H
#define MT_TRAINER_H

#include <signal.h>
#include <stdint.h>

#include "engine/data/data_indexed.h"
#include "engine/data/data_samples.h"
#include "engine/train/jobspec.h"
#include "engine/train/metrics.h"
#include "engine/model/model.h"
#include "engine/train/optimizer.h"
#include "engine/parallel/comm.h"

#define MT_TRAINER_MAX_SINKS 8

typedef struct mt_trainer {
    mt_jobspec job;
    mt_backend *be;
    mt_model *model;
    mt_optimizer *opt;
    mt_indexed *data;
    mt_samples *train;            /* train.steps x global batch samples */
    mt_samples *valid;            /* valid_batches x micro-batch samples, or NULL */
    int32_t *tokens;              /* host [micro_batch, seq_len + 1] */
    int accum;                    /* micro-batches per step on this rank */
    int64_t step;                 /* optimizer steps completed */
    int64_t consumed_samples;     /* train samples read so far */
    int64_t skipped_total;
    int bad_in_row;               /* consecutive skipped steps */
    double flops_per_token;
    double peak_tflops;           /* dense BF16 peak of one device; 0: unknown */
    int profile;                  /* MOETRAIN_PROFILE: time the phases of each step */
    int n_sinks;
    mt_metrics_sink *sinks[MT_TRAINER_MAX_SINKS];
    mt_step_metrics last;         /* metrics of the last step */
    float *bias_host;             /* [E] scratch for the router bias update */
    int64_t *load_sum;            /* [E] expert loads summed over the dp group */
    mt_comm *dp;                  /* data-parallel group, not owned; NULL: one rank */
    int dp_rank, dp_size;
    int *owner;                   /* [params]: ZeRO-1 owner's dp rank (mt_zero_owners), -1 none */
} mt_trainer;

/* Builds model, optimizer and data readers for an admitted job on a backend,
 * as one rank (dp 1).
 * With init.kind random the weights are initialised here; otherwise they are
 * zero until the caller restores a checkpoint into the trainer. */
int mt_trainer_create(mt_trainer **out, const mt_jobspec *job, mt_backend *be);
void mt_trainer_destroy(mt_trainer *t);

/* The model's options for a job: precision, batch shape, recompute and
 * loss weights (the trainer's and evaluation's model). */
void mt_trainer_model_opts(mt_model_opts *o, const mt_jobspec *j);

/* The same as a member of the data-parallel group `dp` (not owned; its size
 * must be the job's parallel.dp; host memory for the CPU backend, device
 * memory for CUDA; NULL: one rank). The optimizer keeps the state of the
 * parameters this rank owns (ZeRO-1). */
int mt_trainer_create_dp(mt_trainer **out, const mt_jobspec *job, mt_backend *be, mt_comm *dp);

/* Registers a sink; the trainer closes it on destroy. */
int mt_trainer_add_sink(mt_trainer *t, mt_metrics_sink *s);

/* One optimizer step; metrics of the step in *out (may be NULL). */
int mt_trainer_step(mt_trainer *t, mt_step_metrics *out);

/* Mean LM loss over the valid samples (no gradients). */
int mt_trainer_validate(mt_trainer *t, double *loss);

/* Steps until train.steps or until *stop is set (checked between steps). */
int mt_trainer_run(mt_trainer *t, volatile sig_atomic_t *stop);

/* The aux-loss-free balancing rule: bias[e] += gamma * sign(mean - load[e]). */
void mt_router_bias_update(float *bias, const int64_t *load, int E, double gamma);

#endif
