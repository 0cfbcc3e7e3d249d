/* test_data_indexed.c - Megatron .bin/.idx: the writer's bytes are exactly the
 * format's, the reader round-trips them, accepts legal oddities (empty
 * documents, empty sequences) and rejects every kind of damage with a message
 * naming the problem. Expected bytes are assembled here from the format
 * description, independently of the writer. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <sys/stat.h>

#include "engine/data/data_indexed.h"
#include "base/mt_status.h"
#include "test_util.h"

static char tmp[512]; /* small enough that the rm/mkdir command in test_util.h fits */

/* ---- byte assembly ----------------------------------------------------------- */

typedef struct bytes {
    uint8_t *p;
    size_t n, cap;
} bytes;

static void put_u8(bytes *b, unsigned v)
{
    if (b->n == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 256;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    b->p[b->n++] = (uint8_t)v;
}

/* Little-endian by explicit shifts, so the expectation does not depend on the
 * host or on the writer's memcpy. */
static void put_le(bytes *b, uint64_t v, int width)
{
    for (int k = 0; k < width; k++) put_u8(b, (unsigned)((v >> (8 * k)) & 0xff));
}

static int item_size(int dtype)
{
    switch (dtype) {
    case 1: case 2: return 1;
    case 3: case 8: return 2;
    case 4: case 7: return 4;
    default: return 8;
    }
}

/* A version-1 .idx for sequences of lens[nseq] and document indices
 * docidx[ndoc1], pointers from the running sum of lengths. */
static bytes make_idx(int dtype, const int32_t *lens, int nseq, const int64_t *docidx, int ndoc1)
{
    bytes b = {0};
    const char magic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
    for (int k = 0; k < 9; k++) put_u8(&b, (unsigned char)magic[k]);
    put_le(&b, 1, 8);
    put_u8(&b, (unsigned)dtype);
    put_le(&b, (uint64_t)nseq, 8);
    put_le(&b, (uint64_t)ndoc1, 8);
    for (int i = 0; i < nseq; i++) put_le(&b, (uint64_t)(uint32_t)lens[i], 4);
    uint64_t ptr = 0;
    for (int i = 0; i < nseq; i++) {
        put_le(&b, ptr, 8);
        ptr += (uint64_t)lens[i] * (uint64_t)item_size(dtype);
    }
    for (int k = 0; k < ndoc1; k++) put_le(&b, (uint64_t)docidx[k], 8);
    return b;
}

static bytes make_bin(int dtype, const int64_t *tokens, int n)
{
    bytes b = {0};
    for (int k = 0; k < n; k++) put_le(&b, (uint64_t)tokens[k], item_size(dtype));
    return b;
}

static void write_bytes(const char *path, const uint8_t *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n) assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static uint8_t *read_bytes(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) fprintf(stderr, "cannot open %s\n", path);
    assert_non_null(f);
    size_t cap = 1 << 16;
    uint8_t *p = malloc(cap);
    *n = fread(p, 1, cap, f);
    fclose(f);
    return p;
}

static void write_pair(const char *prefix, const bytes *idx, const bytes *bin)
{
    char path[1200];
    snprintf(path, sizeof path, "%s.idx", prefix);
    write_bytes(path, idx->p, idx->n);
    snprintf(path, sizeof path, "%s.bin", prefix);
    write_bytes(path, bin->p, bin->n);
}

static void prefix_of(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", tmp, name);
}

/* ---- fixtures ------------------------------------------------------------------ */

static int setup(void **state)
{
    (void)state;
    mt_test_tmpdir(tmp, sizeof tmp, "test_data_indexed");
    return 0;
}

/* Four documents, the third empty (a zero-sequence document, as Megatron's
 * preprocess writes for an empty text). */
static const int32_t doc0[] = {5, 6, 7, 256};
static const int32_t doc1[] = {256};
static const int32_t doc3[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 256};

