/* ckpt_internal.h - shared internals of the checkpoint module (not a
 * public interface): the HDF5 lock and error text, element types, the
 * open-checkpoint structure. */
#ifndef MT_CKPT_INTERNAL_H
#define MT_CKPT_INTERNAL_H

#include <hdf5.h>
#include <pthread.h>

#include "ckpt/ckpt.h"

/* Chunk target of shard datasets: big enough for streaming I/O, small
 * enough that a flipped byte is localised and partial reads stay cheap. */
#define CK_CHUNK_BYTES (4u << 20)
/* Rows per band when streaming a piece: bounded memory (reshard, import,
 * export, verify, diff), a multiple of 128 so FP8 blocks stay whole. */
#define CK_BAND_BYTES ((size_t)64 << 20)
/* f32 temporaries of a type conversion on read (bf16 -> f32, e4m3 + scales
 * -> f32 / bf16) are strips of at most this many bytes. */
#define CK_STRIP_BYTES ((size_t)4 << 20)

#define CK_INDEX "index.h5"
/* Bytes of the HDF5 user block of index.h5 holding its seal (ckpt_seal.c). */
#define CK_INDEX_USERBLOCK 512
#define CK_LATEST "latest"
#define CK_META_GROUP "moetrain"

/* The process-wide HDF5 lock (recursive): every public entry point that
 * touches HDF5 holds it. Also silences HDF5's automatic error printing. */
void ck_lock(void);
void ck_unlock(void);

/* The innermost HDF5 error description of the current stack ("data error
 * detected by Fletcher32 checksum"), or "" - into buf. */
const char *ck_h5_errstr(char *buf, size_t cap);

/* HDF5 file type of a dtype (bf16: a 16-bit IEEE-like float, 8 exponent
 * bits, bias 127; e4m3: unsigned bytes). Caller closes with H5Tclose. */
hid_t ck_h5_type(mt_dtype dt);

/* HDF5's Fletcher32 checksum, bit for bit: shard chunks are written and
 * read directly (H5Dwrite_chunk / H5Dread_chunk) with it appended
 * little-endian, exactly as the HDF5 filter stores them, so HDF5 tools read
 * them through the filter; moetrain reads them without HDF5's per-chunk
 * allocations. */
uint32_t ck_fletcher32(const void *data, size_t n);

/* Worker threads of checkpoint I/O: MT_CKPT_THREADS, else the online CPUs
 * clamped to [4, 16]. */
int ck_io_threads(void);
/* Runs fn(arg) on a worker of the process-wide pool (started on first
 * use); the caller tracks completion. A task must not wait for another. */
void ck_pool_submit(void (*fn)(void *), void *arg);

/* The kernel's sequential read-ahead of files a load reads ahead through
 * the page cache (ckpt_kahead.c): a thread asking readahead(2) for each
 * file's bytes up to MT_CKPT_KERNEL_READAHEAD_MB (default 256; 0: off,
 * start returns NULL) past the last ones wanted. fd[n] stays the caller's,
 * open until stop; want(NULL, ...) and stop(NULL) do nothing. */
typedef struct ck_kahead ck_kahead;
ck_kahead *ck_kahead_start(const int *fd, int n);
/* Bytes [a, b) of file fi are being read (the first call for fi: where the
 * kernel's read-ahead of it starts). */
void ck_kahead_want(ck_kahead *k, int fi, int64_t a, int64_t b);
void ck_kahead_stop(ck_kahead *k);

/* The file driver of shard files (ckpt_vfd.c), or -1 (HDF5 other than
 * 1.10, or MT_CKPT_SERIAL_WRITES set): HDF5's POSIX driver except that the
 * raw write of the buffer announced by ck_vfd_expect(buf, size) on this
 * thread is not made but recorded; ck_vfd_take() returns 1 and its
 * descriptor and offset if it was, and the caller has it written. Call
 * under the HDF5 lock. */
hid_t ck_vfd_id(void);
void ck_vfd_expect(const void *buf, size_t size);
/* dfd: an O_DIRECT descriptor of the file (MT_CKPT_DIRECT), or -1. */
int ck_vfd_take(int *fd, int *dfd, int64_t *addr);
/* Shard chunks written with O_DIRECT where the file system accepts it
 * (ckpt_vfd.c): on unless MT_CKPT_DIRECT=0. */
