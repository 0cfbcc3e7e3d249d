/* rpc_client.c - see rpc_client.h. Each call has its own pluck completion
 * queue, so a call is one blocking function with explicit batches. */
#define _POSIX_C_SOURCE 200809L
#include "base/mt_fs.h"
#include "service/rpc_client.h"

#include <errno.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/status.h>
#include <grpc/support/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

struct rpc_client {
    grpc_channel *ch;
    char auth[600];           /* "Bearer <token>" or "" */
};

struct rpc_client_stream {
    rpc_client *c;
    grpc_completion_queue *cq;
    grpc_call *call;
    grpc_metadata_array md_initial, md_trailing;
    grpc_status_code status;
    grpc_slice details;
    grpc_byte_buffer *send_buf;
    int status_done;
    int tag_start, tag_status, tag_recv;
};


int rpc_client_open(rpc_client **out, const rpc_client_opts *o)
{
    *out = NULL;
    rpc_client *c = calloc(1, sizeof *c);
    if (!c) return MT_ERR(MT_ENOMEM, "out of memory");
    if (o->token) snprintf(c->auth, sizeof c->auth, "Bearer %s", o->token);
    grpc_init();
    grpc_channel_credentials *cr;
    if (o->tls_ca) {
        char *pem = mt_read_text_file(o->tls_ca);
        if (!pem) {
            grpc_shutdown();
            free(c);
            return MT_ERR(MT_EIO, "--tls-ca %s: %s", o->tls_ca, strerror(errno));
        }
        cr = grpc_ssl_credentials_create(pem, NULL, NULL, NULL);
        free(pem);
    } else {
        cr = grpc_insecure_credentials_create();
    }
    grpc_arg args[1];
    grpc_channel_args ca = {0, args};
    if (o->tls_name) {
        args[0].type = GRPC_ARG_STRING;
        args[0].key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        args[0].value.string = (char *)o->tls_name;
        ca.num_args = 1;
    }
    c->ch = grpc_channel_create(o->target, cr, &ca);
    grpc_channel_credentials_release(cr);
    if (!c->ch) {
        grpc_shutdown();
        free(c);
        return MT_ERR(MT_EINVAL, "cannot make a channel to %s", o->target);
    }
    *out = c;
    return MT_OK;
}

void rpc_client_close(rpc_client *c)
{
    if (!c) return;
    grpc_channel_destroy(c->ch);
    grpc_shutdown();
    free(c);
}

static gpr_timespec deadline_in(double s)
{
    if (s <= 0) return gpr_inf_future(GPR_CLOCK_REALTIME);
    return gpr_time_add(gpr_now(GPR_CLOCK_REALTIME),
                        gpr_time_from_millis((int64_t)(s * 1e3), GPR_TIMESPAN));
}

static void fill_status(rpc_client *c, grpc_status_code code, grpc_slice details, rpc_status *st)
{
    st->code = (int)code;
    size_t n = GRPC_SLICE_LENGTH(details);
    if (n >= sizeof st->detail) n = sizeof st->detail - 1;
    memcpy(st->detail, GRPC_SLICE_START_PTR(details), n);
    st->detail[n] = '\0';
    st->connected = grpc_channel_check_connectivity_state(c->ch, 0) == GRPC_CHANNEL_READY;
}

static int decode(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *d, ProtobufCMessage **out,
                  rpc_status *st)
{
    grpc_byte_buffer_reader rd;
    *out = NULL;
    if (!bb || !grpc_byte_buffer_reader_init(&rd, bb)) {
        st->code = GRPC_STATUS_INTERNAL;
        snprintf(st->detail, sizeof st->detail, "the server sent no readable response");
        return st->code;
    }
    grpc_slice sl = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    *out = protobuf_c_message_unpack(d, NULL, GRPC_SLICE_LENGTH(sl), GRPC_SLICE_START_PTR(sl));
    grpc_slice_unref(sl);
    if (!*out) {
        st->code = GRPC_STATUS_INTERNAL;
        snprintf(st->detail, sizeof st->detail, "the response is not a valid %s", d->name);
        return st->code;
    }
    return GRPC_STATUS_OK;
}

