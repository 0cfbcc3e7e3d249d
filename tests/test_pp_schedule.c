/* test_pp_schedule.c - pipeline schedule tables as specifications: every
 * generated table passes the checker, the checker refuses hand-broken
 * tables, and the simulator reproduces the known bubble formulas (costs per
 * chunk: F = 1, B = 2, Bi = W = 1 unless a test says otherwise). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/mt_status.h"
#include "engine/parallel/schedule.h"
#include "test_util.h"

static mt_layout layout_of(int pp, int vpp, mt_pp_schedule kind)
{
    mt_layout l;
    mt_layout_default(&l);
    l.pp = pp;
    l.vpp = vpp;
    l.schedule = kind;
    return l;
}

static void build_ok(mt_schedule *s, int pp, int vpp, mt_pp_schedule kind, int n_mb)
{
    mt_layout l = layout_of(pp, vpp, kind);
    int rc = mt_schedule_build(s, &l, n_mb);
    if (rc != MT_OK) fprintf(stderr, "pp %d vpp %d n_mb %d: %s\n", pp, vpp, n_mb, mt_errmsg());
    assert_int_equal(rc, MT_OK);
}

static void check_ok(const mt_schedule *s)
{
    char err[1024];
    int rc = mt_schedule_check(s, err, sizeof err);
    if (rc != MT_OK)
        fprintf(stderr, "%s pp %d vpp %d n_mb %d: %s\n", mt_pp_schedule_names[s->kind], s->pp,
                s->vpp, s->n_mb, err);
    assert_int_equal(rc, MT_OK);
}

/* The checker's verdict on a (broken) table: MT_EINVAL and a message with `want`. */
static void check_refuses(const mt_schedule *s, const char *want)
{
    char err[1024];
    assert_int_equal(mt_schedule_check(s, err, sizeof err), MT_EINVAL);
    if (!strstr(err, want)) fprintf(stderr, "expected \"%s\" in: %s\n", want, err);
    assert_non_null(strstr(err, want));
    assert_non_null(strstr(mt_errmsg(), want));
}

static double bubble_of(const mt_schedule *s, const mt_sched_costs *c)
{
    double b = -1;
    assert_int_equal(mt_schedule_predict(s, c, &b, NULL), MT_OK);
    return b;
}

static int count_op(const mt_schedule *s, int stage, mt_sched_op op)
{
    int n = 0;
    for (int i = 0; i < s->n_actions[stage]; i++) n += s->actions[stage][i].op == op;
    return n;
}

/* ---- every generated table is valid ------------------------------------------------ */

static void test_every_generated_table_passes_the_checker(void **state)
{
    (void)state;
    int tables = 0;
    for (int pp = 1; pp <= 8; pp++)
        for (int n = 1; n <= 24; n++) {
            mt_schedule s;
            build_ok(&s, pp, 1, MT_PP_1F1B, n);
            check_ok(&s);
            mt_schedule_free(&s);
            tables++;
            for (int vpp = 1; vpp <= 4; vpp++)
                if (n % pp == 0 || vpp == 1) {
                    build_ok(&s, pp, vpp, MT_PP_INTERLEAVED, n);
                    check_ok(&s);
                    mt_schedule_free(&s);
                    tables++;
                }
            if (pp == 1 || n >= 2 * pp) {
                build_ok(&s, pp, 2, MT_PP_DUALPIPEV, n);
                check_ok(&s);
                mt_schedule_free(&s);
                tables++;
            }
        }
    assert_true(tables > 300);
}

