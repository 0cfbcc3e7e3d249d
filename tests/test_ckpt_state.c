/* test_ckpt_state.c - a trainer saved and loaded through the job's
 * checkpoint policy (runtime/job_checkpoint.h, engine/train/train_state.h) is
 * restored exactly: FP8 compute copies and their transposes, act weights,
 * router biases, optimizer moments and main params (each main_params
 * mode, each recipe), step and data position; the next step then computes
 * the same loss bit for bit. Asynchronous saves report their stall and
 * write time; a Hugging Face export imported into a trainer gives the same
 * FP8 weights; a job never mixes its history with a newer one. The
 * snapshot is one slab of the backend's host memory, reused by every save.
 *
 * Usage: test_ckpt_state EXAMPLES_DIR [cuda]. With "cuda" the same runs on
 * the CUDA backend (the snapshot then page-locked host memory, the restore
 * staged through page-locked buffers; the fp32 recipe, CPU only, is left
 * out); exits 77 without a CUDA device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>

#include "ckpt/ckpt.h"
#include "ckpt/hf.h"
#include "engine/train/train_state.h"
#include "engine/train/trainer.h"
#include "base/mt_status.h"
#include "runtime/job_checkpoint.h"
#include "test_util.h"

static char tmp[1024];
static char corpus[1100];
static const char *examples;
static mt_backend *be;
static int on_cuda; /* argv[2] == "cuda" */

static int setup(void **state)
{
    (void)state;
    mt_test_tmpdir(tmp, sizeof tmp, on_cuda ? "ckpt_state_cuda" : "ckpt_state");
    snprintf(corpus, sizeof corpus, "%s/syn", tmp);
    if (mt_test_synth(corpus, "--vocab 64 --tokens 100000 --seed 5") != 0) return -1;
    int rc = on_cuda ? mt_backend_cuda_create(&be, 0, 0) : mt_backend_cpu_create(&be, 0);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    return rc == MT_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    be->destroy(be);
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    return system(cmd) == 0 ? 0 : -1;
}

/* The demo job shrunk to seconds, plus "--set" overrides. */
static void tiny_job(mt_jobspec *j, const char *const *extra, int n_extra)
{
    char path[1200], data[1200];
    snprintf(path, sizeof path, "%s/tiny-cpu.json", examples);
    snprintf(data, sizeof data, "data.path=%s", corpus);
    const char *sets[32] = {data, "batch.seq_len=32", "batch.micro_batch_size=2",
                            "batch.global_batch_size=4", "train.steps=10",
                            "lr_schedule.warmup_steps=2", "data.valid_interval=0",
                            "train.log_interval=1000"};
    int n = 8;
    for (int i = 0; i < n_extra; i++) sets[n++] = extra[i];
    int rc = mt_jobspec_load(j, path, sets, n);
    if (rc == MT_OK) rc = mt_jobspec_admit(j, 1);
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
}

static void ok(int rc)
{
    if (rc) fprintf(stderr, "%s\n", mt_errmsg());
    assert_int_equal(rc, MT_OK);
}

static mt_trainer *make(const mt_jobspec *j, mt_job_ckpt **jc)
{
    mt_trainer *t;
    ok(mt_trainer_create(&t, j, be));
    ok(mt_job_ckpt_open(jc, j, NULL));
    ok(mt_job_ckpt_restore(*jc, t));
    return t;
}

static void bytes_equal(const void *a, const void *b, size_t n, const char *what)
{
    if (n > 0 && memcmp(a, b, n) != 0) { /* n = 0: the bf16 recipe has no FP8 buffers (NULL) */
        fprintf(stderr, "%s differs\n", what);
        fail();
    }
}

