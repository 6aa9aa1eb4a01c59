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
    const float *dy, const float *x, const float *gamma, float *dx, int64_t n_cols, double mean,
    double mean_correction, double rstd, double total_dxhat, double total_dxhat_xhat,
    float *dgamma_acc, float *dbeta_acc, int streaming);
FASTLN_INLINE void fastln_ln_backward_write_row_f64(
    const double *dy, const double *x, const double *gamma, double *dx, int64_t n_cols,
    double mean, double mean_correction, double rstd, double total_dxhat,
    double total_dxhat_xhat, double *dgamma_acc, double *dbeta_acc, int streaming);

/* The backward's per-row dgamma/dbeta accumulators are FASTLN_ACC_T (fastln/instantiate.h):
 * float32 rows accumulate FASTLN_ROWS_PER_FLUSH rows in float before the caller folds them into
 * double partial sums; float64 rows accumulate in double directly. */
#define FASTLN_ROWS_PER_FLUSH 16

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
 * conversions of the all-double version. */
FASTLN_INLINE void fastln_ln_backward_accumulate_f32(
    const float *dy, const float *x, const float *gamma, double mean,
    fastln_d8 sum_dxhat[FASTLN_ACCUMULATORS], fastln_d8 sum_dxhat_d[FASTLN_ACCUMULATORS],
    fastln_d8 sum_d[FASTLN_ACCUMULATORS])
{
    const float mean_f = (float)mean;
    float dx_hat[FASTLN_BLOCK], d[FASTLN_BLOCK];
    for (int k = 0; k < FASTLN_BLOCK; k++) {
        dx_hat[k] = gamma ? dy[k] * gamma[k] : dy[k];
        d[k] = x[k] - mean_f;
    }
    FASTLN_UNROLL_ACCUMULATORS
    for (int a = 0; a < FASTLN_ACCUMULATORS; a++) {
        const fastln_d8 dx_hat8 = fastln_load8_f32(dx_hat + 8 * a);
        const fastln_d8 d8 = fastln_load8_f32(d + 8 * a);
        sum_dxhat[a] += dx_hat8;
        sum_dxhat_d[a] += dx_hat8 * d8;
        sum_d[a] += d8;
    }
}

/* float64 backward rows: the double write pass (with streaming stores when asked). */
FASTLN_INLINE void fastln_ln_backward_write_row_f64(
    const double *dy, const double *x, const double *gamma, double *dx, int64_t n_cols,
    double mean, double mean_correction, double rstd, double total_dxhat,
    double total_dxhat_xhat, double *dgamma_acc, double *dbeta_acc, int streaming)
{
    fastln_ln_backward_write_row_double_f64(dy, x, gamma, dx, n_cols, mean, mean_correction,
                                            rstd, total_dxhat, total_dxhat_xhat, dgamma_acc,
                                            dbeta_acc, streaming);
}

/* float32 backward rows in float32, like the forward's write pass:
 *     dx = rstd * ((dx_hat - mean(dx_hat)) - x_hat * mean(dx_hat * x_hat))
 * with both means taken in double by the first pass and x_hat centred on a float32 head + tail
 * mean. Subtracting mean(dx_hat) first keeps the cancellation inside one float32 rounding (a
 * one-element row gives dx = 0 exactly). Rows whose rstd does not fit a float32 take the double
 * path. With streaming set (and dx aligned), dx goes out with non-temporal stores. */
FASTLN_INLINE void fastln_ln_backward_write_row_f32(
    const float *dy, const float *x, const float *gamma, float *dx, int64_t n_cols, double mean,
    double mean_correction, double rstd, double total_dxhat, double total_dxhat_xhat,
    float *dgamma_acc, float *dbeta_acc, int streaming)
{
    if (!(rstd > 1e-30 && rstd < 1e30)) {
        fastln_ln_backward_write_row_double_f32(dy, x, gamma, dx, n_cols, mean, mean_correction,
                                                rstd, total_dxhat, total_dxhat_xhat, dgamma_acc,
                                                dbeta_acc, 0);
        return;
    }
    const float mean_head = (float)mean; /* mean is a float32 value already (the cache's) */
    const float mean_tail = (float)mean_correction;
    const float rstd_f = (float)rstd;
    const float mean_dxhat = (float)(total_dxhat / (double)n_cols);
    const float mean_dxhat_xhat = (float)(total_dxhat_xhat / (double)n_cols);
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
        fastln_f16 dy16, x16, scale = {0}, dgamma16, dbeta16;
        memcpy(&dy16, dy + i, sizeof dy16);
        memcpy(&x16, x + i, sizeof x16);
        if (gamma) memcpy(&scale, gamma + i, sizeof scale);
        memcpy(&dgamma16, dgamma_acc + i, sizeof dgamma16);
        memcpy(&dbeta16, dbeta_acc + i, sizeof dbeta16);
        const fastln_f16 x_hat = ((x16 - mean_head) - mean_tail) * rstd_f;
        const fastln_f16 dx_hat = gamma ? dy16 * scale : dy16;
        const fastln_f16 dx16 = ((dx_hat - mean_dxhat) - x_hat * mean_dxhat_xhat) * rstd_f;
        dgamma16 += dy16 * x_hat;
        dbeta16 += dy16;
        memcpy(dgamma_acc + i, &dgamma16, sizeof dgamma16);
        memcpy(dbeta_acc + i, &dbeta16, sizeof dbeta16);
        if (stream_dx)
            fastln_stream16_f32(dx + i, dx16);
        else
            memcpy(dx + i, &dx16, sizeof dx16);
    }
    if (stream_dx) fastln_streaming_fence();
    for (; i < n_cols; i++) {
        const float x_hat = ((x[i] - mean_head) - mean_tail) * rstd_f;
        const float dx_hat = gamma ? dy[i] * gamma[i] : dy[i];
        const float dy_i = dy[i];
        dx[i] = ((dx_hat - mean_dxhat) - x_hat * mean_dxhat_xhat) * rstd_f;
        dgamma_acc[i] += dy_i * x_hat;
        dbeta_acc[i] += dy_i;
    }
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

#endif /* FASTLN_LAYER_NORM_H */
