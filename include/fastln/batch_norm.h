/* BatchNorm's per-feature arithmetic, the same for every storage type: the layout of its tasks,
 * the block partial sums added in block order, and the constants of the write passes. Plain
 * loops over the features, in double.
 *
 * x is viewed as a C-contiguous (n_outer, n_features, n_inner) array: each feature's statistics
 * run over the n_outer * n_inner values of its column (n_inner = 1 for (N, C) data with the
 * features last - the rows layout; n_inner = H * W for NCHW images - the segments layout). The
 * outer axis is cut into blocks whose layout depends on the shape alone; the blocks' partial
 * sums are added in block order, so the results are identical for every thread count.
 *
 * Statistics are accumulated in double, shifted by a value of the feature itself (its first
 * value), so features with |mean| >> std do not cancel. float64 features can leave double's
 * range where narrower ones cannot: squares of values beyond ~1e154 overflow, and with eps ~ 0
 * squares of spreads below ~1e-154 underflow. The constants below let such a feature through
 * (NaN, or a variance that is only rounding noise); the rare path of fastln/rare.h, run after
 * them and tested per feature, takes its statistics again on deviations scaled by an exact
 * power of two. The hot loops never see it. */
#ifndef FASTLN_BATCH_NORM_H
#define FASTLN_BATCH_NORM_H

#include <float.h>
#include <math.h>
#include <stdint.h>

/* The segments layout cuts the outer axis so that a block holds at least this many values of a
 * feature; the rows layout gives threads the features in chunks of FASTLN_BN_FEATURE_CHUNK
 * (features never mix, so the chunking changes no result) and writes in chunks of about
 * FASTLN_BN_APPLY_ELEMENTS. */
#define FASTLN_BN_SEGMENT_BLOCK_ELEMENTS 16384
#define FASTLN_BN_FEATURE_CHUNK 512
#define FASTLN_BN_APPLY_ELEMENTS 8192
/* How the rows layout's float write passes (BatchNorm's forward and backward, channels-last
 * GroupNorm: fastln/forward.h, bn_apply_rows_float) go over their rows: one at a time with plain
 * stores, one at a time with non-temporal stores (streamed outputs), or in groups of
 * FASTLN_BN_APPLY_GROUP rows with plain stores, for inputs below FASTLN_BN_GROUP_MAX_BYTES
 * (from memory the group's interleaved rows measured slower than one row at a time). */
enum { FASTLN_ROWS_ALONE = 0, FASTLN_ROWS_STREAMED = 1, FASTLN_ROWS_GROUPED = 2 };
#define FASTLN_BN_APPLY_GROUP 4
#define FASTLN_BN_GROUP_MAX_BYTES (8 * 1024 * 1024)

static inline int fastln_rows_store(int streaming, int64_t input_bytes)
{
    if (streaming) return FASTLN_ROWS_STREAMED;
    return input_bytes < FASTLN_BN_GROUP_MAX_BYTES ? FASTLN_ROWS_GROUPED : FASTLN_ROWS_ALONE;
}
/* Streamed rows come from memory: as a row is written, the float write passes fetch the same
 * columns of the row this many rows on into L2 (inside the array only): two rows, or whole rows
 * to FASTLN_FETCH_AHEAD_BYTES, as LayerNorm's backward (prefetch_step_ahead). The hardware
 * prefetcher alone left the backward's dx pass waiting on its loads of dy and x
 * (docs/performance.md, "BatchNorm's streamed rows fetched ahead"). */
static inline int64_t fastln_rows_fetched_ahead(int64_t row_bytes)
{
    return fastln_max(2, (FASTLN_FETCH_AHEAD_BYTES + row_bytes - 1) / fastln_max(row_bytes, 1));
}

/* The backward taking whole features (bn_backward_features_task) prefetches the next feature
 * when x is large (call->streaming) and its segments are shorter than this; longer ones are
 * read by groups of features, fetched ahead (below). */
#define FASTLN_BN_PREFETCH_SEGMENT_BYTES 512
/* It takes features whose segments sum in float (FASTLN_BN_FLOAT_SEGMENT values and more) in
 * groups, sample by sample, so that each read goes over at least this many contiguous bytes:
 * one feature's segments a sample apart restart the hardware prefetchers every few KB. At most
 * FASTLN_BN_FEATURE_GROUP_MAX features, whose dy and x (read again by the dx pass) fit in
 * FASTLN_BN_FEATURE_GROUP_CACHE bytes. */
