/* moetrain_data.c - the moetrain-data tool: encode, synth, inspect. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/data/data_indexed.h"
#include "engine/data/data_tool.h"
#include "base/mt_status.h"

static const char main_usage[] =
    "usage: moetrain-data <command> [options]\n"
    "\n"
    "Builds and checks Megatron indexed datasets (PREFIX.bin + PREFIX.idx).\n"
    "\n"
    "commands:\n"
    "  encode   tokenize a .txt or .jsonl file with the byte-level tokenizer\n"
    "  synth    generate a corpus from a random sparse order-2 Markov source\n"
    "           with a known entropy rate\n"
    "  inspect  print counts, dtype, document lengths and metadata of a dataset\n"
    "\n"
    "'moetrain-data <command> --help' describes each command.\n";

static const char inspect_usage[] =
    "usage: moetrain-data inspect PREFIX [--scan]\n"
    "\n"
    "Prints the sequence, document and token counts, the dtype, document length\n"
    "statistics, the first 32 tokens of the first non-empty document, and the\n"
    "figures of PREFIX.json if present.\n"
    "\n"
    "  --scan   also read every token and report the smallest and largest id\n";

/* ---- shared helpers ---------------------------------------------------------- */

int data_fail(void)
{
    fprintf(stderr, "moetrain-data: %s\n", mt_errmsg());
    return DATA_EXIT_FAIL;
}

static int usage_error(const char *usage, const char *cmd, const char *fmt, const char *arg)
{
    fprintf(stderr, "moetrain-data %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n\n%s", usage);
    return DATA_EXIT_USAGE;
}

static data_opt *find_opt(data_opt *opts, int nopts, const char *name, size_t len)
{
    for (int k = 0; k < nopts; k++)
        if (strlen(opts[k].name) == len && strncmp(opts[k].name, name, len) == 0) return &opts[k];
    return NULL;
}

int data_parse_args(int argc, char **argv, const char *usage, data_opt *opts, int nopts,
                    const char **pos, int max_pos, int *npos)
{
    const char *cmd = argv[0];
    *npos = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(usage, stdout);
            return -1;
        }
        if (strncmp(a, "--", 2) != 0 || a[2] == '\0') {
            if (a[0] == '-' && a[1] != '\0')
                return usage_error(usage, cmd, "unknown option '%s'", a);
            if (*npos == max_pos) return usage_error(usage, cmd, "unexpected argument '%s'", a);
            pos[(*npos)++] = a;
            continue;
        }
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        data_opt *o = find_opt(opts, nopts, a, len);
        if (!o) return usage_error(usage, cmd, "unknown option '%s'", a);
        if (!o->value) {
            if (eq) return usage_error(usage, cmd, "option %s takes no value", o->name);
            *o->flag = 1;
            continue;
        }
        if (eq) {
            *o->value = eq + 1;
        } else {
            if (i + 1 >= argc) return usage_error(usage, cmd, "option %s needs a value", o->name);
            *o->value = argv[++i];
        }
    }
    return DATA_EXIT_OK;
}

int data_parse_i64(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || errno == ERANGE)
        return MT_ERR(MT_EINVAL, "%s: '%s' is not an integer", opt, s);
    if (v < lo || v > hi)
        return MT_ERR(MT_EINVAL, "%s: %lld is outside [%" PRId64 ", %" PRId64 "]", opt, v, lo, hi);
    *out = v;
    return MT_OK;
}

int data_parse_u64(const char *opt, const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || *end != '\0' || errno == ERANGE || strchr(s, '-'))
        return MT_ERR(MT_EINVAL, "%s: '%s' is not an unsigned 64-bit integer", opt, s);
    *out = v;
    return MT_OK;
}

int data_parse_f64(const char *opt, const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || errno == ERANGE || !isfinite(v))
        return MT_ERR(MT_EINVAL, "%s: '%s' is not a finite number", opt, s);
    *out = v;
    return MT_OK;
}

