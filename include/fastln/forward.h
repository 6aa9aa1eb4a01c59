/* Forward write passes and row kernels (LayerNorm, RMSNorm, residual add + norm) for one storage
 * type (fastln/storage.h). No include guard on purpose.
 *
 * The write passes are elementwise: they go cache line by cache line (FASTLN_STEP elements, and
 * for the rows of prefetch_next_row one prefetch of the next row's line each), and do the
 * elements after the last whole step one at a time with each lane's arithmetic, which rounds
 * exactly as the vector lanes do. y may be x itself (in place): each element is read before it
 * is written. */

/* Prefetch the lines of one step of the next row (rows are contiguous): the next statistics
 * pass then finds it in cache. */
FASTLN_INLINE void FASTLN_NAME(prefetch_step)(const FASTLN_T *p)
{
    FASTLN_UNROLL
    for (int64_t k = 0; k < FASTLN_STEP; k += FASTLN_LINE) __builtin_prefetch(p + k, 0, 3);
}

/* Whether the forward's write pass over a row of n elements prefetches the next row: only for
 * rows from memory (y streams) of at most FASTLN_PREFETCH_ROW_BYTES. Rows in cache came faster
 * without it, and so did longer rows, whose successor does not fit L1 beside them
 * (docs/performance.md, "The forward's prefetch"). */
FASTLN_INLINE int FASTLN_NAME(prefetch_next_row)(int64_t n, int streaming)
{
    return streaming && n * (int64_t)sizeof(FASTLN_T) <= FASTLN_PREFETCH_ROW_BYTES;
}

/* ---- LayerNorm -------------------------------------------------------------------------- */

/* y = gamma * x_hat + beta for the VF_LANES elements at i, in double:
 * x_hat = ((x - shift) - mean_shifted) * rstd. */
FASTLN_INLINE void FASTLN_NAME(ln_write_double_vector)(
    const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *beta, FASTLN_T *y, int64_t i,
    double shift, double mean_shifted, double rstd, int streaming)
{
    FASTLN_VD low, high, scale_low, scale_high;
    FASTLN_NAME(load_wide)(x + i, &low, &high);
    low = ((low - shift) - mean_shifted) * rstd;
    high = ((high - shift) - mean_shifted) * rstd;
    if (gamma) {
        FASTLN_NAME(load_wide_p)(gamma + i, &scale_low, &scale_high);
        low *= scale_low;
        high *= scale_high;
    }
    if (beta) {
        FASTLN_NAME(load_wide_p)(beta + i, &scale_low, &scale_high);
        low += scale_low;
        high += scale_high;
    }
    FASTLN_NAME(store_wide_to)(y + i, low, high, streaming);
}

/* y = gamma * x_hat + beta over n elements (a row, or a piece of it), all in double. The float64
 * pass, and the float32-compute types' pass for rows whose rstd does not fit a float. */
FASTLN_OUTLINED void FASTLN_NAME(ln_write_double)(
    const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *beta, FASTLN_T *y, int64_t n,
    double shift, double mean_shifted, double rstd, const int streaming)
{
    const int prefetch = FASTLN_NAME(prefetch_next_row)(n, streaming);
    int64_t i = 0;
    for (; i + FASTLN_STEP <= n; i += FASTLN_STEP) {
        if (prefetch) FASTLN_NAME(prefetch_step)(x + n + i);
        FASTLN_UNROLL
        for (int64_t v = i; v < i + FASTLN_STEP; v += FASTLN_VF_LANES)
            FASTLN_NAME(ln_write_double_vector)(x, gamma, beta, y, v, shift, mean_shifted, rstd,
                                                streaming);
    }
    for (; i + FASTLN_VF_LANES <= n; i += FASTLN_VF_LANES)
        FASTLN_NAME(ln_write_double_vector)(x, gamma, beta, y, i, shift, mean_shifted, rstd,
                                            streaming);
    /* float64 rows stream without shared lines and fence each row: the float32-compute rows'
     * scheme (one fence per task) measured slower for them (docs/performance.md). */
    if (streaming && !FASTLN_COMPUTE_F32) fastln_streaming_fence();
    for (; i < n; i++) {
        double out = ((FASTLN_NAME(to_double)(x[i]) - shift) - mean_shifted) * rstd;
        if (gamma) out *= (double)gamma[i];
        if (beta) out += (double)beta[i];
        y[i] = FASTLN_NAME(from_double)(out);
    }
}

#if FASTLN_COMPUTE_F32
/* The same in float32 for the VF_LANES elements at i: x_hat = ((x - head) - tail) * rstd. */
FASTLN_INLINE void FASTLN_NAME(ln_write_float_vector)(
    const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *beta, FASTLN_T *y, int64_t i,
    float mean_head, float mean_tail, float rstd, int streaming)
{
    FASTLN_VF out = ((FASTLN_NAME(load_c)(x + i) - mean_head) - mean_tail) * rstd;
    if (gamma) out *= FASTLN_NAME(load_p)(gamma + i);
    if (beta) out += FASTLN_NAME(load_p)(beta + i);
    FASTLN_NAME(store_c_to)(y + i, out, streaming);
}

/* The float32 pass: twice the lanes of the double pass and no conversions. The centring keeps
 * its precision by splitting the mean into a float head and tail: x - head is exact whenever x
 * is within a factor of two of the mean (the large-offset case), and otherwise rounds once
 * relative to a difference as large as x itself, so x_hat is within about two float32 ulps of
 * the double computation. */
FASTLN_OUTLINED void FASTLN_NAME(ln_write_float)(
    const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *beta, FASTLN_T *y, int64_t n,
    float mean_head, float mean_tail, float rstd, const int streaming)
{
    const int prefetch = FASTLN_NAME(prefetch_next_row)(n, streaming);
    int64_t i = 0;
    for (; i + FASTLN_STEP <= n; i += FASTLN_STEP) {
        if (prefetch) FASTLN_NAME(prefetch_step)(x + n + i);
        FASTLN_UNROLL
        for (int64_t v = i; v < i + FASTLN_STEP; v += FASTLN_VF_LANES)
            FASTLN_NAME(ln_write_float_vector)(x, gamma, beta, y, v, mean_head, mean_tail, rstd,
                                               streaming);
    }
    for (; i + FASTLN_VF_LANES <= n; i += FASTLN_VF_LANES)
        FASTLN_NAME(ln_write_float_vector)(x, gamma, beta, y, i, mean_head, mean_tail, rstd,
                                           streaming);
#if FASTLN_MASKED
    /* The last elements (and the few before y's first line, a call of their own) in one masked
     * vector instead of one at a time: each lane's arithmetic is the element's, so the bits are
     * the same (docs/performance.md, "A row's last columns in one masked vector"). */
    if (i < n) {
        const int64_t left = n - i;
        FASTLN_VF out =
            ((FASTLN_NAME(load_c_first)(x + i, left) - mean_head) - mean_tail) * rstd;
        if (gamma) out *= FASTLN_ISA(load_f32_first)(gamma + i, left);
        if (beta) out += FASTLN_ISA(load_f32_first)(beta + i, left);
        FASTLN_NAME(store_c_first)(y + i, out, left);
        return;
    }
#endif
    for (; i < n; i++) {
        float out = ((FASTLN_NAME(to_compute)(x[i]) - mean_head) - mean_tail) * rstd;
        if (gamma) out *= gamma[i];
        if (beta) out += beta[i];
        y[i] = FASTLN_NAME(from_compute)(out);
    }
}
#endif

