/* What every kernel shares: vector types, the fixed order of every sum, alignment helpers.
 * C11 with GCC/Clang vector extensions: no Python, no allocation, no globals. */
#ifndef FASTLN_SIMD_H
#define FASTLN_SIMD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define FASTLN_RESTRICT __restrict__

/* The classes of AVX-512's vfpclassps (_mm512_fpclass_ps_mask), as its immediate's bits. */
#define FASTLN_CLASS_QUIET_NAN 0x01
#define FASTLN_CLASS_INF (0x08 | 0x10) /* +Inf, -Inf */
#define FASTLN_CLASS_SUBNORMAL 0x20
#define FASTLN_CLASS_SIGNALLING_NAN 0x80
#define FASTLN_CLASS_NAN (FASTLN_CLASS_QUIET_NAN | FASTLN_CLASS_SIGNALLING_NAN)

/* Helpers must be inlined into the kernels that call them: an out-of-line copy would be
 * compiled for one instruction set only, and every variant of a kernel would call it. */
#define FASTLN_INLINE static inline __attribute__((always_inline))

/* The per-row (and per-piece) passes are functions of their own, compiled once per storage type
 * and instruction set (each lives inside its variant's target region, so it is compiled for that
 * instruction set): a call per row costs nothing next to the row, and inlining every pass into
 * every caller would multiply the code, and the build time, several times over. */
#define FASTLN_OUTLINED static __attribute__((noinline))

/* Loops over a pass's accumulators are unrolled so that the accumulators live in registers;
 * left rolled (the compiler's choice in a large translation unit) they round-trip through the
 * stack on every iteration. */
#if defined(__clang__)
#define FASTLN_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define FASTLN_UNROLL _Pragma("GCC unroll 16")
#else
#define FASTLN_UNROLL
#endif

/* condition ? a : b, chosen bit by bit. Both values are computed before the choice: a
 * compiler will not compute a floating-point operation that might raise a flag (under the
 * default -ftrapping-math) on the path that does not use it, so a ?: between two computed
 * values stays a branch and keeps its loop out of vectors; this one never does. */
static inline double fastln_choose(int condition, double a, double b)
{
    uint64_t bits_a, bits_b;
    memcpy(&bits_a, &a, sizeof a);
    memcpy(&bits_b, &b, sizeof b);
    const uint64_t mask = (uint64_t)0 - (uint64_t)(condition != 0);
    const uint64_t bits = (bits_a & mask) | (bits_b & ~mask);
    double chosen;
    memcpy(&chosen, &bits, sizeof chosen);
    return chosen;
}

static inline float fastln_choose_float(int condition, float a, float b)
{
    uint32_t bits_a, bits_b;
    memcpy(&bits_a, &a, sizeof a);
    memcpy(&bits_b, &b, sizeof b);
    const uint32_t mask = (uint32_t)0 - (uint32_t)(condition != 0);
    const uint32_t bits = (bits_a & mask) | (bits_b & ~mask);
    float chosen;
    memcpy(&chosen, &bits, sizeof chosen);
    return chosen;
}

/* Vector types, named for what they hold. Each instruction-set variant works in its native
 * width (fastln/isa.h): 16 floats and 8 doubles with AVX-512, 8 and 4 with AVX2, 4 and 2 with
 * SSE2. */
typedef float fastln_f32x4 __attribute__((vector_size(16)));
typedef float fastln_f32x8 __attribute__((vector_size(32)));
typedef float fastln_f32x16 __attribute__((vector_size(64)));
typedef double fastln_f64x2 __attribute__((vector_size(16)));
typedef double fastln_f64x4 __attribute__((vector_size(32)));
typedef double fastln_f64x8 __attribute__((vector_size(64)));
typedef uint32_t fastln_u32x4 __attribute__((vector_size(16)));
typedef uint32_t fastln_u32x8 __attribute__((vector_size(32)));
typedef uint32_t fastln_u32x16 __attribute__((vector_size(64)));
typedef int64_t fastln_i64x2 __attribute__((vector_size(16)));
typedef int64_t fastln_i64x4 __attribute__((vector_size(32)));
typedef int64_t fastln_i64x8 __attribute__((vector_size(64)));

