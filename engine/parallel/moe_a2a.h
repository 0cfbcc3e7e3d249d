/* moe_a2a.h - the expert-parallel dispatcher: routed tokens travel to the
 * ranks owning their experts and back by all-to-all-v over the ep group
 * (engine/model/moe_dispatch.h has the contract and the layouts).
 *
 * Rank r of the ep group (size EP) owns experts [r E / EP, (r + 1) E / EP)
 * (the sharding map's rule). A forward dispatch is two exchanges:
 *   1. counts: to each peer p, one I64 per expert of p (the rows this rank
 *      routes there), so every rank learns what it will receive from whom;
 *   2. rows: the source layout is grouped by destination already, so the
 *      block for p is a contiguous run of xp; all_to_all_v moves them.
 * On arrival the rows are unpacked expert-contiguous (local expert e:
 * peer 0's chunk of rows for e, peer 1's, ..., each chunk zero-padded to
 * `align`): the receive-side permutation is the unpack itself, one pass.
 * Padding each source's chunk (not only the segment's end) keeps the FP8
 * recipe's 128-row tiles of the weight gradient (quant_cols_t) inside one
 * micro-batch, as on one rank: the same tiles, the same scales. Combine packs
 * the local rows per destination (the same pass in reverse, padding left
 * behind) and the exchange lands them straight in the source layout.
 * Backward reuses the forward's plan: no count exchange.
 *
 * Payload: the act values of the backend. Two paths:
 *  - direct, when a wire element is the backend's act element (the CUDA
 *    backend's bf16 with wire = MT_COMM_BF16; the CPU's float with
 *    MT_COMM_F32, recipe fp32): rows travel as the backend stores them,
 *    from and to the backend's memory, through the communicator of the ep
 *    group (device buffers on CUDA: staged for ranks sharing a GPU, NCCL's
 *    grouped send/recv per peer otherwise). The forward's pack is the
 *    backend's moe_permute gather by the layer's src (the permutation
 *    fused into the pack); the unpack and combine's pack are moe_permute
 *    gathers by an index map the host builds from the counts (uploaded:
 *    4 bytes per row); combine lands in the source layout as it is. The
 *    same code runs on the CPU (fp32 recipe), where the tests prove it;
 *  - converting (CPU backend, act float, wire = MT_COMM_BF16, recipes bf16
 *    and fp8-blockwise whose act values are bf16 numbers): rows travel as
 *    bf16 - half the bytes, bit-exact - converted in the pack and unpack.
 * FP8 payload (dispatch_fp8, the forward's dispatch under the fp8 recipe):
 * the layer quantises its tokens once (quant_rows, 1x128 tiles per row);
 * each source row travels as its KB scales and D e4m3 bytes (about 1 byte
 * per value: 7168 + 224 bytes per DeepSeek-V3 row against 14336 in bf16);
 * the unpack (moe_unpack_fp8 by an index map) lays out the e4m3 rows and
 * their scales as quant_rows of the local segments would (the expert
 * GEMMs take them as they are) and the dequantised act rows for the
 * weight gradient. Combine and the backward's exchanges stay act rows.
 *
 * Counts: the per-expert rows are on the host already (the layer's
 * moe_index brings them there: one small device-to-host copy per layer's
 * forward, E int32); they are exchanged over mt_comm_host(ep) (MPI).
 * Device ordering: the ep group's compute stream is the backend's (the
 * runtime sets it; the dispatcher does too, at its first exchange, for
 * direct users): an exchange starts after the kernels that packed its rows
 * and the kernels after it wait for it, by device-side events; the host
 * does not wait. The counts still need the host (the layer's moe_index
 * downloads them, waiting for the backend). Overlap: the exchanges of a
 * part of the local experts are started (mt_comm_all_to_all_v_start: on a
 * device group, enqueued on its side stream) and finished apart, and the
 * backend's stream waits for one only at its finish, so the kernels the
 * caller enqueues in between (the other part's experts, under
 * parallel.ep_overlap = halves) run beside it. On host groups (mpi) the
 * messages are posted at start and MPI moves them when the process is in
 * MPI (the finish, on this CPU path: little real overlap).
 * MT_COMM_HOST_SYNC=1 (comm.h): the host waits for the backend before
 * each exchange and for the group after it, as before.
 *
 * Memory: the ep group's communicator holds the backend's memory kind
 * (host for CPU, device for CUDA; a mix is refused at the first exchange).
 * Wire buffers and the index map are the dispatcher's, grown to the
 * largest exchange and reused by every layer (backend memory on the
 * direct path, freed by destroy: the backend must outlive it).
 */
#ifndef MT_MOE_A2A_H
#define MT_MOE_A2A_H

#include "engine/model/moe_dispatch.h"
#include "engine/parallel/comm.h"

/* A dispatcher for E global experts over the ep group `ep` (not owned; it
 * must outlive the dispatcher). wire: MT_COMM_F32 or MT_COMM_BF16. Errors:
 * EP not dividing E, another wire type; at the first exchange, a backend
 * whose memory or act type the communicator or wire cannot carry. */
int mt_moe_dispatch_a2a(mt_moe_dispatcher **out, mt_comm *ep, int E, mt_comm_dtype wire);

/* Expert tensor parallelism (etp > 1): `ep` is the exchange group of the
 * EP x etp ranks of a stage with the same edp, rank t + etp o holding
 * slice t of owner o's experts [o E / EP, (o + 1) E / EP) (the layout's
 * folding, etp fastest). Every routed row travels to each slice of its
 * owner (the source sends an owner's run once per slice: forward rows and
 * the backward's output gradients alike), and combine sums the slices'
 * partial outputs (forward: down's partial sums over the F / etp columns;
 * backward: the input gradients of each slice) into the source layout in
 * slice order, 0 + 1 + ..., each sum an act value (rounded to bf16 where
 * the act values are). The plan's peers are the EP x etp ranks. etp = 1
 * is mt_moe_dispatch_a2a. Errors: etp not dividing the group, EP = size /
 * etp not dividing E. */
int mt_moe_dispatch_a2a_etp(mt_moe_dispatcher **out, mt_comm *ep, int E, int etp,
                            mt_comm_dtype wire);

/* Bytes sent and received by this rank's exchanges so far (payload and
 * counts), for benchmarks and logs. */
void mt_moe_a2a_bytes(const mt_moe_dispatcher *d, int64_t *sent, int64_t *received);

#endif
