/* control_ckpt.c - see control_ckpt.h. The policy itself (when to save,
 * how, restore, retention) is runtime/job_checkpoint.c's; this file turns
 * its results into the service's records and runs the reshard in the
 * background. */
#define _GNU_SOURCE
#include "service/control_ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/ckpt.h"
#include "engine/parallel/sharding.h"
#include "base/mt_log.h"
#include "base/mt_status.h"
#include "runtime/job_checkpoint.h"
#include "service/svc_text.h"
#include "service/workdir.h"

/* A directory confined to the workdir and held open for as long as it is
 * used (service/workdir.h): `via` names it for the checkpoint library,
 * `shown` is its canonical path for records and messages. */
typedef struct pinned {
    int fd;                    /* -1: not pinned (no workdir: the foreground mode) */
    char via[64];
    char shown[MT_PATH_CAP];
} pinned;

static void pin_none(pinned *p, const char *path)
{
    p->fd = -1;
    snprintf(p->shown, sizeof p->shown, "%s", path);
    snprintf(p->via, sizeof p->via, "%s", "");
}

/* The path to hand to the library: the pinned one, or the plain path. */
static const char *use_path(const pinned *p) { return p->via[0] ? p->via : p->shown; }

static void unpin_path(const pinned *p, const char *in, char *out, size_t cap)
{
    if (p->via[0]) wd_unpin(in, p->via, p->shown, out, cap);
    else snprintf(out, cap, "%s", in);
}

/* text with every pinned name in it said as its canonical path. */
static void unpin_text(const char *text, const pinned *a, const pinned *b, char *out, size_t cap)
{
    char m1[2048], m2[2048];
    snprintf(m1, sizeof m1, "%s", text);
    for (const pinned *p = a; p; p = p == a ? b : NULL) {
        if (!p->via[0]) continue;
        /* every occurrence, not only a leading one; "/proc/self/fd/3" is
         * not a match inside "/proc/self/fd/31" */
        size_t o = 0, n = strlen(p->via);
        const char *s = m1, *hit;
        m2[0] = '\0';
        while ((hit = strstr(s, p->via)) && o < sizeof m2) {
            int whole = hit[n] < '0' || hit[n] > '9';
            o += (size_t)snprintf(m2 + o, sizeof m2 - o, "%.*s%s", (int)(hit - s), s,
                                  whole ? p->shown : p->via);
            s = hit + n;
        }
        if (o < sizeof m2) snprintf(m2 + o, sizeof m2 - o, "%s", s);
        snprintf(m1, sizeof m1, "%s", m2);
    }
    snprintf(out, cap, "%s", m1);
}

/* The last error with every pinned name said as its canonical path. */
static int unpin_err(int rc, const pinned *a, const pinned *b)
{
    if (rc >= 0 || (!a->via[0] && (!b || !b->via[0]))) return rc;
    char m[2048];
    unpin_text(mt_errmsg(), a, b, m, sizeof m);
    mt_err_clear();
    return mt_err_at(rc, __FILE__, __LINE__, "%s", m);
}

static int pin(pinned *p, const char *root, const char *path, const char *field, int flags)
{
    MT_CHECK(wd_confine(root, path, field, flags, p->shown, sizeof p->shown, &p->fd));
    wd_fd_path(p->fd, p->shown, p->via, sizeof p->via);
    return MT_OK;
}

static void unpin(pinned *p)
{
    if (p->fd >= 0) close(p->fd);
    p->fd = -1;
}

/* The newest committed step directory in the pinned root dir, its name into
 * name; MT_ENOTFOUND if there is none. */
static int newest_step(const pinned *dir, char *name, size_t cap)
{
    int64_t *steps;
    int n;
    int rc = mt_ckpt_list(use_path(dir), &steps, &n);
    if (rc < 0) return unpin_err(rc, dir, NULL);
    int64_t s = n ? steps[n - 1] : -1;
    free(steps);
    if (s < 0) return MT_ERR(MT_ENOTFOUND, "no checkpoint in %s", dir->shown);
    snprintf(name, cap, "step_%08lld", (long long)s);
    return MT_OK;
}

/* Confines and pins checkpoint `path` (a step directory, or with
 * newest_of_root a root whose newest committed step is taken): inside the
 * workdir, with an index, and no symbolic link among its files. */
