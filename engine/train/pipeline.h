/* pipeline.h - the pipeline executor: runs this stage's action list of a
 * schedule table (engine/parallel/schedule.h) over the model's chunks
 * (mt_model_chunk_fwd / _bwd), moving activations and their gradients
 * between stages through the pp group (mt_comm_isend / mt_comm_recv_tag).
 *
 * Chunks: the layout's pp * vpp chunks; chunk c holds the decoder layers
 * mt_layout_chunk_layers gives, on stage mt_layout_stage_of_chunk. Chunk 0
 * also embeds, the last chunk runs the heads, loss and MTP.
 *
 * Messages: one activation or gradient is act [N, D] (N = micro_batch x
 * seq_len rows, the backend's activation type), the same size for every
 * (micro-batch, chunk) of the job, so nothing is negotiated while running;
 * the tag is the table's mt_sched_msg_tag.
 *
 * Slots: each (micro-batch, chunk) in flight holds a slot of the chunk (its
 * saved activations) from its input's arrival (RECV_ACT, the local hand-over
 * or FWD) until its input gradient has left (SEND_GRAD, the local hand-over,
 * or the end of its backward on chunk 0). The number of slots per chunk is
 * the most a walk of the table holds at once (mt_pipeline_create).
 *
 * Backward split: BWD_IN runs the input-gradient part of the chunk's
 * backward (mt_model_chunk_bwd_in: the weight-gradient GEMMs of its linear
 * layers recorded with copies of their dy and x) and frees the slot as a
 * whole backward would; BWD_W runs the recorded GEMMs of the same (mb,
 * chunk) (mt_model_chunk_bwd_w). The gradients are those of the whole
 * backward, bit for bit where the table keeps each chunk's weight parts in
 * the order of its input parts. bwd_whole (tests) runs BWD_IN as the whole
 * backward and BWD_W as nothing, for comparing.
 *
 * Idle time (issues 15, 17): the stage's compute actions (FWD, BWD, BWD_IN,
 * BWD_W) are timed on the device with the backend's marks (CUDA: events on
 * the compute stream, read once after the step's final sync; CPU: the host
 * clock), and idle = 1 - their time / the step's span on the same clock
 * (from the step's first mark to the one after the sends' wait). Each
 * chunk's mean time per action kind, summed over the pp group (4 doubles a
 * chunk, one host all-reduce per step), feeds the simulator
 * (mt_schedule_predict_chunks): each stage's idle predicted from the
 * measured costs, next to the table's prediction with equal costs.
 */
#ifndef MT_PIPELINE_H
#define MT_PIPELINE_H

#include "engine/model/model.h"
#include "engine/parallel/comm.h"
#include "engine/parallel/layout.h"
#include "engine/parallel/schedule.h"

/* The tokens of micro-batch mb of the step (host int32 [B, T + 1]) and its
 * loss weight (1 / micro-batches of the global batch, unless faults). */
typedef int (*mt_pipeline_batch_fn)(void *ctx, int mb, int32_t *tokens, double *weight);

typedef struct mt_pipeline {
    mt_layout layout;
    int stage;                /* this rank's pp rank */
    int n_mb;                 /* micro-batches per step on this rank */
    int C;                    /* chunks: pp * vpp */
    mt_comm *pp;              /* pipeline group, ranks ordered by stage; not owned */
    mt_schedule sched;
    mt_stage *chunk;          /* [C] layers of every chunk */
    int n_local;              /* this stage's chunks */
    int *local_ids;           /* [n_local] global ids, ascending */
    int *local_slots;         /* [n_local] slots per local chunk */
    mt_stage *local_chunks;   /* [n_local] */
    int *local_of;            /* [C] index into the model's chunks, -1 elsewhere */
    int *slot_of;             /* [n_mb * C] slot held by (mb, chunk), -1 none */
    int *defer_of;            /* [n_mb * C] the model's deferral handle between BWD_IN and
                                 BWD_W, -1 none */
    int bwd_whole;            /* BWD_IN runs the whole backward, BWD_W nothing (tests) */
    unsigned char *busy;      /* [n_local * max slots] */
    int max_slots;
    int32_t *tokens;          /* host [B, T + 1] */
    size_t msg_bytes;         /* one activation: N * D * act bytes */
    double predicted_bubble;  /* the table's bubble (simulator, default costs) */
    double *predicted_idle;   /* [pp] each stage's predicted idle fraction */
    double last_idle;         /* last training step: 1 - compute time / span on the device
                                 clock (see above); NaN: not measured */
    double last_busy_s;       /* last step: the executor's whole host time */
    mt_sched_costs *chunk_costs; /* [C] last training step's mean device seconds per action
                                 kind of each chunk (gathered over the pp group) */
    double *measured_idle;    /* [pp] each stage's idle predicted from chunk_costs; NaN:
                                 not measured */
    double measured_bubble;   /* the bubble predicted from chunk_costs; NaN: not measured */
    double *mark_t;           /* [2 + 2 x this stage's actions] the step's mark times */
    int n_marks;              /* marks recorded in the step; -1: not timing */
} mt_pipeline;

/* Plans stage `stage` of layout l (pp > 1, or any layout for a test) for
 * n_mb micro-batches per step: builds and checks the table, places the
 * chunks and counts the slots. Fill the model options with
 * mt_pipeline_model_opts before creating the model. */
int mt_pipeline_create(mt_pipeline *p, const mt_layout *l, const mt_model_config *c, int stage,
                       int n_mb, mt_comm *pp);
void mt_pipeline_free(mt_pipeline *p);
/* The model's chunks of this stage (pointers into p). */
void mt_pipeline_model_opts(const mt_pipeline *p, mt_model_opts *o);

/* One step: runs the table; gradients accumulate in the model (zero them
 * first). st[n_mb]: per micro-batch losses of this stage's chunks (loss /
 * mtp_loss / tokens from the last chunk's stage, aux_loss from every
 * stage's MoE layers): sum them over the pp group for the global values. */
int mt_pipeline_step(mt_pipeline *p, mt_model *m, mt_pipeline_batch_fn fn, void *ctx,
                     mt_mb_stats *st);
/* Forward only (validation): each of n_mb micro-batches flows through the
 * chunks in order; st[n_mb] as above. */
int mt_pipeline_forward(mt_pipeline *p, mt_model *m, int n_mb, mt_pipeline_batch_fn fn,
                        void *ctx, mt_mb_stats *st);

/* Gradient sum of squares of the whole model (trainer.h): this stage's
 * parameters with keep[i] (the ZeRO-1 owned ones after the dp reduction,
 * and under tp the ones this tp rank counts; NULL: all), the embedding
 * replica of the last stage left out (counted on the first stage), summed
 * over dp, then tp (each when not NULL), then the pp group in F64,
 * returned rounded to f32. scratch: backend f32 [1]. */
int mt_pipeline_grad_sumsq(const mt_pipeline *p, mt_model *m, const unsigned char *keep,
                           mt_comm *dp, mt_comm *tp, float *scratch, double *sumsq);

#endif
