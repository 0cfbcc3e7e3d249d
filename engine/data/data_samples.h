/* data_samples.h - GPT training samples over an indexed dataset.
 *
 * Split: the documents are divided into train / valid / test contiguous ranges
 * by a ratio string ("98,1,1", "98/1/1", "1"), weights normalised and rounded
 * as Megatron does (round half to even, the rounding excess taken off every
 * boundary), clamped so the ranges stay ordered.
 *
 * Stream: for epoch e, the split's documents are put in an order shuffled by
 * (seed, split, e) and joined into one token stream, each document followed by
 * an EOD token unless its last token already is EOD; empty documents add
 * nothing. The epochs' streams are concatenated.
 *
 * Windows: window j holds stream tokens [j*seq_len, j*seq_len + seq_len], i.e.
 * seq_len + 1 tokens (inputs and shifted labels); consecutive windows share one
 * token. With num_samples requested, the builder uses the fewest epochs E such
 * that E epochs hold num_samples windows, and sample i is window perm(i) where
 * perm is a pseudo-random bijection of [0, num_samples) keyed by the seed.
 * num_samples == 0 means every whole window of one epoch.
 *
 * Everything is a pure function of (dataset, config): mt_samples_get(i) is
 * random access, so a run resumed at sample k reads exactly what an
 * uninterrupted run reads (the same config, num_samples included, must be
 * used). Memory: two int64 per document per epoch, independent of tokens.
 * After open, mt_samples_get may be called from several threads.
 */
#ifndef MT_DATA_SAMPLES_H
#define MT_DATA_SAMPLES_H

#include <stdint.h>

#include "engine/data/data_indexed.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mt_split {
    MT_SPLIT_TRAIN = 0,
    MT_SPLIT_VALID = 1,
    MT_SPLIT_TEST = 2,
    MT_SPLIT_COUNT = 3,
} mt_split;

/* "train", "valid", "test". */
const char *mt_split_name(int split);

/* Document boundaries of the three splits: split s is documents
 * [bounds[s], bounds[s+1]), bounds[0] = 0, bounds[3] = num_docs. Up to three
 * non-negative weights separated by ',' or '/', missing ones are 0, the sum
 * must be positive. */
int mt_split_bounds(const char *ratios, int64_t num_docs, int64_t bounds[4]);

typedef struct mt_samples_config {
    const char *split_ratios; /* "98,1,1"; NULL means "1,0,0" */
    int split;                /* mt_split */
    int64_t seq_len;          /* >= 1; a sample holds seq_len + 1 tokens */
    int64_t num_samples;      /* samples wanted; 0 = the windows of one epoch */
    int32_t eod_token;        /* >= 0 */
    uint64_t seed;
} mt_samples_config;

typedef struct mt_samples mt_samples;

/* Builds the per-epoch document orders. ds must outlive the builder. */
int mt_samples_open(const mt_indexed *ds, const mt_samples_config *cfg, mt_samples **out);
void mt_samples_close(mt_samples *s);

int64_t mt_samples_count(const mt_samples *s);        /* samples, = num_samples if given */
int64_t mt_samples_seq_len(const mt_samples *s);
int64_t mt_samples_epochs(const mt_samples *s);       /* epochs the samples span */
int64_t mt_samples_epoch_tokens(const mt_samples *s); /* stream tokens per epoch, EODs included */
/* The split's documents [*doc_begin, *doc_end) of the dataset. */
void mt_samples_documents(const mt_samples *s, int64_t *doc_begin, int64_t *doc_end);

/* The window that sample idx reads: a bijection of [0, count). */
int64_t mt_samples_window_of(const mt_samples *s, int64_t idx);
/* Sample idx into out[seq_len + 1]. */
int mt_samples_get(const mt_samples *s, int64_t idx, int32_t *out);
/* Unshuffled window j (stream tokens [j*seq_len, j*seq_len + seq_len]) into
 * out[seq_len + 1]; j in [0, count). */
int mt_samples_window(const mt_samples *s, int64_t j, int32_t *out);
/* Dataset document at position k of epoch e's order. */
int64_t mt_samples_epoch_document(const mt_samples *s, int64_t e, int64_t k);

#ifdef __cplusplus
}
#endif

#endif