static void write_sample_docs(const char *prefix, int dtype, const int32_t *big, int nbig)
{
    mt_indexed_writer *w = NULL;
    assert_int_equal(mt_indexed_writer_create(prefix, dtype, &w), MT_OK);
    assert_int_equal(mt_indexed_writer_add_document(w, doc0, 4), MT_OK);
    assert_int_equal(mt_indexed_writer_add_document(w, doc1, 1), MT_OK);
    assert_int_equal(mt_indexed_writer_add_document(w, NULL, 0), MT_OK);
    assert_int_equal(mt_indexed_writer_add_document(w, doc3, 11), MT_OK);
    if (big) assert_int_equal(mt_indexed_writer_add_document(w, big, nbig), MT_OK);
    assert_int_equal(mt_indexed_writer_num_documents(w), big ? 5 : 4);
    assert_int_equal(mt_indexed_writer_num_tokens(w), 16 + (big ? nbig : 0));
    assert_int_equal(mt_indexed_writer_finish(w), MT_OK);
    mt_indexed_writer_free(w);
}

static void check_doc(const mt_indexed *ds, int64_t d, const int32_t *want, int64_t n)
{
    int64_t t0 = -1, cnt = -1;
    assert_int_equal(mt_indexed_document_span(ds, d, &t0, &cnt), MT_OK);
    assert_int_equal(cnt, n);
    int32_t got[64];
    assert_int_equal(mt_indexed_read(ds, t0, cnt, got), MT_OK);
    for (int64_t k = 0; k < n; k++) assert_int_equal(got[k], want[k]);
}

/* ---- round trips ------------------------------------------------------------------ */

static void roundtrip(int dtype, const int32_t *big, int nbig)
{
    char prefix[1100];
    prefix_of(prefix, sizeof prefix, dtype == MT_IDX_UINT16 ? "rt16" : "rt32");
    write_sample_docs(prefix, dtype, big, nbig);
    mt_indexed *ds = NULL;
    assert_int_equal(mt_indexed_open(prefix, &ds), MT_OK);
    int ndocs = big ? 5 : 4;
    assert_int_equal(mt_indexed_dtype(ds), dtype);
    assert_int_equal(mt_indexed_num_documents(ds), ndocs);
    assert_int_equal(mt_indexed_num_sequences(ds), ndocs - 1); /* the empty one has none */
    assert_int_equal(mt_indexed_num_tokens(ds), 16 + (big ? nbig : 0));
    check_doc(ds, 0, doc0, 4);
    check_doc(ds, 1, doc1, 1);
    check_doc(ds, 2, NULL, 0);
    check_doc(ds, 3, doc3, 11);
    if (big) check_doc(ds, 4, big, nbig);
    int64_t s0 = -1, s1 = -1;
    assert_int_equal(mt_indexed_document_range(ds, 2, &s0, &s1), MT_OK);
    assert_int_equal(s0, 2);
    assert_int_equal(s1, 2);
    assert_int_equal(mt_indexed_sequence_length(ds, 2), 11);
    int32_t buf[32];
    int64_t n = -1;
    assert_int_equal(mt_indexed_read_sequences(ds, 0, 3, buf, 32, &n), MT_OK);
    assert_int_equal(n, 16);
    assert_int_equal(buf[4], 256);
    assert_int_equal(buf[15], 256);
    assert_true(mt_indexed_read_sequences(ds, 0, 3, buf, 8, &n) < 0);
    assert_true(mt_indexed_document_range(ds, ndocs, &s0, &s1) < 0);
    assert_true(mt_indexed_read(ds, 10, 100, buf) < 0);
    mt_indexed_close(ds);
}

/* Writer then reader returns the same documents, uint16. */
static void test_roundtrip_uint16(void **state)
{
    (void)state;
    roundtrip(MT_IDX_UINT16, NULL, 0);
}

/* Same for int32, with token ids beyond uint16. */
static void test_roundtrip_int32(void **state)
{
    (void)state;
    const int32_t big[] = {65535, 65536, 129279, 2000000000, 0};
    roundtrip(MT_IDX_INT32, big, 5);
}

/* The writer's files are exactly the format's bytes: header, int32 lengths,
 * int64 byte pointers, int64 document indices [0, ...]; tokens back to back. */
