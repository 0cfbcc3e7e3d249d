/* control.c - see control.h.
 *
 * Threads: the engine loop runs on the main thread of every rank and owns
 * the trainer. On rank 0 the service threads only touch the command queue,
 * the tickets and the status snapshot, all under `mu`. The engine publishes
 * the snapshot after every step and command, so a status request never
 * waits for a step.
 */
#define _POSIX_C_SOURCE 200809L
#include "service/control.h"

#include <errno.h>
#include <stdarg.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/train/trainer.h"
#include "runtime/runtime.h"
#include "base/mt_log.h"
#include "base/mt_status.h"
#include "kernels/ops.h"
#include "service/board.h"
#include "service/control_ckpt.h"
#include "service/control_term.h"
#include "service/preempt.h"
#include "service/watchdog.h"
#include "service/svc_text.h"

/* A ticket is guarded by its control's mutex, the one lock both the
 * engine and the service threads hold anyway. */
struct ctl_ticket {
    control *c;
    int done, dropped;
    ctl_result res;
};

typedef struct pending {
    ctl_kind kind;
    int save;
    char name[SVC_NAME_CAP];
    mt_jobspec *spec;           /* CTL_START: the admitted job */
    ctl_ticket *t;              /* NULL: internal (signal, foreground start) */
    struct pending *next;
} pending;

/* The record shared per command at a step boundary; CTL_NONE ends the
 * boundary's list. A start is followed by the admitted job spec itself (a
 * plain struct: every rank runs the same binary), so no rank parses it
 * again. */
typedef struct wire_cmd {
    int32_t kind;
    int32_t save;
    uint64_t run_id;
    int64_t spec_len;           /* sizeof(mt_jobspec) for a start, else 0 */
    char name[SVC_NAME_CAP];
} wire_cmd;

struct control {
    control_opts o;
    char workdir[MT_PATH_CAP];
    char jsonl[MT_PATH_CAP];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pending *head, *tail;
    svc_state projected;        /* the state once the queue is applied */
    int outstanding;            /* commands queued or being applied */
    int shutting_down;
    control_status st;
    uint64_t run_seq;
    /* engine thread only */
    svc_state state;
    mt_jobspec job;
    mt_job *run;                /* the resident job (runtime/) */
    mt_trainer *t;              /* run->trainer */
    ctl_ckpt *ck;
    uint64_t run_id;
    int quit, term_seen, ran_job;
    int term_unsaved;           /* SIGTERM ended the job without its checkpoint */
    int final_rc;
    char final_msg[SVC_MSG_CAP];
    ctl_reshard *reshard;       /* rank 0 with a workdir */
    board *board;               /* rank 0: the latest per-rank and per-expert values */
    ctl_verifier *verifier;     /* rank 0 with a workdir: reads saves back */
};

/* Saves up to this size are read back (verified) while training goes on. */
#define CTL_VERIFY_MAX_BYTES (512LL << 20)

/* ---- creation ----------------------------------------------------------------------- */

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int control_create(control **out, const control_opts *o)
{
    *out = NULL;
    control *c = calloc(1, sizeof *c);
    if (!c) return MT_ERR(MT_ENOMEM, "control: out of memory");
    c->o = *o;
    if (o->workdir) snprintf(c->workdir, sizeof c->workdir, "%s", o->workdir);
    if (o->jsonl) snprintf(c->jsonl, sizeof c->jsonl, "%s", o->jsonl);
    c->o.workdir = o->workdir ? c->workdir : NULL;
    c->o.jsonl = o->jsonl ? c->jsonl : NULL;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->state = c->projected = c->st.state = SVC_IDLE;
    c->st.ranks = o->world;
    c->st.started_unix = wall_now();
    c->st.last_valid_loss = NAN;
    if (o->rank == 0 && o->workdir) {
        int rc = ctl_reshard_create(&c->reshard, o->hub);
        if (rc < 0) {
            control_destroy(c);
            return rc;
        }
    }
    if (o->rank == 0) {
        int rc = board_create(&c->board, o->world);
        if (rc == MT_OK && o->workdir)
            rc = ctl_verifier_create(&c->verifier, c->board, c->workdir, CTL_VERIFY_MAX_BYTES);
        if (rc < 0) {
            control_destroy(c);
            return rc;
        }
    }
    *out = c;
    return MT_OK;
}

static void free_pending(pending *p)
{
    while (p) {
        pending *n = p->next;
        free(p->spec);
        free(p);
        p = n;
    }
}

void control_destroy(control *c)
{
    if (!c) return;
    ctl_reshard_destroy(c->reshard);
    ctl_verifier_destroy(c->verifier);
    board_destroy(c->board);
    free_pending(c->head);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}

