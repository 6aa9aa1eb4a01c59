"""The output cache (issue 4): large outputs come from recycled, already paged-in memory.

- Reuse: a large output (32 MiB and up) freed and asked for again comes back at the same
  address (and counts as a hit); smaller outputs and ``out=`` never touch the cache.
- Bounds: at most 8 blocks and ``max_bytes`` bytes, whatever sizes come and go (the resident
  memory does not grow with the number of sizes); ``set_output_cache(0)`` frees every block
  and switches the cache off; arrays outliving a change of setting are freed correctly.
- Results never depend on reuse: a recycled block full of old values (NaN) gives bit for bit
  the result of a call with ``out=``, for every function that allocates large outputs.
- The NumPy side: tracemalloc sees the arrays exactly while they exist; views keep the block
  alive; copying, pickling, ``ndarray.resize`` (the handler's realloc) and ``np.zeros`` (its
  calloc) work; 8 threads allocating and freeing at once, freeing each other's arrays, leave a
  consistent cache and correct results.
- Settings: ``FASTLN_OUTPUT_CACHE``, ``set_output_cache`` errors, ``show_config``.
"""
import copy
import gc
import io
import os
import pickle
import queue
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest

import fastln
from conftest import assert_bitwise_equal
from fastln import _output_cache

MIB = 1 << 20
THRESHOLD = 32 * MIB  # the smallest output the cache serves
COLS = 1024
NUMPY_TRACE_DOMAIN = 389047  # the tracemalloc domain NumPy reports array buffers in


def handler_name(array):
    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import get_handler_name
    return get_handler_name(array)


def address(array):
    return array.__array_interface__["data"][0]


def rss():
    """Resident set size of this process in bytes (Linux)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")


@pytest.fixture
def cache():
    """An empty cache with a known cap (256 MiB); the previous setting is restored after."""
    previous = fastln.output_cache_info()["max_bytes"]
    fastln.set_output_cache(0)
    fastln.set_output_cache(256 * MIB)
    yield
    fastln.set_output_cache(0)  # drop what the test left
    fastln.set_output_cache(previous)


def rows_for(mib, dtype=np.float32):
    """The number of COLS-wide rows of `mib` MiB."""
    return mib * MIB // (COLS * np.dtype(dtype).itemsize)


def large_input(mib=32, dtype=np.float32, seed=0):
    """mib MiB of COLS-wide rows: 32 MiB, the threshold, by default."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows_for(mib, dtype), COLS), np.float32).astype(dtype)


# --------------------------------------------------------------------------------------------
# Reuse
# --------------------------------------------------------------------------------------------

def test_a_freed_output_is_reused(cache):
    x = large_input()
    y = fastln.layer_norm(x)
    assert handler_name(y) == "fastln_output_cache"
    first = address(y)
    del y
    info = fastln.output_cache_info()
    assert info["blocks"] == 1 and info["cached_bytes"] >= x.nbytes
    y = fastln.layer_norm(x)
    assert address(y) == first
    after = fastln.output_cache_info()
    assert after["hits"] == info["hits"] + 1 and after["misses"] == info["misses"]
    assert after["blocks"] == 0 and after["cached_bytes"] == 0


def test_the_alternating_pattern_of_a_loop_reuses_two_blocks(cache):
    """y = f(x) in a loop: the new y exists before the old one is freed."""
    x = large_input()
    y = fastln.layer_norm(x)
    y = fastln.layer_norm(x)
    start = fastln.output_cache_info()
    addresses = set()
    for _ in range(10):
        y = fastln.layer_norm(x)
        addresses.add(address(y))
    info = fastln.output_cache_info()
    assert info["misses"] == start["misses"] and info["hits"] == start["hits"] + 10
    assert len(addresses) == 2


