/* mt_npy.c - see mt_npy.h. */
#define _POSIX_C_SOURCE 200809L
#include "base/mt_npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/mt_fs.h"
#include "base/mt_status.h"

static const char magic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};

struct mt_npy_writer {
    FILE *f;
    char *path, *partial;
    int64_t total, written;  /* elements */
    int esize;               /* bytes per element */
};

/* Element size from a descr such as "<f4" or "|u1"; 0 if not understood. */
static int descr_size(const char *descr)
{
    if (strlen(descr) < 3 || !strchr("<>|=", descr[0]) || !strchr("fiub", descr[1])) return 0;
    char *end;
    long n = strtol(descr + 2, &end, 10);
    return *end || n < 1 || n > 16 ? 0 : (int)n;
}

int mt_npy_create(mt_npy_writer **out, const char *path, const char *descr, int ndim,
                  const int64_t *shape)
{
    *out = NULL;
    int esize = descr_size(descr);
    if (!esize) return MT_ERR(MT_EINVAL, "%s: dtype \"%s\" not understood", path, descr);
    if (ndim < 0 || ndim > MT_NPY_MAX_DIMS)
        return MT_ERR(MT_EINVAL, "%s: %d dimensions (at most %d)", path, ndim, MT_NPY_MAX_DIMS);
    /* the header dict; a 1-tuple needs its trailing comma */
    char dict[256], dims[160] = "";
    int64_t total = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return MT_ERR(MT_EINVAL, "%s: negative dimension %d", path, i);
        size_t l = strlen(dims);
        snprintf(dims + l, sizeof dims - l, "%s%lld", i ? ", " : "", (long long)shape[i]);
        total *= shape[i];
    }
    snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (%s%s), }",
             descr, dims, ndim == 1 ? "," : "");
    /* 10 bytes of preamble + dict + spaces + '\n', a multiple of 64 */
    size_t hl = strlen(dict) + 1;
    hl += (64 - (10 + hl) % 64) % 64;
    mt_npy_writer *w = calloc(1, sizeof *w);
    if (!w) return MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    w->path = strdup(path);
    w->partial = malloc(strlen(path) + 9);
    if (!w->path || !w->partial) {
        mt_npy_close(w, 1);
        return MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    }
    sprintf(w->partial, "%s.partial", path);
    w->total = total;
    w->esize = esize;
    int rc = mt_mkdir_parent(path);
    if (rc < 0) {
        mt_npy_close(w, 1);
        return rc;
    }
    w->f = fopen(w->partial, "wb");
    if (!w->f) {
        int e = errno;
        mt_npy_close(w, 1);
        return MT_ERR(MT_EIO, "%s.partial: cannot create: %s", path, strerror(e));
    }
    unsigned char pre[10];
    memcpy(pre, magic, 6);
    pre[6] = 1;
    pre[7] = 0;
    pre[8] = (unsigned char)(hl & 0xff);
    pre[9] = (unsigned char)(hl >> 8);
    char *hdr = malloc(hl);
    if (!hdr) {
        mt_npy_close(w, 1);
        return MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    }
    memset(hdr, ' ', hl);
    memcpy(hdr, dict, strlen(dict));
    hdr[hl - 1] = '\n';
    int ok = fwrite(pre, 1, 10, w->f) == 10 && fwrite(hdr, 1, hl, w->f) == hl;
    free(hdr);
    if (!ok) {
        int e = errno;
        mt_npy_close(w, 1);
        return MT_ERR(MT_EIO, "%s.partial: write failed: %s", path, strerror(e));
    }
    *out = w;
    return MT_OK;
}

int mt_npy_write(mt_npy_writer *w, const void *data, int64_t n)
{
    if (n < 0 || w->written + n > w->total)
        return MT_ERR(MT_EINVAL, "%s: %lld more elements exceed the shape's %lld", w->path,
                      (long long)n, (long long)w->total);
    if (n && fwrite(data, (size_t)w->esize, (size_t)n, w->f) != (size_t)n)
        return MT_ERR(MT_EIO, "%s.partial: write failed: %s", w->path, strerror(errno));
    w->written += n;
    return MT_OK;
}

int mt_npy_close(mt_npy_writer *w, int abandon)
{
    if (!w) return MT_OK;
    int rc = MT_OK;
    if (!abandon && w->written != w->total)
        rc = MT_ERR(MT_EINVAL, "%s: %lld of %lld elements written", w->path, (long long)w->written,
                    (long long)w->total);
    if (w->f) {
        if (rc == MT_OK && !abandon && (fflush(w->f) != 0 || fsync(fileno(w->f)) != 0))
            rc = MT_ERR(MT_EIO, "%s.partial: %s", w->path, strerror(errno));
        if (fclose(w->f) != 0 && rc == MT_OK && !abandon)
            rc = MT_ERR(MT_EIO, "%s.partial: %s", w->path, strerror(errno));
        if (rc == MT_OK && !abandon && rename(w->partial, w->path) != 0)
            rc = MT_ERR(MT_EIO, "%s: cannot rename %s: %s", w->path, w->partial, strerror(errno));
        if (rc == MT_OK && !abandon) mt_fsync_parent(w->path);
        if (rc != MT_OK || abandon) unlink(w->partial);
    }
    free(w->path);
    free(w->partial);
    free(w);
    return rc;
}

/* ---- reading ---------------------------------------------------------------------- */

/* The value text after 'key': in a header dict, or NULL. */
static const char *dict_value(const char *hdr, const char *key)
{
    char k[32];
    snprintf(k, sizeof k, "'%s'", key);
    const char *p = strstr(hdr, k);
    if (!p) return NULL;
    p += strlen(k);
    while (*p == ' ') p++;
    if (*p++ != ':') return NULL;
    while (*p == ' ') p++;
    return p;
}

