/* data_indexed.c - Megatron indexed dataset reader (mmap) and writer. */
#define _POSIX_C_SOURCE 200809L

#include "engine/data/data_indexed.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/mt_fs.h"
#include "base/mt_status.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the Megatron .idx/.bin format is little-endian; this reader assumes a little-endian host"
#endif

static const char idx_magic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};

/* magic(9) + version(8) + dtype(1) + sequence count(8) + document count(8) */
enum { IDX_HEADER_BYTES = 34 };

int mt_idx_dtype_size(int dtype)
{
    switch (dtype) {
    case MT_IDX_UINT8:
    case MT_IDX_INT8: return 1;
    case MT_IDX_INT16:
    case MT_IDX_UINT16: return 2;
    case MT_IDX_INT32:
    case MT_IDX_FLOAT32: return 4;
    case MT_IDX_INT64:
    case MT_IDX_FLOAT64: return 8;
    default: return 0;
    }
}

const char *mt_idx_dtype_name(int dtype)
{
    static const char *const names[MT_IDX_DTYPE_MAX + 1] = {
        "unknown", "uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16",
    };
    _Static_assert(sizeof names / sizeof names[0] == MT_IDX_DTYPE_MAX + 1, "dtype names");
    if (dtype < 1 || dtype > MT_IDX_DTYPE_MAX) return names[0];
    return names[dtype];
}

int mt_idx_dtype_for_vocab(int64_t vocab)
{
    return vocab < 65500 ? MT_IDX_UINT16 : MT_IDX_INT32;
}

static int dtype_is_float(int dtype)
{
    return dtype == MT_IDX_FLOAT32 || dtype == MT_IDX_FLOAT64;
}

static char *path_join(const char *prefix, const char *suffix)
{
    size_t a = strlen(prefix), b = strlen(suffix);
    char *p = malloc(a + b + 1);
    if (!p) return NULL;
    memcpy(p, prefix, a);
    memcpy(p + a, suffix, b + 1);
    return p;
}

/* ---- reader ---------------------------------------------------------------- */

struct mt_indexed {
    char *prefix;
    char *idx_path;
    char *bin_path;
    const uint8_t *idx; /* [idx_size] mapped .idx */
    size_t idx_size;
    const uint8_t *bin; /* [bin_size] mapped .bin; NULL when empty */
    size_t bin_size;
    int dtype;
    int itemsize;
    int64_t nseq;           /* S */
    int64_t ndoc1;          /* D + 1 */
    int64_t ntokens;        /* sum of lengths */
    const uint8_t *lengths; /* i32[S], unaligned */
    const uint8_t *pointers; /* i64[S], unaligned */
    const uint8_t *docidx;  /* i64[D + 1], unaligned */
};

/* The index arrays start at byte 34, so they are read with memcpy. */
static int32_t load_i32(const uint8_t *base, int64_t i)
{
    int32_t v;
    memcpy(&v, base + 4 * i, sizeof v);
    return v;
}

static int64_t load_i64(const uint8_t *base, int64_t i)
{
    int64_t v;
    memcpy(&v, base + 8 * i, sizeof v);
    return v;
}

static uint64_t load_u64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Maps path read-only; an empty file gives *data == NULL, *size == 0. */
static int map_file(const char *path, const uint8_t **data, size_t *size)
{
    *data = NULL;
    *size = 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        int e = errno;
        return MT_ERR(e == ENOENT ? MT_ENOTFOUND : MT_EIO, "%s: cannot open: %s", path,
                      strerror(e));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return MT_ERR(MT_EIO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return MT_ERR(MT_EINVAL, "%s: not a regular file", path);
    }
    if (st.st_size > 0) {
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return MT_ERR(MT_EIO, "%s: mmap of %lld bytes failed: %s", path,
                          (long long)st.st_size, strerror(e));
        }
        *data = p;
        *size = (size_t)st.st_size;
    }
    close(fd);
    return MT_OK;
}

