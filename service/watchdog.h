/* watchdog.h - the step-time watchdog: no rank hangs forever on a collective.
 *
 * A collective with a dead or stopped peer never returns on the other ranks
 * (MPI's default handler aborts only on errors it sees; a peer that stops
 * answering is no error). So every rank arms its watchdog when a step
 * begins (with the step's boundary: commands, checkpoint collectives,
 * saves) and disarms it when the step ends; a step that is still running
 * after train.step_timeout_s calls `fire` from the watchdog's thread, which
 * reports the cause and ends the process with exit status 75 (restart with
 * --resume auto). Every surviving rank is then gone within about
 * step_timeout_s + the launcher's kill time (mpirun, srun
 * --kill-on-bad-exit end the rest when one rank exits non-zero).
 *
 * Idle and paused ranks wait for commands without a deadline: the
 * watchdog is armed only while the job runs.
 *
 * What the comm layer does (engine/parallel/comm_mpi.c, comm_nccl.c): its
 * communicators return MPI errors (MPI_ERRORS_RETURN) and NCCL's async
 * error is polled, so a failed collective comes back as MT_EMPI / MT_ENCCL
 * (exit 75) without waiting for the timeout; a silent peer is the
 * watchdog's. No heartbeat names the rank that stopped answering yet.
 */
#ifndef MT_WATCHDOG_H
#define MT_WATCHDOG_H

typedef struct watchdog watchdog;

/* Called once, from the watchdog thread, when an armed deadline passes:
 * `what` names the phase ("step 12"), waited_s how long it has run. It is
 * expected to end the process. */
typedef void (*watchdog_fire_fn)(void *arg, const char *what, double waited_s);

int watchdog_create(watchdog **out, watchdog_fire_fn fire, void *arg);
/* Stops the thread; NULL is fine. */
void watchdog_destroy(watchdog *w);

/* Arms (or re-arms) for `timeout_s` from now; timeout_s <= 0 disarms.
 * NULL w is a no-op, so callers need no checks. */
void watchdog_arm(watchdog *w, double timeout_s, const char *what);
void watchdog_disarm(watchdog *w);

/* How many times it fired (tests). */
int watchdog_fired(watchdog *w);

#endif
