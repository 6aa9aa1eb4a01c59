/* BatchNorm kernels for float32 (suffix _f32) and float64 (suffix _f64).
 *
 * x is viewed as a C-contiguous (n_outer, n_features, n_inner) array: n_features is the feature
 * axis, and each feature's statistics run over the n_outer * n_inner values of its column
 * (n_inner = 1 for (N, C) data with the features last; n_inner = H * W for NCHW images).
 *
 * Two layouts, chosen from the shape alone:
 *   - rows (n_inner == 1): a row holds one value of every feature; the kernels sweep rows and
 *     keep one accumulator per feature, eight features per vector.
 *   - segments (n_inner > 1): one feature's values come in contiguous segments of n_inner; the
 *     kernels reduce a feature's segments with the fixed-order vector accumulators of common.h.
 * The caller splits the outer axis into blocks whose layout depends only on the shape, runs the
 * blocks (and features) in any order on any thread, and adds the per-block partial sums in
 * block order (fastln_bn_combine_partials): the result is identical for every thread count.
 *
 * Statistics are accumulated in double, shifted by a value of the feature itself (its first
 * value), so features with |mean| >> std do not cancel (the LayerNorm trap, down a column). The
 * per-feature finishing steps (fastln_bn_*_constants) are plain loops over the features.
 *
 * float64 features can leave double's range where float32 ones cannot: squares of values beyond
 * ~1e154 overflow, and with eps ~ 0 squares of spreads below ~1e-154 underflow. The finishing
 * steps let such a feature through (NaN, or a variance that is only rounding noise); the rare
 * path of batch_norm_impl.h (fastln_bn_rescale_*), run after them and tested per feature, takes
 * its statistics again on deviations scaled by an exact power of two. The hot loops never see
 * it. */
#ifndef FASTLN_BATCH_NORM_H
#define FASTLN_BATCH_NORM_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "fastln/common.h"

/* Sum the per-block partials (n_blocks rows of n_features doubles) in block order. */
static inline void fastln_bn_combine_partials(const double *FASTLN_RESTRICT partials,
                                              int64_t n_blocks, int64_t n_features,
                                              double *FASTLN_RESTRICT out)
{
    for (int64_t c = 0; c < n_features; c++) {
        double total = 0.0;
        for (int64_t b = 0; b < n_blocks; b++) total += partials[b * n_features + c];
        out[c] = total;
    }
}

/* Training forward: batch mean, biased variance and rstd of every feature from its shifted sums
 * over `count` values, and the constants of the write pass
 *     y = ((x - shift) - center) * scale + offset,  center = mean - shift, scale = rstd * gamma.
 * gamma and beta (double) may be NULL (ones and zeros). */
static inline void fastln_bn_train_constants(
    int64_t n_features, double count, const double *shift, const double *sum,
    const double *sumsq, const double *gamma, const double *beta, double eps, double *mean_out,
    double *var_out, double *rstd_out, double *center_out, double *scale_out, double *offset_out)
{
    for (int64_t c = 0; c < n_features; c++) {
        const double mean_shifted = sum[c] / count;
        double var = sumsq[c] / count - mean_shifted * mean_shifted;
        if (var < 0.0) var = 0.0; /* rounding only; NaN stays NaN */
        const double rstd = 1.0 / sqrt(var + eps);
        mean_out[c] = shift[c] + mean_shifted;
        var_out[c] = var;
        rstd_out[c] = rstd;
        center_out[c] = mean_shifted;
        /* A constant feature with eps = 0: every deviation is exactly 0 and x_hat is 0
         * (y = beta), not 0 * inf = NaN. rstd still reports inf. */
        const double x_hat_scale = var + eps == 0.0 ? 0.0 : rstd;
        scale_out[c] = gamma ? x_hat_scale * gamma[c] : x_hat_scale;
        offset_out[c] = beta ? beta[c] : 0.0;
    }
}

/* Evaluation forward: the same write-pass constants from the running statistics
 * (shift = running_mean, center = 0). */
static inline void fastln_bn_eval_constants(
    int64_t n_features, const double *running_mean, const double *running_var,
    const double *gamma, const double *beta, double eps, double *mean_out, double *rstd_out,
    double *shift_out, double *center_out, double *scale_out, double *offset_out)
{
    for (int64_t c = 0; c < n_features; c++) {
        const double rstd = 1.0 / sqrt(running_var[c] + eps);
        mean_out[c] = running_mean[c];
        rstd_out[c] = rstd;
        shift_out[c] = running_mean[c];
        center_out[c] = 0.0;
        scale_out[c] = gamma ? rstd * gamma[c] : rstd;
        offset_out[c] = beta ? beta[c] : 0.0;
    }
}

