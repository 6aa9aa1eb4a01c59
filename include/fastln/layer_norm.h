/* LayerNorm row kernels for float32 (suffix _f32) and float64 (suffix _f64).
 *
 * The per-row functions are written once in layer_norm_impl.h and instantiated here for each
 * element type. All arithmetic is in double. */
#ifndef FASTLN_LAYER_NORM_H
#define FASTLN_LAYER_NORM_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include "fastln/common.h"

/* A row's backward sums from its first pass (fastln_ln_backward_first_pass_*), in double:
 * sum(dx_hat), sum(dx_hat * d) with d = x - mean, and the two that the write pass takes,
 * mean(d) (the correction to the cache's mean) and sum(dx_hat * x_hat); n_cols is the row's
 * length (the write pass may be given a piece of the row). */
typedef struct {
    double mean, rstd, mean_correction, total_dxhat, total_dxhat_d, total_dxhat_xhat;
    int64_t n_cols;
} fastln_ln_backward_sums;

/* The write pass of a row, per element type (the forward calls fastln_ln_write_row_*). */
FASTLN_INLINE void fastln_ln_write_row_f32(
    const float *x, const float *gamma, const float *beta, float *y, int64_t n_cols,
    double shift, double mean_shifted, double rstd, int streaming);
FASTLN_INLINE void fastln_ln_write_row_f64(
    const double *x, const double *gamma, const double *beta, double *y, int64_t n_cols,
    double shift, double mean_shifted, double rstd, int streaming);

FASTLN_INLINE void fastln_ln_backward_accumulate_f32(
    const float *dy, const float *x, const float *gamma, double mean,
    fastln_d8 sum_dxhat[FASTLN_ACCUMULATORS], fastln_d8 sum_dxhat_d[FASTLN_ACCUMULATORS],
    fastln_d8 sum_d[FASTLN_ACCUMULATORS]);
FASTLN_INLINE void fastln_ln_backward_accumulate_f64(
    const double *dy, const double *x, const double *gamma, double mean,
    fastln_d8 sum_dxhat[FASTLN_ACCUMULATORS], fastln_d8 sum_dxhat_d[FASTLN_ACCUMULATORS],
    fastln_d8 sum_d[FASTLN_ACCUMULATORS]);
FASTLN_INLINE void fastln_ln_backward_write_row_f32(
    const float *dy, const float *x, const float *gamma, float *dx, int64_t n_cols,
    const fastln_ln_backward_sums *sums, float *dgamma_acc, float *dbeta_acc, int streaming);
FASTLN_INLINE void fastln_ln_backward_write_row_f64(
    const double *dy, const double *x, const double *gamma, double *dx, int64_t n_cols,
    const fastln_ln_backward_sums *sums, double *dgamma_acc, double *dbeta_acc, int streaming);

/* The group write passes of the backward (fastln_layer_norm_backward_rows_*), and whether a
 * row's sums let it take one. */
FASTLN_INLINE void fastln_ln_backward_write_rows_f32(
    const float *dy, const float *x, const float *gamma, float *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_ln_backward_sums *sums, float *dgamma_acc,
    float *dbeta_acc);
FASTLN_INLINE void fastln_ln_backward_write_rows_f64(
    const double *dy, const double *x, const double *gamma, double *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_ln_backward_sums *sums, double *dgamma_acc,
    double *dbeta_acc);
FASTLN_INLINE int fastln_ln_backward_in_vectors_f32(const fastln_ln_backward_sums *sums);
FASTLN_INLINE int fastln_ln_backward_in_vectors_f64(const fastln_ln_backward_sums *sums);

/* The backward's per-row dgamma/dbeta accumulators are FASTLN_ACC_T (fastln/instantiate.h):
 * float32 rows accumulate FASTLN_ROWS_PER_FLUSH rows in float before the caller folds them into
 * double partial sums; float64 rows accumulate in double directly. */
#define FASTLN_ROWS_PER_FLUSH 16

/* Backward rows go through the write pass together in groups of this many (a divisor of
 * FASTLN_ROWS_PER_FLUSH): see fastln_layer_norm_backward_rows. */
#define FASTLN_BACKWARD_GROUP 8

