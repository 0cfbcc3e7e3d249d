/* rpc_method.h - what the gRPC server (rpc_server.c) needs to know about a
 * method, and how handlers answer. No gRPC types here: handlers and
 * decoders are plain C over protobuf-c messages, so they can be fuzzed and
 * tested without a server.
 *
 * A handler either answers at once (fills an rpc_reply and returns NULL) or
 * returns an rpc_stream the server polls from its thread: a server-streaming
 * call, or a unary call whose answer comes at the next step boundary.
 */
#ifndef MT_RPC_METHOD_H
#define MT_RPC_METHOD_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

/* gRPC status codes (grpc/status.h has the same numbers; the server
 * asserts it). */
typedef enum {
    RPC_OK = 0,
    RPC_CANCELLED = 1,
    RPC_UNKNOWN = 2,
    RPC_INVALID_ARGUMENT = 3,
    RPC_DEADLINE_EXCEEDED = 4,
    RPC_NOT_FOUND = 5,
    RPC_ALREADY_EXISTS = 6,
    RPC_PERMISSION_DENIED = 7,
    RPC_RESOURCE_EXHAUSTED = 8,
    RPC_FAILED_PRECONDITION = 9,
    RPC_ABORTED = 10,
    RPC_OUT_OF_RANGE = 11,
    RPC_UNIMPLEMENTED = 12,
    RPC_INTERNAL = 13,
    RPC_UNAVAILABLE = 14,
    RPC_DATA_LOSS = 15,
    RPC_UNAUTHENTICATED = 16,
    RPC_N_CODES
} rpc_code;

const char *rpc_code_name(int code);

#define RPC_DETAIL_CAP 1024

/* A message to send (packed protobuf, malloc'd, may be NULL) and/or the
 * final status. */
typedef struct rpc_reply {
    uint8_t *msg;
    size_t len;
    int code;
    char detail[RPC_DETAIL_CAP];
} rpc_reply;

/* Packs a protobuf-c message into r->msg; RPC_OK, or RPC_INTERNAL. */
int rpc_reply_pack(rpc_reply *r, const ProtobufCMessage *m);
/* Sets an error status with a formatted detail; returns the code. */
int rpc_reply_error(rpc_reply *r, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Maps an MT status and the thread's error message (file:line prefixes
 * removed: they mean nothing to a client) to a status; returns the code. */
int rpc_reply_mt(rpc_reply *r, int mt_rc, const char *context);
/* The same with a message captured earlier (e.g. on the engine thread). */
int rpc_reply_mt_msg(rpc_reply *r, int mt_rc, const char *context, const char *msg);

typedef enum { RPC_WAIT = 0, RPC_MORE = 1, RPC_END = 2 } rpc_next;

typedef struct rpc_stream rpc_stream;
struct rpc_stream {
    /* RPC_MORE: *out holds a message, more may follow; RPC_WAIT: nothing
     * now (polled again soon); RPC_END: *out holds the final status, and for
     * a unary call its message. Called only when no send is in flight. */
    int (*next)(rpc_stream *s, rpc_reply *out);
    /* Bidirectional calls: one received message (already decoded and
     * validated); may fill *out with a message to send. */
    int (*recv)(rpc_stream *s, const ProtobufCMessage *req, rpc_reply *out);
    /* The call is over (finished or the client went away). */
    void (*close)(rpc_stream *s);
};

typedef enum { RPC_UNARY = 0, RPC_SERVER_STREAMING, RPC_BIDI_STREAMING } rpc_kind;

typedef struct rpc_method {
    const char *path;   /* "/moetrain.v1.Trainer/StartJob" */
    rpc_kind kind;
    int mutating;       /* needs the token when one is configured */
    const ProtobufCMessageDescriptor *request;
    /* Checks a decoded request; RPC_OK or RPC_INVALID_ARGUMENT naming the
     * field in r->detail. NULL: any well-formed message. */
    int (*validate)(const ProtobufCMessage *req, rpc_reply *r);
    /* Answers (returns NULL, *out filled) or returns a stream. `req` stays
     * owned by the caller: a stream copies what it needs. */
    rpc_stream *(*handle)(void *ctx, const ProtobufCMessage *req, rpc_reply *out);
} rpc_method;

/* The request decoder: unpacks `len` bytes as the method's request and
 * validates it. RPC_OK and *req (free with protobuf_c_message_free_unpacked),
 * or an error status in *r. Every byte string is safe here (fuzzed). */
int rpc_decode(const rpc_method *m, const uint8_t *data, size_t len, ProtobufCMessage **req,
               rpc_reply *r);

/* The methods moetraind serves: Trainer, Health, reflection v1 and v1alpha. */
const rpc_method *rpc_methods(int *n);
const rpc_method *rpc_method_find(const char *path, size_t len);

#endif