static int pin_step(pinned *p, const char *root, const char *path, const char *field,
                    int newest_of_root)
{
    MT_CHECK(pin(p, root, path, field, 0));
    struct stat st;
    if (fstatat(p->fd, "index.h5", &st, AT_SYMLINK_NOFOLLOW) != 0 && newest_of_root) {
        char name[64], step[MT_PATH_CAP + 64];
        int rc = newest_step(p, name, sizeof name);
        snprintf(step, sizeof step, "%s/%s", p->shown, name);
        unpin(p);
        MT_CHECK(rc);
        MT_CHECK(pin(p, root, step, field, 0));
    }
    int rc = MT_OK;
    if (fstatat(p->fd, "index.h5", &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode))
        rc = MT_ERR(MT_ENOTFOUND, "%s: %s is not a committed checkpoint (no index.h5)", field,
                    p->shown);
    if (rc == MT_OK) rc = wd_no_links_in(p->fd, p->shown, field);
    if (rc < 0) unpin(p);
    return rc;
}

struct ctl_ckpt {
    mt_job *job;          /* not owned; NULL until attached */
    mt_job_ckpt *jc;      /* job->ckpt */
    mt_layout layout;     /* the job's, for the records */
    int64_t saves_seen;   /* committed saves already reported */
    pinned dir;           /* checkpoint.dir, held for the job's life */
    pinned init;          /* init.path of a checkpoint start, held until the job has started */
};

/* Bytes of the regular files directly in a checkpoint directory (links
 * are not followed: their size is not ours to report). */
static int64_t dir_bytes(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    int64_t sum = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        struct stat st;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
            sum += st.st_size;
    }
    closedir(d);
    return sum;
}

/* A record of checkpoint `shown` (its canonical path), sizes read through
 * `read` (the same directory, perhaps by its pinned name). */
static void describe(svc_ckpt *c, const char *shown, const char *read, int64_t step,
                     const mt_layout *layout)
{
    memset(c, 0, sizeof *c);
    c->valid = 1;
    c->step = step;
    snprintf(c->path, sizeof c->path, "%s", shown);
    const char *slash = strrchr(shown, '/');
    snprintf(c->name, sizeof c->name, "%s", slash ? slash + 1 : shown);
    if (layout) {
        c->layout = *layout;
        c->have_layout = 1;
    }
    c->bytes = dir_bytes(read);
}

/* A record of a step the job's policy saved: its path as the policy knows
 * it (the held folder's name) said as the canonical one. */
static void describe_saved(ctl_ckpt *ck, svc_ckpt *c, const char *path, int64_t step)
{
    char shown[MT_PATH_CAP];
    unpin_path(&ck->dir, path, shown, sizeof shown);
    describe(c, shown, path, step, &ck->layout);
}

int ctl_ckpt_open(ctl_ckpt **out, const char *root, const mt_jobspec *spec, mt_jobspec *use)
{
    *out = NULL;
    *use = *spec;
    ctl_ckpt *ck = calloc(1, sizeof *ck);
    if (!ck) return MT_ERR(MT_ENOMEM, "checkpoints: out of memory");
    pin_none(&ck->dir, spec->checkpoint.dir);
    pin_none(&ck->init, spec->init.path);
    *out = ck;
    if (!root) return MT_OK;
    /* The job's folders confined again now, and held: the policy saves
     * through the held folder, so renaming it or replacing it by a link
     * later cannot make a save write outside (issue 21, defect 3). */
    if (spec->checkpoint.dir[0]) {
        MT_CHECK(pin(&ck->dir, root, spec->checkpoint.dir, "checkpoint.dir", WD_MKDIRS));
        snprintf(use->checkpoint.dir, sizeof use->checkpoint.dir, "%s", ck->dir.via);
        if (strcmp(ck->dir.via, ck->dir.shown))
            MT_LOGI("checkpoint.dir %s: held open as %s while the job runs", ck->dir.shown,
                    ck->dir.via);
    }
    if (spec->init.kind == MT_INIT_CHECKPOINT) {
        MT_CHECK(pin_step(&ck->init, root, spec->init.path, "init.path", 1));
        snprintf(use->init.path, sizeof use->init.path, "%s", ck->init.via);
        if (strcmp(ck->init.via, ck->init.shown))
            MT_LOGI("init.path %s: read as %s", ck->init.shown, ck->init.via);
    }
    return MT_OK;
}

