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

const char *svc_schedule_name(mt_pp_schedule s)
{
    return (int)s >= 0 && (int)s <= (int)MT_PP_DUALPIPEV ? mt_pp_schedule_names[s] : "?";
}
