/* bench_ckpt.c - checkpoint throughput against the disk, and the stall of
 * an asynchronous save against a plain host copy.
 *
 *   bench_ckpt [--dir DIR] [--examples DIR] [--threads N] [--scale K] [--keep]
 *
 * Builds a DeepSeek-V3-architecture trainer on the CPU backend whose
 * checkpoint (FP8 weights + scales, BF16 moments, FP32 main params) is
 * about 2.3 GB x K, and measures in DIR (default ./bench_ckpt.tmp):
 *   dd write      dd bs=4M conv=fsync of a file of the checkpoint's size
 *   dd read       dd bs=4M of it, page cache dropped first
 *   save          a synchronous save (snapshot, shards, index, fsyncs, commit)
 *   async write   the background part of an asynchronous save (shards,
 *                 index, fsyncs, commit): the disk-facing throughput
 *   load          restore into a new trainer, page cache dropped first
 *   verify        moetrain-ckpt verify (every byte read and checksummed), cold
 *   async stall   training blocked by an asynchronous save (the snapshot)
 *   host copy     memcpy of the same bytes, into fresh and into touched memory
 * The first asynchronous save allocates its host buffers (page faults);
 * later ones reuse them.
 * Results go to tests/bench/RESULTS.md.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/ckpt.h"
#include "engine/train/train_state.h"
#include "engine/train/trainer.h"
#include "base/mt_status.h"
#include "runtime/job_checkpoint.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int die(const char *what)
{
    fprintf(stderr, "bench_ckpt: %s: %s\n", what, mt_errmsg());
    return 2;
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

/* Runs a dd command, returns its seconds (wall clock of the command). */
static double run_timed(const char *cmd)
{
    double t0 = now_s();
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_ckpt: failed: %s\n", cmd);
        return -1;
    }
    return now_s() - t0;
}