#define FASTLN_BN_FEATURE_GROUP_BYTES 8192
#define FASTLN_BN_FEATURE_GROUP_MAX 8
#define FASTLN_BN_FEATURE_GROUP_CACHE (256 * 1024)
/* From this many bytes of dy, x and dx, it fetches each sample's values ahead into L2, when a
 * group's segments in one sample are shorter than FASTLN_BN_FEATURES_AHEAD_SPAN bytes. */
#define FASTLN_BN_FEATURES_AHEAD_BYTES (16 * 1024 * 1024)
#define FASTLN_BN_FEATURES_AHEAD_SPAN (16 * 1024)

/* The rows layout's statistics take rows in groups of this many (fastln/statistics.h,
 * bn_stats_rows): a group of 512-feature float32 rows (one feature chunk) fits L1. */
#define FASTLN_BN_ROW_GROUP 16
/* The backward's sums read two arrays (dy and x): groups of half as many rows (fastln/backward.h,
 * bn_backward_sums_rows; groups of 8 measured faster than 16 and than row by row:
 * docs/performance.md, "The rows layout's backward sums in registers"). */
#define FASTLN_BN_BACKWARD_ROW_GROUP 8
/* The backward's segments (NCHW) sums go in float runs, segment by segment, for segments of
 * this many values or more (fastln/backward.h, bn_backward_sums_segments). */
#define FASTLN_BN_FLOAT_SEGMENT 128
/* Shorter segments add this many segments per float run (bn_backward_short_segments). */
#define FASTLN_BN_SHORT_SEGMENT_RUN 8

/* The rare path takes a feature again when its variance and eps are both below this (its
 * squares may have underflowed; LayerNorm's FASTLN_TINY), and in the backward when rstd is above
 * FASTLN_BN_RSTD_HUGE = 1 / sqrt(FASTLN_BN_TINY) (its dy * (x - mean) may underflow). */
#define FASTLN_BN_TINY 1e-250
#define FASTLN_BN_RSTD_HUGE 1e125

/* The layout of a call's tasks, from its shape (statistics: n_blocks * n_chunks tasks; writes:
 * n_units tasks of rows_per_unit rows, or one segment each). */
static inline void fastln_bn_layout(fastln_bn_call *call, int64_t max_blocks)
{
    if (call->n_inner == 1) {
        call->n_blocks = fastln_row_blocks(call->n_outer);
        call->n_chunks = (call->n_features + FASTLN_BN_FEATURE_CHUNK - 1) / FASTLN_BN_FEATURE_CHUNK;
        call->rows_per_unit = fastln_max(FASTLN_BN_APPLY_ELEMENTS / fastln_max(call->n_features, 1), 1);
        call->n_units = (call->n_outer + call->rows_per_unit - 1) / call->rows_per_unit;
    } else {
        call->n_blocks = fastln_min(
            fastln_max(call->n_outer * call->n_inner / FASTLN_BN_SEGMENT_BLOCK_ELEMENTS, 1),
            fastln_min(call->n_outer, max_blocks));
        call->n_chunks = call->n_features;
        call->rows_per_unit = 1;
        call->n_units = call->n_outer * call->n_features;
    }
    call->n_blocks = fastln_max(call->n_blocks, 1);
    call->rows_per_block = (call->n_outer + call->n_blocks - 1) / call->n_blocks;
}

/* Sum the per-block partials (n_blocks rows of n_features doubles) in block order. Block after
 * block, each adding its row to the totals: walking one feature down the blocks instead read a
 * double per cache line (docs/performance.md, "The rows layout's backward sums in registers"). */
static inline void fastln_bn_combine_partials(const double *FASTLN_RESTRICT partials,
                                              int64_t n_blocks, int64_t n_features,
                                              double *FASTLN_RESTRICT out)
{
    for (int64_t c = 0; c < n_features; c++) out[c] = 0.0;
    for (int64_t b = 0; b < n_blocks; b++) {
        const double *FASTLN_RESTRICT block = partials + b * n_features;
        for (int64_t c = 0; c < n_features; c++) out[c] += block[c];
    }
}

/* Training forward: batch mean, biased variance and rstd of every feature from its shifted sums,
 * and the constants of the write pass
 *     y = ((x - shift) - center) * scale + offset,  center = mean - shift, scale = rstd * gamma.
 * gamma and beta may be NULL (ones and zeros). */