/* Every byte of state two trainers compute with and update. */
static void assert_same_state(mt_trainer *a, mt_trainer *b)
{
    mt_train_snapshot x, y;
    memset(&x, 0, sizeof x);
    memset(&y, 0, sizeof y);
    ok(mt_train_state_snapshot(a, &x));
    ok(mt_train_state_snapshot(b, &y));
    assert_int_equal(x.bytes, y.bytes);
    int64_t n_act = 0, n_q = 0, n_s = 0, n_f = 0;
    for (int i = 0; i < x.n_params; i++) {
        const mt_param *p = &a->model->params[i];
        int64_t n = mt_param_numel(&p->d);
        if (x.params[i].act_off >= 0 && x.params[i].act_off + n > n_act) n_act = x.params[i].act_off + n;
        if (x.params[i].q_off >= 0 && x.params[i].q_off + n > n_q) n_q = x.params[i].q_off + n;
        if (x.params[i].s_off >= 0) {
            int64_t nb = ((p->d.rows + 127) / 128) * ((p->d.cols + 127) / 128);
            if (x.params[i].s_off + nb > n_s) n_s = x.params[i].s_off + nb;
            /* the transposed copy the data gradient uses */
            uint8_t *qa = malloc((size_t)n), *qb = malloc((size_t)n);
            float *sa = malloc((size_t)nb * 4), *sb = malloc((size_t)nb * 4);
            ok(be->download(be, qa, p->qt, (size_t)n));
            ok(be->download(be, qb, b->model->params[i].qt, (size_t)n));
            ok(be->download(be, sa, p->st, (size_t)nb * 4));
            ok(be->download(be, sb, b->model->params[i].st, (size_t)nb * 4));
            bytes_equal(qa, qb, (size_t)n, "qt");
            bytes_equal(sa, sb, (size_t)nb * 4, "st");
            free(qa), free(qb), free(sa), free(sb);
        }
        if (x.params[i].f32_off >= 0 && x.params[i].f32_off + n > n_f) n_f = x.params[i].f32_off + n;
    }
    bytes_equal(x.act, y.act, (size_t)n_act * (size_t)x.act_bytes, "act weights");
    bytes_equal(x.q, y.q, (size_t)n_q, "FP8 weights");
    bytes_equal(x.s, y.s, (size_t)n_s * 4, "FP8 scales");
    bytes_equal(x.f32, y.f32, (size_t)n_f * 4, "router biases");
    const size_t nopt = (size_t)a->opt->n_state;
    bytes_equal(x.m, y.m, nopt * 2, "exp_avg");
    bytes_equal(x.v, y.v, nopt * 2, "exp_avg_sq");
    assert_int_equal(!x.master, !y.master);
    if (x.master) bytes_equal(x.master, y.master, nopt * (size_t)x.master_bytes, "main params");
    assert_int_equal(a->step, b->step);
    assert_int_equal(a->consumed_samples, b->consumed_samples);
    assert_int_equal(a->skipped_total, b->skipped_total);
    assert_int_equal(a->bad_in_row, b->bad_in_row);
    assert_int_equal(a->opt->step, b->opt->step);
    assert_true(a->opt->seed == b->opt->seed);
    mt_train_snapshot_free(&x);
    mt_train_snapshot_free(&y);
}

static void step_both_same(mt_trainer *a, mt_trainer *b)
{
    mt_step_metrics ma, mb;
    ok(mt_trainer_step(a, &ma));
    ok(mt_trainer_step(b, &mb));
    assert_true(ma.loss == mb.loss);
    assert_true(ma.mtp_loss == mb.mtp_loss);
    assert_true(ma.grad_norm == mb.grad_norm);
}

/* Saves after 3 steps (sync), restores into a new trainer, compares every
 * byte, then steps both: same loss, same state. */
static void roundtrip(const char *name, const char *const *extra, int n_extra)
{
    char dir[1300], set_dir[1400], set_init[1400];
    snprintf(dir, sizeof dir, "%s/%s", tmp, name);
    snprintf(set_dir, sizeof set_dir, "checkpoint.dir=%s", dir);
    const char *sa[16] = {set_dir, "checkpoint.async=false"};
    int na = 2;
    for (int i = 0; i < n_extra; i++) sa[na++] = extra[i];
    mt_jobspec ja, jb;
    tiny_job(&ja, sa, na);
    mt_job_ckpt *ca, *cb;
    mt_trainer *a = make(&ja, &ca);
    for (int i = 0; i < 3; i++) ok(mt_trainer_step(a, NULL));
    ok(mt_job_ckpt_save_now(ca, a));
    ok(mt_ckpt_verify(dir, NULL, NULL, NULL));
    snprintf(set_init, sizeof set_init, "init.path=%s", dir);
    const char *sb[16] = {"init.kind=checkpoint", set_init};
    int nb = 2;
    for (int i = 0; i < n_extra; i++) sb[nb++] = extra[i];
    tiny_job(&jb, sb, nb);
    mt_trainer *b = make(&jb, &cb);
    mt_job_ckpt_stats st;
    mt_job_ckpt_get_stats(cb, &st);
    assert_int_equal(st.restored_step, 3);
    assert_same_state(a, b);
    step_both_same(a, b);
    step_both_same(a, b);
    assert_same_state(a, b);
    ok(mt_job_ckpt_close(ca));
    ok(mt_job_ckpt_close(cb));
    mt_trainer_destroy(a);
    mt_trainer_destroy(b);
}

