/* test_model.c - the whole DeepSeek-V3 model on the CPU reference backend:
 * parameter names, gradients against finite differences, recompute,
 * determinism, FP8 vs BF16 loss, YaRN tables (DeepSeek-V3, Kimi-K2). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>

#include "engine/model/layers.h"
#include "engine/model/model.h"
#include "engine/model/param_table.h"
#include "kernels/mt_fp8.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "test_util.h"
#include "tiny_model.h"

static mt_backend *be;

static void tiny_opts(mt_model_opts *o, mt_recipe recipe)
{
    memset(o, 0, sizeof *o);
    o->recipe = recipe;
    o->micro_batch = 2;
    o->seq_len = 8;
    o->mtp_weight = 0.3;
    o->aux_alpha = 0.05;
}

static void random_tokens(int32_t *tok, int n, int V, uint64_t seed)
{
    mt_rng r;
    mt_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) tok[i] = (int32_t)mt_rng_below(&r, (uint64_t)V);
}

static mt_model *make_model(const mt_model_config *c, const mt_model_opts *o, uint64_t seed)
{
    mt_model *m;
    int rc = mt_model_create(&m, c, o, be);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
    assert_int_equal(mt_model_init_random(m, seed), MT_OK);
    return m;
}

static double step_loss(mt_model *m, const int32_t *tok)
{
    mt_mb_stats st;
    int rc = mt_model_step(m, tok, 0, 1.0, &st);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
    return st.total;
}

static void test_param_names_follow_hugging_face(void **state)
{
    (void)state;
    mt_model_config c;
    mt_test_tiny_config(&c);
    mt_param_table t;
    assert_int_equal(mt_params_build(&t, &c, 0, -1), MT_OK);
    const char *must[] = {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.2.enorm.weight",
        "model.layers.2.hnorm.weight",
        "model.layers.2.eh_proj.weight",
        "model.layers.2.self_attn.o_proj.weight",
        "model.layers.2.mlp.experts.0.gate_proj.weight",
        "model.layers.2.shared_head.norm.weight",
    };
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++) {
        if (mt_params_find(&t, must[i]) < 0) fprintf(stderr, "missing %s\n", must[i]);
        assert_true(mt_params_find(&t, must[i]) >= 0);
    }
    int kv_b = mt_params_find(&t, "model.layers.0.self_attn.kv_b_proj.weight");
    assert_int_equal(t.p[kv_b].rows, 2 * (8 + 8));
    assert_int_equal(t.p[kv_b].cols, 16);
    /* experts of one projection are consecutive: grouped GEMMs stride over them */
    int e0 = mt_params_find(&t, "model.layers.1.mlp.experts.0.up_proj.weight");
    for (int e = 1; e < 8; e++) assert_int_equal(t.p[e0 + e].expert, e);
    /* no duplicate names */
    for (int i = 0; i < t.n; i++)
        for (int j = i + 1; j < t.n; j++) assert_string_not_equal(t.p[i].name, t.p[j].name);
    /* only 2 decayed kinds are excluded */
    int norm = mt_params_find(&t, "model.norm.weight");
    assert_false(t.p[norm].weight_decay);
    mt_params_free(&t);
}

/* The experts chosen by every MoE layer in the last forward (host copy). */
static int32_t *selection_snapshot(mt_model *m)
{
    const int NK = m->ctx.N * m->cfg.num_experts_per_tok;
    int32_t *s = malloc((size_t)(m->n_blocks + m->n_mtp) * NK * 4);
    for (int l = 0; l < m->n_blocks + m->n_mtp; l++) {
        mt_block *b = l < m->n_blocks ? &m->blocks[l] : &m->mtp[l - m->n_blocks].block;
        if (b->is_moe)
            assert_int_equal(be->download(be, s + (size_t)l * NK, b->moe.idx, (size_t)NK * 4), 0);
        else
            memset(s + (size_t)l * NK, 0, (size_t)NK * 4);
    }
    return s;
}

static int selection_equal(mt_model *m, const int32_t *ref)
{
    int32_t *s = selection_snapshot(m);
    int eq = memcmp(s, ref, (size_t)(m->n_blocks + m->n_mtp) * m->ctx.N *
                                m->cfg.num_experts_per_tok * 4) == 0;
    free(s);
    return eq;
}

