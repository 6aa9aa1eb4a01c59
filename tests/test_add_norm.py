"""fastln.add_layer_norm / add_rms_norm (and their _forward): s = x + residual (+ bias), y = norm(s)
in one pass. Held to fastln.reference, to the unfused fastln.layer_norm / rms_norm of s (bitwise),
to PyTorch's norm of a sum, and to the usual promises (aliasing, determinism, errors)."""
import numpy as np
import pytest
from conftest import (DTYPES, LAYOUTS, THREADS, Snapshot, assert_bitwise_equal, assert_close,
                      assert_output_array, at_line_offset, make_layout, numeric_gradient,
                      random_input, random_params)

import fastln
from fastln import reference

KINDS = ("layer", "rms")

SHAPES_AXES = [((1, 1), -1), ((1, 768), -1), ((7, 33), -1), ((7, 33), 0)]
SHAPES_AXES += [((3, 4, 5), axis) for axis in range(3)]
SHAPES_AXES += [((2, 3, 4, 5), axis) for axis in range(4)]

BIG = (256, 1030)  # > 65536 elements: the threads really run


def _add_forward(module, kind, x, residual, gamma, beta, bias, **kwargs):
    if kind == "layer":
        return module.add_layer_norm_forward(x, residual, gamma, beta, bias=bias, **kwargs)
    return module.add_rms_norm_forward(x, residual, gamma, bias=bias, **kwargs)


def _add(module, kind, x, residual, gamma, beta, bias, **kwargs):
    if kind == "layer":
        return module.add_layer_norm(x, residual, gamma, beta, bias=bias, **kwargs)
    return module.add_rms_norm(x, residual, gamma, bias=bias, **kwargs)


def _norm(kind, s, gamma, beta, **kwargs):
    if kind == "layer":
        return fastln.layer_norm(s, gamma, beta, **kwargs)
    return fastln.rms_norm(s, gamma, **kwargs)


def _backward(kind, dy, cache, gamma, **kwargs):
    """ds (and dgamma) from the plain backward of the cache."""
    if kind == "layer":
        ds, dgamma, _ = fastln.layer_norm_backward(dy, cache, gamma, **kwargs)
    else:
        ds, dgamma = fastln.rms_norm_backward(dy, cache, gamma, **kwargs)
    return ds, dgamma


def _inputs(rng, shape, axis, dtype):
    x = random_input(rng, shape, dtype)
    residual = random_input(rng, shape, dtype, offset=2.0)
    gamma, beta = random_params(rng, shape[axis:], dtype)
    bias = rng.standard_normal(shape[axis:]).astype(dtype)
    return x, residual, gamma, beta, bias


