/* The entry points of one storage type (fastln/storage.h): one task function per operation and
 * phase, all of the form `void task(const void *call, int64_t begin, int64_t end)`, doing tasks
 * [begin, end) of the call (rows, row blocks, BatchNorm units or columns, by phase). The driver
 * (fastln/_kernels.pyx) hands ranges of tasks to threads; tasks never share an output, and the
 * layout of every reduction is fixed by the shape alone, so no result depends on how the
 * ranges fall. At the end, FASTLN_NAME(tasks): this storage type's row of the dispatch table.
 * No include guard on purpose. */

/* ---- row normalizations: tasks are rows ----------------------------------------------------- */

static void FASTLN_NAME(layer_norm_forward_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_rows_call *call = opaque;
    const int64_t n = call->n_cols;
    const FASTLN_T *x = call->x;
    FASTLN_T *y = call->y;
    FASTLN_P *mean = call->mean, *rstd = call->rstd;
    /* Rows in cache: row r + 1's statistics are taken before row r is written. They end in a
     * chain of dependent scalar operations (a division, a square root), which then overlaps
     * row r's write pass instead of holding up the row's own. Row r + 1 is only read before row
     * r is written, so y may be x. Rows from memory (streaming) keep one row at a time: their
     * write pass prefetches the next row, which the statistics would otherwise have read. So do
     * float64 rows, which measured no faster ahead (docs/performance.md). */
    const int ahead = FASTLN_COMPUTE_F32 && !call->streaming;
    fastln_shared_line shared;
    fastln_shared_line *streamed = fastln_shared_line_start(&shared, call->streaming);
    fastln_ln_stats next = {0};
    if (ahead && begin < end) FASTLN_NAME(ln_statistics)(x + begin * n, n, call->eps, &next);
    for (int64_t r = begin; r < end; r++) {
        fastln_ln_stats stats;
        if (ahead) {
            stats = next;
            if (r + 1 < end) FASTLN_NAME(ln_statistics)(x + (r + 1) * n, n, call->eps, &next);
        } else {
            FASTLN_NAME(ln_statistics)(x + r * n, n, call->eps, &stats);
        }
        FASTLN_NAME(layer_norm_write_row)(x + r * n, call->gamma, call->beta, y + r * n, n,
                                          call->eps, &stats, streamed, r + 1 < end);
        if (mean) mean[r] = (FASTLN_P)stats.mean;
        if (rstd) rstd[r] = (FASTLN_P)stats.rstd;
    }
    fastln_shared_line_finish(streamed);
}

static void FASTLN_NAME(rms_norm_forward_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_rows_call *call = opaque;
    const int64_t n = call->n_cols;
    const FASTLN_T *x = call->x;
    FASTLN_T *y = call->y;
    FASTLN_P *rstd = call->rstd;
    fastln_shared_line shared;
    fastln_shared_line *streamed = fastln_shared_line_start(&shared, call->streaming);
    for (int64_t r = begin; r < end; r++) {
        double row_rstd;
        FASTLN_NAME(rms_norm_forward_row)(x + r * n, call->gamma, y + r * n, n, call->eps,
                                          &row_rstd, streamed, r + 1 < end);
        if (rstd) rstd[r] = (FASTLN_P)row_rstd;
    }
    fastln_shared_line_finish(streamed);
}

/* s = x + residual (+ bias), then y = LayerNorm(s) of the stored s (so y is bitwise what
 * layer_norm gives for the returned s). s may be x or residual (the in-place residual-stream
 * update) and y may be x or residual: a row of x and residual is read completely before s is
 * written, and s is complete before y is written. */
static void FASTLN_NAME(add_layer_norm_forward_task)(const void *opaque, int64_t begin,
                                                     int64_t end)
{
    const fastln_rows_call *call = opaque;
    const int64_t n = call->n_cols;
    const FASTLN_T *x = call->x, *residual = call->residual;
    FASTLN_T *s = call->s, *y = call->y;
    FASTLN_P *mean = call->mean, *rstd = call->rstd;
    for (int64_t r = begin; r < end; r++) {
        double row_mean, row_rstd;
        FASTLN_NAME(add_row)(x + r * n, residual + r * n, call->bias, s + r * n, n,
                             call->add_in_float);
        FASTLN_NAME(layer_norm_forward_row)(s + r * n, call->gamma, call->beta, y + r * n, n,
                                            call->eps, &row_mean, &row_rstd);
        if (mean) mean[r] = (FASTLN_P)row_mean;
        if (rstd) rstd[r] = (FASTLN_P)row_rstd;
    }
}

static void FASTLN_NAME(add_rms_norm_forward_task)(const void *opaque, int64_t begin,
                                                   int64_t end)
{
    const fastln_rows_call *call = opaque;
    const int64_t n = call->n_cols;
    const FASTLN_T *x = call->x, *residual = call->residual;
    FASTLN_T *s = call->s, *y = call->y;
    FASTLN_P *rstd = call->rstd;
    for (int64_t r = begin; r < end; r++) {
        double row_rstd;
        FASTLN_NAME(add_row)(x + r * n, residual + r * n, call->bias, s + r * n, n,
                             call->add_in_float);
        FASTLN_NAME(rms_norm_forward_row)(s + r * n, call->gamma, y + r * n, n, call->eps,
                                          &row_rstd, NULL, 0);
        if (rstd) rstd[r] = (FASTLN_P)row_rstd;
    }
}

/* ---- row normalizations' backwards: tasks are row blocks ----------------------------------
 * Block b holds rows [b * rows_per_block, (b + 1) * rows_per_block) and adds its dgamma (and
 * dbeta) into its own rows of double partial sums; column_sums_task adds the blocks in block
 * order. */

static void FASTLN_NAME(layer_norm_backward_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_rows_call *call = opaque;
    const int64_t n = call->n_cols;
    const FASTLN_T *dy = call->dy, *x = call->x;
    FASTLN_T *dx = call->dx;
    const FASTLN_P *mean = call->mean, *rstd = call->rstd;
    const int64_t group = call->rows_alone ? 1 : FASTLN_BACKWARD_GROUP;
    const int64_t task_end = fastln_min(end * call->rows_per_block, call->n_rows);
    fastln_shared_line shared;
    fastln_shared_line *streamed = fastln_shared_line_start(&shared, call->streaming);
    for (int64_t block = begin; block < end; block++) {
        const int64_t row_start = block * call->rows_per_block;
        const int64_t row_end = fastln_min(row_start + call->rows_per_block, call->n_rows);
        double *dgamma_partial = call->partials + 2 * block * n;
        double *dbeta_partial = dgamma_partial + n;
#if FASTLN_COMPUTE_F32
        /* float accumulators, folded into the double partials every FASTLN_ROWS_PER_FLUSH rows
         * (the first fold sets them: they come unzeroed, and a block without rows zeroes its
         * own) */
        float *dgamma_acc = call->accumulators + 2 * block * n;
        float *dbeta_acc = dgamma_acc + n;
        if (row_start >= row_end) memset(dgamma_partial, 0, 2 * (size_t)n * sizeof(double));
        const int fold = !fastln_sums_stay_in_accumulators(call);
#else
        double *dgamma_acc = dgamma_partial, *dbeta_acc = dbeta_partial;
#endif
        for (int64_t row = row_start; row < row_end;) {
            const int64_t count = fastln_min(group, row_end - row);
            FASTLN_NAME(layer_norm_backward_rows)(
                dy + row * n, x + row * n, call->gamma, mean + row, rstd + row, call->eps,
                dx + row * n, count, n, dgamma_acc, dbeta_acc, streamed, row + count < task_end,
                fastln_rows_to_fetch(call, group, row + count, task_end));
            row += count;
#if FASTLN_COMPUTE_F32
            if (fold && ((row - row_start) % FASTLN_ROWS_PER_FLUSH == 0 || row == row_end)) {
                const int first = row - row_start <= FASTLN_ROWS_PER_FLUSH;
                fastln_flush_accumulators(dgamma_acc, dgamma_partial, n, first);
                fastln_flush_accumulators(dbeta_acc, dbeta_partial, n, first);
            }
#endif
        }
    }
    fastln_shared_line_finish(streamed);
}

static void FASTLN_NAME(rms_norm_backward_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_rows_call *call = opaque;
    const int64_t n = call->n_cols;
    const FASTLN_T *dy = call->dy, *x = call->x;
    FASTLN_T *dx = call->dx;
    const FASTLN_P *rstd = call->rstd;
    const int64_t group = call->rows_alone ? 1 : FASTLN_BACKWARD_GROUP;
    const int64_t task_end = fastln_min(end * call->rows_per_block, call->n_rows);
    fastln_shared_line shared;
    fastln_shared_line *streamed = fastln_shared_line_start(&shared, call->streaming);
    for (int64_t block = begin; block < end; block++) {
        const int64_t row_start = block * call->rows_per_block;
        const int64_t row_end = fastln_min(row_start + call->rows_per_block, call->n_rows);
        double *dgamma_partial = call->partials + block * n;
        for (int64_t row = row_start; row < row_end;) {
            const int64_t count = fastln_min(group, row_end - row);
            FASTLN_NAME(rms_norm_backward_rows)(
                dy + row * n, x + row * n, call->gamma, rstd + row, call->eps, dx + row * n,
                count, n, dgamma_partial, streamed, row + count < task_end,
                fastln_rows_to_fetch(call, group, row + count, task_end));
            row += count;
        }
    }
    fastln_shared_line_finish(streamed);
}