int ck_io_direct(void);
/* Large chunk runs read with O_DIRECT from the reader's own shard
 * (ckpt_read.c): MT_CKPT_DIRECT_READ=0 / 1, else CK_DIRECT_READ_DEFAULT. */
#ifndef CK_DIRECT_READ_DEFAULT
#define CK_DIRECT_READ_DEFAULT 0
#endif
int ck_io_direct_read(void);
/* O_DIRECT refused for path (err: errno; what: "writes" / "reads"): one
 * log line per process; the caller goes on through the page cache. */
void ck_io_direct_refused(const char *path, const char *what, int err);
/* Block size O_DIRECT offsets, lengths and buffers are aligned to. */
#define CK_DIRECT_ALIGN 4096

/* shard_RRRRR.h5 */
void ck_shard_name(char *out, size_t cap, int rank);

/* Chunk rows of a shard dataset [rows, cols] of esize-byte elements: a
 * power of two near CK_CHUNK_BYTES (or all rows). */
int64_t ck_chunk_rows(int64_t rows, int64_t cols, size_t esize);
/* Rows per streamed band: a power of two >= 128 near CK_BAND_BYTES, so a
 * multiple of the chunk rows and of the FP8 block (or all rows). */
int64_t ck_band_rows(int64_t rows, int64_t cols, size_t esize);
/* The same for bands of at most `bytes`. */
int64_t ck_band_rows_within(int64_t rows, int64_t cols, size_t esize, size_t bytes);

/* Writes a fixed-length string dataset name (1 element, chunked +
 * Fletcher32) into loc. */
int ck_write_string(hid_t loc, const char *name, const char *text);
/* Reads it back (malloc'd). */
int ck_read_string(hid_t loc, const char *name, char **out);

/* Attribute helpers. */
int ck_attr_i64(hid_t obj, const char *name, const int64_t *v, int n);
int ck_attr_u64(hid_t obj, const char *name, uint64_t v);
int ck_attr_str(hid_t obj, const char *name, const char *s);
int ck_attr_read_i64(hid_t obj, const char *name, int64_t *v, int n);
int ck_attr_read_u64(hid_t obj, const char *name, uint64_t *v);
int ck_attr_read_str(hid_t obj, const char *name, char *buf, size_t cap);

/* The meta JSON fields (FORMAT.md) <-> struct. */
char *ck_layout_json(const mt_layout *l);
int ck_layout_from_json(const char *text, mt_layout *l);
char *ck_opts_json(const mt_shard_opts *o);
int ck_opts_from_json(const char *text, mt_shard_opts *o);

/* Model config of a meta. */
int ck_meta_config(const mt_ckpt_meta *m, mt_model_config *c);

/* Coverage of a tensor by pieces: no overlap, no gap, inside bounds.
 * Returns 0 if exact, else writes the problem into msg. */
int ck_check_tiling(int ndim, const int64_t shape[2], const mt_ckpt_piece_rec *const *p, int n,
                    char *msg, size_t cap);

/* Element conversions. */
void ck_convert(void *dst, mt_dtype dt_dst, const void *src, mt_dtype dt_src, int64_t n);

/* Row types of the index tables (FORMAT.md). */
typedef struct tensor_row {
    char name[MT_TENSOR_NAME_CAP];
    char dtype[8];
    int32_t ndim;
    int64_t shape[2];
    int64_t first_piece, n_pieces;
} tensor_row;

typedef struct piece_row {
    int32_t tensor;
    int32_t rank;
    int64_t offset[2], count[2];
    int64_t nbytes;
    uint64_t xxh64;
} piece_row;

typedef struct file_row {
    char name[32];
    int32_t rank;
    int64_t bytes;
} file_row;

/* A piece's stored chunks, row for row with the pieces table (the
 * `chunks` table; rows 0: not recorded). */
typedef struct chunk_row {
    int64_t rows, addr, stride;
} chunk_row;

/* Their HDF5 compound types (close with H5Tclose). */
hid_t ck_tensor_row_type(void);
hid_t ck_piece_row_type(void);
hid_t ck_file_row_type(void);
hid_t ck_chunk_row_type(void);