/* The one-pass variance sum(d * d) / n - mean(d)^2 is recomputed around the mean when the two
 * terms cancel by more than this factor (4 bits): a row whose first element lies more than four
 * standard deviations from its mean. */
#define FASTLN_MAX_CANCELLATION 16.0

/* Variances (and eps) below this are taken again on rescaled values: their squares may have
 * underflowed in double. */
#define FASTLN_TINY 1e-250

/* One row's statistics (fastln_ln_statistics_*): the sums are taken on x - shift (shift = x[0],
 * or the mean where those sums overflow), and x_hat = ((x - shift) - mean_shifted) * rstd,
 * rstd = 1 / sqrt(var + eps). Where rstd is beyond double's range (Inf: eps = 0 and a spread
 * below ~1e-308), x_hat is ldexp((x - shift) - mean_shifted, exponent) * rstd_scaled instead;
 * otherwise rstd = ldexp(rstd_scaled, exponent) (exponent = 0 but on the rescaled path). var is
 * 0 only for a constant row (and is in units of 4^-exponent). */
typedef struct {
    double shift, mean_shifted, var, rstd, rstd_scaled;
    int exponent;
} fastln_ln_stats;

#define FASTLN_TEMPLATE "fastln/layer_norm_impl.h"
#include "fastln/instantiate.h"
#undef FASTLN_TEMPLATE

/* Folds float accumulators into double partial sums and clears them (float32 backward). */
FASTLN_DISPATCH
static void fastln_flush_accumulators_f32(
    float *FASTLN_RESTRICT accumulators, double *FASTLN_RESTRICT partials, int64_t n)
{
    for (int64_t j = 0; j < n; j++) {
        partials[j] += (double)accumulators[j];
        accumulators[j] = 0.0f;
    }
}

/* float64 backward rows: the double sums. */
FASTLN_INLINE void fastln_ln_backward_accumulate_f64(
    const double *dy, const double *x, const double *gamma, double mean,
    fastln_d8 sum_dxhat[FASTLN_ACCUMULATORS], fastln_d8 sum_dxhat_d[FASTLN_ACCUMULATORS],
    fastln_d8 sum_d[FASTLN_ACCUMULATORS])
{
    fastln_ln_backward_accumulate_double_f64(dy, x, gamma, mean, sum_dxhat, sum_dxhat_d, sum_d);
}

/* float32 backward rows: dx_hat = dy * gamma and d = x - mean are formed in float32 (one
 * rounding each, relative to the value itself: no cancellation, since mean is the cache's float32
 * mean and the sums below re-derive its correction), then widened and summed in double. Half the
 * conversions of the all-double version. Each 16-lane product is widened in registers, half by
 * half: going through a stack array instead cost a failed store-to-load forward per half (the
 * first pass ran 1.5x slower). Element k still lands in accumulator k / 8. */
FASTLN_INLINE void fastln_ln_backward_accumulate_f32(
    const float *dy, const float *x, const float *gamma, double mean,
    fastln_d8 sum_dxhat[FASTLN_ACCUMULATORS], fastln_d8 sum_dxhat_d[FASTLN_ACCUMULATORS],
    fastln_d8 sum_d[FASTLN_ACCUMULATORS])
{
    const float mean_f = (float)mean;
    FASTLN_UNROLL_ACCUMULATORS
    for (int h = 0; h < FASTLN_ACCUMULATORS / 2; h++) {
        fastln_f16 dy16, x16, scale16;
        memcpy(&dy16, dy + 16 * h, sizeof dy16);
        memcpy(&x16, x + 16 * h, sizeof x16);
        fastln_f16 dx_hat16 = dy16;
        if (gamma) {
            memcpy(&scale16, gamma + 16 * h, sizeof scale16);
            dx_hat16 *= scale16;
        }
        const fastln_f16 d16 = x16 - mean_f;
        const fastln_d8 dx_hat_low = fastln_low8(dx_hat16), dx_hat_high = fastln_high8(dx_hat16);
        const fastln_d8 d_low = fastln_low8(d16), d_high = fastln_high8(d16);
        sum_dxhat[2 * h] += dx_hat_low;
        sum_dxhat_d[2 * h] += dx_hat_low * d_low;
        sum_d[2 * h] += d_low;
        sum_dxhat[2 * h + 1] += dx_hat_high;
        sum_dxhat_d[2 * h + 1] += dx_hat_high * d_high;
        sum_d[2 * h + 1] += d_high;
    }
}

