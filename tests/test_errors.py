"""Every error path: the exception type, a message that names the argument (and says what was
expected and what was given), and inputs - including a caller's out buffer - left untouched.

The reference takes the same arguments and promises the same errors, so every case runs against
fastln and fastln.reference alike.
"""
import datetime
import operator
import re
from types import SimpleNamespace

import numpy as np
import pytest

import fastln
import fastln.reference as ref
from conftest import Snapshot

IMPLS = {"fastln": fastln, "reference": ref}
FORWARDS = ["layer_norm", "layer_norm_forward"]
SENTINEL = 7.0


def names_argument(message, name):
    """The argument's name as a word of its own ("x" must not match the x of "expected")."""
    return re.search(r"(?<![\w.])" + re.escape(name) + r"(?![\w])", message) is not None


def test_names_argument_helper():
    assert names_argument("x has dtype float16", "x")
    assert names_argument("x.shape[axis:] = (0,) is empty", "x")
    assert not names_argument("expected a float", "x")
    assert not names_argument("max_x is wrong", "x")
    assert names_argument("num_threads must be None", "num_threads")


# --------------------------------------------------------------------------------------------
# Forward errors: (id, overrides of the call's arguments, exception, argument named, also in msg)
# The default call is f(x, gamma, beta, eps=1e-5, axis=-1, out=None, num_threads=None) with a
# float32 x of shape (4, 3).
# --------------------------------------------------------------------------------------------

class _FailsToConvert:
    """An array-like whose __array__ (or __len__) raises an error of its own."""

    def __init__(self, in_len=False):
        self.in_len = in_len

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("boom")

    def __len__(self):
        if self.in_len:
            raise LookupError("no length")
        return 3

    def __getitem__(self, index):
        raise IndexError(index)


def _x(dtype=np.float32, shape=(4, 3)):
    return (np.arange(np.prod(shape), dtype=np.float64).reshape(shape) ** 2 % 7).astype(dtype)


