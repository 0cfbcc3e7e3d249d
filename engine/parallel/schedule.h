/* schedule.h - pipeline schedules as data: each stage's ordered list of
 * actions, a checker that proves a table valid, and a simulator that runs a
 * table with per-action costs (timeline, step time, bubble, activations in
 * flight).
 *
 * Chunks are the layout's (layout.h): pp * vpp contiguous chunks of decoder
 * layers, chunk c on stage mt_layout_stage_of_chunk(l, c). A micro-batch
 * runs forward through chunks 0, 1, ..., pp * vpp - 1 and backward in the
 * reverse order. Chunk 0 also holds the embedding (its input comes from the
 * data, no RECV_ACT); the last chunk holds the final norm, head, loss and MTP
 * (its output gradient starts at the loss, no RECV_GRAD). Under DualPipeV
 * the last chunk 2pp-1 sits on stage 0 next to chunk 0.
 *
 * Execution model the executor implements and the checker proves safe:
 *   - a stage runs its actions strictly in table order;
 *   - sends are non-blocking (the message is buffered until received),
 *     receives block until the matching message has arrived;
 *   - when chunk c and c + 1 are on the same stage (DualPipeV's turn at the
 *     last stage, any pp = 1 table) there is no send/recv between them: the
 *     activation or gradient is handed over locally, and the table orders
 *     the consumer after the producer on that stage;
 *   - a RECV_ACT of (mb, c) comes before FWD (mb, c); a SEND_ACT of (mb, c)
 *     after it; a RECV_GRAD of (mb, c) before the backward of (mb, c)
 *     (BWD or BWD_IN); a SEND_GRAD of (mb, c) after it.
 *   - a send's chunk is its producer, a receive's chunk its consumer, so
 *     SEND_ACT (mb, c) on stage(c) pairs with RECV_ACT (mb, c + 1) on
 *     stage(c + 1), and SEND_GRAD (mb, c) on stage(c) with RECV_GRAD
 *     (mb, c - 1) on stage(c - 1). Both ends of a message get the same
 *     mt_sched_msg_tag; messages between two stages are matched by that tag,
 *     never by arrival order alone.
 * Receives are the only blocking points and each names its message, so
 * whether a table finishes does not depend on timing (a Kahn network): the
 * checker's one run proves it for every run. A send that can block until
 * the peer receives (NCCL point-to-point, MPI_Ssend) breaks the model: the
 * executor must post sends asynchronously (their own stream, or isend), or
 * 1F1B itself deadlocks (stage 0 sending mb 1 while stage 1 sends mb 0's
 * gradient).
 *
 * Backward split (DualPipeV, zero-bubble): BWD_IN computes the gradient of
 * the chunk's input (what the previous chunk waits for) and keeps what the
 * weight gradient needs; BWD_W computes the weight gradients later, in a
 * bubble. A table uses either BWD or BWD_IN + BWD_W for each (mb, chunk).
 *
 * Cost convention of the simulator (mt_sched_costs_default): one chunk's
 * forward F = 1, backward B = 2 (input and weight gradients, each about one
 * forward), B_in = W = 1, p2p latency 0. Costs are per chunk: with vpp
 * chunks per stage a stage's share of a micro-batch costs vpp * (F + B).
 */
#ifndef MT_SCHEDULE_H
#define MT_SCHEDULE_H

#include <stddef.h>
#include <stdio.h>

#include "engine/parallel/layout.h"

typedef enum mt_sched_op {
    MT_SCHED_FWD,       /* forward of (mb, chunk) */
    MT_SCHED_BWD,       /* whole backward of (mb, chunk): input and weight gradients */
    MT_SCHED_BWD_IN,    /* input-gradient part of the backward (DualPipeV / zero-bubble split) */
    MT_SCHED_BWD_W,     /* weight-gradient part, after the same (mb, chunk)'s BWD_IN */
    MT_SCHED_SEND_ACT,  /* send chunk's output activation of mb to the stage of chunk+1 */
    MT_SCHED_RECV_ACT,  /* receive chunk's input activation of mb from the stage of chunk-1 */
    MT_SCHED_SEND_GRAD, /* send the gradient of chunk's input of mb to the stage of chunk-1 */
    MT_SCHED_RECV_GRAD  /* receive the gradient of chunk's output of mb from the stage of chunk+1 */
} mt_sched_op;
#define MT_SCHED_N_OPS 8

/* chunk: the global chunk index 0..pp*vpp-1; peer: the pp rank (stage) at
 * the other end of a send/receive, -1 for compute actions. */
typedef struct mt_sched_action {
    mt_sched_op op;
    int mb;
    int chunk;
    int peer;
} mt_sched_action;

/* actions[stage][i], i < n_actions[stage], in execution order. */
typedef struct mt_schedule {
    int pp, vpp, n_mb;
    mt_pp_schedule kind;
    int *n_actions;             /* [pp] */
    mt_sched_action **actions;  /* [pp][n_actions[stage]] */
} mt_schedule;

/* Builds the table of layout l's schedule (l->pp, l->vpp, l->schedule) for
 * n_mb micro-batches. pp = 1: F then B of every chunk per micro-batch (the
 * one-rank order). 1F1B needs vpp = 1; interleaved needs n_mb % pp == 0
 * (with vpp = 1 it is 1F1B's table, any n_mb);
 * DualPipeV needs vpp = 2 and n_mb >= 2 pp when pp > 1. Errors (MT_EINVAL)
 * name the numbers. On success *s owns memory for mt_schedule_free. */
int mt_schedule_build(mt_schedule *s, const mt_layout *l, int n_mb);
void mt_schedule_free(mt_schedule *s);

