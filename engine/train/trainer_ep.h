/* trainer_ep.h - the trainer's expert-parallel pieces (engine/train
 * internal; trainer.h describes the rules). */
#ifndef MT_TRAINER_EP_H
#define MT_TRAINER_EP_H

#include "engine/train/trainer.h"

/* A run of the flat gradient buffer: dense or expert parameters. */
typedef struct mt_grad_seg {
    int64_t lo, n;   /* elements of buf_grad */
    int expert;
} mt_grad_seg;

/* Before the model is built: the dispatcher over ep into mo. */
int mt_trainer_ep_init(mt_trainer *t, mt_comm *ep, mt_comm *edp, mt_model_opts *mo);
/* After: the gradient runs. */
int mt_trainer_ep_bind(mt_trainer *t);
/* After the model is destroyed. */
void mt_trainer_ep_free(mt_trainer *t);
/* Dense gradients summed over dp, expert gradients over edp (collective). */
int mt_trainer_ep_reduce_grads(mt_trainer *t);
/* The global sum of squares of the gradients (collective over ep). */
int mt_trainer_ep_grad_sumsq(mt_trainer *t, double *sumsq);

#endif
