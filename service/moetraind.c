/* moetraind.c - the engine process.
 *
 *   moetraind [--listen ADDR] [--http ADDR] [--workdir DIR] [--job JOB.json [--set k=v ...]]
 *             [--token-file F] [--tls-cert F --tls-key F] [--ready-file F]
 *   moetraind --job JOB.json [--set key.path=value ...] [--metrics-jsonl FILE]
 *
 * The first form (any of its options given) is the daemon: rank 0 serves gRPC (moetrain.v1.Trainer,
 * health, reflection) and HTTP (/metrics, /healthz) while every rank runs
 * the engine loop; jobs come from the moetrain CLI or any gRPC client.
 * The second form (a job and none of the daemon options) runs that one job
 * in the foreground and exits when it ends. Both are MPI programs: alone
 * one rank (singleton init), under mpirun / srun N ranks.
 *
 * SIGINT / SIGTERM stop the job at the next step boundary and save a
 * checkpoint if that ends within train.term_grace_s (service/preempt.h);
 * the daemon then drains its streams and exits.
 *
 * Exit status (service/exit_status.h): 0 done (the job completed, or was
 * stopped with its checkpoint saved), 1 usage, 2 failed, 75 interrupted:
 * restart with --resume auto.
 */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <limits.h>
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/train/jobspec.h"
#include "base/json_util.h"
#include "base/mt_log.h"
#include "base/mt_status.h"
#include "service/auth.h"
#include "service/control.h"
#include "service/exit_status.h"
#include "service/http_endpoint.h"
#include "service/job_admit.h"
#include "service/metrics_hub.h"
#include "service/preempt.h"
#include "service/rpc_server.h"
#include "service/service.h"
#include "service/watchdog.h"
#include "service/workdir.h"

#define MAX_SETS 128
#define DEFAULT_LISTEN "127.0.0.1:50051"
#define DRAIN_GRACE_S 5.0

static volatile sig_atomic_t stop_requested = 0;

/* ---- ending the process from a helper thread ------------------------------------------ */

/* The engine thread may be blocked in a collective that never returns (a
 * dead peer), so the step watchdog and the SIGTERM backstop end the process
 * from their own threads (service/watchdog.h, service/preempt.h). */
static struct {
    control *ctl; /* rank 0: reports the failure to clients first */
    int rank;
} fatal;

static void die(int status) { _exit(status); }

static void on_watchdog(void *arg, const char *what, double waited_s)
{
    (void)arg;
    char msg[512];
    snprintf(msg, sizeof msg,
             "rank %d: %s has not finished after %.1f s (train.step_timeout_s): a rank died or a "
             "collective stalled; exiting with status %d: restart with --resume auto",
             fatal.rank, what, waited_s, MT_EXIT_RESTART);
    MT_LOGE("%s", msg);
    if (fatal.ctl) {
        control_report_fatal(fatal.ctl, msg);
        /* a moment for GetStatus and StreamMetrics to carry it out */
        struct timespec ts = {1, 0};
        nanosleep(&ts, NULL);
    }
    die(MT_EXIT_RESTART);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moetraind [--listen ADDR] [--http ADDR] [--workdir DIR] [--token-file F]\n"
            "                 [--tls-cert F --tls-key F] [--job JOB.json [--set k=v ...]]\n"
            "                 [--resume auto] [--exit-when-done]\n"
            "                 [--ready-file F] [--metrics-ring N] [--threads N]\n"
            "       moetraind --job JOB.json [--set key.path=value ...] [--metrics-jsonl FILE]\n"
            "                 [--resume auto] [--threads N]\n"
            "       moetraind --help-job    list every job spec field with its default\n"
            "\n"
            "The daemon (any daemon option given): gRPC control plane on\n"
            "--listen, Prometheus /metrics and /healthz on --http.\n"
            "  --listen ADDR         gRPC address (default " DEFAULT_LISTEN "); a non-loopback\n"
            "                        address needs --token-file\n"
            "  --http ADDR           HTTP address for the web dashboard (/), /metrics and\n"
            "                        /healthz (default: off)\n"
            "  --workdir DIR         where checkpoints go; names from requests stay inside\n"
            "                        (default: the current directory)\n"
            "  --token-file F        mutating RPCs need 'authorization: Bearer <token>'\n"
            "  --tls-cert F --tls-key F   serve gRPC over TLS (PEM files)\n"
            "  --job FILE            start this job at once (also with --set)\n"
            "  --ready-file F        write the bound addresses here once serving\n"
            "  --exit-when-done      exit once the job has ended (0 completed or stopped\n"
            "                        with its checkpoint; launchers: Slurm, Kubernetes)\n"
            "  --metrics-ring N      events kept for StreamMetrics replay (default 4096)\n"
            "The foreground mode (--job and no daemon option) runs one job and exits;\n"
            "SIGINT / SIGTERM stop the job at a step boundary.\n"
            "  --job FILE            job spec (JSON; see deploy/examples)\n"
            "  --set key.path=value  override a job spec field (repeatable)\n"
            "  --resume auto         continue from the newest checkpoint in checkpoint.dir\n"
            "                        that verifies (= --set checkpoint.resume=auto; also\n"
            "                        with the daemon's --job)\n"
            "  --metrics-jsonl FILE  also write one JSON object per step to FILE\n"
            "  --threads N           CPU backend worker threads (default: all cores)\n");
}