/* The write pass over n elements: x_hat = ((x - shift) - mean_shifted) * rstd. float64 rows and
 * rows whose rstd does not fit a float32 (eps = 0 with subnormal spreads; the 0 of a constant
 * row) are written in double, the others in float. With streaming set (and y aligned), y goes out
 * with non-temporal stores. */
FASTLN_INLINE void FASTLN_NAME(ln_write)(
    const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *beta, FASTLN_T *y, int64_t n,
    double shift, double mean_shifted, double rstd, int streaming)
{
    const int stream_y = streaming && fastln_is_aligned16(y);
#if FASTLN_COMPUTE_F32
    if (fastln_scale_fits_float(rstd)) {
        const double mean = shift + mean_shifted;
        const float mean_head = (float)mean;
        const float mean_tail = (float)((shift - (double)mean_head) + mean_shifted);
        if (stream_y)
            FASTLN_NAME(ln_write_float)(x, gamma, beta, y, n, mean_head, mean_tail, (float)rstd, 1);
        else
            FASTLN_NAME(ln_write_float)(x, gamma, beta, y, n, mean_head, mean_tail, (float)rstd, 0);
        return;
    }
    FASTLN_NAME(ln_write_double)(x, gamma, beta, y, n, shift, mean_shifted, rstd, 0);
#else
    if (stream_y)
        FASTLN_NAME(ln_write_double)(x, gamma, beta, y, n, shift, mean_shifted, rstd, 1);
    else
        FASTLN_NAME(ln_write_double)(x, gamma, beta, y, n, shift, mean_shifted, rstd, 0);
#endif
}

/* The second pass of layer_norm_forward_row: y from the row's statistics. streamed: NULL for
 * plain stores, else the line this row shares with the previous one (fastln_shared_line), the
 * row's whole lines then going out with non-temporal stores. */
FASTLN_INLINE void FASTLN_NAME(layer_norm_write_row)(
    const FASTLN_T *x, const FASTLN_P *FASTLN_RESTRICT gamma,
    const FASTLN_P *FASTLN_RESTRICT beta, FASTLN_T *y, int64_t n_cols, double eps,
    const fastln_ln_stats *stats, fastln_shared_line *streamed, int next_row_follows)
{
    if (stats->rare) {
        if (streamed) fastln_shared_line_put(streamed);
        FASTLN_NAME(ln_write_rescaled)(x, gamma, beta, y, n_cols, stats);
        return;
    }
    /* A constant row with eps = 0: every centred value is exactly 0 and x_hat is defined as 0
     * (y = beta), not 0 * inf = NaN. The cache still reports rstd = inf. */
    const double x_hat_scale = stats->var + eps == 0.0 ? 0.0 : stats->rstd;
    /* The elements up to y's next cache line first, then whole-line stores. */
    const fastln_row_parts parts =
        fastln_row_parts_of(streamed, y, sizeof(FASTLN_T), n_cols, next_row_follows);
    if (parts.head > 0)
        FASTLN_NAME(ln_write)(x, gamma, beta, parts.head_to, parts.head, stats->shift,
                              stats->mean_shifted, x_hat_scale, 0);
    fastln_row_head_written(streamed, &parts);
    int64_t i = parts.head;
    FASTLN_NAME(ln_write)(x + i, gamma ? gamma + i : NULL, beta ? beta + i : NULL, y + i,
                          parts.body, stats->shift, stats->mean_shifted, x_hat_scale,
                          parts.stream_body);
    i += parts.body;
    if (parts.tail > 0)
        FASTLN_NAME(ln_write)(x + i, gamma ? gamma + i : NULL, beta ? beta + i : NULL,
                              parts.tail_to, parts.tail, stats->shift, stats->mean_shifted,
                              x_hat_scale, 0);
    fastln_row_tail_written(streamed, &parts, y, sizeof(FASTLN_T));
}

/* Forward of one row of n_cols elements: the statistics (ln_statistics) from one read of the
 * row, then y is written in a second pass while the row is still in cache, centring as
 * (x - shift) - mean(d) so that the large offset never meets the small deviations in one
 * rounding. gamma and beta may be NULL (ones and zeros). *mean_out and *rstd_out receive the
 * row's statistics; an rstd beyond double's range (eps = 0 and a spread below ~1e-308) is
 * reported as Inf, its honest float64 value, and the backward then takes the statistics again
 * from x. */
FASTLN_INLINE void FASTLN_NAME(layer_norm_forward_row)(
    const FASTLN_T *x, const FASTLN_P *FASTLN_RESTRICT gamma,
    const FASTLN_P *FASTLN_RESTRICT beta, FASTLN_T *y, int64_t n_cols, double eps,
    double *mean_out, double *rstd_out)
{
    fastln_ln_stats stats;
    FASTLN_NAME(ln_statistics)(x, n_cols, eps, &stats);
    *mean_out = stats.mean;
    *rstd_out = stats.rstd;
    FASTLN_NAME(layer_norm_write_row)(x, gamma, beta, y, n_cols, eps, &stats, NULL, 0);
}

/* ---- RMSNorm ---------------------------------------------------------------------------- */

/* y = gamma * (x * x_scale) for the VF_LANES elements at i, in double. */
FASTLN_INLINE void FASTLN_NAME(rms_write_double_vector)(const FASTLN_T *x, const FASTLN_P *gamma,
                                                        FASTLN_T *y, int64_t i, double x_scale,
                                                        int streaming)
{
    FASTLN_VD low, high, scale_low, scale_high;
    FASTLN_NAME(load_wide)(x + i, &low, &high);
    low *= x_scale;
    high *= x_scale;
    if (gamma) {
        FASTLN_NAME(load_wide_p)(gamma + i, &scale_low, &scale_high);
        low *= scale_low;
        high *= scale_high;
    }
    FASTLN_NAME(store_wide_to)(y + i, low, high, streaming);
}

