/* moe_a2a.c - see moe_a2a.h. */
#include "engine/parallel/moe_a2a.h"

#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

typedef struct a2a {
    mt_comm *c;
    mt_comm_dtype wire;
    size_t wsize;                 /* bytes of one wire element */
    int P, me;
    int T;                        /* etp: peers q = t + T o hold slice t of owner o's experts */
    size_t *sc, *sd, *rc, *rd;    /* [P] element counts and displacements */
    int64_t *cnt_send, *cnt_recv; /* [P * E_local] row counts */
    int64_t *seg;                 /* [E_local + 1] first row of each local segment */
    void *sbuf, *rbuf;            /* wire buffers (host: the converting path) */
    size_t scap, rcap;            /* their bytes */
    int64_t bytes_sent, bytes_recv;
    /* The direct path (wire element = the backend's act element: the CUDA
     * backend's bf16, the CPU's float under fp32): rows travel as stored,
     * in the backend's memory; permutations are the backend's moe_permute
     * gathers by an index map. */
    mt_backend *be;               /* the backend of the first exchange (one per dispatcher) */
    int host_wait;                /* a device ep group not ordered on be's stream: fence on
                                     the host around each exchange */
    int direct;
    void *bsend, *brecv;          /* backend wire buffers */
    size_t bsend_cap, brecv_cap;  /* their bytes */
    int32_t *bmap, *map;          /* index map: backend and host copies */
    size_t bmap_cap, map_cap;     /* elements */
    /* The exchange in flight (one at a time), for its finish. */
    struct pend {
        enum { PEND_NONE = 0, PEND_DISPATCH, PEND_FP8, PEND_COMBINE } kind;
        const mt_moe_plan *p;
        int e0, e1, D;
        void *out;        /* dispatch: the local layout (xl_buf); combine: yp */
        uint8_t *ql;      /* fp8: e4m3 rows and scales of the local layout */
        float *sl;
        void *recv;       /* combine: where the rows landed (yp or a wire buffer) */
        mt_comm_req *req;
    } pend;
} a2a;

static a2a *impl_of(const mt_moe_dispatcher *d) { return d->impl; }

static int grow(void **buf, size_t *cap, size_t bytes)
{
    if (bytes <= *cap) return MT_OK;
    void *p = realloc(*buf, bytes);
    if (!p) return MT_ERR(MT_ENOMEM, "expert dispatch: out of memory for %zu wire bytes", bytes);
    *buf = p;
    *cap = bytes;
    return MT_OK;
}

/* float -> bf16 bits over a run: mt_bf16_from_f32 (round to nearest even,
 * NaN stays a quiet NaN) written without branches, so that the compiler
 * can vectorise it (2-3x faster than the scalar helper here). */
static void f32_to_bf16(uint16_t *restrict y, const float *restrict x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        const uint32_t rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const uint32_t nan = (u >> 16) | 0x40u;
        y[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rne);
    }
}

static void bf16_to_f32(float *restrict y, const uint16_t *restrict x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)x[i] << 16;
        memcpy(&y[i], &u, 4);
    }
}

/* n rows of D act values (float: the CPU backend) to the wire, and back. */
static void to_wire(const a2a *x, void *dst, const float *src, int64_t n, int D)
{
    const int64_t m = n * D;
    if (x->wire == MT_COMM_F32) {
        memcpy(dst, src, (size_t)m * 4);
        return;
    }
    uint16_t *y = dst;
    const int64_t B = 1 << 16; /* elements per parallel block */
#pragma omp parallel for schedule(static) if (m > B)
    for (int64_t b = 0; b < m; b += B) f32_to_bf16(y + b, src + b, m - b < B ? m - b : B);
}

static void from_wire(const a2a *x, float *dst, const void *src, int64_t n, int D)
{
    const int64_t m = n * D;
    if (x->wire == MT_COMM_F32) {
        memcpy(dst, src, (size_t)m * 4);
        return;
    }
    const uint16_t *y = src;
    const int64_t B = 1 << 16;
#pragma omp parallel for schedule(static) if (m > B)
    for (int64_t b = 0; b < m; b += B) bf16_to_f32(dst + b, y + b, m - b < B ? m - b : B);
}

/* Which path the backend's buffers take; refuses mixes the wire cannot
 * carry. Memory: a device communicator moves the CUDA backend's buffers, a
 * host one the CPU backend's. */
