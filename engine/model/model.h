/* model.h - the DeepSeek-V3 model on an op backend: parameters, layers with
 * explicit forward and backward, and one micro-batch step.
 *
 * Shapes: a micro-batch is B sequences of T tokens, N = B * T rows; D is
 * hidden_size, H heads, Dn/R/Dv the nope/rope/value head dims, E routed
 * experts, K experts per token, F expert width, V vocabulary.
 *
 * Ownership: a layer sees only its own parameters (mt_param pointers into the
 * model's table) and its own saved activations; transient buffers come from
 * the step workspace (mt_ws) and are released when the layer returns. The
 * MoE layer holds only its local experts and moves tokens through a
 * dispatcher (identity on one rank, all-to-all under expert parallelism).
 * The model is a list of pipeline stages; with one stage it holds every layer.
 */
#ifndef MT_MODEL_H
#define MT_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model/config.h"
#include "engine/model/moe_dispatch.h"
#include "engine/model/param_table.h"
#include "engine/model/tp.h"
#include "kernels/ops.h"

/* Target id that contributes no loss (positions past the end for MTP). */
#define MT_IGNORE (-1)

/* A parameter's compute copies and gradient, all in backend memory. */
typedef struct mt_param {
    mt_param_desc d;
    int64_t index;      /* element offset of the parameter in the flat buffers */
    void *w;            /* act [rows, cols] (non-FP8 compute copy), or NULL */
    uint8_t *q;         /* e4m3 [rows, cols] (FP8 compute copy), or NULL */
    float *s;           /* BLK128 scales [ceil(rows/128), ceil(cols/128)] */
    uint8_t *qt;        /* e4m3 [cols, rows]: transposed copy for the data gradient */
    float *st;          /* BLK128 scales of qt [ceil(cols/128), ceil(rows/128)] */
    float *wf;          /* f32 [cols] (router bias: used as is), or NULL */
    void *grad;         /* [rows, cols] gradient accumulator of the model's grad_type (f32,
                         * or bf16 bits); NULL for the router bias */
    int grad_stale;     /* mt_model_zero_grads_deferred: grad reads as zero, its memory is
                         * not; the first weight-gradient GEMM writes it (mt_grad_accumulate) */
} mt_param;

/* A bump allocator over one backend buffer for a layer's transient values. */
typedef struct mt_ws {
    mt_backend *be;
    char *base;
    size_t cap, top, peak;
} mt_ws;

/* Weight-gradient deferral (the backward split of DualPipeV, issue 15).
 * While a context's `defer` is set, every linear layer's backward computes
 * its input gradient and, instead of the weight-gradient GEMMs dW += dy^T x,
 * appends a record holding packed copies of dy and x (its own backend
 * memory: the workspace and the slot's saved state are reused before the
 * deferred work runs); mt_model_chunk_bwd_w replays the records in order,
 * the same GEMMs on the same values, so the gradients are bit-identical to
 * the whole backward's. What stays in the input-gradient part: RMSNorm
 * weight gradients (one kernel with the data gradient), the router's
 * gradient and the embedding's. A record may also be a layer mark: the
 * model's on_layer_grads hook at that point, since a layer's gradients are
 * final only after its deferred GEMMs. */
typedef struct mt_wdefer_rec {
    int mark;               /* 1: a layer mark (layer), no GEMM */
    int layer;
    int n, G, grouped;      /* one or two projections of one x; expert segments */
    mt_param *w[2];
    void *dy[2];            /* act [M, N_i] packed, in buf */
    void *x;                /* act [M, K] packed, in buf */
    int *rows;              /* host [G] segment rows (M = their sum) */
    int rows_cap;
    void *buf;              /* backend memory of this record, kept between uses */
    size_t cap;             /* bytes of buf */
} mt_wdefer_rec;

typedef struct mt_wdefer {
    int n, cap;             /* records in use / allocated */
    mt_wdefer_rec *r;
    size_t used;            /* backend bytes the current records need */
} mt_wdefer;

/* What every layer needs to run. */
typedef struct mt_ctx {
    mt_backend *be;
    mt_recipe recipe;
    int B, T, N;               /* sequences, tokens per sequence, rows */
    mt_ws *ws;
    const float *rope_cos;     /* f32 [T, R/2] with the YaRN attention factor */
    const float *rope_sin;
    float attn_scale;          /* softmax scale incl. YaRN mscale^2 */
    int rope_interleave;
    int recompute_mla_up;
    int recompute_moe_act;
    int grad_type;             /* parameter gradients: MT_C_F32 or MT_C_BF16 */
    float rms_eps;
    /* Tensor parallelism (engine/model/tp.h), NULL on one rank: MLA heads,
     * FFN columns and the vocabulary are this rank's part; every region
     * ends in a sum over the group. */
    mt_tp *tp;
    /* Non-NULL during the input-gradient part of a split backward: the
     * linear layers record their weight-gradient work here (mt_wdefer). */
    mt_wdefer *defer;
} mt_ctx;

