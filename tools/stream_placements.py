"""Streamed outputs at different places in their pages: the time of one streamed call with its
output starting at several page offsets after its input's (docs/performance.md, "Streamed
outputs just after their inputs"), this build and, when installed, another (fastln_previous,
from tools/build_previous.sh REV). One thread, `out=`, float32: LayerNorm forward at 4096x4096
(y of 64 MiB) and BatchNorm evaluation at 4096x768 (x of 12 MiB), the input 16 bytes into its
page as NumPy's large arrays are. Each sample is a warm-up call then 3 timed ones; 11 rounds,
medians.

    python tools/stream_placements.py [OFFSETS]   # OFFSETS like 0,16,48,112,512,2048 (bytes)

Placements inside fastln_streams_apart's window (1 to 640 bytes after the input) are written
with ordinary stores, the rest streamed (the previous build, before 225481b, streamed them all):
where the previous build is no slower inside the window than outside, this CPU does not need it.
"""
import statistics
import sys
import time

import numpy as np

import fastln

try:
    import fastln_previous
except ImportError:  # tools/build_previous.sh REV installs it
    fastln_previous = None

ROUNDS = 11
CALLS = 3
PAGE = 4096
INPUT_OFFSET = 16  # where NumPy's large arrays start in their first page
OFFSETS = [0, 16, 48, 112, 256, 512, 1024, 2048]


def placed(shape, dtype, page_offset):
    """An array of `shape` whose data starts `page_offset` bytes into a page."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 2 * PAGE, np.uint8)
    start = (page_offset - raw.ctypes.data) % PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def cases(rng):
    """(name, input, run(module, out)) for each timed operation."""
    x = placed((4096, 4096), np.float32, INPUT_OFFSET)
    x[...] = rng.standard_normal(x.shape)
    gamma, beta = np.ones(4096, np.float32), np.zeros(4096, np.float32)
    yield ("layer_norm 4096x4096", x,
           lambda module, out: module.layer_norm(x, gamma, beta, out=out, num_threads=1))
    xb = placed((4096, 768), np.float32, INPUT_OFFSET)
    xb[...] = rng.standard_normal(xb.shape)
    ones, zeros = np.ones(768, np.float32), np.zeros(768, np.float32)
    yield ("batch_norm eval 4096x768", xb,
           lambda module, out: module.batch_norm(xb, ones, zeros, zeros, ones, training=False,
                                                 out=out, num_threads=1))


def median_time(call, out):
    samples = []
    for _ in range(ROUNDS):
        call(out)
        start = time.perf_counter()
        for _ in range(CALLS):
            call(out)
        samples.append((time.perf_counter() - start) / CALLS)
    return statistics.median(samples)


def main(offsets):
    builds = [fastln] + ([fastln_previous] if fastln_previous else [])
    print("case | output bytes after the input's page offset | " +
          " ".join(f"{build.__name__}_ms" for build in builds))
    for name, x, run in cases(np.random.default_rng(0)):
        for after in offsets:
            out = placed(x.shape, x.dtype, (INPUT_OFFSET + after) % PAGE)
            times = [median_time(lambda o, b=build: run(b, o), out) * 1e3 for build in builds]
            print(f"{name} | {after:5d} | " + " ".join(f"{t:8.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main([int(o) for o in sys.argv[1].split(",")] if len(sys.argv) > 1 else OFFSETS)
