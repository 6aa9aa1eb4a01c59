"""Hostile inputs for GroupNorm and InstanceNorm, held to ``fastln.reference``.

The same contract as tests/test_hostile_inputs.py, with its value kinds, dtypes, layouts,
parameters, outs, eps and thread counts, on (N, C, *spatial) arrays with the channels first or
last: each drawn call is made on fastln and on the reference, each with its own freshly built
copy of the arguments. Either both raise a TypeError or ValueError (the inputs and any ``out``
untouched), or fastln's results agree with the reference's within the dtype's tolerance and
every input is byte-for-byte unchanged. ``num_groups`` is also drawn wrong (not a divisor of C,
0, negative, a float, a bool, a string) and ``channel_axis`` out of range or not an int.

Tolerances, per (sample, group): ``rtol * |expected| + atol * S`` with S the size of the terms
(for y, ``|gamma| * max(1, |x_hat|) + |beta|``; for dx, ``rstd * max|dy * gamma| * (2 +
sqrt(H))``; for dgamma and dbeta, ``sum|dy|`` times ``max(1, |x_hat|)``), plus the reference's
own centring error ``u64 * kappa``, ``kappa = (max|x| + |mean|) * rstd``, plus a few units of
the smallest normal number. The reference is right over the whole float64 range on its own
(it scales each group before it centres it), so no call is rescaled here.
"""
import numpy as np
import pytest

import fastln
import fastln.reference as ref
from conftest import Snapshot, owner
from test_hostile_inputs import (
    HALF_DTYPES, HOSTILE, KERNEL_DTYPES, Choices, Layout, common_arguments, layouts, make_out,
    make_param, overlapping_pair, pick, result_dtype, tolerance, typed_values, with_layout)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FORWARDS = ("group_norm", "group_norm_forward", "instance_norm", "instance_norm_forward")
BACKWARDS = ("group_norm_backward", "instance_norm_backward")
SUITES = FORWARDS + BACKWARDS
CHANNEL_AXES = Choices((1, 1, -1, -1), (0, 5, -6, 1.0, "1", None, True))
BAD_GROUPS = ("not_a_divisor", 0, -1, 2.0, True, "2", None, np.float64(1))
BIG_SHAPES = ((2, 64, 24, 24), (1, 32, 4100), (3, 8, 3, 3, 400))