static int check_backend(const mt_moe_dispatcher *d, mt_backend *be)
{
    a2a *x = impl_of(d);
    if (x->be && x->be != be)
        return MT_ERR(MT_EINVAL, "expert dispatch: one backend per dispatcher (%s, then %s)",
                      x->be->name, be->name);
    const int dev = mt_comm_mem_kind(x->c) == MT_COMM_DEVICE;
    if (dev != (be->kind != MT_BE_CPU))
        return MT_ERR(MT_EINVAL, "expert dispatch: the %s backend's buffers and a %s "
                      "communicator (the ep group must hold the memory the backend computes in)",
                      be->name, dev ? "device" : "host");
    if (x->wsize == (size_t)be->act_bytes) {
        x->direct = 1;
    } else if (be->kind == MT_BE_CPU && be->act_bytes == 4 && x->wire == MT_COMM_BF16) {
        if (!be->round_bf16)
            return MT_ERR(MT_EINVAL, "expert dispatch: a bf16 wire would round the fp32 "
                          "recipe's activations; use an f32 wire");
        x->direct = 0;
    } else {
        return MT_ERR(MT_EINVAL, "expert dispatch: a %s wire for the %s backend's %d-byte "
                      "activations", mt_comm_dtype_name(x->wire), be->name, be->act_bytes);
    }
    if (!x->be && dev) {
        /* the ep group's ops on the backend's stream (the runtime sets it
         * already; direct users of a dispatcher get it here): an exchange
         * starts after the kernels that packed its rows and the kernels
         * after it wait for it, without host waits. MT_COMM_HOST_SYNC=1:
         * left alone, and the host fences each exchange (comm.h). */
        void *stream = be->stream(be);
        if (!mt_comm_host_sync_forced() && stream)
            MT_CHECK(mt_comm_set_stream(x->c, stream));
        x->host_wait = mt_comm_host_sync_forced() || !stream || mt_comm_stream(x->c) != stream;
    }
    x->be = be;
    return MT_OK;
}

/* Ordering of an exchange of backend buffers over a device ep group.
 * Stream-ordered (the group's compute stream is the backend's, the
 * default): the all_to_all_v records an event on the backend's stream
 * after the pack (moe_permute / moe_pack_fp8, or the layer's kernels that
 * wrote xp) and its side stream waits for it; it is not overlapped, so the
 * backend's stream waits for its completion before the unpack, the index
 * map's upload or the layer's kernels after a combine touch the receive
 * buffer, and before any later kernel (the next pack, an arena block
 * reused after bgrow) writes the send buffer. Nothing here reads wire
 * buffers on the host (the counts travel on the host already), so no host
 * wait is needed. Host-fenced (x->host_wait): the host waits for the
 * backend before and for the group after. No-ops on the CPU. */
static int exchange_begin(a2a *x) { return x->host_wait ? x->be->sync(x->be) : MT_OK; }

static int exchange_end(a2a *x) { return x->host_wait ? mt_comm_sync(x->c) : MT_OK; }

/* A backend buffer of at least `bytes` (its contents are not kept). */
static int bgrow(a2a *x, void **buf, size_t *cap, size_t bytes)
{
    if (bytes <= *cap) return MT_OK;
    const size_t want = bytes + bytes / 4 + 256;
    if (*buf) x->be->free(x->be, *buf);
    *buf = NULL;
    *cap = 0;
    MT_CHECK(x->be->alloc(x->be, want, buf));
    *cap = want;
    return MT_OK;
}

/* The host index map of n entries, for filling. */
static int map_grow(a2a *x, int64_t n)
{
    if ((size_t)n <= x->map_cap) return MT_OK;
    const size_t want = (size_t)n + (size_t)n / 4 + 64;
    int32_t *p = realloc(x->map, want * sizeof *p);
    if (!p) return MT_ERR(MT_ENOMEM, "expert dispatch: out of memory for a %zu-row map", want);
    x->map = p;
    x->map_cap = want;
    return MT_OK;
}

/* The host map to the backend (its stream orders the copy before the
 * gather that reads it; a pageable source may be refilled on return). */
static int map_upload(a2a *x, int64_t n)
{
    if (n == 0) return MT_OK;
    size_t cap = x->bmap_cap * 4;
    void *b = x->bmap;
    MT_CHECK(bgrow(x, &b, &cap, (size_t)n * 4));
    x->bmap = b;
    x->bmap_cap = cap / 4;
    return x->be->upload(x->be, x->bmap, x->map, (size_t)n * 4);
}

static int64_t padded(int64_t n, int align) { return (n + align - 1) / align * align; }

/* First row, in the source layout, of the run of peer q's owner's experts
 * (the runs of the owners before it; each owner's once, whatever T). */
static int64_t run_off(const a2a *x, const mt_moe_plan *p, int q)
{
    int64_t off = 0;
    for (int q2 = 0; q2 < q / x->T * x->T; q2 += x->T) off += p->sent[q2];
    return off;
}

/* Counts of the forward: to peer p the rows of p's experts; from peer q
 * the rows q routes to each local expert. Fills the plan. */
