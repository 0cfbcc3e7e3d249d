/* bench_ckpt.c - checkpoint throughput against dd on the same disk, the
 * stall of an asynchronous save against a plain host copy, peak memory.
 *
 *   bench_ckpt [--dir DIR] [--examples DIR] [--synth MOETRAIN-DATA]
 *              [--ckpt-tool MOETRAIN-CKPT] [--threads N] [--scale K] [--repeat R]
 *              [--keep] [--load-only]
 *   mpirun -np N bench_ckpt ...      (aggregate over the ranks: dp = N)
 *
 * Builds a DeepSeek-V3-architecture job on the CPU backend (one per rank)
 * whose checkpoint (FP8 weights + scales, BF16 moments, FP32 main params) is
 * about 2.3 GB x K, and measures in DIR (default ./bench_ckpt.tmp), each
 * figure the best of R runs (default 3):
 *   dd write      dd bs=4M conv=fsync of a file of the checkpoint's size
 *                 (under mpirun: one file per rank, of its shard's size, at
 *                 the same time)
 *   dd read       dd bs=4M of it, page cache dropped first
 *   save          a synchronous save (shards, index, fsyncs, commit)
 *   async write   the background part of an asynchronous save (shards,
 *                 index, fsyncs, commit): the disk-facing throughput
 *   load          a new job restoring it, page cache dropped first
 *   verify        `moetrain-ckpt verify --quiet` (every byte read and
 *                 checksummed), cold: one process over every rank's shard
 *                 file, as an operator runs it (started by rank 0 without
 *                 the MPI job's local-rank variables, so it sizes its
 *                 worker pool for the whole host; the other ranks wait
 *                 without spinning); against dd read of the same run
 *                 (under mpirun every rank's file at once: the aggregate)
 *   async stall   training blocked by an asynchronous save (the snapshot),
 *   host copy     against memcpy of the same bytes into touched memory
 * Under mpirun the load's line per rank follows: its own restore time and
 * what it read (all read calls; from the disk). --load-only: save, dd and
 * load only, the loads alternately with MT_CKPT_DIRECT_READ=0 and 1 (for
 * comparing settings of the reads quickly).
 * Peak memory: the largest resident set during each phase above the one
 * at its start (Linux's VmHWM after clear_refs): what the phase allocates
 * beyond the job's own memory (the async saves' snapshot buffers count);
 * for verify the peak resident set of its process. Results go to tests/bench/RESULTS.md;
 * tests/bench/bench_ckpt.sh runs the single-rank and the 4-rank cases.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <mpi.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/ckpt.h"
#include "engine/train/trainer.h"
#include "base/mt_clock.h"
#include "base/mt_log.h"
#include "base/mt_status.h"
#include "runtime/job_checkpoint.h"
#include "runtime/runtime.h"

static int die(const char *what)
{
    fprintf(stderr, "bench_ckpt: %s: %s\n", what, mt_errmsg());
    MPI_Abort(MPI_COMM_WORLD, 2);
    return 2;
}

/* A field of /proc/self/status in MB ("VmRSS", "VmHWM"), -1 if absent. */
static double status_mb(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    double v = -1;
    size_t n = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, n) && line[n] == ':') v = atof(line + n + 1) / 1024.0;
    if (f) fclose(f);
    return v;
}

/* Starts a phase's memory measure: resets the peak resident set (Linux:
 * clear_refs 5) and returns the resident set now, MB. */
static double mem_start(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) {
        fputs("5", f);
        fclose(f);
    }
    return status_mb("VmRSS");
}

/* The phase's peak resident set above its start, MB. */
static double mem_peak(double start)
{
    double hwm = status_mb("VmHWM");
    if (hwm < 0) {
        struct rusage u;
        getrusage(RUSAGE_SELF, &u);
        hwm = (double)u.ru_maxrss / 1024.0;
    }
    return hwm > start ? hwm - start : 0;
}

/* Drops the page cache of every file under dir (recursively): clean pages
 * go with POSIX_FADV_DONTNEED after an fdatasync. Returns bytes seen. */
static int64_t drop_cache(const char *dir)
{
    int64_t total = 0;
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(p, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            total += drop_cache(p);
            continue;
        }
        int fd = open(p, O_RDONLY);
        if (fd < 0) continue;
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
        total += (int64_t)st.st_size;
    }
    closedir(d);
    return total;
}

/* This process's read I/O so far (/proc/self/io, all threads): bytes asked
 * of read calls (rchar) and bytes fetched from the disk (read_bytes). */