/* Multi-head latent attention with its input norm (one decoder layer's). */
typedef struct mt_mla {
    mt_param *in_norm, *q_a, *q_a_norm, *q_b, *q, *kv_a, *kv_a_norm, *kv_b, *o;
    int D, H, Dn, R, Dv, QL, KL; /* QL = q_lora_rank (0: plain q_proj), KL = kv_lora_rank */
    /* saved for backward */
    void *xn;        /* [N, D] normed input */
    float *rstd_in;  /* [N] */
    void *qa;        /* [N, QL] q_a output */
    void *qan;       /* [N, QL] normed */
    float *rstd_q;   /* [N] */
    void *qh;        /* [N, H, Dn + R] queries after RoPE (NULL with recompute) */
    void *kva;       /* [N, KL + R] kv_a output, its rope part rotated */
    float *rstd_kv;  /* [N] */
    void *kvn;       /* [N, KL] normed compressed kv */
    void *k;         /* [N, H, Dn + R] (NULL with recompute) */
    void *v;         /* [N, H, Dv] (NULL with recompute) */
    void *o_attn;    /* [N, H, Dv] attention output */
    float *lse;      /* [B, H, T] */
} mt_mla;

/* SwiGLU FFN: the dense FFN and the shared experts. */
typedef struct mt_ffn {
    mt_param *gate, *up, *down;
    int D, F;
    int no_sum;      /* tensor parallelism: y and dxn stay partial sums for the caller
                        (sequence parallelism reduce-scatters them) */
    void *gu;        /* [N, 2F] gate and up outputs */
    void *h;         /* [N, F] SwiGLU output (NULL with recompute) */
} mt_ffn;

/* DeepSeekMoE: router, shared experts, local routed experts. */
typedef struct mt_moe {
    mt_param *router, *bias;
    mt_param *exp_gate, *exp_up, *exp_down; /* first local expert of each projection */
    mt_ffn shared;
    int has_shared;
    mt_router_cfg rc;
    int D, F, E_local;
    int align;         /* local expert segments padded to a multiple (128 for fp8: GEMM tiles) */
    int src_align;     /* source segments: align on one rank, 1 when rows travel (no padding sent) */
    int R_cap;         /* rows of the source layout at most */
    int Rl_cap;        /* rows of the local layout at most (mt_moe_local_rows_cap) */
    mt_moe_dispatcher *disp;
    mt_moe_plan plan;  /* what the forward's dispatch moved: for combine and backward */
    int halves;        /* exchanges in two parts of the local experts, pipelined
                          (mt_model_opts.ep_overlap): [0, half) and [half, E_local) */
    int half;
    /* saved for backward */
    void *xn;          /* [N, D] (owned by the block: post-attention norm output) */
    float *logits;     /* [N, E] f32 */
    float *scores;     /* [N, E] f32 */
    int32_t *idx;      /* [N, K] */
    float *w;          /* [N, K] */
    float *dscores;    /* [N, E] aux-loss gradient (computed in forward) */
    int32_t *slot;     /* [N, K] */
    int32_t *src;      /* [R_cap] */
    int32_t *counts;   /* [E] */
    int *rows;         /* host [E]: rows per global expert of this micro-batch (source layout) */
    int R;             /* rows of the source layout */
    void *xp;          /* [R_cap, D] tokens in expert-major order (source layout); NULL
                          when rows travel (the dispatcher gathers them from xn) */
    void *xl_buf;      /* [Rl_cap, D] rows received for the local experts; NULL on one rank */
    void *xl;          /* rows of the local experts (local layout): xp itself on one rank */
    int fp8_wire;      /* rows travel as e4m3 + scales (fp8 recipe, ep > 1: dispatch_fp8) */
    uint8_t *xl_q;     /* [Rl_cap, D] e4m3 of the local rows (fp8_wire) */
    float *xl_s;       /* their VEC128 scales, quant_rows' per-segment layout (fp8_wire) */
    int aux_on;        /* dscores holds this micro-batch's balance-loss gradient */
    void *gup;         /* [Rl_cap, 2F] */
    void *hp;          /* [Rl_cap, F] (NULL with recompute) */
    void *yp;          /* [R_cap, D] expert outputs back in the source layout */
    float *aux_loss;   /* f32 [1] accumulated per micro-batch */
    int64_t *load;     /* host [E]: tokens routed to each expert since the last reset */
} mt_moe;

