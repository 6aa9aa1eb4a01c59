/* fastln's worker threads: a call's parts are claimed, not assigned, so the calling thread never
 * waits for a worker that has not started.
 *
 * An OpenMP parallel region ends in a barrier that every thread of the team must reach: when
 * the workers have gone to sleep between calls (OMP_WAIT_POLICY=passive, or simply a pause in
 * the caller's work), the caller waits for each of them to wake, which on a virtual machine
 * costs more than a small call's whole work. Here the caller publishes the job, wakes the
 * sleeping workers it wants and starts on the parts itself; a worker that wakes takes the parts
 * still unclaimed, one at a time, and one that wakes after the last was claimed goes back to
 * sleep having done nothing. The caller waits only for parts a worker is already running, so a
 * threaded call costs at most the serial call plus the wake-up calls.
 *
 * Parts are fixed ranges of the call's tasks and every task writes only its own outputs, so who
 * runs which part changes no result. One job at a time: a call made while another thread's job
 * runs does its parts alone (same results). A forked child never gets here (fastln_thread_cap
 * is 1 there: the pool's threads do not exist in the child).
 *
 * Workers poll for a new job for a while before they sleep (fastln_pool_spin_ns; 0 with
 * OMP_WAIT_POLICY=passive), so that back-to-back calls find them awake. Included by
 * _kernels.pyx only: the pool is defined here, once. */
#ifndef FASTLN_POOL_H
#define FASTLN_POOL_H

#include <stdint.h>

#include "fastln/kernels.h"
#include "fastln/openmp_compat.h"

#if defined(_OPENMP) && defined(__unix__)
#define FASTLN_HAVE_POOL 1
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define fastln_pause() _mm_pause()
#else
#define fastln_pause() ((void)0)
#endif

/* The claim word: the job's generation (32 bits), its number of parts (16) and the next
 * unclaimed part (16). A worker claims a part with one compare-and-swap that also checks the
 * generation, so a worker still holding an old job cannot take a part of a new one; the job's
 * other fields are read only after a successful claim, when the job cannot end before the
 * claimed part does. */
#define FASTLN_POOL_MAX_PARTS 0xffff

typedef struct {
    pthread_mutex_t lock;    /* guards generation changes seen by sleepers, and the counts */
    pthread_cond_t wake;     /* sleeping workers wait here */
    pthread_cond_t finished; /* the caller waits here for parts workers still run */
    pthread_mutex_t busy;    /* held by the thread whose job runs */
    int n_workers, n_sleeping, caller_sleeping;
    long spin_ns;
    long last_end_ns; /* when the previous job ended */
    /* the job, valid while one of its parts is claimed and not done */
    fastln_task task;
    const void *call;
    int64_t n_tasks;
    _Atomic uint32_t generation;
    _Atomic uint64_t claim;
    _Atomic uint64_t tickets; /* generation << 32 | workers that may still join the job */
    _Atomic int64_t done;
} fastln_pool_state;

static fastln_pool_state fastln_pool = {
    PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
    PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, -1, 0, NULL, NULL, 0, 0, 0, 0, 0};

static inline uint64_t fastln_claim_word(uint32_t generation, uint64_t n_parts, uint64_t next)
{
    return (uint64_t)generation << 32 | n_parts << 16 | next;
}

static inline long fastln_now_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long)now.tv_sec * 1000000000L + now.tv_nsec;
}

/* How long an idle worker polls before it sleeps: 0 under OMP_WAIT_POLICY=passive (the
 * user asked for idle threads that cost nothing), 100 us otherwise (longer than the gap between
 * back-to-back calls, far shorter than OpenMP's default spin). Read once. */
static long fastln_pool_spin_ns(void)
{
    if (fastln_pool.spin_ns < 0) {
        const char *policy = getenv("OMP_WAIT_POLICY");
        fastln_pool.spin_ns = policy && strcasecmp(policy, "passive") == 0 ? 0 : 100000;
    }
    return fastln_pool.spin_ns;
}

