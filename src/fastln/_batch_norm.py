"""fastln.batch_norm and its forward/backward pair: checking here, arithmetic in the kernels.

BatchNorm is LayerNorm with the reduction axis transposed: one mean
and (biased, population) variance per feature, over every other axis of x. In training mode it
normalizes with those batch statistics and folds them into the running statistics; in
evaluation mode it normalizes with the running statistics.
"""

import numpy as np

from fastln import _kernels
from fastln._caches import BatchNormCache, check_cache
from fastln._checks import (
    as_array,
    as_kernel_array,
    check_batch_norm_args,
    check_feature_param,
    check_out,
    check_out_keeps_x,
    check_out_spares_running,
    compute_dtype,
    feature_layout,
    protect_from_output,
)
from fastln._docs import shares_docs
from fastln._output_cache import empty_output
from fastln._threads import resolve_num_threads

FLOAT64 = np.dtype(np.float64)


# ---------------------------------------------------------------------------------------------
# The running statistics (shared with fastln.nn.BatchNorm)
# ---------------------------------------------------------------------------------------------

def update_running(running, momentum, batch_stat):
    """running = momentum * running + (1 - momentum) * batch_stat, in float64, in place.

    A term of weight 0 is left out whatever its value (0 * inf would be NaN): momentum = 1
    keeps running as it is, also where the batch statistic is inf (a variance beyond float64)
    or NaN; momentum = 0 replaces it by the batch statistic, also where the old value is not
    finite."""
    if momentum == 1.0:
        return
    if momentum == 0.0:
        running[...] = batch_stat
        return
    running[...] = momentum * running.astype(FLOAT64) + (1.0 - momentum) * batch_stat


# ---------------------------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------------------------

def _forward(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis, out,
             num_threads, keep_cache):
    (x, dtype, axis, layout, gamma, beta, running_mean, running_var, training, momentum, eps,
     num_threads) = check_batch_norm_args(x, gamma, beta, running_mean, running_var, training,
                                          momentum, eps, axis, num_threads)
    num_threads = resolve_num_threads(num_threads)
    n_outer, n_features, n_inner = layout
    if out is None:
        y = empty_output(x.shape, dtype)
    else:
        y = check_out(out, x.shape, dtype)
        if keep_cache:
            check_out_keeps_x(y, x, "batch_norm")
        check_out_spares_running(y, running_mean, running_var, training)

    mean = np.zeros(n_features, FLOAT64)
    var = np.zeros(n_features, FLOAT64)
    rstd = np.zeros(n_features, FLOAT64)
    if x.size > 0:
        x_data = protect_from_output(as_kernel_array(x, dtype), y)
        _kernels.batch_norm_forward(
            x_data, y, n_outer, n_features, n_inner, gamma, beta,
            None if training else running_mean, None if training else running_var,
            mean, var, rstd, training, eps, _kernels.storage_code(dtype), num_threads)
    elif not training and n_features > 0:  # empty batch in evaluation mode: stats only
        mean[...] = running_mean
        rstd[...] = 1.0 / np.sqrt(running_var + eps)
    if training and running_mean is not None and n_features > 0:
        update_running(running_mean, momentum, mean)
        update_running(running_var, momentum, var)
    result = y if out is None else out  # y is a plain view of a subclass's out: return out
    if not keep_cache:
        return result
    return result, BatchNormCache(x, mean, rstd, axis, eps, training, dtype)


