/* groups.c - process groups by mt_comm_split: the color is the rank's
 * coordinates outside the group (all ranks sharing them form the group),
 * the key its coordinate inside. */
#include <string.h>

#include "base/mt_status.h"
#include "engine/parallel/groups.h"

static const char *const NAMES[MT_GROUP_COUNT] = {"tp", "dp", "pp", "etp", "ep", "edp", "exp"};

const char *mt_group_name(mt_group_kind k)
{
    return (unsigned)k < MT_GROUP_COUNT ? NAMES[k] : "?";
}

void mt_groups_free(mt_groups *g)
{
    for (int k = 0; k < MT_GROUP_COUNT; k++) {
        mt_comm_destroy(g->g[k]);
        g->g[k] = NULL;
    }
}

int mt_groups_build(mt_groups *g, mt_comm *world, const mt_layout *l)
{
    memset(g, 0, sizeof *g);
    const int n = mt_comm_size(world), rank = mt_comm_rank(world);
    /* the layout must cover the world and fold the experts: the one check */
    mt_layout r = *l;
    int rc = mt_layout_resolve(&r, n);
    if (rc < 0) return mt_err_wrap(rc, "groups: a world of %d ranks", n);
    l = &r;
    g->layout = *l;
    g->world = world;
    mt_layout_coords(l, rank, &g->me);
    const mt_rank_coords *c = &g->me;
    const int edp = mt_layout_edp(l);
    const int color[MT_GROUP_COUNT] = {
        c->dp + l->dp * c->pp,                   /* tp */
        c->tp + l->tp * c->pp,                   /* dp */
        c->tp + l->tp * c->dp,                   /* pp */
        c->ep + l->ep * (c->edp + edp * c->pp),  /* etp */
        c->etp + l->etp * (c->edp + edp * c->pp),/* ep */
        c->etp + l->etp * (c->ep + l->ep * c->pp), /* edp */
        c->edp + edp * c->pp,                    /* exp */
    };
    const int key[MT_GROUP_COUNT] = {c->tp, c->dp, c->pp, c->etp, c->ep, c->edp,
                                     c->etp + l->etp * c->ep};
    for (int k = 0; k < MT_GROUP_COUNT; k++) {
        if (k == MT_GROUP_EXP && l->etp == 1) continue; /* the ep group is the exchange */
        rc = mt_comm_split(world, color[k], key[k], &g->g[k]);
        if (rc < 0) {
            mt_groups_free(g);
            return mt_err_wrap(rc, "groups: building the %s group", NAMES[k]);
        }
    }
    return MT_OK;
}
