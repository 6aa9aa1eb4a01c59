/* Backward kernels (LayerNorm, RMSNorm, BatchNorm) for one storage type (fastln/storage.h). No
 * include guard on purpose.
 *
 * A row's backward is two passes: a first pass for its sums in double (slot order of
 * fastln/simd.h), then an elementwise write pass for dx and the dgamma/dbeta accumulators. The
 * accumulators are FASTLN_P: float for the float32-compute types (the caller folds them into
 * double partial sums every FASTLN_ROWS_PER_FLUSH rows), double for float64. dx may be dy
 * itself (in place): each element is read before it is written. */

/* ---- LayerNorm: the first pass ----------------------------------------------------------- */

/* The first pass's sums for one block's elements of this pass's slots, from the row (dy, x) or,
 * when dy is NULL, from `padded` (the last block's dy, x and gamma, FASTLN_SLOTS each): dx_hat =
 * dy * gamma and d = x - mean are formed in the compute type - for the float32-compute types one
 * float rounding each, relative to the value itself (no cancellation: mean is the cache's, and
 * the sums re-derive its correction) - then summed in double. */
FASTLN_INLINE void FASTLN_NAME(ln_backward_add_block)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *padded,
    int64_t at, double mean, FASTLN_VD sum_dxhat[FASTLN_PASS_VECTORS],
    FASTLN_VD sum_dxhat_d[FASTLN_PASS_VECTORS], FASTLN_VD sum_d[FASTLN_PASS_VECTORS])
{
    FASTLN_UNROLL
    for (int j = 0; j < FASTLN_PASS_VECTORS / 2; j++) {
        const int64_t e = at + j * FASTLN_VF_LANES;
        const FASTLN_P *scale = gamma ? (dy ? gamma + e : padded + 2 * FASTLN_SLOTS + e) : NULL;
        FASTLN_VD dx_hat[2], d[2];
#if FASTLN_COMPUTE_F32
        FASTLN_VF dx_hat_v, x_v;
        if (dy) {
            dx_hat_v = FASTLN_NAME(load_c)(dy + e);
            x_v = FASTLN_NAME(load_c)(x + e);
        } else {
            dx_hat_v = FASTLN_NAME(load_p)(padded + e);
            x_v = FASTLN_NAME(load_p)(padded + FASTLN_SLOTS + e);
        }
        if (scale) dx_hat_v *= FASTLN_NAME(load_p)(scale);
        const FASTLN_VF d_v = x_v - (float)mean;
        dx_hat[0] = FASTLN_ISA(widen_low)(dx_hat_v);
        dx_hat[1] = FASTLN_ISA(widen_high)(dx_hat_v);
        d[0] = FASTLN_ISA(widen_low)(d_v);
        d[1] = FASTLN_ISA(widen_high)(d_v);
#else
        if (dy) {
            FASTLN_NAME(load_wide)(dy + e, &dx_hat[0], &dx_hat[1]);
            FASTLN_NAME(load_wide)(x + e, &d[0], &d[1]);
        } else {
            FASTLN_NAME(load_wide_p)(padded + e, &dx_hat[0], &dx_hat[1]);
            FASTLN_NAME(load_wide_p)(padded + FASTLN_SLOTS + e, &d[0], &d[1]);
        }
        if (scale) {
            FASTLN_VD scale_v[2];
            FASTLN_NAME(load_wide_p)(scale, &scale_v[0], &scale_v[1]);
            dx_hat[0] *= scale_v[0];
            dx_hat[1] *= scale_v[1];
        }
        d[0] -= mean;
        d[1] -= mean;
#endif
        FASTLN_UNROLL
        for (int h = 0; h < 2; h++) {
            sum_dxhat[2 * j + h] += dx_hat[h];
            sum_dxhat_d[2 * j + h] += dx_hat[h] * d[h];
            sum_d[2 * j + h] += d[h];
        }
    }
}

/* The last block's dy, x and gamma, padded with dy = 0, x = mean, gamma = 1: they add exactly
 * zero to all three sums. Returns padded, or NULL (padded untouched) when the row has no
 * partial block: passed on as NULL, the compiler cannot load the unwritten array ahead of the
 * loop - such a load stalled every row (docs/performance.md, "A stack read behind streamed
 * stores"). */
FASTLN_INLINE const FASTLN_P *FASTLN_NAME(ln_backward_pad)(const FASTLN_T *dy, const FASTLN_T *x,
                                                          const FASTLN_P *gamma, double mean,
                                                          int64_t n_whole, int64_t n_cols,
                                                          FASTLN_P padded[3 * FASTLN_SLOTS])
{
    if (n_whole == n_cols) return NULL;
    for (int k = 0; k < FASTLN_SLOTS; k++) {
        const int inside = n_whole + k < n_cols;
        padded[k] = inside ? FASTLN_NAME(to_compute)(dy[n_whole + k]) : 0;
        padded[FASTLN_SLOTS + k] = inside ? FASTLN_NAME(to_compute)(x[n_whole + k]) : (FASTLN_C)mean;
        padded[2 * FASTLN_SLOTS + k] = inside && gamma ? gamma[n_whole + k] : 1;
    }
    return padded;
}

/* A row's sums from its slots (the fixed tree of fastln/simd.h). */
FASTLN_INLINE void FASTLN_NAME(ln_backward_sums_from_slots)(
    double mean, double rstd, int64_t n_cols, const double dxhat_slots[FASTLN_SLOTS],
    const double dxhat_d_slots[FASTLN_SLOTS], const double d_slots[FASTLN_SLOTS],
    fastln_ln_backward_sums *sums)
{
    sums->mean = mean;
    sums->rstd = rstd;
    sums->n_cols = n_cols;
    sums->mean_correction = fastln_reduce_slots(d_slots) / (double)n_cols;
    sums->total_dxhat = fastln_reduce_slots(dxhat_slots);
    sums->total_dxhat_d = fastln_reduce_slots(dxhat_d_slots);
    sums->total_dxhat_xhat =
        rstd * (sums->total_dxhat_d - sums->mean_correction * sums->total_dxhat);
}

/* The backward's first pass over a row in double: sum(dx_hat), sum(dx_hat * d) and sum(d),
 * d = x - mean. The row mean is re-derived from x in the same read, with the cached mean as the
 * shift: the cache may hold the mean rounded to float32, and x - mean with that rounded mean
 * would lose the digits that matter when |mean| >> std. The float64 pass, and the float32
 * pass's fallback (below). */
FASTLN_OUTLINED void FASTLN_NAME(ln_backward_first_pass_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, double mean, double rstd,
    int64_t n_cols, fastln_ln_backward_sums *sums)
{
    const int64_t n_whole = n_cols - n_cols % FASTLN_SLOTS;
    FASTLN_P padded[3 * FASTLN_SLOTS]; /* the last block's dy, x and gamma */
    FASTLN_NAME(ln_backward_pad)(dy, x, gamma, mean, n_whole, n_cols, padded);
    double dxhat_slots[FASTLN_SLOTS], dxhat_d_slots[FASTLN_SLOTS], d_slots[FASTLN_SLOTS];
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_PASS_SLOTS) {
        FASTLN_VD sum_dxhat[FASTLN_PASS_VECTORS] = {0}, sum_dxhat_d[FASTLN_PASS_VECTORS] = {0};
        FASTLN_VD sum_d[FASTLN_PASS_VECTORS] = {0};
        for (int64_t i = 0; i < n_whole; i += FASTLN_SLOTS)
            FASTLN_NAME(ln_backward_add_block)(dy, x, gamma, NULL, i + first, mean, sum_dxhat,
                                               sum_dxhat_d, sum_d);
        if (n_whole < n_cols)
            FASTLN_NAME(ln_backward_add_block)(NULL, NULL, gamma, padded, first, mean, sum_dxhat,
                                               sum_dxhat_d, sum_d);
        memcpy(dxhat_slots + first, sum_dxhat, sizeof sum_dxhat);
        memcpy(dxhat_d_slots + first, sum_dxhat_d, sizeof sum_dxhat_d);
        memcpy(d_slots + first, sum_d, sizeof sum_d);
    }
    FASTLN_NAME(ln_backward_sums_from_slots)(mean, rstd, n_cols, dxhat_slots, dxhat_d_slots,
                                             d_slots, sums);
}

#if FASTLN_COMPUTE_F32
/* ---- LayerNorm: the first pass in float ---------------------------------------------------
 * The float32-compute types sum in float runs (FASTLN_FLOAT_RUN, fastln/simd.h): dx_hat, d and
 * dx_hat * d are formed in float (one rounding each, relative to the value: d = x - mean has no
 * cancellation, mean being the cache's and the sums re-deriving its correction), each slot adds
 * a run's terms in float and the run's partial to its double total. The result differs from the
 * double pass's by float roundings relative to the terms (measured bound: docs/performance.md),
 * and it is the same for every offset of the row, thread count and instruction set. */

/* dx_hat = dy * gamma (dy without gamma) for the vector at e, in float; and the same from a
 * padded last block (its dy, then x, then gamma, FASTLN_SLOTS each). */
FASTLN_INLINE FASTLN_VF FASTLN_NAME(float_dx_hat)(const FASTLN_T *dy, const FASTLN_P *gamma,
                                                  int64_t e)
{
    const FASTLN_VF dy_v = FASTLN_NAME(load_c)(dy + e);
    return gamma ? dy_v * FASTLN_NAME(load_p)(gamma + e) : dy_v;
}

FASTLN_INLINE FASTLN_VF FASTLN_NAME(padded_dx_hat)(const FASTLN_P *padded, int64_t e)
{
    return FASTLN_NAME(load_p)(padded + e) * FASTLN_NAME(load_p)(padded + 2 * FASTLN_SLOTS + e);
}

/* Adds one vector of terms to this pass's float partials. */
FASTLN_INLINE void FASTLN_NAME(ln_backward_add_floats)(FASTLN_VF dx_hat, FASTLN_VF x_v,
                                                       float mean, FASTLN_VF *sum_dxhat,
                                                       FASTLN_VF *sum_dxhat_d, FASTLN_VF *sum_d)
{
    const FASTLN_VF d = x_v - mean;
    *sum_dxhat += dx_hat;
    *sum_dxhat_d += dx_hat * d;
    *sum_d += d;
}

/* The float runs over a row's blocks (the last one padded: ln_backward_pad) into the slots'
 * double totals. Inlined twice, with and without gamma, so that the loop has no test for it. */
FASTLN_INLINE void FASTLN_NAME(ln_backward_float_slots)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *padded,
    float mean, int64_t n_cols, double dxhat_slots[FASTLN_SLOTS],
    double dxhat_d_slots[FASTLN_SLOTS], double d_slots[FASTLN_SLOTS])
{
    const int64_t n_whole = n_cols - n_cols % FASTLN_SLOTS;
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_FLOAT_PASS_SLOTS)
        for (int64_t run = 0; run < n_cols; run += FASTLN_FLOAT_RUN * FASTLN_SLOTS) {
            FASTLN_VF sum_dxhat[FASTLN_FLOAT_PASS_VECTORS] = {0};
            FASTLN_VF sum_dxhat_d[FASTLN_FLOAT_PASS_VECTORS] = {0};
            FASTLN_VF sum_d[FASTLN_FLOAT_PASS_VECTORS] = {0};
            int padded_block;
            const int64_t whole_end =
                fastln_float_run_end(run, FASTLN_FLOAT_RUN, n_whole, n_cols, &padded_block);
            for (int64_t i = run; i < whole_end; i += FASTLN_SLOTS) {
                FASTLN_UNROLL
                for (int j = 0; j < FASTLN_FLOAT_PASS_VECTORS; j++) {
                    const int64_t e = i + first + j * FASTLN_VF_LANES;
                    const FASTLN_VF dx_hat = FASTLN_NAME(float_dx_hat)(dy, gamma, e);
                    FASTLN_NAME(ln_backward_add_floats)(dx_hat, FASTLN_NAME(load_c)(x + e), mean,
                                                        &sum_dxhat[j], &sum_dxhat_d[j],
                                                        &sum_d[j]);
                }
            }
            if (padded_block) {
                FASTLN_UNROLL
                for (int j = 0; j < FASTLN_FLOAT_PASS_VECTORS; j++) {
                    const int64_t e = first + j * FASTLN_VF_LANES;
                    const FASTLN_VF dx_hat = FASTLN_NAME(padded_dx_hat)(padded, e);
                    FASTLN_NAME(ln_backward_add_floats)(
                        dx_hat, FASTLN_NAME(load_p)(padded + FASTLN_SLOTS + e), mean,
                        &sum_dxhat[j], &sum_dxhat_d[j], &sum_d[j]);
                }
            }
            FASTLN_NAME(fold_floats)(sum_dxhat, dxhat_slots + first, run == 0);
            FASTLN_NAME(fold_floats)(sum_dxhat_d, dxhat_d_slots + first, run == 0);
            FASTLN_NAME(fold_floats)(sum_d, d_slots + first, run == 0);
        }
}

/* Whether a float pass's sums stand for the row: they are finite, and the sum of products
 * (sum(dx_hat * d), sum(dx_hat * x_hat)) is not so small that products below float's normal
 * range could matter (each is off by at most 2^-150 then; n of them stay below 2^-24 of a sum
 * of n * n * FLT_MIN or more), dy = 0 aside. Other rows (Inf, NaN, extreme or tiny values) take
 * the double pass, and from there the paths the float64 rows take. dy is n_runs runs of width
 * values, stride apart (a row: one run; a BatchNorm feature: its rows or its segments). */
FASTLN_INLINE int FASTLN_NAME(floats_hold_runs)(const FASTLN_T *dy, int64_t n_runs, int64_t width,
                                               int64_t stride, double products)
{
    if (!isfinite(products)) return 0;
    const double n = (double)(n_runs * width);
    if (!(fabs(products) < fastln_products_floor(n))) return 1;
    for (int64_t r = 0; r < n_runs; r++)
        for (int64_t j = 0; j < width; j++)
            if (FASTLN_NAME(to_compute)(dy[r * stride + j]) != 0) return 0;
    return 1;
}

/* floats_hold_runs for a contiguous row of n_cols values. */
FASTLN_INLINE int FASTLN_NAME(floats_hold)(const FASTLN_T *dy, int64_t n_cols, double products)
{
    return FASTLN_NAME(floats_hold_runs)(dy, 1, n_cols, n_cols, products);
}
#endif

/* The backward's first pass over a row: sum(dx_hat), sum(dx_hat * d) and sum(d), d = x - mean
 * (in float runs for the float32-compute types, when those hold; in double otherwise). */
FASTLN_OUTLINED void FASTLN_NAME(ln_backward_first_pass)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, double mean, double rstd,
    int64_t n_cols, fastln_ln_backward_sums *sums)
{
#if FASTLN_COMPUTE_F32
    const int64_t n_whole = n_cols - n_cols % FASTLN_SLOTS;
    FASTLN_P padded[3 * FASTLN_SLOTS]; /* the last block's dy, x and gamma */
    const FASTLN_P *last_block =
        FASTLN_NAME(ln_backward_pad)(dy, x, gamma, mean, n_whole, n_cols, padded);
    double dxhat_slots[FASTLN_SLOTS], dxhat_d_slots[FASTLN_SLOTS], d_slots[FASTLN_SLOTS];
    if (gamma)
        FASTLN_NAME(ln_backward_float_slots)(dy, x, gamma, last_block, (float)mean, n_cols,
                                             dxhat_slots, dxhat_d_slots, d_slots);
    else
        FASTLN_NAME(ln_backward_float_slots)(dy, x, NULL, last_block, (float)mean, n_cols,
                                             dxhat_slots, dxhat_d_slots, d_slots);
    FASTLN_NAME(ln_backward_sums_from_slots)(mean, rstd, n_cols, dxhat_slots, dxhat_d_slots,
                                             d_slots, sums);
    if (isfinite(sums->total_dxhat_xhat)
        && FASTLN_NAME(floats_hold)(dy, n_cols, sums->total_dxhat_d))
        return;
#endif
    FASTLN_NAME(ln_backward_first_pass_double)(dy, x, gamma, mean, rstd, n_cols, sums);
}

/* Whether sum(dx_hat * d) may hold products that underflowed (float64 only: float32 ones,
 * formed in double, cannot): their sum is below n * (n * DBL_MIN) then, which ordinary rows
 * never are (all-zero dy aside). */
FASTLN_INLINE int FASTLN_NAME(ln_backward_maybe_underflow)(const fastln_ln_backward_sums *sums)
{
#if FASTLN_COMPUTE_F32
    (void)sums;
    return 0;
#else
    const double n = (double)sums->n_cols;
    return fabs(sums->total_dxhat_d) < n * n * DBL_MIN;
#endif
}

/* Whether the write pass takes the row in the compute type: float32-compute rows whose rstd
 * fits a float (the others, and float64 rows, are written in double). */
FASTLN_INLINE int FASTLN_NAME(ln_backward_in_floats)(const fastln_ln_backward_sums *sums)
{
#if FASTLN_COMPUTE_F32
    return fastln_scale_fits_float(sums->rstd);
#else
    (void)sums;
    return 0;
#endif
}

/* For the write passes below over rows from memory (rows of `row` elements, contiguous; for a
 * row written in parts, a part's length, a line or two short of the row's): one step of the
 * next row into L1, and into L2 the same step two rows on, or 8 KiB on for rows shorter than
 * 4 KiB. Each row starts a stream the hardware prefetcher has not yet seen, so without the
 * second prefetch the next row's first pass waited for its first lines from memory. The
 * forward, which reads one stream, came slower with it (docs/performance.md, "The backward's
 * rows prefetched further ahead"). */
FASTLN_INLINE void FASTLN_NAME(prefetch_step_ahead)(const FASTLN_T *p, int64_t row)
{
    const int64_t further =
        fastln_max(2 * row, (int64_t)(FASTLN_FETCH_AHEAD_BYTES / sizeof(FASTLN_T)));
    FASTLN_NAME(prefetch_step)(p + row);
    FASTLN_UNROLL
    for (int64_t k = 0; k < FASTLN_STEP; k += FASTLN_LINE)
        __builtin_prefetch(p + further + k, 0, 2);
}

