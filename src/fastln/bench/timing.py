"""How calls are timed: calibrated samples, interleaved rounds, medians with their spread.

A sample is the mean time of `calls_per_sample` back-to-back calls, with that count chosen so a
sample lasts at least `min_sample_seconds`: a 2 us call cannot be timed alone, a thousand of them
can. Implementations are then measured in rounds, each round taking one sample of every
implementation (A B C, then B C A, ...): a burst of noise on a shared machine hits every
implementation of the round instead of one of them, and the per-round ratios to fastln pair
samples taken moments apart.

Before each sample the implementation runs untimed for a millisecond (its warm-up). Thread pools
spin for a while after a call and then sleep (the bench bounds that spin, see
fastln.bench.command): the warm-up outlasts the spin of the previous implementation's workers,
so they no longer compete for the cores, and wakes this implementation's own, so that the sample
times calls back to back, as a program calling it in a loop would see them.
"""
import gc
import math
import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np


# glibc hands out blocks above its mmap threshold (128 KiB in a fresh process) as fresh mmap'd
# pages, one page fault per 4 KiB when first written, and unmaps them on free; once it has freed
# such a block it raises the threshold to that size (up to 32 MiB), and blocks below it come from
# its heap, already mapped. A long-running program is in that second state; a fresh one is not,
# and there every NumPy temporary of 128 KiB or more pays its page faults on every call (the
# naive backward at 64x768 float32: 375 us instead of 179 us on the development machine).
SETTLE_ALLOCATOR_BYTES = 30 << 20


def settle_allocator():
    """Puts the allocator in its long-running state before anything is timed (see above), so
    that a case's figures do not depend on which cases ran before it. Harmless elsewhere."""
    np.ones(SETTLE_ALLOCATOR_BYTES // 8)  # written, then freed at once


@dataclass
class Schedule:
    """How long samples last and how many rounds a case gets.

    A case gets as many rounds as fit in `case_budget_seconds`, between `min_rounds` and
    `max_rounds`; a case whose round takes longer than `slow_round_seconds` (the largest arrays,
    where NumPy alone takes a second) makes do with `slow_min_rounds`, so that the default run
    stays near two minutes. `fixed_rounds` (--repeat) overrides all of it.

    Each sample follows `warmup_seconds` of untimed calls, and at least `warmup_min_calls` of
    them, except for calls longer than `warmup_max_call_seconds`: waking a pool or sharing a core
    with another pool's last half-millisecond of spinning is then under 2% of one call, and extra
    calls would make the largest cases last twice as long. The calls, not only the time, matter
    where the implementation before left the cache full of its own dirty data: after NumPy's
    naive backward at 4096x768 float32, fastln's next calls took 3.7, 3.4, 2.8, 2.3, then 2.0 ms
    (the write-backs of NumPy's temporaries), and one 1 ms warm-up call left most of that in the
    sample of whichever implementation followed NumPy.
    """

    min_sample_seconds: float = 0.002
    warmup_seconds: float = 0.001
    warmup_min_calls: int = 3
    warmup_max_call_seconds: float = 0.02
    min_rounds: int = 5
    max_rounds: int = 25
    case_budget_seconds: float = 0.6
    slow_round_seconds: float = 1.0
    slow_min_rounds: int = 3
    fixed_rounds: Optional[int] = None

    def rounds_for(self, round_seconds):
        if self.fixed_rounds is not None:
            return self.fixed_rounds
        slow = round_seconds > self.slow_round_seconds
        fewest = self.slow_min_rounds if slow else self.min_rounds
        affordable = math.floor(self.case_budget_seconds / max(round_seconds, 1e-9) + 1e-9)
        return max(fewest, min(self.max_rounds, affordable))

    def warmup_for(self, seconds_per_call):
        """Seconds of untimed calls before each sample of a call that takes seconds_per_call."""
        return 0.0 if seconds_per_call > self.warmup_max_call_seconds else self.warmup_seconds


def time_calls(call, n_calls):
    """Seconds per call, averaged over n_calls back-to-back calls."""
    start = time.perf_counter()
    for _ in range(n_calls):
        call()
    return (time.perf_counter() - start) / n_calls


def calibrate(call, first_call_seconds, min_sample_seconds):
    """(calls_per_sample, seconds per call) so that one sample lasts >= min_sample_seconds.

    `first_call_seconds` is the warm-up call's time: a call that long already makes a sample.
    Shorter calls are repeated 1, 2, 5, 10, 20, ... times until a batch lasts a tenth of a
    sample (timeit's autorange), then scaled up.
    """
    if first_call_seconds >= min_sample_seconds:
        return 1, first_call_seconds
    n_calls = 1
    while True:
        seconds_per_call = time_calls(call, n_calls)
        if seconds_per_call * n_calls >= min_sample_seconds / 10:
            break
        n_calls = n_calls * 5 // 2 if str(n_calls)[0] == "2" else n_calls * 2  # 1 2 5 10 20 50
    return max(1, math.ceil(min_sample_seconds / max(seconds_per_call, 1e-9))), seconds_per_call


def warm_up(call, seconds, min_calls=1):
    """Run call untimed for at least `seconds` and at least `min_calls` times (nothing when
    seconds <= 0)."""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    for _ in range(max(min_calls, 1)):
        call()
    while time.perf_counter() < end:
        call()


def interleaved_samples(calls, calls_per_sample, rounds, before_sample=None, warmup=None,
                        warmup_min_calls=1):
    """samples[i][r]: seconds per call of calls[i] in round r; round r starts at call r % n.

    before_sample[i], if not None, runs untimed before each sample of calls[i], and then calls[i]
    itself for warmup[i] seconds and at least warmup_min_calls times (see warm_up). The garbage
    collector is paused while timing, as timeit does: a collection would land on whichever
    implementation happened to be running.
    """
    n = len(calls)
    before_sample = before_sample or [None] * n
    warmup = warmup or [0.0] * n
    samples: List[List[float]] = [[] for _ in range(n)]
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for round_index in range(rounds):
            for offset in range(n):
                i = (round_index + offset) % n
                if before_sample[i] is not None:
                    before_sample[i]()
                warm_up(calls[i], warmup[i], warmup_min_calls)
                samples[i].append(time_calls(calls[i], calls_per_sample[i]))
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def summarize(samples):
    """Median, quartiles, min and max of a list of seconds."""
    values = np.asarray(samples, dtype=np.float64)
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return {"median_s": float(median), "q1_s": float(q1), "q3_s": float(q3),
            "min_s": float(values.min()), "max_s": float(values.max())}


def paired_ratio(samples, reference_samples):
    """Median over rounds of samples[r] / reference_samples[r] (same round, moments apart)."""
    ratios = np.asarray(samples, dtype=np.float64) / np.asarray(reference_samples, np.float64)
    return float(np.median(ratios))
