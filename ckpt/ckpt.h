/* ckpt.h - distributed HDF5 checkpoints (format: ckpt/FORMAT.md).
 *
 * A checkpoint is a directory ROOT/step_NNNNNNNN/ holding one shard file per
 * writing rank (shard_RRRRR.h5) and index.h5, written last. Writing goes to
 * step_NNNNNNNN.partial/ and is committed by a rename (mt_ckpt_begin /
 * mt_ckpt_commit); ROOT/latest names the newest committed checkpoint.
 *
 * Writers hand over tensor descriptors (engine/model/tensor_desc.h) for the
 * pieces the sharding map (engine/parallel/sharding.h) assigns to their rank.
 * Readers see global tensors and read any hyperslab of them in the stored
 * dtype or converted (bf16 <-> f32, e4m3 + scales -> f32 / bf16, anything
 * -> e4m3 + scales by the project's quantisation rule); the same reading
 * interface (mt_tensor_source) serves a Hugging Face safetensors directory.
 *
 * Every function returns MT_OK or a negative status with a message naming
 * the file and the tensor involved. HDF5 is not thread-safe in this build:
 * every HDF5 call here holds one process-wide lock, so a background writer
 * and a foreground reader serialise their HDF5 calls instead of corrupting
 * state; the bytes of the chunks move outside it (issue 23):
 *  - writing a shard is a pipeline: chunks filled, copied, Fletcher32-ed by
 *    a pool of worker threads, XXH64 in order by a hasher thread, handed to
 *    HDF5 in order by the caller, and pwritten by the workers (the shard's
 *    file driver, ckpt_vfd.c, leaves them the chunk writes), chunks of
 *    1 MB and more with O_DIRECT where the file system takes it (else
 *    through the page cache, said once in the log), write-back of the rest
 *    started every 64 MB, one fsync per file;
 *  - reading: chunk addresses from the index's chunks table (the writer
 *    records where its chunks went; HDF5's chunk index only for indexes
 *    without it), the chunks pread and checked by the workers; whole
 *    pieces (up to 256 MB) of the reader's own shard are read ahead in file
 *    order, a task per chunk, started on a thread of their own, with the
 *    kernel's sequential read-ahead of the file;
 *  - verify: the chunks of all pieces of all files pread and checked by the
 *    workers, a window of them in flight, each piece's XXH64 fed in chunk
 *    order by whichever worker completes its next chunk (ckpt_verify.c).
 * Memory stays bounded (about 128 MB for a writer, 256 MB of read-ahead
 * and one piece, verify's window: 2 x workers + 2 chunks of at most 4 MB),
 * never the model. Environment: MT_CKPT_THREADS (workers; default the CPUs
 * divided among the host's ranks, clamped to [4, 16]), MT_CKPT_DIRECT=0
 * (shard chunks through the page cache; 1 or unset: O_DIRECT),
 * MT_CKPT_DIRECT_READ=0 / 1 (large chunks of the reader's own shard read
 * with O_DIRECT; default off), and for comparisons MT_CKPT_SERIAL_WRITES=1 (HDF5's own
 * driver), MT_CKPT_NO_READAHEAD=1, MT_CKPT_READAHEAD_MB / _PIECE_MB,
 * MT_CKPT_KERNEL_READAHEAD_MB (0: off), MT_CKPT_INDEX_CHUNKS=0 (the index's
 * chunks table unread: addresses from HDF5), MT_CKPT_WRITEBACK=0, MT_CKPT_NO_SIMD=1
 * (Fletcher32 without AVX2), MT_CKPT_VERIFY_CHUNKS=N (verify's chunks in
 * flight; 1: one at a time). An mt_ckpt is read by one thread at a time.
 */
#ifndef MT_CKPT_H
#define MT_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "ckpt/progress.h"
#include "engine/parallel/sharding.h"
#include "engine/model/tensor_desc.h"

#define MT_CKPT_FORMAT "moetrain-ckpt"
#define MT_CKPT_FORMAT_VERSION 1

/* ---- the checkpoint root ------------------------------------------------------- */

/* ROOT/step_NNNNNNNN (partial: with ".partial"). MT_EINVAL if it does not fit. */
int mt_ckpt_step_path(char *out, size_t cap, const char *root, int64_t step, int partial);

/* Committed steps under root, ascending (*steps malloc'd; NULL when none). */
int mt_ckpt_list(const char *root, int64_t **steps, int *n);

