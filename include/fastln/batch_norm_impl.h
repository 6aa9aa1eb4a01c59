/* Template body of batch_norm.h, instantiated per element type by fastln/instantiate.h (which
 * lists the macros it defines). No include guard on purpose.
 *
 * Per-feature arrays (shift, mean, scale, ..., and the accumulators) are double. In the rows
 * layout eight features share a vector and the last n_features % 8 take the same arithmetic one
 * at a time; features never mix, so neither the vector width nor the tail changes any result.
 * Outputs (y, dx) may be the input they are computed from (in place). */

/* shift[c] = the first value of feature c (x[0, c, 0]). */
FASTLN_INLINE void FASTLN_NAME(fastln_bn_first_values)(
    const FASTLN_T *FASTLN_RESTRICT x, int64_t n_features, int64_t n_inner,
    double *FASTLN_RESTRICT shift)
{
    for (int64_t c = 0; c < n_features; c++) shift[c] = (double)x[c * n_inner];
}

/* ---- statistics -------------------------------------------------------------------------- */

/* Rows layout: sum[c] += d and sumsq[c] += d * d, d = x[r, c] - shift[c], for n_rows rows of
 * n_features values, consecutive rows row_stride elements apart (a range of features may be
 * given to one thread and the rest to others: features never mix, so results do not change). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_bn_stats_rows)(
    const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows, int64_t n_features, int64_t row_stride,
    const double *FASTLN_RESTRICT shift, double *FASTLN_RESTRICT sum,
    double *FASTLN_RESTRICT sumsq)
{
    for (int64_t r = 0; r < n_rows; r++) {
        const FASTLN_T *row = x + r * row_stride;
        int64_t c = 0;
        for (; c + 8 <= n_features; c += 8) {
            const fastln_d8 d = FASTLN_LOAD8(row + c) - fastln_load8_f64(shift + c);
            fastln_store8_f64(sum + c, fastln_load8_f64(sum + c) + d);
            fastln_store8_f64(sumsq + c, fastln_load8_f64(sumsq + c) + d * d);
        }
        for (; c < n_features; c++) {
            const double d = (double)row[c] - shift[c];
            sum[c] += d;
            sumsq[c] += d * d;
        }
    }
}

/* Segments layout, one feature: the shifted sums over n_segments segments of n_inner values,
 * segment k starting at x + k * stride. The order of every sum depends on n_segments and n_inner
 * only: element l of a segment goes to slot l % 8 of accumulator (l / 8) % 4, the last partial
 * chunk of a segment is zero-filled (adding exactly nothing), and the accumulators are reduced
 * by fastln_reduce. */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_bn_stats_segments)(
    const FASTLN_T *FASTLN_RESTRICT x, int64_t n_segments, int64_t stride, int64_t n_inner,
    double shift, double *FASTLN_RESTRICT sum_out, double *FASTLN_RESTRICT sumsq_out)
{
    fastln_d8 sum[FASTLN_ACCUMULATORS] = {{0}};
    fastln_d8 sumsq[FASTLN_ACCUMULATORS] = {{0}};
    for (int64_t k = 0; k < n_segments; k++) {
        const FASTLN_T *segment = x + k * stride;
        int64_t l = 0;
        for (; l + FASTLN_BLOCK <= n_inner; l += FASTLN_BLOCK) {
            FASTLN_UNROLL_ACCUMULATORS
            for (int a = 0; a < FASTLN_ACCUMULATORS; a++) {
                const fastln_d8 d = FASTLN_LOAD8(segment + l + 8 * a) - shift;
                sum[a] += d;
                sumsq[a] += d * d;
            }
        }
        int a = 0;
        for (; l + 8 <= n_inner; l += 8, a++) {
            const fastln_d8 d = FASTLN_LOAD8(segment + l) - shift;
            sum[a] += d;
            sumsq[a] += d * d;
        }
        if (l < n_inner) {
            fastln_d8 d = {0};
            for (int k8 = 0; l + k8 < n_inner; k8++) d[k8] = (double)segment[l + k8] - shift;
            sum[a] += d;
            sumsq[a] += d * d;
        }
    }
    *sum_out = fastln_reduce(sum);
    *sumsq_out = fastln_reduce(sumsq);
}

