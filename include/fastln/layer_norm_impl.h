/* Template body of layer_norm.h, instantiated per element type by fastln/instantiate.h (which
 * lists the macros it defines). No include guard on purpose.
 *
 * A row's last (n_cols % 8 or % 32) elements go through the same vector code on a small padded
 * copy, with padding chosen to add exactly zero to every sum, so there is no scalar path. */

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
 * the power of two that brings the largest to about 1 (exact scaling: the result is rounded once
 * more, not changed). A plain loop in a fixed order: this path is taken by a handful of rows at
 * most. var_out gets the scaled variance (0 only for a constant row). */
static double FASTLN_NAME(fastln_ln_rescaled_rstd)(
    const FASTLN_T *x, int64_t n_cols, double mean, double eps, double *var_out)
{
    double largest = 0.0;
    for (int64_t j = 0; j < n_cols; j++) largest = fmax(largest, fabs((double)x[j] - mean));
    *var_out = 0.0;
    if (!(largest > 0.0) || isinf(largest)) return 1.0 / sqrt(eps); /* constant row; or beyond */
    int exponent;
    frexp(largest, &exponent);
    const double scale = ldexp(1.0, -exponent);
    double sum = 0.0, sumsq = 0.0;
    for (int64_t j = 0; j < n_cols; j++) {
        const double d = ((double)x[j] - mean) * scale;
        sum += d;
        sumsq += d * d;
    }
    const double mean_scaled = sum / (double)n_cols;
    double var = sumsq / (double)n_cols - mean_scaled * mean_scaled;
    if (var < 0.0) var = 0.0;
    *var_out = var;
    /* 1 / sqrt(var / scale^2 + eps) = scale / sqrt(var + eps * scale^2) */
    return scale / sqrt(var + eps * scale * scale);
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
    if (i < n_cols) {
        const int rest = (int)(n_cols - i);
        FASTLN_T x_tail[8] = {0}, gamma_tail[8] = {0}, beta_tail[8] = {0}, y_tail[8];
        memcpy(x_tail, x + i, rest * sizeof(FASTLN_T));
        if (gamma) memcpy(gamma_tail, gamma + i, rest * sizeof(FASTLN_T));
        if (beta) memcpy(beta_tail, beta + i, rest * sizeof(FASTLN_T));
        FASTLN_STORE8(y_tail, FASTLN_NAME(fastln_ln_output8)(
            x_tail, gamma ? gamma_tail : NULL, beta ? beta_tail : NULL, shift, mean_shifted, rstd));
        memcpy(y + i, y_tail, rest * sizeof(FASTLN_T));
    }
}