# ---------------------------------------------------------------------------------------------
# Parity with the reference and with the unfused norm of s
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_threads", THREADS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, axis", SHAPES_AXES)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(rng, kind, shape, axis, dtype, layout, num_threads):
    x, residual, gamma, beta, bias = _inputs(rng, shape, axis, dtype)
    use_bias = bias if (len(shape) + axis) % 2 == 0 else None  # half the cases with a bias
    y_ref, s_ref, _ = _add_forward(reference, kind, x, residual, gamma, beta, use_bias, axis=axis)

    x_in, residual_in = make_layout(x, layout), make_layout(residual, layout)
    snapshot = Snapshot(x_in, residual_in, gamma, beta, bias)
    y, s, cache = _add_forward(fastln, kind, x_in, residual_in, gamma, beta, use_bias, axis=axis,
                               num_threads=num_threads)
    snapshot.assert_unchanged()
    assert_output_array(y, shape, dtype)
    assert_output_array(s, shape, dtype)
    assert_bitwise_equal(s, s_ref)  # both round the float64 sum once
    assert_close(y, y_ref)
    assert cache.x is s
    assert_bitwise_equal(y, _norm(kind, s, gamma, beta, axis=axis))

    y2, s2 = _add(fastln, kind, x_in, residual_in, gamma, beta, use_bias, axis=axis,
                  num_threads=num_threads)
    assert_bitwise_equal(y2, y)
    assert_bitwise_equal(s2, s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_is_numpys_sum(rng, dtype):
    """Without bias s is exactly NumPy's x + residual (one rounding of an exact sum)."""
    x, residual, *_ = _inputs(rng, (9, 50), -1, dtype)
    _, s = fastln.add_layer_norm(x, residual)
    assert_bitwise_equal(s, x + residual)
    _, s = fastln.add_rms_norm(x, residual)
    assert_bitwise_equal(s, x + residual)


@pytest.mark.parametrize("n_rows", [9, 700], ids=["in cache", "beyond 8 MiB"])
def test_float32_sum_is_numpys_sum_in_both_loops(n_rows):
    """float32 sums are added in float for calls in cache and in double beyond (both round the
    exact sum once): NumPy's x + residual either way, at overflow, subnormals and cancellation."""
    rng = np.random.default_rng(43)
    shape = (n_rows, 1000)
    scales = rng.choice(np.array([3e38, 1e-39, 1e4, 1.0, 1e-3]), size=shape)
    finite = np.finfo(np.float32).max
    x = np.clip(rng.standard_normal(shape) * scales, -finite, finite).astype(np.float32)
    residual = np.clip(rng.standard_normal(shape) * scales[::-1], -finite, finite)
    residual = residual.astype(np.float32)
    residual[:, ::7] = -x[:, ::7]  # exact cancellation: +0
    for function in (fastln.add_layer_norm, fastln.add_rms_norm):
        with np.errstate(over="ignore"):
            _, s = function(x, residual)
            assert_bitwise_equal(s, x + residual)


def test_bias_sum_is_rounded_once(rng):
    x = np.full((1, 3), 1.0, np.float32)
    residual = np.full((1, 3), 2.0 ** -24, np.float32)
    bias = np.full(3, 2.0 ** -24, np.float32)
    _, s = fastln.add_rms_norm(x, residual, bias=bias)
    # (1 + 2^-24) + 2^-24 rounds to 1 twice in float32; once from float64 it is 1 + 2^-23.
    assert_bitwise_equal(s, np.full((1, 3), 1.0 + 2.0 ** -23, np.float32))


def test_dtype_follows_x_and_integer_inputs(rng):
    x = random_input(rng, (3, 8), np.float32)
    residual = rng.standard_normal((3, 8))  # float64: cast to float32
    y, s = fastln.add_layer_norm(x, residual)
    assert y.dtype == s.dtype == np.float32
    assert_bitwise_equal(s, x + residual.astype(np.float32))
    y, s = fastln.add_rms_norm(np.arange(6).reshape(2, 3), np.ones((2, 3), int))
    assert y.dtype == s.dtype == np.float64
    assert_bitwise_equal(s, np.arange(6.0).reshape(2, 3) + 1)


# ---------------------------------------------------------------------------------------------
# Outputs and aliasing: sum_out=residual (the in-place residual stream), out=x, ...
# ---------------------------------------------------------------------------------------------

ALIASES = [
    dict(sum_out="residual"),
    dict(sum_out="x"),
    dict(out="x"),
    dict(out="residual"),
    dict(out="x", sum_out="residual"),
    dict(out="residual", sum_out="x"),
    dict(out="new", sum_out="new"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("aliases", ALIASES,
                         ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
@pytest.mark.parametrize("kind", KINDS)
def test_outputs_may_alias_inputs(rng, kind, aliases, dtype):
    x, residual, gamma, beta, bias = _inputs(rng, (40, 300), -1, dtype)
    y_expected, s_expected = _add(fastln, kind, x, residual, gamma, beta, bias)
    arrays = dict(x=x.copy(), residual=residual.copy())
    kwargs = {name: (np.empty_like(x) if target == "new" else arrays[target])
              for name, target in aliases.items()}
    y, s = _add(fastln, kind, arrays["x"], arrays["residual"], gamma, beta, bias,
                num_threads=2, **kwargs)
    if "out" in kwargs:
        assert y is kwargs["out"]
    if "sum_out" in kwargs:
        assert s is kwargs["sum_out"]
    assert_bitwise_equal(y, y_expected)
    assert_bitwise_equal(s, s_expected)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_cache_with_sum_out_residual(rng, kind):
    """The residual stream updated in place, and the cache (which is s = residual) still works."""
    x, residual, gamma, beta, _ = _inputs(rng, (6, 20), -1, np.float64)
    dy = rng.standard_normal((6, 20))
    y_ref, s_ref, cache_ref = _add_forward(fastln, kind, x, residual.copy(), gamma, beta, None)
    stream = residual.copy()
    y, s, cache = _add_forward(fastln, kind, x, stream, gamma, beta, None, sum_out=stream)
    assert s is stream and cache.x is stream
    assert_bitwise_equal(y, y_ref)
    for got, want in zip(_backward(kind, dy, cache, gamma), _backward(kind, dy, cache_ref, gamma)):
        assert_bitwise_equal(got, want)


def test_inputs_overlapping_outputs_partially_are_copied(rng):
    base = rng.standard_normal(10 * 16 + 16)
    x = base[:160].reshape(10, 16)
    residual = rng.standard_normal((10, 16))
    gamma = rng.standard_normal(16)
    y_expected, s_expected = fastln.add_layer_norm(x.copy(), residual, gamma)
    out = base[16:176].reshape(10, 16)  # one row past x: overlaps without coinciding
    y, s = fastln.add_layer_norm(x, residual, gamma, out=out)
    assert_bitwise_equal(y, y_expected)
    assert_bitwise_equal(s, s_expected)


def test_empty_batch():
    x = np.zeros((0, 4), np.float32)
    y, s, cache = fastln.add_layer_norm_forward(x, x)
    assert y.shape == s.shape == (0, 4) and cache.mean.shape == (0,)
    y, s, cache = fastln.add_rms_norm_forward(x, x)
    assert y.shape == (0, 4) and cache.rstd.shape == (0,)


# ---------------------------------------------------------------------------------------------
# Gradients through the cache (float64 finite differences)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_gradients_through_the_cache(rng, kind):
    """dx = dresidual = ds from the plain backward, dbias = sum of ds over the batch axes."""
    shape, axis = (2, 3, 4), 1
    x, residual, gamma, beta, bias = (a.astype(np.float64) for a in _inputs(rng, shape, axis,
                                                                               np.float64))
    weights = rng.standard_normal(shape)

    def loss():
        y, _ = _add(reference, kind, x, residual, gamma, beta, bias, axis=axis, eps=1e-3)
        return float(np.sum(weights * y))

    _, _, cache = _add_forward(fastln, kind, x, residual, gamma, beta, bias, axis=axis, eps=1e-3)
    ds, dgamma = _backward(kind, weights, cache, gamma)
    assert_close(ds, numeric_gradient(loss, x), rtol=1e-6, atol=1e-7)
    assert_close(ds, numeric_gradient(loss, residual), rtol=1e-6, atol=1e-7)
    assert_close(ds.sum(axis=0), numeric_gradient(loss, bias), rtol=1e-6, atol=1e-7)
    assert_close(dgamma, numeric_gradient(loss, gamma), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_bitwise_identical_for_every_thread_count_and_batch(rng, kind, dtype):
    x, residual, gamma, beta, bias = _inputs(rng, BIG, -1, dtype)
    results = [_add_forward(fastln, kind, x, residual, gamma, beta, bias, num_threads=n)
               for n in (1, 2, 3)]
    y, s, cache = results[0]
    stat = "mean" if kind == "layer" else "rstd"
    for y_n, s_n, cache_n in results[1:]:
        assert_bitwise_equal(y_n, y)
        assert_bitwise_equal(s_n, s)
        assert_bitwise_equal(getattr(cache_n, stat), getattr(cache, stat))
        assert_bitwise_equal(cache_n.rstd, cache.rstd)
    for row in (0, 77, BIG[0] - 1):
        y_row, s_row = _add(fastln, kind, x[row], residual[row], gamma, beta, bias)
        assert_bitwise_equal(y_row, y[row])
        assert_bitwise_equal(s_row, s[row])


# ---------------------------------------------------------------------------------------------
# Accuracy with large offsets
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, offset", [(np.float32, 1e4), (np.float64, 1e8)])
def test_large_offsets(rng, dtype, offset):
    """A residual stream far from zero: s keeps its digits and y matches an exact computation."""
    residual = np.full((6, 512), offset, dtype)
    x = rng.standard_normal((6, 512)).astype(dtype)
    y, s = fastln.add_layer_norm(x, residual)
    s64 = s.astype(np.float64)
    # exact reference on the same s: centre with a shift from the row (exact by Sterbenz)
    d = s64 - s64[:, :1]
    centred = d - np.array([np.float64(sum(map(float, row))) / row.size for row in d])[:, None]
    expected = centred / np.sqrt(np.mean(centred ** 2, axis=1, keepdims=True) + 1e-5)
    assert_close(y, expected, dtype=dtype, rtol=8 * np.finfo(dtype).eps,
                 atol=8 * np.finfo(dtype).eps)


# ---------------------------------------------------------------------------------------------
# PyTorch: layer_norm / rms_norm of a sum
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_torch_norm_of_sum(rng, kind, dtype):
    torch = pytest.importorskip("torch")
    shape, axis = (4, 6, 64), 1
    x, residual, gamma, beta, bias = _inputs(rng, shape, axis, dtype)
    dy = random_input(rng, shape, dtype)
    tensors = {name: torch.tensor(a, requires_grad=True)
               for name, a in dict(x=x, residual=residual, gamma=gamma, beta=beta,
                                   bias=bias).items()}
    s_t = tensors["x"] + tensors["residual"] + tensors["bias"]
    if kind == "layer":
        y_t = torch.nn.functional.layer_norm(s_t, shape[axis:], tensors["gamma"],
                                             tensors["beta"], eps=1e-5)
    else:
        y_t = torch.nn.functional.rms_norm(s_t, shape[axis:], tensors["gamma"], eps=1e-5)
    y_t.backward(torch.tensor(dy))

    y, s, cache = _add_forward(fastln, kind, x, residual, gamma, beta, bias, axis=axis)
    ds, dgamma = _backward(kind, dy, cache, gamma)
    assert_close(s, s_t.detach().numpy())
    assert_close(y, y_t.detach().numpy())
    assert_close(ds, tensors["x"].grad.numpy())
    assert_close(ds, tensors["residual"].grad.numpy())
    assert_close(ds.sum(axis=0), tensors["bias"].grad.numpy())
    assert_close(dgamma, tensors["gamma"].grad.numpy())


# ---------------------------------------------------------------------------------------------
# Properties (hypothesis)
# ---------------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402


@settings(max_examples=30)
@given(data=st.data(), kind=st.sampled_from(KINDS), dtype=st.sampled_from(DTYPES),
       num_threads=st.sampled_from(THREADS))
def test_property_matches_reference(data, kind, dtype, num_threads):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=9))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    values = st.floats(-1e3, 1e3, width=32)
    x = data.draw(hnp.arrays(dtype, shape, elements=values))
    residual = data.draw(hnp.arrays(dtype, shape, elements=values))
    gamma = data.draw(hnp.arrays(dtype, shape[axis:], elements=st.floats(-4, 4, width=32)))
    bias = data.draw(st.none() | hnp.arrays(dtype, shape[axis:], elements=values))
    y, s = _add(fastln, kind, x, residual, gamma, None, bias, axis=axis, num_threads=num_threads)
    y_ref, s_ref = _add(reference, kind, x, residual, gamma, None, bias, axis=axis)
    assert_bitwise_equal(s, s_ref)
    assert_close(y, y_ref, scale=max(1.0, float(np.max(np.abs(gamma), initial=0))))


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def _args():
    return np.arange(12.0).reshape(3, 4), np.ones((3, 4))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x=np.ones((3, 4), complex)), TypeError, "x has dtype complex128"),
    (dict(residual=np.ones((3, 4), complex)), TypeError, "residual has dtype complex128"),
    (dict(residual=np.array([["a"] * 4] * 3)), TypeError, "residual"),
    (dict(residual=np.ones(4)), ValueError,
     r"residual has shape \(4,\), expected x.shape = \(3, 4\)"),
    (dict(bias=np.ones(3)), ValueError, r"bias has shape \(3,\), expected x.shape\[axis:\]"),
    (dict(bias=np.ones(4, complex)), TypeError, "bias has dtype complex128"),
    (dict(gamma=np.ones((3, 4))), ValueError, r"gamma has shape \(3, 4\)"),
    (dict(axis=5), ValueError, "axis 5 is out of bounds"),
    (dict(eps=-1), ValueError, "eps"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(out=np.empty((3, 4), np.float32)), ValueError, "out has dtype float32"),
    (dict(sum_out=np.empty((4, 3))), ValueError, r"sum_out has shape \(4, 3\)"),
    (dict(sum_out=np.empty((3, 4), np.float32)), ValueError, "sum_out has dtype float32"),
    (dict(sum_out=np.empty((4, 3)).T), ValueError, "sum_out must be C-contiguous"),
    (dict(sum_out=[0.0]), TypeError, "sum_out must be a numpy.ndarray"),
])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("module", [fastln, reference], ids=["fastln", "reference"])
def test_errors(module, kind, kwargs, error, match):
    kwargs = dict(kwargs)
    x, residual = _args()
    x = kwargs.pop("x", x)
    residual = kwargs.pop("residual", residual)
    snapshot = Snapshot(x, residual, *kwargs.values())
    function = module.add_layer_norm if kind == "layer" else module.add_rms_norm
    with pytest.raises(error, match=match):
        function(x, residual, **kwargs)
    snapshot.assert_unchanged()