/* ---- forward write pass: y = ((x - shift) - center) * scale + offset ---------------------- */

/* Rows layout, n_rows rows; the four constants are per-feature arrays. */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_bn_apply_rows)(
    const FASTLN_T *x, FASTLN_T *y, int64_t n_rows, int64_t n_features,
    const double *FASTLN_RESTRICT shift, const double *FASTLN_RESTRICT center,
    const double *FASTLN_RESTRICT scale, const double *FASTLN_RESTRICT offset)
{
    for (int64_t r = 0; r < n_rows; r++) {
        const FASTLN_T *row = x + r * n_features;
        FASTLN_T *out = y + r * n_features;
        int64_t c = 0;
        for (; c + 8 <= n_features; c += 8) {
            const fastln_d8 d = (FASTLN_LOAD8(row + c) - fastln_load8_f64(shift + c))
                                - fastln_load8_f64(center + c);
            FASTLN_STORE8(out + c, d * fastln_load8_f64(scale + c) + fastln_load8_f64(offset + c));
        }
        for (; c < n_features; c++)
            out[c] = (FASTLN_T)((((double)row[c] - shift[c]) - center[c]) * scale[c] + offset[c]);
    }
}

/* Segments layout, one segment of n_inner values of one feature. */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_bn_apply_segment)(
    const FASTLN_T *x, FASTLN_T *y, int64_t n_inner, double shift, double center, double scale,
    double offset)
{
    int64_t l = 0;
    for (; l + 8 <= n_inner; l += 8)
        FASTLN_STORE8(y + l, ((FASTLN_LOAD8(x + l) - shift) - center) * scale + offset);
    for (; l < n_inner; l++)
        y[l] = (FASTLN_T)((((double)x[l] - shift) - center) * scale + offset);
}

/* ---- backward sums: dy, dy * d and d with d = x - mean --------------------------------- */