static void test_exact_fp8_main_fp32(void **state)
{
    (void)state;
    roundtrip("fp8_fp32", NULL, 0);
}

static void test_exact_fp8_main_bf16(void **state)
{
    (void)state;
    const char *x[] = {"precision.main_params=bf16"};
    roundtrip("fp8_bf16", x, 1);
}

static void test_exact_fp8_main_none(void **state)
{
    (void)state;
    const char *x[] = {"precision.main_params=none"};
    roundtrip("fp8_none", x, 1);
}

static void test_exact_bf16_recipe(void **state)
{
    (void)state;
    const char *x[] = {"precision.recipe=bf16"};
    roundtrip("bf16", x, 1);
}

static void test_exact_fp32_recipe(void **state)
{
    (void)state;
    if (on_cuda) skip(); /* the fp32 recipe runs on the CPU only */
    const char *x[] = {"precision.recipe=fp32", "precision.main_params=none"};
    roundtrip("fp32", x, 2);
}

/* A region of the trainer's state downloaded on its own, against the
 * snapshot's copy of it. */
static void region_equal(const void *snap, const void *dev, size_t bytes, const char *what)
{
    if (!bytes) return;
    void *h = malloc(bytes);
    ok(be->download(be, h, dev, bytes));
    bytes_equal(snap, h, bytes, what);
    free(h);
}

/* The snapshot is one slab of the backend's host memory (page-locked on
 * CUDA), reserved ahead or at the first snapshot and reused by the next
 * ones of the same trainer; each copy equals the trainer's state at its
 * step, after training moved it. */
static void test_snapshot_slab_reused(void **state)
{
    (void)state;
    mt_jobspec j;
    tiny_job(&j, NULL, 0);
    mt_trainer *t;
    ok(mt_trainer_create(&t, &j, be));
    mt_train_snapshot x;
    memset(&x, 0, sizeof x);
    ok(mt_train_state_snapshot_reserve(t, &x));
    void *slab = x.slab;
    assert_non_null(slab);
    assert_int_equal(x.slab_pinned, 1); /* pinning works on the test machines */
    for (int round = 0; round < 2; round++) {
        ok(mt_trainer_step(t, NULL));
        ok(mt_train_state_snapshot(t, &x));
        assert_ptr_equal(x.slab, slab);
        assert_true(x.bytes > 0 && x.bytes <= x.slab_bytes);
        assert_int_equal(x.step, t->step);
        const mt_model *m = t->model;
        const mt_optimizer *o = t->opt;
        int64_t n_act = 0, n_q = 0, n_s = 0, n_f = 0;
        for (int i = 0; i < x.n_params; i++) {
            const mt_param *p = &m->params[i];
            const int64_t n = mt_param_numel(&p->d);
            const int64_t nb = ((p->d.rows + 127) / 128) * ((p->d.cols + 127) / 128);
            if (x.params[i].act_off + n > n_act && x.params[i].act_off >= 0) n_act = x.params[i].act_off + n;
            if (x.params[i].q_off >= 0 && x.params[i].q_off + n > n_q) n_q = x.params[i].q_off + n;
            if (x.params[i].s_off >= 0 && x.params[i].s_off + nb > n_s) n_s = x.params[i].s_off + nb;
            if (x.params[i].f32_off >= 0 && x.params[i].f32_off + n > n_f) n_f = x.params[i].f32_off + n;
        }
        region_equal(x.act, m->buf_act, (size_t)n_act * (size_t)x.act_bytes, "act weights");
        region_equal(x.q, m->buf_q, (size_t)n_q, "FP8 weights");
        region_equal(x.s, m->buf_s, (size_t)n_s * 4, "FP8 scales");
        region_equal(x.f32, m->buf_f32, (size_t)n_f * 4, "router biases");
        region_equal(x.m, o->m, (size_t)o->n_state * 2, "exp_avg");
        region_equal(x.v, o->v, (size_t)o->n_state * 2, "exp_avg_sq");
        assert_non_null(x.master);
        region_equal(x.master, o->master, (size_t)o->n_state * (size_t)x.master_bytes, "main params");
    }
    mt_train_snapshot_free(&x);
    assert_null(x.slab);
    mt_trainer_destroy(t);
}

