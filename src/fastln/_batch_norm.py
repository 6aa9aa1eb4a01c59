"""fastln.batch_norm and its forward/backward pair: checking here, arithmetic in the kernels.

BatchNorm (the lesson's section 8.2) is LayerNorm with the reduction axis transposed: one mean
and (biased, population) variance per feature, over every other axis of x. In training mode it
normalizes with those batch statistics and folds them into the running statistics; in
evaluation mode it normalizes with the running statistics.
"""
import math
import numbers

import numpy as np

from fastln import _family_kernels
from fastln._layer_norm import check_cache
from fastln._output_cache import empty_output
from fastln._validation import (
    _describe_dtype,
    as_array,
    as_kernel_array,
    check_eps,
    check_input,
    check_out,
    normalize_axis,
    protect_from_output,
    resolve_num_threads,
)

FLOAT64 = np.dtype(np.float64)


class BatchNormCache:
    """What batch_norm_backward needs from a forward call, in O(features) memory.

    Attributes
    ----------
    mean, rstd : float64 ndarray of shape (x.shape[axis],)
        The statistics the forward normalized with, exactly as it used them (float64 even for
        float32 x, so that the backward of a large-offset feature loses nothing): the batch mean
        and 1 / sqrt(var + eps) in training mode, the running mean and
        1 / sqrt(running_var + eps) in evaluation mode.
    x : ndarray
        The forward's input itself, not a copy: it must not be modified before the backward.
    axis : int
        The feature axis (non-negative).
    eps : float
    training : bool
        Which mode the forward ran in (the backward differs).
    dtype : numpy.dtype
        y's dtype.
    """

    op = "batch_norm"
    __slots__ = ("x", "mean", "rstd", "axis", "eps", "training", "dtype")

    def __init__(self, x, mean, rstd, axis, eps, training, dtype):
        self.x = x
        self.mean = mean
        self.rstd = rstd
        self.axis = axis
        self.eps = eps
        self.training = training
        self.dtype = dtype

    @property
    def shape(self):
        return self.x.shape

    def __repr__(self):
        return (f"BatchNormCache(shape={self.shape}, axis={self.axis}, dtype={self.dtype.name}, "
                f"eps={self.eps}, training={self.training})")


# ---------------------------------------------------------------------------------------------
# Argument checks (shared with fastln.reference.batch_norm*)
# ---------------------------------------------------------------------------------------------

