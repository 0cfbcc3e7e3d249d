/* trainer_rpc.c - moetrain.v1.Trainer: requests validated and turned into
 * control commands, replies built from the service records. The protobuf
 * messages of api/moetrain.proto are built here and nowhere else. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/mt_status.h"
#include "moetrain.pb-c.h"
#include "service/board.h"
#include "service/job_admit.h"
#include "service/rpc_validate.h"
#include "service/service.h"
#include "service/workdir.h"

#ifndef MOETRAIN_VERSION
#define MOETRAIN_VERSION "dev"
#endif

_Static_assert((int)SVC_IDLE == (int)MOETRAIN__V1__JOB_STATE__JOB_STATE_IDLE &&
                   (int)SVC_RUNNING == (int)MOETRAIN__V1__JOB_STATE__JOB_STATE_RUNNING &&
                   (int)SVC_PAUSED == (int)MOETRAIN__V1__JOB_STATE__JOB_STATE_PAUSED &&
                   (int)SVC_STOPPING == (int)MOETRAIN__V1__JOB_STATE__JOB_STATE_STOPPING &&
                   (int)SVC_FAILED == (int)MOETRAIN__V1__JOB_STATE__JOB_STATE_FAILED,
               "svc_state and moetrain.v1.JobState must agree");

/* ---- records to messages -------------------------------------------------------- */

static void layout_pb(const mt_layout *p, Moetrain__V1__Layout *l)
{
    *l = (Moetrain__V1__Layout)MOETRAIN__V1__LAYOUT__INIT;
    l->tp = p->tp;
    l->pp = p->pp;
    l->vpp = p->vpp;
    l->ep = p->ep;
    l->etp = p->etp;
    l->dp = p->dp;
    l->schedule = (char *)svc_schedule_name(p->schedule);
}

typedef struct ckpt_pb {
    Moetrain__V1__CheckpointInfo info;
    Moetrain__V1__Layout layout;
} ckpt_pb;

static Moetrain__V1__CheckpointInfo *ckpt_to_pb(const svc_ckpt *c, ckpt_pb *b)
{
    if (!c->valid) return NULL;
    b->info = (Moetrain__V1__CheckpointInfo)MOETRAIN__V1__CHECKPOINT_INFO__INIT;
    b->info.name = (char *)c->name;
    b->info.step = c->step;
    b->info.path = (char *)c->path;
    b->info.bytes = c->bytes;
    b->info.write_ms = c->write_ms;
    b->info.stall_ms = c->stall_ms;
    b->info.verify = (char *)c->verify;
    if (c->have_layout) {
        layout_pb(&c->layout, &b->layout);
        b->info.layout = &b->layout;
    }
    return &b->info;
}

typedef struct metrics_pb {
    Moetrain__V1__StepMetrics m;
    Moetrain__V1__ExpertLoad load[MT_METRICS_MAX_MOE];
    Moetrain__V1__ExpertLoad *loadp[MT_METRICS_MAX_MOE];
} metrics_pb;

static Moetrain__V1__StepMetrics *metrics_to_pb(const mt_step_metrics *s, metrics_pb *b)
{
    Moetrain__V1__StepMetrics *m = &b->m;
    *m = (Moetrain__V1__StepMetrics)MOETRAIN__V1__STEP_METRICS__INIT;
    m->step = s->step;
    m->total_steps = s->total_steps;
    m->loss = s->loss;
    m->mtp_loss = s->mtp_loss;
    m->aux_loss = s->aux_loss;
    m->lr = s->lr;
    m->grad_norm = s->grad_norm;
    m->valid_loss = s->valid_loss;
    m->step_ms = s->step_ms;
    m->compute_ms = s->compute_ms;
    m->tokens_per_s = s->tokens_per_s;
    m->tflops = s->tflops;
    m->mfu = s->mfu;
    m->tokens = s->tokens;
    m->samples = s->samples;
    m->mem_in_use = (int64_t)s->mem_in_use;
    m->mem_peak = (int64_t)s->mem_peak;
    m->skipped = s->skipped != 0;
    m->skipped_total = s->skipped_total;
    int n = s->n_moe < MT_METRICS_MAX_MOE ? s->n_moe : MT_METRICS_MAX_MOE;
    for (int i = 0; i < n; i++) {
        b->load[i] = (Moetrain__V1__ExpertLoad)MOETRAIN__V1__EXPERT_LOAD__INIT;
        b->load[i].layer = s->moe_layer[i];
        b->load[i].min = s->load_min[i];
        b->load[i].max = s->load_max[i];
        b->load[i].cv = s->load_cv[i];
        b->loadp[i] = &b->load[i];
    }
    m->n_expert_load = (size_t)n;
    m->expert_load = b->loadp;
    return m;
}

