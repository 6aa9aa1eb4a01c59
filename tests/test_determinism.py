"""Bitwise determinism: a row's y does not depend on its batch, its position or its address, and
y, dx, dgamma, dbeta do not depend on num_threads.

The shapes are big enough (>= 65536 elements, several blocks of rows in the backward) that the
kernels really split the work between threads.
"""
import numpy as np
import pytest

import fastln
from fastln import reference
from conftest import (BFLOAT16, DTYPES, HALF, LAYOUTS, assert_bitwise_equal, at_line_offset,
                      make_layout, needs_ml_dtypes, random_input, random_params)

BIG_SHAPES = [(2048, 256), (300, 1000), (1000, 67), (97, 1023)]
ALL_THREADS = (1, 2, 3, 4)


def _dtype_id(d):
    return np.dtype(d).name


def _shape_id(s):
    return "x".join(map(str, s))


@pytest.fixture(scope="module")
def big_inputs():
    """One set of inputs per (dtype, shape), shared by the tests of this module."""
    cache = {}

    def get(dtype, shape):
        key = (np.dtype(dtype).name, shape)
        if key not in cache:
            rng = np.random.default_rng(sum(shape) * 7 + len(key[0]))
            x = random_input(rng, shape, dtype)
            gamma, beta = random_params(rng, shape[-1:], dtype)
            dy = rng.standard_normal(shape).astype(dtype)
            cache[key] = (x, gamma, beta, dy)
        return cache[key]

    return get


# --------------------------------------------------------------------------------------------
# num_threads
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_params", [True, False], ids=["affine", "no_affine"])
@pytest.mark.parametrize("shape", BIG_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_thread_count_does_not_change_any_result(big_inputs, dtype, shape, with_params):
    x, gamma, beta, dy = big_inputs(dtype, shape)
    if not with_params:
        gamma = beta = None
    results = {}
    for t in ALL_THREADS + (None,):
        y, cache = fastln.layer_norm_forward(x, gamma, beta, num_threads=t)
        dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma, num_threads=t)
        results[t] = (y, cache.mean, cache.rstd, dx, dgamma, dbeta)
    names = ("y", "mean", "rstd", "dx", "dgamma", "dbeta")
    for t in ALL_THREADS[1:] + (None,):
        for name, a, b in zip(names, results[1], results[t]):
            assert_bitwise_equal(b, a, err_msg=f"{name}: num_threads={t} vs 1")
    # layer_norm too, and in place
    for t in ALL_THREADS:
        assert_bitwise_equal(fastln.layer_norm(x, gamma, beta, num_threads=t), results[1][0],
                             err_msg=f"layer_norm num_threads={t}")
    inplace = x.copy()
    fastln.layer_norm(inplace, gamma, beta, out=inplace, num_threads=3)
    assert_bitwise_equal(inplace, results[1][0], err_msg="in place, 3 threads")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_thread_count_with_other_axes(big_inputs, dtype):
    """3-D input normalized over the last two axes: the same bits for every thread count."""
    x, _, _, dy = big_inputs(dtype, (2048, 256))
    x3 = x.reshape(256, 8, 256)
    dy3 = dy.reshape(x3.shape)
    gamma, beta = random_params(np.random.default_rng(5), (8, 256), dtype)
    first = None
    for t in ALL_THREADS:
        y, cache = fastln.layer_norm_forward(x3, gamma, beta, axis=1, num_threads=t)
        grads = fastln.layer_norm_backward(dy3, cache, gamma, num_threads=t)
        current = (y,) + tuple(grads)
        if first is None:
            first = current
        else:
            for name, a, b in zip(("y", "dx", "dgamma", "dbeta"), first, current):
                assert_bitwise_equal(b, a, err_msg=f"{name} num_threads={t}")


def test_repeated_calls_are_identical(big_inputs):
    x, gamma, beta, dy = big_inputs(np.float32, (2048, 256))
    y0, cache = fastln.layer_norm_forward(x, gamma, beta, num_threads=2)
    g0 = fastln.layer_norm_backward(dy, cache, gamma, num_threads=2)
    for _ in range(3):
        y, cache = fastln.layer_norm_forward(x, gamma, beta, num_threads=2)
        assert_bitwise_equal(y, y0)
        for a, b in zip(fastln.layer_norm_backward(dy, cache, gamma, num_threads=2), g0):
            assert_bitwise_equal(a, b)