static void test_every_chunk_runs_every_micro_batch_once_forward_and_backward(void **state)
{
    /* independent of the checker: the compute counts per stage */
    (void)state;
    mt_schedule s;
    build_ok(&s, 4, 2, MT_PP_DUALPIPEV, 10);
    for (int st = 0; st < 4; st++) {
        assert_int_equal(count_op(&s, st, MT_SCHED_FWD), 2 * 10);
        assert_int_equal(count_op(&s, st, MT_SCHED_BWD) + count_op(&s, st, MT_SCHED_BWD_IN),
                         2 * 10);
        assert_int_equal(count_op(&s, st, MT_SCHED_BWD_IN), count_op(&s, st, MT_SCHED_BWD_W));
        /* DualPipeV splits the backward where it fills bubbles: each stage
         * has pp - 1 - st (phase 3) + st + 1 (drain) + pp - 1 - st (phase 7) */
        assert_int_equal(count_op(&s, st, MT_SCHED_BWD_IN), 2 * 4 - 1 - st);
        for (int i = 0; i < s.n_actions[st]; i++) {
            const mt_sched_action *a = &s.actions[st][i];
            /* V placement: stage st holds chunks st and 2 pp - 1 - st */
            assert_true(a->chunk == st || a->chunk == 7 - st);
        }
    }
    /* the turn of the V: chunk 3 -> 4 on stage 3 is local, no message */
    for (int i = 0; i < s.n_actions[3]; i++) {
        const mt_sched_action *a = &s.actions[3][i];
        /* chunk 3 talks to chunk 2, chunk 4 to chunk 5: both on stage 2 */
        if (a->op >= MT_SCHED_SEND_ACT) assert_int_equal(a->peer, 2);
        assert_false(a->op == MT_SCHED_SEND_ACT && a->chunk == 3);
        assert_false(a->op == MT_SCHED_RECV_GRAD && a->chunk == 3);
    }
    /* the last chunk (head, loss) is on stage 0 and neither sends its output
     * nor receives its output gradient */
    for (int i = 0; i < s.n_actions[0]; i++) {
        const mt_sched_action *a = &s.actions[0][i];
        assert_false((a->op == MT_SCHED_SEND_ACT || a->op == MT_SCHED_RECV_GRAD) && a->chunk == 7);
        assert_false((a->op == MT_SCHED_RECV_ACT || a->op == MT_SCHED_SEND_GRAD) && a->chunk == 0);
    }
    mt_schedule_free(&s);
}

static void test_dualpipev_pairs_forward_and_backward_of_its_two_chunks_when_steady(
    void **state)
{
    /* phase 4: N - 2 pp + st + 1 rounds of F(a)&B(z), F(z)&B(a); phase 5:
     * pp - st - 1 of B(z), F(z)&B(a) */
    (void)state;
    const int P = 4, N = 10;
    mt_schedule s;
    build_ok(&s, P, 2, MT_PP_DUALPIPEV, N);
    for (int st = 0; st < P; st++) {
        int pairs = 0;
        for (int i = 0; i < s.n_actions[st]; i++) {
            int j = mt_schedule_pair(&s, st, i);
            if (j < 0) continue;
            pairs++;
            const mt_sched_action *f = &s.actions[st][i], *b = &s.actions[st][j];
            assert_int_equal(f->op, MT_SCHED_FWD);
            assert_int_equal(b->op, MT_SCHED_BWD);
            assert_int_not_equal(f->chunk, b->chunk);
            /* the forward runs a later micro-batch than the backward */
            assert_true(f->mb > b->mb);
        }
        assert_int_equal(pairs, 2 * (N - 2 * P + st + 1) + (P - st - 1));
    }
    mt_schedule_free(&s);
    build_ok(&s, P, 1, MT_PP_1F1B, N); /* no pairs outside DualPipeV */
    for (int i = 0; i < s.n_actions[0]; i++) assert_int_equal(mt_schedule_pair(&s, 0, i), -1);
    mt_schedule_free(&s);
}

static void test_one_stage_runs_forward_then_backward_per_micro_batch(void **state)
{
    /* pp = 1: the trainer's order, F then B per micro-batch, no messages */
    (void)state;
    mt_schedule s;
    build_ok(&s, 1, 1, MT_PP_1F1B, 3);
    assert_int_equal(s.n_actions[0], 6);
    for (int mb = 0; mb < 3; mb++) {
        assert_int_equal(s.actions[0][2 * mb].op, MT_SCHED_FWD);
        assert_int_equal(s.actions[0][2 * mb].mb, mb);
        assert_int_equal(s.actions[0][2 * mb].peer, -1);
        assert_int_equal(s.actions[0][2 * mb + 1].op, MT_SCHED_BWD);
        assert_int_equal(s.actions[0][2 * mb + 1].mb, mb);
    }
    mt_schedule_free(&s);
    /* DualPipeV on one stage: both chunks forward, then back, handed over locally */
    build_ok(&s, 1, 2, MT_PP_DUALPIPEV, 2);
    assert_int_equal(s.n_actions[0], 8);
    const int chunk[4] = {0, 1, 1, 0};
    const mt_sched_op op[4] = {MT_SCHED_FWD, MT_SCHED_FWD, MT_SCHED_BWD, MT_SCHED_BWD};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(s.actions[0][i].op, op[i]);
        assert_int_equal(s.actions[0][i].chunk, chunk[i]);
        assert_int_equal(s.actions[0][i].mb, 0);
    }
    mt_schedule_free(&s);
}

