/* mt_fs.c - see mt_fs.h. */
#define _POSIX_C_SOURCE 200809L
#include "base/mt_fs.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/mt_status.h"

int mt_mkdir_p(const char *dir)
{
    char buf[4096];
    size_t n = strlen(dir);
    if (n == 0) return MT_OK;
    if (n >= sizeof buf) return MT_ERR(MT_EINVAL, "%s: path too long", dir);
    memcpy(buf, dir, n + 1);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return MT_ERR(MT_EIO, "%s: cannot create directory: %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return MT_ERR(MT_EIO, "%s: cannot create directory: %s", buf, strerror(errno));
    struct stat st;
    if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode))
        return MT_ERR(MT_EIO, "%s: exists and is not a directory", buf);
    return MT_OK;
}

int mt_mkdir_parent(const char *path)
{
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    char *slash = strrchr(buf, '/');
    if (!slash || slash == buf) return MT_OK;
    *slash = '\0';
    return mt_mkdir_p(buf);
}

int mt_fsync_path(const char *path)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0) return MT_ERR(MT_EIO, "%s: cannot open for fsync: %s", path, strerror(errno));
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    if (rc != 0) return MT_ERR(MT_EIO, "%s: fsync failed: %s", path, strerror(e));
    return MT_OK;
}

int mt_fsync_parent(const char *path)
{
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    char *slash = strrchr(buf, '/');
    if (!slash) return mt_fsync_path(".");
    if (slash == buf) return mt_fsync_path("/");
    *slash = '\0';
    return mt_fsync_path(buf);
}

char *mt_read_text_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 16384, n = 0;
    char *b = malloc(cap);
    while (b) {
        n += fread(b + n, 1, cap - n - 1, f);
        if (n < cap - 1) break;
        cap *= 2;
        char *nb = realloc(b, cap);
        if (!nb) free(b);
        b = nb;
    }
    fclose(f);
    if (b) b[n] = '\0';
    return b;
}