static int exchange_counts(mt_moe_dispatcher *d, mt_moe_plan *p, const int *rows)
{
    a2a *x = impl_of(d);
    const int P = x->P, El = d->E_local;
    for (int q = 0; q < P; q++) {
        const int o = q / x->T; /* every slice of owner o gets o's rows */
        x->sc[q] = x->rc[q] = (size_t)El;
        x->sd[q] = x->rd[q] = (size_t)q * El;
        p->sent[q] = 0;
        for (int e = 0; e < El; e++) {
            x->cnt_send[q * El + e] = rows[o * El + e];
            p->to[q * El + e] = rows[o * El + e];
            p->sent[q] += rows[o * El + e];
        }
    }
    /* host arrays: the rows came to the host with the layer's index (the
     * one small device-to-host copy of a layer's forward) */
    MT_CHECK(mt_comm_all_to_all_v(mt_comm_host(x->c), x->cnt_send, x->sc, x->sd, x->cnt_recv,
                                  x->rc, x->rd, MT_COMM_I64));
    x->bytes_sent += (int64_t)(P - 1) * El * 8;
    x->bytes_recv += (int64_t)(P - 1) * El * 8;
    int64_t R = 0, Rl = 0;
    for (int q = 0; q < P; q += x->T) R += p->sent[q]; /* each owner once */
    for (int e = 0; e < El; e++) {
        int64_t n = 0;
        for (int q = 0; q < P; q++) {
            int64_t v = x->cnt_recv[q * El + e];
            if (v < 0)
                return MT_ERR(MT_ECORRUPT, "expert dispatch: rank %d announces %lld rows for "
                              "expert %d", q, (long long)v, d->e_lo + e);
            p->from[q * El + e] = v;
            n += padded(v, p->align);
        }
        if (n > 0x7fffffff) n = 0x7fffffff; /* refused below */
        p->local_rows[e] = (int)n;
        Rl += n;
    }
    if (Rl > p->Rl_cap)
        return MT_ERR(MT_EINVAL, "expert dispatch: %lld rows arrive for experts [%d, %d), the "
                      "buffer holds %lld", (long long)Rl, d->e_lo, d->e_lo + El,
                      (long long)p->Rl_cap);
    p->R = (int)R;
    p->Rl = (int)Rl;
    return MT_OK;
}

/* First row of each local segment in the local layout. */
static void segments(a2a *x, const mt_moe_plan *p)
{
    x->seg[0] = 0;
    for (int e = 0; e < p->E_local; e++) x->seg[e + 1] = x->seg[e] + p->local_rows[e];
}

/* First row of peer q's chunk of local expert e: the chunks of the peers
 * before it, each padded. */
static int64_t chunk_row(const a2a *x, const mt_moe_plan *p, int q, int e)
{
    int64_t row = x->seg[e];
    for (int q2 = 0; q2 < q; q2++) row += padded(p->from[q2 * p->E_local + e], p->align);
    return row;
}

/* Rows of local experts [e0, e1) in v[q * E_local + e] (plan->to: what
 * this rank sends peer q for them; plan->from: what q sends this rank). */
static int64_t part_rows(const int64_t *v, int q, int El, int e0, int e1)
{
    int64_t n = 0;
    for (int e = e0; e < e1; e++) n += v[q * El + e];
    return n;
}

/* First row, in the source layout, of the rows for peer q's experts
 * [e0, E_local) (its owner's run, skipping the experts before e0). */
static int64_t part_src_row(const a2a *x, const mt_moe_plan *p, int q, int e0)
{
    return run_off(x, p, q) + part_rows(p->to, q, p->E_local, 0, e0);
}

/* The send buffer from the tokens: row r of the source layout is token
 * src[r] of x (no padding travels: src[r] >= 0 for r < R). */
static int pack_gather(const a2a *x, void *dst, const float *tok, const int32_t *src, int64_t R,
                       int D)
{
    for (int64_t r = 0; r < R; r++)
        if (src[r] < 0)
            return MT_ERR(MT_EINVAL, "expert dispatch: source row %lld is padding (the source "
                          "layout must be unpadded when rows travel)", (long long)r);
    const size_t row_bytes = (size_t)D * x->wsize;
#pragma omp parallel for schedule(static) if (R * D > (1 << 16))
    for (int64_t r = 0; r < R; r++)
        to_wire(x, (char *)dst + (size_t)r * row_bytes, tok + (int64_t)src[r] * D, 1, D);
    return MT_OK;
}