typedef struct reshard_pb {
    Moetrain__V1__ReshardStatus r;
    Moetrain__V1__Layout layout;
} reshard_pb;

static Moetrain__V1__ReshardStatus *reshard_to_pb(const svc_reshard *s, reshard_pb *b)
{
    Moetrain__V1__ReshardStatus *r = &b->r;
    *r = (Moetrain__V1__ReshardStatus)MOETRAIN__V1__RESHARD_STATUS__INIT;
    r->active = s->active != 0;
    r->done = s->done != 0;
    r->failed = s->failed != 0;
    r->source = (char *)s->source;
    r->target = (char *)s->target;
    r->progress = s->progress;
    r->message = (char *)s->message;
    layout_pb(&s->layout, &b->layout);
    r->layout = &b->layout;
    return r;
}

/* ---- commands answered at the step boundary ------------------------------------------ */

typedef int (*build_fn)(const ctl_result *res, rpc_reply *out);

typedef struct ticket_stream {
    rpc_stream s;
    ctl_ticket *t;
    build_fn build;
    int done;
} ticket_stream;

static int ticket_next(rpc_stream *s, rpc_reply *out)
{
    ticket_stream *ts = (ticket_stream *)s;
    ctl_result res;
    if (!control_ticket_poll(ts->t, &res)) return RPC_WAIT;
    ts->done = 1;
    if (res.rc < 0)
        rpc_reply_mt_msg(out, res.rc, NULL, res.msg);
    else
        ts->build(&res, out);
    return RPC_END;
}

static void ticket_close(rpc_stream *s)
{
    ticket_stream *ts = (ticket_stream *)s;
    if (!ts->done) control_ticket_drop(ts->t);
    free(ts);
}