/* ---- tickets ---------------------------------------------------------------------------- */

/* Under mu. */
static void ticket_complete(ctl_ticket *t, const ctl_result *r)
{
    if (!t) return;
    if (t->dropped) {
        free(t);
        return;
    }
    t->res = *r;
    t->done = 1;
}

int control_ticket_poll(ctl_ticket *t, ctl_result *out)
{
    pthread_mutex_lock(&t->c->mu);
    int done = t->done;
    if (done) *out = t->res;
    pthread_mutex_unlock(&t->c->mu);
    if (done) free(t);
    return done;
}

void control_ticket_drop(ctl_ticket *t)
{
    pthread_mutex_lock(&t->c->mu);
    int done = t->done;
    t->dropped = 1;
    pthread_mutex_unlock(&t->c->mu);
    if (done) free(t);
}

static void result_error(ctl_result *r, int rc, const char *msg)
{
    memset(r, 0, sizeof *r);
    r->rc = rc;
    snprintf(r->msg, sizeof r->msg, "%s", msg);
}

/* ---- queueing (rank 0, service threads) -------------------------------------------------- */

static const char *kind_verb(ctl_kind k)
{
    switch (k) {
    case CTL_START: return "start a job";
    case CTL_PAUSE: return "pause";
    case CTL_RESUME: return "resume";
    case CTL_STOP: return "stop";
    case CTL_SAVE: return "save a checkpoint";
    case CTL_SHUTDOWN: return "shut down";
    default: return "?";
    }
}

/* Is `k` legal in state s? Returns the state it leads to, or 0. */
static svc_state transition(svc_state s, ctl_kind k)
{
    switch (k) {
    case CTL_START: return s == SVC_IDLE || s == SVC_FAILED ? SVC_RUNNING : 0;
    case CTL_PAUSE: return s == SVC_RUNNING ? SVC_PAUSED : 0;
    case CTL_RESUME: return s == SVC_PAUSED ? SVC_RUNNING : 0;
    case CTL_STOP: return s == SVC_RUNNING || s == SVC_PAUSED ? SVC_IDLE : 0;
    case CTL_SAVE: return s == SVC_RUNNING || s == SVC_PAUSED ? s : 0;
    case CTL_SHUTDOWN: return SVC_IDLE;
    default: return 0;
    }
}

static int illegal(ctl_kind k, svc_state s)
{
    const char *hint = s == SVC_RUNNING || s == SVC_PAUSED ? " (stop the job first)"
                       : s == SVC_IDLE || s == SVC_FAILED ? " (no job is running: start one)"
                                                          : "";
    if (k == CTL_START && (s == SVC_RUNNING || s == SVC_PAUSED || s == SVC_STOPPING))
        hint = " (a job is resident: stop it first)";
    else if (k == CTL_PAUSE && s == SVC_PAUSED)
        hint = " (it is already paused)";
    else if (k == CTL_RESUME && s == SVC_RUNNING)
        hint = " (it is not paused)";
    return MT_ERR(MT_ESTATE, "cannot %s: the job is %s%s", kind_verb(k), svc_state_name(s), hint);
}

/* Under mu. */
static int enqueue(control *c, ctl_kind kind, int save, const char *name, mt_jobspec *spec,
                   ctl_ticket **t)
{
    pending *p = calloc(1, sizeof *p);
    ctl_ticket *tk = t ? calloc(1, sizeof *tk) : NULL;
    if (!p || (t && !tk)) {
        free(p);
        free(tk);
        free(spec);
        return MT_ERR(MT_ENOMEM, "control: out of memory");
    }
    p->kind = kind;
    p->save = save;
    snprintf(p->name, sizeof p->name, "%s", name ? name : "");
    p->spec = spec;
    p->t = tk;
    if (tk) tk->c = c;
    c->outstanding++;
    if (c->tail) c->tail->next = p;
    else c->head = p;
    c->tail = p;
    if (t) *t = tk;
    pthread_cond_signal(&c->cv);
    return MT_OK;
}

static int submit(control *c, ctl_kind kind, int save, const char *name, mt_jobspec *spec,
                  ctl_ticket **t)
{
    pthread_mutex_lock(&c->mu);
    int rc;
    svc_state next = transition(c->projected, kind);
    if (c->shutting_down && kind != CTL_SHUTDOWN) {
        rc = MT_ERR(MT_EINTR, "the daemon is shutting down");
    } else if (!next) {
        rc = illegal(kind, c->projected);
    } else {
        rc = enqueue(c, kind, save, name, spec, t);
        spec = NULL;
        if (rc == MT_OK) c->projected = next;
        if (kind == CTL_SHUTDOWN) c->shutting_down = 1;
    }
    pthread_mutex_unlock(&c->mu);
    free(spec);
    return rc;
}

