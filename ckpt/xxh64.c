/* xxh64.c - see xxh64.h (the reference algorithm, little-endian reads). */
#include "ckpt/xxh64.h"

#include <string.h>

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t rd64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* x86-64 and aarch64 Linux are little-endian */
    return v;
}

static inline uint32_t rd32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t round1(uint64_t acc, uint64_t in)
{
    acc += in * P2;
    acc = rotl(acc, 31);
    return acc * P1;
}

static inline uint64_t merge(uint64_t acc, uint64_t v)
{
    acc ^= round1(0, v);
    return acc * P1 + P4;
}

void mt_xxh64_init(mt_xxh64 *h, uint64_t seed)
{
    memset(h, 0, sizeof *h);
    h->seed = seed;
    h->v[0] = seed + P1 + P2;
    h->v[1] = seed + P2;
    h->v[2] = seed;
    h->v[3] = seed - P1;
}

void mt_xxh64_update(mt_xxh64 *h, const void *data, size_t n)
{
    const uint8_t *p = data, *end = p + n;
    h->total += n;
    if (h->nbuf + n < 32) {
        memcpy(h->buf + h->nbuf, p, n);
        h->nbuf += (unsigned)n;
        return;
    }
    if (h->nbuf) {
        size_t k = 32 - h->nbuf;
        memcpy(h->buf + h->nbuf, p, k);
        for (int i = 0; i < 4; i++) h->v[i] = round1(h->v[i], rd64(h->buf + 8 * i));
        p += k;
        h->nbuf = 0;
    }
    uint64_t v0 = h->v[0], v1 = h->v[1], v2 = h->v[2], v3 = h->v[3];
    while (end - p >= 32) {
        v0 = round1(v0, rd64(p));
        v1 = round1(v1, rd64(p + 8));
        v2 = round1(v2, rd64(p + 16));
        v3 = round1(v3, rd64(p + 24));
        p += 32;
    }
    h->v[0] = v0;
    h->v[1] = v1;
    h->v[2] = v2;
    h->v[3] = v3;
    if (p < end) {
        memcpy(h->buf, p, (size_t)(end - p));
        h->nbuf = (unsigned)(end - p);
    }
}

uint64_t mt_xxh64_digest(const mt_xxh64 *h)
{
    uint64_t acc;
    if (h->total >= 32) {
        acc = rotl(h->v[0], 1) + rotl(h->v[1], 7) + rotl(h->v[2], 12) + rotl(h->v[3], 18);
        for (int i = 0; i < 4; i++) acc = merge(acc, h->v[i]);
    } else {
        acc = h->seed + P5;
    }
    acc += h->total;
    const uint8_t *p = h->buf, *end = h->buf + h->nbuf;
    while (end - p >= 8) {
        acc ^= round1(0, rd64(p));
        acc = rotl(acc, 27) * P1 + P4;
        p += 8;
    }
    if (end - p >= 4) {
        acc ^= (uint64_t)rd32(p) * P1;
        acc = rotl(acc, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        acc ^= (*p++) * P5;
        acc = rotl(acc, 11) * P1;
    }
    acc ^= acc >> 33;
    acc *= P2;
    acc ^= acc >> 29;
    acc *= P3;
    acc ^= acc >> 32;
    return acc;
}

uint64_t mt_xxh64_oneshot(const void *data, size_t n, uint64_t seed)
{
    mt_xxh64 h;
    mt_xxh64_init(&h, seed);
    mt_xxh64_update(&h, data, n);
    return mt_xxh64_digest(&h);
}
