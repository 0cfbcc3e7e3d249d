/* optimizer.h - the distributed-ready AdamW (ZeRO-1 layout).
 *
 * Parameters are addressed by their element offset in the model's flat
 * gradient buffer (mt_param.index). A rank owns one shard [lo, hi) of that
 * index space and keeps, for it only: the high-precision main copy (fp32,
 * bf16, or none), and the BF16 moments m and v. An update reads the shard's
 * gradients, updates the shard and rebuilds the compute copies of the
 * parameters it covers (FP8 blocks + transpose, or BF16). Under data
 * parallelism gradients are reduce-scattered to shards before, and the FP8
 * compute copies all-gathered after; with one rank the shard is everything.
 *
 * main_params = none: the compute copy is the only copy. An update
 * dequantises it, applies AdamW in fp32 and writes it back with stochastic
 * rounding (to e4m3 under the fp8 recipe, to bf16 otherwise).
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
    int64_t lo, hi;     /* shard of the flat parameter index space */
    void *master;       /* f32 or bf16 bits [hi - lo]; NULL for none */
    uint16_t *m, *v;    /* bf16 bits [hi - lo] */
    float *tmp;         /* f32 [largest parameter]: dequantised weights, bf16 master as f32 */
    float *sumsq;       /* f32 [1] */
    int64_t step;       /* updates applied so far */
    uint64_t seed;      /* stochastic rounding stream */
} mt_optimizer;

/* An optimizer for the model's parameters in [lo, hi) (hi = -1: all). */
int mt_optimizer_create(mt_optimizer **out, mt_model *m, const mt_jobspec *j, int64_t lo,
                        int64_t hi);
void mt_optimizer_destroy(mt_optimizer *o);

/* Sets parameter i everywhere it lives: main copy (if any) and compute
 * copies, from host f32 values. */
int mt_optimizer_set_param(mt_optimizer *o, mt_model *m, int i, const float *host);

/* Random initialisation of every parameter (mt_model_init_value). */
int mt_optimizer_init_random(mt_optimizer *o, mt_model *m, uint64_t seed);

/* Sum of squares of this shard's gradients (host). */
int mt_optimizer_grad_sumsq(mt_optimizer *o, mt_model *m, double *sumsq);

/* One AdamW update of the shard with learning rate lr and gradients scaled
 * by grad_scale (clipping); rebuilds the compute copies. */
int mt_optimizer_update(mt_optimizer *o, mt_model *m, double lr, double grad_scale);

/* Bytes of optimizer state held by this rank. */
size_t mt_optimizer_state_bytes(const mt_optimizer *o);

#endif
