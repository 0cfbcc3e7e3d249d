/* test_model_pieces.c - the model step cut into pipeline pieces (issue 15),
 * in one process: two "stages" (two models holding one chunk each) hand
 * activations and gradients over by copies, with two micro-batches in
 * flight, and give what the whole model gives. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model/model.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "test_util.h"
#include "tiny_model.h"

static mt_backend *be;

static void opts_fp32(mt_model_opts *o)
{
    memset(o, 0, sizeof *o);
    o->recipe = MT_RECIPE_FP32;
    o->micro_batch = 2;
    o->seq_len = 8;
    o->mtp_weight = 0.3;
    o->aux_alpha = 0.05;
}

static mt_model *make(const mt_model_config *c, const mt_model_opts *o)
{
    mt_model *m;
    int rc = mt_model_create(&m, c, o, be);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
    assert_int_equal(mt_model_init_random(m, 77), MT_OK);
    return m;
}

static void ok(int rc)
{
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
}

/* Stage 0 holds chunk 0 (the embedding and layer 0), stage 1 chunk 1
 * (layer 1, the final norm, head and MTP, and an embedding replica for
 * MTP). Order as 1F1B on two stages with two micro-batches: stage 0
 * forwards both before any backward, so its two slots must keep both
 * micro-batches' activations; it then runs the backwards newest first.
 * Properties: per micro-batch losses bit-identical to the whole model's;
 * stage 1's gradients (layer 1, MTP, the norm and the head; micro-batches
 * in the same order) bit-identical; stage 0's (layer 0, summed newest
 * micro-batch first) and the embedding's (stage 0's plus the replica's)
 * within 1e-6 of the largest entry: only the order of the sums differs,
 * so the slots kept each micro-batch's own activations. */
