/* comm.h - the one interface every collective of the program goes through.
 *
 * A communicator (mt_comm) is one process group: `size` ranks numbered
 * 0..size-1, each process holding its own handle. Behind it sits a backend,
 * a table of functions (engine/parallel/comm_impl.h):
 *   local   a world of 1: every op is a copy (single-rank runs, tests);
 *           host or device buffers
 *   mpi     host buffers, over MPI (the CPU backend)
 *   staged  device buffers copied through pinned host memory and sent by
 *           the mpi backend: lets several ranks share one GPU (CUDA builds)
 *   nccl    device buffers, NCCL (CUDA builds)
 * Every op is collective over the communicator unless it says otherwise:
 * all ranks call it in the same order with matching arguments.
 *
 * Units: counts and displacements are in ELEMENTS of the op's dtype
 * (size_t: no INT_MAX limit; the mpi backend cuts large messages into
 * pieces). Buffers are host or device memory as mt_comm_mem(c) says.
 * Aliasing: buffers must not overlap, except the in-place forms named per
 * op.
 *
 * Reductions (SUM, MAX, MIN) on I32, I64, F32, F64, BF16, E4M3; BYTE is
 * for moving data only. Rules every backend keeps:
 *  - the result is the same, bit for bit, on every rank of the group;
 *  - I32 / I64 sums wrap in two's complement; MAX / MIN are exact;
 *  - BF16 and E4M3 are accumulated in F32 and rounded once at the end
 *    (round to nearest even; E4M3 saturates to +-448), never per hop;
 *  - so integer results, and float results whose every partial sum is
 *    exact (small integers, dyadic values of small range), are the same
 *    on every backend, whatever order it adds in.
 * Rank order: on local, mpi and staged (mt_comm_rank_ordered(c) = 1) a
 * floating-point sum is the sequential sum x_0 + x_1 + ... + x_{n-1} in
 * rank order in the accumulation type (F32 for BF16, E4M3 and F32; F64 for
 * F64), rounded once: results are reproducible from the inputs alone,
 * whatever MPI's algorithm choice. nccl sums in NCCL's ring / tree order
 * (fast, still the same on every rank) and returns 0.
 * NaN: sums propagate it; MAX / MIN with NaN inputs are unspecified.
 *
 * Device communicators (mem = MT_COMM_DEVICE) are stream-ordered like a
 * kernel launch on the compute stream set by mt_comm_set_stream (default:
 * the legacy default stream): an op starts after all work enqueued on that
 * stream before the call, runs on the communicator's own stream, and
 * - default: work enqueued on the compute stream after the call sees its
 *   result (the compute stream waits for the op's completion event; the
 *   host does not wait, except in the staged backend, which blocks while
 *   MPI moves the data);
 * - with mt_comm_set_overlap(c, 1): the compute stream does not wait; the
 *   caller enqueues independent work and calls mt_comm_join(c) before the
 *   compute stream touches the op's buffers.
 * Host communicators complete every op before it returns.
 *
 * Errors: every function returns MT_OK or a negative MT_E* code with a
 * message naming the communicator, the op, its counts and, for a failed
 * message, the peer ("comm mpi 1/4 all_to_all_v(bf16, 3 peers, 1040
 * elements sent): MPI_Irecv from rank 2: ..."). A failed collective leaves
 * the group in an unknown state: the job should end (mt_comm_agree).
 *
 * Threads: one thread uses a communicator at a time. MPI must have been
 * initialised by the program's main (MPI_Init_thread) before an mpi,
 * staged or nccl communicator is made.
 */
#ifndef MT_COMM_H
#define MT_COMM_H

#include <stddef.h>
#include <stdint.h>

typedef struct mt_comm mt_comm;

typedef enum {
    MT_COMM_BYTE = 0, /* opaque bytes: moved, never reduced */
    MT_COMM_I32,
    MT_COMM_I64,
    MT_COMM_F32,
    MT_COMM_F64,
    MT_COMM_BF16,     /* uint16_t bits */
    MT_COMM_E4M3,     /* uint8_t bits, OCP E4M3FN (kernels/mt_fp8.h) */
    MT_COMM_DTYPE_COUNT
} mt_comm_dtype;
_Static_assert(MT_COMM_DTYPE_COUNT == 7, "update mt_comm_dtype_size and _name");

typedef enum { MT_COMM_SUM = 0, MT_COMM_MAX, MT_COMM_MIN, MT_COMM_OP_COUNT } mt_comm_op;
_Static_assert(MT_COMM_OP_COUNT == 3, "update mt_comm_op_name");

