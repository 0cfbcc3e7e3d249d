/* cuda_attn_plan.cu - cuDNN graphs of causal SDPA (forward and backward),
 * their plans and the plan cache, and execution with a variant pack.
 *
 * The graphs are written with the cuDNN backend API the way cudnn-frontend
 * lowers its sdpa / sdpa_backward nodes for cuDNN 9.x (matmul, pointwise and
 * reduction operations with a generated causal mask); cuDNN's runtime
 * fusion engine compiles each into one flash-attention kernel. One plan is
 * built per (direction, B, T, H, Dqk, Dv, scale, determinism) and cached
 * (cuda_attn_impl.h, where the graph conventions are stated with the UIDs).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_attn_impl.h"
#include "base/mt_log.h"

/* ---- error reporting ------------------------------------------------------ */

/* Records "attn cudnn: <what>: <status>: <cuDNN's last error text>". */
static int dnn_fail(const char *file, int line, cudnnStatus_t st, const char *what)
{
    char last[512];
    last[0] = '\0';
    cudnnGetLastErrorString(last, sizeof last);
    for (char *c = last; *c; c++) /* one-line messages */
        if (*c == '\n') *c = ' ';
    return mt_err_at(MT_ECUDNN, file, line, "attn cudnn: %s: %s%s%s", what,
                     cudnnGetErrorString(st), last[0] ? ": " : "", last);
}

#define DNN_OK(stmt, ...)                                                                \
    do {                                                                                 \
        cudnnStatus_t st_ = (stmt);                                                      \
        if (st_ != CUDNN_STATUS_SUCCESS) {                                               \
            char w_[320];                                                                \
            snprintf(w_, sizeof w_, __VA_ARGS__);                                        \
            return dnn_fail(__FILE__, __LINE__, st_, w_);                                \
        }                                                                                \
    } while (0)

/* Sets an attribute; a failure names the descriptor (ctx) and the attribute. */
#define DNN_SET(desc, attr, type, n, ptr, ctx)                                           \
    DNN_OK(cudnnBackendSetAttribute((desc), (attr), (type), (n), (ptr)), "%s: set %s", (ctx), #attr)

/* ---- graph builder -------------------------------------------------------- */

typedef cudnnBackendDescriptor_t dnn_desc;

typedef struct dnn_graph {
    cudnnHandle_t h;
    const char *name; /* "fwd" / "bwd" */
    size_t version;
    dnn_desc keep[ATT_MAX_DESCS];
    int n_keep;
    dnn_desc ops[ATT_MAX_OPS];
    int n_ops;
    int64_t next_uid;
} dnn_graph;

static int dnn_create(dnn_graph *g, cudnnBackendDescriptorType_t type, const char *ctx,
                      dnn_desc *out)
{
    if (g->n_keep >= ATT_MAX_DESCS)
        return MT_ERR(MT_EGENERIC, "attn cudnn: %s: descriptor table full", ctx);
    DNN_OK(cudnnBackendCreateDescriptor(type, out), "%s: create descriptor", ctx);
    g->keep[g->n_keep++] = *out;
    return MT_OK;
}

static int dnn_add_op(dnn_graph *g, dnn_desc op, const char *ctx)
{
    if (g->n_ops >= ATT_MAX_OPS) return MT_ERR(MT_EGENERIC, "attn cudnn: %s: op table full", ctx);
    g->ops[g->n_ops++] = op;
    return MT_OK;
}

/* A 4-d tensor; uid < 0 gives a virtual tensor with the next virtual uid. */
static int dnn_tensor(dnn_graph *g, const char *name, int64_t uid, cudnnDataType_t dt,
                      const int64_t dim[4], const int64_t str[4], int by_value, dnn_desc *out)
{
    const bool is_virtual = uid < 0, is_by_value = by_value != 0;
    if (uid < 0) uid = g->next_uid++;
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s graph: tensor %s (uid %lld)", g->name, name, (long long)uid);
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, ctx, out));
    const int64_t align = 16;
    DNN_SET(*out, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, ctx);
    DNN_SET(*out, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim, ctx);
    DNN_SET(*out, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str, ctx);
    DNN_SET(*out, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, ctx);
    DNN_SET(*out, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, ctx);
    if (is_virtual) DNN_SET(*out, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, ctx);
    if (is_by_value)
        DNN_SET(*out, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &is_by_value, ctx);
    DNN_OK(cudnnBackendFinalize(*out), "%s: finalize", ctx);
    return MT_OK;
}

