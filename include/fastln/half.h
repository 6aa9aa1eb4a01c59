/* Half-precision rows: float16 (IEEE binary16) and bfloat16 <-> float32, one row at a time.
 *
 * fastln computes half-precision inputs with its float32 row kernels: each row is widened to a
 * float32 scratch row (exact: every float16 and bfloat16 value is a float32 value), normalized,
 * and the float32 result is rounded back to the half format, round-to-nearest-even, exactly as
 * NumPy's astype(np.float16) and ml_dtypes' astype(bfloat16) round. No full-size float32 array
 * is ever made.
 *
 * The conversions are integer bit arithmetic written as branch-free selects, so the loops
 * vectorize on every instruction set (no F16C, AVX-512-FP16 or _Float16 library calls needed),
 * and they give the same bits on every machine. Halves are passed as uint16_t. */
#ifndef FASTLN_HALF_H
#define FASTLN_HALF_H

#include <stdint.h>
#include <string.h>
#include "fastln/common.h"

FASTLN_INLINE uint32_t fastln_float_bits(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

FASTLN_INLINE float fastln_bits_float(uint32_t bits)
{
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* cond ? a : b as mask arithmetic: the baseline (SSE2) vectorizer does not if-convert nested
 * selects, but it vectorizes this. */
FASTLN_INLINE uint32_t fastln_select_u32(int cond, uint32_t a, uint32_t b)
{
    const uint32_t mask = (uint32_t)0 - (uint32_t)(cond != 0);
    return (a & mask) | (b & ~mask);
}

/* float16 -> float32, exact. The exponent is rebiased (15 -> 127); Inf/NaN get the maximal
 * exponent; zeros and subnormals are formed as (2^-14 * (1 + m / 1024)) - 2^-14 in float32, which
 * is exact (F. Giesen's half_to_float). */
FASTLN_INLINE float fastln_f16_to_f32(uint16_t half)
{
    const uint32_t shifted_exponent = 0x7c00u << 13;
    const uint32_t magnitude = ((uint32_t)half & 0x7fffu) << 13;
    const uint32_t exponent = magnitude & shifted_exponent;
    const uint32_t normal = magnitude + ((uint32_t)(127 - 15) << 23);
    const uint32_t inf_nan = normal + ((uint32_t)(128 - 16) << 23);
    const uint32_t subnormal = fastln_float_bits(
        fastln_bits_float(normal + (1u << 23)) - fastln_bits_float(113u << 23));
    const uint32_t bits = fastln_select_u32(
        exponent == shifted_exponent, inf_nan, fastln_select_u32(exponent == 0, subnormal, normal));
    return fastln_bits_float(bits | (((uint32_t)half & 0x8000u) << 16));
}

/* float32 -> float16, round to nearest even; overflow gives Inf; NaN stays NaN with the top
 * mantissa bits kept (as NumPy does: npy_floatbits_to_halfbits). */
FASTLN_INLINE uint16_t fastln_f32_to_f16(float value)
{
    const uint32_t bits = fastln_float_bits(value);
    const uint32_t sign = (bits >> 16) & 0x8000u;
    const uint32_t magnitude = bits & 0x7fffffffu;
    /* NaN: keep the top 10 mantissa bits, but never let them all be 0 (that would be Inf). */
    const uint32_t nan_mantissa = (magnitude >> 13) & 0x3ffu;
    const uint32_t nan = 0x7c00u | nan_mantissa | (uint32_t)(nan_mantissa == 0);
    /* Subnormal halves (and zero): adding 0.5 makes float32 addition do the rounding; the
     * result's low mantissa bits are the half's. */
    const float subnormal_magic = fastln_bits_float((uint32_t)((127 - 15) + (23 - 10) + 1) << 23);
    const uint32_t subnormal = fastln_float_bits(fastln_bits_float(magnitude) + subnormal_magic)
                               - fastln_float_bits(subnormal_magic);
    /* Normal halves: rebias, then round the 13 dropped bits to nearest even; a carry out of the
     * mantissa bumps the exponent, up to Inf (0x7c00) exactly when the value rounds past 65504. */
    const uint32_t odd = (magnitude >> 13) & 1u;
    const uint32_t normal = (magnitude + ((uint32_t)(15 - 127) << 23) + 0xfffu + odd) >> 13;
    const uint32_t result = fastln_select_u32(
        magnitude > 0x7f800000u, nan,
        fastln_select_u32(magnitude >= ((uint32_t)(127 + 16) << 23), 0x7c00u,
                          fastln_select_u32(magnitude < (113u << 23), subnormal, normal)));
    return (uint16_t)(result | sign);
}

/* bfloat16 -> float32, exact: bfloat16 is the top half of a float32. */
FASTLN_INLINE float fastln_bf16_to_f32(uint16_t half)
{
    return fastln_bits_float((uint32_t)half << 16);
}

/* float32 -> bfloat16, round to nearest even (overflow rounds to Inf by the carry); NaN becomes
 * the quiet NaN 0x7fc0 with its sign, as ml_dtypes (Eigen) does. */
FASTLN_INLINE uint16_t fastln_f32_to_bf16(float value)
{
    const uint32_t bits = fastln_float_bits(value);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t nan = ((bits >> 16) & 0x8000u) | 0x7fc0u;
    return (uint16_t)fastln_select_u32((bits & 0x7fffffffu) > 0x7f800000u, nan, rounded);
}

/* Rows. `kind` is FASTLN_FLOAT16 or FASTLN_BFLOAT16. */
enum { FASTLN_FLOAT16 = 0, FASTLN_BFLOAT16 = 1 };

FASTLN_DISPATCH
static void fastln_half_to_float_row(const uint16_t *FASTLN_RESTRICT src,
                                     float *FASTLN_RESTRICT dst, int64_t n, int kind)
{
    if (kind == FASTLN_BFLOAT16) {
        for (int64_t i = 0; i < n; i++) dst[i] = fastln_bf16_to_f32(src[i]);
    } else {
        for (int64_t i = 0; i < n; i++) dst[i] = fastln_f16_to_f32(src[i]);
    }
}

FASTLN_DISPATCH
static void fastln_float_to_half_row(const float *FASTLN_RESTRICT src,
                                     uint16_t *FASTLN_RESTRICT dst, int64_t n, int kind)
{
    if (kind == FASTLN_BFLOAT16) {
        for (int64_t i = 0; i < n; i++) dst[i] = fastln_f32_to_bf16(src[i]);
    } else {
        for (int64_t i = 0; i < n; i++) dst[i] = fastln_f32_to_f16(src[i]);
    }
}

/* The residual sum of the fused add + norm for half rows:
 *     s = x + residual (+ bias)
 * in double (exact for two halves), rounded to float32 and then to the half format - which is
 * exactly what NumPy's float16 x + residual does (it adds in float32) - written to s_half, and
 * the rounded s widened back into s_float (the row the normalization then reads, so that y is
 * bitwise the normalization of the returned s). x and residual come in already widened (they
 * may be s_float itself: each element is read before it is written). bias may be NULL. */
FASTLN_DISPATCH
static void fastln_half_sum_row(const float *x, const float *residual,
                                const float *FASTLN_RESTRICT bias, uint16_t *FASTLN_RESTRICT s_half,
                                float *s_float, int64_t n, int kind)
{
    /* Three short passes over a row in cache, each a plain vectorizable loop. */
    if (bias) {
        for (int64_t i = 0; i < n; i++)
            s_float[i] = (float)(((double)x[i] + (double)residual[i]) + (double)bias[i]);
    } else {
        for (int64_t i = 0; i < n; i++)
            s_float[i] = (float)((double)x[i] + (double)residual[i]);
    }
    if (kind == FASTLN_BFLOAT16) {
        for (int64_t i = 0; i < n; i++) s_half[i] = fastln_f32_to_bf16(s_float[i]);
        for (int64_t i = 0; i < n; i++) s_float[i] = fastln_bf16_to_f32(s_half[i]);
    } else {
        for (int64_t i = 0; i < n; i++) s_half[i] = fastln_f32_to_f16(s_float[i]);
        for (int64_t i = 0; i < n; i++) s_float[i] = fastln_f16_to_f32(s_half[i]);
    }
}

#endif /* FASTLN_HALF_H */