static int idx_check_header(mt_indexed *ds)
{
    const char *path = ds->idx_path;
    if (ds->idx_size < sizeof idx_magic)
        return MT_ERR(MT_ECORRUPT, "%s: truncated .idx: %zu bytes, the header needs %d", path,
                      ds->idx_size, IDX_HEADER_BYTES);
    if (memcmp(ds->idx, idx_magic, sizeof idx_magic) != 0)
        return MT_ERR(MT_ECORRUPT, "%s: wrong magic: not a Megatron MMIDIDX index", path);
    if (ds->idx_size < IDX_HEADER_BYTES)
        return MT_ERR(MT_ECORRUPT, "%s: truncated .idx: %zu bytes, the header needs %d", path,
                      ds->idx_size, IDX_HEADER_BYTES);
    uint64_t version = load_u64(ds->idx + 9);
    if (version != 1)
        return MT_ERR(MT_ECORRUPT, "%s: unsupported version %llu (only version 1 is known)",
                      path, (unsigned long long)version);
    int code = ds->idx[17];
    ds->itemsize = mt_idx_dtype_size(code);
    if (ds->itemsize == 0)
        return MT_ERR(MT_ECORRUPT, "%s: unknown dtype code %d (known: 1..%d)", path, code,
                      MT_IDX_DTYPE_MAX);
    ds->dtype = code;
    uint64_t nseq = load_u64(ds->idx + 18), ndoc1 = load_u64(ds->idx + 26);
    /* Counts beyond 2^58 cannot fit any file and would overflow the sizes. */
    if (nseq > (1ull << 58) || ndoc1 > (1ull << 58))
        return MT_ERR(MT_ECORRUPT, "%s: implausible counts: %llu sequences, %llu document indices",
                      path, (unsigned long long)nseq, (unsigned long long)ndoc1);
    ds->nseq = (int64_t)nseq;
    ds->ndoc1 = (int64_t)ndoc1;
    uint64_t need = IDX_HEADER_BYTES + nseq * 12 + ndoc1 * 8;
    if (ds->idx_size < need)
        return MT_ERR(MT_ECORRUPT,
                      "%s: truncated .idx: %zu bytes, %llu sequences and %llu document "
                      "indices need %llu",
                      path, ds->idx_size, (unsigned long long)nseq, (unsigned long long)ndoc1,
                      (unsigned long long)need);
    /* Multimodal files append one int8 mode per sequence; nothing else fits. */
    if (ds->idx_size != need && ds->idx_size != need + nseq)
        return MT_ERR(MT_ECORRUPT, "%s: %zu bytes, expected %llu (or %llu with sequence modes)",
                      path, ds->idx_size, (unsigned long long)need,
                      (unsigned long long)(need + nseq));
    if (ndoc1 < 1)
        return MT_ERR(MT_ECORRUPT, "%s: document count is 0; the document indices must start "
                      "with a 0 entry", path);
    ds->lengths = ds->idx + IDX_HEADER_BYTES;
    ds->pointers = ds->lengths + 4 * nseq;
    ds->docidx = ds->pointers + 8 * nseq;
    return MT_OK;
}

/* Pointers must be the running sum of lengths times the item size: that is
 * what Megatron writes, and it makes every document a contiguous range. */
static int idx_check_sequences(mt_indexed *ds)
{
    int64_t bytes = 0;
    for (int64_t i = 0; i < ds->nseq; i++) {
        int32_t len = load_i32(ds->lengths, i);
        int64_t ptr = load_i64(ds->pointers, i);
        if (len < 0)
            return MT_ERR(MT_ECORRUPT, "%s: sequence %lld has negative length %d",
                          ds->idx_path, (long long)i, len);
        if (ptr != bytes)
            return MT_ERR(MT_ECORRUPT,
                          "%s: sequence pointer %lld is %lld, but the lengths before it put it "
                          "at byte %lld: pointers inconsistent with lengths",
                          ds->idx_path, (long long)i, (long long)ptr, (long long)bytes);
        bytes += (int64_t)len * ds->itemsize;
    }
    ds->ntokens = bytes / ds->itemsize;
    if ((uint64_t)bytes > ds->bin_size)
        return MT_ERR(MT_ECORRUPT, "%s: truncated .bin: %zu bytes, the index needs %lld",
                      ds->bin_path, ds->bin_size, (long long)bytes);
    if ((uint64_t)bytes < ds->bin_size)
        return MT_ERR(MT_ECORRUPT,
                      "%s: %zu bytes, but the index describes %lld: .bin and .idx do not match",
                      ds->bin_path, ds->bin_size, (long long)bytes);
    return MT_OK;
}

