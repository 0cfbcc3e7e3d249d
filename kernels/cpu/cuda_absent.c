/* cuda_absent.c - the CUDA entry points of a CPU-only build (MT_HAVE_CUDA OFF):
 * creating a CUDA backend fails with MT_ENOTSUP and no device is usable. */
#include <stddef.h>

#include "base/mt_status.h"
#include "kernels/op_profile.h"
#include "kernels/ops.h"

int mt_backend_cuda_create(mt_backend **out, int device, size_t arena_bytes)
{
    (void)arena_bytes;
    if (out) *out = NULL;
    return MT_ERR(MT_ENOTSUP,
                  "CUDA backend (device %d): this build has no CUDA support; reconfigure "
                  "with -DMOETRAIN_CUDA=ON on a machine with nvcc, or use the CPU backend",
                  device);
}

int mt_backend_cuda_create_shared(mt_backend **out, int device, int sharers)
{
    (void)sharers;
    return mt_backend_cuda_create(out, device, 0);
}

int mt_backend_cuda_create_reserve(mt_backend **out, int device, int sharers, size_t reserve)
{
    (void)sharers, (void)reserve;
    return mt_backend_cuda_create(out, device, 0);
}

int mt_cuda_device_count(void) { return 0; }

/* The op profile times the CUDA backend's ops only. */
void mt_op_profile_mark(mt_backend *be, const char *mark)
{
    (void)be;
    (void)mark;
}
