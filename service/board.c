/* board.c - see board.h. */
#define _POSIX_C_SOURCE 200809L
#include "service/board.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

typedef struct save_rec {
    char path[MT_PATH_CAP];
    double write_ms, stall_ms;
    char verify[SVC_VERIFY_CAP];
    mt_layout layout;
    int have_layout;
} save_rec;

struct board {
    pthread_mutex_t mu;
    int world;
    /* the gather's buffers (rank 0), made once: a step never allocates */
    board_rank *recv;      /* [world] */
    size_t *counts, *displs; /* [world] bytes */
    /* under mu */
    uint64_t run_id;
    board_rank *ranks;     /* [world] */
    int n_ranks;
    board_experts ex;      /* arrays owned; capacities below */
    size_t cap_layers, cap_cells;
    save_rec saves[BOARD_SAVES]; /* a ring, the newest at (next - 1) */
    int next_save, n_saves;
};

int board_create(board **out, int world)
{
    *out = NULL;
    if (world < 1) return MT_ERR(MT_EINVAL, "board: world of %d ranks", world);
    board *b = calloc(1, sizeof *b);
    if (!b) return MT_ERR(MT_ENOMEM, "board: out of memory");
    pthread_mutex_init(&b->mu, NULL);
    b->world = world;
    b->recv = calloc((size_t)world, sizeof *b->recv);
    b->ranks = calloc((size_t)world, sizeof *b->ranks);
    b->counts = calloc((size_t)world, sizeof *b->counts);
    b->displs = calloc((size_t)world, sizeof *b->displs);
    if (!b->recv || !b->ranks || !b->counts || !b->displs) {
        board_destroy(b);
        return MT_ERR(MT_ENOMEM, "board: out of memory for %d ranks", world);
    }
    for (int r = 0; r < world; r++) {
        b->counts[r] = sizeof(board_rank);
        b->displs[r] = (size_t)r * sizeof(board_rank);
    }
    *out = b;
    return MT_OK;
}

void board_destroy(board *b)
{
    if (!b) return;
    pthread_mutex_destroy(&b->mu);
    free(b->recv);
    free(b->ranks);
    free(b->counts);
    free(b->displs);
    free(b->ex.layer);
    free(b->ex.load);
    free(b->ex.bias);
    free(b);
}

void board_new_run(board *b, uint64_t run_id)
{
    if (!b) return;
    pthread_mutex_lock(&b->mu);
    b->run_id = run_id;
    b->n_ranks = 0;
    b->ex.run_id = run_id;
    b->ex.step = 0;
    b->ex.n_layers = b->ex.n_experts = 0;
    pthread_mutex_unlock(&b->mu);
}

/* ---- ranks ------------------------------------------------------------------------------ */

int board_gather_ranks(board *b, mt_comm *world, const board_rank *mine)
{
    const int root = mt_comm_rank(world) == 0;
    if (root && (!b || b->world != mt_comm_size(world)))
        return MT_ERR(MT_EINVAL, "board: rank 0 has no board for a world of %d ranks",
                      mt_comm_size(world));
    int rc = mt_comm_gather_v(world, mine, sizeof *mine, root ? b->recv : NULL,
                              root ? b->counts : NULL, root ? b->displs : NULL, MT_COMM_BYTE, 0);
    if (rc < 0) return mt_err_wrap(rc, "the ranks' step records");
    return root ? board_post_ranks(b, b->recv, b->world) : MT_OK;
}

int board_post_ranks(board *b, const board_rank *r, int n)
{
    if (n != b->world)
        return MT_ERR(MT_EINVAL, "board: %d rank records for a world of %d", n, b->world);
    pthread_mutex_lock(&b->mu);
    memcpy(b->ranks, r, (size_t)n * sizeof *b->ranks);
    for (int i = 0; i < n; i++) b->ranks[i].rank = i; /* by position, whatever was sent */
    b->n_ranks = n;
    pthread_mutex_unlock(&b->mu);
    return MT_OK;
}

int board_get_ranks(board *b, board_ranks *out)
{
    memset(out, 0, sizeof *out);
    out->slowest = -1;
    pthread_mutex_lock(&b->mu);
    out->run_id = b->run_id;
    int n = b->n_ranks;
    if (n > 0) {
        out->r = malloc((size_t)n * sizeof *out->r);
        if (out->r) memcpy(out->r, b->ranks, (size_t)n * sizeof *out->r);
    }
    pthread_mutex_unlock(&b->mu);
    if (n > 0 && !out->r) return MT_ERR(MT_ENOMEM, "board: out of memory");
    out->n = n;
    for (int r = 0; r < n; r++)
        if (out->slowest < 0 || out->r[r].compute_ms > out->r[out->slowest].compute_ms)
            out->slowest = r;
    return MT_OK;
}

void board_ranks_free(board_ranks *r)
{
    free(r->r);
    r->r = NULL;
    r->n = 0;
}

