/* grad_buckets.h - the data-parallel gradient reduction of ZeRO-1, in
 * buckets overlapped with the backward (engine/train internal; trainer.h
 * states the rules).
 *
 * The parameters with gradients are grouped into buckets of about
 * parallel.bucket_mb MB of gradient (0: one bucket per layer) in the order
 * the backward finishes them (mt_model_grad_ready): the final norm and
 * head (their last use is the last micro-batch's forward, MTP heads
 * included), MTP modules last to first, decoder layers last to first,
 * then the embedding (final only at the end of the backward). Dense parameters
 * and routed experts under expert or tensor parallelism are in separate
 * buckets: dense over the dp group (under tp: the dp group of this tp
 * rank), experts over the edp group. In the step's last
 * micro-batch the model calls mt_grad_buckets_layer_done after each
 * layer's backward; every bucket whose parameters are then final starts
 * its reduction into the owners (mt_comm_reduce_owned_start, wire type
 * parallel.grad_reduce) and the ones in flight are given MPI progress.
 * mt_grad_buckets_finish starts what is left and waits for all: each rank
 * then holds the summed gradient of the parameters it owns (the rest of
 * its gradient buffer is its own contribution, unused). After the
 * optimizer, mt_grad_buckets_share gathers the owners' new compute copies
 * (FP8 E4M3 weights, transposes and 128x128 scales, or BF16 / F32) bucket
 * by bucket (mt_comm_gather_owned_start).
 *
 * Buckets start in the same order on every rank of their group (the order
 * is a function of the layout and the parameter table alone; under tp the
 * dense buckets differ between the tp ranks, whose dp groups differ, and
 * the expert buckets, over edp across the tp ranks, do not: experts are
 * not split).
 *
 * Device groups (CUDA) are ordered with the backend's kernels on the
 * device when their compute stream is the backend's (the runtime sets it:
 * mt_comm_set_stream(g, be->stream(be))): a bucket starts after the
 * kernels that wrote its gradients, runs on the group's side stream beside
 * the rest of the backward, and the optimizer's kernels wait for it
 * (mt_comm_wait joins the backend's stream); the host waits only where it
 * reads a result (the norm's download). Otherwise (MT_COMM_HOST_SYNC=1,
 * or groups left on the default stream) the host fences each op:
 * be->sync before, mt_comm_sync after.
 */
#ifndef MT_GRAD_BUCKETS_H
#define MT_GRAD_BUCKETS_H

#include <stddef.h>

#include "engine/model/model.h"
#include "engine/parallel/comm.h"
#include "engine/train/jobspec.h"

typedef struct mt_grad_bucket {
    mt_comm *group;      /* dp, or edp for routed experts under ep or tp */
    int ready;           /* the model's layer after whose backward it is final (-1: the end) */
    int n_params;
    int *params;         /* [n_params] model parameter indices */
    mt_comm_seg *gsegs;  /* [n_params] gradients (f32 elements) */
    mt_comm_seg *wsegs;  /* [n_wsegs] compute copies (bytes) */
    int n_wsegs;
    size_t grad_bytes;   /* f32 bytes of its gradients */
    mt_comm_req *req;
} mt_grad_bucket;

typedef struct mt_grad_buckets {
    int n;
    mt_grad_bucket *b;
    mt_comm_dtype wire;  /* F32 or BF16 */
    int next;            /* first bucket not started this step */
    int armed;           /* layer_done starts buckets (the step's last micro-batch) */
    int overlap;         /* 0: every bucket starts in finish (MOETRAIN_GRAD_OVERLAP=0, for
                            measuring what the overlap hides) */
    mt_backend *be;      /* the model's backend */
    int host_wait;       /* device groups whose compute stream is not the backend's
                            (be->stream; MT_COMM_HOST_SYNC=1, comm.h): the host waits for
                            the backend before an op reads what it wrote, and for the comm
                            before the backend reads what an op wrote. 0: ordered on the
                            device by the groups' stream (or host groups) */
    double wait_ms;      /* the last finish: time spent waiting after the backward (on
                            stream-ordered device groups only the host's part: the device
                            waits later, in the first download after the reduction) */
    double t_finish_ms, t_done_ms; /* the last finish's start and end (CLOCK_MONOTONIC, ms:
                                      comparable between the ranks of one host) */
    int started_early;   /* the last step: buckets started during the backward */
} mt_grad_buckets;

/* Buckets over the model's parameters: owner[i] the owner's rank in the
 * parameter's group (-1: none, e.g. the router bias), dp the dense group,
 * edp the experts' when expert_split (parallel.ep > 1 or parallel.tp > 1;
 * a NULL group: one rank, nothing to reduce). */
int mt_grad_buckets_build(mt_grad_buckets *gb, const mt_model *m, const int *owner, mt_comm *dp,
                          mt_comm *edp, int expert_split, const mt_jobspec *j);
void mt_grad_buckets_free(mt_grad_buckets *gb);

/* The model's on_layer_grads hook (arg: the mt_grad_buckets). */
int mt_grad_buckets_layer_done(void *arg, int layer);

/* Arms the hook for the step's last micro-batch (call before its backward). */
void mt_grad_buckets_arm(mt_grad_buckets *gb);

/* Starts the buckets not started yet and waits for every one. */
int mt_grad_buckets_finish(mt_grad_buckets *gb);

/* The owners' compute copies to every rank of each bucket's group. */
int mt_grad_buckets_share(mt_grad_buckets *gb);

/* Bytes of parameter i's compute copies (what share moves for it), and its
 * pieces: at most 4 (q, qt, s, st) or 1 (w). */
int mt_param_copy_segs(const mt_model *m, int i, mt_comm_seg *out, int owner);

/* Sum of squares of the gradients of the parameters with keep[i] (this
 * rank's owned ones: after finish their gradients are the group's sums),
 * f32 per run of adjacent parameters, added in f64 in table order.
 * scratch: f32 [1] of the backend. */
int mt_grad_owned_sumsq(mt_backend *be, const mt_model *m, const unsigned char *keep,
                        float *scratch, double *out);

#endif