/* A checkpoint directory from `path`: path itself if it holds index.h5
 * (a step directory), else the newest committed step_NNNNNNNN of the root
 * `path`. Partial directories are never taken. MT_ENOTFOUND if none. */
int mt_ckpt_resolve(const char *path, char *out, size_t cap);

/* Starts a save of `step`: removes stale step_*.partial / *.deleting
 * directories left by an interrupted save, creates an empty
 * ROOT/step_NNNNNNNN.partial and returns its path. */
int mt_ckpt_begin(const char *root, int64_t step, char *partial, size_t cap);

/* Flags of the operations that commit a checkpoint. */
enum {
    /* replace a committed step_NNNNNNNN of the same step (refused without):
     * exchanged atomically (renameat2 RENAME_EXCHANGE), then the old copy
     * removed, so that one committed copy exists at every instant */
    MT_CKPT_OVERWRITE = 1,
};

/* Commits the partial directory of `step` (its files already fsynced):
 * fsync, rename to step_NNNNNNNN, fsync ROOT, replace ROOT/latest
 * atomically (it names the newest step), then keep-last-k retention
 * (keep_last 0: keep all). A committed step_NNNNNNNN of the same step is
 * an error (MT_EINVAL) that leaves both directories as they are. */
int mt_ckpt_commit(const char *root, int64_t step, int keep_last);
/* The same with flags (MT_CKPT_OVERWRITE). */
int mt_ckpt_commit_ex(const char *root, int64_t step, int keep_last, int flags);

/* Removes the oldest committed checkpoints beyond keep_last, never the
 * newest, never the one `latest` names, never one a reader holds open
 * (mt_ckpt_open takes a shared lock on the directory). */
int mt_ckpt_retain(const char *root, int keep_last);

/* ---- resuming and setting aside (ckpt_resume.c) ------------------------------- */

/* Moves committed checkpoint ROOT/step_N out of the committed namespace to
 * ROOT/step_N.<tag> (or .<tag>.2, .<tag>.3 ... when taken), fsyncs ROOT, and
 * points `latest` at the newest remaining step (removes it when none), so
 * listings, resolve, retention and a later save of step N never see it. It
 * is kept for inspection, never deleted. `moved` (may be NULL) gets the new
 * path. */
int mt_ckpt_set_aside(const char *root, int64_t step, const char *tag, char *moved, size_t cap);

/* The newest committed checkpoint under root with step < below (below < 0:
 * any) that verifies completely (mt_ckpt_verify: index, coverage, every
 * checksum). Each newer one that is damaged (MT_ECORRUPT) is logged and,
 * with set_aside, moved to step_N.damaged. *step = -1 and MT_OK when none
 * verifies. Other failures (out of memory, I/O) are returned and move
 * nothing: a transient error never costs a checkpoint. */
int mt_ckpt_find_resumable(const char *root, int64_t below, int set_aside, char *path, size_t cap,
                           int64_t *step);

/* ---- metadata ---------------------------------------------------------------- */

typedef struct mt_ckpt_meta {
    int64_t step;               /* optimizer steps completed */
    int64_t consumed_samples;   /* training samples read so far: the data position */
    int64_t consumed_tokens;
    char *config_json;          /* model config.json (HF DeepSeek-V3 names) */
    char *job_json;             /* the job spec, or "null" */
    char *state_json;           /* trainer scalars (FORMAT.md "state") */
    mt_layout layout;           /* the layout the pieces follow */
    mt_shard_opts opts;         /* which tensors, which dtypes */
} mt_ckpt_meta;

/* Frees the strings of a meta read by mt_ckpt_open's caller copies. */
void mt_ckpt_meta_free(mt_ckpt_meta *m);
/* Deep copy. */
int mt_ckpt_meta_copy(mt_ckpt_meta *dst, const mt_ckpt_meta *src);

/* ---- writing ------------------------------------------------------------------- */

/* One row of the index's shard map: a piece as written. */
typedef struct mt_ckpt_piece_rec {
    char tensor[MT_TENSOR_NAME_CAP];
    int rank;                   /* writer: the piece is in shard_RRRRR.h5 */
    int64_t off[2], count[2];
    int64_t nbytes;
    uint64_t xxh64;             /* of the piece's bytes in row-major order */
    /* where the writer put the piece's stored chunks (FORMAT.md, the
     * index's `chunks` table): rows a chunk, the file offset of the first,
     * bytes from one to the next (equal steps); chunk_rows 0: not recorded
     * (a load then finds them through HDF5) */
    int64_t chunk_rows, chunk_addr, chunk_stride;
} mt_ckpt_piece_rec;

