"""How far below NumPy's naive LayerNorm a single pass over the same memory already is.

    python benchmarks/naive_floor.py                    # 64/512/4096x768, float32 and float64
    python benchmarks/naive_floor.py --shapes 512x768 --dtypes float32

For each case, on one thread and interleaved in rounds (medians of 9), it times NumPy's naive
forward and backward (the `fastln bench` baselines, fastln.bench.ops.layer_norm), fastln's, and
the cheapest NumPy call that moves the same memory: `np.copyto(y, x)` for the forward (read x,
write y) and `np.add(x, dy, out=dx)` for the backward (read x and dy, write dx), into a reused
buffer (fastln allocates its output, as in the default `fastln bench` run). A LayerNorm moves at
least that memory, so where such a pass alone takes about a tenth of the naive code's time, "10x
NumPy naive" is out of reach unless the LayerNorm moves memory faster than NumPy's own loops do
(fastln's forward sometimes does; its backward reads each row twice, once from the cache).

Like `fastln bench`, it first puts glibc's allocator in the state of a long-running process
(fastln.bench.timing.settle_allocator): otherwise every NumPy temporary of 128 KiB or more pays
a page fault per 4 KiB and the naive code runs about 2x slower, which would flatter fastln.
"""
import argparse
import time

import numpy as np

import fastln
from fastln.bench.ops.layer_norm import (EPS, _numpy_statistics, numpy_naive_backward,
                                         numpy_naive_forward)
from fastln.bench.timing import settle_allocator

ROUNDS = 9


def seconds_per_call(f, min_seconds=0.002):
    """Calls f in batches that double until one takes min_seconds; seconds per call."""
    f()
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            f()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls
        calls *= 2


def measure(implementations):
    """Median seconds per call of each implementation, over ROUNDS interleaved rounds."""
    samples = {name: [] for name in implementations}
    for _ in range(ROUNDS):
        for name, f in implementations.items():
            samples[name].append(seconds_per_call(f))
    return {name: float(np.median(times)) for name, times in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x768,512x768,4096x768")
    parser.add_argument("--dtypes", default="float32,float64")
    args = parser.parse_args()
    settle_allocator()
    rng = np.random.default_rng(0)
    print("one thread; medians of %d interleaved rounds; times in microseconds" % ROUNDS)
    print(f"{'case':<28} {'naive':>9} {'naive/10':>9} {'one pass':>9} {'fastln':>9}"
          f" {'fastln vs naive':>16}")
    for dtype in args.dtypes.split(","):
        for shape_text in args.shapes.split(","):
            shape = tuple(int(n) for n in shape_text.split("x"))
            x = rng.standard_normal(shape).astype(dtype)
            dy = rng.standard_normal(shape).astype(dtype)
            gamma = rng.standard_normal(shape[-1]).astype(dtype)
            beta = rng.standard_normal(shape[-1]).astype(dtype)
            out = np.empty_like(x)
            _, cache = fastln.layer_norm_forward(x, gamma, beta)
            mean, rstd = _numpy_statistics(x)
            cases = {
                "forward": {
                    "naive": lambda: numpy_naive_forward(x, gamma, beta, EPS),
                    "one pass": lambda: np.copyto(out, x),
                    "fastln": lambda: fastln.layer_norm(x, gamma, beta, num_threads=1),
                },
                "backward": {
                    "naive": lambda: numpy_naive_backward(dy, x, mean, rstd, gamma),
                    "one pass": lambda: np.add(x, dy, out=out),
                    "fastln": lambda: fastln.layer_norm_backward(dy, cache, gamma,
                                                                 num_threads=1),
                },
            }
            for op, implementations in cases.items():
                t = {name: 1e6 * s for name, s in measure(implementations).items()}
                print(f"{op + ' ' + shape_text + ' ' + dtype:<28} {t['naive']:9.1f}"
                      f" {t['naive'] / 10:9.1f} {t['one pass']:9.1f} {t['fastln']:9.1f}"
                      f" {t['naive'] / t['fastln']:15.2f}x", flush=True)


if __name__ == "__main__":
    main()