/* Directional finite difference: for each parameter tensor, perturb along a
 * random direction u and compare (L(w + eps u) - L(w - eps u)) / 2 eps with
 * sum(grad * u). One check per tensor covers every element's gradient. */
static void test_whole_model_gradient_matches_finite_differences(void **state)
{
    (void)state;
    mt_model_config c;
    mt_model_opts o;
    mt_test_tiny_config(&c);
    tiny_opts(&o, MT_RECIPE_FP32);
    mt_model *m = make_model(&c, &o, 7);
    int32_t tok[2 * 9];
    random_tokens(tok, 2 * 9, 16, 99);
    /* a non-zero router bias, so selection and weights differ */
    float bias[8];
    for (int e = 0; e < 8; e++) bias[e] = 0.05f * (float)(e % 3);
    assert_int_equal(mt_model_set_router_bias(m, 1, bias), MT_OK);
    assert_int_equal(mt_model_set_router_bias(m, 2, bias), MT_OK);

    assert_int_equal(mt_model_zero_grads(m), MT_OK);
    mt_mb_stats st;
    assert_int_equal(mt_model_step(m, tok, 1, 1.0, &st), MT_OK);
    printf("loss %.6f mtp %.6f aux %.6f total %.6f\n", st.loss, st.mtp_loss, st.aux_loss,
           st.total);
    assert_true(st.aux_loss > 0);
    assert_true(st.mtp_loss > 0);

    int32_t *sel0 = selection_snapshot(m);
    int64_t mx = 0;
    for (int i = 0; i < m->table.n; i++)
        if (mt_param_numel(&m->table.p[i]) > mx) mx = mt_param_numel(&m->table.p[i]);
    float *w = malloc((size_t)mx * 4), *wp = malloc((size_t)mx * 4), *u = malloc((size_t)mx * 4);
    float *g = malloc((size_t)mx * 4);
    int checked = 0, worst_i = -1, bad = 0;
    double worst = 0;
    for (int i = 0; i < m->table.n; i++) {
        mt_param *p = &m->params[i];
        if (!p->grad) continue; /* router bias: not trained by gradient */
        const int64_t n = mt_param_numel(&p->d);
        assert_int_equal(mt_model_get_param(m, i, w), MT_OK);
        assert_int_equal(be->download(be, g, p->grad, (size_t)n * 4), MT_OK);
        double an = 0;
        for (int64_t j = 0; j < n; j++) {
            u[j] = (float)mt_hash_normal(1000 + i, (uint64_t)j);
            an += (double)g[j] * u[j];
        }
        /* The router's top-k is piecewise constant: a perturbation that
         * changes any MoE layer's selection makes the loss jump. Shrink eps
         * until neither side changes the selection. */
        double eps = 1e-3, lp = 0, lm = 0;
        int same = 0;
        for (int tries = 0; tries < 8 && !same; tries++, eps *= 0.3) {
            for (int64_t j = 0; j < n; j++) wp[j] = w[j] + (float)eps * u[j];
            assert_int_equal(mt_model_set_param(m, i, wp), MT_OK);
            lp = step_loss(m, tok);
            same = selection_equal(m, sel0);
            for (int64_t j = 0; j < n; j++) wp[j] = w[j] - (float)eps * u[j];
            assert_int_equal(mt_model_set_param(m, i, wp), MT_OK);
            lm = step_loss(m, tok);
            same = same && selection_equal(m, sel0);
        }
        eps /= 0.3;
        assert_true(same);
        assert_int_equal(mt_model_set_param(m, i, w), MT_OK);
        double fd = (lp - lm) / (2 * eps);
        /* tolerance: 1% of the derivative plus the fp32 noise of the loss
         * (~3e-7 relative to a loss of ~5, divided by 2 eps) */
        double tol = 0.01 * fabs(an) + 2e-6 / eps;
        double err = fabs(fd - an);
        if (err > tol || getenv("MT_VERBOSE"))
            fprintf(stderr, "%s %s: analytic %.6g finite-difference %.6g\n",
                    err > tol ? "BAD" : "ok ", p->d.name, an, fd);
        bad += err > tol;
        if (err / (fabs(an) + 1e-12) > worst && fabs(an) > 1e-3) {
            worst = err / fabs(an);
            worst_i = i;
        }
        checked++;
    }
    printf("checked %d tensors; worst relative error %.2e (%s)\n", checked, worst,
           worst_i >= 0 ? m->table.p[worst_i].name : "-");
    assert_int_equal(bad, 0);
    assert_true(checked > 40);
    free(w);
    free(wp);
    free(u);
    free(g);
    free(sel0);
    mt_model_destroy(m);
}

