/* schedule.c - see schedule.h.
 *
 * Generators write each stage's list with three emitters (fwd, bwd, w) that
 * add the receive before and the send after a compute action whenever the
 * neighbouring chunk lives on another stage, so every generator gets the
 * communication right by construction and the checker proves it anyway.
 */
#include "engine/parallel/schedule.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

/* ---- the chunk placement (the layout's, for a table's pp / vpp / kind) ---- */

static mt_layout table_layout(const mt_schedule *s)
{
    mt_layout l;
    mt_layout_default(&l);
    l.pp = s->pp;
    l.vpp = s->vpp;
    l.schedule = s->kind;
    return l;
}

/* The chunk's place among its stage's chunks: 0 for the first. */
static int local_chunk(const mt_schedule *s, int c)
{
    if (s->kind == MT_PP_DUALPIPEV) return c < s->pp ? 0 : 1;
    return c / s->pp;
}

/* ---- building ----------------------------------------------------------------- */

typedef struct builder {
    mt_schedule *s;
    mt_layout l;
    int nc;      /* chunks */
    int stage;   /* the list being written */
    int cap;
    int failed;  /* allocation failure */
} builder;

static void push(builder *b, mt_sched_op op, int mb, int chunk, int peer)
{
    if (b->failed) return;
    int st = b->stage, n = b->s->n_actions[st];
    if (n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 64;
        mt_sched_action *a = realloc(b->s->actions[st], (size_t)cap * sizeof *a);
        if (!a) {
            b->failed = 1;
            return;
        }
        b->s->actions[st] = a;
        b->cap = cap;
    }
    b->s->actions[st][n] = (mt_sched_action){op, mb, chunk, peer};
    b->s->n_actions[st] = n + 1;
}

static int stage_of(const builder *b, int c) { return mt_layout_stage_of_chunk(&b->l, c); }

/* RECV_ACT (when the input comes from another stage), FWD, SEND_ACT (when
 * the output goes to another stage). */
static void emit_fwd(builder *b, int mb, int c)
{
    int st = stage_of(b, c);
    if (c > 0 && stage_of(b, c - 1) != st) push(b, MT_SCHED_RECV_ACT, mb, c, stage_of(b, c - 1));
    push(b, MT_SCHED_FWD, mb, c, -1);
    if (c < b->nc - 1 && stage_of(b, c + 1) != st)
        push(b, MT_SCHED_SEND_ACT, mb, c, stage_of(b, c + 1));
}

/* RECV_GRAD, the backward (BWD, or BWD_IN of the split), SEND_GRAD. */
static void emit_bwd(builder *b, mt_sched_op op, int mb, int c)
{
    int st = stage_of(b, c);
    if (c < b->nc - 1 && stage_of(b, c + 1) != st)
        push(b, MT_SCHED_RECV_GRAD, mb, c, stage_of(b, c + 1));
    push(b, op, mb, c, -1);
    if (c > 0 && stage_of(b, c - 1) != st) push(b, MT_SCHED_SEND_GRAD, mb, c, stage_of(b, c - 1));
}

/* One stage: forward through all chunks, backward back, per micro-batch. */
static void gen_one_stage(builder *b)
{
    for (int mb = 0; mb < b->s->n_mb; mb++) {
        for (int c = 0; c < b->nc; c++) emit_fwd(b, mb, c);
        for (int c = b->nc - 1; c >= 0; c--) emit_bwd(b, MT_SCHED_BWD, mb, c);
    }
}

/* 1F1B: stage s runs pp - s - 1 warm-up forwards (what the stages below it
 * need to fill the pipe), then alternates one forward and one backward,
 * then drains the remaining backwards. At most pp - s micro-batches are in
 * flight on stage s. */
static void gen_1f1b(builder *b, int s)
{
    int n = b->s->n_mb, warm = b->s->pp - s - 1;
    if (warm > n) warm = n;
    int f = 0, k = 0;
    while (f < warm) emit_fwd(b, f++, s);
    while (f < n) {
        emit_fwd(b, f++, s);
        emit_bwd(b, MT_SCHED_BWD, k++, s);
    }
    while (k < n) emit_bwd(b, MT_SCHED_BWD, k++, s);
}

/* Interleaved 1F1B (Megatron's ordering). Stage s holds chunks s, s + pp,
 * ..., s + (vpp - 1) pp. Its n_mb * vpp forward units are taken in groups of
 * pp micro-batches: pp micro-batches through its first chunk, the same pp
 * through its second, ..., then the next pp micro-batches; the backward
 * units run in the same grouping with the chunks reversed. Warm-up: the
 * forwards the rest of the pipe needs before this stage's first backward
 * can arrive, 2 (pp - s - 1) + (vpp - 1) pp (all of them when n_mb = pp);
 * then one forward and one backward unit alternately; then the rest of the
 * backwards. Needs n_mb % pp == 0. */
