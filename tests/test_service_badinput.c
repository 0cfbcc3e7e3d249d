/* test_service_badinput.c - a daemon with a token and TLS off, then TLS on,
 * gets bad input and must answer each with the right status code and keep
 * serving: garbage bytes, an unknown method, invalid job specs (the message
 * names the field; NaN, Inf, bad UTF-8), names and paths that try to leave
 * the workdir (a symbolic link at each component, for each RPC), calls in
 * the wrong state, a missing or wrong token, clients that vanish mid-stream
 * (cancelled, and killed). Then TLS: a client with the CA works, one
 * without TLS cannot connect. */
#define _XOPEN_SOURCE 700
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <grpc/status.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

#include "grpc/health/v1/health.pb-c.h"
#include "base/mt_status.h"
#include "moetrain.pb-c.h"
#include "service/rpc_client.h"
#include "test_util.h"

#define TOKEN "test-token-0123456789abcdef"
#define T "/moetrain.v1.Trainer/"

static char tmp[1024], bin[1024], data[1100];
static const char *examples;
static pid_t daemon_pid;
static char addr[128];

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Starts moetraind with `extra` options; waits for its ready file. */
static int start_daemon(const char *const *extra, int n_extra)
{
    char ready[1200], wd[1200], tok[1200], log[1200];
    snprintf(ready, sizeof ready, "%s/ready", tmp);
    snprintf(wd, sizeof wd, "%s/wd", tmp);
    snprintf(tok, sizeof tok, "%s/token", tmp);
    snprintf(log, sizeof log, "%s/daemon.log", tmp);
    remove(ready);
    char exe[1200];
    snprintf(exe, sizeof exe, "%s/service/moetraind", bin);
    const char *argv[32] = {exe, "--listen", "127.0.0.1:0", "--workdir", wd, "--token-file",
                            tok, "--ready-file", ready, "--threads", "1"};
    int n = 11;
    for (int i = 0; i < n_extra; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    daemon_pid = fork();
    if (daemon_pid == 0) {
        if (!freopen(log, "a", stderr)) _exit(127);
        execv(exe, (char *const *)argv);
        _exit(127);
    }
    for (int i = 0; i < 300; i++) {
        FILE *f = fopen(ready, "r");
        if (f) {
            char line[256];
            while (fgets(line, sizeof line, f))
                if (!strncmp(line, "grpc=", 5)) {
                    snprintf(addr, sizeof addr, "%s", line + 5);
                    addr[strcspn(addr, "\n")] = '\0';
                }
            fclose(f);
            return 0;
        }
        sleep_ms(100);
    }
    return -1;
}

static int stop_daemon(void)
{
    int st = 0;
    kill(daemon_pid, SIGTERM);
    for (int i = 0; i < 300; i++) {
        if (waitpid(daemon_pid, &st, WNOHANG) == daemon_pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        sleep_ms(100);
    }
    kill(daemon_pid, SIGKILL);
    waitpid(daemon_pid, &st, 0);
    return -1;
}

static rpc_client *client(const char *token, const char *ca)
{
    rpc_client *c;
    rpc_client_opts o = {.target = addr, .token = token, .tls_ca = ca};
    assert_int_equal(rpc_client_open(&c, &o), MT_OK);
    return c;
}

static int setup(void **state)
{
    (void)state;
    mt_test_tmpdir(tmp, sizeof tmp, "test_service_badinput");
    snprintf(bin, sizeof bin, "%s", mt_test_bin_dir());
    snprintf(data, sizeof data, "%s/syn", tmp);
    char tok[1200];
    if (mt_test_synth(data, "--vocab 64 --tokens 100000 --seed 2") != 0) return -1;
    snprintf(tok, sizeof tok, "%s/token", tmp);
    mt_test_write_file(tok, TOKEN "\n");
    chmod(tok, 0600);
    return start_daemon(NULL, 0);
}

static int teardown(void **state)
{
    (void)state;
    return stop_daemon() == 0 ? 0 : -1;
}

/* The example tiny job's spec text (a static buffer). */
static char *tiny_json(void)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/tiny-cpu.json", examples);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    static char json[65536];
    size_t n = fread(json, 1, sizeof json - 1, f);
    fclose(f);
    json[n] = '\0';
    return json;
}

static int start_spec(rpc_client *c, const char *json, const char *const *extra, int n_extra,
                      const char *from, rpc_status *st);

/* A StartJob request for the tiny job with extra overrides. */
static int start_job(rpc_client *c, const char *const *extra, int n_extra, const char *from,
                     rpc_status *st)
{
    return start_spec(c, tiny_json(), extra, n_extra, from, st);
}

/* A StartJob request for the job spec text `json` with extra overrides. */
static int start_spec(rpc_client *c, const char *json, const char *const *extra, int n_extra,
                      const char *from, rpc_status *st)
{
    char dset[1200];
    snprintf(dset, sizeof dset, "data.path=%s", data);
    char *sets[32] = {dset, "batch.seq_len=32", "train.steps=100000", "data.valid_interval=0",
                      "train.log_interval=1000"};
    size_t ns = 5;
    for (int i = 0; i < n_extra; i++) sets[ns++] = (char *)extra[i];
    Moetrain__V1__JobSpec spec = MOETRAIN__V1__JOB_SPEC__INIT;
    spec.json = (char *)json;
    spec.set = sets;
    spec.n_set = ns;
    Moetrain__V1__StartJobRequest q = MOETRAIN__V1__START_JOB_REQUEST__INIT;
    q.spec = &spec;
    q.from_checkpoint = (char *)(from ? from : "");
    ProtobufCMessage *resp;
    int code = rpc_client_call(c, T "StartJob", &q.base,
                               &moetrain__v1__start_job_response__descriptor, &resp, 120, st);
    if (code == 0) protobuf_c_message_free_unpacked(resp, NULL);
    return code;
}

static int empty_call(rpc_client *c, const char *method, const ProtobufCMessageDescriptor *req_d,
                      const ProtobufCMessageDescriptor *resp_d, rpc_status *st)
{
    uint8_t buf[8];
    ProtobufCMessage *m = calloc(1, req_d->sizeof_message);
    req_d->message_init(m);
    size_t len = protobuf_c_message_pack(m, buf);
    free(m);
    ProtobufCMessage *resp;
    int code = rpc_client_call_raw(c, method, buf, len, resp_d, &resp, 60, st);
    if (code == 0) protobuf_c_message_free_unpacked(resp, NULL);
    return code;
}

static Moetrain__V1__GetStatusResponse *status(rpc_client *c)
{
    rpc_status st;
    ProtobufCMessage *r;
    Moetrain__V1__GetStatusRequest q = MOETRAIN__V1__GET_STATUS_REQUEST__INIT;
    assert_int_equal(rpc_client_call(c, T "GetStatus", &q.base,
                                     &moetrain__v1__get_status_response__descriptor, &r, 30, &st),
                     0);
    return (Moetrain__V1__GetStatusResponse *)r;
}

static void assert_serving(void)
{
    rpc_client *c = client(NULL, NULL);
    Moetrain__V1__GetStatusResponse *s = status(c);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    rpc_client_close(c);
}

static void test_garbage(void **state)
{
    (void)state;
    rpc_client *c = client(TOKEN, NULL);
    const char *methods[] = {T "StartJob", T "PauseJob", T "ResumeJob", T "StopJob",
                             T "GetStatus", T "SaveCheckpoint", T "ListCheckpoints",
                             T "ReshardCheckpoint", "/grpc.health.v1.Health/Check"};
    const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
        rpc_status st;
        ProtobufCMessage *r;
        assert_int_equal(rpc_client_call_raw(c, methods[i], junk, sizeof junk, NULL, &r, 30, &st),
                         GRPC_STATUS_INVALID_ARGUMENT);
        assert_contains(st.detail, "not a valid");
    }
    rpc_status st;
    ProtobufCMessage *r;
    assert_int_equal(rpc_client_call_raw(c, "/moetrain.v1.Trainer/Nope", "", 0, NULL, &r, 30, &st),
                     GRPC_STATUS_UNIMPLEMENTED);
    /* a length-delimited field running past the end */
    const uint8_t cut[] = {0x0a, 0x7f, 0x0a, 0x02};
    assert_int_equal(rpc_client_call_raw(c, T "StartJob", cut, sizeof cut, NULL, &r, 30, &st),
                     GRPC_STATUS_INVALID_ARGUMENT);
    rpc_client_close(c);
    assert_serving();
}