static void check_megatron_bytes(int dtype, const char *name)
{
    char prefix[1100], path[1200];
    prefix_of(prefix, sizeof prefix, name);
    write_sample_docs(prefix, dtype, NULL, 0);
    /* Sequences: doc0 (4), doc1 (1), doc3 (11); document indices 0,1,2,2,3. */
    const int32_t lens[] = {4, 1, 11};
    const int64_t docidx[] = {0, 1, 2, 2, 3};
    const int64_t toks[] = {5, 6, 7, 256, 256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 256};
    bytes want_idx = make_idx(dtype, lens, 3, docidx, 5);
    bytes want_bin = make_bin(dtype, toks, 16);
    assert_int_equal(want_idx.n, 34 + 3 * 4 + 3 * 8 + 5 * 8);
    size_t n;
    snprintf(path, sizeof path, "%s.idx", prefix);
    uint8_t *got = read_bytes(path, &n);
    assert_int_equal(n, want_idx.n);
    assert_memory_equal(got, want_idx.p, n);
    free(got);
    snprintf(path, sizeof path, "%s.bin", prefix);
    got = read_bytes(path, &n);
    assert_int_equal(n, want_bin.n);
    assert_memory_equal(got, want_bin.p, n);
    free(got);
    /* Spot-check a few absolute bytes against the spec, in case make_idx
     * shared a mistake with the writer: the dtype code at byte 17, the
     * second pointer (4 tokens in) at byte 34 + 12 + 8. */
    assert_int_equal(want_idx.p[17], dtype);
    assert_int_equal(want_idx.p[34 + 12 + 8], 4 * item_size(dtype));
    free(want_idx.p);
    free(want_bin.p);
    /* Committed by rename: no temporary files remain. */
    struct stat st;
    snprintf(path, sizeof path, "%s.idx.tmp", prefix);
    assert_int_not_equal(stat(path, &st), 0);
    snprintf(path, sizeof path, "%s.bin.tmp", prefix);
    assert_int_not_equal(stat(path, &st), 0);
}

static void test_megatron_bytes_uint16(void **state)
{
    (void)state;
    check_megatron_bytes(MT_IDX_UINT16, "bytes16");
}

static void test_megatron_bytes_int32(void **state)
{
    (void)state;
    check_megatron_bytes(MT_IDX_INT32, "bytes32");
}

/* Megatron's dtype rule: uint16 below 65500 entries, else int32. */
static void test_dtype_for_vocab(void **state)
{
    (void)state;
    assert_int_equal(mt_idx_dtype_for_vocab(257), MT_IDX_UINT16);
    assert_int_equal(mt_idx_dtype_for_vocab(65499), MT_IDX_UINT16);
    assert_int_equal(mt_idx_dtype_for_vocab(65500), MT_IDX_INT32);
    assert_int_equal(mt_idx_dtype_for_vocab(129280), MT_IDX_INT32);
    assert_string_equal(mt_idx_dtype_name(MT_IDX_UINT16), "uint16");
    assert_int_equal(mt_idx_dtype_size(MT_IDX_INT64), 8);
    assert_int_equal(mt_idx_dtype_size(9), 0);
}

/* ---- hand-made files ---------------------------------------------------------- */

/* Empty documents of both kinds (no sequence; one zero-length sequence) and a
 * trailing empty document read back as empty, for uint16 and int32. */
static void check_handmade_empty(int dtype, const char *name)
{
    char prefix[1100];
    prefix_of(prefix, sizeof prefix, name);
    /* doc0: seq {9, 8}; doc1: no sequence; doc2: seq {} ; doc3: seqs {7}, {6, 5};
     * doc4: no sequence. */
    const int32_t lens[] = {2, 0, 1, 2};
    const int64_t docidx[] = {0, 1, 1, 2, 4, 4};
    const int64_t toks[] = {9, 8, 7, 6, 5};
    bytes idx = make_idx(dtype, lens, 4, docidx, 6);
    bytes bin = make_bin(dtype, toks, 5);
    write_pair(prefix, &idx, &bin);
    free(idx.p);
    free(bin.p);
    mt_indexed *ds = NULL;
    assert_int_equal(mt_indexed_open(prefix, &ds), MT_OK);
    assert_int_equal(mt_indexed_num_documents(ds), 5);
    assert_int_equal(mt_indexed_num_sequences(ds), 4);
    assert_int_equal(mt_indexed_num_tokens(ds), 5);
    const int32_t d0[] = {9, 8}, d3[] = {7, 6, 5};
    check_doc(ds, 0, d0, 2);
    check_doc(ds, 1, NULL, 0);
    check_doc(ds, 2, NULL, 0);
    check_doc(ds, 3, d3, 3);
    check_doc(ds, 4, NULL, 0);
    assert_int_equal(mt_indexed_sequence_length(ds, 1), 0);
    assert_int_equal(mt_indexed_sequence_offset(ds, 3), 3);
    assert_int_equal(mt_indexed_sequence_offset(ds, 4), 5);
    mt_indexed_close(ds);
}

