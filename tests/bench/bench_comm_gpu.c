/* bench_comm_gpu.c - bandwidth of the comm interface's collectives on device
 * buffers (engine/parallel/comm.h), the ceilings the parallel runtime is
 * measured against (issues 13, 14, 17).
 *
 *   mpirun -np N bench_comm_gpu [--backend nccl|staged] [--max-mb M] [--iters I]
 *
 * For each op and message size (per-rank send bytes, 1 MiB doubling up to
 * M MiB, default 512): a correctness check of the first call (small
 * integers, exact on every backend), 3 warm-up calls, then I timed calls
 * (default 20) between two host barriers after a device sync. Prints the
 * time per call, the algorithm bandwidth (bytes a rank sends / time) and the
 * bus bandwidth with NCCL-tests' factors: all-reduce 2(n-1)/n of the buffer,
 * reduce-scatter and all-gather (n-1)/n of the whole buffer, all-to-all
 * (n-1)/n of a rank's send buffer. The all-to-all is all_to_all_v with equal
 * blocks in BYTE (the FP8 expert payload moves as bytes) - the path the
 * expert dispatcher takes.
 * Exit 0, 1 on a wrong result, 77 without enough GPUs (skipped).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>
#include <mpi.h>

#include "base/mt_status.h"
#include "engine/parallel/comm.h"

#define CK(x)                                                                            \
    do {                                                                                 \
        int rc_ = (x);                                                                   \
        if (rc_ != MT_OK) {                                                              \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, mt_errmsg()); \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                \
        }                                                                                \
    } while (0)
#define CUDA(x)                                                                          \
    do {                                                                                 \
        cudaError_t e_ = (x);                                                            \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,                   \
                    cudaGetErrorString(e_));                                             \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                \
        }                                                                                \
    } while (0)

typedef enum { OP_ALL_REDUCE, OP_REDUCE_SCATTER, OP_ALL_GATHER, OP_ALL_TO_ALL, OP_COUNT } bench_op;
static const char *const op_names[OP_COUNT] = {"all_reduce f32", "reduce_scatter f32",
                                              "all_gather byte", "all_to_all_v byte"};

typedef struct bench {
    mt_comm *c;
    int rank, size;
    void *send, *recv; /* device, max_bytes * size each */
    size_t *cnt, *dsp; /* host [size]: all_to_all_v counts / displacements */
} bench;

/* One call of `op` where each rank sends `bytes`. */
static void bench_call(bench *b, bench_op op, size_t bytes)
{
    int n = b->size;
    switch (op) {
    case OP_ALL_REDUCE:
        CK(mt_comm_all_reduce(b->c, b->send, b->recv, bytes / 4, MT_COMM_F32, MT_COMM_SUM));
        break;
    case OP_REDUCE_SCATTER: /* send [n * count]: the whole buffer is `bytes` */
        CK(mt_comm_reduce_scatter(b->c, b->send, b->recv, bytes / 4 / (size_t)n, MT_COMM_F32,
                                  MT_COMM_SUM));
        break;
    case OP_ALL_GATHER: /* each rank contributes bytes / n, every rank gets `bytes` */
        CK(mt_comm_all_gather(b->c, b->send, b->recv, bytes / (size_t)n, MT_COMM_BYTE));
        break;
    case OP_ALL_TO_ALL:
        for (int p = 0; p < n; p++) {
            b->cnt[p] = bytes / (size_t)n;
            b->dsp[p] = (size_t)p * (bytes / (size_t)n);
        }
        CK(mt_comm_all_to_all_v(b->c, b->send, b->cnt, b->dsp, b->recv, b->cnt, b->dsp,
                                MT_COMM_BYTE));
        break;
    default:
        break;
    }
}

/* Bus bandwidth factor of `op` on n ranks (NCCL-tests' convention). */
static double bus_factor(bench_op op, int n)
{
    return op == OP_ALL_REDUCE ? 2.0 * (n - 1) / n : (double)(n - 1) / n;
}

/* The first call's result on small integers: exact on every backend. Returns
 * the number of wrong elements on this rank. */
