/* job_checkpoint.c - see job_checkpoint.h. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE
#include "runtime/job_checkpoint.h"
#include "runtime/job_resume.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/ckpt.h"
#include "ckpt/hf.h"
#include "engine/parallel/sharding.h"
#include "engine/train/train_state.h"
#include "base/mt_clock.h"
#include "base/mt_log.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"

enum { PHASE_SHARD = 1, PHASE_INDEX = 2 };

struct mt_job_ckpt {
    mt_jobspec job;
    mt_comm *comm;             /* the world's host communicator; NULL: one rank */
    int rank, world;
    char root[MT_PATH_CAP];
    mt_shard_map map;          /* the job's contents under the processes' layout */
    int have_map;
    int share_load;            /* restores read replicated weights once per group */
    /* the save in flight */
    int busy;
    int phase;
    pthread_t th;
    int th_live;
    atomic_int th_done;
    int async;
    int64_t step;
    char partial[MT_PATH_CAP + 32];
    mt_train_snapshot snap;    /* host copies (asynchronous saves; kept for the next) */
    mt_train_snapshot view;    /* a synchronous save on host memory: no copy */
    mt_train_snapshot *cur;    /* the one the save in flight writes */
    mt_ckpt_meta meta;
    mt_tensor_desc *descs;     /* this rank's pieces */
    mt_ckpt_piece_rec *recs;
    int n_recs;
    mt_ckpt_piece_rec *all;    /* rank 0: every rank's records */
    int n_all;
    mt_ckpt_index *ix;         /* rank 0 of several: the index begun after its shard */
    int rc;
    char err[1024];
    double t_start;
    double t_call;             /* when the save was asked for */
    double wait_ms, copy_ms;   /* of the stall: waiting for the previous save, the host copy */
    /* phases, ms after t_start (MOETRAIN_LOG=debug prints them): this
     * rank's shard written, every rank's records at rank 0, index, commit */
    double ms_shard, ms_index_begun, ms_gather, ms_index, ms_commit;
    int foreground;            /* training waits for the whole save */
    mt_job_ckpt_stats st;
    pthread_mutex_t mu;        /* guards st */
};

int mt_job_ckpt_open(mt_job_ckpt **out, const mt_jobspec *job, mt_comm *world)
{
    *out = NULL;
    mt_job_ckpt *jc = calloc(1, sizeof *jc);
    if (!jc) return MT_ERR(MT_ENOMEM, "checkpoint policy: out of memory");
    jc->job = *job;
    jc->comm = world;
    jc->rank = world ? mt_comm_rank(world) : 0;
    jc->world = world ? mt_comm_size(world) : 1;
    pthread_mutex_init(&jc->mu, NULL);
    atomic_init(&jc->th_done, 0);
    jc->st.last_step = jc->st.restored_step = -1;
    snprintf(jc->root, sizeof jc->root, "%s", job->checkpoint.dir);
    jc->async = job->checkpoint.async;
    *out = jc;
    if (!jc->root[0]) return MT_OK;
    /* the admitted layout of the processes */
    mt_layout l = job->parallel;
    if (mt_layout_world(&l) != jc->world)
        return MT_ERR(MT_EINVAL, "checkpoint.dir %s: the job's layout covers %d ranks, not the "
                      "%d that run it (the job was not admitted)", jc->root,
                      l.dp > 0 ? mt_layout_world(&l) : 0, jc->world);
    mt_shard_opts o;
    mt_train_state_opts(job, &o);
    int rc = mt_shard_map_build(&jc->map, &job->model, &l, &o);
    if (rc < 0) return mt_err_wrap(rc, "checkpoint.dir %s", jc->root);
    jc->have_map = 1;
    return MT_OK;
}

/* ---- restore ------------------------------------------------------------------------- */