typedef struct args {
    struct watchdog *wd;
    const char *job;
    const char *jsonl;
    const char *sets[MAX_SETS];
    int n_sets;
    int threads;
    const char *listen, *http, *workdir, *token_file, *tls_cert, *tls_key, *ready_file;
    int ring;
    int daemon;
    int exit_when_done;  /* daemon: exit once its first job has ended */
} args;

/* 0 ok, 1 usage error (printed), 2 --help-job / --help done. */
static int parse_args(int argc, char **argv, args *a)
{
    memset(a, 0, sizeof *a);
    a->ring = 4096;
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        int has = i + 1 < argc;
        const char **daemon_opt = NULL;
        if (!strcmp(s, "--help") || !strcmp(s, "-h")) {
            usage(stdout);
            return 2;
        } else if (!strcmp(s, "--help-job")) {
            mt_jobspec_print_fields(stdout);
            return 2;
        } else if (!strcmp(s, "--job") && has) {
            a->job = argv[++i];
        } else if (!strcmp(s, "--set") && has) {
            if (a->n_sets == MAX_SETS) {
                fprintf(stderr, "moetraind: more than %d --set options\n", MAX_SETS);
                return 1;
            }
            a->sets[a->n_sets++] = argv[++i];
        } else if (!strcmp(s, "--resume") && has) {
            /* the job spec's checkpoint.resume (runtime/job_resume.h) */
            const char *v = argv[++i];
            if (strcmp(v, "auto") != 0 && strcmp(v, "never") != 0) {
                fprintf(stderr, "moetraind: --resume takes auto or never, not '%s'\n", v);
                return 1;
            }
            if (a->n_sets == MAX_SETS) {
                fprintf(stderr, "moetraind: more than %d --set options\n", MAX_SETS);
                return 1;
            }
            a->sets[a->n_sets++] = !strcmp(v, "auto") ? "checkpoint.resume=auto"
                                                      : "checkpoint.resume=never";
        } else if (!strcmp(s, "--exit-when-done")) {
            a->exit_when_done = 1;
            a->daemon = 1;
        } else if (!strcmp(s, "--metrics-jsonl") && has) {
            a->jsonl = argv[++i];
        } else if (!strcmp(s, "--threads") && has) {
            a->threads = atoi(argv[++i]);
        } else if (!strcmp(s, "--metrics-ring") && has) {
            a->ring = atoi(argv[++i]);
            a->daemon = 1;
        } else if (!strcmp(s, "--listen") && has) {
            daemon_opt = &a->listen;
        } else if (!strcmp(s, "--http") && has) {
            daemon_opt = &a->http;
        } else if (!strcmp(s, "--workdir") && has) {
            daemon_opt = &a->workdir;
        } else if (!strcmp(s, "--token-file") && has) {
            daemon_opt = &a->token_file;
        } else if (!strcmp(s, "--tls-cert") && has) {
            daemon_opt = &a->tls_cert;
        } else if (!strcmp(s, "--tls-key") && has) {
            daemon_opt = &a->tls_key;
        } else if (!strcmp(s, "--ready-file") && has) {
            daemon_opt = &a->ready_file;
        } else {
            static const char *const with_value[] = {
                "--job", "--set", "--resume", "--metrics-jsonl", "--threads", "--metrics-ring", "--listen",
                "--http", "--workdir", "--token-file", "--tls-cert", "--tls-key", "--ready-file"};
            int known = 0;
            for (size_t k = 0; k < sizeof with_value / sizeof with_value[0]; k++)
                known |= !strcmp(s, with_value[k]);
            fprintf(stderr, "moetraind: %s '%s'\n", known ? "missing value for" : "unknown option",
                    s);
            usage(stderr);
            return 1;
        }
        if (daemon_opt) {
            *daemon_opt = argv[++i];
            a->daemon = 1;
        }
    }
    if (!a->job && !a->daemon) {
        /* Either mode needs saying: a job to run, or a daemon option. */
        fprintf(stderr, "moetraind: --job is required for the foreground mode; give --listen ADDR "
                        "(or another daemon option) to run the daemon\n");
        usage(stderr);
        return 1;
    }
    if (!a->listen) a->listen = DEFAULT_LISTEN;
    if (!a->workdir) a->workdir = ".";
    if (!!a->tls_cert != !!a->tls_key) {
        fprintf(stderr, "moetraind: --tls-cert and --tls-key go together\n");
        return 1;
    }
    if (a->ring < 16) {
        fprintf(stderr, "moetraind: --metrics-ring must be at least 16\n");
        return 1;
    }
    return 0;
}

