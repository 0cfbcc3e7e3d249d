/* moetrain.c - the command-line client of moetraind.
 *
 *   moetrain [--server ADDR] [--token-file F] [--tls-ca F] [--timeout S] COMMAND ...
 *
 * Exit status: 0 ok, 1 usage, 2 cannot connect, 3 the RPC failed (the
 * message says why), 4 not serving (health), and for watch: 3 if the job
 * failed.
 */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/mt_fs.h"
#include "grpc/health/v1/health.pb-c.h"
#include "base/mt_status.h"
#include "moetrain.pb-c.h"
#include "service/auth.h"
#include "service/pb_json.h"
#include "service/rpc_client.h"

enum { EXIT_OK = 0, EXIT_USAGE = 1, EXIT_CONNECT = 2, EXIT_RPC = 3, EXIT_NOT_SERVING = 4 };

#define DEFAULT_SERVER "127.0.0.1:50051"
#define SVC "/moetrain.v1.Trainer/"
#define MAX_SETS 128

static volatile sig_atomic_t interrupted = 0;
static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moetrain [--server ADDR] [--token-file F] [--tls-ca F [--tls-name NAME]]\n"
            "                [--timeout SECONDS] COMMAND [ARGS]\n"
            "\n"
            "commands:\n"
            "  start JOB.json [--set key.path=value ...] [--from-checkpoint NAME|latest]\n"
            "  pause                      pause at the next step boundary\n"
            "  resume\n"
            "  stop [--save]              stop at the next step boundary (--save: checkpoint)\n"
            "  status [--json]\n"
            "  save                       save a checkpoint (step_NNNNNNNN) now\n"
            "  checkpoints [--job NAME] [--json]\n"
            "  reshard SOURCE TARGET [--tp N] [--pp N] [--vpp N] [--ep N] [--etp N] [--dp N]\n"
            "          [--job NAME] [--wait]\n"
            "  watch [--from STEP] [--all] [--json]   follow the job's steps live\n"
            "  eval CHECKPOINT [--tokens FILE | --job JOB.json [--set key.path=value ...]]\n"
            "       [--out FILE.npy [--logits]] [--backend cpu|cuda] [--fp32] [--batch N]\n"
            "       [--threads N]         score tokens with a checkpoint on the server (paths\n"
            "                             in its workdir; see moetrain-ckpt eval)\n"
            "  health [SERVICE]           exit 0 serving, 4 not serving\n"
            "\n"
            "--server defaults to $MOETRAIN_SERVER or " DEFAULT_SERVER "; --token-file to\n"
            "$MOETRAIN_TOKEN_FILE. Exit status: 0 ok, 1 usage, 2 cannot connect, 3 the call\n"
            "failed, 4 not serving.\n");
}

typedef struct cli {
    rpc_client *c;
    double timeout;
    int json;
} cli;

static const char *code_name(int code)
{
    static const char *const n[] = {
        "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
        "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
        "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
        "UNAUTHENTICATED"};
    return code >= 0 && code <= 16 ? n[code] : "UNKNOWN";
}

/* Prints a failed call and maps it to the exit status. */
static int failed(const char *what, const rpc_status *st)
{
    if (st->code == 14 /* UNAVAILABLE */ && !st->connected) {
        fprintf(stderr, "moetrain: %s: cannot connect to the server: %s\n", what, st->detail);
        return EXIT_CONNECT;
    }
    fprintf(stderr, "moetrain: %s: %s: %s\n", what, code_name(st->code), st->detail);
    return EXIT_RPC;
}

static int call(cli *k, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp, double timeout)
{
    rpc_status st;
    char path[128];
    snprintf(path, sizeof path, SVC "%s", method);
    if (rpc_client_call(k->c, path, req, rd, resp, timeout > 0 ? timeout : k->timeout, &st) != 0)
        return failed(method, &st);
    return EXIT_OK;
}

static void print_json(const ProtobufCMessage *m)
{
    json_t *j = pb_to_json(m);
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    if (s) puts(s);
    free(s);
    json_decref(j);
}