/* The loop of fastln_bn_train_constants, its arrays as restrict parameters: they never overlap,
 * and knowing it lets the loop run in vectors (the same correctly rounded divisions and square
 * roots, a lane per feature; GCC honours restrict on parameters, not on struct fields). */
static inline void fastln_bn_train_constants_of(
    int64_t n, double count, double eps, const double *FASTLN_RESTRICT sum,
    const double *FASTLN_RESTRICT sumsq, const double *FASTLN_RESTRICT shift,
    const double *FASTLN_RESTRICT gamma, const double *FASTLN_RESTRICT beta,
    double *FASTLN_RESTRICT mean, double *FASTLN_RESTRICT var_out,
    double *FASTLN_RESTRICT rstd_out, double *FASTLN_RESTRICT center,
    double *FASTLN_RESTRICT scale, double *FASTLN_RESTRICT offset)
{
    for (int64_t c = 0; c < n; c++) {
        const double mean_shifted = sum[c] / count;
        double var = sumsq[c] / count - mean_shifted * mean_shifted;
        var = var < 0.0 ? 0.0 : var; /* rounding only; NaN stays NaN */
        const double rstd = 1.0 / sqrt(var + eps);
        mean[c] = shift[c] + mean_shifted;
        var_out[c] = var;
        rstd_out[c] = rstd;
        center[c] = mean_shifted;
        /* A constant feature with eps = 0: every deviation is exactly 0 and x_hat is 0
         * (y = beta), not 0 * inf = NaN. rstd still reports inf. */
        const double x_hat_scale = var + eps == 0.0 ? 0.0 : rstd;
        scale[c] = gamma ? x_hat_scale * gamma[c] : x_hat_scale;
        offset[c] = beta ? beta[c] : 0.0;
    }
}

static inline void fastln_bn_train_constants(const fastln_bn_call *call)
{
    fastln_bn_train_constants_of(call->n_features, (double)(call->n_outer * call->n_inner),
                                 call->eps, call->sum, call->sumsq, call->shift, call->gamma,
                                 call->beta, call->mean, call->var, call->rstd, call->center,
                                 call->scale, call->offset);
}

/* A rows-layout float apply's constants per feature (fastln/forward.h, bn_apply_rows_float):
 * in float (head, tail, scale, offset), and in double (shift, center, scale, offset) for the
 * elements it computes in double. */
typedef struct {
    const float *head, *tail, *scale, *offset;
    const double *shift, *center, *scale_double, *offset_double;
} fastln_rows_constants;

/* The float apply's constants of a call whose float_constants are set, as the float passes
 * take them. */
static inline fastln_rows_constants fastln_bn_rows_constants(const fastln_bn_call *call)
{
    const int64_t n = call->n_features;
    const float *head = call->float_constants;
    const fastln_rows_constants k = {head,        head + n,     head + 2 * n, head + 3 * n,
                                     call->shift, call->center, call->scale,  call->offset};
    return k;
}

/* The float apply's constants (fastln/forward.h, bn_apply_rows_float), once per call from the
 * double ones: the feature's mean shift + center split into a float head and tail (head + tail =
 * the mean to about 2^-48 of itself), scale and offset rounded to float. A feature whose
 * constants are outside float's comfortable range (not finite, a scale beyond 1e30 or below
 * 1e-30 but not 0) gets a NaN scale: each of its elements is then computed in double. */
/* Whether float holds a constant of this magnitude well: below limit, and 0 or above 1e-30. */
static inline int fastln_bn_float_in_range(double value, double limit)
{
    const double a = fabs(value);
    /* quiet comparisons, without branches: a NaN raises no flag, and the loops run in vectors */
    return isless(a, limit) & (isgreater(a, 1e-30) | (a == 0));
}

/* mean as a float head and tail (0 and 0 when the feature is out of range). */
static inline void fastln_bn_float_mean(double mean, int in_range, float *head, float *tail)
{
    const float head_value = (float)mean;
    const float tail_value = (float)(mean - (double)head_value);
    *head = fastln_choose_float(in_range, head_value, 0.0f); /* no branch: see fastln_choose */
    *tail = fastln_choose_float(in_range, tail_value, 0.0f);
}