/* A restore staged in memory the caller lends (the job's reserved
 * snapshot slab) loads the same state as one with its own staging, and
 * does stage there (the lent bytes change); a lend too small for the
 * largest parameter is not used. */
static void test_restore_staged_in_lent_memory(void **state)
{
    (void)state;
    char dir[1300], step[1400], set_init[1400];
    snprintf(dir, sizeof dir, "%s/fp8_fp32", tmp); /* step 3 from the first test */
    ok(mt_ckpt_resolve(dir, step, sizeof step));
    snprintf(set_init, sizeof set_init, "init.path=%s", dir);
    const char *sa[] = {"init.kind=checkpoint", set_init};
    mt_jobspec ja, jb;
    tiny_job(&ja, sa, 2);
    mt_job_ckpt *ca;
    mt_trainer *a = make(&ja, &ca); /* the job's own restore */
    tiny_job(&jb, NULL, 0);
    mt_trainer *b;
    ok(mt_trainer_create(&b, &jb, be));
    const size_t lend_bytes = (size_t)64 << 20;
    unsigned char *lend;
    ok(be->host_alloc(be, lend_bytes, (void **)&lend));
    for (int small = 1; small >= 0; small--) {
        memset(lend, 0xA5, lend_bytes);
        mt_ckpt *ck;
        ok(mt_ckpt_open(&ck, step));
        mt_tensor_reader r = {ck, mt_ckpt_read_fn, mt_ckpt_read_fp8_fn, NULL, 0};
        ok(mt_train_state_restore_staged(b, &r, mt_ckpt_get_meta(ck)->state_json, lend,
                                         small ? 4096 : lend_bytes));
        mt_ckpt_close(ck);
        size_t touched = 0;
        for (size_t k = 0; k < lend_bytes; k++) touched += lend[k] != 0xA5;
        if (small) assert_int_equal(touched, 0);
        else assert_true(touched > 0);
        assert_same_state(a, b);
    }
    be->host_free(be, lend);
    ok(mt_job_ckpt_close(ca));
    mt_trainer_destroy(a);
    mt_trainer_destroy(b);
}

/* Async saves every 2 steps while training continues: committed, stall
 * and write time reported, the newest one equals the trainer's state. */
static void test_async_saves(void **state)
{
    (void)state;
    char dir[1300], set_dir[1400], set_init[1400];
    snprintf(dir, sizeof dir, "%s/async", tmp);
    snprintf(set_dir, sizeof set_dir, "checkpoint.dir=%s", dir);
    const char *sa[] = {set_dir, "checkpoint.async=true", "checkpoint.interval=2",
                        "checkpoint.keep_last=2"};
    mt_jobspec ja, jb;
    tiny_job(&ja, sa, 4);
    mt_job_ckpt *ca, *cb;
    mt_trainer *a = make(&ja, &ca);
    for (int i = 0; i < 6; i++) {
        ok(mt_trainer_step(a, NULL));
        ok(mt_job_ckpt_after_step(ca, a));
    }
    ok(mt_job_ckpt_wait(ca));
    mt_job_ckpt_stats st;
    mt_job_ckpt_get_stats(ca, &st);
    assert_int_equal(st.saves, 3);
    assert_int_equal(st.failures, 0);
    assert_int_equal(st.last_step, 6);
    assert_true(st.last_stall_ms > 0 && st.last_write_ms > 0 && st.last_bytes > 0);
    assert_contains(st.last_path, "step_00000006");
    int64_t *steps;
    int n;
    ok(mt_ckpt_list(dir, &steps, &n));
    assert_int_equal(n, 2); /* keep_last */
    assert_int_equal(steps[0], 4);
    assert_int_equal(steps[1], 6);
    free(steps);
    snprintf(set_init, sizeof set_init, "init.path=%s", dir);
    const char *sb[] = {"init.kind=checkpoint", set_init};
    tiny_job(&jb, sb, 2);
    mt_trainer *b = make(&jb, &cb);
    assert_same_state(a, b);
    step_both_same(a, b);
    ok(mt_job_ckpt_close(ca));
    ok(mt_job_ckpt_close(cb));
    mt_trainer_destroy(a);
    mt_trainer_destroy(b);
}