/* y = gamma * (x * x_scale) over n elements, all in double. */
FASTLN_OUTLINED void FASTLN_NAME(rms_write_double)(const FASTLN_T *x, const FASTLN_P *gamma,
                                                 FASTLN_T *y, int64_t n, double x_scale,
                                                 int streaming)
{
    const int prefetch = FASTLN_NAME(prefetch_next_row)(n, streaming);
    int64_t i = 0;
    for (; i + FASTLN_STEP <= n; i += FASTLN_STEP) {
        if (prefetch) FASTLN_NAME(prefetch_step)(x + n + i);
        FASTLN_UNROLL
        for (int64_t v = i; v < i + FASTLN_STEP; v += FASTLN_VF_LANES)
            FASTLN_NAME(rms_write_double_vector)(x, gamma, y, v, x_scale, streaming);
    }
    for (; i + FASTLN_VF_LANES <= n; i += FASTLN_VF_LANES)
        FASTLN_NAME(rms_write_double_vector)(x, gamma, y, i, x_scale, streaming);
    if (streaming && !FASTLN_COMPUTE_F32) fastln_streaming_fence(); /* as ln_write_double */
    for (; i < n; i++) {
        double out = FASTLN_NAME(to_double)(x[i]) * x_scale;
        if (gamma) out *= (double)gamma[i];
        y[i] = FASTLN_NAME(from_double)(out);
    }
}

#if FASTLN_COMPUTE_F32
/* y = (x * rstd) * gamma for the VF_LANES elements at i, in float. */
FASTLN_INLINE void FASTLN_NAME(rms_write_float_vector)(const FASTLN_T *x, const FASTLN_P *gamma,
                                                       FASTLN_T *y, int64_t i, float rstd,
                                                       int streaming)
{
    FASTLN_VF out = FASTLN_NAME(load_c)(x + i) * rstd;
    if (gamma) out *= FASTLN_NAME(load_p)(gamma + i);
    FASTLN_NAME(store_c_to)(y + i, out, streaming);
}
#endif

/* y = (x * rstd) * gamma over n elements. float32-compute rows go in float (rstd rounded to
 * float: three roundings of u32 each, for twice the lanes; there is no centring to lose digits
 * in), unless x_scale does not fit a float (0 for an all-zero row with eps = 0, NaN, beyond
 * 1e30); float64 rows and those in double. With streaming set (and y aligned), y goes out with
 * non-temporal stores. */
FASTLN_OUTLINED void FASTLN_NAME(rms_write)(const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *y,
                                          int64_t n, double x_scale, int streaming)
{
    streaming = streaming && fastln_is_aligned16(y);
#if FASTLN_COMPUTE_F32
    if (fastln_scale_fits_float(x_scale)) {
        const float rstd = (float)x_scale;
        const int prefetch = FASTLN_NAME(prefetch_next_row)(n, streaming);
        int64_t i = 0;
        for (; i + FASTLN_STEP <= n; i += FASTLN_STEP) {
            if (prefetch) FASTLN_NAME(prefetch_step)(x + n + i);
            FASTLN_UNROLL
            for (int64_t v = i; v < i + FASTLN_STEP; v += FASTLN_VF_LANES)
                FASTLN_NAME(rms_write_float_vector)(x, gamma, y, v, rstd, streaming);
        }
        for (; i + FASTLN_VF_LANES <= n; i += FASTLN_VF_LANES)
            FASTLN_NAME(rms_write_float_vector)(x, gamma, y, i, rstd, streaming);
#if FASTLN_MASKED
        /* The last elements in one masked vector, as ln_write_float. */
        if (i < n) {
            const int64_t left = n - i;
            FASTLN_VF out = FASTLN_NAME(load_c_first)(x + i, left) * rstd;
            if (gamma) out *= FASTLN_ISA(load_f32_first)(gamma + i, left);
            FASTLN_NAME(store_c_first)(y + i, out, left);
            return;
        }
#endif
        for (; i < n; i++) {
            float out = FASTLN_NAME(to_compute)(x[i]) * rstd;
            if (gamma) out *= gamma[i];
            y[i] = FASTLN_NAME(from_compute)(out);
        }
        return;
    }
#endif
    FASTLN_NAME(rms_write_double)(x, gamma, y, n, x_scale, streaming);
}

/* Forward of one row: one read for the sum of squares, then y is written in a second pass while
 * the row is still in cache. gamma may be NULL (ones). *rstd_out receives the row's
 * 1 / sqrt(mean(x * x) + eps). streamed and next_row_follows as for layer_norm_write_row. */
FASTLN_INLINE void FASTLN_NAME(rms_norm_forward_row)(
    const FASTLN_T *x, const FASTLN_P *FASTLN_RESTRICT gamma, FASTLN_T *y, int64_t n_cols,
    double eps, double *rstd_out, fastln_shared_line *streamed, int next_row_follows)
{
    const double rstd = FASTLN_NAME(rms_row_rstd)(x, n_cols, eps);
    *rstd_out = rstd;
    if (isinf(rstd)) {
        /* Beyond double's range (reported as Inf, its honest float64 value: the backward then
         * takes rstd again from x), or an all-zero row with eps = 0. Rare. */
        int exponent;
        const double rstd_scaled = FASTLN_NAME(rms_rescaled_rstd)(x, n_cols, eps, &exponent);
        if (!isinf(rstd_scaled)) {
            if (streamed) fastln_shared_line_put(streamed);
            FASTLN_NAME(rms_write_rescaled)(x, gamma, y, n_cols, exponent, rstd_scaled);
            return;
        }
    }
    /* rstd = Inf here only for an all-zero row with eps = 0 (fastln_rms_x_scale: x_hat = 0). */
    const double x_scale = fastln_rms_x_scale(rstd);
    const fastln_row_parts parts =
        fastln_row_parts_of(streamed, y, sizeof(FASTLN_T), n_cols, next_row_follows);
    FASTLN_NAME(rms_write)(x, gamma, parts.head_to, parts.head, x_scale, 0);
    fastln_row_head_written(streamed, &parts);
    int64_t i = parts.head;
    FASTLN_NAME(rms_write)(x + i, gamma ? gamma + i : NULL, y + i, parts.body, x_scale,
                           parts.stream_body);
    i += parts.body;
    if (parts.tail > 0)
        FASTLN_NAME(rms_write)(x + i, gamma ? gamma + i : NULL, parts.tail_to, parts.tail,
                               x_scale, 0);
    fastln_row_tail_written(streamed, &parts, y, sizeof(FASTLN_T));
}

/* ---- residual add + norm ---------------------------------------------------------------- */

/* How many of a row's first columns the write passes take before whole-line stores
 * (fastln_elements_to_line; fastln_rows_head for rows written together): a store that straddles
 * two lines costs two. Only where a float32 or float64 vector is a whole line (AVX-512). A
 * half-format vector is half a line, and an AVX2 head is written partly one element at a time:
 * there the head cost more than the straddling stores it saved (docs/performance.md). */
