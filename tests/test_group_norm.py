"""fastln.group_norm / instance_norm and their forward/backward pairs against fastln.reference,
PyTorch and ONNX's own GroupNormalization and InstanceNormalization cases, plus LayerNorm's
promises: large offsets, constant groups, NaN kept in its group, the same bits for every thread
count and batch, clear errors."""
import numpy as np
import pytest
from conftest import (THREADS, Snapshot, assert_bitwise_equal, assert_close, assert_output_array,
                      at_line_offset, make_layout, onnx_node_cases, random_params)

import fastln
from fastln import reference

# (shape, num_groups, channel_axis). The last ones have groups of more than one piece
# (FASTLN_GN_PIECE = 32768 values) and fewer groups than 4 * threads: their sums go by pieces.
CASES = [((2, 6, 4, 5), 3, 1), ((2, 4, 5, 6), 3, -1), ((3, 4), 2, 1), ((3, 4), 4, -1),
         ((2, 8, 7), 8, 1), ((2, 7, 8), 1, -1), ((1, 32, 9, 11), 8, 1), ((1, 9, 11, 32), 8, -1),
         ((2, 6, 3, 2, 2), 2, 1), ((2, 3, 2, 2, 6), 3, -1)]
BIG_CASES = [((1, 4, 160, 160), 2, 1), ((1, 160, 160, 4), 2, -1), ((2, 3, 100, 200), 1, 1),
             ((1, 300, 300, 2), 1, -1)]


def _input(rng, shape, channel_axis, dtype, offset=0.0):
    """Channels with different means and spreads, so that a channel or group mix-up shows."""
    n_channels = shape[channel_axis]
    view = [1] * len(shape)
    view[channel_axis] = n_channels
    means = rng.standard_normal(n_channels).reshape(view) * 2.0 + offset
    spreads = (0.5 + rng.random(n_channels)).reshape(view)
    return (rng.standard_normal(shape) * spreads + means).astype(dtype)


def _one_element_off_a_line(x):
    """An empty array like x that starts one element past a cache line: not 16-byte aligned
    for float32 and float64, so an output there is written with ordinary stores."""
    raw = np.empty(x.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64 + x.itemsize
    return raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)


def _run(module, x, num_groups, gamma, beta, dy, channel_axis, num_threads=None, eps=1e-5):
    y, cache = module.group_norm_forward(x, num_groups, gamma, beta, eps,
                                         channel_axis=channel_axis, num_threads=num_threads)
    return (y, cache) + module.group_norm_backward(dy, cache, gamma, num_threads=num_threads)