/* Names the config fields that differ between two config JSON texts. */
static int same_config(const char *saved, const mt_model_config *job, const char *what)
{
    json_error_t e;
    json_t *a = json_loads(saved, 0, &e);
    json_t *b = mt_config_to_json(job);
    if (!a) {
        json_decref(b);
        return MT_ERR(MT_ECORRUPT, "%s: model config: %s", what, e.text);
    }
    /* normalise the saved one through the parser, as the job's was */
    mt_model_config c;
    int rc = mt_config_from_json(&c, a, "model", 0);
    json_decref(a);
    if (rc < 0) {
        json_decref(b);
        return mt_err_wrap(rc, "%s", what);
    }
    a = mt_config_to_json(&c);
    char diff[512] = "";
    const char *k;
    json_t *v;
    json_object_foreach(b, k, v)
    {
        if (!json_equal(v, json_object_get(a, k)) && strcmp(k, "initializer_range") != 0) {
            size_t n = strlen(diff);
            snprintf(diff + n, sizeof diff - n, "%s%s", n ? ", " : "", k);
        }
    }
    json_decref(a);
    json_decref(b);
    if (diff[0])
        return MT_ERR(MT_EINVAL, "%s: the model differs from the job's model in: %s", what, diff);
    return MT_OK;
}

/* Every rank's outcome of one attempt (collective under several ranks):
 * the worst status, with the message of the lowest rank that has it, so
 * that all ranks fail, fall back or go on together and rank 0 reports the
 * cause (a damaged piece only its reader sees). */
static int agree(const mt_job_ckpt *jc, int rc)
{
    if (!jc->comm || jc->world == 1) return rc;
    mt_comm *c = mt_comm_host(jc->comm);
    int32_t mine = rc < 0 ? rc : 0, worst = 0, who = jc->world, from;
    if (mt_comm_all_reduce(c, &mine, &worst, 1, MT_COMM_I32, MT_COMM_MIN) < 0) return MT_EGENERIC;
    if (worst >= 0) return MT_OK;
    from = mine == worst ? jc->rank : jc->world;
    if (mt_comm_all_reduce(c, &from, &who, 1, MT_COMM_I32, MT_COMM_MIN) < 0) return MT_EGENERIC;
    char msg[1024] = "";
    if (jc->rank == who) snprintf(msg, sizeof msg, "%s", mt_errmsg());
    if (mt_comm_broadcast(c, msg, sizeof msg, MT_COMM_BYTE, who) < 0) return MT_EGENERIC;
    if (jc->rank == who) return rc;
    return MT_ERR(worst, "rank %d: %s", who, msg);
}

mt_tensor_reader mt_job_ckpt_reader(const mt_job_ckpt *jc, mt_ckpt *ck)
{
    mt_tensor_reader r = {ck, mt_ckpt_read_fn, mt_ckpt_read_fp8_fn, mt_ckpt_skip_fn,
                          jc->share_load};
    return r;
}

/* This host's name, hashed (non-negative: compared by MIN and MAX). */
static int64_t host_hash(void)
{
    char h[256] = "";
    if (gethostname(h, sizeof h - 1) != 0) return 0;
    return (int64_t)(mt_hash_str(h) >> 1);
}

/* Whether a multi-rank restore reads each replicated weight on one replica
 * and sends it to the others (train_state.c, share_plan). Measured on one
 * 16-core host (tests/bench/RESULTS.md, issue 23): the ranks of one host
 * reading everything themselves load faster (80 % of dd against 65 %) -
 * the page cache already reads each byte from the disk once, and the
 * replicas check and convert in parallel instead of waiting for a reader
 * piece by piece - so sharing pays where the ranks span hosts, whose
 * reads would each reach the (shared) file system. MT_CKPT_SHARED_LOAD=1
 * or 0 decides instead; MT_CKPT_NO_SHARED_LOAD=1 is the same as =0.
 * Collective over world: mt_job_ckpt_restore, which every rank reaches. */
static int decide_share_load(mt_job_ckpt *jc)
{
    const char *e = getenv("MT_CKPT_SHARED_LOAD"), *ns = getenv("MT_CKPT_NO_SHARED_LOAD");
    int spans_hosts = 0;
    if (jc->world > 1) {
        int64_t h = host_hash(), lo = 0, hi = 0;
        MT_CHECK(mt_comm_all_reduce(jc->comm, &h, &lo, 1, MT_COMM_I64, MT_COMM_MIN));
        MT_CHECK(mt_comm_all_reduce(jc->comm, &h, &hi, 1, MT_COMM_I64, MT_COMM_MAX));
        spans_hosts = lo != hi;
    }
    if (e && *e) jc->share_load = !strcmp(e, "1");
    else jc->share_load = spans_hosts;
    if (ns && !strcmp(ns, "1")) jc->share_load = 0;
    return MT_OK;
}

/* The reserved snapshot, when no save writes from it: its slab may stage
 * a restore's reads. */
