/* Template body of rms_norm.h, instantiated per element type by fastln/instantiate.h (which
 * lists the macros it defines). No include guard on purpose.
 *
 * Like layer_norm_impl.h, the sums take a row's last (n_cols % 32) elements through the same
 * vector code on a small zero-padded copy (zeros add exactly nothing to a sum), so each sum's
 * order depends on n_cols alone; the elementwise write passes do the elements outside whole
 * vectors one at a time, with each lane's arithmetic. */

/* sumsq += (x * scale)^2 over FASTLN_BLOCK elements. scale is 1 except on the overflow path. */
FASTLN_INLINE void FASTLN_NAME(fastln_rms_accumulate)(
    const FASTLN_T *x, double scale, fastln_d8 sumsq[FASTLN_ACCUMULATORS])
{
    FASTLN_UNROLL_ACCUMULATORS
    for (int a = 0; a < FASTLN_ACCUMULATORS; a++) {
        const fastln_d8 v = FASTLN_LOAD8(x + 8 * a) * scale;
        sumsq[a] += v * v;
    }
}

/* sum((x * scale)^2) over the row, in the fixed order of the accumulators. */
FASTLN_INLINE double FASTLN_NAME(fastln_rms_sum_squares)(const FASTLN_T *x, int64_t n_cols,
                                                         double scale)
{
    fastln_d8 sumsq[FASTLN_ACCUMULATORS] = {{0}};
    int64_t i = 0;
    for (; i + FASTLN_BLOCK <= n_cols; i += FASTLN_BLOCK)
        FASTLN_NAME(fastln_rms_accumulate)(x + i, scale, sumsq);
    if (i < n_cols) {
        FASTLN_T padded[FASTLN_BLOCK] = {0};
        memcpy(padded, x + i, (size_t)(n_cols - i) * sizeof(FASTLN_T));
        FASTLN_NAME(fastln_rms_accumulate)(padded, scale, sumsq);
    }
    return fastln_reduce(sumsq);
}

/* rstd * 2^-exponent of a row whose squares leave double's range (rare, outside the hot loop),
 * summed again scaled by the power of two 2^exponent that brings max|x| into [0.5, 1) (so the
 * scaling is exact), at most 2^1023 (the largest double power of two: a subnormal row then
 * lands at 2^-51 or above, where squares keep their digits):
 *     rstd = 2^exponent / sqrt(mean((x * 2^exponent)^2) + eps * 4^exponent).
 * *exponent_out gets the exponent (0 when eps dwarfs every square); rstd itself may be beyond
 * double (eps = 0 and a row below ~1e-308). An all-zero row gives 1 / sqrt(eps), Inf when
 * eps = 0; a row holding an Inf gives 0 (mean(x * x) is Inf). */
static double FASTLN_NAME(fastln_rms_rescaled_rstd)(const FASTLN_T *x, int64_t n_cols, double eps,
                                                    int *exponent_out)
{
    *exponent_out = 0;
    double max_abs = 0.0;
    for (int64_t i = 0; i < n_cols; i++) {
        const double magnitude = fabs((double)x[i]);
        if (magnitude > max_abs) max_abs = magnitude;
    }
    if (!(max_abs <= DBL_MAX)) return 0.0;          /* an Inf in the row: mean(x * x) is Inf */
    if (max_abs == 0.0) return 1.0 / sqrt(eps);     /* all zeros */
    int exponent;
    frexp(max_abs, &exponent);
    exponent = exponent < -1023 ? 1023 : -exponent;
    const double scale = ldexp(1.0, exponent);
    const double eps_scaled = (eps * scale) * scale;
    if (eps_scaled > DBL_MAX) return 1.0 / sqrt(eps); /* eps dwarfs every square */
    const double scaled = FASTLN_NAME(fastln_rms_sum_squares)(x, n_cols, scale) / (double)n_cols;
    *exponent_out = exponent;
    return 1.0 / sqrt(scaled + eps_scaled);
}

/* 1 / sqrt(mean(x * x) + eps) of one row.
 *
 * The sum of squares is in double, where float32 squares can neither overflow nor underflow.
 * A float64 row can: squares beyond about 1e154 overflow, and with eps = 0 squares below about
 * 1e-154 lose their digits. Such a row is summed again rescaled (fastln_rms_rescaled_rstd). An
 * all-zero row gives 1 / sqrt(eps), and Inf when eps = 0 (the caller then writes y = 0); so does
 * a row whose rstd is beyond double's range (eps = 0 and values below ~1e-308). */
