/* mt_log.c - see mt_log.h. The rank and level are process-wide settings. */
#define _POSIX_C_SOURCE 200809L
#include "base/mt_log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static int log_rank = 0;
static int log_level = -1; /* -1: not yet read from the environment */

static pthread_mutex_t tap_mu = PTHREAD_MUTEX_INITIALIZER;
static mt_log_tap_fn tap_fn; /* guarded by tap_mu */
static void *tap_ctx;

void mt_log_set_tap(mt_log_tap_fn fn, void *ctx)
{
    pthread_mutex_lock(&tap_mu);
    tap_fn = fn;
    tap_ctx = ctx;
    pthread_mutex_unlock(&tap_mu);
}

void mt_log_set_rank(int rank) { log_rank = rank; }

int mt_log_parse_level(const char *s)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) return i;
    return -1;
}

mt_log_level mt_log_get_level(void)
{
    if (log_level < 0) {
        const char *e = getenv("MOETRAIN_LOG");
        int l = e ? mt_log_parse_level(e) : -1;
        log_level = l < 0 ? MT_LOG_INFO : l;
    }
    return (mt_log_level)log_level;
}

void mt_log_set_level(mt_log_level level) { log_level = (int)level; }

void mt_log(mt_log_level level, const char *fmt, ...)
{
    if (level > mt_log_get_level()) return;
    static const char tag[] = "EWID";
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    localtime_r(&tv.tv_sec, &tm);
    char line[4096];
    int n = snprintf(line, sizeof line, "[moetrain r%d %c %02d:%02d:%02d.%03d] ", log_rank,
                     tag[level], tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000));
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2) len = sizeof line - 2;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
    pthread_mutex_lock(&tap_mu);
    if (tap_fn) tap_fn(tap_ctx, level, line, len - 1);
    pthread_mutex_unlock(&tap_mu);
}
