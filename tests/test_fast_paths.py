"""The C-level fast paths (row_norm_forward_fast, row_norm_backward_fast,
batch_norm_forward_fast, batch_norm_backward_fast, group_norm_forward_fast and
group_norm_backward_fast in _kernels.pyx).

Every public call is run twice on fresh copies of the same inputs: as it is, and with the fast
paths switched off (each returns None, so the general Python path runs). The two must agree bit
for bit, caches included (same class, same fields). The common calls must really take the fast
path; everything unusual must decline it and still get the general path's result or error.
"""
import re

import numpy as np
import pytest
from conftest import DTYPES, assert_bitwise_equal, random_input, random_params

import fastln
from fastln import _kernels
from fastln._caches import BatchNormCache, GroupNormCache, RowNormCache

FAST_FUNCTIONS = (
    (_kernels, "row_norm_forward_fast"),
    (_kernels, "row_norm_backward_fast"),
    (_kernels, "batch_norm_forward_fast"),
    (_kernels, "batch_norm_backward_fast"),
    (_kernels, "group_norm_forward_fast"),
    (_kernels, "group_norm_backward_fast"),
)
N_COLS = 96
SHAPES = ((N_COLS,), (5, N_COLS), (2, 3, N_COLS), (0, N_COLS))
CACHE_FIELDS = ("x", "mean", "rstd", "axis", "eps", "_dtype", "training", "dtype", "num_groups",
                "channel_axis")


# --------------------------------------------------------------------------------------------
# Running a call on each path
# --------------------------------------------------------------------------------------------

def fresh_inputs(dtype, shape, seed=0):
    """Every array a call may use, new each time (calls with out= or sum_out= write into them)."""
    rng = np.random.default_rng(seed)
    gamma, beta = random_params(rng, shape[-1], dtype)
    bias = random_params(rng, shape[-1], dtype)[1]
    return dict(x=random_input(rng, shape, dtype), residual=random_input(rng, shape, dtype),
                dy=random_input(rng, shape, dtype), gamma=gamma, beta=beta, bias=bias,
                out=np.full(shape, np.nan, dtype), sum_out=np.full(shape, np.nan, dtype))


class Outcome:
    """What a call did: its result, or the type and message of what it raised; and, for each
    fast-path function it called, (name, whether that produced the result)."""

    def __init__(self, call, inputs, monkeypatch, fast):
        self.inputs = inputs
        self.fast_results = []
        with monkeypatch.context() as patch:
            for module, name in FAST_FUNCTIONS:
                patch.setattr(module, name, self._spy(name, getattr(module, name)) if fast
                              else (lambda *args: None))
            try:
                self.result, self.error = call(inputs), None
            except Exception as exc:  # noqa: BLE001 - compared below, whatever it is
                self.result, self.error = None, (type(exc), str(exc))

    def _spy(self, name, fast_function):
        def spy(*args):
            result = fast_function(*args)
            self.fast_results.append((name, result is not None))
            return result
        return spy

    @property
    def took_fast_path(self):
        return any(taken for _, taken in self.fast_results)

    @property
    def always_fast(self):
        return bool(self.fast_results) and all(taken for _, taken in self.fast_results)

    @property
    def backward_took_fast_path(self):
        return any(taken for name, taken in self.fast_results if "backward" in name)


def run_both(call, dtype=np.float64, shape=(5, N_COLS), monkeypatch=None, seed=0):
    fast = Outcome(call, fresh_inputs(dtype, shape, seed), monkeypatch, fast=True)
    general = Outcome(call, fresh_inputs(dtype, shape, seed), monkeypatch, fast=False)
    assert fast.error == general.error
    if fast.error is None:
        assert_same_result(fast.result, general.result)
    return fast, general


def assert_fast_is_general(call, shape, monkeypatch):
    """run_both of a call that casts the float64 inputs itself: no error, every call on the
    fast path, and the general path's result."""
    fast, _ = run_both(call, np.float64, shape, monkeypatch)
    assert fast.error is None and fast.always_fast, fast.fast_results
    return fast


def assert_falls_back(call, dtype, shape, monkeypatch, backward=False):
    """An unusual call declines the fast path (the backward's, with backward) and gets the
    general path's result or error."""
    fast, _ = run_both(call, dtype, shape, monkeypatch)
    took_fast_path = fast.backward_took_fast_path if backward else fast.took_fast_path
    assert not took_fast_path, fast.fast_results