FORWARD_CASES = [
    # x: dtypes without a kernel
    ("x-longdouble", dict(x=lambda: _x(np.longdouble)), TypeError, "x", ["float128"]),
    ("x-complex", dict(x=lambda: _x(np.complex128)), TypeError, "x", ["complex128"]),
    ("x-complex64", dict(x=lambda: _x(np.complex64)), TypeError, "x", ["complex64"]),
    ("x-longdouble", dict(x=lambda: _x(np.longdouble)), TypeError, "x", []),
    ("x-object-array", dict(x=lambda: _x().astype(object)), TypeError, "x", ["object"]),
    ("x-str-array", dict(x=lambda: np.array([["a", "b"], ["c", "d"]])), TypeError, "x", []),
    ("x-bytes-array", dict(x=lambda: np.array([[b"a", b"b"]])), TypeError, "x", []),
    ("x-str-list", dict(x=lambda: [["a", "b"], ["c", "d"]]), TypeError, "x", []),
    ("x-datetime64", dict(x=lambda: np.array([["2020-01-01", "2021-01-01"]], "M8[D]")),
     TypeError, "x", ["datetime64"]),
    ("x-timedelta64", dict(x=lambda: np.arange(6).astype("m8[s]").reshape(2, 3)),
     TypeError, "x", ["timedelta64"]),
    ("x-datetime-list", dict(x=lambda: [[datetime.datetime(2020, 1, 1)] * 3]), TypeError, "x",
     []),
    ("x-ragged", dict(x=lambda: [[1.0, 2.0], [3.0]]), TypeError, "x", []),
    ("x-None", dict(x=lambda: None), TypeError, "x", []),
    ("x-dict", dict(x=lambda: {"a": 1}), TypeError, "x", []),
    ("x-structured", dict(x=lambda: np.zeros((2, 3), dtype=[("a", "f4")])), TypeError, "x", []),
    # an object whose own conversion fails (any exception): still the argument's TypeError
    ("x-array-raises", dict(x=lambda: _FailsToConvert()), TypeError, "x", ["boom"]),
    ("x-len-raises", dict(x=lambda: _FailsToConvert(in_len=True)), TypeError, "x", []),
    # x: shapes
    ("x-0d-array", dict(x=lambda: np.array(3.0)), ValueError, "x", ["0-d"]),
    ("x-0d-float32", dict(x=lambda: np.float32(3.0)), ValueError, "x", []),
    ("x-python-float", dict(x=lambda: 3.0), ValueError, "x", []),
    ("x-empty-row", dict(x=lambda: np.empty((4, 0), np.float32), gamma=None, beta=None),
     ValueError, "x", ["(0,)"]),
    ("x-empty-1d", dict(x=lambda: np.empty((0,), np.float32), gamma=None, beta=None),
     ValueError, "x", []),
    ("x-empty-normalized-part", dict(x=lambda: np.empty((2, 0, 3), np.float64), axis=1,
                                     gamma=None, beta=None), ValueError, "x", ["(0, 3)"]),
    # axis
    ("axis-too-big", dict(axis=2), ValueError, "axis", ["2"]),
    ("axis-too-small", dict(axis=-3), ValueError, "axis", ["-3"]),
    ("axis-float", dict(axis=1.0), TypeError, "axis", ["float"]),
    ("axis-str", dict(axis="1"), TypeError, "axis", []),
    ("axis-None", dict(axis=None), TypeError, "axis", []),
    # gamma / beta: shapes (no broadcasting) and dtypes
    ("gamma-long", dict(gamma=lambda: np.ones(4, np.float32)), ValueError, "gamma",
     ["(4,)", "(3,)"]),
    ("gamma-short", dict(gamma=lambda: np.ones(1, np.float32)), ValueError, "gamma",
     ["(1,)", "(3,)"]),
    ("gamma-scalar", dict(gamma=lambda: 2.0), ValueError, "gamma", ["()"]),
    ("gamma-2d", dict(gamma=lambda: np.ones((1, 3), np.float32)), ValueError, "gamma",
     ["(1, 3)"]),
    ("gamma-full-x-shape", dict(gamma=lambda: np.ones((4, 3), np.float32)), ValueError, "gamma",
     ["(4, 3)"]),
    ("gamma-for-axis0", dict(axis=0), ValueError, "gamma", ["(3,)", "(4, 3)"]),
    ("gamma-complex", dict(gamma=lambda: np.ones(3, np.complex64)), TypeError, "gamma",
     ["complex64"]),
    ("gamma-str", dict(gamma=lambda: ["a", "b", "c"]), TypeError, "gamma", []),
    ("gamma-object", dict(gamma=lambda: np.array([1, 2, 3], object)), TypeError, "gamma", []),
    ("gamma-datetime", dict(gamma=lambda: np.zeros(3, "M8[s]")), TypeError, "gamma", []),
    ("gamma-array-raises", dict(gamma=lambda: _FailsToConvert()), TypeError, "gamma", ["boom"]),
    ("beta-long", dict(beta=lambda: np.zeros(4, np.float32)), ValueError, "beta",
     ["(4,)", "(3,)"]),
    ("beta-scalar", dict(beta=lambda: 0.0), ValueError, "beta", []),
    ("beta-complex", dict(beta=lambda: np.zeros(3, np.complex128)), TypeError, "beta", []),
    ("beta-str", dict(beta=lambda: np.array(["a", "b", "c"])), TypeError, "beta", []),
    # eps
    ("eps-str", dict(eps="1e-5"), TypeError, "eps", ["str"]),
    ("eps-None", dict(eps=None), TypeError, "eps", []),
    ("eps-list", dict(eps=[1e-5]), TypeError, "eps", []),
    ("eps-array", dict(eps=lambda: np.array([1e-5])), TypeError, "eps", []),
    ("eps-complex", dict(eps=1e-5 + 0j), TypeError, "eps", []),
    ("eps-bool", dict(eps=True), TypeError, "eps", []),
    ("eps-nan", dict(eps=float("nan")), ValueError, "eps", ["nan"]),
    ("eps-np-nan", dict(eps=np.float32("nan")), ValueError, "eps", []),
    ("eps-inf", dict(eps=float("inf")), ValueError, "eps", ["inf"]),
    ("eps-minus-inf", dict(eps=-float("inf")), ValueError, "eps", []),
    ("eps-negative", dict(eps=-1e-5), ValueError, "eps", ["-1e-05"]),
    ("eps-negative-int", dict(eps=-1), ValueError, "eps", []),
    # num_threads
    ("threads-zero", dict(num_threads=0), ValueError, "num_threads", ["0"]),
    ("threads-negative", dict(num_threads=-2), ValueError, "num_threads", ["-2"]),
    ("threads-float", dict(num_threads=2.0), ValueError, "num_threads", ["2.0"]),
    ("threads-str", dict(num_threads="2"), ValueError, "num_threads", []),
    ("threads-bool", dict(num_threads=True), ValueError, "num_threads", []),
    ("threads-np-zero", dict(num_threads=np.int64(0)), ValueError, "num_threads", []),
    # out
    ("out-list", dict(out=lambda: [[0.0] * 3] * 4), TypeError, "out", ["list"]),
    ("out-tuple", dict(out=lambda: (0.0,)), TypeError, "out", []),
    ("out-shape", dict(out=lambda: np.zeros((3, 4), np.float32)), ValueError, "out",
     ["(3, 4)", "(4, 3)"]),
    ("out-flat", dict(out=lambda: np.zeros(12, np.float32)), ValueError, "out", []),
    ("out-dtype", dict(out=lambda: np.zeros((4, 3), np.float64)), ValueError, "out",
     ["float64", "float32"]),
    ("out-dtype-int-x", dict(x=lambda: np.arange(12).reshape(4, 3), gamma=None, beta=None,
                             out=lambda: np.zeros((4, 3), np.int64)), ValueError, "out",
     ["int64", "float64"]),
    ("out-byteswapped", dict(out=lambda: np.zeros((4, 3), ">f4" if np.little_endian else "<f4")),
     ValueError, "out", []),
    ("out-fortran", dict(out=lambda: np.zeros((4, 3), np.float32, order="F")), ValueError,
     "out", ["contiguous"]),
    ("out-strided", dict(out=lambda: np.zeros((4, 6), np.float32)[:, ::2]), ValueError, "out",
     []),
    ("out-readonly", dict(out=lambda: _readonly(np.zeros((4, 3), np.float32))), ValueError,
     "out", []),
]


