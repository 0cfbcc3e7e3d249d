/* comm_cuda.h - device plumbing shared by the staged and nccl backends
 * (CUDA builds only; private to the comm layer).
 *
 * A device communicator runs its work on a side stream of its own:
 *   begin: the side stream waits for everything enqueued so far on the
 *          compute stream (event `ready`), so the op's inputs are written;
 *   end:   event `done` marks the op's completion on the side stream;
 *   join:  the compute stream waits for `done` (comm.c calls it after
 *          each op unless the caller overlaps).
 * Events are timing-free. An op also makes the communicator's device
 * current for its duration and restores the caller's.
 */
#ifndef MT_COMM_CUDA_H
#define MT_COMM_CUDA_H

#include <cuda_runtime.h>
#include <stddef.h>

#include "engine/parallel/comm_impl.h"

typedef struct mt_comm_side {
    int device;          /* the CUDA device of the communicator */
    int saved_device;    /* the caller's, between begin and end */
    cudaStream_t stream; /* non-blocking side stream */
    cudaEvent_t ready, done;
} mt_comm_side;

/* On the current device. */
int mt_comm_side_init(mt_comm_side *s);
void mt_comm_side_free(mt_comm_side *s);
int mt_comm_side_begin(mt_comm_side *s, void *compute);
/* Records done (when ok) and restores the caller's device; returns rc. */
int mt_comm_side_end(mt_comm_side *s, int rc);
int mt_comm_side_join(mt_comm_side *s, void *compute);
int mt_comm_side_sync(mt_comm_side *s);

/* comm_cast.cu: element-wise casts on `stream` for NCCL's rounded-once
 * sums. widen: f32 dst[n] = src[n] (bf16 when bf16, else e4m3); narrow:
 * dst[n] = round(src[n]) to bf16 (nearest even) or e4m3 (nearest even,
 * saturating at +-448), the conversions of kernels/mt_fp8.h. */
int mt_comm_cuda_widen(float *dst, const void *src, int bf16, size_t n, cudaStream_t stream);
int mt_comm_cuda_narrow(void *dst, int bf16, const float *src, size_t n, cudaStream_t stream);
/* dst[n] (f32) = rows[0] + rows[1] + ... + rows[nrows - 1] summed in f32
 * in row order (rows bf16 when bf16, else f32; row r at rows + r * stride
 * elements): the owner's rank-ordered sum of comm.h's reduce_owned. */
int mt_comm_cuda_sum_rows(float *dst, const void *rows, int bf16, int nrows, size_t stride,
                          size_t n, cudaStream_t stream);

#endif
