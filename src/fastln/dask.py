"""fastln on Dask arrays: normalize arrays larger than memory, or spread over a cluster.

Dask is optional for fastln; this module needs ``dask[array]`` (and ``distributed`` for a
cluster): ``pip install "fastln[dask]"``. It is only imported when asked for.

Every function is lazy: it returns Dask arrays, built from one fastln call per block. The
normalized axes (``arr.shape[axis:]``) are first brought into a single chunk, since a row's
statistics need the whole row; the batch axes keep their chunks (unless the merged blocks would
exceed Dask's ``array.chunk-size``: then Dask rechunks them, ``"auto"``).

Guarantees
----------
- **Identical results.** fastln computes every row on its own, in a fixed order (batch
  invariance), so ``layer_norm`` / ``rms_norm`` of a Dask array are bitwise what fastln gives for
  the whole array at once, and so is the backward's ``dx``, for any chunking and any scheduler.
- **Deterministic reductions.** ``dgamma`` / ``dbeta`` (sums over all rows) are reduced as a
  tree: each block's partial sum, in float64, is added up along a tree whose shape depends only
  on the chunking. The result is the same for every run and every scheduler, and agrees with
  fastln on the whole array to float64 rounding of the partials (it is not bitwise the same as
  fastln's in-memory sum, whose blocks of rows differ).
- **Memory.** A worker holds a few blocks at a time; nothing of the size of the array is made.

Threads: each block runs on ``num_threads=1`` by default, because Dask already runs blocks in
parallel (one per worker thread); pass ``num_threads=None`` to use fastln's default inside
every block, e.g. with one single-threaded worker process per machine.
"""
from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

import fastln
from fastln._checks import (
    check_dy_dtype,
    check_eps,
    check_input,
    check_num_threads,
    check_param,
    compute_dtype,
    normalize_axis,
    output_dtype,
    refuse_masked,
)

if TYPE_CHECKING:  # pragma: no cover
    import dask.array
    from numpy.typing import ArrayLike

__all__ = ["layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward"]


def _dask_array() -> Any:
    try:
        import dask.array as da
    except ImportError as exc:  # pragma: no cover - exercised only without dask
        raise ImportError("fastln.dask needs Dask, which fastln does not install: "
                          'pip install "fastln[dask]" (or "dask[array]" distributed)') from exc
    return da


def _check_num_threads(num_threads: Optional[int]) -> Optional[int]:
    if num_threads is not None:
        check_num_threads(num_threads)  # the ValueError of fastln, before any work
    return num_threads


def _prepare(x: Any, name: str = "arr") -> tuple[Any, np.dtype]:
    """x as a Dask array (array_like is wrapped), and fastln's output dtype for it."""
    da = _dask_array()
    if not isinstance(x, da.Array):
        x = da.asarray(check_input(x, name)[0])
    elif isinstance(x._meta, np.ma.MaskedArray):  # its blocks are masked arrays
        refuse_masked(x._meta, name)
    dtype = output_dtype(x.dtype, name)
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least 1 dimension, got a 0-d array")
    return x, dtype


def _row_chunks(x: Any, axis: int) -> Any:
    """x with each row (x.shape[axis:]) inside one chunk.

    The batch axes keep their chunks, unless the merged blocks would exceed Dask's
    ``array.chunk-size``; then Dask picks them ("auto")."""
    if any(math.isnan(n) for n in x.shape[axis:]):
        raise ValueError("arr.shape[axis:] must be known: call arr.compute_chunk_sizes() first")
    if math.prod(x.shape[axis:]) == 0:
        raise ValueError(f"arr.shape[axis:] = {tuple(x.shape[axis:])} is empty: there is "
                         "nothing to normalize")
    if all(len(chunks) == 1 for chunks in x.chunks[axis:]):
        return x
    import dask
    from dask.utils import parse_bytes

    block_rows = math.prod(max(chunks, default=0) for chunks in x.chunks[:axis])
    block_bytes = block_rows * math.prod(x.shape[axis:]) * x.dtype.itemsize
    too_big = block_bytes > parse_bytes(dask.config.get("array.chunk-size"))
    new_chunks: dict[int, Any] = {i: "auto" if too_big else x.chunks[i] for i in range(axis)}
    new_chunks.update({i: -1 for i in range(axis, x.ndim)})
    return x.rechunk(new_chunks)