FASTLN_INLINE int64_t FASTLN_NAME(line_head)(const FASTLN_T *y, int64_t n, int together)
{
#if (FASTLN_STORAGE == FASTLN_FLOAT32 || FASTLN_STORAGE == FASTLN_FLOAT64) && FASTLN_MASKED
    return together ? fastln_rows_head(y, sizeof(FASTLN_T), n)
                    : fastln_elements_to_line(y, sizeof(FASTLN_T), n);
#else
    (void)y, (void)n, (void)together;
    return 0;
#endif
}

/* line_head for a row written alone, plainly or with non-temporal stores: a streamed row always
 * takes its columns up to its first whole line first, so that no streamed vector straddles two
 * lines (docs/performance.md, "Streamed rows from their first whole line"). */
FASTLN_INLINE int64_t FASTLN_NAME(row_head)(const FASTLN_T *y, int64_t n, int streaming)
{
    return streaming ? fastln_elements_to_line(y, sizeof(FASTLN_T), n)
                     : FASTLN_NAME(line_head)(y, n, 0);
}

/* s = x + residual (+ bias) over n_cols values of a row, in double and rounded once (to float32
 * and then to the half format for the half types, as NumPy's float16 addition rounds: exactly
 * NumPy's x + residual without bias). s may be x or residual itself: each element is read before
 * it is written. bias may be NULL. */
FASTLN_INLINE void FASTLN_NAME(add_span)(const FASTLN_T *x, const FASTLN_T *residual,
                                        const FASTLN_P *bias, FASTLN_T *s, int64_t n_cols,
                                        int in_float)
{
    int64_t i = 0;
#if FASTLN_COMPUTE_F32
    /* Without bias, the sum in float has the same bits: the double sum of two floats rounded to
     * float is their float sum (53 >= 2 * 24 + 2 bits: the double rounding is innocuous), and for
     * the half formats the double sum is exact. in_float (call->add_in_float) says whether the
     * call takes it: always for the half formats, for float32 only in cache (with rows from L3
     * the double loop came out faster: docs/performance.md, "The residual add in float"). */
    if (!bias && in_float) {
        for (; i + FASTLN_VF_LANES <= n_cols; i += FASTLN_VF_LANES)
            FASTLN_NAME(store_c)(s + i, FASTLN_NAME(load_c)(x + i)
                                            + FASTLN_NAME(load_c)(residual + i));
        for (; i < n_cols; i++)
            s[i] = FASTLN_NAME(from_compute)(FASTLN_NAME(to_compute)(x[i])
                                             + FASTLN_NAME(to_compute)(residual[i]));
        return;
    }
#else
    (void)in_float;
#endif
    for (; i + FASTLN_VF_LANES <= n_cols; i += FASTLN_VF_LANES) {
        FASTLN_VD x_low, x_high, r_low, r_high;
        FASTLN_NAME(load_wide)(x + i, &x_low, &x_high);
        FASTLN_NAME(load_wide)(residual + i, &r_low, &r_high);
        x_low += r_low;
        x_high += r_high;
        if (bias) {
            FASTLN_NAME(load_wide_p)(bias + i, &r_low, &r_high);
            x_low += r_low;
            x_high += r_high;
        }
        FASTLN_NAME(store_wide)(s + i, x_low, x_high);
    }
    for (; i < n_cols; i++) {
        double sum = FASTLN_NAME(to_double)(x[i]) + FASTLN_NAME(to_double)(residual[i]);
        if (bias) sum += (double)bias[i];
        s[i] = FASTLN_NAME(from_double)(sum);
    }
}

/* add_span over the row's columns up to s's next cache line, then over the rest with
 * whole-line stores (line_head; s is usually x's or the residual's offset, so their loads
 * align too). */
FASTLN_OUTLINED void FASTLN_NAME(add_row)(const FASTLN_T *x, const FASTLN_T *residual,
                                        const FASTLN_P *bias, FASTLN_T *s, int64_t n_cols,
                                        int in_float)
{
    const int64_t head = FASTLN_NAME(line_head)(s, n_cols, 0);
    if (head > 0) FASTLN_NAME(add_span)(x, residual, bias, s, head, in_float);
    FASTLN_NAME(add_span)(x + head, residual + head, bias ? bias + head : NULL, s + head,
                          n_cols - head, in_float);
}

/* ---- BatchNorm: y = ((x - shift) - center) * scale + offset ----------------------------- */

/* One element in double (the rows' and segments' tails, and the float apply's fallback). */
FASTLN_INLINE FASTLN_T FASTLN_NAME(bn_apply1_double)(FASTLN_T x, double shift, double center,
                                                     double scale, double offset)
{
    return FASTLN_NAME(from_double)(((FASTLN_NAME(to_double)(x) - shift) - center) * scale
                                    + offset);
}

/* Columns [c, end) of n_rows rows (n values from one row to the next) in double, a vector of
 * columns at a time with its constants loaded once for all the rows (as the float apply's
 * bn_apply_float_block). Features never mix, so the vector width changes nothing. */
FASTLN_INLINE void FASTLN_NAME(bn_apply_double_block)(
    const FASTLN_T *x, FASTLN_T *y, int64_t n, int64_t c, const int64_t end, const int n_rows,
    const double *shift, const double *center, const double *scale, const double *offset)
{
    for (; c + FASTLN_VF_LANES <= end; c += FASTLN_VF_LANES) {
        FASTLN_VD shift_v[2], center_v[2], scale_v[2], offset_v[2];
        FASTLN_UNROLL
        for (int h = 0; h < 2; h++) {
            const int64_t at = c + h * FASTLN_VD_LANES;
            shift_v[h] = FASTLN_ISA(load_f64)(shift + at);
            center_v[h] = FASTLN_ISA(load_f64)(center + at);
            scale_v[h] = FASTLN_ISA(load_f64)(scale + at);
            offset_v[h] = FASTLN_ISA(load_f64)(offset + at);
        }
        FASTLN_UNROLL
        for (int r = 0; r < n_rows; r++) {
            FASTLN_VD value[2];
            FASTLN_NAME(load_wide)(x + r * n + c, &value[0], &value[1]);
            FASTLN_UNROLL
            for (int h = 0; h < 2; h++)
                value[h] = ((value[h] - shift_v[h]) - center_v[h]) * scale_v[h] + offset_v[h];
            FASTLN_NAME(store_wide)(y + r * n + c, value[0], value[1]);
        }
    }
    for (; c < end; c++)
        for (int r = 0; r < n_rows; r++)
            y[r * n + c] = FASTLN_NAME(bn_apply1_double)(x[r * n + c], shift[c], center[c],
                                                         scale[c], offset[c]);
}

/* Rows layout in double, n_rows rows of n_features values; the four constants are per-feature
 * arrays. store: FASTLN_ROWS_GROUPED takes FASTLN_BN_APPLY_GROUP rows per load of the
 * constants, else rows one at a time (never streamed); each row's columns up to y's next line
 * first (line_head). */
