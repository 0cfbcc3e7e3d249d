/* exit_status.h - what moetraind's exit status tells its launcher.
 *
 *    0  done: the job completed, or it was stopped (StopJob, SIGTERM) with
 *       its checkpoint saved (or it saves none); the daemon shut down.
 *    1  usage: bad command line. Restarting will not help.
 *    2  failed: the job cannot run (job spec, data, numerics beyond the
 *       rollbacks allowed). Restarting will not help.
 *   75  interrupted, restart me (EX_TEMPFAIL): a rank died or a collective
 *       stalled (the watchdog), an MPI / NCCL error, or SIGTERM's grace
 *       period was too short to save. Restart with --resume auto: the job
 *       continues from its newest checkpoint.
 *
 * deploy/slurm, deploy/k8s and deploy/systemd act on these (README
 * "Operations").
 */
#ifndef MT_EXIT_STATUS_H
#define MT_EXIT_STATUS_H

enum {
    MT_EXIT_OK = 0,
    MT_EXIT_USAGE = 1,
    MT_EXIT_FAILED = 2,
    MT_EXIT_RESTART = 75,
};

/* The exit status for the status control_run ended with. */
int mt_exit_status(int rc);

#endif
