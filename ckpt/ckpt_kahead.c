/* ckpt_kahead.c - the kernel's sequential read-ahead of the shard files a
 * load reads ahead through the page cache (ckpt_internal.h).
 *
 * A load's chunk reads are 1-4 MB preads at as many offsets
 * at once as the pool has workers, and the pieces' HDF5 metadata is small
 * reads between them, each queued behind the chunks in flight (0.3-0.7 ms
 * a piece on the lent 16-core hosts, issue 23). dd reads the same disk
 * through the kernel's sequential read-ahead: large requests in file
 * order. So while a file is read, a thread of its own asks the kernel
 * (readahead(2), 8 MB at a time) for the bytes from the first ones wanted
 * up to a window past the last ones wanted: the preads and the metadata
 * then mostly find their pages in the page cache, and the disk sees a
 * stream in file order. Measured on a lent 16-core host (3.06 GB, one
 * rank, alternating): loads of 2.18-2.30 s without, 2.06-2.14 s with a
 * 256 MB window (97-100 % of dd), 2.32-2.57 s with 1024 MB. Verify does
 * not use it: its pieces' metadata is read ahead on a thread of its own,
 * off the reads' path, and queued behind the kernel's requests it became
 * the limit (a 4-rank checkpoint, 3.06 GB: the dispatcher waited 1.25-1.33 s
 * for metadata, against 1.2-1.5 ms without; 2.52-2.60 s against
 * 2.39-2.66 s). MT_CKPT_KERNEL_READAHEAD_MB sets the window (0: off).
 */
#define _GNU_SOURCE /* readahead */
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>

#include "ckpt/ckpt_internal.h"

#define KA_STEP ((int64_t)8 << 20)
#define KA_WINDOW_DEFAULT_MB 256

struct ck_kahead {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int quit;
    int n;
    const int *fd;         /* [n] the files' descriptors (the caller's) */
    int64_t window;
    int64_t *done, *want;  /* [n] asked of the kernel up to; to ask up to (-1: nothing yet) */
};

static void *kahead_main(void *arg)
{
    ck_kahead *k = arg;
    pthread_mutex_lock(&k->mu);
    while (!k->quit) {
        int fi = -1;
        for (int f = 0; f < k->n && fi < 0; f++)
            if (k->done[f] >= 0 && k->done[f] < k->want[f]) fi = f;
        if (fi < 0) {
            pthread_cond_wait(&k->cv, &k->mu);
            continue;
        }
        const int64_t at = k->done[fi], n = k->want[fi] - at < KA_STEP ? k->want[fi] - at : KA_STEP;
        k->done[fi] = at + n;
        pthread_mutex_unlock(&k->mu);
        /* returns once the requests are queued, not read; an error only
         * means no read-ahead: the preads read the bytes themselves */
        (void)readahead(k->fd[fi], (off64_t)at, (size_t)n);
        pthread_mutex_lock(&k->mu);
    }
    pthread_mutex_unlock(&k->mu);
    return NULL;
}

ck_kahead *ck_kahead_start(const int *fd, int n)
{
    const char *e = getenv("MT_CKPT_KERNEL_READAHEAD_MB");
    const long mb = e ? atol(e) : KA_WINDOW_DEFAULT_MB;
    if (mb <= 0 || n <= 0) return NULL;
    ck_kahead *k = calloc(1, sizeof *k);
    if (!k) return NULL;
    k->done = malloc((size_t)n * sizeof *k->done);
    k->want = malloc((size_t)n * sizeof *k->want);
    if (!k->done || !k->want) {
        free(k->done);
        free(k->want);
        free(k);
        return NULL;
    }
    for (int f = 0; f < n; f++) k->done[f] = k->want[f] = -1;
    k->n = n;
    k->fd = fd;
    k->window = (int64_t)mb << 20;
    pthread_mutex_init(&k->mu, NULL);
    pthread_cond_init(&k->cv, NULL);
    if (pthread_create(&k->thread, NULL, kahead_main, k) != 0) {
        pthread_mutex_destroy(&k->mu);
        pthread_cond_destroy(&k->cv);
        free(k->done);
        free(k->want);
        free(k);
        return NULL;
    }
    return k;
}

void ck_kahead_want(ck_kahead *k, int fi, int64_t a, int64_t b)
{
    if (!k || fi < 0 || fi >= k->n || k->fd[fi] < 0) return;
    pthread_mutex_lock(&k->mu);
    if (k->done[fi] < 0) k->done[fi] = a - a % 4096;
    if (b + k->window > k->want[fi]) {
        k->want[fi] = b + k->window;
        pthread_cond_signal(&k->cv);
    }
    pthread_mutex_unlock(&k->mu);
}

void ck_kahead_stop(ck_kahead *k)
{
    if (!k) return;
    pthread_mutex_lock(&k->mu);
    k->quit = 1;
    pthread_cond_signal(&k->cv);
    pthread_mutex_unlock(&k->mu);
    pthread_join(k->thread, NULL);
    pthread_mutex_destroy(&k->mu);
    pthread_cond_destroy(&k->cv);
    free(k->done);
    free(k->want);
    free(k);
}
