/* The only place fastln touches the OpenMP runtime, so that the package also builds without it. */
#ifndef FASTLN_OPENMP_COMPAT_H
#define FASTLN_OPENMP_COMPAT_H

#ifdef _OPENMP
#include <omp.h>
static inline int fastln_openmp_enabled(void) { return 1; }
static inline int fastln_openmp_max_threads(void) { return omp_get_max_threads(); }
/* Sets the calling thread's default team size (what fastln_openmp_max_threads then returns). */
static inline void fastln_openmp_set_max_threads(int n) { omp_set_num_threads(n); }
#else
static inline int fastln_openmp_enabled(void) { return 0; }
static inline int fastln_openmp_max_threads(void) { return 1; }
static inline void fastln_openmp_set_max_threads(int n) { (void)n; }
#endif

#endif /* FASTLN_OPENMP_COMPAT_H */
