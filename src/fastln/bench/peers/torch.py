"""PyTorch on the CPU, for every operation: the calls a PyTorch program makes, without autograd
where PyTorch has a gradient kernel of its own.

    forward, rms_forward     torch.nn.functional.layer_norm / rms_norm
    backward                 torch.ops.aten.native_layer_norm_backward (no autograd)
    rms_backward             autograd: torch.autograd.grad(y, (x, gamma), dy, retain_graph=True)
                             on the graph of F.rms_norm recorded once, untimed. PyTorch 2.13's
                             autograd-free aten._fused_rms_norm_backward is for CUDA only: on the
                             CPU rms_norm is a composite of elementwise and reduction ops whose
                             backwards run one by one, with autograd's bookkeeping on top, which
                             is what training with PyTorch on the CPU runs. Where the aten op does
                             have a CPU kernel (tried once on a tiny tensor) it is used instead.
    add_layer_norm,          torch.add, then F.layer_norm / F.rms_norm (PyTorch has no fused
    add_rms_norm             add + norm on the CPU)
    batch_norm_train         F.batch_norm(training=True), its running statistics updated in place
                             (its momentum weighs the new value: it gets 1 - fastln's)
    batch_norm_eval          F.batch_norm(training=False), the running statistics
    batch_norm_backward      torch.ops.aten.native_batch_norm_backward (no autograd)
    group_norm, instance_norm  F.group_norm / F.instance_norm; group_norm_last gives F.group_norm
                             the channels-last array as an (N, C, H, W) tensor in
                             torch.channels_last memory format (its channels-last kernel)
    group_norm_backward      autograd.grad of F.group_norm, the graph recorded once, untimed
                             (group_norm_last_backward: on the channels_last tensor)

Tensors share the NumPy inputs' memory (torch.from_numpy; bfloat16 through an int16 view), so
torch reads exactly the arrays the others read; float16 and bfloat16 tensors run PyTorch's own
half kernels. torch's thread count is process-wide: it is set before every sample.
"""
import numpy as np

from fastln.bench.operation import (
    EPS,
    FULL_DTYPES,
    MOMENTUM,
    Implementation,
    Prepared,
    RunningStatistics,
    output_mode,
)


def _torch(num_threads):
    """torch, imported (only when a torch implementation is prepared) with its thread count set."""
    import torch

    torch.set_num_threads(num_threads)
    return torch


