# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Plumbing between the normalization family's Python API and its C kernels.

RMSNorm (include/fastln/rms_norm.h), the fused residual add + LayerNorm/RMSNorm
(include/fastln/add_norm.h) and BatchNorm (include/fastln/batch_norm.h), in the style of
fastln._kernels: callers (fastln._rms_norm, _add_norm, _batch_norm) have checked every argument,
so arrays arrive C-contiguous, aligned, in native byte order and with matching float32/float64
dtypes (BatchNorm's per-feature arrays as float64). This module takes their data pointers,
releases the GIL and runs OpenMP pranges. Every reduction's order is fixed by the shape alone.
"""
from cython.parallel cimport prange
from libc.stdlib cimport calloc, free
from libc.stdint cimport int64_t

cimport numpy as cnp

from fastln._fastpath cimport (
    _FastRows,
    _clobbers,
    _data,
    _fast_rows,
    _is_fast_eps,
    _is_fast_out,
    _is_kernel_array,
    _is_last_axis,
    _is_cache_dtype,
    _is_param,
    _is_row_stats,
    _new_column_sums,
    _new_like,
    _new_row_stats,
    _overlaps,
    _same_shape,
)
from fastln._openmp cimport fastln_watch_for_fork
from fastln._parallel cimport (
    MAX_BLOCKS,
    MIN_ELEMENTS_FOR_THREADS,
    _row_blocks,
    _worth_threads,
)

cnp.import_array()
# The forked-child flag of fastln/openmp_compat.h is static, one per extension module: the fast
# paths here read this module's thread cap, so this module must watch for fork too.
fastln_watch_for_fork()

ctypedef fused floating:
    float
    double

cdef extern from "fastln/rms_norm.h" nogil:
    void fastln_rms_norm_forward_row_f32(
        const float *x, const float *gamma, float *y, int64_t n_cols, double eps,
        double *rstd_out)
    void fastln_rms_norm_forward_row_f64(
        const double *x, const double *gamma, double *y, int64_t n_cols, double eps,
        double *rstd_out)
    void fastln_rms_norm_backward_rows_f32(
        const float *dy, const float *x, const float *gamma, const float *rstd, double eps,
        float *dx, int64_t n_rows, int64_t n_cols, double *dgamma_acc)
    void fastln_rms_norm_backward_rows_f64(
        const double *dy, const double *x, const double *gamma, const double *rstd, double eps,
        double *dx, int64_t n_rows, int64_t n_cols, double *dgamma_acc)
    int FASTLN_RMS_BACKWARD_GROUP

cdef extern from "fastln/add_norm.h" nogil:
    void fastln_add_layer_norm_forward_row_f32(
        const float *x, const float *residual, const float *bias, const float *gamma,
        const float *beta, float *s, float *y, int64_t n_cols, double eps, double *mean_out,
        double *rstd_out)
    void fastln_add_layer_norm_forward_row_f64(
        const double *x, const double *residual, const double *bias, const double *gamma,
        const double *beta, double *s, double *y, int64_t n_cols, double eps, double *mean_out,
        double *rstd_out)
    void fastln_add_rms_norm_forward_row_f32(
        const float *x, const float *residual, const float *bias, const float *gamma, float *s,
        float *y, int64_t n_cols, double eps, double *rstd_out)
    void fastln_add_rms_norm_forward_row_f64(
        const double *x, const double *residual, const double *bias, const double *gamma,
        double *s, double *y, int64_t n_cols, double eps, double *rstd_out)
    # Shared with LayerNorm's backward: per-block dgamma partials summed in block order.
    # (the partials are overwritten: the sums are formed in the first block's row)
    void fastln_sum_block_partials_f32(
        double *partials, int64_t n_blocks, int64_t n_cols, float *out)
    void fastln_sum_block_partials_f64(
        double *partials, int64_t n_blocks, int64_t n_cols, double *out)

cdef extern from "fastln/batch_norm.h" nogil:
    void fastln_bn_combine_partials(
        const double *partials, int64_t n_blocks, int64_t n_features, double *out)
    void fastln_bn_train_constants(
        int64_t n_features, double count, const double *shift, const double *sum,
        const double *sumsq, const double *gamma, const double *beta, double eps,
        double *mean_out, double *var_out, double *rstd_out, double *center_out,
        double *scale_out, double *offset_out)
    void fastln_bn_eval_constants(
        int64_t n_features, const double *running_mean, const double *running_var,
        const double *gamma, const double *beta, double eps, double *mean_out,
        double *rstd_out, double *shift_out, double *center_out, double *scale_out,
        double *offset_out)
    void fastln_bn_backward_constants(
        int64_t n_features, double count, int training, const double *rstd,
        const double *gamma, const double *sum_dy, const double *sum_dy_d, const double *sum_d,
        double *dgamma_out, double *dbeta_out, double *correction_out, double *k_out,
        double *mean_dy_out, double *coef_out)

    void fastln_bn_first_values_f32(const float *x, int64_t n_features, int64_t n_inner,
                                    double *shift)
    void fastln_bn_first_values_f64(const double *x, int64_t n_features, int64_t n_inner,
                                    double *shift)
    void fastln_bn_stats_rows_f32(
        const float *x, int64_t n_rows, int64_t n_features, int64_t row_stride,
        const double *shift, double *sum, double *sumsq)
    void fastln_bn_stats_rows_f64(
        const double *x, int64_t n_rows, int64_t n_features, int64_t row_stride,
        const double *shift, double *sum, double *sumsq)
    void fastln_bn_stats_segments_f32(
        const float *x, int64_t n_segments, int64_t stride, int64_t n_inner, double shift,
        double *sum_out, double *sumsq_out)
    void fastln_bn_stats_segments_f64(
        const double *x, int64_t n_segments, int64_t stride, int64_t n_inner, double shift,
        double *sum_out, double *sumsq_out)
    void fastln_bn_apply_rows_f32(
        const float *x, float *y, int64_t n_rows, int64_t n_features, const double *shift,
        const double *center, const double *scale, const double *offset)
    void fastln_bn_apply_rows_f64(
        const double *x, double *y, int64_t n_rows, int64_t n_features, const double *shift,
        const double *center, const double *scale, const double *offset)
    void fastln_bn_apply_segment_f32(
        const float *x, float *y, int64_t n_inner, double shift, double center, double scale,
        double offset)
    void fastln_bn_apply_segment_f64(
        const double *x, double *y, int64_t n_inner, double shift, double center,
        double scale, double offset)
    void fastln_bn_backward_sums_rows_f32(
        const float *dy, const float *x, int64_t n_rows, int64_t n_features,
        int64_t row_stride, const double *mean, double *sum_dy, double *sum_dy_d,
        double *sum_d)
    void fastln_bn_backward_sums_rows_f64(
        const double *dy, const double *x, int64_t n_rows, int64_t n_features,
        int64_t row_stride, const double *mean, double *sum_dy, double *sum_dy_d,
        double *sum_d)
    void fastln_bn_backward_sums_segments_f32(
        const float *dy, const float *x, int64_t n_segments, int64_t stride, int64_t n_inner,
        double mean, double *sum_dy_out, double *sum_dy_d_out, double *sum_d_out)
    void fastln_bn_backward_sums_segments_f64(
        const double *dy, const double *x, int64_t n_segments, int64_t stride,
        int64_t n_inner, double mean, double *sum_dy_out, double *sum_dy_d_out,
        double *sum_d_out)
    void fastln_bn_backward_apply_rows_f32(
        const float *dy, const float *x, float *dx, int64_t n_rows, int64_t n_features,
        const double *mean, const double *correction, const double *k, const double *mean_dy,
        const double *coef)
    void fastln_bn_backward_apply_rows_f64(
        const double *dy, const double *x, double *dx, int64_t n_rows, int64_t n_features,
        const double *mean, const double *correction, const double *k, const double *mean_dy,
        const double *coef)
    void fastln_bn_backward_apply_segment_f32(
        const float *dy, const float *x, float *dx, int64_t n_inner, double mean,
        double correction, double k, double mean_dy, double coef)
    void fastln_bn_backward_apply_segment_f64(
        const double *dy, const double *x, double *dx, int64_t n_inner, double mean,
        double correction, double k, double mean_dy, double coef)
    void fastln_bn_scale_rows_f32(const float *dy, float *dx, int64_t n_rows,
                                  int64_t n_features, const double *k)
    void fastln_bn_scale_rows_f64(const double *dy, double *dx, int64_t n_rows,
                                  int64_t n_features, const double *k)
    void fastln_bn_scale_segment_f32(const float *dy, float *dx, int64_t n_inner, double k)
    void fastln_bn_scale_segment_f64(const double *dy, double *dx, int64_t n_inner, double k)

    # the rare path: features whose statistics leave double's range
    int64_t fastln_bn_rescale_train_f32(
        const float *x, int64_t n_outer, int64_t n_features, int64_t n_inner,
        const double *gamma, double eps, double *mean, double *var, double *rstd,
        double *shift, double *center, double *scale, double *offset, int64_t *finish_out)
    int64_t fastln_bn_rescale_train_f64(
        const double *x, int64_t n_outer, int64_t n_features, int64_t n_inner,
        const double *gamma, double eps, double *mean, double *var, double *rstd,
        double *shift, double *center, double *scale, double *offset, int64_t *finish_out)
    void fastln_bn_finish_rescaled_f32(
        float *y, int64_t n_outer, int64_t n_features, int64_t n_inner, int64_t feature,
        double mean, const double *gamma, const double *beta, double eps)
    void fastln_bn_finish_rescaled_f64(
        double *y, int64_t n_outer, int64_t n_features, int64_t n_inner, int64_t feature,
        double mean, const double *gamma, const double *beta, double eps)
    int64_t fastln_bn_rescale_backward_f32(
        const float *dy, const float *x, int64_t n_outer, int64_t n_features, int64_t n_inner,
        const double *gamma, double eps, const double *mean, const double *rstd,
        const double *sum_dy, const double *sum_dy_d, const double *sum_d,
        double *dgamma_out, double *correction_out, double *k_out, double *mean_dy_out,
        double *coef_out, int64_t *finish_out)
    int64_t fastln_bn_rescale_backward_f64(
        const double *dy, const double *x, int64_t n_outer, int64_t n_features,
        int64_t n_inner, const double *gamma, double eps, const double *mean,
        const double *rstd, const double *sum_dy, const double *sum_dy_d, const double *sum_d,
        double *dgamma_out, double *correction_out, double *k_out, double *mean_dy_out,
        double *coef_out, int64_t *finish_out)
    void fastln_bn_finish_rescaled_backward_f32(
        float *dx, const float *x, int64_t n_outer, int64_t n_features, int64_t n_inner,
        int64_t feature, double mean, double rstd, const double *gamma, double eps,
        double dgamma, double sum_dy)
    void fastln_bn_finish_rescaled_backward_f64(
        double *dx, const double *x, int64_t n_outer, int64_t n_features, int64_t n_inner,
        int64_t feature, double mean, double rstd, const double *gamma, double eps,
        double dgamma, double sum_dy)

# BatchNorm: the segments layout (n_inner > 1) blocks the outer axis so that a block holds at
# least SEGMENT_BLOCK_ELEMENTS values of a feature; the rows layout (n_inner == 1) hands the
# features to threads in chunks of FEATURE_CHUNK (features never mix, so the chunking does not
# change any result) and writes y in chunks of about APPLY_CHUNK_ELEMENTS.
cdef enum:
    SEGMENT_BLOCK_ELEMENTS = 16384
    FEATURE_CHUNK = 512
    APPLY_CHUNK_ELEMENTS = 8192


cdef inline bint _is_float32(cnp.ndarray array):
    return cnp.PyArray_TYPE(array) == cnp.NPY_FLOAT32


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------

cdef inline void _rms_forward_row(const floating *x, const floating *gamma, floating *y,
                                  floating *rstd, Py_ssize_t row, Py_ssize_t n_cols,
                                  double eps) noexcept nogil:
    cdef double row_rstd
    if floating is float:
        fastln_rms_norm_forward_row_f32(x + row * n_cols, gamma, y + row * n_cols, n_cols, eps,
                                        &row_rstd)
    else:
        fastln_rms_norm_forward_row_f64(x + row * n_cols, gamma, y + row * n_cols, n_cols, eps,
                                        &row_rstd)
    if rstd != NULL:
        rstd[row] = <floating>row_rstd


cdef void _rms_forward_rows(const floating *x, const floating *gamma, floating *y,
                            floating *rstd, Py_ssize_t n_rows, Py_ssize_t n_cols, double eps,
                            int num_threads) noexcept nogil:
    cdef Py_ssize_t row
    # Small calls stay out of OpenMP entirely: even a parallel region that use_threads_if keeps
    # on one thread costs ~0.5 us, as much as a 768-wide row.
    if _worth_threads(num_threads, n_rows, n_rows * n_cols):
        for row in prange(n_rows, schedule='static', num_threads=num_threads):
            _rms_forward_row(x, gamma, y, rstd, row, n_cols, eps)
    else:
        for row in range(n_rows):
            _rms_forward_row(x, gamma, y, rstd, row, n_cols, eps)


def rms_norm_forward(cnp.ndarray x, object gamma, cnp.ndarray y, object rstd, double eps,
                     int num_threads):
    """RMSNorm over the rows of the 2-D array x into y; rstd (1-D, or None) gets the stats."""
    _run_rms_forward(x, gamma, y, rstd, cnp.PyArray_DIM(x, 0), cnp.PyArray_DIM(x, 1), eps,
                     num_threads)


cdef void _run_rms_forward(cnp.ndarray x, object gamma, cnp.ndarray y, object rstd,
                           Py_ssize_t n_rows, Py_ssize_t n_cols, double eps, int num_threads):
    cdef void *x_data = cnp.PyArray_DATA(x)
    cdef void *y_data = cnp.PyArray_DATA(y)
    cdef void *gamma_data = _data(gamma)
    cdef void *rstd_data = _data(rstd)
    if _is_float32(x):
        with nogil:
            _rms_forward_rows(<const float*>x_data, <const float*>gamma_data, <float*>y_data,
                              <float*>rstd_data, n_rows, n_cols, eps, num_threads)
    else:
        with nogil:
            _rms_forward_rows(<const double*>x_data, <const double*>gamma_data,
                              <double*>y_data, <double*>rstd_data, n_rows, n_cols, eps,
                              num_threads)


cdef inline void _rms_backward_block(const floating *dy, const floating *x,
                                     const floating *gamma, const floating *rstd, floating *dx,
                                     double *block_dgamma, Py_ssize_t row_start,
                                     Py_ssize_t row_end, Py_ssize_t n_cols,
                                     double eps) noexcept nogil:
    """Rows [row_start, row_end): dx, and their dgamma added to the block's partial sums, in
    groups of FASTLN_RMS_BACKWARD_GROUP rows."""
    cdef Py_ssize_t row = row_start, count
    while row < row_end:
        count = min(<Py_ssize_t>FASTLN_RMS_BACKWARD_GROUP, row_end - row)
        if floating is float:
            fastln_rms_norm_backward_rows_f32(dy + row * n_cols, x + row * n_cols, gamma,
                                              rstd + row, eps, dx + row * n_cols, count, n_cols,
                                              block_dgamma)
        else:
            fastln_rms_norm_backward_rows_f64(dy + row * n_cols, x + row * n_cols, gamma,
                                              rstd + row, eps, dx + row * n_cols, count, n_cols,
                                              block_dgamma)
        row += count


cdef int _rms_backward_rows(const floating *dy, const floating *x, const floating *gamma,
                            const floating *rstd, floating *dx, floating *dgamma,
                            Py_ssize_t n_rows, Py_ssize_t n_cols, double eps,
                            int num_threads) noexcept nogil:
    """Returns -1 when the scratch for the dgamma partial sums cannot be allocated."""
    cdef Py_ssize_t n_blocks = _row_blocks(n_rows)
    cdef Py_ssize_t rows_per_block = (n_rows + n_blocks - 1) // n_blocks
    cdef Py_ssize_t block
    cdef double *partials = <double*>calloc(n_blocks * n_cols, sizeof(double))
    if partials == NULL:
        return -1
    if _worth_threads(num_threads, n_blocks, n_rows * n_cols):
        for block in prange(n_blocks, schedule='static', num_threads=num_threads):
            _rms_backward_block(dy, x, gamma, rstd, dx, partials + block * n_cols,
                                block * rows_per_block,
                                min((block + 1) * rows_per_block, n_rows), n_cols, eps)
    else:  # the same blocks in the same order: the sums do not depend on the branch
        for block in range(n_blocks):
            _rms_backward_block(dy, x, gamma, rstd, dx, partials + block * n_cols,
                                block * rows_per_block,
                                min((block + 1) * rows_per_block, n_rows), n_cols, eps)
    if floating is float:
        fastln_sum_block_partials_f32(partials, n_blocks, n_cols, dgamma)
    else:
        fastln_sum_block_partials_f64(partials, n_blocks, n_cols, dgamma)
    free(partials)
    return 0


def rms_norm_backward(cnp.ndarray dy, cnp.ndarray x, object gamma, cnp.ndarray rstd,
                      cnp.ndarray dx, cnp.ndarray dgamma, double eps, int num_threads):
    """RMSNorm backward over the rows of the 2-D arrays dy and x into dx and dgamma; eps is the
    forward's (rows whose cached rstd is Inf are done from x again)."""
    _run_rms_backward(dy, x, gamma, rstd, dx, dgamma, cnp.PyArray_DIM(x, 0),
                      cnp.PyArray_DIM(x, 1), eps, num_threads)


cdef int _run_rms_backward(cnp.ndarray dy, cnp.ndarray x, object gamma, cnp.ndarray rstd,
                           cnp.ndarray dx, cnp.ndarray dgamma, Py_ssize_t n_rows,
                           Py_ssize_t n_cols, double eps, int num_threads) except -1:
    cdef void *dy_data = cnp.PyArray_DATA(dy)
    cdef void *x_data = cnp.PyArray_DATA(x)
    cdef void *gamma_data = _data(gamma)
    cdef void *rstd_data = cnp.PyArray_DATA(rstd)
    cdef void *dx_data = cnp.PyArray_DATA(dx)
    cdef void *dgamma_data = cnp.PyArray_DATA(dgamma)
    cdef int status
    if _is_float32(x):
        with nogil:
            status = _rms_backward_rows(
                <const float*>dy_data, <const float*>x_data, <const float*>gamma_data,
                <const float*>rstd_data, <float*>dx_data, <float*>dgamma_data,
                n_rows, n_cols, eps, num_threads)
    else:
        with nogil:
            status = _rms_backward_rows(
                <const double*>dy_data, <const double*>x_data, <const double*>gamma_data,
                <const double*>rstd_data, <double*>dx_data, <double*>dgamma_data,
                n_rows, n_cols, eps, num_threads)
    if status != 0:
        raise MemoryError("rms_norm_backward: cannot allocate the dgamma partial sums")
    return 0


# ---------------------------------------------------------------------------------------------
# Fused residual add + LayerNorm / RMSNorm
# ---------------------------------------------------------------------------------------------

cdef inline void _add_norm_row(const floating *x, const floating *residual,
                               const floating *bias, const floating *gamma,
                               const floating *beta, floating *s, floating *y, floating *mean,
                               floating *rstd, bint rms, Py_ssize_t row, Py_ssize_t n_cols,
                               double eps) noexcept nogil:
    cdef Py_ssize_t offset = row * n_cols
    cdef double row_mean = 0.0, row_rstd
    if rms:
        if floating is float:
            fastln_add_rms_norm_forward_row_f32(x + offset, residual + offset, bias, gamma,
                                                s + offset, y + offset, n_cols, eps, &row_rstd)
        else:
            fastln_add_rms_norm_forward_row_f64(x + offset, residual + offset, bias, gamma,
                                                s + offset, y + offset, n_cols, eps, &row_rstd)
    else:
        if floating is float:
            fastln_add_layer_norm_forward_row_f32(x + offset, residual + offset, bias, gamma,
                                                  beta, s + offset, y + offset, n_cols, eps,
                                                  &row_mean, &row_rstd)
        else:
            fastln_add_layer_norm_forward_row_f64(x + offset, residual + offset, bias, gamma,
                                                  beta, s + offset, y + offset, n_cols, eps,
                                                  &row_mean, &row_rstd)
    if mean != NULL:
        mean[row] = <floating>row_mean
    if rstd != NULL:
        rstd[row] = <floating>row_rstd


cdef void _add_norm_rows(const floating *x, const floating *residual, const floating *bias,
                         const floating *gamma, const floating *beta, floating *s, floating *y,
                         floating *mean, floating *rstd, bint rms, Py_ssize_t n_rows,
                         Py_ssize_t n_cols, double eps, int num_threads) noexcept nogil:
    cdef Py_ssize_t row
    if _worth_threads(num_threads, n_rows, n_rows * n_cols):  # as in _rms_forward_rows
        for row in prange(n_rows, schedule='static', num_threads=num_threads):
            _add_norm_row(x, residual, bias, gamma, beta, s, y, mean, rstd, rms, row, n_cols,
                          eps)
    else:
        for row in range(n_rows):
            _add_norm_row(x, residual, bias, gamma, beta, s, y, mean, rstd, rms, row, n_cols,
                          eps)


def add_norm_forward(cnp.ndarray x, cnp.ndarray residual, object bias, object gamma,
                     object beta, cnp.ndarray s, cnp.ndarray y, object mean, object rstd,
                     bint rms, double eps, int num_threads):
    """s = x + residual (+ bias) and y = LayerNorm(s) (rms=False) or RMSNorm(s) (rms=True) over
    the rows of the 2-D arrays; mean/rstd (1-D, or None) get the statistics (mean: LayerNorm)."""
    _run_add_norm(x, residual, bias, gamma, beta, s, y, mean, rstd, rms, cnp.PyArray_DIM(x, 0),
                  cnp.PyArray_DIM(x, 1), eps, num_threads)


cdef void _run_add_norm(cnp.ndarray x, cnp.ndarray residual, object bias, object gamma,
                        object beta, cnp.ndarray s, cnp.ndarray y, object mean, object rstd,
                        bint rms, Py_ssize_t n_rows, Py_ssize_t n_cols, double eps,
                        int num_threads):
    cdef void *x_data = cnp.PyArray_DATA(x)
    cdef void *residual_data = cnp.PyArray_DATA(residual)
    cdef void *bias_data = _data(bias)
    cdef void *gamma_data = _data(gamma)
    cdef void *beta_data = _data(beta)
    cdef void *s_data = cnp.PyArray_DATA(s)
    cdef void *y_data = cnp.PyArray_DATA(y)
    cdef void *mean_data = _data(mean)
    cdef void *rstd_data = _data(rstd)
    if _is_float32(x):
        with nogil:
            _add_norm_rows(<const float*>x_data, <const float*>residual_data,
                           <const float*>bias_data, <const float*>gamma_data,
                           <const float*>beta_data, <float*>s_data, <float*>y_data,
                           <float*>mean_data, <float*>rstd_data, rms, n_rows, n_cols, eps,
                           num_threads)
    else:
        with nogil:
            _add_norm_rows(<const double*>x_data, <const double*>residual_data,
                           <const double*>bias_data, <const double*>gamma_data,
                           <const double*>beta_data, <double*>s_data, <double*>y_data,
                           <double*>mean_data, <double*>rstd_data, rms, n_rows, n_cols, eps,
                           num_threads)


# ---------------------------------------------------------------------------------------------
# Fast paths, as in fastln._kernels (layer_norm_forward_fast): the common call - C-contiguous
# native float32/float64 arrays, axis=-1, nothing unusual - is recognised with the C-level
# checks of fastln/_fastpath.pxd and goes straight to the row loops above, because for one
# 768-wide row the general Python checks cost ten times the arithmetic. Anything else
# (including every invalid argument) returns None, and the caller takes the general path,
# which does the full checking and raises the errors.
# ---------------------------------------------------------------------------------------------


def rms_norm_forward_fast(object x, object gamma, object eps, object axis, object out,
                          object num_threads, bint keep_cache):
    """y, or (y, rstd) with keep_cache; None when the call needs the general path."""
    cdef _FastRows rows
    if not _fast_rows(x, num_threads, &rows):
        return None
    cdef cnp.ndarray x_array = <cnp.ndarray>x
    if (not _is_last_axis(axis, rows.ndim) or not _is_fast_eps(eps)
            or not _is_param(gamma, rows.typenum, rows.n_cols) or not _is_fast_out(out, x_array)):
        return None
    # out may be x itself (in place), except when the cache keeps x for the backward.
    if _overlaps(out, gamma) or _clobbers(out, x) or (keep_cache and _overlaps(out, x)):
        return None
    y = out if out is not None else _new_like(x_array, rows.typenum)
    rstd = _new_row_stats(x_array, rows.typenum) if keep_cache else None
    _run_rms_forward(x_array, gamma, <cnp.ndarray>y, rstd, rows.n_rows, rows.n_cols, <double>eps,
                     rows.threads)
    if keep_cache:
        return y, rstd
    return y


def rms_norm_backward_fast(object dy, object x, object rstd, object axis, object dtype,
                           object eps, object gamma, object out, object num_threads):
    """(dx, dgamma) for a cache normalized over x's last axis; None for the general path.

    x, rstd, axis, eps and dtype (its _dtype field) come from an RMSNormCache.
    """
    cdef _FastRows rows
    if not _fast_rows(x, num_threads, &rows):
        return None
    cdef cnp.ndarray x_array = <cnp.ndarray>x
    # A cache's axis is non-negative: -1 there is a forged cache, for the general path to refuse.
    if (type(axis) is not int or axis != rows.ndim - 1
            or not _is_kernel_array(dy, rows.typenum) or not _same_shape(<cnp.ndarray>dy, x_array)
            or not _is_cache_dtype(dtype, x_array) or not _is_fast_eps(eps)
            or not _is_param(gamma, rows.typenum, rows.n_cols) or not _is_fast_out(out, x_array)
            or not _is_row_stats(rstd, rows.typenum, x_array)):
        return None
    # dx may be dy or x itself (in place).
    if (_overlaps(out, gamma) or _overlaps(out, rstd) or _clobbers(out, dy)
            or _clobbers(out, x)):
        return None
    dx = out if out is not None else _new_like(x_array, rows.typenum)
    dgamma = _new_column_sums(x_array, rows.typenum)
    _run_rms_backward(<cnp.ndarray>dy, x_array, gamma, <cnp.ndarray>rstd, <cnp.ndarray>dx,
                      <cnp.ndarray>dgamma, rows.n_rows, rows.n_cols, <double>eps, rows.threads)
    return dx, dgamma


cdef inline bint _is_safe_add_output(object output, object x, object residual, object bias,
                                     object gamma, object beta):
    """An add-norm output (out or sum_out, or None) may sit exactly on x or residual (a row is
    read completely before its s and y are written) but must not otherwise overlap an input."""
    return not (_clobbers(output, x) or _clobbers(output, residual) or _overlaps(output, bias)
                or _overlaps(output, gamma) or _overlaps(output, beta))


def add_norm_forward_fast(bint rms, object x, object residual, object gamma, object beta,
                          object eps, object bias, object axis, object out, object sum_out,
                          object num_threads, bint keep_cache):
    """(y, s), or (y, s, mean, rstd) with keep_cache (mean None for RMSNorm); None when the
    call needs the general path. beta must be None for RMSNorm."""
    cdef _FastRows rows
    if not _fast_rows(x, num_threads, &rows):
        return None
    cdef cnp.ndarray x_array = <cnp.ndarray>x
    if (not _is_last_axis(axis, rows.ndim) or not _is_fast_eps(eps)
            or not _is_kernel_array(residual, rows.typenum)
            or not _same_shape(<cnp.ndarray>residual, x_array)
            or not _is_param(gamma, rows.typenum, rows.n_cols)
            or not _is_param(beta, rows.typenum, rows.n_cols)
            or not _is_param(bias, rows.typenum, rows.n_cols) or not _is_fast_out(out, x_array)
            or not _is_fast_out(sum_out, x_array)):
        return None
    # out and sum_out may each be x or residual (sum_out=residual updates the residual stream
    # in place), but not each other: the general path refuses that.
    if (_overlaps(out, sum_out)
            or not _is_safe_add_output(out, x, residual, bias, gamma, beta)
            or not _is_safe_add_output(sum_out, x, residual, bias, gamma, beta)):
        return None
    y = out if out is not None else _new_like(x_array, rows.typenum)
    s = sum_out if sum_out is not None else _new_like(x_array, rows.typenum)
    mean = rstd = None
    if keep_cache:
        rstd = _new_row_stats(x_array, rows.typenum)
        if not rms:
            mean = _new_row_stats(x_array, rows.typenum)
    _run_add_norm(x_array, <cnp.ndarray>residual, bias, gamma, beta, <cnp.ndarray>s,
                  <cnp.ndarray>y, mean, rstd, rms, rows.n_rows, rows.n_cols, <double>eps,
                  rows.threads)
    if keep_cache:
        return y, s, mean, rstd
    return y, s


# ---------------------------------------------------------------------------------------------
# BatchNorm: x is a C-contiguous (n_outer, n_features, n_inner) array
# ---------------------------------------------------------------------------------------------

cdef struct BlockLayout:
    # How the outer axis is cut into blocks (a function of the shape alone), and how many
    # parallel tasks that makes. Rows layout (n_inner == 1): task = (block, feature chunk).
    # Segments layout: task = (block, feature).
    Py_ssize_t n_blocks
    Py_ssize_t rows_per_block
    Py_ssize_t n_chunks
    Py_ssize_t n_tasks


cdef BlockLayout _bn_layout(Py_ssize_t n_outer, Py_ssize_t n_features,
                            Py_ssize_t n_inner) noexcept nogil:
    cdef BlockLayout layout
    if n_inner == 1:
        layout.n_blocks = _row_blocks(n_outer)
        layout.n_chunks = (n_features + FEATURE_CHUNK - 1) // FEATURE_CHUNK
    else:
        layout.n_blocks = min(max(n_outer * n_inner // SEGMENT_BLOCK_ELEMENTS, 1),
                              min(n_outer, MAX_BLOCKS))
        layout.n_chunks = n_features
    layout.rows_per_block = (n_outer + layout.n_blocks - 1) // layout.n_blocks
    layout.n_tasks = layout.n_blocks * layout.n_chunks
    return layout


cdef void _bn_stats(const floating *x, Py_ssize_t n_outer, Py_ssize_t n_features,
                    Py_ssize_t n_inner, const double *shift, double *partial_sum,
                    double *partial_sumsq, int num_threads) noexcept nogil:
    """Per-block shifted sums: partial_*[block * n_features + c] (zeroed by the caller)."""
    cdef BlockLayout layout = _bn_layout(n_outer, n_features, n_inner)
    cdef Py_ssize_t task, block, chunk, start, stop, first, width, index
    cdef bint use_threads = (num_threads > 1 and layout.n_tasks > 1
                             and n_outer * n_features * n_inner >= MIN_ELEMENTS_FOR_THREADS)
    for task in prange(layout.n_tasks, schedule='static', num_threads=num_threads,
                       use_threads_if=use_threads):
        block = task // layout.n_chunks
        chunk = task - block * layout.n_chunks
        start = block * layout.rows_per_block
        stop = min(start + layout.rows_per_block, n_outer)
        if start >= stop:  # an empty last block (possible only for tiny shapes)
            pass
        elif n_inner == 1:
            first = chunk * FEATURE_CHUNK
            width = min(FEATURE_CHUNK, n_features - first)
            index = block * n_features + first
            if floating is float:
                fastln_bn_stats_rows_f32(x + start * n_features + first, stop - start, width,
                                         n_features, shift + first, partial_sum + index,
                                         partial_sumsq + index)
            else:
                fastln_bn_stats_rows_f64(x + start * n_features + first, stop - start, width,
                                         n_features, shift + first, partial_sum + index,
                                         partial_sumsq + index)
        else:
            index = block * n_features + chunk
            if floating is float:
                fastln_bn_stats_segments_f32(x + (start * n_features + chunk) * n_inner,
                                             stop - start, n_features * n_inner, n_inner,
                                             shift[chunk], partial_sum + index,
                                             partial_sumsq + index)
            else:
                fastln_bn_stats_segments_f64(x + (start * n_features + chunk) * n_inner,
                                             stop - start, n_features * n_inner, n_inner,
                                             shift[chunk], partial_sum + index,
                                             partial_sumsq + index)


cdef void _bn_apply(const floating *x, floating *y, Py_ssize_t n_outer, Py_ssize_t n_features,
                    Py_ssize_t n_inner, const double *shift, const double *center,
                    const double *scale, const double *offset, int num_threads) noexcept nogil:
    """y = ((x - shift) - center) * scale + offset, feature by feature (elementwise)."""
    cdef Py_ssize_t rows_per_chunk = max(APPLY_CHUNK_ELEMENTS // n_features, 1)
    cdef Py_ssize_t n_units, unit, start, c
    if n_inner == 1:
        n_units = (n_outer + rows_per_chunk - 1) // rows_per_chunk
    else:
        n_units = n_outer * n_features
    cdef bint use_threads = (num_threads > 1 and n_units > 1
                             and n_outer * n_features * n_inner >= MIN_ELEMENTS_FOR_THREADS)
    for unit in prange(n_units, schedule='static', num_threads=num_threads,
                       use_threads_if=use_threads):
        if n_inner == 1:
            start = unit * rows_per_chunk
            if floating is float:
                fastln_bn_apply_rows_f32(x + start * n_features, y + start * n_features,
                                         min(rows_per_chunk, n_outer - start), n_features,
                                         shift, center, scale, offset)
            else:
                fastln_bn_apply_rows_f64(x + start * n_features, y + start * n_features,
                                         min(rows_per_chunk, n_outer - start), n_features,
                                         shift, center, scale, offset)
        else:
            c = unit % n_features
            if floating is float:
                fastln_bn_apply_segment_f32(x + unit * n_inner, y + unit * n_inner, n_inner,
                                            shift[c], center[c], scale[c], offset[c])
            else:
                fastln_bn_apply_segment_f64(x + unit * n_inner, y + unit * n_inner, n_inner,
                                            shift[c], center[c], scale[c], offset[c])


cdef int _bn_forward(const floating *x, floating *y, Py_ssize_t n_outer, Py_ssize_t n_features,
                     Py_ssize_t n_inner, const double *gamma, const double *beta,
                     const double *running_mean, const double *running_var, double *mean,
                     double *var, double *rstd, bint training, double eps,
                     int num_threads) noexcept nogil:
    """Returns -1 when scratch memory cannot be allocated."""
    cdef BlockLayout layout = _bn_layout(n_outer, n_features, n_inner)
    cdef Py_ssize_t n_partials = 2 * layout.n_blocks * n_features
    cdef Py_ssize_t n_finish = 0, i
    # shift, center, scale, offset, sum, sumsq (one double per feature each), and the indices
    # of the features the rare path finishes after the write pass (int64, as wide as a double)
    cdef double *constants = <double*>calloc(7 * n_features, sizeof(double))
    cdef double *partials = NULL
    cdef double *shift = constants
    cdef double *center = constants + n_features
    cdef double *scale = constants + 2 * n_features
    cdef double *offset = constants + 3 * n_features
    cdef double *total_sum = constants + 4 * n_features
    cdef double *total_sumsq = constants + 5 * n_features
    cdef int64_t *finish = <int64_t*>(constants + 6 * n_features)
    if constants == NULL:
        return -1
    if training:
        partials = <double*>calloc(n_partials, sizeof(double))
        if partials == NULL:
            free(constants)
            return -1
        if floating is float:
            fastln_bn_first_values_f32(x, n_features, n_inner, shift)
        else:
            fastln_bn_first_values_f64(x, n_features, n_inner, shift)
        _bn_stats(x, n_outer, n_features, n_inner, shift, partials,
                  partials + layout.n_blocks * n_features, num_threads)
        fastln_bn_combine_partials(partials, layout.n_blocks, n_features, total_sum)
        fastln_bn_combine_partials(partials + layout.n_blocks * n_features, layout.n_blocks,
                                   n_features, total_sumsq)
        free(partials)
        fastln_bn_train_constants(n_features, <double>(n_outer * n_inner), shift, total_sum,
                                  total_sumsq, gamma, beta, eps, mean, var, rstd, center, scale,
                                  offset)
        if floating is float:
            n_finish = fastln_bn_rescale_train_f32(x, n_outer, n_features, n_inner, gamma, eps,
                                                   mean, var, rstd, shift, center, scale,
                                                   offset, finish)
        else:
            n_finish = fastln_bn_rescale_train_f64(x, n_outer, n_features, n_inner, gamma, eps,
                                                   mean, var, rstd, shift, center, scale,
                                                   offset, finish)
    else:
        fastln_bn_eval_constants(n_features, running_mean, running_var, gamma, beta, eps, mean,
                                 rstd, shift, center, scale, offset)
    _bn_apply(x, y, n_outer, n_features, n_inner, shift, center, scale, offset, num_threads)
    for i in range(n_finish):
        if floating is float:
            fastln_bn_finish_rescaled_f32(y, n_outer, n_features, n_inner, finish[i],
                                          mean[finish[i]], gamma, beta, eps)
        else:
            fastln_bn_finish_rescaled_f64(y, n_outer, n_features, n_inner, finish[i],
                                          mean[finish[i]], gamma, beta, eps)
    free(constants)
    return 0


def batch_norm_forward(cnp.ndarray x, cnp.ndarray y, Py_ssize_t n_outer, Py_ssize_t n_features,
                       Py_ssize_t n_inner, object gamma, object beta, object running_mean,
                       object running_var, cnp.ndarray mean, cnp.ndarray var, cnp.ndarray rstd,
                       bint training, double eps, int num_threads):
    """BatchNorm of x (n_outer * n_features * n_inner values, C order) into y.

    gamma, beta, running_mean, running_var: float64 (n_features,) or None (running stats are
    required when not training). mean, var, rstd: float64 (n_features,) outputs (var is only
    written when training)."""
    cdef void *x_data = cnp.PyArray_DATA(x)
    cdef void *y_data = cnp.PyArray_DATA(y)
    cdef const double *gamma_data = <const double*>_data(gamma)
    cdef const double *beta_data = <const double*>_data(beta)
    cdef const double *running_mean_data = <const double*>_data(running_mean)
    cdef const double *running_var_data = <const double*>_data(running_var)
    cdef double *mean_data = <double*>cnp.PyArray_DATA(mean)
    cdef double *var_data = <double*>cnp.PyArray_DATA(var)
    cdef double *rstd_data = <double*>cnp.PyArray_DATA(rstd)
    cdef int status
    if _is_float32(x):
        with nogil:
            status = _bn_forward(<const float*>x_data, <float*>y_data, n_outer, n_features,
                                 n_inner, gamma_data, beta_data, running_mean_data,
                                 running_var_data, mean_data, var_data, rstd_data, training,
                                 eps, num_threads)
    else:
        with nogil:
            status = _bn_forward(<const double*>x_data, <double*>y_data, n_outer, n_features,
                                 n_inner, gamma_data, beta_data, running_mean_data,
                                 running_var_data, mean_data, var_data, rstd_data, training,
                                 eps, num_threads)
    if status != 0:
        raise MemoryError("batch_norm: cannot allocate the per-feature scratch")


cdef void _bn_backward_sums(const floating *dy, const floating *x, Py_ssize_t n_outer,
                            Py_ssize_t n_features, Py_ssize_t n_inner, const double *mean,
                            double *partial_dy, double *partial_dy_d, double *partial_d,
                            int num_threads) noexcept nogil:
    """Per-block sums of dy, dy * (x - mean) and x - mean (zeroed by the caller)."""
    cdef BlockLayout layout = _bn_layout(n_outer, n_features, n_inner)
    cdef Py_ssize_t task, block, chunk, start, stop, first, width, index, offset
    cdef bint use_threads = (num_threads > 1 and layout.n_tasks > 1
                             and n_outer * n_features * n_inner >= MIN_ELEMENTS_FOR_THREADS)
    for task in prange(layout.n_tasks, schedule='static', num_threads=num_threads,
                       use_threads_if=use_threads):
        block = task // layout.n_chunks
        chunk = task - block * layout.n_chunks
        start = block * layout.rows_per_block
        stop = min(start + layout.rows_per_block, n_outer)
        if start >= stop:  # an empty last block (possible only for tiny shapes)
            pass
        elif n_inner == 1:
            first = chunk * FEATURE_CHUNK
            width = min(FEATURE_CHUNK, n_features - first)
            index = block * n_features + first
            offset = start * n_features + first
            if floating is float:
                fastln_bn_backward_sums_rows_f32(dy + offset, x + offset, stop - start, width,
                                                 n_features, mean + first, partial_dy + index,
                                                 partial_dy_d + index, partial_d + index)
            else:
                fastln_bn_backward_sums_rows_f64(dy + offset, x + offset, stop - start, width,
                                                 n_features, mean + first, partial_dy + index,
                                                 partial_dy_d + index, partial_d + index)
        else:
            index = block * n_features + chunk
            offset = (start * n_features + chunk) * n_inner
            if floating is float:
                fastln_bn_backward_sums_segments_f32(dy + offset, x + offset, stop - start,
                                                     n_features * n_inner, n_inner, mean[chunk],
                                                     partial_dy + index, partial_dy_d + index,
                                                     partial_d + index)
            else:
                fastln_bn_backward_sums_segments_f64(dy + offset, x + offset, stop - start,
                                                     n_features * n_inner, n_inner, mean[chunk],
                                                     partial_dy + index, partial_dy_d + index,
                                                     partial_d + index)


cdef void _bn_backward_apply(const floating *dy, const floating *x, floating *dx,
                             Py_ssize_t n_outer, Py_ssize_t n_features, Py_ssize_t n_inner,
                             bint training, const double *mean, const double *correction,
                             const double *k, const double *mean_dy, const double *coef,
                             int num_threads) noexcept nogil:
    """dx, feature by feature (elementwise): the training identity, or dy * k in eval mode."""
    cdef Py_ssize_t rows_per_chunk = max(APPLY_CHUNK_ELEMENTS // n_features, 1)
    cdef Py_ssize_t n_units, unit, start, rows, c, offset
    if n_inner == 1:
        n_units = (n_outer + rows_per_chunk - 1) // rows_per_chunk
    else:
        n_units = n_outer * n_features
    cdef bint use_threads = (num_threads > 1 and n_units > 1
                             and n_outer * n_features * n_inner >= MIN_ELEMENTS_FOR_THREADS)
    for unit in prange(n_units, schedule='static', num_threads=num_threads,
                       use_threads_if=use_threads):
        if n_inner == 1:
            start = unit * rows_per_chunk
            rows = min(rows_per_chunk, n_outer - start)
            offset = start * n_features
            if training:
                if floating is float:
                    fastln_bn_backward_apply_rows_f32(dy + offset, x + offset, dx + offset, rows,
                                                      n_features, mean, correction, k, mean_dy,
                                                      coef)
                else:
                    fastln_bn_backward_apply_rows_f64(dy + offset, x + offset, dx + offset, rows,
                                                      n_features, mean, correction, k, mean_dy,
                                                      coef)
            else:
                if floating is float:
                    fastln_bn_scale_rows_f32(dy + offset, dx + offset, rows, n_features, k)
                else:
                    fastln_bn_scale_rows_f64(dy + offset, dx + offset, rows, n_features, k)
        else:
            c = unit % n_features
            offset = unit * n_inner
            if training:
                if floating is float:
                    fastln_bn_backward_apply_segment_f32(dy + offset, x + offset, dx + offset,
                                                         n_inner, mean[c], correction[c], k[c],
                                                         mean_dy[c], coef[c])
                else:
                    fastln_bn_backward_apply_segment_f64(dy + offset, x + offset, dx + offset,
                                                         n_inner, mean[c], correction[c], k[c],
                                                         mean_dy[c], coef[c])
            else:
                if floating is float:
                    fastln_bn_scale_segment_f32(dy + offset, dx + offset, n_inner, k[c])
                else:
                    fastln_bn_scale_segment_f64(dy + offset, dx + offset, n_inner, k[c])


cdef int _bn_backward(const floating *dy, const floating *x, floating *dx, floating *dgamma,
                      floating *dbeta, Py_ssize_t n_outer, Py_ssize_t n_features,
                      Py_ssize_t n_inner, const double *gamma, const double *mean,
                      const double *rstd, bint training, double eps,
                      int num_threads) noexcept nogil:
    """Returns -1 when scratch memory cannot be allocated."""
    cdef BlockLayout layout = _bn_layout(n_outer, n_features, n_inner)
    cdef Py_ssize_t n_partial = layout.n_blocks * n_features
    cdef Py_ssize_t c, i, n_finish = 0
    # sum_dy, sum_dy_d, sum_d, dgamma, dbeta, correction, k, mean_dy, coef, and the indices of
    # the features the rare path finishes after the dx pass (int64, as wide as a double)
    cdef double *constants = <double*>calloc(10 * n_features, sizeof(double))
    cdef double *partials = <double*>calloc(3 * n_partial, sizeof(double))
    cdef double *sums = constants
    cdef double *dgamma_total = constants + 3 * n_features
    cdef double *dbeta_total = constants + 4 * n_features
    cdef double *correction = constants + 5 * n_features
    cdef double *k = constants + 6 * n_features
    cdef double *mean_dy = constants + 7 * n_features
    cdef double *coef = constants + 8 * n_features
    cdef int64_t *finish = <int64_t*>(constants + 9 * n_features)
    if constants == NULL or partials == NULL:
        free(constants)
        free(partials)
        return -1
    _bn_backward_sums(dy, x, n_outer, n_features, n_inner, mean, partials, partials + n_partial,
                      partials + 2 * n_partial, num_threads)
    for c in range(3):
        fastln_bn_combine_partials(partials + c * n_partial, layout.n_blocks, n_features,
                                   sums + c * n_features)
    free(partials)
    fastln_bn_backward_constants(n_features, <double>(n_outer * n_inner), training, rstd, gamma,
                                 sums, sums + n_features, sums + 2 * n_features, dgamma_total,
                                 dbeta_total, correction, k, mean_dy, coef)
    if training:
        if floating is float:
            n_finish = fastln_bn_rescale_backward_f32(
                dy, x, n_outer, n_features, n_inner, gamma, eps, mean, rstd, sums,
                sums + n_features, sums + 2 * n_features, dgamma_total, correction, k, mean_dy,
                coef, finish)
        else:
            n_finish = fastln_bn_rescale_backward_f64(
                dy, x, n_outer, n_features, n_inner, gamma, eps, mean, rstd, sums,
                sums + n_features, sums + 2 * n_features, dgamma_total, correction, k, mean_dy,
                coef, finish)
    for c in range(n_features):
        dgamma[c] = <floating>dgamma_total[c]
        dbeta[c] = <floating>dbeta_total[c]
    _bn_backward_apply(dy, x, dx, n_outer, n_features, n_inner, training, mean, correction, k,
                       mean_dy, coef, num_threads)
    for i in range(n_finish):
        c = finish[i]
        if floating is float:
            fastln_bn_finish_rescaled_backward_f32(dx, x, n_outer, n_features, n_inner, c,
                                                   mean[c], rstd[c], gamma, eps,
                                                   dgamma_total[c], sums[c])
        else:
            fastln_bn_finish_rescaled_backward_f64(dx, x, n_outer, n_features, n_inner, c,
                                                   mean[c], rstd[c], gamma, eps,
                                                   dgamma_total[c], sums[c])
    free(constants)
    return 0


def batch_norm_backward(cnp.ndarray dy, cnp.ndarray x, cnp.ndarray dx, cnp.ndarray dgamma,
                        cnp.ndarray dbeta, Py_ssize_t n_outer, Py_ssize_t n_features,
                        Py_ssize_t n_inner, object gamma, cnp.ndarray mean, cnp.ndarray rstd,
                        bint training, double eps, int num_threads):
    """BatchNorm backward into dx (x's layout) and dgamma, dbeta (n_features,).

    gamma: float64 (n_features,) or None; mean, rstd: float64 (n_features,) and eps from the
    forward (eps for the rare features whose rstd is beyond double)."""
    cdef void *dy_data = cnp.PyArray_DATA(dy)
    cdef void *x_data = cnp.PyArray_DATA(x)
    cdef void *dx_data = cnp.PyArray_DATA(dx)
    cdef void *dgamma_data = cnp.PyArray_DATA(dgamma)
    cdef void *dbeta_data = cnp.PyArray_DATA(dbeta)
    cdef const double *gamma_data = <const double*>_data(gamma)
    cdef const double *mean_data = <const double*>cnp.PyArray_DATA(mean)
    cdef const double *rstd_data = <const double*>cnp.PyArray_DATA(rstd)
    cdef int status
    if _is_float32(x):
        with nogil:
            status = _bn_backward(<const float*>dy_data, <const float*>x_data, <float*>dx_data,
                                  <float*>dgamma_data, <float*>dbeta_data, n_outer, n_features,
                                  n_inner, gamma_data, mean_data, rstd_data, training, eps,
                                  num_threads)
    else:
        with nogil:
            status = _bn_backward(<const double*>dy_data, <const double*>x_data,
                                  <double*>dx_data, <double*>dgamma_data, <double*>dbeta_data,
                                  n_outer, n_features, n_inner, gamma_data, mean_data,
                                  rstd_data, training, eps, num_threads)
    if status != 0:
        raise MemoryError("batch_norm_backward: cannot allocate the per-feature scratch")
