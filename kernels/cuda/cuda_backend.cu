/* cuda_backend.cu - the CUDA backend: creation, the device memory arena,
 * memory ops, act conversions, add, copy2d.
 *
 * Memory: one cudaMalloc at creation (the arena, sized from the free memory
 * unless the caller gives a size); alloc / free are first-fit over a sorted
 * block list with coalescing, so nothing calls cudaMalloc while training.
 * The op scratch (cuda_scratch) is a fixed slice of the arena.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_impl.h"
#include "base/mt_log.h"

#define ARENA_ALIGN 256
/* cuDNN's deterministic SDPA backward keeps dP (B*H*T*T bf16: 4 GiB at
 * T=4096, H=128) in its workspace; the rest is small reductions. */
#define SCRATCH_DEFAULT (4608ull << 20)

/* ---- helpers shared by the cuda_*.cu files ---------------------------------- */

void *cuda_scratch(mt_backend *be, size_t bytes)
{
    cuda_impl *c = cuda_of(be);
    if (bytes > c->scratch_cap) {
        mt_err_at(MT_ENOMEM, __FILE__, __LINE__,
                  "cuda scratch: an op needs %zu bytes, %zu reserved (MOETRAIN_CUDA_SCRATCH_MB)",
                  bytes, c->scratch_cap);
        return NULL;
    }
    return c->scratch;
}

int cuda_fan_out(mt_backend *be, int S)
{
    cuda_impl *c = cuda_of(be);
    if (S <= 0) return MT_OK;
    MT_CUDA_CHECK(cudaEventRecord(c->xevent[CUDA_EXPERT_STREAMS], c->stream));
    for (int i = 0; i < S; i++)
        MT_CUDA_CHECK(cudaStreamWaitEvent(c->xstream[i], c->xevent[CUDA_EXPERT_STREAMS], 0));
    return MT_OK;
}

int cuda_fan_in(mt_backend *be, int S)
{
    cuda_impl *c = cuda_of(be);
    for (int i = 0; i < S; i++) {
        MT_CUDA_CHECK(cudaEventRecord(c->xevent[i], c->xstream[i]));
        MT_CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->xevent[i], 0));
    }
    return MT_OK;
}

/* ---- arena ------------------------------------------------------------------ */

static int blocks_insert(cuda_impl *c, int at, cuda_block b)
{
    if (c->n_blocks == c->cap_blocks) {
        int cap = c->cap_blocks ? 2 * c->cap_blocks : 256;
        cuda_block *nb = (cuda_block *)realloc(c->blocks, (size_t)cap * sizeof *nb);
        if (!nb) return MT_ERR(MT_ENOMEM, "cuda arena: out of host memory");
        c->blocks = nb;
        c->cap_blocks = cap;
    }
    memmove(&c->blocks[at + 1], &c->blocks[at], (size_t)(c->n_blocks - at) * sizeof *c->blocks);
    c->blocks[at] = b;
    c->n_blocks++;
    return MT_OK;
}

static void blocks_remove(cuda_impl *c, int at)
{
    memmove(&c->blocks[at], &c->blocks[at + 1], (size_t)(c->n_blocks - at - 1) * sizeof *c->blocks);
    c->n_blocks--;
}

