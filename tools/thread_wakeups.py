"""Threaded calls against serial ones, this build (fastln) against another (fastln_previous, from
tools/build_previous.sh REV), in one process, interleaved: float32 layer_norm forward and
backward with out=, 1 and 2 threads, 15 rounds, medians.

    python tools/thread_wakeups.py loop   [SHAPES]   # back to back: each sample a batch of calls
    python tools/thread_wakeups.py spaced [SHAPES]   # one call per sample, after a 5 ms sleep

SHAPES like 64x768,512x768 (default: the bench's seven). Prints per shape, op and thread count
the two builds' medians and their ratio, and for 2 threads each build's 2-thread / 1-thread
ratio (below 1: the threads pay)."""
import sys, time, statistics, numpy as np
import fastln, fastln_previous as prev  # tools/build_previous.sh REV installs it
mode = sys.argv[1]  # "loop" or "spaced"
gap = 0.005  # long enough for idle workers to go to sleep
shapes = [(1, 768), (8, 768), (64, 768), (512, 768), (4096, 768), (4096, 4096), (32768, 1024)]
if len(sys.argv) > 2: shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]
rng = np.random.default_rng(0)
print(f"{mode}: shape op threads | pool_us prev_us pool/prev | 2T/1T pool prev")
for shape in shapes:
    x = rng.standard_normal(shape).astype(np.float32); dy = rng.standard_normal(shape).astype(np.float32)
    out = np.empty_like(x)
    caches = {m: m.layer_norm_forward(x)[1] for m in (fastln, prev)}
    for op in ("fwd", "bwd"):
        def call(m, t):
            if op == "fwd": m.layer_norm(x, out=out, num_threads=t)
            else: m.layer_norm_backward(dy, caches[m], out=out, num_threads=t)
        t0 = time.perf_counter(); call(fastln, 1); single = time.perf_counter() - t0
        batch = max(1, int(0.002 / max(single, 1e-7))) if mode == "loop" else 1
        med = {}
        samples = {(m, t): [] for m in (fastln, prev) for t in (1, 2)}
        for r in range(15):
            for m in (fastln, prev):
                for t in (1, 2):
                    if mode == "spaced": time.sleep(gap)
                    else:
                        for _ in range(3): call(m, t)
                    t0 = time.perf_counter()
                    for _ in range(batch): call(m, t)
                    samples[(m, t)].append((time.perf_counter() - t0) / batch)
        med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
        for t in (1, 2):
            a, b = med[(fastln, t)], med[(prev, t)]
            extra = f"| {med[(fastln,2)]/med[(fastln,1)]:.2f} {med[(prev,2)]/med[(prev,1)]:.2f}" if t == 2 else ""
            print(f"{shape[0]}x{shape[1]} {op} {t} | {a:9.1f} {b:9.1f} {a/b:5.2f} {extra}", flush=True)
