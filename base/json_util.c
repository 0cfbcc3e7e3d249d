/* json_util.c - see json_util.h. */
#define _POSIX_C_SOURCE 200809L
#include "base/json_util.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_fs.h"
#include "base/mt_status.h"

static void *field_ptr(void *obj, const mt_field *f) { return (char *)obj + f->offset; }
static const void *field_cptr(const void *obj, const mt_field *f)
{
    return (const char *)obj + f->offset;
}

static const char *type_name(mt_field_type t)
{
    switch (t) {
    case MT_FT_INT:
    case MT_FT_I64: return "an integer";
    case MT_FT_F64: return "a number";
    case MT_FT_BOOL: return "true or false";
    case MT_FT_STR: return "a string";
    case MT_FT_ENUM: return "a string";
    }
    return "?";
}

static void full_path(char *buf, size_t cap, const char *ctx, const char *path)
{
    if (ctx && *ctx)
        snprintf(buf, cap, "%s.%s", ctx, path);
    else
        snprintf(buf, cap, "%s", path);
}

static int enum_list(const mt_field *f, char *buf, size_t cap)
{
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; f->enum_names[i]; i++) {
        int w = snprintf(buf + used, cap - used, "%s\"%s\"", i ? ", " : "", f->enum_names[i]);
        if (w < 0 || (size_t)w >= cap - used) break;
        used += (size_t)w;
    }
    return 0;
}

static int check_range(const mt_field *f, double v, const char *fp)
{
    if (f->min <= f->max && (v < f->min || v > f->max))
        return MT_ERR(MT_EINVAL, "%s: %g is out of range [%g, %g]", fp, v, f->min, f->max);
    return MT_OK;
}

/* Stores a JSON value into the struct field, validating type and range. */
static int store_value(const mt_field *f, void *obj, json_t *v, const char *fp)
{
    void *p = field_ptr(obj, f);
    if (json_is_null(v)) {
        if (!f->nullable) return MT_ERR(MT_EINVAL, "%s: must be %s, not null", fp, type_name(f->type));
        switch (f->type) {
        case MT_FT_INT:
        case MT_FT_BOOL:
        case MT_FT_ENUM: *(int *)p = 0; break;
        case MT_FT_I64: *(int64_t *)p = 0; break;
        case MT_FT_F64: *(double *)p = 0.0; break;
        case MT_FT_STR: ((char *)p)[0] = '\0'; break;
        }
        return MT_OK;
    }
    switch (f->type) {
    case MT_FT_INT:
    case MT_FT_I64: {
        double d;
        if (json_is_integer(v))
            d = (double)json_integer_value(v);
        else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)))
            d = json_real_value(v); /* 1e3 or 2.0 written for an integer */
        else
            return MT_ERR(MT_EINVAL, "%s: must be an integer", fp);
        MT_CHECK(check_range(f, d, fp));
        if (f->type == MT_FT_INT) {
            if (d < INT32_MIN || d > INT32_MAX) return MT_ERR(MT_EINVAL, "%s: %g does not fit", fp, d);
            *(int *)p = (int)d;
        } else {
            *(int64_t *)p = json_is_integer(v) ? (int64_t)json_integer_value(v) : (int64_t)d;
        }
        return MT_OK;
    }
    case MT_FT_F64: {
        if (!json_is_number(v)) return MT_ERR(MT_EINVAL, "%s: must be a number", fp);
        double d = json_number_value(v);
        if (!isfinite(d)) return MT_ERR(MT_EINVAL, "%s: must be finite", fp);
        MT_CHECK(check_range(f, d, fp));
        *(double *)p = d;
        return MT_OK;
    }
    case MT_FT_BOOL:
        if (!json_is_boolean(v)) return MT_ERR(MT_EINVAL, "%s: must be true or false", fp);
        *(int *)p = json_is_true(v);
        return MT_OK;
    case MT_FT_STR: {
        if (!json_is_string(v)) return MT_ERR(MT_EINVAL, "%s: must be a string", fp);
        size_t len = json_string_length(v);
        if (len + 1 > f->size)
            return MT_ERR(MT_EINVAL, "%s: longer than %zu characters", fp, f->size - 1);
        memcpy(p, json_string_value(v), len + 1);
        return MT_OK;
    }
    case MT_FT_ENUM: {
        char names[512];
        enum_list(f, names, sizeof names);
        if (!json_is_string(v)) return MT_ERR(MT_EINVAL, "%s: must be one of %s", fp, names);
        const char *s = json_string_value(v);
        for (int i = 0; f->enum_names[i]; i++)
            if (strcmp(s, f->enum_names[i]) == 0) {
                *(int *)p = i;
                return MT_OK;
            }
        return MT_ERR(MT_EINVAL, "%s: \"%s\" is not one of %s", fp, s, names);
    }
    }
    return MT_ERR(MT_EINVAL, "%s: unknown field type", fp);
}