static int idx_check_documents(const mt_indexed *ds)
{
    int64_t first = load_i64(ds->docidx, 0);
    if (first != 0)
        return MT_ERR(MT_ECORRUPT, "%s: document index 0 is %lld, expected 0", ds->idx_path,
                      (long long)first);
    int64_t prev = 0;
    for (int64_t k = 1; k < ds->ndoc1; k++) {
        int64_t v = load_i64(ds->docidx, k);
        if (v < prev)
            return MT_ERR(MT_ECORRUPT,
                          "%s: document indices not monotone: entry %lld is %lld after %lld",
                          ds->idx_path, (long long)k, (long long)v, (long long)prev);
        if (v > ds->nseq)
            return MT_ERR(MT_ECORRUPT,
                          "%s: document index %lld is %lld, out of range (%lld sequences)",
                          ds->idx_path, (long long)k, (long long)v, (long long)ds->nseq);
        prev = v;
    }
    if (prev != ds->nseq)
        return MT_ERR(MT_ECORRUPT,
                      "%s: the last document index is %lld, expected the sequence count %lld",
                      ds->idx_path, (long long)prev, (long long)ds->nseq);
    return MT_OK;
}

int mt_indexed_open(const char *prefix, mt_indexed **out)
{
    *out = NULL;
    if (!prefix || !*prefix) return MT_ERR(MT_EINVAL, "indexed dataset: empty path prefix");
    mt_indexed *ds = calloc(1, sizeof *ds);
    if (!ds) return MT_ERR(MT_ENOMEM, "indexed dataset %s: out of memory", prefix);
    int rc = MT_OK;
    ds->prefix = path_join(prefix, "");
    ds->idx_path = path_join(prefix, ".idx");
    ds->bin_path = path_join(prefix, ".bin");
    if (!ds->prefix || !ds->idx_path || !ds->bin_path) {
        rc = MT_ERR(MT_ENOMEM, "indexed dataset %s: out of memory", prefix);
        goto fail;
    }
    MT_GOTO(map_file(ds->idx_path, &ds->idx, &ds->idx_size), fail);
    MT_GOTO(map_file(ds->bin_path, &ds->bin, &ds->bin_size), fail);
    MT_GOTO(idx_check_header(ds), fail);
    MT_GOTO(idx_check_sequences(ds), fail);
    MT_GOTO(idx_check_documents(ds), fail);
    *out = ds;
    return MT_OK;
fail:
    mt_indexed_close(ds);
    return rc;
}

void mt_indexed_close(mt_indexed *ds)
{
    if (!ds) return;
    if (ds->idx) munmap((void *)ds->idx, ds->idx_size);
    if (ds->bin) munmap((void *)ds->bin, ds->bin_size);
    free(ds->prefix);
    free(ds->idx_path);
    free(ds->bin_path);
    free(ds);
}

const char *mt_indexed_prefix(const mt_indexed *ds) { return ds->prefix; }
int mt_indexed_dtype(const mt_indexed *ds) { return ds->dtype; }
int64_t mt_indexed_num_sequences(const mt_indexed *ds) { return ds->nseq; }
int64_t mt_indexed_num_documents(const mt_indexed *ds) { return ds->ndoc1 - 1; }
int64_t mt_indexed_num_tokens(const mt_indexed *ds) { return ds->ntokens; }

int64_t mt_indexed_sequence_length(const mt_indexed *ds, int64_t i)
{
    if (i < 0 || i >= ds->nseq)
        return MT_ERR(MT_EINVAL, "%s: sequence %lld out of range [0, %lld)", ds->idx_path,
                      (long long)i, (long long)ds->nseq);
    return load_i32(ds->lengths, i);
}

int64_t mt_indexed_sequence_offset(const mt_indexed *ds, int64_t i)
{
    if (i < 0 || i > ds->nseq)
        return MT_ERR(MT_EINVAL, "%s: sequence %lld out of range [0, %lld]", ds->idx_path,
                      (long long)i, (long long)ds->nseq);
    if (i == ds->nseq) return ds->ntokens;
    return load_i64(ds->pointers, i) / ds->itemsize;
}

