/* progress.h - a progress bar for long checkpoint operations.
 *
 * On a terminal: one line redrawn with '\r' at most 10 times a second
 * ("verify [##########..........] 48%  1.2/2.5 GB  310 MB/s  eta 4s").
 * Otherwise (logs, tests): a line at every 25%. All functions accept NULL.
 */
#ifndef MT_PROGRESS_H
#define MT_PROGRESS_H

#include <stdint.h>

typedef struct mt_progress {
    char label[32];
    char unit[16];        /* "" : bytes; else counts of this ("tokens") */
    int64_t total, done;  /* bytes */
    double t0, last;      /* seconds (monotonic) */
    int enabled, tty, last_quarter;
} mt_progress;

void mt_progress_start(mt_progress *p, const char *label, int64_t total, int enabled);
/* The same for counts of `unit` ("1200/5120 tokens  410 tokens/s"). */
void mt_progress_start_count(mt_progress *p, const char *label, int64_t total, const char *unit,
                             int enabled);
void mt_progress_add(mt_progress *p, int64_t bytes);
/* Final line with the elapsed time and the rate. */
void mt_progress_end(mt_progress *p);

#endif