static long bench_check(bench *b, bench_op op, size_t bytes)
{
    int n = b->size, r = b->rank;
    size_t nb = bytes / (size_t)n; /* a block, in bytes */
    unsigned char *h = malloc(bytes);
    long bad = 0;
    if (op == OP_ALL_REDUCE || op == OP_REDUCE_SCATTER) {
        float *f = (float *)h;
        for (size_t i = 0; i < bytes / 4; i++) f[i] = (float)((i * 7 + (size_t)r * 3) % 64);
    } else {
        for (size_t i = 0; i < bytes; i++) h[i] = (unsigned char)(i * 13 + (size_t)r * 101);
    }
    CUDA(cudaMemcpy(b->send, h, bytes, cudaMemcpyHostToDevice));
    CUDA(cudaMemset(b->recv, 0, bytes));
    CUDA(cudaDeviceSynchronize());
    bench_call(b, op, bytes);
    CK(mt_comm_sync(b->c));
    CUDA(cudaDeviceSynchronize());
    size_t out_bytes = op == OP_REDUCE_SCATTER ? nb : bytes;
    CUDA(cudaMemcpy(h, b->recv, out_bytes, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < out_bytes; i++) {
        if (op == OP_ALL_REDUCE || op == OP_REDUCE_SCATTER) {
            if (i % 4) continue;
            size_t e = i / 4 + (op == OP_REDUCE_SCATTER ? (size_t)r * (nb / 4) : 0);
            float want = 0;
            for (int q = 0; q < n; q++) want += (float)((e * 7 + (size_t)q * 3) % 64);
            float got;
            memcpy(&got, h + i, 4);
            bad += got != want;
        } else if (op == OP_ALL_GATHER) { /* block q = rank q's first nb bytes */
            size_t q = i / nb, j = i % nb;
            bad += h[i] != (unsigned char)(j * 13 + q * 101);
        } else { /* block q = rank q's block r */
            size_t q = i / nb, j = i % nb;
            bad += h[i] != (unsigned char)(((size_t)r * nb + j) * 13 + q * 101);
        }
    }
    free(h);
    return bad;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    mt_comm_backend backend = MT_COMM_NCCL;
    size_t max_mb = 512;
    int iters = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) {
            if (mt_comm_backend_parse(argv[++i], &backend) != MT_OK) {
                fprintf(stderr, "%s\n", mt_errmsg());
                return 2;
            }
        } else if (!strcmp(argv[i], "--max-mb") && i + 1 < argc) max_mb = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_comm_gpu [--backend nccl|staged] [--max-mb M] [--iters I]\n");
            return 2;
        }
    }
    if (max_mb < 1 || iters < 1) {
        fprintf(stderr, "bench_comm_gpu: --max-mb and --iters must be >= 1\n");
        return 2;
    }
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    int rank, size, ndev = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (cudaGetDeviceCount(&ndev) != cudaSuccess) ndev = 0;
    int need = backend == MT_COMM_NCCL ? size : 1;
    if (ndev < need || size < 2) {
        if (rank == 0)
            printf("bench_comm_gpu: %d ranks, %d GPUs (backend %s needs %d GPUs, 2+ ranks): skipped\n",
                   size, ndev, mt_comm_backend_name(backend), need);
        MPI_Finalize();
        return 77;
    }
    CUDA(cudaSetDevice(backend == MT_COMM_STAGED ? 0 : rank % ndev));
    bench b = {.rank = rank, .size = size};
    mt_comm_opts o = {backend, MT_COMM_DEVICE, 0};
    CK(mt_comm_world(&b.c, &o));
    /* sizes are multiples of 4 * n so every block is whole f32 elements */
    size_t max_bytes = max_mb << 20;
    CUDA(cudaMalloc(&b.send, max_bytes));
    CUDA(cudaMalloc(&b.recv, max_bytes));
    b.cnt = calloc((size_t)size, sizeof(size_t));
    b.dsp = calloc((size_t)size, sizeof(size_t));
    if (rank == 0) {
        struct cudaDeviceProp p;
        CUDA(cudaGetDeviceProperties(&p, 0));
        printf("bench_comm_gpu: backend %s, %d ranks, %s, %d timed calls per size\n",
               mt_comm_backend_name(mt_comm_backend_of(b.c)), size, p.name, iters);
        printf("%-20s %10s %10s %10s %10s %s\n", "op", "MiB/rank", "us/call", "algbw GB/s",
               "busbw GB/s", "check");
    }
    long bad_total = 0;
    for (int op = 0; op < OP_COUNT; op++) {
        for (size_t mb = 1; mb <= max_mb; mb *= 2) {
            size_t bytes = (mb << 20) / (4 * (size_t)size) * (4 * (size_t)size);
            long bad = bench_check(&b, (bench_op)op, bytes);
            for (int w = 0; w < 3; w++) bench_call(&b, (bench_op)op, bytes);
            CK(mt_comm_sync(b.c));
            CUDA(cudaDeviceSynchronize());
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            for (int it = 0; it < iters; it++) bench_call(&b, (bench_op)op, bytes);
            CK(mt_comm_sync(b.c));
            CUDA(cudaDeviceSynchronize());
            MPI_Barrier(MPI_COMM_WORLD);
            double dt = (MPI_Wtime() - t0) / iters;
            long bad_all = 0;
            MPI_Allreduce(&bad, &bad_all, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
            bad_total += bad_all;
            double alg = (double)bytes / dt / 1e9;
            if (rank == 0)
                printf("%-20s %10.1f %10.1f %10.1f %10.1f %s\n", op_names[op],
                       (double)bytes / (1 << 20), dt * 1e6, alg, alg * bus_factor((bench_op)op, size),
                       bad_all ? "WRONG" : "ok");
        }
    }
    if (rank == 0) printf("bench_comm_gpu: %s\n", bad_total ? "WRONG RESULTS" : "all results checked");
    cudaFree(b.send);
    cudaFree(b.recv);
    free(b.cnt);
    free(b.dsp);
    mt_comm_destroy(b.c);
    MPI_Finalize();
    return bad_total ? 1 : 0;
}
