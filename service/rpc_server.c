/* rpc_server.c - see rpc_server.h.
 *
 * One thread owns the completion queue and every call on it, so the call
 * state machines need no locks: grpc_call_start_batch is only ever called
 * from that thread. Each call has at most one receive batch, one send batch
 * and the close batch (RECV_CLOSE_ON_SERVER, which completes when the call
 * is over, with `cancelled` set if the client went away) in flight; a call
 * is freed once all three are done. Streams whose source has nothing to send
 * are polled every POLL_MS.
 */
#define _POSIX_C_SOURCE 200809L
#include "service/rpc_server.h"

#include <errno.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/status.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/mt_clock.h"
#include "base/mt_log.h"
#include "base/mt_status.h"

#define POLL_MS 5

_Static_assert((int)RPC_UNAUTHENTICATED == (int)GRPC_STATUS_UNAUTHENTICATED &&
                   (int)RPC_FAILED_PRECONDITION == (int)GRPC_STATUS_FAILED_PRECONDITION &&
                   (int)RPC_INVALID_ARGUMENT == (int)GRPC_STATUS_INVALID_ARGUMENT &&
                   (int)RPC_UNAVAILABLE == (int)GRPC_STATUS_UNAVAILABLE,
               "rpc_code must use gRPC's numbers");

typedef enum { TAG_NEW, TAG_RECV, TAG_SEND, TAG_CLOSE, TAG_SHUTDOWN } tag_kind;

struct call;
typedef struct tag {
    tag_kind kind;
    struct call *c;
} tag;

typedef struct call {
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
    const rpc_method *m;
    rpc_stream *src;
    grpc_byte_buffer *recv_buf;
    grpc_byte_buffer *send_buf;
    grpc_slice status_details;
    int has_status_details;
    int cancelled;       /* written by the close batch */
    int refs;            /* batches in flight */
    int close_done, md_sent, send_busy, finished, dead;
    int n_recv;          /* messages received (bidi: first creates the stream) */
    tag t_new, t_recv, t_send, t_close;
    struct call *prev, *next;
} call;

struct rpc_server {
    grpc_server *server;
    grpc_completion_queue *cq;
    pthread_t thread;
    service *svc;
    const auth *auth;
    call *calls;         /* every accepted call not yet freed */
    call *incoming;      /* the slot of the outstanding request_call */
    tag t_shutdown;
    atomic_int stop;     /* set by rpc_server_stop */
    double grace_s;
    double drain_start;
    int draining, shutdown_done, cancelled_all, cq_shut;
};

/* ---- call bookkeeping --------------------------------------------------------------- */

static call *call_new(void)
{
    call *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    grpc_call_details_init(&c->details);
    grpc_metadata_array_init(&c->md);
    c->t_new = (tag){TAG_NEW, c};
    c->t_recv = (tag){TAG_RECV, c};
    c->t_send = (tag){TAG_SEND, c};
    c->t_close = (tag){TAG_CLOSE, c};
    return c;
}

static void call_free(rpc_server *s, call *c)
{
    if (c->prev) c->prev->next = c->next;
    else if (s->calls == c) s->calls = c->next;
    if (c->next) c->next->prev = c->prev;
    if (c->src) c->src->close(c->src);
    if (c->recv_buf) grpc_byte_buffer_destroy(c->recv_buf);
    if (c->send_buf) grpc_byte_buffer_destroy(c->send_buf);
    if (c->has_status_details) grpc_slice_unref(c->status_details);
    grpc_call_details_destroy(&c->details);
    grpc_metadata_array_destroy(&c->md);
    if (c->call) grpc_call_unref(c->call);
    free(c);
}

/* Frees the call once nothing is in flight and it is over. */
static void maybe_free(rpc_server *s, call *c)
{
    if (c->refs == 0 && c->close_done && (c->finished || c->dead)) call_free(s, c);
}

static int request_next_call(rpc_server *s)
{
    call *c = call_new();
    if (!c) return MT_ERR(MT_ENOMEM, "rpc server: out of memory");
    grpc_call_error e = grpc_server_request_call(s->server, &c->call, &c->details, &c->md, s->cq,
                                                 s->cq, &c->t_new);
    if (e != GRPC_CALL_OK) {
        call_free(s, c);
        return MT_ERR(MT_EGRPC, "grpc_server_request_call: %s", grpc_call_error_to_string(e));
    }
    s->incoming = c;
    return MT_OK;
}

/* ---- sending -------------------------------------------------------------------------- */

