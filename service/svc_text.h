/* svc_text.h - error text for clients. */
#ifndef MT_SVC_TEXT_H
#define MT_SVC_TEXT_H

#include <stddef.h>

/* Copies an error message without its "file.c:123: " source locations:
 * they help the log's reader, not a client. */
void svc_strip_locations(const char *in, char *out, size_t cap);

#endif
