"""fastln.rms_norm and its forward/backward pair: checking here, arithmetic in the kernels."""
import numpy as np

from fastln import _kernels
from fastln._caches import RMSNormCache
from fastln._checks import (
    as_kernel_array,
    check_eps,
    check_input,
    check_out,
    check_param,
    compute_dtype,
    normalize_axis,
    protect_from_output,
    rows_and_cols,
)
from fastln._layer_norm import row_backward_arrays
from fastln._output_cache import empty_output
from fastln._threads import resolve_num_threads


def _forward(x, gamma, eps, axis, out, num_threads, keep_cache):
    x, dtype = check_input(x, allow_half=True)
    stats_dtype = compute_dtype(dtype)  # float32 for float16/bfloat16 x, else dtype
    axis = normalize_axis(axis, x.ndim)
    n_rows, n_cols = rows_and_cols(x.shape, axis)
    gamma = check_param(gamma, "gamma", x.shape[axis:], stats_dtype)
    eps = check_eps(eps)
    num_threads = resolve_num_threads(num_threads)

    x_rows = as_kernel_array(x, dtype).reshape(n_rows, n_cols)
    if out is None:
        y = empty_output(x.shape, dtype)
    else:
        y = check_out(out, x.shape, dtype)
        if keep_cache and np.may_share_memory(y, x):
            raise ValueError("out overlaps x: rms_norm_forward keeps x for the backward pass; "
                             "use fastln.rms_norm for an in-place forward")
    y_rows = y.reshape(n_rows, n_cols)
    x_rows = protect_from_output(x_rows, y_rows)
    gamma = protect_from_output(gamma, y_rows)

    rstd = np.empty(n_rows, stats_dtype) if keep_cache else None
    _kernels.rms_norm_forward(x_rows, gamma, y_rows, rstd, eps, _kernels.storage_code(dtype),
                              num_threads)
    result = y if out is None else out  # y is a plain view of a subclass's out: return out
    if not keep_cache:
        return result
    return result, RMSNormCache(x, rstd.reshape(x.shape[:axis]), axis, eps, dtype)


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
    out : ndarray, optional
        C-contiguous, shape ``x.shape``, the output dtype. May be ``x`` itself (in place).
    num_threads : int, optional
        OpenMP threads; None uses OpenMP's default (``OMP_NUM_THREADS``). Results are
        identical for every value.

    Returns
    -------
    y : ndarray of x's shape (``out`` when given)

    Examples
    --------
    >>> import numpy as np, fastln
    >>> fastln.rms_norm(np.array([3.0, 4.0]), eps=0.0).round(4)
    array([0.8485, 1.1314])
    """
    y = _kernels.rms_norm_forward_fast(x, gamma, eps, axis, out, num_threads, False)
    if y is not None:
        return y
    return _forward(x, gamma, eps, axis, out, num_threads, keep_cache=False)


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
    result = _kernels.rms_norm_forward_fast(x, gamma, eps, axis, out, num_threads, True)
    if result is not None:
        y, rstd = result
        return y, RMSNormCache(x, rstd, x.ndim - 1, eps, x.dtype)
    return _forward(x, gamma, eps, axis, out, num_threads, keep_cache=True)


def rms_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """Gradients of :func:`rms_norm_forward` with respect to x and gamma.

    With ``x_hat = x * rstd`` and ``dx_hat = dy * gamma``, per row::

        dx = rstd * (dx_hat - x_hat * mean(dx_hat * x_hat))
        dgamma = sum over rows of dy * x_hat

    Parameters
    ----------
    dy : array_like
        Gradient of the loss with respect to y: y's shape and dtype.
    cache : RMSNormCache
        From :func:`rms_norm_forward` (or :func:`fastln.add_rms_norm_forward`). A row whose
        ``cache.rstd`` is inf and whose values are not all zero (rstd beyond the dtype's range)
        takes its rstd again from ``cache.x`` and ``cache.eps``.
    gamma : array_like of shape ``x.shape[axis:]``, optional
        The scale the forward used (None: ones).
    out : ndarray, optional
        Buffer for dx, with the rules of the forward's ``out``; may be dy itself.
    num_threads : int, optional

    Returns
    -------
    dx : ndarray of x's shape
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
        result = _kernels.rms_norm_backward_fast(dy, cache.x, cache.rstd, cache.axis,
                                                        cache._dtype, cache.eps, gamma, out,
                                                        num_threads)
        if result is not None:
            return result
    rows = row_backward_arrays(dy, cache, gamma, out, num_threads, "rms_norm")
    dgamma = np.empty(rows.normalized_shape, rows.stats_dtype)
    _kernels.rms_norm_backward(rows.dy, rows.x, rows.gamma, rows.rstd, rows.dx,
                               dgamma.reshape(-1), cache.eps, _kernels.storage_code(rows.dtype),
                               rows.num_threads)
    return rows.dx_array, dgamma
