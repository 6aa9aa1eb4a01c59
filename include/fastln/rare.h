/* The rows (and BatchNorm features) the vector passes cannot take, for one storage type
 * (fastln/storage.h): values whose squares or products leave double's range, rstds beyond the
 * cache's range, constant rows with eps = 0. Plain loops in a fixed order, every scaling an
 * exact power of two (ldexp), called from the hot kernels' exits for a handful of rows at most.
 * No include guard on purpose.
 *
 * The backward's dgamma/dbeta accumulators are FASTLN_P: float for the float32-compute types
 * (folded into double partial sums by the caller), double for float64. */

/* ---- LayerNorm -------------------------------------------------------------------------- */

/* y = gamma * x_hat + beta for a row of the rare paths (fastln_ln_stats' rare: an rstd or a
 * deviation beyond double's range), with x_hat = fastln_ln_rare_x_hat: each deviation brought to
 * about 1 first. In place is fine. */
static void FASTLN_NAME(ln_write_rescaled)(const FASTLN_T *x, const FASTLN_P *gamma,
                                           const FASTLN_P *beta, FASTLN_T *y, int64_t n_cols,
                                           const fastln_ln_stats *stats)
{
    for (int64_t j = 0; j < n_cols; j++) {
        double value = fastln_ln_rare_x_hat(FASTLN_NAME(to_double)(x[j]), stats);
        if (gamma) value *= (double)gamma[j];
        if (beta) value += (double)beta[j];
        y[j] = FASTLN_NAME(from_double)(value);
    }
}

FASTLN_INLINE double FASTLN_NAME(dx_hat)(const FASTLN_T *dy, const FASTLN_P *gamma, int64_t j)
{
    const double dy_j = FASTLN_NAME(to_double)(dy[j]);
    return gamma ? dy_j * (double)gamma[j] : dy_j;
}

/* The powers of two of a rare row's dx_hat = dy * gamma (fastln_dx_hat_scale): dx_hat_scaled
 * is dx_hat * 2^-(dy + gamma), below 1, formed without dy * gamma itself, which may be beyond
 * double (float64 dy near DBL_MAX times gamma > 1). */
static fastln_dx_hat_scale FASTLN_NAME(dx_hat_scale)(const FASTLN_T *dy, const FASTLN_P *gamma,
                                                     int64_t n_cols)
{
    double largest_dy = 0.0, largest_gamma = 0.0;
    for (int64_t j = 0; j < n_cols; j++) {
        const double dy_j = fabs(FASTLN_NAME(to_double)(dy[j]));
        if (dy_j <= DBL_MAX) largest_dy = fmax(largest_dy, dy_j);
        if (gamma && fabs((double)gamma[j]) <= DBL_MAX)
            largest_gamma = fmax(largest_gamma, fabs((double)gamma[j]));
    }
    fastln_dx_hat_scale scale = {0, 0};
    if (largest_dy > 0.0) frexp(largest_dy, &scale.dy);
    if (largest_gamma > 0.0) frexp(largest_gamma, &scale.gamma);
    return scale;
}

FASTLN_INLINE double FASTLN_NAME(dx_hat_scaled)(const FASTLN_T *dy, const FASTLN_P *gamma,
                                                int64_t j, fastln_dx_hat_scale scale)
{
    const double dy_j = ldexp(FASTLN_NAME(to_double)(dy[j]), -scale.dy);
    return gamma ? dy_j * ldexp((double)gamma[j], -scale.gamma) : dy_j;
}

/* Whether every dy, x and gamma of a row is finite. */
static int FASTLN_NAME(row_is_finite)(const FASTLN_T *dy, const FASTLN_T *x,
                                      const FASTLN_P *gamma, int64_t n_cols)
{
    int finite = 1;
    for (int64_t j = 0; j < n_cols; j++)
        finite &= isfinite(FASTLN_NAME(to_double)(dy[j])) && isfinite(FASTLN_NAME(to_double)(x[j]))
                  && (!gamma || isfinite((double)gamma[j]));
    return finite;
}

/* Backward of a row from its statistics taken again from x (ln_statistics), all in double:
 *     x_hat = fastln_ln_rare_x_hat(x)                                        (|x_hat| <= sqrt(n))
 *     g = dx_hat * 2^-k, 2^k = 2^a 2^b just above max |dy| max |gamma|    (|g| < 1)
 *     dx = ldexp(rstd_scaled * ((g - mean(g)) - x_hat * mean(g * x_hat)), exponent + k)
 * so no product leaves double's range unless dx itself does. For the rows the vector passes
 * cannot take: an rstd beyond the cache's range (Inf: float32 subnormal spreads, float64 ones
 * with eps = 0), dy * (x - mean) beyond double's (|x| and |dy| near 1e300, or both tiny), or
 * x - mean itself beyond double. dx may be dy. */
static void FASTLN_NAME(ln_backward_row_recomputed)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_cols,
    double eps, FASTLN_P *dgamma_acc, FASTLN_P *dbeta_acc)
{
    fastln_ln_stats stats;
    FASTLN_NAME(ln_statistics)(x, n_cols, eps, &stats);
    const fastln_dx_hat_scale scale = FASTLN_NAME(dx_hat_scale)(dy, gamma, n_cols);
    const int k = scale.dy + scale.gamma;
    double sum_g = 0.0, sum_g_xhat = 0.0;
    for (int64_t j = 0; j < n_cols; j++) {
        const double x_hat = fastln_ln_rare_x_hat(FASTLN_NAME(to_double)(x[j]), &stats);
        const double g = FASTLN_NAME(dx_hat_scaled)(dy, gamma, j, scale);
        sum_g += g;
        sum_g_xhat += g * x_hat;
    }
    const double mean_g = sum_g / (double)n_cols;
    const double mean_g_xhat = sum_g_xhat / (double)n_cols;
    for (int64_t j = 0; j < n_cols; j++) {
        const double x_hat = fastln_ln_rare_x_hat(FASTLN_NAME(to_double)(x[j]), &stats);
        const double dy_j = FASTLN_NAME(to_double)(dy[j]);
        const double g = FASTLN_NAME(dx_hat_scaled)(dy, gamma, j, scale);
        dgamma_acc[j] += (FASTLN_P)(dy_j * x_hat);
        dbeta_acc[j] += (FASTLN_P)dy_j;
        dx[j] = FASTLN_NAME(from_double)(
            ldexp(stats.rstd_scaled * ((g - mean_g) - x_hat * mean_g_xhat), stats.exponent + k));
    }
}

