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
    for (int64_t r = begin; r < end; r++) {
        double row_mean, row_rstd;
        FASTLN_NAME(layer_norm_forward_row)(x + r * n, call->gamma, call->beta, y + r * n, n,
                                            call->eps, &row_mean, &row_rstd, call->streaming);
        if (mean) mean[r] = (FASTLN_P)row_mean;
        if (rstd) rstd[r] = (FASTLN_P)row_rstd;
    }
}

static void FASTLN_NAME(rms_norm_forward_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_rows_call *call = opaque;
    const int64_t n = call->n_cols;
    const FASTLN_T *x = call->x;
    FASTLN_T *y = call->y;
    FASTLN_P *rstd = call->rstd;
    for (int64_t r = begin; r < end; r++) {
        double row_rstd;
        FASTLN_NAME(rms_norm_forward_row)(x + r * n, call->gamma, y + r * n, n, call->eps,
                                          &row_rstd, call->streaming);
        if (rstd) rstd[r] = (FASTLN_P)row_rstd;
    }
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
        FASTLN_NAME(add_row)(x + r * n, residual + r * n, call->bias, s + r * n, n);
        FASTLN_NAME(layer_norm_forward_row)(s + r * n, call->gamma, call->beta, y + r * n, n,
                                            call->eps, &row_mean, &row_rstd, 0);
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
        FASTLN_NAME(add_row)(x + r * n, residual + r * n, call->bias, s + r * n, n);
        FASTLN_NAME(rms_norm_forward_row)(s + r * n, call->gamma, y + r * n, n, call->eps,
                                          &row_rstd, 0);
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
    for (int64_t block = begin; block < end; block++) {
        const int64_t row_start = block * call->rows_per_block;
        const int64_t row_end = fastln_min(row_start + call->rows_per_block, call->n_rows);
        double *dgamma_partial = call->partials + 2 * block * n;
        double *dbeta_partial = dgamma_partial + n;
#if FASTLN_COMPUTE_F32
        /* float accumulators, folded into the double partials every FASTLN_ROWS_PER_FLUSH rows */
        float *dgamma_acc = call->accumulators + 2 * block * n;
        float *dbeta_acc = dgamma_acc + n;
#else
        double *dgamma_acc = dgamma_partial, *dbeta_acc = dbeta_partial;
#endif
        for (int64_t row = row_start; row < row_end;) {
            const int64_t count = fastln_min(FASTLN_BACKWARD_GROUP, row_end - row);
            FASTLN_NAME(layer_norm_backward_rows)(dy + row * n, x + row * n, call->gamma,
                                                  mean + row, rstd + row, call->eps,
                                                  dx + row * n, count, n, dgamma_acc, dbeta_acc,
                                                  call->streaming);
            row += count;
#if FASTLN_COMPUTE_F32
            if ((row - row_start) % FASTLN_ROWS_PER_FLUSH == 0 || row == row_end) {
                fastln_flush_accumulators(dgamma_acc, dgamma_partial, n);
                fastln_flush_accumulators(dbeta_acc, dbeta_partial, n);
            }
#endif
        }
    }
}

static void FASTLN_NAME(rms_norm_backward_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_rows_call *call = opaque;
    const int64_t n = call->n_cols;
    const FASTLN_T *dy = call->dy, *x = call->x;
    FASTLN_T *dx = call->dx;
    const FASTLN_P *rstd = call->rstd;
    for (int64_t block = begin; block < end; block++) {
        const int64_t row_start = block * call->rows_per_block;
        const int64_t row_end = fastln_min(row_start + call->rows_per_block, call->n_rows);
        double *dgamma_partial = call->partials + block * n;
        for (int64_t row = row_start; row < row_end;) {
            const int64_t count = fastln_min(FASTLN_BACKWARD_GROUP, row_end - row);
            FASTLN_NAME(rms_norm_backward_rows)(dy + row * n, x + row * n, call->gamma,
                                                rstd + row, call->eps, dx + row * n, count, n,
                                                dgamma_partial, call->streaming);
            row += count;
        }
    }
}

/* Tasks are columns: each column's partial sums added in block order into dgamma (and dbeta:
 * the second of each block's rows, when call->dbeta is set). */
