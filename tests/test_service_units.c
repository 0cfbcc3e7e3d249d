/* test_service_units.c - the service's pieces without a server: workdir
 * confinement (a link at each component), tokens, the metrics hub (replay,
 * gaps, no duplicates), the reflection index of the embedded descriptors,
 * the request decoders on garbage, job admission, the Prometheus page, JSON
 * of messages, the order of a StartJob reply and its hub event. */
#define _XOPEN_SOURCE 700
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>

#include "api/api_descriptors.h"
#include "base/mt_fs.h"
#include "base/mt_status.h"
#include "moetrain.pb-c.h"
#include "service/auth.h"
#include "runtime/runtime.h"
#include "service/control.h"
#include "service/job_admit.h"
#include "service/metrics_hub.h"
#include "service/pb_json.h"
#include "service/prom.h"
#include "service/reflection.h"
#include "service/rpc_method.h"
#include "service/service.h"
#include "service/svc_text.h"
#include "service/workdir.h"
#include "test_util.h"

static char tmp[1024];
static char root[1024];

static int setup(void **state)
{
    (void)state;
    mt_test_tmpdir(tmp, sizeof tmp, "test_service_units");
    char wd[1100];
    snprintf(wd, sizeof wd, "%s/wd", tmp);
    return wd_open(wd, root, sizeof root) == MT_OK ? 0 : -1;
}

static void test_names(void **state)
{
    (void)state;
    assert_int_equal(wd_check_name("step_00000012", "name"), MT_OK);
    assert_int_equal(wd_check_name("tiny-cpu.v2", "name"), MT_OK);
    const char *bad[] = {"", ".", "..", ".hidden", "a/b", "../x", "a b", "x\n", "/abs"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(wd_check_name(bad[i], "name"), MT_EINVAL);
        assert_contains(mt_errmsg(), "name:");
    }
}

static void test_resolve(void **state)
{
    (void)state;
    char out[1200], p[1200];
    assert_int_equal(wd_resolve(root, "checkpoints/job", "f", out, sizeof out), MT_OK);
    snprintf(p, sizeof p, "%s/checkpoints/job", root);
    assert_string_equal(out, p);
    assert_int_equal(wd_resolve(root, "./a//b/./c", "f", out, sizeof out), MT_OK);
    snprintf(p, sizeof p, "%s/a/b/c", root);
    assert_string_equal(out, p);
    snprintf(p, sizeof p, "%s/inside", root);
    assert_int_equal(wd_resolve(root, p, "f", out, sizeof out), MT_OK);
    assert_int_equal(wd_resolve(root, "../escape", "f", out, sizeof out), MT_EINVAL);
    assert_int_equal(wd_resolve(root, "a/../../escape", "f", out, sizeof out), MT_EINVAL);
    assert_int_equal(wd_resolve(root, "/etc", "checkpoint.dir", out, sizeof out), MT_EINVAL);
    assert_contains(mt_errmsg(), "checkpoint.dir");
    /* a prefix of the root's name is not the root */
    snprintf(p, sizeof p, "%s-other/x", root);
    assert_int_equal(wd_resolve(root, p, "f", out, sizeof out), MT_EINVAL);
    /* a symbolic link inside that points outside */
    char link[1200];
    snprintf(link, sizeof link, "%s/evil", root);
    assert_int_equal(symlink(tmp, link), 0);
    assert_int_equal(wd_resolve(root, "evil/x", "f", out, sizeof out), MT_EINVAL);
    assert_contains(mt_errmsg(), "symbolic link");
    /* and one that stays inside is fine */
    snprintf(p, sizeof p, "%s/real", root);
    mkdir(p, 0755);
    snprintf(link, sizeof link, "%s/alias", root);
    assert_int_equal(symlink(p, link), 0);
    assert_int_equal(wd_resolve(root, "alias/x", "f", out, sizeof out), MT_OK);
}