/* The rows whose first pass did not give a finite sum(dx_hat * x_hat): returns 0 when the vector
 * write pass should still do the row (a NaN or Inf in it: their NaN keeps flowing as it always
 * has), 1 when the row is done here. */
static int FASTLN_NAME(ln_backward_row_rare)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_cols,
    double rstd, double eps, FASTLN_P *dgamma_acc, FASTLN_P *dbeta_acc)
{
    if (isnan(rstd)) return 0;
    const FASTLN_C first = FASTLN_NAME(to_compute)(x[0]);
    int constant = 1, finite = 1;
    for (int64_t j = 0; j < n_cols; j++) {
        constant &= FASTLN_NAME(to_compute)(x[j]) == first;
        finite &= isfinite(FASTLN_NAME(to_double)(dy[j])) && isfinite(FASTLN_NAME(to_double)(x[j]))
                  && (!gamma || isfinite((double)gamma[j]));
    }
    if (isinf(rstd) && constant) {
        /* A constant row with eps = 0 (or with an eps so small that 1 / sqrt(eps) is beyond a
         * float32 cache): the forward wrote beta (x_hat = 0), so dgamma gets nothing from it and
         * dx = rstd * (dx_hat - mean(dx_hat)) with the row's true rstd, 1 / sqrt(eps): infinite
         * or NaN with eps = 0, 0 where dy is constant. mean(dx_hat) is taken here from the
         * same double dx_hat as each term (the first pass's may be float32 runs): a row of one
         * value gives 0 * rstd (NaN with eps = 0, as in the reference), not a rounding
         * difference times Inf. */
        const double n = (double)n_cols;
        const double row_rstd = 1.0 / sqrt(eps);
        double total_dxhat = 0.0;
        for (int64_t j = 0; j < n_cols; j++) total_dxhat += FASTLN_NAME(dx_hat)(dy, gamma, j);
        for (int64_t j = 0; j < n_cols; j++) {
            const double dy_j = FASTLN_NAME(to_double)(dy[j]);
            dgamma_acc[j] += (FASTLN_P)(dy_j * 0.0); /* x_hat = 0; NaN in dy stays NaN */
            dbeta_acc[j] += (FASTLN_P)dy_j;
            dx[j] = FASTLN_NAME(from_double)(row_rstd
                                             * (FASTLN_NAME(dx_hat)(dy, gamma, j) - total_dxhat / n));
        }
        return 1;
    }
    /* An Inf rstd of a row that is not constant is the cache's way of saying "beyond my range":
     * the row is done from x, whatever dy holds. With a finite rstd only overflow brings a row
     * here when its values are all finite. */
    if (!isinf(rstd) && !finite) return 0;
    FASTLN_NAME(ln_backward_row_recomputed)(dy, x, gamma, dx, n_cols, eps, dgamma_acc, dbeta_acc);
    return 1;
}

#if !FASTLN_COMPUTE_F32
/* Whether every element is zero (padding rows of dy take this test). */
FASTLN_INLINE int FASTLN_NAME(all_zero)(const FASTLN_T *v, int64_t n)
{
    int any = 0;
    for (int64_t j = 0; j < n; j++) any |= v[j] != 0.0;
    return !any;
}

/* Whether a float64 row's products dx_hat * (x - mean) may have fallen below double's normal
 * range, taking their digits with them: |dy| and |x - mean| both tiny (say 1e-310 and 1e-150,
 * whose squares are fine). A product below DBL_MIN is off by up to DBL_MIN * 2^-53; n of them
 * stay below 2^-53 of the row's largest product when that is n * DBL_MIN or more. (float32
 * products, formed in double, cannot underflow.) */
static int FASTLN_NAME(ln_backward_products_underflow)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, double mean, int64_t n_cols)
{
    double largest_dxhat = 0.0, largest_d = 0.0;
    for (int64_t j = 0; j < n_cols; j++) {
        largest_dxhat = fmax(largest_dxhat, fabs(FASTLN_NAME(dx_hat)(dy, gamma, j)));
        largest_d = fmax(largest_d, fabs(x[j] - mean));
    }
    return largest_dxhat > 0.0 && largest_d > 0.0
           && largest_dxhat * largest_d < (double)n_cols * DBL_MIN;
}
#endif

/* ---- RMSNorm ---------------------------------------------------------------------------- */

/* y = gamma * (ldexp(x, exponent) * rstd_scaled) for a row whose rstd is beyond double's range
 * (eps = 0 and values below ~1e-308): each value is brought to about 1 first. In place is
 * fine. */
static void FASTLN_NAME(rms_write_rescaled)(const FASTLN_T *x, const FASTLN_P *gamma,
                                            FASTLN_T *y, int64_t n_cols, int exponent,
                                            double rstd_scaled)
{
    for (int64_t i = 0; i < n_cols; i++) {
        double value = ldexp(FASTLN_NAME(to_double)(x[i]), exponent) * rstd_scaled;
        if (gamma) value *= (double)gamma[i];
        y[i] = FASTLN_NAME(from_double)(value);
    }
}