static inline void fastln_bn_float_constants_of(
    int64_t n, const double *FASTLN_RESTRICT shift, const double *FASTLN_RESTRICT center,
    const double *FASTLN_RESTRICT scale_in, const double *FASTLN_RESTRICT offset_in,
    float *FASTLN_RESTRICT head, float *FASTLN_RESTRICT tail, float *FASTLN_RESTRICT scale,
    float *FASTLN_RESTRICT offset)
{
    for (int64_t c = 0; c < n; c++) {
        const double mean = shift[c] + center[c];
        const int in_range = isless(fabs(mean), 1e38) & isless(fabs(offset_in[c]), 1e38)
                             & fastln_bn_float_in_range(scale_in[c], 1e30);
        fastln_bn_float_mean(mean, in_range, &head[c], &tail[c]);
        const float scale_value = (float)scale_in[c], offset_value = (float)offset_in[c];
        scale[c] = fastln_choose_float(in_range, scale_value, NAN);
        offset[c] = fastln_choose_float(in_range, offset_value, 0.0f);
    }
}

static inline void fastln_bn_float_constants(const fastln_bn_call *call)
{
    const int64_t n = call->n_features;
    float *head = call->float_constants;
    fastln_bn_float_constants_of(n, call->shift, call->center, call->scale, call->offset, head,
                                 head + n, head + 2 * n, head + 3 * n);
}

/* Evaluation forward: the same write-pass constants from the running statistics
 * (shift = running_mean, center = 0). */
static inline void fastln_bn_eval_constants_of(
    int64_t n, double eps, const double *FASTLN_RESTRICT running_mean,
    const double *FASTLN_RESTRICT running_var, const double *FASTLN_RESTRICT gamma,
    const double *FASTLN_RESTRICT beta, double *FASTLN_RESTRICT mean,
    double *FASTLN_RESTRICT rstd_out, double *FASTLN_RESTRICT shift,
    double *FASTLN_RESTRICT center, double *FASTLN_RESTRICT scale,
    double *FASTLN_RESTRICT offset)
{
    for (int64_t c = 0; c < n; c++) {
        const double rstd = 1.0 / sqrt(running_var[c] + eps);
        mean[c] = running_mean[c];
        rstd_out[c] = rstd;
        shift[c] = running_mean[c];
        center[c] = 0.0;
        scale[c] = gamma ? rstd * gamma[c] : rstd;
        offset[c] = beta ? beta[c] : 0.0;
    }
}

static inline void fastln_bn_eval_constants(const fastln_bn_call *call)
{
    fastln_bn_eval_constants_of(call->n_features, call->eps, call->running_mean,
                                call->running_var, call->gamma, call->beta, call->mean,
                                call->rstd, call->shift, call->center, call->scale, call->offset);
    if (call->float_constants) fastln_bn_float_constants(call);
}

/* Backward: dgamma, dbeta and the constants of the dx pass from the sums over each feature's
 * `count` values of dy, dy * d and d, with d = x - mean (mean and rstd as the forward used).
 *
 * Training (the two-reduction identity of LayerNorm's backward, down the batch axis):
 *     x_hat = (d - correction) * rstd,  correction = mean(d)  (the exact batch mean: a mean
 *                                       rounded in the cache costs nothing)
 *     dgamma = sum(dy * x_hat),  dbeta = sum(dy)
 *     dx = gamma * rstd * (dy - dbeta / count - x_hat * dgamma / count)
 *        = k * ((dy - mean_dy) - (d - correction) * coef)
 * Evaluation (the affine map): dx = dy * k with k = gamma * rstd, x_hat = d * rstd; the dx
 * constants mean_dy, correction and coef are 0. gamma may be NULL (ones). */
