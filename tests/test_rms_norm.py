"""fastln.rms_norm / rms_norm_forward / rms_norm_backward against fastln.reference, PyTorch and
ONNX's own RMSNormalization test cases, plus the promises shared with LayerNorm (determinism,
accuracy, layouts, clear errors)."""
import math

import numpy as np
import pytest
from conftest import (DTYPES, LAYOUTS, THREADS, Snapshot, assert_bitwise_equal, assert_close,
                      assert_output_array, make_layout, numeric_gradient, onnx_node_cases,
                      random_input, random_params)

import fastln
from fastln import reference

# (shape, axis): every axis of the 3-D and 4-D shapes.
SHAPES_AXES = [((1, 1), -1), ((1, 768), -1), ((7, 33), -1), ((7, 33), 0), ((5, 1), 1)]
SHAPES_AXES += [((3, 4, 5), axis) for axis in range(3)]
SHAPES_AXES += [((2, 3, 4, 5), axis) for axis in range(4)]

# > 65536 elements, so that the threads really run.
BIG = (300, 1000)


def _forward_backward(module, x, gamma, dy, axis, num_threads=None):
    y, cache = module.rms_norm_forward(x, gamma, axis=axis, num_threads=num_threads)
    dx, dgamma = module.rms_norm_backward(dy, cache, gamma, num_threads=num_threads)
    return y, cache, dx, dgamma


