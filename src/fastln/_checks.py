"""Argument checking shared by every public function (kernels and reference alike).

Everything here runs before any work: a bad argument raises a TypeError or ValueError that names
it and says what was expected and what was given. Nothing here modifies its inputs. Pure Python
on purpose: fastln.reference uses these checks, and must keep working when the compiled kernels
cannot be loaded.
"""
import decimal
import math
import numbers
import operator
from typing import NamedTuple

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _describe_dtype(dtype):
    return dtype.name if dtype.isnative else f"{dtype.name} ({dtype.str})"


FLOAT32 = FLOAT_DTYPES[0]
FLOAT64 = FLOAT_DTYPES[1]


def is_bfloat16(dtype):
    """The bfloat16 of the ml_dtypes package (recognised without importing it)."""
    return dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16"


def is_half(dtype):
    """float16 or bfloat16: computed in float32 by the row kernels, stored in 16 bits."""
    return (dtype.kind == "f" and dtype.itemsize == 2) or is_bfloat16(dtype)


def compute_dtype(dtype):
    """The dtype of the parameters (gamma, beta, bias) and statistics for output `dtype`:
    float32 for the half formats (the precision they are computed in), else `dtype` itself."""
    return FLOAT32 if is_half(dtype) else dtype


def output_dtype(dtype, name="x"):
    """The dtype fastln computes and returns for an input of `dtype` (native byte order).

    float16, ml_dtypes' bfloat16, float32 and float64 keep their type; integer and bool inputs
    are converted to float64, as NumPy's reductions do. Everything else is a TypeError.
    """
    if (dtype.kind == "f" and dtype.itemsize in (4, 8)) or is_half(dtype):
        return dtype.newbyteorder("=")
    if dtype.kind in "biu":
        return FLOAT_DTYPES[1]
    if dtype.kind == "f":
        raise TypeError(
            f"{name} has dtype {dtype.name}, which fastln has no kernel for; expected float16, "
            f"bfloat16, float32 or float64 (convert with {name}.astype(np.float32))"
        )
    raise TypeError(
        f"{name} has dtype {_describe_dtype(dtype)}; expected a real floating, integer or bool "
        "array (float32 and float64 are computed as they are, integers and bool as float64)"
    )


def _holds_masked(value):
    """Whether value is a masked array, or a (nested) list or tuple holding one anywhere
    (numpy.ma.masked, the masked constant, is a masked array too)."""
    if isinstance(value, np.ma.MaskedArray):
        return True
    if not isinstance(value, (list, tuple)):
        return False
    # The types of the items, collected at C speed: a long list of numbers costs one pass.
    item_types = set(map(type, value))
    if any(issubclass(item_type, np.ma.MaskedArray) for item_type in item_types):
        return True
    return any(_holds_masked(item) for item in value if isinstance(item, (list, tuple)))


def refuse_masked(value, name):
    """A TypeError for masked arrays: fastln computes with every value it is given, so it
    refuses an array whose mask says some of them are not to be used (NumPy would hand over
    the masked values as if they were data)."""
    if _holds_masked(value):
        raise TypeError(
            f"{name} is a numpy.ma.MaskedArray (or holds one): fastln does not honour masks, "
            f"and would use the masked values as data; pass np.ma.getdata({name}) (or "
            f"{name}.filled(value)) to use every value, or remove the masked values first")


def plain_ndarray(array):
    """`array` (an ndarray of any subclass) as an exact numpy.ndarray on the same memory: the
    array itself when it is one already, else a view of it.

    The kernels take their data pointers, shapes and strides from the arrays the checks looked
    at, so those must be numpy's own. A subclass may override reshape, ravel, view, astype,
    copy, __getitem__, __array_function__, even shape, dtype or flags; none of them may decide
    the memory the kernels touch. ndarray.view is taken from the base class, which a subclass
    cannot override, and a view of type ndarray does not run the subclass's __array_finalize__.
    """
    if type(array) is np.ndarray:
        return array
    return np.ndarray.view(array, np.ndarray)


def as_array(value, name):
    """np.asarray with a clear error for things that are not numeric arrays.

    ndarrays of any subclass come back as a plain ndarray on the same memory (see
    plain_ndarray), never copied; masked arrays are refused (see refuse_masked).
    """
    refuse_masked(value, name)
    if issubclass(type(value), np.ndarray):
        return plain_ndarray(value)
    try:
        array = np.asarray(value)
    except MemoryError:
        raise
    except Exception as exc:  # also what an __array__, __len__ or __getitem__ of its own raises
        raise TypeError(f"{name} must be array-like, got {type(value).__name__}: "
                        f"{str(exc)[:200]}") from exc
    if array.dtype.kind in "OSUV":
        raise TypeError(f"{name} must be a numeric array, got {type(value).__name__} "
                        f"that converts to dtype {array.dtype}")
    return array