/* Tasks are columns: each column's partial sums added in block order into dgamma (and dbeta:
 * the second of each block's rows, when call->dbeta is set). */
static void FASTLN_NAME(column_sums_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_rows_call *call = opaque;
    const int64_t n = call->n_cols;
    const int64_t n_sums = call->dbeta ? 2 : 1;
    enum { CHUNK = 256 };
    double total[CHUNK];
    int not_finite = 0;
    for (int64_t sum = 0; sum < n_sums; sum++) {
        FASTLN_P *out = sum == 0 ? call->dgamma : call->dbeta;
#if FASTLN_COMPUTE_F32
        if (fastln_sums_stay_in_accumulators(call)) {
            const float *accumulator = call->accumulators + sum * n;
            for (int64_t j = begin; j < end; j++) {
                out[j] = accumulator[j];
                not_finite |= FASTLN_NAME(parameter_not_finite)(out[j]);
            }
            continue;
        }
#endif
        if (call->n_blocks == 1) { /* a single block's partials are the sums (small calls) */
            const double *partial = call->partials + sum * n;
            for (int64_t j = begin; j < end; j++) {
                out[j] = (FASTLN_P)partial[j];
                not_finite |= FASTLN_NAME(parameter_not_finite)(out[j]);
            }
            continue;
        }
        /* A chunk of columns at a time, each block's row of partials read in order (a column
         * walk through the blocks would take a cache miss per block); each column still adds
         * its blocks in block order. */
        for (int64_t j0 = begin; j0 < end; j0 += CHUNK) {
            const int64_t width = fastln_min(CHUNK, end - j0);
            memcpy(total, call->partials + sum * n + j0, (size_t)width * sizeof(double));
            for (int64_t block = 1; block < call->n_blocks; block++) {
                const double *partial = call->partials + (block * n_sums + sum) * n + j0;
                for (int64_t k = 0; k < width; k++) total[k] += partial[k];
            }
            for (int64_t k = 0; k < width; k++) {
                out[j0 + k] = (FASTLN_P)total[k];
                not_finite |= FASTLN_NAME(parameter_not_finite)(out[j0 + k]);
            }
        }
    }
    /* A sum that is not finite may have overflowed on the way (rare.h): also a float32 one
     * whose double total is finite, its float runs having rounded up past float's range. */
    if (not_finite) FASTLN_NAME(column_sums_again)(call, begin, end);
}

/* ---- BatchNorm ------------------------------------------------------------------------------
 * x is a C-contiguous (n_outer, n_features, n_inner) array. Statistics tasks are (row block,
 * feature chunk) pairs in the rows layout (n_inner == 1) and (row block, feature) pairs in the
 * segments layout; write tasks are chunks of rows, or one segment of one feature. The serial
 * phases (first values, constants, the rare features) are single tasks. */

static void FASTLN_NAME(bn_first_values_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_bn_call *call = opaque;
    (void)begin;
    (void)end;
    FASTLN_NAME(bn_first_values)(call->x, call->n_features, call->n_inner, call->shift);
}

/* Where task `task` of a statistics phase reads and writes. */
typedef struct {
    int64_t start, n_rows, first, width, index;
} FASTLN_NAME(bn_task_place);

FASTLN_INLINE FASTLN_NAME(bn_task_place) FASTLN_NAME(bn_place)(const fastln_bn_call *call,
                                                               int64_t task)
{
    FASTLN_NAME(bn_task_place) place;
    const int64_t block = task / call->n_chunks, chunk = task % call->n_chunks;
    place.start = block * call->rows_per_block;
    place.n_rows = fastln_min(place.start + call->rows_per_block, call->n_outer) - place.start;
    if (call->n_inner == 1) {
        place.first = chunk * FASTLN_BN_FEATURE_CHUNK;
        place.width = fastln_min(FASTLN_BN_FEATURE_CHUNK, call->n_features - place.first);
    } else {
        place.first = chunk;
        place.width = 1;
    }
    place.index = block * call->n_features + place.first;
    return place;
}

static void FASTLN_NAME(bn_statistics_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_bn_call *call = opaque;
    const FASTLN_T *x = call->x;
    const int64_t n_partials = call->n_blocks * call->n_features;
    for (int64_t task = begin; task < end; task++) {
        const FASTLN_NAME(bn_task_place) at = FASTLN_NAME(bn_place)(call, task);
        if (at.n_rows <= 0) continue; /* an empty last block (tiny shapes only) */
        if (call->n_inner == 1)
            FASTLN_NAME(bn_stats_rows)(x + at.start * call->n_features + at.first, at.n_rows,
                                       at.width, call->n_features, call->shift + at.first,
                                       call->partials + at.index,
                                       call->partials + n_partials + at.index);
        else
            FASTLN_NAME(bn_stats_segments)(
                x + (at.start * call->n_features + at.first) * call->n_inner, at.n_rows,
                call->n_features * call->n_inner, call->n_inner, call->shift[at.first],
                call->partials + at.index, call->partials + n_partials + at.index);
    }
}

/* The training forward's statistics and write constants from the block partials, then the
 * features whose statistics left double's range (rare.h). */
static void FASTLN_NAME(bn_train_constants_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_bn_call *call = opaque;
    (void)begin;
    (void)end;
    const int64_t n_partials = call->n_blocks * call->n_features;
    fastln_bn_combine_partials(call->partials, call->n_blocks, call->n_features, call->sum);
    fastln_bn_combine_partials(call->partials + n_partials, call->n_blocks, call->n_features,
                               call->sumsq);
    fastln_bn_train_constants(call);
    FASTLN_NAME(bn_rescale_train)(call->x, call);
    if (call->float_constants) fastln_bn_float_constants(call);
}

/* The evaluation forward's constants from the running statistics (one task, so that they are
 * computed in this variant's vectors). */
static void FASTLN_NAME(bn_eval_constants_task)(const void *opaque, int64_t begin, int64_t end)
{
    (void)begin;
    (void)end;
    fastln_bn_eval_constants(opaque);
}

static void FASTLN_NAME(bn_apply_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_bn_call *call = opaque;
    const FASTLN_T *x = call->x;
    FASTLN_T *y = call->y;
    /* Non-temporal stores need every row 16-byte aligned. */
    const int rows_aligned = fastln_is_aligned16(y)
                             && call->n_features * (int64_t)sizeof(FASTLN_T) % 16 == 0;
    const int store = fastln_rows_store(
        call->streaming && rows_aligned,
        call->n_outer * call->n_features * call->n_inner * (int64_t)sizeof(FASTLN_T));
#if FASTLN_COMPUTE_F32
    const float *head = call->float_constants;
    const fastln_rows_constants k =
        head ? fastln_bn_rows_constants(call) : (fastln_rows_constants){0};
#endif
    for (int64_t unit = begin; unit < end; unit++) {
        if (call->n_inner == 1) {
            const int64_t start = unit * call->rows_per_unit;
            const int64_t offset = start * call->n_features;
            const int64_t n_rows = fastln_min(call->rows_per_unit, call->n_outer - start);
#if FASTLN_COMPUTE_F32
            if (head) {
                FASTLN_NAME(bn_apply_rows_float)(x + offset, y + offset, n_rows, call->n_features,
                                                 &k, store, x + call->n_outer * call->n_features);
                continue;
            }
#endif
            FASTLN_NAME(bn_apply_rows)(x + offset, y + offset, n_rows, call->n_features,
                                       call->shift, call->center, call->scale, call->offset,
                                       store);
        } else {
            const int64_t c = unit % call->n_features;
#if FASTLN_COMPUTE_F32
            if (head) {
                FASTLN_NAME(bn_apply_segment_float)(x + unit * call->n_inner,
                                                    y + unit * call->n_inner, call->n_inner, &k,
                                                    c);
                continue;
            }
#endif
            FASTLN_NAME(bn_apply_segment)(x + unit * call->n_inner, y + unit * call->n_inner,
                                          call->n_inner, call->shift[c], call->center[c],
                                          call->scale[c], call->offset[c]);
        }
    }
}

static void FASTLN_NAME(bn_finish_rescaled_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_bn_call *call = opaque;
    (void)begin;
    (void)end;
    FASTLN_NAME(bn_finish_rescaled)(call->y, call);
}