int mt_indexed_document_range(const mt_indexed *ds, int64_t d, int64_t *seq_begin,
                              int64_t *seq_end)
{
    if (d < 0 || d >= ds->ndoc1 - 1)
        return MT_ERR(MT_EINVAL, "%s: document %lld out of range [0, %lld)", ds->idx_path,
                      (long long)d, (long long)(ds->ndoc1 - 1));
    *seq_begin = load_i64(ds->docidx, d);
    *seq_end = load_i64(ds->docidx, d + 1);
    return MT_OK;
}

int mt_indexed_document_span(const mt_indexed *ds, int64_t d, int64_t *tok_begin,
                             int64_t *tok_count)
{
    int64_t s0 = 0, s1 = 0;
    MT_CHECK(mt_indexed_document_range(ds, d, &s0, &s1));
    *tok_begin = mt_indexed_sequence_offset(ds, s0);
    *tok_count = mt_indexed_sequence_offset(ds, s1) - *tok_begin;
    return MT_OK;
}

/* Converts count elements of an integer dtype to int32, rejecting values that
 * are not valid token ids. src is aligned: pointers are multiples of the item
 * size and the mapping is page-aligned. */
#define CONVERT_TOKENS(type)                                                   \
    do {                                                                       \
        const type *s = (const type *)src;                                     \
        for (int64_t k = 0; k < count; k++) {                                  \
            if (s[k] < 0 || (int64_t)s[k] > INT32_MAX) {                       \
                bad = k;                                                       \
                badv = (long long)s[k];                                        \
                break;                                                         \
            }                                                                  \
            out[k] = (int32_t)s[k];                                            \
        }                                                                      \
    } while (0)

int mt_indexed_read(const mt_indexed *ds, int64_t tok_begin, int64_t count, int32_t *out)
{
    if (dtype_is_float(ds->dtype))
        return MT_ERR(MT_ENOTSUP, "%s: dtype %s holds no token ids; only integer dtypes can be "
                      "read as tokens", ds->idx_path, mt_idx_dtype_name(ds->dtype));
    if (tok_begin < 0 || count < 0 || tok_begin > ds->ntokens || count > ds->ntokens - tok_begin)
        return MT_ERR(MT_EINVAL, "%s: tokens [%lld, %lld) out of range [0, %lld)", ds->bin_path,
                      (long long)tok_begin, (long long)(tok_begin + count),
                      (long long)ds->ntokens);
    if (count == 0) return MT_OK;
    const uint8_t *src = ds->bin + tok_begin * ds->itemsize;
    int64_t bad = -1;
    long long badv = 0;
    switch (ds->dtype) {
    case MT_IDX_UINT8:
        for (int64_t k = 0; k < count; k++) out[k] = src[k];
        break;
    case MT_IDX_UINT16: {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t k = 0; k < count; k++) out[k] = s[k];
        break;
    }
    case MT_IDX_INT8: CONVERT_TOKENS(int8_t); break;
    case MT_IDX_INT16: CONVERT_TOKENS(int16_t); break;
    case MT_IDX_INT32: CONVERT_TOKENS(int32_t); break;
    case MT_IDX_INT64: CONVERT_TOKENS(int64_t); break;
    default:
        return MT_ERR(MT_ENOTSUP, "%s: dtype code %d cannot be read as tokens", ds->idx_path,
                      ds->dtype);
    }
    if (bad >= 0)
        return MT_ERR(MT_ECORRUPT, "%s: token %lld is %lld, not a token id in [0, %d]",
                      ds->bin_path, (long long)(tok_begin + bad), badv, INT32_MAX);
    return MT_OK;
}

