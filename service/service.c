/* service.c - the shared state of rank 0's service threads. */
#include "service/service.h"

#include <stdlib.h>
#include <string.h>

#include "api/api_descriptors.h"
#include "base/mt_status.h"

int service_init(service *s, control *ctl, metrics_hub *hub, const char *workdir)
{
    memset(s, 0, sizeof *s);
    s->ctl = ctl;
    s->hub = hub;
    s->workdir = workdir;
    atomic_init(&s->serving, 1);
    atomic_init(&s->subscribers, 0);
    rpc_methods(&s->n_methods);
    s->calls = calloc((size_t)s->n_methods * RPC_N_CODES, sizeof *s->calls);
    if (!s->calls) return MT_ERR(MT_ENOMEM, "service: out of memory");
    for (int i = 0; i < s->n_methods * RPC_N_CODES; i++) atomic_init(&s->calls[i], 0);
    int rc = reflection_create(&s->refl, mt_api_descriptor_set, mt_api_descriptor_set_len);
    if (rc < 0) {
        free(s->calls);
        return rc;
    }
    return MT_OK;
}

void service_cleanup(service *s)
{
    reflection_destroy(s->refl);
    free(s->calls);
    memset(s, 0, sizeof *s);
}

int service_serving(const service *s)
{
    return atomic_load(&s->serving) && !(s->term && *s->term);
}

void service_count_call(service *s, const rpc_method *m, int code)
{
    int n;
    const rpc_method *t = rpc_methods(&n);
    if (!m || m < t || m >= t + n || code < 0 || code >= RPC_N_CODES) return;
    atomic_fetch_add(&s->calls[(m - t) * RPC_N_CODES + code], 1);
}