static const char *state_name(Moetrain__V1__JobState s)
{
    switch (s) {
    case MOETRAIN__V1__JOB_STATE__JOB_STATE_IDLE: return "IDLE";
    case MOETRAIN__V1__JOB_STATE__JOB_STATE_RUNNING: return "RUNNING";
    case MOETRAIN__V1__JOB_STATE__JOB_STATE_PAUSED: return "PAUSED";
    case MOETRAIN__V1__JOB_STATE__JOB_STATE_STOPPING: return "STOPPING";
    case MOETRAIN__V1__JOB_STATE__JOB_STATE_FAILED: return "FAILED";
    default: return "UNSPECIFIED";
    }
}

static void format_bytes(double b, char *out, size_t cap)
{
    const char *u[] = {"B", "KB", "MB", "GB", "TB"};
    int i = 0;
    while (b >= 1000 && i < 4) {
        b /= 1000;
        i++;
    }
    snprintf(out, cap, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

static void layout_text(const Moetrain__V1__Layout *l, char *out, size_t cap)
{
    if (!l) {
        snprintf(out, cap, "-");
        return;
    }
    snprintf(out, cap, "tp=%d pp=%d vpp=%d ep=%d etp=%d dp=%d (%s)", l->tp, l->pp, l->vpp, l->ep,
             l->etp, l->dp, l->schedule);
}

/* ---- commands ------------------------------------------------------------------------- */


static int cmd_start(cli *k, int argc, char **argv)
{
    const char *file = NULL, *from = "";
    char *sets[MAX_SETS];
    size_t n_sets = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--set") && i + 1 < argc) {
            if (n_sets == MAX_SETS) {
                fprintf(stderr, "moetrain start: too many --set\n");
                return EXIT_USAGE;
            }
            sets[n_sets++] = argv[++i];
        } else if (!strcmp(argv[i], "--from-checkpoint") && i + 1 < argc) {
            from = argv[++i];
        } else if (argv[i][0] != '-' && !file) {
            file = argv[i];
        } else {
            fprintf(stderr, "moetrain start: unexpected '%s'\n", argv[i]);
            return EXIT_USAGE;
        }
    }
    if (!file) {
        fprintf(stderr, "moetrain start: give a job spec file (JOB.json)\n");
        return EXIT_USAGE;
    }
    char *text = mt_read_text_file(file);
    if (!text) {
        fprintf(stderr, "moetrain start: %s: %s\n", file, strerror(errno));
        return EXIT_USAGE;
    }
    /* Relative data paths in the file are relative to its folder: send it. */
    char dir[PATH_MAX], base[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", file);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    else snprintf(dir, sizeof dir, ".");
    if (!realpath(dir, base)) snprintf(base, sizeof base, "%s", dir);

    Moetrain__V1__JobSpec spec = MOETRAIN__V1__JOB_SPEC__INIT;
    spec.json = text;
    spec.n_set = n_sets;
    spec.set = sets;
    spec.base_dir = base;
    Moetrain__V1__StartJobRequest req = MOETRAIN__V1__START_JOB_REQUEST__INIT;
    req.spec = &spec;
    req.from_checkpoint = (char *)from;
    Moetrain__V1__StartJobResponse *r;
    int rc = call(k, "StartJob", &req.base, &moetrain__v1__start_job_response__descriptor,
                  (ProtobufCMessage **)&r, k->timeout > 600 ? k->timeout : 600);
    free(text);
    if (rc) return rc;
    if (k->json) print_json(&r->base);
    else
        printf("started job %s (run %llu) at step %lld of %lld\n", r->job,
               (unsigned long long)r->run_id, (long long)r->start_step, (long long)r->total_steps);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return EXIT_OK;
}

static int no_args(const char *cmd, int argc, char **argv)
{
    if (argc > 0) {
        fprintf(stderr, "moetrain %s: unexpected '%s'\n", cmd, argv[0]);
        return EXIT_USAGE;
    }
    return EXIT_OK;
}

static int cmd_pause(cli *k, int argc, char **argv)
{
    if (no_args("pause", argc, argv)) return EXIT_USAGE;
    Moetrain__V1__PauseJobRequest req = MOETRAIN__V1__PAUSE_JOB_REQUEST__INIT;
    Moetrain__V1__PauseJobResponse *r;
    int rc = call(k, "PauseJob", &req.base, &moetrain__v1__pause_job_response__descriptor,
                  (ProtobufCMessage **)&r, 0);
    if (rc) return rc;
    if (k->json) print_json(&r->base);
    else printf("paused at step %lld\n", (long long)r->step);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return EXIT_OK;
}

static int cmd_resume(cli *k, int argc, char **argv)
{
    if (no_args("resume", argc, argv)) return EXIT_USAGE;
    Moetrain__V1__ResumeJobRequest req = MOETRAIN__V1__RESUME_JOB_REQUEST__INIT;
    Moetrain__V1__ResumeJobResponse *r;
    int rc = call(k, "ResumeJob", &req.base, &moetrain__v1__resume_job_response__descriptor,
                  (ProtobufCMessage **)&r, 0);
    if (rc) return rc;
    if (k->json) print_json(&r->base);
    else printf("resumed at step %lld\n", (long long)r->step);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return EXIT_OK;
}

static int cmd_stop(cli *k, int argc, char **argv)
{
    Moetrain__V1__StopJobRequest req = MOETRAIN__V1__STOP_JOB_REQUEST__INIT;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--save")) {
            req.save = 1;
        } else {
            fprintf(stderr, "moetrain stop: unexpected '%s'\n", argv[i]);
            return EXIT_USAGE;
        }
    }
    Moetrain__V1__StopJobResponse *r;
    int rc = call(k, "StopJob", &req.base, &moetrain__v1__stop_job_response__descriptor,
                  (ProtobufCMessage **)&r, k->timeout > 600 ? k->timeout : 600);
    if (rc) return rc;
    if (k->json) {
        print_json(&r->base);
    } else if (r->checkpoint) {
        printf("stopped at step %lld; checkpoint %s saved (%s)\n", (long long)r->step,
               r->checkpoint->name, r->checkpoint->path);
    } else {
        printf("stopped at step %lld\n", (long long)r->step);
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return EXIT_OK;
}

