/* ckpt_commit.c - the checkpoint root: step directories, the commit
 * protocol, `latest`, retention (FORMAT.md "Commit"). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ckpt/ckpt_internal.h"
#include "base/mt_fs.h"
#include "base/mt_log.h"
#include "base/mt_status.h"

int mt_ckpt_step_path(char *out, size_t cap, const char *root, int64_t step, int partial)
{
    int n = snprintf(out, cap, "%s/step_%08lld%s", root, (long long)step, partial ? ".partial" : "");
    return n >= 0 && (size_t)n < cap ? MT_OK : MT_ERR(MT_EINVAL, "%s: path too long", root);
}

/* "step_NNNNNNNN" exactly (8 or more digits, nothing after): a committed name. */
static int committed_step(const char *name, int64_t *step)
{
    if (strncmp(name, "step_", 5) != 0) return 0;
    const char *d = name + 5;
    size_t n = strspn(d, "0123456789");
    if (n < 8 || d[n] != '\0') return 0;
    *step = strtoll(d, NULL, 10);
    return 1;
}

static int is_dir(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

int mt_ckpt_list(const char *root, int64_t **steps, int *n)
{
    *steps = NULL;
    *n = 0;
    DIR *d = opendir(root);
    if (!d) {
        if (errno == ENOENT) return MT_OK;
        return MT_ERR(MT_EIO, "%s: cannot list: %s", root, strerror(errno));
    }
    int cap = 0, rc = MT_OK;
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t s;
        char p[4400];
        if (!committed_step(e->d_name, &s)) continue;
        snprintf(p, sizeof p, "%s/%s", root, e->d_name);
        if (!is_dir(p)) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            int64_t *q = realloc(*steps, (size_t)cap * sizeof *q);
            if (!q) {
                rc = MT_ERR(MT_ENOMEM, "out of memory");
                break;
            }
            *steps = q;
        }
        (*steps)[(*n)++] = s;
    }
    closedir(d);
    if (rc == MT_OK && *n) qsort(*steps, (size_t)*n, sizeof **steps, cmp_i64);
    return rc;
}

int mt_ckpt_resolve(const char *path, char *out, size_t cap)
{
    char idx[4400];
    snprintf(idx, sizeof idx, "%s/%s", path, CK_INDEX);
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/') len--;
    if (len >= 8 && !strncmp(path + len - 8, ".partial", 8))
        return MT_ERR(MT_EINVAL, "%s: a partial (uncommitted) save is not a checkpoint", path);
    if (access(idx, F_OK) == 0) {
        if ((size_t)snprintf(out, cap, "%.*s", (int)len, path) >= cap)
            return MT_ERR(MT_EINVAL, "%s: path too long", path);
        return MT_OK;
    }
    int64_t *steps;
    int n;
    MT_CHECK(mt_ckpt_list(path, &steps, &n));
    if (n == 0) {
        free(steps);
        if (!is_dir(path)) return MT_ERR(MT_ENOTFOUND, "%s: no such checkpoint directory", path);
        return MT_ERR(MT_ENOTFOUND, "%s: no committed checkpoint (no %s, no step_NNNNNNNN/)", path,
                      CK_INDEX);
    }
    /* the directory scan, not `latest`: a crash between the commit rename
     * and the pointer update leaves `latest` one behind */
    int rc = mt_ckpt_step_path(out, cap, path, steps[n - 1], 0);
    free(steps);
    return rc;
}

void ck_test_crash(const char *point)
{
    const char *want = getenv("MT_CKPT_TEST_CRASH");
    if (!want || strcmp(want, point) != 0) return;
    MT_LOGW("checkpoint: MT_CKPT_TEST_CRASH: killing the process at %s", point);
    raise(SIGKILL);
}

/* The crash point of the removal in progress (nftw has no context argument). */
static _Thread_local const char *rm_crash_point;

static int rm_entry(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    if (remove(p) != 0 && errno != ENOENT) return -1;
    if (rm_crash_point) ck_test_crash(rm_crash_point);
    return 0;
}

int ck_rm_rf(const char *path)
{
    if (nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && errno != ENOENT)
        return MT_ERR(MT_EIO, "%s: cannot remove: %s", path, strerror(errno));
    return MT_OK;
}

/* ck_rm_rf with the test hook `point` after the first entry removed. */
static int rm_rf_hooked(const char *path, const char *point)
{
    rm_crash_point = point;
    int rc = ck_rm_rf(path);
    rm_crash_point = NULL;
    return rc;
}

#define REPLACED ".replaced"

/* A committed copy set aside by the two-rename replacement (no
 * RENAME_EXCHANGE): back to its committed name if the crash left none
 * there, else removed. */
