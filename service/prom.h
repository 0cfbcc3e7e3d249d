/* prom.h - the /metrics page in the Prometheus text exposition format.
 *
 * Names start with moetrain_, values are in base units (seconds, bytes,
 * ratios), counters end in _total, and labels have few values: the job
 * state, the MoE layer of expert-load gauges, the RPC method and code.
 */
#ifndef MT_PROM_H
#define MT_PROM_H

#include <stddef.h>

#include "service/service.h"

/* The page as a malloc'd string (its length in *len). */
int prom_render(service *svc, char **out, size_t *len);

#endif
