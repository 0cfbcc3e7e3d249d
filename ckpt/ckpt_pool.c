/* ckpt_pool.c - the checkpoint module's worker threads (ckpt_internal.h).
 *
 * One process-wide pool, started on first use: MT_CKPT_THREADS threads
 * (default: the online CPUs divided among the ranks on this host, at least
 * 4 so that reads keep several requests in flight on small machines, at
 * most 16). Tasks run in submission order
 * of their start; callers track completion themselves. A task never waits
 * for another task (no deadlock whatever the pool size).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt/ckpt_internal.h"
#include "base/mt_log.h"

typedef struct job {
    void (*fn)(void *);
    void *arg;
} job;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static job *q;
static int cap, head, count, started;

int ck_io_threads(void)
{
    const char *e = getenv("MT_CKPT_THREADS");
    int n = e ? atoi(e) : 0;
    if (n >= 1) return n > 256 ? 256 : n;
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    n = c > 0 ? (int)c : 1;
    /* ranks sharing the host share its cores (Open MPI, MPICH, Slurm) */
    const char *local[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"};
    for (int i = 0; i < 3; i++) {
        const char *v = getenv(local[i]);
        if (v && atoi(v) > 1) {
            n /= atoi(v);
            break;
        }
    }
    return n < 4 ? 4 : n > 16 ? 16 : n;
}

/* MT_CKPT_DIRECT=0 / 1, else the default: on (issue 23: on the lent
 * 16-core host the async write reached 83 % of dd with O_DIRECT, 48 %
 * through the page cache). */
static int env_switch(const char *name, int dflt)
{
    const char *e = getenv(name);
    if (e && !strcmp(e, "0")) return 0;
    if (e && !strcmp(e, "1")) return 1;
    return dflt;
}

int ck_io_direct(void) { return env_switch("MT_CKPT_DIRECT", 1); }

int ck_io_direct_read(void) { return env_switch("MT_CKPT_DIRECT_READ", CK_DIRECT_READ_DEFAULT); }

void ck_io_direct_refused(const char *path, const char *what, int err)
{
    static pthread_mutex_t once_mu = PTHREAD_MUTEX_INITIALIZER;
    static int said;
    pthread_mutex_lock(&once_mu);
    const int first = !said;
    said = 1;
    pthread_mutex_unlock(&once_mu);
    if (first)
        MT_LOGI("checkpoint: %s: O_DIRECT %s refused (%s): those bytes go through the page cache "
                "(said once per process; MT_CKPT_DIRECT=0 / MT_CKPT_DIRECT_READ=0 turn it off)",
                path, what, strerror(err));
}

static void *pool_main(void *arg)
{
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&mu);
        while (!count) pthread_cond_wait(&cv, &mu);
        job j = q[head];
        head = (head + 1) % cap;
        count--;
        pthread_mutex_unlock(&mu);
        j.fn(j.arg);
    }
    return NULL;
}

static void pool_start(void)
{
    cap = 256;
    q = malloc((size_t)cap * sizeof *q);
    if (!q) return;
    const int n = ck_io_threads();
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, &a, pool_main, NULL) == 0) started++;
    }
    pthread_attr_destroy(&a);
}

void ck_pool_submit(void (*fn)(void *), void *arg)
{
    pthread_once(&once, pool_start);
    pthread_mutex_lock(&mu);
    if (!started || !q) {
        /* no threads could start: run it here */
        pthread_mutex_unlock(&mu);
        fn(arg);
        return;
    }
    if (count == cap) {
        job *n = malloc((size_t)cap * 2 * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&mu);
            fn(arg);
            return;
        }
        for (int i = 0; i < count; i++) n[i] = q[(head + i) % cap];
        free(q);
        q = n;
        head = 0;
        cap *= 2;
    }
    q[(head + count) % cap] = (job){fn, arg};
    count++;
    pthread_cond_signal(&cv);
    pthread_mutex_unlock(&mu);
}
