/* mt_fp8.h - scalar number formats: BF16 rounding and FP8 E4M3.
 *
 * These are the rules every backend follows bit for bit (the CUDA kernels use
 * the hardware conversions, which implement the same rounding):
 *  - bf16: round to nearest even, NaN stays NaN.
 *  - e4m3 (OCP "E4M3FN", bias 7, no infinities, max 448): round to nearest
 *    even, saturating: anything beyond +-448 becomes +-448, NaN becomes 0x7f.
 *  - tile scale: s = amax / 448 in float (not rounded to a power of two, as
 *    DeepSeek-V3's released weight_scale_inv); s = 1 for an all-zero tile;
 *    q = e4m3(x / s) with an IEEE division.
 */
#ifndef MT_FP8_H
#define MT_FP8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MT_E4M3_MAX 448.0f
#define MT_QTILE 128 /* quantisation tile edge */

static inline uint32_t mt_f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float mt_bits_f32(uint32_t u)
{
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* float -> bf16 bits, round to nearest even. */
static inline uint16_t mt_bf16_from_f32(float x)
{
    uint32_t u = mt_f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float mt_bf16_to_f32(uint16_t h) { return mt_bits_f32((uint32_t)h << 16); }

/* x rounded to the nearest bf16 value, as a float. */
static inline float mt_bf16_round(float x) { return mt_bf16_to_f32(mt_bf16_from_f32(x)); }

/* float -> e4m3 bits, round to nearest even, saturating to +-448. */
static inline uint8_t mt_e4m3_from_f32(float x)
{
    uint8_t sign = (mt_f32_bits(x) >> 24) & 0x80u;
    if (isnan(x)) return 0x7f | sign;
    float a = fabsf(x);
    if (a >= MT_E4M3_MAX) return sign | 0x7e; /* saturate (infinities too) */
    if (a < 0x1p-6f) {
        /* Subnormal range: multiples of 2^-9; 8 * 2^-9 rounds up to the
         * smallest normal, whose encoding is 8 as well. */
        return sign | (uint8_t)nearbyintf(a * 0x1p9f);
    }
    int e;
    float f = frexpf(a, &e); /* a = f * 2^e, f in [0.5, 1) */
    e -= 1;                  /* a = (2f) * 2^e, 2f in [1, 2) */
    int m = (int)nearbyintf((2.0f * f - 1.0f) * 8.0f);
    if (m == 8) {
        m = 0;
        e += 1;
    }
    int be = e + 7;
    if (be > 15 || (be == 15 && m == 7)) return sign | 0x7e; /* saturate at 448 */
    return sign | (uint8_t)((be << 3) | m);
}

static inline float mt_e4m3_to_f32(uint8_t q)
{
    float sign = (q & 0x80u) ? -1.0f : 1.0f;
    int be = (q >> 3) & 0xf, m = q & 7;
    if (be == 15 && m == 7) return NAN;
    if (be == 0) return sign * (float)m * 0x1p-9f;
    return sign * ldexpf(1.0f + (float)m / 8.0f, be - 7);
}

/* Stochastic rounding to bf16: round up with probability equal to the
 * dropped fraction. rnd: 16 uniform random bits. */
static inline uint16_t mt_bf16_from_f32_sr(float x, uint32_t rnd)
{
    uint32_t u = mt_f32_bits(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return mt_bf16_from_f32(x); /* Inf, NaN */
    u += rnd & 0xffffu;
    return (uint16_t)(u >> 16);
}

/* Stochastic rounding to e4m3 (saturating): one of the two neighbouring
 * values, the upper with probability (|x| - lo) / (hi - lo). u in [0, 1). */
static inline uint8_t mt_e4m3_from_f32_sr(float x, double u)
{
    if (isnan(x)) return mt_e4m3_from_f32(x);
    uint8_t sign = (mt_f32_bits(x) >> 24) & 0x80u;
    float a = fabsf(x);
    uint8_t c = mt_e4m3_from_f32(a); /* nearest; positive codes are monotone */
    if (c == 0x7e && a >= MT_E4M3_MAX) return sign | c;
    float v = mt_e4m3_to_f32(c);
    if (v == a) return sign | c;
    uint8_t lo = v > a ? (uint8_t)(c - 1) : c, hi = (uint8_t)(lo + 1);
    float lv = mt_e4m3_to_f32(lo), hv = mt_e4m3_to_f32(hi);
    double p = ((double)a - lv) / ((double)hv - lv);
    return sign | (u < p ? hi : lo);
}

/* Scale of a tile from its absolute maximum. */
static inline float mt_fp8_scale(float amax)
{
    float s = amax / MT_E4M3_MAX;
    return s > 0.0f ? s : 1.0f; /* zero tile (or amax so small that s underflows) */
}

static inline int mt_ceil_div(int a, int b) { return (a + b - 1) / b; }

#endif
