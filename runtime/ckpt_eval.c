/* ckpt_eval.c - see ckpt_eval.h. */
#define _POSIX_C_SOURCE 200809L
#include "runtime/ckpt_eval.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "ckpt/weights.h"

const char *mt_recipe_name(mt_recipe r)
{
    return r == MT_RECIPE_FP8_BLOCKWISE ? "fp8-blockwise" : r == MT_RECIPE_BF16 ? "bf16" : "fp32";
}

/* FILE.npy -> FILE<suffix>.npy */
static int sibling(char *dst, size_t cap, const char *out, const char *suffix)
{
    size_t l = strlen(out);
    if (l > 4 && !strcmp(out + l - 4, ".npy")) l -= 4;
    int n = snprintf(dst, cap, "%.*s%s.npy", (int)l, out, suffix);
    return n < 0 || (size_t)n >= cap ? MT_ERR(MT_EINVAL, "%s: path too long", out) : MT_OK;
}

int mt_ckpt_eval(const mt_ckpt_eval_args *a, mt_eval_progress_fn progress, void *ctx,
                 volatile sig_atomic_t *stop, mt_ckpt_eval_report *rep)
{
    memset(rep, 0, sizeof *rep);
    if (a->logits && !a->out)
        return MT_ERR(MT_EINVAL, "logits: give an output file for them to go beside");
    const int cuda = a->backend && !strcmp(a->backend, "cuda");
    if (a->backend && !cuda && strcmp(a->backend, "cpu") != 0)
        return MT_ERR(MT_EINVAL, "backend \"%s\": cpu or cuda", a->backend);
    if (cuda && a->fp32)
        return MT_ERR(MT_EINVAL, "fp32 runs on the CPU backend only (CUDA activations are bf16)");

    mt_weights w;
    MT_CHECK(mt_weights_open(&w, a->ckpt));
    snprintf(rep->dir, sizeof rep->dir, "%s", w.dir);
    mt_jobspec saved;
    const mt_jobspec *job = a->job;
    int rc = MT_OK;
    if (!job && !a->tokens) {
        /* the valid split of the job the checkpoint was trained with */
        json_error_t e;
        json_t *jj = w.job_json ? json_loads(w.job_json, 0, &e) : NULL;
        if (!jj) {
            rc = MT_ERR(MT_EINVAL, "%s holds no job spec: give a token file or a job spec (its "
                        "valid split is scored)", w.dir);
            goto out;
        }
        rc = mt_jobspec_from_json(&saved, jj, NULL, NULL, 0);
        json_decref(jj);
        if (rc < 0) {
            rc = mt_err_wrap(rc, "the job spec saved in %s", w.dir);
            goto out;
        }
        job = &saved;
    }
    mt_eval_request req = {
        .tokens_path = a->tokens,
        .job = job,
        .micro_batch = a->micro_batch,
        .recipe = a->fp32 ? MT_RECIPE_FP32 : mt_eval_recipe_of(w.stored.fp8, w.stored.act_dtype == MT_DT_F32),
    };
    if (a->out) {
        if ((rc = sibling(rep->loss_path, sizeof rep->loss_path, a->out, "")) < 0) goto out;
        if ((rc = sibling(rep->tokens_path, sizeof rep->tokens_path, a->out, ".tokens")) < 0) goto out;
        if (a->logits && (rc = sibling(rep->logits_path, sizeof rep->logits_path, a->out, ".logits")) < 0)
            goto out;
        req.loss_path = rep->loss_path;
        req.tokens_out_path = rep->tokens_path;
        req.logits_path = a->logits ? rep->logits_path : NULL;
    }
    if (a->tokens) snprintf(rep->input, sizeof rep->input, "%s", a->tokens);
    else snprintf(rep->input, sizeof rep->input, "valid split of %s", job->data.path);
    snprintf(rep->recipe, sizeof rep->recipe, "%s", mt_recipe_name(req.recipe));
    snprintf(rep->backend, sizeof rep->backend, "%s", cuda ? "cuda" : "cpu");

    mt_backend *be = NULL;
    rc = cuda ? mt_backend_cuda_create(&be, 0, 0) : mt_backend_cpu_create(&be, a->threads);
    if (rc < 0) goto out;
    mt_tensor_reader r = {w.ctx, w.read, w.read_fp8, NULL, 0};
    MT_LOGI("eval: %s (%s) on %s, %s", w.dir, rep->recipe, be->name, rep->input);
    rc = mt_eval_run(&req, &w.cfg, &r, be, progress, ctx, stop, &rep->r);
    be->destroy(be);
out:
    mt_weights_close(&w);
    if (rc < 0) rep->loss_path[0] = rep->tokens_path[0] = rep->logits_path[0] = '\0';
    return rc;
}