static void FASTLN_NAME(bn_backward_sums_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_bn_call *call = opaque;
    const FASTLN_T *dy = call->dy, *x = call->x;
    const int64_t n_partials = call->n_blocks * call->n_features;
    double *sum_dy = call->partials, *sum_dy_d = sum_dy + n_partials;
    double *sum_d = sum_dy_d + n_partials;
    for (int64_t task = begin; task < end; task++) {
        const FASTLN_NAME(bn_task_place) at = FASTLN_NAME(bn_place)(call, task);
        if (at.n_rows <= 0) continue;
        if (call->n_inner == 1) {
            const int64_t offset = at.start * call->n_features + at.first;
#if FASTLN_COMPUTE_F32
            FASTLN_NAME(bn_backward_float_rows)(dy + offset, x + offset, at.n_rows, at.width,
                                                call->n_features, call->mean + at.first,
                                                sum_dy + at.index, sum_dy_d + at.index,
                                                sum_d + at.index, call->streaming);
#else
            FASTLN_NAME(bn_backward_sums_rows)(dy + offset, x + offset, at.n_rows, at.width,
                                               call->n_features, call->mean + at.first,
                                               sum_dy + at.index, sum_dy_d + at.index,
                                               sum_d + at.index);
#endif
        } else {
            const int64_t offset = (at.start * call->n_features + at.first) * call->n_inner;
            FASTLN_NAME(bn_backward_sums_segments)(dy + offset, x + offset, at.n_rows,
                                                   call->n_features * call->n_inner,
                                                   call->n_inner, call->mean[at.first],
                                                   sum_dy + at.index, sum_dy_d + at.index,
                                                   sum_d + at.index);
        }
    }
}

/* dgamma and dbeta of feature c, in the parameter type. */
FASTLN_INLINE void FASTLN_NAME(bn_store_parameter_gradients)(const fastln_bn_call *call,
                                                             int64_t c)
{
    ((FASTLN_P *)call->dgamma_out)[c] = (FASTLN_P)call->dgamma[c];
    ((FASTLN_P *)call->dbeta_out)[c] = (FASTLN_P)call->sum_dy[c];
}

/* dgamma, dbeta and the dx constants from the block partials (and, training, the rare
 * features); dgamma and dbeta stored in the parameter type. */
static void FASTLN_NAME(bn_backward_constants_task)(const void *opaque, int64_t begin,
                                                    int64_t end)
{
    const fastln_bn_call *call = opaque;
    (void)begin;
    (void)end;
    const int64_t n_partials = call->n_blocks * call->n_features;
    fastln_bn_combine_partials(call->partials, call->n_blocks, call->n_features, call->sum_dy);
    fastln_bn_combine_partials(call->partials + n_partials, call->n_blocks, call->n_features,
                               call->sum_dy_d);
    fastln_bn_combine_partials(call->partials + 2 * n_partials, call->n_blocks, call->n_features,
                               call->sum_d);
#if FASTLN_COMPUTE_F32
    if (call->n_inner == 1) { /* the rows' float sums (bn_backward_float_rows): around the
                               * float nearest each mean, moved to the mean in double (exactly:
                               * shift - mean is exact), then held to LayerNorm's rule */
        const double count = (double)call->n_outer;
        fastln_bn_move_all_sums(call->n_features, call->mean, count, call->sum_dy,
                                call->sum_dy_d, call->sum_d);
        if (fastln_bn_any_float_sums_doubtful(call->n_features, count, call->sum_dy,
                                              call->sum_dy_d, call->sum_d))
            for (int64_t c = 0; c < call->n_features; c++)
                FASTLN_NAME(bn_backward_rows_hold)(call->dy, call->x, call->n_outer,
                                                   call->n_features, c, call->mean[c],
                                                   call->sum_dy + c, call->sum_dy_d + c,
                                                   call->sum_d + c);
    }
#endif
    fastln_bn_backward_constants(call);
    *call->n_finish = 0;
    if (call->training) FASTLN_NAME(bn_rescale_backward)(call->dy, call->x, call);
    if (call->float_constants) fastln_bn_backward_float_constants(call);
    for (int64_t c = 0; c < call->n_features; c++)
        FASTLN_NAME(bn_store_parameter_gradients)(call, c);
}

/* dx of one segment of the segments layout (write unit `unit`: segment unit / n_features of
 * feature unit % n_features). */
FASTLN_INLINE void FASTLN_NAME(bn_backward_apply_segment_unit)(const fastln_bn_call *call,
                                                               int64_t unit)
{
    const FASTLN_T *dy = call->dy, *x = call->x;
    FASTLN_T *dx = call->dx;
    const int64_t c = unit % call->n_features, offset = unit * call->n_inner;
#if FASTLN_COMPUTE_F32
    if (call->float_constants) { /* set in the segments layout when training */
        FASTLN_NAME(bn_backward_apply_segment_float)(dy + offset, x + offset, dx + offset,
                                                     call->n_inner, call, c);
        return;
    }
#endif
    FASTLN_NAME(bn_backward_apply_segment)(dy + offset, x + offset, dx + offset, call->n_inner,
                                           call->training, call->dx_mean[c],
                                           call->correction[c], call->k[c], call->mean_dy[c],
                                           call->coef[c]);
}

static void FASTLN_NAME(bn_backward_apply_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_bn_call *call = opaque;
    const FASTLN_T *dy = call->dy, *x = call->x;
    FASTLN_T *dx = call->dx;
    /* Non-temporal stores need every row 16-byte aligned. */
    const int streaming = call->streaming && fastln_is_aligned16(dx)
                          && call->n_features * (int64_t)sizeof(FASTLN_T) % 16 == 0;
    const int store = fastln_rows_store(
        streaming, call->n_outer * call->n_features * (int64_t)sizeof(FASTLN_T));
    for (int64_t unit = begin; unit < end; unit++) {
        if (call->n_inner > 1) {
            FASTLN_NAME(bn_backward_apply_segment_unit)(call, unit);
            continue;
        }
        const int64_t start = unit * call->rows_per_unit;
        const int64_t offset = start * call->n_features;
        const int64_t n_rows = fastln_min(call->rows_per_unit, call->n_outer - start);
#if FASTLN_COMPUTE_F32
        if (call->float_constants) {
            FASTLN_NAME(bn_backward_apply_rows_float)(dy + offset, x + offset, dx + offset,
                                                      n_rows, call, store);
            continue;
        }
#endif
        FASTLN_NAME(bn_backward_apply_rows)(dy + offset, x + offset, dx + offset, n_rows, call,
                                            store);
    }
}

/* dgamma and dbeta of segments-layout feature c, then its dx, segment after segment. */
FASTLN_INLINE void FASTLN_NAME(bn_backward_finish_feature)(const fastln_bn_call *call,
                                                           int64_t c)
{
    FASTLN_NAME(bn_store_parameter_gradients)(call, c);
    for (int64_t k = 0; k < call->n_outer; k++)
        FASTLN_NAME(bn_backward_apply_segment_unit)(call, k * call->n_features + c);
}

/* Feature c's dy, x and dx (n_outer segments of n_inner values, a whole sample apart) into
 * L2, while the feature before it is summed and written: segments this short and this far
 * apart defeat the hardware prefetchers (docs/performance.md, "BatchNorm's short segments
 * prefetched"). Not into L1, where a feature's three arrays fill most of it: the next feature
 * pushed out the one being written. Only addresses inside the arrays. */
FASTLN_INLINE void FASTLN_NAME(bn_backward_prefetch_feature)(const fastln_bn_call *call,
                                                             int64_t c)
{
    const int64_t n_inner = call->n_inner, sample = call->n_features * n_inner;
    for (int64_t o = 0; o < call->n_outer; o++) {
        const int64_t at = o * sample + c * n_inner;
        for (int64_t j = 0; j < n_inner; j += FASTLN_LINE) {
            __builtin_prefetch((const FASTLN_T *)call->dy + at + j, 0, 2);
            __builtin_prefetch((const FASTLN_T *)call->x + at + j, 0, 2);
            __builtin_prefetch((FASTLN_T *)call->dx + at + j, 1, 2);
        }
    }
}

/* How many features bn_backward_features_task takes at once (FASTLN_BN_FEATURE_GROUP_BYTES):
 * one, unless their segments sum in float (bn_backward_float_segments takes a group). */
FASTLN_INLINE int64_t FASTLN_NAME(bn_feature_group)(const fastln_bn_call *call)
{
#if FASTLN_COMPUTE_F32
    const int64_t segment = call->n_inner * (int64_t)sizeof(FASTLN_T);
    if (call->n_inner >= FASTLN_BN_FLOAT_SEGMENT && segment < FASTLN_BN_FEATURE_GROUP_BYTES) {
        const int64_t group = (FASTLN_BN_FEATURE_GROUP_BYTES + segment - 1) / segment;
        const int64_t fits = FASTLN_BN_FEATURE_GROUP_CACHE / (2 * segment * call->n_outer);
        return fastln_max(fastln_min(fastln_min(group, fits), FASTLN_BN_FEATURE_GROUP_MAX), 1);
    }
#endif
    (void)call;
    return 1;
}

/* A group's dy, x and dx values [at, at + n) into L2 (dx for writing): the next group's, while
 * this group's dx is written. */
