/* mt_npy.h - NumPy .npy files (format version 1.0), so that results can be
 * read by numpy.load without any code of ours, and token arrays written by
 * numpy.save can be read here.
 *
 * The format: the magic "\x93NUMPY", version bytes 1 0, a little-endian
 * uint16 header length, then an ASCII Python dict literal
 * {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } padded with
 * spaces and ended by '\n' so that the data start at a multiple of 64
 * bytes; then the elements in C order.
 *
 * A writer streams the data (rows of a large array need not fit in memory)
 * into PATH.partial, which becomes PATH only when every element promised by
 * the shape was written: a reader never sees a short file.
 */
#ifndef MT_NPY_H
#define MT_NPY_H

#include <stdint.h>

#define MT_NPY_MAX_DIMS 4

typedef struct mt_npy_writer mt_npy_writer;

/* Starts PATH.partial for an array of `descr` ("<f4", "<i4", ...; the
 * element size is taken from its digits) and shape [ndim] (0 <= ndim <= 4). */
int mt_npy_create(mt_npy_writer **out, const char *path, const char *descr, int ndim,
                  const int64_t *shape);
/* Appends n elements (C order). Writing past the shape is an error. */
int mt_npy_write(mt_npy_writer *w, const void *data, int64_t n);
/* Checks that the shape is complete, fsyncs and renames PATH.partial to
 * PATH. On any error (or with abandon) the partial file is removed. Always
 * frees w. */
int mt_npy_close(mt_npy_writer *w, int abandon);

/* Reads an integer array (descr <i1 <i2 <i4 <i8 |u1 <u2 <u4 <u8 or |i1,
 * C order, 1 or 2 dimensions) as int32: *data malloc'd [rows, cols] (a 1-D
 * array is one row). Values outside int32 are errors naming the index. */
int mt_npy_read_int32(const char *path, int32_t **data, int64_t *rows, int64_t *cols);

#endif
