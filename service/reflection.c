/* reflection.c - the descriptor index (see reflection.h); the RPC handler
 * is in reflection_rpc.c. */
#include "service/reflection.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

typedef enum { SYM_OTHER = 0, SYM_MESSAGE, SYM_SERVICE } sym_kind;

typedef struct symbol {
    char *name;
    int file;
    sym_kind kind;
} symbol;

typedef struct file_desc {
    const uint8_t *data;
    size_t len;
    char *name;
    char *package;
    int n_deps;
    char **deps;
} file_desc;

struct reflection {
    file_desc *files;
    int n_files;
    symbol *syms;
    int n_syms, cap_syms;
};

/* ---- protobuf wire reading --------------------------------------------------- */

typedef struct wire {
    const uint8_t *p, *end;
} wire;

static int read_varint(wire *w, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (w->p >= w->end) return -1;
        uint8_t b = *w->p++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return 0;
    }
    return -1;
}

/* Next field: its number, and for length-delimited ones the bytes. Other
 * wire types are skipped over (*len = 0, *bytes = NULL). 1 a field, 0 the
 * end, -1 malformed. */
static int next_field(wire *w, uint32_t *field, const uint8_t **bytes, size_t *len)
{
    if (w->p >= w->end) return 0;
    uint64_t tag, v;
    if (read_varint(w, &tag) < 0) return -1;
    *field = (uint32_t)(tag >> 3);
    *bytes = NULL;
    *len = 0;
    switch (tag & 7) {
    case 0: return read_varint(w, &v) < 0 ? -1 : 1;
    case 1:
        if (w->end - w->p < 8) return -1;
        w->p += 8;
        return 1;
    case 5:
        if (w->end - w->p < 4) return -1;
        w->p += 4;
        return 1;
    case 2:
        if (read_varint(w, &v) < 0 || v > (uint64_t)(w->end - w->p)) return -1;
        *bytes = w->p;
        *len = (size_t)v;
        w->p += v;
        return 1;
    default: return -1;
    }
}

static char *dup_bytes(const uint8_t *b, size_t n)
{
    char *s = malloc(n + 1);
    if (!s) return NULL;
    memcpy(s, b, n);
    s[n] = '\0';
    return s;
}

/* ---- indexing ------------------------------------------------------------------- */

static int add_symbol(reflection *r, const char *scope, const uint8_t *name, size_t nlen,
                      int file, sym_kind kind, char **full)
{
    if (r->n_syms == r->cap_syms) {
        int cap = r->cap_syms ? 2 * r->cap_syms : 64;
        symbol *s = realloc(r->syms, (size_t)cap * sizeof *s);
        if (!s) return MT_ERR(MT_ENOMEM, "reflection: out of memory");
        r->syms = s;
        r->cap_syms = cap;
    }
    size_t sl = strlen(scope);
    char *n = malloc(sl + 1 + nlen + 1);
    if (!n) return MT_ERR(MT_ENOMEM, "reflection: out of memory");
    if (sl) {
        memcpy(n, scope, sl);
        n[sl] = '.';
        memcpy(n + sl + 1, name, nlen);
        n[sl + 1 + nlen] = '\0';
    } else {
        memcpy(n, name, nlen);
        n[nlen] = '\0';
    }
    r->syms[r->n_syms++] = (symbol){n, file, kind};
    if (full) *full = n;
    return MT_OK;
}

/* The name (field 1) of a descriptor message. */
static int name_of(const uint8_t *d, size_t n, const uint8_t **name, size_t *len)
{
    wire w = {d, d + n};
    uint32_t f;
    const uint8_t *b;
    size_t l;
    int rc;
    while ((rc = next_field(&w, &f, &b, &l)) == 1)
        if (f == 1 && b) {
            *name = b;
            *len = l;
            return MT_OK;
        }
    return MT_ERR(MT_ECORRUPT, "reflection: descriptor without a name");
}

/* Enum values live in the enum's enclosing scope (protobuf's C++ rule). */
/* An enum or a service: its name, then each field-2 child (enum values, which
 * protobuf scopes beside the enum; service methods, scoped inside it). */