static const mt_train_snapshot *idle_snapshot(const mt_job_ckpt *jc)
{
    return jc->snap.slab && !jc->busy ? &jc->snap : NULL;
}

/* Collective over the job's ranks (all of them call it for the same path):
 * the restore's replica groups send each replicated weight from the one
 * replica that reads it (issue 23), so every rank must get there or none.
 * stage: a reserved snapshot whose slab stages the reads (or NULL). */
static int restore_from(const mt_job_ckpt *jc, mt_trainer *t, const char *path,
                        const mt_train_snapshot *stage)
{
    double t0 = mt_now_ms();
    mt_ckpt *ck = NULL;
    int rc = mt_ckpt_open(&ck, path);
    if (rc == MT_OK) {
        mt_ckpt_set_reader_rank(ck, jc->rank);
        rc = same_config(mt_ckpt_get_meta(ck)->config_json, &t->job.model, mt_ckpt_dir(ck));
    }
    rc = agree(jc, rc);
    if (rc < 0) {
        mt_ckpt_close(ck);
        return rc;
    }
    const mt_ckpt_meta *m = mt_ckpt_get_meta(ck);
    mt_tensor_reader r = mt_job_ckpt_reader(jc, ck);
    rc = mt_train_state_restore_staged(t, &r, m->state_json, stage ? stage->slab : NULL,
                                       stage ? stage->slab_bytes : 0);
    if (rc == MT_OK) {
        MT_LOGI("restored step %lld (%lld samples) from %s: %.2f GB in %.1f s", (long long)t->step,
                (long long)t->consumed_samples, mt_ckpt_dir(ck), (double)mt_ckpt_bytes(ck) / 1e9,
                (mt_now_ms() - t0) / 1e3);
    }
    mt_ckpt_close(ck);
    return rc;
}

/* A damaged or unreadable checkpoint (what init.fallback steps over); a
 * wrong model or a bad spec is not. */
static int is_damage(int rc) { return rc == MT_ECORRUPT || rc == MT_EIO; }

/* Rank 0 moves a damaged checkpoint the job stepped over out of the
 * committed namespace (mt_ckpt_set_aside: step_N.damaged, kept for
 * inspection, `latest` repointed): the job saves that step again, and its
 * history must not hold a newer step. */
static int set_aside(mt_job_ckpt *jc, const char *root, int64_t step)
{
    int rc = MT_OK;
    if (jc->rank == 0) {
        char moved[MT_PATH_CAP + 64];
        rc = mt_ckpt_set_aside(root, step, "damaged", moved, sizeof moved);
        if (rc == MT_OK) MT_LOGW("checkpoint: step_%08lld of %s is damaged; set aside as %s",
                                 (long long)step, root, moved);
    }
    return agree(jc, rc);
}

/* init.path's checkpoint; with init.fallback, when it is damaged, the
 * newest older committed step of the same root that loads (all ranks
 * agree on each attempt). */
static int restore_checkpoint(mt_job_ckpt *jc, mt_trainer *t)
{
    char first[MT_PATH_CAP + 32], root[MT_PATH_CAP + 32];
    int rc = agree(jc, mt_ckpt_resolve(jc->job.init.path, first, sizeof first));
    if (rc < 0) return mt_err_wrap(rc, "init.path %s", jc->job.init.path);
    rc = agree(jc, restore_from(jc, t, first, idle_snapshot(jc)));
    if (rc == MT_OK || !jc->job.init.fallback || !is_damage(rc))
        return rc < 0 ? mt_err_wrap(rc, "init.path %s", jc->job.init.path) : rc;
    /* the older steps of its root, newest first; a step the daemon holds
     * open (/proc/self/fd/N, service/workdir.c) is named by its real path */
    char real[PATH_MAX];
    const char *named = realpath(first, real) ? real : first;
    const char *slash = strrchr(named, '/');
    snprintf(root, sizeof root, "%.*s", slash ? (int)(slash - named) : 1, slash ? named : ".");
    int64_t step = strtoll(slash ? slash + 6 : named + 5, NULL, 10), *steps = NULL;
    int n = 0;
    char why[1024];
    snprintf(why, sizeof why, "%s", mt_errmsg());
    MT_CHECK(mt_ckpt_list(root, &steps, &n));
    /* the job's own history: damaged steps it skips are set aside */
    char a[PATH_MAX], b[PATH_MAX];
    const int own = jc->root[0] && realpath(root, a) && realpath(jc->root, b) && !strcmp(a, b);
    char tried[MT_PATH_CAP + 32];
    snprintf(tried, sizeof tried, "%s", first);
    for (int i = n - 1; i >= 0 && rc < 0 && is_damage(rc); i--) {
        if (steps[i] >= step) continue;
        char path[MT_PATH_CAP + 32];
        mt_ckpt_step_path(path, sizeof path, root, steps[i], 0);
        MT_LOGW("checkpoint: %s cannot be loaded (%s); init.fallback: trying %s", tried, why, path);
        rc = agree(jc, restore_from(jc, t, path, idle_snapshot(jc)));
        if (rc < 0) snprintf(why, sizeof why, "%s", mt_errmsg());
        snprintf(tried, sizeof tried, "%s", path);
    }
    if (rc < 0) {
        free(steps);
        return MT_ERR(rc, "init.path %s: no checkpoint of %s loads (init.fallback); the last "
                          "tried, %s: %s",
                      jc->job.init.path, root, tried, why);
    }
    /* started from step t->step: the damaged newer ones leave the job's history */
    for (int i = 0; i < n && rc == MT_OK && own; i++) {
        if (steps[i] <= t->step || steps[i] > step) continue;
        rc = set_aside(jc, root, steps[i]);
    }
    free(steps);
    return rc;
}

