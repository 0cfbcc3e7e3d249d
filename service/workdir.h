/* workdir.h - names and paths from requests, confined to the daemon's
 * working directory.
 *
 * Everything a client names (checkpoint names, a job spec path, a
 * checkpoint directory, the source and target of a reshard) resolves
 * inside the workdir: no "..", absolute paths only below the workdir, and
 * no symbolic link on the way that leads out of it. wd_confine is the one
 * function that decides; every RPC that names a path, the daemon's --job
 * and the job's own checkpoint folder go through it. Errors are MT_EINVAL
 * with a message naming the request field.
 */
#ifndef MT_WORKDIR_H
#define MT_WORKDIR_H

#include <stddef.h>

/* Creates `dir` if needed and stores its canonical absolute path in root. */
int wd_open(const char *dir, char *root, size_t cap);

/* A checkpoint or job name: 1..127 of [A-Za-z0-9._-], not starting with '.'. */
int wd_check_name(const char *name, const char *field);

/* What wd_confine accepts at the end of the path. */
enum {
    WD_MISSING_OK = 1, /* the last components may not exist yet */
    WD_MKDIRS = 2,     /* create the missing directories (mode 0755) */
    WD_FILE = 4,       /* the last component may be something else than a directory */
};

/* Resolves `path` (relative to the workdir `root`, which is canonical, or
 * absolute below it) one component at a time from a descriptor of the
 * workdir: each component is opened relative to the one before with
 * O_PATH | O_NOFOLLOW, so nothing is followed unseen. A symbolic link is
 * followed only by resolving its target the same way: it may lead anywhere
 * inside the workdir (an absolute target must name a place below root, a
 * relative one may use ".." but never above root), at most 40 links. The
 * request path itself may not contain "..".
 *
 * out: the canonical path (links resolved). fd (may be NULL): an O_PATH
 * descriptor of the last component, which the caller closes; -1 when that
 * does not exist (WD_MISSING_OK). Holding it pins what was confined: use it
 * through wd_fd_path and a later rename, or a component replaced by a link,
 * cannot redirect the use. Without WD_MISSING_OK / WD_MKDIRS a missing
 * component is MT_ENOTFOUND; a component that is not a directory where one
 * is needed, a way out, too many links: MT_EINVAL naming `field`. */
int wd_confine(const char *root, const char *path, const char *field, int flags, char *out,
               size_t cap, int *fd);

/* wd_confine with WD_MISSING_OK | WD_FILE and no descriptor: the canonical
 * path of something a job will use (a checkpoint directory, a spec file). */
int wd_resolve(const char *root, const char *path, const char *field, char *out, size_t cap);

/* The path that names what `fd` holds ("/proc/self/fd/N"), for calls that
 * only take a path (HDF5, the checkpoint library); `shown` when /proc is
 * not mounted (then a later swap is not caught). */
void wd_fd_path(int fd, const char *shown, char *out, size_t cap);

/* `p` with the prefix `via` (a wd_fd_path) replaced by `shown`, for
 * messages and records; p unchanged when it does not start with via. */
void wd_unpin(const char *p, const char *via, const char *shown, char *out, size_t cap);

/* The directory `dirfd` (shown as `shown`) holds no symbolic link: a
 * checkpoint holds only its own files, so a link among them would let a
 * reader or a reshard read outside. MT_EINVAL naming `field` and the link. */
int wd_no_links_in(int dirfd, const char *shown, const char *field);

#endif