int mt_indexed_read_sequences(const mt_indexed *ds, int64_t seq_begin, int64_t seq_end,
                              int32_t *out, int64_t cap, int64_t *n_out)
{
    *n_out = 0;
    if (seq_begin < 0 || seq_end < seq_begin || seq_end > ds->nseq)
        return MT_ERR(MT_EINVAL, "%s: sequences [%lld, %lld) out of range [0, %lld)",
                      ds->idx_path, (long long)seq_begin, (long long)seq_end,
                      (long long)ds->nseq);
    int64_t t0 = mt_indexed_sequence_offset(ds, seq_begin);
    int64_t n = mt_indexed_sequence_offset(ds, seq_end) - t0;
    if (n > cap)
        return MT_ERR(MT_EINVAL, "%s: sequences [%lld, %lld) hold %lld tokens, buffer holds %lld",
                      ds->idx_path, (long long)seq_begin, (long long)seq_end, (long long)n,
                      (long long)cap);
    MT_CHECK(mt_indexed_read(ds, t0, n, out));
    *n_out = n;
    return MT_OK;
}

/* ---- writer ---------------------------------------------------------------- */

struct mt_indexed_writer {
    char *bin_path, *idx_path; /* final names */
    char *bin_tmp, *idx_tmp;   /* written first, renamed by finish */
    FILE *bin;
    int dtype;
    int itemsize;
    int32_t *lengths; /* [nseq] tokens per sequence */
    int64_t nseq, cap_seq;
    int64_t *docidx; /* [ndoc1] Megatron document indices, docidx[0] = 0 */
    int64_t ndoc1, cap_doc;
    int64_t nbytes; /* bytes written to .bin */
    uint8_t *buf;   /* conversion buffer [buf_cap] */
    size_t buf_cap;
    int committed;
};

int mt_indexed_writer_create(const char *prefix, int dtype, mt_indexed_writer **out)
{
    *out = NULL;
    if (!prefix || !*prefix) return MT_ERR(MT_EINVAL, "indexed writer: empty path prefix");
    int size = mt_idx_dtype_size(dtype);
    if (size == 0)
        return MT_ERR(MT_EINVAL, "indexed writer %s: unknown dtype code %d", prefix, dtype);
    if (dtype_is_float(dtype))
        return MT_ERR(MT_ENOTSUP, "indexed writer %s: dtype %s cannot hold token ids", prefix,
                      mt_idx_dtype_name(dtype));
    mt_indexed_writer *w = calloc(1, sizeof *w);
    if (!w) return MT_ERR(MT_ENOMEM, "indexed writer %s: out of memory", prefix);
    w->dtype = dtype;
    w->itemsize = size;
    w->bin_path = path_join(prefix, ".bin");
    w->idx_path = path_join(prefix, ".idx");
    w->bin_tmp = path_join(prefix, ".bin.tmp");
    w->idx_tmp = path_join(prefix, ".idx.tmp");
    w->cap_doc = 1024;
    w->docidx = malloc((size_t)w->cap_doc * sizeof *w->docidx);
    if (!w->bin_path || !w->idx_path || !w->bin_tmp || !w->idx_tmp || !w->docidx) {
        mt_indexed_writer_free(w);
        return MT_ERR(MT_ENOMEM, "indexed writer %s: out of memory", prefix);
    }
    w->docidx[0] = 0;
    w->ndoc1 = 1;
    int mrc = mt_mkdir_parent(w->bin_tmp);
    if (mrc < 0) {
        mt_indexed_writer_free(w);
        return mrc;
    }
    w->bin = fopen(w->bin_tmp, "wb");
    if (!w->bin) {
        int e = errno;
        int rc = MT_ERR(MT_EIO, "%s: cannot create: %s", w->bin_tmp, strerror(e));
        mt_indexed_writer_free(w);
        return rc;
    }
    *out = w;
    return MT_OK;
}

static int grow(void **p, int64_t *cap, int64_t need, size_t elem)
{
    if (need <= *cap) return MT_OK;
    int64_t n = *cap ? *cap : 1024;
    while (n < need) n *= 2;
    void *q = realloc(*p, (size_t)n * elem);
    if (!q) return MT_ENOMEM;
    *p = q;
    *cap = n;
    return MT_OK;
}

/* Packs tokens into w->buf in the writer's dtype; MT_EINVAL names the first
 * token that does not fit. */
