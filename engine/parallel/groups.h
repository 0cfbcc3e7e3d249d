/* groups.h - the process groups of a parallel layout, each a communicator.
 *
 * From the layout's rank coordinates (sharding.h, Megatron order):
 *   tp   ranks with the same (dp, pp), ordered by tp      size TP
 *   dp   same (tp, pp), ordered by dp                     size DP
 *   pp   same (tp, dp), ordered by pp                     size PP
 *   etp  same (ep, edp, pp), ordered by etp               size ETP
 *   ep   same (etp, edp, pp), ordered by ep               size EP
 *   edp  same (etp, ep, pp), ordered by edp               size EDP
 *   exp  same (edp, pp), ordered by etp + ETP ep          size ETP x EP
 *        (the token exchange of expert tensor parallelism, moe_a2a.h;
 *        built only when etp > 1, NULL otherwise: the ep group serves)
 * so a rank's position in each group is its coordinate there. Every group
 * is split from `world` and has its backend and memory kind.
 */
#ifndef MT_GROUPS_H
#define MT_GROUPS_H

#include "engine/parallel/comm.h"
#include "engine/parallel/layout.h"

typedef enum {
    MT_GROUP_TP = 0,
    MT_GROUP_DP,
    MT_GROUP_PP,
    MT_GROUP_ETP,
    MT_GROUP_EP,
    MT_GROUP_EDP,
    MT_GROUP_EXP,
    MT_GROUP_COUNT
} mt_group_kind;
_Static_assert(MT_GROUP_COUNT == 7, "update mt_group_name and groups.c");

typedef struct mt_groups {
    mt_layout layout;
    mt_rank_coords me;            /* this rank's coordinates */
    mt_comm *world;               /* not owned */
    mt_comm *g[MT_GROUP_COUNT];   /* owned; g[MT_GROUP_TP] ... */
} mt_groups;

const char *mt_group_name(mt_group_kind k); /* "tp" */

/* Builds all groups (collective over world). The layout must cover the
 * world (tp * dp * pp = its size) and fold the experts (etp * ep divides
 * tp * dp): errors name the numbers. On failure nothing is held. */
int mt_groups_build(mt_groups *g, mt_comm *world, const mt_layout *l);
void mt_groups_free(mt_groups *g);

#endif