FASTLN_INLINE double FASTLN_NAME(fastln_rms_row_rstd)(const FASTLN_T *x, int64_t n_cols,
                                                      double eps)
{
    const double n = (double)n_cols;
    const double mean_square = FASTLN_NAME(fastln_rms_sum_squares)(x, n_cols, 1.0) / n;
    if (mean_square <= DBL_MAX && mean_square + eps >= DBL_MIN) /* false for Inf and NaN */
        return 1.0 / sqrt(mean_square + eps);
    if (mean_square != mean_square) return mean_square; /* NaN in the row */
    int exponent;
    const double rstd_scaled = FASTLN_NAME(fastln_rms_rescaled_rstd)(x, n_cols, eps, &exponent);
    return ldexp(rstd_scaled, exponent);
}

/* y = gamma * (ldexp(x, exponent) * rstd_scaled) for a row whose rstd is beyond double's range
 * (eps = 0 and values below ~1e-308): each value is brought to about 1 first. A plain loop: a
 * rare row. In place is fine. */
static void FASTLN_NAME(fastln_rms_write_row_rescaled)(
    const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *y, int64_t n_cols, int exponent,
    double rstd_scaled)
{
    for (int64_t i = 0; i < n_cols; i++) {
        double value = ldexp((double)x[i], exponent) * rstd_scaled;
        if (gamma) value *= (double)gamma[i];
        y[i] = (FASTLN_T)value;
    }
}

/* y = gamma * (x * rstd) for eight elements; gamma may be NULL. */
FASTLN_INLINE void FASTLN_NAME(fastln_rms_write8)(
    const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *y, double rstd)
{
    fastln_d8 out = FASTLN_LOAD8(x) * rstd;
    if (gamma) out *= FASTLN_LOAD8(gamma);
    FASTLN_STORE8(y, out);
}

/* y = gamma * (x * x_scale) for n elements (a row, or a piece of one), all in double: whole
 * chunks of eight, then the rest one by one. While it writes, it prefetches the next row (rows
 * are contiguous), so the next sum of squares finds it in cache, as LayerNorm's write pass does.
 * The forward takes it through fastln_rms_write_row_* (rms_norm.h). */
FASTLN_INLINE void FASTLN_NAME(fastln_rms_write_row_double)(
    const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *y, int64_t n, double x_scale)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __builtin_prefetch(x + n + i, 0, 3);
        FASTLN_NAME(fastln_rms_write8)(x + i, gamma ? gamma + i : NULL, y + i, x_scale);
    }
    for (; i < n; i++) { /* the last n % 8: each lane's arithmetic, one at a time */
        double out = (double)x[i] * x_scale;
        if (gamma) out *= (double)gamma[i];
        y[i] = (FASTLN_T)out;
    }
}

/* Forward of one row of n_cols elements: one read for the sum of squares, then y is written in
 * a second pass while the row is still in cache.
 *
 * y may be x itself (in place): each element is read before it is overwritten. gamma may be
 * NULL (ones). rstd_out receives the row's 1 / sqrt(mean(x * x) + eps). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_rms_norm_forward_row)(
    const FASTLN_T *x, const FASTLN_T *FASTLN_RESTRICT gamma, FASTLN_T *y, int64_t n_cols,
    double eps, double *rstd_out)
{
    const double rstd = FASTLN_NAME(fastln_rms_row_rstd)(x, n_cols, eps);
    *rstd_out = rstd;
    if (isinf(rstd)) {
        /* Beyond double's range (reported as Inf, its honest float64 value: the backward then
         * takes rstd again from x), or an all-zero row with eps = 0. Rare. */
        int exponent;
        const double rstd_scaled = FASTLN_NAME(fastln_rms_rescaled_rstd)(x, n_cols, eps,
                                                                         &exponent);
        if (!isinf(rstd_scaled)) {
            FASTLN_NAME(fastln_rms_write_row_rescaled)(x, gamma, y, n_cols, exponent,
                                                       rstd_scaled);
            return;
        }
    }
    /* rstd = Inf here only for an all-zero row with eps = 0 (fastln_rms_x_scale). */
    const double x_scale = fastln_rms_x_scale(rstd);
    /* The elements up to y's next cache line first, then whole-line stores
     * (fastln_elements_to_line); elementwise, so the same bits whatever the split. */
    const int64_t head = fastln_elements_to_line(y, sizeof(FASTLN_T), n_cols);
    FASTLN_NAME(fastln_rms_write_row)(x, gamma, y, head, x_scale);
    FASTLN_NAME(fastln_rms_write_row)(x + head, gamma ? gamma + head : NULL, y + head,
                                      n_cols - head, x_scale);
}

