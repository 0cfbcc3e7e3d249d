/* mt_log.h - leveled logging with a rank prefix.
 *
 * Lines look like "[moetrain r0 I 12:03:04.512] message". The level comes
 * from MOETRAIN_LOG (error|warn|info|debug) or mt_log_set_level(); the rank
 * is set once after MPI init. Output goes to stderr, one write per line so
 * lines of different ranks do not interleave mid-line.
 */
#ifndef MT_LOG_H
#define MT_LOG_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { MT_LOG_ERROR = 0, MT_LOG_WARN, MT_LOG_INFO, MT_LOG_DEBUG } mt_log_level;

void mt_log_set_rank(int rank);
void mt_log_set_level(mt_log_level level);
mt_log_level mt_log_get_level(void);
/* Parses "error", "warn", "info", "debug"; returns -1 if unknown. */
int mt_log_parse_level(const char *s);

void mt_log(mt_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A tap sees every line that is written (without its newline), after the
 * write, from the thread that logged it; calls are serialised. One tap per
 * process (moetraind's dashboard keeps recent lines); NULL removes it, and
 * once mt_log_set_tap returns the old tap is no longer running or called.
 * The tap must not log itself (the calls hold a lock). */
typedef void (*mt_log_tap_fn)(void *ctx, mt_log_level level, const char *line, size_t len);
void mt_log_set_tap(mt_log_tap_fn fn, void *ctx);

#define MT_LOGE(...) mt_log(MT_LOG_ERROR, __VA_ARGS__)
#define MT_LOGW(...) mt_log(MT_LOG_WARN, __VA_ARGS__)
#define MT_LOGI(...) mt_log(MT_LOG_INFO, __VA_ARGS__)
#define MT_LOGD(...) mt_log(MT_LOG_DEBUG, __VA_ARGS__)

#ifdef __cplusplus
}
#endif

#endif
