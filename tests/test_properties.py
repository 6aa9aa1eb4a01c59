"""Property tests (hypothesis) against the reference, a finite-difference gradient check, and the
worked examples and invariances of the definition."""
import math

import numpy as np
import pytest

import fastln
import fastln.reference as ref
from conftest import (
    LAYOUTS,
    Snapshot,
    assert_bitwise_equal,
    assert_close,
    make_layout,
    random_input,
    random_params,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

FUNCS = {"fastln": fastln, "reference": ref}


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------

@st.composite
def problems(draw, max_dims=4, max_side=6, max_last=40):
    """(x, axis, gamma, beta, eps, dy, layout): any shape, axis, dtype and layout."""
    ndim = draw(st.integers(1, max_dims))
    shape = draw(st.lists(st.integers(1, max_side), min_size=ndim - 1, max_size=ndim - 1))
    shape = tuple(shape) + (draw(st.integers(1, max_last)),)
    axis = draw(st.integers(-ndim, ndim - 1))
    dtype = np.dtype(draw(st.sampled_from([np.float32, np.float64])))
    # Values in a moderate range around an arbitrary offset: the float64 reference and the
    # kernels then agree to the dtype's tolerance whatever the spread.
    offset = draw(st.sampled_from([0.0, 1.0, -100.0, 1e3]))
    elements = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)
    x = draw(hnp.arrays(np.float64, shape, elements=elements)) + offset
    x = x.astype(dtype)
    nshape = shape[axis % ndim:]
    params = st.floats(-4, 4, allow_nan=False, width=32)
    gamma = draw(st.none() | hnp.arrays(dtype, nshape, elements=params))
    beta = draw(st.none() | hnp.arrays(dtype, nshape, elements=params))
    eps = draw(st.sampled_from([1e-5, 1e-3, 0.1, 1.0]))
    dy = draw(hnp.arrays(dtype, shape, elements=st.floats(-10, 10, width=32)))
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    num_threads = draw(st.sampled_from([None, 1, 2, 3]))
    return x, axis, gamma, beta, eps, dy, layout, num_threads


@settings(max_examples=150)
@given(problems())
def test_matches_reference(problem):
    x, axis, gamma, beta, eps, dy, layout, num_threads = problem
    xl = make_layout(x, layout)
    dyl = make_layout(dy, layout)
    snap = Snapshot(xl, gamma, beta, dyl)
    y, cache = fastln.layer_norm_forward(xl, gamma, beta, eps, axis=axis, num_threads=num_threads)
    y_ref, cache_ref = ref.layer_norm_forward(x, gamma, beta, eps, axis=axis)

    # The reference centres with a float64 mean rounded once (np.mean, then x - mean), so its own
    # x_hat is only good to about u64 * kappa, kappa = max|x| * rstd: how many standard deviations
    # the values sit from 0. With |mean| = 1e3 and a spread far below sqrt(eps) that exceeds the
    # 1e-11 tolerance (test_accuracy holds the kernels to an exact reference instead).
    x64 = x.astype(np.float64)
    rstd_max = float(np.max(cache_ref.rstd.astype(np.float64), initial=1.0))
    kappa = float(np.max(np.abs(x64), initial=0.0)) * rstd_max
    g_max = 1.0 if gamma is None else float(np.max(np.abs(gamma), initial=1.0))
    dy_max = float(np.max(np.abs(dy), initial=0.0))
    row_size = int(np.prod(x.shape[axis % x.ndim:]))
    n_rows = x.size // row_size
    ref_error = 64 * np.finfo(np.float64).eps * kappa  # in units of x_hat

    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, y_ref, extra_atol=ref_error * g_max, err_msg="y")
    assert_close(cache.mean, cache_ref.mean, scale=max(1.0, float(np.max(np.abs(x64)))),
                 err_msg="mean")
    assert_close(cache.rstd, cache_ref.rstd, err_msg="rstd")

    dx, dgamma, dbeta = fastln.layer_norm_backward(dyl, cache, gamma, num_threads=num_threads)
    dx_ref, dgamma_ref, dbeta_ref = ref.layer_norm_backward(dy, cache_ref, gamma)
    # dx is a difference of terms of size rstd * |dy * gamma| (times |x_hat| <= sqrt(row size)):
    # its absolute tolerance is taken relative to that size.
    dx_scale = max(1.0, rstd_max * dy_max * g_max * math.sqrt(row_size))
    assert_close(dx, dx_ref, scale=dx_scale, extra_atol=ref_error * dx_scale, err_msg="dx")
    sums_scale = max(1.0, n_rows * dy_max * math.sqrt(row_size))
    assert_close(dgamma, dgamma_ref, scale=sums_scale, extra_atol=ref_error * sums_scale,
                 err_msg="dgamma")
    assert_close(dbeta, dbeta_ref, scale=max(1.0, n_rows * dy_max), err_msg="dbeta")
    snap.assert_unchanged()


