"""No kernel reads or writes a byte outside the arrays it is given, in any instruction set.

Every array of a call (x, residual, dy, gamma, beta, the running statistics and out) is put in
memory of its own, flush against a page that may not be read or written: its last byte is the
last one before such a page ("end"), or its first byte the first one after one ("start"). A
vector load or store that reaches past either end of an array - a tail read a whole vector at a
time, a streamed store of a line the array only begins, a load before the first element - then
stops the process with a segmentation fault. AddressSanitizer (tools/sanitize.sh) misses some
of those: it checks the loads and stores the compiler emits itself, not the masked and
non-temporal ones, which are compiler builtins; here every instruction set this CPU runs is
taken in turn.

A fault kills the process, so each family of operations runs in a child Python, case after
case; the child names each case before it runs it, and the test reports the last one named if
the child dies. Each guarded call is also held bit for bit to the same call on ordinary arrays:
where an array sits must not change what is computed.
"""
import ctypes
import functools
import mmap
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import fastln
from conftest import BFLOAT16, assert_bitwise_equal
from fastln import _kernels

FAMILIES = ("rows", "batch_norm", "group_norm")


def _run_child(argument, timeout):
    """This file run as a script with argument (without faulthandler's report of a fault)."""
    return subprocess.run([sys.executable, __file__, argument], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONFAULTHANDLER": ""})


@pytest.mark.parametrize("family", FAMILIES)
def test_no_access_outside_the_arrays(family):
    result = _run_child(family, timeout=600)
    named = [line for line in result.stdout.splitlines() if line.startswith("case ")]
    assert result.returncode == 0, (
        f"the child exited with {result.returncode} during "
        f"{named[-1] if named else 'its start'}\n{result.stderr[-3000:]}")
    assert result.stdout.rstrip().endswith(f"{family}: all cases done")
    # every family runs each of its cases in every instruction set and placement
    assert len(named) >= 100, len(named)


@pytest.mark.parametrize("side", ["end", "start"])
def test_the_guard_stops_an_access_one_byte_outside(side):
    """The harness itself: a read of the byte just past the end (before the start) faults."""
    result = _run_child(f"outside-{side}", timeout=60)
    assert "the guarded array reads back" in result.stdout
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stderr[-2000:])


# ---- the child ---------------------------------------------------------------------------------

