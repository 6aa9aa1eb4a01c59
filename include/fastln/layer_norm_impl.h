/* Template body of layer_norm.h: included once per element type with FASTLN_T (the element
 * type) and FASTLN_NAME(name) (appends the type suffix) defined. No include guard on purpose. */

/* Forward of one row of n_cols elements.
 *
 * Statistics come from one read of the row, shifted by its first element: d = x - x[0] is small
 * whenever the row's spread is small, so sum(d) and sum(d*d) in double do not cancel even when
 * |mean| >> std (the E[x^2] - E[x]^2 trap). y is then written in a second pass while the row is
 * still in cache, centring as (x - shift) - mean(d) so that the large offset never meets the small
 * deviations in one rounding.
 *
 * y may be x itself (in place): each element is read before it is overwritten. gamma and beta may
 * be NULL (ones and zeros). mean_out and rstd_out receive the row's statistics. */
static inline void FASTLN_NAME(fastln_layer_norm_forward_row)(
    const FASTLN_T *x, const FASTLN_T *FASTLN_RESTRICT gamma, const FASTLN_T *FASTLN_RESTRICT beta,
    FASTLN_T *y, int64_t n_cols, double eps, double *mean_out, double *rstd_out)
{
    const double shift = (double)x[0];
    double sum_lanes[FASTLN_LANES] = {0};
    double sumsq_lanes[FASTLN_LANES] = {0};
    int64_t i = 0;
    for (; i + FASTLN_LANES <= n_cols; i += FASTLN_LANES) {
        for (int k = 0; k < FASTLN_LANES; k++) {
            const double d = (double)x[i + k] - shift;
            sum_lanes[k] += d;
            sumsq_lanes[k] += d * d;
        }
    }
    for (int k = 0; i + k < n_cols; k++) {
        const double d = (double)x[i + k] - shift;
        sum_lanes[k] += d;
        sumsq_lanes[k] += d * d;
    }
    const double mean_shifted = fastln_sum_lanes(sum_lanes) / (double)n_cols;
    double var = fastln_sum_lanes(sumsq_lanes) / (double)n_cols - mean_shifted * mean_shifted;
    if (var < 0.0) var = 0.0; /* rounding only; NaN stays NaN */
    const double rstd = 1.0 / sqrt(var + eps);
    *mean_out = shift + mean_shifted;
    *rstd_out = rstd;

    if (gamma && beta) {
        for (i = 0; i < n_cols; i++) {
            const double x_hat = (((double)x[i] - shift) - mean_shifted) * rstd;
            y[i] = (FASTLN_T)(x_hat * (double)gamma[i] + (double)beta[i]);
        }
    } else if (gamma) {
        for (i = 0; i < n_cols; i++) {
            const double x_hat = (((double)x[i] - shift) - mean_shifted) * rstd;
            y[i] = (FASTLN_T)(x_hat * (double)gamma[i]);
        }
    } else if (beta) {
        for (i = 0; i < n_cols; i++) {
            const double x_hat = (((double)x[i] - shift) - mean_shifted) * rstd;
            y[i] = (FASTLN_T)(x_hat + (double)beta[i]);
        }
    } else {
        for (i = 0; i < n_cols; i++) {
            const double x_hat = (((double)x[i] - shift) - mean_shifted) * rstd;
            y[i] = (FASTLN_T)x_hat;
        }
    }
}

/* Backward of one row, the lesson's two-reduction identity:
 *     dx = rstd / n * (n * dx_hat - sum(dx_hat) - x_hat * sum(dx_hat * x_hat)),  dx_hat = dy * gamma.
 *
 * The row mean is re-derived from x in the same read as the two reductions, using the cached mean
 * as the shift: the cache may hold the mean rounded to float32, and (x - mean) with that rounded
 * mean would lose the digits that matter when |mean| >> std.
 *
 * dgamma_acc and dbeta_acc (double, n_cols) are added to: dgamma += dy * x_hat, dbeta += dy.
 * dx may be dy itself (in place). gamma may be NULL (ones). */
static inline void FASTLN_NAME(fastln_layer_norm_backward_row)(
    const FASTLN_T *dy, const FASTLN_T *FASTLN_RESTRICT x, const FASTLN_T *FASTLN_RESTRICT gamma,
    double mean, double rstd, FASTLN_T *dx, int64_t n_cols,
    double *FASTLN_RESTRICT dgamma_acc, double *FASTLN_RESTRICT dbeta_acc)
{
    double dxhat_lanes[FASTLN_LANES] = {0};   /* sum(dx_hat) */
    double dxhat_d_lanes[FASTLN_LANES] = {0}; /* sum(dx_hat * (x - mean)) */
    double d_lanes[FASTLN_LANES] = {0};       /* sum(x - mean): the mean's correction */
    int64_t i = 0;
    for (; i + FASTLN_LANES <= n_cols; i += FASTLN_LANES) {
        for (int k = 0; k < FASTLN_LANES; k++) {
            const double g = gamma ? (double)gamma[i + k] : 1.0;
            const double dx_hat = (double)dy[i + k] * g;
            const double d = (double)x[i + k] - mean;
            dxhat_lanes[k] += dx_hat;
            dxhat_d_lanes[k] += dx_hat * d;
            d_lanes[k] += d;
        }
    }
    for (int k = 0; i + k < n_cols; k++) {
        const double g = gamma ? (double)gamma[i + k] : 1.0;
        const double dx_hat = (double)dy[i + k] * g;
        const double d = (double)x[i + k] - mean;
        dxhat_lanes[k] += dx_hat;
        dxhat_d_lanes[k] += dx_hat * d;
        d_lanes[k] += d;
    }
    const double n = (double)n_cols;
    const double mean_correction = fastln_sum_lanes(d_lanes) / n;
    const double sum_dxhat = fastln_sum_lanes(dxhat_lanes);
    const double sum_dxhat_xhat =
        rstd * (fastln_sum_lanes(dxhat_d_lanes) - mean_correction * sum_dxhat);
    const double scale = rstd / n;

    for (i = 0; i < n_cols; i++) {
        const double g = gamma ? (double)gamma[i] : 1.0;
        const double dy_i = (double)dy[i];
        const double x_hat = (((double)x[i] - mean) - mean_correction) * rstd;
        dgamma_acc[i] += dy_i * x_hat;
        dbeta_acc[i] += dy_i;
        dx[i] = (FASTLN_T)(scale * (n * (dy_i * g) - sum_dxhat - x_hat * sum_dxhat_xhat));
    }
}

/* dgamma/dbeta: add the per-block partial sums (n_blocks rows of n_cols doubles) in block order,
 * so the result does not depend on which thread produced which block. */
static inline void FASTLN_NAME(fastln_sum_block_partials)(
    const double *FASTLN_RESTRICT partials, int64_t n_blocks, int64_t n_cols,
    FASTLN_T *FASTLN_RESTRICT out)
{
    for (int64_t j = 0; j < n_cols; j++) {
        double total = 0.0;
        for (int64_t b = 0; b < n_blocks; b++) total += partials[b * n_cols + j];
        out[j] = (FASTLN_T)total;
    }
}
