/* Template body of layer_norm.h, instantiated per element type by fastln/instantiate.h (which
 * lists the macros it defines). No include guard on purpose.
 *
 * The sums take a row's last (n_cols % 32) elements through the same vector code on a small
 * padded copy, with padding chosen to add exactly zero, so their order depends on n_cols alone.
 * The write passes are elementwise: the elements they do not store as whole vectors (before the
 * output's first cache line, after the last whole chunk) get each lane's arithmetic one at a
 * time, which rounds exactly as the vector lanes do. */

/* sum += d and sumsq += d * d over FASTLN_BLOCK elements, d = x - shift. */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_accumulate)(
    const FASTLN_T *x, double shift, fastln_d8 sum[FASTLN_ACCUMULATORS],
    fastln_d8 sumsq[FASTLN_ACCUMULATORS])
{
    FASTLN_UNROLL_ACCUMULATORS
    for (int a = 0; a < FASTLN_ACCUMULATORS; a++) {
        const fastln_d8 d = FASTLN_LOAD8(x + 8 * a) - shift;
        sum[a] += d;
        sumsq[a] += d * d;
    }
}

/* sum(d) and sum(d * d) over a row, d = x - shift, for a shift that is a value of the element
 * type. The last partial block is padded with the shift itself, which adds exactly d = 0. */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_sums)(
    const FASTLN_T *x, int64_t n_cols, double shift, fastln_d8 sum[FASTLN_ACCUMULATORS],
    fastln_d8 sumsq[FASTLN_ACCUMULATORS])
{
    int64_t i = 0;
    for (; i + FASTLN_BLOCK <= n_cols; i += FASTLN_BLOCK)
        FASTLN_NAME(fastln_ln_accumulate)(x + i, shift, sum, sumsq);
    if (i < n_cols) {
        FASTLN_T padded[FASTLN_BLOCK];
        for (int k = 0; k < FASTLN_BLOCK; k++) padded[k] = i + k < n_cols ? x[i + k] : (FASTLN_T)shift;
        FASTLN_NAME(fastln_ln_accumulate)(padded, shift, sum, sumsq);
    }
}

/* rstd of a row whose squares leave double's range, from its deviations around `mean` scaled by
 * the power of two 2^exponent that brings the largest into [0.5, 1). ldexp scales exactly, also
 * by powers of two beyond double's range (a subnormal spread needs up to 2^1074). Returns
 * rstd * 2^-exponent; *exponent_out gets the exponent, whose rstd itself may be beyond double
 * (eps = 0 and a spread below ~1e-308). A plain loop in a fixed order: this path is taken by a
 * handful of rows at most. var_out gets the scaled variance (0 only for a constant row),
 * residual_out the mean of x - mean (0 for a constant row, NaN where x - mean is beyond
 * double). */
static double FASTLN_NAME(fastln_ln_rescaled_rstd)(
    const FASTLN_T *x, int64_t n_cols, double mean, double eps, double *var_out,
    int *exponent_out, double *residual_out)
{
    double largest = 0.0;
    for (int64_t j = 0; j < n_cols; j++) largest = fmax(largest, fabs((double)x[j] - mean));
    *var_out = 0.0;
    *exponent_out = 0;
    *residual_out = isinf(largest) ? NAN : 0.0;
    if (!(largest > 0.0) || isinf(largest)) return 1.0 / sqrt(eps); /* constant row; or beyond */
    int exponent;
    frexp(largest, &exponent);
    double sum = 0.0, sumsq = 0.0;
    for (int64_t j = 0; j < n_cols; j++) {
        const double d = ldexp((double)x[j] - mean, -exponent);
        sum += d;
        sumsq += d * d;
    }
    const double mean_scaled = sum / (double)n_cols;
    *residual_out = ldexp(mean_scaled, exponent);
    double var = sumsq / (double)n_cols - mean_scaled * mean_scaled;
    if (var < 0.0) var = 0.0;
    *var_out = var;
    /* 1 / sqrt(var * 4^exponent + eps) = 2^-exponent / sqrt(var + eps * 4^-exponent). Where
     * eps * 4^-exponent passes DBL_MAX, it dwarfs var (< 1) and rstd is 1 / sqrt(eps). */
    const double eps_scaled = ldexp(eps, -2 * exponent);
    if (eps_scaled > DBL_MAX) return 1.0 / sqrt(eps);
    *exponent_out = -exponent;
    return 1.0 / sqrt(var + eps_scaled);
}

/* The mean of a row of finite values whose sums around x[0] overflow double (float64 values
 * near DBL_MAX), summed on the values scaled by 2^-k with n_cols < 2^k, a sum that cannot
 * overflow; 0 (no mean) when the row holds a NaN or an Inf, which stays NaN. A plain loop: a
 * rare row. */
