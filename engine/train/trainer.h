/* trainer.h - the training loop of one job on one rank.
 *
 * Data parallelism: with a dp communicator (mt_trainer_create_in) each of the
 * DP ranks reads its contiguous share of the step's global batch (rank d:
 * samples [consumed + d * A * B, consumed + (d + 1) * A * B), A = global /
 * (B * DP) micro-batches of B sequences) and scales its gradients by 1 / (A *
 * DP). ZeRO-1: each parameter's optimizer state lives on one rank of its
 * group (mt_zero_owners: dense parameters over dp, routed experts over
 * edp). The gradients are reduced INTO THE OWNERS only (a reduce-scatter
 * whose blocks are whole parameters), in buckets started from inside the
 * last micro-batch's backward as each layer's gradients become final
 * (grad_buckets.h; parallel.bucket_mb, wire type parallel.grad_reduce fp32
 * or bf16), and waited for before the optimizer: afterwards each rank holds
 * the summed gradient of what it owns, the owner updates it and the new
 * compute copies are all-gathered bucket by bucket from the owners, so
 * every rank computes with the same weights.
 *
 * Expert parallelism (parallel.ep = EP > 1): the model holds only this
 * rank's n_routed_experts / EP experts and its MoE layers send tokens to
 * the experts' owners over the ep group (engine/parallel/moe_a2a.h).
 * Gradients: dense parameters are reduced over the dp group as above;
 * expert parameters over the edp group (the ranks holding the same
 * experts; each owner already summed the contributions of every ep rank's
 * tokens), in buckets of their own.
 *
 * Tensor parallelism (parallel.tp = TP > 1): the model holds this rank's
 * part of every split parameter (heads, FFN columns, vocabulary;
 * engine/model/tp.h) and the replicated ones whole; the TP ranks of a dp
 * group read the same data. The replicated parameters' gradients are the
 * same on every tp rank by construction (each region's entry gradient is
 * summed over tp, bit-identically everywhere), so dense (split and
 * replicated) parameters are reduced over the dp group of their tp rank
 * only, each tp rank's ZeRO-1 owners within it. The exception is the
 * router: each tp rank routes and dispatches only its 1/TP share of the
 * token rows (the model's layers.h, mt_tp_share; under sequence
 * parallelism its own rows), the MoE output being summed over tp with the
 * shared experts' parts, so the router's gradient is summed over tp.
 * Routed experts are replicated over tp too (etp = 1): their owner is an
 * edp rank (the sharding map's folding: with ep = 1, edp = tp + TP * dp),
 * their buckets reduce over edp and gather the owner's compute copies over
 * edp. With ep > 1 (etp = 1) the ep group folds over the tp x dp ranks and
 * every tp rank dispatches its share of the tokens. Either way each token
 * reaches an expert's gradient once in the edp sum, which spans the tp
 * ranks, so the experts' gradients need no fix. With
 * parallel.sequence_parallel the norms outside the regions (and MTP's
 * eh_proj) see only this rank's rows: their gradients are summed over tp.
 * These fixes happen in the last
 * micro-batch's backward as each layer's gradients become final, before
 * the layer's buckets start (the model's on_layer_grads hook runs
 * trainer_tp.c's fixes, then the buckets'); what is left, after it.
 * With pipeline parallelism (below) the buckets are not started inside
 * the backward, so all of these fixes run after the step's last backward,
 * before the buckets.
 *
 * Expert tensor parallelism (parallel.etp = ETP > 1, with dp, ep, tp and
 * pp, also ep and pp both; CPU and CUDA backends): the ep group handed in is the
 * exchange group of the EP x ETP ranks with the same edp (groups.h: exp);
 * the model holds slice etp_rank of each of its experts
 * (mt_params_etp_local) and the dispatcher sends each routed row to every
 * slice and sums the slices' outputs (moe_a2a.h). The slices' gradients
 * are whole parameters of their own: reduced over edp, owned within edp,
 * each counted once in the norm (the etp ranks hold different slices).
 * With tp > 1 the folding puts the etp ranks on the tp ranks first (etp
 * fastest: with etp = tp the etp rank is the tp rank); each tp rank
 * dispatches its share of the tokens to every slice, so each token reaches
 * a slice's gradient once, as above.
 *
 * Reductions (which one each global quantity uses):
 *  - gradients: F32 sums at the owner in rank order x_0 + x_1 + ... on
 *    every backend (comm.h reduce_owned), each contribution rounded to
 *    BF16 first under grad_reduce bf16; with fp32 the owner's sum is the
 *    one an all-reduce would give, bit for bit; under sequence parallelism
 *    the sequence-split norms are first summed over tp (F32 all-reduce);
 *  - gradient norm (clipping, NaN/Inf skip): each rank's sum of squares of
 *    the gradients it owns and counts (f32 per run of adjacent parameters,
 * *    added in f64), one F64 scalar summed over dp in rank order, then over
 *    tp, then over pp (stage order), rounded to f32 as one rank's norm is.
 *    Every parameter of the global model is counted exactly once: a dense
 *    parameter by one dp rank of its tp rank's group, of which a split
 *    one's parts by every tp rank (the parts differ) and a replicated one
 *    by tp rank 0's group only (the tp ranks hold the same); each routed
 *    expert by one rank of its edp group, the ep ranks holding different
 *    experts (edp x ep is the world of a stage); each stage its own
 *    layers, the pipeline's embedding replica on the last stage left out
 *    (the first stage counts the embedding). The same value on every rank,
 *    so the clip and the skip agree everywhere;
 *  - losses (LM, MTP, aux): F64 sums over dp of the ranks' shares (the tp
 *    ranks compute the same, so they are not summed over tp), then over pp
 *    (the LM and MTP losses come from the last stage, the aux loss from
 *    each stage's MoE layers), so every rank logs the global loss;
 *  - expert loads: I64 sums over tp (each tp rank counts the rows of its
 *    share) then dp (each token is routed once, on its own rank), hence
 *    the router bias update; the sequence-wise balance loss is per
 *    sequence, so local (under tp every rank computes it on all rows).
 *
 * Pipeline parallelism (parallel.pp > 1, engine/train/pipeline.h): the
 * model holds this stage's chunks only and the executor runs the step's
 * schedule table; every stage reads the micro-batches (the first embeds
 * them, the last takes the targets). The loss and norm reductions over the
 * pp group come after the dp (and tp) ones, as above. With MTP or tied
 * embeddings the embedding's gradient is summed (F32) between the first
 * stage and the replica on the last one (same dp rank, after the dp
 * reduction), so both owners apply the same update. Expert loads and the
 * router bias update stay with the stage owning the layer. With tensor
 * parallelism each stage's tp ranks hold parts of its chunks (the first
 * stage's embedding and the last stage's head and replica split by
 * vocabulary rows alike); activations and their gradients go between the
 * same tp rank of neighbouring stages (under sequence parallelism, its
 * rows). With expert parallelism each stage's TP x DP ranks refold as
 * ETP x EP x EDP (layout.h; etp 1 under pp): the stage's MoE layers (its
 * chunks' decoder layers, and MTP's on the last stage) dispatch over the
 * stage's ep group from inside the executor's FWD and BWD / BWD_IN
 * actions (per-slot plans: several micro-batches in flight per chunk).
 * Every ep rank of a stage runs the same action list, so their exchanges
 * pair up in the same order; BWD_W only replays local GEMMs. The rules
 * above hold per stage: expert gradients over edp, dense over dp, loads
 * over dp (each stage its own layers), norm over dp, tp, then pp.
 *
 * A step: gradient accumulation over micro-batches to the global batch,
 * loss = LM + lambda * MTP + alpha * sequence-aux; a non-finite loss or
 * gradient skips the step (max_bad_steps in a row fail the job); global-norm
 * clipping; AdamW on this rank's shard; the router's aux-loss-free bias
 * update from the step's expert loads; validation every valid_interval
 * steps; metrics to every registered sink. The loop stops at train.steps or
 * at a step boundary once *stop becomes non-zero.
 *
 * Rollback (issue 20): the spike detector (spike.h) judges each step. When
 * train.spike_persist abnormal steps follow each other (or
 * train.max_bad_steps non-finite ones) and train.max_rollbacks allows, the
 * step is not applied and not counted: rollback.pending is set and the
 * caller, who owns the checkpoints (service/job_rollback.h), restores the
 * last good state and calls mt_trainer_rollback_done, which skips the data
 * read since (the data window before the spike). Skipping reads past
 * train.steps x global batch samples in the end: those wrap around to the
 * start of the sample order.
 *
 * Fault injection (train.fault, tests only): the data of the configured
 * steps of the uninterrupted run gives NaN gradients (its loss weight is
 * NaN) or a loss and gradients scaled by train.fault.scale.
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
#include "engine/train/spike.h"
#include "engine/train/pipeline.h"

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
    /* The last balanced step's routed-expert loads (global: summed over the
     * dp group, as the bias update uses them) and router biases after its
     * update, per MoE layer, for the service's heat map. Host memory. */
    int64_t moe_step;             /* the step they are of; 0: none yet */
    int n_moe_rec;                /* MoE layers recorded */
    int moe_have_bias;            /* the router has a bias (noaux_tc) */
    int *moe_layer;               /* [n_blocks + n_mtp] model layer of record i */
    int64_t *moe_load;            /* [n_blocks + n_mtp, E] */
    float *moe_bias;              /* [n_blocks + n_mtp, E] */
    int64_t *load_sum;            /* [E] expert loads summed over the dp group */
    mt_comm *dp;                  /* data-parallel group, not owned; NULL: one rank */
    int dp_rank, dp_size;
    int *owner;                   /* [params]: ZeRO-1 owner's dp (experts: edp) rank, -1 none */
    struct mt_grad_buckets *gb;   /* gradient buckets (grad_buckets.h); NULL on one rank (no
                                     dp group, nor under ep or tp an edp group) */
    unsigned char *keep;          /* [params]: this rank keeps the optimizer state */
    /* expert parallelism (ep_size > 1) */
    int ep_size;
    mt_comm *ep, *edp;            /* expert-parallel and expert-data-parallel groups, not owned */
    mt_moe_dispatcher *disp;      /* the model's dispatcher (owned) */
    /* pipeline parallelism (pp > 1) */
    mt_comm *pp;                  /* pipeline group, not owned */
    mt_comm *emb;                 /* first + last stage, for the embedding replica; owned */
    mt_pipeline *pipe;            /* the executor's plan of this stage */
    mt_mb_stats *mb_stats;        /* [accum] */
    int64_t batch_first;          /* sample index of the step's first micro-batch here */
    /* tensor parallelism (tp_size > 1; trainer_tp.h) */
    int tp_size;
    mt_comm *tpc;                 /* tensor-parallel group, not owned */
    struct mt_tp *tp;             /* the model's tp table over it (owned) */
    int *tp_fix, n_tp_fix;        /* params whose gradients tp fixes, in backward order */
    int tp_fix_next, tp_armed;    /* first not fixed this step; the backward fixes them */
    unsigned char *in_norm;       /* [params]: this rank adds it to the norm (NULL: keep) */
    /* operations (issue 20) */
    int rank;                     /* world rank, for train.fault.rank (set by the runtime) */
    mt_spike_detector spike;
    int64_t rollbacks;            /* rollbacks done by this process */
    struct {
        int pending;              /* the last step asked for a rollback */
        int nonfinite;            /* ... for a NaN / Inf streak (else a spike) */
        int64_t onset;            /* first abnormal step: roll back to a checkpoint before it */
        int64_t step;             /* the step that asked */
        int64_t samples;          /* consumed_samples then: training continues from here */
        char why[320];
    } rollback;
} mt_trainer;


