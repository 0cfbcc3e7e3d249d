/* test_ckpt_format.c - the checkpoint format and its guarantees, on
 * synthetic tensor contents (every element a pure function of the tensor
 * name and its global index):
 *  - save -> load returns every tensor byte for byte, any hyperslab, any
 *    layout; metadata round-trips;
 *  - conversions (bf16 -> f32, e4m3 + scales -> f32, f32 -> e4m3) follow
 *    the project's rules;
 *  - a flipped byte in any dataset, a truncated shard, a missing shard, an
 *    inconsistent index: verify and load fail naming the file and tensor;
 *  - the index's chunks table records where HDF5 put every chunk; a load
 *    without a row finds the chunks through HDF5, a wrong row fails;
 *  - h5dump prints a whole global tensor through the index's virtual
 *    dataset, across shard files;
 *  - the commit protocol: partial directories are never checkpoints and are
 *    cleaned; `latest`; keep-last-k never removes the newest, `latest`'s
 *    target or one being read;
 *  - xxh64 test vectors; safetensors round trip;
 *  - O_DIRECT writes and reads (the defaults, their overrides, a tmpfs
 *    that may refuse them) change no byte, and the large chunks written
 *    that way are aligned and not left in the page cache.
 */
#define _GNU_SOURCE /* O_DIRECT */
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <hdf5.h>
#include <jansson.h>
#include <math.h>
#include <sys/stat.h>

#include "ckpt/ckpt.h"
#include "ckpt/ckpt_internal.h"
#include "ckpt/safetensors.h"
#include "ckpt/xxh64.h"
#include "kernels/mt_fp8.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"
#include "test_util.h"

static char tmp[1024];
/* the synthetic model's vocabulary (test_direct_io enlarges it) */
static int cfg_vocab = 96;

/* 2 layers (one dense), MTP 1, 4 experts; dims multiples of 256 so that
 * tp = 2 keeps FP8 blocks whole. */
static void cfg(mt_model_config *c)
{
    mt_config_defaults(c);
    c->vocab_size = cfg_vocab;
    c->hidden_size = 256;
    c->intermediate_size = 512;
    c->moe_intermediate_size = 256;
    c->num_hidden_layers = 2;
    c->num_attention_heads = 4;
    c->num_key_value_heads = 4;
    c->q_lora_rank = 128;
    c->kv_lora_rank = 128;
    c->qk_nope_head_dim = 64;
    c->qk_rope_head_dim = 64;
    c->v_head_dim = 64;
    c->n_routed_experts = 4;
    c->n_shared_experts = 1;
    c->num_experts_per_tok = 2;
    c->n_group = 2;
    c->topk_group = 1;
    c->first_k_dense_replace = 1;
    c->num_nextn_predict_layers = 1;
}

static uint64_t fnv(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ULL;
    return h;
}

/* Elements [k0, k0 + n) (global row-major indices) of tensor `name`:
 * finite values, a pure function of the name and the index. */
static void gen_run(const char *name, mt_dtype dt, int64_t k0, int64_t n, void *out)
{
    const uint64_t seed = fnv(name);
    const int scale = strstr(name, "weight_scale_inv") != NULL;
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = mt_hash_u64(seed, (uint64_t)(k0 + i));
        float v = (float)((double)(h >> 11) * 0x1p-53 * 2 - 1);
        if (scale) v = 1e-3f + fabsf(v) * 1e-2f;
        switch (dt) {
        case MT_DT_F32: ((float *)out)[i] = v; break;
        case MT_DT_BF16: ((uint16_t *)out)[i] = mt_bf16_from_f32(v); break;
        case MT_DT_E4M3: {
            uint8_t b = (uint8_t)(h & 0xff);
            if ((b & 0x7f) == 0x7f) b ^= 1; /* no NaN codes */
            ((uint8_t *)out)[i] = b;
            break;
        }
        default: memset((char *)out + i * (int64_t)mt_dtype_size(dt), 0, mt_dtype_size(dt)); break;
        }
    }
}

static void gen(const char *name, mt_dtype dt, int64_t k, void *out) { gen_run(name, dt, k, 1, out); }

static int fill_gen(void *ctx, int i, const mt_tensor_desc *band, void *buf)
{
    (void)ctx;
    (void)i;
    const size_t es = mt_dtype_size(band->dtype);
    const int64_t C = band->ndim == 2 ? band->shape[1] : 1;
    const int64_t c0 = band->ndim == 2 ? band->off[1] : 0, nc = band->ndim == 2 ? band->count[1] : 1;
    for (int64_t r = 0; r < band->count[0]; r++)
        gen_run(band->name, band->dtype, (band->off[0] + r) * C + c0, nc,
                (char *)buf + (size_t)(r * nc) * es);
    return MT_OK;
}

static mt_shard_opts opts_full(void)
{
    mt_shard_opts o = {.fp8 = 1, .act_dtype = MT_DT_BF16, .optimizer = 1, .has_main = 1,
                       .main_dtype = MT_DT_F32};
    return o;
}

/* Writes every rank's shard of map into the partial directory part
 * (descriptor scratch d[map->n_pieces]); their records into recs, rank
 * after rank. */
static void write_shards(const char *part, const mt_shard_map *map, mt_tensor_desc *d,
                         mt_ckpt_piece_rec *recs)
{
    int k = 0;
    for (int r = 0; r < map->world; r++) {
        int n;
        const int *idx = mt_shard_map_rank_pieces(map, r, &n);
        if (!n) continue;
        for (int i = 0; i < n; i++) mt_shard_piece_desc(map, idx[i], &d[i]);
        const int rc = mt_ckpt_write_shard(part, r, d, n, fill_gen, NULL, recs + k, NULL);
        if (rc) fprintf(stderr, "%s\n", mt_errmsg());
        assert_int_equal(rc, MT_OK);
        k += n;
    }
    assert_int_equal(k, map->n_pieces);
}

/* save_ckpt's index: begun from the shard map before the shards are
 * written and finished with their records (as rank 0 of several writes
 * it), or written whole after them. */
static int index_begun;

/* Saves a synthetic checkpoint of `step` under root with a layout. */
static void save_ckpt(const char *root, const char *layout, int64_t step, int keep)
{
    mt_model_config c;
    cfg(&c);
    mt_layout l;
    assert_int_equal(mt_layout_parse(&l, layout), MT_OK);
    mt_shard_map map;
    mt_shard_opts o = opts_full();
    int rc = mt_shard_map_build(&map, &c, &l, &o);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
    mt_ckpt_meta meta;
    memset(&meta, 0, sizeof meta);
    meta.step = step;
    meta.consumed_samples = 8 * step;
    meta.consumed_tokens = 256 * step;
    json_t *cj = mt_config_to_json(&c);
    meta.config_json = json_dumps(cj, JSON_SORT_KEYS | JSON_COMPACT);
    json_decref(cj);
    meta.job_json = strdup("{\"name\":\"synthetic\"}");
    char st[64];
    snprintf(st, sizeof st, "{\"step\":%lld}", (long long)step);
    meta.state_json = strdup(st);
    meta.layout = l;
    meta.opts = o;
    char part[2048];
    assert_int_equal(mt_ckpt_begin(root, step, part, sizeof part), MT_OK);
    mt_ckpt_index *ix = NULL;
    if (index_begun) { /* as rank 0 of a multi-rank save: before the shards are done */
        rc = mt_ckpt_index_begin(&ix, part, &meta, &map);
        if (rc) fprintf(stderr, "%s\n", mt_errmsg());
        assert_int_equal(rc, MT_OK);
    }
    mt_ckpt_piece_rec *recs = calloc((size_t)map.n_pieces, sizeof *recs);
    mt_tensor_desc *d = calloc((size_t)map.n_pieces, sizeof *d);
    write_shards(part, &map, d, recs);
    const int k = map.n_pieces;
    rc = ix ? mt_ckpt_index_finish(ix, recs, k) : mt_ckpt_write_index(part, &meta, &map, recs, k);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
    assert_int_equal(mt_ckpt_commit(root, step, keep), MT_OK);
    free(recs);
    free(d);
    mt_ckpt_meta_free(&meta);
    mt_shard_map_free(&map);
}

