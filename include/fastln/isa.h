/* One instruction-set variant of the kernels: the vector layer for the current target, then
 * every kernel template for every storage type (bfloat16 alone when FASTLN_ISA_BFLOAT16_ONLY).
 * fastln/kernels.h includes this file once per variant, inside a `#pragma GCC target` region,
 * with FASTLN_ISA_SUFFIX set (_v4bf16, _v4, _v3, _base); the target's macros (__AVX512F__,
 * __AVX512BF16__, __AVX2__, __F16C__) choose the native vector width and the conversion
 * instructions below. No include guard on purpose.
 *
 * The arithmetic is the same in every variant, operation for operation (no fused multiply-adds:
 * -ffp-contract=off), and every sum keeps its slot order (fastln/simd.h): the variants give the
 * same bits. */

#define FASTLN_ISA(name) FASTLN_XPASTE(fastln_##name, FASTLN_ISA_SUFFIX)

#if defined(__AVX512F__)
#define FASTLN_VF fastln_f32x16
#define FASTLN_VD fastln_f64x8
#define FASTLN_VU32 fastln_u32x16
#define FASTLN_VF_LANES 16
#elif defined(__AVX2__)
#define FASTLN_VF fastln_f32x8
#define FASTLN_VD fastln_f64x4
#define FASTLN_VU32 fastln_u32x8
#define FASTLN_VF_LANES 8
#else
#define FASTLN_VF fastln_f32x4
#define FASTLN_VD fastln_f64x2
#define FASTLN_VU32 fastln_u32x4
#define FASTLN_VF_LANES 4
#endif
#define FASTLN_VD_LANES (FASTLN_VF_LANES / 2)

/* A sum's pass keeps FASTLN_PASS_VECTORS accumulators of FASTLN_VD_LANES slots: all 32 slots in
 * one pass with AVX-512; two passes of 16 slots with AVX2 and four of 8 with SSE2, each over the
 * whole row, so that a pass's accumulators (two or three sums of them) fit the 16 registers
 * those have. Each slot still adds its elements in row order. */
#define FASTLN_PASS_VECTORS 4
#define FASTLN_PASS_SLOTS (FASTLN_PASS_VECTORS * FASTLN_VD_LANES)
/* The same for float accumulators (fastln/simd.h, FASTLN_FLOAT_RUN): all 32 slots in one pass
 * with AVX-512 (two vectors) and AVX2 (four), two passes of 16 with SSE2. */
#define FASTLN_FLOAT_PASS_SLOTS (4 * FASTLN_VF_LANES < FASTLN_SLOTS ? 4 * FASTLN_VF_LANES : FASTLN_SLOTS)
#define FASTLN_FLOAT_PASS_VECTORS (FASTLN_FLOAT_PASS_SLOTS / FASTLN_VF_LANES)

FASTLN_INLINE FASTLN_VF FASTLN_ISA(load_f32)(const float *p)
{
    FASTLN_VF v;
    memcpy(&v, p, sizeof v);
    return v;
}

FASTLN_INLINE void FASTLN_ISA(store_f32)(float *p, FASTLN_VF v)
{
    memcpy(p, &v, sizeof v);
}

FASTLN_INLINE FASTLN_VD FASTLN_ISA(load_f64)(const double *p)
{
    FASTLN_VD v;
    memcpy(&v, p, sizeof v);
    return v;
}

FASTLN_INLINE void FASTLN_ISA(store_f64)(double *p, FASTLN_VD v)
{
    memcpy(p, &v, sizeof v);
}

/* The low and high halves of a float vector, widened to double (exact). */
FASTLN_INLINE FASTLN_VD FASTLN_ISA(widen_low)(FASTLN_VF v)
{
#if defined(__AVX512F__)
    return (FASTLN_VD)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)v));
#elif defined(__AVX2__)
    return (FASTLN_VD)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)v));
#elif defined(__x86_64__)
    return (FASTLN_VD)_mm_cvtps_pd((__m128)v);