/* A piece of the read-ahead (ckpt_read.c). */
struct pf_run;
struct ck_pf {
    int state;                   /* none, running, ready */
    int drop;                    /* skipped while running: freed when done */
    int rc;
    char *data;                  /* the piece's bytes, row-major */
    struct pf_run *run;          /* while running: its chunks' reads */
    char msg[512];
};

struct mt_ckpt {
    char dir[4096];
    int lock_fd;                 /* shared flock on the directory */
    mt_ckpt_meta meta;
    int n_tensors;
    mt_ckpt_tensor *tensors;
    int n_pieces;
    mt_ckpt_piece_rec *pieces;   /* grouped by tensor; their chunks as recorded, if they are */
    int n_files;
    int *file_rank;              /* [n_files] */
    int64_t *file_bytes;         /* [n_files] recorded sizes */
    hid_t *file_h;               /* [n_files] opened lazily, -1 */
    int *file_fd;                /* [n_files] our own descriptors for chunk reads, -1 */
    int *file_dfd;               /* [n_files] O_DIRECT descriptors of them, or -1 */
    int reader_rank;             /* mt_ckpt_set_reader_rank, or -1 */
    unsigned char *skip;         /* [n_tensors] mt_ckpt_skip_fn's hints, or NULL */
    int64_t *file_base;          /* [n_files] HDF5 base address (user block bytes) */
    int *piece_file;             /* [n_pieces] */
    int hash_cap;
    int *hash;                   /* name -> tensor + 1 */
    int n_bufs;                  /* raw chunk buffers (+ checksum) of parallel reads */
    char **bufs;
    size_t buf_cap;
    /* read-ahead of whole pieces (ckpt_read.c): the pieces after the one
     * read whole, in the order of their file, read and checked by the
     * pool's workers (a task per chunk) into memory the next whole read
     * takes; in another rank's shard (when the reader's rank is set) only
     * pieces that are not optimizer state; never tensors another replica
     * reads (skip); pieces the reader skips are dropped */
    pthread_mutex_t pf_mu;
    pthread_cond_t pf_cv;
    int pf_on;                   /* mutex and condition initialised */
    struct ck_pf *pf;            /* [n_pieces] */
    int *pf_cursor;              /* [n_files] next piece to consider */
    int *pf_low;                 /* [n_files] pieces below were taken or skipped */
    int64_t pf_held;             /* bytes of the entries, running or ready */
    int pf_running;
    pthread_t pf_meta;           /* the pieces' starts (HDF5 metadata), in launch order */
    int pf_meta_on, pf_quit;
    int *pf_queue;               /* [n_pieces + 1] ring of pieces to start */
    int64_t pf_qhead, pf_qtail;
    ck_kahead *pf_kahead;        /* the kernel's read-ahead of the files read ahead, or NULL */
    int pf_kahead_tried;
    int64_t pf_pieces, pf_chunks; /* read ahead, for the debug log */
    double pf_meta_ms, pf_wait_ms, pf_copy_ms;
};

/* Reads index.h5 of ck->dir into ck (takes the lock). */
int ck_read_index_locked(mt_ckpt *ck);
/* Reads the intersection of piece p with d into d->data; a piece read
 * whole is checked against its xxh64. Takes the HDF5 lock only for HDF5's
 * calls: the chunks are read by the pool's workers (pread, Fletcher32,
 * copy) while this thread hashes them in order. An mt_ckpt is read by one
 * thread at a time. */
int ck_read_piece(mt_ckpt *ck, int p, mt_tensor_desc *d);
/* Reads a band (any hyperslab) of map tensor t from a source in the map's
 * dtype: e4m3 weights via mt_source_read_fp8, scales stored or from
 * quantising the weight, the rest via mt_source_read. */
int ck_read_map_band(const mt_shard_map *m, const mt_tensor_source *src, int t, mt_tensor_desc *d);
/* rm -rf */
int ck_rm_rf(const char *path);
/* ROOT/latest: write (temp file, fsync, rename) / read (-1: absent or bad). */
int ck_write_latest(const char *root, int64_t step);
int64_t ck_read_latest(const char *root);