def _readonly(a):
    a.setflags(write=False)
    return a


def _resolve(value):
    return value() if callable(value) else value


def _forward_call(overrides, with_out):
    kwargs = dict(x=_x(), gamma=np.full(3, 2.0, np.float32), beta=np.full(3, -1.0, np.float32),
                  eps=1e-5, axis=-1, out=None, num_threads=None)
    if with_out:  # a valid out buffer that must not be written by a failing call
        kwargs["out"] = np.full((4, 3), SENTINEL, np.float32)
    for key, value in overrides.items():
        kwargs[key] = _resolve(value)
    if with_out and "out" not in overrides:
        x = kwargs["x"]
        if isinstance(x, np.ndarray) and x.dtype.kind == "f" and x.dtype.itemsize in (4, 8):
            kwargs["out"] = np.full(x.shape, SENTINEL, x.dtype.newbyteorder("="))
    x = kwargs.pop("x")
    gamma = kwargs.pop("gamma")
    beta = kwargs.pop("beta")
    eps = kwargs.pop("eps")
    return (x, gamma, beta, eps), kwargs


def _check_raises(func, args, kwargs, exc_type, name, also):
    arrays = list(args) + list(kwargs.values())
    snap = Snapshot(*arrays)
    out = kwargs.get("out")
    out_before = out.copy() if isinstance(out, np.ndarray) else None
    with pytest.raises(exc_type) as info:
        func(*args, **kwargs)
    message = str(info.value)
    assert names_argument(message, name), f"message does not name {name!r}: {message!r}"
    for fragment in also:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    snap.assert_unchanged()
    if out_before is not None:
        np.testing.assert_array_equal(out, out_before)


