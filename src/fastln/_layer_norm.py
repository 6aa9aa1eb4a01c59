"""fastln.layer_norm and its forward/backward pair: checking here, arithmetic in the kernels."""
from typing import NamedTuple

import numpy as np

from fastln import _kernels
from fastln._caches import LayerNormCache, check_cache
from fastln._checks import (
    as_array,
    as_kernel_array,
    check_eps,
    check_input,
    check_out,
    check_out_keeps_x,
    check_param,
    compute_dtype,
    normalize_axis,
    protect_from_output,
    rows_and_cols,
)
from fastln._output_cache import empty_output
from fastln._threads import resolve_num_threads


def _forward(x, gamma, beta, eps, axis, out, num_threads, keep_cache):
    x, dtype = check_input(x, allow_half=True)
    stats_dtype = compute_dtype(dtype)  # float32 for float16/bfloat16 x, else dtype
    axis = normalize_axis(axis, x.ndim)
    n_rows, n_cols = rows_and_cols(x.shape, axis)
    normalized_shape = x.shape[axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, stats_dtype)
    beta = check_param(beta, "beta", normalized_shape, stats_dtype)
    eps = check_eps(eps)
    num_threads = resolve_num_threads(num_threads)

    x_rows = as_kernel_array(x, dtype).reshape(n_rows, n_cols)
    if out is None:
        y = empty_output(x.shape, dtype)
    else:
        y = check_out(out, x.shape, dtype)
        if keep_cache:
            check_out_keeps_x(y, x)
    y_rows = y.reshape(n_rows, n_cols)
    x_rows = protect_from_output(x_rows, y_rows)
    gamma = protect_from_output(gamma, y_rows)
    beta = protect_from_output(beta, y_rows)

    mean = rstd = None
    if keep_cache:
        mean = np.empty(n_rows, stats_dtype)
        rstd = np.empty(n_rows, stats_dtype)
    _kernels.layer_norm_forward(x_rows, gamma, beta, y_rows, mean, rstd, eps,
                                _kernels.storage_code(dtype), num_threads)
    result = y if out is None else out  # y is a plain view of a subclass's out: return out
    if not keep_cache:
        return result
    batch_shape = x.shape[:axis]
    return result, LayerNormCache(x, mean.reshape(batch_shape), rstd.reshape(batch_shape), axis,
                                  eps, dtype)


def layer_norm(x, gamma=None, beta=None, eps=1e-5, *, axis=-1, out=None, num_threads=None):
    """Layer normalization: ``gamma * (x - mean) / sqrt(var + eps) + beta`` for each row.

    Statistics (mean and population variance) are taken over ``x.shape[axis:]``, once for each
    index of ``x.shape[:axis]``, as in ONNX ``LayerNormalization``.

    Parameters
    ----------
    x : array_like
        float32 and float64 are computed as they are; integer and bool as float64. float16 and
        bfloat16 (``ml_dtypes``) are computed in float32 row by row (no full-size float32 copy)
        and returned in their own format. Any strides, order or byte order.
    gamma, beta : array_like of shape ``x.shape[axis:]``, optional
        Scale and shift, cast to the output dtype (to float32 for float16/bfloat16 x); None
        means ones and zeros.
    eps : float, default 1e-5
        Added to the variance; a finite number >= 0.
    axis : int, default -1
        The first normalized axis.
    out : ndarray, optional
        C-contiguous, shape ``x.shape``, the output dtype. May be ``x`` itself (in place).
    num_threads : int, optional
        OpenMP threads; None uses OpenMP's default (``OMP_NUM_THREADS``).

    Returns
    -------
    y : ndarray of x's shape (``out`` when given)

    Examples
    --------
    >>> import numpy as np, fastln
    >>> fastln.layer_norm(np.array([10.0, 20.0, 60.0])).round(4)
    array([-0.9258, -0.4629,  1.3887])
    """
    y = _kernels.layer_norm_forward_fast(x, gamma, beta, eps, axis, out, num_threads, False)
    if y is not None:
        return y
    return _forward(x, gamma, beta, eps, axis, out, num_threads, keep_cache=False)


def layer_norm_forward(x, gamma=None, beta=None, eps=1e-5, *, axis=-1, out=None,
                       num_threads=None):
    """Like :func:`layer_norm`, and also returns the cache for :func:`layer_norm_backward`.

    Returns
    -------
    y : ndarray
    cache : LayerNormCache
        ``cache.mean`` and ``cache.rstd`` have shape ``x.shape[:axis]`` and y's dtype. The cache
        refers to x without copying it: do not modify x before calling the backward. For the
        same reason ``out`` may not overlap x here. A row whose rstd exceeds the dtype's range
        (a non-constant row of subnormal spread with eps = 0) has ``cache.rstd`` inf, and
        :func:`layer_norm_backward` recomputes that row's statistics from x; a constant row
        with eps = 0 has inf too (its x_hat is 0).

    Examples
    --------
    >>> import numpy as np, fastln
    >>> y, cache = fastln.layer_norm_forward(np.array([[10.0, 20.0, 60.0]]))
    >>> cache.mean, cache.rstd.round(5)
    (array([30.]), array([0.04629]))
    """
    result = _kernels.layer_norm_forward_fast(x, gamma, beta, eps, axis, out, num_threads, True)
    if result is not None:
        y, mean, rstd = result
        return y, LayerNormCache(x, mean, rstd, x.ndim - 1, eps, x.dtype)
    return _forward(x, gamma, beta, eps, axis, out, num_threads, keep_cache=True)


