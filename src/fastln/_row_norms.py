"""LayerNorm, RMSNorm and the fused residual add + norm: checking here, arithmetic in the kernels.

Every public function first offers its call to the small-call recogniser of fastln._kernels
(which only takes arguments that are kernel-ready already, and never raises); the general path
below checks every argument (fastln._checks: the one place where the rules and their error
messages live), makes the kernel-ready arrays and calls the same binding entry. The four forwards
share one general path (_forward), the two backwards another (_backward): what tells them apart is
their row of _OPS.
"""
from typing import NamedTuple

import numpy as np

from fastln import _kernels
from fastln._caches import LayerNormCache, RMSNormCache, check_cache
from fastln._checks import (
    as_array,
    as_kernel_array,
    check_eps,
    check_input,
    check_out,
    check_out_keeps_x,
    check_param,
    check_residual,
    compute_dtype,
    normalize_axis,
    protect_from_output,
    rows_and_cols,
)
from fastln._docs import shares_docs
from fastln._output_cache import empty_output
from fastln._threads import resolve_num_threads


class _RowOp(NamedTuple):
    """What tells a row normalization apart: its cache, whether it has beta (LayerNorm: and a
    mean in the cache), whether it adds a residual first, and its binding entries."""
    cache: type
    has_beta: bool
    fused: bool


_OPS = {
    "layer_norm": _RowOp(LayerNormCache, True, False),
    "rms_norm": _RowOp(RMSNormCache, False, False),
    "add_layer_norm": _RowOp(LayerNormCache, True, True),
    "add_rms_norm": _RowOp(RMSNormCache, False, True),
}


def _forward(name, x, residual, gamma, beta, bias, eps, axis, out, sum_out, num_threads,
             keep_cache):
    """The general path of the four forwards: y (and s), and the cache with keep_cache."""
    op = _OPS[name]
    x, dtype = check_input(x)
    stats_dtype = compute_dtype(dtype)  # float32 for float16/bfloat16 x, else dtype
    if op.fused:
        residual = check_residual(residual, x)
    axis = normalize_axis(axis, x.ndim)
    n_rows, n_cols = rows_and_cols(x.shape, axis)
    normalized_shape = x.shape[axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, stats_dtype)
    beta = check_param(beta, "beta", normalized_shape, stats_dtype) if op.has_beta else None
    bias = check_param(bias, "bias", normalized_shape, stats_dtype) if op.fused else None
    eps = check_eps(eps)
    num_threads = resolve_num_threads(num_threads)
    if out is None:
        y = empty_output(x.shape, dtype)
    else:
        y = check_out(out, x.shape, dtype)
        if keep_cache and not op.fused:
            check_out_keeps_x(y, x, name)
    outputs = [y.reshape(n_rows, n_cols)]
    if op.fused:
        s = (empty_output(x.shape, dtype) if sum_out is None
             else check_out(sum_out, x.shape, dtype, name="sum_out"))
        if np.may_share_memory(y, s):
            raise ValueError(f"out and sum_out overlap: {name} writes both y and s, so they "
                             "must be different arrays")
        outputs.append(s.reshape(n_rows, n_cols))

    # An input exactly on top of an output is safe (a row is read completely, or element i
    # before element i, ahead of every write); any other overlap gets a copy.
    def protected(array):
        for output in outputs:
            array = protect_from_output(array, output)
        return array
    x_rows = protected(as_kernel_array(x, dtype).reshape(n_rows, n_cols))
    gamma, beta, bias = (protected(p) for p in (gamma, beta, bias))
    mean = np.empty(n_rows, stats_dtype) if keep_cache and op.has_beta else None
    rstd = np.empty(n_rows, stats_dtype) if keep_cache else None
    storage = _kernels.storage_code(dtype)
    if op.fused:
        residual_rows = protected(as_kernel_array(residual, dtype).reshape(n_rows, n_cols))
        if op.has_beta:
            _kernels.add_layer_norm_forward(x_rows, residual_rows, bias, gamma, beta, outputs[1],
                                            outputs[0], mean, rstd, eps, storage, num_threads)
        else:
            _kernels.add_rms_norm_forward(x_rows, residual_rows, bias, gamma, outputs[1],
                                          outputs[0], rstd, eps, storage, num_threads)
    elif op.has_beta:
        _kernels.layer_norm_forward(x_rows, gamma, beta, outputs[0], mean, rstd, eps, storage,
                                    num_threads)
    else:
        _kernels.rms_norm_forward(x_rows, gamma, outputs[0], rstd, eps, storage, num_threads)
    # y and s are plain views of a subclass's out and sum_out: return the caller's own arrays
    results = (y if out is None else out,) + ((s if sum_out is None else sum_out,)
                                              if op.fused else ())
    if not keep_cache:
        return results if op.fused else results[0]
    normalized = s if op.fused else x
    return (*results, _new_cache(op, normalized, mean, rstd, axis, eps, dtype))


