/* trainer_ep.c - see trainer_ep.h. */
#include "engine/train/trainer_ep.h"

#include <stdlib.h>

#include "base/mt_status.h"
#include "engine/parallel/moe_a2a.h"

int mt_trainer_ep_init(mt_trainer *t, mt_comm *ep, mt_comm *edp, mt_model_opts *mo)
{
    const mt_jobspec *j = &t->job;
    const int EP = j->parallel.ep, ETP = j->parallel.etp, E = j->model.n_routed_experts;
    if (mt_comm_size(ep) != EP * ETP)
        return MT_ERR(MT_EINVAL, "trainer: the expert-parallel group has %d ranks, the layout "
                      "ep %d x etp %d", mt_comm_size(ep), EP, ETP);
    const int edp_size = edp ? mt_comm_size(edp) : 1;
    if (edp_size != mt_layout_edp(&j->parallel))
        return MT_ERR(MT_EINVAL, "trainer: the expert-data-parallel group has %d ranks, the "
                      "layout's edp is %d", edp_size, mt_layout_edp(&j->parallel));
    /* rows travel as bf16: the CUDA backend's act values are bf16; the CPU's
     * are bf16 numbers under the bf16 and fp8 recipes (exact, half the
     * bytes), floats under fp32 (f32 wire) */
    const mt_comm_dtype wire = t->be->kind == MT_BE_CPU && j->precision.recipe == MT_RECIPE_FP32
                                   ? MT_COMM_F32
                                   : MT_COMM_BF16;
    MT_CHECK(mt_moe_dispatch_a2a_etp(&t->disp, ep, E, ETP, wire));
    t->ep = ep;
    t->edp = edp;
    t->ep_size = EP;
    mo->dispatcher = t->disp;
    return MT_OK;
}

void mt_trainer_ep_free(mt_trainer *t)
{
    if (t->disp) t->disp->destroy(t->disp);
    t->disp = NULL;
}
