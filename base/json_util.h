/* json_util.h - table-driven parsing of JSON objects into C structs.
 *
 * A config struct is described once by a table of mt_field: the JSON path of
 * each field, its type, its place in the struct, its default (as text, parsed
 * exactly like a --set override) and its valid range. The same table fills
 * defaults, parses and validates JSON, applies --set overrides, serialises the
 * struct back to JSON and documents the fields, so each fact lives in one
 * place. Errors name the full path of the field and say why. Keys starting
 * with '#' are annotations and are skipped everywhere.
 */
#ifndef MT_JSON_UTIL_H
#define MT_JSON_UTIL_H

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>

typedef enum {
    MT_FT_INT,  /* int */
    MT_FT_I64,  /* int64_t */
    MT_FT_F64,  /* double */
    MT_FT_BOOL, /* int, 0 or 1 */
    MT_FT_STR,  /* char[size] */
    MT_FT_ENUM, /* int, index into enum_names */
} mt_field_type;

typedef struct mt_field {
    const char *path;              /* dotted path below the table's root, "train.steps" */
    mt_field_type type;
    size_t offset;                 /* offsetof() into the struct */
    size_t size;                   /* capacity of a MT_FT_STR buffer */
    const char *dflt;              /* default as text; NULL: the field is required */
    double min, max;               /* inclusive range for numbers (ignored if min > max) */
    const char *const *enum_names; /* MT_FT_ENUM: NULL-terminated spellings */
    int nullable;                  /* JSON null is accepted and stored as 0 / "" */
    const char *doc;               /* one line of documentation */
} mt_field;

#define MT_NO_RANGE 1, 0

/* Fills every field with its default; fields without a default are zeroed. */
int mt_fields_defaults(const mt_field *t, int n, void *obj);

/* Parses the fields of t found in the JSON object `root` into obj. Missing
 * required fields are errors. With `strict`, a key of root (or of a nested
 * object named by the table) that the table does not know is an error;
 * otherwise it is reported through `unknown` (may be NULL) and skipped.
 * `ctx` prefixes paths in messages ("model" gives "model.hidden_size"). */
int mt_fields_parse(const mt_field *t, int n, void *obj, json_t *root, const char *ctx,
                    int strict, void (*unknown)(const char *path));

/* Serialises every field of obj under its path into a new JSON object. */
json_t *mt_fields_to_json(const mt_field *t, int n, const void *obj);

/* Finds the table entry for `path`; NULL if none. */
const mt_field *mt_fields_find(const mt_field *t, int n, const char *path);

/* Sets `path` (dotted) in the JSON tree to `text` converted to the field's
 * type, creating intermediate objects; for --set overrides. */
int mt_json_set_text(json_t *root, const char *path, const mt_field *f, const char *text,
                     const char *ctx);

/* Looks up a dotted path in a JSON tree; NULL if absent. */
json_t *mt_json_get_path(json_t *root, const char *path);

/* Loads a JSON file; errors name the file, line and column, and the field
 * at the error (mt_json_error_reason). */
int mt_json_load_file(const char *path, json_t **out);

/* The dotted path of the field being read at byte `pos` of the JSON text
 * ("optimizer.lr", "model.rope_scaling.factor", "a.list[2]"); where a key
 * was being read, "a key in model" ("a key at the top level"); outside any
 * object "(top level)". */
void mt_json_path_at(const char *text, size_t pos, char *out, size_t cap);

/* A JSON reader error of `text` as "PATH: reason", with a plain word on
 * NaN / Infinity (not JSON) and on numbers beyond a double:
 * "optimizer.lr: invalid token near 'NaN' (NaN and Infinity are not JSON
 * numbers; give a finite number)". */
void mt_json_error_reason(const char *text, const json_error_t *e, char *out, size_t cap);

/* Prints a markdown-ish table of the fields (name, type, default, doc). */
void mt_fields_print_doc(const mt_field *t, int n, const char *prefix, FILE *out);

#endif
