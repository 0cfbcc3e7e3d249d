/* bench_service.c - the control plane under load (issue #6 benchmark).
 *
 *   bench_service BUILD_DIR EXAMPLES_DIR [--seconds S] [--subscribers N] [--rate R]
 *                 [--threads T] [--seq-len L]
 *
 * Starts moetraind with the tiny job (steps timed by the daemon's own
 * --metrics-jsonl), then runs three phases of S seconds (default 30):
 * quiet, loaded, quiet. Loaded: N (32) StreamMetrics subscribers following
 * live and R (500) GetStatus calls per second. Every subscriber checks that
 * it sees each step exactly once (no gap, no duplicate); the step time of the
 * loaded phase is compared with the mean of the quiet ones. Exit status 0
 * when nothing was lost or duplicated and the step time stayed within 5 %.
 * Not a timed test: run it by hand and put the numbers in RESULTS.md.
 */
#define _XOPEN_SOURCE 700
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "moetrain.pb-c.h"
#include "service/rpc_client.h"
#include "base/mt_clock.h"

#define T "/moetrain.v1.Trainer/"

static char tmp[512], addr[128], bin[512], examples[512];
static atomic_int stop_load, stop_poll;
static volatile sig_atomic_t stop_flag; /* the same, for rpc_stream_next */

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static rpc_client *client(void)
{
    rpc_client *c;
    rpc_client_opts o = {.target = addr};
    if (rpc_client_open(&c, &o) < 0) {
        fprintf(stderr, "bench: cannot open a client\n");
        exit(1);
    }
    return c;
}

static int64_t current_step(rpc_client *c)
{
    Moetrain__V1__GetStatusRequest q = MOETRAIN__V1__GET_STATUS_REQUEST__INIT;
    Moetrain__V1__GetStatusResponse *r;
    rpc_status st;
    if (rpc_client_call(c, T "GetStatus", &q.base, &moetrain__v1__get_status_response__descriptor,
                        (ProtobufCMessage **)&r, 30, &st) != 0) {
        fprintf(stderr, "bench: GetStatus: %s\n", st.detail);
        exit(1);
    }
    int64_t s = r->step;
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return s;
}

/* ---- subscribers ------------------------------------------------------------------ */

typedef struct sub {
    pthread_t th;
    int64_t from;
    int64_t first, last, count, dups, lost, gaps;
    int err;
} sub;

static void *subscriber(void *arg)
{
    sub *s = arg;
    rpc_client *c = client();
    Moetrain__V1__StreamMetricsRequest q = MOETRAIN__V1__STREAM_METRICS_REQUEST__INIT;
    q.from_step = s->from;
    rpc_client_stream *st;
    rpc_status rs;
    if (rpc_stream_open(c, T "StreamMetrics", &q.base, &st, &rs) != 0) {
        s->err = 1;
        rpc_client_close(c);
        return NULL;
    }
    s->first = s->last = -1;
    while (!atomic_load(&stop_load)) {
        Moetrain__V1__MetricsEvent *e;
        int r = rpc_stream_next(st, &moetrain__v1__metrics_event__descriptor,
                                (ProtobufCMessage **)&e, &stop_flag, &rs);
        if (r <= 0) {
            if (r == 0) s->err = 1;
            break;
        }
        if (e->event_case == MOETRAIN__V1__METRICS_EVENT__EVENT_GAP) {
            s->gaps++;
        } else if (e->event_case == MOETRAIN__V1__METRICS_EVENT__EVENT_STEP) {
            int64_t k = e->step->step;
            if (s->first < 0) s->first = k;
            else if (k <= s->last) s->dups++;
            else if (k > s->last + 1) s->lost += k - s->last - 1;
            if (k > s->last) s->last = k;
            s->count++;
        }
        protobuf_c_message_free_unpacked(&e->base, NULL);
    }
    rpc_stream_close(st);
    rpc_client_close(c);
    return NULL;
}

/* ---- GetStatus load ------------------------------------------------------------------ */

typedef struct poller {
    pthread_t th;
    double rate;
    int64_t calls, errors;
    double *lat;
    int64_t cap;
} poller;