static int FASTLN_NAME(fastln_ln_wide_mean)(const FASTLN_T *x, int64_t n_cols, double *mean_out)
{
    int k;
    frexp((double)n_cols, &k);
    double sum = 0.0;
    for (int64_t j = 0; j < n_cols; j++) {
        if (!isfinite((double)x[j])) return 0;
        sum += ldexp((double)x[j], -k);
    }
    *mean_out = ldexp(sum / (double)n_cols, k);
    return 1;
}

/* y = gamma * x_hat + beta for eight elements; gamma and beta may be NULL. */
FASTLN_INLINE fastln_d8 FASTLN_NAME(fastln_ln_output8)(
    const FASTLN_T *x, const FASTLN_T *gamma, const FASTLN_T *beta, double shift,
    double mean_shifted, double rstd)
{
    fastln_d8 out = ((FASTLN_LOAD8(x) - shift) - mean_shifted) * rstd;
    if (gamma) out *= FASTLN_LOAD8(gamma);
    if (beta) out += FASTLN_LOAD8(beta);
    return out;
}

/* y = gamma * x_hat + beta for a whole row, all in double. While it writes, it prefetches the
 * next row (rows are contiguous), so the next statistics pass finds it in cache. */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_write_row_double)(
    const FASTLN_T *x, const FASTLN_T *gamma, const FASTLN_T *beta, FASTLN_T *y, int64_t n_cols,
    double shift, double mean_shifted, double rstd, int streaming)
{
    int64_t i = 0;
    for (; i + 8 <= n_cols; i += 8) {
        __builtin_prefetch(x + n_cols + i, 0, 3);
        FASTLN_STORE8(y + i, FASTLN_NAME(fastln_ln_output8)(
            x + i, gamma ? gamma + i : NULL, beta ? beta + i : NULL, shift, mean_shifted, rstd));
    }
    (void)streaming; /* only the float64 specialisation in layer_norm.h streams */
    for (; i < n_cols; i++) { /* the last n_cols % 8: each lane's arithmetic, one at a time */
        double out = (((double)x[i] - shift) - mean_shifted) * rstd;
        if (gamma) out *= (double)gamma[i];
        if (beta) out += (double)beta[i];
        y[i] = (FASTLN_T)out;
    }
}

/* The statistics of one row (fastln_ln_stats, layer_norm.h), as the forward takes them and
 * the backward's rare path takes them again.
 *
 * They come from one read of the row, shifted by its first element: d = x - x[0] is small
 * whenever the row's spread is small, so sum(d) and sum(d * d) in double do not cancel even when
 * |mean| >> std (the E[x^2] - E[x]^2 trap). A row of finite values whose sums around x[0]
 * overflow (float64 values near DBL_MAX, of both signs) is centred on its mean instead, with
 * every sum taken on scaled values. */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_statistics)(const FASTLN_T *x, int64_t n_cols,
                                                     double eps, fastln_ln_stats *stats)
{
    double shift = (double)x[0];
    fastln_d8 sum[FASTLN_ACCUMULATORS] = {{0}};
    fastln_d8 sumsq[FASTLN_ACCUMULATORS] = {{0}};
    FASTLN_NAME(fastln_ln_sums)(x, n_cols, shift, sum, sumsq);
    double mean_shifted = fastln_reduce(sum) / (double)n_cols;
    double var = fastln_reduce(sumsq) / (double)n_cols - mean_shifted * mean_shifted;
    double wide_mean;
    const int wide = !isfinite(mean_shifted)
                     && FASTLN_NAME(fastln_ln_wide_mean)(x, n_cols, &wide_mean);
    if (wide) {
        /* Finite values whose sums around x[0] overflow (float64 values near DBL_MAX): centred
         * on their mean, and every sum taken on scaled values by the rescaled path below. */
        shift = (double)(FASTLN_T)wide_mean;
        mean_shifted = 0.0;
        var = INFINITY;
    }
    if (mean_shifted * mean_shifted > FASTLN_MAX_CANCELLATION * var) {
        /* The shift was far from the mean (an outlier in x[0]): sum(d * d) and mean(d)^2 cancel
         * by more than ~10 bits. Rare; take the variance again around the mean, in cache. */
        fastln_d8 sum2[FASTLN_ACCUMULATORS] = {{0}};
        fastln_d8 sumsq2[FASTLN_ACCUMULATORS] = {{0}};
        /* The new shift is rounded to the element type so the padding adds exactly zero. */
        FASTLN_NAME(fastln_ln_sums)(x, n_cols, (double)(FASTLN_T)(shift + mean_shifted), sum2,
                                    sumsq2);
        const double mean_residual = fastln_reduce(sum2) / (double)n_cols;
        var = fastln_reduce(sumsq2) / (double)n_cols - mean_residual * mean_residual;
    }
    if (var < 0.0) var = 0.0; /* rounding only; NaN stays NaN */
    double rstd = 1.0 / sqrt(var + eps);
    double rstd_scaled = rstd;
    int exponent = 0;
    if ((isfinite(mean_shifted) && !isfinite(var)) || (var < FASTLN_TINY && eps < FASTLN_TINY)) {
        /* Squares that overflow (|x| beyond ~1e154) or underflow (spreads below ~1e-154, with
         * eps too small to matter) in double: take the statistics again on rescaled values.
         * Rare; NaN and Inf rows never come here (their mean_shifted is not finite). */
        double residual;
        rstd_scaled = FASTLN_NAME(fastln_ln_rescaled_rstd)(x, n_cols, shift + mean_shifted, eps,
                                                           &var, &exponent, &residual);
        if (wide) {
            /* The mean's last digits; NaN where x - mean itself is beyond double, for which
             * the row stays NaN as it was. */
            mean_shifted = residual;
            if (isnan(residual)) var = rstd_scaled = NAN;
        }
        rstd = ldexp(rstd_scaled, exponent); /* Inf when beyond double */
    }
    stats->shift = shift;
    stats->mean_shifted = mean_shifted;
    stats->var = var;
    stats->rstd = rstd;
    stats->rstd_scaled = rstd_scaled;
    stats->exponent = exponent;
}

