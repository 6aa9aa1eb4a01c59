/* Statistics of a row (LayerNorm, RMSNorm) and of a BatchNorm feature, for one storage type
 * (fastln/storage.h): in double, or for LayerNorm's float32-compute types in float runs folded
 * into double, falling back to double where those do not hold. No include guard on purpose.
 *
 * Every sum keeps the slots of fastln/simd.h: a pass over the row adds each FASTLN_SLOTS-element
 * block into FASTLN_PASS_VECTORS accumulators (one pass per FASTLN_PASS_SLOTS slots), and the
 * row's last partial block comes from a padded copy whose padding adds exactly +0. */

/* ---- LayerNorm: mean and variance ------------------------------------------------------- */

/* A row's last partial block in the compute type, into padded, its lanes past the row set to
 * pad (a value that adds exactly 0 to the sum at hand); returns n_whole, where that block
 * starts (n_cols when the row has none, padded then untouched). */
FASTLN_INLINE int64_t FASTLN_NAME(pad_last_block)(const FASTLN_T *x, int64_t n_cols,
                                                  FASTLN_P pad, FASTLN_P padded[FASTLN_SLOTS])
{
    const int64_t n_whole = n_cols - n_cols % FASTLN_SLOTS;
    if (n_whole < n_cols)
        for (int k = 0; k < FASTLN_SLOTS; k++)
            padded[k] = n_whole + k < n_cols ? FASTLN_NAME(to_compute)(x[n_whole + k]) : pad;
    return n_whole;
}

/* sum += d and sumsq += d * d, d = x - shift, for one block's elements of this pass's slots
 * (from the row, or from the padded last block when x is NULL). */
FASTLN_INLINE void FASTLN_NAME(ln_add_block)(const FASTLN_T *x, const FASTLN_P *padded,
                                             int64_t at, double shift,
                                             FASTLN_VD sum[FASTLN_PASS_VECTORS],
                                             FASTLN_VD sumsq[FASTLN_PASS_VECTORS])
{
    FASTLN_UNROLL
    for (int j = 0; j < FASTLN_PASS_VECTORS / 2; j++) {
        FASTLN_VD low, high;
        FASTLN_NAME(load_wide_from)(x, padded, at + j * FASTLN_VF_LANES, &low, &high);
        low -= shift;
        high -= shift;
        sum[2 * j] += low;
        sumsq[2 * j] += low * low;
        sum[2 * j + 1] += high;
        sumsq[2 * j + 1] += high * high;
    }
}

/* sum(d) and sum(d * d) over a row, d = x - shift, for a shift that is a compute-type value (it
 * pads the last block: d = 0 there). */
FASTLN_OUTLINED void FASTLN_NAME(ln_sums)(const FASTLN_T *x, int64_t n_cols, double shift,
                                        double *sum_out, double *sumsq_out)
{
    FASTLN_P padded[FASTLN_SLOTS];
    const int64_t n_whole = FASTLN_NAME(pad_last_block)(x, n_cols, (FASTLN_C)shift, padded);
    double sum_slots[FASTLN_SLOTS], sumsq_slots[FASTLN_SLOTS];
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_PASS_SLOTS) {
        FASTLN_VD sum[FASTLN_PASS_VECTORS] = {0}, sumsq[FASTLN_PASS_VECTORS] = {0};
        for (int64_t i = 0; i < n_whole; i += FASTLN_SLOTS)
            FASTLN_NAME(ln_add_block)(x, NULL, i + first, shift, sum, sumsq);
        if (n_whole < n_cols) FASTLN_NAME(ln_add_block)(NULL, padded, first, shift, sum, sumsq);
        memcpy(sum_slots + first, sum, sizeof sum);
        memcpy(sumsq_slots + first, sumsq, sizeof sumsq);
    }
    *sum_out = fastln_reduce_slots(sum_slots);
    *sumsq_out = fastln_reduce_slots(sumsq_slots);
}

#if FASTLN_COMPUTE_F32
/* ---- LayerNorm: the statistics in float runs ---------------------------------------------
 * The float32-compute types take a row's sums as the backward does (FASTLN_FORWARD_FLOAT_RUN
 * blocks per float run, fastln/simd.h): d = x - shift, sum(d) and sum(d * d) in float per slot
 * and run, each run's partial added to its slot's double total. Float sums need a shift near
 * the mean (a variance that is a small difference of large sums would keep the float
 * roundings of the large ones), so the shift is the mean of the row's first block, and a row
 * whose mean is still far from it is summed again around its mean. */

/* Adds this pass's float partials to their slots' double totals (slot first + lane); the row's
 * first run sets them (the same as adding to +0: a partial is never -0). */
FASTLN_INLINE void FASTLN_NAME(fold_floats)(const FASTLN_VF partial[FASTLN_FLOAT_PASS_VECTORS],
                                            double *totals, int first_run)
{
    FASTLN_UNROLL
    for (int j = 0; j < FASTLN_FLOAT_PASS_VECTORS; j++) {
        double *slot = totals + j * FASTLN_VF_LANES;
        FASTLN_VD low = FASTLN_ISA(widen_low)(partial[j]);
        FASTLN_VD high = FASTLN_ISA(widen_high)(partial[j]);
        if (!first_run) {
            low += FASTLN_ISA(load_f64)(slot);
            high += FASTLN_ISA(load_f64)(slot + FASTLN_VD_LANES);
        }
        FASTLN_ISA(store_f64)(slot, low);
        FASTLN_ISA(store_f64)(slot + FASTLN_VD_LANES, high);
    }
}

/* A float near the row's mean: the mean of its first block (of all of it when shorter), summed
 * in double by a fixed tree: element k + width added to element k, for width = 16, 8, 4, 2, 1.
 * The widths down to a vector's lanes add whole double vectors, the rest lanes of the last one:
 * converted and stored one element at a time, a float16 block stalled every row, its scalar
 * stores read back as vectors (docs/performance.md, "The row's shift a vector at a time"). */