/* ---- exchanges of a part of the local experts, started and finished apart ----
 *
 * Every exchange is one part [e0, e1) of the local experts (all of them
 * for the plain dispatch and combine): the rows of every owner's experts
 * [e0, e1) travel, and land at their places in the local layout (segments
 * [e0, e1), whose rows are contiguous) or in the source layout (each
 * owner's run of those experts, contiguous). A start packs and starts the
 * all-to-all-v (mt_comm_all_to_all_v_start); finish waits for it and
 * unpacks. One exchange is in flight per dispatcher; the counts and
 * displacements of x (sc..rd) belong to it until finish. */

static int check_idle(const a2a *x, const char *what)
{
    if (x->pend.kind != PEND_NONE)
        return MT_ERR(MT_EINVAL, "expert dispatch: %s while an exchange is in flight (finish "
                      "it first: one at a time per dispatcher)", what);
    return MT_OK;
}

static int check_part(const mt_moe_dispatcher *d, int e0, int e1)
{
    const a2a *x = impl_of(d);
    if (e0 < 0 || e1 < e0 || e1 > d->E_local)
        return MT_ERR(MT_EINVAL, "expert dispatch: part [%d, %d) of %d local experts", e0, e1,
                      d->E_local);
    if (x->T > 1 && (e0 != 0 || e1 != d->E_local))
        return MT_ERR(MT_ENOTSUP, "expert dispatch: a part [%d, %d) of the local experts with "
                      "expert tensor parallelism (etp %d): the slices' sums run over whole "
                      "exchanges", e0, e1, x->T);
    return MT_OK;
}

/* The part's counts and displacements (elements of `el` per row):
 * dispatch: send the rows to each peer's experts, receive the rows for
 * mine; combine: the reverse. Returns the element totals. */
static void part_counts(a2a *x, const mt_moe_plan *p, int e0, int e1, int combine, size_t el,
                        size_t *s_out, size_t *r_out)
{
    const int P = x->P, El = p->E_local;
    size_t s = 0, r = 0;
    for (int q = 0; q < P; q++) {
        const int64_t to = part_rows(p->to, q, El, e0, e1), from = part_rows(p->from, q, El, e0, e1);
        x->sc[q] = (size_t)(combine ? from : to) * el;
        x->sd[q] = s;
        x->rc[q] = (size_t)(combine ? to : from) * el;
        x->rd[q] = r;
        s += x->sc[q];
        r += x->rc[q];
    }
    *s_out = s;
    *r_out = r;
}

static int start_exchange(a2a *x, const void *send, void *recv, mt_comm_dtype dt, size_t s,
                          size_t r, size_t es)
{
    x->bytes_sent += (int64_t)((s - x->sc[x->me]) * es);
    x->bytes_recv += (int64_t)((r - x->rc[x->me]) * es);
    MT_CHECK(exchange_begin(x));
    return mt_comm_all_to_all_v_start(x->c, send, x->sc, x->sd, recv, x->rc, x->rd, dt,
                                      &x->pend.req);
}

static int a2a_dispatch_start(mt_moe_dispatcher *d, mt_backend *be, const mt_moe_plan *p,
                              int e0, int e1, void *xl_buf, const void *xp, const void *x_tok,
                              const int32_t *src, int D)
{
    a2a *x = impl_of(d);
    const int P = x->P;
    MT_CHECK(check_idle(x, "dispatch"));
    MT_CHECK(check_backend(d, be));
    MT_CHECK(check_part(d, e0, e1));
    const int full = e0 == 0 && e1 == d->E_local;
    size_t s, r;
    part_counts(x, p, e0, e1, 0, (size_t)D, &s, &r);
    const void *send = xp;
    void *recv;
    if (x->direct) {
        if (x_tok) { /* the layer's permutation fused into the pack */
            MT_CHECK(bgrow(x, &x->bsend, &x->bsend_cap, s * x->wsize + 1));
            if (x->T == 1 && full) {
                MT_CHECK(be->moe_permute(be, x->bsend, x_tok, src, p->R, D));
            } else { /* each peer's rows (an owner's run once per slice) */
                for (int q = 0; q < P; q++)
                    if (x->sc[q] > 0)
                        MT_CHECK(be->moe_permute(be, (char *)x->bsend + x->sd[q] * x->wsize,
                                                 x_tok, src + part_src_row(x, p, q, e0),
                                                 (int)(x->sc[q] / (size_t)D), D));
            }
            send = x->bsend;
        } else {
            /* xp as it is: the slices of one owner read the same run */
            for (int q = 0; q < P; q++) x->sd[q] = (size_t)part_src_row(x, p, q, e0) * D;
        }
        MT_CHECK(bgrow(x, &x->brecv, &x->brecv_cap, r * x->wsize + 1));
        recv = x->brecv;
    } else {
        MT_CHECK(grow(&x->rbuf, &x->rcap, r * x->wsize + 1));
        recv = x->rbuf;
        if (x_tok) { /* the permutation and the conversion in one pass */
            MT_CHECK(grow(&x->sbuf, &x->scap, s * x->wsize + 1));
            for (int q = 0; q < P; q++) /* each owner's run once per slice */
                MT_CHECK(pack_gather(x, (char *)x->sbuf + x->sd[q] * x->wsize, x_tok,
                                     src + part_src_row(x, p, q, e0),
                                     (int64_t)(x->sc[q] / (size_t)D), D));
            send = x->sbuf;
        } else {
            /* the source layout: the slices of one owner read the same run */
            for (int q = 0; q < P; q++) x->sd[q] = (size_t)part_src_row(x, p, q, e0) * D;
            if (x->wire != MT_COMM_F32) {
                MT_CHECK(grow(&x->sbuf, &x->scap, (size_t)p->R * D * x->wsize + 1));
                if (full) {
                    to_wire(x, x->sbuf, xp, p->R, D);
                } else {
                    for (int q = 0; q < P; q++)
                        to_wire(x, (char *)x->sbuf + x->sd[q] * x->wsize,
                                (const float *)xp + x->sd[q], (int64_t)(x->sc[q] / (size_t)D),
                                D);
                }
                send = x->sbuf;
            }
        }
    }
    MT_CHECK(start_exchange(x, send, recv, x->wire, s, r, x->wsize));
    x->pend = (struct pend){PEND_DISPATCH, p, e0, e1, D, xl_buf, NULL, NULL, NULL, x->pend.req};
    return MT_OK;
}