static void interleaved_unit(const builder *b, int s, int k, int forward, int *mb, int *c)
{
    int pp = b->s->pp, vpp = b->s->vpp, group = pp * vpp;
    int j = (k % group) / pp;
    if (!forward) j = vpp - 1 - j;
    *mb = (k / group) * pp + k % pp;
    *c = j * pp + s;
}

static void gen_interleaved(builder *b, int s)
{
    int pp = b->s->pp, total = b->s->n_mb * b->s->vpp;
    int warm = b->s->n_mb == pp ? total : 2 * (pp - s - 1) + (b->s->vpp - 1) * pp;
    if (warm > total) warm = total;
    int f = 0, k = 0, mb, c;
    for (; f < warm; f++) {
        interleaved_unit(b, s, f, 1, &mb, &c);
        emit_fwd(b, mb, c);
    }
    for (; f < total; f++, k++) {
        interleaved_unit(b, s, f, 1, &mb, &c);
        emit_fwd(b, mb, c);
        interleaved_unit(b, s, k, 0, &mb, &c);
        emit_bwd(b, MT_SCHED_BWD, mb, c);
    }
    for (; k < total; k++) {
        interleaved_unit(b, s, k, 0, &mb, &c);
        emit_bwd(b, MT_SCHED_BWD, mb, c);
    }
}

/* DualPipeV ("cut-in-half" DualPipe, V placement): stage s holds chunk
 * a = s (the way down) and chunk z = 2 pp - 1 - s (the way back up, the
 * last one with the loss on stage 0). Each chunk's forwards and backwards
 * take the micro-batches in order. Phases (P = pp, N = n_mb, W = the oldest
 * pending weight gradient):
 *   1. 2 (P - s - 1) x  F(a)                 fill the way down
 *   2. s + 1         x  F(a) F(z)            both legs in flight
 *   3. P - s - 1     x  Bin(z) W F(z)        zero bubble: the weight part
 *                                            fills the wait for gradients
 *   4. N - 2P + s + 1 x F(a)&B(z) F(z)&B(a)  steady: forward/backward pairs
 *                                            of the two chunks (the executor
 *                                            may overlap a pair's compute
 *                                            with the other's communication)
 *   5. P - s - 1     x  B(z) F(z)&B(a)       last forwards
 *   6. s + 1         x  B(z) B(a)            drain; the second half splits
 *                                            off the weight gradients
 *   7. P - s - 1     x  W Bin(a)
 *   8. s + 1         x  W                    pending weight gradients
 * Every chunk gets N forwards and N backwards; needs N >= 2P. */
typedef struct dpv_state {
    builder *b;
    int a, z;          /* the stage's chunks */
    int fa, fz, ba, bz; /* next micro-batch of each stream */
    int *wq, wh, wt;   /* pending weight gradients (mb, chunk) pairs, FIFO */
} dpv_state;

static void dpv_f(dpv_state *d, int chunk)
{
    emit_fwd(d->b, chunk == d->a ? d->fa++ : d->fz++, chunk);
}

static void dpv_b(dpv_state *d, int chunk, int split)
{
    int mb = chunk == d->a ? d->ba++ : d->bz++;
    emit_bwd(d->b, split ? MT_SCHED_BWD_IN : MT_SCHED_BWD, mb, chunk);
    if (split) {
        d->wq[2 * d->wt] = mb;
        d->wq[2 * d->wt + 1] = chunk;
        d->wt++;
    }
}

static void dpv_w(dpv_state *d)
{
    if (d->wh == d->wt) { /* cannot happen for the phase counts below */
        d->b->failed = 2;
        return;
    }
    push(d->b, MT_SCHED_BWD_W, d->wq[2 * d->wh], d->wq[2 * d->wh + 1], -1);
    d->wh++;
}

static void gen_dualpipev(builder *b, int s, int *wq)
{
    int P = b->s->pp, N = b->s->n_mb;
    dpv_state d = {b, s, 2 * P - 1 - s, 0, 0, 0, 0, wq, 0, 0};
    for (int i = 0; i < 2 * (P - s - 1); i++) dpv_f(&d, d.a);
    for (int i = 0; i < s + 1; i++) {
        dpv_f(&d, d.a);
        dpv_f(&d, d.z);
    }
    for (int i = 0; i < P - s - 1; i++) {
        dpv_b(&d, d.z, 1);
        dpv_w(&d);
        dpv_f(&d, d.z);
    }
    for (int i = 0; i < N - 2 * P + s + 1; i++) {
        dpv_f(&d, d.a);
        dpv_b(&d, d.z, 0);
        dpv_f(&d, d.z);
        dpv_b(&d, d.a, 0);
    }
    for (int i = 0; i < P - s - 1; i++) {
        dpv_b(&d, d.z, 0);
        dpv_f(&d, d.z);
        dpv_b(&d, d.a, 0);
    }
    /* Split the weight gradients off the second half of the drain: s + 1 of
     * its 2 (s + 1) backwards, starting on chunk z for odd s and on chunk a
     * for even s, so that the drain's own W tail is s + 1 long. */
    int h = (s + 1) / 2;
    for (int i = 0; i < s + 1; i++) {
        dpv_b(&d, d.z, i > h || (i == h && s % 2 == 1));
        dpv_b(&d, d.a, i >= h);
    }
    for (int i = 0; i < P - s - 1; i++) {
        dpv_w(&d);
        dpv_b(&d, d.a, 1);
    }
    while (d.wh < d.wt) dpv_w(&d);
}