@st.composite
def gn_shapes(draw):
    """(N, C, *spatial) with the channels at axis 1: 0- and 1-sized axes, now and then one big
    enough for the threaded paths."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(BIG_SHAPES))
    n = draw(st.integers(0, 3))
    c = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    spatial = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=2)))
    return (n, c) + spatial


def divisors(c):
    return [g for g in range(1, c + 1) if c % g == 0]


@st.composite
def gn_cases(draw, func, one_in=None):
    shape = draw(gn_shapes())
    c = shape[1]
    case = dict(
        func=func,
        seed=draw(st.integers(0, 2**32 - 1)),
        shape=shape,  # channels first; moved last for channel_axis = -1
        channel_axis=pick(draw, CHANNEL_AXES, one_in),
        num_groups=draw(st.sampled_from(divisors(c))),
    )
    case.update(common_arguments(draw, one_in))
    if one_in and func in FORWARDS and draw(st.integers(0, one_in - 1)) == 0:
        case["num_groups"] = draw(st.sampled_from(BAD_GROUPS))
    if func in BACKWARDS:  # a valid forward (its own hostility is drawn above), a hostile backward
        case.update(
            shape=tuple(n or 1 for n in shape),
            dtype=draw(st.sampled_from(KERNEL_DTYPES * 3 + ["int32", "bool"] + HALF_DTYPES)),
            channel_axis=draw(st.sampled_from([1, -1])),
            eps=draw(st.sampled_from([1e-5, 1e-5, 0.0, 5e-324, 1e-12, 1.0, 1e30])),
            forward_gamma=draw(st.sampled_from(["none", "right", "int"])),
            backward_gamma=pick(draw, Choices(("same", "same", "none", "right", "float16",
                                               "list", "other_float"),
                                              ("wrong_shape", "object", "complex")), one_in),
            dy_shape=pick(draw, Choices(("same",), ("wrong", "flat")), one_in),
            dy_dtype=pick(draw, Choices(("like_y",) * 3 + ("float32", "float64"),
                                        ("int32", "bool", "complex64", "object")), one_in),
            dy_kind=draw(st.sampled_from(["normal", "normal", "huge", "small", "subnormal",
                                          "nan", "inf", "zeros", "mixed"])),
            dy_layout=draw(layouts),
            out=pick(draw, Choices(("none", "none", "right", "alias_dy", "alias_x"),
                                   ("wrong_shape", "wrong_dtype", "swapped", "noncontiguous",
                                    "readonly", "list")), one_in),
        )
    return case


def _channels_last(case):
    return case["channel_axis"] == -1


def _shape(case):
    shape = case["shape"]
    return shape[:1] + shape[2:] + shape[1:2] if _channels_last(case) else shape


def _num_groups(case):
    groups = case["num_groups"]
    return case["shape"][1] + 1 if groups == "not_a_divisor" else groups


def _instance(func):
    return func.startswith("instance")


def build_forward(case):
    """(args, kwargs, protected inputs, outputs) of one forward call, built afresh."""
    rng = np.random.default_rng(case["seed"])
    shape, c = _shape(case), case["shape"][1]
    values = typed_values(rng, shape, case["x_kind"], case["dtype"])
    dtype = result_dtype(case["dtype"])
    mode = case["out"]
    if mode == "overlap_x" and values.dtype == dtype and values.size > 0:
        x, out = overlapping_pair(values, dtype, case["seed"] % 2 == 0)
    else:
        layout = case["x_layout"]
        if mode == "alias_x" and values.dtype == dtype:
            layout = Layout()
        x = with_layout(values, layout)
        out = make_out(rng, "right" if mode == "overlap_x" else mode, shape, dtype, x=x)
    gamma = make_param(rng, case["gamma"], (c,), dtype, "gamma")
    beta = make_param(rng, case["beta"], (c,), dtype, "beta")
    args = [x] if _instance(case["func"]) else [x, _num_groups(case)]
    kwargs = dict(gamma=gamma, beta=beta, eps=case["eps"], channel_axis=case["channel_axis"],
                  num_threads=case["num_threads"])
    outputs = {}
    if out is not None:
        kwargs["out"] = outputs["out"] = out
    return args, kwargs, [x, gamma, beta], outputs


def build_backward(case, module):
    """A valid forward with `module`, then the backward's hostile arguments."""
    rng = np.random.default_rng(case["seed"])
    shape, c = _shape(case), case["shape"][1]
    dtype = result_dtype(case["dtype"])
    x = with_layout(typed_values(rng, shape, case["x_kind"], case["dtype"]), case["x_layout"])
    gamma = make_param(rng, case["forward_gamma"], (c,), dtype, "gamma")
    beta = make_param(rng, case["forward_gamma"], (c,), dtype, "beta")
    kwargs = dict(gamma=gamma, beta=beta, eps=case["eps"], channel_axis=case["channel_axis"])
    with np.errstate(all="ignore"):
        if _instance(case["func"]):
            _, cache = module.instance_norm_forward(x, **kwargs)
        else:
            _, cache = module.group_norm_forward(x, case["num_groups"], **kwargs)
    dy_shape = {"same": shape, "wrong": shape[:-1] + (shape[-1] + 1,),
                "flat": (int(np.prod(shape)),)}[case["dy_shape"]]
    dy_dtype = str(dtype) if case["dy_dtype"] == "like_y" else case["dy_dtype"]
    dy = with_layout(typed_values(rng, dy_shape, case["dy_kind"], dy_dtype), case["dy_layout"])
    backward_gamma = gamma if case["backward_gamma"] == "same" else make_param(
        rng, case["backward_gamma"], (c,), dtype, "gamma")
    mode = case["out"]
    out = dy if mode == "alias_dy" else x if mode == "alias_x" else make_out(rng, mode, shape,
                                                                             dtype)
    call_kwargs = dict(gamma=backward_gamma, num_threads=case["num_threads"])
    outputs = {}
    if out is not None:
        call_kwargs["out"] = outputs["out"] = out
    return [dy, cache], call_kwargs, [x, dy, gamma, backward_gamma], outputs, x