# ---------------------------------------------------------------------------------------------
# Parity with the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, num_groups, channel_axis", CASES + BIG_CASES)
@pytest.mark.parametrize("num_threads", THREADS)
def test_matches_reference(dtype, shape, num_groups, channel_axis, num_threads):
    rng = np.random.default_rng(sum(shape) + num_groups)
    x = _input(rng, shape, channel_axis, dtype)
    gamma, beta = random_params(rng, shape[channel_axis], dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    snapshot = Snapshot(x, gamma, beta, dy)
    y, cache, dx, dgamma, dbeta = _run(fastln, x, num_groups, gamma, beta, dy, channel_axis,
                                       num_threads)
    y_ref, cache_ref, dx_ref, dgamma_ref, dbeta_ref = _run(reference, x, num_groups, gamma,
                                                           beta, dy, channel_axis)
    snapshot.assert_unchanged()
    assert_output_array(y, shape, dtype)
    assert_close(y, y_ref)
    assert cache.mean.shape == cache.rstd.shape == (shape[0], num_groups)
    assert cache.num_groups == num_groups and cache.channel_axis == channel_axis % len(shape)
    assert_close(cache.mean, cache_ref.mean)
    assert_close(cache.rstd, cache_ref.rstd)
    assert_close(dx, dx_ref)
    # dgamma, dbeta: sums over N * spatial values, compared at their own scale
    count = x.size // shape[channel_axis]
    assert_close(dgamma, dgamma_ref, atol=np.finfo(dtype).eps * 10, scale=count)
    assert_close(dbeta, dbeta_ref, atol=np.finfo(dtype).eps * 10, scale=count)


@pytest.mark.parametrize("layout", ["strided", "fortran", "readonly", "byteswapped",
                                    "unaligned"])
@pytest.mark.parametrize("channel_axis", [1, -1])
def test_layouts(layout, channel_axis):
    rng = np.random.default_rng(5)
    shape = (2, 6, 5, 7) if channel_axis == 1 else (2, 5, 7, 6)
    x = _input(rng, shape, channel_axis, np.float32)
    gamma, beta = random_params(rng, 6, np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    expected = _run(fastln, x, 2, gamma, beta, dy, channel_axis)
    got = _run(fastln, make_layout(x, layout), 2, make_layout(gamma, layout),
               make_layout(beta, layout), make_layout(dy, layout), channel_axis)
    for a, b in zip(expected[2:] + expected[:1], got[2:] + got[:1]):
        assert_bitwise_equal(a, b, layout)


def test_integer_input_is_float64():
    x = np.arange(24).reshape(2, 4, 3)
    y = fastln.group_norm(x, 2)
    assert y.dtype == np.float64
    assert_close(y, reference.group_norm(x.astype(np.float64), 2))


# ---------------------------------------------------------------------------------------------
# Determinism: every thread count, every batch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, num_groups, channel_axis",
                         BIG_CASES + [((1, 1, 300, 300), 1, 1), ((1, 300, 300, 1), 1, -1),
                                      ((1, 32, 64, 64), 32, 1), ((1, 64, 64, 32), 32, -1)])
def test_same_bits_for_every_thread_count(shape, num_groups, channel_axis):
    rng = np.random.default_rng(7)
    x = _input(rng, shape, channel_axis, np.float32, offset=3.0)
    gamma, beta = random_params(rng, shape[channel_axis], np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    results = [_run(fastln, x, num_groups, gamma, beta, dy, channel_axis, n)
               for n in (1, 2, 3, 4, 7)]
    for other in results[1:]:
        for a, b in zip(results[0][:1] + results[0][2:], other[:1] + other[2:]):
            assert_bitwise_equal(a, b)
        assert_bitwise_equal(results[0][1].mean, other[1].mean)
        assert_bitwise_equal(results[0][1].rstd, other[1].rstd)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_by_groups_and_by_pieces_agree(dtype):
    """Channels first, the backward takes a task per group when there are at least 4 groups per
    thread (else its sums, constants and dx go in phases over pieces): 4 groups of channels of
    two pieces take one way on 1 thread and the other on 2, and give the same bits, also for a
    group with a NaN in dy (its dx done from x again) and one far from zero."""
    rng = np.random.default_rng(9)
    shape = (1, 8, 200, 200)
    x = _input(rng, shape, 1, dtype)
    x[:, 4:6] += 1e4
    gamma, beta = random_params(rng, 8, dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    dy[0, 2, 17, 3] = np.nan
    _, cache = fastln.group_norm_forward(x, 4, gamma, beta)
    by_groups = fastln.group_norm_backward(dy, cache, gamma, num_threads=1)
    by_pieces = fastln.group_norm_backward(dy, cache, gamma, num_threads=2)
    for a, b in zip(by_groups, by_pieces):
        assert_bitwise_equal(a, b)
    assert np.isnan(by_groups[0][0, 2:4]).all() and np.isfinite(by_groups[0][0, 4:]).all()
    assert_close(by_groups[0][0, :2], reference.group_norm_backward(dy, cache, gamma)[0][0, :2])


@pytest.mark.parametrize("channel_axis", [1, -1])
def test_same_bits_for_every_batch(channel_axis):
    """A sample's y, statistics and dx do not depend on the other samples of the batch."""
    rng = np.random.default_rng(8)
    shape = (4, 8, 90, 90) if channel_axis == 1 else (4, 90, 90, 8)
    x = _input(rng, shape, channel_axis, np.float32)
    gamma, beta = random_params(rng, 8, np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    y, cache, dx, _, _ = _run(fastln, x, 4, gamma, beta, dy, channel_axis, 2)
    for i in range(shape[0]):
        y_i, cache_i, dx_i, _, _ = _run(fastln, x[i:i + 1], 4, gamma, beta, dy[i:i + 1],
                                        channel_axis, 1)
        assert_bitwise_equal(y[i:i + 1], y_i)
        assert_bitwise_equal(cache.rstd[i:i + 1], cache_i.rstd)
        assert_bitwise_equal(dx[i:i + 1], dx_i)


def test_instance_norm_is_group_norm_with_a_group_per_channel():
    rng = np.random.default_rng(9)
    x = _input(rng, (2, 5, 40, 40), 1, np.float32)
    gamma, beta = random_params(rng, 5, np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    y, cache = fastln.instance_norm_forward(x, gamma, beta)
    assert cache.num_groups == 5 and cache.mean.shape == (2, 5)
    assert_bitwise_equal(y, fastln.group_norm(x, 5, gamma, beta))
    assert_bitwise_equal(fastln.instance_norm(x, gamma, beta), y)
    got = fastln.instance_norm_backward(dy, cache, gamma)
    expected = fastln.group_norm_backward(dy, cache, gamma)
    for a, b in zip(got, expected):
        assert_bitwise_equal(a, b)
    y_ref, cache_ref = reference.instance_norm_forward(x, gamma, beta)
    assert_close(y, y_ref)
    for a, b in zip(got, reference.instance_norm_backward(dy, cache_ref, gamma)):
        assert_close(a, b, atol=1e-5, scale=3200)
    assert_close(reference.instance_norm(x, gamma, beta), y_ref)


# ---------------------------------------------------------------------------------------------
# Exactness: large offsets, constant groups, NaN and Inf, the ends of float64's range
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("channel_axis", [1, -1])
@pytest.mark.parametrize("shape_first", [(2, 8, 6, 6), (1, 4, 200, 200)])
def test_large_offset_has_no_cancellation(channel_axis, shape_first):
    rng = np.random.default_rng(10)
    shape = shape_first if channel_axis == 1 else (shape_first[0],) + shape_first[2:] + \
        shape_first[1:2]
    x = (1e4 + rng.standard_normal(shape)).astype(np.float32)
    y = fastln.group_norm(x, 2, channel_axis=channel_axis)
    exact = reference.group_norm(x.astype(np.float64), 2, channel_axis=channel_axis)
    assert np.abs(y - exact).max() <= 5e-7 * max(1.0, np.abs(exact).max())


@pytest.mark.parametrize("channel_axis", [1, -1])
@pytest.mark.parametrize("eps", [0.0, 1e-5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_constant_group_gives_beta(channel_axis, eps, dtype):
    rng = np.random.default_rng(11)
    shape = (2, 4, 3, 5) if channel_axis == 1 else (2, 3, 5, 4)
    x = _input(rng, shape, channel_axis, dtype)
    group = (slice(1, 2), slice(0, 2)) if channel_axis == 1 else \
        (slice(1, 2), Ellipsis, slice(0, 2))
    x[group] = 7.25
    gamma, beta = random_params(rng, 4, dtype)
    y, cache = fastln.group_norm_forward(x, 2, gamma, beta, eps, channel_axis=channel_axis)
    channels_first = np.moveaxis(y, channel_axis, 1)
    for c in (0, 1):
        np.testing.assert_array_equal(channels_first[1, c], np.full((3, 5), beta[c]))
    assert cache.mean[1, 0] == dtype(7.25)
    assert np.isfinite(y).all()
    dy = rng.standard_normal(shape).astype(dtype)
    dx, dgamma, dbeta = fastln.group_norm_backward(dy, cache, gamma)
    dx_ref, dgamma_ref, dbeta_ref = reference.group_norm_backward(
        dy, reference.group_norm_forward(x, 2, gamma, beta, eps, channel_axis=channel_axis)[1],
        gamma)
    other = (slice(0, 1),)
    assert_close(dx[other], dx_ref[other])
    if eps > 0:
        assert_close(dx, dx_ref)
    assert_close(dgamma, dgamma_ref, atol=1e-5, scale=30)
    assert_close(dbeta, dbeta_ref, atol=1e-5, scale=30)


@pytest.mark.parametrize("channel_axis", [1, -1])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf_stay_in_their_group(channel_axis, bad):
    rng = np.random.default_rng(12)
    shape = (2, 6, 4, 4) if channel_axis == 1 else (2, 4, 4, 6)
    x = _input(rng, shape, channel_axis, np.float32)
    if channel_axis == 1:
        x[1, 3, 2, 1] = bad          # sample 1, group 1 (channels 2, 3)
        inside = np.zeros(shape, bool)
        inside[1, 2:4] = True
    else:
        x[1, 2, 1, 3] = bad
        inside = np.zeros(shape, bool)
        inside[1, ..., 2:4] = True
    y, cache = fastln.group_norm_forward(x, 3, channel_axis=channel_axis)
    assert np.isnan(y[inside]).all()
    assert np.isfinite(y[~inside]).all()
    assert np.isnan(cache.rstd[1, 1]) or np.isnan(cache.mean[1, 1])
    assert_close(y[~inside], reference.group_norm(x, 3, channel_axis=channel_axis)[~inside])
    dx, _, _ = fastln.group_norm_backward(np.ones_like(x), cache)
    assert np.isfinite(dx[~inside]).all()
    assert np.isnan(dx[inside]).all()


@pytest.mark.parametrize("channel_axis", [1, -1])
@pytest.mark.parametrize("scale", [1e300, 1e-300, 4e-320])
def test_ends_of_float64_range(channel_axis, scale):
    """Groups whose squares or sums leave double's range, and a subnormal spread with eps = 0
    whose rstd is beyond it: the careful paths, held to the reference."""
    rng = np.random.default_rng(13)
    shape = (2, 4, 5, 3) if channel_axis == 1 else (2, 5, 3, 4)
    x = rng.standard_normal(shape) * scale
    gamma, beta = random_params(rng, 4, np.float64)
    dy = rng.standard_normal(shape)
    got = _run(fastln, x, 2, gamma, beta, dy, channel_axis, eps=0.0)
    expected = _run(reference, x, 2, gamma, beta, dy, channel_axis, eps=0.0)
    rtol = 1e-9 if scale > 1e-310 else 1e-3  # subnormal inputs carry few digits
    assert_close(got[0], expected[0], rtol=rtol, atol=rtol)
    assert_close(got[2], expected[2], rtol=rtol, atol=rtol)
    assert_close(got[3], expected[3], rtol=rtol, atol=rtol)
    assert_close(got[4], expected[4], rtol=rtol, atol=rtol)


def test_group_far_from_its_first_value_is_centred_again():
    """A first value six standard deviations from the group mean takes the careful path."""
    rng = np.random.default_rng(14)
    for channel_axis, shape in ((1, (1, 2, 64, 64)), (-1, (1, 64, 64, 2))):
        x = (1e3 + rng.standard_normal(shape)).astype(np.float32)
        x.reshape(-1)[0] = 1e3 + 50.0
        y = fastln.group_norm(x, 1, channel_axis=channel_axis)
        exact = reference.group_norm(x.astype(np.float64), 1, channel_axis=channel_axis)
        assert np.abs(y - exact).max() < 5e-6 * np.abs(exact).max()


@pytest.mark.parametrize("image", ["top rows apart", "gradient", "one bright pixel"])
@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("shape", [(1, 64, 64, 512), (2, 40, 40, 64), (1, 300, 7, 6)])
def test_channels_last_images_whose_first_rows_are_not_typical(image, offset, shape):
    """Channels last, the float32 statistics take each block's shift from its first rows and
    sum it again when its mean is far from them; either way float32 stays within 5e-7 of
    float64."""
    rng = np.random.default_rng(15)
    x = offset + rng.standard_normal(shape)
    rows = np.arange(shape[1]).reshape(1, -1, 1, 1)
    if image == "top rows apart":
        x = x + np.where(rows < 2, 40.0, 0.0)
    elif image == "gradient":
        x = x + np.linspace(-30.0, 30.0, shape[1]).reshape(1, -1, 1, 1)
    else:
        x[0, shape[1] // 2, shape[2] // 2, :] += 1e3
    x = x.astype(np.float32)
    num_groups = 2 if shape[-1] == 6 else 32
    y = fastln.group_norm(x, num_groups, channel_axis=-1)
    exact = reference.group_norm(x.astype(np.float64), num_groups, channel_axis=-1)
    assert np.abs(y - exact).max() <= 5e-7 * max(1.0, np.abs(exact).max())


@pytest.mark.parametrize("channel_axis, channels", [(1, 64), (-1, 64), (-1, 56)])
def test_streamed_output_holds_the_same_bits_as_ordinary_stores(channel_axis, channels):
    """Large inputs (from 12 MiB, in both layouts) write y with
    non-temporal stores where it is 16-byte aligned; the values are those of the ordinary
    stores (a y one element off that alignment). 56
    channels last end every row with fewer elements than a vector (streamed too)."""
    rng = np.random.default_rng(32)
    side = 256 if channels == 64 else 280  # 2 * channels * side**2 float32 values: >= 32 MiB
    shape = (2, channels, side, side) if channel_axis == 1 else (2, side, side, channels)
    assert np.prod(shape) * 4 >= 32 * 1024 * 1024
    x = (rng.standard_normal(shape) + 5.0).astype(np.float32)
    x.reshape(-1)[11] = np.nan
    x.reshape(-1)[channels * 7 + 50] = np.inf
    gamma = rng.standard_normal(channels).astype(np.float32)
    aligned = np.empty_like(x)
    misaligned = _one_element_off_a_line(x)
    num_groups = 32 if channels == 64 else 8
    for y in (aligned, misaligned):
        fastln.group_norm(x, num_groups, gamma, gamma, channel_axis=channel_axis, out=y)
    assert np.array_equal(aligned.view(np.uint32), misaligned.view(np.uint32))
    exact = reference.group_norm(x.astype(np.float64), num_groups, gamma, gamma,
                                 channel_axis=channel_axis)
    finite = np.isfinite(exact)
    assert np.array_equal(finite, np.isfinite(aligned))
    assert np.abs(aligned[finite] - exact[finite]).max() <= 1e-5 * np.abs(exact[finite]).max()


@pytest.mark.parametrize("dtype, groups", [(np.float32, 32), (np.float32, 2), (np.float64, 32)])
def test_streamed_backward_holds_the_same_bits_as_ordinary_stores(dtype, groups):
    """Channels first, a backward whose inputs reach 8 MiB writes dx with non-temporal stores
    where it is 16-byte aligned; dx, dgamma and dbeta are those of the ordinary stores (a dx one
    element off that alignment), by groups (32) and by pieces (2 groups of 4 MiB), also for
    a channel with a NaN in dy and one far from zero."""
    rng = np.random.default_rng(33)
    shape = (2, 64, 128, 128)
    assert np.prod(shape) * np.dtype(dtype).itemsize >= 8 * 1024 * 1024
    x = _input(rng, shape, 1, dtype)
    x[1, 8:12] += 1e4
    gamma, beta = random_params(rng, 64, dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    dy[0, 5, 17, 3] = np.nan
    _, cache = fastln.group_norm_forward(x, groups, gamma, beta)
    aligned = np.empty_like(x)
    misaligned = _one_element_off_a_line(x)
    results = [fastln.group_norm_backward(dy, cache, gamma, out=dx) for dx in (aligned, misaligned)]
    for a, b in zip(*results):
        assert_bitwise_equal(a, b)
    nan_group = 5 // (64 // groups)
    per_group = 64 // groups
    finite = np.ones(64, bool)
    finite[nan_group * per_group:(nan_group + 1) * per_group] = False
    assert np.isnan(aligned[0, ~finite]).all() and np.isfinite(aligned[0, finite]).all()
    dx_ref = reference.group_norm_backward(dy[1:], reference.group_norm_forward(
        x[1:], groups, gamma, beta)[1], gamma)[0]
    assert_close(aligned[1:], dx_ref)


def test_backward_fetching_dx_ahead_of_its_writes():
    """Channels first, a backward below dx streaming (8 MiB) whose dy, x and dx reach 16 MiB
    fetches each channel's dx lines while it sums: dx, dgamma and dbeta are bit for bit the
    same for 1 and 2 threads and in place of dy, a NaN stays in its group, and the rest is the
    float64 reference's."""
    rng = np.random.default_rng(38)
    shape = (8, 64, 56, 56)
    nbytes = np.prod(shape) * 4
    assert 3 * nbytes >= 16 * 1024 * 1024 and nbytes < 8 * 1024 * 1024
    x = _input(rng, shape, 1, np.float32)
    gamma, beta = random_params(rng, 64, np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    dy[2, 9, 40, 7] = np.nan
    _, cache = fastln.group_norm_forward(x, 32, gamma, beta)
    results = fastln.group_norm_backward(dy, cache, gamma, num_threads=1)
    in_place = dy.copy()
    for other in (fastln.group_norm_backward(dy, cache, gamma, num_threads=2),
                  fastln.group_norm_backward(in_place, cache, gamma, out=in_place)):
        for a, b in zip(other, results):
            assert_bitwise_equal(a, b)
    dx = results[0]
    assert np.isnan(dx[2, 8:10]).all()
    dx[2, 8:10] = 0.0
    assert np.isfinite(dx).all()
    exact = reference.group_norm_backward(
        np.delete(dy, 2, axis=0).astype(np.float64),
        reference.group_norm_forward(np.delete(x, 2, axis=0).astype(np.float64), 32,
                                     gamma.astype(np.float64), beta.astype(np.float64))[1],
        gamma.astype(np.float64))[0]
    assert_close(np.delete(dx, 2, axis=0), exact, dtype=np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_streamed_short_channels_hold_the_same_bits(dtype):
    """Channels first, channels of 14 x 14 values (784 bytes in float32: not whole cache lines)
    stream their last values too, forward from 12 MiB and backward from 8 MiB; y and dx are
    those of the ordinary stores (outputs one element off 16-byte alignment)."""
    rng = np.random.default_rng(36)
    shape = (64, 256, 14, 14)
    assert np.prod(shape) * np.dtype(dtype).itemsize >= 12 * 1024 * 1024
    x = _input(rng, shape, 1, dtype)
    gamma, beta = random_params(rng, 256, dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    misaligned = _one_element_off_a_line(x)
    aligned = np.empty_like(x)
    for y in (aligned, misaligned):
        fastln.group_norm(x, 32, gamma, beta, out=y)
    assert_bitwise_equal(aligned, misaligned)
    _, cache = fastln.group_norm_forward(x, 32, gamma, beta)
    results = [fastln.group_norm_backward(dy, cache, gamma, out=dx) for dx in (aligned, misaligned)]
    for a, b in zip(*results):
        assert_bitwise_equal(a, b)
    dx_ref = reference.group_norm_backward(dy[:2], reference.group_norm_forward(
        x[:2], 32, gamma, beta)[1], gamma)[0]
    assert_close(aligned[:2], dx_ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_streamed_channels_last_backward_holds_the_same_bits(dtype):
    """Channels last, a backward whose inputs reach 8 MiB writes dx with non-temporal stores
    (float32-compute types, rows 16-byte aligned): the same bits as a dx one element off that
    alignment, with a NaN in dy kept in its group."""
    rng = np.random.default_rng(34)
    shape = (2, 128, 128, 64)
    x = _input(rng, shape, -1, dtype)
    gamma, beta = random_params(rng, 64, dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    dy[0, 17, 3, 5] = np.nan  # channel 5: group 2 of 32
    _, cache = fastln.group_norm_forward(x, 32, gamma, beta, channel_axis=-1)
    aligned = np.empty_like(x)
    misaligned = _one_element_off_a_line(x)
    results = [fastln.group_norm_backward(dy, cache, gamma, out=dx) for dx in (aligned, misaligned)]
    for a, b in zip(*results):
        assert_bitwise_equal(a, b)
    assert np.isnan(aligned[0, ..., 4:6]).all()
    assert np.isfinite(aligned[0, ..., :4]).all() and np.isfinite(aligned[0, ..., 6:]).all()
    dx_ref = reference.group_norm_backward(dy[1:], reference.group_norm_forward(
        x[1:], 32, gamma, beta, channel_axis=-1)[1], gamma)[0]
    assert_close(aligned[1:], dx_ref)


@pytest.mark.parametrize("scale, eps", [(1e35, 1e-5), (1e-33, 0.0)])
def test_channels_last_backward_groups_beyond_float_rstd(scale, eps):
    """Channels last, float32: groups whose rstd a float cannot hold (beyond 1e30 or below 1e-30)
    are written in double, the sample's other groups in float, in the same rows; each sample's
    dx is the one it gets alone, and the reference's."""
    rng = np.random.default_rng(35)
    x = _input(rng, (2, 5, 7, 64), -1, np.float32)
    x[1, ..., 8:16] *= np.float32(scale)  # groups 4-7 of 32 in sample 1
    dy = rng.standard_normal(x.shape).astype(np.float32)
    gamma, beta = random_params(rng, 64, np.float32)
    _, cache = fastln.group_norm_forward(x, 32, gamma, beta, eps, channel_axis=-1)
    assert not (1e-30 < cache.rstd[1, 4] < 1e30) and 1e-30 < cache.rstd[1, 3] < 1e30
    dx, _, _ = fastln.group_norm_backward(dy, cache, gamma)
    _, alone = fastln.group_norm_forward(x[1:], 32, gamma, beta, eps, channel_axis=-1)
    assert_bitwise_equal(dx[1:], fastln.group_norm_backward(dy[1:], alone, gamma)[0])
    exact = reference.group_norm_backward(
        dy.astype(np.float64),
        reference.group_norm_forward(x.astype(np.float64), 32, gamma.astype(np.float64),
                                     beta.astype(np.float64), eps, channel_axis=-1)[1],
        gamma.astype(np.float64))[0]
    for n in range(2):
        assert np.abs(dx[n] - exact[n]).max() <= 1e-6 * np.abs(exact[n]).max()


# ---------------------------------------------------------------------------------------------
# float16 and bfloat16: the float32 computation on the widened values, rounded once
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("channel_axis", [1, -1])
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_is_the_float32_computation_rounded(channel_axis, half):
    dtype = np.dtype(np.float16) if half == "float16" else \
        np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    rng = np.random.default_rng(15)
    shape = (2, 6, 9, 9) if channel_axis == 1 else (2, 9, 9, 6)
    x = _input(rng, shape, channel_axis, np.float32).astype(dtype)
    gamma, beta = random_params(rng, 6, np.float32)
    dy = rng.standard_normal(shape).astype(dtype)
    y, cache, dx, dgamma, dbeta = _run(fastln, x, 3, gamma, beta, dy, channel_axis)
    wide = _run(fastln, x.astype(np.float32), 3, gamma, beta, dy.astype(np.float32),
                channel_axis)
    assert y.dtype == dx.dtype == dtype and dgamma.dtype == np.float32
    assert_bitwise_equal(y, wide[0].astype(dtype))
    assert_bitwise_equal(cache.rstd, wide[1].rstd)
    assert_bitwise_equal(dx, wide[2].astype(dtype))
    assert_bitwise_equal(dgamma, wide[3])
    assert_bitwise_equal(dbeta, wide[4])


# ---------------------------------------------------------------------------------------------
# Gradients: float64 finite differences
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("channel_axis", [1, -1])
def test_finite_differences(channel_axis):
    rng = np.random.default_rng(16)
    shape = (2, 4, 3) if channel_axis == 1 else (2, 3, 4)
    x = _input(rng, shape, channel_axis, np.float64)
    gamma, beta = random_params(rng, 4, np.float64)
    dy = rng.standard_normal(shape)

    def loss(x_, gamma_, beta_):
        return np.sum(fastln.group_norm(x_, 2, gamma_, beta_, channel_axis=channel_axis) * dy)

    _, cache = fastln.group_norm_forward(x, 2, gamma, beta, channel_axis=channel_axis)
    dx, dgamma, dbeta = fastln.group_norm_backward(dy, cache, gamma)
    step = 1e-6
    for analytic, array, which in ((dx, x, 0), (dgamma, gamma, 1), (dbeta, beta, 2)):
        numeric = np.zeros_like(array)
        for i in np.ndindex(array.shape):
            args = [x.copy(), gamma.copy(), beta.copy()]
            args[which][i] += step
            up = loss(*args)
            args[which][i] -= 2 * step
            numeric[i] = (up - loss(*args)) / (2 * step)
        assert_close(analytic, numeric, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Property tests against the reference
# ---------------------------------------------------------------------------------------------

def test_properties():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3),
                      st.lists(st.integers(1, 7), min_size=0, max_size=2),
                      st.sampled_from([1, -1]), st.sampled_from([np.float32, np.float64]),
                      st.integers(0, 2**32 - 1), st.sampled_from([0.0, 1e-5, 0.3]))
    def check(n, groups, per_group, spatial, channel_axis, dtype, seed, eps):
        rng = np.random.default_rng(seed)
        channels = groups * per_group
        shape = (n, channels, *spatial) if channel_axis == 1 else (n, *spatial, channels)
        x = _input(rng, shape, channel_axis, dtype, offset=float(rng.normal() * 100))
        gamma, beta = random_params(rng, channels, dtype)
        dy = rng.standard_normal(shape).astype(dtype)
        if eps == 0.0:
            x += rng.standard_normal(shape).astype(dtype)  # no constant groups with eps = 0
        got = _run(fastln, x, groups, gamma, beta, dy, channel_axis, eps=eps)
        expected = _run(reference, x, groups, gamma, beta, dy, channel_axis, eps=eps)
        tolerance = 1e-3 if dtype == np.float32 else 1e-9
        assert_close(got[0], expected[0], rtol=tolerance, atol=tolerance)
        for a, b in zip(got[2:], expected[2:]):
            assert_close(a, b, rtol=tolerance, atol=tolerance, scale=max(1.0, np.abs(b).max()))

    check()


# ---------------------------------------------------------------------------------------------
# PyTorch and ONNX
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape, num_groups", [((2, 8, 5, 6), 4), ((3, 6, 7), 3),
                                               ((1, 16, 3, 4, 5), 16), ((2, 4), 1)])
def test_matches_pytorch(shape, num_groups, channels_last):
    torch = pytest.importorskip("torch", reason="the PyTorch parity tests need torch")
    rng = np.random.default_rng(17)
    x = _input(rng, shape, 1, np.float64)
    gamma, beta = random_params(rng, shape[1], np.float64)
    dy = rng.standard_normal(shape)
    x_t = torch.tensor(x, requires_grad=True)
    gamma_t = torch.tensor(gamma, requires_grad=True)
    beta_t = torch.tensor(beta, requires_grad=True)
    y_t = torch.nn.functional.group_norm(x_t, num_groups, gamma_t, beta_t, 1e-5)
    y_t.backward(torch.tensor(dy))
    axis = -1 if channels_last else 1
    move = (lambda a: np.moveaxis(a, 1, -1)) if channels_last else (lambda a: a)
    y, cache = fastln.group_norm_forward(move(x), num_groups, gamma, beta, channel_axis=axis)
    dx, dgamma, dbeta = fastln.group_norm_backward(move(dy), cache, gamma)
    assert_close(y, move(y_t.detach().numpy()))
    assert_close(dx, move(x_t.grad.numpy()))
    assert_close(dgamma, gamma_t.grad.numpy())
    assert_close(dbeta, beta_t.grad.numpy())
    if num_groups == shape[1] and len(shape) > 2:
        y_i = torch.nn.functional.instance_norm(torch.tensor(x), weight=torch.tensor(gamma),
                                                bias=torch.tensor(beta), eps=1e-5)
        assert_close(fastln.instance_norm(move(x), gamma, beta, channel_axis=axis),
                     move(y_i.numpy()))


def test_onnx_group_normalization_cases():
    cases = onnx_node_cases("groupnormalization", "GroupNormalization")
    assert len(cases) >= 2
    for name, (x, scale, bias), (expected,), attributes in cases:
        y = fastln.group_norm(x, attributes["num_groups"], scale, bias,
                              attributes.get("epsilon", 1e-5))
        assert y.dtype == expected.dtype, name
        assert_close(y, expected, err_msg=name)


def test_onnx_instance_normalization_cases():
    cases = onnx_node_cases("instance_normalization", "InstanceNormalization")
    assert len(cases) >= 2
    for name, (x, scale, bias), (expected,), attributes in cases:
        y = fastln.instance_norm(x, scale, bias, attributes.get("epsilon", 1e-5))
        assert y.dtype == expected.dtype, name
        assert_close(y, expected, err_msg=name)


# ---------------------------------------------------------------------------------------------
# out=, in place
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("channel_axis", [1, -1])
def test_in_place(channel_axis):
    rng = np.random.default_rng(18)
    shape = (2, 4, 50, 50) if channel_axis == 1 else (2, 50, 50, 4)
    x = _input(rng, shape, channel_axis, np.float32)
    expected = fastln.group_norm(x, 2, channel_axis=channel_axis)
    work = x.copy()
    assert fastln.group_norm(work, 2, channel_axis=channel_axis, out=work) is work
    assert_bitwise_equal(work, expected)
    y, cache = fastln.group_norm_forward(x, 2, channel_axis=channel_axis)
    dy = rng.standard_normal(shape).astype(np.float32)
    dx_expected = fastln.group_norm_backward(dy, cache)[0]
    assert fastln.group_norm_backward(dy, cache, out=dy)[0] is dy
    assert_bitwise_equal(dy, dx_expected)


def test_empty_batch():
    y, cache = fastln.group_norm_forward(np.zeros((0, 4, 3), np.float32), 2)
    assert y.shape == (0, 4, 3) and cache.mean.shape == (0, 2)
    dx, dgamma, dbeta = fastln.group_norm_backward(np.zeros((0, 4, 3), np.float32), cache)
    assert dx.shape == (0, 4, 3)
    np.testing.assert_array_equal(dgamma, np.zeros(4, np.float32))


# ---------------------------------------------------------------------------------------------
# Errors: type, message naming the argument, before any work
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("module", [fastln, reference], ids=["fastln", "reference"])
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_groups=3), ValueError, "num_groups must be a positive int dividing the 4"),
    (dict(num_groups=0), ValueError, "num_groups"),
    (dict(num_groups=-2), ValueError, "num_groups"),
    (dict(num_groups=2.0), TypeError, "num_groups must be an int"),
    (dict(num_groups=True), TypeError, "num_groups must be an int, got a bool"),
    (dict(channel_axis=3), ValueError, "channel_axis must be 1"),
    (dict(channel_axis=0), ValueError, "channel_axis must be 1"),
    (dict(channel_axis="1"), TypeError, "channel_axis must be an int"),
    (dict(x=np.ones(4)), ValueError, "at least 2 dimensions"),
    (dict(x=np.ones((2, 4, 0))), ValueError, "nothing to normalize"),
    (dict(x=np.ones((2, 0, 3))), ValueError, "no channels"),
    (dict(x=np.ones((2, 4, 3), complex)), TypeError, "x has dtype complex128"),
    (dict(gamma=np.ones(3)), ValueError, r"gamma has shape \(3,\), expected \(C,\)"),
    (dict(beta=np.ones((4, 1))), ValueError, "beta has shape"),
    (dict(gamma=np.array(["a"] * 4)), TypeError, "gamma"),
    (dict(eps=-1.0), ValueError, "eps must be a finite number >= 0"),
    (dict(eps=np.nan), ValueError, "eps"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(out=np.zeros((2, 4, 2))), ValueError, "out has shape"),
    (dict(out=np.zeros((2, 4, 3), np.float32)), ValueError, "out has dtype"),
    (dict(out=[0.0]), TypeError, "out must be a numpy.ndarray"),
])
def test_errors(module, kwargs, error, match):
    arguments = dict(x=np.arange(24.0).reshape(2, 4, 3), num_groups=2)
    arguments.update(kwargs)
    snapshot = Snapshot(*arguments.values())
    x = arguments.pop("x")
    num_groups = arguments.pop("num_groups")
    with pytest.raises(error, match=match):
        module.group_norm(x, num_groups, **arguments)
    with pytest.raises(error, match=match):
        module.group_norm_forward(x, num_groups, **arguments)
    snapshot.assert_unchanged()


@pytest.mark.parametrize("module", [fastln, reference], ids=["fastln", "reference"])
def test_forward_out_must_not_overlap_x(module):
    x = np.arange(24.0).reshape(2, 4, 3)
    with pytest.raises(ValueError, match="group_norm_forward keeps x"):
        module.group_norm_forward(x, 2, out=x)
    with pytest.raises(ValueError, match="instance_norm_forward keeps x"):
        module.instance_norm_forward(x, out=x)


def _cache():
    x = np.arange(24.0).reshape(2, 4, 3) % 5
    return fastln.group_norm_forward(x, 2)[1]


def _forged(**fields):
    cache = _cache()
    values = {name: getattr(cache, name) for name in GroupNormCache_fields}
    values.update(fields)
    return fastln.GroupNormCache(**values)


GroupNormCache_fields = ("x", "mean", "rstd", "num_groups", "channel_axis", "eps", "dtype")


@pytest.mark.parametrize("module", [fastln, reference], ids=["fastln", "reference"])
@pytest.mark.parametrize("make, error, match", [
    (lambda: object(), TypeError, "cache must be the cache returned by group_norm_forward"),
    (lambda: fastln.layer_norm_forward(np.ones((2, 4, 3)))[1], ValueError,
     "cache comes from layer_norm_forward"),
    (lambda: _forged(num_groups=3), ValueError, "cache.num_groups"),
    (lambda: _forged(num_groups=4), ValueError, r"cache.mean has shape \(2, 2\), expected"),
    (lambda: _forged(num_groups=2.0), ValueError, "cache.num_groups must be an int"),
    (lambda: _forged(channel_axis=0), ValueError, "cache.channel_axis must be 1 or 2"),
    (lambda: _forged(channel_axis=True), ValueError, "cache.channel_axis"),
    (lambda: _forged(mean=np.zeros(2)), ValueError, "cache.mean has shape"),
    (lambda: _forged(rstd=[[1.0, 1.0]] * 2), ValueError, "cache.rstd must be a floating"),
    (lambda: _forged(eps=-1.0), ValueError, "cache.eps"),
    (lambda: _forged(dtype=np.dtype(np.float32)), ValueError, "cache.dtype"),
    (lambda: _forged(x=np.zeros((2, 4, 4))), ValueError, "dy has shape"),
])
def test_backward_checks_the_cache(module, make, error, match):
    dy = np.ones((2, 4, 3))
    with pytest.raises(error, match=match):
        module.group_norm_backward(dy, make())


@pytest.mark.parametrize("module", [fastln, reference], ids=["fastln", "reference"])
def test_backward_errors(module):
    cache = _cache()
    with pytest.raises(ValueError, match="dy has shape"):
        module.group_norm_backward(np.ones((2, 4, 2)), cache)
    with pytest.raises(ValueError, match="dy has dtype float32"):
        module.group_norm_backward(np.ones((2, 4, 3), np.float32), cache)
    with pytest.raises(ValueError, match="gamma has shape"):
        module.group_norm_backward(np.ones((2, 4, 3)), cache, np.ones(3))
    with pytest.raises(ValueError, match="instance_norm_backward needs one group per channel"):
        module.instance_norm_backward(np.ones((2, 4, 3)), cache)
    with pytest.raises(ValueError, match="instance_norm_backward needs the cache of "
                                         "instance_norm_forward"):
        module.instance_norm_backward(np.ones((2, 4)), fastln.rms_norm_forward(np.ones((2, 4)))[1])


# ---------------------------------------------------------------------------------------------
# fastln.nn and fastln.torch
# ---------------------------------------------------------------------------------------------

def test_nn_layers_load_torch_state_dicts():
    torch = pytest.importorskip("torch", reason="loading torch state dicts needs torch")
    import fastln.nn

    torch.manual_seed(0)
    x = torch.randn(2, 6, 5, 4)
    dy = np.random.default_rng(19).standard_normal(tuple(x.shape)).astype(np.float32)
    for theirs, ours in ((torch.nn.GroupNorm(3, 6), fastln.nn.GroupNorm(3, 6)),
                         (torch.nn.InstanceNorm2d(6, affine=True),
                          fastln.nn.InstanceNorm(6, affine=True))):
        with torch.no_grad():
            theirs.weight.normal_()
            theirs.bias.normal_()
        ours.load_state_dict({k: v.numpy() for k, v in theirs.state_dict().items()})
        x_t = x.clone().requires_grad_()
        y_t = theirs(x_t)
        y_t.backward(torch.from_numpy(dy))
        assert_close(ours(x.numpy()), y_t.detach().numpy(), dtype=np.float32)
        assert_close(ours.backward(dy), x_t.grad.numpy(), dtype=np.float32)
        assert_close(ours.weight_grad, theirs.weight.grad.numpy(), atol=1e-5, scale=40)
        assert_close(ours.bias_grad, theirs.bias.grad.numpy(), atol=1e-5, scale=40)
    plain = fastln.nn.InstanceNorm(6)
    assert plain.weight is None and plain.state_dict() == {}
    assert_close(plain(x.numpy()), torch.nn.functional.instance_norm(x).numpy())
    with pytest.raises(ValueError, match="num_groups must be a positive int dividing"):
        fastln.nn.GroupNorm(4, 6)
    with pytest.raises(ValueError, match=r"expects x.shape\[1\] = 6"):
        fastln.nn.GroupNorm(3, 6)(np.ones((2, 5, 3)))
    layer = fastln.nn.GroupNorm(2, 4, channel_axis=-1)
    x_last = np.random.default_rng(20).standard_normal((2, 3, 4)).astype(np.float32)
    assert_bitwise_equal(layer(x_last), fastln.group_norm(x_last, 2, np.ones(4, np.float32),
                                                          np.zeros(4, np.float32),
                                                          channel_axis=-1))


@pytest.mark.parametrize("memory_format", ["contiguous_format", "channels_last"])
def test_torch_drop_in(memory_format):
    torch = pytest.importorskip("torch", reason="fastln.torch needs torch")
    import fastln.torch

    torch.manual_seed(1)
    x = (torch.randn(2, 8, 5, 6, dtype=torch.float64) * 3 + 2).contiguous(
        memory_format=getattr(torch, memory_format)).requires_grad_()
    theirs = torch.nn.GroupNorm(4, 8).double()
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours = fastln.torch.GroupNorm(4, 8).double()
    ours.load_state_dict(theirs.state_dict())
    assert isinstance(ours, torch.nn.GroupNorm)
    dy = torch.randn(2, 8, 5, 6, dtype=torch.float64)
    y_theirs = theirs(x)
    y_theirs.backward(dy)
    grad_theirs = x.grad.clone()
    x.grad = None
    y_ours = ours(x)
    y_ours.backward(dy)
    assert_close(y_ours.detach().numpy(), y_theirs.detach().numpy())
    assert_close(x.grad.numpy(), grad_theirs.numpy())
    assert_close(ours.weight.grad.numpy(), theirs.weight.grad.numpy())
    assert_close(ours.bias.grad.numpy(), theirs.bias.grad.numpy())
    model = fastln.torch.patch(torch.nn.Sequential(torch.nn.GroupNorm(2, 4)))
    assert type(model[0]) is fastln.torch.GroupNorm
    assert type(fastln.torch.unpatch(model)[0]) is torch.nn.GroupNorm
    kept = fastln.torch.patch(torch.nn.Sequential(torch.nn.GroupNorm(2, 4)), group_norm=False)
    assert type(kept[0]) is torch.nn.GroupNorm
    inputs = (torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True),
              torch.randn(4, dtype=torch.float64, requires_grad=True),
              torch.randn(4, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda a, w, b: fastln.torch.group_norm(a, 2, w, b), inputs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_channels_last_groups_do_not_depend_on_a_rare_neighbour(dtype):
    """A constant group with eps = 0 takes the rare path; its sample's other groups keep the
    bits they have without it (they are written as every other sample's groups are)."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((2, 5, 6, 64)) + 100).astype(dtype)
    with_constant = x.copy()
    with_constant[0, ..., 8:16] = 3.0
    y = fastln.group_norm(x, 8, channel_axis=-1, eps=0.0)
    y_constant = fastln.group_norm(with_constant, 8, channel_axis=-1, eps=0.0)
    others = np.r_[0:8, 16:64]
    assert_bitwise_equal(y_constant[0][..., others], y[0][..., others])
    assert_bitwise_equal(y_constant[1], y[1])
    assert (y_constant[0][..., 8:16] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("spatial", [(7, 7), (16, 16), (32, 32), (5, 130)])
def test_results_do_not_depend_on_where_the_channels_start(rng, dtype, spatial):
    """The channels-first write pass takes each long channel's values up to y's next cache line
    apart from the rest (fastln/forward.h, gn_write) and its last values in one masked vector:
    y, in place or not, must be the bits of the same arrays starting on a line, whatever the
    element offset from one, also with Inf and NaN at a channel's first and last values."""
    shape = (2, 8) + spatial
    x = (1e3 + 50 * rng.standard_normal(shape)).astype(dtype)
    x[0, 1, 0, 0], x[1, 6, -1, -1], x[1, 2, 0, 1] = np.inf, np.nan, -np.inf
    gamma = rng.standard_normal(8).astype(np.float32)
    beta = rng.standard_normal(8).astype(np.float32)

    def run(offset, in_place):
        x_at = at_line_offset(x, offset)
        y = x_at if in_place else at_line_offset(np.zeros_like(x), offset)
        fastln.group_norm(x_at, 4, gamma, beta, out=y)
        return y.copy()

    with np.errstate(invalid="ignore"):
        expected = run(0, in_place=False)
        for offset in range(x.itemsize, 64, x.itemsize):
            for in_place in (False, True):
                assert_bitwise_equal(run(offset, in_place), expected, err_msg=f"offset {offset}")