@given(problems(max_dims=3))
def test_each_row_is_normalized(problem):
    """Without gamma/beta every row has mean 0 and variance var/(var+eps); the cache holds the
    row's mean and 1/sqrt(var+eps), checked against NumPy's own mean and var."""
    x, axis, _, _, eps, _, layout, num_threads = problem
    y, cache = fastln.layer_norm_forward(make_layout(x, layout), eps=eps, axis=axis,
                                         num_threads=num_threads)
    axis %= x.ndim
    rows = x.astype(np.float64).reshape(int(np.prod(x.shape[:axis])), -1)
    y_rows = y.astype(np.float64).reshape(rows.shape)
    var = rows.var(axis=1)
    tol = 2e-5 if x.dtype == np.float32 else 1e-11
    # the cache, in y's dtype
    np.testing.assert_allclose(cache.mean.reshape(-1), rows.mean(axis=1),
                               rtol=tol, atol=tol * (1 + np.max(np.abs(rows))))
    np.testing.assert_allclose(cache.rstd.reshape(-1), 1 / np.sqrt(var + eps), rtol=tol)
    # y itself: sum(y) = 0 and mean(y^2) = var / (var + eps)
    np.testing.assert_allclose(y_rows.mean(axis=1), 0, atol=tol * 10)
    np.testing.assert_allclose((y_rows ** 2).mean(axis=1), var / (var + eps), atol=tol * 10)


@given(problems(max_dims=3), st.data())
def test_row_alone_equals_row_in_batch(problem, data):
    """Layer norm has no cross-row dependence: any row computed alone is bitwise the same."""
    x, axis, gamma, beta, eps, _, layout, num_threads = problem
    axis %= x.ndim
    assume(axis > 0)
    y = fastln.layer_norm(make_layout(x, layout), gamma, beta, eps, axis=axis,
                          num_threads=num_threads)
    index = tuple(data.draw(st.integers(0, n - 1)) for n in x.shape[:axis])
    alone = fastln.layer_norm(x[index], gamma, beta, eps, axis=0)
    assert_bitwise_equal(alone, y[index])


# --------------------------------------------------------------------------------------------
# Worked examples
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", sorted(FUNCS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("x", [[10, 20, 60], [100, 200, 600], [1010, 1020, 1060]])
def test_worked_example_10_20_60(impl, dtype, x):
    """x = [10, 20, 60] -> x_hat = [-0.9258, -0.4629, 1.3887]; multiplying by 10 or adding
    1000 does not move it (to four decimals)."""
    y = FUNCS[impl].layer_norm(np.array(x, dtype))
    np.testing.assert_array_almost_equal(y, [-0.9258, -0.4629, 1.3887], decimal=4)


