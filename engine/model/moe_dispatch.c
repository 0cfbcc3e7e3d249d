/* moe_dispatch.c - the dispatch plan and the identity dispatcher
 * (expert-parallel size 1). */
#include "engine/model/moe_dispatch.h"

#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

int mt_moe_plan_init(mt_moe_plan *p, int ep, int E_local, int align)
{
    memset(p, 0, sizeof *p);
    if (ep < 1 || E_local < 0 || align < 1)
        return MT_ERR(MT_EINVAL, "dispatch plan: ep %d, %d local experts, align %d", ep, E_local,
                      align);
    p->ep = ep;
    p->E_local = E_local;
    p->align = align;
    p->local_rows = calloc((size_t)E_local + 1, sizeof *p->local_rows);
    p->from = calloc((size_t)ep * E_local + 1, sizeof *p->from);
    p->sent = calloc((size_t)ep, sizeof *p->sent);
    p->to = calloc((size_t)ep * E_local + 1, sizeof *p->to);
    if (!p->local_rows || !p->from || !p->sent || !p->to) {
        mt_moe_plan_free(p);
        return MT_ERR(MT_ENOMEM, "dispatch plan: out of memory");
    }
    return MT_OK;
}

void mt_moe_plan_free(mt_moe_plan *p)
{
    free(p->local_rows);
    free(p->from);
    free(p->sent);
    free(p->to);
    memset(p, 0, sizeof *p);
}

static int identity_dispatch(mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p, int count,
                             void **xl, void *xl_buf, const void *xp, const void *x,
                             const int32_t *src, const int *rows, int D)
{
    (void)be;
    (void)xl_buf;
    (void)x;
    (void)src;
    (void)D;
    if (!xp) return MT_ERR(MT_EINVAL, "identity dispatch: the source layout xp is needed");
    *xl = (void *)xp;
    if (!count) return MT_OK;
    int64_t R = 0;
    for (int e = 0; e < d->E; e++) {
        p->local_rows[e] = rows[e];
        p->from[e] = p->to[e] = rows[e];
        R += rows[e];
    }
    p->R = p->Rl = (int)R;
    p->sent[0] = R;
    return MT_OK;
}

static int identity_combine(mt_moe_dispatcher *d, mt_backend *be, const mt_moe_plan *p, void *yp,
                            const void *yl, int D)
{
    (void)d;
    if (yp == yl) return MT_OK;
    return be->copy(be, yp, yl, (size_t)p->R * D * mt_act_size(be));
}

static void identity_destroy(mt_moe_dispatcher *d) { free(d); }

int mt_moe_dispatch_identity(mt_moe_dispatcher **out, int E)
{
    mt_moe_dispatcher *d = calloc(1, sizeof *d);
    if (!d) return MT_ERR(MT_ENOMEM, "dispatcher: out of memory");
    d->E = E;
    d->e_lo = 0;
    d->E_local = E;
    d->ep = 1;
    d->etp = 1;
    d->dispatch = identity_dispatch;
    d->combine = identity_combine;
    d->destroy = identity_destroy;
    *out = d;
    return MT_OK;
}