static void test_two_stages_with_two_micro_batches_in_flight_equal_the_whole_model(void **state)
{
    (void)state;
    mt_model_config c;
    mt_test_tiny_config(&c);
    mt_model_opts o;
    opts_fp32(&o);
    mt_model *whole = make(&c, &o);
    const mt_stage ch0 = {0, 1, 1, 0}, ch1 = {1, 2, 0, 1};
    const int id0 = 0, id1 = 1, two = 2;
    mt_model_opts o0 = o, o1 = o;
    o0.n_chunks = o1.n_chunks = 1;
    o0.chunks = &ch0;
    o0.chunk_ids = &id0;
    o1.chunks = &ch1;
    o1.chunk_ids = &id1;
    o0.chunk_slots = o1.chunk_slots = &two;
    mt_model *s0 = make(&c, &o0), *s1 = make(&c, &o1);

    /* each stage holds its chunk's parameters only */
    assert_true(s0->has_first && !s0->has_last && !s0->embed_replica);
    assert_true(s1->has_last && !s1->has_first && s1->embed_replica);
    assert_int_equal(s0->table.n + s1->table.n, whole->table.n + 1); /* + the replica */
    for (int i = 0; i < s0->table.n; i++) assert_true(s0->table.p[i].layer <= 0);
    for (int i = 0; i < s1->table.n; i++) assert_true(s1->table.p[i].layer != 0);
    assert_true(mt_params_find(&s1->table, "lm_head.weight") >= 0);
    assert_true(mt_params_find(&s0->table, "lm_head.weight") < 0);

    const int B = o.micro_batch, T = o.seq_len, N = B * T, D = c.hidden_size;
    const size_t nd = (size_t)N * D * 4;
    int32_t tok[2][2 * 9];
    mt_rng r;
    mt_rng_seed(&r, 5);
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < B * (T + 1); i++) tok[k][i] = (int32_t)mt_rng_below(&r, c.vocab_size);

    ok(mt_model_zero_grads(whole));
    ok(mt_model_zero_grads(s0));
    ok(mt_model_zero_grads(s1));
    mt_mb_stats w[2], a, b[2];
    for (int k = 0; k < 2; k++) ok(mt_model_step(whole, tok[k], 1, 0.5, &w[k]));

    /* stage 0: both forwards (slots 0 and 1) */
    for (int k = 0; k < 2; k++) ok(mt_model_chunk_fwd(s0, 0, k, tok[k], 1, 0.5, &a));
    /* stage 1: forward and backward of each, the input "received" from stage 0 */
    for (int k = 0; k < 2; k++) {
        memcpy(s1->chunks[0].slots[k].h[0], s0->chunks[0].slots[k].h[1], nd);
        ok(mt_model_chunk_fwd(s1, 0, k, tok[k], 1, 0.5, &b[k]));
        ok(mt_model_chunk_bwd(s1, 0, k));
    }
    /* stage 0: backwards, newest first, the gradient "received" from stage 1 */
    for (int k = 1; k >= 0; k--) {
        memcpy(s0->chunks[0].slots[k].dh, s1->chunks[0].slots[k].dh, nd);
        ok(mt_model_chunk_bwd(s0, 0, k));
    }
    for (int k = 0; k < 2; k++) {
        assert_true(b[k].loss == w[k].loss);
        assert_true(b[k].mtp_loss == w[k].mtp_loss);
        assert_int_equal(b[k].tokens, w[k].tokens);
    }

    /* gradients, by global parameter index (the CPU backend's host memory) */
    const int e0 = mt_model_embed_index(s0), e1 = mt_model_embed_index(s1);
    assert_true(e0 >= 0 && e1 >= 0);
    mt_model *st[2] = {s0, s1};
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < st[s]->table.n; i++) {
            const mt_param *p = &st[s]->params[i];
            const mt_param *q = &whole->params[st[s]->global_param[i]];
            assert_string_equal(p->d.name, q->d.name);
            if (!p->grad || p->d.role == MT_PR_EMBED) continue;
            const int64_t n = mt_param_numel(&p->d);
            if (s == 1) { /* the same micro-batch order: bit for bit */
                if (memcmp(p->grad, q->grad, (size_t)n * 4) != 0)
                    fail_msg("%s: stage 1's gradient differs from the whole model's", p->d.name);
                continue;
            }
            double off = 0, big = 0; /* stage 0 summed mb 1 first */
            const float *gp = p->grad, *gq = q->grad; /* f32: the default grad_type */
            for (int64_t k = 0; k < n; k++) {
                off = fmax(off, fabs((double)gp[k] - gq[k]));
                big = fmax(big, fabs(gq[k]));
            }
            if (off > 1e-6 * big)
                fail_msg("%s: stage 0's gradient is %.3g off (largest %.3g)", p->d.name, off, big);
        }
    const int64_t n = mt_param_numel(&s0->params[e0].d);
    const float *g0 = s0->params[e0].grad, *g1 = s1->params[e1].grad;
    const float *gw = whole->params[mt_model_embed_index(whole)].grad;
    double worst = 0, big = 0;
    for (int64_t i = 0; i < n; i++) {
        worst = fmax(worst, fabs((double)g0[i] + g1[i] - gw[i]));
        big = fmax(big, fabs(gw[i]));
    }
    assert_true(big > 0);
    if (worst > 1e-6 * big) fail_msg("embedding gradient: %.3g off (largest %.3g)", worst, big);
    mt_model_destroy(s0);
    mt_model_destroy(s1);
    mt_model_destroy(whole);
}

/* A chunk with no decoder layer (parallel.pp_layers 0) only embeds, or only
 * runs the heads: stage 0 = the embedding, stage 1 = both layers + heads. */
static void test_a_chunk_without_layers_embeds_or_passes_through(void **state)
{
    (void)state;
    mt_model_config c;
    mt_test_tiny_config(&c);
    mt_model_opts o;
    opts_fp32(&o);
    mt_model *whole = make(&c, &o);
    const mt_stage ch0 = {0, 0, 1, 0}, ch1 = {0, 2, 0, 1};
    const int id0 = 0, id1 = 1, one = 1;
    mt_model_opts o0 = o, o1 = o;
    o0.n_chunks = o1.n_chunks = 1;
    o0.chunks = &ch0;
    o0.chunk_ids = &id0;
    o1.chunks = &ch1;
    o1.chunk_ids = &id1;
    o0.chunk_slots = o1.chunk_slots = &one;
    mt_model *s0 = make(&c, &o0), *s1 = make(&c, &o1);
    assert_int_equal(s0->table.n, 1); /* the embedding alone */
    const int B = o.micro_batch, T = o.seq_len, N = B * T, D = c.hidden_size;
    int32_t tok[2 * 9];
    for (int i = 0; i < B * (T + 1); i++) tok[i] = (int32_t)((i * 7 + 3) % c.vocab_size);
    mt_mb_stats w, a, b;
    ok(mt_model_zero_grads(whole));
    ok(mt_model_zero_grads(s0));
    ok(mt_model_zero_grads(s1));
    ok(mt_model_step(whole, tok, 1, 1.0, &w));
    ok(mt_model_chunk_fwd(s0, 0, 0, tok, 1, 1.0, &a));
    memcpy(s1->chunks[0].slots[0].h[0], s0->chunks[0].slots[0].h[0], (size_t)N * D * 4);
    ok(mt_model_chunk_fwd(s1, 0, 0, tok, 1, 1.0, &b));
    ok(mt_model_chunk_bwd(s1, 0, 0));
    memcpy(s0->chunks[0].slots[0].dh, s1->chunks[0].slots[0].dh, (size_t)N * D * 4);
    ok(mt_model_chunk_bwd(s0, 0, 0));
    assert_true(b.loss == w.loss && b.mtp_loss == w.mtp_loss && b.aux_loss == w.aux_loss);
    assert_true(a.loss == 0 && a.aux_loss == 0); /* no head, no MoE layer on stage 0 */
    mt_model_destroy(s0);
    mt_model_destroy(s1);
    mt_model_destroy(whole);
}

