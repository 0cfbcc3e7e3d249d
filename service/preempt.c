/* preempt.c - see preempt.h. */
#define _POSIX_C_SOURCE 200809L
#include "service/preempt.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "service/exit_status.h"

/* Written by the handler: monotonic time of the first signal, ns; 0: none.
 * Lock-free 64-bit atomics are async-signal-safe on the platforms we run. */
static atomic_llong term_ns;
static volatile sig_atomic_t *term_flag;
static _Atomic double grace_s = 25.0;

/* A margin on the estimate: the last save is a guide, not a promise. */
#define SAVE_FACTOR 1.25
#define SAVE_SLACK_S 1.0

static long long mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* async-signal-safe */
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void on_signal(int sig)
{
    (void)sig;
    long long zero = 0;
    atomic_compare_exchange_strong(&term_ns, &zero, mono_ns());
    if (term_flag) *term_flag = 1;
}

void preempt_install(volatile sig_atomic_t *flag)
{
    term_flag = flag;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

double preempt_elapsed_s(void)
{
    long long t = atomic_load(&term_ns);
    return t ? (double)(mono_ns() - t) * 1e-9 : -1.0;
}

void preempt_set_grace(double seconds) { atomic_store(&grace_s, seconds); }

double preempt_grace(void) { return atomic_load(&grace_s); }

preempt_verdict preempt_decide(double elapsed_s, double est_save_s, double grace_s, char *why,
                               size_t cap)
{
    if (grace_s <= 0) {
        snprintf(why, cap, "train.term_grace_s is 0: exiting without a checkpoint");
        return PREEMPT_NO_SAVE;
    }
    if (est_save_s < 0) {
        snprintf(why, cap, "%.1f s after the signal, grace period %g s: saving (no earlier save "
                           "to estimate its time from; the backstop ends the process at the "
                           "deadline)", elapsed_s, grace_s);
        return PREEMPT_SAVE;
    }
    double end = elapsed_s + SAVE_FACTOR * est_save_s + SAVE_SLACK_S;
    if (end <= grace_s) {
        snprintf(why, cap, "%.1f s after the signal, a save takes about %.1f s: saving within "
                           "the grace period of %g s", elapsed_s, est_save_s, grace_s);
        return PREEMPT_SAVE;
    }
    snprintf(why, cap, "%.1f s after the signal, a save takes about %.1f s and would end after "
                       "the grace period of %g s: exiting without a checkpoint",
             elapsed_s, est_save_s, grace_s);
    return PREEMPT_NO_SAVE;
}

static void *backstop_main(void *arg)
{
    void (*die)(int) = *(void (**)(int))arg;
    for (;;) {
        struct timespec nap = {0, 100 * 1000000L};
        nanosleep(&nap, NULL);
        double e = preempt_elapsed_s(), g = preempt_grace();
        if (e < 0 || g <= 0 || e < g) continue;
        MT_LOGE("SIGTERM %.1f s ago: the grace period of %g s (train.term_grace_s) is over "
                "before the job could save and exit: exiting now with status %d; the newest "
                "committed checkpoint is unchanged", e, g, MT_EXIT_RESTART);
        die(MT_EXIT_RESTART);
    }
    return NULL;
}

int preempt_backstop_start(void (*die)(int status))
{
    static int started;
    static void (*die_fn)(int);
    if (started) return MT_OK;
    die_fn = die;
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int e = pthread_create(&th, &at, backstop_main, (void *)&die_fn);
    pthread_attr_destroy(&at);
    if (e != 0) return MT_ERR(MT_EGENERIC, "cannot start the SIGTERM backstop thread");
    started = 1;
    return MT_OK;
}
