"""The float32 backward's row sums in float runs (include/fastln/backward.h).

LayerNorm's and RMSNorm's float32-compute backwards form their row sums in float: each of 32
slots adds 32 of its terms in float32, then that partial joins the slot's double total. The
accepted rule for them: the error does not depend on the row's offset; dx is within 1e-6 of the
row's largest gradient from a float64 computation on the same float32 inputs, dgamma and dbeta
within 1e-6 of their largest value; and the results stay bitwise deterministic. Rows whose
float sums could be off in other ways (non-finite sums, products below float's normal range)
are summed in double.
"""
import numpy as np
import pytest
from conftest import assert_bitwise_equal

import fastln

WIDTHS = (16, 33, 64, 777, 4096, 16384)


def float64_backward(op, x, dy, gamma):
    g64 = None if gamma is None else gamma.astype(np.float64)
    _, cache = getattr(fastln, f"{op}_forward")(x.astype(np.float64), g64)
    return getattr(fastln, f"{op}_backward")(dy.astype(np.float64), cache, g64)


def relative_errors(op, x, dy, gamma):
    """dx: the worst row's max|dx - dx64| / max|dx64|; the parameters': / max|.64|."""
    _, cache = getattr(fastln, f"{op}_forward")(x, gamma)
    results = getattr(fastln, f"{op}_backward")(dy, cache, gamma)
    exact = float64_backward(op, x, dy, gamma)
    dx, dx64 = results[0].astype(np.float64), exact[0]
    errors = [np.max(np.abs(dx - dx64).max(axis=1) / np.abs(dx64).max(axis=1))]
    for a, a64 in zip(results[1:], exact[1:]):
        errors.append(np.abs(a.astype(np.float64) - a64).max() / np.abs(a64).max())
    return errors


@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("n_cols", WIDTHS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_within_1e6_of_float64_at_every_offset(rng, op, n_cols, affine):
    n_rows = max(4, 65536 // n_cols)
    gamma = rng.standard_normal(n_cols).astype(np.float32) if affine else None
    offsets = (0.0, 1e3, 1e4, 1e5) if op == "layer_norm" else (0.0,)
    for offset in offsets:
        x = (offset + rng.standard_normal((n_rows, n_cols))).astype(np.float32)
        dy = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        for error in relative_errors(op, x, dy, gamma):
            assert error <= 1e-6, (offset, error)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_within_1e6_of_float64_over_32768_rows(rng, op):
    x = (1e4 + rng.standard_normal((32768, 16))).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    gamma = rng.standard_normal(16).astype(np.float32)
    for error in relative_errors(op, x, dy, gamma):
        assert error <= 1e-6


@pytest.mark.parametrize("n_cols", [17, 33, 777, 1000])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_gamma_none_gives_the_bits_of_ones_at_every_tail(rng, op, n_cols):
    """Without gamma the padded last block must still hold dy (a padding that dropped it would
    lose the tail's terms)."""
    x = rng.standard_normal((8, n_cols)).astype(np.float32)
    dy = rng.standard_normal((8, n_cols)).astype(np.float32)
    _, cache = getattr(fastln, f"{op}_forward")(x)
    backward = getattr(fastln, f"{op}_backward")
    for a, b in zip(backward(dy, cache), backward(dy, cache, np.ones(n_cols, np.float32))):
        assert_bitwise_equal(a, b)
    errors = relative_errors(op, x, dy, None)
    assert max(errors) <= 1e-6


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_tiny_products_are_summed_in_double(rng, op):
    """dy ~ 1e-25 against deviations of 1e-20 (eps = 0): dx_hat * (x - mean) is below float's
    normal range, where float products keep only a few bits; those rows take the double pass."""
    x = (1e-20 * rng.standard_normal((16, 300))).astype(np.float32)
    dy = (1e-25 * rng.standard_normal((16, 300))).astype(np.float32)
    forward = getattr(fastln, f"{op}_forward")
    _, cache = forward(x, eps=0.0)
    dx = getattr(fastln, f"{op}_backward")(dy, cache)[0]
    _, cache64 = forward(x.astype(np.float64), eps=0.0)
    dx64 = getattr(fastln, f"{op}_backward")(dy.astype(np.float64), cache64)[0]
    error = np.abs(dx - dx64).max(axis=1) / np.abs(dx64).max(axis=1)
    assert error.max() <= 1e-6


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_bits_do_not_depend_on_batch_or_threads(rng, op):
    x = (1e4 + rng.standard_normal((300, 777))).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    forward = getattr(fastln, f"{op}_forward")
    backward = getattr(fastln, f"{op}_backward")
    _, cache = forward(x)
    full = backward(dy, cache, num_threads=1)
    assert_bitwise_equal(full[0], backward(dy, cache, num_threads=2)[0])
    _, cache_part = forward(x[123:170])
    assert_bitwise_equal(full[0][123:170], backward(dy[123:170], cache_part)[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_rows", [2049, 2050])
def test_an_empty_last_row_block_adds_nothing(rng, dtype, n_rows):
    """2049 and 2050 rows take 64 row blocks of 33 rows: the last block has none. The blocks'
    partial sums are not zeroed before (each block's first fold of its float accumulators sets
    them), so the empty block must zero its own: a call of 2112 rows (64 full blocks) of the
    same width runs first, so that memory reused from it holds its last block's sums."""
    n_cols = 768
    gamma = rng.standard_normal(n_cols).astype(np.float32)
    big = (rng.standard_normal((2112, n_cols)) + 3).astype(dtype)
    _, big_cache = fastln.layer_norm_forward(big, gamma)
    x = (rng.standard_normal((n_rows, n_cols)) + 3).astype(dtype)
    dy = rng.standard_normal((n_rows, n_cols)).astype(dtype)
    _, cache = fastln.layer_norm_forward(x, gamma)
    results = []
    for _ in range(2):
        fastln.layer_norm_backward(big * 1e3, big_cache, gamma, num_threads=1)
        results.append(fastln.layer_norm_backward(dy, cache, gamma, num_threads=1))
    for first, again in zip(*results):
        assert_bitwise_equal(first, again)
    exact = float64_backward("layer_norm", x, dy, gamma)
    for got, want in zip(results[0][1:], exact[1:]):
        error = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert error < 1e-6
