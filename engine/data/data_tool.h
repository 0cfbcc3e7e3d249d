/* data_tool.h - internals of the moetrain-data tool shared by its commands.
 *
 * Each command's main returns the process exit status: 0 success, 1 usage
 * error (message and usage on stderr), 2 failure (mt_errmsg() on stderr).
 */
#ifndef MT_DATA_TOOL_H
#define MT_DATA_TOOL_H

#include <stdint.h>

#include <jansson.h>

enum { DATA_EXIT_OK = 0, DATA_EXIT_USAGE = 1, DATA_EXIT_FAIL = 2 };

/* One "--name VALUE" option; *value stays as set by the caller (a default or
 * NULL) unless the option is given. A NULL value pointer marks a flag, and
 * *flag is set to 1 when it is given. */
typedef struct data_opt {
    const char *name;
    const char **value;
    int *flag;
} data_opt;

/* Parses argv[1..argc) (argv[0] is the command name) into opts and up to
 * max_pos positional arguments. Accepts "--name value" and "--name=value".
 * Returns DATA_EXIT_OK, DATA_EXIT_USAGE after printing the problem and
 * `usage` to stderr, or -1 after printing `usage` to stdout for --help/-h. */
int data_parse_args(int argc, char **argv, const char *usage, data_opt *opts, int nopts,
                    const char **pos, int max_pos, int *npos);

/* Integer option value in [lo, hi]; MT_EINVAL naming the option otherwise. */
int data_parse_i64(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out);
int data_parse_u64(const char *opt, const char *s, uint64_t *out);
int data_parse_f64(const char *opt, const char *s, double *out);

/* Writes obj to path durably: path.tmp, fsync, rename, directory fsync. */
int data_write_json(const char *path, const json_t *obj);
/* data_write_json to PREFIX.json. */
int data_write_meta(const char *prefix, const json_t *obj);

/* Prints "moetrain-data: <mt_errmsg()>" to stderr; returns DATA_EXIT_FAIL. */
int data_fail(void);

int data_encode_main(int argc, char **argv);
int data_synth_main(int argc, char **argv);

#endif