int ctl_ckpt_said(const ctl_ckpt *ck, int rc)
{
    return ck ? unpin_err(rc, &ck->dir, &ck->init) : rc;
}

void ctl_ckpt_say(const ctl_ckpt *ck, const char *text, char *out, size_t cap)
{
    if (ck) unpin_text(text, &ck->dir, &ck->init, out, cap);
    else snprintf(out, cap, "%s", text);
}

int ctl_ckpt_attach(ctl_ckpt *ck, mt_job *job)
{
    ck->job = job;
    ck->jc = job->ckpt;
    ck->layout = job->spec.parallel;
    mt_job_ckpt_stats st;
    mt_job_ckpt_get_stats(ck->jc, &st);
    ck->saves_seen = st.saves;
    unpin(&ck->init); /* restored: no longer read */
    return MT_OK;
}

void ctl_ckpt_close(ctl_ckpt *ck)
{
    if (!ck) return;
    unpin(&ck->dir);
    unpin(&ck->init);
    free(ck);
}

void ctl_ckpt_newly_saved(ctl_ckpt *ck, svc_ckpt *saved)
{
    memset(saved, 0, sizeof *saved);
    if (!ck || !ck->jc) return;
    mt_job_ckpt_stats st;
    mt_job_ckpt_get_stats(ck->jc, &st);
    if (st.saves > ck->saves_seen && st.last_step >= 0) {
        ck->saves_seen = st.saves;
        describe_saved(ck, saved, st.last_path, st.last_step);
        saved->write_ms = st.last_write_ms;
        saved->stall_ms = st.last_stall_ms;
    }
}

double ctl_ckpt_save_estimate_s(ctl_ckpt *ck)
{
    if (!ck || !ck->jc) return -1;
    mt_job_ckpt_stats st;
    mt_job_ckpt_get_stats(ck->jc, &st);
    return st.saves > 0 ? (st.last_stall_ms + st.last_write_ms) * 1e-3 : -1;
}

int ctl_ckpt_finish(ctl_ckpt *ck, svc_ckpt *saved)
{
    memset(saved, 0, sizeof *saved);
    if (!ck || !ck->jc) return MT_OK;
    int rc = ctl_ckpt_said(ck, mt_job_ckpt_wait(ck->jc));
    ctl_ckpt_newly_saved(ck, saved);
    return rc;
}

int ctl_ckpt_save(ctl_ckpt *ck, svc_ckpt *earlier, svc_ckpt *saved)
{
    memset(saved, 0, sizeof *saved);
    memset(earlier, 0, sizeof *earlier);
    if (!ck || !ck->job) return MT_ERR(MT_ESTATE, "no job");
    /* the save in flight ends first: reported, not lost behind this one */
    MT_CHECK(ctl_ckpt_finish(ck, earlier));
    MT_CHECK(ctl_ckpt_said(ck, mt_job_save(ck->job)));
    ctl_ckpt_newly_saved(ck, saved);
    if (!saved->valid) {
        /* This step was saved already (e.g. by the interval policy). */
        mt_job_ckpt_stats st;
        mt_job_ckpt_get_stats(ck->jc, &st);
        if (st.last_step >= 0) describe_saved(ck, saved, st.last_path, st.last_step);
    }
    return MT_OK;
}

int ctl_ckpt_list(const char *root, const char *dir, svc_ckpt **out, int *n)
{
    *out = NULL;
    *n = 0;
    pinned d;
    pin_none(&d, dir);
    if (root) {
        MT_CHECK(pin(&d, root, dir, "job", WD_MISSING_OK));
        if (d.fd < 0) return MT_OK; /* no checkpoint saved yet */
    }
    int64_t *steps;
    int rc = unpin_err(mt_ckpt_list(use_path(&d), &steps, n), &d, NULL);
    if (rc < 0 || *n == 0) {
        free(steps);
        *n = 0;
        unpin(&d);
        return rc;
    }
    *out = calloc((size_t)*n, sizeof **out);
    if (!*out) {
        free(steps);
        *n = 0;
        unpin(&d);
        return MT_ERR(MT_ENOMEM, "out of memory");
    }
    int k = 0;
    for (int i = 0; i < *n; i++) {
        char shown[MT_PATH_CAP + 32];
        mt_ckpt_step_path(shown, sizeof shown, d.shown, steps[i], 0);
        pinned sp;
        pin_none(&sp, shown);
        /* A step that is a link leading out is not ours to show. */
        if (root && pin(&sp, root, shown, "job", 0) < 0) {
            MT_LOGW("ListCheckpoints: leaving out %s", mt_errmsg());
            continue;
        }
        /* The layout is in each index; listing stays a directory scan so
         * that it never waits for a save holding the HDF5 lock. */
        describe(&(*out)[k++], shown, use_path(&sp), steps[i], NULL);
        unpin(&sp);
    }
    *n = k;
    free(steps);
    unpin(&d);
    return MT_OK;
}

