/* service.h - what the RPC handlers and the HTTP endpoint of rank 0 share. */
#ifndef MT_SERVICE_H
#define MT_SERVICE_H

#include <signal.h>
#include <stdatomic.h>

#include "service/control.h"
#include "service/metrics_hub.h"
#include "service/reflection.h"
#include "service/rpc_method.h"

typedef struct service {
    control *ctl;
    metrics_hub *hub;
    const char *workdir;          /* canonical */
    reflection *refl;
    atomic_int serving;           /* health: 1 SERVING, 0 NOT_SERVING (draining) */
    volatile sig_atomic_t *term;  /* set by SIGTERM: draining starts (may be NULL) */
    atomic_int subscribers;       /* StreamMetrics calls open */
    /* RPCs answered, by method (rpc_methods() order) and status code. */
    atomic_ulong *calls;          /* [n_methods * RPC_N_CODES] */
    int n_methods;
} service;

int service_init(service *s, control *ctl, metrics_hub *hub, const char *workdir);
void service_cleanup(service *s);

/* SERVING for health checks: up, and no SIGTERM yet. */
int service_serving(const service *s);

/* Counts an answered call (the server calls this). */
void service_count_call(service *s, const rpc_method *m, int code);

/* Per-module method tables, joined by rpc_methods(). */
extern const rpc_method trainer_rpc_methods[];
extern const int trainer_rpc_n_methods;
extern const rpc_method eval_rpc_methods[];
extern const int eval_rpc_n_methods;
extern const rpc_method health_rpc_methods[];
extern const int health_rpc_n_methods;
extern const rpc_method reflection_rpc_methods[];
extern const int reflection_rpc_n_methods;

#endif
