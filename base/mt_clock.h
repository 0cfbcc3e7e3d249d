/* mt_clock.h - the monotonic clock every timing in the tree reads (step
 * and phase times, rates, deadlines), as a double in seconds or
 * milliseconds. clock_gettime is POSIX: a file including this defines
 * _POSIX_C_SOURCE 200809L (or _XOPEN_SOURCE 700) before its first include.
 */
#ifndef MT_CLOCK_H
#define MT_CLOCK_H

#include <time.h>

static inline double mt_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline double mt_now_ms(void) { return 1e3 * mt_now_s(); }

#endif
