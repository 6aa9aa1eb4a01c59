"""GroupNorm and InstanceNorm: checking here, arithmetic in the kernels.

GroupNorm normalizes each (sample, group of C / num_groups channels) over its channels and every
spatial position, then scales and shifts each channel by its own gamma and beta (ONNX
GroupNormalization, opset 21; ``torch.nn.functional.group_norm``). InstanceNorm is GroupNorm with
one group per channel (ONNX InstanceNormalization; PyTorch's InstanceNorm without running
statistics, its default): its functions are GroupNorm's with num_groups = C, and its cache is a
GroupNormCache with ``num_groups == C``.
"""
import numpy as np

from fastln import _kernels
from fastln._caches import GroupNormCache, check_cache
from fastln._checks import (
    as_array,
    as_kernel_array,
    check_channel_param,
    check_group_norm_args,
    check_out,
    check_out_keeps_x,
    compute_dtype,
    protect_from_output,
)
from fastln._docs import shares_docs
from fastln._output_cache import empty_output
from fastln._threads import resolve_num_threads


def _forward(name, x, num_groups, gamma, beta, eps, channel_axis, out, num_threads,
             keep_cache):
    """y, and with keep_cache the cache; num_groups None: one group per channel."""
    result = _kernels.group_norm_forward_fast(x, num_groups, gamma, beta, eps, channel_axis, out,
                                              num_threads, keep_cache)
    if result is not None:
        y, mean, rstd, axis, n_groups = result
        if not keep_cache:
            return y
        return y, GroupNormCache(x, mean, rstd, n_groups, axis, eps, x.dtype)
    x, dtype, layout, gamma, beta, eps, num_threads = check_group_norm_args(
        x, num_groups, gamma, beta, eps, channel_axis, num_threads)
    num_threads = resolve_num_threads(num_threads)
    if out is None:
        y = empty_output(x.shape, dtype)
    else:
        y = check_out(out, x.shape, dtype)
        if keep_cache:
            check_out_keeps_x(y, x, name)
    stats_dtype = compute_dtype(dtype)
    n_groups_total = layout.n_samples * layout.n_groups
    mean = np.empty(n_groups_total, stats_dtype) if keep_cache else None
    rstd = np.empty(n_groups_total, stats_dtype) if keep_cache else None
    if x.size > 0:
        # y exactly on top of x is safe (every group is read before it is written); any other
        # overlap gets a copy.
        x_data = protect_from_output(as_kernel_array(x, dtype), y)
        gamma, beta = (protect_from_output(p, y) for p in (gamma, beta))
        _kernels.group_norm_forward(x_data, gamma, beta, y, mean, rstd, layout.n_samples,
                                    layout.n_channels, layout.n_groups, layout.n_spatial,
                                    layout.channels_last, eps, _kernels.storage_code(dtype),
                                    num_threads)
    result = y if out is None else out  # y is a plain view of a subclass's out: return out
    if not keep_cache:
        return result
    cache = GroupNormCache(x, mean.reshape(layout.statistics_shape),
                           rstd.reshape(layout.statistics_shape), layout.n_groups,
                           layout.channel_axis, eps, dtype)
    return result, cache


