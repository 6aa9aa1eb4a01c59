"""fastln.dask: layer_norm / rms_norm and their backwards on Dask arrays (skipped without dask).

The forward and dx are bitwise fastln's on the whole array (batch invariance); dgamma/dbeta are
deterministic tree sums that agree with fastln to rounding.
"""
import os

import numpy as np
import pytest
from conftest import assert_bitwise_equal, assert_close

da = pytest.importorskip("dask.array")
import dask  # noqa: E402

import fastln  # noqa: E402
import fastln.dask as fd  # noqa: E402

TIMEOUT = 60  # seconds for anything that waits on a cluster


def _data(rng, shape, dtype=np.float32):
    x = (rng.standard_normal(shape) * (1 + rng.random(shape[:1] + (1,) * (len(shape) - 1)))
         + 5 * rng.standard_normal(shape[:1] + (1,) * (len(shape) - 1)))
    return x.astype(dtype)


CHUNKINGS = [
    ((1000, 96), (128, 96), -1),       # rows in blocks, each row whole
    ((1000, 96), (300, 32), -1),       # rows split across chunks: merged first
    ((40, 6, 50), (7, 2, 25), 1),      # normalize the last two axes
    ((40, 6, 50), (40, 6, 50), 0),     # one row: everything
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("shape, chunks, axis", CHUNKINGS)
def test_forward_is_bitwise_fastln_on_the_whole_array(dtype, shape, chunks, axis, rng):
    x = _data(rng, shape, dtype)
    gamma = rng.standard_normal(shape[axis:]).astype(dtype)
    beta = rng.standard_normal(shape[axis:]).astype(dtype)
    lazy = fd.layer_norm(da.from_array(x, chunks=chunks), gamma, beta, axis=axis)
    assert lazy.dtype == np.dtype(dtype) and lazy.shape == x.shape
    assert all(len(c) == 1 for c in lazy.chunks[axis % x.ndim:])
    assert_bitwise_equal(lazy.compute(scheduler="threads"),
                         fastln.layer_norm(x, gamma, beta, axis=axis))
    lazy = fd.rms_norm(da.from_array(x, chunks=chunks), gamma, axis=axis, num_threads=None)
    assert_bitwise_equal(lazy.compute(scheduler="sync"), fastln.rms_norm(x, gamma, axis=axis))


def test_bfloat16_forward():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(3).standard_normal((300, 40)).astype(ml_dtypes.bfloat16)
    y = fd.layer_norm(da.from_array(x, chunks=(64, 40))).compute(scheduler="sync")
    assert y.dtype == x.dtype
    assert_bitwise_equal(y.view(np.uint16), fastln.layer_norm(x).view(np.uint16))


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("shape, chunks, axis", CHUNKINGS[:3])
def test_backward(rms, shape, chunks, axis, rng):
    x = _data(rng, shape)
    dy = _data(rng, shape)
    gamma = rng.standard_normal(shape[axis:]).astype(np.float32)
    x_lazy = da.from_array(x, chunks=chunks)
    dy_lazy = da.from_array(dy, chunks=chunks[::-1] if len(chunks) == 2 else chunks)
    if rms:
        lazy = fd.rms_norm_backward(dy_lazy, x_lazy, gamma, axis=axis, split_every=2)
        _, cache = fastln.rms_norm_forward(x, gamma, axis=axis)
        expected = fastln.rms_norm_backward(dy, cache, gamma)
    else:
        lazy = fd.layer_norm_backward(dy_lazy, x_lazy, gamma, axis=axis, split_every=2)
        _, cache = fastln.layer_norm_forward(x, gamma, axis=axis)
        expected = fastln.layer_norm_backward(dy, cache, gamma)
    assert len(lazy) == len(expected)
    computed = dask.compute(*lazy, scheduler="threads")
    assert_bitwise_equal(computed[0], expected[0])              # dx: bitwise
    for got, want in zip(computed[1:], expected[1:]):           # tree sums: to rounding
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_close(got, want, dtype=np.float32, rtol=1e-5)
    # Deterministic: the same bits again, with another scheduler.
    again = dask.compute(*lazy, scheduler="sync")
    for a, b in zip(computed, again):
        assert_bitwise_equal(a, b)


def test_backward_runs_each_block_once(rng):
    x = _data(rng, (400, 32))
    calls = []
    original = fd._backward_block

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    fd._backward_block = counting
    try:
        lazy = fd.layer_norm_backward(da.from_array(x, chunks=(100, 32)),
                                      da.from_array(x, chunks=(100, 32)))
        dask.compute(*lazy, scheduler="sync")
    finally:
        fd._backward_block = original
    assert len(calls) == 4


def test_errors_are_raised_before_computing(rng):
    x = da.from_array(_data(rng, (20, 8)), chunks=(5, 8))
    with pytest.raises(ValueError, match=r"gamma has shape \(7,\), expected"):
        fd.layer_norm(x, np.ones(7))
    with pytest.raises(ValueError, match="eps must be"):
        fd.rms_norm(x, eps=-1.0)
    with pytest.raises(ValueError, match="num_threads"):
        fd.layer_norm(x, num_threads=0)
    with pytest.raises(ValueError, match="axis 2 is out of bounds"):
        fd.layer_norm(x, axis=2)
    with pytest.raises(TypeError, match="arr has dtype complex128"):
        fd.layer_norm(x.astype(complex))
    with pytest.raises(ValueError, match="is empty"):
        fd.layer_norm(da.zeros((4, 0), chunks=(2, 0)))
    with pytest.raises(ValueError, match="dy has shape"):
        fd.layer_norm_backward(x[:10], x)
    for backward in (fd.layer_norm_backward, fd.rms_norm_backward):  # as fastln's: no cast
        with pytest.raises(ValueError, match="dy has dtype float64, expected float32"):
            backward(x.astype(np.float64), x)
        with pytest.raises(ValueError, match="dy has dtype int32, expected float32"):
            backward(x.astype(np.int32), x)
        backward(x.astype(">f4"), x)  # another byte order is the same dtype
        backward(x.astype(np.float64), x.astype(np.int64))  # integers compute in float64
    with pytest.raises(ValueError, match="^eps must be a finite number >= 0, got 1000"):
        fd.layer_norm(x, eps=10**400)
    with pytest.raises(TypeError, match="^axis must be an int, got a bool"):
        fd.rms_norm_backward(x, x, axis=True)


def test_numpy_input_and_the_issue_signature(rng):
    x = _data(rng, (50, 12))
    gamma, beta = np.full(12, 2.0, np.float32), np.full(12, 0.5, np.float32)
    lazy = fd.layer_norm(arr=x, gamma=gamma, beta=beta, eps=1e-5, axis=-1)
    assert_bitwise_equal(lazy.compute(), fastln.layer_norm(x, gamma, beta))
    assert_bitwise_equal(fd.rms_norm(arr=x).compute(), fastln.rms_norm(x))


def test_larger_than_memory_recipe_with_npy_files(tmp_path, rng):
    """The README's recipe: a .npy file on disk in, a .npy file on disk out."""
    x = _data(rng, (2000, 64))
    np.save(tmp_path / "x.npy", x)
    source = np.load(tmp_path / "x.npy", mmap_mode="r")          # nothing read yet
    y = fd.layer_norm(da.from_array(source, chunks=(256, -1)))
    target = np.lib.format.open_memmap(tmp_path / "y.npy", mode="w+", dtype=y.dtype,
                                       shape=y.shape)
    da.store(y, target, scheduler="threads")
    target.flush()
    del target
    assert_bitwise_equal(np.load(tmp_path / "y.npy"), fastln.layer_norm(x))


def test_larger_than_memory_recipe_with_zarr(tmp_path, rng):
    pytest.importorskip("zarr")
    x = _data(rng, (2000, 64))
    da.from_array(x, chunks=(256, 64)).to_zarr(str(tmp_path / "x.zarr"))
    y = fd.layer_norm(da.from_zarr(str(tmp_path / "x.zarr")))
    y.to_zarr(str(tmp_path / "y.zarr"))
    assert_bitwise_equal(da.from_zarr(str(tmp_path / "y.zarr")).compute(), fastln.layer_norm(x))


@pytest.fixture(scope="module", params=[False, True], ids=["threads", "processes"])
def cluster_client(request):
    """A LocalCluster of two single-threaded workers talking TCP over loopback only. Its nannies
    set MKL_NUM_THREADS and the like in this process's environment (for the workers they
    spawn); the environment is restored after, so later tests' subprocesses do not inherit them."""
    distributed = pytest.importorskip("distributed")
    environment = dict(os.environ)
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1,
                                       processes=request.param, protocol="tcp",
                                       host="127.0.0.1", dashboard_address=None,
                                       silence_logs=40)
    client = distributed.Client(cluster, timeout=TIMEOUT)
    try:
        yield client
    finally:
        client.close(timeout=TIMEOUT)
        cluster.close(timeout=TIMEOUT)
        os.environ.clear()
        os.environ.update(environment)