/* Index of the first byte of `s` that is not part of well-formed UTF-8
 * (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF), or
 * -1 when all of it is. The same rule as the JSON library's, so a string
 * that passes here is one it accepts. */
static long utf8_bad_at(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    for (long i = 0; p[i];) {
        unsigned c = p[i];
        int n;
        unsigned min;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            n = 1, min = 0x80, c &= 0x1f;
        } else if ((c & 0xf0) == 0xe0) {
            n = 2, min = 0x800, c &= 0x0f;
        } else if ((c & 0xf8) == 0xf0) {
            n = 3, min = 0x10000, c &= 0x07;
        } else {
            return i;
        }
        for (int k = 1; k <= n; k++) {
            if ((p[i + k] & 0xc0) != 0x80) return i;
            c = (c << 6) | (p[i + k] & 0x3f);
        }
        if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return i;
        i += n + 1;
    }
    return -1;
}

/* Converts override / default text to a JSON value of the field's type.
 * Text the JSON library cannot hold (NaN, infinities, invalid UTF-8) is
 * bad input naming the field, never "out of memory". */
static int text_to_json(const mt_field *f, const char *text, const char *fp, json_t **out)
{
    char *end = NULL;
    *out = NULL;
    if (f->nullable && strcmp(text, "null") == 0) {
        *out = json_null();
        return MT_OK;
    }
    long bad = utf8_bad_at(text);
    if (bad >= 0)
        return MT_ERR(MT_EINVAL, "%s: not valid UTF-8 (byte 0x%02x at offset %ld)", fp,
                      (unsigned char)text[bad], bad);
    switch (f->type) {
    case MT_FT_INT:
    case MT_FT_I64: {
        errno = 0;
        long long v = strtoll(text, &end, 0);
        if (errno || end == text || *end) {
            double d = strtod(text, &end); /* accept 1e6 */
            if (end == text || *end || d != floor(d))
                return MT_ERR(MT_EINVAL, "%s: \"%s\" is not an integer", fp, text);
            /* 2^63: the first double past the int64 range */
            if (!isfinite(d) || fabs(d) >= 9223372036854775808.0)
                return MT_ERR(MT_EINVAL, "%s: \"%s\" is not an integer of 64 bits", fp, text);
            v = (long long)d;
        }
        *out = json_integer(v);
        break;
    }
    case MT_FT_F64: {
        double d = strtod(text, &end);
        if (end == text || *end) return MT_ERR(MT_EINVAL, "%s: \"%s\" is not a number", fp, text);
        if (!isfinite(d)) return MT_ERR(MT_EINVAL, "%s: \"%s\" is not a finite number", fp, text);
        *out = json_real(d);
        break;
    }
    case MT_FT_BOOL:
        if (strcmp(text, "true") == 0 || strcmp(text, "1") == 0)
            *out = json_true();
        else if (strcmp(text, "false") == 0 || strcmp(text, "0") == 0)
            *out = json_false();
        else
            return MT_ERR(MT_EINVAL, "%s: \"%s\" is not true or false", fp, text);
        break;
    case MT_FT_STR:
    case MT_FT_ENUM: *out = json_string(text); break;
    }
    return *out ? MT_OK : MT_ERR(MT_ENOMEM, "%s: out of memory", fp);
}