/* Gradients of every parameter, downloaded into one host buffer (f32;
 * bf16 accumulators widened exactly). */
static float *all_grads(mt_model *m)
{
    float *g = malloc((size_t)m->n_grad * 4);
    assert_non_null(g);
    if (m->grad_type == MT_C_BF16) {
        uint16_t *h = malloc((size_t)m->n_grad * 2);
        assert_non_null(h);
        assert_int_equal(be->download(be, h, m->buf_grad, (size_t)m->n_grad * 2), MT_OK);
        for (int64_t i = 0; i < m->n_grad; i++) g[i] = mt_bf16_to_f32(h[i]);
        free(h);
        return g;
    }
    assert_int_equal(be->download(be, g, m->buf_grad, (size_t)m->n_grad * 4), MT_OK);
    return g;
}

/* precision.grads bf16: two micro-batches accumulated into bf16 give every
 * parameter's gradient within 1 % (relative L2 norm) of the f32
 * accumulators' (bf16 keeps 8 bits: ~2e-3 per rounding), and the buffer is
 * half the size. */
static void test_bf16_grads_track_f32_grads(void **state)
{
    (void)state;
    mt_model_config c;
    mt_model_opts o;
    mt_test_tiny_config(&c);
    int32_t tok[2][2 * 9];
    random_tokens(tok[0], 2 * 9, 16, 21);
    random_tokens(tok[1], 2 * 9, 16, 22);
    float *g[2];
    size_t param_bytes[2];
    mt_model *m[2];
    for (int v = 0; v < 2; v++) {
        tiny_opts(&o, MT_RECIPE_FP8_BLOCKWISE);
        o.grads_bf16 = v;
        m[v] = make_model(&c, &o, 4);
        assert_int_equal(m[v]->grad_type, v ? MT_C_BF16 : MT_C_F32);
        mt_mb_stats st;
        assert_int_equal(mt_model_zero_grads(m[v]), MT_OK);
        for (int mb = 0; mb < 2; mb++)
            assert_int_equal(mt_model_step(m[v], tok[mb], 1, 0.5, &st), MT_OK);
        g[v] = all_grads(m[v]);
        param_bytes[v] = m[v]->param_bytes;
    }
    assert_int_equal(param_bytes[0] - param_bytes[1], (size_t)m[0]->n_grad * 2);
    double worst = 0;
    for (int i = 0; i < m[0]->table.n; i++) {
        const mt_param *p = &m[0]->params[i];
        if (!p->grad) continue;
        const int64_t n = mt_param_numel(&p->d);
        double se = 0, sf = 0;
        for (int64_t j = 0; j < n; j++) {
            const double f = g[0][p->index + j], b = g[1][p->index + j];
            se += (b - f) * (b - f);
            sf += f * f;
        }
        const double rel = sf > 0 ? sqrt(se / sf) : sqrt(se);
        if (rel > 1e-2) fprintf(stderr, "BAD %s: relative error %.3e\n", p->d.name, rel);
        assert_true(rel <= 1e-2);
        if (rel > worst) worst = rel;
    }
    printf("bf16 gradients: worst relative L2 error %.2e\n", worst);
    assert_true(worst > 0); /* the rounding is there */
    free(g[0]), free(g[1]);
    mt_model_destroy(m[0]), mt_model_destroy(m[1]);
}

static void test_recompute_gives_identical_gradients(void **state)
{
    (void)state;
    mt_model_config c;
    mt_model_opts o;
    mt_test_tiny_config(&c);
    int32_t tok[2 * 9];
    random_tokens(tok, 2 * 9, 16, 5);
    float *ref = NULL;
    for (int variant = 0; variant < 2; variant++) {
        tiny_opts(&o, MT_RECIPE_FP8_BLOCKWISE);
        o.recompute_mla_up = variant;
        o.recompute_moe_act = variant;
        mt_model *m = make_model(&c, &o, 3);
        mt_mb_stats st;
        assert_int_equal(mt_model_zero_grads(m), MT_OK);
        assert_int_equal(mt_model_step(m, tok, 1, 1.0, &st), MT_OK);
        float *g = all_grads(m);
        if (!ref)
            ref = g;
        else {
            assert_memory_equal(ref, g, (size_t)m->n_grad * 4);
            free(g);
        }
        mt_model_destroy(m);
    }
    free(ref);
}