void mt_schedule_free(mt_schedule *s)
{
    if (!s) return;
    if (s->actions)
        for (int i = 0; i < s->pp; i++) free(s->actions[i]);
    free(s->actions);
    free(s->n_actions);
    memset(s, 0, sizeof *s);
}

int mt_schedule_build(mt_schedule *s, const mt_layout *l, int n_mb)
{
    memset(s, 0, sizeof *s);
    const char *name = mt_pp_schedule_names[l->schedule];
    if (l->pp < 1 || l->vpp < 1)
        return MT_ERR(MT_EINVAL, "pipeline schedule: pp %d and vpp %d must be >= 1", l->pp, l->vpp);
    if (n_mb < 1)
        return MT_ERR(MT_EINVAL, "pipeline schedule %s: %d micro-batches; needs at least 1", name,
                      n_mb);
    if ((long long)n_mb * l->pp * l->vpp >= 1LL << 30)
        return MT_ERR(MT_EINVAL, "pipeline schedule %s: %d micro-batches x %d chunks is too many",
                      name, n_mb, l->pp * l->vpp);
    if (l->schedule == MT_PP_1F1B && l->vpp != 1)
        return MT_ERR(MT_EINVAL, "pipeline schedule 1f1b runs one chunk per stage, not vpp %d; "
                      "virtual stages need schedule interleaved", l->vpp);
    if (l->schedule == MT_PP_DUALPIPEV && l->vpp != 2)
        return MT_ERR(MT_EINVAL, "pipeline schedule dualpipev places 2 chunks per stage (a V), "
                      "not vpp %d", l->vpp);
    if (l->pp > 1 && l->schedule == MT_PP_INTERLEAVED && l->vpp > 1 && n_mb % l->pp != 0)
        return MT_ERR(MT_EINVAL, "pipeline schedule interleaved needs the micro-batches (%d) to be "
                      "a multiple of pp %d", n_mb, l->pp);
    if (l->pp > 1 && l->schedule == MT_PP_DUALPIPEV && n_mb < 2 * l->pp)
        return MT_ERR(MT_EINVAL, "pipeline schedule dualpipev needs at least 2 x pp = %d "
                      "micro-batches, not %d", 2 * l->pp, n_mb);

    s->pp = l->pp;
    s->vpp = l->vpp;
    s->n_mb = n_mb;
    s->kind = l->schedule;
    s->n_actions = calloc((size_t)s->pp, sizeof *s->n_actions);
    s->actions = calloc((size_t)s->pp, sizeof *s->actions);
    int *wq = malloc(2 * (size_t)n_mb * 2 * sizeof *wq); /* DualPipeV: <= 2 N pending */
    if (!s->n_actions || !s->actions || !wq) {
        free(wq);
        mt_schedule_free(s);
        return MT_ERR(MT_ENOMEM, "pipeline schedule: out of memory for pp %d", l->pp);
    }
    builder b = {s, table_layout(s), s->pp * s->vpp, 0, 0, 0};
    for (int st = 0; st < s->pp && !b.failed; st++) {
        b.stage = st;
        b.cap = 0;
        if (s->pp == 1) gen_one_stage(&b);
        else if (s->kind == MT_PP_1F1B || s->vpp == 1) gen_1f1b(&b, st); /* interleaved, 1 chunk */
        else if (s->kind == MT_PP_INTERLEAVED) gen_interleaved(&b, st);
        else gen_dualpipev(&b, st, wq);
    }
    free(wq);
    if (b.failed) {
        int internal = b.failed == 2;
        mt_schedule_free(s);
        return internal ? MT_ERR(MT_ESTATE, "pipeline schedule dualpipev: a weight gradient "
                                 "was scheduled before its input gradient (generator bug)")
                        : MT_ERR(MT_ENOMEM, "pipeline schedule: out of memory");
    }
    return MT_OK;
}

int mt_schedule_pair(const mt_schedule *s, int stage, int i)
{
    if (s->kind != MT_PP_DUALPIPEV || s->pp < 2 || stage < 0 || stage >= s->pp || i < 0 ||
        i >= s->n_actions[stage] || s->actions[stage][i].op != MT_SCHED_FWD)
        return -1;
    const mt_sched_action *a = s->actions[stage];
    for (int j = i + 1; j < s->n_actions[stage]; j++) {
        if (a[j].op >= MT_SCHED_SEND_ACT) continue; /* messages between the two */
        return a[j].op == MT_SCHED_BWD && a[j].chunk != a[i].chunk ? j : -1;
    }
    return -1;
}