/* One decoder layer: x + attn(norm(x)), then + ffn/moe(norm(.)). */
typedef struct mt_block {
    int layer;
    int is_moe;
    mt_mla attn;
    mt_param *post_norm;
    mt_ffn ffn;
    mt_moe moe;
    void *mid;         /* [N, D] residual after attention */
    void *xn2;         /* [N, D] post-attention norm output */
    float *rstd2;      /* [N] */
} mt_block;

/* Multi-token prediction module k (1-based depth). */
typedef struct mt_mtp {
    int depth;
    mt_param *enorm, *hnorm, *eh, *norm;
    mt_block block;
    void *emb;         /* [N, D] embedding of the tokens k ahead */
    void *cat;         /* [N, 2D] [enorm(emb), hnorm(h)] */
    float *rstd_e, *rstd_h; /* [N] */
    void *hin;         /* [N, D] eh_proj output: the block's input */
    void *hout;        /* [N, D] block output */
    int32_t *ids;      /* [N] input tokens k ahead */
    int32_t *tgt;      /* [N] targets k + 1 ahead (ignore past the end) */
} mt_mtp;

/* Final norm + output head + cross-entropy (main model or MTP). */
typedef struct mt_head {
    mt_param *norm, *head;
    void *hn;          /* [N, D] normed hidden */
    float *rstd;       /* [N] */
    float *loss;       /* [N] f32 per-token loss */
    int v_lo;          /* first vocabulary row of this rank's head part (0 without tp) */
} mt_head;

/* A pipeline chunk: a contiguous run of decoder layers, with the embedding
 * before it on the first chunk and the final norm, head, loss and MTP after
 * it on the last (issue 15). */
typedef struct mt_stage {
    int layer_lo, layer_hi; /* decoder layers [lo, hi) */
    int first, last;        /* holds the embedding / the head and MTP */
} mt_stage;

/* What one in-flight micro-batch of a chunk keeps between its forward and
 * its backward: the layers' saved activations (each slot has its own copies
 * of the chunk's layer structs, bound to the same parameters), the residual
 * stream and its gradient. Under 1F1B a stage has up to pp micro-batches in
 * flight per chunk, so a chunk has that many slots (mt_model_opts). */
typedef struct mt_chunk_slot {
    mt_block *blocks;       /* [layer_hi - layer_lo]: layer layer_lo + i */
    void **h;               /* [n + 1] act [N, D]: h[0] the chunk's input (the embedding
                               on the first chunk, else what the previous chunk sent),
                               h[i + 1] block layer_lo + i's output: h[n] is sent on */
    void *dh;               /* act [N, D]: the gradient of h[n] before the backward (the
                               next chunk's, received; on the last chunk from the heads),
                               of h[0] after it (sent back) */
    int32_t *ids, *tgt;     /* [N] device: input tokens (first chunk) and targets (last) */
    mt_head *head;          /* last chunk: the main head */
    mt_mtp *mtp;            /* last chunk: [n_mtp] */
    mt_head *mtp_head;      /* last chunk: [n_mtp] */
    void **dmtp;            /* last chunk: [n_mtp] act [N, D] */
} mt_chunk_slot;

typedef struct mt_chunk {
    mt_stage s;
    int id;                 /* global chunk index 0 .. pp * vpp - 1 */
    int n_slots;
    mt_chunk_slot *slots;   /* [n_slots] */
} mt_chunk;