/* float64 backward rows: the double write pass (with streaming stores when asked). */
FASTLN_INLINE void fastln_ln_backward_write_row_f64(
    const double *dy, const double *x, const double *gamma, double *dx, int64_t n_cols,
    const fastln_ln_backward_sums *sums, double *dgamma_acc, double *dbeta_acc, int streaming)
{
    fastln_ln_backward_write_row_double_f64(dy, x, gamma, dx, n_cols, sums, dgamma_acc,
                                            dbeta_acc, streaming);
}

FASTLN_INLINE void fastln_ln_backward_write_rows_f64(
    const double *dy, const double *x, const double *gamma, double *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_ln_backward_sums *sums, double *dgamma_acc,
    double *dbeta_acc)
{
    fastln_ln_backward_write_rows_double_f64(dy, x, gamma, dx, n_rows, stride, width, sums,
                                             dgamma_acc, dbeta_acc);
}

FASTLN_INLINE int fastln_ln_backward_in_vectors_f64(const fastln_ln_backward_sums *sums)
{
    (void)sums;
    return 1;
}

/* float32 backward rows in float32, like the forward's write pass:
 *     dx = rstd * ((dx_hat - mean(dx_hat)) - x_hat * mean(dx_hat * x_hat))
 * with both means taken in double by the first pass and x_hat centred on a float32 head + tail
 * mean. Subtracting mean(dx_hat) first keeps the cancellation inside one float32 rounding (a
 * one-element row gives dx = 0 exactly). Rows whose rstd does not fit a float32 take the double
 * path (fastln_ln_backward_in_vectors_f32). */
typedef struct {
    float mean_head, mean_tail, rstd, mean_dxhat, mean_dxhat_xhat;
} fastln_ln_backward_f32;

FASTLN_INLINE int fastln_ln_backward_in_vectors_f32(const fastln_ln_backward_sums *sums)
{
    return sums->rstd > 1e-30 && sums->rstd < 1e30;
}

FASTLN_INLINE fastln_ln_backward_f32 fastln_ln_backward_to_f32(const fastln_ln_backward_sums *sums)
{
    const double n = (double)sums->n_cols;
    fastln_ln_backward_f32 row;
    row.mean_head = (float)sums->mean; /* mean is a float32 value already (the cache's) */
    row.mean_tail = (float)sums->mean_correction;
    row.rstd = (float)sums->rstd;
    row.mean_dxhat = (float)(sums->total_dxhat / n);
    row.mean_dxhat_xhat = (float)(sums->total_dxhat_xhat / n);
    return row;
}

/* dx for sixteen elements of a row; their dy * x_hat and dy are added to dgamma16 and dbeta16.
 * The single-row and the group write passes both take it, so their results are the same bits. */
FASTLN_INLINE fastln_f16 fastln_ln_backward_dx16_f32(
    const float *dy, const float *x, const float *gamma, const fastln_ln_backward_f32 *row,
    fastln_f16 *dgamma16, fastln_f16 *dbeta16)
{
    fastln_f16 dy16, x16, scale = {0};
    memcpy(&dy16, dy, sizeof dy16);
    memcpy(&x16, x, sizeof x16);
    if (gamma) memcpy(&scale, gamma, sizeof scale);
    const fastln_f16 x_hat = ((x16 - row->mean_head) - row->mean_tail) * row->rstd;
    const fastln_f16 dx_hat = gamma ? dy16 * scale : dy16;
    *dgamma16 += dy16 * x_hat;
    *dbeta16 += dy16;
    return ((dx_hat - row->mean_dxhat) - x_hat * row->mean_dxhat_xhat) * row->rstd;
}

/* The same for one element (those outside whole chunks of sixteen). */
FASTLN_INLINE float fastln_ln_backward_dx1_f32(
    float dy, float x, const float *gamma, const fastln_ln_backward_f32 *row, float *dgamma,
    float *dbeta)
{
    const float x_hat = ((x - row->mean_head) - row->mean_tail) * row->rstd;
    const float dx_hat = gamma ? dy * *gamma : dy;
    *dgamma += dy * x_hat;
    *dbeta += dy;
    return ((dx_hat - row->mean_dxhat) - x_hat * row->mean_dxhat_xhat) * row->rstd;
}