/* ---- the foreground mode ---------------------------------------------------------- */

static int run_foreground(const args *a, mt_runtime *rt)
{
    mt_jobspec job;
    control *ctl = NULL;
    const int rank = rt->rank, world = rt->size;
    int rc;
    /* Every rank parses the file: a bad spec fails all of them alike. */
    MT_GOTO(mt_jobspec_load(&job, a->job, a->sets, a->n_sets), out);
    rc = mt_jobspec_admit(&job, world);
    if (rc < 0) {
        mt_err_wrap(rc, "--job %s on %d rank%s", a->job, world, world == 1 ? "" : "s");
        goto out;
    }
    control_opts o = {.rt = rt, .rank = rank, .world = world, .threads = a->threads,
                      .jsonl = a->jsonl, .exit_when_idle = 1, .wd = a->wd};
    MT_GOTO(control_create(&ctl, &o), out);
    if (rank == 0) MT_GOTO(control_start(ctl, &job, NULL), out);
    rc = control_run(ctl, &stop_requested);
out:
    if (rc < 0) MT_LOGE("%s", mt_errmsg());
    control_destroy(ctl);
    return rc;
}

/* ---- the daemon ------------------------------------------------------------------- */

static int check_listen(const args *a)
{
    char host[256];
    int port;
    MT_CHECK(http_parse_addr(a->listen, host, sizeof host, &port));
    if (!addr_is_loopback(host) && !a->token_file)
        return MT_ERR(MT_EINVAL, "--listen %s is not a loopback address: give --token-file so "
                                 "that only holders of the token can control jobs",
                      a->listen);
    if (a->http) MT_CHECK(http_parse_addr(a->http, host, sizeof host, &port));
    return MT_OK;
}

/* The --job of the daemon, admitted like a StartJob request. */
static int start_job_file(const args *a, const char *workdir, int world, control *ctl)
{
    json_t *root;
    MT_CHECK(mt_json_load_file(a->job, &root));
    char *text = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!text) return MT_ERR(MT_ENOMEM, "out of memory");
    char dir[PATH_MAX], real[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", a->job);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    else snprintf(dir, sizeof dir, ".");
    if (!realpath(dir, real)) {
        free(text);
        return MT_ERR(MT_EIO, "%s: %s", dir, strerror(errno));
    }
    job_request jr = {.json = text, .base_dir = real, .sets = a->sets, .n_sets = a->n_sets,
                      .world = world};
    mt_jobspec job;
    int rc = job_admit(workdir, &jr, &job);
    free(text);
    if (rc < 0) return mt_err_wrap(rc, "--job %s", a->job);
    return control_start(ctl, &job, NULL);
}

static int write_ready(const char *path, const char *grpc_host, int grpc_port, const char *http_host,
                       int http_port)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return MT_ERR(MT_EIO, "--ready-file %s: %s", path, strerror(errno));
    fprintf(f, "grpc=%s:%d\n", grpc_host, grpc_port);
    if (http_host) fprintf(f, "http=%s:%d\n", http_host, http_port);
    fprintf(f, "pid=%ld\n", (long)getpid());
    if (fclose(f) != 0 || rename(tmp, path) != 0)
        return MT_ERR(MT_EIO, "--ready-file %s: %s", path, strerror(errno));
    return MT_OK;
}