# ---------------------------------------------------------------------------------------------
# Parity with the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_threads", THREADS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, axis", SHAPES_AXES)
def test_matches_reference(rng, shape, axis, dtype, layout, num_threads):
    x = random_input(rng, shape, dtype)
    gamma, _ = random_params(rng, shape[axis:], dtype)
    dy = random_input(rng, shape, dtype)
    expected = _forward_backward(reference, x, gamma, dy, axis)

    x_in, gamma_in, dy_in = (make_layout(a, layout) for a in (x, gamma, dy))
    snapshot = Snapshot(x_in, gamma_in, dy_in)
    y, cache, dx, dgamma = _forward_backward(fastln, x_in, gamma_in, dy_in, axis, num_threads)
    snapshot.assert_unchanged()

    assert_output_array(y, shape, dtype)
    assert_output_array(dx, shape, dtype)
    assert_output_array(dgamma, shape[axis:], dtype)
    assert cache.rstd.shape == shape[:axis] and cache.rstd.dtype == dtype
    assert_close(y, expected[0])
    assert_close(cache.rstd, expected[1].rstd)
    assert_close(dx, expected[2])
    assert_close(dgamma, expected[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gamma_none_is_ones_and_rms_norm_is_forward_y(rng, dtype):
    x = random_input(rng, (6, 17), dtype)
    dy = random_input(rng, (6, 17), dtype)
    y, cache = fastln.rms_norm_forward(x)
    assert_bitwise_equal(y, fastln.rms_norm(x))
    assert_bitwise_equal(y, fastln.rms_norm(x, np.ones(17, dtype)))
    dx, dgamma = fastln.rms_norm_backward(dy, cache)
    dx1, dgamma1 = fastln.rms_norm_backward(dy, cache, np.ones(17, dtype))
    assert_bitwise_equal(dx, dx1)
    assert_bitwise_equal(dgamma, dgamma1)
    assert_close(y, reference.rms_norm(x))


def test_formula_and_axis_semantics(rng):
    """y = x / sqrt(mean(x**2) + eps) * gamma, statistics over x.shape[axis:]."""
    x = rng.standard_normal((2, 3, 4))
    gamma = rng.standard_normal((3, 4))
    y = fastln.rms_norm(x, gamma, eps=1e-3, axis=1)
    rms = np.sqrt(np.mean(x ** 2, axis=(1, 2), keepdims=True) + 1e-3)
    assert_close(y, x / rms * gamma)
    assert_close(fastln.rms_norm(x, axis=-1),
                 x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + 1e-5))
    # 1-D input: one row
    assert_close(fastln.rms_norm(np.array([3.0, 4.0]), eps=0.0),
                 [3 / math.sqrt(12.5), 4 / math.sqrt(12.5)])


def test_integer_and_bool_inputs_give_float64():
    y = fastln.rms_norm(np.arange(6).reshape(2, 3))
    assert y.dtype == np.float64
    assert_close(y, reference.rms_norm(np.arange(6.0).reshape(2, 3)))
    assert fastln.rms_norm(np.ones((2, 2), bool)).dtype == np.float64


def test_gamma_is_cast_to_x_dtype(rng):
    x = random_input(rng, (4, 9), np.float32)
    gamma = rng.standard_normal(9)  # float64
    assert_bitwise_equal(fastln.rms_norm(x, gamma), fastln.rms_norm(x, gamma.astype(np.float32)))
    assert fastln.rms_norm(x, gamma).dtype == np.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_and_in_place(rng, dtype):
    x = random_input(rng, (5, 40), dtype)
    gamma, _ = random_params(rng, (40,), dtype)
    expected = fastln.rms_norm(x, gamma)
    out = np.empty_like(x)
    assert fastln.rms_norm(x, gamma, out=out) is out
    assert_bitwise_equal(out, expected)
    x_copy = x.copy()
    assert fastln.rms_norm(x_copy, gamma, out=x_copy) is x_copy
    assert_bitwise_equal(x_copy, expected)

    dy = random_input(rng, (5, 40), dtype)
    _, cache = fastln.rms_norm_forward(x, gamma)
    dx, dgamma = fastln.rms_norm_backward(dy, cache, gamma)
    dy_copy = dy.copy()
    dx2, dgamma2 = fastln.rms_norm_backward(dy_copy, cache, gamma, out=dy_copy)
    assert dx2 is dy_copy
    assert_bitwise_equal(dx2, dx)
    assert_bitwise_equal(dgamma2, dgamma)


def test_output_overlapping_gamma_is_safe(rng):
    x = random_input(rng, (4, 8), np.float64)
    buffer = rng.standard_normal(4 * 8 + 8)
    gamma = buffer[:8]
    expected = fastln.rms_norm(x, gamma.copy())
    out = buffer[4:4 + 32].reshape(4, 8)  # starts inside gamma
    fastln.rms_norm(x, gamma, out=out)
    assert_bitwise_equal(out, expected)


def test_empty_batch_returns_empty():
    x = np.zeros((0, 5), np.float32)
    y, cache = fastln.rms_norm_forward(x)
    assert y.shape == (0, 5) and y.dtype == np.float32 and cache.rstd.shape == (0,)
    dx, dgamma = fastln.rms_norm_backward(np.zeros((0, 5), np.float32), cache)
    assert dx.shape == (0, 5)
    assert_bitwise_equal(dgamma, np.zeros(5, np.float32))


# ---------------------------------------------------------------------------------------------
# Properties (hypothesis)
# ---------------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402


@settings(max_examples=30)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), num_threads=st.sampled_from(THREADS))
def test_property_matches_reference(data, dtype, num_threads):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=9))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    elements = st.floats(-1e3, 1e3, width=32)
    x = data.draw(hnp.arrays(dtype, shape, elements=elements))
    gamma = data.draw(hnp.arrays(dtype, shape[axis:], elements=st.floats(-4, 4, width=32)))
    dy = data.draw(hnp.arrays(dtype, shape, elements=st.floats(-4, 4, width=32)))
    eps = data.draw(st.sampled_from([1e-5, 1e-2, 1.0]))
    y, cache = fastln.rms_norm_forward(x, gamma, eps, axis=axis, num_threads=num_threads)
    y_ref, cache_ref = reference.rms_norm_forward(x, gamma, eps, axis=axis)
    scale = max(1.0, float(np.max(np.abs(gamma), initial=0)))
    assert_close(y, y_ref, scale=scale)
    dx, dgamma = fastln.rms_norm_backward(dy, cache, gamma, num_threads=num_threads)
    dx_ref, dgamma_ref = reference.rms_norm_backward(dy, cache_ref, gamma)
    # dx scales like |dy| * |gamma| / rms(x), which is large for tiny rows: compare relative to it
    assert_close(dx, dx_ref, scale=max(1.0, float(np.max(np.abs(dx_ref), initial=0))))
    assert_close(dgamma, dgamma_ref)


