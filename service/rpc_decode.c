/* rpc_decode.c - replies and the request decoder (no gRPC, no engine: fuzzed). */
#define _POSIX_C_SOURCE 200809L
#include "service/rpc_method.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"
#include "service/svc_text.h"

const char *rpc_code_name(int code)
{
    static const char *const names[RPC_N_CODES] = {
        "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
        "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
        "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
        "UNAUTHENTICATED"};
    return code >= 0 && code < RPC_N_CODES ? names[code] : "UNKNOWN";
}

int rpc_reply_pack(rpc_reply *r, const ProtobufCMessage *m)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    r->msg = malloc(n ? n : 1);
    if (!r->msg) return rpc_reply_error(r, RPC_INTERNAL, "out of memory");
    r->len = protobuf_c_message_pack(m, r->msg);
    r->code = RPC_OK;
    return RPC_OK;
}

int rpc_reply_error(rpc_reply *r, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->detail, sizeof r->detail, fmt, ap);
    va_end(ap);
    r->code = code;
    return code;
}

int rpc_reply_mt(rpc_reply *r, int mt_rc, const char *context)
{
    return rpc_reply_mt_msg(r, mt_rc, context, mt_errmsg());
}

int rpc_reply_mt_msg(rpc_reply *r, int mt_rc, const char *context, const char *text)
{
    int code;
    switch (mt_rc) {
    case MT_OK: code = RPC_OK; break;
    case MT_EINVAL: code = RPC_INVALID_ARGUMENT; break;
    case MT_ESTATE: code = RPC_FAILED_PRECONDITION; break;
    case MT_ENOTFOUND: code = RPC_NOT_FOUND; break;
    case MT_EINTR: code = RPC_UNAVAILABLE; break;
    case MT_ENOTSUP: code = RPC_FAILED_PRECONDITION; break;
    case MT_ECORRUPT: code = RPC_DATA_LOSS; break;
    case MT_ENOMEM: code = RPC_RESOURCE_EXHAUSTED; break;
    default: code = RPC_INTERNAL; break;
    }
    char msg[RPC_DETAIL_CAP];
    svc_strip_locations(text, msg, sizeof msg);
    if (context && context[0])
        rpc_reply_error(r, code, "%s: %s", context, msg);
    else
        rpc_reply_error(r, code, "%s", msg);
    return code;
}

int rpc_decode(const rpc_method *m, const uint8_t *data, size_t len, ProtobufCMessage **req,
               rpc_reply *r)
{
    *req = protobuf_c_message_unpack(m->request, NULL, len, data);
    if (!*req)
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "the request is not a valid %s message",
                               m->request->name);
    if (m->validate && m->validate(*req, r) != RPC_OK) {
        protobuf_c_message_free_unpacked(*req, NULL);
        *req = NULL;
        return r->code;
    }
    return RPC_OK;
}

