/* test_config.c - HF config.json and job spec parsing: good inputs load with
 * the right values, every bad input fails with a message naming the field. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/model/config.h"
#include "engine/model/layers.h"
#include "engine/train/jobspec.h"
#include "engine/parallel/sharding.h"
#include "base/json_util.h"
#include "base/mt_status.h"
#include "test_util.h"

static char tmp[1024];
static char data_prefix[1100];
static const char *examples_dir;

/* The official DeepSeek-V3 config.json, abridged only in auto_map. */
static const char *dsv3_config =
    "{\"architectures\": [\"DeepseekV3ForCausalLM\"], \"attention_bias\": false,"
    " \"attention_dropout\": 0.0, \"auto_map\": {\"AutoConfig\": \"configuration_deepseek.DeepseekV3Config\"},"
    " \"aux_loss_alpha\": 0.001, \"bos_token_id\": 0, \"eos_token_id\": 1, \"ep_size\": 1,"
    " \"first_k_dense_replace\": 3, \"hidden_act\": \"silu\", \"hidden_size\": 7168,"
    " \"initializer_range\": 0.02, \"intermediate_size\": 18432, \"kv_lora_rank\": 512,"
    " \"max_position_embeddings\": 163840, \"model_type\": \"deepseek_v3\","
    " \"moe_intermediate_size\": 2048, \"moe_layer_freq\": 1, \"n_group\": 8,"
    " \"n_routed_experts\": 256, \"n_shared_experts\": 1, \"norm_topk_prob\": true,"
    " \"num_attention_heads\": 128, \"num_experts_per_tok\": 8, \"num_hidden_layers\": 61,"
    " \"num_key_value_heads\": 128, \"num_nextn_predict_layers\": 1, \"pretraining_tp\": 1,"
    " \"q_lora_rank\": 1536, \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64,"
    " \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\","
    " \"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}, \"rms_norm_eps\": 1e-06,"
    " \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 40, \"mscale\": 1.0,"
    " \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096, \"type\": \"yarn\"},"
    " \"rope_theta\": 10000, \"routed_scaling_factor\": 2.5, \"scoring_func\": \"sigmoid\","
    " \"seq_aux\": true, \"tie_word_embeddings\": false, \"topk_group\": 4,"
    " \"topk_method\": \"noaux_tc\", \"torch_dtype\": \"bfloat16\","
    " \"transformers_version\": \"4.33.1\", \"use_cache\": true, \"v_head_dim\": 128,"
    " \"vocab_size\": 129280}";

/* The same model as transformers 5 saves it: the rotary settings move into
 * rope_parameters (rope_theta inside, rope_type), head_dim and qk_head_dim
 * are written out, torch_dtype is now dtype. */
static const char *dsv3_config_tf5 =
    "{\"architectures\": [\"DeepseekV3ForCausalLM\"], \"attention_bias\": false,"
    " \"attention_dropout\": 0.0, \"bos_token_id\": 0, \"dtype\": \"bfloat16\","
    " \"eos_token_id\": 1, \"first_k_dense_replace\": 3, \"head_dim\": 64,"
    " \"hidden_act\": \"silu\", \"hidden_size\": 7168, \"initializer_range\": 0.02,"
    " \"intermediate_size\": 18432, \"kv_lora_rank\": 512, \"max_position_embeddings\": 163840,"
    " \"model_type\": \"deepseek_v3\", \"moe_intermediate_size\": 2048, \"n_group\": 8,"
    " \"n_routed_experts\": 256, \"n_shared_experts\": 1, \"norm_topk_prob\": true,"
    " \"num_attention_heads\": 128, \"num_experts_per_tok\": 8, \"num_hidden_layers\": 61,"
    " \"num_key_value_heads\": 128, \"num_nextn_predict_layers\": 1, \"pad_token_id\": null,"
    " \"pretraining_tp\": 1, \"q_lora_rank\": 1536, \"qk_head_dim\": 192,"
    " \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64, \"rms_norm_eps\": 1e-06,"
    " \"rope_interleave\": true, \"rope_parameters\": {\"beta_fast\": 32.0, \"beta_slow\": 1.0,"
    " \"factor\": 40.0, \"mscale\": 1.0, \"mscale_all_dim\": 1.0,"
    " \"original_max_position_embeddings\": 4096, \"rope_theta\": 10000.0,"
    " \"rope_type\": \"yarn\", \"type\": \"yarn\"}, \"routed_scaling_factor\": 2.5,"
    " \"scoring_func\": \"sigmoid\", \"tie_word_embeddings\": false, \"topk_group\": 4,"
    " \"topk_method\": \"noaux_tc\", \"transformers_version\": \"5.0.0\", \"use_cache\": true,"
    " \"v_head_dim\": 128, \"vocab_size\": 129280}";

/* Kimi-K2's rotary settings (config.json of moonshotai/Kimi-K2-Instruct,
 * the other fields abridged): YaRN with beta_fast == beta_slow. */
#define KIMI_K2_ROPE_TF4                                                                   \
    "\"max_position_embeddings\": 131072, \"rope_theta\": 50000.0,"                         \
    " \"rope_scaling\": {\"beta_fast\": 1.0, \"beta_slow\": 1.0, \"factor\": 32.0,"         \
    " \"mscale\": 1.0, \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096," \
    " \"type\": \"yarn\"}"
