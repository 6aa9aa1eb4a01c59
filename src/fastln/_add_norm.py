"""Fused residual add + LayerNorm / RMSNorm: ``s = x + residual (+ bias)``, ``y = norm(s)``.

One pass per row instead of three (add, statistics, normalize): x and residual are read once, s
and y written once (ONNX Runtime's ``SkipLayerNormalization`` does the same and also returns the
sum). The caches are the plain LayerNorm / RMSNorm caches of s, so the ordinary backwards apply.
"""
import numpy as np

from fastln import _kernels
from fastln._caches import LayerNormCache, RMSNormCache
from fastln._checks import (
    as_kernel_array,
    check_eps,
    check_input,
    check_out,
    check_param,
    check_residual,
    compute_dtype,
    normalize_axis,
    protect_from_output,
    rows_and_cols,
)
from fastln._output_cache import empty_output
from fastln._threads import resolve_num_threads


def _forward(rms, x, residual, gamma, beta, eps, bias, axis, out, sum_out, num_threads,
             keep_cache):
    name = "add_rms_norm" if rms else "add_layer_norm"
    x, dtype = check_input(x, allow_half=True)
    stats_dtype = compute_dtype(dtype)  # float32 for float16/bfloat16 x, else dtype
    residual = check_residual(residual, x)
    axis = normalize_axis(axis, x.ndim)
    n_rows, n_cols = rows_and_cols(x.shape, axis)
    normalized_shape = x.shape[axis:]
    gamma = check_param(gamma, "gamma", normalized_shape, stats_dtype)
    beta = None if rms else check_param(beta, "beta", normalized_shape, stats_dtype)
    bias = check_param(bias, "bias", normalized_shape, stats_dtype)
    eps = check_eps(eps)
    num_threads = resolve_num_threads(num_threads)
    y = empty_output(x.shape, dtype) if out is None else check_out(out, x.shape, dtype)
    s = (empty_output(x.shape, dtype) if sum_out is None
         else check_out(sum_out, x.shape, dtype, name="sum_out"))
    if np.may_share_memory(y, s):
        raise ValueError(f"out and sum_out overlap: {name} writes both y and s, so they must be "
                         "different arrays")

    y_rows = y.reshape(n_rows, n_cols)
    s_rows = s.reshape(n_rows, n_cols)
    x_rows = as_kernel_array(x, dtype).reshape(n_rows, n_cols)
    residual_rows = as_kernel_array(residual, dtype).reshape(n_rows, n_cols)
    # Within a row, x and residual are read completely before s is written, and s is complete
    # before y is written: an output exactly on top of x or residual is safe; any other
    # overlap (with gamma, beta, bias too) gets a copy.
    x_rows = protect_from_output(protect_from_output(x_rows, y_rows), s_rows)
    residual_rows = protect_from_output(protect_from_output(residual_rows, y_rows), s_rows)
    bias, gamma, beta = (None if p is None
                         else protect_from_output(protect_from_output(p, y_rows), s_rows)
                         for p in (bias, gamma, beta))

    mean = rstd = None
    if keep_cache:
        rstd = np.empty(n_rows, stats_dtype)
        mean = None if rms else np.empty(n_rows, stats_dtype)
    storage = _kernels.storage_code(dtype)
    if rms:
        _kernels.add_rms_norm_forward(x_rows, residual_rows, bias, gamma, s_rows, y_rows, rstd,
                                      eps, storage, num_threads)
    else:
        _kernels.add_layer_norm_forward(x_rows, residual_rows, bias, gamma, beta, s_rows,
                                        y_rows, mean, rstd, eps, storage, num_threads)
    # y and s are plain views of a subclass's out and sum_out: return the caller's own arrays
    results = (y if out is None else out, s if sum_out is None else sum_out)
    if not keep_cache:
        return results
    batch_shape = x.shape[:axis]
    return results + (_cache_of_s(rms, s, None if rms else mean.reshape(batch_shape),
                                  rstd.reshape(batch_shape), axis, eps, dtype),)


def _cache_of_s(rms, s, mean, rstd, axis, eps, dtype):
    """The plain RMSNorm / LayerNorm cache of the sum s (mean: None for RMSNorm)."""
    if rms:
        return RMSNormCache(s, rstd, axis, eps, dtype)
    return LayerNormCache(s, mean, rstd, axis, eps, dtype)


_SHARED_DOC = """
    ``s = x + residual + bias`` is computed in float64 and rounded once to the output dtype (for
    float32 without bias that is exactly NumPy's ``x + residual``), and y is bitwise what the
    unfused normalization of that s gives. The output dtype is x's (see
    :func:`fastln.layer_norm`); residual and bias are cast to it. For float16/bfloat16 x, s is
    rounded to float32 and then to x's format (for float16 without bias exactly NumPy's
    ``x + residual``, which adds in float32), residual is cast to x's format and gamma, beta and
    bias to float32.

    Parameters
    ----------
    x : array_like
        The sublayer output (float32/float64 as they are; integer and bool as float64).
    residual : array_like of x's shape
        The residual stream. Not broadcast: it must have exactly x's shape.
    {params}
    bias : array_like of shape ``x.shape[axis:]``, optional
        Added to the sum before normalizing (the sublayer's bias folded in).
    axis : int, default -1
        The first normalized axis.
    out : ndarray, optional
        Buffer for y: C-contiguous, shape ``x.shape``, the output dtype. May be x or residual.
    sum_out : ndarray, optional
        Buffer for s, with the same rules. May be ``residual`` itself (the in-place
        residual-stream update) or x; must not overlap ``out``.
    num_threads : int, optional
        OpenMP threads; None uses OpenMP's default. Results are identical for every value.
"""