static void test_handmade_empty_uint16(void **state)
{
    (void)state;
    check_handmade_empty(MT_IDX_UINT16, "empty16");
}

static void test_handmade_empty_int32(void **state)
{
    (void)state;
    check_handmade_empty(MT_IDX_INT32, "empty32");
}

/* A dataset with no documents at all is legal and empty. */
static void test_handmade_no_documents(void **state)
{
    (void)state;
    char prefix[1100];
    prefix_of(prefix, sizeof prefix, "nodocs");
    const int64_t docidx[] = {0};
    bytes idx = make_idx(MT_IDX_UINT16, NULL, 0, docidx, 1);
    bytes bin = {0};
    write_pair(prefix, &idx, &bin);
    free(idx.p);
    mt_indexed *ds = NULL;
    assert_int_equal(mt_indexed_open(prefix, &ds), MT_OK);
    assert_int_equal(mt_indexed_num_documents(ds), 0);
    assert_int_equal(mt_indexed_num_tokens(ds), 0);
    mt_indexed_close(ds);
}

/* ---- damaged files --------------------------------------------------------------- */

/* A valid uint16 pair to damage: two documents {1,2,3}, {4,5}. */
static void good_pair(bytes *idx, bytes *bin)
{
    const int32_t lens[] = {3, 2};
    const int64_t docidx[] = {0, 1, 2};
    const int64_t toks[] = {1, 2, 3, 4, 5};
    *idx = make_idx(MT_IDX_UINT16, lens, 2, docidx, 3);
    *bin = make_bin(MT_IDX_UINT16, toks, 5);
}

/* Opens prefix, expects failure code `code` and `needle` in the message. */
static void expect_open_error(const char *prefix, int code, const char *needle)
{
    mt_indexed *ds = (mt_indexed *)1;
    mt_err_clear();
    int rc = mt_indexed_open(prefix, &ds);
    if (rc != code) fprintf(stderr, "rc %d (%s): %s\n", rc, mt_strstatus(rc), mt_errmsg());
    assert_int_equal(rc, code);
    assert_null(ds);
    assert_contains(mt_errmsg(), needle);
    assert_contains(mt_errmsg(), prefix); /* the message names the file */
}

static void damaged(const char *name, bytes *idx, bytes *bin, int code, const char *needle)
{
    char prefix[1100];
    prefix_of(prefix, sizeof prefix, name);
    write_pair(prefix, idx, bin);
    expect_open_error(prefix, code, needle);
    free(idx->p);
    free(bin->p);
}

static void test_error_missing_files(void **state)
{
    (void)state;
    char prefix[1100], path[1200];
    prefix_of(prefix, sizeof prefix, "missing");
    expect_open_error(prefix, MT_ENOTFOUND, "missing.idx");
    /* .idx present, .bin missing */
    bytes idx, bin;
    good_pair(&idx, &bin);
    snprintf(path, sizeof path, "%s.idx", prefix);
    write_bytes(path, idx.p, idx.n);
    expect_open_error(prefix, MT_ENOTFOUND, "missing.bin");
    free(idx.p);
    free(bin.p);
}

static void test_error_wrong_magic(void **state)
{
    (void)state;
    bytes idx, bin;
    good_pair(&idx, &bin);
    idx.p[0] = 'X';
    damaged("magic", &idx, &bin, MT_ECORRUPT, "wrong magic");
}

static void test_error_truncated_idx(void **state)
{
    (void)state;
    bytes idx, bin;
    good_pair(&idx, &bin);
    idx.n -= 5; /* cut into the document indices */
    damaged("trunc_idx", &idx, &bin, MT_ECORRUPT, "truncated .idx");
    good_pair(&idx, &bin);
    idx.n = 20; /* cut inside the header */
    damaged("trunc_hdr", &idx, &bin, MT_ECORRUPT, "truncated .idx");
}

static void test_error_bad_version(void **state)
{
    (void)state;
    bytes idx, bin;
    good_pair(&idx, &bin);
    idx.p[9] = 2;
    damaged("version", &idx, &bin, MT_ECORRUPT, "unsupported version 2");
}

