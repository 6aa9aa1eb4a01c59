"""float64 rows at the two ends of the range, held to the reference.

Two classes of rows leave plain float64 arithmetic although their normalized values are
ordinary numbers: rows of both signs near DBL_MAX, whose deviations x - mean overflow, and
rows of subnormal values with eps = 0, whose variance underflows to zero or to a few
subnormal units. fastln scales such a row (or BatchNorm feature) by a power of two before it
centres it; here LayerNorm, the fused add + LayerNorm and BatchNorm, forward and backward, in
every instruction-set variant the CPU runs and on one and two threads, must agree with the
reference (which is held to exact arithmetic over the whole range in test_reference_range.py).
"""
import numpy as np
import pytest

import fastln
import fastln.reference as ref
from fastln import _kernels

DBL_MAX = np.finfo(np.float64).max
TINY = 5e-324  # the smallest subnormal
VARIANTS = _kernels.instruction_sets()
WIDTHS = (2, 3, 6, 33, 777)


def _huge_rows(rng, n_rows, width):
    """Values drawn uniformly from (-DBL_MAX, DBL_MAX), some rows pushed towards one end."""
    x = rng.uniform(-1.0, 1.0, (n_rows, width)) * DBL_MAX
    x[::5] = np.abs(x[::5])  # rows of one sign: large mean, deviations that fit
    x[1::7, 0] = DBL_MAX
    x[2::7, -1] = -DBL_MAX
    return x


def _subnormal_rows(rng, n_rows, width):
    """Rows of a few subnormal units: the variance, in float64, is zero or subnormal."""
    x = rng.integers(-3, 4, (n_rows, width)) * TINY
    x[0] = 0.0
    x[0, -1] = TINY  # [0, ..., 0, 5e-324]
    x[1] = TINY * np.arange(width)
    return x


def _assert_close(got, expected, scale, what):
    """Each value of `got` within 1e-12 * `scale` (the size of the terms it is made of) of the
    reference's, and +-inf exactly where the reference's is (an rstd beyond float64)."""
    assert np.all(np.isfinite(got) == np.isfinite(expected)), f"{what}: not finite"
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(got[~finite], expected[~finite])
    with np.errstate(invalid="ignore"):
        allowed = 1e-12 * np.broadcast_to(scale, got.shape)
        bad = finite & (np.abs(got - expected) > np.where(np.isfinite(allowed), allowed, 0))
    assert not bad.any(), f"{what}: {np.argwhere(bad)[:5].tolist()} differ"


def _row_scale(a, axis=1):
    return np.max(np.abs(a), axis=axis, keepdims=True)


def _dx_size(x, dy_gamma, eps, axis):
    """4 * rstd * max|dy * gamma| per group (the size of dx's terms), with the true rstd: the
    group scaled to about 1 first, since rstd itself may be beyond float64."""
    _, exponent = np.frexp(np.max(np.abs(x), axis=axis, keepdims=True))
    scaled = np.ldexp(x, -exponent)
    std_scaled = np.sqrt(np.var(scaled, axis=axis, keepdims=True) + np.ldexp(eps, -2 * exponent))
    with np.errstate(divide="ignore"):
        return np.ldexp(4 * np.max(np.abs(dy_gamma), axis=axis, keepdims=True) / std_scaled,
                        -exponent)


def _in_each_variant(check):
    try:
        for variant in VARIANTS:
            _kernels.use_instruction_set(variant)
            for num_threads in (1, 2):
                check(num_threads)
    finally:
        _kernels.use_instruction_set(None)


# draw, eps, the scale of dy: rstd ~ 1e323 for the subnormal rows, so dy ~ 1e-300 keeps the
# true dx in float64 (its terms are rstd * |dy * gamma|)
ROWS = {"huge": (_huge_rows, 1e-5, 1.0), "subnormal": (_subnormal_rows, 0.0, 2.0 ** -1000)}


@pytest.mark.parametrize("family", sorted(ROWS))
@pytest.mark.parametrize("width", WIDTHS)
def test_layer_norm_rows_at_the_ends_of_float64(family, width):
    draw, eps, dy_scale = ROWS[family]
    rng = np.random.default_rng(width)
    x = draw(rng, 300, width)
    gamma, beta = 1 + 0.1 * rng.standard_normal(width), rng.standard_normal(width)
    dy = rng.standard_normal(x.shape) * dy_scale
    y_ref, cache_ref = ref.layer_norm_forward(x, gamma, beta, eps)
    dx_ref, dgamma_ref, dbeta_ref = ref.layer_norm_backward(dy, cache_ref, gamma)

    def check(num_threads):
        y, cache = fastln.layer_norm_forward(x, gamma, beta, eps, num_threads=num_threads)
        _assert_close(y, y_ref, _row_scale(y_ref) + np.abs(beta), "y")
        # (a mean of subnormal values rounds to a unit of the smallest one, ties either way)
        _assert_close(cache.mean, cache_ref.mean, np.max(np.abs(x), axis=1) + TINY / 1e-12,
                      "mean")
        _assert_close(cache.rstd, cache_ref.rstd, cache_ref.rstd, "rstd")
        dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma, num_threads=num_threads)
        # dx is a sum of terms of size rstd * |dy * gamma|
        _assert_close(dx, dx_ref, _dx_size(x, dy * gamma, eps, 1), "dx")
        _assert_close(dgamma, dgamma_ref, np.sum(np.abs(dy * (y_ref - beta) / gamma), axis=0), "dgamma")
        _assert_close(dbeta, dbeta_ref, np.sum(np.abs(dy), axis=0), "dbeta")
        y_fused, s, _ = fastln.add_layer_norm_forward(x, np.zeros_like(x), gamma, beta, eps,
                                                      num_threads=num_threads)
        np.testing.assert_array_equal(s, x)
        np.testing.assert_array_equal(y_fused, y)

    _in_each_variant(check)


