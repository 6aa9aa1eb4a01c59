"""PyTorch drop-in: fastln's kernels behind ``torch.nn.LayerNorm``, ``torch.nn.RMSNorm`` and
``torch.nn.GroupNorm``.

PyTorch is optional for fastln; this module needs it (``pip install torch``, version 2.4 or
later) and is only imported when asked for::

    import fastln.torch

    norm = fastln.torch.LayerNorm(768)        # same constructor as torch.nn.LayerNorm
    model = fastln.torch.patch(model)         # or swap the layers of an existing model

- :class:`LayerNorm`, :class:`RMSNorm` and :class:`GroupNorm` subclass ``torch.nn.LayerNorm``,
  ``torch.nn.RMSNorm`` and ``torch.nn.GroupNorm``: same constructor, same parameters, same ``state_dict`` keys
  (``weight``, ``bias``), ``isinstance(m, torch.nn.LayerNorm)`` still holds. Only ``forward``
  differs: it runs fastln's kernels through a ``torch.autograd.Function``; and LayerNorm's and
  RMSNorm's ``__call__`` hands an inference call without hooks straight to the kernel (hooks,
  ``module.compile()`` and tracing still go through ``torch.nn.Module.__call__``).
- **No copies** for CPU tensors that are contiguous float32, float64, float16 or bfloat16:
  inference calls (``torch.no_grad()``, ``torch.inference_mode()``) normalizing one axis read
  the tensor's memory where it lies; other calls view it as a NumPy array. fastln's output
  array becomes the result tensor (``torch.from_numpy``, no copy). The modules keep NumPy views
  of their parameters between calls (renewed when a parameter or its storage changes), so a
  call costs little more than fastln's own (docs/performance.md has the figures). bfloat16
  tensors outside inference calls are viewed the same way when ``ml_dtypes`` is installed
  (else computed via a float32 copy). Non-contiguous tensors are made contiguous first (one
  explicit copy), as are lazy negations (``torch._neg_view``).
  Tensors on other devices (CUDA, MPS, ...) and other dtypes go to PyTorch's own functional
  implementation, so a patched model still runs everywhere; so do empty tensors, tensor
  subclasses (FakeTensor under ``torch.export``, a ``__torch_function__`` of one's own, which
  then sees the call), torch.fx's proxies (``symbolic_trace``) and calls inside a TorchScript
  trace (``torch.jit.trace``, the TorchScript ONNX exporter), which record PyTorch's
  operations instead of fastln's result as a constant.
- **Parameters**: ``weight`` and ``bias`` as PyTorch's modules use them, also when a
  parametrization computes them (``torch.nn.utils.parametrize``, ``prune``, ``weight_norm``).
- **Autograd**: the backward is fastln's (x, gamma and beta gradients in one pass), with the
  forward's input saved through ``ctx.save_for_backward``, so modifying it in place before the
  backward is detected by PyTorch as usual. ``torch.autograd.gradcheck`` passes in float64.
  Under ``torch.no_grad()`` (inference) no cache is kept at all.
- **Threads**: fastln's own OpenMP threads (``fastln.set_num_threads``, or ``num_threads=`` on
  a module), independent of ``torch.set_num_threads``. Results are bitwise the same for every
  thread count and every batch composition, which PyTorch's CPU kernel does not promise.
- **torch.func** (``vmap``, ``grad``, ``jacrev``, ``jvp``, ``functional_call`` under them):
  inside a transform the tensors are PyTorch's wrappers, with no memory NumPy could read, so
  fastln.torch computes with PyTorch's own ``F.layer_norm`` / ``F.rms_norm`` there: the
  transforms work and give PyTorch's results (not fastln's bits).
- Not supported: TorchScript (``torch.jit.script``) and double backward (differentiating a
  gradient again raises a RuntimeError). ``torch.compile`` works, but does not trace into
  fastln (its calls run as ordinary Python between graphs).
- ``torch.nn.TransformerEncoderLayer`` in evaluation mode may take PyTorch's fused "fast path",
  which calls its own kernels and never the norm modules' ``forward``: :func:`patch` swaps the
  modules, but that path does not use them.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional, Union, overload

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.modules import module as _torch_module
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "fastln.torch needs PyTorch, which fastln does not install: pip install torch"
    ) from exc

import fastln
from fastln import _kernels
from fastln._checks import check_num_threads

__all__ = ["GroupNorm", "LayerNorm", "RMSNorm", "group_norm", "layer_norm", "rms_norm",
           "patch", "unpatch"]

_ShapeLike = Union[int, Sequence[int], torch.Size]

# dtypes whose CPU tensors NumPy can view directly (bfloat16 needs ml_dtypes, see _to_numpy).
_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16})
_HANDLED_DTYPES = _NUMPY_DTYPES | {torch.bfloat16}


def _bfloat16_numpy_dtype() -> Optional[np.dtype]:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


# The tensors whose memory the kernels read in place for inference calls, without the .numpy()
# view a call would otherwise cost: each dtype's storage type.
_kernels.register_torch(torch.Tensor, torch.strided, {
    torch.float32: _kernels.FLOAT32, torch.float64: _kernels.FLOAT64,
    torch.float16: _kernels.FLOAT16, torch.bfloat16: _kernels.BFLOAT16,
}, torch.bfloat16, torch.from_numpy)
_forward_tensor = _kernels.row_norm_forward_tensor
_LAYER_NORM, _RMS_NORM = _kernels.LAYER_NORM, _kernels.RMS_NORM

# What Module.__call__ looks at before it calls forward (see _InferenceShortcut).
_tracing_state = torch._C._get_tracing_state
_grad_enabled = torch.is_grad_enabled
_global_forward_hooks = _torch_module._global_forward_hooks
_global_forward_pre_hooks = _torch_module._global_forward_pre_hooks
_global_backward_hooks = _torch_module._global_backward_hooks
_global_backward_pre_hooks = _torch_module._global_backward_pre_hooks


# Tensor types fastln reads: PyTorch's own. Subclasses (FakeTensor under torch.export, those
# with a __torch_function__ of their own) and torch.fx's proxies go to PyTorch's functions,
# which dispatch them as they expect.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _handles(tensor: torch.Tensor) -> bool:
    """Whether fastln computes this tensor (else PyTorch's own implementation does): a plain
    CPU tensor of a dtype fastln has, not empty (PyTorch returns an empty result where fastln
    refuses an empty normalized shape), outside a TorchScript trace (which would record
    fastln's result as a constant of the graph: torch.jit.trace, the TorchScript ONNX
    exporter)."""
    return (type(tensor) in _PLAIN_TENSORS and tensor.is_cpu and tensor.dtype in _HANDLED_DTYPES
            and tensor.numel() > 0 and _tracing_state() is None)


@overload
def _to_numpy(tensor: torch.Tensor) -> np.ndarray: ...
@overload
def _to_numpy(tensor: None) -> None: ...
@overload
def _to_numpy(tensor: Optional[torch.Tensor]) -> Optional[np.ndarray]: ...
def _to_numpy(tensor: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    """A NumPy view of a CPU tensor's memory; a copy only when it is not contiguous (or is
    bfloat16 without ml_dtypes, which becomes float32), or when its memory does not hold its
    values (a lazy negation, torch._neg_view; a ZeroTensor, which has none): numpy(force=True)
    makes those real."""
    if tensor is None:
        return None
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        bfloat16 = _bfloat16_numpy_dtype()
        if bfloat16 is None:
            return tensor.to(torch.float32).numpy(force=True)
        return tensor.resolve_neg().contiguous().view(torch.int16).numpy(force=True).view(bfloat16)
    return tensor.contiguous().numpy(force=True)


def _to_torch(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """The NumPy result as a tensor of `like`'s dtype, sharing memory when the dtypes agree."""
    if array.dtype.kind == "V":  # ml_dtypes' bfloat16 (the only non-"f" dtype fastln returns)
        tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    return tensor if tensor.dtype == like.dtype else tensor.to(like.dtype)


