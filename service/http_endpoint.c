/* http_endpoint.c - see http_endpoint.h. */
#define _POSIX_C_SOURCE 200809L
#include "service/http_endpoint.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "service/http_dashboard.h"
#include "service/prom.h"

struct http_endpoint {
    struct MHD_Daemon *d;
    service *svc;
    http_dash dash;
};

int http_parse_addr(const char *listen, char *host, int host_cap, int *port)
{
    const char *colon;
    const char *h = listen;
    size_t hl;
    if (listen[0] == '[') {
        const char *close = strchr(listen, ']');
        if (!close || close[1] != ':') return MT_ERR(MT_EINVAL, "%s: expected [V6ADDR]:PORT", listen);
        h = listen + 1;
        hl = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(listen, ':');
        if (!colon) return MT_ERR(MT_EINVAL, "%s: expected HOST:PORT", listen);
        hl = (size_t)(colon - listen);
    }
    if (hl == 0 || hl >= (size_t)host_cap) return MT_ERR(MT_EINVAL, "%s: bad host", listen);
    memcpy(host, h, hl);
    host[hl] = '\0';
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (*end || end == colon + 1 || p < 0 || p > 65535)
        return MT_ERR(MT_EINVAL, "%s: bad port", listen);
    *port = (int)p;
    return MT_OK;
}

int addr_is_loopback(const char *host)
{
    struct in_addr a4;
    struct in6_addr a6;
    if (!strcmp(host, "localhost")) return 1;
    if (inet_pton(AF_INET, host, &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
    return 0;
}

/* The access handler: called first with *state NULL, then (a POST) with
 * each piece of the body, then with no more body: answered then. */
static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **state)
{
    (void)version;
    (void)upload;
    static int seen;
    http_endpoint *h = cls;
    int get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if (!get && strcmp(method, "POST")) return http_text(conn, 405, "GET or POST only\n");
    if (!*state) {
        *state = &seen;
        if (!get) return MHD_YES; /* the body (if any) comes next */
    }
    /* No request takes a body; acknowledge and ignore one. */
    if (*upload_size) {
        *upload_size = 0;
        return MHD_YES;
    }
    if (get && !strcmp(url, "/metrics")) {
        char *body;
        size_t len;
        if (prom_render(h->svc, &body, &len) < 0) return http_text(conn, 500, "out of memory\n");
        return http_reply(conn, 200, body, len, "text/plain; version=0.0.4; charset=utf-8");
    }
    if (get && !strcmp(url, "/healthz")) {
        if (service_serving(h->svc)) return http_text(conn, 200, "ok\n");
        return http_text(conn, 503, "draining\n");
    }
    int handled;
    enum MHD_Result r = http_dash_handle(&h->dash, conn, url, method, &handled);
    if (handled) return r;
    if (!get) return http_text(conn, 405, "POST only to /api/{pause,resume,save,stop}\n");
    return http_text(conn, 404, "not found: try /, /metrics, /healthz or /events\n");
}

int http_start(http_endpoint **out, const char *listen, service *svc, const auth *au, int *port)
{
    *out = NULL;
    char host[256];
    MT_CHECK(http_parse_addr(listen, host, sizeof host, port));
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    /* A thread per connection: an event stream, or a control call waiting
     * for its step boundary, blocks nobody else. */
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                     MHD_USE_ERROR_LOG;
    if (inet_pton(AF_INET, host, &((struct sockaddr_in *)&ss)->sin_addr) == 1) {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        a->sin_family = AF_INET;
        a->sin_port = htons((uint16_t)*port);
    } else if (inet_pton(AF_INET6, host, &((struct sockaddr_in6 *)&ss)->sin6_addr) == 1) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)*port);
        flags |= MHD_USE_IPv6;
    } else {
        return MT_ERR(MT_EINVAL, "--http %s: the host must be an IP address", listen);
    }
    http_endpoint *h = calloc(1, sizeof *h);
    if (!h) return MT_ERR(MT_ENOMEM, "http: out of memory");
    h->svc = svc;
    int rc = http_dash_init(&h->dash, svc, au);
    if (rc < 0) {
        free(h);
        return rc;
    }
    h->d = MHD_start_daemon(flags, (uint16_t)*port, NULL, NULL, handle, h, MHD_OPTION_SOCK_ADDR,
                            (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_TIMEOUT,
                            (unsigned)30, MHD_OPTION_CONNECTION_LIMIT,
                            (unsigned)HTTP_MAX_CONNECTIONS, MHD_OPTION_END);
    if (!h->d) {
        http_dash_cleanup(&h->dash);
        free(h);
        return MT_ERR(MT_EIO, "--http %s: cannot listen (in use, or not an address here)", listen);
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    if (info) *port = info->port;
    *out = h;
    return MT_OK;
}

void http_stop(http_endpoint *h)
{
    if (!h) return;
    /* Streams and waiting controls end at their next look (<= 50 ms), so
     * the connection threads MHD_stop_daemon joins do finish. */
    atomic_store(&h->dash.stopping, 1);
    MHD_stop_daemon(h->d);
    http_dash_cleanup(&h->dash);
    free(h);
}
