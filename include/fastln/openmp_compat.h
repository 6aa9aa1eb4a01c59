/* The only place fastln touches the OpenMP runtime, so that the package also builds without it. */
#ifndef FASTLN_OPENMP_COMPAT_H
#define FASTLN_OPENMP_COMPAT_H

#ifdef _OPENMP
#include <omp.h>
static inline int fastln_openmp_enabled(void) { return 1; }
static inline int fastln_openmp_max_threads(void) { return omp_get_max_threads(); }
/* Sets the calling thread's default team size (what fastln_openmp_max_threads then returns). */
static inline void fastln_openmp_set_max_threads(int n) { omp_set_num_threads(n); }
static inline int fastln_openmp_num_procs(void) { return omp_get_num_procs(); }
#else
static inline int fastln_openmp_enabled(void) { return 0; }
static inline int fastln_openmp_max_threads(void) { return 1; }
static inline void fastln_openmp_set_max_threads(int n) { (void)n; }
static inline int fastln_openmp_num_procs(void) { return 1; }
#endif

/* The most threads a call will start: more than a few per processor only wastes memory, and
 * asking OpenMP for a team of 10^5 threads can exhaust the process (results are the same for
 * every count, so capping changes nothing but the cost). */
static inline int fastln_thread_cap(void)
{
    const int cap = 4 * fastln_openmp_num_procs();
    return cap > 64 ? cap : 64;
}

#endif /* FASTLN_OPENMP_COMPAT_H */