/* Reads hyperslab (r0, c0, nr, nc) of tensor t and compares with gen. */
static void check_slab(mt_ckpt *ck, const mt_ckpt_tensor *x, int64_t r0, int64_t c0, int64_t nr,
                       int64_t nc)
{
    const size_t es = mt_dtype_size(x->dtype);
    mt_tensor_desc d;
    mt_tensor_desc_slab(&d, x->name, x->dtype, x->ndim, x->shape, r0, c0, nr, nc,
                        malloc((size_t)(nr * nc) * es));
    void *want = malloc((size_t)(nr * nc) * es);
    mt_tensor_desc w = d;
    w.data = want;
    fill_gen(NULL, 0, &w, want);
    int rc = mt_ckpt_read_fn(ck, &d);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
    if (memcmp(d.data, want, (size_t)(nr * nc) * es) != 0) {
        fprintf(stderr, "%s [%lld+%lld, %lld+%lld] differs\n", x->name, (long long)r0,
                (long long)nr, (long long)c0, (long long)nc);
        fail();
    }
    free(d.data);
    free(want);
}

/* The index's chunks table (FORMAT.md) records every piece's chunks where
 * HDF5's chunk index of the shard has them: a load reads them from there
 * without the shard's metadata. */
static void check_chunks_recorded(mt_ckpt *ck)
{
    for (int p = 0; p < mt_ckpt_n_pieces(ck); p++) {
        const mt_ckpt_piece_rec *r = mt_ckpt_piece_at(ck, p);
        int64_t cr = 0, *addr = NULL;
        assert_int_equal(ck_piece_chunks(ck, p, &cr, &addr), MT_OK);
        if (ck_vfd_id() >= 0) assert_true(r->chunk_rows > 0); /* the writer's driver places them */
        if (r->chunk_rows > 0) {
            assert_int_equal(r->chunk_rows, cr);
            for (int64_t k = 0; k * cr < r->count[0]; k++)
                assert_int_equal(addr[k], r->chunk_addr + k * r->chunk_stride);
        }
        free(addr);
    }
}

/* Save -> load exact: every tensor whole and random hyperslabs crossing
 * piece boundaries, under two layouts, with the index written after the
 * shards or begun from the shard map before them; metadata round-trips. */
static void test_save_load_exact(void **state)
{
    (void)state;
    const char *layouts[] = {"tp=2,pp=2,ep=2", "tp=1,pp=2,ep=4,dp=4"};
    for (int li = 0; li < 4; li++) {
        char root[1200];
        snprintf(root, sizeof root, "%s/exact%d", tmp, li);
        index_begun = li >= 2; /* the index begun before the shards, then finished */
        save_ckpt(root, layouts[li % 2], 7, 0);
        index_begun = 0;
        mt_ckpt *ck;
        int rc = mt_ckpt_open(&ck, root);
        if (rc) fprintf(stderr, "%s\n", mt_errmsg());
        assert_int_equal(rc, MT_OK);
        const mt_ckpt_meta *m = mt_ckpt_get_meta(ck);
        assert_int_equal(m->step, 7);
        assert_int_equal(m->consumed_samples, 56);
        assert_int_equal(m->consumed_tokens, 7 * 256);
        assert_string_equal(m->state_json, "{\"step\":7}");
        assert_string_equal(m->job_json, "{\"name\":\"synthetic\"}");
        mt_layout l;
        mt_layout_parse(&l, layouts[li % 2]);
        assert_memory_equal(&m->layout, &l, sizeof l);
        assert_true(m->opts.fp8 && m->opts.optimizer && m->opts.has_main);
        mt_rng r;
        mt_rng_seed(&r, 99);
        for (int t = 0; t < mt_ckpt_n_tensors(ck); t++) {
            const mt_ckpt_tensor *x = mt_ckpt_tensor_at(ck, t);
            check_slab(ck, x, 0, 0, x->shape[0], x->shape[1]);
            int64_t r0 = (int64_t)mt_rng_below(&r, (uint64_t)x->shape[0]);
            int64_t c0 = (int64_t)mt_rng_below(&r, (uint64_t)x->shape[1]);
            int64_t nr = 1 + (int64_t)mt_rng_below(&r, (uint64_t)(x->shape[0] - r0));
            int64_t nc = 1 + (int64_t)mt_rng_below(&r, (uint64_t)(x->shape[1] - c0));
            check_slab(ck, x, r0, c0, nr, nc);
        }
        check_chunks_recorded(ck);
        mt_shard_map map;
        assert_int_equal(mt_ckpt_map(ck, &map), MT_OK);
        assert_int_equal(map.n_tensors, mt_ckpt_n_tensors(ck));
        assert_int_equal(map.n_pieces, mt_ckpt_n_pieces(ck));
        mt_shard_map_free(&map);
        mt_ckpt_close(ck);
        assert_int_equal(mt_ckpt_verify(root, NULL, NULL, NULL), MT_OK);
    }
}

/* Conversions: bf16 -> f32 exact, e4m3 + scales -> q * s, f32 -> e4m3 by
 * the block rule. */
static void test_conversions(void **state)
{
    (void)state;
    char root[1200];
    snprintf(root, sizeof root, "%s/conv", tmp);
    save_ckpt(root, "tp=2", 1, 0);
    mt_ckpt *ck;
    assert_int_equal(mt_ckpt_open(&ck, root), MT_OK);
    /* bf16 tensor read as f32 */
    const char *bn = "model.layers.0.input_layernorm.weight";
    mt_tensor_desc d;
    mt_tensor_desc_whole(&d, bn, MT_DT_F32, 1, 1, 256, malloc(256 * 4));
    assert_int_equal(mt_ckpt_read_fn(ck, &d), MT_OK);
    for (int k = 0; k < 256; k++) {
        uint16_t b;
        gen(bn, MT_DT_BF16, k, &b);
        assert_true(((float *)d.data)[k] == mt_bf16_to_f32(b));
    }
    free(d.data);
    /* e4m3 weight read as f32: q * s of its block */
    const char *qn = "model.layers.0.self_attn.q_b_proj.weight"; /* [512, 128] */
    const char *sn = "model.layers.0.self_attn.q_b_proj.weight_scale_inv";
    mt_tensor_desc_whole(&d, qn, MT_DT_F32, 2, 512, 128, malloc(512 * 128 * 4));
    d.off[0] = 128;
    d.count[0] = 300;
    assert_int_equal(mt_ckpt_read_fn(ck, &d), MT_OK);
    for (int i = 0; i < 300; i++)
        for (int j = 0; j < 128; j += 17) {
            uint8_t q;
            float s;
            gen(qn, MT_DT_E4M3, (int64_t)(128 + i) * 128 + j, &q);
            gen(sn, MT_DT_F32, (128 + i) / 128, &s);
            assert_true(((float *)d.data)[i * 128 + j] == mt_e4m3_to_f32(q) * s);
        }
    free(d.data);
    /* f32 main params read as FP8: the project's quantisation */
    const char *mn = "optimizer.main.model.layers.0.self_attn.o_proj.weight"; /* [256, 256] */
    mt_tensor_source src = mt_ckpt_source(ck);
    mt_tensor_desc q;
    mt_tensor_desc_whole(&q, mn, MT_DT_E4M3, 2, 256, 256, malloc(256 * 256));
    float sc[4];
    assert_int_equal(mt_source_read_fp8(&src, &q, sc), MT_OK);
    for (int b = 0; b < 4; b++) {
        float amax = 0;
        for (int i = 0; i < 128; i++)
            for (int j = 0; j < 128; j++) {
                float v;
                gen(mn, MT_DT_F32, (int64_t)((b / 2) * 128 + i) * 256 + (b % 2) * 128 + j, &v);
                amax = fabsf(v) > amax ? fabsf(v) : amax;
            }
        assert_true(sc[b] == mt_fp8_scale(amax));
    }
    float v0;
    gen(mn, MT_DT_F32, 0, &v0);
    assert_int_equal(((uint8_t *)q.data)[0], mt_e4m3_from_f32(v0 / sc[0]));
    free(q.data);
    /* FP8 reads must not cut a block */
    mt_tensor_desc_whole(&q, qn, MT_DT_E4M3, 2, 512, 128, malloc(512 * 128));
    q.off[0] = 64;
    q.count[0] = 128;
    assert_int_equal(mt_source_read_fp8(&src, &q, NULL), MT_EINVAL);
    free(q.data);
    mt_ckpt_close(ck);
}