/* ---- names and tags --------------------------------------------------------------- */

const char *mt_sched_op_name(mt_sched_op op)
{
    static const char *const names[MT_SCHED_N_OPS] = {
        "F", "B", "Bi", "W", "send_act", "recv_act", "send_grad", "recv_grad"};
    return (unsigned)op < MT_SCHED_N_OPS ? names[op] : "?";
}

static int is_comm(mt_sched_op op) { return op >= MT_SCHED_SEND_ACT && op <= MT_SCHED_RECV_GRAD; }

int mt_sched_msg_tag(const mt_sched_action *a, int n_chunks)
{
    int boundary, grad;
    switch (a->op) {
    case MT_SCHED_SEND_ACT: boundary = a->chunk; grad = 0; break;
    case MT_SCHED_RECV_ACT: boundary = a->chunk - 1; grad = 0; break;
    case MT_SCHED_SEND_GRAD: boundary = a->chunk - 1; grad = 1; break;
    case MT_SCHED_RECV_GRAD: boundary = a->chunk; grad = 1; break;
    default: return -1;
    }
    return 2 * (a->mb * n_chunks + boundary) + grad;
}

void mt_sched_action_format(const mt_sched_action *a, char *buf, size_t cap)
{
    if (is_comm(a->op))
        snprintf(buf, cap, "%s mb=%d chunk=%d peer=%d", mt_sched_op_name(a->op), a->mb, a->chunk,
                 a->peer);
    else
        snprintf(buf, cap, "%s mb=%d chunk=%d", mt_sched_op_name(a->op), a->mb, a->chunk);
}

/* ---- running a table ---------------------------------------------------------------- */

void mt_sched_costs_default(mt_sched_costs *c)
{
    c->f = 1;
    c->b = 2;
    c->b_in = 1;
    c->w = 1;
    c->p2p = 0;
}

static double cost_of(const mt_sched_costs *c, mt_sched_op op)
{
    switch (op) {
    case MT_SCHED_FWD: return c->f;
    case MT_SCHED_BWD: return c->b;
    case MT_SCHED_BWD_IN: return c->b_in;
    case MT_SCHED_BWD_W: return c->w;
    default: return 0;
    }
}

/* Runs every stage in table order under the execution model (non-blocking
 * sends, blocking receives), with times when `start` / `end` are given.
 * A receive whose message was never sent stops its stage; when no stage
 * can move and some are not done, the table deadlocks: MT_EINVAL with each
 * stuck stage's waiting action in err. Needs every tag in range (the
 * structural checks come first). */
static int run_stages(const mt_schedule *s, const mt_sched_costs *c, int per_chunk, double **start,
                      double **end, double *clock, char *err, size_t cap)
{
    int nc = s->pp * s->vpp;
    size_t ntag = 2 * (size_t)s->n_mb * nc;
    double *sent = malloc(ntag * sizeof *sent);
    int *pos = calloc((size_t)s->pp, sizeof *pos);
    if (!sent || !pos) {
        free(sent);
        free(pos);
        snprintf(err, cap, "out of memory");
        return MT_ENOMEM;
    }
    for (size_t i = 0; i < ntag; i++) sent[i] = -1;
    for (int st = 0; st < s->pp; st++) clock[st] = 0;
    for (int moved = 1; moved;) {
        moved = 0;
        for (int st = 0; st < s->pp; st++) {
            for (; pos[st] < s->n_actions[st]; pos[st]++) {
                const mt_sched_action *a = &s->actions[st][pos[st]];
                double t0 = clock[st], t1 = t0;
                if (a->op == MT_SCHED_RECV_ACT || a->op == MT_SCHED_RECV_GRAD) {
                    double at = sent[mt_sched_msg_tag(a, nc)];
                    if (at < 0) break; /* blocks until the peer sends */
                    if (at + c[0].p2p > t1) t1 = at + c[0].p2p;
                } else if (is_comm(a->op)) {
                    sent[mt_sched_msg_tag(a, nc)] = t0;
                } else {
                    t1 = t0 + cost_of(per_chunk ? &c[a->chunk] : c, a->op);
                }
                clock[st] = t1;
                if (start) start[st][pos[st]] = t0;
                if (end) end[st][pos[st]] = t1;
                moved = 1;
            }
        }
    }
    int rc = MT_OK;
    size_t len = 0;
    for (int st = 0; st < s->pp; st++) {
        if (pos[st] == s->n_actions[st]) continue;
        char what[96];
        mt_sched_action_format(&s->actions[st][pos[st]], what, sizeof what);
        if (rc == MT_OK) len = (size_t)snprintf(err, cap, "deadlock:");
        rc = MT_EINVAL;
        if (len < cap)
            len += (size_t)snprintf(err + len, cap - len, " stage %d waits at action %d (%s);", st,
                                    pos[st], what);
    }
    free(sent);
    free(pos);
    return rc;
}

