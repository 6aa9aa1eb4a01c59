/* RMSNorm row kernels for float32 (suffix _f32) and float64 (suffix _f64).
 *
 *     y = gamma * x / sqrt(mean(x * x) + eps)
 *
 * The per-row functions are written once in rms_norm_impl.h and instantiated here for each
 * element type, exactly as layer_norm.h does. The sums are in double: squares of float32
 * values (up to 3.4e38) cannot overflow there, and float64 rows whose sum of squares does
 * overflow are rescaled by their largest magnitude (a rare path outside the hot loop). The
 * float32 write passes (below) are in float32, as LayerNorm's are. */
#ifndef FASTLN_RMS_NORM_H
#define FASTLN_RMS_NORM_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "fastln/common.h"

/* A row's constants for the backward's write pass: x_hat = x * x_scale (x_scale is rstd, or 0
 * for the Inf rstd of an all-zero row with eps = 0), dx = rstd * (dx_hat - x_hat * mean). */
typedef struct {
    double rstd, x_scale, mean_dxhat_xhat;
} fastln_rms_backward_row;

/* x_hat = x * fastln_rms_x_scale(rstd): rstd, except 0 for the Inf rstd of an all-zero row
 * with eps = 0 (x_hat is 0 there, as LayerNorm's for a constant row, not 0 * Inf = NaN). */
FASTLN_INLINE double fastln_rms_x_scale(double rstd)
{
    return rstd <= DBL_MAX ? rstd : (rstd == rstd ? 0.0 : rstd);
}

/* Backward rows go through the write pass together in groups of this many
 * (fastln_rms_norm_backward_rows), as LayerNorm's do. */
#define FASTLN_RMS_BACKWARD_GROUP 8

/* The forward's write pass and the backward's sums and write pass, per element type (defined
 * below, after the template). */
FASTLN_INLINE void fastln_rms_write_row_f32(const float *x, const float *gamma, float *y,
                                            int64_t n, double x_scale);
FASTLN_INLINE void fastln_rms_write_row_f64(const double *x, const double *gamma, double *y,
                                            int64_t n, double x_scale);
FASTLN_INLINE void fastln_rms_backward_accumulate_f32(
    const float *dy, const float *x, const float *gamma, double x_scale,
    fastln_d8 sum_dxhat_xhat[FASTLN_ACCUMULATORS]);
FASTLN_INLINE void fastln_rms_backward_accumulate_f64(
    const double *dy, const double *x, const double *gamma, double x_scale,
    fastln_d8 sum_dxhat_xhat[FASTLN_ACCUMULATORS]);
FASTLN_INLINE int fastln_rms_backward_in_vectors_f32(const fastln_rms_backward_row *row);
FASTLN_INLINE int fastln_rms_backward_in_vectors_f64(const fastln_rms_backward_row *row);
FASTLN_INLINE void fastln_rms_backward_write_rows_f32(
    const float *dy, const float *x, const float *gamma, float *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_rms_backward_row *rows, double *dgamma_acc);
FASTLN_INLINE void fastln_rms_backward_write_rows_f64(
    const double *dy, const double *x, const double *gamma, double *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_rms_backward_row *rows, double *dgamma_acc);

#define FASTLN_TEMPLATE "fastln/rms_norm_impl.h"
#include "fastln/instantiate.h"
#undef FASTLN_TEMPLATE

/* float64 rows: the double write pass. */
FASTLN_INLINE void fastln_rms_write_row_f64(const double *x, const double *gamma, double *y,
                                            int64_t n, double x_scale)
{
    fastln_rms_write_row_double_f64(x, gamma, y, n, x_scale);
}

/* float32 rows are written in float32, 16 lanes per AVX-512 instruction instead of 8, as
 * LayerNorm's are: y = (x * rstd) * gamma with rstd rounded to float32, three roundings of
 * u32 each (the double pass had one), for twice the lanes and no conversions. There is no
 * centring to lose digits in. An x_scale that does not fit a float32 (0 for an all-zero row
 * with eps = 0, NaN, or beyond 1e30) takes the double pass. */
FASTLN_INLINE void fastln_rms_write_row_f32(const float *x, const float *gamma, float *y,
                                            int64_t n, double x_scale)
{
    if (!(x_scale > 1e-30 && x_scale < 1e30)) {
        fastln_rms_write_row_double_f32(x, gamma, y, n, x_scale);
        return;
    }
    const float rstd = (float)x_scale;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __builtin_prefetch(x + n + i, 0, 3); /* the next row, as the double pass */
        fastln_f16 v, scale;
        memcpy(&v, x + i, sizeof v);
        v *= rstd;
        if (gamma) {
            memcpy(&scale, gamma + i, sizeof scale);
            v *= scale;
        }
        memcpy(y + i, &v, sizeof v);
    }
    for (; i < n; i++) { /* the last n % 16: each lane's arithmetic, one at a time */
        float out = x[i] * rstd;
        if (gamma) out *= gamma[i];
        y[i] = out;
    }
}

/* float64 rows: the double passes. */
FASTLN_INLINE void fastln_rms_backward_accumulate_f64(
    const double *dy, const double *x, const double *gamma, double x_scale,
    fastln_d8 sum_dxhat_xhat[FASTLN_ACCUMULATORS])
{
    fastln_rms_backward_accumulate_double_f64(dy, x, gamma, x_scale, sum_dxhat_xhat);
}

FASTLN_INLINE int fastln_rms_backward_in_vectors_f64(const fastln_rms_backward_row *row)
{
    (void)row;
    return 1;
}

