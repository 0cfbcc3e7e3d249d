/* safetensors.c - see safetensors.h. */
#define _POSIX_C_SOURCE 200809L
#include "ckpt/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/mt_fs.h"
#include "base/mt_status.h"

size_t mt_st_dtype_size(const char *d)
{
    static const struct {
        const char *n;
        size_t s;
    } t[] = {{"F8_E4M3", 1}, {"F8_E5M2", 1}, {"BF16", 2}, {"F16", 2}, {"F32", 4}, {"F64", 8},
             {"I8", 1},      {"U8", 1},      {"I16", 2},  {"I32", 4}, {"I64", 8}, {"BOOL", 1}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(d, t[i].n)) return t[i].s;
    return 0;
}

void mt_st_close(mt_st_file *f)
{
    if (!f) return;
    if (f->map && f->map != MAP_FAILED) munmap((void *)f->map, f->size);
    if (f->fd >= 0) close(f->fd);
    free(f->t);
    free(f);
}

static int parse_header(mt_st_file *f, const char *text, size_t len)
{
    json_error_t e;
    json_t *root = json_loadb(text, len, 0, &e);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return MT_ERR(MT_ECORRUPT, "%s: header is not a JSON object (%s)", f->path, e.text);
    }
    f->t = calloc(json_object_size(root) + 1, sizeof *f->t);
    if (!f->t) {
        json_decref(root);
        return MT_ERR(MT_ENOMEM, "out of memory");
    }
    const uint64_t data_len = f->size - f->data_off;
    const char *key;
    json_t *v;
    int rc = MT_OK;
    json_object_foreach(root, key, v)
    {
        if (!strcmp(key, "__metadata__")) continue;
        mt_st_tensor *t = &f->t[f->n];
        json_t *dt = json_object_get(v, "dtype"), *sh = json_object_get(v, "shape"),
               *of = json_object_get(v, "data_offsets");
        if (strlen(key) >= sizeof t->name || !json_is_string(dt) || !json_is_array(sh) ||
            json_array_size(sh) > 8 || !json_is_array(of) || json_array_size(of) != 2) {
            rc = MT_ERR(MT_ECORRUPT, "%s: tensor %s: bad header entry", f->path, key);
            break;
        }
        snprintf(t->name, sizeof t->name, "%s", key);
        snprintf(t->dtype, sizeof t->dtype, "%s", json_string_value(dt));
        t->ndim = (int)json_array_size(sh);
        uint64_t numel = 1;
        int bad = 0;
        for (int k = 0; k < t->ndim; k++) {
            json_t *v = json_array_get(sh, (size_t)k);
            t->shape[k] = json_integer_value(v);
            bad |= !json_is_integer(v) || t->shape[k] < 0 ||
                   __builtin_mul_overflow(numel, (uint64_t)t->shape[k], &numel);
        }
        if (bad) {
            rc = MT_ERR(MT_ECORRUPT, "%s: tensor %s: bad shape", f->path, key);
            break;
        }
        t->begin = (uint64_t)json_integer_value(json_array_get(of, 0));
        t->end = (uint64_t)json_integer_value(json_array_get(of, 1));
        size_t es = mt_st_dtype_size(t->dtype);
        uint64_t nbytes;
        if (!es || __builtin_mul_overflow(numel, (uint64_t)es, &nbytes) || t->end < t->begin ||
            t->end > data_len || t->end - t->begin != nbytes) {
            rc = MT_ERR(MT_ECORRUPT,
                        "%s: tensor %s: %s %llu elements at [%llu, %llu) do not fit the %llu data "
                        "bytes",
                        f->path, key, t->dtype, (unsigned long long)numel,
                        (unsigned long long)t->begin, (unsigned long long)t->end,
                        (unsigned long long)data_len);
            break;
        }
        f->n++;
    }
    json_decref(root);
    return rc;
}

int mt_st_open(mt_st_file **out, const char *path)
{
    *out = NULL;
    mt_st_file *f = calloc(1, sizeof *f);
    if (!f) return MT_ERR(MT_ENOMEM, "out of memory");
    snprintf(f->path, sizeof f->path, "%s", path);
    f->fd = open(path, O_RDONLY);
    int rc = MT_OK;
    struct stat st;
    if (f->fd < 0 || fstat(f->fd, &st) != 0) {
        rc = MT_ERR(MT_EIO, "%s: cannot open: %s", path, strerror(errno));
        goto fail;
    }
    f->size = (size_t)st.st_size;
    uint64_t hl = 0;
    if (f->size < 8 || pread(f->fd, &hl, 8, 0) != 8 || hl > f->size - 8) {
        rc = MT_ERR(MT_ECORRUPT, "%s: not a safetensors file (header length)", path);
        goto fail;
    }
    f->data_off = 8 + (size_t)hl;
    f->map = mmap(NULL, f->size, PROT_READ, MAP_SHARED, f->fd, 0);
    if (f->map == MAP_FAILED) {
        rc = MT_ERR(MT_EIO, "%s: cannot map: %s", path, strerror(errno));
        goto fail;
    }
    if ((rc = parse_header(f, (const char *)f->map + 8, (size_t)hl)) < 0) goto fail;
    *out = f;
    return MT_OK;
fail:
    mt_st_close(f);
    return rc;
}