static int index_named(reflection *r, const char *scope, const uint8_t *d, size_t n, int file,
                       int is_service)
{
    const uint8_t *nm = NULL; /* set by name_of on success */
    size_t nl = 0;
    char *full = NULL;
    MT_CHECK(name_of(d, n, &nm, &nl));
    MT_CHECK(add_symbol(r, scope, nm, nl, file, is_service ? SYM_SERVICE : SYM_OTHER,
                        is_service ? &full : NULL));
    wire w = {d, d + n};
    uint32_t f;
    const uint8_t *b;
    size_t l;
    int rc;
    while ((rc = next_field(&w, &f, &b, &l)) == 1)
        if (f == 2 && b) {
            MT_CHECK(name_of(b, l, &nm, &nl));
            MT_CHECK(add_symbol(r, is_service ? full : scope, nm, nl, file, SYM_OTHER, NULL));
        }
    if (rc < 0)
        return MT_ERR(MT_ECORRUPT, "reflection: bad %s descriptor", is_service ? "service" : "enum");
    return MT_OK;
}

static int index_message(reflection *r, const char *scope, const uint8_t *d, size_t n, int file,
                         int depth)
{
    if (depth > 32) return MT_ERR(MT_ECORRUPT, "reflection: messages nested too deep");
    const uint8_t *nm = NULL;
    size_t nl = 0;
    char *full;
    MT_CHECK(name_of(d, n, &nm, &nl));
    MT_CHECK(add_symbol(r, scope, nm, nl, file, SYM_MESSAGE, &full));
    wire w = {d, d + n};
    uint32_t f;
    const uint8_t *b;
    size_t l;
    int rc;
    while ((rc = next_field(&w, &f, &b, &l)) == 1) {
        if (!b) continue;
        if (f == 2 || f == 6 || f == 8) { /* field, extension, oneof_decl */
            MT_CHECK(name_of(b, l, &nm, &nl));
            MT_CHECK(add_symbol(r, full, nm, nl, file, SYM_OTHER, NULL));
        } else if (f == 3) { /* nested_type */
            MT_CHECK(index_message(r, full, b, l, file, depth + 1));
        } else if (f == 4) { /* enum_type */
            MT_CHECK(index_named(r, full, b, l, file, 0));
        }
    }
    return rc < 0 ? MT_ERR(MT_ECORRUPT, "reflection: bad message descriptor") : MT_OK;
}

static int index_file(reflection *r, int i)
{
    file_desc *fd = &r->files[i];
    wire w = {fd->data, fd->data + fd->len};
    uint32_t f;
    const uint8_t *b;
    size_t l;
    int rc;
    /* name, package and dependencies first: symbols need the package. */
    while ((rc = next_field(&w, &f, &b, &l)) == 1) {
        if (!b) continue;
        if (f == 1) {
            free(fd->name);
            fd->name = dup_bytes(b, l);
        } else if (f == 2) {
            free(fd->package);
            fd->package = dup_bytes(b, l);
        } else if (f == 3) {
            char **d = realloc(fd->deps, (size_t)(fd->n_deps + 1) * sizeof *d);
            if (!d) return MT_ERR(MT_ENOMEM, "reflection: out of memory");
            fd->deps = d;
            if (!(d[fd->n_deps++] = dup_bytes(b, l)))
                return MT_ERR(MT_ENOMEM, "reflection: out of memory");
        }
    }
    if (rc < 0 || !fd->name) return MT_ERR(MT_ECORRUPT, "reflection: bad file descriptor %d", i);
    if (!fd->package && !(fd->package = dup_bytes((const uint8_t *)"", 0)))
        return MT_ERR(MT_ENOMEM, "reflection: out of memory");
    w = (wire){fd->data, fd->data + fd->len};
    while ((rc = next_field(&w, &f, &b, &l)) == 1) {
        if (!b) continue;
        if (f == 4) MT_CHECK(index_message(r, fd->package, b, l, i, 0));
        else if (f == 5) MT_CHECK(index_named(r, fd->package, b, l, i, 0));
        else if (f == 6) MT_CHECK(index_named(r, fd->package, b, l, i, 1));
    }
    return MT_OK;
}