/* ---- damage ----------------------------------------------------------------------- */

static void copy_tree(const char *from, const char *to)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", to, from, to);
    assert_int_equal(system(cmd), 0);
}

/* File offset of a byte inside the first chunk of dataset `name` (HDF5
 * addresses start after the user block: the index has one, its seal). */
static long chunk_byte(const char *file, const char *name)
{
    hid_t f = H5Fopen(file, H5F_ACC_RDONLY, H5P_DEFAULT);
    assert_true(f >= 0);
    hid_t fcpl = H5Fget_create_plist(f);
    hsize_t ub = 0;
    assert_true(H5Pget_userblock(fcpl, &ub) >= 0);
    H5Pclose(fcpl);
    hid_t ds = H5Dopen2(f, name, H5P_DEFAULT);
    assert_true(ds >= 0);
    hid_t sp = H5Dget_space(ds);
    hsize_t off[2];
    unsigned mask;
    haddr_t addr;
    hsize_t size;
    assert_true(H5Dget_chunk_info(ds, sp, 0, off, &mask, &addr, &size) >= 0);
    H5Sclose(sp);
    H5Dclose(ds);
    H5Fclose(f);
    return (long)(ub + addr + size / 2);
}

static void flip_byte(const char *file, long at)
{
    FILE *f = fopen(file, "r+b");
    assert_non_null(f);
    fseek(f, at, SEEK_SET);
    int c = fgetc(f);
    fseek(f, at, SEEK_SET);
    fputc(c ^ 0x20, f);
    fclose(f);
}

typedef struct reports {
    int n;
    char first[2048];
} reports;

static void collect(void *ctx, const char *file, const char *tensor, const char *problem)
{
    reports *r = ctx;
    if (!r->n++) snprintf(r->first, sizeof r->first, "%s | %s | %s", file, tensor, problem);
}

/* Opening and reading every tensor fails with a message naming both. */
static void expect_load_fails(const char *dir, const char *file, const char *tensor)
{
    mt_ckpt *ck;
    int rc = mt_ckpt_open(&ck, dir);
    if (rc == MT_OK) {
        for (int t = 0; t < mt_ckpt_n_tensors(ck) && rc == MT_OK; t++) {
            const mt_ckpt_tensor *x = mt_ckpt_tensor_at(ck, t);
            mt_tensor_desc d;
            mt_tensor_desc_whole(&d, x->name, x->dtype, x->ndim, x->ndim == 1 ? 1 : x->shape[0],
                                 x->ndim == 1 ? x->shape[0] : x->shape[1], NULL);
            d.data = malloc(mt_tensor_desc_bytes(&d));
            rc = mt_ckpt_read_fn(ck, &d);
            free(d.data);
        }
        mt_ckpt_close(ck);
    }
    assert_true(rc < 0);
    assert_contains(mt_errmsg(), file);
    assert_contains(mt_errmsg(), tensor);
}

static void expect_verify_fails(const char *dir, const char *file, const char *tensor)
{
    reports r = {0, ""};
    int rc = mt_ckpt_verify(dir, collect, &r, NULL);
    assert_int_equal(rc, MT_ECORRUPT);
    assert_true(r.n >= 1);
    assert_contains(mt_errmsg(), file);
    assert_contains(mt_errmsg(), tensor);
    assert_contains(r.first, file);
    assert_contains(r.first, tensor);
}

/* A flipped byte in the data of datasets of every kind: weight e4m3,
 * scales, bf16 norm, f32 router bias, optimizer moments and main. */