static int fsync_dir_of(const char *path)
{
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash) {
        strcpy(dir, ".");
    } else {
        size_t n = slash == path ? 1 : (size_t)(slash - path);
        if (n >= sizeof dir) return MT_ERR(MT_EINVAL, "%s: path too long", path);
        memcpy(dir, path, n);
        dir[n] = '\0';
    }
    int fd = open(dir, O_RDONLY);
    if (fd < 0) return MT_ERR(MT_EIO, "%s: cannot open directory: %s", dir, strerror(errno));
    int rc = fsync(fd) == 0 ? MT_OK : MT_ERR(MT_EIO, "%s: fsync: %s", dir, strerror(errno));
    close(fd);
    return rc;
}

int data_write_json(const char *path, const json_t *obj)
{
    char *text = json_dumps(obj, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
    if (!text) return MT_ERR(MT_ENOMEM, "%s: cannot serialise JSON", path);
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 5);
    if (!tmp) {
        free(text);
        return MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    }
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp", 5);
    int rc = MT_OK;
    FILE *f = fopen(tmp, "w");
    if (!f) {
        rc = MT_ERR(MT_EIO, "%s: cannot create: %s", tmp, strerror(errno));
    } else {
        size_t n = strlen(text);
        int bad = fwrite(text, 1, n, f) != n || fputc('\n', f) == EOF || fflush(f) != 0 ||
                  fsync(fileno(f)) != 0;
        int e = errno;
        if (fclose(f) != 0 && !bad) {
            bad = 1;
            e = errno;
        }
        if (bad) rc = MT_ERR(MT_EIO, "%s: write failed: %s", tmp, strerror(e));
        else if (rename(tmp, path) != 0)
            rc = MT_ERR(MT_EIO, "rename %s -> %s: %s", tmp, path, strerror(errno));
        else rc = fsync_dir_of(path);
        if (rc < 0) unlink(tmp);
    }
    free(tmp);
    free(text);
    return rc;
}

int data_write_meta(const char *prefix, const json_t *obj)
{
    size_t n = strlen(prefix);
    char *path = malloc(n + 6);
    if (!path) return MT_ERR(MT_ENOMEM, "%s.json: out of memory", prefix);
    memcpy(path, prefix, n);
    memcpy(path + n, ".json", 6);
    int rc = data_write_json(path, obj);
    free(path);
    return rc;
}

/* ---- inspect ------------------------------------------------------------------- */

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Document length statistics; the first tokens only for integer dtypes. */
static int inspect_documents(const mt_indexed *ds, int tokens_ok)
{
    int64_t nd = mt_indexed_num_documents(ds);
    if (nd == 0) {
        printf("empty documents: 0\ndocument length: -\nfirst tokens:    -\n");
        return MT_OK;
    }
    int64_t *len = malloc((size_t)nd * sizeof *len);
    if (!len) return MT_ERR(MT_ENOMEM, "inspect: out of memory for %lld documents",
                            (long long)nd);
    int64_t empty = 0, first = -1, first_t0 = 0;
    for (int64_t d = 0; d < nd; d++) {
        int64_t t0 = 0;
        int rc = mt_indexed_document_span(ds, d, &t0, &len[d]);
        if (rc < 0) {
            free(len);
            return rc;
        }
        if (len[d] == 0) empty++;
        else if (first < 0) {
            first = d;
            first_t0 = t0;
        }
    }
    int64_t first_len = first >= 0 ? len[first] : 0;
    qsort(len, (size_t)nd, sizeof *len, cmp_i64);
    printf("empty documents: %lld\n", (long long)empty);
    printf("document length: min %lld  mean %.2f  median %lld  max %lld\n", (long long)len[0],
           (double)mt_indexed_num_tokens(ds) / (double)nd, (long long)len[(nd - 1) / 2],
           (long long)len[nd - 1]);
    free(len);
    if (first < 0 || !tokens_ok) {
        printf("first tokens:    -\n");
        return MT_OK;
    }
    int32_t tok[32];
    int64_t n = first_len < 32 ? first_len : 32;
    MT_CHECK(mt_indexed_read(ds, first_t0, n, tok));
    printf("first tokens:    (document %lld, %lld tokens)", (long long)first,
           (long long)first_len);
    for (int64_t k = 0; k < n; k++) printf(" %d", (int)tok[k]);
    printf("\n");
    return MT_OK;
}

