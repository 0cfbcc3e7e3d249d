/* trainer_tp.c - see trainer_tp.h. */
#include "engine/train/trainer_tp.h"

#include <limits.h>
#include <stdlib.h>

#include "base/mt_status.h"
#include "engine/parallel/tp_comm.h"
#include "engine/train/grad_buckets.h"

int mt_trainer_tp_init(mt_trainer *t, mt_comm *tp, mt_model_opts *mo)
{
    const mt_jobspec *j = &t->job;
    if (!tp || mt_comm_size(tp) != j->parallel.tp)
        return MT_ERR(MT_EINVAL, "trainer: parallel.tp %d needs the tensor-parallel group of as "
                      "many ranks (it has %d)", j->parallel.tp, tp ? mt_comm_size(tp) : 0);
    MT_CHECK(mt_tp_over_comm(&t->tp, tp, t->be, j->parallel.sequence_parallel));
    t->tpc = tp;
    t->tp_size = j->parallel.tp;
    mo->tp = t->tp;
    mo->on_layer_grads = mt_trainer_tp_layer_done;
    mo->on_layer_grads_arg = t;
    return MT_OK;
}

/* A parameter split over tp: its part is smaller than the full tensor. */
static int is_split(const mt_param_desc *d)
{
    return d->rows != d->full_rows || d->cols != d->full_cols;
}

/* Applied to sequence-split rows under sequence parallelism. */
static int sp_role(mt_param_role r);

/* A replicated parameter whose gradient is a term of a sum over tp: the
 * router's (each tp rank routes its share of the rows: layers.h,
 * mt_tp_share) and, under sequence parallelism, the norms of split rows. */
static int summed_over_tp(const mt_param_desc *d, int sp)
{
    return d->expert < 0 && (d->role == MT_PR_ROUTER || (sp && sp_role(d->role)));
}

static int sp_role(mt_param_role r)
{
    switch (r) {
    case MT_PR_INPUT_NORM: case MT_PR_POST_ATTN_NORM: case MT_PR_FINAL_NORM:
    case MT_PR_MTP_ENORM: case MT_PR_MTP_HNORM: case MT_PR_MTP_EH: case MT_PR_MTP_NORM:
        return 1;
    default:
        return 0;
    }
}

static const mt_model *sort_model;
static int by_backward(const void *a, const void *b)
{
    const int i = *(const int *)a, k = *(const int *)b;
    /* the model's key: the same one the gradient buckets start on */
    const int ki = mt_model_grad_ready(sort_model, i), kk = mt_model_grad_ready(sort_model, k);
    if (ki != kk) return ki > kk ? -1 : 1;
    return i < k ? -1 : i > k; /* table order: the same on every tp rank */
}

int mt_trainer_tp_bind(mt_trainer *t)
{
    if (t->tp_size <= 1) return MT_OK;
    const mt_model *m = t->model;
    const int np = m->table.n, sp = t->job.parallel.sequence_parallel;
    t->tp_fix = malloc((size_t)(np > 0 ? np : 1) * sizeof *t->tp_fix);
    t->in_norm = malloc((size_t)(np > 0 ? np : 1));
    if (!t->tp_fix || !t->in_norm) return MT_ERR(MT_ENOMEM, "trainer: out of memory");
    t->n_tp_fix = 0;
    for (int i = 0; i < np; i++) {
        const mt_param *p = &m->params[i];
        /* the routed experts' gradients need no fix: each tp rank's are of
         * its share of the rows, summed over edp (which spans the tp ranks) */
        if (p->grad && summed_over_tp(&p->d, sp)) t->tp_fix[t->n_tp_fix++] = i;
        /* the norm: each routed expert is owned once in the world (edp x
         * ep), each split part once in its dp group, each replicated
         * parameter once in the dp group of every tp rank: tp rank 0's */
        t->in_norm[i] = t->keep[i] && (p->d.expert >= 0 || is_split(&p->d) || t->tp->rank == 0);
    }
    sort_model = m;
    qsort(t->tp_fix, (size_t)t->n_tp_fix, sizeof *t->tp_fix, by_backward);
    return MT_OK;
}

void mt_trainer_tp_free(mt_trainer *t)
{
    if (t->tp) t->tp->destroy(t->tp);
    free(t->tp_fix);
    free(t->in_norm);
    t->tp = NULL;
    t->tp_fix = NULL;
    t->in_norm = NULL;
}

void mt_trainer_tp_arm(mt_trainer *t, int on)
{
    t->tp_armed = on;
    t->tp_fix_next = 0;
}

/* The fixes of the parameters final after layer `layer` not done yet. */
static int fix_upto(mt_trainer *t, int layer)
{
    mt_model *m = t->model;
    mt_backend *be = t->be;
    const int device = mt_comm_mem_kind(t->tpc) == MT_COMM_DEVICE;
    int summed = 0;
    while (t->tp_fix_next < t->n_tp_fix &&
           mt_model_grad_ready(m, t->tp_fix[t->tp_fix_next]) >= layer) {
        mt_param *p = &m->params[t->tp_fix[t->tp_fix_next++]];
        const int64_t n = mt_param_numel(&p->d);
        /* device groups: the group's stream is not the backend's (ops.h
         * does not expose it), so the host orders them, as the buckets do */
        if (device && !summed) MT_CHECK(be->sync(be));
        MT_CHECK(mt_comm_all_reduce(t->tpc, p->grad, p->grad, (size_t)n, MT_COMM_F32,
                                    MT_COMM_SUM));
        summed = 1;
    }
    if (device && summed) MT_CHECK(mt_comm_sync(t->tpc));
    return MT_OK;
}

int mt_trainer_tp_layer_done(void *arg, int layer)
{
    mt_trainer *t = arg;
    if (t->tp_armed) MT_CHECK(fix_upto(t, layer));
    return t->gb ? mt_grad_buckets_layer_done(t->gb, layer) : MT_OK;
}

int mt_trainer_tp_grads(mt_trainer *t)
{
    int rc = fix_upto(t, INT_MIN);
    mt_trainer_tp_arm(t, 0);
    return rc;
}
