/* pipeline.c - see pipeline.h. */
#define _POSIX_C_SOURCE 200809L
#include "engine/train/pipeline.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/parallel/sharding.h"
#include "engine/train/grad_buckets.h"
#include "base/mt_clock.h"
#include "base/mt_log.h"
#include "base/mt_status.h"

/* ---- slots ------------------------------------------------------------------------- */

/* The walk over the table that both counts the slots (dry: held[] and
 * peak[] per local chunk) and runs the step shares these two rules. */
typedef struct walk {
    mt_pipeline *p;
    int dry;
    int *held, *peak;         /* dry: [n_local] */
} walk;

static int acquire(walk *w, int mb, int c, int *slot)
{
    mt_pipeline *p = w->p;
    int *so = &p->slot_of[mb * p->C + c];
    const int ci = p->local_of[c];
    if (*so >= 0) {
        *slot = *so;
        return MT_OK;
    }
    if (w->dry) {
        *so = w->held[ci]++;
        if (w->held[ci] > w->peak[ci]) w->peak[ci] = w->held[ci];
        *slot = *so;
        return MT_OK;
    }
    unsigned char *b = p->busy + (size_t)ci * p->max_slots;
    for (int s = 0; s < p->local_slots[ci]; s++)
        if (!b[s]) {
            b[s] = 1;
            *so = *slot = s;
            return MT_OK;
        }
    return MT_ERR(MT_ESTATE, "pipeline stage %d: chunk %d has no free slot for micro-batch %d "
                  "(%d slots)", p->stage, c, mb, p->local_slots[ci]);
}

static void release(walk *w, int mb, int c)
{
    mt_pipeline *p = w->p;
    int *so = &p->slot_of[mb * p->C + c];
    const int ci = p->local_of[c];
    if (*so < 0) return;
    if (w->dry) w->held[ci]--;
    else p->busy[(size_t)ci * p->max_slots + *so] = 0;
    *so = -1;
}

static mt_chunk_slot *slot_at(mt_model *m, const mt_pipeline *p, int mb, int c)
{
    const int ci = p->local_of[c], s = p->slot_of[mb * p->C + c];
    return s >= 0 ? &m->chunks[ci].slots[s] : NULL;
}

static int layers_of(const mt_pipeline *p, int c)
{
    return p->chunk[c].layer_hi - p->chunk[c].layer_lo;
}

/* ---- the walk ------------------------------------------------------------------------ */

/* Messages are ordered with the backend's kernels on the device when the
 * pp group runs on the backend's compute stream (the runtime sets it).
 * Otherwise (MT_COMM_HOST_SYNC=1, or a group left on the default stream)
 * nothing orders a device message with the kernels that write or read
 * its buffer, and the host fences each one (comm.h): the backend's
 * kernels done before an isend, the message in before a recv's data is
 * used. The CPU backend (no stream) needs neither. */
static int msg_fenced(const mt_pipeline *p, mt_backend *be)
{
    void *s = be->stream ? be->stream(be) : NULL;
    return s && (mt_comm_host_sync_forced() || mt_comm_stream(p->pp) != s);
}

static int msg_send(mt_pipeline *p, mt_backend *be, const void *buf, int peer, int tag)
{
    if (msg_fenced(p, be)) MT_CHECK(be->sync(be));
    return mt_comm_isend(p->pp, buf, p->msg_bytes, MT_COMM_BYTE, peer, tag);
}

static int msg_recv(mt_pipeline *p, mt_backend *be, void *buf, int peer, int tag)
{
    MT_CHECK(mt_comm_recv_tag(p->pp, buf, p->msg_bytes, MT_COMM_BYTE, peer, tag));
    return msg_fenced(p, be) ? mt_comm_sync(p->pp) : MT_OK;
}

/* The table's tag folded into the communicator's range: two messages
 * between the same stages share a tag only MT_COMM_MAX_TAG / 2 boundaries
 * apart, far more than a stage keeps in flight, and MPI keeps the order of
 * messages with the same tag. */
static int msg_tag(const mt_sched_action *a, int n_chunks)
{
    return mt_sched_msg_tag(a, n_chunks) % MT_COMM_MAX_TAG;
}