FASTLN_INLINE void FASTLN_NAME(bn_backward_prefetch_values)(const fastln_bn_call *call,
                                                            int64_t at, int64_t n)
{
    FASTLN_NAME(prefetch_pair)((const FASTLN_T *)call->dy + at, (const FASTLN_T *)call->x + at,
                               n);
    for (int64_t j = 0; j < n; j += FASTLN_LINE)
        __builtin_prefetch((FASTLN_T *)call->dx + at + j, 1, 2);
}

/* The segments layout when each feature's values are one block (fastln_bn_layout, n_blocks =
 * 1: fewer than 2 * FASTLN_BN_SEGMENT_BLOCK_ELEMENTS values, or one sample): a task takes its
 * features through the backward's three phases - sums, constants, dx - a group of features
 * (bn_feature_group) at a time, so that the dx pass finds dy and x in cache from the sums (the
 * phases one after the other read them from memory twice). The bits are the phases': the same
 * sums (added to a zero as fastln_bn_combine_partials adds the one block), the constants of the
 * same per-feature loops, the same dx. A training feature that the rare path may need
 * (fastln_bn_backward_any_rare) waits: bn_backward_waiting_task writes it after
 * bn_rescale_backward.
 * Calls of FASTLN_BN_FEATURES_AHEAD_BYTES and more read from memory, and the groups' segments a
 * sample apart are jumps the hardware prefetchers do not follow: unless a group's segments are
 * long enough for them (FASTLN_BN_FEATURES_AHEAD_SPAN), each sample's values are fetched into
 * L2 ahead (the float sums fetch the next sample's, the dx pass the next group's). Short
 * segments, one feature at a time, fetch the whole next feature instead. */
static void FASTLN_NAME(bn_backward_features_task)(const void *opaque, int64_t begin,
                                                   int64_t end)
{
    const fastln_bn_call *call = opaque;
    const int64_t n = call->n_features, n_inner = call->n_inner;
    const double count = (double)(call->n_outer * n_inner);
    float *head = call->float_constants;
    const int64_t group = FASTLN_NAME(bn_feature_group)(call);
    const int prefetch = call->streaming
                         && n_inner * (int64_t)sizeof(FASTLN_T) < FASTLN_BN_PREFETCH_SEGMENT_BYTES;
    const int64_t span = group * n_inner * (int64_t)sizeof(FASTLN_T); /* read at a time */
    const int ahead = 3 * call->n_outer * n * n_inner * (int64_t)sizeof(FASTLN_T)
                          >= FASTLN_BN_FEATURES_AHEAD_BYTES
                      && span < FASTLN_BN_FEATURES_AHEAD_SPAN;
    for (int64_t first = begin; first < end; first += group) {
        const int64_t n_group = fastln_min(group, end - first);
        const int64_t next = first + n_group, n_next = fastln_min(group, end - next);
        const FASTLN_T *dy = (const FASTLN_T *)call->dy + first * n_inner;
        const FASTLN_T *x = (const FASTLN_T *)call->x + first * n_inner;
        double sum_dy[FASTLN_BN_FEATURE_GROUP_MAX], sum_dy_d[FASTLN_BN_FEATURE_GROUP_MAX];
        double sum_d[FASTLN_BN_FEATURE_GROUP_MAX];
#if FASTLN_COMPUTE_F32
        if (n_inner >= FASTLN_BN_FLOAT_SEGMENT) {
            FASTLN_NAME(bn_backward_float_segments)(dy, x, call->n_outer, n * n_inner, n_inner,
                                                    n_group, call->mean + first, sum_dy,
                                                    sum_dy_d, sum_d, ahead);
        } else
#endif
        {
            if (prefetch && next < end) FASTLN_NAME(bn_backward_prefetch_feature)(call, next);
            FASTLN_NAME(bn_backward_sums_segments)(dy, x, call->n_outer, n * n_inner, n_inner,
                                                   call->mean[first], sum_dy, sum_dy_d, sum_d);
        }
        int64_t ready[FASTLN_BN_FEATURE_GROUP_MAX], n_ready = 0; /* those not waiting */
        for (int64_t c = first; c < next; c++) {
            call->sum_dy[c] = 0.0 + sum_dy[c - first];
            call->sum_dy_d[c] = 0.0 + sum_dy_d[c - first];
            call->sum_d[c] = 0.0 + sum_d[c - first];
            fastln_bn_backward_constants_of(
                1, count, call->training, call->rstd + c, call->mean + c,
                call->gamma ? call->gamma + c : NULL, call->sum_dy + c, call->sum_dy_d + c,
                call->sum_d + c, call->dgamma + c, call->dx_mean + c, call->correction + c,
                call->k + c, call->mean_dy + c, call->coef + c);
            if (call->training
                && fastln_bn_backward_any_rare(1, call->rstd + c, call->sum_dy + c,
                                               call->sum_dy_d + c, call->sum_d + c,
                                               call->dgamma + c, call->coef + c)) {
                call->waiting[c] = 1;
                continue;
            }
            if (head)
                fastln_bn_backward_float_constants_of(
                    1, call->dx_mean + c, call->correction + c, call->k + c, call->mean_dy + c,
                    call->coef + c, head + c, head + n + c, head + 2 * n + c, head + 3 * n + c,
                    head + 4 * n + c);
            FASTLN_NAME(bn_store_parameter_gradients)(call, c);
            ready[n_ready++] = c;
        }
        /* dx feature by feature (from L2: the order of reading matters less here; sample by
         * sample, short segments measured slower), the next group fetched along the first */
        const int fetch_next = ahead && n_next > 0 && !prefetch;
        for (int64_t r = 0; r < n_ready; r++)
            for (int64_t k = 0; k < call->n_outer; k++) {
                if (fetch_next && r == 0)
                    FASTLN_NAME(bn_backward_prefetch_values)(call, (k * n + next) * n_inner,
                                                             n_next * n_inner);
                FASTLN_NAME(bn_backward_apply_segment_unit)(call, k * n + ready[r]);
            }
    }
}

/* After bn_backward_features_task: the waiting features, if any, through the rare path (as
 * bn_backward_constants_task takes every feature there), then their dx. */
static void FASTLN_NAME(bn_backward_waiting_task)(const void *opaque, int64_t begin,
                                                  int64_t end)
{
    const fastln_bn_call *call = opaque;
    (void)begin;
    (void)end;
    const int64_t n = call->n_features;
    *call->n_finish = 0;
    int64_t n_waiting = 0;
    for (int64_t c = 0; c < n; c++) n_waiting += call->waiting[c];
    if (n_waiting == 0) return;
    FASTLN_NAME(bn_rescale_backward)(call->dy, call->x, call);
    if (call->float_constants) fastln_bn_backward_float_constants(call);
    for (int64_t c = 0; c < n; c++)
        if (call->waiting[c]) FASTLN_NAME(bn_backward_finish_feature)(call, c);
}

static void FASTLN_NAME(bn_backward_finish_rescaled_task)(const void *opaque, int64_t begin,
                                                          int64_t end)
{
    const fastln_bn_call *call = opaque;
    (void)begin;
    (void)end;
    FASTLN_NAME(bn_finish_rescaled_backward)(call->dx, call->x, call);
}

/* ---- GroupNorm ------------------------------------------------------------------------------
 * Channels first (NCHW), (sample, group) ng is the run of fastln_gn_group_size values at
 * x + ng * size; channels last (NHWC), sample n is n_spatial rows of n_channels values, and
 * group g its channels [g * per_group, (g + 1) * per_group) of every row. The pieces, blocks
 * and scratch are laid out by fastln/group_norm.h. */

/* The careful view of a group (rare.h) and where it starts. */
FASTLN_INLINE fastln_gn_view FASTLN_NAME(gn_view_of)(const fastln_gn_call *call, int64_t ng,
                                                     int64_t *offset)
{
    const int64_t per_group = call->n_channels / call->n_groups;
    const int64_t n = ng / call->n_groups, g = ng % call->n_groups;
    fastln_gn_view view;
    view.first_channel = g * per_group;
    view.channels_last = call->channels_last;
    if (call->channels_last) {
        view.n_rows = call->n_spatial;
        view.width = per_group;
        view.stride = call->n_channels;
        *offset = n * call->n_spatial * call->n_channels + g * per_group;
    } else {
        view.n_rows = per_group;
        view.width = view.stride = call->n_spatial;
        *offset = ng * per_group * call->n_spatial;
    }
    return view;
}

/* A forward group's statistics are known: keep them (the cache's mean and rstd, the scratch),
 * and write a channels-first group whose rstd is beyond double now (channels last: flag it for
 * FASTLN_GN_FINISH_RARE, after the write pass that must not overwrite it). */
