/* test_ckpt_sharding.c - the sharding map (engine/parallel/sharding.h): for many
 * layouts, the pieces of every tensor tile its global shape exactly (no
 * gap, no overlap); every piece is held by its writer and the writer is the
 * lowest rank holding it; what a rank holds is one piece; FP8 scale pieces
 * match their weights' blocks; layouts that would cut an FP8 block or break
 * divisibility are rejected naming the tensor or field. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>

#include "engine/parallel/sharding.h"
#include "base/mt_status.h"
#include "test_util.h"

/* A small model whose split dimensions are multiples of 256, so FP8 layouts
 * up to tp = etp = 2 keep whole 128 x 128 blocks: 4 layers (one dense) +
 * MTP, 8 experts. */
static void small_config(mt_model_config *c)
{
    mt_config_defaults(c);
    c->vocab_size = 96;
    c->hidden_size = 256;
    c->intermediate_size = 512;
    c->moe_intermediate_size = 256;
    c->num_hidden_layers = 4;
    c->num_attention_heads = 4;
    c->num_key_value_heads = 4;
    c->q_lora_rank = 128;
    c->kv_lora_rank = 128;
    c->qk_nope_head_dim = 64;
    c->qk_rope_head_dim = 64;
    c->v_head_dim = 64;
    c->n_routed_experts = 8;
    c->n_shared_experts = 1;
    c->num_experts_per_tok = 2;
    c->n_group = 4;
    c->topk_group = 2;
    c->first_k_dense_replace = 1;
    c->num_nextn_predict_layers = 1;
}

static mt_shard_opts full_opts(int fp8)
{
    mt_shard_opts o = {.fp8 = fp8, .act_dtype = MT_DT_BF16, .optimizer = 1, .has_main = 1,
                       .main_dtype = MT_DT_F32};
    return o;
}

static int overlap(const mt_shard_piece *a, const mt_shard_piece *b)
{
    for (int k = 0; k < 2; k++)
        if (a->off[k] >= b->off[k] + b->count[k] || b->off[k] >= a->off[k] + a->count[k]) return 0;
    return 1;
}

/* Pieces of every tensor tile it exactly. */
static void check_tiling(const mt_shard_map *m)
{
    for (int t = 0; t < m->n_tensors; t++) {
        const mt_shard_tensor *x = &m->tensors[t];
        int64_t vol = 0;
        assert_true(x->n_pieces >= 1);
        for (int i = 0; i < x->n_pieces; i++) {
            const mt_shard_piece *a = &m->pieces[x->first_piece + i];
            assert_int_equal(a->tensor, t);
            for (int k = 0; k < 2; k++) {
                assert_true(a->off[k] >= 0 && a->count[k] > 0);
                assert_true(a->off[k] + a->count[k] <= x->shape[k]);
            }
            assert_true(a->writer >= 0 && a->writer < m->world);
            vol += a->count[0] * a->count[1];
            for (int j = i + 1; j < x->n_pieces; j++)
                if (overlap(a, &m->pieces[x->first_piece + j])) {
                    fprintf(stderr, "%s: pieces %d and %d overlap\n", x->name, i, j);
                    fail();
                }
        }
        if (vol != x->shape[0] * x->shape[1]) {
            fprintf(stderr, "%s: pieces cover %lld of %lld\n", x->name, (long long)vol,
                    (long long)(x->shape[0] * x->shape[1]));
            fail();
        }
    }
}

static int same_slab(const mt_shard_piece *p, const int64_t off[2], const int64_t cnt[2])
{
    return p->off[0] == off[0] && p->off[1] == off[1] && p->count[0] == cnt[0] &&
           p->count[1] == cnt[1];
}

/* Writers hold their pieces; a held slab is a piece; and the balance of the
 * replicated weights' writers leaves the busiest writer no busier than the
 * lowest-holder rule would (strictly less busy when `relieved`: layouts
 * with replicas to spread over). */
