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
 * Payload: the act values of the backend. With wire = MT_COMM_BF16 and a
 * CPU backend that rounds its act values to bf16 (recipes bf16 and
 * fp8-blockwise) the rows travel as bf16 - half the bytes, bit-exact;
 * MT_COMM_F32 sends floats as they are (recipe fp32). The FP8 payload
 * (e4m3 + 1x128 scales) is not done yet.
 *
 * Memory: host communicators and the CPU backend only (backend memory is
 * host memory there); device buffers (NCCL, host-staged) come with the
 * GPU path. Wire buffers are the dispatcher's, grown to the largest
 * exchange and reused by every layer.
 */
#ifndef MT_MOE_A2A_H
#define MT_MOE_A2A_H

#include "engine/model/moe_dispatch.h"
#include "engine/parallel/comm.h"

/* A dispatcher for E global experts over the ep group `ep` (not owned; it
 * must outlive the dispatcher). wire: MT_COMM_F32 or MT_COMM_BF16. Errors:
 * EP not dividing E, a device communicator, another wire type. */
int mt_moe_dispatch_a2a(mt_moe_dispatcher **out, mt_comm *ep, int E, mt_comm_dtype wire);

/* Bytes sent and received by this rank's exchanges so far (payload and
 * counts), for benchmarks and logs. */
void mt_moe_a2a_bytes(const mt_moe_dispatcher *d, int64_t *sent, int64_t *received);

#endif
