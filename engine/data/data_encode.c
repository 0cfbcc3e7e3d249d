/* data_encode.c - moetrain-data encode: text or JSON lines to a byte-level
 * tokenized Megatron dataset. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/data/data_indexed.h"
#include "engine/data/data_tool.h"
#include "base/mt_status.h"

/* Byte-level tokenizer: token = byte value, EOD after the 256 bytes. */
enum { BYTE_VOCAB = 257, BYTE_EOD = 256 };

/* Inputs above this size report progress on stderr. */
#define ENCODE_PROGRESS_BYTES (64ll << 20)

static const char encode_usage[] =
    "usage: moetrain-data encode --input FILE --output PREFIX [--format txt|jsonl]\n"
    "                            [--json-key KEY]\n"
    "\n"
    "Tokenizes FILE with the byte-level tokenizer (token = byte value 0..255,\n"
    "EOD = 256 appended to every non-empty document, vocab 257, dtype uint16) and\n"
    "writes PREFIX.bin, PREFIX.idx (Megatron indexed dataset, one sequence per\n"
    "document) and PREFIX.json (tokenizer and counts).\n"
    "\n"
    "  --input FILE     .txt: documents separated by one or more blank lines\n"
    "                   (lines of only whitespace); a document's lines keep\n"
    "                   their newlines between them.\n"
    "                   .jsonl: one JSON object per line, the document is the\n"
    "                   string under KEY; an empty string is an empty document\n"
    "                   (no tokens, no EOD), as Megatron's preprocess writes it.\n"
    "  --output PREFIX  output path without .bin/.idx\n"
    "  --format F       txt or jsonl; default from the extension of FILE\n"
    "                   (.txt; .jsonl or .json)\n"
    "  --json-key KEY   the JSON key holding the text (default: text)\n";

typedef struct encoder {
    mt_indexed_writer *w;
    const char *input;
    int32_t *doc; /* [cap] tokens of the current document */
    int64_t n, cap;
    int64_t line;     /* current input line, from 1 */
    int64_t size;     /* input bytes, for progress */
    int64_t consumed; /* input bytes read so far */
    int64_t next_report;
} encoder;

static int doc_append(encoder *e, const char *p, size_t n)
{
    if (e->n + (int64_t)n > e->cap) {
        int64_t cap = e->cap ? e->cap : 4096;
        while (cap < e->n + (int64_t)n) cap *= 2;
        int32_t *q = realloc(e->doc, (size_t)cap * sizeof *q);
        if (!q) return MT_ERR(MT_ENOMEM, "%s:%lld: out of memory for a document of %lld bytes",
                              e->input, (long long)e->line, (long long)(e->n + (int64_t)n));
        e->doc = q;
        e->cap = cap;
    }
    for (size_t k = 0; k < n; k++) e->doc[e->n++] = (unsigned char)p[k];
    return MT_OK;
}

/* Ends the current document: EOD appended unless it is empty. */
static int doc_finish(encoder *e)
{
    if (e->n > 0) {
        const char room = 0;
        MT_CHECK(doc_append(e, &room, 1));
        e->doc[e->n - 1] = BYTE_EOD;
    }
    int rc = mt_indexed_writer_add_document(e->w, e->doc, e->n);
    e->n = 0;
    if (rc < 0) return mt_err_wrap(rc, "%s:%lld", e->input, (long long)e->line);
    return MT_OK;
}

static void encode_progress(encoder *e, int64_t bytes)
{
    e->consumed += bytes;
    if (e->size < ENCODE_PROGRESS_BYTES || e->consumed < e->next_report) return;
    fprintf(stderr, "encode: %3d%% (%lld of %lld MiB, %lld documents)\n",
            (int)(100 * e->consumed / e->size), (long long)(e->consumed >> 20),
            (long long)(e->size >> 20), (long long)mt_indexed_writer_num_documents(e->w));
    e->next_report += e->size / 10;
}

static int is_blank(const char *p, size_t n)
{
    for (size_t k = 0; k < n; k++)
        if (!strchr(" \t\r\f\v", p[k]) || p[k] == '\0') return 0;
    return 1;
}

static int encode_txt(encoder *e, FILE *f)
{
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int rc = MT_OK;
    while (rc == MT_OK && (len = getline(&line, &cap, f)) != -1) {
        e->line++;
        encode_progress(e, len);
        size_t n = (size_t)len;
        if (n && line[n - 1] == '\n') n--;
        if (is_blank(line, n)) {
            if (e->n > 0) rc = doc_finish(e);
            continue;
        }
        if (e->n > 0) rc = doc_append(e, "\n", 1);
        if (rc == MT_OK) rc = doc_append(e, line, n);
    }
    free(line);
    MT_CHECK(rc);
    if (ferror(f)) return MT_ERR(MT_EIO, "%s: read failed: %s", e->input, strerror(errno));
    if (e->n > 0) MT_CHECK(doc_finish(e));
    return MT_OK;
}