/* Builds model, optimizer and data readers for an admitted job on a backend,
 * as one rank (dp 1).
 * With init.kind random the weights are initialised here; otherwise they are
 * zero until the caller restores a checkpoint into the trainer. */
int mt_trainer_create(mt_trainer **out, const mt_jobspec *job, mt_backend *be);
void mt_trainer_destroy(mt_trainer *t);

/* The groups a trainer joins (not owned; they must outlive it; NULL where
 * the group has one rank): dp, the data-parallel group (size parallel.dp);
 * ep, the expert-parallel group (size parallel.ep); edp, the ranks holding
 * the same experts. Host memory for the CPU backend, device memory for
 * CUDA (expert parallelism: CPU backend with host groups for now). */
typedef struct mt_trainer_groups {
    mt_comm *dp, *edp;
    mt_comm *ep;                  /* the token exchange: ep, or ep x etp (groups.h: exp) */
    mt_comm *pp;                  /* pipeline group (size parallel.pp), ordered by stage */
    mt_comm *tp;                  /* tensor-parallel group (size parallel.tp) */
} mt_trainer_groups;

/* The same as a member of its groups (g NULL: one rank). The model is built
 * with only this rank's experts; the optimizer keeps the state of the
 * parameters this rank owns (ZeRO-1). */
