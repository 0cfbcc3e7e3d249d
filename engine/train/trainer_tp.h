/* trainer_tp.h - the trainer's tensor-parallel pieces (engine/train
 * internal; trainer.h describes the rules). */
#ifndef MT_TRAINER_TP_H
#define MT_TRAINER_TP_H

#include "engine/train/trainer.h"

/* Before the model is built: the model's tp table over the tp group into mo. */
int mt_trainer_tp_init(mt_trainer *t, mt_comm *tp, mt_model_opts *mo);
/* After the micro-batches, before any other reduction (collective over tp):
 * - sequence parallelism: the parameters applied to sequence-split rows
 *   (the norms outside the regions, MTP's eh_proj) hold this rank's rows'
 *   share of their gradient: summed over tp;
 * - expert parallelism: the tp ranks of an ep group dispatch the same
 *   tokens, so each expert saw every token tp times: its gradient is
 *   divided by tp (exact: tp is a power of two in practice; else rounded). */
int mt_trainer_tp_grads(mt_trainer *t);
/* After the model is destroyed. */
void mt_trainer_tp_free(mt_trainer *t);
/* The global sum of squares of the gradients: the split parameters' parts
 * summed over the tp group, the replicated ones (the same on every tp rank)
 * counted once, under expert parallelism the routed experts' summed over
 * the ep group (collective over tp and ep). */
int mt_trainer_tp_grad_sumsq(mt_trainer *t, double *sumsq);

#endif