static void test_1f1b_warms_up_with_pp_minus_stage_minus_one_forwards(void **state)
{
    (void)state;
    mt_schedule s;
    build_ok(&s, 4, 1, MT_PP_1F1B, 8);
    /* interleaved with one chunk per stage is the same table */
    mt_schedule t;
    build_ok(&t, 4, 1, MT_PP_INTERLEAVED, 8);
    for (int st = 0; st < 4; st++) {
        assert_int_equal(t.n_actions[st], s.n_actions[st]);
        assert_memory_equal(t.actions[st], s.actions[st],
                            (size_t)s.n_actions[st] * sizeof(mt_sched_action));
    }
    mt_schedule_free(&t);
    for (int st = 0; st < 4; st++) {
        int fwd = 0;
        for (int i = 0; i < s.n_actions[st] && s.actions[st][i].op != MT_SCHED_BWD; i++)
            fwd += s.actions[st][i].op == MT_SCHED_FWD;
        assert_int_equal(fwd, 4 - st); /* warm-up, then the steady phase's first F */
    }
    mt_schedule_free(&s);
}

static void test_send_and_receive_of_one_message_share_its_tag(void **state)
{
    (void)state;
    const mt_pp_schedule kinds[3] = {MT_PP_1F1B, MT_PP_INTERLEAVED, MT_PP_DUALPIPEV};
    const int vpps[3] = {1, 2, 2};
    for (int k = 0; k < 3; k++) {
        mt_schedule s;
        build_ok(&s, 4, vpps[k], kinds[k], 8);
        int nc = 4 * vpps[k], sends = 0, found = 0;
        for (int st = 0; st < 4; st++)
            for (int i = 0; i < s.n_actions[st]; i++) {
                const mt_sched_action *a = &s.actions[st][i];
                if (a->op != MT_SCHED_SEND_ACT && a->op != MT_SCHED_SEND_GRAD) {
                    if (a->op < MT_SCHED_SEND_ACT) assert_int_equal(mt_sched_msg_tag(a, nc), -1);
                    continue;
                }
                sends++;
                int tag = mt_sched_msg_tag(a, nc), hits = 0;
                for (int j = 0; j < s.n_actions[a->peer]; j++) {
                    const mt_sched_action *r = &s.actions[a->peer][j];
                    if ((r->op == MT_SCHED_RECV_ACT || r->op == MT_SCHED_RECV_GRAD) &&
                        mt_sched_msg_tag(r, nc) == tag) {
                        hits++;
                        assert_int_equal(r->peer, st);
                        assert_int_equal(r->mb, a->mb);
                        assert_int_equal(r->chunk, a->op == MT_SCHED_SEND_ACT ? a->chunk + 1
                                                                              : a->chunk - 1);
                    }
                }
                assert_int_equal(hits, 1);
                found += hits;
            }
        assert_true(sends > 0);
        assert_int_equal(found, sends);
        mt_schedule_free(&s);
    }
}

/* ---- what the builder refuses ---------------------------------------------------- */

static void test_build_refuses_sizes_a_schedule_cannot_run(void **state)
{
    (void)state;
    mt_schedule s;
    mt_layout l = layout_of(4, 2, MT_PP_INTERLEAVED);
    assert_int_equal(mt_schedule_build(&s, &l, 6), MT_EINVAL);
    assert_non_null(strstr(mt_errmsg(), "micro-batches (6) to be a multiple of pp 4"));
    l = layout_of(4, 2, MT_PP_DUALPIPEV);
    assert_int_equal(mt_schedule_build(&s, &l, 7), MT_EINVAL);
    assert_non_null(strstr(mt_errmsg(), "2 x pp = 8"));
    l = layout_of(4, 2, MT_PP_1F1B);
    assert_int_equal(mt_schedule_build(&s, &l, 8), MT_EINVAL);
    assert_non_null(strstr(mt_errmsg(), "vpp 2"));
    l = layout_of(4, 1, MT_PP_1F1B);
    assert_int_equal(mt_schedule_build(&s, &l, 0), MT_EINVAL);
    assert_non_null(strstr(mt_errmsg(), "0 micro-batches"));
}

/* ---- the checker refuses broken tables ---------------------------------------------- */