/* Dispatch arrived: unpack expert-contiguous into segments [e0, e1):
 * segment e = peer 0's chunk of rows for e, peer 1's, ..., each chunk
 * followed by its zero padding (peer q's block holds its rows for my
 * experts [e0, e1) in order). */
static int finish_dispatch(a2a *x, const struct pend *w)
{
    const mt_moe_plan *p = w->p;
    const int P = x->P, El = p->E_local, D = w->D, e0 = w->e0, e1 = w->e1;
    segments(x, p);
    const int64_t n_rows = x->seg[e1] - x->seg[e0];
    if (x->direct) {
        mt_backend *be = x->be;
        MT_CHECK(map_grow(x, n_rows));
        int64_t at = 0;
        for (int e = e0; e < e1; e++)
            for (int q = 0; q < P; q++) {
                const int64_t first = (int64_t)(x->rd[q] / (size_t)D) +
                                      part_rows(p->from, q, El, e0, e);
                const int64_t n = p->from[q * El + e], pad = padded(n, p->align) - n;
                for (int64_t i = 0; i < n; i++) x->map[at++] = (int32_t)(first + i);
                for (int64_t i = 0; i < pad; i++) x->map[at++] = -1;
            }
        MT_CHECK(map_upload(x, n_rows));
        return be->moe_permute(be, (char *)w->out + (size_t)x->seg[e0] * D * mt_act_size(be),
                               x->brecv, x->bmap, (int)n_rows, D);
    }
    float *out = w->out;
    for (int q = 0; q < P; q++) {
        const char *blk = (const char *)x->rbuf + x->rd[q] * x->wsize;
        int64_t at = 0; /* rows of q's block before expert e */
        for (int e = e0; e < e1; e++) {
            const int64_t n = p->from[q * El + e], row = chunk_row(x, p, q, e);
            from_wire(x, out + row * D, blk + (size_t)(at * D) * x->wsize, n, D);
            const int64_t pad = padded(n, p->align) - n;
            if (pad > 0) memset(out + (row + n) * D, 0, (size_t)(pad * D) * 4);
            at += n;
        }
    }
    return MT_OK;
}

static int a2a_dispatch_fp8_start(mt_moe_dispatcher *d, mt_backend *be, const mt_moe_plan *p,
                                  int e0, int e1, uint8_t *ql, float *sl, void *xl_buf,
                                  const uint8_t *xq, const float *xs, int N, const int32_t *src,
                                  int D)
{
    a2a *x = impl_of(d);
    const int P = x->P;
    MT_CHECK(check_idle(x, "dispatch (fp8)"));
    MT_CHECK(check_backend(d, be));
    MT_CHECK(check_part(d, e0, e1));
    if (!be->moe_pack_fp8 || !be->moe_unpack_fp8)
        return MT_ERR(MT_ENOTSUP, "expert dispatch: the %s backend has no FP8 row packing",
                      be->name);
    const int full = e0 == 0 && e1 == d->E_local;
    const size_t W = mt_fp8_wire_row_bytes(D); /* BYTE elements per row */
    size_t s, r;
    part_counts(x, p, e0, e1, 0, W, &s, &r);
    MT_CHECK(bgrow(x, &x->bsend, &x->bsend_cap, s + 1));
    if (x->T == 1 && full) {
        MT_CHECK(be->moe_pack_fp8(be, x->bsend, xq, xs, src, N, p->R, D));
    } else { /* each peer's rows (an owner's run once per slice) */
        for (int q = 0; q < P; q++)
            if (x->sc[q] > 0)
                MT_CHECK(be->moe_pack_fp8(be, (uint8_t *)x->bsend + x->sd[q], xq, xs,
                                          src + part_src_row(x, p, q, e0), N,
                                          (int)(x->sc[q] / W), D));
    }
    MT_CHECK(bgrow(x, &x->brecv, &x->brecv_cap, r + 1));
    MT_CHECK(start_exchange(x, x->bsend, x->brecv, MT_COMM_BYTE, s, r, 1));
    x->pend = (struct pend){PEND_FP8, p, e0, e1, D, xl_buf, ql, sl, NULL, x->pend.req};
    return MT_OK;
}

