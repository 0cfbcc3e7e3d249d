/* grad_buckets.c - see grad_buckets.h. */
#define _POSIX_C_SOURCE 200809L
#include "engine/train/grad_buckets.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/mt_clock.h"
#include "base/mt_status.h"

int mt_param_copy_segs(const mt_model *m, int i, mt_comm_seg *out, int owner)
{
    const mt_param *p = &m->params[i];
    const size_t n = (size_t)mt_param_numel(&p->d);
    if (p->q) {
        const size_t nb = (size_t)(((p->d.rows + 127) / 128) * ((p->d.cols + 127) / 128));
        out[0] = (mt_comm_seg){p->q, n, owner};
        out[1] = (mt_comm_seg){p->qt, n, owner};
        out[2] = (mt_comm_seg){p->s, nb * 4, owner};
        out[3] = (mt_comm_seg){p->st, nb * 4, owner};
        return 4;
    }
    out[0] = (mt_comm_seg){p->w, n * mt_act_size(m->be), owner};
    return 1;
}

/* Parameter order of the backward: key (mt_model_grad_ready) descending,
 * then table order reversed (the order does not matter within a layer, it
 * only has to be the same everywhere). */
static const mt_model *sort_model;
static int by_backward(const void *a, const void *b)
{
    const int i = *(const int *)a, k = *(const int *)b;
    const int ki = mt_model_grad_ready(sort_model, i), kk = mt_model_grad_ready(sort_model, k);
    if (ki != kk) return ki > kk ? -1 : 1;
    return i > k ? -1 : i < k;
}

static int by_ready(const void *a, const void *b)
{
    const mt_grad_bucket *x = a, *y = b;
    if (x->ready != y->ready) return x->ready > y->ready ? -1 : 1;
    /* stable: the index of the first parameter (unique per bucket) */
    return x->params[0] > y->params[0] ? -1 : x->params[0] < y->params[0];
}

static int bucket_close(mt_grad_buckets *gb, mt_grad_bucket *open, int cap)
{
    if (open->n_params == 0) return MT_OK;
    mt_grad_bucket *b = &gb->b[gb->n++];
    if (gb->n > cap) return MT_ERR(MT_EINVAL, "grad buckets: more buckets than parameters");
    *b = *open;
    memset(open, 0, sizeof *open);
    open->group = b->group;
    b->gsegs = calloc((size_t)b->n_params, sizeof *b->gsegs);
    b->wsegs = calloc((size_t)b->n_params * 4, sizeof *b->wsegs);
    if (!b->gsegs || !b->wsegs) return MT_ERR(MT_ENOMEM, "grad buckets: out of memory");
    return MT_OK;
}

/* A device group is ordered with the backend's kernels when its compute
 * stream is the backend's (the runtime sets it, kernels/ops.h be->stream);
 * otherwise (a group on the default stream, MT_COMM_HOST_SYNC=1) the host
 * fences every op. */
static int stream_ordered(mt_backend *be, mt_comm *g)
{
    if (!g || mt_comm_mem_kind(g) != MT_COMM_DEVICE) return 1;
    void *s = be->stream(be);
    return !mt_comm_host_sync_forced() && s && mt_comm_stream(g) == s;
}

static int needs_host_wait(mt_backend *be, mt_comm *dp, mt_comm *edp)
{
    mt_comm *any = dp ? dp : edp; /* tp with dp 1: edp only */
    const int device = any && mt_comm_mem_kind(any) == MT_COMM_DEVICE;
    return device && !(stream_ordered(be, dp) && stream_ordered(be, edp));
}

