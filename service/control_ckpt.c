/* control_ckpt.c - see control_ckpt.h. The policy itself (when to save,
 * how, restore, retention) is runtime/job_checkpoint.c's; this file turns
 * its results into the service's records and runs the reshard in the
 * background. */
#define _POSIX_C_SOURCE 200809L
#include "service/control_ckpt.h"

#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "ckpt/ckpt.h"
#include "engine/parallel/sharding.h"
#include "base/mt_log.h"
#include "base/mt_status.h"
#include "runtime/job_checkpoint.h"
#include "service/svc_text.h"

struct ctl_ckpt {
    mt_job *job;          /* not owned */
    mt_job_ckpt *jc;      /* job->ckpt */
    mt_layout layout;   /* the job's, for the records */
    int64_t saves_seen;   /* committed saves already reported */
};

/* Bytes of the files directly in a checkpoint directory. */
static int64_t dir_bytes(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    int64_t sum = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char p[MT_PATH_CAP + 300];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (stat(p, &st) == 0 && S_ISREG(st.st_mode)) sum += st.st_size;
    }
    closedir(d);
    return sum;
}

static void describe(svc_ckpt *c, const char *path, int64_t step, const mt_layout *layout)
{
    memset(c, 0, sizeof *c);
    c->valid = 1;
    c->step = step;
    snprintf(c->path, sizeof c->path, "%s", path);
    const char *slash = strrchr(path, '/');
    snprintf(c->name, sizeof c->name, "%s", slash ? slash + 1 : path);
    if (layout) {
        c->layout = *layout;
        c->have_layout = 1;
    }
    c->bytes = dir_bytes(path);
}

int ctl_ckpt_open(ctl_ckpt **out, mt_job *job)
{
    *out = NULL;
    ctl_ckpt *ck = calloc(1, sizeof *ck);
    if (!ck) return MT_ERR(MT_ENOMEM, "checkpoints: out of memory");
    ck->job = job;
    ck->jc = job->ckpt;
    ck->layout = job->spec.parallel;
    mt_job_ckpt_stats st;
    mt_job_ckpt_get_stats(ck->jc, &st);
    ck->saves_seen = st.saves;
    *out = ck;
    return MT_OK;
}

void ctl_ckpt_close(ctl_ckpt *ck) { free(ck); }

void ctl_ckpt_newly_saved(ctl_ckpt *ck, svc_ckpt *saved)
{
    mt_job_ckpt_stats st;
    mt_job_ckpt_get_stats(ck->jc, &st);
    memset(saved, 0, sizeof *saved);
    if (st.saves > ck->saves_seen && st.last_step >= 0) {
        ck->saves_seen = st.saves;
        describe(saved, st.last_path, st.last_step, &ck->layout);
    }
}

int ctl_ckpt_save(ctl_ckpt *ck, svc_ckpt *saved)
{
    memset(saved, 0, sizeof *saved);
    if (!ck) return MT_ERR(MT_ESTATE, "no job");
    MT_CHECK(mt_job_save(ck->job));
    ctl_ckpt_newly_saved(ck, saved);
    if (!saved->valid) {
        /* This step was saved already (e.g. by the interval policy). */
        mt_job_ckpt_stats st;
        mt_job_ckpt_get_stats(ck->jc, &st);
        if (st.last_step >= 0) describe(saved, st.last_path, st.last_step, &ck->layout);
    }
    return MT_OK;
}

int ctl_ckpt_list(const char *dir, svc_ckpt **out, int *n)
{
    int64_t *steps;
    *out = NULL;
    *n = 0;
    MT_CHECK(mt_ckpt_list(dir, &steps, n));
    if (*n == 0) {
        free(steps);
        return MT_OK;
    }
    *out = calloc((size_t)*n, sizeof **out);
    if (!*out) {
        free(steps);
        *n = 0;
        return MT_ERR(MT_ENOMEM, "out of memory");
    }
    for (int i = 0; i < *n; i++) {
        char path[MT_PATH_CAP];
        mt_ckpt_step_path(path, sizeof path, dir, steps[i], 0);
        /* The layout is in each index; listing stays a directory scan so
         * that it never waits for a save holding the HDF5 lock. */
        describe(&(*out)[i], path, steps[i], NULL);
    }
    free(steps);
    return MT_OK;
}