/* Rows layout: adds into the per-feature arrays sum_dy, sum_dy_d and sum_d (rows and features
 * as in fastln_bn_stats_rows). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_bn_backward_sums_rows)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows,
    int64_t n_features, int64_t row_stride, const double *FASTLN_RESTRICT mean,
    double *FASTLN_RESTRICT sum_dy, double *FASTLN_RESTRICT sum_dy_d,
    double *FASTLN_RESTRICT sum_d)
{
    for (int64_t r = 0; r < n_rows; r++) {
        const FASTLN_T *dy_row = dy + r * row_stride;
        const FASTLN_T *x_row = x + r * row_stride;
        int64_t c = 0;
        for (; c + 8 <= n_features; c += 8) {
            const fastln_d8 g = FASTLN_LOAD8(dy_row + c);
            const fastln_d8 d = FASTLN_LOAD8(x_row + c) - fastln_load8_f64(mean + c);
            fastln_store8_f64(sum_dy + c, fastln_load8_f64(sum_dy + c) + g);
            fastln_store8_f64(sum_dy_d + c, fastln_load8_f64(sum_dy_d + c) + g * d);
            fastln_store8_f64(sum_d + c, fastln_load8_f64(sum_d + c) + d);
        }
        for (; c < n_features; c++) {
            const double g = (double)dy_row[c];
            const double d = (double)x_row[c] - mean[c];
            sum_dy[c] += g;
            sum_dy_d[c] += g * d;
            sum_d[c] += d;
        }
    }
}

/* Segments layout, one feature (same fixed order as fastln_bn_stats_segments). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_bn_backward_sums_segments)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t n_segments,
    int64_t stride, int64_t n_inner, double mean, double *FASTLN_RESTRICT sum_dy_out,
    double *FASTLN_RESTRICT sum_dy_d_out, double *FASTLN_RESTRICT sum_d_out)
{
    fastln_d8 sum_dy[FASTLN_ACCUMULATORS] = {{0}};
    fastln_d8 sum_dy_d[FASTLN_ACCUMULATORS] = {{0}};
    fastln_d8 sum_d[FASTLN_ACCUMULATORS] = {{0}};
    for (int64_t k = 0; k < n_segments; k++) {
        const FASTLN_T *dy_segment = dy + k * stride;
        const FASTLN_T *x_segment = x + k * stride;
        int64_t l = 0;
        for (; l + FASTLN_BLOCK <= n_inner; l += FASTLN_BLOCK) {
            FASTLN_UNROLL_ACCUMULATORS
            for (int a = 0; a < FASTLN_ACCUMULATORS; a++) {
                const fastln_d8 g = FASTLN_LOAD8(dy_segment + l + 8 * a);
                const fastln_d8 d = FASTLN_LOAD8(x_segment + l + 8 * a) - mean;
                sum_dy[a] += g;
                sum_dy_d[a] += g * d;
                sum_d[a] += d;
            }
        }
        int a = 0;
        for (; l + 8 <= n_inner; l += 8, a++) {
            const fastln_d8 g = FASTLN_LOAD8(dy_segment + l);
            const fastln_d8 d = FASTLN_LOAD8(x_segment + l) - mean;
            sum_dy[a] += g;
            sum_dy_d[a] += g * d;
            sum_d[a] += d;
        }
        if (l < n_inner) {
            fastln_d8 g = {0}, d = {0};
            for (int k8 = 0; l + k8 < n_inner; k8++) {
                g[k8] = (double)dy_segment[l + k8];
                d[k8] = (double)x_segment[l + k8] - mean;
            }
            sum_dy[a] += g;
            sum_dy_d[a] += g * d;
            sum_d[a] += d;
        }
    }
    *sum_dy_out = fastln_reduce(sum_dy);
    *sum_dy_d_out = fastln_reduce(sum_dy_d);
    *sum_d_out = fastln_reduce(sum_d);
}

/* ---- backward dx pass ----------------------------------------------------------------- */

/* Training, rows layout: dx = k * ((dy - mean_dy) - ((x - mean) - correction) * coef). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_bn_backward_apply_rows)(
    const FASTLN_T *dy, const FASTLN_T *FASTLN_RESTRICT x, FASTLN_T *dx, int64_t n_rows,
    int64_t n_features, const double *FASTLN_RESTRICT mean,
    const double *FASTLN_RESTRICT correction, const double *FASTLN_RESTRICT k,
    const double *FASTLN_RESTRICT mean_dy, const double *FASTLN_RESTRICT coef)
{
    for (int64_t r = 0; r < n_rows; r++) {
        const FASTLN_T *dy_row = dy + r * n_features;
        const FASTLN_T *x_row = x + r * n_features;
        FASTLN_T *dx_row = dx + r * n_features;
        int64_t c = 0;
        for (; c + 8 <= n_features; c += 8) {
            const fastln_d8 centred = (FASTLN_LOAD8(x_row + c) - fastln_load8_f64(mean + c))
                                      - fastln_load8_f64(correction + c);
            const fastln_d8 g = FASTLN_LOAD8(dy_row + c) - fastln_load8_f64(mean_dy + c);
            FASTLN_STORE8(dx_row + c, fastln_load8_f64(k + c)
                                          * (g - centred * fastln_load8_f64(coef + c)));
        }
        for (; c < n_features; c++) {
            const double centred = ((double)x_row[c] - mean[c]) - correction[c];
            const double g = (double)dy_row[c] - mean_dy[c];
            dx_row[c] = (FASTLN_T)(k[c] * (g - centred * coef[c]));
        }
    }
}

/* Training, segments layout, one segment of one feature. */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_bn_backward_apply_segment)(
    const FASTLN_T *dy, const FASTLN_T *FASTLN_RESTRICT x, FASTLN_T *dx, int64_t n_inner,
    double mean, double correction, double k, double mean_dy, double coef)
{
    int64_t l = 0;
    for (; l + 8 <= n_inner; l += 8) {
        const fastln_d8 centred = (FASTLN_LOAD8(x + l) - mean) - correction;
        FASTLN_STORE8(dx + l, k * ((FASTLN_LOAD8(dy + l) - mean_dy) - centred * coef));
    }
    for (; l < n_inner; l++) {
        const double centred = ((double)x[l] - mean) - correction;
        dx[l] = (FASTLN_T)(k * (((double)dy[l] - mean_dy) - centred * coef));
    }
}