#else
    return (FASTLN_VD){v[0], v[1]};
#endif
}

FASTLN_INLINE FASTLN_VD FASTLN_ISA(widen_high)(FASTLN_VF v)
{
#if defined(__AVX512F__)
    return (FASTLN_VD)_mm512_cvtps_pd(
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)v), 1)));
#elif defined(__AVX2__)
    return (FASTLN_VD)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)v, 1));
#elif defined(__x86_64__)
    return (FASTLN_VD)_mm_cvtps_pd(_mm_movehl_ps((__m128)v, (__m128)v));
#else
    return (FASTLN_VD){v[2], v[3]};
#endif
}

/* Two double vectors rounded to float (to nearest even) into one float vector. */
FASTLN_INLINE FASTLN_VF FASTLN_ISA(narrow_pair)(FASTLN_VD low, FASTLN_VD high)
{
#if defined(__AVX512F__)
    return (FASTLN_VF)_mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(_mm512_cvtpd_ps((__m512d)low))),
        _mm256_castps_pd(_mm512_cvtpd_ps((__m512d)high)), 1));
#elif defined(__AVX2__)
    return (FASTLN_VF)_mm256_insertf128_ps(
        _mm256_castps128_ps256(_mm256_cvtpd_ps((__m256d)low)), _mm256_cvtpd_ps((__m256d)high), 1);
#elif defined(__x86_64__)
    return (FASTLN_VF)_mm_movelh_ps(_mm_cvtpd_ps((__m128d)low), _mm_cvtpd_ps((__m128d)high));
#else
    return (FASTLN_VF){(float)low[0], (float)low[1], (float)high[0], (float)high[1]};
#endif
}

/* Whether any lane of any of the n vectors at v is Inf or NaN (its exponent bits all set): one
 * test for a group of vectors. */
FASTLN_INLINE int FASTLN_ISA(any_not_finite_of)(const FASTLN_VF *v, int n)
{
#if defined(__AVX512F__)
    __mmask16 special = 0;
    for (int i = 0; i < n; i++)
        special |= _mm512_fpclass_ps_mask((__m512)v[i], FASTLN_CLASS_NAN | FASTLN_CLASS_INF);
    return special != 0;
#else
    FASTLN_VU32 special = {0};
    for (int i = 0; i < n; i++) {
        const FASTLN_VU32 exponent = (FASTLN_VU32)v[i] & 0x7f800000u;
        special |= (FASTLN_VU32)(exponent == 0x7f800000u);
    }
#if defined(__AVX2__)
    return !_mm256_testz_si256((__m256i)special, (__m256i)special);
#elif defined(__x86_64__)
    return _mm_movemask_ps((__m128)special) != 0;
#else
    int any = 0;
    for (int l = 0; l < FASTLN_VF_LANES; l++) any |= special[l] != 0;
    return any;
#endif
#endif
}

/* Whether any lane of v is Inf or NaN. */
FASTLN_INLINE int FASTLN_ISA(any_not_finite)(FASTLN_VF v)
{
    return FASTLN_ISA(any_not_finite_of)(&v, 1);
}

/* float16 <-> float32 for a vector: F16C's conversions where the target has them (AVX2 and
 * AVX-512 targets do), else the portable bit arithmetic of fastln/convert.h lane by lane on
 * integer vectors. Both are exact one way and round to nearest even the other, as NumPy's
 * astype does (computed values are never signalling NaNs, the one case where they differ). */
FASTLN_INLINE FASTLN_VF FASTLN_ISA(load_float16)(const uint16_t *p)
{
#if defined(__AVX512F__)
    return (FASTLN_VF)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__) && defined(__F16C__)
    return (FASTLN_VF)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    FASTLN_VF v;
    for (int k = 0; k < FASTLN_VF_LANES; k++) v[k] = fastln_float16_to_float(p[k]);
    return v;
#endif
}