/* ---- LayerNorm: the write pass in double -------------------------------------------------
 *     dx = rstd / n * ((n * dx_hat - sum(dx_hat)) - x_hat * sum(dx_hat * x_hat)),
 *     x_hat = ((x - mean) - mean(d)) * rstd,   dgamma += dy * x_hat,  dbeta += dy. */

FASTLN_INLINE double FASTLN_NAME(ln_backward_dx1_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, int64_t i,
    const fastln_ln_backward_sums *sums, FASTLN_P *dgamma_acc, FASTLN_P *dbeta_acc)
{
    const double n = (double)sums->n_cols;
    const double dy_i = FASTLN_NAME(to_double)(dy[i]);
    const double x_hat =
        ((FASTLN_NAME(to_double)(x[i]) - sums->mean) - sums->mean_correction) * sums->rstd;
    const double dx_hat = gamma ? dy_i * (double)gamma[i] : dy_i;
    *dgamma_acc = (FASTLN_P)((double)*dgamma_acc + dy_i * x_hat);
    *dbeta_acc = (FASTLN_P)((double)*dbeta_acc + dy_i);
    return (sums->rstd / n) * ((n * dx_hat - sums->total_dxhat) - x_hat * sums->total_dxhat_xhat);
}

/* dx for VF_LANES elements as two double vectors; dy * x_hat and dy are added to the
 * accumulators (two double vectors each). */
FASTLN_INLINE void FASTLN_NAME(ln_backward_dx_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma,
    const fastln_ln_backward_sums *sums, FASTLN_VD dgamma[2], FASTLN_VD dbeta[2],
    FASTLN_VD dx[2])
{
    const double n = (double)sums->n_cols;
    FASTLN_VD dy_v[2], x_hat[2], scale[2] = {0};
    FASTLN_NAME(load_wide)(dy, &dy_v[0], &dy_v[1]);
    FASTLN_NAME(load_wide)(x, &x_hat[0], &x_hat[1]);
    if (gamma) FASTLN_NAME(load_wide_p)(gamma, &scale[0], &scale[1]);
    FASTLN_UNROLL
    for (int h = 0; h < 2; h++) {
        x_hat[h] = ((x_hat[h] - sums->mean) - sums->mean_correction) * sums->rstd;
        const FASTLN_VD dx_hat = gamma ? dy_v[h] * scale[h] : dy_v[h];
        dgamma[h] += dy_v[h] * x_hat[h];
        dbeta[h] += dy_v[h];
        dx[h] = (sums->rstd / n)
                * ((n * dx_hat - sums->total_dxhat) - x_hat[h] * sums->total_dxhat_xhat);
    }
}

/* The double pass for the VF_LANES elements of a row at i: dx, and the accumulators. */
FASTLN_INLINE void FASTLN_NAME(ln_backward_write_double_vector)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t i,
    const fastln_ln_backward_sums *row, FASTLN_P *dgamma_acc, FASTLN_P *dbeta_acc, int stream_dx)
{
    FASTLN_VD dgamma[2], dbeta[2], dx_v[2];
    FASTLN_NAME(load_wide_p)(dgamma_acc + i, &dgamma[0], &dgamma[1]);
    FASTLN_NAME(load_wide_p)(dbeta_acc + i, &dbeta[0], &dbeta[1]);
    FASTLN_NAME(ln_backward_dx_double)(dy + i, x + i, gamma ? gamma + i : NULL, row, dgamma,
                                       dbeta, dx_v);
    FASTLN_NAME(store_wide_p)(dgamma_acc + i, dgamma[0], dgamma[1]);
    FASTLN_NAME(store_wide_p)(dbeta_acc + i, dbeta[0], dbeta[1]);
    FASTLN_NAME(store_wide_to)(dx + i, dx_v[0], dx_v[1], stream_dx);
}

/* The double write pass over n elements of one row. With streaming set (and dx aligned), dx is
 * written with non-temporal stores and the next row is prefetched (rows then come from memory;
 * in cache the prefetch costs more than it saves). */
FASTLN_OUTLINED void FASTLN_NAME(ln_backward_write_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n,
    const fastln_ln_backward_sums *sums, FASTLN_P *dgamma_acc, FASTLN_P *dbeta_acc,
    int streaming)
{
    const fastln_ln_backward_sums row = *sums;
    const int stream_dx = streaming && fastln_is_aligned16(dx);
    int64_t i = 0;
    for (; i + FASTLN_STEP <= n; i += FASTLN_STEP) {
        if (streaming) {
            FASTLN_NAME(prefetch_step_ahead)(dy + i, n);
            FASTLN_NAME(prefetch_step_ahead)(x + i, n);
        }
        FASTLN_UNROLL
        for (int64_t v = i; v < i + FASTLN_STEP; v += FASTLN_VF_LANES)
            FASTLN_NAME(ln_backward_write_double_vector)(dy, x, gamma, dx, v, &row, dgamma_acc,
                                                         dbeta_acc, stream_dx);
    }
    for (; i + FASTLN_VF_LANES <= n; i += FASTLN_VF_LANES)
        FASTLN_NAME(ln_backward_write_double_vector)(dy, x, gamma, dx, i, &row, dgamma_acc,
                                                     dbeta_acc, stream_dx);
    /* float64 rows fence each row, as the forward's (fastln/forward.h, ln_write_double). */
    if (stream_dx && !FASTLN_COMPUTE_F32) fastln_streaming_fence();
    for (; i < n; i++)
        dx[i] = FASTLN_NAME(from_double)(FASTLN_NAME(ln_backward_dx1_double)(
            dy, x, gamma, i, &row, dgamma_acc + i, dbeta_acc + i));
}

/* The line holding element `at` of dy, x and dx fetched into L2: dy and x for a first pass to
 * come, dx for its writes. */
FASTLN_INLINE void FASTLN_NAME(fetch_line_at)(const FASTLN_T *dy, const FASTLN_T *x, FASTLN_T *dx,
                                              int64_t at)
{
    __builtin_prefetch(dy + at, 0, 2);
    __builtin_prefetch(x + at, 0, 2);
    __builtin_prefetch(dx + at, 1, 2);
}

/* The lines at columns [i, i + FASTLN_STEP) of n_fetch rows from row first (rows stride
 * elements apart) fetched as a group's write pass goes: the next group's. Without them the next
 * rows' first pass starts on lines still in memory, its loads stalling while nothing else is on
 * its way (docs/performance.md). */
FASTLN_INLINE void FASTLN_NAME(fetch_rows_at)(const FASTLN_T *dy, const FASTLN_T *x,
                                              FASTLN_T *dx, int64_t first, int64_t n_fetch,
                                              int64_t stride, int64_t i)
{
    for (int64_t r = first; r < first + n_fetch; r++) {
        FASTLN_UNROLL
        for (int64_t k = i; k < i + FASTLN_STEP; k += FASTLN_LINE)
            FASTLN_NAME(fetch_line_at)(dy, x, dx, r * stride + k);
    }
}

/* The rest of the fetched rows' lines, after the whole steps: columns [i, width), and the line
 * of the last column. Only dx's rows start on a line (the write passes begin at dx's first
 * whole line); a row of dy or x that does not spans one line more than its steps, and that line,
 * missed, stalled the next row's first pass on memory. */
FASTLN_INLINE void FASTLN_NAME(fetch_rows_rest)(const FASTLN_T *dy, const FASTLN_T *x,
                                                FASTLN_T *dx, int64_t first, int64_t n_fetch,
                                                int64_t stride, int64_t i, int64_t width)
{
    if (width <= 0) return;
    for (int64_t r = first; r < first + n_fetch; r++) {
        for (int64_t k = i; k < width; k += FASTLN_LINE)
            FASTLN_NAME(fetch_line_at)(dy, x, dx, r * stride + k);
        FASTLN_NAME(fetch_line_at)(dy, x, dx, r * stride + width - 1);
    }
}

#if !FASTLN_COMPUTE_F32
/* The double write pass of n_rows consecutive rows together over width columns (rows stride
 * elements apart): each accumulator is loaded and stored once for the group, and the rows add
 * to it in row order, as row after row would. float64 only: the float32-compute types group
 * only rows their float pass takes. */
FASTLN_OUTLINED void FASTLN_NAME(ln_backward_write_rows_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_ln_backward_sums *sums, FASTLN_P *dgamma_acc,
    FASTLN_P *dbeta_acc, int64_t n_fetch)
{
    enum { VECTORS = FASTLN_STEP / FASTLN_VF_LANES };
    int64_t i = 0;
    for (; i + FASTLN_STEP <= width; i += FASTLN_STEP) {
        if (n_fetch) FASTLN_NAME(fetch_rows_at)(dy, x, dx, n_rows, n_fetch, stride, i);
        FASTLN_VD dgamma[VECTORS][2], dbeta[VECTORS][2], dx_v[2];
        FASTLN_UNROLL
        for (int v = 0; v < VECTORS; v++) {
            FASTLN_NAME(load_wide_p)(dgamma_acc + i + v * FASTLN_VF_LANES, &dgamma[v][0],
                                     &dgamma[v][1]);
            FASTLN_NAME(load_wide_p)(dbeta_acc + i + v * FASTLN_VF_LANES, &dbeta[v][0],
                                     &dbeta[v][1]);
        }
        for (int64_t r = 0; r < n_rows; r++) {
            FASTLN_UNROLL
            for (int v = 0; v < VECTORS; v++) {
                const int64_t column = i + v * FASTLN_VF_LANES, at = r * stride + column;
                FASTLN_NAME(ln_backward_dx_double)(dy + at, x + at, gamma ? gamma + column : NULL,
                                                   &sums[r], dgamma[v], dbeta[v], dx_v);
                FASTLN_NAME(store_wide)(dx + at, dx_v[0], dx_v[1]);
            }
        }
        FASTLN_UNROLL
        for (int v = 0; v < VECTORS; v++) {
            FASTLN_NAME(store_wide_p)(dgamma_acc + i + v * FASTLN_VF_LANES, dgamma[v][0],
                                      dgamma[v][1]);
            FASTLN_NAME(store_wide_p)(dbeta_acc + i + v * FASTLN_VF_LANES, dbeta[v][0],
                                      dbeta[v][1]);
        }
    }
    if (n_fetch) FASTLN_NAME(fetch_rows_rest)(dy, x, dx, n_rows, n_fetch, stride, i, width);
    for (; i + FASTLN_VF_LANES <= width; i += FASTLN_VF_LANES)
        for (int64_t r = 0; r < n_rows; r++)
            FASTLN_NAME(ln_backward_write_double_vector)(dy + r * stride, x + r * stride, gamma,
                                                         dx + r * stride, i, &sums[r],
                                                         dgamma_acc, dbeta_acc, 0);
    for (; i < width; i++)
        for (int64_t r = 0; r < n_rows; r++)
            dx[r * stride + i] = FASTLN_NAME(from_double)(FASTLN_NAME(ln_backward_dx1_double)(
                dy + r * stride, x + r * stride, gamma, i, &sums[r], dgamma_acc + i,
                dbeta_acc + i));
}
#endif

/* ---- LayerNorm: the write pass in float32 ----------------------------------------------
 *     dx = rstd * ((dx_hat - mean(dx_hat)) - x_hat * mean(dx_hat * x_hat))
 * with both means taken in double by the first pass and x_hat centred on a float head + tail
 * mean. Subtracting mean(dx_hat) first keeps the cancellation inside one float rounding (a
 * one-element row gives dx = 0 exactly). */

#if FASTLN_COMPUTE_F32
FASTLN_INLINE fastln_ln_backward_floats FASTLN_NAME(ln_backward_to_floats)(
    const fastln_ln_backward_sums *sums)
{
    const double n = (double)sums->n_cols;
    fastln_ln_backward_floats row;
    row.mean_head = (float)sums->mean; /* a float value already (the cache's) */
    row.mean_tail = (float)sums->mean_correction;
    row.rstd = (float)sums->rstd;
    row.mean_dxhat = (float)(sums->total_dxhat / n);
    row.mean_dxhat_xhat = (float)(sums->total_dxhat_xhat / n);
    return row;
}

/* dx for VF_LANES elements from their dy and x vectors; their dy * x_hat and dy are added to
 * dgamma and dbeta. gamma_v is gamma's vector for these columns (NULL without gamma), loaded by
 * the caller: once for all the rows of a group, as x and dy are the only loads each row needs. */
FASTLN_INLINE FASTLN_VF FASTLN_NAME(ln_backward_dx_float_of)(
    FASTLN_VF dy_v, FASTLN_VF x_v, const FASTLN_VF *gamma_v, const fastln_ln_backward_floats *row,
    FASTLN_VF *dgamma, FASTLN_VF *dbeta)
{
    const FASTLN_VF x_hat = ((x_v - row->mean_head) - row->mean_tail) * row->rstd;
    const FASTLN_VF dx_hat = gamma_v ? dy_v * *gamma_v : dy_v;
    *dgamma += dy_v * x_hat;
    *dbeta += dy_v;
    return ((dx_hat - row->mean_dxhat) - x_hat * row->mean_dxhat_xhat) * row->rstd;
}

/* The same from dy and x in memory. */
FASTLN_INLINE FASTLN_VF FASTLN_NAME(ln_backward_dx_float)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_VF *gamma_v,
    const fastln_ln_backward_floats *row, FASTLN_VF *dgamma, FASTLN_VF *dbeta)
{
    return FASTLN_NAME(ln_backward_dx_float_of)(FASTLN_NAME(load_c)(dy), FASTLN_NAME(load_c)(x),
                                                gamma_v, row, dgamma, dbeta);
}

/* The same for one element, with each lane's arithmetic. */
FASTLN_INLINE float FASTLN_NAME(ln_backward_dx1_float)(
    FASTLN_T dy, FASTLN_T x, const FASTLN_P *gamma, const fastln_ln_backward_floats *row,
    float *dgamma, float *dbeta)
{
    const float dy_f = FASTLN_NAME(to_compute)(dy);
    const float x_hat = ((FASTLN_NAME(to_compute)(x) - row->mean_head) - row->mean_tail) * row->rstd;
    const float dx_hat = gamma ? dy_f * *gamma : dy_f;
    *dgamma += dy_f * x_hat;
    *dbeta += dy_f;
    return ((dx_hat - row->mean_dxhat) - x_hat * row->mean_dxhat_xhat) * row->rstd;
}

/* The float pass for the VF_LANES elements of a row at i: dx, and the accumulators. */
FASTLN_INLINE void FASTLN_NAME(ln_backward_write_float_vector)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t i,
    const fastln_ln_backward_floats *row, float *dgamma_acc, float *dbeta_acc, int stream_dx)
{
    FASTLN_VF dgamma = FASTLN_ISA(load_f32)(dgamma_acc + i);
    FASTLN_VF dbeta = FASTLN_ISA(load_f32)(dbeta_acc + i);
    const FASTLN_VF gamma_v = gamma ? FASTLN_NAME(load_p)(gamma + i) : dgamma; /* unused then */
    const FASTLN_VF dx_v = FASTLN_NAME(ln_backward_dx_float)(
        dy + i, x + i, gamma ? &gamma_v : NULL, row, &dgamma, &dbeta);
    FASTLN_ISA(store_f32)(dgamma_acc + i, dgamma);
    FASTLN_ISA(store_f32)(dbeta_acc + i, dbeta);
    FASTLN_NAME(store_c_to)(dx + i, dx_v, stream_dx);
}

/* The float write pass over n elements of one row (streaming as the double pass); inlined
 * with and without gamma (below). */
FASTLN_INLINE void FASTLN_NAME(ln_backward_write_float_row)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n,
    const fastln_ln_backward_sums *sums, float *dgamma_acc, float *dbeta_acc, int streaming)
{
    const fastln_ln_backward_floats row = FASTLN_NAME(ln_backward_to_floats)(sums);
    const int stream_dx = streaming && fastln_is_aligned16(dx);
    int64_t i = 0;
    for (; i + FASTLN_STEP <= n; i += FASTLN_STEP) {
        if (streaming) {
            FASTLN_NAME(prefetch_step_ahead)(dy + i, n);
            FASTLN_NAME(prefetch_step_ahead)(x + i, n);
        }
        FASTLN_UNROLL
        for (int64_t v = i; v < i + FASTLN_STEP; v += FASTLN_VF_LANES)
            FASTLN_NAME(ln_backward_write_float_vector)(dy, x, gamma, dx, v, &row, dgamma_acc,
                                                        dbeta_acc, stream_dx);
    }
    for (; i + FASTLN_VF_LANES <= n; i += FASTLN_VF_LANES)
        FASTLN_NAME(ln_backward_write_float_vector)(dy, x, gamma, dx, i, &row, dgamma_acc,
                                                    dbeta_acc, stream_dx);
    for (; i < n; i++)
        dx[i] = FASTLN_NAME(from_compute)(FASTLN_NAME(ln_backward_dx1_float)(
            dy[i], x[i], gamma ? gamma + i : NULL, &row, dgamma_acc + i, dbeta_acc + i));
}

/* With gamma a known NULL or not in each copy, the vector of gamma needs no test per vector;
 * with it unknown, GCC kept that vector on the stack, a store and a load per vector. */
FASTLN_OUTLINED void FASTLN_NAME(ln_backward_write_float)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n,
    const fastln_ln_backward_sums *sums, float *dgamma_acc, float *dbeta_acc, int streaming)
{
    if (gamma)
        FASTLN_NAME(ln_backward_write_float_row)(dy, x, gamma, dx, n, sums, dgamma_acc,
                                                 dbeta_acc, streaming);
    else
        FASTLN_NAME(ln_backward_write_float_row)(dy, x, NULL, dx, n, sums, dgamma_acc,
                                                 dbeta_acc, streaming);
}