static void test_token(void **state)
{
    (void)state;
    rpc_status st;
    rpc_client *none = client(NULL, NULL), *wrong = client("wrong-token-0123456789", NULL);
    const char *mutating[] = {T "StartJob", T "PauseJob", T "ResumeJob", T "StopJob",
                              T "SaveCheckpoint", T "ReshardCheckpoint"};
    for (int i = 0; i < 6; i++) {
        ProtobufCMessage *r;
        assert_int_equal(rpc_client_call_raw(none, mutating[i], "", 0, NULL, &r, 30, &st),
                         GRPC_STATUS_UNAUTHENTICATED);
        assert_contains(st.detail, "authorization");
        assert_int_equal(rpc_client_call_raw(wrong, mutating[i], "", 0, NULL, &r, 30, &st),
                         GRPC_STATUS_UNAUTHENTICATED);
    }
    /* reading needs no token */
    Moetrain__V1__GetStatusResponse *s = status(none);
    assert_int_equal(s->state, MOETRAIN__V1__JOB_STATE__JOB_STATE_IDLE);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    assert_int_equal(empty_call(none, T "ListCheckpoints",
                                &moetrain__v1__list_checkpoints_request__descriptor,
                                &moetrain__v1__list_checkpoints_response__descriptor, &st),
                     GRPC_STATUS_NOT_FOUND); /* no job has run yet */
    rpc_client_close(none);
    rpc_client_close(wrong);
}

