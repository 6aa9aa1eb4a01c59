"""Normalization layers for models written in NumPy: ``LayerNorm``, ``RMSNorm``, ``BatchNorm``,
``GroupNorm``, ``InstanceNorm``.

Each layer owns its parameters as NumPy arrays, named as in PyTorch (``weight`` is the scale
gamma, ``bias`` the shift beta), so the ``state_dict`` of the matching ``torch.nn`` layer loads
unchanged and ours loads into torch after ``torch.from_numpy``::

    import numpy as np
    import fastln.nn

    norm = fastln.nn.LayerNorm(64)
    y = norm(x)                      # forward; keeps what the backward needs
    dx = norm.backward(dy)           # returns dx; adds to norm.weight_grad and norm.bias_grad
    for param, grad in zip(norm.parameters(), norm.grads()):
        param -= 0.1 * grad          # parameters() are the live arrays
    norm.zero_grad()

    norm.load_state_dict(torch_layer.state_dict())                       # torch -> fastln
    torch_layer.load_state_dict({k: torch.from_numpy(v)
                                 for k, v in norm.state_dict().items()})  # fastln -> torch

Conventions shared by the layers:

- **One dtype per layer** (``dtype=np.float32`` by default). Parameters, buffers and gradients
  have it, and inputs are converted to it (no copy when they already have it), as Keras converts
  inputs to a layer's compute dtype: ``np.random.randn`` gives float64, and feeding it to a
  float32 model should not silently turn the whole model into float64.
- **One forward, one backward.** ``forward`` keeps the cache of its most recent call (it refers
  to the input without copying it: do not modify x in place before the backward); ``backward``
  uses it once. A backward without a forward, or a second backward for the same forward, raises
  ``RuntimeError``. A layer used at two places in a model needs two instances.
- **Gradients accumulate** into ``weight_grad`` / ``bias_grad`` (zeros at construction) until
  ``zero_grad()``, which zeroes them in place, like PyTorch's ``.grad``.
- ``train()`` / ``eval()`` set ``training``. Only BatchNorm behaves differently (batch statistics
  while training, running statistics in evaluation); the others compute exactly the
  same thing in both modes (each sample is normalized with its own statistics).
- ``state_dict()`` returns copies; ``load_state_dict()`` checks every key, shape and dtype before
  changing anything and then writes into the existing arrays, so references an optimizer holds
  stay valid. ``save(path)`` / ``load(path)`` store and read the state dict as ``.npz``.
"""
import math
import numbers
import os
import zipfile
from collections import namedtuple

import numpy as np

import fastln
from fastln._batch_norm import update_running
from fastln._checks import (
    as_array,
    check_eps,
    check_int_argument,
    check_momentum,
    check_running,
    describe,
    is_bfloat16,
    refuse_masked,
)
from fastln._threads import resolve_num_threads

__all__ = ["BatchNorm", "GroupNorm", "InstanceNorm", "LayerNorm", "RMSNorm"]

_MAX_BATCH_COUNT = 2**63 - 1  # num_batches_tracked is an int64, as in torch

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])
IncompatibleKeys.__doc__ = "What load_state_dict(strict=False) skipped, as in PyTorch."


def _layer_dtype(dtype):
    if dtype is None:  # as torch's dtype=None: the default, float32 (np.dtype(None) is float64)
        return _FLOAT_DTYPES[0]
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if resolved not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32 or float64, got {resolved.name}")
    return resolved


def _normalized_shape(normalized_shape):
    """An int or a sequence of ints (not bools), each >= 1, as a non-empty tuple."""
    if (isinstance(normalized_shape, (numbers.Integral, np.integer))
            and not isinstance(normalized_shape, (bool, np.bool_))):
        normalized_shape = (normalized_shape,)
    try:
        shape = tuple(check_int_argument(size, "normalized_shape") for size in normalized_shape)
    except TypeError:
        raise TypeError(f"normalized_shape must be an int or a tuple of ints (not bools), got "
                        f"{describe(normalized_shape)}") from None
    if not shape or any(size < 1 for size in shape):
        raise ValueError(f"normalized_shape must be a non-empty tuple of positive ints, got "
                         f"{describe(normalized_shape)}")
    _check_allocatable(math.prod(shape), "normalized_shape", normalized_shape)
    return shape