/* Evaluation, rows layout: dx = dy * k (x is not needed). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_bn_scale_rows)(
    const FASTLN_T *dy, FASTLN_T *dx, int64_t n_rows, int64_t n_features,
    const double *FASTLN_RESTRICT k)
{
    for (int64_t r = 0; r < n_rows; r++) {
        const FASTLN_T *dy_row = dy + r * n_features;
        FASTLN_T *dx_row = dx + r * n_features;
        int64_t c = 0;
        for (; c + 8 <= n_features; c += 8)
            FASTLN_STORE8(dx_row + c, FASTLN_LOAD8(dy_row + c) * fastln_load8_f64(k + c));
        for (; c < n_features; c++) dx_row[c] = (FASTLN_T)((double)dy_row[c] * k[c]);
    }
}

/* Evaluation, segments layout, one segment of one feature: dx = dy * k. */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_bn_scale_segment)(const FASTLN_T *dy, FASTLN_T *dx,
                                                 int64_t n_inner, double k)
{
    int64_t l = 0;
    for (; l + 8 <= n_inner; l += 8) FASTLN_STORE8(dx + l, FASTLN_LOAD8(dy + l) * k);
    for (; l < n_inner; l++) dx[l] = (FASTLN_T)((double)dy[l] * k);
}

/* ---- rare path: features whose statistics leave double's range ---------------------------
 *
 * Plain loops over one feature's values in memory order (segments of n_inner values, n_features
 * * n_inner apart, from x + feature * n_inner): a fixed order, whatever the thread count, and
 * run for a handful of features at most. Scaling by a power of two is exact (ldexp), so the
 * rescaled sums round no more than plain ones would in a wider exponent range. */

/* The mean of a feature whose shifted sum overflowed (values near double's largest), from its
 * values scaled so that the largest is below 1, still shifted by `shift`. Not finite when the
 * feature holds an Inf. */
static double FASTLN_NAME(fastln_bn_rescaled_mean)(
    const FASTLN_T *x, int64_t n_outer, int64_t n_features, int64_t n_inner, int64_t feature,
    double shift)
{
    const FASTLN_T *column = x + feature * n_inner;
    const int64_t stride = n_features * n_inner;
    double largest = 0.0;
    for (int64_t k = 0; k < n_outer; k++)
        for (int64_t l = 0; l < n_inner; l++)
            largest = fmax(largest, fabs((double)column[k * stride + l]));
    if (isinf(largest)) return largest;
    int exponent;
    frexp(largest, &exponent);
    const double shift_scaled = ldexp(shift, -exponent);
    double sum = 0.0;
    for (int64_t k = 0; k < n_outer; k++)
        for (int64_t l = 0; l < n_inner; l++)
            sum += ldexp((double)column[k * stride + l], -exponent) - shift_scaled;
    return ldexp(shift_scaled + sum / (double)(n_outer * n_inner), exponent);
}

/* The deviations d = x - mean of a feature, scaled by the power of two 2^exponent that brings
 * the largest into [0.5, 1): their mean `center` (small: the rounding of `mean`) and their
 * variance about it. Returns 0, and leaves the outputs alone, when there is nothing to rescale:
 * a constant feature, or deviations beyond double (an Inf, or values of both signs near
 * double's largest). Callers never pass a feature holding NaN. */