/* Device time of the compute actions (issue 15): mark 0 begins the step,
 * each compute action (FWD, BWD, BWD_IN, BWD_W) lies between a pair of
 * marks on the backend's compute stream, the last mark ends the step (after
 * the sends' wait). On CUDA the host runs ahead of the device, so a host
 * clock around the host's calls would count the stage's own queued work as
 * waiting; the marks time the device. A backend without marks: not timed. */
static int mark(mt_pipeline *p, mt_backend *be)
{
    if (!be->mark || p->n_marks < 0) return MT_OK;
    return be->mark(be, p->n_marks++);
}

static int run_action(walk *w, mt_model *m, const mt_sched_action *a, int backward,
                      mt_pipeline_batch_fn fn, void *ctx, mt_mb_stats *st)
{
    mt_pipeline *p = w->p;
    const int mb = a->mb, c = a->chunk, C = p->C;
    if (mb < 0 || mb >= p->n_mb || c < 0 || c >= C || p->local_of[c] < 0)
        return MT_ERR(MT_EINVAL, "pipeline stage %d: action on micro-batch %d chunk %d is not "
                      "this stage's", p->stage, mb, c);
    const int tag = msg_tag(a, C);
    const int next_local = c + 1 < C && p->local_of[c + 1] >= 0;
    const int prev_local = c > 0 && p->local_of[c - 1] >= 0;
    int slot;
    mt_chunk_slot *sl;
    mt_backend *be = m ? m->be : NULL;
    switch (a->op) {
    case MT_SCHED_RECV_ACT:
        MT_CHECK(acquire(w, mb, c, &slot));
        if (w->dry) return MT_OK;
        sl = slot_at(m, p, mb, c);
        return msg_recv(p, be, sl->h[0], a->peer, tag);
    case MT_SCHED_FWD: {
        MT_CHECK(acquire(w, mb, c, &slot));
        int nslot = -1;
        if (next_local) MT_CHECK(acquire(w, mb, c + 1, &nslot));
        if (w->dry) return MT_OK;
        double weight;
        mt_mb_stats s1;
        MT_CHECK(fn(ctx, mb, p->tokens, &weight));
        MT_CHECK(mark(p, be));
        MT_CHECK(mt_model_chunk_fwd(m, p->local_of[c], slot, p->tokens, backward, weight, &s1));
        st[mb].aux_loss += s1.aux_loss;
        if (p->chunk[c].last) {
            st[mb].loss = s1.loss;
            st[mb].mtp_loss = s1.mtp_loss;
            st[mb].tokens = s1.tokens;
        }
        if (next_local) { /* the hand-over to the next chunk on this stage */
            sl = slot_at(m, p, mb, c);
            mt_chunk_slot *nx = &m->chunks[p->local_of[c + 1]].slots[nslot];
            MT_CHECK(be->copy(be, nx->h[0], sl->h[layers_of(p, c)], p->msg_bytes));
        }
        return mark(p, be);
    }
    case MT_SCHED_SEND_ACT:
        if (w->dry) return MT_OK;
        sl = slot_at(m, p, mb, c);
        if (!sl) return MT_ERR(MT_ESTATE, "pipeline: send_act of mb %d chunk %d before its "
                               "forward", mb, c);
        return msg_send(p, be, sl->h[layers_of(p, c)], a->peer, tag);
    case MT_SCHED_RECV_GRAD:
        if (w->dry) return MT_OK;
        sl = slot_at(m, p, mb, c);
        if (!sl) return MT_ERR(MT_ESTATE, "pipeline: recv_grad of mb %d chunk %d before its "
                               "forward", mb, c);
        return msg_recv(p, be, sl->dh, a->peer, tag);
    case MT_SCHED_BWD:
    case MT_SCHED_BWD_IN:
        if (!w->dry) {
            sl = slot_at(m, p, mb, c);
            if (!sl) return MT_ERR(MT_ESTATE, "pipeline: backward of mb %d chunk %d before its "
                                   "forward", mb, c);
            MT_CHECK(mark(p, be));
            if (a->op == MT_SCHED_BWD_IN && !p->bwd_whole)
                MT_CHECK(mt_model_chunk_bwd_in(m, p->local_of[c], p->slot_of[mb * C + c],
                                               &p->defer_of[mb * C + c]));
            else
                MT_CHECK(mt_model_chunk_bwd(m, p->local_of[c], p->slot_of[mb * C + c]));
            if (prev_local) {
                mt_chunk_slot *pv = slot_at(m, p, mb, c - 1);
                if (!pv) return MT_ERR(MT_ESTATE, "pipeline: mb %d chunk %d lost its slot", mb,
                                       c - 1);
                MT_CHECK(be->copy(be, pv->dh, sl->dh, p->msg_bytes));
            }
            MT_CHECK(mark(p, be));
        }
        /* the input gradient stays until SEND_GRAD takes it */
        if (c == 0 || prev_local) release(w, mb, c);
        return MT_OK;
    case MT_SCHED_BWD_W: {
        if (w->dry || p->bwd_whole) return MT_OK; /* bwd_whole: done with BWD_IN */
        int *h = &p->defer_of[mb * C + c];
        if (*h < 0) return MT_ERR(MT_ESTATE, "pipeline: weight gradients of mb %d chunk %d "
                                  "before its input gradients", mb, c);
        MT_CHECK(mark(p, be));
        MT_CHECK(mt_model_chunk_bwd_w(m, *h));
        *h = -1;
        return mark(p, be);
    }
    case MT_SCHED_SEND_GRAD:
        if (!w->dry) {
            sl = slot_at(m, p, mb, c);
            if (!sl) return MT_ERR(MT_ESTATE, "pipeline: send_grad of mb %d chunk %d without "
                                   "its backward", mb, c);
            MT_CHECK(msg_send(p, be, sl->dh, a->peer, tag));
        }
        release(w, mb, c);
        return MT_OK;
    }
    return MT_ERR(MT_EINVAL, "pipeline: unknown action %d", (int)a->op);
}

