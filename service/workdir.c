/* workdir.c - see workdir.h. Linux: O_PATH descriptors and /proc/self/fd. */
#define _GNU_SOURCE
#include "service/workdir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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

enum { WD_MAX_LINKS = 40, WD_MAX_DEPTH = 256 };

/* The walk of wd_confine: a stack of O_PATH descriptors, one per existing
 * component below root (fds[0] is root), then the names of the missing
 * ones; canon holds the canonical path of the stack. */
typedef struct walk {
    const char *root, *path, *field;
    int fds[WD_MAX_DEPTH + 1];
    int depth;             /* fds[0..depth] are open */
    int missing;           /* components past fds[depth] that do not exist */
    size_t lens[WD_MAX_DEPTH + 1]; /* strlen(canon) before each pushed component */
    int n_lens;
    char canon[PATH_MAX];
} walk;

static void walk_close(walk *w, int keep)
{
    for (int i = 0; i <= w->depth; i++)
        if (w->fds[i] >= 0 && i != keep) close(w->fds[i]);
    w->depth = -1;
}

static int push_name(walk *w, const char *name, size_t len)
{
    size_t n = strlen(w->canon);
    if (w->n_lens > WD_MAX_DEPTH) return MT_ERR(MT_EINVAL, "%s: %s: too deep", w->field, w->path);
    if (n + 1 + len + 1 > sizeof w->canon)
        return MT_ERR(MT_EINVAL, "%s: %s: path too long", w->field, w->path);
    w->lens[w->n_lens++] = n;
    if (n > 1 || w->canon[0] != '/') w->canon[n++] = '/';
    memcpy(w->canon + n, name, len);
    w->canon[n + len] = '\0';
    return MT_OK;
}

static void pop_name(walk *w)
{
    if (w->n_lens > 0) w->canon[w->lens[--w->n_lens]] = '\0';
}

/* Back to root (an absolute link target restarts from it). */
static void walk_reset(walk *w)
{
    for (int i = 1; i <= w->depth; i++) close(w->fds[i]);
    w->depth = 0;
    w->missing = 0;
    w->n_lens = 0;
    snprintf(w->canon, sizeof w->canon, "%s", w->root);
}

