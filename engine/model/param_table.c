/* param_table.c - names, shapes and kinds of every DeepSeek-V3 parameter. */
#include "engine/model/param_table.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

typedef struct builder {
    mt_param_table *t;
    int cap;
} builder;

static int add(builder *b, mt_param_kind kind, mt_param_role role, int layer, int expert,
               int ndim, int64_t rows, int64_t cols, const char *fmt, ...)
    __attribute__((format(printf, 9, 10)));

static int add(builder *b, mt_param_kind kind, mt_param_role role, int layer, int expert,
               int ndim, int64_t rows, int64_t cols, const char *fmt, ...)
{
    if (b->t->n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 64;
        mt_param_desc *p = realloc(b->t->p, (size_t)cap * sizeof *p);
        if (!p) return MT_ERR(MT_ENOMEM, "parameter table: out of memory");
        b->t->p = p;
        b->cap = cap;
    }
    mt_param_desc *d = &b->t->p[b->t->n++];
    memset(d, 0, sizeof *d);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->name, sizeof d->name, fmt, ap);
    va_end(ap);
    d->kind = kind;
    d->role = role;
    d->layer = layer;
    d->expert = expert;
    d->ndim = ndim;
    d->rows = rows;
    d->cols = cols;
    d->full_rows = rows;
    d->full_cols = cols;
    /* Decay the matrices that carry the model's capacity; norms, biases and
     * the router's bias are left alone (DESIGN: no decay on norms, biases). */
    d->weight_decay = kind != MT_PK_NORM && kind != MT_PK_ROUTER_BIAS;
    return MT_OK;
}

#define VEC(role, layer, n, ...) add(b, MT_PK_NORM, role, layer, -1, 1, 1, n, __VA_ARGS__)
#define LIN(role, layer, r, c, ...) add(b, MT_PK_LINEAR, role, layer, -1, 2, r, c, __VA_ARGS__)

static int add_attention(builder *b, const mt_model_config *c, int l)
{
    const int64_t D = c->hidden_size, H = c->num_attention_heads;
    const int64_t qk = mt_config_qk_head_dim(c);
    const char *pre = "model.layers";
    MT_CHECK(VEC(MT_PR_INPUT_NORM, l, D, "%s.%d.input_layernorm.weight", pre, l));
    if (c->q_lora_rank > 0) {
        MT_CHECK(LIN(MT_PR_Q_A, l, c->q_lora_rank, D, "%s.%d.self_attn.q_a_proj.weight", pre, l));
        MT_CHECK(VEC(MT_PR_Q_A_NORM, l, c->q_lora_rank, "%s.%d.self_attn.q_a_layernorm.weight",
                     pre, l));
        MT_CHECK(LIN(MT_PR_Q_B, l, H * qk, c->q_lora_rank, "%s.%d.self_attn.q_b_proj.weight",
                     pre, l));
    } else {
        MT_CHECK(LIN(MT_PR_Q, l, H * qk, D, "%s.%d.self_attn.q_proj.weight", pre, l));
    }
    MT_CHECK(LIN(MT_PR_KV_A, l, c->kv_lora_rank + c->qk_rope_head_dim, D,
                 "%s.%d.self_attn.kv_a_proj_with_mqa.weight", pre, l));
    MT_CHECK(VEC(MT_PR_KV_A_NORM, l, c->kv_lora_rank, "%s.%d.self_attn.kv_a_layernorm.weight",
                 pre, l));
    MT_CHECK(LIN(MT_PR_KV_B, l, H * (c->qk_nope_head_dim + c->v_head_dim), c->kv_lora_rank,
                 "%s.%d.self_attn.kv_b_proj.weight", pre, l));
    MT_CHECK(LIN(MT_PR_O, l, D, H * c->v_head_dim, "%s.%d.self_attn.o_proj.weight", pre, l));
    MT_CHECK(VEC(MT_PR_POST_ATTN_NORM, l, D, "%s.%d.post_attention_layernorm.weight", pre, l));
    return MT_OK;
}