/* y = gamma * x_hat + beta for a row whose rstd is beyond double's range (eps = 0 and a spread
 * below ~1e-308), with x_hat = ldexp((x - shift) - mean_shifted, exponent) * rstd_scaled: each
 * deviation is brought to about 1 first. A plain loop: a rare row. In place is fine. */
static void FASTLN_NAME(fastln_ln_write_row_rescaled)(
    const FASTLN_T *x, const FASTLN_T *gamma, const FASTLN_T *beta, FASTLN_T *y, int64_t n_cols,
    const fastln_ln_stats *stats)
{
    for (int64_t j = 0; j < n_cols; j++) {
        double value = ldexp(((double)x[j] - stats->shift) - stats->mean_shifted, stats->exponent)
                       * stats->rstd_scaled;
        if (gamma) value *= (double)gamma[j];
        if (beta) value += (double)beta[j];
        y[j] = (FASTLN_T)value;
    }
}

/* Forward of one row of n_cols elements: the statistics (fastln_ln_statistics) from one read of
 * the row, then y is written in a second pass while the row is still in cache, centring as
 * (x - shift) - mean(d) so that the large offset never meets the small deviations in one
 * rounding.
 *
 * y may be x itself (in place): each element is read before it is overwritten. gamma and beta may
 * be NULL (ones and zeros). mean_out and rstd_out receive the row's statistics; an rstd beyond
 * double's range (eps = 0 and a spread below ~1e-308) is reported as Inf, its honest float64
 * value, and the backward then takes the statistics again from x. With streaming set, y is
 * written with non-temporal stores (for outputs much larger than the cache). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_layer_norm_forward_row)(
    const FASTLN_T *x, const FASTLN_T *FASTLN_RESTRICT gamma, const FASTLN_T *FASTLN_RESTRICT beta,
    FASTLN_T *y, int64_t n_cols, double eps, double *mean_out, double *rstd_out, int streaming)
{
    fastln_ln_stats stats;
    FASTLN_NAME(fastln_ln_statistics)(x, n_cols, eps, &stats);
    *mean_out = stats.shift + stats.mean_shifted;
    *rstd_out = stats.rstd;
    if (isinf(stats.rstd) && stats.var > 0.0) {
        FASTLN_NAME(fastln_ln_write_row_rescaled)(x, gamma, beta, y, n_cols, &stats);
        return;
    }
    /* A constant row with eps = 0: every centred value is exactly 0 and x_hat is defined as 0
     * (y = beta), not 0 * inf = NaN. The cache still reports rstd = inf. */
    const double x_hat_scale = stats.var + eps == 0.0 ? 0.0 : stats.rstd;

    /* In two pieces: the elements up to y's next cache line, then the rest, whose vector stores
     * are whole lines (fastln_elements_to_line). Elementwise: the same bits whatever the split. */
    const int64_t head = fastln_elements_to_line(y, sizeof(FASTLN_T), n_cols);
    if (head > 0)
        FASTLN_NAME(fastln_ln_write_row)(x, gamma, beta, y, head, stats.shift,
                                         stats.mean_shifted, x_hat_scale, 0);
    FASTLN_NAME(fastln_ln_write_row)(x + head, gamma ? gamma + head : NULL,
                                     beta ? beta + head : NULL, y + head, n_cols - head,
                                     stats.shift, stats.mean_shifted, x_hat_scale, streaming);
}