int mt_st_find(const mt_st_file *f, const char *name)
{
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->t[i].name, name)) return i;
    return -1;
}

int mt_st_read(const mt_st_file *f, void *dst, size_t n, uint64_t off)
{
    char *p = dst;
    uint64_t at = f->data_off + off;
    while (n) {
        ssize_t got = pread(f->fd, p, n, (off_t)at);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0)
            return MT_ERR(MT_EIO, "%s: read of %zu bytes at %llu failed: %s", f->path, n,
                          (unsigned long long)at, got < 0 ? strerror(errno) : "end of file");
        p += got;
        at += (uint64_t)got;
        n -= (size_t)got;
    }
    return MT_OK;
}

/* ---- writer ---------------------------------------------------------------------- */

struct mt_st_writer {
    char path[4096], tmp[4200];
    FILE *fp;
    uint64_t want, have;
};

int mt_st_writer_open(mt_st_writer **out, const char *path, const mt_st_tensor *e, int n)
{
    *out = NULL;
    json_t *h = json_object();
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        json_t *shape = json_array();
        uint64_t numel = 1;
        for (int k = 0; k < e[i].ndim; k++) {
            json_array_append_new(shape, json_integer(e[i].shape[k]));
            numel *= (uint64_t)e[i].shape[k];
        }
        uint64_t bytes = numel * mt_st_dtype_size(e[i].dtype);
        json_object_set_new(h, e[i].name,
                            json_pack("{s:s,s:o,s:[I,I]}", "dtype", e[i].dtype, "shape", shape,
                                      "data_offsets", (json_int_t)off, (json_int_t)(off + bytes)));
        off += bytes;
    }
    json_object_set_new(h, "__metadata__", json_pack("{s:s}", "format", "pt"));
    /* tensors in data order: the header keeps insertion order */
    char *text = json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(h);
    if (!text) return MT_ERR(MT_ENOMEM, "out of memory");
    size_t len = strlen(text), pad = (8 - len % 8) % 8;
    mt_st_writer *w = calloc(1, sizeof *w);
    if (!w) {
        free(text);
        return MT_ERR(MT_ENOMEM, "out of memory");
    }
    snprintf(w->path, sizeof w->path, "%s", path);
    snprintf(w->tmp, sizeof w->tmp, "%s.tmp", path);
    w->want = off;
    w->fp = fopen(w->tmp, "wb");
    uint64_t hl = len + pad;
    int ok = w->fp && fwrite(&hl, 8, 1, w->fp) == 1 && fwrite(text, 1, len, w->fp) == len &&
             fwrite("        ", 1, pad, w->fp) == pad;
    free(text);
    if (!ok) {
        int rc = MT_ERR(MT_EIO, "%s: cannot write: %s", w->tmp, strerror(errno));
        mt_st_writer_abort(w);
        return rc;
    }
    *out = w;
    return MT_OK;
}

int mt_st_writer_write(mt_st_writer *w, const void *data, size_t n)
{
    if (w->have + n > w->want)
        return MT_ERR(MT_EINVAL, "%s: more data than the header declares", w->path);
    if (fwrite(data, 1, n, w->fp) != n) return MT_ERR(MT_EIO, "%s: write failed: %s", w->tmp, strerror(errno));
    w->have += n;
    return MT_OK;
}

void mt_st_writer_abort(mt_st_writer *w)
{
    if (!w) return;
    if (w->fp) fclose(w->fp);
    unlink(w->tmp);
    free(w);
}

int mt_st_writer_close(mt_st_writer *w)
{
    int rc = MT_OK;
    if (w->have != w->want)
        rc = MT_ERR(MT_EINVAL, "%s: %llu of %llu data bytes written", w->path,
                    (unsigned long long)w->have, (unsigned long long)w->want);
    if (rc == MT_OK && (fflush(w->fp) != 0 || fsync(fileno(w->fp)) != 0))
        rc = MT_ERR(MT_EIO, "%s: flush failed: %s", w->tmp, strerror(errno));
    if (fclose(w->fp) != 0 && rc == MT_OK) rc = MT_ERR(MT_EIO, "%s: close failed", w->tmp);
    w->fp = NULL;
    if (rc == MT_OK && rename(w->tmp, w->path) != 0)
        rc = MT_ERR(MT_EIO, "%s: cannot rename: %s", w->path, strerror(errno));
    if (rc == MT_OK) rc = mt_fsync_parent(w->path);
    if (rc < 0) unlink(w->tmp);
    free(w);
    return rc;
}
