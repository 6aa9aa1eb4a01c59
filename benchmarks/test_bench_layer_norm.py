"""layer_norm forward and backward: fastln and every baseline, one pytest-benchmark group per
(operation, shape, dtype) so that each group's table compares them side by side."""
import pytest

from fastln.bench import peers, timing
from fastln.bench.command import STANDARD_SHAPES
from fastln.bench.ops import OPERATIONS, compare_results

DTYPES = ("float32", "float64")

# Samples of about a millisecond, 3 to 15 of them, about 0.15 s per test: enough for a stable
# median, short enough that 32768x1024 does not dominate the suite.
SCHEDULE = timing.Schedule(min_sample_seconds=0.001, min_rounds=3, max_rounds=15,
                           case_budget_seconds=0.15)


def _shape_id(shape):
    return "x".join(map(str, shape))


def run_benchmark(benchmark, input_cache, num_threads, op, shape, dtype, implementation_name):
    operation = OPERATIONS[op]
    implementation = operation.implementation(implementation_name)
    if implementation.peer != "fastln" and not peers.is_installed(implementation.peer):
        pytest.skip(f"{implementation.peer} is not installed")
    inputs, reference = input_cache.get(operation, shape, dtype, num_threads)
    prepared = implementation.prepare(inputs, num_threads, False)
    # As `fastln bench` does: the previous test's spinning OpenMP workers go idle first.
    timing.wait_for_idle_threads()

    benchmark.group = f"{op} {_shape_id(shape)} {dtype}"
    benchmark.extra_info.update(implementation=implementation.name, threads=prepared.threads,
                                bytes_moved=operation.bytes_moved(shape, inputs.x.itemsize))
    if benchmark.disabled:
        result = benchmark(prepared.call)
    else:
        # One warm-up call also calibrates: calls per sample so that a sample lasts ~1 ms.
        first_call_seconds = timing.time_calls(prepared.call, 1)
        iterations, seconds_per_call = timing.calibrate(
            prepared.call, first_call_seconds, SCHEDULE.min_sample_seconds)
        rounds = SCHEDULE.rounds_for(iterations * seconds_per_call)
        result = benchmark.pedantic(prepared.call, rounds=rounds, iterations=iterations)
        benchmark.extra_info["GB/s (median)"] = round(
            benchmark.extra_info["bytes_moved"] / benchmark.stats.stats.median / 1e9, 3)
    mismatch = compare_results(prepared.result_arrays(result), reference, inputs.x.dtype)
    assert mismatch is None, f"{implementation.name}: {mismatch}"


def _parametrize(op):
    names = [implementation.name for implementation in OPERATIONS[op].implementations]
    # Implementation varies fastest: the tests of one case run together and share its inputs.
    return pytest.mark.parametrize(
        "shape, dtype, implementation_name",
        [(shape, dtype, name) for shape in STANDARD_SHAPES for dtype in DTYPES for name in names],
        ids=[f"{_shape_id(shape)}-{dtype}-{name}"
             for shape in STANDARD_SHAPES for dtype in DTYPES for name in names])


@_parametrize("forward")
def test_forward(benchmark, input_cache, num_threads, shape, dtype, implementation_name):
    run_benchmark(benchmark, input_cache, num_threads, "forward", shape, dtype,
                  implementation_name)


@_parametrize("backward")
def test_backward(benchmark, input_cache, num_threads, shape, dtype, implementation_name):
    run_benchmark(benchmark, input_cache, num_threads, "backward", shape, dtype,
                  implementation_name)
