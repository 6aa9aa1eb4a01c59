"""float16 and bfloat16 (ml_dtypes) inputs, for every function.

The design: the half formats are storage types of the float32 kernels - each element is widened
to float32 (exactly) as it is loaded, and each float32 result rounded once to the half format as
it is stored. So the tests hold the half path to three things:

- the conversions themselves, against NumPy's and ml_dtypes' astype, bit for bit (every half
  value; millions of float32 values with every rounding case);
- the float32 path: a half call is bitwise the float32 call on the widened input, rounded;
- the float64 reference (computed on the same half values, rounded once): within one unit in
  the last place of the half format, plus the float32 path's own error where cancellation makes
  y small.

And the promises: identical bits for every num_threads and every batch, no full-size float32
temporary, clear errors.
"""
import tracemalloc

import numpy as np
import pytest
from conftest import (
    BFLOAT16,
    HALF,
    Snapshot,
    assert_bitwise_equal,
    assert_close,
    make_layout,
    ml_dtypes,
    needs_ml_dtypes,
    random_input,
)

import fastln
import fastln.reference as reference
from fastln import _kernels

KIND = {"float16": 0, "bfloat16": 1}
# (significand bits including the implicit one, minimum normal exponent)
FORMAT = {"float16": (11, -14), "bfloat16": (8, -126)}


def bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


def spacing(values, dtype):
    """The gap between adjacent values of the half format at each |value| (its ulp)."""
    precision, min_exponent = FORMAT[dtype.name]
    magnitude = np.abs(np.asarray(values, np.float64))
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    return np.exp2(np.maximum(exponent, min_exponent) - (precision - 1))


def assert_within_ulp(actual, desired, dtype, ulps=1.0, scale_atol=0.0):
    """|actual - desired| <= ulps * ulp(desired) + scale_atol * max|desired| elementwise."""
    actual = np.asarray(actual, np.float64)
    desired = np.asarray(desired, np.float64)
    assert actual.shape == desired.shape
    finite = np.isfinite(desired)
    np.testing.assert_array_equal(np.isfinite(actual), finite)
    scale = np.max(np.abs(desired[finite]), initial=1.0)
    allowed = ulps * spacing(desired, dtype) + scale_atol * scale
    error = np.abs(actual - desired)
    worst = np.argmax(np.where(finite, error - allowed, -np.inf))
    assert np.all(error[finite] <= allowed[finite]), (
        f"{np.count_nonzero(error[finite] > allowed[finite])} element(s) off by more than "
        f"{ulps} ulp; worst at {np.unravel_index(worst, error.shape)}: actual "
        f"{actual.flat[worst]!r}, desired {desired.flat[worst]!r}")


def half_input(rng, shape, dtype, offset=0.0, scale=1.0):
    return random_input(rng, shape, np.float64, offset=offset, scale=scale).astype(dtype)


def half_params(rng, n, dtype):
    gamma = ((0.5 + rng.random(n)) * rng.choice([-1.0, 1.0], size=n)).astype(dtype)
    beta = rng.standard_normal(n).astype(dtype)
    return gamma, beta


# ---------------------------------------------------------------------------------------------
# The conversions (include/fastln/convert.h, fastln/isa.h) against NumPy / ml_dtypes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
def test_widening_is_exact_for_every_half_value(dtype):
    every = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(every.size, np.float32)
    _kernels.widen(every, out, KIND[dtype.name])
    expected = every.view(dtype).astype(np.float32)
    assert_bitwise_equal(out.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("dtype", HALF)
def test_rounding_matches_astype_bit_for_bit(dtype):
    rng = np.random.default_rng(8)
    # Random bit patterns (every exponent, NaN payloads, subnormals) ...
    random_bits = rng.integers(0, 1 << 32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    # ... and every half value's float32 neighbourhood: exact, ties, just above and below ties.
    every = np.arange(1 << 16, dtype=np.uint16).view(dtype).astype(np.float32)
    exact = every[np.isfinite(every)].view(np.uint32)
    half_ulp = np.uint32(1 << (23 - FORMAT[dtype.name][0]))  # a tie in float32 bits
    near = np.concatenate([exact + d for d in (np.uint32(1), half_ulp - 1, half_ulp,
                                               half_ulp + 1)]
                          + [exact - d for d in (np.uint32(1), half_ulp)])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504.0, 65519.996,
                         65520.0, 3.3895314e38, 3.4028235e38, 1e-45, 5.96e-8, 2.98e-8],
                        np.float32).view(np.uint32)
    values = np.concatenate([random_bits, near, specials]).view(np.float32)
    out = np.empty(values.size, np.uint16)
    _kernels.narrow(values, out, KIND[dtype.name])
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(dtype)
    assert_bitwise_equal(out, bits(expected))