@settings(max_examples=20)
@given(data=st.data())
def test_property_scale_invariance(data):
    """RMSNorm ignores a positive rescaling of the row (up to eps)."""
    x = data.draw(hnp.arrays(np.float64, (3, 8), elements=st.floats(-10, 10)).filter(
        lambda a: np.all(np.mean(a ** 2, axis=1) > 1e-2)))
    factor = data.draw(st.floats(0.5, 1e3))
    assert_close(fastln.rms_norm(x * factor, eps=0.0), fastln.rms_norm(x, eps=0.0), rtol=1e-12,
                 atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Gradients by finite differences (float64)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, axis", [((3, 7), -1), ((2, 3, 4), 1), ((4,), 0)])
def test_gradients_match_finite_differences(rng, shape, axis):
    x = rng.standard_normal(shape)
    gamma = rng.standard_normal(shape[axis:])
    weights = rng.standard_normal(shape)  # loss = sum(weights * y)

    def loss():
        return float(np.sum(weights * reference.rms_norm(x, gamma, 1e-3, axis=axis)))

    _, cache = fastln.rms_norm_forward(x, gamma, 1e-3, axis=axis)
    dx, dgamma = fastln.rms_norm_backward(weights, cache, gamma)
    assert_close(dx, numeric_gradient(loss, x), rtol=1e-6, atol=1e-7)
    assert_close(dgamma, numeric_gradient(loss, gamma), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Determinism: thread count and batch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_identical_for_every_thread_count(rng, dtype):
    x = random_input(rng, BIG, dtype)
    gamma, _ = random_params(rng, BIG[1:], dtype)
    dy = random_input(rng, BIG, dtype)
    results = [_forward_backward(fastln, x, gamma, dy, -1, n) for n in (1, 2, 3)]
    for y, cache, dx, dgamma in results[1:]:
        assert_bitwise_equal(y, results[0][0])
        assert_bitwise_equal(cache.rstd, results[0][1].rstd)
        assert_bitwise_equal(dx, results[0][2])
        assert_bitwise_equal(dgamma, results[0][3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance(rng, dtype):
    x = random_input(rng, BIG, dtype)
    gamma, _ = random_params(rng, BIG[1:], dtype)
    y, cache = fastln.rms_norm_forward(x, gamma, num_threads=2)
    for row in (0, 1, 137, BIG[0] - 1):
        y_row, cache_row = fastln.rms_norm_forward(x[row], gamma)
        assert_bitwise_equal(y_row, y[row])
        assert_bitwise_equal(cache_row.rstd, cache.rstd[row])
        assert_bitwise_equal(fastln.rms_norm(x[row:row + 5], gamma), y[row:row + 5])


# ---------------------------------------------------------------------------------------------
# Accuracy: offsets, huge and tiny magnitudes, special values
# ---------------------------------------------------------------------------------------------

def _exact_rms_norm(x, eps):
    """Per row with math.fsum in float64 (x's values are exact in float64)."""
    x = np.asarray(x, np.float64)
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    for n, row in enumerate(rows):
        out[n] = row / math.sqrt(math.fsum(row * row) / row.size + eps)
    return out.reshape(x.shape)


@pytest.mark.parametrize("dtype, offset", [(np.float32, 1e4), (np.float64, 1e8)])
def test_large_offsets(rng, dtype, offset):
    x = (offset + rng.standard_normal((8, 1000))).astype(dtype)
    assert_close(fastln.rms_norm(x), _exact_rms_norm(x, 1e-5), rtol=4 * np.finfo(dtype).eps,
                 atol=4 * np.finfo(dtype).eps)


@pytest.mark.parametrize("n_cols", [15, 777, 4096])
@pytest.mark.parametrize("scale, offset, eps", [(1.0, 0.0, 1e-5), (1.0, 1e4, 1e-5),
                                                (1e20, 0.0, 1e-5), (1e-20, 0.0, 0.0)])
def test_float32_y_within_three_roundings(rng, n_cols, scale, offset, eps):
    """float32 rows are written in float32: rstd rounded to float32, then x * rstd and * gamma,
    one rounding of u32 (relative) each, so |y - y*| <= 3 u32 |y*| (u32 = 2**-24) whatever
    the magnitude."""
    x = ((offset + rng.standard_normal((6, n_cols))) * scale).astype(np.float32)
    gamma = rng.uniform(-2.0, 2.0, n_cols).astype(np.float32)
    y = fastln.rms_norm(x, gamma, eps=eps)
    y_exact = _exact_rms_norm(x, eps) * gamma.astype(np.float64)
    error = np.abs(y.astype(np.float64) - y_exact)
    assert np.all(error <= 3.001 * 2.0**-24 * np.abs(y_exact))


@pytest.mark.parametrize("n_cols", [15, 777, 4096])
@pytest.mark.parametrize("scale, offset", [(1.0, 0.0), (1.0, 1e4), (1e20, 0.0), (1e-20, 0.0)])
def test_float32_backward_within_a_few_roundings(rng, n_cols, scale, offset):
    """float32 rows: dx_hat = dy * gamma rounded to float32 before the double sum (moving
    mean(dx_hat * x_hat) by up to u32 / 2 of mean|dx_hat * x_hat|), then dx in float32 with the
    cache's rstd: an ulp of dx plus 4 u32 (u32 = 2**-24) of its terms rstd * |dx_hat| and
    rstd * |x_hat * mean(dx_hat * x_hat)|. dgamma: each product rounded once, then summed in
    double."""
    x = ((offset + rng.standard_normal((6, n_cols))) * scale).astype(np.float32)
    dy = rng.standard_normal((6, n_cols)).astype(np.float32)
    gamma = rng.uniform(-2.0, 2.0, n_cols).astype(np.float32)
    _, cache = fastln.rms_norm_forward(x, gamma, eps=0.0 if scale < 1 else 1e-5)
    dx, dgamma = fastln.rms_norm_backward(dy, cache, gamma)

    u32 = 2.0**-24
    rstd = cache.rstd.astype(np.float64)[:, None]  # the float32 rstd the backward is given
    x_hat = x.astype(np.float64) * rstd
    dx_hat = dy.astype(np.float64) * gamma.astype(np.float64)
    mean = np.array([math.fsum(row) for row in dx_hat * x_hat])[:, None] / n_cols
    dx_exact = rstd * (dx_hat - x_hat * mean)
    terms = rstd * (np.abs(dx_hat) + np.abs(x_hat * mean))
    rounding = rstd * np.abs(x_hat) * u32 / 2 * np.mean(np.abs(dx_hat * x_hat), axis=1)[:, None]
    bound = np.spacing(np.abs(dx_exact).astype(np.float32)) + 4 * u32 * terms + rounding
    assert np.all(np.abs(dx - dx_exact) <= bound)
    dgamma_exact = np.sum(dy.astype(np.float64) * x_hat, axis=0)
    dgamma_terms = np.sum(np.abs(dy.astype(np.float64) * x_hat), axis=0)
    assert np.all(np.abs(dgamma - dgamma_exact)
                  <= np.spacing(np.abs(dgamma_exact).astype(np.float32)) + 2 * u32 * dgamma_terms)


def test_float32_near_1e20_does_not_overflow(rng):
    x = (rng.standard_normal((4, 300)) * 1e20).astype(np.float32)
    x[0, :] = 3e38  # squares far beyond float32's range
    y, cache = fastln.rms_norm_forward(x)
    assert np.all(np.isfinite(y))
    assert_close(y, _exact_rms_norm(x, 1e-5), np.float32)
    dx, dgamma = fastln.rms_norm_backward(np.ones_like(x), cache)
    assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dgamma))


def test_float64_huge_values_are_rescaled(rng):
    x = rng.standard_normal((3, 50)) * 1e200  # squares overflow float64
    y = fastln.rms_norm(x)
    assert np.all(np.isfinite(y))
    expected = x / (np.max(np.abs(x), axis=1, keepdims=True)
                    * np.sqrt(np.mean((x / np.max(np.abs(x), axis=1, keepdims=True)) ** 2,
                                      axis=1, keepdims=True)))
    assert_close(y, expected)


def test_tiny_values(rng):
    x = (rng.standard_normal((2, 64)) * 1e-20).astype(np.float32)
    assert_close(fastln.rms_norm(x, eps=0.0), _exact_rms_norm(x, 0.0), np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_row_gives_zeros_not_nan(dtype):
    x = np.zeros((3, 10), dtype)
    x[1] = 2.0
    y, cache = fastln.rms_norm_forward(x)
    assert np.all(y[0] == 0) and np.all(y[2] == 0)
    assert not np.any(np.isnan(y))
    dx, dgamma = fastln.rms_norm_backward(np.ones_like(x), cache)
    assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dgamma))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_row_with_eps_zero_gives_zeros_and_infinite_rstd(dtype):
    x = np.zeros((2, 9), dtype)
    x[1] = -3.0
    y, cache = fastln.rms_norm_forward(x, eps=0.0)
    assert_bitwise_equal(y[0], np.zeros(9, dtype))
    assert_close(y[1], -np.ones(9))
    assert cache.rstd[0] == np.inf
    y_ref, cache_ref = reference.rms_norm_forward(x, eps=0.0)
    assert_bitwise_equal(y, y_ref)
    assert_bitwise_equal(cache.rstd, cache_ref.rstd)


def test_float64_tiny_values_with_eps_zero_are_rescaled(rng):
    x = rng.standard_normal((3, 40)) * 1e-170  # squares underflow float64
    scale = 2.0 ** 560
    expected = (x * scale) / np.sqrt(np.mean((x * scale) ** 2, axis=1, keepdims=True))
    assert_close(fastln.rms_norm(x, eps=0.0), expected)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_affects_its_row_only(rng, bad):
    x = rng.standard_normal((4, 20))
    x[2, 5] = bad
    y = fastln.rms_norm(x)
    clean = np.delete(np.arange(4), 2)
    assert_bitwise_equal(y[clean], fastln.rms_norm(x[clean]))
    assert not np.all(np.isfinite(y[2]))


# ---------------------------------------------------------------------------------------------
# Independent implementations: PyTorch and ONNX
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, axis", [((4, 768), -1), ((2, 3, 16), 1), ((3, 5, 7), 2)])
def test_matches_torch(rng, dtype, shape, axis):
    torch = pytest.importorskip("torch")
    x = random_input(rng, shape, dtype)
    gamma, _ = random_params(rng, shape[axis:], dtype)
    dy = random_input(rng, shape, dtype)
    x_t = torch.tensor(x, requires_grad=True)
    gamma_t = torch.tensor(gamma, requires_grad=True)
    y_t = torch.nn.functional.rms_norm(x_t, shape[axis:], gamma_t, eps=1e-5)
    y_t.backward(torch.tensor(dy))

    y, cache = fastln.rms_norm_forward(x, gamma, 1e-5, axis=axis)
    dx, dgamma = fastln.rms_norm_backward(dy, cache, gamma)
    assert_close(y, y_t.detach().numpy())
    assert_close(dx, x_t.grad.numpy())
    assert_close(dgamma, gamma_t.grad.numpy())


def test_onnx_rms_normalization_cases():
    cases = onnx_node_cases("rmsnormalization", "RMSNormalization")
    assert len(cases) >= 15
    for name, (x, scale), (expected,), attributes in cases:
        y = fastln.rms_norm(x, scale, attributes.get("epsilon", 1e-5),
                            axis=attributes.get("axis", -1))
        assert y.dtype == expected.dtype, name
        assert_close(y, expected, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Errors: type, message naming the argument, inputs unchanged
# ---------------------------------------------------------------------------------------------

def _x():
    return np.arange(12, dtype=np.float64).reshape(3, 4)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x=np.ones((2, 3), complex)), TypeError, "x has dtype complex128"),
    (dict(x=np.array(["a", "b"])), TypeError, "x"),
    (dict(x=np.ones((2, 3), np.longdouble)), TypeError, "x has dtype float128"),
    (dict(x=np.float64(3.0)), ValueError, "x must have at least 1 dimension"),
    (dict(x=np.ones((3, 0))), ValueError, "empty"),
    (dict(axis=2), ValueError, "axis 2 is out of bounds"),
    (dict(axis=1.0), TypeError, "axis must be an int"),
    (dict(gamma=np.ones(3)), ValueError,
     r"gamma has shape \(3,\), expected x.shape\[axis:\] = \(4,\)"),
    (dict(gamma=np.ones(4, complex)), TypeError, "gamma has dtype complex128"),
    (dict(eps=-1.0), ValueError, "eps must be a finite number >= 0"),
    (dict(eps=float("nan")), ValueError, "eps"),
    (dict(eps="small"), TypeError, "eps must be a real number"),
    (dict(num_threads=0), ValueError, "num_threads must be None or a positive int"),
    (dict(num_threads=1.5), ValueError, "num_threads"),
    (dict(num_threads=True), ValueError, "num_threads"),
    (dict(out=np.empty((4, 3))), ValueError, r"out has shape \(4, 3\), expected \(3, 4\)"),
    (dict(out=np.empty((3, 4), np.float32)), ValueError, "out has dtype float32, expected float64"),
    (dict(out=np.empty((4, 3)).T), ValueError, "out must be C-contiguous"),
    (dict(out=[[0.0] * 4] * 3), TypeError, "out must be a numpy.ndarray"),
])
@pytest.mark.parametrize("function", [fastln.rms_norm, fastln.rms_norm_forward,
                                      reference.rms_norm])