static int find(const mt_schedule *s, int st, mt_sched_op op, int mb, int chunk)
{
    for (int i = 0; i < s->n_actions[st]; i++) {
        const mt_sched_action *a = &s->actions[st][i];
        if (a->op == op && a->mb == mb && a->chunk == chunk) return i;
    }
    fail_msg("stage %d has no %s mb %d chunk %d", st, mt_sched_op_name(op), mb, chunk);
    return -1;
}

/* Moves action `from` to index `to` of stage st, shifting the ones between. */
static void move(mt_schedule *s, int st, int from, int to)
{
    mt_sched_action a = s->actions[st][from];
    if (from < to)
        memmove(&s->actions[st][from], &s->actions[st][from + 1],
                (size_t)(to - from) * sizeof a);
    else
        memmove(&s->actions[st][to + 1], &s->actions[st][to], (size_t)(from - to) * sizeof a);
    s->actions[st][to] = a;
}

static void test_checker_refuses_backward_before_forward(void **state)
{
    (void)state;
    mt_schedule s;
    build_ok(&s, 1, 1, MT_PP_1F1B, 2);
    move(&s, 0, find(&s, 0, MT_SCHED_BWD, 1, 0), 0);
    check_refuses(&s, "runs the backward (action 0) before the forward");
    mt_schedule_free(&s);
}

static void test_checker_refuses_a_missing_or_duplicated_compute(void **state)
{
    (void)state;
    mt_schedule s;
    build_ok(&s, 2, 1, MT_PP_1F1B, 4);
    int i = find(&s, 1, MT_SCHED_FWD, 2, 1);
    s.actions[1][i].mb = 3; /* F of mb 3 twice, mb 2 never */
    check_refuses(&s, "a second F of mb 3 chunk 1");
    mt_schedule_free(&s);

    build_ok(&s, 2, 1, MT_PP_1F1B, 4);
    s.n_actions[0]--; /* stage 0's last action, the backward of mb 3, dropped */
    check_refuses(&s, "mb 3 chunk 0: no backward on stage 0");
    mt_schedule_free(&s);
}

static void test_checker_refuses_a_chunk_on_the_wrong_stage(void **state)
{
    (void)state;
    mt_schedule s;
    build_ok(&s, 4, 2, MT_PP_INTERLEAVED, 4);
    int i = find(&s, 1, MT_SCHED_FWD, 0, 5);
    s.actions[1][i].chunk = 6; /* chunk 6 runs on stage 2 */
    check_refuses(&s, "chunk 6 runs on stage 2");
    mt_schedule_free(&s);
}

static void test_checker_refuses_unmatched_or_misaddressed_messages(void **state)
{
    (void)state;
    mt_schedule s;
    build_ok(&s, 3, 1, MT_PP_1F1B, 3);
    int i = find(&s, 0, MT_SCHED_SEND_ACT, 1, 0);
    s.actions[0][i].peer = 2; /* chunk 1 is on stage 1 */
    check_refuses(&s, "peer must be 1");
    mt_schedule_free(&s);

    build_ok(&s, 3, 1, MT_PP_1F1B, 3);
    i = find(&s, 1, MT_SCHED_SEND_GRAD, 2, 1); /* dropped: stage 0 would wait forever */
    move(&s, 1, i, s.n_actions[1] - 1);
    s.n_actions[1]--;
    check_refuses(&s, "mb 2 chunk 0: stage 0 waits for a gradient that stage 1 never sends");
    mt_schedule_free(&s);

    build_ok(&s, 3, 1, MT_PP_1F1B, 3);
    i = find(&s, 2, MT_SCHED_RECV_ACT, 0, 2);
    move(&s, 2, i, find(&s, 2, MT_SCHED_FWD, 0, 2)); /* received after the forward used it */
    check_refuses(&s, "needs recv_act from stage 1 before its forward");
    mt_schedule_free(&s);

    /* DualPipeV's turn: chunks 3 and 4 share stage 3, so a message between
     * them is wrong */
    build_ok(&s, 4, 2, MT_PP_DUALPIPEV, 8);
    i = find(&s, 3, MT_SCHED_FWD, 0, 4);
    s.actions[3][i - 1] = (mt_sched_action){MT_SCHED_RECV_ACT, 0, 4, 3};
    check_refuses(&s, "handed over locally");
    mt_schedule_free(&s);
}