static grpc_byte_buffer *pack(const ProtobufCMessage *m)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(n ? n : 1);
    if (!b) return NULL;
    protobuf_c_message_pack(m, b);
    grpc_slice sl = grpc_slice_from_copied_buffer((const char *)b, n);
    free(b);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    return bb;
}

/* SEND_INITIAL_METADATA (with the token) + SEND_MESSAGE + SEND_CLOSE. */
static size_t send_ops(rpc_client *c, grpc_op *ops, grpc_metadata *md, grpc_byte_buffer *bb)
{
    memset(ops, 0, 3 * sizeof *ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (c->auth[0]) {
        md->key = grpc_slice_from_static_string("authorization");
        md->value = grpc_slice_from_static_string(c->auth);
        ops[0].data.send_initial_metadata.count = 1;
        ops[0].data.send_initial_metadata.metadata = md;
    }
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    return 3;
}

static int call_buffer(rpc_client *c, const char *method, grpc_byte_buffer *bb,
                       const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                       double timeout_s, rpc_status *st)
{
    memset(st, 0, sizeof *st);
    *resp = NULL;
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    gpr_timespec dl = deadline_in(timeout_s);
    grpc_call *call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                               grpc_slice_from_static_string(method), NULL, dl,
                                               NULL);
    grpc_metadata_array md_init, md_trail;
    grpc_metadata_array_init(&md_init);
    grpc_metadata_array_init(&md_trail);
    grpc_byte_buffer *rbuf = NULL;
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_metadata md;
    grpc_op ops[6];
    size_t n = send_ops(c, ops, &md, bb);
    memset(ops + n, 0, 3 * sizeof *ops);
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n++].data.recv_initial_metadata.recv_initial_metadata = &md_init;
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n++].data.recv_message.recv_message = &rbuf;
    ops[n].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[n].data.recv_status_on_client.trailing_metadata = &md_trail;
    ops[n].data.recv_status_on_client.status = &code;
    ops[n++].data.recv_status_on_client.status_details = &details;
    int tag;
    grpc_call_error e = grpc_call_start_batch(call, ops, n, &tag, NULL);
    if (e == GRPC_CALL_OK) {
        grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        fill_status(c, code, details, st);
        if (code == GRPC_STATUS_OK && resp_desc) decode(rbuf, resp_desc, resp, st);
    } else {
        st->code = GRPC_STATUS_INTERNAL;
        snprintf(st->detail, sizeof st->detail, "grpc_call_start_batch: %s",
                 grpc_call_error_to_string(e));
    }
    if (rbuf) grpc_byte_buffer_destroy(rbuf);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&md_init);
    grpc_metadata_array_destroy(&md_trail);
    grpc_call_unref(call);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    return st->code;
}

int rpc_client_call(rpc_client *c, const char *method, const ProtobufCMessage *req,
                    const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                    double timeout_s, rpc_status *st)
{
    grpc_byte_buffer *bb = pack(req);
    if (!bb) {
        memset(st, 0, sizeof *st);
        st->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        snprintf(st->detail, sizeof st->detail, "out of memory");
        return st->code;
    }
    int rc = call_buffer(c, method, bb, resp_desc, resp, timeout_s, st);
    grpc_byte_buffer_destroy(bb);
    return rc;
}