/* Forward of one row of n_cols elements.
 *
 * Statistics come from one read of the row, shifted by its first element: d = x - x[0] is small
 * whenever the row's spread is small, so sum(d) and sum(d * d) in double do not cancel even when
 * |mean| >> std (the E[x^2] - E[x]^2 trap). y is then written in a second pass while the row is
 * still in cache, centring as (x - shift) - mean(d) so that the large offset never meets the small
 * deviations in one rounding.
 *
 * y may be x itself (in place): each element is read before it is overwritten. gamma and beta may
 * be NULL (ones and zeros). mean_out and rstd_out receive the row's statistics. With streaming
 * set, y is written with non-temporal stores (for outputs much larger than the cache). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_layer_norm_forward_row)(
    const FASTLN_T *x, const FASTLN_T *FASTLN_RESTRICT gamma, const FASTLN_T *FASTLN_RESTRICT beta,
    FASTLN_T *y, int64_t n_cols, double eps, double *mean_out, double *rstd_out, int streaming)
{
    const double shift = (double)x[0];
    fastln_d8 sum[FASTLN_ACCUMULATORS] = {{0}};
    fastln_d8 sumsq[FASTLN_ACCUMULATORS] = {{0}};
    FASTLN_NAME(fastln_ln_sums)(x, n_cols, shift, sum, sumsq);
    const double mean_shifted = fastln_reduce(sum) / (double)n_cols;
    double var = fastln_reduce(sumsq) / (double)n_cols - mean_shifted * mean_shifted;
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
    if ((isfinite(mean_shifted) && !isfinite(var)) || (var < FASTLN_TINY && eps < FASTLN_TINY)) {
        /* Squares that overflow (|x| beyond ~1e154) or underflow (spreads below ~1e-154, with
         * eps too small to matter) in double: take the statistics again on rescaled values.
         * Rare; NaN and Inf rows never come here (their mean_shifted is not finite). */
        double var_rescaled;
        rstd = FASTLN_NAME(fastln_ln_rescaled_rstd)(x, n_cols, shift + mean_shifted, eps,
                                                    &var_rescaled);
        var = var_rescaled;
    }
    *mean_out = shift + mean_shifted;
    *rstd_out = rstd;
    /* A constant row with eps = 0: every centred value is exactly 0 and x_hat is defined as 0
     * (y = beta), not 0 * inf = NaN. The cache still reports rstd = inf. */
    const double x_hat_scale = var + eps == 0.0 ? 0.0 : rstd;

    FASTLN_NAME(fastln_ln_write_row)(x, gamma, beta, y, n_cols, shift, mean_shifted, x_hat_scale,
                                     streaming);
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
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, double mean,
    double mean_correction, double rstd, double n, double sum_dxhat, double sum_dxhat_xhat,
    FASTLN_ACC_T *dgamma_acc, FASTLN_ACC_T *dbeta_acc)
{
    const fastln_d8 dy8 = FASTLN_LOAD8(dy);
    const fastln_d8 x_hat = ((FASTLN_LOAD8(x) - mean) - mean_correction) * rstd;
    const fastln_d8 dx_hat = gamma ? dy8 * FASTLN_LOAD8(gamma) : dy8;
    FASTLN_ACC_STORE8(dgamma_acc, FASTLN_ACC_LOAD8(dgamma_acc) + dy8 * x_hat);
    FASTLN_ACC_STORE8(dbeta_acc, FASTLN_ACC_LOAD8(dbeta_acc) + dy8);
    return (rstd / n) * ((n * dx_hat - sum_dxhat) - x_hat * sum_dxhat_xhat);
}

/* The write pass of the backward, all in double: dx, and the dgamma/dbeta accumulators. With
 * streaming set (and dx 16-byte aligned) dx is written with FASTLN_STREAM8, non-temporal for
 * float64. */
FASTLN_INLINE void FASTLN_NAME(fastln_ln_backward_write_row_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *dx, int64_t n_cols,
    double mean, double mean_correction, double rstd, double total_dxhat,
    double total_dxhat_xhat, FASTLN_ACC_T *dgamma_acc, FASTLN_ACC_T *dbeta_acc, int streaming)
{
    const double n = (double)n_cols;
    const int stream_dx = streaming && fastln_is_aligned16(dx);
    int64_t i = 0;
    for (; i + 8 <= n_cols; i += 8) {
        __builtin_prefetch(dy + n_cols + i, 0, 3);
        __builtin_prefetch(x + n_cols + i, 0, 3);
        const fastln_d8 dx8 = FASTLN_NAME(fastln_ln_backward_dx8)(
            dy + i, x + i, gamma ? gamma + i : NULL, mean, mean_correction, rstd, n, total_dxhat,
            total_dxhat_xhat, dgamma_acc + i, dbeta_acc + i);
        if (stream_dx)
            FASTLN_STREAM8(dx + i, dx8);
        else
            FASTLN_STORE8(dx + i, dx8);
    }
    if (stream_dx) fastln_streaming_fence();
    if (i < n_cols) {
        const int rest = (int)(n_cols - i);
        FASTLN_T dy_tail[8] = {0}, x_tail[8] = {0}, gamma_tail[8] = {0}, dx_tail[8];
        FASTLN_ACC_T dgamma_tail[8] = {0}, dbeta_tail[8] = {0};
        memcpy(dy_tail, dy + i, rest * sizeof(FASTLN_T));
        memcpy(x_tail, x + i, rest * sizeof(FASTLN_T));
        if (gamma) memcpy(gamma_tail, gamma + i, rest * sizeof(FASTLN_T));
        memcpy(dgamma_tail, dgamma_acc + i, rest * sizeof(FASTLN_ACC_T));
        memcpy(dbeta_tail, dbeta_acc + i, rest * sizeof(FASTLN_ACC_T));
        FASTLN_STORE8(dx_tail, FASTLN_NAME(fastln_ln_backward_dx8)(
            dy_tail, x_tail, gamma ? gamma_tail : NULL, mean, mean_correction, rstd, n,
            total_dxhat, total_dxhat_xhat, dgamma_tail, dbeta_tail));
        memcpy(dx + i, dx_tail, rest * sizeof(FASTLN_T));
        memcpy(dgamma_acc + i, dgamma_tail, rest * sizeof(FASTLN_ACC_T));
        memcpy(dbeta_acc + i, dbeta_tail, rest * sizeof(FASTLN_ACC_T));
    }
}