typedef enum { MT_COMM_HOST = 0, MT_COMM_DEVICE } mt_comm_mem;

typedef enum {
    MT_COMM_AUTO = 0,
    MT_COMM_LOCAL,
    MT_COMM_MPI,
    MT_COMM_STAGED,
    MT_COMM_NCCL,
    MT_COMM_BACKEND_COUNT
} mt_comm_backend;
_Static_assert(MT_COMM_BACKEND_COUNT == 5, "update mt_comm_backend_name and _parse");

/* split: a rank that passes this color gets no new communicator (NULL). */
#define MT_COMM_NO_COLOR (-1)
/* sendrecv: no message in this direction. */
#define MT_COMM_NO_PEER (-1)

size_t mt_comm_dtype_size(mt_comm_dtype dt);      /* bytes per element; 0 if invalid */
const char *mt_comm_dtype_name(mt_comm_dtype dt); /* "bf16" */
const char *mt_comm_op_name(mt_comm_op op);       /* "sum" */
const char *mt_comm_backend_name(mt_comm_backend b);

/* "auto" | "nccl" | "mpi" | "staged" | "local" (the job's parallel.comm).
 * Errors name the text and the choices. */
int mt_comm_backend_parse(const char *text, mt_comm_backend *out);

typedef struct mt_comm_opts {
    mt_comm_backend backend; /* MT_COMM_AUTO: see mt_comm_world */
    mt_comm_mem mem;         /* the buffers ops take; local may have either,
                                mpi only host, staged / nccl only device */
    size_t chunk_bytes;      /* mpi (and staged through it): largest message
                                handed to one MPI call; 0 = INT_MAX rounded
                                down to 8. Tests set it small to exercise the
                                chunking of >2 GiB messages */
} mt_comm_opts;

/* The communicator of every process (collective over MPI_COMM_WORLD when
 * MPI is initialised). AUTO picks: host memory: mpi, or local where MPI is
 * not initialised; device memory: local for one rank, nccl when every rank
 * has a GPU of its own, staged when ranks share a GPU (NCCL refuses
 * duplicate GPUs). Device communicators use the CUDA device current at the
 * call. Errors: ENOTSUP for a GPU backend in a CPU-only build, EINVAL for a
 * backend that cannot hold `mem` or local on more than one rank. */
int mt_comm_world(mt_comm **out, const mt_comm_opts *o);

/* New communicators from c: ranks with the same color form one, ordered by
 * (key, rank in c). MT_COMM_NO_COLOR gives *out = NULL. Same backend,
 * memory and options as c. Collective over c. */
int mt_comm_split(mt_comm *c, int color, int key, mt_comm **out);

/* Collective over c (all ranks, after their last op); NULL is a no-op. */
void mt_comm_destroy(mt_comm *c);

int mt_comm_rank(const mt_comm *c);
int mt_comm_size(const mt_comm *c);
mt_comm_mem mt_comm_mem_kind(const mt_comm *c);
mt_comm_backend mt_comm_backend_of(const mt_comm *c);
/* 1 when float sums are computed in rank order (see above). */
int mt_comm_rank_ordered(const mt_comm *c);

/* The same group with host buffers: c itself for a host communicator, its
 * MPI (or local) companion for a device one. For control-path scalars
 * (flags, losses, counters) on any communicator. Owned by c. */
mt_comm *mt_comm_host(mt_comm *c);

/* ---- collectives ------------------------------------------------------------------- */

/* recv[i] = op over ranks of send[i], i < count. In place: send == recv. */
int mt_comm_all_reduce(mt_comm *c, const void *send, void *recv, size_t count, mt_comm_dtype dt,
                       mt_comm_op op);

/* Equal blocks: send [size * count], recv [count]; rank r gets
 * recv[i] = op over ranks of send[r * count + i]. In place: recv ==
 * send + rank * count elements (NCCL's convention). */
int mt_comm_reduce_scatter(mt_comm *c, const void *send, void *recv, size_t count,
                           mt_comm_dtype dt, mt_comm_op op);

/* Equal blocks: send [count], recv [size * count]; recv[r * count + i] =
 * send of rank r. In place: send == recv + rank * count elements. */
int mt_comm_all_gather(mt_comm *c, const void *send, void *recv, size_t count, mt_comm_dtype dt);

/* Blocks of rank-dependent sizes: rank r sends counts[r] elements, which
 * land at recv + displs[r] on every rank (all_gather_v) or on root only
 * (gather_v; recv, counts and displs are read on root only, counts may be
 * NULL elsewhere). send_count must equal counts[rank]. Bytes of recv
 * outside the blocks are left untouched. */
