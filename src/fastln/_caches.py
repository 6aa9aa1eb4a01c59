"""The caches a forward returns for its backward, and the checks a backward makes of them.

Pure Python (fastln.reference builds and reads the same caches, also when the compiled kernels
cannot be loaded), so caches work across the two implementations.
"""
import math
import numbers

import numpy as np

from fastln._checks import (
    check_dy_dtype,
    describe,
    group_layout,
    output_dtype,
    plain_ndarray,
    refuse_masked,
)


class RowNormCache:
    """The part of a row normalization's cache that LayerNorm and RMSNorm share.

    Attributes
    ----------
    x : ndarray
        The forward's input itself, not a copy: it must not be modified before the backward.
    rstd : ndarray of shape x.shape[:axis], in y's dtype (float32 for float16/bfloat16)
        Each row's 1 / sqrt(var + eps) (LayerNorm) or 1 / sqrt(mean(x**2) + eps) (RMSNorm).
        Where that exceeds the dtype's range (eps = 0 or nearly, and a spread below ~1e-38 in
        float32, ~1e-308 in float64) it is inf, its honest value in that dtype; the backward
        then takes that row's statistics again from x, in float64.
    axis : int
        The first normalized axis (non-negative).
    eps : float
    """

    op = None
    __slots__ = ("x", "rstd", "axis", "eps", "_dtype")

    def __init__(self, x, rstd, axis, eps, dtype=None):
        self.x = x
        self.rstd = rstd
        self.axis = axis
        self.eps = eps
        # y's dtype. fastln's forwards always pass it (fast and general path alike, so their
        # caches hold the same fields); None, for a cache built by hand, means rstd's dtype.
        self._dtype = dtype

    @property
    def shape(self):
        return self.x.shape

    @property
    def dtype(self):
        """y's dtype."""
        return self.rstd.dtype if self._dtype is None else self._dtype

    def __repr__(self):
        return (f"{type(self).__name__}(shape={self.shape}, axis={self.axis}, "
                f"dtype={self.dtype.name}, eps={self.eps})")


class LayerNormCache(RowNormCache):
    """What layer_norm_backward needs from a forward call, in O(rows) memory: the attributes of
    :class:`RowNormCache` and ``mean``, each row's mean (shape x.shape[:axis], rstd's dtype)."""

    op = "layer_norm"
    __slots__ = ("mean",)

    def __init__(self, x, mean, rstd, axis, eps, dtype=None):
        super().__init__(x, rstd, axis, eps, dtype)
        self.mean = mean


class RMSNormCache(RowNormCache):
    """What rms_norm_backward needs from a forward call, in O(rows) memory: the attributes of
    :class:`RowNormCache` (x is the sum ``s`` for
    :func:`fastln.add_rms_norm_forward`)."""

    op = "rms_norm"
    __slots__ = ()


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


class GroupNormCache:
    """What group_norm_backward (and instance_norm_backward) needs from a forward call, in
    O(N * num_groups) memory.

    Attributes
    ----------
    x : ndarray
        The forward's input itself, not a copy: it must not be modified before the backward.
    mean, rstd : ndarray of shape (N, num_groups), in y's dtype (float32 for float16/bfloat16)
        Each (sample, group)'s mean and 1 / sqrt(var + eps); rstd is inf where that exceeds
        the dtype's range (the backward then takes that group's statistics again from x).
    num_groups : int
        The groups of channels (``C`` for :func:`fastln.instance_norm_forward`, whose cache this
        is too).
    channel_axis : int
        1 (x of shape (N, C, *spatial)) or x.ndim - 1 (channels last).
    eps : float
    dtype : numpy.dtype
        y's dtype.
    """

    op = "group_norm"
    __slots__ = ("x", "mean", "rstd", "num_groups", "channel_axis", "eps", "dtype")

    def __init__(self, x, mean, rstd, num_groups, channel_axis, eps, dtype):
        self.x = x
        self.mean = mean
        self.rstd = rstd
        self.num_groups = num_groups
        self.channel_axis = channel_axis
        self.eps = eps
        self.dtype = dtype

    @property
    def shape(self):
        return self.x.shape

    def __repr__(self):
        return (f"GroupNormCache(shape={self.shape}, num_groups={self.num_groups}, "
                f"channel_axis={self.channel_axis}, dtype={self.dtype.name}, eps={self.eps})")


# The statistics each operation's cache holds, and the shape they must have for x and axis.
_CACHE_STATISTICS = {
    "layer_norm": (("mean", "rstd"), lambda shape, axis: shape[:axis]),
    "rms_norm": (("rstd",), lambda shape, axis: shape[:axis]),
    "batch_norm": (("mean", "rstd"), lambda shape, axis: (shape[axis],)),
}


def _checked_x(cache):
    x = cache.x
    refuse_masked(x, "cache.x")
    if not issubclass(type(x), np.ndarray) or plain_ndarray(x).ndim == 0:
        raise ValueError(f"cache.x must be the forward's input array, got {type(x).__name__}")
    return plain_ndarray(x)


def _checked_eps(cache):
    eps = cache.eps
    if not isinstance(eps, numbers.Real) or not 0 <= eps < math.inf:
        raise ValueError(f"cache.eps must be a finite number >= 0, got {describe(eps)}")
    try:
        return float(eps)
    except (OverflowError, ValueError):
        raise ValueError("cache.eps must be a finite number >= 0, got a number beyond float64")