/* Backward of a row whose cached rstd is Inf but whose values are not all zero: its rstd is
 * beyond the cache's range (float32 values below ~1e-38, float64 ones below ~1e-308 with
 * eps = 0), so it is taken again from x, all in double:
 *     x_hat = ldexp(x, e) * rstd_scaled,   g = dx_hat * 2^-k, 2^k above max |dy| max |gamma|
 *     dx = ldexp(rstd_scaled * (g - x_hat * mean(g * x_hat)), e + k)
 * Also for the rows whose mean(dx_hat * x_hat) was beyond double (float64 dy near DBL_MAX, or
 * a float32 dy * gamma beyond float). Returns 0 (and does nothing) for an all-zero row. dx may
 * be dy. */
static int FASTLN_NAME(rms_backward_row_recomputed)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, double eps, FASTLN_T *dx,
    int64_t n_cols, double *dgamma_acc)
{
    double rstd_scaled = FASTLN_NAME(rms_row_rstd)(x, n_cols, eps);
    int exponent = 0;
    if (isinf(rstd_scaled))
        rstd_scaled = FASTLN_NAME(rms_rescaled_rstd)(x, n_cols, eps, &exponent);
    if (isinf(rstd_scaled)) return 0; /* all zeros with eps = 0 */
    const fastln_dx_hat_scale scale = FASTLN_NAME(dx_hat_scale)(dy, gamma, n_cols);
    const int k = scale.dy + scale.gamma;
    double sum_g_xhat = 0.0;
    for (int64_t i = 0; i < n_cols; i++)
        sum_g_xhat += FASTLN_NAME(dx_hat_scaled)(dy, gamma, i, scale)
                      * (ldexp(FASTLN_NAME(to_double)(x[i]), exponent) * rstd_scaled);
    const double mean_g_xhat = sum_g_xhat / (double)n_cols;
    for (int64_t i = 0; i < n_cols; i++) {
        const double dy_i = FASTLN_NAME(to_double)(dy[i]);
        const double x_hat = ldexp(FASTLN_NAME(to_double)(x[i]), exponent) * rstd_scaled;
        const double g = FASTLN_NAME(dx_hat_scaled)(dy, gamma, i, scale);
        dgamma_acc[i] += dy_i * x_hat;
        dx[i] = FASTLN_NAME(from_double)(ldexp(rstd_scaled * (g - x_hat * mean_g_xhat),
                                               exponent + k));
    }
    return 1;
}

/* ---- BatchNorm: features whose statistics leave double's range --------------------------
 *
 * Plain loops over one feature's values in memory order (segments of n_inner values,
 * n_features * n_inner apart, from x + feature * n_inner). */

FASTLN_INLINE double FASTLN_NAME(bn_value)(const FASTLN_T *column, int64_t n_features,
                                           int64_t n_inner, int64_t k, int64_t l)
{
    return FASTLN_NAME(to_double)(column[k * n_features * n_inner + l]);
}

/* The mean of a feature whose shifted sum overflowed (values near double's largest), from its
 * values scaled so that the largest is below 1, still shifted by `shift`. Not finite when the
 * feature holds an Inf. */
static double FASTLN_NAME(bn_rescaled_mean)(const FASTLN_T *x, int64_t n_outer,
                                            int64_t n_features, int64_t n_inner, int64_t feature,
                                            double shift)
{
    const FASTLN_T *column = x + feature * n_inner;
    double largest = 0.0;
    for (int64_t k = 0; k < n_outer; k++)
        for (int64_t l = 0; l < n_inner; l++)
            largest = fmax(largest, fabs(FASTLN_NAME(bn_value)(column, n_features, n_inner, k, l)));
    if (isinf(largest)) return largest;
    int exponent;
    frexp(largest, &exponent);
    const double shift_scaled = ldexp(shift, -exponent);
    double sum = 0.0;
    for (int64_t k = 0; k < n_outer; k++)
        for (int64_t l = 0; l < n_inner; l++)
            sum += ldexp(FASTLN_NAME(bn_value)(column, n_features, n_inner, k, l), -exponent)
                   - shift_scaled;
    return ldexp(shift_scaled + sum / (double)(n_outer * n_inner), exponent);
}

/* The deviations d = x - mean of a feature, scaled by the power of two 2^exponent that brings
 * the largest into [0.5, 1): d_scaled = ldexp(fastln_bn_deviation(x, mean, prescale),
 * exponent - prescale). Gives their mean `center` (small: the rounding of `mean`) and their
 * variance about it; *prescale_out is -2 when x - mean itself passes DBL_MAX (values of both
 * signs near it), else 0. Returns 0, and leaves the outputs alone, when there is nothing to
 * rescale: a constant feature, or an Inf in it. Callers never pass a feature holding NaN. */
static int FASTLN_NAME(bn_rescaled_moments)(const FASTLN_T *x, int64_t n_outer,
                                            int64_t n_features, int64_t n_inner,
                                            int64_t feature, double mean, int *exponent_out,
                                            int *prescale_out, double *center_out,
                                            double *var_out)
{
    const FASTLN_T *column = x + feature * n_inner;
    double largest = 0.0;
    int prescale = 0;
    for (int pass = 0; pass < 2; pass++, prescale = -2) {
        largest = 0.0;
        for (int64_t k = 0; k < n_outer; k++)
            for (int64_t l = 0; l < n_inner; l++)
                largest = fmax(largest, fabs(fastln_bn_deviation(
                    FASTLN_NAME(bn_value)(column, n_features, n_inner, k, l), mean, prescale)));
        if (!isinf(largest)) break;
    }
    if (!(largest > 0.0) || isinf(largest)) return 0;
    int e;
    frexp(largest, &e);
    double sum = 0.0, sumsq = 0.0;
    for (int64_t k = 0; k < n_outer; k++)
        for (int64_t l = 0; l < n_inner; l++) {
            const double d = ldexp(fastln_bn_deviation(
                FASTLN_NAME(bn_value)(column, n_features, n_inner, k, l), mean, prescale), -e);
            sum += d;
            sumsq += d * d;
        }
    const double count = (double)(n_outer * n_inner);
    const double center = sum / count;
    const double var = sumsq / count - center * center;
    *exponent_out = prescale - e;
    *prescale_out = prescale;
    *center_out = center;
    *var_out = var < 0.0 ? 0.0 : var;
    return 1;
}