int mt_trainer_create_in(mt_trainer **out, const mt_jobspec *job, mt_backend *be,
                         const mt_trainer_groups *g);

/* The model's options for a job: precision, batch shape, recompute and
 * loss weights (the trainer's and evaluation's model). */
void mt_trainer_model_opts(mt_model_opts *o, const mt_jobspec *j);

/* Registers a sink; the trainer closes it on destroy. */
int mt_trainer_add_sink(mt_trainer *t, mt_metrics_sink *s);

/* One optimizer step; metrics of the step in *out (may be NULL). */
int mt_trainer_step(mt_trainer *t, mt_step_metrics *out);

/* After the caller restored the state of a checkpoint before
 * rollback.onset: continue with the data after the abnormal steps, count
 * the rollback, clear the request. */
void mt_trainer_rollback_done(mt_trainer *t);

/* No checkpoint to go back to: the abnormal step stays unapplied (counted
 * as skipped) and training goes on from the current state. */
void mt_trainer_rollback_cancel(mt_trainer *t);

/* Mean LM loss over the valid samples (no gradients). */
int mt_trainer_validate(mt_trainer *t, double *loss);

/* Steps until train.steps or until *stop is set (checked between steps). */
int mt_trainer_run(mt_trainer *t, volatile sig_atomic_t *stop);

/* The aux-loss-free balancing rule: bias[e] += gamma * sign(mean - load[e]). */
void mt_router_bias_update(float *bias, const int64_t *load, int E, double gamma);

#endif
