/* rpc_client.h - a small blocking gRPC client on the gRPC C core, for the
 * moetrain CLI and the service benchmark. Every client-side gRPC call is in
 * rpc_client.c. One thread per client. */
#ifndef MT_RPC_CLIENT_H
#define MT_RPC_CLIENT_H

#include <protobuf-c/protobuf-c.h>
#include <signal.h>

typedef struct rpc_client rpc_client;

typedef struct rpc_client_opts {
    const char *target;       /* "127.0.0.1:50051" */
    const char *token;        /* bearer token or NULL */
    const char *tls_ca;       /* PEM file of the CA (or the self-signed cert): use TLS */
    const char *tls_name;     /* expected server name in its certificate; NULL: the host */
} rpc_client_opts;

typedef struct rpc_status {
    int code;                 /* gRPC status code */
    char detail[1024];
    int connected;            /* the channel was connected when the call ended */
} rpc_status;

int rpc_client_open(rpc_client **out, const rpc_client_opts *o);
void rpc_client_close(rpc_client *c);

/* A unary call. On OK *resp is the decoded response (free with
 * protobuf_c_message_free_unpacked). Returns the status code. */
int rpc_client_call(rpc_client *c, const char *method, const ProtobufCMessage *req,
                    const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                    double timeout_s, rpc_status *st);

/* The same with a raw request body (tests send garbage this way). */
int rpc_client_call_raw(rpc_client *c, const char *method, const void *body, size_t len,
                        const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
                        double timeout_s, rpc_status *st);

typedef struct rpc_client_stream rpc_client_stream;

/* Starts a server-streaming call (no deadline). */
int rpc_stream_open(rpc_client *c, const char *method, const ProtobufCMessage *req,
                    rpc_client_stream **out, rpc_status *st);

/* Next message: 1 and *resp; 0 the stream ended (*st has its status);
 * -1 *stop became non-zero while waiting (the call is cancelled). */
int rpc_stream_next(rpc_client_stream *s, const ProtobufCMessageDescriptor *d,
                    ProtobufCMessage **resp, volatile sig_atomic_t *stop, rpc_status *st);

/* Cancels the call if it is still open and frees it. */
void rpc_stream_close(rpc_client_stream *s);

#endif