FASTLN_INLINE float FASTLN_NAME(ln_float_shift)(const FASTLN_T *x, int64_t n_cols)
{
    enum { N_VECTORS = FASTLN_SLOTS / FASTLN_VD_LANES };
    if (n_cols < FASTLN_SLOTS) {
        double sum = 0.0;
        for (int64_t j = 0; j < n_cols; j++) sum += FASTLN_NAME(to_double)(x[j]);
        return (float)(sum / (double)n_cols);
    }
    FASTLN_VD v[N_VECTORS];
    for (int k = 0; k < N_VECTORS; k += 2)
        FASTLN_NAME(load_wide)(x + k * FASTLN_VD_LANES, &v[k], &v[k + 1]);
    for (int width = N_VECTORS / 2; width > 0; width /= 2)
        for (int k = 0; k < width; k++) v[k] += v[k + width];
    double lanes[FASTLN_VD_LANES];
    memcpy(lanes, &v[0], sizeof lanes);
    for (int width = FASTLN_VD_LANES / 2; width > 0; width /= 2)
        for (int k = 0; k < width; k++) lanes[k] += lanes[k + width];
    return (float)(lanes[0] / FASTLN_SLOTS);
}

/* sum(d) and sum(d * d) over a row in float runs, d = x - shift in float (the padding of the
 * last block is the shift: d = 0 there). */
FASTLN_OUTLINED void FASTLN_NAME(ln_float_sums)(const FASTLN_T *x, int64_t n_cols, float shift,
                                              double *sum_out, double *sumsq_out)
{
    FASTLN_P padded[FASTLN_SLOTS];
    const int64_t n_whole = FASTLN_NAME(pad_last_block)(x, n_cols, shift, padded);
    double sum_slots[FASTLN_SLOTS], sumsq_slots[FASTLN_SLOTS];
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_FLOAT_PASS_SLOTS)
        for (int64_t run = 0; run < n_cols; run += FASTLN_FORWARD_FLOAT_RUN * FASTLN_SLOTS) {
            FASTLN_VF sum[FASTLN_FLOAT_PASS_VECTORS] = {0}, sumsq[FASTLN_FLOAT_PASS_VECTORS] = {0};
            int padded_block;
            const int64_t whole_end = fastln_float_run_end(run, FASTLN_FORWARD_FLOAT_RUN, n_whole,
                                                           n_cols, &padded_block);
            for (int64_t i = run; i < whole_end; i += FASTLN_SLOTS) {
                FASTLN_UNROLL
                for (int j = 0; j < FASTLN_FLOAT_PASS_VECTORS; j++) {
                    const FASTLN_VF d =
                        FASTLN_NAME(load_c)(x + i + first + j * FASTLN_VF_LANES) - shift;
                    sum[j] += d;
                    sumsq[j] += d * d;
                }
            }
            if (padded_block) {
                FASTLN_UNROLL
                for (int j = 0; j < FASTLN_FLOAT_PASS_VECTORS; j++) {
                    const FASTLN_VF d =
                        FASTLN_NAME(load_p)(padded + first + j * FASTLN_VF_LANES) - shift;
                    sum[j] += d;
                    sumsq[j] += d * d;
                }
            }
            FASTLN_NAME(fold_floats)(sum, sum_slots + first, run == 0);
            FASTLN_NAME(fold_floats)(sumsq, sumsq_slots + first, run == 0);
        }
    *sum_out = fastln_reduce_slots(sum_slots);
    *sumsq_out = fastln_reduce_slots(sumsq_slots);
}

/* A row's statistics from its float sums around `shift`: 1 and *stats filled when they hold, 0
 * when the row needs the double pass. They hold when the sums are finite (no Inf, NaN, or
 * square beyond float), sum(d * d) is at least n * FLT_MIN (below that, squares under float's
 * normal range could matter: each is off by at most 2^-150; a constant row is also sent on),
 * and the mean is near the shift (mean_shifted^2 <= FASTLN_MAX_FLOAT_CANCELLATION * var, so
 * that the variance keeps the sums' relative accuracy). */
FASTLN_INLINE int FASTLN_NAME(ln_float_statistics_from_sums)(float shift, double sum,
                                                             double sumsq, double n, double eps,
                                                             fastln_ln_stats *stats)
{
    const double mean_shifted = sum / n;
    double var = sumsq / n - mean_shifted * mean_shifted;
    if (!isfinite(sum) || !(sumsq >= n * FLT_MIN) || !(sumsq < INFINITY)
        || !(mean_shifted * mean_shifted <= FASTLN_MAX_FLOAT_CANCELLATION * var))
        return 0;
    stats->shift = (double)shift;
    stats->mean_shifted = mean_shifted;
    stats->mean = (double)shift + mean_shifted;
    stats->var = var;
    stats->rstd = stats->rstd_scaled = 1.0 / sqrt(var + eps);
    stats->exponent = stats->prescale = 0;
    stats->center = 0.0;
    stats->rare = 0;
    return 1;
}

/* A row's statistics in float runs (above): 1 when they hold, 0 for the double pass. */
FASTLN_INLINE int FASTLN_NAME(ln_float_statistics)(const FASTLN_T *x, int64_t n_cols, double eps,
                                                   fastln_ln_stats *stats)
{
    const double n = (double)n_cols;
    float shift = FASTLN_NAME(ln_float_shift)(x, n_cols);
    double sum, sumsq;
    FASTLN_NAME(ln_float_sums)(x, n_cols, shift, &sum, &sumsq);
    if (FASTLN_NAME(ln_float_statistics_from_sums)(shift, sum, sumsq, n, eps, stats)) return 1;
    /* A better shift helps only a row whose sums were good but far from it. */
    const double mean_shifted = sum / n;
    if (!isfinite(sum) || !(sumsq >= n * FLT_MIN) || !(sumsq < INFINITY)) return 0;
    shift = (float)((double)shift + mean_shifted);
    FASTLN_NAME(ln_float_sums)(x, n_cols, shift, &sum, &sumsq);
    return FASTLN_NAME(ln_float_statistics_from_sums)(shift, sum, sumsq, n, eps, stats);
}
#endif

