/* xxh64.h - XXH64 (Yann Collet's xxHash, 64-bit), one-shot and streaming.
 *
 * The per-piece checksum of checkpoints (FORMAT.md): seed 0, over the
 * piece's bytes in row-major order. Streaming over consecutive row bands
 * gives the same value as one call over the whole piece.
 */
#ifndef MT_XXH64_H
#define MT_XXH64_H

#include <stddef.h>
#include <stdint.h>

typedef struct mt_xxh64 {
    uint64_t v[4];
    uint64_t total;
    uint8_t buf[32];
    unsigned nbuf;
    uint64_t seed;
} mt_xxh64;

void mt_xxh64_init(mt_xxh64 *h, uint64_t seed);
void mt_xxh64_update(mt_xxh64 *h, const void *data, size_t n);
uint64_t mt_xxh64_digest(const mt_xxh64 *h);
uint64_t mt_xxh64_oneshot(const void *data, size_t n, uint64_t seed);

#endif
