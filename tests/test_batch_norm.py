"""fastln.batch_norm / batch_norm_forward / batch_norm_backward: per-feature statistics over the
batch, running statistics (momentum = the weight of the OLD value), training and evaluation
modes. Held to fastln.reference, the defining formulas, PyTorch (momentum converted)
and the usual promises (determinism across threads, large offsets, layouts, clear errors)."""
import math

import numpy as np
import pytest
from conftest import (DTYPES, LAYOUTS, THREADS, Snapshot, assert_bitwise_equal, assert_close,
                      assert_output_array, at_line_offset, make_layout, numeric_gradient,
                      placed_after, random_input, random_params)

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
def test_the_defining_formulas(rng, dtype):
    """Batch mean, biased variance, x_hat, gamma/beta, running averages, written out."""
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


@pytest.mark.parametrize("module", [fastln, reference], ids=["fastln", "reference"])
def test_a_term_of_weight_zero_is_left_out(module):
    """momentum = 0 replaces running statistics that are not finite; momentum = 1 keeps them
    next to batch statistics that are not (an Inf in x, a variance beyond float64)."""
    x = np.array([[0.0, 1e300, np.inf], [2.0, -1e300, 1.0], [4.0, 1e300, 2.0]])
    running_mean = np.array([np.inf, np.nan, 1.0])
    running_var = np.array([np.inf, np.nan, 2.0])
    module.batch_norm(x, running_mean=running_mean, running_var=running_var, training=True,
                      momentum=0.0)
    np.testing.assert_array_equal(running_mean[:2], [2.0, 1e300 / 3])
    np.testing.assert_allclose(running_var[:2], [8 / 3, np.inf])
    assert not np.isfinite(running_mean[2]) and np.isnan(running_var[2])  # the batch's
    running_mean, running_var = np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, 6.0])
    module.batch_norm(x, running_mean=running_mean, running_var=running_var, training=True,
                      momentum=1.0)
    np.testing.assert_array_equal(running_mean, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(running_var, [4.0, 5.0, 6.0])


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


@pytest.mark.parametrize("module", [fastln, reference], ids=["fastln", "reference"])
@pytest.mark.parametrize("training", [True, False])
def test_bfloat16_running_statistics(module, training):
    """bfloat16 running statistics are read as the values they are and, in training, updated
    in place (the float64 update rounded once to bfloat16), as float16 ones are."""
    bfloat16 = pytest.importorskip("ml_dtypes").bfloat16
    x = random_input(np.random.default_rng(1), (25, 5), np.float32)
    halves = np.array([0.5, -1.0, 2.0, 3.0, 0.25], bfloat16), np.array([1, 2, 3, 4, 5], bfloat16)
    doubles = tuple(a.astype(np.float64) for a in halves)
    y = module.batch_norm(x, running_mean=halves[0], running_var=halves[1], training=training)
    y64 = module.batch_norm(x, running_mean=doubles[0], running_var=doubles[1],
                            training=training)
    assert_bitwise_equal(y, y64)
    for half, double in zip(halves, doubles):
        assert_bitwise_equal(half, double.astype(bfloat16))


def test_eval_mode_accepts_array_likes():
    x = np.arange(6.0).reshape(3, 2)
    y = fastln.batch_norm(x, running_mean=[1, 2], running_var=[4, 9], eps=0.0)
    assert_close(y, (x - [1, 2]) / [2, 3])


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("shape, axis", [((40, 33), -1), ((3, 33, 5, 2), 1)])
def test_float32_parameters_are_their_float64_values(rng, training, shape, axis):
    """float32 gamma, beta and running statistics are read as the float64 numbers they are:
    the same bits as passing those float64 arrays, whose values the kernels read in place."""
    x = random_input(rng, shape, np.float32) + np.float32(1e3)
    dy = random_input(rng, shape, np.float32)
    gamma, beta = (1 + 0.1 * rng.standard_normal(33)), rng.standard_normal(33)
    running = rng.standard_normal(33), rng.random(33) + 0.5
    singles = [a.astype(np.float32) for a in (gamma, beta) + running]
    doubles = [a.astype(np.float64) for a in singles]
    results = []
    for g, b, mean, var in (singles, doubles):
        mean, var = mean.copy(), var.copy()
        y, cache = fastln.batch_norm_forward(x, g, b, mean, var, training=training, axis=axis)
        results.append((y, cache.mean, cache.rstd, *fastln.batch_norm_backward(dy, cache, g)))
        if training:  # updated in place in float64, each stored in its own dtype
            results[-1] += (mean.astype(np.float32), var.astype(np.float32))
    for single, double in zip(*results):
        assert_bitwise_equal(single, double)


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
    assert_close(dx, numeric_gradient(loss, x), rtol=1e-6, atol=1e-7)
    assert_close(dgamma, numeric_gradient(loss, gamma), rtol=1e-6, atol=1e-7)
    assert_close(dbeta, numeric_gradient(loss, beta), rtol=1e-6, atol=1e-7)


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


@pytest.mark.parametrize("offset", [0.0, 1e3, 1e4, 1e5])
@pytest.mark.parametrize("segment", [125, 200, 1000])
def test_large_offsets_in_long_segments(rng, offset, segment):
    """float32 segments of 128 values and more sum the backward in float runs around the float
    nearest each feature's mean (shorter ones, as 125 here, position by position): as exact as
    the rows layout at every offset."""
    m, n_features = 2000, 6
    offsets = offset * (1 + np.arange(n_features))
    x = (offsets + rng.standard_normal((m, n_features))).astype(np.float32)
    dy = rng.standard_normal((m, n_features)).astype(np.float32)
    exact_y, exact_dx = _exact_batch_norm(x, dy)
    x_in = np.ascontiguousarray(x.T).reshape(n_features, m // segment, segment)
    dy_in = np.ascontiguousarray(dy.T).reshape(n_features, m // segment, segment)
    _, cache = fastln.batch_norm_forward(x_in, training=True, axis=0)
    dx, dgamma, dbeta = fastln.batch_norm_backward(dy_in, cache)
    dx = dx.reshape(n_features, m).T
    tolerance = 8 * np.finfo(np.float32).eps
    assert_close(dx, exact_dx, dtype=np.float32, rtol=tolerance, atol=tolerance)
    exact_dbeta = dy.astype(np.float64).sum(axis=0)
    exact_dgamma = (dy.astype(np.float64) * exact_y).sum(axis=0)
    assert np.allclose(dbeta, exact_dbeta, rtol=1e-6, atol=1e-6 * np.abs(exact_dbeta).max())
    assert np.allclose(dgamma, exact_dgamma, rtol=1e-6, atol=1e-6 * np.abs(exact_dgamma).max())


# ---------------------------------------------------------------------------------------------
# Extreme float64 ranges (issue 7): features whose squares overflow or underflow in float64
# ---------------------------------------------------------------------------------------------
#
# BatchNorm is exactly invariant under scaling x by a power of two c with eps scaled by c**2:
# y, dgamma and dbeta do not change, mean is multiplied by c, var by c**2, rstd and dx divided
# by c (and dx, dgamma, dbeta multiplied by c' when dy is scaled by c'). The expected results
# are the reference's on scaled data, where nothing overflows or underflows, scaled back to
# float64 - out-of-range values included: the variance of values ~1e300 is inf, and so is the
# rstd of a subnormal spread with eps = 0.

def _rescaled_reference(x, dy, gamma, beta, eps, axis, x_exponent, dy_exponent=0):
    """The reference on x * 2**x_exponent (eps * 4**x_exponent) and dy * 2**dy_exponent, its
    results scaled back: y, the cache's mean and rstd, the batch variance, dx, dgamma, dbeta."""
    n_features = x.shape[axis]
    batch_mean, batch_var = np.zeros(n_features), np.zeros(n_features)  # (momentum=0 below)
    y, cache = reference.batch_norm_forward(
        np.ldexp(x, x_exponent), gamma, beta, batch_mean, batch_var, training=True,
        momentum=0.0, eps=math.ldexp(eps, 2 * x_exponent), axis=axis)
    dx, dgamma, dbeta = reference.batch_norm_backward(np.ldexp(dy, dy_exponent), cache, gamma)
    with np.errstate(over="ignore", under="ignore"):
        return dict(y=y, mean=np.ldexp(cache.mean, -x_exponent),
                    rstd=np.ldexp(cache.rstd, x_exponent),
                    var=np.ldexp(batch_var, -2 * x_exponent),
                    dx=np.ldexp(dx, x_exponent - dy_exponent),
                    dgamma=np.ldexp(dgamma, -dy_exponent), dbeta=np.ldexp(dbeta, -dy_exponent))


def _assert_close_at_its_scale(actual, desired, name, rtol=1e-11):
    """Within rtol of the largest finite |desired| (these values may all be ~1e-300, where the
    usual floor of 1 would accept anything), and the same infinities where desired has them."""
    actual = np.asarray(actual, np.float64)
    desired = np.asarray(desired, np.float64)
    finite = np.isfinite(desired)
    np.testing.assert_array_equal(actual[~finite], desired[~finite], err_msg=name)
    if finite.any():
        size = float(np.max(np.abs(desired[finite])))
        np.testing.assert_allclose(actual[finite], desired[finite], rtol=rtol, atol=rtol * size,
                                   err_msg=name)


# name: (size of x, offset of x in units of its size, eps, x_exponent, size of dy, dy_exponent);
# the exponents bring the values to about 1 for the reference.
EXTREMES = {
    "huge 1e300": (1e300, 0.0, 1e-5, -1000, 1e-3, 0),           # squares overflow
    "huge 1e300 offset": (1e300, 3.0, 1e-5, -1000, 1e-3, 0),    # all of one sign
    "huge 1e200": (1e200, 0.0, 1e-5, -665, 1e-3, 0),
    "huge x and dy": (1e300, 0.0, 1e-5, -1000, 1e300, -1000),   # and so does dy * (x - mean)
    "tiny 1e-162 eps 0": (1e-162, 0.0, 0.0, 600, 1e-3, 0),      # squares underflow, in part
    "tiny 1e-162 eps 1e-320": (1e-162, 0.0, 1e-320, 600, 1e-3, 0),  # var and eps both count
    "subnormal 1e-309 eps 0": (1e-309, 0.0, 0.0, 1000, 1e-3, 0),    # rstd beyond float64
    "subnormal 1e-309 eps 1e-320": (1e-309, 0.0, 1e-320, 1000, 1e-3, 0),  # eps dominates
}


@pytest.mark.parametrize("shape, axis", [((37, 5), -1), ((6, 3, 7), 1)],
                         ids=["rows", "segments"])
@pytest.mark.parametrize("case", sorted(EXTREMES))
def test_float64_extreme_ranges_match_the_rescaled_reference(rng, case, shape, axis):
    """Forward (y, the cache, the running statistics) and backward of features whose squares
    leave float64's range: the reference's results on rescaled data, not NaN, inf or noise."""
    x_size, x_offset, eps, x_exponent, dy_size, dy_exponent = EXTREMES[case]
    n_features = shape[axis]
    x = x_size * (x_offset + rng.standard_normal(shape))
    dy = dy_size * rng.standard_normal(shape)
    gamma, beta = random_params(rng, (n_features,), np.float64)
    expected = _rescaled_reference(x, dy, gamma, beta, eps, axis, x_exponent, dy_exponent)
    assert np.all(np.isfinite(expected["y"])) and np.all(np.isfinite(expected["dx"]))

    running_mean, running_var = _running(rng, n_features)
    old_mean, old_var = running_mean.copy(), running_var.copy()
    y, cache = fastln.batch_norm_forward(x, gamma, beta, running_mean, running_var,
                                         training=True, eps=eps, axis=axis)
    dx, dgamma, dbeta = fastln.batch_norm_backward(dy, cache, gamma)
    _assert_close_at_its_scale(y, expected["y"], "y")
    _assert_close_at_its_scale(cache.mean, expected["mean"], "mean")
    _assert_close_at_its_scale(cache.rstd, expected["rstd"], "rstd")
    # running_var takes the batch variance as float64 has it: inf for 1e300 (variance 1e600)
    with np.errstate(over="ignore"):
        _assert_close_at_its_scale(running_mean, 0.9 * old_mean + 0.1 * expected["mean"],
                                   "running_mean")
        _assert_close_at_its_scale(running_var, 0.9 * old_var + 0.1 * expected["var"],
                                   "running_var")
    _assert_close_at_its_scale(dx, expected["dx"], "dx")
    _assert_close_at_its_scale(dgamma, expected["dgamma"], "dgamma")
    _assert_close_at_its_scale(dbeta, expected["dbeta"], "dbeta")


def test_float64_huge_values_whose_shifted_sum_overflows():
    """A feature's sum of x - x[0] can overflow before its squares do: values near 1e308 with
    the first far from the rest."""
    x = np.array([-8e307, 8e307, 7e307, 8.5e307, 9e307, 6e307])[:, None] * [1.0, -1.0]
    dy = np.array([1.0, -2.0, 0.5, 3.0, -1.0, 2.0])[:, None] * [1.0, 2.0]
    expected = _rescaled_reference(x, dy, None, None, 1e-5, -1, -1020)
    y, cache = fastln.batch_norm_forward(x, training=True)
    dx, dgamma, dbeta = fastln.batch_norm_backward(dy, cache)
    for name, actual in dict(y=y, mean=cache.mean, rstd=cache.rstd, dx=dx, dgamma=dgamma,
                             dbeta=dbeta).items():
        _assert_close_at_its_scale(actual, expected[name], name)


def test_float64_subnormal_feature_with_eps_zero_keeps_a_cache_rstd_of_inf(rng):
    """The true rstd (~5e308) is beyond float64: the cache says inf, honestly, and the backward
    (which cannot use it) recomputes the feature's statistics from x."""
    x = np.array([1.0, -2.0, 3.0, 0.5])[:, None] * 1e-309
    y, cache = fastln.batch_norm_forward(x, training=True, eps=0.0)
    assert np.isinf(cache.rstd[0])
    dy = np.array([1.0, -2.0, 0.5, 3.0])[:, None] * 1e-309  # subnormal too: dx ~ 1
    expected = _rescaled_reference(x, dy, None, None, 0.0, -1, 1000)
    _assert_close_at_its_scale(y, expected["y"], "y")
    dx, dgamma, _ = fastln.batch_norm_backward(dy, cache)
    _assert_close_at_its_scale(dx, expected["dx"], "dx")
    _assert_close_at_its_scale(dgamma, expected["dgamma"], "dgamma")


@pytest.mark.parametrize("shape, axis", [((4100, 20), -1), ((40, 20, 103), 1)],
                         ids=["rows", "segments"])
def test_extreme_features_in_a_batch_of_ordinary_ones(rng, shape, axis):
    """Huge, tiny and subnormal features among ordinary ones (eps = 0 for all): bit-for-bit
    the same for every thread count and in place; the ordinary features bit-for-bit what they
    are without the others; the extreme ones what the rescaled reference says."""
    n_features = shape[axis]
    x = rng.standard_normal(shape)
    sizes = {3: 1e300, 7: 1e-309, 11: 1e-162}
    for feature, size in sizes.items():
        np.moveaxis(x, axis, 0)[feature] *= size
    dy = rng.standard_normal(shape)
    gamma, beta = random_params(rng, (n_features,), np.float64)

    def run(num_threads, in_place=False):
        kwargs = dict(training=True, eps=0.0, axis=axis, num_threads=num_threads)
        y, cache = fastln.batch_norm_forward(x, gamma, beta, **kwargs)
        if in_place:
            y = x.copy()
            fastln.batch_norm(y, gamma, beta, out=y, **kwargs)
        dy_in = dy.copy()
        grads = fastln.batch_norm_backward(dy_in, cache, gamma, num_threads=num_threads,
                                           out=dy_in if in_place else None)
        return (y, cache.mean, cache.rstd) + grads

    results = run(1)
    for other in (run(2), run(3), run(3, in_place=True), run(1, in_place=True)):
        for got, want in zip(other, results):
            assert_bitwise_equal(got, want)

    ordinary = [c for c in range(n_features) if c not in sizes]
    alone = np.ascontiguousarray(np.take(x, ordinary, axis=axis))
    y_alone, cache_alone = fastln.batch_norm_forward(alone, gamma[ordinary], beta[ordinary],
                                                     training=True, eps=0.0, axis=axis)
    dx_alone, dgamma_alone, dbeta_alone = fastln.batch_norm_backward(
        np.ascontiguousarray(np.take(dy, ordinary, axis=axis)), cache_alone, gamma[ordinary])
    y, mean, rstd, dx, dgamma, dbeta = results
    assert_bitwise_equal(np.take(y, ordinary, axis=axis), y_alone)
    assert_bitwise_equal(np.take(dx, ordinary, axis=axis), dx_alone)
    assert_bitwise_equal(mean[ordinary], cache_alone.mean)
    assert_bitwise_equal(rstd[ordinary], cache_alone.rstd)
    assert_bitwise_equal(dgamma[ordinary], dgamma_alone)
    assert_bitwise_equal(dbeta[ordinary], dbeta_alone)

    for feature, size in sizes.items():
        x_exponent = -math.frexp(size)[1]  # brings the feature to about 1
        one = [feature]
        expected = _rescaled_reference(np.take(x, one, axis=axis), np.take(dy, one, axis=axis),
                                       gamma[one], beta[one], 0.0, axis, x_exponent)
        with np.errstate(over="ignore"):  # dx of the subnormal feature is beyond float64
            _assert_close_at_its_scale(np.take(y, one, axis=axis), expected["y"], "y")
            _assert_close_at_its_scale(np.take(dx, one, axis=axis), expected["dx"], "dx")
        _assert_close_at_its_scale(rstd[one], expected["rstd"], "rstd")
        _assert_close_at_its_scale(dgamma[one], expected["dgamma"], "dgamma")


def test_running_statistics_of_huge_features():
    """The batch variance of values ~1e300 is ~1e600: running_var becomes inf (float64's honest
    answer; evaluation mode then normalizes that feature to beta), except with momentum = 1,
    which leaves it as it was (not 0 * inf = NaN). running_mean stays finite."""
    x = np.array([[3e300, 1.0], [-1e300, 2.0], [2e300, 4.0], [5e299, 8.0]])
    for momentum, expected_var in ((0.9, np.inf), (1.0, 2.0)):
        running_mean, running_var = np.array([0.5, 0.5]), np.array([2.0, 2.0])
        fastln.batch_norm(x, running_mean=running_mean, running_var=running_var, training=True,
                          momentum=momentum)
        assert running_var[0] == expected_var
        assert np.all(np.isfinite(running_mean)) and np.isfinite(running_var[1])
    beta = np.array([3.0, 0.0])
    y = fastln.batch_norm(x, beta=beta, running_mean=running_mean, running_var=[np.inf, 1.0])
    assert_bitwise_equal(y[:, 0], np.full(4, 3.0))


def test_float64_tiny_features_update_running_var_with_their_float64_variance():
    """Values ~1e-162 have a variance below float64's smallest number: 0 goes into running_var."""
    x = np.array([1.0, -2.0, 3.0, 0.5])[:, None] * 1e-162
    running_mean, running_var = np.zeros(1), np.ones(1)
    fastln.batch_norm(x, running_mean=running_mean, running_var=running_var, training=True,
                      momentum=0.5, eps=0.0)
    assert_bitwise_equal(running_var, np.array([0.5]))
    assert_close(running_mean, [0.5 * 0.625e-162], rtol=1e-15, atol=0.0)


@pytest.mark.parametrize("size, dy_size", [(1e38, 1e30), (1e-40, 1e-6)],
                         ids=["huge 1e38", "subnormal 1e-40"])
@pytest.mark.parametrize("axis", [-1, 0], ids=["rows", "segments"])
def test_float32_extreme_ranges(rng, size, dy_size, axis):
    """float32 values near both ends of float32 (eps = 0): statistics in double cannot overflow
    or underflow, so the reference on the same values is the answer (dy is chosen so that dx
    fits float32)."""
    x = (size * rng.standard_normal((40, 3))).astype(np.float32)
    dy = (dy_size * rng.standard_normal((40, 3))).astype(np.float32)
    if axis == 0:
        x, dy = np.ascontiguousarray(x.T), np.ascontiguousarray(dy.T)
    expected_y, expected_cache = reference.batch_norm_forward(x, training=True, eps=0.0,
                                                              axis=axis)
    expected_grads = reference.batch_norm_backward(dy, expected_cache)
    y, cache = fastln.batch_norm_forward(x, training=True, eps=0.0, axis=axis)
    grads = fastln.batch_norm_backward(dy, cache)
    _assert_close_at_its_scale(y, expected_y, "y", rtol=2e-5)
    _assert_close_at_its_scale(cache.mean, expected_cache.mean, "mean", rtol=1e-12)
    _assert_close_at_its_scale(cache.rstd, expected_cache.rstd, "rstd", rtol=1e-12)
    for name, got, want in zip(("dx", "dgamma", "dbeta"), grads, expected_grads):
        assert np.all(np.isfinite(want)), name
        _assert_close_at_its_scale(got, want, name, rtol=2e-5)


def test_float32_feature_with_tiny_products_is_summed_in_double(rng):
    """Rows layout: one feature with dy ~ 1e-25 against deviations of 1e-20 (eps = 0), whose
    dy * (x - mean) is below float's normal range, among ordinary features. Its sums are taken
    again in double (within 1e-6 of float64 on the same inputs); its neighbours keep the bits
    they have without it."""
    x = rng.standard_normal((64, 40)).astype(np.float32)
    dy = rng.standard_normal((64, 40)).astype(np.float32)
    x[:, 7] = (1e-20 * rng.standard_normal(64)).astype(np.float32)
    dy[:, 7] = (1e-25 * rng.standard_normal(64)).astype(np.float32)
    _, cache = fastln.batch_norm_forward(x, training=True, eps=0.0)
    dx, dgamma, _ = fastln.batch_norm_backward(dy, cache)
    _, cache64 = fastln.batch_norm_forward(x.astype(np.float64), training=True, eps=0.0)
    dx64, dgamma64, _ = fastln.batch_norm_backward(dy.astype(np.float64), cache64)
    assert np.abs(dx[:, 7] - dx64[:, 7]).max() <= 1e-6 * np.abs(dx64[:, 7]).max()
    assert abs(dgamma[7] - dgamma64[7]) <= 1e-6 * abs(dgamma64[7])
    keep = [c for c in range(40) if c != 7]
    _, cache_keep = fastln.batch_norm_forward(np.ascontiguousarray(x[:, keep]), training=True,
                                              eps=0.0)
    dx_keep, dgamma_keep, _ = fastln.batch_norm_backward(np.ascontiguousarray(dy[:, keep]),
                                                         cache_keep)
    assert_bitwise_equal(dx[:, keep], dx_keep)
    assert_bitwise_equal(dgamma[keep], dgamma_keep)


def test_reference_gives_inf_not_zero_division_for_a_subnormal_feature_with_eps_zero():
    """The reference's float64 variance of a subnormal spread underflows to 0; with eps = 0 its
    1 / sqrt(0) is inf, as float64 arithmetic has it, not a ZeroDivisionError (the tests above
    hold fastln to the reference on rescaled values instead)."""
    x = np.array([1.0, -2.0, 3.0, 0.5])[:, None] * 1e-309
    with np.errstate(divide="ignore", invalid="ignore"):
        _, cache = reference.batch_norm_forward(x, training=True, eps=0.0)
    assert np.isinf(cache.rstd[0])


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
        # PyTorch folds the unbiased variance into running_var; fastln the biased one
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


def _misaligned_like(a):
    """An array like a whose data is 16-byte misaligned (one element off), which the kernels
    write with ordinary stores; a itself, from NumPy's allocator, is aligned."""
    raw = np.empty(a.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64 + a.itemsize
    return raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("training", [True, False])
def test_streamed_outputs_hold_the_same_bits_as_ordinary_stores(dtype, training):
    """Inputs of 4 MiB and more write y and dx with non-temporal stores where the rows are
    16-byte aligned (each row's elements up to its first whole line apart, wherever in a line
    the output starts); the values are those of the ordinary stores."""
    rng = np.random.default_rng(31)
    shape = (2100, 1000) if dtype == np.float32 else (4200, 1000)
    x = (rng.standard_normal(shape) * 2 + 30).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    x[5, 7] = np.inf
    gamma = rng.standard_normal(shape[1]).astype(np.float32)
    beta = rng.standard_normal(shape[1]).astype(np.float32)
    results = []
    streamed_at = [lambda a, offset=offset: at_line_offset(a, offset)
                   for offset in (0, 16, 32, 48)]
    for make in (np.empty_like, _misaligned_like, *streamed_at):
        y, dx = make(x), make(x)
        assert (y.ctypes.data % 16 == 0) == (make is not _misaligned_like)
        running_mean, running_var = np.zeros(shape[1]), np.ones(shape[1])
        _, cache = fastln.batch_norm_forward(x, gamma, beta, running_mean, running_var,
                                             training=training, out=y)
        fastln.batch_norm_backward(dy, cache, gamma, out=dx)
        results.append((y.copy(), dx.copy()))
    ordinary = results[1]
    for streamed in results[:1] + results[2:]:
        for streamed_array, ordinary_array in zip(streamed, ordinary):
            assert np.array_equal(streamed_array.view(np.uint16), ordinary_array.view(np.uint16))
    y = results[0][0].astype(np.float64)
    expected = reference.batch_norm(x.astype(np.float64), gamma, beta, np.zeros(shape[1]),
                                    np.ones(shape[1]), training=training)
    finite = np.isfinite(expected)
    assert np.allclose(y[finite], expected[finite], rtol=2e-3 if dtype == np.float16 else 1e-5,
                       atol=2e-3 if dtype == np.float16 else 1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_backward_sums_of_inputs_beyond_the_cache(dtype):
    """Rows-layout inputs of 4 MiB and more take the backward's float sums with their rows
    prefetched ahead (past the last row too); dx, dgamma and dbeta are those of the float64
    reference on the same values, and dgamma, dbeta those of one feature taken alone."""
    rng = np.random.default_rng(37)
    shape = (2100, 1000) if dtype == np.float32 else (4200, 1000)
    assert np.prod(shape) * np.dtype(dtype).itemsize >= 4 * 1024 * 1024
    x = (rng.standard_normal(shape) * 2 + 300).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gamma = rng.standard_normal(shape[1]).astype(np.float32)
    _, cache = fastln.batch_norm_forward(x, gamma, training=True)
    dx, dgamma, dbeta = fastln.batch_norm_backward(dy, cache, gamma)
    _, exact_cache = reference.batch_norm_forward(x.astype(np.float64), gamma.astype(np.float64),
                                                  training=True)
    exact_dx, exact_dgamma, exact_dbeta = reference.batch_norm_backward(
        dy.astype(np.float64), exact_cache, gamma.astype(np.float64))
    assert np.allclose(dgamma, exact_dgamma, rtol=1e-6, atol=1e-6 * np.abs(exact_dgamma).max())
    assert np.allclose(dbeta, exact_dbeta, rtol=1e-6, atol=1e-6 * np.abs(exact_dbeta).max())
    tolerance = 2e-3 if dtype == np.float16 else 1e-5
    assert np.allclose(dx.astype(np.float64), exact_dx, rtol=tolerance,
                       atol=tolerance * np.abs(exact_dx).max())
    feature = 999  # the last: its rows' prefetches reach past the array
    _, cache_one = fastln.batch_norm_forward(np.ascontiguousarray(x[:, feature:]), gamma[feature:],
                                             training=True)
    _, dgamma_one, dbeta_one = fastln.batch_norm_backward(np.ascontiguousarray(dy[:, feature:]),
                                                          cache_one, gamma[feature:])
    assert dgamma_one[0] == dgamma[feature] and dbeta_one[0] == dbeta[feature]


@pytest.mark.parametrize("dtype, shape", [(np.float32, (8, 300, 28, 28)),
                                          (np.float16, (16, 300, 28, 28)),
                                          (np.float32, (3, 29, 130)),
                                          (np.float32, (5, 13, 1000))],
                         ids=["float32 from memory", "float16 from memory", "small groups",
                              "one feature a group"])
def test_backward_features_taken_in_groups(dtype, shape):
    """The NCHW backward takes several features of long segments at once, sample by sample
    (with the next values fetched ahead from 16 MiB of dy, x and dx): a NaN feature and one that
    float cannot scale stay in their features, each feature's results are bit for bit those of
    the same feature among other neighbours (other groups) and the same for 1, 2 and 3 threads,
    and dx, dgamma, dbeta are those of the float64 reference."""
    rng = np.random.default_rng(41)
    n_features = shape[1]
    x = (rng.standard_normal(shape) * 2 + 300).astype(dtype)
    x[:, 4] = (rng.standard_normal(x[:, 4].shape) * 1e-3 + 1).astype(dtype)  # rstd ~ 1e3
    if dtype == np.float32:
        x[:, 4] = (rng.standard_normal(x[:, 4].shape) * 1e-32).astype(dtype)  # rstd ~ 1e32
    x[1, 7].flat[5] = np.nan
    dy = rng.standard_normal(shape).astype(dtype)
    gamma = rng.standard_normal(n_features).astype(np.float32)

    def run(x, dy, gamma, num_threads):
        _, cache = fastln.batch_norm_forward(x, gamma, training=True, eps=0.0, axis=1,
                                             num_threads=num_threads)
        return fastln.batch_norm_backward(dy, cache, gamma, num_threads=num_threads)

    dx, dgamma, dbeta = run(x, dy, gamma, 1)
    for num_threads in (2, 3):
        for got, want in zip(run(x, dy, gamma, num_threads), (dx, dgamma, dbeta)):
            assert_bitwise_equal(got, want)
    assert np.isnan(dx[:, 7]).all() and np.isnan(dgamma[7])
    assert not np.isnan(np.delete(dx, 7, axis=1)).any()
    assert not np.isnan(np.delete(dgamma, 7)).any()

    picked = [1, 4, 5, 6, 9, n_features - 1]  # other neighbours, other groups
    dx_picked, dgamma_picked, dbeta_picked = run(
        np.ascontiguousarray(x[:, picked]), np.ascontiguousarray(dy[:, picked]), gamma[picked],
        1)
    assert_bitwise_equal(dx_picked, dx[:, picked])
    assert_bitwise_equal(dgamma_picked, dgamma[picked])
    assert_bitwise_equal(dbeta_picked, dbeta[picked])

    finite = [c for c in range(n_features) if c != 7]
    x64 = x[:, finite].astype(np.float64)
    _, exact_cache = reference.batch_norm_forward(x64, gamma[finite].astype(np.float64),
                                                  training=True, eps=0.0, axis=1)
    exact_dx, exact_dgamma, exact_dbeta = reference.batch_norm_backward(
        dy[:, finite].astype(np.float64), exact_cache, gamma[finite].astype(np.float64))
    tolerance = 2e-3 if dtype == np.float16 else 1e-5
    for got, want in ((dx[:, finite], exact_dx), (dgamma[finite], exact_dgamma),
                      (dbeta[finite], exact_dbeta)):
        got = got.astype(np.float64)
        assert np.allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())


@pytest.mark.parametrize("axis, segment", [(-1, None), (0, 200), (0, 20)],
                         ids=["rows", "segments", "short segments"])
def test_backward_products_below_float_range(axis, segment):
    """float32 x of 1e-20 and dy of 1e-25: dy * d is below float's range, so the float runs'
    sums cannot hold and the feature is summed in double; dgamma keeps float32 accuracy."""
    rng = np.random.default_rng(33)
    x = (rng.standard_normal((600, 4)) * 1e-20).astype(np.float32)
    dy = (rng.standard_normal((600, 4)) * 1e-25).astype(np.float32)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    x_hat = (x64 - x64.mean(axis=0)) / x64.std(axis=0)
    exact_dgamma = (dy64 * x_hat).sum(axis=0)
    if axis == 0:
        x = np.ascontiguousarray(x.T).reshape(4, 600 // segment, segment)
        dy = np.ascontiguousarray(dy.T).reshape(4, 600 // segment, segment)
    _, cache = fastln.batch_norm_forward(x, training=True, eps=0.0, axis=axis)
    _, dgamma, _ = fastln.batch_norm_backward(dy, cache)
    assert np.allclose(dgamma, exact_dgamma, rtol=1e-6, atol=1e-6 * np.abs(exact_dgamma).max())


@pytest.mark.parametrize("training", [True, False])
def test_streamed_outputs_just_after_their_inputs_hold_the_same_bits(training):
    """Rows-layout outputs of inputs of 4 MiB and more are streamed, except where they start
    just after an input's place in a page (ordinary stores there); the bits are the same at
    every placement."""
    rng = np.random.default_rng(41)
    shape = (1500, 1000)
    x = (rng.standard_normal(shape) * 2 + 30).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    x[5, 7] = np.inf
    gamma = rng.standard_normal(shape[1]).astype(np.float32)
    beta = rng.standard_normal(shape[1]).astype(np.float32)
    results = []
    for after in (0, 16, 48, 640, 656, 2048):
        y, dx = placed_after(x, after), placed_after(dy, after)
        _, cache = fastln.batch_norm_forward(x, gamma, beta, np.zeros(shape[1]),
                                             np.ones(shape[1]), training=training, out=y)
        fastln.batch_norm_backward(dy, cache, gamma, out=dx)
        results.append((y.view(np.uint32).copy(), dx.view(np.uint32).copy()))
    for y_bits, dx_bits in results[1:]:
        assert np.array_equal(y_bits, results[0][0])
        assert np.array_equal(dx_bits, results[0][1])