/* The mean of a row of finite values whose sums around x[0] overflow double (float64 values
 * near DBL_MAX), summed on the values scaled by 2^-k with n_cols < 2^k, a sum that cannot
 * overflow; 0 (no mean) when the row holds a NaN or an Inf, which stays NaN. Rare: a plain
 * loop. */
static int FASTLN_NAME(ln_wide_mean)(const FASTLN_T *x, int64_t n_cols, double *mean_out)
{
    int k;
    frexp((double)n_cols, &k);
    double sum = 0.0;
    for (int64_t j = 0; j < n_cols; j++) {
        const double value = FASTLN_NAME(to_double)(x[j]);
        if (!isfinite(value)) return 0;
        sum += ldexp(value, -k);
    }
    *mean_out = ldexp(sum / (double)n_cols, k);
    return 1;
}

/* The power of two the rare paths compute a row's deviations under: 2^-2 for a row holding a
 * value of magnitude 2^1022 or more, whose x - mean can pass DBL_MAX (values of both signs near
 * it), 2^0 otherwise (scaling a subnormal would lose its digits). The values are n_runs runs of
 * width values, stride apart (a row: one run; a channels-last group: its channels at every
 * position), as for ln_rescaled_statistics. */
static int FASTLN_NAME(ln_prescale)(const FASTLN_T *x, int64_t n_runs, int64_t width,
                                    int64_t stride)
{
    for (int64_t r = 0; r < n_runs; r++)
        for (int64_t j = 0; j < width; j++)
            if (fabs(FASTLN_NAME(to_double)(x[r * stride + j])) >= 0x1p1022) return -2;
    return 0;
}

/* The statistics of a row whose squares (or deviations) leave double's range, from its
 * deviations (fastln_ln_deviation) scaled by the power of two 2^-e that brings the largest into
 * [0.5, 1). ldexp scales exactly, also by powers of two beyond double's range (a subnormal
 * spread needs up to 2^1074). Sets stats->var (the scaled variance, 0 only for a constant row),
 * ->center (the scaled deviations' mean: the rounding of the mean, which for subnormal spreads is
 * no smaller than the spread itself; NaN where the deviations are beyond double), ->exponent
 * (rstd = rstd_scaled * 2^exponent may be beyond double: eps = 0 and a spread below ~1e-308)
 * and ->rstd_scaled. Rare: plain loops in a fixed order. */
static void FASTLN_NAME(ln_rescaled_statistics)(const FASTLN_T *x, int64_t n_runs,
                                                int64_t width, int64_t stride, double eps,
                                                fastln_ln_stats *stats)
{
    double largest = 0.0;
    for (int64_t r = 0; r < n_runs; r++)
        for (int64_t j = 0; j < width; j++)
            largest = fmax(largest, fabs(fastln_ln_deviation(
                                        FASTLN_NAME(to_double)(x[r * stride + j]), stats)));
    stats->var = 0.0;
    stats->exponent = stats->prescale;
    stats->center = isinf(largest) ? NAN : 0.0;
    stats->rstd_scaled = 1.0 / sqrt(eps);
    if (!(largest > 0.0) || isinf(largest)) { /* constant row; or beyond */
        stats->exponent = 0;
        return;
    }
    int e;
    frexp(largest, &e);
    double sum = 0.0, sumsq = 0.0;
    for (int64_t r = 0; r < n_runs; r++)
        for (int64_t j = 0; j < width; j++) {
            const double d = ldexp(
                fastln_ln_deviation(FASTLN_NAME(to_double)(x[r * stride + j]), stats), -e);
            sum += d;
            sumsq += d * d;
        }
    const double n = (double)(n_runs * width);
    const double center = sum / n;
    double var = sumsq / n - center * center;
    if (var < 0.0) var = 0.0;
    /* The true deviations are the scaled ones times 2^scale, so
     * 1 / sqrt(var * 4^scale + eps) = 2^-scale / sqrt(var + eps * 4^-scale). Where
     * eps * 4^-scale passes DBL_MAX, it dwarfs var (< 1) and rstd is 1 / sqrt(eps). */
    const int scale = e - stats->prescale;
    const double eps_scaled = ldexp(eps, -2 * scale);
    stats->var = var;
    if (eps_scaled > DBL_MAX) {
        stats->center = ldexp(center, scale); /* in the units of exponent 0 */
        stats->exponent = 0;
        return;
    }
    stats->center = center;
    stats->exponent = -scale;
    stats->rstd_scaled = 1.0 / sqrt(var + eps_scaled);
}

/* One row's statistics (fastln_ln_stats), as the forward takes them and the backward's rare path
 * takes them again.
 *
 * They come from one read of the row, shifted by its first element: d = x - x[0] is small
 * whenever the row's spread is small, so sum(d) and sum(d * d) in double do not cancel even when
 * |mean| >> std (the E[x^2] - E[x]^2 trap). A row whose first element lies far from its mean
 * (the two terms of the variance cancel by more than FASTLN_MAX_CANCELLATION) is summed again
 * around the mean. A row of finite values whose sums around x[0] overflow (float64 values near
 * DBL_MAX, of both signs) is centred on its mean instead, with every sum taken on scaled values;
 * so is a row whose squares overflow or underflow double (ln_rescaled_statistics). */
