# The C-level argument checks of the fast paths (see layer_norm_forward_fast in _kernels.pyx).
# Each answers "is this the common, already-valid case?"; a False sends the call to the general
# Python path, which does the full checking and raises the errors. At the end, what the kernel
# modules share once a call is checked: optional arguments' data pointers, output allocations.
from libc.math cimport INFINITY

cimport numpy as cnp

from fastln._openmp cimport fastln_openmp_max_threads, fastln_thread_cap
from fastln._output_cache cimport new_output


cdef inline bint _is_kernel_array(object value, int typenum):
    """An exact ndarray of typenum: C-contiguous, aligned, native byte order."""
    if type(value) is not cnp.ndarray:
        return False
    cdef cnp.ndarray array = <cnp.ndarray>value
    return (cnp.PyArray_TYPE(array) == typenum and cnp.PyArray_ISCARRAY_RO(array)
            and cnp.PyArray_ISNOTSWAPPED(array))


cdef inline int _float_typenum(object x):
    """x's typenum when x is a float32/float64 kernel array of at least one dimension (an input
    the fast paths take), else 0."""
    if type(x) is not cnp.ndarray:
        return 0
    cdef int typenum = cnp.PyArray_TYPE(<cnp.ndarray>x)
    if ((typenum != cnp.NPY_FLOAT32 and typenum != cnp.NPY_FLOAT64)
            or cnp.PyArray_NDIM(<cnp.ndarray>x) == 0 or not _is_kernel_array(x, typenum)):
        return 0
    return typenum


cdef inline bint _is_last_axis(object axis, int ndim):
    """A forward's axis argument naming the last axis, as a plain int (-1 or ndim - 1)."""
    return type(axis) is int and (axis == -1 or axis == ndim - 1)


cdef inline bint _is_param(object value, int typenum, Py_ssize_t n_cols):
    """None, or a 1-D kernel array of n_cols elements."""
    if value is None:
        return True
    return (_is_kernel_array(value, typenum) and cnp.PyArray_NDIM(<cnp.ndarray>value) == 1
            and cnp.PyArray_DIM(<cnp.ndarray>value, 0) == n_cols)


cdef inline bint _overlaps(object a, object b):
    """Whether the memory of two contiguous arrays (or None) intersects."""
    if a is None or b is None:
        return False
    cdef char *a_start = <char*>cnp.PyArray_DATA(<cnp.ndarray>a)
    cdef char *b_start = <char*>cnp.PyArray_DATA(<cnp.ndarray>b)
    return (a_start < b_start + cnp.PyArray_NBYTES(<cnp.ndarray>b)
            and b_start < a_start + cnp.PyArray_NBYTES(<cnp.ndarray>a))


cdef inline bint _clobbers(object out, object source):
    """Whether writing out could change source before it is read. The kernels read element i of
    a row before they write element i of its output, so out exactly on top of source (same
    start, same size) is safe; any other overlap is not."""
    if not _overlaps(out, source):
        return False
    return (cnp.PyArray_DATA(<cnp.ndarray>out) != cnp.PyArray_DATA(<cnp.ndarray>source)
            or cnp.PyArray_NBYTES(<cnp.ndarray>out) != cnp.PyArray_NBYTES(<cnp.ndarray>source))


cdef inline bint _same_leading_dims(cnp.ndarray a, cnp.ndarray b, int ndim):
    """a's first ndim dimensions equal b's."""
    cdef int axis
    for axis in range(ndim):
        if cnp.PyArray_DIM(a, axis) != cnp.PyArray_DIM(b, axis):
            return False
    return True


cdef inline bint _same_shape(cnp.ndarray a, cnp.ndarray b):
    cdef int ndim = cnp.PyArray_NDIM(a)
    return cnp.PyArray_NDIM(b) == ndim and _same_leading_dims(a, b, ndim)