static void test_error_unknown_dtype(void **state)
{
    (void)state;
    bytes idx, bin;
    good_pair(&idx, &bin);
    idx.p[17] = 9;
    damaged("dtype", &idx, &bin, MT_ECORRUPT, "unknown dtype code 9");
}

static void test_error_truncated_bin(void **state)
{
    (void)state;
    bytes idx, bin;
    good_pair(&idx, &bin);
    bin.n -= 1;
    damaged("trunc_bin", &idx, &bin, MT_ECORRUPT, "truncated .bin");
}

static void test_error_bin_too_long(void **state)
{
    (void)state;
    bytes idx, bin;
    good_pair(&idx, &bin);
    put_le(&bin, 7, 2);
    damaged("long_bin", &idx, &bin, MT_ECORRUPT, "do not match");
}

static void test_error_pointers(void **state)
{
    (void)state;
    bytes idx, bin;
    good_pair(&idx, &bin);
    idx.p[34 + 2 * 4 + 8] = 4; /* second pointer 4 instead of 6 */
    damaged("pointers", &idx, &bin, MT_ECORRUPT, "pointers inconsistent with lengths");
}

static void test_error_negative_length(void **state)
{
    (void)state;
    bytes idx, bin;
    good_pair(&idx, &bin);
    idx.p[34 + 3] = 0xff; /* length 0xff000003 < 0 */
    damaged("neglen", &idx, &bin, MT_ECORRUPT, "negative length");
}

static void test_error_document_indices(void **state)
{
    (void)state;
    const int32_t lens[] = {3, 2};
    const int64_t toks[] = {1, 2, 3, 4, 5};
    const int64_t not_monotone[] = {0, 2, 1, 2};
    bytes idx = make_idx(MT_IDX_UINT16, lens, 2, not_monotone, 4);
    bytes bin = make_bin(MT_IDX_UINT16, toks, 5);
    damaged("docs_order", &idx, &bin, MT_ECORRUPT, "not monotone");
    const int64_t beyond[] = {0, 3, 2};
    idx = make_idx(MT_IDX_UINT16, lens, 2, beyond, 3);
    bin = make_bin(MT_IDX_UINT16, toks, 5);
    damaged("docs_range", &idx, &bin, MT_ECORRUPT, "out of range");
    const int64_t short_end[] = {0, 1};
    idx = make_idx(MT_IDX_UINT16, lens, 2, short_end, 2);
    bin = make_bin(MT_IDX_UINT16, toks, 5);
    damaged("docs_end", &idx, &bin, MT_ECORRUPT, "last document index is 1");
    const int64_t bad_first[] = {1, 2};
    idx = make_idx(MT_IDX_UINT16, lens, 2, bad_first, 2);
    bin = make_bin(MT_IDX_UINT16, toks, 5);
    damaged("docs_first", &idx, &bin, MT_ECORRUPT, "document index 0 is 1");
}

/* Float dtypes open (the format allows them) but are refused as tokens. */
static void test_float_dtype_not_tokens(void **state)
{
    (void)state;
    char prefix[1100];
    prefix_of(prefix, sizeof prefix, "float");
    const int32_t lens[] = {2};
    const int64_t docidx[] = {0, 1};
    const int64_t toks[] = {0x3f800000, 0x40000000}; /* 1.0f, 2.0f */
    bytes idx = make_idx(MT_IDX_FLOAT32, lens, 1, docidx, 2);
    bytes bin = make_bin(MT_IDX_FLOAT32, toks, 2);
    write_pair(prefix, &idx, &bin);
    free(idx.p);
    free(bin.p);
    mt_indexed *ds = NULL;
    assert_int_equal(mt_indexed_open(prefix, &ds), MT_OK);
    int32_t out[2];
    assert_int_equal(mt_indexed_read(ds, 0, 2, out), MT_ENOTSUP);
    assert_contains(mt_errmsg(), "float32");
    assert_contains(mt_errmsg(), "no token ids");
    mt_indexed_close(ds);
}

