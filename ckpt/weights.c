/* weights.c - see weights.h. */
#define _POSIX_C_SOURCE 200809L
#include "ckpt/weights.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/mt_status.h"

static int is_file(const char *dir, const char *name)
{
    char p[4200];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static int open_hf(mt_weights *w, const char *path)
{
    MT_CHECK(mt_hf_open(&w->hf, path));
    w->is_hf = 1;
    w->cfg = *mt_hf_config(w->hf);
    snprintf(w->dir, sizeof w->dir, "%s", path);
    w->ctx = w->hf;
    w->read = mt_hf_read_fn;
    w->read_fp8 = mt_hf_read_fp8_fn;
    /* What the release stores: FP8 linears if the first layer's kv_a is e4m3
     * (every DeepSeek-V3 layer has one), otherwise the dtype of the weights. */
    mt_tensor_source s = mt_hf_source(w->hf);
    mt_dtype dt;
    int nd;
    int64_t shape[2];
    int rc = s.info(s.impl, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", &dt, &nd, shape);
    if (rc < 0) {
        mt_weights_close(w);
        return MT_ERR(MT_ENOTFOUND, "%s: no tensor model.layers.0.self_attn.kv_a_proj_with_mqa.weight "
                      "(not a DeepSeek-V3 model?)", path);
    }
    w->stored.fp8 = dt == MT_DT_E4M3;
    w->stored.act_dtype = dt == MT_DT_F32 ? MT_DT_F32 : MT_DT_BF16;
    return MT_OK;
}

int mt_weights_open(mt_weights *w, const char *path)
{
    memset(w, 0, sizeof *w);
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return MT_ERR(MT_ENOTFOUND, "%s: no such directory (want a checkpoint or a Hugging Face "
                      "directory)", path);
    if (is_file(path, "config.json") && !is_file(path, "index.h5")) return open_hf(w, path);
    int rc = mt_ckpt_open(&w->ck, path);
    if (rc < 0) return rc;
    const mt_ckpt_meta *m = mt_ckpt_get_meta(w->ck);
    snprintf(w->dir, sizeof w->dir, "%s", mt_ckpt_dir(w->ck));
    json_error_t e;
    json_t *cj = json_loads(m->config_json, 0, &e);
    if (!cj) {
        rc = MT_ERR(MT_ECORRUPT, "%s: model config: %s", w->dir, e.text);
    } else {
        rc = mt_config_from_json(&w->cfg, cj, "model", 0);
        if (rc < 0) rc = mt_err_wrap(rc, "%s", w->dir);
        json_decref(cj);
    }
    if (rc == MT_OK && m->job_json && strcmp(m->job_json, "null") != 0) {
        w->job_json = strdup(m->job_json);
        if (!w->job_json) rc = MT_ERR(MT_ENOMEM, "out of memory");
    }
    if (rc < 0) {
        mt_weights_close(w);
        return rc;
    }
    w->stored = m->opts;
    w->ctx = w->ck;
    w->read = mt_ckpt_read_fn;
    w->read_fp8 = mt_ckpt_read_fp8_fn;
    return MT_OK;
}

void mt_weights_close(mt_weights *w)
{
    if (w->ck) mt_ckpt_close(w->ck);
    if (w->hf) mt_hf_close(w->hf);
    free(w->job_json);
    w->ck = NULL;
    w->hf = NULL;
    w->job_json = NULL;
}