/* The float write pass of n_rows consecutive rows together (see the double one), from their
 * constants. */
FASTLN_INLINE void FASTLN_NAME(ln_backward_write_rows_floats)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_ln_backward_floats *rows, float *dgamma_acc,
    float *dbeta_acc, int64_t n_fetch)
{
    enum { VECTORS = FASTLN_STEP / FASTLN_VF_LANES };
    int64_t i = 0;
    for (; i + FASTLN_STEP <= width; i += FASTLN_STEP) {
        if (n_fetch) FASTLN_NAME(fetch_rows_at)(dy, x, dx, n_rows, n_fetch, stride, i);
        FASTLN_VF dgamma[VECTORS], dbeta[VECTORS], gamma_v[VECTORS];
        FASTLN_UNROLL
        for (int v = 0; v < VECTORS; v++) {
            dgamma[v] = FASTLN_ISA(load_f32)(dgamma_acc + i + v * FASTLN_VF_LANES);
            dbeta[v] = FASTLN_ISA(load_f32)(dbeta_acc + i + v * FASTLN_VF_LANES);
            /* without gamma, any value: ln_backward_dx_float does not read it */
            gamma_v[v] = gamma ? FASTLN_NAME(load_p)(gamma + i + v * FASTLN_VF_LANES) : dgamma[v];
        }
        for (int64_t r = 0; r < n_rows; r++) {
            FASTLN_UNROLL
            for (int v = 0; v < VECTORS; v++) {
                const int64_t at = r * stride + i + v * FASTLN_VF_LANES;
                FASTLN_NAME(store_c)(dx + at, FASTLN_NAME(ln_backward_dx_float)(
                    dy + at, x + at, gamma ? &gamma_v[v] : NULL, &rows[r], &dgamma[v],
                    &dbeta[v]));
            }
        }
        FASTLN_UNROLL
        for (int v = 0; v < VECTORS; v++) {
            FASTLN_ISA(store_f32)(dgamma_acc + i + v * FASTLN_VF_LANES, dgamma[v]);
            FASTLN_ISA(store_f32)(dbeta_acc + i + v * FASTLN_VF_LANES, dbeta[v]);
        }
    }
    if (n_fetch) FASTLN_NAME(fetch_rows_rest)(dy, x, dx, n_rows, n_fetch, stride, i, width);
    for (; i + FASTLN_VF_LANES <= width; i += FASTLN_VF_LANES)
        for (int64_t r = 0; r < n_rows; r++)
            FASTLN_NAME(ln_backward_write_float_vector)(dy + r * stride, x + r * stride, gamma,
                                                        dx + r * stride, i, &rows[r], dgamma_acc,
                                                        dbeta_acc, 0);
#if FASTLN_MASKED
    /* The last columns (and the few before dx's first line, a call of their own) in one masked
     * vector per row instead of one at a time, each with its accumulators' load and store
     * (docs/performance.md): each lane's arithmetic is the element's, and the rows add to the
     * accumulators in row order, so the bits are the same. */
    if (i < width) {
        const int64_t n = width - i;
        FASTLN_VF dgamma = FASTLN_ISA(load_f32_first)(dgamma_acc + i, n);
        FASTLN_VF dbeta = FASTLN_ISA(load_f32_first)(dbeta_acc + i, n);
        const FASTLN_VF gamma_v = gamma ? FASTLN_ISA(load_f32_first)(gamma + i, n) : dgamma;
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t at = r * stride + i;
            FASTLN_NAME(store_c_first)(dx + at, FASTLN_NAME(ln_backward_dx_float_of)(
                FASTLN_NAME(load_c_first)(dy + at, n), FASTLN_NAME(load_c_first)(x + at, n),
                gamma ? &gamma_v : NULL, &rows[r], &dgamma, &dbeta), n);
        }
        FASTLN_ISA(store_f32_first)(dgamma_acc + i, dgamma, n);
        FASTLN_ISA(store_f32_first)(dbeta_acc + i, dbeta, n);
        return;
    }
#endif
    for (; i < width; i++)
        for (int64_t r = 0; r < n_rows; r++)
            dx[r * stride + i] = FASTLN_NAME(from_compute)(FASTLN_NAME(ln_backward_dx1_float)(
                dy[r * stride + i], x[r * stride + i], gamma ? gamma + i : NULL, &rows[r],
                dgamma_acc + i, dbeta_acc + i));
}

/* The same from the rows' sums; inlined with and without gamma, and for a whole group with its
 * row count a constant (the rows loop unrolled, each row's constants in registers), so that the
 * loops have no test for either. */
FASTLN_OUTLINED void FASTLN_NAME(ln_backward_write_rows_float)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_ln_backward_sums *sums, float *dgamma_acc,
    float *dbeta_acc, int64_t n_fetch)
{
    fastln_ln_backward_floats rows[FASTLN_BACKWARD_GROUP];
    for (int64_t r = 0; r < n_rows; r++) rows[r] = FASTLN_NAME(ln_backward_to_floats)(&sums[r]);
    if (n_rows == FASTLN_BACKWARD_GROUP && gamma)
        FASTLN_NAME(ln_backward_write_rows_floats)(dy, x, gamma, dx, FASTLN_BACKWARD_GROUP, stride,
                                                   width, rows, dgamma_acc, dbeta_acc, n_fetch);
    else if (n_rows == FASTLN_BACKWARD_GROUP)
        FASTLN_NAME(ln_backward_write_rows_floats)(dy, x, NULL, dx, FASTLN_BACKWARD_GROUP, stride,
                                                   width, rows, dgamma_acc, dbeta_acc, n_fetch);
    else if (gamma)
        FASTLN_NAME(ln_backward_write_rows_floats)(dy, x, gamma, dx, n_rows, stride, width, rows,
                                                   dgamma_acc, dbeta_acc, n_fetch);
    else
        FASTLN_NAME(ln_backward_write_rows_floats)(dy, x, NULL, dx, n_rows, stride, width, rows,
                                                   dgamma_acc, dbeta_acc, n_fetch);
}
#endif

/* ---- LayerNorm: rows ---------------------------------------------------------------------- */

FASTLN_INLINE void FASTLN_NAME(ln_backward_write)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n,
    const fastln_ln_backward_sums *sums, FASTLN_P *dgamma_acc, FASTLN_P *dbeta_acc,
    int streaming)
{
#if FASTLN_COMPUTE_F32
    if (FASTLN_NAME(ln_backward_in_floats)(sums)) {
        FASTLN_NAME(ln_backward_write_float)(dy, x, gamma, dx, n, sums, dgamma_acc, dbeta_acc,
                                             streaming);
        return;
    }
    streaming = 0;
#endif
    FASTLN_NAME(ln_backward_write_double)(dy, x, gamma, dx, n, sums, dgamma_acc, dbeta_acc,
                                          streaming);
}

FASTLN_INLINE void FASTLN_NAME(ln_backward_write_rows)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_ln_backward_sums *sums, FASTLN_P *dgamma_acc,
    FASTLN_P *dbeta_acc, int64_t n_fetch)
{
#if FASTLN_COMPUTE_F32
    FASTLN_NAME(ln_backward_write_rows_float)(dy, x, gamma, dx, n_rows, stride, width, sums,
                                              dgamma_acc, dbeta_acc, n_fetch);
#else
    FASTLN_NAME(ln_backward_write_rows_double)(dy, x, gamma, dx, n_rows, stride, width, sums,
                                               dgamma_acc, dbeta_acc, n_fetch);
#endif
}

/* Backward of one row from its first pass's sums, by the two-reduction identity
 *     dx = rstd / n * (n * dx_hat - sum(dx_hat) - x_hat * sum(dx_hat * x_hat)),  dx_hat = dy * gamma.
 * eps is the forward's: rows whose cached rstd is Inf (beyond the cache's range) and rows whose
 * products overflow or underflow double are done from statistics taken again from x (rare.h).
 * With streaming set, dx is written with non-temporal stores. */
FASTLN_INLINE void FASTLN_NAME(ln_backward_row_from_sums)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, double eps, FASTLN_T *dx,
    int64_t n_cols, const fastln_ln_backward_sums *sums, FASTLN_P *dgamma_acc,
    FASTLN_P *dbeta_acc, fastln_shared_line *streamed, int next_row_follows)
{
    /* Not finite: an Inf rstd (a constant row with eps = 0, or beyond the cache's range), a
     * product that overflowed, or a NaN or Inf in the row. */
    if (!isfinite(sums->total_dxhat_xhat)) {
        if (streamed) fastln_shared_line_put(streamed);
        if (FASTLN_NAME(ln_backward_row_rare)(dy, x, gamma, dx, n_cols, sums->rstd, eps,
                                              dgamma_acc, dbeta_acc))
            return;
    }
#if !FASTLN_COMPUTE_F32
    if (FASTLN_NAME(ln_backward_maybe_underflow)(sums) && !FASTLN_NAME(all_zero)(dy, n_cols)
        && FASTLN_NAME(ln_backward_products_underflow)(dy, x, gamma, sums->mean, n_cols)) {
        if (streamed) fastln_shared_line_put(streamed);
        FASTLN_NAME(ln_backward_row_recomputed)(dy, x, gamma, dx, n_cols, eps, dgamma_acc,
                                                dbeta_acc);
        return;
    }
#endif
    /* The elements up to dx's next cache line first, then whole-line stores (streamed: the
     * lines shared with the neighbouring rows whole, fastln_row_parts_of). */
    const fastln_row_parts parts =
        fastln_row_parts_of(streamed, dx, sizeof(FASTLN_T), n_cols, next_row_follows);
    if (parts.head > 0)
        FASTLN_NAME(ln_backward_write)(dy, x, gamma, parts.head_to, parts.head, sums,
                                       dgamma_acc, dbeta_acc, 0);
    fastln_row_head_written(streamed, &parts);
    int64_t i = parts.head;
    FASTLN_NAME(ln_backward_write)(dy + i, x + i, gamma ? gamma + i : NULL, dx + i, parts.body,
                                   sums, dgamma_acc + i, dbeta_acc + i, parts.stream_body);
    i += parts.body;
    if (parts.tail > 0)
        FASTLN_NAME(ln_backward_write)(dy + i, x + i, gamma ? gamma + i : NULL, parts.tail_to,
                                       parts.tail, sums, dgamma_acc + i, dbeta_acc + i, 0);
    fastln_row_tail_written(streamed, &parts, dx, sizeof(FASTLN_T));
}

/* Backward of n_rows <= FASTLN_BACKWARD_GROUP consecutive rows: each row's first pass, then one
 * write pass over the group's columns that loads and stores each dgamma/dbeta accumulator once
 * per group instead of once per row (that traffic dominates a 768-wide float32 row in cache).
 * Each element's arithmetic, and the order in which the rows add to an accumulator, are those of
 * the single-row pass row after row: the same bits. A group with a row that the group pass does
 * not take as it is, or whose dx streams (rows from memory), goes row by row, keeping the first
 * passes already taken. mean and rstd are the group's entries of the cache. streamed: NULL, or
 * the line shared with the previous row (fastln_row_parts_of); next_row_follows: the row after
 * these is written next, by this thread. n_fetch: how many of the rows after these the group's
 * write pass fetches as it goes (fetch_rows_at; 0: none). */
FASTLN_INLINE void FASTLN_NAME(layer_norm_backward_rows)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *mean,
    const FASTLN_P *rstd, double eps, FASTLN_T *dx, int64_t n_rows, int64_t n_cols,
    FASTLN_P *dgamma_acc, FASTLN_P *dbeta_acc, fastln_shared_line *streamed,
    int next_row_follows, int64_t n_fetch)
{
    fastln_ln_backward_sums sums[FASTLN_BACKWARD_GROUP];
    int grouped = n_rows <= FASTLN_BACKWARD_GROUP && !streamed;
    int64_t n_summed = 0;
    for (; grouped && n_summed < n_rows; n_summed++) {
        const int64_t r = n_summed;
        FASTLN_NAME(ln_backward_first_pass)(dy + r * n_cols, x + r * n_cols, gamma,
                                            (double)mean[r], (double)rstd[r], n_cols, &sums[r]);
        grouped = isfinite(sums[r].total_dxhat_xhat)
                  && !FASTLN_NAME(ln_backward_maybe_underflow)(&sums[r])
                  && (FASTLN_NAME(ln_backward_in_floats)(&sums[r]) || !FASTLN_COMPUTE_F32);
    }
    if (!grouped) {
        for (int64_t r = 0; r < n_rows; r++) {
            fastln_ln_backward_sums row_sums;
            const fastln_ln_backward_sums *row = r < n_summed ? &sums[r] : &row_sums;
            if (r >= n_summed)
                FASTLN_NAME(ln_backward_first_pass)(dy + r * n_cols, x + r * n_cols, gamma,
                                                    (double)mean[r], (double)rstd[r], n_cols,
                                                    &row_sums);
            FASTLN_NAME(ln_backward_row_from_sums)(dy + r * n_cols, x + r * n_cols, gamma, eps,
                                                   dx + r * n_cols, n_cols, row, dgamma_acc,
                                                   dbeta_acc, streamed,
                                                   r + 1 < n_rows || next_row_follows);
        }
        return;
    }
    /* The columns up to dx's next cache line first, as the single-row pass does; the rows all
     * start at the same offset from a line only when a row is a whole number of lines. */
    const int64_t head = fastln_rows_head(dx, sizeof(FASTLN_T), n_cols);
    if (head > 0)
        FASTLN_NAME(ln_backward_write_rows)(dy, x, gamma, dx, n_rows, n_cols, head, sums,
                                            dgamma_acc, dbeta_acc, 0);
    FASTLN_NAME(ln_backward_write_rows)(dy + head, x + head, gamma ? gamma + head : NULL,
                                        dx + head, n_rows, n_cols, n_cols - head, sums,
                                        dgamma_acc + head, dbeta_acc + head, n_fetch);
}

/* ---- RMSNorm ------------------------------------------------------------------------------
 * With x_hat = x * rstd and dx_hat = dy * gamma:
 *     dx = rstd * (dx_hat - x_hat * mean(dx_hat * x_hat)),   dgamma += dy * x_hat
 * (LayerNorm's identity without the mean terms). dgamma accumulates in double for every type. */

/* The last block's dy, x and gamma (1 without gamma), padded with zeros: they add exactly zero.
 * Returns padded, or NULL without a partial block (as ln_backward_pad). */
FASTLN_INLINE const FASTLN_P *FASTLN_NAME(rms_backward_pad)(const FASTLN_T *dy, const FASTLN_T *x,
                                                           const FASTLN_P *gamma, int64_t n_whole,
                                                           int64_t n_cols,
                                                           FASTLN_P padded[3 * FASTLN_SLOTS])
{
    if (n_whole == n_cols) return NULL;
    for (int k = 0; k < FASTLN_SLOTS; k++) {
        const int inside = n_whole + k < n_cols;
        padded[k] = inside ? FASTLN_NAME(to_compute)(dy[n_whole + k]) : 0;
        padded[FASTLN_SLOTS + k] = inside ? FASTLN_NAME(to_compute)(x[n_whole + k]) : 0;
        padded[2 * FASTLN_SLOTS + k] = inside ? (gamma ? gamma[n_whole + k] : 1) : 0;
    }
    return padded;
}

/* sum(dx_hat * x_hat) for one block's elements of this pass's slots, x_hat = x * x_scale in
 * double; for the float32-compute types dx_hat is formed in float (one rounding, relative to
 * itself) and widened. The padded block (dy NULL) holds zeros. */
FASTLN_INLINE void FASTLN_NAME(rms_backward_add_block)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *padded,
    int64_t at, double x_scale, FASTLN_VD sum[FASTLN_PASS_VECTORS])
{
    FASTLN_UNROLL
    for (int j = 0; j < FASTLN_PASS_VECTORS / 2; j++) {
        const int64_t e = at + j * FASTLN_VF_LANES;
        const FASTLN_P *scale = gamma ? (dy ? gamma + e : padded + 2 * FASTLN_SLOTS + e) : NULL;
        FASTLN_VD dx_hat[2], x_v[2];
#if FASTLN_COMPUTE_F32
        FASTLN_VF dx_hat_v = dy ? FASTLN_NAME(load_c)(dy + e) : FASTLN_NAME(load_p)(padded + e);
        if (scale) dx_hat_v *= FASTLN_NAME(load_p)(scale);
        dx_hat[0] = FASTLN_ISA(widen_low)(dx_hat_v);
        dx_hat[1] = FASTLN_ISA(widen_high)(dx_hat_v);
#else
        if (dy)
            FASTLN_NAME(load_wide)(dy + e, &dx_hat[0], &dx_hat[1]);
        else
            FASTLN_NAME(load_wide_p)(padded + e, &dx_hat[0], &dx_hat[1]);
        if (scale) {
            FASTLN_VD scale_v[2];
            FASTLN_NAME(load_wide_p)(scale, &scale_v[0], &scale_v[1]);
            dx_hat[0] *= scale_v[0];
            dx_hat[1] *= scale_v[1];
        }
#endif
        if (dy)
            FASTLN_NAME(load_wide)(x + e, &x_v[0], &x_v[1]);
        else
            FASTLN_NAME(load_wide_p)(padded + FASTLN_SLOTS + e, &x_v[0], &x_v[1]);
        sum[2 * j] += dx_hat[0] * (x_v[0] * x_scale);
        sum[2 * j + 1] += dx_hat[1] * (x_v[1] * x_scale);
    }
}

/* mean(dx_hat * x_hat) of a row in double, in the slot order: the float64 pass, and the float32
 * pass's fallback (below). */