/* Every rank's last step; past 16 ranks only the slowest and the one with
 * the highest peak memory. */
static void print_ranks(const Moetrain__V1__GetStatusResponse *r)
{
    const size_t n = r->n_rank_stats;
    if (!n) return;
    size_t most = 0;
    for (size_t i = 1; i < n; i++)
        if (r->rank_stats[i]->mem_peak > r->rank_stats[most]->mem_peak) most = i;
    for (size_t i = 0; i < n; i++) {
        const Moetrain__V1__RankStats *s = r->rank_stats[i];
        const int slowest = s->rank == r->slowest_rank;
        if (n > 16 && !slowest && i != most) continue;
        char mem[32], peak[32], label[16];
        format_bytes((double)s->mem_in_use, mem, sizeof mem);
        format_bytes((double)s->mem_peak, peak, sizeof peak);
        snprintf(label, sizeof label, "rank %d", s->rank);
        printf("%-11s step %lld: %.0f ms (own work %.0f ms), memory %s, peak %s%s\n", label,
               (long long)s->step, s->step_ms, s->compute_ms, mem, peak,
               slowest && n > 1 ? "  <- slowest" : "");
    }
    if (n > 16) printf("            (%zu ranks: the slowest and the highest peak shown)\n", n);
}

static void print_status(const Moetrain__V1__GetStatusResponse *r)
{
    char lay[160];
    if (r->outcome[0] && r->state == MOETRAIN__V1__JOB_STATE__JOB_STATE_IDLE)
        printf("state       %s (the last job %s)\n", state_name(r->state), r->outcome);
    else
        printf("state       %s\n", state_name(r->state));
    if (r->job[0]) printf("job         %s (run %llu)\n", r->job, (unsigned long long)r->run_id);
    if (r->total_steps > 0)
        printf("step        %lld / %lld (%.1f%%)\n", (long long)r->step, (long long)r->total_steps,
               100.0 * (double)r->step / (double)r->total_steps);
    if (r->tokens > 0) printf("tokens      %lld\n", (long long)r->tokens);
    const Moetrain__V1__StepMetrics *m = r->last_metrics;
    if (m) {
        printf("loss        %.4f (mtp %.4f, lr %.3e, grad norm %.3f)\n", m->loss, m->mtp_loss,
               m->lr, m->grad_norm);
        printf("speed       %.0f ms/step, %.0f tokens/s, %.3f TFLOPS", m->step_ms, m->tokens_per_s,
               m->tflops);
        if (isfinite(m->mfu)) printf(", MFU %.1f%%", 100 * m->mfu);
        printf("\n");
    }
    if (r->layout) {
        layout_text(r->layout, lay, sizeof lay);
        printf("layout      %s, %d rank(s), backend %s\n", lay, r->ranks, r->backend);
    }
    print_ranks(r);
    if (r->last_checkpoint)
        printf("checkpoint  %s at step %lld (%s)\n", r->last_checkpoint->name,
               (long long)r->last_checkpoint->step, r->last_checkpoint->path);
    if (r->reshard)
        printf("reshard     %s -> %s: %s %.0f%% %s\n", r->reshard->source, r->reshard->target,
               r->reshard->active ? "running" : r->reshard->failed ? "FAILED" : "done",
               100 * r->reshard->progress, r->reshard->message);
    if (r->error[0]) printf("error       %s\n", r->error);
    printf("daemon      %s, up %.0f s, %d stream subscriber(s)\n", r->version, r->uptime_s,
           r->subscribers);
}

