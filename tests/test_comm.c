/* test_comm.c - every op of the comm interface (engine/parallel/comm.h)
 * against a sequential reference that each rank computes on its own.
 *
 *   test_comm [--backend local|mpi|staged|nccl|auto] [--mem host|device]
 *
 * Run alone (local backend) or under mpirun -np N (mpi, and in the GPU
 * build, staged and nccl). Every rank can generate every rank's input (a
 * hash of seed, rank and index), so each computes the expected output of
 * each op by simulating all ranks in rank order, and compares its own
 * result bit for bit. Properties checked, each by name in a failure line:
 *  - all_reduce / reduce_scatter, sum max min, for i32 i64 f32 f64 bf16
 *    e4m3, in and out of place, counts 0, 1, odd, fewer than the ranks,
 *    and large: integer and exact float inputs give the reference exactly
 *    on every backend; random float inputs give the rank-ordered sum
 *    (accumulated in f32 / f64, rounded once) exactly where the backend is
 *    rank ordered, else a value within the summation error bound; and the
 *    same bits on every rank (gathered and compared);
 *  - all_gather (in and out of place), all_gather_v and gather_v (every
 *    root, zero counts, displacements out of order with gaps: the gaps stay
 *    untouched), all_to_all_v and its started form (per-pair counts with
 *    zeros, gaps; start, test, wait), broadcast
 *    from every root, send / recv around a ring, sendrecv both ways;
 *    pipeline messages (refused before mt_comm_pipe_open; tagged, buffered
 *    isend; receives in another order; both sides sending first; a
 *    received message sent on from its buffer with no host wait);
 *  - split: group sizes, ranks ordered by key, NO_COLOR gives none, ops on
 *    the new groups; the process groups of every layout that fits the
 *    world: each rank's position is its coordinate and each group holds
 *    exactly the ranks the layout puts there; agree; argument errors name
 *    the op.
 * mpi and staged repeat everything with 20-byte messages, so every
 * transfer is cut into many pieces (the path of counts above INT_MAX).
 * Device memory (--mem device, GPU build): buffers live on the GPU,
 * checked after download; also an overlapped op on a side stream, and ops
 * ordered on a non-blocking compute stream with no host wait (collectives,
 * and two pipeline messages received back to back).
 * Exit: 0 all passed, 1 a check failed (on any rank), 77 skipped (no GPU,
 * or fewer GPUs than ranks for nccl).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include "base/mt_status.h"
#include "engine/parallel/comm.h"
#include "engine/parallel/groups.h"
#include "kernels/mt_fp8.h"

#ifdef TEST_COMM_GPU
#include <cuda_runtime.h>
#endif

static int RANK, SIZE, n_pass, n_fail;
static int MEM_DEVICE;

#define FAIL(...)                                                                        \
    do {                                                                                 \
        n_fail++;                                                                        \
        fprintf(stderr, "FAIL rank %d/%d: ", RANK, SIZE);                                \
        fprintf(stderr, __VA_ARGS__);                                                    \
        fputc('\n', stderr);                                                             \
    } while (0)

#define MUST(stmt)                                                                       \
    do {                                                                                 \
        int rc_ = (stmt);                                                                \
        if (rc_ < 0) {                                                                   \
            fprintf(stderr, "rank %d: %s: %s\n", RANK, #stmt, mt_errmsg());              \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

/* ---- buffers in the comm's memory -------------------------------------------------- */

static void *buf_alloc(size_t bytes)
{
    if (bytes == 0) bytes = 1;
#ifdef TEST_COMM_GPU
    if (MEM_DEVICE) {
        void *p = NULL;
        if (cudaMalloc(&p, bytes) != cudaSuccess) {
            fprintf(stderr, "cudaMalloc %zu failed\n", bytes);
            exit(1);
        }
        return p;
    }
#endif
    void *p = malloc(bytes);
    if (!p) exit(1);
    return p;
}

static void buf_free(void *p)
{
#ifdef TEST_COMM_GPU
    if (MEM_DEVICE) {
        cudaFree(p);
        return;
    }
#endif
    free(p);
}

static void buf_put(void *dst, const void *host, size_t bytes)
{
    if (bytes == 0) return;
#ifdef TEST_COMM_GPU
    if (MEM_DEVICE) {
        cudaMemcpy(dst, host, bytes, cudaMemcpyHostToDevice);
        return;
    }
#endif
    memcpy(dst, host, bytes);
}

static void buf_get(void *host, const void *src, size_t bytes)
{
    if (bytes == 0) return;
#ifdef TEST_COMM_GPU
    if (MEM_DEVICE) {
        if (cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
            fprintf(stderr, "cudaMemcpy down failed\n");
            exit(1);
        }
        return;
    }
#endif
    memcpy(host, src, bytes);
}

/* ---- inputs: any rank's, from a hash -------------------------------------------------- */

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t hash3(uint64_t seed, int r, size_t i)
{
    return mix(mix(seed * 1000003u + (uint64_t)r) ^ (uint64_t)i);
}

/* Element i of rank r's input. exact: small integers (every partial sum of
 * up to 4 ranks exact in every type, e4m3 included); else random values of
 * mixed magnitude (integers: full range, sums wrap). No -0, no NaN. */
static void gen_one(void *out, mt_comm_dtype dt, uint64_t seed, int r, size_t i, int exact)
{
    uint64_t h = hash3(seed, r, i);
    int small = (int)(h % 9) - 4; /* -4..4 */
    double u = (double)(h >> 11) * 0x1p-53 * 2.0 - 1.0;
    double mag = u * (double)(1 << (int)((h >> 3) % 8)) / 16.0;
    if (mag == 0.0) mag = 0.5;
    switch (dt) {
    case MT_COMM_BYTE: *(uint8_t *)out = (uint8_t)h; break;
    case MT_COMM_I32: *(int32_t *)out = exact ? small : (int32_t)(uint32_t)h; break;
    case MT_COMM_I64: *(int64_t *)out = exact ? small : (int64_t)h; break;
    case MT_COMM_F32: *(float *)out = exact ? (float)small * 0.5f : (float)mag; break;
    case MT_COMM_F64: *(double *)out = exact ? small * 0.25 : mag; break;
    case MT_COMM_BF16:
        *(uint16_t *)out = mt_bf16_from_f32(exact ? (float)small : (float)mag);
        if (*(uint16_t *)out == 0x8000) *(uint16_t *)out = 0;
        break;
    case MT_COMM_E4M3: {
        uint8_t q = exact ? mt_e4m3_from_f32((float)small) : (uint8_t)(h >> 40);
        if ((q & 0x7f) == 0x7f || q == 0x80) q = 0; /* no NaN, no -0 */
        *(uint8_t *)out = q;
        break;
    }
    default: break;
    }
}

static void gen(void *buf, mt_comm_dtype dt, size_t n, uint64_t seed, int r, size_t first, int exact)
{
    size_t es = mt_comm_dtype_size(dt);
    for (size_t i = 0; i < n; i++) gen_one((char *)buf + i * es, dt, seed, r, first + i, exact);
}

/* ---- the reference reduction: rank order, one rounding ---------------------------------- */

static double to_f64(mt_comm_dtype dt, const void *p)
{
    switch (dt) {
    case MT_COMM_F32: return *(const float *)p;
    case MT_COMM_F64: return *(const double *)p;
    case MT_COMM_BF16: return mt_bf16_to_f32(*(const uint16_t *)p);
    case MT_COMM_E4M3: return mt_e4m3_to_f32(*(const uint8_t *)p);
    default: return 0;
    }
}

static void from_f64(mt_comm_dtype dt, void *p, double v)
{
    switch (dt) {
    case MT_COMM_F32: *(float *)p = (float)v; break;
    case MT_COMM_F64: *(double *)p = v; break;
    case MT_COMM_BF16: *(uint16_t *)p = mt_bf16_from_f32((float)v); break;
    case MT_COMM_E4M3: *(uint8_t *)p = mt_e4m3_from_f32((float)v); break;
    default: break;
    }
}