static int writer_pack(mt_indexed_writer *w, const int32_t *tokens, int64_t n)
{
    size_t need = (size_t)n * (size_t)w->itemsize;
    if (need > w->buf_cap) {
        uint8_t *q = realloc(w->buf, need);
        if (!q) return MT_ERR(MT_ENOMEM, "%s: out of memory for %lld tokens", w->bin_tmp,
                              (long long)n);
        w->buf = q;
        w->buf_cap = need;
    }
    int64_t lo = 0, hi = INT32_MAX;
    switch (w->dtype) {
    case MT_IDX_UINT8: hi = UINT8_MAX; break;
    case MT_IDX_INT8: hi = INT8_MAX; break;
    case MT_IDX_INT16: hi = INT16_MAX; break;
    case MT_IDX_UINT16: hi = UINT16_MAX; break;
    default: break;
    }
    for (int64_t k = 0; k < n; k++) {
        int64_t t = tokens[k];
        if (t < lo || t > hi)
            return MT_ERR(MT_EINVAL, "%s: token %lld of document %lld is %lld, outside [%lld, "
                          "%lld] of dtype %s", w->bin_tmp, (long long)k,
                          (long long)(w->ndoc1 - 1), (long long)t, (long long)lo, (long long)hi,
                          mt_idx_dtype_name(w->dtype));
        switch (w->dtype) {
        case MT_IDX_UINT8: w->buf[k] = (uint8_t)t; break;
        case MT_IDX_INT8: ((int8_t *)w->buf)[k] = (int8_t)t; break;
        case MT_IDX_INT16: ((int16_t *)w->buf)[k] = (int16_t)t; break;
        case MT_IDX_UINT16: ((uint16_t *)w->buf)[k] = (uint16_t)t; break;
        case MT_IDX_INT32: ((int32_t *)w->buf)[k] = (int32_t)t; break;
        default: ((int64_t *)w->buf)[k] = t; break;
        }
    }
    return MT_OK;
}

int mt_indexed_writer_add_document(mt_indexed_writer *w, const int32_t *tokens, int64_t n)
{
    if (w->committed || !w->bin)
        return MT_ERR(MT_ESTATE, "%s: writer already finished", w->bin_path);
    if (n < 0 || n > INT32_MAX)
        return MT_ERR(MT_EINVAL, "%s: document of %lld tokens; the format's sequence lengths are "
                      "int32", w->bin_tmp, (long long)n);
    if (grow((void **)&w->docidx, &w->cap_doc, w->ndoc1 + 1, sizeof *w->docidx) < 0 ||
        grow((void **)&w->lengths, &w->cap_seq, w->nseq + 1, sizeof *w->lengths) < 0)
        return MT_ERR(MT_ENOMEM, "%s: out of memory for the index", w->bin_tmp);
    if (n > 0) {
        MT_CHECK(writer_pack(w, tokens, n));
        size_t bytes = (size_t)n * (size_t)w->itemsize;
        if (fwrite(w->buf, 1, bytes, w->bin) != bytes) {
            int e = errno;
            return MT_ERR(MT_EIO, "%s: write failed: %s", w->bin_tmp, strerror(e));
        }
        w->lengths[w->nseq++] = (int32_t)n;
        w->nbytes += (int64_t)bytes;
    }
    w->docidx[w->ndoc1++] = w->nseq;
    return MT_OK;
}

static int write_all(FILE *f, const void *p, size_t n, const char *path)
{
    if (n && fwrite(p, 1, n, f) != n) {
        int e = errno;
        return MT_ERR(MT_EIO, "%s: write failed: %s", path, strerror(e));
    }
    return MT_OK;
}

/* Flushes, fsyncs and closes f; always closes. */
static int close_durable(FILE *f, const char *path)
{
    int rc = MT_OK;
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) {
        int e = errno;
        rc = MT_ERR(MT_EIO, "%s: flush/fsync failed: %s", path, strerror(e));
    }
    if (fclose(f) != 0 && rc == MT_OK) {
        int e = errno;
        rc = MT_ERR(MT_EIO, "%s: close failed: %s", path, strerror(e));
    }
    return rc;
}