#define KIMI_K2_ROPE_TF5                                                                   \
    "\"max_position_embeddings\": 131072, \"rope_parameters\": {\"beta_fast\": 1.0,"        \
    " \"beta_slow\": 1.0, \"factor\": 32.0, \"mscale\": 1.0, \"mscale_all_dim\": 1.0,"      \
    " \"original_max_position_embeddings\": 4096, \"rope_theta\": 50000.0,"                 \
    " \"rope_type\": \"yarn\"}"
#define KIMI_K2_REST                                                                       \
    "\"architectures\": [\"DeepseekV3ForCausalLM\"], \"model_type\": \"kimi_k2\","          \
    " \"aux_loss_alpha\": 0.001, \"seq_aux\": true, \"ep_size\": 1, \"first_k_dense_replace\": 1," \
    " \"n_group\": 1, \"topk_group\": 1, \"n_routed_experts\": 384, \"num_attention_heads\": 64," \
    " \"num_key_value_heads\": 64, \"routed_scaling_factor\": 2.827, \"vocab_size\": 163840"

static int setup(void **state)
{
    (void)state;
    mt_test_tmpdir(tmp, sizeof tmp, "test_config");
    snprintf(data_prefix, sizeof data_prefix, "%s/corpus", tmp);
    char f[1200];
    snprintf(f, sizeof f, "%s.idx", data_prefix);
    mt_test_write_file(f, "x");
    snprintf(f, sizeof f, "%s.bin", data_prefix);
    mt_test_write_file(f, "x");
    return 0;
}

static void test_defaults_are_deepseek_v3(void **state)
{
    (void)state;
    mt_model_config c;
    mt_config_defaults(&c);
    assert_int_equal(c.vocab_size, 129280);
    assert_int_equal(c.hidden_size, 7168);
    assert_int_equal(c.num_hidden_layers, 61);
    assert_int_equal(c.q_lora_rank, 1536);
    assert_int_equal(c.n_routed_experts, 256);
    assert_int_equal(c.num_experts_per_tok, 8);
    assert_true(c.routed_scaling_factor == 2.5);
    assert_int_equal(c.scoring_func, MT_SCORING_SIGMOID);
    assert_int_equal(c.rope_scaling.type, MT_ROPE_SCALING_NONE);
    assert_int_equal(mt_config_validate(&c, ""), MT_OK);
}

static void test_official_config_json_loads_as_is(void **state)
{
    (void)state;
    char path[1200];
    snprintf(path, sizeof path, "%s/config.json", tmp);
    mt_test_write_file(path, dsv3_config);
    mt_model_config c;
    assert_int_equal(mt_config_load(&c, path), MT_OK);
    assert_int_equal(c.num_hidden_layers, 61);
    assert_int_equal(c.first_k_dense_replace, 3);
    assert_int_equal(c.num_nextn_predict_layers, 1);
    assert_int_equal(c.rope_scaling.type, MT_ROPE_SCALING_YARN);
    assert_true(c.rope_scaling.factor == 40);
    assert_int_equal(c.rope_scaling.original_max_position_embeddings, 4096);
    assert_true(c.rope_scaling.mscale_all_dim == 1.0);
    assert_int_equal(c.topk_method, MT_TOPK_NOAUX_TC);
    assert_int_equal(mt_config_qk_head_dim(&c), 192);
    assert_false(mt_config_layer_is_moe(&c, 2));
    assert_true(mt_config_layer_is_moe(&c, 3));
}

static void test_null_q_lora_rank_means_plain_q_proj(void **state)
{
    (void)state;
    json_t *j = json_loads("{\"q_lora_rank\": null}", 0, NULL);
    mt_model_config c;
    assert_int_equal(mt_config_from_json(&c, j, "model", 1), MT_OK);
    assert_int_equal(c.q_lora_rank, 0);
    json_decref(j);
}

/* Parses `model` (inline JSON text) and expects failure naming `needle`. */
static void expect_model_error(const char *model, const char *needle)
{
    json_t *j = json_loads(model, 0, NULL);
    assert_non_null(j);
    mt_model_config c;
    int rc = mt_config_from_json(&c, j, "model", 1);
    json_decref(j);
    if (rc != MT_EINVAL) fprintf(stderr, "model %s: rc %d\n", model, rc);
    assert_int_equal(rc, MT_EINVAL);
    assert_contains(mt_errmsg(), needle);
}

static void test_bad_model_configs_name_the_field(void **state)
{
    (void)state;
    expect_model_error("{\"n_routed_experts\": 10, \"n_group\": 4}", "model.n_routed_experts");
    expect_model_error("{\"topk_group\": 9}", "model.topk_group");
    expect_model_error("{\"qk_rope_head_dim\": 63}", "model.qk_rope_head_dim");
    expect_model_error("{\"hidden_size\": 0}", "model.hidden_size");
    expect_model_error("{\"hidden_size\": \"big\"}", "model.hidden_size: must be an integer");
    expect_model_error("{\"hiden_size\": 64}", "model.hiden_size: unknown field");
    expect_model_error("{\"hidden_act\": \"gelu\"}", "model.hidden_act");
    expect_model_error("{\"scoring_func\": \"relu\"}", "model.scoring_func");
    expect_model_error("{\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}}",
                       "model.rope_scaling.type");
    expect_model_error("{\"rope_scaling\": {\"type\": \"yarn\"}}", "model.rope_scaling.factor");
    expect_model_error("{\"num_experts_per_tok\": 300}", "model.num_experts_per_tok");
    expect_model_error("{\"first_k_dense_replace\": 99, \"num_hidden_layers\": 4}",
                       "model.first_k_dense_replace");
}


