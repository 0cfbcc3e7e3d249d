/* test_tp_xent.c - the vocabulary-parallel cross-entropy and embedding
 * (tensor parallelism, engine/model/tp.c) against the plain ones.
 *
 * Run under mpirun with P ranks (also alone). Every rank builds the same
 * full logits [N, V] and targets from a seed (V = 37: parts of unequal size
 * for P = 2 and 4, plus some ignored targets and logits spread over +-12),
 * takes its columns [v_lo, v_lo + V_local) of the sharding rule
 * (mt_param_part) and runs mt_tp_xent over the tp group. Properties:
 *   1. the per-token losses equal the plain xent's over the whole row
 *      within 2e-6 relative (the sum of exponentials is regrouped by part),
 *      and are bit-identical on every rank;
 *   2. each rank's gradient columns equal the plain gradient's columns
 *      within 1e-6 (absolute; gradients are at most grad_scale); ignored
 *      rows give a zero loss and a zero gradient row;
 *   3. the embedding looked up in each rank's rows (other ranks' tokens as
 *      id -1: a zero row) and summed over tp equals the plain lookup
 *      exactly; the backward leaves each rank exactly the plain table
 *      gradient's rows of its part, nothing for ids it does not hold.
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "engine/model/layers.h"
#include "engine/parallel/comm.h"
#include "engine/parallel/tp_comm.h"
#include "mpi_check.h"

#define NT 23
#define NV 37
#define ND 6


#define MUST(x)                                                                           \
    do {                                                                                  \
        int rc_ = (x);                                                                    \
        if (rc_ < 0) die(#x, rc_);                                                        \
    } while (0)

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    mt_comm_opts co = {.backend = MT_COMM_MPI, .mem = MT_COMM_HOST};
    mt_comm *world;
    MUST(mt_comm_world(&world, &co));
    rank_ = mt_comm_rank(world);
    const int P = mt_comm_size(world);
    mt_backend *be;
    MUST(mt_backend_cpu_create(&be, 1));
    mt_tp *tp;
    MUST(mt_tp_over_comm(&tp, world, be, 0));

    /* the same full problem on every rank */
    float *full = malloc(sizeof(float) * NT * NV), *ref = malloc(sizeof(float) * NT * NV);
    float loss_ref[NT], loss[NT];
    int32_t tgt[NT];
    for (int i = 0; i < NT * NV; i++) full[i] = (float)(12.0 * (2.0 * mt_hash_uniform(7, (uint64_t)i) - 1.0));
    for (int m = 0; m < NT; m++) tgt[m] = m % 7 == 3 ? MT_IGNORE : (int32_t)((m * 11 + 5) % NV);
    const float gs = 0.25f;
    memcpy(ref, full, sizeof(float) * NT * NV);
    MUST(be->xent(be, loss_ref, ref, tgt, NT, NV, MT_IGNORE, gs));

    /* this rank's columns */
    int64_t lo64, n64;
    mt_param_part(NV, P, rank_, &lo64, &n64);
    const int v_lo = (int)lo64, Vl = (int)n64;
    float *part = malloc(sizeof(float) * NT * (Vl > 0 ? Vl : 1));
    for (int m = 0; m < NT; m++)
        memcpy(part + (size_t)m * Vl, full + (size_t)m * NV + v_lo, sizeof(float) * Vl);
    mt_ws ws = {.be = be, .cap = 1 << 16};
    MUST(be->alloc(be, ws.cap, (void **)&ws.base));
    mt_ctx c = {.be = be, .ws = &ws, .tp = tp, .N = NT, .B = 1, .T = NT};
    MUST(mt_tp_xent(&c, loss, part, tgt, NT, Vl, v_lo, gs));

    /* 1. losses */
    double worst_l = 0, worst_g = 0;
    for (int m = 0; m < NT; m++) {
        double d = fabs((double)loss[m] - loss_ref[m]);
        worst_l = fmax(worst_l, d / fmax(1.0, fabs(loss_ref[m])));
        if (tgt[m] == MT_IGNORE) CHECK(loss[m] == 0.0f, "ignored row %d: loss %g", m, loss[m]);
    }
    CHECK(worst_l <= 2e-6, "loss differs from the plain xent by %.3g (relative)", worst_l);
    float hi[NT], lo[NT];
    MUST(mt_comm_all_reduce(world, loss, hi, NT, MT_COMM_F32, MT_COMM_MAX));
    MUST(mt_comm_all_reduce(world, loss, lo, NT, MT_COMM_F32, MT_COMM_MIN));
    CHECK(memcmp(hi, lo, sizeof hi) == 0, "the ranks' losses are not bit-identical");
    /* 2. gradient columns */
    for (int m = 0; m < NT; m++)
        for (int j = 0; j < Vl; j++) {
            const float g = part[(size_t)m * Vl + j], r = ref[(size_t)m * NV + v_lo + j];
            worst_g = fmax(worst_g, fabs((double)g - r));
            if (tgt[m] == MT_IGNORE) CHECK(g == 0.0f, "ignored row %d: gradient %g", m, g);
        }
    CHECK(worst_g <= 1e-6, "gradient differs from the plain xent's by %.3g", worst_g);

    /* 3. embedding */
    float *table = malloc(sizeof(float) * NV * ND), *y_ref = malloc(sizeof(float) * NT * ND);
    float *y = malloc(sizeof(float) * NT * ND), *dy = malloc(sizeof(float) * NT * ND);
    float *dt_ref = calloc((size_t)NV * ND, sizeof(float));
    float *dt = calloc((size_t)(Vl > 0 ? Vl : 1) * ND, sizeof(float));
    int32_t ids[NT], lids[NT];
    for (int i = 0; i < NV * ND; i++) table[i] = (float)mt_hash_normal(9, (uint64_t)i);
    for (int i = 0; i < NT * ND; i++) dy[i] = (float)mt_hash_normal(10, (uint64_t)i);
    for (int m = 0; m < NT; m++) {
        ids[m] = (int32_t)((m * 13 + 2) % NV);
        if (m == 5) ids[m] = ids[4]; /* a repeated id sums its rows */
        lids[m] = ids[m] >= v_lo && ids[m] < v_lo + Vl ? ids[m] - v_lo : -1;
    }
    MUST(be->embedding_fwd(be, y_ref, table, ids, NT, ND));
    MUST(be->embedding_fwd(be, y, table + (size_t)v_lo * ND, lids, NT, ND));
    MUST(mt_tp_sum(&c, y, (int64_t)NT * ND));
    CHECK(memcmp(y, y_ref, sizeof(float) * NT * ND) == 0,
          "vocabulary-parallel embedding differs from the plain lookup");
    MUST(be->embedding_bwd(be, dt_ref, MT_C_F32, dy, ids, NT, ND));
    MUST(be->embedding_bwd(be, dt, MT_C_F32, dy, lids, NT, ND));
    CHECK(memcmp(dt, dt_ref + (size_t)v_lo * ND, sizeof(float) * Vl * ND) == 0,
          "embedding gradient rows [%d, %d) differ from the plain gradient's", v_lo, v_lo + Vl);

    int all_ok = mt_comm_agree(world, failures == 0);
    if (rank_ == 0)
        printf("test_tp_xent: %d rank%s: loss within %.3g (relative), gradient within %.3g of "
               "the plain xent; embedding exact: %s\n", P, P == 1 ? "" : "s", worst_l, worst_g,
               all_ok == 1 ? "ok" : "FAILED");
    be->free(be, ws.base);
    free(full);
    free(ref);
    free(part);
    free(table);
    free(y_ref);
    free(y);
    free(dy);
    free(dt_ref);
    free(dt);
    tp->destroy(tp);
    be->destroy(be);
    mt_comm_destroy(world);
    MPI_Finalize();
    return all_ok == 1 ? 0 : 1;
}