/* Element `i` of op over ranks 0..n-1 of gen(seed, r, i). */
static void ref_one(void *out, mt_comm_dtype dt, mt_comm_op op, uint64_t seed, int n, size_t i,
                    int exact)
{
    union { int32_t i32; int64_t i64; float f; double d; uint16_t h; uint8_t q; } x;
    if (dt == MT_COMM_I32 || dt == MT_COMM_I64) {
        uint64_t su = 0;
        int64_t m = 0;
        for (int r = 0; r < n; r++) {
            gen_one(&x, dt, seed, r, i, exact);
            int64_t v = dt == MT_COMM_I32 ? x.i32 : x.i64;
            su += (uint64_t)v;
            if (r == 0 || (op == MT_COMM_MAX ? v > m : v < m)) m = v;
        }
        int64_t res = op == MT_COMM_SUM ? (int64_t)su : m;
        if (dt == MT_COMM_I32) *(int32_t *)out = (int32_t)(uint32_t)(uint64_t)res;
        else *(int64_t *)out = res;
        return;
    }
    if (dt == MT_COMM_F64) {
        double acc = 0;
        for (int r = 0; r < n; r++) {
            gen_one(&x, dt, seed, r, i, exact);
            if (r == 0) acc = x.d;
            else if (op == MT_COMM_SUM) acc = acc + x.d;
            else if (op == MT_COMM_MAX ? x.d > acc : x.d < acc) acc = x.d;
        }
        *(double *)out = acc;
        return;
    }
    float acc = 0; /* f32, bf16, e4m3: accumulate in f32 */
    for (int r = 0; r < n; r++) {
        gen_one(&x, dt, seed, r, i, exact);
        float v = (float)to_f64(dt, &x);
        if (r == 0) acc = v;
        else if (op == MT_COMM_SUM) acc = acc + v;
        else if (op == MT_COMM_MAX ? v > acc : v < acc) acc = v;
    }
    from_f64(dt, out, acc);
}

/* For a backend that sums in its own order: the exact sum S (in double,
 * exact enough for these magnitudes) and the bound B = n * eps * sum |x|
 * on any order's error; the result must round within [S - B, S + B]. */
static int sum_within_bound(const void *got, mt_comm_dtype dt, uint64_t seed, int n, size_t i)
{
    union { float f; double d; uint16_t h; uint8_t q; } x;
    double s = 0, a = 0, eps = dt == MT_COMM_F64 ? 0x1p-53 : 0x1p-24;
    for (int r = 0; r < n; r++) {
        gen_one(&x, dt, seed, r, i, 0);
        double v = to_f64(dt, &x);
        s += v;
        a += v < 0 ? -v : v;
    }
    double b = n * eps * a, g = to_f64(dt, got);
    union { float f; double d; uint16_t h; uint8_t q; } lo, hi;
    from_f64(dt, &lo, s - b);
    from_f64(dt, &hi, s + b);
    return g >= to_f64(dt, &lo) && g <= to_f64(dt, &hi);
}

/* ---- checks ---------------------------------------------------------------------------- */

static mt_comm *C;       /* the communicator under test */
static const char *LABEL = "";

/* The same bytes on every rank of c (gathered on its host companion). */
static void check_same_everywhere(mt_comm *c, const void *host, size_t bytes, const char *what)
{
    int n = mt_comm_size(c);
    char *all = malloc(bytes * (size_t)n + 1);
    MUST(mt_comm_all_gather(mt_comm_host(c), host, all, bytes, MT_COMM_BYTE));
    for (int r = 1; r < n; r++)
        if (memcmp(all, all + (size_t)r * bytes, bytes) != 0) {
            FAIL("%s%s: rank %d's result differs from rank 0's", LABEL, what, r);
            free(all);
            return;
        }
    n_pass++;
    free(all);
}

static void report_elem(const char *what, mt_comm_dtype dt, size_t i, const void *want,
                        const void *got)
{
    size_t es = mt_comm_dtype_size(dt);
    uint64_t w = 0, g = 0;
    memcpy(&w, want, es);
    memcpy(&g, got, es);
    FAIL("%s%s: element %zu is 0x%llx, expected 0x%llx", LABEL, what, i, (unsigned long long)g,
         (unsigned long long)w);
}

static const mt_comm_dtype RED_TYPES[] = {MT_COMM_I32, MT_COMM_I64, MT_COMM_F32,
                                          MT_COMM_F64, MT_COMM_BF16, MT_COMM_E4M3};

/* all_reduce: result vs reference; every rank the same. */
static void t_all_reduce(mt_comm *c, mt_comm_dtype dt, mt_comm_op op, size_t count, int in_place,
                         int exact, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    const size_t es = mt_comm_dtype_size(dt), b = count * es;
    char what[128];
    snprintf(what, sizeof what, "all_reduce %s %s count %zu%s%s", mt_comm_dtype_name(dt),
             mt_comm_op_name(op), count, in_place ? " in place" : "", exact ? " exact" : "");
    char *in = malloc(b + 1), *out = malloc(b + 1), *want = malloc(b + 1);
    gen(in, dt, count, seed, me, 0, exact);
    void *ds = buf_alloc(b), *dr = in_place ? ds : buf_alloc(b);
    buf_put(ds, in, b);
    int rc = mt_comm_all_reduce(c, ds, dr, count, dt, op);
    if (rc < 0) FAIL("%s%s: %s", LABEL, what, mt_errmsg());
    buf_get(out, dr, b);
    int strict = exact || op != MT_COMM_SUM || dt == MT_COMM_I32 || dt == MT_COMM_I64 ||
                 mt_comm_rank_ordered(c);
    int ok = rc == 0;
    for (size_t i = 0; i < count && ok; i++) {
        ref_one(want + i * es, dt, op, seed, n, i, exact);
        if (strict ? memcmp(want + i * es, out + i * es, es) != 0
                   : !sum_within_bound(out + i * es, dt, seed, n, i)) {
            report_elem(what, dt, i, want + i * es, out + i * es);
            ok = 0;
        }
    }
    if (ok) n_pass++;
    check_same_everywhere(c, out, b, what);
    if (!in_place) buf_free(dr);
    buf_free(ds);
    free(in), free(out), free(want);
}

/* reduce_scatter: rank r's block r of the reduced vector. */
static void t_reduce_scatter(mt_comm *c, mt_comm_dtype dt, mt_comm_op op, size_t count, int in_place,
                             int exact, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    const size_t es = mt_comm_dtype_size(dt), b = count * es, nb = b * (size_t)n;
    char what[128];
    snprintf(what, sizeof what, "reduce_scatter %s %s %zu per rank%s%s", mt_comm_dtype_name(dt),
             mt_comm_op_name(op), count, in_place ? " in place" : "", exact ? " exact" : "");
    char *in = malloc(nb + 1), *out = malloc(b + 1), *want = malloc(es + 8);
    gen(in, dt, count * (size_t)n, seed, me, 0, exact);
    char *ds = buf_alloc(nb), *dr = in_place ? ds + (size_t)me * b : buf_alloc(b);
    buf_put(ds, in, nb);
    int rc = mt_comm_reduce_scatter(c, ds, dr, count, dt, op);
    if (rc < 0) FAIL("%s%s: %s", LABEL, what, mt_errmsg());
    buf_get(out, dr, b);
    int strict = exact || op != MT_COMM_SUM || dt == MT_COMM_I32 || dt == MT_COMM_I64 ||
                 mt_comm_rank_ordered(c);
    int ok = rc == 0;
    for (size_t i = 0; i < count && ok; i++) {
        size_t gi = (size_t)me * count + i;
        ref_one(want, dt, op, seed, n, gi, exact);
        if (strict ? memcmp(want, out + i * es, es) != 0
                   : !sum_within_bound(out + i * es, dt, seed, n, gi)) {
            report_elem(what, dt, i, want, out + i * es);
            ok = 0;
        }
    }
    if (ok) n_pass++;
    if (!in_place) buf_free(dr);
    buf_free(ds);
    free(in), free(out), free(want);
}

/* Fills a host copy of a receive buffer with the gap pattern. */
#define GAP 0xa5

static int check_gaps(const char *host, size_t bytes, const unsigned char *mask, const char *what)
{
    for (size_t i = 0; i < bytes; i++)
        if (!mask[i] && (unsigned char)host[i] != GAP) {
            FAIL("%s%s: byte %zu outside every block was written", LABEL, what, i);
            return 0;
        }
    return 1;
}

