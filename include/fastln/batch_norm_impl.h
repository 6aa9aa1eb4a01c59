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
