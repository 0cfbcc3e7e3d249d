/* metrics_hub.h - the events of the engine (steps, state changes,
 * checkpoints, reshard progress) in a ring buffer, read by any number of
 * subscribers.
 *
 * Every event gets a sequence number, one more than the last. The engine
 * publishes without ever waiting on a reader: a subscriber is only a cursor
 * (the next sequence number it wants), so a slow one cannot hold training
 * back. A subscriber that falls more than the ring's capacity behind is told
 * how many events it missed and continues with the oldest retained one; a
 * subscriber that keeps up sees every event exactly once, in order.
 */
#ifndef MT_METRICS_HUB_H
#define MT_METRICS_HUB_H

#include <stdint.h>

#include "engine/train/metrics.h"
#include "service/svc_types.h"

typedef enum {
    HUB_STEP = 0,
    HUB_STATE,
    HUB_CHECKPOINT,
    HUB_RESHARD,
    HUB_N_KINDS
} hub_kind;

typedef struct hub_event {
    uint64_t seq;
    uint64_t run_id;           /* job the event belongs to; 0: none */
    char job[SVC_NAME_CAP];
    hub_kind kind;
    union {
        mt_step_metrics step;
        struct {
            svc_state state;
            int64_t step;
            char message[SVC_MSG_CAP];
        } state;
        svc_ckpt ckpt;
        svc_reshard reshard;
    } u;
} hub_event;

typedef struct metrics_hub metrics_hub;

int hub_create(metrics_hub **out, int capacity);
void hub_destroy(metrics_hub *h);

/* A zeroed event of `kind` for job `job` of run `run_id` (heap: an event
 * holds a whole step's metrics), or NULL when out of memory. */
hub_event *hub_event_new(uint64_t run_id, const char *job, hub_kind kind);

/* Appends a copy of *e (its seq is assigned here) and returns the seq. */
uint64_t hub_publish(metrics_hub *h, const hub_event *e);

/* The cursor a new subscriber starts at: the oldest retained event of the
 * latest job (all retained events with `all_runs`); the subscriber itself
 * skips step events below the step it asked for. */
uint64_t hub_cursor_start(metrics_hub *h, int all_runs, uint64_t *run_id);

/* Reads the event at *cursor: 1 an event (cursor advanced), 0 none yet,
 * -1 none and the hub is closed. When the cursor had fallen out of the ring
 * *missed says by how many events (the cursor moves to the oldest). */
int hub_read(metrics_hub *h, uint64_t *cursor, hub_event *out, uint64_t *missed);

/* No more events will come: readers end once they have caught up. */
void hub_close(metrics_hub *h);

/* The next seq to be assigned (for cheap "anything new?" checks). */
uint64_t hub_head(metrics_hub *h);

/* Totals for /metrics: events published, events missed by subscribers. */
void hub_stats(metrics_hub *h, uint64_t *published, uint64_t *missed_total);
void hub_count_missed(metrics_hub *h, uint64_t missed);

#endif
