/* board.h - what the engine posts after each step for the status, the
 * Prometheus page and the dashboard to read: the latest values only (no
 * history; the metrics hub's ring keeps the per-step history).
 *
 *  - ranks: every rank's record of its last step (step time, its own
 *    compute time before the gradient reduction, backend memory in use and
 *    peak), gathered to rank 0 at the step boundary by one small gather
 *    over the runtime's world communicator; the slowest rank is the one
 *    with the longest compute time (the others wait for it in the
 *    reduction, so their step times are alike and do not name it);
 *  - experts: every MoE layer's per-expert load of the last step (tokens
 *    routed to each routed expert, summed over the global batch: the loads
 *    that drive the router bias update) and the router bias after it;
 *  - saves: how long this daemon's recent checkpoint saves took and what
 *    verifying them found (ListCheckpoints joins them to its directory
 *    scan).
 *
 * One lock; rank 0's engine thread posts, service threads read copies.
 * A board exists on rank 0 only (control_board); the gather is collective
 * and runs on every rank with b = NULL except on rank 0.
 */
#ifndef MT_BOARD_H
#define MT_BOARD_H

#include <stdint.h>

#include "engine/parallel/comm.h"
#include "service/svc_types.h"

/* One rank's last step. Also the record each rank sends to rank 0 (a plain
 * struct: every rank runs the same binary). */
typedef struct board_rank {
    int32_t rank;
    int32_t reserved;
    int64_t step;            /* the step these numbers are of */
    double step_ms;          /* wall time of the step on this rank */
    double compute_ms;       /* its own work before the gradient reduction */
    int64_t mem_in_use;      /* backend bytes */
    int64_t mem_peak;
    int32_t pp_size;         /* pipeline stages; 0: no pipeline (the pp_ fields unset) */
    int32_t pp_stage;        /* this rank's stage */
    double pp_idle;          /* measured idle fraction of its last step (device time) */
    double pp_bubble;        /* the schedule's predicted idle fraction of its stage */
    double pp_bubble_measured; /* the same predicted from the step's measured costs */
} board_rank;

typedef struct board_ranks {
    uint64_t run_id;
    int n;                   /* ranks posted: 0 before the job's first step */
    int slowest;             /* longest compute_ms (lowest rank on ties); -1 with none */
    board_rank *r;           /* [n], rank order; malloc'd */
} board_ranks;

typedef struct board_experts {
    uint64_t run_id;
    int64_t step;            /* the step of the loads; 0: nothing posted */
    int n_layers, n_experts;
    int have_bias;           /* the router has a bias (aux-loss-free balancing) */
    int *layer;              /* [n_layers] model layer (MTP modules follow the main layers) */
    int64_t *load;           /* [n_layers, n_experts] tokens routed in the step */
    float *bias;             /* [n_layers, n_experts] router bias after the step, if have_bias */
} board_experts;

/* Saves remembered (the newest). */
#define BOARD_SAVES 64

typedef struct board board;

/* A board for a world of `world` ranks (rank 0). */
int board_create(board **out, int world);
void board_destroy(board *b);

/* A new job starts: what was posted for the previous one is dropped
 * (the save records stay: they describe checkpoints on disk). */
void board_new_run(board *b, uint64_t run_id);

/* Collective over `world` (every rank, after a step): each rank's *mine
 * goes to rank 0, where b (NULL on the other ranks) posts them all. */
int board_gather_ranks(board *b, mt_comm *world, const board_rank *mine);
/* Posts the records r[n] of all n ranks (n = the world), as the gather does. */
int board_post_ranks(board *b, const board_rank *r, int n);

/* A copy of the last posted rank records; board_ranks_free after. */
int board_get_ranks(board *b, board_ranks *out);
void board_ranks_free(board_ranks *r);

/* Posts a copy of *e (its arrays are copied). */
int board_post_experts(board *b, const board_experts *e);
/* A copy of the last posted loads (step 0: none); board_experts_free after. */
int board_get_experts(board *b, board_experts *out);
void board_experts_free(board_experts *e);

/* A checkpoint this daemon saved (c->write_ms, c->stall_ms as measured);
 * its verify result comes later (board_set_verify). */
void board_note_save(board *b, const svc_ckpt *c);
/* The verify result of the checkpoint at `path`: "ok", "failed: ...",
 * "skipped: ...". */
void board_set_verify(board *b, const char *path, const char *result);
/* Fills write_ms, stall_ms, verify (and the layout, where the entry has
 * none) of the checkpoints in list[n] that this daemon saved (matched by
 * path); the others are left as they are. */
void board_fill_saves(board *b, svc_ckpt *list, int n);

#endif
