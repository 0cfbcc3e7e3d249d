/* workdir.h - names and paths from requests, confined to the daemon's
 * working directory.
 *
 * Everything a client names (checkpoint names, a job spec path, a
 * checkpoint directory) resolves inside the workdir: no "..", absolute paths
 * only below the workdir, and no symbolic link on the way that leads out of
 * it. Errors are MT_EINVAL with a message naming the request field.
 */
#ifndef MT_WORKDIR_H
#define MT_WORKDIR_H

#include <stddef.h>

/* Creates `dir` if needed and stores its canonical absolute path in root. */
int wd_open(const char *dir, char *root, size_t cap);

/* A checkpoint or job name: 1..127 of [A-Za-z0-9._-], not starting with '.'. */
int wd_check_name(const char *name, const char *field);

/* Resolves `path` (relative to root, or absolute below it) into out
 * (absolute, normalised). The part of it that exists must not leave root
 * through a symbolic link. */
int wd_resolve(const char *root, const char *path, const char *field, char *out, size_t cap);

#endif
