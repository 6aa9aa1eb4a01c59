# Outputs of fastln's calls, from recycled memory when they are large (see _output_cache.pyx).
cimport numpy as cnp

# Outputs of at least this many bytes come from the output cache; smaller ones are plain
# np.empty, with no extra cost at all (the check below is the only thing they pay).
cdef extern from "fastln/output_cache.h":
    enum: FASTLN_OUTPUT_CACHE_MIN_BYTES

cdef object new_cached_output(int ndim, cnp.npy_intp *dims, int typenum)


cdef inline object new_output(int ndim, cnp.npy_intp *dims, int typenum, Py_ssize_t nbytes):
    """An uninitialised C-ordered array of nbytes bytes for a result."""
    if nbytes >= FASTLN_OUTPUT_CACHE_MIN_BYTES:
        return new_cached_output(ndim, dims, typenum)
    return cnp.PyArray_EMPTY(ndim, dims, typenum, 0)
