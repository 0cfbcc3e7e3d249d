/* ckpt_eval.h - scoring tokens with a checkpoint (or a Hugging Face
 * directory): what `moetrain-ckpt eval` and the Evaluate RPC run.
 *
 * This file stands above both ckpt/ (the weights: ckpt/weights.h) and the
 * engine (the forward: engine/train/eval.h) and is built as its own
 * library, mt_ckpt_eval; the mt_ckpt library itself never runs the model.
 *
 * Outputs, named after `out` (FILE.npy, or FILE without .npy):
 *   FILE.npy          per-token loss [S, T] f32
 *   FILE.tokens.npy   the scored sequences [S, T + 1] int32
 *   FILE.logits.npy   with `logits`: [S, T, V] f32
 * Each appears only complete (written as .partial, then renamed).
 */
#ifndef MT_CKPT_EVAL_H
#define MT_CKPT_EVAL_H

#include <signal.h>

#include "engine/train/eval.h"
#include "engine/train/jobspec.h"

#define MT_EVAL_PATH_CAP 4200

typedef struct mt_ckpt_eval_args {
    const char *ckpt;           /* checkpoint (step dir or root) or Hugging Face directory */
    const char *tokens;         /* token file (eval.h), or NULL */
    const mt_jobspec *job;      /* its valid split when no tokens; NULL: the job saved
                                 * with the checkpoint */
    const char *out;            /* loss .npy path, or NULL: nothing written */
    int logits;                 /* also write the logits (needs out) */
    const char *backend;        /* "cpu" (NULL) or "cuda" */
    int fp32;                   /* fp32 instead of the checkpoint's recipe (CPU only) */
    int threads;                /* CPU threads; 0: all cores */
    int micro_batch;            /* sequences per forward; 0: the job's, else 1 */
} mt_ckpt_eval_args;

typedef struct mt_ckpt_eval_report {
    mt_eval_result r;
    char dir[MT_EVAL_PATH_CAP];         /* the checkpoint read */
    char input[MT_EVAL_PATH_CAP];       /* the token file, or "valid split of DATA" */
    char recipe[16], backend[8];
    char loss_path[MT_EVAL_PATH_CAP], tokens_path[MT_EVAL_PATH_CAP],
        logits_path[MT_EVAL_PATH_CAP];  /* "" where not written */
} mt_ckpt_eval_report;

int mt_ckpt_eval(const mt_ckpt_eval_args *a, mt_eval_progress_fn progress, void *ctx,
                 volatile sig_atomic_t *stop, mt_ckpt_eval_report *rep);

const char *mt_recipe_name(mt_recipe r);

#endif
