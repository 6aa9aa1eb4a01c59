"""Parity of fastln's kernels with fastln.reference, over dtypes, shapes, axes, layouts, threads.

Every kernel result is compared with the pure-Python float64 reference at the tolerance of the
output dtype (conftest.RTOL/ATOL: ~2e-5 relative for float32, ~1e-11 for float64). Inputs are
checked byte for byte after every call.
"""
import numpy as np
import pytest

import fastln
import fastln.reference as ref
from conftest import (
    DTYPES,
    LAYOUTS,
    THREADS,
    Snapshot,
    assert_close,
    assert_output_array,
    make_layout,
    placed_after,
    random_input,
    random_params,
)

# (shape, axis): 2-D with the usual last axis, odd widths, width 1, 1-D, and 3-D / 4-D arrays with
# every axis (negative spellings included). The last two are big enough that the kernels really
# run on several threads (>= 65536 elements).
SHAPE_AXES = [
    ((1, 1), -1),
    ((1, 768), -1),
    ((3, 5), -1),
    ((3, 5), 0),
    ((4, 1), 1),
    ((7, 1023), -1),
    ((9,), 0),
    ((2, 3, 4), 0),
    ((2, 3, 4), 1),
    ((2, 3, 4), 2),
    ((2, 3, 4), -2),
    ((2, 3, 4, 5), 0),
    ((2, 3, 4, 5), 1),
    ((2, 3, 4, 5), 2),
    ((2, 3, 4, 5), 3),
    ((2, 3, 4, 5), -3),
    ((300, 257), -1),
    ((6, 50, 257), 2),
]


def _ids(value):
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple):
        return f"{'x'.join(map(str, value[0]))}-axis{value[1]}"
    return None


def _normalized_shape(shape, axis):
    return shape[axis % len(shape):]


def _batch_shape(shape, axis):
    return shape[:axis % len(shape)]


