/* log_ring.h - the recent log lines of rank 0, for the dashboard.
 *
 * A tap on mt_log (base/mt_log.h) copies each line written into a ring of
 * LOG_RING_LINES lines; every line gets a sequence number, one more than
 * the last, starting at 1, so a reader that remembers the last number it
 * saw gets only what came after (a jump in the numbers shows lines it
 * missed by falling a whole ring behind).
 */
#ifndef MT_LOG_RING_H
#define MT_LOG_RING_H

#include <stddef.h>
#include <stdint.h>

#include "base/mt_log.h"

#define LOG_RING_LINES 256
#define LOG_RING_LINE_CAP 512 /* longer lines are cut */

typedef struct log_ring log_ring;

typedef struct log_line {
    uint64_t seq;
    mt_log_level level;
    char text[LOG_RING_LINE_CAP];
} log_line;

int log_ring_create(log_ring **out);
/* Removes the tap first if it is installed. NULL is fine. */
void log_ring_destroy(log_ring *r);

/* Installs / removes the ring as the process's mt_log tap. */
void log_ring_attach(log_ring *r);
void log_ring_detach(log_ring *r);

/* Adds a line (what the tap does; also for tests). */
void log_ring_add(log_ring *r, mt_log_level level, const char *text, size_t len);

/* Copies up to `cap` lines with seq > after, oldest first, into out;
 * returns how many. *next is the seq the next line will get. */
int log_ring_read(log_ring *r, uint64_t after, log_line *out, int cap, uint64_t *next);

#endif
