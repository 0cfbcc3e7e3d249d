/* safetensors.h - the safetensors format, read and written here (no
 * library): 8-byte little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "BF16", "shape": [r, c], "data_offsets": [b, e]}, ...,
 * "__metadata__": {...}} padded with spaces to a multiple of 8, then the
 * raw little-endian data (offsets relative to the end of the header).
 */
#ifndef MT_SAFETENSORS_H
#define MT_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

typedef struct mt_st_tensor {
    char name[128];
    char dtype[16];      /* "F8_E4M3", "BF16", "F16", "F32", ... */
    int ndim;
    int64_t shape[8];
    uint64_t begin, end; /* data offsets */
} mt_st_tensor;

/* A safetensors file: the header parsed from a mapping, the data read with
 * mt_st_read (map is the whole file, for callers that want it). */
typedef struct mt_st_file {
    char path[4096];
    int fd;
    const uint8_t *map;
    size_t size;
    size_t data_off;     /* 8 + header length */
    int n;
    mt_st_tensor *t;
} mt_st_file;

/* Bytes of one element of a safetensors dtype; 0 if unknown. */
size_t mt_st_dtype_size(const char *dtype);

/* Maps and parses a file; checks every tensor lies inside the data and its
 * size matches dtype x shape. */
int mt_st_open(mt_st_file **out, const char *path);
void mt_st_close(mt_st_file *f);
/* Index of a tensor, or -1. */
int mt_st_find(const mt_st_file *f, const char *name);
/* Reads n bytes at data offset `off` (relative to the end of the header)
 * with pread: the bytes land in dst only, not in mapped pages that would
 * stay resident (the mapping is for the header). */
int mt_st_read(const mt_st_file *f, void *dst, size_t n, uint64_t off);

/* A file written front to back: the header is fixed by the entry list,
 * then the data of each entry in order. Written to PATH.tmp, fsynced,
 * renamed on close. */
typedef struct mt_st_writer mt_st_writer;
int mt_st_writer_open(mt_st_writer **out, const char *path, const mt_st_tensor *entries, int n);
/* Appends bytes of the current tensor(s). */
int mt_st_writer_write(mt_st_writer *w, const void *data, size_t n);
/* Checks every declared byte was written, fsyncs, renames. */
int mt_st_writer_close(mt_st_writer *w);
/* Drops a writer after an error (removes the temp file). */
void mt_st_writer_abort(mt_st_writer *w);

#endif