/* Backward: dgamma, dbeta and the constants of the dx pass from the sums over each feature's
 * `count` values of dy, dy * d and d, with d = x - mean (mean and rstd as the forward used).
 *
 * Training (the lesson's two-reduction identity down the batch axis):
 *     x_hat = (d - correction) * rstd,  correction = mean(d)  (exact mean; see below)
 *     dgamma = sum(dy * x_hat),  dbeta = sum(dy)
 *     dx = gamma * rstd * (dy - dbeta / count - x_hat * dgamma / count)
 *        = k * ((dy - mean_dy) - (d - correction) * coef)
 * The correction re-derives the batch mean from x itself, so a mean rounded in the cache costs
 * nothing (the same device as LayerNorm's backward).
 * Evaluation (the affine map): dx = dy * k with k = gamma * rstd, x_hat = d * rstd; the dx
 * constants mean_dy, correction and coef are 0. gamma (double) may be NULL (ones). */
static inline void fastln_bn_backward_constants(
    int64_t n_features, double count, int training, const double *rstd, const double *gamma,
    const double *sum_dy, const double *sum_dy_d, const double *sum_d, double *dgamma_out,
    double *dbeta_out, double *correction_out, double *k_out, double *mean_dy_out,
    double *coef_out)
{
    for (int64_t c = 0; c < n_features; c++) {
        const double correction = training ? sum_d[c] / count : 0.0;
        /* rstd = inf: a constant feature with eps = 0, whose x_hat is 0 (see the forward). */
        const double dgamma =
            isinf(rstd[c]) ? 0.0 * sum_dy[c] : rstd[c] * (sum_dy_d[c] - correction * sum_dy[c]);
        dgamma_out[c] = dgamma;
        dbeta_out[c] = sum_dy[c];
        correction_out[c] = correction;
        k_out[c] = gamma ? gamma[c] * rstd[c] : rstd[c];
        mean_dy_out[c] = training ? sum_dy[c] / count : 0.0;
        coef_out[c] = training && !isinf(rstd[c]) ? rstd[c] * dgamma / count : 0.0;
    }
}

/* The rare path takes a feature again when its variance and eps are both below this (its
 * squares may have underflowed; LayerNorm's FASTLN_TINY), and in the backward when rstd is above
 * FASTLN_BN_RSTD_HUGE = 1 / sqrt(FASTLN_BN_TINY) (its dy * (x - mean) may underflow). */
#define FASTLN_BN_TINY 1e-250
#define FASTLN_BN_RSTD_HUGE 1e125

/* 1 / sqrt(var + eps) as rstd_scaled * 2^exponent, given var = var_scaled * 2^(-2 exponent):
 * 1 / sqrt(var_scaled + eps * 2^(2 exponent)). When eps * 2^(2 exponent) is beyond double, var
 * (below eps by more than double's range) is nothing next to eps. */
static inline double fastln_bn_scaled_rstd(double var_scaled, double eps, int exponent)
{
    const double eps_scaled = ldexp(eps, 2 * exponent);
    if (isinf(eps_scaled)) return ldexp(1.0 / sqrt(eps), -exponent);
    return 1.0 / sqrt(var_scaled + eps_scaled);
}

/* The backward's rstd / 2^exponent: the cache's rstd exactly, when it is a normal double; else
 * (inf: beyond double, for spreads below ~5e-309 with eps = 0; or subnormal, for spreads near
 * double's largest) recomputed as the forward did. */
static inline double fastln_bn_backward_scaled_rstd(double rstd, double var_scaled, double eps,
                                                    int exponent)
{
    return isnormal(rstd) ? ldexp(rstd, -exponent)
                          : fastln_bn_scaled_rstd(var_scaled, eps, exponent);
}

/* scaled * 2^exponent is what the write passes can use: a normal double, or an exact 0. */
static inline int fastln_bn_in_range(double scaled, int exponent)
{
    return scaled == 0.0 || isnormal(ldexp(scaled, exponent));
}

#define FASTLN_TEMPLATE "fastln/batch_norm_impl.h"
#include "fastln/instantiate.h"
#undef FASTLN_TEMPLATE

#endif /* FASTLN_BATCH_NORM_H */