FASTLN_INLINE void fastln_rms_backward_write_rows_f64(
    const double *dy, const double *x, const double *gamma, double *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_rms_backward_row *rows, double *dgamma_acc)
{
    fastln_rms_backward_write_rows_double_f64(dy, x, gamma, dx, n_rows, stride, width, rows,
                                              dgamma_acc);
}

/* float32 rows, as LayerNorm's: dx_hat = dy * gamma is formed in float32 (one rounding,
 * relative to itself), then widened in registers, and x_hat = x * x_scale and the products are
 * taken in double. Element k still lands in accumulator k / 8. */
FASTLN_INLINE void fastln_rms_backward_accumulate_f32(
    const float *dy, const float *x, const float *gamma, double x_scale,
    fastln_d8 sum_dxhat_xhat[FASTLN_ACCUMULATORS])
{
    FASTLN_UNROLL_ACCUMULATORS
    for (int h = 0; h < FASTLN_ACCUMULATORS / 2; h++) {
        fastln_f16 dx_hat16, scale16;
        memcpy(&dx_hat16, dy + 16 * h, sizeof dx_hat16);
        if (gamma) {
            memcpy(&scale16, gamma + 16 * h, sizeof scale16);
            dx_hat16 *= scale16;
        }
        /* x straight from memory into double (fastln_low8 of a loaded vector made GCC 12
         * gather it element by element) */
        sum_dxhat_xhat[2 * h] += fastln_low8(dx_hat16) * (fastln_load8_f32(x + 16 * h) * x_scale);
        sum_dxhat_xhat[2 * h + 1] +=
            fastln_high8(dx_hat16) * (fastln_load8_f32(x + 16 * h + 8) * x_scale);
    }
}

/* float32 rows are written in float32, 16 lanes at a time (x_hat = x * rstd):
 *     dx = (dx_hat - x_hat * mean(dx_hat * x_hat)) * rstd,   dgamma += dy * x_hat
 * each product rounded once, the dgamma product then widened into the double accumulators.
 * An rstd that does not fit a float32 (eps = 0 with values near float32's smallest, NaN, or
 * the x_scale = 0 of an all-zero row) takes the double pass. */
FASTLN_INLINE int fastln_rms_backward_in_vectors_f32(const fastln_rms_backward_row *row)
{
    return row->x_scale > 1e-30 && row->x_scale < 1e30 && row->rstd == row->x_scale;
}

/* dx for sixteen elements of a row; their dy * x_hat is returned in *dgamma16. */
FASTLN_INLINE fastln_f16 fastln_rms_backward_dx16_f32(
    const float *dy, const float *x, const float *gamma, float rstd, float mean,
    fastln_f16 *dgamma16)
{
    fastln_f16 dy16, x16, scale16;
    memcpy(&dy16, dy, sizeof dy16);
    memcpy(&x16, x, sizeof x16);
    const fastln_f16 x_hat = x16 * rstd;
    fastln_f16 dx_hat = dy16;
    if (gamma) {
        memcpy(&scale16, gamma, sizeof scale16);
        dx_hat *= scale16;
    }
    *dgamma16 = dy16 * x_hat;
    return (dx_hat - x_hat * mean) * rstd;
}

/* The float32 write pass over width columns of n_rows consecutive rows (one row, or a group):
 * each sixteen dgamma accumulators are loaded and stored once, and the rows add to them in row
 * order. */
FASTLN_INLINE void fastln_rms_backward_write_rows_f32(
    const float *dy, const float *x, const float *gamma, float *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_rms_backward_row *rows, double *dgamma_acc)
{
    float rstd[FASTLN_RMS_BACKWARD_GROUP], mean[FASTLN_RMS_BACKWARD_GROUP];
    for (int64_t r = 0; r < n_rows; r++) {
        if (!fastln_rms_backward_in_vectors_f32(&rows[r])) {
            /* (only a single row gets here: a group with such a row goes row by row) */
            fastln_rms_backward_write_rows_double_f32(dy, x, gamma, dx, n_rows, stride, width,
                                                      rows, dgamma_acc);
            return;
        }
        rstd[r] = (float)rows[r].rstd;
        mean[r] = (float)rows[r].mean_dxhat_xhat;
    }
    int64_t i = 0;
    for (; i + 16 <= width; i += 16) {
        fastln_d8 dgamma_low = fastln_load8_f64(dgamma_acc + i);
        fastln_d8 dgamma_high = fastln_load8_f64(dgamma_acc + i + 8);
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t at = r * stride + i;
            fastln_f16 dgamma16;
            const fastln_f16 dx16 = fastln_rms_backward_dx16_f32(
                dy + at, x + at, gamma ? gamma + i : NULL, rstd[r], mean[r], &dgamma16);
            memcpy(dx + at, &dx16, sizeof dx16);
            dgamma_low += fastln_low8(dgamma16);
            dgamma_high += fastln_high8(dgamma16);
        }
        fastln_store8_f64(dgamma_acc + i, dgamma_low);
        fastln_store8_f64(dgamma_acc + i + 8, dgamma_high);
    }
    for (; i < width; i++) /* the last width % 16: each lane's arithmetic, one at a time */
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t at = r * stride + i;
            const float dy_i = dy[at], x_hat = x[at] * rstd[r]; /* read before dx (may be dy) */
            const float dx_hat = gamma ? dy_i * gamma[i] : dy_i;
            dgamma_acc[i] += (double)(dy_i * x_hat);
            dx[at] = (dx_hat - x_hat * mean[r]) * rstd[r];
        }
}

#endif /* FASTLN_RMS_NORM_H */