int control_start(control *c, const mt_jobspec *job, ctl_ticket **t)
{
    if (mt_layout_world(&job->parallel) != c->o.world || job->parallel.dp < 1)
        return MT_ERR(MT_EINVAL, "job %s was not admitted for %d ranks", job->name, c->o.world);
    mt_jobspec *spec = malloc(sizeof *spec);
    if (!spec) return MT_ERR(MT_ENOMEM, "control: out of memory for a job spec");
    *spec = *job;
    return submit(c, CTL_START, 0, job->name, spec, t);
}

int control_command(control *c, ctl_kind kind, int save, ctl_ticket **t)
{
    if (kind == CTL_START || kind == CTL_NONE)
        return MT_ERR(MT_EINVAL, "control_command: use control_start");
    return submit(c, kind, save, "", NULL, t);
}

void control_get_status(control *c, control_status *out)
{
    pthread_mutex_lock(&c->mu);
    *out = c->st;
    pthread_mutex_unlock(&c->mu);
    if (c->reshard) ctl_reshard_get(c->reshard, &out->reshard);
    if (out->last_ckpt.valid) board_fill_saves(c->board, &out->last_ckpt, 1);
}

int control_world(const control *c) { return c->o.world; }

board *control_board(control *c) { return c->board; }

int control_shutting_down(control *c)
{
    pthread_mutex_lock(&c->mu);
    int v = c->shutting_down;
    pthread_mutex_unlock(&c->mu);
    return v;
}

/* ---- the engine side ---------------------------------------------------------------------- */

static int rank0(const control *c) { return c->o.rank == 0; }

static void publish_state(control *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Records the state in the snapshot and as a hub event (rank 0). */
static void publish_state(control *c, const char *fmt, ...)
{
    if (!rank0(c)) return;
    char msg[SVC_MSG_CAP];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&c->mu);
    c->st.state = c->state;
    pthread_mutex_unlock(&c->mu);
    if (c->o.hub) {
        hub_event *e = hub_event_new(c->run_id, c->job.name, HUB_STATE);
        if (!e) return;
        e->u.state.state = c->state;
        e->u.state.step = c->t ? c->t->step : c->st.step;
        snprintf(e->u.state.message, sizeof e->u.state.message, "%s", msg);
        hub_publish(c->o.hub, e);
        free(e);
    }
}

/* The snapshot after a step or a command (rank 0). */
static void snapshot(control *c)
{
    if (!rank0(c)) return;
    pthread_mutex_lock(&c->mu);
    c->st.state = c->state;
    if (c->t) {
        c->st.step = c->t->step;
        c->st.total_steps = c->job.train.steps;
        c->st.tokens = c->t->consumed_samples * c->job.batch.seq_len;
        if (c->t->last.step > 0) {
            c->st.last = c->t->last;
            c->st.have_metrics = 1;
            if (isfinite(c->t->last.valid_loss)) c->st.last_valid_loss = c->t->last.valid_loss;
        }
    }
    pthread_mutex_unlock(&c->mu);
}

typedef struct hub_sink {
    mt_metrics_sink s;
    control *c;
} hub_sink;

static int hub_emit(mt_metrics_sink *s, const mt_step_metrics *m)
{
    control *c = ((hub_sink *)s->impl)->c;
    hub_event *e = hub_event_new(c->run_id, c->job.name, HUB_STEP);
    if (!e) return MT_ERR(MT_ENOMEM, "metrics hub: out of memory");
    e->u.step = *m;
    hub_publish(c->o.hub, e);
    free(e);
    return MT_OK;
}

static void hub_sink_close(mt_metrics_sink *s) { free(s->impl); }

static int add_sinks(control *c)
{
    mt_metrics_sink *s;
    MT_CHECK(mt_metrics_log_sink(&s, c->job.train.log_interval));
    MT_CHECK(mt_trainer_add_sink(c->t, s));
    if (!rank0(c)) return MT_OK;
    if (c->o.jsonl) {
        MT_CHECK(mt_metrics_jsonl_sink(&s, c->o.jsonl));
        MT_CHECK(mt_trainer_add_sink(c->t, s));
    }
    if (c->o.hub) {
        hub_sink *h = calloc(1, sizeof *h);
        if (!h) return MT_ERR(MT_ENOMEM, "control: out of memory");
        h->c = c;
        h->s.emit = hub_emit;
        h->s.close = hub_sink_close;
        h->s.impl = h;
        int rc = mt_trainer_add_sink(c->t, &h->s);
        if (rc < 0) free(h);
        return rc;
    }
    return MT_OK;
}