static void slots_reset(mt_pipeline *p)
{
    for (int i = 0; i < p->n_mb * p->C; i++) p->slot_of[i] = p->defer_of[i] = -1;
    if (p->busy) memset(p->busy, 0, (size_t)p->n_local * p->max_slots);
}

/* ---- plan ---------------------------------------------------------------------------- */

void mt_pipeline_free(mt_pipeline *p)
{
    if (!p) return;
    mt_schedule_free(&p->sched);
    free(p->chunk);
    free(p->local_ids);
    free(p->local_slots);
    free(p->local_chunks);
    free(p->local_of);
    free(p->slot_of);
    free(p->defer_of);
    free(p->busy);
    free(p->tokens);
    free(p->predicted_idle);
    free(p->measured_idle);
    free(p->mark_t);
    free(p->chunk_costs);
    memset(p, 0, sizeof *p);
}

int mt_pipeline_create(mt_pipeline *p, const mt_layout *l, const mt_model_config *c, int stage,
                       int n_mb, mt_comm *pp)
{
    memset(p, 0, sizeof *p);
    p->layout = *l;
    p->stage = stage;
    p->n_mb = n_mb;
    p->pp = pp;
    p->C = mt_layout_chunks(l);
    const int C = p->C;
    if (pp && mt_comm_size(pp) != l->pp)
        return MT_ERR(MT_EINVAL, "pipeline: the pp group has %d ranks, the layout %d",
                      mt_comm_size(pp), l->pp);
    /* collective over the group: every stage creates its plan at once, and
     * before anything that could fail on one stage alone */
    if (pp) {
        int ro = mt_comm_pipe_open(pp);
        if (ro < 0) return mt_err_wrap(ro, "pipeline: opening the pp group for messages");
    }
    int rc = mt_schedule_build(&p->sched, l, n_mb);
    if (rc < 0) return mt_err_wrap(rc, "pipeline: the schedule for %d micro-batches", n_mb);
    char err[256];
    rc = mt_schedule_check(&p->sched, err, sizeof err);
    if (rc < 0) {
        mt_pipeline_free(p);
        return MT_ERR(MT_EINVAL, "pipeline: the schedule table is invalid: %s", err);
    }
    p->chunk = calloc((size_t)C, sizeof *p->chunk);
    p->local_of = malloc((size_t)C * sizeof *p->local_of);
    p->local_ids = calloc((size_t)C, sizeof *p->local_ids);
    p->local_slots = calloc((size_t)C, sizeof *p->local_slots);
    p->local_chunks = calloc((size_t)C, sizeof *p->local_chunks);
    p->slot_of = malloc((size_t)n_mb * C * sizeof *p->slot_of);
    p->defer_of = malloc((size_t)n_mb * C * sizeof *p->defer_of);
    p->predicted_idle = calloc((size_t)l->pp, sizeof *p->predicted_idle);
    p->measured_idle = calloc((size_t)l->pp, sizeof *p->measured_idle);
    p->chunk_costs = calloc((size_t)C, sizeof *p->chunk_costs);
    /* marks: the step's begin and end, two per compute action at most */
    p->mark_t = malloc((2 + 2 * (size_t)p->sched.n_actions[stage]) * sizeof *p->mark_t);
    if (!p->chunk || !p->local_of || !p->local_ids || !p->local_slots || !p->local_chunks ||
        !p->slot_of || !p->defer_of || !p->predicted_idle || !p->measured_idle ||
        !p->chunk_costs || !p->mark_t) {
        mt_pipeline_free(p);
        return MT_ERR(MT_ENOMEM, "pipeline: out of memory");
    }
    for (int k = 0; k < C; k++) {
        mt_layout_chunk_layers(l, c, k, &p->chunk[k].layer_lo, &p->chunk[k].layer_hi);
        p->chunk[k].first = k == 0;
        p->chunk[k].last = k == C - 1;
        p->local_of[k] = -1;
        if (mt_layout_stage_of_chunk(l, k) == stage) {
            p->local_of[k] = p->n_local;
            p->local_ids[p->n_local] = k;
            p->local_chunks[p->n_local] = p->chunk[k];
            p->n_local++;
        }
    }
    /* slots: the most (mb, chunk) pairs the walk holds at once per chunk */
    int *held = calloc((size_t)C, sizeof *held);
    walk w = {p, 1, held, p->local_slots};
    rc = held ? MT_OK : MT_ERR(MT_ENOMEM, "pipeline: out of memory");
    slots_reset(p);
    for (int i = 0; rc == MT_OK && i < p->sched.n_actions[stage]; i++)
        rc = run_action(&w, NULL, &p->sched.actions[stage][i], 1, NULL, NULL, NULL);
    free(held);
    for (int i = 0; i < p->n_local; i++) {
        if (p->local_slots[i] < 1) p->local_slots[i] = 1;
        if (p->local_slots[i] > p->max_slots) p->max_slots = p->local_slots[i];
    }
    p->busy = calloc((size_t)(p->n_local > 0 ? p->n_local : 1) * p->max_slots, 1);
    p->last_idle = p->measured_bubble = NAN;
    for (int st = 0; st < l->pp; st++) p->measured_idle[st] = NAN;
    if (rc == MT_OK && !p->busy) rc = MT_ERR(MT_ENOMEM, "pipeline: out of memory");
    if (rc == MT_OK)
        rc = mt_schedule_predict(&p->sched, NULL, &p->predicted_bubble, p->predicted_idle);
    if (rc < 0) {
        mt_pipeline_free(p);
        return rc;
    }
    return MT_OK;
}