static int cuda_alloc(mt_backend *be, size_t bytes, void **p)
{
    cuda_impl *c = cuda_of(be);
    CUDA_REQUIRE(p != NULL, "alloc: p is NULL");
    *p = NULL;
    size_t need = (bytes + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
    if (need == 0) need = ARENA_ALIGN;
    for (int i = 0; i < c->n_blocks; i++) {
        cuda_block *b = &c->blocks[i];
        if (b->used || b->size < need) continue;
        if (b->size > need) {
            cuda_block rest = {b->off + need, b->size - need, 0};
            b->size = need;
            MT_CHECK(blocks_insert(c, i + 1, rest));
            b = &c->blocks[i];
        }
        b->used = 1;
        c->in_use += need;
        if (c->in_use > c->peak) c->peak = c->in_use;
        *p = c->arena + b->off;
        MT_CUDA_CHECK(cudaMemsetAsync(*p, 0, need, c->stream));
        return MT_OK;
    }
    return MT_ERR(MT_ENOMEM,
                  "cuda arena: no free block of %zu bytes (%zu of %zu in use); raise the arena "
                  "size or shrink the micro-batch",
                  need, c->in_use, c->arena_cap);
}

static void cuda_free(mt_backend *be, void *p)
{
    cuda_impl *c = cuda_of(be);
    if (!p) return;
    size_t off = (size_t)((char *)p - c->arena);
    for (int i = 0; i < c->n_blocks; i++) {
        if (c->blocks[i].off != off || !c->blocks[i].used) continue;
        c->blocks[i].used = 0;
        c->in_use -= c->blocks[i].size;
        if (i + 1 < c->n_blocks && !c->blocks[i + 1].used) {
            c->blocks[i].size += c->blocks[i + 1].size;
            blocks_remove(c, i + 1);
        }
        if (i > 0 && !c->blocks[i - 1].used) {
            c->blocks[i - 1].size += c->blocks[i].size;
            blocks_remove(c, i);
        }
        return;
    }
    MT_LOGE("cuda arena: free of a pointer it does not hold (%p)", p);
}

static void cuda_mem_stats(mt_backend *be, size_t *in_use, size_t *peak)
{
    cuda_impl *c = cuda_of(be);
    if (in_use) *in_use = c->in_use;
    if (peak) *peak = c->peak;
}

/* ---- memory ops ----------------------------------------------------------------- */

static int cuda_upload(mt_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!bytes) return MT_OK;
    CUDA_REQUIRE(dst && src, "upload: NULL pointer");
    /* Pageable host memory: the call returns once the source is staged;
     * page-locked (host_alloc): it returns at once and the copy runs on
     * the stream (the caller syncs before reusing the source). */
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cuda_stream(be)));
    return MT_OK;
}

static int cuda_download(mt_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!bytes) return MT_OK;
    CUDA_REQUIRE(dst && src, "download: NULL pointer");
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cuda_stream(be)));
    MT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream(be)));
    return MT_OK;
}

/* Page-locked host memory (ops.h host_alloc): device copies to and from it
 * are DMA at full link speed and need no staging; portable, so any context
 * of the process sees it pinned. */
static int cuda_host_alloc(mt_backend *be, size_t bytes, void **p)
{
    CUDA_REQUIRE(p != NULL, "host_alloc: p is NULL");
    *p = NULL;
    MT_CUDA_CHECK(cudaSetDevice(cuda_of(be)->device));
    cudaError_t e = cudaHostAlloc(p, bytes ? bytes : 1, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* not sticky: the next launch check must not see it */
        *p = NULL;
        return MT_ERR(MT_ENOMEM, "host_alloc: %zu MB of page-locked host memory: %s",
                      bytes >> 20, cudaGetErrorString(e));
    }
    return MT_OK;
}

static void cuda_host_free(mt_backend *be, void *p)
{
    (void)be;
    if (!p) return;
    cudaError_t e = cudaFreeHost(p);
    if (e != cudaSuccess) {
        cudaGetLastError();
        MT_LOGE("cuda host_free(%p): %s", p, cudaGetErrorString(e));
    }
}

static int cuda_copy(mt_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!bytes || dst == src) return MT_OK;
    CUDA_REQUIRE(dst && src, "copy: NULL pointer");
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda_stream(be)));
    return MT_OK;
}

static int cuda_zero(mt_backend *be, void *p, size_t bytes)
{
    if (!bytes) return MT_OK;
    CUDA_REQUIRE(p, "zero: NULL pointer");
    MT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cuda_stream(be)));
    return MT_OK;
}

static int cuda_sync(mt_backend *be)
{
    MT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream(be)));
    return MT_OK;
}

static void *cuda_stream_of(mt_backend *be) { return (void *)cuda_stream(be); }

/* Marks: timing events on the main stream; more are created (a host call,
 * no device wait) when an index first goes past those there are. */