FASTLN_INLINE void FASTLN_NAME(gn_keep_statistics)(const fastln_gn_call *call, int64_t ng,
                                                   const fastln_ln_stats *stats)
{
    FASTLN_P *mean = call->mean, *rstd = call->rstd;
    if (mean) mean[ng] = (FASTLN_P)stats->mean;
    if (rstd) rstd[ng] = (FASTLN_P)stats->rstd;
    fastln_gn_store_stats(call->group_scratch + FASTLN_GN_GROUP_FIELDS * ng, stats);
    call->rare[ng] = stats->rare;
    if (call->rare[ng] && !call->channels_last) {
        int64_t offset;
        const fastln_gn_view view = FASTLN_NAME(gn_view_of)(call, ng, &offset);
        FASTLN_NAME(gn_write_rescaled)((const FASTLN_T *)call->x + offset,
                                       (FASTLN_T *)call->y + offset, &view, call->gamma,
                                       call->beta, stats);
    }
}

/* Channels first: values [start, end) of group ng's run written from its kept statistics. */
FASTLN_INLINE void FASTLN_NAME(gn_write_part)(const fastln_gn_call *call, int64_t ng,
                                              int64_t start, int64_t end)
{
    if (call->rare[ng]) return;
    const int64_t size = fastln_gn_group_size(call);
    const int64_t per_group = call->n_channels / call->n_groups;
    const fastln_ln_stats stats =
        fastln_gn_load_stats(call->group_scratch + FASTLN_GN_GROUP_FIELDS * ng);
    FASTLN_NAME(gn_write_run)((const FASTLN_T *)call->x + ng * size, (FASTLN_T *)call->y + ng * size,
                              start, end, call->n_spatial, (ng % call->n_groups) * per_group,
                              &stats, fastln_gn_x_hat_scale(&stats, call->eps), call->gamma,
                              call->beta, call->streaming);
}

/* Channels first, a group per task: its pieces' sums, its statistics, its write pass while
 * the group is still in cache. The same sums in the same order as the piece phases. */
static void FASTLN_NAME(gn_forward_groups_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_gn_call *call = opaque;
    const int64_t size = fastln_gn_group_size(call);
    for (int64_t ng = begin; ng < end; ng++) {
        const FASTLN_T *x = (const FASTLN_T *)call->x + ng * size;
        double *sums = call->partials + 2 * call->n_pieces * ng;
        FASTLN_NAME(gn_piece_sums)(x, size, call->piece, 0, call->n_pieces, sums);
        fastln_ln_stats stats;
        FASTLN_NAME(gn_run_statistics)(x, size, sums, call->n_pieces, call->eps, &stats);
        FASTLN_NAME(gn_keep_statistics)(call, ng, &stats);
        FASTLN_NAME(gn_write_part)(call, ng, 0, size);
    }
    if (call->streaming) fastln_streaming_fence(); /* the task's streamed writes (gn_write) */
}

/* Channels last: where block `task` of a sample starts, and its rows. */
FASTLN_INLINE int64_t FASTLN_NAME(gn_block)(const fastln_gn_call *call, int64_t task,
                                            int64_t *n_rows)
{
    const int64_t n = task / call->n_pieces, b = task % call->n_pieces;
    *n_rows = fastln_min(call->piece, call->n_spatial - b * call->piece);
    return (n * call->n_spatial + b * call->piece) * call->n_channels;
}

/* Pieces (channels first) or blocks (channels last): their shifted sums. */
static void FASTLN_NAME(gn_statistics_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_gn_call *call = opaque;
    const FASTLN_T *x = call->x;
    const int64_t size = fastln_gn_group_size(call), C = call->n_channels;
    const int64_t per_group = C / call->n_groups;
    for (int64_t task = begin; task < end; task++) {
        if (!call->channels_last) {
            const int64_t ng = task / call->n_pieces, p = task % call->n_pieces;
            FASTLN_NAME(gn_piece_sums)(x + ng * size, size, call->piece, p, p + 1,
                                       call->partials + 2 * call->n_pieces * ng);
            continue;
        }
        double *shift = call->partials + 3 * C * task;
        int64_t n_rows;
        const int64_t offset = FASTLN_NAME(gn_block)(call, task, &n_rows);
#if FASTLN_COMPUTE_F32
        FASTLN_NAME(gn_float_block)(x + offset, n_rows, C, per_group, shift, shift + C,
                                    shift + 2 * C);
#else
        /* Each block shifts a channel by its group's first value (spatial position 0). */
        const FASTLN_T *first_row = x + task / call->n_pieces * call->n_spatial * C;
        for (int64_t c = 0; c < C; c++)
            shift[c] = FASTLN_NAME(to_double)(first_row[c / per_group * per_group]);
        FASTLN_NAME(bn_stats_rows)(x + offset, n_rows, C, C, shift, shift + C, shift + 2 * C);
#endif
    }
}

/* Groups: their statistics from the pieces' (blocks') sums, added in order; channels last,
 * also the write constants of their channels. */
static void FASTLN_NAME(gn_finish_statistics_task)(const void *opaque, int64_t begin,
                                                   int64_t end)
{
    const fastln_gn_call *call = opaque;
    const FASTLN_T *x = call->x;
    const int64_t size = fastln_gn_group_size(call), C = call->n_channels;
    const int64_t per_group = C / call->n_groups, n_channel_values = call->n_samples * C;
    for (int64_t ng = begin; ng < end; ng++) {
        fastln_ln_stats stats;
        if (!call->channels_last) {
            FASTLN_NAME(gn_run_statistics)(x + ng * size, size,
                                           call->partials + 2 * call->n_pieces * ng,
                                           call->n_pieces, call->eps, &stats);
            FASTLN_NAME(gn_keep_statistics)(call, ng, &stats);
            continue;
        }
        const int64_t n = ng / call->n_groups, first = (ng % call->n_groups) * per_group;
        const double *blocks = call->partials + 3 * C * n * call->n_pieces;
#if FASTLN_COMPUTE_F32
        const int held = fastln_gn_float_block_statistics(blocks, C, call->n_pieces, call->piece,
                                                          call->n_spatial, first, per_group,
                                                          call->eps, &stats);
#else
        const int held = fastln_gn_block_statistics(blocks, C, call->n_pieces, first, per_group,
                                                    (double)size, call->eps, &stats);
#endif
        if (!held) {
            int64_t offset;
            const fastln_gn_view view = FASTLN_NAME(gn_view_of)(call, ng, &offset);
            FASTLN_NAME(gn_view_statistics)(x + offset, &view, call->eps, &stats);
        }
        FASTLN_NAME(gn_keep_statistics)(call, ng, &stats);
        const double x_hat_scale = fastln_gn_x_hat_scale(&stats, call->eps);
        double *constants = call->channel_scratch + n * C;
#if FASTLN_COMPUTE_F32
        float mean_tail;
        const float mean_head =
            FASTLN_NAME(gn_float_mean)(stats.shift, stats.mean_shifted, &mean_tail);
#endif
        for (int64_t c = first; c < first + per_group; c++) {
            const FASTLN_NAME(gn_channel) channel = FASTLN_NAME(gn_channel_of)(
                &stats, x_hat_scale, call->gamma, call->beta, c);
            constants[c] = channel.shift;
            constants[n_channel_values + c] = channel.mean_shifted;
            constants[2 * n_channel_values + c] = channel.scale;
            constants[3 * n_channel_values + c] = channel.offset;
#if FASTLN_COMPUTE_F32
            FASTLN_NAME(gn_float_channel)(&channel, mean_head, mean_tail,
                                          fastln_gn_float_constants(call) + n * C + c,
                                          n_channel_values);
#endif
        }
    }
}

/* Whether sample n has a group a rare path does. */
FASTLN_INLINE int FASTLN_NAME(gn_sample_has_rare)(const fastln_gn_call *call, int64_t n)
{
    int any = 0;
    for (int64_t g = 0; g < call->n_groups; g++) any |= call->rare[n * call->n_groups + g] != 0;
    return any;
}

/* Channels last: channels [first, first + width) of sample n's rows (n_rows rows of width
 * values, width apart), with their write constants: in float for the float32-compute types
 * (bn_apply_rows_float, its rows stored as `store` says), in double for float64. */
FASTLN_INLINE void FASTLN_NAME(gn_apply_channels)(const fastln_gn_call *call, int64_t n,
                                                  int64_t first, int64_t width, const FASTLN_T *x,
                                                  FASTLN_T *y, int64_t n_rows, int store)
{
    const int64_t n_channel_values = call->n_samples * call->n_channels;
    const double *shift = call->channel_scratch + n * call->n_channels + first;
    const double *center = shift + n_channel_values, *scale = center + n_channel_values;
    const double *offset = scale + n_channel_values;
#if FASTLN_COMPUTE_F32
    const float *head = fastln_gn_float_constants(call) + n * call->n_channels + first;
    const fastln_rows_constants k = {head, head + n_channel_values, head + 2 * n_channel_values,
                                     head + 3 * n_channel_values, shift, center, scale, offset};
    /* x_end = x: no row lies inside, so none is fetched */
    const int64_t x_bytes = n_channel_values * call->n_spatial * (int64_t)sizeof(FASTLN_T);
    const FASTLN_T *x_end = x_bytes >= FASTLN_GN_FETCH_ROWS_BYTES ? x + n_rows * width : x;
    FASTLN_NAME(bn_apply_rows_float)(x, y, n_rows, width, &k, store, x_end);
#else
    FASTLN_NAME(bn_apply_rows)(x, y, n_rows, width, shift, center, scale, offset, store);
#endif
}