static void io_read(double *rchar, double *disk)
{
    *rchar = *disk = 0;
    FILE *f = fopen("/proc/self/io", "r");
    if (!f) return;
    char line[128];
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "rchar: ", 7)) *rchar = atof(line + 7);
        if (!strncmp(line, "read_bytes: ", 12)) *disk = atof(line + 12);
    }
    fclose(f);
}

static int64_t file_size(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 ? (int64_t)st.st_size : 0;
}

/* Runs a shell command, returns its seconds. */
static double run_timed(const char *cmd)
{
    double t0 = mt_now_s();
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_ckpt: failed: %s\n", cmd);
        return -1;
    }
    return mt_now_s() - t0;
}

/* A barrier that sleeps instead of spinning (Open MPI's polls a core):
 * the ranks that wait while rank 0 alone measures leave the cores to it. */
static void quiet_barrier(void)
{
    MPI_Request rq;
    MPI_Ibarrier(MPI_COMM_WORLD, &rq);
    for (int done = 0;;) {
        MPI_Test(&rq, &done, MPI_STATUS_IGNORE);
        if (done) return;
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
}

extern char **environ;

/* VmHWM of process pid in MB, or -1 (gone). */
static double pid_hwm_mb(pid_t pid)
{
    char p[64], line[256];
    snprintf(p, sizeof p, "/proc/%d/status", (int)pid);
    FILE *f = fopen(p, "r");
    double v = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) v = atof(line + 6) / 1024.0;
    if (f) fclose(f);
    return v;
}

/* Runs `tool verify --quiet dir` as its own process, as an operator does:
 * the environment less the MPI job's (an mpirun rank's local-size
 * variables would make the tool's pool share the host with ranks that are
 * idle now). Its seconds, or -1; *peak_mb its peak resident set, sampled
 * every 2 ms from /proc (the rusage of a child counts the memory of the
 * process it was spawned from: this job's). */
static double run_verify(const char *tool, const char *dir, double *peak_mb)
{
    const char *drop[] = {"OMPI_", "PMIX_", "MPI_LOCALNRANKS=", "SLURM_NTASKS_PER_NODE="};
    int n = 0;
    while (environ[n]) n++;
    char **env = calloc((size_t)n + 1, sizeof *env);
    if (!env) return -1;
    int k = 0;
    for (int i = 0; i < n; i++) {
        int keep = 1;
        for (size_t d = 0; d < sizeof drop / sizeof drop[0]; d++)
            if (!strncmp(environ[i], drop[d], strlen(drop[d]))) keep = 0;
        if (keep) env[k++] = environ[i];
    }
    char *argv[] = {(char *)tool, "verify", "--quiet", (char *)dir, NULL};
    pid_t pid;
    const double t0 = mt_now_s();
    int rc = posix_spawn(&pid, tool, NULL, NULL, argv, env);
    free(env);
    if (rc != 0) {
        fprintf(stderr, "bench_ckpt: cannot run %s: %s\n", tool, strerror(rc));
        return -1;
    }
    int st = 0;
    double peak = 0, s = -1;
    for (;;) {
        const double h = pid_hwm_mb(pid);
        peak = h > peak ? h : peak;
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid) {
            s = mt_now_s() - t0;
            break;
        }
        if (w < 0) return -1;
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "bench_ckpt: %s verify %s: exit status %d\n", tool, dir,
                WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        return -1;
    }
    *peak_mb = peak;
    return s;
}

/* Wall time of a collective phase: every rank starts together, the phase
 * ends when the last rank is done. */
static double phase_begin(void)
{
    MPI_Barrier(MPI_COMM_WORLD);
    return mt_now_s();
}

static double phase_end(double t0)
{
    MPI_Barrier(MPI_COMM_WORLD);
    return mt_now_s() - t0;
}

static double best(double a, double b) { return a < 0 || (b >= 0 && b < a) ? b : a; }

typedef struct row {
    const char *name;
    double s, gb;       /* seconds, GB moved */
    double dd;          /* the dd figure it compares with, GB/s (0: none) */
    double mem;         /* peak RSS above the job's own, MB */
    const char *note;
} row;

