# When a kernel call uses OpenMP threads, and how a backward splits its rows for the dgamma/dbeta
# sums: one set of rules for fastln._kernels, _family_kernels and _half_kernels.

# Below MIN_ELEMENTS_FOR_THREADS elements a call runs on the calling thread: waking the OpenMP
# team costs more than the work (a few microseconds). Measured here with 2 threads: 64x768
# (49,152 elements) gains 1.6x forward and 1.2-1.6x backward; 8x768 (6,144) stays on the calling
# thread. Backwards sum dgamma/dbeta over blocks of at least MIN_ROWS_PER_BLOCK rows, at most
# MAX_BLOCKS blocks: the layout depends only on n_rows, never on the thread count, so the sums
# are the same for every num_threads.
cdef enum:
    MIN_ELEMENTS_FOR_THREADS = 32768
    MIN_ROWS_PER_BLOCK = 32
    MAX_BLOCKS = 64


cdef inline bint _worth_threads(int num_threads, Py_ssize_t n_tasks,
                                Py_ssize_t n_elements) noexcept nogil:
    return num_threads > 1 and n_tasks > 1 and n_elements >= MIN_ELEMENTS_FOR_THREADS


cdef inline Py_ssize_t _row_blocks(Py_ssize_t n_rows) noexcept nogil:
    """The number of row blocks of a backward of n_rows rows."""
    return min(max(n_rows // MIN_ROWS_PER_BLOCK, 1), MAX_BLOCKS)