int main(int argc, char **argv)
{
    const char *dir = "bench_ckpt.tmp", *examples = "deploy/examples";
    int threads = 0, keep = 0;
    double scale = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dir") && i + 1 < argc) dir = argv[++i];
        else if (!strcmp(argv[i], "--examples") && i + 1 < argc) examples = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--scale") && i + 1 < argc) scale = atof(argv[++i]);
        else if (!strcmp(argv[i], "--keep")) keep = 1;
        else {
            fprintf(stderr, "usage: bench_ckpt [--dir DIR] [--examples DIR] [--threads N] "
                            "[--scale K] [--keep]\n");
            return 1;
        }
    }
    char cmd[8192], p[4096], root[4096], data[4096];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", dir, dir);
    if (system(cmd) != 0) return 2;
    snprintf(root, sizeof root, "%s/ckpt", dir);
    snprintf(data, sizeof data, "%s/syn", dir);
    const char *bin = getenv("MT_BIN_DIR");
    snprintf(cmd, sizeof cmd,
             "%s/engine/moetrain-data synth --output '%s' --vocab 1024 --tokens 20000 --seed 1 > /dev/null",
             bin ? bin : "build", data);
    if (system(cmd) != 0) return 2;

    /* ~260M parameters x 9 bytes (e4m3 + bf16 m, v + f32 main): 2.3 GB at scale 1 */
    char s_exp[64], s_grp[64], s_tg[64], s_data[4200], s_dir[4200], s_init[4200];
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
    const char *sets[] = {s_data, "model.vocab_size=32768", "model.hidden_size=1024",
                          "model.intermediate_size=4096", "model.moe_intermediate_size=1024",
                          "model.num_hidden_layers=4", "model.num_attention_heads=16",
                          "model.num_key_value_heads=16", "model.q_lora_rank=512",
                          "model.kv_lora_rank=512", "model.qk_nope_head_dim=128",
                          "model.qk_rope_head_dim=64", "model.v_head_dim=128", s_exp,
                          s_grp, s_tg, "model.num_experts_per_tok=2",
                          "batch.micro_batch_size=1", "batch.global_batch_size=1",
                          "batch.seq_len=16", "train.steps=4", "lr_schedule.warmup_steps=1",
                          "data.valid_interval=0", "train.log_interval=1000", s_dir,
                          "checkpoint.async=false", "checkpoint.keep_last=0", NULL, NULL};
    int ns = 27;
    snprintf(p, sizeof p, "%s/tiny-cpu.json", examples);
    mt_jobspec ja, jb;
    if (mt_jobspec_load(&ja, p, sets, ns) < 0 || mt_jobspec_admit(&ja, 1) < 0) return die("job");
    mt_backend *be;
    if (mt_backend_cpu_create(&be, threads) < 0) return die("backend");

    /* ---- save ---- */
    double t0 = now_s();
    mt_trainer *a;
    mt_job_ckpt *ca;
    if (mt_trainer_create(&a, &ja, be) < 0) return die("trainer");
    if (mt_job_ckpt_open(&ca, &ja, NULL) < 0 || mt_job_ckpt_restore(ca, a) < 0) return die("checkpoint policy");
    printf("trainer: %lld parameters, created in %.1f s\n", (long long)mt_params_numel(&a->model->table),
           now_s() - t0);
    t0 = now_s();
    if (mt_job_ckpt_save_now(ca, a) < 0) return die("save");
    const double t_save = now_s() - t0;
    mt_job_ckpt_close(ca);
    mt_trainer_destroy(a);
    const int64_t bytes = drop_cache(root);
    printf("checkpoint: %.3f GB on disk\n", (double)bytes / 1e9);

    /* ---- dd of the same size on the same disk ---- */
    snprintf(p, sizeof p, "%s/dd.bin", dir);
    const long blocks = (long)(bytes / (4 << 20)) + 1;
    snprintf(cmd, sizeof cmd, "dd if=/dev/zero of='%s' bs=4M count=%ld conv=fsync status=none", p, blocks);
    const double t_ddw = run_timed(cmd);
    snprintf(cmd, sizeof cmd, "dd if='%s' iflag=nocache count=0 status=none", p);
    if (system(cmd) != 0) return 2;
    drop_cache(dir);
    snprintf(cmd, sizeof cmd, "dd if='%s' of=/dev/null bs=4M status=none", p);
    const double t_ddr = run_timed(cmd);
    const double dd_bytes = (double)blocks * (4 << 20);
    unlink(p);

    /* ---- load ---- */
    sets[ns] = "init.kind=checkpoint";
    sets[ns + 1] = s_init;
    snprintf(p, sizeof p, "%s/tiny-cpu.json", examples);
    if (mt_jobspec_load(&jb, p, sets, ns + 2) < 0 || mt_jobspec_admit(&jb, 1) < 0)
        return die("job");
    mt_trainer *b;
    mt_job_ckpt *cb;
    if (mt_trainer_create(&b, &jb, be) < 0) return die("trainer");
    if (mt_job_ckpt_open(&cb, &jb, NULL) < 0) return die("checkpoint policy");
    drop_cache(root);
    t0 = now_s();
    if (mt_job_ckpt_restore(cb, b) < 0) return die("load");
    const double t_load = now_s() - t0;
    mt_job_ckpt_close(cb);

    /* ---- verify, cold ---- */
    drop_cache(root);
    t0 = now_s();
    if (mt_ckpt_verify(root, NULL, NULL, NULL) < 0) return die("verify");
    const double t_verify = now_s() - t0;

    /* ---- async save: the stall, against a host copy of the same bytes ---- */
    jb.checkpoint.async = 1;
    jb.checkpoint.interval = 1;
    jb.init.kind = MT_INIT_RANDOM;
    snprintf(jb.checkpoint.dir, sizeof jb.checkpoint.dir, "%s/async", dir);
    if (mt_job_ckpt_open(&cb, &jb, NULL) < 0) return die("checkpoint policy");
    /* first save: fresh host buffers; second: the same buffers again */
    double t_stall1 = 0, t_stall = 0;
    mt_job_ckpt_stats st;
    for (int k = 1; k <= 2; k++) {
        b->step = k; /* a step boundary that is due for a save */
        t0 = now_s();
        if (mt_job_ckpt_after_step(cb, b) < 0) return die("async save");
        *(k == 1 ? &t_stall1 : &t_stall) = now_s() - t0;
        if (mt_job_ckpt_wait(cb) < 0) return die("async save");
    }
    mt_job_ckpt_get_stats(cb, &st);
    mt_job_ckpt_close(cb);
    const size_t snap = (size_t)st.last_bytes;
    char *src = malloc(snap);
    memset(src, 1, snap);
    t0 = now_s();
    char *dst = malloc(snap);
    memcpy(dst, src, snap);
    const double t_copy1 = now_s() - t0;
    memset(src, 2, snap);
    t0 = now_s();
    memcpy(dst, src, snap);
    const double t_copy = now_s() - t0;
    if (dst[snap - 1] != 2) return 2;
    free(src);
    free(dst);
    mt_trainer_destroy(b);
    be->destroy(be);

    const double gb = (double)bytes / 1e9;
    printf("\n%-12s %10s %10s\n", "", "seconds", "GB/s");
    printf("%-12s %10.2f %10.2f\n", "dd write", t_ddw, dd_bytes / 1e9 / t_ddw);
    printf("%-12s %10.2f %10.2f\n", "save", t_save, gb / t_save);
    printf("%-12s %10.2f %10.2f\n", "dd read", t_ddr, dd_bytes / 1e9 / t_ddr);
    printf("%-12s %10.2f %10.2f\n", "load", t_load, gb / t_load);
    printf("%-12s %10.2f %10.2f\n", "verify", t_verify, gb / t_verify);
    printf("%-12s %10.3f %10.2f  (snapshot %.2f GB, first save: fresh buffers)\n", "async stall 1",
           t_stall1, (double)snap / 1e9 / t_stall1, (double)snap / 1e9);
    printf("%-12s %10.3f %10.2f  (into fresh memory)\n", "host copy 1", t_copy1, (double)snap / 1e9 / t_copy1);
    printf("%-12s %10.3f %10.2f  (later saves: buffers reused)\n", "async stall", t_stall, (double)snap / 1e9 / t_stall);
    printf("%-12s %10.3f %10.2f  (into touched memory)\n", "host copy", t_copy, (double)snap / 1e9 / t_copy);
    const double t_bg = (st.last_write_ms - st.last_stall_ms) / 1e3;
    printf("%-12s %10.2f %10.2f  (snapshot to commit)\n", "async save", st.last_write_ms / 1e3,
           gb / (st.last_write_ms / 1e3));
    printf("%-12s %10.2f %10.2f  (its background part: shards, index, fsyncs, commit)\n",
           "async write", t_bg, gb / t_bg);
    printf("\n| %.2f GB | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f / %.0f ms | %.0f / %.0f ms |\n",
           gb, gb / t_save, gb / t_bg, dd_bytes / 1e9 / t_ddw, gb / t_load, dd_bytes / 1e9 / t_ddr,
           gb / t_verify, t_stall1 * 1e3, t_stall * 1e3, t_copy1 * 1e3, t_copy * 1e3);
    if (!keep) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) return 2;
    }
    return 0;
}