/* all_gather (equal blocks), in and out of place. */
static void t_all_gather(mt_comm *c, mt_comm_dtype dt, size_t count, int in_place, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    const size_t es = mt_comm_dtype_size(dt), b = count * es, nb = b * (size_t)n;
    char what[96];
    snprintf(what, sizeof what, "all_gather %s %zu per rank%s", mt_comm_dtype_name(dt), count,
             in_place ? " in place" : "");
    char *in = malloc(b + 1), *out = malloc(nb + 1), *want = malloc(nb + 1);
    gen(in, dt, count, seed, me, 0, 0);
    for (int r = 0; r < n; r++) gen(want + (size_t)r * b, dt, count, seed, r, 0, 0);
    char *dr = buf_alloc(nb), *ds = in_place ? dr + (size_t)me * b : buf_alloc(b);
    buf_put(ds, in, b);
    int rc = mt_comm_all_gather(c, ds, dr, count, dt);
    if (rc < 0) FAIL("%s%s: %s", LABEL, what, mt_errmsg());
    buf_get(out, dr, nb);
    if (rc == 0 && memcmp(out, want, nb) == 0) n_pass++;
    else if (rc == 0) FAIL("%s%s: wrong data", LABEL, what);
    if (!in_place) buf_free(ds);
    buf_free(dr);
    free(in), free(out), free(want);
}

/* Blocks placed in reverse rank order with a gap of r + 1 elements after
 * each: counts[r] = (3 r + k) % 5 (zeros included). */
static size_t v_layout(int n, int k, size_t *counts, size_t *displs)
{
    size_t off = 0;
    for (int r = n - 1; r >= 0; r--) {
        counts[r] = (size_t)((3 * r + k) % 5);
        displs[r] = off;
        off += counts[r] + (size_t)r + 1;
    }
    return off;
}

/* all_gather_v (root -1) or gather_v (root >= 0). */
static void t_gather_v(mt_comm *c, mt_comm_dtype dt, int k, int root, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    const size_t es = mt_comm_dtype_size(dt);
    size_t counts[64], displs[64], total = v_layout(n, k, counts, displs);
    char what[96];
    snprintf(what, sizeof what, "%s %s layout %d%s", root < 0 ? "all_gather_v" : "gather_v",
             mt_comm_dtype_name(dt), k, root < 0 ? "" : " to a root");
    const size_t rb = total * es;
    char *in = malloc(counts[me] * es + 1), *out = malloc(rb + 1), *want = malloc(rb + 1);
    unsigned char *mask = calloc(rb + 1, 1);
    gen(in, dt, counts[me], seed, me, 0, 0);
    memset(want, GAP, rb);
    for (int r = 0; r < n; r++) {
        gen(want + displs[r] * es, dt, counts[r], seed, r, 0, 0);
        memset(mask + displs[r] * es, 1, counts[r] * es);
    }
    memset(out, GAP, rb);
    char *ds = buf_alloc(counts[me] * es), *dr = buf_alloc(rb);
    buf_put(ds, in, counts[me] * es);
    buf_put(dr, out, rb);
    int rc = root < 0 ? mt_comm_all_gather_v(c, ds, counts[me], dr, counts, displs, dt)
                      : mt_comm_gather_v(c, ds, counts[me], dr, counts, displs, dt, root);
    if (rc < 0) FAIL("%s%s: %s", LABEL, what, mt_errmsg());
    buf_get(out, dr, rb);
    int receives = root < 0 || root == me;
    if (rc == 0 && receives) {
        if (memcmp(out, want, rb) != 0 && check_gaps(out, rb, mask, what))
            FAIL("%s%s: wrong data in a block", LABEL, what);
        else if (memcmp(out, want, rb) == 0) n_pass++;
    } else if (rc == 0) {
        memset(want, GAP, rb); /* not the root: recv untouched */
        if (memcmp(out, want, rb) == 0) n_pass++;
        else FAIL("%s%s: a rank other than the root had its recv written", LABEL, what);
    }
    buf_free(ds), buf_free(dr);
    free(in), free(out), free(want), free(mask);
}

/* all_to_all_v: rank p sends cnt(p, q) elements to q, cnt = (p + 2 q + k) % 4
 * (zeros included); the send blocks are in peer order with one spare
 * element between them, the receive blocks in reverse order with gaps.
 * Element j of the block p -> q is gen(seed, p, 1000 q + j). */
static size_t cnt_pq(int p, int q, int k) { return (size_t)((p + 2 * q + k) % 4); }

/* started: through mt_comm_all_to_all_v_start, a test and the wait (the
 * same blocks, the same gaps) */
static void t_all_to_all_v(mt_comm *c, mt_comm_dtype dt, int k, int started, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    const size_t es = mt_comm_dtype_size(dt);
    size_t sc[64], sd[64], rcn[64], rd[64], soff = 0, roff = 0;
    for (int q = 0; q < n; q++) {
        sc[q] = cnt_pq(me, q, k);
        sd[q] = soff;
        soff += sc[q] + 1;
    }
    for (int p = n - 1; p >= 0; p--) {
        rcn[p] = cnt_pq(p, me, k);
        rd[p] = roff;
        roff += rcn[p] + 2;
    }
    char what[80];
    snprintf(what, sizeof what, "all_to_all_v%s %s pattern %d", started ? "_start" : "",
             mt_comm_dtype_name(dt), k);
    char *in = malloc(soff * es + 1), *out = malloc(roff * es + 1), *want = malloc(roff * es + 1);
    unsigned char *mask = calloc(roff * es + 1, 1);
    memset(in, 0, soff * es);
    for (int q = 0; q < n; q++) gen(in + sd[q] * es, dt, sc[q], seed, me, 1000 * (size_t)q, 0);
    memset(want, GAP, roff * es);
    for (int p = 0; p < n; p++) {
        gen(want + rd[p] * es, dt, rcn[p], seed, p, 1000 * (size_t)me, 0);
        memset(mask + rd[p] * es, 1, rcn[p] * es);
    }
    memset(out, GAP, roff * es);
    char *ds = buf_alloc(soff * es), *dr = buf_alloc(roff * es);
    buf_put(ds, in, soff * es);
    buf_put(dr, out, roff * es);
    int rc;
    if (started) {
        mt_comm_req *r = NULL;
        int done = 0;
        rc = mt_comm_all_to_all_v_start(c, ds, sc, sd, dr, rcn, rd, dt, &r);
        if (rc == 0) rc = mt_comm_test(r, &done);
        if (rc == 0) rc = mt_comm_wait(r);
    } else {
        rc = mt_comm_all_to_all_v(c, ds, sc, sd, dr, rcn, rd, dt);
    }
    if (rc < 0) FAIL("%s%s: %s", LABEL, what, mt_errmsg());
    buf_get(out, dr, roff * es);
    if (rc == 0 && memcmp(out, want, roff * es) == 0) n_pass++;
    else if (rc == 0 && check_gaps(out, roff * es, mask, what))
        FAIL("%s%s: wrong data in a block", LABEL, what);
    buf_free(ds), buf_free(dr);
    free(in), free(out), free(want), free(mask);
}

static void t_broadcast(mt_comm *c, mt_comm_dtype dt, size_t count, int root, uint64_t seed)
{
    const int me = mt_comm_rank(c);
    const size_t es = mt_comm_dtype_size(dt), b = count * es;
    char what[80];
    snprintf(what, sizeof what, "broadcast %s count %zu root %d", mt_comm_dtype_name(dt), count, root);
    char *h = malloc(b + 1), *want = malloc(b + 1);
    gen(want, dt, count, seed, root, 0, 0);
    gen(h, dt, count, seed, me, 0, 0);
    char *d = buf_alloc(b);
    buf_put(d, h, b);
    int rc = mt_comm_broadcast(c, d, count, dt, root);
    if (rc < 0) FAIL("%s%s: %s", LABEL, what, mt_errmsg());
    buf_get(h, d, b);
    if (rc == 0 && memcmp(h, want, b) == 0) n_pass++;
    else if (rc == 0) FAIL("%s%s: wrong data", LABEL, what);
    buf_free(d);
    free(h), free(want);
}

/* Ring: send / recv (even ranks send first, so blocking calls cannot all
 * wait), then sendrecv in both directions at once. */
