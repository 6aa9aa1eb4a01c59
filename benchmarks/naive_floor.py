"""How far below NumPy's naive LayerNorm a single pass over the same memory already is.

    python benchmarks/naive_floor.py                    # 64/512/4096x768, float32 and float64
    python benchmarks/naive_floor.py --shapes 512x768 --dtypes float32

For each case, on one thread and interleaved in rounds (medians of 9, with fastln.bench.timing's
calibrated samples and warm-ups), it times NumPy's naive forward and backward and fastln's, on the
inputs and as `fastln bench` prepares them (fastln.bench.ops), and the cheapest NumPy
call that moves the same memory: `np.copyto(y, x)` for the forward (read x, write y) and
`np.add(x, dy, out=dx)` for the backward (read x and dy, write dx), into a reused buffer (fastln
allocates its output, as in the default `fastln bench` run). A LayerNorm moves at least that
memory, so where such a pass alone takes about a tenth of the naive code's time, "10x NumPy
naive" is out of reach unless the LayerNorm moves memory faster than NumPy's own loops do
(fastln's forward sometimes does; its backward reads each row twice, once from the cache).

Like `fastln bench`, it first puts glibc's allocator in the state of a long-running process
(fastln.bench.timing.settle_allocator): otherwise every NumPy temporary of 128 KiB or more pays
a page fault per 4 KiB and the naive code runs about 2x slower, which would flatter fastln.
"""
import argparse

import numpy as np

from fastln.bench import timing
from fastln.bench.command import parse_shapes
from fastln.bench.ops import OPERATIONS

ROUNDS = 9


def one_pass(op, inputs):
    """The cheapest NumPy call that moves the memory `op` must move, into a reused buffer."""
    out = np.empty_like(inputs.x)
    if op == "forward":
        return lambda: np.copyto(out, inputs.x)
    return lambda: np.add(inputs.x, inputs.dy, out=out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default="64x768,512x768,4096x768")
    parser.add_argument("--dtypes", default="float32,float64")
    args = parser.parse_args()
    timing.settle_allocator()
    schedule = timing.Schedule()
    rng = np.random.default_rng(0)
    print(f"one thread; medians of {ROUNDS} interleaved rounds; times in microseconds")
    print(f"{'case':<28} {'naive':>9} {'naive/10':>9} {'one pass':>9} {'fastln':>9}"
          f" {'fastln vs naive':>16}")
    for dtype in args.dtypes.split(","):
        for shape in args.shapes:
            for op in ("forward", "backward"):
                # The implementations `fastln bench` times, prepared as it prepares them.
                operation = OPERATIONS[op]
                inputs = operation.make_inputs(shape, dtype, rng)
                calls = [operation.implementation(name).prepare(inputs, 1, False).call
                         for name in ("numpy-naive", "fastln")]
                calls.insert(1, one_pass(op, inputs))
                calls_per_sample, warmups = [], []
                for call in calls:
                    first = timing.time_calls(call, 1)
                    n_calls, seconds_per_call = timing.calibrate(call, first,
                                                                 schedule.min_sample_seconds)
                    calls_per_sample.append(n_calls)
                    warmups.append(schedule.warmup_for(seconds_per_call))
                samples = timing.interleaved_samples(
                    calls, calls_per_sample, ROUNDS, warmup=warmups,
                    warmup_min_calls=schedule.warmup_min_calls)
                naive, floor, fastln_time = (1e6 * timing.summarize(s)["median_s"]
                                             for s in samples)
                case = f"{op} {'x'.join(map(str, shape))} {dtype}"
                print(f"{case:<28} {naive:9.1f} {naive / 10:9.1f} {floor:9.1f}"
                      f" {fastln_time:9.1f} {naive / fastln_time:15.2f}x", flush=True)


if __name__ == "__main__":
    main()
