/* mt_status.c - thread-local last-error message (like errno, with text). */
#include "base/mt_status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define MT_ERRMSG_CAP 2048

static _Thread_local char errbuf[MT_ERRMSG_CAP];

int mt_err_at(int code, const char *file, int line, const char *fmt, ...)
{
    const char *base = strrchr(file, '/');
    int n = snprintf(errbuf, sizeof errbuf, "%s:%d: ", base ? base + 1 : file, line);
    if (n < 0 || (size_t)n >= sizeof errbuf) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf + n, sizeof errbuf - (size_t)n, fmt, ap);
    va_end(ap);
    return code;
}

int mt_err_wrap(int code, const char *fmt, ...)
{
    char prefix[512], old[MT_ERRMSG_CAP];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, errbuf, sizeof old);
    snprintf(errbuf, sizeof errbuf, "%s: %s", prefix, old);
    return code;
}

const char *mt_errmsg(void) { return errbuf; }

void mt_err_clear(void) { errbuf[0] = '\0'; }

const char *mt_strstatus(int code)
{
    switch (code) {
    case MT_OK: return "OK";
    case MT_EGENERIC: return "EGENERIC";
    case MT_EINVAL: return "EINVAL";
    case MT_EIO: return "EIO";
    case MT_ENOMEM: return "ENOMEM";
    case MT_ENOTSUP: return "ENOTSUP";
    case MT_ECORRUPT: return "ECORRUPT";
    case MT_ESTATE: return "ESTATE";
    case MT_ENOTFOUND: return "ENOTFOUND";
    case MT_EINTR: return "EINTR";
    case MT_ECUDA: return "ECUDA";
    case MT_ECUBLAS: return "ECUBLAS";
    case MT_ECUDNN: return "ECUDNN";
    case MT_ENCCL: return "ENCCL";
    case MT_EMPI: return "EMPI";
    case MT_EHDF5: return "EHDF5";
    case MT_EGRPC: return "EGRPC";
    case MT_ENUMERIC: return "ENUMERIC";
    default: return "E?";
    }
}