/* A whole-model step on a model holding only some chunks is refused. */
static void test_a_stage_refuses_the_whole_model_step(void **state)
{
    (void)state;
    mt_model_config c;
    mt_test_tiny_config(&c);
    mt_model_opts o;
    opts_fp32(&o);
    const mt_stage ch = {0, 1, 1, 0};
    const int id = 0, one = 1;
    o.n_chunks = 1;
    o.chunks = &ch;
    o.chunk_ids = &id;
    o.chunk_slots = &one;
    mt_model *s = make(&c, &o);
    int32_t tok[2 * 9] = {0};
    mt_mb_stats st;
    assert_int_equal(mt_model_step(s, tok, 1, 1.0, &st), MT_EINVAL);
    assert_contains(mt_errmsg(), "pipeline executor");
    mt_err_clear();
    mt_model_destroy(s);
}

/* Host copy of every parameter gradient of m (f32, the CPU backend's
 * memory), in table order. */
static float *grads_copy(const mt_model *m)
{
    float *g = malloc((size_t)m->n_grad * sizeof *g);
    assert_non_null(g);
    memcpy(g, m->buf_grad, (size_t)m->n_grad * sizeof *g);
    return g;
}

/* on_layer_grads: the layers in the order reported; at MT_LAYER_HEAD a
 * copy of every gradient (hook_model's) */
static int hook_calls, hook_seq[64];
static const mt_model *hook_model;
static float *hook_at_head;
static int count_layer_hook(void *arg, int layer)
{
    (void)arg;
    if (hook_calls < 64) hook_seq[hook_calls] = layer;
    hook_calls++;
    if (layer == MT_LAYER_HEAD && hook_model) {
        free(hook_at_head);
        hook_at_head = grads_copy(hook_model);
    }
    return MT_OK;
}

static const float *grad_of(const mt_model *m, const float *all, const char *name)
{
    int i = mt_params_find(&m->table, name);
    assert_true(i >= 0);
    return all + m->params[i].index;
}

static int grad_equal(const mt_model *m, const float *a, const float *b, const char *name)
{
    int i = mt_params_find(&m->table, name);
    assert_true(i >= 0);
    return memcmp(grad_of(m, a, name), grad_of(m, b, name),
                  (size_t)mt_param_numel(&m->params[i].d) * sizeof *a) == 0;
}

/* The backward split (DualPipeV's BWD_IN and BWD_W) on the whole tiny model
 * (dense layer 0, MoE layer 1, MTP), fp32 and fp8-blockwise recipes, two
 * micro-batches whose input parts both run before either weight part.
 * Properties: after the input parts alone the input gradient (dh, the
 * embedding's) is bit-identical to the whole backward's, every linear
 * weight's gradient is as the forward left it (attention, dense FFN,
 * experts, shared experts, MTP projection; the head's comes with the
 * loss in the forward), the norms' and the router's gradients already
 * moved, and no layer has reported final gradients (on_layer_grads); after
 * the weight parts, in the same order, every gradient is bit-identical to
 * two whole backwards' and every layer reported once per micro-batch. */