/* export-hf then init.kind=hf: the same FP8 weights, BF16 weights and
 * router biases; moments zero, main params from the weights, step 0. */
static void test_hf_into_trainer(void **state)
{
    (void)state;
    char dir[1300], hf[1300], set_dir[1400], set_init[1400];
    snprintf(dir, sizeof dir, "%s/hfsrc", tmp);
    snprintf(hf, sizeof hf, "%s/hf", tmp);
    snprintf(set_dir, sizeof set_dir, "checkpoint.dir=%s", dir);
    const char *sa[] = {set_dir, "checkpoint.async=false"};
    mt_jobspec ja, jb;
    tiny_job(&ja, sa, 2);
    mt_job_ckpt *ca, *cb;
    mt_trainer *a = make(&ja, &ca);
    for (int i = 0; i < 2; i++) ok(mt_trainer_step(a, NULL));
    ok(mt_job_ckpt_save_now(ca, a));
    ok(mt_hf_export(dir, hf, 1 << 20, NULL));
    snprintf(set_init, sizeof set_init, "init.path=%s", hf);
    const char *sb[] = {"init.kind=hf", set_init};
    tiny_job(&jb, sb, 2);
    mt_trainer *b = make(&jb, &cb);
    assert_int_equal(b->step, 0);
    mt_train_snapshot x, y;
    memset(&x, 0, sizeof x);
    memset(&y, 0, sizeof y);
    ok(mt_train_state_snapshot(a, &x));
    ok(mt_train_state_snapshot(b, &y));
    for (int i = 0; i < x.n_params; i++) {
        const mt_param *p = &a->model->params[i];
        int64_t n = mt_param_numel(&p->d);
        if (x.params[i].q_off >= 0) {
            bytes_equal(x.q + x.params[i].q_off, y.q + y.params[i].q_off, (size_t)n, p->d.name);
            int64_t nb = ((p->d.rows + 127) / 128) * ((p->d.cols + 127) / 128);
            bytes_equal(x.s + x.params[i].s_off, y.s + y.params[i].s_off, (size_t)nb * 4, p->d.name);
        } else if (x.params[i].act_off >= 0) {
            const size_t ab = (size_t)x.act_bytes; /* float on the CPU, bf16 on CUDA */
            bytes_equal((char *)x.act + (size_t)x.params[i].act_off * ab,
                        (char *)y.act + (size_t)y.params[i].act_off * ab, (size_t)n * ab, p->d.name);
        } else {
            bytes_equal(x.f32 + x.params[i].f32_off, y.f32 + y.params[i].f32_off, (size_t)n * 4, p->d.name);
        }
        if (y.params[i].opt_off >= 0) {
            for (int64_t k = 0; k < n; k++) assert_int_equal(y.m[y.params[i].opt_off + k], 0);
            /* main = the dequantised compute copy */
            float *w = malloc((size_t)n * 4);
            ok(mt_model_get_param(b->model, i, w));
            bytes_equal((float *)y.master + y.params[i].opt_off, w, (size_t)n * 4, "main from weights");
            free(w);
        }
    }
    mt_train_snapshot_free(&x);
    mt_train_snapshot_free(&y);
    ok(mt_trainer_step(b, NULL)); /* it trains */
    ok(mt_job_ckpt_close(ca));
    ok(mt_job_ckpt_close(cb));
    mt_trainer_destroy(a);
    mt_trainer_destroy(b);
}

/* Issue 21, defect 6: a job does not start from a checkpoint whose index
 * was damaged after the commit (MT_ECORRUPT naming index.h5, DATA_LOSS
 * over gRPC); asked (init.fallback), it starts from the newest older step
 * of the root that loads, and sets the damaged one aside so that its
 * history holds no newer step. */