typedef struct mt_model_opts {
    mt_recipe recipe;
    int micro_batch;        /* B */
    int seq_len;            /* T */
    int recompute_mla_up;
    int recompute_moe_act;
    int grads_bf16;         /* gradient accumulators in bf16 (precision.grads), else f32 */
    double mtp_weight;      /* lambda */
    double aux_alpha;       /* alpha */
    int expert_align;       /* expert segment padding; 0: 128 for fp8, 1 otherwise */
    /* Expert parallelism: the dispatcher that moves tokens to the ranks
     * owning their experts (engine/parallel/moe_a2a.h); the model then holds
     * only its experts [e_lo, e_lo + E_local). Not owned; it must outlive
     * the model. NULL: the identity, every expert local. */
    mt_moe_dispatcher *dispatcher;
    /* 1: each MoE layer's exchanges run in two parts (the first half of
     * the local experts, then the second) pipelined with the experts'
     * compute (parallel.ep_overlap = halves, layer_moe.c); the results are
     * those of 0, bit for bit. Nothing changes where nothing travels
     * (the identity dispatcher). */
    int ep_overlap;
    /* Pipeline: the chunks this rank runs (ascending global ids), their
     * layers and how many micro-batches each keeps in flight (slots).
     * n_chunks 0: the whole model as one chunk with one slot. The model
     * then holds only these chunks' parameters: their decoder layers, the
     * embedding with the first chunk, the final norm, head and MTP modules
     * with the last, and an embedding replica with the last when MTP or
     * tied embeddings use it on a stage without the first chunk. Not owned. */
    int n_chunks;
    const mt_stage *chunks;   /* [n_chunks] */
    const int *chunk_ids;     /* [n_chunks] */
    const int *chunk_slots;   /* [n_chunks] */
    /* Tensor parallelism (engine/model/tp.h; engine/parallel/tp_comm.h
     * makes one over a tp group): the model holds its part of every split
     * parameter (mt_params_tp_local: heads, FFN columns, vocabulary), the
     * replicated ones whole. Not owned; it must outlive the model. NULL:
     * one rank. */
    mt_tp *tp;
    /* Optional: called in every backward once a layer's parameter
     * gradients are final for the micro-batch, with the layer's index (the
     * param table's: decoder layers 0..L-1, MTP modules L..), in the order
     * the backward finishes them: MT_LAYER_HEAD first, after the last
     * chunk's head and MTP heads (whose backward runs inside the forward),
     * then MTP modules last to first, the decoder layers last to first,
     * and a last time with -1 after the embedding's backward (then every
     * gradient is final). mt_model_grad_ready names the call after which
     * a parameter's gradient is final. The data parallel trainer starts
     * its gradient reductions here. A negative return ends the step with
     * that status. Under a pipeline each chunk's backward reports its own
     * layers (-1: the first chunk's embedding). */
    int (*on_layer_grads)(void *arg, int layer);
    void *on_layer_grads_arg;
} mt_model_opts;

/* Losses of one micro-batch (host). */
typedef struct mt_mb_stats {
    double loss;            /* LM loss, mean over tokens */
    double mtp_loss;        /* mean over depths of the MTP losses; 0 without MTP */
    double aux_loss;        /* sequence balance loss summed over layers (with alpha) */
    double total;           /* loss + lambda * mtp_loss + aux_loss */
    int64_t tokens;         /* target tokens counted in loss */
} mt_mb_stats;

typedef struct mt_model {
    mt_model_config cfg;
    mt_model_opts opts;
    mt_backend *be;
    mt_ctx ctx;
    mt_ws ws;
    mt_param_table table;
    mt_param *params;       /* [table.n] */
    int n_chunks;
    mt_chunk *chunks;       /* [n_chunks]: this rank's pipeline chunks */
    int has_first, has_last;/* holds the first / the last chunk */
    int embed_replica;      /* holds the embedding for MTP / tied head only (last stage) */
    unsigned char *local;   /* [num_hidden_layers + n_mtp]: the layer is built here */
    mt_moe_dispatcher *disp;
    int own_disp;           /* disp is the model's identity dispatcher */
    int v_lo, V_local;      /* this rank's vocabulary rows [v_lo, v_lo + V_local) */
    /* The table holds this rank's experts only (expert parallelism):
     * global_param[i] is parameter i's index in the full table
     * (mt_params_build(cfg, 0, -1), the sharding map's numbering). */
    int n_params_global;
    int *global_param;      /* [table.n] */
    /* layers: the first slot's structs (the others are in chunks[].slots) */
    mt_param *embed;        /* NULL without the first chunk or a replica */
    int n_blocks;
    mt_block *blocks;       /* [num_hidden_layers]: zero where not local */
    mt_head head;
    int n_mtp;
    mt_mtp *mtp;            /* [num_nextn_predict_layers] (last chunk) */
    mt_head *mtp_head;      /* [n_mtp] */
    /* activations */
    void *logits;           /* [N, V_local] logits, then their gradient (transient) */
    int32_t *host_tok;      /* host [B, T + 1] staging */
    int32_t *host_i32;      /* host [N] staging of input ids */
    int32_t *host_tgt;      /* host [N] staging of targets */
    float *host_loss;       /* host [N] */
    float *rope_cos, *rope_sin;
    /* flat buffers (backend memory) */
    void *buf_act;
    uint8_t *buf_q, *buf_qt;
    float *buf_s, *buf_st, *buf_f32;
    void *buf_grad;         /* every gradient, of type grad_type */
    int64_t n_grad;         /* elements of buf_grad */
    int grad_type;          /* MT_C_F32 or MT_C_BF16 (opts.grads_bf16): ops.h's mt_c_type */
    size_t param_bytes;     /* backend bytes of compute copies and gradients */
    /* Deferred weight-gradient lists of split backwards (mt_model_chunk_bwd_in):
     * a pool, each list kept with its memory for reuse. */
    int n_defer;
    mt_wdefer *defer;       /* [n_defer] */
    unsigned char *defer_busy; /* [n_defer] */
    size_t defer_peak;      /* most backend bytes pending deferrals held at once */
} mt_model;

