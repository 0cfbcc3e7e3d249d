/* comm_reduce.c - the arithmetic of a rank-ordered reduction (comm.h):
 * accumulate in F32 (F32, BF16, E4M3), F64 (F64) or the integer type
 * itself, one rank's contribution after another, and round once.
 *
 * Integer sums are done in the unsigned type of the same width so that
 * overflow wraps (two's complement) instead of being undefined. Built with
 * the project's flags: no -ffast-math, and additions only (no contraction
 * to worry about), so each element is a fixed sequence of IEEE operations.
 */
#include <string.h>

#include "engine/parallel/comm_impl.h"
#include "kernels/mt_fp8.h"

size_t mt_comm_acc_size(mt_comm_dtype dt)
{
    switch (dt) {
    case MT_COMM_I32: return 4;
    case MT_COMM_I64: return 8;
    case MT_COMM_F32: return 4;
    case MT_COMM_F64: return 8;
    case MT_COMM_BF16: return 4;
    case MT_COMM_E4M3: return 4;
    default: return 0;
    }
}

void mt_comm_acc_load(void *acc, const void *x, size_t n, mt_comm_dtype dt)
{
    if (dt == MT_COMM_BF16) {
        float *a = acc;
        const uint16_t *h = x;
        for (size_t i = 0; i < n; i++) a[i] = mt_bf16_to_f32(h[i]);
    } else if (dt == MT_COMM_E4M3) {
        float *a = acc;
        const uint8_t *q = x;
        for (size_t i = 0; i < n; i++) a[i] = mt_e4m3_to_f32(q[i]);
    } else {
        memcpy(acc, x, n * mt_comm_acc_size(dt));
    }
}

#define MT_ACC_LOOP(T, a, b, n, op)                                                     \
    do {                                                                                \
        if ((op) == MT_COMM_SUM)                                                        \
            for (size_t i_ = 0; i_ < (n); i_++) (a)[i_] = (T)((a)[i_] + (b)[i_]);       \
        else if ((op) == MT_COMM_MAX)                                                   \
            for (size_t i_ = 0; i_ < (n); i_++) (a)[i_] = (b)[i_] > (a)[i_] ? (b)[i_] : (a)[i_]; \
        else                                                                            \
            for (size_t i_ = 0; i_ < (n); i_++) (a)[i_] = (b)[i_] < (a)[i_] ? (b)[i_] : (a)[i_]; \
    } while (0)

/* Narrow float types: convert a block at a time onto the stack, then the
 * F32 loop. */
#define MT_ACC_BLOCK 256

void mt_comm_acc_add(void *acc, const void *x, size_t n, mt_comm_dtype dt, mt_comm_op op)
{
    switch (dt) {
    case MT_COMM_I32:
        if (op == MT_COMM_SUM) MT_ACC_LOOP(uint32_t, (uint32_t *)acc, (const uint32_t *)x, n, op);
        else MT_ACC_LOOP(int32_t, (int32_t *)acc, (const int32_t *)x, n, op);
        break;
    case MT_COMM_I64:
        if (op == MT_COMM_SUM) MT_ACC_LOOP(uint64_t, (uint64_t *)acc, (const uint64_t *)x, n, op);
        else MT_ACC_LOOP(int64_t, (int64_t *)acc, (const int64_t *)x, n, op);
        break;
    case MT_COMM_F32: MT_ACC_LOOP(float, (float *)acc, (const float *)x, n, op); break;
    case MT_COMM_F64: MT_ACC_LOOP(double, (double *)acc, (const double *)x, n, op); break;
    case MT_COMM_BF16:
    case MT_COMM_E4M3: {
        float tmp[MT_ACC_BLOCK];
        const size_t es = dt == MT_COMM_BF16 ? 2 : 1;
        for (size_t i = 0; i < n; i += MT_ACC_BLOCK) {
            size_t m = n - i < MT_ACC_BLOCK ? n - i : MT_ACC_BLOCK;
            mt_comm_acc_load(tmp, (const char *)x + i * es, m, dt);
            float *a = (float *)acc + i;
            MT_ACC_LOOP(float, a, tmp, m, op);
        }
        break;
    }
    default: break;
    }
}

void mt_comm_acc_store(void *out, const void *acc, size_t n, mt_comm_dtype dt)
{
    if (dt == MT_COMM_BF16) {
        uint16_t *h = out;
        const float *a = acc;
        for (size_t i = 0; i < n; i++) h[i] = mt_bf16_from_f32(a[i]);
    } else if (dt == MT_COMM_E4M3) {
        uint8_t *q = out;
        const float *a = acc;
        for (size_t i = 0; i < n; i++) q[i] = mt_e4m3_from_f32(a[i]);
    } else {
        memmove(out, acc, n * mt_comm_acc_size(dt));
    }
}
