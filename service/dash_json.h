/* dash_json.h - what the web dashboard reads, as text: Server-Sent Events
 * frames of metrics hub events, and the JSON of /api/status,
 * /api/checkpoints and /api/logs. No HTTP here (http_dashboard.c serves it),
 * so the formats are testable without a socket.
 *
 * Event ids. Every hub event goes out as
 *
 *     id: EPOCH-SEQ
 *     event: step | state | checkpoint | reshard
 *     data: {"seq":SEQ,"run_id":R,"job":"...","kind":"step",...}
 *
 * where SEQ is the hub's sequence number and EPOCH names this daemon
 * process (hub numbers start again at 1 in the next one). A browser that
 * reconnects sends the last id it saw as Last-Event-ID; when its EPOCH is
 * ours the stream resumes at SEQ + 1, so across reconnects every event
 * arrives exactly once and in order, as long as it is still in the hub's
 * ring (otherwise a `gap` event says how many were lost). A foreign or
 * malformed id starts afresh, like a new page. `hello` (first on every
 * connection) and `gap` carry no id, so they never move the resume point.
 *
 * Step events hold the step metrics with the field names of the JSONL sink
 * (mt_metrics_to_json): one spelling of a metric across the project.
 */
#ifndef MT_DASH_JSON_H
#define MT_DASH_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "service/log_ring.h"
#include "service/metrics_hub.h"
#include "service/service.h"

#define DASH_EPOCH_CAP 32

/* 1 and *seq set when `header` (the Last-Event-ID value, or NULL) is
 * "EPOCH-SEQ" of this epoch; 0 otherwise (absent, foreign, malformed). */
int dash_parse_event_id(const char *header, const char *epoch, uint64_t *seq);

/* The frames, each a malloc'd string ending in a blank line (*len bytes).
 * `resumed`: the stream continues an earlier one (Last-Event-ID was ours);
 * `head`: the next seq the hub will assign. */
int dash_hello_frame(const char *epoch, int resumed, uint64_t head, char **out, size_t *len);
int dash_event_frame(const char *epoch, const hub_event *e, char **out, size_t *len);
/* `missed` events were lost; the stream goes on at seq `next`. */
int dash_gap_frame(uint64_t missed, uint64_t next, char **out, size_t *len);

/* Who may use the controls, as /api/status tells the page. */
typedef struct dash_access {
    const char *mode;   /* "token": the daemon has one; "loopback": it has none */
    int allowed;        /* this request could press the buttons */
    const char *why;    /* when not allowed: what is missing */
} dash_access;

/* GET /api/status: state, job, layout, progress, the last step's metrics,
 * every rank's last step ("rank_stats": rank, step, step_ms, compute_ms,
 * mem_in_use, mem_peak; "slowest_rank", null before the first step), the
 * last checkpoint, reshard progress, and `control` (dash_access). */
int dash_status_json(service *svc, const dash_access *acc, char **out, size_t *len);

/* GET /api/experts: the last step's per-expert loads and router bias, a
 * "latest only" snapshot (the hub's step events carry only each layer's
 * min / max / cv): {"run_id", "job", "step" (0: none yet), "experts" E,
 * "have_bias", "layers": [{"layer", "mean", "load": [E tokens],
 * "bias": [E] or null}]}. */
int dash_experts_json(service *svc, char **out, size_t *len);

/* GET /api/checkpoints: {"directory": ..., "checkpoints": [oldest first]}
 * of the current or last job. */
int dash_checkpoints_json(service *svc, char **out, size_t *len);

/* GET /api/logs?after=N: {"next": N', "lines": [{"seq","level","text"}]}. */
int dash_logs_json(log_ring *r, uint64_t after, char **out, size_t *len);

/* The JSON answer to a control command: {"ok": false, "error": msg} when
 * rc < 0; {"ok": true, "queued": true} when it is still waiting for the step
 * boundary (res NULL); else the step it took effect at, the state after it
 * and the checkpoint it saved, from res. */
int dash_command_json(const char *command, int rc, const char *msg, const ctl_result *res,
                      char **out, size_t *len);

#endif
