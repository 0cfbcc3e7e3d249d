/* train_state.h - a trainer's state as tensor descriptors plus a JSON of
 * scalars: the glue between the trainer and checkpoints (ckpt/ never sees
 * the trainer; the trainer never sees ckpt/).
 *
 * Saved: the compute copies the model computes with (FP8 e4m3 + 128x128
 * scales for FP8 linears under the fp8-blockwise recipe, so a round trip
 * is bit-exact; bf16 otherwise, f32 under the fp32 recipe), router biases
 * (f32), optimizer exp_avg / exp_avg_sq (bf16) and main params (f32 or
 * bf16; absent for main_params none), all in global coordinates named by
 * engine/parallel/sharding.h; and the scalars of "state" (FORMAT.md): step,
 * consumed samples and tokens, skipped-step counters, optimizer step and
 * stochastic-rounding seed, data sampler and LR schedule settings.
 *
 * Saving is two phases so that an asynchronous save stalls training only
 * for host copies: mt_train_state_snapshot copies the raw backend buffers
 * to host memory at a step boundary; mt_train_snapshot_fill then cuts and
 * converts the pieces a rank writes, on any thread, band by band.
 */
#ifndef MT_TRAIN_STATE_H
#define MT_TRAIN_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/parallel/sharding.h"
#include "engine/model/tensor_desc.h"
#include "engine/train/trainer.h"

/* The checkpoint contents of a job: FP8 linears (recipe fp8-blockwise),
 * weight dtype (f32 for recipe fp32, else bf16), optimizer state with main
 * params per precision.main_params. */
void mt_train_state_opts(const mt_jobspec *j, mt_shard_opts *o);

/* Where parameter i's compute copy lives in the snapshot. */
typedef struct mt_snap_param {
    int64_t q_off, s_off;  /* FP8: element offsets into q / s; -1 otherwise */
    int64_t act_off;       /* act compute copy: element offset into act; -1 otherwise */
    int64_t f32_off;       /* router bias: offset into f32; -1 otherwise */
    int64_t opt_off;       /* optimizer state: p->index - lo; -1 if not in this shard */
    /* Tensor parallelism: the copies hold this rank's slab, rows [off[0],
     * off[0] + rows) x columns [off[1], off[1] + cols) of the full tensor
     * (0 and the full shape without it); scale blocks follow / 128. */
    int64_t off[2], rows, cols;
} mt_snap_param;

/* Host copies of a trainer's state at a step boundary. */
typedef struct mt_train_snapshot {
    int64_t step, consumed_samples, consumed_tokens;
    int n_params;
    mt_snap_param *params;     /* [n_params] in the full table's order (the sharding map's
                                  numbering); another rank's expert: every offset -1 */
    void *act;                 /* copy of the model's act buffer */
    int act_bytes;             /* 4: float (CPU), 2: bf16 bits (CUDA) */
    uint8_t *q;                /* e4m3 compute copies */
    float *s;                  /* their BLK128 scales */
    float *f32;                /* router biases */
    uint16_t *m, *v;           /* optimizer moments, bf16 bits */
    void *master;              /* main params: f32 or bf16 bits; NULL for none */
    int master_bytes;          /* 4 or 2 */
    size_t bytes;              /* bytes of state copied (the regions above) */
    /* The copies are carved from one slab of the backend's host memory
     * (ops.h host_alloc: page-locked on CUDA, so the device-to-host copies
     * run at link speed), allocated at the first snapshot and reused by the
     * next ones of the same trainer; NULL for a view. */
    void *slab;
    size_t slab_bytes;
    int slab_pinned;           /* 1: be->host_free frees it; 0: free() (pinning failed) */
    mt_backend *be;            /* the backend that allocated the slab */
    char *state_json;          /* scalars */
    char *config_json;         /* the model's config.json */
    char *job_json;            /* the job spec */
    const void *trainer;       /* the trainer it copies (buffer reuse) */
    int borrowed;              /* a view: the buffers are the trainer's own */
} mt_train_snapshot;