/* Builds the model for B x T micro-batches on a backend. Weights are zero
 * until mt_model_init_random() or mt_model_set_param(). */
int mt_model_create(mt_model **out, const mt_model_config *cfg, const mt_model_opts *opts,
                    mt_backend *be);
void mt_model_destroy(mt_model *m);


/* Random initial value of parameter element i (layout independent: a pure
 * function of seed, parameter name and element index in the full tensor;
 * i counts the elements of d's part, mapped through d->off). */
float mt_model_init_value(const mt_param_desc *d, double std, uint64_t seed, int64_t i);

/* Writes initial values of every parameter into host f32 buffers and loads
 * them: normal(0, initializer_range) for matrices, 1 for norms, 0 for biases. */
int mt_model_init_random(mt_model *m, uint64_t seed);

/* Parameters go between host f32 values and their compute copies through a
 * device f32 scratch in slabs of rows (the DSV3 embedding alone is 3.7 GB
 * as f32; an 80 GB H100 has no room for that twice): all rows when the
 * tensor has at most MT_PARAM_STAGE elements, else whole 128-row blocks
 * (FP8 block scales stay whole) of at most that many elements, at least
 * one block. mt_param_stage_rows gives a tensor's slab, mt_params_stage_elems
 * the scratch elements that serve every tensor of a table. */
#define MT_PARAM_STAGE ((int64_t)32 << 20)
int64_t mt_param_stage_rows(const mt_param_desc *d);
int64_t mt_params_stage_elems(const mt_param_table *t);
/* Tests: a smaller slab size (elements; 0: MT_PARAM_STAGE) so that the tiny
 * models' tensors take the slab paths. Set before creating models. */
void mt_param_stage_set(int64_t elems);

/* Sets parameter i from host f32 values [rows, cols] (builds its compute
 * copies: FP8 blocks and transpose, or act), slab by slab. */
int mt_model_set_param(mt_model *m, int i, const float *host);
/* The same from an f32 buffer in backend memory (the optimizer's master). */
int mt_model_set_param_dev(mt_model *m, int i, const float *dev);
/* Reads the value parameter i computes with, as host f32 (dequantised). */
int mt_model_get_param(mt_model *m, int i, float *host);

int mt_model_zero_grads(mt_model *m);
/* The same for a whole-model step, without a pass over most of the memory:
 * the gradients of the linear weights and of the output head (about 13 of
 * the DeepSeek-V3 proxy's 14.7 GB of bf16 gradients) are marked stale, and
 * their first weight-gradient GEMM of the step writes them (beta 0: no
 * zeros written, none read back); the rest is zeroed now. mt_model_step's
 * backward zeroes what no GEMM wrote before it returns, so every gradient
 * holds its value whenever a step has returned. A model whose backward
 * calls an on_layer_grads hook (reductions read gradients during it) or
 * that is not one whole-model chunk (the pipeline's chunk calls) has all
 * its gradients zeroed, as mt_model_zero_grads does. */
int mt_model_zero_grads_deferred(mt_model *m);
/* Zeroes the gradients still stale (weights no GEMM wrote since the
 * deferred zeroing). */
int mt_model_grads_settle(mt_model *m);

/* Bytes of one gradient element (4, or 2 for bf16): with mt_param.index
 * (element offset) the accessor for code that walks the flat gradient
 * buffer (norm, reductions): parameter i's gradient is at
 * buf_grad + index * mt_model_grad_size(m). */
static inline size_t mt_model_grad_size(const mt_model *m)
{
    return m->grad_type == MT_C_BF16 ? 2 : 4;
}