static void test_wrong_state(void **state)
{
    (void)state;
    rpc_client *c = client(TOKEN, NULL);
    rpc_status st;
    struct {
        const char *m;
        const ProtobufCMessageDescriptor *q, *r;
    } calls[] = {
        {T "PauseJob", &moetrain__v1__pause_job_request__descriptor,
         &moetrain__v1__pause_job_response__descriptor},
        {T "ResumeJob", &moetrain__v1__resume_job_request__descriptor,
         &moetrain__v1__resume_job_response__descriptor},
        {T "StopJob", &moetrain__v1__stop_job_request__descriptor,
         &moetrain__v1__stop_job_response__descriptor},
        {T "SaveCheckpoint", &moetrain__v1__save_checkpoint_request__descriptor,
         &moetrain__v1__save_checkpoint_response__descriptor},
    };
    for (int i = 0; i < 4; i++) {
        assert_int_equal(empty_call(c, calls[i].m, calls[i].q, calls[i].r, &st),
                         GRPC_STATUS_FAILED_PRECONDITION);
        assert_contains(st.detail, "IDLE");
    }
    rpc_client_close(c);
}

static void test_bad_specs(void **state)
{
    (void)state;
    rpc_client *c = client(TOKEN, NULL);
    rpc_status st;
    struct {
        const char *set, *from, *want;
    } cases[] = {
        {"batch.micro_batch_size=3", NULL, "batch.global_batch_size"},
        {"train.steps=-5", NULL, "train.steps"},
        {"model.hidden_size=abc", NULL, "hidden_size"},
        {"no.such.field=1", NULL, "no.such.field"},
        {"data.path=/nonexistent/x", NULL, "data.path"},
        {"checkpoint.dir=/etc", NULL, "checkpoint.dir"},
        {"checkpoint.dir=../../x", NULL, "checkpoint.dir"},
        {"checkpoint.dir=escape/inside", NULL, "symbolic link"},
        {"init.kind=checkpoint", NULL, "init.path"},
        {"name=../../x", NULL, "name"},
        /* admission: the daemon runs one rank */
        {"parallel.tp=2", NULL, "layout tp=2,pp=1,vpp=1,ep=1,etp=1,dp=0: 1 rank runs the job"},
        {"parallel.dp=2", NULL, "needs tp 1 x pp 1 x dp 2 = 2 ranks, but 1 rank runs the job"},
        {NULL, "../../etc", "from_checkpoint"},
        {NULL, "step_00000001", "from_checkpoint"},
    };
    char wd[1200], link[1300];
    snprintf(wd, sizeof wd, "%s/wd", tmp);
    snprintf(link, sizeof link, "%s/escape", wd);
    assert_int_equal(symlink("/tmp", link), 0);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int code = start_job(c, &cases[i].set, cases[i].set ? 1 : 0, cases[i].from, &st);
        if (code != GRPC_STATUS_INVALID_ARGUMENT && code != GRPC_STATUS_NOT_FOUND)
            fprintf(stderr, "case %zu: %d %s\n", i, code, st.detail);
        assert_true(code == GRPC_STATUS_INVALID_ARGUMENT || code == GRPC_STATUS_NOT_FOUND);
        assert_contains(st.detail, cases[i].want);
        assert_null(strstr(st.detail, ".c:")); /* no source locations for clients */
    }
    /* a reshard or a listing that names something outside */
    Moetrain__V1__ReshardCheckpointRequest rq = MOETRAIN__V1__RESHARD_CHECKPOINT_REQUEST__INIT;
    Moetrain__V1__Layout l = MOETRAIN__V1__LAYOUT__INIT;
    rq.source = "latest";
    rq.target = "../outside";
    rq.layout = &l;
    ProtobufCMessage *r;
    assert_int_equal(rpc_client_call(c, T "ReshardCheckpoint", &rq.base, NULL, &r, 30, &st),
                     GRPC_STATUS_INVALID_ARGUMENT);
    assert_contains(st.detail, "target");
    Moetrain__V1__ListCheckpointsRequest lq = MOETRAIN__V1__LIST_CHECKPOINTS_REQUEST__INIT;
    lq.job = "..";
    assert_int_equal(rpc_client_call(c, T "ListCheckpoints", &lq.base, NULL, &r, 30, &st),
                     GRPC_STATUS_INVALID_ARGUMENT);
    rpc_client_close(c);
    assert_serving();
}

/* Issue 21, defect 5: NaN, infinities and invalid UTF-8 in a --set or in
 * spec.json are INVALID_ARGUMENT naming the field (they were "out of
 * memory", RESOURCE_EXHAUSTED). */