/* Backward of one row, the lesson's two-reduction identity:
 *     dx = rstd / n * (n * dx_hat - sum(dx_hat) - x_hat * sum(dx_hat * x_hat)),  dx_hat = dy * gamma.
 *
 * The row mean is re-derived from x in the same read as the two reductions, using the cached mean
 * as the shift: the cache may hold the mean rounded to float32, and (x - mean) with that rounded
 * mean would lose the digits that matter when |mean| >> std.
 *
 * dgamma_acc and dbeta_acc (FASTLN_ACC_T, n_cols) are added to: dgamma += dy * x_hat,
 * dbeta += dy. dx may be dy itself (in place). gamma may be NULL (ones). With streaming set, dx is
 * written with non-temporal stores (for outputs much larger than the cache). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_layer_norm_backward_row)(
    const FASTLN_T *dy, const FASTLN_T *FASTLN_RESTRICT x, const FASTLN_T *FASTLN_RESTRICT gamma,
    double mean, double rstd, FASTLN_T *dx, int64_t n_cols,
    FASTLN_ACC_T *FASTLN_RESTRICT dgamma_acc, FASTLN_ACC_T *FASTLN_RESTRICT dbeta_acc,
    int streaming)
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
    const double n = (double)n_cols;
    const double mean_correction = fastln_reduce(sum_d) / n;
    const double total_dxhat = fastln_reduce(sum_dxhat);
    if (isinf(rstd)) {
        /* A constant row with eps = 0: the forward wrote beta (x_hat = 0), so dgamma gets
         * nothing from it and dx = rstd * (dx_hat - mean(dx_hat)), infinite or NaN. Rare. */
        for (int64_t j = 0; j < n_cols; j++) {
            const double dy_j = (double)dy[j];
            const double dx_hat = gamma ? dy_j * (double)gamma[j] : dy_j;
            dgamma_acc[j] += (FASTLN_ACC_T)(dy_j * 0.0); /* x_hat = 0; NaN in dy stays NaN */
            dbeta_acc[j] += (FASTLN_ACC_T)dy_j;
            dx[j] = (FASTLN_T)(rstd * (dx_hat - total_dxhat / n));
        }
        return;
    }
    const double total_dxhat_xhat =
        rstd * (fastln_reduce(sum_dxhat_d) - mean_correction * total_dxhat);
    FASTLN_NAME(fastln_ln_backward_write_row)(dy, x, gamma, dx, n_cols, mean, mean_correction,
                                              rstd, total_dxhat, total_dxhat_xhat, dgamma_acc,
                                              dbeta_acc, streaming);
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
