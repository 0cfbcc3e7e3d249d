/* eval.h - scoring token sequences with a model's weights: the per-token
 * loss and, on request, the logits, written as .npy files (base/mt_npy.h)
 * that numpy reads without any code of ours.
 *
 * Input: a token file, or the validation split of a job's data. A token
 * file is a .npy integer array [S, L] (or [L]: one sequence), or text with
 * one sequence per line of whitespace-separated ids (blank lines and lines
 * starting with '#' skipped); every sequence has the same length L >= 2.
 * The valid split is what the trainer validates on: valid_batches x
 * micro_batch_size samples of seq_len + 1 tokens, in the trainer's order.
 *
 * Output, for S sequences of L = T + 1 tokens: loss [S, T] f32 with
 * loss[s, t] = -log p(tok[s, t + 1] | tok[s, 0..t]); logits [S, T, V] f32,
 * the main head's logits at position t (the distribution of token t + 1);
 * tokens [S, L] int32, the sequences scored. The forward is the training
 * forward (engine/model/model.h mt_model_score): same recipe, same code, so
 * the losses are those training computes on the same tokens, bit for bit.
 */
#ifndef MT_EVAL_H
#define MT_EVAL_H

#include <signal.h>
#include <stdint.h>

#include "engine/model/config.h"
#include "engine/train/jobspec.h"
#include "engine/train/train_state.h"
#include "kernels/ops.h"

typedef struct mt_eval_request {
    const char *tokens_path;     /* token file; NULL: the job's valid split */
    const mt_jobspec *job;       /* data (valid split) and batch defaults; may be NULL
                                  * with tokens_path */
    const char *loss_path;       /* .npy [S, T] f32; NULL: not written */
    const char *logits_path;     /* .npy [S, T, V] f32; NULL: not written */
    const char *tokens_out_path; /* .npy [S, T + 1] int32 of the scored tokens; NULL: not written */
    int micro_batch;             /* sequences per forward; 0: the job's micro_batch_size, else 1 */
    mt_recipe recipe;            /* the weights' recipe, or fp32 (CPU) */
} mt_eval_request;

typedef struct mt_eval_result {
    double loss;                 /* mean per-token loss over every scored token */
    int64_t sequences, tokens;   /* tokens: scored targets, S x T */
    int seq_len;                 /* T */
    double seconds;
} mt_eval_result;

/* Called after loading (phase "load", done / total parameters) and after
 * each micro-batch (phase "score", done / total tokens). */
typedef void (*mt_eval_progress_fn)(void *ctx, const char *phase, int64_t done, int64_t total);

/* Scores the request's sequences with a model of `cfg` whose weights come
 * from `weights`, on `be`. Stops early with MT_EINTR when *stop becomes
 * non-zero (stop may be NULL); output files appear only when complete.
 * Errors name the file, sequence and position of bad input. */
int mt_eval_run(const mt_eval_request *req, const mt_model_config *cfg,
                const mt_tensor_reader *weights, mt_backend *be, mt_eval_progress_fn progress,
                void *ctx, volatile sig_atomic_t *stop, mt_eval_result *res);

/* The recipe a checkpoint's weights were saved in: fp8-blockwise with FP8
 * linears, fp32 with f32 weights, else bf16. */
static inline mt_recipe mt_eval_recipe_of(int fp8, int f32)
{
    return fp8 ? MT_RECIPE_FP8_BLOCKWISE : f32 ? MT_RECIPE_FP32 : MT_RECIPE_BF16;
}

#endif
