/* fastln's default team size, what a call with num_threads=None uses. It is fastln's own
 * setting, not OpenMP's nthreads-var: PyTorch and fastln often share one OpenMP runtime, and
 * limiting one of them must not silently limit the other. Like nthreads-var it belongs to the
 * thread that sets it; a thread that never did has the initial value (OMP_NUM_THREADS's first
 * entry, or the processors), which fastln._threads computes once at import.
 *
 * The pair of functions below is exported from the extension for threadpoolctl, whose
 * controller for fastln (fastln._threads) finds them by name in the loaded library. Included by
 * _kernels.pyx only: the functions are defined here, once. */
#ifndef FASTLN_THREADS_H
#define FASTLN_THREADS_H

#include "fastln/openmp_compat.h"

static int fastln_initial_threads = 1;
static _Thread_local int fastln_thread_setting = 0; /* 0: never set on this thread */

static inline void fastln_set_initial_threads(int n) { fastln_initial_threads = n > 0 ? n : 1; }

/* 1 without OpenMP: every call runs on the calling thread. */
__attribute__((visibility("default"))) int fastln_get_num_threads(void)
{
    if (!fastln_openmp_enabled()) return 1;
    return fastln_thread_setting > 0 ? fastln_thread_setting : fastln_initial_threads;
}

__attribute__((visibility("default"))) void fastln_set_num_threads(int n)
{
    if (n > 0) fastln_thread_setting = n;
}

#endif /* FASTLN_THREADS_H */