/* The float32 write pass over n_cols elements of a row (the row, or a piece of it). With
 * streaming set (and dx aligned), dx goes out with non-temporal stores. */
FASTLN_INLINE void fastln_ln_backward_write_row_f32(
    const float *dy, const float *x, const float *gamma, float *dx, int64_t n_cols,
    const fastln_ln_backward_sums *sums, float *dgamma_acc, float *dbeta_acc, int streaming)
{
    if (!fastln_ln_backward_in_vectors_f32(sums)) {
        fastln_ln_backward_write_row_double_f32(dy, x, gamma, dx, n_cols, sums, dgamma_acc,
                                                dbeta_acc, 0);
        return;
    }
    const fastln_ln_backward_f32 row = fastln_ln_backward_to_f32(sums);
    const int stream_dx = streaming && fastln_is_aligned16(dx);
    int64_t i = 0;
    for (; i + 16 <= n_cols; i += 16) {
        if (streaming) {
            /* The next row, for the next first pass: it pays when rows come from memory (the
             * streaming sizes: 7-14% there); below, where they come from cache, it cost 6-20%
             * (measured at 512x768 and 4096x768). */
            __builtin_prefetch(dy + n_cols + i, 0, 3);
            __builtin_prefetch(x + n_cols + i, 0, 3);
        }
        fastln_f16 dgamma16, dbeta16;
        memcpy(&dgamma16, dgamma_acc + i, sizeof dgamma16);
        memcpy(&dbeta16, dbeta_acc + i, sizeof dbeta16);
        const fastln_f16 dx16 = fastln_ln_backward_dx16_f32(
            dy + i, x + i, gamma ? gamma + i : NULL, &row, &dgamma16, &dbeta16);
        memcpy(dgamma_acc + i, &dgamma16, sizeof dgamma16);
        memcpy(dbeta_acc + i, &dbeta16, sizeof dbeta16);
        if (stream_dx)
            fastln_stream16_f32(dx + i, dx16);
        else
            memcpy(dx + i, &dx16, sizeof dx16);
    }
    if (stream_dx) fastln_streaming_fence();
    for (; i < n_cols; i++)
        dx[i] = fastln_ln_backward_dx1_f32(dy[i], x[i], gamma ? gamma + i : NULL, &row,
                                           dgamma_acc + i, dbeta_acc + i);
}

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

/* The float32 write pass of n_rows consecutive rows together (fastln_layer_norm_backward_rows),
 * over width columns of rows stride elements apart: each sixteen accumulators are loaded and
 * stored once for the group, and the rows add to them in row order, as row after row would. */
FASTLN_INLINE void fastln_ln_backward_write_rows_f32(
    const float *dy, const float *x, const float *gamma, float *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_ln_backward_sums *sums, float *dgamma_acc,
    float *dbeta_acc)
{
    fastln_ln_backward_f32 rows[FASTLN_BACKWARD_GROUP];
    for (int64_t r = 0; r < n_rows; r++) rows[r] = fastln_ln_backward_to_f32(&sums[r]);
    int64_t i = 0;
    for (; i + 16 <= width; i += 16) {
        fastln_f16 dgamma16, dbeta16;
        memcpy(&dgamma16, dgamma_acc + i, sizeof dgamma16);
        memcpy(&dbeta16, dbeta_acc + i, sizeof dbeta16);
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t at = r * stride + i;
            const fastln_f16 dx16 = fastln_ln_backward_dx16_f32(
                dy + at, x + at, gamma ? gamma + i : NULL, &rows[r], &dgamma16, &dbeta16);
            memcpy(dx + at, &dx16, sizeof dx16);
        }
        memcpy(dgamma_acc + i, &dgamma16, sizeof dgamma16);
        memcpy(dbeta_acc + i, &dbeta16, sizeof dbeta16);
    }
    for (; i < width; i++)
        for (int64_t r = 0; r < n_rows; r++)
            dx[r * stride + i] = fastln_ln_backward_dx1_f32(
                dy[r * stride + i], x[r * stride + i], gamma ? gamma + i : NULL, &rows[r],
                dgamma_acc + i, dbeta_acc + i);
}

#endif /* FASTLN_LAYER_NORM_H */
