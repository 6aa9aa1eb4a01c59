/* Shared helpers for fastln's row kernels. Plain C99: no Python, no allocation, no globals. */
#ifndef FASTLN_COMMON_H
#define FASTLN_COMMON_H

#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define FASTLN_RESTRICT __restrict__
#else
#define FASTLN_RESTRICT
#endif

/* Reductions run in FASTLN_LANES independent accumulators: element i of a row always goes to
 * lane i % FASTLN_LANES, and the lanes are combined by one fixed tree. The order of every sum is
 * therefore a function of the row alone, never of its address, its batch or the thread count,
 * and the compiler can still keep the lanes in vector registers. */
#define FASTLN_LANES 16

static inline double fastln_sum_lanes(const double lanes[FASTLN_LANES])
{
    double pairs[FASTLN_LANES / 2];
    for (int k = 0; k < FASTLN_LANES / 2; k++) pairs[k] = lanes[k] + lanes[k + FASTLN_LANES / 2];
    double quads[FASTLN_LANES / 4];
    for (int k = 0; k < FASTLN_LANES / 4; k++) quads[k] = pairs[k] + pairs[k + FASTLN_LANES / 4];
    return (quads[0] + quads[2]) + (quads[1] + quads[3]);
}

#endif /* FASTLN_COMMON_H */