FASTLN_INLINE void FASTLN_ISA(store_float16)(uint16_t *p, FASTLN_VF v)
{
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__AVX2__) && defined(__F16C__)
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#else
    for (int k = 0; k < FASTLN_VF_LANES; k++) p[k] = fastln_float_to_float16(v[k]);
#endif
}

/* One float16 element either way, as the vector conversions do it. */
FASTLN_INLINE float FASTLN_ISA(float16_to_float)(uint16_t half)
{
#if defined(__F16C__)
    return _cvtsh_ss(half);
#else
    return fastln_float16_to_float(half);
#endif
}

FASTLN_INLINE uint16_t FASTLN_ISA(float_to_float16)(float value)
{
#if defined(__F16C__)
    return _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);
#else
    return fastln_float_to_float16(value);
#endif
}

/* bfloat16 is the top half of a float32: widening is a shift, narrowing rounds the low half
 * away (to nearest even, NaN to the quiet NaN 0x7fc0 with its sign, as ml_dtypes does). Integer
 * vector arithmetic, the same on every target. */
FASTLN_INLINE FASTLN_VF FASTLN_ISA(load_bfloat16)(const uint16_t *p)
{
#if defined(__AVX512F__)
    return (FASTLN_VF)_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
    return (FASTLN_VF)_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#elif defined(__x86_64__)
    /* each half below a zero half: the 32-bit lane is half << 16 */
    return (FASTLN_VF)_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p));
#else
    FASTLN_VU32 bits;
    for (int k = 0; k < FASTLN_VF_LANES; k++) bits[k] = (uint32_t)p[k] << 16;
    FASTLN_VF v;
    memcpy(&v, &bits, sizeof v);
    return v;
#endif
}

/* Whether any lane of v is a NaN. */
FASTLN_INLINE int FASTLN_ISA(any_nan)(FASTLN_VF v)
{
#if defined(__AVX512F__)
    return _mm512_fpclass_ps_mask((__m512)v, FASTLN_CLASS_NAN) != 0;
#elif defined(__AVX2__)
    const __m256 unordered = _mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q);
    return !_mm256_testz_ps(unordered, unordered);
#elif defined(__x86_64__)
    return _mm_movemask_ps(_mm_cmpunord_ps((__m128)v, (__m128)v)) != 0;
#else
    int any = 0;
    for (int l = 0; l < FASTLN_VF_LANES; l++) any |= v[l] != v[l];
    return any;
#endif
}

/* store_bfloat16's rounding in integer arithmetic: each lane's bfloat16 in its low half. A NaN
 * lane would round like a large number (and could carry into the sign): it becomes the quiet
 * NaN 0x7fc0 with its sign. */
FASTLN_INLINE FASTLN_VU32 FASTLN_ISA(bfloat16_bits)(FASTLN_VF v)
{
    FASTLN_VU32 bits;
    memcpy(&bits, &v, sizeof bits);
    const FASTLN_VU32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const FASTLN_VU32 nan = ((bits >> 16) & 0x8000u) | 0x7fc0u;
    const FASTLN_VU32 is_nan = (FASTLN_VU32)((bits & 0x7fffffffu) > 0x7f800000u);
    return (nan & is_nan) | (rounded & ~is_nan);
}

/* The rare vectors of store_bfloat16 (a NaN lane; with vcvtneps2bf16, also a subnormal one),
 * out of line to keep them out of the loops that store. */
#if defined(__AVX512BF16__)
FASTLN_OUTLINED __m256i FASTLN_ISA(bfloat16_rare)(FASTLN_VF v)
{
    return _mm512_cvtepi32_epi16((__m512i)FASTLN_ISA(bfloat16_bits)(v));
}
#else
FASTLN_OUTLINED FASTLN_VU32 FASTLN_ISA(bfloat16_rare)(FASTLN_VF v)
{
    return FASTLN_ISA(bfloat16_bits)(v);
}
#endif