static int recover_replaced(const char *root, const char *name)
{
    char p[4400], fin[4400];
    snprintf(p, sizeof p, "%s/%s", root, name);
    snprintf(fin, sizeof fin, "%s/%.*s", root, (int)(strlen(name) - strlen(REPLACED)), name);
    if (is_dir(fin)) {
        MT_LOGI("checkpoint: removing %s, replaced by %s", p, fin);
        return ck_rm_rf(p);
    }
    MT_LOGW("checkpoint: %s was set aside by a replacement that did not finish: committing it "
            "again as %s",
            p, fin);
    if (rename(p, fin) != 0) return MT_ERR(MT_EIO, "%s: cannot rename back: %s", p, strerror(errno));
    return mt_fsync_path(root);
}

/* Removes leftovers of interrupted saves and deletions; recovers a copy
 * an interrupted replacement set aside. */
static int clean_stale(const char *root)
{
    DIR *d = opendir(root);
    if (!d) return MT_OK;
    struct dirent *e;
    int rc = MT_OK;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        int partial = n > 8 && !strcmp(e->d_name + n - 8, ".partial");
        int deleting = n > 9 && !strcmp(e->d_name + n - 9, ".deleting");
        int replaced = n > strlen(REPLACED) && !strcmp(e->d_name + n - strlen(REPLACED), REPLACED);
        if (strncmp(e->d_name, "step_", 5) != 0 || (!partial && !deleting && !replaced)) continue;
        if (replaced) {
            if (recover_replaced(root, e->d_name) < 0 && rc == MT_OK)
                rc = mt_err_wrap(MT_EIO, "cleaning %s", root);
            continue;
        }
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", root, e->d_name);
        MT_LOGI("checkpoint: removing %s left by an interrupted %s", p, partial ? "save" : "deletion");
        if (ck_rm_rf(p) < 0 && rc == MT_OK) rc = mt_err_wrap(MT_EIO, "cleaning %s", root);
    }
    closedir(d);
    return rc;
}

int mt_ckpt_begin(const char *root, int64_t step, char *partial, size_t cap)
{
    MT_CHECK(mt_mkdir_p(root));
    MT_CHECK(clean_stale(root));
    MT_CHECK(mt_ckpt_step_path(partial, cap, root, step, 1));
    if (mkdir(partial, 0755) != 0)
        return MT_ERR(MT_EIO, "%s: cannot create: %s", partial, strerror(errno));
    return MT_OK;
}

/* Writes root/latest = "step_NNNNNNNN\n" by temp file + fsync + rename. */
int ck_write_latest(const char *root, int64_t step)
{
    char tmp[4400], dst[4400], text[64];
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", root, CK_LATEST);
    snprintf(dst, sizeof dst, "%s/%s", root, CK_LATEST);
    int n = snprintf(text, sizeof text, "step_%08lld\n", (long long)step);
    /* A fresh file, never through what is there: a leftover, or a link put
     * in its place, is removed (the link itself), and O_EXCL | O_NOFOLLOW
     * refuse anything that appears meanwhile. */
    if (unlink(tmp) != 0 && errno != ENOENT)
        return MT_ERR(MT_EIO, "%s: cannot remove: %s", tmp, strerror(errno));
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644);
    if (fd < 0) return MT_ERR(MT_EIO, "%s: cannot create: %s", tmp, strerror(errno));
    int ok = write(fd, text, (size_t)n) == n && fsync(fd) == 0;
    int e = errno;
    close(fd);
    if (!ok) return MT_ERR(MT_EIO, "%s: cannot write: %s", tmp, strerror(e));
    if (rename(tmp, dst) != 0) return MT_ERR(MT_EIO, "%s: cannot rename: %s", dst, strerror(errno));
    return mt_fsync_path(root);
}

/* The step `latest` names, or -1. */
int64_t ck_read_latest(const char *root)
{
    char p[4400], buf[64] = "";
    snprintf(p, sizeof p, "%s/%s", root, CK_LATEST);
    FILE *f = fopen(p, "r");
    if (!f) return -1;
    int ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    buf[strcspn(buf, "\n")] = '\0';
    int64_t s;
    return ok && committed_step(buf, &s) ? s : -1;
}

/* renameat2(RENAME_EXCHANGE) by its system call (no glibc version needed):
 * swaps two directory entries atomically. */
static int exchange(const char *a, const char *b)
{
#ifdef SYS_renameat2
    if (!getenv("MT_CKPT_TEST_NO_EXCHANGE"))
        return (int)syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b, 2 /* RENAME_EXCHANGE */);
#endif
    errno = EINVAL;
    return -1;
}

