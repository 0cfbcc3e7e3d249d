/* config.c - the DeepSeek-V3 config.json field table and its validation. */
#include "engine/model/config.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

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

/* ---- keys outside the field table -------------------------------------------------- */

/* Keys of a Hugging Face config.json that do not change what is trained:
 * bookkeeping of transformers and of inference code. Accepted and ignored
 * without a word; every other key outside the tables is an error, because
 * moetrain cannot tell whether it changes the model (issue 21). */
static const char *const ignored_keys[] = {
    "architectures", "auto_map", "model_type", "transformers_version",
    "torch_dtype", "dtype",                  /* storage dtype; the job's recipe decides */
    "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
    "quantization_config",                   /* how released weights are stored; import-hf reads them */
    "ep_size",                               /* DeepSeek's inference-time expert parallelism */
    "pretraining_tp",                        /* read by Llama's slicing code, never by DeepSeek-V3's */
    "aux_loss_alpha", "seq_aux",             /* the balance loss: the job spec's loss.aux_alpha */
    NULL,
};

static int is_ignored_key(const char *k)
{
    for (int i = 0; ignored_keys[i]; i++)
        if (strcmp(ignored_keys[i], k) == 0) return 1;
    return 0;
}

static void field_path(char *buf, size_t cap, const char *ctx, const char *key)
{
    snprintf(buf, cap, "%s%s%s", ctx, *ctx ? "." : "", key);
}

/* A number `key` of obj, if present, must equal `want`: keys transformers 5
 * writes that restate (head_dim, qk_head_dim) or fix (attention_dropout,
 * partial_rotary_factor) what the tables say; any other value changes the
 * math. Removes the key from obj. */
static int check_restated(json_t *obj, const char *key, double want, const char *ctx,
                          const char *why)
{
    json_t *v = json_object_get(obj, key);
    if (!v) return MT_OK;
    char fp[256];
    field_path(fp, sizeof fp, ctx, key);
    if (!json_is_number(v) || json_number_value(v) != want) {
        char got[64] = "not a number";
        if (json_is_number(v)) snprintf(got, sizeof got, "%g", json_number_value(v));
        return MT_ERR(MT_EINVAL, "%s: %s is not supported (must be %g: %s)", fp, got, want, why);
    }
    json_object_del(obj, key);
    return MT_OK;
}

/* ---- rotary settings ---------------------------------------------------------------- */

/* The rotary settings come in two spellings, which must give the same tables:
 *  - transformers 4 and the official releases: top-level "rope_theta", and
 *    "rope_scaling" null or {"type" | "rope_type": "yarn", factor, ...};
 *  - transformers 5: "rope_parameters" {"rope_theta", "rope_type":
 *    "default" | "yarn", the YaRN fields} and neither top-level key.
 * A file may carry both only where they agree. */
typedef struct rope_spec {
    int present;           /* the object was given (not absent or null) */
    int has_theta;
    double theta;          /* rope_parameters.rope_theta */
    mt_rope_scaling scaling;
} rope_spec;

/* Parses rope_scaling or rope_parameters (`name`; `with_theta`: the latter,
 * which carries rope_theta and may carry partial_rotary_factor). */