def _check_allocatable(n_elements, name, given):
    """A ValueError naming the argument, where NumPy would say "Maximum allowed dimension
    exceeded" or "array is too big" (a size that fits memory but not this machine's is still
    a MemoryError when the arrays are made)."""
    if n_elements * np.dtype(np.float64).itemsize > np.iinfo(np.intp).max:
        raise ValueError(f"{name} {describe(given)} is too large for an array")


def _check_feature_count(value, name):
    """num_features / num_channels: a positive int small enough for an array."""
    count = check_int_argument(value, name)
    if count < 1:
        raise ValueError(f"{name} must be a positive int, got {describe(count)}")
    _check_allocatable(count, name, count)
    return count


def _check_bool(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _as_numpy(value, key):
    """A state-dict entry as an ndarray: NumPy arrays, PyTorch tensors, anything array-like
    (not a masked array: np.asarray would drop its mask)."""
    refuse_masked(value, f"state_dict[{key!r}]")
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch.Tensor, without torch
        try:
            value = value.detach().cpu()
            if str(value.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: float32 holds
                value = value.float()                 # every bfloat16 exactly
            value = value.numpy()
        except (TypeError, RuntimeError) as exc:
            raise TypeError(f"state_dict[{key!r}]: cannot convert the tensor to NumPy: "
                            f"{exc}") from None
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"state_dict[{key!r}] must be array-like, got "
                        f"{type(value).__name__}: {exc}") from None
    if is_bfloat16(array.dtype):  # ml_dtypes' bfloat16: exactly float32 too
        array = array.astype(np.float32)
    return array


def _saved_file(path):
    """The file save(path) writes: path itself when it ends with .npz (or is a file object),
    else path + ".npz", as np.savez names it. When that does not exist, path as it is."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return path
    name = os.fspath(path)
    suffix = b".npz" if isinstance(name, bytes) else ".npz"
    if name.endswith(suffix) or not os.path.exists(name + suffix):
        return name
    return name + suffix


def _declared_shape(archive, key):
    """The shape the header of an .npz entry declares, read without its data (None when the
    header is not one NumPy's public readers take; reading the entry then tells)."""
    member = key + ".npy" if key + ".npy" in archive.zip.namelist() else key
    readers = {(1, 0): np.lib.format.read_array_header_1_0,
               (2, 0): np.lib.format.read_array_header_2_0}
    try:
        with archive.zip.open(member) as f:
            reader = readers.get(np.lib.format.read_magic(f))
            return None if reader is None else tuple(reader(f)[0])
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile):
        return None


class _Layer:
    """What the layers share: modes, parameters, gradients, state dicts, files.

    A subclass sets ``_param_names`` (attributes holding parameters or None) and
    ``_buffer_names`` (non-trained state that is saved, such as running statistics), and
    implements ``_check_input_shape(shape)``, ``_forward(x) -> (y, cache)`` and
    ``_backward(dy, cache) -> (dx, grads)`` with ``grads`` a dict from parameter name to its
    gradient.
    """

    _param_names = ("weight", "bias")
    _buffer_names = ()

    def __init__(self, dtype, num_threads):
        self.dtype = _layer_dtype(dtype)
        if num_threads is not None:
            resolve_num_threads(num_threads)  # ValueError naming it
        self.num_threads = num_threads
        self.training = True
        self._cache = None
        self._cache_used = False

    # -- modes -------------------------------------------------------------------------------

    def train(self, mode=True):
        """Training mode (or evaluation mode for ``mode=False``); returns the layer."""
        self.training = _check_bool(mode, "mode")
        return self

    def eval(self):
        """Evaluation mode, the same as ``train(False)``; returns the layer."""
        return self.train(False)

    # -- forward and backward ----------------------------------------------------------------

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):
        """y for input x; keeps the cache for one :meth:`backward`."""
        x = self._as_input(x, "x")
        self._check_input_shape(x.shape)
        y, cache = self._forward(x)
        self._cache, self._cache_used = cache, False
        return y

    def backward(self, dy):
        """dx for the gradient dy of the most recent forward's output.

        Adds the parameters' gradients to ``weight_grad`` / ``bias_grad``. Raises RuntimeError
        without a forward, or when this forward's backward has already run.
        """
        name = type(self).__name__
        if self._cache is None:
            if self._cache_used:
                raise RuntimeError(
                    f"{name}.backward() was already called for the last forward: each forward "
                    "allows one backward (a second would add the parameter gradients twice); "
                    "run the forward again first")
            raise RuntimeError(f"{name}.backward() called before any forward: call the layer "
                               "on an input first, then backward with the gradient of its output")
        cache = self._cache
        dy = self._as_input(dy, "dy")
        if dy.shape != cache.shape:
            raise ValueError(f"dy has shape {dy.shape}, but the last forward's output has shape "
                             f"{cache.shape}")
        dx, grads = self._backward(dy, cache)
        for param_name, grad in grads.items():
            getattr(self, param_name + "_grad")[...] += grad
        # The cache is used: drop it (it holds the input alive) and remember why it is gone.
        self._cache, self._cache_used = None, True
        return dx

    def _as_input(self, array, name):
        """array (x or dy) in the layer's dtype; no copy when it has it already."""
        array = as_array(array, name)
        if array.dtype.kind not in "biuf" and not is_bfloat16(array.dtype):
            raise TypeError(f"{name} has dtype {array.dtype}; expected a real floating, integer "
                            f"or bool array (it is converted to the layer's {self.dtype.name})")
        if array.dtype != self.dtype:
            array = array.astype(self.dtype)
        return array

    # -- parameters and gradients ------------------------------------------------------------

    def named_parameters(self):
        """{name: parameter}: the live arrays (update them in place)."""
        return {name: getattr(self, name) for name in self._param_names
                if getattr(self, name) is not None}

    def parameters(self):
        """The parameters as a list of live arrays (update them in place)."""
        return list(self.named_parameters().values())

    def grads(self):
        """The accumulated gradients, in the order of :meth:`parameters`."""
        return [getattr(self, name + "_grad") for name in self.named_parameters()]

    def zero_grad(self):
        """Set every accumulated gradient to zero, in place."""
        for grad in self.grads():
            grad[...] = 0

    def _make_param(self, size_or_shape, fill):
        shape = (size_or_shape,) if isinstance(size_or_shape, int) else size_or_shape
        return np.full(shape, fill, self.dtype), np.zeros(shape, self.dtype)

    # -- state -------------------------------------------------------------------------------

    def _state_names(self):
        return list(self.named_parameters()) + list(self._buffer_names)

    def state_dict(self):
        """{name: copy of the array}: parameters, then buffers, in PyTorch's order and names."""
        return {name: np.array(getattr(self, name), copy=True) for name in self._state_names()}

    def load_state_dict(self, state_dict, strict=True):
        """Load parameters and buffers from a dict of arrays (or of PyTorch tensors).

        Every value must have exactly the shape of the layer's array and a dtype that converts
        to it without loss (``np.can_cast(..., 'safe')``: a float64 array does not load into a
        float32 layer; build the layer with ``dtype=np.float64`` or convert the array). All
        checks run before anything changes; then values are copied into the existing arrays.

        With ``strict=True`` (the default) the keys must be exactly those of
        :meth:`state_dict`; with ``strict=False`` missing and unexpected keys are skipped and
        returned as ``(missing_keys, unexpected_keys)``.
        """
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"state_dict must be a mapping of names to arrays, got "
                            f"{type(state_dict).__name__}")
        expected = self._state_names()
        missing = [key for key in expected if key not in state_dict]
        unexpected = [key for key in state_dict.keys() if key not in expected]
        if strict and (missing or unexpected):
            problems = []
            if missing:
                problems.append(f"missing key(s) {', '.join(map(repr, missing))}")
            if unexpected:
                problems.append(f"unexpected key(s) {', '.join(map(repr, unexpected))}")
            raise KeyError(f"{type(self).__name__}.load_state_dict: {'; '.join(problems)} "
                           f"(expected exactly {', '.join(map(repr, expected))}; pass "
                           "strict=False to load the keys that match)")
        converted = {}
        for key in expected:
            if key in state_dict:
                converted[key] = self._check_state_value(key, _as_numpy(state_dict[key], key))
        for key, value in converted.items():
            self._assign_state(key, value)
        return IncompatibleKeys(missing, unexpected)

    def _check_state_value(self, key, value):
        target = np.asarray(getattr(self, key))
        if not target.flags.writeable:  # found now, not after other arrays were written
            raise ValueError(f"{type(self).__name__}.{key} is read-only: load_state_dict "
                             "writes the values into the layer's own arrays")
        if value.shape != target.shape:
            raise ValueError(f"state_dict[{key!r}] has shape {value.shape}, but "
                             f"{type(self).__name__}.{key} has shape {target.shape}")
        if value.dtype.kind not in "biuf" or not np.can_cast(value.dtype, target.dtype, "safe"):
            raise TypeError(f"state_dict[{key!r}] has dtype {value.dtype}, which does not "
                            f"convert to {type(self).__name__}.{key}'s {target.dtype} without "
                            f"loss (build the layer with a matching dtype= or convert the "
                            "array first)")
        return value

    def _assign_state(self, key, value):
        getattr(self, key)[...] = value

    def save(self, path):
        """Write :meth:`state_dict` to ``path`` as ``.npz`` (NumPy appends ``.npz`` if absent)."""
        np.savez(path, **self.state_dict())

    def load(self, path):
        """Load a ``.npz`` written by :meth:`save` (strictly, as :meth:`load_state_dict`).

        ``path`` may omit the ``.npz`` that :meth:`save` added: ``load(p)`` reads the file
        ``save(p)`` wrote, ``p + ".npz"``, also when a file named ``p`` exists beside it (``p``
        itself is read only when there is no ``p + ".npz"``). Returns the layer.
        """
        path = _saved_file(path)
        not_saved = f"{describe(path)} is not an .npz archive written by save()"
        try:
            archive = np.load(path, allow_pickle=False)
        except (ValueError, EOFError, zipfile.BadZipFile) as exc:  # not NumPy's; pickled data
            raise ValueError(f"{not_saved}: {exc}") from None
        if not isinstance(archive, np.lib.npyio.NpzFile):  # a .npy: one array, no names
            raise ValueError(f"{not_saved}: it holds a single array")
        with archive:
            expected = {name: np.shape(getattr(self, name)) for name in self._state_names()}
            state = {}
            for key in archive.files:
                if key not in expected:  # refused by name below: its data is never read
                    state[key] = None
                    continue
                # The header declares the array's shape, and NumPy allocates that much before
                # it reads the data: a forged (1e11,) is a MemoryError, or gigabytes.
                declared = _declared_shape(archive, key)
                if declared is not None and math.prod(declared) > math.prod(expected[key]):
                    raise ValueError(f"state_dict[{key!r}] has shape {declared}, but "
                                     f"{type(self).__name__}.{key} has shape {expected[key]}")
                try:
                    state[key] = archive[key]
                except (ValueError, EOFError, zipfile.BadZipFile) as exc:  # object arrays, ...
                    raise ValueError(f"{not_saved}: entry {key!r}: {exc}") from None
        self.load_state_dict(state)
        return self