static int read_header(FILE *f, const char *path, char *descr, size_t dcap, int *ndim,
                       int64_t shape[2])
{
    unsigned char pre[12];
    if (fread(pre, 1, 10, f) != 10 || memcmp(pre, magic, 6) != 0)
        return MT_ERR(MT_EINVAL, "%s: not a .npy file (no \\x93NUMPY magic)", path);
    size_t hl;
    if (pre[6] == 1) {
        hl = pre[8] | (size_t)pre[9] << 8;
    } else if (pre[6] == 2 || pre[6] == 3) {
        if (fread(pre + 10, 1, 2, f) != 2) return MT_ERR(MT_EINVAL, "%s: truncated header", path);
        hl = pre[8] | (size_t)pre[9] << 8 | (size_t)pre[10] << 16 | (size_t)pre[11] << 24;
        if (hl > (1u << 20)) return MT_ERR(MT_EINVAL, "%s: header of %zu bytes", path, hl);
    } else {
        return MT_ERR(MT_EINVAL, "%s: .npy version %d.%d is not supported", path, pre[6], pre[7]);
    }
    char *hdr = malloc(hl + 1);
    if (!hdr) return MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    int rc = MT_OK;
    if (fread(hdr, 1, hl, f) != hl) {
        rc = MT_ERR(MT_EINVAL, "%s: truncated header", path);
        goto out;
    }
    hdr[hl] = '\0';
    const char *d = dict_value(hdr, "descr"), *fo = dict_value(hdr, "fortran_order"),
               *sh = dict_value(hdr, "shape");
    if (!d || *d != '\'' || !fo || !sh || *sh != '(') {
        rc = MT_ERR(MT_EINVAL, "%s: header is not a .npy dict: %.80s", path, hdr);
        goto out;
    }
    size_t dl = strcspn(d + 1, "'");
    if (dl + 1 > dcap) dl = dcap - 1;
    memcpy(descr, d + 1, dl);
    descr[dl] = '\0';
    if (strncmp(fo, "False", 5) != 0) {
        rc = MT_ERR(MT_EINVAL, "%s: Fortran-ordered arrays are not supported (save a C-ordered "
                    "copy: numpy.ascontiguousarray)", path);
        goto out;
    }
    *ndim = 0;
    const char *p = sh + 1;
    for (;;) {
        while (*p == ' ' || *p == ',') p++;
        if (*p == ')') break;
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < 0) {
            rc = MT_ERR(MT_EINVAL, "%s: bad shape in header: %.80s", path, sh);
            goto out;
        }
        if (*ndim == 2) {
            rc = MT_ERR(MT_EINVAL, "%s: more than 2 dimensions (want [sequences, tokens] or "
                        "[tokens])", path);
            goto out;
        }
        shape[(*ndim)++] = v;
        p = end;
    }
out:
    free(hdr);
    return rc;
}

int mt_npy_read_int32(const char *path, int32_t **data, int64_t *rows, int64_t *cols)
{
    *data = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return MT_ERR(MT_EIO, "%s: cannot open: %s", path, strerror(errno));
    char descr[16];
    int ndim = 0;
    int64_t shape[2] = {0, 0};
    unsigned char *raw = NULL;
    int rc = read_header(f, path, descr, sizeof descr, &ndim, shape);
    if (rc < 0) goto out;
    if (ndim == 0) {
        rc = MT_ERR(MT_EINVAL, "%s: a scalar, not an array of tokens", path);
        goto out;
    }
    *rows = ndim == 2 ? shape[0] : 1;
    *cols = ndim == 2 ? shape[1] : shape[0];
    int es = descr_size(descr);
    int is_signed = descr[1] == 'i';
    if (!es || (descr[1] != 'i' && descr[1] != 'u') || (es != 1 && es != 2 && es != 4 && es != 8) ||
        (es > 1 && descr[0] == '>')) {
        rc = MT_ERR(MT_EINVAL, "%s: dtype '%s' is not a little-endian integer type", path, descr);
        goto out;
    }
    int64_t n = *rows > 0 && *cols > ((int64_t)1 << 34) / *rows ? -1 : *rows * *cols;
    if (n < 0) {
        rc = MT_ERR(MT_EINVAL, "%s: %lld tokens is too many", path, (long long)n);
        goto out;
    }
    raw = malloc((size_t)(n ? n : 1) * (size_t)es);
    *data = malloc((size_t)(n ? n : 1) * 4);
    if (!raw || !*data) {
        rc = MT_ERR(MT_ENOMEM, "%s: out of memory", path);
        goto out;
    }
    if (fread(raw, (size_t)es, (size_t)n, f) != (size_t)n) {
        rc = MT_ERR(MT_EINVAL, "%s: the file holds fewer than the %lld elements of its shape", path,
                    (long long)n);
        goto out;
    }
    for (int64_t i = 0; i < n; i++) {
        const unsigned char *b = raw + i * es;
        uint64_t u = 0;
        for (int k = 0; k < es; k++) u |= (uint64_t)b[k] << (8 * k);
        int64_t v;
        if (is_signed && es < 8 && (u >> (8 * es - 1)) & 1) u |= ~(uint64_t)0 << (8 * es);
        v = (int64_t)u;
        if ((!is_signed && u > INT32_MAX) || v < INT32_MIN || v > INT32_MAX) {
            rc = MT_ERR(MT_EINVAL, "%s: element %lld (%lld) does not fit a token id", path,
                        (long long)i, is_signed ? (long long)v : (long long)u);
            goto out;
        }
        (*data)[i] = (int32_t)v;
    }
out:
    free(raw);
    fclose(f);
    if (rc < 0) {
        free(*data);
        *data = NULL;
    }
    return rc;
}
