/* trainer_tp.h - the trainer's tensor-parallel pieces (engine/train
 * internal; trainer.h describes the rules). */
#ifndef MT_TRAINER_TP_H
#define MT_TRAINER_TP_H

#include "engine/train/trainer.h"

/* Before the model is built: the model's tp table over the tp group into
 * mo, and the model's gradient hook (mt_trainer_tp_layer_done). */
int mt_trainer_tp_init(mt_trainer *t, mt_comm *tp, mt_model_opts *mo);
/* After the model is built: the parameters whose gradients tp fixes before
 * the reductions (below), in the order the backward finishes them, and the
 * norm's rule (t->in_norm; after own_params). */
int mt_trainer_tp_bind(mt_trainer *t);
/* After the model is destroyed. */
void mt_trainer_tp_free(mt_trainer *t);

/* The gradients tp fixes before any reduction or norm reads them
 * (collective over tp):
 * - sequence parallelism: the parameters applied to sequence-split rows
 *   (the norms outside the regions, MTP's eh_proj) hold this rank's rows'
 *   share of their gradient: summed over tp;
 * - the router: each tp rank routes its share of the rows (the model's
 *   layers.h, mt_tp_share), so its gradient holds that share's: summed
 *   over tp. (The routed experts need no fix: a token reaches them from
 *   one tp rank only, and the edp reduction spans the tp ranks.)
 * mt_trainer_tp_arm(t, 1) before the step's last micro-batch (0 before the
 * others): its backward fixes each layer's parameters as soon as they are
 * final (mt_trainer_tp_layer_done, before the layer's gradient buckets
 * start); mt_trainer_tp_grads after the micro-batches fixes the rest (all
 * of them when not armed) and disarms. */
void mt_trainer_tp_arm(mt_trainer *t, int on);
/* The model's on_layer_grads hook under tp (arg: the trainer): the fixes of
 * the parameters final after layer `layer`, then the gradient buckets'
 * hook (mt_grad_buckets_layer_done). */
int mt_trainer_tp_layer_done(void *arg, int layer);
int mt_trainer_tp_grads(mt_trainer *t);

#endif