/* Backward sums over FASTLN_BLOCK elements, all in double: dx_hat = dy * gamma, d = x - mean. */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_backward_accumulate_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, double mean,
    fastln_d8 sum_dxhat[FASTLN_ACCUMULATORS], fastln_d8 sum_dxhat_d[FASTLN_ACCUMULATORS],
    fastln_d8 sum_d[FASTLN_ACCUMULATORS])
{
    FASTLN_UNROLL_ACCUMULATORS
    for (int a = 0; a < FASTLN_ACCUMULATORS; a++) {
        fastln_d8 dx_hat = FASTLN_LOAD8(dy + 8 * a);
        if (gamma) dx_hat *= FASTLN_LOAD8(gamma + 8 * a);
        const fastln_d8 d = FASTLN_LOAD8(x + 8 * a) - mean;
        sum_dxhat[a] += dx_hat;
        sum_dxhat_d[a] += dx_hat * d;
        sum_d[a] += d;
    }
}

/* dx for eight elements, in double, returned; their dy * x_hat and dy are added to the
 * dgamma/dbeta accumulators (of type FASTLN_ACC_T). */
FASTLN_INLINE fastln_d8 FASTLN_NAME(fastln_ln_backward_dx8)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma,
    const fastln_ln_backward_sums *sums, FASTLN_ACC_T *dgamma_acc, FASTLN_ACC_T *dbeta_acc)
{
    const double n = (double)sums->n_cols;
    const fastln_d8 dy8 = FASTLN_LOAD8(dy);
    const fastln_d8 x_hat = ((FASTLN_LOAD8(x) - sums->mean) - sums->mean_correction) * sums->rstd;
    const fastln_d8 dx_hat = gamma ? dy8 * FASTLN_LOAD8(gamma) : dy8;
    FASTLN_ACC_STORE8(dgamma_acc, FASTLN_ACC_LOAD8(dgamma_acc) + dy8 * x_hat);
    FASTLN_ACC_STORE8(dbeta_acc, FASTLN_ACC_LOAD8(dbeta_acc) + dy8);
    return (sums->rstd / n)
           * ((n * dx_hat - sums->total_dxhat) - x_hat * sums->total_dxhat_xhat);
}

/* The double write pass for the elements from i to end (fewer than 8) of a row: each lane's
 * arithmetic of fastln_ln_backward_dx8, one element at a time. */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_backward_write_tail_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *dx, int64_t i,
    int64_t end, const fastln_ln_backward_sums *sums, FASTLN_ACC_T *dgamma_acc,
    FASTLN_ACC_T *dbeta_acc)
{
    const double n = (double)sums->n_cols;
    for (; i < end; i++) {
        const double dy_i = (double)dy[i];
        const double x_hat = (((double)x[i] - sums->mean) - sums->mean_correction) * sums->rstd;
        const double dx_hat = gamma ? dy_i * (double)gamma[i] : dy_i;
        dgamma_acc[i] = (FASTLN_ACC_T)((double)dgamma_acc[i] + dy_i * x_hat);
        dbeta_acc[i] = (FASTLN_ACC_T)((double)dbeta_acc[i] + dy_i);
        dx[i] = (FASTLN_T)((sums->rstd / n)
                           * ((n * dx_hat - sums->total_dxhat) - x_hat * sums->total_dxhat_xhat));
    }
}

/* The write pass of the backward, all in double: dx, and the dgamma/dbeta accumulators. With
 * streaming set (and dx 16-byte aligned) dx is written with FASTLN_STREAM8, non-temporal for
 * float64. */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_backward_write_row_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *dx, int64_t n_cols,
    const fastln_ln_backward_sums *sums, FASTLN_ACC_T *dgamma_acc, FASTLN_ACC_T *dbeta_acc,
    int streaming)
{
    const fastln_ln_backward_sums row = *sums;
    const int stream_dx = streaming && fastln_is_aligned16(dx);
    int64_t i = 0;
    for (; i + 8 <= n_cols; i += 8) {
        if (streaming) { /* see fastln_ln_backward_write_row_f32 */
            __builtin_prefetch(dy + n_cols + i, 0, 3);
            __builtin_prefetch(x + n_cols + i, 0, 3);
        }
        const fastln_d8 dx8 = FASTLN_NAME(fastln_ln_backward_dx8)(
            dy + i, x + i, gamma ? gamma + i : NULL, &row, dgamma_acc + i, dbeta_acc + i);
        if (stream_dx)
            FASTLN_STREAM8(dx + i, dx8);
        else
            FASTLN_STORE8(dx + i, dx8);
    }
    if (stream_dx) fastln_streaming_fence();
    if (i < n_cols)
        FASTLN_NAME(fastln_ln_backward_write_tail_double)(dy, x, gamma, dx, i, n_cols, &row,
                                                          dgamma_acc, dbeta_acc);
}

