/* moetrain_pp.c - the moetrain-pp tool: a pipeline schedule's table, checked
 * and simulated, printed as a timeline with its bubble fraction. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"
#include "engine/parallel/layout.h"
#include "engine/parallel/schedule.h"
#include "engine/train/jobspec.h"

static const char usage[] =
    "usage: moetrain-pp [--job SPEC [--set key=value]... [--world N]]\n"
    "                   [--pp N] [--vpp V] [--schedule 1f1b|interleaved|dualpipev] [--mb M]\n"
    "                   [--costs F,B,Bi,W[,P2P]] [--stage-scale S0,S1,...] [--unit U]\n"
    "                   [--actions]\n"
    "\n"
    "Builds the pipeline schedule table (engine/parallel/schedule.h), checks it\n"
    "(every forward before its backward, sends matched by receives, no deadlock)\n"
    "and prints its simulated timeline: one row per stage, one cell per time unit\n"
    "(F forward, B backward or its input-gradient part, W weight-gradient part,\n"
    "then the micro-batch; lower case for a stage's later chunks; '.' idle), each\n"
    "stage's idle fraction and peak activations in flight, and the bubble.\n"
    "\n"
    "  --job SPEC     take pp, vpp, schedule and the micro-batches per step\n"
    "                 (global_batch_size / (micro_batch_size x dp)) from a job spec\n"
    "  --set k=v      job spec override, as moetraind takes it\n"
    "  --world N      ranks, when the spec derives dp (parallel.dp = 0); default\n"
    "                 tp x pp (dp 1)\n"
    "  --pp, --vpp, --schedule, --mb   the table's sizes (override the job spec;\n"
    "                 defaults pp 1, vpp 1 (2 for dualpipev), 1f1b, mb 1)\n"
    "  --costs        per-chunk costs in time units; default 1,2,1,1,0: a chunk's\n"
    "                 forward 1, its whole backward 2, split into input part 1 and\n"
    "                 weight part 1, no point-to-point latency\n"
    "  --stage-scale  one factor > 0 per stage: each stage's chunks cost its\n"
    "                 factor times --costs (p2p unscaled), e.g. 1,2 for a last\n"
    "                 stage twice as slow (the step log's measured costs)\n"
    "  --unit U       time per cell (default: the smallest cost)\n"
    "  --actions      also print every stage's action list\n"
    "\n"
    "Exit status: 0 table valid and printed, 1 refused (the message says why), 2 usage.\n";

static int usage_error(const char *msg, const char *arg)
{
    fprintf(stderr, "moetrain-pp: %s%s\n\n%s", msg, arg, usage);
    return 2;
}

static int parse_int(const char *flag, const char *v, int lo, int *out)
{
    char *end;
    long n = strtol(v, &end, 10);
    if (end == v || *end || n < lo || n > 1 << 20) {
        fprintf(stderr, "moetrain-pp: %s needs a whole number >= %d, not \"%s\"\n", flag, lo, v);
        return -1;
    }
    *out = (int)n;
    return 0;
}

int main(int argc, char **argv)
{
    const char *job = NULL, *sets[64];
    int n_sets = 0, world = 0, pp = 0, vpp = 0, mb = 0, actions = 0, sched = -1;
    double unit = 0, scale[64];
    int n_scale = 0;
    mt_sched_costs costs;
    mt_sched_costs_default(&costs);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(usage, stdout);
            return 0;
        }
        if (!strcmp(a, "--actions")) {
            actions = 1;
            continue;
        }
        if (i + 1 >= argc) return usage_error("missing value or unknown option ", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--job")) job = v;
        else if (!strcmp(a, "--set")) {
            if (n_sets == 64) return usage_error("too many --set, at most 64", "");
            sets[n_sets++] = v;
        } else if (!strcmp(a, "--world")) {
            if (parse_int(a, v, 1, &world)) return 2;
        } else if (!strcmp(a, "--pp")) {
            if (parse_int(a, v, 1, &pp)) return 2;
        } else if (!strcmp(a, "--vpp")) {
            if (parse_int(a, v, 1, &vpp)) return 2;
        } else if (!strcmp(a, "--mb")) {
            if (parse_int(a, v, 1, &mb)) return 2;
        } else if (!strcmp(a, "--schedule")) {
            for (int k = 0; mt_pp_schedule_names[k]; k++)
                if (!strcmp(v, mt_pp_schedule_names[k])) sched = k;
            if (sched < 0)
                return usage_error("--schedule is 1f1b, interleaved or dualpipev, not ", v);
        } else if (!strcmp(a, "--costs")) {
            double k[5] = {0, 0, 0, 0, 0};
            char tail;
            int n = sscanf(v, "%lf,%lf,%lf,%lf,%lf%c", &k[0], &k[1], &k[2], &k[3], &k[4], &tail);
            if (n < 4 || n > 5 || k[0] < 0 || k[1] < 0 || k[2] < 0 || k[3] < 0 || k[4] < 0)
                return usage_error("--costs needs F,B,Bi,W[,P2P], each >= 0, not ", v);
            costs = (mt_sched_costs){k[0], k[1], k[2], k[3], k[4]};
        } else if (!strcmp(a, "--stage-scale")) {
            const char *q = v;
            for (n_scale = 0;;) {
                char *end;
                double x = strtod(q, &end);
                if (end == q || !(x > 0) || n_scale == 64 || (*end && *end != ','))
                    return usage_error("--stage-scale needs up to 64 numbers > 0 separated by "
                                       "commas, not ", v);
                scale[n_scale++] = x;
                if (!*end) break;
                q = end + 1;
            }
        } else if (!strcmp(a, "--unit")) {
            char *end;
            unit = strtod(v, &end);
            if (end == v || *end || unit <= 0)
                return usage_error("--unit needs a number > 0, not ", v);
        } else {
            return usage_error("unknown option ", a);
        }
    }
    if (n_sets && !job) return usage_error("--set needs --job", "");
    if (world && !job) return usage_error("--world needs --job", "");

    mt_layout l;
    mt_layout_default(&l);
    int n_mb = 1;
    if (job) {
        static mt_jobspec j; /* large */
        if (mt_jobspec_load(&j, job, sets, n_sets) < 0) {
            fprintf(stderr, "moetrain-pp: %s\n", mt_errmsg());
            return 1;
        }
        l = j.parallel;
        if (!world) world = l.tp * l.pp * (l.dp ? l.dp : 1);
        if (mt_layout_resolve(&l, world) < 0) {
            fprintf(stderr, "moetrain-pp: %s\n", mt_errmsg());
            return 1;
        }
        j.parallel = l;
        if (j.batch.global_batch_size % (j.batch.micro_batch_size * l.dp)) {
            fprintf(stderr, "moetrain-pp: batch.global_batch_size %d is not a multiple of "
                    "micro_batch_size %d x dp %d\n", j.batch.global_batch_size,
                    j.batch.micro_batch_size, l.dp);
            return 1;
        }
        n_mb = mt_jobspec_grad_accum(&j);
    }
    if (pp) l.pp = pp;
    if (sched >= 0) l.schedule = (mt_pp_schedule)sched;
    if (vpp) l.vpp = vpp;
    else if (l.schedule == MT_PP_DUALPIPEV) l.vpp = 2;
    if (mb) n_mb = mb;

    mt_schedule s;
    char err[1024];
    if (mt_schedule_build(&s, &l, n_mb) < 0 || mt_schedule_check(&s, err, sizeof err) < 0) {
        fprintf(stderr, "moetrain-pp: %s\n", mt_errmsg());
        mt_schedule_free(&s);
        return 1;
    }
    int rc;
    if (n_scale) {
        if (n_scale != l.pp) {
            fprintf(stderr, "moetrain-pp: --stage-scale gives %d factors, the table has %d "
                    "stages\n", n_scale, l.pp);
            mt_schedule_free(&s);
            return 1;
        }
        const int C = l.pp * l.vpp;
        mt_sched_costs *cc = malloc((size_t)C * sizeof *cc);
        if (!cc) {
            fprintf(stderr, "moetrain-pp: out of memory\n");
            mt_schedule_free(&s);
            return 1;
        }
        for (int c = 0; c < C; c++) {
            const double k = scale[mt_layout_stage_of_chunk(&l, c)];
            cc[c] = (mt_sched_costs){k * costs.f, k * costs.b, k * costs.b_in, k * costs.w,
                                     costs.p2p};
        }
        rc = mt_schedule_print_chunks(stdout, &s, cc, unit);
        free(cc);
    } else {
        rc = mt_schedule_print(stdout, &s, &costs, unit);
    }
    if (rc == MT_OK && actions)
        for (int st = 0; st < s.pp; st++) {
            printf("stage %d, %d actions:", st, s.n_actions[st]);
            for (int i = 0; i < s.n_actions[st]; i++) {
                char what[96];
                mt_sched_action_format(&s.actions[st][i], what, sizeof what);
                printf("%s %s", i ? ";" : "", what);
            }
            printf("\n");
        }
    mt_schedule_free(&s);
    if (rc < 0) {
        fprintf(stderr, "moetrain-pp: %s\n", mt_errmsg());
        return 1;
    }
    return 0;
}