FASTLN_OUTLINED double FASTLN_NAME(rms_backward_mean_double)(const FASTLN_T *dy, const FASTLN_T *x,
                                                           const FASTLN_P *gamma, double x_scale,
                                                           int64_t n_cols)
{
    const int64_t n_whole = n_cols - n_cols % FASTLN_SLOTS;
    FASTLN_P padded[3 * FASTLN_SLOTS]; /* the last block's dy, x and gamma */
    FASTLN_NAME(rms_backward_pad)(dy, x, gamma, n_whole, n_cols, padded);
    double slots[FASTLN_SLOTS];
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_PASS_SLOTS) {
        FASTLN_VD sum[FASTLN_PASS_VECTORS] = {0};
        for (int64_t i = 0; i < n_whole; i += FASTLN_SLOTS)
            FASTLN_NAME(rms_backward_add_block)(dy, x, gamma, NULL, i + first, x_scale, sum);
        if (n_whole < n_cols)
            FASTLN_NAME(rms_backward_add_block)(NULL, NULL, gamma, padded, first, x_scale, sum);
        memcpy(slots + first, sum, sizeof sum);
    }
    return fastln_reduce_slots(slots) / (double)n_cols;
}

#if FASTLN_COMPUTE_F32
/* The float runs of sum(dx_hat * x_hat) into the slots' double totals, by the rule of
 * LayerNorm's float first pass, x_hat = x * x_scale formed in float; inlined with and without
 * gamma. */
FASTLN_INLINE void FASTLN_NAME(rms_backward_float_slots)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *padded,
    float x_scale, int64_t n_cols, double slots[FASTLN_SLOTS])
{
    const int64_t n_whole = n_cols - n_cols % FASTLN_SLOTS;
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_FLOAT_PASS_SLOTS)
        for (int64_t run = 0; run < n_cols; run += FASTLN_FLOAT_RUN * FASTLN_SLOTS) {
            FASTLN_VF sum[FASTLN_FLOAT_PASS_VECTORS] = {0};
            int padded_block;
            const int64_t whole_end =
                fastln_float_run_end(run, FASTLN_FLOAT_RUN, n_whole, n_cols, &padded_block);
            for (int64_t i = run; i < whole_end; i += FASTLN_SLOTS) {
                FASTLN_UNROLL
                for (int j = 0; j < FASTLN_FLOAT_PASS_VECTORS; j++) {
                    const int64_t e = i + first + j * FASTLN_VF_LANES;
                    const FASTLN_VF dx_hat = FASTLN_NAME(float_dx_hat)(dy, gamma, e);
                    sum[j] += dx_hat * (FASTLN_NAME(load_c)(x + e) * x_scale);
                }
            }
            if (padded_block) {
                FASTLN_UNROLL
                for (int j = 0; j < FASTLN_FLOAT_PASS_VECTORS; j++) {
                    const int64_t e = first + j * FASTLN_VF_LANES;
                    const FASTLN_VF dx_hat = FASTLN_NAME(padded_dx_hat)(padded, e);
                    sum[j] += dx_hat * (FASTLN_NAME(load_p)(padded + FASTLN_SLOTS + e) * x_scale);
                }
            }
            FASTLN_NAME(fold_floats)(sum, slots + first, run == 0);
        }
}
#endif

/* mean(dx_hat * x_hat) of a row: in float runs for the float32-compute types whose x_scale fits
 * a float, when those hold (floats_hold); in double otherwise. */
FASTLN_OUTLINED double FASTLN_NAME(rms_backward_mean)(const FASTLN_T *dy, const FASTLN_T *x,
                                                    const FASTLN_P *gamma, double x_scale,
                                                    int64_t n_cols)
{
#if FASTLN_COMPUTE_F32
    if (fastln_scale_fits_float(x_scale)) {
        const int64_t n_whole = n_cols - n_cols % FASTLN_SLOTS;
        FASTLN_P padded[3 * FASTLN_SLOTS]; /* the last block's dy, x and gamma */
        const FASTLN_P *last_block =
            FASTLN_NAME(rms_backward_pad)(dy, x, gamma, n_whole, n_cols, padded);
        double slots[FASTLN_SLOTS];
        if (gamma)
            FASTLN_NAME(rms_backward_float_slots)(dy, x, gamma, last_block, (float)x_scale,
                                                  n_cols, slots);
        else
            FASTLN_NAME(rms_backward_float_slots)(dy, x, NULL, last_block, (float)x_scale,
                                                  n_cols, slots);
        const double total = fastln_reduce_slots(slots);
        if (FASTLN_NAME(floats_hold)(dy, n_cols, total)) return total / (double)n_cols;
    }
#endif
    return FASTLN_NAME(rms_backward_mean_double)(dy, x, gamma, x_scale, n_cols);
}

/* Whether the float write pass takes the row: float32-compute rows whose rstd fits a float
 * (not the 0 x_scale of an all-zero row with eps = 0, nor NaN). */
FASTLN_INLINE int FASTLN_NAME(rms_backward_in_floats)(const fastln_rms_backward_row *row)
{
#if FASTLN_COMPUTE_F32
    return fastln_scale_fits_float(row->x_scale) && row->rstd == row->x_scale;
#else
    (void)row;
    return 0;
#endif
}

/* The double write pass over the n_vectors * VF_LANES columns at i of n_rows consecutive rows
 * (stride elements apart; one row, or a group): each dgamma accumulator is loaded and stored
 * once, and the rows add to it in row order. With streaming (a single row), the next row is
 * prefetched and dx stored non-temporally (stream_dx: dx aligned). */
FASTLN_INLINE void FASTLN_NAME(rms_backward_double_chunk)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t stride, int64_t i, const int n_vectors, const fastln_rms_backward_row *rows,
    double *dgamma_acc, int streaming, int stream_dx, int64_t n_fetch)
{
    FASTLN_VD dgamma[FASTLN_STEP / FASTLN_VF_LANES][2], scale[FASTLN_STEP / FASTLN_VF_LANES][2];
    FASTLN_UNROLL
    for (int v = 0; v < n_vectors; v++) {
        const int64_t column = i + v * FASTLN_VF_LANES;
        dgamma[v][0] = FASTLN_ISA(load_f64)(dgamma_acc + column);
        dgamma[v][1] = FASTLN_ISA(load_f64)(dgamma_acc + column + FASTLN_VD_LANES);
        if (gamma)
            FASTLN_NAME(load_wide_p)(gamma + column, &scale[v][0], &scale[v][1]);
        else /* unread: set only so that GCC does not see it read uninitialized */
            scale[v][0] = scale[v][1] = (FASTLN_VD){0};
    }
    if (streaming) {
        FASTLN_NAME(prefetch_step_ahead)(dy + i, stride);
        FASTLN_NAME(prefetch_step_ahead)(x + i, stride);
    }
    if (n_fetch) FASTLN_NAME(fetch_rows_at)(dy, x, dx, n_rows, n_fetch, stride, i);
    for (int64_t r = 0; r < n_rows; r++) {
        FASTLN_UNROLL
        for (int v = 0; v < n_vectors; v++) {
            const int64_t at = r * stride + i + v * FASTLN_VF_LANES;
            FASTLN_VD dy_v[2], x_hat[2], dx_v[2];
            FASTLN_NAME(load_wide)(dy + at, &dy_v[0], &dy_v[1]);
            FASTLN_NAME(load_wide)(x + at, &x_hat[0], &x_hat[1]);
            FASTLN_UNROLL
            for (int h = 0; h < 2; h++) {
                x_hat[h] *= rows[r].x_scale;
                const FASTLN_VD dx_hat = gamma ? dy_v[h] * scale[v][h] : dy_v[h];
                dgamma[v][h] += dy_v[h] * x_hat[h];
                dx_v[h] = rows[r].rstd * (dx_hat - x_hat[h] * rows[r].mean_dxhat_xhat);
            }
            FASTLN_NAME(store_wide_to)(dx + at, dx_v[0], dx_v[1], stream_dx);
        }
    }
    FASTLN_UNROLL
    for (int v = 0; v < n_vectors; v++) {
        const int64_t column = i + v * FASTLN_VF_LANES;
        FASTLN_ISA(store_f64)(dgamma_acc + column, dgamma[v][0]);
        FASTLN_ISA(store_f64)(dgamma_acc + column + FASTLN_VD_LANES, dgamma[v][1]);
    }
}

/* The double write pass over width columns of n_rows consecutive rows, a cache line of each
 * row at a time. */
FASTLN_OUTLINED void FASTLN_NAME(rms_backward_write_rows_double)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_rms_backward_row *rows, double *dgamma_acc,
    int streaming, int64_t n_fetch)
{
    const int stream_dx = streaming && fastln_is_aligned16(dx);
    int64_t i = 0;
    for (; i + FASTLN_STEP <= width; i += FASTLN_STEP)
        FASTLN_NAME(rms_backward_double_chunk)(dy, x, gamma, dx, n_rows, stride, i,
                                               FASTLN_STEP / FASTLN_VF_LANES, rows, dgamma_acc,
                                               streaming, stream_dx, n_fetch);
    if (n_fetch) FASTLN_NAME(fetch_rows_rest)(dy, x, dx, n_rows, n_fetch, stride, i, width);
    for (; i + FASTLN_VF_LANES <= width; i += FASTLN_VF_LANES)
        FASTLN_NAME(rms_backward_double_chunk)(dy, x, gamma, dx, n_rows, stride, i, 1, rows,
                                               dgamma_acc, 0, stream_dx, 0);
    /* float64 rows fence each row, as the forward's (fastln/forward.h, ln_write_double). */
    if (stream_dx && !FASTLN_COMPUTE_F32) fastln_streaming_fence();
    for (; i < width; i++)
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t at = r * stride + i;
            const double dy_i = FASTLN_NAME(to_double)(dy[at]);
            const double x_hat = FASTLN_NAME(to_double)(x[at]) * rows[r].x_scale;
            const double dx_hat = gamma ? dy_i * (double)gamma[i] : dy_i;
            dgamma_acc[i] += dy_i * x_hat;
            dx[at] = FASTLN_NAME(from_double)(rows[r].rstd
                                              * (dx_hat - x_hat * rows[r].mean_dxhat_xhat));
        }
}

#if FASTLN_COMPUTE_F32
/* dx = (dx_hat - x_hat * mean) * rstd for VF_LANES elements from their dy and x vectors, each
 * product rounded once; dy * x_hat, the dgamma term, in *dgamma_v. gamma_v as in
 * ln_backward_dx_float_of. */
FASTLN_INLINE FASTLN_VF FASTLN_NAME(rms_backward_dx_float_of)(
    FASTLN_VF dy_v, FASTLN_VF x_v, const FASTLN_VF *gamma_v, float rstd, float mean,
    FASTLN_VF *dgamma_v)
{
    const FASTLN_VF x_hat = x_v * rstd;
    const FASTLN_VF dx_hat = gamma_v ? dy_v * *gamma_v : dy_v;
    *dgamma_v = dy_v * x_hat;
    return (dx_hat - x_hat * mean) * rstd;
}

/* The float write pass over the n_vectors * VF_LANES columns at i of n_rows rows, all of which
 * rms_backward_in_floats takes: dx = (dx_hat - x_hat * mean) * rstd in float, each product
 * rounded once, dy * x_hat widened into the double accumulators (streaming as the double). */
FASTLN_INLINE void FASTLN_NAME(rms_backward_float_chunk)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t stride, int64_t i, const int n_vectors, const float *rstd, const float *mean,
    double *dgamma_acc, int streaming, int stream_dx, int64_t n_fetch)
{
    FASTLN_VD dgamma[FASTLN_STEP / FASTLN_VF_LANES][2];
    FASTLN_VF gamma_v[FASTLN_STEP / FASTLN_VF_LANES]; /* loaded once for all the rows */
    FASTLN_UNROLL
    for (int v = 0; v < n_vectors; v++) {
        const int64_t column = i + v * FASTLN_VF_LANES;
        dgamma[v][0] = FASTLN_ISA(load_f64)(dgamma_acc + column);
        dgamma[v][1] = FASTLN_ISA(load_f64)(dgamma_acc + column + FASTLN_VD_LANES);
        gamma_v[v] = gamma ? FASTLN_NAME(load_p)(gamma + column) : (FASTLN_VF){0};
    }
    if (streaming) {
        FASTLN_NAME(prefetch_step_ahead)(dy + i, stride);
        FASTLN_NAME(prefetch_step_ahead)(x + i, stride);
    }
    if (n_fetch) FASTLN_NAME(fetch_rows_at)(dy, x, dx, n_rows, n_fetch, stride, i);
    for (int64_t r = 0; r < n_rows; r++) {
        FASTLN_UNROLL
        for (int v = 0; v < n_vectors; v++) {
            const int64_t column = i + v * FASTLN_VF_LANES, at = r * stride + column;
            FASTLN_VF dgamma_v;
            FASTLN_NAME(store_c_to)(dx + at, FASTLN_NAME(rms_backward_dx_float_of)(
                FASTLN_NAME(load_c)(dy + at), FASTLN_NAME(load_c)(x + at),
                gamma ? &gamma_v[v] : NULL, rstd[r], mean[r], &dgamma_v), stream_dx);
            dgamma[v][0] += FASTLN_ISA(widen_low)(dgamma_v);
            dgamma[v][1] += FASTLN_ISA(widen_high)(dgamma_v);
        }
    }
    FASTLN_UNROLL
    for (int v = 0; v < n_vectors; v++) {
        const int64_t column = i + v * FASTLN_VF_LANES;
        FASTLN_ISA(store_f64)(dgamma_acc + column, dgamma[v][0]);
        FASTLN_ISA(store_f64)(dgamma_acc + column + FASTLN_VD_LANES, dgamma[v][1]);
    }
}

/* The float write pass over width columns of n_rows rows, a cache line of each at a time. */
FASTLN_OUTLINED void FASTLN_NAME(rms_backward_write_rows_float)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t stride, int64_t width, const fastln_rms_backward_row *rows, double *dgamma_acc,
    int streaming, int64_t n_fetch)
{
    const int stream_dx = streaming && fastln_is_aligned16(dx);
    float rstd[FASTLN_BACKWARD_GROUP], mean[FASTLN_BACKWARD_GROUP];
    for (int64_t r = 0; r < n_rows; r++) {
        rstd[r] = (float)rows[r].rstd;
        mean[r] = (float)rows[r].mean_dxhat_xhat;
    }
    int64_t i = 0;
    for (; i + FASTLN_STEP <= width; i += FASTLN_STEP)
        FASTLN_NAME(rms_backward_float_chunk)(dy, x, gamma, dx, n_rows, stride, i,
                                              FASTLN_STEP / FASTLN_VF_LANES, rstd, mean,
                                              dgamma_acc, streaming, stream_dx, n_fetch);
    if (n_fetch) FASTLN_NAME(fetch_rows_rest)(dy, x, dx, n_rows, n_fetch, stride, i, width);
    for (; i + FASTLN_VF_LANES <= width; i += FASTLN_VF_LANES)
        FASTLN_NAME(rms_backward_float_chunk)(dy, x, gamma, dx, n_rows, stride, i, 1, rstd, mean,
                                              dgamma_acc, 0, stream_dx, 0);
#if FASTLN_MASKED
    /* The last columns in one masked vector per row, as LayerNorm's float pass does. */
    if (i < width) {
        const int64_t n = width - i, n_low = fastln_min(n, FASTLN_VD_LANES);
        FASTLN_VD dgamma_low = FASTLN_ISA(load_f64_first)(dgamma_acc + i, n_low);
        FASTLN_VD dgamma_high = FASTLN_ISA(load_f64_first)(dgamma_acc + i + FASTLN_VD_LANES,
                                                           n - n_low);
        const FASTLN_VF gamma_v = gamma ? FASTLN_ISA(load_f32_first)(gamma + i, n)
                                        : (FASTLN_VF){0};
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t at = r * stride + i;
            FASTLN_VF dgamma_v;
            FASTLN_NAME(store_c_first)(dx + at, FASTLN_NAME(rms_backward_dx_float_of)(
                FASTLN_NAME(load_c_first)(dy + at, n), FASTLN_NAME(load_c_first)(x + at, n),
                gamma ? &gamma_v : NULL, rstd[r], mean[r], &dgamma_v), n);
            dgamma_low += FASTLN_ISA(widen_low)(dgamma_v);
            dgamma_high += FASTLN_ISA(widen_high)(dgamma_v);
        }
        FASTLN_ISA(store_f64_first)(dgamma_acc + i, dgamma_low, n_low);
        FASTLN_ISA(store_f64_first)(dgamma_acc + i + FASTLN_VD_LANES, dgamma_high, n - n_low);
        return;
    }
#endif
    for (; i < width; i++)
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t at = r * stride + i;
            const float dy_i = FASTLN_NAME(to_compute)(dy[at]);
            const float x_hat = FASTLN_NAME(to_compute)(x[at]) * rstd[r];
            const float dx_hat = gamma ? dy_i * gamma[i] : dy_i;
            dgamma_acc[i] += (double)(dy_i * x_hat);
            dx[at] = FASTLN_NAME(from_compute)((dx_hat - x_hat * mean[r]) * rstd[r]);
        }
}
#endif

/* Columns [start, start + width) of the write pass over n_rows consecutive rows (one, or a
 * group), to `to` (dx + start, or where a streamed row's part waits: fastln_row_parts_of). */
FASTLN_INLINE void FASTLN_NAME(rms_backward_write_part)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *to, int64_t n_rows,
    int64_t n_cols, int64_t start, int64_t width, const fastln_rms_backward_row *rows,
    double *dgamma_acc, int streaming)
{
    if (width == 0) return;
#if FASTLN_COMPUTE_F32
    if (FASTLN_NAME(rms_backward_in_floats)(&rows[0])) {
        FASTLN_NAME(rms_backward_write_rows_float)(
            dy + start, x + start, gamma ? gamma + start : NULL, to, n_rows, n_cols, width, rows,
            dgamma_acc + start, streaming, 0);
        return;
    }
#endif
    FASTLN_NAME(rms_backward_write_rows_double)(
        dy + start, x + start, gamma ? gamma + start : NULL, to, n_rows, n_cols, width, rows,
        dgamma_acc + start, streaming, 0);
}

