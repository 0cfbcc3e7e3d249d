/* config.h - the model configuration: a Hugging Face DeepSeek-V3 config.json.
 *
 * Field names and defaults are those of transformers' DeepseekV3Config (and
 * the official config.json for num_nextn_predict_layers), so a config.json
 * from the Hub loads as is. The field table in config.c is the one place the
 * fields, defaults and ranges are written down.
 */
#ifndef MT_CONFIG_H
#define MT_CONFIG_H

#include <jansson.h>
#include <stdint.h>

#include "base/json_util.h"

typedef enum { MT_ROPE_SCALING_NONE = 0, MT_ROPE_SCALING_YARN } mt_rope_scaling_type;

/* Linear-layer precision of the model. fp32: no rounding anywhere
 * (gradient checks). */
typedef enum { MT_RECIPE_FP8_BLOCKWISE = 0, MT_RECIPE_BF16, MT_RECIPE_FP32 } mt_recipe;

typedef struct mt_rope_scaling {
    mt_rope_scaling_type type;
    double factor;                             /* context extension factor s */
    double beta_fast, beta_slow;               /* YaRN ramp bounds, in rotations */
    double mscale, mscale_all_dim;             /* attention temperature terms */
    int64_t original_max_position_embeddings;  /* pre-extension context length */
} mt_rope_scaling;

typedef enum { MT_SCORING_SIGMOID = 0, MT_SCORING_SOFTMAX } mt_scoring_func;
typedef enum { MT_TOPK_NOAUX_TC = 0, MT_TOPK_GREEDY, MT_TOPK_GROUP_LIMITED_GREEDY } mt_topk_method;

typedef struct mt_model_config {
    int64_t vocab_size;
    int hidden_size;               /* d */
    int intermediate_size;         /* dense FFN width */
    int moe_intermediate_size;     /* width of one routed / shared expert */
    int num_hidden_layers;
    int num_attention_heads;       /* H */
    int num_key_value_heads;       /* informational: MLA has H kv heads */
    int q_lora_rank;               /* 0 (null in JSON): q_proj without low rank */
    int kv_lora_rank;
    int qk_nope_head_dim;
    int qk_rope_head_dim;
    int v_head_dim;
    int n_routed_experts;
    int n_shared_experts;
    int num_experts_per_tok;       /* top-k */
    int n_group;
    int topk_group;
    int first_k_dense_replace;     /* layers [0, k) use the dense FFN */
    int moe_layer_freq;            /* layer l >= k is MoE when l % freq == 0 (HF rule) */
    int num_nextn_predict_layers;  /* MTP depth D */
    int norm_topk_prob;
    double routed_scaling_factor;
    mt_scoring_func scoring_func;
    mt_topk_method topk_method;
    double rms_norm_eps;
    double rope_theta;
    int64_t max_position_embeddings;
    int tie_word_embeddings;
    int rope_interleave;           /* rope dims stored as interleaved pairs */
    double initializer_range;      /* std of the random normal initialisation */
    int attention_bias;            /* must be false */
    char hidden_act[16];           /* must be "silu" */
    mt_rope_scaling rope_scaling;
} mt_model_config;

/* Fills DeepseekV3Config's defaults. */
void mt_config_defaults(mt_model_config *c);

/* Parses a config.json object (ctx prefixes error paths). The rotary
 * settings may be written either way transformers does: top-level
 * rope_theta + rope_scaling (transformers 4, the official releases) or
 * rope_parameters (transformers 5); both give the same config. A key outside
 * the field tables is an error naming it, since it could change the model,
 * unless config.c lists it as irrelevant to training (architectures,
 * torch_dtype, quantization_config, ...): those are ignored quietly.
 * `strict` is no longer used (both modes refuse unknown keys, issue 21); it
 * stays so that callers need not change. */
int mt_config_from_json(mt_model_config *c, json_t *root, const char *ctx, int strict);

/* Loads and parses a config.json file. */
int mt_config_load(mt_model_config *c, const char *path);

/* Checks cross-field consistency; errors name the field. */
int mt_config_validate(const mt_model_config *c, const char *ctx);

/* The config as HF-style JSON (rope_scaling null when none). */
json_t *mt_config_to_json(const mt_model_config *c);

/* The field table, for --set overrides of model.* and documentation. */
const mt_field *mt_config_fields(int *n);

/* Derived quantities. */
static inline int mt_config_qk_head_dim(const mt_model_config *c)
{
    return c->qk_nope_head_dim + c->qk_rope_head_dim;
}
/* Is decoder layer l (0-based) an MoE layer? */
static inline int mt_config_layer_is_moe(const mt_model_config *c, int l)
{
    return c->n_routed_experts > 0 && l >= c->first_k_dense_replace &&
           l % (c->moe_layer_freq > 0 ? c->moe_layer_freq : 1) == 0;
}

#endif