def _new_cache(op, x, mean, rstd, axis, eps, dtype):
    """The cache of a forward: of x, or of s for the fused adds (mean None for RMSNorm)."""
    batch_shape = x.shape[:axis]
    rstd = rstd.reshape(batch_shape)
    if op.has_beta:
        return LayerNormCache(x, mean.reshape(batch_shape), rstd, axis, eps, dtype)
    return RMSNormCache(x, rstd, axis, eps, dtype)


def _backward(name, dy, cache, gamma, out, num_threads):
    """The general path of the two backwards: (dx, dgamma, dbeta) or (dx, dgamma). The checks
    are made in the order their errors are raised: dy, the cache, gamma, num_threads, out."""
    has_beta = _OPS[name].has_beta
    dy = as_array(dy, "dy")
    cache = check_cache(cache, dy, name)  # the checked copy: its fields are read only once
    dtype = cache.dtype
    stats_dtype = compute_dtype(dtype)
    n_rows, n_cols = rows_and_cols(cache.shape, cache.axis)
    normalized_shape = cache.shape[cache.axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, stats_dtype)
    num_threads = resolve_num_threads(num_threads)
    dx = empty_output(cache.shape, dtype) if out is None else check_out(out, cache.shape, dtype)
    dx_rows = dx.reshape(n_rows, n_cols)

    def rows_of(array, row_dtype, shape):
        return protect_from_output(as_kernel_array(array, row_dtype).reshape(shape), dx_rows)
    dy_rows = rows_of(dy, dtype, (n_rows, n_cols))
    x_rows = rows_of(cache.x, dtype, (n_rows, n_cols))
    gamma = protect_from_output(gamma, dx_rows)
    rstd = as_kernel_array(cache.rstd, stats_dtype).reshape(n_rows)
    dgamma = np.empty(normalized_shape, stats_dtype)
    storage = _kernels.storage_code(dtype)
    if not has_beta:
        _kernels.rms_norm_backward(dy_rows, x_rows, gamma, rstd, dx_rows, dgamma.reshape(-1),
                                   cache.eps, storage, num_threads)
        return dx if out is None else out, dgamma
    mean = as_kernel_array(cache.mean, stats_dtype).reshape(n_rows)
    dbeta = np.empty(normalized_shape, stats_dtype)
    _kernels.layer_norm_backward(dy_rows, x_rows, gamma, mean, rstd, dx_rows, dgamma.reshape(-1),
                                 dbeta.reshape(-1), cache.eps, storage, num_threads)
    # dx is a plain view of a subclass's out: return out
    return dx if out is None else out, dgamma, dbeta


# ---------------------------------------------------------------------------------------------
# LayerNorm
# ---------------------------------------------------------------------------------------------

@shares_docs
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
    {forward_out}

    Examples
    --------
    >>> import numpy as np, fastln
    >>> fastln.layer_norm(np.array([10.0, 20.0, 60.0])).round(4)
    array([-0.9258, -0.4629,  1.3887])
    """
    y = _kernels.row_norm_forward_fast(_kernels.LAYER_NORM, x, None, gamma, beta, None, eps,
                                       axis, out, None, num_threads, False)
    if y is not None:
        return y
    return _forward("layer_norm", x, None, gamma, beta, None, eps, axis, out, None, num_threads,
                    keep_cache=False)


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
    result = _kernels.row_norm_forward_fast(_kernels.LAYER_NORM, x, None, gamma, beta, None, eps,
                                            axis, out, None, num_threads, True)
    if result is not None:
        y, _, mean, rstd = result
        return y, LayerNormCache(x, mean, rstd, x.ndim - 1, eps, x.dtype)
    return _forward("layer_norm", x, None, gamma, beta, None, eps, axis, out, None, num_threads,
                    keep_cache=True)


@shares_docs
def layer_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """Gradients of :func:`layer_norm_forward` with respect to x, gamma and beta.

    Parameters
    ----------
    {backward_dy}
    cache : LayerNormCache
        From :func:`layer_norm_forward`. A row whose ``cache.rstd`` is inf (beyond the dtype's
        range, see there) takes its statistics again from ``cache.x`` and ``cache.eps``.
    {backward_out}
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
        result = _kernels.row_norm_backward_fast(False, dy, cache.x, cache.mean, cache.rstd,
                                                 cache.axis, cache._dtype, cache.eps, gamma, out,
                                                 num_threads)
        if result is not None:
            return result
    return _backward("layer_norm", dy, cache, gamma, out, num_threads)


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------