FASTLN_INLINE void FASTLN_NAME(ln_statistics)(const FASTLN_T *x, int64_t n_cols, double eps,
                                              fastln_ln_stats *stats)
{
#if FASTLN_COMPUTE_F32
    if (FASTLN_NAME(ln_float_statistics)(x, n_cols, eps, stats)) return;
#endif
    const double n = (double)n_cols;
    double shift = FASTLN_NAME(to_double)(x[0]);
    double sum, sumsq;
    FASTLN_NAME(ln_sums)(x, n_cols, shift, &sum, &sumsq);
    double mean_shifted = sum / n;
    double var = sumsq / n - mean_shifted * mean_shifted;
    double wide_mean;
    const int wide = !isfinite(mean_shifted) && FASTLN_NAME(ln_wide_mean)(x, n_cols, &wide_mean);
    if (wide) {
        shift = (double)(FASTLN_C)wide_mean;
        mean_shifted = 0.0;
        var = INFINITY;
    }
    if (mean_shifted * mean_shifted > FASTLN_MAX_CANCELLATION * var) {
        /* The new shift is a compute-type value, so the padding still adds exactly zero. */
        double sum_around_mean, sumsq_around_mean;
        FASTLN_NAME(ln_sums)(x, n_cols, (double)(FASTLN_C)(shift + mean_shifted),
                             &sum_around_mean, &sumsq_around_mean);
        const double mean_residual = sum_around_mean / n;
        var = sumsq_around_mean / n - mean_residual * mean_residual;
    }
    if (var < 0.0) var = 0.0; /* rounding only; NaN stays NaN */
    stats->shift = shift;
    stats->mean_shifted = mean_shifted;
    stats->mean = shift + mean_shifted;
    stats->var = var;
    stats->rstd = stats->rstd_scaled = 1.0 / sqrt(var + eps);
    stats->exponent = stats->prescale = 0;
    stats->center = 0.0;
    stats->rare = 0;
    if ((isfinite(mean_shifted) && !isfinite(var)) || (var < FASTLN_TINY && eps < FASTLN_TINY)) {
        /* Squares that overflow (|x| beyond ~1e154) or underflow (spreads below ~1e-154, with
         * eps too small to matter) in double: take the statistics again on rescaled values.
         * NaN and Inf rows never come here (their mean_shifted is not finite). */
        stats->prescale = FASTLN_NAME(ln_prescale)(x, 1, n_cols, n_cols);
        FASTLN_NAME(ln_rescaled_statistics)(x, 1, n_cols, n_cols, eps, stats);
        /* The mean of a row centred on its mean gets the deviations' mean, its last digits; a
         * row whose deviations are beyond double stays NaN. */
        if (wide) stats->mean = shift + ldexp(stats->center, stats->prescale - stats->exponent);
        if (isnan(stats->center)) stats->var = stats->rstd_scaled = NAN;
        stats->rstd = ldexp(stats->rstd_scaled, stats->exponent); /* Inf when beyond double */
        stats->rare = fastln_ln_needs_rare(stats);
    }
}

/* ---- RMSNorm: mean of squares ----------------------------------------------------------- */

/* sumsq += (x * scale)^2 for one block's elements of this pass's slots. */
FASTLN_INLINE void FASTLN_NAME(rms_add_block)(const FASTLN_T *x, const FASTLN_P *padded,
                                              int64_t at, double scale,
                                              FASTLN_VD sumsq[FASTLN_PASS_VECTORS])
{
    FASTLN_UNROLL
    for (int j = 0; j < FASTLN_PASS_VECTORS / 2; j++) {
        FASTLN_VD low, high;
        FASTLN_NAME(load_wide_from)(x, padded, at + j * FASTLN_VF_LANES, &low, &high);
        low *= scale;
        high *= scale;
        sumsq[2 * j] += low * low;
        sumsq[2 * j + 1] += high * high;
    }
}

/* sum((x * scale)^2) over the row; scale is 1 except on the overflow path. Zeros pad. */
FASTLN_OUTLINED double FASTLN_NAME(rms_sum_squares)(const FASTLN_T *x, int64_t n_cols, double scale)
{
    FASTLN_P padded[FASTLN_SLOTS];
    const int64_t n_whole = FASTLN_NAME(pad_last_block)(x, n_cols, 0, padded);
    double slots[FASTLN_SLOTS];
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_PASS_SLOTS) {
        FASTLN_VD sumsq[FASTLN_PASS_VECTORS] = {0};
        for (int64_t i = 0; i < n_whole; i += FASTLN_SLOTS)
            FASTLN_NAME(rms_add_block)(x, NULL, i + first, scale, sumsq);
        if (n_whole < n_cols) FASTLN_NAME(rms_add_block)(NULL, padded, first, scale, sumsq);
        memcpy(slots + first, sumsq, sizeof sumsq);
    }
    return fastln_reduce_slots(slots);
}

/* rstd * 2^-exponent of a row whose squares leave double's range (rare), summed again scaled by
 * the power of two 2^exponent that brings max|x| into [0.5, 1) (so the scaling is exact), at most
 * 2^1023 (the largest double power of two: a subnormal row then lands at 2^-51 or above, where
 * squares keep their digits):
 *     rstd = 2^exponent / sqrt(mean((x * 2^exponent)^2) + eps * 4^exponent).
 * *exponent_out gets the exponent (0 when eps dwarfs every square); rstd itself may be beyond
 * double (eps = 0 and a row below ~1e-308). An all-zero row gives 1 / sqrt(eps), Inf when
 * eps = 0; a row holding an Inf gives 0 (mean(x * x) is Inf). */