/* Training forward, after fastln_bn_train_constants: the features whose statistics left
 * double's range there - squares or sums that overflowed (NaN or Inf variance, finite or
 * infinite mean: |x| beyond ~1e154), or a variance below FASTLN_BN_TINY with eps below it too
 * (squares that underflowed) - are taken again on rescaled deviations, and their statistics and
 * write-pass constants replaced. Features holding NaN or Inf stay as they are (their rescaled
 * mean is not finite).
 *
 * var and rstd get the true values rounded to double, out of range included: var is inf for
 * spreads beyond ~1e154 and 0 below ~1e-162, rstd inf for spreads below ~5e-309 with eps = 0.
 * When the write pass's scale rstd * gamma is out of range itself, the feature gets constants
 * that copy it into y unchanged, and its index goes to c->finish: bn_finish_rescaled normalizes
 * it there after the write pass. Sets *c->n_finish. */
static void FASTLN_NAME(bn_rescale_train)(const FASTLN_T *x, const fastln_bn_call *c)
{
    *c->n_finish = 0;
    if (!fastln_bn_train_any_rare(c->n_features, c->eps, c->center, c->var)) return;
    for (int64_t f = 0; f < c->n_features; f++) {
        /* center is NaN also when two slots' shifted sums overflowed to both infinities;
         * bn_rescaled_mean below tells that from a NaN or Inf in x */
        const int overflowed = !isfinite(c->center[f]) || !isfinite(c->var[f]);
        const int underflowed = c->var[f] < FASTLN_BN_TINY && c->eps < FASTLN_BN_TINY;
        if (!overflowed && !underflowed) continue;
        /* center is the shifted mean: not finite when the shifted sum itself overflowed */
        const double feature_mean = isfinite(c->center[f])
            ? c->mean[f]
            : FASTLN_NAME(bn_rescaled_mean)(x, c->n_outer, c->n_features, c->n_inner, f,
                                            c->shift[f]);
        int exponent, prescale;
        double center_scaled, var_scaled;
        if (!isfinite(feature_mean)
            || !FASTLN_NAME(bn_rescaled_moments)(x, c->n_outer, c->n_features, c->n_inner, f,
                                                 feature_mean, &exponent, &prescale,
                                                 &center_scaled, &var_scaled))
            continue;
        const double rstd_scaled = fastln_bn_scaled_rstd(var_scaled, c->eps, exponent);
        const double scale_scaled = c->gamma ? rstd_scaled * c->gamma[f] : rstd_scaled;
        c->mean[f] = feature_mean;
        c->var[f] = ldexp(var_scaled, -2 * exponent);
        c->rstd[f] = ldexp(rstd_scaled, exponent);
        /* The write pass takes the feature unless its constants leave double's range, or its
         * deviations do (then x - shift would overflow there). */
        if (prescale == 0 && fastln_bn_in_range(scale_scaled, exponent)) {
            c->shift[f] = feature_mean;
            c->center[f] = ldexp(center_scaled, -exponent);
            c->scale[f] = ldexp(scale_scaled, exponent);
        } else { /* ((x - 0) - 0) * 1 + (-0) is x, -0 included */
            c->shift[f] = 0.0;
            c->center[f] = 0.0;
            c->scale[f] = 1.0;
            c->offset[f] = -0.0;
            c->finish[(*c->n_finish)++] = f;
        }
    }
}

/* Normalizes in y the features that bn_rescale_train passed on (y holds their values, copied
 * there by the write pass), from the same rescaled moments:
 *     y = (d_scaled - center_scaled) * rstd_scaled * gamma + beta,  d_scaled = (x - mean) 2^e. */
