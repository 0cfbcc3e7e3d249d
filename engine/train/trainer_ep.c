/* trainer_ep.c - see trainer_ep.h. */
#include "engine/train/trainer_ep.h"

#include <stdlib.h>

#include "base/mt_status.h"
#include "engine/parallel/moe_a2a.h"

int mt_trainer_ep_init(mt_trainer *t, mt_comm *ep, mt_comm *edp, mt_model_opts *mo)
{
    const mt_jobspec *j = &t->job;
    const int EP = j->parallel.ep, E = j->model.n_routed_experts;
    if (mt_comm_size(ep) != EP)
        return MT_ERR(MT_EINVAL, "trainer: the expert-parallel group has %d ranks, the layout "
                      "ep %d", mt_comm_size(ep), EP);
    const int edp_size = edp ? mt_comm_size(edp) : 1;
    if (edp_size != mt_layout_edp(&j->parallel))
        return MT_ERR(MT_EINVAL, "trainer: the expert-data-parallel group has %d ranks, the "
                      "layout's edp is %d", edp_size, mt_layout_edp(&j->parallel));
    if (t->be->kind != MT_BE_CPU)
        return MT_ERR(MT_ENOTSUP, "trainer: parallel.ep %d runs on the cpu backend only so far "
                      "(the GPU path of expert parallelism is not done)", EP);
    /* act values of the bf16 and fp8 recipes are bf16 numbers: bf16 on the
     * wire is exact and half the bytes */
    const mt_comm_dtype wire =
        j->precision.recipe == MT_RECIPE_FP32 ? MT_COMM_F32 : MT_COMM_BF16;
    MT_CHECK(mt_moe_dispatch_a2a(&t->disp, ep, E, wire));
    t->ep = ep;
    t->edp = edp;
    t->ep_size = EP;
    mo->dispatcher = t->disp;
    return MT_OK;
}

int mt_trainer_ep_bind(mt_trainer *t)
{
    if (t->ep_size <= 1) return MT_OK;
    mt_model *m = t->model;
    t->gseg = calloc((size_t)m->table.n + 1, sizeof *t->gseg);
    if (!t->gseg) return MT_ERR(MT_ENOMEM, "trainer: out of memory");
    t->n_gseg = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mt_param *p = &m->params[i];
        if (!p->grad) continue;
        const int ex = p->d.expert >= 0;
        const int64_t n = mt_param_numel(&p->d);
        mt_grad_seg *last = t->n_gseg ? &t->gseg[t->n_gseg - 1] : NULL;
        if (last && last->expert == ex && last->lo + last->n == p->index) {
            last->n += n;
        } else {
            t->gseg[t->n_gseg++] = (mt_grad_seg){p->index, n, ex};
        }
    }
    return t->be->alloc(t->be, 4, (void **)&t->sumsq_dev);
}

void mt_trainer_ep_free(mt_trainer *t)
{
    if (t->sumsq_dev) t->be->free(t->be, t->sumsq_dev);
    if (t->disp) t->disp->destroy(t->disp);
    free(t->gseg);
    t->sumsq_dev = NULL;
    t->disp = NULL;
    t->gseg = NULL;
}

int mt_trainer_ep_reduce_grads(mt_trainer *t)
{
    char *g = t->model->buf_grad;
    const size_t ge = mt_model_grad_size(t->model);
    for (int s = 0; s < t->n_gseg; s++) {
        const mt_grad_seg *sg = &t->gseg[s];
        mt_comm *c = sg->expert ? t->edp : t->dp;
        if (!c || mt_comm_size(c) == 1) continue;
        void *gs = g + (size_t)sg->lo * ge;
        MT_CHECK(mt_comm_all_reduce(c, gs, gs, (size_t)sg->n, mt_trainer_grad_dtype(t->model),
                                    MT_COMM_SUM));
    }
    return MT_OK;
}

int mt_trainer_ep_grad_sumsq(mt_trainer *t, double *sumsq)
{
    mt_backend *be = t->be;
    const char *g = t->model->buf_grad;
    const size_t ge = mt_model_grad_size(t->model);
    const int gbf = t->model->grad_type == MT_C_BF16;
    double part[2] = {0, 0}; /* dense, expert */
    for (int s = 0; s < t->n_gseg; s++) {
        const mt_grad_seg *sg = &t->gseg[s];
        float v;
        MT_CHECK(be->sumsq(be, t->sumsq_dev, g + (size_t)sg->lo * ge, gbf, sg->n));
        MT_CHECK(be->download(be, &v, t->sumsq_dev, 4));
        part[sg->expert] += v;
    }
    /* every ep rank holds other experts; their edp replicas hold the same */
    MT_CHECK(mt_comm_all_reduce(mt_comm_host(t->ep), &part[1], &part[1], 1, MT_COMM_F64,
                                MT_COMM_SUM));
    *sumsq = part[0] + part[1];
    return MT_OK;
}
