/* comm_impl.h - what a comm backend implements (private to the comm layer:
 * engine/parallel/comm*.c).
 *
 * A backend is a table of functions over its communicators. The public
 * wrappers in comm.c check the arguments (dtype, op, root, peers, counts
 * against the size), handle the trivial cases every backend shares (count
 * 0 of a reduction, a world of 1 is not special-cased: local does it), and
 * prefix any error with the communicator, op and counts; a backend adds
 * the peer and the library's message. Arguments reach a backend valid.
 * Counts and displacements are elements, as in comm.h.
 */
#ifndef MT_COMM_IMPL_H
#define MT_COMM_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "engine/parallel/comm.h"

typedef struct mt_comm_iface {
    int (*all_reduce)(mt_comm *c, const void *send, void *recv, size_t count, mt_comm_dtype dt,
                      mt_comm_op op);
    int (*reduce_scatter)(mt_comm *c, const void *send, void *recv, size_t count,
                          mt_comm_dtype dt, mt_comm_op op);
    /* root >= 0: gather_v; root = -1: all_gather_v (and all_gather, with
     * equal counts and displs[r] = r * count) */
    int (*gather_v)(mt_comm *c, const void *send, size_t send_count, void *recv,
                    const size_t *counts, const size_t *displs, mt_comm_dtype dt, int root);
    int (*all_to_all_v)(mt_comm *c, const void *send, const size_t *send_counts,
                        const size_t *send_displs, void *recv, const size_t *recv_counts,
                        const size_t *recv_displs, mt_comm_dtype dt);
    int (*broadcast)(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int root);
    /* dst / src MT_COMM_NO_PEER: that direction absent (send and recv come here) */
    int (*sendrecv)(mt_comm *c, const void *send, size_t send_count, int dst, void *recv,
                    size_t recv_count, int src, mt_comm_dtype dt);
    /* pipeline messages (tag >= 0): isend copies buf out before it returns
     * and completes in the background; wait_sends waits for every isend;
     * recv_tag blocks. NULL: the backend has none (comm.c refuses). */
    int (*isend)(mt_comm *c, const void *buf, size_t count, mt_comm_dtype dt, int peer, int tag);
    int (*recv_tag)(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int peer, int tag);
    int (*wait_sends)(mt_comm *c);
    /* collective, once per communicator, before the first isend / recv_tag;
     * NULL: nothing to prepare */
    int (*pipe_open)(mt_comm *c);
    int (*barrier)(mt_comm *c);
    /* *out NULL for MT_COMM_NO_COLOR */
    int (*split)(mt_comm *c, int color, int key, mt_comm **out);
    void (*destroy)(mt_comm *c);
    /* nonblocking owner collectives (comm.h): wire F32 / BF16 for reduce,
     * BYTE for gather. Arguments checked; n > 0. */
    int (*reduce_owned_start)(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_dtype wire,
                              mt_comm_req **req);
    int (*gather_owned_start)(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_req **req);
    /* all_to_all_v started (comm.h); arguments checked. NULL: comm.c runs
     * the blocking op and returns no request (local). */
    int (*all_to_all_v_start)(mt_comm *c, const void *send, const size_t *send_counts,
                              const size_t *send_displs, void *recv, const size_t *recv_counts,
                              const size_t *recv_displs, mt_comm_dtype dt, mt_comm_req **req);
    /* device backends; NULL on host backends */
    int (*join)(mt_comm *c);  /* compute stream waits for the ops issued so far */
    int (*sync)(mt_comm *c);  /* the host waits for them */
} mt_comm_iface;

struct mt_comm {
    const mt_comm_iface *iface;
    mt_comm_backend backend;
    mt_comm_mem mem;
    int rank, size;
    int rank_ordered;    /* float sums in rank order */
    size_t chunk_bytes;  /* mpi: largest message per MPI call */
    mt_comm *host;       /* same group, host buffers: self, or owned */
    void *stream;        /* device: the compute stream (cudaStream_t), NULL default */
    int overlap;         /* device: ops do not join the compute stream */
    int pipe_open;       /* mt_comm_pipe_open has run */
    void *ctx;           /* backend state */
};

/* Every backend's request starts with this header; test / wait / free
 * come from the backend that made it. */