static void FASTLN_NAME(bn_finish_rescaled)(FASTLN_T *y, const fastln_bn_call *c)
{
    const int64_t stride = c->n_features * c->n_inner;
    for (int64_t i = 0; i < *c->n_finish; i++) {
        const int64_t f = c->finish[i];
        const double mean = c->mean[f];
        int exponent, prescale;
        double center_scaled, var_scaled;
        if (!FASTLN_NAME(bn_rescaled_moments)(y, c->n_outer, c->n_features, c->n_inner, f, mean,
                                              &exponent, &prescale, &center_scaled, &var_scaled))
            continue; /* not reached: these are the values the forward rescaled */
        const double rstd_scaled = fastln_bn_scaled_rstd(var_scaled, c->eps, exponent);
        const double scale = c->gamma ? rstd_scaled * c->gamma[f] : rstd_scaled;
        const double offset = c->beta ? c->beta[f] : 0.0;
        FASTLN_T *column = y + f * c->n_inner;
        for (int64_t k = 0; k < c->n_outer; k++)
            for (int64_t l = 0; l < c->n_inner; l++) {
                FASTLN_T *value = column + k * stride + l;
                const double d = fastln_bn_scaled_deviation(FASTLN_NAME(to_double)(*value), mean,
                                                            exponent, prescale);
                *value = FASTLN_NAME(from_double)((d - center_scaled) * scale + offset);
            }
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
 * c->finish for bn_finish_rescaled_backward. Sets *c->n_finish. */
/* The power of two 2^j just above max |dy| over a feature's finite values (j = 0 for zeros);
 * *finite_out: whether they all are finite. For the features whose sums of dy (or dy * d)
 * overflowed although each dy is finite (float64 dy near DBL_MAX): their sums are taken on
 * dy * 2^-j. */
static int FASTLN_NAME(bn_dy_exponent)(const FASTLN_T *dy, const fastln_bn_call *c, int64_t f,
                                       int *finite_out)
{
    const FASTLN_T *column = dy + f * c->n_inner;
    double largest = 0.0;
    int finite = 1;
    for (int64_t k = 0; k < c->n_outer; k++)
        for (int64_t l = 0; l < c->n_inner; l++) {
            const double value = fabs(FASTLN_NAME(bn_value)(column, c->n_features, c->n_inner,
                                                            k, l));
            finite &= value <= DBL_MAX;
            if (value <= DBL_MAX) largest = fmax(largest, value);
        }
    int j = 0;
    if (largest > 0.0) frexp(largest, &j);
    if (finite_out) *finite_out = finite;
    return j;
}

static void FASTLN_NAME(bn_rescale_backward)(const FASTLN_T *dy, const FASTLN_T *x,
                                             const fastln_bn_call *c)
{
    const double count = (double)(c->n_outer * c->n_inner);
    const int64_t stride = c->n_features * c->n_inner;
    *c->n_finish = 0;
    if (!fastln_bn_backward_any_rare(c->n_features, c->rstd, c->sum_dy, c->sum_dy_d, c->sum_d,
                                     c->dgamma, c->coef))
        return;
    for (int64_t f = 0; f < c->n_features; f++) {
        const double rstd = c->rstd[f];
        const int out_of_range = rstd > FASTLN_BN_RSTD_HUGE || rstd < DBL_MIN;
        /* a sum of dy * d that overflowed (huge x and huge dy), or of d itself (x - mean beyond
         * double: values of both signs near DBL_MAX; an Inf in x, which the moments refuse) */
        const int overflowed =
            (!isfinite(c->sum_dy_d[f]) && isfinite(c->sum_dy[f]) && isfinite(c->sum_d[f]))
            || (!isfinite(c->sum_d[f]) && isfinite(c->mean[f]));
        /* a sum of dy or dy * d, dgamma or coef = rstd * dgamma / count beyond double from
         * finite dy (float64 dy near DBL_MAX): taken on dy * 2^-j below, and dx in
         * bn_finish_rescaled_backward (an infinite coef made dx an infinity of either sign) */
        int scale_dy = 0, j = 0;
        if (!isfinite(c->sum_dy[f]) || !isfinite(c->sum_dy_d[f]) || !isfinite(c->dgamma[f])
            || !isfinite(c->coef[f]))
            j = FASTLN_NAME(bn_dy_exponent)(dy, c, f, &scale_dy);
        if (!scale_dy) j = 0; /* NaN or Inf in dy: its NaN flows as it always has */
        if (!out_of_range && !overflowed && !scale_dy) continue;
        int exponent, prescale;
        double center_scaled, var_scaled;
        if (!FASTLN_NAME(bn_rescaled_moments)(x, c->n_outer, c->n_features, c->n_inner, f,
                                              c->mean[f], &exponent, &prescale, &center_scaled,
                                              &var_scaled))
            continue; /* constant (x_hat = 0, as fastln_bn_backward_constants has it), or beyond */
        const double rstd_scaled = fastln_bn_backward_scaled_rstd(rstd, var_scaled, c->eps,
                                                                  exponent);
        const FASTLN_T *dy_column = dy + f * c->n_inner;
        const FASTLN_T *x_column = x + f * c->n_inner;
        double sum_dy_d_scaled = 0.0, sum_dy_scaled = 0.0; /* of dy * 2^-j */
        for (int64_t k = 0; k < c->n_outer; k++)
            for (int64_t l = 0; l < c->n_inner; l++) {
                const int64_t at = k * stride + l;
                const double g = ldexp(FASTLN_NAME(to_double)(dy_column[at]), -j);
                sum_dy_scaled += g;
                sum_dy_d_scaled += g * fastln_bn_scaled_deviation(
                                           FASTLN_NAME(to_double)(x_column[at]), c->mean[f],
                                           exponent, prescale);
            }
        /* dgamma * 2^-j; without scale_dy from the slot-order sum of dy, as before */
        const double dgamma_scaled = rstd_scaled * (
            sum_dy_d_scaled - center_scaled * (scale_dy ? sum_dy_scaled : c->sum_dy[f]));
        const double k_scaled = c->gamma ? c->gamma[f] * rstd_scaled : rstd_scaled;
        const double coef_scaled = rstd_scaled * dgamma_scaled / count;
        c->dgamma[f] = ldexp(dgamma_scaled, j);
        if (scale_dy) {
            c->sum_dy_d[f] = NAN; /* tells bn_finish_rescaled_backward (not used after) */
            /* dbeta: a partial sum of [1e308, 1e308, -1e308] overflowed, the sum does not */
            if (!isfinite(c->sum_dy[f])) c->sum_dy[f] = ldexp(sum_dy_scaled, j);
        }
        if (!scale_dy && prescale == 0 && fastln_bn_in_range(k_scaled, exponent)
            && fastln_bn_in_range(coef_scaled, exponent)) {
            c->correction[f] = ldexp(center_scaled, -exponent);
            c->k[f] = ldexp(k_scaled, exponent);
            c->coef[f] = ldexp(coef_scaled, exponent);
        } else { /* 1 * ((dy - 0) - ((x - 0) - 0) * 0) is dy: x - 0 cannot overflow */
            c->dx_mean[f] = 0.0;
            c->correction[f] = 0.0;
            c->k[f] = 1.0;
            c->mean_dy[f] = 0.0;
            c->coef[f] = 0.0;
            c->finish[(*c->n_finish)++] = f;
        }
    }
}

/* dx of the features that bn_rescale_backward passed on (dx holds their dy, copied there by the
 * dx pass), with the same rescaled constants:
 *     dx = 2^e * k_scaled * ((dy - mean_dy) - (d_scaled - center_scaled) * coef_scaled). */
static void FASTLN_NAME(bn_finish_rescaled_backward)(FASTLN_T *dx, const FASTLN_T *x,
                                                     const fastln_bn_call *c)
{
    const double count = (double)(c->n_outer * c->n_inner);
    const int64_t stride = c->n_features * c->n_inner;
    for (int64_t i = 0; i < *c->n_finish; i++) {
        const int64_t f = c->finish[i];
        const double mean = c->mean[f];
        int exponent, prescale;
        double center_scaled, var_scaled;
        if (!FASTLN_NAME(bn_rescaled_moments)(x, c->n_outer, c->n_features, c->n_inner, f, mean,
                                              &exponent, &prescale, &center_scaled, &var_scaled))
            continue; /* not reached: bn_rescale_backward took these moments */
        const double rstd_scaled = fastln_bn_backward_scaled_rstd(c->rstd[f], var_scaled, c->eps,
                                                                  exponent);
        const double k_scaled = c->gamma ? c->gamma[f] * rstd_scaled : rstd_scaled;
        FASTLN_T *dx_column = dx + f * c->n_inner;
        const FASTLN_T *x_column = x + f * c->n_inner;
        /* dy * 2^-j for the features whose sums of dy overflowed (bn_rescale_backward): their
         * sums taken again here, on dx's copy of dy */
        const int scale_dy = isnan(c->sum_dy_d[f]);
        const int j = scale_dy ? FASTLN_NAME(bn_dy_exponent)(dx, c, f, NULL) : 0;
        double coef_scaled = rstd_scaled * c->dgamma[f] / count;
        double mean_dy = c->sum_dy[f] / count;
        if (scale_dy) {
            double sum_dy_scaled = 0.0, sum_dy_d_scaled = 0.0;
            for (int64_t k = 0; k < c->n_outer; k++)
                for (int64_t l = 0; l < c->n_inner; l++) {
                    const int64_t at = k * stride + l;
                    const double g = ldexp(FASTLN_NAME(to_double)(dx_column[at]), -j);
                    sum_dy_scaled += g;
                    sum_dy_d_scaled += g * fastln_bn_scaled_deviation(
                                               FASTLN_NAME(to_double)(x_column[at]), mean,
                                               exponent, prescale);
                }
            coef_scaled = rstd_scaled * (rstd_scaled * (sum_dy_d_scaled - center_scaled
                                                        * sum_dy_scaled)) / count;
            mean_dy = sum_dy_scaled / count;
        }
        for (int64_t k = 0; k < c->n_outer; k++)
            for (int64_t l = 0; l < c->n_inner; l++) {
                const int64_t at = k * stride + l;
                const double d = fastln_bn_scaled_deviation(FASTLN_NAME(to_double)(x_column[at]),
                                                            mean, exponent, prescale);
                const double dy_centred =
                    ldexp(FASTLN_NAME(to_double)(dx_column[at]), -j) - mean_dy;
                dx_column[at] = FASTLN_NAME(from_double)(
                    ldexp(k_scaled * (dy_centred - (d - center_scaled) * coef_scaled),
                          exponent + j));
            }
    }
}

/* ---- GroupNorm ---------------------------------------------------------------------------
 * A group seen as n_rows rows of width values, rows `stride` values apart
 * (fastln_gn_view, fastln/group_norm.h). Plain loops in row order. */

/* A group's statistics taken the careful way, in the rare paths' terms (fastln_ln_stats, as
 * ln_statistics gives them for a row): its mean from values scaled by a power of two that keeps
 * the sum within double's range, then ln_rescaled_statistics around that mean over the group's
 * runs. A group holding a NaN or an Inf gets NaN statistics (its values stay NaN). For the
 * channels-last groups the sums cannot take, and the backward's groups taken again from x. */
static void FASTLN_NAME(gn_view_statistics)(const FASTLN_T *x, const fastln_gn_view *view,
                                            double eps, fastln_ln_stats *stats)
{
    const double n = (double)(view->n_rows * view->width);
    double largest = 0.0;
    for (int64_t r = 0; r < view->n_rows; r++)
        for (int64_t j = 0; j < view->width; j++)
            largest = fmax(largest, fabs(FASTLN_NAME(to_double)(x[r * view->stride + j])));
    for (int64_t r = 0; r < view->n_rows && isfinite(largest); r++)
        for (int64_t j = 0; j < view->width; j++)
            if (!isfinite(FASTLN_NAME(to_double)(x[r * view->stride + j]))) largest = NAN;
    stats->shift = stats->mean_shifted = stats->mean = stats->var = NAN;
    stats->rstd = stats->rstd_scaled = stats->center = NAN;
    stats->exponent = stats->prescale = stats->rare = 0;
    if (!isfinite(largest)) return;
    int top, count_bits;
    frexp(largest, &top);
    frexp(n, &count_bits); /* n < 2^count_bits: the scaled sum stays below 1 */
    double sum = 0.0;
    for (int64_t r = 0; r < view->n_rows; r++)
        for (int64_t j = 0; j < view->width; j++)
            sum += ldexp(FASTLN_NAME(to_double)(x[r * view->stride + j]), -top - count_bits);
    stats->shift = stats->mean = ldexp(sum / n, top + count_bits);
    stats->mean_shifted = 0.0;
    stats->prescale = FASTLN_NAME(ln_prescale)(x, view->n_rows, view->width, view->stride);
    FASTLN_NAME(ln_rescaled_statistics)(x, view->n_rows, view->width, view->stride, eps, stats);
    stats->rstd = ldexp(stats->rstd_scaled, stats->exponent); /* Inf when beyond double */
    stats->rare = fastln_ln_needs_rare(stats);
}

/* x_hat of one value from the careful statistics (fastln_ln_rare_x_hat): 0 for a constant
 * group. */
FASTLN_INLINE double FASTLN_NAME(gn_rescaled_x_hat)(FASTLN_T value, const fastln_ln_stats *stats)
{
    if (stats->var == 0.0) return 0.0;
    return fastln_ln_rare_x_hat(FASTLN_NAME(to_double)(value), stats);
}

/* y = gamma_c * x_hat + beta_c for a group of the rare paths (stats->rare), each deviation
 * brought to about 1 first (ln_write_rescaled). In place is fine. */
static void FASTLN_NAME(gn_write_rescaled)(const FASTLN_T *x, FASTLN_T *y,
                                           const fastln_gn_view *view, const FASTLN_P *gamma,
                                           const FASTLN_P *beta, const fastln_ln_stats *stats)
{
    for (int64_t r = 0; r < view->n_rows; r++)
        for (int64_t j = 0; j < view->width; j++) {
            const int64_t at = r * view->stride + j, c = fastln_gn_view_channel(view, r, j);
            double value = FASTLN_NAME(gn_rescaled_x_hat)(x[at], stats);
            if (gamma) value *= (double)gamma[c];
            if (beta) value += (double)beta[c];
            y[at] = FASTLN_NAME(from_double)(value);
        }
}

/* Backward of a group from its statistics taken again from x (gn_view_statistics), all in
 * double, as ln_backward_row_recomputed does for a row:
 *     g = ldexp(dx_hat, -k), 2^k just above max |dx_hat|,
 *     dx = ldexp(rstd_scaled * ((g - mean(g)) - x_hat * mean(g * x_hat)), exponent + k),
 * so no product leaves double's range unless dx itself does; a constant group has x_hat = 0 and
 * rstd = 1 / sqrt(eps) (Inf with eps = 0). Adds each channel's dgamma and dbeta terms (indexed
 * by channel - view->first_channel). For the groups whose cached rstd is Inf (beyond the cache's
 * range, or a constant group with eps = 0) and those whose products overflow. dx may be dy. */
static void FASTLN_NAME(gn_backward_recomputed)(const FASTLN_T *dy, const FASTLN_T *x,
                                                FASTLN_T *dx, const fastln_gn_view *view,
                                                const FASTLN_P *gamma, double eps,
                                                double *dgamma_terms, double *dbeta_terms)
{
    fastln_ln_stats stats;
    FASTLN_NAME(gn_view_statistics)(x, view, eps, &stats);
    const double n = (double)(view->n_rows * view->width);
    double largest = 0.0;
    for (int64_t r = 0; r < view->n_rows; r++)
        for (int64_t j = 0; j < view->width; j++) {
            const int64_t at = r * view->stride + j, c = fastln_gn_view_channel(view, r, j);
            const double dx_hat = FASTLN_NAME(to_double)(dy[at]) * (gamma ? (double)gamma[c] : 1.0);
            if (isfinite(dx_hat)) largest = fmax(largest, fabs(dx_hat));
        }
    int k = 0;
    if (largest > 0.0) frexp(largest, &k);
    double sum_g = 0.0, sum_g_xhat = 0.0;
    for (int64_t r = 0; r < view->n_rows; r++)
        for (int64_t j = 0; j < view->width; j++) {
            const int64_t at = r * view->stride + j, c = fastln_gn_view_channel(view, r, j);
            const double g = ldexp(FASTLN_NAME(to_double)(dy[at]), -k)
                             * (gamma ? (double)gamma[c] : 1.0);
            sum_g += g;
            sum_g_xhat += g * FASTLN_NAME(gn_rescaled_x_hat)(x[at], &stats);
        }
    const double mean_g = sum_g / n, mean_g_xhat = sum_g_xhat / n;
    for (int64_t r = 0; r < view->n_rows; r++)
        for (int64_t j = 0; j < view->width; j++) {
            const int64_t at = r * view->stride + j, c = fastln_gn_view_channel(view, r, j);
            const double dy_value = FASTLN_NAME(to_double)(dy[at]);
            const double x_hat = FASTLN_NAME(gn_rescaled_x_hat)(x[at], &stats);
            const double g = ldexp(dy_value, -k) * (gamma ? (double)gamma[c] : 1.0);
            dgamma_terms[c - view->first_channel] += dy_value * x_hat;
            dbeta_terms[c - view->first_channel] += dy_value;
            dx[at] = FASTLN_NAME(from_double)(
                ldexp(stats.rstd_scaled * ((g - mean_g) - x_hat * mean_g_xhat), stats.exponent + k));
        }
}

/* ---- The row backwards' sums over rows (dgamma, dbeta) beyond their accumulators' range ----
 * dgamma = sum(dy * x_hat) and dbeta = sum(dy) per column are accumulated in float runs (the
 * float32-compute types) or in double (float64), and both overflow when dy comes within a
 * factor of the number of rows of the type's largest value, even where the exact sum is
 * finite. A column whose dgamma or dbeta came out Inf or NaN is summed again here, in double,
 * row after row in row order (the same order for any thread count), float64 dy scaled by
 * 2^-FASTLN_COLUMN_SCALE first (exact but for values below 2^-946, far under the sums' last
 * digits; |x_hat| <= sqrt(n_cols), so no sum of fewer than 2^64 rows can overflow), and the
 * scale taken out at the end. A column with NaN or Inf among its inputs comes out NaN or Inf
 * again. */
#define FASTLN_COLUMN_SCALE 128

/* What values_x_hat needs of a row, or of a GroupNorm group, taken once: the mean of its
 * deviations from the cache's mean (which may be rounded to float32: the backward's own
 * correction), and, where the cache's mean and rstd do not give x_hat (an Inf rstd: a spread
 * beyond the cache's range, constant values with eps = 0; float64 deviations beyond double),
 * its statistics taken again the careful way (gn_view_statistics). */
typedef struct {
    int corrected, taken;
    double correction;
    fastln_ln_stats stats;
} FASTLN_NAME(values_again);

/* x_hat of `value`, one of the values that `view` sees of x, as the backward takes it:
 * ((value - mean) - correction) * rstd, or from the careful statistics (0 for constant
 * values, as the forward wrote beta). */
static double FASTLN_NAME(values_x_hat)(const FASTLN_T *x, const fastln_gn_view *view,
                                        double mean, double rstd, double eps, FASTLN_T value,
                                        FASTLN_NAME(values_again) *again)
{
    const double v = FASTLN_NAME(to_double)(value);
    if (!again->corrected) {
        double sum = 0.0;
        for (int64_t r = 0; r < view->n_rows; r++)
            for (int64_t j = 0; j < view->width; j++)
                sum += FASTLN_NAME(to_double)(x[r * view->stride + j]) - mean;
        again->correction = sum / (double)(view->n_rows * view->width);
        again->corrected = 1;
    }
    const double x_hat = ((v - mean) - again->correction) * rstd;
    if (isfinite(x_hat) || !isfinite(v) || isnan(rstd)) return x_hat;
    if (!again->taken) {
        FASTLN_NAME(gn_view_statistics)(x, view, eps, &again->stats);
        again->taken = 1;
    }
    return FASTLN_NAME(gn_rescaled_x_hat)(value, &again->stats);
}

/* What column_x_hat needs of a row: values_x_hat's (LayerNorm), or an RMSNorm row's rstd taken
 * again where the cache's is Inf. */
typedef struct {
    FASTLN_NAME(values_again) ln;
    int rms_taken, rms_exponent;
    double rms_rstd_scaled;     /* x_hat = ldexp(x, rms_exponent) * rms_rstd_scaled */
} FASTLN_NAME(row_again);

/* x_hat of element j of row r, as the backward takes it: values_x_hat for LayerNorm; x * rstd
 * for RMSNorm, or from the row's rstd taken again (0 for an all-zero row with eps = 0, as the
 * forward wrote 0). */
static double FASTLN_NAME(column_x_hat)(const fastln_rows_call *call, int64_t r, int64_t j,
                                        FASTLN_NAME(row_again) *again)
{
    const int64_t n = call->n_cols;
    const FASTLN_T *row = (const FASTLN_T *)call->x + r * n;
    const double rstd = (double)((const FASTLN_P *)call->rstd)[r];
    if (call->mean) {
        const fastln_gn_view view = {1, n, n, 0, 0}; /* the row as one run of values */
        return FASTLN_NAME(values_x_hat)(row, &view, (double)((const FASTLN_P *)call->mean)[r],
                                         rstd, call->eps, row[j], &again->ln);
    }
    const double x = FASTLN_NAME(to_double)(row[j]);
    const double x_hat = x * rstd;
    if (isfinite(x_hat) || !isfinite(x) || isnan(rstd)) return x_hat;
    if (!again->rms_taken) {
        again->rms_rstd_scaled =
            FASTLN_NAME(rms_rescaled_rstd)(row, n, call->eps, &again->rms_exponent);
        again->rms_taken = 1;
    }
    if (isinf(again->rms_rstd_scaled)) return 0.0; /* all zeros with eps = 0 */
    return ldexp(x, again->rms_exponent) * again->rms_rstd_scaled;
}

/* Whether a parameter-type value is Inf or NaN: its exponent bits all ones, tested as integers,
 * which the compiler keeps in vectors (isfinite goes one value at a time). */
FASTLN_INLINE int FASTLN_NAME(parameter_not_finite)(FASTLN_P v)
{
#if FASTLN_COMPUTE_F32
    const uint32_t exponent = 0x7f800000u;
    uint32_t bits;
#else
    const uint64_t exponent = 0x7ff0000000000000u;
    uint64_t bits;
#endif
    memcpy(&bits, &v, sizeof bits);
    return (bits & exponent) == exponent;
}

/* Where out[j] (j in [begin, end)) came out Inf or NaN: the sum taken again, sums[j], with the
 * scale taken out (2^unscale), in the parameter type. */
FASTLN_INLINE void FASTLN_NAME(store_sums_again)(FASTLN_P *out, const double *sums,
                                                 int64_t begin, int64_t end, int unscale)
{
    for (int64_t j = begin; j < end; j++)
        if (!isfinite((double)out[j])) out[j] = (FASTLN_P)ldexp(sums[j], unscale);
}

/* Columns [begin, end) of dgamma and dbeta summed again where they are not finite (each sum on
 * its own: a NaN in x makes its columns' dgamma NaN and leaves their dbeta as it is). The sums
 * go to block 0's partials of these columns, which the column sums have read. Out of line,
 * as a rare path: the column sums around its call stay the small loops they were. */
FASTLN_OUTLINED void FASTLN_NAME(column_sums_again)(const fastln_rows_call *call, int64_t begin,
                                                    int64_t end)
{
    const int64_t n = call->n_cols;
    const FASTLN_T *dy = call->dy;
    FASTLN_P *dgamma = call->dgamma, *dbeta = call->dbeta;
    double *sum_dy_xhat = call->partials, *sum_dy = call->partials + n;
    const int unscale = FASTLN_COMPUTE_F32 ? 0 : FASTLN_COLUMN_SCALE;
    const double scale = ldexp(1.0, -unscale);
    for (int64_t j = begin; j < end; j++) {
        sum_dy_xhat[j] = 0.0;
        if (dbeta) sum_dy[j] = 0.0;
    }
    for (int64_t r = 0; r < call->n_rows; r++) {
        FASTLN_NAME(row_again) again = {0};
        for (int64_t j = begin; j < end; j++) {
            const double dy_scaled = FASTLN_NAME(to_double)(dy[r * n + j]) * scale;
            if (!isfinite((double)dgamma[j]))
                sum_dy_xhat[j] += dy_scaled * FASTLN_NAME(column_x_hat)(call, r, j, &again);
            if (dbeta && !isfinite((double)dbeta[j])) sum_dy[j] += dy_scaled;
        }
    }
    FASTLN_NAME(store_sums_again)(dgamma, sum_dy_xhat, begin, end, unscale);
    if (dbeta) FASTLN_NAME(store_sums_again)(dbeta, sum_dy, begin, end, unscale);
}