def _in_every_variant(function):
    """function() in each instruction-set variant this CPU runs (fastln/isa.h)."""
    try:
        for variant in _kernels.instruction_sets():
            _kernels.use_instruction_set(variant)
            function(variant)
    finally:
        _kernels.use_instruction_set(None)


def _quieted(bits32):
    """float32 bit patterns with every signalling NaN made quiet (its quiet bit set)."""
    is_nan = (bits32 & 0x7FFFFFFF) > 0x7F800000
    return np.where(is_nan, bits32 | np.uint32(0x00400000), bits32)


@pytest.mark.parametrize("dtype", HALF)
def test_the_kernels_vector_loads_widen_exactly(dtype):
    """The loads the kernels make (F16C where the target has it) give every half value exactly;
    a signalling float16 NaN comes out quiet with its sign and payload (IEEE 754's conversion;
    arithmetic would quiet it next anyway, so no result changes)."""
    every = np.arange(1 << 16, dtype=np.uint16)
    expected = every.view(dtype).astype(np.float32).view(np.uint32)

    def check(variant):
        out = np.empty(every.size, np.float32)
        _kernels.widen_as_loaded(every, out, KIND[dtype.name])
        assert_bitwise_equal(_quieted(out.view(np.uint32)), _quieted(expected), variant)
        is_nan = np.isnan(every.view(dtype).astype(np.float32))
        assert_bitwise_equal(out.view(np.uint32)[~is_nan], expected[~is_nan], variant)
    _in_every_variant(check)