/* The write pass over n_rows consecutive rows (one, or a group): the columns up to dx's next
 * cache line first, then whole-line stores. The rows of a group all start at the same offset
 * from a line only when a row is a whole number of lines; otherwise the group is stored as it
 * comes. A group only holds rows the float pass takes (rms_norm_backward_rows). n_fetch as
 * for layer_norm_backward_rows. */
FASTLN_INLINE void FASTLN_NAME(rms_backward_write)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_rows,
    int64_t n_cols, const fastln_rms_backward_row *rows, double *dgamma_acc, int64_t n_fetch)
{
    const int64_t head = n_rows == 1 ? fastln_elements_to_line(dx, sizeof(FASTLN_T), n_cols)
                                     : fastln_rows_head(dx, sizeof(FASTLN_T), n_cols);
    /* Its own loop, not two calls of rms_backward_write_part: GCC compiled that form slower in
     * cache for float32 (docs/performance.md). */
    for (int piece = 0; piece < 2; piece++) {
        const int64_t start = piece == 0 ? 0 : head;
        const int64_t width = piece == 0 ? head : n_cols - head;
        const int64_t fetch = piece == 0 ? 0 : n_fetch;
        if (width == 0) continue;
#if FASTLN_COMPUTE_F32
        if (FASTLN_NAME(rms_backward_in_floats)(&rows[0])) {
            FASTLN_NAME(rms_backward_write_rows_float)(
                dy + start, x + start, gamma ? gamma + start : NULL, dx + start, n_rows, n_cols,
                width, rows, dgamma_acc + start, 0, fetch);
            continue;
        }
#endif
        FASTLN_NAME(rms_backward_write_rows_double)(
            dy + start, x + start, gamma ? gamma + start : NULL, dx + start, n_rows, n_cols,
            width, rows, dgamma_acc + start, 0, fetch);
    }
}

/* The write pass of one streamed row, in the parts of fastln_row_parts_of. */
FASTLN_INLINE void FASTLN_NAME(rms_backward_write_streamed)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, FASTLN_T *dx, int64_t n_cols,
    const fastln_rms_backward_row *row, double *dgamma_acc, fastln_shared_line *streamed,
    int next_row_follows)
{
    const fastln_row_parts parts =
        fastln_row_parts_of(streamed, dx, sizeof(FASTLN_T), n_cols, next_row_follows);
    FASTLN_NAME(rms_backward_write_part)(dy, x, gamma, parts.head_to, 1, n_cols, 0, parts.head,
                                         row, dgamma_acc, 0);
    fastln_row_head_written(streamed, &parts);
    const int64_t i = parts.head;
    FASTLN_NAME(rms_backward_write_part)(dy, x, gamma, dx + i, 1, n_cols, i, parts.body, row,
                                         dgamma_acc, parts.stream_body);
    FASTLN_NAME(rms_backward_write_part)(dy, x, gamma, parts.tail_to, 1, n_cols, i + parts.body,
                                         parts.tail, row, dgamma_acc, 0);
    fastln_row_tail_written(streamed, &parts, dx, sizeof(FASTLN_T));
}

/* Backward of one row. x_hat is formed before any product, so rows of huge or tiny magnitude
 * neither overflow nor underflow. An all-zero row with eps = 0 (rstd = Inf) has x_hat = 0, as in
 * the forward; its dx is then Inf * dx_hat (the gradient of x / |x| at 0 does not exist). Any
 * other row with an Inf rstd has an rstd beyond the cache's range and is done from x (rare.h). */
FASTLN_INLINE void FASTLN_NAME(rms_norm_backward_row)(
    const FASTLN_T *dy, const FASTLN_T *FASTLN_RESTRICT x, const FASTLN_P *FASTLN_RESTRICT gamma,
    double rstd, double eps, FASTLN_T *dx, int64_t n_cols, double *FASTLN_RESTRICT dgamma_acc,
    fastln_shared_line *streamed, int next_row_follows)
{
    if (streamed && isinf(rstd)) fastln_shared_line_put(streamed);
    if (isinf(rstd)
        && FASTLN_NAME(rms_backward_row_recomputed)(dy, x, gamma, eps, dx, n_cols, dgamma_acc))
        return;
    fastln_rms_backward_row row;
    row.rstd = rstd;
    row.x_scale = fastln_rms_x_scale(rstd);
    row.mean_dxhat_xhat = FASTLN_NAME(rms_backward_mean)(dy, x, gamma, row.x_scale, n_cols);
    /* A mean beyond double (or float: dy * gamma) in a row of finite values: its products
     * overflowed (float64 dy near DBL_MAX), and the row is done from x, rescaled. */
    if (!isfinite(row.mean_dxhat_xhat) && !isinf(rstd)
        && FASTLN_NAME(row_is_finite)(dy, x, gamma, n_cols)) {
        if (streamed) fastln_shared_line_put(streamed);
        if (FASTLN_NAME(rms_backward_row_recomputed)(dy, x, gamma, eps, dx, n_cols, dgamma_acc))
            return;
    }
    if (streamed)
        FASTLN_NAME(rms_backward_write_streamed)(dy, x, gamma, dx, n_cols, &row, dgamma_acc,
                                                 streamed, next_row_follows);
    else
        FASTLN_NAME(rms_backward_write)(dy, x, gamma, dx, 1, n_cols, &row, dgamma_acc, 0);
}

/* Backward of n_rows <= FASTLN_BACKWARD_GROUP consecutive rows (rstd: their cache entries): each
 * row's mean(dx_hat * x_hat), then one write pass over the group's columns that loads and stores
 * each dgamma accumulator once per group. The same bits as row after row; a group with a row of
 * Inf rstd or one the float pass does not take, or whose dx streams (rows from memory), goes row
 * by row. streamed, next_row_follows and n_fetch as for layer_norm_backward_rows. */
FASTLN_INLINE void FASTLN_NAME(rms_norm_backward_rows)(
    const FASTLN_T *dy, const FASTLN_T *x, const FASTLN_P *gamma, const FASTLN_P *rstd,
    double eps, FASTLN_T *dx, int64_t n_rows, int64_t n_cols, double *dgamma_acc,
    fastln_shared_line *streamed, int next_row_follows, int64_t n_fetch)
{
    fastln_rms_backward_row rows[FASTLN_BACKWARD_GROUP];
    int grouped = n_rows <= FASTLN_BACKWARD_GROUP && !streamed;
    for (int64_t r = 0; grouped && r < n_rows; r++) {
        rows[r].rstd = (double)rstd[r];
        rows[r].x_scale = fastln_rms_x_scale(rows[r].rstd);
        grouped = !isinf(rows[r].rstd)
                  && (FASTLN_NAME(rms_backward_in_floats)(&rows[r]) || !FASTLN_COMPUTE_F32);
    }
    if (!grouped) {
        for (int64_t r = 0; r < n_rows; r++)
            FASTLN_NAME(rms_norm_backward_row)(dy + r * n_cols, x + r * n_cols, gamma,
                                               (double)rstd[r], eps, dx + r * n_cols, n_cols,
                                               dgamma_acc, streamed,
                                               r + 1 < n_rows || next_row_follows);
        return;
    }
    for (int64_t r = 0; grouped && r < n_rows; r++) {
        rows[r].mean_dxhat_xhat = FASTLN_NAME(rms_backward_mean)(
            dy + r * n_cols, x + r * n_cols, gamma, rows[r].x_scale, n_cols);
        grouped = isfinite(rows[r].mean_dxhat_xhat);
    }
    if (!grouped) { /* a row whose products overflowed (or holding NaN or Inf): row by row */
        for (int64_t r = 0; r < n_rows; r++)
            FASTLN_NAME(rms_norm_backward_row)(dy + r * n_cols, x + r * n_cols, gamma,
                                               (double)rstd[r], eps, dx + r * n_cols, n_cols,
                                               dgamma_acc, NULL, 0);
        return;
    }
    FASTLN_NAME(rms_backward_write)(dy, x, gamma, dx, n_rows, n_cols, rows, dgamma_acc, n_fetch);
}

#if FASTLN_MASKED && FASTLN_COMPUTE_F32
/* run_backward_sums' float slots for a run shorter than a block (a GroupNorm channel of a few
 * spatial positions), read where it is by masked loads instead of from a padded copy: the
 * missing lanes load dy = 0 and get d = +0, where the copy's dy = 0, x = mean gave 0, so each
 * slot ends as the float run leaves it (all FASTLN_SLOTS slots are one pass of
 * FASTLN_FLOAT_PASS_VECTORS vectors with AVX-512). */
FASTLN_INLINE void FASTLN_NAME(run_backward_first)(const FASTLN_T *dy, const FASTLN_T *x,
                                                   int64_t n, float mean,
                                                   double dy_slots[FASTLN_SLOTS],
                                                   double dy_d_slots[FASTLN_SLOTS],
                                                   double d_slots[FASTLN_SLOTS])
{
    FASTLN_VF sum_dy[FASTLN_FLOAT_PASS_VECTORS] = {0}, sum_dy_d[FASTLN_FLOAT_PASS_VECTORS] = {0};
    FASTLN_VF sum_d[FASTLN_FLOAT_PASS_VECTORS] = {0};
    FASTLN_UNROLL
    for (int j = 0; j < FASTLN_FLOAT_PASS_VECTORS; j++) {
        const int64_t at = j * FASTLN_VF_LANES;
        const int64_t count = fastln_max(fastln_min(n - at, FASTLN_VF_LANES), 0);
        const FASTLN_VF dy_v = FASTLN_NAME(load_c_first)(dy + at, count);
        const FASTLN_VF d =
            FASTLN_ISA(keep_first_f32)(FASTLN_NAME(load_c_first)(x + at, count) - mean, count);
        sum_dy[j] += dy_v;
        sum_dy_d[j] += dy_v * d;
        sum_d[j] += d;
    }
    FASTLN_NAME(fold_floats)(sum_dy, dy_slots, 1);
    FASTLN_NAME(fold_floats)(sum_dy_d, dy_d_slots, 1);
    FASTLN_NAME(fold_floats)(sum_d, d_slots, 1);
}
#endif

/* The three sums over a contiguous run of n values (a GroupNorm channel, a BatchNorm segment),
 * in LayerNorm's slot order and by its backward's first pass (ln_backward_first_pass, without
 * gamma): in float runs for the
 * float32-compute types when they hold, else in double (ln_backward_add_block), the last block
 * padded with dy = 0 and x = mean. sums: sum(dy), sum(dy * d), sum(d). */
FASTLN_OUTLINED void FASTLN_NAME(run_backward_sums)(const FASTLN_T *dy, const FASTLN_T *x,
                                                  int64_t n, double mean, double sums[3])
{
    const int64_t n_whole = n - n % FASTLN_SLOTS;
#if FASTLN_COMPUTE_F32
    /* The float32-compute types: LayerNorm's float runs (ln_backward_float_slots, without
     * gamma), by its rule - they stand when the sums are finite and floats_hold - else the
     * double pass below. */
    {
        double dy_slots[FASTLN_SLOTS], dy_d_slots[FASTLN_SLOTS], d_slots[FASTLN_SLOTS];
#if FASTLN_MASKED
        if (n < FASTLN_SLOTS) {
            FASTLN_NAME(run_backward_first)(dy, x, n, (float)mean, dy_slots, dy_d_slots, d_slots);
        } else
#endif
        {
            FASTLN_P floats_padded[3 * FASTLN_SLOTS]; /* the last block's dy, x, gamma of 1 */
            const FASTLN_P *last_block =
                FASTLN_NAME(ln_backward_pad)(dy, x, NULL, mean, n_whole, n, floats_padded);
            FASTLN_NAME(ln_backward_float_slots)(dy, x, NULL, last_block, (float)mean, n,
                                                 dy_slots, dy_d_slots, d_slots);
        }
        sums[0] = fastln_reduce_slots(dy_slots);
        sums[1] = fastln_reduce_slots(dy_d_slots);
        sums[2] = fastln_reduce_slots(d_slots);
        if (isfinite(sums[0]) && isfinite(sums[2]) && FASTLN_NAME(floats_hold)(dy, n, sums[1]))
            return;
    }
#endif
    FASTLN_P padded[3 * FASTLN_SLOTS]; /* the last block's dy and x (gamma unused) */
    if (n_whole < n)
        for (int k = 0; k < FASTLN_SLOTS; k++) {
            const int inside = n_whole + k < n;
            padded[k] = inside ? FASTLN_NAME(to_compute)(dy[n_whole + k]) : 0;
            padded[FASTLN_SLOTS + k] = inside ? FASTLN_NAME(to_compute)(x[n_whole + k])
                                              : (FASTLN_C)mean;
            padded[2 * FASTLN_SLOTS + k] = 1;
        }
    double dy_slots[FASTLN_SLOTS], dy_d_slots[FASTLN_SLOTS], d_slots[FASTLN_SLOTS];
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_PASS_SLOTS) {
        FASTLN_VD sum_dy[FASTLN_PASS_VECTORS] = {0}, sum_dy_d[FASTLN_PASS_VECTORS] = {0};
        FASTLN_VD sum_d[FASTLN_PASS_VECTORS] = {0};
        for (int64_t i = 0; i < n_whole; i += FASTLN_SLOTS)
            FASTLN_NAME(ln_backward_add_block)(dy, x, NULL, NULL, i + first, mean, sum_dy,
                                               sum_dy_d, sum_d);
        if (n_whole < n)
            FASTLN_NAME(ln_backward_add_block)(NULL, NULL, NULL, padded, first, mean, sum_dy,
                                               sum_dy_d, sum_d);
        memcpy(dy_slots + first, sum_dy, sizeof sum_dy);
        memcpy(dy_d_slots + first, sum_dy_d, sizeof sum_dy_d);
        memcpy(d_slots + first, sum_d, sizeof sum_d);
    }
    sums[0] = fastln_reduce_slots(dy_slots);
    sums[1] = fastln_reduce_slots(dy_d_slots);
    sums[2] = fastln_reduce_slots(d_slots);
}

/* ---- BatchNorm ------------------------------------------------------------------------------
 * Sums of dy, dy * d and d per feature, d = x - mean (in double: mean is the batch mean, not a
 * value of x), then dx feature by feature with the constants of fastln_bn_backward_constants. */

/* Rows layout: adds into the per-feature arrays sum_dy, sum_dy_d and sum_d. As the forward's
 * statistics (bn_stats_rows), the rows go in groups (of FASTLN_BN_BACKWARD_ROW_GROUP) and each
 * chunk of features keeps its sums in registers over a group; each feature adds its rows in row
 * order, so the bits are those of adding row after row. Chunks of two float vectors' worth of
 * features only with AVX-512, whose 32 registers hold their 16 vectors of sums and means. */

/* The sums of n_vectors float vectors' worth of features from c on, over n_rows rows. */
FASTLN_INLINE void FASTLN_NAME(bn_backward_sums_chunk)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows,
    int64_t row_stride, int64_t c, const int n_vectors, const double *FASTLN_RESTRICT mean,
    double *FASTLN_RESTRICT sum_dy, double *FASTLN_RESTRICT sum_dy_d,
    double *FASTLN_RESTRICT sum_d)
{
    FASTLN_VD m[4], s_dy[4], s_dy_d[4], s_d[4];
    FASTLN_UNROLL
    for (int k = 0; k < 2 * n_vectors; k++) {
        const int64_t at = c + k * FASTLN_VD_LANES;
        m[k] = FASTLN_ISA(load_f64)(mean + at);
        s_dy[k] = FASTLN_ISA(load_f64)(sum_dy + at);
        s_dy_d[k] = FASTLN_ISA(load_f64)(sum_dy_d + at);
        s_d[k] = FASTLN_ISA(load_f64)(sum_d + at);
    }
    for (int64_t r = 0; r < n_rows; r++) {
        FASTLN_UNROLL
        for (int j = 0; j < n_vectors; j++) {
            const int64_t at = r * row_stride + c + j * FASTLN_VF_LANES;
            FASTLN_PREFETCH_RUNS_AHEAD(dy + at, FASTLN_BN_BACKWARD_ROW_GROUP, row_stride);
            FASTLN_PREFETCH_RUNS_AHEAD(x + at, FASTLN_BN_BACKWARD_ROW_GROUP, row_stride);
            FASTLN_VD g[2], d[2];
            FASTLN_NAME(load_wide)(dy + at, &g[0], &g[1]);
            FASTLN_NAME(load_wide)(x + at, &d[0], &d[1]);
            FASTLN_UNROLL
            for (int h = 0; h < 2; h++) {
                const int k = 2 * j + h;
                const FASTLN_VD dev = d[h] - m[k];
                s_dy[k] += g[h];
                s_dy_d[k] += g[h] * dev;
                s_d[k] += dev;
            }
        }
    }
    FASTLN_UNROLL
    for (int k = 0; k < 2 * n_vectors; k++) {
        const int64_t at = c + k * FASTLN_VD_LANES;
        FASTLN_ISA(store_f64)(sum_dy + at, s_dy[k]);
        FASTLN_ISA(store_f64)(sum_dy_d + at, s_dy_d[k]);
        FASTLN_ISA(store_f64)(sum_d + at, s_d[k]);
    }
}