try:
    _current_transform_level = torch._C._functorch.maybe_current_level
except AttributeError:  # pragma: no cover - a torch without torch.func
    def _current_transform_level() -> Optional[int]:
        return None


def _under_transform() -> bool:
    """Inside torch.func.vmap / grad / jacrev / jvp: tensors are wrappers without storage."""
    return _current_transform_level() is not None


def _is_view_of(array: Optional[np.ndarray], tensor: Optional[torch.Tensor]) -> bool:
    """Whether array reads tensor's own memory (not a copy _to_numpy had to make)."""
    return array is None or array.__array_interface__["data"][0] == tensor.data_ptr()


class _ParameterViews:
    """NumPy views of a module's weight and bias, kept between calls: converting them costs
    more than a small call's kernel. Renewed when a parameter is replaced or its storage is
    (``module.to(...)``, ``param.data = ...``); in-place updates are seen through the view.
    A parameter that _to_numpy has to copy (not contiguous, a lazy negation, bfloat16 without
    ml_dtypes) is converted again on every call: a kept copy would miss in-place updates, and
    ``param.data.mul_(...)`` changes neither the pointer nor the version counter.
    get() returns None for parameters fastln cannot read (another device or dtype)."""

    __slots__ = ("weight", "bias", "weight_ptr", "bias_ptr", "arrays")

    def __init__(self) -> None:
        self.weight = self.bias = None
        self.weight_ptr = self.bias_ptr = None
        self.arrays: Optional[tuple[Optional[np.ndarray], Optional[np.ndarray]]] = (None, None)

    def get(self, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]
            ) -> Optional[tuple[Optional[np.ndarray], Optional[np.ndarray]]]:
        weight_ptr = None if weight is None else weight.data_ptr()
        bias_ptr = None if bias is None else bias.data_ptr()
        if (weight_ptr == self.weight_ptr and bias_ptr == self.bias_ptr
                and weight is self.weight and bias is self.bias):
            return self.arrays
        readable = all(p is None or _handles(p) for p in (weight, bias))
        arrays = (_to_numpy(weight), _to_numpy(bias)) if readable else None
        # Copies are not kept: the next call with these parameters converts them again.
        if arrays is None or (_is_view_of(arrays[0], weight) and _is_view_of(arrays[1], bias)):
            self.weight, self.bias = weight, bias
            self.weight_ptr, self.bias_ptr = weight_ptr, bias_ptr
            self.arrays = arrays
        return arrays