static int restore_hf(mt_job_ckpt *jc, mt_trainer *t)
{
    double t0 = mt_now_ms();
    mt_hf *h;
    MT_CHECK(mt_hf_open(&h, jc->job.init.path));
    char *cj = mt_train_state_config_json(mt_hf_config(h));
    int rc = cj ? same_config(cj, &t->job.model, jc->job.init.path) : MT_ERR(MT_ENOMEM, "out of memory");
    free(cj);
    mt_tensor_reader r = {h, mt_hf_read_fn, mt_hf_read_fp8_fn, NULL, 0};
    if (rc == MT_OK)
        rc = mt_train_state_restore_staged(t, &r, NULL, idle_snapshot(jc) ? jc->snap.slab : NULL,
                                           jc->snap.slab_bytes);
    if (rc == MT_OK)
        MT_LOGI("imported the weights of %s in %.1f s", jc->job.init.path, (mt_now_ms() - t0) / 1e3);
    else
        rc = mt_err_wrap(rc, "init.path %s", jc->job.init.path);
    mt_hf_close(h);
    return rc;
}

/* On a device the snapshot is page-locked host memory; locking ~14 GB
 * takes seconds, which would be the first save's stall: done when the job
 * starts, before its state loads (the slab, idle until the first save,
 * then stages the restore's reads: no page-locked buffers of its own). */
static void reserve_snapshot(mt_job_ckpt *jc, mt_trainer *t)
{
    if (!jc->root[0] || jc->job.checkpoint.interval <= 0 || t->model->be->kind == MT_BE_CPU)
        return;
    double t0 = mt_now_ms();
    if (mt_train_state_snapshot_reserve(t, &jc->snap) == MT_OK) {
        MT_LOGI("checkpoint: %.2f GB of %s host memory for the snapshot in %.1f s",
                (double)jc->snap.slab_bytes / 1e9, jc->snap.slab_pinned ? "page-locked" : "pageable",
                (mt_now_ms() - t0) / 1e3);
    } else {
        MT_LOGW("checkpoint: %s; the first save allocates its snapshot", mt_errmsg());
        mt_err_clear();
    }
}

int mt_job_ckpt_restore(mt_job_ckpt *jc, mt_trainer *t)
{
    MT_CHECK(decide_share_load(jc));
    MT_CHECK(mt_job_resume_auto(&jc->job, jc->comm)); /* issue 20 */
    reserve_snapshot(jc, t);
    if (jc->job.init.kind == MT_INIT_CHECKPOINT) MT_CHECK(restore_checkpoint(jc, t));
    if (jc->job.init.kind == MT_INIT_HF) MT_CHECK(restore_hf(jc, t));
    if (jc->job.init.kind != MT_INIT_RANDOM) jc->st.restored_step = t->step;
    if (!jc->root[0]) return MT_OK;
    int64_t *steps;
    int n;
    MT_CHECK(mt_ckpt_list(jc->root, &steps, &n));
    int64_t newest = n ? steps[n - 1] : -1;
    free(steps);
    if (newest > t->step)
        return MT_ERR(MT_EINVAL,
                      "checkpoint.dir %s already holds step_%08lld, newer than this job's start "
                      "(step %lld): resume from it (init.kind=checkpoint, init.path=%s) or choose "
                      "an empty checkpoint.dir",
                      jc->root, (long long)newest, (long long)t->step, jc->root);
    if (newest == t->step) { /* resumed from it: do not save it again */
        jc->st.last_step = newest;
        mt_ckpt_step_path(jc->st.last_path, sizeof jc->st.last_path, jc->root, newest, 0);
    }
    return MT_OK;
}

