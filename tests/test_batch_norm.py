"""fastln.batch_norm / batch_norm_forward / batch_norm_backward: per-feature statistics over the
batch, running statistics (momentum = the lesson's alpha, weight of the OLD value), training and
evaluation modes. Held to fastln.reference, the lesson's formulas, PyTorch (momentum converted)
and the usual promises (determinism across threads, large offsets, layouts, clear errors)."""
import math

import numpy as np
import pytest
from conftest import (
    DTYPES,
    LAYOUTS,
    THREADS,
    Snapshot,
    assert_bitwise_equal,
    assert_close,
    assert_output_array,
    make_layout,
    random_input,
    random_params,
)

import fastln
from fastln import reference

# (shape, feature axis): both kernel layouts (features last: "rows"; features inside: "segments")
SHAPES_AXES = [((1, 1), -1), ((1, 5), -1), ((7, 3), -1), ((7, 3), 0), ((40, 33), -1)]
SHAPES_AXES += [((3, 4, 5), axis) for axis in range(3)]
SHAPES_AXES += [((2, 3, 4, 5), axis) for axis in range(4)]

# > 65536 elements, so that threads run: rows layout (one and three feature chunks), segments
# layout (one and eight outer blocks), few features
BIG = [((4100, 40), -1), ((70, 1100), -1), ((16, 24, 13, 17), 1), ((64, 2, 1030), 1),
       ((3, 70000), 0)]


def _running(rng, n_features):
    return rng.standard_normal(n_features), 0.5 + rng.random(n_features)


def _forward_backward(module, x, gamma, beta, running, dy, training, axis, num_threads=None,
                      momentum=0.9):
    running_mean, running_var = (None, None) if running is None else running
    y, cache = module.batch_norm_forward(x, gamma, beta, running_mean, running_var,
                                         training=training, momentum=momentum, axis=axis,
                                         num_threads=num_threads)
    dx, dgamma, dbeta = module.batch_norm_backward(dy, cache, gamma, num_threads=num_threads)
    return y, cache, dx, dgamma, dbeta


# ---------------------------------------------------------------------------------------------
# Parity with the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_threads", THREADS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, axis", SHAPES_AXES)
def test_matches_reference(rng, shape, axis, dtype, training, layout, num_threads):
    n_features = shape[axis]
    x = random_input(rng, shape, dtype, offset=3.0)
    gamma, beta = random_params(rng, (n_features,), dtype)
    dy = random_input(rng, shape, dtype)
    running = _running(rng, n_features)
    running_ref = tuple(r.copy() for r in running)
    expected = _forward_backward(reference, x, gamma, beta, running_ref, dy, training, axis)

    x_in, dy_in = make_layout(x, layout), make_layout(dy, layout)
    snapshot = Snapshot(x_in, dy_in, gamma, beta)
    y, cache, dx, dgamma, dbeta = _forward_backward(fastln, x_in, gamma, beta, running, dy_in,
                                                    training, axis, num_threads)
    snapshot.assert_unchanged()
    assert_output_array(y, shape, dtype)
    assert_output_array(dx, shape, dtype)
    assert_output_array(dgamma, (n_features,), dtype)
    assert_output_array(dbeta, (n_features,), dtype)
    assert cache.mean.shape == cache.rstd.shape == (n_features,)
    assert_close(y, expected[0])
    assert_close(cache.mean, expected[1].mean, dtype=dtype)
    assert_close(cache.rstd, expected[1].rstd, dtype=dtype)
    assert_close(dx, expected[2])
    assert_close(dgamma, expected[3])
    assert_close(dbeta, expected[4])
    assert_close(running[0], running_ref[0], dtype=np.float64)
    assert_close(running[1], running_ref[1], dtype=np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lesson_formulas(rng, dtype):
    """Section 8.2: batch mean, biased variance, x_hat, gamma/beta, running averages."""
    x = random_input(rng, (50, 6), dtype, offset=5.0)
    gamma, beta = random_params(rng, (6,), dtype)
    running_mean, running_var = _running(rng, 6)
    old_mean, old_var = running_mean.copy(), running_var.copy()
    alpha = 0.8
    y = fastln.batch_norm(x, gamma, beta, running_mean, running_var, training=True,
                          momentum=alpha, eps=1e-3)
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=0)
    var = ((x64 - mu) ** 2).mean(axis=0)  # divide by m
    expected = gamma.astype(np.float64) * (x64 - mu) / np.sqrt(var + 1e-3) + beta
    assert_close(y, expected, dtype=dtype)
    assert_close(running_mean, alpha * old_mean + (1 - alpha) * mu)
    assert_close(running_var, alpha * old_var + (1 - alpha) * var)

    # evaluation: the fixed transform with the running statistics, which are not touched
    snapshot = Snapshot(running_mean, running_var)
    y = fastln.batch_norm(x, gamma, beta, running_mean, running_var, eps=1e-3)
    snapshot.assert_unchanged()
    expected = gamma.astype(np.float64) * (x64 - running_mean) / np.sqrt(running_var + 1e-3) + beta
    assert_close(y, expected, dtype=dtype)