@pytest.mark.parametrize("dtype", HALF)
def test_the_kernels_vector_stores_round_like_astype(dtype):
    """The stores the kernels make round every float32 a computation can produce (no signalling
    NaNs: arithmetic never makes one) exactly as astype does."""
    rng = np.random.default_rng(9)
    random_bits = rng.integers(0, 1 << 32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    every = np.arange(1 << 16, dtype=np.uint16).view(dtype).astype(np.float32)
    exact = every[np.isfinite(every)].view(np.uint32)
    half_ulp = np.uint32(1 << (23 - FORMAT[dtype.name][0]))
    near = np.concatenate([exact + d for d in (np.uint32(1), half_ulp - 1, half_ulp,
                                               half_ulp + 1)]
                          + [exact - d for d in (np.uint32(1), half_ulp)])
    values = _quieted(np.concatenate([random_bits, near])).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(dtype)

    def check(variant):
        out = np.empty(values.size, np.uint16)
        _kernels.narrow_as_stored(values, out, KIND[dtype.name])
        assert_bitwise_equal(out, bits(expected), variant)
    _in_every_variant(check)


# ---------------------------------------------------------------------------------------------
# The half path is the float32 path on the widened input, rounded
# ---------------------------------------------------------------------------------------------

SHAPES = [((1, 1), -1), ((7, 33), -1), ((3, 5, 40), 1), ((257, 300), -1), ((4, 2, 768), -1)]


def _float32_then_round(func, dtype, *arrays, **kwargs):
    widened = [None if a is None else np.asarray(a, np.float32) for a in arrays]
    result = func(*widened, **kwargs)
    if isinstance(result, tuple):
        return tuple(r.astype(dtype) for r in result)
    return result.astype(dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape, axis", SHAPES)
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_forward_is_the_float32_forward_rounded(dtype, shape, axis, num_threads, rng):
    x = half_input(rng, shape, dtype)
    residual = half_input(rng, shape, dtype)
    n = int(np.prod(shape[axis:]))
    gamma, beta = half_params(rng, n, dtype)
    gamma, beta = gamma.reshape(shape[axis:]), beta.reshape(shape[axis:])
    bias = rng.standard_normal(shape[axis:]).astype(np.float32)
    kw = dict(axis=axis, num_threads=num_threads)

    y = fastln.layer_norm(x, gamma, beta, **kw)
    assert y.dtype == dtype
    assert_bitwise_equal(y, _float32_then_round(fastln.layer_norm, dtype, x, gamma, beta, **kw))
    y = fastln.rms_norm(x, gamma, **kw)
    assert_bitwise_equal(y, _float32_then_round(fastln.rms_norm, dtype, x, gamma, **kw))

    # Fused add: s is x + residual (+ bias) rounded to float32, then to the half format, and y
    # is the unfused normalization of that s, bit for bit.
    y, s = fastln.add_layer_norm(x, residual, gamma, beta, bias=bias, **kw)
    s_expected = ((x.astype(np.float64) + residual.astype(np.float64) + bias)
                  .astype(np.float32).astype(dtype))
    assert_bitwise_equal(s, s_expected)
    assert_bitwise_equal(y, fastln.layer_norm(s, gamma, beta, **kw))
    y, s = fastln.add_rms_norm(x, residual, gamma, **kw)
    if dtype == np.float16:
        assert_bitwise_equal(s, x + residual)  # NumPy's float16 addition (via float32)
    assert_bitwise_equal(y, fastln.rms_norm(s, gamma, **kw))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape, axis", SHAPES)
def test_backward_is_the_float32_backward_rounded(dtype, shape, axis, rng):
    x = half_input(rng, shape, dtype)
    dy = half_input(rng, shape, dtype)
    gamma, beta = half_params(rng, int(np.prod(shape[axis:])), dtype)
    gamma, beta = gamma.reshape(shape[axis:]), beta.reshape(shape[axis:])
    x32, dy32 = x.astype(np.float32), dy.astype(np.float32)
    gamma32, beta32 = gamma.astype(np.float32), beta.astype(np.float32)

    _, cache = fastln.layer_norm_forward(x, gamma, beta, axis=axis)
    _, cache32 = fastln.layer_norm_forward(x32, gamma32, beta32, axis=axis)
    assert cache.mean.dtype == cache.rstd.dtype == np.float32
    assert cache.dtype == dtype
    assert_bitwise_equal(cache.mean, cache32.mean)
    assert_bitwise_equal(cache.rstd, cache32.rstd)
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma)
    dx32, dgamma32, dbeta32 = fastln.layer_norm_backward(dy32, cache32, gamma32)
    assert dx.dtype == dtype and dgamma.dtype == dbeta.dtype == np.float32
    assert_bitwise_equal(dx, dx32.astype(dtype))
    # Same block layout and flushes as the float32 path: the very same sums.
    assert_bitwise_equal(dgamma, dgamma32)
    assert_bitwise_equal(dbeta, dbeta32)

    _, cache = fastln.rms_norm_forward(x, gamma, axis=axis)
    _, cache32 = fastln.rms_norm_forward(x32, gamma32, axis=axis)
    assert_bitwise_equal(cache.rstd, cache32.rstd)
    dx, dgamma = fastln.rms_norm_backward(dy, cache, gamma)
    dx32, dgamma32 = fastln.rms_norm_backward(dy32, cache32, gamma32)
    assert_bitwise_equal(dx, dx32.astype(dtype))
    assert_bitwise_equal(dgamma, dgamma32)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape, axis", [((64, 33), -1), ((5, 7, 3, 3), 1), ((2, 4, 70), 1)])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_is_the_float32_batch_norm_rounded(dtype, shape, axis, training, rng):
    """BatchNorm of half x: the float32 computation on the widened x (gamma and beta as float32,
    statistics in float64), y and dx rounded once to the half format; dgamma and dbeta float32."""
    x = half_input(rng, shape, dtype, offset=100.0, scale=3.0)
    dy = half_input(rng, shape, dtype)
    n_features = shape[axis]
    gamma, beta = (p.astype(np.float32) for p in half_params(rng, n_features, dtype))
    running = [np.zeros(n_features), np.ones(n_features)]
    running32 = [r.copy() for r in running]
    kw = dict(training=training, axis=axis, num_threads=2)
    y, cache = fastln.batch_norm_forward(x, gamma, beta, *running, **kw)
    y32, cache32 = fastln.batch_norm_forward(x.astype(np.float32), gamma, beta, *running32, **kw)
    assert y.dtype == dtype
    assert_bitwise_equal(y, y32.astype(dtype))
    for a, b in zip([cache.mean, cache.rstd, *running], [cache32.mean, cache32.rstd, *running32]):
        assert_bitwise_equal(a, b)
    dx, dgamma, dbeta = fastln.batch_norm_backward(dy, cache, gamma)
    dx32, dgamma32, dbeta32 = fastln.batch_norm_backward(dy.astype(np.float32), cache32, gamma)
    assert_bitwise_equal(dx, dx32.astype(dtype))
    assert dgamma.dtype == dbeta.dtype == np.float32
    assert_bitwise_equal(dgamma, dgamma32)
    assert_bitwise_equal(dbeta, dbeta32)
    # The reference takes the same arguments and agrees to the half format's precision.
    y_ref, cache_ref = fastln.reference.batch_norm_forward(x, gamma, beta,
                                                           *[np.zeros(n_features), np.ones(n_features)],
                                                           **kw)
    assert y_ref.dtype == dtype
    assert_within_ulp(y, y_ref, dtype, ulps=1.0, scale_atol=1e-6)
    dx_ref, dgamma_ref, _ = fastln.reference.batch_norm_backward(dy, cache_ref, gamma)
    assert dgamma_ref.dtype == np.float32


# ---------------------------------------------------------------------------------------------
# Accuracy against the float64 reference
# ---------------------------------------------------------------------------------------------

ACCURACY_CASES = [
    # (shape, axis, offset, scale)
    ((64, 768), -1, 0.0, 1.0),
    ((5, 6, 17), 1, 0.0, 1.0),
    ((32, 100), -1, 100.0, 1.0),      # |mean| >> std: float16 spacing at 100 is 1/16
    ((32, 100), -1, 0.0, 1e-3),       # small values (float16 subnormals nearby)
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape, axis, offset, scale", ACCURACY_CASES)
def test_forward_within_one_ulp_of_the_reference(dtype, shape, axis, offset, scale, rng):
    x = half_input(rng, shape, dtype, offset=offset, scale=scale)
    gamma, beta = half_params(rng, int(np.prod(shape[axis:])), dtype)
    gamma, beta = gamma.reshape(shape[axis:]), beta.reshape(shape[axis:])
    residual = half_input(rng, shape, dtype)

    # Without gamma/beta y is x_hat itself, computed to a few float32 ulps: one half ulp.
    y = fastln.layer_norm(x, axis=axis)
    expected = reference.layer_norm(x, axis=axis)
    assert expected.dtype == dtype
    assert_within_ulp(y, expected, dtype)
    assert_within_ulp(fastln.rms_norm(x, axis=axis), reference.rms_norm(x, axis=axis), dtype)
    # gamma * x_hat + beta is formed in float32, where it may cancel: allow float32's error on
    # the scale of the terms on top of the ulp.
    assert_within_ulp(fastln.layer_norm(x, gamma, beta, axis=axis),
                      reference.layer_norm(x, gamma, beta, axis=axis), dtype, scale_atol=1e-6)
    y, s = fastln.add_layer_norm(x, residual, gamma, beta, axis=axis)
    y_ref, s_ref = reference.add_layer_norm(x, residual, gamma, beta, axis=axis)
    assert_bitwise_equal(s, s_ref)
    assert_within_ulp(y, y_ref, dtype, scale_atol=1e-6)
    y, s = fastln.add_rms_norm(x, residual, gamma, axis=axis)
    y_ref, s_ref = reference.add_rms_norm(x, residual, gamma, axis=axis)
    assert_bitwise_equal(s, s_ref)
    assert_within_ulp(y, y_ref, dtype, scale_atol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape, axis, offset, scale", ACCURACY_CASES)
def test_backward_close_to_the_reference(dtype, shape, axis, offset, scale, rng):
    x = half_input(rng, shape, dtype, offset=offset, scale=scale)
    dy = half_input(rng, shape, dtype)
    gamma, _ = half_params(rng, int(np.prod(shape[axis:])), dtype)
    gamma = gamma.reshape(shape[axis:])

    _, cache = fastln.layer_norm_forward(x, gamma, axis=axis)
    _, cache_ref = reference.layer_norm_forward(x, gamma, axis=axis)
    assert_close(cache.mean, cache_ref.mean, dtype=np.float32)
    assert_close(cache.rstd, cache_ref.rstd, dtype=np.float32)
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma)
    dx_ref, dgamma_ref, dbeta_ref = reference.layer_norm_backward(dy, cache_ref, gamma)
    assert dgamma_ref.dtype == np.float32
    # dx cancels (dx_hat - mean(dx_hat) - x_hat * ...): one ulp plus float32 error at scale.
    assert_within_ulp(dx, dx_ref, dtype, scale_atol=2e-5)
    assert_close(dgamma, dgamma_ref, dtype=np.float32, rtol=1e-4)
    assert_close(dbeta, dbeta_ref, dtype=np.float32, rtol=1e-4)

    _, cache = fastln.rms_norm_forward(x, gamma, axis=axis)
    _, cache_ref = reference.rms_norm_forward(x, gamma, axis=axis)
    dx, dgamma = fastln.rms_norm_backward(dy, cache, gamma)
    dx_ref, dgamma_ref = reference.rms_norm_backward(dy, cache_ref, gamma)
    assert_within_ulp(dx, dx_ref, dtype, scale_atol=2e-5)
    assert_close(dgamma, dgamma_ref, dtype=np.float32, rtol=1e-4)


def test_float16_extremes_do_not_overflow():
    # Values near float16's largest finite value: the statistics are float32 (in double inside
    # the kernel), so squares far beyond 65504 are fine and y is finite.
    x = np.array([[65504.0, -65504.0, 60000.0, 1.0], [6e-8, 1.2e-7, 0.0, 6e-8]], np.float16)
    y = fastln.layer_norm(x)
    assert np.isfinite(y).all()
    assert_within_ulp(y, reference.layer_norm(x), np.dtype(np.float16))
    assert_within_ulp(fastln.rms_norm(x), reference.rms_norm(x), np.dtype(np.float16))
    # A constant row gives beta exactly, also with eps = 0.
    beta = np.array([0.5, -1.0, 2.0, 0.25], np.float16)
    constant = np.full((2, 4), 1234.0, np.float16)
    assert_bitwise_equal(fastln.layer_norm(constant, None, beta, eps=0.0),
                         np.broadcast_to(beta, (2, 4)).copy())


@needs_ml_dtypes
def test_bfloat16_huge_magnitudes():
    x = (np.array([[1e38, -2e38, 3e37, 5e36]]) * np.array([[1.0], [1e-36]])).astype(BFLOAT16)
    y = fastln.layer_norm(x)
    assert np.isfinite(y.astype(np.float32)).all()
    assert_within_ulp(y, reference.layer_norm(x), BFLOAT16)
    assert_within_ulp(fastln.rms_norm(x), reference.rms_norm(x), BFLOAT16)


@pytest.mark.parametrize("dtype", HALF)
def test_nan_and_inf_stay_in_their_row(dtype, rng):
    x = half_input(rng, (4, 50), dtype)
    clean = fastln.layer_norm(x)
    x[1, 3] = np.nan
    x[2, 7] = np.inf
    y = fastln.layer_norm(x)
    assert np.isnan(y[1].astype(np.float32)).all() and np.isnan(y[2].astype(np.float32)).all()
    assert_bitwise_equal(y[[0, 3]], clean[[0, 3]])


# ---------------------------------------------------------------------------------------------
# Determinism, layouts, parameters, memory, errors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
def test_identical_for_every_thread_count_and_batch(dtype, rng):
    x = half_input(rng, (513, 200), dtype)  # above the threading threshold
    dy = half_input(rng, (513, 200), dtype)
    residual = half_input(rng, (513, 200), dtype)
    gamma, beta = half_params(rng, 200, dtype)
    results = []
    for num_threads in (1, 2, 3):
        kw = dict(num_threads=num_threads)
        y, cache = fastln.layer_norm_forward(x, gamma, beta, **kw)
        y_rms, rms_cache = fastln.rms_norm_forward(x, gamma, **kw)
        results.append((y, y_rms, *fastln.layer_norm_backward(dy, cache, gamma, **kw),
                        *fastln.rms_norm_backward(dy, rms_cache, gamma, **kw),
                        *fastln.add_layer_norm(x, residual, gamma, beta, **kw)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_bitwise_equal(a, b)
    # A row alone gives the same bits as inside the batch.
    y = results[0][0]
    for row in (0, 255, 512):
        assert_bitwise_equal(fastln.layer_norm(x[row:row + 1], gamma, beta), y[row:row + 1])


@pytest.mark.parametrize("layout", ["strided", "fortran", "readonly", "byteswapped",
                                    "negative_strides", "unaligned"])
def test_float16_layouts(layout, rng):
    x = half_input(rng, (6, 9, 11), np.float16)
    gamma, beta = half_params(rng, 11, np.float16)
    expected = fastln.layer_norm(x, gamma, beta)
    arranged = make_layout(x, layout)
    snapshot = Snapshot(arranged)
    assert_bitwise_equal(fastln.layer_norm(arranged, gamma, beta), expected)
    assert_bitwise_equal(fastln.rms_norm(arranged, gamma), fastln.rms_norm(x, gamma))
    snapshot.assert_unchanged()


@pytest.mark.parametrize("dtype", HALF)
def test_parameters_in_the_half_format_or_float32(dtype, rng):
    x = half_input(rng, (8, 24), dtype)
    gamma, beta = half_params(rng, 24, dtype)
    y = fastln.layer_norm(x, gamma, beta)
    # float32 parameters holding the same values give the same bits ...
    assert_bitwise_equal(fastln.layer_norm(x, gamma.astype(np.float32), beta.astype(np.float32)),
                         y)
    # ... and float32 values between half values are used as they are, not rounded to half.
    fine = np.float32(1.0) + np.float32(2.0 ** -12)
    assert np.float32(fine).astype(dtype) == 1.0
    assert_bitwise_equal(fastln.layer_norm(x, np.full(24, fine, np.float32)),
                         (fastln.layer_norm(x.astype(np.float32)) * fine).astype(dtype))


@pytest.mark.parametrize("dtype", HALF)
def test_out_in_place_and_sum_out(dtype, rng):
    x = half_input(rng, (40, 64), dtype)
    residual = half_input(rng, (40, 64), dtype)
    expected = fastln.layer_norm(x)
    inplace = x.copy()
    assert fastln.layer_norm(inplace, out=inplace) is inplace
    assert_bitwise_equal(inplace, expected)
    y_expected, s_expected = fastln.add_rms_norm(x, residual)
    stream = residual.copy()
    y, s = fastln.add_rms_norm(x, stream, sum_out=stream)
    assert s is stream
    assert_bitwise_equal(s, s_expected)
    assert_bitwise_equal(y, y_expected)


def test_no_full_size_float32_temporary(rng):
    x = half_input(rng, (2048, 1024), np.float16)  # 4 MiB; a float32 copy would be 8 MiB
    dy = half_input(rng, (2048, 1024), np.float16)
    fastln.layer_norm(x[:2])  # warm up
    tracemalloc.start()
    try:
        y, cache = fastln.layer_norm_forward(x)
        _, forward_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        dx, _, _ = fastln.layer_norm_backward(dy, cache)
        _, backward_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # NumPy reports its allocations to tracemalloc: the output plus O(rows) statistics only.
    assert forward_peak < y.nbytes + (1 << 20), forward_peak
    assert backward_peak < y.nbytes + dx.nbytes + (1 << 20), backward_peak


def test_half_errors():
    x16 = np.ones((4, 3), np.float16)
    _, cache = fastln.layer_norm_forward(x16)
    with pytest.raises(ValueError, match="dy has dtype float32"):
        fastln.layer_norm_backward(np.ones((4, 3), np.float32), cache)
    with pytest.raises(ValueError, match="out has dtype float32, expected float16"):
        fastln.layer_norm(x16, out=np.empty((4, 3), np.float32))
    with pytest.raises(ValueError, match="gamma has shape"):
        fastln.rms_norm(x16, np.ones(4, np.float16))
    with pytest.raises(TypeError, match="x has dtype longdouble|x has dtype float128"):
        fastln.layer_norm(np.ones((2, 2), np.longdouble))


@needs_ml_dtypes
def test_bfloat16_errors_and_caches():
    x = np.ones((4, 3), BFLOAT16)
    _, cache = fastln.rms_norm_forward(x)
    assert cache.dtype == BFLOAT16 and cache.rstd.dtype == np.float32
    with pytest.raises(ValueError, match="dy has dtype float16, expected bfloat16"):
        fastln.rms_norm_backward(np.ones((4, 3), np.float16), cache)
    # Other ml_dtypes formats have no kernel.
    with pytest.raises(TypeError, match="x has dtype float8_e4m3fn"):
        fastln.layer_norm(np.ones((2, 2), ml_dtypes.float8_e4m3fn))
    # Caches of fastln and of the reference are interchangeable for half inputs too.
    _, ref_cache = reference.layer_norm_forward(x)
    dx, dgamma, dbeta = fastln.layer_norm_backward(np.ones((4, 3), BFLOAT16), ref_cache)
    assert dx.dtype == BFLOAT16 and dgamma.dtype == np.float32


def test_empty_batches(rng):
    x = np.ones((0, 5), np.float16)
    y, cache = fastln.layer_norm_forward(x)
    assert y.shape == (0, 5) and y.dtype == np.float16 and cache.mean.shape == (0,)
    dx, dgamma, dbeta = fastln.layer_norm_backward(np.ones((0, 5), np.float16), cache)
    assert dx.shape == (0, 5) and dgamma.dtype == np.float32
    np.testing.assert_array_equal(dgamma, np.zeros(5, np.float32))
    y, s = fastln.add_rms_norm(np.ones((2, 0, 3), np.float16), np.ones((2, 0, 3), np.float16))
    assert y.shape == s.shape == (2, 0, 3)


def test_property_half_is_float32_rounded():
    pytest.importorskip("hypothesis")
    from hypothesis import given
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp

    @given(hnp.arrays(np.float16, st.tuples(st.integers(1, 9), st.integers(1, 70)),
                      elements=st.floats(-65504, 65504, width=16)),
           st.sampled_from([0.0, 1e-5, 1.0]))
    def check(x, eps):
        x32 = x.astype(np.float32)
        with np.errstate(all="ignore"):
            assert_bitwise_equal(fastln.layer_norm(x, eps=eps),
                                 fastln.layer_norm(x32, eps=eps).astype(np.float16))
            assert_bitwise_equal(fastln.rms_norm(x, eps=eps),
                                 fastln.rms_norm(x32, eps=eps).astype(np.float16))
            y, cache = fastln.layer_norm_forward(x, eps=eps)
            _, cache32 = fastln.layer_norm_forward(x32, eps=eps)
            dx, dgamma, _ = fastln.layer_norm_backward(x, cache)
            dx32, dgamma32, _ = fastln.layer_norm_backward(x32, cache32)
            assert_bitwise_equal(dx, dx32.astype(np.float16))
            assert_bitwise_equal(dgamma, dgamma32)

    check()
