"""fastln's thread controls: set_num_threads / get_num_threads / num_threads(n), threadpoolctl.

fastln's default thread count is its own setting, apart from the OpenMP runtime's (which PyTorch
uses): fastln.set_num_threads and the runtime's setting never change each other, while
threadpoolctl sees and limits both (fastln registers a controller for itself) and
OMP_NUM_THREADS starts both. The tests that need a clean process run in a fresh interpreter,
where nothing but fastln has loaded an OpenMP runtime and no OpenMP thread exists yet, so they
can count the threads the runtime really starts (Linux: /proc/self/task).
"""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

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


BAD_COUNTS = {"zero": 0, "negative": -1, "float": 1.5, "bool": True, "str": "2", "none": None,
              "2**31": 2**31, "2**40": 2**40, "10**5000": 10**5000,
              "timedelta64": np.timedelta64(2), "numpy_bool": np.bool_(True)}


@pytest.mark.parametrize("bad", BAD_COUNTS.values(), ids=BAD_COUNTS.keys())
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
    # A new thread starts from the initial value (OMP_NUM_THREADS or the processor count).
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

    def runtime_threads():
        return [i["num_threads"] for i in threadpool_info() if i["internal_api"] == "openmp"]

    before = openmp_libraries()
    import fastln
    after = openmp_libraries()
    x = np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32)
    result = {"new_libraries": sorted(after - before), "default": fastln.get_num_threads(),
              "fastln_entries": [i["num_threads"] for i in threadpool_info()
                                 if i["internal_api"] == "fastln"]}
    with threadpool_limits(limits=1, user_api="openmp"):
        result["limited"] = fastln.get_num_threads()
        start = os_threads()
        fastln.layer_norm(x)                       # num_threads=None: limited to one thread
        result["threads_started_by_default_call"] = os_threads() - start
        fastln.layer_norm(x, num_threads=3)        # an explicit count wins
        result["threads_started_by_explicit_call"] = os_threads() - start
        for _ in range(5):
            fastln.layer_norm(x, num_threads=3)    # the same workers, woken again
        fastln.layer_norm(x, num_threads=2)        # fewer than there are
        result["threads_after_more_calls"] = os_threads() - start
    result["restored"] = fastln.get_num_threads()
    fastln.set_num_threads(1)  # fastln's setting alone: the runtime's stays ...
    result["runtime_after_fastln_set"] = runtime_threads()
    with threadpool_limits(limits=1, user_api="openmp"):
        pass
    from threadpoolctl import ThreadpoolController
    fastln.set_num_threads(2)
    ThreadpoolController().select(internal_api="openmp").limit(limits=1)  # ... and the other way
    result["fastln_after_runtime_set"] = fastln.get_num_threads()
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
    # Importing fastln loads an OpenMP runtime that threadpoolctl finds, and fastln's entry ...
    runtimes = [path for path in result["new_libraries"] if "_kernels" not in path]
    assert len(runtimes) == 1 and "omp" in runtimes[0]
    assert len(result["new_libraries"]) == 2
    assert result["default"] == 2 and result["fastln_entries"] == [2]
    # ... and limiting it limits fastln's default: no OpenMP thread is started ...
    assert result["limited"] == 1
    assert result["threads_started_by_default_call"] == 0
    # ... while num_threads=3 on a call still gets its team of three (two new threads).
    assert result["threads_started_by_explicit_call"] == 2
    # Later calls reuse those workers (fastln/pool.h): no thread is started per call.
    assert result["threads_after_more_calls"] == 2
    assert result["restored"] == 2
    # ... and fastln's setting and the runtime's leave each other alone.
    assert result["runtime_after_fastln_set"] == [2]
    assert result["fastln_after_runtime_set"] == 2


@needs_openmp
@pytest.mark.parametrize("value, expected", [("3", 3), ("3,2", 3), (" 1 ", 1), ("0", None),
                                             ("abc", None), ("", None), ("\u0663", None)])
def test_the_initial_default_follows_omp_num_threads(value, expected):
    env = dict(os.environ, OMP_NUM_THREADS=value)
    script = "import fastln; print(fastln.get_num_threads(), fastln._kernels.num_procs())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    default, procs = map(int, done.stdout.split())
    assert default == (procs if expected is None else expected)


TORCH_AND_FASTLN = textwrap.dedent("""
    import json
    import torch
    import fastln
    result = {"start": [torch.get_num_threads(), fastln.get_num_threads()]}
    torch.set_num_threads(1)
    result["torch_set"] = [torch.get_num_threads(), fastln.get_num_threads()]
    torch.set_num_threads(2)
    fastln.set_num_threads(1)
    torch.ones(1000, 1000).sum()  # a parallel torch call after fastln's setting
    result["fastln_set"] = [torch.get_num_threads(), fastln.get_num_threads()]
    print(json.dumps(result))
""")


@needs_openmp
def test_pytorch_and_fastln_keep_their_own_settings():
    pytest.importorskip("torch")
    # torch's own count also follows MKL_NUM_THREADS: the child starts without it.
    env = {name: value for name, value in os.environ.items() if name != "MKL_NUM_THREADS"}
    env["OMP_NUM_THREADS"] = "2"
    done = subprocess.run([sys.executable, "-c", TORCH_AND_FASTLN], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"start": [2, 2], "torch_set": [1, 2], "fastln_set": [2, 1]}


@needs_openmp
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_calls_that_wake_a_sleeping_worker_give_the_serial_bits(dtype):
    """A job that has to wake a sleeping worker goes in finer parts (the worker starts late;
    fastln/pool.h): each call here comes after a pause longer than a worker polls, so it takes
    that path, and every output must be bit for bit the serial call's."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2048, 768)) * 3 + 50).astype(dtype)   # 1.5M elements: wakes
    dy = rng.standard_normal((2048, 768)).astype(dtype)
    gamma = rng.standard_normal(768).astype(dtype)
    beta = rng.standard_normal(768).astype(dtype)
    images = x.reshape(8, 64, 48, 64)

    def results(threads):
        time.sleep(0.02)
        y, cache = fastln.layer_norm_forward(x, gamma, beta, num_threads=threads)
        time.sleep(0.02)
        grads = fastln.layer_norm_backward(dy, cache, gamma, num_threads=threads)
        time.sleep(0.02)
        rms_y, rms_cache = fastln.rms_norm_forward(x, gamma, num_threads=threads)
        time.sleep(0.02)
        rms_grads = fastln.rms_norm_backward(dy, rms_cache, gamma, num_threads=threads)
        time.sleep(0.02)
        bn_y, bn_cache = fastln.batch_norm_forward(x, gamma, beta, training=True,
                                                   num_threads=threads)
        time.sleep(0.02)
        bn_grads = fastln.batch_norm_backward(dy, bn_cache, gamma, num_threads=threads)
        time.sleep(0.02)
        gn_y, gn_cache = fastln.group_norm_forward(images, 8, num_threads=threads)
        time.sleep(0.02)
        gn_grads = fastln.group_norm_backward(dy.reshape(images.shape), gn_cache,
                                              num_threads=threads)
        return (y, *grads, rms_y, *rms_grads, bn_y, *bn_grads, gn_y, *gn_grads)

    serial = results(1)
    for _ in range(2):
        for expected, got in zip(serial, results(2)):
            assert_bitwise_equal(got, expected)