# Each case also runs with a valid out buffer (unless the case is about out), which must still
# hold its sentinel values afterwards: the errors come before any work.
FORWARD_CASES_WITH_OUT = [
    pytest.param(case, with_out, id=f"{case[0]}-{'with_out' if with_out else 'no_out'}")
    for case in FORWARD_CASES for with_out in (False, True)
    if not (with_out and "out" in case[1])
]


@pytest.mark.parametrize("func", FORWARDS)
@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("case,with_out", FORWARD_CASES_WITH_OUT)
def test_forward_errors(case, with_out, impl, func):
    _, overrides, exc_type, name, also = case
    args, kwargs = _forward_call(overrides, with_out)
    _check_raises(getattr(IMPLS[impl], func), args, kwargs, exc_type, name, also)


@pytest.mark.parametrize("func", FORWARDS)
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_gamma_shape_message_is_the_documented_one(impl, func):
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError) as info:
        getattr(IMPLS[impl], func)(x, np.ones(4))
    assert "gamma has shape (4,), expected x.shape[axis:] = (3,)" in str(info.value)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("overlap", ["same", "shifted", "reversed_view"])
def test_forward_refuses_out_overlapping_x(impl, overlap):
    """layer_norm_forward keeps x for the backward, so its out may not overlap x."""
    buf = np.arange(5 * 3, dtype=np.float64).reshape(5, 3) ** 2 % 11
    if overlap == "same":
        x, out = buf[:4], buf[:4]
    elif overlap == "shifted":
        x, out = buf[1:], buf[:4]
    else:
        x, out = buf[:4][::-1], buf[:4]
    snap = Snapshot(x)
    before = buf.copy()
    with pytest.raises(ValueError) as info:
        IMPLS[impl].layer_norm_forward(x, out=out)
    assert names_argument(str(info.value), "out")
    assert names_argument(str(info.value), "x")
    snap.assert_unchanged()
    np.testing.assert_array_equal(buf, before)


def test_layer_norm_accepts_out_equal_to_x_but_forward_does_not():
    x = np.arange(12, dtype=np.float64).reshape(4, 3) ** 2
    expected = fastln.layer_norm(x.copy())
    assert fastln.layer_norm(x, out=x) is x
    np.testing.assert_array_equal(x, expected)
    with pytest.raises(ValueError):
        fastln.layer_norm_forward(x, out=x)


# --------------------------------------------------------------------------------------------
# Backward errors
# --------------------------------------------------------------------------------------------

def _forward_for(impl, dtype=np.float32, shape=(4, 3), axis=-1):
    x = _x(dtype, shape)
    _, cache = IMPLS[impl].layer_norm_forward(x, axis=axis)
    return x, cache