int ctl_ckpt_find(const char *dir, const char *name, char *path, size_t cap)
{
    if (!strcmp(name, "latest")) {
        int rc = mt_ckpt_resolve(dir, path, cap);
        if (rc == MT_ENOTFOUND) return MT_ERR(MT_ENOTFOUND, "no checkpoint in %s", dir);
        return rc;
    }
    int n = snprintf(path, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return MT_ERR(MT_EINVAL, "%s: name too long", name);
    char idx[MT_PATH_CAP + 32];
    struct stat st;
    snprintf(idx, sizeof idx, "%s/index.h5", path);
    if (stat(idx, &st) != 0)
        return MT_ERR(MT_ENOTFOUND, "no checkpoint %s in %s (ListCheckpoints shows them)", name, dir);
    return MT_OK;
}

/* ---- the background reshard --------------------------------------------------------------- */

struct ctl_reshard {
    pthread_mutex_t mu;
    metrics_hub *hub;
    svc_reshard st;
    mt_progress prog;     /* written by the worker; read with atomic loads */
    char src[MT_PATH_CAP], dst[MT_PATH_CAP];
    uint64_t run_id;
    char job[SVC_NAME_CAP];
    pthread_t thread;
    int joinable;
};

int ctl_reshard_create(ctl_reshard **out, metrics_hub *hub)
{
    ctl_reshard *r = calloc(1, sizeof *r);
    if (!r) return MT_ERR(MT_ENOMEM, "reshard: out of memory");
    pthread_mutex_init(&r->mu, NULL);
    r->hub = hub;
    *out = r;
    return MT_OK;
}

void ctl_reshard_destroy(ctl_reshard *r)
{
    if (!r) return;
    if (r->joinable) pthread_join(r->thread, NULL);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

static double progress_of(const mt_progress *p)
{
    int64_t total = __atomic_load_n(&p->total, __ATOMIC_RELAXED);
    int64_t done = __atomic_load_n(&p->done, __ATOMIC_RELAXED);
    if (total <= 0) return 0;
    double f = (double)done / (double)total;
    return f > 1 ? 1 : f;
}

static void publish(ctl_reshard *r)
{
    if (!r->hub) return;
    hub_event *e = hub_event_new(r->run_id, r->job, HUB_RESHARD);
    if (!e) return;
    pthread_mutex_lock(&r->mu);
    e->u.reshard = r->st;
    pthread_mutex_unlock(&r->mu);
    hub_publish(r->hub, e);
    free(e);
}

typedef struct worker {
    ctl_reshard *r;
    mt_layout layout;
    int ticking;
} worker;

/* The target layout: request fields of 0 keep the source's. */
static int target_layout(const char *src, const mt_layout *req, mt_layout *out)
{
    mt_ckpt *ck;
    MT_CHECK(mt_ckpt_open(&ck, src));
    *out = mt_ckpt_get_meta(ck)->layout;
    mt_ckpt_close(ck);
    if (req->tp) out->tp = req->tp;
    if (req->pp) out->pp = req->pp;
    if (req->vpp) out->vpp = req->vpp;
    if (req->ep) out->ep = req->ep;
    if (req->etp) out->etp = req->etp;
    if (req->dp) out->dp = req->dp;
    return MT_OK;
}

/* Publishes progress while the worker runs (the ckpt library reports it
 * only through the mt_progress counters). */
static void *ticker(void *arg)
{
    worker *w = arg;
    ctl_reshard *r = w->r;
    double last = -1;
    while (__atomic_load_n(&w->ticking, __ATOMIC_ACQUIRE)) {
        struct timespec ts = {0, 200 * 1000 * 1000L};
        nanosleep(&ts, NULL);
        double p = progress_of(&r->prog);
        if (p - last >= 0.05) {
            last = p;
            pthread_mutex_lock(&r->mu);
            r->st.progress = p;
            snprintf(r->st.message, sizeof r->st.message, "writing %.0f%%", 100 * p);
            pthread_mutex_unlock(&r->mu);
            publish(r);
        }
    }
    return NULL;
}

static void *reshard_main(void *arg)
{
    worker *w = arg;
    ctl_reshard *r = w->r;
    char msg[SVC_MSG_CAP];
    mt_layout req;
    pthread_mutex_lock(&r->mu);
    req = r->st.layout;
    pthread_mutex_unlock(&r->mu);
    int rc = target_layout(r->src, &req, &w->layout);
    if (rc == MT_OK) {
        pthread_mutex_lock(&r->mu);
        mt_layout *l = &r->st.layout;
        *l = w->layout;
        /* checkpoints record DualPipeV only; other chunked layouts interleave */
        if (l->schedule == MT_PP_1F1B && l->vpp > 1) l->schedule = MT_PP_INTERLEAVED;
        pthread_mutex_unlock(&r->mu);
        pthread_t tk;
        __atomic_store_n(&w->ticking, 1, __ATOMIC_RELEASE);
        int have_ticker = pthread_create(&tk, NULL, ticker, w) == 0;
        rc = mt_ckpt_reshard(r->src, r->dst, &w->layout, 0, &r->prog);
        __atomic_store_n(&w->ticking, 0, __ATOMIC_RELEASE);
        if (have_ticker) pthread_join(tk, NULL);
    }
    if (rc < 0) svc_strip_locations(mt_errmsg(), msg, sizeof msg);
    pthread_mutex_lock(&r->mu);
    r->st.active = 0;
    r->st.done = rc == MT_OK;
    r->st.failed = rc < 0;
    if (rc == MT_OK) {
        r->st.progress = 1;
        char lay[128];
        mt_layout_format(&w->layout, lay, sizeof lay);
        snprintf(r->st.message, sizeof r->st.message, "wrote %s (%s)", r->dst, lay);
    } else {
        snprintf(r->st.message, sizeof r->st.message, "%s", msg);
    }
    pthread_mutex_unlock(&r->mu);
    if (rc < 0) MT_LOGE("reshard %s -> %s failed: %s", r->src, r->dst, mt_errmsg());
    else MT_LOGI("reshard %s -> %s done", r->src, r->dst);
    publish(r);
    free(w);
    return NULL;
}

int ctl_reshard_start(ctl_reshard *r, const char *src, const char *dst, const char *src_name,
                      const char *dst_name, const mt_layout *layout, uint64_t run_id,
                      const char *job)
{
    char busy_src[SVC_NAME_CAP], busy_dst[SVC_NAME_CAP];
    pthread_mutex_lock(&r->mu);
    int busy = r->st.active;
    snprintf(busy_src, sizeof busy_src, "%s", r->st.source);
    snprintf(busy_dst, sizeof busy_dst, "%s", r->st.target);
    pthread_mutex_unlock(&r->mu);
    if (busy)
        return MT_ERR(MT_ESTATE, "a reshard (%s -> %s) is running; one at a time", busy_src,
                      busy_dst);
    struct stat st;
    if (stat(dst, &st) == 0)
        return MT_ERR(MT_EINVAL, "target: %s exists already; choose a new name", dst);
    if (r->joinable) {
        pthread_join(r->thread, NULL);
        r->joinable = 0;
    }
    worker *w = calloc(1, sizeof *w);
    if (!w) return MT_ERR(MT_ENOMEM, "reshard: out of memory");
    w->r = r;
    pthread_mutex_lock(&r->mu);
    memset(&r->st, 0, sizeof r->st);
    r->st.active = 1;
    snprintf(r->st.source, sizeof r->st.source, "%s", src_name);
    snprintf(r->st.target, sizeof r->st.target, "%s", dst_name);
    r->st.layout = *layout;
    snprintf(r->st.message, sizeof r->st.message, "starting");
    snprintf(r->src, sizeof r->src, "%s", src);
    snprintf(r->dst, sizeof r->dst, "%s", dst);
    r->run_id = run_id;
    snprintf(r->job, sizeof r->job, "%s", job);
    memset(&r->prog, 0, sizeof r->prog);
    pthread_mutex_unlock(&r->mu);
    publish(r);
    if (pthread_create(&r->thread, NULL, reshard_main, w) != 0) {
        free(w);
        pthread_mutex_lock(&r->mu);
        r->st.active = 0;
        r->st.failed = 1;
        pthread_mutex_unlock(&r->mu);
        return MT_ERR(MT_EGENERIC, "reshard: cannot start its thread");
    }
    r->joinable = 1;
    return MT_OK;
}

void ctl_reshard_get(ctl_reshard *r, svc_reshard *out)
{
    pthread_mutex_lock(&r->mu);
    *out = r->st;
    pthread_mutex_unlock(&r->mu);
    if (out->active) out->progress = progress_of(&r->prog);
}
