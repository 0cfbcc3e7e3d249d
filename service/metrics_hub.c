/* metrics_hub.c - see metrics_hub.h. */
#include "service/metrics_hub.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

struct metrics_hub {
    pthread_mutex_t mu;
    hub_event *ring;   /* [cap]; event seq s lives at s % cap */
    uint64_t cap;
    uint64_t head;     /* next seq; events [max(1, head - cap), head) are retained */
    int closed;
    uint64_t missed_total;
};

int hub_create(metrics_hub **out, int capacity)
{
    *out = NULL;
    if (capacity < 2) return MT_ERR(MT_EINVAL, "metrics hub: capacity %d < 2", capacity);
    metrics_hub *h = calloc(1, sizeof *h);
    if (!h) return MT_ERR(MT_ENOMEM, "metrics hub: out of memory");
    h->ring = calloc((size_t)capacity, sizeof *h->ring);
    if (!h->ring) {
        free(h);
        return MT_ERR(MT_ENOMEM, "metrics hub: out of memory for %d events", capacity);
    }
    pthread_mutex_init(&h->mu, NULL);
    h->cap = (uint64_t)capacity;
    h->head = 1; /* seq 0 means "none" in cursors of the callers */
    *out = h;
    return MT_OK;
}

void hub_destroy(metrics_hub *h)
{
    if (!h) return;
    pthread_mutex_destroy(&h->mu);
    free(h->ring);
    free(h);
}

static uint64_t oldest(const metrics_hub *h) { return h->head > h->cap + 1 ? h->head - h->cap : 1; }

hub_event *hub_event_new(uint64_t run_id, const char *job, hub_kind kind)
{
    hub_event *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->run_id = run_id;
    snprintf(e->job, sizeof e->job, "%s", job);
    e->kind = kind;
    return e;
}

uint64_t hub_publish(metrics_hub *h, const hub_event *e)
{
    pthread_mutex_lock(&h->mu);
    uint64_t seq = h->head++;
    hub_event *slot = &h->ring[seq % h->cap];
    *slot = *e;
    slot->seq = seq;
    pthread_mutex_unlock(&h->mu);
    return seq;
}

uint64_t hub_cursor_start(metrics_hub *h, int all_runs, uint64_t *run_id)
{
    pthread_mutex_lock(&h->mu);
    uint64_t first = oldest(h), cur = h->head;
    uint64_t run = h->head > 1 ? h->ring[(h->head - 1) % h->cap].run_id : 0;
    if (all_runs) {
        cur = first;
    } else {
        /* Events of one run are contiguous: walk back while it lasts. */
        while (cur > first && h->ring[(cur - 1) % h->cap].run_id == run && run != 0) cur--;
    }
    pthread_mutex_unlock(&h->mu);
    if (run_id) *run_id = run;
    return cur;
}

int hub_read(metrics_hub *h, uint64_t *cursor, hub_event *out, uint64_t *missed)
{
    *missed = 0;
    pthread_mutex_lock(&h->mu);
    uint64_t first = oldest(h);
    if (*cursor < first) {
        *missed = first - *cursor;
        *cursor = first;
    }
    int r;
    if (*cursor < h->head) {
        *out = h->ring[*cursor % h->cap];
        (*cursor)++;
        r = 1;
    } else {
        r = h->closed ? -1 : 0;
    }
    pthread_mutex_unlock(&h->mu);
    return r;
}

void hub_close(metrics_hub *h)
{
    pthread_mutex_lock(&h->mu);
    h->closed = 1;
    pthread_mutex_unlock(&h->mu);
}

uint64_t hub_head(metrics_hub *h)
{
    pthread_mutex_lock(&h->mu);
    uint64_t v = h->head;
    pthread_mutex_unlock(&h->mu);
    return v;
}

void hub_stats(metrics_hub *h, uint64_t *published, uint64_t *missed_total)
{
    pthread_mutex_lock(&h->mu);
    *published = h->head - 1;
    *missed_total = h->missed_total;
    pthread_mutex_unlock(&h->mu);
}

void hub_count_missed(metrics_hub *h, uint64_t missed)
{
    pthread_mutex_lock(&h->mu);
    h->missed_total += missed;
    pthread_mutex_unlock(&h->mu);
}