void mt_pipeline_model_opts(const mt_pipeline *p, mt_model_opts *o)
{
    o->n_chunks = p->n_local;
    o->chunks = p->local_chunks;
    o->chunk_ids = p->local_ids;
    o->chunk_slots = p->local_slots;
}

/* ---- step ---------------------------------------------------------------------------- */

static int prepare(mt_pipeline *p, mt_model *m)
{
    const size_t tok = (size_t)m->ctx.B * (m->ctx.T + 1) * sizeof *p->tokens;
    if (!p->tokens && !(p->tokens = malloc(tok)))
        return MT_ERR(MT_ENOMEM, "pipeline: out of memory");
    p->msg_bytes = (size_t)m->ctx.N * m->cfg.hidden_size * mt_act_size(m->be);
    if (m->n_chunks != p->n_local)
        return MT_ERR(MT_EINVAL, "pipeline stage %d: the model holds %d chunks, the plan %d",
                      p->stage, m->n_chunks, p->n_local);
    return MT_OK;
}

/* Validation: each micro-batch flows through the chunks in order (a stage
 * takes its chunks in ascending order per micro-batch: no cycle). */
static int forward_only(mt_pipeline *p, mt_model *m, int n_mb, mt_pipeline_batch_fn fn,
                        void *ctx, mt_mb_stats *st)
{
    mt_backend *be = m->be;
    for (int mb = 0; mb < n_mb; mb++)
        for (int i = 0; i < p->n_local; i++) {
            const int c = p->local_ids[i];
            mt_chunk_slot *sl = &m->chunks[i].slots[0];
            const mt_sched_action ra = {MT_SCHED_RECV_ACT, mb, c, -1};
            if (c > 0 && p->local_of[c - 1] < 0) {
                const int from = mt_layout_stage_of_chunk(&p->layout, c - 1);
                MT_CHECK(msg_recv(p, be, sl->h[0], from, msg_tag(&ra, p->C)));
            } else if (c > 0) {
                mt_chunk_slot *pv = &m->chunks[p->local_of[c - 1]].slots[0];
                MT_CHECK(be->copy(be, sl->h[0], pv->h[layers_of(p, c - 1)], p->msg_bytes));
            }
            double weight;
            mt_mb_stats s1;
            MT_CHECK(fn(ctx, mb, p->tokens, &weight));
            MT_CHECK(mt_model_chunk_fwd(m, i, 0, p->tokens, 0, weight, &s1));
            st[mb].aux_loss += s1.aux_loss;
            if (p->chunk[c].last) {
                st[mb].loss = s1.loss;
                st[mb].mtp_loss = s1.mtp_loss;
                st[mb].tokens = s1.tokens;
            }
            if (c + 1 < p->C && p->local_of[c + 1] < 0) {
                const mt_sched_action sa = {MT_SCHED_SEND_ACT, mb, c, -1};
                MT_CHECK(msg_send(p, be, sl->h[layers_of(p, c)],
                                  mt_layout_stage_of_chunk(&p->layout, c + 1), msg_tag(&sa, p->C)));
            }
        }
    return MT_OK;
}

