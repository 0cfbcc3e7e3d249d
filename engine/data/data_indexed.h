/* data_indexed.h - Megatron indexed datasets (PREFIX.bin + PREFIX.idx).
 *
 * The format of Megatron-Core's IndexedDataset (MMapIndexedDataset), version 1,
 * all little-endian:
 *
 *   PREFIX.idx  char magic[9] = "MMIDIDX\0\0"
 *               u64  version = 1
 *               u8   dtype code (mt_idx_dtype)
 *               u64  sequence count S
 *               u64  document count D1 (= documents + 1)
 *               i32  sequence lengths[S]      (tokens)
 *               i64  sequence pointers[S]     (byte offset of each sequence in .bin)
 *               i64  document indices[D1]     (0, then for each document the
 *                                              sequence index where the next
 *                                              document starts; the last is S)
 *              [i8   sequence modes[S]]       (multimodal files only; ignored)
 *   PREFIX.bin  the tokens of all sequences back to back, in dtype.
 *
 * Document d is sequences [doc_idx[d], doc_idx[d+1]). Sequences are contiguous
 * in .bin, so a document is also a contiguous token range. A document may hold
 * zero sequences (Megatron's preprocess writes that for an empty text) and a
 * sequence may hold zero tokens.
 *
 * The reader maps both files read-only and validates the whole index on open;
 * after that every accessor is O(1) and safe to call from several threads.
 */
#ifndef MT_DATA_INDEXED_H
#define MT_DATA_INDEXED_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Megatron's DType codes. */
typedef enum mt_idx_dtype {
    MT_IDX_UINT8 = 1,
    MT_IDX_INT8 = 2,
    MT_IDX_INT16 = 3,
    MT_IDX_INT32 = 4,
    MT_IDX_INT64 = 5,
    MT_IDX_FLOAT64 = 6,
    MT_IDX_FLOAT32 = 7,
    MT_IDX_UINT16 = 8,
} mt_idx_dtype;

enum { MT_IDX_DTYPE_MAX = 8 };

/* Bytes per element of a dtype code, 0 if the code is unknown. */
int mt_idx_dtype_size(int dtype);
/* "uint16", ...; "unknown" for an unknown code. */
const char *mt_idx_dtype_name(int dtype);
/* Megatron's DType.optimal_dtype: uint16 when vocab < 65500, else int32. */
int mt_idx_dtype_for_vocab(int64_t vocab);

/* ---- reader ---------------------------------------------------------------- */

typedef struct mt_indexed mt_indexed;

/* Opens PREFIX.idx and PREFIX.bin, maps them and validates the index: magic,
 * version, dtype, sizes, pointers equal to the running sum of lengths, .bin
 * long enough, document indices starting at 0, monotone and ending at S.
 * MT_ENOTFOUND for a missing file, MT_ECORRUPT for a bad one. */
int mt_indexed_open(const char *prefix, mt_indexed **out);
void mt_indexed_close(mt_indexed *ds);

const char *mt_indexed_prefix(const mt_indexed *ds);
int mt_indexed_dtype(const mt_indexed *ds);
int64_t mt_indexed_num_sequences(const mt_indexed *ds);
/* Documents, i.e. the index's document count minus one. */
int64_t mt_indexed_num_documents(const mt_indexed *ds);
/* Tokens in all sequences. */
int64_t mt_indexed_num_tokens(const mt_indexed *ds);

/* Length of sequence i in tokens, or MT_EINVAL for i out of [0, S). */
int64_t mt_indexed_sequence_length(const mt_indexed *ds, int64_t i);
/* Token offset of sequence i in the whole token array; i == S gives the
 * token count. MT_EINVAL for i out of [0, S]. */
int64_t mt_indexed_sequence_offset(const mt_indexed *ds, int64_t i);
/* Sequences [*seq_begin, *seq_end) of document d. */
int mt_indexed_document_range(const mt_indexed *ds, int64_t d, int64_t *seq_begin,
                              int64_t *seq_end);
/* Tokens of document d: [*tok_begin, *tok_begin + *tok_count) in the whole
 * token array. */
int mt_indexed_document_span(const mt_indexed *ds, int64_t d, int64_t *tok_begin,
                             int64_t *tok_count);

/* Reads tokens [tok_begin, tok_begin + count) of the whole token array into
 * out[count]. Integer dtypes only (MT_ENOTSUP for float32/float64); a value
 * outside [0, INT32_MAX] is MT_ECORRUPT. */
int mt_indexed_read(const mt_indexed *ds, int64_t tok_begin, int64_t count, int32_t *out);
/* Reads all tokens of sequences [seq_begin, seq_end) into out[cap]; *n_out
 * receives the token count. MT_EINVAL if cap is too small. */
int mt_indexed_read_sequences(const mt_indexed *ds, int64_t seq_begin, int64_t seq_end,
                              int32_t *out, int64_t cap, int64_t *n_out);

/* ---- writer ---------------------------------------------------------------- */

typedef struct mt_indexed_writer mt_indexed_writer;

/* Starts PREFIX.bin.tmp; dtype is an integer dtype code. */
int mt_indexed_writer_create(const char *prefix, int dtype, mt_indexed_writer **out);
/* Appends one document of n tokens as one sequence (Megatron's preprocess
 * without sentence splitting). n == 0 adds a document with no sequence, as
 * Megatron does for an empty text. A token that does not fit the dtype is
 * MT_EINVAL. */
int mt_indexed_writer_add_document(mt_indexed_writer *w, const int32_t *tokens, int64_t n);
/* Writes PREFIX.idx.tmp, fsyncs both files, renames them to PREFIX.bin and
 * PREFIX.idx, and fsyncs the directory. Byte-identical to Megatron's
 * IndexedDatasetBuilder output for the same documents. */
int mt_indexed_writer_finish(mt_indexed_writer *w);
/* Frees the writer; removes the temporary files unless finish succeeded. */
void mt_indexed_writer_free(mt_indexed_writer *w);

int64_t mt_indexed_writer_num_documents(const mt_indexed_writer *w);
int64_t mt_indexed_writer_num_tokens(const mt_indexed_writer *w);

#ifdef __cplusplus
}
#endif

#endif