static void test_checker_refuses_a_local_hand_over_out_of_order(void **state)
{
    (void)state;
    mt_schedule s;
    build_ok(&s, 4, 2, MT_PP_DUALPIPEV, 8);
    /* stage 3: chunk 4's forward of mb 0 before chunk 3's, whose output it takes */
    int f3 = find(&s, 3, MT_SCHED_FWD, 0, 3), f4 = find(&s, 3, MT_SCHED_FWD, 0, 4);
    s.actions[3][f3].chunk = 4;
    s.actions[3][f4].chunk = 3;
    check_refuses(&s, "mb 0: stage 3 runs chunk 4's forward");
    mt_schedule_free(&s);
}

static void test_checker_refuses_weight_gradient_before_input_gradient(void **state)
{
    (void)state;
    mt_schedule s;
    build_ok(&s, 4, 2, MT_PP_DUALPIPEV, 8);
    int bi = find(&s, 0, MT_SCHED_BWD_IN, 0, 7), w = find(&s, 0, MT_SCHED_BWD_W, 0, 7);
    move(&s, 0, w, bi);
    check_refuses(&s, "runs W (action");
    mt_schedule_free(&s);
}

static void test_checker_refuses_a_table_that_deadlocks(void **state)
{
    /* 1F1B pp = 2: stage 0 waits for mb 0's gradient before sending mb 0's
     * activation; stage 1 waits for that activation. Every action is present
     * and in order per (mb, chunk); only running it shows the cycle. */
    (void)state;
    mt_schedule s;
    build_ok(&s, 2, 1, MT_PP_1F1B, 2);
    move(&s, 0, find(&s, 0, MT_SCHED_RECV_GRAD, 0, 0), 0);
    check_refuses(&s, "deadlock");
    check_refuses(&s, "stage 0 waits at action 0 (recv_grad mb=0 chunk=0 peer=1)");
    check_refuses(&s, "stage 1 waits at action 0 (recv_act mb=0 chunk=1 peer=0)");
    mt_sched_sim sim;
    assert_int_equal(mt_schedule_simulate(&s, NULL, &sim), MT_EINVAL);
    mt_schedule_free(&s);

    /* two stages each receiving before sending what the other waits for */
    build_ok(&s, 2, 1, MT_PP_1F1B, 4);
    /* stage 1 takes mb 1's activation before running mb 0: fine alone, but
     * stage 0 sends mb 1 only after it got mb 0's gradient */
    int r1 = find(&s, 1, MT_SCHED_RECV_ACT, 1, 1);
    move(&s, 1, r1, 0);
    move(&s, 0, find(&s, 0, MT_SCHED_RECV_GRAD, 0, 0), find(&s, 0, MT_SCHED_FWD, 1, 0));
    check_refuses(&s, "deadlock");
    mt_schedule_free(&s);
}

/* ---- the simulator: bubbles and memory ------------------------------------------- */

static void test_1f1b_bubble_is_pp_minus_1_over_n_mb_plus_pp_minus_1(void **state)
{
    (void)state;
    mt_sched_costs c;
    mt_sched_costs_default(&c);
    mt_sched_costs equal = {1, 1, 0.5, 0.5, 0}; /* the formula holds for any F, B */
    for (int pp = 1; pp <= 8; pp++)
        for (int n = 1; n <= 24; n++) {
            mt_schedule s;
            build_ok(&s, pp, 1, MT_PP_1F1B, n);
            double want = (double)(pp - 1) / (n + pp - 1);
            assert_float_equal(bubble_of(&s, &c), want, 1e-12);
            assert_float_equal(bubble_of(&s, &equal), want, 1e-12);
            mt_sched_sim sim;
            assert_int_equal(mt_schedule_simulate(&s, &c, &sim), MT_OK);
            assert_float_equal(sim.step, (n + pp - 1) * (c.f + c.b), 1e-9);
            for (int st = 0; st < pp; st++) {
                assert_float_equal(sim.busy[st], n * (c.f + c.b), 1e-9);
                /* 1F1B's point: at most pp - stage micro-batches alive */
                assert_int_equal(sim.peak_in_flight[st], n < pp - st ? n : pp - st);
            }
            mt_sched_sim_free(&sim);
            mt_schedule_free(&s);
        }
}