/* Claim and run parts of job `generation` until none is left. */
static void fastln_pool_work(uint32_t generation)
{
    for (;;) {
        uint64_t word = atomic_load_explicit(&fastln_pool.claim, memory_order_acquire);
        const uint64_t n_parts = word >> 16 & 0xffff, part = word & 0xffff;
        if ((uint32_t)(word >> 32) != generation || part >= n_parts) return;
        if (!atomic_compare_exchange_weak_explicit(&fastln_pool.claim, &word, word + 1,
                                                   memory_order_acq_rel, memory_order_relaxed))
            continue;
        const int64_t n_tasks = fastln_pool.n_tasks;
        fastln_pool.task(fastln_pool.call, (int64_t)part * n_tasks / (int64_t)n_parts,
                         (int64_t)(part + 1) * n_tasks / (int64_t)n_parts);
        if (atomic_fetch_add_explicit(&fastln_pool.done, 1, memory_order_acq_rel) + 1
                == (int64_t)n_parts) {
            pthread_mutex_lock(&fastln_pool.lock);
            if (fastln_pool.caller_sleeping) pthread_cond_signal(&fastln_pool.finished);
            pthread_mutex_unlock(&fastln_pool.lock);
        }
    }
}

/* Whether a worker may join job `generation`: at most num_threads - 1 do, also when more are
 * awake (an earlier call may have started more). */
static int fastln_pool_ticket(uint32_t generation)
{
    uint64_t word = atomic_load_explicit(&fastln_pool.tickets, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(word >> 32) != generation || (word & 0xffffffffu) == 0) return 0;
        if (atomic_compare_exchange_weak_explicit(&fastln_pool.tickets, &word, word - 1,
                                                  memory_order_acq_rel, memory_order_acquire))
            return 1;
    }
}

static void *fastln_pool_worker(void *start)
{
    uint32_t seen = (uint32_t)(uintptr_t)start; /* the job it was started for */
    if (fastln_pool_ticket(seen)) fastln_pool_work(seen);
    for (;;) {
        uint32_t generation;
        const long spin = fastln_pool_spin_ns();
        const long until = spin > 0 ? fastln_now_ns() + spin : 0;
        for (int polls = 1;; polls++) {
            generation = atomic_load_explicit(&fastln_pool.generation, memory_order_acquire);
            if (generation != seen || spin == 0) break;
            fastln_pause();
            if (polls % 64 == 0 && fastln_now_ns() > until) break;
        }
        if (generation == seen) {
            pthread_mutex_lock(&fastln_pool.lock);
            fastln_pool.n_sleeping++;
            while ((generation = atomic_load(&fastln_pool.generation)) == seen)
                pthread_cond_wait(&fastln_pool.wake, &fastln_pool.lock);
            fastln_pool.n_sleeping--;
            pthread_mutex_unlock(&fastln_pool.lock);
        }
        seen = generation;
        if (fastln_pool_ticket(seen)) fastln_pool_work(seen);
    }
    return NULL;
}

/* A job below FASTLN_POOL_WAKE_ELEMENTS elements wakes sleeping workers only when it follows
 * the previous threaded job within FASTLN_POOL_RECENT_NS: on a virtual machine a wake-up (a
 * futex call and the other vCPU's return from idle) costs tens of microseconds and can put the
 * woken thread on the caller's own vCPU for a while, which made an isolated small call slower
 * than a serial one (docs/performance.md); in a run of calls the woken workers then stay awake
 * (polling) for the next ones. Under OMP_WAIT_POLICY=passive they do not poll, so every small
 * job would pay the wake-up again: there small jobs never wake anyone. Workers still polling
 * join any job. */
#define FASTLN_POOL_WAKE_ELEMENTS (1 << 20)
#define FASTLN_POOL_RECENT_NS 1000000L
#define FASTLN_POOL_LATE_PARTS 8

/* Tasks [0, n_tasks) of `call` (n_elements in all) in n_parts parts (2 ..
 * FASTLN_POOL_MAX_PARTS; more when a helper has to be woken, below), with up to n_threads - 1
 * workers helping the calling thread. */