def _guarded_memory():
    """guarded(values, side) copies values into memory flush against an inaccessible page;
    release() lets the mappings made so far go with their arrays (a process may only have so
    many)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    keep = []  # the mappings of the case in hand (see release)

    def guarded(values, side):
        values = np.ascontiguousarray(values)
        n_bytes = values.nbytes
        pages = max(1, -(-n_bytes // page))
        memory = mmap.mmap(-1, (pages + 2) * page)
        keep.append(memory)
        raw = np.frombuffer(memory, dtype=np.uint8)
        address = raw.ctypes.data
        for guard in (address, address + (pages + 1) * page):
            if libc.mprotect(guard, page, 0) != 0:  # PROT_NONE
                raise OSError(ctypes.get_errno(), "mprotect failed")
        start = page if side == "start" else (pages + 1) * page - n_bytes
        array = raw[start:start + n_bytes].view(values.dtype).reshape(values.shape)
        array[...] = values
        return array

    def release():
        keep.clear()

    return guarded, release


# every storage type (bfloat16 with ml_dtypes, a test extra)
DTYPES = [np.float32, np.float64, np.float16] + ([BFLOAT16] if BFLOAT16 is not None else [])


# Sizes from which the kernels stream their outputs or fetch ahead (src/fastln/_kernels.pyx),
# with room.
STREAMED_ROWS_BYTES = 33 * 2**20
FETCHED_ROWS_BYTES = 5 * 2**20  # each of dy, x and dx
STREAMED_BATCH_NORM_BYTES = 5 * 2**20
STREAMED_GROUP_NORM_BYTES = 13 * 2**20


def _count_for(n_bytes, elements_per_item, dtype):
    """How many items of elements_per_item elements of dtype take at least n_bytes."""
    item_bytes = elements_per_item * np.dtype(dtype).itemsize
    return -(-n_bytes // item_bytes)


def _row_cases(dtype, rng):
    widths = (1, 2, 3, 5, 7, 15, 16, 17, 31, 33, 63, 64, 65, 100, 129, 777)
    shapes = [(rows, width) for width in widths for rows in (1, 3)] + [(300, 1000)]
    # a backward that fetches the next rows as it writes (dy, x and dx of 12 MiB and more), and
    # rows that share cache lines, in calls that stream y and dx (32 MiB and more)
    shapes.append((_count_for(FETCHED_ROWS_BYTES, 1000, dtype), 1000))
    shapes.append((_count_for(STREAMED_ROWS_BYTES, 2049, dtype), 2049))
    param = np.float64 if dtype is np.float64 else np.float32
    for shape in shapes:
        x = (rng.standard_normal(shape) + 3).astype(dtype)
        residual = rng.standard_normal(shape).astype(dtype)
        dy = rng.standard_normal(shape).astype(dtype)
        gamma = rng.standard_normal(shape[-1]).astype(param)
        beta = rng.standard_normal(shape[-1]).astype(param)
        threads = 2 if shape[0] >= 300 else 1

        def layer_norm(put, x=x, dy=dy, gamma=gamma, beta=beta, threads=threads):
            y, cache = fastln.layer_norm_forward(put(x), put(gamma), put(beta),
                                                 out=put(np.zeros_like(x)),
                                                 num_threads=threads)
            dx, dgamma, dbeta = fastln.layer_norm_backward(put(dy), cache, put(gamma),
                                                           out=put(np.zeros_like(x)),
                                                           num_threads=threads)
            return [y, cache.mean, cache.rstd, dx, dgamma, dbeta]

        def rms_norm(put, x=x, dy=dy, gamma=gamma, threads=threads):
            y, cache = fastln.rms_norm_forward(put(x), put(gamma), out=put(np.zeros_like(x)),
                                               num_threads=threads)
            dx, dgamma = fastln.rms_norm_backward(put(dy), cache, put(gamma),
                                                  out=put(np.zeros_like(x)),
                                                  num_threads=threads)
            return [y, cache.rstd, dx, dgamma]

        def add_norms(put, x=x, residual=residual, gamma=gamma, beta=beta, threads=threads):
            y, s, cache = fastln.add_layer_norm_forward(put(x), put(residual), put(gamma),
                                                        put(beta), bias=put(beta),
                                                        out=put(np.zeros_like(x)),
                                                        sum_out=put(np.zeros_like(x)),
                                                        num_threads=threads)
            y2, s2, cache2 = fastln.add_rms_norm_forward(put(x), put(residual), put(gamma),
                                                         out=put(np.zeros_like(x)),
                                                         sum_out=put(np.zeros_like(x)),
                                                         num_threads=threads)
            return [y, s, cache.mean, cache.rstd, y2, s2, cache2.rstd]

        for name, call in (("layer_norm", layer_norm), ("rms_norm", rms_norm),
                           ("add_norms", add_norms)):
            if shape[0] * shape[1] < 10**6 or name == "layer_norm":
                yield f"{name} {shape}", call


def _batch_norm_cases(dtype, rng):
    shapes = [((rows, features), -1) for features in (1, 3, 16, 17, 33, 100) for rows in (1, 5)]
    shapes += [((2, 3, 5, 7), 1), ((3, 17, 3, 3), 1), ((2, 4, 1, 1), 1), ((1, 33, 16), 1),
               ((2, 5, 7, 6), -1), ((64, 300), -1), ((16, 64, 9, 9), 1)]
    # streamed (4 MiB and more)
    shapes += [((_count_for(STREAMED_BATCH_NORM_BYTES, 300, dtype), 300), -1),
               ((_count_for(STREAMED_BATCH_NORM_BYTES, 64 * 46 * 46, dtype), 64, 46, 46), 1)]
    for shape, axis in shapes:
        x = (rng.standard_normal(shape) + 3).astype(dtype)
        dy = rng.standard_normal(shape).astype(dtype)
        n_features = shape[axis]
        param = np.float64 if dtype is np.float64 else np.float32
        gamma = rng.standard_normal(n_features).astype(param)
        beta = rng.standard_normal(n_features).astype(param)
        threads = 2 if x.size >= 10000 else 1
        for training in (True, False):
            def batch_norm(put, x=x, dy=dy, gamma=gamma, beta=beta, axis=axis,
                           training=training, threads=threads, n=n_features):
                running_mean = put(np.full(n, 0.5, param))
                running_var = put(np.full(n, 2.0, param))
                y, cache = fastln.batch_norm_forward(put(x), put(gamma), put(beta),
                                                     running_mean, running_var,
                                                     training=training, axis=axis,
                                                     out=put(np.zeros_like(x)),
                                                     num_threads=threads)
                dx, dgamma, dbeta = fastln.batch_norm_backward(put(dy), cache, put(gamma),
                                                               out=put(np.zeros_like(x)),
                                                               num_threads=threads)
                return [y, cache.mean, cache.rstd, running_mean, running_var, dx, dgamma,
                        dbeta]

            yield f"batch_norm {shape} axis={axis} training={training}", batch_norm


def _group_norm_cases(dtype, rng):
    shapes = [((2, 6, 5, 7), 3, 1), ((1, 32, 9, 9), 8, 1), ((3, 4, 1, 1), 2, 1),
              ((1, 8, 33), 4, 1), ((2, 5, 7, 6), 2, -1), ((1, 9, 9, 32), 8, -1),
              ((2, 3, 18), 3, -1), ((1, 64, 16, 16), 32, 1), ((2, 16, 16, 64), 32, -1)]
    # streamed (12 MiB and more): channels of whole 16-byte pieces that are not whole lines
    channels = 32 * _count_for(STREAMED_GROUP_NORM_BYTES, 32 * 28 * 30, dtype)
    shapes += [((1, channels, 28, 30), 32, 1), ((1, 28, 30, channels), 32, -1)]
    for shape, groups, channel_axis in shapes:
        x = (rng.standard_normal(shape) + 3).astype(dtype)
        dy = rng.standard_normal(shape).astype(dtype)
        param = np.float64 if dtype is np.float64 else np.float32
        gamma = rng.standard_normal(shape[channel_axis]).astype(param)
        beta = rng.standard_normal(shape[channel_axis]).astype(param)
        threads = 2 if x.size >= 10000 else 1

        def grouped(put, forward, backward, x=x, dy=dy, gamma=gamma, beta=beta,
                    channel_axis=channel_axis, threads=threads):
            y, cache = forward(put(x), gamma=put(gamma), beta=put(beta),
                               channel_axis=channel_axis, out=put(np.zeros_like(x)),
                               num_threads=threads)
            dx, dgamma, dbeta = backward(put(dy), cache, put(gamma), out=put(np.zeros_like(x)),
                                         num_threads=threads)
            return [y, cache.mean, cache.rstd, dx, dgamma, dbeta]

        yield (f"group_norm {shape} G={groups} channel_axis={channel_axis}",
               functools.partial(grouped, forward=functools.partial(fastln.group_norm_forward,
                                                                    num_groups=groups),
                                 backward=fastln.group_norm_backward))
        if channel_axis == 1 or x.size < 10**6:
            yield (f"instance_norm {shape} channel_axis={channel_axis}",
                   functools.partial(grouped, forward=fastln.instance_norm_forward,
                                     backward=fastln.instance_norm_backward))


def _child(family):
    cases_of = {"rows": _row_cases, "batch_norm": _batch_norm_cases,
                "group_norm": _group_norm_cases}[family]
    guarded, release = _guarded_memory()
    rng = np.random.default_rng(20261207)
    try:
        for variant in _kernels.instruction_sets():
            _kernels.use_instruction_set(variant)
            for dtype in DTYPES:
                for name, call in cases_of(dtype, rng):
                    expected = call(lambda a: np.array(a, copy=True))
                    for side in ("end", "start"):
                        label = f"case {name} {np.dtype(dtype).name} {variant} {side}"
                        print(label, flush=True)
                        results = call(lambda a, side=side: guarded(a, side))
                        for index, (e, a) in enumerate(zip(expected, results)):
                            assert_bitwise_equal(e, a, f"{label}, result {index}")
                        del results
                        release()
    finally:
        _kernels.use_instruction_set(None)
    print(f"{family}: all cases done", flush=True)


def _read_outside(side):
    guarded, _ = _guarded_memory()
    values = np.arange(5, dtype=np.float32)
    array = guarded(values, side)
    assert (array == values).all()
    print("the guarded array reads back", flush=True)
    outside = array.ctypes.data + array.nbytes if side == "end" else array.ctypes.data - 1
    print(ctypes.c_char.from_address(outside).value, flush=True)  # faults


if __name__ == "__main__":
    if sys.argv[1].startswith("outside-"):
        _read_outside(sys.argv[1].removeprefix("outside-"))
    else:
        _child(sys.argv[1])
