/* optimizer.h - AdamW with ZeRO-1: each rank keeps the state of its
 * parameters only.
 *
 * Parameters are whole units of the shard: a rank keeps, for the parameters
 * it owns (mt_zero_owners, the same rule the checkpoint's sharding map
 * uses), the high-precision main copy (fp32, bf16, or none) and the BF16
 * moments m and v, packed in table order (off[i]). An update reads those
 * parameters' gradients, updates them and rebuilds their compute copies
 * (FP8 blocks + transpose, or BF16); whole parameters keep every 128x128
 * block's re-quantisation on one rank. Under data parallelism the trainer
 * sums the gradients over the group before and shares the owners' updated
 * compute copies after; with one rank the shard is everything.
 *
 * main_params = none: the compute copy is the only copy. An update
 * dequantises it, applies AdamW in fp32 and writes it back with stochastic
 * rounding (to e4m3 under the fp8 recipe, in one op with the transpose:
 * adamw_fp8_sr, every FP8 weight of an update in one adamw_fp8_sr_n call;
 * to bf16 otherwise, in one op: adamw_sr).
 */
#ifndef MT_OPTIMIZER_H
#define MT_OPTIMIZER_H

#include <stdint.h>

#include "engine/train/jobspec.h"
#include "engine/model/model.h"

typedef struct mt_optimizer {
    mt_backend *be;
    mt_main_params main;
    mt_optimizer_cfg cfg;
    int n_params;
    int64_t *off;       /* [n_params]: element offset of parameter i's state, -1: not kept */
    int64_t n_state;    /* elements of state kept here */
    void *master;       /* f32 or bf16 bits [n_state]; NULL for none */
    uint16_t *m, *v;    /* bf16 bits [n_state] */
    float *tmp;         /* f32 [tmp_n]: dequantised weights (slab by slab), bf16 master as f32 */
    int64_t tmp_n;      /* bf16 main: the largest parameter; else mt_params_stage_elems */
    float *sumsq;       /* f32 [1] */
    mt_adamw_fp8_arg *fp8; /* host [n_params]: one update's FP8 weights, for adamw_fp8_n */
    mt_adamw_fp8_sr_arg *fp8_sr; /* the same with no main copy, for adamw_fp8_sr_n */
    int64_t step;       /* updates applied so far */
    uint64_t seed;      /* stochastic rounding stream */
} mt_optimizer;

/* An optimizer keeping the state of the parameters i with keep[i] != 0
 * (keep NULL: all). */
int mt_optimizer_create(mt_optimizer **out, mt_model *m, const mt_jobspec *j,
                        const unsigned char *keep);
void mt_optimizer_destroy(mt_optimizer *o);

/* Sets parameter i everywhere it lives: main copy (if any) and compute
 * copies, from host f32 values. */
int mt_optimizer_set_param(mt_optimizer *o, mt_model *m, int i, const float *host);

/* Random initialisation of every parameter (mt_model_init_value). */
int mt_optimizer_init_random(mt_optimizer *o, mt_model *m, uint64_t seed);

/* Sum of squares of the model's whole gradient (host): every rank holds the
 * summed gradients, so this is the global norm. */
int mt_optimizer_grad_sumsq(mt_optimizer *o, mt_model *m, double *sumsq);

/* One AdamW update of the shard with learning rate lr and gradients scaled
 * by grad_scale (clipping); rebuilds the compute copies. */
int mt_optimizer_update(mt_optimizer *o, mt_model *m, double lr, double grad_scale);

/* Bytes of optimizer state held by this rank. */
size_t mt_optimizer_state_bytes(const mt_optimizer *o);

#endif
