"""fastln's thread controls: set_num_threads / get_num_threads / num_threads(n), threadpoolctl.

fastln's default thread count is OpenMP's own setting, so fastln.set_num_threads, threadpoolctl
and OMP_NUM_THREADS all act on the same number. The threadpoolctl tests run in a fresh
interpreter, where nothing but fastln has loaded an OpenMP runtime and no OpenMP thread exists
yet, so they can count the threads the runtime really starts (Linux: /proc/self/task).
"""
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import assert_bitwise_equal

import fastln
from fastln._threads import resolve_num_threads

needs_openmp = pytest.mark.skipif(not fastln._kernels.openmp_enabled(),
                                  reason="fastln was built without OpenMP")


def test_set_and_get_num_threads():
    previous = fastln.get_num_threads()
    try:
        fastln.set_num_threads(3)
        expected = 3 if fastln._kernels.openmp_enabled() else 1
        assert fastln.get_num_threads() == expected
        assert resolve_num_threads(None) == expected       # what num_threads=None uses
        assert resolve_num_threads(2) == 2                 # a per-call value still wins
    finally:
        fastln.set_num_threads(previous)
    assert fastln.get_num_threads() == previous


@needs_openmp
def test_context_manager_restores_also_on_error():
    previous = fastln.get_num_threads()
    target = previous + 1
    with fastln.num_threads(target) as n:
        assert n == target
        assert fastln.get_num_threads() == target
        with fastln.num_threads(1):
            assert fastln.get_num_threads() == 1
        assert fastln.get_num_threads() == target
    assert fastln.get_num_threads() == previous
    with pytest.raises(RuntimeError, match="boom"):
        with fastln.num_threads(1):
            raise RuntimeError("boom")
    assert fastln.get_num_threads() == previous


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None, 2**31, 2**40])
def test_bad_counts_are_a_value_error_and_change_nothing(bad):
    previous = fastln.get_num_threads()
    with pytest.raises(ValueError, match="num_threads must be a positive int"):
        fastln.set_num_threads(bad)
    with pytest.raises(ValueError, match="num_threads must be a positive int"):
        with fastln.num_threads(bad):
            pass  # pragma: no cover
    assert fastln.get_num_threads() == previous


@needs_openmp
def test_results_do_not_depend_on_the_default(rng):
    x = rng.standard_normal((600, 300)).astype(np.float32)
    expected = fastln.layer_norm(x, num_threads=1)
    for n in (1, 2, 3):
        with fastln.num_threads(n):
            assert_bitwise_equal(fastln.layer_norm(x), expected)
            assert_bitwise_equal(fastln.rms_norm(x), fastln.rms_norm(x, num_threads=1))


@needs_openmp
def test_setting_is_per_thread_like_openmp():
    previous = fastln.get_num_threads()
    seen = []
    with fastln.num_threads(previous + 2):
        worker = threading.Thread(target=lambda: seen.append(fastln.get_num_threads()))
        worker.start()
        worker.join()
    # A new thread starts from OpenMP's initial value (OMP_NUM_THREADS or the core count).
    assert seen and seen[0] != previous + 2


def test_threadpoolctl_sees_the_setting():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not fastln._kernels.openmp_enabled():
        pytest.skip("fastln was built without OpenMP")
    with fastln.num_threads(1):
        counts = [info["num_threads"] for info in threadpoolctl.threadpool_info()
                  if info["user_api"] == "openmp"]
        assert 1 in counts
    with threadpoolctl.threadpool_limits(limits=1, user_api="openmp"):
        assert fastln.get_num_threads() == 1
        assert resolve_num_threads(None) == 1
        assert resolve_num_threads(3) == 3


FRESH_PROCESS = textwrap.dedent("""
    import json, os
    import numpy as np
    from threadpoolctl import threadpool_info, threadpool_limits

    def openmp_libraries():
        return {i["filepath"] for i in threadpool_info() if i["user_api"] == "openmp"}

    def os_threads():
        return len(os.listdir("/proc/self/task"))

    before = openmp_libraries()
    import fastln
    after = openmp_libraries()
    x = np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32)
    result = {"new_libraries": sorted(after - before), "default": fastln.get_num_threads()}
    with threadpool_limits(limits=1, user_api="openmp"):
        result["limited"] = fastln.get_num_threads()
        start = os_threads()
        fastln.layer_norm(x)                       # num_threads=None: limited to one thread
        result["threads_started_by_default_call"] = os_threads() - start
        fastln.layer_norm(x, num_threads=3)        # an explicit count wins
        result["threads_started_by_explicit_call"] = os_threads() - start
    result["restored"] = fastln.get_num_threads()
    print(json.dumps(result))
""")


@needs_openmp
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_threadpoolctl_limits_fastln_in_a_fresh_process():
    pytest.importorskip("threadpoolctl")
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env["OMP_NUM_THREADS"] = "2"
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Importing fastln loads an OpenMP runtime that threadpoolctl finds ...
    assert len(result["new_libraries"]) == 1
    assert "gomp" in result["new_libraries"][0] or "omp" in result["new_libraries"][0]
    assert result["default"] == 2
    # ... and limiting it limits fastln's default: no OpenMP thread is started ...
    assert result["limited"] == 1
    assert result["threads_started_by_default_call"] == 0
    # ... while num_threads=3 on a call still gets its team of three (two new threads).
    assert result["threads_started_by_explicit_call"] == 2
    assert result["restored"] == 2
