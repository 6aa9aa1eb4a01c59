/* LayerNorm row kernels for float32 (suffix _f32) and float64 (suffix _f64).
 *
 * The per-row functions are written once in layer_norm_impl.h and instantiated here for each
 * element type. All arithmetic is in double. */
#ifndef FASTLN_LAYER_NORM_H
#define FASTLN_LAYER_NORM_H

#include <math.h>
#include <stdint.h>
#include "fastln/common.h"

/* The write pass of a row, per element type (the forward calls fastln_ln_write_row_*). */
FASTLN_INLINE void fastln_ln_write_row_f32(
    const float *x, const float *gamma, const float *beta, float *y, int64_t n_cols,
    double shift, double mean_shifted, double rstd, int streaming);
FASTLN_INLINE void fastln_ln_write_row_f64(
    const double *x, const double *gamma, const double *beta, double *y, int64_t n_cols,
    double shift, double mean_shifted, double rstd, int streaming);

#define FASTLN_T float
#define FASTLN_NAME(name) name##_f32
#define FASTLN_LOAD8 fastln_load8_f32
#define FASTLN_STORE8 fastln_store8_f32
#include "fastln/layer_norm_impl.h"
#undef FASTLN_T
#undef FASTLN_NAME
#undef FASTLN_LOAD8
#undef FASTLN_STORE8

#define FASTLN_T double
#define FASTLN_NAME(name) name##_f64
#define FASTLN_LOAD8 fastln_load8_f64
#define FASTLN_STORE8 fastln_store8_f64
#include "fastln/layer_norm_impl.h"
#undef FASTLN_T
#undef FASTLN_NAME
#undef FASTLN_LOAD8
#undef FASTLN_STORE8

/* float64 rows: the double write pass, with streaming stores when asked and y is aligned. */
FASTLN_INLINE void fastln_ln_write_row_f64(
    const double *x, const double *gamma, const double *beta, double *y, int64_t n_cols,
    double shift, double mean_shifted, double rstd, int streaming)
{
    if (!streaming || !fastln_is_aligned16(y)) {
        fastln_ln_write_row_double_f64(x, gamma, beta, y, n_cols, shift, mean_shifted, rstd, 0);
        return;
    }
    const int64_t n_vector = n_cols - n_cols % 8;
    for (int64_t i = 0; i < n_vector; i += 8) {
        __builtin_prefetch(x + n_cols + i, 0, 3);
        fastln_stream8_f64(y + i, fastln_ln_output8_f64(
            x + i, gamma ? gamma + i : NULL, beta ? beta + i : NULL, shift, mean_shifted, rstd));
    }
    fastln_streaming_fence();
    if (n_vector < n_cols)
        fastln_ln_write_row_double_f64(x + n_vector, gamma ? gamma + n_vector : NULL,
                                       beta ? beta + n_vector : NULL, y + n_vector,
                                       n_cols - n_vector, shift, mean_shifted, rstd, 0);
}

/* The float32 write loop over whole 16-element chunks; returns where it stopped. Always inlined
 * with a constant `streaming`, so each caller gets a loop without the test in it. */
FASTLN_INLINE int64_t fastln_ln_write_chunks_f32(
    const float *x, const float *gamma, const float *beta, float *y, int64_t n_cols,
    float mean_head, float mean_tail, float rstd, const int streaming)
{
    int64_t i = 0;
    for (; i + 16 <= n_cols; i += 16) {
        __builtin_prefetch(x + n_cols + i, 0, 3);
        fastln_f16 v, scale = {0}, offset = {0};
        memcpy(&v, x + i, sizeof v);
        if (gamma) memcpy(&scale, gamma + i, sizeof scale);
        if (beta) memcpy(&offset, beta + i, sizeof offset);
        v = ((v - mean_head) - mean_tail) * rstd;
        v = gamma ? v * scale : v;
        v = beta ? v + offset : v;
        if (streaming)
            fastln_stream16_f32(y + i, v);
        else
            memcpy(y + i, &v, sizeof v);
    }
    if (streaming) fastln_streaming_fence();
    return i;
}

/* float32 rows are written in float32, twice as many lanes per instruction as double. The
 * centring keeps its precision by splitting the mean into a float32 head and tail:
 * x - head is exact whenever x is within a factor of two of the mean (the large-offset case), and
 * otherwise rounds once relative to a difference as large as x itself, so x_hat is within about
 * two float32 ulps of the double computation. Rows whose rstd does not fit a float32 (eps = 0
 * with subnormal spreads) take the double path. */
FASTLN_INLINE void fastln_ln_write_row_f32(
    const float *x, const float *gamma, const float *beta, float *y, int64_t n_cols,
    double shift, double mean_shifted, double rstd, int streaming)
{
    if (!(rstd > 1e-30 && rstd < 1e30)) {
        fastln_ln_write_row_double_f32(x, gamma, beta, y, n_cols, shift, mean_shifted, rstd, 0);
        return;
    }
    const double mean = shift + mean_shifted;
    const float mean_head = (float)mean;
    const float mean_tail = (float)((shift - (double)mean_head) + mean_shifted);
    const float rstd_f = (float)rstd;
    int64_t i;
    if (streaming && fastln_is_aligned16(y))
        i = fastln_ln_write_chunks_f32(x, gamma, beta, y, n_cols, mean_head, mean_tail, rstd_f, 1);
    else
        i = fastln_ln_write_chunks_f32(x, gamma, beta, y, n_cols, mean_head, mean_tail, rstd_f, 0);
    for (; i < n_cols; i++) {
        float v = ((x[i] - mean_head) - mean_tail) * rstd_f;
        if (gamma) v *= gamma[i];
        if (beta) v += beta[i];
        y[i] = v;
    }
}

#endif /* FASTLN_LAYER_NORM_H */