/* The double write pass of n_rows consecutive rows together (fastln_layer_norm_backward_rows),
 * over width columns of rows stride elements apart: each eight accumulators are loaded and
 * stored once for the group, and the rows add to them in row order, as row after row would. */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_backward_write_rows_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_ln_backward_sums *sums,
    FASTLN_ACC_T *dgamma_acc, FASTLN_ACC_T *dbeta_acc)
{
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
        FASTLN_ACC_T dgamma8[8], dbeta8[8];
        memcpy(dgamma8, dgamma_acc + i, sizeof dgamma8);
        memcpy(dbeta8, dbeta_acc + i, sizeof dbeta8);
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t at = r * stride + i;
            FASTLN_STORE8(dx + at, FASTLN_NAME(fastln_ln_backward_dx8)(
                dy + at, x + at, gamma ? gamma + i : NULL, &sums[r], dgamma8, dbeta8));
        }
        memcpy(dgamma_acc + i, dgamma8, sizeof dgamma8);
        memcpy(dbeta_acc + i, dbeta8, sizeof dbeta8);
    }
    if (i < width)
        for (int64_t r = 0; r < n_rows; r++)
            FASTLN_NAME(fastln_ln_backward_write_tail_double)(
                dy + r * stride, x + r * stride, gamma, dx + r * stride, i, width, &sums[r],
                dgamma_acc, dbeta_acc);
}

/* Backward of a row from its statistics taken again from x (fastln_ln_statistics), all in
 * double, every scaling an exact power of two, in plain loops in a fixed order:
 *     x_hat = ldexp((x - shift) - mean_shifted, e) * rstd_scaled          (|x_hat| <= sqrt(n))
 *     g = ldexp(dx_hat, -k), 2^k just above max |dx_hat|                   (|g| < 1)
 *     dx = ldexp(rstd_scaled * ((g - mean(g)) - x_hat * mean(g * x_hat)), e + k)
 * so no product leaves double's range unless dx itself does. For the rows the vector passes
 * cannot take: an rstd beyond the cache's range (Inf: float32 subnormal spreads, float64 ones
 * with eps = 0), or dy * (x - mean) beyond double's (|x| and |dy| near 1e300, or both tiny).
 * dx may be dy. */
static void FASTLN_NAME(fastln_ln_backward_row_recomputed)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *dx, int64_t n_cols,
    double eps, FASTLN_ACC_T *dgamma_acc, FASTLN_ACC_T *dbeta_acc)
{
    fastln_ln_stats stats;
    FASTLN_NAME(fastln_ln_statistics)(x, n_cols, eps, &stats);
    double largest = 0.0;
    for (int64_t j = 0; j < n_cols; j++) {
        const double dx_hat = gamma ? (double)dy[j] * (double)gamma[j] : (double)dy[j];
        if (isfinite(dx_hat)) largest = fmax(largest, fabs(dx_hat));
    }
    int k = 0;
    if (largest > 0.0) frexp(largest, &k);
    double sum_g = 0.0, sum_g_xhat = 0.0;
    for (int64_t j = 0; j < n_cols; j++) {
        const double x_hat = ldexp(((double)x[j] - stats.shift) - stats.mean_shifted,
                                   stats.exponent) * stats.rstd_scaled;
        const double dx_hat = gamma ? (double)dy[j] * (double)gamma[j] : (double)dy[j];
        const double g = ldexp(dx_hat, -k);
        sum_g += g;
        sum_g_xhat += g * x_hat;
    }
    const double mean_g = sum_g / (double)n_cols;
    const double mean_g_xhat = sum_g_xhat / (double)n_cols;
    for (int64_t j = 0; j < n_cols; j++) {
        const double x_hat = ldexp(((double)x[j] - stats.shift) - stats.mean_shifted,
                                   stats.exponent) * stats.rstd_scaled;
        const double dy_j = (double)dy[j];
        const double g = ldexp(gamma ? dy_j * (double)gamma[j] : dy_j, -k);
        dgamma_acc[j] += (FASTLN_ACC_T)(dy_j * x_hat);
        dbeta_acc[j] += (FASTLN_ACC_T)dy_j;
        dx[j] = (FASTLN_T)ldexp(stats.rstd_scaled * ((g - mean_g) - x_hat * mean_g_xhat),
                                stats.exponent + k);
    }
}

/* The rows whose vector sums did not give a finite sum(dx_hat * x_hat) (rare): returns 0 when
 * the vector write pass should still do the row (a NaN or Inf in it: their NaN keeps flowing as
 * it always has), 1 when the row is done here. */