class _TrailingNorm(_Layer):
    """LayerNorm and RMSNorm: statistics over the trailing ``normalized_shape`` axes."""

    def __init__(self, normalized_shape, eps, elementwise_affine, bias, dtype, num_threads):
        super().__init__(dtype, num_threads)
        self.normalized_shape = _normalized_shape(normalized_shape)
        self.axis = -len(self.normalized_shape)
        self.eps = check_eps(eps)
        self.elementwise_affine = _check_bool(elementwise_affine, "elementwise_affine")
        self.weight = self.weight_grad = None
        if self.elementwise_affine:
            self.weight, self.weight_grad = self._make_param(self.normalized_shape, 1)
        if "bias" in self._param_names:
            self.bias = self.bias_grad = None
            if _check_bool(bias, "bias") and self.elementwise_affine:
                self.bias, self.bias_grad = self._make_param(self.normalized_shape, 0)

    def _check_input_shape(self, shape):
        size = len(self.normalized_shape)
        if len(shape) < size or tuple(shape[-size:]) != self.normalized_shape:
            expected = ", ".join(["..."] + [str(n) for n in self.normalized_shape])
            raise ValueError(f"{type(self).__name__} with normalized_shape="
                             f"{self.normalized_shape} expects x of shape ({expected}), got "
                             f"shape {tuple(shape)}")