int mt_comm_all_gather_v(mt_comm *c, const void *send, size_t send_count, void *recv,
                         const size_t *counts, const size_t *displs, mt_comm_dtype dt);
int mt_comm_gather_v(mt_comm *c, const void *send, size_t send_count, void *recv,
                     const size_t *counts, const size_t *displs, mt_comm_dtype dt, int root);

/* Personalised exchange: send_counts[p] elements at send + send_displs[p]
 * go to peer p, which receives them at recv + recv_displs[rank] with
 * recv_counts[rank] == that count (arrays [size]; exchange the counts
 * first, e.g. by an all_to_all_v of one I64 per peer). Bytes of recv
 * outside the blocks are left untouched. */
int mt_comm_all_to_all_v(mt_comm *c, const void *send, const size_t *send_counts,
                         const size_t *send_displs, void *recv, const size_t *recv_counts,
                         const size_t *recv_displs, mt_comm_dtype dt);

/* buf [count] of root to every rank. */
int mt_comm_broadcast(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int root);

/* Point to point (not collective): blocking; messages between two ranks
 * arrive in the order sent; counts must match. send / recv to one's own
 * rank are refused (they would wait for each other): use sendrecv, which
 * sends to `dst` and receives from `src` at once (either may be
 * MT_COMM_NO_PEER, either may be the own rank) - the deadlock-free form
 * for pipeline exchanges where both sides send. */
int mt_comm_send(mt_comm *c, const void *buf, size_t count, mt_comm_dtype dt, int peer);
int mt_comm_recv(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int peer);
int mt_comm_sendrecv(mt_comm *c, const void *send, size_t send_count, int dst, void *recv,
                     size_t recv_count, int src, mt_comm_dtype dt);

/* Pipeline messages (engine/train/pipeline.c): matched by (peer, tag), tag
 * in [0, MT_COMM_MAX_TAG). mt_comm_pipe_open(c) first: collective over c,
 * once (later calls do nothing); isend / recv_tag on a communicator not
 * opened are refused (MT_ESTATE). mt_comm_isend does not wait for the
 * receiver: the message is copied out of buf (which may change at once:
 * on a device communicator, work enqueued on the compute stream after the
 * call) and delivered in the background; mt_comm_wait_sends waits until
 * every isend so far has been delivered (before the communicator is used
 * for anything else that could wait on the peers, and at the end of a
 * pipeline step). recv_tag returns once the message has arrived (device
 * communicators: once its arrival is ordered before the compute stream's
 * later work; the host waits for the sender's isend call, not for its
 * data). Receives may ask for tags in another order than they were sent.
 * Backends: mpi, staged (through host memory), nccl (device buffers; the
 * peer must be a ring neighbour, rank +-1 mod size: comm_nccl.c); local
 * refuses (MT_ENOTSUP). */
#define MT_COMM_MAX_TAG 2700
int mt_comm_pipe_open(mt_comm *c);
int mt_comm_isend(mt_comm *c, const void *buf, size_t count, mt_comm_dtype dt, int peer, int tag);
int mt_comm_recv_tag(mt_comm *c, void *buf, size_t count, mt_comm_dtype dt, int peer, int tag);
int mt_comm_wait_sends(mt_comm *c);

/* Returns on each rank once every rank has called it (host-level; device
 * communicators do not wait for their streams: mt_comm_sync does). */
int mt_comm_barrier(mt_comm *c);

/* "Did every rank succeed?": the one MIN all-reduce the service and the
 * runtime use at every decision point (on mt_comm_host(c)). Returns 1 when
 * every rank passed ok != 0, 0 when some rank did not, a negative status
 * when the all-reduce itself failed (then treat it as not agreed). */
int mt_comm_agree(mt_comm *c, int ok);

/* ---- nonblocking collectives over owned segments (ZeRO) -------------------------- */

/* One piece of a bucket: `count` elements at `buf` (this rank's own
 * pointer: the same piece lives at different addresses on different
 * ranks), owned by rank `owner` of the group. Every rank passes the same
 * list (counts, owners, order); the buffers must not be touched by the
 * caller between start and wait. */
typedef struct mt_comm_seg {
    void *buf;
    size_t count;
    int owner;
} mt_comm_seg;

/* A started operation: completed (and freed) by mt_comm_wait. Several may
 * be in flight on one communicator; every rank starts them in the same
 * order. Other ops of the communicator may run meanwhile. */