/* One micro-batch: tokens host int32 [B, T + 1] (inputs and shifted
 * targets). Forward, loss and, if `backward`, gradients accumulated with
 * weight loss_scale (1 / micro-batches per step). */
int mt_model_step(mt_model *m, const int32_t *tokens, int backward, double loss_scale,
                  mt_mb_stats *st);

/* Pipeline pieces (issue 15): chunk `ci` (index into m->chunks) in slot
 * `slot`. The forward embeds the tokens (first chunk) or reads its input
 * from slots[slot].h[0], runs its layers and leaves its output in h[n]; the
 * last chunk runs the heads instead, losses in *st (aux_loss: this chunk's
 * MoE layers; loss, mtp_loss and tokens only on the last chunk) and, with
 * `backward`, their gradients into dh / dmtp at once. tokens: host int32
 * [B, T + 1] on every chunk (the first reads the inputs, the last the
 * targets). The backward reads dh (the next chunk's input gradient, unless
 * last), accumulates parameter gradients and leaves the input gradient in
 * dh (the embedding's gradient on the first chunk). mt_model_step is one
 * chunk's forward and backward. */
int mt_model_chunk_fwd(mt_model *m, int ci, int slot, const int32_t *tokens, int backward,
                       double loss_scale, mt_mb_stats *st);
int mt_model_chunk_bwd(mt_model *m, int ci, int slot);
/* mt_model_chunk_bwd split in two (DualPipeV's BWD_IN and BWD_W): the
 * input-gradient part leaves dh complete and the parameter gradients of
 * everything but the linear layers' weights accumulated; it defers the
 * weight-gradient GEMMs (and the on_layer_grads calls) into a list of the
 * model's pool whose handle it returns in *handle. The slot is free again
 * after it (the list holds its own copies). The weight part runs a
 * handle's list in the order the whole backward would, and frees the
 * handle; afterwards the gradients equal mt_model_chunk_bwd's bit for bit
 * (where no other backward touched the same gradients in between). */
int mt_model_chunk_bwd_in(mt_model *m, int ci, int slot, int *handle);
int mt_model_chunk_bwd_w(mt_model *m, int handle);
/* Drops every pending deferral (a failed step); the memory stays for reuse. */
void mt_model_defer_reset(mt_model *m);
/* Backend bytes held by the deferral pool now (capacity). */
size_t mt_model_defer_bytes(const mt_model *m);

/* Index of the embedding parameter in m->params, or -1 (not on this rank). */
int mt_model_embed_index(const mt_model *m);

/* The on_layer_grads call after which parameter i's gradient is final for
 * the micro-batch: its layer; MT_LAYER_HEAD for the final norm and an
 * untied head (the head's last use, the MTP heads included, is in the last
 * chunk's forward: their gradients are final a whole backward before the
 * embedding's, and the data-parallel reduction of the head, as large as
 * the embedding, runs beside that backward); -1 for the embedding (the
 * MTP modules and a tied head use it too: final at the end). */
#define MT_LAYER_HEAD 0x7fffffff
int mt_model_grad_ready(const mt_model *m, int i);

/* What a scoring forward hands back (host buffers; either may be NULL). */
typedef struct mt_score_out {
    float *tok_loss;        /* [B, T]: -log p(tokens[b, t + 1] | tokens[b, <= t]) */
    float *logits;          /* [B, T, V] f32: the main head's logits (bf16 values on CUDA
                             * and in the bf16 / fp8 recipes, widened exactly) */
} mt_score_out;

/* The forward of mt_model_step without gradients (the same code, so the
 * same losses bit for bit), also returning per-token losses and logits. */
int mt_model_score(mt_model *m, const int32_t *tokens, const mt_score_out *so, mt_mb_stats *st);

/* Tokens routed to each expert of MoE layer `layer` since the last reset
 * (host [E]); NULL for dense layers. */
const int64_t *mt_model_expert_load(const mt_model *m, int layer);
void mt_model_reset_load(mt_model *m);

/* Router bias of MoE decoder layer `layer` (host f32 [E], read / write). */
int mt_model_get_router_bias(mt_model *m, int layer, float *host);
int mt_model_set_router_bias(mt_model *m, int layer, const float *host);

/* Model FLOPs of one training token: 6 x the active linear parameters
 * (incl. head, router and MTP) + causal attention 6 x T/2 x (Dqk + Dv) per head
 * per layer, i.e. forward x3. Documented in README's throughput section. */
double mt_model_flops_per_token(const mt_model_config *c, int seq_len);

#endif
