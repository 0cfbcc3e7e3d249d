/* weights.h - the weights of one model from a checkpoint or a Hugging Face
 * directory: its config, what the stored weights are (FP8 linears or not,
 * the dtype of the others) and read functions with the signatures of
 * engine/train/train_state.h's mt_tensor_reader. Data only: ckpt/ never
 * runs the model; a program hands these readers to the engine (scoring:
 * engine/train/eval.h).
 */
#ifndef MT_WEIGHTS_H
#define MT_WEIGHTS_H

#include "ckpt/ckpt.h"
#include "ckpt/hf.h"
#include "engine/model/config.h"

typedef struct mt_weights {
    mt_model_config cfg;
    mt_shard_opts stored;  /* fp8: linears stored as e4m3 + scales; act_dtype of the rest */
    char dir[4096];        /* the checkpoint directory (a root resolved), or the HF directory */
    int is_hf;
    char *job_json;        /* the job spec saved with a checkpoint, or NULL */
    void *ctx;             /* for read / read_fp8 */
    int (*read)(void *ctx, mt_tensor_desc *d);
    int (*read_fp8)(void *ctx, mt_tensor_desc *q, float *s);
    mt_ckpt *ck;
    mt_hf *hf;
} mt_weights;

/* Opens `path`: a checkpoint (step directory or root: its newest committed
 * step; its checksums are checked as it is read) or a Hugging Face
 * directory (config.json + safetensors). Errors name the path and say what
 * was expected. */
int mt_weights_open(mt_weights *w, const char *path);
void mt_weights_close(mt_weights *w);

#endif