FASTLN_OUTLINED void FASTLN_NAME(bn_apply_rows)(
    const FASTLN_T *x, FASTLN_T *y, int64_t n_rows, int64_t n_features,
    const double *FASTLN_RESTRICT shift, const double *FASTLN_RESTRICT center,
    const double *FASTLN_RESTRICT scale, const double *FASTLN_RESTRICT offset, int store)
{
    const int64_t n = n_features;
    int64_t r = 0;
    if (store == FASTLN_ROWS_GROUPED) {
        const int64_t head = FASTLN_NAME(line_head)(y, n, 1);
        for (; r + FASTLN_BN_APPLY_GROUP <= n_rows; r += FASTLN_BN_APPLY_GROUP) {
            FASTLN_NAME(bn_apply_double_block)(x + r * n, y + r * n, n, 0, head,
                                               FASTLN_BN_APPLY_GROUP, shift, center, scale,
                                               offset);
            FASTLN_NAME(bn_apply_double_block)(x + r * n, y + r * n, n, head, n,
                                               FASTLN_BN_APPLY_GROUP, shift, center, scale,
                                               offset);
        }
    }
    for (; r < n_rows; r++) {
        const int64_t head = FASTLN_NAME(line_head)(y + r * n, n, 0);
        FASTLN_NAME(bn_apply_double_block)(x + r * n, y + r * n, n, 0, head, 1, shift, center,
                                           scale, offset);
        FASTLN_NAME(bn_apply_double_block)(x + r * n, y + r * n, n, head, n, 1, shift, center,
                                           scale, offset);
    }
}

#if FASTLN_COMPUTE_F32
/* One element of the float apply: the float result when it is finite, else the double one. */
FASTLN_INLINE FASTLN_T FASTLN_NAME(bn_apply_element)(FASTLN_T x, float value,
                                                     const fastln_rows_constants *k, int64_t c)
{
    if (isfinite(value)) return FASTLN_NAME(from_compute)(value);
    return FASTLN_NAME(bn_apply1_double)(x, k->shift[c], k->center[c], k->scale_double[c],
                                         k->offset_double[c]);
}

/* bn_store_float's rare vectors, out of line: inlined, GCC saved every vector to the stack
 * for them before the test. */
FASTLN_OUTLINED void FASTLN_NAME(bn_store_float_by_element)(
    const FASTLN_T *x, FASTLN_T *y, FASTLN_VF v, const fastln_rows_constants *k, int64_t c,
    int64_t feature_step)
{
    FASTLN_T lanes[FASTLN_VF_LANES];
    for (int l = 0; l < FASTLN_VF_LANES; l++)
        lanes[l] = FASTLN_NAME(bn_apply_element)(x[l], v[l], k, c + l * feature_step);
    memcpy(y, lanes, sizeof lanes);
}

/* Stores the float apply's vector v of x's VF_LANES elements at y, or, when a lane is not
 * finite, each element by bn_apply_element; lane l is feature c + l * feature_step (1 in the
 * rows layout, 0 in a segment). */
FASTLN_INLINE void FASTLN_NAME(bn_store_float)(const FASTLN_T *x, FASTLN_T *y, FASTLN_VF v,
                                               const fastln_rows_constants *k, int64_t c,
                                               int64_t feature_step, int streaming)
{
    if (__builtin_expect(FASTLN_ISA(any_not_finite)(v), 0))
        FASTLN_NAME(bn_store_float_by_element)(x, y, v, k, c, feature_step);
    else
        FASTLN_NAME(store_c_to)(y, v, streaming);
}

/* The rows layout in float for the float32-compute types, as LayerNorm's float write pass:
 * y = ((x - head) - tail) * scale + offset in float with per-feature float constants
 * (BatchNorm's fastln_bn_float_constants, GroupNorm's channels-last constants), within a few
 * u32 of the double computation. Each element whose float result is Inf or NaN (every element
 * of a feature whose constants float cannot hold: its scale is NaN) is computed in double
 * instead, from its x (not yet overwritten when y is x): the rule is per element, so a
 * feature's results never depend on its neighbours, nor on how rows are grouped below. */

/* The float apply of a vector of x: ((x - head) - tail) * scale + offset, each lane the
 * element's own arithmetic (whole vectors and a row's masked first or last ones alike). */
FASTLN_INLINE FASTLN_VF FASTLN_NAME(bn_apply_float_of)(FASTLN_VF x, FASTLN_VF head, FASTLN_VF tail,
                                                       FASTLN_VF scale, FASTLN_VF offset)
{
    return ((x - head) - tail) * scale + offset;
}

/* One row's elements [c, end), fewer than VF_LANES: one masked vector where the instruction set
 * has masks (each lane's arithmetic is the element's, so the bits are the same) and y is not
 * streamed (a plain store into a line that the pass streams costs more than it saves: measured),
 * else, and for a vector with a lane that is not finite, one element at a time stored in 16-byte
 * pieces. */
FASTLN_INLINE void FASTLN_NAME(bn_apply_row_part)(const FASTLN_T *row, FASTLN_T *out, int64_t c,
                                                  int64_t end, const fastln_rows_constants *k,
                                                  const int streaming)
{
    const float *head = k->head, *tail = k->tail, *scale = k->scale, *offset = k->offset;
#if FASTLN_MASKED
    if (!streaming) {
        const int64_t left = end - c;
        const FASTLN_VF v = FASTLN_NAME(bn_apply_float_of)(
            FASTLN_NAME(load_c_first)(row + c, left), FASTLN_ISA(load_f32_first)(head + c, left),
            FASTLN_ISA(load_f32_first)(tail + c, left), FASTLN_ISA(load_f32_first)(scale + c, left),
            FASTLN_ISA(load_f32_first)(offset + c, left));
        if (!FASTLN_ISA(any_not_finite)(v)) {
            FASTLN_NAME(store_c_first)(out + c, v, left);
            return;
        }
    }
#endif
    FASTLN_T part[FASTLN_STEP];
    for (int64_t l = 0; c + l < end; l++) {
        const int64_t at = c + l;
        const float v = ((FASTLN_NAME(to_compute)(row[at]) - head[at]) - tail[at]) * scale[at]
                        + offset[at];
        part[l] = FASTLN_NAME(bn_apply_element)(row[at], v, k, at);
    }
    FASTLN_NAME(store_elements_to)(out + c, part, end - c, streaming);
}

/* Columns [c, end) of n_rows rows (FASTLN_BN_APPLY_GROUP of them when grouped; n elements from
 * one row to the next) a vector at a time: each vector of constants is loaded once for all the
 * rows (one row at a time, the four constant loads per vector of x were what bound the pass in
 * cache), and the rows' vectors are tested for Inf and NaN together before any is stored.
 * Groups are not for streamed outputs: non-temporal stores spread over the group's rows leave
 * each row's write-combining buffer part full between stores (twice the time measured). */