BACKWARD_CASES = [
    # cache of the wrong type
    ("cache-None", dict(cache=lambda impl: None), TypeError, "cache", []),
    ("cache-tuple", dict(cache=lambda impl: (np.zeros(4), np.ones(4))), TypeError, "cache", []),
    ("cache-dict", dict(cache=lambda impl: {"mean": np.zeros(4), "rstd": np.ones(4)}),
     TypeError, "cache", []),
    ("cache-array", dict(cache=lambda impl: np.zeros(4)), TypeError, "cache", []),
    ("cache-y", dict(cache=lambda impl: IMPLS[impl].layer_norm(_x())), TypeError, "cache", []),
    ("cache-other-op", dict(cache=lambda impl: SimpleNamespace(
        op="rms_norm", x=_x(), mean=np.zeros(4, np.float32), rstd=np.ones(4, np.float32),
        axis=1, eps=1e-5, shape=(4, 3), dtype=np.dtype(np.float32))), ValueError, "cache", []),
    # dy that does not match the cache
    ("dy-shape", dict(dy=lambda: np.ones((3, 4), np.float32)), ValueError, "dy",
     ["(3, 4)", "(4, 3)"]),
    ("dy-shape-extra-dim", dict(dy=lambda: np.ones((1, 4, 3), np.float32)), ValueError, "dy",
     []),
    ("dy-shape-1d", dict(dy=lambda: np.ones(12, np.float32)), ValueError, "dy", []),
    ("dy-dtype-float64", dict(dy=lambda: np.ones((4, 3), np.float64)), ValueError, "dy",
     ["float64", "float32"]),
    ("dy-dtype-float16", dict(dy=lambda: np.ones((4, 3), np.float16)), ValueError, "dy", []),
    ("dy-dtype-int", dict(dy=lambda: np.ones((4, 3), np.int32)), ValueError, "dy", []),
    ("dy-dtype-int64-for-float64", dict(dy=lambda: np.ones((4, 3), np.int64),
                                        cache_dtype=np.float64), ValueError, "dy", []),
    ("dy-dtype-float32-for-float64", dict(dy=lambda: np.ones((4, 3), np.float32),
                                          cache_dtype=np.float64), ValueError, "dy", []),
    ("dy-str", dict(dy=lambda: [["a", "b", "c"]] * 4), TypeError, "dy", []),
    ("dy-ragged", dict(dy=lambda: [[1.0, 2.0], [3.0]]), TypeError, "dy", []),
    # gamma
    ("gamma-shape", dict(gamma=lambda: np.ones(4, np.float32)), ValueError, "gamma",
     ["(4,)", "(3,)"]),
    ("gamma-scalar", dict(gamma=lambda: 1.0), ValueError, "gamma", []),
    ("gamma-complex", dict(gamma=lambda: np.ones(3, np.complex64)), TypeError, "gamma", []),
    ("gamma-str", dict(gamma=lambda: np.array(["a", "b", "c"])), TypeError, "gamma", []),
    # num_threads
    ("threads-zero", dict(num_threads=0), ValueError, "num_threads", []),
    ("threads-float", dict(num_threads=1.0), ValueError, "num_threads", []),
    ("threads-bool", dict(num_threads=False), ValueError, "num_threads", []),
    # out
    ("out-list", dict(out=lambda: [[0.0] * 3] * 4), TypeError, "out", []),
    ("out-shape", dict(out=lambda: np.zeros((4, 4), np.float32)), ValueError, "out", []),
    ("out-dtype", dict(out=lambda: np.zeros((4, 3), np.float64)), ValueError, "out", []),
    ("out-fortran", dict(out=lambda: np.zeros((4, 3), np.float32, order="F")), ValueError,
     "out", []),
    ("out-readonly", dict(out=lambda: _readonly(np.zeros((4, 3), np.float32))), ValueError,
     "out", []),
]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=[c[0] for c in BACKWARD_CASES])
def test_backward_errors(case, impl):
    _, overrides, exc_type, name, also = case
    overrides = dict(overrides)
    dtype = overrides.pop("cache_dtype", np.float32)
    x, cache = _forward_for(impl, dtype)
    dy = np.full((4, 3), 0.5, dtype)
    gamma = np.full(3, 2.0, dtype)
    kwargs = {"out": None, "num_threads": None}
    for key, value in overrides.items():
        if key == "cache":
            cache = value(impl)
        elif key == "dy":
            dy = value()
        elif key == "gamma":
            gamma = value()
        else:
            kwargs[key] = _resolve(value)
    func = IMPLS[impl].layer_norm_backward
    snapshot_extra = [getattr(cache, a, None) for a in ("x", "mean", "rstd")]
    snap = Snapshot(x, *snapshot_extra)
    _check_raises(func, (dy, cache, gamma), kwargs, exc_type, name, also)
    snap.assert_unchanged()


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_backward_cache_for_other_axis(impl):
    """A cache of a (2, 3, 4) forward over axis=1 with a dy of the right size but other shape."""
    x, cache = _forward_for(impl, np.float64, (2, 3, 4), axis=1)
    with pytest.raises(ValueError) as info:
        IMPLS[impl].layer_norm_backward(np.ones((6, 4)), cache)
    assert names_argument(str(info.value), "dy")
    with pytest.raises(ValueError) as info:
        IMPLS[impl].layer_norm_backward(np.ones((2, 3, 4)), cache, np.ones(4))
    assert names_argument(str(info.value), "gamma")


