/* http_dashboard.c - see http_dashboard.h. Runs on libmicrohttpd's
 * thread-per-connection mode: an event stream or a control call waiting for
 * its step boundary blocks only its own connection's thread. */
#define _POSIX_C_SOURCE 200809L
#include "service/http_dashboard.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/mt_clock.h"
#include "base/mt_status.h"
#include "service/http_endpoint.h"
#include "service/web_assets.h"

/* The page loads nothing from elsewhere and runs no inline script. */
static const char page_csp[] = "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'";

static void nap_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR) {}
}

/* ---- setup ------------------------------------------------------------------------ */

/* A name for this process's hub numbering: random where /dev/urandom is,
 * else time and pid (two daemons in one microsecond with one pid: no). */
static void make_epoch(char *out, size_t cap)
{
    unsigned char b[6] = {0};
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    ssize_t got = fd >= 0 ? read(fd, b, sizeof b) : -1;
    if (fd >= 0) close(fd);
    if (got == (ssize_t)sizeof b) {
        snprintf(out, cap, "%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2], b[3], b[4], b[5]);
    } else {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        snprintf(out, cap, "%lx%05lx%lx", (unsigned long)t.tv_sec,
                 (unsigned long)(t.tv_nsec / 1000) & 0xfffff, (unsigned long)getpid());
    }
}

int http_dash_init(http_dash *d, service *svc, const auth *au)
{
    memset(d, 0, sizeof *d);
    d->svc = svc;
    d->auth = au && au->enabled ? au : NULL;
    atomic_init(&d->stopping, 0);
    make_epoch(d->epoch, sizeof d->epoch);
    MT_CHECK(log_ring_create(&d->logs));
    log_ring_attach(d->logs);
    return MT_OK;
}

void http_dash_cleanup(http_dash *d)
{
    log_ring_destroy(d->logs); /* detaches the log tap first */
    d->logs = NULL;
}

/* ---- replies ------------------------------------------------------------------------ */

enum MHD_Result http_reply(struct MHD_Connection *conn, unsigned code, char *body, size_t len,
                           const char *type)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (code == 401) MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    enum MHD_Result ok = MHD_queue_response(conn, code, r);
    MHD_destroy_response(r);
    return ok;
}

enum MHD_Result http_text(struct MHD_Connection *conn, unsigned code, const char *s)
{
    char *body = strdup(s);
    if (!body) return MHD_NO;
    return http_reply(conn, code, body, strlen(body), "text/plain; charset=utf-8");
}

static enum MHD_Result json_reply(struct MHD_Connection *conn, unsigned code, int rc, char *body,
                                  size_t len)
{
    if (rc < 0) return http_text(conn, 500, mt_errmsg());
    return http_reply(conn, code, body, len, "application/json");
}

/* ---- who may press the buttons ------------------------------------------------------- */

static const char *header(struct MHD_Connection *conn, const char *name)
{
    return MHD_lookup_connection_value(conn, MHD_HEADER_KIND, name);
}

static int client_is_loopback(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (!ci || !ci->client_addr) return 0;
    const struct sockaddr *sa = ci->client_addr;
    if (sa->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a)) return 1;
        return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
    }
    return 0;
}

/* The Host header names a loopback address ("127.0.0.1:8080", "[::1]:80",
 * "localhost"). */
static int host_is_loopback(const char *host)
{
    if (!host) return 0;
    char h[256];
    size_t n;
    if (host[0] == '[') {
        const char *close = strchr(host, ']');
        if (!close) return 0;
        n = (size_t)(close - host - 1);
        host++;
    } else {
        const char *colon = strchr(host, ':');
        n = colon ? (size_t)(colon - host) : strlen(host);
    }
    if (n == 0 || n >= sizeof h) return 0;
    memcpy(h, host, n);
    h[n] = '\0';
    return addr_is_loopback(h);
}

/* Whether this request may use the controls (everything but the
 * X-Moetrain-Control header, which only a POST needs); *code is the HTTP
 * status to refuse with. */
static void access_of(http_dash *d, struct MHD_Connection *conn, dash_access *acc,
                      unsigned *code)
{
    acc->mode = d->auth ? "token" : "loopback";
    acc->allowed = 0;
    *code = 403;
    const char *origin = header(conn, "Origin");
    const char *host = header(conn, MHD_HTTP_HEADER_HOST);
    if (origin) {
        /* The page's own origin is http://HOST (the endpoint has no TLS). */
        static const char scheme[] = "http://";
        if (!host || strncasecmp(origin, scheme, sizeof scheme - 1) ||
            strcasecmp(origin + sizeof scheme - 1, host)) {
            acc->why = "the request comes from a page of another origin";
            return;
        }
    }
    if (d->auth) {
        const char *a = header(conn, MHD_HTTP_HEADER_AUTHORIZATION);
        if (!auth_check(d->auth, a, a ? strlen(a) : 0)) {
            acc->why = a ? "wrong token" : "the daemon has a token: enter it to use the controls";
            *code = 401;
            return;
        }
    } else if (!client_is_loopback(conn) || !host_is_loopback(host)) {
        acc->why = "the daemon has no token: only a loopback client (and Host) may use the "
                   "controls; start moetraind with --token-file to allow others";
        return;
    }
    acc->allowed = 1;
    acc->why = "";
    *code = 200;
}