def _empty(ndim: int, dtype: np.dtype) -> np.ndarray:
    return np.empty((0,) * ndim, dtype)


def _forward_block(block: np.ndarray, *, rms: bool, gamma: Optional[np.ndarray],
                   beta: Optional[np.ndarray], eps: float, axis: int,
                   num_threads: Optional[int]) -> np.ndarray:
    if rms:
        return fastln.rms_norm(block, gamma, eps, axis=axis, num_threads=num_threads)
    return fastln.layer_norm(block, gamma, beta, eps, axis=axis, num_threads=num_threads)


def _forward(rms: bool, x: Any, gamma: Any, beta: Any, eps: float, axis: int,
             num_threads: Optional[int]) -> "dask.array.Array":
    x, dtype = _prepare(x)
    axis = normalize_axis(axis, x.ndim)
    x = _row_chunks(x, axis)
    params = compute_dtype(dtype)
    gamma = check_param(gamma, "gamma", x.shape[axis:], params)
    beta = None if rms else check_param(beta, "beta", x.shape[axis:], params)
    if gamma is not None:
        gamma = gamma.reshape(x.shape[axis:])
    if beta is not None:
        beta = beta.reshape(x.shape[axis:])
    eps = check_eps(eps)
    num_threads = _check_num_threads(num_threads)
    name = "fastln-rms-norm" if rms else "fastln-layer-norm"
    return x.map_blocks(_forward_block, rms=rms, gamma=gamma, beta=beta, eps=eps, axis=axis,
                        num_threads=num_threads, dtype=dtype, meta=_empty(x.ndim, dtype),
                        token=name)


def layer_norm(arr: "dask.array.Array | ArrayLike", gamma: "ArrayLike | None" = None,
               beta: "ArrayLike | None" = None, eps: float = 1e-5, *, axis: int = -1,
               num_threads: Optional[int] = 1) -> "dask.array.Array":
    """:func:`fastln.layer_norm` of a Dask array, block by block (lazy).

    Parameters
    ----------
    arr : dask.array.Array or array_like
        Chunked along the batch axes ``arr.shape[:axis]`` as you like; the normalized axes are
        brought into one chunk. dtypes as for :func:`fastln.layer_norm` (float16 and bfloat16
        included).
    gamma, beta : array_like of shape ``arr.shape[axis:]``, optional
        In memory (NumPy); sent along with every block's task.
    eps : float, default 1e-5
    axis : int, default -1
        The first normalized axis.
    num_threads : int or None, default 1
        fastln's threads inside each block (Dask runs the blocks in parallel already).

    Returns
    -------
    y : dask.array.Array
        arr's shape, fastln's output dtype; computing it gives bitwise what
        ``fastln.layer_norm(arr.compute(), ...)`` gives.

    Raises
    ------
    TypeError, ValueError
        fastln's argument errors, raised here (before anything is computed).

    Examples
    --------
    >>> import numpy as np, dask.array as da, fastln, fastln.dask
    >>> x = np.random.default_rng(0).standard_normal((1000, 64)).astype(np.float32)
    >>> y = fastln.dask.layer_norm(da.from_array(x, chunks=(100, 64)))
    >>> y
    dask.array<fastln-layer-norm, shape=(1000, 64), dtype=float32, chunksize=(100, 64), chunktype=numpy.ndarray>
    >>> bool((y.compute() == fastln.layer_norm(x)).all())
    True
    """
    return _forward(False, arr, gamma, beta, eps, axis, num_threads)