static grpc_byte_buffer *to_buffer(const uint8_t *msg, size_t len)
{
    grpc_slice sl = grpc_slice_from_copied_buffer((const char *)msg, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    return bb;
}

static void start_batch(rpc_server *s, call *c, const grpc_op *ops, size_t n, tag *t)
{
    (void)s;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, t, NULL);
    if (e != GRPC_CALL_OK) {
        /* Only a bug of ours gets here (two sends at once, ...): give up on
         * the call rather than the daemon. */
        MT_LOGE("rpc: grpc_call_start_batch: %s", grpc_call_error_to_string(e));
        c->dead = 1;
        grpc_call_cancel(c->call, NULL);
        return;
    }
    c->refs++;
}

static void send_message(rpc_server *s, call *c, rpc_reply *r)
{
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof ops);
    if (!c->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        c->md_sent = 1;
    }
    c->send_buf = to_buffer(r->msg, r->len);
    free(r->msg);
    r->msg = NULL;
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = c->send_buf;
    n++;
    c->send_busy = 1;
    start_batch(s, c, ops, n, &c->t_send);
}

/* Sends the final status (with a last message when r->msg is set). */
static void finish(rpc_server *s, call *c, rpc_reply *r)
{
    if (c->finished || c->dead) {
        free(r->msg);
        r->msg = NULL;
        return;
    }
    grpc_op ops[3];
    size_t n = 0;
    memset(ops, 0, sizeof ops);
    if (!c->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        c->md_sent = 1;
    }
    if (r->msg && r->code == RPC_OK) {
        c->send_buf = to_buffer(r->msg, r->len);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->send_buf;
        n++;
    }
    free(r->msg);
    r->msg = NULL;
    c->status_details = grpc_slice_from_copied_string(r->code == RPC_OK ? "" : r->detail);
    c->has_status_details = 1;
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)r->code;
    ops[n].data.send_status_from_server.status_details = &c->status_details;
    n++;
    c->finished = 1;
    c->send_busy = 1;
    service_count_call(s->svc, c->m, r->code);
    if (r->code != RPC_OK && r->code != RPC_CANCELLED)
        MT_LOGD("rpc %s: %s: %s", c->m ? c->m->path : "?", rpc_code_name(r->code), r->detail);
    start_batch(s, c, ops, n, &c->t_send);
}

static void finish_code(rpc_server *s, call *c, int code, const char *detail)
{
    rpc_reply r;
    memset(&r, 0, sizeof r);
    r.code = code;
    snprintf(r.detail, sizeof r.detail, "%s", detail);
    finish(s, c, &r);
}

/* Asks the call's source for more, if it can send now. */
static void pump(rpc_server *s, call *c)
{
    if (!c->src || c->dead || c->finished || c->send_busy) return;
    if (c->m->kind == RPC_BIDI_STREAMING) return; /* answers come from recv */
    rpc_reply r;
    memset(&r, 0, sizeof r);
    int k = c->src->next(c->src, &r);
    if (k == RPC_MORE) {
        if (r.msg) send_message(s, c, &r);
    } else if (k == RPC_END) {
        finish(s, c, &r);
    }
}

/* ---- receiving ------------------------------------------------------------------------ */

static void start_recv(rpc_server *s, call *c)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_buf;
    start_batch(s, c, &op, 1, &c->t_recv);
}

/* The received message as one contiguous slice; 0 if it cannot be read
 * (e.g. a compression the core cannot undo). */
static int read_buffer(grpc_byte_buffer *bb, grpc_slice *out)
{
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, bb)) return 0;
    *out = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    return 1;
}

static void on_message(rpc_server *s, call *c, grpc_byte_buffer *bb)
{
    rpc_reply r;
    memset(&r, 0, sizeof r);
    grpc_slice sl;
    if (!read_buffer(bb, &sl)) {
        finish_code(s, c, RPC_INVALID_ARGUMENT, "the request message cannot be read");
        return;
    }
    ProtobufCMessage *req = NULL;
    int code = rpc_decode(c->m, GRPC_SLICE_START_PTR(sl), GRPC_SLICE_LENGTH(sl), &req, &r);
    grpc_slice_unref(sl);
    if (code != RPC_OK) {
        finish(s, c, &r);
        return;
    }
    c->n_recv++;
    if (c->m->kind == RPC_BIDI_STREAMING) {
        if (!c->src) c->src = c->m->handle(s->svc, NULL, &r);
        if (!c->src) {
            finish(s, c, &r);
        } else if (c->src->recv(c->src, req, &r) != RPC_OK || !r.msg) {
            finish(s, c, &r);
        } else {
            send_message(s, c, &r); /* the next receive starts when it is sent */
        }
    } else {
        c->src = c->m->handle(s->svc, req, &r);
        if (!c->src) finish(s, c, &r);
        else pump(s, c);
    }
    protobuf_c_message_free_unpacked(req, NULL);
}