int ctl_ckpt_find(const char *root, const char *dir, const char *name, char *path, size_t cap)
{
    if (!root) {
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
            return MT_ERR(MT_ENOTFOUND, "no checkpoint %s in %s (ListCheckpoints shows them)",
                          name, dir);
        return MT_OK;
    }
    pinned d, sp;
    int rc = pin(&d, root, dir, "checkpoint", WD_MISSING_OK);
    if (rc < 0) return rc;
    if (d.fd < 0) return MT_ERR(MT_ENOTFOUND, "no checkpoint in %s", d.shown);
    char step[64], want[MT_PATH_CAP + 64];
    if (!strcmp(name, "latest")) rc = newest_step(&d, step, sizeof step);
    else snprintf(step, sizeof step, "%s", name);
    snprintf(want, sizeof want, "%s/%s", d.shown, step);
    unpin(&d);
    MT_CHECK(rc);
    rc = pin_step(&sp, root, want, "checkpoint", 0);
    if (rc == MT_ENOTFOUND)
        return MT_ERR(MT_ENOTFOUND, "no checkpoint %s in %s (ListCheckpoints shows them)", name,
                      dir);
    MT_CHECK(rc);
    if (strlen(sp.shown) + 1 > cap) rc = MT_ERR(MT_EINVAL, "%s: path too long", sp.shown);
    else snprintf(path, cap, "%s", sp.shown);
    unpin(&sp);
    return rc;
}

/* ---- the background reshard --------------------------------------------------------------- */

struct ctl_reshard {
    pthread_mutex_t mu;
    metrics_hub *hub;
    svc_reshard st;
    mt_progress prog;     /* written by the worker; read with atomic loads */
    pinned src, dst;      /* held by the worker until it ends */
    int parent_fd;        /* the target's folder: an empty target is removed on failure */
    char dst_name[SVC_NAME_CAP];
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
    int rc = target_layout(use_path(&r->src), &req, &w->layout);
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
        rc = mt_ckpt_reshard(use_path(&r->src), use_path(&r->dst), &w->layout, 0, &r->prog);
        __atomic_store_n(&w->ticking, 0, __ATOMIC_RELEASE);
        if (have_ticker) pthread_join(tk, NULL);
    }
    rc = unpin_err(rc, &r->src, &r->dst);
    if (rc < 0) svc_strip_locations(mt_errmsg(), msg, sizeof msg);
    pthread_mutex_lock(&r->mu);
    r->st.active = 0;
    r->st.done = rc == MT_OK;
    r->st.failed = rc < 0;
    if (rc == MT_OK) {
        r->st.progress = 1;
        char lay[128];
        mt_layout_format(&w->layout, lay, sizeof lay);
        snprintf(r->st.message, sizeof r->st.message, "wrote %s (%s)", r->dst.shown, lay);
    } else {
        snprintf(r->st.message, sizeof r->st.message, "%s", msg);
    }
    pthread_mutex_unlock(&r->mu);
    if (rc < 0) MT_LOGE("reshard %s -> %s failed: %s", r->src.shown, r->dst.shown, mt_errmsg());
    else MT_LOGI("reshard %s -> %s done", r->src.shown, r->dst.shown);
    unpin(&r->src);
    unpin(&r->dst);
    if (r->parent_fd >= 0) {
        /* a target that failed before its first file leaves no empty folder
         * behind (rmdir: a folder with anything in it stays) */
        if (rc < 0) unlinkat(r->parent_fd, r->dst_name, AT_REMOVEDIR);
        close(r->parent_fd);
        r->parent_fd = -1;
    }
    publish(r);
    free(w);
    return NULL;
}

