/* tp_comm.c - see tp_comm.h. */
#include "engine/parallel/tp_comm.h"

#include <stdlib.h>

#include "base/mt_status.h"

typedef struct tp_impl {
    mt_comm *c;
    mt_comm_dtype act; /* F32 (cpu) or BF16 (cuda) */
} tp_impl;

static tp_impl *impl_of(mt_tp *t) { return t->impl; }

static int sum_act(mt_tp *t, void *x, int64_t n)
{
    tp_impl *p = impl_of(t);
    return mt_comm_all_reduce(p->c, x, x, (size_t)n, p->act, MT_COMM_SUM);
}

static int gather_f32(mt_tp *t, const float *send, float *recv, int64_t n)
{
    return mt_comm_all_gather(impl_of(t)->c, send, recv, (size_t)n, MT_COMM_F32);
}

static int gather_act(mt_tp *t, const void *send, void *recv, int64_t n)
{
    tp_impl *p = impl_of(t);
    return mt_comm_all_gather(p->c, send, recv, (size_t)n, p->act);
}

static int reduce_scatter_act(mt_tp *t, const void *send, void *recv, int64_t n)
{
    tp_impl *p = impl_of(t);
    return mt_comm_reduce_scatter(p->c, send, recv, (size_t)n, p->act, MT_COMM_SUM);
}

static void destroy(mt_tp *t)
{
    if (!t) return;
    free(t->impl);
    free(t);
}

int mt_tp_over_comm(mt_tp **out, mt_comm *tp, const mt_backend *be, int sp)
{
    *out = NULL;
    const mt_comm_mem want = be->kind == MT_BE_CPU ? MT_COMM_HOST : MT_COMM_DEVICE;
    if (mt_comm_mem_kind(tp) != want)
        return MT_ERR(MT_EINVAL, "tensor parallelism: the %s backend needs a tp group with %s "
                      "memory", be->name, want == MT_COMM_HOST ? "host" : "device");
    if (be->act_bytes != 4 && be->act_bytes != 2)
        return MT_ERR(MT_EINVAL, "tensor parallelism: act elements of %d bytes", be->act_bytes);
    mt_tp *t = calloc(1, sizeof *t);
    tp_impl *p = calloc(1, sizeof *p);
    if (!t || !p) {
        free(t);
        free(p);
        return MT_ERR(MT_ENOMEM, "tensor parallelism: out of memory");
    }
    p->c = tp;
    p->act = be->act_bytes == 4 ? MT_COMM_F32 : MT_COMM_BF16;
    t->size = mt_comm_size(tp);
    t->rank = mt_comm_rank(tp);
    t->sp = sp;
    t->sum_act = sum_act;
    t->gather_f32 = gather_f32;
    t->gather_act = gather_act;
    t->reduce_scatter_act = reduce_scatter_act;
    t->destroy = destroy;
    t->impl = p;
    *out = t;
    return MT_OK;
}
