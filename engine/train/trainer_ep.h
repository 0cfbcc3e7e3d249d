/* trainer_ep.h - the trainer's expert-parallel pieces (engine/train
 * internal; trainer.h describes the rules). */
#ifndef MT_TRAINER_EP_H
#define MT_TRAINER_EP_H

#include "engine/train/trainer.h"

/* Before the model is built: the dispatcher over ep into mo. */
int mt_trainer_ep_init(mt_trainer *t, mt_comm *ep, mt_comm *edp, mt_model_opts *mo);
/* After the model is destroyed. */
void mt_trainer_ep_free(mt_trainer *t);

#endif