int ck_commit_dir(const char *root, const char *work, const char *fin, int flags)
{
    MT_CHECK(mt_fsync_path(work));
    if (!is_dir(fin)) {
        if (rename(work, fin) != 0)
            return MT_ERR(MT_EIO, "%s: cannot rename to %s: %s", work, fin, strerror(errno));
        return mt_fsync_path(root);
    }
    if (!(flags & MT_CKPT_OVERWRITE))
        return MT_ERR(MT_EINVAL,
                      "%s exists: a committed checkpoint is replaced only when asked (overwrite); "
                      "the new one is left uncommitted in %s",
                      fin, work);
    /* Replacing: at every instant one committed copy of the step exists.
     * The exchange puts the new copy in place and the old one under the
     * partial name (ignored by readers, removed by the next save). */
    ck_test_crash("replace-start");
    if (exchange(work, fin) == 0) {
        ck_test_crash("replace-exchanged");
        MT_CHECK(mt_fsync_path(root));
        ck_test_crash("replace-synced");
        MT_CHECK(rm_rf_hooked(work, "replace-removing"));
        ck_test_crash("replace-removed");
        return MT_OK;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP && errno != EOPNOTSUPP)
        return MT_ERR(MT_EIO, "%s: cannot exchange with %s: %s", work, fin, strerror(errno));
    /* No atomic exchange on this file system: two renames, the old copy
     * set aside as step_N.replaced; a crash between them leaves it there
     * and the next save into the root (clean_stale) commits it again. */
    char aside[4400];
    snprintf(aside, sizeof aside, "%s%s", fin, REPLACED);
    MT_LOGW("checkpoint: %s: the file system cannot exchange directories atomically "
            "(renameat2 RENAME_EXCHANGE: %s); replacing by two renames, the old copy set aside "
            "as %s until the new one is in place",
            fin, strerror(errno), aside);
    if (rename(fin, aside) != 0)
        return MT_ERR(MT_EIO, "%s: cannot rename to %s: %s", fin, aside, strerror(errno));
    MT_CHECK(mt_fsync_path(root));
    ck_test_crash("replace-aside");
    if (rename(work, fin) != 0) {
        int e = errno;
        if (rename(aside, fin) == 0) mt_fsync_path(root);
        return MT_ERR(MT_EIO, "%s: cannot rename to %s: %s", work, fin, strerror(e));
    }
    MT_CHECK(mt_fsync_path(root));
    ck_test_crash("replace-renamed");
    return rm_rf_hooked(aside, "replace-removing");
}

int mt_ckpt_commit(const char *root, int64_t step, int keep_last)
{
    return mt_ckpt_commit_ex(root, step, keep_last, 0);
}

int mt_ckpt_commit_ex(const char *root, int64_t step, int keep_last, int flags)
{
    char part[4400], fin[4400];
    MT_CHECK(mt_ckpt_step_path(part, sizeof part, root, step, 1));
    MT_CHECK(mt_ckpt_step_path(fin, sizeof fin, root, step, 0));
    MT_CHECK(ck_commit_dir(root, part, fin, flags));
    /* `latest` names the newest committed step (a replaced older step leaves it) */
    int64_t *steps;
    int n;
    MT_CHECK(mt_ckpt_list(root, &steps, &n));
    int64_t newest = n && steps[n - 1] > step ? steps[n - 1] : step;
    free(steps);
    MT_CHECK(ck_write_latest(root, newest));
    return mt_ckpt_retain(root, keep_last);
}

int mt_ckpt_retain(const char *root, int keep_last)
{
    if (keep_last <= 0) return MT_OK;
    int64_t *steps;
    int n;
    MT_CHECK(mt_ckpt_list(root, &steps, &n));
    const int64_t latest = ck_read_latest(root);
    int rc = MT_OK;
    for (int i = 0; i + keep_last < n && rc == MT_OK; i++) {
        if (steps[i] == latest || i == n - 1) continue;
        char p[4400], del[4500];
        mt_ckpt_step_path(p, sizeof p, root, steps[i], 0);
        int fd = open(p, O_RDONLY | O_DIRECTORY);
        if (fd < 0) continue;
        /* a reader holds a shared lock while it has the checkpoint open */
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            MT_LOGI("checkpoint: keeping %s for now: it is being read", p);
            close(fd);
            continue;
        }
        snprintf(del, sizeof del, "%s.deleting", p);
        if (rename(p, del) != 0) {
            rc = MT_ERR(MT_EIO, "%s: cannot rename for deletion: %s", p, strerror(errno));
        } else {
            rc = mt_fsync_path(root);
            if (rc == MT_OK) rc = ck_rm_rf(del);
        }
        close(fd);
    }
    free(steps);
    return rc;
}