static int cmd_status(cli *k, int argc, char **argv)
{
    if (no_args("status", argc, argv)) return EXIT_USAGE;
    Moetrain__V1__GetStatusRequest req = MOETRAIN__V1__GET_STATUS_REQUEST__INIT;
    Moetrain__V1__GetStatusResponse *r;
    int rc = call(k, "GetStatus", &req.base, &moetrain__v1__get_status_response__descriptor,
                  (ProtobufCMessage **)&r, 0);
    if (rc) return rc;
    if (k->json) print_json(&r->base);
    else print_status(r);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return EXIT_OK;
}

static int cmd_save(cli *k, int argc, char **argv)
{
    Moetrain__V1__SaveCheckpointRequest req = MOETRAIN__V1__SAVE_CHECKPOINT_REQUEST__INIT;
    if (no_args("save", argc, argv)) return EXIT_USAGE;
    Moetrain__V1__SaveCheckpointResponse *r;
    int rc = call(k, "SaveCheckpoint", &req.base,
                  &moetrain__v1__save_checkpoint_response__descriptor, (ProtobufCMessage **)&r,
                  k->timeout > 600 ? k->timeout : 600);
    if (rc) return rc;
    if (k->json) print_json(&r->base);
    else if (r->checkpoint)
        printf("saved checkpoint %s at step %lld (%s)\n", r->checkpoint->name,
               (long long)r->checkpoint->step, r->checkpoint->path);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return EXIT_OK;
}

static int cmd_checkpoints(cli *k, int argc, char **argv)
{
    Moetrain__V1__ListCheckpointsRequest req = MOETRAIN__V1__LIST_CHECKPOINTS_REQUEST__INIT;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--job") && i + 1 < argc) {
            req.job = argv[++i];
        } else {
            fprintf(stderr, "moetrain checkpoints: unexpected '%s'\n", argv[i]);
            return EXIT_USAGE;
        }
    }
    Moetrain__V1__ListCheckpointsResponse *r;
    int rc = call(k, "ListCheckpoints", &req.base,
                  &moetrain__v1__list_checkpoints_response__descriptor, (ProtobufCMessage **)&r, 0);
    if (rc) return rc;
    if (k->json) {
        print_json(&r->base);
    } else {
        printf("%s: %zu checkpoint(s)\n", r->directory, r->n_checkpoints);
        for (size_t i = 0; i < r->n_checkpoints; i++) {
            const Moetrain__V1__CheckpointInfo *c = r->checkpoints[i];
            char lay[160], size[32];
            layout_text(c->layout, lay, sizeof lay);
            format_bytes((double)c->bytes, size, sizeof size);
            printf("  %-24s step %-8lld %-10s %s", c->name, (long long)c->step, size, lay);
            if (c->write_ms > 0)
                printf("; written in %.0f ms (training stalled %.0f ms)", c->write_ms, c->stall_ms);
            if (c->verify[0]) printf("; verify %s", c->verify);
            printf("\n");
        }
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return EXIT_OK;
}