def assert_same_result(a, b, where="result"):
    """Same structure; arrays of the same type, dtype, shape, contiguity and bytes; caches of
    the same class with the same fields."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, tuple):
        assert len(a) == len(b), where
        for i, (item_a, item_b) in enumerate(zip(a, b)):
            assert_same_result(item_a, item_b, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.flags.c_contiguous == b.flags.c_contiguous, where
        assert_bitwise_equal(a, b, where)
    elif isinstance(a, (RowNormCache, BatchNormCache, GroupNormCache)):
        for field in CACHE_FIELDS:
            if hasattr(type(a), field) or hasattr(a, field):
                assert_same_result(getattr(a, field), getattr(b, field), f"{where}.{field}")
    else:
        assert a == b, (where, a, b)


# --------------------------------------------------------------------------------------------
# The common calls: fast path taken, bitwise the general path's result
# --------------------------------------------------------------------------------------------

def _params(op, with_params):
    if not with_params:
        return {}
    return {"layer_norm": ("gamma", "beta"), "rms_norm": ("gamma",)}[op]


def _norm_call(op, keep_cache, with_params, out, eps, num_threads, axis):
    function = getattr(fastln, op + ("_forward" if keep_cache else ""))

    def call(d):
        kwargs = dict(axis=d["x"].ndim - 1 if axis == "positive" else -1, eps=eps,
                      num_threads=num_threads)
        if out is not None:
            kwargs["out"] = d[out]
        result = function(d["x"], *(d[name] for name in _params(op, with_params)), **kwargs)
        y = result[0] if keep_cache else result
        if out is not None:
            assert y is d[out]
        if keep_cache:
            assert result[1].x is d["x"]
        return result
    return call


NORM_CASES = [(op, keep_cache, with_params, out)
              for op in ("layer_norm", "rms_norm") for keep_cache in (False, True)
              for with_params in (False, True)
              for out in ((None, "out") if keep_cache else (None, "out", "x"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, keep_cache, with_params, out", NORM_CASES)
def test_norm_forward_fast_path_is_the_general_path(monkeypatch, op, keep_cache, with_params,
                                                    out, dtype):
    for shape in SHAPES:
        call = _norm_call(op, keep_cache, with_params, out, 1e-5, None, "negative")
        fast, _ = run_both(call, dtype, shape, monkeypatch)
        assert fast.error is None and fast.took_fast_path, shape


@pytest.mark.parametrize("op", ("layer_norm", "rms_norm"))
@pytest.mark.parametrize("eps, num_threads, axis", [
    (0.0, 1, "positive"), (1e-3, 2, "negative"), (1e-5, 3, "positive"), (2.5, None, "negative")])
def test_norm_forward_eps_threads_axis(monkeypatch, op, eps, num_threads, axis):
    # (96, 768): enough elements for the threads to run
    for shape in ((2, 3, N_COLS), (96, 768)):
        call = _norm_call(op, True, True, None, eps, num_threads, axis)
        fast, _ = run_both(call, np.float32, shape, monkeypatch)
        assert fast.took_fast_path


def _backward_call(op, forward, with_gamma, out, num_threads=None):
    """forward: the forward that made the cache ("plain", or "add" for the fused add+norm)."""
    backward = getattr(fastln, op + "_backward")

    def call(d):
        gamma = d["gamma"] if with_gamma else None
        if forward == "add":
            add = getattr(fastln, "add_" + op + "_forward")
            _, s, cache = add(d["x"], d["residual"], gamma)
            assert cache.x is s
        else:
            _, cache = getattr(fastln, op + "_forward")(d["x"], gamma)
        kwargs = {"num_threads": num_threads}
        if out == "x":
            kwargs["out"] = cache.x
        elif out is not None:
            kwargs["out"] = d[out]
        result = backward(d["dy"], cache, gamma, **kwargs)
        if out is not None:
            assert result[0] is kwargs["out"]
        return result
    return call


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ("layer_norm", "rms_norm"))
@pytest.mark.parametrize("forward", ("plain", "add"))
@pytest.mark.parametrize("with_gamma", (False, True))
@pytest.mark.parametrize("out", (None, "out", "dy", "x"))
def test_norm_backward_fast_path_is_the_general_path(monkeypatch, op, forward, with_gamma, out,
                                                     dtype):
    for shape in SHAPES:
        fast, _ = run_both(_backward_call(op, forward, with_gamma, out), dtype, shape,
                           monkeypatch)
        assert fast.error is None
        assert fast.always_fast, (shape, fast.fast_results)


@pytest.mark.parametrize("op", ("layer_norm", "rms_norm"))
@pytest.mark.parametrize("num_threads", (1, 2, 3))
def test_norm_backward_threads(monkeypatch, op, num_threads):
    fast, _ = run_both(_backward_call(op, "plain", True, None, num_threads), np.float32,
                       (200, 768), monkeypatch)
    assert fast.always_fast


def _add_call(op, keep_cache, params, out, sum_out, num_threads=None, same_x_residual=False):
    function = getattr(fastln, "add_" + op + ("_forward" if keep_cache else ""))

    def call(d):
        residual = d["x"] if same_x_residual else d["residual"]
        gamma, beta, bias = (d[name] if name in params else None
                             for name in ("gamma", "beta", "bias"))
        kwargs = dict(bias=bias, num_threads=num_threads)
        if out is not None:
            kwargs["out"] = d[out]
        if sum_out is not None:
            kwargs["sum_out"] = d[sum_out]
        if op == "layer_norm":
            result = function(d["x"], residual, gamma, beta, **kwargs)
        else:
            result = function(d["x"], residual, gamma, **kwargs)
        y, s = result[:2]
        if out is not None:
            assert y is d[out]
        if sum_out is not None:
            assert s is d[sum_out]
        if keep_cache:
            assert result[2].x is s
        return result
    return call


ADD_PARAMS = ((), ("gamma",), ("bias",), ("gamma", "beta", "bias"))
# out and sum_out may each be x or residual, never the same array
ADD_OUTPUTS = [(out, sum_out) for out in (None, "out", "x", "residual")
               for sum_out in (None, "sum_out", "residual", "x")
               if out is None or out != sum_out]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ("layer_norm", "rms_norm"))
@pytest.mark.parametrize("keep_cache", (False, True))
@pytest.mark.parametrize("out, sum_out", ADD_OUTPUTS)
def test_add_norm_fast_path_is_the_general_path(monkeypatch, op, keep_cache, out, sum_out,
                                                dtype):
    for shape in SHAPES:
        for params in ADD_PARAMS:
            call = _add_call(op, keep_cache, params, out, sum_out)
            fast, _ = run_both(call, dtype, shape, monkeypatch)
            assert fast.error is None and fast.took_fast_path, (shape, params)


@pytest.mark.parametrize("op", ("layer_norm", "rms_norm"))
def test_add_norm_x_is_residual_and_threads(monkeypatch, op):
    for num_threads in (1, 2, 3):
        call = _add_call(op, True, ("gamma", "beta", "bias"), None, None, num_threads)
        fast, _ = run_both(call, np.float32, (96, 768), monkeypatch)
        assert fast.took_fast_path
    for out, sum_out in ((None, None), ("x", None), (None, "x"), ("out", "x")):
        call = _add_call(op, False, ("gamma",), out, sum_out, same_x_residual=True)
        fast, _ = run_both(call, np.float64, (5, N_COLS), monkeypatch)
        assert fast.took_fast_path


def test_fast_and_general_caches_hold_the_same_fields(monkeypatch):
    """Not only equal: the same dtype object in _dtype (y's dtype, as the general path sets)."""
    for call in (_norm_call("layer_norm", True, True, None, 1e-5, None, "negative"),
                 _norm_call("rms_norm", True, True, None, 1e-5, None, "negative"),
                 _add_call("layer_norm", True, ("gamma",), None, None),
                 _add_call("rms_norm", True, ("gamma",), None, None)):
        for dtype in DTYPES:
            fast, general = run_both(call, dtype, (5, N_COLS), monkeypatch)
            assert fast.took_fast_path
            cache_fast, cache_general = fast.result[-1], general.result[-1]
            assert cache_fast._dtype == cache_general._dtype == np.dtype(dtype)
            assert type(cache_fast.eps) is type(cache_general.eps) is float
            assert type(cache_fast.axis) is type(cache_general.axis) is int


# --------------------------------------------------------------------------------------------
# Unusual calls: the fast path declines, and the general path gives its result or its error
# --------------------------------------------------------------------------------------------

class Subclass(np.ndarray):
    pass


def _partial_overlap(d, name, target):
    """d[target] replaced by a buffer that also backs a view shifted by one row, put in d[name];
    the view starts with d[name]'s values."""
    values = d[name]
    buffer = np.zeros((values.shape[0] + 1,) + values.shape[1:], values.dtype)
    buffer[1:] = values
    d[name] = buffer[1:]
    d[target] = buffer[:-1]


def _gamma_inside_out(d):
    """gamma stored in out's first row (so out overlaps gamma)."""
    d["out"][0] = d["gamma"]
    d["gamma"] = d["out"][0]


# name -> (call, expected): expected is a call whose (fast) result the unusual call must equal
# bit for bit, or (exception type, regex of the message).
def _rms(d, **kw):
    return fastln.rms_norm(d["x"], d["gamma"], **kw)


def _ln(d, **kw):
    return fastln.layer_norm(d["x"], d["gamma"], d["beta"], **kw)


def _add_ln(d, **kw):
    return fastln.add_layer_norm(d["x"], d["residual"], d["gamma"], d["beta"], bias=d["bias"],
                                 **kw)


def _add_rms(d, **kw):
    return fastln.add_rms_norm(d["x"], d["residual"], d["gamma"], bias=d["bias"], **kw)


def _with(d, **changes):
    """d with some arrays replaced by functions of themselves."""
    for name, change in changes.items():
        d[name] = change(d[name])
    return d


FORTRAN = np.asfortranarray


def OTHER_DTYPE(a):
    """float32 for float64 and the other way round."""
    return a.astype(np.float64 if a.dtype == np.float32 else np.float32)


def ROUND_TRIP(a):
    """The values OTHER_DTYPE(a) has once the general path casts them back to a's dtype."""
    return OTHER_DTYPE(a).astype(a.dtype)


def SWAPPED(a):
    return a.astype(a.dtype.newbyteorder("S"))


def STRIDED(a):
    return np.repeat(a, 2, axis=-1)[..., ::2]


def _unaligned(a):
    buffer = np.zeros(a.nbytes + 1, np.uint8)
    view = buffer[1:].view(a.dtype).reshape(a.shape)
    view[...] = a
    return view


def _rms_into_overlapping_out(d):
    _partial_overlap(d, "x", "out")
    return _rms(d, out=d["out"])


def _ln_into_overlapping_out(d):
    _partial_overlap(d, "x", "out")
    return _ln(d, out=d["out"])


def _rms_out_holds_gamma(d):
    _gamma_inside_out(d)
    return _rms(d, out=d["out"]).copy()


def _add_ln_sum_out_overlapping_residual(d):
    _partial_overlap(d, "residual", "sum_out")
    return tuple(a.copy() for a in _add_ln(d, sum_out=d["sum_out"]))


def _add_ln_out_overlapping_x(d):
    _partial_overlap(d, "x", "out")
    return tuple(a.copy() for a in _add_ln(d, out=d["out"]))


def _add_rms_out_holds_bias(d):
    d["out"][0] = d["bias"]
    d["bias"] = d["out"][0]
    return tuple(a.copy() for a in _add_rms(d, out=d["out"]))


def _readonly(d, name):
    d[name].setflags(write=False)
    return d[name]


FORWARD_FALLBACKS = {
    # inputs the general path converts: the same bits as the fast path on the converted input
    "rms-fortran-x": (lambda d: _rms(_with(d, x=FORTRAN)), _rms),
    "rms-strided-x": (lambda d: _rms(_with(d, x=STRIDED)), _rms),
    "rms-unaligned-x": (lambda d: _rms(_with(d, x=_unaligned)), _rms),
    "rms-byteswapped-x": (lambda d: _rms(_with(d, x=SWAPPED)), _rms),
    "rms-subclass-x": (lambda d: _rms(_with(d, x=lambda a: a.view(Subclass))), _rms),
    "rms-list-x": (lambda d: _rms(_with(d, x=lambda a: a.tolist())), _rms),
    "rms-byteswapped-gamma": (lambda d: _rms(_with(d, gamma=SWAPPED)), _rms),
    "rms-other-dtype-gamma": (lambda d: _rms(_with(d, gamma=OTHER_DTYPE)),
                              lambda d: _rms(_with(d, gamma=ROUND_TRIP))),
    "rms-eps-numpy-scalar": (lambda d: _rms(d, eps=np.float64(1e-3)), lambda d: _rms(d, eps=1e-3)),
    "rms-eps-int": (lambda d: _rms(d, eps=1), lambda d: _rms(d, eps=1.0)),
    "rms-num-threads-numpy-int": (lambda d: _rms(d, num_threads=np.int64(2)),
                                  lambda d: _rms(d, num_threads=2)),
    "rms-num-threads-above-cap": (lambda d: _rms(d, num_threads=10**6), _rms),
    "rms-axis-numpy-int": (lambda d: _rms(d, axis=np.int64(-1)), _rms),
    "rms-overlapping-out": (_rms_into_overlapping_out, _rms),
    "rms-out-overlaps-gamma": (_rms_out_holds_gamma, _rms),
    "ln-fortran-x": (lambda d: _ln(_with(d, x=FORTRAN)), _ln),
    "ln-other-dtype-beta": (lambda d: _ln(_with(d, beta=OTHER_DTYPE)),
                            lambda d: _ln(_with(d, beta=ROUND_TRIP))),
    "ln-eps-int": (lambda d: _ln(d, eps=0), lambda d: _ln(d, eps=0.0)),
    "ln-overlapping-out": (_ln_into_overlapping_out, _ln),
    "add-ln-fortran-residual": (lambda d: _add_ln(_with(d, residual=FORTRAN)), _add_ln),
    "add-ln-byteswapped-x": (lambda d: _add_ln(_with(d, x=SWAPPED)), _add_ln),
    "add-ln-other-dtype-residual": (lambda d: _add_ln(_with(d, residual=OTHER_DTYPE)),
                                    lambda d: _add_ln(_with(d, residual=ROUND_TRIP))),
    "add-ln-other-dtype-bias": (lambda d: _add_ln(_with(d, bias=OTHER_DTYPE)),
                                lambda d: _add_ln(_with(d, bias=ROUND_TRIP))),
    "add-rms-other-dtype-gamma": (lambda d: _add_rms(_with(d, gamma=OTHER_DTYPE)),
                                  lambda d: _add_rms(_with(d, gamma=ROUND_TRIP))),
    "add-ln-eps-numpy-scalar": (lambda d: _add_ln(d, eps=np.float32(0.5)),
                                lambda d: _add_ln(d, eps=0.5)),
    "add-ln-sum-out-overlaps-residual": (_add_ln_sum_out_overlapping_residual, _add_ln),
    "add-ln-out-overlaps-x": (_add_ln_out_overlapping_x, _add_ln),
    "add-rms-out-overlaps-bias": (_add_rms_out_holds_bias, _add_rms),
    "add-rms-strided-x": (lambda d: _add_rms(_with(d, x=STRIDED)), _add_rms),
    "add-rms-num-threads-numpy-int": (lambda d: _add_rms(d, num_threads=np.int32(1)), _add_rms),
    # errors: the general path's, with its message
    "rms-num-threads-0": (lambda d: _rms(d, num_threads=0), (ValueError, "num_threads")),
    "rms-num-threads-negative": (lambda d: _rms(d, num_threads=-2), (ValueError, "num_threads")),
    "rms-num-threads-float": (lambda d: _rms(d, num_threads=2.0), (ValueError, "num_threads")),
    "rms-num-threads-bool": (lambda d: _rms(d, num_threads=True), (ValueError, "num_threads")),
    "rms-eps-negative": (lambda d: _rms(d, eps=-1e-5), (ValueError, "eps")),
    "rms-eps-nan": (lambda d: _rms(d, eps=float("nan")), (ValueError, "eps")),
    "rms-eps-inf": (lambda d: _rms(d, eps=float("inf")), (ValueError, "eps")),
    "rms-eps-bool": (lambda d: _rms(d, eps=True), (TypeError, "eps")),
    "rms-eps-string": (lambda d: _rms(d, eps="1e-5"), (TypeError, "eps")),
    "rms-axis-out-of-range": (lambda d: _rms(d, axis=2), (ValueError, "axis")),
    "rms-axis-float": (lambda d: _rms(d, axis=-1.0), (TypeError, "axis")),
    "rms-gamma-wrong-shape": (lambda d: _rms(_with(d, gamma=lambda g: g[:-1])),
                              (ValueError, "gamma")),
    "rms-out-wrong-dtype": (lambda d: _rms(d, out=OTHER_DTYPE(d["out"])),
                            (ValueError, "out has dtype")),
    "rms-out-readonly": (lambda d: _rms(d, out=_readonly(d, "out")),
                         (ValueError, "out is read-only")),
    "rms-out-wrong-shape": (lambda d: _rms(d, out=d["out"][:-1]), (ValueError, "out")),
    "rms-nothing-to-normalize": (lambda d: fastln.rms_norm(d["x"][:, :0]),
                                 (ValueError, "empty")),
    "rms-0-d-x": (lambda d: fastln.rms_norm(d["x"][0, 0]), (ValueError, "dimension")),
    "rms-forward-out-is-x": (lambda d: fastln.rms_norm_forward(d["x"], out=d["x"]),
                             (ValueError, "out overlaps x")),
    "ln-forward-out-is-x": (lambda d: fastln.layer_norm_forward(d["x"], out=d["x"]),
                            (ValueError, "out overlaps x")),
    "ln-num-threads-0": (lambda d: _ln(d, num_threads=0), (ValueError, "num_threads")),
    "add-ln-out-is-sum-out": (lambda d: _add_ln(d, out=d["out"], sum_out=d["out"]),
                              (ValueError, "out and sum_out overlap")),
    "add-ln-out-and-sum-out-are-x": (lambda d: _add_ln(d, out=d["x"], sum_out=d["x"]),
                                     (ValueError, "out and sum_out overlap")),
    "add-rms-out-and-sum-out-are-residual": (
        lambda d: _add_rms(d, out=d["residual"], sum_out=d["residual"]),
        (ValueError, "out and sum_out overlap")),
    "add-rms-residual-wrong-shape": (lambda d: _add_rms(_with(d, residual=lambda r: r[:-1])),
                                     (ValueError, "residual")),
    "add-rms-bias-wrong-shape": (lambda d: _add_rms(_with(d, bias=lambda b: b[1:])),
                                 (ValueError, "bias")),
    "add-rms-num-threads-negative": (lambda d: _add_rms(d, num_threads=-1),
                                     (ValueError, "num_threads")),
    "add-ln-eps-negative": (lambda d: _add_ln(d, eps=-1.0), (ValueError, "eps")),
    "add-ln-sum-out-wrong-dtype": (lambda d: _add_ln(d, sum_out=d["sum_out"].astype(np.float16)),
                                   (ValueError, "sum_out")),
    "add-ln-sum-out-readonly": (lambda d: _add_ln(d, sum_out=_readonly(d, "sum_out")),
                                (ValueError, "sum_out is read-only")),
}


def _check_fallback(monkeypatch, call, expected, dtype):
    fast, general = run_both(call, dtype, (5, N_COLS), monkeypatch)
    assert not fast.took_fast_path, fast.fast_results
    if isinstance(expected, tuple):
        error_type, message = expected
        assert fast.error is not None and fast.error[0] is error_type, fast.error
        assert re.search(message, fast.error[1]), fast.error
        return
    assert fast.error is None, fast.error
    common = Outcome(expected, fresh_inputs(dtype, (5, N_COLS)), monkeypatch, fast=True)
    assert common.error is None and common.always_fast, common.fast_results
    assert_same_result(tuple(np.ascontiguousarray(a) for a in _as_tuple(fast.result)),
                       _as_tuple(common.result))


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("name, dtype", [(name, dtype) for name in sorted(FORWARD_FALLBACKS)
                                          for dtype in DTYPES
                                          if dtype is np.float64 or "list-x" not in name])
def test_forward_falls_back(monkeypatch, name, dtype):
    """(A list becomes float64, so list-x runs for float64 only.)"""
    call, expected = FORWARD_FALLBACKS[name]
    _check_fallback(monkeypatch, call, expected, dtype)


@pytest.mark.parametrize("dtype", ("int64", "bool"))
@pytest.mark.parametrize("op", ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"))
def test_dtypes_without_a_fast_path_fall_back(monkeypatch, op, dtype):
    def call(d):
        x = d["x"].astype(dtype)
        if op.startswith("add"):
            return getattr(fastln, op)(x, d["residual"].astype(dtype))
        return getattr(fastln, op)(x)
    fast, _ = run_both(call, np.float64, (5, N_COLS), monkeypatch)
    assert fast.error is None and not fast.took_fast_path


def _half_dtypes():
    dtypes = ["float16"]
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes is a test extra
        return dtypes
    return dtypes + [ml_dtypes.bfloat16]


@pytest.mark.parametrize("dtype", _half_dtypes())
@pytest.mark.parametrize("op", ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"))
def test_half_precision_takes_the_fast_path(monkeypatch, op, dtype):
    """float16 and bfloat16 rows with float32 parameters are recognised like float32 ones (a
    bfloat16 call after the general path has met bfloat16 once), forward and backward."""
    fastln.layer_norm(np.zeros((1, 4), dtype))  # the general path meets the dtype

    def call(d):
        x = d["x"].astype(dtype)
        gamma = d["gamma"].astype(np.float32)
        if op.startswith("add"):
            return getattr(fastln, op + "_forward")(x, d["residual"].astype(dtype), gamma)
        y, cache = getattr(fastln, op + "_forward")(x, gamma)
        return y, cache, getattr(fastln, op + "_backward")(d["dy"].astype(dtype), cache, gamma)
    assert_fast_is_general(call, (5, N_COLS), monkeypatch)


@pytest.mark.parametrize("dtype", _half_dtypes())
@pytest.mark.parametrize("op", ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"))
def test_half_precision_parameters_in_x_format_take_the_fast_path(monkeypatch, op, dtype):
    """gamma, beta and bias in x's own half format (as a float16 or bfloat16 model holds them)
    are widened to float32 by the recogniser: the fast path, the general path's bits - also
    with a signalling NaN in gamma, which the general path's cast keeps and the recogniser's
    widening makes quiet."""
    fastln.layer_norm(np.zeros((1, 4), dtype))  # the general path meets the dtype

    def call(d):
        x, dy = d["x"].astype(dtype), d["dy"].astype(dtype)
        gamma, beta, bias = (d[name].astype(dtype) for name in ("gamma", "beta", "bias"))
        signalling_nan = np.array([0x7C01 if dtype == np.float16 else 0x7F81], np.uint16)
        gamma[3] = signalling_nan.view(dtype)[0]
        if op.startswith("add"):
            params = (gamma, beta) if op == "add_layer_norm" else (gamma,)
            y, s, cache = getattr(fastln, op + "_forward")(x, d["residual"].astype(dtype),
                                                           *params, bias=bias)
            backward = getattr(fastln, op[len("add_"):] + "_backward")
            return y, s, cache, backward(dy, cache, gamma)
        params = (gamma, beta) if op == "layer_norm" else (gamma,)
        y, cache = getattr(fastln, op + "_forward")(x, *params)
        return y, cache, getattr(fastln, op + "_backward")(dy, cache, gamma)
    fast = assert_fast_is_general(call, (5, N_COLS), monkeypatch)
    assert np.isnan(fast.result[0][:, 3].astype(np.float32)).all()


@pytest.mark.parametrize("dtype", _half_dtypes())
def test_half_precision_gamma_inside_out(monkeypatch, dtype):
    """A half gamma that lies inside out: the recogniser reads its float32 copy, made before y
    is written, as the general path reads its cast - the result of a separate gamma."""
    fastln.layer_norm(np.zeros((1, 4), dtype))

    def call(d, inside):
        x, out = d["x"].astype(dtype), d["out"].astype(dtype)
        gamma = d["gamma"].astype(dtype)
        if inside:
            out[0] = gamma
            gamma = out[0]
        return fastln.rms_norm(x, gamma, out=out).copy()
    fast, _ = run_both(lambda d: call(d, True), np.float64, (5, N_COLS), monkeypatch)
    separate = Outcome(lambda d: call(d, False), fresh_inputs(np.float64, (5, N_COLS)),
                       monkeypatch, fast=True)
    assert fast.error is None and fast.always_fast, fast.fast_results
    assert_same_result(fast.result, separate.result)


@pytest.mark.parametrize("dtype", _half_dtypes())
@pytest.mark.parametrize("layout", ("first", "last"))
@pytest.mark.parametrize("op", ("batch_norm", "group_norm", "instance_norm"))
def test_per_channel_parameters_in_x_format_take_the_fast_path(monkeypatch, op, layout, dtype):
    """BatchNorm, GroupNorm and InstanceNorm with gamma and beta in x's own half format: the
    fast path too (the recogniser widens them to float32, exactly), the general path's bits,
    forward and backward."""
    fastln.layer_norm(np.zeros((1, 4), dtype))  # the general path meets the dtype
    shape, channel_axis = GN_LAYOUTS[layout]

    def call(d):
        x, dy = d["x"].astype(dtype), d["dy"].astype(dtype)
        gamma, beta = (d[name][:x.shape[channel_axis]].astype(dtype) for name in ("gamma", "beta"))
        if op == "batch_norm":
            y, cache = fastln.batch_norm_forward(x, gamma, beta, training=True,
                                                 axis=channel_axis)
            return y, cache, fastln.batch_norm_backward(dy, cache, gamma)
        groups = (4,) if op == "group_norm" else ()
        y, cache = getattr(fastln, op + "_forward")(x, *groups, gamma, beta,
                                                    channel_axis=channel_axis)
        return y, cache, getattr(fastln, op + "_backward")(dy, cache, gamma)
    assert_fast_is_general(call, shape, monkeypatch)


def _backward(op, forward_inputs=None, dy=None, gamma=False, tamper=None, **kwargs):
    """A call: forward (with forward_inputs applied to d), then backward; tamper edits the
    cache, dy edits dy, gamma=True passes gamma (or a function of it)."""
    def call(d):
        if forward_inputs is not None:
            forward_inputs(d)
        _, cache = getattr(fastln, op + "_forward")(d["x"], d["gamma"])
        if tamper is not None:
            tamper(cache)
        # the keyword arguments first: out= may put dy into a new buffer
        extra = {key: (value(d, cache) if callable(value) else value)
                 for key, value in kwargs.items()}
        dy_value = d["dy"] if dy is None else dy(d["dy"])
        gamma_value = (None if gamma is False else d["gamma"] if gamma is True
                       else gamma(d["gamma"]))
        return getattr(fastln, op + "_backward")(dy_value, cache, gamma_value, **extra)
    return call


def _set(**fields):
    def tamper(cache):
        for name, change in fields.items():
            setattr(cache, name, change(cache))
    return tamper


def _dy_overlapping_out(d, cache):
    """out: a buffer whose other view (shifted by one row) holds dy."""
    _partial_overlap(d, "dy", "out")
    return d["out"]


BACKWARD_FALLBACKS = {}
for _op in ("layer_norm", "rms_norm"):
    _plain = _backward(_op, gamma=True)
    BACKWARD_FALLBACKS.update({
        f"{_op}-fortran-dy": (_backward(_op, dy=FORTRAN, gamma=True), _plain),
        f"{_op}-byteswapped-dy": (_backward(_op, dy=SWAPPED, gamma=True), _plain),
        f"{_op}-other-dtype-gamma": (_backward(_op, gamma=OTHER_DTYPE),
                                     _backward(_op, gamma=ROUND_TRIP)),
        f"{_op}-num-threads-numpy-int": (_backward(_op, gamma=True, num_threads=np.int64(1)),
                                         _plain),
        f"{_op}-cache-eps-numpy-scalar": (
            _backward(_op, gamma=True, tamper=_set(eps=lambda c: np.float64(c.eps))), _plain),
        f"{_op}-cache-rstd-other-dtype": (
            _backward(_op, gamma=True, tamper=_set(rstd=lambda c: OTHER_DTYPE(c.rstd))),
            _backward(_op, gamma=True, tamper=_set(rstd=lambda c: ROUND_TRIP(c.rstd)))),
        f"{_op}-cache-axis-numpy-int": (
            _backward(_op, gamma=True, tamper=_set(axis=lambda c: np.int64(c.axis))), _plain),
        f"{_op}-cache-fortran-x": (
            _backward(_op, gamma=True, tamper=_set(x=lambda c: FORTRAN(c.x))), _plain),
        f"{_op}-out-overlaps-dy": (
            lambda d, _op=_op: _backward(_op, gamma=True, out=_dy_overlapping_out)(d)[0].copy(),
            lambda d, _op=_op: _backward(_op, gamma=True)(d)[0]),
        f"{_op}-num-threads-0": (_backward(_op, num_threads=0), (ValueError, "num_threads")),
        f"{_op}-num-threads-bool": (_backward(_op, num_threads=True),
                                    (ValueError, "num_threads")),
        f"{_op}-dy-other-dtype": (
            _backward(_op, dy=OTHER_DTYPE),
            (ValueError, "dy has dtype")),
        f"{_op}-dy-wrong-shape": (_backward(_op, dy=lambda a: a[:-1]), (ValueError, "dy")),
        f"{_op}-gamma-wrong-shape": (_backward(_op, gamma=lambda g: g[:-1]),
                                     (ValueError, "gamma")),
        f"{_op}-out-readonly": (_backward(_op, out=lambda d, cache: _readonly(d, "out")),
                                (ValueError, "out is read-only")),
        f"{_op}-forged-axis-minus-one": (_backward(_op, tamper=_set(axis=lambda c: -1)),
                                         (ValueError, "cache.axis")),
        f"{_op}-forged-axis-bool": (_backward(_op, tamper=_set(axis=lambda c: True)),
                                    (ValueError, "cache.axis")),
        f"{_op}-forged-dtype-float16": (
            _backward(_op, tamper=_set(_dtype=lambda c: np.dtype(np.float16))),
            (ValueError, "cache.dtype")),
        f"{_op}-forged-dtype-byteswapped": (
            _backward(_op, tamper=_set(_dtype=lambda c: c.dtype.newbyteorder("S"))),
            (ValueError, "cache.dtype")),
        f"{_op}-forged-eps-negative": (_backward(_op, tamper=_set(eps=lambda c: -1.0)),
                                       (ValueError, "cache.eps")),
        f"{_op}-forged-rstd-flattened": (
            _backward(_op, forward_inputs=lambda d: d.update(x=d["x"].reshape(5, 2, -1)),
                      dy=lambda a: a.reshape(5, 2, -1),
                      tamper=_set(rstd=lambda c: c.rstd.reshape(-1))),
            (ValueError, "cache.rstd has shape")),
    })
BACKWARD_FALLBACKS["layer_norm-forged-mean-flattened"] = (
    _backward("layer_norm", forward_inputs=lambda d: d.update(x=d["x"].reshape(5, 2, -1)),
              dy=lambda a: a.reshape(5, 2, -1), tamper=_set(mean=lambda c: c.mean.reshape(-1))),
    (ValueError, "cache.mean has shape"))
BACKWARD_FALLBACKS["rms_norm-layer-norm-cache"] = (
    lambda d: fastln.rms_norm_backward(d["dy"], fastln.layer_norm_forward(d["x"])[1]),
    (ValueError, "cache comes from layer_norm_forward"))
BACKWARD_FALLBACKS["rms_norm-not-a-cache"] = (
    lambda d: fastln.rms_norm_backward(d["dy"], (d["x"], None)), (TypeError, "cache"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BACKWARD_FALLBACKS))
def test_backward_falls_back(monkeypatch, name, dtype):
    call, expected = BACKWARD_FALLBACKS[name]
    fast, _ = run_both(call, dtype, (10, N_COLS), monkeypatch)
    assert not fast.backward_took_fast_path, fast.fast_results
    if isinstance(expected, tuple):
        assert fast.error is not None and fast.error[0] is expected[0], fast.error
        assert re.search(expected[1], fast.error[1]), fast.error
        return
    assert fast.error is None, fast.error
    common = Outcome(expected, fresh_inputs(dtype, (10, N_COLS)), monkeypatch, fast=True)
    assert common.error is None and common.always_fast, common.fast_results
    assert_same_result(_as_tuple(fast.result), _as_tuple(common.result))


@pytest.mark.parametrize("dtype", DTYPES)
def test_hand_built_caches_take_the_fast_path(monkeypatch, dtype):
    """A cache built by hand (public constructor, no dtype) is as good as the forward's."""
    def call(d):
        _, cache = fastln.layer_norm_forward(d["x"])
        hand_ln = fastln.LayerNormCache(cache.x, cache.mean, cache.rstd, cache.axis, cache.eps)
        _, cache = fastln.rms_norm_forward(d["x"])
        hand_rms = fastln.RMSNormCache(cache.x, cache.rstd, cache.axis, cache.eps)
        return (fastln.layer_norm_backward(d["dy"], hand_ln),
                fastln.rms_norm_backward(d["dy"], hand_rms))
    fast, _ = run_both(call, dtype, (5, N_COLS), monkeypatch)
    assert fast.always_fast and len(fast.fast_results) == 4


# --------------------------------------------------------------------------------------------
# BatchNorm's forward
# --------------------------------------------------------------------------------------------

BN_LAYOUTS = {"rows": ((5, N_COLS), -1), "nchw": ((2, N_COLS, 3, N_COLS), 1)}


def _bn_call(dtype, training, with_params, running, momentum, out, keep_cache, axis=None):
    """batch_norm(_forward) of x in `dtype` (its features N_COLS long), returning the result
    and the running statistics after the call."""
    def call(d):
        x = d["x"].astype(dtype)
        param_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        params = ((d["gamma"][:N_COLS].astype(param_dtype), d["beta"][:N_COLS].astype(param_dtype))
                  if with_params else (None, None))
        stats = (None, None)
        if running is not None:
            stats = (d["beta"][:N_COLS].astype(running),
                     (np.abs(d["gamma"][:N_COLS]) + 0.5).astype(running))
        kwargs = dict(training=training, momentum=momentum,
                      axis=BN_LAYOUTS["nchw" if x.ndim == 4 else "rows"][1] if axis is None
                      else axis)
        if out:
            kwargs["out"] = np.full(x.shape, np.nan, x.dtype)
        function = fastln.batch_norm_forward if keep_cache else fastln.batch_norm
        result = function(x, *params, *stats, **kwargs)
        if out:
            assert (result[0] if keep_cache else result) is kwargs["out"]
        return result, stats
    return call


def _bn_dtypes():
    return [np.float32, np.float64] + _half_dtypes()


BN_CASES = [(layout, training, with_params, running, momentum)
            for layout in BN_LAYOUTS for training in (True, False)
            for with_params in (True, False)
            for running in ((None, np.float32, np.float64) if training
                            else (np.float32, np.float64))
            for momentum in ((0.0, 0.9, 1.0) if training and running is not None else (0.9,))]


@pytest.mark.parametrize("keep_cache, out", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", _bn_dtypes())
@pytest.mark.parametrize("layout, training, with_params, running, momentum", BN_CASES)
def test_batch_norm_fast_path_is_the_general_path(monkeypatch, layout, training, with_params,
                                                  running, momentum, dtype, keep_cache, out):
    """y, the cache and the updated running statistics: the general path's bits."""
    fastln.layer_norm(np.zeros((1, 4), dtype))  # the general path meets the dtype
    call = _bn_call(dtype, training, with_params, running, momentum, out, keep_cache)
    assert_fast_is_general(call, BN_LAYOUTS[layout][0], monkeypatch)


def _bn(d, **kwargs):
    x = kwargs.pop("x", d["x"])
    stats = kwargs.pop("stats", (d["beta"].copy(), np.abs(d["gamma"]) + 0.5))
    return fastln.batch_norm(x, d["gamma"], d["beta"], *stats,
                             **{"training": True, **kwargs}), stats


BN_FALLBACKS = {
    "fortran-x": lambda d: _bn(d, x=np.asfortranarray(d["x"])),
    "list-x": lambda d: _bn(d, x=d["x"].tolist()),
    "int-x": lambda d: _bn(d, x=(d["x"] * 10).astype(np.int64)),
    "numpy-bool-training": lambda d: _bn(d, training=np.bool_(True)),
    "numpy-float-momentum": lambda d: _bn(d, momentum=np.float64(0.5)),
    "int-momentum": lambda d: _bn(d, momentum=1),
    "numpy-int-axis": lambda d: _bn(d, axis=np.int64(-1)),
    "float16-running": lambda d: _bn(d, stats=(d["beta"].astype(np.float16),
                                               np.abs(d["gamma"]).astype(np.float16) + 1)),
    "strided-running": lambda d: _bn(d, stats=(np.repeat(d["beta"], 2)[::2],
                                               np.abs(d["gamma"]) + 0.5)),
    "out-is-x": lambda d: _bn(d, out=d["x"]),
    "out-overlaps-x": lambda d: _bn(d, x=d["out"], out=d["out"]),
    "eval-list-running": lambda d: _bn(d, training=False, stats=(d["beta"].tolist(),
                                                                 (np.abs(d["gamma"]) + 1).tolist())),
    # errors: the general path's, with its message
    "running-overlap": lambda d: _bn(d, stats=(d["beta"], d["beta"])),
    "momentum-above-1": lambda d: _bn(d, momentum=1.5),
    "momentum-nan": lambda d: _bn(d, momentum=float("nan")),
    "eval-without-running": lambda d: _bn(d, training=False, stats=()),
    "running-mean-alone": lambda d: _bn(d, stats=(d["beta"].copy(), None)),
    "readonly-running": lambda d: _bn(d, stats=(_readonly(d, "beta"), np.abs(d["gamma"]) + 1)),
    "axis-out-of-range": lambda d: _bn(d, axis=2),
    "gamma-wrong-length": lambda d: fastln.batch_norm(d["x"], d["gamma"][1:], training=True),
    "empty-batch": lambda d: _bn(d, x=d["x"][:0]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BN_FALLBACKS))
def test_batch_norm_falls_back(monkeypatch, name, dtype):
    assert_falls_back(BN_FALLBACKS[name], dtype, (5, N_COLS), monkeypatch)


# --------------------------------------------------------------------------------------------
# BatchNorm's backward
# --------------------------------------------------------------------------------------------

def _dx_target(out, x, dy):
    """The out= of a backward test: None, a fresh "out" array, or dy or x itself (in place)."""
    return {None: None, "out": np.full(x.shape, np.nan, x.dtype), "dy": dy, "x": x}[out]


def _bn_backward_call(dtype, layout, training, with_gamma, out, num_threads=None):
    """batch_norm_forward then batch_norm_backward of x in `dtype`; out None, "out", "dy" or
    "x" (dx written over dy or x, in place)."""
    def call(d):
        x, dy = d["x"].astype(dtype), d["dy"].astype(dtype)
        param_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        gamma = d["gamma"][:N_COLS].astype(param_dtype) if with_gamma else None
        stats = () if training else (d["beta"][:N_COLS].astype(param_dtype),
                                     (np.abs(d["gamma"][:N_COLS]) + 0.5).astype(param_dtype))
        _, cache = fastln.batch_norm_forward(x, gamma, None, *stats, training=training,
                                             axis=BN_LAYOUTS[layout][1])
        target = _dx_target(out, x, dy)
        result = fastln.batch_norm_backward(dy, cache, gamma, out=target,
                                            num_threads=num_threads)
        if target is not None:
            assert result[0] is target
        return result
    return call


@pytest.mark.parametrize("out", (None, "out", "dy", "x"))
@pytest.mark.parametrize("dtype", _bn_dtypes())
@pytest.mark.parametrize("with_gamma", (False, True))
@pytest.mark.parametrize("training", (True, False))
@pytest.mark.parametrize("layout", sorted(BN_LAYOUTS))
def test_batch_norm_backward_fast_path_is_the_general_path(monkeypatch, layout, training,
                                                           with_gamma, dtype, out):
    """dx, dgamma and dbeta: the general path's bits, forward and backward on the fast path."""
    fastln.layer_norm(np.zeros((1, 4), dtype))  # the general path meets the dtype
    call = _bn_backward_call(dtype, layout, training, with_gamma, out)
    fast = assert_fast_is_general(call, BN_LAYOUTS[layout][0], monkeypatch)
    assert fast.backward_took_fast_path


@pytest.mark.parametrize("num_threads", (1, 2, 3))
def test_batch_norm_backward_threads(monkeypatch, num_threads):
    fast, _ = run_both(_bn_backward_call(np.float32, "rows", True, True, None, num_threads),
                       np.float32, (200, N_COLS), monkeypatch)
    assert fast.always_fast


def _bn_backward(d, dy=None, out=None, gamma="gamma", **cache_fields):
    """The backward of a training forward of d["x"] (features last), its cache's fields
    replaced by cache_fields."""
    _, cache = fastln.batch_norm_forward(d["x"], d["gamma"], training=True)
    for name, value in cache_fields.items():
        setattr(cache, name, value(cache) if callable(value) else value)
    gamma = d["gamma"] if gamma == "gamma" else gamma
    return fastln.batch_norm_backward(d["dy"] if dy is None else dy(d), cache, gamma, out=out)


BN_BACKWARD_FALLBACKS = {
    "fortran-dy": lambda d: _bn_backward(d, dy=lambda d: np.asfortranarray(d["dy"])),
    "list-dy": lambda d: _bn_backward(d, dy=lambda d: d["dy"].tolist()),
    "swapped-dy": lambda d: _bn_backward(d, dy=lambda d: d["dy"].astype(
        d["dy"].dtype.newbyteorder(">"))),
    "float32-mean": lambda d: _bn_backward(d, mean=lambda c: c.mean.astype(np.float32)),
    "strided-rstd": lambda d: _bn_backward(d, rstd=lambda c: np.repeat(c.rstd, 2)[::2]),
    "numpy-int-axis": lambda d: _bn_backward(d, axis=lambda c: np.int64(c.axis)),
    "numpy-bool-training": lambda d: _bn_backward(d, training=np.bool_(True)),
    "numpy-float-eps": lambda d: _bn_backward(d, eps=np.float64(1e-5)),
    "list-gamma": lambda d: _bn_backward(d, gamma=d["gamma"].tolist()),
    "int-gamma": lambda d: _bn_backward(d, gamma=np.arange(N_COLS)),
    "out-shifted-on-dy": lambda d: _bn_backward(
        d, dy=lambda d: d["sum_out"].reshape(-1)[:d["out"].size - N_COLS].reshape(-1, N_COLS),
        out=d["sum_out"].reshape(-1)[N_COLS:].reshape(-1, N_COLS)),
    # errors: the general path's, with its message
    "dy-wrong-shape": lambda d: _bn_backward(d, dy=lambda d: d["dy"][1:]),
    "dy-wrong-dtype": lambda d: _bn_backward(d, dy=lambda d: d["dy"].astype(np.float16)),
    "gamma-wrong-length": lambda d: _bn_backward(d, gamma=d["gamma"][1:]),
    "mean-wrong-length": lambda d: _bn_backward(d, mean=lambda c: c.mean[1:]),
    "axis-out-of-range": lambda d: _bn_backward(d, axis=2),
    "dtype-none": lambda d: _bn_backward(d, dtype=None),
    "negative-eps": lambda d: _bn_backward(d, eps=-1.0),
    "out-readonly": lambda d: _bn_backward(d, out=_readonly(d, "out")),
    "out-wrong-dtype": lambda d: _bn_backward(d, out=d["out"].astype(np.float16)),
    "empty-batch": lambda d: _bn_backward(d, dy=lambda d: d["dy"][:0],
                                          x=lambda c: c.x[:0]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BN_BACKWARD_FALLBACKS))
def test_batch_norm_backward_falls_back(monkeypatch, name, dtype):
    assert_falls_back(BN_BACKWARD_FALLBACKS[name], dtype, (5, N_COLS), monkeypatch,
                      backward=True)


# --------------------------------------------------------------------------------------------
# GroupNorm's and InstanceNorm's forward
# --------------------------------------------------------------------------------------------

# (shape, channel_axis): the channels are shape[channel_axis]; a 2-D x has no spatial axes.
GN_LAYOUTS = {"first": ((2, 12, 3, N_COLS), 1), "last": ((2, 3, 5, N_COLS), -1),
              "rows-first": ((5, N_COLS), 1), "rows-last": ((5, N_COLS), -1),
              "3d-last": ((2, 7, N_COLS), -1)}
GN_FUNCTIONS = {"group_norm": fastln.group_norm, "group_norm_forward": fastln.group_norm_forward,
                "instance_norm": fastln.instance_norm,
                "instance_norm_forward": fastln.instance_norm_forward}


def _gn_call(function, dtype, layout, with_params, out, num_threads=None):
    """A GroupNorm (4 groups) or InstanceNorm forward of x in `dtype` laid out as `layout`."""
    shape, channel_axis = GN_LAYOUTS[layout]

    def call(d):
        x = d["x"].astype(dtype)
        n_channels = x.shape[channel_axis]
        param_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        params = ((d["gamma"][:n_channels].astype(param_dtype),
                   d["beta"][:n_channels].astype(param_dtype)) if with_params else (None, None))
        kwargs = dict(channel_axis=channel_axis, num_threads=num_threads)
        if out:
            kwargs["out"] = np.full(x.shape, np.nan, x.dtype)
        groups = () if function.startswith("instance") else (4,)
        result = GN_FUNCTIONS[function](x, *groups, *params, **kwargs)
        if out:
            assert (result[0] if function.endswith("_forward") else result) is kwargs["out"]
        return result
    return call, shape


@pytest.mark.parametrize("out", (False, True))
@pytest.mark.parametrize("with_params", (False, True))
@pytest.mark.parametrize("layout", sorted(GN_LAYOUTS))
@pytest.mark.parametrize("dtype", _bn_dtypes())
@pytest.mark.parametrize("function", sorted(GN_FUNCTIONS))
def test_group_norm_fast_path_is_the_general_path(monkeypatch, function, dtype, layout,
                                                  with_params, out):
    """y and the cache: the general path's bits."""
    fastln.layer_norm(np.zeros((1, 4), dtype))  # the general path meets the dtype
    call, shape = _gn_call(function, dtype, layout, with_params, out)
    assert_fast_is_general(call, shape, monkeypatch)


@pytest.mark.parametrize("num_threads", (1, 2, 3))
def test_group_norm_fast_path_threads(monkeypatch, num_threads):
    call, shape = _gn_call("group_norm_forward", np.float32, "last", True, False, num_threads)
    assert_fast_is_general(call, shape, monkeypatch)


def _gn(d, **changes):
    """group_norm of a (2, 3, 5, N_COLS) channels-last x (d's x, reshaped) with some change."""
    x = changes.pop("x", d["x"].reshape(2, 3, 5, N_COLS))
    kwargs = dict(channel_axis=-1, **changes)
    num_groups = kwargs.pop("num_groups", 4)
    gamma = kwargs.pop("gamma", d["gamma"])
    return fastln.group_norm_forward(x, num_groups, gamma, d["beta"], **kwargs)


GN_FALLBACKS = {
    "fortran-x": lambda d: _gn(d, x=np.asfortranarray(d["x"].reshape(2, 3, 5, N_COLS))),
    "list-x": lambda d: _gn(d, x=d["x"].reshape(2, 3, 5, N_COLS).tolist()),
    "int-x": lambda d: _gn(d, x=(d["x"] * 10).astype(np.int64).reshape(2, 3, 5, N_COLS)),
    "numpy-int-groups": lambda d: _gn(d, num_groups=np.int64(4)),
    "numpy-int-axis": lambda d: _gn(d, channel_axis=np.int64(-1)),
    "int-eps": lambda d: _gn(d, eps=0),
    "numpy-float-eps": lambda d: _gn(d, eps=np.float64(1e-5)),
    "list-gamma": lambda d: _gn(d, gamma=d["gamma"].tolist()),
    "float16-gamma": lambda d: _gn(d, gamma=d["gamma"].astype(np.float16)),
    "strided-gamma": lambda d: _gn(d, gamma=np.repeat(d["gamma"], 2)[::2]),
    "out-overlaps-gamma": lambda d: fastln.group_norm(
        d["out"].reshape(-1)[:N_COLS].reshape(1, 1, 1, N_COLS), 4, d["out"].reshape(-1)[:N_COLS],
        channel_axis=-1, out=d["out"].reshape(-1)[:N_COLS].reshape(1, 1, 1, N_COLS)),
    "out-is-x": lambda d: fastln.group_norm(d["x"], 4, channel_axis=-1, out=d["x"]),
    "empty-batch": lambda d: _gn(d, x=d["x"].reshape(2, 3, 5, N_COLS)[:0]),
    # errors: the general path's, with its message
    "bool-groups": lambda d: _gn(d, num_groups=True),
    "groups-not-dividing": lambda d: _gn(d, num_groups=5),
    "zero-groups": lambda d: _gn(d, num_groups=0),
    "axis-2": lambda d: _gn(d, channel_axis=2),
    "axis-beyond-any-int": lambda d: _gn(d, channel_axis=10 ** 30),
    "one-dimensional-x": lambda d: fastln.group_norm(d["x"][0], 4),
    "empty-spatial": lambda d: _gn(d, x=d["x"].reshape(2, 3, 5, N_COLS)[:, :0]),
    "gamma-wrong-length": lambda d: _gn(d, gamma=d["gamma"][1:]),
    "negative-eps": lambda d: _gn(d, eps=-1.0),
    "out-readonly": lambda d: _gn(d, out=_readonly(d, "out").reshape(2, 3, 5, N_COLS)),
    "out-overlaps-x": lambda d: _gn(d, x=d["out"].reshape(2, 3, 5, N_COLS),
                                    out=d["out"].reshape(2, 3, 5, N_COLS)),
    "out-wrong-dtype": lambda d: _gn(d, out=d["out"].astype(np.float16).reshape(2, 3, 5, N_COLS)),
    "threads-zero": lambda d: _gn(d, num_threads=0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(GN_FALLBACKS))
def test_group_norm_falls_back(monkeypatch, name, dtype):
    assert_falls_back(GN_FALLBACKS[name], dtype, (30, N_COLS), monkeypatch)


# --------------------------------------------------------------------------------------------
# GroupNorm's and InstanceNorm's backward
# --------------------------------------------------------------------------------------------

def _gn_backward_call(op, dtype, layout, with_gamma, out, num_threads=None):
    """group_norm_forward (4 groups) or instance_norm_forward, then its backward; out None,
    "out", "dy" or "x" (dx written over dy or x, in place)."""
    shape, channel_axis = GN_LAYOUTS[layout]

    def call(d):
        x, dy = d["x"].astype(dtype), d["dy"].astype(dtype)
        n_channels = x.shape[channel_axis]
        param_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        gamma = d["gamma"][:n_channels].astype(param_dtype) if with_gamma else None
        if op == "group_norm":
            _, cache = fastln.group_norm_forward(x, 4, gamma, None, channel_axis=channel_axis)
            backward = fastln.group_norm_backward
        else:
            _, cache = fastln.instance_norm_forward(x, gamma, None, channel_axis=channel_axis)
            backward = fastln.instance_norm_backward
        target = _dx_target(out, x, dy)
        result = backward(dy, cache, gamma, out=target, num_threads=num_threads)
        if target is not None:
            assert result[0] is target
        return result
    return call, shape


@pytest.mark.parametrize("out", (None, "out", "dy", "x"))
@pytest.mark.parametrize("with_gamma", (False, True))
@pytest.mark.parametrize("layout", sorted(GN_LAYOUTS))
@pytest.mark.parametrize("dtype", _bn_dtypes())
@pytest.mark.parametrize("op", ("group_norm", "instance_norm"))
def test_group_norm_backward_fast_path_is_the_general_path(monkeypatch, op, dtype, layout,
                                                           with_gamma, out):
    fastln.layer_norm(np.zeros((1, 4), dtype))  # the general path meets the dtype
    call, shape = _gn_backward_call(op, dtype, layout, with_gamma, out)
    fast = assert_fast_is_general(call, shape, monkeypatch)
    assert fast.backward_took_fast_path


@pytest.mark.parametrize("num_threads", (1, 2, 3))
def test_group_norm_backward_threads(monkeypatch, num_threads):
    call, shape = _gn_backward_call("group_norm", np.float32, "first", True, None, num_threads)
    fast, _ = run_both(call, np.float64, shape, monkeypatch)
    assert fast.always_fast


def _gn_backward(d, dy=None, out=None, gamma="gamma", backward=None, **cache_fields):
    """group_norm_backward of a (2, 3, 5, N_COLS) channels-last forward, the cache's fields
    replaced by cache_fields."""
    x = d["x"].reshape(2, 3, 5, N_COLS)
    _, cache = fastln.group_norm_forward(x, 4, d["gamma"], channel_axis=-1)
    for name, value in cache_fields.items():
        setattr(cache, name, value(cache) if callable(value) else value)
    gamma = d["gamma"] if gamma == "gamma" else gamma
    dy = d["dy"].reshape(x.shape) if dy is None else dy(d)
    return (backward or fastln.group_norm_backward)(dy, cache, gamma, out=out)


def _gn_backward_shifted_out(d):
    """dx written one row of channels past the start of dy, in the same buffer."""
    buffer = np.empty(31 * N_COLS, d["dy"].dtype)
    dy = buffer[:30 * N_COLS].reshape(2, 3, 5, N_COLS)
    dy[...] = d["dy"].reshape(dy.shape)
    return _gn_backward(d, dy=lambda d: dy, out=buffer[N_COLS:].reshape(2, 3, 5, N_COLS))


GN_BACKWARD_FALLBACKS = {
    "fortran-dy": lambda d: _gn_backward(d, dy=lambda d: np.asfortranarray(
        d["dy"].reshape(2, 3, 5, N_COLS))),
    "list-dy": lambda d: _gn_backward(d, dy=lambda d: d["dy"].reshape(2, 3, 5, N_COLS).tolist()),
    "numpy-int-groups": lambda d: _gn_backward(d, num_groups=lambda c: np.int64(c.num_groups)),
    "numpy-int-axis": lambda d: _gn_backward(d, channel_axis=lambda c: np.int64(c.channel_axis)),
    "numpy-float-eps": lambda d: _gn_backward(d, eps=np.float64(1e-5)),
    "list-gamma": lambda d: _gn_backward(d, gamma=d["gamma"].tolist()),
    "float16-mean": lambda d: _gn_backward(d, mean=lambda c: c.mean.astype(np.float16)),
    "strided-rstd": lambda d: _gn_backward(d, rstd=lambda c: np.repeat(c.rstd, 2, axis=1)[:, ::2]),
    "flat-mean": lambda d: _gn_backward(d, mean=lambda c: c.mean.reshape(-1)),
    "out-shifted-on-dy": lambda d: _gn_backward_shifted_out(d),
    # errors: the general path's, with its message
    "dy-wrong-shape": lambda d: _gn_backward(d, dy=lambda d: d["dy"].reshape(2, 3, 5, N_COLS)[1:]),
    "dy-wrong-dtype": lambda d: _gn_backward(
        d, dy=lambda d: d["dy"].reshape(2, 3, 5, N_COLS).astype(np.float16)),
    "gamma-wrong-length": lambda d: _gn_backward(d, gamma=d["gamma"][1:]),
    "groups-not-dividing": lambda d: _gn_backward(d, num_groups=5),
    "mean-wrong-shape": lambda d: _gn_backward(d, mean=lambda c: c.mean[:1]),
    "axis-unnormalized": lambda d: _gn_backward(d, channel_axis=-1),
    "axis-beyond-any-int": lambda d: _gn_backward(d, channel_axis=10 ** 30),
    "dtype-none": lambda d: _gn_backward(d, dtype=None),
    "negative-eps": lambda d: _gn_backward(d, eps=-1.0),
    "out-readonly": lambda d: _gn_backward(d, out=_readonly(d, "out")[:30].reshape(
        2, 3, 5, N_COLS)),
    "instance-backward-of-groups": lambda d: _gn_backward(
        d, backward=fastln.instance_norm_backward),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(GN_BACKWARD_FALLBACKS))
def test_group_norm_backward_falls_back(monkeypatch, name, dtype):
    assert_falls_back(GN_BACKWARD_FALLBACKS[name], dtype, (30, N_COLS), monkeypatch,
                      backward=True)
