"""How calls are timed: calibrated samples, interleaved rounds, medians with their spread.

A sample is the mean time of `calls_per_sample` back-to-back calls, with that count chosen so a
sample lasts at least `min_sample_seconds`: a 2 us call cannot be timed alone, a thousand of them
can. Implementations are then measured in rounds, each round taking one sample of every
implementation (A B C, then B C A, ...): a burst of noise on a shared machine hits every
implementation of the round instead of one of them, and the per-round ratios to fastln pair
samples taken moments apart.

Thread pools keep their idle workers spinning for a while after a call, then put them to sleep:
libgomp's (fastln's, and the copy PyTorch ships) for milliseconds with its default policy
(docs/performance.md has the figure). Before each sample the runner waits until no other thread of this
process is running (wait_for_idle_threads), so that the previous implementation's spinning
workers do not take the cores this one needs; then the implementation runs untimed for a
millisecond and at least three calls (its warm-up), which wakes its own workers, so that the
sample times calls back to back, as a program calling it in a loop would see them.
"""
import gc
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np


# glibc hands out blocks above its mmap threshold (128 KiB in a fresh process) as fresh mmap'd
# pages, one page fault per 4 KiB when first written, and unmaps them on free; once it has freed
# such a block it raises the threshold to that size (up to 32 MiB), and blocks below it come from
# its heap, already mapped. A long-running program is in that second state; a fresh one is not,
# and there every NumPy temporary of 128 KiB or more pays its page faults on every call
# (docs/performance.md, "Measuring NumPy's baselines in a settled process").
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
    stays at a few minutes. `fixed_rounds` (--repeat) overrides all of it.

    Each sample follows `warmup_seconds` of untimed calls, and at least `warmup_min_calls` of
    them, except for calls longer than `warmup_max_call_seconds`: waking a pool is then a small
    part of one call, and extra calls would make the largest cases last twice as long. The
    calls, not only the time, matter where the implementation before left the cache full of its
    own dirty data, whose write-backs would land in the next sample (docs/performance.md,
    "Measuring each implementation in its own steady state").
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


# How long to wait at most for other threads to stop running (a thread of the user's that never
# sleeps must not stall the run), and the pause between two looks. Without /proc (not Linux),
# the wait is a fixed pause longer than libgomp's default spin on the development machine.
IDLE_TIMEOUT_SECONDS = 0.05
IDLE_POLL_SECONDS = 0.0001
IDLE_FALLBACK_SECONDS = 0.01


def _other_threads_running():
    """How many threads of this process other than the calling one are running (state R in
    /proc/self/task/*/stat: a spinning worker is running, a sleeping one is not); None where
    /proc cannot tell."""
    own = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    running = 0
    for tid in tids:
        if tid == str(own):
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        running += stat[stat.rindex(")") + 2] == "R"
    return running


def wait_for_idle_threads(timeout=IDLE_TIMEOUT_SECONDS):
    """Sleep until no other thread of this process is running, at most `timeout` seconds;
    returns (seconds waited, whether they all went idle)."""
    start = time.perf_counter()
    running = _other_threads_running()
    if running is None:
        time.sleep(IDLE_FALLBACK_SECONDS)
        return IDLE_FALLBACK_SECONDS, True
    while running:
        if time.perf_counter() - start > timeout:
            return time.perf_counter() - start, False
        time.sleep(IDLE_POLL_SECONDS)
        running = _other_threads_running()
    return time.perf_counter() - start, True


def interleaved_samples(calls, calls_per_sample, rounds, before_sample=None, warmup=None,
                        warmup_min_calls=1, wait_for_idle=True, idle_stats=None):
    """samples[i][r]: seconds per call of calls[i] in round r; round r starts at call r % n.

    Before each sample of calls[i]: with wait_for_idle, a wait until the other threads of the
    process stopped running (wait_for_idle_threads); before_sample[i], if not None; then calls[i]
    itself, untimed, for warmup[i] seconds and at least warmup_min_calls times (see warm_up).
    idle_stats, a dict, gets the seconds spent waiting ("idle_wait_seconds") and the waits that
    timed out ("idle_wait_timeouts") added to it. The garbage collector is paused while timing,
    as timeit does: a collection would land on whichever implementation happened to be running.
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
                if wait_for_idle:
                    waited, idle = wait_for_idle_threads()
                    if idle_stats is not None:
                        idle_stats["idle_wait_seconds"] = (
                            idle_stats.get("idle_wait_seconds", 0.0) + waited)
                        idle_stats["idle_wait_timeouts"] = (
                            idle_stats.get("idle_wait_timeouts", 0) + (not idle))
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
