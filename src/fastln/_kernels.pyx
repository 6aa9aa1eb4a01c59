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

from fastln._openmp cimport fastln_openmp_enabled, fastln_openmp_max_threads

cnp.import_array()

ctypedef fused floating:
    float
    double

cdef extern from "fastln/layer_norm.h" nogil:
    void fastln_layer_norm_forward_row_f32(
        const float *x, const float *gamma, const float *beta, float *y, int64_t n_cols,
        double eps, double *mean_out, double *rstd_out)
    void fastln_layer_norm_forward_row_f64(
        const double *x, const double *gamma, const double *beta, double *y, int64_t n_cols,
        double eps, double *mean_out, double *rstd_out)
    void fastln_layer_norm_backward_row_f32(
        const float *dy, const float *x, const float *gamma, double mean, double rstd,
        float *dx, int64_t n_cols, double *dgamma_acc, double *dbeta_acc)
    void fastln_layer_norm_backward_row_f64(
        const double *dy, const double *x, const double *gamma, double mean, double rstd,
        double *dx, int64_t n_cols, double *dgamma_acc, double *dbeta_acc)
    void fastln_sum_block_partials_f32(
        const double *partials, int64_t n_blocks, int64_t n_cols, float *out)
    void fastln_sum_block_partials_f64(
        const double *partials, int64_t n_blocks, int64_t n_cols, double *out)

# Below this many elements a call runs on the calling thread: waking the OpenMP team costs more
# than the work (a few microseconds).
cdef enum:
    MIN_ELEMENTS_FOR_THREADS = 65536
# Backward sums dgamma/dbeta over blocks of at least this many rows, at most MAX_BLOCKS blocks.
# The block layout depends only on n_rows, never on the thread count, so the sums are the same
# for every num_threads.
cdef enum:
    MIN_ROWS_PER_BLOCK = 32
    MAX_BLOCKS = 64


def openmp_enabled():
    """True when the extension was compiled with OpenMP."""
    return bool(fastln_openmp_enabled())


def default_num_threads():
    """OpenMP's default team size (honours OMP_NUM_THREADS); 1 without OpenMP."""
    return fastln_openmp_max_threads()


cdef inline void* _data(object array):
    return NULL if array is None else cnp.PyArray_DATA(<cnp.ndarray>array)


cdef void _forward_rows(const floating *x, const floating *gamma, const floating *beta,
                        floating *y, floating *mean, floating *rstd,
                        Py_ssize_t n_rows, Py_ssize_t n_cols, double eps,
                        int num_threads) noexcept nogil:
    cdef Py_ssize_t row
    cdef double row_mean, row_rstd
    cdef bint use_threads = num_threads > 1 and n_rows > 1 and n_rows * n_cols >= MIN_ELEMENTS_FOR_THREADS
    for row in prange(n_rows, schedule='static', num_threads=num_threads,
                      use_threads_if=use_threads):
        if floating is float:
            fastln_layer_norm_forward_row_f32(x + row * n_cols, gamma, beta, y + row * n_cols,
                                              n_cols, eps, &row_mean, &row_rstd)
        else:
            fastln_layer_norm_forward_row_f64(x + row * n_cols, gamma, beta, y + row * n_cols,
                                              n_cols, eps, &row_mean, &row_rstd)
        if mean != NULL:
            mean[row] = <floating>row_mean
            rstd[row] = <floating>row_rstd


def layer_norm_forward(cnp.ndarray x, object gamma, object beta, cnp.ndarray y,
                       object mean, object rstd, double eps, int num_threads):
    """Forward over the rows of the 2-D array x into y; mean/rstd (1-D, or None) get the stats."""
    cdef Py_ssize_t n_rows = cnp.PyArray_DIM(x, 0)
    cdef Py_ssize_t n_cols = cnp.PyArray_DIM(x, 1)
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


cdef int _backward_rows(const floating *dy, const floating *x, const floating *gamma,
                        const floating *mean, const floating *rstd, floating *dx,
                        floating *dgamma, floating *dbeta,
                        Py_ssize_t n_rows, Py_ssize_t n_cols, int num_threads) noexcept nogil:
    """Returns -1 when the scratch for the dgamma/dbeta partial sums cannot be allocated."""
    cdef Py_ssize_t n_blocks = min(max(n_rows // MIN_ROWS_PER_BLOCK, 1), MAX_BLOCKS)
    cdef Py_ssize_t rows_per_block = (n_rows + n_blocks - 1) // n_blocks
    cdef Py_ssize_t block, row, row_end
    cdef double *block_dgamma
    cdef double *block_dbeta
    cdef bint use_threads = num_threads > 1 and n_blocks > 1 and n_rows * n_cols >= MIN_ELEMENTS_FOR_THREADS
    # One row of partial sums per block for dgamma, then one per block for dbeta.
    cdef double *partials = <double*>calloc(2 * n_blocks * n_cols, sizeof(double))
    if partials == NULL:
        return -1
    for block in prange(n_blocks, schedule='static', num_threads=num_threads,
                        use_threads_if=use_threads):
        block_dgamma = partials + block * n_cols
        block_dbeta = partials + (n_blocks + block) * n_cols
        row_end = min((block + 1) * rows_per_block, n_rows)
        for row in range(block * rows_per_block, row_end):
            if floating is float:
                fastln_layer_norm_backward_row_f32(
                    dy + row * n_cols, x + row * n_cols, gamma, mean[row], rstd[row],
                    dx + row * n_cols, n_cols, block_dgamma, block_dbeta)
            else:
                fastln_layer_norm_backward_row_f64(
                    dy + row * n_cols, x + row * n_cols, gamma, mean[row], rstd[row],
                    dx + row * n_cols, n_cols, block_dgamma, block_dbeta)
    if floating is float:
        fastln_sum_block_partials_f32(partials, n_blocks, n_cols, dgamma)
        fastln_sum_block_partials_f32(partials + n_blocks * n_cols, n_blocks, n_cols, dbeta)
    else:
        fastln_sum_block_partials_f64(partials, n_blocks, n_cols, dgamma)
        fastln_sum_block_partials_f64(partials + n_blocks * n_cols, n_blocks, n_cols, dbeta)
    free(partials)
    return 0


def layer_norm_backward(cnp.ndarray dy, cnp.ndarray x, object gamma, cnp.ndarray mean,
                        cnp.ndarray rstd, cnp.ndarray dx, cnp.ndarray dgamma,
                        cnp.ndarray dbeta, int num_threads):
    """Backward over the rows of the 2-D arrays dy and x into dx, dgamma and dbeta."""
    cdef Py_ssize_t n_rows = cnp.PyArray_DIM(x, 0)
    cdef Py_ssize_t n_cols = cnp.PyArray_DIM(x, 1)
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
                <float*>dgamma_data, <float*>dbeta_data, n_rows, n_cols, num_threads)
    else:
        with nogil:
            status = _backward_rows(
                <const double*>dy_data, <const double*>x_data, <const double*>gamma_data,
                <const double*>mean_data, <const double*>rstd_data, <double*>dx_data,
                <double*>dgamma_data, <double*>dbeta_data, n_rows, n_cols, num_threads)
    if status != 0:
        raise MemoryError("layer_norm_backward: cannot allocate the dgamma/dbeta partial sums")