def test_docstring_example_and_feature_axis():
    x = np.array([[1.0, 10.0], [3.0, 30.0]])
    running_mean, running_var = np.zeros(2), np.ones(2)
    y = fastln.batch_norm(x, running_mean=running_mean, running_var=running_var, training=True,
                          eps=0.0)
    assert_close(y, [[-1.0, -1.0], [1.0, 1.0]])
    assert_close(running_mean, [0.2, 2.0])
    assert_close(running_var, [1.0, 10.9])
    # NCHW with axis=1: the statistics of channel c run over N, H and W
    images = np.random.default_rng(1).standard_normal((4, 3, 5, 5))
    y = fastln.batch_norm(images, training=True, axis=1)
    mean = images.mean(axis=(0, 2, 3), keepdims=True)
    var = images.var(axis=(0, 2, 3), keepdims=True)
    assert_close(y, (images - mean) / np.sqrt(var + 1e-5))


def test_training_without_running_statistics(rng):
    x = random_input(rng, (20, 4), np.float64)
    y = fastln.batch_norm(x, training=True)
    assert_close(y, reference.batch_norm(x, training=True))


@pytest.mark.parametrize("momentum", [0.0, 0.5, 1.0])
def test_momentum_extremes(rng, momentum):
    x = random_input(rng, (30, 3), np.float64)
    running_mean, running_var = _running(rng, 3)
    old = running_mean.copy(), running_var.copy()
    fastln.batch_norm(x, running_mean=running_mean, running_var=running_var, training=True,
                      momentum=momentum)
    if momentum == 1.0:
        assert_bitwise_equal(running_mean, old[0])
        assert_bitwise_equal(running_var, old[1])
    if momentum == 0.0:
        assert_close(running_mean, x.mean(axis=0))
        assert_close(running_var, x.var(axis=0))


@pytest.mark.parametrize("running_dtype", [np.float32, np.float64, ">f8"])
def test_running_statistics_any_float_dtype_and_strides(rng, running_dtype):
    x = random_input(rng, (25, 5), np.float64)
    base_mean = np.zeros(10, running_dtype)
    base_var = np.ones(10, running_dtype)
    running_mean, running_var = base_mean[::2], base_var[::2]  # strided views, updated in place
    fastln.batch_norm(x, running_mean=running_mean, running_var=running_var, training=True)
    dtype = np.dtype(running_dtype).newbyteorder("=")
    assert_close(base_mean[::2], 0.1 * x.mean(axis=0), dtype=dtype)
    assert_close(base_var[::2], 0.9 + 0.1 * x.var(axis=0), dtype=dtype)
    assert np.all(base_mean[1::2] == 0) and np.all(base_var[1::2] == 1)