static int parse_rope_object(rope_spec *r, json_t *v, const char *ctx, const char *name,
                             int with_theta)
{
    char fp[256], kp[320];
    field_path(fp, sizeof fp, ctx, name);
    memset(r, 0, sizeof *r);
    if (!v || json_is_null(v)) return MT_OK;
    if (!json_is_object(v)) return MT_ERR(MT_EINVAL, "%s: must be an object or null", fp);
    r->present = 1;
    json_t *copy = json_deep_copy(v);
    int rc = MT_OK;
    /* Older configs say "type", transformers 4.4x and later "rope_type"; a
     * converted file may keep both. */
    json_t *t1 = json_object_get(copy, "type"), *t2 = json_object_get(copy, "rope_type");
    json_t *t = t2 ? t2 : t1;
    if (!t || !json_is_string(t)) {
        rc = MT_ERR(MT_EINVAL, "%s.rope_type: required, must be \"yarn\" or \"default\"", fp);
        goto out;
    }
    char type[32]; /* copied: the keys are deleted below */
    snprintf(type, sizeof type, "%s", json_string_value(t));
    if (t1 && t2 && (!json_is_string(t1) || strcmp(json_string_value(t1), type) != 0)) {
        rc = MT_ERR(MT_EINVAL, "%s.type: disagrees with %s.rope_type \"%s\"", fp, fp, type);
        goto out;
    }
    json_object_del(copy, "type");
    json_object_del(copy, "rope_type");
    if (with_theta) {
        json_t *th = json_object_get(copy, "rope_theta");
        if (th) {
            snprintf(kp, sizeof kp, "%s.rope_theta", fp);
            if (!json_is_number(th) || !(json_number_value(th) >= 1) ||
                !(json_number_value(th) <= 1e12)) {
                rc = MT_ERR(MT_EINVAL, "%s: must be a number in [1, 1e12]", kp);
                goto out;
            }
            r->has_theta = 1;
            r->theta = json_number_value(th);
            json_object_del(copy, "rope_theta");
        }
        rc = check_restated(copy, "partial_rotary_factor", 1, fp,
                            "MLA rotates all qk_rope_head_dim dims");
        if (rc < 0) goto out;
    }
    if (strcmp(type, "default") == 0) {
        /* Plain RoPE: any other key would be a setting that does nothing
         * here, which is more likely a mistake than intended. */
        const char *k;
        json_t *x;
        json_object_foreach(copy, k, x)
        {
            if (k[0] == '#') continue;
            rc = MT_ERR(MT_EINVAL, "%s.%s: has no effect with rope_type \"default\"", fp, k);
            goto out;
        }
        goto out;
    }
    if (strcmp(type, "yarn") != 0) {
        rc = MT_ERR(MT_EINVAL, "%s.%s: \"%s\" is not supported (only \"yarn\" or \"default\")",
                    fp, t2 ? "rope_type" : "type", type);
        goto out;
    }
    /* transformers' YaRN options beyond DeepSeek-V3's: "truncate" (true is
     * the DeepSeek-V3 rule: floor / ceil of the correction range) and
     * "attention_factor" (moetrain derives it from mscale / mscale_all_dim). */
    json_t *tr = json_object_get(copy, "truncate");
    if (tr) {
        if (!json_is_true(tr)) {
            rc = MT_ERR(MT_EINVAL, "%s.truncate: only true is supported", fp);
            goto out;
        }
        json_object_del(copy, "truncate");
    }
    if (json_object_get(copy, "attention_factor")) {
        rc = MT_ERR(MT_EINVAL, "%s.attention_factor: not supported (the attention factor comes "
                    "from mscale and mscale_all_dim)", fp);
        goto out;
    }
    rc = mt_fields_defaults(rope_fields, N_ROPE_FIELDS, &r->scaling);
    if (rc == MT_OK) rc = mt_fields_parse(rope_fields, N_ROPE_FIELDS, &r->scaling, copy, fp, 1, NULL);
    if (rc == MT_OK) r->scaling.type = MT_ROPE_SCALING_YARN;
out:
    json_decref(copy);
    return rc;
}

static int same_scaling(const mt_rope_scaling *a, const mt_rope_scaling *b)
{
    return a->type == b->type && a->factor == b->factor && a->beta_fast == b->beta_fast &&
           a->beta_slow == b->beta_slow && a->mscale == b->mscale &&
           a->mscale_all_dim == b->mscale_all_dim &&
           a->original_max_position_embeddings == b->original_max_position_embeddings;
}

/* Sets c->rope_theta and c->rope_scaling from either spelling (see above). */
static int resolve_rope(mt_model_config *c, json_t *root, const char *ctx)
{
    rope_spec rs, rp;
    MT_CHECK(parse_rope_object(&rs, json_object_get(root, "rope_scaling"), ctx, "rope_scaling", 0));
    MT_CHECK(parse_rope_object(&rp, json_object_get(root, "rope_parameters"), ctx,
                               "rope_parameters", 1));
    char fp[256];
    field_path(fp, sizeof fp, ctx, "rope_parameters");
    if (rp.has_theta) {
        /* c->rope_theta holds the top-level value or the default */
        if (json_object_get(root, "rope_theta") && c->rope_theta != rp.theta)
            return MT_ERR(MT_EINVAL, "%s.rope_theta: %g disagrees with rope_theta %g", fp, rp.theta,
                          c->rope_theta);
        c->rope_theta = rp.theta;
    }
    c->rope_scaling = rs.scaling;
    if (rp.present) {
        if (rs.present && !same_scaling(&rs.scaling, &rp.scaling))
            return MT_ERR(MT_EINVAL, "%s: disagrees with rope_scaling (give one of them, or the "
                          "same settings in both)", fp);
        c->rope_scaling = rp.scaling;
    }
    return MT_OK;
}