@shares_docs
def batch_norm(x, gamma=None, beta=None, running_mean=None, running_var=None, *, training=False,
               momentum=0.9, eps=1e-5, axis=-1, out=None, num_threads=None):
    """Batch normalization: ``gamma * (x - mean) / sqrt(var + eps) + beta`` per feature.

    ``axis`` is the feature axis: each feature (each index along ``axis``) gets one mean and
    one biased (population, divide by m) variance over all its ``m`` values, i.e. over every
    other axis of x. ``axis=-1`` suits (N, C) activations, ``axis=1`` NCHW images.

    - ``training=True`` normalizes with the batch statistics. When running_mean and running_var
      are given they are then updated in place, as exponential moving averages::

          running_mean = momentum * running_mean + (1 - momentum) * batch_mean
          running_var  = momentum * running_var  + (1 - momentum) * batch_var   # biased

      ``momentum`` weighs the OLD value (Keras' momentum). PyTorch's
      ``momentum`` weighs the new one and its running_var takes the unbiased (m - 1) variance:
      ``torch_momentum = 1 - momentum``. A batch of one value per feature is allowed: its
      variance is 0, so y is ``beta`` (and the running variance decays towards 0).
    - ``training=False`` (the default, as for a model in evaluation mode) normalizes with
      running_mean and running_var, which are then required and never modified.

    Statistics are accumulated in float64, each feature shifted by one of its own values, so
    features with ``|mean| >> std`` keep their precision; results are identical for every
    ``num_threads``. float64 features whose squares would overflow or underflow (values beyond
    ~1e154, or spreads below ~1e-125 with eps below 1e-250) are taken again rescaled by an exact
    power of two, forward and backward. Their batch variance is still reported as it is in
    float64: ``inf`` for spreads beyond ~1e154 (so running_var becomes ``inf``, and evaluation
    mode then gives y = beta for them), 0 below ~1e-162; likewise ``cache.rstd`` is ``inf`` for
    spreads below ~5e-309 with ``eps=0``, and the backward recomputes it from x.

    Parameters
    ----------
    x : array_like
        float32 and float64 are computed as they are; integer and bool as float64. Any strides,
        order or byte order. float16 and bfloat16 (``ml_dtypes``) are computed as their widened
        float32 values are and rounded once to their format (gamma and beta as float32).
    gamma, beta : array_like of shape ``(x.shape[axis],)``, optional
        Per-feature scale and shift, cast to the output dtype; None means ones and zeros.
    running_mean, running_var : ndarray of shape ``(x.shape[axis],)``, optional
        Both or neither. Training mode updates them in place (computed in float64, stored in
        their own dtype), so there they must be writeable ndarrays of a floating dtype (any
        strides or byte order). Evaluation mode only reads them (any real array_like). Their
        values are not checked: a negative running_var gives NaN.
    training : bool, default False
    momentum : float in [0, 1], default 0.9
        Weight of the old running value; 1 freezes the running statistics.
    eps : float, default 1e-5
        Added to the variance; a finite number >= 0.
    axis : int, default -1
        The feature axis.
    {forward_out}

    Raises
    ------
    ValueError
        In evaluation mode without running statistics; in training mode when a feature has no
        values (an empty batch). An empty batch in evaluation mode returns an empty y.

    Examples
    --------
    >>> import numpy as np, fastln
    >>> x = np.array([[1.0, 10.0], [3.0, 30.0]])
    >>> running_mean, running_var = np.zeros(2), np.ones(2)
    >>> fastln.batch_norm(x, running_mean=running_mean, running_var=running_var,
    ...                   training=True, eps=0.0)
    array([[-1., -1.],
           [ 1.,  1.]])
    >>> running_mean, running_var
    (array([0.2, 2. ]), array([ 1. , 10.9]))
    """
    result = _kernels.batch_norm_forward_fast(x, gamma, beta, running_mean, running_var,
                                              training, momentum, eps, axis, out, num_threads)
    if result is not None:
        return result[0]
    return _forward(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis,
                    out, num_threads, keep_cache=False)