int mt_fields_defaults(const mt_field *t, int n, void *obj)
{
    for (int i = 0; i < n; i++) {
        const mt_field *f = &t[i];
        memset(field_ptr(obj, f), 0,
               f->type == MT_FT_STR ? f->size
               : f->type == MT_FT_I64 ? sizeof(int64_t)
               : f->type == MT_FT_F64 ? sizeof(double)
                                      : sizeof(int));
        if (!f->dflt) continue;
        json_t *v = NULL;
        char fp[256];
        full_path(fp, sizeof fp, "default of", f->path);
        MT_CHECK(text_to_json(f, f->dflt, fp, &v));
        int rc = store_value(f, obj, v, fp);
        json_decref(v);
        MT_CHECK(rc);
    }
    return MT_OK;
}

json_t *mt_json_get_path(json_t *root, const char *path)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    json_t *cur = root;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ".", &save); tok; tok = strtok_r(NULL, ".", &save)) {
        if (!json_is_object(cur)) return NULL;
        cur = json_object_get(cur, tok);
        if (!cur) return NULL;
    }
    return cur;
}

const mt_field *mt_fields_find(const mt_field *t, int n, const char *path)
{
    for (int i = 0; i < n; i++)
        if (strcmp(t[i].path, path) == 0) return &t[i];
    return NULL;
}

/* Is `prefix` (dotted) the parent object of some field of the table? */
static int is_object_prefix(const mt_field *t, int n, const char *prefix)
{
    size_t len = strlen(prefix);
    for (int i = 0; i < n; i++)
        if (strncmp(t[i].path, prefix, len) == 0 && t[i].path[len] == '.') return 1;
    return 0;
}

/* Walks the keys of obj (at dotted `prefix`) and reports those not in t. */
static int check_unknown(const mt_field *t, int n, json_t *obj, const char *prefix,
                         const char *ctx, int strict, void (*unknown)(const char *))
{
    const char *key;
    json_t *val;
    json_object_foreach(obj, key, val) {
        char path[256], fp[300];
        if (*prefix)
            snprintf(path, sizeof path, "%s.%s", prefix, key);
        else
            snprintf(path, sizeof path, "%s", key);
        if (key[0] == '#') continue; /* "#": annotation, see deploy/examples */
        if (mt_fields_find(t, n, path)) continue;
        if (is_object_prefix(t, n, path)) {
            if (json_is_null(val)) continue;
            full_path(fp, sizeof fp, ctx, path);
            if (!json_is_object(val)) return MT_ERR(MT_EINVAL, "%s: must be an object", fp);
            MT_CHECK(check_unknown(t, n, val, path, ctx, strict, unknown));
            continue;
        }
        full_path(fp, sizeof fp, ctx, path);
        if (strict) return MT_ERR(MT_EINVAL, "%s: unknown field", fp);
        if (unknown) unknown(fp);
    }
    return MT_OK;
}

int mt_fields_parse(const mt_field *t, int n, void *obj, json_t *root, const char *ctx,
                    int strict, void (*unknown)(const char *path))
{
    if (!json_is_object(root))
        return MT_ERR(MT_EINVAL, "%s: must be a JSON object", ctx && *ctx ? ctx : "document");
    MT_CHECK(check_unknown(t, n, root, "", ctx, strict, unknown));
    for (int i = 0; i < n; i++) {
        const mt_field *f = &t[i];
        char fp[300];
        full_path(fp, sizeof fp, ctx, f->path);
        json_t *v = mt_json_get_path(root, f->path);
        if (!v) {
            if (!f->dflt) return MT_ERR(MT_EINVAL, "%s: required field is missing", fp);
            continue; /* keeps the default already in obj */
        }
        MT_CHECK(store_value(f, obj, v, fp));
    }
    return MT_OK;
}