static int add_ffn(builder *b, const mt_model_config *c, int l, int lo, int hi)
{
    const int64_t D = c->hidden_size;
    const char *pre = "model.layers";
    if (!mt_config_layer_is_moe(c, l)) {
        const int64_t I = c->intermediate_size;
        MT_CHECK(LIN(MT_PR_GATE, l, I, D, "%s.%d.mlp.gate_proj.weight", pre, l));
        MT_CHECK(LIN(MT_PR_UP, l, I, D, "%s.%d.mlp.up_proj.weight", pre, l));
        MT_CHECK(LIN(MT_PR_DOWN, l, D, I, "%s.%d.mlp.down_proj.weight", pre, l));
        return MT_OK;
    }
    const int64_t E = c->n_routed_experts, F = c->moe_intermediate_size;
    MT_CHECK(add(b, MT_PK_ROUTER, MT_PR_ROUTER, l, -1, 2, E, D, "%s.%d.mlp.gate.weight", pre, l));
    if (c->topk_method == MT_TOPK_NOAUX_TC)
        MT_CHECK(add(b, MT_PK_ROUTER_BIAS, MT_PR_ROUTER_BIAS, l, -1, 1, 1, E,
                     "%s.%d.mlp.gate.e_score_correction_bias", pre, l));
    /* All experts' gate_proj, then all up_proj, then all down_proj: constant
     * stride between experts for the grouped GEMMs. */
    for (int e = lo; e < hi; e++)
        MT_CHECK(add(b, MT_PK_LINEAR, MT_PR_EXP_GATE, l, e, 2, F, D,
                     "%s.%d.mlp.experts.%d.gate_proj.weight", pre, l, e));
    for (int e = lo; e < hi; e++)
        MT_CHECK(add(b, MT_PK_LINEAR, MT_PR_EXP_UP, l, e, 2, F, D,
                     "%s.%d.mlp.experts.%d.up_proj.weight", pre, l, e));
    for (int e = lo; e < hi; e++)
        MT_CHECK(add(b, MT_PK_LINEAR, MT_PR_EXP_DOWN, l, e, 2, D, F,
                     "%s.%d.mlp.experts.%d.down_proj.weight", pre, l, e));
    if (c->n_shared_experts > 0) {
        const int64_t S = F * c->n_shared_experts;
        MT_CHECK(LIN(MT_PR_SH_GATE, l, S, D, "%s.%d.mlp.shared_experts.gate_proj.weight", pre, l));
        MT_CHECK(LIN(MT_PR_SH_UP, l, S, D, "%s.%d.mlp.shared_experts.up_proj.weight", pre, l));
        MT_CHECK(LIN(MT_PR_SH_DOWN, l, D, S, "%s.%d.mlp.shared_experts.down_proj.weight", pre, l));
    }
    return MT_OK;
}

static int build(builder *b, const mt_model_config *c, int lo, int hi)
{
    const int64_t D = c->hidden_size, V = c->vocab_size;
    MT_CHECK(add(b, MT_PK_EMBED, MT_PR_EMBED, -1, -1, 2, V, D, "model.embed_tokens.weight"));
    for (int l = 0; l < c->num_hidden_layers; l++) {
        MT_CHECK(add_attention(b, c, l));
        MT_CHECK(add_ffn(b, c, l, lo, hi));
    }
    MT_CHECK(VEC(MT_PR_FINAL_NORM, -1, D, "model.norm.weight"));
    if (!c->tie_word_embeddings)
        MT_CHECK(add(b, MT_PK_HEAD, MT_PR_HEAD, -1, -1, 2, V, D, "lm_head.weight"));
    for (int k = 0; k < c->num_nextn_predict_layers; k++) {
        int l = c->num_hidden_layers + k;
        MT_CHECK(VEC(MT_PR_MTP_ENORM, l, D, "model.layers.%d.enorm.weight", l));
        MT_CHECK(VEC(MT_PR_MTP_HNORM, l, D, "model.layers.%d.hnorm.weight", l));
        MT_CHECK(add(b, MT_PK_LINEAR_BF16, MT_PR_MTP_EH, l, -1, 2, D, 2 * D,
                     "model.layers.%d.eh_proj.weight", l));
        MT_CHECK(add_attention(b, c, l));
        MT_CHECK(add_ffn(b, c, l, lo, hi));
        MT_CHECK(VEC(MT_PR_MTP_NORM, l, D, "model.layers.%d.shared_head.norm.weight", l));
    }
    return MT_OK;
}

int mt_params_build(mt_param_table *t, const mt_model_config *c, int expert_lo, int expert_hi)
{
    memset(t, 0, sizeof *t);
    if (expert_hi < 0) expert_hi = c->n_routed_experts;
    if (expert_lo < 0 || expert_lo > expert_hi || expert_hi > c->n_routed_experts)
        return MT_ERR(MT_EINVAL, "parameter table: expert range [%d, %d) outside [0, %d)",
                      expert_lo, expert_hi, c->n_routed_experts);
    builder b = {t, 0};
    int rc = build(&b, c, expert_lo, expert_hi);
    if (rc < 0) mt_params_free(t);
    return rc;
}

