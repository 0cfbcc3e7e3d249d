/* cuda_attn.h - C-visible helpers of the CUDA attention ops (cuda_attn.cu)
 * for tests, benchmarks and the backend's scratch sizing.
 *
 * Path selection (read at every attn_fwd / attn_bwd call):
 *   MOETRAIN_ATTN=own    the own tiled kernels only
 *   MOETRAIN_ATTN=cudnn  cuDNN only; a shape or build cuDNN cannot serve is an error
 *   unset / auto         cuDNN where it builds and fits in scratch, else the own
 *                        kernels (one warning per shape)
 *   MOETRAIN_ATTN_DETERMINISTIC=0 lets the cuDNN backward accumulate dQ with
 *   atomics (fp32 dQ_accum, much smaller workspace); default 1: the deterministic
 *   cuDNN backward, whose workspace holds dP (about B*H*T*T*2 bytes).
 */
#ifndef MT_CUDA_ATTN_H
#define MT_CUDA_ATTN_H

#include <stddef.h>

#include "kernels/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Estimate of the scratch (cuda_scratch) bytes one attn_fwd + attn_bwd call
 * of this shape needs on the cuDNN path in the current determinism mode
 * (the own kernels need B*H*T*4 bytes). The exact number comes from
 * cuda_attn_plan_bytes once a backend exists. */
size_t cuda_attn_scratch_bytes(int B, int T, int H, int Dqk, int Dv);

/* Builds (or finds) the cuDNN plan of attn_fwd (bwd = 0) or attn_bwd (bwd = 1)
 * for this shape and scale, in the current determinism mode. need: scratch
 * bytes its execution takes (aux tensors + engine workspace); have: the
 * backend's scratch capacity. Returns MT_OK, or the build error (message in
 * mt_errmsg) when cuDNN cannot serve the shape. */
int cuda_attn_plan_bytes(mt_backend *be, int bwd, int B, int T, int H, int Dqk, int Dv,
                         float scale, size_t *need, size_t *have);

/* The path the last attn_fwd / attn_bwd call took: "cudnn", "own", or
 * "own (why cuDNN was not used)". Valid until the next attention call. */
const char *cuda_attn_last_path(mt_backend *be);

/* The cudaStream_t every op of this backend runs on (for cudaEvent timing). */
void *cuda_attn_stream(mt_backend *be);

#ifdef __cplusplus
}
#endif

#endif