/* Parses config text as a downloaded config.json is parsed; expects MT_OK. */
static void parse_config(const char *text, mt_model_config *c)
{
    json_error_t e;
    json_t *j = json_loads(text, 0, &e);
    if (!j) fprintf(stderr, "bad test JSON: %s\n", e.text);
    assert_non_null(j);
    int rc = mt_config_from_json(c, j, "config.json", 0);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    json_decref(j);
    assert_int_equal(rc, MT_OK);
}

/* Two configs are the same model: their JSON forms are equal. */
static void assert_same_config(const mt_model_config *a, const mt_model_config *b)
{
    json_t *ja = mt_config_to_json(a), *jb = mt_config_to_json(b);
    char *sa = json_dumps(ja, JSON_SORT_KEYS), *sb = json_dumps(jb, JSON_SORT_KEYS);
    assert_string_equal(sa, sb);
    free(sa), free(sb);
    json_decref(ja), json_decref(jb);
}

/* Both spellings' RoPE tables (cos, sin over T positions, softmax scale)
 * are bit-identical. */
static void assert_same_rope_tables(const mt_model_config *a, const mt_model_config *b)
{
    enum { T = 4096 };
    const size_t n = (size_t)T * (size_t)(a->qk_rope_head_dim / 2);
    float *ca = malloc(n * sizeof *ca), *sa = malloc(n * sizeof *sa);
    float *cb = malloc(n * sizeof *cb), *sb = malloc(n * sizeof *sb);
    float scale_a, scale_b;
    assert_int_equal(mt_rope_tables(a, T, ca, sa, &scale_a), MT_OK);
    assert_int_equal(mt_rope_tables(b, T, cb, sb, &scale_b), MT_OK);
    assert_int_equal(memcmp(ca, cb, n * sizeof *ca), 0);
    assert_int_equal(memcmp(sa, sb, n * sizeof *sa), 0);
    assert_true(scale_a == scale_b);
    free(ca), free(sa), free(cb), free(sb);
}

static void test_transformers5_rope_parameters_give_the_same_model(void **state)
{
    (void)state;
    mt_model_config a, b;
    /* DeepSeek-V3, written by transformers 4 (the release) and by transformers 5 */
    parse_config(dsv3_config, &a);
    parse_config(dsv3_config_tf5, &b);
    assert_int_equal(b.rope_scaling.type, MT_ROPE_SCALING_YARN);
    assert_true(b.rope_scaling.factor == 40);
    assert_int_equal(b.rope_scaling.original_max_position_embeddings, 4096);
    assert_true(b.rope_theta == 10000);
    assert_same_config(&a, &b);
    assert_same_rope_tables(&a, &b);
    /* Kimi-K2 (rope_theta 50000, not the default) in both spellings */
    parse_config("{" KIMI_K2_ROPE_TF4 ", " KIMI_K2_REST "}", &a);
    parse_config("{" KIMI_K2_ROPE_TF5 ", " KIMI_K2_REST "}", &b);
    assert_true(b.rope_theta == 50000);
    assert_true(b.rope_scaling.factor == 32);
    assert_same_config(&a, &b);
    assert_same_rope_tables(&a, &b);
    /* plain RoPE: rope_type "default" */
    parse_config("{\"rope_theta\": 50000}", &a);
    parse_config("{\"rope_parameters\": {\"rope_theta\": 50000, \"rope_type\": \"default\"}}", &b);
    assert_int_equal(b.rope_scaling.type, MT_ROPE_SCALING_NONE);
    assert_true(b.rope_theta == 50000);
    assert_same_rope_tables(&a, &b);
    /* both spellings in one file are fine where they agree */
    parse_config("{" KIMI_K2_ROPE_TF4 "}", &a);
    parse_config("{" KIMI_K2_ROPE_TF4 ", \"rope_parameters\": {\"beta_fast\": 1, \"beta_slow\": 1,"
                 " \"factor\": 32, \"mscale\": 1, \"mscale_all_dim\": 1,"
                 " \"original_max_position_embeddings\": 4096, \"rope_theta\": 50000,"
                 " \"rope_type\": \"yarn\"}}", &b);
    assert_same_rope_tables(&a, &b);
}

static void test_kimi_k2_config_loads(void **state)
{
    (void)state;
    mt_model_config c;
    parse_config("{" KIMI_K2_ROPE_TF4 ", " KIMI_K2_REST "}", &c);
    assert_int_equal(c.rope_scaling.type, MT_ROPE_SCALING_YARN);
    assert_true(c.rope_scaling.beta_fast == 1 && c.rope_scaling.beta_slow == 1);
    assert_true(c.rope_theta == 50000);
    assert_int_equal(c.n_routed_experts, 384);
}

/* Parses config text as a downloaded config.json; expects an error naming `needle`. */
static void expect_config_json_error(const char *text, const char *needle)
{
    json_t *j = json_loads(text, 0, NULL);
    assert_non_null(j);
    mt_model_config c;
    int rc = mt_config_from_json(&c, j, "config.json", 0);
    json_decref(j);
    if (rc != MT_EINVAL) fprintf(stderr, "config %s: rc %d\n", text, rc);
    assert_int_equal(rc, MT_EINVAL);
    assert_contains(mt_errmsg(), needle);
}

