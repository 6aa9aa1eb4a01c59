/* The only place fastln touches the OpenMP runtime, so that the package also builds without it. */
#ifndef FASTLN_OPENMP_COMPAT_H
#define FASTLN_OPENMP_COMPAT_H

#ifdef _OPENMP
#include <omp.h>
static inline int fastln_openmp_enabled(void) { return 1; }
static inline int fastln_openmp_num_procs(void) { return omp_get_num_procs(); }
#else
static inline int fastln_openmp_enabled(void) { return 0; }
static inline int fastln_openmp_num_procs(void) { return 1; }
#endif

/* Thread pools do not survive fork(): GNU OpenMP's hangs in a forked child of a process that
 * already used it (the pytorch issue 19163), and fastln's own workers (fastln/pool.h) do not
 * exist in the child. Like PyTorch, fastln runs every call of a forked child on the calling
 * thread; spawned children are not affected. The flag is
 * global state in fastln's C code with the thread cap below, set once by
 * fastln_watch_for_fork() at import. */
#if defined(_OPENMP) && defined(__unix__)
#include <pthread.h>
static int fastln_in_forked_child = 0;
static void fastln_mark_forked_child(void) { fastln_in_forked_child = 1; }
static inline void fastln_watch_for_fork(void)
{
    pthread_atfork(NULL, NULL, fastln_mark_forked_child);
}
#else
static const int fastln_in_forked_child = 0;
static inline void fastln_watch_for_fork(void) {}
#endif

/* The most threads a call will start: more than a few per processor only wastes memory, and
 * asking OpenMP for a team of 10^5 threads can exhaust the process (results are the same for
 * every count, so capping changes nothing but the cost). 1 in a forked child (see above). */
static int fastln_thread_cap_value = 0; /* once: omp_get_num_procs() asks the kernel each time */
static inline int fastln_thread_cap(void)
{
    if (fastln_in_forked_child) return 1;
    if (fastln_thread_cap_value == 0) {
        const int cap = 4 * fastln_openmp_num_procs();
        fastln_thread_cap_value = cap > 64 ? cap : 64; /* every thread writes the same value */
    }
    return fastln_thread_cap_value;
}

#endif /* FASTLN_OPENMP_COMPAT_H */
