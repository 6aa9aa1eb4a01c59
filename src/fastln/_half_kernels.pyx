# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Half-precision plumbing: float16 and bfloat16 rows through fastln's float32 row kernels.

Callers (fastln._layer_norm, _rms_norm, _add_norm) have checked every argument: the half arrays
(x, residual, dy, y, s, dx) arrive C-contiguous, aligned and native, all of one half format
(`kind`: 0 float16, 1 bfloat16; passed as raw 16-bit data), and the small arrays (gamma, beta,
bias, mean, rstd, dgamma, dbeta) as float32.

Each thread mallocs a float32 scratch of one or two rows inside the parallel region; a row is
widened into it (exactly), run through the float32 kernel of include/fastln/ in place, and
rounded back to the half format (round to nearest even) into the output. No full-size float32
array is ever made. Every row is computed alone and every dgamma/dbeta reduction has the block
layout of the float32 path (a function of n_rows only), so results are identical for every
num_threads and every batch - and bitwise what the float32 functions give for the widened
input, rounded.
"""
from cython.parallel cimport parallel, prange
from libc.stdint cimport int64_t, uint16_t
from libc.stdlib cimport calloc, free, malloc

cimport numpy as cnp

from fastln._fastpath cimport _data
from fastln._openmp cimport fastln_openmp_set_max_threads
from fastln._parallel cimport _row_blocks, _worth_threads

cnp.import_array()

cdef extern from "fastln/half.h" nogil:
    void fastln_half_to_float_row(const uint16_t *src, float *dst, int64_t n, int kind)
    void fastln_float_to_half_row(const float *src, uint16_t *dst, int64_t n, int kind)
    void fastln_half_sum_row(const float *x, const float *residual, const float *bias,
                             uint16_t *s_half, float *s_float, int64_t n, int kind)

cdef extern from "fastln/layer_norm.h" nogil:
    void fastln_layer_norm_forward_row_f32(
        const float *x, const float *gamma, const float *beta, float *y, int64_t n_cols,
        double eps, double *mean_out, double *rstd_out, int streaming)
    void fastln_layer_norm_backward_row_f32(
        const float *dy, const float *x, const float *gamma, double mean, double rstd,
        double eps, float *dx, int64_t n_cols, float *dgamma_acc, float *dbeta_acc, int streaming)
    void fastln_flush_accumulators_f32(float *accumulators, double *partials, int64_t n)
    int FASTLN_ROWS_PER_FLUSH
    void fastln_sum_block_partials_f32(
        double *partials, int64_t n_blocks, int64_t n_cols, float *out)

cdef extern from "fastln/rms_norm.h" nogil:
    void fastln_rms_norm_forward_row_f32(
        const float *x, const float *gamma, float *y, int64_t n_cols, double eps,
        double *rstd_out)
    void fastln_rms_norm_backward_row_f32(
        const float *dy, const float *x, const float *gamma, double rstd, double eps,
        float *dx, int64_t n_cols, double *dgamma_acc)

def set_default_num_threads(int num_threads):
    """Set the calling thread's OpenMP default team size (fastln.set_num_threads).

    Kept here rather than in an extension of its own (one line would not justify one); it goes
    through fastln/_openmp.pxd like every OpenMP call.
    """
    fastln_openmp_set_max_threads(num_threads)


# ---------------------------------------------------------------------------------------------
# Forward: LayerNorm / RMSNorm, optionally after the residual add
# ---------------------------------------------------------------------------------------------

cdef inline void _forward_row(const uint16_t *x, const uint16_t *residual, const float *bias,
                              const float *gamma, const float *beta, uint16_t *s, uint16_t *y,
                              float *mean, float *rstd, float *buffer, Py_ssize_t row,
                              Py_ssize_t n_cols, double eps, bint rms, int kind) noexcept nogil:
    """One row: widen (and add the residual), normalize in float32 in place, round into y."""
    cdef Py_ssize_t offset = row * n_cols
    cdef double row_mean = 0.0
    cdef double row_rstd = 0.0
    fastln_half_to_float_row(x + offset, buffer, n_cols, kind)
    if residual != NULL:
        fastln_half_to_float_row(residual + offset, buffer + n_cols, n_cols, kind)
        fastln_half_sum_row(buffer, buffer + n_cols, bias, s + offset, buffer, n_cols, kind)
    if rms:
        fastln_rms_norm_forward_row_f32(buffer, gamma, buffer, n_cols, eps, &row_rstd)
    else:
        fastln_layer_norm_forward_row_f32(buffer, gamma, beta, buffer, n_cols, eps, &row_mean,
                                          &row_rstd, 0)
    fastln_float_to_half_row(buffer, y + offset, n_cols, kind)
    if mean != NULL:
        mean[row] = <float>row_mean
    if rstd != NULL:
        rstd[row] = <float>row_rstd


cdef int _forward_rows(const uint16_t *x, const uint16_t *residual, const float *bias,
                       const float *gamma, const float *beta, uint16_t *s, uint16_t *y,
                       float *mean, float *rstd, Py_ssize_t n_rows, Py_ssize_t n_cols,
                       double eps, bint rms, int kind, int num_threads) noexcept nogil:
    """Returns -1 when a thread cannot allocate its scratch rows."""
    cdef Py_ssize_t row
    cdef float *buffer = NULL  # each thread's own (Cython makes it firstprivate)
    cdef int n_failed = 0
    # One scratch row, two with a residual (x and residual side by side; the sum replaces x).
    cdef size_t buffer_bytes = (2 if residual != NULL else 1) * n_cols * sizeof(float)
    # Small calls stay out of OpenMP entirely (as in fastln._kernels): even a disabled parallel
    # region costs about half a microsecond.
    if not _worth_threads(num_threads, n_rows, n_rows * n_cols):
        buffer = <float*>malloc(buffer_bytes)
        if buffer == NULL:
            return -1
        for row in range(n_rows):
            _forward_row(x, residual, bias, gamma, beta, s, y, mean, rstd, buffer, row, n_cols,
                         eps, rms, kind)
        free(buffer)
        return 0
    with parallel(num_threads=num_threads):
        buffer = <float*>malloc(buffer_bytes)
        for row in prange(n_rows, schedule='static'):
            if buffer == NULL:
                n_failed += 1
            else:
                _forward_row(x, residual, bias, gamma, beta, s, y, mean, rstd, buffer, row,
                             n_cols, eps, rms, kind)
        free(buffer)
    return -1 if n_failed else 0


def norm_forward(cnp.ndarray x, object residual, object bias, object gamma, object beta,
                 object s, cnp.ndarray y, object mean, object rstd, bint rms, double eps,
                 int kind, int num_threads):
    """LayerNorm (rms=False) or RMSNorm (rms=True) over the rows of the 2-D half array x.

    With a residual (x's shape and format), s = x + residual (+ bias) is written to s and
    normalized instead of x. mean (LayerNorm) and rstd are 1-D float32 arrays or None.
    """
    cdef Py_ssize_t n_rows = cnp.PyArray_DIM(x, 0)
    cdef Py_ssize_t n_cols = cnp.PyArray_DIM(x, 1)
    cdef const uint16_t *x_data = <const uint16_t*>cnp.PyArray_DATA(x)
    cdef const uint16_t *residual_data = <const uint16_t*>_data(residual)
    cdef const float *bias_data = <const float*>_data(bias)
    cdef const float *gamma_data = <const float*>_data(gamma)
    cdef const float *beta_data = <const float*>_data(beta)
    cdef uint16_t *s_data = <uint16_t*>_data(s)
    cdef uint16_t *y_data = <uint16_t*>cnp.PyArray_DATA(y)
    cdef float *mean_data = <float*>_data(mean)
    cdef float *rstd_data = <float*>_data(rstd)
    cdef int status
    with nogil:
        status = _forward_rows(x_data, residual_data, bias_data, gamma_data, beta_data, s_data,
                               y_data, mean_data, rstd_data, n_rows, n_cols, eps, rms, kind,
                               num_threads)
    if status != 0:
        raise MemoryError("cannot allocate the float32 scratch rows of a half-precision call")


# ---------------------------------------------------------------------------------------------
# Backward: LayerNorm (dx, dgamma, dbeta) / RMSNorm (dx, dgamma)
# ---------------------------------------------------------------------------------------------

cdef void _backward_block(const uint16_t *dy, const uint16_t *x, const float *gamma,
                          const float *mean, const float *rstd, uint16_t *dx,
                          double *block_dgamma, double *block_dbeta, float *row_dgamma,
                          float *row_dbeta, float *buffer, Py_ssize_t row_start,
                          Py_ssize_t row_end, Py_ssize_t n_cols, bint rms, double eps,
                          int kind) noexcept nogil:
    """Rows [row_start, row_end): dx, and their dgamma (dbeta) added to the block's partials.

    As in fastln._kernels: LayerNorm's float32 rows add into float accumulators, folded into
    the double partials every FASTLN_ROWS_PER_FLUSH rows; RMSNorm's rows add into the double
    partials directly. dy is widened into buffer[:n_cols] (where dx is then formed, in place)
    and x into buffer[n_cols:].
    """
    cdef Py_ssize_t row, offset
    for row in range(row_start, row_end):
        offset = row * n_cols
        fastln_half_to_float_row(dy + offset, buffer, n_cols, kind)
        fastln_half_to_float_row(x + offset, buffer + n_cols, n_cols, kind)
        if rms:
            fastln_rms_norm_backward_row_f32(buffer, buffer + n_cols, gamma, rstd[row], eps,
                                             buffer, n_cols, block_dgamma)
        else:
            fastln_layer_norm_backward_row_f32(buffer, buffer + n_cols, gamma, mean[row],
                                               rstd[row], eps, buffer, n_cols, row_dgamma,
                                               row_dbeta, 0)
            if (row - row_start + 1) % FASTLN_ROWS_PER_FLUSH == 0 or row == row_end - 1:
                fastln_flush_accumulators_f32(row_dgamma, block_dgamma, n_cols)
                fastln_flush_accumulators_f32(row_dbeta, block_dbeta, n_cols)
        fastln_float_to_half_row(buffer, dx + offset, n_cols, kind)


cdef inline void _run_block(const uint16_t *dy, const uint16_t *x, const float *gamma,
                            const float *mean, const float *rstd, uint16_t *dx, double *partials,
                            float *accumulators, float *buffer, Py_ssize_t block,
                            Py_ssize_t n_blocks, Py_ssize_t rows_per_block, Py_ssize_t n_rows,
                            Py_ssize_t n_cols, bint rms, double eps, int kind) noexcept nogil:
    """Block `block` of the fixed layout, with its own rows of partials and accumulators."""
    _backward_block(dy, x, gamma, mean, rstd, dx, partials + block * n_cols,
                    partials + (n_blocks + block) * n_cols if not rms else NULL,
                    accumulators + block * n_cols if not rms else NULL,
                    accumulators + (n_blocks + block) * n_cols if not rms else NULL,
                    buffer, block * rows_per_block, min((block + 1) * rows_per_block, n_rows),
                    n_cols, rms, eps, kind)


cdef int _backward_rows(const uint16_t *dy, const uint16_t *x, const float *gamma,
                        const float *mean, const float *rstd, uint16_t *dx, float *dgamma,
                        float *dbeta, Py_ssize_t n_rows, Py_ssize_t n_cols, bint rms, double eps,
                        int kind, int num_threads) noexcept nogil:
    """Returns -1 when scratch memory cannot be allocated."""
    cdef Py_ssize_t n_blocks = _row_blocks(n_rows)
    cdef Py_ssize_t rows_per_block = (n_rows + n_blocks - 1) // n_blocks
    cdef Py_ssize_t n_sums = 1 if rms else 2
    cdef Py_ssize_t block
    cdef float *buffer = NULL  # each thread's own (Cython makes it firstprivate)
    cdef int n_failed = 0
    # Per block: a row of double partial sums for dgamma (and one for dbeta), and for LayerNorm
    # a row of float accumulators for each.
    cdef double *partials = <double*>calloc(n_sums * n_blocks * n_cols, sizeof(double))
    cdef float *accumulators = NULL
    if not rms:
        accumulators = <float*>calloc(2 * n_blocks * n_cols, sizeof(float))
    if partials == NULL or (not rms and accumulators == NULL):
        free(partials)
        free(accumulators)
        return -1
    if not _worth_threads(num_threads, n_blocks, n_rows * n_cols):
        buffer = <float*>malloc(2 * n_cols * sizeof(float))
        if buffer == NULL:
            n_failed = 1
        else:
            for block in range(n_blocks):
                _run_block(dy, x, gamma, mean, rstd, dx, partials, accumulators, buffer, block,
                           n_blocks, rows_per_block, n_rows, n_cols, rms, eps, kind)
        free(buffer)
    else:
        with parallel(num_threads=num_threads):
            buffer = <float*>malloc(2 * n_cols * sizeof(float))
            for block in prange(n_blocks, schedule='static'):
                if buffer == NULL:
                    n_failed += 1
                else:
                    _run_block(dy, x, gamma, mean, rstd, dx, partials, accumulators, buffer,
                               block, n_blocks, rows_per_block, n_rows, n_cols, rms, eps,
                               kind)
            free(buffer)
    if n_failed == 0:
        fastln_sum_block_partials_f32(partials, n_blocks, n_cols, dgamma)
        if not rms:
            fastln_sum_block_partials_f32(partials + n_blocks * n_cols, n_blocks, n_cols, dbeta)
    free(partials)
    free(accumulators)
    return -1 if n_failed else 0


def norm_backward(cnp.ndarray dy, cnp.ndarray x, object gamma, object mean, cnp.ndarray rstd,
                  cnp.ndarray dx, cnp.ndarray dgamma, object dbeta, bint rms, double eps,
                  int kind, int num_threads):
    """Backward over the rows of the 2-D half arrays dy and x into dx (half) and the float32
    dgamma and (LayerNorm) dbeta; mean (LayerNorm) and rstd are the forward's float32 stats, and
    eps its eps."""
    cdef Py_ssize_t n_rows = cnp.PyArray_DIM(x, 0)
    cdef Py_ssize_t n_cols = cnp.PyArray_DIM(x, 1)
    cdef const uint16_t *dy_data = <const uint16_t*>cnp.PyArray_DATA(dy)
    cdef const uint16_t *x_data = <const uint16_t*>cnp.PyArray_DATA(x)
    cdef const float *gamma_data = <const float*>_data(gamma)
    cdef const float *mean_data = <const float*>_data(mean)
    cdef const float *rstd_data = <const float*>cnp.PyArray_DATA(rstd)
    cdef uint16_t *dx_data = <uint16_t*>cnp.PyArray_DATA(dx)
    cdef float *dgamma_data = <float*>cnp.PyArray_DATA(dgamma)
    cdef float *dbeta_data = <float*>_data(dbeta)
    cdef int status
    with nogil:
        status = _backward_rows(dy_data, x_data, gamma_data, mean_data, rstd_data, dx_data,
                                dgamma_data, dbeta_data, n_rows, n_cols, rms, eps, kind,
                                num_threads)
    if status != 0:
        raise MemoryError("cannot allocate the scratch of a half-precision backward")


# ---------------------------------------------------------------------------------------------
# The conversions alone, for the tests (which hold them to NumPy's and ml_dtypes' astype)
# ---------------------------------------------------------------------------------------------

def widen(cnp.ndarray half, cnp.ndarray out, int kind):
    """out[:] = half as float32 (1-D C-contiguous arrays of equal length; out float32)."""
    with nogil:
        fastln_half_to_float_row(<const uint16_t*>cnp.PyArray_DATA(half),
                                 <float*>cnp.PyArray_DATA(out), cnp.PyArray_SIZE(half), kind)


def narrow(cnp.ndarray values, cnp.ndarray out, int kind):
    """out[:] = float32 values rounded to the half format (1-D C-contiguous, equal length)."""
    with nogil:
        fastln_float_to_half_row(<const float*>cnp.PyArray_DATA(values),
                                 <uint16_t*>cnp.PyArray_DATA(out), cnp.PyArray_SIZE(values),
                                 kind)