/* ---- the checker ------------------------------------------------------------------ */

#define FAIL(...)                                                                          \
    do {                                                                                   \
        snprintf(err, cap, __VA_ARGS__);                                                   \
        goto done;                                                                         \
    } while (0)

int mt_schedule_check(const mt_schedule *s, char *err, size_t cap)
{
    char scratch[512]; /* err NULL: the message still reaches mt_errmsg() */
    if (!err || cap == 0) {
        err = scratch;
        cap = sizeof scratch;
    }
    err[0] = '\0';
    if (!s || s->pp < 1 || s->vpp < 1 || s->n_mb < 1 || !s->n_actions || !s->actions ||
        (unsigned)s->kind > MT_PP_DUALPIPEV) {
        snprintf(err, cap, "not a schedule (pp, vpp, n_mb must be >= 1, lists present)");
        return MT_ERR(MT_EINVAL, "pipeline schedule: %s", err);
    }
    if (s->kind == MT_PP_DUALPIPEV && s->vpp != 2) {
        snprintf(err, cap, "dualpipev with vpp %d (the V needs 2 chunks per stage)", s->vpp);
        return MT_ERR(MT_EINVAL, "pipeline schedule: %s", err);
    }
    const mt_layout l = table_layout(s);
    const int nc = s->pp * s->vpp, N = s->n_mb;
    const size_t nu = (size_t)N * nc; /* (mb, chunk) units */
    /* at[op][mb * nc + c]: index of that action in its chunk's stage list */
    int *at = malloc(MT_SCHED_N_OPS * nu * sizeof *at);
    double *clock = malloc((size_t)s->pp * sizeof *clock);
    int rc = MT_EINVAL;
    if (!at || !clock) {
        snprintf(err, cap, "out of memory");
        rc = MT_ENOMEM;
        goto done;
    }
    for (size_t i = 0; i < MT_SCHED_N_OPS * nu; i++) at[i] = -1;
#define AT(op, mb, c) at[(size_t)(op) * nu + (size_t)(mb) * nc + (c)]

    /* every action: known op, in range, on its chunk's stage, right peer, once */
    for (int st = 0; st < s->pp; st++) {
        if (s->n_actions[st] < 0 || (s->n_actions[st] > 0 && !s->actions[st]))
            FAIL("stage %d: no action list", st);
        for (int i = 0; i < s->n_actions[st]; i++) {
            const mt_sched_action *a = &s->actions[st][i];
            char what[96];
            mt_sched_action_format(a, what, sizeof what);
            if ((unsigned)a->op >= MT_SCHED_N_OPS)
                FAIL("stage %d action %d: unknown op %d", st, i, (int)a->op);
            if (a->mb < 0 || a->mb >= N || a->chunk < 0 || a->chunk >= nc)
                FAIL("stage %d action %d (%s): mb must be in [0, %d), chunk in [0, %d)", st, i,
                     what, N, nc);
            int c = a->chunk, home = mt_layout_stage_of_chunk(&l, c);
            if (home != st)
                FAIL("stage %d action %d (%s): chunk %d runs on stage %d", st, i, what, c, home);
            int want = -1; /* the peer this action must name */
            if (a->op == MT_SCHED_SEND_ACT || a->op == MT_SCHED_RECV_GRAD) {
                if (c == nc - 1)
                    FAIL("stage %d action %d (%s): the last chunk's output stays on its stage "
                         "(head and loss)", st, i, what);
                want = mt_layout_stage_of_chunk(&l, c + 1);
            } else if (a->op == MT_SCHED_RECV_ACT || a->op == MT_SCHED_SEND_GRAD) {
                if (c == 0)
                    FAIL("stage %d action %d (%s): chunk 0's input is the embedding's, on its "
                         "stage", st, i, what);
                want = mt_layout_stage_of_chunk(&l, c - 1);
            }
            if (is_comm(a->op) && want == st)
                FAIL("stage %d action %d (%s): chunks %d and %d share stage %d, so the %s is "
                     "handed over locally, without a message", st, i, what,
                     a->op == MT_SCHED_SEND_ACT || a->op == MT_SCHED_RECV_GRAD ? c : c - 1,
                     a->op == MT_SCHED_SEND_ACT || a->op == MT_SCHED_RECV_GRAD ? c + 1 : c, st,
                     a->op == MT_SCHED_SEND_ACT || a->op == MT_SCHED_RECV_ACT ? "activation"
                                                                              : "gradient");
            if (a->peer != want)
                FAIL("stage %d action %d (%s): peer must be %d", st, i, what, want);
            int *slot = &AT(a->op, a->mb, c);
            if (*slot >= 0)
                FAIL("stage %d action %d (%s): a second %s of mb %d chunk %d (the first is "
                     "action %d)", st, i, what, mt_sched_op_name(a->op), a->mb, c, *slot);
            *slot = i;
        }
    }

    /* every (mb, chunk): one forward, one backward (whole or split), in order,
     * fed and followed by the right messages or local hand-overs */
    for (int mb = 0; mb < N; mb++)
        for (int c = 0; c < nc; c++) {
            int st = mt_layout_stage_of_chunk(&l, c);
            int f = AT(MT_SCHED_FWD, mb, c), bw = AT(MT_SCHED_BWD, mb, c);
            int bi = AT(MT_SCHED_BWD_IN, mb, c), w = AT(MT_SCHED_BWD_W, mb, c);
            if (f < 0) FAIL("mb %d chunk %d: no forward (on stage %d)", mb, c, st);
            if (bw >= 0 && (bi >= 0 || w >= 0))
                FAIL("mb %d chunk %d: both a whole backward (stage %d action %d) and a split "
                     "one", mb, c, st, bw);
            if (bw < 0 && (bi < 0 || w < 0))
                FAIL("mb %d chunk %d: no backward on stage %d (a whole B, or Bi and W; has Bi "
                     "%d, W %d)", mb, c, st, bi, w);
            int back = bw >= 0 ? bw : bi; /* the part that yields the input gradient */
            if (back < f)
                FAIL("mb %d chunk %d: stage %d runs the backward (action %d) before the "
                     "forward (action %d)", mb, c, st, back, f);
            if (bw < 0 && w < bi)
                FAIL("mb %d chunk %d: stage %d runs W (action %d) before Bi (action %d)", mb, c,
                     st, w, bi);
            if (c > 0) {
                int prev = mt_layout_stage_of_chunk(&l, c - 1);
                if (prev != st) {
                    int r = AT(MT_SCHED_RECV_ACT, mb, c), sg = AT(MT_SCHED_SEND_GRAD, mb, c);
                    if (r < 0 || r > f)
                        FAIL("mb %d chunk %d: stage %d needs recv_act from stage %d before its "
                             "forward (action %d); %s", mb, c, st, prev, f,
                             r < 0 ? "there is none" : "it comes after");
                    if (AT(MT_SCHED_SEND_ACT, mb, c - 1) < 0)
                        FAIL("mb %d chunk %d: stage %d waits for an activation that stage %d "
                             "never sends (no send_act of chunk %d)", mb, c, st, prev, c - 1);
                    if (sg < 0 || sg < back)
                        FAIL("mb %d chunk %d: stage %d must send_grad to stage %d after its "
                             "backward (action %d); %s", mb, c, st, prev, back,
                             sg < 0 ? "there is none" : "it comes before");
                } else {
                    int pf = AT(MT_SCHED_FWD, mb, c - 1);
                    int pb = AT(MT_SCHED_BWD, mb, c - 1) >= 0 ? AT(MT_SCHED_BWD, mb, c - 1)
                                                              : AT(MT_SCHED_BWD_IN, mb, c - 1);
                    if (pf >= 0 && pf > f)
                        FAIL("mb %d: stage %d runs chunk %d's forward (action %d) before chunk "
                             "%d's (action %d), whose output it takes locally", mb, st, c, f,
                             c - 1, pf);
                    if (pb >= 0 && pb < back)
                        FAIL("mb %d: stage %d runs chunk %d's backward (action %d) before chunk "
                             "%d's (action %d), whose gradient it takes locally", mb, st, c - 1,
                             pb, c, back);
                }
            }
            if (c < nc - 1 && mt_layout_stage_of_chunk(&l, c + 1) != st) {
                int next = mt_layout_stage_of_chunk(&l, c + 1);
                int sa = AT(MT_SCHED_SEND_ACT, mb, c), rg = AT(MT_SCHED_RECV_GRAD, mb, c);
                if (sa < 0 || sa < f)
                    FAIL("mb %d chunk %d: stage %d must send_act to stage %d after its forward "
                         "(action %d); %s", mb, c, st, next, f,
                         sa < 0 ? "there is none" : "it comes before");
                if (rg < 0 || rg > back)
                    FAIL("mb %d chunk %d: stage %d needs recv_grad from stage %d before its "
                         "backward (action %d); %s", mb, c, st, next, back,
                         rg < 0 ? "there is none" : "it comes after");
                if (AT(MT_SCHED_SEND_GRAD, mb, c + 1) < 0)
                    FAIL("mb %d chunk %d: stage %d waits for a gradient that stage %d never "
                         "sends (no send_grad of chunk %d)", mb, c, st, next, c + 1);
            }
        }
#undef AT

    /* every message is now sent once and received once: run it */
    mt_sched_costs zero = {0, 0, 0, 0, 0};
    rc = run_stages(s, &zero, 0, NULL, NULL, clock, err, cap);
    goto out;
done:
    if (rc == MT_OK) rc = MT_EINVAL;
out:
    free(at);
    free(clock);
    if (rc != MT_OK) return MT_ERR(rc, "pipeline schedule: %s", err);
    return MT_OK;
}
#undef FAIL