static int watch_reshard(cli *k, const char *target);

static int cmd_reshard(cli *k, int argc, char **argv)
{
    Moetrain__V1__ReshardCheckpointRequest req = MOETRAIN__V1__RESHARD_CHECKPOINT_REQUEST__INIT;
    Moetrain__V1__Layout l = MOETRAIN__V1__LAYOUT__INIT;
    req.layout = &l;
    int wait = 0, npos = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        int32_t *f = !strcmp(a, "--tp")    ? &l.tp
                     : !strcmp(a, "--pp")  ? &l.pp
                     : !strcmp(a, "--vpp") ? &l.vpp
                     : !strcmp(a, "--ep")  ? &l.ep
                     : !strcmp(a, "--etp") ? &l.etp
                     : !strcmp(a, "--dp")  ? &l.dp
                                           : NULL;
        if (f && has) {
            *f = atoi(argv[++i]);
        } else if (!strcmp(a, "--job") && has) {
            req.job = argv[++i];
        } else if (!strcmp(a, "--wait")) {
            wait = 1;
        } else if (a[0] != '-' && npos < 2) {
            if (npos++ == 0) req.source = (char *)a;
            else req.target = (char *)a;
        } else {
            fprintf(stderr, "moetrain reshard: unexpected '%s'\n", a);
            return EXIT_USAGE;
        }
    }
    if (npos != 2) {
        fprintf(stderr, "moetrain reshard: give SOURCE and TARGET checkpoint names\n");
        return EXIT_USAGE;
    }
    Moetrain__V1__ReshardCheckpointResponse *r;
    int rc = call(k, "ReshardCheckpoint", &req.base,
                  &moetrain__v1__reshard_checkpoint_response__descriptor, (ProtobufCMessage **)&r,
                  0);
    if (rc) return rc;
    if (k->json) print_json(&r->base);
    else printf("resharding %s into %s (%s) in the background\n", req.source, r->target, r->path);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return wait ? watch_reshard(k, req.target) : EXIT_OK;
}

/* Polls the status until the reshard into `target` ends. */
static int watch_reshard(cli *k, const char *target)
{
    for (;;) {
        Moetrain__V1__GetStatusRequest req = MOETRAIN__V1__GET_STATUS_REQUEST__INIT;
        Moetrain__V1__GetStatusResponse *r;
        int rc = call(k, "GetStatus", &req.base, &moetrain__v1__get_status_response__descriptor,
                      (ProtobufCMessage **)&r, 0);
        if (rc) return rc;
        int done = 0, ok = 0;
        if (r->reshard && !strcmp(r->reshard->target, target)) {
            if (!r->reshard->active) {
                done = 1;
                ok = !r->reshard->failed;
                printf("reshard %s: %s\n", ok ? "done" : "FAILED", r->reshard->message);
            } else if (!k->json) {
                printf("reshard %.0f%% %s\n", 100 * r->reshard->progress, r->reshard->message);
            }
        }
        protobuf_c_message_free_unpacked(&r->base, NULL);
        if (done) return ok ? EXIT_OK : EXIT_RPC;
        if (interrupted) return EXIT_RPC;
        struct timespec ts = {0, 500 * 1000 * 1000L};
        nanosleep(&ts, NULL);
    }
}