def test_eval_mode_accepts_array_likes():
    x = np.arange(6.0).reshape(3, 2)
    y = fastln.batch_norm(x, running_mean=[1, 2], running_var=[4, 9], eps=0.0)
    assert_close(y, (x - [1, 2]) / [2, 3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_of_one_gives_beta_and_zero_gradient(rng, dtype):
    x = random_input(rng, (1, 6), dtype)
    gamma, beta = random_params(rng, (6,), dtype)
    running_mean, running_var = np.zeros(6), np.ones(6)
    y, cache = fastln.batch_norm_forward(x, gamma, beta, running_mean, running_var,
                                         training=True)
    assert_bitwise_equal(y, beta.reshape(1, 6))
    assert_close(running_var, np.full(6, 0.9))  # the batch variance 0, folded in
    dx, dgamma, dbeta = fastln.batch_norm_backward(np.ones_like(x), cache, gamma)
    assert np.array_equal(dx, np.zeros_like(x))  # exactly zero (either sign)
    assert_bitwise_equal(dbeta, np.ones(6, dtype))
    # a 1-D x is one value per feature as well
    assert_bitwise_equal(fastln.batch_norm(x[0], gamma, beta, training=True), beta)


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_feature_gives_beta_not_nan(rng, dtype):
    x = random_input(rng, (30, 4), dtype)
    x[:, 2] = 7.5
    gamma, beta = random_params(rng, (4,), dtype)
    y = fastln.batch_norm(x, gamma, beta, training=True)
    assert_bitwise_equal(y[:, 2], np.full(30, beta[2], dtype))


def test_nan_affects_its_feature_only(rng):
    x = rng.standard_normal((20, 5))
    x[3, 1] = np.nan
    y = fastln.batch_norm(x, training=True)
    assert np.all(np.isnan(y[:, 1]))
    keep = [0, 2, 3, 4]
    assert_bitwise_equal(y[:, keep], fastln.batch_norm(np.ascontiguousarray(x[:, keep]),
                                                       training=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_and_in_place(rng, dtype):
    x = random_input(rng, (64, 12), dtype)
    gamma, beta = random_params(rng, (12,), dtype)
    expected = fastln.batch_norm(x, gamma, beta, training=True)
    out = np.empty_like(x)
    assert fastln.batch_norm(x, gamma, beta, training=True, out=out) is out
    assert_bitwise_equal(out, expected)
    x_copy = x.copy()
    assert fastln.batch_norm(x_copy, gamma, beta, training=True, out=x_copy) is x_copy
    assert_bitwise_equal(x_copy, expected)
    assert_bitwise_equal(reference.batch_norm(x, gamma, beta, training=True, out=x.copy()),
                         reference.batch_norm(x, gamma, beta, training=True))

    dy = random_input(rng, (64, 12), dtype)
    _, cache = fastln.batch_norm_forward(x, gamma, beta, training=True)
    dx, dgamma, dbeta = fastln.batch_norm_backward(dy, cache, gamma)
    dy_copy = dy.copy()
    result = fastln.batch_norm_backward(dy_copy, cache, gamma, out=dy_copy)
    assert result[0] is dy_copy
    for got, want in zip(result, (dx, dgamma, dbeta)):
        assert_bitwise_equal(got, want)


def test_integer_input_gives_float64():
    y = fastln.batch_norm(np.arange(12).reshape(4, 3), training=True)
    assert y.dtype == np.float64
    assert_close(y, reference.batch_norm(np.arange(12.0).reshape(4, 3), training=True))


def test_empty_inputs():
    y, cache = fastln.batch_norm_forward(np.zeros((0, 3), np.float32), running_mean=np.zeros(3),
                                         running_var=np.ones(3))
    assert y.shape == (0, 3) and y.dtype == np.float32
    dx, dgamma, dbeta = fastln.batch_norm_backward(np.zeros((0, 3), np.float32), cache)
    assert dx.shape == (0, 3)
    assert_bitwise_equal(dgamma, np.zeros(3, np.float32))
    y = fastln.batch_norm(np.zeros((5, 0)), training=True)  # no features: nothing to do
    assert y.shape == (5, 0)


# ---------------------------------------------------------------------------------------------
# Gradients by finite differences (float64)
# ---------------------------------------------------------------------------------------------

def _numeric_gradient(f, value, h=1e-6):
    grad = np.zeros_like(value)
    for index in np.ndindex(value.shape):
        saved = value[index]
        value[index] = saved + h
        up = f()
        value[index] = saved - h
        down = f()
        value[index] = saved
        grad[index] = (up - down) / (2 * h)
    return grad


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape, axis", [((6, 3), -1), ((2, 3, 4), 1), ((3, 2, 2), 0)])
def test_gradients_match_finite_differences(rng, shape, axis, training):
    n_features = shape[axis]
    x = rng.standard_normal(shape)
    gamma, beta = rng.standard_normal(n_features), rng.standard_normal(n_features)
    running_mean, running_var = _running(rng, n_features)
    weights = rng.standard_normal(shape)

    def loss():
        y = reference.batch_norm(x, gamma, beta, running_mean.copy(), running_var.copy(),
                                 training=training, eps=1e-3, axis=axis)
        return float(np.sum(weights * y))

    _, cache = fastln.batch_norm_forward(x, gamma, beta, running_mean.copy(), running_var.copy(),
                                         training=training, eps=1e-3, axis=axis)
    dx, dgamma, dbeta = fastln.batch_norm_backward(weights, cache, gamma)
    assert_close(dx, _numeric_gradient(loss, x), rtol=1e-6, atol=1e-7)
    assert_close(dgamma, _numeric_gradient(loss, gamma), rtol=1e-6, atol=1e-7)
    assert_close(dbeta, _numeric_gradient(loss, beta), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Determinism across thread counts
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape, axis", BIG)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_identical_for_every_thread_count(rng, dtype, shape, axis, training):
    n_features = shape[axis]
    x = random_input(rng, shape, dtype, offset=2.0)
    gamma, beta = random_params(rng, (n_features,), dtype)
    dy = random_input(rng, shape, dtype)
    runs = []
    for num_threads in (1, 2, 3):
        running = tuple(r.copy() for r in _running(np.random.default_rng(5), n_features))
        runs.append((running, _forward_backward(fastln, x, gamma, beta, running, dy, training,
                                                axis, num_threads)))
    (running0, (y0, cache0, dx0, dgamma0, dbeta0)) = runs[0]
    for running, (y, cache, dx, dgamma, dbeta) in runs[1:]:
        assert_bitwise_equal(y, y0)
        assert_bitwise_equal(cache.mean, cache0.mean)
        assert_bitwise_equal(cache.rstd, cache0.rstd)
        assert_bitwise_equal(running[0], running0[0])
        assert_bitwise_equal(running[1], running0[1])
        assert_bitwise_equal(dx, dx0)
        assert_bitwise_equal(dgamma, dgamma0)
        assert_bitwise_equal(dbeta, dbeta0)
    if training:  # and right, not only reproducible
        expected = reference.batch_norm_forward(x, gamma, beta, training=True, axis=axis)[0]
        assert_close(y0, expected)


# ---------------------------------------------------------------------------------------------
# Accuracy with large per-feature offsets
# ---------------------------------------------------------------------------------------------

def _exact_batch_norm(x, dy):
    """Per feature (columns of 2-D x) with an exact centring: shift by the first value
    (x - x0 is exact for values within a factor of two), math.fsum for every sum."""
    x = x.astype(np.float64)
    dy = dy.astype(np.float64)
    m = x.shape[0]
    y, dx = np.empty_like(x), np.empty_like(x)
    for c in range(x.shape[1]):
        d = x[:, c] - x[0, c]
        centred = d - math.fsum(d) / m
        rstd = 1 / math.sqrt(math.fsum(centred * centred) / m + 1e-5)
        x_hat = centred * rstd
        y[:, c] = x_hat
        g = dy[:, c]
        dx[:, c] = rstd * (g - math.fsum(g) / m - x_hat * math.fsum(g * x_hat) / m)
    return y, dx


@pytest.mark.parametrize("dtype, offset", [(np.float32, 1e4), (np.float64, 1e8)])
@pytest.mark.parametrize("axis", [-1, 0], ids=["rows", "segments"])
def test_large_offsets(rng, dtype, offset, axis):
    m, n_features = 2000, 6
    offsets = offset * (1 + np.arange(n_features))  # a different offset for every feature
    x = (offsets + rng.standard_normal((m, n_features))).astype(dtype)
    dy = rng.standard_normal((m, n_features)).astype(dtype)
    exact_y, exact_dx = _exact_batch_norm(x, dy)
    if axis == 0:  # the same data with the features first: (C, m) viewed as (C, m/10, 10)
        x_in = np.ascontiguousarray(x.T).reshape(n_features, m // 10, 10)
        dy_in = np.ascontiguousarray(dy.T).reshape(n_features, m // 10, 10)
    else:
        x_in, dy_in = x, dy
    y, cache = fastln.batch_norm_forward(x_in, training=True, axis=axis)
    dx, _, _ = fastln.batch_norm_backward(dy_in, cache)
    if axis == 0:
        y = y.reshape(n_features, m).T
        dx = dx.reshape(n_features, m).T
    tolerance = 8 * np.finfo(dtype).eps
    assert_close(y, exact_y, dtype=dtype, rtol=tolerance, atol=tolerance)
    assert_close(dx, exact_dx, dtype=dtype, rtol=tolerance, atol=tolerance)


# ---------------------------------------------------------------------------------------------
# PyTorch: batch_norm with its momentum converted
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 10), (8, 6, 5, 7)])
def test_matches_torch(rng, shape, dtype, training):
    torch = pytest.importorskip("torch")
    n_features = shape[1]
    x = random_input(rng, shape, dtype, offset=1.0)
    gamma, beta = random_params(rng, (n_features,), dtype)
    dy = random_input(rng, shape, dtype)
    running_mean, running_var = (r.astype(dtype) for r in _running(rng, n_features))
    old_var = running_var.astype(np.float64)
    momentum = 0.9

    x_t = torch.tensor(x, requires_grad=True)
    gamma_t = torch.tensor(gamma, requires_grad=True)
    beta_t = torch.tensor(beta, requires_grad=True)
    running_mean_t, running_var_t = torch.tensor(running_mean), torch.tensor(running_var)
    y_t = torch.nn.functional.batch_norm(x_t, running_mean_t, running_var_t, gamma_t, beta_t,
                                         training=training, momentum=1 - momentum, eps=1e-5)
    y_t.backward(torch.tensor(dy))

    y, cache = fastln.batch_norm_forward(x, gamma, beta, running_mean, running_var,
                                         training=training, momentum=momentum, axis=1)
    dx, dgamma, dbeta = fastln.batch_norm_backward(dy, cache, gamma)
    assert_close(y, y_t.detach().numpy())
    assert_close(dx, x_t.grad.numpy())
    assert_close(dgamma, gamma_t.grad.numpy())
    assert_close(dbeta, beta_t.grad.numpy())
    assert_close(running_mean, running_mean_t.numpy())
    if training:
        # PyTorch folds the unbiased variance into running_var; fastln the biased one (lesson)
        m = x.size // n_features
        batch_var = x.astype(np.float64).swapaxes(0, 1).reshape(n_features, -1).var(axis=1)
        torch_expected = momentum * old_var + (1 - momentum) * batch_var * m / (m - 1)
        assert_close(running_var_t.numpy(), torch_expected, dtype=dtype)
        assert_close(running_var, momentum * old_var + (1 - momentum) * batch_var, dtype=dtype)
    else:
        assert_close(running_var, running_var_t.numpy())


# ---------------------------------------------------------------------------------------------
# Properties (hypothesis)
# ---------------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402


@settings(max_examples=30)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), training=st.booleans(),
       num_threads=st.sampled_from(THREADS))
def test_property_matches_reference(data, dtype, training, num_threads):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=7))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    n_features = shape[axis]
    x = data.draw(hnp.arrays(dtype, shape, elements=st.floats(-1e3, 1e3, width=32)))
    gamma = data.draw(hnp.arrays(dtype, (n_features,), elements=st.floats(-4, 4, width=32)))
    beta = data.draw(hnp.arrays(dtype, (n_features,), elements=st.floats(-4, 4, width=32)))
    running_mean = data.draw(hnp.arrays(np.float64, (n_features,),
                                        elements=st.floats(-10, 10)))
    running_var = data.draw(hnp.arrays(np.float64, (n_features,), elements=st.floats(0.1, 10)))
    momentum = data.draw(st.floats(0, 1))
    running_ref = running_mean.copy(), running_var.copy()
    y = fastln.batch_norm(x, gamma, beta, running_mean, running_var, training=training,
                          momentum=momentum, axis=axis, num_threads=num_threads)
    y_ref = reference.batch_norm(x, gamma, beta, *running_ref, training=training,
                                 momentum=momentum, axis=axis)
    # y scales with |gamma| * |x - mean| * rstd, large where eps dominates a tiny variance
    scale = max(1.0, float(np.max(np.abs(y_ref), initial=0)))
    assert_close(y, y_ref, scale=scale)
    assert_close(running_mean, running_ref[0], dtype=np.float64)
    assert_close(running_var, running_ref[1], dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def _x():
    return np.arange(12.0).reshape(4, 3)


def _running_arrays():
    return np.zeros(3), np.ones(3)


def _read_only(array):
    array.setflags(write=False)
    return array


ERRORS = [
    (dict(x=np.ones((4, 3), complex)), TypeError, "x has dtype complex128"),
    (dict(x=np.float64(1.0)), ValueError, "x must have at least 1 dimension"),
    (dict(axis=2), ValueError, "axis 2 is out of bounds"),
    (dict(axis="1"), TypeError, "axis must be an int"),
    (dict(gamma=np.ones(4)), ValueError,
     r"gamma has shape \(4,\), expected \(x.shape\[axis\],\) = \(3,\)"),
    (dict(beta=np.ones((1, 3))), ValueError, r"beta has shape \(1, 3\)"),
    (dict(gamma=np.ones(3, complex)), TypeError, "gamma has dtype complex128"),
    (dict(running_mean=None, running_var=None, training=False), ValueError,
     "running_mean and running_var are required"),
    (dict(running_var=None), ValueError, "running_mean was given without running_var"),
    (dict(running_mean=None), ValueError, "running_var was given without running_mean"),
    (dict(running_mean=np.zeros(4)), ValueError, r"running_mean has shape \(4,\), expected"),
    (dict(running_var=np.ones(3, np.int64)), TypeError, "running_var has dtype int64"),
    (dict(running_mean=[0.0, 0.0, 0.0]), TypeError, "running_mean must be a numpy.ndarray"),
    (dict(running_var=_read_only(np.ones(3))), ValueError, "running_var is read-only"),
    (dict(running_mean=np.ones(3, complex), training=False), TypeError, "running_mean has dtype"),
    (dict(running_var=np.ones(4), training=False), ValueError, r"running_var has shape \(4,\)"),
    (dict(momentum=1.5), ValueError, r"momentum must be in \[0, 1\]"),
    (dict(momentum=-0.1), ValueError, "momentum"),
    (dict(momentum=float("nan")), ValueError, "momentum"),
    (dict(momentum=True), TypeError, "momentum must be a real number"),
    (dict(momentum="0.9"), TypeError, "momentum must be a real number"),
    (dict(training="yes"), TypeError, "training must be a bool"),
    (dict(training=1), TypeError, "training must be a bool"),
    (dict(eps=-1e-5), ValueError, "eps"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(x=np.zeros((0, 3))), ValueError, "training mode needs at least one value per feature"),
    (dict(out=np.empty((3, 4))), ValueError, r"out has shape \(3, 4\), expected \(4, 3\)"),
    (dict(out=np.empty((4, 3), np.float32)), ValueError, "out has dtype float32"),
]


@pytest.mark.parametrize("kwargs, error, match", ERRORS)
@pytest.mark.parametrize("function", [fastln.batch_norm, fastln.batch_norm_forward,
                                      reference.batch_norm])
def test_errors(function, kwargs, error, match):
    kwargs = dict(kwargs)
    x = kwargs.pop("x", _x())
    running_mean, running_var = _running_arrays()
    arguments = dict(running_mean=running_mean, running_var=running_var, training=True)
    arguments.update(kwargs)
    snapshot = Snapshot(x, *[v for v in arguments.values() if isinstance(v, np.ndarray)])
    with pytest.raises(error, match=match):
        function(x, **arguments)
    snapshot.assert_unchanged()  # running statistics included: no partial update


def test_overlaps_are_errors():
    x = _x()
    running_mean, running_var = _running_arrays()
    with pytest.raises(ValueError, match="out overlaps x"):
        fastln.batch_norm_forward(x, training=True, out=x)
    buffer = np.zeros(12)
    with pytest.raises(ValueError, match="out overlaps running_mean or running_var"):
        fastln.batch_norm(x, running_mean=buffer[:3], running_var=running_var, training=True,
                          out=buffer.reshape(4, 3))
    with pytest.raises(ValueError, match="running_mean and running_var overlap"):
        fastln.batch_norm(x, running_mean=running_mean, running_var=running_mean, training=True)


@pytest.mark.parametrize("module", [fastln, reference], ids=["fastln", "reference"])
def test_backward_errors(module):
    x = _x()
    _, cache = module.batch_norm_forward(x, training=True)
    dy = np.ones((4, 3))
    snapshot = Snapshot(x, dy)
    with pytest.raises(TypeError, match="cache must be the cache returned by batch_norm_forward"):
        module.batch_norm_backward(dy, None)
    _, ln_cache = fastln.layer_norm_forward(x)
    with pytest.raises(ValueError, match="cache comes from layer_norm_forward"):
        module.batch_norm_backward(dy, ln_cache)
    with pytest.raises(ValueError, match=r"dy has shape \(3, 4\)"):
        module.batch_norm_backward(np.ones((3, 4)), cache)
    with pytest.raises(ValueError, match="dy has dtype float32"):
        module.batch_norm_backward(dy.astype(np.float32), cache)
    with pytest.raises(ValueError, match=r"gamma has shape \(4,\)"):
        module.batch_norm_backward(dy, cache, np.ones(4))
    with pytest.raises(ValueError, match=r"out has shape \(12,\)"):
        module.batch_norm_backward(dy, cache, out=np.empty(12))
    snapshot.assert_unchanged()


def test_cache_attributes():
    x = np.arange(24.0).reshape(2, 3, 4)
    _, cache = fastln.batch_norm_forward(x.astype(np.float32), training=True, axis=1)
    assert cache.axis == 1 and cache.training and cache.dtype == np.float32
    assert cache.mean.dtype == cache.rstd.dtype == np.float64
    assert_close(cache.mean, x.mean(axis=(0, 2)))
    assert "BatchNormCache" in repr(cache)
