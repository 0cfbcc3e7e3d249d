/* ckpt_resume.c - which checkpoint a job continues from, and moving a
 * checkpoint out of the committed namespace (ckpt.h "resuming"). */
#define _XOPEN_SOURCE 700
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/ckpt.h"
#include "ckpt/ckpt_internal.h"
#include "base/mt_clock.h"
#include "base/mt_fs.h"
#include "base/mt_log.h"
#include "base/mt_status.h"

static int exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

int mt_ckpt_set_aside(const char *root, int64_t step, const char *tag, char *moved, size_t cap)
{
    char from[4400], to[4500];
    MT_CHECK(mt_ckpt_step_path(from, sizeof from, root, step, 0));
    /* a second set-aside of the same step (after a later re-save) gets .2, .3 ... */
    snprintf(to, sizeof to, "%s.%s", from, tag);
    for (int k = 2; exists(to); k++) {
        if (k > 1000) return MT_ERR(MT_EIO, "%s.%s.*: too many set aside", from, tag);
        snprintf(to, sizeof to, "%s.%s.%d", from, tag, k);
    }
    if (rename(from, to) != 0)
        return MT_ERR(MT_EIO, "%s: cannot move to %s: %s", from, to, strerror(errno));
    MT_CHECK(mt_fsync_path(root));
    if (moved) snprintf(moved, cap, "%s", to);
    /* `latest` must name a committed step, or nothing */
    if (ck_read_latest(root) == step) {
        int64_t *steps;
        int n;
        MT_CHECK(mt_ckpt_list(root, &steps, &n));
        int rc = MT_OK;
        if (n) {
            rc = ck_write_latest(root, steps[n - 1]);
        } else {
            char p[4400];
            snprintf(p, sizeof p, "%s/%s", root, CK_LATEST);
            if (unlink(p) != 0 && errno != ENOENT)
                rc = MT_ERR(MT_EIO, "%s: cannot remove: %s", p, strerror(errno));
            if (rc == MT_OK) rc = mt_fsync_path(root);
        }
        free(steps);
        MT_CHECK(rc);
    }
    return MT_OK;
}

int mt_ckpt_find_resumable(const char *root, int64_t below, int set_aside, char *path, size_t cap,
                           int64_t *step)
{
    *step = -1;
    if (cap) path[0] = '\0';
    int64_t *steps;
    int n;
    MT_CHECK(mt_ckpt_list(root, &steps, &n));
    int rc = MT_OK;
    for (int i = n - 1; i >= 0 && rc == MT_OK; i--) {
        if (below >= 0 && steps[i] >= below) continue;
        char dir[4400];
        rc = mt_ckpt_step_path(dir, sizeof dir, root, steps[i], 0);
        if (rc < 0) break;
        double t0 = mt_now_s();
        int v = mt_ckpt_verify(dir, NULL, NULL, NULL);
        if (v == MT_OK) {
            MT_LOGI("checkpoint %s verified in %.1f s", dir, mt_now_s() - t0);
            if ((size_t)snprintf(path, cap, "%s", dir) >= cap)
                rc = MT_ERR(MT_EINVAL, "%s: path too long", dir);
            else
                *step = steps[i];
            break;
        }
        if (v != MT_ECORRUPT) {
            rc = mt_err_wrap(v, "verifying %s", dir);
            break;
        }
        char msg[1024], moved[4600] = "";
        snprintf(msg, sizeof msg, "%s", mt_errmsg());
        if (set_aside) {
            rc = mt_ckpt_set_aside(root, steps[i], "damaged", moved, sizeof moved);
            if (rc < 0) break;
        }
        MT_LOGW("checkpoint %s does not verify (%s)%s%s; trying the one before", dir, msg,
                moved[0] ? ": moved to " : "", moved);
    }
    free(steps);
    return rc;
}
