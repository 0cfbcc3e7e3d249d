/* cuda_attn_impl.h - private to the CUDA attention files: the cuDNN plan
 * cache shared by the plan builder (cuda_attn_plan.cu) and the ops
 * (cuda_attn.cu), and the own fallback kernels' launchers (cuda_attn_own.cu).
 *
 *   cuda_attn.cu       path selection, cuDNN launches, attn_fwd / attn_bwd,
 *                      install / destroy, the C helpers of cuda_attn.h
 *   cuda_attn_plan.cu  cuDNN graphs of the SDPA forward and backward, plans
 *                      and their cache, execution with a variant pack
 *   cuda_attn_own.cu   the own FlashAttention-2 style kernels (fallback)
 *   cuda_rope_mla.cu   rotary embedding and MLA key/value assembly
 */
#ifndef MT_CUDA_ATTN_IMPL_H
#define MT_CUDA_ATTN_IMPL_H

#include "kernels/cuda/cuda_impl.h"

/* The graphs follow cudnn-frontend's CompositeSDPANode / CompositeSDPABackwardNode
 * for bf16 I/O with fp32 intermediates and compute, causal mask "top left"
 * (right bound 0) and no padding mask, dropout, bias or GQA. Tensors are
 * [B, H, T, D] views of our [B*T, H, D] buffers: strides [T*H*D, D, H*D, 1];
 * K enters as K^T ([B, H, Dqk, T], strides 2 and 3 swapped), and the backward
 * takes V^T likewise. Virtual score tensors are [B, H, T, T]; per-row
 * statistics [B, H, T, 1] with strides [H*T, T, 1, 1] (lse's layout). */

enum { /* unique ids of the non-virtual tensors (the variant pack) */
       UID_Q = 1,
       UID_K,
       UID_V,
       UID_O,
       UID_STATS,
       UID_DO,
       UID_DQ,
       UID_DK,
       UID_DV,
       UID_SCALE,   /* by value: attn scale (f32) */
       UID_NEG_INF, /* by value: the masked score (f32 -inf) */
       UID_ONE,     /* by value: 1.0f (the dropout-less softmax_sum scale) */
       UID_SOFTMAX_SUM, /* bwd: sum_j dO O per row, f32 [B, H, T, 1] in scratch */
       UID_DQ_ACCUM,    /* bwd, non-deterministic: f32 dQ accumulator in scratch */
       UID_VIRTUAL = 100 };

#define ATT_MAX_DESCS 160
#define ATT_MAX_OPS 40
#define ATT_CACHE 16

typedef struct attn_key {
    int bwd, B, T, H, Dqk, Dv, det;
    uint32_t scale_bits;
} attn_key;

typedef struct attn_plan {
    attn_key key;
    int state;  /* 0 empty, 1 ready, -1 cuDNN cannot serve this key */
    int warned; /* the fallback warning was logged */
    cudnnBackendDescriptor_t plan;
    cudnnBackendDescriptor_t *descs; /* every descriptor of the graph, destroyed with the plan */
    int n_descs;
    size_t ws_bytes;  /* engine workspace */
    size_t aux_bytes; /* our scratch tensors in front of it (bwd) */
    int64_t engine;   /* engine global index, -1 if unknown */
    float scale, neg_inf, one; /* by-value scalars (host memory read at execute) */
    char why[1024];            /* state -1: the error */
} attn_plan;

struct cuda_attn_cache {
    attn_plan plans[ATT_CACHE];
    int evict; /* next slot to reuse when full */
    cudnnHandle_t handle;
    int own_handle;
    int smem_optin;
    size_t version; /* cudnnGetVersion() of the loaded library */
    char last_path[1200];
};

static inline cuda_attn_cache *att_cache(mt_backend *be) { return cuda_of(be)->attn; }
static inline int att_smem_optin(mt_backend *be) { return att_cache(be)->smem_optin; }
static inline size_t att_align(size_t x) { return (x + 255) & ~(size_t)255; }

/* ---- cuda_attn_plan.cu ---- */
/* The cached plan of a key, built on first use (never NULL; state -1 and
 * why say when cuDNN cannot serve it). */
attn_plan *att_plan_get(mt_backend *be, const attn_key *k);
/* Executes a ready plan with (uid, pointer) pairs and the workspace. */
int att_plan_run(mt_backend *be, attn_plan *p, const int64_t *uids, void **ptrs, int n, void *ws);
void att_plan_release(attn_plan *p);

/* ---- cuda_attn_own.cu ---- */
int att_own_fwd(mt_backend *be, bf16 *o, float *lse, const bf16 *q, const bf16 *k, const bf16 *v,
                int B, int T, int H, int Dqk, int Dv, float scale);
int att_own_bwd(mt_backend *be, bf16 *dq, bf16 *dk, bf16 *dv, const bf16 *dout, const bf16 *q,
                const bf16 *k, const bf16 *v, const bf16 *o, const float *lse, int B, int T, int H,
                int Dqk, int Dv, float scale);

#endif