static void test_unknown_keys_that_could_change_the_math_are_errors(void **state)
{
    (void)state;
    /* a downloaded config.json used to log these at debug level and go on */
    expect_config_json_error("{\"mlp_bias\": true}", "config.json.mlp_bias: unknown field");
    expect_config_json_error("{\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4,"
                             " \"original_max_position_embeddings\": 64, \"attention_factor\": 2}}",
                             "config.json.rope_parameters.attention_factor");
    expect_config_json_error("{\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4,"
                             " \"original_max_position_embeddings\": 64, \"beta_fastt\": 2}}",
                             "config.json.rope_scaling.beta_fastt: unknown field");
    expect_config_json_error("{\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4,"
                             " \"original_max_position_embeddings\": 64, \"truncate\": false}}",
                             "config.json.rope_parameters.truncate");
    expect_config_json_error("{\"rope_parameters\": {\"rope_type\": \"llama3\", \"factor\": 8}}",
                             "config.json.rope_parameters.rope_type: \"llama3\" is not supported");
    expect_config_json_error("{\"rope_parameters\": {\"rope_type\": \"default\", \"factor\": 8}}",
                             "config.json.rope_parameters.factor: has no effect");
    expect_config_json_error("{\"rope_parameters\": {\"rope_theta\": 10000,"
                             " \"partial_rotary_factor\": 0.5, \"rope_type\": \"default\"}}",
                             "config.json.rope_parameters.partial_rotary_factor: 0.5");
    expect_config_json_error("{\"partial_rotary_factor\": 0.5}", "config.json.partial_rotary_factor");
    expect_config_json_error("{\"head_dim\": 128}", "config.json.head_dim: 128 is not supported");
    expect_config_json_error("{\"qk_head_dim\": 128}", "config.json.qk_head_dim");
    expect_config_json_error("{\"attention_dropout\": 0.1}", "config.json.attention_dropout");
    /* the two spellings must agree where both are given */
    expect_config_json_error("{\"rope_theta\": 10000, \"rope_parameters\": {\"rope_theta\": 50000,"
                             " \"rope_type\": \"default\"}}",
                             "config.json.rope_parameters.rope_theta: 50000 disagrees");
    expect_config_json_error("{" KIMI_K2_ROPE_TF4 ", \"rope_parameters\": {\"rope_type\": \"yarn\","
                             " \"factor\": 40, \"original_max_position_embeddings\": 4096}}",
                             "config.json.rope_parameters: disagrees with rope_scaling");
    expect_config_json_error("{\"rope_scaling\": {\"type\": \"yarn\", \"rope_type\": \"linear\","
                             " \"factor\": 4}}", "config.json.rope_scaling.type: disagrees");
    /* a ramp from beta_slow down to beta_fast would be upside down */
    expect_config_json_error("{\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4,"
                             " \"original_max_position_embeddings\": 64, \"beta_fast\": 1,"
                             " \"beta_slow\": 2}}", "config.json.rope_scaling.beta_fast: 1 must be at least");
}

static void test_keys_irrelevant_to_training_are_ignored(void **state)
{
    (void)state;
    mt_model_config a, b;
    parse_config("{}", &a);
    parse_config("{\"architectures\": [\"DeepseekV3ForCausalLM\"], \"auto_map\": {},"
                 " \"model_type\": \"deepseek_v3\", \"transformers_version\": \"5.0.0\","
                 " \"torch_dtype\": \"bfloat16\", \"dtype\": \"bfloat16\", \"_name_or_path\": \"x\","
                 " \"bos_token_id\": 0, \"eos_token_id\": 1, \"pad_token_id\": null,"
                 " \"use_cache\": true, \"quantization_config\": {\"fmt\": \"e4m3\"},"
                 " \"ep_size\": 8, \"pretraining_tp\": 1, \"aux_loss_alpha\": 0.001,"
                 " \"seq_aux\": true, \"head_dim\": 64, \"qk_head_dim\": 192,"
                 " \"attention_dropout\": 0.0, \"partial_rotary_factor\": 1.0}", &b);
    assert_same_config(&a, &b);
}

static void load_example(const char *name, mt_jobspec *j, const char *const *extra, int n_extra)
{
    char path[1200], set[1200];
    snprintf(path, sizeof path, "%s/%s", examples_dir, name);
    snprintf(set, sizeof set, "data.path=%s", data_prefix);
    const char *sets[8] = {set};
    for (int i = 0; i < n_extra; i++) sets[1 + i] = extra[i];
    int rc = mt_jobspec_load(j, path, sets, 1 + n_extra);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
}