static double FASTLN_NAME(rms_rescaled_rstd)(const FASTLN_T *x, int64_t n_cols, double eps,
                                             int *exponent_out)
{
    *exponent_out = 0;
    double max_abs = 0.0;
    for (int64_t i = 0; i < n_cols; i++) {
        const double magnitude = fabs(FASTLN_NAME(to_double)(x[i]));
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
    const double scaled = FASTLN_NAME(rms_sum_squares)(x, n_cols, scale) / (double)n_cols;
    *exponent_out = exponent;
    return 1.0 / sqrt(scaled + eps_scaled);
}

#if FASTLN_COMPUTE_F32
/* sum(x * x) over a row in float runs (FASTLN_FORWARD_FLOAT_RUN blocks per run, each run's
 * partial added to its slot's double total), as LayerNorm's ln_float_sums. Zeros pad. */
FASTLN_OUTLINED double FASTLN_NAME(rms_float_sum_squares)(const FASTLN_T *x, int64_t n_cols)
{
    FASTLN_P padded[FASTLN_SLOTS];
    const int64_t n_whole = FASTLN_NAME(pad_last_block)(x, n_cols, 0, padded);
    double slots[FASTLN_SLOTS];
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_FLOAT_PASS_SLOTS)
        for (int64_t run = 0; run < n_cols; run += FASTLN_FORWARD_FLOAT_RUN * FASTLN_SLOTS) {
            FASTLN_VF sumsq[FASTLN_FLOAT_PASS_VECTORS] = {0};
            int padded_block;
            const int64_t whole_end = fastln_float_run_end(run, FASTLN_FORWARD_FLOAT_RUN, n_whole,
                                                           n_cols, &padded_block);
            for (int64_t i = run; i < whole_end; i += FASTLN_SLOTS) {
                FASTLN_UNROLL
                for (int j = 0; j < FASTLN_FLOAT_PASS_VECTORS; j++) {
                    const FASTLN_VF v = FASTLN_NAME(load_c)(x + i + first + j * FASTLN_VF_LANES);
                    sumsq[j] += v * v;
                }
            }
            if (padded_block) {
                FASTLN_UNROLL
                for (int j = 0; j < FASTLN_FLOAT_PASS_VECTORS; j++) {
                    const FASTLN_VF v = FASTLN_NAME(load_p)(padded + first + j * FASTLN_VF_LANES);
                    sumsq[j] += v * v;
                }
            }
            FASTLN_NAME(fold_floats)(sumsq, slots + first, run == 0);
        }
    return fastln_reduce_slots(slots);
}
#endif

/* 1 / sqrt(mean(x * x) + eps) of one row.
 *
 * float32-compute rows first try their squares in float runs (rms_float_sum_squares): they
 * stand when the sum is finite and at least n * FLT_MIN (so squares below float's normal range,
 * each off by at most 2^-150, cannot matter; an all-zero row is sent on). Otherwise, and for
 * float64, the sum of squares is in double, where float32 squares can neither overflow nor
 * underflow.
 * A float64 row can: squares beyond about 1e154 overflow, and with eps = 0 squares below about
 * 1e-154 lose their digits. Such a row is summed again rescaled (rms_rescaled_rstd). An all-zero
 * row gives 1 / sqrt(eps), and Inf when eps = 0 (the caller then writes y = 0); so does a row
 * whose rstd is beyond double's range (eps = 0 and values below ~1e-308). */
FASTLN_INLINE double FASTLN_NAME(rms_row_rstd)(const FASTLN_T *x, int64_t n_cols, double eps)
{
#if FASTLN_COMPUTE_F32
    const double float_squares = FASTLN_NAME(rms_float_sum_squares)(x, n_cols);
    if (float_squares >= (double)n_cols * FLT_MIN && float_squares < INFINITY)
        return 1.0 / sqrt(float_squares / (double)n_cols + eps);
#endif
    const double mean_square = FASTLN_NAME(rms_sum_squares)(x, n_cols, 1.0) / (double)n_cols;
    if (mean_square <= DBL_MAX && mean_square + eps >= DBL_MIN) /* false for Inf and NaN */
        return 1.0 / sqrt(mean_square + eps);
    if (mean_square != mean_square) return mean_square; /* NaN in the row */
    int exponent;
    const double rstd_scaled = FASTLN_NAME(rms_rescaled_rstd)(x, n_cols, eps, &exponent);
    return ldexp(rstd_scaled, exponent);
}

/* ---- BatchNorm: per-feature shifted sums ------------------------------------------------ */

/* shift[c] = the first value of feature c (x[0, c, 0]). */
FASTLN_INLINE void FASTLN_NAME(bn_first_values)(const FASTLN_T *FASTLN_RESTRICT x,
                                                int64_t n_features, int64_t n_inner,
                                                double *FASTLN_RESTRICT shift)
{
    for (int64_t c = 0; c < n_features; c++) shift[c] = FASTLN_NAME(to_double)(x[c * n_inner]);
}

/* Rows layout: sum[c] += d and sumsq[c] += d * d, d = x[r, c] - shift[c], for n_rows rows of
 * n_features values, consecutive rows row_stride elements apart. Features never mix, so the
 * vector width and a split of the features among threads change nothing. The rows go in groups
 * of FASTLN_BN_ROW_GROUP (fastln/batch_norm.h), and over a group each chunk of features keeps
 * its sums in registers: stored and loaded again for every row, they made each row wait for the
 * previous row's stores. Each feature still adds its rows in row order: the same bits. */

/* The sums of n_vectors float vectors' worth of features from c on, over n_rows rows. */
FASTLN_INLINE void FASTLN_NAME(bn_stats_chunk)(
    const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows, int64_t row_stride, int64_t c,
    const int n_vectors, const double *FASTLN_RESTRICT shift, double *FASTLN_RESTRICT sum,
    double *FASTLN_RESTRICT sumsq)
{
    FASTLN_VD sh[4], s[4], q[4];
    FASTLN_UNROLL
    for (int k = 0; k < 2 * n_vectors; k++) {
        const int64_t at = c + k * FASTLN_VD_LANES;
        sh[k] = FASTLN_ISA(load_f64)(shift + at);
        s[k] = FASTLN_ISA(load_f64)(sum + at);
        q[k] = FASTLN_ISA(load_f64)(sumsq + at);
    }
    for (int64_t r = 0; r < n_rows; r++) {
        FASTLN_UNROLL
        for (int j = 0; j < n_vectors; j++) {
            const FASTLN_T *at = x + r * row_stride + c + j * FASTLN_VF_LANES;
            FASTLN_PREFETCH_RUNS_AHEAD(at, FASTLN_BN_ROW_GROUP, row_stride);
            FASTLN_VD d[2];
            FASTLN_NAME(load_wide)(at, &d[0], &d[1]);
            FASTLN_UNROLL
            for (int h = 0; h < 2; h++) {
                const FASTLN_VD dev = d[h] - sh[2 * j + h];
                s[2 * j + h] += dev;
                q[2 * j + h] += dev * dev;
            }
        }
    }
    FASTLN_UNROLL
    for (int k = 0; k < 2 * n_vectors; k++) {
        const int64_t at = c + k * FASTLN_VD_LANES;
        FASTLN_ISA(store_f64)(sum + at, s[k]);
        FASTLN_ISA(store_f64)(sumsq + at, q[k]);
    }
}

