/* rpc_validate.c - request validators of every method (see
 * rpc_validate.h). Pure functions of the decoded message: no state, no
 * files, no gRPC, so the fuzz targets run them as they are. */
#define _POSIX_C_SOURCE 200809L
#include "service/rpc_validate.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "grpc/reflection/v1/reflection.pb-c.h"
#include "base/json_util.h"
#include "base/mt_status.h"
#include "moetrain.pb-c.h"
#include "service/workdir.h"

/* ---- moetrain.v1.Trainer ------------------------------------------------------------ */

static int bad(rpc_reply *r) { return rpc_reply_mt(r, MT_EINVAL, NULL); }

static int checkpoint_name_ok(const char *name, const char *field, int allow_latest,
                              int allow_empty, rpc_reply *r)
{
    if (!name[0] && allow_empty) return RPC_OK;
    if (allow_latest && !strcmp(name, "latest")) return RPC_OK;
    return wd_check_name(name, field) < 0 ? bad(r) : RPC_OK;
}

int rpc_validate_start(const ProtobufCMessage *m, rpc_reply *r)
{
    const Moetrain__V1__StartJobRequest *q = (const void *)m;
    if (!q->spec)
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "spec: required");
    const Moetrain__V1__JobSpec *s = q->spec;
    if (!s->json[0] && !s->path[0])
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT,
                               "spec: give the job spec as spec.json or spec.path");
    if (s->json[0] && s->path[0])
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "spec: give spec.json or spec.path, not both");
    if (s->base_dir[0] && s->base_dir[0] != '/')
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "spec.base_dir: must be an absolute path");
    if (s->n_set > 200)
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "spec.set: more than 200 overrides");
    for (size_t i = 0; i < s->n_set; i++) {
        char field[32];
        snprintf(field, sizeof field, "spec.set[%zu]", i);
        const char *eq = strchr(s->set[i], '=');
        if (!eq || eq == s->set[i])
            return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "%s: \"%.200s\" is not key.path=value",
                                   field, s->set[i]);
    }
    if (s->json[0]) {
        json_error_t e;
        json_t *root = json_loads(s->json, 0, &e);
        if (!root) {
            char reason[512];
            mt_json_error_reason(s->json, &e, reason, sizeof reason);
            return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "spec.json: line %d column %d: %s",
                                   e.line, e.column, reason);
        }
        int obj = json_is_object(root);
        json_decref(root);
        if (!obj) return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "spec.json: must be a JSON object");
    }
    return checkpoint_name_ok(q->from_checkpoint, "from_checkpoint", 1, 1, r);
}

job_request rpc_start_job_request(const ProtobufCMessage *m,
                                  int (*find)(void *arg, const char *dir, const char *name,
                                              char *path, size_t cap),
                                  void *find_arg)
{
    const Moetrain__V1__StartJobRequest *q = (const void *)m;
    job_request jr = {
        .json = q->spec->json,
        .path = q->spec->path,
        .base_dir = q->spec->base_dir,
        .sets = (const char *const *)q->spec->set,
        .n_sets = (int)q->spec->n_set,
        .from_checkpoint = q->from_checkpoint,
        .find_checkpoint = find,
        .find_arg = find_arg,
    };
    return jr;
}

int rpc_validate_list(const ProtobufCMessage *m, rpc_reply *r)
{
    const Moetrain__V1__ListCheckpointsRequest *q = (const void *)m;
    return checkpoint_name_ok(q->job, "job", 0, 1, r);
}

static int layout_field_ok(int v, const char *name, rpc_reply *r)
{
    if (v < 0 || v > 65536)
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "layout.%s: %d is outside [0, 65536]",
                               name, v);
    return RPC_OK;
}

int rpc_validate_reshard(const ProtobufCMessage *m, rpc_reply *r)
{
    const Moetrain__V1__ReshardCheckpointRequest *q = (const void *)m;
    if (!q->source[0]) return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "source: required");
    if (checkpoint_name_ok(q->source, "source", 1, 0, r) != RPC_OK) return r->code;
    if (checkpoint_name_ok(q->target, "target", 0, 0, r) != RPC_OK) return r->code;
    if (!strcmp(q->target, "latest"))
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "target: \"latest\" is reserved");
    if (checkpoint_name_ok(q->job, "job", 0, 1, r) != RPC_OK) return r->code;
    if (!q->layout) return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "layout: required");
    const Moetrain__V1__Layout *l = q->layout;
    if (layout_field_ok(l->tp, "tp", r) || layout_field_ok(l->pp, "pp", r) ||
        layout_field_ok(l->vpp, "vpp", r) || layout_field_ok(l->ep, "ep", r) ||
        layout_field_ok(l->etp, "etp", r) || layout_field_ok(l->dp, "dp", r))
        return r->code;
    return RPC_OK;
}

int rpc_validate_stream(const ProtobufCMessage *m, rpc_reply *r)
{
    const Moetrain__V1__StreamMetricsRequest *q = (const void *)m;
    if (q->from_step < 0)
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "from_step: %lld is negative",
                               (long long)q->from_step);
    return RPC_OK;
}

/* ---- grpc.health.v1 and reflection ----------------------------------------------------- */

int rpc_validate_health(const ProtobufCMessage *m, rpc_reply *r)
{
    const Grpc__Health__V1__HealthCheckRequest *req = (const void *)m;
    if (strlen(req->service) > 256)
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "service: longer than 256 bytes");
    return RPC_OK;
}

int rpc_validate_reflection(const ProtobufCMessage *m, rpc_reply *r)
{
    const Grpc__Reflection__V1__ServerReflectionRequest *req = (const void *)m;
    if (req->message_request_case ==
        GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST__NOT_SET)
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "message_request: not set");
    return RPC_OK;
}

