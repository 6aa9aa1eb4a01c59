/* One storage type of one instruction-set variant: how its elements load into the compute type
 * and store back, then every kernel template instantiated for it. fastln/isa.h includes this
 * file once per storage type, with FASTLN_STORAGE set. No include guard on purpose.
 *
 * The compute scheme is today's and the same for the three 32-bit-and-narrower types: float32
 * arithmetic for the elementwise passes, double for every sum (FASTLN_COMPUTE_F32 = 1); float64
 * computes in double throughout. A half-precision element is widened to float32 in registers
 * as it is loaded (exact), and a float32 result rounded once to the half format as it is
 * stored: a float16 or bfloat16 call gives, bit for bit, the float32 computation on the widened
 * input, rounded to the half format. A result computed in double is rounded to float32 first,
 * as the float32 computation would have rounded it.
 *
 * Each type defines, for the templates:
 *   FASTLN_T           the element type in memory (uint16_t for the half formats)
 *   FASTLN_P           the type of parameters (gamma, beta, bias), per-row statistics and
 *                      per-column sums: float, or double for float64
 *   FASTLN_C, VC       the elementwise compute type (float or double) and its vector
 *   FASTLN_NAME(name)  fastln_<name>_<storage>_<variant>
 *   load_c, store_c, stream_c      a vector of VC_LANES elements <-> a VC
 *   load_wide, store_wide          VF_LANES elements <-> two double vectors
 *   to_double, from_double, from_compute    one element */

#if FASTLN_STORAGE == FASTLN_FLOAT16 || FASTLN_STORAGE == FASTLN_BFLOAT16
#define FASTLN_T uint16_t
#elif FASTLN_STORAGE == FASTLN_FLOAT32
#define FASTLN_T float
#else
#define FASTLN_T double
#endif

#if FASTLN_STORAGE == FASTLN_FLOAT64
#define FASTLN_COMPUTE_F32 0
#define FASTLN_P double
#define FASTLN_C double
#define FASTLN_VC FASTLN_VD
#define FASTLN_VC_LANES FASTLN_VD_LANES
#define FASTLN_STORAGE_SUFFIX _f64
#else
#define FASTLN_COMPUTE_F32 1
#define FASTLN_P float
#define FASTLN_C float
#define FASTLN_VC FASTLN_VF
#define FASTLN_VC_LANES FASTLN_VF_LANES
#if FASTLN_STORAGE == FASTLN_FLOAT16
#define FASTLN_STORAGE_SUFFIX _f16
#elif FASTLN_STORAGE == FASTLN_BFLOAT16
#define FASTLN_STORAGE_SUFFIX _bf16
#else
#define FASTLN_STORAGE_SUFFIX _f32
#endif
#endif