/* ---- experts ---------------------------------------------------------------------------- */

/* Copies src into dst, growing dst's arrays (capacities *cl, *cc). */
static int copy_experts(board_experts *dst, size_t *cl, size_t *cc, const board_experts *src)
{
    const size_t L = (size_t)(src->n_layers > 0 ? src->n_layers : 0);
    const size_t cells = L * (size_t)(src->n_experts > 0 ? src->n_experts : 0);
    if (L > *cl) {
        int *p = realloc(dst->layer, L * sizeof *p);
        if (!p) return MT_ERR(MT_ENOMEM, "board: out of memory for %zu MoE layers", L);
        dst->layer = p;
        *cl = L;
    }
    if (cells > *cc) {
        int64_t *p = realloc(dst->load, cells * sizeof *p);
        if (!p) return MT_ERR(MT_ENOMEM, "board: out of memory for %zu expert loads", cells);
        dst->load = p;
        float *q = realloc(dst->bias, cells * sizeof *q);
        if (!q) return MT_ERR(MT_ENOMEM, "board: out of memory for %zu router biases", cells);
        dst->bias = q;
        *cc = cells;
    }
    dst->run_id = src->run_id;
    dst->step = src->step;
    dst->n_layers = src->n_layers;
    dst->n_experts = src->n_experts;
    dst->have_bias = src->have_bias;
    if (L) memcpy(dst->layer, src->layer, L * sizeof *dst->layer);
    if (cells) memcpy(dst->load, src->load, cells * sizeof *dst->load);
    if (cells && src->have_bias) memcpy(dst->bias, src->bias, cells * sizeof *dst->bias);
    return MT_OK;
}

int board_post_experts(board *b, const board_experts *e)
{
    pthread_mutex_lock(&b->mu);
    int rc = copy_experts(&b->ex, &b->cap_layers, &b->cap_cells, e);
    if (rc < 0) b->ex.step = 0;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

int board_get_experts(board *b, board_experts *out)
{
    memset(out, 0, sizeof *out);
    size_t cl = 0, cc = 0;
    pthread_mutex_lock(&b->mu);
    int rc = MT_OK;
    if (b->ex.step > 0) {
        rc = copy_experts(out, &cl, &cc, &b->ex);
    } else {
        out->run_id = b->ex.run_id;
    }
    pthread_mutex_unlock(&b->mu);
    if (rc < 0) board_experts_free(out);
    return rc;
}

void board_experts_free(board_experts *e)
{
    free(e->layer);
    free(e->load);
    free(e->bias);
    memset(e, 0, sizeof *e);
}

/* ---- saves ------------------------------------------------------------------------------ */

/* Under mu: the record of path, or NULL. */
static save_rec *find_save(board *b, const char *path)
{
    for (int i = 0; i < b->n_saves; i++) {
        save_rec *s = &b->saves[(b->next_save - 1 - i + BOARD_SAVES) % BOARD_SAVES];
        if (!strcmp(s->path, path)) return s;
    }
    return NULL;
}

void board_note_save(board *b, const svc_ckpt *c)
{
    if (!b || !c->valid) return;
    pthread_mutex_lock(&b->mu);
    save_rec *s = find_save(b, c->path);
    if (!s) {
        s = &b->saves[b->next_save];
        b->next_save = (b->next_save + 1) % BOARD_SAVES;
        if (b->n_saves < BOARD_SAVES) b->n_saves++;
        memset(s, 0, sizeof *s);
        snprintf(s->path, sizeof s->path, "%s", c->path);
    }
    s->write_ms = c->write_ms;
    s->stall_ms = c->stall_ms;
    if (c->have_layout) {
        s->layout = c->layout;
        s->have_layout = 1;
    }
    if (c->verify[0]) snprintf(s->verify, sizeof s->verify, "%s", c->verify);
    pthread_mutex_unlock(&b->mu);
}

void board_set_verify(board *b, const char *path, const char *result)
{
    if (!b) return;
    pthread_mutex_lock(&b->mu);
    save_rec *s = find_save(b, path);
    if (s) snprintf(s->verify, sizeof s->verify, "%s", result);
    pthread_mutex_unlock(&b->mu);
}

void board_fill_saves(board *b, svc_ckpt *list, int n)
{
    if (!b) return;
    pthread_mutex_lock(&b->mu);
    for (int i = 0; i < n; i++) {
        const save_rec *s = find_save(b, list[i].path);
        if (!s) continue;
        list[i].write_ms = s->write_ms;
        list[i].stall_ms = s->stall_ms;
        if (!list[i].have_layout && s->have_layout) {
            list[i].layout = s->layout;
            list[i].have_layout = 1;
        }
        snprintf(list[i].verify, sizeof list[i].verify, "%s", s->verify);
    }
    pthread_mutex_unlock(&b->mu);
}
