# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Plumbing between the Python API and the C row kernels in include/fastln/.

Callers (fastln._layer_norm) have already checked every argument: arrays arrive C-contiguous,
aligned, in native byte order and with matching float32/float64 dtypes. This module only takes
their data pointers, releases the GIL and runs the rows in an OpenMP prange.
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
from fastln._openmp cimport (
    fastln_openmp_enabled,
    fastln_openmp_max_threads,
    fastln_thread_cap,
    fastln_watch_for_fork,
)
from fastln._parallel cimport _row_blocks, _worth_threads

cnp.import_array()
fastln_watch_for_fork()  # forked children run serially: see fastln/openmp_compat.h

ctypedef fused floating:
    float
    double

cdef extern from "fastln/layer_norm.h" nogil:
    void fastln_layer_norm_forward_row_f32(
        const float *x, const float *gamma, const float *beta, float *y, int64_t n_cols,
        double eps, double *mean_out, double *rstd_out, int streaming)
    void fastln_layer_norm_forward_row_f64(
        const double *x, const double *gamma, const double *beta, double *y, int64_t n_cols,
        double eps, double *mean_out, double *rstd_out, int streaming)
    void fastln_layer_norm_backward_rows_f32(
        const float *dy, const float *x, const float *gamma, const float *mean,
        const float *rstd, double eps, float *dx, int64_t n_rows, int64_t n_cols,
        float *dgamma_acc, float *dbeta_acc, int streaming)
    void fastln_layer_norm_backward_rows_f64(
        const double *dy, const double *x, const double *gamma, const double *mean,
        const double *rstd, double eps, double *dx, int64_t n_rows, int64_t n_cols,
        double *dgamma_acc, double *dbeta_acc, int streaming)
    void fastln_flush_accumulators_f32(float *accumulators, double *partials, int64_t n)
    int FASTLN_ROWS_PER_FLUSH
    int FASTLN_BACKWARD_GROUP
    void fastln_sum_block_partials_f32(
        double *partials, int64_t n_blocks, int64_t n_cols, float *out)
    void fastln_sum_block_partials_f64(
        double *partials, int64_t n_blocks, int64_t n_cols, double *out)

# Outputs at least this large are written with streaming (non-temporal) stores: measured here,
# they gain from 32 MiB up and lose below (the output would still have been in cache).
cdef enum:
    MIN_BYTES_FOR_STREAMING = 32 * 1024 * 1024


def openmp_enabled():
    """True when the extension was compiled with OpenMP."""
    return bool(fastln_openmp_enabled())


def default_num_threads():
    """OpenMP's default team size (honours OMP_NUM_THREADS); 1 without OpenMP."""
    return min(fastln_openmp_max_threads(), fastln_thread_cap())


def thread_cap():
    """The most threads one call starts (4 per processor, at least 64)."""
    return fastln_thread_cap()


# ---------------------------------------------------------------------------------------------
# Fast path. The common call - C-contiguous native float32/float64 arrays, axis=-1, nothing
# unusual - is recognised here with a few C-level checks (fastln/_fastpath.pxd) instead of the
# general Python checks, because for one 768-wide row those checks would cost ten times the
# arithmetic. Anything the fast path does not recognise (including every invalid argument)
# returns None, and the caller takes the general path, which does the full checking and raises
# the errors.
# ---------------------------------------------------------------------------------------------


def layer_norm_forward_fast(object x, object gamma, object beta, object eps, object axis,
                            object out, object num_threads, bint keep_cache):
    """y, or (y, mean, rstd) with keep_cache; None when the call needs the general path."""
    cdef _FastRows rows
    if not _fast_rows(x, num_threads, &rows):
        return None
    cdef cnp.ndarray x_array = <cnp.ndarray>x
    if (not _is_last_axis(axis, rows.ndim) or not _is_fast_eps(eps)
            or not _is_param(gamma, rows.typenum, rows.n_cols)
            or not _is_param(beta, rows.typenum, rows.n_cols) or not _is_fast_out(out, x_array)):
        return None
    # out may be x itself (in place), except when the cache keeps x for the backward.
    if (_overlaps(out, gamma) or _overlaps(out, beta) or _clobbers(out, x)
            or (keep_cache and _overlaps(out, x))):
        return None
    y = out if out is not None else _new_like(x_array, rows.typenum)
    mean = rstd = None
    if keep_cache:
        mean = _new_row_stats(x_array, rows.typenum)
        rstd = _new_row_stats(x_array, rows.typenum)
    _run_forward(x_array, gamma, beta, <cnp.ndarray>y, mean, rstd, rows.n_rows, rows.n_cols,
                 <double>eps, rows.threads)
    if keep_cache:
        return y, mean, rstd
    return y