/* Deferred zeroing (mt_model_zero_grads_deferred: the first weight-gradient
 * GEMM writes a linear weight's or the head's gradient) gives bit for bit
 * the gradients of zeroing them, over two micro-batches, from gradient
 * memory full of NaN: under the FP8 and BF16 recipes, f32 and bf16
 * gradients, and with a router bias that leaves experts 4..7 without a
 * token (their gradients, written by no GEMM, must come out zero). */
static void test_deferred_zeroing_gives_the_zeroed_gradients(void **state)
{
    (void)state;
    mt_model_config c;
    mt_model_opts o;
    mt_test_tiny_config(&c);
    int32_t tok[2][2 * 9];
    random_tokens(tok[0], 2 * 9, 16, 21);
    random_tokens(tok[1], 2 * 9, 16, 22);
    for (int v = 0; v < 8; v++) {
        const int fp8 = v & 1, gbf = (v >> 1) & 1, biased = (v >> 2) & 1;
        tiny_opts(&o, fp8 ? MT_RECIPE_FP8_BLOCKWISE : MT_RECIPE_BF16);
        o.grads_bf16 = gbf;
        mt_model *a = make_model(&c, &o, 5), *b = make_model(&c, &o, 5);
        if (biased) { /* groups 0 and 1 (experts 0..3) win every token */
            float bias[8] = {10, 10, 10, 10, 0, 0, 0, 0};
            for (int l = 1; l <= 2; l++) {
                assert_int_equal(mt_model_set_router_bias(a, l, bias), MT_OK);
                assert_int_equal(mt_model_set_router_bias(b, l, bias), MT_OK);
            }
        }
        const size_t bytes = (size_t)b->n_grad * mt_model_grad_size(b);
        unsigned char *nan = malloc(bytes);
        assert_non_null(nan);
        memset(nan, 0xff, bytes); /* NaN in f32 and in bf16 */
        assert_int_equal(be->upload(be, b->buf_grad, nan, bytes), MT_OK);
        free(nan);
        assert_int_equal(mt_model_zero_grads(a), MT_OK);
        assert_int_equal(mt_model_zero_grads_deferred(b), MT_OK);
        mt_model_reset_load(b);
        for (int mb = 0; mb < 2; mb++) {
            mt_mb_stats sa, sb;
            assert_int_equal(mt_model_step(a, tok[mb], 1, 0.5, &sa), MT_OK);
            assert_int_equal(mt_model_step(b, tok[mb], 1, 0.5, &sb), MT_OK);
            assert_memory_equal(&sa.total, &sb.total, sizeof sa.total);
        }
        if (biased) {
            const int64_t *load = mt_model_expert_load(b, 1);
            for (int e = 4; e < 8; e++) assert_int_equal(load[e], 0);
        }
        float *ga = all_grads(a), *gb = all_grads(b);
        assert_memory_equal(ga, gb, (size_t)a->n_grad * 4);
        free(ga);
        free(gb);
        mt_model_destroy(a);
        mt_model_destroy(b);
    }
}

static void test_step_is_deterministic(void **state)
{
    (void)state;
    mt_model_config c;
    mt_model_opts o;
    mt_test_tiny_config(&c);
    tiny_opts(&o, MT_RECIPE_FP8_BLOCKWISE);
    int32_t tok[2 * 9];
    random_tokens(tok, 2 * 9, 16, 11);
    mt_model *a = make_model(&c, &o, 1), *b = make_model(&c, &o, 1);
    mt_mb_stats sa, sb;
    assert_int_equal(mt_model_zero_grads(a), MT_OK);
    assert_int_equal(mt_model_zero_grads(b), MT_OK);
    assert_int_equal(mt_model_step(a, tok, 1, 1.0, &sa), MT_OK);
    assert_int_equal(mt_model_step(b, tok, 1, 1.0, &sb), MT_OK);
    assert_memory_equal(&sa.total, &sb.total, sizeof sa.total);
    float *ga = all_grads(a), *gb = all_grads(b);
    assert_memory_equal(ga, gb, (size_t)a->n_grad * 4);
    free(ga);
    free(gb);
    mt_model_destroy(a);
    mt_model_destroy(b);
}

