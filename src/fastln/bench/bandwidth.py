"""This machine's memory bandwidth, measured with fastln's own streaming copy.

LayerNorm reads each element once and writes it once, so the best it can do on data larger than
the caches is the speed of a copy. The copy (_copy.h beside this file, threaded in
fastln.bench._bandwidth) runs over a source and a destination each twice the last-level cache, so that
neither can be served from cache, with the same thread counts as the benchmark.

Bandwidth is counted as the bytes read plus the bytes written per second (2 x buffer / time), the
same way the benchmark counts LayerNorm's traffic. Two store kinds are measured:
    ordinary     the stores LayerNorm kernels make; the reference for "% of copy"
    nontemporal  cache-bypassing stores, the machine's best case for writing
"""
import time

import numpy as np

from fastln.bench import _bandwidth
from fastln.bench.machine import usable_cpus

MIB = 1 << 20
MIN_BUFFER_BYTES = 128 * MIB      # per array
UNKNOWN_CACHE_BYTES = 128 * MIB   # assumed when sysfs does not say: a big server cache
CHUNK_BYTES = 1 * MIB             # a thread's unit of work: large enough to stream


def copy_buffer_bytes(last_level_cache_bytes, available_memory_bytes=None):
    """Size of the source (and of the destination): twice the last-level cache, at least 128 MiB.

    Source and destination together are then at least four times the cache. Capped at an eighth
    of the available memory each, so the measurement never pushes the machine into swap.
    """
    cache = last_level_cache_bytes or UNKNOWN_CACHE_BYTES
    size = max(MIN_BUFFER_BYTES, 2 * cache)
    if available_memory_bytes:
        size = min(size, available_memory_bytes // 8)
    return max(size // MIB, 1) * MIB


def measure_copy_bandwidth(thread_counts, buffer_bytes, repeats=5, nontemporal=None):
    """Median copy bandwidth per thread count and store kind.

    Returns a list of dicts: threads, stores ("ordinary" or "nontemporal"), bytes_per_second
    (median), best_bytes_per_second, samples_s (each copy's seconds), buffer_bytes.
    The store kinds alternate within each repeat so that both see the same machine state.
    """
    if nontemporal is None:
        nontemporal = _bandwidth.nontemporal_available()
    store_kinds = ("ordinary", "nontemporal") if nontemporal else ("ordinary",)
    n_elements = buffer_bytes // 8
    source = np.empty(n_elements, np.float64)
    destination = np.empty(n_elements, np.float64)
    # Touch every page of the source: untouched pages all map to the kernel's zero page, which
    # reads from cache and would report an impossible bandwidth.
    source.fill(1.0)
    chunk_elements = CHUNK_BYTES // 8
    n_chunks = -(-n_elements // chunk_elements)
    results = []
    try:
        for threads in thread_counts:
            # Never more threads than CPUs or chunks: a team of --threads 100000 would only
            # exhaust the process, and built without OpenMP the copy runs on one thread.
            threads_used = (max(1, min(threads, usable_cpus(), n_chunks))
                            if _bandwidth.openmp_enabled() else 1)
            samples = {kind: [] for kind in store_kinds}
            for repeat in range(repeats + 1):  # the first round warms up (and faults in pages)
                for kind in store_kinds:
                    start = time.perf_counter()
                    _bandwidth.stream_copy(source, destination, chunk_elements, threads_used,
                                           kind == "nontemporal")
                    elapsed = time.perf_counter() - start
                    if repeat > 0:
                        samples[kind].append(elapsed)
            for kind in store_kinds:
                traffic = 2 * source.nbytes
                results.append({
                    "threads": threads,
                    "threads_used": threads_used,
                    "stores": kind,
                    "bytes_per_second": traffic / float(np.median(samples[kind])),
                    "best_bytes_per_second": traffic / min(samples[kind]),
                    "samples_s": samples[kind],
                    "buffer_bytes": source.nbytes,
                })
    finally:
        del source, destination
    return results


def copy_bandwidth_for(results, threads, stores="ordinary"):
    """The median bytes/s of `results` for one thread count and store kind (None if absent)."""
    for result in results:
        if result["threads"] == threads and result["stores"] == stores:
            return result["bytes_per_second"]
    return None
