/* config.c - the DeepSeek-V3 config.json field table and its validation. */
#include "engine/model/config.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "base/mt_log.h"
#include "base/mt_status.h"

static const char *const scoring_names[] = {"sigmoid", "softmax", NULL};
static const char *const topk_names[] = {"noaux_tc", "greedy", "group_limited_greedy", NULL};

#define F(name, type, dflt, lo, hi, doc) \
    {#name, type, offsetof(mt_model_config, name), 0, dflt, lo, hi, NULL, 0, doc}
#define FB(name, dflt, doc) \
    {#name, MT_FT_BOOL, offsetof(mt_model_config, name), 0, dflt, MT_NO_RANGE, NULL, 0, doc}
#define FN(name, type, dflt, lo, hi, doc) \
    {#name, type, offsetof(mt_model_config, name), 0, dflt, lo, hi, NULL, 1, doc}
#define FE(name, dflt, names, doc) \
    {#name, MT_FT_ENUM, offsetof(mt_model_config, name), 0, dflt, MT_NO_RANGE, names, 0, doc}
#define FS(name, dflt, doc) \
    {#name, MT_FT_STR, offsetof(mt_model_config, name), sizeof(((mt_model_config *)0)->name), \
     dflt, MT_NO_RANGE, NULL, 0, doc}

/* Defaults are DeepseekV3Config's (transformers), i.e. the 671B model. */
static const mt_field config_fields[] = {
    F(vocab_size, MT_FT_I64, "129280", 2, 1 << 30, "vocabulary size"),
    F(hidden_size, MT_FT_INT, "7168", 1, 1 << 20, "model width d"),
    F(intermediate_size, MT_FT_INT, "18432", 1, 1 << 22, "dense SwiGLU FFN width"),
    F(moe_intermediate_size, MT_FT_INT, "2048", 1, 1 << 22, "width of one expert"),
    F(num_hidden_layers, MT_FT_INT, "61", 1, 4096, "decoder layers"),
    F(num_attention_heads, MT_FT_INT, "128", 1, 4096, "attention heads H"),
    F(num_key_value_heads, MT_FT_INT, "128", 1, 4096, "informational (MLA)"),
    FN(q_lora_rank, MT_FT_INT, "1536", 0, 1 << 20, "query compression rank; null: no q LoRA"),
    F(kv_lora_rank, MT_FT_INT, "512", 1, 1 << 20, "key/value compression rank"),
    F(qk_nope_head_dim, MT_FT_INT, "128", 1, 4096, "per-head q/k dims without RoPE"),
    F(qk_rope_head_dim, MT_FT_INT, "64", 2, 4096, "per-head q/k dims with RoPE (even)"),
    F(v_head_dim, MT_FT_INT, "128", 1, 4096, "per-head value dims"),
    FN(n_routed_experts, MT_FT_INT, "256", 0, 1 << 16, "routed experts; null/0: dense model"),
    FN(n_shared_experts, MT_FT_INT, "1", 0, 1024, "shared experts"),
    F(num_experts_per_tok, MT_FT_INT, "8", 1, 1024, "routed experts per token (top-k)"),
    F(n_group, MT_FT_INT, "8", 1, 1 << 16, "expert groups"),
    F(topk_group, MT_FT_INT, "4", 1, 1 << 16, "groups a token may route to"),
    F(first_k_dense_replace, MT_FT_INT, "3", 0, 4096, "leading layers with a dense FFN"),
    F(moe_layer_freq, MT_FT_INT, "1", 1, 4096, "MoE on layers l >= k with l % freq == 0"),
    F(num_nextn_predict_layers, MT_FT_INT, "0", 0, 16, "MTP depth D"),
    FB(norm_topk_prob, "true", "normalise the top-k weights"),
    F(routed_scaling_factor, MT_FT_F64, "2.5", 0, 1e6, "scale of the routed output"),
    FE(scoring_func, "sigmoid", scoring_names, "expert affinity function"),
    FE(topk_method, "noaux_tc", topk_names, "expert selection method"),
    F(rms_norm_eps, MT_FT_F64, "1e-6", 0, 1, "RMSNorm epsilon"),
    F(rope_theta, MT_FT_F64, "10000", 1, 1e12, "RoPE base"),
    F(max_position_embeddings, MT_FT_I64, "4096", 1, 1LL << 40, "longest sequence"),
    FB(tie_word_embeddings, "false", "head shares the embedding"),
    FB(rope_interleave, "true", "RoPE pairs interleaved (HF default)"),
    F(initializer_range, MT_FT_F64, "0.02", 0, 10, "std of the normal initialisation"),
    FB(attention_bias, "false", "must be false"),
    FS(hidden_act, "silu", "must be \"silu\""),
};
#define N_CONFIG_FIELDS ((int)(sizeof config_fields / sizeof config_fields[0]))
_Static_assert(N_CONFIG_FIELDS == 32, "config field table changed: update tests and docs");

/* rope_scaling is an optional object; its fields, relative to it. */
#define FR(name, type, dflt, lo, hi, doc) \
    {#name, type, offsetof(mt_rope_scaling, name), 0, dflt, lo, hi, NULL, 0, doc}
static const mt_field rope_fields[] = {
    FR(factor, MT_FT_F64, NULL, 1, 1e6, "context extension factor"),
    FR(beta_fast, MT_FT_F64, "32", 0, 1e6, "YaRN beta_fast"),
    FR(beta_slow, MT_FT_F64, "1", 0, 1e6, "YaRN beta_slow"),
    FR(mscale, MT_FT_F64, "1", 0, 1e6, "YaRN mscale"),
    FR(mscale_all_dim, MT_FT_F64, "0", 0, 1e6, "YaRN mscale_all_dim"),
    FR(original_max_position_embeddings, MT_FT_I64, NULL, 1, 1LL << 40,
       "context length before extension"),
};
#define N_ROPE_FIELDS ((int)(sizeof rope_fields / sizeof rope_fields[0]))

const mt_field *mt_config_fields(int *n)
{
    *n = N_CONFIG_FIELDS;
    return config_fields;
}

void mt_config_defaults(mt_model_config *c)
{
    memset(c, 0, sizeof *c);
    int rc = mt_fields_defaults(config_fields, N_CONFIG_FIELDS, c);
    (void)rc; /* the defaults above are constants checked by test_config */
}

static void warn_unknown(const char *path) { MT_LOGD("config: ignoring unknown key %s", path); }

static int parse_rope_scaling(mt_rope_scaling *r, json_t *v, const char *ctx)
{
    char fp[256];
    snprintf(fp, sizeof fp, "%s%srope_scaling", ctx, *ctx ? "." : "");
    memset(r, 0, sizeof *r);
    if (!v || json_is_null(v)) return MT_OK;
    if (!json_is_object(v)) return MT_ERR(MT_EINVAL, "%s: must be an object or null", fp);
    /* Older configs say "type", newer transformers say "rope_type". */
    json_t *t = json_object_get(v, "type");
    if (!t) t = json_object_get(v, "rope_type");
    if (!t || !json_is_string(t))
        return MT_ERR(MT_EINVAL, "%s.type: required, must be \"yarn\"", fp);
    if (strcmp(json_string_value(t), "yarn") != 0)
        return MT_ERR(MT_EINVAL, "%s.type: \"%s\" is not supported (only \"yarn\")", fp,
                      json_string_value(t));
    /* Parse a copy without the type keys so the table sees only its fields. */
    json_t *copy = json_deep_copy(v);
    json_object_del(copy, "type");
    json_object_del(copy, "rope_type");
    int rc = mt_fields_defaults(rope_fields, N_ROPE_FIELDS, r);
    if (rc == MT_OK) rc = mt_fields_parse(rope_fields, N_ROPE_FIELDS, r, copy, fp, 0, warn_unknown);
    json_decref(copy);
    MT_CHECK(rc);
    r->type = MT_ROPE_SCALING_YARN;
    return MT_OK;
}

int mt_config_from_json(mt_model_config *c, json_t *root, const char *ctx, int strict)
{
    mt_config_defaults(c);
    if (!json_is_object(root)) return MT_ERR(MT_EINVAL, "%s: must be a JSON object", ctx);
    /* rope_scaling is parsed by its own table; the rest by config_fields. */
    json_t *copy = json_copy(root);
    json_t *rs = json_object_get(root, "rope_scaling");
    json_object_del(copy, "rope_scaling");
    int rc = mt_fields_parse(config_fields, N_CONFIG_FIELDS, c, copy, ctx, strict, warn_unknown);
    json_decref(copy);
    MT_CHECK(rc);
    MT_CHECK(parse_rope_scaling(&c->rope_scaling, rs, ctx));
    return mt_config_validate(c, ctx);
}

int mt_config_load(mt_model_config *c, const char *path)
{
    json_t *root;
    MT_CHECK(mt_json_load_file(path, &root));
    int rc = mt_config_from_json(c, root, path, 0);
    json_decref(root);
    return rc;
}

#define BAD(field, ...) \
    mt_err_at(MT_EINVAL, __FILE__, __LINE__, "%s%s" field ": " __VA_ARGS__)

int mt_config_validate(const mt_model_config *c, const char *ctx)
{
    const char *dot = *ctx ? "." : "";
    if (c->qk_rope_head_dim % 2)
        return BAD("qk_rope_head_dim", "%d must be even (RoPE rotates pairs)", ctx, dot,
                   c->qk_rope_head_dim);
    if (strcmp(c->hidden_act, "silu") != 0)
        return BAD("hidden_act", "\"%s\" is not supported (only \"silu\")", ctx, dot, c->hidden_act);
    if (c->attention_bias) return BAD("attention_bias", "true is not supported", ctx, dot);
    if (c->first_k_dense_replace > c->num_hidden_layers)
        return BAD("first_k_dense_replace", "%d exceeds num_hidden_layers %d", ctx, dot,
                   c->first_k_dense_replace, c->num_hidden_layers);
    if (c->n_routed_experts > 0) {
        if (c->n_routed_experts % c->n_group)
            return BAD("n_routed_experts", "%d is not divisible by n_group %d", ctx, dot,
                       c->n_routed_experts, c->n_group);
        if (c->topk_group > c->n_group)
            return BAD("topk_group", "%d exceeds n_group %d", ctx, dot, c->topk_group, c->n_group);
        if (c->num_experts_per_tok > c->n_routed_experts)
            return BAD("num_experts_per_tok", "%d exceeds n_routed_experts %d", ctx, dot,
                       c->num_experts_per_tok, c->n_routed_experts);
        int per_group = c->n_routed_experts / c->n_group;
        if (c->topk_method != MT_TOPK_GREEDY && c->num_experts_per_tok > c->topk_group * per_group)
            return BAD("num_experts_per_tok",
                       "%d exceeds the %d experts of topk_group %d groups", ctx, dot,
                       c->num_experts_per_tok, c->topk_group * per_group, c->topk_group);
        if (c->topk_method == MT_TOPK_NOAUX_TC && c->n_group > 1 && per_group < 2)
            return BAD("n_group", "noaux_tc scores groups by their top-2 experts: %d groups "
                       "of %d expert(s) is too few", ctx, dot, c->n_group, per_group);
        if (c->scoring_func == MT_SCORING_SOFTMAX && c->topk_method == MT_TOPK_NOAUX_TC)
            return BAD("topk_method", "noaux_tc needs scoring_func \"sigmoid\"", ctx, dot);
    }
    if (c->rope_scaling.type == MT_ROPE_SCALING_YARN &&
        c->rope_scaling.beta_fast <= c->rope_scaling.beta_slow)
        return BAD("rope_scaling.beta_fast", "%g must exceed beta_slow %g", ctx, dot,
                   c->rope_scaling.beta_fast, c->rope_scaling.beta_slow);
    return MT_OK;
}

json_t *mt_config_to_json(const mt_model_config *c)
{
    json_t *root = mt_fields_to_json(config_fields, N_CONFIG_FIELDS, c);
    if (c->rope_scaling.type == MT_ROPE_SCALING_YARN) {
        json_t *rs = mt_fields_to_json(rope_fields, N_ROPE_FIELDS, &c->rope_scaling);
        json_object_set_new(rs, "type", json_string("yarn"));
        json_object_set_new(root, "rope_scaling", rs);
    } else {
        json_object_set_new(root, "rope_scaling", json_null());
    }
    return root;
}