static int FASTLN_NAME(fastln_bn_rescaled_moments)(
    const FASTLN_T *x, int64_t n_outer, int64_t n_features, int64_t n_inner, int64_t feature,
    double mean, int *exponent_out, double *center_out, double *var_out)
{
    const FASTLN_T *column = x + feature * n_inner;
    const int64_t stride = n_features * n_inner;
    double largest = 0.0;
    for (int64_t k = 0; k < n_outer; k++)
        for (int64_t l = 0; l < n_inner; l++)
            largest = fmax(largest, fabs((double)column[k * stride + l] - mean));
    if (!(largest > 0.0) || isinf(largest)) return 0;
    int exponent;
    frexp(largest, &exponent);
    exponent = -exponent;
    double sum = 0.0, sumsq = 0.0;
    for (int64_t k = 0; k < n_outer; k++)
        for (int64_t l = 0; l < n_inner; l++) {
            const double d = ldexp((double)column[k * stride + l] - mean, exponent);
            sum += d;
            sumsq += d * d;
        }
    const double count = (double)(n_outer * n_inner);
    const double center = sum / count;
    const double var = sumsq / count - center * center;
    *exponent_out = exponent;
    *center_out = center;
    *var_out = var < 0.0 ? 0.0 : var;
    return 1;
}

/* Training forward, after fastln_bn_train_constants: the features whose statistics left
 * double's range there - squares or sums that overflowed (NaN or Inf variance, finite or
 * infinite mean: |x| beyond ~1e154), or a variance below FASTLN_BN_TINY with eps below it too
 * (squares that underflowed) - are taken again on rescaled deviations, and their statistics and
 * write-pass constants replaced. Features holding NaN or Inf stay as they are.
 *
 * var and rstd get the true values rounded to double, out of range included: var is inf for
 * spreads beyond ~1e154 and 0 below ~1e-162, rstd inf for spreads below ~5e-309 with eps = 0.
 * When the write pass's scale rstd * gamma is out of range itself, the feature gets constants
 * that copy it into y unchanged, and its index goes to finish_out: fastln_bn_finish_rescaled
 * normalizes it there after the write pass. Returns how many features went to finish_out. */
static int64_t FASTLN_NAME(fastln_bn_rescale_train)(
    const FASTLN_T *x, int64_t n_outer, int64_t n_features, int64_t n_inner,
    const double *gamma, double eps, double *mean, double *var, double *rstd, double *shift,
    double *center, double *scale, double *offset, int64_t *finish_out)
{
    int64_t n_finish = 0;
    for (int64_t c = 0; c < n_features; c++) {
        const int overflowed = !isnan(center[c]) && !isfinite(var[c]);
        const int underflowed = var[c] < FASTLN_BN_TINY && eps < FASTLN_BN_TINY;
        if (!overflowed && !underflowed) continue;
        /* center is the shifted mean: not finite when the shifted sum itself overflowed */
        const double feature_mean = isfinite(center[c]) ? mean[c]
            : FASTLN_NAME(fastln_bn_rescaled_mean)(x, n_outer, n_features, n_inner, c, shift[c]);
        int exponent;
        double center_scaled, var_scaled;
        if (!isfinite(feature_mean)
            || !FASTLN_NAME(fastln_bn_rescaled_moments)(x, n_outer, n_features, n_inner, c,
                                                        feature_mean, &exponent,
                                                        &center_scaled, &var_scaled))
            continue;
        const double rstd_scaled = fastln_bn_scaled_rstd(var_scaled, eps, exponent);
        const double scale_scaled = gamma ? rstd_scaled * gamma[c] : rstd_scaled;
        mean[c] = feature_mean;
        var[c] = ldexp(var_scaled, -2 * exponent);
        rstd[c] = ldexp(rstd_scaled, exponent);
        if (fastln_bn_in_range(scale_scaled, exponent)) {
            shift[c] = feature_mean;
            center[c] = ldexp(center_scaled, -exponent);
            scale[c] = ldexp(scale_scaled, exponent);
        } else { /* ((x - 0) - 0) * 1 + (-0) is x, -0 included */
            shift[c] = 0.0;
            center[c] = 0.0;
            scale[c] = 1.0;
            offset[c] = -0.0;
            finish_out[n_finish++] = c;
        }
    }
    return n_finish;
}