/* sum(dx_hat * x_hat) over FASTLN_BLOCK elements, dx_hat = dy * gamma, x_hat = x * x_scale,
 * all in double. The backward takes it through fastln_rms_backward_accumulate_* (rms_norm.h). */
FASTLN_INLINE void FASTLN_NAME(fastln_rms_backward_accumulate_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, double x_scale,
    fastln_d8 sum_dxhat_xhat[FASTLN_ACCUMULATORS])
{
    FASTLN_UNROLL_ACCUMULATORS
    for (int a = 0; a < FASTLN_ACCUMULATORS; a++) {
        fastln_d8 dx_hat = FASTLN_LOAD8(dy + 8 * a);
        if (gamma) dx_hat *= FASTLN_LOAD8(gamma + 8 * a);
        sum_dxhat_xhat[a] += dx_hat * (FASTLN_LOAD8(x + 8 * a) * x_scale);
    }
}

/* mean(dx_hat * x_hat) of a row, in the fixed order of the accumulators (the per-type
 * fastln_rms_backward_accumulate_*, rms_norm.h); x_hat = x * x_scale. */
FASTLN_INLINE double FASTLN_NAME(fastln_rms_backward_mean)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, double x_scale, int64_t n_cols)
{
    fastln_d8 sum_dxhat_xhat[FASTLN_ACCUMULATORS] = {{0}};
    int64_t i = 0;
    for (; i + FASTLN_BLOCK <= n_cols; i += FASTLN_BLOCK)
        FASTLN_NAME(fastln_rms_backward_accumulate)(dy + i, x + i, gamma ? gamma + i : NULL,
                                                    x_scale, sum_dxhat_xhat);
    if (i < n_cols) {
        /* Padding with dy = 0 and x = 0 adds exactly zero to the sum. */
        FASTLN_T dy_tail[FASTLN_BLOCK] = {0}, x_tail[FASTLN_BLOCK] = {0};
        FASTLN_T gamma_tail[FASTLN_BLOCK] = {0};
        const size_t rest = (size_t)(n_cols - i);
        memcpy(dy_tail, dy + i, rest * sizeof(FASTLN_T));
        memcpy(x_tail, x + i, rest * sizeof(FASTLN_T));
        if (gamma) memcpy(gamma_tail, gamma + i, rest * sizeof(FASTLN_T));
        FASTLN_NAME(fastln_rms_backward_accumulate)(dy_tail, x_tail, gamma ? gamma_tail : NULL,
                                                    x_scale, sum_dxhat_xhat);
    }
    return fastln_reduce(sum_dxhat_xhat) / (double)n_cols;
}

/* dx for eight elements of a row, returned, in double; their dy * x_hat is added to dgamma8. */
FASTLN_INLINE fastln_d8 FASTLN_NAME(fastln_rms_backward_dx8)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma,
    const fastln_rms_backward_row *row, fastln_d8 *dgamma8)
{
    const fastln_d8 dy8 = FASTLN_LOAD8(dy);
    const fastln_d8 x_hat = FASTLN_LOAD8(x) * row->x_scale;
    const fastln_d8 dx_hat = gamma ? dy8 * FASTLN_LOAD8(gamma) : dy8;
    *dgamma8 += dy8 * x_hat;
    return row->rstd * (dx_hat - x_hat * row->mean_dxhat_xhat);
}

/* The same for one element (those outside whole chunks of eight). dx may be dy. */
FASTLN_INLINE void FASTLN_NAME(fastln_rms_backward_dx1_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *dx,
    const fastln_rms_backward_row *row, double *dgamma)
{
    const double dy_i = (double)*dy;
    const double x_hat = (double)*x * row->x_scale;
    const double dx_hat = gamma ? dy_i * (double)*gamma : dy_i;
    *dgamma += dy_i * x_hat;
    *dx = (FASTLN_T)(row->rstd * (dx_hat - x_hat * row->mean_dxhat_xhat));
}