static void test_examples_load(void **state)
{
    (void)state;
    mt_jobspec j;
    load_example("tiny-cpu.json", &j, NULL, 0);
    assert_string_equal(j.name, "tiny-cpu");
    assert_int_equal(j.backend, MT_BACKEND_CPU);
    assert_int_equal(j.model.n_routed_experts, 8);
    assert_int_equal(j.model.n_group, 4);
    assert_int_equal(j.model.num_nextn_predict_layers, 1);
    assert_int_equal(j.precision.recipe, MT_RECIPE_FP8_BLOCKWISE);
    assert_string_equal(j.data.path, data_prefix);
    assert_int_equal(mt_jobspec_eod(&j), 63);

    load_example("dsv3-proxy.json", &j, NULL, 0);
    assert_int_equal(j.backend, MT_BACKEND_CUDA);
    assert_int_equal(j.model.hidden_size, 7168);
    assert_int_equal(j.model.num_attention_heads, 128);
    assert_int_equal(j.model.q_lora_rank, 1536);
    assert_int_equal(j.model.kv_lora_rank, 512);
    assert_int_equal(j.model.moe_intermediate_size, 2048);
    assert_int_equal(j.model.intermediate_size, 18432);
    assert_int_equal(j.model.vocab_size, 129280);
    assert_int_equal(j.model.num_hidden_layers, 4);
    assert_int_equal(j.model.first_k_dense_replace, 1);
    assert_int_equal(j.model.n_routed_experts, 32);
    assert_int_equal(j.model.num_experts_per_tok, 8);
    assert_int_equal(j.batch.seq_len, 4096);
    assert_int_equal(j.batch.micro_batch_size, 1);
    assert_int_equal(j.model.rope_scaling.type, MT_ROPE_SCALING_YARN);
}

static void test_set_overrides_job_and_model_fields(void **state)
{
    (void)state;
    mt_jobspec j;
    const char *sets[] = {"train.steps=50", "model.num_hidden_layers=3",
                          "precision.recipe=bf16", "checkpoint.async=false",
                          "optimizer.lr=1e-3"};
    load_example("tiny-cpu.json", &j, sets, 5);
    assert_int_equal(j.train.steps, 50);
    assert_int_equal(j.model.num_hidden_layers, 3);
    assert_int_equal(j.precision.recipe, MT_RECIPE_BF16);
    assert_int_equal(j.checkpoint.async, 0);
    assert_true(j.optimizer.lr == 1e-3);
}

static void test_model_by_path_is_relative_to_the_spec(void **state)
{
    (void)state;
    char path[1200], spec[3000];
    snprintf(path, sizeof path, "%s/config.json", tmp);
    mt_test_write_file(path, dsv3_config);
    snprintf(path, sizeof path, "%s/job.json", tmp);
    snprintf(spec, sizeof spec,
             "{\"model\": \"config.json\", \"data\": {\"path\": \"corpus\"},"
             " \"train\": {\"steps\": 5}}");
    mt_test_write_file(path, spec);
    mt_jobspec j;
    const char *sets[] = {"model.num_hidden_layers=4", "model.rope_scaling.factor=8"};
    int rc = mt_jobspec_load(&j, path, sets, 2);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
    assert_int_equal(j.model.hidden_size, 7168);
    assert_int_equal(j.model.num_hidden_layers, 4);
    assert_true(j.model.rope_scaling.factor == 8);
    assert_string_equal(j.data.path, data_prefix);
    assert_contains(j.model_path, "config.json");
}

static void test_to_json_round_trips(void **state)
{
    (void)state;
    mt_jobspec a, b;
    load_example("dsv3-proxy.json", &a, NULL, 0);
    json_t *ja = mt_jobspec_to_json(&a);
    assert_int_equal(mt_jobspec_from_json(&b, ja, NULL, NULL, 0), MT_OK);
    json_t *jb = mt_jobspec_to_json(&b);
    char *sa = json_dumps(ja, JSON_SORT_KEYS), *sb = json_dumps(jb, JSON_SORT_KEYS);
    assert_string_equal(sa, sb);
    free(sa);
    free(sb);
    json_decref(ja);
    json_decref(jb);
}

/* Admits the tiny example with overrides for `world` ranks; expects the
 * refusal to contain every needle (NULL-terminated), or success if none. */
static void expect_admission(int world, const char *const *extra, int n_extra,
                             const char *const *needles, mt_jobspec *out)
{
    mt_jobspec j;
    load_example("tiny-cpu.json", &j, extra, n_extra);
    int rc = mt_jobspec_admit(&j, world);
    if (!needles || !needles[0]) {
        if (rc) fprintf(stderr, "refused: %s\n", mt_errmsg());
        assert_int_equal(rc, MT_OK);
        if (out) *out = j;
        return;
    }
    if (rc >= 0) fprintf(stderr, "admitted a layout that should be refused\n");
    assert_true(rc < 0);
    for (int i = 0; needles[i]; i++) {
        if (!strstr(mt_errmsg(), needles[i]))
            fprintf(stderr, "\"%s\" lacks \"%s\"\n", mt_errmsg(), needles[i]);
        assert_contains(mt_errmsg(), needles[i]);
    }
}

