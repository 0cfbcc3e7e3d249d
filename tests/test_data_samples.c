/* test_data_samples.c - GPT sample builder: windows are the documented slices
 * of the documented stream (checked against a stream rebuilt here from the
 * document contents), EOD rules, Megatron split ratios, epochs, determinism
 * and resume. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/data/data_indexed.h"
#include "engine/data/data_samples.h"
#include "base/mt_status.h"
#include "test_util.h"

static char tmp[512]; /* small enough that the rm/mkdir command in test_util.h fits */
static char prefix[600];

enum { NDOCS = 40, EOD = 1 };

/* Document d: (7d mod 13) tokens, 1000(d+1) + t, so every token names its
 * document; docs with d % 5 == 0 and two or more tokens already end with EOD;
 * d % 13 == 0 is empty. */
static int64_t doc_len(int64_t d) { return (7 * d) % 13; }

static int32_t doc_tok(int64_t d, int64_t t)
{
    if (d % 5 == 0 && doc_len(d) >= 2 && t == doc_len(d) - 1) return EOD;
    return (int32_t)(1000 * (d + 1) + t);
}

static int setup(void **state)
{
    (void)state;
    mt_test_tmpdir(tmp, sizeof tmp, "test_data_samples");
    snprintf(prefix, sizeof prefix, "%s/docs", tmp);
    mt_indexed_writer *w = NULL;
    if (mt_indexed_writer_create(prefix, MT_IDX_INT32, &w) != MT_OK) return -1;
    for (int64_t d = 0; d < NDOCS; d++) {
        int32_t buf[16];
        for (int64_t t = 0; t < doc_len(d); t++) buf[t] = doc_tok(d, t);
        if (mt_indexed_writer_add_document(w, buf, doc_len(d)) != MT_OK) return -1;
    }
    int rc = mt_indexed_writer_finish(w);
    mt_indexed_writer_free(w);
    return rc;
}

static mt_indexed *open_ds(void)
{
    mt_indexed *ds = NULL;
    if (mt_indexed_open(prefix, &ds) != MT_OK) fprintf(stderr, "%s\n", mt_errmsg());
    assert_non_null(ds);
    return ds;
}

static mt_samples *open_samples(const mt_indexed *ds, const char *ratios, int split,
                                int64_t seq_len, int64_t num, uint64_t seed)
{
    mt_samples_config cfg = {ratios, split, seq_len, num, EOD, seed};
    mt_samples *s = NULL;
    int rc = mt_samples_open(ds, &cfg, &s);
    if (rc != MT_OK) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
    return s;
}

/* The stream of all epochs, rebuilt from the document contents and the
 * builder's per-epoch orders: doc tokens, then EOD unless empty or already
 * ending with EOD. Returns its length; *out is malloc'd. */
static int64_t expected_stream(const mt_samples *s, int32_t **out)
{
    int64_t d0, d1;
    mt_samples_documents(s, &d0, &d1);
    int64_t cap = mt_samples_epochs(s) * (d1 - d0) * 14 + 1, n = 0;
    int32_t *st = malloc((size_t)cap * sizeof *st);
    assert_non_null(st);
    for (int64_t e = 0; e < mt_samples_epochs(s); e++) {
        for (int64_t k = 0; k < d1 - d0; k++) {
            int64_t d = mt_samples_epoch_document(s, e, k);
            for (int64_t t = 0; t < doc_len(d); t++) st[n++] = doc_tok(d, t);
            if (doc_len(d) > 0 && doc_tok(d, doc_len(d) - 1) != EOD) st[n++] = EOD;
        }
    }
    *out = st;
    return n;
}

/* Every window equals stream[j*L .. j*L + L]. */
static void check_windows_against_stream(const mt_samples *s)
{
    int32_t *st;
    int64_t n = expected_stream(s, &st), L = mt_samples_seq_len(s);
    assert_int_equal(n, mt_samples_epochs(s) * mt_samples_epoch_tokens(s));
    int32_t win[64];
    for (int64_t j = 0; j < mt_samples_count(s); j++) {
        assert_int_equal(mt_samples_window(s, j, win), MT_OK);
        assert_true(j * L + L < n);
        for (int64_t k = 0; k <= L; k++) assert_int_equal(win[k], st[j * L + k]);
    }
    free(st);
}