/* The authorization metadata value, or NULL. */
static const grpc_slice *find_md(const grpc_metadata_array *md, const char *key)
{
    size_t kl = strlen(key);
    for (size_t i = 0; i < md->count; i++) {
        const grpc_slice *k = &md->metadata[i].key;
        if (GRPC_SLICE_LENGTH(*k) == kl && !memcmp(GRPC_SLICE_START_PTR(*k), key, kl))
            return &md->metadata[i].value;
    }
    return NULL;
}

static void on_new_call(rpc_server *s, call *c)
{
    c->next = s->calls;
    if (s->calls) s->calls->prev = c;
    s->calls = c;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->cancelled;
    start_batch(s, c, &op, 1, &c->t_close);
    if (c->dead) return;

    const char *path = (const char *)GRPC_SLICE_START_PTR(c->details.method);
    size_t plen = GRPC_SLICE_LENGTH(c->details.method);
    c->m = rpc_method_find(path, plen);
    if (!c->m) {
        char d[300];
        snprintf(d, sizeof d, "unknown method %.*s", (int)(plen < 200 ? plen : 200), path);
        finish_code(s, c, RPC_UNIMPLEMENTED, d);
        return;
    }
    if (c->m->mutating && s->auth && s->auth->enabled) {
        const grpc_slice *v = find_md(&c->md, "authorization");
        if (!v || !auth_check(s->auth, (const char *)GRPC_SLICE_START_PTR(*v),
                              GRPC_SLICE_LENGTH(*v))) {
            finish_code(s, c, RPC_UNAUTHENTICATED,
                        v ? "wrong token" : "this call needs the metadata 'authorization: "
                                            "Bearer <token>' (moetraind --token-file)");
            return;
        }
    }
    if (s->draining) {
        finish_code(s, c, RPC_UNAVAILABLE, "the daemon is shutting down");
        return;
    }
    start_recv(s, c);
}

/* ---- the completion queue thread --------------------------------------------------------- */

static void on_event(rpc_server *s, const grpc_event *ev)
{
    tag *t = ev->tag;
    if (t->kind == TAG_SHUTDOWN) {
        s->shutdown_done = 1;
        return;
    }
    call *c = t->c;
    switch (t->kind) {
    case TAG_NEW:
        s->incoming = NULL;
        if (!ev->success) { /* the server is shutting down */
            call_free(s, c);
            return;
        }
        if (!s->draining && request_next_call(s) < 0) MT_LOGE("rpc: %s", mt_errmsg());
        on_new_call(s, c);
        break;
    case TAG_RECV: {
        c->refs--;
        grpc_byte_buffer *bb = c->recv_buf;
        c->recv_buf = NULL;
        if (c->finished || c->dead || !ev->success) {
            if (bb) grpc_byte_buffer_destroy(bb);
        } else if (!bb) {
            /* The client closed its side: fine for a bidi stream after its
             * requests, an error for a call that needs a request. */
            if (c->m->kind == RPC_BIDI_STREAMING)
                finish_code(s, c, RPC_OK, "");
            else
                finish_code(s, c, RPC_INVALID_ARGUMENT, "no request message");
        } else {
            on_message(s, c, bb);
            grpc_byte_buffer_destroy(bb);
        }
        break;
    }
    case TAG_SEND:
        c->refs--;
        c->send_busy = 0;
        if (c->send_buf) {
            grpc_byte_buffer_destroy(c->send_buf);
            c->send_buf = NULL;
        }
        if (!ev->success) {
            c->dead = 1;
        } else if (!c->finished) {
            if (c->m->kind == RPC_BIDI_STREAMING) start_recv(s, c);
            else pump(s, c);
        }
        break;
    case TAG_CLOSE:
        c->refs--;
        c->close_done = 1;
        if (c->cancelled && !c->finished) {
            c->dead = 1;
            if (c->m) service_count_call(s->svc, c->m, RPC_CANCELLED);
        }
        break;
    default: break;
    }
    maybe_free(s, c);
}

static void poll_streams(rpc_server *s)
{
    for (call *c = s->calls, *next; c; c = next) {
        next = c->next;
        pump(s, c);
        maybe_free(s, c); /* pump may have found the call dead */
    }
}

static void drain_step(rpc_server *s)
{
    if (!s->draining) {
        s->draining = 1;
        s->drain_start = mt_now_s();
        grpc_server_shutdown_and_notify(s->server, s->cq, &s->t_shutdown);
    }
    if (!s->cancelled_all && s->calls && mt_now_s() - s->drain_start > s->grace_s) {
        MT_LOGW("rpc: cancelling the calls still open after %.1f s", s->grace_s);
        grpc_server_cancel_all_calls(s->server);
        s->cancelled_all = 1;
    }
    if (s->shutdown_done && !s->calls && !s->cq_shut) {
        grpc_completion_queue_shutdown(s->cq);
        s->cq_shut = 1;
    }
}