#if !FASTLN_COMPUTE_F32 /* the float32-compute types sum rows in float runs (below) */
FASTLN_OUTLINED void FASTLN_NAME(bn_backward_sums_rows)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows,
    int64_t n_features, int64_t row_stride, const double *FASTLN_RESTRICT mean,
    double *FASTLN_RESTRICT sum_dy, double *FASTLN_RESTRICT sum_dy_d,
    double *FASTLN_RESTRICT sum_d)
{
    for (int64_t first = 0; first < n_rows; first += FASTLN_BN_BACKWARD_ROW_GROUP) {
        const int64_t n = fastln_min(FASTLN_BN_BACKWARD_ROW_GROUP, n_rows - first);
        const FASTLN_T *dy_rows = dy + first * row_stride, *x_rows = x + first * row_stride;
        int64_t c = 0;
#if defined(__AVX512F__)
        for (; c + 2 * FASTLN_VF_LANES <= n_features; c += 2 * FASTLN_VF_LANES)
            FASTLN_NAME(bn_backward_sums_chunk)(dy_rows, x_rows, n, row_stride, c, 2, mean,
                                                sum_dy, sum_dy_d, sum_d);
#endif
        for (; c + FASTLN_VF_LANES <= n_features; c += FASTLN_VF_LANES)
            FASTLN_NAME(bn_backward_sums_chunk)(dy_rows, x_rows, n, row_stride, c, 1, mean,
                                                sum_dy, sum_dy_d, sum_d);
        for (; c < n_features; c++)
            for (int64_t r = 0; r < n; r++) {
                const double g = FASTLN_NAME(to_double)(dy_rows[r * row_stride + c]);
                const double d = FASTLN_NAME(to_double)(x_rows[r * row_stride + c]) - mean[c];
                sum_dy[c] += g;
                sum_dy_d[c] += g * d;
                sum_d[c] += d;
            }
    }
}
#endif

#if FASTLN_COMPUTE_F32
/* Rows layout, the float32-compute types: the three sums in float runs of
 * FASTLN_BN_BACKWARD_ROW_GROUP rows around shift[c] = the float nearest mean[c], each run's
 * partial added to the feature's double sums (fastln_bn_backward_move_sums then moves them to
 * the mean; bn_backward_rows_hold sends a feature they cannot hold to the double loop). The
 * features' chunks of three float vectors keep their 12 partials and shifts in AVX2's 16
 * registers. */
FASTLN_INLINE void FASTLN_NAME(bn_backward_float_chunk)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows,
    int64_t row_stride, int64_t c, const int n_vectors, const double *FASTLN_RESTRICT mean,
    double *FASTLN_RESTRICT sum_dy, double *FASTLN_RESTRICT sum_dy_d,
    double *FASTLN_RESTRICT sum_d, const int prefetch)
{
    float shift_f[3 * FASTLN_VF_LANES];
    for (int k = 0; k < n_vectors * FASTLN_VF_LANES; k++) shift_f[k] = (float)mean[c + k];
    FASTLN_VF sh[3], s_dy[3] = {0}, s_dy_d[3] = {0}, s_d[3] = {0};
    FASTLN_UNROLL
    for (int j = 0; j < n_vectors; j++) sh[j] = FASTLN_ISA(load_f32)(shift_f + j * FASTLN_VF_LANES);
    for (int64_t r = 0; r < n_rows; r++) {
        FASTLN_UNROLL
        for (int j = 0; j < n_vectors; j++) {
            const int64_t at = r * row_stride + c + j * FASTLN_VF_LANES;
            if (prefetch && j * FASTLN_VF_LANES % FASTLN_LINE == 0) {
                FASTLN_PREFETCH_RUNS_AHEAD(dy + at, FASTLN_BN_BACKWARD_ROW_GROUP, row_stride);
                FASTLN_PREFETCH_RUNS_AHEAD(x + at, FASTLN_BN_BACKWARD_ROW_GROUP, row_stride);
            }
            const FASTLN_VF g = FASTLN_NAME(load_c)(dy + at);
            const FASTLN_VF d = FASTLN_NAME(load_c)(x + at) - sh[j];
            s_dy[j] += g;
            s_dy_d[j] += g * d;
            s_d[j] += d;
        }
    }
    FASTLN_UNROLL
    for (int j = 0; j < n_vectors; j++) {
        double *totals[3] = {sum_dy + c + j * FASTLN_VF_LANES, sum_dy_d + c + j * FASTLN_VF_LANES,
                             sum_d + c + j * FASTLN_VF_LANES};
        const FASTLN_VF partials[3] = {s_dy[j], s_dy_d[j], s_d[j]};
        for (int i = 0; i < 3; i++) {
            const FASTLN_VD low = FASTLN_ISA(widen_low)(partials[i])
                                  + FASTLN_ISA(load_f64)(totals[i]);
            const FASTLN_VD high = FASTLN_ISA(widen_high)(partials[i])
                                   + FASTLN_ISA(load_f64)(totals[i] + FASTLN_VD_LANES);
            FASTLN_ISA(store_f64)(totals[i], low);
            FASTLN_ISA(store_f64)(totals[i] + FASTLN_VD_LANES, high);
        }
    }
}

FASTLN_INLINE void FASTLN_NAME(bn_backward_float_rows_to)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows,
    int64_t n_features, int64_t row_stride, const double *FASTLN_RESTRICT mean,
    double *FASTLN_RESTRICT sum_dy, double *FASTLN_RESTRICT sum_dy_d,
    double *FASTLN_RESTRICT sum_d, const int prefetch)
{
    for (int64_t first = 0; first < n_rows; first += FASTLN_BN_BACKWARD_ROW_GROUP) {
        const int64_t n = fastln_min(FASTLN_BN_BACKWARD_ROW_GROUP, n_rows - first);
        const FASTLN_T *dy_rows = dy + first * row_stride, *x_rows = x + first * row_stride;
        int64_t c = 0;
        for (; c + 3 * FASTLN_VF_LANES <= n_features; c += 3 * FASTLN_VF_LANES)
            FASTLN_NAME(bn_backward_float_chunk)(dy_rows, x_rows, n, row_stride, c, 3, mean,
                                                 sum_dy, sum_dy_d, sum_d, prefetch);
        for (; c + FASTLN_VF_LANES <= n_features; c += FASTLN_VF_LANES)
            FASTLN_NAME(bn_backward_float_chunk)(dy_rows, x_rows, n, row_stride, c, 1, mean,
                                                 sum_dy, sum_dy_d, sum_d, prefetch);
        for (; c < n_features; c++) {
            const float shift = (float)mean[c];
            float s_dy = 0.0f, s_dy_d = 0.0f, s_d = 0.0f;
            for (int64_t r = 0; r < n; r++) {
                const float g = FASTLN_NAME(to_compute)(dy_rows[r * row_stride + c]);
                const float d = FASTLN_NAME(to_compute)(x_rows[r * row_stride + c]) - shift;
                s_dy += g;
                s_dy_d += g * d;
                s_d += d;
            }
            sum_dy[c] += (double)s_dy;
            sum_dy_d[c] += (double)s_dy_d;
            sum_d[c] += (double)s_d;
        }
    }
}

/* With prefetch set (inputs of BN_MIN_BYTES_FOR_STREAMING and more: call->streaming), each
 * chunk prefetches its rows (FASTLN_PREFETCH_RUNS_AHEAD); in cache they cost more than they save
 * (docs/performance.md, "Channels-last GroupNorm's two passes"). */
FASTLN_OUTLINED void FASTLN_NAME(bn_backward_float_rows)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t n_rows,
    int64_t n_features, int64_t row_stride, const double *FASTLN_RESTRICT mean,
    double *FASTLN_RESTRICT sum_dy, double *FASTLN_RESTRICT sum_dy_d,
    double *FASTLN_RESTRICT sum_d, int prefetch)
{
    if (prefetch)
        FASTLN_NAME(bn_backward_float_rows_to)(dy, x, n_rows, n_features, row_stride, mean,
                                               sum_dy, sum_dy_d, sum_d, 1);
    else
        FASTLN_NAME(bn_backward_float_rows_to)(dy, x, n_rows, n_features, row_stride, mean,
                                               sum_dy, sum_dy_d, sum_d, 0);
}

/* Whether feature c's float sums (moved to the mean) stand, by LayerNorm's rule (floats_hold):
 * finite, and sum(dy * d) not so small that products below float's normal range could matter,
 * all-zero dy aside; else they are taken again in double, row after row. */
FASTLN_INLINE void FASTLN_NAME(bn_backward_rows_hold)(const FASTLN_T *dy, const FASTLN_T *x,
                                                      int64_t n_rows, int64_t n_features,
                                                      int64_t c, double mean, double *sum_dy,
                                                      double *sum_dy_d, double *sum_d)
{
    if (isfinite(*sum_dy) && isfinite(*sum_d)
        && FASTLN_NAME(floats_hold_runs)(dy + c, n_rows, 1, n_features, *sum_dy_d))
        return;
    double s_dy = 0.0, s_dy_d = 0.0, s_d = 0.0;
    for (int64_t r = 0; r < n_rows; r++) {
        const double g = FASTLN_NAME(to_double)(dy[r * n_features + c]);
        const double d = FASTLN_NAME(to_double)(x[r * n_features + c]) - mean;
        s_dy += g;
        s_dy_d += g * d;
        s_d += d;
    }
    *sum_dy = s_dy;
    *sum_dy_d = s_dy_d;
    *sum_d = s_d;
}
#endif

/* The three sums for this pass's slots of one block: from the segment, or (dy NULL) from
 * padded[0..1], the block's dy and d already in double (zeros beyond the segment). */
FASTLN_INLINE void FASTLN_NAME(bn_backward_add_block)(
    const FASTLN_T *dy, const FASTLN_T *x, const double (*padded)[FASTLN_SLOTS], int64_t at,
    double mean, FASTLN_VD sum_dy[FASTLN_PASS_VECTORS], FASTLN_VD sum_dy_d[FASTLN_PASS_VECTORS],
    FASTLN_VD sum_d[FASTLN_PASS_VECTORS])
{
    FASTLN_UNROLL
    for (int j = 0; j < FASTLN_PASS_VECTORS / 2; j++) {
        const int64_t e = at + j * FASTLN_VF_LANES;
        FASTLN_VD g[2], d[2];
        if (dy) {
            FASTLN_NAME(load_wide)(dy + e, &g[0], &g[1]);
            FASTLN_NAME(load_wide)(x + e, &d[0], &d[1]);
            d[0] -= mean;
            d[1] -= mean;
        } else {
            g[0] = FASTLN_ISA(load_f64)(padded[0] + e);
            g[1] = FASTLN_ISA(load_f64)(padded[0] + e + FASTLN_VD_LANES);
            d[0] = FASTLN_ISA(load_f64)(padded[1] + e);
            d[1] = FASTLN_ISA(load_f64)(padded[1] + e + FASTLN_VD_LANES);
        }
        FASTLN_UNROLL
        for (int h = 0; h < 2; h++) {
            sum_dy[2 * j + h] += g[h];
            sum_dy_d[2 * j + h] += g[h] * d[h];
            sum_d[2 * j + h] += d[h];
        }
    }
}

#if FASTLN_COMPUTE_F32
/* One run's segments [first, last), n_vectors float vectors of positions from v on, their float
 * sums kept in registers over the run (indexed by a run-time count, GCC kept them on the stack,
 * and each add waited for the last one's store), then added to the positions' double sums. */
FASTLN_INLINE void FASTLN_NAME(bn_backward_short_chunk)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t first,
    int64_t last, int64_t stride, int64_t v, const int n_vectors, float shift,
    double positions[3][FASTLN_BN_FLOAT_SEGMENT])
{
    FASTLN_VF s_dy[4] = {0}, s_dy_d[4] = {0}, s_d[4] = {0};
    for (int64_t k = first; k < last; k++) {
        FASTLN_UNROLL
        for (int j = 0; j < n_vectors; j++) {
            const int64_t at = k * stride + (v + j) * FASTLN_VF_LANES;
            const FASTLN_VF g = FASTLN_NAME(load_c)(dy + at);
            const FASTLN_VF d = FASTLN_NAME(load_c)(x + at) - shift;
            s_dy[j] += g;
            s_dy_d[j] += g * d;
            s_d[j] += d;
        }
    }
    FASTLN_UNROLL
    for (int j = 0; j < n_vectors; j++) {
        const FASTLN_VF partials[3] = {s_dy[j], s_dy_d[j], s_d[j]};
        for (int i = 0; i < 3; i++) {
            double *at = positions[i] + (v + j) * FASTLN_VF_LANES;
            FASTLN_ISA(store_f64)(at, FASTLN_ISA(load_f64)(at)
                                          + FASTLN_ISA(widen_low)(partials[i]));
            FASTLN_ISA(store_f64)(at + FASTLN_VD_LANES,
                                  FASTLN_ISA(load_f64)(at + FASTLN_VD_LANES)
                                      + FASTLN_ISA(widen_high)(partials[i]));
        }
    }
}

/* Segments layout, one feature of short segments (n_inner below FASTLN_BN_FLOAT_SEGMENT), in
 * float: each position of a segment adds that position of the segments of a run of
 * FASTLN_BN_SHORT_SEGMENT_RUN in float, around the float nearest the mean; the run's partials go
 * to the position's double sums, added over the positions in order at the end. Positions never
 * mix, so the vector width changes nothing. 1 and the sums (moved to the mean) when they hold
 * by LayerNorm's rule (finite; sum(dy * d) not below n^2 FLT_MIN unless dy is all zero); 0 for
 * the double slots. */
FASTLN_INLINE int FASTLN_NAME(bn_backward_short_segments)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t n_segments,
    int64_t stride, int64_t n_inner, double mean, double *FASTLN_RESTRICT sum_dy_out,
    double *FASTLN_RESTRICT sum_dy_d_out, double *FASTLN_RESTRICT sum_d_out)
{
    const float shift = (float)mean;
    const int64_t n_vectors = n_inner / FASTLN_VF_LANES, whole = n_vectors * FASTLN_VF_LANES;
    double positions[3][FASTLN_BN_FLOAT_SEGMENT];
    for (int i = 0; i < 3; i++) memset(positions[i], 0, (size_t)n_inner * sizeof(double));
    for (int64_t first = 0; first < n_segments; first += FASTLN_BN_SHORT_SEGMENT_RUN) {
        const int64_t last = fastln_min(first + FASTLN_BN_SHORT_SEGMENT_RUN, n_segments);
        int64_t v = 0;
        for (; v + 4 <= n_vectors; v += 4)
            FASTLN_NAME(bn_backward_short_chunk)(dy, x, first, last, stride, v, 4, shift,
                                                 positions);
        if (v + 2 <= n_vectors) {
            FASTLN_NAME(bn_backward_short_chunk)(dy, x, first, last, stride, v, 2, shift,
                                                 positions);
            v += 2;
        }
        if (v < n_vectors)
            FASTLN_NAME(bn_backward_short_chunk)(dy, x, first, last, stride, v, 1, shift,
                                                 positions);
        float t_dy[FASTLN_VF_LANES] = {0}, t_dy_d[FASTLN_VF_LANES] = {0};
        float t_d[FASTLN_VF_LANES] = {0};
        for (int64_t k = first; k < last && whole < n_inner; k++) {
            const FASTLN_T *dy_segment = dy + k * stride, *x_segment = x + k * stride;
            for (int64_t l = whole; l < n_inner; l++) {
                const float g = FASTLN_NAME(to_compute)(dy_segment[l]);
                const float d = FASTLN_NAME(to_compute)(x_segment[l]) - shift;
                t_dy[l - whole] += g;
                t_dy_d[l - whole] += g * d;
                t_d[l - whole] += d;
            }
        }
        for (int64_t l = whole; l < n_inner; l++) {
            positions[0][l] += (double)t_dy[l - whole];
            positions[1][l] += (double)t_dy_d[l - whole];
            positions[2][l] += (double)t_d[l - whole];
        }
    }
    double totals[3];
    for (int i = 0; i < 3; i++) {
        double total = 0.0;
        for (int64_t l = 0; l < n_inner; l++) total += positions[i][l];
        totals[i] = total;
    }
    if (!isfinite(totals[0]) || !isfinite(totals[2])
        || !FASTLN_NAME(floats_hold_runs)(dy, n_segments, n_inner, stride, totals[1]))
        return 0;
    fastln_bn_move_sums(shift, mean, (double)(n_segments * n_inner), totals);
    *sum_dy_out = totals[0];
    *sum_dy_d_out = totals[1];
    *sum_d_out = totals[2];
    return 1;
}
#endif

/* n values of dy and x into L2, for reading (prefetcht1: a whole sample's group of segments
 * in L1 would push out the values being worked on). */
FASTLN_INLINE void FASTLN_NAME(prefetch_pair)(const FASTLN_T *dy, const FASTLN_T *x, int64_t n)
{
    for (int64_t j = 0; j < n; j += FASTLN_LINE) {
        __builtin_prefetch(dy + j, 0, 2);
        __builtin_prefetch(x + j, 0, 2);
    }
}

#if FASTLN_COMPUTE_F32
/* Segments layout, n_group features side by side (feature f's segment k at k * stride + f *
 * n_inner), in float runs segment by segment: each feature adds its segments' sums in segment
 * order, so the bits do not depend on n_group. Sample by sample, the reads go over the group's
 * n_group * n_inner contiguous values at a time (bn_backward_features_task); with prefetch
 * set, the next sample's are fetched while this one's are summed (the jump of a whole sample
 * to them is one the hardware prefetchers do not follow). */
FASTLN_OUTLINED void FASTLN_NAME(bn_backward_float_segments)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t n_segments,
    int64_t stride, int64_t n_inner, int64_t n_group, const double *FASTLN_RESTRICT mean,
    double *FASTLN_RESTRICT sum_dy, double *FASTLN_RESTRICT sum_dy_d,
    double *FASTLN_RESTRICT sum_d, const int prefetch)
{
    double total[FASTLN_BN_FEATURE_GROUP_MAX][3] = {{0.0}};
    for (int64_t k = 0; k < n_segments; k++) {
        if (prefetch && k + 1 < n_segments)
            FASTLN_NAME(prefetch_pair)(dy + (k + 1) * stride, x + (k + 1) * stride,
                                       n_group * n_inner);
        for (int64_t f = 0; f < n_group; f++) {
            double sums[3];
            const int64_t at = k * stride + f * n_inner;
            FASTLN_NAME(run_backward_sums)(dy + at, x + at, n_inner, (double)(float)mean[f],
                                           sums);
            for (int i = 0; i < 3; i++) total[f][i] += sums[i];
        }
    }
    for (int64_t f = 0; f < n_group; f++) {
        fastln_bn_move_sums((float)mean[f], mean[f], (double)(n_segments * n_inner), total[f]);
        sum_dy[f] = total[f][0];
        sum_dy_d[f] = total[f][1];
        sum_d[f] = total[f][2];
    }
}
#endif