/* Megatron's split rule: normalised weights, round half to even, the excess
 * removed from every boundary. */
static void test_split_bounds(void **state)
{
    (void)state;
    int64_t b[4];
    assert_int_equal(mt_split_bounds("98,1,1", 100, b), MT_OK);
    assert_int_equal(b[1], 98);
    assert_int_equal(b[2], 99);
    assert_int_equal(b[3], 100);
    assert_int_equal(mt_split_bounds("1", 10, b), MT_OK);
    assert_int_equal(b[1], 10);
    assert_int_equal(b[2], 10);
    /* thirds of 10: 3,3,3 -> 9, one short, so every boundary moves up one */
    assert_int_equal(mt_split_bounds("1/1/1", 10, b), MT_OK);
    assert_int_equal(b[1], 4);
    assert_int_equal(b[2], 7);
    assert_int_equal(b[3], 10);
    /* halves of 5: round(2.5) = 2 (half to even), 2 + 2 = 4 -> 3, 5 */
    assert_int_equal(mt_split_bounds("1,1", 5, b), MT_OK);
    assert_int_equal(b[1], 3);
    assert_int_equal(b[2], 5);
    /* halves of 7: round(3.5) = 4 twice, 8 -> 3, 7 */
    assert_int_equal(mt_split_bounds("1,1", 7, b), MT_OK);
    assert_int_equal(b[1], 3);
    assert_int_equal(b[2], 7);
    /* Megatron's rule can push a boundary below 0; it is clamped */
    assert_int_equal(mt_split_bounds("0,1,1", 3, b), MT_OK);
    assert_int_equal(b[1], 0);
    assert_true(b[2] >= b[1] && b[3] == 3);
    assert_int_equal(mt_split_bounds("70,20,10", NDOCS, b), MT_OK);
    assert_int_equal(b[1], 28);
    assert_int_equal(b[2], 36);
    const char *bad[] = {"", "a", "1,,1", "-1,1", "1,2,3,4", "0,0,0", "1;1", "inf"};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        mt_err_clear();
        assert_int_equal(mt_split_bounds(bad[k], 10, b), MT_EINVAL);
        assert_contains(mt_errmsg(), "split");
    }
}

/* One epoch: consecutive windows share exactly one token, and the windows
 * are the stream rebuilt independently from the documents. */
static void test_windows_overlap_by_one(void **state)
{
    (void)state;
    mt_indexed *ds = open_ds();
    mt_samples *s = open_samples(ds, "1", MT_SPLIT_TRAIN, 7, 0, 11);
    assert_int_equal(mt_samples_epochs(s), 1);
    int64_t T = mt_samples_epoch_tokens(s);
    assert_int_equal(mt_samples_count(s), (T - 1) / 7);
    int32_t a[8], b[8];
    for (int64_t j = 0; j + 1 < mt_samples_count(s); j++) {
        assert_int_equal(mt_samples_window(s, j, a), MT_OK);
        assert_int_equal(mt_samples_window(s, j + 1, b), MT_OK);
        assert_int_equal(a[7], b[0]);
    }
    check_windows_against_stream(s);
    assert_true(mt_samples_window(s, mt_samples_count(s), a) < 0);
    mt_samples_close(s);
    mt_indexed_close(ds);
}

/* With enough samples for more than an epoch, every token of every split
 * document appears in the first epoch's windows exactly once, and nothing
 * from outside the split does. */