/* The measured costs of the step (issue 17): the mean device time of each
 * compute action kind of each chunk of this stage, in seconds, summed over
 * the pp group (each chunk's costs come from its one stage, the others add
 * zeros: 4 doubles per chunk), then the table simulated with them. Marks
 * pair up with the stage's compute actions in table order. */
static int measure(mt_pipeline *p, mt_backend *be)
{
    const int n = p->n_marks, C = p->C;
    p->last_idle = p->measured_bubble = NAN;
    for (int st = 0; st < p->layout.pp; st++) p->measured_idle[st] = NAN;
    if (n < 2 || !be->marks_read) return MT_OK;
    MT_CHECK(be->marks_read(be, n, p->mark_t));
    double *sum = calloc((size_t)C * 8, sizeof *sum); /* [C][4] seconds, then [C][4] counts */
    if (!sum) return MT_ERR(MT_ENOMEM, "pipeline: out of memory");
    double busy = 0;
    int k = 1;
    for (int i = 0; i < p->sched.n_actions[p->stage]; i++) {
        const mt_sched_action *a = &p->sched.actions[p->stage][i];
        int kind = a->op == MT_SCHED_FWD ? 0 : a->op == MT_SCHED_BWD ? 1
                 : a->op == MT_SCHED_BWD_IN ? 2 : a->op == MT_SCHED_BWD_W ? 3 : -1;
        if (kind < 0 || (kind == 3 && p->bwd_whole)) continue;
        if (k + 1 >= n) break; /* cannot happen: every compute action marks twice */
        const double dt = p->mark_t[k + 1] - p->mark_t[k];
        k += 2;
        busy += dt;
        sum[a->chunk * 4 + kind] += dt;
        sum[C * 4 + a->chunk * 4 + kind] += 1;
    }
    const double span = p->mark_t[n - 1] - p->mark_t[0];
    /* the actions lie inside the span, one after the other on one clock:
     * in [0, 1] unless the marks are paired wrongly (test_trainer_pp) */
    p->last_idle = span > 0 ? 1 - busy / span : 0;
    for (int i = 0; i < C * 4; i++) sum[i] = sum[C * 4 + i] > 0 ? sum[i] / sum[C * 4 + i] : 0;
    int rc = MT_OK;
    if (p->pp && p->layout.pp > 1)
        rc = mt_comm_all_reduce(mt_comm_host(p->pp), sum, sum, C * 4, MT_COMM_F64, MT_COMM_SUM);
    else if (p->layout.pp > 1) { /* a test's lone stage: the others' costs are unknown */
        free(sum);
        return MT_OK;
    }
    for (int c = 0; rc == MT_OK && c < C; c++)
        p->chunk_costs[c] = (mt_sched_costs){sum[c * 4], sum[c * 4 + 1], sum[c * 4 + 2],
                                             sum[c * 4 + 3], 0};
    free(sum);
    if (rc < 0) return mt_err_wrap(rc, "pipeline: gathering the stages' measured costs");
    return mt_schedule_predict_chunks(&p->sched, p->chunk_costs, &p->measured_bubble,
                                      p->measured_idle);
}