/* The demo's tiny model: same weights and batch under both recipes. */
static void test_fp8_loss_within_one_percent_of_bf16(void **state)
{
    (void)state;
    mt_model_config c;
    mt_config_defaults(&c);
    c.vocab_size = 64;
    c.hidden_size = 128;
    c.intermediate_size = 256;
    c.moe_intermediate_size = 64;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.q_lora_rank = 64;
    c.kv_lora_rank = 64;
    c.qk_nope_head_dim = 32;
    c.qk_rope_head_dim = 16;
    c.v_head_dim = 32;
    c.n_routed_experts = 8;
    c.num_experts_per_tok = 2;
    c.n_group = 4;
    c.topk_group = 2;
    c.first_k_dense_replace = 1;
    c.num_nextn_predict_layers = 1;
    c.max_position_embeddings = 1024;
    mt_model_opts o;
    memset(&o, 0, sizeof o);
    o.micro_batch = 4;
    o.seq_len = 128;
    o.mtp_weight = 0.3;
    o.aux_alpha = 1e-4;
    int32_t *tok = malloc(4 * 129 * 4);
    random_tokens(tok, 4 * 129, 64, 2024);
    double loss[2];
    for (int r = 0; r < 2; r++) {
        o.recipe = r == 0 ? MT_RECIPE_BF16 : MT_RECIPE_FP8_BLOCKWISE;
        mt_model *m = make_model(&c, &o, 42);
        loss[r] = step_loss(m, tok);
        mt_model_destroy(m);
    }
    double rel = fabs(loss[1] - loss[0]) / loss[0];
    printf("tiny model loss: bf16 %.6f fp8-blockwise %.6f relative difference %.3e\n", loss[0],
           loss[1], rel);
    assert_true(rel < 0.01);
    assert_true(loss[0] != loss[1]); /* the recipes really differ */
    free(tok);
}

static void test_initial_loss_is_near_log_vocab(void **state)
{
    (void)state;
    mt_model_config c;
    mt_model_opts o;
    mt_test_tiny_config(&c);
    c.initializer_range = 0.02;
    tiny_opts(&o, MT_RECIPE_BF16);
    mt_model *m = make_model(&c, &o, 9);
    int32_t tok[2 * 9];
    random_tokens(tok, 2 * 9, 16, 1);
    mt_mb_stats st;
    assert_int_equal(mt_model_step(m, tok, 0, 1.0, &st), MT_OK);
    assert_true(fabs(st.loss - log(16.0)) < 0.05);
    assert_true(fabs(st.mtp_loss - log(16.0)) < 0.05);
    assert_int_equal(st.tokens, 16);
    mt_model_destroy(m);
}

/* Scoring is the training forward: the same per-micro-batch loss bit for
 * bit, per-token losses whose mean it is, and logits whose log-softmax at
 * the target is that loss. */
static void test_score_is_the_training_forward(void **state)
{
    (void)state;
    const int B = 2, T = 9;
    for (int r = 0; r < 2; r++) {
        mt_recipe recipe = r == 0 ? MT_RECIPE_FP8_BLOCKWISE : MT_RECIPE_FP32;
        mt_model_config c;
        mt_model_opts o;
        mt_test_tiny_config(&c);
        tiny_opts(&o, recipe);
        o.seq_len = T;
        mt_model *m = make_model(&c, &o, 11);
        const int V = (int)c.vocab_size;
        int32_t tok[2 * 10];
        random_tokens(tok, B * (T + 1), V, 3);
        mt_mb_stats train, score;
        assert_int_equal(mt_model_step(m, tok, 0, 1.0, &train), MT_OK);
        float loss[2 * 9], *logits = malloc((size_t)B * T * V * sizeof *logits);
        mt_score_out so = {loss, logits};
        assert_int_equal(mt_model_score(m, tok, &so, &score), MT_OK);
        assert_true(score.loss == train.loss);
        assert_true(score.mtp_loss == train.mtp_loss);
        double sum = 0;
        for (int i = 0; i < B * T; i++) sum += loss[i];
        assert_true(sum / (B * T) == train.loss);
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                const float *z = logits + ((size_t)b * T + t) * V;
                double mx = z[0], se = 0;
                for (int v = 1; v < V; v++) mx = z[v] > mx ? z[v] : mx;
                for (int v = 0; v < V; v++) se += exp(z[v] - mx);
                double want = mx + log(se) - z[tok[b * (T + 1) + t + 1]];
                assert_float_equal(loss[b * T + t], want, 1e-5);
            }
        /* the logits are not left holding their gradient */
        assert_int_equal(mt_model_score(m, tok, &so, &score), MT_OK);
        assert_true(score.loss == train.loss);
        free(logits);
        mt_model_destroy(m);
    }
}