static void test_every_token_appears(void **state)
{
    (void)state;
    mt_indexed *ds = open_ds();
    mt_samples *one = open_samples(ds, "1", MT_SPLIT_TRAIN, 5, 0, 3);
    int64_t n1 = mt_samples_count(one);
    mt_samples_close(one);
    mt_samples *s = open_samples(ds, "1", MT_SPLIT_TRAIN, 5, n1 + 1, 3);
    assert_int_equal(mt_samples_epochs(s), 2);
    int64_t T = mt_samples_epoch_tokens(s);
    int seen[NDOCS][16] = {{0}};
    int32_t w[6];
    for (int64_t j = 0; j < mt_samples_count(s); j++) {
        assert_int_equal(mt_samples_window(s, j, w), MT_OK);
        for (int k = (j == 0 ? 0 : 1); k <= 5; k++) {
            if (j * 5 + k >= T) break; /* first epoch only */
            if (w[k] == EOD) continue;
            int d = w[k] / 1000 - 1, t = w[k] % 1000;
            assert_true(d >= 0 && d < NDOCS && t < doc_len(d));
            seen[d][t]++;
        }
    }
    for (int d = 0; d < NDOCS; d++)
        for (int t = 0; t < doc_len(d); t++)
            if (doc_tok(d, t) != EOD) assert_int_equal(seen[d][t], 1);
    mt_samples_close(s);
    mt_indexed_close(ds);
}

/* EOD: one per non-empty document, none added after a document that ends
 * with EOD (so never two in a row), none for empty documents. */
static void test_eod_handling(void **state)
{
    (void)state;
    mt_indexed *ds = open_ds();
    mt_samples *s = open_samples(ds, "1", MT_SPLIT_TRAIN, 4, 0, 5);
    int64_t want_T = 0, nonempty = 0;
    for (int64_t d = 0; d < NDOCS; d++) {
        want_T += doc_len(d);
        if (doc_len(d) > 0) {
            nonempty++;
            if (doc_tok(d, doc_len(d) - 1) != EOD) want_T++;
        }
    }
    assert_int_equal(mt_samples_epoch_tokens(s), want_T);
    int64_t T = want_T, eods = 0, pos = 0;
    int32_t w[5], prev = -1;
    for (int64_t j = 0; j < mt_samples_count(s); j++) {
        assert_int_equal(mt_samples_window(s, j, w), MT_OK);
        for (int k = (j == 0 ? 0 : 1); k <= 4; k++, pos++) {
            if (w[k] == EOD) {
                eods++;
                assert_int_not_equal(prev, EOD);
            } else if (prev != -1 && prev != EOD) {
                /* inside a document tokens are consecutive */
                assert_int_equal(w[k], prev + 1);
            }
            prev = w[k];
        }
    }
    /* the windows cover all but the last < seq_len tokens of the epoch */
    assert_true(T - pos < 4);
    assert_true(eods <= nonempty && eods >= nonempty - (T - pos));
    mt_samples_close(s);
    mt_indexed_close(ds);
}

/* Same seed, same samples; another seed, other samples and document order. */
static void test_determinism(void **state)
{
    (void)state;
    mt_indexed *ds = open_ds();
    mt_samples *a = open_samples(ds, "1", MT_SPLIT_TRAIN, 6, 100, 42);
    mt_samples *b = open_samples(ds, "1", MT_SPLIT_TRAIN, 6, 100, 42);
    mt_samples *c = open_samples(ds, "1", MT_SPLIT_TRAIN, 6, 100, 43);
    int32_t x[7], y[7], z[7];
    int differ = 0;
    for (int64_t i = 0; i < 100; i++) {
        assert_int_equal(mt_samples_get(a, i, x), MT_OK);
        assert_int_equal(mt_samples_get(b, i, y), MT_OK);
        assert_int_equal(mt_samples_get(c, i, z), MT_OK);
        assert_memory_equal(x, y, sizeof x);
        if (memcmp(x, z, sizeof x) != 0) differ++;
    }
    assert_true(differ > 50);
    int order_differs = 0;
    for (int64_t k = 0; k < NDOCS; k++)
        if (mt_samples_epoch_document(a, 0, k) != mt_samples_epoch_document(c, 0, k))
            order_differs = 1;
    assert_true(order_differs);
    mt_samples_close(a);
    mt_samples_close(b);
    mt_samples_close(c);
    mt_indexed_close(ds);
}