def _backward(name, dy, cache, gamma, out, num_threads):
    """(dx, dgamma, dbeta). The checks are made in the order their errors are raised: dy, the
    cache, gamma, num_threads, out."""
    if type(cache) is GroupNormCache:
        result = _kernels.group_norm_backward_fast(
            dy, cache.x, cache.mean, cache.rstd, cache.num_groups, cache.channel_axis,
            cache.eps, cache.dtype, gamma, out, num_threads, name == "instance_norm")
        if result is not None:
            return result
    dy = as_array(dy, "dy")
    cache = check_cache(cache, dy, "group_norm", name)  # the checked copy: fields read once
    n_channels = cache.shape[cache.channel_axis]
    dtype = cache.dtype
    stats_dtype = compute_dtype(dtype)
    gamma = check_channel_param(gamma, "gamma", n_channels, stats_dtype)
    num_threads = resolve_num_threads(num_threads)
    dx = empty_output(cache.shape, dtype) if out is None else check_out(out, cache.shape, dtype)
    dgamma = np.zeros(n_channels, stats_dtype)
    dbeta = np.zeros(n_channels, stats_dtype)
    if cache.x.size > 0:
        n_samples = cache.shape[0]
        n_spatial = cache.x.size // (n_samples * n_channels)
        dy_data = protect_from_output(as_kernel_array(dy, dtype), dx)
        x_data = protect_from_output(as_kernel_array(cache.x, dtype), dx)
        gamma = protect_from_output(gamma, dx)
        mean = as_kernel_array(cache.mean, stats_dtype).reshape(-1)
        rstd = as_kernel_array(cache.rstd, stats_dtype).reshape(-1)
        _kernels.group_norm_backward(dy_data, x_data, gamma, mean, rstd, dx, dgamma, dbeta,
                                     n_samples, n_channels, cache.num_groups, n_spatial,
                                     cache.channel_axis > 1, cache.eps,
                                     _kernels.storage_code(dtype), num_threads)
    return dx if out is None else out, dgamma, dbeta


# ---------------------------------------------------------------------------------------------
# GroupNorm
# ---------------------------------------------------------------------------------------------

@shares_docs
def group_norm(x, num_groups, gamma=None, beta=None, eps=1e-5, *, channel_axis=1, out=None,
               num_threads=None):
    """Group normalization: ``gamma_c * (x - mean) / sqrt(var + eps) + beta_c``, with mean and
    (population) variance per sample and group of channels.

    The C channels are split into ``num_groups`` groups of ``C / num_groups`` consecutive
    channels; each (sample, group) is normalized over its channels and every spatial position,
    then each channel scaled and shifted by its own gamma and beta (ONNX GroupNormalization,
    opset 21; ``torch.nn.functional.group_norm``). Statistics are accumulated in float64,
    shifted by a value of the group itself, so groups with ``|mean| >> std`` keep their
    precision; results are identical for every ``num_threads`` and every batch.

    Parameters
    ----------
    x : array_like
        Shape ``(N, C, *spatial)`` with ``channel_axis=1`` (NCHW), ``(N, *spatial, C)`` with
        ``channel_axis=-1`` (channels last). float32 and float64 are computed as they are;
        integer and bool as float64. float16 and bfloat16 (``ml_dtypes``) are computed in
        float32 and returned in their own format. Any strides, order or byte order.
    num_groups : int
        A positive divisor of C.
    gamma, beta : array_like of shape ``(C,)``, optional
        Per-channel scale and shift, cast to the output dtype (to float32 for float16/bfloat16
        x); None means ones and zeros.
    eps : float, default 1e-5
        Added to the variance; a finite number >= 0.
    channel_axis : {1, -1}, default 1
    {forward_out}

    Examples
    --------
    >>> import numpy as np, fastln
    >>> x = np.array([[[1.0, 3.0], [10.0, 30.0]]])       # N=1, C=2, 2 positions
    >>> fastln.group_norm(x, 2, eps=0.0)                  # two groups: each channel alone
    array([[[-1.,  1.],
            [-1.,  1.]]])
    """
    return _forward("group_norm", x, num_groups, gamma, beta, eps, channel_axis, out,
                    num_threads, keep_cache=False)


def group_norm_forward(x, num_groups, gamma=None, beta=None, eps=1e-5, *, channel_axis=1,
                       out=None, num_threads=None):
    """Like :func:`group_norm`, and also returns the cache for :func:`group_norm_backward`.

    Returns
    -------
    y : ndarray
    cache : GroupNormCache
        ``cache.mean`` and ``cache.rstd`` have shape ``(N, num_groups)`` and y's dtype (float32
        for float16/bfloat16). The cache refers to x without copying it: do not modify x
        before calling the backward. For the same reason ``out`` may not overlap x here. A
        group whose rstd exceeds the dtype's range (a non-constant group of subnormal spread
        with eps = 0) has ``cache.rstd`` inf, and the backward takes its statistics again from
        x; a constant group with eps = 0 has inf too (its x_hat is 0).

    Examples
    --------
    >>> import numpy as np, fastln
    >>> y, cache = fastln.group_norm_forward(np.array([[[1.0, 3.0], [10.0, 30.0]]]), 1)
    >>> cache.mean, cache.num_groups
    (array([[11.]]), 1)
    """
    return _forward("group_norm", x, num_groups, gamma, beta, eps, channel_axis, out,
                    num_threads, keep_cache=True)


