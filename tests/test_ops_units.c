/* test_ops_units.c - the decisions behind operations (issue 20), each a
 * pure function: what SIGTERM does given the time left, which exit status
 * tells the launcher what; and the step watchdog's promise: it reports a
 * step that outlasts its deadline, once, and never one that ends in time. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "base/mt_status.h"
#include "service/exit_status.h"
#include "service/preempt.h"
#include "service/watchdog.h"

#include <time.h>

static void test_sigterm_saves_when_the_save_ends_within_the_grace_period(void **state)
{
    (void)state;
    char why[256];
    /* 2 s after the signal, a 10 s save: ends at 2 + 1.25 * 10 + 1 = 15.5 s < 25 s */
    assert_int_equal(preempt_decide(2, 10, 25, why, sizeof why), PREEMPT_SAVE);
    assert_non_null(strstr(why, "saving within the grace period of 25 s"));
}

static void test_sigterm_does_not_save_when_the_save_would_end_late(void **state)
{
    (void)state;
    char why[256];
    /* 10 s after the signal, a 12 s save: 10 + 15 + 1 = 26 s > 25 s */
    assert_int_equal(preempt_decide(10, 12, 25, why, sizeof why), PREEMPT_NO_SAVE);
    assert_non_null(strstr(why, "exiting without a checkpoint"));
    /* the margin: a save estimated to end just inside is still refused */
    assert_int_equal(preempt_decide(0, 19.5, 25, why, sizeof why), PREEMPT_NO_SAVE);
    assert_int_equal(preempt_decide(0, 19, 25, why, sizeof why), PREEMPT_SAVE);
}

static void test_sigterm_tries_when_no_save_time_is_known(void **state)
{
    (void)state;
    char why[256];
    assert_int_equal(preempt_decide(3, -1, 25, why, sizeof why), PREEMPT_SAVE);
    assert_non_null(strstr(why, "backstop"));
}

static void test_sigterm_with_no_grace_period_never_saves(void **state)
{
    (void)state;
    char why[256];
    assert_int_equal(preempt_decide(0, 0.001, 0, why, sizeof why), PREEMPT_NO_SAVE);
    assert_non_null(strstr(why, "term_grace_s is 0"));
}

static void test_no_signal_means_no_elapsed_time(void **state)
{
    (void)state;
    assert_true(preempt_elapsed_s() < 0);
}

static void test_exit_status_says_whether_a_restart_helps(void **state)
{
    (void)state;
    assert_int_equal(mt_exit_status(MT_OK), 0);
    /* restartable: SIGTERM without a checkpoint, a dead peer, the transport */
    assert_int_equal(mt_exit_status(MT_EINTR), 75);
    assert_int_equal(mt_exit_status(MT_EMPI), 75);
    assert_int_equal(mt_exit_status(MT_ENCCL), 75);
    /* not: the job itself is wrong */
    assert_int_equal(mt_exit_status(MT_EINVAL), 2);
    assert_int_equal(mt_exit_status(MT_ENUMERIC), 2);
    assert_int_equal(mt_exit_status(MT_ECORRUPT), 2);
}

typedef struct fired_rec {
    char what[64];
    double waited;
} fired_rec;

static void record_fire(void *arg, const char *what, double waited_s)
{
    fired_rec *r = arg;
    snprintf(r->what, sizeof r->what, "%s", what);
    r->waited = waited_s;
}

static void nap(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static void test_watchdog_fires_once_when_a_step_outlasts_its_deadline(void **state)
{
    (void)state;
    fired_rec r = {"", 0};
    watchdog *w;
    assert_int_equal(watchdog_create(&w, record_fire, &r), MT_OK);
    watchdog_arm(w, 0.05, "step 7");
    for (int i = 0; i < 500 && !watchdog_fired(w); i++) nap(0.01);
    assert_int_equal(watchdog_fired(w), 1);
    assert_string_equal(r.what, "step 7");
    assert_true(r.waited >= 0.05);
    nap(0.1); /* one arming, one report */
    assert_int_equal(watchdog_fired(w), 1);
    watchdog_destroy(w);
}

static void test_watchdog_stays_quiet_when_disarmed_in_time(void **state)
{
    (void)state;
    fired_rec r = {"", 0};
    watchdog *w;
    assert_int_equal(watchdog_create(&w, record_fire, &r), MT_OK);
    for (int i = 0; i < 5; i++) { /* five steps well inside a 60 s timeout */
        watchdog_arm(w, 60, "step");
        nap(0.01);
        watchdog_disarm(w);
    }
    watchdog_arm(w, 0, "off"); /* 0: no deadline (train.step_timeout_s = 0) */
    nap(0.05);
    assert_int_equal(watchdog_fired(w), 0);
    watchdog_destroy(w);
    watchdog_arm(NULL, 1, "no watchdog"); /* callers need no checks */
    watchdog_disarm(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sigterm_saves_when_the_save_ends_within_the_grace_period),
        cmocka_unit_test(test_sigterm_does_not_save_when_the_save_would_end_late),
        cmocka_unit_test(test_sigterm_tries_when_no_save_time_is_known),
        cmocka_unit_test(test_sigterm_with_no_grace_period_never_saves),
        cmocka_unit_test(test_no_signal_means_no_elapsed_time),
        cmocka_unit_test(test_exit_status_says_whether_a_restart_helps),
        cmocka_unit_test(test_watchdog_fires_once_when_a_step_outlasts_its_deadline),
        cmocka_unit_test(test_watchdog_stays_quiet_when_disarmed_in_time),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
