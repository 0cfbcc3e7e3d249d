/* moe_dispatch.c - the identity dispatcher (expert-parallel size 1). */
#include "engine/model/moe_dispatch.h"

#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

static int identity_dispatch(mt_moe_dispatcher *d, mt_backend *be, void **xl, int *local_rows,
                             void *xp, const int *rows, int D)
{
    (void)be;
    (void)D;
    *xl = xp;
    memcpy(local_rows, rows, (size_t)d->E * sizeof *rows);
    return MT_OK;
}

static int identity_combine(mt_moe_dispatcher *d, mt_backend *be, void *yp, const void *yl,
                            const int *rows, int D)
{
    (void)d;
    if (yp == yl) return MT_OK;
    int64_t R = 0;
    for (int e = 0; e < d->E; e++) R += rows[e];
    return be->copy(be, yp, yl, (size_t)(R * D) * mt_act_size(be));
}

static void identity_destroy(mt_moe_dispatcher *d) { free(d); }

int mt_moe_dispatch_identity(mt_moe_dispatcher **out, int E)
{
    mt_moe_dispatcher *d = calloc(1, sizeof *d);
    if (!d) return MT_ERR(MT_ENOMEM, "dispatcher: out of memory");
    d->E = E;
    d->e_lo = 0;
    d->E_local = E;
    d->dispatch = identity_dispatch;
    d->combine = identity_combine;
    d->destroy = identity_destroy;
    *out = d;
    return MT_OK;
}