@shares_docs
def rms_norm(x, gamma=None, eps=1e-5, *, axis=-1, out=None, num_threads=None):
    """RMS normalization: ``gamma * x / sqrt(mean(x**2) + eps)`` for each row.

    The mean of squares is taken over ``x.shape[axis:]``, once for each index of
    ``x.shape[:axis]``, as in ONNX ``RMSNormalization`` (opset 23) and
    ``torch.nn.functional.rms_norm``. Unlike LayerNorm there is no mean subtraction and no
    shift. Squares are summed in float64 (float32 values near 1e20 do not overflow; float64 rows
    whose squares would overflow or underflow are rescaled), and an all-zero row gives zeros,
    not NaN, also with ``eps = 0``.

    Parameters
    ----------
    x : array_like
        float32 and float64 are computed as they are; integer and bool as float64. float16 and
        bfloat16 (``ml_dtypes``) are computed in float32 row by row (no full-size float32 copy)
        and returned in their own format. Any strides, order or byte order.
    gamma : array_like of shape ``x.shape[axis:]``, optional
        Scale, cast to the output dtype (to float32 for float16/bfloat16 x); None means ones.
    eps : float, default 1e-5
        Added to the mean of squares; a finite number >= 0.
    axis : int, default -1
        The first normalized axis.
    {forward_out}

    Examples
    --------
    >>> import numpy as np, fastln
    >>> fastln.rms_norm(np.array([3.0, 4.0]), eps=0.0).round(4)
    array([0.8485, 1.1314])
    """
    y = _kernels.row_norm_forward_fast(_kernels.RMS_NORM, x, None, gamma, None, None, eps,
                                       axis, out, None, num_threads, False)
    if y is not None:
        return y
    return _forward("rms_norm", x, None, gamma, None, None, eps, axis, out, None, num_threads,
                    keep_cache=False)


def rms_norm_forward(x, gamma=None, eps=1e-5, *, axis=-1, out=None, num_threads=None):
    """Like :func:`rms_norm`, and also returns the cache for :func:`rms_norm_backward`.

    Returns
    -------
    y : ndarray
    cache : RMSNormCache
        ``cache.rstd`` has shape ``x.shape[:axis]`` and y's dtype. The cache refers to x
        without copying it: do not modify x before calling the backward. For the same reason
        ``out`` may not overlap x here. A row whose rstd exceeds the dtype's range (subnormal
        values with eps = 0) has ``cache.rstd`` inf, and :func:`rms_norm_backward` recomputes
        that row's rstd from x; an all-zero row with eps = 0 has inf too (its x_hat is 0).

    Examples
    --------
    >>> import numpy as np, fastln
    >>> y, cache = fastln.rms_norm_forward(np.array([[3.0, 4.0]]), eps=0.0)
    >>> cache.rstd.round(6)
    array([0.282843])
    """
    result = _kernels.row_norm_forward_fast(_kernels.RMS_NORM, x, None, gamma, None, None, eps,
                                            axis, out, None, num_threads, True)
    if result is not None:
        y, _, _, rstd = result
        return y, RMSNormCache(x, rstd, x.ndim - 1, eps, x.dtype)
    return _forward("rms_norm", x, None, gamma, None, None, eps, axis, out, None, num_threads,
                    keep_cache=True)