def rms_norm(arr: "dask.array.Array | ArrayLike", gamma: "ArrayLike | None" = None,
             eps: float = 1e-5, *, axis: int = -1,
             num_threads: Optional[int] = 1) -> "dask.array.Array":
    """:func:`fastln.rms_norm` of a Dask array, block by block (lazy).

    Parameters and guarantees as in :func:`layer_norm` (no beta).

    Returns
    -------
    y : dask.array.Array

    Examples
    --------
    >>> import numpy as np, dask.array as da, fastln, fastln.dask
    >>> x = np.random.default_rng(0).standard_normal((1000, 64))
    >>> y = fastln.dask.rms_norm(da.from_array(x, chunks=(250, 16)))   # columns get merged
    >>> y.chunks[1]
    (64,)
    >>> bool((y.compute() == fastln.rms_norm(x)).all())
    True
    """
    return _forward(True, arr, gamma, None, eps, axis, num_threads)


def _backward_block(dy: np.ndarray, x: np.ndarray, *, rms: bool, gamma: Optional[np.ndarray],
                    eps: float, axis: int, num_threads: Optional[int]) -> tuple[np.ndarray, ...]:
    """(dx, dgamma, dbeta) of one block; dgamma/dbeta as float64 partials with a leading
    length-1 axis per batch axis (so that they can be summed as a Dask array)."""
    sums: tuple[np.ndarray, ...]
    if rms:
        _, rms_cache = fastln.rms_norm_forward(x, gamma, eps, axis=axis, num_threads=num_threads)
        dx, dgamma = fastln.rms_norm_backward(dy, rms_cache, gamma, num_threads=num_threads)
        sums = (dgamma,)
    else:
        _, cache = fastln.layer_norm_forward(x, gamma, None, eps, axis=axis,
                                             num_threads=num_threads)
        dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, gamma,
                                                       num_threads=num_threads)
        sums = (dgamma, dbeta)
    lead = (1,) * axis
    return (dx,) + tuple(s.astype(np.float64).reshape(lead + s.shape) for s in sums)