static void bar(char *out, int width, double frac)
{
    if (frac < 0) frac = 0;
    if (frac > 1) frac = 1;
    int full = (int)(frac * width + 0.5);
    out[0] = '[';
    for (int i = 0; i < width; i++) out[1 + i] = i < full ? '#' : '.';
    out[1 + width] = ']';
    out[2 + width] = '\0';
}

static int cmd_watch(cli *k, int argc, char **argv)
{
    Moetrain__V1__StreamMetricsRequest req = MOETRAIN__V1__STREAM_METRICS_REQUEST__INIT;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--from") && i + 1 < argc) {
            req.from_step = atoll(argv[++i]);
        } else if (!strcmp(argv[i], "--all")) {
            req.all_runs = 1;
        } else {
            fprintf(stderr, "moetrain watch: unexpected '%s'\n", argv[i]);
            return EXIT_USAGE;
        }
    }
    rpc_client_stream *s;
    rpc_status st;
    if (rpc_stream_open(k->c, SVC "StreamMetrics", &req.base, &s, &st) != 0)
        return failed("StreamMetrics", &st);
    int rc = EXIT_OK;
    uint64_t run = 0;
    for (;;) {
        Moetrain__V1__MetricsEvent *e;
        int r = rpc_stream_next(s, &moetrain__v1__metrics_event__descriptor,
                                (ProtobufCMessage **)&e, &interrupted, &st);
        if (r < 0) break; /* Ctrl-C */
        if (r == 0) {
            if (st.code != 0) rc = failed("StreamMetrics", &st);
            break;
        }
        int end = 0;
        if (k->json) {
            json_t *j = pb_to_json(&e->base);
            char *txt = json_dumps(j, JSON_COMPACT | JSON_PRESERVE_ORDER);
            if (txt) puts(txt);
            free(txt);
            json_decref(j);
        }
        if (e->event_case == MOETRAIN__V1__METRICS_EVENT__EVENT_STEP) {
            const Moetrain__V1__StepMetrics *m = e->step;
            run = e->run_id;
            if (!k->json) {
                char b[32];
                bar(b, 20, m->total_steps > 0 ? (double)m->step / (double)m->total_steps : 0);
                printf("step %6lld/%lld %s %3.0f%% | loss %.4f | lr %.3e | gnorm %.3f | %.0f ms | "
                       "%.0f tok/s%s\n",
                       (long long)m->step, (long long)m->total_steps, b,
                       m->total_steps > 0 ? 100.0 * (double)m->step / (double)m->total_steps : 0,
                       m->loss, m->lr, m->grad_norm, m->step_ms, m->tokens_per_s,
                       m->skipped ? " | SKIPPED" : "");
            }
        } else if (e->event_case == MOETRAIN__V1__METRICS_EVENT__EVENT_STATE) {
            const Moetrain__V1__StateChange *c = e->state;
            if (!k->json) printf("-- %s: %s\n", state_name(c->state), c->message);
            /* The job we followed is over. */
            if ((c->state == MOETRAIN__V1__JOB_STATE__JOB_STATE_IDLE ||
                 c->state == MOETRAIN__V1__JOB_STATE__JOB_STATE_FAILED) &&
                (run == 0 || e->run_id == run)) {
                end = 1;
                if (c->state == MOETRAIN__V1__JOB_STATE__JOB_STATE_FAILED) rc = EXIT_RPC;
            }
            if (c->state == MOETRAIN__V1__JOB_STATE__JOB_STATE_RUNNING) run = e->run_id;
        } else if (e->event_case == MOETRAIN__V1__METRICS_EVENT__EVENT_CHECKPOINT) {
            if (!k->json && e->checkpoint->checkpoint)
                printf("-- checkpoint %s saved at step %lld\n", e->checkpoint->checkpoint->name,
                       (long long)e->checkpoint->checkpoint->step);
        } else if (e->event_case == MOETRAIN__V1__METRICS_EVENT__EVENT_RESHARD) {
            if (!k->json)
                printf("-- reshard %s -> %s: %.0f%% %s\n", e->reshard->source, e->reshard->target,
                       100 * e->reshard->progress, e->reshard->message);
        } else if (e->event_case == MOETRAIN__V1__METRICS_EVENT__EVENT_GAP) {
            if (!k->json)
                printf("-- %llu event(s) missed (this client fell behind)\n",
                       (unsigned long long)e->gap->missed);
        }
        fflush(stdout);
        protobuf_c_message_free_unpacked(&e->base, NULL);
        if (end) break;
    }
    rpc_stream_close(s);
    return rc;
}

