"""BatchNorm's forward and training backward in float for the float32-compute types, in both
layouts (fastln/forward.h, bn_apply_rows_float and bn_apply_segment_float; fastln/backward.h,
the same for dx): y = ((x - head) - tail) * scale + offset in float32, each element whose float
result is not finite computed in double instead, so that values near float's limits give what
the double computation gives and a feature's results never depend on its neighbours.

Each test builds (rows, features) values and runs them in the rows layout ((N, C), axis=-1) and
in the segments layout ((N, C, L), axis=1, the same values of each feature in runs of L = 15,
25, 20 or 32 values, the first that divides the rows: vectors and scalar tails, or with 32 whole
AVX-512 vectors only)."""
import numpy as np
import pytest
from conftest import assert_bitwise_equal, at_line_offset

import fastln

U32 = 2.0**-24
SEGMENTS = (15, 25, 20, 32)
LAYOUTS = pytest.mark.parametrize("layout", ["rows", "segments"])


def arranged(values, layout):
    """(rows, features) values in the layout, and the axis of its features."""
    if layout == "rows":
        return values, -1
    rows, features = values.shape
    segment = next(length for length in SEGMENTS if rows % length == 0)
    runs = values.reshape(rows // segment, segment, features)
    return np.ascontiguousarray(runs.transpose(0, 2, 1)), 1


def as_rows(array, layout):
    """The inverse of arranged: the layout's values back as (rows, features)."""
    if layout == "rows":
        return array
    return array.transpose(0, 2, 1).reshape(-1, array.shape[1])


def forward(values, layout, *args, **kwargs):
    x, axis = arranged(values, layout)
    y, cache = fastln.batch_norm_forward(x, *args, axis=axis, **kwargs)
    return as_rows(y, layout), cache


def norm(values, layout, **kwargs):
    x, axis = arranged(values, layout)
    return as_rows(fastln.batch_norm(x, axis=axis, **kwargs), layout)


def backward(dy_values, cache, layout, gamma=None):
    dy, _ = arranged(dy_values, layout)
    dx, dgamma, dbeta = fastln.batch_norm_backward(dy, cache, gamma)
    return as_rows(dx, layout), dgamma, dbeta


def double_apply(x, mean, rstd, gamma, beta):
    """The forward's write pass in float64 from the cache's statistics, rounded once."""
    x64 = x.astype(np.float64)
    return (((x64 - mean) * rstd) * gamma + beta).astype(np.float32)


@LAYOUTS
@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
@pytest.mark.parametrize("offset", [0.0, 1e4, -3e5])
def test_within_a_few_u32_of_the_double_apply(rng, offset, training, layout):
    x = (offset + rng.standard_normal((300, 77))).astype(np.float32)
    gamma = rng.standard_normal(77).astype(np.float32)
    beta = rng.standard_normal(77).astype(np.float32)
    running_mean = offset + rng.standard_normal(77)
    running_var = rng.random(77) + 0.5
    y, cache = forward(x, layout, gamma, beta, running_mean.copy(), running_var.copy(),
                       training=training)
    mean = cache.mean.astype(np.float64)
    rstd = cache.rstd.astype(np.float64)
    if not training:
        mean, rstd = running_mean, 1 / np.sqrt(running_var + 1e-5)
    x_hat = (x.astype(np.float64) - mean) * rstd
    exact = x_hat * gamma + beta
    bound = 4 * U32 * (np.abs(x_hat * gamma) + np.abs(beta)) + 1e-30
    assert np.max(np.abs(y - exact) / bound) <= 1.0


@LAYOUTS
def test_values_near_float_limits_are_computed_in_double(rng, layout):
    """A feature of values near +-FLT_MAX: x - mean overflows float32 (not double), and its
    elements come from the double computation; the other features are unaffected."""
    big = np.finfo(np.float32).max
    x = rng.standard_normal((64, 16)).astype(np.float32)
    x[:, 3] = np.float32(-0.9 * big)
    x[0, 3] = np.float32(0.9 * big)  # x - mean = 1.77 FLT_MAX
    y = norm(x, layout, training=True)
    assert np.all(np.isfinite(y))
    x64 = x[:, 3].astype(np.float64)
    expected = ((x64 - x64.mean()) / np.sqrt(x64.var() + 1e-5)).astype(np.float32)
    np.testing.assert_allclose(y[:, 3], expected, rtol=1e-6)
    keep = [c for c in range(16) if c != 3]
    assert_bitwise_equal(y[:, keep], norm(np.ascontiguousarray(x[:, keep]), layout,
                                          training=True))


@LAYOUTS
def test_a_feature_beyond_float_range_does_not_change_its_neighbours(rng, layout):
    """eps = 0 and a feature whose spread is 1e-38: its scale (1e38) is beyond what the float
    pass takes, so its elements are done in double; the neighbours keep their float bits."""
    x = rng.standard_normal((50, 24)).astype(np.float32)
    x[:, 5] = (1e-38 * rng.standard_normal(50)).astype(np.float32)
    y = norm(x, layout, training=True, eps=0.0)
    x64 = x[:, 5].astype(np.float64)
    expected = ((x64 - x64.mean()) / x64.std()).astype(np.float32)
    np.testing.assert_allclose(y[:, 5], expected, rtol=1e-5, atol=1e-6)
    keep = [c for c in range(24) if c != 5]
    assert_bitwise_equal(y[:, keep], norm(np.ascontiguousarray(x[:, keep]), layout,
                                          training=True, eps=0.0))


@LAYOUTS
def test_half_precision_is_the_float32_apply_rounded_once(rng, layout):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = (100 + rng.standard_normal((40, 33))).astype(np.float32)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        half = x.astype(dtype)
        y_half = norm(half, layout, training=True)
        y_float = norm(half.astype(np.float32), layout, training=True)
        assert_bitwise_equal(y_half, y_float.astype(dtype))


@LAYOUTS
@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_backward_within_a_few_u32_of_the_double_pass(rng, training, layout):
    x = (1e4 + rng.standard_normal((300, 77))).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    gamma = rng.standard_normal(77).astype(np.float32)
    running = (1e4 + rng.standard_normal(77), rng.random(77) + 0.5)
    _, cache = forward(x, layout, gamma, None, running[0].copy(), running[1].copy(),
                       training=training)
    dx, _, _ = backward(dy, cache, layout, gamma)
    _, cache64 = forward(x.astype(np.float64), layout, gamma.astype(np.float64), None,
                         running[0].copy(), running[1].copy(), training=training)
    dx64, _, _ = backward(dy.astype(np.float64), cache64, layout, gamma.astype(np.float64))
    scale = np.abs(dx64).max(axis=0)
    assert np.max(np.abs(dx - dx64) / scale) <= 1e-6


@LAYOUTS
def test_backward_values_near_float_limits_are_computed_in_double(rng, layout):
    """dy near FLT_MAX in one feature: dy - mean(dy) overflows float32, not double (the result
    for the first row is beyond float32 either way: inf); the other features are unaffected."""
    big = np.finfo(np.float32).max
    x = rng.standard_normal((64, 16)).astype(np.float32)
    dy = rng.standard_normal((64, 16)).astype(np.float32)
    dy[:, 3] = np.float32(-0.9 * big)
    dy[0, 3] = np.float32(0.9 * big)
    _, cache = forward(x, layout, training=True)
    dx, _, _ = backward(dy, cache, layout)
    _, cache64 = forward(x.astype(np.float64), layout, training=True)
    dx64, _, _ = backward(dy.astype(np.float64), cache64, layout)
    assert np.all(np.isfinite(dx[1:, 3])) and np.isinf(dx[0, 3])
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(dx[:, 3], dx64[:, 3].astype(np.float32), rtol=1e-5)
    keep = [c for c in range(16) if c != 3]
    _, cache_keep = forward(np.ascontiguousarray(x[:, keep]), layout, training=True)
    dx_keep, _, _ = backward(np.ascontiguousarray(dy[:, keep]), cache_keep, layout)
    assert_bitwise_equal(dx[:, keep], dx_keep)


@pytest.mark.parametrize("offset", [0.0, 1e4, -3e5])
def test_evaluation_gives_the_same_bits_in_both_layouts(rng, offset):
    """In evaluation the constants come from the running statistics alone, so the two layouts'
    float passes see the same constants and must round every element alike; a feature beyond
    float's range and a value near FLT_MAX go to double in both."""
    x = (offset + rng.standard_normal((300, 77))).astype(np.float32)
    x[7, 4] = np.float32(0.9 * np.finfo(np.float32).max)
    gamma = rng.standard_normal(77).astype(np.float32)
    beta = rng.standard_normal(77).astype(np.float32)
    running_mean = offset + rng.standard_normal(77)
    running_var = rng.random(77) + 0.5
    running_var[9] = 1e-70  # with eps = 0: a scale of 1e35, beyond the float pass
    kwargs = dict(gamma=gamma, beta=beta, running_mean=running_mean, running_var=running_var,
                  training=False, eps=0.0)
    with np.errstate(over="ignore"):
        rows, segments = norm(x, "rows", **kwargs), norm(x, "segments", **kwargs)
    assert_bitwise_equal(segments, rows)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_each_row_is_its_own_computation_in_evaluation(rng, dtype):
    """The rows layout's write passes take rows in groups (fastln/forward.h,
    bn_apply_float_block): in evaluation y and dx of each row must be the bits of that row
    normalized alone, also for the rows grouped with one holding Inf, NaN or a value whose float
    result overflows (computed in double), and whatever the row count's remainder."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    x = (1e3 + 50 * rng.standard_normal((11, 37))).astype(dtype)
    x[5, 3], x[5, 20], x[2, 30] = np.inf, np.nan, x.dtype.type(6e4)
    dy = rng.standard_normal((11, 37)).astype(dtype)
    dy[9, 8] = -np.inf
    gamma = (1e3 * rng.standard_normal(37)).astype(np.float32)
    beta = rng.standard_normal(37).astype(np.float32)
    stats = dict(running_mean=1e3 + rng.standard_normal(37), running_var=rng.random(37) + 0.5)
    with np.errstate(over="ignore", invalid="ignore"):
        y, cache = fastln.batch_norm_forward(x, gamma, beta, training=False, **stats)
        dx, _, _ = fastln.batch_norm_backward(dy, cache, gamma)
        for r in range(len(x)):
            y_row, cache_row = fastln.batch_norm_forward(x[r:r + 1], gamma, beta,
                                                         training=False, **stats)
            dx_row, _, _ = fastln.batch_norm_backward(dy[r:r + 1], cache_row, gamma)
            assert_bitwise_equal(y[r:r + 1], y_row)
            assert_bitwise_equal(dx[r:r + 1], dx_row)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("features", [64, 100, 768])
def test_results_do_not_depend_on_where_the_rows_start(rng, dtype, features):
    """The rows layout's write passes take each row's columns up to the output's next cache line
    apart from the rest (fastln/forward.h, line_head; float64's double pass too), and a row's
    first and last columns in one masked vector: y and dx, in training and evaluation, in place
    or not, must be the bits of the same arrays starting on a line, whatever the element offset
    from one, also with Inf, NaN and float-overflowing values in the first and last columns."""
    rows = 9
    x = (1e3 + 50 * rng.standard_normal((rows, features))).astype(dtype)
    x[1, 0], x[2, 5], x[4, features - 1], x[6, 2] = np.inf, np.nan, -np.inf, dtype(6e4)
    dy = rng.standard_normal((rows, features)).astype(dtype)
    dy[7, 3] = np.inf
    gamma = (1e3 * rng.standard_normal(features)).astype(np.float32)
    beta = rng.standard_normal(features).astype(np.float32)
    running_mean = 1e3 + rng.standard_normal(features)
    running_var = rng.random(features) + 0.5

    def run(offset, in_place):
        results = []
        for training in (True, False):
            x_at, dy_at = at_line_offset(x, offset), at_line_offset(dy, offset)
            y = x_at if in_place else at_line_offset(np.zeros_like(x), offset)
            # training updates the running statistics: each call gets its own copies
            _, cache = fastln.batch_norm_forward(at_line_offset(x, offset), gamma, beta,
                                                 running_mean.copy(), running_var.copy(),
                                                 training=training)
            fastln.batch_norm(x_at, gamma, beta, running_mean.copy(), running_var.copy(),
                              training=training, out=y)
            dx = dy_at if in_place else at_line_offset(np.zeros_like(dy), offset)
            fastln.batch_norm_backward(dy_at, cache, gamma, out=dx)
            results += [y.copy(), dx.copy()]
        return results

    with np.errstate(over="ignore", invalid="ignore"):
        expected = run(0, in_place=False)
        for offset in range(x.itemsize, 64, x.itemsize):
            for in_place in (False, True):
                for got, want in zip(run(offset, in_place), expected):
                    assert_bitwise_equal(got, want, err_msg=f"offset {offset}")