static json_t *value_to_json(const mt_field *f, const void *obj)
{
    const void *p = field_cptr(obj, f);
    switch (f->type) {
    case MT_FT_INT:
        if (f->nullable && *(const int *)p == 0) return json_null();
        return json_integer(*(const int *)p);
    case MT_FT_I64: return json_integer(*(const int64_t *)p);
    case MT_FT_F64: return json_real(*(const double *)p);
    case MT_FT_BOOL: return json_boolean(*(const int *)p);
    case MT_FT_STR:
        if (f->nullable && ((const char *)p)[0] == '\0') return json_null();
        return json_string((const char *)p);
    case MT_FT_ENUM: return json_string(f->enum_names[*(const int *)p]);
    }
    return json_null();
}

/* Creates (or finds) the object at dotted `path`'s parent; returns the leaf key. */
static json_t *ensure_parent(json_t *root, const char *path, const char **leaf, char *buf,
                             size_t cap)
{
    snprintf(buf, cap, "%s", path);
    json_t *cur = root;
    char *p = buf;
    for (char *dot = strchr(p, '.'); dot; dot = strchr(p, '.')) {
        *dot = '\0';
        json_t *next = json_object_get(cur, p);
        if (!next || !json_is_object(next)) {
            next = json_object();
            json_object_set_new(cur, p, next);
        }
        cur = next;
        p = dot + 1;
    }
    *leaf = p;
    return cur;
}

json_t *mt_fields_to_json(const mt_field *t, int n, const void *obj)
{
    json_t *root = json_object();
    for (int i = 0; i < n; i++) {
        const char *leaf;
        char buf[256];
        json_t *parent = ensure_parent(root, t[i].path, &leaf, buf, sizeof buf);
        json_object_set_new(parent, leaf, value_to_json(&t[i], obj));
    }
    return root;
}

int mt_json_set_text(json_t *root, const char *path, const mt_field *f, const char *text,
                     const char *ctx)
{
    char fp[300];
    full_path(fp, sizeof fp, ctx, path);
    json_t *v = NULL;
    MT_CHECK(text_to_json(f, text, fp, &v));
    const char *leaf;
    char buf[256];
    json_t *parent = ensure_parent(root, path, &leaf, buf, sizeof buf);
    json_object_set_new(parent, leaf, v);
    return MT_OK;
}

/* ---- where a JSON document is broken ------------------------------------------------ */

typedef struct path_frame {
    char type;          /* '{' or '[' */
    int index;          /* '[': the element being read */
    int want_key;       /* '{': the next string is a key */
    char key[96];       /* '{': the member being read ("" before the first key) */
} path_frame;

void mt_json_path_at(const char *text, size_t pos, char *out, size_t cap)
{
    enum { MAX_DEPTH = 32 };
    path_frame st[MAX_DEPTH];
    int depth = 0;      /* may exceed MAX_DEPTH: deeper frames are not kept */
    int in_key = 0;
    size_t i = 0;
    while (i < pos && text[i]) {
        char ch = text[i];
        path_frame *top = depth > 0 && depth <= MAX_DEPTH ? &st[depth - 1] : NULL;
        if (ch == '"') {
            size_t j = i + 1;
            while (j < pos && text[j] && text[j] != '"') j += text[j] == '\\' && text[j + 1] ? 2 : 1;
            int closed = j < pos && text[j] == '"';
            if (top && top->type == '{' && top->want_key) {
                if (!closed) {
                    in_key = 1;
                    break;
                }
                size_t n = j - i - 1 < sizeof top->key - 1 ? j - i - 1 : sizeof top->key - 1;
                memcpy(top->key, text + i + 1, n);
                top->key[n] = '\0';
                top->want_key = 0;
            } else if (!closed) {
                break; /* inside a value string */
            }
            i = j + 1;
            continue;
        }
        if (ch == '{' || ch == '[') {
            if (depth < MAX_DEPTH) {
                st[depth].type = ch;
                st[depth].index = 0;
                st[depth].want_key = ch == '{';
                st[depth].key[0] = '\0';
            }
            depth++;
        } else if ((ch == '}' || ch == ']') && depth > 0) {
            depth--;
        } else if (ch == ',' && top) {
            if (top->type == '{') top->want_key = 1;
            else top->index++;
        }
        i++;
    }
    size_t n = 0;
    out[0] = '\0';
    for (int d = 0; d < depth && d < MAX_DEPTH && n < cap; d++) {
        int w = 0;
        if (st[d].type == '[')
            w = snprintf(out + n, cap - n, "[%d]", st[d].index);
        else if (st[d].key[0] && !(d == depth - 1 && st[d].want_key))
            w = snprintf(out + n, cap - n, "%s%s", n ? "." : "", st[d].key);
        if (w > 0) n += (size_t)w < cap - n ? (size_t)w : cap - n - 1;
    }
    int at_key = in_key || (depth > 0 && depth <= MAX_DEPTH && st[depth - 1].type == '{' &&
                            st[depth - 1].want_key);
    if (at_key) {
        char obj[256];
        snprintf(obj, sizeof obj, "%s", out);
        snprintf(out, cap, "a key %s%s", obj[0] ? "in " : "at the top level", obj);
    } else if (!n) {
        snprintf(out, cap, "(top level)");
    }
}

