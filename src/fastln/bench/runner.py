"""The benchmark itself: every case, every implementation, one process, interleaved.

A case is one (operation, shape, dtype, thread count). The cases of one (operation, shape, dtype)
are measured together, as one group: each threaded implementation once per thread count, NumPy
(single-threaded) once for all counts. For each group the runner
  1. prepares every contestant (buffers, sessions: untimed),
  2. warms each one up with one call and checks its result against fastln's first rows,
  3. calibrates how many calls make a sample of at least `min_sample_seconds`,
  4. takes interleaved rounds of samples, each after a millisecond and at least three untimed
     calls (fastln.bench.timing), and summarizes them,
  5. looks for anomalies: a contestant whose rounds disagree wildly (interquartile range over
     SPREAD_LIMIT of the median), or that is slower with more threads than with fewer by more
     than THREAD_SLOWDOWN_LIMIT. Such a group is measured again, all of it (so that the paired
     ratios stay paired), up to MAX_REMEASURES times; what remains is flagged in the table and
     the JSON ("anomaly"),
and reports time, effective bandwidth, the fraction of the machine's copy bandwidth at the same
thread count and fastln's speed-up against every other implementation, paired round by round
with fastln at the same thread count.
"""
import gc
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Tuple

import numpy as np

from fastln.bench import bandwidth, machine, peers, timing
from fastln.bench.operation import check_rows, compare_results, numpy_dtype
from fastln.bench.ops import OPERATIONS
from fastln.bench.peers.onnxruntime import onnxruntime_spinning
from fastln.bench.progress import Progress

SCHEMA = "fastln-bench/1"

# Never let one group take more than this fraction of the memory that is available at start.
MEMORY_FRACTION = 0.6

# What makes a measurement suspect (see step 5 above), and how often a suspect group is measured
# again before it is reported flagged.
SPREAD_LIMIT = 0.5
THREAD_SLOWDOWN_LIMIT = 1.3
MAX_REMEASURES = 2


@dataclass
class BenchConfig:
    """Everything a run depends on (what `fastln bench` builds from its options)."""

    ops: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[str, ...]
    threads: Tuple[int, ...]
    peers: Tuple[str, ...]                    # selected and installed; fastln is implied
    out_buffer: bool = False
    schedule: timing.Schedule = field(default_factory=timing.Schedule)
    copy_buffer_bytes: Optional[int] = None   # None: twice the last-level cache
    copy_repeats: int = 5
    seed: int = 0
    progress: bool = True

    def as_dict(self):
        return {
            "ops": list(self.ops),
            "shapes": [list(shape) for shape in self.shapes],
            "dtypes": list(self.dtypes),
            "threads": list(self.threads),
            "peers": list(self.peers),
            "out_buffer": self.out_buffer,
            "min_sample_seconds": self.schedule.min_sample_seconds,
            "warmup_seconds": self.schedule.warmup_seconds,
            "warmup_min_calls": self.schedule.warmup_min_calls,
            "warmup_max_call_seconds": self.schedule.warmup_max_call_seconds,
            "rounds": (self.schedule.fixed_rounds if self.schedule.fixed_rounds is not None
                       else [min(self.schedule.min_rounds, self.schedule.slow_min_rounds),
                             self.schedule.max_rounds]),
            "case_budget_seconds": self.schedule.case_budget_seconds,
            "copy_buffer_bytes": self.copy_buffer_bytes,
            "copy_repeats": self.copy_repeats,
            "seed": self.seed,
        }


def shape_label(shape):
    return "x".join(str(n) for n in shape)


def _selected(operation, selected_peers, dtype):
    """The implementations of `operation` to measure in `dtype`: fastln, and the selected peers'
    that compute that dtype."""
    return [implementation for implementation in operation.implementations
            if (implementation.peer == "fastln" or implementation.peer in selected_peers)
            and implementation.supports(dtype)]


