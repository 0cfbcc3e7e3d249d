/* mpi_check.h - the checks of the multi-rank tests (label mpi).
 *
 * CHECK(cond, fmt, ...) names the rank, file and line of a failed property
 * and counts it in `failures`; the test ends with every rank agreeing on
 * failures == 0. die() ends every rank at once: a rank that cannot go on
 * would leave the others waiting in a collective. Each test sets rank_ once
 * MPI knows it. Included once, by the test's own .c file.
 */
#ifndef MT_TESTS_MPI_CHECK_H
#define MT_TESTS_MPI_CHECK_H

#include <stdio.h>

#include <mpi.h>

#include "base/mt_status.h"

static int failures, rank_;

#define CHECK(cond, ...)                                                                 \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "rank %d: FAIL %s:%d: ", rank_, __FILE__, __LINE__);         \
            fprintf(stderr, __VA_ARGS__);                                                \
            fprintf(stderr, "\n");                                                       \
            failures++;                                                                  \
        }                                                                                \
    } while (0)

static void die(const char *what, int rc)
{
    fprintf(stderr, "rank %d: %s: %d %s\n", rank_, what, rc, mt_errmsg());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

#endif
