/* mt_status.h - status codes, error messages and check macros.
 *
 * Convention (DESIGN.md): library functions return 0 (MT_OK) or a negative
 * MT_E* code, and leave a human-readable message in a thread-local buffer
 * that mt_errmsg() returns. Library code never calls exit().
 *
 * The CHECK macros capture the failing statement, file and line. They expand
 * at the point of use, so a file only needs the headers of the libraries whose
 * macros it uses (cuda_runtime.h for MT_CUDA_CHECK, hdf5.h for MT_H5_CHECK...).
 * MPI and NCCL errors are the comm layer's (engine/parallel/comm*.c).
 * Each macro returns from the enclosing function, so use them only in
 * functions returning int status; use MT_GOTO for cleanup paths.
 */
#ifndef MT_STATUS_H
#define MT_STATUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    MT_OK = 0,
    MT_EGENERIC = -1,  /* unspecified failure */
    MT_EINVAL = -2,    /* bad argument or bad input (config, job spec, file) */
    MT_EIO = -3,       /* file system or stream I/O failed */
    MT_ENOMEM = -4,    /* host or device allocation failed */
    MT_ENOTSUP = -5,   /* valid but not supported by this build or backend */
    MT_ECORRUPT = -6,  /* a file's contents fail validation */
    MT_ESTATE = -7,    /* operation illegal in the current state */
    MT_ENOTFOUND = -8, /* a named thing does not exist */
    MT_EINTR = -9,     /* interrupted by a signal or a stop request */
    MT_ECUDA = -10,
    MT_ECUBLAS = -11,
    MT_ECUDNN = -12,
    MT_ENCCL = -13,
    MT_EMPI = -14,
    MT_EHDF5 = -15,
    MT_EGRPC = -16,
    MT_ENUMERIC = -17, /* NaN / Inf or divergence */
};

/* Records "file:line: message" as this thread's last error and returns code. */
int mt_err_at(int code, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Prepends "context: " to this thread's last error message; returns code.
 * Used when an error crosses a module boundary, e.g. "job spec: ". */
int mt_err_wrap(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The last error message of this thread ("" if none). */
const char *mt_errmsg(void);

/* Forget the last error of this thread. */
void mt_err_clear(void);

/* Short name of a status code ("EINVAL"). */
const char *mt_strstatus(int code);

#ifdef __cplusplus
}
#endif

#define MT_ERR(code, ...) mt_err_at((code), __FILE__, __LINE__, __VA_ARGS__)

/* Propagate a negative status. */
#define MT_CHECK(stmt)                                                         \
    do {                                                                       \
        int mt_rc_ = (stmt);                                                   \
        if (mt_rc_ < 0) return mt_rc_;                                         \
    } while (0)

/* Propagate a negative status through a cleanup label; rc must be declared. */
#define MT_GOTO(stmt, label)                                                   \
    do {                                                                       \
        rc = (stmt);                                                           \
        if (rc < 0) goto label;                                                \
    } while (0)

#define MT_CUDA_CHECK(stmt)                                                    \
    do {                                                                       \
        cudaError_t mt_e_ = (stmt);                                            \
        if (mt_e_ != cudaSuccess)                                              \
            return mt_err_at(MT_ECUDA, __FILE__, __LINE__, "%s: %s", #stmt,    \
                             cudaGetErrorString(mt_e_));                       \
    } while (0)

#define MT_CUBLAS_CHECK(stmt)                                                  \
    do {                                                                       \
        cublasStatus_t mt_e_ = (stmt);                                         \
        if (mt_e_ != CUBLAS_STATUS_SUCCESS)                                    \
            return mt_err_at(MT_ECUBLAS, __FILE__, __LINE__, "%s: %s", #stmt,  \
                             cublasGetStatusString(mt_e_));                    \
    } while (0)

#define MT_CUDNN_CHECK(stmt)                                                   \
    do {                                                                       \
        cudnnStatus_t mt_e_ = (stmt);                                          \
        if (mt_e_ != CUDNN_STATUS_SUCCESS)                                     \
            return mt_err_at(MT_ECUDNN, __FILE__, __LINE__, "%s: %s", #stmt,   \
                             cudnnGetErrorString(mt_e_));                      \
    } while (0)

/* HDF5 calls return a negative herr_t or hid_t on failure. */
#define MT_H5_CHECK(stmt)                                                      \
    do {                                                                       \
        if ((stmt) < 0)                                                        \
            return mt_err_at(MT_EHDF5, __FILE__, __LINE__, "%s failed", #stmt);\
    } while (0)

#define MT_GRPC_CHECK(stmt)                                                    \
    do {                                                                       \
        grpc_call_error mt_e_ = (stmt);                                        \
        if (mt_e_ != GRPC_CALL_OK)                                             \
            return mt_err_at(MT_EGRPC, __FILE__, __LINE__, "%s: %s", #stmt,    \
                             grpc_call_error_to_string(mt_e_));                \
    } while (0)

#endif