/* FP8 dispatch arrived: local row j of segments [e0, e1) gets its wire row
 * (-1: padding) and the place of its scales in quant_rows' layout of the
 * local segments: base KB r_g + (j - r_g), stride rows[g]. */
static int finish_dispatch_fp8(a2a *x, const struct pend *w)
{
    const mt_moe_plan *p = w->p;
    mt_backend *be = x->be;
    const int P = x->P, El = p->E_local, D = w->D, e0 = w->e0, e1 = w->e1, KB = (D + 127) / 128;
    const size_t W = mt_fp8_wire_row_bytes(D);
    segments(x, p);
    const int64_t j0 = x->seg[e0], n_rows = x->seg[e1] - j0;
    MT_CHECK(map_grow(x, 3 * n_rows));
    int64_t at = 0; /* from j0 */
    for (int e = e0; e < e1; e++)
        for (int q = 0; q < P; q++) {
            const int64_t first = (int64_t)(x->rd[q] / W) + part_rows(p->from, q, El, e0, e);
            const int64_t n = p->from[q * El + e], tot = padded(n, p->align);
            for (int64_t i = 0; i < tot; i++, at++) {
                x->map[3 * at] = i < n ? (int32_t)(first + i) : -1;
                x->map[3 * at + 1] = (int32_t)(KB * x->seg[e] + (j0 + at - x->seg[e]));
                x->map[3 * at + 2] = p->local_rows[e];
            }
        }
    MT_CHECK(map_upload(x, 3 * n_rows));
    return be->moe_unpack_fp8(be, w->ql + (size_t)j0 * D, w->sl,
                              (char *)w->out + (size_t)j0 * D * mt_act_size(be), x->brecv,
                              x->bmap, (int)n_rows, D);
}

static int a2a_combine_start(mt_moe_dispatcher *d, mt_backend *be, const mt_moe_plan *p, int e0,
                             int e1, void *yp, const void *yl, int D)
{
    a2a *x = impl_of(d);
    const int P = x->P, El = d->E_local;
    MT_CHECK(check_idle(x, "combine"));
    MT_CHECK(check_backend(d, be));
    MT_CHECK(check_part(d, e0, e1));
    /* receive: slice t's partial outputs of every owner's run land in
     * block t [R, D] at the run's rows; yp = block 0 + block 1 + ... (in
     * slice order; T = 1: block 0 is yp, and the part's rows of each
     * owner's run land where they belong) */
    const int T = x->T;
    const size_t RD = (size_t)p->R * D;
    size_t s, r;
    part_counts(x, p, e0, e1, 1, (size_t)D, &s, &r);
    for (int q = 0; q < P; q++)
        x->rd[q] = (size_t)(q % T) * RD + (size_t)part_src_row(x, p, q, e0) * D;
    segments(x, p);
    void *recv = yp;
    if (x->direct) {
        if (T > 1) {
            MT_CHECK(bgrow(x, &x->brecv, &x->brecv_cap, T * RD * x->wsize + 1));
            recv = x->brecv;
        }
        /* one gather packs the local rows per destination (padding left
         * behind); they land in the source layout as they are */
        const int64_t S = (int64_t)(s / (size_t)D);
        MT_CHECK(map_grow(x, S));
        int64_t at = 0;
        for (int q = 0; q < P; q++)
            for (int e = e0; e < e1; e++) {
                const int64_t n = p->from[q * El + e], row = chunk_row(x, p, q, e);
                for (int64_t i = 0; i < n; i++) x->map[at++] = (int32_t)(row + i);
            }
        MT_CHECK(map_upload(x, S));
        MT_CHECK(bgrow(x, &x->bsend, &x->bsend_cap, s * x->wsize + 1));
        MT_CHECK(be->moe_permute(be, x->bsend, yl, x->bmap, (int)S, D));
        MT_CHECK(start_exchange(x, x->bsend, recv, x->wire, s, r, x->wsize));
    } else {
        MT_CHECK(grow(&x->sbuf, &x->scap, s * x->wsize + 1));
        /* pack per destination, the reverse of the dispatch's unpack */
        const float *in = yl;
        for (int q = 0; q < P; q++) {
            char *blk = (char *)x->sbuf + x->sd[q] * x->wsize;
            int64_t at = 0;
            for (int e = e0; e < e1; e++) {
                const int64_t n = p->from[q * El + e], row = chunk_row(x, p, q, e);
                to_wire(x, blk + (size_t)(at * D) * x->wsize, in + row * D, n, D);
                at += n;
            }
        }
        if (x->wire != MT_COMM_F32 || T > 1) {
            MT_CHECK(grow(&x->rbuf, &x->rcap, T * RD * x->wsize + 1));
            recv = x->rbuf;
        }
        MT_CHECK(start_exchange(x, x->sbuf, recv, x->wire, s, r, x->wsize));
    }
    x->pend = (struct pend){PEND_COMBINE, p, e0, e1, D, yp, NULL, NULL, recv, x->pend.req};
    return MT_OK;
}