static void check_holders(const mt_shard_map *m, int relieved)
{
    int64_t *load = calloc((size_t)m->world, sizeof *load), *lowest = calloc((size_t)m->world, sizeof *lowest);
    for (int t = 0; t < m->n_tensors; t++) {
        const mt_shard_tensor *x = &m->tensors[t];
        int *held_by_writer = calloc((size_t)x->n_pieces, sizeof *held_by_writer);
        int *first = malloc((size_t)x->n_pieces * sizeof *first);
        for (int i = 0; i < x->n_pieces; i++) first[i] = m->world;
        for (int r = 0; r < m->world; r++) {
            int64_t off[2], cnt[2];
            if (!mt_shard_map_held(m, t, r, off, cnt)) continue;
            int found = -1;
            for (int i = 0; i < x->n_pieces && found < 0; i++)
                if (same_slab(&m->pieces[x->first_piece + i], off, cnt)) found = i;
            if (found < 0) {
                fprintf(stderr, "%s: rank %d holds a slab that is no piece\n", x->name, r);
                fail();
            }
            const mt_shard_piece *p = &m->pieces[x->first_piece + found];
            if (p->writer == r) held_by_writer[found] = 1;
            if (r < first[found]) first[found] = r;
        }
        for (int i = 0; i < x->n_pieces; i++) {
            const mt_shard_piece *p = &m->pieces[x->first_piece + i];
            if (!held_by_writer[i]) {
                fprintf(stderr, "%s: piece %d is not held by its writer %d\n", x->name, i, p->writer);
                fail();
            }
            const int64_t bytes = p->count[0] * p->count[1] * (int64_t)mt_dtype_size(x->dtype);
            load[p->writer] += bytes;
            lowest[first[i]] += bytes;
        }
        free(held_by_writer);
        free(first);
    }
    int64_t busiest = 0, busiest_lowest = 0;
    for (int r = 0; r < m->world; r++) {
        if (load[r] > busiest) busiest = load[r];
        if (lowest[r] > busiest_lowest) busiest_lowest = lowest[r];
    }
    if (busiest > busiest_lowest || (relieved && busiest >= busiest_lowest)) {
        fprintf(stderr, "busiest writer %lld bytes, %lld with the lowest holders writing\n",
                (long long)busiest, (long long)busiest_lowest);
        fail();
    }
    free(load);
    free(lowest);
}

/* Scale pieces are the block images of their weight pieces, same writers. */
static void check_scales(const mt_shard_map *m)
{
    for (int p = 0; p < m->n_params; p++) {
        int w = m->param_tensor[p][MT_TS_WEIGHT], s = m->param_tensor[p][MT_TS_SCALE];
        if (s < 0) continue;
        const mt_shard_tensor *W = &m->tensors[w], *S = &m->tensors[s];
        assert_int_equal(W->dtype, MT_DT_E4M3);
        assert_int_equal(S->shape[0], (W->shape[0] + 127) / 128);
        assert_int_equal(S->shape[1], (W->shape[1] + 127) / 128);
        assert_int_equal(W->n_pieces, S->n_pieces);
        for (int i = 0; i < W->n_pieces; i++) {
            const mt_shard_piece *a = &m->pieces[W->first_piece + i], *b = &m->pieces[S->first_piece + i];
            assert_int_equal(a->writer, b->writer);
            for (int k = 0; k < 2; k++) {
                assert_int_equal(a->off[k] % 128, 0);
                assert_int_equal(b->off[k], a->off[k] / 128);
                assert_int_equal(b->off[k] + b->count[k], (a->off[k] + a->count[k] + 127) / 128);
            }
        }
    }
}

/* The per-rank index lists exactly the pieces each rank writes. */
static void check_rank_index(const mt_shard_map *m)
{
    int total = 0;
    for (int r = 0; r < m->world; r++) {
        int n;
        const int *idx = mt_shard_map_rank_pieces(m, r, &n);
        for (int i = 0; i < n; i++) assert_int_equal(m->pieces[idx[i]].writer, r);
        total += n;
    }
    assert_int_equal(total, m->n_pieces);
}