static void fastln_pool_run(fastln_task task, const void *call, int64_t n_tasks, int64_t n_parts,
                            int64_t n_elements, int n_threads)
{
    if (pthread_mutex_trylock(&fastln_pool.busy) != 0) { /* another thread's job runs */
        task(call, 0, n_tasks);
        return;
    }
    if (n_parts > FASTLN_POOL_MAX_PARTS) n_parts = FASTLN_POOL_MAX_PARTS;
    (void)fastln_pool_spin_ns(); /* read once here, before any worker can read it */
    const int helpers = n_threads - 1 < n_parts - 1 ? n_threads - 1 : (int)n_parts - 1;
    fastln_pool.task = task;
    fastln_pool.call = call;
    fastln_pool.n_tasks = n_tasks;
    atomic_store_explicit(&fastln_pool.done, 0, memory_order_relaxed);
    const uint32_t generation =
        atomic_load_explicit(&fastln_pool.generation, memory_order_relaxed) + 1;
    pthread_mutex_lock(&fastln_pool.lock);
    /* Wake as many sleepers as this job wants helpers (large jobs only), start more workers
     * if there are too few (a worker that cannot be started is no loss: the caller takes its
     * parts). */
    int to_wake = fastln_pool.n_sleeping < helpers ? fastln_pool.n_sleeping : helpers;
    if (n_elements < FASTLN_POOL_WAKE_ELEMENTS
        && (fastln_pool_spin_ns() == 0
            || fastln_now_ns() - fastln_pool.last_end_ns > FASTLN_POOL_RECENT_NS))
        to_wake = 0;
    /* A helper that has to be woken or started begins late, and once it has claimed a part
     * the caller waits for that part: the job then goes in FASTLN_POOL_LATE_PARTS times as
     * many parts, so that the caller does what the late helper has not reached and waits at
     * most for one small part. */
    if (to_wake > 0 || fastln_pool.n_workers < helpers)
        n_parts = fastln_min(fastln_min(n_parts * FASTLN_POOL_LATE_PARTS, n_tasks),
                             FASTLN_POOL_MAX_PARTS);
    atomic_store_explicit(&fastln_pool.tickets, (uint64_t)generation << 32 | (uint64_t)helpers,
                          memory_order_relaxed);
    atomic_store_explicit(&fastln_pool.claim, fastln_claim_word(generation, (uint64_t)n_parts, 0),
                          memory_order_release);
    atomic_store_explicit(&fastln_pool.generation, generation, memory_order_release);
    for (int i = 0; i < to_wake; i++) pthread_cond_signal(&fastln_pool.wake);
    if (fastln_pool.n_workers < helpers) {
        /* Workers block every signal (they inherit the mask), so that signals such as SIGINT
         * reach the threads that run Python, as they would without fastln. */
        sigset_t all, previous;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &previous);
        while (fastln_pool.n_workers < helpers) {
            pthread_t thread;
            pthread_attr_t attributes;
            pthread_attr_init(&attributes);
            pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
            const int failed = pthread_create(&thread, &attributes, fastln_pool_worker,
                                              (void *)(uintptr_t)generation);
            pthread_attr_destroy(&attributes);
            if (failed) break;
            fastln_pool.n_workers++;
        }
        pthread_sigmask(SIG_SETMASK, &previous, NULL);
    }
    pthread_mutex_unlock(&fastln_pool.lock);
    fastln_pool_work(generation);
    /* Every part is claimed: wait for those workers still run, polling as long as an idle
     * worker does before sleeping (a sleeper's wake-up can cost tens of microseconds). */
    const long spin = fastln_pool_spin_ns();
    const long until = spin > 0 ? fastln_now_ns() + spin : 0;
    for (int polls = 1; atomic_load_explicit(&fastln_pool.done, memory_order_acquire) < n_parts;
         polls++) {
        if (spin > 0 && (polls % 64 != 0 || fastln_now_ns() < until)) {
            fastln_pause();
            continue;
        }
        pthread_mutex_lock(&fastln_pool.lock);
        fastln_pool.caller_sleeping = 1;
        while (atomic_load_explicit(&fastln_pool.done, memory_order_acquire) < n_parts)
            pthread_cond_wait(&fastln_pool.finished, &fastln_pool.lock);
        fastln_pool.caller_sleeping = 0;
        pthread_mutex_unlock(&fastln_pool.lock);
    }
    fastln_pool.last_end_ns = fastln_now_ns();
    pthread_mutex_unlock(&fastln_pool.busy);
}

#else
#define FASTLN_HAVE_POOL 0
static inline void fastln_pool_run(fastln_task task, const void *call, int64_t n_tasks,
                                   int64_t n_parts, int64_t n_elements, int n_threads)
{
    (void)n_parts;
    (void)n_elements;
    (void)n_threads;
    task(call, 0, n_tasks);
}
#endif

#endif /* FASTLN_POOL_H */