FASTLN_OUTLINED void FASTLN_NAME(bn_stats_rows)(
    const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows, int64_t n_features, int64_t row_stride,
    const double *FASTLN_RESTRICT shift, double *FASTLN_RESTRICT sum,
    double *FASTLN_RESTRICT sumsq)
{
    for (int64_t first = 0; first < n_rows; first += FASTLN_BN_ROW_GROUP) {
        const FASTLN_T *rows = x + first * row_stride;
        const int64_t n = fastln_min(FASTLN_BN_ROW_GROUP, n_rows - first);
        int64_t c = 0;
        for (; c + 2 * FASTLN_VF_LANES <= n_features; c += 2 * FASTLN_VF_LANES)
            FASTLN_NAME(bn_stats_chunk)(rows, n, row_stride, c, 2, shift, sum, sumsq);
        for (; c + FASTLN_VF_LANES <= n_features; c += FASTLN_VF_LANES)
            FASTLN_NAME(bn_stats_chunk)(rows, n, row_stride, c, 1, shift, sum, sumsq);
        for (; c < n_features; c++)
            for (int64_t r = 0; r < n; r++) {
                const double d = FASTLN_NAME(to_double)(rows[r * row_stride + c]) - shift[c];
                sum[c] += d;
                sumsq[c] += d * d;
            }
    }
}

#if FASTLN_MASKED && FASTLN_COMPUTE_F32
/* ln_add_block over a block's first n (< FASTLN_SLOTS) values, read where they are by masked
 * loads instead of from a padded copy: the lanes after them are set to d = +0 where the copy's
 * shift gave d = 0, which leaves every slot as it was. Staged value by value, the partial blocks
 * set the pace of a training forward with short segments (docs/performance.md, "BatchNorm's
 * short segments"). */
FASTLN_INLINE void FASTLN_NAME(ln_add_first)(const FASTLN_T *x, int64_t n, double shift,
                                             FASTLN_VD sum[FASTLN_PASS_VECTORS],
                                             FASTLN_VD sumsq[FASTLN_PASS_VECTORS])
{
    FASTLN_UNROLL
    for (int j = 0; j < FASTLN_PASS_VECTORS / 2; j++) {
        const int64_t at = j * FASTLN_VF_LANES;
        const int64_t count = fastln_max(fastln_min(n - at, FASTLN_VF_LANES), 0);
        const FASTLN_VF v = FASTLN_NAME(load_c_first)(x + at, count);
        const FASTLN_VD low = FASTLN_ISA(keep_first_f64)(FASTLN_ISA(widen_low)(v) - shift,
                                                         fastln_min(count, FASTLN_VD_LANES));
        const FASTLN_VD high = FASTLN_ISA(keep_first_f64)(
            FASTLN_ISA(widen_high)(v) - shift, fastln_max(count - FASTLN_VD_LANES, 0));
        sum[2 * j] += low;
        sumsq[2 * j] += low * low;
        sum[2 * j + 1] += high;
        sumsq[2 * j + 1] += high * high;
    }
}
#endif

/* Segments layout, one feature: the shifted sums over n_segments segments of n_inner values,
 * segment k starting at x + k * stride. Element l of a segment adds to slot l % FASTLN_SLOTS;
 * each segment's last partial block is padded with the shift (d = 0). */
FASTLN_OUTLINED void FASTLN_NAME(bn_stats_segments)(
    const FASTLN_T *FASTLN_RESTRICT x, int64_t n_segments, int64_t stride, int64_t n_inner,
    double shift, double *FASTLN_RESTRICT sum_out, double *FASTLN_RESTRICT sumsq_out)
{
    const int64_t n_whole = n_inner - n_inner % FASTLN_SLOTS;
    double sum_slots[FASTLN_SLOTS], sumsq_slots[FASTLN_SLOTS];
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_PASS_SLOTS) {
        FASTLN_VD sum[FASTLN_PASS_VECTORS] = {0}, sumsq[FASTLN_PASS_VECTORS] = {0};
        for (int64_t k = 0; k < n_segments; k++) {
            const FASTLN_T *segment = x + k * stride;
            for (int64_t l = 0; l < n_whole; l += FASTLN_SLOTS)
                FASTLN_NAME(ln_add_block)(segment, NULL, l + first, shift, sum, sumsq);
#if FASTLN_MASKED && FASTLN_COMPUTE_F32
            if (n_whole < n_inner) /* one pass of all the slots with AVX-512: first is 0 */
                FASTLN_NAME(ln_add_first)(segment + n_whole, n_inner - n_whole, shift, sum, sumsq);
#else
            if (n_whole < n_inner) {
                FASTLN_P padded[FASTLN_PASS_SLOTS];
                for (int s = 0; s < FASTLN_PASS_SLOTS; s++)
                    padded[s] = n_whole + first + s < n_inner
                                    ? FASTLN_NAME(to_compute)(segment[n_whole + first + s])
                                    : (FASTLN_C)shift;
                FASTLN_NAME(ln_add_block)(NULL, padded, 0, shift, sum, sumsq);
            }
#endif
        }
        memcpy(sum_slots + first, sum, sizeof sum);
        memcpy(sumsq_slots + first, sumsq, sizeof sumsq);
    }
    *sum_out = fastln_reduce_slots(sum_slots);
    *sumsq_out = fastln_reduce_slots(sumsq_slots);
}