/* Segments layout, one feature: the float32-compute types' long segments in float runs,
 * the rest in bn_stats_segments' slot order. */
FASTLN_OUTLINED void FASTLN_NAME(bn_backward_sums_segments)(
    const FASTLN_T *FASTLN_RESTRICT dy, const FASTLN_T *FASTLN_RESTRICT x, int64_t n_segments,
    int64_t stride, int64_t n_inner, double mean, double *FASTLN_RESTRICT sum_dy_out,
    double *FASTLN_RESTRICT sum_dy_d_out, double *FASTLN_RESTRICT sum_d_out)
{
#if FASTLN_COMPUTE_F32
    /* The float32-compute types, segments of FASTLN_BN_FLOAT_SEGMENT values or more: each
     * segment's sums as a run's (run_backward_sums: float runs where they hold), added in
     * segment order. The runs take d = x - shift around the float nearest the mean; the sums
     * are moved to the mean itself in double (shift - mean is exact), as the dx constants take
     * them. Shorter segments stay in the slots below: a run's padding and reductions cost more
     * than their values. */
    if (n_inner >= FASTLN_BN_FLOAT_SEGMENT) {
        FASTLN_NAME(bn_backward_float_segments)(dy, x, n_segments, stride, n_inner, 1, &mean,
                                                sum_dy_out, sum_dy_d_out, sum_d_out, 0);
        return;
    }
    if (FASTLN_NAME(bn_backward_short_segments)(dy, x, n_segments, stride, n_inner, mean,
                                                sum_dy_out, sum_dy_d_out, sum_d_out))
        return;
#endif
    const int64_t n_whole = n_inner - n_inner % FASTLN_SLOTS;
    double dy_slots[FASTLN_SLOTS], dy_d_slots[FASTLN_SLOTS], d_slots[FASTLN_SLOTS];
    for (int first = 0; first < FASTLN_SLOTS; first += FASTLN_PASS_SLOTS) {
        FASTLN_VD sum_dy[FASTLN_PASS_VECTORS] = {0}, sum_dy_d[FASTLN_PASS_VECTORS] = {0};
        FASTLN_VD sum_d[FASTLN_PASS_VECTORS] = {0};
        for (int64_t k = 0; k < n_segments; k++) {
            const FASTLN_T *dy_segment = dy + k * stride;
            const FASTLN_T *x_segment = x + k * stride;
            for (int64_t l = 0; l < n_whole; l += FASTLN_SLOTS)
                FASTLN_NAME(bn_backward_add_block)(dy_segment, x_segment, NULL, l + first, mean,
                                                   sum_dy, sum_dy_d, sum_d);
            if (n_whole < n_inner) {
                double padded[2][FASTLN_SLOTS];
                for (int s = 0; s < FASTLN_PASS_SLOTS; s++) {
                    const int64_t l = n_whole + first + s;
                    padded[0][s] = l < n_inner ? FASTLN_NAME(to_double)(dy_segment[l]) : 0.0;
                    padded[1][s] = l < n_inner ? FASTLN_NAME(to_double)(x_segment[l]) - mean : 0.0;
                }
                FASTLN_NAME(bn_backward_add_block)(NULL, NULL, (const double(*)[FASTLN_SLOTS])padded,
                                                   0, mean, sum_dy, sum_dy_d, sum_d);
            }
        }
        memcpy(dy_slots + first, sum_dy, sizeof sum_dy);
        memcpy(dy_d_slots + first, sum_dy_d, sizeof sum_dy_d);
        memcpy(d_slots + first, sum_d, sizeof sum_d);
    }
    *sum_dy_out = fastln_reduce_slots(dy_slots);
    *sum_dy_d_out = fastln_reduce_slots(dy_d_slots);
    *sum_d_out = fastln_reduce_slots(d_slots);
}

/* One element of the dx pass in double (the rows' and segments' tails, and the float pass's
 * fallback). */
FASTLN_INLINE FASTLN_T FASTLN_NAME(bn_backward1_double)(FASTLN_T dy, FASTLN_T x, int training,
                                                        double mean, double correction, double k,
                                                        double mean_dy, double coef)
{
    const double g = FASTLN_NAME(to_double)(dy);
    if (!training) return FASTLN_NAME(from_double)(g * k);
    const double centred = (FASTLN_NAME(to_double)(x) - mean) - correction;
    return FASTLN_NAME(from_double)(k * ((g - mean_dy) - centred * coef));
}

/* Columns [c, end) of n_rows rows of the rows layout's dx in double, a vector of columns at a
 * time with its constants loaded once for all the rows (as the float pass's
 * bn_backward_apply_float_block): dx = k * ((dy - mean_dy) - ((x - mean) - correction) * coef) in
 * training, dx = dy * k in evaluation. */
FASTLN_INLINE void FASTLN_NAME(bn_backward_double_block)(
    const FASTLN_T *dy, const FASTLN_T *x, FASTLN_T *dx, int64_t c, const int64_t end,
    const int n_rows, const fastln_bn_call *call)
{
    const int64_t n = call->n_features;
    const int training = call->training;
    const double *mean = call->dx_mean, *correction = call->correction, *k = call->k;
    const double *mean_dy = call->mean_dy, *coef = call->coef;
    for (; c + FASTLN_VF_LANES <= end; c += FASTLN_VF_LANES) {
        FASTLN_VD k_v[2], mean_v[2], correction_v[2], mean_dy_v[2], coef_v[2];
        FASTLN_UNROLL
        for (int h = 0; h < 2; h++) {
            const int64_t at = c + h * FASTLN_VD_LANES;
            k_v[h] = FASTLN_ISA(load_f64)(k + at);
            if (training) {
                mean_v[h] = FASTLN_ISA(load_f64)(mean + at);
                correction_v[h] = FASTLN_ISA(load_f64)(correction + at);
                mean_dy_v[h] = FASTLN_ISA(load_f64)(mean_dy + at);
                coef_v[h] = FASTLN_ISA(load_f64)(coef + at);
            }
        }
        FASTLN_UNROLL
        for (int r = 0; r < n_rows; r++) {
            FASTLN_VD g[2], centred[2];
            FASTLN_NAME(load_wide)(dy + r * n + c, &g[0], &g[1]);
            if (training) FASTLN_NAME(load_wide)(x + r * n + c, &centred[0], &centred[1]);
            FASTLN_UNROLL
            for (int h = 0; h < 2; h++) {
                if (training) {
                    centred[h] = (centred[h] - mean_v[h]) - correction_v[h];
                    g[h] = k_v[h] * ((g[h] - mean_dy_v[h]) - centred[h] * coef_v[h]);
                } else {
                    g[h] *= k_v[h];
                }
            }
            FASTLN_NAME(store_wide)(dx + r * n + c, g[0], g[1]);
        }
    }
    for (; c < end; c++)
        for (int r = 0; r < n_rows; r++)
            dx[r * n + c] = FASTLN_NAME(bn_backward1_double)(dy[r * n + c], x[r * n + c],
                                                             training, mean[c], correction[c],
                                                             k[c], mean_dy[c], coef[c]);
}

/* Rows layout, n_rows rows of dx in double (float64, and the float32-compute types without
 * float constants); store as for the forward's bn_apply_rows (never streamed). */
FASTLN_OUTLINED void FASTLN_NAME(bn_backward_apply_rows)(const FASTLN_T *dy, const FASTLN_T *x,
                                                        FASTLN_T *dx, int64_t n_rows,
                                                        const fastln_bn_call *call, int store)
{
    const int64_t n = call->n_features;
    int64_t r = 0;
    if (store == FASTLN_ROWS_GROUPED) {
        const int64_t head = FASTLN_NAME(line_head)(dx, n, 1);
        for (; r + FASTLN_BN_APPLY_GROUP <= n_rows; r += FASTLN_BN_APPLY_GROUP) {
            FASTLN_NAME(bn_backward_double_block)(dy + r * n, x + r * n, dx + r * n, 0, head,
                                                  FASTLN_BN_APPLY_GROUP, call);
            FASTLN_NAME(bn_backward_double_block)(dy + r * n, x + r * n, dx + r * n, head, n,
                                                  FASTLN_BN_APPLY_GROUP, call);
        }
    }
    for (; r < n_rows; r++) {
        const int64_t head = FASTLN_NAME(line_head)(dx + r * n, n, 0);
        FASTLN_NAME(bn_backward_double_block)(dy + r * n, x + r * n, dx + r * n, 0, head, 1,
                                              call);
        FASTLN_NAME(bn_backward_double_block)(dy + r * n, x + r * n, dx + r * n, head, n, 1,
                                              call);
    }
}

#if FASTLN_COMPUTE_F32
/* One element of the float dx pass: the float result when it is finite, else the double one. */
FASTLN_INLINE FASTLN_T FASTLN_NAME(bn_backward_element)(FASTLN_T dy, FASTLN_T x, float value,
                                                        const fastln_bn_call *call, int64_t c)
{
    if (isfinite(value)) return FASTLN_NAME(from_compute)(value);
    return FASTLN_NAME(bn_backward1_double)(dy, x, call->training, call->dx_mean[c],
                                            call->correction[c], call->k[c], call->mean_dy[c],
                                            call->coef[c]);
}

/* bn_backward_store_float's rare vectors, out of line (see bn_store_float). */
FASTLN_OUTLINED void FASTLN_NAME(bn_backward_store_by_element)(
    const FASTLN_T *dy, const FASTLN_T *x, FASTLN_T *dx, FASTLN_VF v, const fastln_bn_call *call,
    int64_t c, int64_t feature_step)
{
    FASTLN_T lanes[FASTLN_VF_LANES];
    for (int l = 0; l < FASTLN_VF_LANES; l++)
        lanes[l] = FASTLN_NAME(bn_backward_element)(dy[l], x[l], v[l], call, c + l * feature_step);
    memcpy(dx, lanes, sizeof lanes);
}

/* Stores the float dx pass's vector v of VF_LANES elements at dx, or, when a lane is not
 * finite, each element by bn_backward_element from its dy and x; lane l is feature
 * c + l * feature_step (1 in the rows layout, 0 in a segment). */
FASTLN_INLINE void FASTLN_NAME(bn_backward_store_float)(const FASTLN_T *dy, const FASTLN_T *x,
                                                        FASTLN_T *dx, FASTLN_VF v,
                                                        const fastln_bn_call *call, int64_t c,
                                                        int64_t feature_step, int streaming)
{
    if (__builtin_expect(FASTLN_ISA(any_not_finite)(v), 0))
        FASTLN_NAME(bn_backward_store_by_element)(dy, x, dx, v, call, c, feature_step);
    else
        FASTLN_NAME(store_c_to)(dx, v, streaming);
}

/* The rows layout's dx pass in float for the float32-compute types (the forward's rule,
 * bn_apply_rows_float): dx = k * ((dy - mean_dy) - ((x - head) - tail) * coef) in training,
 * dy * k in evaluation, with the call's float constants
 * (fastln_bn_backward_float_constants); each element whose float result is not finite, and
 * every element of a feature whose constants float cannot hold (k is NaN), is computed in
 * double from its dy and x (the vector is not stored yet, also when dx is dy). */

/* One element's float dx (the row's last elements). */
FASTLN_INLINE float FASTLN_NAME(bn_backward_float1)(FASTLN_T dy, FASTLN_T x, const float *constants,
                                                    int64_t n, int64_t at, int training)
{
    const float g = FASTLN_NAME(to_compute)(dy);
    const float k = constants[2 * n + at];
    if (!training) return g * k;
    const float centred = (FASTLN_NAME(to_compute)(x) - constants[at]) - constants[n + at];
    return k * ((g - constants[3 * n + at]) - centred * constants[4 * n + at]);
}

/* The training dx of a vector in float: k * ((dy - mean_dy) - ((x - head) - tail) * coef), each
 * lane the element's own arithmetic (whole vectors and a row's masked last ones alike). */
FASTLN_INLINE FASTLN_VF FASTLN_NAME(bn_backward_float_of)(FASTLN_VF dy, FASTLN_VF x, FASTLN_VF head,
                                                          FASTLN_VF tail, FASTLN_VF k,
                                                          FASTLN_VF mean_dy, FASTLN_VF coef)
{
    return k * ((dy - mean_dy) - ((x - head) - tail) * coef);
}

/* One row's elements [c, end), fewer than VF_LANES, as the forward's bn_apply_row_part. */
FASTLN_INLINE void FASTLN_NAME(bn_backward_row_part)(const FASTLN_T *dy_row, const FASTLN_T *x_row,
                                                     FASTLN_T *dx_row, int64_t c, int64_t end,
                                                     const fastln_bn_call *call,
                                                     const int streaming)
{
    const int64_t n = call->n_features;
    const float *constants = call->float_constants;
    const int training = call->training;
#if FASTLN_MASKED
    if (!streaming) {
        const int64_t left = end - c;
        const FASTLN_VF k = FASTLN_ISA(load_f32_first)(constants + 2 * n + c, left);
        const FASTLN_VF g = FASTLN_NAME(load_c_first)(dy_row + c, left);
        FASTLN_VF v;
        if (training) {
            v = FASTLN_NAME(bn_backward_float_of)(
                g, FASTLN_NAME(load_c_first)(x_row + c, left),
                FASTLN_ISA(load_f32_first)(constants + c, left),
                FASTLN_ISA(load_f32_first)(constants + n + c, left), k,
                FASTLN_ISA(load_f32_first)(constants + 3 * n + c, left),
                FASTLN_ISA(load_f32_first)(constants + 4 * n + c, left));
        } else {
            v = g * k;
        }
        if (!FASTLN_ISA(any_not_finite)(v)) {
            FASTLN_NAME(store_c_first)(dx_row + c, v, left);
            return;
        }
    }
#endif
    FASTLN_T part[FASTLN_STEP];
    for (int64_t l = 0; c + l < end; l++) {
        const int64_t at = c + l;
        const float v = FASTLN_NAME(bn_backward_float1)(dy_row[at], x_row[at], constants, n, at,
                                                        training);
        part[l] = FASTLN_NAME(bn_backward_element)(dy_row[at], x_row[at], v, call, at);
    }
    FASTLN_NAME(store_elements_to)(dx_row + c, part, end - c, streaming);
}

/* Columns [c, end) of n_rows rows (FASTLN_BN_APPLY_GROUP of them when grouped) a vector at a
 * time: each vector of constants is loaded once for all the rows, and a group's vectors are
 * tested for Inf and NaN together before any is stored (as the forward's
 * bn_apply_float_block). */
FASTLN_INLINE void FASTLN_NAME(bn_backward_apply_float_block)(
    const FASTLN_T *dy, const FASTLN_T *x, FASTLN_T *dx, int64_t c, const int64_t end,
    const int n_rows, const fastln_bn_call *call, const int streaming, const int64_t fetch_rows)
{
    const int64_t n = call->n_features;
    const int training = call->training;
    const float *head = call->float_constants, *tail = head + n, *k = head + 2 * n;
    const float *mean_dy = head + 3 * n, *coef = head + 4 * n;
    for (; c + FASTLN_VF_LANES <= end; c += FASTLN_VF_LANES) {
        if (fetch_rows && c % FASTLN_LINE < FASTLN_VF_LANES) {
            __builtin_prefetch(dy + fetch_rows * n + c, 0, 2);
            __builtin_prefetch(x + fetch_rows * n + c, 0, 2);
        }
        FASTLN_VF v[FASTLN_BN_APPLY_GROUP];
        const FASTLN_VF k_v = FASTLN_ISA(load_f32)(k + c);
        if (training) {
            const FASTLN_VF head_v = FASTLN_ISA(load_f32)(head + c);
            const FASTLN_VF tail_v = FASTLN_ISA(load_f32)(tail + c);
            const FASTLN_VF mean_dy_v = FASTLN_ISA(load_f32)(mean_dy + c);
            const FASTLN_VF coef_v = FASTLN_ISA(load_f32)(coef + c);
            FASTLN_UNROLL
            for (int r = 0; r < n_rows; r++)
                v[r] = FASTLN_NAME(bn_backward_float_of)(FASTLN_NAME(load_c)(dy + r * n + c),
                                                         FASTLN_NAME(load_c)(x + r * n + c),
                                                         head_v, tail_v, k_v, mean_dy_v, coef_v);
        } else {
            FASTLN_UNROLL
            for (int r = 0; r < n_rows; r++) v[r] = FASTLN_NAME(load_c)(dy + r * n + c) * k_v;
        }
        if (__builtin_expect(FASTLN_ISA(any_not_finite_of)(v, n_rows), 0)) {
            for (int r = 0; r < n_rows; r++)
                FASTLN_NAME(bn_backward_store_float)(dy + r * n + c, x + r * n + c,
                                                     dx + r * n + c, v[r], call, c, 1,
                                                     streaming);
        } else {
            FASTLN_UNROLL
            for (int r = 0; r < n_rows; r++)
                FASTLN_NAME(store_c_to)(dx + r * n + c, v[r], streaming);
        }
    }
    if (c < end)
        for (int r = 0; r < n_rows; r++)
            FASTLN_NAME(bn_backward_row_part)(dy + r * n, x + r * n, dx + r * n, c, end, call,
                                              streaming);
}