/* ---- static files -------------------------------------------------------------------- */

const web_asset *web_asset_find(const char *url)
{
    if (!strcmp(url, "/index.html")) url = "/";
    for (int i = 0; i < web_assets_n; i++)
        if (!strcmp(web_assets[i].url, url)) return &web_assets[i];
    return NULL;
}

static enum MHD_Result asset(struct MHD_Connection *conn, const web_asset *a)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(a->len, (void *)a->data, MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, a->type);
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    /* The files change with the binary: revalidate rather than cache. */
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    if (!strcmp(a->url, "/")) {
        MHD_add_response_header(r, "Content-Security-Policy", page_csp);
        MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
    }
    enum MHD_Result ok = MHD_queue_response(conn, 200, r);
    MHD_destroy_response(r);
    return ok;
}

/* ---- /events ------------------------------------------------------------------------- */

typedef struct sse {
    http_dash *d;
    uint64_t cursor;       /* next hub seq to send */
    uint64_t run0;         /* the job current when the stream began */
    int64_t from_step;     /* step events of run0 below this are skipped */
    char *pend;            /* a frame being written out */
    size_t pend_len, pend_off;
    double last_write;
    hub_event ev;
} sse;

static void sse_free(void *cls)
{
    sse *s = cls;
    free(s->pend);
    free(s);
}

static void sse_pend(sse *s, char *frame, size_t len)
{
    s->pend = frame;
    s->pend_len = len;
    s->pend_off = 0;
}

/* MHD asks for up to `max` bytes; this blocks (its own thread) until there
 * is at least one byte: events, a gap notice, or a keep-alive comment that
 * also finds out when the browser has gone. */
static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    sse *s = cls;
    metrics_hub *hub = s->d->svc->hub;
    size_t n = 0;
    for (;;) {
        if (s->pend) {
            size_t k = s->pend_len - s->pend_off;
            if (k > max - n) k = max - n;
            memcpy(buf + n, s->pend + s->pend_off, k);
            n += k;
            s->pend_off += k;
            if (s->pend_off == s->pend_len) {
                free(s->pend);
                s->pend = NULL;
            }
            if (n == max) break;
            continue;
        }
        if (atomic_load(&s->d->stopping)) break;
        uint64_t missed;
        int r = hub_read(hub, &s->cursor, &s->ev, &missed);
        char *f = NULL;
        size_t fl = 0;
        if (missed) {
            if (r == 1) s->cursor--; /* the event read comes after the notice */
            hub_count_missed(hub, missed);
            if (dash_gap_frame(missed, s->cursor, &f, &fl) < 0) return MHD_CONTENT_READER_END_WITH_ERROR;
            sse_pend(s, f, fl);
            continue;
        }
        if (r == 1) {
            if (s->ev.kind == HUB_STEP && s->ev.run_id == s->run0 &&
                s->ev.u.step.step < s->from_step)
                continue;
            if (dash_event_frame(s->d->epoch, &s->ev, &f, &fl) < 0)
                return MHD_CONTENT_READER_END_WITH_ERROR;
            sse_pend(s, f, fl);
            continue;
        }
        if (n) break;
        if (r < 0) break; /* the hub is closed: the daemon is going down */
        if (mt_now_s() - s->last_write >= HTTP_DASH_KEEPALIVE_S) {
            char *k = strdup(": keep-alive\n\n");
            if (!k) return MHD_CONTENT_READER_END_WITH_ERROR;
            sse_pend(s, k, strlen(k));
            continue;
        }
        nap_ms(50);
    }
    if (!n) return MHD_CONTENT_READER_END_OF_STREAM;
    s->last_write = mt_now_s();
    return (ssize_t)n;
}

static enum MHD_Result events(http_dash *d, struct MHD_Connection *conn)
{
    const char *fs = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "from_step");
    int64_t from_step = 0;
    if (fs) {
        char *end;
        errno = 0;
        long long v = strtoll(fs, &end, 10);
        if (!*fs || *end || errno || v < 0)
            return http_text(conn, 400, "from_step: expected a step number >= 0\n");
        from_step = v;
    }
    sse *s = calloc(1, sizeof *s);
    if (!s) return http_text(conn, 503, "out of memory\n");
    s->d = d;
    s->from_step = from_step;
    s->last_write = mt_now_s();
    metrics_hub *hub = d->svc->hub;
    s->cursor = hub_cursor_start(hub, 0, &s->run0);
    uint64_t seq, head = hub_head(hub);
    /* The browser sends the header when it reconnects by itself; a page that
     * had to open a new EventSource passes the id as ?last_event_id=. */
    const char *last = header(conn, "Last-Event-ID");
    if (!last) last = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "last_event_id");
    int resumed = dash_parse_event_id(last, d->epoch, &seq);
    if (resumed) s->cursor = seq + 1 < head ? seq + 1 : head;
    char *f;
    size_t fl;
    if (dash_hello_frame(d->epoch, resumed, head, &f, &fl) < 0) {
        free(s);
        return http_text(conn, 503, "out of memory\n");
    }
    sse_pend(s, f, fl);
    struct MHD_Response *r =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 64 * 1024, sse_read, s, sse_free);
    if (!r) {
        sse_free(s);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream; charset=utf-8");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    MHD_add_response_header(r, "X-Accel-Buffering", "no"); /* a proxy must not hold it back */
    /* No idle timeout for a stream: it is quiet between events by nature
     * (a paused job), and the keep-alive comments find a browser that has
     * gone. The endpoint's timeout would cut it after a quiet spell. */
    MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    enum MHD_Result ok = MHD_queue_response(conn, 200, r);
    MHD_destroy_response(r);
    return ok;
}