def test_local_cluster(cluster_client, rng):
    x = _data(rng, (3000, 128))
    dy = _data(rng, (3000, 128))
    gamma = rng.standard_normal(128).astype(np.float32)
    beta = rng.standard_normal(128).astype(np.float32)
    x_lazy = da.from_array(x, chunks=(250, 64))
    dy_lazy = da.from_array(dy, chunks=(500, 128))
    y = fd.layer_norm(x_lazy, gamma, beta)
    backward = fd.layer_norm_backward(dy_lazy, x_lazy, gamma)
    futures = cluster_client.compute([y, *backward])
    y_value, dx, dgamma, dbeta = [f.result(timeout=TIMEOUT) for f in futures]
    workers = cluster_client.scheduler_info()["workers"]
    assert len(workers) == 2 and all(w.startswith("tcp://127.0.0.1:") for w in workers)
    assert_bitwise_equal(y_value, fastln.layer_norm(x, gamma, beta))
    _, cache = fastln.layer_norm_forward(x, gamma, beta)
    expected = fastln.layer_norm_backward(dy, cache, gamma)
    assert_bitwise_equal(dx, expected[0])
    assert_close(dgamma, expected[1], rtol=1e-5)
    assert_close(dbeta, expected[2], rtol=1e-5)
    # The cluster's tree sums are the same bits as a local run's.
    local = dask.compute(*backward, scheduler="sync")
    assert_bitwise_equal(dgamma, local[1])
    assert_bitwise_equal(dbeta, local[2])