/* ---- simulation -------------------------------------------------------------------- */

void mt_sched_sim_free(mt_sched_sim *sim)
{
    if (!sim) return;
    for (int st = 0; st < sim->pp; st++) {
        if (sim->start) free(sim->start[st]);
        if (sim->end) free(sim->end[st]);
    }
    free(sim->start);
    free(sim->end);
    free(sim->busy);
    free(sim->idle);
    free(sim->peak_in_flight);
    memset(sim, 0, sizeof *sim);
}

int mt_schedule_peak_in_flight(const mt_schedule *s, int *peak)
{
    for (int st = 0; st < s->pp; st++) {
        int live = 0;
        peak[st] = 0;
        for (int i = 0; i < s->n_actions[st]; i++) {
            mt_sched_op op = s->actions[st][i].op;
            if (op == MT_SCHED_FWD && ++live > peak[st]) peak[st] = live;
            if (op == MT_SCHED_BWD || op == MT_SCHED_BWD_W) live--;
        }
    }
    return MT_OK;
}

/* c: one cost set for every chunk, or (per_chunk) one per chunk [pp * vpp],
 * p2p taken from c[0]. */
static int simulate(const mt_schedule *s, const mt_sched_costs *c, int per_chunk,
                    mt_sched_sim *out)
{
    memset(out, 0, sizeof *out);
    const int nc = per_chunk ? s->pp * s->vpp : 1;
    for (int k = 0; k < nc; k++)
        if (!(c[k].f >= 0 && c[k].b >= 0 && c[k].b_in >= 0 && c[k].w >= 0 && c[k].p2p >= 0))
            return MT_ERR(MT_EINVAL, "pipeline simulation: costs must be >= 0 (chunk %d: F %g "
                          "B %g Bi %g W %g p2p %g)", k, c[k].f, c[k].b, c[k].b_in, c[k].w,
                          c[k].p2p);
    char err[512];
    MT_CHECK(mt_schedule_check(s, err, sizeof err));
    out->pp = s->pp;
    out->busy = calloc((size_t)s->pp, sizeof *out->busy);
    out->idle = calloc((size_t)s->pp, sizeof *out->idle);
    out->start = calloc((size_t)s->pp, sizeof *out->start);
    out->end = calloc((size_t)s->pp, sizeof *out->end);
    out->peak_in_flight = calloc((size_t)s->pp, sizeof *out->peak_in_flight);
    double *clock = calloc((size_t)s->pp, sizeof *clock);
    int ok = out->busy && out->idle && out->start && out->end && out->peak_in_flight && clock;
    for (int st = 0; ok && st < s->pp; st++) {
        size_t n = s->n_actions[st] ? (size_t)s->n_actions[st] : 1;
        out->start[st] = malloc(n * sizeof(double));
        out->end[st] = malloc(n * sizeof(double));
        ok = out->start[st] && out->end[st];
    }
    if (!ok) {
        free(clock);
        mt_sched_sim_free(out);
        return MT_ERR(MT_ENOMEM, "pipeline simulation: out of memory");
    }
    int rc = run_stages(s, c, per_chunk, out->start, out->end, clock, err, sizeof err);
    if (rc != MT_OK) { /* the checker ran the same model: cannot happen */
        free(clock);
        mt_sched_sim_free(out);
        return MT_ERR(rc, "pipeline simulation: %s", err);
    }
    double idle_sum = 0;
    for (int st = 0; st < s->pp; st++) {
        if (clock[st] > out->step) out->step = clock[st];
        for (int i = 0; i < s->n_actions[st]; i++) {
            const mt_sched_action *a = &s->actions[st][i];
            out->busy[st] += cost_of(per_chunk ? &c[a->chunk] : c, a->op);
        }
    }
    for (int st = 0; st < s->pp; st++) {
        out->idle[st] = out->step - out->busy[st];
        idle_sum += out->idle[st];
    }
    out->bubble = out->step > 0 ? idle_sum / (s->pp * out->step) : 0;
    free(clock);
    return mt_schedule_peak_in_flight(s, out->peak_in_flight);
}