int mt_grad_buckets_build(mt_grad_buckets *gb, const mt_model *m, const int *owner, mt_comm *dp,
                          mt_comm *edp, int expert_split, const mt_jobspec *j)
{
    memset(gb, 0, sizeof *gb);
    gb->be = m->be;
    gb->host_wait = needs_host_wait(m->be, dp, expert_split ? edp : NULL);
    gb->wire = j->grad_reduce == MT_GRAD_BF16 ? MT_COMM_BF16 : MT_COMM_F32;
    const char *ov = getenv("MOETRAIN_GRAD_OVERLAP");
    gb->overlap = !(ov && strcmp(ov, "0") == 0);
    const size_t cap_bytes = (size_t)(j->bucket_mb * 1e6);
    const int np = m->table.n;
    int *order = malloc((size_t)(np > 0 ? np : 1) * sizeof *order);
    gb->b = calloc((size_t)np + 1, sizeof *gb->b);
    if (!order || !gb->b) {
        free(order);
        return MT_ERR(MT_ENOMEM, "grad buckets: out of memory");
    }
    int n_order = 0;
    for (int i = 0; i < np; i++) {
        const mt_param *p = &m->params[i];
        const int ex = expert_split && p->d.expert >= 0;
        mt_comm *g = ex ? edp : dp;
        if (!p->grad || owner[i] < 0 || !g || mt_comm_size(g) == 1) continue;
        order[n_order++] = i;
    }
    sort_model = m;
    qsort(order, (size_t)n_order, sizeof *order, by_backward);
    /* one open bucket per group: [0] dense, [1] experts */
    mt_grad_bucket open[2];
    memset(open, 0, sizeof open);
    open[0].group = dp;
    open[1].group = edp;
    int *plist[2] = {NULL, NULL}, rc = MT_OK;
    for (int g = 0; g < 2; g++) {
        plist[g] = malloc((size_t)(n_order > 0 ? n_order : 1) * sizeof(int));
        if (!plist[g]) rc = MT_ERR(MT_ENOMEM, "grad buckets: out of memory");
    }
    for (int g = 0; g < 2; g++) open[g].params = plist[g];
    int last_key[2] = {-2, -2};
    for (int o = 0; o < n_order && rc == MT_OK; o++) {
        const int i = order[o];
        const mt_param *p = &m->params[i];
        const int g = expert_split && p->d.expert >= 0;
        const size_t bytes = (size_t)mt_param_numel(&p->d) * mt_model_grad_size(m);
        const int key = mt_model_grad_ready(m, i);
        mt_grad_bucket *b = &open[g];
        const int full = cap_bytes > 0 ? b->grad_bytes > 0 && b->grad_bytes + bytes > cap_bytes
                                       : b->n_params > 0 && key != last_key[g];
        if (full) {
            /* the closed bucket keeps its parameter list; the open one
             * continues in a fresh one */
            int *fresh = malloc((size_t)(n_order > 0 ? n_order : 1) * sizeof(int));
            if (!fresh) {
                rc = MT_ERR(MT_ENOMEM, "grad buckets: out of memory");
                break;
            }
            rc = bucket_close(gb, b, np + 1);
            b->params = fresh;
            if (rc < 0) break;
        }
        b->params[b->n_params++] = i;
        b->grad_bytes += bytes;
        b->ready = key;
        last_key[g] = key;
    }
    for (int g = 0; g < 2 && rc == MT_OK; g++) {
        if (open[g].n_params > 0) {
            rc = bucket_close(gb, &open[g], np + 1);
            open[g].params = NULL;
        }
    }
    free(open[0].params);
    free(open[1].params);
    free(order);
    if (rc < 0) {
        mt_grad_buckets_free(gb);
        return rc;
    }
    qsort(gb->b, (size_t)gb->n, sizeof *gb->b, by_ready);
    for (int k = 0; k < gb->n; k++) {
        mt_grad_bucket *b = &gb->b[k];
        for (int q = 0; q < b->n_params; q++) {
            const int i = b->params[q];
            mt_param *p = &m->params[i];
            b->gsegs[q] = (mt_comm_seg){p->grad, (size_t)mt_param_numel(&p->d), owner[i]};
            b->n_wsegs += mt_param_copy_segs(m, i, b->wsegs + b->n_wsegs, owner[i]);
        }
    }
    return MT_OK;
}

void mt_grad_buckets_free(mt_grad_buckets *gb)
{
    for (int k = 0; k < gb->n; k++) {
        mt_grad_bucket *b = &gb->b[k];
        mt_comm_wait(b->req); /* a step that failed half-way */
        free(b->params);
        free(b->gsegs);
        free(b->wsegs);
    }
    free(gb->b);
    memset(gb, 0, sizeof *gb);
}

/* Host-fenced device groups: the host waits for every op issued on the
 * groups. */
static int sync_groups(mt_grad_buckets *gb)
{
    for (int k = 0; gb->host_wait && k < gb->n; k++)
        if (k == 0 || gb->b[k].group != gb->b[k - 1].group) MT_CHECK(mt_comm_sync(gb->b[k].group));
    return MT_OK;
}

static int start(mt_grad_buckets *gb, mt_grad_bucket *b)
{
    return mt_comm_reduce_owned_start(b->group, b->gsegs, b->n_params, gb->wire, &b->req);
}

void mt_grad_buckets_arm(mt_grad_buckets *gb)
{
    gb->next = 0;
    gb->armed = gb->overlap;
    gb->started_early = 0;
}