static int cuda_mark(mt_backend *be, int i)
{
    cuda_impl *c = cuda_of(be);
    CUDA_REQUIRE(i >= 0, "mark: index %d", i);
    if (i >= c->cap_marks) {
        int cap = c->cap_marks ? c->cap_marks : 64;
        while (cap <= i) cap *= 2;
        cudaEvent_t *m = (cudaEvent_t *)realloc(c->marks, (size_t)cap * sizeof *m);
        if (!m) return MT_ERR(MT_ENOMEM, "cuda backend: out of memory for %d marks", cap);
        c->marks = m;
        for (; c->cap_marks < cap; c->cap_marks++) /* cap_marks: the events created */
            MT_CUDA_CHECK(cudaEventCreate(&m[c->cap_marks]));
    }
    MT_CUDA_CHECK(cudaEventRecord(c->marks[i], c->stream));
    return MT_OK;
}

static int cuda_marks_read(mt_backend *be, int n, double *t)
{
    cuda_impl *c = cuda_of(be);
    CUDA_REQUIRE(n >= 0 && n <= c->cap_marks, "marks_read: %d marks, %d recorded at most", n,
                 c->cap_marks);
    if (n == 0) return MT_OK;
    MT_CUDA_CHECK(cudaEventSynchronize(c->marks[n - 1]));
    t[0] = 0;
    for (int i = 1; i < n; i++) {
        float ms = 0;
        MT_CUDA_CHECK(cudaEventElapsedTime(&ms, c->marks[0], c->marks[i]));
        t[i] = 1e-3 * (double)ms;
    }
    return MT_OK;
}

/* ---- elementwise -------------------------------------------------------------- */

__global__ void k_f32_to_bf16(bf16 *dst, const float *src, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void k_bf16_to_f32(float *dst, const bf16 *src, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}

__global__ void k_add(bf16 *y, const bf16 *a, const bf16 *b, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

__global__ void k_copy2d(bf16 *dst, int ldd, const bf16 *src, int lds, int rows, int cols,
                         int accumulate)
{
    int64_t n = (int64_t)rows * cols;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / cols, col = i % cols;
        float v = __bfloat162float(src[r * lds + col]);
        if (accumulate) v += __bfloat162float(dst[r * ldd + col]);
        dst[r * ldd + col] = __float2bfloat16_rn(v);
    }
}

/* Grid-stride launches: enough blocks to fill the device, not one per element. */
static unsigned ew_grid(const mt_backend *be, int64_t n)
{
    unsigned g = cuda_grid(n, 256), cap = (unsigned)cuda_of(be)->sm_count * 16;
    return g < cap ? g : cap;
}

static int cuda_act_from_f32(mt_backend *be, void *dst, const float *src, int64_t n)
{
    if (n <= 0) return MT_OK;
    CUDA_REQUIRE(dst && src, "act_from_f32: NULL pointer");
    k_f32_to_bf16<<<ew_grid(be, n), 256, 0, cuda_stream(be)>>>((bf16 *)dst, src, n);
    CUDA_LAUNCH_CHECK("act_from_f32");
    return MT_OK;
}

static int cuda_act_to_f32(mt_backend *be, float *dst, const void *src, int64_t n)
{
    if (n <= 0) return MT_OK;
    CUDA_REQUIRE(dst && src, "act_to_f32: NULL pointer");
    k_bf16_to_f32<<<ew_grid(be, n), 256, 0, cuda_stream(be)>>>(dst, (const bf16 *)src, n);
    CUDA_LAUNCH_CHECK("act_to_f32");
    return MT_OK;
}

static int cuda_add(mt_backend *be, void *y, const void *a, const void *b, int64_t n)
{
    if (n <= 0) return MT_OK;
    CUDA_REQUIRE(y && a && b, "add: NULL pointer");
    k_add<<<ew_grid(be, n), 256, 0, cuda_stream(be)>>>((bf16 *)y, (const bf16 *)a,
                                                       (const bf16 *)b, n);
    CUDA_LAUNCH_CHECK("add");
    return MT_OK;
}

static int cuda_copy2d(mt_backend *be, void *dst, int ldd, const void *src, int lds, int rows,
                       int cols, int accumulate)
{
    if (rows <= 0 || cols <= 0) return MT_OK;
    CUDA_REQUIRE(dst && src && ldd >= cols && lds >= cols, "copy2d: bad arguments");
    k_copy2d<<<ew_grid(be, (int64_t)rows * cols), 256, 0, cuda_stream(be)>>>(
        (bf16 *)dst, ldd, (const bf16 *)src, lds, rows, cols, accumulate);
    CUDA_LAUNCH_CHECK("copy2d");
    return MT_OK;
}

void cuda_install_backend(mt_backend *be)
{
    be->alloc = cuda_alloc;
    be->free = cuda_free;
    be->upload = cuda_upload;
    be->download = cuda_download;
    be->host_alloc = cuda_host_alloc;
    be->host_free = cuda_host_free;
    be->copy = cuda_copy;
    be->zero = cuda_zero;
    be->sync = cuda_sync;
    be->stream = cuda_stream_of;
    be->mark = cuda_mark;
    be->marks_read = cuda_marks_read;
    be->mem_stats = cuda_mem_stats;
    be->act_from_f32 = cuda_act_from_f32;
    be->act_to_f32 = cuda_act_to_f32;
    be->add = cuda_add;
    be->copy2d = cuda_copy2d;
}

/* ---- creation ------------------------------------------------------------------ */

static void cuda_destroy(mt_backend *be)
{
    if (!be) return;
    cuda_impl *c = cuda_of(be);
    if (c) {
        cudaSetDevice(c->device);
        if (c->stream) cudaStreamSynchronize(c->stream);
        cuda_prof_destroy(be);
        cuda_attn_destroy(be);
        cuda_gemm_destroy(be);
        for (int i = 0; i < CUDA_EXPERT_STREAMS; i++)
            if (c->xstream[i]) cudaStreamDestroy(c->xstream[i]);
        for (int i = 0; i <= CUDA_EXPERT_STREAMS; i++)
            if (c->xevent[i]) cudaEventDestroy(c->xevent[i]);
        for (int i = 0; i <= CUDA_EXPERT_STREAMS; i++)
            if (c->lt_ws[i]) cudaFree(c->lt_ws[i]);
        if (c->lt) cublasLtDestroy(c->lt);
        if (c->dnn) cudnnDestroy(c->dnn);
        if (c->arena) cudaFree(c->arena);
        for (int i = 0; i < c->cap_marks; i++) cudaEventDestroy(c->marks[i]);
        free(c->marks);
        if (c->stream) cudaStreamDestroy(c->stream);
        free(c->blocks);
        free(c);
    }
    free(be);
}

int mt_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* no driver: clear the sticky error */
        return 0;
    }
    return n;
}