/* Writes the seal of a closed index.h5 (its user block): XXH64 and length
 * of the rest of the file. */
int ck_index_seal(const char *path);
/* Checks it: MT_OK sealed and intact; 1 no seal (an index written before
 * seals: its first bytes are HDF5's signature); -1 damaged, with the
 * reason in why; another negative status if the file cannot be read. */
int ck_index_check(const char *path, char *why, size_t cap);

/* Moves the complete directory `work` to the committed name `fin` (both in
 * `root`) and fsyncs root: a rename when fin is absent; when present,
 * MT_EINVAL unless flags has MT_CKPT_OVERWRITE, else the atomic exchange
 * then removal of the old copy (or, where the file system cannot exchange,
 * two renames with the old copy set aside as FIN.replaced, logged). */
int ck_commit_dir(const char *root, const char *work, const char *fin, int flags);

/* Test hook: if the environment has MT_CKPT_TEST_CRASH=point, the process
 * kills itself (SIGKILL, as a power cut) here. Points: replace-start,
 * replace-exchanged, replace-synced, replace-removing, replace-removed,
 * replace-aside, replace-renamed (ck_commit_dir). MT_CKPT_TEST_NO_EXCHANGE
 * makes the exchange fail as on a file system without it. */
void ck_test_crash(const char *point);

/* Piece p read and checked whole (Fletcher32 of its chunks, its XXH64)
 * without keeping the bytes: verify's check of the small pieces, through
 * the read-ahead. 0 if it does not apply (a large piece: read it). */
int ck_check_piece(mt_ckpt *ck, int p, int *rc);

/* Reads past HDF5 (ckpt_read.c), for the readers and verify. */
/* Chunk layout of piece p (HDF5 lock held; its file opened with
 * ck_piece_file): the dataset checked against the index (present, shape,
 * element size), then for a dataset moetrain wrote (chunked, full-width
 * chunks, Fletcher32 only) *cr rows per chunk and *addr (malloc'd) the
 * file offset of each of its ceil(rows / cr) chunks, each stored whole
 * with its checksum; *cr = 0 for another layout (read it through HDF5). */
int ck_piece_chunks(mt_ckpt *ck, int p, int64_t *cr, int64_t **addr);
/* A buffer for one stored chunk of n bytes (CK_DIRECT_ALIGN-aligned, room
 * for the whole blocks an O_DIRECT read takes around it); free() it. */
char *ck_chunk_buf_alloc(size_t n);
/* Reads the n stored bytes at offset addr of file fi into buf (of
 * ck_chunk_buf_alloc(n)): where they start in buf, or NULL with *err =
 * errno (0: the file ends before them). Large chunks with O_DIRECT as
 * MT_CKPT_DIRECT_READ and the reader's rank say; thread-safe. */
char *ck_chunk_pread(const mt_ckpt *ck, int fi, char *buf, size_t n, int64_t addr, int *err);
/* Checks a chunk ck_chunk_pread returned (buf NULL: unreadable, with err):
 * cb data bytes then their Fletcher32, little-endian. MT_OK, or MT_EIO /
 * MT_ECORRUPT with the problem in msg naming path, tensor and the chunk's
 * first row (the text every reader gives). */
int ck_chunk_check(const char *buf, int err, size_t cb, const char *path, const char *tensor,
                   int64_t row, char *msg, size_t cap);
/* The text of a piece whose bytes hash to `got`, not to its recorded xxh64. */
void ck_piece_hash_msg(char *msg, size_t cap, const char *path, const mt_ckpt_piece_rec *r,
                       uint64_t got);

/* Problems found by verify and diff (ckpt_verify.c): each goes to report
 * (may be NULL); the first is kept as "FILE: tensor T: problem". */
typedef struct ck_problems {
    mt_ckpt_report_fn report;
    void *ctx;
    int n;
    char first[1024];
} ck_problems;
void ck_problem(ck_problems *v, const char *file, const char *tensor, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Opens (once) the shard file of piece p; error names the file and tensor. */
int ck_piece_file(mt_ckpt *ck, int p, hid_t *f);
int ck_file_index(const mt_ckpt *ck, int rank);

#endif
