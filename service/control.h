/* control.h - the job state machine and the engine loop of moetraind.
 *
 *   IDLE -> RUNNING <-> PAUSED -> STOPPING -> IDLE      (and FAILED)
 *
 * The engine loop (control_run) runs on every rank. Service threads on
 * rank 0 queue commands (control_start, control_command); at the next step
 * boundary rank 0 shares them through the runtime (runtime/runtime.h) as
 * fixed-size records (plus the admitted job spec for a start) and every
 * rank applies them in the same order, so all ranks change state at the
 * same step. With one rank the share is a local copy. Jobs are built,
 * stepped, saved and ended through the runtime's mt_job. A paused job keeps everything resident; resume continues with
 * the next step.
 *
 * A queued command comes back through a ticket that the caller polls: the
 * reply to a pause says at which step it took effect. Requests are checked
 * against the state the queue will leave (a pause queued behind a start is
 * fine) when they are queued, and again when applied; an illegal one is
 * MT_ESTATE with a message.
 */
#ifndef MT_CONTROL_H
#define MT_CONTROL_H

#include <signal.h>
#include <stdint.h>

#include "engine/train/jobspec.h"
#include "engine/train/metrics.h"
#include "runtime/runtime.h"
#include "service/metrics_hub.h"
#include "service/svc_types.h"

typedef struct control control;

typedef struct control_opts {
    mt_runtime *rt;          /* the process's runtime (every rank) */
    const char *workdir;     /* canonical (wd_open); NULL in the foreground mode */
    int rank, world;         /* rt's */
    int threads;             /* CPU backend threads; 0: all cores */
    metrics_hub *hub;        /* rank 0; may be NULL */
    const char *jsonl;       /* rank 0: also write each step as a JSON line here */
    int exit_when_idle;      /* foreground: return once the first job has ended */
    struct watchdog *wd;     /* armed for train.step_timeout_s around each step; may be NULL */
} control_opts;

int control_create(control **out, const control_opts *o);
void control_destroy(control *c);

/* The engine loop. Returns when shut down (SIGTERM sets *term: the job stops
 * at the next step boundary, saving a checkpoint if its checkpoint policy
 * says so) or, with exit_when_idle, when the job has ended: MT_OK, or the
 * job's error if it failed. */
int control_run(control *c, volatile sig_atomic_t *term);

/* ---- rank 0, any thread ---------------------------------------------------- */

typedef enum {
    CTL_NONE = 0,
    CTL_START,
    CTL_PAUSE,
    CTL_RESUME,
    CTL_STOP,
    CTL_SAVE,
    CTL_SHUTDOWN,
} ctl_kind;

typedef struct ctl_result {
    int rc;                     /* MT status of the command */
    char msg[SVC_MSG_CAP];      /* the error when rc < 0 */
    int64_t step;               /* step boundary where it took effect */
    uint64_t run_id;
    char job[SVC_NAME_CAP];
    int64_t start_step, total_steps;
    svc_state state;            /* state after the command */
    svc_ckpt ckpt;              /* saved checkpoint, if any */
} ctl_result;

typedef struct ctl_ticket ctl_ticket;

/* Queues the start of a job admitted for this world (mt_jobspec_admit). */
int control_start(control *c, const mt_jobspec *job, ctl_ticket **t);

/* Queues pause / resume / stop (`save`: final checkpoint) / save a
 * checkpoint / shutdown. */
int control_command(control *c, ctl_kind kind, int save, ctl_ticket **t);

/* 1 and *out filled (the ticket is freed) once the command has been
 * applied; 0 while it waits for the step boundary. */
int control_ticket_poll(ctl_ticket *t, ctl_result *out);

/* The caller no longer wants the result (its client went away). */
void control_ticket_drop(ctl_ticket *t);

typedef struct control_status {
    svc_state state;
    char job[SVC_NAME_CAP];
    uint64_t run_id;
    int64_t step, total_steps, tokens;
    int have_metrics;
    mt_step_metrics last;
    double last_valid_loss;    /* the last measured one; NaN: none yet */
    svc_ckpt last_ckpt;
    mt_layout layout;
    int have_layout;           /* a job was built (layout and backend known) */
    int ranks;
    char backend[16];
    char error[SVC_MSG_CAP];
    char outcome[16];          /* "completed", "stopped" or "" */
    char ckpt_dir[MT_PATH_CAP];/* checkpoint directory of the current / last job */
    svc_reshard reshard;
    int shutting_down;
    uint64_t ckpt_saved_total;
    double started_unix;       /* when the daemon started */
} control_status;

void control_get_status(control *c, control_status *out);

/* The number of ranks that run jobs (what StartJob admits a layout for). */
int control_world(const control *c);

/* What the engine posted after its last step (per-rank step times and
 * memory, per-expert loads and router bias, save records); rank 0. */
struct board;
struct board *control_board(control *c);

/* Any thread, rank 0: the process is about to end on its own (the step
 * watchdog fired): the status and the metrics stream say FAILED with msg,
 * so clients learn why before the connection drops. */
void control_report_fatal(control *c, const char *msg);

/* The daemon is going down: new commands get MT_EINTR. */
int control_shutting_down(control *c);

/* ---- checkpoints (rank 0) ---------------------------------------------------- */

/* The checkpoints of a job (name; "" the current or last job), oldest first,
 * into a malloc'd array. */
int control_list_checkpoints(control *c, const char *job, char *dir, size_t dir_cap,
                             svc_ckpt **out, int *n);

/* Starts rewriting checkpoint `source` of a job as `target` for `layout`
 * (fields 0: as the source) in the background; progress in the status and
 * as hub events. */
int control_reshard(control *c, const char *job, const char *source, const char *target,
                    const mt_layout *layout, char *path, size_t path_cap);

/* Resolves checkpoint `name` ("latest" allowed) in a job's checkpoint
 * directory to its path; MT_ENOTFOUND if there is none. */
int control_checkpoint_path(control *c, const char *ckpt_dir, const char *name, char *path,
                            size_t cap);

#endif
