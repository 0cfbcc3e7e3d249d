/* sharding.h - the one map from (model config, parallel layout) to the
 * hyperslabs each rank owns, for weights and for optimizer state.
 *
 * Save, load, reshard and the parallel runtime all use it; ckpt/ sees the
 * model only through this header, layout.h and engine/model/tensor_desc.h.
 *
 * Ranks, the expert folding and the pipeline chunks: see layout.h. The
 * embedding is on the first chunk's stage; the final norm, the output head
 * and the MTP modules on the last chunk's stage (which also holds a replica
 * of the embedding when MTP or tied embeddings need it).
 * Tensor parallelism (dimension split, equal parts):
 *   column-parallel (rows split): q_proj / q_b_proj, kv_b_proj, dense and
 *     shared-expert gate_proj / up_proj;
 *   row-parallel (columns split): o_proj, dense and shared down_proj;
 *   vocabulary (rows split, balanced): embed_tokens, lm_head;
 *   replicated: q_a_proj, kv_a_proj_with_mqa, norms, router and its bias,
 *     MTP eh_proj.
 * Experts: EP gives each rank E / EP consecutive routed experts; ETP splits
 *   their gate_proj / up_proj rows and down_proj columns.
 * Data parallelism (DP, or EDP for experts) replicates weights. ZeRO-1
 *   optimizer state (exp_avg, exp_avg_sq, main) is kept by one rank of the
 *   DP (EDP) group per parameter, whole (its TP-local slab): per group of
 *   parameters (the dense ones of a stage; the routed experts of a stage
 *   and EP rank), in table order, contiguous runs over the group's Z
 *   ranks whose largest has as few elements as any contiguous split
 *   allows, each run ending where the elements' midpoint rule (parameter
 *   i with first element `start` and n elements to rank
 *   floor((start + n / 2) * Z / N), N the group's elements) ends it, or as
 *   near as that bound lets (mt_zero_owners; the rule alone left a head of
 *   more than N / Z elements on top of a full share). Whole parameters
 *   keep every update local (an FP8 weight's 128x128 blocks are
 *   re-quantised by one rank) and every piece a rectangle.
 * FP8 weights (opts.fp8): every TP / ETP split boundary of an e4m3 tensor
 *   must fall on a multiple of 128 (or the end), so each rank's slab is a
 *   whole number of 128 x 128 scale blocks and the scale tensor's piece is
 *   rows [off / 128, ceil((off + count) / 128)) of it. Layouts that would
 *   cut a block are rejected, naming the tensor.
 * Writers: optimizer state by its ZeRO-1 owner, its only holder; a weight
 *   piece held by the replicas of a dp (edp) group by the replica that
 *   writes the fewest bytes so far, in tensor order, counting the optimizer
 *   state (ties: the lowest); its scale piece by the same rank. The busiest
 *   writer then writes about the group's share instead of every replicated
 *   weight. Non-replicated pieces: their holder.
 */
#ifndef MT_SHARDING_H
#define MT_SHARDING_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model/config.h"
#include "engine/model/tensor_desc.h"
#include "engine/parallel/layout.h"

/* Checks the layout against the model: divisibility of heads, widths and
 * experts by the split sizes, the expert folding (when dp is resolved),
 * pipeline chunks; with fp8, 128-aligned splits of every e4m3 tensor.
 * Errors name the layout and the numbers. */
int mt_layout_validate(const mt_layout *l, const mt_model_config *c, int fp8);

/* Pipeline stage (pp rank) of decoder layer `layer` (MTP layers >= L: the
 * last chunk's stage). */
int mt_layout_stage_of_layer(const mt_layout *l, const mt_model_config *c, int layer);
/* Decoder layers [*lo, *hi) of pipeline chunk `chunk` (may be empty), and
 * the chunk of a layer (MTP layers >= L: the last chunk): the layout's
 * pp_layers when given, else balanced. The one rule that places layers in
 * chunks: the model, the trainer and the map use it. */
void mt_layout_chunk_layers(const mt_layout *l, const mt_model_config *c, int chunk, int *lo,
                            int *hi);
int mt_layout_chunk_of_layer(const mt_layout *l, const mt_model_config *c, int layer);

/* What a stored tensor is to its parameter. */
typedef enum {
    MT_TS_WEIGHT = 0,   /* the compute copy: e4m3, bf16, or f32 */
    MT_TS_SCALE,        /* e4m3 weights: f32 weight_scale_inv [ceil(r/128), ceil(c/128)] */
    MT_TS_EXP_AVG,      /* optimizer.exp_avg.<name>: bf16 */
    MT_TS_EXP_AVG_SQ,   /* optimizer.exp_avg_sq.<name>: bf16 */
    MT_TS_MAIN,         /* optimizer.main.<name>: f32 or bf16 main params */
    MT_TS_COUNT
} mt_tensor_role;
_Static_assert(MT_TS_COUNT == 5, "update mt_tensor_role_name");

