# Every OpenMP query fastln makes goes through this file; the header stubs them out when the
# extension is built without OpenMP, so the package still builds and runs (serially).
cdef extern from "fastln/openmp_compat.h" nogil:
    int fastln_openmp_enabled()
    int fastln_openmp_max_threads()
    void fastln_openmp_set_max_threads(int n)
    int fastln_thread_cap()
    void fastln_watch_for_fork()