/* Combine arrived: the slices' partial sums (etp), or the wire's rows
 * converted into the source layout. */
static int finish_combine(a2a *x, const struct pend *w)
{
    const mt_moe_plan *p = w->p;
    mt_backend *be = x->be;
    const int T = x->T, D = w->D;
    const size_t RD = (size_t)p->R * D;
    if (x->direct) {
        for (int t = 1; t < T && RD > 0; t++)
            MT_CHECK(be->add(be, w->out, t == 1 ? w->recv : w->out,
                             (char *)w->recv + t * RD * x->wsize, (int64_t)RD));
        return MT_OK;
    }
    if (w->recv != w->out) {
        if (T > 1) { /* block 0: every owner's run, [0, R) */
            from_wire(x, w->out, w->recv, p->R, D);
        } else {
            for (int q = 0; q < x->P; q++)
                from_wire(x, (float *)w->out + x->rd[q],
                          (const char *)w->recv + x->rd[q] * x->wsize,
                          (int64_t)(x->rc[q] / (size_t)D), D);
        }
    }
    if (T > 1) { /* the slices' partial sums in slice order, each sum an act value */
        float *y = w->out, tmp;
        uint16_t h;
        for (int t = 1; t < T; t++) {
            const char *blk = (const char *)w->recv + t * RD * x->wsize;
            for (size_t i = 0; i < RD; i++) {
                from_wire(x, &tmp, blk + i * x->wsize, 1, 1);
                y[i] += tmp;
                if (be->round_bf16) {
                    f32_to_bf16(&h, &y[i], 1);
                    bf16_to_f32(&y[i], &h, 1);
                }
            }
        }
    }
    return MT_OK;
}

static int a2a_finish(mt_moe_dispatcher *d)
{
    a2a *x = impl_of(d);
    struct pend w = x->pend;
    x->pend = (struct pend){0};
    if (w.kind == PEND_NONE)
        return MT_ERR(MT_EINVAL, "expert dispatch: finish without an exchange in flight");
    MT_CHECK(mt_comm_wait(w.req));
    MT_CHECK(exchange_end(x));
    switch (w.kind) {
    case PEND_DISPATCH: return finish_dispatch(x, &w);
    case PEND_FP8: return finish_dispatch_fp8(x, &w);
    default: return finish_combine(x, &w);
    }
}

static int a2a_counts(mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p, const int *rows)
{
    MT_CHECK(check_idle(impl_of(d), "count exchange"));
    MT_CHECK(check_backend(d, be));
    return exchange_counts(d, p, rows);
}

/* ---- the plain exchanges: every local expert, started and finished at once ---- */

static int a2a_dispatch(mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p, int count,
                        void **xl, void *xl_buf, const void *xp, const void *x_tok,
                        const int32_t *src, const int *rows, int D)
{
    if (count) MT_CHECK(a2a_counts(d, be, p, rows));
    MT_CHECK(a2a_dispatch_start(d, be, p, 0, d->E_local, xl_buf, xp, x_tok, src, D));
    MT_CHECK(a2a_finish(d));
    *xl = xl_buf;
    return MT_OK;
}

static int a2a_dispatch_fp8(mt_moe_dispatcher *d, mt_backend *be, mt_moe_plan *p, uint8_t *ql,
                            float *sl, void *xl_buf, const uint8_t *xq, const float *xs, int N,
                            const int32_t *src, const int *rows, int D)
{
    MT_CHECK(a2a_counts(d, be, p, rows));
    MT_CHECK(a2a_dispatch_fp8_start(d, be, p, 0, d->E_local, ql, sl, xl_buf, xq, xs, N, src, D));
    return a2a_finish(d);
}