/* Normalizes in y a feature that fastln_bn_rescale_train passed on (y holds its values, copied
 * there by the write pass), from the same rescaled moments:
 *     y = (d_scaled - center_scaled) * rstd_scaled * gamma + beta,  d_scaled = (x - mean) 2^e.
 * gamma and beta (double) may be NULL. */
static void FASTLN_NAME(fastln_bn_finish_rescaled)(
    FASTLN_T *y, int64_t n_outer, int64_t n_features, int64_t n_inner, int64_t feature,
    double mean, const double *gamma, const double *beta, double eps)
{
    int exponent;
    double center_scaled, var_scaled;
    if (!FASTLN_NAME(fastln_bn_rescaled_moments)(y, n_outer, n_features, n_inner, feature, mean,
                                                 &exponent, &center_scaled, &var_scaled))
        return; /* not reached: these are the values the forward rescaled */
    const double rstd_scaled = fastln_bn_scaled_rstd(var_scaled, eps, exponent);
    const double scale = gamma ? rstd_scaled * gamma[feature] : rstd_scaled;
    const double offset = beta ? beta[feature] : 0.0;
    FASTLN_T *column = y + feature * n_inner;
    const int64_t stride = n_features * n_inner;
    for (int64_t k = 0; k < n_outer; k++)
        for (int64_t l = 0; l < n_inner; l++) {
            FASTLN_T *value = column + k * stride + l;
            const double d = ldexp((double)*value - mean, exponent);
            *value = (FASTLN_T)((d - center_scaled) * scale + offset);
        }
}

/* Training backward, after fastln_bn_backward_constants: the features whose sums may have left
 * double's range - rstd above FASTLN_BN_RSTD_HUGE or below double's normal numbers (tiny or huge
 * spreads), or a sum of dy * d that overflowed (huge x and huge dy) - are summed again on the
 * forward's rescaled deviations d_scaled = (x - mean) 2^e (from the cache's mean):
 *     dgamma = rstd_scaled * (sum(dy * d_scaled) - center_scaled * sum(dy)),
 * and their dx constants replaced (correction, coef and k = gamma * rstd are 2^e-scalings of
 * center_scaled, rstd_scaled * dgamma / count and gamma * rstd_scaled). When k or coef is out
 * of range, the feature gets constants that copy dy into dx unchanged, and its index goes to
 * finish_out for fastln_bn_finish_rescaled_backward. Returns how many. */
