/* fuzz_request.c - libFuzzer target for one request decoder of moetraind.
 *
 * Built once per decoder (tests/CMakeLists.txt, clang -fsanitize=fuzzer
 * with ASan and UBSan), chosen by FUZZ_DESCRIPTOR (the request message)
 * and FUZZ_VALIDATE (its check, or NULL): exactly what rpc_server.c runs on
 * the bytes of a request. The StartJob target also admits a decoded job
 * spec against a scratch workdir (FUZZ_ADMIT): the job spec parser and the
 * workdir confinement see fuzzed JSON and paths.
 */
#define _XOPEN_SOURCE 700
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "grpc/health/v1/health.pb-c.h"
#include "grpc/reflection/v1/reflection.pb-c.h"
#include "base/mt_log.h"
#include "moetrain.pb-c.h"
#include "service/job_admit.h"
#include "service/rpc_method.h"
#include "service/rpc_validate.h"
#include "service/workdir.h"

#ifndef FUZZ_ADMIT
#define FUZZ_ADMIT 0
#endif

static const rpc_method method = {"/fuzz", RPC_UNARY, 0, &FUZZ_DESCRIPTOR, FUZZ_VALIDATE, NULL};
static char root[1024];

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    mt_log_set_level(MT_LOG_ERROR);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/fuzz_wd.%d", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
             (int)getpid());
    if (wd_open(dir, root, sizeof root) < 0) abort();
    return 0;
}

#if FUZZ_ADMIT
static int no_checkpoint(void *arg, const char *dir, const char *name, char *path, size_t cap)
{
    (void)arg;
    snprintf(path, cap, "%s/%s", dir, name);
    return 0;
}

static void admit(const ProtobufCMessage *m)
{
    job_request jr = rpc_start_job_request(m, no_checkpoint, NULL);
    static mt_jobspec job;
    (void)job_admit(root, &jr, &job);
}
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rpc_reply r;
    memset(&r, 0, sizeof r);
    ProtobufCMessage *req = NULL;
    int code = rpc_decode(&method, data, size, &req, &r);
    if (code == RPC_OK) {
        /* what a handler may rely on after a successful decode */
        if (!req) abort();
#if FUZZ_ADMIT
        admit(req);
#endif
        protobuf_c_message_free_unpacked(req, NULL);
    } else if (req || !r.detail[0]) {
        abort(); /* an error must come with a message and no request */
    }
    return 0;
}