static int inspect_scan(const mt_indexed *ds)
{
    enum { CHUNK = 1 << 16 };
    int32_t *buf = malloc(CHUNK * sizeof *buf);
    if (!buf) return MT_ERR(MT_ENOMEM, "inspect: out of memory");
    int64_t total = mt_indexed_num_tokens(ds);
    int32_t lo = INT32_MAX, hi = -1;
    for (int64_t t = 0; t < total; t += CHUNK) {
        int64_t n = total - t < CHUNK ? total - t : CHUNK;
        int rc = mt_indexed_read(ds, t, n, buf);
        if (rc < 0) {
            free(buf);
            return rc;
        }
        for (int64_t k = 0; k < n; k++) {
            if (buf[k] < lo) lo = buf[k];
            if (buf[k] > hi) hi = buf[k];
        }
    }
    free(buf);
    if (total == 0) printf("token ids:       -\n");
    else printf("token ids:       min %d  max %d\n", (int)lo, (int)hi);
    return MT_OK;
}

static void inspect_metadata(const char *prefix)
{
    size_t n = strlen(prefix);
    char *path = malloc(n + 6);
    if (!path) return;
    memcpy(path, prefix, n);
    memcpy(path + n, ".json", 6);
    if (access(path, F_OK) != 0) {
        free(path);
        return;
    }
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!root || !json_is_object(root)) {
        fprintf(stderr, "moetrain-data inspect: warning: %s: %s\n", path,
                root ? "not a JSON object" : err.text);
        json_decref(root);
        free(path);
        return;
    }
    printf("metadata (%s):\n", path);
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (json_is_integer(v)) printf("  %s: %" JSON_INTEGER_FORMAT "\n", key,
                                       json_integer_value(v));
        else if (json_is_real(v)) printf("  %s: %.10g\n", key, json_real_value(v));
        else if (json_is_string(v)) printf("  %s: %s\n", key, json_string_value(v));
        else {
            char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
            printf("  %s: %s\n", key, s ? s : "?");
            free(s);
        }
    }
    json_decref(root);
    free(path);
}

static int inspect_main(int argc, char **argv)
{
    int scan = 0;
    data_opt opts[] = {{"--scan", NULL, &scan}};
    const char *pos[1];
    int npos = 0;
    int rc = data_parse_args(argc, argv, inspect_usage, opts, 1, pos, 1, &npos);
    if (rc < 0) return DATA_EXIT_OK;
    if (rc != DATA_EXIT_OK) return rc;
    if (npos != 1) return usage_error(inspect_usage, "inspect", "%s", "missing PREFIX");
    mt_indexed *ds = NULL;
    if (mt_indexed_open(pos[0], &ds) < 0) return data_fail();
    printf("prefix:          %s\n", pos[0]);
    printf("dtype:           %s\n", mt_idx_dtype_name(mt_indexed_dtype(ds)));
    printf("sequences:       %lld\n", (long long)mt_indexed_num_sequences(ds));
    printf("documents:       %lld\n", (long long)mt_indexed_num_documents(ds));
    printf("tokens:          %lld\n", (long long)mt_indexed_num_tokens(ds));
    int tokens_ok = mt_indexed_dtype(ds) != MT_IDX_FLOAT32 && mt_indexed_dtype(ds) != MT_IDX_FLOAT64;
    rc = inspect_documents(ds, tokens_ok);
    if (rc == MT_OK && scan && tokens_ok) rc = inspect_scan(ds);
    mt_indexed_close(ds);
    if (rc < 0) return data_fail();
    inspect_metadata(pos[0]);
    return DATA_EXIT_OK;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fputs(main_usage, stderr);
        return DATA_EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        fputs(main_usage, stdout);
        return DATA_EXIT_OK;
    }
    if (strcmp(cmd, "encode") == 0) return data_encode_main(argc - 1, argv + 1);
    if (strcmp(cmd, "synth") == 0) return data_synth_main(argc - 1, argv + 1);
    if (strcmp(cmd, "inspect") == 0) return inspect_main(argc - 1, argv + 1);
    fprintf(stderr, "moetrain-data: unknown command '%s'\n\n%s", cmd, main_usage);
    return DATA_EXIT_USAGE;
}