cdef inline int _fast_num_threads(object num_threads):
    """The thread count, or 0 when the value needs the general path's checking."""
    if num_threads is None:
        return min(fastln_openmp_max_threads(), fastln_thread_cap())
    if type(num_threads) is int and 1 <= num_threads <= fastln_thread_cap():
        return <int>num_threads
    return 0


cdef inline bint _is_fast_eps(object eps):
    return type(eps) is float and 0.0 <= <double>eps < INFINITY


# What every fast path establishes first about its x and num_threads (_fast_rows).
ctypedef struct _FastRows:
    int typenum           # NPY_FLOAT32 or NPY_FLOAT64
    int ndim
    Py_ssize_t n_cols     # x.shape[-1], not 0
    Py_ssize_t n_rows     # the product of the other dimensions
    int threads           # the checked thread count


cdef inline bint _fast_rows(object x, object num_threads, _FastRows *rows):
    """The opening check of every fast path: x a float32/float64 kernel array whose last axis is
    not empty, and a thread count that needs no checking; rows gets their description. False:
    the call goes to the general path."""
    rows.typenum = _float_typenum(x)
    if rows.typenum == 0:
        return False
    rows.ndim = cnp.PyArray_NDIM(<cnp.ndarray>x)
    rows.n_cols = cnp.PyArray_DIM(<cnp.ndarray>x, rows.ndim - 1)
    rows.threads = _fast_num_threads(num_threads)
    if rows.n_cols == 0 or rows.threads == 0:
        return False
    rows.n_rows = cnp.PyArray_SIZE(<cnp.ndarray>x) // rows.n_cols
    return True


cdef inline bint _is_fast_out(object out, cnp.ndarray like):
    """None, or a writeable kernel array of like's dtype and shape."""
    if out is None:
        return True
    return (_is_kernel_array(out, cnp.PyArray_TYPE(like))
            and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out) and _same_shape(<cnp.ndarray>out, like))


cdef inline bint _is_row_stats(object value, int typenum, cnp.ndarray x):
    """A cache's per-row statistic (mean or rstd) for x normalized over its last axis: a kernel
    array of typenum and shape x.shape[:-1], as the forward made it."""
    if not _is_kernel_array(value, typenum):
        return False
    cdef cnp.ndarray stats = <cnp.ndarray>value
    cdef int ndim = cnp.PyArray_NDIM(x) - 1
    return cnp.PyArray_NDIM(stats) == ndim and _same_leading_dims(stats, x, ndim)


cdef inline bint _is_cache_dtype(object dtype, cnp.ndarray x):
    """A cache's _dtype field for x: None (a cache built by hand; y's dtype is then the
    statistics', which _is_row_stats checks) or x's own dtype, as fastln's forwards record it."""
    if dtype is None:
        return True
    return (cnp.PyArray_DescrCheck(dtype)
            and cnp.PyArray_EquivTypes(<cnp.dtype>dtype, <cnp.dtype>cnp.PyArray_DESCR(x)))


cdef inline void* _data(object array):
    """An optional array argument's data pointer: NULL for None."""
    return NULL if array is None else cnp.PyArray_DATA(<cnp.ndarray>array)


cdef inline object _new_like(cnp.ndarray x, int typenum):
    """An output of x's shape (from the output cache when it is large)."""
    return new_output(cnp.PyArray_NDIM(x), cnp.PyArray_DIMS(x), typenum, cnp.PyArray_NBYTES(x))


cdef inline object _new_row_stats(cnp.ndarray x, int typenum):
    """A per-row statistic (mean, rstd) of x normalized over its last axis: x.shape[:-1]."""
    return cnp.PyArray_EMPTY(cnp.PyArray_NDIM(x) - 1, cnp.PyArray_DIMS(x), typenum, 0)


cdef inline object _new_column_sums(cnp.ndarray x, int typenum):
    """A parameter gradient (dgamma, dbeta) of x normalized over its last axis: x.shape[-1:]."""
    return cnp.PyArray_EMPTY(1, cnp.PyArray_DIMS(x) + cnp.PyArray_NDIM(x) - 1, typenum, 0)