static int encode_json_line(encoder *e, const char *line, size_t n, const char *key)
{
    json_error_t err;
    json_t *obj = json_loadb(line, n, JSON_ALLOW_NUL, &err);
    if (!obj)
        return MT_ERR(MT_EINVAL, "%s:%lld: invalid JSON at column %d: %s", e->input,
                      (long long)e->line, err.column, err.text);
    int rc = MT_OK;
    json_t *v = json_object_get(obj, key);
    if (!json_is_object(obj))
        rc = MT_ERR(MT_EINVAL, "%s:%lld: not a JSON object", e->input, (long long)e->line);
    else if (!v)
        rc = MT_ERR(MT_EINVAL, "%s:%lld: no \"%s\" key", e->input, (long long)e->line, key);
    else if (!json_is_string(v))
        rc = MT_ERR(MT_EINVAL, "%s:%lld: \"%s\" is not a string", e->input, (long long)e->line,
                    key);
    else rc = doc_append(e, json_string_value(v), json_string_length(v));
    json_decref(obj);
    MT_CHECK(rc);
    return doc_finish(e);
}

static int encode_jsonl(encoder *e, FILE *f, const char *key)
{
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int rc = MT_OK;
    while (rc == MT_OK && (len = getline(&line, &cap, f)) != -1) {
        e->line++;
        encode_progress(e, len);
        if (is_blank(line, (size_t)len - (len && line[len - 1] == '\n'))) continue;
        rc = encode_json_line(e, line, (size_t)len, key);
    }
    free(line);
    MT_CHECK(rc);
    if (ferror(f)) return MT_ERR(MT_EIO, "%s: read failed: %s", e->input, strerror(errno));
    return MT_OK;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static int encode_metadata(const encoder *e, const char *prefix, const char *format)
{
    json_t *o = json_object();
    json_object_set_new(o, "generator", json_string("moetrain-data encode"));
    json_object_set_new(o, "tokenizer", json_string("bytes"));
    json_object_set_new(o, "vocab", json_integer(BYTE_VOCAB));
    json_object_set_new(o, "eod_token", json_integer(BYTE_EOD));
    json_object_set_new(o, "dtype", json_string(mt_idx_dtype_name(mt_idx_dtype_for_vocab(BYTE_VOCAB))));
    json_object_set_new(o, "documents", json_integer(mt_indexed_writer_num_documents(e->w)));
    json_object_set_new(o, "tokens", json_integer(mt_indexed_writer_num_tokens(e->w)));
    json_object_set_new(o, "source", json_string(e->input));
    json_object_set_new(o, "format", json_string(format));
    int rc = data_write_meta(prefix, o);
    json_decref(o);
    return rc;
}

static int encode_run(const char *input, const char *prefix, const char *format, const char *key)
{
    encoder e = {.input = input};
    FILE *f = fopen(input, "rb");
    if (!f)
        return MT_ERR(errno == ENOENT ? MT_ENOTFOUND : MT_EIO, "%s: cannot open: %s", input,
                      strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode)) e.size = st.st_size;
    e.next_report = e.size / 10;
    int rc = mt_indexed_writer_create(prefix, mt_idx_dtype_for_vocab(BYTE_VOCAB), &e.w);
    if (rc == MT_OK)
        rc = strcmp(format, "txt") == 0 ? encode_txt(&e, f) : encode_jsonl(&e, f, key);
    fclose(f);
    if (rc == MT_OK) rc = mt_indexed_writer_finish(e.w);
    if (rc == MT_OK) rc = encode_metadata(&e, prefix, format);
    if (rc == MT_OK) {
        int64_t nd = mt_indexed_writer_num_documents(e.w);
        printf("encoded %s (%s): %lld documents, %lld tokens, vocab %d, eod %d, dtype %s -> "
               "%s.bin/.idx/.json\n", input, format, (long long)nd,
               (long long)mt_indexed_writer_num_tokens(e.w), BYTE_VOCAB, BYTE_EOD,
               mt_idx_dtype_name(mt_idx_dtype_for_vocab(BYTE_VOCAB)), prefix);
        if (nd == 0) fprintf(stderr, "moetrain-data encode: warning: %s holds no documents\n",
                             input);
    }
    mt_indexed_writer_free(e.w);
    free(e.doc);
    return rc;
}

int data_encode_main(int argc, char **argv)
{
    const char *input = NULL, *output = NULL, *format = NULL, *key = "text";
    data_opt opts[] = {
        {"--input", &input, NULL},
        {"--output", &output, NULL},
        {"--format", &format, NULL},
        {"--json-key", &key, NULL},
    };
    const char *pos[1];
    int npos = 0;
    int rc = data_parse_args(argc, argv, encode_usage, opts, 4, pos, 0, &npos);
    if (rc < 0) return DATA_EXIT_OK;
    if (rc != DATA_EXIT_OK) return rc;
    if (!input || !output) {
        fprintf(stderr, "moetrain-data encode: missing %s\n\n%s", !input ? "--input" : "--output",
                encode_usage);
        return DATA_EXIT_USAGE;
    }
    if (!format) {
        if (ends_with(input, ".txt")) format = "txt";
        else if (ends_with(input, ".jsonl") || ends_with(input, ".json")) format = "jsonl";
        else {
            MT_ERR(MT_EINVAL, "%s: cannot tell the format from the name; use --format txt or "
                   "--format jsonl", input);
            return data_fail();
        }
    }
    if (strcmp(format, "txt") != 0 && strcmp(format, "jsonl") != 0) {
        MT_ERR(MT_EINVAL, "--format: '%s' is neither txt nor jsonl", format);
        return data_fail();
    }
    if (encode_run(input, output, format, key) < 0) return data_fail();
    return DATA_EXIT_OK;
}