def batch_norm_forward(x, gamma=None, beta=None, running_mean=None, running_var=None, *,
                       training=False, momentum=0.9, eps=1e-5, axis=-1, out=None,
                       num_threads=None):
    """Like :func:`batch_norm`, and also returns the cache for :func:`batch_norm_backward`.

    Returns
    -------
    y : ndarray
    cache : BatchNormCache
        ``cache.mean`` and ``cache.rstd`` (float64, one per feature) are the statistics y was
        normalized with. The cache refers to x without copying it: do not modify x before
        calling the backward. For the same reason ``out`` may not overlap x here.

    Examples
    --------
    >>> import numpy as np, fastln
    >>> y, cache = fastln.batch_norm_forward(np.array([[1.0, 10.0], [3.0, 30.0]]),
    ...                                      training=True, eps=0.0)
    >>> cache.mean, cache.rstd
    (array([ 2., 20.]), array([1. , 0.1]))
    """
    result = _kernels.batch_norm_forward_fast(x, gamma, beta, running_mean, running_var,
                                              training, momentum, eps, axis, out, num_threads)
    if result is not None:
        y, mean, rstd, axis = result
        return y, BatchNormCache(x, mean, rstd, axis, eps, training, x.dtype)
    return _forward(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis,
                    out, num_threads, keep_cache=True)


@shares_docs
def batch_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """Gradients of :func:`batch_norm_forward` with respect to x, gamma and beta.

    Training mode goes through the batch statistics: per feature, over its m values, with
    ``x_hat = (x - mean) * rstd`` and ``dx_hat = dy * gamma``, LayerNorm's two-reduction
    identity down the batch axis::

        dx = rstd / m * (m * dx_hat - sum(dx_hat) - x_hat * sum(dx_hat * x_hat))

    Evaluation mode is the affine map of fixed statistics: ``dx = dy * gamma * rstd``. In both
    modes ``dgamma = sum(dy * x_hat)`` and ``dbeta = sum(dy)`` per feature. The running
    statistics get no gradient.

    Parameters
    ----------
    {backward_dy}
    cache : BatchNormCache
        From :func:`batch_norm_forward`.
    {backward_out}
    dgamma, dbeta : ndarray of shape ``(x.shape[axis],)``
        Identical for every ``num_threads``; returned even when gamma/beta were None.

    Examples
    --------
    >>> import numpy as np, fastln
    >>> x = np.array([[1.0], [2.0], [6.0]])          # one feature, three samples
    >>> y, cache = fastln.batch_norm_forward(x, training=True, eps=0.0)
    >>> dx, dgamma, dbeta = fastln.batch_norm_backward(np.array([[1.0], [0.0], [0.0]]), cache)
    >>> dx.ravel().round(4), dgamma.round(4), dbeta
    (array([ 0.1763, -0.2204,  0.0441]), array([-0.9258]), array([1.]))
    """
    if type(cache) is BatchNormCache:
        result = _kernels.batch_norm_backward_fast(dy, cache.x, cache.mean, cache.rstd,
                                                   cache.axis, cache.dtype, cache.eps,
                                                   cache.training, gamma, out, num_threads)
        if result is not None:
            return result
    dy = as_array(dy, "dy")
    cache = check_cache(cache, dy, "batch_norm")  # the checked copy: fields read only once
    dtype = cache.dtype
    n_outer, n_features, n_inner = feature_layout(cache.shape, cache.axis)
    gamma = check_feature_param(gamma, "gamma", n_features, dtype)
    num_threads = resolve_num_threads(num_threads)

    dx = empty_output(cache.shape, dtype) if out is None else check_out(out, cache.shape, dtype)
    dgamma = np.zeros(n_features, compute_dtype(dtype))
    dbeta = np.zeros(n_features, compute_dtype(dtype))
    result = dx if out is None else out  # dx is a plain view of a subclass's out: return out
    if dx.size == 0:
        return result, dgamma, dbeta
    dy_data = protect_from_output(as_kernel_array(dy, dtype), dx)
    x_data = protect_from_output(as_kernel_array(cache.x, dtype), dx)
    _kernels.batch_norm_backward(
        dy_data, x_data, dx, dgamma, dbeta, n_outer, n_features, n_inner, gamma,
        as_kernel_array(cache.mean, FLOAT64), as_kernel_array(cache.rstd, FLOAT64),
        cache.training, cache.eps, _kernels.storage_code(dtype), num_threads)
    return result, dgamma, dbeta
