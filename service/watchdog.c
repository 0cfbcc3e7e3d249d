/* watchdog.c - see watchdog.h. */
#define _POSIX_C_SOURCE 200809L
#include "service/watchdog.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "base/mt_status.h"

struct watchdog {
    pthread_mutex_t mu;
    pthread_cond_t cv;     /* CLOCK_MONOTONIC */
    pthread_t th;
    int quit;
    int armed;
    struct timespec start, deadline;
    char what[128];
    int fired;
    watchdog_fire_fn fire;
    void *arg;
};

static double diff_s(const struct timespec *a, const struct timespec *b)
{
    return (double)(a->tv_sec - b->tv_sec) + 1e-9 * (double)(a->tv_nsec - b->tv_nsec);
}

static void *watch_main(void *arg)
{
    watchdog *w = arg;
    pthread_mutex_lock(&w->mu);
    while (!w->quit) {
        if (!w->armed) {
            pthread_cond_wait(&w->cv, &w->mu);
            continue;
        }
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (diff_s(&now, &w->deadline) < 0) {
            struct timespec until = w->deadline;
            pthread_cond_timedwait(&w->cv, &w->mu, &until);
            continue;
        }
        /* expired: fire once per arming, outside the lock */
        char what[128];
        snprintf(what, sizeof what, "%s", w->what);
        double waited = diff_s(&now, &w->start);
        w->armed = 0;
        w->fired++;
        pthread_mutex_unlock(&w->mu);
        w->fire(w->arg, what, waited);
        pthread_mutex_lock(&w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int watchdog_create(watchdog **out, watchdog_fire_fn fire, void *arg)
{
    *out = NULL;
    watchdog *w = calloc(1, sizeof *w);
    if (!w) return MT_ERR(MT_ENOMEM, "watchdog: out of memory");
    w->fire = fire;
    w->arg = arg;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&w->mu, NULL);
    if (pthread_create(&w->th, NULL, watch_main, w) != 0) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return MT_ERR(MT_EGENERIC, "watchdog: cannot start its thread");
    }
    *out = w;
    return MT_OK;
}

void watchdog_destroy(watchdog *w)
{
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->quit = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->th, NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
}

void watchdog_arm(watchdog *w, double timeout_s, const char *what)
{
    if (!w) return;
    if (timeout_s <= 0) {
        watchdog_disarm(w);
        return;
    }
    pthread_mutex_lock(&w->mu);
    clock_gettime(CLOCK_MONOTONIC, &w->start);
    w->deadline = w->start;
    long long ns = (long long)(timeout_s * 1e9);
    w->deadline.tv_sec += (time_t)(ns / 1000000000LL);
    w->deadline.tv_nsec += (long)(ns % 1000000000LL);
    if (w->deadline.tv_nsec >= 1000000000L) {
        w->deadline.tv_sec++;
        w->deadline.tv_nsec -= 1000000000L;
    }
    snprintf(w->what, sizeof w->what, "%s", what);
    w->armed = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void watchdog_disarm(watchdog *w)
{
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->armed = 0;
    pthread_mutex_unlock(&w->mu);
}

int watchdog_fired(watchdog *w)
{
    pthread_mutex_lock(&w->mu);
    int n = w->fired;
    pthread_mutex_unlock(&w->mu);
    return n;
}