/* Frees the job's engine state (every rank). */
static void release_job(control *c)
{
    int rc = mt_job_end(c->run);
    if (rc < 0) MT_LOGE("checkpoint: %s", mt_errmsg());
    c->run = NULL;
    c->t = NULL;
    /* after the end: a save in flight writes through the folder ck holds */
    ctl_ckpt_close(c->ck);
    c->ck = NULL;
}

/* Builds the admitted job on this rank; all ranks agree on the outcome
 * (mt_job_start). Rank 0 of the daemon first confines the job's checkpoint
 * folders again and holds them; the job starts on the held ones
 * (service/control_ckpt.h). */
static int build_job(control *c, const mt_jobspec *spec)
{
    c->job = *spec;
    mt_jobspec *use = malloc(sizeof *use);
    int rc = use ? ctl_ckpt_open(&c->ck, c->o.workdir, &c->job, use)
                 : MT_ERR(MT_ENOMEM, "control: out of memory for a job spec");
    int ok = mt_runtime_agree(c->o.rt, rc == MT_OK);
    if (rc == MT_OK && ok != 1) rc = MT_ERR(MT_EGENERIC, "the job failed to start on another rank");
    if (rc == MT_OK) {
        mt_job_opts jo = {.threads = c->o.threads};
        rc = ctl_ckpt_said(c->ck, mt_job_start(&c->run, c->o.rt, use, &jo));
    }
    free(use);
    if (rc < 0) {
        release_job(c);
        return rc;
    }
    c->t = c->run->trainer;
    rc = add_sinks(c);
    if (rc == MT_OK) rc = ctl_ckpt_attach(c->ck, c->run);
    /* a sink that cannot open fails the job on every rank alike */
    ok = mt_runtime_agree(c->o.rt, rc == MT_OK);
    if (rc == MT_OK && ok != 1) rc = MT_ERR(MT_EGENERIC, "the job failed to start on another rank");
    if (rc < 0) release_job(c);
    return rc;
}

static void complete_ticket(control *c, ctl_ticket *t, const ctl_result *r);

static void apply_start(control *c, const wire_cmd *w, const mt_jobspec *spec, ctl_ticket *t)
{
    ctl_result r;
    memset(&r, 0, sizeof r);
    c->run_id = w->run_id;
    c->ran_job = 1;
    int rc = build_job(c, spec);
    if (rc < 0) {
        char msg[SVC_MSG_CAP];
        MT_LOGE("job start failed: %s", mt_errmsg());
        svc_strip_locations(mt_errmsg(), msg, sizeof msg);
        c->state = SVC_FAILED;
        c->final_rc = rc;
        snprintf(c->final_msg, sizeof c->final_msg, "%s", msg);
        if (rank0(c)) {
            pthread_mutex_lock(&c->mu);
            snprintf(c->st.error, sizeof c->st.error, "%s", msg);
            c->st.run_id = c->run_id;
            snprintf(c->st.job, sizeof c->st.job, "%s", w->name);
            c->st.step = c->st.total_steps = c->st.tokens = 0;
            c->st.have_metrics = 0;
            c->st.have_layout = 0;
            c->st.last_ckpt.valid = 0;
            c->st.backend[0] = '\0';
            c->st.outcome[0] = '\0';
            result_error(&r, rc, msg);
            pthread_mutex_unlock(&c->mu);
            publish_state(c, "the job failed to start: %s", msg);
            complete_ticket(c, t, &r);
        }
        if (c->o.exit_when_idle) c->quit = 1;
        return;
    }
    c->state = SVC_RUNNING;
    preempt_set_grace(c->job.train.term_grace_s);
    MT_LOGI("job %s (run %llu) running from step %lld of %lld", c->job.name,
            (unsigned long long)c->run_id, (long long)c->t->step, (long long)c->job.train.steps);
    if (!rank0(c)) return;
    pthread_mutex_lock(&c->mu);
    memset(&c->st.last, 0, sizeof c->st.last);
    c->st.have_metrics = 0;
    c->st.last_valid_loss = NAN;
    c->st.run_id = c->run_id;
    snprintf(c->st.job, sizeof c->st.job, "%s", c->job.name);
    snprintf(c->st.backend, sizeof c->st.backend, "%s", c->run->be->name);
    snprintf(c->st.ckpt_dir, sizeof c->st.ckpt_dir, "%s", c->job.checkpoint.dir);
    c->st.error[0] = c->st.outcome[0] = '\0';
    c->st.last_ckpt.valid = 0;
    c->st.layout = c->job.parallel; /* admitted: dp resolved */
    c->st.have_layout = 1;
    board_new_run(c->board, c->run_id);
    r.run_id = c->run_id;
    snprintf(r.job, sizeof r.job, "%s", c->job.name);
    r.start_step = r.step = c->t->step;
    r.total_steps = c->job.train.steps;
    r.state = SVC_RUNNING;
    pthread_mutex_unlock(&c->mu);
    snapshot(c);
    publish_state(c, "job %s started at step %lld of %lld", c->job.name, (long long)c->t->step,
                  (long long)c->job.train.steps);
    /* The reply after the event, as for every command: a client that opens
     * StreamMetrics once StartJob has answered follows this job, not a
     * replay of the previous one. */
    complete_ticket(c, t, &r);
}