def describe(value, limit=60):
    """repr(value) for an error message, shortened when long: the repr of 10**400 has 401
    digits, and Python refuses to write an int of more than 4300 digits at all."""
    try:
        text = repr(value)
    except ValueError:
        return f"<{type(value).__name__} too large to print>"
    if len(text) > limit:
        text = f"{text[:limit // 2]}...{text[-10:]} ({len(text)} characters)"
    return text


def check_int_argument(value, name):
    """An int argument (an axis, a size) as a Python int: any integer type but bool, whose
    True would silently mean 1."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got a bool ({value!r})")
    if isinstance(value, np.timedelta64):  # registered as an integer, but a duration
        raise TypeError(f"{name} must be an int, got timedelta64")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def normalize_axis(axis, ndim):
    """The first normalized axis as a non-negative int; negative values count from the end."""
    index = check_int_argument(axis, "axis")
    if not -ndim <= index < ndim:
        raise ValueError(f"axis {describe(index)} is out of bounds for x with {ndim} "
                         "dimension(s)")
    return index % ndim


def real_number(value, name, requirement):
    """A real-number argument (int, float, Fraction, Decimal, NumPy scalar; not bool) as a
    float. TypeError for anything else; ValueError, saying `requirement`, for a value beyond
    float64 (10**400, Fraction(10**400, 3): float() would raise OverflowError) or that float
    cannot represent (a signalling Decimal NaN)."""
    # NumPy's timedelta64 is registered as an integer: a duration is not a number here.
    if (isinstance(value, (bool, np.bool_, np.timedelta64))
            or not isinstance(value, (numbers.Real, decimal.Decimal))):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        return float(value)
    except (OverflowError, ValueError, ArithmeticError):
        raise ValueError(f"{name} must be {requirement}, got {describe(value)}, which does "
                         "not convert to a float64") from None


def check_eps(eps):
    """eps as a float: a finite number >= 0."""
    requirement = "a finite number >= 0"
    value = real_number(eps, "eps", requirement)
    # The sign is taken from eps itself too: Fraction(-1, 10**400) rounds to -0.0.
    if not math.isfinite(value) or value < 0 or eps < 0:
        raise ValueError(f"eps must be {requirement}, got {describe(eps)}")
    return value


def check_num_threads(num_threads):
    """None (the default count, see fastln._threads.resolve_num_threads) or a positive int."""
    if num_threads is None:
        return None
    if (isinstance(num_threads, (bool, np.bool_, np.timedelta64))
            or not isinstance(num_threads, numbers.Integral) or num_threads < 1):
        raise ValueError(f"num_threads must be None or a positive int, got "
                         f"{describe(num_threads)}")
    return int(num_threads)


def rows_and_cols(shape, axis):
    """(n_rows, n_cols): one row per index of shape[:axis], normalized over shape[axis:]."""
    n_rows = math.prod(shape[:axis])
    n_cols = math.prod(shape[axis:])
    if n_cols == 0:
        raise ValueError(
            f"x.shape[axis:] = {tuple(shape[axis:])} is empty: there is nothing to normalize"
        )
    return n_rows, n_cols


def as_kernel_array(array, dtype):
    """A C-contiguous, aligned, native-order plain ndarray of `dtype`; a copy only when needed.

    (np.require keeps subclasses and calls their methods: it gets the plain view.)"""
    return np.require(plain_ndarray(array), dtype=dtype, requirements="CA")


def check_input(x, name="x"):
    """x as an ndarray with at least one dimension, and the dtype the result will have."""
    x = as_array(x, name)
    dtype = output_dtype(x.dtype, name)
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least 1 dimension, got a 0-d array")
    return x, dtype


def _real_array(param, name, dtype):
    """A parameter as an array of a real floating, integer or bool dtype (TypeError naming it
    otherwise); it is to be cast to `dtype`."""
    array = as_array(param, name)
    if array.dtype.kind not in "biuf" and not is_half(array.dtype):
        raise TypeError(f"{name} has dtype {_describe_dtype(array.dtype)}; expected a real "
                        f"floating, integer or bool array (it is cast to {dtype.name})")
    return array


def check_param(param, name, expected_shape, dtype):
    """gamma/beta: None, or an array of exactly `expected_shape`, cast to `dtype` and flattened."""
    if param is None:
        return None
    array = _real_array(param, name, dtype)
    if array.shape != tuple(expected_shape):
        raise ValueError(f"{name} has shape {array.shape}, expected x.shape[axis:] = "
                         f"{tuple(expected_shape)}")
    return as_kernel_array(array, dtype).reshape(-1)


def check_out(out, shape, dtype, name="out"):
    """A caller's output buffer must be a writeable C-contiguous ndarray of shape and dtype.

    Returns the array to write: out itself, or for a subclass of ndarray a plain ndarray on
    out's memory (see plain_ndarray), whose attributes are the ones checked here. A function
    that writes it still returns the caller's own out.
    """
    if not issubclass(type(out), np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(out).__name__}")
    refuse_masked(out, name)
    out = plain_ndarray(out)
    if out.shape != tuple(shape):
        raise ValueError(f"{name} has shape {out.shape}, expected {tuple(shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{name} has dtype {_describe_dtype(out.dtype)}, expected {dtype.name}")
    if not out.flags.c_contiguous or not out.flags.aligned:
        raise ValueError(f"{name} must be C-contiguous and aligned")
    if not out.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return out


def check_out_keeps_x(out, x, op):
    """A forward that returns a cache keeps x for the backward, so out must not overwrite it."""
    if np.may_share_memory(plain_ndarray(out), plain_ndarray(x)):
        raise ValueError(f"out overlaps x: {op}_forward keeps x for the backward pass; use "
                         f"fastln.{op} for an in-place forward")


def check_out_spares_running(out, running_mean, running_var, training):
    """Training mode updates running_mean and running_var in place: out must not overlap them
    (fastln.batch_norm and fastln.reference.batch_norm alike)."""
    if training and running_mean is not None and (
            np.may_share_memory(plain_ndarray(out), plain_ndarray(running_mean))
            or np.may_share_memory(plain_ndarray(out), plain_ndarray(running_var))):
        raise ValueError("out overlaps running_mean or running_var, which training mode "
                         "updates")


def same_memory(a, b):
    """True when a and b start at the same address with the same C-contiguous layout."""
    a, b = plain_ndarray(a), plain_ndarray(b)
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides)


def protect_from_output(array, out):
    """`array` itself if writing `out` cannot clobber it before it is read, else a copy.

    Element i of every row is read before element i of the output is written, so an output
    exactly on top of an input is safe (in place); any other overlap is not.
    """
    if array is None:
        return array
    array, out = plain_ndarray(array), plain_ndarray(out)
    if not np.may_share_memory(array, out):
        return array
    if array.size == out.size and same_memory(array, out.reshape(array.shape)):
        return array
    return array.copy()


def check_dy_dtype(dy, dtype):
    """dy of a backward: in the dtype of the forward's y (any byte order), never cast."""
    if dy.dtype.kind not in "fV" or dy.dtype.newbyteorder("=") != dtype:
        raise ValueError(f"dy has dtype {dy.dtype.name}, expected {dtype.name} (the dtype of "
                         "the forward's y)")


