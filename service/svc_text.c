/* svc_text.c - see svc_text.h. */
#include "service/svc_text.h"

#include <ctype.h>

void svc_strip_locations(const char *in, char *out, size_t cap)
{
    size_t o = 0;
    for (const char *s = in; *s && o + 1 < cap;) {
        const char *p = s;
        while (isalnum((unsigned char)*p) || *p == '_' || *p == '-') p++;
        if (p > s && *p == '.' && isalpha((unsigned char)p[1])) {
            const char *q = p + 1;
            while (isalpha((unsigned char)*q)) q++;
            if (*q == ':' && isdigit((unsigned char)q[1])) {
                q++;
                while (isdigit((unsigned char)*q)) q++;
                if (q[0] == ':' && q[1] == ' ') {
                    s = q + 2;
                    continue;
                }
            }
        }
        out[o++] = *s++;
    }
    out[o] = '\0';
}