def _parameter(module: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    """A module's weight or bias as its forward must use it: from _parameters (a dict lookup,
    cheaper than Module.__getattr__), else the attribute, which a parametrization
    (torch.nn.utils.parametrize, prune, weight_norm) computes after taking the name out of
    _parameters."""
    parameters = module._parameters
    if name in parameters:
        return parameters[name]
    return getattr(module, name, None)


def _module_views(module: torch.nn.Module) -> _ParameterViews:
    views = module.__dict__.get("_fastln_views")
    if views is None:
        views = module.__dict__["_fastln_views"] = _ParameterViews()
    return views


def _trailing_shape_is(input: torch.Tensor, shape: tuple) -> bool:
    if len(shape) == 1:
        # Ints, not torch.Size.__eq__, which goes through symbolic-shape helpers (PyTorch 2.13).
        return input.dim() > 0 and input.shape[-1] == shape[0]
    return tuple(input.shape[-len(shape):]) == tuple(shape)


def _result(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """fastln's output as a tensor of like's dtype, without a copy when the dtypes agree
    (fastln returns x's float dtype for every dtype but bfloat16)."""
    if like.dtype is not torch.bfloat16:
        return torch.from_numpy(array)
    return _to_torch(array, like)


def _normalized_ndim(input: torch.Tensor, normalized_shape: _ShapeLike) -> int:
    """How many trailing axes are normalized; ValueError when they do not match."""
    shape = tuple(_shape_list(normalized_shape))
    if len(shape) == 0 or len(shape) > input.dim() or tuple(input.shape[-len(shape):]) != shape:
        raise ValueError(f"normalized_shape = {list(shape)} does not match the last axes of "
                         f"input with shape {list(input.shape)}")
    return len(shape)


def _needs_grad(input: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor] = None) -> bool:
    return torch.is_grad_enabled() and (input.requires_grad
                                        or (weight is not None and weight.requires_grad)
                                        or (bias is not None and bias.requires_grad))


def _view(tensor: torch.Tensor) -> np.ndarray:
    """_to_numpy inside a Function's forward and backward, where grad mode is off, so that
    numpy() takes a tensor that requires grad: one call for the common tensor, _to_numpy for
    the others (numpy() refuses bfloat16, lazy negations and ZeroTensors; a strided view is
    read as it is)."""
    try:
        return tensor.numpy()
    except (RuntimeError, TypeError):
        return _to_numpy(tensor)


def _dy_array(grad_output: torch.Tensor, input: torch.Tensor, cache: Any) -> Any:
    """grad_output as the NumPy array a fastln backward takes: in the input's dtype, then in the
    cache's (bfloat16 is computed as float32 when ml_dtypes is missing)."""
    dy = _view(grad_output if grad_output.dtype == input.dtype else grad_output.to(input.dtype))
    return dy if dy.dtype == cache.dtype else dy.astype(cache.dtype)


def _parameter_grad(ctx: Any, index: int, grad: np.ndarray,
                    parameter: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The gradient a backward returns for the forward's argument `index`, a parameter (weight
    or bias): None when there is no parameter or autograd does not need its gradient, else
    `grad` as a tensor of the parameter's dtype."""
    if parameter is None or not ctx.needs_input_grad[index]:
        return None
    return _to_torch(grad, parameter)


class _NoSecondDerivative(torch.autograd.Function):
    """Stands between a fastln backward's gradients and the tensors they were computed from,
    when that backward runs with ``create_graph=True``: differentiating them again raises.
    (``once_differentiable``'s error node hangs off detached copies instead, so
    ``torch.autograd.grad(..., inputs)`` skipped it and gave None, or zeros, for the second
    derivative.)"""

    @staticmethod
    def forward(ctx: Any, n_gradients: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in tensors[:n_gradients])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(
            "fastln.torch has no double backward: its layer_norm, rms_norm and group_norm cannot "
            "be differentiated twice (create_graph=True, gradgradcheck, Hessians); use "
            "torch.nn.functional.layer_norm / rms_norm / group_norm (or "
            "fastln.torch.unpatch(model)) there")


def _first_derivative_only(backward: Any) -> Any:
    """once_differentiable, with the error node connected to grad_output and the saved
    tensors, so that every later differentiation through the gradients reaches it."""
    @functools.wraps(backward)
    def wrapper(ctx: Any, grad_output: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        if not torch.is_grad_enabled():  # an ordinary backward (no create_graph): nothing to guard
            return backward(ctx, grad_output)
        with torch.no_grad():
            results = backward(ctx, grad_output)
        sources = [t for t in (grad_output, *ctx.saved_tensors)
                   if t is not None and t.requires_grad]
        if not torch.is_grad_enabled() or not sources:
            return results
        gradients = [r for r in results if isinstance(r, torch.Tensor)]
        if not gradients:
            return results
        connected = iter(_NoSecondDerivative.apply(len(gradients), *gradients, *sources))
        return tuple(next(connected) if isinstance(r, torch.Tensor) else r for r in results)
    return wrapper


def _direct_apply(function: type) -> Any:
    """function.apply without the Python layer of torch.autograd.Function.apply, which costs
    several microseconds a call (against about 1 for the kernel of a 768-wide row): it binds
    default arguments for a setup_context, which fastln's Functions do not define, and unwraps
    torch.func's dead wrappers with a walk over every argument, which _live does for the tensors
    alone. Calls under a torch.func transform never come here (they take PyTorch's functional
    forms)."""
    return super(torch.autograd.Function, function).apply


try:
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
except AttributeError:  # pragma: no cover - a torch without torch.func
    def _unwrap_if_dead(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _live(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A tensor that escaped a finished torch.func transform as the tensor it wraps (as
    torch.autograd.Function.apply unwraps it)."""
    return None if tensor is None else _unwrap_if_dead(tensor)


class _LayerNormFunction(torch.autograd.Function):
    """y = layer_norm(x) * weight + bias over the last `n_axes` axes, on fastln's kernels."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], n_axes: int, eps: float,
                num_threads: Optional[int], arrays: tuple) -> torch.Tensor:
        weight_array, bias_array = arrays
        y, cache = fastln.layer_norm_forward(_view(input), weight_array, bias_array, eps,
                                             axis=input.dim() - n_axes, num_threads=num_threads)
        ctx.cache = cache  # refers to input's memory (no copy); mean, rstd: O(rows)
        ctx.num_threads = num_threads
        ctx.weight_array = weight_array
        ctx.save_for_backward(input, weight, bias)  # so that PyTorch checks in-place changes
        return _result(y, input)

    @staticmethod
    @_first_derivative_only
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        input, weight, bias = ctx.saved_tensors
        cache = ctx.cache
        dy = _dy_array(grad_output, input, cache)
        dx, dgamma, dbeta = fastln.layer_norm_backward(dy, cache, ctx.weight_array,
                                                       num_threads=ctx.num_threads)
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = _result(dx, input)
        grad_weight = _parameter_grad(ctx, 1, dgamma, weight)
        grad_bias = _parameter_grad(ctx, 2, dbeta, bias)
        return grad_input, grad_weight, grad_bias, None, None, None, None


class _RMSNormFunction(torch.autograd.Function):
    """y = x / sqrt(mean(x**2) + eps) * weight over the last `n_axes` axes, on fastln."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: Optional[torch.Tensor], n_axes: int,
                eps: float, num_threads: Optional[int], weight_array: Optional[np.ndarray]
                ) -> torch.Tensor:
        y, cache = fastln.rms_norm_forward(_view(input), weight_array, eps,
                                           axis=input.dim() - n_axes, num_threads=num_threads)
        ctx.cache = cache
        ctx.num_threads = num_threads
        ctx.weight_array = weight_array
        ctx.save_for_backward(input, weight)
        return _result(y, input)

    @staticmethod
    @_first_derivative_only
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        input, weight = ctx.saved_tensors
        cache = ctx.cache
        dy = _dy_array(grad_output, input, cache)
        dx, dgamma = fastln.rms_norm_backward(dy, cache, ctx.weight_array,
                                              num_threads=ctx.num_threads)
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = _result(dx, input)
        grad_weight = _parameter_grad(ctx, 1, dgamma, weight)
        return grad_input, grad_weight, None, None, None, None


def _channels_last_view(input: torch.Tensor) -> Optional[torch.Tensor]:
    """An (N, C, H, W) or (N, C, D, H, W) tensor stored channels last (``torch.channels_last``,
    ``torch.channels_last_3d``), as the contiguous (N, *spatial, C) tensor on the same memory;
    None for any other layout. PyTorch has no channels-last format for other ranks, and returns
    their results contiguous: so does the NCHW path, which copies such an input first."""
    if input.dim() not in (4, 5) or input.is_contiguous():
        return None
    moved = input.movedim(1, -1)
    return moved if moved.is_contiguous() else None


class _GroupNormFunction(torch.autograd.Function):
    """y = group_norm(x, num_groups) * weight + bias, on fastln's kernels; channels-last
    tensors are computed in their own layout (no copy)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], num_groups: int, eps: float,
                num_threads: Optional[int], arrays: tuple) -> torch.Tensor:
        weight_array, bias_array = arrays
        last = _channels_last_view(input)
        x = _to_numpy(input if last is None else last)
        y, cache = fastln.group_norm_forward(x, num_groups, weight_array, bias_array, eps,
                                             channel_axis=1 if last is None else -1,
                                             num_threads=num_threads)
        ctx.cache = cache
        ctx.num_threads = num_threads
        ctx.weight_array = weight_array
        ctx.channels_last = last is not None
        ctx.save_for_backward(input, weight, bias)
        result = _result(y, input)
        return result if last is None else result.movedim(-1, 1)

    @staticmethod
    @_first_derivative_only
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        input, weight, bias = ctx.saved_tensors
        cache = ctx.cache
        dy = _dy_array(grad_output.movedim(1, -1) if ctx.channels_last else grad_output, input,
                       cache)
        dx, dgamma, dbeta = fastln.group_norm_backward(dy, cache, ctx.weight_array,
                                                       num_threads=ctx.num_threads)
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = _result(dx, input)
            if ctx.channels_last:
                grad_input = grad_input.movedim(-1, 1)
        grad_weight = _parameter_grad(ctx, 1, dgamma, weight)
        grad_bias = _parameter_grad(ctx, 2, dbeta, bias)
        return grad_input, grad_weight, grad_bias, None, None, None, None


_apply_layer_norm = _direct_apply(_LayerNormFunction)
_apply_rms_norm = _direct_apply(_RMSNormFunction)
_apply_group_norm = _direct_apply(_GroupNormFunction)


def group_norm(input: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, *,
               num_threads: Optional[int] = None) -> torch.Tensor:
    """``torch.nn.functional.group_norm`` on fastln's kernels (PyTorch's own for tensors and
    parameters fastln does not compute, and inside torch.func transforms).

    Examples
    --------
    >>> import torch, fastln.torch
    >>> fastln.torch.group_norm(torch.tensor([[[1.0, 3.0], [10.0, 30.0]]]), 2, eps=0.0)
    tensor([[[-1.,  1.],
             [-1.,  1.]]])
    """
    if (_current_transform_level() is None and _handles(input) and input.dim() >= 2
            and all(p is None or _handles(p) for p in (weight, bias))):
        arrays = (_to_numpy(weight), _to_numpy(bias))
        return _apply_group_norm(_live(input), _live(weight), _live(bias), num_groups, eps,
                                 num_threads, arrays)
    return F.group_norm(input, num_groups, weight, bias, eps)


def layer_norm(input: torch.Tensor, normalized_shape: _ShapeLike,
               weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5, *, num_threads: Optional[int] = None) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` on fastln's kernels (differentiable).

    Parameters
    ----------
    input : torch.Tensor
        CPU float32/float64/float16/bfloat16 tensors run on fastln (contiguous ones without a
        copy); anything else goes to ``torch.nn.functional.layer_norm``.
    normalized_shape : int or sequence of int
        The trailing shape to normalize over, as in PyTorch.
    weight, bias : torch.Tensor of shape ``normalized_shape``, optional
    eps : float, default 1e-5
    num_threads : int, optional
        fastln's threads for this call; None uses ``fastln.get_num_threads()``.

    Returns
    -------
    torch.Tensor of input's shape and dtype

    Raises
    ------
    ValueError
        When ``normalized_shape`` is not the trailing shape of input (PyTorch raises a
        RuntimeError there); fastln's errors for bad weight/bias shapes or eps.

    Examples
    --------
    >>> import torch, fastln.torch
    >>> x = torch.tensor([[10.0, 20.0, 60.0]])
    >>> fastln.torch.layer_norm(x, (3,))
    tensor([[-0.9258, -0.4629,  1.3887]])
    """
    if (_under_transform() or not _handles(input)
            or not all(t is None or _handles(t) for t in (weight, bias))):
        return F.layer_norm(input, _shape_list(normalized_shape), weight, bias, eps)
    n_axes = _normalized_ndim(input, normalized_shape)
    return _layer_norm(input, n_axes, weight, bias, (_to_numpy(weight), _to_numpy(bias)), eps,
                       num_threads)


def _layer_norm(input: torch.Tensor, n_axes: int, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], arrays: tuple, eps: float,
                num_threads: Optional[int]) -> torch.Tensor:
    """fastln's layer_norm of a checked CPU input; arrays are weight's and bias's views."""
    if not _needs_grad(input, weight, bias):
        if n_axes == 1:
            result = _forward_tensor(_LAYER_NORM, input, input.shape[-1], arrays[0], arrays[1],
                                     eps, num_threads)
            if result is not None:
                return result
        y = fastln.layer_norm(_to_numpy(input), arrays[0], arrays[1], eps,
                              axis=input.dim() - n_axes, num_threads=num_threads)
        return _result(y, input)
    return _apply_layer_norm(_live(input), _live(weight), _live(bias), n_axes, eps, num_threads,
                             arrays)


def rms_norm(input: torch.Tensor, normalized_shape: _ShapeLike,
             weight: Optional[torch.Tensor] = None, eps: Optional[float] = None, *,
             num_threads: Optional[int] = None) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` on fastln's kernels (differentiable).

    ``eps=None`` means ``torch.finfo(input.dtype).eps``, as in PyTorch. Other parameters as in
    :func:`layer_norm` (there is no bias).

    Returns
    -------
    torch.Tensor of input's shape and dtype

    Examples
    --------
    >>> import torch, fastln.torch
    >>> fastln.torch.rms_norm(torch.tensor([3.0, 4.0]), (2,), eps=0.0)
    tensor([0.8485, 1.1314])
    """
    if _under_transform() or not (_handles(input) and (weight is None or _handles(weight))):
        return F.rms_norm(input, _shape_list(normalized_shape), weight, eps)
    if eps is None:
        eps = torch.finfo(input.dtype).eps
    n_axes = _normalized_ndim(input, normalized_shape)
    return _rms_norm(input, n_axes, weight, _to_numpy(weight), eps, num_threads)


def _rms_norm(input: torch.Tensor, n_axes: int, weight: Optional[torch.Tensor],
              weight_array: Optional[np.ndarray], eps: float,
              num_threads: Optional[int]) -> torch.Tensor:
    """fastln's rms_norm of a checked CPU input; weight_array is weight's view."""
    if not _needs_grad(input, weight):
        if n_axes == 1:
            result = _forward_tensor(_RMS_NORM, input, input.shape[-1], weight_array, None, eps,
                                     num_threads)
            if result is not None:
                return result
        y = fastln.rms_norm(_to_numpy(input), weight_array, eps, axis=input.dim() - n_axes,
                            num_threads=num_threads)
        return _result(y, input)
    return _apply_rms_norm(_live(input), _live(weight), n_axes, eps, num_threads, weight_array)


def _shape_list(normalized_shape: _ShapeLike) -> list[int]:
    if isinstance(normalized_shape, (int, np.integer)):
        return [int(normalized_shape)]
    return [int(n) for n in normalized_shape]


class _InferenceShortcut:
    """``__call__`` of fastln's LayerNorm and RMSNorm: an inference call on one tensor, over
    one axis, that Module.__call__ would only hand to forward (no hooks of the module's or
    global ones, no ``module.compile()``, no TorchScript trace: Module.__call__'s own shortcut)
    goes straight to the kernel, which reads the tensor's memory in place. Module.__call__ and
    forward's frame cost more than the kernel of a 768-wide row (docs/performance.md, "The
    PyTorch drop-in's glue"), so the steps are spelled out here rather than in helpers. Every
    other call, and every tensor the recogniser refuses (other devices and layouts, torch.func's
    wrappers), takes Module.__call__ and forward."""

    _fastln_op: int
    _fastln_parameters: tuple[str, ...]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        shape = d["normalized_shape"]
        if (len(args) == 1 and not kwargs and len(shape) == 1 and not _grad_enabled()
                and d.get("_compiled_call_impl") is None
                and not (d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"]
                         or d["_backward_pre_hooks"] or _global_forward_hooks
                         or _global_forward_pre_hooks or _global_backward_hooks
                         or _global_backward_pre_hooks or _tracing_state())):
            eps, input = d["eps"], args[0]
            if eps is None and type(input) is torch.Tensor:  # RMSNorm's default, as in PyTorch
                eps = torch.finfo(input.dtype).eps
            # Parameters straight from _parameters: Module.__getattr__ costs as much as a check.
            # A parametrized one is not there (forward computes it: _parameter).
            parameters, names = d["_parameters"], self._fastln_parameters
            if eps is not None and names[0] in parameters and names[-1] in parameters:
                arrays = (d.get("_fastln_views") or _module_views(self)).get(
                    parameters.get("weight"), parameters.get("bias"))
                if arrays is not None:
                    result = _forward_tensor(self._fastln_op, input, shape[0], arrays[0],
                                             arrays[1], eps, self.num_threads)
                    if result is not None:
                        return result
        # Looked up at call time, so that what patches Module.__call__ (torch.fx's tracer, for
        # one) sees these calls too.
        return super().__call__(*args, **kwargs)


class LayerNorm(_InferenceShortcut, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by fastln: same constructor, parameters and state_dict.

    Parameters
    ----------
    normalized_shape, eps, elementwise_affine, bias, device, dtype
        As in ``torch.nn.LayerNorm``.
    num_threads : int, optional (keyword only)
        fastln's threads for this layer; None (the default) uses ``fastln.get_num_threads()``.

    Examples
    --------
    >>> import torch, fastln.torch
    >>> norm = fastln.torch.LayerNorm(3)
    >>> sorted(norm.state_dict())
    ['bias', 'weight']
    >>> norm(torch.tensor([[10.0, 20.0, 60.0]]))
    tensor([[-0.9258, -0.4629,  1.3887]], grad_fn=<_LayerNormFunctionBackward>)
    """

    num_threads: Optional[int] = None  # class default, so patched modules have it too

    def __init__(self, normalized_shape: _ShapeLike, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device: Any = None,
                 dtype: Any = None, *, num_threads: Optional[int] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.num_threads = num_threads

    _fastln_op = _LAYER_NORM
    _fastln_parameters = ("weight", "bias")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Inference calls without hooks came through _InferenceShortcut.__call__; the others
        # (and direct forward calls) take the general path, whose inference shortcut is the same.
        shape = self.normalized_shape
        weight, bias = _parameter(self, "weight"), _parameter(self, "bias")
        if (_current_transform_level() is None and _handles(input)
                and _trailing_shape_is(input, shape)):
            arrays = _module_views(self).get(weight, bias)
            if arrays is not None:
                return _layer_norm(input, len(shape), weight, bias, arrays, self.eps,
                                   self.num_threads)
        return layer_norm(input, shape, weight, bias, self.eps, num_threads=self.num_threads)

    def __getstate__(self) -> dict:
        # The NumPy views are a cache of this process: not pickled, not deep-copied.
        return {k: v for k, v in self.__dict__.items() if k != "_fastln_views"}


class RMSNorm(_InferenceShortcut, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by fastln: same constructor, parameters and state_dict.

    Parameters
    ----------
    normalized_shape, eps, elementwise_affine, device, dtype
        As in ``torch.nn.RMSNorm`` (``eps=None``: ``torch.finfo(input.dtype).eps``).
    num_threads : int, optional (keyword only)
        fastln's threads for this layer; None uses ``fastln.get_num_threads()``.

    Examples
    --------
    >>> import torch, fastln.torch
    >>> norm = fastln.torch.RMSNorm(2, eps=0.0)
    >>> list(norm.state_dict())
    ['weight']
    >>> norm(torch.tensor([3.0, 4.0])).detach()
    tensor([0.8485, 1.1314])
    """

    num_threads: Optional[int] = None

    def __init__(self, normalized_shape: _ShapeLike, eps: Optional[float] = None,
                 elementwise_affine: bool = True, device: Any = None, dtype: Any = None, *,
                 num_threads: Optional[int] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.num_threads = num_threads

    _fastln_op = _RMS_NORM
    _fastln_parameters = ("weight",)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # As LayerNorm.forward.
        weight, shape = _parameter(self, "weight"), self.normalized_shape
        if (_current_transform_level() is None and _handles(input)
                and _trailing_shape_is(input, shape)):
            arrays = _module_views(self).get(weight, None)
            if arrays is not None:
                eps = torch.finfo(input.dtype).eps if self.eps is None else self.eps
                return _rms_norm(input, len(shape), weight, arrays[0], eps, self.num_threads)
        return rms_norm(input, shape, weight, self.eps, num_threads=self.num_threads)

    def __getstate__(self) -> dict:
        # The NumPy views are a cache of this process: not pickled, not deep-copied.
        return {k: v for k, v in self.__dict__.items() if k != "_fastln_views"}


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` computed by fastln: same constructor, parameters and state_dict.
    Channels-last tensors (``memory_format=torch.channels_last``) are computed in their own
    layout.

    Parameters
    ----------
    num_groups, num_channels, eps, affine, device, dtype
        As in ``torch.nn.GroupNorm``.
    num_threads : int, optional (keyword only)
        fastln's threads for this layer; None uses ``fastln.get_num_threads()``.

    Examples
    --------
    >>> import torch, fastln.torch
    >>> norm = fastln.torch.GroupNorm(1, 2, eps=0.0)
    >>> sorted(norm.state_dict())
    ['bias', 'weight']
    >>> norm(torch.tensor([[[1.0, 3.0], [1.0, 3.0]]])).detach()
    tensor([[[-1.,  1.],
             [-1.,  1.]]])
    """

    num_threads: Optional[int] = None

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True, device: Any = None, dtype: Any = None, *,
                 num_threads: Optional[int] = None) -> None:
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        self.num_threads = num_threads

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = _parameter(self, "weight"), _parameter(self, "bias")
        if (_current_transform_level() is None and _handles(input) and input.dim() >= 2
                and input.shape[1] == self.num_channels):
            arrays = _module_views(self).get(weight, bias)
            if arrays is not None:
                return _apply_group_norm(_live(input), _live(weight), _live(bias),
                                         self.num_groups, self.eps, self.num_threads, arrays)
        return F.group_norm(input, self.num_groups, weight, bias, self.eps)

    def __getstate__(self) -> dict:
        # The NumPy views are a cache of this process: not pickled, not deep-copied.
        return {k: v for k, v in self.__dict__.items() if k != "_fastln_views"}


_SWAPS = {torch.nn.LayerNorm: LayerNorm, torch.nn.RMSNorm: RMSNorm,
          torch.nn.GroupNorm: GroupNorm}


def patch(model: torch.nn.Module, *, layer_norm: bool = True, rms_norm: bool = True,
          group_norm: bool = True, num_threads: Optional[int] = None) -> torch.nn.Module:
    """Make every ``torch.nn.LayerNorm`` / ``RMSNorm`` / ``GroupNorm`` in ``model`` run on
    fastln.

    The swap is in place and keeps each module object: its class becomes
    :class:`fastln.torch.LayerNorm` / :class:`fastln.torch.RMSNorm` /
    :class:`fastln.torch.GroupNorm` (subclasses of the torch ones), so its parameters (the very ``Parameter`` objects an optimizer may hold), buffers,
    hooks and ``state_dict`` are untouched. Only modules whose type is exactly the torch class
    are swapped (a custom subclass may have its own ``forward``). ``model`` itself is included.

    Parameters
    ----------
    model : torch.nn.Module
    layer_norm, rms_norm, group_norm : bool, default True
        Which kinds of layer to swap.
    num_threads : int, optional
        fastln's threads for the swapped layers (and for those of these kinds that an earlier
        patch swapped); None uses ``fastln.get_num_threads()``.

    Returns
    -------
    model : torch.nn.Module
        The same object, for chaining. :func:`unpatch` undoes the swap.

    Raises
    ------
    ValueError
        num_threads is not None or a positive int.

    Examples
    --------
    >>> import torch, fastln.torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> model = fastln.torch.patch(model)
    >>> type(model[1]).__module__, type(model[1]).__name__
    ('fastln.torch', 'LayerNorm')
    """
    num_threads = check_num_threads(num_threads)
    kinds = {torch.nn.LayerNorm: layer_norm, torch.nn.RMSNorm: rms_norm,
             torch.nn.GroupNorm: group_norm}
    plain = {swap: original for original, swap in _SWAPS.items()}
    for module in model.modules():
        swap = _SWAPS.get(type(module))
        if swap is not None and kinds[type(module)]:
            module.__class__ = swap
            setattr(module, "num_threads", num_threads)
        elif type(module) in plain and kinds[plain[type(module)]]:  # patched before
            setattr(module, "num_threads", num_threads)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: fastln's layers in ``model`` become the plain torch layers again.

    Returns
    -------
    model : torch.nn.Module
        The same object.

    Examples
    --------
    >>> import torch, fastln.torch
    >>> model = fastln.torch.patch(torch.nn.Sequential(torch.nn.LayerNorm(4)))
    >>> type(fastln.torch.unpatch(model)[0]) is torch.nn.LayerNorm
    True
    """
    plain = {swap: original for original, swap in _SWAPS.items()}
    for module in model.modules():
        original = plain.get(type(module))
        if original is not None:
            module.__class__ = original
            module.__dict__.pop("num_threads", None)
            module.__dict__.pop("_fastln_views", None)
    return model