/* Negative values in a signed dtype are not token ids. */
static void test_negative_token_rejected(void **state)
{
    (void)state;
    char prefix[1100];
    prefix_of(prefix, sizeof prefix, "negtok");
    const int32_t lens[] = {3};
    const int64_t docidx[] = {0, 1};
    const int64_t toks[] = {1, -4, 2};
    bytes idx = make_idx(MT_IDX_INT16, lens, 1, docidx, 2);
    bytes bin = make_bin(MT_IDX_INT16, toks, 3);
    write_pair(prefix, &idx, &bin);
    free(idx.p);
    free(bin.p);
    mt_indexed *ds = NULL;
    assert_int_equal(mt_indexed_open(prefix, &ds), MT_OK);
    int32_t out[3];
    assert_int_equal(mt_indexed_read(ds, 0, 1, out), MT_OK);
    assert_int_equal(out[0], 1);
    assert_int_equal(mt_indexed_read(ds, 0, 3, out), MT_ECORRUPT);
    assert_contains(mt_errmsg(), "token 1 is -4");
    mt_indexed_close(ds);
}

/* The writer refuses tokens its dtype cannot hold and float dtypes; an
 * unfinished writer leaves no files behind. */
static void test_writer_errors(void **state)
{
    (void)state;
    char prefix[1100], path[1200];
    prefix_of(prefix, sizeof prefix, "wr_err");
    mt_indexed_writer *w = NULL;
    assert_int_equal(mt_indexed_writer_create(prefix, MT_IDX_FLOAT32, &w), MT_ENOTSUP);
    assert_null(w);
    assert_int_equal(mt_indexed_writer_create(prefix, 11, &w), MT_EINVAL);
    assert_int_equal(mt_indexed_writer_create(prefix, MT_IDX_UINT16, &w), MT_OK);
    const int32_t toks[] = {1, 70000};
    assert_int_equal(mt_indexed_writer_add_document(w, toks, 2), MT_EINVAL);
    assert_contains(mt_errmsg(), "70000");
    const int32_t neg[] = {-1};
    assert_int_equal(mt_indexed_writer_add_document(w, neg, 1), MT_EINVAL);
    assert_int_equal(mt_indexed_writer_add_document(w, toks, 1), MT_OK);
    snprintf(path, sizeof path, "%s.bin.tmp", prefix);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    mt_indexed_writer_free(w); /* abandoned */
    assert_int_not_equal(stat(path, &st), 0);
    snprintf(path, sizeof path, "%s.bin", prefix);
    assert_int_not_equal(stat(path, &st), 0);
    snprintf(path, sizeof path, "%s.idx", prefix);
    assert_int_not_equal(stat(path, &st), 0);
}

/* Multimodal files append one mode byte per sequence; they still open. Any
 * other trailing garbage does not. */
static void test_idx_trailing_bytes(void **state)
{
    (void)state;
    bytes idx, bin;
    good_pair(&idx, &bin);
    put_u8(&idx, 0);
    put_u8(&idx, 0);
    char prefix[1100];
    prefix_of(prefix, sizeof prefix, "modes");
    write_pair(prefix, &idx, &bin);
    mt_indexed *ds = NULL;
    assert_int_equal(mt_indexed_open(prefix, &ds), MT_OK);
    mt_indexed_close(ds);
    put_u8(&idx, 0);
    damaged("trailing", &idx, &bin, MT_ECORRUPT, "expected 82");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_uint16),
        cmocka_unit_test(test_roundtrip_int32),
        cmocka_unit_test(test_megatron_bytes_uint16),
        cmocka_unit_test(test_megatron_bytes_int32),
        cmocka_unit_test(test_dtype_for_vocab),
        cmocka_unit_test(test_handmade_empty_uint16),
        cmocka_unit_test(test_handmade_empty_int32),
        cmocka_unit_test(test_handmade_no_documents),
        cmocka_unit_test(test_error_missing_files),
        cmocka_unit_test(test_error_wrong_magic),
        cmocka_unit_test(test_error_truncated_idx),
        cmocka_unit_test(test_error_bad_version),
        cmocka_unit_test(test_error_unknown_dtype),
        cmocka_unit_test(test_error_truncated_bin),
        cmocka_unit_test(test_error_bin_too_long),
        cmocka_unit_test(test_error_pointers),
        cmocka_unit_test(test_error_negative_length),
        cmocka_unit_test(test_error_document_indices),
        cmocka_unit_test(test_float_dtype_not_tokens),
        cmocka_unit_test(test_negative_token_rejected),
        cmocka_unit_test(test_writer_errors),
        cmocka_unit_test(test_idx_trailing_bytes),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