def _backward(rms: bool, dy: Any, x: Any, gamma: Any, eps: float, axis: int,
              split_every: Optional[int], num_threads: Optional[int]) -> tuple[Any, ...]:
    da = _dask_array()
    x, dtype = _prepare(x)
    dy, _ = _prepare(dy, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {dy.shape}, expected arr.shape = {x.shape}")
    check_dy_dtype(dy, dtype)  # as fastln's backwards
    axis = normalize_axis(axis, x.ndim)
    x = _row_chunks(x, axis)
    dy = dy.astype(dtype).rechunk(x.chunks)
    params = compute_dtype(dtype)
    gamma = check_param(gamma, "gamma", x.shape[axis:], params)
    if gamma is not None:
        gamma = gamma.reshape(x.shape[axis:])
    eps = check_eps(eps)
    num_threads = _check_num_threads(num_threads)

    name = "fastln-rms-norm-backward" if rms else "fastln-layer-norm-backward"
    # One task per block computes all outputs of the block; the arrays below pick them apart.
    # (Its "blocks" are tuples, so it is never computed on its own.)
    per_block = da.map_blocks(_backward_block, dy, x, rms=rms, gamma=gamma, eps=eps, axis=axis,
                              num_threads=num_threads, dtype=dtype,
                              meta=_empty(x.ndim, np.dtype(object)), token=name)
    dx = per_block.map_blocks(operator.getitem, 0, dtype=dtype, meta=_empty(x.ndim, dtype),
                              token=name + "-dx")
    partial_chunks = tuple((1,) * n for n in x.numblocks[:axis]) + x.chunks[axis:]
    results = [dx]
    for index in range(1, 2 if rms else 3):
        partials = per_block.map_blocks(operator.getitem, index, chunks=partial_chunks,
                                        dtype=np.float64,
                                        meta=_empty(x.ndim, np.dtype(np.float64)),
                                        token=f"{name}-partials-{index}")
        total = partials.sum(axis=tuple(range(axis)), split_every=split_every)
        results.append(total.astype(params))
    return tuple(results)


def layer_norm_backward(dy: "dask.array.Array | ArrayLike", arr: "dask.array.Array | ArrayLike",
                        gamma: "ArrayLike | None" = None, eps: float = 1e-5, *, axis: int = -1,
                        split_every: Optional[int] = None,
                        num_threads: Optional[int] = 1) -> tuple["dask.array.Array", ...]:
    """Gradients of :func:`layer_norm` with respect to arr, gamma and beta (lazy).

    There is no cache to carry between Dask graphs: each block recomputes its rows' statistics
    from arr (one more read of the block), which gives exactly the statistics of the forward.

    Parameters
    ----------
    dy : dask.array.Array or array_like
        Gradient with respect to y: arr's shape (rechunked like arr).
    arr : dask.array.Array or array_like
        The forward's input.
    gamma : array_like of shape ``arr.shape[axis:]``, optional
        The forward's scale (None: ones).
    eps : float, default 1e-5
        The forward's eps.
    axis : int, default -1
    split_every : int, optional
        Fan-in of the tree that sums the blocks' dgamma/dbeta (Dask's default when None).
    num_threads : int or None, default 1

    Returns
    -------
    dx : dask.array.Array
        Bitwise what :func:`fastln.layer_norm_backward` gives on the whole array.
    dgamma, dbeta : dask.array.Array of shape ``arr.shape[axis:]``
        Tree sums of float64 block partials, in y's dtype (float32 for float16/bfloat16).
        Compute them together with dx (``dask.compute(dx, dgamma, dbeta)``): each block's
        backward then runs once.

    Examples
    --------
    >>> import dask, numpy as np, dask.array as da, fastln, fastln.dask
    >>> rng = np.random.default_rng(0)
    >>> x, dy = rng.standard_normal((2, 1000, 64))
    >>> dx, dgamma, dbeta = dask.compute(*fastln.dask.layer_norm_backward(
    ...     da.from_array(dy, chunks=(100, 64)), da.from_array(x, chunks=(100, 64))))
    >>> _, cache = fastln.layer_norm_forward(x)
    >>> expected = fastln.layer_norm_backward(dy, cache)
    >>> bool((dx == expected[0]).all()), bool(np.allclose(dgamma, expected[1], rtol=1e-13))
    (True, True)
    """
    return _backward(False, dy, arr, gamma, eps, axis, split_every, num_threads)


def rms_norm_backward(dy: "dask.array.Array | ArrayLike", arr: "dask.array.Array | ArrayLike",
                      gamma: "ArrayLike | None" = None, eps: float = 1e-5, *, axis: int = -1,
                      split_every: Optional[int] = None,
                      num_threads: Optional[int] = 1) -> tuple["dask.array.Array", ...]:
    """Gradients of :func:`rms_norm` with respect to arr and gamma (lazy): ``(dx, dgamma)``.

    Parameters, guarantees and costs as in :func:`layer_norm_backward`.

    Returns
    -------
    dx : dask.array.Array
    dgamma : dask.array.Array of shape ``arr.shape[axis:]``

    Examples
    --------
    >>> import dask, numpy as np, dask.array as da, fastln, fastln.dask
    >>> x = np.random.default_rng(0).standard_normal((400, 16))
    >>> lazy_x = da.from_array(x, chunks=(100, 16))
    >>> dx, dgamma = dask.compute(*fastln.dask.rms_norm_backward(lazy_x, lazy_x))
    >>> _, cache = fastln.rms_norm_forward(x)
    >>> bool((dx == fastln.rms_norm_backward(x, cache)[0]).all())
    True
    """
    return _backward(True, dy, arr, gamma, eps, axis, split_every, num_threads)