static void test_admission_checks_the_layout_against_the_ranks(void **state)
{
    (void)state;
    mt_jobspec j;
    /* tp 2 on one rank: refused, naming the layout and the world size */
    const char *tp2[] = {"parallel.tp=2"};
    const char *tp2_err[] = {"layout tp=2,pp=1,vpp=1,ep=1,etp=1,dp=0", "1 rank runs the job",
                             "tp 2 x pp 1 = 2", NULL};
    expect_admission(1, tp2, 1, tp2_err, NULL);
    /* an explicit dp that does not match the world */
    const char *dp2[] = {"parallel.dp=2"};
    const char *dp2_err[] = {"needs tp 1 x pp 1 x dp 2 = 2 ranks, but 3 ranks run the job", NULL};
    expect_admission(3, dp2, 1, dp2_err, NULL);
    /* dp derived from the world; micro-batches per rank follow the derived dp */
    const char *ep2[] = {"parallel.ep=2", "batch.micro_batch_size=1"};
    expect_admission(4, ep2, 2, NULL, &j);
    assert_int_equal(j.parallel.dp, 4);
    assert_int_equal(mt_layout_edp(&j.parallel), 2);
    assert_int_equal(mt_layout_world(&j.parallel), 4);
    assert_int_equal(mt_jobspec_grad_accum(&j), 8 / (1 * 4));
    /* tensor parallelism runs (bf16: the tiny model's splits are not FP8 blocks) */
    const char *bf16_tp2[] = {"parallel.tp=2", "precision.recipe=bf16"};
    expect_admission(4, bf16_tp2, 2, NULL, &j);
    assert_int_equal(j.parallel.dp, 2);
    /* ... with ep folded over the tp x dp ranks */
    const char *tp2_ep2[] = {"parallel.tp=2", "parallel.ep=2", "precision.recipe=bf16",
                             "batch.micro_batch_size=1"};
    expect_admission(4, tp2_ep2, 4, NULL, &j);
    assert_int_equal(mt_layout_edp(&j.parallel), 2);
    /* ... and expert tensor parallelism on the tp ranks (etp 2 x tp 2, edp 2) */
    const char *etp2[] = {"parallel.tp=2", "parallel.etp=2", "precision.recipe=bf16",
                          "batch.micro_batch_size=1"};
    expect_admission(4, etp2, 4, NULL, &j);
    assert_int_equal(mt_layout_edp(&j.parallel), 2);
    /* ... and with pipeline parallelism (tp 2 x pp 2 x etp 2, DualPipeV) */
    const char *etp_dv[] = {"parallel.tp=2", "parallel.pp=2", "parallel.etp=2",
                            "precision.recipe=bf16", "batch.micro_batch_size=1",
                            "parallel.schedule=dualpipev", "model.num_hidden_layers=4"};
    expect_admission(4, etp_dv, 7, NULL, &j);
    assert_int_equal(j.parallel.etp, 2);
    /* ... but expert tensor parallelism over ep and dp runs: etp 2 x ep 2
     * fold the 4 data-parallel ranks (edp 1) */
    const char *etp2_ep2[] = {"parallel.etp=2", "parallel.ep=2", "batch.micro_batch_size=1",
                              "precision.recipe=bf16"};
    expect_admission(4, etp2_ep2, 4, NULL, &j);
    assert_int_equal(j.parallel.dp, 4);
    assert_int_equal(mt_layout_edp(&j.parallel), 1);
    /* parallel.pp_layers: one entry per chunk, summing to the model's layers */
    const char *ppl_ok[] = {"parallel.pp=2", "parallel.pp_layers=0,2", "batch.micro_batch_size=1"};
    expect_admission(2, ppl_ok, 3, NULL, &j);
    assert_int_equal(j.parallel.n_pp_layers, 2);
    int lo, hi;
    mt_layout_chunk_layers(&j.parallel, &j.model, 1, &lo, &hi);
    assert_int_equal(lo, 0);
    assert_int_equal(hi, 2);
    const char *ppl_n[] = {"parallel.pp=2", "parallel.pp_layers=1,0,1", "batch.micro_batch_size=1"};
    const char *ppl_n_err[] = {"parallel.pp_layers has 3 entries", "pp 2 x vpp 1 = 2", NULL};
    expect_admission(2, ppl_n, 3, ppl_n_err, NULL);
    const char *ppl_sum[] = {"parallel.pp=2", "parallel.pp_layers=1,2", "batch.micro_batch_size=1"};
    const char *ppl_sum_err[] = {"parallel.pp_layers places 3 decoder layers",
                                 "num_hidden_layers 2", NULL};
    expect_admission(2, ppl_sum, 3, ppl_sum_err, NULL);
    /* pipeline parallelism runs, with tensor, expert and expert tensor
     * parallelism too (each stage's dp ranks refold as ep x edp, or as
     * etp x ep x edp) */
    const char *pp2[] = {"parallel.pp=2", "batch.micro_batch_size=1"};
    expect_admission(2, pp2, 2, NULL, &j);
    assert_int_equal(j.parallel.dp, 1);
    const char *pp2ep2[] = {"parallel.pp=2", "parallel.ep=2", "batch.micro_batch_size=1"};
    expect_admission(4, pp2ep2, 3, NULL, &j);
    assert_int_equal(j.parallel.dp, 2);
    assert_int_equal(mt_layout_edp(&j.parallel), 1);
    const char *pp2etp2[] = {"parallel.pp=2", "parallel.ep=2", "parallel.etp=2",
                             "batch.micro_batch_size=1", "precision.recipe=bf16"};
    expect_admission(8, pp2etp2, 5, NULL, &j);
    assert_int_equal(j.parallel.dp, 4);
    assert_int_equal(mt_layout_edp(&j.parallel), 1);
    const char *pp2tp2[] = {"parallel.pp=2", "parallel.tp=2", "precision.recipe=bf16",
                            "batch.micro_batch_size=1"};
    expect_admission(4, pp2tp2, 4, NULL, &j);
    assert_int_equal(j.parallel.dp, 1);
    /* the batch must divide over the derived dp: 8 sequences, mbs 4, dp 4 */
    const char *dp4_err[] = {"batch.global_batch_size: 8 is not divisible by "
                             "batch.micro_batch_size 4 x data-parallel size 4", NULL};
    expect_admission(4, NULL, 0, dp4_err, NULL);
    /* expert folding: ep 4 over tp 1 x dp 2 ranks */
    const char *ep4[] = {"parallel.ep=4", "batch.micro_batch_size=1"};
    const char *ep4_err[] = {"etp 1 x ep 4 = 4 must divide tp 1 x dp 2 = 2", NULL};
    expect_admission(2, ep4, 2, ep4_err, NULL);
    /* a split that does not divide the model */
    const char *ep3[] = {"parallel.ep=3"};
    const char *ep3_err[] = {"parallel: ", "layout tp=1,pp=1,vpp=1,ep=3,etp=1,dp=3", "ep 3 does not divide n_routed_experts 8", NULL};
    expect_admission(3, ep3, 1, ep3_err, NULL);
    /* FP8: tp 2 would cut q_b_proj's 192 rows into 96, inside a 128 block */
    const char *fp8_tp2[] = {"parallel.tp=2", "batch.micro_batch_size=1"};
    const char *fp8_err[] = {"not a multiple of 128", "128x128 scale block would be cut", NULL};
    expect_admission(2, fp8_tp2, 2, fp8_err, NULL);
}