/* Pointwise y = mode(x [, b [, t]]) computed in `prec`; axis >= 0 for GEN_INDEX. */
static int dnn_pointwise(dnn_graph *g, const char *name, cudnnPointwiseMode_t mode,
                         cudnnDataType_t prec, int64_t axis, dnn_desc x, dnn_desc b, dnn_desc t,
                         dnn_desc y)
{
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s graph: pointwise %s", g->name, name);
    dnn_desc pw, op;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, ctx, &pw));
    DNN_SET(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, ctx);
    DNN_SET(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, ctx);
    if (axis >= 0) DNN_SET(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, ctx);
    DNN_OK(cudnnBackendFinalize(pw), "%s: finalize pointwise descriptor", ctx);
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, ctx, &op));
    DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, ctx);
    if (b) DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, ctx);
    if (t) DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, ctx);
    const float one = 1.0f;
    DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, ctx);
    DNN_OK(cudnnBackendFinalize(op), "%s: finalize operation", ctx);
    return dnn_add_op(g, op, ctx);
}

/* Batched c = a b over the two last dims, fp32 compute. */
static int dnn_matmul(dnn_graph *g, const char *name, dnn_desc a, dnn_desc b, dnn_desc c)
{
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s graph: matmul %s", g->name, name);
    dnn_desc mm, op;
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, ctx, &mm));
    DNN_SET(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, ctx);
    DNN_OK(cudnnBackendFinalize(mm), "%s: finalize matmul descriptor", ctx);
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, ctx, &op));
    DNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm, ctx);
    DNN_OK(cudnnBackendFinalize(op), "%s: finalize operation", ctx);
    return dnn_add_op(g, op, ctx);
}

/* y = reduce(x) over the dims where y has extent 1, fp32 compute. */
static int dnn_reduce(dnn_graph *g, const char *name, cudnnReduceTensorOp_t red, dnn_desc x,
                      dnn_desc y)
{
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s graph: reduction %s", g->name, name);
    dnn_desc rd, op;
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, ctx, &rd));
    DNN_SET(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, ctx);
    DNN_SET(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red, ctx);
    if (g->version >= 91100) { /* the attribute exists from 9.11; frontend sets it false */
        const bool det = false;
        DNN_SET(rd, CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1, &det, ctx);
    }
    DNN_OK(cudnnBackendFinalize(rd), "%s: finalize reduction descriptor", ctx);
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, ctx, &op));
    DNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, ctx);
    DNN_OK(cudnnBackendFinalize(op), "%s: finalize operation", ctx);
    return dnn_add_op(g, op, ctx);
}

/* y = x with other dims/strides (a transpose view), no data movement. */
static int dnn_reshape(dnn_graph *g, const char *name, dnn_desc x, dnn_desc y)
{
    char ctx[128];
    snprintf(ctx, sizeof ctx, "%s graph: reshape %s", g->name, name);
    dnn_desc op;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, ctx, &op));
    DNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, ctx);
    DNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, ctx);
    DNN_OK(cudnnBackendFinalize(op), "%s: finalize operation", ctx);
    return dnn_add_op(g, op, ctx);
}

/* ---- shapes ---------------------------------------------------------------- */

/* [B, H, T, D] view of a [B*T, H, D] buffer; transposed: [B, H, D, T]. */
static void att_view(int64_t dim[4], int64_t str[4], const attn_key *k, int D, int transposed)
{
    const int64_t B = k->B, H = k->H, T = k->T;
    dim[0] = B, dim[1] = H, dim[2] = T, dim[3] = D;
    str[0] = T * H * D, str[1] = D, str[2] = H * D, str[3] = 1;
    if (transposed) {
        int64_t x = dim[2];
        dim[2] = dim[3], dim[3] = x;
        x = str[2];
        str[2] = str[3], str[3] = x;
    }
}