static void test_yarn_tables_follow_deepseek_v3(void **state)
{
    (void)state;
    mt_model_config c;
    mt_config_defaults(&c);
    c.rope_scaling.type = MT_ROPE_SCALING_YARN;
    c.rope_scaling.factor = 40;
    c.rope_scaling.beta_fast = 32;
    c.rope_scaling.beta_slow = 1;
    c.rope_scaling.mscale = 1;
    c.rope_scaling.mscale_all_dim = 1;
    c.rope_scaling.original_max_position_embeddings = 4096;
    const int T = 4, half = 32;
    float ct[4 * 32], st[4 * 32], scale;
    assert_int_equal(mt_rope_tables(&c, T, ct, st, &scale), MT_OK);
    double m = 0.1 * log(40.0) + 1.0;
    assert_float_equal(scale, m * m / sqrt(192.0), 1e-6);
    /* mscale == mscale_all_dim: cos/sin carry no extra factor */
    assert_float_equal(ct[0], 1.0, 1e-7);
    /* the highest frequency is not interpolated, the lowest is divided by 40 */
    assert_float_equal(st[1 * half + 0], sin(1.0), 1e-6);
    double inv_low = 1.0 / pow(10000.0, 62.0 / 64.0) / 40.0;
    assert_float_equal(st[1 * half + 31], sin(inv_low), 1e-7);
    /* no scaling: plain RoPE */
    c.rope_scaling.type = MT_ROPE_SCALING_NONE;
    assert_int_equal(mt_rope_tables(&c, T, ct, st, &scale), MT_OK);
    assert_float_equal(scale, 1.0 / sqrt(192.0), 1e-7);
    assert_float_equal(ct[2 * half + 1], cos(2.0 / pow(10000.0, 2.0 / 64.0)), 1e-6);
}

/* The expected table of YaRN with a ramp that is a step at `step`: the
 * frequencies i < step keep theta^(-2i/R), the others are divided by
 * `factor`; long double, from the formula. Checks every entry of T rows. */
static void assert_step_yarn_table(const mt_model_config *c, int T, int step, double factor)
{
    const int R = c->qk_rope_head_dim, half = R / 2;
    float *ct = malloc((size_t)T * half * sizeof *ct), *st = malloc((size_t)T * half * sizeof *st);
    float scale;
    assert_int_equal(mt_rope_tables(c, T, ct, st, &scale), MT_OK);
    long double worst = 0;
    for (int i = 0; i < half; i++) {
        long double inv = powl((long double)c->rope_theta, -2.0L * i / R);
        if (i >= step) inv /= factor;
        for (int t = 0; t < T; t++) {
            long double a = (long double)t * inv;
            long double e1 = fabsl(cosl(a) - ct[(size_t)t * half + i]);
            long double e2 = fabsl(sinl(a) - st[(size_t)t * half + i]);
            if (e1 > worst) worst = e1;
            if (e2 > worst) worst = e2;
        }
    }
    if (worst > 1e-6L) fprintf(stderr, "largest difference %Lg\n", worst);
    assert_true(worst <= 1e-6L); /* float rounding of values in [-1, 1] */
    free(ct);
    free(st);
}

/* Kimi-K2's rotary settings: theta 50000, YaRN factor 32 over an original
 * context of 4096, beta_fast == beta_slow == 1, mscale == mscale_all_dim == 1.
 * One rotation over 4096 positions falls at dim 64 ln(4096 / 2 pi) /
 * (2 ln 50000) = 19.1646 (python3), so the correction range is [floor, ceil]
 * = [19, 20] and transformers' ramp (i - 19) / (20 - 19) is a step: i <= 19
 * keep their frequency, i >= 20 are divided by 32. */