# --------------------------------------------------------------------------------------------
# Batch invariance: a row alone, in batches of any size, at any position, at any address
# --------------------------------------------------------------------------------------------

ROWS = (0, 1, 77, -1)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("shape", BIG_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_row_alone_equals_row_in_full_batch(big_inputs, dtype, shape, num_threads):
    x, gamma, beta, dy = big_inputs(dtype, shape)
    y, cache = fastln.layer_norm_forward(x, gamma, beta, num_threads=num_threads)
    dx = fastln.layer_norm_backward(dy, cache, gamma, num_threads=num_threads)[0]
    y_plain = fastln.layer_norm(x, num_threads=num_threads)
    for r in ROWS:
        r %= shape[0]
        y1, cache1 = fastln.layer_norm_forward(x[r:r + 1], gamma, beta)
        assert_bitwise_equal(y1[0], y[r], err_msg=f"y of row {r} alone (2-D)")
        assert_bitwise_equal(fastln.layer_norm(x[r], gamma, beta), y[r],
                             err_msg=f"y of row {r} alone (1-D)")
        assert_bitwise_equal(fastln.layer_norm(x[r]), y_plain[r], err_msg=f"row {r}, no affine")
        assert_bitwise_equal(cache1.mean[0], cache.mean[r], err_msg=f"mean of row {r}")
        assert_bitwise_equal(cache1.rstd[0], cache.rstd[r], err_msg=f"rstd of row {r}")
        dx1 = fastln.layer_norm_backward(dy[r:r + 1], cache1, gamma)[0]
        assert_bitwise_equal(dx1[0], dx[r], err_msg=f"dx of row {r} alone")


@pytest.mark.parametrize("batch_size", [1, 2, 3, 8, 17, 64, 300, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_row_at_every_position_of_batches_of_every_size(dtype, batch_size):
    h = 1000
    rng = np.random.default_rng(batch_size)
    row = random_input(rng, (1, h), dtype, offset=3.0)[0]
    gamma, beta = random_params(rng, (h,), dtype)
    expected = fastln.layer_norm(row, gamma, beta)
    positions = sorted({0, batch_size // 2, batch_size - 1})
    for pos in positions:
        batch = random_input(rng, (batch_size, h), dtype)
        batch[pos] = row
        for t in (1, 2):
            y = fastln.layer_norm(batch, gamma, beta, num_threads=t)
            assert_bitwise_equal(y[pos], expected,
                                 err_msg=f"row at {pos} of a batch of {batch_size}, {t} threads")


@pytest.mark.parametrize("offset", range(0, 17))
@pytest.mark.parametrize("h", [256, 1000, 1023])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_row_at_every_memory_alignment(dtype, h, offset):
    """The same row at `offset` elements into a buffer (so 4/8-byte steps through every 16-,
    32- and 64-byte alignment), alone and inside a batch view of the same buffer."""
    rng = np.random.default_rng(h)
    row = random_input(rng, (1, h), dtype, offset=-2.0)[0]
    gamma, beta = random_params(rng, (h,), dtype)
    expected = fastln.layer_norm(row.copy(), gamma, beta)
    expected_plain = fastln.layer_norm(row.copy())

    n = 300
    buf = random_input(rng, (n * h + 32,), dtype)
    batch = buf[offset:offset + n * h].reshape(n, h)
    batch[5] = row
    assert batch.flags.c_contiguous and batch.flags.aligned
    alone = buf[offset + 5 * h: offset + 6 * h]
    np.testing.assert_array_equal(alone, row)
    assert_bitwise_equal(fastln.layer_norm(alone, gamma, beta), expected, err_msg="alone")
    assert_bitwise_equal(fastln.layer_norm(alone), expected_plain, err_msg="alone, no affine")
    for t in (1, 2):
        y = fastln.layer_norm(batch, gamma, beta, num_threads=t)
        assert_bitwise_equal(y[5], expected, err_msg=f"in batch, {t} threads")
    # the output's alignment must not matter either
    out_buf = np.empty(n * h + 32, dtype)
    out = out_buf[(offset * 3) % 17:(offset * 3) % 17 + n * h].reshape(n, h)
    fastln.layer_norm(batch, gamma, beta, out=out, num_threads=2)
    assert_bitwise_equal(out[5], expected, err_msg="unaligned out")
    # and in place, at this alignment
    fastln.layer_norm(batch, gamma, beta, out=batch, num_threads=2)
    assert_bitwise_equal(batch[5], expected, err_msg="in place")


@pytest.mark.parametrize("h", [256, 1000, 1023])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_backward_at_every_output_alignment(dtype, h):
    """The write passes start each row's vector stores on a cache line (the elements before it
    go first, on their own): dx, dgamma and dbeta must be the same bits for dx at every offset
    into a buffer (4/8-byte steps through every 64-byte alignment), in place too. h = 256 rows
    are whole cache lines (the grouped pass splits them all alike), 1000 and 1023 are not."""
    rng = np.random.default_rng(h + 1)
    n = 37  # groups of 8 and a partial one
    x = random_input(rng, (n, h), dtype, offset=1.5)
    gamma, _ = random_params(rng, (h,), dtype)
    dy = rng.standard_normal((n, h)).astype(dtype)
    _, cache = fastln.layer_norm_forward(x, gamma)
    dx0, dgamma0, dbeta0 = fastln.layer_norm_backward(dy, cache, gamma)
    dx_row = fastln.layer_norm_backward(dy[9:10], fastln.layer_norm_forward(x[9:10], gamma)[1],
                                        gamma)[0]
    assert_bitwise_equal(dx_row[0], dx0[9], err_msg="row alone")
    out_buf = np.empty(n * h + 32, dtype)
    for offset in range(17):
        out = out_buf[offset:offset + n * h].reshape(n, h)
        dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma, out=out)
        assert_bitwise_equal(dx, dx0, err_msg=f"dx at offset {offset}")
        assert_bitwise_equal(dgamma, dgamma0, err_msg=f"dgamma at offset {offset}")
        assert_bitwise_equal(dbeta, dbeta0, err_msg=f"dbeta at offset {offset}")
        out[...] = dy  # in place: dx overwrites dy at this alignment
        dx_in = fastln.layer_norm_backward(out, cache, gamma, out=out)[0]
        assert_bitwise_equal(dx_in, dx0, err_msg=f"in place at offset {offset}")


@pytest.mark.parametrize("odd_row", ["zeros", "tiny"])
@pytest.mark.parametrize("n_cols", [768, 777])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_rms_norm_backward_group_falling_back_to_single_rows_gives_the_same_bits(
        dtype, n_cols, odd_row):
    """RMSNorm's backward writes rows in groups of 8 too; a group holding a row of Inf rstd (all
    zeros with eps = 0) or, in float32, one beyond the float32 pass (tiny values, rstd ~ 1e36)
    goes row by row. With dy = 0 that row adds exactly zero to dgamma, so the batch with it
    (its group row by row) and without it (every group grouped) must give the same dgamma and
    other rows' dx, bit for bit."""
    n_rows, odd = 11, 3
    rng = np.random.default_rng(29)
    x = random_input(rng, (n_rows, n_cols), dtype, offset=0.5)
    dy = rng.standard_normal((n_rows, n_cols)).astype(dtype)
    x[odd] = 0 if odd_row == "zeros" else (rng.standard_normal(n_cols) * 1e-36).astype(dtype)
    dy[odd] = 0
    gamma, _ = random_params(rng, (n_cols,), dtype)
    keep = np.arange(n_rows) != odd
    _, cache = fastln.rms_norm_forward(x, gamma, eps=0.0)
    assert cache.rstd[odd] > 1e30
    dx, dgamma = fastln.rms_norm_backward(dy, cache, gamma)
    _, cache_kept = fastln.rms_norm_forward(x[keep], gamma, eps=0.0)
    dx_kept, dgamma_kept = fastln.rms_norm_backward(dy[keep], cache_kept, gamma)
    assert_bitwise_equal(dx[keep], dx_kept, err_msg="dx")
    assert_bitwise_equal(dgamma, dgamma_kept, err_msg="dgamma")
    for row in (0, odd + 1, n_rows - 1):  # and each row alone (a group of one)
        _, cache_row = fastln.rms_norm_forward(x[row], gamma, eps=0.0)
        assert_bitwise_equal(fastln.rms_norm_backward(dy[row], cache_row, gamma)[0], dx[row],
                             err_msg=f"row {row} alone")


@pytest.mark.parametrize("n_cols", [768, 777])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_rms_norm_backward_rows_add_to_dgamma_in_row_order(dtype, n_cols):
    """Rows 8, 9 and 10 (one group, one block) share x and have dy = +1e9 v, -1e9 v, 1e-9 v,
    every other dy is 0: in row order dgamma is (P - P) + p = p, row 10's dgamma alone, bit for
    bit; any other order loses p against P (1e18 apart, beyond double's 53 bits)."""
    rng = np.random.default_rng(31)
    x = random_input(rng, (11, n_cols), dtype, offset=0.5)
    x[9] = x[10] = x[8]
    v = rng.standard_normal(n_cols)
    dy = np.zeros((11, n_cols), dtype)
    for row, scale in ((8, 1e9), (9, -1e9), (10, 1e-9)):
        dy[row] = (v * scale).astype(dtype)
    gamma, _ = random_params(rng, (n_cols,), dtype)
    _, cache = fastln.rms_norm_forward(x, gamma)
    _, dgamma = fastln.rms_norm_backward(dy, cache, gamma)
    _, cache_row = fastln.rms_norm_forward(x[10], gamma)
    _, dgamma_row = fastln.rms_norm_backward(dy[10], cache_row, gamma)
    assert np.all(dgamma_row != 0)
    assert_bitwise_equal(dgamma, dgamma_row)


@pytest.mark.parametrize("h", [256, 1000, 1023])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_rms_norm_at_every_output_alignment(dtype, h):
    """RMSNorm's write passes split each row at the output's first cache line as LayerNorm's
    do: y, dx and dgamma must be the same bits for the output at every offset into a buffer."""
    rng = np.random.default_rng(h + 2)
    n = 21
    x = random_input(rng, (n, h), dtype, offset=0.5)
    gamma, _ = random_params(rng, (h,), dtype)
    dy = rng.standard_normal((n, h)).astype(dtype)
    y0, cache = fastln.rms_norm_forward(x, gamma)
    dx0, dgamma0 = fastln.rms_norm_backward(dy, cache, gamma)
    out_buf = np.empty(n * h + 32, dtype)
    for offset in range(17):
        out = out_buf[offset:offset + n * h].reshape(n, h)
        assert_bitwise_equal(fastln.rms_norm(x, gamma, out=out), y0, err_msg=f"y at {offset}")
        dx, dgamma = fastln.rms_norm_backward(dy, cache, gamma, out=out)
        assert_bitwise_equal(dx, dx0, err_msg=f"dx at offset {offset}")
        assert_bitwise_equal(dgamma, dgamma0, err_msg=f"dgamma at offset {offset}")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_layout_does_not_change_the_bits(big_inputs, dtype, layout):
    """A strided, Fortran, byte-swapped... x holds the same numbers, so gives the same bits."""
    x, gamma, beta, dy = big_inputs(dtype, (300, 1000))
    y, cache = fastln.layer_norm_forward(x, gamma, beta, num_threads=2)
    grads = fastln.layer_norm_backward(dy, cache, gamma, num_threads=2)
    xl = make_layout(x, layout)
    y2, cache2 = fastln.layer_norm_forward(xl, gamma, beta, num_threads=2)
    grads2 = fastln.layer_norm_backward(make_layout(dy, layout), cache2, gamma, num_threads=2)
    assert_bitwise_equal(y2, y, err_msg="y")
    for name, a, b in zip(("dx", "dgamma", "dbeta"), grads2, grads):
        assert_bitwise_equal(a, b, err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_axis_spelling_does_not_change_the_bits(big_inputs, dtype):
    """(2048, 256) normalized over the last axis == (256, 8, 256) with axis=2 == (8, 256, 256)
    with axis=-1: the same rows, so the same bits."""
    x, gamma, beta, _ = big_inputs(dtype, (2048, 256))
    y = fastln.layer_norm(x, gamma, beta, num_threads=2)
    y3 = fastln.layer_norm(x.reshape(256, 8, 256), gamma, beta, axis=2, num_threads=3)
    assert_bitwise_equal(y3.reshape(y.shape), y)
    y4 = fastln.layer_norm(x.reshape(8, 256, 256), gamma, beta, axis=-1, num_threads=1)
    assert_bitwise_equal(y4.reshape(y.shape), y)


# --------------------------------------------------------------------------------------------
# Outputs beyond the cache: written with non-temporal stores, the same bits
# --------------------------------------------------------------------------------------------

STREAMING_BYTES = 32 * 1024 * 1024  # MIN_BYTES_FOR_STREAMING in src/fastln/_kernels.pyx


@pytest.mark.parametrize("in_place", [False, True], ids=["new_output", "in_place"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_streamed_outputs_equal_the_same_rows_in_a_small_batch(dtype, in_place):
    """y and dx of at least 32 MiB go out with non-temporal stores; a few rows of them, computed
    again in a small batch (ordinary stores), must give the same bits; so must dgamma/dbeta
    whether or not dx streams (in place: dx overwrites dy as it is written)."""
    n_cols = 4099  # not a multiple of the vector width: the row tails take the other store
    n_rows = STREAMING_BYTES // (np.dtype(dtype).itemsize * n_cols) + 1
    rng = np.random.default_rng(11)
    x = random_input(rng, (n_rows, n_cols), dtype, offset=5.0)
    gamma, beta = random_params(rng, (n_cols,), dtype)
    dy = rng.standard_normal((n_rows, n_cols)).astype(dtype)
    y, cache = fastln.layer_norm_forward(x, gamma, beta, num_threads=2)
    assert y.nbytes >= STREAMING_BYTES
    dy_in = dy.copy()
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy_in, cache, gamma, num_threads=2,
                                                   out=dy_in if in_place else None)
    assert (dx is dy_in) == in_place
    rows = np.array([0, 1, n_rows // 2, n_rows - 1])
    y_few, cache_few = fastln.layer_norm_forward(x[rows], gamma, beta)
    assert_bitwise_equal(y_few, y[rows], err_msg="y")
    dx_few = fastln.layer_norm_backward(dy[rows], cache_few, gamma)[0]
    assert_bitwise_equal(dx_few, dx[rows], err_msg="dx")
    # dgamma/dbeta do not depend on where dx went: a fresh dx and one thread give the same sums
    _, dgamma_again, dbeta_again = fastln.layer_norm_backward(dy, cache, gamma, num_threads=1)
    assert_bitwise_equal(dgamma_again, dgamma, err_msg="dgamma")
    assert_bitwise_equal(dbeta_again, dbeta, err_msg="dbeta")



STREAMED_DTYPES = HALF + [pytest.param(np.dtype(np.float32), id="float32"),
                          pytest.param(np.dtype(np.float64), id="float64")]


# rows that end at a different place in a line each time; rows shorter than two lines; rows of
# whole lines of at most 2 KiB (streamed whole from their first element when it is on 16 bytes)
N_COLS_STREAMED = [pytest.param(1000, id="1000_columns"), pytest.param(20, id="20_columns"),
                   pytest.param(512, id="512_columns")]


@pytest.mark.parametrize("n_cols", N_COLS_STREAMED)
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", STREAMED_DTYPES)
def test_streamed_rows_sharing_cache_lines_hold_their_own_bits(dtype, rms, backward, n_cols):
    """A streamed y (or dx) writes a line that two rows share once both rows are computed
    (fastln_shared_line). Every row of it, at every placement of the output against the cache
    lines, in place or not, on 1 and 2 threads, and beside rows taken on the rare paths (NaN,
    constant), must hold the bits the same rows get in small calls with ordinary stores; so must
    rows shorter than two lines, which a streamed call writes with ordinary stores, and short rows
    of whole lines, which it streams whole from their first element."""
    n_rows = STREAMING_BYTES // (dtype.itemsize * n_cols) + 3
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((n_rows, n_cols)) * 2 + 3).astype(dtype)
    x[[5, n_rows // 2]] = np.nan
    x[[6, n_rows - 2]] = 1.5
    dy = rng.standard_normal((n_rows, n_cols)).astype(dtype)
    dy[n_rows // 3] = np.inf
    gamma = rng.standard_normal(n_cols).astype(dtype)
    beta = rng.standard_normal(n_cols).astype(dtype)

    def compute(rows, source, out=None, num_threads=1):
        """y of source (x's rows), or dx of source (dy's rows); out may be source (in place)."""
        if rms:
            if not backward:
                return fastln.rms_norm(source, gamma, out=out, num_threads=num_threads)
            _, cache = fastln.rms_norm_forward(x[rows], gamma)
            return fastln.rms_norm_backward(source, cache, gamma, out=out,
                                            num_threads=num_threads)[0]
        if not backward:
            return fastln.layer_norm(source, gamma, beta, out=out, num_threads=num_threads)
        _, cache = fastln.layer_norm_forward(x[rows], gamma, beta)
        return fastln.layer_norm_backward(source, cache, gamma, out=out,
                                          num_threads=num_threads)[0]

    inputs = dy if backward else x
    expected = np.concatenate([compute(slice(r, r + 256), inputs[r:r + 256])
                               for r in range(0, n_rows, 256)])
    assert expected.nbytes >= STREAMING_BYTES
    for offset, in_place, num_threads in [(0, False, 1), (16, False, 1), (48, True, 2),
                                          (2 * dtype.itemsize, False, 2)]:
        source = at_line_offset(inputs, offset)
        out = source if in_place else at_line_offset(np.zeros_like(inputs), offset)
        compute(slice(None), source, out=out, num_threads=num_threads)
        assert_bitwise_equal(out, expected,
                             err_msg=f"offset {offset}, in place {in_place}, {num_threads} threads")


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_float32_backward_beyond_the_cache_takes_rows_alone_with_the_same_bits(rms):
    """A float32 backward whose dy, x and dx reach 32 MiB takes its rows one at a time (rows
    of at most 8 KiB, dx not streamed: 1000 columns, 12 MB of dx); the same rows in a small
    batch, written in groups, give the same dx bits, and 1 and 2 threads the same dgamma."""
    n_cols = 1000
    n_rows = STREAMING_BYTES // (3 * 4 * n_cols) + 7
    rng = np.random.default_rng(12)
    x = random_input(rng, (n_rows, n_cols), np.float32, offset=5.0)
    gamma, beta = random_params(rng, (n_cols,), np.float32)
    dy = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    assert 3 * x.nbytes >= STREAMING_BYTES > x.nbytes
    results = _backward_bits_hold(rms, x, gamma, beta, dy,
                                  np.array([0, 1, 2, 3, 4, n_rows // 2, n_rows - 1]))
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    exact = (reference.rms_norm_backward(dy64, reference.rms_norm_forward(x64, gamma)[1], gamma)
             if rms else reference.layer_norm_backward(
                 dy64, reference.layer_norm_forward(x64, gamma, beta)[1], gamma))
    for got, want in zip(results, exact):
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def _backward_bits_hold(rms, x, gamma, beta, dy, rows):
    """The row backward of x and dy with 1 and 2 threads gives the same bits, and the given rows
    in a small batch of their own the same dx bits; returns the 1-thread results."""
    forward = fastln.rms_norm_forward if rms else fastln.layer_norm_forward
    backward = fastln.rms_norm_backward if rms else fastln.layer_norm_backward
    params = (gamma,) if rms else (gamma, beta)
    _, cache = forward(x, *params)
    results = [backward(dy, cache, gamma, num_threads=t) for t in (1, 2)]
    for one, two in zip(*results):
        assert_bitwise_equal(one, two)
    _, cache_few = forward(x[rows], *params)
    dx_few = backward(dy[rows], cache_few, gamma)[0]
    assert_bitwise_equal(dx_few, results[0][0][rows], err_msg="dx")
    return results[0]


FETCHING_BYTES = 12 * 1024 * 1024  # BACKWARD_MIN_BYTES_FOR_FETCHING in src/fastln/_kernels.pyx


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype, n_cols, reach, line_offset", [
    pytest.param(np.float32, 1000, FETCHING_BYTES, None, id="float32"),
    pytest.param(np.float64, 1000, FETCHING_BYTES, None, id="float64"),
    pytest.param(np.float16, 1000, FETCHING_BYTES, None, id="float16"),
    pytest.param(BFLOAT16, 1000, FETCHING_BYTES, None, id="bfloat16", marks=needs_ml_dtypes),
    pytest.param(np.float32, 1024, STREAMING_BYTES, None, id="float32-rows-alone"),
    pytest.param(np.float32, 768, STREAMING_BYTES, (16, 48), id="float32-rows-alone-off-lines")])
def test_backward_fetching_the_next_rows_keeps_the_bits(rms, dtype, n_cols, reach, line_offset):
    """A backward whose dy, x and dx reach 12 MiB fetches the next rows' lines while it writes
    each group (float32 rows taken alone, from 32 MiB: the next two rows, for rows of 1536 bytes
    and more); the same rows in a small batch, where nothing is fetched, give the same dx bits,
    and 1 and 2 threads the same dgamma (and dbeta). dy, x and dx together just reach `reach`.
    line_offset: x and dy placed that many bytes past a cache line (rows that span one line more
    than the write pass's steps, whose last line is fetched apart)."""
    itemsize = np.dtype(dtype).itemsize
    n_rows = reach // (3 * itemsize * n_cols) + 5
    rng = np.random.default_rng(21)
    x = random_input(rng, (n_rows, n_cols), dtype, offset=3.0)
    param = np.float64 if dtype == np.float64 else np.float32
    gamma, beta = random_params(rng, (n_cols,), param)
    dy = rng.standard_normal((n_rows, n_cols)).astype(dtype)
    if line_offset is not None:
        x, dy = at_line_offset(x, line_offset[0]), at_line_offset(dy, line_offset[1])
    assert 3 * x.nbytes >= FETCHING_BYTES and x.nbytes < STREAMING_BYTES
    _backward_bits_hold(rms, x, gamma, beta, dy,
                        np.array([0, 1, 2, 3, 4, 5, n_rows // 2, n_rows - 2, n_rows - 1]))


# --------------------------------------------------------------------------------------------
# The backward's grouped write pass and its row-by-row fallback: the same bits
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_backward_group_falling_back_to_single_rows_gives_the_same_bits(dtype):
    """The backward writes rows in groups of 8 (one load and store of each dgamma/dbeta
    accumulator per group); a group holding a row the vector pass does not take goes row by row.
    A row of tiny values with eps = 0 (rstd ~ 1e36: beyond the float32 pass) and dy = 0 (its
    products are exact zeros: a float64 group falls back too) adds exactly zero to dgamma and
    dbeta, so the batch with it (first group row by row) and the batch without it (every group
    grouped) must give the same dgamma, dbeta and other rows' dx, bit for bit: the row-by-row
    order of the accumulations is the grouped pass's."""
    n_rows, n_cols, odd = 11, 777, 3  # 777: the rows have a tail beyond the vector width
    rng = np.random.default_rng(23)
    x = random_input(rng, (n_rows, n_cols), dtype, offset=2.0)
    dy = rng.standard_normal((n_rows, n_cols)).astype(dtype)
    x[odd] = (rng.standard_normal(n_cols) * 1e-36).astype(dtype)
    dy[odd] = 0
    gamma, beta = random_params(rng, (n_cols,), dtype)
    keep = np.arange(n_rows) != odd
    _, cache = fastln.layer_norm_forward(x, gamma, beta, eps=0.0)
    assert cache.rstd[odd] > 1e30
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma)
    _, cache_kept = fastln.layer_norm_forward(x[keep], gamma, beta, eps=0.0)
    dx_kept, dgamma_kept, dbeta_kept = fastln.layer_norm_backward(dy[keep], cache_kept, gamma)
    assert_bitwise_equal(dx[keep], dx_kept, err_msg="dx")
    assert_bitwise_equal(dgamma, dgamma_kept, err_msg="dgamma")
    assert_bitwise_equal(dbeta, dbeta_kept, err_msg="dbeta")
    assert np.all(dx[odd] == 0)
