/* bench_host_copy.c - device <-> host copies of the CUDA backend through
 * pageable memory (malloc, touched) and through the backend's host memory
 * (ops.h host_alloc: page-locked), and what page-locking itself costs: the
 * ceilings of a checkpoint snapshot's stall (device to host into the
 * reused slab) and of a restore's uploads (issues 17 and 23).
 *
 *   bench_host_copy [--gb N]   (default 4: one copy of N GB each way)
 *
 * Timing: wall time of one be->download (it synchronises) or be->upload +
 * be->sync, best of 3 after one warm-up. host_alloc is timed once (GB/s of
 * page-locking; a job pays it once when it reserves its snapshot).
 * Results: tests/bench/RESULTS.md.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/mt_clock.h"
#include "base/mt_status.h"
#include "kernels/ops.h"

#define CK(x)                                                                  \
    do {                                                                       \
        if ((x) < 0) {                                                         \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, mt_errmsg());   \
            exit(2);                                                           \
        }                                                                      \
    } while (0)

/* Best of 3 (after a warm-up) of one copy of n bytes; returns GB/s. */
static double rate(mt_backend *be, int down, void *host, void *dev, size_t n)
{
    double best = 1e30;
    for (int k = 0; k < 4; k++) {
        double t0 = mt_now_s();
        if (down) {
            CK(be->download(be, host, dev, n));
        } else {
            CK(be->upload(be, dev, host, n));
            CK(be->sync(be));
        }
        double t = mt_now_s() - t0;
        if (k > 0 && t < best) best = t;
    }
    return (double)n / 1e9 / best;
}

int main(int argc, char **argv)
{
    double gb = 4;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--gb") && i + 1 < argc) gb = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_host_copy [--gb N]\n");
            return 2;
        }
    }
    if (mt_cuda_device_count() < 1) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    const size_t n = (size_t)(gb * 1e9) / 4096 * 4096;
    mt_backend *be;
    CK(mt_backend_cuda_create(&be, 0, n + ((size_t)6 << 30))); /* + the op scratch */
    void *dev;
    CK(be->alloc(be, n, &dev));
    char *pageable = malloc(n);
    if (!pageable) {
        fprintf(stderr, "out of host memory (%zu MB)\n", n >> 20);
        return 2;
    }
    memset(pageable, 1, n); /* touched: no first-fault cost in the copies */
    void *locked;
    double t0 = mt_now_s();
    CK(be->host_alloc(be, n, &locked));
    const double t_lock = mt_now_s() - t0;
    memset(locked, 1, n);
    printf("bench_host_copy: %.2f GB each way, device 0 (%s backend)\n", (double)n / 1e9, be->name);
    printf("  host_alloc (page-locking)   %6.2f GB/s  (%.2f s for %.2f GB)\n",
           (double)n / 1e9 / t_lock, t_lock, (double)n / 1e9);
    printf("  device to host, pageable    %6.2f GB/s\n", rate(be, 1, pageable, dev, n));
    printf("  device to host, page-locked %6.2f GB/s\n", rate(be, 1, locked, dev, n));
    printf("  host to device, pageable    %6.2f GB/s\n", rate(be, 0, pageable, dev, n));
    printf("  host to device, page-locked %6.2f GB/s\n", rate(be, 0, locked, dev, n));
    be->host_free(be, locked);
    free(pageable);
    be->free(be, dev);
    be->destroy(be);
    return 0;
}