static void print_row(const row *r)
{
    double rate = r->gb / r->s;
    char vs[32] = "";
    if (r->dd > 0) snprintf(vs, sizeof vs, "%5.0f %%", 100 * rate / r->dd);
    printf("%-13s %9.3f %9.2f %9s %9.0f  %s\n", r->name, r->s, rate, vs, r->mem, r->note ? r->note : "");
}

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    const char *dir = "bench_ckpt.tmp", *examples = "deploy/examples", *synth = NULL, *ckpt_tool = NULL;
    int threads = 0, keep = 0, repeat = 3, load_only = 0;
    double scale = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dir") && i + 1 < argc) dir = argv[++i];
        else if (!strcmp(argv[i], "--examples") && i + 1 < argc) examples = argv[++i];
        else if (!strcmp(argv[i], "--synth") && i + 1 < argc) synth = argv[++i];
        else if (!strcmp(argv[i], "--ckpt-tool") && i + 1 < argc) ckpt_tool = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--scale") && i + 1 < argc) scale = atof(argv[++i]);
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--keep")) keep = 1;
        else if (!strcmp(argv[i], "--load-only")) load_only = 1;
        else {
            fprintf(stderr, "usage: bench_ckpt [--dir DIR] [--examples DIR] [--synth MOETRAIN-DATA] "
                            "[--ckpt-tool MOETRAIN-CKPT] [--threads N] [--scale K] [--repeat R] "
                            "[--keep] [--load-only]\n");
            return 1;
        }
    }
    if (repeat < 1) repeat = 1;
    mt_runtime *rt;
    if (mt_runtime_create(&rt) < 0) return die("runtime");
    mt_log_set_rank(rt->rank);
    const int rank = rt->rank, world = rt->size;
    char cmd[8192], p[4096], root[4096], data[4096], tool[4096], vtool[4096];
    snprintf(root, sizeof root, "%s/ckpt", dir);
    snprintf(data, sizeof data, "%s/syn", dir);
    if (synth) snprintf(tool, sizeof tool, "%s", synth);
    else snprintf(tool, sizeof tool, "%s/engine/moetrain-data", getenv("MT_BIN_DIR") ? getenv("MT_BIN_DIR") : "build");
    if (ckpt_tool) snprintf(vtool, sizeof vtool, "%s", ckpt_tool);
    else snprintf(vtool, sizeof vtool, "%s/ckpt/moetrain-ckpt", getenv("MT_BIN_DIR") ? getenv("MT_BIN_DIR") : "build");
    if (rank == 0) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s' && '%s' synth --output '%s' --vocab 1024 "
                 "--tokens 20000 --seed 1 > /dev/null", dir, dir, tool, data);
        if (system(cmd) != 0) return die("corpus (moetrain-data synth)");
    }
    MPI_Barrier(MPI_COMM_WORLD);

    /* ~260M parameters x 9 bytes (e4m3 + bf16 m, v + f32 main): 2.3 GB at scale 1 */
    char s_exp[64], s_grp[64], s_tg[64], s_data[4200], s_dir[4200], s_init[4200], s_dp[64];
    int experts = (int)(16 * scale + 0.5), groups = 8;
    if (experts < 2) experts = 2;
    /* group-limited routing scores a group by its top-2 experts */
    while (groups > 1 && experts / groups < 2) groups /= 2;
    experts = experts / groups * groups;
    snprintf(s_exp, sizeof s_exp, "model.n_routed_experts=%d", experts);
    snprintf(s_grp, sizeof s_grp, "model.n_group=%d", groups);
    snprintf(s_tg, sizeof s_tg, "model.topk_group=%d", groups > 1 ? groups / 2 : 1);
    snprintf(s_data, sizeof s_data, "data.path=%s", data);
    snprintf(s_dir, sizeof s_dir, "checkpoint.dir=%s", root);
    snprintf(s_init, sizeof s_init, "init.path=%s", root);
    snprintf(s_dp, sizeof s_dp, "parallel.dp=%d", world);
    const char *sets[40] = {s_data, "model.vocab_size=32768", "model.hidden_size=1024",
                            "model.intermediate_size=4096", "model.moe_intermediate_size=1024",
                            "model.num_hidden_layers=4", "model.num_attention_heads=16",
                            "model.num_key_value_heads=16", "model.q_lora_rank=512",
                            "model.kv_lora_rank=512", "model.qk_nope_head_dim=128",
                            "model.qk_rope_head_dim=64", "model.v_head_dim=128", s_exp,
                            s_grp, s_tg, "model.num_experts_per_tok=2",
                            "batch.micro_batch_size=1", s_dp, "batch.seq_len=16",
                            "train.steps=4", "lr_schedule.warmup_steps=1",
                            "data.valid_interval=0", "train.log_interval=1000", s_dir,
                            "checkpoint.async=false", "checkpoint.keep_last=0"};
    int ns = 27;
    char s_gbs[64];
    snprintf(s_gbs, sizeof s_gbs, "batch.global_batch_size=%d", world);
    sets[ns++] = s_gbs;
    snprintf(p, sizeof p, "%s/tiny-cpu.json", examples);
    mt_jobspec ja, jb;
    if (mt_jobspec_load(&ja, p, sets, ns) < 0 || mt_jobspec_admit(&ja, world) < 0) return die("job");
    mt_job_opts jo = {.threads = threads};

    /* ---- the job, and its synchronous saves (each into a fresh root) ---- */
    double t0 = mt_now_s();
    mt_job *a;
    if (mt_job_start(&a, rt, &ja, &jo) < 0) return die("job start");
    const double base_mb = status_mb("VmRSS");
    if (rank == 0)
        printf("job: %d rank(s), %lld parameters, created in %.1f s, %.0f MB resident\n", world,
               (long long)mt_params_numel(&a->trainer->model->table), mt_now_s() - t0, base_mb);
    double t_save = -1, m0 = mem_start();
    int64_t bytes = 0, mine = 0;
    mt_trainer *tr = a->trainer;
    const int64_t step0 = tr->step;
    for (int k = 1; k <= repeat; k++) {
        tr->step = step0 + k; /* a step not saved yet */
        t0 = phase_begin();
        if (mt_job_save(a) < 0) return die("save");
        t_save = best(t_save, phase_end(t0));
        if (rank == 0 && k > 1) { /* keep the disk for one */
            char old[4200];
            mt_ckpt_step_path(old, sizeof old, root, tr->step - 1, 0);
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", old);
            if (system(cmd) != 0) return 2;
        }
    }
    const double mem_save = mem_peak(m0);
    /* sizes: the whole checkpoint, and this rank's shard (dd's file) */
    char step_dir[4200];
    mt_ckpt_step_path(step_dir, sizeof step_dir, root, tr->step, 0);
    snprintf(p, sizeof p, "%s/shard_%05d.h5", step_dir, rank);
    mine = file_size(p);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) bytes = drop_cache(root);
    MPI_Bcast(&bytes, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
    const double gb = (double)bytes / 1e9;
    if (rank == 0) printf("checkpoint: %.3f GB on disk\n", gb);

    /* ---- dd of the same sizes on the same disk, every rank at once ---- */
    double t_ddw = -1, t_ddr = -1;
    snprintf(p, sizeof p, "%s/dd.%d.bin", dir, rank);
    const long blocks = (long)((world > 1 ? mine : bytes) / (4 << 20)) + 1;
    for (int k = 0; k < repeat; k++) {
        snprintf(cmd, sizeof cmd, "dd if=/dev/zero of='%s' bs=4M count=%ld conv=fsync status=none", p, blocks);
        t0 = phase_begin();
        if (run_timed(cmd) < 0) return 2;
        t_ddw = best(t_ddw, phase_end(t0));
        snprintf(cmd, sizeof cmd, "dd if='%s' iflag=nocache count=0 status=none", p);
        if (system(cmd) != 0) return 2;
        drop_cache(dir);
        snprintf(cmd, sizeof cmd, "dd if='%s' of=/dev/null bs=4M status=none", p);
        t0 = phase_begin();
        if (run_timed(cmd) < 0) return 2;
        t_ddr = best(t_ddr, phase_end(t0));
    }
    unlink(p);
    double dd_bytes = (double)blocks * (4 << 20), all_dd = 0;
    MPI_Allreduce(&dd_bytes, &all_dd, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    const double ddw = all_dd / 1e9 / t_ddw, ddr = all_dd / 1e9 / t_ddr;

    /* ---- load: a new job restoring the checkpoint, cold ---- */
    sets[ns] = "init.kind=checkpoint";
    sets[ns + 1] = s_init;
    snprintf(p, sizeof p, "%s/tiny-cpu.json", examples);
    if (mt_jobspec_load(&jb, p, sets, ns + 2) < 0 || mt_jobspec_admit(&jb, world) < 0) return die("job");
    double t_load = -1, mem_load = 0, my_load = -1, my_rchar = 0, my_disk = 0;
    double t_load_dr[2] = {-1, -1};
    /* --load-only alternates MT_CKPT_DIRECT_READ, or the variable that
     * BENCH_CKPT_ALTERNATE names (e.g. MT_CKPT_NO_SHARED_LOAD) */
    const char *alt = getenv("BENCH_CKPT_ALTERNATE") ? getenv("BENCH_CKPT_ALTERNATE") : "MT_CKPT_DIRECT_READ";
    for (int k = 0; k < (load_only ? 2 * repeat : repeat); k++) {
        if (load_only) setenv(alt, k % 2 ? "1" : "0", 1);
        /* the trainer's own state again, from the disk: the restore alone */
        mt_job_ckpt *cl;
        if (mt_job_ckpt_open(&cl, &jb, rt->world) < 0) return die("checkpoint policy");
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 0) drop_cache(root);
        m0 = mem_start();
        double rc0, dk0, rc1, dk1;
        io_read(&rc0, &dk0);
        t0 = phase_begin();
        if (mt_job_ckpt_restore(cl, tr) < 0) return die("load");
        const double mine_s = mt_now_s() - t0;
        io_read(&rc1, &dk1);
        const double all_s = phase_end(t0);
        if (t_load < 0 || all_s < t_load) {
            my_load = mine_s;
            my_rchar = rc1 - rc0;
            my_disk = dk1 - dk0;
        }
        t_load = best(t_load, all_s);
        if (load_only) t_load_dr[k % 2] = best(t_load_dr[k % 2], all_s);
        if (load_only && world > 1) { /* each load's reads per rank */
            double mine3[3] = {mine_s, (rc1 - rc0) / 1e9, (dk1 - dk0) / 1e9}, all3[3 * 64];
            if (world <= 64) {
                MPI_Gather(mine3, 3, MPI_DOUBLE, all3, 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
                for (int r = 0; rank == 0 && r < world; r++)
                    printf("load %d (%s=%d) %.3f s, rank %d: %.3f s, read %.3f GB (%.3f GB from the disk)\n",
                           k, alt, k % 2, all_s, r, all3[3 * r], all3[3 * r + 1], all3[3 * r + 2]);
            }
        }
        mem_load = mem_peak(m0);
        mt_job_ckpt_close(cl);
    }
    const int64_t saved = tr->step;
    if (world > 1) {
        double mine3[3] = {my_load, my_rchar / 1e9, my_disk / 1e9}, *all3 = NULL;
        if (rank == 0 && !(all3 = malloc(sizeof mine3 * (size_t)world))) return die("out of memory");
        MPI_Gather(mine3, 3, MPI_DOUBLE, all3, 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
        for (int r = 0; rank == 0 && r < world; r++)
            printf("load, rank %d: %.3f s, read %.3f GB (%.3f GB from the disk)\n", r, all3[3 * r],
                   all3[3 * r + 1], all3[3 * r + 2]);
        free(all3);
    }
    if (load_only) {
        if (rank == 0)
            printf("\n| %d | %.2f GB | save %.2f (%.0f %%) | dd write %.2f | load, %s=0 "
                   "%.2f (%.0f %%), =1 %.2f (%.0f %%) | dd read %.2f | (--load-only)\n",
                   world, gb, gb / t_save, 100 * gb / t_save / ddw, ddw, alt, gb / t_load_dr[0],
                   100 * gb / t_load_dr[0] / ddr, gb / t_load_dr[1], 100 * gb / t_load_dr[1] / ddr, ddr);
        mt_job_end(a);
        MPI_Barrier(MPI_COMM_WORLD);
        if (!keep && rank == 0) {
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
            if (system(cmd) != 0) return 2;
        }
        mt_runtime_destroy(rt);
        MPI_Finalize();
        return 0;
    }

    /* ---- verify, cold: one moetrain-ckpt process over every file ---- */
    double t_verify = -1, mem_verify = 0;
    quiet_barrier();
    if (rank == 0) {
        for (int k = 0; k < repeat; k++) {
            drop_cache(root);
            double peak = 0, s = run_verify(vtool, root, &peak);
            if (s < 0) return die("verify (moetrain-ckpt)");
            t_verify = best(t_verify, s);
            mem_verify = peak > mem_verify ? peak : mem_verify;
        }
    }
    quiet_barrier();

    /* ---- asynchronous saves: the stall, and the background write ---- */
    mt_job_ckpt *cb;
    mt_jobspec jc = ja;
    jc.checkpoint.async = 1;
    jc.checkpoint.interval = 1;
    snprintf(jc.checkpoint.dir, sizeof jc.checkpoint.dir, "%s/async", dir);
    if (mt_job_ckpt_open(&cb, &jc, rt->world) < 0) return die("checkpoint policy");
    /* first save: fresh host buffers; later ones: the same buffers again */
    double t_stall1 = 0, t_stall = -1, t_bg = -1;
    mt_job_ckpt_stats st;
    m0 = mem_start();
    for (int k = 1; k <= repeat + 1; k++) {
        tr->step = saved + k; /* a step boundary that is due for a save */
        t0 = phase_begin();
        if (mt_job_ckpt_after_step(cb, tr) < 0) return die("async save");
        double s = phase_end(t0);
        if (mt_job_ckpt_wait(cb) < 0) return die("async save");
        MPI_Barrier(MPI_COMM_WORLD);
        mt_job_ckpt_get_stats(cb, &st);
        if (k == 1) {
            t_stall1 = s;
        } else {
            t_stall = best(t_stall, s);
            t_bg = best(t_bg, (st.last_write_ms - st.last_stall_ms) / 1e3);
        }
    }
    tr->step = saved;
    const double mem_async = mem_peak(m0);
    mt_job_ckpt_close(cb);
    const size_t snap = (size_t)st.last_bytes;
    char *src = malloc(snap), *dst = malloc(snap);
    if (!src || !dst) return die("host copy: out of memory");
    /* both touched first (not 0: malloc + memset 0 may become calloc's
     * untouched zero pages) */
    memset(src, 1, snap);
    memset(dst, 2, snap);
    double t_copy = -1;
    for (int k = 0; k < repeat; k++) {
        src[k] = (char)k;
        t0 = mt_now_s();
        memcpy(dst, src, snap);
        t_copy = best(t_copy, mt_now_s() - t0);
    }
    if (dst[0] != src[0]) return 2;
    free(src);
    free(dst);
    mt_job_end(a);

    if (rank == 0) {
        const double sg = (double)snap / 1e9;
        printf("\n%d rank(s); best of %d; GB/s of the whole checkpoint (%.2f GB); %% of dd "
               "write (saves) or read (load, verify); MB peak: resident memory the phase added "
               "to the job's %.0f MB\n\n",
               world, repeat, gb, base_mb);
        printf("%-13s %9s %9s %9s %9s\n", "", "seconds", "GB/s", "vs dd", "MB peak");
        row rows[] = {
            {"dd write", t_ddw, all_dd / 1e9, 0, 0, world > 1 ? "every rank its shard's size at once" : NULL},
            {"save", t_save, gb, ddw, mem_save, "synchronous: shards, index, fsyncs, commit"},
            {"async write", t_bg, gb, ddw, mem_async, "background part of an async save (snapshot buffers included)"},
            {"dd read", t_ddr, all_dd / 1e9, 0, 0, "page cache dropped"},
            {"load", t_load, gb, ddr, mem_load, "restore into the job's trainer, cold"},
            {"verify", t_verify, gb, ddr, mem_verify,
             world > 1 ? "moetrain-ckpt verify, cold: one process, every rank's file (MB: its peak RSS)"
                       : "moetrain-ckpt verify, cold (MB: its peak RSS)"},
            {"async stall", t_stall, sg, 0, 0, "training blocked by an async save, buffers reused"},
            {"host copy", t_copy, sg, 0, 0, "memcpy of the snapshot's bytes into touched memory"},
        };
        for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
            if (rows[i].s > 0) print_row(&rows[i]);
        printf("%-13s %9.3f %9.2f %9s %9s  first async save: host buffers allocated\n", "async stall 1",
               t_stall1, sg / t_stall1, "", "");
        printf("\n| %d | %.2f GB | %.2f (%.0f %%) | %.2f (%.0f %%) | %.2f | %.2f (%.0f %%) | ",
               world, gb, gb / t_save, 100 * gb / t_save / ddw, gb / t_bg, 100 * gb / t_bg / ddw, ddw,
               gb / t_load, 100 * gb / t_load / ddr);
        printf("%.2f (%.0f %%) | ", gb / t_verify, 100 * gb / t_verify / ddr);
        printf("%.2f | %.0f / %.0f ms (%.2fx) | %.0f / %.0f / %.0f MB |\n", ddr, t_stall * 1e3,
               t_copy * 1e3, t_stall / t_copy, mem_save, mem_load, mem_verify);
        fflush(stdout);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (!keep && rank == 0) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) return 2;
    }
    mt_runtime_destroy(rt);
    MPI_Finalize();
    return 0;
}