FASTLN_INLINE void FASTLN_NAME(bn_apply_float_block)(const FASTLN_T *x, FASTLN_T *y, int64_t n,
                                                    int64_t c, const int64_t end,
                                                    const int n_rows,
                                                    const fastln_rows_constants *k,
                                                    const int streaming,
                                                    const int64_t fetch_rows)
{
    const float *head = k->head, *tail = k->tail, *scale = k->scale, *offset = k->offset;
    for (; c + FASTLN_VF_LANES <= end; c += FASTLN_VF_LANES) {
        if (fetch_rows && c % FASTLN_LINE < FASTLN_VF_LANES)
            __builtin_prefetch(x + fetch_rows * n + c, 0, 2);
        const FASTLN_VF head_v = FASTLN_ISA(load_f32)(head + c);
        const FASTLN_VF tail_v = FASTLN_ISA(load_f32)(tail + c);
        const FASTLN_VF scale_v = FASTLN_ISA(load_f32)(scale + c);
        const FASTLN_VF offset_v = FASTLN_ISA(load_f32)(offset + c);
        FASTLN_VF v[FASTLN_BN_APPLY_GROUP];
        FASTLN_UNROLL
        for (int r = 0; r < n_rows; r++)
            v[r] = FASTLN_NAME(bn_apply_float_of)(FASTLN_NAME(load_c)(x + r * n + c), head_v,
                                                  tail_v, scale_v, offset_v);
        if (__builtin_expect(FASTLN_ISA(any_not_finite_of)(v, n_rows), 0)) {
            for (int r = 0; r < n_rows; r++)
                FASTLN_NAME(bn_store_float)(x + r * n + c, y + r * n + c, v[r], k, c, 1,
                                            streaming);
        } else {
            FASTLN_UNROLL
            for (int r = 0; r < n_rows; r++)
                FASTLN_NAME(store_c_to)(y + r * n + c, v[r], streaming);
        }
    }
    if (c < end)
        for (int r = 0; r < n_rows; r++)
            FASTLN_NAME(bn_apply_row_part)(x + r * n, y + r * n, c, end, k, streaming);
}

/* The columns up to y's next cache line first, then the rest with whole-line stores (as
 * LayerNorm's write pass; a group's rows share the head only when a row is a whole number of
 * lines, else the group has none). */
FASTLN_INLINE void FASTLN_NAME(bn_apply_rows_float_to)(const FASTLN_T *x, FASTLN_T *y,
                                                      int64_t n_rows, int64_t n,
                                                      const fastln_rows_constants *k,
                                                      const int store, const FASTLN_T *x_end)
{
    const int streaming = store == FASTLN_ROWS_STREAMED;
    int64_t r = 0;
    if (store == FASTLN_ROWS_GROUPED) {
        const int64_t head = FASTLN_NAME(line_head)(y, n, 1);
        for (; r + FASTLN_BN_APPLY_GROUP <= n_rows; r += FASTLN_BN_APPLY_GROUP) {
            FASTLN_NAME(bn_apply_float_block)(x + r * n, y + r * n, n, 0, head,
                                              FASTLN_BN_APPLY_GROUP, k, 0, 0);
            FASTLN_NAME(bn_apply_float_block)(x + r * n, y + r * n, n, head, n,
                                              FASTLN_BN_APPLY_GROUP, k, 0, 0);
        }
    }
    const int64_t ahead = fastln_rows_fetched_ahead(n * (int64_t)sizeof(FASTLN_T));
    for (; r < n_rows; r++) {
        const int64_t head = FASTLN_NAME(row_head)(y + r * n, n, streaming);
        const int64_t fetch_rows = streaming && x + (r + ahead + 1) * n <= x_end ? ahead : 0;
        FASTLN_NAME(bn_apply_float_block)(x + r * n, y + r * n, n, 0, head, 1, k, streaming,
                                          fetch_rows);
        FASTLN_NAME(bn_apply_float_block)(x + r * n, y + r * n, n, head, n, 1, k, streaming,
                                          fetch_rows);
    }
    if (streaming) fastln_streaming_fence();
}

/* store: FASTLN_ROWS_ALONE, _STREAMED (y 16-byte aligned, and so each row) or _GROUPED
 * (fastln/batch_norm.h, fastln_rows_store). x_end: the end of the array x is part of (streamed
 * rows fetch the rows fastln_rows_fetched_ahead on while those are inside it). */
FASTLN_OUTLINED void FASTLN_NAME(bn_apply_rows_float)(const FASTLN_T *x, FASTLN_T *y,
                                                     int64_t n_rows, int64_t n,
                                                     const fastln_rows_constants *k, int store,
                                                     const FASTLN_T *x_end)
{
    if (store == FASTLN_ROWS_STREAMED)
        FASTLN_NAME(bn_apply_rows_float_to)(x, y, n_rows, n, k, FASTLN_ROWS_STREAMED, x_end);
    else if (store == FASTLN_ROWS_GROUPED)
        FASTLN_NAME(bn_apply_rows_float_to)(x, y, n_rows, n, k, FASTLN_ROWS_GROUPED, x_end);
    else
        FASTLN_NAME(bn_apply_rows_float_to)(x, y, n_rows, n, k, FASTLN_ROWS_ALONE, x_end);
}
#endif

#if FASTLN_COMPUTE_F32
/* The segments layout in float: one segment of n_inner values of feature c, by the rows
 * layout's rule (bn_apply_rows_float) with the feature's constants in every lane, so that a
 * feature's values round alike in both layouts. The last values are one masked vector where the
 * instruction set has masks (as bn_apply_row_part). */
FASTLN_OUTLINED void FASTLN_NAME(bn_apply_segment_float)(const FASTLN_T *x, FASTLN_T *y,
                                                        int64_t n_inner,
                                                        const fastln_rows_constants *k, int64_t c)
{
    const float head = k->head[c], tail = k->tail[c], scale = k->scale[c], offset = k->offset[c];
    int64_t l = 0;
    for (; l + FASTLN_VF_LANES <= n_inner; l += FASTLN_VF_LANES) {
        const FASTLN_VF v = ((FASTLN_NAME(load_c)(x + l) - head) - tail) * scale + offset;
        FASTLN_NAME(bn_store_float)(x + l, y + l, v, k, c, 0, 0);
    }
    if (l == n_inner) return;
#if FASTLN_MASKED
    const int64_t left = n_inner - l;
    const FASTLN_VF v =
        ((FASTLN_NAME(load_c_first)(x + l, left) - head) - tail) * scale + offset;
    if (!FASTLN_ISA(any_not_finite)(v)) {
        FASTLN_NAME(store_c_first)(y + l, v, left);
        return;
    }
#endif
    for (; l < n_inner; l++) {
        const float v = ((FASTLN_NAME(to_compute)(x[l]) - head) - tail) * scale + offset;
        y[l] = FASTLN_NAME(bn_apply_element)(x[l], v, k, c);
    }
}
#endif