static void t_p2p(mt_comm *c, mt_comm_dtype dt, size_t count, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    const size_t es = mt_comm_dtype_size(dt), b = count * es;
    char what[80];
    char *h = malloc(b + 1), *want = malloc(b + 1), *got = malloc(b + 1);
    char *ds = buf_alloc(b), *dr = buf_alloc(b);
    gen(h, dt, count, seed, me, 0, 0);
    buf_put(ds, h, b);
    if (n > 1) {
        snprintf(what, sizeof what, "send/recv ring %s count %zu", mt_comm_dtype_name(dt), count);
        int rc;
        if (me % 2 == 0) {
            rc = mt_comm_send(c, ds, count, dt, next);
            if (rc == 0) rc = mt_comm_recv(c, dr, count, dt, prev);
        } else {
            rc = mt_comm_recv(c, dr, count, dt, prev);
            if (rc == 0) rc = mt_comm_send(c, ds, count, dt, next);
        }
        if (rc < 0) FAIL("%s%s: %s", LABEL, what, mt_errmsg());
        gen(want, dt, count, seed, prev, 0, 0);
        buf_get(got, dr, b);
        if (rc == 0 && memcmp(got, want, b) == 0) n_pass++;
        else if (rc == 0) FAIL("%s%s: wrong data from rank %d", LABEL, what, prev);
    } else {
        /* one rank: a blocking send to itself would wait forever */
        if (mt_comm_send(c, ds, count, dt, 0) == MT_EINVAL) n_pass++;
        else FAIL("%ssend to the own rank is not refused", LABEL);
    }
    for (int dir = 0; dir < 2; dir++) {
        int dst = dir ? prev : next, src = dir ? next : prev;
        snprintf(what, sizeof what, "sendrecv %s count %zu direction %d", mt_comm_dtype_name(dt),
                 count, dir);
        int rc = mt_comm_sendrecv(c, ds, count, dst, dr, count, src, dt);
        if (rc < 0) FAIL("%s%s: %s", LABEL, what, mt_errmsg());
        gen(want, dt, count, seed, src, 0, 0);
        buf_get(got, dr, b);
        if (rc == 0 && memcmp(got, want, b) == 0) n_pass++;
        else if (rc == 0) FAIL("%s%s: wrong data from rank %d", LABEL, what, src);
    }
    buf_free(ds), buf_free(dr);
    free(h), free(want), free(got);
}

/* Pipeline messages before mt_comm_pipe_open are refused (MT_ESTATE),
 * on every backend that has them (a program that forgets the collective
 * open fails on the cpu too, not only on nccl). c: a new communicator. */
static void t_pipe_unopened(mt_comm *c)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    if (n == 1 || mt_comm_backend_of(c) == MT_COMM_LOCAL) return;
    char *ds = buf_alloc(8);
    int rc = mt_comm_isend(c, ds, 8, MT_COMM_BYTE, (me + 1) % n, 0);
    int rr = mt_comm_recv_tag(c, ds, 8, MT_COMM_BYTE, (me + 1) % n, 0);
    if (rc == MT_ESTATE && rr == MT_ESTATE && strstr(mt_errmsg(), "mt_comm_pipe_open")) n_pass++;
    else FAIL("%spipeline messages before mt_comm_pipe_open: isend %d, recv_tag %d (%s)", LABEL,
              rc, rr, mt_errmsg());
    mt_err_clear();
    buf_free(ds);
}

/* Pipeline messages (isend / recv_tag / wait_sends): every rank sends
 * three tagged messages to the next rank and, with n > 2, two to the one
 * before; the sender overwrites its buffer right after each isend
 * (buffered sends), and the receiver takes them in another order than
 * sent (matched by tag). On two ranks both sides send before either
 * receives. The local backend refuses with MT_ENOTSUP; a message to the
 * own rank is refused. */
static void t_pipe(mt_comm *c, mt_comm_dtype dt, size_t count, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    const size_t es = mt_comm_dtype_size(dt), b = count * es;
    char *h = malloc(b + 1), *want = malloc(b + 1), *got = malloc(b + 1);
    char *ds = buf_alloc(b), *dr = buf_alloc(b);
    const mt_comm_backend be = mt_comm_backend_of(c);
    if (mt_comm_pipe_open(c) < 0) FAIL("%spipe_open: %s", LABEL, mt_errmsg());
    if (be == MT_COMM_LOCAL || n == 1) {
        int rc = mt_comm_isend(c, ds, count, dt, n > 1 ? next : 0, 0);
        if (rc == (n == 1 ? MT_EINVAL : MT_ENOTSUP)) n_pass++;
        else FAIL("%spipeline isend on %s with %d rank(s): %d", LABEL, mt_comm_backend_name(be),
                  n, rc);
        mt_err_clear();
        goto out;
    }
    const int tags[3] = {5, 0, MT_COMM_MAX_TAG - 1};
    memset(want, 0xa5, b + 1);
    for (int k = 0; k < 3; k++) {
        gen(h, dt, count, seed + (uint64_t)k, me, 0, 0);
        buf_put(ds, h, b);
        int rc = mt_comm_isend(c, ds, count, dt, next, tags[k]);
        if (rc < 0) FAIL("%spipeline isend tag %d: %s", LABEL, tags[k], mt_errmsg());
        buf_put(ds, want, b); /* the caller's buffer changes at once */
    }
    if (n > 2)
        for (int k = 0; k < 2; k++) {
            gen(h, dt, count, seed + 100 + (uint64_t)k, me, 0, 0);
            buf_put(ds, h, b);
            if (mt_comm_isend(c, ds, count, dt, prev, 7 + k) < 0)
                FAIL("%spipeline isend back: %s", LABEL, mt_errmsg());
        }
    for (int k = 2; k >= 0; k--) { /* the last sent first */
        int rc = mt_comm_recv_tag(c, dr, count, dt, prev, tags[k]);
        gen(want, dt, count, seed + (uint64_t)k, prev, 0, 0);
        buf_get(got, dr, b);
        if (rc == 0 && memcmp(got, want, b) == 0) n_pass++;
        else FAIL("%spipeline recv tag %d from rank %d: %s", LABEL, tags[k], prev,
                  rc < 0 ? mt_errmsg() : "wrong data");
    }
    if (n > 2)
        for (int k = 1; k >= 0; k--) {
            int rc = mt_comm_recv_tag(c, dr, count, dt, next, 7 + k);
            gen(want, dt, count, seed + 100 + (uint64_t)k, next, 0, 0);
            buf_get(got, dr, b);
            if (rc == 0 && memcmp(got, want, b) == 0) n_pass++;
            else FAIL("%spipeline recv back tag %d: %s", LABEL, 7 + k,
                      rc < 0 ? mt_errmsg() : "wrong data");
        }
    if (mt_comm_wait_sends(c) == 0) n_pass++;
    else FAIL("%spipeline wait_sends: %s", LABEL, mt_errmsg());
    if (mt_comm_isend(c, ds, count, dt, me, 0) == MT_EINVAL) n_pass++;
    else FAIL("%spipeline isend to the own rank is not refused", LABEL);
    if (mt_comm_isend(c, ds, count, dt, next, MT_COMM_MAX_TAG) == MT_EINVAL) n_pass++;
    else FAIL("%spipeline tag %d is not refused", LABEL, MT_COMM_MAX_TAG);
    mt_err_clear();
out:
    buf_free(ds), buf_free(dr);
    free(h), free(want), free(got);
}

/* The executor's pattern, harder: each rank sends M "activations" to the
 * next rank before it receives anything (1F1B's warm-up, both sides at
 * once on two ranks), takes the ones from the previous rank last sent
 * first, and sends each straight back as a "gradient" from the buffer it
 * arrived in (device: with no host wait between: the isend must see the
 * data of the recv_tag before it), overwriting that buffer at once; then
 * takes the gradients from the next rank in sent order: each must be the
 * activation it sent, bit for bit. Device communicators run it on a
 * non-blocking compute stream set by mt_comm_set_stream (the runtime's
 * streams; nothing orders it with the legacy stream) and on the default
 * one. Messages in flight per pair: up to 2M. */