/* Every sum over a row (or a segment of a BatchNorm feature) keeps FASTLN_SLOTS partial sums:
 * element i of the row adds to slot i % FASTLN_SLOTS, and the slots are added by one fixed
 * tree (fastln_reduce_slots). The order of every sum is a function of the row's length alone -
 * never of its address, its batch, the thread count or the instruction set. A row's last
 * partial block of FASTLN_SLOTS elements is padded with values that add exactly +0 (a slot
 * starts at +0 and can never hold -0, so adding +0 changes nothing). */
#define FASTLN_SLOTS 32

/* The float32 backward's row sums: each slot adds FASTLN_FLOAT_RUN of its elements (one from each
 * of FASTLN_FLOAT_RUN consecutive blocks of FASTLN_SLOTS) in float, from +0, then adds that float
 * partial to its double total. A partial holds at most FASTLN_FLOAT_RUN terms, so its rounding
 * errors stay within about FASTLN_FLOAT_RUN float ulps of the terms it holds, whatever the row's
 * length; the folds cost one widening per slot per run. */
#define FASTLN_FLOAT_RUN 32

/* The float32 forward's statistics follow the same rule with shorter runs: a variance is a
 * difference of sums, and the forward's results are held to a tighter bound than the backward's
 * (docs/performance.md, "The forward's statistics in float runs"). */
#define FASTLN_FORWARD_FLOAT_RUN 8

/* The float run of run_blocks blocks starting at element `run` of a row: its whole blocks end at
 * the returned index; *padded tells whether the row's padded last block (from n_whole on)
 * belongs to it. */
FASTLN_INLINE int64_t fastln_float_run_end(int64_t run, int64_t run_blocks, int64_t n_whole,
                                           int64_t n_cols, int *padded)
{
    const int64_t run_end = run + run_blocks * FASTLN_SLOTS;
    *padded = n_whole < n_cols && n_whole < run_end;
    return run_end < n_whole ? run_end : n_whole;
}