static void test_flipped_byte(void **state)
{
    (void)state;
    char root[1200], base[1300], dir[1300], file[1400];
    snprintf(root, sizeof root, "%s/flip", tmp);
    save_ckpt(root, "tp=2,ep=2", 3, 0);
    snprintf(base, sizeof base, "%s/step_00000003", root);
    const struct {
        const char *tensor;
        int rank;
    } cases[] = {
        {"model.layers.1.mlp.experts.3.down_proj.weight", 1},
        {"model.layers.0.self_attn.kv_b_proj.weight_scale_inv", 0},
        {"model.layers.2.shared_head.norm.weight", 0},
        {"model.layers.1.mlp.gate.e_score_correction_bias", 0},
        {"optimizer.exp_avg_sq.model.embed_tokens.weight", 1},
        {"optimizer.main.model.layers.0.mlp.up_proj.weight", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(dir, sizeof dir, "%s/../flip_case", root);
        copy_tree(base, dir);
        char shard[32];
        snprintf(shard, sizeof shard, "shard_%05d.h5", cases[i].rank);
        snprintf(file, sizeof file, "%s/%s", dir, shard);
        flip_byte(file, chunk_byte(file, cases[i].tensor));
        expect_verify_fails(dir, shard, cases[i].tensor);
        expect_load_fails(dir, shard, cases[i].tensor);
    }
    /* the index's own datasets: the shard map and the trainer state */
    const char *tables[] = {"moetrain/pieces", "moetrain/state"};
    for (int i = 0; i < 2; i++) {
        copy_tree(base, dir);
        snprintf(file, sizeof file, "%s/index.h5", dir);
        flip_byte(file, chunk_byte(file, tables[i]));
        reports r = {0, ""};
        assert_int_equal(mt_ckpt_verify(dir, collect, &r, NULL), MT_ECORRUPT);
        assert_contains(mt_errmsg(), "index.h5");
        assert_contains(mt_errmsg(), tables[i] + 9);
        mt_ckpt *ck;
        assert_true(mt_ckpt_open(&ck, dir) < 0);
        assert_contains(mt_errmsg(), "index.h5");
        assert_contains(mt_errmsg(), tables[i] + 9);
    }
}

/* An index begun from the shard map is finished only with the map's
 * pieces: a piece missing, or recorded by another rank than the map's
 * writer, is refused naming the tensor, and no sealed index is left (the
 * checkpoint does not open); aborted, the same. */
static void test_index_begun_refuses_other_pieces(void **state)
{
    (void)state;
    mt_model_config c;
    cfg(&c);
    mt_layout l;
    assert_int_equal(mt_layout_parse(&l, "tp=1,pp=2,ep=2,dp=2"), MT_OK);
    mt_shard_map map;
    mt_shard_opts o = opts_full();
    assert_int_equal(mt_shard_map_build(&map, &c, &l, &o), MT_OK);
    mt_ckpt_meta meta;
    memset(&meta, 0, sizeof meta);
    json_t *cj = mt_config_to_json(&c);
    meta.config_json = json_dumps(cj, JSON_SORT_KEYS | JSON_COMPACT);
    json_decref(cj);
    meta.layout = l;
    meta.opts = o;
    char root[1200], part[2048], done[1300], want[MT_TENSOR_NAME_CAP + 16];
    snprintf(root, sizeof root, "%s/begun", tmp);
    mt_ckpt_piece_rec *recs = calloc((size_t)map.n_pieces, sizeof *recs);
    mt_tensor_desc *d = calloc((size_t)map.n_pieces, sizeof *d);
    /* rounds: a piece recorded by the next rank instead of its writer; the
     * last piece missing; the index aborted; the pieces as written */
    for (int round = 0; round < 4; round++) {
        const int64_t step = 3 + round;
        meta.step = step;
        assert_int_equal(mt_ckpt_begin(root, step, part, sizeof part), MT_OK);
        mt_ckpt_index *ix;
        assert_int_equal(mt_ckpt_index_begin(&ix, part, &meta, &map), MT_OK);
        write_shards(part, &map, d, recs);
        const int k = map.n_pieces;
        if (round == 0) recs[k / 2].rank = (recs[k / 2].rank + 1) % map.world;
        snprintf(want, sizeof want, "tensor %s", recs[round == 0 ? k / 2 : k - 1].tensor);
        if (round == 2) mt_ckpt_index_abort(ix);
        else {
            const int rc = mt_ckpt_index_finish(ix, recs, round == 1 ? k - 1 : k);
            if (round == 3 && rc) fprintf(stderr, "%s\n", mt_errmsg());
            assert_int_equal(rc, round == 3 ? MT_OK : MT_EINVAL);
            if (round == 0) assert_contains(mt_errmsg(), want);
            if (round == 1) assert_contains(mt_errmsg(), "pieces");
        }
        assert_int_equal(mt_ckpt_commit(root, step, 0), MT_OK);
        snprintf(done, sizeof done, "%s/step_%08lld", root, (long long)step);
        mt_ckpt *ck;
        const int rc = mt_ckpt_open(&ck, done);
        if (round < 3) {
            assert_true(rc < 0); /* no sealed index: not a checkpoint */
            continue;
        }
        if (rc) fprintf(stderr, "%s\n", mt_errmsg());
        assert_int_equal(rc, MT_OK);
        mt_ckpt_close(ck);
        assert_int_equal(mt_ckpt_verify(done, NULL, NULL, NULL), MT_OK);
    }
    free(recs);
    free(d);
    mt_ckpt_meta_free(&meta);
    mt_shard_map_free(&map);
}

/* Pages of [at, at + n) of file in the page cache, and of all. */
static void resident_pages(const char *file, long at, long n, long *in, long *all)
{
    const long pg = sysconf(_SC_PAGESIZE);
    int fd = open(file, O_RDONLY);
    assert_true(fd >= 0);
    const long a0 = at / pg * pg, len = at + n - a0;
    void *m = mmap(NULL, (size_t)len, PROT_READ, MAP_SHARED, fd, a0);
    assert_true(m != MAP_FAILED);
    *all = (len + pg - 1) / pg;
    unsigned char *v = malloc((size_t)*all);
    assert_int_equal(mincore(m, (size_t)len, v), 0);
    *in = 0;
    for (long i = 0; i < *all; i++) *in += v[i] & 1;
    free(v);
    munmap(m, (size_t)len);
    close(fd);
}

/* Whether dir's file system takes O_DIRECT and is a disk (not tmpfs,
 * whose pages are the page cache). */
static int direct_disk(const char *dir)
{
    char p[1300];
    snprintf(p, sizeof p, "%s/direct.probe", dir);
    int fd = open(p, O_CREAT | O_WRONLY | O_DIRECT, 0644);
    if (fd >= 0) close(fd);
    unlink(p);
    struct statfs sf;
    return fd >= 0 && statfs(dir, &sf) == 0 && sf.f_type != 0x01021994 /* TMPFS_MAGIC */;
}

/* O_DIRECT changes no byte: a checkpoint with chunks of 1 to 4 MB
 * (vocabulary 4096: the embedding's pieces) saved with shard chunks past
 * the page cache (the default) and through it (MT_CKPT_DIRECT=0), read
 * with O_DIRECT (MT_CKPT_DIRECT_READ=1, every shard, then the reader's own)
 * and through the page cache, in the test directory and on /dev/shm
 * (tmpfs: O_DIRECT refused before Linux 6.6, the fallback then), reads
 * back every tensor exactly and verifies. Where the disk takes O_DIRECT,
 * the large chunks written that way start on 4 KB boundaries and are not
 * in the page cache after the save; through the page cache they are not
 * aligned by the writer. */
static void test_direct_io(void **state)
{
    (void)state;
    cfg_vocab = 4096;
    const char *big = "optimizer.main.model.embed_tokens.weight"; /* [4096, 256] f32: 4 MB */
    char shm[1100];
    snprintf(shm, sizeof shm, "/dev/shm/moetrain_direct_%d", (int)getpid());
    const int have_shm = mkdir(shm, 0755) == 0;
    const char *dirs[2] = {tmp, shm};
    for (int di = 0; di < 1 + have_shm; di++) {
        for (int w = 0; w < 2; w++) {
            char root[1300], file[1400];
            snprintf(root, sizeof root, "%s/direct%d", dirs[di], w);
            if (w) setenv("MT_CKPT_DIRECT", "0", 1);
            else unsetenv("MT_CKPT_DIRECT");
            save_ckpt(root, "tp=1", 5, 0);
            unsetenv("MT_CKPT_DIRECT");
            snprintf(file, sizeof file, "%s/step_00000005/shard_00000.h5", root);
            /* the chunk's start: chunk_byte gives its middle (4 MB + 4 checksum bytes) */
            const long at = chunk_byte(file, big) - ((4 << 20) + 4) / 2;
            if (!w && direct_disk(dirs[di])) {
                long in, all;
                resident_pages(file, at, 4 << 20, &in, &all);
                if (at % 4096 != 0 || in > all / 4) {
                    fprintf(stderr, "%s: chunk of %s at %ld, %ld of its %ld pages in the page cache\n",
                            file, big, at, in, all);
                    fail();
                }
            }
            for (int r = 0; r < 3; r++) {
                setenv("MT_CKPT_DIRECT_READ", r ? "1" : "0", 1);
                mt_ckpt *ck;
                int rc = mt_ckpt_open(&ck, root);
                if (rc) fprintf(stderr, "%s\n", mt_errmsg());
                assert_int_equal(rc, MT_OK);
                if (r == 2) mt_ckpt_set_reader_rank(ck, 0);
                for (int t = 0; t < mt_ckpt_n_tensors(ck); t++) {
                    const mt_ckpt_tensor *x = mt_ckpt_tensor_at(ck, t);
                    check_slab(ck, x, 0, 0, x->shape[0], x->shape[1]);
                    check_slab(ck, x, x->shape[0] / 3, 0, x->shape[0] - x->shape[0] / 3, x->shape[1]);
                }
                mt_ckpt_close(ck);
                assert_int_equal(mt_ckpt_verify(root, NULL, NULL, NULL), MT_OK);
            }
            unsetenv("MT_CKPT_DIRECT_READ");
        }
    }
    if (have_shm) {
        char cmd[1200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", shm);
        assert_int_equal(system(cmd), 0);
    }
    cfg_vocab = 96;
}

/* Whole reads in any order return the same bytes, with or without the
 * reader's rank (the read-ahead follows file order, skips other ranks'
 * optimizer state and drops what the reader goes past): tensors forwards,
 * backwards, every third one, as ranks 0, 1 and 3 of dp = 4. */
static void test_read_any_order(void **state)
{
    (void)state;
    char root[1200];
    snprintf(root, sizeof root, "%s/order", tmp);
    save_ckpt(root, "tp=1,pp=2,ep=4,dp=4", 9, 0);
    const int ranks[] = {-1, 0, 1, 3};
    for (int ri = 0; ri < 4; ri++) {
        for (int order = 0; order < 3; order++) {
            mt_ckpt *ck;
            assert_int_equal(mt_ckpt_open(&ck, root), MT_OK);
            if (ranks[ri] >= 0) mt_ckpt_set_reader_rank(ck, ranks[ri]);
            const int n = mt_ckpt_n_tensors(ck);
            for (int k = 0; k < n; k++) {
                const int t = order == 0 ? k : order == 1 ? n - 1 - k : (k * 3) % n;
                if (order == 2 && k >= (n + 2) / 3) break;
                const mt_ckpt_tensor *x = mt_ckpt_tensor_at(ck, t);
                check_slab(ck, x, 0, 0, x->shape[0], x->shape[1]);
            }
            mt_ckpt_close(ck);
        }
    }
}

static void test_truncated_and_missing_shard(void **state)
{
    (void)state;
    char root[1200], base[1300], dir[1300], file[1400];
    snprintf(root, sizeof root, "%s/trunc", tmp);
    save_ckpt(root, "pp=2", 2, 0);
    snprintf(base, sizeof base, "%s/step_00000002", root);
    snprintf(dir, sizeof dir, "%s/../trunc_case", root);
    /* truncated: shard 1 holds the last stage (final norm, head, MTP) */
    copy_tree(base, dir);
    snprintf(file, sizeof file, "%s/shard_00001.h5", dir);
    struct stat st;
    assert_int_equal(stat(file, &st), 0);
    assert_int_equal(truncate(file, st.st_size / 2), 0);
    expect_verify_fails(dir, "shard_00001.h5", "model.layers.1.");
    expect_load_fails(dir, "shard_00001.h5", "model.layers.1.");
    /* missing */
    copy_tree(base, dir);
    assert_int_equal(unlink(file), 0);
    expect_verify_fails(dir, "shard_00001.h5", "model.layers.1.");
    expect_load_fails(dir, "shard_00001.h5", "model.layers.1.");
}

/* Rewrites one row of an index table with edit(); with reseal, the
 * index's seal is renewed (an index consistent in its bytes, wrong in its
 * contents: what a faulty writer would commit), so that the checks of the
 * contents are what must catch it. */
static void edit_index_row(const char *dir, const char *table, size_t row_size, int row,
                           void (*edit)(void *row), int reseal)
{
    char p[1400];
    snprintf(p, sizeof p, "%s/index.h5", dir);
    hid_t f = H5Fopen(p, H5F_ACC_RDWR, H5P_DEFAULT);
    assert_true(f >= 0);
    hid_t ds = H5Dopen2(f, table, H5P_DEFAULT);
    assert_true(ds >= 0);
    hid_t t = H5Dget_type(ds), sp = H5Dget_space(ds);
    hsize_t o = (hsize_t)row, n = 1;
    H5Sselect_hyperslab(sp, H5S_SELECT_SET, &o, NULL, &n, NULL);
    hid_t ms = H5Screate_simple(1, &n, NULL);
    void *buf = calloc(1, row_size + 256);
    assert_true(H5Dread(ds, t, ms, sp, H5P_DEFAULT, buf) >= 0);
    edit(buf);
    assert_true(H5Dwrite(ds, t, ms, sp, H5P_DEFAULT, buf) >= 0);
    free(buf);
    H5Sclose(ms);
    H5Sclose(sp);
    H5Tclose(t);
    H5Dclose(ds);
    H5Fclose(f);
    if (reseal) assert_int_equal(ck_index_seal(p), MT_OK);
}

/* The file layout of a pieces row (FORMAT.md): tensor i32, rank i32,
 * offset i64[2], count i64[2], nbytes i64, xxh64 u64. */
typedef struct prow {
    int32_t tensor, rank;
    int64_t off[2], count[2], nbytes;
    uint64_t xxh64;
} prow;

static void shrink_count(void *r) { ((prow *)r)->count[0] -= 1, ((prow *)r)->nbytes = -1; }
static void shift_offset(void *r) { ((prow *)r)->off[0] += 1; }
static void bad_hash(void *r) { ((prow *)r)->xxh64 ^= 1; }

static int piece_of(const char *dir, const char *tensor, int *first)
{
    mt_ckpt *ck;
    assert_int_equal(mt_ckpt_open(&ck, dir), MT_OK);
    int t = mt_ckpt_find(ck, tensor);
    assert_true(t >= 0);
    *first = mt_ckpt_tensor_at(ck, t)->first_piece;
    int n = mt_ckpt_tensor_at(ck, t)->n_pieces;
    mt_ckpt_close(ck);
    return n;
}

/* A tp = 2 checkpoint saved under tmp/NAME (its step directory: base) and
 * a copy of it to damage (dir); *first: the first of the two pieces of
 * model.embed_tokens.weight. */
static void damage_case(const char *name, char base[1300], char dir[1300], int *first)
{
    char root[1200];
    snprintf(root, sizeof root, "%s/%s", tmp, name);
    save_ckpt(root, "tp=2", 5, 0);
    snprintf(base, 1300, "%s/step_00000005", root);
    snprintf(dir, 1300, "%s/../%s_case", root, name);
    copy_tree(base, dir);
    assert_int_equal(piece_of(dir, "model.embed_tokens.weight", first), 2);
}

static void test_inconsistent_index(void **state)
{
    (void)state;
    char base[1300], dir[1300];
    const char *tn = "model.embed_tokens.weight";
    int first;
    damage_case("index", base, dir, &first);
    /* a gap: a piece one row short (and its byte count inconsistent) */
    edit_index_row(dir, "moetrain/pieces", sizeof(prow), first + 1, shrink_count, 1);
    expect_verify_fails(dir, "index.h5", tn);
    expect_load_fails(dir, "index.h5", tn);
    /* an overlap: a piece shifted by a row (and now outside the shape) */
    copy_tree(base, dir);
    edit_index_row(dir, "moetrain/pieces", sizeof(prow), first, shift_offset, 1);
    expect_verify_fails(dir, "index.h5", tn);
    expect_load_fails(dir, "index.h5", tn);
    /* a checksum that does not match the data */
    copy_tree(base, dir);
    edit_index_row(dir, "moetrain/pieces", sizeof(prow), first + 1, bad_hash, 1);
    expect_verify_fails(dir, "shard_00001.h5", tn);
    expect_load_fails(dir, "shard_00001.h5", tn);
}

/* The file layout of a chunks row (FORMAT.md): rows, addr, stride (i64). */
static void chunks_unrecorded(void *r) { ((chunk_row *)r)->rows = 0; }
static void chunks_moved(void *r) { ((chunk_row *)r)->addr += 4096; }
static void chunks_past_end(void *r) { ((chunk_row *)r)->addr = (int64_t)1 << 40; }
static void chunks_overlap(void *r) { ((chunk_row *)r)->stride = 8; }

/* What a load does with the chunks table's rows: a piece without one is
 * read through HDF5's chunk index, byte for byte the same; one that points
 * elsewhere in its file fails the load at that piece (the chunk checksums)
 * and verify (the row disagrees with HDF5's); one outside the file, or
 * whose chunks would overlap, fails at open, naming the index and tensor. */
static void test_chunks_table(void **state)
{
    (void)state;
    char base[1300], dir[1300];
    const char *tn = "model.embed_tokens.weight";
    int first;
    damage_case("chunks", base, dir, &first);
    edit_index_row(dir, "moetrain/chunks", sizeof(chunk_row), first, chunks_unrecorded, 1);
    mt_ckpt *ck;
    assert_int_equal(mt_ckpt_open(&ck, dir), MT_OK);
    assert_int_equal(mt_ckpt_piece_at(ck, first)->chunk_rows, 0);
    for (int t = 0; t < mt_ckpt_n_tensors(ck); t++) {
        const mt_ckpt_tensor *x = mt_ckpt_tensor_at(ck, t);
        check_slab(ck, x, 0, 0, x->shape[0], x->shape[1]);
    }
    mt_ckpt_close(ck);
    assert_int_equal(mt_ckpt_verify(dir, NULL, NULL, NULL), MT_OK);
    copy_tree(base, dir);
    edit_index_row(dir, "moetrain/chunks", sizeof(chunk_row), first, chunks_moved, 1);
    expect_load_fails(dir, "shard_00000.h5", tn);
    expect_verify_fails(dir, "shard_00000.h5", tn);
    void (*bad[])(void *) = {chunks_past_end, chunks_overlap};
    for (int i = 0; i < 2; i++) {
        copy_tree(base, dir);
        edit_index_row(dir, "moetrain/chunks", sizeof(chunk_row), first + 1, bad[i], 1);
        expect_load_fails(dir, "index.h5", tn);
        expect_verify_fails(dir, "index.h5", tn);
    }
}

/* ---- verify in parallel ------------------------------------------------------------- */

/* Every report of a verify, in order, one line each. */
typedef struct report_log {
    int n;
    char text[16384];
} report_log;

static void log_report(void *ctx, const char *file, const char *tensor, const char *problem)
{
    report_log *l = ctx;
    size_t u = strlen(l->text);
    snprintf(l->text + u, sizeof l->text - u, "%s | %s | %s\n", file, tensor, problem);
    l->n++;
}

/* mt_ckpt_verify with MT_CKPT_VERIFY_CHUNKS = chunks (NULL: the default). */
static int verify_with(const char *dir, const char *chunks, report_log *l)
{
    if (chunks) setenv("MT_CKPT_VERIFY_CHUNKS", chunks, 1);
    else unsetenv("MT_CKPT_VERIFY_CHUNKS");
    memset(l, 0, sizeof *l);
    mt_progress prog;
    mt_progress_start(&prog, "verify", 1, 0);
    int rc = mt_ckpt_verify(dir, log_report, l, &prog);
    unsetenv("MT_CKPT_VERIFY_CHUNKS");
    return rc;
}

/* Rows per chunk of dataset `name` and the file offset of a byte inside
 * its chunk k. */
static long chunk_k_byte(const char *file, const char *name, int64_t k, int64_t *rows_per_chunk)
{
    hid_t f = H5Fopen(file, H5F_ACC_RDONLY, H5P_DEFAULT);
    assert_true(f >= 0);
    hid_t fcpl = H5Fget_create_plist(f);
    hsize_t ub = 0;
    assert_true(H5Pget_userblock(fcpl, &ub) >= 0);
    H5Pclose(fcpl);
    hid_t ds = H5Dopen2(f, name, H5P_DEFAULT);
    assert_true(ds >= 0);
    hid_t dcpl = H5Dget_create_plist(ds);
    hsize_t ch[2] = {0, 0};
    assert_true(H5Pget_chunk(dcpl, 2, ch) >= 1);
    H5Pclose(dcpl);
    hsize_t off[2] = {(hsize_t)k * ch[0], 0}, size = 0;
    unsigned mask = 0;
    haddr_t addr = HADDR_UNDEF;
    assert_true(H5Dget_chunk_info_by_coord(ds, off, &mask, &addr, &size) >= 0);
    assert_true(addr != HADDR_UNDEF);
    H5Dclose(ds);
    H5Fclose(f);
    *rows_per_chunk = (int64_t)ch[0];
    return (long)(ub + addr + size / 3);
}

/* Verify checks the chunks of every file and piece in parallel and feeds
 * each piece's XXH64 in chunk order: on a 4-file checkpoint whose large
 * pieces span 2-4 chunks, a clean copy verifies whatever the number of
 * chunks in flight (a hash fed out of order would fail it), and a damaged
 * copy gives the same report, line for line, with one chunk in flight as
 * with many: for a piece damaged in two chunks, the first in row order;
 * a recorded XXH64 that does not match; a small piece in another file. */
static void test_verify_parallel_equals_serial(void **state)
{
    (void)state;
    cfg_vocab = 16384; /* embedding and heads [16384, 256]: main params 16 MB, 4 chunks */
    char root[1200], base[1300], dir[1300], file[1400];
    snprintf(root, sizeof root, "%s/vpar", tmp);
    save_ckpt(root, "pp=2,dp=2", 9, 0);
    cfg_vocab = 96;
    snprintf(base, sizeof base, "%s/step_00000009", root);
    /* two pieces of 3+ chunks in different files, a small one in a third */
    mt_ckpt *ck;
    assert_int_equal(mt_ckpt_open(&ck, base), MT_OK);
    int pa = -1, pb = -1, pc = -1;
    for (int p = 0; p < mt_ckpt_n_pieces(ck); p++) {
        const mt_ckpt_piece_rec *r = mt_ckpt_piece_at(ck, p);
        if (r->nbytes > 2 * (int64_t)CK_CHUNK_BYTES && pa < 0) pa = p;
        else if (r->nbytes > 2 * (int64_t)CK_CHUNK_BYTES && pb < 0 && r->rank != mt_ckpt_piece_at(ck, pa)->rank)
            pb = p;
    }
    assert_true(pa >= 0 && pb >= 0);
    for (int p = 0; p < mt_ckpt_n_pieces(ck) && pc < 0; p++) {
        const mt_ckpt_piece_rec *r = mt_ckpt_piece_at(ck, p);
        if (r->nbytes < (int64_t)CK_CHUNK_BYTES && r->rank != mt_ckpt_piece_at(ck, pa)->rank &&
            r->rank != mt_ckpt_piece_at(ck, pb)->rank)
            pc = p;
    }
    assert_true(pc >= 0);
    mt_ckpt_piece_rec ra = *mt_ckpt_piece_at(ck, pa), rb = *mt_ckpt_piece_at(ck, pb),
                      rcs = *mt_ckpt_piece_at(ck, pc);
    mt_ckpt_close(ck);
    const char *windows[] = {"1", NULL, "3", "64"};
    report_log one, many;
    for (int w = 0; w < 4; w++) {
        assert_int_equal(verify_with(base, windows[w], &many), MT_OK);
        assert_int_equal(many.n, 0);
    }
    /* the damage */
    snprintf(dir, sizeof dir, "%s/../vpar_case", root);
    copy_tree(base, dir);
    char shard[32];
    int64_t cr;
    snprintf(shard, sizeof shard, "shard_%05d.h5", ra.rank);
    snprintf(file, sizeof file, "%s/%s", dir, shard);
    flip_byte(file, chunk_k_byte(file, ra.tensor, 2, &cr));
    flip_byte(file, chunk_k_byte(file, ra.tensor, 1, &cr));
    snprintf(file, sizeof file, "%s/shard_%05d.h5", dir, rcs.rank);
    flip_byte(file, chunk_k_byte(file, rcs.tensor, 0, &cr));
    edit_index_row(dir, "moetrain/pieces", sizeof(prow), pb, bad_hash, 1);
    assert_int_equal(verify_with(dir, "1", &one), MT_ECORRUPT);
    char first_one[1024];
    snprintf(first_one, sizeof first_one, "%s", mt_errmsg());
    assert_int_equal(one.n, 3);
    /* in piece order, each naming its file, tensor and what is wrong */
    char want[3][1200];
    int order[3] = {pa, pb, pc};
    for (int i = 0; i < 3; i++)
        for (int j = i + 1; j < 3; j++)
            if (order[j] < order[i]) {
                int t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
    for (int i = 0; i < 3; i++) {
        const mt_ckpt_piece_rec *r = order[i] == pa ? &ra : order[i] == pb ? &rb : &rcs;
        snprintf(shard, sizeof shard, "shard_%05d.h5", r->rank);
        int64_t rpc;
        snprintf(file, sizeof file, "%s/%s", base, shard);
        chunk_k_byte(file, r->tensor, 0, &rpc);
        if (order[i] == pa)
            snprintf(want[i], sizeof want[i], "%s | %s | %s/%s: tensor %s: chunk at row %lld fails its Fletcher32",
                     shard, r->tensor, dir, shard, r->tensor, (long long)rpc);
        else if (order[i] == pb)
            snprintf(want[i], sizeof want[i], "%s | %s | %s/%s: tensor %s: piece [", shard, r->tensor, dir,
                     shard, r->tensor);
        else
            snprintf(want[i], sizeof want[i], "%s | %s | %s/%s: tensor %s: chunk at row 0 fails its Fletcher32",
                     shard, r->tensor, dir, shard, r->tensor);
    }
    const char *line = one.text;
    for (int i = 0; i < 3; i++) {
        const char *nl = strchr(line, '\n');
        assert_non_null(nl);
        char got[4096];
        snprintf(got, sizeof got, "%.*s", (int)(nl - line), line);
        if (!strstr(got, want[i])) {
            fprintf(stderr, "report %d:\n  %s\nwants\n  %s\n", i, got, want[i]);
            fail();
        }
        if (order[i] == pb) assert_contains(got, "xxh64");
        line = nl + 1;
    }
    /* many in flight: the same lines, the same first problem */
    for (int w = 1; w < 4; w++) {
        assert_int_equal(verify_with(dir, windows[w], &many), MT_ECORRUPT);
        assert_string_equal(mt_errmsg(), first_one);
        assert_int_equal(many.n, one.n);
        assert_string_equal(many.text, one.text);
    }
}

/* The checks after the data (the shard files' objects, the index's virtual
 * mappings) run while the last chunks are read, and their problems still
 * come after the data's: an index whose mapping was damaged and the last
 * piece's first chunk flipped report the seal, then the piece, then the
 * virtual dataset, line for line the same with one chunk in flight as with
 * many. */
static void test_verify_late_checks_after_data(void **state)
{
    (void)state;
    char root[1200], base[1300], dir[1300], file[1400];
    snprintf(root, sizeof root, "%s/vlate", tmp);
    save_ckpt(root, "pp=2,dp=2", 9, 0);
    snprintf(base, sizeof base, "%s/step_00000009", root);
    mt_ckpt *ck;
    assert_int_equal(mt_ckpt_open(&ck, base), MT_OK);
    const mt_ckpt_piece_rec last = *mt_ckpt_piece_at(ck, mt_ckpt_n_pieces(ck) - 1);
    mt_ckpt_close(ck);
    snprintf(dir, sizeof dir, "%s/../vlate_case", root);
    copy_tree(base, dir);
    snprintf(file, sizeof file, "%s/index.h5", dir);
    assert_int_equal(mt_test_damage_index(file), 0);
    snprintf(file, sizeof file, "%s/shard_%05d.h5", dir, last.rank);
    int64_t cr;
    flip_byte(file, chunk_k_byte(file, last.tensor, 0, &cr));
    report_log one, many;
    assert_int_equal(verify_with(dir, "1", &one), MT_ECORRUPT);
    assert_int_equal(one.n, 3);
    const char *l1 = strchr(one.text, '\n'), *l2 = l1 ? strchr(l1 + 1, '\n') : NULL;
    assert_non_null(l2);
    char first[2048], second[2048];
    snprintf(first, sizeof first, "%.*s", (int)(l1 - one.text), one.text);
    snprintf(second, sizeof second, "%.*s", (int)(l2 - l1 - 1), l1 + 1);
    assert_contains(first, "index.h5");
    assert_contains(first, "seal");
    assert_contains(second, last.tensor);
    assert_contains(second, "Fletcher32");
    assert_contains(l2 + 1, "virtual dataset");
    assert_int_equal(verify_with(dir, "64", &many), MT_ECORRUPT);
    assert_string_equal(many.text, one.text);
}

/* Issue 21, defect 6: an index damaged after its commit, so that verify
 * fails, is refused by a load too (its seal: XXH64 of every byte), naming
 * index.h5; whatever the damage: a virtual dataset mapping (HDF5 does not
 * checksum it, a load never reads it), a table rewritten through HDF5
 * (valid Fletcher32), bytes appended, the seal itself. An index written
 * before seals (no user block) still loads. */
static void test_damaged_index_refused(void **state)
{
    (void)state;
    char root[1200], base[1300], dir[1300], file[1400], cmd[4200];
    snprintf(root, sizeof root, "%s/seal", tmp);
    save_ckpt(root, "tp=2", 6, 0);
    snprintf(base, sizeof base, "%s/step_00000006", root);
    snprintf(dir, sizeof dir, "%s/../seal_case", root);
    snprintf(file, sizeof file, "%s/index.h5", dir);
    mt_ckpt *ck;
    for (int kind = 0; kind < 4; kind++) {
        copy_tree(base, dir);
        if (kind == 0) assert_int_equal(mt_test_damage_index(file), 0);
        if (kind == 1) {
            int first;
            piece_of(dir, "model.embed_tokens.weight", &first);
            edit_index_row(dir, "moetrain/pieces", sizeof(prow), first + 1, bad_hash, 0);
        }
        if (kind == 2) {
            FILE *f = fopen(file, "ab");
            fputs("appended", f);
            fclose(f);
        }
        if (kind == 3) flip_byte(file, 30); /* inside the seal's text */
        reports r = {0, ""};
        assert_int_equal(mt_ckpt_verify(dir, collect, &r, NULL), MT_ECORRUPT);
        assert_contains(r.first, "index.h5");
        assert_int_equal(mt_ckpt_open(&ck, dir), MT_ECORRUPT);
        assert_contains(mt_errmsg(), "index.h5");
        assert_contains(mt_errmsg(), kind == 3 ? "checksum block" : "seal");
    }
    /* an index without a seal (as older builds wrote it) loads and verifies */
    copy_tree(base, dir);
    if (system("command -v h5unjam > /dev/null") != 0) skip();
    snprintf(cmd, sizeof cmd, "h5unjam -i '%s' -o '%s.plain' > /dev/null && mv '%s.plain' '%s'", file,
             file, file, file);
    assert_int_equal(system(cmd), 0);
    char why[256];
    assert_int_equal(ck_index_check(file, why, sizeof why), 1);
    assert_int_equal(mt_ckpt_open(&ck, dir), MT_OK);
    mt_ckpt_close(ck);
    assert_int_equal(mt_ckpt_verify(dir, NULL, NULL, NULL), MT_OK);
}

/* h5dump prints the whole embedding through the virtual dataset, whose
 * two TP pieces are in two shard files. */
static void test_h5dump_vds(void **state)
{
    (void)state;
    char root[1200], cmd[2048], out[1400];
    snprintf(root, sizeof root, "%s/dump", tmp);
    save_ckpt(root, "tp=2", 4, 0);
    const char *tn = "model.embed_tokens.weight"; /* [96, 256] bf16: rows 0-47 rank 0, 48-95 rank 1 */
    snprintf(out, sizeof out, "%s/dump.txt", tmp);
    snprintf(cmd, sizeof cmd, "cd / && h5dump -y -w 0 -m %%.9g -d /%s '%s/step_00000004/index.h5' > '%s'",
             tn, root, out);
    if (system("command -v h5dump > /dev/null") != 0) skip();
    assert_int_equal(system(cmd), 0);
    FILE *f = fopen(out, "r");
    assert_non_null(f);
    static char text[1 << 22];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    assert_contains(text, "96, 256");
    char *p = strstr(text, "DATA {");
    assert_non_null(p);
    p += 6;
    int64_t k = 0;
    while (k < 96 * 256) {
        char *end;
        double v = strtod(p, &end);
        if (end == p) {
            p++;
            assert_true(*p);
            continue;
        }
        p = end;
        uint16_t b;
        gen(tn, MT_DT_BF16, k, &b);
        if ((float)v != mt_bf16_to_f32(b)) {
            fprintf(stderr, "element %lld: h5dump %.9g, want %.9g\n", (long long)k, v,
                    (double)mt_bf16_to_f32(b));
            fail();
        }
        k++;
    }
    assert_int_equal(k, 96 * 256);
}

/* ---- commit protocol ------------------------------------------------------------- */

static int exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

static void test_commit_protocol(void **state)
{
    (void)state;
    char root[1200], p[1400], out[1400];
    snprintf(root, sizeof root, "%s/commit", tmp);
    save_ckpt(root, "tp=1", 10, 0);
    save_ckpt(root, "tp=1", 20, 0);
    /* latest names the newest */
    snprintf(p, sizeof p, "%s/latest", root);
    FILE *f = fopen(p, "r");
    char line[64] = "";
    assert_non_null(fgets(line, sizeof line, f));
    fclose(f);
    assert_string_equal(line, "step_00000020\n");
    /* a complete-looking partial directory (crash before the rename) is no checkpoint */
    char part[1400];
    snprintf(part, sizeof part, "%s/step_00000030.partial", root);
    snprintf(p, sizeof p, "cp -r '%s/step_00000020' '%s'", root, part);
    assert_int_equal(system(p), 0);
    assert_int_equal(mt_ckpt_resolve(root, out, sizeof out), MT_OK);
    snprintf(p, sizeof p, "%s/step_00000020", root);
    assert_string_equal(out, p);
    assert_int_equal(mt_ckpt_resolve(part, out, sizeof out), MT_EINVAL);
    assert_contains(mt_errmsg(), "partial");
    /* the next save removes it */
    save_ckpt(root, "tp=1", 40, 0);
    assert_false(exists(part));
    /* `latest` lagging (crash between rename and pointer): the scan wins */
    snprintf(p, sizeof p, "%s/latest", root);
    f = fopen(p, "w");
    fputs("step_00000010\n", f);
    fclose(f);
    assert_int_equal(mt_ckpt_resolve(root, out, sizeof out), MT_OK);
    assert_contains(out, "step_00000040");
    /* retention: keep 1, but never latest's target (10) nor one being read (20) */
    mt_ckpt *reader;
    snprintf(p, sizeof p, "%s/step_00000020", root);
    assert_int_equal(mt_ckpt_open(&reader, p), MT_OK);
    assert_int_equal(mt_ckpt_retain(root, 1), MT_OK);
    int64_t *steps;
    int n;
    assert_int_equal(mt_ckpt_list(root, &steps, &n), MT_OK);
    assert_int_equal(n, 3);
    assert_int_equal(steps[0], 10);
    assert_int_equal(steps[1], 20);
    assert_int_equal(steps[2], 40);
    free(steps);
    mt_ckpt_close(reader);
    /* once closed, and latest repointed, the old ones go; the newest stays */
    save_ckpt(root, "tp=1", 50, 1);
    assert_int_equal(mt_ckpt_list(root, &steps, &n), MT_OK);
    assert_int_equal(n, 1);
    assert_int_equal(steps[0], 50);
    free(steps);
    /* an empty root */
    snprintf(p, sizeof p, "%s/empty", tmp);
    assert_int_equal(mt_ckpt_resolve(p, out, sizeof out), MT_ENOTFOUND);
}

/* ---- small pieces --------------------------------------------------------------------- */

static void test_xxh64_vectors(void **state)
{
    (void)state;
    assert_true(mt_xxh64_oneshot("", 0, 0) == 0xEF46DB3751D8E999ULL);
    assert_true(mt_xxh64_oneshot("a", 1, 0) == 0xD24EC4F1A98C6E5BULL);
    assert_true(mt_xxh64_oneshot("abc", 3, 0) == 0x44BC2CF5AD770999ULL);
    /* streaming in uneven parts equals one shot */
    static uint8_t buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (uint8_t)(i * 7 + 3);
    mt_xxh64 h;
    mt_xxh64_init(&h, 0);
    size_t cuts[] = {0, 1, 31, 32, 33, 100, 999, 1000};
    for (int i = 0; i + 1 < 8; i++) mt_xxh64_update(&h, buf + cuts[i], cuts[i + 1] - cuts[i]);
    assert_true(mt_xxh64_digest(&h) == mt_xxh64_oneshot(buf, 1000, 0));
}

/* HDF5's Fletcher32 as H5checksum.c writes it: the reference loop. */
static uint32_t fletcher_ref(const uint8_t *d, size_t n)
{
    size_t len = n / 2;
    uint32_t s1 = 0, s2 = 0;
    while (len) {
        size_t t = len > 360 ? 360 : len;
        len -= t;
        do {
            s1 += (uint32_t)(((uint16_t)d[0]) << 8) | ((uint16_t)d[1]);
            d += 2;
            s2 += s1;
        } while (--t);
        s1 = (s1 & 0xffff) + (s1 >> 16);
        s2 = (s2 & 0xffff) + (s2 >> 16);
    }
    if (n % 2) {
        s1 += (uint32_t)(((uint16_t)*d) << 8);
        s2 += s1;
        s1 = (s1 & 0xffff) + (s1 >> 16);
        s2 = (s2 & 0xffff) + (s2 >> 16);
    }
    s1 = (s1 & 0xffff) + (s1 >> 16);
    s2 = (s2 & 0xffff) + (s2 >> 16);
    return (s2 << 16) | s1;
}

/* Our Fletcher32 equals HDF5's on random and all-0xff data of any length
 * (HDF5 also checks it on every read of a chunk we wrote). */
static void test_fletcher32_matches_hdf5(void **state)
{
    (void)state;
    static uint8_t buf[100003];
    mt_rng r;
    mt_rng_seed(&r, 5);
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)mt_rng_u64(&r);
    /* around the 16-word vector step and the 360-word block; odd addresses */
    const size_t lens[] = {0,   1,   2,   3,   30,  31,  32,   33,   34,     63,     64,
                           65,  719, 720, 721, 722, 751, 752, 4096, 100001, 100002};
    for (int off = 0; off < 2; off++) {
        for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++)
            assert_int_equal(ck_fletcher32(buf + off, lens[k]), fletcher_ref(buf + off, lens[k]));
    }
    memset(buf, 0xff, sizeof buf);
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++)
        assert_int_equal(ck_fletcher32(buf, lens[k]), fletcher_ref(buf, lens[k]));
}