def feature_layout(shape, axis):
    """(n_outer, n_features, n_inner): x as a C-order (outer, feature, inner) block."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def check_feature_param(param, name, n_features, dtype):
    """gamma/beta of BatchNorm: None, or shape (x.shape[axis],), cast to dtype, as float64."""
    if param is None:
        return None
    array = as_array(param, name)
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{name} has dtype {_describe_dtype(array.dtype)}; expected a real "
                        f"floating, integer or bool array (it is cast to {dtype.name})")
    if array.shape != (n_features,):
        raise ValueError(f"{name} has shape {array.shape}, expected (x.shape[axis],) = "
                         f"({n_features},)")
    # Cast to y's dtype first (as LayerNorm does with its parameters), then to float64 for the
    # per-feature constants.
    return np.array(array.astype(dtype), dtype=FLOAT64)


def check_running(running, name, n_features, training):
    """running_mean / running_var: shape (x.shape[axis],).

    In training mode they are updated in place, so they must be writeable ndarrays of a real
    floating dtype (any strides and byte order). In evaluation mode they are only read: any real
    array_like. Returns the array to update (training) or a float64 copy (evaluation).
    """
    if training and not isinstance(running, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray (it is updated in place in training "
                        f"mode), got {type(running).__name__}")
    array = as_array(running, name)
    kinds = "f" if training else "biuf"
    if array.dtype.kind not in kinds:
        expected = ("a real floating dtype (it is updated in place)" if training
                    else "a real floating, integer or bool dtype")
        raise TypeError(f"{name} has dtype {_describe_dtype(array.dtype)}; expected {expected}")
    if array.shape != (n_features,):
        raise ValueError(f"{name} has shape {array.shape}, expected (x.shape[axis],) = "
                         f"({n_features},)")
    if training:
        if not array.flags.writeable:
            raise ValueError(f"{name} is read-only, but training mode updates it in place")
        return array
    return np.array(array, dtype=FLOAT64)


def check_momentum(momentum):
    """momentum as a float in [0, 1] (the weight of the old running value)."""
    if isinstance(momentum, (bool, np.bool_)) or not isinstance(momentum, numbers.Real):
        raise TypeError(f"momentum must be a real number, got {type(momentum).__name__}")
    value = float(momentum)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"momentum must be in [0, 1] (the weight of the old running value), "
                         f"got {momentum!r}")
    return value


def check_training(training):
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")
    return bool(training)


def check_batch_norm_args(x, gamma, beta, running_mean, running_var, training, momentum, eps,
                          axis, num_threads):
    """Every check of batch_norm's arguments, before any work; returns them normalized."""
    x, dtype = check_input(x)
    axis = normalize_axis(axis, x.ndim)
    n_outer, n_features, n_inner = feature_layout(x.shape, axis)
    training = check_training(training)
    gamma = check_feature_param(gamma, "gamma", n_features, dtype)
    beta = check_feature_param(beta, "beta", n_features, dtype)
    if (running_mean is None) != (running_var is None):
        given, missing = (("running_mean", "running_var") if running_var is None
                          else ("running_var", "running_mean"))
        raise ValueError(f"{given} was given without {missing}: pass both running statistics "
                         "or neither")
    if running_mean is None and not training:
        raise ValueError("batch_norm with training=False normalizes with the running "
                         "statistics, so running_mean and running_var are required; pass "
                         "training=True to normalize with the batch statistics")
    if running_mean is not None:
        running_mean = check_running(running_mean, "running_mean", n_features, training)
        running_var = check_running(running_var, "running_var", n_features, training)
        if training and np.may_share_memory(running_mean, running_var):
            raise ValueError("running_mean and running_var overlap in memory")
    momentum = check_momentum(momentum)
    eps = check_eps(eps)
    num_threads = resolve_num_threads(num_threads)
    if training and n_features > 0 and n_outer * n_inner == 0:
        raise ValueError(f"batch_norm in training mode needs at least one value per feature; "
                         f"x has shape {x.shape} with feature axis {axis}")
    return (x, dtype, axis, (n_outer, n_features, n_inner), gamma, beta, running_mean,
            running_var, training, momentum, eps, num_threads)


def update_running(running, momentum, batch_stat):
    """running = momentum * running + (1 - momentum) * batch_stat, in float64, in place."""
    running[...] = momentum * running.astype(FLOAT64) + (1.0 - momentum) * batch_stat


def update_running_var(running_var, momentum, batch_var):
    """update_running for the variance, whose batch value may be inf for finite x (a spread
    beyond ~1e154; Inf in x gives NaN instead): momentum = 1 gives it weight 0, and 0 * inf
    would make running_var NaN where momentum = 1 leaves it as it is."""
    if momentum == 1.0:
        batch_var = np.where(np.isinf(batch_var), 0.0, batch_var)
    update_running(running_var, momentum, batch_var)


# ---------------------------------------------------------------------------------------------
# API
# ---------------------------------------------------------------------------------------------

def _forward(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis, out,
             num_threads, keep_cache):
    (x, dtype, axis, layout, gamma, beta, running_mean, running_var, training, momentum, eps,
     num_threads) = check_batch_norm_args(x, gamma, beta, running_mean, running_var, training,
                                          momentum, eps, axis, num_threads)
    n_outer, n_features, n_inner = layout
    if out is None:
        y = empty_output(x.shape, dtype)
    else:
        y = check_out(out, x.shape, dtype)
        if keep_cache and np.may_share_memory(y, x):
            raise ValueError("out overlaps x: batch_norm_forward keeps x for the backward pass; "
                             "use fastln.batch_norm for an in-place forward")
        if training and running_mean is not None and (np.may_share_memory(y, running_mean)
                                                      or np.may_share_memory(y, running_var)):
            raise ValueError("out overlaps running_mean or running_var, which training mode "
                             "updates")

    mean = np.zeros(n_features, FLOAT64)
    var = np.zeros(n_features, FLOAT64)
    rstd = np.zeros(n_features, FLOAT64)
    if x.size > 0:
        x_data = protect_from_output(as_kernel_array(x, dtype), y)
        _family_kernels.batch_norm_forward(
            x_data, y, n_outer, n_features, n_inner, gamma, beta,
            None if training else running_mean, None if training else running_var,
            mean, var, rstd, training, eps, num_threads)
    elif not training and n_features > 0:  # empty batch in evaluation mode: stats only
        mean[...] = running_mean
        rstd[...] = 1.0 / np.sqrt(running_var + eps)
    if training and running_mean is not None and n_features > 0:
        update_running(running_mean, momentum, mean)
        update_running_var(running_var, momentum, var)
    if not keep_cache:
        return y
    return y, BatchNormCache(x, mean, rstd, axis, eps, training, dtype)