/* Loads a job spec from text with the data files present; expects failure. */
static void expect_job_error(const char *text, const char *const *sets, int n_sets,
                             const char *needle)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/bad.json", tmp);
    mt_test_write_file(path, text);
    mt_jobspec j;
    int rc = mt_jobspec_load(&j, path, sets, n_sets);
    if (rc >= 0) fprintf(stderr, "accepted: %s\n", text);
    assert_true(rc < 0);
    assert_contains(mt_errmsg(), needle);
}

#define TINY "\"model\": {\"vocab_size\": 64, \"hidden_size\": 64, \"n_routed_experts\": 8," \
             " \"n_group\": 4, \"topk_group\": 2, \"num_experts_per_tok\": 2}"
#define DATA "\"data\": {\"path\": \"corpus\"}"

static void test_bad_job_specs_name_the_field(void **state)
{
    (void)state;
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"stpes\": 5}}", NULL, 0,
                     "train.stpes: unknown field");
    expect_job_error("{" TINY ", " DATA "}", NULL, 0, "train.steps: required field is missing");
    expect_job_error("{" DATA ", \"train\": {\"steps\": 5}}", NULL, 0, "model: required");
    expect_job_error("{" TINY ", \"data\": {\"path\": \"nothere\"}, \"train\": {\"steps\": 5}}",
                     NULL, 0, "data.path: ");
    expect_job_error("{" TINY ", \"data\": {\"path\": \"nothere\"}, \"train\": {\"steps\": 5}}",
                     NULL, 0, "nothere.idx does not exist");
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5},"
                     " \"batch\": {\"micro_batch_size\": 3, \"global_batch_size\": 8}}",
                     NULL, 0, "batch.global_batch_size: 8 is not divisible");
    expect_job_error("{\"model\": {\"n_routed_experts\": 10, \"n_group\": 4}, " DATA
                     ", \"train\": {\"steps\": 5}}",
                     NULL, 0, "model.n_routed_experts: 10 is not divisible by n_group 4");
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5},"
                     " \"parallel\": {\"pp\": 2, \"pp_layers\": \"1,x\"}}",
                     NULL, 0, "parallel.pp_layers: \"1,x\" must be a comma-separated list");
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5},"
                     " \"precision\": {\"recipe\": \"fp4\"}}",
                     NULL, 0, "precision.recipe: \"fp4\" is not one of");
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5},"
                     " \"batch\": {\"seq_len\": 100000}}",
                     NULL, 0, "batch.seq_len");
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5},"
                     " \"optimizer\": {\"lr\": -1}}",
                     NULL, 0, "optimizer.lr: -1 is out of range");
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5}, \"data\": 3}", NULL, 0,
                     "duplicate"); /* duplicate keys are rejected by the JSON reader */
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5,}}", NULL, 0, "bad.json:1:");
    const char *bad_set[] = {"train.stepz=3"};
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5}}", bad_set, 1,
                     "--set train.stepz: unknown field");
    const char *bad_val[] = {"train.steps=many"};
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5}}", bad_val, 1,
                     "train.steps: \"many\" is not an integer");
    const char *bad_model_set[] = {"model.n_group=3"};
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5}}", bad_model_set, 1,
                     "model.n_routed_experts: 8 is not divisible by n_group 3");
    expect_job_error("{" TINY ", " DATA ", \"train\": {\"steps\": 5}, \"init\": {\"kind\": \"hf\"}}",
                     NULL, 0, "init.path: required");
}

/* Loads a job spec (text, --set overrides) and expects bad input: MT_EINVAL
 * with `needle` in the message, never "out of memory". */
static void expect_invalid(const char *text, const char *set, const char *needle)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/bad_input.json", tmp);
    mt_test_write_file(path, text);
    mt_jobspec j;
    const char *sets[1] = {set};
    int rc = mt_jobspec_load(&j, path, sets, set ? 1 : 0);
    if (rc != MT_EINVAL) fprintf(stderr, "status %d for %s / %s: %s\n", rc, text, set, mt_errmsg());
    assert_int_equal(rc, MT_EINVAL);
    assert_contains(mt_errmsg(), needle);
    assert_null(strstr(mt_errmsg(), "out of memory"));
}

