/* Shared helpers for fastln's row kernels. C99 with GCC/Clang vector extensions: no Python, no
 * allocation, no globals. */
#ifndef FASTLN_COMMON_H
#define FASTLN_COMMON_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define FASTLN_HAVE_STREAMING_STORES 1
#endif

#define FASTLN_RESTRICT __restrict__

/* Eight doubles: the unit of all arithmetic. The same source compiles to one AVX-512 register,
 * two AVX2 registers or four SSE2 registers, with the same association order in each. */
typedef double fastln_d8 __attribute__((vector_size(64)));
typedef float fastln_f16 __attribute__((vector_size(64)));

/* Reductions keep FASTLN_ACCUMULATORS vectors of partial sums (element i of a row always lands
 * in slot i % 32), and combine them by one fixed tree. The order of every sum is a function of
 * the row alone - never of its address, its batch or the thread count. */
#define FASTLN_ACCUMULATORS 4
#define FASTLN_BLOCK (8 * FASTLN_ACCUMULATORS)

/* Put before every loop over the accumulators: once it is unrolled, the accumulator arrays live in
 * registers; left rolled (the compiler's choice inside a large translation unit), they round-trip
 * through memory on every iteration and the kernel runs at half speed. */
#if defined(__clang__)
#define FASTLN_UNROLL_ACCUMULATORS _Pragma("unroll")
#elif defined(__GNUC__)
#define FASTLN_UNROLL_ACCUMULATORS _Pragma("GCC unroll 4")
#else
#define FASTLN_UNROLL_ACCUMULATORS
#endif

/* Every kernel is compiled for AVX-512, AVX2+FMA and the baseline, and the loader picks the best
 * the CPU has (GCC function multi-versioning), so a portable build still uses wide vectors. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(FASTLN_NO_DISPATCH)
#define FASTLN_DISPATCH __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTLN_DISPATCH
#endif

/* Helpers of the dispatched kernels must be inlined into them: a helper left out of line would be
 * compiled once, for the baseline instruction set, and every variant would call that. */
#define FASTLN_INLINE static inline __attribute__((always_inline))

/* Unaligned loads and stores (memcpy compiles to one vector move). */
FASTLN_INLINE fastln_d8 fastln_load8_f32(const float *p)
{
    fastln_d8 v;
    for (int k = 0; k < 8; k++) v[k] = (double)p[k];
    return v;
}

/* The low and high eight lanes of sixteen floats, widened to double in registers. (An element
 * loop: GCC 12 compiles __builtin_convertvector of eight floats to four-lane pieces.) */
FASTLN_INLINE fastln_d8 fastln_low8(fastln_f16 v)
{
    fastln_d8 wide;
    for (int k = 0; k < 8; k++) wide[k] = (double)v[k];
    return wide;
}

FASTLN_INLINE fastln_d8 fastln_high8(fastln_f16 v)
{
    fastln_d8 wide;
    for (int k = 0; k < 8; k++) wide[k] = (double)v[8 + k];
    return wide;
}

FASTLN_INLINE fastln_d8 fastln_load8_f64(const double *p)
{
    fastln_d8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

FASTLN_INLINE void fastln_store8_f32(float *p, fastln_d8 v)
{
    for (int k = 0; k < 8; k++) p[k] = (float)v[k];
}

FASTLN_INLINE void fastln_store8_f64(double *p, fastln_d8 v)
{
    memcpy(p, &v, sizeof v);
}

/* Non-temporal ("streaming") stores write around the caches: for outputs far larger than the
 * cache they save the read-for-ownership of every output line and leave the cache to the inputs.
 * SSE2 stores, so every dispatch target has them; p must be 16-byte aligned. Callers finish with
 * fastln_streaming_fence(). */
FASTLN_INLINE void fastln_stream16_f32(float *p, fastln_f16 v)
{
#ifdef FASTLN_HAVE_STREAMING_STORES
    __m128 parts[4];
    memcpy(parts, &v, sizeof v);
    for (int k = 0; k < 4; k++) _mm_stream_ps(p + 4 * k, parts[k]);
#else
    memcpy(p, &v, sizeof v);
#endif
}

FASTLN_INLINE void fastln_stream8_f64(double *p, fastln_d8 v)
{
#ifdef FASTLN_HAVE_STREAMING_STORES
    __m128d parts[4];
    memcpy(parts, &v, sizeof v);
    for (int k = 0; k < 4; k++) _mm_stream_pd(p + 2 * k, parts[k]);
#else
    memcpy(p, &v, sizeof v);
#endif
}

FASTLN_INLINE void fastln_streaming_fence(void)
{
#ifdef FASTLN_HAVE_STREAMING_STORES
    _mm_sfence();
#endif
}

FASTLN_INLINE int fastln_is_aligned16(const void *p)
{
    return ((uintptr_t)p & 15) == 0;
}

/* How many of a row's first elements (of `size` bytes, at most n) to write on their own so that
 * the row's vector stores after them start on a 64-byte cache line. A 64-byte store that
 * straddles two lines costs two: NumPy's outputs are only 16-byte aligned, and at 768 columns
 * such a y or dx made the forward up to 1.3x and the backward up to 1.6x slower. 0 when p is
 * on a line already, or not even aligned to its element size (then nothing can help). */
FASTLN_INLINE int64_t fastln_elements_to_line(const void *p, size_t size, int64_t n)
{
    const size_t offset = (size_t)((uintptr_t)p & 63);
    if (offset == 0 || offset % size != 0) return 0;
    const int64_t head = (int64_t)((64 - offset) / size);
    return head < n ? head : n;
}

/* Sum of the accumulators, then of the eight slots, in one fixed order. */
FASTLN_INLINE double fastln_reduce(const fastln_d8 acc[FASTLN_ACCUMULATORS])
{
    const fastln_d8 v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

#endif /* FASTLN_COMMON_H */