static void test_damaged_checkpoint_fallback(void **state)
{
    (void)state;
    char dir[1300], cmd[3000], idx[1400], set_dir[1400], set_init[1400];
    snprintf(dir, sizeof dir, "%s/damaged", tmp);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s/async' '%s'", dir, tmp, dir); /* steps 4, 6 */
    assert_int_equal(system(cmd), 0);
    snprintf(idx, sizeof idx, "%s/step_00000006/index.h5", dir);
    assert_int_equal(mt_test_damage_index(idx), 0);
    snprintf(set_dir, sizeof set_dir, "checkpoint.dir=%s", dir);
    snprintf(set_init, sizeof set_init, "init.path=%s", dir);
    const char *plain[] = {"init.kind=checkpoint", set_init, set_dir};
    const char *fallback[] = {"init.kind=checkpoint", set_init, set_dir, "init.fallback=true"};
    mt_jobspec j;
    mt_trainer *t;
    mt_job_ckpt *c;
    tiny_job(&j, plain, 3);
    ok(mt_trainer_create(&t, &j, be));
    ok(mt_job_ckpt_open(&c, &j, NULL));
    assert_int_equal(mt_job_ckpt_restore(c, t), MT_ECORRUPT);
    assert_contains(mt_errmsg(), "step_00000006/index.h5");
    ok(mt_job_ckpt_close(c));
    mt_trainer_destroy(t);
    /* nothing was changed by the refusal */
    int64_t *steps;
    int n;
    ok(mt_ckpt_list(dir, &steps, &n));
    assert_int_equal(n, 2);
    free(steps);

    tiny_job(&j, fallback, 4);
    ok(mt_trainer_create(&t, &j, be));
    ok(mt_job_ckpt_open(&c, &j, NULL));
    ok(mt_job_ckpt_restore(c, t));
    assert_int_equal(t->step, 4);
    ok(mt_ckpt_list(dir, &steps, &n));
    assert_int_equal(n, 1);
    assert_int_equal(steps[0], 4);
    free(steps);
    snprintf(idx, sizeof idx, "%s/step_00000006.damaged/index.h5", dir);
    assert_int_equal(access(idx, F_OK), 0);
    /* it trains and saves step 6 again */
    ok(mt_trainer_step(t, NULL));
    ok(mt_trainer_step(t, NULL));
    ok(mt_job_ckpt_save_now(c, t));
    ok(mt_ckpt_verify(dir, NULL, NULL, NULL));
    ok(mt_job_ckpt_close(c));
    mt_trainer_destroy(t);
}

/* A fresh job refuses a checkpoint.dir holding a newer checkpoint. */
static void test_refuses_newer_history(void **state)
{
    (void)state;
    char dir[1300], set_dir[1400];
    snprintf(dir, sizeof dir, "%s/fp8_fp32", tmp); /* step 3 from the first test */
    snprintf(set_dir, sizeof set_dir, "checkpoint.dir=%s", dir);
    const char *sa[] = {set_dir};
    mt_jobspec j;
    tiny_job(&j, sa, 1);
    mt_trainer *t;
    mt_job_ckpt *c;
    ok(mt_trainer_create(&t, &j, be));
    ok(mt_job_ckpt_open(&c, &j, NULL));
    assert_int_equal(mt_job_ckpt_restore(c, t), MT_EINVAL);
    assert_contains(mt_errmsg(), "step_00000003");
    ok(mt_job_ckpt_close(c));
    mt_trainer_destroy(t);
}

int main(int argc, char **argv)
{
    examples = argc > 1 ? argv[1] : "deploy/examples";
    on_cuda = argc > 2 && !strcmp(argv[2], "cuda");
    if (on_cuda && mt_cuda_device_count() < 1) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exact_fp8_main_fp32), cmocka_unit_test(test_exact_fp8_main_bf16),
        cmocka_unit_test(test_exact_fp8_main_none), cmocka_unit_test(test_exact_bf16_recipe),
        cmocka_unit_test(test_exact_fp32_recipe),   cmocka_unit_test(test_snapshot_slab_reused),
        cmocka_unit_test(test_restore_staged_in_lent_memory), cmocka_unit_test(test_async_saves),
        cmocka_unit_test(test_hf_into_trainer),     cmocka_unit_test(test_refuses_newer_history),
        cmocka_unit_test(test_damaged_checkpoint_fallback),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