@pytest.mark.parametrize("backward_impl,forward_impl", [("reference", "fastln"),
                                                         ("fastln", "reference")])
def test_cache_of_the_other_implementation(backward_impl, forward_impl):
    """A cache from the other implementation's forward: either it works (and gives the right
    gradients) or it is refused with a TypeError naming the cache - never another exception."""
    x = _x(np.float64)
    dy = np.linspace(-1, 1, 12).reshape(4, 3)
    _, cache = IMPLS[forward_impl].layer_norm_forward(x)
    _, own_cache = IMPLS[backward_impl].layer_norm_forward(x)
    expected = IMPLS[backward_impl].layer_norm_backward(dy, own_cache)
    try:
        got = IMPLS[backward_impl].layer_norm_backward(dy, cache)
    except TypeError as exc:
        assert names_argument(str(exc), "cache")
    else:
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_errors_happen_before_any_work_on_a_big_call(impl):
    """A bad argument that comes last in the signature still stops the call before out is
    written, also for a call big enough to be threaded."""
    x = np.ones((300, 300)) + np.arange(300)
    out = np.full(x.shape, SENTINEL)
    for bad in (dict(num_threads=0), dict(eps=-1.0), dict(beta=np.zeros(299))):
        with pytest.raises((TypeError, ValueError)):
            IMPLS[impl].layer_norm(x, **bad, out=out)
        assert np.all(out == SENTINEL), bad


# --------------------------------------------------------------------------------------------
# Numeric arguments of every kind (issue: eps=10**400 and momentum=10**400 raised
# OverflowError, axis=True was taken as 1). Every number type Python and NumPy have: huge and
# tiny ints, Fractions and Decimals beyond float64, NumPy scalars, bools. A value is either
# taken as the number it is (the result is then the one of that number as a float or int) or
# refused with the contract's TypeError / ValueError naming the argument.
# --------------------------------------------------------------------------------------------

from decimal import Decimal  # noqa: E402
from fractions import Fraction  # noqa: E402

