"""BatchNorm's rows-layout forward in float for the float32-compute types (fastln/forward.h,
bn_apply_rows_float): y = ((x - head) - tail) * scale + offset in float32, each element whose
float result is not finite computed in double instead, so that values near float's limits give
what the double computation gives and a feature's results never depend on its neighbours."""
import numpy as np
import pytest
from conftest import assert_bitwise_equal

import fastln

U32 = 2.0**-24


def double_apply(x, mean, rstd, gamma, beta):
    """The forward's write pass in float64 from the cache's statistics, rounded once."""
    x64 = x.astype(np.float64)
    return (((x64 - mean) * rstd) * gamma + beta).astype(np.float32)


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
@pytest.mark.parametrize("offset", [0.0, 1e4, -3e5])
def test_within_a_few_u32_of_the_double_apply(rng, offset, training):
    x = (offset + rng.standard_normal((300, 77))).astype(np.float32)
    gamma = rng.standard_normal(77).astype(np.float32)
    beta = rng.standard_normal(77).astype(np.float32)
    running_mean = offset + rng.standard_normal(77)
    running_var = rng.random(77) + 0.5
    y, cache = fastln.batch_norm_forward(x, gamma, beta, running_mean.copy(), running_var.copy(),
                                         training=training)
    mean = cache.mean.astype(np.float64)
    rstd = cache.rstd.astype(np.float64)
    if not training:
        mean, rstd = running_mean, 1 / np.sqrt(running_var + 1e-5)
    x_hat = (x.astype(np.float64) - mean) * rstd
    exact = x_hat * gamma + beta
    bound = 4 * U32 * (np.abs(x_hat * gamma) + np.abs(beta)) + 1e-30
    assert np.max(np.abs(y - exact) / bound) <= 1.0


def test_values_near_float_limits_are_computed_in_double(rng):
    """A feature of values near +-FLT_MAX: x - mean overflows float32 (not double), and its
    elements come from the double computation; the other features are unaffected."""
    big = np.finfo(np.float32).max
    x = rng.standard_normal((64, 16)).astype(np.float32)
    x[:, 3] = np.float32(-0.9 * big)
    x[0, 3] = np.float32(0.9 * big)  # x - mean = 1.77 FLT_MAX
    y = fastln.batch_norm(x, training=True)
    assert np.all(np.isfinite(y))
    x64 = x[:, 3].astype(np.float64)
    expected = ((x64 - x64.mean()) / np.sqrt(x64.var() + 1e-5)).astype(np.float32)
    np.testing.assert_allclose(y[:, 3], expected, rtol=1e-6)
    keep = [c for c in range(16) if c != 3]
    assert_bitwise_equal(y[:, keep], fastln.batch_norm(np.ascontiguousarray(x[:, keep]),
                                                       training=True))


def test_a_feature_beyond_float_range_does_not_change_its_neighbours(rng):
    """eps = 0 and a feature whose spread is 1e-38: its scale (1e38) is beyond what the float
    pass takes, so its elements are done in double; the neighbours keep their float bits."""
    x = rng.standard_normal((50, 24)).astype(np.float32)
    x[:, 5] = (1e-38 * rng.standard_normal(50)).astype(np.float32)
    y = fastln.batch_norm(x, training=True, eps=0.0)
    x64 = x[:, 5].astype(np.float64)
    expected = ((x64 - x64.mean()) / x64.std()).astype(np.float32)
    np.testing.assert_allclose(y[:, 5], expected, rtol=1e-5, atol=1e-6)
    keep = [c for c in range(24) if c != 5]
    assert_bitwise_equal(y[:, keep], fastln.batch_norm(np.ascontiguousarray(x[:, keep]),
                                                       training=True, eps=0.0))


def test_half_precision_is_the_float32_apply_rounded_once(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = (100 + rng.standard_normal((40, 33))).astype(np.float32)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        half = x.astype(dtype)
        y_half = fastln.batch_norm(half, training=True)
        y_float = fastln.batch_norm(half.astype(np.float32), training=True)
        assert_bitwise_equal(y_half, y_float.astype(dtype))


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_backward_within_a_few_u32_of_the_double_pass(rng, training):
    x = (1e4 + rng.standard_normal((300, 77))).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    gamma = rng.standard_normal(77).astype(np.float32)
    running = (1e4 + rng.standard_normal(77), rng.random(77) + 0.5)
    _, cache = fastln.batch_norm_forward(x, gamma, None, running[0].copy(), running[1].copy(),
                                         training=training)
    dx, _, _ = fastln.batch_norm_backward(dy, cache, gamma)
    _, cache64 = fastln.batch_norm_forward(x.astype(np.float64), gamma.astype(np.float64), None,
                                           running[0].copy(), running[1].copy(),
                                           training=training)
    dx64, _, _ = fastln.batch_norm_backward(dy.astype(np.float64), cache64,
                                            gamma.astype(np.float64))
    scale = np.abs(dx64).max(axis=0)
    assert np.max(np.abs(dx - dx64) / scale) <= 1e-6


def test_backward_values_near_float_limits_are_computed_in_double(rng):
    """dy near FLT_MAX in one feature: dy - mean(dy) overflows float32, not double (the result
    for the first row is beyond float32 either way: inf); the other features are unaffected."""
    big = np.finfo(np.float32).max
    x = rng.standard_normal((64, 16)).astype(np.float32)
    dy = rng.standard_normal((64, 16)).astype(np.float32)
    dy[:, 3] = np.float32(-0.9 * big)
    dy[0, 3] = np.float32(0.9 * big)
    _, cache = fastln.batch_norm_forward(x, training=True)
    dx, _, _ = fastln.batch_norm_backward(dy, cache)
    _, cache64 = fastln.batch_norm_forward(x.astype(np.float64), training=True)
    dx64, _, _ = fastln.batch_norm_backward(dy.astype(np.float64), cache64)
    assert np.all(np.isfinite(dx[1:, 3])) and np.isinf(dx[0, 3])
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(dx[:, 3], dx64[:, 3].astype(np.float32), rtol=1e-5)
    keep = [c for c in range(16) if c != 3]
    _, cache_keep = fastln.batch_norm_forward(np.ascontiguousarray(x[:, keep]), training=True)
    dx_keep, _, _ = fastln.batch_norm_backward(np.ascontiguousarray(dy[:, keep]), cache_keep)
    assert_bitwise_equal(dx[:, keep], dx_keep)