#define FASTLN_NAME(name) \
    FASTLN_XPASTE(FASTLN_XPASTE(fastln_##name, FASTLN_STORAGE_SUFFIX), FASTLN_ISA_SUFFIX)

/* Elements per 64-byte cache line, and per iteration of a write pass: a line, or one wide load
 * where that is more (float64 with AVX-512). The write passes prefetch once per line. */
#define FASTLN_LINE ((int64_t)(64 / sizeof(FASTLN_T)))
#define FASTLN_STEP (FASTLN_LINE > FASTLN_VF_LANES ? FASTLN_LINE : (int64_t)FASTLN_VF_LANES)

/* ---- one element ------------------------------------------------------------------------ */

FASTLN_INLINE FASTLN_C FASTLN_NAME(to_compute)(FASTLN_T value)
{
#if FASTLN_STORAGE == FASTLN_FLOAT16
    return FASTLN_ISA(float16_to_float)(value);
#elif FASTLN_STORAGE == FASTLN_BFLOAT16
    return fastln_bfloat16_to_float(value);
#else
    return value;
#endif
}

FASTLN_INLINE double FASTLN_NAME(to_double)(FASTLN_T value)
{
    return (double)FASTLN_NAME(to_compute)(value);
}

FASTLN_INLINE FASTLN_T FASTLN_NAME(from_compute)(FASTLN_C value)
{
#if FASTLN_STORAGE == FASTLN_FLOAT16
    return FASTLN_ISA(float_to_float16)(value);
#elif FASTLN_STORAGE == FASTLN_BFLOAT16
    return fastln_float_to_bfloat16(value);
#else
    return value;
#endif
}

FASTLN_INLINE FASTLN_T FASTLN_NAME(from_double)(double value)
{
    return FASTLN_NAME(from_compute)((FASTLN_C)value);
}

/* ---- vectors ---------------------------------------------------------------------------- */

FASTLN_INLINE FASTLN_VC FASTLN_NAME(load_c)(const FASTLN_T *p)
{
#if FASTLN_STORAGE == FASTLN_FLOAT16
    return FASTLN_ISA(load_float16)(p);
#elif FASTLN_STORAGE == FASTLN_BFLOAT16
    return FASTLN_ISA(load_bfloat16)(p);
#elif FASTLN_STORAGE == FASTLN_FLOAT32
    return FASTLN_ISA(load_f32)(p);
#else
    return FASTLN_ISA(load_f64)(p);
#endif
}

FASTLN_INLINE void FASTLN_NAME(store_c)(FASTLN_T *p, FASTLN_VC v)
{
#if FASTLN_STORAGE == FASTLN_FLOAT16
    FASTLN_ISA(store_float16)(p, v);
#elif FASTLN_STORAGE == FASTLN_BFLOAT16
    FASTLN_ISA(store_bfloat16)(p, v);
#elif FASTLN_STORAGE == FASTLN_FLOAT32
    FASTLN_ISA(store_f32)(p, v);
#else
    FASTLN_ISA(store_f64)(p, v);
#endif
}

#if FASTLN_MASKED && FASTLN_COMPUTE_F32
/* The first n (0 <= n < FASTLN_VC_LANES) elements at p as a vector (the other lanes 0), and the
 * first n lanes of v stored at p, with AVX-512 masks: a row's last few elements in one vector.
 * The half types go through a vector's worth of elements on the stack, converted as load_c
 * and store_c convert (the same bits as the elements' own conversions). */
FASTLN_INLINE FASTLN_VC FASTLN_NAME(load_c_first)(const FASTLN_T *p, int64_t n)
{
#if FASTLN_STORAGE == FASTLN_FLOAT32
    return FASTLN_ISA(load_f32_first)(p, n);
#else
    FASTLN_T lanes[FASTLN_VC_LANES];
    _mm256_storeu_si256((__m256i *)lanes, FASTLN_ISA(load_u16_first)(p, n));
    return FASTLN_NAME(load_c)(lanes);
#endif
}

FASTLN_INLINE void FASTLN_NAME(store_c_first)(FASTLN_T *p, FASTLN_VC v, int64_t n)
{
#if FASTLN_STORAGE == FASTLN_FLOAT32
    FASTLN_ISA(store_f32_first)(p, v, n);
#else
    FASTLN_T lanes[FASTLN_VC_LANES];
    FASTLN_NAME(store_c)(lanes, v);
    FASTLN_ISA(store_u16_first)(p, _mm256_loadu_si256((const __m256i *)lanes), n);
#endif
}
#endif

/* store_c with non-temporal stores; p must be 16-byte aligned. */
FASTLN_INLINE void FASTLN_NAME(stream_c)(FASTLN_T *p, FASTLN_VC v)
{
#if FASTLN_STORAGE == FASTLN_FLOAT64
    FASTLN_ISA(stream_f64)(p, v);
#else
    FASTLN_T elements[FASTLN_VC_LANES];
    FASTLN_NAME(store_c)(elements, v);
    FASTLN_ISA(stream_bytes)(p, elements, sizeof elements);
#endif
}

/* store_c, or stream_c when streaming. */
FASTLN_INLINE void FASTLN_NAME(store_c_to)(FASTLN_T *p, FASTLN_VC v, int streaming)
{
    if (streaming)
        FASTLN_NAME(stream_c)(p, v);
    else
        FASTLN_NAME(store_c)(p, v);
}

/* The n elements of `values` at p: a streamed row's last elements after its vectors, with
 * non-temporal stores too when streaming (16 bytes at a time; p 16-byte aligned then). A line
 * written partly with plain stores and partly with non-temporal ones leaves the write-combining
 * buffers half full, and a row that ended that way slowed the whole pass (docs/performance.md,
 * "Streamed rows that end in a partial vector"). */
FASTLN_INLINE void FASTLN_NAME(store_elements_to)(FASTLN_T *p, const FASTLN_T *values, int64_t n,
                                                  int streaming)
{
    if (streaming)
        FASTLN_ISA(stream_bytes)(p, values, (size_t)n * sizeof(FASTLN_T));
    else
        memcpy(p, values, (size_t)n * sizeof(FASTLN_T));
}

/* FASTLN_VF_LANES elements as two double vectors (exact), and back (rounded once per type). */
FASTLN_INLINE void FASTLN_NAME(load_wide)(const FASTLN_T *p, FASTLN_VD *low, FASTLN_VD *high)
{
#if FASTLN_COMPUTE_F32
    const FASTLN_VF v = FASTLN_NAME(load_c)(p);
    *low = FASTLN_ISA(widen_low)(v);
    *high = FASTLN_ISA(widen_high)(v);
#else
    *low = FASTLN_ISA(load_f64)(p);
    *high = FASTLN_ISA(load_f64)(p + FASTLN_VD_LANES);
#endif
}

FASTLN_INLINE void FASTLN_NAME(store_wide)(FASTLN_T *p, FASTLN_VD low, FASTLN_VD high)
{
#if FASTLN_COMPUTE_F32
    FASTLN_NAME(store_c)(p, FASTLN_ISA(narrow_pair)(low, high));
#else
    FASTLN_ISA(store_f64)(p, low);
    FASTLN_ISA(store_f64)(p + FASTLN_VD_LANES, high);
#endif
}

/* store_wide, with non-temporal stores when streaming (p 16-byte aligned then). */
FASTLN_INLINE void FASTLN_NAME(store_wide_to)(FASTLN_T *p, FASTLN_VD low, FASTLN_VD high,
                                              int streaming)
{
    if (!streaming) {
        FASTLN_NAME(store_wide)(p, low, high);
        return;
    }
    /* what store_wide stores, each vector through stream_c */
#if FASTLN_COMPUTE_F32
    FASTLN_NAME(stream_c)(p, FASTLN_ISA(narrow_pair)(low, high));
#else
    FASTLN_NAME(stream_c)(p, low);
    FASTLN_NAME(stream_c)(p + FASTLN_VD_LANES, high);
#endif
}

/* The same from parameters (gamma, beta, bias: FASTLN_P) and from padded blocks of compute
 * values (FASTLN_C, the same type): plain loads of float or double. */
FASTLN_INLINE FASTLN_VC FASTLN_NAME(load_p)(const FASTLN_P *p)
{
#if FASTLN_COMPUTE_F32
    return FASTLN_ISA(load_f32)(p);
#else
    return FASTLN_ISA(load_f64)(p);
#endif
}

FASTLN_INLINE void FASTLN_NAME(load_wide_p)(const FASTLN_P *p, FASTLN_VD *low, FASTLN_VD *high)
{
#if FASTLN_COMPUTE_F32
    const FASTLN_VF v = FASTLN_ISA(load_f32)(p);
    *low = FASTLN_ISA(widen_low)(v);
    *high = FASTLN_ISA(widen_high)(v);
#else
    *low = FASTLN_ISA(load_f64)(p);
    *high = FASTLN_ISA(load_f64)(p + FASTLN_VD_LANES);
#endif
}

FASTLN_INLINE void FASTLN_NAME(store_wide_p)(FASTLN_P *p, FASTLN_VD low, FASTLN_VD high)
{
#if FASTLN_COMPUTE_F32
    FASTLN_ISA(store_f32)(p, FASTLN_ISA(narrow_pair)(low, high));
#else
    FASTLN_ISA(store_f64)(p, low);
    FASTLN_ISA(store_f64)(p + FASTLN_VD_LANES, high);
#endif
}

/* VF_LANES elements at `at` as two double vectors, from the row x or, when x is NULL, from a
 * padded block of compute values. Always inlined with one of the two a constant NULL. */
FASTLN_INLINE void FASTLN_NAME(load_wide_from)(const FASTLN_T *x, const FASTLN_P *padded,
                                               int64_t at, FASTLN_VD *low, FASTLN_VD *high)
{
    if (x)
        FASTLN_NAME(load_wide)(x + at, low, high);
    else
        FASTLN_NAME(load_wide_p)(padded + at, low, high);
}

/* ---- the kernels, for this storage type ------------------------------------------------- */

#include "fastln/statistics.h"
#include "fastln/rare.h"
#include "fastln/forward.h"
#include "fastln/backward.h"
#include "fastln/entries.h"

#undef FASTLN_T
#undef FASTLN_P
#undef FASTLN_C
#undef FASTLN_VC
#undef FASTLN_VC_LANES
#undef FASTLN_COMPUTE_F32
#undef FASTLN_STORAGE_SUFFIX
#undef FASTLN_NAME
#undef FASTLN_LINE
#undef FASTLN_STEP