static void FASTLN_NAME(column_sums_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_rows_call *call = opaque;
    const int64_t n = call->n_cols;
    const int64_t n_sums = call->dbeta ? 2 : 1;
    for (int64_t sum = 0; sum < n_sums; sum++) {
        FASTLN_P *out = sum == 0 ? call->dgamma : call->dbeta;
        for (int64_t j = begin; j < end; j++) {
            double total = call->partials[sum * n + j];
            for (int64_t block = 1; block < call->n_blocks; block++)
                total += call->partials[(block * n_sums + sum) * n + j];
            out[j] = (FASTLN_P)total;
        }
    }
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
}

static void FASTLN_NAME(bn_apply_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_bn_call *call = opaque;
    const FASTLN_T *x = call->x;
    FASTLN_T *y = call->y;
    for (int64_t unit = begin; unit < end; unit++) {
        if (call->n_inner == 1) {
            const int64_t start = unit * call->rows_per_unit;
            const int64_t offset = start * call->n_features;
            FASTLN_NAME(bn_apply_rows)(x + offset, y + offset,
                                       fastln_min(call->rows_per_unit, call->n_outer - start),
                                       call->n_features, call->shift, call->center, call->scale,
                                       call->offset);
        } else {
            const int64_t c = unit % call->n_features;
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
            FASTLN_NAME(bn_backward_sums_rows)(dy + offset, x + offset, at.n_rows, at.width,
                                               call->n_features, call->mean + at.first,
                                               sum_dy + at.index, sum_dy_d + at.index,
                                               sum_d + at.index);
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
    fastln_bn_backward_constants(call);
    *call->n_finish = 0;
    if (call->training) FASTLN_NAME(bn_rescale_backward)(call->dy, call->x, call);
    FASTLN_P *dgamma = call->dgamma_out, *dbeta = call->dbeta_out;
    for (int64_t c = 0; c < call->n_features; c++) {
        dgamma[c] = (FASTLN_P)call->dgamma[c];
        dbeta[c] = (FASTLN_P)call->sum_dy[c];
    }
}

static void FASTLN_NAME(bn_backward_apply_task)(const void *opaque, int64_t begin, int64_t end)
{
    const fastln_bn_call *call = opaque;
    const FASTLN_T *dy = call->dy, *x = call->x;
    FASTLN_T *dx = call->dx;
    for (int64_t unit = begin; unit < end; unit++) {
        if (call->n_inner == 1) {
            const int64_t start = unit * call->rows_per_unit;
            const int64_t offset = start * call->n_features;
            FASTLN_NAME(bn_backward_apply_rows)(
                dy + offset, x + offset, dx + offset,
                fastln_min(call->rows_per_unit, call->n_outer - start), call->n_features,
                call->training, call->dx_mean, call->correction, call->k, call->mean_dy,
                call->coef);
        } else {
            const int64_t c = unit % call->n_features, offset = unit * call->n_inner;
            FASTLN_NAME(bn_backward_apply_segment)(dy + offset, x + offset, dx + offset,
                                                   call->n_inner, call->training,
                                                   call->dx_mean[c], call->correction[c],
                                                   call->k[c], call->mean_dy[c], call->coef[c]);
        }
    }
}

static void FASTLN_NAME(bn_backward_finish_rescaled_task)(const void *opaque, int64_t begin,
                                                          int64_t end)
{
    const fastln_bn_call *call = opaque;
    (void)begin;
    (void)end;
    FASTLN_NAME(bn_finish_rescaled_backward)(call->dx, call->x, call);
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
    [FASTLN_BN_APPLY] = FASTLN_NAME(bn_apply_task),
    [FASTLN_BN_FINISH_RESCALED] = FASTLN_NAME(bn_finish_rescaled_task),
    [FASTLN_BN_BACKWARD_SUMS] = FASTLN_NAME(bn_backward_sums_task),
    [FASTLN_BN_BACKWARD_CONSTANTS] = FASTLN_NAME(bn_backward_constants_task),
    [FASTLN_BN_BACKWARD_APPLY] = FASTLN_NAME(bn_backward_apply_task),
    [FASTLN_BN_BACKWARD_FINISH_RESCALED] = FASTLN_NAME(bn_backward_finish_rescaled_task),
#if FASTLN_COMPUTE_F32 && FASTLN_STORAGE != FASTLN_FLOAT32
    [FASTLN_WIDEN] = FASTLN_NAME(widen_task),
    [FASTLN_NARROW] = FASTLN_NAME(narrow_task),
#endif
};