static void test_nonfinite_and_bad_utf8(void **state)
{
    (void)state;
    rpc_client *c = client(TOKEN, NULL);
    rpc_status st;
    struct {
        const char *set, *want;
    } sets[] = {
        {"optimizer.lr=nan", "optimizer.lr: \"nan\" is not a finite number"},
        {"optimizer.lr=-inf", "optimizer.lr: \"-inf\" is not a finite number"},
        {"optimizer.lr=1e999", "optimizer.lr: \"1e999\" is not a finite number"},
        {"train.steps=inf", "train.steps: \"inf\" is not an integer of 64 bits"},
        {"model.rope_scaling.factor=nan", "model.rope_scaling.factor: \"nan\" is not a finite"},
        {"name=tiny\xff", "name: not valid UTF-8 (byte 0xff at offset 4)"},
        {"data.path=\xc3(", "data.path: not valid UTF-8 (byte 0xc3 at offset 0)"},
    };
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++) {
        int code = start_job(c, &sets[i].set, 1, NULL, &st);
        if (code != GRPC_STATUS_INVALID_ARGUMENT) fprintf(stderr, "set %zu: %d %s\n", i, code, st.detail);
        assert_int_equal(code, GRPC_STATUS_INVALID_ARGUMENT);
        assert_contains(st.detail, sets[i].want);
    }
    /* spec.json: what JSON cannot say is refused where the document is read,
     * with the field at the place */
    static char json[65536];
    struct {
        const char *from, *to, *want;
    } docs[] = {
        {"\"lr\": 3e-3", "\"lr\": NaN",
         "spec.json: line 36 column 26: optimizer.lr: invalid token near 'NaN' (NaN and Infinity"},
        {"\"lr\": 3e-3", "\"lr\": Infinity", "line 36 column 31: optimizer.lr: invalid token"},
        {"\"lr\": 3e-3", "\"lr\": 1e999", "line 36 column 28: optimizer.lr: real number overflow"},
        {"\"name\": \"tiny-cpu\"", "\"name\": \"tiny\xff\"",
         "spec.json: line 3 column 15: name: unable to decode byte 0xff"},
    };
    for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++) {
        const char *base = tiny_json();
        const char *at = strstr(base, docs[i].from);
        assert_non_null(at);
        snprintf(json, sizeof json, "%.*s%s%s", (int)(at - base), base, docs[i].to,
                 at + strlen(docs[i].from));
        int code = start_spec(c, json, NULL, 0, NULL, &st);
        if (code != GRPC_STATUS_INVALID_ARGUMENT) fprintf(stderr, "doc %zu: %d %s\n", i, code, st.detail);
        assert_int_equal(code, GRPC_STATUS_INVALID_ARGUMENT);
        assert_contains(st.detail, docs[i].want);
    }
    rpc_client_close(c);
    assert_serving();
}

/* ---- issue 21, defect 3: links out of the workdir, for each RPC ------------------------- */

static char wd[1100], out_dir[1100];

/* Runs a shell command built like printf; it must succeed. */
static void sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void sh(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    if (system(cmd) != 0) {
        fprintf(stderr, "failed: %s\n", cmd);
        fail();
    }
}

static int exists(const char *fmt, const char *a)
{
    char p[2048];
    snprintf(p, sizeof p, fmt, a);
    struct stat st;
    return lstat(p, &st) == 0;
}

/* Records one case: its status code and message against what is wanted. */
static int n_cases, n_bad;
static void expect_case(const char *name, int got, int want, const rpc_status *st,
                        const char *needle)
{
    n_cases++;
    int ok = got == want && (!needle || strstr(st->detail, needle));
    if (!ok) n_bad++;
    fprintf(stderr, "%s %s: %d (want %d) %s\n", ok ? "ok  " : "FAIL", name, got, want,
            got ? st->detail : "");
}

/* Records one case that is a plain condition (what was written where). */
static void expect_true(const char *name, int ok, const char *what)
{
    n_cases++;
    if (!ok) n_bad++;
    fprintf(stderr, "%s %s%s%s\n", ok ? "ok  " : "FAIL", name, ok ? "" : ": ", ok ? "" : what);
}