const char *mt_tensor_role_name(mt_tensor_role r);

/* Which tensors a checkpoint holds, and their types. */
typedef struct mt_shard_opts {
    int fp8;             /* FP8-eligible linears as e4m3 + weight_scale_inv */
    mt_dtype act_dtype;  /* other weights: MT_DT_BF16, or MT_DT_F32 (recipe fp32) */
    int optimizer;       /* include exp_avg and exp_avg_sq */
    int has_main;        /* include main params (needs optimizer) */
    mt_dtype main_dtype; /* MT_DT_F32 or MT_DT_BF16 */
} mt_shard_opts;

typedef struct mt_shard_tensor {
    char name[MT_TENSOR_NAME_CAP];
    mt_dtype dtype;
    int ndim;
    int64_t shape[2];        /* 1-D: shape[1] = 1 */
    int param;               /* index in mt_params_build(cfg, 0, -1) */
    mt_tensor_role role;
    int first_piece, n_pieces;
} mt_shard_tensor;

typedef struct mt_shard_piece {
    int tensor;
    int writer;              /* rank that writes it */
    int64_t off[2], count[2];
} mt_shard_piece;

/* A tensor of the Hugging Face export that copies a weight (each MTP
 * module's embed_tokens and shared_head.head, as the DeepSeek-V3 release). */
typedef struct mt_shard_alias {
    char name[MT_TENSOR_NAME_CAP];
    int source;                       /* tensor index of the weight it copies */
} mt_shard_alias;

typedef struct mt_shard_map {
    mt_model_config cfg;
    mt_layout layout;
    mt_shard_opts opts;
    int world;
    int n_params;
    int (*param_tensor)[MT_TS_COUNT]; /* [n_params]: tensor index per role, -1 absent */
    int n_tensors;
    mt_shard_tensor *tensors;         /* parameter order; per parameter roles in enum order */
    int n_pieces;
    mt_shard_piece *pieces;           /* grouped by tensor */
    int *rank_first;                  /* [world + 1] into rank_pieces */
    int *rank_pieces;                 /* piece indices grouped by writer */
    int hash_cap;
    int *hash;                        /* name lookup: tensor index + 1, 0 empty */
    int n_aliases;
    mt_shard_alias *aliases;          /* copies the HF export adds */
    struct mt_shard_priv *priv;       /* parameter classes (sharding.c) */
} mt_shard_map;

/* ZeRO-1 owner of each parameter of mt_params_build(c, 0, -1) within its DP
 * (dense) or EDP (routed experts) group; -1 for the router biases (no
 * optimizer state). owner: [parameters]. The map uses the same rule. */
int mt_zero_owners(const mt_model_config *c, const mt_layout *l, int *owner);

/* Builds the map; validates the layout (mt_layout_validate). */
int mt_shard_map_build(mt_shard_map *m, const mt_model_config *c, const mt_layout *l,
                       const mt_shard_opts *o);
void mt_shard_map_free(mt_shard_map *m);

/* Index of a tensor by name, or -1. */
int mt_shard_map_find(const mt_shard_map *m, const char *name);

/* The hyperslab of tensor t that `rank` holds in memory: its TP / EP slab
 * of a weight or scale, its ZeRO piece of optimizer state. Returns 1 and
 * fills off / count if it holds some, 0 if none. */
int mt_shard_map_held(const mt_shard_map *m, int t, int rank, int64_t off[2], int64_t count[2]);

/* Pieces `rank` writes: indices into m->pieces. */
static inline const int *mt_shard_map_rank_pieces(const mt_shard_map *m, int rank, int *n)
{
    *n = m->rank_first[rank + 1] - m->rank_first[rank];
    return m->rank_pieces + m->rank_first[rank];
}

/* Descriptor of piece p (data NULL). */
void mt_shard_piece_desc(const mt_shard_map *m, int p, mt_tensor_desc *d);

/* "<x>.weight" -> "<x>.weight_scale_inv" (engine/param_table's rule), for
 * readers that see tensor names only. */
int mt_shard_scale_name(char *out, size_t cap, const char *weight_name);

/* Bytes of all tensors (each global tensor counted once). */
int64_t mt_shard_map_bytes(const mt_shard_map *m);

#endif