/* The fixed tree over the slots: four groups of eight added pairwise, then the eight. */
FASTLN_INLINE double fastln_reduce_slots(const double slots[FASTLN_SLOTS])
{
    double lanes[8];
    for (int l = 0; l < 8; l++)
        lanes[l] = (slots[l] + slots[8 + l]) + (slots[16 + l] + slots[24 + l]);
    return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
           + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

FASTLN_INLINE int fastln_is_aligned16(const void *p)
{
    return ((uintptr_t)p & 15) == 0;
}

/* How many of a row's first elements (of `size` bytes, at most n) to write on their own so that
 * the row's vector stores after them start on a 64-byte cache line: a store that straddles two
 * lines costs two, and NumPy's outputs are only 16-byte aligned. 0 when p is on a line already,
 * or not even aligned to its element size (then nothing can help). The write passes are
 * elementwise, so the split never changes a result. */
FASTLN_INLINE int64_t fastln_elements_to_line(const void *p, size_t size, int64_t n)
{
    const size_t offset = (size_t)((uintptr_t)p & 63);
    if (offset == 0 || offset % size != 0) return 0;
    const int64_t head = (int64_t)((64 - offset) / size);
    return head < n ? head : n;
}

/* fastln_elements_to_line for rows of n elements written together (a group's columns at a
 * time): they share the head only when a row is a whole number of lines; else none. */
FASTLN_INLINE int64_t fastln_rows_head(const void *first_row, size_t size, int64_t n)
{
    return n * (int64_t)size % 64 == 0 ? fastln_elements_to_line(first_row, size, n) : 0;
}

/* Non-temporal ("streaming") stores write around the caches: for outputs far larger than the
 * cache they save the read-for-ownership of every output line and leave the cache to the
 * inputs. Every x86-64 CPU has them (SSE2). Every pass or task that used them ends with this
 * fence, before another thread may read what it wrote (the row forwards once per task). */
FASTLN_INLINE void fastln_streaming_fence(void)
{
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

/* Whether a pass may stream its output beside one of its inputs. Loads wait on pending stores
 * whose addresses share their low 12 bits (4K aliasing), and non-temporal stores stay pending
 * long: on an Intel Xeon (Ice Lake) a streamed output starting up to about 600 bytes after
 * its input's place in a page took up to twice the time of other placements, while ordinary
 * stores took the same time at every placement (docs/performance.md, "Streamed outputs just
 * after their inputs"). Such outputs are written with ordinary stores. */
#define FASTLN_STREAM_ALIAS_BYTES 640
FASTLN_INLINE int fastln_streams_apart(const void *output, const void *input)
{
    const uintptr_t after = ((uintptr_t)output - (uintptr_t)input) & 4095;
    return after == 0 || after > FASTLN_STREAM_ALIAS_BYTES;
}

/* One 64-byte line (line aligned) with non-temporal stores, from bytes in memory. */
FASTLN_INLINE void fastln_stream_line(void *line, const void *bytes)
{
#if defined(__x86_64__)
    for (int k = 0; k < 64; k += 16)
        _mm_stream_si128((__m128i *)((char *)line + k),
                         _mm_load_si128((const __m128i *)((const char *)bytes + k)));
#else
    memcpy(line, bytes, 64);
#endif
}

/* fastln_row_parts_of: streamed rows of whole lines up to this size, starting on 16 bytes, go
 * out whole from their first element instead of around a shared line. */
#define FASTLN_WHOLE_ROW_MAX_BYTES 2048

/* Streamed rows go out in whole cache lines. A row rarely ends on a line (NumPy's large arrays
 * start 16 bytes past one), so consecutive rows share a line: its first part, the end of one
 * row, waits here until the next row's first elements complete it, and the line is then
 * written in one non-temporal piece. Written plainly instead, the shared line is read for
 * ownership from memory while the streamed stores queue behind it, once per row
 * (docs/performance.md, "Streamed rows in whole lines"). */
typedef struct {
    unsigned char bytes[64] __attribute__((aligned(64)));
    unsigned char *line; /* the output line that bytes[0, n_bytes) belong to, or NULL */
    size_t n_bytes;
} fastln_shared_line;

/* A streamed row's parts: `head` elements up to y's first line, written to head_to (the shared
 * line's bytes when they complete it, else y); `body` elements in whole lines, streamed; `tail`
 * elements after them, written to tail_to (the shared line's bytes when the next row will
 * complete it, else their place in y). */
typedef struct {
    int64_t head, body, tail;
    void *head_to, *tail_to;
    int head_completes_line, tail_waits;
    int stream_body; /* whether the body goes out with non-temporal stores */
} fastln_row_parts;

/* A row task's shared line: *shared when the call streams, else NULL (rows written plainly). */
FASTLN_INLINE fastln_shared_line *fastln_shared_line_start(fastln_shared_line *shared,
                                                           int streaming)
{
    shared->line = NULL;
    return streaming ? shared : NULL;
}

/* The shared line's bytes stored plainly at their place (the next row does not complete it). */
FASTLN_INLINE void fastln_shared_line_put(fastln_shared_line *shared)
{
    if (shared->line) memcpy(shared->line, shared->bytes, shared->n_bytes);
    shared->line = NULL;
}

/* The end of a row task that streamed: a line still waiting is stored plainly, and the task's
 * non-temporal stores are fenced before another thread may read them. */
FASTLN_INLINE void fastln_shared_line_finish(fastln_shared_line *streamed)
{
    if (!streamed) return;
    fastln_shared_line_put(streamed);
    fastln_streaming_fence();
}

/* The parts of a row of n elements of `size` bytes at y. Without a shared line (rows written
 * plainly, and float64 rows: measured no faster with it), or not on an element boundary of a
 * line: the head, then the rest as the body (whose own last elements the write passes store
 * as they store any row's). Rows shorter than two lines are written plainly: streamed, each
 * line took plain and non-temporal stores from neighbouring rows, which measured far slower
 * (docs/performance.md). Short rows of whole lines are one streamed body (below).
 * next_row_follows: the next row is written next, by this thread. */
FASTLN_INLINE fastln_row_parts fastln_row_parts_of(fastln_shared_line *shared, void *y,
                                                    size_t size, int64_t n,
                                                    int next_row_follows)
{
    fastln_row_parts parts;
    parts.head = fastln_elements_to_line(y, size, n);
    parts.body = n - parts.head;
    parts.tail = 0;
    parts.head_to = y;
    parts.tail_to = NULL;
    parts.head_completes_line = parts.tail_waits = 0;
    parts.stream_body = shared != NULL;
    if (!shared || size == sizeof(double)) return parts;
    const int64_t line = 64 / (int64_t)size;
    if (n * (int64_t)size < 128 || ((uintptr_t)y & 63) % size != 0) {
        fastln_shared_line_put(shared);
        parts.stream_body = n * (int64_t)size >= 128;
        return parts;
    }
    /* Rows of whole lines, of at most FASTLN_WHOLE_ROW_MAX_BYTES, that start on 16 bytes
     * (NumPy's large arrays start 16 bytes past a line): the whole row streams, in 16-byte
     * pieces from its first element, and each line it shares with a neighbour is written by
     * both rows in non-temporal pieces. For such short rows the three parts cost more than the
     * write pass's loads straddling lines; longer rows measured faster in parts
     * (docs/performance.md, "Short rows streamed from their first element"). */
    if ((n * (int64_t)size) % 64 == 0 && n * (int64_t)size <= FASTLN_WHOLE_ROW_MAX_BYTES
        && ((uintptr_t)y & 15) == 0) {
        fastln_shared_line_put(shared);
        parts.head = 0;
        parts.body = n;
        return parts;
    }
    parts.body = parts.body / line * line;
    parts.tail = n - parts.head - parts.body;
    unsigned char *start = (unsigned char *)y;
    if (parts.head > 0 && shared->line == start - (64 - parts.head * size)
        && shared->n_bytes + parts.head * size == 64) {
        parts.head_to = shared->bytes + shared->n_bytes;
        parts.head_completes_line = 1;
    } else {
        fastln_shared_line_put(shared);
    }
    parts.tail_waits = parts.tail > 0 && next_row_follows;
    parts.tail_to = parts.tail_waits ? shared->bytes : start + (parts.head + parts.body) * size;
    return parts;
}

/* After the head is written: a line it completed goes out. */
FASTLN_INLINE void fastln_row_head_written(fastln_shared_line *shared,
                                           const fastln_row_parts *parts)
{
    if (parts->head_completes_line) {
        fastln_stream_line(shared->line, shared->bytes);
        shared->line = NULL;
    }
}

/* After the tail is written: a tail kept for the next row becomes the shared line's start. */
FASTLN_INLINE void fastln_row_tail_written(fastln_shared_line *shared,
                                           const fastln_row_parts *parts, void *y, size_t size)
{
    if (parts->tail_waits) {
        shared->line = (unsigned char *)y + (parts->head + parts->body) * size;
        shared->n_bytes = (size_t)parts->tail * size;
    }
}

/* Builds where the instruction-set variants are compiled (fastln/kernels.h); elsewhere only the
 * portable one is. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(FASTLN_NO_DISPATCH)
#define FASTLN_X86_VARIANTS 1
#else
#define FASTLN_X86_VARIANTS 0
#endif

#endif /* FASTLN_SIMD_H */