static void test_backward_split_defers_weight_gradients_and_gives_the_whole_backward(void **state)
{
    (void)state;
    const mt_recipe recipes[2] = {MT_RECIPE_FP32, MT_RECIPE_FP8_BLOCKWISE};
    for (int ri = 0; ri < 2; ri++) {
        mt_model_config c;
        mt_test_tiny_config(&c);
        mt_model_opts o;
        opts_fp32(&o);
        o.recipe = recipes[ri];
        o.on_layer_grads = count_layer_hook;
        mt_model *whole = make(&c, &o), *split = make(&c, &o);
        const int B = o.micro_batch, T = o.seq_len, N = B * T, D = c.hidden_size;
        const size_t nd = (size_t)N * D * 4;
        int32_t tok[2][2 * 9];
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < B * (T + 1); i++)
                tok[k][i] = (int32_t)((i * 7 + 3 + 11 * k) % c.vocab_size);
        ok(mt_model_zero_grads(whole));
        ok(mt_model_zero_grads(split));
        mt_mb_stats st;
        float *dh_whole = malloc(2 * nd);
        assert_non_null(dh_whole);
        hook_calls = 0;
        for (int k = 0; k < 2; k++) {
            ok(mt_model_step(whole, tok[k], 1, 0.5, &st));
            memcpy((char *)dh_whole + k * nd, whole->chunks[0].slots[0].dh, nd);
        }
        /* + the head's MT_LAYER_HEAD and the embedding's -1 */
        const int layers = c.num_hidden_layers + split->n_mtp + 2;
        assert_int_equal(hook_calls, 2 * layers);

        /* mb 0: forward and input part; mb 1 likewise (the slot is free again) */
        hook_calls = 0;
        int h[2];
        float *after_fwd = NULL, *after_in = NULL;
        for (int k = 0; k < 2; k++) {
            ok(mt_model_chunk_fwd(split, 0, 0, tok[k], 1, 0.5, &st));
            free(after_fwd);
            after_fwd = grads_copy(split);
            ok(mt_model_chunk_bwd_in(split, 0, 0, &h[k]));
            if (memcmp(split->chunks[0].slots[0].dh, (char *)dh_whole + k * nd, nd) != 0)
                fail_msg("recipe %d mb %d: the input gradient after BWD_IN differs from the "
                         "whole backward's", (int)o.recipe, k);
        }
        assert_true(h[0] != h[1]);
        assert_int_equal(hook_calls, 2); /* each forward's head, computed there */
        assert_int_equal(hook_seq[0], MT_LAYER_HEAD);
        after_in = grads_copy(split);
        const char *deferred[] = {"model.layers.0.self_attn.o_proj.weight",
                                  "model.layers.0.self_attn.kv_b_proj.weight",
                                  "model.layers.0.mlp.down_proj.weight",
                                  "model.layers.1.mlp.shared_experts.up_proj.weight",
                                  "model.layers.1.mlp.experts.0.gate_proj.weight",
                                  "model.layers.2.eh_proj.weight"};
        for (size_t i = 0; i < sizeof deferred / sizeof deferred[0]; i++)
            if (!grad_equal(split, after_fwd, after_in, deferred[i]))
                fail_msg("recipe %d: %s's gradient moved in BWD_IN", (int)o.recipe, deferred[i]);
        const char *in_part[] = {"model.layers.0.input_layernorm.weight",
                                 "model.layers.1.mlp.gate.weight", "model.embed_tokens.weight"};
        for (size_t i = 0; i < sizeof in_part / sizeof in_part[0]; i++)
            if (grad_equal(split, after_fwd, after_in, in_part[i]))
                fail_msg("recipe %d: %s's gradient did not move in BWD_IN", (int)o.recipe,
                         in_part[i]);

        for (int k = 0; k < 2; k++) ok(mt_model_chunk_bwd_w(split, h[k]));
        assert_int_equal(hook_calls, 2 * layers);
        assert_int_equal(split->n_grad, whole->n_grad);
        for (int i = 0; i < split->table.n; i++) {
            const mt_param *p = &split->params[i];
            if (memcmp((float *)split->buf_grad + p->index, (float *)whole->buf_grad + p->index,
                       (size_t)mt_param_numel(&p->d) * 4) != 0)
                fail_msg("recipe %d: %s's gradient after BWD_W differs from the whole "
                         "backward's", (int)o.recipe, p->d.name);
        }
        /* a handle runs once */
        assert_int_equal(mt_model_chunk_bwd_w(split, h[0]), MT_EINVAL);
        mt_err_clear();
        /* the memory of the deferral: two micro-batches pending at once */
        assert_true(split->defer_peak > 0 && mt_model_defer_bytes(split) >= split->defer_peak);
        printf("recipe %d: two pending weight parts held %zu bytes (N = %d rows, D = %d)\n",
               (int)o.recipe, split->defer_peak, N, D);
        free(after_fwd);
        free(after_in);
        free(dh_whole);
        mt_model_destroy(whole);
        mt_model_destroy(split);
    }
}

