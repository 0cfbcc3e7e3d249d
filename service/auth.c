/* auth.c - see auth.h. */
#define _POSIX_C_SOURCE 200809L
#include "service/auth.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "base/mt_log.h"
#include "base/mt_status.h"

int auth_read_token(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f) return MT_ERR(MT_EIO, "token file %s: %s", path, strerror(errno));
    char line[AUTH_TOKEN_CAP + 2];
    if (!fgets(line, sizeof line, f)) line[0] = '\0';
    fclose(f);
    char *s = line;
    while (isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
    if (n < 16) return MT_ERR(MT_EINVAL, "token file %s: the token needs 16 characters or more", path);
    if (n + 1 > cap || n >= AUTH_TOKEN_CAP)
        return MT_ERR(MT_EINVAL, "token file %s: token longer than %d characters", path,
                      AUTH_TOKEN_CAP - 1);
    for (size_t i = 0; i < n; i++)
        if (!isgraph((unsigned char)s[i]))
            return MT_ERR(MT_EINVAL, "token file %s: the token must be printable, no spaces",
                          path);
    memcpy(buf, s, n + 1);
    return MT_OK;
}

int auth_load(auth *a, const char *path)
{
    memset(a, 0, sizeof *a);
    MT_CHECK(auth_read_token(path, a->token, sizeof a->token));
    a->len = strlen(a->token);
    a->enabled = 1;
    struct stat st;
    /* A token others can read is no secret; say so, but a mode is the
     * operator's call. */
    if (stat(path, &st) == 0 && (st.st_mode & 077))
        MT_LOGW("token file %s is readable by group or others (mode %03o)", path,
                (unsigned)(st.st_mode & 0777));
    return MT_OK;
}

int auth_check(const auth *a, const char *header, size_t len)
{
    if (!a || !a->enabled) return 1;
    static const char prefix[] = "Bearer ";
    const size_t np = sizeof prefix - 1;
    if (!header || len != np + a->len) return 0;
    unsigned char diff = 0;
    for (size_t i = 0; i < np; i++) diff |= (unsigned char)(header[i] ^ prefix[i]);
    for (size_t i = 0; i < a->len; i++) diff |= (unsigned char)(header[np + i] ^ a->token[i]);
    return diff == 0;
}
