# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Plumbing for the streaming copy that measures this machine's memory bandwidth (bench only).

The copy itself is _copy.h beside this file; fastln.bench.bandwidth checks the buffers, chooses
their size and the thread count and times the calls. This module only cuts the buffer into chunks
and copies them in an OpenMP prange with the GIL released. It depends on nothing of the kernels'.
"""
from cython.parallel cimport prange
from libc.stdint cimport int64_t

cimport numpy as cnp

cnp.import_array()

cdef extern from "_copy.h" nogil:
    void fastln_copy_chunk(double *destination, const double *source, int64_t n_elements)
    void fastln_copy_chunk_nontemporal(double *destination, const double *source,
                                       int64_t n_elements)
    int fastln_nontemporal_copy_available()
    int fastln_copy_openmp_enabled()


def openmp_enabled():
    """True when compiled with OpenMP (otherwise the copy runs on one thread)."""
    return bool(fastln_copy_openmp_enabled())


def nontemporal_available():
    """True when the copy can use cache-bypassing stores on this build."""
    return bool(fastln_nontemporal_copy_available())


def stream_copy(cnp.ndarray source, cnp.ndarray destination, Py_ssize_t chunk_elements,
                int num_threads, bint nontemporal):
    """Copy source into destination, chunk_elements at a time, spread over num_threads.

    Both arrays are 1-D, C-contiguous float64 of the same length, and num_threads is at most
    the number of chunks (fastln.bench.bandwidth checks and caps them).
    """
    cdef Py_ssize_t n_elements = cnp.PyArray_SIZE(source)
    cdef Py_ssize_t n_chunks = (n_elements + chunk_elements - 1) // chunk_elements
    cdef const double *source_data = <const double*>cnp.PyArray_DATA(source)
    cdef double *destination_data = <double*>cnp.PyArray_DATA(destination)
    cdef Py_ssize_t chunk, start, count
    with nogil:
        # Static schedule: each thread streams through one contiguous part of the buffer.
        for chunk in prange(n_chunks, schedule='static', num_threads=num_threads):
            start = chunk * chunk_elements
            count = min(chunk_elements, n_elements - start)
            if nontemporal:
                fastln_copy_chunk_nontemporal(destination_data + start, source_data + start, count)
            else:
                fastln_copy_chunk(destination_data + start, source_data + start, count)
