/* preempt.h - SIGTERM the way schedulers send it: Slurm preemption, requeue
 * or scancel (SIGTERM, then SIGKILL after KillWait, 30 s by default),
 * Kubernetes pod deletion (SIGTERM, then SIGKILL after
 * terminationGracePeriodSeconds, 30 s by default), systemctl stop
 * (TimeoutStopSec).
 *
 * Every rank finishes the step in progress. At that step boundary rank 0
 * decides for all: save a checkpoint and exit 0 if the save is expected to
 * end within train.term_grace_s of the signal (default 25 s, below both
 * defaults above), else exit 75 (restart me) without saving, saying so; the
 * newest committed checkpoint is then the one a restart continues from.
 * The expected save time is the last save's (snapshot stall + write); with
 * no save yet in this process the job tries, and the backstop below bounds
 * it.
 *
 * The backstop: a thread that, once SIGTERM has come and the grace period
 * has passed without the process ending (a step longer than the grace
 * period, a save slower than expected), logs why and ends the process with
 * exit status 75. A save cut short this way leaves only a .partial
 * directory, never a damaged committed checkpoint (ckpt/FORMAT.md).
 *
 * Process-wide state, as signals are.
 */
#ifndef MT_PREEMPT_H
#define MT_PREEMPT_H

#include <signal.h>
#include <stddef.h>

/* Installs the SIGINT / SIGTERM handler: sets *flag and notes the time of
 * the first signal. */
void preempt_install(volatile sig_atomic_t *flag);

/* Seconds since the first SIGTERM / SIGINT; negative when none came. */
double preempt_elapsed_s(void);

/* The grace period of the job now running (train.term_grace_s); the
 * default before any job is 25 s. 0 means: exit without saving. */
void preempt_set_grace(double seconds);
double preempt_grace(void);

typedef enum {
    PREEMPT_SAVE = 1,    /* save a checkpoint, then exit */
    PREEMPT_NO_SAVE = 2, /* exit without saving: the deadline would be missed */
} preempt_verdict;

/* The decision at the first step boundary after the signal. elapsed_s:
 * since the signal; est_save_s: expected duration of a save (< 0:
 * unknown); grace_s: the grace period. `why` gets one sentence for the log. */
preempt_verdict preempt_decide(double elapsed_s, double est_save_s, double grace_s, char *why,
                               size_t cap);

/* Starts the backstop thread (once); at the deadline it logs why and calls
 * die(75), which ends the process (the program supplies it: library code
 * does not exit). */
int preempt_backstop_start(void (*die)(int status));

#endif