static void *poll_status(void *arg)
{
    poller *p = arg;
    rpc_client *c = client();
    double t0 = mt_now_s();
    while (!atomic_load(&stop_poll)) {
        double due = t0 + (double)p->calls / p->rate;
        double t = mt_now_s();
        if (t < due) sleep_s(due - t);
        Moetrain__V1__GetStatusRequest q = MOETRAIN__V1__GET_STATUS_REQUEST__INIT;
        ProtobufCMessage *r;
        rpc_status st;
        double a = mt_now_s();
        if (rpc_client_call(c, T "GetStatus", &q.base,
                            &moetrain__v1__get_status_response__descriptor, &r, 10, &st) == 0)
            protobuf_c_message_free_unpacked(r, NULL);
        else
            p->errors++;
        if (p->calls < p->cap) p->lat[p->calls] = mt_now_s() - a;
        p->calls++;
    }
    rpc_client_close(c);
    return NULL;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- step times from the daemon's JSONL --------------------------------------------------- */

typedef struct phase {
    const char *name;
    int64_t s0, s1;    /* steps (s0, s1] */
    double wall;
    double mean_ms, median_ms;
} phase;

static void step_times(const char *jsonl, phase *ph, int n)
{
    FILE *f = fopen(jsonl, "r");
    if (!f) {
        perror(jsonl);
        exit(1);
    }
    static double ms[8][1 << 16];
    int64_t cnt[8] = {0};
    char line[32768];
    while (fgets(line, sizeof line, f)) {
        long long step;
        double v;
        const char *p = strstr(line, "\"step\":"), *q = strstr(line, "\"step_ms\":");
        if (!p || !q || sscanf(p + 7, "%lld", &step) != 1 || sscanf(q + 10, "%lf", &v) != 1)
            continue;
        for (int i = 0; i < n; i++)
            if (step > ph[i].s0 && step <= ph[i].s1 && cnt[i] < (1 << 16)) ms[i][cnt[i]++] = v;
    }
    fclose(f);
    for (int i = 0; i < n; i++) {
        double sum = 0;
        for (int64_t k = 0; k < cnt[i]; k++) sum += ms[i][k];
        ph[i].mean_ms = cnt[i] ? sum / (double)cnt[i] : NAN;
        qsort(ms[i], (size_t)cnt[i], sizeof(double), cmp_d);
        ph[i].median_ms = cnt[i] ? ms[i][cnt[i] / 2] : NAN;
    }
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_service BUILD_DIR EXAMPLES_DIR [--seconds S] "
                        "[--subscribers N] [--rate R] [--threads T] [--seq-len L]\n");
        return 1;
    }
    double seconds = 30, rate = 500;
    int nsub = 32, threads = 0, seq = 32;
    snprintf(bin, sizeof bin, "%s", argv[1]);
    snprintf(examples, sizeof examples, "%s", argv[2]);
    for (int i = 3; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--subscribers")) nsub = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rate")) rate = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--seq-len")) seq = atoi(argv[i + 1]);
    }
    signal(SIGPIPE, SIG_IGN);
    snprintf(tmp, sizeof tmp, "/tmp/bench_service.%d", (int)getpid());
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "rm -rf %s && mkdir -p %s && %s/engine/moetrain-data synth --output %s/syn --vocab 64 "
             "--tokens 4000000 --seed 1 > /dev/null",
             tmp, tmp, bin, tmp);
    if (system(cmd) != 0) return 1;

    char exe[1024], ready[1024], jsonl[1024], wd[1024], thr[16], log[1024];
    snprintf(exe, sizeof exe, "%s/service/moetraind", bin);
    snprintf(ready, sizeof ready, "%s/ready", tmp);
    snprintf(jsonl, sizeof jsonl, "%s/steps.jsonl", tmp);
    snprintf(wd, sizeof wd, "%s/wd", tmp);
    snprintf(log, sizeof log, "%s/daemon.log", tmp);
    snprintf(thr, sizeof thr, "%d", threads);
    char job[1024], dset[1024], seqs[64];
    snprintf(job, sizeof job, "%s/tiny-cpu.json", examples);
    snprintf(dset, sizeof dset, "data.path=%s/syn", tmp);
    snprintf(seqs, sizeof seqs, "batch.seq_len=%d", seq);
    pid_t d = fork();
    if (d == 0) {
        if (!freopen(log, "w", stderr)) _exit(127);
        execl(exe, exe, "--listen", "127.0.0.1:0", "--workdir", wd, "--ready-file", ready,
              "--metrics-jsonl", jsonl, "--threads", thr, "--job", job, "--set", dset, "--set",
              "train.steps=1000000", "--set", seqs, "--set", "data.valid_interval=0", "--set",
              "train.log_interval=1000", (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 600 && access(ready, F_OK) != 0; i++) sleep_s(0.1);
    FILE *rf = fopen(ready, "r");
    if (!rf) {
        fprintf(stderr, "bench: moetraind did not start (see %s)\n", log);
        return 1;
    }
    char line[256];
    while (fgets(line, sizeof line, rf))
        if (!strncmp(line, "grpc=", 5)) {
            snprintf(addr, sizeof addr, "%s", line + 5);
            addr[strcspn(addr, "\n")] = '\0';
        }
    fclose(rf);
    rpc_client *c = client();
    while (current_step(c) < 5) sleep_s(0.2); /* warm up */

    phase ph[3] = {{"quiet", 0, 0, 0, 0, 0}, {"loaded", 0, 0, 0, 0, 0}, {"quiet", 0, 0, 0, 0, 0}};
    sub *subs = calloc((size_t)nsub, sizeof *subs);
    const int npoll = 2;
    poller polls[2];
    for (int p = 0; p < 3; p++) {
        ph[p].s0 = current_step(c);
        double t0 = mt_now_s();
        if (p == 1) {
            atomic_store(&stop_load, 0);
            atomic_store(&stop_poll, 0);
            stop_flag = 0;
            for (int i = 0; i < nsub; i++) {
                subs[i].from = ph[p].s0 + 1;
                pthread_create(&subs[i].th, NULL, subscriber, &subs[i]);
            }
            for (int i = 0; i < npoll; i++) {
                memset(&polls[i], 0, sizeof polls[i]);
                polls[i].rate = rate / npoll;
                polls[i].cap = (int64_t)(rate * seconds) + 1000;
                polls[i].lat = calloc((size_t)polls[i].cap, sizeof(double));
                pthread_create(&polls[i].th, NULL, poll_status, &polls[i]);
            }
        }
        sleep_s(seconds);
        if (p == 1) {
            atomic_store(&stop_poll, 1);
            for (int i = 0; i < npoll; i++) pthread_join(polls[i].th, NULL);
        }
        ph[p].s1 = current_step(c);
        ph[p].wall = mt_now_s() - t0;
        if (p == 1) {
            /* let the subscribers reach the last step of the phase */
            sleep_s(1.0);
            atomic_store(&stop_load, 1);
            stop_flag = 1;
            for (int i = 0; i < nsub; i++) pthread_join(subs[i].th, NULL);
        }
    }
    kill(d, SIGTERM);
    int ws;
    waitpid(d, &ws, 0);
    rpc_client_close(c);
    step_times(jsonl, ph, 3);

    int64_t dups = 0, lost = 0, gaps = 0, errs = 0, short_subs = 0;
    for (int i = 0; i < nsub; i++) {
        dups += subs[i].dups;
        lost += subs[i].lost;
        gaps += subs[i].gaps;
        errs += subs[i].err;
        if (subs[i].first != ph[1].s0 + 1 || subs[i].last < ph[1].s1) short_subs++;
    }
    int64_t calls = 0, cerr = 0, nl = 0;
    double *all = malloc(sizeof(double) * (size_t)(rate * seconds * 2 + 2000));
    for (int i = 0; i < npoll; i++) {
        calls += polls[i].calls;
        cerr += polls[i].errors;
        for (int64_t k = 0; k < polls[i].calls && k < polls[i].cap; k++) all[nl++] = polls[i].lat[k];
    }
    qsort(all, (size_t)nl, sizeof(double), cmp_d);
    printf("bench_service: %d subscribers, %.0f GetStatus/s target, %.0f s phases, seq_len %d, "
           "trainer threads %s\n",
           nsub, rate, seconds, seq, threads ? thr : "all");
    for (int p = 0; p < 3; p++)
        printf("  %-6s steps %6lld..%-6lld  %5.2f steps/s  step_ms mean %7.2f  median %7.2f\n",
               ph[p].name, (long long)ph[p].s0 + 1, (long long)ph[p].s1,
               (double)(ph[p].s1 - ph[p].s0) / ph[p].wall, ph[p].mean_ms, ph[p].median_ms);
    double quiet = 0.5 * (ph[0].mean_ms + ph[2].mean_ms);
    double ratio = ph[1].mean_ms / quiet;
    double quiet_rate = 0.5 * ((double)(ph[0].s1 - ph[0].s0) / ph[0].wall +
                               (double)(ph[2].s1 - ph[2].s0) / ph[2].wall);
    double load_rate = (double)(ph[1].s1 - ph[1].s0) / ph[1].wall;
    printf("  loaded / quiet step time: %.3f (mean step_ms), throughput %.3f (steps/s)\n", ratio,
           load_rate / quiet_rate);
    printf("  GetStatus: %lld calls (%.0f/s), %lld errors, latency p50 %.2f ms p99 %.2f ms\n",
           (long long)calls, (double)calls / ph[1].wall, (long long)cerr,
           nl ? 1e3 * all[nl / 2] : NAN, nl ? 1e3 * all[(int64_t)(0.99 * (double)nl)] : NAN);
    printf("  streams: %lld steps lost, %lld duplicated, %lld gap events, %lld errors, %lld "
           "subscribers short of the phase's steps\n",
           (long long)lost, (long long)dups, (long long)gaps, (long long)errs,
           (long long)short_subs);
    int ok = lost == 0 && dups == 0 && gaps == 0 && errs == 0 && short_subs == 0 && cerr == 0 &&
             fabs(ratio - 1) <= 0.05;
    printf("  %s\n", ok ? "PASS" : "FAIL");
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    if (ok && system(cmd) != 0) return 1;
    return ok ? 0 : 1;
}