class LayerNorm(_TrailingNorm):
    """Layer normalization over the trailing ``normalized_shape`` axes, as ``torch.nn.LayerNorm``.

    ``y = weight * (x - mean) / sqrt(var + eps) + bias`` with the mean and the (biased)
    variance of each sample over its last ``len(normalized_shape)`` axes, computed by
    :func:`fastln.layer_norm_forward` / :func:`fastln.layer_norm_backward`. The same in
    training and evaluation mode.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        The trailing shape of the inputs; ``axis = -len(normalized_shape)``.
    eps : float, default 1e-5
    elementwise_affine : bool, default True
        Learn ``weight`` (ones at first); False leaves ``weight`` None (a scale of 1).
    bias : bool, default True
        Learn ``bias`` (zeros at first) when elementwise_affine; otherwise ``bias`` is None.
    dtype : float32 or float64, default float32
    num_threads : int, optional
        OpenMP threads for the kernels (None: OpenMP's default).
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 dtype=np.float32, *, num_threads=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, dtype, num_threads)

    def _forward(self, x):
        return fastln.layer_norm_forward(x, self.weight, self.bias, self.eps, axis=self.axis,
                                         num_threads=self.num_threads)

    def _backward(self, dy, cache):
        dx, dweight, dbias = fastln.layer_norm_backward(dy, cache, self.weight,
                                                        num_threads=self.num_threads)
        grads = {}
        if self.weight is not None:
            grads["weight"] = dweight
        if self.bias is not None:
            grads["bias"] = dbias
        return dx, grads

    def __repr__(self):
        return (f"LayerNorm({self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}, "
                f"dtype={self.dtype.name})")


class RMSNorm(_TrailingNorm):
    """RMS normalization over the trailing ``normalized_shape`` axes, as ``torch.nn.RMSNorm``.

    ``y = weight * x / sqrt(mean(x**2) + eps)`` per sample: no mean subtraction and no bias
    (the state dict holds ``weight`` only), computed by :func:`fastln.rms_norm_forward` /
    :func:`fastln.rms_norm_backward`. The same in training and evaluation mode.

    Parameters
    ----------
    normalized_shape : int or tuple of int
    eps : float or None, default 1e-5
        None means ``np.finfo(dtype).eps``, which is what ``torch.nn.RMSNorm``'s default
        ``eps=None`` uses; pass None to match a torch layer built without eps.
    elementwise_affine : bool, default True
    dtype : float32 or float64, default float32
    num_threads : int, optional
    """

    _param_names = ("weight",)

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, dtype=np.float32,
                 *, num_threads=None):
        if eps is None:
            eps = float(np.finfo(_layer_dtype(dtype)).eps)
        super().__init__(normalized_shape, eps, elementwise_affine, False, dtype, num_threads)

    def _forward(self, x):
        return fastln.rms_norm_forward(x, self.weight, self.eps, axis=self.axis,
                                       num_threads=self.num_threads)

    def _backward(self, dy, cache):
        dx, dweight = fastln.rms_norm_backward(dy, cache, self.weight,
                                               num_threads=self.num_threads)
        return dx, ({"weight": dweight} if self.weight is not None else {})

    def __repr__(self):
        return (f"RMSNorm({self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, dtype={self.dtype.name})")


class BatchNorm(_Layer):
    """Batch normalization of the features along ``axis``, as ``torch.nn.BatchNorm1d``.

    In training mode each feature is normalized with the mean and (biased) variance of its
    values in the batch (over every axis but ``axis``), and the running statistics follow them::

        running_mean = momentum * running_mean + (1 - momentum) * batch_mean
        running_var  = momentum * running_var  + (1 - momentum) * batch_var

    In evaluation mode the running statistics are used instead and never change. This is
    :func:`fastln.batch_norm_forward` / :func:`fastln.batch_norm_backward`.

    **Against PyTorch.** The state dict has torch's keys: ``weight``, ``bias``,
    ``running_mean``, ``running_var``, ``num_batches_tracked`` (a 0-d int64 count of training
    batches). Two conventions differ, and the defaults are the formulas above:

    - ``momentum`` is the weight of the OLD running value (the alpha of
      ``running = alpha * running + (1 - alpha) * batch``, Keras' momentum); torch's weighs the new batch. ``torch_momentum = 1 - momentum``, so the
      defaults agree (0.9 here, 0.1 in torch). ``momentum=None`` is torch's cumulative average
      (the new batch weighs ``1 / num_batches_tracked``).
    - The running variance takes the batch's biased variance (divide by m, the variance
      the batch is normalized with, as Keras does); torch's takes the unbiased one (divide by m - 1).
      ``unbiased_running_var=True`` follows torch, so that the running statistics of a layer
      trained here and a torch layer trained on the same batches agree; a batch with one value
      per feature then raises, as in torch. The normalization itself always uses the biased
      variance, in both libraries.

    Parameters
    ----------
    num_features : int
        ``x.shape[axis]``.
    eps : float, default 1e-5
    momentum : float in [0, 1] or None, default 0.9
    axis : int, default -1
        The feature axis: -1 for (N, C) activations; 1 for torch's (N, C, L) layout.
    affine : bool, default True
        Learn ``weight`` (ones) and ``bias`` (zeros); False leaves both None.
    track_running_stats : bool, default True
        Keep running statistics. False keeps none: batch statistics are then used in both
        modes, as in torch.
    unbiased_running_var : bool, default False
        See above.
    dtype : float32 or float64, default float32
        Also the dtype of the running statistics (updated in float64, stored in this dtype).
    num_threads : int, optional
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.9, axis=-1, affine=True,
                 track_running_stats=True, dtype=np.float32, *, unbiased_running_var=False,
                 num_threads=None):
        super().__init__(dtype, num_threads)
        count = _check_feature_count(num_features, "num_features")
        self.num_features = count
        self.eps = check_eps(eps)
        if momentum is not None:
            momentum = check_momentum(momentum)
        self.momentum = momentum
        self.axis = check_int_argument(axis, "axis")
        self.affine = _check_bool(affine, "affine")
        self.track_running_stats = _check_bool(track_running_stats, "track_running_stats")
        self.unbiased_running_var = _check_bool(unbiased_running_var, "unbiased_running_var")
        self.weight = self.weight_grad = self.bias = self.bias_grad = None
        if self.affine:
            self.weight, self.weight_grad = self._make_param(self.num_features, 1)
            self.bias, self.bias_grad = self._make_param(self.num_features, 0)
        self.running_mean = self.running_var = self.num_batches_tracked = None
        if self.track_running_stats:
            self._buffer_names = ("running_mean", "running_var", "num_batches_tracked")
            self.running_mean = np.zeros(self.num_features, self.dtype)
            self.running_var = np.ones(self.num_features, self.dtype)
            self.num_batches_tracked = np.zeros((), np.int64)

    def reset_running_stats(self):
        """Running mean 0, running variance 1, no batches tracked."""
        if self.track_running_stats:
            self.running_mean[...] = 0
            self.running_var[...] = 1
            self.num_batches_tracked[...] = 0

    def _check_input_shape(self, shape):
        ndim = len(shape)
        if not -ndim <= self.axis < ndim:
            raise ValueError(f"BatchNorm with axis={self.axis} needs x with at least "
                             f"{self.axis + 1 if self.axis >= 0 else -self.axis} dimension(s), "
                             f"got shape {tuple(shape)}")
        if shape[self.axis] != self.num_features:
            raise ValueError(f"BatchNorm({self.num_features}) expects x.shape[{self.axis}] = "
                             f"{self.num_features} features, got shape {tuple(shape)}")

    def _check_state_value(self, key, value):
        if key == "num_batches_tracked":
            if value.shape != () or value.dtype.kind not in "iu":
                raise TypeError(f"state_dict['num_batches_tracked'] must be a non-negative "
                                f"integer scalar (0-d array), got {value.dtype} array of shape "
                                f"{value.shape}")
            # An int64 count, as torch's: a uint64 of 2**63 or more would be stored negative.
            count = int(value)
            if not 0 <= count <= _MAX_BATCH_COUNT:
                raise ValueError(f"state_dict['num_batches_tracked'] must be a count in "
                                 f"[0, 2**63 - 1], got {describe(count)}")
            if not self.num_batches_tracked.flags.writeable:
                raise ValueError("BatchNorm.num_batches_tracked is read-only: load_state_dict "
                                 "writes the values into the layer's own arrays")
            return np.int64(count)
        return super()._check_state_value(key, value)

    def _next_batch_count(self):
        """num_batches_tracked + 1, checked before a training forward changes anything."""
        try:
            tracked = int(self.num_batches_tracked)
        except (TypeError, ValueError):
            raise RuntimeError(f"BatchNorm.num_batches_tracked must be an integer count, got "
                               f"{describe(self.num_batches_tracked)}") from None
        if not 0 <= tracked < _MAX_BATCH_COUNT:
            raise RuntimeError(
                f"BatchNorm.num_batches_tracked is {describe(tracked)}: a training forward "
                f"counts one more batch, which needs a count in [0, 2**63 - 2]; call "
                "reset_running_stats() or load a smaller count")
        return tracked + 1

    def _forward(self, x):
        common = dict(eps=self.eps, axis=self.axis, num_threads=self.num_threads)
        if not self.track_running_stats:  # batch statistics in both modes, as torch
            return fastln.batch_norm_forward(x, self.weight, self.bias, training=True, **common)
        if not self.training:
            return fastln.batch_norm_forward(x, self.weight, self.bias, self.running_mean,
                                             self.running_var, training=False, **common)

        count = self._next_batch_count()
        momentum = 1.0 - 1.0 / count if self.momentum is None else self.momentum
        if not self.unbiased_running_var:
            y, cache = fastln.batch_norm_forward(x, self.weight, self.bias, self.running_mean,
                                                 self.running_var, training=True,
                                                 momentum=momentum, **common)
        else:
            values_per_feature = x.size // self.num_features
            if values_per_feature < 2:
                raise ValueError(f"BatchNorm with unbiased_running_var=True needs more than one "
                                 f"value per feature in training mode (the unbiased variance "
                                 f"divides by m - 1), got x of shape {x.shape}")
            # The layer's running statistics are updated after the call: check them before it,
            # so that a forward that fails changes nothing.
            running_mean = check_running(self.running_mean, "running_mean", self.num_features,
                                         training=True)
            running_var = check_running(self.running_var, "running_var", self.num_features,
                                        training=True)
            # momentum=0 makes batch_norm store the exact batch mean and biased variance here.
            batch_mean = np.zeros(self.num_features)
            batch_var = np.zeros(self.num_features)
            y, cache = fastln.batch_norm_forward(x, self.weight, self.bias, batch_mean,
                                                 batch_var, training=True, momentum=0.0,
                                                 **common)
            batch_var *= values_per_feature / (values_per_feature - 1)
            update_running(running_mean, momentum, batch_mean)
            update_running(running_var, momentum, batch_var)
        self.num_batches_tracked[...] = count
        return y, cache

    def _backward(self, dy, cache):
        dx, dweight, dbias = fastln.batch_norm_backward(dy, cache, self.weight,
                                                        num_threads=self.num_threads)
        return dx, ({"weight": dweight, "bias": dbias} if self.affine else {})

    def __repr__(self):
        extra = ", unbiased_running_var=True" if self.unbiased_running_var else ""
        return (f"BatchNorm({self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"axis={self.axis}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}, dtype={self.dtype.name}"
                f"{extra}, training={self.training})")