static int64_t FASTLN_NAME(fastln_bn_rescale_backward)(
    const FASTLN_T *dy, const FASTLN_T *x, int64_t n_outer, int64_t n_features, int64_t n_inner,
    const double *gamma, double eps, const double *mean, const double *rstd,
    const double *sum_dy, const double *sum_dy_d, const double *sum_d, double *dgamma_out,
    double *correction_out, double *k_out, double *mean_dy_out, double *coef_out,
    int64_t *finish_out)
{
    const double count = (double)(n_outer * n_inner);
    const int64_t stride = n_features * n_inner;
    int64_t n_finish = 0;
    for (int64_t c = 0; c < n_features; c++) {
        const int out_of_range = rstd[c] > FASTLN_BN_RSTD_HUGE || rstd[c] < DBL_MIN;
        const int overflowed =
            !isfinite(sum_dy_d[c]) && isfinite(sum_dy[c]) && isfinite(sum_d[c]);
        if (!out_of_range && !overflowed) continue;
        int exponent;
        double center_scaled, var_scaled;
        if (!FASTLN_NAME(fastln_bn_rescaled_moments)(x, n_outer, n_features, n_inner, c, mean[c],
                                                     &exponent, &center_scaled, &var_scaled))
            continue; /* constant (x_hat = 0, as fastln_bn_backward_constants has it), or beyond */
        const double rstd_scaled =
            fastln_bn_backward_scaled_rstd(rstd[c], var_scaled, eps, exponent);
        const FASTLN_T *dy_column = dy + c * n_inner;
        const FASTLN_T *x_column = x + c * n_inner;
        double sum_dy_d_scaled = 0.0;
        for (int64_t k = 0; k < n_outer; k++)
            for (int64_t l = 0; l < n_inner; l++) {
                const int64_t at = k * stride + l;
                sum_dy_d_scaled += (double)dy_column[at]
                                   * ldexp((double)x_column[at] - mean[c], exponent);
            }
        const double dgamma = rstd_scaled * (sum_dy_d_scaled - center_scaled * sum_dy[c]);
        const double k_scaled = gamma ? gamma[c] * rstd_scaled : rstd_scaled;
        const double coef_scaled = rstd_scaled * dgamma / count;
        dgamma_out[c] = dgamma;
        if (fastln_bn_in_range(k_scaled, exponent) && fastln_bn_in_range(coef_scaled, exponent)) {
            correction_out[c] = ldexp(center_scaled, -exponent);
            k_out[c] = ldexp(k_scaled, exponent);
            coef_out[c] = ldexp(coef_scaled, exponent);
        } else { /* 1 * ((dy - 0) - ((x - mean) - 0) * 0) is dy */
            correction_out[c] = 0.0;
            k_out[c] = 1.0;
            mean_dy_out[c] = 0.0;
            coef_out[c] = 0.0;
            finish_out[n_finish++] = c;
        }
    }
    return n_finish;
}

/* dx of a feature that fastln_bn_rescale_backward passed on (dx holds its dy, copied there by
 * the dx pass), with the same rescaled constants:
 *     dx = 2^e * k_scaled * ((dy - mean_dy) - (d_scaled - center_scaled) * coef_scaled).
 * dgamma and sum_dy are the feature's, as fastln_bn_rescale_backward left them. */
static void FASTLN_NAME(fastln_bn_finish_rescaled_backward)(
    FASTLN_T *dx, const FASTLN_T *x, int64_t n_outer, int64_t n_features, int64_t n_inner,
    int64_t feature, double mean, double rstd, const double *gamma, double eps, double dgamma,
    double sum_dy)
{
    int exponent;
    double center_scaled, var_scaled;
    if (!FASTLN_NAME(fastln_bn_rescaled_moments)(x, n_outer, n_features, n_inner, feature, mean,
                                                 &exponent, &center_scaled, &var_scaled))
        return; /* not reached: fastln_bn_rescale_backward took these moments */
    const double count = (double)(n_outer * n_inner);
    const double rstd_scaled = fastln_bn_backward_scaled_rstd(rstd, var_scaled, eps, exponent);
    const double k_scaled = gamma ? gamma[feature] * rstd_scaled : rstd_scaled;
    const double coef_scaled = rstd_scaled * dgamma / count;
    const double mean_dy = sum_dy / count;
    const int64_t stride = n_features * n_inner;
    FASTLN_T *dx_column = dx + feature * n_inner;
    const FASTLN_T *x_column = x + feature * n_inner;
    for (int64_t k = 0; k < n_outer; k++)
        for (int64_t l = 0; l < n_inner; l++) {
            const int64_t at = k * stride + l;
            const double d = ldexp((double)x_column[at] - mean, exponent);
            const double dy_centred = (double)dx_column[at] - mean_dy;
            dx_column[at] = (FASTLN_T)ldexp(
                k_scaled * (dy_centred - (d - center_scaled) * coef_scaled), exponent);
        }
}
