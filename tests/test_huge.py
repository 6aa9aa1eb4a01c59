"""Arrays over 2**31 elements (issue 7): 64-bit indexing all the way down.

One float32 array of 2**31 + 17 elements (8 GiB; 1,393,565 rows of 1,541 - both odd, so the
vector loops' remainders run too), normalized in place by layer_norm, rms_norm and batch_norm,
then a layer_norm backward in place on a second array of the same size. A sample of rows -
the first, the last, the rows around element 2**31 and random ones - is checked against
``fastln.reference``; the parameter gradients (sums over every row) against a float64 NumPy
computation in chunks.

Marked slow, and skipped unless asked for (``-m slow``, or FASTLN_RUN_SLOW=1) and unless the
machine has the memory: 9 GiB for the forwards, 17 GiB for the backward. Run with ``-s`` to
print the runtime and peak memory.
"""
import gc
import os
import resource
import time

import numpy as np
import pytest

import fastln
import fastln.reference as ref
from conftest import assert_close

pytestmark = pytest.mark.slow

N_ELEMENTS = 2**31 + 17
N_COLS = 1541                      # 2**31 + 17 = 1541 * 1393565
N_ROWS = N_ELEMENTS // N_COLS
GIB = 1 << 30
CHUNK_ROWS = 1 << 14


def available_memory():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(autouse=True)
def only_when_asked(request):
    asked = "slow" in (request.config.getoption("-m") or "") or os.environ.get("FASTLN_RUN_SLOW")
    if not asked:
        pytest.skip("slow: run with -m slow (or FASTLN_RUN_SLOW=1)")


def need(n_bytes):
    gc.collect()
    if available_memory() < n_bytes:
        pytest.skip(f"needs {n_bytes / GIB:.1f} GiB of free memory, "
                    f"{available_memory() / GIB:.1f} GiB available")


def fill(array, seed):
    """Deterministic values, a different offset and spread in every row, chunk by chunk."""
    rng = np.random.default_rng(seed)
    for start in range(0, array.shape[0], CHUNK_ROWS):
        block = array[start:start + CHUNK_ROWS]
        rng.random(out=block, dtype=np.float32)
        rows = np.arange(start, start + block.shape[0], dtype=np.float32)[:, None]
        block *= 1.0 + rows % 5
        block += rows % 11 - 5