typedef struct att_shapes {
    int64_t s_dim[4], s_str[4];   /* scores [B, H, T, T] */
    int64_t st_dim[4], st_str[4]; /* transposed scores [B, H, T(k), T(q)] */
    int64_t r_dim[4], r_str[4];   /* row statistics [B, H, T, 1] */
    int64_t one[4];               /* scalars {1, 1, 1, 1} */
} att_shapes;

static void att_shapes_of(att_shapes *s, const attn_key *k)
{
    const int64_t B = k->B, H = k->H, T = k->T;
    const int64_t sd[4] = {B, H, T, T}, ss[4] = {H * T * T, T * T, T, 1};
    const int64_t ts[4] = {H * T * T, T * T, 1, T};
    const int64_t rd[4] = {B, H, T, 1}, rs[4] = {H * T, T, 1, 1};
    for (int i = 0; i < 4; i++) {
        s->s_dim[i] = s->st_dim[i] = sd[i];
        s->s_str[i] = ss[i];
        s->st_str[i] = ts[i];
        s->r_dim[i] = rd[i];
        s->r_str[i] = rs[i];
        s->one[i] = 1;
    }
}

/* Causal mask as the frontend's top-left diagonal band (right bound 0):
 * keep[t][u] = row index >= column index, masked scores become -inf. */
static int att_graph_causal(dnn_graph *g, const att_shapes *s, dnn_desc x, dnn_desc neg_inf,
                            dnn_desc *y)
{
    dnn_desc row, col, keep;
    MT_CHECK(dnn_tensor(g, "row_index", -1, CUDNN_DATA_INT32, s->s_dim, s->s_str, 0, &row));
    MT_CHECK(dnn_tensor(g, "col_index", -1, CUDNN_DATA_INT32, s->s_dim, s->s_str, 0, &col));
    MT_CHECK(dnn_tensor(g, "causal_keep", -1, CUDNN_DATA_BOOLEAN, s->s_dim, s->s_str, 0, &keep));
    MT_CHECK(dnn_tensor(g, "s_masked", -1, CUDNN_DATA_FLOAT, s->s_dim, s->s_str, 0, y));
    MT_CHECK(dnn_pointwise(g, "gen_row_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, 2, x,
                           NULL, NULL, row));
    MT_CHECK(dnn_pointwise(g, "gen_col_index", CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, 3, x,
                           NULL, NULL, col));
    MT_CHECK(dnn_pointwise(g, "row_ge_col", CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, -1, row,
                           col, NULL, keep));
    return dnn_pointwise(g, "binary_select", CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, -1,
                         x, neg_inf, keep, *y);
}

/* Forward: S = Q K^T; S *= scale; causal mask; M = max S; E = exp(S - M);
 * Z = sum E; Stats = M + log Z (the lse output); P = E / Z (bf16); O = P V. */
