/* rpc_method.c - the method table: every service's methods, joined. */
#define _POSIX_C_SOURCE 200809L
#include "service/rpc_method.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "service/service.h"

static rpc_method *all;
static int n_all;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void join_tables(void)
{
    const rpc_method *t[] = {trainer_rpc_methods, eval_rpc_methods, health_rpc_methods,
                             reflection_rpc_methods};
    const int n[] = {trainer_rpc_n_methods, eval_rpc_n_methods, health_rpc_n_methods,
                     reflection_rpc_n_methods};
    int total = n[0] + n[1] + n[2] + n[3];
    all = calloc((size_t)total, sizeof *all);
    if (!all) return;
    for (int i = 0, k = 0; i < 4; i++)
        for (int j = 0; j < n[i]; j++) all[k++] = t[i][j];
    n_all = total;
}

const rpc_method *rpc_methods(int *n)
{
    pthread_once(&once, join_tables);
    *n = n_all;
    return all;
}

const rpc_method *rpc_method_find(const char *path, size_t len)
{
    int n;
    const rpc_method *t = rpc_methods(&n);
    for (int i = 0; i < n; i++)
        if (strlen(t[i].path) == len && !memcmp(t[i].path, path, len)) return &t[i];
    return NULL;
}