/* ---- saving ----------------------------------------------------------------------------- */

static int fill_snapshot(void *ctx, int i, const mt_tensor_desc *band, void *buf)
{
    (void)i;
    mt_job_ckpt *jc = ctx;
    return mt_train_snapshot_fill(jc->cur, &jc->map, band, buf);
}

/* This rank's shard file. */
static int write_local(mt_job_ckpt *jc)
{
    int n;
    const int *idx = mt_shard_map_rank_pieces(&jc->map, jc->rank, &n);
    jc->n_recs = n;
    jc->descs = calloc((size_t)n + 1, sizeof *jc->descs);
    jc->recs = calloc((size_t)n + 1, sizeof *jc->recs);
    if (!jc->descs || !jc->recs) return MT_ERR(MT_ENOMEM, "checkpoint: out of memory");
    for (int k = 0; k < n; k++) {
        mt_shard_piece_desc(&jc->map, idx[k], &jc->descs[k]);
        /* whole rows already in the snapshot in the stored type: no copy */
        jc->descs[k].data = (void *)mt_train_snapshot_direct(jc->cur, &jc->map, &jc->descs[k]);
    }
    if (!n) return MT_OK;
    return mt_ckpt_write_shard(jc->partial, jc->rank, jc->descs, n, fill_snapshot, jc, jc->recs, NULL);
}

/* Rank 0: the index and the commit. */
static int finalize(mt_job_ckpt *jc)
{
    mt_ckpt_index *ix = jc->ix;
    jc->ix = NULL;
    MT_CHECK(ix ? mt_ckpt_index_finish(ix, jc->all, jc->n_all)
                : mt_ckpt_write_index(jc->partial, &jc->meta, &jc->map, jc->all, jc->n_all));
    jc->ms_index = mt_now_ms() - jc->t_start;
    int rc = mt_ckpt_commit(jc->root, jc->step, jc->job.checkpoint.keep_last);
    jc->ms_commit = mt_now_ms() - jc->t_start;
    return rc;
}

static void *writer_main(void *arg)
{
    mt_job_ckpt *jc = arg;
    int rc;
    if (jc->phase == PHASE_SHARD) {
        rc = write_local(jc);
        jc->ms_shard = mt_now_ms() - jc->t_start;
        /* the index from the shard map while the other ranks finish their
         * shards (issue 23: written after the gather, it was 85-135 ms of a
         * 4-rank save's 1.6-2.0 s on the lent 16-core hosts); only the
         * pieces' checksums and the files' sizes wait for the gather. A
         * failure here only means the whole index is written then. */
        if (rc == MT_OK && jc->world > 1 && jc->rank == 0 &&
            mt_ckpt_index_begin(&jc->ix, jc->partial, &jc->meta, &jc->map) < 0) {
            MT_LOGD("checkpoint: the index is written after the gather: %s", mt_errmsg());
            mt_err_clear();
        }
        jc->ms_index_begun = mt_now_ms() - jc->t_start;
        if (rc == MT_OK && jc->world == 1) {
            jc->all = jc->recs;
            jc->n_all = jc->n_recs;
            rc = finalize(jc);
        }
    } else {
        rc = finalize(jc);
    }
    jc->rc = rc;
    if (rc < 0) snprintf(jc->err, sizeof jc->err, "%s", mt_errmsg());
    atomic_store(&jc->th_done, 1);
    return NULL;
}

static int run_phase(mt_job_ckpt *jc, int phase, int background)
{
    jc->phase = phase;
    atomic_store(&jc->th_done, 0);
    if (background) {
        if (pthread_create(&jc->th, NULL, writer_main, jc) == 0) {
            jc->th_live = 1;
            return MT_OK;
        }
        MT_LOGW("checkpoint: cannot start a writer thread; saving in the foreground");
    }
    writer_main(jc);
    return MT_OK;
}

