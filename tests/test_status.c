/* test_status.c - the error convention: codes, file:line, wrapping. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/mt_status.h"
#include "test_util.h"

static int fails_with_einval(int x) { return MT_ERR(MT_EINVAL, "x=%d is bad", x); }

static int propagates(void)
{
    MT_CHECK(fails_with_einval(7));
    return MT_OK;
}

static void test_error_carries_code_file_line_and_message(void **state)
{
    (void)state;
    int rc = propagates();
    assert_int_equal(rc, MT_EINVAL);
    assert_contains(mt_errmsg(), "test_status.c:");
    assert_contains(mt_errmsg(), "x=7 is bad");
    assert_string_equal(mt_strstatus(rc), "EINVAL");
}

static void test_wrap_prefixes_context(void **state)
{
    (void)state;
    fails_with_einval(3);
    int rc = mt_err_wrap(MT_EINVAL, "job spec %s", "a.json");
    assert_int_equal(rc, MT_EINVAL);
    assert_true(strncmp(mt_errmsg(), "job spec a.json: ", 17) == 0);
    assert_contains(mt_errmsg(), "x=3 is bad");
    mt_err_clear();
    assert_string_equal(mt_errmsg(), "");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_error_carries_code_file_line_and_message),
        cmocka_unit_test(test_wrap_prefixes_context),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