@shares_docs
def rms_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """Gradients of :func:`rms_norm_forward` with respect to x and gamma.

    With ``x_hat = x * rstd`` and ``dx_hat = dy * gamma``, per row::

        dx = rstd * (dx_hat - x_hat * mean(dx_hat * x_hat))
        dgamma = sum over rows of dy * x_hat

    Parameters
    ----------
    {backward_dy}
    cache : RMSNormCache
        From :func:`rms_norm_forward` (or :func:`fastln.add_rms_norm_forward`). A row whose
        ``cache.rstd`` is inf and whose values are not all zero (rstd beyond the dtype's range)
        takes its rstd again from ``cache.x`` and ``cache.eps``.
    {backward_out}
    dgamma : ndarray of shape ``x.shape[axis:]``
        Sum over the rows, identical for every ``num_threads``; returned even when gamma is
        None. In y's dtype, except float32 for float16/bfloat16.

    Examples
    --------
    >>> import numpy as np, fastln
    >>> x = np.array([[3.0, 4.0]])
    >>> y, cache = fastln.rms_norm_forward(x, eps=0.0)
    >>> dx, dgamma = fastln.rms_norm_backward(x, cache)   # dy parallel to x: dx = 0
    >>> bool(np.abs(dx).max() < 1e-15), dgamma.round(4)
    (True, array([2.5456, 4.5255]))
    """
    # cache._dtype, not the dtype property: on a forged cache (rstd None) that property would
    # raise before the general path could give its error.
    if type(cache) is RMSNormCache:
        result = _kernels.row_norm_backward_fast(True, dy, cache.x, None, cache.rstd,
                                                 cache.axis, cache._dtype, cache.eps, gamma, out,
                                                 num_threads)
        if result is not None:
            return result
    return _backward("rms_norm", dy, cache, gamma, out, num_threads)


# ---------------------------------------------------------------------------------------------
# Fused residual add + LayerNorm / RMSNorm: s = x + residual (+ bias), y = norm(s). One pass
# per row instead of three (add, statistics, normalize): x and residual are read once, s and y
# written once (ONNX Runtime's SkipLayerNormalization does the same and also returns the sum).
# The caches are the plain LayerNorm / RMSNorm caches of s, so the ordinary backwards apply.
# ---------------------------------------------------------------------------------------------

@shares_docs
def add_layer_norm(x, residual, gamma=None, beta=None, eps=1e-5, *, bias=None, axis=-1, out=None,
                   sum_out=None, num_threads=None):
    """Fused residual add + LayerNorm: ``s = x + residual (+ bias)``,
    ``y = layer_norm(s, gamma, beta, eps)``, in one pass (pre-norm transformer inference).

    {add_sum}

    {add_inputs}
    gamma, beta : array_like of shape ``x.shape[axis:]``, optional
        Scale and shift of the LayerNorm, cast to the output dtype; None means ones and zeros.
    eps : float, default 1e-5
        Added to the variance; a finite number >= 0.
    {add_outputs}

    Returns
    -------
    y : ndarray of x's shape (``out`` when given)
    s : ndarray of x's shape (``sum_out`` when given)

    Examples
    --------
    >>> import numpy as np, fastln
    >>> y, s = fastln.add_layer_norm(np.array([1.0, 2.0, 3.0]), np.array([9.0, 18.0, 57.0]))
    >>> s, y.round(4)
    (array([10., 20., 60.]), array([-0.9258, -0.4629,  1.3887]))
    """
    result = _kernels.row_norm_forward_fast(_kernels.ADD_LAYER_NORM, x, residual, gamma, beta,
                                            bias, eps, axis, out, sum_out, num_threads, False)
    if result is not None:
        return result
    return _forward("add_layer_norm", x, residual, gamma, beta, bias, eps, axis, out, sum_out,
                    num_threads, keep_cache=False)