typedef struct mt_comm_req mt_comm_req;

/* Reduce into the owners (a reduce-scatter whose blocks are the segments):
 * for each segment, F32 buf[count] on its owner becomes the sum over the
 * group's ranks of their buf; the others' buffers are left as they were.
 * wire = F32 or BF16: the type each rank's contribution travels in. BF16:
 * every contribution, the owner's own too, is rounded to BF16 (nearest
 * even) and the sum is accumulated in F32 and stored in F32 (not rounded
 * back). Sums are in rank order x_0 + x_1 + ... on every backend (nccl
 * too: contributions go to the owner by send / recv and it adds them), so
 * the result does not depend on the backend or on which rank owns what.
 * A group of one (local) moves and rounds nothing. Volume per rank: sends
 * (total - own) wire elements, receives (size - 1) x own. */
int mt_comm_reduce_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_dtype wire,
                               mt_comm_req **req);

/* Gather from the owners (an all-gather-v whose blocks are the segments):
 * each segment's `count` BYTES on its owner land in every rank's buf.
 * Volume per rank: sends (size - 1) x own bytes, receives total - own. */
int mt_comm_gather_owned_start(mt_comm *c, const mt_comm_seg *segs, int n, mt_comm_req **req);

/* all_to_all_v, started: the exchange runs while the caller computes, and
 * mt_comm_wait completes it (then the receive blocks hold the data and the
 * send buffer may be reused). Arguments as all_to_all_v; the count and
 * displacement arrays are read at start only, the buffers must not be
 * touched between start and wait. *req may come back NULL (done already:
 * the local backend, nothing to move); mt_comm_wait(NULL) is a no-op.
 * Per backend: mpi posts every message at start (MPI progresses them in
 * mt_comm_test and the wait); staged copies the send blocks down at start
 * (the host waits for the compute stream's work so far), starts the mpi
 * exchange on a host mirror of its own, and copies the received blocks up
 * at wait; nccl enqueues the grouped send / recv on the side stream after
 * the compute stream's work so far and the compute stream waits for it at
 * mt_comm_wait only (device-side): kernels enqueued between start and wait
 * run beside the exchange. Collective: every rank starts its exchanges in
 * the same order. */
int mt_comm_all_to_all_v_start(mt_comm *c, const void *send, const size_t *send_counts,
                               const size_t *send_displs, void *recv, const size_t *recv_counts,
                               const size_t *recv_displs, mt_comm_dtype dt, mt_comm_req **req);

/* Lets a started operation progress without blocking (MPI progress for
 * host backends); *done = 1 once it has completed (wait still frees it). */
int mt_comm_test(mt_comm_req *r, int *done);

/* Completes r and frees it; NULL is a no-op. Device communicators: the
 * result is stream-ordered like any op of comm.h (the compute stream waits
 * for it unless the communicator overlaps). On error the group is in an
 * unknown state, as for any failed collective. */
int mt_comm_wait(mt_comm_req *r);

/* ---- device stream ordering (no-ops on host communicators) ------------------------ */

/* The compute stream (a cudaStream_t) ops are ordered after and joined to.
 * The runtime sets the op backend's stream (kernels/ops.h be->stream) on
 * every device group of a job, so collectives are ordered with the
 * backend's kernels by device-side events, without host waits. */
int mt_comm_set_stream(mt_comm *c, void *stream);
/* The compute stream set last (NULL: the legacy default stream; always
 * NULL on host communicators). Callers compare it with their backend's
 * stream: when it differs, nothing orders the op with that backend's
 * kernels and the host must wait (be->sync before, mt_comm_sync after). */
void *mt_comm_stream(const mt_comm *c);
/* on = 1: ops no longer make the compute stream wait; see mt_comm_join. */
int mt_comm_set_overlap(mt_comm *c, int on);
/* The compute stream waits (device-side) for every op issued so far. */
int mt_comm_join(mt_comm *c);
/* The host waits for every op issued so far. */
int mt_comm_sync(mt_comm *c);

/* The diagnosis switch back to host-synchronised device communication:
 * 1 when the environment had MT_COMM_HOST_SYNC=1 at the first call (read
 * once per process). Then no caller sets a backend's stream on a device
 * communicator (they stay on the legacy default stream) and every device
 * op is fenced on the host as before streams were shared: be->sync before
 * it, mt_comm_sync after (gradient buckets, expert dispatch). For
 * comparing the two on a device; results are the same either way. */
int mt_comm_host_sync_forced(void);

#endif