void mt_json_error_reason(const char *text, const json_error_t *e, char *out, size_t cap)
{
    char where[256];
    size_t pos = e->position > 0 ? (size_t)e->position : 0;
    mt_json_path_at(text, pos, where, sizeof where);
    /* The usual ways a number goes wrong get their reason said plainly. */
    const char *hint = "";
    const char *near = strstr(e->text, "near '");
    if (strstr(e->text, "real number overflow")) {
        hint = " (beyond the range of a double, about 1.8e308)";
    } else if (strstr(e->text, "invalid token") && near) {
        const char *tok = near + 6;
        /* "-Infinity": the reader stops at the '-'; the word follows it */
        const char *word = !strncmp(tok, "-'", 2) && pos < strlen(text) ? text + pos : tok;
        static const char *const nonfinite[] = {"NaN", "nan", "Infinity", "infinity", "Inf",
                                                "inf"};
        for (size_t k = 0; k < sizeof nonfinite / sizeof nonfinite[0]; k++)
            if (!strncmp(word, nonfinite[k], strlen(nonfinite[k])))
                hint = " (NaN and Infinity are not JSON numbers; give a finite number)";
    }
    snprintf(out, cap, "%s: %s%s", where, e->text, hint);
}

int mt_json_load_file(const char *path, json_t **out)
{
    json_error_t e;
    *out = json_load_file(path, JSON_REJECT_DUPLICATES, &e);
    if (!*out) {
        if (e.line <= 0) return MT_ERR(MT_EIO, "%s: %s", path, e.text);
        char *text = mt_read_text_file(path);
        char reason[512];
        if (text) mt_json_error_reason(text, &e, reason, sizeof reason);
        else snprintf(reason, sizeof reason, "%s", e.text);
        free(text);
        return MT_ERR(MT_EINVAL, "%s:%d:%d: %s", path, e.line, e.column, reason);
    }
    return MT_OK;
}

void mt_fields_print_doc(const mt_field *t, int n, const char *prefix, FILE *out)
{
    for (int i = 0; i < n; i++) {
        const mt_field *f = &t[i];
        char names[512] = "";
        if (f->type == MT_FT_ENUM) enum_list(f, names, sizeof names);
        fprintf(out, "  %s%s%-34s %-8s default %-12s %s%s%s\n", prefix ? prefix : "",
                prefix && *prefix ? "." : "", f->path,
                f->type == MT_FT_ENUM ? "enum"
                : f->type == MT_FT_STR ? "string"
                : f->type == MT_FT_BOOL ? "bool"
                : f->type == MT_FT_F64 ? "number"
                                       : "integer",
                f->dflt ? f->dflt : "(required)", f->doc ? f->doc : "", *names ? " one of " : "",
                names);
    }
}