def test_small_outputs_and_out_do_not_use_the_cache(cache):
    before = fastln.output_cache_info()
    small = fastln.layer_norm(np.ones((4, 768), np.float32))
    assert handler_name(small) == "default_allocator"
    just_below = fastln.layer_norm(np.ones((THRESHOLD // 4 - 16, 1), np.float32), axis=0)
    assert just_below.nbytes < fastln.output_cache_info()["min_output_bytes"]
    assert handler_name(just_below) == "default_allocator"
    x = large_input()
    out = np.empty_like(x)
    assert fastln.layer_norm(x, out=out) is out
    assert fastln.output_cache_info()["hits"] == before["hits"]
    assert fastln.output_cache_info()["misses"] == before["misses"]


def test_the_threshold_is_32_mib(cache):
    assert fastln.output_cache_info()["min_output_bytes"] == THRESHOLD
    y = fastln.layer_norm(np.ones((1, THRESHOLD // 4), np.float32))
    assert handler_name(y) == "fastln_output_cache"


def test_smaller_outputs_reuse_a_block_larger_ones_do_not(cache):
    """Up to 1/8 smaller: the block as it is; smaller still: its head, the rest given back."""
    y = fastln.layer_norm(large_input(68))
    first = address(y)
    del y
    y = fastln.layer_norm(large_input(64))  # 6% smaller
    assert address(y) == first
    del y
    assert fastln.output_cache_info()["cached_bytes"] > 68 * MIB
    y = fastln.layer_norm(large_input(34))  # half: cut to size
    assert address(y) == first
    del y
    info = fastln.output_cache_info()
    assert info["blocks"] == 1 and 34 * MIB < info["cached_bytes"] < 35 * MIB
    before = fastln.output_cache_info()
    y = fastln.layer_norm(large_input(40))  # larger than every cached block
    assert fastln.output_cache_info()["misses"] == before["misses"] + 1
    del y
    assert fastln.output_cache_info()["blocks"] == 2


def test_large_outputs_are_page_aligned(cache):
    for rows in (rows_for(32), rows_for(32) + 1, rows_for(33) + 3):
        y = fastln.layer_norm(np.ones((rows, COLS), np.float32))
        assert address(y) % os.sysconf("SC_PAGE_SIZE") == 0
        del y


# --------------------------------------------------------------------------------------------
# Bounds and settings
# --------------------------------------------------------------------------------------------

@needs_proc
def test_the_cache_is_bounded_whatever_the_sizes(cache):
    cap = 128 * MIB
    fastln.set_output_cache(cap)
    x = np.ones((56, MIB // 4), np.float32)  # x[:n] gives an n MiB output
    before = rss()
    for _ in range(2):
        for n in range(32, 57):
            y = fastln.layer_norm(x[:n])
            del y
            info = fastln.output_cache_info()
            assert info["blocks"] <= info["max_blocks"] == 8
            assert info["cached_bytes"] <= cap
    grown = rss() - before
    assert grown <= cap + 8 * MIB, f"RSS grew by {grown / MIB:.1f} MiB with a {cap / MIB} MiB cap"


def test_blocks_over_the_cap_are_not_kept(cache):
    fastln.set_output_cache(16 * MIB)  # less than one 32 MiB block
    y = fastln.layer_norm(large_input())
    assert handler_name(y) == "fastln_output_cache"
    del y
    assert fastln.output_cache_info()["blocks"] == 0


@needs_proc
def test_zero_releases_the_memory_and_switches_off(cache):
    x = large_input(64)
    y = fastln.layer_norm(x)
    del y
    assert fastln.output_cache_info()["cached_bytes"] >= x.nbytes
    before = rss()
    fastln.set_output_cache(0)
    assert before - rss() >= x.nbytes - 4 * MIB  # given back to the system
    info = fastln.output_cache_info()
    assert info["max_bytes"] == 0 and info["blocks"] == 0 and info["cached_bytes"] == 0
    y = fastln.layer_norm(x)
    assert handler_name(y) == "default_allocator"  # plain NumPy memory when off
    del y
    assert fastln.output_cache_info()["blocks"] == 0


def test_lowering_the_cap_frees_the_blocks_over_it(cache):
    ys = [fastln.layer_norm(large_input(mib)) for mib in (32, 40, 48)]
    while ys:
        ys.pop(0)  # freed in this order: 32 MiB is the oldest block
    assert fastln.output_cache_info()["blocks"] == 3
    fastln.set_output_cache(90 * MIB)  # the oldest go first until the rest fit
    info = fastln.output_cache_info()
    assert info["blocks"] == 2 and 88 * MIB < info["cached_bytes"] <= 90 * MIB


def test_arrays_outliving_a_change_of_setting_are_freed_correctly(cache):
    x = large_input()
    expected = fastln.layer_norm(x, out=np.empty_like(x))
    cached_then_off = fastln.layer_norm(x)
    fastln.set_output_cache(0)
    plain_then_on = fastln.layer_norm(x)
    fastln.set_output_cache(256 * MIB)
    for y in (cached_then_off, plain_then_on):
        assert_bitwise_equal(y, expected)
    assert handler_name(cached_then_off) == "fastln_output_cache"
    assert handler_name(plain_then_on) == "default_allocator"
    del plain_then_on  # NumPy's allocator frees it: the cache does not see it
    assert fastln.output_cache_info()["blocks"] == 0
    del cached_then_off  # allocated by the cache, freed while it is on again: kept
    assert fastln.output_cache_info()["blocks"] == 1
    survivor = fastln.layer_norm(x)
    fastln.set_output_cache(0)
    del survivor  # freed while off: unmapped, not kept
    assert fastln.output_cache_info()["blocks"] == 0


def test_set_output_cache_none_restores_the_default(cache, monkeypatch):
    monkeypatch.delenv("FASTLN_OUTPUT_CACHE", raising=False)
    fastln.set_output_cache(None)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert fastln.output_cache_info()["max_bytes"] == min(512 * MIB, physical // 16)
    monkeypatch.setenv("FASTLN_OUTPUT_CACHE", "64M")
    fastln.set_output_cache(None)
    assert fastln.output_cache_info()["max_bytes"] == 64 * MIB


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1G", [1]])
def test_set_output_cache_rejects_bad_values(bad, cache):
    with pytest.raises(ValueError, match="max_bytes"):
        fastln.set_output_cache(bad)
    assert fastln.output_cache_info()["max_bytes"] == 256 * MIB


def test_the_environment_variable_sets_the_cap_at_import():
    script = ("import warnings, fastln; warnings.simplefilter('error', RuntimeWarning)\n"
              "print(fastln.output_cache_info()['max_bytes'])")
    default = subprocess.run([sys.executable, "-c", "import fastln; print("
                              "fastln._memory.default_max_bytes())"], capture_output=True,
                             text=True, check=True, env=dict(os.environ, FASTLN_OUTPUT_CACHE=""))
    for value, expected in (("0", 0), ("123456", 123456), ("64M", 64 * MIB), ("1g", 1 << 30),
                            ("256MiB", 256 * MIB), ("", int(default.stdout))):
        env = dict(os.environ, FASTLN_OUTPUT_CACHE=value)
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                text=True, check=True)
        assert int(result.stdout) == expected, value
    env = dict(os.environ, FASTLN_OUTPUT_CACHE="lots")
    result = subprocess.run([sys.executable, "-c", "import fastln; print(fastln.output_cache_info()"
                             "['max_bytes'])"], env=env, capture_output=True, text=True,
                            check=True)
    assert int(result.stdout) == int(default.stdout)
    assert "FASTLN_OUTPUT_CACHE='lots'" in result.stderr and "RuntimeWarning" in result.stderr


def test_show_config_shows_the_cap(cache):
    text = io.StringIO()
    fastln.show_config(file=text)
    assert "output cache:        256 MiB" in text.getvalue()
    fastln.set_output_cache(0)
    text = io.StringIO()
    fastln.show_config(file=text)
    assert "output cache:        off" in text.getvalue()


# --------------------------------------------------------------------------------------------
# Results do not depend on reuse
# --------------------------------------------------------------------------------------------

def _large_calls(dtype):
    """name -> (call allocating its outputs, the same call into out= buffers)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows_for(32, dtype), COLS)).astype(dtype)
    residual = rng.standard_normal(x.shape).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, COLS).astype(dtype)
    beta = rng.standard_normal(COLS).astype(dtype)
    _, ln_cache = fastln.layer_norm_forward(x, gamma, beta)
    _, rms_cache = fastln.rms_norm_forward(x, gamma)
    _, bn_cache = fastln.batch_norm_forward(x, gamma, beta, training=True)
    x_strided = np.repeat(x, 2, axis=1)[:, ::2]  # the general (Python) path

    def with_out(call):
        return lambda: call(out=np.full_like(x, 7.0))

    calls = {
        "layer_norm": lambda **o: fastln.layer_norm(x, gamma, beta, **o),
        "layer_norm strided": lambda **o: fastln.layer_norm(x_strided, gamma, beta, **o),
        "layer_norm_forward": lambda **o: fastln.layer_norm_forward(x, gamma, beta, **o)[0],
        "layer_norm_backward": lambda **o: fastln.layer_norm_backward(dy, ln_cache, gamma,
                                                                      **o)[0],
        "rms_norm": lambda **o: fastln.rms_norm(x, gamma, **o),
        "rms_norm_backward": lambda **o: fastln.rms_norm_backward(dy, rms_cache, gamma, **o)[0],
        "add_layer_norm y": lambda **o: fastln.add_layer_norm(x, residual, gamma, beta, **o)[0],
        "add_rms_norm_forward s": lambda **o: fastln.add_rms_norm_forward(
            x, residual, gamma, **({"sum_out": o["out"]} if o else {}))[1],
        "batch_norm": lambda **o: fastln.batch_norm(x, gamma, beta, training=True, **o),
        "batch_norm_backward": lambda **o: fastln.batch_norm_backward(dy, bn_cache, gamma,
                                                                      **o)[0],
    }
    return {name: (call, with_out(call)) for name, call in calls.items()}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(_large_calls(np.float32)))
def test_a_recycled_block_gives_the_same_result(name, dtype, cache):
    call, call_with_out = _large_calls(dtype)[name]
    expected = call_with_out()
    for _ in range(2):
        y = call()
        assert handler_name(y) == "fastln_output_cache"
        assert_bitwise_equal(y, expected)
        y[...] = np.nan  # what the next call will find in the block
        del y
    assert fastln.output_cache_info()["hits"] >= 1


def test_half_precision_outputs_use_the_cache_too(cache):
    x = large_input(32, np.float16)
    expected = fastln.layer_norm(x, out=np.empty_like(x))
    y = fastln.layer_norm(x)
    assert handler_name(y) == "fastln_output_cache"
    y[...] = np.nan
    first = address(y)
    del y
    y = fastln.layer_norm(x)
    assert address(y) == first
    assert_bitwise_equal(y, expected)


# --------------------------------------------------------------------------------------------
# NumPy's side: tracemalloc, views, copies, realloc and calloc
# --------------------------------------------------------------------------------------------

def _traced_numpy_bytes():
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.DomainFilter(True, NUMPY_TRACE_DOMAIN)])
    return sum(trace.size for trace in snapshot.traces)


def test_tracemalloc_sees_the_arrays_while_they_exist(cache):
    x = large_input()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        base_numpy = _traced_numpy_bytes()
        hits = fastln.output_cache_info()["hits"]
        for reused in (False, True):
            y = fastln.layer_norm(x)
            assert fastln.output_cache_info()["hits"] == hits + reused
            assert tracemalloc.get_traced_memory()[0] - base >= x.nbytes
            assert _traced_numpy_bytes() - base_numpy == x.nbytes
            del y
            gc.collect()
            # back in the cache: no longer traced, as when NumPy frees a block
            assert tracemalloc.get_traced_memory()[0] - base < 64 * 1024
            assert _traced_numpy_bytes() == base_numpy
        tracemalloc.reset_peak()
        peak_base = tracemalloc.get_traced_memory()[0]
        y = fastln.layer_norm(x)
        assert tracemalloc.get_traced_memory()[1] - peak_base >= x.nbytes
    finally:
        tracemalloc.stop()


def test_a_view_keeps_the_block_alive(cache):
    x = large_input()
    expected = fastln.layer_norm(x, out=np.empty_like(x))
    y = fastln.layer_norm(x)
    views = [y[10:20], y.T, y.reshape(-1), np.asarray(y), memoryview(y)]
    del y
    gc.collect()
    assert fastln.output_cache_info()["blocks"] == 0
    fastln.layer_norm(x * 2)  # a new output: may not land on the views' memory
    assert_bitwise_equal(views[0], expected[10:20])
    assert_bitwise_equal(views[1], expected.T)
    assert_bitwise_equal(np.asarray(views[4]), expected)
    first_view = views.pop(0)
    del views
    gc.collect()
    assert fastln.output_cache_info()["blocks"] <= 1  # the x * 2 output, the views' block not
    assert_bitwise_equal(first_view, expected[10:20])
    blocks = fastln.output_cache_info()["blocks"]
    del first_view
    assert fastln.output_cache_info()["blocks"] == blocks + 1


def test_copies_and_pickles_of_outputs(cache):
    x = large_input()
    y = fastln.layer_norm(x)
    expected = y.copy()
    for other in (copy.copy(y), copy.deepcopy(y), pickle.loads(pickle.dumps(y)),
                  pickle.loads(pickle.dumps(y, protocol=5)), np.array(y), y.astype(np.float64)):
        np.testing.assert_array_equal(other, expected)
        assert address(other) != address(y)
    buffer = io.BytesIO()
    np.save(buffer, y)
    buffer.seek(0)
    np.testing.assert_array_equal(np.load(buffer), expected)
    _, cache_ = fastln.layer_norm_forward(x)
    assert pickle.loads(pickle.dumps(cache_.mean)).shape == (x.shape[0],)


def test_resize_uses_the_handlers_realloc(cache):
    x = large_input()
    y = fastln.layer_norm(x)
    expected = y.copy()
    n_rows = x.shape[0]
    y.resize((2 * n_rows, COLS), refcheck=False)  # grows: a new block, the data copied, zeros
    assert handler_name(y) == "fastln_output_cache"
    assert_bitwise_equal(y[:n_rows], expected)
    assert not y[n_rows:].any()
    y.resize((100, COLS), refcheck=False)  # shrinks in place
    assert_bitwise_equal(y, expected[:100])
    y.resize((3,), refcheck=False)
    assert_bitwise_equal(y, expected.reshape(-1)[:3])
    del y
    resized = np.resize(fastln.layer_norm(x), (n_rows + 10, COLS))  # NumPy's own copy
    assert_bitwise_equal(resized[:n_rows], expected)


def test_calloc_and_malloc_of_the_handler_directly(cache):
    """np.zeros goes through the handler's calloc: zeros also in a recycled, dirty block."""
    with _output_cache.installed():
        dirty = np.empty(33 * MIB, np.uint8)
    dirty[...] = 0xAB
    del dirty
    assert fastln.output_cache_info()["blocks"] == 1
    with _output_cache.installed():
        zeros = np.zeros(33 * MIB, np.uint8)  # reuses the dirty block
        fresh = np.zeros(35 * MIB, np.uint8)  # a fresh mapping
        tiny = np.zeros(3, np.uint8)
        empty = np.empty(0)
    assert fastln.output_cache_info()["blocks"] == 0
    for array in (zeros, fresh, tiny):
        assert handler_name(array) == "fastln_output_cache"
        assert not array.any()
    assert empty.size == 0
    del zeros, fresh, tiny, empty
    assert fastln.output_cache_info()["blocks"] == 2  # the 32 MiB-and-up blocks only


def test_threads_allocating_and_freeing_at_once(cache):
    """8 threads make outputs of three sizes and free them - half of them on another thread."""
    fastln.set_output_cache(100 * MIB)  # at most 2 or 3 blocks: contested
    inputs = [large_input(mib, seed=mib) for mib in (32, 34, 36)]
    expected = [fastln.layer_norm(x, out=np.empty_like(x)) for x in inputs]
    handed_over = queue.Queue()
    errors = []
    before = fastln.output_cache_info()
    n_threads, n_calls = 8, 16

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for i in range(n_calls):
                k = int(rng.integers(len(inputs)))
                y = fastln.layer_norm(inputs[k], num_threads=int(rng.integers(1, 3)))
                if not np.array_equal(y, expected[k]):
                    errors.append(f"thread {seed}, call {i}: wrong result")
                y[...] = np.nan
                if i % 2:
                    handed_over.put(y)  # freed by whichever thread takes it
                del y
                try:
                    handed_over.get_nowait()
                except queue.Empty:
                    pass
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    while not handed_over.empty():
        handed_over.get()
    assert not errors, errors[:5]
    info = fastln.output_cache_info()
    assert (info["hits"] - before["hits"]) + (info["misses"] - before["misses"]) \
        == n_threads * n_calls
    assert info["hits"] > before["hits"]
    assert info["blocks"] <= 8 and info["cached_bytes"] <= 100 * MIB