def add_layer_norm_forward(x, residual, gamma=None, beta=None, eps=1e-5, *, bias=None, axis=-1,
                           out=None, sum_out=None, num_threads=None):
    """Like :func:`add_layer_norm`, and also returns a cache for
    :func:`fastln.layer_norm_backward`.

    Returns
    -------
    y, s : ndarray
    cache : LayerNormCache
        The LayerNorm cache of s (``cache.x is s``): pass it to
        :func:`fastln.layer_norm_backward`. It refers to s without copying it, so s (which may
        be ``residual`` when ``sum_out=residual``) must not be modified before the backward.

    Gradients: s feeds y (and whatever uses s downstream), and ``ds/dx = ds/dresidual = 1``. So
    with ``ds`` the gradient :func:`fastln.layer_norm_backward` returns for the cache (plus any
    gradient flowing into s directly), ``dx = dresidual = ds`` and ``dbias = ds`` summed over
    ``x.shape[:axis]``.

    Examples
    --------
    >>> import numpy as np, fastln
    >>> x, residual = np.array([[1.0, 2.0, 3.0]]), np.array([[9.0, 18.0, 57.0]])
    >>> y, s, cache = fastln.add_layer_norm_forward(x, residual)
    >>> ds, dgamma, dbeta = fastln.layer_norm_backward(np.ones_like(y), cache)
    >>> cache.x is s, cache.mean
    (True, array([30.]))
    """
    result = _kernels.row_norm_forward_fast(_kernels.ADD_LAYER_NORM, x, residual, gamma, beta,
                                            bias, eps, axis, out, sum_out, num_threads, True)
    if result is not None:
        y, s, mean, rstd = result
        return y, s, LayerNormCache(s, mean, rstd, x.ndim - 1, eps, x.dtype)
    return _forward("add_layer_norm", x, residual, gamma, beta, bias, eps, axis, out, sum_out,
                    num_threads, keep_cache=True)


@shares_docs
def add_rms_norm(x, residual, gamma=None, eps=1e-5, *, bias=None, axis=-1, out=None,
                 sum_out=None, num_threads=None):
    """Fused residual add + RMSNorm: ``s = x + residual (+ bias)``,
    ``y = rms_norm(s, gamma, eps)``, in one pass (pre-norm transformer inference).

    {add_sum}

    {add_inputs}
    gamma : array_like of shape ``x.shape[axis:]``, optional
        Scale of the RMSNorm, cast to the output dtype; None means ones.
    eps : float, default 1e-5
        Added to the mean of squares; a finite number >= 0.
    {add_outputs}

    Returns
    -------
    y : ndarray of x's shape (``out`` when given)
    s : ndarray of x's shape (``sum_out`` when given)

    Examples
    --------
    >>> import numpy as np, fastln
    >>> stream = np.array([[1.0, 2.0]])
    >>> y, s = fastln.add_rms_norm(np.array([[2.0, 2.0]]), stream, eps=0.0, sum_out=stream)
    >>> stream, y.round(4)                 # the residual stream updated in place
    (array([[3., 4.]]), array([[0.8485, 1.1314]]))
    """
    result = _kernels.row_norm_forward_fast(_kernels.ADD_RMS_NORM, x, residual, gamma, None,
                                            bias, eps, axis, out, sum_out, num_threads, False)
    if result is not None:
        return result
    return _forward("add_rms_norm", x, residual, gamma, None, bias, eps, axis, out, sum_out,
                    num_threads, keep_cache=False)


def add_rms_norm_forward(x, residual, gamma=None, eps=1e-5, *, bias=None, axis=-1, out=None,
                         sum_out=None, num_threads=None):
    """Like :func:`add_rms_norm`, and also returns a cache for
    :func:`fastln.rms_norm_backward`.

    Returns
    -------
    y, s : ndarray
    cache : RMSNormCache
        The RMSNorm cache of s (``cache.x is s``): pass it to :func:`fastln.rms_norm_backward`.
        It refers to s without copying it, so s must not be modified before the backward.

    Gradients: s feeds y (and whatever uses s downstream), and ``ds/dx = ds/dresidual = 1``. So
    with ``ds`` the gradient :func:`fastln.rms_norm_backward` returns for the cache (plus any
    gradient flowing into s directly), ``dx = dresidual = ds`` and ``dbias = ds`` summed over
    ``x.shape[:axis]``.

    Examples
    --------
    >>> import numpy as np, fastln
    >>> y, s, cache = fastln.add_rms_norm_forward(np.array([[2.0, 2.0]]),
    ...                                           np.array([[1.0, 2.0]]), eps=0.0)
    >>> s, cache.rstd.round(6)
    (array([[3., 4.]]), array([0.282843]))
    """
    result = _kernels.row_norm_forward_fast(_kernels.ADD_RMS_NORM, x, residual, gamma, None,
                                            bias, eps, axis, out, sum_out, num_threads, True)
    if result is not None:
        y, s, _, rstd = result
        return y, s, RMSNormCache(s, rstd, x.ndim - 1, eps, x.dtype)
    return _forward("add_rms_norm", x, residual, gamma, None, bias, eps, axis, out, sum_out,
                    num_threads, keep_cache=True)
