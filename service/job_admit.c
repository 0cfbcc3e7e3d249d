/* job_admit.c - see job_admit.h. */
#define _POSIX_C_SOURCE 200809L
#include "service/job_admit.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json_util.h"
#include "base/mt_status.h"
#include "service/workdir.h"

#define MAX_SETS 256

/* The value the spec gives a string field: the last override wins, as in the
 * parser. NULL when neither sets it. */
static const char *raw_value(json_t *root, const char *const *sets, int n, const char *key)
{
    size_t kl = strlen(key);
    for (int i = n - 1; i >= 0; i--)
        if (!strncmp(sets[i], key, kl) && sets[i][kl] == '=') return sets[i] + kl + 1;
    json_t *v = mt_json_get_path(root, key);
    return v && json_is_string(v) ? json_string_value(v) : NULL;
}

static int load_root(const char *workdir, const job_request *r, json_t **root, char *dir,
                     size_t cap)
{
    if (r->json && r->json[0]) {
        json_error_t e;
        *root = json_loads(r->json, 0, &e);
        if (!*root) {
            char reason[512];
            mt_json_error_reason(r->json, &e, reason, sizeof reason);
            return MT_ERR(MT_EINVAL, "spec.json: line %d column %d: %s", e.line, e.column, reason);
        }
        snprintf(dir, cap, "%s", r->base_dir && r->base_dir[0] ? r->base_dir : workdir);
        return MT_OK;
    }
    if (!r->path || !r->path[0])
        return MT_ERR(MT_EINVAL, "spec: give the job spec as spec.json or spec.path");
    char file[MT_PATH_CAP];
    MT_CHECK(wd_resolve(workdir, r->path, "spec.path", file, sizeof file));
    int rc = mt_json_load_file(file, root);
    if (rc < 0) return mt_err_wrap(rc, "spec.path");
    if (r->base_dir && r->base_dir[0]) {
        snprintf(dir, cap, "%s", r->base_dir);
    } else {
        snprintf(dir, cap, "%s", file);
        *strrchr(dir, '/') = '\0';
    }
    return MT_OK;
}

int job_admit(const char *workdir, const job_request *r, mt_jobspec *out)
{
    if (r->n_sets < 0 || r->n_sets > MAX_SETS - 3)
        return MT_ERR(MT_EINVAL, "spec.set: more than %d overrides", MAX_SETS - 3);
    if (r->base_dir && r->base_dir[0] && r->base_dir[0] != '/')
        return MT_ERR(MT_EINVAL, "spec.base_dir: must be an absolute path");
    json_t *root = NULL;
    char base[MT_PATH_CAP];
    MT_CHECK(load_root(workdir, r, &root, base, sizeof base));

    int rc;
    const char *const *sets = r->sets;
    const int n = r->n_sets;
    char ckdir[MT_PATH_CAP];
    rc = mt_jobspec_from_json(out, root, base, sets, n);
    if (rc < 0) {
        mt_err_wrap(rc, "job spec");
        goto out;
    }
    MT_GOTO(wd_check_name(out->name, "name"), out);

    /* Where the job's checkpoints go: inside the workdir. */
    const char *raw = raw_value(root, sets, n, "checkpoint.dir");
    char dflt[MT_PATH_CAP];
    if (!raw || !raw[0]) {
        snprintf(dflt, sizeof dflt, "checkpoints/%s", out->name);
        raw = dflt;
    }
    MT_GOTO(wd_resolve(workdir, raw, "checkpoint.dir", ckdir, sizeof ckdir), out);
    snprintf(out->checkpoint.dir, sizeof out->checkpoint.dir, "%s", ckdir);

    if (r->from_checkpoint && r->from_checkpoint[0]) {
        char path[MT_PATH_CAP];
        if (strcmp(r->from_checkpoint, "latest") != 0)
            MT_GOTO(wd_check_name(r->from_checkpoint, "from_checkpoint"), out);
        if (!r->find_checkpoint) {
            rc = MT_ERR(MT_ENOTSUP, "from_checkpoint: checkpoints are not available");
            goto out;
        }
        rc = r->find_checkpoint(r->find_arg, ckdir, r->from_checkpoint, path, sizeof path);
        if (rc < 0) {
            mt_err_wrap(rc, "from_checkpoint");
            goto out;
        }
        MT_GOTO(wd_resolve(workdir, path, "from_checkpoint", path, sizeof path), out);
        out->init.kind = MT_INIT_CHECKPOINT;
        snprintf(out->init.path, sizeof out->init.path, "%s", path);
    } else if (out->init.kind == MT_INIT_CHECKPOINT) {
        /* The parser resolved a relative path against base_dir; checkpoints
         * are workdir-relative instead. */
        const char *ip = raw_value(root, sets, n, "init.path");
        char path[MT_PATH_CAP];
        MT_GOTO(wd_resolve(workdir, ip ? ip : "", "init.path", path, sizeof path), out);
        snprintf(out->init.path, sizeof out->init.path, "%s", path);
    }
    rc = mt_jobspec_validate(out, 1);
    if (rc == MT_OK) rc = mt_jobspec_admit(out, r->world > 0 ? r->world : 1);
    if (rc < 0) mt_err_wrap(rc, "job spec");
out:
    json_decref(root);
    return rc;
}
