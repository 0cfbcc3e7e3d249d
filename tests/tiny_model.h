/* tiny_model.h - the smallest DeepSeek-V3 config with every part, shared by
 * the CPU model test (gradient checks) and the CUDA model test (CPU vs GPU). */
#ifndef MT_TEST_TINY_MODEL_H
#define MT_TEST_TINY_MODEL_H

#include "engine/model/config.h"

/* Dense layer 0, MoE layer 1 (8 experts, 4 groups, top-2 of 2 groups, one
 * shared expert), MTP depth 1. */
static inline void mt_test_tiny_config(mt_model_config *c)
{
    mt_config_defaults(c);
    c->vocab_size = 16;
    c->hidden_size = 32;
    c->intermediate_size = 48;
    c->moe_intermediate_size = 16;
    c->num_hidden_layers = 2;
    c->num_attention_heads = 2;
    c->q_lora_rank = 16;
    c->kv_lora_rank = 16;
    c->qk_nope_head_dim = 8;
    c->qk_rope_head_dim = 4;
    c->v_head_dim = 8;
    c->n_routed_experts = 8;
    c->n_shared_experts = 1;
    c->num_experts_per_tok = 2;
    c->n_group = 4;
    c->topk_group = 2;
    c->first_k_dense_replace = 1;
    c->num_nextn_predict_layers = 1;
    c->routed_scaling_factor = 1.5;
    c->max_position_embeddings = 64;
    c->initializer_range = 0.3; /* large weights: gradients well above fp32 noise */
}

#endif