#define ECHO_M 4
static void t_pipe_echo(mt_comm *c, size_t count, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    if (n == 1 || mt_comm_backend_of(c) == MT_COMM_LOCAL) return;
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    const size_t b = count * 4;
    char *h = malloc(b), *want = malloc(b), *got = malloc(b);
    char *act = buf_alloc(b), *dr[ECHO_M], *dg = buf_alloc(b);
    for (int k = 0; k < ECHO_M; k++) dr[k] = buf_alloc(b);
    if (mt_comm_pipe_open(c) < 0) FAIL("%spipe_open: %s", LABEL, mt_errmsg());
    for (int stream = 0; stream < 1 + MEM_DEVICE; stream++) {
#ifdef TEST_COMM_GPU
        cudaStream_t s = NULL;
        if (stream) {
            cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
            MUST(mt_comm_set_stream(c, s));
        }
#define ECHO_FILL(dst, src) (MEM_DEVICE ? (void)cudaMemcpyAsync(dst, src, b, cudaMemcpyDefault, s) \
                                        : (void)memcpy(dst, src, b))
#define ECHO_CLOBBER(dst) \
    (MEM_DEVICE ? (void)cudaMemsetAsync(dst, 0x5a, b, s) : (void)memset(dst, 0x5a, b))
#define ECHO_SYNC() (MEM_DEVICE ? (void)cudaStreamSynchronize(s) : (void)0)
#else
#define ECHO_FILL(dst, src) memcpy(dst, src, b)
#define ECHO_CLOBBER(dst) memset(dst, 0x5a, b)
#define ECHO_SYNC() ((void)0)
#endif
        const uint64_t sd = seed + 1000 * (uint64_t)stream;
        int rc = 0;
        for (int k = 0; k < ECHO_M && rc == 0; k++) { /* activations, tags 2k */
            ECHO_SYNC(); /* h is reused: the previous fill has read it */
            gen(h, MT_COMM_F32, count, sd + (uint64_t)k, me, 0, 0);
            ECHO_FILL(act, h);
            rc = mt_comm_isend(c, act, count, MT_COMM_F32, next, 2 * k);
            ECHO_CLOBBER(act); /* buffered: the message was copied out */
        }
        for (int k = ECHO_M - 1; k >= 0 && rc == 0; k--) { /* last sent first, echoed back */
            rc = mt_comm_recv_tag(c, dr[k], count, MT_COMM_F32, prev, 2 * k);
            if (rc == 0) rc = mt_comm_isend(c, dr[k], count, MT_COMM_F32, prev, 2 * k + 1);
            ECHO_CLOBBER(dr[k]);
        }
        int ok = rc == 0;
        if (rc < 0) FAIL("%spipeline echo (stream %d): %s", LABEL, stream, mt_errmsg());
        for (int k = 0; k < ECHO_M && ok; k++) { /* the gradients, in sent order */
            rc = mt_comm_recv_tag(c, dg, count, MT_COMM_F32, next, 2 * k + 1);
            ECHO_SYNC();
            buf_get(got, dg, b);
            gen(want, MT_COMM_F32, count, sd + (uint64_t)k, me, 0, 0);
            if (rc < 0 || memcmp(got, want, b) != 0) {
                FAIL("%spipeline echo (stream %d): activation %d came back from rank %d %s", LABEL,
                     stream, k, next, rc < 0 ? mt_errmsg() : "changed");
                ok = 0;
            }
        }
        if (ok && mt_comm_wait_sends(c) == 0) n_pass++;
        else if (ok) FAIL("%spipeline echo: wait_sends: %s", LABEL, mt_errmsg());
        mt_err_clear();
#undef ECHO_FILL
#undef ECHO_CLOBBER
#undef ECHO_SYNC
#ifdef TEST_COMM_GPU
        if (stream) {
            MUST(mt_comm_sync(c));
            MUST(mt_comm_set_stream(c, NULL));
            cudaStreamDestroy(s);
        }
#endif
    }
    for (int k = 0; k < ECHO_M; k++) buf_free(dr[k]);
    buf_free(act), buf_free(dg);
    free(h), free(want), free(got);
}

/* Every collective on communicator c. big: include the large counts. */
static void run_ops(mt_comm *c, int big, uint64_t seed)
{
    const int n = mt_comm_size(c);
    const size_t counts[] = {0, 1, 2, 3, 7, 1031};
    for (size_t t = 0; t < sizeof RED_TYPES / sizeof *RED_TYPES; t++)
        for (int op = 0; op < MT_COMM_OP_COUNT; op++)
            for (size_t k = 0; k < sizeof counts / sizeof *counts; k++)
                for (int ip = 0; ip < 2; ip++)
                    for (int exact = 1; exact >= 0; exact--) {
                        uint64_t s = seed + 7919 * (t * 100 + (size_t)op * 10 + k) + (size_t)ip;
                        t_all_reduce(c, RED_TYPES[t], (mt_comm_op)op, counts[k], ip, exact, s);
                        if (counts[k] <= 257)
                            t_reduce_scatter(c, RED_TYPES[t], (mt_comm_op)op, counts[k], ip, exact,
                                             s + 1);
                    }
    if (big) {
        /* a vector of a quarter million elements, odd */
        t_all_reduce(c, MT_COMM_F32, MT_COMM_SUM, (1u << 18) + 3, 0, 0, seed + 1);
        t_all_reduce(c, MT_COMM_BF16, MT_COMM_SUM, (1u << 18) + 3, 1, 0, seed + 2);
        t_reduce_scatter(c, MT_COMM_BF16, MT_COMM_SUM, (1u << 16) + 1, 0, 0, seed + 3);
        t_all_gather(c, MT_COMM_E4M3, (1u << 18) + 5, 0, seed + 4);
    }
    const mt_comm_dtype move[] = {MT_COMM_BYTE, MT_COMM_BF16, MT_COMM_F64};
    for (size_t t = 0; t < 3; t++) {
        for (size_t k = 0; k < sizeof counts / sizeof *counts; k++)
            for (int ip = 0; ip < 2; ip++) t_all_gather(c, move[t], counts[k], ip, seed + 31 * k);
        for (int k = 0; k < 5; k++) {
            t_gather_v(c, move[t], k, -1, seed + (uint64_t)k);
            for (int root = 0; root < n; root++) t_gather_v(c, move[t], k, root, seed + 5 + (uint64_t)k);
        }
        for (int k = 0; k < 4; k++)
            for (int st = 0; st < 2; st++)
                t_all_to_all_v(c, move[t], k, st, seed + 11 + (uint64_t)k);
        for (int root = 0; root < n; root++) {
            t_broadcast(c, move[t], 0, root, seed);
            t_broadcast(c, move[t], 1, root, seed + 1);
            t_broadcast(c, move[t], 1001, root, seed + 2);
        }
        t_p2p(c, move[t], 0, seed);
        t_p2p(c, move[t], 5, seed + 1);
        t_p2p(c, move[t], 999, seed + 2);
        t_pipe(c, move[t], 3, seed + 3);
        t_pipe(c, move[t], 999, seed + 4);
    }
    t_pipe_echo(c, 1031, seed + 5);
    if (mt_comm_barrier(c) == 0) n_pass++;
    else FAIL("%sbarrier: %s", LABEL, mt_errmsg());
}

/* reduce_owned_start / gather_owned_start (ZeRO buckets): segments of
 * counts 0, 1, odd and large, owners out of order (the last rank owns
 * nothing), two requests in flight at once, waited in reverse order.
 * Reduce: the owner holds the f32 rank-ordered sum of every rank's input,
 * each rounded to bf16 first for the bf16 wire (in a group of one nothing
 * is rounded), exactly; the other ranks' buffers are unchanged. Gather:
 * every rank holds each segment's owner bytes. */