/* Proves the table valid: every (mb, chunk) has exactly one FWD and one BWD
 * (or one BWD_IN and one BWD_W after it) on the chunk's own stage; the FWD
 * precedes the backward; every chunk but 0 receives its input (RECV_ACT,
 * before the FWD) unless chunk - 1 is on the same stage, and symmetrically
 * for gradients; every send matches exactly one receive of the same (kind,
 * mb, chunk) on its peer, with the right peers; and running all stages under
 * the execution model above terminates (no deadlock). MT_OK, or MT_EINVAL
 * with the first violation in err (stage, index, action) and mt_errmsg(). */
int mt_schedule_check(const mt_schedule *s, char *err, size_t cap);

/* Per-chunk costs in arbitrary time units (see the convention above). */
typedef struct mt_sched_costs {
    double f;    /* FWD */
    double b;    /* BWD (input + weight gradients) */
    double b_in; /* BWD_IN */
    double w;    /* BWD_W */
    double p2p;  /* from a send to the moment its receive may complete */
} mt_sched_costs;
/* F = 1, B = 2, B_in = 1, W = 1, p2p = 0. */
void mt_sched_costs_default(mt_sched_costs *c);

/* One simulated run of a table. Sends and receives take no stage time; a
 * receive waits until its send's time + p2p. Idle = step - busy per stage;
 * bubble = sum of idle / (pp * step). */
typedef struct mt_sched_sim {
    int pp;
    double step;          /* makespan: the last action's end over all stages */
    double bubble;        /* fraction of pp * step that stages sit idle */
    double *busy;         /* [pp] compute time */
    double *idle;         /* [pp] step - busy */
    double **start, **end;/* [pp][n_actions[stage]] times of each action */
    int *peak_in_flight;  /* [pp] see mt_schedule_peak_in_flight */
} mt_sched_sim;

/* Runs s with costs c (NULL: defaults). The table must pass the checker
 * (a deadlocking table is refused with MT_EINVAL). Fills *out, which owns
 * memory for mt_sched_sim_free. */
int mt_schedule_simulate(const mt_schedule *s, const mt_sched_costs *c, mt_sched_sim *out);
void mt_sched_sim_free(mt_sched_sim *sim);

/* The predicted bubble of a table for the executor's metrics: the bubble
 * fraction (*bubble) and, when idle_frac is not NULL, each stage's idle
 * fraction of the step (idle_frac[pp]). Same model as mt_schedule_simulate. */
int mt_schedule_predict(const mt_schedule *s, const mt_sched_costs *c, double *bubble,
                        double *idle_frac);

/* The same with costs per chunk: chunk_costs[pp * vpp], chunk c's actions
 * costing chunk_costs[c] (stages of unequal speed or size, e.g. the
 * measured costs of a step, issue 17); the p2p latency is chunk_costs[0]'s.
 * With every chunk's costs equal to c, the results are mt_schedule_simulate
 * / _predict's with c. */
int mt_schedule_simulate_chunks(const mt_schedule *s, const mt_sched_costs *chunk_costs,
                                mt_sched_sim *out);
int mt_schedule_predict_chunks(const mt_schedule *s, const mt_sched_costs *chunk_costs,
                               double *bubble, double *idle_frac);

/* Activation memory from the table: the most (mb, chunk) pairs a stage has
 * forwarded and not yet finished backward (BWD, or BWD_W under the split:
 * the weight gradient still reads the saved inputs), counted in units of one
 * chunk's activations for one micro-batch. peak[pp]. */
int mt_schedule_peak_in_flight(const mt_schedule *s, int *peak);

/* DualPipeV's overlap pairs: when action i of `stage` is a forward that
 * DualPipeV pairs with the backward of the stage's other chunk (its steady
 * phase: F(a)&B(z), F(z)&B(a)), the index of that backward, else -1. An
 * executor may run a pair's two computations concurrently, each hiding the
 * other's communication; running them one after the other is also correct
 * (the table's order). -1 for every action of other kinds. */
int mt_schedule_pair(const mt_schedule *s, int stage, int i);

/* Short names: "F", "B", "Bi", "W", "send_act", ... */
const char *mt_sched_op_name(mt_sched_op op);

/* Writes the simulated timeline: one row per stage, one cell per `unit` of
 * time (unit <= 0: the smallest positive cost among F, B, B_in, W). A cell
 * is a letter and the micro-batch number: F forward, B backward (whole, or
 * the input-gradient part BWD_IN), W weight-gradient part; upper case for
 * the stage's first chunk, lower case for its later ones (interleaved,
 * DualPipeV's second chunk); an action of k units fills k cells; '.' cells
 * are idle. Then the step time, each stage's idle fraction and peak
 * activations in flight, and the bubble. */
int mt_schedule_print(FILE *f, const mt_schedule *s, const mt_sched_costs *c, double unit);
/* The same with costs per chunk (chunk_costs[pp * vpp], as
 * mt_schedule_simulate_chunks); the header lists each chunk's costs. */
int mt_schedule_print_chunks(FILE *f, const mt_schedule *s, const mt_sched_costs *chunk_costs,
                             double unit);

/* The message a send or receive carries, equal at both ends and distinct
 * for every (kind, mb, chunk boundary) of a table with `n_chunks` chunks:
 * 2 * (mb * n_chunks + boundary) + (gradient ? 1 : 0), boundary b being the
 * edge between chunks b and b + 1. -1 for compute actions. Below 2^31 while
 * n_mb * n_chunks < 2^30. */
int mt_sched_msg_tag(const mt_sched_action *a, int n_chunks);

/* The action as text, "F mb=3 chunk=5" or "send_act mb=3 chunk=5 peer=2". */
void mt_sched_action_format(const mt_sched_action *a, char *buf, size_t cap);

#endif