/* Segments layout: one segment of n_inner values of one feature, in double (float64, and the
 * float32-compute types without float constants). */
FASTLN_OUTLINED void FASTLN_NAME(bn_apply_segment)(const FASTLN_T *x, FASTLN_T *y, int64_t n_inner,
                                                 double shift, double center, double scale,
                                                 double offset)
{
    int64_t l = 0;
    for (; l + FASTLN_VF_LANES <= n_inner; l += FASTLN_VF_LANES) {
        FASTLN_VD low, high;
        FASTLN_NAME(load_wide)(x + l, &low, &high);
        low = ((low - shift) - center) * scale + offset;
        high = ((high - shift) - center) * scale + offset;
        FASTLN_NAME(store_wide)(y + l, low, high);
    }
    for (; l < n_inner; l++)
        y[l] = FASTLN_NAME(bn_apply1_double)(x[l], shift, center, scale, offset);
}

/* ---- GroupNorm: y = ((x - shift) - mean_shifted) * scale + offset over a channel's values ---
 * scale = x_hat_scale * gamma_c and offset = beta_c are the channel's constants (gamma folded
 * into rstd in double, rounded once). */

/* A group's write constants for one channel. */
typedef struct {
    double shift, mean_shifted, scale, offset;
} FASTLN_NAME(gn_channel);

FASTLN_INLINE FASTLN_NAME(gn_channel) FASTLN_NAME(gn_channel_of)(const fastln_ln_stats *stats,
                                                                 double x_hat_scale,
                                                                 const FASTLN_P *gamma,
                                                                 const FASTLN_P *beta,
                                                                 int64_t c)
{
    FASTLN_NAME(gn_channel) channel;
    channel.shift = stats->shift;
    channel.mean_shifted = stats->mean_shifted;
    channel.scale = gamma ? x_hat_scale * (double)gamma[c] : x_hat_scale;
    channel.offset = beta ? (double)beta[c] : 0.0;
    return channel;
}

/* The double pass over n values of one channel. */
FASTLN_OUTLINED void FASTLN_NAME(gn_write_double)(const FASTLN_T *x, FASTLN_T *y, int64_t n,
                                                const FASTLN_NAME(gn_channel) *constants,
                                                int streaming)
{
    const FASTLN_NAME(gn_channel) k = *constants;
    int64_t i = 0;
    for (; i + FASTLN_VF_LANES <= n; i += FASTLN_VF_LANES) {
        FASTLN_VD low, high;
        FASTLN_NAME(load_wide)(x + i, &low, &high);
        low = ((low - k.shift) - k.mean_shifted) * k.scale + k.offset;
        high = ((high - k.shift) - k.mean_shifted) * k.scale + k.offset;
        FASTLN_NAME(store_wide_to)(y + i, low, high, streaming);
    }
    FASTLN_T part[FASTLN_STEP]; /* the last values, streamed too (gn_write_float) */
    for (int64_t l = i; l < n; l++)
        part[l - i] = FASTLN_NAME(from_double)(
            ((FASTLN_NAME(to_double)(x[l]) - k.shift) - k.mean_shifted) * k.scale + k.offset);
    FASTLN_NAME(store_elements_to)(y + i, part, n - i, streaming);
}

#if FASTLN_COMPUTE_F32
/* The float pass, centred on a float head and tail of the mean as ln_write_float. */
FASTLN_OUTLINED void FASTLN_NAME(gn_write_float)(const FASTLN_T *x, FASTLN_T *y, int64_t n,
                                               float mean_head, float mean_tail, float scale,
                                               float offset, int streaming)
{
    int64_t i = 0;
    for (; i + FASTLN_STEP <= n; i += FASTLN_STEP) {
        FASTLN_UNROLL
        for (int64_t v = i; v < i + FASTLN_STEP; v += FASTLN_VF_LANES) {
            const FASTLN_VF out =
                ((FASTLN_NAME(load_c)(x + v) - mean_head) - mean_tail) * scale + offset;
            FASTLN_NAME(store_c_to)(y + v, out, streaming);
        }
    }
    for (; i + FASTLN_VF_LANES <= n; i += FASTLN_VF_LANES) {
        const FASTLN_VF out = ((FASTLN_NAME(load_c)(x + i) - mean_head) - mean_tail) * scale + offset;
        FASTLN_NAME(store_c_to)(y + i, out, streaming);
    }
#if FASTLN_MASKED
    /* The last values in one masked vector (as ln_write_float); a single one alone (a one-lane
     * masked vector measured slower in BatchNorm's backward segments). */
    if (!streaming && i + 1 < n) {
        const int64_t left = n - i;
        const FASTLN_VF out =
            ((FASTLN_NAME(load_c_first)(x + i, left) - mean_head) - mean_tail) * scale + offset;
        FASTLN_NAME(store_c_first)(y + i, out, left);
        return;
    }
#endif
    /* Streamed, the last values go out with non-temporal stores too: a line written by
     * non-temporal stores and then by plain ones (this channel's tail, or the next channel's
     * head) made whole calls several times slower (docs/performance.md, "GroupNorm's outputs
     * streamed from smaller calls"). Streamed calls have channels of whole 16-byte pieces
     * (_kernels.pyx), and their tasks fence once at the end: a fence per channel flushed each
     * channel's last line half written. */
    FASTLN_T part[FASTLN_STEP]; /* fewer than a vector: a line of room */
    for (int64_t l = i; l < n; l++)
        part[l - i] = FASTLN_NAME(from_compute)(
            ((FASTLN_NAME(to_compute)(x[l]) - mean_head) - mean_tail) * scale + offset);
    FASTLN_NAME(store_elements_to)(y + i, part, n - i, streaming);
}
#endif

#if FASTLN_COMPUTE_F32
/* Whether a channel's write pass can go in float: a scale that float holds well. */
FASTLN_INLINE int FASTLN_NAME(gn_float_scale)(double scale)
{
    scale = fabs(scale);
    return fastln_scale_fits_float(scale) || scale == 0.0;
}

/* A group's mean (shift + mean_shifted) as the float write passes take it: a float head and the
 * float rest, *tail (x - head - tail keeps the mean's digits, as ln_write_float's split). */
FASTLN_INLINE float FASTLN_NAME(gn_float_mean)(double shift, double mean_shifted, float *tail)
{
    const float head = (float)(shift + mean_shifted);
    *tail = (float)((shift - (double)head) + mean_shifted);
    return head;
}

/* A channel's float constants as gn_write rounds them (head, tail, scale, offset, `stride`
 * floats apart; mean_head and mean_tail: gn_float_mean of its group, the same for every
 * channel of the group); a NaN scale when gn_write would write the channel in double, so that
 * the float apply of the channels-last layout (bn_apply_rows_float) takes each of its elements
 * in double. */