/* Pieces (channels first) or blocks (channels last): the write pass. Channels last, the
 * channels of a rare group are left for FASTLN_GN_FINISH_RARE (which reads x: y may be x). */
static void FASTLN_NAME(gn_apply_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_gn_call *call = opaque;
    const FASTLN_T *x = call->x;
    FASTLN_T *y = call->y;
    const int64_t size = fastln_gn_group_size(call), C = call->n_channels;
    const int64_t per_group = C / call->n_groups;
    for (int64_t task = begin; task < end; task++) {
        if (!call->channels_last) {
            const int64_t ng = task / call->n_pieces, p = task % call->n_pieces;
            FASTLN_NAME(gn_write_part)(call, ng, p * call->piece,
                                       fastln_min((p + 1) * call->piece, size));
            continue;
        }
        const int64_t n = task / call->n_pieces;
        int64_t n_rows;
        const int64_t offset = FASTLN_NAME(gn_block)(call, task, &n_rows);
        if (!FASTLN_NAME(gn_sample_has_rare)(call, n)) {
            /* Non-temporal stores need every row 16-byte aligned. */
            const int streaming = call->streaming && fastln_is_aligned16(y + offset)
                                  && C * (int64_t)sizeof(FASTLN_T) % 16 == 0;
            const int store = fastln_rows_store(
                streaming, call->n_samples * call->n_spatial * C * (int64_t)sizeof(FASTLN_T));
            FASTLN_NAME(gn_apply_channels)(call, n, 0, C, x + offset, y + offset, n_rows, store);
            continue;
        }
        /* A sample with a rare group: its other groups one by one, each as above. */
        for (int64_t r = 0; r < n_rows; r++)
            for (int64_t g = 0; g < call->n_groups; g++) {
                if (call->rare[n * call->n_groups + g]) continue;
                const int64_t at = offset + r * C + g * per_group;
                FASTLN_NAME(gn_apply_channels)(call, n, g * per_group, per_group, x + at, y + at,
                                               1, FASTLN_ROWS_ALONE);
            }
    }
    if (call->streaming) fastln_streaming_fence(); /* the task's streamed writes (gn_write) */
}

/* Channels last: the groups whose rstd is beyond double, written rescaled. One task. */
static void FASTLN_NAME(gn_finish_rare_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_gn_call *call = opaque;
    (void)begin;
    (void)end;
    for (int64_t ng = 0; ng < call->n_samples * call->n_groups; ng++) {
        if (!call->rare[ng]) continue;
        int64_t offset;
        const fastln_gn_view view = FASTLN_NAME(gn_view_of)(call, ng, &offset);
        const fastln_ln_stats stats =
            fastln_gn_load_stats(call->group_scratch + FASTLN_GN_GROUP_FIELDS * ng);
        FASTLN_NAME(gn_write_rescaled)((const FASTLN_T *)call->x + offset,
                                       (FASTLN_T *)call->y + offset, &view, call->gamma,
                                       call->beta, &stats);
    }
}

/* Channels first, piece p of the values of (sample, channel) nc in group ng: its three sums
 * (into its partials, task nc * n_pieces + p), and its dx from the group's constants. The
 * piece phases and the group tasks take a piece alike. */
FASTLN_INLINE void FASTLN_NAME(gn_backward_piece_sums)(const fastln_gn_call *call, int64_t nc,
                                                       int64_t p, int64_t ng)
{
    const int64_t at = nc * call->n_spatial + p * call->piece;
    FASTLN_NAME(run_backward_sums)((const FASTLN_T *)call->dy + at, (const FASTLN_T *)call->x + at,
                                   fastln_min(call->piece, call->n_spatial - p * call->piece),
                                   (double)((const FASTLN_P *)call->mean)[ng],
                                   call->partials + 3 * (nc * call->n_pieces + p));
}

FASTLN_INLINE void FASTLN_NAME(gn_backward_piece_write)(const fastln_gn_call *call, int64_t nc,
                                                        int64_t p, int64_t ng)
{
    const int64_t at = nc * call->n_spatial + p * call->piece;
    const FASTLN_P *gamma = call->gamma;
    FASTLN_NAME(gn_backward_write)((const FASTLN_T *)call->dy + at, (const FASTLN_T *)call->x + at,
                                   (FASTLN_T *)call->dx + at,
                                   fastln_min(call->piece, call->n_spatial - p * call->piece),
                                   call->group_scratch + FASTLN_GN_GROUP_FIELDS * ng,
                                   gamma ? (double)gamma[nc % call->n_channels] : 1.0,
                                   call->streaming);
}

/* Backward pieces (channels first: of a channel's values) or blocks: their three sums. */
static void FASTLN_NAME(gn_backward_sums_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_gn_call *call = opaque;
    const FASTLN_T *dy = call->dy, *x = call->x;
    const FASTLN_P *mean = call->mean;
    const int64_t C = call->n_channels;
    const int64_t per_group = C / call->n_groups;
    for (int64_t task = begin; task < end; task++) {
        if (!call->channels_last) {
            const int64_t nc = task / call->n_pieces;
            FASTLN_NAME(gn_backward_piece_sums)(call, nc, task % call->n_pieces,
                                                nc / C * call->n_groups + nc % C / per_group);
            continue;
        }
        double *channel_mean = call->partials + 4 * C * task;
        const FASTLN_P *sample_mean = mean + task / call->n_pieces * call->n_groups;
        for (int64_t c = 0; c < C; c++) channel_mean[c] = (double)sample_mean[c / per_group];
        int64_t n_rows;
        const int64_t offset = FASTLN_NAME(gn_block)(call, task, &n_rows);
        double *sum_dy = channel_mean + C, *sum_dy_d = sum_dy + C, *sum_d = sum_dy_d + C;
#if FASTLN_COMPUTE_F32
        /* In float runs around the group's mean, a float already (the cache's), as BatchNorm's
         * rows layout sums, prefetching as the double loop does; a channel whose float sums do
         * not hold (LayerNorm's rule) is summed again in double over the block. */
        FASTLN_NAME(bn_backward_float_rows)(dy + offset, x + offset, n_rows, C, C, channel_mean,
                                            sum_dy, sum_dy_d, sum_d, 1);
        for (int64_t c = 0; c < C; c++)
            FASTLN_NAME(bn_backward_rows_hold)(dy + offset, x + offset, n_rows, C, c,
                                               channel_mean[c], sum_dy + c, sum_dy_d + c,
                                               sum_d + c);
#else
        FASTLN_NAME(bn_backward_sums_rows)(dy + offset, x + offset, n_rows, C, C, channel_mean,
                                           sum_dy, sum_dy_d, sum_d);
#endif
    }
}

/* One group's backward constants: channels first, its channels' piece sums first added in
 * piece order into each channel's first piece. A rare group's dx is written here, from x (and
 * call->rare[ng] set); channels last, the group's channels get their write constants. */
FASTLN_INLINE void FASTLN_NAME(gn_backward_finish_group)(const fastln_gn_call *call, int64_t ng)
{
    const FASTLN_T *dy = call->dy, *x = call->x;
    FASTLN_T *dx = call->dx;
    const FASTLN_P *mean = call->mean, *rstd = call->rstd, *gamma = call->gamma;
    const int64_t C = call->n_channels, G = call->n_groups, P = call->n_pieces;
    const int64_t per_group = C / G, n_channel_values = call->n_samples * C;
    double *dgamma_terms = call->channel_scratch, *dbeta_terms = dgamma_terms + n_channel_values;
    const int64_t n = ng / G, first = ng % G * per_group, nc = n * C + first;
    const double *sum_dy, *sum_dy_d, *sum_d;
    int64_t stride;
    if (!call->channels_last) {
        for (int64_t c = nc; c < nc + per_group; c++)
            for (int64_t p = 1; p < P; p++)
                for (int k = 0; k < 3; k++)
                    call->partials[3 * P * c + k] += call->partials[3 * (P * c + p) + k];
        sum_dy = call->partials + 3 * P * nc;
        stride = 3 * P;
    } else {
        sum_dy = call->partials + 4 * C * P * n + C + first;
        stride = 1;
    }
    sum_dy_d = call->channels_last ? sum_dy + C : sum_dy + 1;
    sum_d = call->channels_last ? sum_dy + 2 * C : sum_dy + 2;
    double *fields = call->group_scratch + FASTLN_GN_GROUP_FIELDS * ng;
    const double group_rstd = (double)rstd[ng];
    const int finite = FASTLN_NAME(gn_backward_group)(
        sum_dy, sum_dy_d, sum_d, stride, gamma ? gamma + first : NULL, per_group,
        (double)fastln_gn_group_size(call), (double)mean[ng], group_rstd, fields,
        dgamma_terms + nc, dbeta_terms + nc);
    call->rare[ng] = 0;
    /* A group whose rstd is beyond the cache's range, or whose plain sums are not finite
     * while its statistics are (products that overflow; or a NaN or Inf in dy or gamma,
     * which must not take the dgamma and dbeta of the group's other channels with it). */
    if (isinf(group_rstd) || (!finite && !isnan(group_rstd))) {
        int64_t offset;
        const fastln_gn_view view = FASTLN_NAME(gn_view_of)(call, ng, &offset);
        for (int64_t c = 0; c < per_group; c++) dgamma_terms[nc + c] = dbeta_terms[nc + c] = 0.0;
        FASTLN_NAME(gn_backward_recomputed)(dy + offset, x + offset, dx + offset, &view, gamma,
                                            call->eps, dgamma_terms + nc, dbeta_terms + nc);
        call->rare[ng] = 1;
    }
    if (call->channels_last) {
        double *constants = call->channel_scratch + 2 * n_channel_values + nc;
        for (int64_t c = 0; c < per_group; c++) {
            constants[c] = fields[0];
            constants[n_channel_values + c] = fields[1];
            constants[2 * n_channel_values + c] = fields[2];
            constants[3 * n_channel_values + c] = gamma ? (double)gamma[first + c] : 1.0;
            constants[4 * n_channel_values + c] = fields[3];
            constants[5 * n_channel_values + c] = fields[4];
        }
#if FASTLN_COMPUTE_F32
        /* The same rounded to float, as the channels-first float write rounds them. */
        float *floats = fastln_gn_backward_float_constants(call) + nc;
        for (int64_t k = 0; k < 6; k++)
            for (int64_t c = 0; c < per_group; c++)
                floats[k * n_channel_values + c] = (float)constants[k * n_channel_values + c];
#endif
    }
}