@shares_docs
def group_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """Gradients of :func:`group_norm_forward` with respect to x, gamma and beta.

    With ``x_hat`` the normalized x and ``dx_hat = dy * gamma_c``, per (sample, group) of n
    values::

        dx = rstd * (dx_hat - mean(dx_hat) - x_hat * mean(dx_hat * x_hat))
        dgamma_c = sum of dy * x_hat over the samples and positions of channel c
        dbeta_c = sum of dy over the same

    Parameters
    ----------
    {backward_dy}
    cache : GroupNormCache
        From :func:`group_norm_forward` (or :func:`instance_norm_forward`).
    {backward_out}
    dgamma, dbeta : ndarray of shape ``(C,)``
        Identical for every ``num_threads``; in y's dtype, except float32 for
        float16/bfloat16.

    Examples
    --------
    >>> import numpy as np, fastln
    >>> x = np.array([[[1.0, 3.0], [10.0, 30.0]]])
    >>> y, cache = fastln.group_norm_forward(x, 2)
    >>> dx, dgamma, dbeta = fastln.group_norm_backward(np.ones_like(y), cache)
    >>> bool(np.abs(dx).max() < 1e-12), dbeta           # a constant dy does not move x_hat
    (True, array([2., 2.]))
    """
    return _backward("group_norm", dy, cache, gamma, out, num_threads)


# ---------------------------------------------------------------------------------------------
# InstanceNorm: one group per channel
# ---------------------------------------------------------------------------------------------

def instance_norm(x, gamma=None, beta=None, eps=1e-5, *, channel_axis=1, out=None,
                  num_threads=None):
    """Instance normalization: each (sample, channel) normalized over its spatial positions,
    then scaled and shifted by the channel's gamma and beta (ONNX InstanceNormalization;
    ``torch.nn.functional.instance_norm`` without running statistics). :func:`group_norm` with
    ``num_groups = C``; the arguments are group_norm's.

    Examples
    --------
    >>> import numpy as np, fastln
    >>> fastln.instance_norm(np.array([[[1.0, 3.0], [10.0, 30.0]]]), eps=0.0)
    array([[[-1.,  1.],
            [-1.,  1.]]])
    """
    return _forward("instance_norm", x, None, gamma, beta, eps, channel_axis, out,
                    num_threads, keep_cache=False)


def instance_norm_forward(x, gamma=None, beta=None, eps=1e-5, *, channel_axis=1, out=None,
                          num_threads=None):
    """Like :func:`instance_norm`, and also returns the cache for
    :func:`instance_norm_backward`: a :class:`GroupNormCache` with ``num_groups = C`` (so
    :func:`group_norm_backward` takes it too), ``cache.mean`` and ``cache.rstd`` of shape
    ``(N, C)``.

    Examples
    --------
    >>> import numpy as np, fastln
    >>> y, cache = fastln.instance_norm_forward(np.array([[[1.0, 3.0], [10.0, 30.0]]]))
    >>> cache.mean, cache.num_groups
    (array([[ 2., 20.]]), 2)
    """
    return _forward("instance_norm", x, None, gamma, beta, eps, channel_axis, out,
                    num_threads, keep_cache=True)


def instance_norm_backward(dy, cache, gamma=None, *, out=None, num_threads=None):
    """Gradients of :func:`instance_norm_forward` (:func:`group_norm_backward` of its cache).
    A GroupNorm cache with fewer groups than channels is refused (ValueError).

    Examples
    --------
    >>> import numpy as np, fastln
    >>> y, cache = fastln.instance_norm_forward(np.array([[[1.0, 3.0], [10.0, 30.0]]]))
    >>> dx, dgamma, dbeta = fastln.instance_norm_backward(np.ones_like(y), cache)
    >>> dbeta
    array([2., 2.])
    """
    return _backward("instance_norm", dy, cache, gamma, out, num_threads)