static void check_layout(const mt_model_config *c, const char *lt, int fp8, int holders)
{
    mt_layout l;
    assert_int_equal(mt_layout_parse(&l, lt), MT_OK);
    mt_shard_map m;
    mt_shard_opts o = full_opts(fp8);
    int rc = mt_shard_map_build(&m, c, &l, &o);
    if (rc) fprintf(stderr, "%s: %s\n", lt, mt_errmsg());
    assert_int_equal(rc, MT_OK);
    assert_int_equal(m.world, mt_layout_world(&l));
    check_tiling(&m);
    check_scales(&m);
    check_rank_index(&m);
    if (holders) check_holders(&m, l.dp > 1); /* dp > 1: replicated weights to spread */
    for (int t = 0; t < m.n_tensors; t++) assert_int_equal(mt_shard_map_find(&m, m.tensors[t].name), t);
    mt_shard_map_free(&m);
}

static const char *const small_layouts[] = {
    "tp=1",
    "tp=2",
    "dp=2",
    "dp=3",
    "pp=2",
    "pp=4",
    "tp=2,pp=2,ep=2,dp=1",
    "tp=1,pp=2,ep=4,dp=4",
    "tp=2,pp=1,vpp=2,ep=2,etp=2,dp=2",
    "tp=2,ep=8,dp=4",
    "tp=1,ep=8,etp=1,dp=8",
    "pp=2,vpp=2,dp=2,ep=2",
    "pp=2,dualpipev=1,ep=2,dp=2",
    "tp=2,etp=2,ep=4,dp=4,pp=2",
    "dp=5,ep=1",
};

/* Many layouts of a small model, FP8 and BF16, with every rank checked. */
static void test_small_layouts_tile(void **state)
{
    (void)state;
    mt_model_config c;
    small_config(&c);
    for (size_t i = 0; i < sizeof small_layouts / sizeof small_layouts[0]; i++) {
        check_layout(&c, small_layouts[i], 1, 1);
        check_layout(&c, small_layouts[i], 0, 1);
    }
    /* without FP8, tp may cut where blocks would be: tp = 4 splits o_proj at 64 */
    check_layout(&c, "tp=4,dp=2,ep=8", 0, 1);
}

/* DeepSeek-V3 itself (61 layers, 256 experts, MTP) under production-like
 * layouts: tiling, scales and the rank index (holders on a smaller model). */
static void test_dsv3_layouts_tile(void **state)
{
    (void)state;
    mt_model_config c;
    mt_config_defaults(&c);
    c.num_nextn_predict_layers = 1;
    check_layout(&c, "tp=1,pp=16,ep=64,dp=64", 1, 0);
    check_layout(&c, "tp=8,pp=8,vpp=2,ep=8,etp=1,dp=4", 1, 0);
    check_layout(&c, "tp=2,pp=8,dualpipev=1,ep=32,dp=16", 1, 0);
    check_layout(&c, "tp=16,pp=1,ep=16,etp=2,dp=2", 1, 0);
}

/* An FP8 split that would cut a 128x128 block is rejected, naming the tensor. */
static void test_fp8_block_rule(void **state)
{
    (void)state;
    mt_model_config c;
    small_config(&c);
    mt_layout l;
    assert_int_equal(mt_layout_parse(&l, "tp=4"), MT_OK);
    int rc = mt_layout_validate(&l, &c, 1);
    assert_int_equal(rc, MT_EINVAL);
    assert_contains(mt_errmsg(), "o_proj.weight");
    assert_contains(mt_errmsg(), "128");
    assert_int_equal(mt_layout_validate(&l, &c, 0), MT_OK);
    mt_config_defaults(&c);
    assert_int_equal(mt_layout_parse(&l, "tp=32"), MT_OK); /* dense width 18432 / 32 = 576 */
    assert_int_equal(mt_layout_validate(&l, &c, 1), MT_EINVAL);
    assert_contains(mt_errmsg(), "model.layers.0.mlp.gate_proj.weight");
}