FASTLN_INLINE void FASTLN_NAME(gn_float_channel)(const FASTLN_NAME(gn_channel) *constants,
                                                 float mean_head, float mean_tail, float *head,
                                                 int64_t stride)
{
    const int in_range = FASTLN_NAME(gn_float_scale)(constants->scale);
    head[0] = in_range ? mean_head : 0.0f;
    head[stride] = in_range ? mean_tail : 0.0f;
    head[2 * stride] = in_range ? (float)constants->scale : NAN;
    head[3 * stride] = in_range ? (float)constants->offset : 0.0f;
}
#endif

#define FASTLN_GN_HEAD_MIN_BYTES 2048

/* The write pass over n values of one channel: in float for the float32-compute types whose
 * scale fits a float (as ln_write), else in double. With streaming set (and y aligned), y goes
 * out with non-temporal stores. */
FASTLN_INLINE void FASTLN_NAME(gn_write)(const FASTLN_T *x, FASTLN_T *y, int64_t n,
                                         const FASTLN_NAME(gn_channel) *constants, int streaming)
{
    const int stream_y = streaming && fastln_is_aligned16(y);
    /* The values up to y's next cache line first, then whole-line stores: not when streamed
     * (as the rows layout's write passes), nor for channels shorter than
     * FASTLN_GN_HEAD_MIN_BYTES, where the second call cost more than the straddling stores
     * (docs/performance.md). */
    const int64_t head = stream_y || n * (int64_t)sizeof(FASTLN_T) < FASTLN_GN_HEAD_MIN_BYTES
                             ? 0 : FASTLN_NAME(line_head)(y, n, 0);
#if FASTLN_COMPUTE_F32
    if (FASTLN_NAME(gn_float_scale)(constants->scale)) {
        float mean_tail;
        const float mean_head =
            FASTLN_NAME(gn_float_mean)(constants->shift, constants->mean_shifted, &mean_tail);
        const float scale = (float)constants->scale, offset = (float)constants->offset;
        if (head > 0)
            FASTLN_NAME(gn_write_float)(x, y, head, mean_head, mean_tail, scale, offset, 0);
        FASTLN_NAME(gn_write_float)(x + head, y + head, n - head, mean_head, mean_tail, scale,
                                    offset, stream_y);
        return;
    }
#endif
    if (head > 0) FASTLN_NAME(gn_write_double)(x, y, head, constants, 0);
    FASTLN_NAME(gn_write_double)(x + head, y + head, n - head, constants, stream_y);
}

#if FASTLN_COMPUTE_F32
/* Values [start, end) of a channels-first group's run whose channels are shorter than a vector
 * (a few spatial positions, or one: (N, C) input), the float32-compute types: a chunk at a
 * time, each value's channel constants (rounded to float as gn_write rounds them) laid out
 * beside it, then gn_write_float's lane arithmetic a vector at a time - the same bits. A call
 * of gn_write per channel cost several times the channel's own work. 0, nothing written, when
 * a channel's scale needs the double pass. */
FASTLN_INLINE int FASTLN_NAME(gn_write_short_channels)(const FASTLN_T *x, FASTLN_T *y,
                                                      int64_t start, int64_t end,
                                                      int64_t n_spatial, int64_t first_channel,
                                                      const fastln_ln_stats *stats,
                                                      double x_hat_scale, const FASTLN_P *gamma,
                                                      const FASTLN_P *beta)
{
    enum { CHUNK = 256 };
    const int64_t first_local = start / n_spatial, end_local = (end - 1) / n_spatial + 1;
    for (int64_t local = first_local; local < end_local; local++)
        if (!FASTLN_NAME(gn_float_scale)(FASTLN_NAME(gn_channel_of)(
                stats, x_hat_scale, gamma, beta, first_channel + local).scale))
            return 0;
    float mean_tail;
    const float mean_head =
        FASTLN_NAME(gn_float_mean)(stats->shift, stats->mean_shifted, &mean_tail);
    float scale[CHUNK], offset[CHUNK];
    int64_t local = first_local - 1, left = first_local * n_spatial - start; /* <= 0: load */
    float channel_scale = 0.0f, channel_offset = 0.0f;
    for (int64_t at = start; at < end; at += CHUNK) {
        const int64_t n = fastln_min(CHUNK, end - at);
        for (int64_t k = 0; k < n; k++, left--) {
            if (left <= 0) {
                const FASTLN_NAME(gn_channel) constants = FASTLN_NAME(gn_channel_of)(
                    stats, x_hat_scale, gamma, beta, first_channel + ++local);
                channel_scale = (float)constants.scale;
                channel_offset = (float)constants.offset;
                left += n_spatial;
            }
            scale[k] = channel_scale;
            offset[k] = channel_offset;
        }
        int64_t k = 0;
        for (; k + FASTLN_VF_LANES <= n; k += FASTLN_VF_LANES) {
            const FASTLN_VF out = ((FASTLN_NAME(load_c)(x + at + k) - mean_head) - mean_tail)
                                      * FASTLN_ISA(load_f32)(scale + k)
                                  + FASTLN_ISA(load_f32)(offset + k);
            FASTLN_NAME(store_c)(y + at + k, out);
        }
        for (; k < n; k++)
            y[at + k] = FASTLN_NAME(from_compute)(
                ((FASTLN_NAME(to_compute)(x[at + k]) - mean_head) - mean_tail) * scale[k]
                + offset[k]);
    }
    return 1;
}
#endif

/* Values [start, end) of a channels-first group's run (y likewise), cut at its channels'
 * boundaries (n_spatial values each, the first the group's channel first_channel). */
FASTLN_INLINE void FASTLN_NAME(gn_write_run)(const FASTLN_T *x, FASTLN_T *y, int64_t start,
                                             int64_t end, int64_t n_spatial,
                                             int64_t first_channel, const fastln_ln_stats *stats,
                                             double x_hat_scale, const FASTLN_P *gamma,
                                             const FASTLN_P *beta, int streaming)
{
#if FASTLN_COMPUTE_F32
    if (n_spatial < FASTLN_VF_LANES
        && FASTLN_NAME(gn_write_short_channels)(x, y, start, end, n_spatial, first_channel,
                                                stats, x_hat_scale, gamma, beta))
        return;
#endif
    while (start < end) {
        const int64_t local = start / n_spatial;
        const int64_t stop = fastln_min((local + 1) * n_spatial, end);
        const FASTLN_NAME(gn_channel) constants = FASTLN_NAME(gn_channel_of)(
            stats, x_hat_scale, gamma, beta, first_channel + local);
        FASTLN_NAME(gn_write)(x + start, y + start, stop - start, &constants, streaming);
        start = stop;
    }
}
