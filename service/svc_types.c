/* svc_types.c - names of the shared service records. */
#include "service/svc_types.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

const char *svc_state_name(svc_state s)
{
    switch (s) {
    case SVC_IDLE: return "IDLE";
    case SVC_RUNNING: return "RUNNING";
    case SVC_PAUSED: return "PAUSED";
    case SVC_STOPPING: return "STOPPING";
    case SVC_FAILED: return "FAILED";
    }
    return "UNSPECIFIED";
}

#define N_SCHED 3
_Static_assert(MT_PP_DUALPIPEV + 1 == N_SCHED, "pipeline schedules changed");
static char sched[N_SCHED][32];
static pthread_once_t sched_once = PTHREAD_ONCE_INIT;

static void sched_init(void)
{
    static mt_jobspec j; /* static: too large for a thread's stack */
    for (int i = 0; i < N_SCHED; i++) {
        memset(&j, 0, sizeof j);
        j.parallel.schedule = (mt_pp_schedule)i;
        json_t *root = mt_jobspec_to_json(&j);
        json_t *v = json_object_get(json_object_get(root, "parallel"), "schedule");
        snprintf(sched[i], sizeof sched[i], "%s", json_is_string(v) ? json_string_value(v) : "?");
        json_decref(root);
    }
}

const char *svc_schedule_name(mt_pp_schedule s)
{
    pthread_once(&sched_once, sched_init);
    return (int)s >= 0 && (int)s < N_SCHED ? sched[s] : "?";
}