static inline void fastln_bn_backward_constants_of(
    int64_t n, double count, int training, const double *FASTLN_RESTRICT rstd_in,
    const double *FASTLN_RESTRICT mean, const double *FASTLN_RESTRICT gamma,
    const double *FASTLN_RESTRICT sum_dy, const double *FASTLN_RESTRICT sum_dy_d,
    const double *FASTLN_RESTRICT sum_d, double *FASTLN_RESTRICT dgamma_out,
    double *FASTLN_RESTRICT dx_mean, double *FASTLN_RESTRICT correction_out,
    double *FASTLN_RESTRICT k, double *FASTLN_RESTRICT mean_dy, double *FASTLN_RESTRICT coef)
{
    for (int64_t c = 0; c < n; c++) {
        /* Every value computed, then chosen (no branches: see fastln_choose). */
        const double rstd = rstd_in[c];
        const int infinite = fabs(rstd) == INFINITY;
        const double batch_mean_d = sum_d[c] / count, batch_mean_dy = sum_dy[c] / count;
        const double correction = fastln_choose(training, batch_mean_d, 0.0);
        /* rstd = inf: a constant feature with eps = 0, whose x_hat is 0 (see the forward). */
        const double dgamma_zero = 0.0 * sum_dy[c];
        const double dgamma_finite = rstd * (sum_dy_d[c] - correction * sum_dy[c]);
        const double dgamma = fastln_choose(infinite, dgamma_zero, dgamma_finite);
        const double coef_value = rstd * dgamma / count;
        dgamma_out[c] = dgamma;
        dx_mean[c] = mean[c];
        correction_out[c] = correction;
        k[c] = rstd;
        mean_dy[c] = fastln_choose(training, batch_mean_dy, 0.0);
        coef[c] = fastln_choose(training & !infinite, coef_value, 0.0);
    }
    if (gamma)
        for (int64_t c = 0; c < n; c++) k[c] = gamma[c] * rstd_in[c];
}

/* Backward sums (sum(dy), sum(dy * d), sum(d)) of count values taken around shift, the float
 * nearest mean (the float passes), made the sums around mean that the constants take: shift -
 * mean is exact. */
static inline void fastln_bn_move_sums(float shift, double mean, double count, double sums[3])
{
    const double moved = (double)shift - mean;
    sums[1] += moved * sums[0];
    sums[2] += moved * count;
}

/* fastln_bn_move_sums for every feature of the rows layout (sums of count values each), in one
 * loop that runs in vectors (the same operations, a lane per feature). */
static inline void fastln_bn_move_all_sums(int64_t n, const double *FASTLN_RESTRICT mean,
                                           double count, const double *FASTLN_RESTRICT sum_dy,
                                           double *FASTLN_RESTRICT sum_dy_d,
                                           double *FASTLN_RESTRICT sum_d)
{
    for (int64_t c = 0; c < n; c++) {
        double sums[3] = {sum_dy[c], sum_dy_d[c], sum_d[c]};
        fastln_bn_move_sums((float)mean[c], mean[c], count, sums);
        sum_dy_d[c] = sums[1];
        sum_d[c] = sums[2];
    }
}

/* Whether any feature's moved float sums may fail LayerNorm's rule (bn_backward_rows_hold's
 * tests, without their all-zero dy escape: a superset, in one pass without branches, so that
 * the common call skips the per-feature loop; see fastln_bn_backward_any_rare). */
static inline int fastln_bn_any_float_sums_doubtful(int64_t n, double count,
                                                    const double *FASTLN_RESTRICT sum_dy,
                                                    const double *FASTLN_RESTRICT sum_dy_d,
                                                    const double *FASTLN_RESTRICT sum_d)
{
    const double tiny = fastln_products_floor(count);
    int any = 0;
    for (int64_t c = 0; c < n; c++)
        any |= !isless(fabs(sum_dy[c]), INFINITY) | !isless(fabs(sum_d[c]), INFINITY)
               | !isless(fabs(sum_dy_d[c]), INFINITY) | isless(fabs(sum_dy_d[c]), tiny);
    return any;
}

static inline void fastln_bn_backward_constants(const fastln_bn_call *call)
{
    fastln_bn_backward_constants_of(
        call->n_features, (double)(call->n_outer * call->n_inner), call->training, call->rstd,
        call->mean, call->gamma, call->sum_dy, call->sum_dy_d, call->sum_d, call->dgamma,
        call->dx_mean, call->correction, call->k, call->mean_dy, call->coef);
}

/* The backward's float apply constants (fastln/backward.h, bn_backward_apply_rows_float), once
 * per call from the double ones, by the forward's rule (fastln_bn_float_constants): the dx
 * pass's mean dx_mean + correction as a float head and tail, k, mean_dy and coef in float. A
 * feature with a constant outside float's comfortable range (not finite, beyond 1e30, or below
 * 1e-30 but not 0; the mean beyond 1e38) gets a NaN k: its elements are computed in double. */