int mt_config_from_json(mt_model_config *c, json_t *root, const char *ctx, int strict)
{
    /* `strict` no longer matters: since issue 21 every key outside the
     * tables and the ignored list is an error in both modes. */
    (void)strict;
    mt_config_defaults(c);
    if (!json_is_object(root)) return MT_ERR(MT_EINVAL, "%s: must be a JSON object", ctx);
    /* The rotary objects are parsed by resolve_rope; the rest by config_fields. */
    json_t *copy = json_deep_copy(root);
    json_object_del(copy, "rope_scaling");
    json_object_del(copy, "rope_parameters");
    /* Keys transformers 5 writes that restate or fix what the tables say:
     * set aside, checked against the parsed values below. */
    static const char *const restated_keys[] = {"head_dim", "qk_head_dim", "attention_dropout",
                                                "partial_rotary_factor", NULL};
    json_t *restated = json_object();
    for (int i = 0; restated_keys[i]; i++) {
        json_t *x = json_object_get(copy, restated_keys[i]);
        if (!x) continue;
        json_object_set(restated, restated_keys[i], x);
        json_object_del(copy, restated_keys[i]);
    }
    int rc = MT_OK;
    const char *k;
    json_t *v;
    void *tmp;
    json_object_foreach_safe(copy, tmp, k, v)
    {
        if (rc < 0) break;
        if (is_ignored_key(k)) {
            json_object_del(copy, k);
            continue;
        }
        if (k[0] == '#' || mt_fields_find(config_fields, N_CONFIG_FIELDS, k)) continue;
        char fp[256];
        field_path(fp, sizeof fp, ctx, k);
        rc = MT_ERR(MT_EINVAL, "%s: unknown field (it could change the model, so it is refused; "
                    "remove it if it does not)", fp);
    }
    if (rc == MT_OK) rc = mt_fields_parse(config_fields, N_CONFIG_FIELDS, c, copy, ctx, 1, NULL);
    if (rc == MT_OK)
        rc = check_restated(restated, "head_dim", c->qk_rope_head_dim, ctx,
                            "transformers takes the rotary dimension from head_dim, moetrain "
                            "from qk_rope_head_dim");
    if (rc == MT_OK)
        rc = check_restated(restated, "qk_head_dim", mt_config_qk_head_dim(c), ctx,
                            "qk_nope_head_dim + qk_rope_head_dim");
    if (rc == MT_OK)
        rc = check_restated(restated, "attention_dropout", 0, ctx, "moetrain has no dropout");
    if (rc == MT_OK)
        rc = check_restated(restated, "partial_rotary_factor", 1, ctx,
                            "MLA rotates all qk_rope_head_dim dims");
    json_decref(restated);
    json_decref(copy);
    MT_CHECK(rc);
    MT_CHECK(resolve_rope(c, root, ctx));
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
    /* beta_fast == beta_slow is Kimi-K2's setting: a ramp of one step (see
     * rope_table.c); beta_fast below beta_slow would invert the ramp. */
    if (c->rope_scaling.type == MT_ROPE_SCALING_YARN && !(c->rope_scaling.beta_slow > 0))
        return BAD("rope_scaling.beta_slow", "%g must be positive", ctx, dot,
                   c->rope_scaling.beta_slow);
    if (c->rope_scaling.type == MT_ROPE_SCALING_YARN &&
        c->rope_scaling.beta_fast < c->rope_scaling.beta_slow)
        return BAD("rope_scaling.beta_fast", "%g must be at least beta_slow %g", ctx, dot,
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