/* The columns up to dx's next cache line first, as the forward's bn_apply_rows_float_to. */
FASTLN_INLINE void FASTLN_NAME(bn_backward_apply_rows_float_to)(
    const FASTLN_T *dy, const FASTLN_T *x, FASTLN_T *dx, int64_t n_rows,
    const fastln_bn_call *call, const int store)
{
    const int streaming = store == FASTLN_ROWS_STREAMED;
    const int64_t n = call->n_features;
    int64_t r = 0;
    if (store == FASTLN_ROWS_GROUPED) {
        const int64_t head = FASTLN_NAME(line_head)(dx, n, 1);
        for (; r + FASTLN_BN_APPLY_GROUP <= n_rows; r += FASTLN_BN_APPLY_GROUP) {
            FASTLN_NAME(bn_backward_apply_float_block)(dy + r * n, x + r * n, dx + r * n, 0,
                                                       head, FASTLN_BN_APPLY_GROUP, call, 0, 0);
            FASTLN_NAME(bn_backward_apply_float_block)(dy + r * n, x + r * n, dx + r * n, head,
                                                       n, FASTLN_BN_APPLY_GROUP, call, 0, 0);
        }
    }
    const int64_t ahead = fastln_rows_fetched_ahead(n * (int64_t)sizeof(FASTLN_T));
    const FASTLN_T *dy_end = (const FASTLN_T *)call->dy + call->n_outer * n;
    for (; r < n_rows; r++) {
        const int64_t head = FASTLN_NAME(row_head)(dx + r * n, n, streaming);
        const int64_t fetch_rows = streaming && dy + (r + ahead + 1) * n <= dy_end ? ahead : 0;
        FASTLN_NAME(bn_backward_apply_float_block)(dy + r * n, x + r * n, dx + r * n, 0, head, 1,
                                                   call, streaming, fetch_rows);
        FASTLN_NAME(bn_backward_apply_float_block)(dy + r * n, x + r * n, dx + r * n, head, n, 1,
                                                   call, streaming, fetch_rows);
    }
    if (streaming) fastln_streaming_fence();
}

/* store as for the forward's bn_apply_rows_float (dx streamed: 16-byte aligned, and so each
 * row). */
FASTLN_OUTLINED void FASTLN_NAME(bn_backward_apply_rows_float)(
    const FASTLN_T *dy, const FASTLN_T *x, FASTLN_T *dx, int64_t n_rows,
    const fastln_bn_call *call, int store)
{
    if (store == FASTLN_ROWS_STREAMED)
        FASTLN_NAME(bn_backward_apply_rows_float_to)(dy, x, dx, n_rows, call, FASTLN_ROWS_STREAMED);
    else if (store == FASTLN_ROWS_GROUPED)
        FASTLN_NAME(bn_backward_apply_rows_float_to)(dy, x, dx, n_rows, call, FASTLN_ROWS_GROUPED);
    else
        FASTLN_NAME(bn_backward_apply_rows_float_to)(dy, x, dx, n_rows, call, FASTLN_ROWS_ALONE);
}
#endif

#if FASTLN_COMPUTE_F32
/* The segments layout's training dx pass in float: one segment of n_inner values of feature c,
 * by the rows layout's rule (bn_backward_apply_rows_float) with the feature's constants in every
 * lane. Evaluation's dx = dy * k stays in double (bn_backward_apply_segment): one product per
 * element, which the float pass's finiteness test made no faster (docs/performance.md). */
FASTLN_OUTLINED void FASTLN_NAME(bn_backward_apply_segment_float)(
    const FASTLN_T *dy, const FASTLN_T *x, FASTLN_T *dx, int64_t n_inner,
    const fastln_bn_call *call, int64_t c)
{
    const int64_t n = call->n_features;
    const float *constants = call->float_constants;
    const float head = constants[c], tail = constants[n + c], k = constants[2 * n + c];
    const float mean_dy = constants[3 * n + c], coef = constants[4 * n + c];
    int64_t l = 0;
    for (; l + FASTLN_VF_LANES <= n_inner; l += FASTLN_VF_LANES) {
        const FASTLN_VF centred = (FASTLN_NAME(load_c)(x + l) - head) - tail;
        const FASTLN_VF v = k * ((FASTLN_NAME(load_c)(dy + l) - mean_dy) - centred * coef);
        FASTLN_NAME(bn_backward_store_float)(dy + l, x + l, dx + l, v, call, c, 0, 0);
    }
    for (; l < n_inner; l++) {
        const float centred = (FASTLN_NAME(to_compute)(x[l]) - head) - tail;
        const float v = k * ((FASTLN_NAME(to_compute)(dy[l]) - mean_dy) - centred * coef);
        dx[l] = FASTLN_NAME(bn_backward_element)(dy[l], x[l], v, call, c);
    }
}
#endif

/* Segments layout, one segment of one feature (training, or evaluation's dx = dy * k). */
FASTLN_OUTLINED void FASTLN_NAME(bn_backward_apply_segment)(
    const FASTLN_T *dy, const FASTLN_T *FASTLN_RESTRICT x, FASTLN_T *dx, int64_t n_inner,
    int training, double mean, double correction, double k, double mean_dy, double coef)
{
    int64_t l = 0;
    for (; l + FASTLN_VF_LANES <= n_inner; l += FASTLN_VF_LANES) {
        FASTLN_VD g[2], centred[2];
        FASTLN_NAME(load_wide)(dy + l, &g[0], &g[1]);
        if (training) FASTLN_NAME(load_wide)(x + l, &centred[0], &centred[1]);
        FASTLN_UNROLL
        for (int h = 0; h < 2; h++) {
            if (training) {
                centred[h] = (centred[h] - mean) - correction;
                g[h] = k * ((g[h] - mean_dy) - centred[h] * coef);
            } else {
                g[h] *= k;
            }
        }
        FASTLN_NAME(store_wide)(dx + l, g[0], g[1]);
    }
    for (; l < n_inner; l++)
        dx[l] = FASTLN_NAME(bn_backward1_double)(dy[l], x[l], training, mean, correction, k,
                                                 mean_dy, coef);
}

/* ---- GroupNorm ------------------------------------------------------------------------------
 * Per (sample, channel) sums of dy, dy * d and d (d = x - mean, the group's cached mean), then
 * per group the constants of fastln_gn_backward_group, then dx value by value:
 *     x_hat = ((x - mean) - correction) * rstd,
 *     dx = rstd * ((gamma_c * dy - mean(dx_hat)) - x_hat * mean(dx_hat * x_hat)). */

/* The backward's constants of one group of n values from its channels' sums (sum(dy),
 * sum(dy * d) and sum(d) of channel c at sum_dy[c * stride] and likewise; gamma from the group's
 * first channel, or NULL):
 *     mean correction = sum(d) / n (the cache's mean may be rounded to float32),
 *     sum(dx_hat) = sum over c of gamma_c sum_c(dy), likewise sum(dx_hat * d),
 *     sum(dx_hat * x_hat) = rstd * (sum(dx_hat * d) - correction * sum(dx_hat)),
 * and each channel's dgamma term rstd * (sum_c(dy * d) - correction * sum_c(dy)) and dbeta
 * term sum_c(dy). fields: mean, correction, rstd, mean(dx_hat), mean(dx_hat * x_hat). Returns
 * whether sum(dx_hat * x_hat) is finite. */
FASTLN_INLINE int FASTLN_NAME(gn_backward_group)(const double *sum_dy, const double *sum_dy_d,
                                                 const double *sum_d, int64_t stride,
                                                 const FASTLN_P *gamma, int64_t n_channels,
                                                 double n, double mean, double rstd,
                                                 double *fields, double *dgamma_terms,
                                                 double *dbeta_terms)
{
    double total_d = 0.0, total_dxhat = 0.0, total_dxhat_d = 0.0;
    for (int64_t c = 0; c < n_channels; c++) {
        const double scale = gamma ? (double)gamma[c] : 1.0;
        total_dxhat += scale * sum_dy[c * stride];
        total_dxhat_d += scale * sum_dy_d[c * stride];
        total_d += sum_d[c * stride];
    }
    const double correction = total_d / n;
    const double total_dxhat_xhat = rstd * (total_dxhat_d - correction * total_dxhat);
    for (int64_t c = 0; c < n_channels; c++) {
        dgamma_terms[c] = rstd * (sum_dy_d[c * stride] - correction * sum_dy[c * stride]);
        dbeta_terms[c] = sum_dy[c * stride];
    }
    fields[0] = mean;
    fields[1] = correction;
    fields[2] = rstd;
    fields[3] = total_dxhat / n;
    fields[4] = total_dxhat_xhat / n;
    fields[5] = 0.0;
    return isfinite(total_dxhat_xhat);
}

/* dx over n values of one channel (channels first) in double; fields as gn_backward_group.
 * With streaming set, the vectors go out with non-temporal stores (dx 16-byte aligned). */
FASTLN_OUTLINED void FASTLN_NAME(gn_backward_write_double)(const FASTLN_T *dy, const FASTLN_T *x,
                                                         FASTLN_T *dx, int64_t n,
                                                         const double *fields, double gamma,
                                                         int streaming)
{
    const double mean = fields[0], correction = fields[1], rstd = fields[2];
    const double mean_dxhat = fields[3], mean_dxhat_xhat = fields[4];
    int64_t i = 0;
    for (; i + FASTLN_VF_LANES <= n; i += FASTLN_VF_LANES) {
        FASTLN_VD g[2], x_hat[2];
        FASTLN_NAME(load_wide)(dy + i, &g[0], &g[1]);
        FASTLN_NAME(load_wide)(x + i, &x_hat[0], &x_hat[1]);
        FASTLN_UNROLL
        for (int h = 0; h < 2; h++) {
            x_hat[h] = ((x_hat[h] - mean) - correction) * rstd;
            g[h] = rstd * ((g[h] * gamma - mean_dxhat) - x_hat[h] * mean_dxhat_xhat);
        }
        FASTLN_NAME(store_wide_to)(dx + i, g[0], g[1], streaming);
    }
    FASTLN_T part[FASTLN_STEP]; /* the last values, streamed too (gn_write_float) */
    for (int64_t l = i; l < n; l++) {
        const double x_hat = ((FASTLN_NAME(to_double)(x[l]) - mean) - correction) * rstd;
        part[l - i] = FASTLN_NAME(from_double)(
            rstd * ((FASTLN_NAME(to_double)(dy[l]) * gamma - mean_dxhat) - x_hat * mean_dxhat_xhat));
    }
    FASTLN_NAME(store_elements_to)(dx + i, part, n - i, streaming);
}

#if FASTLN_COMPUTE_F32
/* The same in float, the mean a float head (the cache's float mean) and tail (the correction),
 * as ln_backward_dx_float. */
FASTLN_OUTLINED void FASTLN_NAME(gn_backward_write_float)(const FASTLN_T *dy, const FASTLN_T *x,
                                                        FASTLN_T *dx, int64_t n,
                                                        const double *fields, float gamma,
                                                        int streaming)
{
    const float mean_head = (float)fields[0], mean_tail = (float)fields[1];
    const float rstd = (float)fields[2];
    const float mean_dxhat = (float)fields[3], mean_dxhat_xhat = (float)fields[4];
    int64_t i = 0;
    for (; i + FASTLN_VF_LANES <= n; i += FASTLN_VF_LANES) {
        const FASTLN_VF x_hat = ((FASTLN_NAME(load_c)(x + i) - mean_head) - mean_tail) * rstd;
        const FASTLN_VF dx_hat = FASTLN_NAME(load_c)(dy + i) * gamma;
        FASTLN_NAME(store_c_to)(dx + i, ((dx_hat - mean_dxhat) - x_hat * mean_dxhat_xhat) * rstd,
                                streaming);
    }
    FASTLN_T part[FASTLN_STEP]; /* the last values, streamed too (gn_write_float) */
    for (int64_t l = i; l < n; l++) {
        const float x_hat = ((FASTLN_NAME(to_compute)(x[l]) - mean_head) - mean_tail) * rstd;
        const float dx_hat = FASTLN_NAME(to_compute)(dy[l]) * gamma;
        part[l - i] =
            FASTLN_NAME(from_compute)(((dx_hat - mean_dxhat) - x_hat * mean_dxhat_xhat) * rstd);
    }
    FASTLN_NAME(store_elements_to)(dx + i, part, n - i, streaming);
}
#endif

/* dx over n values of one channel: in float for the float32-compute types whose rstd fits a
 * float (ln_backward_in_floats), else in double. With streaming set and dx 16-byte aligned,
 * with non-temporal stores (from memory, dx's lines are not read for ownership then). */
FASTLN_INLINE void FASTLN_NAME(gn_backward_write)(const FASTLN_T *dy, const FASTLN_T *x,
                                                  FASTLN_T *dx, int64_t n, const double *fields,
                                                  double gamma, int streaming)
{
    streaming = streaming && fastln_is_aligned16(dx);
#if FASTLN_COMPUTE_F32
    if (fastln_scale_fits_float(fields[2])) {
        FASTLN_NAME(gn_backward_write_float)(dy, x, dx, n, fields, (float)gamma, streaming);
        return;
    }
#endif
    FASTLN_NAME(gn_backward_write_double)(dy, x, dx, n, fields, gamma, streaming);
}

#if FASTLN_COMPUTE_F32
/* The channels-last write in float: gn_backward_write_float's arithmetic, each lane with its
 * channel's constants (mean head and tail, rstd, gamma, mean(dx_hat), mean(dx_hat * x_hat) as
 * gn_backward_write_float rounds them, each `width` floats, constants_stride apart), so that a
 * value gets the same dx in either layout from the same group constants. */
FASTLN_OUTLINED void FASTLN_NAME(gn_backward_apply_rows_float)(
    const FASTLN_T *dy, const FASTLN_T *x, FASTLN_T *dx, int64_t n_rows, int64_t width,
    int64_t stride, const float *FASTLN_RESTRICT constants, int64_t constants_stride,
    int streaming)
{
    /* streaming: rows of whole vectors, 16-byte aligned; the task fences. */
    const float *head = constants, *tail = constants + constants_stride;
    const float *rstd = constants + 2 * constants_stride, *gamma = constants + 3 * constants_stride;
    const float *mean_dxhat = constants + 4 * constants_stride;
    const float *mean_dxhat_xhat = constants + 5 * constants_stride;
    for (int64_t r = 0; r < n_rows; r++) {
        const FASTLN_T *dy_row = dy + r * stride, *x_row = x + r * stride;
        FASTLN_T *dx_row = dx + r * stride;
        int64_t c = 0;
        for (; c + FASTLN_VF_LANES <= width; c += FASTLN_VF_LANES) {
            const FASTLN_VF rstd_v = FASTLN_ISA(load_f32)(rstd + c);
            const FASTLN_VF x_v = FASTLN_NAME(load_c)(x_row + c);
            const FASTLN_VF x_hat =
                ((x_v - FASTLN_ISA(load_f32)(head + c)) - FASTLN_ISA(load_f32)(tail + c)) * rstd_v;
            const FASTLN_VF dx_hat =
                FASTLN_NAME(load_c)(dy_row + c) * FASTLN_ISA(load_f32)(gamma + c);
            FASTLN_NAME(store_c_to)(dx_row + c,
                                    ((dx_hat - FASTLN_ISA(load_f32)(mean_dxhat + c))
                                     - x_hat * FASTLN_ISA(load_f32)(mean_dxhat_xhat + c)) * rstd_v,
                                    streaming);
        }
        for (; c < width; c++) {
            const float x_hat = ((FASTLN_NAME(to_compute)(x_row[c]) - head[c]) - tail[c]) * rstd[c];
            const float dx_hat = FASTLN_NAME(to_compute)(dy_row[c]) * gamma[c];
            dx_row[c] = FASTLN_NAME(from_compute)(((dx_hat - mean_dxhat[c])
                                                   - x_hat * mean_dxhat_xhat[c]) * rstd[c]);
        }
    }
}
#endif

/* Channels last: dx over n_rows spatial rows of width channels (rows stride values apart), in
 * double, from per-channel constants (mean, correction, rstd, gamma, mean(dx_hat),
 * mean(dx_hat * x_hat), each `width` doubles: their group's, and gamma_c). Channels never mix,
 * so the vector width changes nothing. */
FASTLN_OUTLINED void FASTLN_NAME(gn_backward_apply_rows)(
    const FASTLN_T *dy, const FASTLN_T *x, FASTLN_T *dx, int64_t n_rows, int64_t width,
    int64_t stride, const double *FASTLN_RESTRICT constants, int64_t constants_stride)
{
    const double *mean = constants, *correction = constants + constants_stride;
    const double *rstd = constants + 2 * constants_stride, *gamma = constants + 3 * constants_stride;
    const double *mean_dxhat = constants + 4 * constants_stride;
    const double *mean_dxhat_xhat = constants + 5 * constants_stride;
    for (int64_t r = 0; r < n_rows; r++) {
        const FASTLN_T *dy_row = dy + r * stride, *x_row = x + r * stride;
        FASTLN_T *dx_row = dx + r * stride;
        int64_t c = 0;
        for (; c + FASTLN_VF_LANES <= width; c += FASTLN_VF_LANES) {
            FASTLN_VD g[2], x_hat[2];
            FASTLN_NAME(load_wide)(dy_row + c, &g[0], &g[1]);
            FASTLN_NAME(load_wide)(x_row + c, &x_hat[0], &x_hat[1]);
            FASTLN_UNROLL
            for (int h = 0; h < 2; h++) {
                const int64_t at = c + h * FASTLN_VD_LANES;
                const FASTLN_VD rstd_v = FASTLN_ISA(load_f64)(rstd + at);
                x_hat[h] = ((x_hat[h] - FASTLN_ISA(load_f64)(mean + at))
                            - FASTLN_ISA(load_f64)(correction + at)) * rstd_v;
                g[h] = rstd_v * ((g[h] * FASTLN_ISA(load_f64)(gamma + at)
                                  - FASTLN_ISA(load_f64)(mean_dxhat + at))
                                 - x_hat[h] * FASTLN_ISA(load_f64)(mean_dxhat_xhat + at));
            }
            FASTLN_NAME(store_wide)(dx_row + c, g[0], g[1]);
        }
        for (; c < width; c++) {
            const double x_hat = ((FASTLN_NAME(to_double)(x_row[c]) - mean[c]) - correction[c])
                                 * rstd[c];
            dx_row[c] = FASTLN_NAME(from_double)(
                rstd[c] * ((FASTLN_NAME(to_double)(dy_row[c]) * gamma[c] - mean_dxhat[c])
                           - x_hat * mean_dxhat_xhat[c]));
        }
    }
}