cdef inline void _forward_row(const floating *x, const floating *gamma, const floating *beta,
                              floating *y, floating *mean, floating *rstd, Py_ssize_t row,
                              Py_ssize_t n_cols, double eps, bint streaming) noexcept nogil:
    cdef double row_mean, row_rstd
    if floating is float:
        fastln_layer_norm_forward_row_f32(x + row * n_cols, gamma, beta, y + row * n_cols,
                                          n_cols, eps, &row_mean, &row_rstd, streaming)
    else:
        fastln_layer_norm_forward_row_f64(x + row * n_cols, gamma, beta, y + row * n_cols,
                                          n_cols, eps, &row_mean, &row_rstd, streaming)
    if mean != NULL:
        mean[row] = <floating>row_mean
        rstd[row] = <floating>row_rstd


cdef void _forward_rows(const floating *x, const floating *gamma, const floating *beta,
                        floating *y, floating *mean, floating *rstd,
                        Py_ssize_t n_rows, Py_ssize_t n_cols, double eps,
                        int num_threads) noexcept nogil:
    cdef Py_ssize_t row
    cdef bint streaming = n_rows * n_cols * sizeof(floating) >= MIN_BYTES_FOR_STREAMING
    # Small calls stay out of OpenMP entirely: even a disabled parallel region costs ~0.5 us.
    if _worth_threads(num_threads, n_rows, n_rows * n_cols):
        for row in prange(n_rows, schedule='static', num_threads=num_threads):
            _forward_row(x, gamma, beta, y, mean, rstd, row, n_cols, eps, streaming)
    else:
        for row in range(n_rows):
            _forward_row(x, gamma, beta, y, mean, rstd, row, n_cols, eps, streaming)


def layer_norm_forward(cnp.ndarray x, object gamma, object beta, cnp.ndarray y,
                       object mean, object rstd, double eps, int num_threads):
    """Forward over the rows of the 2-D array x into y; mean/rstd (1-D, or None) get the stats."""
    _run_forward(x, gamma, beta, y, mean, rstd, cnp.PyArray_DIM(x, 0), cnp.PyArray_DIM(x, 1),
                 eps, num_threads)


cdef void _run_forward(cnp.ndarray x, object gamma, object beta, cnp.ndarray y, object mean,
                       object rstd, Py_ssize_t n_rows, Py_ssize_t n_cols, double eps,
                       int num_threads):
    cdef void *x_data = cnp.PyArray_DATA(x)
    cdef void *y_data = cnp.PyArray_DATA(y)
    cdef void *gamma_data = _data(gamma)
    cdef void *beta_data = _data(beta)
    cdef void *mean_data = _data(mean)
    cdef void *rstd_data = _data(rstd)
    if cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32:
        with nogil:
            _forward_rows(<const float*>x_data, <const float*>gamma_data, <const float*>beta_data,
                          <float*>y_data, <float*>mean_data, <float*>rstd_data,
                          n_rows, n_cols, eps, num_threads)
    else:
        with nogil:
            _forward_rows(<const double*>x_data, <const double*>gamma_data,
                          <const double*>beta_data, <double*>y_data, <double*>mean_data,
                          <double*>rstd_data, n_rows, n_cols, eps, num_threads)


