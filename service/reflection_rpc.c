/* reflection_rpc.c - grpc.reflection.v1 and v1alpha ServerReflectionInfo.
 *
 * A bidirectional stream: one response per request. v1alpha's messages are
 * v1's field for field, so one codec serves both paths. Files already sent
 * on a stream are not sent again (the protocol allows it, and grpcurl asks
 * for the same dependencies many times).
 */
#include <stdlib.h>
#include <string.h>

#include "grpc/reflection/v1/reflection.pb-c.h"
#include "service/rpc_validate.h"
#include "service/service.h"

#define MAX_FILES 64

typedef struct refl_stream {
    rpc_stream s;
    const reflection *r;
    unsigned char sent[MAX_FILES];
} refl_stream;

static int refl_next(rpc_stream *s, rpc_reply *out)
{
    (void)s;
    (void)out;
    return RPC_WAIT; /* replies come from refl_recv */
}

static void refl_close(rpc_stream *s) { free(s); }

static void error_response(Grpc__Reflection__V1__ServerReflectionResponse *resp,
                           Grpc__Reflection__V1__ErrorResponse *err, int code, const char *msg)
{
    err->error_code = code;
    err->error_message = (char *)msg;
    resp->message_response_case =
        GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE;
    resp->error_response = err;
}

static int refl_recv(rpc_stream *s, const ProtobufCMessage *msg, rpc_reply *out)
{
    refl_stream *rs = (refl_stream *)s;
    const Grpc__Reflection__V1__ServerReflectionRequest *req = (const void *)msg;
    Grpc__Reflection__V1__ServerReflectionResponse resp =
        GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__INIT;
    Grpc__Reflection__V1__ErrorResponse err = GRPC__REFLECTION__V1__ERROR_RESPONSE__INIT;
    Grpc__Reflection__V1__FileDescriptorResponse files =
        GRPC__REFLECTION__V1__FILE_DESCRIPTOR_RESPONSE__INIT;
    Grpc__Reflection__V1__ListServiceResponse list =
        GRPC__REFLECTION__V1__LIST_SERVICE_RESPONSE__INIT;
    Grpc__Reflection__V1__ExtensionNumberResponse ext =
        GRPC__REFLECTION__V1__EXTENSION_NUMBER_RESPONSE__INIT;
    Grpc__Reflection__V1__ServiceResponse svc[16];
    Grpc__Reflection__V1__ServiceResponse *svcp[16];
    ProtobufCBinaryData blobs[MAX_FILES];
    int idx[MAX_FILES];
    char msgbuf[600];

    resp.valid_host = req->host;
    resp.original_request = (Grpc__Reflection__V1__ServerReflectionRequest *)req;
    int file = -1;
    switch (req->message_request_case) {
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_LIST_SERVICES: {
        int n = reflection_n_services(rs->r);
        if (n > 16) n = 16;
        for (int i = 0; i < n; i++) {
            svc[i] = (Grpc__Reflection__V1__ServiceResponse)GRPC__REFLECTION__V1__SERVICE_RESPONSE__INIT;
            svc[i].name = (char *)reflection_service(rs->r, i);
            svcp[i] = &svc[i];
        }
        list.n_service = (size_t)n;
        list.service = svcp;
        resp.message_response_case =
            GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE;
        resp.list_services_response = &list;
        break;
    }
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_BY_FILENAME:
        file = reflection_file_by_name(rs->r, req->file_by_filename);
        if (file < 0) {
            snprintf(msgbuf, sizeof msgbuf, "file not found: %.500s", req->file_by_filename);
            error_response(&resp, &err, RPC_NOT_FOUND, msgbuf);
        }
        break;
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_SYMBOL:
        file = reflection_file_by_symbol(rs->r, req->file_containing_symbol);
        if (file < 0) {
            snprintf(msgbuf, sizeof msgbuf, "symbol not found: %.500s",
                     req->file_containing_symbol);
            error_response(&resp, &err, RPC_NOT_FOUND, msgbuf);
        }
        break;
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_EXTENSION:
        error_response(&resp, &err, RPC_NOT_FOUND, "extension not found: none are declared");
        break;
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_ALL_EXTENSION_NUMBERS_OF_TYPE:
        if (reflection_is_message(rs->r, req->all_extension_numbers_of_type)) {
            ext.base_type_name = req->all_extension_numbers_of_type;
            resp.message_response_case =
                GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ALL_EXTENSION_NUMBERS_RESPONSE;
            resp.all_extension_numbers_response = &ext;
        } else {
            snprintf(msgbuf, sizeof msgbuf, "type not found: %.500s",
                     req->all_extension_numbers_of_type);
            error_response(&resp, &err, RPC_NOT_FOUND, msgbuf);
        }
        break;
    default:
        error_response(&resp, &err, RPC_INVALID_ARGUMENT, "message_request: not set");
        break;
    }
    if (file >= 0) {
        int n = reflection_closure(rs->r, file, idx, MAX_FILES), k = 0;
        for (int i = 0; i < n; i++) {
            /* The asked-for file always; its dependencies once a stream. */
            if (i > 0 && idx[i] < MAX_FILES && rs->sent[idx[i]]) continue;
            const uint8_t *d;
            size_t len;
            reflection_file_bytes(rs->r, idx[i], &d, &len);
            blobs[k].data = (uint8_t *)d;
            blobs[k].len = len;
            k++;
            if (idx[i] < MAX_FILES) rs->sent[idx[i]] = 1;
        }
        files.n_file_descriptor_proto = (size_t)k;
        files.file_descriptor_proto = blobs;
        resp.message_response_case =
            GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_FILE_DESCRIPTOR_RESPONSE;
        resp.file_descriptor_response = &files;
    }
    return rpc_reply_pack(out, &resp.base);
}

static rpc_stream *refl_handle(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    (void)req;
    service *sv = ctx;
    refl_stream *rs = calloc(1, sizeof *rs);
    if (!rs) {
        rpc_reply_error(out, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    rs->s.next = refl_next;
    rs->s.recv = refl_recv;
    rs->s.close = refl_close;
    rs->r = sv->refl;
    return &rs->s;
}

/* The handler gets NULL as the request: each message arrives at recv. */
const rpc_method reflection_rpc_methods[] = {
    {"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", RPC_BIDI_STREAMING, 0,
     &grpc__reflection__v1__server_reflection_request__descriptor, rpc_validate_reflection, refl_handle},
    {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", RPC_BIDI_STREAMING, 0,
     &grpc__reflection__v1__server_reflection_request__descriptor, rpc_validate_reflection, refl_handle},
};
const int reflection_rpc_n_methods = 2;