static void *cq_thread(void *arg)
{
    rpc_server *s = arg;
    double last_poll = 0;
    for (;;) {
        gpr_timespec dl = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                       gpr_time_from_millis(POLL_MS, GPR_TIMESPAN));
        grpc_event ev = grpc_completion_queue_next(s->cq, dl, NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type == GRPC_OP_COMPLETE) on_event(s, &ev);
        double t = mt_now_s();
        if (ev.type == GRPC_QUEUE_TIMEOUT || t - last_poll >= POLL_MS * 1e-3) {
            poll_streams(s);
            last_poll = t;
        }
        if (atomic_load(&s->stop)) drain_step(s);
    }
    return NULL;
}

/* ---- start / stop --------------------------------------------------------------------- */

static int read_file(const char *path, char **out)
{
    FILE *f = fopen(path, "rb");
    if (!f) return MT_ERR(MT_EIO, "%s: %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (!buf) {
            fclose(f);
            return MT_ERR(MT_ENOMEM, "%s: out of memory", path);
        }
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1) break;
        cap *= 2;
        char *nb = realloc(buf, cap);
        if (!nb) free(buf);
        buf = nb;
    }
    fclose(f);
    buf[n] = '\0';
    *out = buf;
    return MT_OK;
}

static grpc_server_credentials *make_creds(const rpc_server_opts *o, int *rc)
{
    *rc = MT_OK;
    if (!o->tls_cert && !o->tls_key) return grpc_insecure_server_credentials_create();
    if (!o->tls_cert || !o->tls_key) {
        *rc = MT_ERR(MT_EINVAL, "TLS needs both --tls-cert and --tls-key");
        return NULL;
    }
    char *cert = NULL, *key = NULL;
    if ((*rc = read_file(o->tls_cert, &cert)) < 0) return NULL;
    if ((*rc = read_file(o->tls_key, &key)) < 0) {
        free(cert);
        return NULL;
    }
    grpc_ssl_pem_key_cert_pair pair = {key, cert};
    grpc_server_credentials *cr = grpc_ssl_server_credentials_create(NULL, &pair, 1, 0, NULL);
    free(cert);
    free(key);
    if (!cr) *rc = MT_ERR(MT_EINVAL, "TLS: cannot use %s / %s", o->tls_cert, o->tls_key);
    return cr;
}

int rpc_server_start(rpc_server **out, const rpc_server_opts *o, int *port)
{
    *out = NULL;
    rpc_server *s = calloc(1, sizeof *s);
    if (!s) return MT_ERR(MT_ENOMEM, "rpc server: out of memory");
    s->svc = o->svc;
    s->auth = o->auth;
    s->t_shutdown = (tag){TAG_SHUTDOWN, NULL};
    atomic_init(&s->stop, 0);
    int rc;
    grpc_init();
    grpc_server_credentials *cr = make_creds(o, &rc);
    if (!cr) {
        grpc_shutdown();
        free(s);
        return rc;
    }
    s->cq = grpc_completion_queue_create_for_next(NULL);
    s->server = grpc_server_create(NULL, NULL);
    grpc_server_register_completion_queue(s->server, s->cq, NULL);
    *port = grpc_server_add_http2_port(s->server, o->listen, cr);
    grpc_server_credentials_release(cr);
    if (*port <= 0) {
        rc = MT_ERR(MT_EGRPC, "cannot listen on %s (in use, or not an address here)", o->listen);
        goto fail;
    }
    grpc_server_start(s->server);
    MT_GOTO(request_next_call(s), fail);
    if (pthread_create(&s->thread, NULL, cq_thread, s) != 0) {
        rc = MT_ERR(MT_EGENERIC, "rpc server: cannot start its thread");
        goto fail;
    }
    *out = s;
    return MT_OK;
fail:
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->t_shutdown);
    grpc_server_cancel_all_calls(s->server);
    grpc_completion_queue_shutdown(s->cq);
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        tag *t = ev.tag;
        if (t && t->kind == TAG_NEW) call_free(s, t->c);
    }
    grpc_server_destroy(s->server);
    grpc_completion_queue_destroy(s->cq);
    grpc_shutdown();
    free(s);
    return rc;
}

void rpc_server_stop(rpc_server *s, double grace_s)
{
    if (!s) return;
    s->grace_s = grace_s;
    atomic_store(&s->stop, 1);
    pthread_join(s->thread, NULL);
    grpc_server_destroy(s->server);
    grpc_completion_queue_destroy(s->cq);
    grpc_shutdown();
    free(s);
}
