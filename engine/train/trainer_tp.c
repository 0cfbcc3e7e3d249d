/* trainer_tp.c - see trainer_tp.h. */
#include "engine/train/trainer_tp.h"

#include "base/mt_status.h"
#include "engine/parallel/tp_comm.h"

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
    return MT_OK;
}

void mt_trainer_tp_free(mt_trainer *t)
{
    if (t->tp) t->tp->destroy(t->tp);
    t->tp = NULL;
}

int mt_trainer_tp_grads(mt_trainer *t)
{
    mt_model *m = t->model;
    const int sp = t->job.parallel.sequence_parallel;
    for (int i = 0; i < m->table.n; i++) {
        mt_param *p = &m->params[i];
        if (p->grad && p->d.expert >= 0 && t->ep_size > 1) {
            MT_CHECK(t->be->scale_f32(t->be, p->grad, mt_param_numel(&p->d),
                                      1.0f / (float)t->tp_size));
            continue;
        }
        if (!sp) continue;
        switch (p->d.role) {
        case MT_PR_INPUT_NORM: case MT_PR_POST_ATTN_NORM: case MT_PR_FINAL_NORM:
        case MT_PR_MTP_ENORM: case MT_PR_MTP_HNORM: case MT_PR_MTP_EH: case MT_PR_MTP_NORM:
            MT_CHECK(mt_comm_all_reduce(t->tpc, p->grad, p->grad,
                                        (size_t)mt_param_numel(&p->d), MT_COMM_F32,
                                        MT_COMM_SUM));
            break;
        default:
            break;
        }
    }
    return MT_OK;
}

/* A parameter split over tp: its part is smaller than the full tensor. */
static int is_split(const mt_param_desc *d)
{
    return d->rows != d->full_rows || d->cols != d->full_cols;
}

int mt_trainer_tp_grad_sumsq(mt_trainer *t, double *sumsq)
{
    mt_model *m = t->model;
    mt_backend *be = t->be;
    double part[3] = {0, 0, 0}; /* replicated, split, routed experts under ep */
    /* runs of parameters of one kind, contiguous in buf_grad */
    int64_t lo = -1, n = 0;
    int kind = 0;
    for (int i = 0; i <= m->table.n; i++) {
        const mt_param *p = i < m->table.n ? &m->params[i] : NULL;
        if (p && !p->grad) continue;
        const int k = !p ? -1 : p->d.expert >= 0 && t->ep_size > 1 ? 2 : is_split(&p->d);
        if (p && lo >= 0 && k == kind && lo + n == p->index) {
            n += mt_param_numel(&p->d);
            continue;
        }
        if (lo >= 0 && n > 0) {
            float v;
            MT_CHECK(be->sumsq(be, t->opt->sumsq, m->buf_grad + lo, n));
            MT_CHECK(be->download(be, &v, t->opt->sumsq, 4));
            part[kind] += v;
        }
        if (!p) break;
        lo = p->index;
        n = mt_param_numel(&p->d);
        kind = k;
    }
    MT_CHECK(mt_comm_all_reduce(mt_comm_host(t->tpc), &part[1], &part[1], 1, MT_COMM_F64,
                                MT_COMM_SUM));
    /* every ep rank holds other experts; their edp replicas hold the same */
    if (t->ep_size > 1)
        MT_CHECK(mt_comm_all_reduce(mt_comm_host(t->ep), &part[2], &part[2], 1, MT_COMM_F64,
                                    MT_COMM_SUM));
    *sumsq = part[0] + part[1] + part[2];
    return MT_OK;
}