int mt_grad_buckets_layer_done(void *arg, int layer)
{
    mt_grad_buckets *gb = arg;
    if (!gb->armed) return MT_OK;
    /* progress for those in flight (MPI moves large messages only inside
     * its calls), then the buckets that became final */
    for (int k = 0; k < gb->next; k++) {
        int done;
        MT_CHECK(mt_comm_test(gb->b[k].req, &done));
    }
    /* The layer's gradients must be written before a bucket reads them.
     * Stream-ordered groups: the start records an event on the backend's
     * stream after the layer's backward kernels (enqueued before this
     * hook) and the comm's side stream waits for it; the backend's later
     * kernels (the earlier layers' backward) do not wait for the bucket
     * (an owner op joins only in mt_comm_wait, at finish) and touch none
     * of its gradients (they are final). Host-fenced groups: the host
     * waits for the backend. */
    if (gb->host_wait && gb->next < gb->n && gb->b[gb->next].ready >= layer)
        MT_CHECK(gb->be->sync(gb->be));
    while (gb->next < gb->n && gb->b[gb->next].ready >= layer) {
        MT_CHECK(start(gb, &gb->b[gb->next]));
        gb->next++;
        gb->started_early++;
    }
    return MT_OK;
}

int mt_grad_buckets_finish(mt_grad_buckets *gb)
{
    const double t0 = mt_now_ms();
    gb->armed = 0;
    /* stream-ordered: the starts below come after the whole backward on
     * the backend's stream (see layer_done); host-fenced: wait for it */
    int rc = gb->host_wait && gb->next < gb->n ? gb->be->sync(gb->be) : MT_OK;
    for (; gb->next < gb->n && rc == MT_OK; gb->next++) rc = start(gb, &gb->b[gb->next]);
    /* wait for all that started, even after a failure: their buffers.
     * Stream-ordered: each wait makes the backend's stream wait (device
     * side) for the group's ops so far, so the optimizer's kernels (and
     * the norm's sumsq, whose download the host waits for) read the
     * summed gradients; the host does not wait here, the reduction's time
     * shows in the first download after it. Host-fenced: the host waits
     * for the groups (sync_groups). */
    for (int k = 0; k < gb->n; k++) {
        int w = mt_comm_wait(gb->b[k].req);
        gb->b[k].req = NULL;
        if (rc == MT_OK) rc = w;
    }
    if (rc == MT_OK) rc = sync_groups(gb);
    gb->next = 0;
    gb->t_finish_ms = t0;
    gb->t_done_ms = mt_now_ms();
    gb->wait_ms = gb->t_done_ms - t0;
    return rc;
}

int mt_grad_buckets_share(mt_grad_buckets *gb)
{
    /* The gathers read the owners' new compute copies, which the
     * optimizer's kernels write. Stream-ordered: each start waits (side
     * stream, device-side event) for the backend's stream so far, the
     * optimizer included, and each wait makes the backend's stream wait
     * for the gathered copies before the next step's forward reads them
     * (the step's end sync covers the host). Host-fenced: the host waits
     * for the optimizer here and for the groups after. */
    int rc = gb->host_wait && gb->n > 0 ? gb->be->sync(gb->be) : MT_OK;
    for (int k = 0; k < gb->n && rc == MT_OK; k++) {
        mt_grad_bucket *b = &gb->b[k];
        rc = mt_comm_gather_owned_start(b->group, b->wsegs, b->n_wsegs, &b->req);
    }
    for (int k = 0; k < gb->n; k++) {
        int w = mt_comm_wait(gb->b[k].req);
        gb->b[k].req = NULL;
        if (rc == MT_OK) rc = w;
    }
    if (rc == MT_OK) rc = sync_groups(gb);
    return rc;
}

int mt_grad_owned_sumsq(mt_backend *be, const mt_model *m, const unsigned char *keep,
                        float *scratch, double *out)
{
    double s = 0;
    int64_t lo = -1, n = 0;
    for (int i = 0; i <= m->table.n; i++) {
        const mt_param *p = i < m->table.n ? &m->params[i] : NULL;
        if (p && !p->grad) continue; /* the router bias: no gradient, no room in buf_grad */
        const int take = p && keep[i];
        if (take && lo >= 0 && lo + n == p->index) {
            n += mt_param_numel(&p->d);
            continue;
        }
        if (n > 0) { /* the run [lo, lo + n) of buf_grad is done */
            float v;
            MT_CHECK(be->sumsq(be, scratch,
                               (const char *)m->buf_grad + (size_t)lo * mt_model_grad_size(m),
                               m->grad_type == MT_C_BF16, n));
            MT_CHECK(be->download(be, &v, scratch, 4));
            s += v;
        }
        lo = take ? p->index : -1;
        n = take ? mt_param_numel(&p->d) : 0;
    }
    *out = s;
    return MT_OK;
}