static void test_interleaved_bubble_is_pp_minus_1_over_vpp_n_mb_plus_pp_minus_1(void **state)
{
    /* Megatron's interleaved schedule cuts the 1F1B bubble by vpp: with
     * per-chunk costs, idle (pp - 1)(F + B) per stage against vpp n (F + B)
     * of work */
    (void)state;
    mt_sched_costs c;
    mt_sched_costs_default(&c);
    for (int pp = 2; pp <= 8; pp++)
        for (int vpp = 2; vpp <= 4; vpp++)
            for (int n = pp; n <= 4 * pp; n += pp) {
                mt_schedule s;
                build_ok(&s, pp, vpp, MT_PP_INTERLEAVED, n);
                double want = (double)(pp - 1) / (vpp * n + pp - 1);
                double got = bubble_of(&s, &c);
                if (fabs(got - want) > 1e-12)
                    fprintf(stderr, "pp %d vpp %d n %d: bubble %.6f, formula %.6f\n", pp, vpp, n,
                            got, want);
                assert_float_equal(got, want, 1e-12);
                /* and below 1F1B's at the same pp and micro-batches */
                assert_true(got < (double)(pp - 1) / (n + pp - 1));
                /* Megatron's warm-up: stage st holds 2 (pp - st - 1) + (vpp - 1) pp + 1
                 * chunk activations at the peak (all of them when n = pp) */
                int peak[8];
                mt_schedule_peak_in_flight(&s, peak);
                for (int st = 0; st < pp; st++) {
                    int w = n == pp ? vpp * n : 2 * (pp - st - 1) + (vpp - 1) * pp + 1;
                    if (w > vpp * n) w = vpp * n;
                    assert_int_equal(peak[st], w);
                }
                mt_schedule_free(&s);
            }
}

static void test_dualpipev_bubble_is_below_1f1b_at_the_same_sizes(void **state)
{
    /* The same model on pp ranks: 1F1B with one chunk per stage of cost
     * (2F, 2B) against DualPipeV's two chunks of (F, B) per stage - the
     * fractions compare directly. */
    (void)state;
    /* also with other backward / weight splits and a p2p latency */
    const mt_sched_costs other[4] = {
        {1, 3, 1.5, 1.5, 0}, {1, 2, 1.5, 0.5, 0}, {1, 1, 0.5, 0.5, 0}, {1, 2, 1, 1, 0.3}};
    mt_sched_costs c;
    mt_sched_costs_default(&c);
    for (int pp = 2; pp <= 8; pp++)
        for (int n = 2 * pp; n <= 4 * pp; n++) {
            mt_schedule v, o;
            build_ok(&v, pp, 2, MT_PP_DUALPIPEV, n);
            build_ok(&o, pp, 1, MT_PP_1F1B, n);
            for (int k = -1; k < 4; k++) {
                const mt_sched_costs *ck = k < 0 ? &c : &other[k];
                mt_sched_costs c2 = {2 * ck->f, 2 * ck->b, 2 * ck->b_in, 2 * ck->w, ck->p2p};
                double bv = bubble_of(&v, ck), bo = bubble_of(&o, &c2);
                if (!(bv < bo))
                    fprintf(stderr, "pp %d n %d costs %d: dualpipev %.4f 1f1b %.4f\n", pp, n, k,
                            bv, bo);
                assert_true(bv < bo);
            }
            /* at most (pp - 1) (F + B) idle per stage, at least (pp - 1) F
             * (the last stage waits for the first forward to arrive) */
            mt_sched_sim sim;
            assert_int_equal(mt_schedule_simulate(&v, &c, &sim), MT_OK);
            for (int st = 0; st < pp; st++) {
                assert_true(sim.idle[st] <= (pp - 1) * (c.f + c.b) + 1e-9);
                /* activation memory: 2 pp + 1 chunk activations at the peak
                 * (DualPipe's PP + 1 over its 2 pp virtual stages) */
                assert_int_equal(sim.peak_in_flight[st], 2 * pp + 1);
            }
            assert_true(sim.idle[pp - 1] >= (pp - 1) * c.f - 1e-9);
            mt_sched_sim_free(&sim);
            mt_schedule_free(&v);
            mt_schedule_free(&o);
        }
}