/* The backward's write pass, all in double, over width columns of n_rows consecutive rows
 * (stride elements apart; one row, or a group of them - fastln_rms_norm_backward_rows): each
 * eight dgamma accumulators are loaded and stored once, and the rows add to them in row order,
 * as row after row would. The per-type passes (fastln_rms_backward_write_rows_*, rms_norm.h)
 * call it for float64 rows and for float32 rows the float32 pass does not take. */
FASTLN_INLINE void FASTLN_NAME(fastln_rms_backward_write_rows_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_rms_backward_row *rows, double *dgamma_acc)
{
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
        fastln_d8 dgamma8 = fastln_load8_f64(dgamma_acc + i);
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t at = r * stride + i;
            FASTLN_STORE8(dx + at, FASTLN_NAME(fastln_rms_backward_dx8)(
                dy + at, x + at, gamma ? gamma + i : NULL, &rows[r], &dgamma8));
        }
        fastln_store8_f64(dgamma_acc + i, dgamma8);
    }
    for (; i < width; i++) /* the last width % 8: each lane's arithmetic, one at a time */
        for (int64_t r = 0; r < n_rows; r++)
            FASTLN_NAME(fastln_rms_backward_dx1_double)(
                dy + r * stride + i, x + r * stride + i, gamma ? gamma + i : NULL,
                dx + r * stride + i, &rows[r], dgamma_acc + i);
}

/* The backward's write pass over n_rows consecutive rows (one, or a group): the columns up to
 * dx's next cache line first, then whole-line stores (fastln_elements_to_line). The rows of a
 * group all start at the same offset from a line only when a row is a whole number of lines;
 * otherwise the group is stored as it comes. Elementwise: the same bits whatever the split. */
FASTLN_INLINE void FASTLN_NAME(fastln_rms_backward_write)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t n_cols, const fastln_rms_backward_row *rows, double *dgamma_acc)
{
    const int64_t head = n_rows == 1 || n_cols * (int64_t)sizeof(FASTLN_T) % 64 == 0
                             ? fastln_elements_to_line(dx, sizeof(FASTLN_T), n_cols) : 0;
    if (head > 0)
        FASTLN_NAME(fastln_rms_backward_write_rows)(dy, x, gamma, dx, n_rows, n_cols, head, rows,
                                                    dgamma_acc);
    FASTLN_NAME(fastln_rms_backward_write_rows)(dy + head, x + head, gamma ? gamma + head : NULL,
                                                dx + head, n_rows, n_cols, n_cols - head, rows,
                                                dgamma_acc + head);
}

/* Backward of a row whose cached rstd is Inf but whose values are not all zero: its rstd is beyond
 * the cache's range (float32 values below ~1e-38, float64 ones below ~1e-308 with eps = 0), so
 * it is taken again from x, all in double, every scaling an exact power of two, in plain loops
 * in a fixed order:
 *     x_hat = ldexp(x, e) * rstd_scaled,   g = ldexp(dx_hat, -k), 2^k just above max |dx_hat|
 *     dx = ldexp(rstd_scaled * (g - x_hat * mean(g * x_hat)), e + k)
 * Returns 0 (and does nothing) for an all-zero row. dx may be dy. */
static int FASTLN_NAME(fastln_rms_backward_row_recomputed)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, double eps, FASTLN_T *dx,
    int64_t n_cols, double *dgamma_acc)
{
    double rstd_scaled = FASTLN_NAME(fastln_rms_row_rstd)(x, n_cols, eps);
    int exponent = 0;
    if (isinf(rstd_scaled))
        rstd_scaled = FASTLN_NAME(fastln_rms_rescaled_rstd)(x, n_cols, eps, &exponent);
    if (isinf(rstd_scaled)) return 0; /* all zeros with eps = 0 */
    double largest = 0.0;
    for (int64_t i = 0; i < n_cols; i++) {
        const double dx_hat = gamma ? (double)dy[i] * (double)gamma[i] : (double)dy[i];
        if (isfinite(dx_hat)) largest = fmax(largest, fabs(dx_hat));
    }
    int k = 0;
    if (largest > 0.0) frexp(largest, &k);
    double sum_g_xhat = 0.0;
    for (int64_t i = 0; i < n_cols; i++) {
        const double dx_hat = gamma ? (double)dy[i] * (double)gamma[i] : (double)dy[i];
        sum_g_xhat += ldexp(dx_hat, -k) * (ldexp((double)x[i], exponent) * rstd_scaled);
    }
    const double mean_g_xhat = sum_g_xhat / (double)n_cols;
    for (int64_t i = 0; i < n_cols; i++) {
        const double dy_i = (double)dy[i];
        const double x_hat = ldexp((double)x[i], exponent) * rstd_scaled;
        const double g = ldexp(gamma ? dy_i * (double)gamma[i] : dy_i, -k);
        dgamma_acc[i] += dy_i * x_hat;
        dx[i] = (FASTLN_T)ldexp(rstd_scaled * (g - x_hat * mean_g_xhat), exponent + k);
    }
    return 1;
}