/* Divisibility and folding rules name the field. */
static void test_layout_rules(void **state)
{
    (void)state;
    mt_model_config c;
    small_config(&c);
    mt_layout l;
    const struct {
        const char *layout, *needle;
    } bad[] = {
        {"tp=3", "num_attention_heads"},
        {"ep=3,dp=3", "n_routed_experts"},
        {"ep=4,dp=2", "expert folding"},
        {"pp=5", "num_hidden_layers"},
        {"etp=3,dp=3", "moe_intermediate_size"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(mt_layout_parse(&l, bad[i].layout), MT_OK);
        assert_int_equal(mt_layout_validate(&l, &c, 0), MT_EINVAL);
        assert_contains(mt_errmsg(), bad[i].needle);
    }
    assert_int_equal(mt_layout_parse(&l, "tp=2,xp=3"), MT_EINVAL);
    assert_contains(mt_errmsg(), "xp");
    assert_int_equal(mt_layout_parse(&l, "tp=0"), MT_EINVAL);
    char buf[128];
    assert_int_equal(mt_layout_parse(&l, "tp=2,pp=2,ep=4,dp=8,dualpipev=1"), MT_OK);
    assert_int_equal(l.vpp, 2);
    mt_layout_format(&l, buf, sizeof buf);
    mt_layout l2;
    assert_int_equal(mt_layout_parse(&l2, buf), MT_OK);
    assert_memory_equal(&l, &l2, sizeof l);
}

/* Pipeline placement: the embedding on the first chunk's stage, the head
 * and MTP on the last chunk's (rank 0 under DualPipeV); layers contiguous. */
static void test_pipeline_placement(void **state)
{
    (void)state;
    mt_model_config c;
    small_config(&c);
    c.num_hidden_layers = 8;
    mt_layout l;
    assert_int_equal(mt_layout_parse(&l, "pp=2,vpp=2"), MT_OK);
    /* chunks of 2 layers: 0-1 stage 0, 2-3 stage 1, 4-5 stage 0, 6-7 stage 1 */
    const int want[8] = {0, 0, 1, 1, 0, 0, 1, 1};
    for (int i = 0; i < 8; i++) assert_int_equal(mt_layout_stage_of_layer(&l, &c, i), want[i]);
    assert_int_equal(mt_layout_stage_of_layer(&l, &c, 8), 1); /* MTP */
    assert_int_equal(mt_layout_parse(&l, "pp=2,dualpipev=1"), MT_OK);
    const int v[8] = {0, 0, 1, 1, 1, 1, 0, 0};
    for (int i = 0; i < 8; i++) assert_int_equal(mt_layout_stage_of_layer(&l, &c, i), v[i]);
    assert_int_equal(mt_layout_stage_of_layer(&l, &c, 8), 0);
    /* the embedding has a replica on the last stage for MTP; its writer is stage 0's */
    assert_int_equal(mt_layout_parse(&l, "pp=4"), MT_OK);
    mt_shard_map m;
    mt_shard_opts o = full_opts(1);
    assert_int_equal(mt_shard_map_build(&m, &c, &l, &o), MT_OK);
    int e = mt_shard_map_find(&m, "model.embed_tokens.weight");
    int h = mt_shard_map_find(&m, "lm_head.weight");
    assert_true(e >= 0 && h >= 0);
    int64_t off[2], cnt[2];
    assert_int_equal(mt_shard_map_held(&m, e, 0, off, cnt), 1);
    assert_int_equal(mt_shard_map_held(&m, e, 3, off, cnt), 1);
    assert_int_equal(mt_shard_map_held(&m, e, 1, off, cnt), 0);
    assert_int_equal(m.pieces[m.tensors[e].first_piece].writer, 0);
    assert_int_equal(m.pieces[m.tensors[h].first_piece].writer, 3);
    assert_int_equal(m.n_aliases, 2);
    assert_string_equal(m.aliases[0].name, "model.layers.8.embed_tokens.weight");
    assert_int_equal(m.aliases[1].source, h);
    mt_shard_map_free(&m);
}

/* The least possible largest run when a[0..n) is cut into at most Z
 * contiguous runs (every split tried: the specification zero_owners must
 * meet). */
static int64_t best_largest_run(const int64_t *a, int n, int Z)
{
    /* f[z][j]: the least largest run of a[0..j) in z runs */
    int64_t *f = malloc(sizeof *f * (size_t)(Z + 1) * (size_t)(n + 1));
    assert_non_null(f);
#define F(z, j) f[(size_t)(z) * (size_t)(n + 1) + (size_t)(j)]
    for (int j = 0; j <= n; j++) F(0, j) = j == 0 ? 0 : INT64_MAX;
    for (int z = 1; z <= Z; z++)
        for (int j = 0; j <= n; j++) {
            int64_t best = INT64_MAX, run = 0;
            for (int i = j; i >= 0; i--) { /* the last run is a[i..j) */
                if (i < j) run += a[i];
                const int64_t prev = F(z - 1, i);
                const int64_t worst = prev > run ? prev : run;
                if (worst < best) best = worst;
            }
            F(z, j) = best;
        }
    const int64_t r = F(Z, n);
#undef F
    free(f);
    return r;
}

/* ZeRO-1 owners in a model whose output head (vocabulary x hidden) is more
 * than a dp rank's share of the dense parameters: the busiest owner keeps
 * no more elements than the best contiguous split allows (the elements'
 * midpoint rule alone put the head on top of a full share: 45.7 M elements
 * against 39.6 M possible at dp = 4, issue 23), owners stay contiguous in
 * table order, and every rank owns something. */
static void test_zero_owners_least_largest_run(void **state)
{
    (void)state;
    mt_model_config c;
    small_config(&c);
    c.vocab_size = 32768, c.hidden_size = 1024, c.intermediate_size = 4096;
    c.moe_intermediate_size = 1024, c.num_attention_heads = 16, c.num_key_value_heads = 16;
    c.q_lora_rank = 512, c.kv_lora_rank = 512, c.qk_nope_head_dim = 128;
    c.qk_rope_head_dim = 64, c.v_head_dim = 128, c.n_routed_experts = 16, c.n_group = 8;
    c.topk_group = 4;
    for (int dp = 2; dp <= 6; dp++) {
        mt_layout l;
        char spec[32];
        snprintf(spec, sizeof spec, "dp=%d", dp);
        assert_int_equal(mt_layout_parse(&l, spec), MT_OK);
        mt_shard_map m;
        mt_shard_opts o = full_opts(1);
        assert_int_equal(mt_shard_map_build(&m, &c, &l, &o), MT_OK);
        int *own = calloc((size_t)m.n_params, sizeof *own);
        int64_t *dense = calloc((size_t)m.n_params, sizeof *dense), held[6] = {0};
        int64_t expert_held[6] = {0}, experts = 0;
        assert_true(own && dense);
        assert_int_equal(mt_zero_owners(&c, &l, own), MT_OK);
        int n = 0, last = 0;
        for (int i = 0; i < m.n_params; i++) {
            if (own[i] < 0) continue; /* router bias */
            const mt_shard_tensor *w = &m.tensors[m.param_tensor[i][MT_TS_WEIGHT]];
            const int64_t e = w->shape[0] * (w->ndim > 1 ? w->shape[1] : 1);
            if (strstr(w->name, ".experts.")) {
                expert_held[own[i]] += e, experts += e;
                continue;
            }
            assert_true(own[i] >= last); /* contiguous runs in rank order */
            last = own[i];
            held[own[i]] += e;
            dense[n++] = e;
        }
        const int64_t best = best_largest_run(dense, n, dp);
        int64_t largest = 0;
        for (int z = 0; z < dp; z++) {
            assert_true(held[z] > 0);
            if (held[z] > largest) largest = held[z];
            /* the experts (equal parameters) split as evenly as whole ones can */
            assert_true(expert_held[z] * dp >= experts - dp * (int64_t)1024 * 1024);
            assert_true(expert_held[z] * dp <= experts + dp * (int64_t)1024 * 1024);
        }
        assert_int_equal(largest, best);
        assert_true(best >= (int64_t)32768 * 1024); /* the head alone */
        free(own);
        free(dense);
        mt_shard_map_free(&m);
    }
}

/* ZeRO-1: each parameter's optimizer state is kept whole (its TP slab) by
 * one rank of its DP (EDP) group, the owners in contiguous runs balanced by
 * elements; weights stay replicated; the map and mt_zero_owners agree. */
static void test_zero_owners(void **state)
{
    (void)state;
    mt_model_config c;
    small_config(&c);
    mt_layout l;
    assert_int_equal(mt_layout_parse(&l, "tp=2,dp=3,ep=2"), MT_OK);
    mt_shard_map m;
    mt_shard_opts o = full_opts(1);
    assert_int_equal(mt_shard_map_build(&m, &c, &l, &o), MT_OK);
    int *own = calloc((size_t)m.n_params, sizeof *own);
    assert_non_null(own);
    assert_int_equal(mt_zero_owners(&c, &l, own), MT_OK);
    /* dense: owners 0..dp-1 in non-decreasing table order, each one used;
     * experts: owners within the EDP group (edp = 2 * 3 / 2 = 3) */
    int64_t dense_elems[3] = {0, 0, 0};
    int last_dense = 0, edp = mt_layout_edp(&l);
    for (int i = 0; i < m.n_params; i++) {
        const mt_shard_tensor *w = &m.tensors[m.param_tensor[i][MT_TS_WEIGHT]];
        const int t = m.param_tensor[i][MT_TS_EXP_AVG];
        if (t < 0) { /* router bias: no optimizer state */
            assert_int_equal(own[i], -1);
            continue;
        }
        const int expert = strstr(w->name, ".experts.") != NULL;
        assert_true(own[i] >= 0 && own[i] < (expert ? edp : l.dp));
        if (!expert) {
            assert_true(own[i] >= last_dense);
            last_dense = own[i];
            dense_elems[own[i]] += w->shape[0] * w->shape[1];
        }
        /* one piece per TP (ETP) slab, written by the owner, held only by the owner's ranks */
        const mt_shard_tensor *a = &m.tensors[t];
        const mt_shard_piece *pc = &m.pieces[a->first_piece];
        mt_rank_coords rc;
        mt_layout_coords(&l, pc->writer, &rc);
        assert_int_equal(expert ? rc.edp : rc.dp, own[i]);
        int held = 0;
        for (int r = 0; r < m.world; r++) {
            int64_t off[2], cnt[2];
            if (!mt_shard_map_held(&m, t, r, off, cnt)) continue;
            mt_layout_coords(&l, r, &rc);
            assert_int_equal(expert ? rc.edp : rc.dp, own[i]);
            held++;
        }
        assert_true(held >= a->n_pieces); /* TP-replicated ones: every tp rank of the owner */
    }
    for (int z = 0; z < 3; z++) assert_true(dense_elems[z] > 0);
    /* q_b_proj of layer 0: split by TP into two pieces, each whole for its owner */
    int a = mt_shard_map_find(&m, "optimizer.exp_avg.model.layers.0.self_attn.q_b_proj.weight");
    assert_true(a >= 0);
    assert_int_equal(m.tensors[a].n_pieces, 2);
    int64_t off[2], cnt[2];
    const int writer = m.pieces[m.tensors[a].first_piece + 1].writer;
    assert_int_equal(mt_shard_map_held(&m, a, writer, off, cnt), 1);
    assert_int_equal(off[0], 256);
    assert_int_equal(cnt[0], 256);
    free(own);
    mt_shard_map_free(&m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_layouts_tile),  cmocka_unit_test(test_dsv3_layouts_tile),
        cmocka_unit_test(test_fp8_block_rule),      cmocka_unit_test(test_layout_rules),
        cmocka_unit_test(test_pipeline_placement),  cmocka_unit_test(test_zero_owners),
        cmocka_unit_test(test_zero_owners_least_largest_run),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
