/* hf.h - Hugging Face DeepSeek-V3 directories: config.json plus
 * safetensors shards (model.safetensors.index.json, or *.safetensors).
 *
 * Export writes the official DeepSeek-V3 release format: FP8 E4M3 linear
 * weights with float32 weight_scale_inv per 128x128 block and
 * quantization_config {"activation_scheme": "dynamic", "fmt": "e4m3",
 * "quant_method": "fp8", "weight_block_size": [128, 128]}; BF16 norms,
 * router, embedding, head and MTP eh_proj; fp32 e_score_correction_bias;
 * each MTP module k as model.layers.{L+k-1}.* with its copies of
 * embed_tokens and shared_head.head. Linears stored as BF16 / f32 in the
 * checkpoint are quantised with the project's rule.
 *
 * Import accepts FP8 + weight_scale_inv (copied exactly) or BF16 / F16 /
 * F32 sources (quantised by the project's rule where the checkpoint keeps
 * FP8), and writes a step-0 checkpoint without optimizer state (the
 * trainer starts its moments at zero and its main params from the
 * weights).
 */
#ifndef MT_HF_H
#define MT_HF_H

#include <stdint.h>

#include "ckpt/ckpt.h"
#include "engine/model/config.h"

typedef struct mt_hf mt_hf;

/* Opens DIR: config.json (engine/model/config.h: either rotary spelling;
 * unknown keys that could change the model are errors) and the safetensors
 * files. */
int mt_hf_open(mt_hf **out, const char *dir);
void mt_hf_close(mt_hf *h);
const mt_model_config *mt_hf_config(const mt_hf *h);
/* F16 tensors read as F32 (exactly). */
mt_tensor_source mt_hf_source(mt_hf *h);
/* mt_source_read / mt_source_read_fp8 on the directory (ctx: the mt_hf). */
int mt_hf_read_fn(void *ctx, mt_tensor_desc *d);
int mt_hf_read_fp8_fn(void *ctx, mt_tensor_desc *q, float *s);

/* Exports checkpoint `ckpt` (weights only) into out_dir, shards of at most
 * max_shard_bytes (a tensor larger than that gets a shard of its own). */
int mt_hf_export(const char *ckpt, const char *out_dir, int64_t max_shard_bytes, mt_progress *prog);

/* Imports hf_dir into a step-0 checkpoint `out` (a root, or a step_N
 * directory) with the given contents (fp8 / weight dtype; optimizer state
 * is never written) and layout; flags as mt_ckpt_write_from_source (an
 * existing step_00000000 is replaced only with MT_CKPT_OVERWRITE). */
int mt_hf_import(const char *hf_dir, const char *out, const mt_shard_opts *opts,
                 const mt_layout *layout, int flags, mt_progress *prog);

#endif