static void test_p2p_latency_delays_each_hop(void **state)
{
    /* one micro-batch through 2 stages: F, hop, F, B, hop, B */
    (void)state;
    mt_schedule s;
    build_ok(&s, 2, 1, MT_PP_1F1B, 1);
    mt_sched_costs c = {1, 2, 1, 1, 0.25};
    mt_sched_sim sim;
    assert_int_equal(mt_schedule_simulate(&s, &c, &sim), MT_OK);
    assert_float_equal(sim.step, 2 * 1 + 2 * 2 + 2 * 0.25, 1e-12);
    assert_float_equal(sim.idle[0], sim.step - 3, 1e-12);
    assert_float_equal(sim.bubble, (2 * sim.step - 6) / (2 * sim.step), 1e-12);
    mt_sched_sim_free(&sim);
    mt_schedule_free(&s);
}

static void test_predicted_idle_fractions_are_the_simulated_ones(void **state)
{
    (void)state;
    mt_schedule s;
    build_ok(&s, 4, 2, MT_PP_DUALPIPEV, 8);
    double bubble, idle[4], sum = 0;
    assert_int_equal(mt_schedule_predict(&s, NULL, &bubble, idle), MT_OK);
    mt_sched_sim sim;
    assert_int_equal(mt_schedule_simulate(&s, NULL, &sim), MT_OK);
    for (int st = 0; st < 4; st++) {
        assert_float_equal(idle[st], sim.idle[st] / sim.step, 1e-12);
        sum += idle[st];
    }
    assert_float_equal(bubble, sum / 4, 1e-12);
    assert_float_equal(bubble, sim.bubble, 1e-12);
    mt_sched_sim_free(&sim);
    mt_schedule_free(&s);
}

/* Per-chunk costs (issue 17): with every chunk's costs equal, the
 * per-chunk simulator is the uniform one, for every schedule kind. */
static void test_equal_chunk_costs_predict_what_uniform_costs_predict(void **state)
{
    (void)state;
    const struct { int pp, vpp; mt_pp_schedule kind; int n_mb; } cases[] = {
        {2, 1, MT_PP_1F1B, 8}, {4, 1, MT_PP_1F1B, 5}, {4, 2, MT_PP_INTERLEAVED, 8},
        {4, 2, MT_PP_DUALPIPEV, 8}, {2, 2, MT_PP_DUALPIPEV, 6}};
    const mt_sched_costs c = {1.5, 2.75, 1.25, 1.5, 0.125};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        mt_schedule s;
        build_ok(&s, cases[k].pp, cases[k].vpp, cases[k].kind, cases[k].n_mb);
        const int C = cases[k].pp * cases[k].vpp;
        mt_sched_costs cc[8];
        for (int i = 0; i < C; i++) cc[i] = c;
        double b1, bc, i1[4], ic[4];
        assert_int_equal(mt_schedule_predict(&s, &c, &b1, i1), MT_OK);
        assert_int_equal(mt_schedule_predict_chunks(&s, cc, &bc, ic), MT_OK);
        assert_float_equal(bc, b1, 1e-12);
        for (int st = 0; st < cases[k].pp; st++) assert_float_equal(ic[st], i1[st], 1e-12);
        mt_schedule_free(&s);
    }
}

/* 1F1B with the last stage slower than the others (the proxy's last stage
 * holds the vocabulary head): once the first forward reaches it, the last
 * stage never waits, so
 *   step = sum_{s < pp-1} (F_s + B_s) + n_mb (F_last + B_last),
 * the last stage idles sum_{s < pp-1} (F_s + B_s) and stage s < pp-1 idles
 * step - n_mb (F_s + B_s): more than with equal costs, where every stage
 * idles (pp - 1) (F + B). */
static void test_a_slow_last_stage_makes_the_others_wait_in_1f1b(void **state)
{
    (void)state;
    for (int pp = 2; pp <= 4; pp += 2) {
        const int n = 8;
        mt_schedule s;
        build_ok(&s, pp, 1, MT_PP_1F1B, n);
        mt_sched_costs cc[4];
        for (int st = 0; st < pp; st++) mt_sched_costs_default(&cc[st]);
        cc[pp - 1].f = 2; /* twice as slow */
        cc[pp - 1].b = 4;
        double bubble, idle[4], eq_bubble, eq_idle[4];
        assert_int_equal(mt_schedule_predict_chunks(&s, cc, &bubble, idle), MT_OK);
        assert_int_equal(mt_schedule_predict(&s, NULL, &eq_bubble, eq_idle), MT_OK);
        const double step = (pp - 1) * 3.0 + n * 6.0;
        mt_sched_sim sim;
        assert_int_equal(mt_schedule_simulate_chunks(&s, cc, &sim), MT_OK);
        assert_float_equal(sim.step, step, 1e-9);
        mt_sched_sim_free(&sim);
        assert_float_equal(idle[pp - 1], (pp - 1) * 3.0 / step, 1e-12);
        for (int st = 0; st < pp - 1; st++) {
            assert_float_equal(idle[st], 1 - n * 3.0 / step, 1e-12);
            assert_true(idle[st] > eq_idle[st]);
            assert_float_equal(eq_idle[st], (pp - 1) * 3.0 / ((n + pp - 1) * 3.0), 1e-12);
        }
        assert_true(bubble > eq_bubble);
        mt_schedule_free(&s);
    }
}

