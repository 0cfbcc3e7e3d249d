/* log_ring.c - see log_ring.h. */
#include "service/log_ring.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

struct log_ring {
    pthread_mutex_t mu;
    log_line lines[LOG_RING_LINES]; /* line seq s lives at s % LOG_RING_LINES */
    uint64_t head;                  /* next seq; lines [max(1, head - N), head) are kept */
    int attached;
};

int log_ring_create(log_ring **out)
{
    *out = calloc(1, sizeof **out);
    if (!*out) return MT_ERR(MT_ENOMEM, "log ring: out of memory");
    pthread_mutex_init(&(*out)->mu, NULL);
    (*out)->head = 1;
    return MT_OK;
}

void log_ring_destroy(log_ring *r)
{
    if (!r) return;
    log_ring_detach(r);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

static void tap(void *ctx, mt_log_level level, const char *line, size_t len)
{
    log_ring_add(ctx, level, line, len);
}

void log_ring_attach(log_ring *r)
{
    mt_log_set_tap(tap, r);
    r->attached = 1;
}

void log_ring_detach(log_ring *r)
{
    if (r && r->attached) {
        mt_log_set_tap(NULL, NULL);
        r->attached = 0;
    }
}

void log_ring_add(log_ring *r, mt_log_level level, const char *text, size_t len)
{
    if (len >= LOG_RING_LINE_CAP) len = LOG_RING_LINE_CAP - 1;
    pthread_mutex_lock(&r->mu);
    log_line *l = &r->lines[r->head % LOG_RING_LINES];
    l->seq = r->head++;
    l->level = level;
    memcpy(l->text, text, len);
    l->text[len] = '\0';
    pthread_mutex_unlock(&r->mu);
}

int log_ring_read(log_ring *r, uint64_t after, log_line *out, int cap, uint64_t *next)
{
    pthread_mutex_lock(&r->mu);
    uint64_t first = r->head > LOG_RING_LINES ? r->head - LOG_RING_LINES : 1;
    uint64_t s = after + 1 > first ? after + 1 : first;
    int n = 0;
    for (; s < r->head && n < cap; s++) out[n++] = r->lines[s % LOG_RING_LINES];
    *next = r->head;
    pthread_mutex_unlock(&r->mu);
    return n;
}