cdef inline void _backward_block(const floating *dy, const floating *x, const floating *gamma,
                                 const floating *mean, const floating *rstd, floating *dx,
                                 double *block_dgamma, double *block_dbeta,
                                 floating *row_dgamma, floating *row_dbeta, Py_ssize_t row_start,
                                 Py_ssize_t row_end, Py_ssize_t n_cols,
                                 double eps, bint streaming) noexcept nogil:
    """Rows [row_start, row_end): dx, and their dgamma/dbeta added to the block's partials.

    Rows go in groups of FASTLN_BACKWARD_GROUP. float32 rows add into float accumulators
    (row_dgamma/row_dbeta), folded into the double partials every FASTLN_ROWS_PER_FLUSH rows;
    float64 rows add into the partials directly.
    """
    cdef Py_ssize_t row = row_start, count
    while row < row_end:
        count = min(<Py_ssize_t>FASTLN_BACKWARD_GROUP, row_end - row)
        if floating is float:
            fastln_layer_norm_backward_rows_f32(
                dy + row * n_cols, x + row * n_cols, gamma, mean + row, rstd + row, eps,
                dx + row * n_cols, count, n_cols, row_dgamma, row_dbeta, streaming)
        else:
            fastln_layer_norm_backward_rows_f64(
                dy + row * n_cols, x + row * n_cols, gamma, mean + row, rstd + row, eps,
                dx + row * n_cols, count, n_cols, block_dgamma, block_dbeta, streaming)
        row += count
        if floating is float and ((row - row_start) % FASTLN_ROWS_PER_FLUSH == 0
                                  or row == row_end):
            fastln_flush_accumulators_f32(row_dgamma, block_dgamma, n_cols)
            fastln_flush_accumulators_f32(row_dbeta, block_dbeta, n_cols)


cdef int _backward_rows(const floating *dy, const floating *x, const floating *gamma,
                        const floating *mean, const floating *rstd, floating *dx,
                        floating *dgamma, floating *dbeta,
                        Py_ssize_t n_rows, Py_ssize_t n_cols, double eps,
                        int num_threads) noexcept nogil:
    """Returns -1 when the scratch for the dgamma/dbeta partial sums cannot be allocated."""
    cdef Py_ssize_t n_blocks = _row_blocks(n_rows)
    cdef Py_ssize_t rows_per_block = (n_rows + n_blocks - 1) // n_blocks
    cdef Py_ssize_t block
    # dx much larger than the cache goes out with non-temporal stores: it saves reading every
    # line of dx before writing it (measured here: 1.8x at 4096x4096 float32, reused dx).
    cdef bint streaming = n_rows * n_cols * sizeof(floating) >= MIN_BYTES_FOR_STREAMING
    # One row of double partial sums per block for dgamma, then one per block for dbeta; for
    # float32, one row of float accumulators per block for each as well.
    cdef double *partials = <double*>calloc(2 * n_blocks * n_cols, sizeof(double))
    cdef floating *accumulators = NULL
    if floating is float:
        accumulators = <floating*>calloc(2 * n_blocks * n_cols, sizeof(floating))
    if partials == NULL or (floating is float and accumulators == NULL):
        free(partials)
        free(accumulators)
        return -1
    if _worth_threads(num_threads, n_blocks, n_rows * n_cols):
        for block in prange(n_blocks, schedule='static', num_threads=num_threads):
            _backward_block(dy, x, gamma, mean, rstd, dx, partials + block * n_cols,
                            partials + (n_blocks + block) * n_cols,
                            accumulators + block * n_cols,
                            accumulators + (n_blocks + block) * n_cols, block * rows_per_block,
                            min((block + 1) * rows_per_block, n_rows), n_cols, eps,
                            streaming)
    else:
        for block in range(n_blocks):
            _backward_block(dy, x, gamma, mean, rstd, dx, partials + block * n_cols,
                            partials + (n_blocks + block) * n_cols,
                            accumulators + block * n_cols,
                            accumulators + (n_blocks + block) * n_cols, block * rows_per_block,
                            min((block + 1) * rows_per_block, n_rows), n_cols, eps,
                            streaming)
    if floating is float:
        fastln_sum_block_partials_f32(partials, n_blocks, n_cols, dgamma)
        fastln_sum_block_partials_f32(partials + n_blocks * n_cols, n_blocks, n_cols, dbeta)
    else:
        fastln_sum_block_partials_f64(partials, n_blocks, n_cols, dgamma)
        fastln_sum_block_partials_f64(partials + n_blocks * n_cols, n_blocks, n_cols, dbeta)
    free(partials)
    free(accumulators)
    return 0