static inline void fastln_bn_backward_float_constants_of(
    int64_t n, const double *FASTLN_RESTRICT dx_mean, const double *FASTLN_RESTRICT correction,
    const double *FASTLN_RESTRICT k_in, const double *FASTLN_RESTRICT mean_dy_in,
    const double *FASTLN_RESTRICT coef_in, float *FASTLN_RESTRICT head,
    float *FASTLN_RESTRICT tail, float *FASTLN_RESTRICT k, float *FASTLN_RESTRICT mean_dy,
    float *FASTLN_RESTRICT coef)
{
    for (int64_t c = 0; c < n; c++) {
        const double mean = dx_mean[c] + correction[c];
        const int in_range = isless(fabs(mean), 1e38) & fastln_bn_float_in_range(k_in[c], 1e30)
                             & fastln_bn_float_in_range(mean_dy_in[c], 1e30)
                             & fastln_bn_float_in_range(coef_in[c], 1e30);
        fastln_bn_float_mean(mean, in_range, &head[c], &tail[c]);
        const float k_value = (float)k_in[c], mean_dy_value = (float)mean_dy_in[c];
        const float coef_value = (float)coef_in[c];
        k[c] = fastln_choose_float(in_range, k_value, NAN);
        mean_dy[c] = fastln_choose_float(in_range, mean_dy_value, 0.0f);
        coef[c] = fastln_choose_float(in_range, coef_value, 0.0f);
    }
}

static inline void fastln_bn_backward_float_constants(const fastln_bn_call *call)
{
    const int64_t n = call->n_features;
    float *head = call->float_constants;
    fastln_bn_backward_float_constants_of(n, call->dx_mean, call->correction, call->k,
                                          call->mean_dy, call->coef, head, head + n,
                                          head + 2 * n, head + 3 * n, head + 4 * n);
}

/* Whether any feature may need bn_rescale_backward (fastln/rare.h): rstd out of its range or a
 * sum, dgamma or coef not finite (a superset of its tests, in one pass without branches, so
 * that it runs in vectors: the common call, with no such feature, costs a fraction of the
 * per-feature loop). */
static inline int fastln_bn_backward_any_rare(int64_t n, const double *FASTLN_RESTRICT rstd,
                                              const double *FASTLN_RESTRICT sum_dy,
                                              const double *FASTLN_RESTRICT sum_dy_d,
                                              const double *FASTLN_RESTRICT sum_d,
                                              const double *FASTLN_RESTRICT dgamma,
                                              const double *FASTLN_RESTRICT coef)
{
    int any = 0;
    for (int64_t f = 0; f < n; f++)
        any |= isgreater(rstd[f], FASTLN_BN_RSTD_HUGE) | isless(rstd[f], DBL_MIN)
               | !isless(fabs(sum_dy[f]), INFINITY) | !isless(fabs(sum_dy_d[f]), INFINITY)
               | !isless(fabs(sum_d[f]), INFINITY) | !isless(fabs(dgamma[f]), INFINITY)
               | !isless(fabs(coef[f]), INFINITY);
    return any;
}

/* Whether any feature may need bn_rescale_train (fastln/rare.h; its tests, in one pass without
 * branches: see fastln_bn_backward_any_rare). */
static inline int fastln_bn_train_any_rare(int64_t n, double eps,
                                           const double *FASTLN_RESTRICT center,
                                           const double *FASTLN_RESTRICT var)
{
    int any = 0;
    for (int64_t f = 0; f < n; f++)
        any |= !isless(fabs(center[f]), INFINITY) | !isless(fabs(var[f]), INFINITY)
               | (isless(var[f], FASTLN_BN_TINY) & isless(eps, FASTLN_BN_TINY));
    return any;
}

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

/* A deviation of a feature's rare path (fastln/rare.h): x - mean, each term scaled by
 * 2^prescale first (0, or -2 for features whose deviations pass DBL_MAX), and the same brought to
 * about 1 by bn_rescaled_moments' exponent. */
FASTLN_INLINE double fastln_bn_deviation(double x, double mean, int prescale)
{
    return ldexp(x, prescale) - ldexp(mean, prescale);
}

FASTLN_INLINE double fastln_bn_scaled_deviation(double x, double mean, int exponent, int prescale)
{
    return ldexp(fastln_bn_deviation(x, mean, prescale), exponent - prescale);
}

/* scaled * 2^exponent is what the write passes can use: a normal double, or an exact 0. */
static inline int fastln_bn_in_range(double scaled, int exponent)
{
    return scaled == 0.0 || isnormal(ldexp(scaled, exponent));
}

#endif /* FASTLN_BATCH_NORM_H */