/* Supplies rows [band->off[0], +band->count[0]) (all of the piece's
 * columns) of descriptor i into buf, in band->dtype, row-major. */
typedef int (*mt_ckpt_fill_fn)(void *ctx, int i, const mt_tensor_desc *band, void *buf);

/* Writes DIR/shard_RRRRR.h5 holding descriptors d[0..n) (global name,
 * dtype, shape, hyperslab; data, or NULL to ask fill() band by band with
 * bounded memory), checksummed (Fletcher32 per chunk, xxh64 per piece),
 * closed and fsynced. recs[n] receives the shard-map rows. */
int mt_ckpt_write_shard(const char *dir, int rank, const mt_tensor_desc *d, int n,
                        mt_ckpt_fill_fn fill, void *ctx, mt_ckpt_piece_rec *recs,
                        mt_progress *prog);

/* Writes DIR/index.h5: metadata, the tensor table of `map`, the shard map
 * `recs` (checked first: every tensor tiled exactly, files present with the
 * sizes they have now) and one virtual dataset per global tensor; fsynced. */
int mt_ckpt_write_index(const char *dir, const mt_ckpt_meta *meta, const mt_shard_map *map,
                        const mt_ckpt_piece_rec *recs, int n);

/* The same in two steps, so that the index is written while the shards
 * are (issue 23): begin creates DIR/index.h5 from the shard map alone
 * (metadata, the tensor table, the virtual datasets: all but the pieces'
 * checksums and the files' sizes); finish takes the written pieces' rows
 * (which must be the map's pieces), writes the rest, closes, seals and
 * fsyncs it, and frees ix, as abort does (ix NULL: nothing) without
 * finishing. map must stay valid until then. */
typedef struct mt_ckpt_index mt_ckpt_index;
int mt_ckpt_index_begin(mt_ckpt_index **ix, const char *dir, const mt_ckpt_meta *meta,
                        const mt_shard_map *map);
int mt_ckpt_index_finish(mt_ckpt_index *ix, const mt_ckpt_piece_rec *recs, int n);
void mt_ckpt_index_abort(mt_ckpt_index *ix);

/* ---- reading ------------------------------------------------------------------- */

/* A source of global tensors: a checkpoint, or a Hugging Face directory. */
typedef struct mt_tensor_source {
    void *impl;
    const char *what;  /* path, for messages */
    /* stored dtype and shape of a tensor; MT_ENOTFOUND if absent (no message) */
    int (*info)(void *impl, const char *name, mt_dtype *dt, int *ndim, int64_t shape[2]);
    /* reads hyperslab d->off / d->count of d->name in the stored dtype */
    int (*read_raw)(void *impl, mt_tensor_desc *d);
} mt_tensor_source;

/* Reads d->name's hyperslab into d->data as d->dtype, converting from the
 * stored dtype: bf16 <-> f32 exactly / rounded to nearest even; e4m3 (with
 * its weight_scale_inv) dequantised. e4m3 is not a conversion target here:
 * use mt_source_read_fp8. MT_ENOTFOUND (with a message) if absent. */
int mt_source_read(const mt_tensor_source *s, mt_tensor_desc *d);

/* Reads weight rows / columns q->off, q->count as e4m3 into q->data and the
 * matching 128 x 128 block scales into s_out [ceil(count0/128),
 * ceil(count1/128)] f32 (may be NULL). Exact when stored as e4m3; otherwise
 * quantised from the stored values (kernels/mt_fp8.h rule). The hyperslab
 * must start on a block boundary. */
int mt_source_read_fp8(const mt_tensor_source *s, mt_tensor_desc *q, float *s_out);

typedef struct mt_ckpt_tensor {
    char name[MT_TENSOR_NAME_CAP];
    mt_dtype dtype;
    int ndim;
    int64_t shape[2];
    int first_piece, n_pieces;  /* into the checkpoint's piece table */
} mt_ckpt_tensor;

typedef struct mt_ckpt mt_ckpt;

/* Opens a checkpoint (a step directory, or a root: its newest committed
 * step). Reads and checks the index: format version, metadata, tensor
 * table, shard map coverage, shard files present with their recorded sizes
 * and each piece's dataset present with its shape. Takes a shared lock on
 * the directory until close (retention skips it). */