_GRADIENT_DOC = """
    Gradients: s feeds y (and whatever uses s downstream), and ``ds/dx = ds/dresidual = 1``. So
    with ``ds`` the gradient :func:`{backward}` returns for the cache (plus any gradient flowing
    into s directly), ``dx = dresidual = ds`` and ``dbias = ds`` summed over ``x.shape[:axis]``.
"""


def add_layer_norm(x, residual, gamma=None, beta=None, eps=1e-5, *, bias=None, axis=-1, out=None,
                   sum_out=None, num_threads=None):
    result = _kernels.add_norm_forward_fast(False, x, residual, gamma, beta, eps, bias,
                                                   axis, out, sum_out, num_threads, False)
    if result is not None:
        return result
    return _forward(False, x, residual, gamma, beta, eps, bias, axis, out, sum_out, num_threads,
                    keep_cache=False)


def add_layer_norm_forward(x, residual, gamma=None, beta=None, eps=1e-5, *, bias=None, axis=-1,
                           out=None, sum_out=None, num_threads=None):
    result = _kernels.add_norm_forward_fast(False, x, residual, gamma, beta, eps, bias,
                                                   axis, out, sum_out, num_threads, True)
    if result is not None:
        y, s, mean, rstd = result
        return y, s, _cache_of_s(False, s, mean, rstd, x.ndim - 1, eps, x.dtype)
    return _forward(False, x, residual, gamma, beta, eps, bias, axis, out, sum_out, num_threads,
                    keep_cache=True)


def add_rms_norm(x, residual, gamma=None, eps=1e-5, *, bias=None, axis=-1, out=None,
                 sum_out=None, num_threads=None):
    result = _kernels.add_norm_forward_fast(True, x, residual, gamma, None, eps, bias,
                                                   axis, out, sum_out, num_threads, False)
    if result is not None:
        return result
    return _forward(True, x, residual, gamma, None, eps, bias, axis, out, sum_out, num_threads,
                    keep_cache=False)


def add_rms_norm_forward(x, residual, gamma=None, eps=1e-5, *, bias=None, axis=-1, out=None,
                         sum_out=None, num_threads=None):
    result = _kernels.add_norm_forward_fast(True, x, residual, gamma, None, eps, bias,
                                                   axis, out, sum_out, num_threads, True)
    if result is not None:
        y, s, mean, rstd = result
        return y, s, _cache_of_s(True, s, mean, rstd, x.ndim - 1, eps, x.dtype)
    return _forward(True, x, residual, gamma, None, eps, bias, axis, out, sum_out, num_threads,
                    keep_cache=True)


_LN_PARAMS = """gamma, beta : array_like of shape ``x.shape[axis:]``, optional
        Scale and shift of the LayerNorm, cast to the output dtype; None means ones and zeros.
    eps : float, default 1e-5
        Added to the variance; a finite number >= 0."""
_RMS_PARAMS = """gamma : array_like of shape ``x.shape[axis:]``, optional
        Scale of the RMSNorm, cast to the output dtype; None means ones.
    eps : float, default 1e-5
        Added to the mean of squares; a finite number >= 0."""

add_layer_norm.__doc__ = """Fused residual add + LayerNorm: ``s = x + residual (+ bias)``,
    ``y = layer_norm(s, gamma, beta, eps)``, in one pass (pre-norm transformer inference).
""" + _SHARED_DOC.format(params=_LN_PARAMS) + """
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

add_layer_norm_forward.__doc__ = """Like :func:`add_layer_norm`, and also returns a cache for
    :func:`fastln.layer_norm_backward`.

    Returns
    -------
    y, s : ndarray
    cache : LayerNormCache
        The LayerNorm cache of s (``cache.x is s``): pass it to
        :func:`fastln.layer_norm_backward`. It refers to s without copying it, so s (which may
        be ``residual`` when ``sum_out=residual``) must not be modified before the backward.
""" + _GRADIENT_DOC.format(backward="fastln.layer_norm_backward") + """
    Examples
    --------
    >>> import numpy as np, fastln
    >>> x, residual = np.array([[1.0, 2.0, 3.0]]), np.array([[9.0, 18.0, 57.0]])
    >>> y, s, cache = fastln.add_layer_norm_forward(x, residual)
    >>> ds, dgamma, dbeta = fastln.layer_norm_backward(np.ones_like(y), cache)
    >>> cache.x is s, cache.mean
    (True, array([30.]))
    """

add_rms_norm.__doc__ = """Fused residual add + RMSNorm: ``s = x + residual (+ bias)``,
    ``y = rms_norm(s, gamma, eps)``, in one pass (pre-norm transformer inference).
""" + _SHARED_DOC.format(params=_RMS_PARAMS) + """
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

add_rms_norm_forward.__doc__ = """Like :func:`add_rms_norm`, and also returns a cache for
    :func:`fastln.rms_norm_backward`.

    Returns
    -------
    y, s : ndarray
    cache : RMSNormCache
        The RMSNorm cache of s (``cache.x is s``): pass it to :func:`fastln.rms_norm_backward`.
        It refers to s without copying it, so s must not be modified before the backward.
""" + _GRADIENT_DOC.format(backward="fastln.rms_norm_backward") + """
    Examples
    --------
    >>> import numpy as np, fastln
    >>> y, s, cache = fastln.add_rms_norm_forward(np.array([[2.0, 2.0]]),
    ...                                           np.array([[1.0, 2.0]]), eps=0.0)
    >>> s, cache.rstd.round(6)
    (array([[3., 4.]]), array([0.282843]))
    """