static int att_graph_fwd(dnn_graph *g, const attn_key *k)
{
    att_shapes s;
    att_shapes_of(&s, k);
    int64_t qd[4], qs[4], ktd[4], kts[4], vd[4], vs[4];
    att_view(qd, qs, k, k->Dqk, 0);
    att_view(ktd, kts, k, k->Dqk, 1);
    att_view(vd, vs, k, k->Dv, 0);
    dnn_desc Q, KT, V, O, Stats, Scale, NegInf;
    MT_CHECK(dnn_tensor(g, "Q", UID_Q, CUDNN_DATA_BFLOAT16, qd, qs, 0, &Q));
    MT_CHECK(dnn_tensor(g, "K^T", UID_K, CUDNN_DATA_BFLOAT16, ktd, kts, 0, &KT));
    MT_CHECK(dnn_tensor(g, "V", UID_V, CUDNN_DATA_BFLOAT16, vd, vs, 0, &V));
    MT_CHECK(dnn_tensor(g, "O", UID_O, CUDNN_DATA_BFLOAT16, vd, vs, 0, &O));
    MT_CHECK(dnn_tensor(g, "Stats", UID_STATS, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &Stats));
    MT_CHECK(dnn_tensor(g, "attn_scale", UID_SCALE, CUDNN_DATA_FLOAT, s.one, s.one, 1, &Scale));
    MT_CHECK(dnn_tensor(g, "neg_inf", UID_NEG_INF, CUDNN_DATA_FLOAT, s.one, s.one, 1, &NegInf));

    dnn_desc S, Ss, Sm, M, Sub, E, Z, LogZ, P;
    MT_CHECK(dnn_tensor(g, "s", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &S));
    MT_CHECK(dnn_tensor(g, "s_scaled", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &Ss));
    MT_CHECK(dnn_matmul(g, "bmm1 Q K^T", Q, KT, S));
    MT_CHECK(dnn_pointwise(g, "attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, S, Scale,
                           NULL, Ss));
    MT_CHECK(att_graph_causal(g, &s, Ss, NegInf, &Sm));
    MT_CHECK(dnn_tensor(g, "max", -1, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &M));
    MT_CHECK(dnn_tensor(g, "sub_max", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &Sub));
    MT_CHECK(dnn_tensor(g, "exp", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &E));
    MT_CHECK(dnn_tensor(g, "sum_exp", -1, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &Z));
    MT_CHECK(dnn_tensor(g, "log_sum", -1, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &LogZ));
    MT_CHECK(dnn_tensor(g, "p", -1, CUDNN_DATA_BFLOAT16, s.s_dim, s.s_str, 0, &P));
    MT_CHECK(dnn_reduce(g, "max", CUDNN_REDUCE_TENSOR_MAX, Sm, M));
    MT_CHECK(dnn_pointwise(g, "sub", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, -1, Sm, M, NULL, Sub));
    MT_CHECK(dnn_pointwise(g, "exp", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, -1, Sub, NULL, NULL, E));
    MT_CHECK(dnn_reduce(g, "sum", CUDNN_REDUCE_TENSOR_ADD, E, Z));
    MT_CHECK(dnn_pointwise(g, "log", CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, -1, Z, NULL, NULL, LogZ));
    MT_CHECK(dnn_pointwise(g, "stats", CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, -1, M, LogZ, NULL,
                           Stats));
    MT_CHECK(dnn_pointwise(g, "div", CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, -1, E, Z, NULL, P));
    return dnn_matmul(g, "bmm2 P V", P, V, O);
}

/* Backward (frontend order): softmax_sum = (sum_j dO O) * 1 (stored);
 * S = Q K^T * scale - Stats, causal mask, P = exp(S); dV = P^T dO;
 * dP = dO V^T; dS = (dP - softmax_sum) P * scale; dK = dS^T Q; dQ = dS K
 * (directly in bf16 when deterministic; else into an fp32 accumulator and an
 * identity to dQ). */