static int a2a_combine(mt_moe_dispatcher *d, mt_backend *be, const mt_moe_plan *p, void *yp,
                       const void *yl, int D)
{
    MT_CHECK(a2a_combine_start(d, be, p, 0, d->E_local, yp, yl, D));
    return a2a_finish(d);
}

static void a2a_destroy(mt_moe_dispatcher *d)
{
    if (!d) return;
    a2a *x = d->impl;
    if (x) {
        if (x->pend.req) mt_comm_wait(x->pend.req); /* an exchange left in flight (an error) */
        free(x->sc);
        free(x->sd);
        free(x->rc);
        free(x->rd);
        free(x->cnt_send);
        free(x->cnt_recv);
        free(x->seg);
        free(x->sbuf);
        free(x->rbuf);
        free(x->map);
        if (x->be) {
            void *b[] = {x->bsend, x->brecv, x->bmap};
            for (int i = 0; i < 3; i++)
                if (b[i]) x->be->free(x->be, b[i]);
        }
        free(x);
    }
    free(d);
}

int mt_moe_dispatch_a2a(mt_moe_dispatcher **out, mt_comm *ep, int E, mt_comm_dtype wire)
{
    return mt_moe_dispatch_a2a_etp(out, ep, E, 1, wire);
}

int mt_moe_dispatch_a2a_etp(mt_moe_dispatcher **out, mt_comm *ep, int E, int etp,
                            mt_comm_dtype wire)
{
    *out = NULL;
    const int P = mt_comm_size(ep);
    if (etp < 1 || P % etp != 0)
        return MT_ERR(MT_EINVAL, "expert dispatch: etp %d does not divide the %d ranks of the "
                      "exchange", etp, P);
    const int EP = P / etp;
    if (E < 1 || E % EP != 0)
        return MT_ERR(MT_EINVAL, "expert dispatch: ep %d does not divide %d experts", EP, E);
    if (wire != MT_COMM_F32 && wire != MT_COMM_BF16)
        return MT_ERR(MT_EINVAL, "expert dispatch: wire type %s (f32 or bf16)",
                      mt_comm_dtype_name(wire));
    mt_moe_dispatcher *d = calloc(1, sizeof *d);
    a2a *x = calloc(1, sizeof *x);
    if (!d || !x) {
        free(d);
        free(x);
        return MT_ERR(MT_ENOMEM, "expert dispatch: out of memory");
    }
    d->impl = x;
    d->E = E;
    d->ep = P;
    d->etp = etp;
    d->etp_rank = mt_comm_rank(ep) % etp;
    d->E_local = E / EP;
    d->e_lo = mt_comm_rank(ep) / etp * d->E_local;
    d->dispatch = a2a_dispatch;
    d->dispatch_fp8 = a2a_dispatch_fp8;
    d->combine = a2a_combine;
    d->counts = a2a_counts;
    d->dispatch_start = a2a_dispatch_start;
    d->dispatch_fp8_start = a2a_dispatch_fp8_start;
    d->combine_start = a2a_combine_start;
    d->finish = a2a_finish;
    d->destroy = a2a_destroy;
    x->c = ep;
    x->wire = wire;
    x->wsize = mt_comm_dtype_size(wire);
    x->P = P;
    x->T = etp;
    x->me = mt_comm_rank(ep);
    x->sc = calloc((size_t)P, sizeof *x->sc);
    x->sd = calloc((size_t)P, sizeof *x->sd);
    x->rc = calloc((size_t)P, sizeof *x->rc);
    x->rd = calloc((size_t)P, sizeof *x->rd);
    x->cnt_send = calloc((size_t)P * d->E_local, sizeof *x->cnt_send);
    x->cnt_recv = calloc((size_t)P * d->E_local, sizeof *x->cnt_recv);
    x->seg = calloc((size_t)d->E_local + 1, sizeof *x->seg);
    if (!x->sc || !x->sd || !x->rc || !x->rd || !x->cnt_send || !x->cnt_recv || !x->seg) {
        a2a_destroy(d);
        return MT_ERR(MT_ENOMEM, "expert dispatch: out of memory");
    }
    *out = d;
    return MT_OK;
}

void mt_moe_a2a_bytes(const mt_moe_dispatcher *d, int64_t *sent, int64_t *received)
{
    const a2a *x = d && d->dispatch == a2a_dispatch ? d->impl : NULL;
    *sent = x ? x->bytes_sent : 0;
    *received = x ? x->bytes_recv : 0;
}