/* ---- the controls ------------------------------------------------------------------- */

static unsigned http_code_of(int rc)
{
    switch (rc) {
    case MT_ESTATE: return 409;
    case MT_EINVAL: return 400;
    case MT_ENOTFOUND: return 404;
    case MT_EINTR: return 503;
    case MT_ENOTSUP: return 501;
    default: return 500;
    }
}

static enum MHD_Result command(http_dash *d, struct MHD_Connection *conn, const char *name)
{
    static const struct {
        const char *name;
        ctl_kind kind;
    } cmds[] = {{"pause", CTL_PAUSE}, {"resume", CTL_RESUME}, {"save", CTL_SAVE}, {"stop", CTL_STOP}};
    int k = -1;
    for (int i = 0; i < (int)(sizeof cmds / sizeof cmds[0]); i++)
        if (!strcmp(name, cmds[i].name)) k = i;
    if (k < 0) return http_text(conn, 404, "no such control: try pause, resume, save or stop\n");
    const char *x = header(conn, "X-Moetrain-Control");
    if (!x || strcmp(x, "1"))
        return http_text(conn, 403, "a control request needs the header X-Moetrain-Control: 1\n");
    dash_access acc;
    unsigned code;
    access_of(d, conn, &acc, &code);
    if (!acc.allowed) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s\n", acc.why);
        return http_text(conn, code, msg);
    }
    int save = 0;
    if (cmds[k].kind == CTL_STOP) {
        const char *sv = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "save");
        save = sv && (!strcmp(sv, "1") || !strcmp(sv, "true"));
    }
    char *body = NULL;
    size_t len = 0;
    ctl_ticket *t;
    int rc = control_command(d->svc->ctl, cmds[k].kind, save, &t);
    if (rc < 0) {
        unsigned c = http_code_of(rc);
        rc = dash_command_json(name, rc, mt_errmsg(), NULL, &body, &len);
        return json_reply(conn, c, rc, body, len);
    }
    /* Wait for the step boundary (a save may take a while on a big model). */
    double deadline = mt_now_s() + HTTP_DASH_WAIT_S;
    ctl_result res;
    while (!control_ticket_poll(t, &res)) {
        if (atomic_load(&d->stopping) || mt_now_s() > deadline) {
            control_ticket_drop(t);
            rc = dash_command_json(name, 0, NULL, NULL, &body, &len);
            return json_reply(conn, 202, rc, body, len);
        }
        nap_ms(20);
    }
    unsigned c = res.rc < 0 ? http_code_of(res.rc) : 200;
    rc = dash_command_json(name, res.rc, res.msg, &res, &body, &len);
    return json_reply(conn, c, rc, body, len);
}

/* ---- routing ------------------------------------------------------------------------ */

enum MHD_Result http_dash_handle(http_dash *d, struct MHD_Connection *conn, const char *url,
                                 const char *method, int *handled)
{
    *handled = 1;
    int post = !strcmp(method, "POST");
    if (!strncmp(url, "/api/", 5) && post) return command(d, conn, url + 5);
    if (post) {
        *handled = 0;
        return MHD_NO;
    }
    char *body = NULL;
    size_t len = 0;
    if (!strcmp(url, "/events")) return events(d, conn);
    if (!strcmp(url, "/api/status")) {
        dash_access acc;
        unsigned code;
        access_of(d, conn, &acc, &code);
        int rc = dash_status_json(d->svc, &acc, &body, &len);
        return json_reply(conn, 200, rc, body, len);
    }
    if (!strcmp(url, "/api/experts")) {
        int rc = dash_experts_json(d->svc, &body, &len);
        return json_reply(conn, 200, rc, body, len);
    }
    if (!strcmp(url, "/api/checkpoints")) {
        int rc = dash_checkpoints_json(d->svc, &body, &len);
        if (rc == MT_ENOTFOUND || rc == MT_EINVAL) return http_text(conn, 404, mt_errmsg());
        return json_reply(conn, 200, rc, body, len);
    }
    if (!strcmp(url, "/api/logs")) {
        const char *a = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "after");
        uint64_t after = a ? strtoull(a, NULL, 10) : 0;
        int rc = dash_logs_json(d->logs, after, &body, &len);
        return json_reply(conn, 200, rc, body, len);
    }
    const web_asset *a = web_asset_find(url);
    if (a) return asset(conn, a);
    *handled = 0;
    return MHD_NO;
}
