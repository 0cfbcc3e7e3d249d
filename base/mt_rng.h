/* mt_rng.h - deterministic random numbers.
 *
 * Two forms, both reproducible across runs, backends and rank counts:
 *  - mt_rng: a stateful xoshiro256** stream (32 bytes of state, saved in
 *    checkpoints) for sequential draws such as data shuffles;
 *  - mt_hash_u64(seed, counter): a stateless counter-based draw, so that a
 *    value depends only on (seed, index) and not on how work is split. Used
 *    for parameter initialisation and stochastic rounding.
 * And mt_hash_str, an FNV-1a-style hash of a string (tensor name tables).
 */
#ifndef MT_RNG_H
#define MT_RNG_H

#include <math.h>
#include <stdint.h>

typedef struct mt_rng {
    uint64_t s[4];
} mt_rng;

/* splitmix64 finaliser: a bijective mix of 64 bits. */
static inline uint64_t mt_mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static inline uint64_t mt_hash_u64(uint64_t seed, uint64_t counter)
{
    return mt_mix64(mt_mix64(seed) ^ (counter * 0xd1342543de82ef95ULL));
}

/* FNV-1a-style hash of a string (64-bit prime): name tables, host identities. */
static inline uint64_t mt_hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ULL;
    return h;
}

/* Uniform in [0, 1) with 53 random bits. */
static inline double mt_hash_uniform(uint64_t seed, uint64_t counter)
{
    return (double)(mt_hash_u64(seed, counter) >> 11) * 0x1.0p-53;
}

/* Standard normal by Box-Muller from two counter draws (2*counter, 2*counter+1). */
static inline double mt_hash_normal(uint64_t seed, uint64_t counter)
{
    double u1 = mt_hash_uniform(seed, 2 * counter);
    double u2 = mt_hash_uniform(seed, 2 * counter + 1);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static inline void mt_rng_seed(mt_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++) r->s[i] = mt_hash_u64(seed, (uint64_t)i);
}

static inline uint64_t mt_rng_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t mt_rng_u64(mt_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = mt_rng_rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = mt_rng_rotl(s[3], 45);
    return result;
}

static inline double mt_rng_uniform(mt_rng *r) { return (double)(mt_rng_u64(r) >> 11) * 0x1.0p-53; }

/* Uniform integer in [0, n) without modulo bias (Lemire's method). n > 0. */
static inline uint64_t mt_rng_below(mt_rng *r, uint64_t n)
{
    unsigned __int128 m = (unsigned __int128)mt_rng_u64(r) * n;
    uint64_t lo = (uint64_t)m;
    if (lo < n) {
        uint64_t thresh = (0 - n) % n;
        while (lo < thresh) {
            m = (unsigned __int128)mt_rng_u64(r) * n;
            lo = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

/* Fisher-Yates shuffle of an int64 array. */
static inline void mt_rng_shuffle_i64(mt_rng *r, int64_t *a, int64_t n)
{
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)mt_rng_below(r, (uint64_t)i + 1);
        int64_t t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

#endif