int mt_schedule_simulate(const mt_schedule *s, const mt_sched_costs *c, mt_sched_sim *out)
{
    mt_sched_costs def;
    if (!c) {
        mt_sched_costs_default(&def);
        c = &def;
    }
    return simulate(s, c, 0, out);
}

int mt_schedule_simulate_chunks(const mt_schedule *s, const mt_sched_costs *chunk_costs,
                                mt_sched_sim *out)
{
    return simulate(s, chunk_costs, 1, out);
}

static int predict(const mt_schedule *s, const mt_sched_costs *c, int per_chunk, double *bubble,
                   double *idle_frac)
{
    mt_sched_sim sim;
    MT_CHECK(simulate(s, c, per_chunk, &sim));
    *bubble = sim.bubble;
    if (idle_frac)
        for (int st = 0; st < s->pp; st++)
            idle_frac[st] = sim.step > 0 ? sim.idle[st] / sim.step : 0;
    mt_sched_sim_free(&sim);
    return MT_OK;
}

int mt_schedule_predict(const mt_schedule *s, const mt_sched_costs *c, double *bubble,
                        double *idle_frac)
{
    mt_sched_costs def;
    if (!c) {
        mt_sched_costs_default(&def);
        c = &def;
    }
    return predict(s, c, 0, bubble, idle_frac);
}