def check_residual(residual, x):
    """residual: a real array of exactly x's shape (no broadcasting); cast later to y's dtype."""
    residual = as_array(residual, "residual")
    output_dtype(residual.dtype, "residual")  # TypeError for complex, object, ...
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {residual.shape}, expected x.shape = {x.shape}")
    return residual


# BatchNorm's arguments: one mean and variance per feature (x.shape[axis]), over every other axis.

def feature_layout(shape, axis):
    """(n_outer, n_features, n_inner): x as a C-order (outer, feature, inner) block."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])


def check_feature_param(param, name, n_features, dtype):
    """gamma/beta of BatchNorm: None, or shape (x.shape[axis],), cast to the parameter dtype of
    output `dtype` (compute_dtype), as float64."""
    if param is None:
        return None
    dtype = compute_dtype(dtype)
    array = _real_array(param, name, dtype)
    if array.shape != (n_features,):
        raise ValueError(f"{name} has shape {array.shape}, expected (x.shape[axis],) = "
                         f"({n_features},)")
    # Cast to y's dtype first (as LayerNorm does with its parameters), then to float64 for the
    # per-feature constants.
    return np.array(array.astype(dtype), dtype=FLOAT64)


def check_running(running, name, n_features, training):
    """running_mean / running_var: shape (x.shape[axis],).

    In training mode they are updated in place, so they must be writeable ndarrays of a real
    floating dtype, ml_dtypes' bfloat16 included (any strides and byte order). In evaluation
    mode they are only read: any real array_like. Returns the array to update (training) or a
    float64 copy (evaluation).
    """
    if training and not issubclass(type(running), np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray (it is updated in place in training "
                        f"mode), got {type(running).__name__}")
    array = as_array(running, name)
    kinds = "f" if training else "biuf"
    if array.dtype.kind not in kinds and not is_bfloat16(array.dtype):
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
    requirement = "in [0, 1] (the weight of the old running value)"
    value = real_number(momentum, "momentum", requirement)
    # The bounds are checked on momentum itself too: Fraction(10**400 + 1, 10**400) rounds to 1.
    if not 0.0 <= value <= 1.0 or not 0 <= momentum <= 1:
        raise ValueError(f"momentum must be {requirement}, got {describe(momentum)}")
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
    num_threads = check_num_threads(num_threads)
    if training and n_features > 0 and n_outer * n_inner == 0:
        raise ValueError(f"batch_norm in training mode needs at least one value per feature; "
                         f"x has shape {x.shape} with feature axis {axis}")
    return (x, dtype, axis, (n_outer, n_features, n_inner), gamma, beta, running_mean,
            running_var, training, momentum, eps, num_threads)


# GroupNorm's arguments: x is (N, C, *spatial) with channel_axis=1, (N, *spatial, C) with
# channel_axis=-1; statistics per (sample, group of C / num_groups channels).

class GroupLayout(NamedTuple):
    """x as (n_samples, n_channels, n_spatial) - channels first - or (n_samples, n_spatial,
    n_channels) - channels last; channel_axis is 1 or x.ndim - 1."""
    n_samples: int
    n_channels: int
    n_groups: int
    n_spatial: int
    channel_axis: int

    @property
    def channels_last(self):
        # For (N, C) arrays both layouts are the same: one spatial position.
        return self.channel_axis > 1

    @property
    def statistics_shape(self):
        """The shape of a cache's mean and rstd: (N, num_groups)."""
        return (self.n_samples, self.n_groups)