/* Issue 21, defect 5: NaN, infinities and invalid UTF-8 are invalid input
 * that names the field, in a --set override and in the job spec file alike
 * (they were "out of memory", which StartJob answered RESOURCE_EXHAUSTED). */
static void test_nonfinite_and_bad_utf8_name_the_field(void **state)
{
    (void)state;
    const char *ok = "{" TINY ", " DATA ", \"train\": {\"steps\": 5}}";
    /* --set: every numeric type, the model's free-form rope_scaling numbers,
     * strings and enums */
    expect_invalid(ok, "optimizer.lr=nan", "optimizer.lr: \"nan\" is not a finite number");
    expect_invalid(ok, "optimizer.lr=inf", "optimizer.lr: \"inf\" is not a finite number");
    expect_invalid(ok, "optimizer.lr=-Infinity", "optimizer.lr: \"-Infinity\" is not a finite");
    expect_invalid(ok, "optimizer.lr=1e999", "optimizer.lr: \"1e999\" is not a finite number");
    expect_invalid(ok, "train.steps=inf", "train.steps: \"inf\" is not an integer of 64 bits");
    expect_invalid(ok, "train.steps=1e30", "train.steps: \"1e30\" is not an integer of 64 bits");
    expect_invalid(ok, "train.steps=nan", "train.steps: \"nan\" is not an integer");
    expect_invalid(ok, "model.rope_scaling.factor=nan", "model.rope_scaling.factor: \"nan\" is not");
    expect_invalid(ok, "name=a\xff", "name: not valid UTF-8 (byte 0xff at offset 1)");
    expect_invalid(ok, "precision.recipe=\xc3(", "precision.recipe: not valid UTF-8 (byte 0xc3");
    expect_invalid(ok, "data.path=x\xed\xa0\x80", "data.path: not valid UTF-8"); /* a surrogate */
    expect_invalid(ok, "name=\xc0\xae", "name: not valid UTF-8"); /* an overlong '.' */
    /* the file: what JSON cannot say, found at the field */
    expect_invalid("{" TINY ", " DATA ", \"train\": {\"steps\": 5}, \"optimizer\": {\"lr\": NaN}}",
                   NULL, "optimizer.lr: invalid token near 'NaN' (NaN and Infinity are not JSON");
    expect_invalid("{" TINY ", " DATA ", \"train\": {\"steps\": 5}, \"optimizer\": {\"lr\": -Infinity}}",
                   NULL, "optimizer.lr: invalid token near '-' (NaN and Infinity");
    expect_invalid("{" TINY ", " DATA ", \"train\": {\"steps\": 1e999}}", NULL,
                   "train.steps: real number overflow");
    expect_invalid("{" TINY ", " DATA ", \"train\": {\"steps\": 5}, \"name\": \"t\xff\"}", NULL,
                   "name: unable to decode byte 0xff");
    expect_invalid("{\"model\": {\"vocab_size\": 64, \"hidden_\xff\": 1}}", NULL,
                   "a key in model: unable to decode byte 0xff");
    expect_invalid("{" TINY ", " DATA ", \"train\": {\"steps\": 5}, \"name\": \"a\\ud800b\"}", NULL,
                   "name: invalid Unicode");
}

/* A reader error's place: the path of the field at a byte of the text. */
static void test_json_path_at_names_the_field(void **state)
{
    (void)state;
    const char *t = "{\"a\": {\"b\": [1, {\"c\": X}], \"d\": \"x\\\"y\", \"e\": Y}}";
    char out[256];
    mt_json_path_at(t, (size_t)(strchr(t, 'X') - t + 1), out, sizeof out);
    assert_string_equal(out, "a.b[1].c");
    mt_json_path_at(t, (size_t)(strchr(t, 'Y') - t + 1), out, sizeof out);
    assert_string_equal(out, "a.e"); /* past a string holding an escaped quote */
    mt_json_path_at(t, 1, out, sizeof out);
    assert_string_equal(out, "a key at the top level");
    mt_json_path_at("[1, 2, Z]", 8, out, sizeof out);
    assert_string_equal(out, "[2]");
    mt_json_path_at("NaN", 3, out, sizeof out);
    assert_string_equal(out, "(top level)");
}

int main(int argc, char **argv)
{
    examples_dir = argc > 1 ? argv[1] : "deploy/examples";
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_are_deepseek_v3),
        cmocka_unit_test(test_official_config_json_loads_as_is),
        cmocka_unit_test(test_null_q_lora_rank_means_plain_q_proj),
        cmocka_unit_test(test_bad_model_configs_name_the_field),
        cmocka_unit_test(test_transformers5_rope_parameters_give_the_same_model),
        cmocka_unit_test(test_kimi_k2_config_loads),
        cmocka_unit_test(test_unknown_keys_that_could_change_the_math_are_errors),
        cmocka_unit_test(test_keys_irrelevant_to_training_are_ignored),
        cmocka_unit_test(test_examples_load),
        cmocka_unit_test(test_set_overrides_job_and_model_fields),
        cmocka_unit_test(test_model_by_path_is_relative_to_the_spec),
        cmocka_unit_test(test_to_json_round_trips),
        cmocka_unit_test(test_bad_job_specs_name_the_field),
        cmocka_unit_test(test_admission_checks_the_layout_against_the_ranks),
        cmocka_unit_test(test_nonfinite_and_bad_utf8_name_the_field),
        cmocka_unit_test(test_json_path_at_names_the_field),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
