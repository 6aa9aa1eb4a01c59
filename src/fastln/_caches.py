"""The caches a forward returns for its backward, and the checks a backward makes of them.

Pure Python (fastln.reference builds and reads the same caches, also when the compiled kernels
cannot be loaded), so caches work across the two implementations.
"""
import math
import numbers

import numpy as np

from fastln._checks import output_dtype


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


# The statistics each operation's cache holds, and the shape they must have for x and axis.
_CACHE_STATISTICS = {
    "layer_norm": (("mean", "rstd"), lambda shape, axis: shape[:axis]),
    "rms_norm": (("rstd",), lambda shape, axis: shape[:axis]),
    "batch_norm": (("mean", "rstd"), lambda shape, axis: (shape[axis],)),
}


def _check_cache_contents(cache, op):
    """A cache's fields must still be what its forward made: a backward trusts their sizes."""
    x = cache.x
    if not isinstance(x, np.ndarray) or x.ndim == 0:
        raise ValueError(f"cache.x must be the forward's input array, got {type(x).__name__}")
    axis = cache.axis
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral) \
            or not 0 <= axis < x.ndim:
        raise ValueError(f"cache.axis must be an int in [0, {x.ndim}), got {axis!r}")
    if not isinstance(cache.eps, numbers.Real) or not 0 <= cache.eps < math.inf:
        raise ValueError(f"cache.eps must be a finite number >= 0, got {cache.eps!r}")
    names, expected_shape = _CACHE_STATISTICS[op]
    for name in names:
        statistic = getattr(cache, name)
        if not isinstance(statistic, np.ndarray) or statistic.dtype.kind != "f":
            raise ValueError(f"cache.{name} must be a floating ndarray, "
                             f"got {type(statistic).__name__}")
        if statistic.shape != tuple(expected_shape(x.shape, axis)):
            raise ValueError(f"cache.{name} has shape {statistic.shape}, expected "
                             f"{tuple(expected_shape(x.shape, axis))} for x of shape {x.shape}")
    dtype = cache.dtype
    if not isinstance(dtype, np.dtype) or dtype != output_dtype(x.dtype, "cache.x"):
        raise ValueError(f"cache.dtype {dtype!r} does not match cache.x ({x.dtype})")
    if op == "batch_norm" and not isinstance(cache.training, (bool, np.bool_)):
        raise ValueError(f"cache.training must be a bool, got {cache.training!r}")


def check_cache(cache, dy, op):
    """The cache must come from a forward of `op` with y of dy's shape and dtype."""
    if not hasattr(cache, "op") or not hasattr(cache, "x"):
        raise TypeError(f"cache must be the cache returned by {op}_forward, "
                        f"got {type(cache).__name__}")
    if cache.op != op:
        raise ValueError(f"cache comes from {cache.op}_forward; {op}_backward needs the cache "
                         f"of {op}_forward")
    _check_cache_contents(cache, op)
    if dy.shape != cache.shape:
        raise ValueError(f"dy has shape {dy.shape}, but the cache is for x of shape "
                         f"{cache.shape}")
    if dy.dtype.kind not in "fV" or dy.dtype.newbyteorder("=") != cache.dtype:
        raise ValueError(f"dy has dtype {dy.dtype.name}, expected {cache.dtype.name} "
                         "(the dtype of the forward's y)")