def test_forward_errors(function, kwargs, error, match):
    kwargs = dict(kwargs)
    x = kwargs.pop("x", _x())
    snapshot = Snapshot(x, *kwargs.values())
    with pytest.raises(error, match=match):
        function(x, **kwargs)
    snapshot.assert_unchanged()


def test_read_only_out_is_an_error():
    out = np.empty((3, 4))
    out.setflags(write=False)
    with pytest.raises(ValueError, match="out is read-only"):
        fastln.rms_norm(_x(), out=out)


def test_forward_out_overlapping_x_is_an_error():
    x = _x()
    with pytest.raises(ValueError, match="out overlaps x"):
        fastln.rms_norm_forward(x, out=x)


@pytest.mark.parametrize("backward", [fastln.rms_norm_backward, reference.rms_norm_backward])
def test_backward_errors(backward):
    forward = fastln.rms_norm_forward if backward is fastln.rms_norm_backward else \
        reference.rms_norm_forward
    x = _x()
    _, cache = forward(x)
    dy = np.ones((3, 4))
    snapshot = Snapshot(x, dy)
    with pytest.raises(TypeError, match="cache must be the cache returned by rms_norm_forward"):
        backward(dy, object())
    _, ln_cache = fastln.layer_norm_forward(x)
    with pytest.raises(ValueError, match="cache comes from layer_norm_forward"):
        backward(dy, ln_cache)
    with pytest.raises(ValueError, match=r"dy has shape \(4, 3\)"):
        backward(np.ones((4, 3)), cache)
    with pytest.raises(ValueError, match="dy has dtype float32, expected float64"):
        backward(dy.astype(np.float32), cache)
    with pytest.raises(ValueError, match=r"gamma has shape \(3,\)"):
        backward(dy, cache, np.ones(3))
    with pytest.raises(ValueError, match="num_threads"):
        backward(dy, cache, num_threads=-1)
    with pytest.raises(ValueError, match=r"out has shape \(2, 6\)"):
        backward(dy, cache, out=np.empty((2, 6)))
    snapshot.assert_unchanged()


def test_cache_repr_and_attributes(rng):
    x = random_input(rng, (2, 3, 4), np.float32)
    _, cache = fastln.rms_norm_forward(x, axis=1)
    assert cache.x is x and cache.axis == 1 and cache.eps == 1e-5
    assert cache.shape == x.shape and cache.dtype == np.float32
    assert "RMSNormCache" in repr(cache)
