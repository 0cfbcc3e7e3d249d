/* web_assets.h - the dashboard's files (service/web/), compiled into the
 * binary by service/web/embed.cmake: a table of URL path, content type and
 * bytes, served by http_dashboard.c. */
#ifndef MT_WEB_ASSETS_H
#define MT_WEB_ASSETS_H

#include <stddef.h>

typedef struct web_asset {
    const char *url;          /* "/", "/assets/dashboard.js", ... */
    const char *type;         /* Content-Type */
    const unsigned char *data;
    size_t len;
} web_asset;

extern const web_asset web_assets[];
extern const int web_assets_n;

/* The asset served at `url`, or NULL. */
const web_asset *web_asset_find(const char *url);

#endif