#define N_SEG 6
static void t_owned(mt_comm *c, uint64_t seed, int pattern)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    const size_t counts[N_SEG] = {7, 0, 1031, 1, 3, 257};
    int owners[N_SEG]; /* pattern 0: every rank owns, descending; 1: the last rank owns nothing */
    for (int k = 0; k < N_SEG; k++)
        owners[k] = n == 1 ? 0 : pattern == 0 ? (k * 7 + 3) % n : (n - 2 - k % (n - 1) + n) % n;
    for (int wi = 0; wi < 2; wi++) {
        const mt_comm_dtype wire = wi ? MT_COMM_BF16 : MT_COMM_F32;
        mt_comm_seg red[N_SEG], gat[N_SEG];
        float *in[N_SEG];
        unsigned char *gin[N_SEG];
        for (int k = 0; k < N_SEG; k++) {
            in[k] = malloc(counts[k] * 4 + 4);
            gin[k] = malloc(counts[k] + 1);
            gen(in[k], MT_COMM_F32, counts[k], seed + (uint64_t)k, me, 0, 0);
            gen(gin[k], MT_COMM_BYTE, counts[k], seed + 50 + (uint64_t)k, me, 0, 0);
            red[k] = (mt_comm_seg){buf_alloc(counts[k] * 4 + 4), counts[k], owners[k]};
            gat[k] = (mt_comm_seg){buf_alloc(counts[k] + 1), counts[k], owners[k]};
            buf_put(red[k].buf, in[k], counts[k] * 4);
            buf_put(gat[k].buf, gin[k], counts[k]);
        }
        mt_comm_req *r1 = NULL, *r2 = NULL;
        int rc = mt_comm_reduce_owned_start(c, red, N_SEG, wire, &r1);
        if (rc == 0) rc = mt_comm_gather_owned_start(c, gat, N_SEG, &r2);
        int done = 0;
        if (rc == 0) rc = mt_comm_test(r1, &done);
        if (rc == 0) rc = mt_comm_wait(r2);
        if (rc == 0) rc = mt_comm_wait(r1);
        if (rc) {
            FAIL("%sowned ops (%s wire): %s", LABEL, mt_comm_dtype_name(wire), mt_errmsg());
            return;
        }
        int bad = 0;
        for (int k = 0; k < N_SEG && !bad; k++) {
            float *got = malloc(counts[k] * 4 + 4), *x = malloc(counts[k] * 4 + 4);
            unsigned char *gg = malloc(counts[k] + 1), *gx = malloc(counts[k] + 1);
            buf_get(got, red[k].buf, counts[k] * 4);
            buf_get(gg, gat[k].buf, counts[k]);
            for (size_t i = 0; i < counts[k] && !bad; i++) {
                float want = in[k][i];
                if (owners[k] == me && n > 1) {
                    for (int r = 0; r < n; r++) {
                        gen(x, MT_COMM_F32, 1, seed + (uint64_t)k, r, i, 0);
                        float v = wire == MT_COMM_BF16 ? mt_bf16_round(x[0]) : x[0];
                        want = r == 0 ? v : want + v;
                    }
                }
                if (memcmp(&want, &got[i], 4) != 0) {
                    FAIL("%sreduce_owned (%s wire): segment %d element %zu is %.9g, expected %.9g "
                         "(owner %d)", LABEL, mt_comm_dtype_name(wire), k, i, got[i], want,
                         owners[k]);
                    bad = 1;
                }
            }
            gen(gx, MT_COMM_BYTE, counts[k], seed + 50 + (uint64_t)k, owners[k], 0, 0);
            if (!bad && counts[k] && memcmp(gg, gx, counts[k]) != 0) {
                FAIL("%sgather_owned: segment %d differs from its owner %d's bytes", LABEL, k,
                     owners[k]);
                bad = 1;
            }
            free(got), free(x), free(gg), free(gx);
        }
        if (!bad) n_pass++;
        for (int k = 0; k < N_SEG; k++) {
            free(in[k]), free(gin[k]);
            buf_free(red[k].buf), buf_free(gat[k].buf);
        }
    }
    /* argument errors name the op */
    mt_comm_seg badseg = {NULL, 0, n};
    mt_comm_req *r = NULL;
    if (mt_comm_gather_owned_start(c, &badseg, 1, &r) == MT_EINVAL && strstr(mt_errmsg(), "gather_owned"))
        n_pass++;
    else FAIL("%sgather_owned with owner %d of %d ranks was not refused by name", LABEL, n, n);
}

/* split: color by parity of the rank (the last rank of an odd world
 * above 1 takes no part), key reverses the order. */
static void t_split(mt_comm *c, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    int color = me % 2;
    if (n > 1 && n % 2 == 1 && me == n - 1) color = MT_COMM_NO_COLOR;
    mt_comm *s = NULL;
    int rc = mt_comm_split(c, color, -me, &s);
    if (rc < 0) {
        FAIL("%ssplit: %s", LABEL, mt_errmsg());
        return;
    }
    if (color == MT_COMM_NO_COLOR) {
        if (s == NULL) n_pass++;
        else FAIL("%ssplit: NO_COLOR gave a communicator", LABEL);
        return;
    }
    /* members: ranks of my parity taking part, in decreasing order */
    int members[64], m = 0;
    for (int r = n - 1; r >= 0; r--)
        if (r % 2 == color && !(n > 1 && n % 2 == 1 && r == n - 1)) members[m++] = r;
    int pos = -1;
    for (int i = 0; i < m; i++)
        if (members[i] == me) pos = i;
    if (mt_comm_size(s) == m && mt_comm_rank(s) == pos) n_pass++;
    else
        FAIL("%ssplit color %d: rank %d of %d, expected %d of %d", LABEL, color, mt_comm_rank(s),
             mt_comm_size(s), pos, m);
    int32_t mine = me, *all = malloc(sizeof *all * (size_t)m);
    MUST(mt_comm_all_gather(mt_comm_host(s), &mine, all, 1, MT_COMM_I32));
    int ok = 1;
    for (int i = 0; i < m; i++) ok &= all[i] == members[i];
    if (ok) n_pass++;
    else FAIL("%ssplit color %d: members not in key order", LABEL, color);
    free(all);
    /* the new group works like any other */
    const char *saved = LABEL;
    LABEL = "[split] ";
    t_all_reduce(s, MT_COMM_BF16, MT_COMM_SUM, 33, 0, 0, seed);
    t_all_to_all_v(s, MT_COMM_F32, 1, 0, seed);
    t_all_to_all_v(s, MT_COMM_F32, 1, 1, seed);
    LABEL = saved;
    mt_comm_destroy(s);
}

/* Groups of every layout whose tp * dp * pp is the world size. */
static void t_groups(mt_comm *c)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    int tested = 0;
    for (int tp = 1; tp <= n; tp++)
        for (int pp = 1; pp <= n; pp++) {
            if (n % (tp * pp)) continue;
            int dp = n / (tp * pp);
            for (int etp = 1; etp <= tp * dp; etp++)
                for (int ep = 1; ep <= tp * dp; ep++) {
                    if ((tp * dp) % (etp * ep)) continue;
                    mt_layout l;
                    mt_layout_default(&l);
                    l.tp = tp, l.pp = pp, l.dp = dp, l.etp = etp, l.ep = ep;
                    char name[96];
                    mt_layout_format(&l, name, sizeof name);
                    mt_groups g;
                    if (mt_groups_build(&g, c, &l) < 0) {
                        FAIL("%sgroups %s: %s", LABEL, name, mt_errmsg());
                        continue;
                    }
                    mt_rank_coords me_c, rc_;
                    mt_layout_coords(&l, me, &me_c);
                    const int mine[MT_GROUP_COUNT] = {me_c.tp, me_c.dp, me_c.pp,
                                                      me_c.etp, me_c.ep, me_c.edp,
                                                      me_c.etp + etp * me_c.ep};
                    for (int k = 0; k < MT_GROUP_COUNT; k++) {
                        /* the ep x etp exchange exists only under etp */
                        if (k == MT_GROUP_EXP && etp == 1) {
                            if (g.g[k]) FAIL("%sgroups %s: an exchange group without etp",
                                             LABEL, name);
                            continue;
                        }
                        /* expected members: ranks agreeing on every other
                         * coordinate of the group's family, by coordinate */
                        int members[64], m = 0;
                        for (int pos = 0; pos < n; pos++)
                            for (int r = 0; r < n; r++) {
                                mt_layout_coords(&l, r, &rc_);
                                const int co[MT_GROUP_COUNT] = {rc_.tp, rc_.dp, rc_.pp,
                                                                rc_.etp, rc_.ep, rc_.edp,
                                                                rc_.etp + etp * rc_.ep};
                                int same = 1;
                                int fam = k < 3 ? 0 : 3;
                                for (int j = fam; j < fam + 3; j++)
                                    if (j != k && co[j] != mine[j]) same = 0;
                                if (k == MT_GROUP_EXP) /* etp and ep vary together */
                                    same = rc_.edp == me_c.edp;
                                if (k >= 3 && rc_.pp != me_c.pp) same = 0;
                                if (same && co[k] == pos) members[m++] = r;
                            }
                        mt_comm *gc = g.g[k];
                        int32_t wr = me, all[64];
                        int ok = gc && mt_comm_size(gc) == m && mt_comm_rank(gc) == mine[k] &&
                                 mt_comm_all_gather(mt_comm_host(gc), &wr, all, 1, MT_COMM_I32) == 0;
                        for (int i = 0; ok && i < m; i++) ok = all[i] == members[i];
                        if (ok) n_pass++;
                        else
                            FAIL("%sgroups %s: the %s group of rank %d (size %d, rank %d) is not "
                                 "the ranks with its coordinates (size %d, coordinate %d)",
                                 LABEL, name, mt_group_name((mt_group_kind)k), me,
                                 gc ? mt_comm_size(gc) : -1, gc ? mt_comm_rank(gc) : -1, m,
                                 mine[k]);
                    }
                    mt_groups_free(&g);
                    tested++;
                }
        }
    mt_layout bad;
    mt_layout_default(&bad);
    bad.tp = n + 1;
    mt_groups g;
    if (mt_groups_build(&g, c, &bad) == MT_EINVAL && strstr(mt_errmsg(), "world"))
        n_pass++;
    else
        FAIL("%sgroups: a layout of %d ranks on a world of %d is not refused by name", LABEL, n + 1,
             n);
    if (me == 0) printf("%sgroups: %d layouts of %d ranks\n", LABEL, tested, n);
}

