/* test_npy.c - base/mt_npy: the .npy files written follow format 1.0 (the
 * header padded to 64 bytes, the shape and dtype numpy reads), appear only
 * complete, and integer token arrays read back with their errors named.
 * (tests/ckpt_eval.sh reads the files with numpy itself.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <sys/stat.h>

#include "base/mt_npy.h"
#include "base/mt_status.h"
#include "test_util.h"

static char tmp[1024];

static int exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

static char *slurp(const char *path, long *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    *len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)*len + 1);
    assert_int_equal(fread(b, 1, (size_t)*len, f), (size_t)*len);
    b[*len] = '\0';
    fclose(f);
    return b;
}

static void test_writer_follows_format_1_0(void **state)
{
    (void)state;
    char path[1200];
    snprintf(path, sizeof path, "%s/sub/a.npy", tmp); /* the folder is created */
    int64_t shape[2] = {2, 3};
    mt_npy_writer *w;
    assert_int_equal(mt_npy_create(&w, path, "<f4", 2, shape), MT_OK);
    float a[6] = {1, 2, 3, 4, 5, 6};
    assert_int_equal(mt_npy_write(w, a, 2), MT_OK);
    assert_int_equal(mt_npy_write(w, a + 2, 4), MT_OK);
    assert_int_equal(mt_npy_close(w, 0), MT_OK);
    long len;
    char *b = slurp(path, &len);
    assert_memory_equal(b, "\x93NUMPY\x01\x00", 8);
    int hl = (unsigned char)b[8] | (unsigned char)b[9] << 8;
    assert_int_equal((10 + hl) % 64, 0);
    assert_int_equal(b[10 + hl - 1], '\n');
    assert_non_null(strstr(b + 10, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"));
    assert_int_equal(len, 10 + hl + 24);
    assert_memory_equal(b + 10 + hl, a, 24);
    free(b);
    /* a 1-D shape is a 1-tuple: (5,) */
    int64_t n5 = 5;
    assert_int_equal(mt_npy_create(&w, path, "<i4", 1, &n5), MT_OK);
    int32_t v[5] = {0};
    assert_int_equal(mt_npy_write(w, v, 5), MT_OK);
    assert_int_equal(mt_npy_close(w, 0), MT_OK);
    b = slurp(path, &len);
    assert_non_null(strstr(b + 10, "'shape': (5,), }"));
    free(b);
}

static void test_incomplete_arrays_never_appear(void **state)
{
    (void)state;
    char path[1200], partial[1300];
    snprintf(path, sizeof path, "%s/short.npy", tmp);
    snprintf(partial, sizeof partial, "%s.partial", path);
    int64_t shape[2] = {2, 3};
    mt_npy_writer *w;
    float a[7] = {0};
    assert_int_equal(mt_npy_create(&w, path, "<f4", 2, shape), MT_OK);
    assert_true(exists(partial) && !exists(path));
    assert_int_equal(mt_npy_write(w, a, 5), MT_OK);
    assert_int_equal(mt_npy_write(w, a, 2), MT_EINVAL); /* past the shape */
    assert_int_equal(mt_npy_close(w, 0), MT_EINVAL);    /* 5 of 6 */
    assert_contains(mt_errmsg(), "5 of 6 elements");
    assert_false(exists(path));
    assert_false(exists(partial));
    assert_int_equal(mt_npy_create(&w, path, "<f4", 2, shape), MT_OK);
    assert_int_equal(mt_npy_close(w, 1), MT_OK); /* abandoned */
    assert_false(exists(partial));
}

/* Writes raw .npy bytes: header dict `dict`, then `n` bytes of data. */
static void write_raw(const char *path, const char *dict, const void *data, size_t n)
{
    char hdr[256];
    size_t hl = strlen(dict) + 1;
    hl += (64 - (10 + hl) % 64) % 64;
    memset(hdr, ' ', hl);
    memcpy(hdr, dict, strlen(dict));
    hdr[hl - 1] = '\n';
    FILE *f = fopen(path, "wb");
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)hl, 0};
    fwrite(pre, 1, 10, f);
    fwrite(hdr, 1, hl, f);
    fwrite(data, 1, n, f);
    fclose(f);
}

static void test_integer_arrays_read_as_token_ids(void **state)
{
    (void)state;
    char path[1200];
    snprintf(path, sizeof path, "%s/t.npy", tmp);
    int64_t v8[6] = {0, 1, 2, 63, -5, 7};
    int32_t *d;
    int64_t rows, cols;
    write_raw(path, "{'descr': '<i8', 'fortran_order': False, 'shape': (2, 3), }", v8, sizeof v8);
    assert_int_equal(mt_npy_read_int32(path, &d, &rows, &cols), MT_OK);
    assert_int_equal(rows, 2);
    assert_int_equal(cols, 3);
    for (int i = 0; i < 6; i++) assert_int_equal(d[i], v8[i]);
    free(d);
    uint16_t v2[4] = {1, 65535, 3, 4};
    write_raw(path, "{'descr': '<u2', 'fortran_order': False, 'shape': (4,), }", v2, sizeof v2);
    assert_int_equal(mt_npy_read_int32(path, &d, &rows, &cols), MT_OK);
    assert_int_equal(rows, 1);
    assert_int_equal(cols, 4);
    assert_int_equal(d[1], 65535);
    free(d);
    /* the errors name the file and what is wrong */
    int64_t big[2] = {1, (int64_t)1 << 40};
    write_raw(path, "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", big, sizeof big);
    assert_int_equal(mt_npy_read_int32(path, &d, &rows, &cols), MT_EINVAL);
    assert_contains(mt_errmsg(), "element 1 (1099511627776) does not fit a token id");
    write_raw(path, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", big, 8);
    assert_int_equal(mt_npy_read_int32(path, &d, &rows, &cols), MT_EINVAL);
    assert_contains(mt_errmsg(), "dtype '<f4' is not a little-endian integer type");
    write_raw(path, "{'descr': '<i4', 'fortran_order': True, 'shape': (2, 1), }", big, 8);
    assert_int_equal(mt_npy_read_int32(path, &d, &rows, &cols), MT_EINVAL);
    assert_contains(mt_errmsg(), "Fortran-ordered");
    write_raw(path, "{'descr': '<i4', 'fortran_order': False, 'shape': (3, 2), }", big, 8);
    assert_int_equal(mt_npy_read_int32(path, &d, &rows, &cols), MT_EINVAL);
    assert_contains(mt_errmsg(), "fewer than the 6 elements");
    write_raw(path, "{'descr': '<i4', 'fortran_order': False, 'shape': (1, 1, 2), }", big, 8);
    assert_int_equal(mt_npy_read_int32(path, &d, &rows, &cols), MT_EINVAL);
    assert_contains(mt_errmsg(), "more than 2 dimensions");
    mt_test_write_file(path, "1 2 3\n");
    assert_int_equal(mt_npy_read_int32(path, &d, &rows, &cols), MT_EINVAL);
    assert_contains(mt_errmsg(), "not a .npy file");
}

static int setup(void **state)
{
    (void)state;
    mt_test_tmpdir(tmp, sizeof tmp, "test_npy");
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_writer_follows_format_1_0),
        cmocka_unit_test(test_incomplete_arrays_never_appear),
        cmocka_unit_test(test_integer_arrays_read_as_token_ids),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
