/* test_util.h - small helpers shared by the cmocka tests. */
#ifndef MT_TEST_UTIL_H
#define MT_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A fresh scratch directory under $MT_TEST_TMPDIR (or /tmp); returns buf. */
static inline const char *mt_test_tmpdir(char *buf, size_t cap, const char *name)
{
    const char *base = getenv("MT_TEST_TMPDIR");
    if (!base) base = "/tmp";
    snprintf(buf, cap, "%s/%s.%d", base, name, (int)getpid());
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", buf, buf);
    if (system(cmd) != 0) {
        fprintf(stderr, "cannot create %s\n", buf);
        abort();
    }
    return buf;
}

static inline void mt_test_write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s\n", path);
        abort();
    }
}

/* The directory of the built tools: $MT_BIN_DIR (ctest sets it), or build. */
static inline const char *mt_test_bin_dir(void)
{
    const char *bin = getenv("MT_BIN_DIR");
    return bin ? bin : "build";
}

/* Writes a synthetic corpus PREFIX.bin/.idx/.json with `moetrain-data synth`
 * and the given options ("--vocab 64 --tokens 100000 --seed 5"); 0 or -1. */
static inline int mt_test_synth(const char *prefix, const char *options)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s/engine/moetrain-data synth --output %s %s > /dev/null",
             mt_test_bin_dir(), prefix, options);
    return system(cmd) == 0 ? 0 : -1;
}

/* Damages a checkpoint's index.h5 where only its seal notices: flips a
 * digit of the first virtual dataset mapping's source file name
 * ("shard_RRRRR.h5" in the global heap, which HDF5 does not checksum and a
 * load does not read; verify reports the mapping). 0, or -1 if none. */
static inline int mt_test_damage_index(const char *index_h5)
{
    FILE *f = fopen(index_h5, "r+b");
    if (!f) return -1;
    static char buf[1 << 22];
    size_t n = fread(buf, 1, sizeof buf, f);
    long at = -1;
    for (size_t i = 0; i + 16 < n && at < 0; i++) {
        if (memcmp(buf + i, "GCOL", 4) != 0) continue;
        for (size_t j = i; j + 14 < n && at < 0; j++)
            if (!memcmp(buf + j, "shard_", 6)) at = (long)(j + 10); /* a digit of the rank */
    }
    int rc = at >= 0 && fseek(f, at, SEEK_SET) == 0 && fputc(buf[at] ^ 0x20, f) != EOF ? 0 : -1;
    return fclose(f) == 0 ? rc : -1;
}

/* Asserts that `haystack` contains `needle`, printing both if not. */
#define assert_contains(haystack, needle)                                          \
    do {                                                                           \
        const char *h_ = (haystack), *n_ = (needle);                               \
        if (!strstr(h_, n_)) {                                                     \
            fprintf(stderr, "expected \"%s\" in \"%s\"\n", n_, h_);                \
            fail();                                                                \
        }                                                                          \
    } while (0)

#endif
