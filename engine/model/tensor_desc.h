/* tensor_desc.h - a plain descriptor of one piece of a global tensor.
 *
 * The narrow interface between the engine and checkpoints (ckpt/ includes
 * this header, never the model or trainer headers): a global tensor name
 * (the Hugging Face DeepSeek-V3 names of engine/param_table, or the derived
 * scale / optimizer names), its element type, its global shape, the
 * rectangular hyperslab [off, off + count) of it that this descriptor
 * covers, and a host pointer to that hyperslab's elements in row-major
 * order (count[0] rows of count[1] contiguous elements for 2-D tensors).
 */
#ifndef MT_TENSOR_DESC_H
#define MT_TENSOR_DESC_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef enum {
    MT_DT_F32 = 0, /* IEEE float32 */
    MT_DT_BF16,    /* bfloat16 bits (uint16) */
    MT_DT_E4M3,    /* FP8 E4M3FN bits (uint8), kernels/mt_fp8.h */
    MT_DT_I32,
    MT_DT_I64,
    MT_DT_U8,
    MT_DT_COUNT
} mt_dtype;
_Static_assert(MT_DT_COUNT == 6, "update mt_dtype_size and mt_dtype_name");

#define MT_TENSOR_NAME_CAP 128

typedef struct mt_tensor_desc {
    char name[MT_TENSOR_NAME_CAP]; /* global name, "model.layers.3.mlp.gate.weight" */
    mt_dtype dtype;
    int ndim;                      /* 1 or 2 */
    int64_t shape[2];              /* global shape; shape[1] unused (1) for 1-D */
    int64_t off[2];                /* hyperslab start, elements */
    int64_t count[2];              /* hyperslab extent, elements */
    void *data;                    /* host [count[0], count[1]] row-major, or NULL */
} mt_tensor_desc;

/* Bytes of one element. */
static inline size_t mt_dtype_size(mt_dtype t)
{
    static const unsigned char sz[MT_DT_COUNT] = {4, 2, 1, 4, 8, 1};
    return (unsigned)t < MT_DT_COUNT ? sz[t] : 0;
}

/* "f32", "bf16", "e4m3", "i32", "i64", "u8" (the names FORMAT.md uses). */
static inline const char *mt_dtype_name(mt_dtype t)
{
    static const char *const names[MT_DT_COUNT] = {"f32", "bf16", "e4m3", "i32", "i64", "u8"};
    return (unsigned)t < MT_DT_COUNT ? names[t] : "?";
}

/* Inverse of mt_dtype_name; -1 if unknown. */
static inline int mt_dtype_parse(const char *s)
{
    for (int t = 0; t < MT_DT_COUNT; t++)
        if (strcmp(s, mt_dtype_name((mt_dtype)t)) == 0) return t;
    return -1;
}

/* Elements of the descriptor's hyperslab. */
static inline int64_t mt_tensor_desc_numel(const mt_tensor_desc *d)
{
    return d->ndim == 1 ? d->count[0] : d->count[0] * d->count[1];
}

static inline size_t mt_tensor_desc_bytes(const mt_tensor_desc *d)
{
    return (size_t)mt_tensor_desc_numel(d) * mt_dtype_size(d->dtype);
}

/* Fills a descriptor of the hyperslab [r0, r0 + nr) x [c0, c0 + nc) of a
 * tensor of global shape `shape` (readers stream bands of rows with it). */
static inline void mt_tensor_desc_slab(mt_tensor_desc *d, const char *name, mt_dtype dtype,
                                       int ndim, const int64_t shape[2], int64_t r0, int64_t c0,
                                       int64_t nr, int64_t nc, void *data)
{
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name, "%s", name);
    d->dtype = dtype;
    d->ndim = ndim;
    d->shape[0] = shape[0];
    d->shape[1] = shape[1];
    d->off[0] = r0;
    d->off[1] = c0;
    d->count[0] = nr;
    d->count[1] = nc;
    d->data = data;
}

/* Fills a descriptor covering the whole tensor (1-D: rows unused). */
static inline void mt_tensor_desc_whole(mt_tensor_desc *d, const char *name, mt_dtype dtype,
                                        int ndim, int64_t rows, int64_t cols, void *data)
{
    const int64_t shape[2] = {ndim == 1 ? cols : rows, ndim == 1 ? 1 : cols};
    mt_tensor_desc_slab(d, name, dtype, ndim, shape, 0, 0, shape[0], shape[1], data);
}

#endif