static int att_graph_bwd(dnn_graph *g, const attn_key *k)
{
    att_shapes s;
    att_shapes_of(&s, k);
    int64_t qd[4], qs[4], ktd[4], kts[4], vd[4], vs[4], vtd[4], vts[4];
    att_view(qd, qs, k, k->Dqk, 0);
    att_view(ktd, kts, k, k->Dqk, 1);
    att_view(vd, vs, k, k->Dv, 0);
    att_view(vtd, vts, k, k->Dv, 1);
    dnn_desc Q, KT, VT, O, dO, Stats, dQ, dK, dV, Scale, NegInf, One, SoftSum;
    MT_CHECK(dnn_tensor(g, "Q", UID_Q, CUDNN_DATA_BFLOAT16, qd, qs, 0, &Q));
    MT_CHECK(dnn_tensor(g, "K^T", UID_K, CUDNN_DATA_BFLOAT16, ktd, kts, 0, &KT));
    MT_CHECK(dnn_tensor(g, "V^T", UID_V, CUDNN_DATA_BFLOAT16, vtd, vts, 0, &VT));
    MT_CHECK(dnn_tensor(g, "O", UID_O, CUDNN_DATA_BFLOAT16, vd, vs, 0, &O));
    MT_CHECK(dnn_tensor(g, "dO", UID_DO, CUDNN_DATA_BFLOAT16, vd, vs, 0, &dO));
    MT_CHECK(dnn_tensor(g, "Stats", UID_STATS, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &Stats));
    MT_CHECK(dnn_tensor(g, "dQ", UID_DQ, CUDNN_DATA_BFLOAT16, qd, qs, 0, &dQ));
    MT_CHECK(dnn_tensor(g, "dK", UID_DK, CUDNN_DATA_BFLOAT16, qd, qs, 0, &dK));
    MT_CHECK(dnn_tensor(g, "dV", UID_DV, CUDNN_DATA_BFLOAT16, vd, vs, 0, &dV));
    MT_CHECK(dnn_tensor(g, "attn_scale", UID_SCALE, CUDNN_DATA_FLOAT, s.one, s.one, 1, &Scale));
    MT_CHECK(dnn_tensor(g, "neg_inf", UID_NEG_INF, CUDNN_DATA_FLOAT, s.one, s.one, 1, &NegInf));
    MT_CHECK(dnn_tensor(g, "one", UID_ONE, CUDNN_DATA_FLOAT, s.one, s.one, 1, &One));
    MT_CHECK(dnn_tensor(g, "softmax_sum", UID_SOFTMAX_SUM, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0,
                        &SoftSum));

    /* softmax_sum = rowsum(dO * O) * 1 */
    dnn_desc dOO, dOOsum;
    MT_CHECK(dnn_tensor(g, "dO_O", -1, CUDNN_DATA_FLOAT, vd, vs, 0, &dOO));
    MT_CHECK(dnn_tensor(g, "dO_O_sum", -1, CUDNN_DATA_FLOAT, s.r_dim, s.r_str, 0, &dOOsum));
    MT_CHECK(dnn_pointwise(g, "mul_dO_O", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, dO, O, NULL,
                           dOO));
    MT_CHECK(dnn_reduce(g, "reduce_dO_O", CUDNN_REDUCE_TENSOR_ADD, dOO, dOOsum));
    MT_CHECK(dnn_pointwise(g, "scale_dropout_inv", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1,
                           dOOsum, One, NULL, SoftSum));

    /* P = exp(mask(scale Q K^T - Stats)) */
    dnn_desc S, Ss, Sd, Sm, P, PT;
    MT_CHECK(dnn_tensor(g, "s", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &S));
    MT_CHECK(dnn_tensor(g, "s_scaled", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &Ss));
    MT_CHECK(dnn_tensor(g, "s_sub_stats", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &Sd));
    MT_CHECK(dnn_matmul(g, "matmul_Q_KT", Q, KT, S));
    MT_CHECK(dnn_pointwise(g, "mul_s_attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, S,
                           Scale, NULL, Ss));
    MT_CHECK(dnn_pointwise(g, "sub_s_m", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, -1, Ss, Stats,
                           NULL, Sd));
    MT_CHECK(att_graph_causal(g, &s, Sd, NegInf, &Sm));
    MT_CHECK(dnn_tensor(g, "p", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &P));
    MT_CHECK(dnn_pointwise(g, "exp_s", CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, -1, Sm, NULL, NULL, P));

    /* dV = P^T dO */
    MT_CHECK(dnn_tensor(g, "p^T", -1, CUDNN_DATA_BFLOAT16, s.st_dim, s.st_str, 0, &PT));
    MT_CHECK(dnn_reshape(g, "reshape_p", P, PT));
    MT_CHECK(dnn_matmul(g, "matmul_pT_dO", PT, dO, dV));

    /* dS = (dO V^T - softmax_sum) P scale */
    dnn_desc dP, dPs, dPm, dS, dST;
    MT_CHECK(dnn_tensor(g, "dp", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &dP));
    MT_CHECK(dnn_tensor(g, "dp_sub", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &dPs));
    MT_CHECK(dnn_tensor(g, "dp_mul_p", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &dPm));
    MT_CHECK(dnn_tensor(g, "ds", -1, CUDNN_DATA_FLOAT, s.s_dim, s.s_str, 0, &dS));
    MT_CHECK(dnn_matmul(g, "matmul_dO_VT", dO, VT, dP));
    MT_CHECK(dnn_pointwise(g, "sub_dP_softmax_sum", CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, -1, dP,
                           SoftSum, NULL, dPs));
    MT_CHECK(dnn_pointwise(g, "mul_dP_exp_s", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, dPs, P,
                           NULL, dPm));
    MT_CHECK(dnn_pointwise(g, "mul_dS_attn_scale", CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, dPm,
                           Scale, NULL, dS));

    /* dK = dS^T Q */
    MT_CHECK(dnn_tensor(g, "ds^T", -1, CUDNN_DATA_BFLOAT16, s.st_dim, s.st_str, 0, &dST));
    MT_CHECK(dnn_reshape(g, "reshape_dS", dS, dST));
    MT_CHECK(dnn_matmul(g, "matmul_dST_Q", dST, Q, dK));

    /* dQ = dS K (K as a view of K^T) */
    dnn_desc Kv;
    MT_CHECK(dnn_tensor(g, "k", -1, CUDNN_DATA_BFLOAT16, qd, qs, 0, &Kv));
    MT_CHECK(dnn_reshape(g, "reshape_k", KT, Kv));
    if (k->det) return dnn_matmul(g, "matmul_dS_K", dS, Kv, dQ);
    const int64_t B = k->B, H = k->H, T = k->T, D = k->Dqk;
    const int64_t ad[4] = {B, H, T, D}, as[4] = {H * T * D, T * D, D, 1};
    dnn_desc dQacc;
    MT_CHECK(dnn_tensor(g, "dQ_accum", UID_DQ_ACCUM, CUDNN_DATA_FLOAT, ad, as, 0, &dQacc));
    MT_CHECK(dnn_matmul(g, "matmul_dS_K", dS, Kv, dQacc));
    return dnn_pointwise(g, "identity_dQ", CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, -1, dQacc,
                         NULL, NULL, dQ);
}