int reflection_create(reflection **out, const uint8_t *set, size_t len)
{
    *out = NULL;
    reflection *r = calloc(1, sizeof *r);
    if (!r) return MT_ERR(MT_ENOMEM, "reflection: out of memory");
    int rc = MT_OK;
    wire w = {set, set + len};
    uint32_t f;
    const uint8_t *b;
    size_t l;
    int wr;
    while ((wr = next_field(&w, &f, &b, &l)) == 1) {
        if (f != 1 || !b) continue;
        file_desc *fs = realloc(r->files, (size_t)(r->n_files + 1) * sizeof *fs);
        if (!fs) {
            rc = MT_ERR(MT_ENOMEM, "reflection: out of memory");
            goto fail;
        }
        r->files = fs;
        memset(&fs[r->n_files], 0, sizeof *fs);
        fs[r->n_files].data = b;
        fs[r->n_files].len = l;
        r->n_files++;
        MT_GOTO(index_file(r, r->n_files - 1), fail);
    }
    if (wr < 0) {
        rc = MT_ERR(MT_ECORRUPT, "reflection: bad descriptor set");
        goto fail;
    }
    *out = r;
    return MT_OK;
fail:
    reflection_destroy(r);
    return rc;
}

void reflection_destroy(reflection *r)
{
    if (!r) return;
    for (int i = 0; i < r->n_files; i++) {
        free(r->files[i].name);
        free(r->files[i].package);
        for (int d = 0; d < r->files[i].n_deps; d++) free(r->files[i].deps[d]);
        free(r->files[i].deps);
    }
    for (int i = 0; i < r->n_syms; i++) free(r->syms[i].name);
    free(r->syms);
    free(r->files);
    free(r);
}

int reflection_n_files(const reflection *r) { return r->n_files; }

int reflection_file_by_name(const reflection *r, const char *name)
{
    for (int i = 0; i < r->n_files; i++)
        if (!strcmp(r->files[i].name, name)) return i;
    return -1;
}

static const symbol *find_symbol(const reflection *r, const char *name)
{
    if (name[0] == '.') name++; /* ".pkg.Msg" is fully qualified too */
    for (int i = 0; i < r->n_syms; i++)
        if (!strcmp(r->syms[i].name, name)) return &r->syms[i];
    return NULL;
}

int reflection_file_by_symbol(const reflection *r, const char *symbol)
{
    const struct symbol *s = find_symbol(r, symbol);
    return s ? s->file : -1;
}

int reflection_is_message(const reflection *r, const char *symbol)
{
    const struct symbol *s = find_symbol(r, symbol);
    return s && s->kind == SYM_MESSAGE;
}

int reflection_closure(const reflection *r, int file, int *out, int cap)
{
    int n = 0;
    if (file < 0 || file >= r->n_files || cap < 1) return 0;
    out[n++] = file;
    for (int k = 0; k < n; k++) {
        const file_desc *fd = &r->files[out[k]];
        for (int d = 0; d < fd->n_deps; d++) {
            int j = reflection_file_by_name(r, fd->deps[d]);
            int seen = j < 0;
            for (int m = 0; m < n && !seen; m++) seen = out[m] == j;
            if (!seen && n < cap) out[n++] = j;
        }
    }
    return n;
}

void reflection_file_bytes(const reflection *r, int i, const uint8_t **data, size_t *len)
{
    *data = r->files[i].data;
    *len = r->files[i].len;
}

int reflection_n_services(const reflection *r)
{
    int n = 0;
    for (int i = 0; i < r->n_syms; i++) n += r->syms[i].kind == SYM_SERVICE;
    return n;
}

const char *reflection_service(const reflection *r, int i)
{
    for (int k = 0; k < r->n_syms; k++)
        if (r->syms[k].kind == SYM_SERVICE && i-- == 0) return r->syms[k].name;
    return NULL;
}
