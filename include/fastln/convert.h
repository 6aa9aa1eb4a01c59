/* Scalar conversions between the half formats - float16 (IEEE binary16) and bfloat16 - and
 * float32, as integer bit arithmetic written as branch-free selects: the same bits on every
 * machine, with no F16C, AVX-512-FP16 or _Float16 library call. Exact from half to float32;
 * round to nearest even from float32, exactly as NumPy's astype(np.float16) and ml_dtypes'
 * astype(bfloat16) round. The kernels use them for single elements and, on targets without
 * F16C, lane by lane (fastln/isa.h). Halves travel as uint16_t. */
#ifndef FASTLN_CONVERT_H
#define FASTLN_CONVERT_H

#include <stdint.h>
#include <string.h>
#include "fastln/simd.h"

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
FASTLN_INLINE float fastln_float16_to_float(uint16_t half)
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
FASTLN_INLINE uint16_t fastln_float_to_float16(float value)
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
FASTLN_INLINE float fastln_bfloat16_to_float(uint16_t half)
{
    return fastln_bits_float((uint32_t)half << 16);
}

/* float32 -> bfloat16, round to nearest even (overflow rounds to Inf by the carry); NaN becomes
 * the quiet NaN 0x7fc0 with its sign, as ml_dtypes (Eigen) does. */
FASTLN_INLINE uint16_t fastln_float_to_bfloat16(float value)
{
    const uint32_t bits = fastln_float_bits(value);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t nan = ((bits >> 16) & 0x8000u) | 0x7fc0u;
    return (uint16_t)fastln_select_u32((bits & 0x7fffffffu) > 0x7f800000u, nan, rounded);
}

#endif /* FASTLN_CONVERT_H */
