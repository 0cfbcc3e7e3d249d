/* cpu_backend.c - the CPU backend: creation, memory, conversions, add, copy2d. */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels/cpu/cpu_impl.h"
#include "base/mt_clock.h"

/* Each allocation carries a header with its size so free() can account for
 * it; the header keeps the user pointer 64-byte aligned. */
#define CPU_HDR 64

void *cpu_scratch(size_t bytes)
{
    size_t n = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, n ? n : 64);
}

int cpu_thread_id(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* ---- memory ---------------------------------------------------------------- */

static int cpu_alloc(mt_backend *be, size_t bytes, void **p)
{
    CPU_REQUIRE(p != NULL, "alloc: p is NULL");
    *p = NULL;
    CPU_REQUIRE(bytes <= SIZE_MAX - 2 * CPU_HDR, "alloc: %zu bytes is too many", bytes);
    size_t n = (CPU_HDR + bytes + 63) / 64 * 64;
    unsigned char *base = aligned_alloc(64, n);
    if (!base) return MT_ERR(MT_ENOMEM, "alloc: out of host memory for %zu bytes", bytes);
    memset(base, 0, n);
    memcpy(base, &bytes, sizeof bytes);
    cpu_impl *c = cpu_of(be);
    size_t now = atomic_fetch_add(&c->in_use, bytes) + bytes;
    size_t old = atomic_load(&c->peak);
    while (now > old && !atomic_compare_exchange_weak(&c->peak, &old, now)) {
    }
    *p = base + CPU_HDR;
    return MT_OK;
}

static void cpu_free(mt_backend *be, void *p)
{
    if (!p) return;
    unsigned char *base = (unsigned char *)p - CPU_HDR;
    size_t bytes;
    memcpy(&bytes, base, sizeof bytes);
    atomic_fetch_sub(&cpu_of(be)->in_use, bytes);
    free(base);
}

/* Host memory for host copies (ops.h host_alloc): on the CPU backend any
 * host memory is as fast as any other, so plain aligned memory, not
 * counted with the backend's buffers. */
static int cpu_host_alloc(mt_backend *be, size_t bytes, void **p)
{
    (void)be;
    CPU_REQUIRE(p != NULL, "host_alloc: p is NULL");
    *p = cpu_scratch(bytes);
    if (!*p) return MT_ERR(MT_ENOMEM, "host_alloc: out of host memory for %zu bytes", bytes);
    return MT_OK;
}

static void cpu_host_free(mt_backend *be, void *p)
{
    (void)be;
    free(p);
}

static int cpu_memcpy(const char *op, void *dst, const void *src, size_t bytes)
{
    if (bytes == 0) return MT_OK;
    CPU_REQUIRE(dst && src, "%s: NULL pointer (dst %p, src %p)", op, dst, src);
    memmove(dst, src, bytes);
    return MT_OK;
}

static int cpu_upload(mt_backend *be, void *dst, const void *host_src, size_t bytes)
{
    (void)be;
    return cpu_memcpy("upload", dst, host_src, bytes);
}

static int cpu_download(mt_backend *be, void *host_dst, const void *src, size_t bytes)
{
    (void)be;
    return cpu_memcpy("download", host_dst, src, bytes);
}

static int cpu_copy(mt_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    return cpu_memcpy("copy", dst, src, bytes);
}

static int cpu_zero(mt_backend *be, void *p, size_t bytes)
{
    (void)be;
    if (bytes == 0) return MT_OK;
    CPU_REQUIRE(p != NULL, "zero: p is NULL");
    memset(p, 0, bytes);
    return MT_OK;
}

static int cpu_sync(mt_backend *be)
{
    (void)be;
    return MT_OK;
}

/* Marks: the host clock, every op having completed when it returns. */
static int cpu_mark(mt_backend *be, int i)
{
    cpu_impl *c = cpu_of(be);
    CPU_REQUIRE(i >= 0, "mark: index %d", i);
    if (i >= c->cap_marks) {
        int cap = c->cap_marks ? c->cap_marks : 64;
        while (cap <= i) cap *= 2;
        double *m = realloc(c->marks, (size_t)cap * sizeof *m);
        if (!m) return MT_ERR(MT_ENOMEM, "cpu backend: out of memory for %d marks", cap);
        c->marks = m;
        c->cap_marks = cap;
    }
    c->marks[i] = mt_now_s();
    return MT_OK;
}

static int cpu_marks_read(mt_backend *be, int n, double *t)
{
    cpu_impl *c = cpu_of(be);
    CPU_REQUIRE(n >= 0 && n <= c->cap_marks, "marks_read: %d marks, %d recorded at most", n,
                c->cap_marks);
    for (int i = 0; i < n; i++) t[i] = c->marks[i] - c->marks[0];
    return MT_OK;
}

/* No stream: every op has completed when it returns. */
static void *cpu_stream(mt_backend *be)
{
    (void)be;
    return NULL;
}

static void cpu_mem_stats(mt_backend *be, size_t *in_use, size_t *peak)
{
    cpu_impl *c = cpu_of(be);
    if (in_use) *in_use = atomic_load(&c->in_use);
    if (peak) *peak = atomic_load(&c->peak);
}

static void cpu_destroy(mt_backend *be)
{
    if (!be) return;
    if (be->impl) free(cpu_of(be)->marks);
    free(be->impl);
    free(be);
}

/* ---- conversions and elementwise ------------------------------------------ */

static int cpu_act_from_f32(mt_backend *be, void *dst, const float *src, int64_t n)
{
    CPU_REQUIRE(n >= 0, "act_from_f32: n=%lld is negative", (long long)n);
    if (n == 0) return MT_OK;
    CPU_REQUIRE(dst && src, "act_from_f32: NULL pointer");
    float *y = dst;
#pragma omp parallel for num_threads(cpu_team(be, n))
    for (int64_t i = 0; i < n; i++) y[i] = cpu_act(be, src[i]);
    return MT_OK;
}

static int cpu_act_to_f32(mt_backend *be, float *dst, const void *src, int64_t n)
{
    (void)be;
    CPU_REQUIRE(n >= 0, "act_to_f32: n=%lld is negative", (long long)n);
    return cpu_memcpy("act_to_f32", dst, src, (size_t)n * sizeof(float));
}

/* Stochastic rounding to bf16 (mt_bf16_from_f32_sr with the low 32 bits of
 * mt_hash_u64(seed, i) for element i) when the backend stores bf16-valued
 * acts (round_bf16); with fp32 acts nothing is rounded, as in act_from_f32. */
static int cpu_act_from_f32_sr(mt_backend *be, void *dst, const float *src, int64_t n,
                               uint64_t seed)
{
    CPU_REQUIRE(n >= 0, "act_from_f32_sr: n=%lld is negative", (long long)n);
    if (n == 0) return MT_OK;
    CPU_REQUIRE(dst && src, "act_from_f32_sr: NULL pointer");
    float *y = dst;
#pragma omp parallel for num_threads(cpu_team(be, n))
    for (int64_t i = 0; i < n; i++) y[i] = cpu_act_sr(be, src[i], seed, i);
    return MT_OK;
}

static int cpu_bf16_to_f32(mt_backend *be, float *dst, const uint16_t *src, int64_t n)
{
    CPU_REQUIRE(n >= 0, "bf16_to_f32: n=%lld is negative", (long long)n);
    if (n == 0) return MT_OK;
    CPU_REQUIRE(dst && src, "bf16_to_f32: NULL pointer");
#pragma omp parallel for num_threads(cpu_team(be, n))
    for (int64_t i = 0; i < n; i++) dst[i] = mt_bf16_to_f32(src[i]);
    return MT_OK;
}

static int cpu_add(mt_backend *be, void *y, const void *a, const void *b, int64_t n)
{
    CPU_REQUIRE(n >= 0, "add: n=%lld is negative", (long long)n);
    if (n == 0) return MT_OK;
    CPU_REQUIRE(y && a && b, "add: NULL pointer");
    float *yy = y; /* may alias a or b: element i is read before it is written */
    const float *aa = a, *bb = b;
#pragma omp parallel for num_threads(cpu_team(be, n))
    for (int64_t i = 0; i < n; i++) yy[i] = cpu_act(be, aa[i] + bb[i]);
    return MT_OK;
}

static int cpu_copy2d(mt_backend *be, void *dst, int ldd, const void *src, int lds, int rows,
                      int cols, int accumulate)
{
    CPU_REQUIRE(rows >= 0 && cols >= 0, "copy2d: rows=%d cols=%d", rows, cols);
    if (rows == 0 || cols == 0) return MT_OK;
    CPU_REQUIRE(dst && src, "copy2d: NULL pointer");
    CPU_REQUIRE(ldd >= cols && lds >= cols, "copy2d: ldd=%d lds=%d < cols=%d", ldd, lds, cols);
    float *d = dst;
    const float *s = src;
#pragma omp parallel for num_threads(cpu_team(be, (int64_t)rows * cols))
    for (int r = 0; r < rows; r++) {
        float *dr = d + (int64_t)r * ldd;
        const float *sr = s + (int64_t)r * lds;
        if (accumulate)
            for (int c = 0; c < cols; c++) dr[c] = cpu_act(be, dr[c] + sr[c]);
        else
            for (int c = 0; c < cols; c++) dr[c] = cpu_act(be, sr[c]);
    }
    return MT_OK;
}

/* ---- creation ---------------------------------------------------------------- */

int mt_backend_cpu_create(mt_backend **out, int threads)
{
    CPU_REQUIRE(out != NULL, "cpu backend: out is NULL");
    *out = NULL;
    CPU_REQUIRE(threads >= 0, "cpu backend: threads=%d is negative", threads);
    mt_backend *be = calloc(1, sizeof *be);
    cpu_impl *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return MT_ERR(MT_ENOMEM, "cpu backend: out of memory");
    }
#ifdef _OPENMP
    c->threads = threads > 0 ? threads : omp_get_num_procs();
#else
    c->threads = 1;
#endif
    if (c->threads < 1) c->threads = 1;
    atomic_init(&c->in_use, 0);
    atomic_init(&c->peak, 0);
    for (int q = 0; q < 256; q++) c->e4m3_lut[q] = mt_e4m3_to_f32((uint8_t)q);

    be->kind = MT_BE_CPU;
    be->name = "cpu";
    be->act_bytes = 4;
    be->round_bf16 = 0;
    be->peak_tflops = 0; /* unknown: no MFU on the CPU */
    be->impl = c;
    be->alloc = cpu_alloc;
    be->free = cpu_free;
    be->upload = cpu_upload;
    be->download = cpu_download;
    be->host_alloc = cpu_host_alloc;
    be->host_free = cpu_host_free;
    be->copy = cpu_copy;
    be->zero = cpu_zero;
    be->sync = cpu_sync;
    be->stream = cpu_stream;
    be->mark = cpu_mark;
    be->marks_read = cpu_marks_read;
    be->mem_stats = cpu_mem_stats;
    be->destroy = cpu_destroy;
    be->act_from_f32 = cpu_act_from_f32;
    be->act_to_f32 = cpu_act_to_f32;
    be->add = cpu_add;
    be->copy2d = cpu_copy2d;
    be->act_from_f32_sr = cpu_act_from_f32_sr;
    be->bf16_to_f32 = cpu_bf16_to_f32;
    cpu_install_gemm(be);
    cpu_install_fp8(be);
    cpu_install_norm(be);
    cpu_install_attn(be);
    cpu_install_moe(be);
    cpu_install_loss(be);
    cpu_install_optim(be);
    *out = be;
    return MT_OK;
}