/* The sample order is a shuffled bijection onto the windows. */
static void test_shuffle_is_permutation(void **state)
{
    (void)state;
    mt_indexed *ds = open_ds();
    const int64_t counts[] = {1, 2, 3, 17, 64, 100, 333};
    for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
        int64_t n = counts[c];
        mt_samples *s = open_samples(ds, "1", MT_SPLIT_TRAIN, 3, n, 9);
        char hit[333] = {0};
        int64_t fixed = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t j = mt_samples_window_of(s, i);
            assert_true(j >= 0 && j < n);
            assert_int_equal(hit[j], 0);
            hit[j] = 1;
            if (j == i) fixed++;
        }
        if (n >= 17) assert_true(fixed < n / 4);
        mt_samples_close(s);
    }
    mt_indexed_close(ds);
}

/* A run resumed at sample k from a fresh open reads what an uninterrupted
 * run reads from k on. */
static void test_resume(void **state)
{
    (void)state;
    enum { N = 300, L = 9, K = 137 };
    mt_indexed *ds = open_ds();
    mt_samples *a = open_samples(ds, "1", MT_SPLIT_TRAIN, L, N, 2024);
    static int32_t run[N][L + 1];
    for (int64_t i = 0; i < N; i++) assert_int_equal(mt_samples_get(a, i, run[i]), MT_OK);
    mt_samples_close(a);
    mt_indexed_close(ds);
    ds = open_ds();
    mt_samples *b = open_samples(ds, "1", MT_SPLIT_TRAIN, L, N, 2024);
    int32_t x[L + 1];
    for (int64_t i = K; i < N; i++) {
        assert_int_equal(mt_samples_get(b, i, x), MT_OK);
        assert_memory_equal(x, run[i], sizeof x);
    }
    mt_samples_close(b);
    mt_indexed_close(ds);
}

/* Split ranges are contiguous document ranges and samples only draw from
 * their own split. */
static void test_split_samples(void **state)
{
    (void)state;
    mt_indexed *ds = open_ds();
    const int64_t want[4] = {0, 28, 36, 40};
    for (int sp = 0; sp < MT_SPLIT_COUNT; sp++) {
        mt_samples *s = open_samples(ds, "70,20,10", sp, 3, 0, 1);
        int64_t d0, d1;
        mt_samples_documents(s, &d0, &d1);
        assert_int_equal(d0, want[sp]);
        assert_int_equal(d1, want[sp + 1]);
        int32_t w[4];
        for (int64_t i = 0; i < mt_samples_count(s); i++) {
            assert_int_equal(mt_samples_get(s, i, w), MT_OK);
            for (int k = 0; k < 4; k++) {
                if (w[k] == EOD) continue;
                int d = w[k] / 1000 - 1;
                assert_true(d >= d0 && d < d1);
            }
        }
        check_windows_against_stream(s);
        mt_samples_close(s);
    }
    mt_indexed_close(ds);
}

/* Enough epochs for the samples asked; each epoch is its own shuffle of the
 * split; windows run across epoch boundaries without a gap. */