/* The reshard's source and target, confined (root != NULL) and held:
 * the source must be a committed checkpoint with no link among its files,
 * the target a new folder, made here so that nothing else can be put in
 * its place before the writer starts. */
static int pin_reshard(ctl_reshard *r, const char *root, const char *src, const char *dst)
{
    pin_none(&r->src, src);
    pin_none(&r->dst, dst);
    r->parent_fd = -1;
    const char *slash = strrchr(dst, '/');
    snprintf(r->dst_name, sizeof r->dst_name, "%s", slash ? slash + 1 : dst);
    if (!root) {
        struct stat st;
        if (stat(dst, &st) == 0)
            return MT_ERR(MT_EINVAL, "target: %s exists already; choose a new name", dst);
        return MT_OK;
    }
    MT_CHECK(pin_step(&r->src, root, src, "source", 0));
    char parent[MT_PATH_CAP];
    snprintf(parent, sizeof parent, "%.*s", slash ? (int)(slash - dst) : 0, dst);
    pinned par;
    int rc = pin(&par, root, parent[0] ? parent : ".", "target", WD_MKDIRS);
    if (rc == MT_OK) {
        struct stat st;
        snprintf(r->dst.shown, sizeof r->dst.shown, "%s/%s", par.shown, r->dst_name);
        int exists = fstatat(par.fd, r->dst_name, &st, AT_SYMLINK_NOFOLLOW) == 0;
        if (!exists && mkdirat(par.fd, r->dst_name, 0755) != 0) {
            exists = errno == EEXIST;
            if (!exists)
                rc = MT_ERR(MT_EIO, "target: cannot create %s: %s", r->dst.shown, strerror(errno));
        }
        if (exists)
            rc = MT_ERR(MT_EINVAL, "target: %s exists already; choose a new name", r->dst.shown);
    }
    if (rc == MT_OK) {
        r->dst.fd = openat(par.fd, r->dst_name, O_PATH | O_NOFOLLOW | O_DIRECTORY | O_CLOEXEC);
        if (r->dst.fd < 0) {
            rc = MT_ERR(MT_EIO, "target: %s: %s", r->dst.shown, strerror(errno));
        } else {
            wd_fd_path(r->dst.fd, r->dst.shown, r->dst.via, sizeof r->dst.via);
            r->parent_fd = par.fd;
            par.fd = -1;
        }
    }
    unpin(&par);
    if (rc < 0) unpin(&r->src);
    return rc;
}