class _ChannelGroupNorm(_Layer):
    """GroupNorm and InstanceNorm: per-channel weight and bias, statistics per sample."""

    def __init__(self, num_groups, num_channels, eps, affine, dtype, channel_axis,
                 num_threads):
        super().__init__(dtype, num_threads)
        count = _check_feature_count(num_channels, "num_channels")
        self.num_channels = count
        if num_groups is not None:
            groups = check_int_argument(num_groups, "num_groups")
            if groups < 1 or count % groups != 0:
                raise ValueError(f"num_groups must be a positive int dividing num_channels = "
                                 f"{count}, got {describe(groups)}")
            self.num_groups = groups
        self.eps = check_eps(eps)
        self.affine = _check_bool(affine, "affine")
        axis = check_int_argument(channel_axis, "channel_axis")
        if axis not in (1, -1):
            raise ValueError(f"channel_axis must be 1 or -1, got {describe(axis)}")
        self.channel_axis = axis
        self.weight = self.weight_grad = self.bias = self.bias_grad = None
        if self.affine:
            self.weight, self.weight_grad = self._make_param(count, 1)
            self.bias, self.bias_grad = self._make_param(count, 0)

    def _check_input_shape(self, shape):
        name = type(self).__name__
        if len(shape) < 2:
            raise ValueError(f"{name} expects x of shape (N, C, *spatial) (or channels last), "
                             f"got shape {tuple(shape)}")
        if shape[self.channel_axis] != self.num_channels:
            raise ValueError(f"{name} with {self.num_channels} channels expects "
                             f"x.shape[{self.channel_axis}] = {self.num_channels}, got shape "
                             f"{tuple(shape)}")

    def _backward(self, dy, cache):
        dx, dweight, dbias = fastln.group_norm_backward(dy, cache, self.weight,
                                                        num_threads=self.num_threads)
        return dx, ({"weight": dweight, "bias": dbias} if self.affine else {})