/* Frees what a save used; the snapshot's host buffers stay for the next
 * save (its stall is then a copy, with no allocation or page faults). */
static void release(mt_job_ckpt *jc)
{
    mt_ckpt_index_abort(jc->ix); /* a save that failed after it was begun */
    jc->ix = NULL;
    mt_ckpt_meta_free(&jc->meta);
    if (jc->all != jc->recs) free(jc->all);
    free(jc->recs);
    free(jc->descs);
    jc->all = jc->recs = NULL;
    jc->descs = NULL;
    jc->n_all = jc->n_recs = 0;
    jc->busy = 0;
}

/* The save in flight is over on this rank: stats, log, release. */
static int finish(mt_job_ckpt *jc)
{
    int rc = jc->rc;
    double ms = mt_now_ms() - jc->t_start;
    pthread_mutex_lock(&jc->mu);
    jc->st.in_flight = 0;
    /* a save in the foreground blocks training from the call to the commit */
    if (jc->foreground) jc->st.last_stall_ms = mt_now_ms() - jc->t_call;
    if (rc == MT_OK) {
        jc->st.saves++;
        jc->st.last_step = jc->step;
        jc->st.last_write_ms = ms;
        mt_ckpt_step_path(jc->st.last_path, sizeof jc->st.last_path, jc->root, jc->step, 0);
    } else {
        jc->st.failures++;
    }
    pthread_mutex_unlock(&jc->mu);
    char copy[96] = "written from the trainer's memory";
    if (jc->cur != &jc->view)
        snprintf(copy, sizeof copy, "host copy %.1f ms at %.2f GB/s", jc->copy_ms,
                 (double)jc->st.last_bytes / 1e6 / (jc->copy_ms > 0 ? jc->copy_ms : 1));
    if (rc == MT_OK && jc->rank == 0)
        MT_LOGI("checkpoint step_%08lld committed in %s: stall %.1f ms (waiting for the previous "
                "save %.1f ms, %s), written in %.1f ms (%.1f MB, %.0f MB/s)",
                (long long)jc->step, jc->root, jc->st.last_stall_ms, jc->wait_ms, copy, ms,
                (double)jc->st.last_bytes / 1e6, (double)jc->st.last_bytes / 1e3 / (ms > 0 ? ms : 1));
    else if (rc < 0)
        MT_LOGE("checkpoint step_%08lld failed: %s; the previous checkpoint stays the newest",
                (long long)jc->step, jc->err);
    if (rc == MT_OK && jc->rank == 0)
        MT_LOGD("checkpoint step_%08lld, rank 0: shard written at %.1f ms, index begun at %.1f ms, "
                "records gathered at %.1f ms, index written at %.1f ms, committed at %.1f ms",
                (long long)jc->step, jc->ms_shard, jc->ms_index_begun, jc->ms_gather, jc->ms_index,
                jc->ms_commit);
    else if (rc == MT_OK)
        MT_LOGD("checkpoint step_%08lld, rank %d: shard written at %.1f ms, records gathered at "
                "%.1f ms", (long long)jc->step, jc->rank, jc->ms_shard, jc->ms_gather);
    jc->ms_shard = jc->ms_index_begun = jc->ms_gather = jc->ms_index = jc->ms_commit = 0;
    release(jc);
    return rc < 0 ? MT_ERR(rc, "checkpoint step_%08lld: %s", (long long)jc->step, jc->err) : MT_OK;
}