int mt_schedule_predict_chunks(const mt_schedule *s, const mt_sched_costs *chunk_costs,
                               double *bubble, double *idle_frac)
{
    return predict(s, chunk_costs, 1, bubble, idle_frac);
}

/* ---- the timeline ---------------------------------------------------------------- */

static int print(FILE *f, const mt_schedule *s, const mt_sched_costs *c, int per_chunk,
                 double unit)
{
    if (unit <= 0) {
        unit = 0;
        for (int ci = 0; ci < (per_chunk ? s->pp * s->vpp : 1); ci++) {
            const double k[4] = {c[ci].f, c[ci].b, c[ci].b_in, c[ci].w};
            for (int i = 0; i < 4; i++)
                if (k[i] > 0 && (unit == 0 || k[i] < unit)) unit = k[i];
        }
        if (unit == 0) unit = 1;
    }
    mt_sched_sim sim;
    MT_CHECK(simulate(s, c, per_chunk, &sim));
    int digits = 1;
    for (int m = s->n_mb - 1; m >= 10; m /= 10) digits++;
    const int cw = 1 + digits;
    const long ncell = (long)ceil(sim.step / unit - 1e-9);
    char *row = malloc((size_t)ncell * cw + 1);
    if (!row) {
        mt_sched_sim_free(&sim);
        return MT_ERR(MT_ENOMEM, "pipeline timeline: out of memory");
    }
    if (!per_chunk)
        fprintf(f, "schedule %s: pp %d, vpp %d, %d micro-batches; costs per chunk F %g B %g Bi "
                "%g W %g p2p %g; one cell = %g\n", mt_pp_schedule_names[s->kind], s->pp, s->vpp,
                s->n_mb, c->f, c->b, c->b_in, c->w, c->p2p, unit);
    else {
        fprintf(f, "schedule %s: pp %d, vpp %d, %d micro-batches; p2p %g; one cell = %g; costs "
                "of each chunk (F B Bi W):", mt_pp_schedule_names[s->kind], s->pp, s->vpp,
                s->n_mb, c[0].p2p, unit);
        for (int ci = 0; ci < s->pp * s->vpp; ci++)
            fprintf(f, "%s %d: %g %g %g %g", ci ? ";" : "", ci, c[ci].f, c[ci].b, c[ci].b_in,
                    c[ci].w);
        fprintf(f, "\n");
    }
    for (int st = 0; st < s->pp; st++) {
        memset(row, '.', (size_t)ncell * cw);
        row[(size_t)ncell * cw] = '\0';
        for (int i = 0; i < s->n_actions[st]; i++) {
            const mt_sched_action *a = &s->actions[st][i];
            if (is_comm(a->op)) continue;
            long c0 = lround(sim.start[st][i] / unit), c1 = lround(sim.end[st][i] / unit);
            if (c1 == c0 && sim.end[st][i] > sim.start[st][i]) c1 = c0 + 1;
            char letter = a->op == MT_SCHED_FWD ? 'F' : a->op == MT_SCHED_BWD_W ? 'W' : 'B';
            if (local_chunk(s, a->chunk) > 0) letter = (char)(letter - 'A' + 'a');
            for (long k = c0; k < c1 && k < ncell; k++) {
                char cell[16];
                snprintf(cell, sizeof cell, "%c%-*d", letter, digits, a->mb % 1000000);
                memcpy(row + k * cw, cell, (size_t)cw);
            }
        }
        fprintf(f, "stage %-2d |%s| idle %5.1f%%  peak %d\n", st, row,
                sim.step > 0 ? 100.0 * sim.idle[st] / sim.step : 0.0, sim.peak_in_flight[st]);
    }
    fprintf(f, "step %g, bubble %.1f%% (idle / (pp x step)); F/B/W: forward / backward (input "
            "part when a W follows) / weight part; lower case: the stage's later chunks\n",
            sim.step, 100.0 * sim.bubble);
    free(row);
    mt_sched_sim_free(&sim);
    return MT_OK;
}

int mt_schedule_print(FILE *f, const mt_schedule *s, const mt_sched_costs *c, double unit)
{
    mt_sched_costs def;
    if (!c) {
        mt_sched_costs_default(&def);
        c = &def;
    }
    return print(f, s, c, 0, unit);
}

int mt_schedule_print_chunks(FILE *f, const mt_schedule *s, const mt_sched_costs *chunk_costs,
                             double unit)
{
    return print(f, s, chunk_costs, 1, unit);
}