def test_the_rows_reported_give_the_right_answers():
    np.testing.assert_allclose(fastln.layer_norm(np.array([1.5e308, -1.5e308, 1.5e308])),
                               [2 ** -0.5, -2 ** 0.5, 2 ** -0.5], rtol=1e-12)
    x = np.array([0.0, TINY])
    y, cache = fastln.layer_norm_forward(x, eps=0.0)
    np.testing.assert_array_equal(y, [-1.0, 1.0])
    dx, _, _ = fastln.layer_norm_backward(np.array([1.0, -1.0]), cache)
    dx_ref, _, _ = ref.layer_norm_backward(np.array([1.0, -1.0]),
                                           ref.layer_norm_forward(x, eps=0.0)[1])
    assert np.all(np.isfinite(dx))
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-12)


@pytest.mark.parametrize("family", sorted(ROWS))
@pytest.mark.parametrize("layout", ["rows", "channels"])
def test_batch_norm_features_at_the_ends_of_float64(family, layout):
    draw, eps, dy_scale = ROWS[family]
    rng = np.random.default_rng(7)
    columns = draw(rng, 40, 65)  # one row per feature, one value per example
    if layout == "rows":  # (examples, features)
        x, axis = columns.T.copy(), 1
    else:  # (examples, features, positions): 5 examples of 13 positions
        x, axis = columns.reshape(40, 5, 13).transpose(1, 0, 2).copy(), 1
    n_features = x.shape[axis]
    gamma = 1 + 0.1 * rng.standard_normal(n_features)
    beta = rng.standard_normal(n_features)
    dy = rng.standard_normal(x.shape) * dy_scale
    y_ref, cache_ref = ref.batch_norm_forward(x, gamma, beta, training=True, eps=eps, axis=axis)
    dx_ref, dgamma_ref, dbeta_ref = ref.batch_norm_backward(dy, cache_ref, gamma)
    reduce = tuple(i for i in range(x.ndim) if i != axis)
    shape = [1] * x.ndim
    shape[axis] = n_features

    def check(num_threads):
        y, cache = fastln.batch_norm_forward(x, gamma, beta, training=True, eps=eps, axis=axis,
                                             num_threads=num_threads)
        _assert_close(y, y_ref, np.max(np.abs(y_ref), axis=reduce, keepdims=True) + 1e-300, "y")
        _assert_close(cache.mean, cache_ref.mean, np.max(np.abs(x), axis=reduce) + TINY / 1e-12,
                      "mean")
        _assert_close(cache.rstd, cache_ref.rstd, cache_ref.rstd, "rstd")
        dx, dgamma, dbeta = fastln.batch_norm_backward(dy, cache, gamma,
                                                       num_threads=num_threads)
        _assert_close(dx, dx_ref, _dx_size(x, dy * gamma.reshape(shape), eps, reduce), "dx")
        _assert_close(dgamma, dgamma_ref, np.sum(np.abs(dy * (y_ref - beta.reshape(shape)) / gamma.reshape(shape)),
                                  axis=reduce), "dgamma")
        _assert_close(dbeta, dbeta_ref, np.sum(np.abs(dy), axis=reduce), "dbeta")

    _in_each_variant(check)


def test_streamed_rows_at_the_ends_match_the_same_rows_alone():
    """A batch large enough to take the streaming (non-temporal) passes (32 MiB and more) gives
    each row the bits it has alone."""
    rng = np.random.default_rng(1)
    x = _huge_rows(rng, 4200, 1024)
    x[1::3] = _subnormal_rows(rng, 1400, 1024)
    for eps in (0.0, 1e-5):
        y, cache = fastln.layer_norm_forward(x, eps=eps, num_threads=2)
        dx, _, _ = fastln.layer_norm_backward(x[::-1] / DBL_MAX, cache, num_threads=2)
        for row in (0, 1, 2, 3, 2098, 4199):
            y_row, cache_row = fastln.layer_norm_forward(x[row:row + 1], eps=eps)
            dx_row, _, _ = fastln.layer_norm_backward(x[::-1][row:row + 1] / DBL_MAX, cache_row)
            np.testing.assert_array_equal(y[row:row + 1], y_row)
            np.testing.assert_array_equal(dx[row:row + 1], dx_row)