def _contestants(operation, config, dtype):
    """(implementation, threads) pairs to time, fastln at the first thread count first.

    Single-threaded implementations get threads=None: measured once, reported at every count.
    """
    selected = _selected(operation, config.peers, dtype)
    pairs = [(implementation, threads) for threads in config.threads
             for implementation in selected if implementation.uses_threads]
    pairs += [(implementation, None) for implementation in selected
              if not implementation.uses_threads]
    return pairs


class NotMeasured(Exception):
    """A peer that failed or disagreed with fastln: reported with the reason, never timed."""


def _prepare_and_check(implementation, threads, inputs, operation, dtype, config, reference):
    """(prepared, calls per sample, seconds per call, reference rows, inexact) for one
    contestant.

    The first fastln call's result becomes the reference (its first rows); every later
    contestant, fastln at other thread counts included, must match it. A failing or mismatching
    peer raises NotMeasured; a failing fastln raises its own error, as nothing can be compared
    without it. Only the operation's batch sums may differ: inexact says how, and the peer is
    timed all the same.
    """
    inexact = None
    try:
        prepared = implementation.prepare(inputs, threads or 1, config.out_buffer)
        start = time.perf_counter()
        result = prepared.call()
        first_call_seconds = time.perf_counter() - start
        arrays = prepared.result_arrays(result)
        if reference is None:
            reference = tuple(check_rows(array) for array in arrays)
        else:
            tolerance = operation.tolerance_for(dtype)
            checked = [index for index in range(len(arrays))
                       if index not in operation.batch_sums]
            mismatch = compare_results(arrays, reference, dtype, tolerance, indices=checked)
            if mismatch:
                raise NotMeasured(f"mismatch: {mismatch}")
            if operation.batch_sums:
                inexact = compare_results(arrays, reference, dtype, tolerance,
                                          indices=operation.batch_sums)
        del result, arrays
        if prepared.before_sample is not None:
            prepared.before_sample()
        n_calls, seconds_per_call = timing.calibrate(
            prepared.call, first_call_seconds, config.schedule.min_sample_seconds)
    except NotMeasured:
        raise
    except Exception as exc:
        if implementation.peer == "fastln":
            raise
        raise NotMeasured(f"error: {type(exc).__name__}: {exc}") from exc
    return prepared, n_calls, seconds_per_call, reference, inexact


def find_anomalies(samples_by_contestant):
    """{(implementation name, threads): why its measurement is suspect} (see the module
    docstring, step 5); threads is None for the single-threaded implementations."""
    found = {}
    medians = {}
    for key, samples in samples_by_contestant.items():
        stats = timing.summarize(samples)
        medians[key] = stats["median_s"]
        spread = (stats["q3_s"] - stats["q1_s"]) / stats["median_s"]
        if spread > SPREAD_LIMIT:
            found[key] = f"rounds disagree: interquartile range {spread:.0%} of the median"
    for (name, threads), median in medians.items():
        for (other_name, fewer), fewer_median in medians.items():
            if (other_name == name and threads is not None and fewer is not None
                    and fewer < threads and median > THREAD_SLOWDOWN_LIMIT * fewer_median):
                found.setdefault((name, threads),
                                 f"{median / fewer_median:.2f}x slower with {threads} threads "
                                 f"than with {fewer}")
    return found