/* Records a saved checkpoint in the snapshot, on the board (its save
 * times; its verify starts: ck->verify says so) and in the hub (rank 0). */
static void note_checkpoint(control *c, svc_ckpt *ck)
{
    if (!rank0(c) || !ck->valid) return;
    if (c->verifier) ctl_verifier_submit(c->verifier, ck);
    else board_note_save(c->board, ck);
    pthread_mutex_lock(&c->mu);
    c->st.last_ckpt = *ck;
    c->st.ckpt_saved_total++;
    pthread_mutex_unlock(&c->mu);
    if (c->o.hub) {
        hub_event *e = hub_event_new(c->run_id, c->job.name, HUB_CHECKPOINT);
        if (!e) return;
        e->u.ckpt = *ck;
        hub_publish(c->o.hub, e);
        free(e);
    }
}

/* Ends the resident job: optional final checkpoint, then IDLE. */
static int end_job(control *c, const char *outcome, int save, svc_ckpt *saved)
{
    int rc = MT_OK;
    memset(saved, 0, sizeof *saved);
    if (save) {
        c->state = SVC_STOPPING;
        snapshot(c);
        publish_state(c, "stopping at step %lld: saving a final checkpoint", (long long)c->t->step);
        svc_ckpt earlier;
        rc = ctl_ckpt_save(c->ck, &earlier, saved);
        if (rc < 0) MT_LOGE("final checkpoint failed: %s", mt_errmsg());
        note_checkpoint(c, &earlier);
        note_checkpoint(c, saved);
    } else {
        /* a save still writing commits before the job goes: reported */
        svc_ckpt last;
        if (ctl_ckpt_finish(c->ck, &last) < 0) mt_err_clear(); /* logged by the policy */
        note_checkpoint(c, &last);
    }
    int64_t step = c->t->step;
    if (!strcmp(outcome, "completed"))
        MT_LOGI("job %s completed %lld steps", c->job.name, (long long)step);
    else
        MT_LOGI("job %s %s at step %lld", c->job.name, outcome, (long long)step);
    snapshot(c);
    release_job(c);
    c->state = SVC_IDLE;
    if (rank0(c)) {
        pthread_mutex_lock(&c->mu);
        snprintf(c->st.outcome, sizeof c->st.outcome, "%s", outcome);
        c->st.step = step;
        pthread_mutex_unlock(&c->mu);
        publish_state(c, "job %s %s at step %lld", c->job.name, outcome, (long long)step);
    }
    if (c->o.exit_when_idle) c->quit = 1;
    return rc;
}

static void fail_job(control *c, int rc)
{
    char msg[SVC_MSG_CAP];
    MT_LOGE("job %s failed at step %lld: %s", c->job.name, (long long)(c->t ? c->t->step : 0),
            mt_errmsg());
    svc_strip_locations(mt_errmsg(), msg, sizeof msg);
    snapshot(c);
    release_job(c);
    c->state = SVC_FAILED;
    c->final_rc = rc;
    snprintf(c->final_msg, sizeof c->final_msg, "%s", msg);
    if (rank0(c)) {
        pthread_mutex_lock(&c->mu);
        snprintf(c->st.error, sizeof c->st.error, "%s", msg);
        pthread_mutex_unlock(&c->mu);
        publish_state(c, "the job failed: %s", msg);
    }
    if (c->o.exit_when_idle) c->quit = 1;
}

/* Once no command is outstanding, the projected state is the state: a job
 * that completed or failed on its own takes a start again. */
static void sync_projected(control *c, int applied)
{
    if (!rank0(c)) return;
    pthread_mutex_lock(&c->mu);
    c->outstanding -= applied;
    if (c->outstanding == 0) c->projected = c->state;
    pthread_mutex_unlock(&c->mu);
}

