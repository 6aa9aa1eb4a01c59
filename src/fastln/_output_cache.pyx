# cython: language_level=3, boundscheck=False, wraparound=False
"""Recycled memory for fastln's large outputs: a NumPy data-memory handler over a small cache.

A fresh output of tens of MiB is dominated by first-touch page faults (the kernel maps and
zeroes every page), and glibc hands every block over 32 MiB back to the system when it is freed.
So fastln allocates its large outputs (FASTLN_OUTPUT_CACHE_MIN_BYTES, 32 MiB, and up) through
a NumPy data-memory handler (NumPy >= 1.22, NEP 49) whose free keeps the block in a small cache
(include/fastln/output_cache.h); the next output of the same size or smaller reuses it,
already faulted in. Each array remembers its handler, so its memory comes back here whenever and on
whichever thread it is freed, also after the cache was resized or switched off.

The handler is installed only around the allocation of an output (PyDataMem_SetHandler sets it
for the current context), so no other array in the process is affected. NumPy's wrappers do the
tracemalloc bookkeeping for any handler: a block is traced while an array owns it, and not
while it sits in the cache.
"""
import contextlib
import math

import numpy as np

cimport numpy as cnp
from cpython.pycapsule cimport PyCapsule_New

cnp.import_array()

cdef extern from "fastln/output_cache.h" nogil:
    ctypedef struct fastln_output_cache_stats:
        size_t max_bytes
        int n_blocks
        size_t cached_bytes
        unsigned long long hits
        unsigned long long misses
    ctypedef struct fastln_output_cache:
        pass
    int FASTLN_OUTPUT_CACHE_MAX_BLOCKS
    void fastln_output_cache_init(fastln_output_cache *cache, size_t max_bytes,
                                  int advise_hugepages)
    void fastln_output_cache_set_max_bytes(fastln_output_cache *cache, size_t max_bytes)
    fastln_output_cache_stats fastln_output_cache_get_stats(fastln_output_cache *cache)

# The handler: NumPy's PyDataMem_Handler struct over the cache's functions. Its name is what
# np._core.multiarray.get_handler_name(array) reports for fastln's large outputs.
cdef extern from *:
    """
    static fastln_output_cache fastln_the_output_cache;
    static PyDataMem_Handler fastln_output_handler = {
        "fastln_output_cache",
        1,
        {
            &fastln_the_output_cache,
            fastln_output_cache_malloc,
            fastln_output_cache_calloc,
            fastln_output_cache_realloc,
            fastln_output_cache_free,
        },
    };
    """
    fastln_output_cache fastln_the_output_cache
    cnp.PyDataMem_Handler fastln_output_handler

MAX_BLOCKS = FASTLN_OUTPUT_CACHE_MAX_BLOCKS
MIN_BYTES = FASTLN_OUTPUT_CACHE_MIN_BYTES


def _numpy_advises_hugepages():
    """Whether NumPy madvises its large blocks MADV_HUGEPAGE (NUMPY_MADVISE_HUGEPAGE)."""
    try:
        from numpy._core.multiarray import _get_madvise_hugepage
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _get_madvise_hugepage
    return bool(_get_madvise_hugepage())


# Off until fastln._memory configures it at import (FASTLN_OUTPUT_CACHE or the default). Fresh
# blocks get the huge-page advice when NumPy's own blocks do (read once, now).
fastln_output_cache_init(&fastln_the_output_cache, 0, _numpy_advises_hugepages())
cdef object _handler_capsule = PyCapsule_New(&fastln_output_handler, "mem_handler", NULL)


cdef inline bint _cache_enabled():
    return fastln_output_cache_get_stats(&fastln_the_output_cache).max_bytes > 0


cdef object new_cached_output(int ndim, cnp.npy_intp *dims, int typenum):
    if not _cache_enabled():
        return cnp.PyArray_EMPTY(ndim, dims, typenum, 0)
    previous = cnp.PyDataMem_SetHandler(_handler_capsule)
    try:
        return cnp.PyArray_EMPTY(ndim, dims, typenum, 0)
    finally:
        cnp.PyDataMem_SetHandler(previous)


def empty_output(shape, dtype):
    """np.empty(shape, dtype) for a result: from the output cache when it is large.

    shape is a tuple of ints, dtype a np.dtype (the callers have checked both).
    """
    if (dtype.itemsize * math.prod(shape) < FASTLN_OUTPUT_CACHE_MIN_BYTES
            or not _cache_enabled()):
        return np.empty(shape, dtype)
    previous = cnp.PyDataMem_SetHandler(_handler_capsule)
    try:
        return np.empty(shape, dtype)
    finally:
        cnp.PyDataMem_SetHandler(previous)


@contextlib.contextmanager
def installed():
    """Every array allocated in the with block gets the handler (for the tests: calloc, etc.)."""
    previous = cnp.PyDataMem_SetHandler(_handler_capsule)
    try:
        yield
    finally:
        cnp.PyDataMem_SetHandler(previous)


def set_max_bytes(size_t max_bytes):
    """Cap the cached bytes; blocks over the new cap are unmapped now (0: every block)."""
    fastln_output_cache_set_max_bytes(&fastln_the_output_cache, max_bytes)


def stats():
    """The cache's state: max_bytes, blocks, cached_bytes, hits, misses."""
    cdef fastln_output_cache_stats stats = fastln_output_cache_get_stats(&fastln_the_output_cache)
    return {"max_bytes": stats.max_bytes, "blocks": stats.n_blocks,
            "cached_bytes": stats.cached_bytes, "hits": stats.hits, "misses": stats.misses}