@pytest.mark.parametrize("impl", sorted(FUNCS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("x", [[2, 4, 4, 6], [16, 22, 22, 28]])
def test_worked_example_2_4_4_6(impl, dtype, x):
    """x = [2, 4, 4, 6] (and 3x + 10 = [16, 22, 22, 28]) -> x_hat = [-1.41419, 0, 0,
    1.41419] to four decimals; with gamma = [0.5, 0.5, 2, 2] and beta = [1, 1, -1, -1],
    y = gamma * x_hat + beta."""
    lib = FUNCS[impl]
    x = np.array(x, dtype)
    x_hat = np.array([-1.41419, 0, 0, 1.41419])
    np.testing.assert_array_almost_equal(lib.layer_norm(x), x_hat, decimal=4)
    gamma = np.array([0.5, 0.5, 2.0, 2.0], dtype)
    beta = np.array([1.0, 1.0, -1.0, -1.0], dtype)
    y = lib.layer_norm(x, gamma, beta)
    np.testing.assert_array_almost_equal(y, [1 - 0.5 * 1.41419, 1.0, -1.0, 2 * 1.41419 - 1],
                                         decimal=4)
    # the backward of the same example, through the reference for the reference's own cache
    _, cache = lib.layer_norm_forward(x, gamma, beta)
    dx, dgamma, dbeta = lib.layer_norm_backward(np.ones(4, dtype), cache, gamma)
    np.testing.assert_array_equal(dbeta, np.ones(4))  # one row: dbeta = dy
    np.testing.assert_array_almost_equal(dgamma, x_hat, decimal=4)  # one row: dy * x_hat


# --------------------------------------------------------------------------------------------
# Invariances: x_hat(a * x + b) = x_hat(x) for a > 0 (exactly as eps -> 0)
# --------------------------------------------------------------------------------------------

@given(
    x=hnp.arrays(np.float64, st.tuples(st.integers(1, 5), st.integers(2, 64)),
                 elements=st.floats(-10, 10, allow_nan=False)),
    a=st.floats(1e-3, 1e3),
    b=st.floats(-1e4, 1e4),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_scale_and_shift_invariance(x, a, b, dtype):
    std = x.std(axis=1)
    assume(np.all(std > 0.1))
    x = x.astype(dtype)
    x2 = (a * x.astype(np.float64) + b).astype(dtype)
    y1 = fastln.layer_norm(x, eps=0.0)
    y2 = fastln.layer_norm(x2, eps=0.0)
    # x2 is a*x + b rounded to dtype: a relative error of u = unit roundoff in each element,
    # i.e. up to u * (|a x| + |b|) absolute, which moves x_hat by that over the row's std(a x).
    # On top of that each y carries its own rounding error, relative to the row's largest |y|:
    # the one-pass variance may cancel by up to 16x before the kernel takes it again around the
    # mean (~16 u on var, ~8 u on x_hat), for each of the two calls.
    u = np.finfo(dtype).eps
    input_error = 4 * u * (np.max(np.abs(a * x.astype(np.float64)), axis=1) + abs(b)) / (a * std)
    output_error = 32 * u * np.max(np.abs(y1.astype(np.float64)), axis=1)
    err = np.max(np.abs(y1.astype(np.float64) - y2.astype(np.float64)), axis=1)
    assert np.all(err <= input_error + output_error), (err, input_error, output_error)


@given(
    x=hnp.arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(2, 50)),
                 elements=st.integers(-2**20, 2**20).map(lambda v: v / 2**10)),
    k=st.integers(-10, 10),
    b=st.integers(-2**20, 2**20),
)
def test_exact_scale_and_shift_invariance_float64(x, k, b):
    """With a a power of two and b an integer, a * x + b is exact in float64; then x_hat is equal
    up to the last few bits (eps = 0 makes the invariance exact mathematically)."""
    assume(np.all(x.std(axis=1) > 0))
    x2 = x * 2.0**k + b
    np.testing.assert_array_equal((x2 - b) / 2.0**k, x)  # the transformation really is exact
    y1 = fastln.layer_norm(x, eps=0.0)
    y2 = fastln.layer_norm(x2, eps=0.0)
    np.testing.assert_allclose(y2, y1, rtol=1e-12, atol=1e-12)


@given(
    c=st.floats(-1e30, 1e30, allow_nan=False).map(lambda v: float(np.float32(v))),
    h=st.integers(1, 70),
    n=st.integers(1, 4),
    eps=st.sampled_from([1e-5, 1e-2, 1.0]),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_constant_row_gives_beta(c, h, n, eps, dtype, seed):
    """A constant row has variance 0 and gives exactly beta (no NaN), for any constant."""
    rng = np.random.default_rng(seed)
    x = np.full((n, h), c, dtype)
    gamma, beta = random_params(rng, (h,), dtype)
    y, cache = fastln.layer_norm_forward(x, gamma, beta, eps)
    np.testing.assert_array_equal(y, np.broadcast_to(beta, y.shape))
    np.testing.assert_array_equal(fastln.layer_norm(x, eps=eps), np.zeros_like(x))
    np.testing.assert_array_equal(cache.mean, np.full(n, c, dtype))
    # the backward of a constant row: x_hat = 0, so dgamma = 0 and dx = rstd*(dy*g - mean(dy*g))
    dy = rng.standard_normal(x.shape).astype(dtype)
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma)
    np.testing.assert_array_equal(dgamma, np.zeros(h))
    dxhat = dy.astype(np.float64) * gamma
    expected = (dxhat - dxhat.mean(axis=1, keepdims=True)) / math.sqrt(eps)
    assert_close(dx, expected, dtype=dtype)
    assert_close(dbeta, dy.astype(np.float64).sum(axis=0), dtype=dtype)


# --------------------------------------------------------------------------------------------
# Finite-difference gradient check (float64)
# --------------------------------------------------------------------------------------------

def _central_difference(f, a, h):
    """d f / d a by central differences, element by element (a is modified and restored)."""
    grad = np.empty(a.shape)
    flat = a.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        step = h * max(1.0, abs(old))
        flat[i] = old + step
        f_plus = f()
        flat[i] = old - step
        f_minus = f()
        flat[i] = old
        grad.reshape(-1)[i] = (f_plus - f_minus) / (2 * step)
    return grad


@pytest.mark.parametrize("impl", sorted(FUNCS))
@pytest.mark.parametrize("eps", [1e-5, 0.5])
@pytest.mark.parametrize("shape_axis", [((3, 5), -1), ((4, 1), -1), ((1, 7), -1),
                                        ((2, 3, 4), 1), ((2, 3, 4), 2), ((3, 2, 2), 0)])
def test_gradients_match_finite_differences(rng, impl, eps, shape_axis):
    """loss = sum(w * layer_norm(x, gamma, beta)); the backward of dy = w must be the gradient
    of the loss with respect to x, gamma and beta (central differences, step 1e-6)."""
    lib = FUNCS[impl]
    shape, axis = shape_axis
    nshape = shape[axis % len(shape):]
    x = random_input(rng, shape, np.float64)
    gamma, beta = random_params(rng, nshape, np.float64)
    w = rng.standard_normal(shape)

    def loss():
        return math.fsum((w * fastln.layer_norm(x, gamma, beta, eps, axis=axis)).ravel())

    _, cache = lib.layer_norm_forward(x, gamma, beta, eps, axis=axis)
    dx, dgamma, dbeta = lib.layer_norm_backward(w, cache, gamma)

    h = 1e-6
    # central differences: truncation O(h^2) ~ 1e-12, rounding ~ 1e-16 / 1e-6 = 1e-10
    tol = dict(rtol=1e-6, atol=1e-6 * max(1.0, float(np.max(np.abs(w)))))
    np.testing.assert_allclose(dx, _central_difference(loss, x, h), **tol, err_msg="dx")
    np.testing.assert_allclose(dgamma, _central_difference(loss, gamma, h), **tol,
                               err_msg="dgamma")
    np.testing.assert_allclose(dbeta, _central_difference(loss, beta, h), **tol,
                               err_msg="dbeta")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradient_check_through_layouts(rng, layout):
    """The same gradient check with x and dy in every layout (the backward reads x back)."""
    shape = (3, 6)
    x = random_input(rng, shape, np.float64)
    gamma, beta = random_params(rng, (6,), np.float64)
    w = rng.standard_normal(shape)

    def loss():
        return math.fsum((w * fastln.layer_norm(x, gamma, beta)).ravel())

    _, cache = fastln.layer_norm_forward(make_layout(x, layout), gamma, beta)
    dx, dgamma, dbeta = fastln.layer_norm_backward(make_layout(w, layout), cache, gamma)
    np.testing.assert_allclose(dx, _central_difference(loss, x, 1e-6), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dgamma, _central_difference(loss, gamma, 1e-6), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(dbeta, _central_difference(loss, beta, 1e-6), rtol=1e-6,
                               atol=1e-6)
