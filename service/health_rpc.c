/* health_rpc.c - grpc.health.v1.Health, per the gRPC health-checking
 * protocol: Check answers at once (NOT_FOUND for an unknown service); Watch
 * sends the current status, then every change (SERVICE_UNKNOWN for an
 * unknown service, without ending the call). The known services are ""
 * (the whole daemon) and moetrain.v1.Trainer; both are SERVING until the
 * daemon starts draining on SIGTERM, when watchers get NOT_SERVING and
 * their calls end. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "service/rpc_validate.h"
#include "service/service.h"

static int known(const char *service)
{
    return !service[0] || !strcmp(service, "moetrain.v1.Trainer");
}

static int status_of(service *sv, const char *name)
{
    if (!known(name)) return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
    return service_serving(sv)
               ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
               : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

static int pack_status(rpc_reply *out, int status)
{
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = status;
    return rpc_reply_pack(out, &resp.base);
}

static rpc_stream *check(void *ctx, const ProtobufCMessage *m, rpc_reply *out)
{
    const Grpc__Health__V1__HealthCheckRequest *req = (const void *)m;
    if (!known(req->service))
        rpc_reply_error(out, RPC_NOT_FOUND, "unknown service \"%s\"", req->service);
    else
        pack_status(out, status_of(ctx, req->service));
    return NULL;
}

typedef struct watch_stream {
    rpc_stream s;
    service *sv;
    char name[260];
    int last;      /* status sent last; -1 none */
} watch_stream;

static int watch_next(rpc_stream *s, rpc_reply *out)
{
    watch_stream *w = (watch_stream *)s;
    int st = status_of(w->sv, w->name);
    if (st != w->last) {
        w->last = st;
        pack_status(out, st);
        return RPC_MORE;
    }
    /* The call ends once the daemon really goes (streams are drained). */
    if (!atomic_load(&w->sv->serving)) {
        out->code = RPC_OK;
        snprintf(out->detail, sizeof out->detail, "the daemon is shutting down");
        return RPC_END;
    }
    return RPC_WAIT;
}

static void watch_close(rpc_stream *s) { free(s); }

static rpc_stream *watch(void *ctx, const ProtobufCMessage *m, rpc_reply *out)
{
    const Grpc__Health__V1__HealthCheckRequest *req = (const void *)m;
    watch_stream *w = calloc(1, sizeof *w);
    if (!w) {
        rpc_reply_error(out, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    w->s.next = watch_next;
    w->s.close = watch_close;
    w->sv = ctx;
    w->last = -1;
    snprintf(w->name, sizeof w->name, "%s", req->service);
    return &w->s;
}

const rpc_method health_rpc_methods[] = {
    {"/grpc.health.v1.Health/Check", RPC_UNARY, 0,
     &grpc__health__v1__health_check_request__descriptor, rpc_validate_health, check},
    {"/grpc.health.v1.Health/Watch", RPC_SERVER_STREAMING, 0,
     &grpc__health__v1__health_check_request__descriptor, rpc_validate_health, watch},
};
const int health_rpc_n_methods = 2;
