"""Threaded calls against serial ones, this build (fastln) against another (fastln_previous, from
tools/build_previous.sh REV), in one process, interleaved: float32 layer_norm forward and
backward with out=, 1 and 2 threads, 15 rounds, medians.

    python tools/thread_wakeups.py loop   [SHAPES]   # back to back: each sample a batch of calls
    python tools/thread_wakeups.py spaced [SHAPES]   # one call per sample, after a 5 ms sleep

SHAPES like 64x768,512x768 (default: the bench's seven). Prints per shape, op and thread count
the two builds' medians and their ratio, and for 2 threads each build's 2-thread / 1-thread
ratio (below 1: the threads pay).
"""
import statistics
import sys
import time

import numpy as np

import fastln
import fastln_previous  # tools/build_previous.sh REV installs it

PAUSE_S = 0.005  # long enough for idle workers to go to sleep
ROUNDS = 15
SHAPES = [(1, 768), (8, 768), (64, 768), (512, 768), (4096, 768), (4096, 4096), (32768, 1024)]
BUILDS = (fastln, fastln_previous)


def main(mode, shapes):
    rng = np.random.default_rng(0)
    print(f"{mode}: shape op threads | this_us previous_us this/previous | 2T/1T this previous")
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32)
        dy = rng.standard_normal(shape).astype(np.float32)
        out = np.empty_like(x)
        caches = {build: build.layer_norm_forward(x)[1] for build in BUILDS}
        for op in ("fwd", "bwd"):
            def call(build, threads, op=op):
                if op == "fwd":
                    build.layer_norm(x, out=out, num_threads=threads)
                else:
                    build.layer_norm_backward(dy, caches[build], out=out, num_threads=threads)

            start = time.perf_counter()
            call(fastln, 1)
            single = time.perf_counter() - start
            batch = max(1, int(0.002 / max(single, 1e-7))) if mode == "loop" else 1
            samples = {(build, t): [] for build in BUILDS for t in (1, 2)}
            for _ in range(ROUNDS):
                for key in samples:
                    if mode == "spaced":
                        time.sleep(PAUSE_S)
                    else:
                        for _ in range(3):  # warm: workers awake, caches filled
                            call(*key)
                    start = time.perf_counter()
                    for _ in range(batch):
                        call(*key)
                    samples[key].append((time.perf_counter() - start) / batch)
            median = {key: statistics.median(v) * 1e6 for key, v in samples.items()}
            for t in (1, 2):
                this, previous = median[(fastln, t)], median[(fastln_previous, t)]
                line = f"{shape[0]}x{shape[1]} {op} {t} | {this:9.1f} {previous:9.1f} " \
                       f"{this / previous:5.2f}"
                if t == 2:
                    line += (f" | {median[(fastln, 2)] / median[(fastln, 1)]:.2f}"
                             f" {median[(fastln_previous, 2)] / median[(fastln_previous, 1)]:.2f}")
                print(line, flush=True)


if __name__ == "__main__":
    chosen = SHAPES
    if len(sys.argv) > 2:
        chosen = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]
    main(sys.argv[1], chosen)