/* Whether group ng's dx is written in float: the float32-compute types whose rstd fits a float
 * (as gn_backward_write). */
FASTLN_INLINE int FASTLN_NAME(gn_backward_in_floats)(const fastln_gn_call *call, int64_t ng)
{
#if FASTLN_COMPUTE_F32
    return fastln_scale_fits_float(call->group_scratch[FASTLN_GN_GROUP_FIELDS * ng + 2]);
#else
    (void)call;
    (void)ng;
    return 0;
#endif
}

/* Channels last: channels [first, first + width) of n_rows rows of sample n (rows C apart), in
 * float or in double as their groups' rstd says (in_floats). */
FASTLN_INLINE void FASTLN_NAME(gn_backward_apply_channels)(const fastln_gn_call *call, int64_t n,
                                                           int64_t first, int64_t width,
                                                           int64_t offset, int64_t n_rows,
                                                           int in_floats)
{
    const int64_t C = call->n_channels, n_channel_values = call->n_samples * C;
    const FASTLN_T *dy = (const FASTLN_T *)call->dy + offset;
    const FASTLN_T *x = (const FASTLN_T *)call->x + offset;
    FASTLN_T *dx = (FASTLN_T *)call->dx + offset;
#if FASTLN_COMPUTE_F32
    if (in_floats) {
        /* Non-temporal stores need every row's vectors 16-byte aligned. */
        const int streaming = call->streaming && fastln_is_aligned16(dx)
                              && C * (int64_t)sizeof(FASTLN_T) % 16 == 0
                              && width % FASTLN_VF_LANES == 0;
        FASTLN_NAME(gn_backward_apply_rows_float)(
            dy, x, dx, n_rows, width, C,
            fastln_gn_backward_float_constants(call) + n * C + first, n_channel_values,
            streaming);
        return;
    }
#else
    (void)in_floats;
#endif
    const double *constants = call->channel_scratch + 2 * n_channel_values + n * C + first;
    FASTLN_NAME(gn_backward_apply_rows)(dy, x, dx, n_rows, width, C, constants, n_channel_values);
}

/* x_hat of the value at `at` of group ng, as the backward takes it (values_x_hat, rare.h). */
static double FASTLN_NAME(gn_value_x_hat)(const fastln_gn_call *call, int64_t ng, int64_t at,
                                          FASTLN_NAME(values_again) *again)
{
    const FASTLN_T *x = call->x;
    int64_t offset;
    const fastln_gn_view view = FASTLN_NAME(gn_view_of)(call, ng, &offset);
    return FASTLN_NAME(values_x_hat)(x + offset, &view, (double)((const FASTLN_P *)call->mean)[ng],
                                     (double)((const FASTLN_P *)call->rstd)[ng], call->eps, x[at],
                                     again);
}

/* The channels whose dgamma or dbeta came out Inf or NaN, summed again as the row backwards'
 * columns are (column_sums_again, fastln/rare.h): in double, float64 dy scaled by
 * 2^-FASTLN_COLUMN_SCALE, sample after sample and each sample's values in spatial order, each
 * sum on its own. Their terms per (sample, channel) or their totals over the samples may have
 * overflowed where the exact sums are finite. The sums go to sample 0's terms. */
FASTLN_OUTLINED void FASTLN_NAME(gn_parameter_sums_again)(const fastln_gn_call *call)
{
    const int64_t C = call->n_channels, G = call->n_groups, S = call->n_spatial;
    const int64_t per_group = C / G;
    const FASTLN_T *dy = call->dy;
    FASTLN_P *dgamma = call->dgamma, *dbeta = call->dbeta;
    double *sum_dy_xhat = call->channel_scratch;
    double *sum_dy = sum_dy_xhat + call->n_samples * C;
    const int unscale = FASTLN_COMPUTE_F32 ? 0 : FASTLN_COLUMN_SCALE;
    const double scale = ldexp(1.0, -unscale);
    for (int64_t c = 0; c < C; c++) sum_dy_xhat[c] = sum_dy[c] = 0.0;
    for (int64_t n = 0; n < call->n_samples; n++)
        for (int64_t g = 0; g < G; g++) {
            FASTLN_NAME(values_again) again = {0};
            for (int64_t c = g * per_group; c < (g + 1) * per_group; c++) {
                const int redo_dgamma = !isfinite((double)dgamma[c]);
                const int redo_dbeta = !isfinite((double)dbeta[c]);
                if (!redo_dgamma && !redo_dbeta) continue;
                for (int64_t s = 0; s < S; s++) {
                    const int64_t at = call->channels_last ? (n * S + s) * C + c
                                                           : (n * C + c) * S + s;
                    const double dy_scaled = FASTLN_NAME(to_double)(dy[at]) * scale;
                    if (redo_dbeta) sum_dy[c] += dy_scaled;
                    if (redo_dgamma)
                        sum_dy_xhat[c] += dy_scaled * FASTLN_NAME(gn_value_x_hat)(
                                                          call, n * G + g, at, &again);
                }
            }
        }
    FASTLN_NAME(store_sums_again)(dgamma, sum_dy_xhat, 0, C, unscale);
    FASTLN_NAME(store_sums_again)(dbeta, sum_dy, 0, C, unscale);
}

/* dgamma and dbeta: each channel's terms added in sample order. */
FASTLN_INLINE void FASTLN_NAME(gn_backward_parameter_sums)(const fastln_gn_call *call)
{
    const int64_t C = call->n_channels, n_channel_values = call->n_samples * C;
    const double *dgamma_terms = call->channel_scratch;
    const double *dbeta_terms = dgamma_terms + n_channel_values;
    FASTLN_P *dgamma = call->dgamma, *dbeta = call->dbeta;
    int not_finite = 0;
    for (int64_t c = 0; c < C; c++) {
        double total_dgamma = 0.0, total_dbeta = 0.0;
        for (int64_t n = 0; n < call->n_samples; n++) {
            total_dgamma += dgamma_terms[n * C + c];
            total_dbeta += dbeta_terms[n * C + c];
        }
        dgamma[c] = (FASTLN_P)total_dgamma;
        dbeta[c] = (FASTLN_P)total_dbeta;
        not_finite |= FASTLN_NAME(parameter_not_finite)(dgamma[c])
                      | FASTLN_NAME(parameter_not_finite)(dbeta[c]);
    }
    if (not_finite) FASTLN_NAME(gn_parameter_sums_again)(call);
}

/* The backward's constants, group by group (the rare groups done here, from x; channels last
 * after the blocks' sums are added in block order), then dgamma and dbeta. One task. */
static void FASTLN_NAME(gn_backward_constants_task)(const void *opaque, int64_t begin,
                                                    int64_t end)
{
    const fastln_gn_call *call = opaque;
    (void)begin;
    (void)end;
    const int64_t C = call->n_channels, P = call->n_pieces;
    if (call->channels_last)
        for (int64_t n = 0; n < call->n_samples; n++) {
            double *first = call->partials + 4 * C * P * n;
            for (int64_t b = 1; b < P; b++)
                for (int64_t j = C; j < 4 * C; j++) first[j] += first[4 * C * b + j];
        }
    for (int64_t ng = 0; ng < call->n_samples * call->n_groups; ng++)
        FASTLN_NAME(gn_backward_finish_group)(call, ng);
    FASTLN_NAME(gn_backward_parameter_sums)(call);
}