static size_t env_mb(const char *name, size_t dflt)
{
    const char *v = getenv(name);
    return v && *v ? (size_t)strtoull(v, NULL, 10) << 20 : dflt;
}

static int create(mt_backend *be, cuda_impl *c, int device, size_t arena_bytes, int sharers,
                  size_t reserve)
{
    cudaDeviceProp prop;
    c->device = device;
    MT_CUDA_CHECK(cudaSetDevice(device));
    MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    if (prop.major < 9)
        return MT_ERR(MT_ENOTSUP, "cuda backend: %s is compute capability %d.%d; moetrain's "
                                  "kernels are built for Hopper (sm_90a)",
                      prop.name, prop.major, prop.minor);
    c->sm_count = prop.multiProcessorCount;
    /* Dense BF16 peak (H100/H200 SXM datasheet) for MFU. */
    if (strstr(prop.name, "H100") || strstr(prop.name, "H200") || strstr(prop.name, "GH200"))
        be->peak_tflops = 989.4;
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    for (int i = 0; i < CUDA_EXPERT_STREAMS; i++)
        MT_CUDA_CHECK(cudaStreamCreateWithFlags(&c->xstream[i], cudaStreamNonBlocking));
    for (int i = 0; i <= CUDA_EXPERT_STREAMS; i++)
        MT_CUDA_CHECK(cudaEventCreateWithFlags(&c->xevent[i], cudaEventDisableTiming));
    MT_CUBLAS_CHECK(cublasLtCreate(&c->lt));
    for (int i = 0; i <= CUDA_EXPERT_STREAMS; i++)
        MT_CUDA_CHECK(cudaMalloc(&c->lt_ws[i], CUDA_LT_WORKSPACE));
    MT_CUDNN_CHECK(cudnnCreate(&c->dnn));
    MT_CUDNN_CHECK(cudnnSetStream(c->dnn, c->stream));

    size_t free_b = 0, total_b = 0;
    MT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (!arena_bytes) {
        /* all but a reserve for the CUDA context growth, cuDNN and cuBLAS;
         * processes sharing the device take equal parts of its total, so
         * that ranks starting at once agree */
        if (!reserve) reserve = (size_t)1536 << 20;
        size_t want = sharers > 1 ? total_b / (size_t)sharers : free_b;
        if (want <= 2 * reserve || free_b <= 2 * reserve)
            return MT_ERR(MT_ENOMEM, "cuda backend: only %zu MB free on %s (%zu MB for each of "
                          "%d processes)", free_b >> 20, prop.name, want >> 20, sharers);
        arena_bytes = want - reserve;
        if (arena_bytes > free_b - reserve) arena_bytes = free_b - reserve;
    }
    arena_bytes = arena_bytes / ARENA_ALIGN * ARENA_ALIGN;
    cudaError_t e = cudaMalloc((void **)&c->arena, arena_bytes);
    if (e != cudaSuccess)
        return MT_ERR(MT_ENOMEM, "cuda backend: arena of %zu MB: %s", arena_bytes >> 20,
                      cudaGetErrorString(e));
    c->arena_cap = arena_bytes;
    c->scratch_cap = env_mb("MOETRAIN_CUDA_SCRATCH_MB", SCRATCH_DEFAULT);
    if (c->scratch_cap >= arena_bytes / 2) c->scratch_cap = arena_bytes / 4 / ARENA_ALIGN * ARENA_ALIGN;
    c->scratch = c->arena; /* the scratch is the arena's first slice */
    cuda_block rest = {c->scratch_cap, arena_bytes - c->scratch_cap, 0};
    MT_CHECK(blocks_insert(c, 0, rest));

    be->kind = MT_BE_CUDA;
    be->name = "cuda";
    be->act_bytes = 2;
    be->round_bf16 = 1;
    be->destroy = cuda_destroy;
    cuda_install_backend(be);
    cuda_install_fp8(be);
    cuda_install_norm(be);
    cuda_install_moe(be);
    cuda_install_loss(be);
    MT_CHECK(cuda_install_gemm(be));
    cuda_install_rope_mla(be);
    MT_CHECK(cuda_install_attn(be));
    MT_CHECK(cuda_prof_install(be)); /* last: it wraps the ops above */
    MT_LOGI("cuda backend: %s (%d SMs, %zu MB), arena %zu MB, scratch %zu MB", prop.name,
            c->sm_count, total_b >> 20, arena_bytes >> 20, c->scratch_cap >> 20);
    return MT_OK;
}