/* Backward of one row. With x_hat = x * rstd and dx_hat = dy * gamma,
 *     dx = rstd * (dx_hat - x_hat * mean(dx_hat * x_hat))
 * (the LayerNorm identity without the mean terms). x_hat is formed before any product, so
 * rows of huge or tiny magnitude neither overflow nor underflow.
 *
 * dgamma_acc (double, n_cols) is added to: dgamma += dy * x_hat. dx may be dy itself (in
 * place). gamma may be NULL (ones). eps is the forward's. An all-zero row with eps = 0
 * (rstd = Inf) has x_hat = 0, as in the forward; its dx is then Inf * dx_hat: the gradient of
 * x / |x| at 0 does not exist. Any other row with an Inf rstd has an rstd beyond the cache's
 * range and is done from x (fastln_rms_backward_row_recomputed). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_rms_norm_backward_row)(
    const FASTLN_T *dy, const FASTLN_T *FASTLN_RESTRICT x, const FASTLN_T *FASTLN_RESTRICT gamma,
    double rstd, double eps, FASTLN_T *dx, int64_t n_cols, double *FASTLN_RESTRICT dgamma_acc)
{
    if (isinf(rstd)
        && FASTLN_NAME(fastln_rms_backward_row_recomputed)(dy, x, gamma, eps, dx, n_cols,
                                                           dgamma_acc))
        return;
    fastln_rms_backward_row row;
    row.rstd = rstd;
    row.x_scale = fastln_rms_x_scale(rstd);
    row.mean_dxhat_xhat = FASTLN_NAME(fastln_rms_backward_mean)(dy, x, gamma, row.x_scale, n_cols);
    FASTLN_NAME(fastln_rms_backward_write)(dy, x, gamma, dx, 1, n_cols, &row, dgamma_acc);
}

/* Backward of n_rows <= FASTLN_RMS_BACKWARD_GROUP consecutive rows (rstd: their cache entries):
 * each row's mean(dx_hat * x_hat), then one write pass over the group's columns that loads and
 * stores each dgamma accumulator once per group instead of once per row. Each element's
 * arithmetic, and the order in which the rows add to an accumulator, are those of the
 * single-row backward (fastln_rms_norm_backward_row) row after row: the same bits. A group
 * with a row of Inf rstd (done from x again) or one the float32 pass does not take goes row by
 * row. dx may be dy (in place). */
FASTLN_DISPATCH
static void FASTLN_NAME(fastln_rms_norm_backward_rows)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_T *gamma, const FASTLN_T *rstd,
    double eps, FASTLN_T *dx, int64_t n_rows, int64_t n_cols, double *dgamma_acc)
{
    fastln_rms_backward_row rows[FASTLN_RMS_BACKWARD_GROUP];
    int grouped = n_rows <= FASTLN_RMS_BACKWARD_GROUP;
    for (int64_t r = 0; grouped && r < n_rows; r++) {
        rows[r].rstd = (double)rstd[r];
        rows[r].x_scale = fastln_rms_x_scale(rows[r].rstd);
        grouped = !isinf(rows[r].rstd) && FASTLN_NAME(fastln_rms_backward_in_vectors)(&rows[r]);
    }
    if (!grouped) {
        for (int64_t r = 0; r < n_rows; r++)
            FASTLN_NAME(fastln_rms_norm_backward_row)(dy + r * n_cols, x + r * n_cols, gamma,
                                                      (double)rstd[r], eps, dx + r * n_cols,
                                                      n_cols, dgamma_acc);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++)
        rows[r].mean_dxhat_xhat = FASTLN_NAME(fastln_rms_backward_mean)(
            dy + r * n_cols, x + r * n_cols, gamma, rows[r].x_scale, n_cols);
    FASTLN_NAME(fastln_rms_backward_write)(dy, x, gamma, dx, n_rows, n_cols, rows, dgamma_acc);
}