def batch_norm(x, gamma=None, beta=None, running_mean=None, running_var=None, *, training=False,
               momentum=0.9, eps=1e-5, axis=-1, out=None, num_threads=None):
    """Batch normalization: ``gamma * (x - mean) / sqrt(var + eps) + beta`` per feature.

    ``axis`` is the feature axis: each feature (each index along ``axis``) gets one mean and
    one biased (population, divide by m) variance over all its ``m`` values, i.e. over every
    other axis of x. ``axis=-1`` suits (N, C) activations, ``axis=1`` NCHW images.

    - ``training=True`` normalizes with the batch statistics. When running_mean and running_var
      are given they are then updated in place, as the lesson writes it (section 8.2.3)::

          running_mean = momentum * running_mean + (1 - momentum) * batch_mean
          running_var  = momentum * running_var  + (1 - momentum) * batch_var   # biased

      ``momentum`` weighs the OLD value (the lesson's alpha, Keras' momentum). PyTorch's
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
        order or byte order. BatchNorm has no half-precision kernel: float16 and bfloat16 are a
        TypeError (convert with ``x.astype(np.float32)``).
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
    out : ndarray, optional
        C-contiguous, shape ``x.shape``, the output dtype. May be ``x`` itself (in place).
    num_threads : int, optional
        OpenMP threads; None uses OpenMP's default (``OMP_NUM_THREADS``).

    Returns
    -------
    y : ndarray of x's shape (``out`` when given)

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
    return _forward(x, gamma, beta, running_mean, running_var, training, momentum, eps, axis,
                    out, num_threads, keep_cache=True)


def batch_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """Gradients of :func:`batch_norm_forward` with respect to x, gamma and beta.

    Training mode goes through the batch statistics: per feature, over its m values, with
    ``x_hat = (x - mean) * rstd`` and ``dx_hat = dy * gamma``, the lesson's two-reduction
    identity down the batch axis::

        dx = rstd / m * (m * dx_hat - sum(dx_hat) - x_hat * sum(dx_hat * x_hat))

    Evaluation mode is the affine map of fixed statistics: ``dx = dy * gamma * rstd``. In both
    modes ``dgamma = sum(dy * x_hat)`` and ``dbeta = sum(dy)`` per feature. The running
    statistics get no gradient.

    Parameters
    ----------
    dy : array_like
        Gradient of the loss with respect to y: y's shape and dtype.
    cache : BatchNormCache
        From :func:`batch_norm_forward`.
    gamma : array_like of shape ``(x.shape[axis],)``, optional
        The scale the forward used (None: ones).
    out : ndarray, optional
        Buffer for dx, with the rules of the forward's ``out``; may be dy itself.
    num_threads : int, optional

    Returns
    -------
    dx : ndarray of x's shape
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
    dy = as_array(dy, "dy")
    check_cache(cache, dy, "batch_norm")
    dtype = cache.dtype
    n_outer, n_features, n_inner = feature_layout(cache.shape, cache.axis)
    gamma = check_feature_param(gamma, "gamma", n_features, dtype)
    num_threads = resolve_num_threads(num_threads)

    dx = empty_output(cache.shape, dtype) if out is None else check_out(out, cache.shape, dtype)
    dgamma = np.zeros(n_features, dtype)
    dbeta = np.zeros(n_features, dtype)
    if dx.size == 0:
        return dx, dgamma, dbeta
    dy_data = protect_from_output(as_kernel_array(dy, dtype), dx)
    x_data = protect_from_output(as_kernel_array(cache.x, dtype), dx)
    _family_kernels.batch_norm_backward(
        dy_data, x_data, dx, dgamma, dbeta, n_outer, n_features, n_inner, gamma,
        as_kernel_array(cache.mean, FLOAT64), as_kernel_array(cache.rstd, FLOAT64),
        cache.training, cache.eps, num_threads)
    return dx, dgamma, dbeta