HUGE = 10**400
ENORMOUS = 10**5000  # beyond the 4300 digits Python agrees to print
# (argument, value, the plain value it means - or the error it gets)
NUMERIC_CASES = [
    ("eps", HUGE, ValueError), ("eps", -HUGE, ValueError), ("eps", ENORMOUS, ValueError),
    ("eps", -ENORMOUS, ValueError), ("eps", Fraction(HUGE, 3), ValueError),
    ("eps", Fraction(-1, HUGE), ValueError), ("eps", Decimal("1e400"), ValueError),
    ("eps", Decimal("-1e-400"), ValueError), ("eps", Decimal("sNaN"), ValueError),
    ("eps", Decimal("NaN"), ValueError), ("eps", np.longdouble("1e4000"), ValueError),
    ("eps", True, TypeError), ("eps", np.True_, TypeError), ("eps", 1e-5 + 0j, TypeError),
    ("eps", Fraction(1, 10**5), 1e-5), ("eps", Fraction(1, HUGE), 0.0),
    ("eps", Decimal("0.001"), 1e-3), ("eps", np.float16(0.25), 0.25), ("eps", 2, 2.0),
    ("eps", np.uint64(3), 3.0),
    ("axis", True, TypeError), ("axis", np.True_, TypeError), ("axis", HUGE, ValueError),
    ("axis", -ENORMOUS, ValueError), ("axis", Fraction(1), TypeError),
    ("axis", Decimal(1), TypeError), ("axis", np.int8(-1), -1), ("axis", np.uint64(1), 1),
    ("num_threads", ENORMOUS, 1), ("num_threads", HUGE, 1), ("num_threads", np.uint64(2), 2),
    ("num_threads", -ENORMOUS, ValueError), ("num_threads", True, ValueError),
    ("num_threads", Fraction(2), ValueError), ("num_threads", Decimal(2), ValueError),
    ("momentum", HUGE, ValueError), ("momentum", Fraction(HUGE + 1, HUGE), ValueError),
    ("momentum", Fraction(-1, HUGE), ValueError), ("momentum", Decimal("NaN"), ValueError),
    ("momentum", True, TypeError), ("momentum", Decimal("0.25"), 0.25),
    # NumPy registers timedelta64 as an integer: a duration is no number of threads or eps
    ("eps", np.timedelta64(5), TypeError), ("momentum", np.timedelta64(0), TypeError),
    ("num_threads", np.timedelta64(2), ValueError), ("axis", np.timedelta64(0), TypeError),
    ("momentum", Fraction(1, 4), 0.25), ("momentum", np.float32(0.5), 0.5),
]
NUMERIC_FUNCS = ["layer_norm", "layer_norm_forward", "rms_norm", "rms_norm_forward",
                 "add_layer_norm", "add_rms_norm_forward", "batch_norm", "batch_norm_forward",
                 "layer_norm_backward", "rms_norm_backward", "batch_norm_backward"]


def _takes(func, argument):
    if func.endswith("backward"):
        return argument == "num_threads"
    return argument != "momentum" or func.startswith("batch")


def _numeric_call(impl, func, argument, value):
    """(call, out): func called with `argument` set to value and a valid out buffer (which a
    failing call must leave as it is)."""
    module = IMPLS[impl]
    x = _x(np.float64, (4, 2, 3))
    out = np.full(x.shape, SENTINEL)
    if func.endswith("backward"):
        forward = getattr(module, func.replace("backward", "forward"))
        _, cache = forward(x, training=True) if func.startswith("batch") else forward(x)
        return lambda: getattr(module, func)(np.ones_like(x), cache, out=out,
                                             num_threads=value), out
    args, kwargs = (x,), {argument: value, "out": out}
    if func.startswith("add"):
        args, kwargs["sum_out"] = (x, x.copy()), np.full(x.shape, SENTINEL)
    if func.startswith("batch"):
        try:  # the running statistics have the length of the feature axis
            n_features = x.shape[operator.index(value) if argument == "axis" else -1]
        except (TypeError, IndexError):
            n_features = 3  # an invalid axis: refused before the statistics are looked at
        kwargs.update(training=True, running_mean=np.zeros(n_features),
                      running_var=np.ones(n_features))
    return lambda: getattr(module, func)(*args, **kwargs), out


def _arrays_of(result):
    return [r for r in (result if isinstance(result, tuple) else (result,))
            if isinstance(r, np.ndarray)]


NUMERIC_PARAMS = [pytest.param(func, argument, value, meaning,
                                 id=f"{func}-{argument}-{type(value).__name__}-{index}")
                  for func in NUMERIC_FUNCS
                  for index, (argument, value, meaning) in enumerate(NUMERIC_CASES)
                  if _takes(func, argument)]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("func, argument, value, meaning", NUMERIC_PARAMS)
def test_numeric_arguments_of_every_kind(impl, func, argument, value, meaning):
    call, out = _numeric_call(impl, func, argument, value)
    if isinstance(meaning, type):
        with pytest.raises(meaning) as info:
            call()
        message = str(info.value)
        assert names_argument(message, argument), message
        assert len(message) < 400, "the value must be shortened in the message"
        assert np.all(out == SENTINEL), "a failing call wrote out"
        return
    expected_call, _ = _numeric_call(impl, func, argument, meaning)
    got, expected = _arrays_of(call()), _arrays_of(expected_call())
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