static int run_daemon(const args *a, mt_runtime *rt)
{
    const int rank = rt->rank, world = rt->size;
    char workdir[PATH_MAX];
    auth au;
    metrics_hub *hub = NULL;
    control *ctl = NULL;
    service svc;
    rpc_server *srv = NULL;
    http_endpoint *http = NULL;
    int have_svc = 0, rc = MT_OK;
    memset(&au, 0, sizeof au);
    if (rank == 0) {
        MT_GOTO(check_listen(a), setup_done);
        MT_GOTO(wd_open(a->workdir, workdir, sizeof workdir), setup_done);
        if (a->token_file) MT_GOTO(auth_load(&au, a->token_file), setup_done);
        MT_GOTO(hub_create(&hub, a->ring), setup_done);
    }
    control_opts o = {.rt = rt, .workdir = rank == 0 ? workdir : NULL, .rank = rank, .world = world,
                      .threads = a->threads, .hub = hub, .jsonl = a->jsonl, .wd = a->wd,
                      .exit_when_idle = a->exit_when_done};
    MT_GOTO(control_create(&ctl, &o), setup_done);
    if (rank == 0) fatal.ctl = ctl;
    if (rank == 0) {
        MT_GOTO(service_init(&svc, ctl, hub, workdir), setup_done);
        svc.term = &stop_requested;
        have_svc = 1;
        int gport = 0, hport = 0;
        rpc_server_opts ro = {.listen = a->listen, .tls_cert = a->tls_cert,
                              .tls_key = a->tls_key, .auth = &au, .svc = &svc};
        MT_GOTO(rpc_server_start(&srv, &ro, &gport), setup_done);
        if (a->http) MT_GOTO(http_start(&http, a->http, &svc, &au, &hport), setup_done);
        char ghost[256], hhost[256];
        int p;
        http_parse_addr(a->listen, ghost, sizeof ghost, &p);
        if (a->http) http_parse_addr(a->http, hhost, sizeof hhost, &p);
        MT_LOGI("moetraind serving gRPC on %s:%d%s%s, workdir %s, %d rank(s)", ghost, gport,
                a->tls_cert ? " (TLS)" : "", au.enabled ? " with a token" : "", workdir, world);
        if (a->http) MT_LOGI("HTTP dashboard, /metrics and /healthz on %s:%d", hhost, hport);
        if (a->job) MT_GOTO(start_job_file(a, workdir, world, ctl), setup_done);
        if (a->ready_file)
            MT_GOTO(write_ready(a->ready_file, ghost, gport, a->http ? hhost : NULL, hport), setup_done);
    }
setup_done:;
    /* All ranks enter the engine loop, or none does. */
    int bad = rc < 0, all_ok = mt_runtime_agree(rt, !bad);
    if (all_ok == 1) {
        rc = control_run(ctl, &stop_requested);
        if (rank == 0) MT_LOGI("draining: the job is stopped, closing streams");
    } else if (!bad) {
        rc = MT_ERR(MT_EGENERIC, "rank 0 could not start the service");
    }
    if (rc < 0) MT_LOGE("%s", mt_errmsg());
    if (have_svc) atomic_store(&svc.serving, 0);
    if (hub) hub_close(hub);
    rpc_server_stop(srv, DRAIN_GRACE_S);
    http_stop(http);
    if (have_svc) service_cleanup(&svc);
    fatal.ctl = NULL;
    control_destroy(ctl);
    hub_destroy(hub);
    if (rank == 0 && a->ready_file) remove(a->ready_file);
    if (rank == 0 && rc == MT_OK) MT_LOGI("moetraind: bye");
    return rc;
}

int main(int argc, char **argv)
{
    args a;
    int pr = parse_args(argc, argv, &a);
    if (pr) return pr == 2 ? 0 : 1;
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    mt_runtime *rt;
    int rc = mt_runtime_create(&rt);
    if (rc < 0) {
        MT_LOGE("%s", mt_errmsg());
        MPI_Finalize();
        return MT_EXIT_FAILED;
    }
    mt_log_set_rank(rt->rank);
    /* SIGINT / SIGTERM: stop at the step boundary, save within the grace
     * period or exit 75 (service/preempt.h) */
    preempt_install(&stop_requested);
    if (preempt_backstop_start(die) < 0) MT_LOGW("%s", mt_errmsg());
    signal(SIGPIPE, SIG_IGN); /* a client gone mid-write is the RPC layer's business */
    fatal.rank = rt->rank;
    if (watchdog_create(&a.wd, on_watchdog, NULL) < 0) MT_LOGW("%s", mt_errmsg());
    rc = a.daemon ? run_daemon(&a, rt) : run_foreground(&a, rt);
    watchdog_destroy(a.wd);
    mt_runtime_destroy(rt);
    MPI_Finalize();
    return mt_exit_status(rc);
}