/* ---- plans ------------------------------------------------------------------- */

/* Scratch tensors the backward graph keeps outside the engine workspace. */
static size_t att_aux_bytes(const attn_key *k)
{
    if (!k->bwd) return 0;
    size_t rows = (size_t)k->B * k->H * k->T;
    return att_align(rows * sizeof(float)) + (k->det ? 0 : att_align(rows * k->Dqk * sizeof(float)));
}

void att_plan_release(attn_plan *p)
{
    for (int i = p->n_descs - 1; i >= 0; i--) cudnnBackendDestroyDescriptor(p->descs[i]);
    free(p->descs);
    memset(p, 0, sizeof *p);
}

/* The engine's global index of a config (for the log), -1 if unavailable. */
static int64_t att_engine_index(dnn_desc cfg)
{
    dnn_desc eng = NULL;
    int64_t n = 0, idx = -1;
    if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &eng) != CUDNN_STATUS_SUCCESS)
        return -1;
    if (cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                 &n, &eng) != CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                                 &idx) != CUDNN_STATUS_SUCCESS)
        idx = -1;
    cudnnBackendDestroyDescriptor(eng);
    return idx;
}

/* Operation graph -> heuristics (mode A) -> the first engine config whose
 * execution plan finalizes. */
static int att_graph_plan(dnn_graph *g, attn_plan *p)
{
    char ctx[64];
    snprintf(ctx, sizeof ctx, "%s graph: operation graph", g->name);
    dnn_desc opg, heur, plan;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, ctx, &opg));
    DNN_SET(opg, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &g->h, ctx);
    DNN_SET(opg, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g->n_ops, g->ops, ctx);
    DNN_OK(cudnnBackendFinalize(opg), "%s: finalize the graph of %d operations", ctx, g->n_ops);

    snprintf(ctx, sizeof ctx, "%s graph: heuristics", g->name);
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    MT_CHECK(dnn_create(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, ctx, &heur));
    DNN_SET(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &opg, ctx);
    DNN_SET(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, ctx);
    DNN_OK(cudnnBackendFinalize(heur), "%s: finalize", ctx);
    int64_t count = 0;
    DNN_OK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, NULL),
           "%s: count of CUDNN_ATTR_ENGINEHEUR_RESULTS", ctx);
    if (count <= 0)
        return MT_ERR(MT_ECUDNN, "attn cudnn: %s: heuristics returned no engine config", ctx);
    if (count > 32) count = 32;
    dnn_desc cfg[32];
    int64_t made = 0;
    for (; made < count; made++)
        if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfg[made]) !=
            CUDNN_STATUS_SUCCESS)
            break;
    int64_t got = 0;
    cudnnStatus_t st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, made, &got, cfg);
    int rc = MT_OK, chosen = -1;
    char first_err[400] = "";
    if (st != CUDNN_STATUS_SUCCESS) {
        rc = dnn_fail(__FILE__, __LINE__, st, "get CUDNN_ATTR_ENGINEHEUR_RESULTS");
        got = 0;
    } else if (got == 0) { /* the configs failed cuDNN's own support checks: keep its reasons */
        char last[360] = "";
        cudnnGetLastErrorString(last, sizeof last);
        for (char *c = last; *c; c++)
            if (*c == '\n') *c = ' ';
        snprintf(first_err, sizeof first_err, "no viable config: %s", last);
    }
    for (int64_t i = 0; i < got && chosen < 0; i++) {
        if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan) !=
            CUDNN_STATUS_SUCCESS)
            break;
        st = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &g->h);
        if (st == CUDNN_STATUS_SUCCESS)
            st = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                          CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg[i]);
        if (st == CUDNN_STATUS_SUCCESS) st = cudnnBackendFinalize(plan);
        int64_t ws = 0, nws = 0;
        if (st == CUDNN_STATUS_SUCCESS)
            st = cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                          CUDNN_TYPE_INT64, 1, &nws, &ws);
        if (st == CUDNN_STATUS_SUCCESS) {
            chosen = (int)i;
            p->plan = plan;
            p->ws_bytes = (size_t)ws;
            p->engine = att_engine_index(cfg[i]);
            break;
        }
        if (!first_err[0]) {
            char last[320] = "";
            cudnnGetLastErrorString(last, sizeof last);
            for (char *c = last; *c; c++)
                if (*c == '\n') *c = ' ';
            snprintf(first_err, sizeof first_err, "config %lld: %s: %s", (long long)i,
                     cudnnGetErrorString(st), last);
        }
        cudnnBackendDestroyDescriptor(plan);
    }
    for (int64_t i = 0; i < made; i++) /* keep the chosen config alive with the plan */
        if (i == chosen) {
            if (g->n_keep < ATT_MAX_DESCS) g->keep[g->n_keep++] = cfg[i];
            else cudnnBackendDestroyDescriptor(cfg[i]);
        } else {
            cudnnBackendDestroyDescriptor(cfg[i]);
        }
    if (chosen < 0) {
        if (rc < 0) return rc;
        return MT_ERR(MT_ECUDNN, "attn cudnn: %s graph: none of %lld engine configs (%lld from "
                      "heuristics mode A) finalizes; first failure: %s", g->name, (long long)got,
                      (long long)count, first_err);
    }
    if (g->n_keep < ATT_MAX_DESCS) g->keep[g->n_keep++] = plan;
    return MT_OK;
}

