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

/* ---- x / s without a division per element --------------------------------
 * A tile of 128 (or 128 x 128) values shares one scale s, and the optimizer
 * divides every element by the same bias corrections; an IEEE division per
 * element costs a GPU more than the bytes those kernels move. With
 * r = 1 / s rounded to nearest, computed once,
 *   q = x r;  q += (x - q s) r;  q += (x - q s) r   (each line fused multiply-adds)
 * is x / s rounded to nearest, the same float as the division: after the
 * first correction q is within an ulp of x / s, so the residual x - q s is
 * exact and the second correction rounds correctly (Markstein's theorem for
 * a correctly rounded reciprocal). That needs no underflow or overflow
 * anywhere: s in [2^-60, 2^60] (`fast`) and s 2^-40 <= |x| <= s 2^60, so
 * that |x / s| is in [2^-40, 2^60] and |x| >= 2^-100; everything else
 * divides (mt_div_rn) - or, for e4m3 codes (mt_fp8_div, |x| <= 448 s by
 * the scale's definition), |x| < s 2^-40 takes x r, whose code is the
 * signed zero of x / s (under 2^-40, far below e4m3's smallest 2^-9).
 * tests/test_ops_fp8.c checks both against the division. */
#if defined(__CUDACC__)
#define MT_FP8_HD __host__ __device__
#else
#define MT_FP8_HD
#endif

typedef struct mt_divisor {
    float s, r;      /* divisor, 1 / s rounded to nearest */
    float lo, hi;    /* s 2^-40, s 2^60: the |x| of the exact fast path */
    int fast;        /* s in [2^-60, 2^60] */
} mt_divisor;

static inline MT_FP8_HD mt_divisor mt_divisor_of(float s)
{
    mt_divisor d;
    d.s = s;
    d.fast = s >= 0x1p-60f && s <= 0x1p60f; /* false for NaN */
    d.r = d.fast ? 1.0f / s : 0.0f;         /* IEEE division: rounded to nearest */
    d.lo = s * 0x1p-40f;
    d.hi = s * 0x1p60f;
    return d;
}

static inline MT_FP8_HD float mt_div_corrected(float x, mt_divisor d)
{
    float q = x * d.r;
    q = fmaf(fmaf(-q, d.s, x), d.r, q);
    return fmaf(fmaf(-q, d.s, x), d.r, q);
}

/* x / d.s rounded to nearest, for any x (zeros, NaN, Inf and extremes divide). */
static inline MT_FP8_HD float mt_div_rn(float x, mt_divisor d)
{
    const float a = fabsf(x);
    if (!d.fast || !(a >= d.lo && a <= d.hi)) return x / d.s;
    return mt_div_corrected(x, d);
}

/* x / d.s for e4m3 encoding, |x| <= 448 d.s (a tile's values over its
 * scale): the quotient rounded to nearest, or below d.lo a float of the
 * same e4m3 code. */
static inline MT_FP8_HD float mt_fp8_div(float x, mt_divisor d)
{
    if (!d.fast) return x / d.s;
    if (fabsf(x) < d.lo) return x * d.r; /* NaN goes on: NaN either way */
    return mt_div_corrected(x, d);
}


#endif