static void test_multiple_epochs(void **state)
{
    (void)state;
    mt_indexed *ds = open_ds();
    mt_samples *s = open_samples(ds, "1", MT_SPLIT_TRAIN, 8, 0, 77);
    int64_t T = mt_samples_epoch_tokens(s), per = mt_samples_count(s);
    mt_samples_close(s);
    int64_t N = 3 * per + 5;
    s = open_samples(ds, "1", MT_SPLIT_TRAIN, 8, N, 77);
    assert_int_equal(mt_samples_count(s), N);
    int64_t need = N * 8 + 1;
    assert_int_equal(mt_samples_epochs(s), (need + T - 1) / T);
    assert_true(mt_samples_epochs(s) >= 4);
    int64_t same_as_first = 0;
    for (int64_t e = 0; e < mt_samples_epochs(s); e++) {
        char hit[NDOCS] = {0};
        int same = 1;
        for (int64_t k = 0; k < NDOCS; k++) {
            int64_t d = mt_samples_epoch_document(s, e, k);
            assert_true(d >= 0 && d < NDOCS);
            assert_int_equal(hit[d], 0);
            hit[d] = 1;
            if (d != mt_samples_epoch_document(s, 0, k)) same = 0;
        }
        same_as_first += same;
    }
    assert_int_equal(same_as_first, 1); /* only epoch 0 itself */
    check_windows_against_stream(s);
    /* the epoch's document order depends on the seed and epoch only, not on
     * how many samples were asked for */
    mt_samples *t = open_samples(ds, "1", MT_SPLIT_TRAIN, 8, N + 50, 77);
    for (int64_t k = 0; k < NDOCS; k++)
        assert_int_equal(mt_samples_epoch_document(t, 1, k), mt_samples_epoch_document(s, 1, k));
    mt_samples_close(t);
    mt_samples_close(s);
    mt_indexed_close(ds);
}

static void expect_open_error(const mt_indexed *ds, const char *ratios, int split,
                              int64_t seq_len, int64_t num, int32_t eod, const char *needle)
{
    mt_samples_config cfg = {ratios, split, seq_len, num, eod, 0};
    mt_samples *s = (mt_samples *)1;
    mt_err_clear();
    assert_true(mt_samples_open(ds, &cfg, &s) < 0);
    assert_null(s);
    assert_contains(mt_errmsg(), needle);
}

/* Bad configurations fail with a message naming the problem. */
static void test_errors(void **state)
{
    (void)state;
    mt_indexed *ds = open_ds();
    expect_open_error(ds, "1", MT_SPLIT_TRAIN, 0, 0, EOD, "seq_len 0 must be >= 1");
    expect_open_error(ds, "1", MT_SPLIT_TRAIN, 4, -1, EOD, "num_samples");
    expect_open_error(ds, "1", MT_SPLIT_TRAIN, 4, 0, -3, "EOD token");
    expect_open_error(ds, "1", 3, 4, 0, EOD, "split 3");
    expect_open_error(ds, "1,0,0", MT_SPLIT_VALID, 4, 0, EOD, "split valid has no documents");
    expect_open_error(ds, "x", MT_SPLIT_TRAIN, 4, 0, EOD, "expected a number");
    expect_open_error(ds, "1", MT_SPLIT_TRAIN, 100000, 0, EOD, "fewer than");
    expect_open_error(ds, "1", MT_SPLIT_TRAIN, 4, INT64_MAX / 2, EOD, "overflow");
    expect_open_error(ds, "1", MT_SPLIT_TRAIN, 1, 1ll << 40, EOD, "too many index entries");
    mt_indexed_close(ds);

    /* a split whose documents are all empty */
    char p2[700];
    snprintf(p2, sizeof p2, "%s/empties", tmp);
    mt_indexed_writer *w = NULL;
    assert_int_equal(mt_indexed_writer_create(p2, MT_IDX_UINT16, &w), MT_OK);
    const int32_t one[] = {5, 6};
    assert_int_equal(mt_indexed_writer_add_document(w, one, 2), MT_OK);
    assert_int_equal(mt_indexed_writer_add_document(w, NULL, 0), MT_OK);
    assert_int_equal(mt_indexed_writer_finish(w), MT_OK);
    mt_indexed_writer_free(w);
    assert_int_equal(mt_indexed_open(p2, &ds), MT_OK);
    expect_open_error(ds, "1,1", MT_SPLIT_VALID, 1, 0, EOD, "has no tokens");
    mt_indexed_close(ds);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_split_bounds),
        cmocka_unit_test(test_windows_overlap_by_one),
        cmocka_unit_test(test_every_token_appears),
        cmocka_unit_test(test_eod_handling),
        cmocka_unit_test(test_determinism),
        cmocka_unit_test(test_shuffle_is_permutation),
        cmocka_unit_test(test_resume),
        cmocka_unit_test(test_split_samples),
        cmocka_unit_test(test_multiple_epochs),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