/* Shapes the graphs (as built here) cannot take; NULL if fine. */
static const char *att_dnn_unsupported(const attn_key *k, size_t version, char *buf, size_t n)
{
    if (k->Dqk % 8 || k->Dv % 8 || k->Dqk > 256 || k->Dv > 256)
        snprintf(buf, n, "head dims Dqk=%d Dv=%d: cuDNN needs multiples of 8 up to 256", k->Dqk, k->Dv);
    else if (k->bwd && k->T < 2)
        snprintf(buf, n, "T=%d: the cuDNN backward needs T >= 2", k->T);
    else if (k->bwd && version <= 91500 && k->T % 128)
        snprintf(buf, n, "T=%d is not a multiple of 128: the cuDNN %zu backward then needs a "
                         "padding-mask workaround this graph does not build", k->T, version);
    else
        return NULL;
    return buf;
}

/* Builds the plan of p->key into p (state 1), or records why not (state -1). */
static void att_plan_build(cuda_attn_cache *c, attn_plan *p)
{
    char buf[300];
    const char *bad = att_dnn_unsupported(&p->key, c->version, buf, sizeof buf);
    if (bad) {
        snprintf(p->why, sizeof p->why, "%s", bad);
        p->state = -1;
        return;
    }
    dnn_graph *g = (dnn_graph *)calloc(1, sizeof *g);
    if (!g) {
        snprintf(p->why, sizeof p->why, "out of host memory for the graph builder");
        p->state = -1;
        return;
    }
    g->h = c->handle;
    g->name = p->key.bwd ? "bwd" : "fwd";
    g->version = c->version;
    g->next_uid = UID_VIRTUAL;
    int rc = p->key.bwd ? att_graph_bwd(g, &p->key) : att_graph_fwd(g, &p->key);
    if (rc == MT_OK) rc = att_graph_plan(g, p);
    if (rc == MT_OK) {
        p->descs = (dnn_desc *)malloc(sizeof(dnn_desc) * (size_t)g->n_keep);
        if (!p->descs) rc = MT_ERR(MT_ENOMEM, "attn cudnn: out of host memory");
    }
    if (rc != MT_OK) {
        snprintf(p->why, sizeof p->why, "%s", mt_errmsg());
        for (int i = g->n_keep - 1; i >= 0; i--) cudnnBackendDestroyDescriptor(g->keep[i]);
        p->plan = NULL;
        p->state = -1;
        free(g);
        return;
    }
    memcpy(p->descs, g->keep, sizeof(dnn_desc) * (size_t)g->n_keep);
    p->n_descs = g->n_keep;
    p->aux_bytes = att_aux_bytes(&p->key);
    p->state = 1;
    MT_LOGI("attn: cuDNN %s plan B=%d T=%d H=%d Dqk=%d Dv=%d%s: engine %lld, %d operations, "
            "workspace %zu + aux %zu bytes",
            g->name, p->key.B, p->key.T, p->key.H, p->key.Dqk, p->key.Dv,
            p->key.bwd ? (p->key.det ? " deterministic" : " dQ-atomic") : "", (long long)p->engine,
            g->n_ops, p->ws_bytes, p->aux_bytes);
    free(g);
}