def invoke(module, case):
    """(exception, result, snapshot of the inputs, of the outs, outputs) of one call."""
    with np.errstate(all="ignore"):
        if case["func"] in BACKWARDS:
            try:
                args, kwargs, protected, outputs, _ = build_backward(case, module)
            except (TypeError, ValueError) as exc:  # pragma: no cover - the draws are valid
                raise AssertionError(f"the forward of a backward case raised {exc!r}") from exc
        else:
            args, kwargs, protected, outputs = build_forward(case)
        outs = [owner(o) for o in outputs.values() if isinstance(o, np.ndarray)]
        protected = [a for a in protected if isinstance(a, np.ndarray)
                     and not any(np.may_share_memory(owner(a), o) for o in outs)]
        inputs = Snapshot(*protected)
        outs = Snapshot(*[o for o in outputs.values() if isinstance(o, np.ndarray)])
        try:
            result = getattr(module, case["func"])(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - judged by the caller
            return exc, None, inputs, outs, outputs
        return None, result, inputs, outs, outputs


def group_rows(a, case, n_groups):
    """(N * G, group size) float64 view of an array of x's shape: one row per group."""
    a = np.asarray(a, np.float64)
    if _channels_last(case):
        a = np.moveaxis(a, -1, 1)
    width = a.shape[1] // n_groups * int(np.prod(a.shape[2:], dtype=np.int64))
    return a.reshape(a.shape[0] * n_groups, width)


def channel_rows(values, case, n_groups):
    """Per-channel values (C,) laid out like group_rows (each group's channels repeated over
    its spatial extent)."""
    shape = case["shape"]
    spatial = int(np.prod(shape[2:]))
    per_channel = np.repeat(np.asarray(values, np.float64), spatial)
    return np.tile(per_channel.reshape(n_groups, shape[1] // n_groups * spatial), (shape[0], 1))


def allowance(case, x_rows, rstd, mean, dtype):
    rtol, atol = tolerance(dtype)
    with np.errstate(all="ignore"):
        largest = np.max(np.abs(np.where(np.isfinite(x_rows), x_rows, 0.0)), axis=1,
                         initial=0.0)
        kappa = (largest + np.abs(np.nan_to_num(mean))) * np.nan_to_num(rstd, posinf=0.0)
    floor = 8 * float(np.finfo(np.dtype(dtype).newbyteorder("=")).tiny)
    return rtol, atol, 4 * np.finfo(np.float64).eps * kappa[:, None], floor


def assert_agrees(actual, desired, allowed, name):
    actual = np.asarray(actual, np.float64)
    desired = np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, name
    finite = np.isfinite(desired)
    np.testing.assert_array_equal(np.isfinite(actual), finite, err_msg=f"{name}: non-finite "
                                  "where the reference is finite (or the other way round)")
    with np.errstate(all="ignore"):
        error = np.where(finite, np.abs(actual - desired), 0.0)
        bad = error > np.broadcast_to(allowed, error.shape)
    assert not bad.any(), (f"{name}: largest error {error.max():.3g} at {np.argwhere(bad)[0]}, "
                           f"allowed {np.broadcast_to(allowed, error.shape)[bad].min():.3g}")


def compare(case, result, expected):
    """fastln's results against the reference's; the inputs rebuilt (an out may overlap x)."""
    c = case["shape"][1]
    n_groups = c if _instance(case["func"]) else _num_groups(case)
    names = (("dx", "dgamma", "dbeta") if case["func"] in BACKWARDS
             else ("y", "cache") if case["func"].endswith("_forward") else ("y",))
    if len(names) == 1:
        result, expected = (result,), (expected,)
    for name, got, want in zip(names, result, expected):
        if name != "cache":
            assert type(got) is type(want) and got.dtype == want.dtype, name
    dtype = np.asarray(expected[0]).dtype
    if case["func"] in BACKWARDS:
        return compare_backward(case, result, expected, n_groups, dtype)
    args, kwargs = build_forward(case)[:2]
    x = args[0]
    x_rows = group_rows(x, case, n_groups)
    if "cache" in names:
        for field in ("mean", "rstd"):
            got = np.asarray(getattr(result[1], field), np.float64).reshape(-1)
            want = np.asarray(getattr(expected[1], field), np.float64).reshape(-1)
            rtol, _ = tolerance(np.asarray(getattr(result[1], field)).dtype)
            assert_agrees(got, want, rtol * np.abs(want) + np.finfo(np.float64).tiny * 8,
                          f"cache.{field}")
    kwargs.pop("out", None)
    kwargs.pop("num_threads")
    with np.errstate(all="ignore"):  # the reference's statistics, for the allowance
        _, cache = (ref.instance_norm_forward(x, **kwargs) if _instance(case["func"])
                    else ref.group_norm_forward(x, n_groups, **kwargs))
    rstd = np.asarray(cache.rstd, np.float64).reshape(-1)
    mean = np.asarray(cache.mean, np.float64).reshape(-1)
    gamma = np.ones(c) if kwargs["gamma"] is None else np.asarray(kwargs["gamma"], np.float64)
    beta = np.zeros(c) if kwargs["beta"] is None else np.asarray(kwargs["beta"], np.float64)
    y_rows = group_rows(expected[0], case, n_groups)
    gamma_rows, beta_rows = channel_rows(gamma, case, n_groups), channel_rows(beta, case, n_groups)
    with np.errstate(all="ignore"):
        x_hat = np.where(gamma_rows != 0, (y_rows - beta_rows) / gamma_rows, 0.0)
    rtol, atol, centring, floor = allowance(case, x_rows, rstd, mean, dtype)
    size = np.abs(gamma_rows) * np.maximum(1.0, np.nan_to_num(np.abs(x_hat))) + np.abs(beta_rows)
    allowed = rtol * np.abs(np.nan_to_num(y_rows)) + atol * size + centring * np.abs(
        gamma_rows) + floor
    assert_agrees(group_rows(result[0], case, n_groups), y_rows, allowed, "y")


def compare_backward(case, result, expected, n_groups, dtype):
    args, kwargs, _, _, x = build_backward(case, ref)
    x_rows = group_rows(x, case, n_groups)
    dy_rows = group_rows(args[0], case, n_groups)
    c = case["shape"][1]
    cache = args[1]
    gamma = np.ones(c) if kwargs["gamma"] is None else np.asarray(kwargs["gamma"], np.float64)
    gamma_rows = channel_rows(gamma, case, n_groups)
    rstd = np.asarray(cache.rstd, np.float64).reshape(-1)
    mean = np.asarray(cache.mean, np.float64).reshape(-1)
    rtol, atol, centring, floor = allowance(case, x_rows, rstd, mean, dtype)
    h = x_rows.shape[1]
    with np.errstate(all="ignore"):
        dxhat = np.max(np.abs(np.nan_to_num(dy_rows * gamma_rows)), axis=1, initial=0.0)
        dx_size = (np.nan_to_num(rstd, posinf=0.0) * dxhat * (2 + np.sqrt(h)))[:, None]
        x_hat = (x_rows - mean[:, None]) * np.nan_to_num(rstd, posinf=0.0)[:, None]
    dx_rows = group_rows(expected[0], case, n_groups)
    allowed = rtol * np.abs(np.nan_to_num(dx_rows)) + (atol + centring) * dx_size + floor
    if np.isinf(rstd).any():  # groups whose rstd is beyond the cache's range: judged by dx alone
        allowed = allowed + rtol * np.abs(np.nan_to_num(dx_rows))
    assert_agrees(group_rows(result[0], case, n_groups), dx_rows, allowed, "dx")
    with np.errstate(all="ignore"):
        per_channel = np.abs(np.nan_to_num(dy_rows)) * np.maximum(1.0, np.abs(
            np.nan_to_num(x_hat)))
        sums = per_channel.reshape(case["shape"][0], n_groups, -1, h // max(
            c // n_groups, 1) if h else 1).sum(axis=(0, 3)).reshape(-1) if x_rows.size else 0.0
    for name, got, want in zip(("dgamma", "dbeta"), result[1:], expected[1:]):
        want64 = np.asarray(want, np.float64)
        allowed = rtol * np.abs(np.nan_to_num(want64)) + (atol + 4 * np.finfo(
            np.float64).eps * np.nan_to_num(centring.max(initial=0.0))) * (sums + 1.0) + floor
        assert_agrees(got, want64, allowed, name)


def check_case(case):
    mine = invoke(fastln, case)
    theirs = invoke(ref, case)
    exc, result, inputs, outs, outputs = mine
    ref_exc, expected = theirs[0], theirs[1]
    if ref_exc is not None:
        assert isinstance(ref_exc, (TypeError, ValueError)), ref_exc
        assert exc is not None, f"fastln accepted what the reference refused: {ref_exc!r}"
        assert type(exc) is type(ref_exc), (exc, ref_exc)
        assert str(exc), "an error without a message"
        inputs.assert_unchanged()
        outs.assert_unchanged()
        return
    assert exc is None, f"fastln raised {exc!r} where the reference did not"
    inputs.assert_unchanged()
    if "out" in outputs:
        first = result[0] if isinstance(result, tuple) else result
        assert first is outputs["out"], "the result is not the out= given"
    with np.errstate(all="ignore"):  # rebuilding the arguments (integer casts of NaN)
        compare(case, result, expected)


@pytest.mark.parametrize("func", SUITES)
@HOSTILE
@given(data=st.data())
def test_valid_calls_agree_with_the_reference(func, data):
    check_case(data.draw(gn_cases(func), label="case"))


@pytest.mark.parametrize("func", SUITES)
@HOSTILE
@given(data=st.data())
def test_invalid_calls_raise_like_the_reference(func, data):
    check_case(data.draw(gn_cases(func, one_in=4), label="case"))


@pytest.mark.parametrize("values", [[1.5e308, -1.5e308, 1.5e308, -1.5e308],
                                    [3e160, 1e160, -2e160, 0.0], [0.0, 5e-324, 1e-323, 0.0]])
@pytest.mark.parametrize("channel_axis", [1, -1])
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_the_ends_of_float64(values, channel_axis, eps):
    """Groups near DBL_MAX of both signs, squares beyond double, subnormal spreads with eps = 0:
    forward and backward as the reference gives them (it scales each group first)."""
    x = np.array(values).reshape(1, 2, 2)
    if channel_axis == -1:
        x = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    dy = np.arange(1.0, 5.0).reshape(x.shape)
    for groups in (1, 2):
        y, cache = fastln.group_norm_forward(x, groups, eps=eps, channel_axis=channel_axis)
        y_ref, cache_ref = ref.group_norm_forward(x, groups, eps=eps, channel_axis=channel_axis)
        np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-300)
        got = fastln.group_norm_backward(dy, cache)
        want = ref.group_norm_backward(dy, cache_ref)
        # dx is a difference of terms of size rstd * |dy|: its rounding is relative to that
        rstd = np.nan_to_num(np.asarray(cache_ref.rstd, np.float64), posinf=0.0).max()
        for a, b in zip(got, want):
            scale = max(float(np.max(np.abs(b))), 4.0 * rstd)
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=max(1e-12 * scale, 1e-300))


def harness_case(**changes):
    case = dict(func="group_norm", seed=1, shape=(2, 4, 5), channel_axis=1, num_groups=2,
                dtype="float64", x_kind="normal", x_layout=Layout(), eps=1e-5, num_threads=None,
                gamma="right", beta="right", out="none")
    case.update(changes)
    return case


def test_harness_catches_a_wrong_result(monkeypatch):
    check_case(harness_case())
    right = fastln.group_norm
    monkeypatch.setattr(fastln, "group_norm", lambda *a, **k: right(*a, **k) * (1 + 1e-9))
    with pytest.raises(AssertionError, match="y: largest error"):
        check_case(harness_case())


def test_harness_catches_a_modified_input(monkeypatch):
    right = fastln.group_norm

    def modifies_x(x, *args, **kwargs):
        y = right(x, *args, **kwargs)
        x[0, 0, 0] += 1.0
        return y

    monkeypatch.setattr(fastln, "group_norm", modifies_x)
    with pytest.raises(AssertionError, match="an input's memory was modified"):
        check_case(harness_case())
