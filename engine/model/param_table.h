/* param_table.h - the one table of model parameters.
 *
 * mt_params_build() enumerates every parameter of a model config with its
 * Hugging Face DeepSeek-V3 name, shape, kind and the precision its compute
 * copy takes. The model, the optimizer, checkpoints and the HF converters
 * all walk this table; nothing else spells a tensor name.
 *
 * Order: the table order is the memory order of the flat buffers, chosen so
 * that the same projection of all routed experts of a layer is contiguous
 * with a constant stride (grouped expert GEMMs index them as B + e * stride).
 * MTP module k (1-based) is decoder layer num_hidden_layers + k - 1, as in the
 * released DeepSeek-V3 checkpoint; it shares the embedding and output head.
 */
#ifndef MT_PARAM_TABLE_H
#define MT_PARAM_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model/config.h"

typedef enum {
    MT_PK_EMBED = 0,   /* model.embed_tokens.weight [V, D] */
    MT_PK_HEAD,        /* lm_head.weight [V, D] */
    MT_PK_NORM,        /* RMSNorm gains [D]: initialised to 1, no weight decay */
    MT_PK_LINEAR,      /* attention / FFN / expert projection [out, in]: FP8-eligible */
    MT_PK_LINEAR_BF16, /* MTP eh_proj [D, 2D]: kept in BF16 */
    MT_PK_ROUTER,      /* mlp.gate.weight [E, D]: BF16, logits in fp32 */
    MT_PK_ROUTER_BIAS, /* mlp.gate.e_score_correction_bias [E] fp32: set by the balancing rule */
    MT_PK_COUNT
} mt_param_kind;
_Static_assert(MT_PK_COUNT == 7, "update mt_param_kind_name");

/* What a parameter is, within its layer. */
typedef enum {
    MT_PR_EMBED = 0, MT_PR_HEAD, MT_PR_FINAL_NORM,
    MT_PR_INPUT_NORM, MT_PR_POST_ATTN_NORM,
    MT_PR_Q_A, MT_PR_Q_A_NORM, MT_PR_Q_B, MT_PR_Q, MT_PR_KV_A, MT_PR_KV_A_NORM, MT_PR_KV_B,
    MT_PR_O,
    MT_PR_GATE, MT_PR_UP, MT_PR_DOWN,                /* dense FFN */
    MT_PR_ROUTER, MT_PR_ROUTER_BIAS,
    MT_PR_EXP_GATE, MT_PR_EXP_UP, MT_PR_EXP_DOWN,    /* routed expert e */
    MT_PR_SH_GATE, MT_PR_SH_UP, MT_PR_SH_DOWN,       /* shared experts */
    MT_PR_MTP_ENORM, MT_PR_MTP_HNORM, MT_PR_MTP_EH, MT_PR_MTP_NORM,
    MT_PR_COUNT
} mt_param_role;
_Static_assert(MT_PR_COUNT == 28, "update the role tables in param_table.c");

typedef struct mt_param_desc {
    char name[112];      /* HF name, "model.layers.3.mlp.experts.7.up_proj.weight" */
    mt_param_kind kind;
    mt_param_role role;
    int layer;           /* decoder layer (MTP modules continue the count); -1: none */
    int expert;          /* routed expert index; -1: none */
    int ndim;            /* 1 or 2 */
    int64_t rows, cols;  /* [rows, cols]; 1-D tensors: rows = 1, cols = length */
    int weight_decay;    /* AdamW decay applies */
    /* Tensor parallelism (mt_params_tp_local): [rows, cols] is this rank's
     * slab [off, off + [rows, cols]) of the full [full_rows, full_cols]
     * tensor; without it off = 0 and full = [rows, cols]. */
    int64_t off[2];
    int64_t full_rows, full_cols;
} mt_param_desc;

typedef struct mt_param_table {
    int n;
    mt_param_desc *p;
} mt_param_table;

/* Builds the table for a config. Routed experts [expert_lo, expert_hi) of
 * every MoE layer are included (a rank holds only its local experts);
 * expert_hi = -1 means all. */
int mt_params_build(mt_param_table *t, const mt_model_config *c, int expert_lo, int expert_hi);
void mt_params_free(mt_param_table *t);

/* Tensor parallelism: the dimension a role splits over the tp ranks (0 rows,
 * 1 columns, -1 replicated): column-parallel q_proj / q_b_proj, kv_b_proj,
 * dense and shared gate / up, vocabulary-split embedding and lm_head (0);
 * row-parallel o_proj, dense and shared down_proj (1). Routed experts split
 * over etp the same way (gate / up rows, down columns). The sharding map
 * uses the same rule (engine/parallel/sharding.h). */
int mt_param_role_tp_dim(mt_param_role r);

/* Part k of n of [0, N): [k N / n, (k + 1) N / n) (the sharding map's rule). */
static inline void mt_param_part(int64_t N, int n, int k, int64_t *lo, int64_t *cnt)
{
    const int64_t a = N * k / n, b = N * (k + 1) / n;
    *lo = a;
    *cnt = b - a;
}

/* Narrows every tensor-parallel parameter (not the routed experts, which
 * etp splits) to part `rank` of `tp` of its split dimension, recording the
 * offset (off) in the full tensor. */
void mt_params_tp_local(mt_param_table *t, int tp, int rank);

/* Expert tensor parallelism: narrows every routed expert's gate / up (rows)
 * and down (columns) to part `rank` of `etp`, recording the offset (off) in
 * the full tensor, as mt_params_tp_local does for the dense ones. */
void mt_params_etp_local(mt_param_table *t, int etp, int rank);

/* Index of a name in the table, or -1. */
int mt_params_find(const mt_param_table *t, const char *name);

/* Total elements of a parameter. */
static inline int64_t mt_param_numel(const mt_param_desc *d) { return d->rows * d->cols; }

/* Total elements of the table (parameters counted once). */
int64_t mt_params_numel(const mt_param_table *t);

const char *mt_param_kind_name(mt_param_kind k);

/* Does the kind's compute copy take FP8 under the fp8-blockwise recipe? */
static inline int mt_param_kind_is_fp8(mt_param_kind k) { return k == MT_PK_LINEAR; }

/* ---- derived names (the DeepSeek-V3 release; ckpt/FORMAT.md) ------------ */

/* The FP8 block scales of a weight: "<x>.weight" -> "<x>.weight_scale_inv"
 * ([ceil(rows/128), ceil(cols/128)] f32). MT_EINVAL if it does not fit. */
int mt_param_scale_name(char *out, size_t cap, const char *weight_name);

/* Optimizer state of a parameter: "optimizer.<state>.<name>" with state
 * "exp_avg", "exp_avg_sq" or "main". MT_EINVAL if it does not fit. */
int mt_param_optim_name(char *out, size_t cap, const char *state, const char *name);

/* A tensor of the Hugging Face export that copies a parameter. */
typedef struct mt_param_alias {
    char name[112];      /* "model.layers.61.embed_tokens.weight" */
    char source[112];    /* "model.embed_tokens.weight" */
} mt_param_alias;

/* The copies the released DeepSeek-V3 checkpoint carries for each MTP
 * module k (layer L = num_hidden_layers + k - 1): model.layers.L.embed_tokens
 * (the embedding) and model.layers.L.shared_head.head (the output head, or
 * the embedding when tied). Writes up to cap aliases; returns the count
 * (2 per MTP module). */
int mt_params_hf_aliases(const mt_model_config *c, mt_param_alias *out, int cap);

#endif