static int cmd_health(cli *k, int argc, char **argv)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    if (argc > 1) {
        fprintf(stderr, "moetrain health: usage: health [SERVICE]\n");
        return EXIT_USAGE;
    }
    if (argc == 1) req.service = argv[0];
    Grpc__Health__V1__HealthCheckResponse *r;
    rpc_status st;
    if (rpc_client_call(k->c, "/grpc.health.v1.Health/Check", &req.base,
                        &grpc__health__v1__health_check_response__descriptor,
                        (ProtobufCMessage **)&r, k->timeout, &st) != 0)
        return failed("health", &st);
    const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(
        &grpc__health__v1__health_check_response__serving_status__descriptor, r->status);
    printf("%s\n", v ? v->name : "UNKNOWN");
    int serving = r->status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return serving ? EXIT_OK : EXIT_NOT_SERVING;
}

static int cmd_eval(cli *k, int argc, char **argv)
{
    Moetrain__V1__EvaluateRequest req = MOETRAIN__V1__EVALUATE_REQUEST__INIT;
    Moetrain__V1__JobSpec spec = MOETRAIN__V1__JOB_SPEC__INIT;
    const char *job = NULL;
    char *sets[MAX_SETS];
    size_t n_sets = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        char **str = !strcmp(a, "--tokens")    ? &req.tokens
                     : !strcmp(a, "--out")     ? &req.output
                     : !strcmp(a, "--backend") ? &req.backend
                                               : NULL;
        int32_t *num = !strcmp(a, "--batch") ? &req.micro_batch : !strcmp(a, "--threads") ? &req.threads : NULL;
        if (str && has) {
            *str = argv[++i];
        } else if (num && has) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 0 || v > 65536) {
                fprintf(stderr, "moetrain eval: %s %s: a count\n", a, argv[i]);
                return EXIT_USAGE;
            }
            *num = (int32_t)v;
        } else if (!strcmp(a, "--job") && has) {
            job = argv[++i];
        } else if (!strcmp(a, "--set") && has && n_sets < MAX_SETS) {
            sets[n_sets++] = argv[++i];
        } else if (!strcmp(a, "--logits")) {
            req.logits = 1;
        } else if (!strcmp(a, "--fp32")) {
            req.fp32 = 1;
        } else if (a[0] != '-' && !req.checkpoint[0]) {
            req.checkpoint = (char *)a;
        } else {
            fprintf(stderr, "moetrain eval: unexpected '%s'\n", a);
            return EXIT_USAGE;
        }
    }
    if (!req.checkpoint[0]) {
        fprintf(stderr, "moetrain eval: give a CHECKPOINT (a path in the server's workdir)\n");
        return EXIT_USAGE;
    }
    if (n_sets && !job) {
        fprintf(stderr, "moetrain eval: --set needs --job\n");
        return EXIT_USAGE;
    }
    char *text = NULL;
    char base[PATH_MAX];
    if (job) {
        text = mt_read_text_file(job);
        if (!text) {
            fprintf(stderr, "moetrain eval: %s: %s\n", job, strerror(errno));
            return EXIT_USAGE;
        }
        /* relative data paths in the file are relative to its folder, as for start */
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s", job);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = '\0';
        else snprintf(dir, sizeof dir, ".");
        if (!realpath(dir, base)) snprintf(base, sizeof base, "%s", dir);
        spec.json = text;
        spec.n_set = n_sets;
        spec.set = sets;
        spec.base_dir = base;
        req.spec = &spec;
    }
    Moetrain__V1__EvaluateResponse *r;
    /* the answer comes when the evaluation is done */
    int rc = call(k, "Evaluate", &req.base, &moetrain__v1__evaluate_response__descriptor,
                  (ProtobufCMessage **)&r, k->timeout > 86400 ? k->timeout : 86400);
    free(text);
    if (rc) return rc;
    if (k->json) {
        print_json(&r->base);
    } else {
        printf("checkpoint  %s\n", r->checkpoint);
        printf("input       %s: %lld sequences x %d tokens scored\n", r->input,
               (long long)r->sequences, r->seq_len);
        printf("loss        %.9g (perplexity %.6g), mean over %lld tokens\n", r->loss, exp(r->loss),
               (long long)r->tokens);
        printf("computed    %s recipe on %s in %.1f s\n", r->recipe, r->backend, r->seconds);
        if (r->loss_file[0]) printf("wrote       %s (loss), %s (tokens)\n", r->loss_file, r->tokens_file);
        if (r->logits_file[0]) printf("wrote       %s (logits)\n", r->logits_file);
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return EXIT_OK;
}