static int make(mt_backend **out, int device, size_t arena_bytes, int sharers, size_t reserve);

int mt_backend_cuda_create(mt_backend **out, int device, size_t arena_bytes)
{
    return make(out, device, arena_bytes, 1, 0);
}

int mt_backend_cuda_create_shared(mt_backend **out, int device, int sharers)
{
    return make(out, device, 0, sharers > 1 ? sharers : 1, 0);
}

int mt_backend_cuda_create_reserve(mt_backend **out, int device, int sharers, size_t reserve)
{
    return make(out, device, 0, sharers > 1 ? sharers : 1, reserve);
}

static int make(mt_backend **out, int device, size_t arena_bytes, int sharers, size_t reserve)
{
    *out = NULL;
    int n = mt_cuda_device_count();
    if (device < 0 || device >= n)
        return MT_ERR(MT_ENOTSUP, "cuda backend: device %d requested, %d present", device, n);
    mt_backend *be = (mt_backend *)calloc(1, sizeof *be);
    cuda_impl *c = (cuda_impl *)calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return MT_ERR(MT_ENOMEM, "cuda backend: out of host memory");
    }
    be->impl = c;
    be->destroy = cuda_destroy;
    int rc = create(be, c, device, arena_bytes, sharers, reserve);
    if (rc < 0) {
        cuda_destroy(be);
        return rc;
    }
    *out = be;
    return MT_OK;
}