@pytest.mark.parametrize("kind", KINDS)
def test_out_and_sum_out_must_not_overlap(kind):
    x, residual = _args()
    buffer = np.empty((3, 4))
    snapshot = Snapshot(x, residual)
    for function in ((fastln.add_layer_norm, fastln.add_layer_norm_forward) if kind == "layer"
                     else (fastln.add_rms_norm, fastln.add_rms_norm_forward)):
        with pytest.raises(ValueError, match="out and sum_out overlap"):
            function(x, residual, out=buffer, sum_out=buffer)
        with pytest.raises(ValueError, match="out and sum_out overlap"):
            function(x, residual, out=residual, sum_out=residual)
    snapshot.assert_unchanged()


def test_read_only_sum_out_is_an_error():
    x, residual = _args()
    residual.setflags(write=False)
    with pytest.raises(ValueError, match="sum_out is read-only"):
        fastln.add_rms_norm(x, residual, sum_out=residual)


def test_caches_are_rejected_by_the_other_backward(rng):
    x, residual = _args()
    _, _, ln_cache = fastln.add_layer_norm_forward(x, residual)
    _, _, rms_cache = fastln.add_rms_norm_forward(x, residual)
    with pytest.raises(ValueError, match="cache comes from layer_norm_forward"):
        fastln.rms_norm_backward(np.ones((3, 4)), ln_cache)
    with pytest.raises(ValueError, match="cache comes from rms_norm_forward"):
        fastln.layer_norm_backward(np.ones((3, 4)), rms_cache)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_results_do_not_depend_on_where_the_rows_start(rng, dtype):
    """The residual add takes each row's columns up to the sum's next cache line apart from the
    rest (fastln/forward.h, add_row): the sum and y, with and without bias, must be the bits of
    the same arrays starting on a line, whatever the element offset from one."""
    x = (100 * rng.standard_normal((5, 768))).astype(dtype)
    x[0, 0], x[4, 767] = np.nan, np.inf
    residual = rng.standard_normal((5, 768)).astype(dtype)
    gamma, beta, bias = (rng.standard_normal(768).astype(np.float32) for _ in range(3))

    def run(offset, with_bias):
        results = []
        for op, params in ((fastln.add_layer_norm, (gamma, beta)), (fastln.add_rms_norm, (gamma,))):
            s = at_line_offset(np.zeros_like(x), offset)
            y = at_line_offset(np.zeros_like(x), offset)
            op(at_line_offset(x, offset), at_line_offset(residual, offset), *params,
               bias=bias if with_bias else None, out=y, sum_out=s)
            results += [s.copy(), y.copy()]
        return results

    with np.errstate(invalid="ignore"):
        for with_bias in (False, True):
            expected = run(0, with_bias)
            for offset in range(x.itemsize, 64, x.itemsize):
                for got, want in zip(run(offset, with_bias), expected):
                    assert_bitwise_equal(got, want, err_msg=f"offset {offset}")
