/* svc_types.h - plain C records the service modules share: job states,
 * checkpoint descriptions, reshard progress. The protobuf messages of
 * api/moetrain.proto are built from these in one place (trainer_rpc.c). */
#ifndef MT_SVC_TYPES_H
#define MT_SVC_TYPES_H

#include <stdint.h>

#include "engine/train/jobspec.h"

/* Numbered like moetrain.v1.JobState (trainer_rpc.c asserts it). */
typedef enum {
    SVC_IDLE = 1,
    SVC_RUNNING = 2,
    SVC_PAUSED = 3,
    SVC_STOPPING = 4,
    SVC_FAILED = 5,
} svc_state;

/* "IDLE", "RUNNING", ... */
const char *svc_state_name(svc_state s);

/* The job spec's spelling of a pipeline schedule ("1f1b", ...), taken from
 * the job spec field table so it is written in one place. */
const char *svc_schedule_name(mt_pp_schedule s);

#define SVC_NAME_CAP 128
#define SVC_MSG_CAP 512
#define SVC_VERIFY_CAP 256

typedef struct svc_ckpt {
    int valid;                 /* 0: no checkpoint */
    char name[SVC_NAME_CAP];
    int64_t step;
    char path[MT_PATH_CAP];
    mt_layout layout;
    int have_layout;           /* 0: not known without opening the index */
    int64_t bytes;
    /* How its save went, when this daemon saved it (0 / "": not known):
     * rank 0's time from the snapshot to the commit, and how long training
     * was blocked (snapshot, waiting for the previous save); what verifying
     * it found: "ok", "failed: ...", "skipped: ..." (too big to read back
     * at once), "running" or "". */
    double write_ms, stall_ms;
    char verify[SVC_VERIFY_CAP];
} svc_ckpt;

typedef struct svc_reshard {
    int active, done, failed;
    char source[SVC_NAME_CAP], target[SVC_NAME_CAP];
    mt_layout layout;        /* target layout */
    double progress;           /* 0..1 */
    char message[SVC_MSG_CAP];
} svc_reshard;

#endif