def normalize_channel_axis(channel_axis, ndim, name="channel_axis"):
    """1 (channels first, as NCHW) or ndim - 1 (channels last); -1 counts from the end."""
    index = check_int_argument(channel_axis, name)
    if ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (N, C, *spatial), got {ndim}")
    if index not in (1, -1, ndim - 1):
        raise ValueError(f"{name} must be 1 (x of shape (N, C, *spatial)) or -1 (x of shape "
                         f"(N, *spatial, C)), got {describe(index)}")
    return 1 if index == 1 else ndim - 1


def group_layout(shape, num_groups, channel_axis, name="num_groups"):
    """The GroupLayout of x's shape; num_groups None means one group per channel (InstanceNorm).
    num_groups must be a positive int dividing the channel count."""
    axis = normalize_channel_axis(channel_axis, len(shape))
    n_channels = shape[axis]
    if n_channels == 0:
        raise ValueError(f"x has shape {tuple(shape)}: no channels along axis {axis}")
    if num_groups is None:
        groups = n_channels
    else:
        groups = check_int_argument(num_groups, name)
        if groups < 1 or n_channels % groups != 0:
            raise ValueError(f"{name} must be a positive int dividing the {n_channels} "
                             f"channels of x, got {describe(groups)}")
    spatial = shape[2:] if axis == 1 else shape[1:-1]
    n_spatial = math.prod(spatial)
    if n_spatial == 0:
        raise ValueError(f"x has shape {tuple(shape)}: its spatial extent {tuple(spatial)} is "
                         "empty, so a group has nothing to normalize")
    return GroupLayout(shape[0], n_channels, groups, n_spatial, axis)


def check_channel_param(param, name, n_channels, dtype):
    """gamma/beta of GroupNorm: None, or shape (C,), cast to `dtype` (the parameter dtype)."""
    if param is None:
        return None
    array = _real_array(param, name, dtype)
    if array.shape != (n_channels,):
        raise ValueError(f"{name} has shape {array.shape}, expected (C,) = ({n_channels},), "
                         "one value per channel")
    return as_kernel_array(array, dtype)


def check_group_norm_args(x, num_groups, gamma, beta, eps, channel_axis, num_threads):
    """Every check of group_norm's arguments, before any work (num_groups None: one group per
    channel); returns x, its output dtype, the GroupLayout, gamma, beta, eps, num_threads."""
    x, dtype = check_input(x)
    layout = group_layout(x.shape, num_groups, channel_axis)
    stats_dtype = compute_dtype(dtype)
    gamma = check_channel_param(gamma, "gamma", layout.n_channels, stats_dtype)
    beta = check_channel_param(beta, "beta", layout.n_channels, stats_dtype)
    eps = check_eps(eps)
    num_threads = check_num_threads(num_threads)
    return x, dtype, layout, gamma, beta, eps, num_threads