static int writer_write_index(const mt_indexed_writer *w)
{
    FILE *f = fopen(w->idx_tmp, "wb");
    if (!f) {
        int e = errno;
        return MT_ERR(MT_EIO, "%s: cannot create: %s", w->idx_tmp, strerror(e));
    }
    uint8_t head[IDX_HEADER_BYTES];
    uint64_t version = 1, nseq = (uint64_t)w->nseq, ndoc1 = (uint64_t)w->ndoc1;
    memcpy(head, idx_magic, 9);
    memcpy(head + 9, &version, 8);
    head[17] = (uint8_t)w->dtype;
    memcpy(head + 18, &nseq, 8);
    memcpy(head + 26, &ndoc1, 8);
    int rc = write_all(f, head, sizeof head, w->idx_tmp);
    if (rc == MT_OK)
        rc = write_all(f, w->lengths, (size_t)w->nseq * sizeof *w->lengths, w->idx_tmp);
    int64_t ptr = 0, chunk[512];
    for (int64_t i = 0; rc == MT_OK && i < w->nseq; i += 512) {
        int64_t m = w->nseq - i < 512 ? w->nseq - i : 512;
        for (int64_t k = 0; k < m; k++) {
            chunk[k] = ptr;
            ptr += (int64_t)w->lengths[i + k] * w->itemsize;
        }
        rc = write_all(f, chunk, (size_t)m * sizeof chunk[0], w->idx_tmp);
    }
    if (rc == MT_OK)
        rc = write_all(f, w->docidx, (size_t)w->ndoc1 * sizeof *w->docidx, w->idx_tmp);
    int rc2 = close_durable(f, w->idx_tmp);
    return rc < 0 ? rc : rc2;
}

/* Makes the renames durable. */
static int fsync_parent_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash) {
        strcpy(dir, ".");
    } else if (slash == path) {
        strcpy(dir, "/");
    } else {
        size_t n = (size_t)(slash - path);
        if (n >= sizeof dir) return MT_ERR(MT_EINVAL, "%s: path too long", path);
        memcpy(dir, path, n);
        dir[n] = '\0';
    }
    int fd = open(dir, O_RDONLY);
    if (fd < 0) {
        int e = errno;
        return MT_ERR(MT_EIO, "%s: cannot open directory: %s", dir, strerror(e));
    }
    int rc = MT_OK;
    if (fsync(fd) != 0) {
        int e = errno;
        rc = MT_ERR(MT_EIO, "%s: directory fsync failed: %s", dir, strerror(e));
    }
    close(fd);
    return rc;
}

int mt_indexed_writer_finish(mt_indexed_writer *w)
{
    if (w->committed || !w->bin)
        return MT_ERR(MT_ESTATE, "%s: writer already finished", w->bin_path);
    int rc = close_durable(w->bin, w->bin_tmp);
    w->bin = NULL;
    MT_CHECK(rc);
    MT_CHECK(writer_write_index(w));
    /* .bin first: a reader that races the two renames sees a size mismatch,
     * which open() reports, never a silently wrong pairing. */
    if (rename(w->bin_tmp, w->bin_path) != 0) {
        int e = errno;
        return MT_ERR(MT_EIO, "rename %s -> %s failed: %s", w->bin_tmp, w->bin_path, strerror(e));
    }
    if (rename(w->idx_tmp, w->idx_path) != 0) {
        int e = errno;
        return MT_ERR(MT_EIO, "rename %s -> %s failed: %s", w->idx_tmp, w->idx_path, strerror(e));
    }
    w->committed = 1;
    return fsync_parent_dir(w->idx_path);
}

void mt_indexed_writer_free(mt_indexed_writer *w)
{
    if (!w) return;
    if (w->bin) fclose(w->bin);
    if (!w->committed) {
        if (w->bin_tmp) unlink(w->bin_tmp);
        if (w->idx_tmp) unlink(w->idx_tmp);
    }
    free(w->bin_path);
    free(w->idx_path);
    free(w->bin_tmp);
    free(w->idx_tmp);
    free(w->lengths);
    free(w->docidx);
    free(w->buf);
    free(w);
}

int64_t mt_indexed_writer_num_documents(const mt_indexed_writer *w) { return w->ndoc1 - 1; }

int64_t mt_indexed_writer_num_tokens(const mt_indexed_writer *w)
{
    return w->nbytes / w->itemsize;
}