int mt_param_role_tp_dim(mt_param_role r)
{
    switch (r) {
    case MT_PR_EMBED: case MT_PR_HEAD:
    case MT_PR_Q: case MT_PR_Q_B: case MT_PR_KV_B:
    case MT_PR_GATE: case MT_PR_UP: case MT_PR_SH_GATE: case MT_PR_SH_UP:
    case MT_PR_EXP_GATE: case MT_PR_EXP_UP:
        return 0;
    case MT_PR_O: case MT_PR_DOWN: case MT_PR_SH_DOWN: case MT_PR_EXP_DOWN:
        return 1;
    default:
        return -1;
    }
}

void mt_params_tp_local(mt_param_table *t, int tp, int rank)
{
    for (int i = 0; i < t->n; i++) {
        mt_param_desc *d = &t->p[i];
        const int dim = mt_param_role_tp_dim(d->role);
        if (dim < 0 || d->expert >= 0 || tp <= 1) continue;
        int64_t lo, cnt;
        mt_param_part(dim == 0 ? d->full_rows : d->full_cols, tp, rank, &lo, &cnt);
        d->off[dim] = lo;
        if (dim == 0) d->rows = cnt;
        else d->cols = cnt;
    }
}

void mt_params_etp_local(mt_param_table *t, int etp, int rank)
{
    for (int i = 0; i < t->n; i++) {
        mt_param_desc *d = &t->p[i];
        const int dim = mt_param_role_tp_dim(d->role);
        if (dim < 0 || d->expert < 0 || etp <= 1) continue;
        int64_t lo, cnt;
        mt_param_part(dim == 0 ? d->full_rows : d->full_cols, etp, rank, &lo, &cnt);
        d->off[dim] = lo;
        if (dim == 0) d->rows = cnt;
        else d->cols = cnt;
    }
}

void mt_params_free(mt_param_table *t)
{
    free(t->p);
    t->p = NULL;
    t->n = 0;
}

int mt_params_find(const mt_param_table *t, const char *name)
{
    for (int i = 0; i < t->n; i++)
        if (strcmp(t->p[i].name, name) == 0) return i;
    return -1;
}

int64_t mt_params_numel(const mt_param_table *t)
{
    int64_t n = 0;
    for (int i = 0; i < t->n; i++) n += mt_param_numel(&t->p[i]);
    return n;
}

const char *mt_param_kind_name(mt_param_kind k)
{
    static const char *names[MT_PK_COUNT] = {"embed", "head", "norm", "linear", "linear_bf16",
                                             "router", "router_bias"};
    return (unsigned)k < MT_PK_COUNT ? names[k] : "?";
}

/* ---- derived names ------------------------------------------------------------ */

int mt_param_scale_name(char *out, size_t cap, const char *weight_name)
{
    size_t n = strlen(weight_name);
    const char *suffix = ".weight";
    size_t k = strlen(suffix);
    if (n < k || strcmp(weight_name + n - k, suffix) != 0)
        return MT_ERR(MT_EINVAL, "%s: not a weight name (no .weight suffix)", weight_name);
    int w = snprintf(out, cap, "%.*s.weight_scale_inv", (int)(n - k), weight_name);
    if (w < 0 || (size_t)w >= cap) return MT_ERR(MT_EINVAL, "%s: scale name too long", weight_name);
    return MT_OK;
}

int mt_param_optim_name(char *out, size_t cap, const char *state, const char *name)
{
    int w = snprintf(out, cap, "optimizer.%s.%s", state, name);
    if (w < 0 || (size_t)w >= cap)
        return MT_ERR(MT_EINVAL, "%s: optimizer state name too long", name);
    return MT_OK;
}

int mt_params_hf_aliases(const mt_model_config *c, mt_param_alias *out, int cap)
{
    int n = 0;
    for (int k = 0; k < c->num_nextn_predict_layers; k++) {
        int l = c->num_hidden_layers + k;
        if (n < cap) {
            snprintf(out[n].name, sizeof out[n].name, "model.layers.%d.embed_tokens.weight", l);
            snprintf(out[n].source, sizeof out[n].source, "model.embed_tokens.weight");
        }
        n++;
        if (n < cap) {
            snprintf(out[n].name, sizeof out[n].name, "model.layers.%d.shared_head.head.weight", l);
            snprintf(out[n].source, sizeof out[n].source, "%s",
                     c->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
        }
        n++;
    }
    return n;
}
