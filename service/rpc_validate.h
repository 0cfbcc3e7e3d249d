/* rpc_validate.h - the request checks of every method: a decoded message
 * in, RPC_OK or RPC_INVALID_ARGUMENT naming the field out. With
 * protobuf-c's unpacking (rpc_decode) they make the request decoders that
 * tests/fuzz_request.c fuzzes. */
#ifndef MT_RPC_VALIDATE_H
#define MT_RPC_VALIDATE_H

#include "service/job_admit.h"
#include "service/rpc_method.h"

int rpc_validate_start(const ProtobufCMessage *m, rpc_reply *r);
int rpc_validate_list(const ProtobufCMessage *m, rpc_reply *r);
int rpc_validate_reshard(const ProtobufCMessage *m, rpc_reply *r);
int rpc_validate_stream(const ProtobufCMessage *m, rpc_reply *r);
int rpc_validate_health(const ProtobufCMessage *m, rpc_reply *r);
int rpc_validate_reflection(const ProtobufCMessage *m, rpc_reply *r);

/* The job_request of a validated StartJobRequest (its strings stay owned by
 * the message); checkpoints are looked up with find(find_arg, ...). */
job_request rpc_start_job_request(const ProtobufCMessage *m,
                                  int (*find)(void *arg, const char *dir, const char *name,
                                              char *path, size_t cap),
                                  void *find_arg);

#endif