static void test_yarn_tables_follow_kimi_k2(void **state)
{
    (void)state;
    mt_model_config c;
    mt_config_defaults(&c);
    c.rope_theta = 50000;
    c.rope_scaling.type = MT_ROPE_SCALING_YARN;
    c.rope_scaling.factor = 32;
    c.rope_scaling.beta_fast = 1;
    c.rope_scaling.beta_slow = 1;
    c.rope_scaling.mscale = 1;
    c.rope_scaling.mscale_all_dim = 1;
    c.rope_scaling.original_max_position_embeddings = 4096;
    assert_int_equal(mt_config_validate(&c, ""), MT_OK);
    assert_step_yarn_table(&c, 8192, 20, 32);
    /* a few entries computed by python3 (double) */
    const int T = 4096, half = 32;
    float *ct = malloc((size_t)T * half * sizeof *ct), *st = malloc((size_t)T * half * sizeof *st);
    float scale;
    assert_int_equal(mt_rope_tables(&c, T, ct, st, &scale), MT_OK);
    assert_float_equal(ct[4095 * half + 19], 0.9366269977324891, 1e-6);
    assert_float_equal(st[4095 * half + 20], 0.14745556044163688, 1e-6);
    assert_float_equal(scale, 0.13086079996295008, 1e-7);
    free(ct);
    free(st);
}

/* Where the correction range is empty (here both ends clamp to 0: one
 * rotation of beta = 700 takes longer than the 4096 positions), transformers
 * widens it to [0, 0.001]: only frequency 0 keeps its value. */
static void test_yarn_empty_correction_range_is_a_step_at_its_start(void **state)
{
    (void)state;
    mt_model_config c;
    mt_config_defaults(&c);
    c.rope_theta = 50000;
    c.rope_scaling.type = MT_ROPE_SCALING_YARN;
    c.rope_scaling.factor = 32;
    c.rope_scaling.beta_fast = 700;
    c.rope_scaling.beta_slow = 700;
    c.rope_scaling.mscale = 1;
    c.rope_scaling.mscale_all_dim = 1;
    c.rope_scaling.original_max_position_embeddings = 4096;
    assert_int_equal(mt_config_validate(&c, ""), MT_OK);
    assert_step_yarn_table(&c, 1024, 1, 32);
}

static void test_flops_formula_counts_active_parameters(void **state)
{
    (void)state;
    mt_model_config c;
    mt_test_tiny_config(&c);
    c.num_nextn_predict_layers = 0;
    c.num_hidden_layers = 1;
    c.first_k_dense_replace = 1;
    /* one dense layer: attention linears + 3 D I + head, and attention core */
    double D = 32, H = 2, T = 8;
    double attn_lin = D * 16 + 16 * H * 12 + D * (16 + 4) + 16 * H * 16 + H * 8 * D;
    double macs = attn_lin + 3 * D * 48 + D * 16 + H * (12 + 8) * (T + 1) / 2;
    assert_float_equal(mt_model_flops_per_token(&c, (int)T), 6 * macs, 1e-6);
}

static int setup(void **state)
{
    (void)state;
    return mt_backend_cpu_create(&be, 0) == MT_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    be->destroy(be);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_param_names_follow_hugging_face),
        cmocka_unit_test(test_whole_model_gradient_matches_finite_differences),
        cmocka_unit_test(test_recompute_gives_identical_gradients),
        cmocka_unit_test(test_bf16_grads_track_f32_grads),
        cmocka_unit_test(test_step_is_deterministic),
        cmocka_unit_test(test_deferred_zeroing_gives_the_zeroed_gradients),
        cmocka_unit_test(test_fp8_loss_within_one_percent_of_bf16),
        cmocka_unit_test(test_initial_loss_is_near_log_vocab),
        cmocka_unit_test(test_score_is_the_training_forward),
        cmocka_unit_test(test_yarn_tables_follow_deepseek_v3),
        cmocka_unit_test(test_yarn_tables_follow_kimi_k2),
        cmocka_unit_test(test_yarn_empty_correction_range_is_a_step_at_its_start),
        cmocka_unit_test(test_flops_formula_counts_active_parameters),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
