/* test_ops_units.c - the decisions behind operations (issue 20), each a
 * pure function: what SIGTERM does given the time left, which exit status
 * tells the launcher what; and the step watchdog's promise: it reports a
 * step that outlasts its deadline, once, and never one that ends in time;
 * and the loss-spike detector's rule. */
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
#include "engine/train/spike.h"

#include <math.h>

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

static void detector(mt_spike_detector *d, int window, double sigma, double grad_sigma)
{
    mt_train_cfg c;
    memset(&c, 0, sizeof c);
    c.spike_window = window;
    c.spike_sigma = sigma;
    c.spike_grad_sigma = grad_sigma;
    assert_int_equal(mt_spike_init(d, &c), MT_OK);
}

static void test_spike_needs_half_a_window_of_history(void **state)
{
    (void)state;
    mt_spike_detector d;
    detector(&d, 20, 6, 0);
    int64_t s = 1;
    for (; s <= 9; s++) assert_int_equal(mt_spike_observe(&d, s, 3.0 + 0.01 * (s % 3), 1, NULL, 0), MT_SPIKE_OK);
    /* 9 steps of history: a huge loss is not judged yet */
    assert_int_equal(mt_spike_observe(&d, s++, 1000, 1, NULL, 0), MT_SPIKE_OK);
    /* ... but a NaN always is */
    assert_int_equal(mt_spike_observe(&d, s++, NAN, 1, NULL, 0), MT_SPIKE_NONFINITE);
    assert_int_equal(mt_spike_observe(&d, s++, 3.0, INFINITY, NULL, 0), MT_SPIKE_NONFINITE);
    mt_spike_free(&d);
}

static void test_spike_is_a_rise_beyond_sigma_deviations_and_persists_as_a_streak(void **state)
{
    (void)state;
    mt_spike_detector d;
    detector(&d, 20, 6, 0);
    int64_t s = 1;
    /* loss 3.0 +- 0.1: mean 3, std 0.1, the limit 3.6 */
    for (; s <= 20; s++) mt_spike_observe(&d, s, 3.0 + (s % 2 ? 0.1 : -0.1), 1, NULL, 0);
    char why[256];
    assert_int_equal(mt_spike_observe(&d, s, 3.65, 1, why, sizeof why), MT_SPIKE_LOSS);
    assert_int_equal(d.streak, 1);
    assert_int_equal(d.onset, s);
    assert_non_null(strstr(why, "loss 3.6500 above 3.6000"));
    int64_t onset = s++;
    /* the spike is not part of the baseline: the same value stays a spike */
    assert_int_equal(mt_spike_observe(&d, s++, 3.65, 1, NULL, 0), MT_SPIKE_LOSS);
    assert_int_equal(mt_spike_observe(&d, s++, NAN, 1, NULL, 0), MT_SPIKE_NONFINITE);
    assert_int_equal(d.streak, 3);
    assert_int_equal(d.onset, onset);
    /* a drop is never a spike, and a normal step ends the streak */
    assert_int_equal(mt_spike_observe(&d, s++, 0.5, 1, NULL, 0), MT_SPIKE_OK);
    assert_int_equal(d.streak, 0);
    assert_int_equal(d.onset, 0);
    /* 5 deviations is within 6 */
    mt_spike_detector e;
    detector(&e, 20, 6, 0);
    for (s = 1; s <= 20; s++) mt_spike_observe(&e, s, 3.0 + (s % 2 ? 0.1 : -0.1), 1, NULL, 0);
    assert_int_equal(mt_spike_observe(&e, s, 3.5, 1, NULL, 0), MT_SPIKE_OK);
    mt_spike_free(&e);
    mt_spike_free(&d);
}

static void test_spike_flat_history_uses_a_relative_floor(void **state)
{
    (void)state;
    mt_spike_detector d;
    detector(&d, 8, 6, 0);
    for (int64_t s = 1; s <= 8; s++) mt_spike_observe(&d, s, 2.0, 1, NULL, 0); /* std 0 */
    /* floor 1e-3 * 2 = 0.002: 2.02 is 10 floors above (a spike, kept out of
     * the history), 2.01 is 5 (not a spike) */
    assert_int_equal(mt_spike_observe(&d, 9, 2.02, 1, NULL, 0), MT_SPIKE_LOSS);
    assert_int_equal(mt_spike_observe(&d, 10, 2.01, 1, NULL, 0), MT_SPIKE_OK);
    mt_spike_free(&d);
}

static void test_spike_gradient_norm_only_when_asked(void **state)
{
    (void)state;
    mt_spike_detector off, on;
    detector(&off, 8, 6, 0);
    detector(&on, 8, 6, 4);
    for (int64_t s = 1; s <= 8; s++) {
        mt_spike_observe(&off, s, 3.0, 1.0 + 0.1 * (s % 2), NULL, 0);
        mt_spike_observe(&on, s, 3.0, 1.0 + 0.1 * (s % 2), NULL, 0);
    }
    assert_int_equal(mt_spike_observe(&off, 9, 3.0, 50, NULL, 0), MT_SPIKE_OK);
    assert_int_equal(mt_spike_observe(&on, 9, 3.0, 50, NULL, 0), MT_SPIKE_GRAD);
    mt_spike_free(&off);
    mt_spike_free(&on);
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
        cmocka_unit_test(test_spike_needs_half_a_window_of_history),
        cmocka_unit_test(test_spike_is_a_rise_beyond_sigma_deviations_and_persists_as_a_streak),
        cmocka_unit_test(test_spike_flat_history_uses_a_relative_floor),
        cmocka_unit_test(test_spike_gradient_norm_only_when_asked),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