/* mkdir -p of root/rel, then a symbolic link root/link -> target. */
static void tree_with_link(const char *rel, const char *link, const char *target)
{
    char p[1400];
    if (rel) {
        snprintf(p, sizeof p, "%s/%s", root, rel);
        assert_int_equal(mt_mkdir_p(p), MT_OK);
    }
    snprintf(p, sizeof p, "%s/%s", root, link);
    char parent[1400];
    snprintf(parent, sizeof parent, "%s", p);
    *strrchr(parent, '/') = '\0';
    assert_int_equal(mt_mkdir_p(parent), MT_OK);
    assert_int_equal(symlink(target, p), 0);
}

static int confine(const char *path, int flags, char *out, size_t cap)
{
    return wd_confine(root, path, "f", flags, out, cap, NULL);
}

/* Issue 21, defect 3: the one confinement of request paths refuses a link
 * leading out at every component of a path (first, middle, last; absolute
 * or relative target; a dangling one too), follows links that stay inside,
 * never climbs above the workdir, and pins what it resolved. */
static void test_confine_link_at_each_component(void **state)
{
    (void)state;
    char out[1400], p[1400], outside[1200];
    snprintf(outside, sizeof outside, "%s/outside", tmp);
    assert_int_equal(mt_mkdir_p(outside), MT_OK);
    snprintf(p, sizeof p, "%s/b/c", outside);
    assert_int_equal(mt_mkdir_p(p), MT_OK);
    const int modes[] = {0, WD_MISSING_OK, WD_MKDIRS, WD_MISSING_OK | WD_FILE};
    /* a link out at component 1, 2 and 3 of "cK/a/b/c" */
    tree_with_link(NULL, "c1/a", outside);
    tree_with_link("c2/a", "c2/a/b", outside);
    tree_with_link("c3/a/b", "c3/a/b/c", outside);
    tree_with_link("c4/a/b", "c4/a/b/c", "/nonexistent-outside"); /* dangling */
    tree_with_link(NULL, "c5/a", "../../.."); /* relative, climbing above the workdir */
    tree_with_link("c6/a", "c6/a/b", "../../../outside");
    for (int m = 0; m < 4; m++) {
        for (int k = 1; k <= 6; k++) {
            char path[64];
            snprintf(path, sizeof path, "c%d/a/b/c", k);
            int rc = confine(path, modes[m], out, sizeof out);
            if (rc != MT_EINVAL) fprintf(stderr, "%s (flags %d): %d %s\n", path, modes[m], rc, out);
            assert_int_equal(rc, MT_EINVAL);
            assert_contains(mt_errmsg(), "leads outside the workdir through a symbolic link");
            assert_contains(mt_errmsg(), "f: ");
        }
    }
    /* nothing was created outside by WD_MKDIRS */
    snprintf(p, sizeof p, "%s/b/c/c", outside);
    assert_int_not_equal(access(p, F_OK), 0);
    /* links that stay inside are followed, to the canonical place */
    tree_with_link("real7/a", "c7/x", "../real7"); /* relative, with ".." */
    assert_int_equal(confine("c7/x/a", 0, out, sizeof out), MT_OK);
    snprintf(p, sizeof p, "%s/real7/a", root);
    assert_string_equal(out, p);
    snprintf(p, sizeof p, "%s/real7", root);
    tree_with_link(NULL, "c8/x", p); /* absolute, inside */
    assert_int_equal(confine("c8/x/a/new", WD_MISSING_OK, out, sizeof out), MT_OK);
    snprintf(p, sizeof p, "%s/real7/a/new", root);
    assert_string_equal(out, p);
    /* a loop, a file where a folder is needed, what must exist */
    tree_with_link(NULL, "c9/a", "b");
    tree_with_link(NULL, "c9/b", "a");
    assert_int_equal(confine("c9/a/x", WD_MISSING_OK, out, sizeof out), MT_EINVAL);
    assert_contains(mt_errmsg(), "more than 40 symbolic links");
    snprintf(p, sizeof p, "%s/c10", root);
    assert_int_equal(mt_mkdir_p(p), MT_OK);
    snprintf(p, sizeof p, "%s/c10/file", root);
    mt_test_write_file(p, "x");
    assert_int_equal(confine("c10/file/x", WD_MISSING_OK, out, sizeof out), MT_EINVAL);
    assert_contains(mt_errmsg(), "is not a directory");
    assert_int_equal(confine("c10/file", WD_FILE, out, sizeof out), MT_OK);
    assert_int_equal(confine("c10/missing", 0, out, sizeof out), MT_ENOTFOUND);
    /* WD_MKDIRS makes the folders */
    assert_int_equal(confine("c11/x/y", WD_MKDIRS, out, sizeof out), MT_OK);
    struct stat st;
    assert_int_equal(stat(out, &st), 0);
    assert_true(S_ISDIR(st.st_mode));
    /* the descriptor pins the folder: replaced by a link to outside after
     * the check, the pinned name still writes into the original folder */
    int fd;
    assert_int_equal(wd_confine(root, "c11/x/y", "f", 0, out, sizeof out, &fd), MT_OK);
    assert_true(fd >= 0);
    char moved[1500], via[64], file[200];
    snprintf(moved, sizeof moved, "%s.moved", out);
    assert_int_equal(rename(out, moved), 0);
    assert_int_equal(symlink(outside, out), 0);
    wd_fd_path(fd, out, via, sizeof via);
    snprintf(file, sizeof file, "%s/written", via);
    mt_test_write_file(file, "pinned\n");
    close(fd);
    snprintf(p, sizeof p, "%s/written", moved);
    assert_int_equal(access(p, F_OK), 0);
    snprintf(p, sizeof p, "%s/written", outside);
    assert_int_not_equal(access(p, F_OK), 0);
    /* and once replaced, the name is refused */
    assert_int_equal(confine("c11/x/y", 0, out, sizeof out), MT_EINVAL);
}

