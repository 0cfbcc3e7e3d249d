/* tp_comm.h - the model's tensor-parallel table (engine/model/tp.h) over a
 * tp communicator of comm.h. */
#ifndef MT_TP_COMM_H
#define MT_TP_COMM_H

#include "engine/model/tp.h"
#include "engine/parallel/comm.h"

/* tp: the tp group (not owned; it must outlive the table); its memory
 * must be the backend's (host for the cpu backend). sp: sequence
 * parallelism. */
int mt_tp_over_comm(mt_tp **out, mt_comm *tp, const mt_backend *be, int sp);

#endif
