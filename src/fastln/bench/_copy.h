/* Streaming copy of one contiguous chunk: the yardstick for "this machine's memory bandwidth".
 * Used only by `fastln bench` (fastln.bench._bandwidth), not by the kernels.
 *
 * `fastln bench` copies a buffer much larger than the last-level cache, chunk by chunk on every
 * thread, and reports LayerNorm's effective bandwidth as a fraction of this copy's. A copy is the
 * right ceiling for a LayerNorm pass: one stream read, one stream written, no arithmetic to hide.
 *
 * Two flavours:
 *   - fastln_copy_chunk: ordinary stores, the same kind fastln's kernels make (each written cache
 *     line is first read for ownership, exactly as when LayerNorm writes y).
 *   - fastln_copy_chunk_nontemporal: stores that bypass the cache (SSE2 _mm_stream_pd on x86-64,
 *     clang's __builtin_nontemporal_store elsewhere), the best case for the write stream.
 *     FASTLN_HAVE_NONTEMPORAL_COPY is 0 where neither exists; the function then copies plainly.
 *
 * Plain C: no Python, no allocation, no globals. */
#ifndef FASTLN_BENCH_COPY_H
#define FASTLN_BENCH_COPY_H

#include <stdint.h>

/* GCC turns a copy loop into a call to memcpy, whose large-size path may switch to non-temporal
 * stores on its own; keep the loop a loop so that "ordinary stores" means what it says. */
#if defined(__GNUC__) && !defined(__clang__)
#define FASTLN_KEEP_LOOP __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define FASTLN_KEEP_LOOP
#endif

FASTLN_KEEP_LOOP
static inline void fastln_copy_chunk(double *restrict destination,
                                     const double *restrict source, int64_t n_elements)
{
#ifdef _OPENMP
#pragma omp simd
#endif
    for (int64_t i = 0; i < n_elements; i++) destination[i] = source[i];
}

#if defined(__SSE2__)
#include <emmintrin.h>
#define FASTLN_HAVE_NONTEMPORAL_COPY 1

FASTLN_KEEP_LOOP
static inline void fastln_copy_chunk_nontemporal(double *restrict destination,
                                                 const double *restrict source,
                                                 int64_t n_elements)
{
    int64_t i = 0;
    /* _mm_stream_pd needs a 16-byte aligned destination: copy one element plainly if not. */
    for (; i < n_elements && ((uintptr_t)(destination + i) & 15) != 0; i++)
        destination[i] = source[i];
    /* Four streams per iteration: a whole 64-byte line per iteration keeps the write-combining
     * buffers full. */
    for (; i + 8 <= n_elements; i += 8) {
        _mm_stream_pd(destination + i, _mm_loadu_pd(source + i));
        _mm_stream_pd(destination + i + 2, _mm_loadu_pd(source + i + 2));
        _mm_stream_pd(destination + i + 4, _mm_loadu_pd(source + i + 4));
        _mm_stream_pd(destination + i + 6, _mm_loadu_pd(source + i + 6));
    }
    for (; i < n_elements; i++) destination[i] = source[i];
    /* Non-temporal stores are weakly ordered: make them visible before the chunk is done. */
    _mm_sfence();
}

#elif defined(__clang__) && defined(__has_builtin)
#if __has_builtin(__builtin_nontemporal_store)
#define FASTLN_HAVE_NONTEMPORAL_COPY 1

static inline void fastln_copy_chunk_nontemporal(double *restrict destination,
                                                 const double *restrict source,
                                                 int64_t n_elements)
{
    for (int64_t i = 0; i < n_elements; i++)
        __builtin_nontemporal_store(source[i], destination + i);
}
#endif
#endif

#ifndef FASTLN_HAVE_NONTEMPORAL_COPY
#define FASTLN_HAVE_NONTEMPORAL_COPY 0

static inline void fastln_copy_chunk_nontemporal(double *restrict destination,
                                                 const double *restrict source,
                                                 int64_t n_elements)
{
    fastln_copy_chunk(destination, source, n_elements);
}
#endif

/* For Cython: function-like names for the compile-time flags. */
static inline int fastln_nontemporal_copy_available(void) { return FASTLN_HAVE_NONTEMPORAL_COPY; }

static inline int fastln_copy_openmp_enabled(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#endif /* FASTLN_BENCH_COPY_H */