static void test_auth(void **state)
{
    (void)state;
    char f[1200];
    snprintf(f, sizeof f, "%s/token", tmp);
    mt_test_write_file(f, "  0123456789abcdef-token \n");
    auth a;
    assert_int_equal(auth_load(&a, f), MT_OK);
    const char *good = "Bearer 0123456789abcdef-token";
    assert_true(auth_check(&a, good, strlen(good)));
    const char *bad[] = {"Bearer 0123456789abcdef-tokeN", "bearer 0123456789abcdef-token",
                         "Bearer 0123456789abcdef-toke", "Bearer 0123456789abcdef-token ", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_false(auth_check(&a, bad[i], strlen(bad[i])));
    assert_false(auth_check(&a, NULL, 0));
    mt_test_write_file(f, "short\n");
    assert_int_equal(auth_load(&a, f), MT_EINVAL);
    auth off = {0};
    assert_true(auth_check(&off, NULL, 0));
}

static void step_event(hub_event *e, uint64_t run, int64_t step)
{
    memset(e, 0, sizeof *e);
    e->run_id = run;
    e->kind = HUB_STEP;
    e->u.step.step = step;
}

static void test_hub(void **state)
{
    (void)state;
    metrics_hub *h;
    assert_int_equal(hub_create(&h, 8), MT_OK);
    hub_event e, got;
    uint64_t run, missed;
    assert_int_equal(hub_cursor_start(h, 0, &run), 1);
    for (int s = 1; s <= 5; s++) {
        step_event(&e, 1, s);
        hub_publish(h, &e);
    }
    /* a reader that keeps up sees every event once, in order */
    uint64_t cur = hub_cursor_start(h, 0, &run);
    assert_int_equal(run, 1);
    for (int s = 1; s <= 5; s++) {
        assert_int_equal(hub_read(h, &cur, &got, &missed), 1);
        assert_int_equal(missed, 0);
        assert_int_equal(got.u.step.step, s);
        assert_int_equal(got.seq, (uint64_t)s);
    }
    assert_int_equal(hub_read(h, &cur, &got, &missed), 0);
    /* a second run: a new subscriber replays only it */
    for (int s = 1; s <= 3; s++) {
        step_event(&e, 2, s);
        hub_publish(h, &e);
    }
    uint64_t c2 = hub_cursor_start(h, 0, &run);
    assert_int_equal(run, 2);
    assert_int_equal(hub_read(h, &c2, &got, &missed), 1);
    assert_int_equal(got.run_id, 2);
    assert_int_equal(got.u.step.step, 1);
    /* all_runs replays what the ring holds: 8 of the 8 events */
    uint64_t c3 = hub_cursor_start(h, 1, NULL);
    assert_int_equal(c3, 1);
    /* a slow reader is told what it missed and goes on without duplicates */
    for (int s = 4; s <= 20; s++) {
        step_event(&e, 2, s);
        hub_publish(h, &e);
    }
    assert_int_equal(hub_read(h, &cur, &got, &missed), 1);
    assert_true(missed > 0);
    uint64_t prev = got.seq;
    while (hub_read(h, &cur, &got, &missed) == 1) {
        assert_int_equal(missed, 0);
        assert_int_equal(got.seq, prev + 1);
        prev = got.seq;
    }
    hub_close(h);
    assert_int_equal(hub_read(h, &cur, &got, &missed), -1);
    hub_destroy(h);
}

static void test_reflection_index(void **state)
{
    (void)state;
    reflection *r;
    assert_int_equal(reflection_create(&r, mt_api_descriptor_set, mt_api_descriptor_set_len),
                     MT_OK);
    int f = reflection_file_by_name(r, "moetrain.proto");
    assert_true(f >= 0);
    assert_int_equal(reflection_file_by_symbol(r, "moetrain.v1.Trainer"), f);
    assert_int_equal(reflection_file_by_symbol(r, "moetrain.v1.Trainer.StartJob"), f);
    assert_int_equal(reflection_file_by_symbol(r, "moetrain.v1.JobSpec"), f);
    assert_int_equal(reflection_file_by_symbol(r, ".moetrain.v1.StepMetrics"), f);
    assert_int_equal(reflection_file_by_symbol(r, "moetrain.v1.JobSpec.json"), f);
    assert_int_equal(reflection_file_by_symbol(r, "moetrain.v1.JOB_STATE_PAUSED"), f);
    assert_int_equal(reflection_file_by_symbol(r, "moetrain.v1.MetricsEvent.event"), f);
    assert_true(reflection_file_by_symbol(r, "grpc.health.v1.Health") >= 0);
    assert_true(reflection_file_by_symbol(
                    r, "grpc.health.v1.HealthCheckResponse.ServingStatus") >= 0);
    assert_int_equal(reflection_file_by_symbol(r, "moetrain.v1.Nope"), -1);
    assert_true(reflection_is_message(r, "moetrain.v1.JobSpec"));
    assert_false(reflection_is_message(r, "moetrain.v1.Trainer"));
    const char *want[] = {"moetrain.v1.Trainer", "grpc.health.v1.Health",
                          "grpc.reflection.v1.ServerReflection",
                          "grpc.reflection.v1alpha.ServerReflection"};
    assert_int_equal(reflection_n_services(r), 4);
    for (int i = 0; i < 4; i++) {
        int found = 0;
        for (int k = 0; k < 4; k++) found |= !strcmp(reflection_service(r, k), want[i]);
        assert_true(found);
    }
    int idx[8];
    assert_int_equal(reflection_closure(r, f, idx, 8), 1); /* no imports */
    reflection_destroy(r);
    /* a truncated set is refused, not read past its end */
    assert_int_equal(reflection_create(&r, mt_api_descriptor_set, 100), MT_ECORRUPT);
}

static void test_decoders(void **state)
{
    (void)state;
    int n;
    const rpc_method *m = rpc_methods(&n);
    assert_int_equal(n, 9 + 1 + 2 + 2); /* Trainer, Evaluate, Health, reflection */
    const uint8_t garbage[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    for (int i = 0; i < n; i++) {
        rpc_reply r;
        memset(&r, 0, sizeof r);
        ProtobufCMessage *req;
        assert_int_equal(rpc_decode(&m[i], garbage, sizeof garbage, &req, &r),
                         RPC_INVALID_ARGUMENT);
        assert_null(req);
        assert_contains(r.detail, "not a valid");
    }
    const rpc_method *start = rpc_method_find("/moetrain.v1.Trainer/StartJob", 29);
    assert_non_null(start);
    assert_true(start->mutating);
    assert_false(rpc_method_find("/moetrain.v1.Trainer/GetStatus", 30)->mutating);
    /* decoded but invalid: the message names the field */
    struct {
        const char *json, *set, *from, *want;
    } cases[] = {
        {"{", NULL, "", "spec.json"},
        {"[1]", NULL, "", "spec.json"},
        {"{}", "no-equals", "", "spec.set[0]"},
        {"{}", NULL, "../x", "from_checkpoint"},
        {"", NULL, "", "spec"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        Moetrain__V1__JobSpec spec = MOETRAIN__V1__JOB_SPEC__INIT;
        Moetrain__V1__StartJobRequest q = MOETRAIN__V1__START_JOB_REQUEST__INIT;
        char *set = (char *)cases[i].set;
        spec.json = (char *)cases[i].json;
        if (set) {
            spec.n_set = 1;
            spec.set = &set;
        }
        q.spec = &spec;
        q.from_checkpoint = (char *)cases[i].from;
        uint8_t buf[512];
        size_t len = protobuf_c_message_pack(&q.base, buf);
        rpc_reply r;
        memset(&r, 0, sizeof r);
        ProtobufCMessage *req;
        assert_int_equal(rpc_decode(start, buf, len, &req, &r), RPC_INVALID_ARGUMENT);
        assert_contains(r.detail, cases[i].want);
    }
}

static void test_strip(void **state)
{
    (void)state;
    char out[256];
    svc_strip_locations("job spec: jobspec.c:231: batch.seq_len: 5 exceeds x.y:1", out,
                        sizeof out);
    assert_string_equal(out, "job spec: batch.seq_len: 5 exceeds x.y:1");
}

/* The spec of a tiny CPU job on a synthetic corpus (made once in tmp/syn). */
static void tiny_job_json(char *json, size_t cap)
{
    char data[1200], probe[1300];
    snprintf(data, sizeof data, "%s/syn", tmp);
    snprintf(probe, sizeof probe, "%s.bin", data);
    if (access(probe, F_OK) != 0)
        assert_int_equal(mt_test_synth(data, "--vocab 64 --tokens 20000 --seed 1"), 0);
    snprintf(json, cap,
             "{\"name\": \"t\", \"model\": {\"vocab_size\": 64, \"hidden_size\": 64, "
             "\"intermediate_size\": 128, \"moe_intermediate_size\": 32, \"num_hidden_layers\": 2,"
             " \"num_attention_heads\": 2, \"q_lora_rank\": 32, \"kv_lora_rank\": 32, "
             "\"qk_nope_head_dim\": 16, \"qk_rope_head_dim\": 16, \"v_head_dim\": 16, "
             "\"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"n_group\": 1, "
             "\"topk_group\": 1, \"first_k_dense_replace\": 1, \"max_position_embeddings\": 128}, "
             "\"batch\": {\"seq_len\": 32}, \"data\": {\"path\": \"%s\"}, "
             "\"train\": {\"steps\": 3}}",
             data);
}

static void test_admit(void **state)
{
    (void)state;
    char json[2048];
    tiny_job_json(json, sizeof json);
    mt_jobspec j;
    job_request r = {.json = json};
    int rc = job_admit(root, &r, &j);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
    char want[1200];
    snprintf(want, sizeof want, "%s/checkpoints/t", root);
    assert_string_equal(j.checkpoint.dir, want);
    const char *escape[] = {"checkpoint.dir=/tmp", "checkpoint.dir=../up", "name=../x",
                            "name=a b"};
    for (int i = 0; i < 4; i++) {
        r.sets = &escape[i];
        r.n_sets = 1;
        assert_int_equal(job_admit(root, &r, &j), MT_EINVAL);
    }
    const char *in_wd = "checkpoint.dir=mine/here";
    r.sets = &in_wd;
    assert_int_equal(job_admit(root, &r, &j), MT_OK);
    snprintf(want, sizeof want, "%s/mine/here", root);
    assert_string_equal(j.checkpoint.dir, want);
    const char *bad_field = "batch.micro_batch_size=3";
    r.sets = &bad_field;
    assert_int_equal(job_admit(root, &r, &j), MT_EINVAL);
    assert_contains(mt_errmsg(), "batch.global_batch_size");
    /* a setting the trainer does not run on these ranks is refused at
     * admission, naming the field, not started and failed on every rank */
    const char *grads_dp[] = {"parallel.dp=2", "precision.grads=bf16"};
    r.sets = grads_dp;
    r.n_sets = 2;
    r.world = 2;
    assert_int_equal(job_admit(root, &r, &j), MT_EINVAL);
    assert_contains(mt_errmsg(), "precision.grads");
    assert_contains(mt_errmsg(), "bf16 runs on one rank only");
    r.n_sets = 1; /* the same world with fp32 gradients is fine */
    r.sets = (const char *[]){"parallel.dp=2"};
    assert_int_equal(job_admit(root, &r, &j), MT_OK);
    assert_int_equal(j.parallel.dp, 2);
    r.world = 0;
    r.n_sets = 0;
    r.json = NULL;
    r.path = "../../etc/passwd";
    assert_int_equal(job_admit(root, &r, &j), MT_EINVAL);
    assert_contains(mt_errmsg(), "spec.path");
}

static void test_pb_json(void **state)
{
    (void)state;
    Moetrain__V1__GetStatusResponse m = MOETRAIN__V1__GET_STATUS_RESPONSE__INIT;
    Moetrain__V1__StepMetrics sm = MOETRAIN__V1__STEP_METRICS__INIT;
    m.state = MOETRAIN__V1__JOB_STATE__JOB_STATE_PAUSED;
    m.step = 12;
    m.job = "tiny";
    sm.valid_loss = NAN;
    m.last_metrics = &sm;
    json_t *j = pb_to_json(&m.base);
    char *s = json_dumps(j, JSON_COMPACT);
    assert_contains(s, "\"state\":\"JOB_STATE_PAUSED\"");
    assert_contains(s, "\"step\":\"12\"");
    assert_contains(s, "\"validLoss\":\"NaN\"");
    assert_contains(s, "\"lastMetrics\":{");
    free(s);
    json_decref(j);
}

static void test_prom(void **state)
{
    (void)state;
    metrics_hub *h;
    control *c;
    assert_int_equal(hub_create(&h, 16), MT_OK);
    control_opts o = {.workdir = root, .rank = 0, .world = 1, .hub = h};
    assert_int_equal(control_create(&c, &o), MT_OK);
    service sv;
    assert_int_equal(service_init(&sv, c, h, root), MT_OK);
    char *page;
    size_t len;
    assert_int_equal(prom_render(&sv, &page, &len), MT_OK);
    assert_int_equal(strlen(page), len);
    assert_contains(page, "# TYPE moetrain_steps_total counter\n");
    assert_contains(page, "moetrain_job_state{state=\"idle\"} 1\n");
    /* every sample line: a moetrain_ name, counters end in _total */
    for (char *line = strtok(page, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "# TYPE ", 7)) {
            char name[128], type[32];
            assert_int_equal(sscanf(line + 7, "%127s %31s", name, type), 2);
            assert_int_equal(strncmp(name, "moetrain_", 9), 0);
            size_t n = strlen(name);
            int total = n > 6 && !strcmp(name + n - 6, "_total");
            assert_int_equal(total, !strcmp(type, "counter"));
        }
    }
    free(page);
    service_cleanup(&sv);
    control_destroy(c);
    hub_destroy(h);
}

/* ---- the engine loop with a tiny job (rank 0 of 1, on a thread) ---------------------- */

typedef struct engine {
    control *c;
    metrics_hub *h;
    pthread_t th;
    volatile sig_atomic_t term;
    int rc;
} engine;

static void *engine_main(void *arg)
{
    engine *e = arg;
    e->rc = control_run(e->c, &e->term);
    return NULL;
}

/* The test links with -Wl,--wrap=hub_publish: every event the engine
 * publishes passes here first. While a start is armed, the RUNNING event
 * looks at the start's ticket before it enters the hub: a ticket already
 * answered means the StartJob reply could reach a client before the event. */
static struct {
    int on;                 /* a start is armed */
    ctl_ticket *t;          /* its ticket (written by control_start under its lock) */
    int answered_first;     /* its ticket was answered before the event */
    ctl_result res;         /* the answer, when answered_first */
    sem_t seen;             /* posted once the RUNNING event went by */
} armed;

uint64_t __real_hub_publish(metrics_hub *h, const hub_event *e);
uint64_t __wrap_hub_publish(metrics_hub *h, const hub_event *e);

uint64_t __wrap_hub_publish(metrics_hub *h, const hub_event *e)
{
    if (armed.on && e->kind == HUB_STATE && e->u.state.state == SVC_RUNNING) {
        armed.on = 0;
        armed.answered_first = control_ticket_poll(armed.t, &armed.res);
        uint64_t seq = __real_hub_publish(h, e);
        sem_post(&armed.seen);
        return seq;
    }
    return __real_hub_publish(h, e);
}

static ctl_result await_ticket(ctl_ticket *t)
{
    ctl_result r;
    struct timespec ms = {0, 1000000L};
    while (!control_ticket_poll(t, &r)) nanosleep(&ms, NULL);
    return r;
}

/* The reply to a start comes after the hub holds the run's RUNNING event:
 * a client that opens StreamMetrics once StartJob has answered follows its
 * own job, never a replay of the job before it (issue 22: `moetrain watch`
 * right after `moetrain start` could replay the stopped run and end at
 * once). Deterministic: the wrapped hub_publish checks the order itself. */
static void test_start_reply_after_event(void **state)
{
    (void)state;
    char json[2048];
    tiny_job_json(json, sizeof json);
    const char *sets[] = {"train.steps=100000", "train.log_interval=100000",
                          "checkpoint.dir=checkpoints/order"};
    mt_jobspec job;
    job_request req = {.json = json, .sets = sets, .n_sets = 3, .world = 1};
    assert_int_equal(job_admit(root, &req, &job), MT_OK);
    engine e = {0};
    mt_runtime *rt; /* not under mpirun: a world of this process alone */
    assert_int_equal(mt_runtime_create(&rt), MT_OK);
    assert_int_equal(hub_create(&e.h, 256), MT_OK);
    control_opts o = {.rt = rt, .workdir = root, .rank = 0, .world = 1, .threads = 1, .hub = e.h};
    assert_int_equal(control_create(&e.c, &o), MT_OK);
    assert_int_equal(sem_init(&armed.seen, 0, 0), 0);
    assert_int_equal(pthread_create(&e.th, NULL, engine_main, &e), 0);
    /* Two rounds: the second starts after a stopped run, whose IDLE event
     * is the newest until the start publishes. Failures are counted, not
     * asserted, so that the engine thread is always stopped and joined. */
    int early = 0, bad_run = 0;
    for (int round = 0; round < 2; round++) {
        armed.answered_first = 0;
        armed.on = 1;
        assert_int_equal(control_start(e.c, &job, &armed.t), MT_OK);
        while (sem_wait(&armed.seen) != 0) {
        }
        ctl_result r = armed.answered_first ? armed.res : await_ticket(armed.t);
        if (armed.answered_first)
            fprintf(stderr, "round %d: StartJob was answered (run %llu) before the hub had its "
                            "RUNNING event\n",
                    round, (unsigned long long)r.run_id);
        early += armed.answered_first;
        uint64_t run = 0;
        hub_cursor_start(e.h, 0, &run);
        bad_run += r.rc != MT_OK || run != r.run_id;
        ctl_ticket *t;
        if (control_command(e.c, CTL_STOP, 0, &t) == MT_OK) await_ticket(t);
    }
    e.term = 1;
    pthread_join(e.th, NULL);
    assert_int_equal(early, 0);
    assert_int_equal(bad_run, 0);
    assert_int_equal(e.rc, MT_OK);
    sem_destroy(&armed.seen);
    control_destroy(e.c);
    hub_destroy(e.h);
    mt_runtime_destroy(rt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),     cmocka_unit_test(test_resolve),
        cmocka_unit_test(test_confine_link_at_each_component),
        cmocka_unit_test(test_auth),      cmocka_unit_test(test_hub),
        cmocka_unit_test(test_reflection_index), cmocka_unit_test(test_decoders),
        cmocka_unit_test(test_strip),     cmocka_unit_test(test_admit),
        cmocka_unit_test(test_pb_json),   cmocka_unit_test(test_prom),
        cmocka_unit_test(test_start_reply_after_event),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