/* Gathers every rank's piece records to rank 0 (collective). */
static int gather_records(mt_job_ckpt *jc)
{
    const size_t rec = sizeof *jc->recs, W = (size_t)jc->world;
    const int root = jc->rank == 0;
    int64_t n = jc->rc == MT_OK ? jc->n_recs : 0;
    /* rank 0: record counts (one I64 per rank at slot r), then bytes */
    int64_t *counts = root ? calloc(W, sizeof *counts) : NULL;
    size_t *ones = root ? calloc(W, sizeof *ones) : NULL;
    size_t *slot = root ? calloc(W, sizeof *slot) : NULL;
    size_t *bytes = root ? calloc(W, sizeof *bytes) : NULL;
    size_t *displs = root ? calloc(W, sizeof *displs) : NULL;
    int rc = MT_OK;
    if (root && (!counts || !ones || !slot || !bytes || !displs))
        rc = MT_ERR(MT_ENOMEM, "checkpoint: out of memory");
    int all_ok = mt_comm_agree(jc->comm, jc->rc == MT_OK && rc == MT_OK);
    if (all_ok < 0) rc = all_ok;
    size_t total = 0;
    char *buf = NULL;
    if (all_ok == 1) {
        for (size_t r = 0; root && r < W; r++) {
            ones[r] = 1;
            slot[r] = r;
        }
        rc = mt_comm_gather_v(jc->comm, &n, 1, counts, ones, slot, MT_COMM_I64, 0);
        if (rc == MT_OK && root) {
            for (size_t r = 0; r < W; r++) {
                displs[r] = total;
                bytes[r] = (size_t)counts[r] * rec;
                total += bytes[r];
            }
            buf = malloc(total + 1);
            if (!buf) rc = MT_ERR(MT_ENOMEM, "checkpoint: out of memory");
        }
        /* rank 0's allocation failure would leave the others waiting: agree */
        int ready = mt_comm_agree(jc->comm, rc == MT_OK);
        if (ready == 1)
            rc = mt_comm_gather_v(jc->comm, jc->recs, (size_t)n * rec, buf, bytes, displs,
                                  MT_COMM_BYTE, 0);
        else if (rc == MT_OK)
            rc = ready < 0 ? ready : MT_ERR(MT_EIO, "checkpoint: rank 0 cannot gather the records");
    }
    free(counts);
    free(ones);
    free(slot);
    free(bytes);
    free(displs);
    if (root && rc == MT_OK) {
        jc->all = (mt_ckpt_piece_rec *)buf;
        jc->n_all = (int)(total / rec);
    } else {
        free(buf);
    }
    if (all_ok == 0 && jc->rc == MT_OK) {
        jc->rc = MT_EIO;
        snprintf(jc->err, sizeof jc->err, "another rank failed to write its shard");
    }
    return rc;
}

/* Advances the save in flight; with block, to its end. */
static int progress(mt_job_ckpt *jc, int block)
{
    if (!jc->busy) return MT_OK;
    int done = atomic_load(&jc->th_done);
    if (jc->world > 1 && jc->phase == PHASE_SHARD) {
        /* every rank takes part each time: the shard phase ends together */
        if (block && jc->th_live) {
            pthread_join(jc->th, NULL);
            jc->th_live = 0;
            done = 1;
        }
        int all = mt_comm_agree(jc->comm, done);
        if (all < 0) return all;
        if (!all) return MT_OK;
        if (jc->th_live) {
            pthread_join(jc->th, NULL);
            jc->th_live = 0;
        }
        MT_CHECK(gather_records(jc));
        jc->ms_gather = mt_now_ms() - jc->t_start;
        if (jc->rank != 0 || jc->rc < 0) return finish(jc);
        return run_phase(jc, PHASE_INDEX, !block && jc->async) < 0 ? finish(jc) : progress(jc, block);
    }
    if (!done && !block) return MT_OK;
    if (jc->th_live) {
        pthread_join(jc->th, NULL);
        jc->th_live = 0;
    }
    return finish(jc);
}