/* The sends must be delivered before the step's collectives; then the
 * times of the step (train: the marks' idle and the measured costs). */
static int finish_step(mt_pipeline *p, mt_model *m, int rc, double t0, int train)
{
    const int rw = p->pp ? mt_comm_wait_sends(p->pp) : MT_OK;
    if (train && rc == MT_OK && rw == MT_OK) rc = mark(p, m->be);
    if (rc < 0) return rc;
    if (rw < 0) return rw;
    MT_CHECK(m->be->sync(m->be));
    p->last_busy_s = mt_now_s() - t0;
    if (train) MT_CHECK(measure(p, m->be));
    return MT_OK;
}

int mt_pipeline_forward(mt_pipeline *p, mt_model *m, int n_mb, mt_pipeline_batch_fn fn,
                        void *ctx, mt_mb_stats *st)
{
    MT_CHECK(prepare(p, m));
    memset(st, 0, (size_t)n_mb * sizeof *st);
    const double t0 = mt_now_s();
    p->n_marks = -1; /* validation: not timed */
    int rc = forward_only(p, m, n_mb, fn, ctx, st);
    return finish_step(p, m, rc, t0, 0);
}

int mt_pipeline_step(mt_pipeline *p, mt_model *m, mt_pipeline_batch_fn fn, void *ctx,
                     mt_mb_stats *st)
{
    MT_CHECK(prepare(p, m));
    memset(st, 0, (size_t)p->n_mb * sizeof *st);
    const double t0 = mt_now_s();
    walk w = {p, 0, NULL, NULL};
    p->n_marks = 0;
    MT_CHECK(mark(p, m->be));
    slots_reset(p);
    mt_model_defer_reset(m); /* nothing pending survives a failed step */
    int rc = MT_OK;
    for (int i = 0; rc == MT_OK && i < p->sched.n_actions[p->stage]; i++) {
        const mt_sched_action *a = &p->sched.actions[p->stage][i];
        rc = run_action(&w, m, a, 1, fn, ctx, st);
        if (rc < 0) {
            char s[96];
            mt_sched_action_format(a, s, sizeof s);
            rc = mt_err_wrap(rc, "pipeline stage %d, action %d (%s)", p->stage, i, s);
        }
    }
    return finish_step(p, m, rc, t0, 1);
}

int mt_pipeline_grad_sumsq(const mt_pipeline *p, mt_model *m, const unsigned char *keep,
                           mt_comm *dp, mt_comm *tp, float *scratch, double *sumsq)
{
    const int n = m->table.n, e = mt_model_embed_index(m);
    unsigned char *mask = malloc((size_t)(n > 0 ? n : 1));
    if (!mask) return MT_ERR(MT_ENOMEM, "pipeline: out of memory");
    for (int i = 0; i < n; i++) mask[i] = keep ? keep[i] : 1;
    if (m->embed_replica && e >= 0) mask[e] = 0; /* counted on the first stage */
    double sum = 0;
    int rc = mt_grad_owned_sumsq(m->be, m, mask, scratch, &sum);
    free(mask);
    MT_CHECK(rc);
    if (dp) MT_CHECK(mt_comm_all_reduce(mt_comm_host(dp), &sum, &sum, 1, MT_COMM_F64, MT_COMM_SUM));
    if (tp) MT_CHECK(mt_comm_all_reduce(mt_comm_host(tp), &sum, &sum, 1, MT_COMM_F64, MT_COMM_SUM));
    if (p->pp)
        MT_CHECK(mt_comm_all_reduce(mt_comm_host(p->pp), &sum, &sum, 1, MT_COMM_F64,
                                    MT_COMM_SUM));
    *sumsq = (double)(float)sum; /* an f32, as one rank's */
    return MT_OK;
}