static rpc_stream *await(ctl_ticket *t, build_fn build, rpc_reply *out)
{
    ticket_stream *ts = calloc(1, sizeof *ts);
    if (!ts) {
        control_ticket_drop(t);
        rpc_reply_error(out, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    ts->s.next = ticket_next;
    ts->s.close = ticket_close;
    ts->t = t;
    ts->build = build;
    return &ts->s;
}

static int b_start(const ctl_result *res, rpc_reply *out)
{
    Moetrain__V1__StartJobResponse m = MOETRAIN__V1__START_JOB_RESPONSE__INIT;
    m.job = (char *)res->job;
    m.run_id = res->run_id;
    m.start_step = res->start_step;
    m.total_steps = res->total_steps;
    m.state = (Moetrain__V1__JobState)res->state;
    return rpc_reply_pack(out, &m.base);
}

static int b_pause(const ctl_result *res, rpc_reply *out)
{
    Moetrain__V1__PauseJobResponse m = MOETRAIN__V1__PAUSE_JOB_RESPONSE__INIT;
    m.step = res->step;
    return rpc_reply_pack(out, &m.base);
}

static int b_resume(const ctl_result *res, rpc_reply *out)
{
    Moetrain__V1__ResumeJobResponse m = MOETRAIN__V1__RESUME_JOB_RESPONSE__INIT;
    m.step = res->step;
    return rpc_reply_pack(out, &m.base);
}

static int b_stop(const ctl_result *res, rpc_reply *out)
{
    Moetrain__V1__StopJobResponse m = MOETRAIN__V1__STOP_JOB_RESPONSE__INIT;
    ckpt_pb cb;
    m.step = res->step;
    m.checkpoint = ckpt_to_pb(&res->ckpt, &cb);
    return rpc_reply_pack(out, &m.base);
}

static int b_save(const ctl_result *res, rpc_reply *out)
{
    Moetrain__V1__SaveCheckpointResponse m = MOETRAIN__V1__SAVE_CHECKPOINT_RESPONSE__INIT;
    ckpt_pb cb;
    m.checkpoint = ckpt_to_pb(&res->ckpt, &cb);
    return rpc_reply_pack(out, &m.base);
}

static int find_checkpoint(void *arg, const char *dir, const char *name, char *path, size_t cap)
{
    service *sv = arg;
    return control_checkpoint_path(sv->ctl, dir, name, path, cap);
}

static rpc_stream *h_start(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    service *sv = ctx;
    mt_jobspec job;
    job_request jr = rpc_start_job_request(req, find_checkpoint, sv);
    jr.world = control_world(sv->ctl);
    int rc = job_admit(sv->workdir, &jr, &job);
    if (rc < 0) {
        rpc_reply_mt(out, rc, NULL);
        return NULL;
    }
    ctl_ticket *t;
    rc = control_start(sv->ctl, &job, &t);
    if (rc < 0) {
        rpc_reply_mt(out, rc, NULL);
        return NULL;
    }
    return await(t, b_start, out);
}

static rpc_stream *command(service *sv, ctl_kind kind, int save, build_fn b, rpc_reply *out)
{
    ctl_ticket *t;
    int rc = control_command(sv->ctl, kind, save, &t);
    if (rc < 0) {
        rpc_reply_mt(out, rc, NULL);
        return NULL;
    }
    return await(t, b, out);
}

static rpc_stream *h_pause(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    (void)req;
    return command(ctx, CTL_PAUSE, 0, b_pause, out);
}

static rpc_stream *h_resume(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    (void)req;
    return command(ctx, CTL_RESUME, 0, b_resume, out);
}

static rpc_stream *h_stop(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    const Moetrain__V1__StopJobRequest *q = (const void *)req;
    return command(ctx, CTL_STOP, q->save, b_stop, out);
}

static rpc_stream *h_save(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    (void)req;
    service *sv = ctx;
    /* The job saves through the folder it started with, held open since
     * (service/control_ckpt.h), so nothing is written outside whatever
     * happened to its name. If the name now leads out of the workdir the
     * folder was replaced by a link: refuse and say so, rather than save
     * where its name no longer points. */
    control_status *st = malloc(sizeof *st);
    if (!st) {
        rpc_reply_error(out, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    control_get_status(sv->ctl, st);
    int rc = MT_OK;
    if ((st->state == SVC_RUNNING || st->state == SVC_PAUSED) && st->ckpt_dir[0] && sv->workdir) {
        char canon[MT_PATH_CAP];
        rc = wd_confine(sv->workdir, st->ckpt_dir, "checkpoint.dir", WD_MISSING_OK, canon,
                        sizeof canon, NULL);
    }
    free(st);
    if (rc < 0) {
        rpc_reply_mt(out, mt_err_wrap(MT_ESTATE, "cannot save"), NULL);
        return NULL;
    }
    return command(ctx, CTL_SAVE, 0, b_save, out);
}

/* ---- answered at once ----------------------------------------------------------------- */

static rpc_stream *h_status(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    (void)req;
    service *sv = ctx;
    control_status *st = malloc(sizeof *st);
    metrics_pb *mb = malloc(sizeof *mb);
    if (!st || !mb) {
        free(st);
        free(mb);
        rpc_reply_error(out, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    control_get_status(sv->ctl, st);
    board_ranks br = {0};
    Moetrain__V1__RankStats *rs = NULL, **rsp = NULL;
    if (board_get_ranks(control_board(sv->ctl), &br) == MT_OK && br.n > 0) {
        rs = calloc((size_t)br.n, sizeof *rs);
        rsp = calloc((size_t)br.n, sizeof *rsp);
    }
    Moetrain__V1__GetStatusResponse m = MOETRAIN__V1__GET_STATUS_RESPONSE__INIT;
    if (rs && rsp) {
        for (int i = 0; i < br.n; i++) {
            const board_rank *r = &br.r[i];
            rs[i] = (Moetrain__V1__RankStats)MOETRAIN__V1__RANK_STATS__INIT;
            rs[i].rank = r->rank;
            rs[i].step = r->step;
            rs[i].step_ms = r->step_ms;
            rs[i].compute_ms = r->compute_ms;
            rs[i].mem_in_use = r->mem_in_use;
            rs[i].mem_peak = r->mem_peak;
            rsp[i] = &rs[i];
        }
        m.n_rank_stats = (size_t)br.n;
        m.rank_stats = rsp;
        m.slowest_rank = br.slowest;
    }
    Moetrain__V1__Layout layout;
    ckpt_pb cb;
    reshard_pb rb;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    m.state = (Moetrain__V1__JobState)st->state;
    m.job = st->job;
    m.run_id = st->run_id;
    m.step = st->step;
    m.total_steps = st->total_steps;
    m.tokens = st->tokens;
    if (st->have_metrics) m.last_metrics = metrics_to_pb(&st->last, mb);
    m.last_checkpoint = ckpt_to_pb(&st->last_ckpt, &cb);
    if (st->have_layout) {
        layout_pb(&st->layout, &layout);
        m.layout = &layout;
    }
    m.ranks = st->ranks;
    m.error = st->error;
    if (st->reshard.active || st->reshard.done || st->reshard.failed)
        m.reshard = reshard_to_pb(&st->reshard, &rb);
    m.backend = st->backend;
    m.uptime_s = (double)now.tv_sec + 1e-9 * now.tv_nsec - st->started_unix;
    m.version = MOETRAIN_VERSION;
    m.subscribers = atomic_load(&sv->subscribers);
    m.outcome = st->outcome;
    rpc_reply_pack(out, &m.base);
    free(st);
    free(mb);
    free(rs);
    free(rsp);
    board_ranks_free(&br);
    return NULL;
}

static rpc_stream *h_list(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    service *sv = ctx;
    const Moetrain__V1__ListCheckpointsRequest *q = (const void *)req;
    svc_ckpt *list = NULL;
    int n = 0;
    char dir[MT_PATH_CAP];
    int rc = control_list_checkpoints(sv->ctl, q->job, dir, sizeof dir, &list, &n);
    if (rc < 0) {
        rpc_reply_mt(out, rc, NULL);
        return NULL;
    }
    Moetrain__V1__ListCheckpointsResponse m = MOETRAIN__V1__LIST_CHECKPOINTS_RESPONSE__INIT;
    ckpt_pb *cb = calloc((size_t)n + 1, sizeof *cb);
    Moetrain__V1__CheckpointInfo **p = calloc((size_t)n + 1, sizeof *p);
    if (!cb || !p) {
        rpc_reply_error(out, RPC_RESOURCE_EXHAUSTED, "out of memory");
    } else {
        for (int i = 0; i < n; i++) p[i] = ckpt_to_pb(&list[i], &cb[i]);
        m.directory = dir;
        m.n_checkpoints = (size_t)n;
        m.checkpoints = p;
        rpc_reply_pack(out, &m.base);
    }
    free(cb);
    free(p);
    free(list);
    return NULL;
}

static void layout_from_pb(const Moetrain__V1__Layout *l, mt_layout *p)
{
    memset(p, 0, sizeof *p);
    p->tp = l->tp;
    p->pp = l->pp;
    p->vpp = l->vpp;
    p->ep = l->ep;
    p->etp = l->etp;
    p->dp = l->dp;
}

static rpc_stream *h_reshard(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    service *sv = ctx;
    const Moetrain__V1__ReshardCheckpointRequest *q = (const void *)req;
    mt_layout layout;
    layout_from_pb(q->layout, &layout);
    char path[MT_PATH_CAP];
    int rc = control_reshard(sv->ctl, q->job, q->source, q->target, &layout, path, sizeof path);
    if (rc < 0) {
        rpc_reply_mt(out, rc, NULL);
        return NULL;
    }
    Moetrain__V1__ReshardCheckpointResponse m = MOETRAIN__V1__RESHARD_CHECKPOINT_RESPONSE__INIT;
    m.target = q->target;
    m.path = path;
    rpc_reply_pack(out, &m.base);
    return NULL;
}

/* ---- StreamMetrics ------------------------------------------------------------------ */

typedef struct metrics_stream {
    rpc_stream s;
    service *sv;
    uint64_t cursor;
    uint64_t run0;       /* the job current when the stream began */
    int64_t from_step;
    hub_event ev;
    metrics_pb mb;
} metrics_stream;

static int event_to_reply(metrics_stream *ms, const hub_event *e, rpc_reply *out)
{
    Moetrain__V1__MetricsEvent m = MOETRAIN__V1__METRICS_EVENT__INIT;
    Moetrain__V1__StateChange sc = MOETRAIN__V1__STATE_CHANGE__INIT;
    Moetrain__V1__CheckpointSaved cs = MOETRAIN__V1__CHECKPOINT_SAVED__INIT;
    ckpt_pb cb;
    reshard_pb rb;
    m.seq = e->seq;
    m.run_id = e->run_id;
    m.job = (char *)e->job;
    switch (e->kind) {
    case HUB_STEP:
        m.event_case = MOETRAIN__V1__METRICS_EVENT__EVENT_STEP;
        m.step = metrics_to_pb(&e->u.step, &ms->mb);
        break;
    case HUB_STATE:
        sc.state = (Moetrain__V1__JobState)e->u.state.state;
        sc.step = e->u.state.step;
        sc.message = (char *)e->u.state.message;
        m.event_case = MOETRAIN__V1__METRICS_EVENT__EVENT_STATE;
        m.state = &sc;
        break;
    case HUB_CHECKPOINT:
        cs.checkpoint = ckpt_to_pb(&e->u.ckpt, &cb);
        m.event_case = MOETRAIN__V1__METRICS_EVENT__EVENT_CHECKPOINT;
        m.checkpoint = &cs;
        break;
    case HUB_RESHARD:
        m.event_case = MOETRAIN__V1__METRICS_EVENT__EVENT_RESHARD;
        m.reshard = reshard_to_pb(&e->u.reshard, &rb);
        break;
    default: break;
    }
    return rpc_reply_pack(out, &m.base);
}

static int metrics_next(rpc_stream *s, rpc_reply *out)
{
    metrics_stream *ms = (metrics_stream *)s;
    for (;;) {
        uint64_t missed;
        int r = hub_read(ms->sv->hub, &ms->cursor, &ms->ev, &missed);
        if (missed) {
            /* Say what was lost first; the event just read comes next. */
            if (r == 1) ms->cursor--;
            hub_count_missed(ms->sv->hub, missed);
            Moetrain__V1__MetricsEvent m = MOETRAIN__V1__METRICS_EVENT__INIT;
            Moetrain__V1__Gap g = MOETRAIN__V1__GAP__INIT;
            g.missed = missed;
            m.seq = ms->cursor;
            m.job = "";
            m.event_case = MOETRAIN__V1__METRICS_EVENT__EVENT_GAP;
            m.gap = &g;
            rpc_reply_pack(out, &m.base);
            return RPC_MORE;
        }
        if (r == 0) return RPC_WAIT;
        if (r < 0) {
            out->code = RPC_OK;
            snprintf(out->detail, sizeof out->detail, "the daemon is shutting down");
            return RPC_END;
        }
        if (ms->ev.kind == HUB_STEP && ms->ev.run_id == ms->run0 &&
            ms->ev.u.step.step < ms->from_step)
            continue;
        event_to_reply(ms, &ms->ev, out);
        return RPC_MORE;
    }
}

static void metrics_close(rpc_stream *s)
{
    metrics_stream *ms = (metrics_stream *)s;
    atomic_fetch_sub(&ms->sv->subscribers, 1);
    free(ms);
}

static rpc_stream *h_stream(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    service *sv = ctx;
    const Moetrain__V1__StreamMetricsRequest *q = (const void *)req;
    metrics_stream *ms = malloc(sizeof *ms);
    if (!ms) {
        rpc_reply_error(out, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    memset(&ms->s, 0, sizeof ms->s);
    ms->s.next = metrics_next;
    ms->s.close = metrics_close;
    ms->sv = sv;
    ms->from_step = q->from_step;
    ms->cursor = hub_cursor_start(sv->hub, q->all_runs, &ms->run0);
    atomic_fetch_add(&sv->subscribers, 1);
    return &ms->s;
}

/* ---- the table ------------------------------------------------------------------------ */

#define T(name) "/moetrain.v1.Trainer/" name
#define D(msg) &moetrain__v1__##msg##__descriptor

const rpc_method trainer_rpc_methods[] = {
    {T("StartJob"), RPC_UNARY, 1, D(start_job_request), rpc_validate_start, h_start},
    {T("PauseJob"), RPC_UNARY, 1, D(pause_job_request), NULL, h_pause},
    {T("ResumeJob"), RPC_UNARY, 1, D(resume_job_request), NULL, h_resume},
    {T("StopJob"), RPC_UNARY, 1, D(stop_job_request), NULL, h_stop},
    {T("GetStatus"), RPC_UNARY, 0, D(get_status_request), NULL, h_status},
    {T("SaveCheckpoint"), RPC_UNARY, 1, D(save_checkpoint_request), NULL, h_save},
    {T("ListCheckpoints"), RPC_UNARY, 0, D(list_checkpoints_request), rpc_validate_list, h_list},
    {T("ReshardCheckpoint"), RPC_UNARY, 1, D(reshard_checkpoint_request), rpc_validate_reshard, h_reshard},
    {T("StreamMetrics"), RPC_SERVER_STREAMING, 0, D(stream_metrics_request), rpc_validate_stream, h_stream},
};
const int trainer_rpc_n_methods = (int)(sizeof trainer_rpc_methods / sizeof trainer_rpc_methods[0]);