/* ---- GroupNorm: a (sample, group) -----------------------------------------------------------
 * Channels first, a group is a contiguous run of n values (fastln/group_norm.h): its pieces are
 * summed as LayerNorm sums a row (float32-compute types in float runs around the mean of the
 * run's first block, float64 in double around the run's first value); channels last, its
 * blocks are summed in float runs (below) for the float32-compute types, and with BatchNorm's
 * bn_stats_rows (entries.h) for float64. */

/* The shift of a channels-first run of n values: the one LayerNorm's first try takes for it. */
FASTLN_INLINE double FASTLN_NAME(gn_shift)(const FASTLN_T *x, int64_t n)
{
#if FASTLN_COMPUTE_F32
    return (double)FASTLN_NAME(ln_float_shift)(x, n);
#else
    (void)n;
    return FASTLN_NAME(to_double)(x[0]);
#endif
}

/* sum(d) and sum(d * d), d = x - gn_shift(run), of each piece of `piece` values of a run of n
 * values, into sums[2 * p] and sums[2 * p + 1] for pieces [first, last). */
FASTLN_INLINE void FASTLN_NAME(gn_piece_sums)(const FASTLN_T *x, int64_t n, int64_t piece,
                                              int64_t first, int64_t last, double *sums)
{
    const double shift = FASTLN_NAME(gn_shift)(x, n);
    for (int64_t p = first; p < last; p++) {
        const int64_t length = fastln_min(piece, n - p * piece);
#if FASTLN_COMPUTE_F32
        FASTLN_NAME(ln_float_sums)(x + p * piece, length, (float)shift, &sums[2 * p],
                                   &sums[2 * p + 1]);
#else
        FASTLN_NAME(ln_sums)(x + p * piece, length, shift, &sums[2 * p], &sums[2 * p + 1]);
#endif
    }
}

/* The statistics of a channels-first group of n values from its pieces' sums (added in piece
 * order); the groups those cannot take (ln_float_statistics_from_sums, or for float64
 * fastln_gn_statistics_from_sums) are taken again as a LayerNorm row. A group of one piece gets
 * exactly the statistics of that row. */
FASTLN_INLINE void FASTLN_NAME(gn_run_statistics)(const FASTLN_T *x, int64_t n,
                                                  const double *sums, int64_t n_pieces,
                                                  double eps, fastln_ln_stats *stats)
{
    double sum = 0.0, sumsq = 0.0;
    for (int64_t p = 0; p < n_pieces; p++) {
        sum += sums[2 * p];
        sumsq += sums[2 * p + 1];
    }
    const double shift = FASTLN_NAME(gn_shift)(x, n);
#if FASTLN_COMPUTE_F32
    if (!FASTLN_NAME(ln_float_statistics_from_sums)((float)shift, sum, sumsq, (double)n, eps,
                                                    stats))
#else
    if (!fastln_gn_statistics_from_sums(shift, sum, sumsq, (double)n, eps, stats))
#endif
        FASTLN_NAME(ln_statistics)(x, n, eps, stats);
}

#if FASTLN_COMPUTE_F32
/* ---- GroupNorm channels last, the float32-compute types ------------------------------------
 * A block (fastln/group_norm.h) sums each channel down its rows in float runs of
 * FASTLN_GN_FLOAT_RUN rows around its group's block shift, each run's float partial added to
 * the channel's double sum; the groups' statistics then come from the blocks' sums
 * (fastln_gn_float_block_statistics, fastln/group_norm.h). A run's partial holds at most FASTLN_GN_FLOAT_RUN terms, whatever
 * the group's size or offset. */

/* A float near each group's mean over a block of n_rows rows of C channels, into shift[c] for
 * every channel of the group: the mean, in double, of the group's values in the block's first
 * k rows (k * per_group >= FASTLN_SLOTS where the block has the rows): rows the sums read next,
 * where rows spread over the block would each come from memory alone. A block whose mean is
 * far from its first rows is summed again (gn_float_block). */
FASTLN_INLINE void FASTLN_NAME(gn_block_shifts)(const FASTLN_T *x, int64_t n_rows, int64_t C,
                                                int64_t per_group, double *shift)
{
    const int64_t k_rows = fastln_min((FASTLN_SLOTS + per_group - 1) / per_group, n_rows);
    for (int64_t c = 0; c < C; c++) shift[c] = 0.0;
    for (int64_t k = 0; k < k_rows; k++) {
        const FASTLN_T *row = x + k * C;
        for (int64_t c = 0; c < C; c++) shift[c] += FASTLN_NAME(to_double)(row[c]);
    }
    for (int64_t first = 0; first < C; first += per_group) {
        double total = 0.0;
        for (int64_t c = first; c < first + per_group; c++) total += shift[c];
        const float mean = (float)(total / (double)(k_rows * per_group));
        for (int64_t c = first; c < first + per_group; c++) shift[c] = (double)mean;
    }
}

/* One float run (n_rows <= FASTLN_GN_FLOAT_RUN rows) of n_vectors float vectors' worth of
 * channels from c on, added to (first_run: stored in) the channels' double sums. */
