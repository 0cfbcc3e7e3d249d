/* workdir.c - see workdir.h. */
#define _XOPEN_SOURCE 700
#include "service/workdir.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/mt_fs.h"
#include "base/mt_status.h"

int wd_open(const char *dir, char *root, size_t cap)
{
    MT_CHECK(mt_mkdir_p(dir));
    char buf[PATH_MAX];
    if (!realpath(dir, buf)) return MT_ERR(MT_EIO, "workdir %s: %s", dir, strerror(errno));
    if (strlen(buf) + 1 > cap) return MT_ERR(MT_EINVAL, "workdir %s: path too long", dir);
    snprintf(root, cap, "%s", buf);
    return MT_OK;
}

int wd_check_name(const char *name, const char *field)
{
    size_t n = strlen(name);
    if (n == 0) return MT_ERR(MT_EINVAL, "%s: must not be empty", field);
    if (n > 127) return MT_ERR(MT_EINVAL, "%s: longer than 127 characters", field);
    if (name[0] == '.')
        return MT_ERR(MT_EINVAL, "%s: \"%s\" must not start with '.'", field, name);
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                 c == '.' || c == '_' || c == '-';
        if (!ok)
            return MT_ERR(MT_EINVAL,
                          "%s: only letters, digits, '.', '_' and '-' are allowed (got byte "
                          "0x%02x at %zu)",
                          field, (unsigned char)c, i);
    }
    return MT_OK;
}

/* Is `p` root itself or below it (both canonical)? */
static int inside(const char *root, const char *p)
{
    size_t n = strlen(root);
    return strncmp(root, p, n) == 0 && (p[n] == '\0' || p[n] == '/' || !strcmp(root, "/"));
}

int wd_resolve(const char *root, const char *path, const char *field, char *out, size_t cap)
{
    if (!path[0]) return MT_ERR(MT_EINVAL, "%s: must not be empty", field);
    const char *rel = path;
    if (path[0] == '/') {
        if (!inside(root, path))
            return MT_ERR(MT_EINVAL, "%s: %s is outside the workdir %s", field, path, root);
        rel = path + strlen(root);
    }
    char buf[PATH_MAX];
    size_t n = (size_t)snprintf(buf, sizeof buf, "%s", root);
    const char *s = rel;
    while (*s) {
        while (*s == '/') s++;
        if (!*s) break;
        const char *e = strchr(s, '/');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        if (len == 2 && s[0] == '.' && s[1] == '.')
            return MT_ERR(MT_EINVAL, "%s: \"..\" is not allowed (%s)", field, path);
        if (!(len == 1 && s[0] == '.')) {
            if (n + 1 + len + 1 > sizeof buf || n + 1 + len + 1 > cap)
                return MT_ERR(MT_EINVAL, "%s: path too long", field);
            buf[n++] = '/';
            memcpy(buf + n, s, len);
            n += len;
            buf[n] = '\0';
        }
        s += len;
    }
    /* The existing prefix must stay inside after resolving symbolic links;
     * what does not exist yet cannot be a link. */
    char probe[PATH_MAX];
    snprintf(probe, sizeof probe, "%s", buf);
    struct stat st;
    while (lstat(probe, &st) != 0) {
        char *slash = strrchr(probe, '/');
        if (!slash || slash == probe) break;
        *slash = '\0';
    }
    char real[PATH_MAX];
    if (!realpath(probe, real))
        return MT_ERR(MT_EINVAL, "%s: cannot resolve %s: %s", field, path, strerror(errno));
    if (!inside(root, real))
        return MT_ERR(MT_EINVAL, "%s: %s leads outside the workdir through a symbolic link",
                      field, path);
    snprintf(out, cap, "%s", buf);
    return MT_OK;
}