typedef struct command {
    const char *name;
    int (*run)(cli *k, int argc, char **argv);
} command;

static const command commands[] = {
    {"start", cmd_start},   {"pause", cmd_pause},     {"resume", cmd_resume},
    {"stop", cmd_stop},     {"status", cmd_status},   {"save", cmd_save},
    {"checkpoints", cmd_checkpoints}, {"reshard", cmd_reshard}, {"watch", cmd_watch},
    {"health", cmd_health}, {"eval", cmd_eval},
};

int main(int argc, char **argv)
{
    const char *server = getenv("MOETRAIN_SERVER");
    const char *token_file = getenv("MOETRAIN_TOKEN_FILE");
    const char *tls_ca = NULL, *tls_name = NULL;
    cli k = {NULL, 10.0, 0};
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return EXIT_OK;
        } else if (!strcmp(a, "--server") && has) {
            server = argv[++i];
        } else if (!strcmp(a, "--token-file") && has) {
            token_file = argv[++i];
        } else if (!strcmp(a, "--tls-ca") && has) {
            tls_ca = argv[++i];
        } else if (!strcmp(a, "--tls-name") && has) {
            tls_name = argv[++i];
        } else if (!strcmp(a, "--timeout") && has) {
            k.timeout = atof(argv[++i]);
        } else if (!strcmp(a, "--json")) {
            k.json = 1;
        } else {
            fprintf(stderr, "moetrain: unknown option '%s'\n", a);
            usage(stderr);
            return EXIT_USAGE;
        }
    }
    if (i >= argc) {
        usage(stderr);
        return EXIT_USAGE;
    }
    const command *cmd = NULL;
    for (size_t c = 0; c < sizeof commands / sizeof commands[0]; c++)
        if (!strcmp(argv[i], commands[c].name)) cmd = &commands[c];
    if (!cmd) {
        fprintf(stderr, "moetrain: unknown command '%s'\n", argv[i]);
        usage(stderr);
        return EXIT_USAGE;
    }
    /* --json may also follow the command. */
    int sub_argc = 0;
    char **sub_argv = argv + i + 1;
    for (int j = i + 1; j < argc; j++) {
        if (!strcmp(argv[j], "--json")) k.json = 1;
        else sub_argv[sub_argc++] = argv[j];
    }
    char token[AUTH_TOKEN_CAP];
    if (token_file && token_file[0] && auth_read_token(token_file, token, sizeof token) < 0) {
        fprintf(stderr, "moetrain: %s\n", mt_errmsg());
        return EXIT_USAGE;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    rpc_client_opts o = {.target = server && server[0] ? server : DEFAULT_SERVER,
                         .token = token_file && token_file[0] ? token : NULL,
                         .tls_ca = tls_ca,
                         .tls_name = tls_name};
    if (rpc_client_open(&k.c, &o) < 0) {
        fprintf(stderr, "moetrain: %s\n", mt_errmsg());
        return EXIT_CONNECT;
    }
    int rc = cmd->run(&k, sub_argc, sub_argv);
    rpc_client_close(k.c);
    return rc;
}
