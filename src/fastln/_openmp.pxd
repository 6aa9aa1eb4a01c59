# Every OpenMP query fastln makes goes through this file; the header stubs them out when the
# extension is built without OpenMP, so the package still builds and runs (serially).
cdef extern from "fastln/openmp_compat.h" nogil:
    int fastln_openmp_enabled()
    int fastln_openmp_num_procs()
    int fastln_thread_cap()
    void fastln_watch_for_fork()


cdef extern from "fastln/threads.h" nogil:
    void fastln_set_initial_threads(int n)
    int fastln_get_num_threads()
    void fastln_set_num_threads(int n)