int wd_confine(const char *root, const char *path, const char *field, int flags, char *out,
               size_t cap, int *fdout)
{
    if (fdout) *fdout = -1;
    if (!path[0]) return MT_ERR(MT_EINVAL, "%s: must not be empty", field);
    const char *rel = path;
    if (path[0] == '/') {
        if (!inside(root, path))
            return MT_ERR(MT_EINVAL, "%s: %s is outside the workdir %s", field, path, root);
        rel = path + strlen(root);
    }
    /* The request's own ".." is refused outright; links may use it. */
    for (const char *s = rel; *s;) {
        while (*s == '/') s++;
        size_t len = strcspn(s, "/");
        if (len == 2 && s[0] == '.' && s[1] == '.')
            return MT_ERR(MT_EINVAL, "%s: \"..\" is not allowed (%s)", field, path);
        s += len;
    }
    static walk zero;
    walk *w = malloc(sizeof *w);
    char *rest = malloc(PATH_MAX), *next = malloc(PATH_MAX), *target = malloc(PATH_MAX);
    int rc = MT_OK, links = 0;
    if (!w || !rest || !next || !target) {
        rc = MT_ERR(MT_ENOMEM, "%s: out of memory", field);
        goto done;
    }
    *w = zero;
    w->root = root;
    w->path = path;
    w->field = field;
    w->depth = 0;
    w->fds[0] = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (w->fds[0] < 0) {
        rc = MT_ERR(MT_EIO, "workdir %s: %s", root, strerror(errno));
        w->depth = -1;
        goto done;
    }
    snprintf(w->canon, sizeof w->canon, "%s", root);
    if (strlen(rel) >= PATH_MAX) {
        rc = MT_ERR(MT_EINVAL, "%s: path too long", field);
        goto done;
    }
    snprintf(rest, PATH_MAX, "%s", rel);
    size_t at = 0; /* rest[at..] is still to walk */
    for (;;) {
        while (rest[at] == '/') at++;
        if (!rest[at]) break;
        const char *comp = rest + at;
        size_t len = strcspn(comp, "/");
        at += len;
        while (rest[at] == '/') at++;
        int last = !rest[at];
        if (len == 1 && comp[0] == '.') continue;
        if (len == 2 && comp[0] == '.' && comp[1] == '.') { /* from a link's target */
            if (w->missing > 0) {
                w->missing--;
            } else if (w->depth == 0) {
                rc = MT_ERR(MT_EINVAL,
                            "%s: %s leads outside the workdir through a symbolic link (\"..\" "
                            "above %s)",
                            field, path, root);
                goto done;
            } else {
                close(w->fds[w->depth--]);
            }
            pop_name(w);
            continue;
        }
        char name[NAME_MAX + 1];
        if (len > NAME_MAX) {
            rc = MT_ERR(MT_EINVAL, "%s: %s: a name longer than %d bytes", field, path, NAME_MAX);
            goto done;
        }
        memcpy(name, comp, len);
        name[len] = '\0';
        if (w->missing > 0) { /* below a missing directory: nothing to open */
            MT_GOTO(push_name(w, name, len), done);
            w->missing++;
            continue;
        }
        int fd = openat(w->fds[w->depth], name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT && (flags & WD_MKDIRS)) {
            if (mkdirat(w->fds[w->depth], name, 0755) != 0 && errno != EEXIST) {
                rc = MT_ERR(MT_EIO, "%s: cannot create %s/%s: %s", field, w->canon, name,
                            strerror(errno));
                goto done;
            }
            /* whatever is there now (even a link raced in) is looked at below */
            fd = openat(w->fds[w->depth], name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        }
        if (fd < 0 && errno == ENOENT) {
            if (!(flags & (WD_MISSING_OK | WD_MKDIRS))) {
                rc = MT_ERR(MT_ENOTFOUND, "%s: %s/%s does not exist", field, w->canon, name);
                goto done;
            }
            MT_GOTO(push_name(w, name, len), done);
            w->missing = 1;
            continue;
        }
        if (fd < 0) {
            rc = MT_ERR(MT_EIO, "%s: %s/%s: %s", field, w->canon, name, strerror(errno));
            goto done;
        }
        struct stat st;
        if (fstat(fd, &st) != 0) {
            rc = MT_ERR(MT_EIO, "%s: %s/%s: %s", field, w->canon, name, strerror(errno));
            close(fd);
            goto done;
        }
        if (S_ISLNK(st.st_mode)) {
            ssize_t n = readlinkat(fd, "", target, PATH_MAX - 1);
            close(fd);
            if (n < 0) {
                rc = MT_ERR(MT_EIO, "%s: %s/%s: %s", field, w->canon, name, strerror(errno));
                goto done;
            }
            target[n] = '\0';
            if (++links > WD_MAX_LINKS) {
                rc = MT_ERR(MT_EINVAL, "%s: %s: more than %d symbolic links", field, path,
                            WD_MAX_LINKS);
                goto done;
            }
            const char *tail = target;
            if (target[0] == '/') {
                if (!inside(root, target)) {
                    rc = MT_ERR(MT_EINVAL,
                                "%s: %s leads outside the workdir through a symbolic link (%s/%s "
                                "-> %s)",
                                field, path, w->canon, name, target);
                    goto done;
                }
                tail = target + strlen(root);
                walk_reset(w);
            }
            /* the link's target, then the rest of the path */
            if ((size_t)snprintf(next, PATH_MAX, "%s/%s", tail, rest + at) >= PATH_MAX) {
                rc = MT_ERR(MT_EINVAL, "%s: path too long", field);
                goto done;
            }
            memcpy(rest, next, PATH_MAX);
            at = 0;
            continue;
        }
        if (!S_ISDIR(st.st_mode) && (!last || !(flags & WD_FILE))) {
            close(fd);
            rc = MT_ERR(MT_EINVAL, "%s: %s/%s is not a directory", field, w->canon, name);
            goto done;
        }
        if (w->depth == WD_MAX_DEPTH) {
            close(fd);
            rc = MT_ERR(MT_EINVAL, "%s: %s: too deep", field, path);
            goto done;
        }
        rc = push_name(w, name, len);
        if (rc < 0) {
            close(fd);
            goto done;
        }
        w->fds[++w->depth] = fd;
    }
    if (strlen(w->canon) + 1 > cap) {
        rc = MT_ERR(MT_EINVAL, "%s: path too long", field);
        goto done;
    }
    snprintf(out, cap, "%s", w->canon);
done:
    if (w && w->depth >= 0) {
        int keep = rc == MT_OK && fdout && w->missing == 0 ? w->depth : -1;
        if (keep >= 0) *fdout = w->fds[keep];
        walk_close(w, keep);
    }
    free(w);
    free(rest);
    free(next);
    free(target);
    return rc;
}

int wd_resolve(const char *root, const char *path, const char *field, char *out, size_t cap)
{
    return wd_confine(root, path, field, WD_MISSING_OK | WD_FILE, out, cap, NULL);
}

void wd_fd_path(int fd, const char *shown, char *out, size_t cap)
{
    static int have_proc = -1;
    if (have_proc < 0) have_proc = access("/proc/self/fd", X_OK) == 0;
    if (have_proc && fd >= 0) snprintf(out, cap, "/proc/self/fd/%d", fd);
    else snprintf(out, cap, "%s", shown);
}

void wd_unpin(const char *p, const char *via, const char *shown, char *out, size_t cap)
{
    size_t n = strlen(via);
    if (n && !strncmp(p, via, n) && (p[n] == '\0' || p[n] == '/'))
        snprintf(out, cap, "%s%s", shown, p + n);
    else
        snprintf(out, cap, "%s", p);
}

int wd_no_links_in(int dirfd, const char *shown, const char *field)
{
    int fd = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0) close(fd);
        return MT_ERR(MT_EIO, "%s: %s: cannot list: %s", field, shown, strerror(errno));
    }
    int rc = MT_OK;
    struct dirent *e;
    while (rc == MT_OK && (e = readdir(d))) {
        struct stat st;
        if (fstatat(dirfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode))
            rc = MT_ERR(MT_EINVAL,
                        "%s: %s/%s is a symbolic link; a checkpoint holds only its own files",
                        field, shown, e->d_name);
    }
    closedir(d);
    return rc;
}
