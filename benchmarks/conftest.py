"""The pytest-benchmark suite: fastln beside its baselines, grouped by operation, shape and dtype.

    pytest benchmarks/                          # a few minutes; tables per group at the end
    pytest benchmarks/ --benchmark-disable      # every call once, checked: a smoke test
    pytest benchmarks/ -k "forward and 4096x768"
    pytest benchmarks/ --bench-threads 1        # thread count for fastln, torch, onnxruntime

The implementations are the ones `fastln bench` times (fastln.bench.ops), so the suite and the
command measure the same code. Peers that are not installed are skipped. Each result is checked
against fastln's before it is reported.

Rounds are limited so that the biggest shapes do not make the suite take forever: calls are
batched into samples of about a millisecond and a test stops after 3 to 15 samples or about
0.15 s. `fastln bench` is the tool for careful numbers (interleaved rounds, one process).
"""
import gc
import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("pytest_benchmark") is None:
    # The suite needs the plugin (pip install pytest-benchmark): without it, collect nothing
    # instead of failing on the missing `benchmark` fixture.
    collect_ignore_glob = ["test_*.py"]

from fastln.bench.machine import usable_cpus
from fastln.bench.operation import check_rows
from fastln.bench.timing import settle_allocator


def pytest_sessionstart(session):
    settle_allocator()  # as `fastln bench` does: NumPy's temporaries from the heap, not mmap


def pytest_addoption(parser):
    parser.addoption("--bench-threads", type=int, default=None,
                     help="threads for fastln, torch and onnxruntime (default: all usable CPUs)")


@pytest.fixture(scope="session")
def num_threads(request):
    return request.config.getoption("--bench-threads") or usable_cpus()


class InputCache:
    """Inputs and fastln's reference result for the current (op, shape, dtype), one at a time.

    Tests of the same case run one after another, so keeping only the latest case spares
    regenerating 256 MiB arrays for every implementation without holding all cases in memory.
    """

    def __init__(self):
        self.key = None
        self.value = None

    def get(self, operation, shape, dtype, num_threads):
        key = (operation.name, shape, dtype, num_threads)
        if key != self.key:
            self.key = self.value = None
            gc.collect()
            inputs = operation.make_inputs(shape, dtype, np.random.default_rng(0))
            fastln_call = operation.implementation("fastln").prepare(inputs, num_threads, False)
            result = fastln_call.result_arrays(fastln_call.call())
            reference = tuple(check_rows(array) for array in result)
            self.key, self.value = key, (inputs, reference)
        return self.value


@pytest.fixture(scope="session")
def input_cache():
    return InputCache()