static void complete_ticket(control *c, ctl_ticket *t, const ctl_result *r)
{
    if (!rank0(c) || !t) return;
    pthread_mutex_lock(&c->mu);
    ticket_complete(t, r);
    pthread_mutex_unlock(&c->mu);
}

/* A command that was legal when queued may not be now (the job completed
 * or failed meanwhile). */
static int still_legal(control *c, ctl_kind k, ctl_ticket *t)
{
    if (transition(c->state, k)) return 1;
    ctl_result r;
    int rc = illegal(k, c->state);
    result_error(&r, rc, mt_errmsg());
    complete_ticket(c, t, &r);
    return 0;
}

static void apply(control *c, const wire_cmd *w, const mt_jobspec *spec, ctl_ticket *t)
{
    ctl_kind k = (ctl_kind)w->kind;
    ctl_result r;
    memset(&r, 0, sizeof r);
    if (k == CTL_START) {
        if (still_legal(c, k, t)) apply_start(c, w, spec, t);
        return;
    }
    if (k == CTL_SHUTDOWN) {
        if (c->state == SVC_RUNNING || c->state == SVC_PAUSED) {
            svc_ckpt ck;
            /* save: 1 / -1 SIGTERM within / past its grace period (control_term.h), 0 policy */
            int save = w->save > 0 || (w->save == 0 && c->job.checkpoint.save_on_stop);
            int src = end_job(c, "stopped", save, &ck);
            if (w->save < 0 || (w->save > 0 && src < 0)) c->term_unsaved = 1;
        }
        c->quit = 1;
        complete_ticket(c, t, &r);
        return;
    }
    if (!still_legal(c, k, t)) return;
    r.step = c->t->step;
    switch (k) {
    case CTL_PAUSE:
        c->state = SVC_PAUSED;
        MT_LOGI("job %s paused at step %lld", c->job.name, (long long)r.step);
        snapshot(c);
        publish_state(c, "paused at step %lld", (long long)r.step);
        break;
    case CTL_RESUME:
        c->state = SVC_RUNNING;
        MT_LOGI("job %s resumed at step %lld", c->job.name, (long long)r.step);
        snapshot(c);
        publish_state(c, "resumed at step %lld", (long long)r.step);
        break;
    case CTL_STOP:
        r.rc = end_job(c, "stopped", w->save || c->job.checkpoint.save_on_stop, &r.ckpt);
        if (r.rc < 0) snprintf(r.msg, sizeof r.msg, "stopped, but the final checkpoint failed: %s",
                               mt_errmsg());
        break;
    case CTL_SAVE: {
        svc_ckpt earlier;
        r.rc = ctl_ckpt_save(c->ck, &earlier, &r.ckpt);
        if (r.rc < 0) {
            snprintf(r.msg, sizeof r.msg, "%s", mt_errmsg());
            MT_LOGE("checkpoint failed: %s", r.msg);
        }
        note_checkpoint(c, &earlier);
        note_checkpoint(c, &r.ckpt);
        break;
    }
    default: break;
    }
    r.state = c->state;
    complete_ticket(c, t, &r);
}

/* After a step, on every rank: each rank's record to rank 0's board (one
 * gather over the world), and rank 0's expert loads and router biases. */
static int post_step(control *c)
{
    const mt_step_metrics *m = &c->t->last;
    board_rank me = {.rank = c->o.rank, .step = m->step, .step_ms = m->step_ms,
                     .compute_ms = m->compute_ms, .mem_in_use = (int64_t)m->mem_in_use,
                     .mem_peak = (int64_t)m->mem_peak, .pp_size = m->pp_size,
                     .pp_stage = m->pp_stage, .pp_idle = m->pp_idle, .pp_bubble = m->pp_bubble,
                     .pp_bubble_measured = m->pp_bubble_measured};
    MT_CHECK(board_gather_ranks(c->board, c->o.rt->world, &me));
    const mt_trainer *t = c->t;
    if (!rank0(c) || t->moe_step <= 0 || t->moe_step != m->step) return MT_OK;
    board_experts e = {.run_id = c->run_id, .step = t->moe_step, .n_layers = t->n_moe_rec,
                       .n_experts = t->model->cfg.n_routed_experts, .have_bias = t->moe_have_bias,
                       .layer = t->moe_layer, .load = t->moe_load, .bias = t->moe_bias};
    if (board_post_experts(c->board, &e) < 0) {
        MT_LOGW("the expert loads of step %lld are not shown: %s", (long long)m->step, mt_errmsg());
        mt_err_clear();
    }
    return MT_OK;
}