def layer_norm_backward(cnp.ndarray dy, cnp.ndarray x, object gamma, cnp.ndarray mean,
                        cnp.ndarray rstd, cnp.ndarray dx, cnp.ndarray dgamma,
                        cnp.ndarray dbeta, double eps, int num_threads):
    """Backward over the rows of the 2-D arrays dy and x into dx, dgamma and dbeta; eps is the
    forward's (rows whose cached rstd is Inf are done from x again)."""
    _run_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, cnp.PyArray_DIM(x, 0),
                  cnp.PyArray_DIM(x, 1), eps, num_threads)


def layer_norm_backward_fast(object dy, object x, object mean, object rstd, object axis,
                             object dtype, object eps, object gamma, object out,
                             object num_threads):
    """(dx, dgamma, dbeta) for a cache normalized over x's last axis; None for the general path.

    x, mean, rstd, axis, eps and dtype (its _dtype field) come from a LayerNormCache.
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
            or not _is_row_stats(mean, rows.typenum, x_array)
            or not _is_row_stats(rstd, rows.typenum, x_array)):
        return None
    # dx may be dy or x itself (in place).
    if (_overlaps(out, gamma) or _overlaps(out, mean) or _overlaps(out, rstd)
            or _clobbers(out, dy) or _clobbers(out, x)):
        return None
    dx = out if out is not None else _new_like(x_array, rows.typenum)
    dgamma = _new_column_sums(x_array, rows.typenum)
    dbeta = _new_column_sums(x_array, rows.typenum)
    _run_backward(<cnp.ndarray>dy, x_array, gamma, <cnp.ndarray>mean, <cnp.ndarray>rstd,
                  <cnp.ndarray>dx, <cnp.ndarray>dgamma, <cnp.ndarray>dbeta, rows.n_rows,
                  rows.n_cols, <double>eps, rows.threads)
    return dx, dgamma, dbeta


cdef int _run_backward(cnp.ndarray dy, cnp.ndarray x, object gamma, cnp.ndarray mean,
                       cnp.ndarray rstd, cnp.ndarray dx, cnp.ndarray dgamma, cnp.ndarray dbeta,
                       Py_ssize_t n_rows, Py_ssize_t n_cols, double eps,
                       int num_threads) except -1:
    cdef void *dy_data = cnp.PyArray_DATA(dy)
    cdef void *x_data = cnp.PyArray_DATA(x)
    cdef void *gamma_data = _data(gamma)
    cdef void *mean_data = cnp.PyArray_DATA(mean)
    cdef void *rstd_data = cnp.PyArray_DATA(rstd)
    cdef void *dx_data = cnp.PyArray_DATA(dx)
    cdef void *dgamma_data = cnp.PyArray_DATA(dgamma)
    cdef void *dbeta_data = cnp.PyArray_DATA(dbeta)
    cdef int status
    if cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32:
        with nogil:
            status = _backward_rows(
                <const float*>dy_data, <const float*>x_data, <const float*>gamma_data,
                <const float*>mean_data, <const float*>rstd_data, <float*>dx_data,
                <float*>dgamma_data, <float*>dbeta_data, n_rows, n_cols, eps, num_threads)
    else:
        with nogil:
            status = _backward_rows(
                <const double*>dy_data, <const double*>x_data, <const double*>gamma_data,
                <const double*>mean_data, <const double*>rstd_data, <double*>dx_data,
                <double*>dgamma_data, <double*>dbeta_data, n_rows, n_cols, eps, num_threads)
    if status != 0:
        raise MemoryError("layer_norm_backward: cannot allocate the dgamma/dbeta partial sums")
    return 0