/* The on_layer_grads order of a whole backward (tiny model: dense layer 0,
 * MoE layer 1, one MTP module, layer 2): MT_LAYER_HEAD from inside the
 * forward, then MTP modules and decoder layers last to first, -1 last;
 * every parameter's mt_model_grad_ready is one of them, and the
 * parameters ready at MT_LAYER_HEAD (the final norm and the untied head)
 * have their final gradients by then: bit-identical to the step's end.
 * With tied embeddings the head is the embedding, ready at -1. */
static void test_the_head_reports_final_gradients_before_the_backward(void **state)
{
    (void)state;
    mt_model_config c;
    mt_test_tiny_config(&c);
    mt_model_opts o;
    opts_fp32(&o);
    o.on_layer_grads = count_layer_hook;
    mt_model *m = make(&c, &o);
    hook_model = m;
    const int L = c.num_hidden_layers, K = m->n_mtp, B = o.micro_batch, T = o.seq_len;
    assert_true(K > 0);
    int32_t tok[2 * 9];
    for (int i = 0; i < B * (T + 1); i++) tok[i] = (int32_t)((i * 5 + 1) % c.vocab_size);
    ok(mt_model_zero_grads(m));
    hook_calls = 0;
    mt_mb_stats st;
    ok(mt_model_step(m, tok, 1, 1.0, &st));
    assert_int_equal(hook_calls, L + K + 2);
    assert_int_equal(hook_seq[0], MT_LAYER_HEAD);
    for (int k = 0; k < L + K; k++) assert_int_equal(hook_seq[1 + k], L + K - 1 - k);
    assert_int_equal(hook_seq[L + K + 1], -1);
    assert_non_null(hook_at_head);
    float *end = grads_copy(m);
    int at_head = 0;
    for (int i = 0; i < m->table.n; i++) {
        const mt_param *p = &m->params[i];
        const int r = mt_model_grad_ready(m, i);
        assert_true(r == MT_LAYER_HEAD || r == -1 || (r >= 0 && r < L + K));
        if (r != MT_LAYER_HEAD) continue;
        at_head++;
        if (memcmp(hook_at_head + p->index, end + p->index, (size_t)mt_param_numel(&p->d) * 4))
            fail_msg("%s: its gradient changed after MT_LAYER_HEAD", p->d.name);
    }
    assert_int_equal(at_head, 2); /* model.norm.weight, lm_head.weight */
    assert_int_equal(mt_model_grad_ready(m, mt_params_find(&m->table, "lm_head.weight")),
                     MT_LAYER_HEAD);
    assert_int_equal(mt_model_grad_ready(m, mt_model_embed_index(m)), -1);
    free(end);
    free(hook_at_head);
    hook_at_head = NULL;
    hook_model = NULL;
    mt_model_destroy(m);

    c.tie_word_embeddings = 1;
    m = make(&c, &o);
    assert_int_equal(mt_params_find(&m->table, "lm_head.weight"), -1);
    assert_int_equal(mt_model_grad_ready(m, mt_model_embed_index(m)), -1);
    assert_int_equal(mt_model_grad_ready(m, mt_params_find(&m->table, "model.norm.weight")),
                     MT_LAYER_HEAD);
    mt_model_destroy(m);
}

int main(void)
{
    if (mt_backend_cpu_create(&be, 1) != MT_OK) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_stages_with_two_micro_batches_in_flight_equal_the_whole_model),
        cmocka_unit_test(test_a_chunk_without_layers_embeds_or_passes_through),
        cmocka_unit_test(test_a_stage_refuses_the_whole_model_step),
        cmocka_unit_test(test_backward_split_defers_weight_gradients_and_gives_the_whole_backward),
        cmocka_unit_test(test_the_head_reports_final_gradients_before_the_backward),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    be->destroy(be);
    return rc;
}