static int FASTLN_NAME(fastln_ln_backward_row_rare)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *dx, int64_t n_cols,
    double rstd, double eps, double total_dxhat, FASTLN_ACC_T *dgamma_acc,
    FASTLN_ACC_T *dbeta_acc)
{
    if (isnan(rstd)) return 0;
    int constant = 1, finite = 1;
    for (int64_t j = 0; j < n_cols; j++) {
        constant &= x[j] == x[0];
        finite &= isfinite((double)dy[j]) && isfinite((double)x[j])
                  && (!gamma || isfinite((double)gamma[j]));
    }
    if (isinf(rstd) && constant) {
        /* A constant row with eps = 0 (or with an eps so small that 1 / sqrt(eps) is beyond a
         * float32 cache): the forward wrote beta (x_hat = 0), so dgamma gets nothing from it
         * and dx = rstd * (dx_hat - mean(dx_hat)) with the row's true rstd, 1 / sqrt(eps):
         * infinite or NaN with eps = 0, 0 where dy is constant. */
        const double n = (double)n_cols;
        const double row_rstd = 1.0 / sqrt(eps);
        for (int64_t j = 0; j < n_cols; j++) {
            const double dy_j = (double)dy[j];
            const double dx_hat = gamma ? dy_j * (double)gamma[j] : dy_j;
            dgamma_acc[j] += (FASTLN_ACC_T)(dy_j * 0.0); /* x_hat = 0; NaN in dy stays NaN */
            dbeta_acc[j] += (FASTLN_ACC_T)dy_j;
            dx[j] = (FASTLN_T)(row_rstd * (dx_hat - total_dxhat / n));
        }
        return 1;
    }
    /* An Inf rstd of a row that is not constant is the cache's way of saying "beyond my range":
     * the row is done from x, whatever dy holds. With a finite rstd only overflow brings a row
     * here when its values are all finite. */
    if (!isinf(rstd) && !finite) return 0;
    FASTLN_NAME(fastln_ln_backward_row_recomputed)(dy, x, gamma, dx, n_cols, eps, dgamma_acc,
                                                   dbeta_acc);
    return 1;
}

/* Whether every element is zero, eight at a time (padding rows of dy take this test). */
FASTLN_INLINE int FASTLN_NAME(fastln_all_zero)(const FASTLN_T *v, int64_t n)
{
    typedef int64_t fastln_i8 __attribute__((vector_size(64)));
    fastln_i8 nonzero = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) nonzero |= FASTLN_LOAD8(v + j) != 0.0;
    int any = 0;
    for (int k = 0; k < 8; k++) any |= nonzero[k] != 0;
    for (; j < n; j++) any |= v[j] != (FASTLN_T)0;
    return !any;
}

/* Whether a float64 row's products dx_hat * (x - mean) may have fallen below double's normal
 * range, taking their digits with them: |dy| and |x - mean| both tiny (say 1e-310 and 1e-150,
 * whose squares are fine). A product below DBL_MIN is off by up to DBL_MIN * 2^-53; n of them
 * stay below 2^-53 of the row's largest product when that is n * DBL_MIN or more. Rare: a
 * scan, outside the vector passes (an all-zero dy, whose products are exact zeros, does not
 * come here). */
static int FASTLN_NAME(fastln_ln_backward_products_underflow)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, double mean, int64_t n_cols)
{
    double largest_dxhat = 0.0, largest_d = 0.0;
    for (int64_t j = 0; j < n_cols; j++) {
        const double dx_hat = gamma ? (double)dy[j] * (double)gamma[j] : (double)dy[j];
        largest_dxhat = fmax(largest_dxhat, fabs(dx_hat));
        largest_d = fmax(largest_d, fabs((double)x[j] - mean));
    }
    return largest_dxhat > 0.0 && largest_d > 0.0
           && largest_dxhat * largest_d < (double)n_cols * DBL_MIN;
}

/* The backward's first pass over a row: its sums in double, dx_hat = dy * gamma, d = x - mean.
 *
 * The row mean is re-derived from x in the same read as the two reductions, using the cached mean
 * as the shift: the cache may hold the mean rounded to float32, and (x - mean) with that rounded
 * mean would lose the digits that matter when |mean| >> std. */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_backward_first_pass)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, double mean, double rstd,
    int64_t n_cols, fastln_ln_backward_sums *sums)
{
    fastln_d8 sum_dxhat[FASTLN_ACCUMULATORS] = {{0}};
    fastln_d8 sum_dxhat_d[FASTLN_ACCUMULATORS] = {{0}};
    fastln_d8 sum_d[FASTLN_ACCUMULATORS] = {{0}};
    int64_t i = 0;
    for (; i + FASTLN_BLOCK <= n_cols; i += FASTLN_BLOCK)
        FASTLN_NAME(fastln_ln_backward_accumulate)(dy + i, x + i, gamma ? gamma + i : NULL, mean,
                                                   sum_dxhat, sum_dxhat_d, sum_d);
    if (i < n_cols) {
        /* Padding with dy = 0 and x = mean adds exactly zero to all three sums. */
        FASTLN_T dy_tail[FASTLN_BLOCK], x_tail[FASTLN_BLOCK], gamma_tail[FASTLN_BLOCK];
        for (int k = 0; k < FASTLN_BLOCK; k++) {
            const int inside = i + k < n_cols;
            dy_tail[k] = inside ? dy[i + k] : (FASTLN_T)0;
            x_tail[k] = inside ? x[i + k] : (FASTLN_T)mean;
            gamma_tail[k] = inside && gamma ? gamma[i + k] : (FASTLN_T)1;
        }
        FASTLN_NAME(fastln_ln_backward_accumulate)(dy_tail, x_tail, gamma ? gamma_tail : NULL,
                                                   mean, sum_dxhat, sum_dxhat_d, sum_d);
    }
    sums->mean = mean;
    sums->rstd = rstd;
    sums->n_cols = n_cols;
    sums->mean_correction = fastln_reduce(sum_d) / (double)n_cols;
    sums->total_dxhat = fastln_reduce(sum_dxhat);
    sums->total_dxhat_d = fastln_reduce(sum_dxhat_d);
    sums->total_dxhat_xhat =
        rstd * (sums->total_dxhat_d - sums->mean_correction * sums->total_dxhat);
}