struct mt_comm_req {
    mt_comm *c;
    char what[80];  /* the op, for error messages */
    int (*test)(mt_comm_req *r, int *done);
    int (*wait)(mt_comm_req *r);   /* completes; does not free */
    void (*free)(mt_comm_req *r);
};

/* The packing every backend shares for an owner op (comm.c): the segments
 * owned by rank o, in list order, form o's pack of total[o] elements;
 * segment k sits at pos[k] in its owner's pack. Reduce: each rank sends
 * owner o its contribution to o's pack; gather: each owner sends its pack
 * to every rank. */
typedef struct mt_comm_owned_plan {
    int n;            /* segments */
    int size;
    size_t *total;    /* [size]: elements owned by each rank */
    size_t *pos;      /* [n]: element offset of segment k within its owner's pack */
} mt_comm_owned_plan;
int mt_comm_owned_plan_make(mt_comm_owned_plan *p, const mt_comm_seg *segs, int n, int size);
void mt_comm_owned_plan_free(mt_comm_owned_plan *p);

/* Backends. */
int mt_comm_local_create(mt_comm **out, mt_comm_mem mem);
/* Over the MPI communicator *mpi_comm (an MPI_Comm, duplicated). */
int mt_comm_mpi_create(mt_comm **out, const void *mpi_comm, size_t chunk_bytes);
/* A device communicator over the group of `host` (an mpi communicator,
 * owned from then on, also on failure). */
int mt_comm_staged_create(mt_comm **out, mt_comm *host);
int mt_comm_nccl_create(mt_comm **out, mt_comm *host);
/* 1 when each rank of `host` has a CUDA device of its own (no two ranks of
 * one node on the same device), 0 otherwise (collective over host). */
int mt_comm_nccl_distinct_gpus(mt_comm *host, int *distinct);

/* The MPI_Comm of an mpi communicator (mt_comm_mpi.c), as void *. */
const void *mt_comm_mpi_handle(const mt_comm *c);
/* MPI_Initialized, and the size of MPI_COMM_WORLD (1 when not initialised). */
int mt_comm_mpi_world_size(int *initialised);

/* Device memory helpers (comm_cuda.c; in CPU-only builds comm_no_cuda.c:
 * built 0, the others ENOTSUP). stream: a cudaStream_t. */
int mt_comm_cuda_built(void);
/* cudaMemcpyAsync(cudaMemcpyDefault) on stream; bytes 0 or dst == src: nothing. */
int mt_comm_cuda_copy(void *dst, const void *src, size_t bytes, void *stream);
int mt_comm_cuda_stream_sync(void *stream);

/* Rank-ordered reduction (comm_reduce.c), the arithmetic of comm.h:
 * acc [count] in the accumulation type (F64 for F64, F32 for F32, BF16 and
 * E4M3, the type itself for integers). */
size_t mt_comm_acc_size(mt_comm_dtype dt);
/* acc = x (first) or acc = acc op x, element-wise. */
void mt_comm_acc_load(void *acc, const void *x, size_t count, mt_comm_dtype dt);
void mt_comm_acc_add(void *acc, const void *x, size_t count, mt_comm_dtype dt, mt_comm_op op);
/* out = acc rounded once to dt. */
void mt_comm_acc_store(void *out, const void *acc, size_t count, mt_comm_dtype dt);

/* Balanced split of count into n blocks: block j = [off(j), off(j + 1)). */
static inline size_t mt_comm_block_off(size_t count, int n, int j)
{
    size_t q = count / (size_t)n, r = count % (size_t)n;
    return q * (size_t)j + ((size_t)j < r ? (size_t)j : r);
}

/* Fills the common fields of a new communicator. */
static inline void mt_comm_init_fields(mt_comm *c, const mt_comm_iface *iface, mt_comm_backend b,
                                       mt_comm_mem mem, int rank, int size)
{
    c->iface = iface;
    c->backend = b;
    c->mem = mem;
    c->rank = rank;
    c->size = size;
    c->rank_ordered = b != MT_COMM_NCCL;
    c->chunk_bytes = 0;
    c->host = c;
    c->stream = NULL;
    c->overlap = 0;
    c->pipe_open = 0;
    c->ctx = NULL;
}

#endif