static void step_once(control *c)
{
    if (c->t->step >= c->job.train.steps) {
        svc_ckpt ck;
        end_job(c, "completed", 0, &ck);
        return;
    }
    int rc = ctl_ckpt_said(c->ck, mt_job_step(c->run, NULL));
    if (rc == MT_OK && c->run->rollback_note[0]) { /* a loss spike or NaN streak (issue 20) */
        /* the step was not applied (every rank alike): nothing to post */
        char msg[SVC_MSG_CAP];
        ctl_ckpt_say(c->ck, c->run->rollback_note, msg, sizeof msg);
        snapshot(c);
        publish_state(c, "%s", msg);
        return;
    }
    if (rc == MT_OK) rc = post_step(c);
    if (rc < 0) {
        fail_job(c, rc);
        return;
    }
    svc_ckpt ck;
    ctl_ckpt_newly_saved(c->ck, &ck);
    note_checkpoint(c, &ck);
    snapshot(c);
    if (c->t->step >= c->job.train.steps) end_job(c, "completed", 0, &ck);
}

/* Rank 0: waits until there is something to do, then takes the queue. */
static pending *collect(control *c, volatile sig_atomic_t *term)
{
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (term && *term && !c->term_seen) {
            c->term_seen = 1;
            c->shutting_down = 1;
            enqueue(c, CTL_SHUTDOWN, ctl_term_save_flag(&c->job, c->ck, c->t != NULL), "", NULL,
                    NULL);
        }
        if (c->head || c->state == SVC_RUNNING || c->quit) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    pending *p = c->head;
    c->head = c->tail = NULL;
    pthread_mutex_unlock(&c->mu);
    return p;
}

/* Broadcasts rank 0's commands of this boundary and applies them. */
static int boundary(control *c, pending *list)
{
    pending *p = list;
    for (;;) {
        wire_cmd w;
        memset(&w, 0, sizeof w);
        if (rank0(c) && p) {
            w.kind = p->kind;
            w.save = p->save;
            snprintf(w.name, sizeof w.name, "%s", p->name);
            w.spec_len = p->spec ? (int64_t)sizeof *p->spec : 0;
            if (p->kind == CTL_START) w.run_id = ++c->run_seq;
        }
        MT_CHECK(mt_runtime_share(c->o.rt, &w, sizeof w));
        if (w.kind == CTL_NONE) break;
        mt_jobspec *spec = NULL;
        if (w.spec_len > 0) {
            if (w.spec_len != (int64_t)sizeof *spec)
                return MT_ERR(MT_EGENERIC, "control: a job spec of %lld bytes, not %zu",
                              (long long)w.spec_len, sizeof *spec);
            spec = rank0(c) ? p->spec : malloc(sizeof *spec);
            if (!spec) return MT_ERR(MT_ENOMEM, "control: out of memory for a job spec");
            MT_CHECK(mt_runtime_share(c->o.rt, spec, sizeof *spec));
        }
        apply(c, &w, spec, rank0(c) ? p->t : NULL);
        sync_projected(c, 1);
        if (!rank0(c)) free(spec);
        if (rank0(c)) p = p->next;
    }
    return MT_OK;
}

/* Commands still queued when the loop ends are refused. */
static void refuse_queued(control *c)
{
    pthread_mutex_lock(&c->mu);
    c->shutting_down = 1;
    pending *p = c->head;
    c->head = c->tail = NULL;
    for (pending *q = p; q; q = q->next) {
        ctl_result r;
        result_error(&r, MT_EINTR, "the daemon is shutting down");
        ticket_complete(q->t, &r);
    }
    pthread_mutex_unlock(&c->mu);
    free_pending(p);
}

/* The step watchdog (watchdog.h) covers a running job's boundary and step. */
static void arm_watchdog(control *c)
{
    if (!c->o.wd || c->state != SVC_RUNNING || !c->t) return;
    char what[64];
    snprintf(what, sizeof what, "step %lld", (long long)c->t->step + 1);
    watchdog_arm(c->o.wd, c->job.train.step_timeout_s, what);
}