FASTLN_INLINE void FASTLN_ISA(store_bfloat16)(uint16_t *p, FASTLN_VF v)
{
#if defined(__AVX512BF16__)
    /* vcvtneps2bf16 rounds to nearest even in one instruction, but it flushes subnormals to
     * zero and keeps a NaN's payload: vectors with either are rounded in integer arithmetic. */
    __m256i rounded;
    if (__builtin_expect(
            _mm512_fpclass_ps_mask((__m512)v, FASTLN_CLASS_NAN | FASTLN_CLASS_SUBNORMAL) != 0, 0))
        rounded = FASTLN_ISA(bfloat16_rare)(v);
    else
        rounded = (__m256i)_mm512_cvtneps_pbh((__m512)v);
    _mm256_storeu_si256((__m256i *)p, rounded);
#else
    /* Without NaNs the rounding is five integer operations; the NaN test costs two. */
    FASTLN_VU32 result;
    if (__builtin_expect(FASTLN_ISA(any_nan)(v), 0)) {
        result = FASTLN_ISA(bfloat16_rare)(v);
    } else {
        FASTLN_VU32 bits;
        memcpy(&bits, &v, sizeof bits);
        result = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    }
    /* Each lane holds a value below 2^16: keep its low half. Written lane by lane, GCC stores
     * the vector one element at a time in some loops; the narrowing instructions say it once. */
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16((__m512i)result));
#elif defined(__AVX2__)
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128((__m256i)result),
                                                    _mm256_extracti128_si256((__m256i)result, 1)));
#elif defined(__x86_64__)
    /* as signed 16-bit values (sign-extended from the low half), which packs keeps exactly */
    const __m128i low = _mm_srai_epi32(_mm_slli_epi32((__m128i)result, 16), 16);
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi32(low, low));
#else
    for (int k = 0; k < FASTLN_VF_LANES; k++) p[k] = (uint16_t)result[k];
#endif
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The first n (0 <= n <= FASTLN_VF_LANES) floats at p as a vector, the other lanes 0, and the
 * first n lanes of v stored at p: a row's last few elements in one masked vector instead of
 * one at a time. Masked-off lanes are neither read nor written (nor can they fault). */
#define FASTLN_MASKED 1
FASTLN_INLINE FASTLN_VF FASTLN_ISA(load_f32_first)(const float *p, int64_t n)
{
    return (FASTLN_VF)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}

FASTLN_INLINE void FASTLN_ISA(store_f32_first)(float *p, FASTLN_VF v, int64_t n)
{
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), (__m512)v);
}

/* The same for the first n (0 <= n <= FASTLN_VD_LANES) doubles. */
FASTLN_INLINE FASTLN_VD FASTLN_ISA(load_f64_first)(const double *p, int64_t n)
{
    return (FASTLN_VD)_mm512_maskz_loadu_pd((__mmask8)((1u << n) - 1), p);
}

FASTLN_INLINE void FASTLN_ISA(store_f64_first)(double *p, FASTLN_VD v, int64_t n)
{
    _mm512_mask_storeu_pd(p, (__mmask8)((1u << n) - 1), (__m512d)v);
}

/* v with its lanes from n on (0 <= n <= the vector's lanes) set to +0: a partial block's
 * missing values made to add +0 to their sums. */
FASTLN_INLINE FASTLN_VF FASTLN_ISA(keep_first_f32)(FASTLN_VF v, int64_t n)
{
    return (FASTLN_VF)_mm512_maskz_mov_ps((__mmask16)((1u << n) - 1), (__m512)v);
}

FASTLN_INLINE FASTLN_VD FASTLN_ISA(keep_first_f64)(FASTLN_VD v, int64_t n)
{
    return (FASTLN_VD)_mm512_maskz_mov_pd((__mmask8)((1u << n) - 1), (__m512d)v);
}

