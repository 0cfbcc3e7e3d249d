/* auth.h - bearer-token authorization of mutating RPCs.
 *
 * With a token configured (moetraind --token-file), a mutating call must
 * carry the metadata "authorization: Bearer <token>". The token file holds
 * the token on its first line; surrounding white space is ignored.
 */
#ifndef MT_AUTH_H
#define MT_AUTH_H

#include <stddef.h>

#define AUTH_TOKEN_CAP 512

typedef struct auth {
    int enabled;
    char token[AUTH_TOKEN_CAP];
    size_t len;
} auth;

/* Reads the token (16..511 printable characters, no spaces). */
int auth_load(auth *a, const char *path);

/* Reads a token file into buf (the CLI side of the same format). */
int auth_read_token(const char *path, char *buf, size_t cap);

/* 1 when the call may proceed: auth disabled, or `header` (the
 * authorization metadata value, not NUL-terminated) is "Bearer <token>".
 * Compares in time independent of where the token differs. */
int auth_check(const auth *a, const char *header, size_t len);

#endif