/* Copies the trainer's state to host memory (the stall of an async save):
 * one device-to-host copy per state buffer (7 at most) into the slab.
 * s is zeroed, or holds a previous snapshot of the same trainer whose
 * slab is then reused: after the first save the stall is the copy
 * alone, without allocating, pinning and faulting in fresh host memory. */
int mt_train_state_snapshot(mt_trainer *t, mt_train_snapshot *s);
/* Allocates (or keeps) the slab a snapshot of t needs without copying, so
 * that the first save's stall is the copy alone too (page-locking ~14 GB
 * takes seconds). s as for mt_train_state_snapshot. */
int mt_train_state_snapshot_reserve(mt_trainer *t, mt_train_snapshot *s);
/* The same without copying, where the backend's buffers are host memory
 * (CPU): the snapshot points into the trainer, valid while it does not
 * step - what a synchronous save needs (MT_ENOTSUP on device backends).
 * s is zeroed or a previous view. */
int mt_train_state_view(mt_trainer *t, mt_train_snapshot *s);
/* Frees the snapshot (its slab through the backend that allocated it:
 * free snapshots before destroying their backend). */
void mt_train_snapshot_free(mt_train_snapshot *s);

/* Fills band (a hyperslab of a tensor of `map`, map dtype) from the
 * snapshot. The map must be of the job's contents (mt_train_state_opts). */
int mt_train_snapshot_fill(const mt_train_snapshot *s, const mt_shard_map *map,
                           const mt_tensor_desc *band, void *buf);

/* The band's bytes inside the snapshot when they are stored there whole
 * rows, in the map's dtype (the writer then needs no copy); else NULL. */
const void *mt_train_snapshot_direct(const mt_train_snapshot *s, const mt_shard_map *map,
                                     const mt_tensor_desc *d);

/* Reading tensors for a restore: read() fills d->data with the hyperslab
 * of d->name converted to d->dtype (MT_ENOTFOUND if absent); read_fp8()
 * fills an e4m3 weight hyperslab and its block scales. */
typedef struct mt_tensor_reader {
    void *ctx;
    int (*read)(void *ctx, mt_tensor_desc *d);
    int (*read_fp8)(void *ctx, mt_tensor_desc *q, float *s);
    /* Optional (NULL: none): this rank will not read tensor `name` (nor
     * its FP8 block scales) - another replica reads it and sends it over;
     * the reader may leave it out of its read-ahead. */
    void (*skip)(void *ctx, const char *name);
    /* 1: every rank can read every tensor (a checkpoint on a file system
     * all ranks see) and every rank of the job restores from the same
     * source at once (collective over the trainer's dp and edp groups):
     * the replicas of a weight split the reads (issue 23). 0: each rank
     * reads all it holds, no communication. */
    int shared;
} mt_tensor_reader;

/* Restores the trainer from a reader and the scalars of state_json (NULL,
 * or a state without "optimizer": weights only, as after an import; the
 * optimizer then starts from the weights with zero moments at step 0).
 * Compute copies are written exactly (FP8 bytes and scales as stored),
 * optimizer buffers as stored; the trainer continues bit-identically. */
int mt_train_state_restore(mt_trainer *t, const mt_tensor_reader *r, const char *state_json);
/* The same, staging the reads in stage_mem (stage_bytes of the backend's
 * host memory, e.g. the slab of a reserved snapshot, idle until the first
 * save) when it holds the largest parameter's values and scales; else in
 * buffers of its own. */
int mt_train_state_restore_staged(mt_trainer *t, const mt_tensor_reader *r,
                                  const char *state_json, void *stage_mem, size_t stage_bytes);

/* Loads only the weights into a model (scoring, no optimizer): the compute
 * copies exactly as mt_train_state_restore writes them. progress (may be
 * NULL) is called after each parameter. */
int mt_train_state_load_weights(mt_model *m, const mt_tensor_reader *r,
                                void (*progress)(void *ctx, int done, int total), void *ctx);

/* The model config as JSON text (malloc'd). */
char *mt_train_state_config_json(const mt_model_config *c);

#endif