/* agree, and argument errors that name the op. */
static void t_agree_and_errors(mt_comm *c)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    if (mt_comm_agree(c, 1) == 1) n_pass++;
    else FAIL("%sagree: every rank ok but not agreed", LABEL);
    if (mt_comm_agree(c, me != n - 1) == 0) n_pass++;
    else FAIL("%sagree: rank %d failed but agreed", LABEL, n - 1);
    char *d = buf_alloc(16);
    int rc = mt_comm_broadcast(c, d, 1, MT_COMM_F32, n);
    if (rc == MT_EINVAL && strstr(mt_errmsg(), "broadcast") && strstr(mt_errmsg(), "root"))
        n_pass++;
    else FAIL("%sbroadcast to root %d: not refused by name (%s)", LABEL, n, mt_errmsg());
    rc = mt_comm_all_reduce(c, d, d, 4, MT_COMM_BYTE, MT_COMM_SUM);
    if (rc == MT_EINVAL && strstr(mt_errmsg(), "all_reduce(byte sum, count 4)")) n_pass++;
    else FAIL("%sall_reduce of bytes: not refused by name (%s)", LABEL, mt_errmsg());
    rc = mt_comm_all_reduce(c, d, d + 4, 2, MT_COMM_F32, MT_COMM_SUM);
    if (rc == MT_EINVAL && strstr(mt_errmsg(), "overlap")) n_pass++;
    else FAIL("%sall_reduce with overlapping buffers: not refused (%s)", LABEL, mt_errmsg());
    /* mpi: a message shorter than the receive is an error naming the op,
     * the peer and both lengths (other backends leave it undefined). The
     * longer case is MPI's MPI_ERR_TRUNCATE; it is not tested here because
     * Open MPI 4.1 can leave the truncated receive pending on 3 ranks. */
    if (mt_comm_backend_of(c) == MT_COMM_MPI && n > 1 && me < 2) {
        int32_t v[4] = {0};
        rc = me == 0 ? mt_comm_send(c, v, 2, MT_COMM_I32, 1) : mt_comm_recv(c, v, 3, MT_COMM_I32, 0);
        if (me == 0 && rc == 0) n_pass++;
        else if (me == 1 && rc == MT_EMPI && strstr(mt_errmsg(), "recv(i32, count 3, from rank 0)") &&
                 strstr(mt_errmsg(), "with rank 0: 8 bytes arrived, 12 expected"))
            n_pass++;
        else FAIL("%s2 elements sent, 3 received: rc %d, '%s'", LABEL, rc, mt_errmsg());
    }
    buf_free(d);
    mt_comm_backend b;
    if (mt_comm_backend_parse("nccl", &b) == 0 && b == MT_COMM_NCCL &&
        mt_comm_backend_parse("gloo", &b) == MT_EINVAL && strstr(mt_errmsg(), "'gloo'"))
        n_pass++;
    else FAIL("backend names: 'nccl' not parsed or 'gloo' not refused by name");
}

#ifdef TEST_COMM_GPU
/* An op on a side stream with overlap: ordered after the work already on
 * that stream (a copy that fills the input), joined before the download. */
static void t_overlap(mt_comm *c, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    const size_t count = 4099, b = count * 4;
    float *h = malloc(b), *want = malloc(b);
    gen(h, MT_COMM_F32, count, seed, me, 0, 1);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    float *d = buf_alloc(b);
    cudaMemcpyAsync(d, h, b, cudaMemcpyHostToDevice, s);
    MUST(mt_comm_set_stream(c, s));
    MUST(mt_comm_set_overlap(c, 1));
    int rc = mt_comm_all_reduce(c, d, d, count, MT_COMM_F32, MT_COMM_SUM);
    if (rc == 0) rc = mt_comm_join(c);
    if (rc == 0) cudaMemcpyAsync(h, d, b, cudaMemcpyDeviceToHost, s);
    cudaStreamSynchronize(s);
    MUST(mt_comm_set_overlap(c, 0));
    MUST(mt_comm_set_stream(c, NULL));
    for (size_t i = 0; i < count; i++) ref_one(&want[i], MT_COMM_F32, MT_COMM_SUM, seed, n, i, 1);
    if (rc == 0 && memcmp(h, want, b) == 0) n_pass++;
    else FAIL("all_reduce on a side stream with overlap: %s", rc ? mt_errmsg() : "wrong data");
    MUST(mt_comm_sync(c));
    buf_free(d);
    cudaStreamDestroy(s);
    free(h), free(want);
}

/* The runtime's pattern (gradient buckets, expert dispatch): the compute
 * stream is a non-blocking stream (as the CUDA backend's) set by
 * mt_comm_set_stream, no overlap, and the host waits only for the compute
 * stream, never for the communicator:
 *  - an all_reduce whose input the compute stream writes late (behind
 *    slow device copies) reads it, and the compute stream's copy of the
 *    result right after the call sees the sum: ordered both ways by
 *    device-side events alone;
 *  - a reduce_owned started before more compute-stream work and completed
 *    by mt_comm_wait: the compute stream's copy after the wait sees the
 *    owner's sum (the other ranks' buffers as they were). */
static void t_stream_ordered(mt_comm *c, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    const size_t count = 4099, b = count * 4, big = (size_t)32 << 20;
    float *h = malloc(b), *want = malloc(b), *got = malloc(b);
    gen(h, MT_COMM_F32, count, seed, me, 0, 1);
    for (size_t i = 0; i < count; i++) ref_one(&want[i], MT_COMM_F32, MT_COMM_SUM, seed, n, i, 1);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    float *d = buf_alloc(b), *src = buf_alloc(b);
    char *slow = buf_alloc(2 * big);
    buf_put(src, h, b);
    MUST(mt_comm_set_stream(c, s));
    for (int part = 0; part < 2; part++) {
        cudaMemsetAsync(d, 0, b, s);
        for (int k = 0; k < 8; k++) cudaMemcpyAsync(slow + big, slow, big, cudaMemcpyDeviceToDevice, s);
        cudaMemcpyAsync(d, src, b, cudaMemcpyDeviceToDevice, s); /* the input, late */
        int rc;
        const char *what = part == 0 ? "all_reduce" : "reduce_owned";
        if (part == 0) {
            rc = mt_comm_all_reduce(c, d, d, count, MT_COMM_F32, MT_COMM_SUM);
        } else {
            mt_comm_seg seg = {d, count, n - 1};
            mt_comm_req *r = NULL;
            rc = mt_comm_reduce_owned_start(c, &seg, 1, MT_COMM_F32, &r);
            for (int k = 0; rc == 0 && k < 8; k++)
                cudaMemcpyAsync(slow + big, slow, big, cudaMemcpyDeviceToDevice, s);
            if (rc == 0) rc = mt_comm_wait(r);
        }
        memset(got, 0, b);
        if (rc == 0) cudaMemcpyAsync(got, d, b, cudaMemcpyDeviceToHost, s);
        cudaError_t e = cudaStreamSynchronize(s);
        const float *expect = part == 1 && me != n - 1 ? h : want;
        if (rc == 0 && e == cudaSuccess && memcmp(got, expect, b) == 0) n_pass++;
        else FAIL("%s ordered on a non-blocking compute stream, no host wait: %s", what,
                  rc ? mt_errmsg() : e != cudaSuccess ? cudaGetErrorString(e) : "wrong data");
    }
    MUST(mt_comm_sync(c));
    MUST(mt_comm_set_stream(c, NULL));
    buf_free(d), buf_free(src), buf_free(slow);
    cudaStreamDestroy(s);
    free(h), free(want), free(got);
}