/* Whether sum(dx_hat * d) may hold products that underflowed (float64 only: float32 ones,
 * formed in double, cannot): their sum is below n * (n * DBL_MIN) then, which ordinary rows
 * never are (all-zero dy aside). */
FASTLN_INLINE int FASTLN_NAME(fastln_ln_backward_maybe_underflow)(
    const fastln_ln_backward_sums *sums)
{
    const double n = (double)sums->n_cols;
    return sizeof(FASTLN_T) == sizeof(double) && fabs(sums->total_dxhat_d) < n * n * DBL_MIN;
}

/* Backward of one row from its first pass's sums (fastln_ln_backward_first_pass), by the lesson's
 * two-reduction identity:
 *     dx = rstd / n * (n * dx_hat - sum(dx_hat) - x_hat * sum(dx_hat * x_hat)),  dx_hat = dy * gamma.
 *
 * eps is the forward's: rows whose cached rstd is Inf (beyond the cache's range) and rows whose
 * products overflow or underflow double are done from statistics taken again from x
 * (fastln_ln_backward_row_rare, fastln_ln_backward_row_recomputed), outside the vector passes.
 *
 * dgamma_acc and dbeta_acc (FASTLN_ACC_T, n_cols) are added to: dgamma += dy * x_hat,
 * dbeta += dy. dx may be dy itself (in place). gamma may be NULL (ones). With streaming set, dx is
 * written with non-temporal stores (for outputs much larger than the cache). */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_backward_row_from_sums)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, double eps, FASTLN_T *dx,
    int64_t n_cols, const fastln_ln_backward_sums *sums, FASTLN_ACC_T *dgamma_acc,
    FASTLN_ACC_T *dbeta_acc, int streaming)
{
    /* Not finite: an Inf rstd (a constant row with eps = 0, or beyond the cache's range), a
     * product that overflowed, or a NaN or Inf in the row. Rare. */
    if (!isfinite(sums->total_dxhat_xhat)
        && FASTLN_NAME(fastln_ln_backward_row_rare)(dy, x, gamma, dx, n_cols, sums->rstd, eps,
                                                    sums->total_dxhat, dgamma_acc, dbeta_acc))
        return;
    if (FASTLN_NAME(fastln_ln_backward_maybe_underflow)(sums)
        && !FASTLN_NAME(fastln_all_zero)(dy, n_cols)
        && FASTLN_NAME(fastln_ln_backward_products_underflow)(dy, x, gamma, sums->mean,
                                                                n_cols)) {
        FASTLN_NAME(fastln_ln_backward_row_recomputed)(dy, x, gamma, dx, n_cols, eps, dgamma_acc,
                                                       dbeta_acc);
        return;
    }
    /* In two pieces: the elements up to dx's next cache line, then the rest, whose vector
     * stores are whole lines (fastln_elements_to_line). The pass is elementwise: the same bits
     * whatever the split. */
    const int64_t head = fastln_elements_to_line(dx, sizeof(FASTLN_T), n_cols);
    if (head > 0)
        FASTLN_NAME(fastln_ln_backward_write_row)(dy, x, gamma, dx, head, sums, dgamma_acc,
                                                  dbeta_acc, 0);
    FASTLN_NAME(fastln_ln_backward_write_row)(dy + head, x + head, gamma ? gamma + head : NULL,
                                              dx + head, n_cols - head, sums, dgamma_acc + head,
                                              dbeta_acc + head, streaming);
}