static int start_save(mt_job_ckpt *jc, mt_trainer *t, int background)
{
    double t0 = mt_now_ms();
    /* at most one save in flight: a due save waits for the previous one */
    int prev = progress(jc, 1);
    if (prev < 0) MT_LOGW("%s", mt_errmsg());
    jc->t_start = mt_now_ms();
    jc->t_call = t0;
    jc->wait_ms = jc->t_start - t0;
    jc->foreground = !background;
    jc->step = t->step;
    jc->rc = MT_OK;
    jc->err[0] = '\0';
    /* a synchronous save of a host-memory trainer writes from its state
     * directly (the trainer waits anyway); otherwise a host copy */
    int rc;
    if (!background && t->model->be->kind == MT_BE_CPU) {
        jc->cur = &jc->view;
        rc = mt_train_state_view(t, jc->cur);
    } else {
        jc->cur = &jc->snap;
        rc = mt_train_state_snapshot(t, jc->cur);
    }
    jc->copy_ms = mt_now_ms() - jc->t_start;
    if (rc == MT_OK) {
        jc->meta.step = jc->cur->step;
        jc->meta.consumed_samples = jc->cur->consumed_samples;
        jc->meta.consumed_tokens = jc->cur->consumed_tokens;
        jc->meta.config_json = strdup(jc->cur->config_json);
        jc->meta.job_json = strdup(jc->cur->job_json);
        jc->meta.state_json = strdup(jc->cur->state_json);
        jc->meta.layout = jc->map.layout;
        jc->meta.opts = jc->map.opts;
        if (!jc->meta.config_json || !jc->meta.job_json || !jc->meta.state_json)
            rc = MT_ERR(MT_ENOMEM, "checkpoint: out of memory");
    }
    /* rank 0 makes the partial directory; nobody writes before it exists */
    if (rc == MT_OK && jc->rank == 0) rc = mt_ckpt_begin(jc->root, jc->step, jc->partial, sizeof jc->partial);
    if (jc->world > 1) {
        int all_ok = mt_comm_agree(jc->comm, rc == MT_OK);
        if (rc == MT_OK && all_ok < 0) rc = all_ok;
        if (rc == MT_OK && all_ok == 0)
            rc = MT_ERR(MT_EIO, "checkpoint: another rank could not start the save");
        if (rc == MT_OK && jc->rank != 0) rc = mt_ckpt_step_path(jc->partial, sizeof jc->partial, jc->root, jc->step, 1);
    }
    double stall = mt_now_ms() - t0;
    pthread_mutex_lock(&jc->mu);
    jc->st.last_stall_ms = stall;
    jc->st.last_bytes = (int64_t)jc->cur->bytes;
    jc->st.in_flight = rc == MT_OK;
    pthread_mutex_unlock(&jc->mu);
    jc->busy = 1;
    if (rc < 0) {
        jc->rc = rc;
        snprintf(jc->err, sizeof jc->err, "%s", mt_errmsg());
        return finish(jc);
    }
    MT_CHECK(run_phase(jc, PHASE_SHARD, background));
    return background ? MT_OK : progress(jc, 1);
}

int mt_job_ckpt_after_step(mt_job_ckpt *jc, mt_trainer *t)
{
    if (!jc || !jc->have_map) return MT_OK;
    int rc = progress(jc, 0);
    if (rc < 0) mt_err_clear(); /* logged by finish(); training continues */
    const int64_t iv = jc->job.checkpoint.interval;
    if (iv <= 0 || t->step % iv != 0 || t->step == jc->st.last_step) return MT_OK;
    rc = start_save(jc, t, jc->async);
    if (rc < 0) mt_err_clear();
    return MT_OK;
}

int mt_job_ckpt_save_now(mt_job_ckpt *jc, mt_trainer *t)
{
    if (!jc || !jc->have_map)
        return MT_ERR(MT_ESTATE, "the job has no checkpoint.dir: nowhere to save");
    MT_CHECK(progress(jc, 1));
    if (t->step == jc->st.last_step) return MT_OK;
    return start_save(jc, t, 0);
}

int mt_job_ckpt_wait(mt_job_ckpt *jc) { return jc ? progress(jc, 1) : MT_OK; }

void mt_job_ckpt_stage_mem(mt_job_ckpt *jc, void **mem, size_t *bytes)
{
    const mt_train_snapshot *s = jc ? idle_snapshot(jc) : NULL;
    *mem = s ? s->slab : NULL;
    *bytes = s ? s->slab_bytes : 0;
}

void mt_job_ckpt_get_stats(mt_job_ckpt *jc, mt_job_ckpt_stats *s)
{
    pthread_mutex_lock(&jc->mu);
    *s = jc->st;
    pthread_mutex_unlock(&jc->mu);
}

void mt_job_ckpt_rewind(mt_job_ckpt *jc, int64_t step)
{
    pthread_mutex_lock(&jc->mu);
    jc->st.last_step = step;
    mt_ckpt_step_path(jc->st.last_path, sizeof jc->st.last_path, jc->root, step, 0);
    pthread_mutex_unlock(&jc->mu);
}

int mt_job_ckpt_close(mt_job_ckpt *jc)
{
    if (!jc) return MT_OK;
    int rc = progress(jc, 1);
    mt_train_snapshot_free(&jc->snap);
    mt_train_snapshot_free(&jc->view);
    if (jc->have_map) mt_shard_map_free(&jc->map);
    pthread_mutex_destroy(&jc->mu);
    free(jc);
    return rc;
}