int rpc_client_call_raw(rpc_client *c, const char *method, const void *body, size_t len,
                        const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                        double timeout_s, rpc_status *st)
{
    grpc_slice sl = grpc_slice_from_copied_buffer(body, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    int rc = call_buffer(c, method, bb, resp_desc, resp, timeout_s, st);
    grpc_byte_buffer_destroy(bb);
    return rc;
}

int rpc_stream_open(rpc_client *c, const char *method, const ProtobufCMessage *req,
                    rpc_client_stream **out, rpc_status *st)
{
    memset(st, 0, sizeof *st);
    *out = NULL;
    rpc_client_stream *s = calloc(1, sizeof *s);
    if (!s) {
        st->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        snprintf(st->detail, sizeof st->detail, "out of memory");
        return st->code;
    }
    s->c = c;
    s->cq = grpc_completion_queue_create_for_pluck(NULL);
    s->call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, s->cq,
                                       grpc_slice_from_static_string(method), NULL,
                                       gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    grpc_metadata_array_init(&s->md_initial);
    grpc_metadata_array_init(&s->md_trailing);
    s->details = grpc_empty_slice();
    s->send_buf = pack(req);
    grpc_metadata md;
    grpc_op ops[4];
    size_t n = send_ops(c, ops, &md, s->send_buf);
    memset(ops + n, 0, sizeof *ops);
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n++].data.recv_initial_metadata.recv_initial_metadata = &s->md_initial;
    grpc_call_error e = grpc_call_start_batch(s->call, ops, n, &s->tag_start, NULL);
    grpc_op sop;
    memset(&sop, 0, sizeof sop);
    sop.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    sop.data.recv_status_on_client.trailing_metadata = &s->md_trailing;
    sop.data.recv_status_on_client.status = &s->status;
    sop.data.recv_status_on_client.status_details = &s->details;
    if (e != GRPC_CALL_OK) {
        s->tag_start = 1; /* nothing in flight to wait for */
        s->status_done = 1;
    } else if ((e = grpc_call_start_batch(s->call, &sop, 1, &s->tag_status, NULL)) !=
               GRPC_CALL_OK) {
        s->status_done = 1;
    }
    if (e != GRPC_CALL_OK) {
        st->code = GRPC_STATUS_INTERNAL;
        snprintf(st->detail, sizeof st->detail, "grpc_call_start_batch: %s",
                 grpc_call_error_to_string(e));
        rpc_stream_close(s);
        return st->code;
    }
    *out = s;
    return GRPC_STATUS_OK;
}

/* Waits for `tag`, waking every 100 ms to look at *stop. */
static int pluck(rpc_client_stream *s, void *tag, volatile sig_atomic_t *stop, int *ok)
{
    for (;;) {
        grpc_event ev = grpc_completion_queue_pluck(s->cq, tag, deadline_in(0.1), NULL);
        if (ev.type == GRPC_OP_COMPLETE) {
            *ok = ev.success;
            return 1;
        }
        if (stop && *stop) return 0;
    }
}

int rpc_stream_next(rpc_client_stream *s, const ProtobufCMessageDescriptor *d,
                    ProtobufCMessage **resp, volatile sig_atomic_t *stop, rpc_status *st)
{
    memset(st, 0, sizeof *st);
    *resp = NULL;
    if (s->tag_start == 0) {
        int ok;
        if (!pluck(s, &s->tag_start, stop, &ok)) return -1;
        s->tag_start = 1;
    }
    grpc_byte_buffer *bb = NULL;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &bb;
    if (grpc_call_start_batch(s->call, &op, 1, &s->tag_recv, NULL) != GRPC_CALL_OK) {
        st->code = GRPC_STATUS_INTERNAL;
        snprintf(st->detail, sizeof st->detail, "cannot receive");
        return 0;
    }
    int ok;
    if (!pluck(s, &s->tag_recv, stop, &ok)) {
        grpc_call_cancel(s->call, NULL);
        pluck(s, &s->tag_recv, NULL, &ok);
        if (bb) grpc_byte_buffer_destroy(bb);
        return -1;
    }
    if (bb) {
        int code = decode(bb, d, resp, st);
        grpc_byte_buffer_destroy(bb);
        if (code == GRPC_STATUS_OK) return 1;
        return 0;
    }
    /* No message: the stream is over; its status follows. */
    pluck(s, &s->tag_status, NULL, &ok);
    s->status_done = 1;
    fill_status(s->c, s->status, s->details, st);
    return 0;
}

void rpc_stream_close(rpc_client_stream *s)
{
    if (!s) return;
    int ok;
    if (!s->status_done) {
        grpc_call_cancel(s->call, NULL);
        if (s->tag_start == 0) pluck(s, &s->tag_start, NULL, &ok);
        pluck(s, &s->tag_status, NULL, &ok);
    }
    grpc_call_unref(s->call);
    grpc_completion_queue_shutdown(s->cq);
    while (grpc_completion_queue_pluck(s->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL)
               .type != GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(s->cq);
    if (s->send_buf) grpc_byte_buffer_destroy(s->send_buf);
    grpc_slice_unref(s->details);
    grpc_metadata_array_destroy(&s->md_initial);
    grpc_metadata_array_destroy(&s->md_trailing);
    free(s);
}