class GroupNorm(_ChannelGroupNorm):
    """Group normalization of (N, C, *spatial) inputs, as ``torch.nn.GroupNorm``: the C channels
    in ``num_groups`` groups, each (sample, group) normalized over its channels and positions,
    then each channel scaled by ``weight`` and shifted by ``bias``. The same in training and
    evaluation mode. This is :func:`fastln.group_norm_forward` /
    :func:`fastln.group_norm_backward`; the state dict of a ``torch.nn.GroupNorm`` loads.

    Parameters
    ----------
    num_groups : int
        A positive divisor of num_channels.
    num_channels : int
    eps : float, default 1e-5
    affine : bool, default True
        Learn ``weight`` (ones) and ``bias`` (zeros); False leaves both None.
    dtype : float32 or float64, default float32
    channel_axis : {1, -1}, default 1
        -1 for channels-last (N, *spatial, C) inputs.
    num_threads : int, optional
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, dtype=np.float32, *,
                 channel_axis=1, num_threads=None):
        super().__init__(num_groups, num_channels, eps, affine, dtype, channel_axis,
                         num_threads)

    def _forward(self, x):
        return fastln.group_norm_forward(x, self.num_groups, self.weight, self.bias, self.eps,
                                         channel_axis=self.channel_axis,
                                         num_threads=self.num_threads)

    def __repr__(self):
        return (f"GroupNorm({self.num_groups}, {self.num_channels}, eps={self.eps}, "
                f"affine={self.affine}, channel_axis={self.channel_axis}, "
                f"dtype={self.dtype.name})")


class InstanceNorm(_ChannelGroupNorm):
    """Instance normalization of (N, C, *spatial) inputs: each (sample, channel) normalized over
    its positions, as ``torch.nn.InstanceNorm2d`` with its default
    ``track_running_stats=False`` (GroupNorm with one group per channel). The state dict of an
    ``InstanceNorm1d/2d/3d(affine=True)`` loads.

    Parameters
    ----------
    num_channels : int
    eps : float, default 1e-5
    affine : bool, default False
        As torch's default: no ``weight`` and ``bias`` unless True.
    dtype : float32 or float64, default float32
    channel_axis : {1, -1}, default 1
    num_threads : int, optional
    """

    def __init__(self, num_channels, eps=1e-5, affine=False, dtype=np.float32, *,
                 channel_axis=1, num_threads=None):
        super().__init__(None, num_channels, eps, affine, dtype, channel_axis, num_threads)

    def _forward(self, x):
        return fastln.instance_norm_forward(x, self.weight, self.bias, self.eps,
                                            channel_axis=self.channel_axis,
                                            num_threads=self.num_threads)

    def __repr__(self):
        return (f"InstanceNorm({self.num_channels}, eps={self.eps}, affine={self.affine}, "
                f"channel_axis={self.channel_axis}, dtype={self.dtype.name})")
