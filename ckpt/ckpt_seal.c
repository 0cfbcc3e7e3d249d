/* ckpt_seal.c - the index's own checksum (FORMAT.md "Index seal").
 *
 * index.h5 is created with a 512-byte HDF5 user block (HDF5 and every tool
 * skip it). After the file is closed, the user block receives a text seal:
 *
 *   moetrain-ckpt index seal\n
 *   xxh64 0123456789abcdef\n
 *   bytes 123456\n
 *
 * the XXH64 (seed 0) and the length of everything after the user block.
 * Any change to the index after its commit (a flipped byte in a virtual
 * dataset mapping, a table edited through HDF5, a truncation) fails the
 * seal, whether or not HDF5's own checksums cover the bytes.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt/ckpt_internal.h"
#include "ckpt/xxh64.h"
#include "base/mt_status.h"

#define SEAL_MAGIC "moetrain-ckpt index seal\n"

static const unsigned char hdf5_sig[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};

/* XXH64 and length of fd's bytes from CK_INDEX_USERBLOCK to the end. */
static int hash_body(int fd, const char *path, uint64_t *h, int64_t *n)
{
    const size_t cap = 4u << 20;
    char *buf = malloc(cap);
    if (!buf) return MT_ERR(MT_ENOMEM, "%s: out of memory", path);
    mt_xxh64 x;
    mt_xxh64_init(&x, 0);
    off_t at = CK_INDEX_USERBLOCK;
    int rc = MT_OK;
    for (;;) {
        ssize_t got = pread(fd, buf, cap, at);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            rc = MT_ERR(MT_EIO, "%s: read failed: %s", path, strerror(errno));
            break;
        }
        if (got == 0) break;
        mt_xxh64_update(&x, buf, (size_t)got);
        at += got;
    }
    free(buf);
    *h = mt_xxh64_digest(&x);
    *n = (int64_t)at - CK_INDEX_USERBLOCK;
    return rc;
}

int ck_index_seal(const char *path)
{
    int fd = open(path, O_RDWR);
    if (fd < 0) return MT_ERR(MT_EIO, "%s: cannot open to seal: %s", path, strerror(errno));
    uint64_t h;
    int64_t n;
    int rc = hash_body(fd, path, &h, &n);
    if (rc == MT_OK) {
        char seal[CK_INDEX_USERBLOCK];
        memset(seal, 0, sizeof seal);
        snprintf(seal, sizeof seal, SEAL_MAGIC "xxh64 %016" PRIx64 "\nbytes %" PRId64 "\n", h, n);
        if (pwrite(fd, seal, sizeof seal, 0) != (ssize_t)sizeof seal)
            rc = MT_ERR(MT_EIO, "%s: cannot write the seal: %s", path, strerror(errno));
    }
    close(fd);
    return rc;
}

int ck_index_check(const char *path, char *why, size_t cap)
{
    why[0] = '\0';
    int fd = open(path, O_RDONLY);
    if (fd < 0) return MT_ERR(MT_ECORRUPT, "%s: cannot open: %s", path, strerror(errno));
    char seal[CK_INDEX_USERBLOCK + 1];
    ssize_t got = pread(fd, seal, CK_INDEX_USERBLOCK, 0);
    int rc = MT_OK;
    if (got >= 8 && !memcmp(seal, hdf5_sig, 8)) {
        rc = 1; /* no user block: an index written before seals */
        goto out;
    }
    seal[got > 0 ? got : 0] = '\0';
    uint64_t want_h = 0;
    int64_t want_n = -1;
    if (got != CK_INDEX_USERBLOCK || strncmp(seal, SEAL_MAGIC, strlen(SEAL_MAGIC)) != 0 ||
        sscanf(seal + strlen(SEAL_MAGIC), "xxh64 %" SCNx64 " bytes %" SCNd64, &want_h, &want_n) != 2) {
        snprintf(why, cap, "its checksum block (the first %d bytes) is damaged", CK_INDEX_USERBLOCK);
        rc = -1;
        goto out;
    }
    uint64_t h;
    int64_t n;
    if ((rc = hash_body(fd, path, &h, &n)) < 0) goto out;
    if (n != want_n)
        snprintf(why, cap, "%lld bytes after its checksum block, the seal records %lld: truncated "
                           "or extended after the commit",
                 (long long)n, (long long)want_n);
    else if (h != want_h)
        snprintf(why, cap, "xxh64 %016llx, its seal records %016llx: damaged after the commit",
                 (unsigned long long)h, (unsigned long long)want_h);
    rc = why[0] ? -1 : MT_OK;
out:
    close(fd);
    return rc;
}