/* Measured costs may be NaN (a stage that timed nothing): refused by name. */
static void test_chunk_costs_must_be_numbers_at_least_zero(void **state)
{
    (void)state;
    mt_schedule s;
    build_ok(&s, 2, 1, MT_PP_1F1B, 4);
    mt_sched_costs cc[2];
    mt_sched_costs_default(&cc[0]);
    mt_sched_costs_default(&cc[1]);
    cc[1].b = NAN;
    double bubble, idle[2];
    assert_int_equal(mt_schedule_predict_chunks(&s, cc, &bubble, idle), MT_EINVAL);
    assert_non_null(strstr(mt_errmsg(), "chunk 1"));
    mt_schedule_free(&s);
}

static void test_timeline_shows_one_row_per_stage_and_the_bubble(void **state)
{
    (void)state;
    mt_schedule s;
    build_ok(&s, 4, 1, MT_PP_1F1B, 8);
    FILE *f = tmpfile();
    assert_non_null(f);
    assert_int_equal(mt_schedule_print(f, &s, NULL, 0), MT_OK);
    long len = ftell(f);
    char *text = calloc((size_t)len + 1, 1);
    rewind(f);
    assert_int_equal(fread(text, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    /* stage 3 starts after 3 idle units, then F0 and a 2-unit B0 */
    assert_non_null(strstr(text, "stage 3  |......F0B0B0F1B1B1"));
    assert_non_null(strstr(text, "stage 0  |F0F1F2F3......"));
    assert_non_null(strstr(text, "bubble 27.3%"));
    free(text);
    mt_schedule_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_generated_table_passes_the_checker),
        cmocka_unit_test(test_every_chunk_runs_every_micro_batch_once_forward_and_backward),
        cmocka_unit_test(test_dualpipev_pairs_forward_and_backward_of_its_two_chunks_when_steady),
        cmocka_unit_test(test_one_stage_runs_forward_then_backward_per_micro_batch),
        cmocka_unit_test(test_1f1b_warms_up_with_pp_minus_stage_minus_one_forwards),
        cmocka_unit_test(test_send_and_receive_of_one_message_share_its_tag),
        cmocka_unit_test(test_build_refuses_sizes_a_schedule_cannot_run),
        cmocka_unit_test(test_checker_refuses_backward_before_forward),
        cmocka_unit_test(test_checker_refuses_a_missing_or_duplicated_compute),
        cmocka_unit_test(test_checker_refuses_a_chunk_on_the_wrong_stage),
        cmocka_unit_test(test_checker_refuses_unmatched_or_misaddressed_messages),
        cmocka_unit_test(test_checker_refuses_a_local_hand_over_out_of_order),
        cmocka_unit_test(test_checker_refuses_weight_gradient_before_input_gradient),
        cmocka_unit_test(test_checker_refuses_a_table_that_deadlocks),
        cmocka_unit_test(test_1f1b_bubble_is_pp_minus_1_over_n_mb_plus_pp_minus_1),
        cmocka_unit_test(test_interleaved_bubble_is_pp_minus_1_over_vpp_n_mb_plus_pp_minus_1),
        cmocka_unit_test(test_dualpipev_bubble_is_below_1f1b_at_the_same_sizes),
        cmocka_unit_test(test_p2p_latency_delays_each_hop),
        cmocka_unit_test(test_predicted_idle_fractions_are_the_simulated_ones),
        cmocka_unit_test(test_equal_chunk_costs_predict_what_uniform_costs_predict),
        cmocka_unit_test(test_a_slow_last_stage_makes_the_others_wait_in_1f1b),
        cmocka_unit_test(test_chunk_costs_must_be_numbers_at_least_zero),
        cmocka_unit_test(test_timeline_shows_one_row_per_stage_and_the_bubble),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