static int att_handle(mt_backend *be, cudnnHandle_t *h)
{
    cuda_attn_cache *c = att_cache(be);
    if (!c->handle) {
        if (cuda_of(be)->dnn) {
            c->handle = cuda_of(be)->dnn;
        } else {
            MT_CUDNN_CHECK(cudnnCreate(&c->handle));
            c->own_handle = 1;
        }
    }
    *h = c->handle;
    return MT_OK;
}

attn_plan *att_plan_get(mt_backend *be, const attn_key *k)
{
    cuda_attn_cache *c = att_cache(be);
    for (int i = 0; i < ATT_CACHE; i++)
        if (c->plans[i].state != 0 && !memcmp(&c->plans[i].key, k, sizeof *k)) return &c->plans[i];
    attn_plan *p = NULL;
    for (int i = 0; i < ATT_CACHE && !p; i++)
        if (c->plans[i].state == 0) p = &c->plans[i];
    if (!p) {
        p = &c->plans[c->evict];
        c->evict = (c->evict + 1) % ATT_CACHE;
        att_plan_release(p);
    }
    p->key = *k;
    p->engine = -1;
    cudnnHandle_t h;
    if (att_handle(be, &h) != MT_OK) {
        snprintf(p->why, sizeof p->why, "%s", mt_errmsg());
        p->state = -1;
        return p;
    }
    att_plan_build(c, p);
    return p;
}

int att_plan_run(mt_backend *be, attn_plan *p, const int64_t *uids, void **ptrs, int n, void *ws)
{
    const char *dir = p->key.bwd ? "bwd" : "fwd";
    dnn_desc vp = NULL;
    int rc = MT_OK;
    cudnnStatus_t st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
    const char *what = "create the variant pack";
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "set CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS";
        st = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    }
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "set CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS";
        st = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
    }
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "set CUDNN_ATTR_VARIANT_PACK_WORKSPACE";
        st = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    }
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "finalize the variant pack";
        st = cudnnBackendFinalize(vp);
    }
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "cudnnSetStream";
        st = cudnnSetStream(att_cache(be)->handle, cuda_stream(be));
    }
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "cudnnBackendExecute";
        st = cudnnBackendExecute(att_cache(be)->handle, p->plan, vp);
    }
    if (st != CUDNN_STATUS_SUCCESS) {
        char w[160];
        snprintf(w, sizeof w, "%s graph B=%d T=%d H=%d: %s", dir, p->key.B, p->key.T, p->key.H, what);
        rc = dnn_fail(__FILE__, __LINE__, st, w);
    }
    if (vp) cudnnBackendDestroyDescriptor(vp);
    return rc;
}