@pytest.mark.parametrize("num_threads", THREADS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shape_axis", SHAPE_AXES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_forward_backward_match_reference(rng, dtype, shape_axis, layout, num_threads):
    shape, axis = shape_axis
    nshape = _normalized_shape(shape, axis)
    x = random_input(rng, shape, dtype)
    gamma, beta = random_params(rng, nshape, dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    xl = make_layout(x, layout)
    dyl = make_layout(dy, layout)
    snap = Snapshot(xl, gamma, beta, dyl)

    y, cache = fastln.layer_norm_forward(xl, gamma, beta, axis=axis, num_threads=num_threads)
    y_ref, cache_ref = ref.layer_norm_forward(x, gamma, beta, axis=axis)
    assert_output_array(y, shape, dtype)
    assert_close(y, y_ref, err_msg="y")

    batch = _batch_shape(shape, axis)
    for name in ("mean", "rstd"):
        got, want = getattr(cache, name), getattr(cache_ref, name)
        assert got.shape == batch, name
        assert got.dtype == np.dtype(dtype), name
        assert_close(got, want, err_msg=name)

    dx, dgamma, dbeta = fastln.layer_norm_backward(dyl, cache, gamma, num_threads=num_threads)
    dx_ref, dgamma_ref, dbeta_ref = ref.layer_norm_backward(dy, cache_ref, gamma)
    assert_output_array(dx, shape, dtype)
    assert_output_array(dgamma, nshape, dtype)
    assert_output_array(dbeta, nshape, dtype)
    assert_close(dx, dx_ref, err_msg="dx")
    assert_close(dgamma, dgamma_ref, err_msg="dgamma")
    assert_close(dbeta, dbeta_ref, err_msg="dbeta")

    # layer_norm is the forward's y, exactly
    y2 = fastln.layer_norm(xl, gamma, beta, axis=axis, num_threads=num_threads)
    np.testing.assert_array_equal(y2, y)
    snap.assert_unchanged()


@pytest.mark.parametrize("layout", ["strided", "byteswapped", "readonly", "negative_strides",
                                    "unaligned", "fortran"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_gamma_beta_layouts(rng, dtype, layout):
    """gamma and beta may have any layout too (here a 2-D normalized part, so Fortran matters)."""
    shape, axis = (5, 6, 7), 1
    x = random_input(rng, shape, dtype)
    gamma, beta = random_params(rng, shape[axis:], dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gl, bl = make_layout(gamma, layout), make_layout(beta, layout)
    snap = Snapshot(x, gl, bl, dy)
    y, cache = fastln.layer_norm_forward(x, gl, bl, axis=axis)
    y_ref, cache_ref = ref.layer_norm_forward(x, gamma, beta, axis=axis)
    assert_close(y, y_ref)
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gl)
    dx_ref, dgamma_ref, dbeta_ref = ref.layer_norm_backward(dy, cache_ref, gamma)
    assert_close(dx, dx_ref)
    assert_close(dgamma, dgamma_ref)
    assert_close(dbeta, dbeta_ref)
    snap.assert_unchanged()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("use_gamma", [False, True])
@pytest.mark.parametrize("use_beta", [False, True])
def test_none_means_ones_and_zeros(rng, dtype, use_gamma, use_beta):
    x = random_input(rng, (11, 37), dtype)
    gamma, beta = random_params(rng, (37,), dtype)
    g = gamma if use_gamma else None
    b = beta if use_beta else None
    g_full = gamma if use_gamma else np.ones(37, dtype)
    b_full = beta if use_beta else np.zeros(37, dtype)
    y = fastln.layer_norm(x, g, b)
    np.testing.assert_array_equal(y, fastln.layer_norm(x, g_full, b_full))
    assert_close(y, ref.layer_norm(x, g, b))
    dy = rng.standard_normal(x.shape).astype(dtype)
    _, cache = fastln.layer_norm_forward(x, g, b)
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, g)
    dx_full, dgamma_full, dbeta_full = fastln.layer_norm_backward(dy, cache, g_full)
    np.testing.assert_array_equal(dx, dx_full)
    np.testing.assert_array_equal(dgamma, dgamma_full)
    np.testing.assert_array_equal(dbeta, dbeta_full)
    assert dgamma.shape == dbeta.shape == (37,)


@pytest.mark.parametrize("eps", [0.0, 0, 1e-12, 1e-3, 0.5, 7, np.float32(1e-2), np.float64(2.0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_eps_values(rng, dtype, eps):
    """eps is used inside the square root, with any real-number type."""
    x = random_input(rng, (6, 19), dtype, scale=0.3)
    gamma, beta = random_params(rng, (19,), dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    y, cache = fastln.layer_norm_forward(x, gamma, beta, eps)
    y_ref, cache_ref = ref.layer_norm_forward(x, gamma, beta, eps)
    assert_close(y, y_ref)
    assert_close(cache.rstd, cache_ref.rstd)
    xd = x.astype(np.float64)
    assert_close(cache.rstd, 1 / np.sqrt(xd.var(axis=-1) + float(eps)), dtype=dtype)
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma)
    dx_ref, dgamma_ref, dbeta_ref = ref.layer_norm_backward(dy, cache_ref, gamma)
    assert_close(dx, dx_ref)
    assert_close(dgamma, dgamma_ref)
    assert_close(dbeta, dbeta_ref)


@pytest.mark.parametrize("in_dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8,
                                      np.uint64, np.bool_, ">i4"])
def test_integer_and_bool_inputs_compute_in_float64(rng, in_dtype):
    x = rng.integers(0, 2 if in_dtype is np.bool_ else 100, size=(5, 8)).astype(in_dtype)
    x[:, 0] = 1  # no constant bool row by accident being the only thing tested
    x[:, 1] = 0
    snap = Snapshot(x)
    y, cache = fastln.layer_norm_forward(x)
    assert_output_array(y, x.shape, np.float64)
    assert cache.mean.dtype == cache.rstd.dtype == np.float64
    expected = ref.layer_norm(x.astype(np.float64))
    assert_close(y, expected)
    assert_close(y, ref.layer_norm(x))
    dy = rng.standard_normal(x.shape)
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache)
    assert dx.dtype == dgamma.dtype == dbeta.dtype == np.float64
    _, cache_ref = ref.layer_norm_forward(x.astype(np.float64))
    dx_ref, _, _ = ref.layer_norm_backward(dy, cache_ref)
    assert_close(dx, dx_ref)
    snap.assert_unchanged()


@pytest.mark.parametrize("param_dtype", [np.float64, np.float32, np.int64, np.bool_, ">f8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_gamma_beta_are_cast_to_the_output_dtype(rng, dtype, param_dtype):
    x = random_input(rng, (4, 10), dtype)
    gamma = (rng.integers(0, 2, 10) if param_dtype is np.bool_
             else rng.integers(-3, 4, 10) + 0.37 * rng.standard_normal(10)).astype(param_dtype)
    beta = np.abs(gamma).astype(param_dtype)
    y = fastln.layer_norm(x, gamma, beta)
    assert y.dtype == np.dtype(dtype)
    expected = fastln.layer_norm(x, gamma.astype(dtype), beta.astype(dtype))
    np.testing.assert_array_equal(y, expected)
    assert_close(y, ref.layer_norm(x, gamma, beta))


def test_python_lists_are_accepted():
    x = [[1.0, 2.0, 4.0], [3.0, -1.0, 0.5]]
    y = fastln.layer_norm(x, [1, 2, 3], [0.5, 0.0, -0.5])
    assert y.dtype == np.float64
    assert_close(y, ref.layer_norm(np.array(x), np.array([1, 2, 3.0]), np.array([0.5, 0, -0.5])))
    y, cache = fastln.layer_norm_forward(x)
    dx, dgamma, dbeta = fastln.layer_norm_backward([[1.0, 0, 0], [0, 1.0, 0]], cache)
    _, cache_ref = ref.layer_norm_forward(np.array(x))
    dx_ref, dgamma_ref, dbeta_ref = ref.layer_norm_backward(
        np.array([[1.0, 0, 0], [0, 1.0, 0]]), cache_ref)
    assert_close(dx, dx_ref)
    assert_close(dgamma, dgamma_ref)
    assert_close(dbeta, dbeta_ref)


def _assert_backward_writes_out(out, dy, cache, gamma, num_threads):
    """layer_norm_backward(..., out=out) returns out as dx, with the bits of a call without out
    (made first, on a copy of dy: out may be dy itself)."""
    dx_expected, dgamma_expected, dbeta_expected = fastln.layer_norm_backward(
        dy.copy(), cache, gamma)
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma, out=out,
                                                   num_threads=num_threads)
    assert dx is out
    np.testing.assert_array_equal(dx, dx_expected)
    np.testing.assert_array_equal(dgamma, dgamma_expected)
    np.testing.assert_array_equal(dbeta, dbeta_expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("num_threads", THREADS)
def test_out_new_buffer(rng, dtype, num_threads):
    x = random_input(rng, (300, 260), dtype)
    gamma, beta = random_params(rng, (260,), dtype)
    expected = fastln.layer_norm(x, gamma, beta)
    out = np.full(x.shape, np.nan, dtype)
    snap = Snapshot(x, gamma, beta)
    result = fastln.layer_norm(x, gamma, beta, out=out, num_threads=num_threads)
    assert result is out
    np.testing.assert_array_equal(out, expected)
    out2 = np.full(x.shape, np.nan, dtype)
    y, cache = fastln.layer_norm_forward(x, gamma, beta, out=out2, num_threads=num_threads)
    assert y is out2
    np.testing.assert_array_equal(out2, expected)
    snap.assert_unchanged()

    dy = rng.standard_normal(x.shape).astype(dtype)
    _assert_backward_writes_out(np.full(x.shape, np.nan, dtype), dy, cache, gamma, num_threads)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("num_threads", THREADS)
@pytest.mark.parametrize("shape_axis", [((300, 260), -1), ((3, 5), -1), ((4, 6, 50), 1)],
                         ids=_ids)
def test_in_place(rng, dtype, num_threads, shape_axis):
    """layer_norm(x, out=x) overwrites x with y; layer_norm_backward(dy, out=dy) with dx."""
    shape, axis = shape_axis
    nshape = _normalized_shape(shape, axis)
    x = random_input(rng, shape, dtype)
    gamma, beta = random_params(rng, nshape, dtype)
    expected = fastln.layer_norm(x.copy(), gamma, beta, axis=axis)
    result = fastln.layer_norm(x, gamma, beta, axis=axis, out=x, num_threads=num_threads)
    assert result is x
    np.testing.assert_array_equal(x, expected)

    x = random_input(rng, shape, dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    _, cache = fastln.layer_norm_forward(x, gamma, beta, axis=axis)
    _assert_backward_writes_out(dy, dy, cache, gamma, num_threads)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shift", [1, -1, 3])
def test_out_partially_overlapping_x(rng, dtype, shift):
    """out shifted by whole rows over x: x must be read as it was, not as already written."""
    n, h = 257, 260
    buf = random_input(rng, (n + abs(shift), h), dtype)
    if shift > 0:
        x, out = buf[shift:], buf[:-shift]
    else:
        x, out = buf[:shift], buf[-shift:]
    gamma, beta = random_params(rng, (h,), dtype)
    expected = fastln.layer_norm(x.copy(), gamma, beta)
    result = fastln.layer_norm(x, gamma, beta, out=out)
    assert result is out
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("which", ["gamma", "beta"])
def test_gamma_or_beta_inside_out(rng, dtype, which):
    """gamma/beta that live inside out must be used with their values from before the call."""
    n, h = 300, 256
    x = random_input(rng, (n, h), dtype)
    gamma, beta = random_params(rng, (h,), dtype)
    expected = fastln.layer_norm(x, gamma, beta)
    out = np.empty((n, h), dtype)
    row = n // 2
    out[row] = gamma if which == "gamma" else beta
    params = {"gamma": gamma, "beta": beta, which: out[row]}
    fastln.layer_norm(x, params["gamma"], params["beta"], out=out)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape_axis", [((0, 5), -1), ((0, 5), 1), ((2, 0, 3), 2),
                                        ((3, 0, 4, 2), -2)], ids=_ids)
def test_empty_batch(dtype, shape_axis):
    shape, axis = shape_axis
    nshape = _normalized_shape(shape, axis)
    x = np.empty(shape, dtype)
    gamma, beta = np.ones(nshape, dtype), np.zeros(nshape, dtype)
    y = fastln.layer_norm(x, gamma, beta, axis=axis)
    assert_output_array(y, shape, dtype)
    y, cache = fastln.layer_norm_forward(x, gamma, beta, axis=axis)
    assert_output_array(y, shape, dtype)
    assert cache.mean.shape == cache.rstd.shape == _batch_shape(shape, axis)
    dx, dgamma, dbeta = fastln.layer_norm_backward(np.empty(shape, dtype), cache, gamma)
    assert_output_array(dx, shape, dtype)
    assert_output_array(dgamma, nshape, dtype)
    assert_output_array(dbeta, nshape, dtype)
    np.testing.assert_array_equal(dgamma, np.zeros(nshape))  # a sum over no rows
    np.testing.assert_array_equal(dbeta, np.zeros(nshape))
    out = np.empty(shape, dtype)
    assert fastln.layer_norm(x, axis=axis, out=out) is out
    y_ref = ref.layer_norm(x, gamma, beta, axis=axis)
    assert y_ref.shape == shape


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_outputs_are_fresh_and_writeable(rng, dtype):
    """Without out, results never alias the inputs and can be written to, even from read-only x."""
    x = random_input(rng, (4, 9), dtype)
    gamma, beta = random_params(rng, (9,), dtype)
    for a in (x, gamma, beta):
        a.setflags(write=False)
    y, cache = fastln.layer_norm_forward(x, gamma, beta)
    assert y.flags.writeable and y.flags.c_contiguous
    for a in (x, gamma, beta):
        assert not np.shares_memory(y, a)
    dy = rng.standard_normal(x.shape).astype(dtype)
    dy.setflags(write=False)
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma)
    for out in (dx, dgamma, dbeta):
        assert out.flags.writeable
        for a in (x, gamma, beta, dy, cache.mean, cache.rstd):
            assert not np.shares_memory(out, a)
    y[...] = 0
    dx[...] = 0
    dgamma[...] = 0


@pytest.mark.parametrize("layout", ["contiguous", "strided", "fortran"])
def test_cache_is_o_rows(rng, layout):
    """The cache holds x itself plus O(rows) numbers, not a copy of x or of x_hat."""
    x = make_layout(random_input(rng, (64, 3, 40), np.float32), layout)
    _, cache = fastln.layer_norm_forward(x, axis=1)
    n_rows = 64
    seen = 0
    for name in dir(cache):
        if name.startswith("__"):
            continue
        value = getattr(cache, name, None)
        if isinstance(value, np.ndarray):
            seen += 1
            assert value.size <= n_rows or np.shares_memory(value, x), name
    assert seen >= 2  # at least mean and rstd


def test_num_threads_accepts_numpy_integers(rng):
    x = random_input(rng, (300, 300), np.float64)
    expected = fastln.layer_norm(x, num_threads=1)
    np.testing.assert_array_equal(fastln.layer_norm(x, num_threads=np.int64(2)), expected)
    np.testing.assert_array_equal(fastln.layer_norm(x, num_threads=np.uint8(3)), expected)


def test_reference_cache_works_with_kernel_backward(rng):
    """Both caches expose the documented mean/rstd, so either backward can use the reference's."""
    x = random_input(rng, (5, 12), np.float64)
    dy = rng.standard_normal(x.shape)
    _, cache_ref = ref.layer_norm_forward(x)
    _, cache = fastln.layer_norm_forward(x)
    got = fastln.layer_norm_backward(dy, cache_ref)
    want = fastln.layer_norm_backward(dy, cache)
    for g, w in zip(got, want):
        assert_close(g, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("alias", ["gamma_in_out", "dy_shifted_1", "dy_shifted_-2"])
def test_backward_out_overlapping_inputs(rng, dtype, alias):
    """dx written into a buffer that also holds gamma, or that overlaps dy shifted by whole
    rows: every input must be read with its values from before the call."""
    n, h = 300, 256
    x = random_input(rng, (n, h), dtype)
    gamma, _ = random_params(rng, (h,), dtype)
    _, cache = fastln.layer_norm_forward(x, gamma)
    if alias == "gamma_in_out":
        dy = rng.standard_normal((n, h)).astype(dtype)
        out = np.empty((n, h), dtype)
        out[7] = gamma
        g = out[7]
    else:
        shift = int(alias.rsplit("_", 1)[1])
        buf = rng.standard_normal((n + abs(shift), h)).astype(dtype)
        dy, out = (buf[shift:], buf[:-shift]) if shift > 0 else (buf[:shift], buf[-shift:])
        g = gamma
    expected = fastln.layer_norm_backward(dy.copy(), cache, gamma.copy())
    got = fastln.layer_norm_backward(dy, cache, g, out=out)
    assert got[0] is out
    for name, a, b in zip(("dx", "dgamma", "dbeta"), got, expected):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("rms", [False, True])
def test_streamed_outputs_just_after_their_inputs_hold_the_same_bits(rms):
    """Outputs of 32 MiB and more are streamed, except where they start just after an input's
    place in a page (ordinary stores there: fastln_streams_apart); either way the bits are the
    same, forward and backward, at every placement."""
    rng = np.random.default_rng(37)
    shape = (2049, 4100)  # y 33.6 MB, streamed; rows of 16400 bytes start all over a line
    x = (rng.standard_normal(shape) + 100).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    x[3, 5], dy[7, 1] = np.nan, np.inf
    gamma = rng.standard_normal(shape[1]).astype(np.float32)
    beta = None if rms else rng.standard_normal(shape[1]).astype(np.float32)
    forward = fastln.rms_norm_forward if rms else fastln.layer_norm_forward
    backward = fastln.rms_norm_backward if rms else fastln.layer_norm_backward
    args = (x, gamma) if rms else (x, gamma, beta)
    _, cache = forward(*args)
    results = []
    for after in (0, 16, 48, 640, 656, 2048):
        y, dx = placed_after(x, after), placed_after(dy, after)
        forward(*args, out=y)
        backward(dy, cache, gamma, out=dx)
        results.append((y.view(np.uint32).copy(), dx.view(np.uint32).copy()))
    for y_bits, dx_bits in results[1:]:
        assert np.array_equal(y_bits, results[0][0])
        assert np.array_equal(dx_bits, results[0][1])