int mt_ckpt_open(mt_ckpt **out, const char *path);
/* The rank reading ck (before its reads): large chunks of its own shard
 * are read past the page cache (O_DIRECT, MT_CKPT_DIRECT_READ), those of
 * other ranks' shards through it, since replicated pieces (written by one
 * replica of each group) are read by every replica. Unset: every shard alike. */
void mt_ckpt_set_reader_rank(mt_ckpt *ck, int rank);
void mt_ckpt_close(mt_ckpt *ck);

const char *mt_ckpt_dir(const mt_ckpt *ck);
const mt_ckpt_meta *mt_ckpt_get_meta(const mt_ckpt *ck);
int mt_ckpt_n_tensors(const mt_ckpt *ck);
const mt_ckpt_tensor *mt_ckpt_tensor_at(const mt_ckpt *ck, int i);
int mt_ckpt_find(const mt_ckpt *ck, const char *name);
int mt_ckpt_n_pieces(const mt_ckpt *ck);
const mt_ckpt_piece_rec *mt_ckpt_piece_at(const mt_ckpt *ck, int i);
int64_t mt_ckpt_bytes(const mt_ckpt *ck);

/* The checkpoint as a tensor source. Reads verify Fletcher32 on every
 * chunk and xxh64 on every piece read whole. */
mt_tensor_source mt_ckpt_source(mt_ckpt *ck);

/* mt_source_read on the checkpoint; the signature of engine/train/train_state.h's
 * mt_tensor_read_fn (ctx: the mt_ckpt). */
int mt_ckpt_read_fn(void *ctx, mt_tensor_desc *d);
/* mt_source_read_fp8 likewise (ctx: the mt_ckpt). */
int mt_ckpt_read_fp8_fn(void *ctx, mt_tensor_desc *q, float *s);
/* The reader's skip hint (train_state.h mt_tensor_reader.skip; ctx: the
 * mt_ckpt): tensor `name` and its FP8 block scales are read by another
 * replica, so their pieces stay out of this reader's read-ahead (a read
 * of them still works). Unknown names are ignored. */
void mt_ckpt_skip_fn(void *ctx, const char *name);

/* Rebuilds the sharding map the checkpoint was written with. */
int mt_ckpt_map(const mt_ckpt *ck, mt_shard_map *map);

/* ---- whole operations (single process) ------------------------------------------ */

/* Writes every rank's shard of `map` (one process playing all ranks) with
 * pieces read from `src`, then the index; into ROOT/step_N via the commit
 * protocol, or into `out` itself if its name is step_NNNNNNNN. Memory is
 * bounded by the band size, never the model. An existing target is
 * refused before anything is written unless flags has MT_CKPT_OVERWRITE. */
int mt_ckpt_write_from_source(const char *out, const mt_ckpt_meta *meta, const mt_shard_map *map,
                              const mt_tensor_source *src, int flags, mt_progress *prog);

/* The resulting checkpoint directory of mt_ckpt_write_from_source(out, step). */
int mt_ckpt_out_path(const char *out, int64_t step, char *dir, size_t cap, char *root,
                     size_t rcap, int *is_root);

/* Re-lays `in` out under `layout` into `out` (streaming); flags as
 * mt_ckpt_write_from_source. */
int mt_ckpt_reshard(const char *in, const char *out, const mt_layout *layout, int flags,
                    mt_progress *prog);

/* One problem found by verify. */
typedef void (*mt_ckpt_report_fn)(void *ctx, const char *file, const char *tensor,
                                  const char *problem);

/* Checks everything: index consistency, coverage (no gaps, no overlaps),
 * every shard dataset read in full (Fletcher32) and its xxh64, virtual
 * datasets. Calls report() per problem, in piece order whatever the
 * workers' timing (from this thread); returns MT_OK or MT_ECORRUPT (the
 * message names the first problem and the count), or another error that
 * says nothing about the checkpoint (out of memory). The files and pieces
 * are read in parallel by the checkpoint workers. */
int mt_ckpt_verify(const char *path, mt_ckpt_report_fn report, void *ctx, mt_progress *prog);

/* Compares two checkpoints tensor by tensor (bytes of each global tensor,
 * read in bands); weights_only skips optimizer state. report() gets each
 * difference; MT_OK if identical, MT_ECORRUPT otherwise. */
int mt_ckpt_diff(const char *a, const char *b, int weights_only, int meta_too,
                 mt_ckpt_report_fn report, void *ctx);

#endif