static void test_safetensors_roundtrip(void **state)
{
    (void)state;
    char p[1400];
    snprintf(p, sizeof p, "%s/t.safetensors", tmp);
    mt_st_tensor e[3];
    memset(e, 0, sizeof e);
    snprintf(e[0].name, sizeof e[0].name, "a.weight");
    snprintf(e[0].dtype, sizeof e[0].dtype, "F8_E4M3");
    e[0].ndim = 2, e[0].shape[0] = 3, e[0].shape[1] = 5;
    snprintf(e[1].name, sizeof e[1].name, "a.weight_scale_inv");
    snprintf(e[1].dtype, sizeof e[1].dtype, "F32");
    e[1].ndim = 2, e[1].shape[0] = 1, e[1].shape[1] = 1;
    snprintf(e[2].name, sizeof e[2].name, "n.weight");
    snprintf(e[2].dtype, sizeof e[2].dtype, "BF16");
    e[2].ndim = 1, e[2].shape[0] = 7;
    mt_st_writer *w;
    assert_int_equal(mt_st_writer_open(&w, p, e, 3), MT_OK);
    uint8_t q[15];
    for (int i = 0; i < 15; i++) q[i] = (uint8_t)i;
    float s = 0.5f;
    uint16_t b[7] = {1, 2, 3, 4, 5, 6, 7};
    assert_int_equal(mt_st_writer_write(w, q, 15), MT_OK);
    assert_int_equal(mt_st_writer_write(w, &s, 4), MT_OK);
    assert_int_equal(mt_st_writer_write(w, b, 14), MT_OK);
    assert_int_equal(mt_st_writer_close(w), MT_OK);
    mt_st_file *f;
    assert_int_equal(mt_st_open(&f, p), MT_OK);
    assert_int_equal(f->n, 3);
    assert_int_equal(f->data_off % 8, 0);
    int k = mt_st_find(f, "n.weight");
    assert_true(k >= 0);
    assert_string_equal(f->t[k].dtype, "BF16");
    assert_memory_equal(f->map + f->data_off + f->t[k].begin, b, 14);
    mt_st_close(f);
    /* too little data: the writer refuses to finish */
    assert_int_equal(mt_st_writer_open(&w, p, e, 3), MT_OK);
    assert_int_equal(mt_st_writer_write(w, q, 15), MT_OK);
    assert_int_equal(mt_st_writer_close(w), MT_EINVAL);
    /* a truncated file is rejected naming the tensor */
    assert_int_equal(truncate(p, 40), 0);
    assert_true(mt_st_open(&f, p) < 0);
}

int main(void)
{
    mt_test_tmpdir(tmp, sizeof tmp, "ckpt_format");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xxh64_vectors),
        cmocka_unit_test(test_safetensors_roundtrip),
        cmocka_unit_test(test_fletcher32_matches_hdf5),
        cmocka_unit_test(test_save_load_exact),
        cmocka_unit_test(test_index_begun_refuses_other_pieces),
        cmocka_unit_test(test_conversions),
        cmocka_unit_test(test_flipped_byte),
        cmocka_unit_test(test_truncated_and_missing_shard),
        cmocka_unit_test(test_inconsistent_index),
        cmocka_unit_test(test_chunks_table),
        cmocka_unit_test(test_verify_parallel_equals_serial),
        cmocka_unit_test(test_verify_late_checks_after_data),
        cmocka_unit_test(test_damaged_index_refused),
        cmocka_unit_test(test_h5dump_vds),
        cmocka_unit_test(test_commit_protocol),
        cmocka_unit_test(test_direct_io),
        cmocka_unit_test(test_read_any_order),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (rc == 0) {
        char cmd[1100];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
        if (system(cmd) != 0) rc = 1;
    }
    return rc;
}
