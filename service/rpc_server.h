/* rpc_server.h - the gRPC server of rank 0, on the gRPC C core.
 *
 * Every server-side gRPC call of moetraind is in rpc_server.c: one
 * completion queue served by one thread, an explicit state machine per call
 * (receive, authorize, decode, handle, send, finish), server streaming and
 * bidirectional streaming, and a drain on shutdown. Methods, decoders and
 * handlers come from rpc_methods(); they never see gRPC types.
 */
#ifndef MT_RPC_SERVER_H
#define MT_RPC_SERVER_H

#include "service/auth.h"
#include "service/service.h"

typedef struct rpc_server rpc_server;

typedef struct rpc_server_opts {
    const char *listen;      /* "127.0.0.1:50051"; port 0 picks a free one */
    const char *tls_cert;    /* PEM files; both NULL: plaintext */
    const char *tls_key;
    const auth *auth;        /* may be NULL: no token */
    service *svc;            /* handler context */
} rpc_server_opts;

/* Binds and starts serving; *port receives the bound port. */
int rpc_server_start(rpc_server **out, const rpc_server_opts *o, int *port);

/* Stops accepting calls, lets open calls finish (streams end once their
 * source ends: the hub closed, health NOT_SERVING), cancels what is still
 * open after `grace_s` seconds, then frees everything. */
void rpc_server_stop(rpc_server *s, double grace_s);

#endif