/* Channels first, a task per group: its channels' piece sums, its constants, then its dx while
 * the group is still in cache, where the three phases above read it from memory twice. The
 * same sums in the same order: the same bits. */
static void FASTLN_NAME(gn_backward_groups_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_gn_call *call = opaque;
    const int64_t C = call->n_channels, G = call->n_groups, P = call->n_pieces;
    const int64_t per_group = C / G, n_spatial = call->n_spatial;
    /* dx fetched for writing while the sums read (not streamed, from FASTLN_GN_FETCH_DX_BYTES
     * of dy, x and dx): the write pass then finds its lines in L2 instead of waiting for each
     * one from memory before it can store. */
    const int fetch_dx = !call->streaming
                         && 3 * call->n_samples * C * n_spatial * (int64_t)sizeof(FASTLN_T)
                                >= FASTLN_GN_FETCH_DX_BYTES;
    for (int64_t ng = begin; ng < end; ng++) {
        const int64_t first = ng / G * C + ng % G * per_group;
        for (int64_t nc = first; nc < first + per_group; nc++) {
            if (fetch_dx)
                for (int64_t j = 0; j < n_spatial; j += FASTLN_LINE)
                    __builtin_prefetch((FASTLN_T *)call->dx + nc * n_spatial + j, 1, 2);
            for (int64_t p = 0; p < P; p++) FASTLN_NAME(gn_backward_piece_sums)(call, nc, p, ng);
        }
        FASTLN_NAME(gn_backward_finish_group)(call, ng);
        if (call->rare[ng]) continue;
        /* Last piece first: what the sums read last is what the cache still holds. */
        for (int64_t nc = first + per_group - 1; nc >= first; nc--)
            for (int64_t p = P - 1; p >= 0; p--) FASTLN_NAME(gn_backward_piece_write)(call, nc, p, ng);
    }
    if (call->streaming) fastln_streaming_fence(); /* the task's streamed dx */
}

/* After the groups: dgamma and dbeta. One task. */
static void FASTLN_NAME(gn_backward_parameters_task)(const void *opaque, int64_t begin,
                                                     int64_t end)
{
    (void)begin;
    (void)end;
    FASTLN_NAME(gn_backward_parameter_sums)(opaque);
}

/* Backward pieces or blocks: dx (the rare groups were written by the constants task). */
static void FASTLN_NAME(gn_backward_apply_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_gn_call *call = opaque;
    const int64_t C = call->n_channels, G = call->n_groups;
    const int64_t per_group = C / G;
    for (int64_t task = begin; task < end; task++) {
        if (!call->channels_last) {
            const int64_t nc = task / call->n_pieces, ng = nc / C * G + nc % C / per_group;
            if (!call->rare[ng])
                FASTLN_NAME(gn_backward_piece_write)(call, nc, task % call->n_pieces, ng);
            continue;
        }
        const int64_t n = task / call->n_pieces;
        int64_t n_rows;
        const int64_t offset = FASTLN_NAME(gn_block)(call, task, &n_rows);
        /* The whole rows when every group of the sample is written the same way (rare ones
         * aside: the constants task wrote them), else group by group. */
        int all_floats = 1, all_doubles = 1;
        for (int64_t g = 0; g < G; g++) {
            if (call->rare[n * G + g]) {
                all_floats = all_doubles = 0;
                break;
            }
            const int in_floats = FASTLN_NAME(gn_backward_in_floats)(call, n * G + g);
            all_floats &= in_floats;
            all_doubles &= !in_floats;
        }
        if (all_floats || all_doubles) {
            FASTLN_NAME(gn_backward_apply_channels)(call, n, 0, C, offset, n_rows, all_floats);
            continue;
        }
        for (int64_t g = 0; g < G; g++) {
            if (call->rare[n * G + g]) continue;
            const int in_floats = FASTLN_NAME(gn_backward_in_floats)(call, n * G + g);
            FASTLN_NAME(gn_backward_apply_channels)(call, n, g * per_group, per_group,
                                                    offset + g * per_group, n_rows, in_floats);
        }
    }
    if (call->streaming) fastln_streaming_fence(); /* the task's streamed dx */
}

#if FASTLN_COMPUTE_F32 && FASTLN_STORAGE != FASTLN_FLOAT32
/* The half conversions alone, exactly as the kernels load and store (the tests hold them to
 * NumPy's and ml_dtypes' astype): call->x's halves widened into call->y's floats, or call->x's
 * floats rounded into call->y's halves. Tasks are elements. */
static void FASTLN_NAME(widen_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_rows_call *call = opaque;
    const FASTLN_T *half = call->x;
    float *out = call->y;
    int64_t i = begin;
    for (; i + FASTLN_VF_LANES <= end; i += FASTLN_VF_LANES)
        FASTLN_ISA(store_f32)(out + i, FASTLN_NAME(load_c)(half + i));
    for (; i < end; i++) out[i] = FASTLN_NAME(to_compute)(half[i]);
}

static void FASTLN_NAME(narrow_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_rows_call *call = opaque;
    const float *values = call->x;
    FASTLN_T *out = call->y;
    int64_t i = begin;
    for (; i + FASTLN_VF_LANES <= end; i += FASTLN_VF_LANES)
        FASTLN_NAME(store_c)(out + i, FASTLN_ISA(load_f32)(values + i));
    for (; i < end; i++) out[i] = FASTLN_NAME(from_compute)(values[i]);
}
#endif

/* This storage type's row of the dispatch table (fastln/kernels.h). */
static const fastln_task FASTLN_NAME(tasks)[FASTLN_N_TASKS] = {
    [FASTLN_LAYER_NORM_FORWARD] = FASTLN_NAME(layer_norm_forward_task),
    [FASTLN_RMS_NORM_FORWARD] = FASTLN_NAME(rms_norm_forward_task),
    [FASTLN_ADD_LAYER_NORM_FORWARD] = FASTLN_NAME(add_layer_norm_forward_task),
    [FASTLN_ADD_RMS_NORM_FORWARD] = FASTLN_NAME(add_rms_norm_forward_task),
    [FASTLN_LAYER_NORM_BACKWARD] = FASTLN_NAME(layer_norm_backward_task),
    [FASTLN_RMS_NORM_BACKWARD] = FASTLN_NAME(rms_norm_backward_task),
    [FASTLN_COLUMN_SUMS] = FASTLN_NAME(column_sums_task),
    [FASTLN_BN_FIRST_VALUES] = FASTLN_NAME(bn_first_values_task),
    [FASTLN_BN_STATISTICS] = FASTLN_NAME(bn_statistics_task),
    [FASTLN_BN_TRAIN_CONSTANTS] = FASTLN_NAME(bn_train_constants_task),
    [FASTLN_BN_EVAL_CONSTANTS] = FASTLN_NAME(bn_eval_constants_task),
    [FASTLN_BN_APPLY] = FASTLN_NAME(bn_apply_task),
    [FASTLN_BN_FINISH_RESCALED] = FASTLN_NAME(bn_finish_rescaled_task),
    [FASTLN_BN_BACKWARD_SUMS] = FASTLN_NAME(bn_backward_sums_task),
    [FASTLN_BN_BACKWARD_CONSTANTS] = FASTLN_NAME(bn_backward_constants_task),
    [FASTLN_BN_BACKWARD_APPLY] = FASTLN_NAME(bn_backward_apply_task),
    [FASTLN_BN_BACKWARD_FEATURES] = FASTLN_NAME(bn_backward_features_task),
    [FASTLN_BN_BACKWARD_WAITING] = FASTLN_NAME(bn_backward_waiting_task),
    [FASTLN_BN_BACKWARD_FINISH_RESCALED] = FASTLN_NAME(bn_backward_finish_rescaled_task),
    [FASTLN_GN_FORWARD_GROUPS] = FASTLN_NAME(gn_forward_groups_task),
    [FASTLN_GN_STATISTICS] = FASTLN_NAME(gn_statistics_task),
    [FASTLN_GN_FINISH_STATISTICS] = FASTLN_NAME(gn_finish_statistics_task),
    [FASTLN_GN_APPLY] = FASTLN_NAME(gn_apply_task),
    [FASTLN_GN_FINISH_RARE] = FASTLN_NAME(gn_finish_rare_task),
    [FASTLN_GN_BACKWARD_GROUPS] = FASTLN_NAME(gn_backward_groups_task),
    [FASTLN_GN_BACKWARD_PARAMETERS] = FASTLN_NAME(gn_backward_parameters_task),
    [FASTLN_GN_BACKWARD_SUMS] = FASTLN_NAME(gn_backward_sums_task),
    [FASTLN_GN_BACKWARD_CONSTANTS] = FASTLN_NAME(gn_backward_constants_task),
    [FASTLN_GN_BACKWARD_APPLY] = FASTLN_NAME(gn_backward_apply_task),
#if FASTLN_COMPUTE_F32 && FASTLN_STORAGE != FASTLN_FLOAT32
    [FASTLN_WIDEN] = FASTLN_NAME(widen_task),
    [FASTLN_NARROW] = FASTLN_NAME(narrow_task),
#endif
};