def sample_rows():
    """Rows to check: the ends, the rows holding elements 2**31 - 1 and 2**31 (the last row:
    its last 17 elements have indices >= 2**31), and random ones."""
    rows = {0, 1, (2**31 - 1) // N_COLS, 2**31 // N_COLS, N_ROWS - 2, N_ROWS - 1}
    assert 2**31 // N_COLS == N_ROWS - 1
    rng = np.random.default_rng(3)
    rows.update(int(r) for r in rng.integers(0, N_ROWS, 24))
    return np.array(sorted(rows))


def report(name, start):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\n[huge] {name}: {time.perf_counter() - start:.1f} s, peak RSS {peak / GIB:.2f} GiB")


def test_forwards_in_place_on_more_than_2_31_elements():
    need(9 * GIB)
    start = time.perf_counter()
    x = np.empty((N_ROWS, N_COLS), np.float32)
    assert x.size == N_ELEMENTS > 2**31
    fill(x, seed=0)
    rows = sample_rows()
    rng = np.random.default_rng(4)
    gamma = (0.5 + rng.random(N_COLS)).astype(np.float32)
    beta = rng.standard_normal(N_COLS).astype(np.float32)

    before = x[rows].copy()
    assert fastln.layer_norm(x, gamma, beta, out=x) is x
    assert_close(x[rows], ref.layer_norm(before, gamma, beta), err_msg="layer_norm")

    before = x[rows].copy()
    assert fastln.rms_norm(x, gamma, out=x) is x
    assert_close(x[rows], ref.rms_norm(before, gamma), err_msg="rms_norm")

    # BatchNorm: three features, each over all 1.4 million rows, against the reference
    features = [0, N_COLS // 2, N_COLS - 1]
    columns = x[:, features].copy()
    running_mean, running_var = np.zeros(N_COLS), np.ones(N_COLS)
    assert fastln.batch_norm(x, gamma, beta, running_mean, running_var, training=True,
                             momentum=0.5, out=x) is x
    expected_mean, expected_var = np.zeros(3), np.ones(3)
    expected = ref.batch_norm(columns, gamma[features], beta[features], expected_mean,
                              expected_var, training=True, momentum=0.5)
    assert_close(x[:, features], expected, err_msg="batch_norm")
    assert_close(running_mean[features], expected_mean, err_msg="running_mean")
    assert_close(running_var[features], expected_var, err_msg="running_var")
    report("layer_norm + rms_norm + batch_norm in place on 2**31 + 17 float32", start)


def test_layer_norm_backward_in_place_on_more_than_2_31_elements():
    need(17 * GIB)
    start = time.perf_counter()
    x = np.empty((N_ROWS, N_COLS), np.float32)
    fill(x, seed=1)
    buffer = np.empty_like(x)
    gamma = np.linspace(0.5, 1.5, N_COLS, dtype=np.float32)
    # the forward writes y into `buffer` (y itself is not needed), keeping only the cache
    _, cache = fastln.layer_norm_forward(x, gamma, out=buffer)
    dy = buffer
    fill(dy, seed=2)
    rows = sample_rows()
    x_rows, dy_rows = x[rows].copy(), dy[rows].copy()
    dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma, out=dy)
    assert dx is dy

    _, cache_rows = ref.layer_norm_forward(x_rows, gamma)
    dx_rows = ref.layer_norm_backward(dy_rows, cache_rows, gamma)[0]
    assert_close(cache.mean[rows], cache_rows.mean, err_msg="mean")
    assert_close(cache.rstd[rows], cache_rows.rstd, err_msg="rstd")
    assert_close(dx[rows], dx_rows, scale=float(np.abs(dx_rows).max()) * 10, err_msg="dx")
    del dx, dy, buffer
    gc.collect()

    # dgamma and dbeta sum every row: recompute them in float64, chunk by chunk (dy again)
    rng_dy = np.empty((CHUNK_ROWS, N_COLS), np.float32)
    expected_dgamma = np.zeros(N_COLS)
    expected_dbeta = np.zeros(N_COLS)
    abs_sum = np.zeros(N_COLS)
    dy_generator = np.random.default_rng(2)
    for first in range(0, N_ROWS, CHUNK_ROWS):
        block = x[first:first + CHUNK_ROWS].astype(np.float64)
        dy_block = rng_dy[:block.shape[0]]
        dy_generator.random(out=dy_block, dtype=np.float32)
        row_index = np.arange(first, first + block.shape[0], dtype=np.float32)[:, None]
        dy_block *= 1.0 + row_index % 5
        dy_block += row_index % 11 - 5
        mean = block.mean(axis=1, keepdims=True)
        rstd = 1.0 / np.sqrt(block.var(axis=1, keepdims=True) + 1e-5)
        expected_dgamma += (dy_block * ((block - mean) * rstd)).sum(axis=0)
        expected_dbeta += dy_block.sum(axis=0, dtype=np.float64)
        abs_sum += np.abs(dy_block).sum(axis=0, dtype=np.float64)
    # float32 results of sums over 1.4 million rows: relative to the sum of |terms|
    np.testing.assert_allclose(dbeta, expected_dbeta, rtol=2e-5, atol=float(abs_sum.max()) * 1e-6)
    np.testing.assert_allclose(dgamma, expected_dgamma, rtol=2e-5,
                               atol=float(abs_sum.max()) * 4e-6)
    report("layer_norm forward + backward in place on 2**31 + 17 float32", start)