def _checked_statistic(cache, name, expected_shape, x):
    statistic = getattr(cache, name)
    refuse_masked(statistic, f"cache.{name}")
    if (not issubclass(type(statistic), np.ndarray)
            or plain_ndarray(statistic).dtype.kind != "f"):
        raise ValueError(f"cache.{name} must be a floating ndarray, "
                         f"got {type(statistic).__name__}")
    statistic = plain_ndarray(statistic)
    if statistic.shape != expected_shape:
        raise ValueError(f"cache.{name} has shape {statistic.shape}, expected "
                         f"{expected_shape} for x of shape {x.shape}")
    return statistic


def _checked_dtype(cache, x):
    dtype = cache.dtype
    if not isinstance(dtype, np.dtype) or dtype != output_dtype(x.dtype, "cache.x"):
        raise ValueError(f"cache.dtype {describe(dtype)} does not match cache.x ({x.dtype})")
    return dtype


def _checked_group_norm(cache, x):
    """_checked_contents for a GroupNormCache: num_groups and channel_axis must describe x as
    the forward saw it (their errors name the cache's field)."""
    channel_axis = cache.channel_axis
    if isinstance(channel_axis, (bool, np.bool_)) or not isinstance(channel_axis, numbers.Integral) \
            or x.ndim < 2 or int(channel_axis) not in (1, x.ndim - 1):
        raise ValueError(f"cache.channel_axis must be 1 or {max(x.ndim - 1, 1)} for x of shape "
                         f"{x.shape}, got {describe(channel_axis)}")
    num_groups = cache.num_groups
    if isinstance(num_groups, (bool, np.bool_)) or not isinstance(num_groups, numbers.Integral):
        raise ValueError(f"cache.num_groups must be an int, got {describe(num_groups)}")
    try:
        layout = group_layout(x.shape, int(num_groups), int(channel_axis), "cache.num_groups")
    except (TypeError, ValueError) as error:
        raise ValueError(f"the cache does not describe x of shape {x.shape}: {error}") from None
    eps = _checked_eps(cache)
    mean = _checked_statistic(cache, "mean", layout.statistics_shape, x)
    rstd = _checked_statistic(cache, "rstd", layout.statistics_shape, x)
    dtype = _checked_dtype(cache, x)
    return GroupNormCache(x, mean, rstd, layout.n_groups, layout.channel_axis, eps, dtype)


def _checked_contents(cache, op):
    """A copy of the cache, of op's cache class, holding the fields once checked: they must
    still be what the forward made, since a backward trusts their sizes.

    Each field is read once, and arrays are taken as plain ndarrays on the cache's memory
    (see plain_ndarray): the sizes the backward hands the kernels come from these, not from a
    subclass's attributes or from a second read of a field that has changed since.
    """
    x = _checked_x(cache)
    if op == "group_norm":
        return _checked_group_norm(cache, x)
    axis = cache.axis
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral) \
            or not 0 <= axis < x.ndim:
        raise ValueError(f"cache.axis must be an int in [0, {x.ndim}), got {describe(axis)}")
    axis = int(axis)
    eps = _checked_eps(cache)
    names, expected_shape = _CACHE_STATISTICS[op]
    shape = tuple(expected_shape(x.shape, axis))
    statistics = {name: _checked_statistic(cache, name, shape, x) for name in names}
    dtype = _checked_dtype(cache, x)
    if op == "layer_norm":
        return LayerNormCache(x, statistics["mean"], statistics["rstd"], axis, eps, dtype)
    if op == "rms_norm":
        return RMSNormCache(x, statistics["rstd"], axis, eps, dtype)
    training = cache.training
    if not isinstance(training, (bool, np.bool_)):
        raise ValueError(f"cache.training must be a bool, got {describe(training)}")
    return BatchNormCache(x, statistics["mean"], statistics["rstd"], axis, eps, bool(training),
                          dtype)


def check_cache(cache, dy, op, name=None):
    """The cache must come from a forward of `op` with y of dy's shape and dtype; `name` is the
    operation the errors name (op itself by default: instance_norm's cache is group_norm's, and
    must have one group per channel).

    Returns the checked copy of the cache (see _checked_contents): a backward reads its fields
    from that copy, never again from the caller's object.
    """
    name = op if name is None else name
    if not hasattr(cache, "op") or not hasattr(cache, "x"):
        raise TypeError(f"cache must be the cache returned by {name}_forward, "
                        f"got {type(cache).__name__}")
    cache_op = cache.op
    if cache_op != op:
        raise ValueError(f"cache comes from {cache_op}_forward; {name}_backward needs the "
                         f"cache of {name}_forward")
    checked = _checked_contents(cache, op)
    if dy.shape != checked.shape:
        raise ValueError(f"dy has shape {dy.shape}, but the cache is for x of shape "
                         f"{checked.shape}")
    check_dy_dtype(dy, checked.dtype)
    if name == "instance_norm":
        n_channels = checked.shape[checked.channel_axis]
        if checked.num_groups != n_channels:
            raise ValueError(f"cache comes from group_norm_forward with num_groups="
                             f"{checked.num_groups}; instance_norm_backward needs one group per "
                             f"channel ({n_channels}): use group_norm_backward")
    return checked