class RowBackwardArrays(NamedTuple):
    """What the general path of a row normalization's backward hands its kernels: dy, x and dx
    as (rows, cols) kernel arrays, gamma and rstd checked and converted."""
    dtype: np.dtype
    stats_dtype: np.dtype      # float32 for float16/bfloat16, else dtype
    normalized_shape: tuple
    gamma: object
    num_threads: int
    dy: np.ndarray
    x: np.ndarray
    dx: np.ndarray             # rows of dx_array
    dx_array: np.ndarray       # the result, of x's shape (or the caller's out)
    rstd: np.ndarray


def row_backward_arrays(dy, cache, gamma, out, num_threads, op):
    """The checks and conversions LayerNorm's and RMSNorm's backwards share, in the order their
    errors are raised: dy, the cache, gamma, num_threads, out."""
    dy = as_array(dy, "dy")
    cache = check_cache(cache, dy, op)  # the checked copy: its fields are read only once
    dtype = cache.dtype
    stats_dtype = compute_dtype(dtype)
    axis = cache.axis
    n_rows, n_cols = rows_and_cols(cache.shape, axis)
    normalized_shape = cache.shape[axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, stats_dtype)
    num_threads = resolve_num_threads(num_threads)

    dy_rows = as_kernel_array(dy, dtype).reshape(n_rows, n_cols)
    x_rows = as_kernel_array(cache.x, dtype).reshape(n_rows, n_cols)
    dx = empty_output(cache.shape, dtype) if out is None else check_out(out, cache.shape, dtype)
    dx_rows = dx.reshape(n_rows, n_cols)
    return RowBackwardArrays(
        dtype, stats_dtype, normalized_shape, protect_from_output(gamma, dx_rows), num_threads,
        protect_from_output(dy_rows, dx_rows), protect_from_output(x_rows, dx_rows), dx_rows,
        dx if out is None else out,
        as_kernel_array(cache.rstd, stats_dtype).reshape(n_rows))


def layer_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """Gradients of :func:`layer_norm_forward` with respect to x, gamma and beta.

    Parameters
    ----------
    dy : array_like
        Gradient of the loss with respect to y: y's shape and dtype.
    cache : LayerNormCache
        From :func:`layer_norm_forward`. A row whose ``cache.rstd`` is inf (beyond the dtype's
        range, see there) takes its statistics again from ``cache.x`` and ``cache.eps``.
    gamma : array_like of shape ``x.shape[axis:]``, optional
        The scale the forward used (None: ones).
    out : ndarray, optional
        Buffer for dx, with the rules of the forward's ``out``; may be dy itself.
    num_threads : int, optional

    Returns
    -------
    dx : ndarray of x's shape
    dgamma, dbeta : ndarray of shape ``x.shape[axis:]``
        Sums over the rows, identical for every ``num_threads``; in y's dtype, except float32
        for float16/bfloat16 (a sum over many rows would overflow float16).

    Raises
    ------
    ValueError
        When dy's shape or dtype is not the forward's y's, or the cache is of another operation
        (TypeError when it is not a cache at all).

    Examples
    --------
    >>> import numpy as np, fastln
    >>> x = np.array([[10.0, 20.0, 60.0], [1.0, 2.0, 3.0]])
    >>> y, cache = fastln.layer_norm_forward(x)
    >>> dx, dgamma, dbeta = fastln.layer_norm_backward(np.ones_like(y), cache)
    >>> bool(np.abs(dx).max() < 1e-12), dbeta    # a constant dy does not move x_hat
    (True, array([2., 2., 2.]))
    """
    # cache._dtype, not the dtype property: on a forged cache (rstd None) that property would
    # raise before the general path could give its error.
    if type(cache) is LayerNormCache:
        result = _kernels.layer_norm_backward_fast(dy, cache.x, cache.mean, cache.rstd,
                                                   cache.axis, cache._dtype, cache.eps, gamma,
                                                   out, num_threads)
        if result is not None:
            return result
    rows = row_backward_arrays(dy, cache, gamma, out, num_threads, "layer_norm")
    mean = as_kernel_array(cache.mean, rows.stats_dtype).reshape(rows.dy.shape[0])
    dgamma = np.empty(rows.normalized_shape, rows.stats_dtype)
    dbeta = np.empty(rows.normalized_shape, rows.stats_dtype)
    _kernels.layer_norm_backward(rows.dy, rows.x, rows.gamma, mean, rows.rstd, rows.dx,
                                 dgamma.reshape(-1), dbeta.reshape(-1), cache.eps,
                                 _kernels.storage_code(rows.dtype), rows.num_threads)
    return rows.dx_array, dgamma, dbeta