/* Backward of n_rows <= FASTLN_BACKWARD_GROUP consecutive rows: each row's first pass, then
 * one write pass over the group's columns (fastln_ln_backward_write_rows_*) that loads and
 * stores each dgamma/dbeta accumulator once per group instead of once per row - that traffic
 * was 40% of the time of a 768-wide float32 row in cache. Each element's arithmetic, and the
 * order in which the rows add to an accumulator, are those of the single-row pass
 * (fastln_ln_backward_row_from_sums) row after row: the results are the same bits. A group with
 * a row that the vector write pass does not take as it is, or whose dx streams (rows from
 * memory), goes row by row, keeping the first passes already taken. mean and rstd are the
 * group's entries of the cache; dx may be dy (in place). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_layer_norm_backward_rows)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, const FASTLN_T *mean,
    const FASTLN_T *rstd, double eps, FASTLN_T *dx, int64_t n_rows, int64_t n_cols,
    FASTLN_ACC_T *dgamma_acc, FASTLN_ACC_T *dbeta_acc, int streaming)
{
    fastln_ln_backward_sums sums[FASTLN_BACKWARD_GROUP];
    int grouped = n_rows <= FASTLN_BACKWARD_GROUP && !streaming;
    int64_t n_summed = 0;
    for (; grouped && n_summed < n_rows; n_summed++) {
        const int64_t r = n_summed;
        FASTLN_NAME(fastln_ln_backward_first_pass)(dy + r * n_cols, x + r * n_cols, gamma,
                                                   mean[r], rstd[r], n_cols, &sums[r]);
        grouped = isfinite(sums[r].total_dxhat_xhat)
                  && !FASTLN_NAME(fastln_ln_backward_maybe_underflow)(&sums[r])
                  && FASTLN_NAME(fastln_ln_backward_in_vectors)(&sums[r]);
    }
    if (!grouped) {
        for (int64_t r = 0; r < n_rows; r++) {
            fastln_ln_backward_sums row_sums;
            const fastln_ln_backward_sums *row = r < n_summed ? &sums[r] : &row_sums;
            if (r >= n_summed)
                FASTLN_NAME(fastln_ln_backward_first_pass)(dy + r * n_cols, x + r * n_cols,
                                                           gamma, mean[r], rstd[r], n_cols,
                                                           &row_sums);
            FASTLN_NAME(fastln_ln_backward_row_from_sums)(
                dy + r * n_cols, x + r * n_cols, gamma, eps, dx + r * n_cols, n_cols, row,
                dgamma_acc, dbeta_acc, streaming);
        }
        return;
    }
    /* The columns up to dx's next cache line first, as the single-row pass does; the rows all
     * start at the same offset from a line only when a row is a whole number of lines. */
    const int64_t head = n_cols * (int64_t)sizeof(FASTLN_T) % 64 == 0
                             ? fastln_elements_to_line(dx, sizeof(FASTLN_T), n_cols) : 0;
    if (head > 0)
        FASTLN_NAME(fastln_ln_backward_write_rows)(dy, x, gamma, dx, n_rows, n_cols, head, sums,
                                                   dgamma_acc, dbeta_acc);
    FASTLN_NAME(fastln_ln_backward_write_rows)(
        dy + head, x + head, gamma ? gamma + head : NULL, dx + head, n_rows, n_cols,
        n_cols - head, sums, dgamma_acc + head, dbeta_acc + head);
}

/* Backward of one row (its first pass, then fastln_ln_backward_row_from_sums): the entry point
 * for rows converted one at a time (the half-precision kernels). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_layer_norm_backward_row)(
    const FASTLN_T *dy, const FASTLN_T *FASTLN_RESTRICT x, const FASTLN_T *FASTLN_RESTRICT gamma,
    double mean, double rstd, double eps, FASTLN_T *dx, int64_t n_cols,
    FASTLN_ACC_T *FASTLN_RESTRICT dgamma_acc, FASTLN_ACC_T *FASTLN_RESTRICT dbeta_acc,
    int streaming)
{
    fastln_ln_backward_sums sums;
    FASTLN_NAME(fastln_ln_backward_first_pass)(dy, x, gamma, mean, rstd, n_cols, &sums);
    FASTLN_NAME(fastln_ln_backward_row_from_sums)(dy, x, gamma, eps, dx, n_cols, &sums,
                                                  dgamma_acc, dbeta_acc, streaming);
}

/* dgamma/dbeta: add the per-block partial sums (n_blocks rows of n_cols doubles) in block order,
 * so the result does not depend on which thread produced which block. The sums are formed in
 * the first block's row, which is overwritten. */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_sum_block_partials)(
    double *FASTLN_RESTRICT partials, int64_t n_blocks, int64_t n_cols,
    FASTLN_T *FASTLN_RESTRICT out)
{
    for (int64_t b = 1; b < n_blocks; b++) {
        const double *FASTLN_RESTRICT block = partials + b * n_cols;
        for (int64_t j = 0; j < n_cols; j++) partials[j] += block[j];
    }
    for (int64_t j = 0; j < n_cols; j++) out[j] = (FASTLN_T)partials[j];
}