def tensor(torch, array):
    """A tensor sharing the array's memory (bfloat16 through an int16 view: torch.from_numpy
    does not know ml_dtypes' bfloat16)."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _tensors(torch, inputs, *names):
    """The named inputs as tensors, the full-size ones as (rows, last axis)."""
    full = {"x", "dy", "residual"}
    return tuple(tensor(torch, inputs.rows(name) if name in full else getattr(inputs, name))
                 for name in names)


def _prepared(torch, call, num_threads, out_buffer, result_arrays=None):
    # The count is process-wide: set again before each sample, as calls with other counts may
    # have run in between.
    return Prepared(call, output_mode(out_buffer, False), threads=num_threads,
                    result_arrays=result_arrays,
                    before_sample=lambda: torch.set_num_threads(num_threads))


def _forward(inputs, num_threads, out_buffer):
    torch = _torch(num_threads)
    x, gamma, beta = _tensors(torch, inputs, "x", "gamma", "beta")
    layer_norm, normalized_shape = torch.nn.functional.layer_norm, (inputs.n_cols,)
    return _prepared(torch, lambda: layer_norm(x, normalized_shape, gamma, beta, EPS),
                     num_threads, out_buffer)


def _backward(inputs, num_threads, out_buffer):
    torch = _torch(num_threads)
    x, gamma, beta, dy = _tensors(torch, inputs, "x", "gamma", "beta", "dy")
    n_cols = inputs.n_cols
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [n_cols], gamma, beta, EPS)
    backward, output_mask = torch.ops.aten.native_layer_norm_backward, [True, True, True]
    return _prepared(torch, lambda: backward(dy, x, [n_cols], mean, rstd, gamma, beta,
                                             output_mask),
                     num_threads, out_buffer)


def _rms_forward(inputs, num_threads, out_buffer):
    torch = _torch(num_threads)
    x, gamma = _tensors(torch, inputs, "x", "gamma")
    rms_norm, normalized_shape = torch.nn.functional.rms_norm, (inputs.n_cols,)
    return _prepared(torch, lambda: rms_norm(x, normalized_shape, gamma, EPS), num_threads,
                     out_buffer)


_fused_backward_runs = {}


def fused_rms_backward_runs():
    """True when aten._fused_rms_norm_backward exists and has a CPU kernel (tried once on a
    tiny tensor: PyTorch 2.13 has the op, but for CUDA only)."""
    import torch

    if "cpu" not in _fused_backward_runs:
        try:
            x = torch.ones(2, 3)
            _, rstd = torch.ops.aten._fused_rms_norm(x, [3], None, EPS)
            torch.ops.aten._fused_rms_norm_backward(x, x, [3], rstd, None, [True, False])
            _fused_backward_runs["cpu"] = True
        except (AttributeError, NotImplementedError, RuntimeError):
            _fused_backward_runs["cpu"] = False
    return _fused_backward_runs["cpu"]


def _rms_backward(inputs, num_threads, out_buffer):
    torch = _torch(num_threads)
    x, gamma, dy = _tensors(torch, inputs, "x", "gamma", "dy")
    n_cols = inputs.n_cols
    if fused_rms_backward_runs():
        _, rstd = torch.ops.aten._fused_rms_norm(x, [n_cols], gamma, EPS)
        backward = torch.ops.aten._fused_rms_norm_backward

        def call():
            return backward(dy, x, [n_cols], rstd, gamma, [True, True])
    else:
        # Autograd: the graph is recorded once here; each call runs only its backward, with
        # autograd's bookkeeping on top (see the module docstring).
        x_leaf = x.detach().requires_grad_(True)
        gamma_leaf = gamma.detach().requires_grad_(True)
        y = torch.nn.functional.rms_norm(x_leaf, (n_cols,), gamma_leaf, EPS)
        grad = torch.autograd.grad

        def call():
            return grad(y, (x_leaf, gamma_leaf), dy, retain_graph=True)

    return _prepared(torch, call, num_threads, out_buffer)


def _add_norm(kind):
    def prepare(inputs, num_threads, out_buffer):
        torch = _torch(num_threads)
        x, residual, gamma = _tensors(torch, inputs, "x", "residual", "gamma")
        normalized_shape, add = (inputs.n_cols,), torch.add
        if kind == "layer_norm":
            beta, layer_norm = tensor(torch, inputs.beta), torch.nn.functional.layer_norm

            def norm(s):
                return layer_norm(s, normalized_shape, gamma, beta, EPS)
        else:
            rms_norm = torch.nn.functional.rms_norm

            def norm(s):
                return rms_norm(s, normalized_shape, gamma, EPS)

        def call():
            s = add(x, residual)
            return norm(s), s

        return _prepared(torch, call, num_threads, out_buffer)
    return prepare


def _batch_norm_parameters(torch, inputs):
    """gamma and beta as tensors in the running statistics' dtype: float32 for the half formats,
    PyTorch's mixed-precision batch norm (it takes the parameters and statistics all in x's dtype
    or all in float32)."""
    dtype = inputs.running_mean.dtype
    return (tensor(torch, array.astype(dtype, copy=False)) for array in (inputs.gamma, inputs.beta))


def _batch_norm_train(inputs, num_threads, out_buffer):
    torch = _torch(num_threads)
    x = tensor(torch, inputs.x)
    gamma, beta = _batch_norm_parameters(torch, inputs)
    running = RunningStatistics(inputs, unbiased_variance=True)
    # Views of running.mean / running.var: torch's in-place updates land in them.
    running_mean, running_var = tensor(torch, running.mean), tensor(torch, running.var)
    batch_norm, torch_momentum = torch.nn.functional.batch_norm, 1.0 - MOMENTUM

    def call():
        running.updates += 1
        return batch_norm(x, running_mean, running_var, gamma, beta, True, torch_momentum, EPS)

    return _prepared(torch, call, num_threads, out_buffer, result_arrays=running.result_arrays)


def _batch_norm_eval(inputs, num_threads, out_buffer):
    torch = _torch(num_threads)
    x, running_mean, running_var = (
        tensor(torch, array) for array in (inputs.x, inputs.running_mean, inputs.running_var))
    gamma, beta = _batch_norm_parameters(torch, inputs)
    batch_norm = torch.nn.functional.batch_norm

    def call():
        return batch_norm(x, running_mean, running_var, gamma, beta, False, eps=EPS)

    return _prepared(torch, call, num_threads, out_buffer)


def _batch_norm_backward(inputs, num_threads, out_buffer):
    torch = _torch(num_threads)
    x, gamma, beta, dy = (tensor(torch, array)
                          for array in (inputs.x, inputs.gamma, inputs.beta, inputs.dy))
    _, save_mean, save_invstd = torch.ops.aten.native_batch_norm(
        x, gamma, beta, None, None, True, 1.0 - MOMENTUM, EPS)
    backward = torch.ops.aten.native_batch_norm_backward

    def call():
        return backward(dy, x, gamma, None, None, save_mean, save_invstd, True, EPS,
                        [True, True, True])

    return _prepared(torch, call, num_threads, out_buffer)


def _group_norm(channels_last):
    def prepare(inputs, num_threads, out_buffer):
        from fastln.bench.ops import group_count

        torch = _torch(num_threads)
        x, gamma, beta = (tensor(torch, array) for array in (inputs.x, inputs.gamma, inputs.beta))
        if channels_last:
            x = x.movedim(-1, 1)  # (N, C, H, W) in channels_last memory format, no copy
        groups, group_norm = group_count(tuple(x.shape)), torch.nn.functional.group_norm

        def result_arrays(y):
            return (y.movedim(1, -1) if channels_last else y).float().numpy(),

        return _prepared(torch, lambda: group_norm(x, groups, gamma, beta, EPS), num_threads,
                         out_buffer, result_arrays=result_arrays if channels_last else None)
    return prepare


def _group_norm_backward(channels_last):
    def prepare(inputs, num_threads, out_buffer):
        from fastln.bench.ops import group_count

        torch = _torch(num_threads)
        x, gamma, beta, dy = (tensor(torch, array)
                              for array in (inputs.x, inputs.gamma, inputs.beta, inputs.dy))
        if channels_last:  # (N, C, H, W) in channels_last memory format, no copy
            x, dy = x.movedim(-1, 1), dy.movedim(-1, 1)
        leaves = tuple(t.detach().requires_grad_(True) for t in (x, gamma, beta))
        y = torch.nn.functional.group_norm(leaves[0], group_count(tuple(x.shape)), leaves[1],
                                           leaves[2], EPS)
        grad = torch.autograd.grad

        def call():
            return grad(y, leaves, dy, retain_graph=True)

        def result_arrays(grads):
            dx, dgamma, dbeta = grads
            return tuple(t.float().numpy() for t in (dx.movedim(1, -1), dgamma, dbeta))

        return _prepared(torch, call, num_threads, out_buffer,
                         result_arrays=result_arrays if channels_last else None)
    return prepare


def _instance_norm(inputs, num_threads, out_buffer):
    torch = _torch(num_threads)
    x, gamma, beta = (tensor(torch, array) for array in (inputs.x, inputs.gamma, inputs.beta))
    instance_norm = torch.nn.functional.instance_norm
    return _prepared(torch, lambda: instance_norm(x, weight=gamma, bias=beta, eps=EPS),
                     num_threads, out_buffer)


def _torch_implementation(prepare, description, dtypes=None):
    return (Implementation("torch", "torch", prepare, description, dtypes=dtypes),)


IMPLEMENTATIONS = {
    "forward": _torch_implementation(_forward, "torch.nn.functional.layer_norm"),
    "backward": _torch_implementation(_backward,
                                      "aten.native_layer_norm_backward (no autograd)"),
    "rms_forward": _torch_implementation(_rms_forward, "torch.nn.functional.rms_norm"),
    "rms_backward": _torch_implementation(
        _rms_backward, "autograd.grad of F.rms_norm (aten._fused_rms_norm_backward where it "
                       "has a CPU kernel)"),
    "add_layer_norm": _torch_implementation(_add_norm("layer_norm"),
                                            "torch.add, then torch.nn.functional.layer_norm"),
    "add_rms_norm": _torch_implementation(_add_norm("rms_norm"),
                                          "torch.add, then torch.nn.functional.rms_norm"),
    "batch_norm_train": _torch_implementation(
        _batch_norm_train, "torch.nn.functional.batch_norm(training=True)"),
    "batch_norm_eval": _torch_implementation(
        _batch_norm_eval, "torch.nn.functional.batch_norm(training=False)"),
    "batch_norm_backward": _torch_implementation(
        _batch_norm_backward, "aten.native_batch_norm_backward (no autograd)"),
    "group_norm": _torch_implementation(_group_norm(False), "torch.nn.functional.group_norm"),
    "group_norm_last": _torch_implementation(
        _group_norm(True), "torch.nn.functional.group_norm, torch.channels_last"),
    "group_norm_backward": _torch_implementation(
        _group_norm_backward(False), "autograd.grad of F.group_norm"),
    "group_norm_last_backward": _torch_implementation(
        _group_norm_backward(True), "autograd.grad of F.group_norm, torch.channels_last"),
    "instance_norm": _torch_implementation(_instance_norm, "torch.nn.functional.instance_norm"),
}