def measure_group(operation, inputs, shape, dtype, config, copy_results, idle_stats=None):
    """Records (dicts) for every selected implementation and thread count of one
    (operation, shape, dtype), in table order: by thread count, then implementation."""
    prepared_calls, measured, warmups, failures, inexact = [], [], [], {}, {}
    reference, round_seconds = None, 0.0
    for implementation, threads in _contestants(operation, config, dtype):
        try:
            prepared, n_calls, seconds_per_call, reference, difference = _prepare_and_check(
                implementation, threads, inputs, operation, dtype, config, reference)
        except NotMeasured as exc:
            failures[(implementation.name, threads)] = str(exc)
            continue
        if difference:
            inexact[(implementation.name, threads)] = difference
        prepared_calls.append(prepared)
        measured.append((implementation, threads, n_calls))
        warmups.append(config.schedule.warmup_for(seconds_per_call))
        round_seconds += n_calls * seconds_per_call

    # More contestants, more time: the budget is per thread count.
    schedule = config.schedule
    rounds = schedule.rounds_for(round_seconds / len(config.threads))
    remeasured = 0
    while True:
        samples = timing.interleaved_samples(
            [prepared.call for prepared in prepared_calls],
            [n_calls for _, _, n_calls in measured], rounds,
            before_sample=[prepared.before_sample for prepared in prepared_calls],
            warmup=warmups, warmup_min_calls=schedule.warmup_min_calls, idle_stats=idle_stats)
        by_contestant = {(implementation.name, threads): (prepared, n_calls, contestant_samples)
                         for (implementation, threads, n_calls), prepared, contestant_samples
                         in zip(measured, prepared_calls, samples)}
        anomalies = find_anomalies({key: value[2] for key, value in by_contestant.items()})
        if not anomalies or remeasured == MAX_REMEASURES:
            break
        remeasured += 1
    del prepared_calls

    bytes_moved = operation.bytes_moved(shape, numpy_dtype(dtype).itemsize)
    records = []
    for threads in config.threads:
        copy_speed = bandwidth.copy_bandwidth_for(copy_results, threads)
        fastln_samples = by_contestant[("fastln", threads)][2]
        fastln_median = timing.summarize(fastln_samples)["median_s"]
        for implementation in _selected(operation, config.peers, dtype):
            key = (implementation.name, threads if implementation.uses_threads else None)
            record = {"op": operation.name, "shape": list(shape), "dtype": dtype,
                      "threads": threads, "implementation": implementation.name,
                      "peer": implementation.peer, "status": failures.get(key, "ok")}
            records.append(record)
            if key not in by_contestant:
                continue
            prepared, n_calls, contestant_samples = by_contestant[key]
            stats = timing.summarize(contestant_samples)
            bandwidth_bytes = bytes_moved / stats["median_s"]
            record.update(
                output=prepared.output,
                threads_used=prepared.threads,
                # NumPy's samples are shared by every thread count of the group.
                measured_once_for_all_threads=not implementation.uses_threads,
                calls_per_sample=n_calls,
                rounds=rounds,
                samples_s=contestant_samples,
                **stats,
                bytes_moved=bytes_moved,
                bandwidth_bytes_per_second=bandwidth_bytes,
                fraction_of_copy_bandwidth=(bandwidth_bytes / copy_speed if copy_speed
                                            else None),
                # How many times faster fastln (same thread count) is than this implementation.
                fastln_speedup=timing.paired_ratio(contestant_samples, fastln_samples),
                fastln_speedup_of_medians=stats["median_s"] / fastln_median,
                remeasured=remeasured,
                anomaly=anomalies.get(key),
                inexact=inexact.get(key),
            )
    return records


def speedup_summary(results):
    """Per op, dtype and peer implementation: the median and the minimum over shapes and thread
    counts of fastln's speed-up (paired, peer time / fastln time), with the case of the minimum.
    Flagged measurements (see find_anomalies) are left out and counted."""
    groups = {}
    for record in results:
        if record["implementation"] == "fastln" or record["status"] != "ok":
            continue
        key = (record["op"], record["dtype"], record["implementation"])
        groups.setdefault(key, []).append(record)
    summary = []
    for (op, dtype, implementation), records in groups.items():
        kept = [record for record in records if not record.get("anomaly")]
        entry = {"op": op, "dtype": dtype, "implementation": implementation,
                 "cases": len(kept), "flagged_cases_left_out": len(records) - len(kept)}
        if kept:
            slowest = min(kept, key=lambda record: record["fastln_speedup"])
            entry.update(
                median_speedup=float(np.median([r["fastln_speedup"] for r in kept])),
                min_speedup=slowest["fastln_speedup"],
                min_case={"shape": slowest["shape"], "threads": slowest["threads"]})
        summary.append(entry)
    return summary