FASTLN_INLINE void FASTLN_NAME(gn_float_run_chunk)(
    const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows, int64_t row_stride, int64_t c,
    const int n_vectors, const double *FASTLN_RESTRICT shift, double *FASTLN_RESTRICT sum,
    double *FASTLN_RESTRICT sumsq, int first_run)
{
    float shift_f[4 * FASTLN_VF_LANES];
    for (int k = 0; k < n_vectors * FASTLN_VF_LANES; k++) shift_f[k] = (float)shift[c + k];
    FASTLN_VF sh[4], s[4] = {0}, q[4] = {0};
    FASTLN_UNROLL
    for (int j = 0; j < n_vectors; j++) sh[j] = FASTLN_ISA(load_f32)(shift_f + j * FASTLN_VF_LANES);
    for (int64_t r = 0; r < n_rows; r++) {
        FASTLN_UNROLL
        for (int j = 0; j < n_vectors; j++) {
            const FASTLN_T *at = x + r * row_stride + c + j * FASTLN_VF_LANES;
            /* read down the rows, the chunks leave the hardware's prefetchers behind */
            if (j * FASTLN_VF_LANES * (int)sizeof(FASTLN_T) % 64 == 0)
                FASTLN_PREFETCH_RUNS_AHEAD(at, FASTLN_GN_FLOAT_RUN, row_stride);
            const FASTLN_VF d = FASTLN_NAME(load_c)(at) - sh[j];
            s[j] += d;
            q[j] += d * d;
        }
    }
    FASTLN_UNROLL
    for (int j = 0; j < n_vectors; j++) {
        const int64_t at = c + j * FASTLN_VF_LANES;
        FASTLN_VD s_low = FASTLN_ISA(widen_low)(s[j]), s_high = FASTLN_ISA(widen_high)(s[j]);
        FASTLN_VD q_low = FASTLN_ISA(widen_low)(q[j]), q_high = FASTLN_ISA(widen_high)(q[j]);
        if (!first_run) {
            s_low += FASTLN_ISA(load_f64)(sum + at);
            s_high += FASTLN_ISA(load_f64)(sum + at + FASTLN_VD_LANES);
            q_low += FASTLN_ISA(load_f64)(sumsq + at);
            q_high += FASTLN_ISA(load_f64)(sumsq + at + FASTLN_VD_LANES);
        }
        FASTLN_ISA(store_f64)(sum + at, s_low);
        FASTLN_ISA(store_f64)(sum + at + FASTLN_VD_LANES, s_high);
        FASTLN_ISA(store_f64)(sumsq + at, q_low);
        FASTLN_ISA(store_f64)(sumsq + at + FASTLN_VD_LANES, q_high);
    }
}

/* The vectors of a chunk: two cache lines of each row (at most four vectors, which with their
 * shifts and sums fit 16 registers). Narrower chunks mean fewer rows' lines in flight at once. */
#define FASTLN_GN_CHUNK_VECTORS                                                                 \
    (128 / (FASTLN_VF_LANES * (int)sizeof(FASTLN_T)) < 4                                        \
         ? 128 / (FASTLN_VF_LANES * (int)sizeof(FASTLN_T))                                      \
         : 4)

/* sum[c] and sumsq[c] (stored, not added to) of d = x[r, c] - shift[c] in float, over a block
 * of n_rows rows of C channels, in float runs of FASTLN_GN_FLOAT_RUN rows. Channels never mix:
 * the vector width and the chunks change nothing. */
FASTLN_OUTLINED void FASTLN_NAME(gn_float_block_sums)(
    const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows, int64_t C,
    const double *FASTLN_RESTRICT shift, double *FASTLN_RESTRICT sum,
    double *FASTLN_RESTRICT sumsq)
{
    for (int64_t first = 0; first < n_rows; first += FASTLN_GN_FLOAT_RUN) {
        const FASTLN_T *rows = x + first * C;
        const int64_t n = fastln_min(FASTLN_GN_FLOAT_RUN, n_rows - first);
        int64_t c = 0;
        for (; c + FASTLN_GN_CHUNK_VECTORS * FASTLN_VF_LANES <= C;
             c += FASTLN_GN_CHUNK_VECTORS * FASTLN_VF_LANES)
            FASTLN_NAME(gn_float_run_chunk)(rows, n, C, c, FASTLN_GN_CHUNK_VECTORS, shift, sum,
                                            sumsq, first == 0);
        for (; c + FASTLN_VF_LANES <= C; c += FASTLN_VF_LANES)
            FASTLN_NAME(gn_float_run_chunk)(rows, n, C, c, 1, shift, sum, sumsq, first == 0);
        for (; c < C; c++) {
            const float sh = (float)shift[c];
            float s = 0.0f, q = 0.0f;
            for (int64_t r = 0; r < n; r++) {
                const float d = FASTLN_NAME(to_compute)(rows[r * C + c]) - sh;
                s += d;
                q += d * d;
            }
            sum[c] = first == 0 ? (double)s : sum[c] + (double)s;
            sumsq[c] = first == 0 ? (double)q : sumsq[c] + (double)q;
        }
    }
}
#undef FASTLN_GN_CHUNK_VECTORS

/* A block's sums of d = x - shift: each group's, over its channels in channel order. For every
 * group whose sums do not hold (fastln_gn_block_holds), the block is summed once more with that
 * group's shift moved to float(shift + mean(d)). */
FASTLN_INLINE void FASTLN_NAME(gn_float_block)(const FASTLN_T *x, int64_t n_rows, int64_t C,
                                               int64_t per_group, double *shift, double *sum,
                                               double *sumsq)
{
    FASTLN_NAME(gn_block_shifts)(x, n_rows, C, per_group, shift);
    FASTLN_NAME(gn_float_block_sums)(x, n_rows, C, shift, sum, sumsq);
    const double n = (double)(n_rows * per_group);
    int again = 0;
    for (int64_t first = 0; first < C; first += per_group) {
        double group_sum = 0.0, group_sumsq = 0.0;
        for (int64_t c = first; c < first + per_group; c++) {
            group_sum += sum[c];
            group_sumsq += sumsq[c];
        }
        if (!isfinite(group_sum) || !(group_sumsq < INFINITY)
            || fastln_gn_block_holds(group_sum, group_sumsq, n))
            continue;
        const float moved = (float)(shift[first] + group_sum / n);
        for (int64_t c = first; c < first + per_group; c++) shift[c] = (double)moved;
        again = 1;
    }
    if (again) FASTLN_NAME(gn_float_block_sums)(x, n_rows, C, shift, sum, sumsq);
}

#endif