static int list_call(rpc_client *c, const char *job, rpc_status *st, char *names, size_t cap)
{
    Moetrain__V1__ListCheckpointsRequest q = MOETRAIN__V1__LIST_CHECKPOINTS_REQUEST__INIT;
    q.job = (char *)job;
    Moetrain__V1__ListCheckpointsResponse *r;
    int code = rpc_client_call(c, T "ListCheckpoints", &q.base,
                               &moetrain__v1__list_checkpoints_response__descriptor,
                               (ProtobufCMessage **)&r, 30, st);
    names[0] = '\0';
    if (code == 0) {
        for (size_t i = 0; i < r->n_checkpoints; i++) {
            size_t n = strlen(names);
            snprintf(names + n, cap - n, "%s ", r->checkpoints[i]->name);
        }
        protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    return code;
}

static void wait_no_reshard(rpc_client *c)
{
    for (int i = 0;; i++) {
        assert_true(i < 600);
        Moetrain__V1__GetStatusResponse *r = status(c);
        int active = r->reshard && r->reshard->active;
        protobuf_c_message_free_unpacked(&r->base, NULL);
        if (!active) return;
        sleep_ms(100);
    }
}

/* ReshardCheckpoint; a reshard it started is waited for, so that each case
 * stands alone (one running refuses the next). */
static int reshard_call(rpc_client *c, const char *job, const char *source, const char *target,
                        rpc_status *st)
{
    Moetrain__V1__ReshardCheckpointRequest q = MOETRAIN__V1__RESHARD_CHECKPOINT_REQUEST__INIT;
    Moetrain__V1__Layout l = MOETRAIN__V1__LAYOUT__INIT;
    q.job = (char *)job;
    q.source = (char *)source;
    q.target = (char *)target;
    q.layout = &l;
    ProtobufCMessage *r;
    int code = rpc_client_call(c, T "ReshardCheckpoint", &q.base,
                               &moetrain__v1__reshard_checkpoint_response__descriptor, &r, 30, st);
    if (code == 0) protobuf_c_message_free_unpacked(r, NULL);
    if (code == 0) wait_no_reshard(c);
    return code;
}

/* SaveCheckpoint; the saved checkpoint's name into name. */
static int save_call(rpc_client *c, rpc_status *st, char *name, size_t cap)
{
    Moetrain__V1__SaveCheckpointRequest q = MOETRAIN__V1__SAVE_CHECKPOINT_REQUEST__INIT;
    Moetrain__V1__SaveCheckpointResponse *r;
    int code = rpc_client_call(c, T "SaveCheckpoint", &q.base,
                               &moetrain__v1__save_checkpoint_response__descriptor,
                               (ProtobufCMessage **)&r, 120, st);
    if (name) name[0] = '\0';
    if (code == 0) {
        if (name && r->checkpoint) snprintf(name, cap, "%s", r->checkpoint->name);
        protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    return code;
}

static int stop_call(rpc_client *c, int save, rpc_status *st)
{
    Moetrain__V1__StopJobRequest q = MOETRAIN__V1__STOP_JOB_REQUEST__INIT;
    q.save = save;
    ProtobufCMessage *r;
    int code = rpc_client_call(c, T "StopJob", &q.base, &moetrain__v1__stop_job_response__descriptor,
                               &r, 120, st);
    if (code == 0) protobuf_c_message_free_unpacked(r, NULL);
    return code;
}

/* Waits until the running job has done a step after `step`. */
static void wait_step_after(rpc_client *c, int64_t step)
{
    for (int i = 0;; i++) {
        assert_true(i < 600);
        Moetrain__V1__GetStatusResponse *r = status(c);
        int moved = r->step > step;
        protobuf_c_message_free_unpacked(&r->base, NULL);
        if (moved) return;
        sleep_ms(100);
    }
}

static int64_t step_of(const char *name) { return strtoll(name + 5, NULL, 10); }

#define INVALID GRPC_STATUS_INVALID_ARGUMENT
#define LINK_OUT "leads outside the workdir through a symbolic link"

/* ReshardCheckpoint, ListCheckpoints and SaveCheckpoint used to follow
 * symbolic links out of the workdir (StartJob checked). Each RPC gets a link
 * leading out at each component of the paths it uses: the `checkpoints`
 * folder, the job's folder, a step folder, a file inside a checkpoint, the
 * reshard target, `latest.tmp`; and a job folder replaced by a link while the
 * job runs. Nothing may be read or written outside. Every case is reported
 * (stderr) before the count is asserted, so a run against the unfixed code
 * lists each one that fails. */
static void test_links_out_of_workdir(void **state)
{
    (void)state;
    rpc_client *c = client(TOKEN, NULL);
    rpc_status st;
    char names[4096], ck[128], ck2[128];
    snprintf(wd, sizeof wd, "%s/wd", tmp);
    snprintf(out_dir, sizeof out_dir, "%s/outside", tmp);
    sh("rm -rf '%s' && mkdir -p '%s/savedir' && echo keep > '%s/victim'", out_dir, out_dir, out_dir);
    n_cases = n_bad = 0;

    /* a job with one checkpoint, and a copy of its folder outside */
    const char *lnk[] = {"name=lnk"};
    assert_int_equal(start_job(c, lnk, 1, NULL, &st), 0);
    assert_int_equal(save_call(c, &st, ck, sizeof ck), 0);
    sh("cp -r '%s/checkpoints/lnk' '%s/jobcopy'", wd, out_dir);

    /* ListCheckpoints */
    sh("ln -s '%s/jobcopy' '%s/checkpoints/viaj'", out_dir, wd);
    expect_case("List: the job's folder is a link out", list_call(c, "viaj", &st, names, sizeof names),
                INVALID, &st, LINK_OUT);
    sh("ln -s '%s/jobcopy/%s' '%s/checkpoints/lnk/step_99999999'", out_dir, ck, wd);
    int code = list_call(c, "lnk", &st, names, sizeof names);
    expect_case("List: a step is a link out (left out)", code, 0, &st, NULL);
    expect_true("List: the link is not listed, the step is", code == 0 &&
                !strstr(names, "step_99999999") && strstr(names, ck), names);

    /* ReshardCheckpoint: the source side */
    expect_case("Reshard: the source job's folder is a link out",
                reshard_call(c, "viaj", "latest", "r1", &st), INVALID, &st, LINK_OUT);
    expect_case("Reshard: the source step is a link out",
                reshard_call(c, "lnk", "step_99999999", "r2", &st), INVALID, &st, LINK_OUT);
    expect_case("Reshard: latest is a link out", reshard_call(c, "lnk", "latest", "r3", &st), INVALID,
                &st, LINK_OUT);
    sh("rm '%s/checkpoints/lnk/step_99999999'", wd);
    sh("mkdir -p '%s/checkpoints/lnkcopy' && cp -r '%s/checkpoints/lnk/%s' '%s/checkpoints/lnkcopy/' && "
       "ln -s '%s/victim' '%s/checkpoints/lnkcopy/%s/notes'",
       wd, wd, ck, wd, out_dir, wd, ck);
    expect_case("Reshard: a file of the source is a link out",
                reshard_call(c, "lnkcopy", ck, "r4", &st), INVALID, &st, "is a symbolic link");
    /* the target side */
    sh("ln -s '%s/tgt' '%s/checkpoints/tlink'", out_dir, wd);
    expect_case("Reshard: the target is a (dangling) link out",
                reshard_call(c, "lnk", ck, "tlink", &st), INVALID, &st, "exists already");
    expect_true("Reshard: nothing written through the target link", !exists("%s/tgt", out_dir),
                "wrote outside/tgt");

    /* SaveCheckpoint: a link at latest.tmp must not be written through */
    wait_step_after(c, step_of(ck));
    sh("ln -s '%s/victim' '%s/checkpoints/lnk/latest.tmp'", out_dir, wd);
    expect_case("Save: latest.tmp is a link out", save_call(c, &st, ck2, sizeof ck2), 0, &st, NULL);
    {
        char v[1200];
        snprintf(v, sizeof v, "%s/victim", out_dir);
        FILE *f = fopen(v, "r");
        char line[64] = "";
        if (f) {
            if (!fgets(line, sizeof line, f)) line[0] = '\0';
            fclose(f);
        }
        expect_true("Save: the target of latest.tmp is untouched", !strcmp(line, "keep\n"), line);
    }
    /* the job's folder replaced by a link while it runs */
    wait_step_after(c, step_of(ck2));
    sh("mv '%s/checkpoints/lnk' '%s/checkpoints/lnk.moved' && ln -s '%s/savedir' '%s/checkpoints/lnk'",
       wd, wd, out_dir, wd);
    expect_case("Save: the job's folder was replaced by a link out", save_call(c, &st, NULL, 0),
                GRPC_STATUS_FAILED_PRECONDITION, &st, LINK_OUT);
    expect_case("Stop with a save: the job's folder replaced by a link out", stop_call(c, 1, &st),
                0, &st, NULL);
    sh("ls -A '%s/savedir' > '%s/savedir.ls'", out_dir, tmp);
    {
        char ls[1200];
        snprintf(ls, sizeof ls, "%s/savedir.ls", tmp);
        struct stat s2;
        expect_true("Save and stop: nothing written through the job's folder link",
                    stat(ls, &s2) == 0 && s2.st_size == 0, "wrote into outside/savedir");
    }
    sh("rm '%s/checkpoints/lnk' && mv '%s/checkpoints/lnk.moved' '%s/checkpoints/lnk'", wd, wd, wd);

    /* StartJob: a step that is a link out, a spec file that is a link out */
    sh("ln -s '%s/jobcopy/%s' '%s/checkpoints/lnk/step_99999999'", out_dir, ck, wd);
    expect_case("Start: from_checkpoint is a link out",
                start_job(c, lnk, 1, "step_99999999", &st), INVALID, &st, "symbolic link");
    sh("rm '%s/checkpoints/lnk/step_99999999'", wd);

    /* the `checkpoints` folder itself replaced by a link to a copy outside */
    sh("mkdir -p '%s/ckroot' && cp -r '%s/checkpoints/lnk' '%s/ckroot/' && "
       "mv '%s/checkpoints' '%s/checkpoints.real' && ln -s '%s/ckroot' '%s/checkpoints'",
       out_dir, wd, out_dir, wd, wd, out_dir, wd);
    expect_case("List: `checkpoints` is a link out", list_call(c, "lnk", &st, names, sizeof names),
                INVALID, &st, LINK_OUT);
    expect_case("Reshard: `checkpoints` is a link out", reshard_call(c, "lnk", "latest", "r6", &st),
                INVALID, &st, LINK_OUT);
    expect_case("Start: `checkpoints` is a link out", start_job(c, lnk, 1, "latest", &st), INVALID,
                &st, "symbolic link");
    expect_true("Reshard: nothing written through `checkpoints`", !exists("%s/ckroot/r6", out_dir),
                "wrote outside/ckroot/r6");
    sh("rm '%s/checkpoints' && mv '%s/checkpoints.real' '%s/checkpoints'", wd, wd, wd);
    /* ... and while a job runs */
    const char *lnk3[] = {"name=lnk3"};
    assert_int_equal(start_job(c, lnk3, 1, NULL, &st), 0);
    sh("mkdir -p '%s/ckroot3/lnk3' && mv '%s/checkpoints' '%s/checkpoints.real' && "
       "ln -s '%s/ckroot3' '%s/checkpoints'",
       out_dir, wd, wd, out_dir, wd);
    expect_case("Save: `checkpoints` was replaced by a link out", save_call(c, &st, NULL, 0),
                GRPC_STATUS_FAILED_PRECONDITION, &st, LINK_OUT);
    expect_case("Stop with a save: `checkpoints` replaced by a link out", stop_call(c, 1, &st), 0,
                &st, NULL);
    sh("rm '%s/checkpoints' && mv '%s/checkpoints.real' '%s/checkpoints'", wd, wd, wd);
    expect_true("Save and stop: nothing written through `checkpoints`",
                !exists("%s/ckroot3/lnk3/latest", out_dir), "wrote into outside/ckroot3/lnk3");
    /* the final save went to the folder the job started with */
    code = list_call(c, "lnk3", &st, names, sizeof names);
    expect_true("the final save of lnk3 is in the folder it started with",
                code == 0 && strstr(names, "step_"), names);
    fprintf(stderr, "links out of the workdir: %d of %d cases wrong\n", n_bad, n_cases);
    assert_int_equal(n_bad, 0);
    rpc_client_close(c);
    assert_serving();
}

/* Opens a metrics stream, reads `n` events, returns the client. */
static rpc_client_stream *subscribe(rpc_client *c, int n)
{
    Moetrain__V1__StreamMetricsRequest q = MOETRAIN__V1__STREAM_METRICS_REQUEST__INIT;
    rpc_client_stream *s;
    rpc_status st;
    assert_int_equal(rpc_stream_open(c, T "StreamMetrics", &q.base, &s, &st), 0);
    for (int i = 0; i < n; i++) {
        ProtobufCMessage *e;
        assert_int_equal(rpc_stream_next(s, &moetrain__v1__metrics_event__descriptor, &e, NULL, &st),
                         1);
        protobuf_c_message_free_unpacked(e, NULL);
    }
    return s;
}

static void test_vanishing_clients(void **state)
{
    (void)state;
    rpc_client *c = client(TOKEN, NULL);
    rpc_status st;
    const char *name = "name=vanish";
    assert_int_equal(start_job(c, &name, 1, NULL, &st), 0);
    /* a subscriber that cancels mid-stream */
    rpc_client_stream *s = subscribe(c, 3);
    rpc_stream_close(s);
    /* one whose process dies mid-stream: the CLI's watch, killed */
    char out[1200], exe[1200];
    snprintf(out, sizeof out, "%s/watch.out", tmp);
    snprintf(exe, sizeof exe, "%s/service/moetrain", bin);
    pid_t child = fork();
    if (child == 0) {
        if (!freopen(out, "w", stdout)) _exit(127);
        execl(exe, exe, "--server", addr, "watch", (char *)NULL);
        _exit(127);
    }
    for (int i = 0;; i++) {
        assert_true(i < 600);
        FILE *f = fopen(out, "r");
        int lines = 0;
        if (f) {
            for (int ch; (ch = fgetc(f)) != EOF;) lines += ch == '\n';
            fclose(f);
        }
        if (lines >= 2) break;
        sleep_ms(100);
    }
    kill(child, SIGKILL);
    int ws;
    waitpid(child, &ws, 0);
    assert_true(WIFSIGNALED(ws));
    /* the daemon forgets both and keeps training and serving */
    Moetrain__V1__GetStatusResponse *r = NULL;
    for (int i = 0; i < 100; i++) {
        if (r) protobuf_c_message_free_unpacked(&r->base, NULL);
        r = status(c);
        if (r->subscribers == 0) break;
        sleep_ms(100);
    }
    assert_int_equal(r->subscribers, 0);
    int64_t step = r->step;
    protobuf_c_message_free_unpacked(&r->base, NULL);
    for (int i = 0; i < 200; i++) {
        r = status(c);
        int moved = r->step > step;
        protobuf_c_message_free_unpacked(&r->base, NULL);
        if (moved) break;
        assert_true(i < 199);
        sleep_ms(100);
    }
    /* a start while running is refused; the stop is answered */
    assert_int_equal(start_job(c, &name, 1, NULL, &st), GRPC_STATUS_FAILED_PRECONDITION);
    assert_contains(st.detail, "RUNNING");
    assert_int_equal(empty_call(c, T "StopJob", &moetrain__v1__stop_job_request__descriptor,
                                &moetrain__v1__stop_job_response__descriptor, &st),
                     0);
    rpc_client_close(c);
}

static void test_health(void **state)
{
    (void)state;
    rpc_client *c = client(NULL, NULL);
    rpc_status st;
    Grpc__Health__V1__HealthCheckRequest q = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    Grpc__Health__V1__HealthCheckResponse *r;
    const char *known[] = {"", "moetrain.v1.Trainer"};
    for (int i = 0; i < 2; i++) {
        q.service = (char *)known[i];
        assert_int_equal(rpc_client_call(c, "/grpc.health.v1.Health/Check", &q.base,
                                         &grpc__health__v1__health_check_response__descriptor,
                                         (ProtobufCMessage **)&r, 30, &st),
                         0);
        assert_int_equal(r->status, GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
        protobuf_c_message_free_unpacked(&r->base, NULL);
    }
    q.service = "no.such.Service";
    assert_int_equal(rpc_client_call(c, "/grpc.health.v1.Health/Check", &q.base, NULL,
                                     (ProtobufCMessage **)&r, 30, &st),
                     GRPC_STATUS_NOT_FOUND);
    /* Watch: the current status at once, the call stays open */
    rpc_client_stream *s;
    q.service = "";
    assert_int_equal(rpc_stream_open(c, "/grpc.health.v1.Health/Watch", &q.base, &s, &st), 0);
    assert_int_equal(rpc_stream_next(s, &grpc__health__v1__health_check_response__descriptor,
                                     (ProtobufCMessage **)&r, NULL, &st),
                     1);
    assert_int_equal(r->status, GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    rpc_stream_close(s);
    rpc_client_close(c);
}

/* Waits until no job is resident (IDLE or FAILED). */
static void wait_not_running(rpc_client *c)
{
    for (int i = 0;; i++) {
        assert_true(i < 600);
        Moetrain__V1__GetStatusResponse *r = status(c);
        int busy = r->state == MOETRAIN__V1__JOB_STATE__JOB_STATE_RUNNING ||
                   r->state == MOETRAIN__V1__JOB_STATE__JOB_STATE_PAUSED ||
                   r->state == MOETRAIN__V1__JOB_STATE__JOB_STATE_STOPPING;
        protobuf_c_message_free_unpacked(&r->base, NULL);
        if (!busy) return;
        sleep_ms(100);
    }
}

/* Issue 21, defect 6: StartJob from a checkpoint whose index was damaged
 * after the commit answers DATA_LOSS naming the file; with
 * init.fallback=true the job starts from the older step. */
static void test_damaged_checkpoint(void **state)
{
    (void)state;
    char cmd[8192], root[1200], idx[1300];
    snprintf(root, sizeof root, "%s/wd/checkpoints/damaged", tmp);
    snprintf(cmd, sizeof cmd,
             "%s/tests/ckpt_run --job %s/tiny-cpu.json --threads 1 --set data.path=%s "
             "--set batch.seq_len=32 --set train.steps=2 --set lr_schedule.warmup_steps=1 "
             "--set data.valid_interval=0 "
             "--set checkpoint.dir=%s --set checkpoint.interval=1 2> %s/ckpt_run.log",
             bin, examples, data, root, tmp);
    assert_int_equal(system(cmd), 0);
    snprintf(idx, sizeof idx, "%s/step_00000002/index.h5", root);
    assert_int_equal(mt_test_damage_index(idx), 0);
    rpc_client *c = client(TOKEN, NULL);
    wait_not_running(c);
    rpc_status st;
    const char *sets[] = {"checkpoint.dir=checkpoints/damaged", "init.fallback=true"};
    assert_int_equal(start_job(c, sets, 1, "latest", &st), GRPC_STATUS_DATA_LOSS);
    assert_contains(st.detail, "step_00000002/index.h5");
    assert_int_equal(start_job(c, sets, 2, "latest", &st), 0);
    Moetrain__V1__GetStatusResponse *r = status(c);
    assert_true(r->step >= 1);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    assert_int_equal(empty_call(c, T "StopJob", &moetrain__v1__stop_job_request__descriptor,
                                &moetrain__v1__stop_job_response__descriptor, &st),
                     0);
    wait_not_running(c);
    rpc_client_close(c);
}

/* Last: restart the daemon with TLS. */
static void test_tls(void **state)
{
    (void)state;
    assert_int_equal(stop_daemon(), 0);
    char cmd[4096], cert[1200], key[1200];
    snprintf(cert, sizeof cert, "%s/cert.pem", tmp);
    snprintf(key, sizeof key, "%s/key.pem", tmp);
    snprintf(cmd, sizeof cmd,
             "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=localhost "
             "-addext subjectAltName=IP:127.0.0.1,DNS:localhost -keyout %s -out %s "
             "> /dev/null 2>&1",
             key, cert);
    if (system(cmd) != 0) skip();
    const char *tls[] = {"--tls-cert", cert, "--tls-key", key};
    assert_int_equal(start_daemon(tls, 4), 0);
    rpc_client *c = client(NULL, cert);
    Moetrain__V1__GetStatusResponse *s = status(c);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    rpc_client_close(c);
    /* plaintext to a TLS port cannot connect */
    c = client(NULL, NULL);
    rpc_status st;
    ProtobufCMessage *r;
    Moetrain__V1__GetStatusRequest q = MOETRAIN__V1__GET_STATUS_REQUEST__INIT;
    assert_int_equal(rpc_client_call(c, T "GetStatus", &q.base, NULL, &r, 10, &st),
                     GRPC_STATUS_UNAVAILABLE);
    rpc_client_close(c);
}

int main(int argc, char **argv)
{
    examples = argc > 1 ? argv[1] : "deploy/examples";
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_garbage),     cmocka_unit_test(test_token),
        cmocka_unit_test(test_wrong_state), cmocka_unit_test(test_bad_specs),
        cmocka_unit_test(test_nonfinite_and_bad_utf8),
        cmocka_unit_test(test_links_out_of_workdir),
        cmocka_unit_test(test_vanishing_clients), cmocka_unit_test(test_health),
        cmocka_unit_test(test_damaged_checkpoint), cmocka_unit_test(test_tls),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