/* Pipeline messages in the runtime's pattern (a non-blocking compute
 * stream, no host wait): two messages received back to back into two
 * device buffers while the compute stream is still busy land each in its
 * own buffer (the staged copy up of the first must leave the pinned
 * buffer before the second receive writes it). Backends with pipeline
 * messages only (mpi through staged on device memory). */
static void t_pipe_stream_ordered(mt_comm *c, uint64_t seed)
{
    const int n = mt_comm_size(c), me = mt_comm_rank(c);
    if (n < 2 || mt_comm_backend_of(c) != MT_COMM_STAGED) return;
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    const size_t count = 4099, b = count * 4, big = (size_t)32 << 20;
    float *h = malloc(b), *want = malloc(b), *got = malloc(b);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    float *ds = buf_alloc(b), *dr[2] = {buf_alloc(b), buf_alloc(b)};
    char *slow = buf_alloc(2 * big);
    MUST(mt_comm_set_stream(c, s));
    for (int k = 0; k < 2; k++) {
        gen(h, MT_COMM_F32, count, seed + (uint64_t)k, me, 0, 1);
        /* written on the compute stream, as the runtime's kernels write
         * what it sends: a plain cudaMemcpy from pageable memory may return
         * before its DMA lands, and the non-blocking streams do not wait for
         * the legacy stream (the first GPU run read the buffer early) */
        cudaMemcpyAsync(ds, h, b, cudaMemcpyHostToDevice, s);
        int rc = mt_comm_isend(c, ds, count, MT_COMM_F32, next, 11 + k);
        if (rc < 0) FAIL("pipeline isend tag %d, stream ordered: %s", 11 + k, mt_errmsg());
    }
    /* ~2 ms of device copies ahead of the receives' copies up */
    for (int k = 0; k < 32; k++) cudaMemcpyAsync(slow + big, slow, big, cudaMemcpyDeviceToDevice, s);
    int rc = 0;
    for (int k = 0; k < 2 && rc == 0; k++)
        rc = mt_comm_recv_tag(c, dr[k], count, MT_COMM_F32, prev, 11 + k);
    for (int k = 0; k < 2; k++) {
        memset(got, 0, b);
        if (rc == 0) cudaMemcpyAsync(got, dr[k], b, cudaMemcpyDeviceToHost, s);
        cudaError_t e = cudaStreamSynchronize(s);
        gen(want, MT_COMM_F32, count, seed + (uint64_t)k, prev, 0, 1);
        if (rc == 0 && e == cudaSuccess && memcmp(got, want, b) == 0) n_pass++;
        else FAIL("pipeline receive %d of 2 back to back on a busy non-blocking compute stream: "
                  "%s", k + 1, rc ? mt_errmsg() : e != cudaSuccess ? cudaGetErrorString(e)
                                                  : "wrong data (the other message's?)");
    }
    MUST(mt_comm_wait_sends(c));
    MUST(mt_comm_sync(c));
    MUST(mt_comm_set_stream(c, NULL));
    buf_free(ds), buf_free(dr[0]), buf_free(dr[1]), buf_free(slow);
    cudaStreamDestroy(s);
    free(h), free(want), free(got);
}
#endif

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    mt_comm_opts o = {MT_COMM_LOCAL, MT_COMM_HOST, 0};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) MUST(mt_comm_backend_parse(argv[++i], &o.backend));
        else if (!strcmp(argv[i], "--mem") && i + 1 < argc) o.mem = !strcmp(argv[++i], "device") ? MT_COMM_DEVICE : MT_COMM_HOST;
        else {
            fprintf(stderr, "usage: test_comm [--backend local|mpi|staged|nccl|auto] [--mem host|device]\n");
            return 2;
        }
    }
    MEM_DEVICE = o.mem == MT_COMM_DEVICE;
    int use_mpi = o.backend != MT_COMM_LOCAL;
    if (use_mpi) {
        int provided;
        MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    }
#ifdef TEST_COMM_GPU
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess) ndev = 0;
    if (ndev == 0) {
        printf("no CUDA device: skipped\n");
        if (use_mpi) MPI_Finalize();
        return 77;
    }
#else
    if (MEM_DEVICE) {
        fprintf(stderr, "device memory needs the GPU build of this test (test_comm_gpu)\n");
        return 2;
    }
#endif
    /* a host world first: its size decides the device of each rank */
    mt_comm *hw = NULL;
    mt_comm_opts ho = {use_mpi ? MT_COMM_MPI : MT_COMM_LOCAL, MT_COMM_HOST, 0};
    MUST(mt_comm_world(&hw, &ho));
    RANK = mt_comm_rank(hw), SIZE = mt_comm_size(hw);
#ifdef TEST_COMM_GPU
    if (o.backend == MT_COMM_NCCL && ndev < SIZE) {
        if (RANK == 0) printf("nccl needs a GPU per rank: %d ranks, %d GPUs: skipped\n", SIZE, ndev);
        mt_comm_destroy(hw);
        MPI_Finalize();
        return 77;
    }
    /* staged: every rank on GPU 0 (sharing is its point); else one each */
    cudaSetDevice(o.backend == MT_COMM_STAGED ? 0 : RANK % ndev);
#endif
    /* auto picks: host: mpi under MPI, local without; device: local on one
     * rank, staged where ranks share a GPU, nccl where each has its own */
    {
        mt_comm *a = NULL;
        mt_comm_opts ao = {MT_COMM_AUTO, o.mem, 0};
        mt_comm_backend want = !use_mpi ? MT_COMM_LOCAL : MEM_DEVICE ? MT_COMM_LOCAL : MT_COMM_MPI;
        if (MEM_DEVICE && SIZE > 1)
            want = o.backend == MT_COMM_STAGED ? MT_COMM_STAGED : MT_COMM_NCCL;
        if (!use_mpi || o.backend != MT_COMM_AUTO) {
            MUST(mt_comm_world(&a, &ao));
            if (mt_comm_backend_of(a) == want) n_pass++;
            else
                FAIL("auto on %d ranks with %s buffers picked %s, expected %s", SIZE,
                     MEM_DEVICE ? "device" : "host", mt_comm_backend_name(mt_comm_backend_of(a)),
                     mt_comm_backend_name(want));
            mt_comm_destroy(a);
        }
    }
    uint64_t seed = 12345;
    /* default messages, then (mpi, staged) 20-byte messages */
    for (int pass = 0; pass < 2; pass++) {
        size_t chunk = pass ? 20 : 0;
        if (pass && o.backend != MT_COMM_MPI && o.backend != MT_COMM_STAGED) break;
        mt_comm_opts oc = o;
        oc.chunk_bytes = chunk;
        MUST(mt_comm_world(&C, &oc));
        LABEL = pass ? "[20-byte messages] " : "";
        if (RANK == 0)
            printf("%sbackend %s (asked %s), %s buffers, %d ranks, rank ordered %d\n", LABEL,
                   mt_comm_backend_name(mt_comm_backend_of(C)), mt_comm_backend_name(o.backend),
                   MEM_DEVICE ? "device" : "host", mt_comm_size(C), mt_comm_rank_ordered(C));
        t_pipe_unopened(C);
        run_ops(C, !pass, seed + (uint64_t)pass);
        t_split(C, seed + 99);
        t_owned(C, seed + 555, 0);
        t_owned(C, seed + 556, 1);
        if (!pass) t_groups(C);
        t_agree_and_errors(C);
#ifdef TEST_COMM_GPU
        if (MEM_DEVICE && !pass) t_overlap(C, seed + 7);
        if (MEM_DEVICE && !pass) t_stream_ordered(C, seed + 8);
        if (MEM_DEVICE && !pass) t_pipe_stream_ordered(C, seed + 9);
#endif
        mt_comm_destroy(C);
        C = NULL;
    }
    int all_ok = mt_comm_agree(hw, n_fail == 0);
    int total_pass = n_pass, total_fail = n_fail;
    printf("rank %d: %d checks passed, %d failed\n", RANK, total_pass, total_fail);
    mt_comm_destroy(hw);
    if (use_mpi) MPI_Finalize();
    return all_ok == 1 ? 0 : 1;
}
