/* op_profile.h - the per-op profile of a training step (issue 18).
 *
 * MOETRAIN_OP_PROFILE=S (CUDA backend): from the S-th step on (1-based;
 * "1" or any non-number: from the first), every op of the backend is timed
 * on the device with a pair of CUDA events on the main stream, and the
 * times are summed per (phase, op, shape). When the backend is destroyed a
 * table is logged: per phase and per op its milliseconds a step, its share
 * of the step (the step's own device time from its first to its last op),
 * its achieved TFLOPS or GB/s and the fraction of the ceilings measured on
 * the same device just before (a device copy, a BF16 and an FP8 GEMM of
 * 8192^3). MOETRAIN_OP_PROFILE_OUT=FILE also writes the full table there as
 * tab-separated values. Profiling adds one event pair per op and one
 * synchronisation a step; the step times it reports are its own.
 *
 * Callers name what the following ops belong to with marks: "step" begins
 * a step, "end" ends it (the caller has synchronised), any other name is a
 * phase ("fwd.attn", "bwd.moe", "optim"). A string literal: it is kept, not
 * copied. On other backends and when not profiling a mark does nothing.
 */
#ifndef MT_OP_PROFILE_H
#define MT_OP_PROFILE_H

#include "kernels/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

void mt_op_profile_mark(mt_backend *be, const char *mark);

#ifdef __cplusplus
}
#endif

#endif
