/* http_endpoint.h - rank 0's HTTP endpoint (libmicrohttpd, a thread per
 * connection, at most HTTP_MAX_CONNECTIONS):
 *
 *   GET /metrics   Prometheus text format (prom.h)
 *   GET /healthz   200 "ok" while serving, 503 while draining
 *   the web dashboard: GET /, /assets/..., /events, /api/..., and the
 *   controls POST /api/{pause,resume,save,stop} (http_dashboard.h)
 */
#ifndef MT_HTTP_ENDPOINT_H
#define MT_HTTP_ENDPOINT_H

#include "service/auth.h"
#include "service/service.h"

#define HTTP_MAX_CONNECTIONS 64

typedef struct http_endpoint http_endpoint;

/* `listen` is "HOST:PORT" with an IPv4 or IPv6 ("[::1]:9100") address;
 * port 0 picks a free one, returned in *port. `au` (may be NULL: no token)
 * guards the dashboard's controls like the gRPC mutating calls. */
int http_start(http_endpoint **out, const char *listen, service *svc, const auth *au, int *port);
void http_stop(http_endpoint *h);

/* Splits "HOST:PORT" / "[V6]:PORT"; 1 if the host is a loopback address. */
int http_parse_addr(const char *listen, char *host, int host_cap, int *port);
int addr_is_loopback(const char *host);

#endif
