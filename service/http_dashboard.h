/* http_dashboard.h - the web dashboard on rank 0's HTTP endpoint (internal
 * to http_endpoint.c, which routes to it):
 *
 *   GET  /                  the page (service/web/, compiled in)
 *   GET  /assets/NAME       its script, style sheet and uPlot
 *   GET  /events            Server-Sent Events of the metrics hub
 *                           (dash_json.h: ids, resume by Last-Event-ID or
 *                           ?last_event_id=; ?from_step=N skips earlier
 *                           steps of the job, like StreamMetrics' from_step)
 *   GET  /api/status        job state, layout, progress, last metrics,
 *                           every rank's last step (rank_stats, the slowest
 *                           rank), and whether this caller may use the controls
 *   GET  /api/checkpoints   the job's checkpoints (with save times, verify)
 *   GET  /api/experts       the last step's tokens per expert and router
 *                           bias of every MoE layer (the layer x expert map)
 *   GET  /api/logs?after=N  recent log lines of rank 0
 *   POST /api/pause | /api/resume | /api/save | /api/stop[?save=1]
 *
 * The POSTs are guarded like the gRPC mutating calls: with a token
 * (moetraind --token-file) they need "Authorization: Bearer <token>" (a
 * header: the page never puts the token in a URL); without one only a
 * loopback client naming a loopback Host may use them. Either way they need
 * "X-Moetrain-Control: 1" and, when the browser sends an Origin, the page's
 * own origin: a page of another site cannot send that header without a
 * CORS preflight, which is never granted, so it cannot drive a daemon
 * through a browser on the same machine (nor by DNS rebinding, which the
 * Host check stops).
 *
 * A POST answers when the command took effect at a step boundary (the JSON
 * of dash_command_json), or 202 with "queued" when that takes longer than
 * HTTP_DASH_WAIT_S.
 */
#ifndef MT_HTTP_DASHBOARD_H
#define MT_HTTP_DASHBOARD_H

#include <microhttpd.h>
#include <stdatomic.h>

#include "service/auth.h"
#include "service/dash_json.h"
#include "service/log_ring.h"
#include "service/service.h"

#define HTTP_DASH_WAIT_S 600.0
#define HTTP_DASH_KEEPALIVE_S 15.0 /* an SSE comment this often while idle */

typedef struct http_dash {
    service *svc;
    const auth *auth;        /* may be NULL: no token */
    log_ring *logs;
    char epoch[DASH_EPOCH_CAP];
    atomic_int stopping;     /* set first by http_stop: streams and waits end */
} http_dash;

int http_dash_init(http_dash *d, service *svc, const auth *au);
void http_dash_cleanup(http_dash *d);

/* Answers `url` if it is one of the dashboard's; MHD_NO with *handled 0
 * when it is not (the caller answers). `method` is GET, HEAD or POST. */
enum MHD_Result http_dash_handle(http_dash *d, struct MHD_Connection *conn, const char *url,
                                 const char *method, int *handled);

/* Helpers http_endpoint.c shares. */
enum MHD_Result http_reply(struct MHD_Connection *conn, unsigned code, char *body, size_t len,
                           const char *type);
enum MHD_Result http_text(struct MHD_Connection *conn, unsigned code, const char *s);

#endif