int ctl_reshard_start(ctl_reshard *r, const char *root, const char *src, const char *dst,
                      const char *src_name, const char *dst_name, const mt_layout *layout,
                      uint64_t run_id, const char *job)
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
    if (r->joinable) {
        pthread_join(r->thread, NULL);
        r->joinable = 0;
    }
    worker *w = calloc(1, sizeof *w);
    if (!w) return MT_ERR(MT_ENOMEM, "reshard: out of memory");
    int rc = pin_reshard(r, root, src, dst);
    if (rc < 0) {
        free(w);
        return rc;
    }
    w->r = r;
    pthread_mutex_lock(&r->mu);
    memset(&r->st, 0, sizeof r->st);
    r->st.active = 1;
    snprintf(r->st.source, sizeof r->st.source, "%s", src_name);
    snprintf(r->st.target, sizeof r->st.target, "%s", dst_name);
    r->st.layout = *layout;
    snprintf(r->st.message, sizeof r->st.message, "starting");
    r->run_id = run_id;
    snprintf(r->job, sizeof r->job, "%s", job);
    memset(&r->prog, 0, sizeof r->prog);
    pthread_mutex_unlock(&r->mu);
    publish(r);
    if (pthread_create(&r->thread, NULL, reshard_main, w) != 0) {
        free(w);
        unpin(&r->src);
        unpin(&r->dst);
        if (r->parent_fd >= 0) {
            unlinkat(r->parent_fd, r->dst_name, AT_REMOVEDIR);
            close(r->parent_fd);
            r->parent_fd = -1;
        }
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

/* ---- reading saves back (rank 0) ---------------------------------------------------------- */

#define VERIFY_QUEUE 8

struct ctl_verifier {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    board *board;
    char root[MT_PATH_CAP];    /* the workdir: what is read back is confined to it */
    int64_t max_bytes;
    char queue[VERIFY_QUEUE][MT_PATH_CAP]; /* a ring of paths */
    int head, n;
    int quit;
    pthread_t thread;
    int joinable;
};

static void *verify_main(void *arg)
{
    ctl_verifier *v = arg;
    char path[MT_PATH_CAP], result[SVC_VERIFY_CAP], msg[SVC_MSG_CAP];
    pthread_mutex_lock(&v->mu);
    for (;;) {
        while (!v->n && !v->quit) pthread_cond_wait(&v->cv, &v->mu);
        if (v->quit) break;
        snprintf(path, sizeof path, "%s", v->queue[v->head]);
        v->head = (v->head + 1) % VERIFY_QUEUE;
        v->n--;
        pthread_mutex_unlock(&v->mu);
        /* read through the confined, held folder (like every other read of
         * the service), whatever happened to the path since the save */
        pinned p;
        int rc = pin_step(&p, v->root, path, "checkpoint", 0);
        if (rc == MT_OK) {
            rc = unpin_err(mt_ckpt_verify(use_path(&p), NULL, NULL, NULL), &p, NULL);
            unpin(&p);
        }
        if (rc == MT_OK) {
            snprintf(result, sizeof result, "ok");
        } else {
            svc_strip_locations(mt_errmsg(), msg, sizeof msg);
            snprintf(result, sizeof result, "failed: %s", msg);
            MT_LOGE("checkpoint %s does not verify: %s", path, msg);
            mt_err_clear();
        }
        board_set_verify(v->board, path, result);
        pthread_mutex_lock(&v->mu);
    }
    pthread_mutex_unlock(&v->mu);
    return NULL;
}

int ctl_verifier_create(ctl_verifier **out, board *b, const char *root, int64_t max_bytes)
{
    *out = NULL;
    ctl_verifier *v = calloc(1, sizeof *v);
    if (!v) return MT_ERR(MT_ENOMEM, "verifier: out of memory");
    snprintf(v->root, sizeof v->root, "%s", root);
    pthread_mutex_init(&v->mu, NULL);
    pthread_cond_init(&v->cv, NULL);
    v->board = b;
    v->max_bytes = max_bytes;
    if (pthread_create(&v->thread, NULL, verify_main, v) != 0) {
        ctl_verifier_destroy(v);
        return MT_ERR(MT_EGENERIC, "verifier: cannot start its thread");
    }
    v->joinable = 1;
    *out = v;
    return MT_OK;
}

void ctl_verifier_destroy(ctl_verifier *v)
{
    if (!v) return;
    pthread_mutex_lock(&v->mu);
    v->quit = 1;
    pthread_cond_signal(&v->cv);
    pthread_mutex_unlock(&v->mu);
    if (v->joinable) pthread_join(v->thread, NULL);
    pthread_mutex_destroy(&v->mu);
    pthread_cond_destroy(&v->cv);
    free(v);
}

void ctl_verifier_submit(ctl_verifier *v, svc_ckpt *c)
{
    if (!c->valid) return;
    if (c->bytes > v->max_bytes) {
        snprintf(c->verify, sizeof c->verify,
                 "skipped: %.1f MB is more than the %.0f MB read back while training "
                 "(moetrain-ckpt verify checks it)",
                 (double)c->bytes / 1e6, (double)v->max_bytes / 1e6);
        board_note_save(v->board, c);
        return;
    }
    snprintf(c->verify, sizeof c->verify, "running");
    board_note_save(v->board, c); /* before the result can come */
    char dropped[MT_PATH_CAP] = "";
    pthread_mutex_lock(&v->mu);
    if (v->n == VERIFY_QUEUE) { /* saves come faster than they read back */
        snprintf(dropped, sizeof dropped, "%s", v->queue[v->head]);
        v->head = (v->head + 1) % VERIFY_QUEUE;
        v->n--;
    }
    snprintf(v->queue[(v->head + v->n) % VERIFY_QUEUE], MT_PATH_CAP, "%s", c->path);
    v->n++;
    pthread_cond_signal(&v->cv);
    pthread_mutex_unlock(&v->mu);
    if (dropped[0])
        board_set_verify(v->board, dropped, "skipped: newer saves came before it was read back");
}