/* The same for the first n (0 <= n <= FASTLN_VF_LANES) 16-bit elements (a half vector's). */
FASTLN_INLINE __m256i FASTLN_ISA(load_u16_first)(const uint16_t *p, int64_t n)
{
    return _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
}

FASTLN_INLINE void FASTLN_ISA(store_u16_first)(uint16_t *p, __m256i v, int64_t n)
{
    _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), v);
}
#else
#define FASTLN_MASKED 0
#endif

/* Streaming stores of n_bytes (see fastln_streaming_fence), in 16-byte pieces so that p needs
 * only 16-byte alignment; bytes beyond the last whole piece are stored plainly. */
FASTLN_INLINE void FASTLN_ISA(stream_bytes)(void *p, const void *v, size_t n_bytes)
{
    size_t done = 0;
#if defined(__x86_64__)
    for (; done + 16 <= n_bytes; done += 16) {
        __m128i piece;
        memcpy(&piece, (const char *)v + done, sizeof piece);
        _mm_stream_si128((__m128i *)((char *)p + done), piece);
    }
#endif
    memcpy((char *)p + done, (const char *)v + done, n_bytes - done);
}

/* A double vector streamed from its register (p 16-byte aligned): one non-temporal store
 * where p is aligned to the vector's width, which measured faster than 16-byte pieces for
 * double outputs; else the pieces, taken from the register (a copy on the stack made GCC
 * spill every vector of loops that also store plainly). float32 and half vectors keep
 * stream_bytes: whole-vector stores were no faster for them overall (docs/performance.md). */
FASTLN_INLINE void FASTLN_ISA(stream_f64)(double *p, FASTLN_VD v)
{
#if defined(__AVX512F__)
    const __m512d w = (__m512d)v;
    if (((uintptr_t)p & 63) == 0) {
        _mm512_stream_pd(p, w);
        return;
    }
    const __m256d low = _mm512_castpd512_pd256(w), high = _mm512_extractf64x4_pd(w, 1);
    _mm_stream_pd(p, _mm256_castpd256_pd128(low));
    _mm_stream_pd(p + 2, _mm256_extractf128_pd(low, 1));
    _mm_stream_pd(p + 4, _mm256_castpd256_pd128(high));
    _mm_stream_pd(p + 6, _mm256_extractf128_pd(high, 1));
#elif defined(__AVX__)
    const __m256d w = (__m256d)v;
    if (((uintptr_t)p & 31) == 0) {
        _mm256_stream_pd(p, w);
        return;
    }
    _mm_stream_pd(p, _mm256_castpd256_pd128(w));
    _mm_stream_pd(p + 2, _mm256_extractf128_pd(w, 1));
#elif defined(__x86_64__)
    _mm_stream_pd(p, (__m128d)v);
#else
    memcpy(p, &v, sizeof v);
#endif
}

#if !FASTLN_ISA_BFLOAT16_ONLY
#define FASTLN_STORAGE FASTLN_FLOAT16
#include "fastln/storage.h"
#undef FASTLN_STORAGE
#endif
#define FASTLN_STORAGE FASTLN_BFLOAT16
#include "fastln/storage.h"
#undef FASTLN_STORAGE
#if !FASTLN_ISA_BFLOAT16_ONLY
#define FASTLN_STORAGE FASTLN_FLOAT32
#include "fastln/storage.h"
#undef FASTLN_STORAGE
#define FASTLN_STORAGE FASTLN_FLOAT64
#include "fastln/storage.h"
#undef FASTLN_STORAGE
#endif

#undef FASTLN_ISA
#undef FASTLN_VF
#undef FASTLN_VD
#undef FASTLN_VU32
#undef FASTLN_VF_LANES
#undef FASTLN_VD_LANES
#undef FASTLN_MASKED
#undef FASTLN_PASS_VECTORS
#undef FASTLN_PASS_SLOTS
#undef FASTLN_FLOAT_PASS_SLOTS
#undef FASTLN_FLOAT_PASS_VECTORS
