/* exit_status.c - see exit_status.h. */
#include "service/exit_status.h"

#include "base/mt_status.h"

int mt_exit_status(int rc)
{
    if (rc >= 0) return MT_EXIT_OK;
    switch (rc) {
    case MT_EINTR: /* SIGTERM without a checkpoint */
    case MT_EMPI:  /* a peer rank is gone or the transport failed */
    case MT_ENCCL:
        return MT_EXIT_RESTART;
    default: return MT_EXIT_FAILED;
    }
}