int control_run(control *c, volatile sig_atomic_t *term)
{
    int rc = MT_OK;
    while (!c->quit) {
        pending *list = NULL;
        if (rank0(c)) list = collect(c, term);
        arm_watchdog(c);
        /* Under mpirun a signal reaches every rank; only rank 0 acts on it
         * and the others follow the broadcast. */
        rc = boundary(c, list);
        free_pending(list);
        if (rc < 0) break;
        if (!c->quit && c->state == SVC_RUNNING) {
            step_once(c);
            if (c->state != SVC_RUNNING) sync_projected(c, 0);
        }
        watchdog_disarm(c->o.wd);
    }
    watchdog_disarm(c->o.wd);
    if (c->t) release_job(c);
    if (rank0(c)) refuse_queued(c);
    if (rc < 0) return rc;
    if (c->term_unsaved)
        return mt_err_at(MT_EINTR, __FILE__, __LINE__,
                         "stopped by SIGTERM without saving a checkpoint: restart with --resume "
                         "auto to continue from the newest one");
    if (c->state == SVC_FAILED && c->o.exit_when_idle)
        return mt_err_at(c->final_rc, __FILE__, __LINE__, "%s", c->final_msg);
    return MT_OK;
}

void control_report_fatal(control *c, const char *msg)
{
    if (!rank0(c)) return;
    char job[SVC_NAME_CAP];
    pthread_mutex_lock(&c->mu);
    c->st.state = SVC_FAILED;
    snprintf(c->st.error, sizeof c->st.error, "%s", msg);
    snprintf(job, sizeof job, "%s", c->st.job);
    uint64_t run = c->st.run_id;
    int64_t step = c->st.step;
    pthread_mutex_unlock(&c->mu);
    if (c->o.hub) {
        hub_event *e = hub_event_new(run, job, HUB_STATE);
        if (!e) return;
        e->u.state.state = SVC_FAILED;
        e->u.state.step = step;
        snprintf(e->u.state.message, sizeof e->u.state.message, "%s", msg);
        hub_publish(c->o.hub, e);
        free(e);
    }
}

/* ---- checkpoints (rank 0) ------------------------------------------------------------------ */

/* The checkpoint directory of a job: the current or last one's as its spec
 * said, otherwise the default place for the name. */
static int job_ckpt_dir(control *c, const char *job, char *dir, size_t cap, char *name,
                        size_t ncap)
{
    if (!c->o.workdir) return MT_ERR(MT_ENOTSUP, "no workdir");
    pthread_mutex_lock(&c->mu);
    int have = c->st.ckpt_dir[0] && (!job[0] || !strcmp(job, c->st.job));
    if (have) {
        snprintf(dir, cap, "%s", c->st.ckpt_dir);
        snprintf(name, ncap, "%s", c->st.job);
    }
    pthread_mutex_unlock(&c->mu);
    if (have) return MT_OK;
    if (!job[0]) return MT_ERR(MT_ENOTFOUND, "job: no job has run yet; name one");
    int n = snprintf(dir, cap, "%s/checkpoints/%s", c->o.workdir, job);
    if (n < 0 || (size_t)n >= cap) return MT_ERR(MT_EINVAL, "job: name too long");
    snprintf(name, ncap, "%s", job);
    return MT_OK;
}

int control_list_checkpoints(control *c, const char *job, char *dir, size_t dir_cap,
                             svc_ckpt **out, int *n)
{
    char name[SVC_NAME_CAP];
    *out = NULL;
    *n = 0;
    MT_CHECK(job_ckpt_dir(c, job, dir, dir_cap, name, sizeof name));
    MT_CHECK(ctl_ckpt_list(c->o.workdir, dir, out, n));
    board_fill_saves(c->board, *out, *n);
    return MT_OK;
}

int control_checkpoint_path(control *c, const char *ckpt_dir, const char *name, char *path,
                            size_t cap)
{
    return ctl_ckpt_find(c->o.workdir, ckpt_dir, name, path, cap);
}

int control_reshard(control *c, const char *job, const char *source, const char *target,
                    const mt_layout *layout, char *path, size_t path_cap)
{
    if (!c->reshard) return MT_ERR(MT_ENOTSUP, "reshard: not available here");
    char dir[MT_PATH_CAP], name[SVC_NAME_CAP], src[MT_PATH_CAP];
    MT_CHECK(job_ckpt_dir(c, job, dir, sizeof dir, name, sizeof name));
    MT_CHECK(ctl_ckpt_find(c->o.workdir, dir, source, src, sizeof src));
    /* The target is a checkpoint directory of its own beside the job's. */
    int k = snprintf(path, path_cap, "%s/checkpoints/%s", c->o.workdir, target);
    if (k < 0 || (size_t)k >= path_cap) return MT_ERR(MT_EINVAL, "target: name too long");
    uint64_t run;
    pthread_mutex_lock(&c->mu);
    run = c->st.run_id;
    pthread_mutex_unlock(&c->mu);
    return ctl_reshard_start(c->reshard, c->o.workdir, src, path, source, target, layout, run,
                             name);
}