def _group_memory_bytes(operation, shape, dtype, config):
    # Each extra thread count adds its own output buffers when --out-buffer is on.
    factor = operation.memory_factor + (3 * (len(config.threads) - 1) if config.out_buffer else 0)
    return factor * int(np.prod(shape)) * numpy_dtype(dtype).itemsize


def run_benchmark(config, command_line=None, log=sys.stderr):
    """Run every case of `config`; returns the report (a JSON-ready dict)."""
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    wall_start = time.perf_counter()
    cpu_start = machine.busy_cpu_seconds()
    description = machine.describe_machine(peers.peer_versions(config.peers))

    load = description["load_average"]
    if load and load[0] > 0.5 * description["usable_cpus"]:
        print(f"fastln bench: warning: load average {load[0]:.2f} on "
              f"{description['usable_cpus']} CPUs: other processes are running, and "
              "multi-threaded timings will wait for them", file=log, flush=True)

    timing.settle_allocator()
    buffer_bytes = config.copy_buffer_bytes or bandwidth.copy_buffer_bytes(
        description["last_level_cache_bytes"], description["memory_available_bytes"])
    if config.progress:
        print(f"measuring copy bandwidth (2 x {buffer_bytes / (1 << 20):.0f} MiB, threads "
              f"{', '.join(map(str, config.threads))}) ...", file=log, flush=True)
    copy_results = bandwidth.measure_copy_bandwidth(config.threads, buffer_bytes,
                                                    repeats=config.copy_repeats)

    memory_limit = (description["memory_available_bytes"] or float("inf")) * MEMORY_FRACTION
    idle_stats = {"idle_wait_seconds": 0.0, "idle_wait_timeouts": 0}
    rng = np.random.default_rng(config.seed)
    results, skipped = [], []
    groups = [(OPERATIONS[name], shape, dtype) for name in config.ops
              for shape in config.shapes for dtype in config.dtypes]
    with Progress(len(groups), enabled=config.progress, stream=log, unit="group") as progress:
        for operation, shape, dtype in groups:
            progress.set_description(f"{operation.name} {shape_label(shape)} {dtype}")
            needed = _group_memory_bytes(operation, shape, dtype, config)
            if needed > memory_limit:
                skipped.append({
                    "op": operation.name, "shape": list(shape), "dtype": dtype,
                    "reason": f"needs about {needed / (1 << 30):.1f} GiB, more than "
                              f"{MEMORY_FRACTION:.0%} of the available memory"})
            else:
                inputs = operation.make_inputs(shape, dtype, rng)
                results.extend(measure_group(operation, inputs, shape, dtype, config,
                                             copy_results, idle_stats))
                del inputs
                gc.collect()  # give the big arrays back before the next group
            progress.update()

    duration = time.perf_counter() - wall_start
    # Multi-threaded timings wait for the cores other processes take: say how many they took.
    others = machine.other_processes_cpus(cpu_start, machine.busy_cpu_seconds(), duration)
    if others is not None and others > 0.1 * description["usable_cpus"]:
        print(f"fastln bench: warning: other processes kept {others:.2f} of "
              f"{description['usable_cpus']} CPUs busy during the run; multi-threaded "
              "timings waited for them", file=log, flush=True)
    settings = config.as_dict()
    settings.update(idle_stats, anomaly_limits={"spread": SPREAD_LIMIT,
                                                "thread_slowdown": THREAD_SLOWDOWN_LIMIT,
                                                "remeasures": MAX_REMEASURES})
    if "onnxruntime" in config.peers:
        # How its idle workers waited (libgomp's setting is in machine.thread_environment).
        settings["onnxruntime_session_config"] = onnxruntime_spinning()
    return {
        "schema": SCHEMA,
        "command": command_line,
        "started_at": started_at,
        "duration_seconds": duration,
        "other_processes_cpus": others,
        "settings": settings,
        "machine": description,
        "copy_bandwidth": copy_results,
        "results": results,
        "summary": speedup_summary(results),
        "skipped": skipped,
    }
