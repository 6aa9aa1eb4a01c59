"""RMSNorm forward and backward, and every implementation the benchmark compares.

Built like ``fastln.bench.ops.layer_norm`` (same inputs, eps, threads and checks); the
statistics are over the last axis, one per row: ``y = x / sqrt(mean(x**2) + eps) * gamma``.

Operations (--ops names) and the bytes they must move, for the effective bandwidth (n elements
of x, each of `itemsize` bytes; per-row statistics and gamma-sized results are negligible):
    rms_forward    read x, write y                          2 * n * itemsize
    rms_backward   read dy and x, write dx (and dgamma)     3 * n * itemsize

Implementations, by --peers name:
    fastln        fastln.rms_norm / fastln.rms_norm_backward
    numpy         numpy-naive: (x**2).mean and broadcasting, as commonly written;
                  numpy-inplace: the same maths written well, in place into preallocated
                  buffers, no avoidable temporaries
    torch         torch.nn.functional.rms_norm. Backward through AUTOGRAD on the CPU:
                  torch.autograd.grad(y, (x, gamma), dy, retain_graph=True) on the graph of
                  F.rms_norm recorded once, untimed. PyTorch has an autograd-free kernel,
                  aten._fused_rms_norm_backward, for CUDA only (2.13): on the CPU rms_norm is a
                  composite of elementwise and reduction ops, and its gradient runs their
                  backwards one by one, with autograd's per-call bookkeeping on top; it is what
                  training with PyTorch on the CPU runs. Where the aten op does have a CPU
                  kernel (tried once on a tiny tensor), it is used instead, without autograd.
    onnxruntime   an RMSNormalization (opset 23) model built in memory, when the installed
                  onnx and onnxruntime know that opset; forward only (ONNX has no backward op)
"""
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

import fastln
from fastln.bench.ops.base import (
    EPS,
    OUTPUT_NEW,
    OUTPUT_REUSED,
    Implementation,
    Operation,
    Prepared,
    as_rows,
    fastln_threads,
    onnx_element_type,
    onnxruntime_session,
    output_mode,
    random_array,
    row_dots,
    torch_thread_setter,
    torch_with_threads,
)

# The first opset with RMSNormalization.
ONNX_RMS_OPSET = 23


@dataclass
class RMSNormInputs:
    """x and gamma for the forward; dy as well for the backward."""

    x: np.ndarray
    gamma: np.ndarray
    dy: Optional[np.ndarray] = None

    @property
    def n_cols(self):
        return self.x.shape[-1]


def make_forward_inputs(shape, dtype, rng):
    n_cols = shape[-1]
    # An offset and a spread other than 0 and 1, and a gamma that is not ones, so that no
    # implementation can skip work.
    x = random_array(rng, shape, dtype)
    x *= 2.0
    x += 0.5
    gamma = (1.0 + 0.1 * rng.standard_normal(n_cols)).astype(dtype)
    return RMSNormInputs(x, gamma)


def make_backward_inputs(shape, dtype, rng):
    inputs = make_forward_inputs(shape, dtype, rng)
    inputs.dy = random_array(rng, shape, dtype)
    return inputs


def forward_bytes_moved(shape, itemsize):
    """Read x, write y."""
    return 2 * int(np.prod(shape)) * itemsize


def backward_bytes_moved(shape, itemsize):
    """Read dy and x, write dx (dgamma and rstd are one row each: negligible)."""
    return 3 * int(np.prod(shape)) * itemsize


# --- fastln --------------------------------------------------------------------------------------

def prepare_fastln_forward(inputs, num_threads, out_buffer):
    x, gamma = inputs.x, inputs.gamma
    out = np.empty_like(x) if out_buffer else None

    def call():
        return fastln.rms_norm(x, gamma, EPS, out=out, num_threads=num_threads)

    return Prepared(call, output_mode(out_buffer, True), threads=fastln_threads(num_threads))


def prepare_fastln_backward(inputs, num_threads, out_buffer):
    _, cache = fastln.rms_norm_forward(inputs.x, inputs.gamma, EPS, num_threads=num_threads)
    dy, gamma = inputs.dy, inputs.gamma
    out = np.empty_like(dy) if out_buffer else None

    def call():
        return fastln.rms_norm_backward(dy, cache, gamma, out=out, num_threads=num_threads)

    return Prepared(call, output_mode(out_buffer, True), threads=fastln_threads(num_threads),
                    result_arrays=tuple)


# --- NumPy ---------------------------------------------------------------------------------------

def numpy_naive_forward(x, gamma, eps):
    return x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + eps) * gamma


def numpy_naive_backward(dy, x, rstd, gamma):
    x_hat = x * rstd
    dgamma = (dy * x_hat).sum(axis=0)
    dx_hat = dy * gamma
    dx = rstd * (dx_hat - x_hat * (dx_hat * x_hat).mean(axis=-1, keepdims=True))
    return dx, dgamma


def _numpy_rstd(x):
    """Per-row rstd as an (n_rows, 1) column in x's dtype (what a forward would cache)."""
    return (1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS)).astype(x.dtype)


def prepare_numpy_naive_forward(inputs, num_threads, out_buffer):
    x, gamma = inputs.x, inputs.gamma
    return Prepared(lambda: numpy_naive_forward(x, gamma, EPS), output_mode(out_buffer, False))


def prepare_numpy_naive_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = as_rows(inputs.x), as_rows(inputs.dy), inputs.gamma
    rstd = _numpy_rstd(x)
    return Prepared(lambda: numpy_naive_backward(dy, x, rstd, gamma),
                    output_mode(out_buffer, False), result_arrays=tuple)


def numpy_inplace_rms_norm(n_rows, dtype, gamma):
    """normalize(x, y) -> y: RMSNorm of the rows of a 2-D x into y, in place.

    The (n_rows,) rstd buffer is made here and kept across calls like a training loop would.
    """
    rstd = np.empty(n_rows, dtype)
    rstd_column = rstd[:, None]

    def normalize(x, y):
        row_dots(x, x, out=rstd)                       # rstd holds sum(x^2)
        np.divide(rstd, x.shape[1], out=rstd)
        np.add(rstd, EPS, out=rstd)
        np.sqrt(rstd, out=rstd)
        np.reciprocal(rstd, out=rstd)
        np.multiply(x, rstd_column, out=y)
        y *= gamma
        return y

    return normalize


def prepare_numpy_inplace_forward(inputs, num_threads, out_buffer):
    x = as_rows(inputs.x)
    normalize = numpy_inplace_rms_norm(x.shape[0], x.dtype, inputs.gamma)
    preallocated = np.empty_like(x) if out_buffer else None

    def call():
        return normalize(x, preallocated if preallocated is not None else np.empty_like(x))

    return Prepared(call, output_mode(out_buffer, True),
                    result_arrays=lambda y: (y.reshape(inputs.x.shape),))


def prepare_numpy_inplace_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = as_rows(inputs.x), as_rows(inputs.dy), inputs.gamma
    n_rows, n_cols = x.shape
    rstd = _numpy_rstd(x)
    # dx = rstd * (g - x_hat * mean(g * x_hat)) with g = dy * gamma and x_hat = x * rstd:
    # x_hat lives in dx, g in one scratch buffer kept across calls.
    scratch = np.empty_like(x)
    g_xhat_mean = np.empty(n_rows, x.dtype)
    dgamma = np.empty(n_cols, x.dtype)
    preallocated = np.empty_like(x) if out_buffer else None

    def call():
        dx = preallocated if preallocated is not None else np.empty_like(x)
        x_hat = np.multiply(x, rstd, out=dx)
        np.einsum("ij,ij->j", dy, x_hat, out=dgamma)
        g = np.multiply(dy, gamma, out=scratch)
        row_dots(g, x_hat, out=g_xhat_mean)
        np.divide(g_xhat_mean, n_cols, out=g_xhat_mean)
        x_hat *= g_xhat_mean[:, None]
        g -= x_hat
        np.multiply(g, rstd, out=dx)
        return dx, dgamma

    return Prepared(call, output_mode(out_buffer, True), result_arrays=tuple)


# --- PyTorch -------------------------------------------------------------------------------------

def _torch_tensors(torch, inputs):
    # from_numpy shares memory: no copy, and torch reads exactly the arrays the others read.
    return torch.from_numpy(as_rows(inputs.x)), torch.from_numpy(inputs.gamma)


def prepare_torch_forward(inputs, num_threads, out_buffer):
    torch = torch_with_threads(num_threads)
    n_cols = inputs.n_cols
    x, gamma = _torch_tensors(torch, inputs)
    rms_norm = torch.nn.functional.rms_norm

    def call():
        return rms_norm(x, (n_cols,), gamma, EPS)

    return Prepared(call, output_mode(out_buffer, False), threads=num_threads,
                    result_arrays=lambda y: (y.numpy(),),
                    before_sample=torch_thread_setter(torch, num_threads))


_fused_backward_runs: Dict[str, bool] = {}


def torch_fused_rms_backward_runs():
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


def prepare_torch_backward(inputs, num_threads, out_buffer):
    torch = torch_with_threads(num_threads)
    n_cols = inputs.n_cols
    x, gamma = _torch_tensors(torch, inputs)
    dy = torch.from_numpy(as_rows(inputs.dy))

    if torch_fused_rms_backward_runs():
        _, rstd = torch.ops.aten._fused_rms_norm(x, [n_cols], gamma, EPS)
        backward = torch.ops.aten._fused_rms_norm_backward
        output_mask = [True, True]

        def call():
            return backward(dy, x, [n_cols], rstd, gamma, output_mask)
    else:
        # Autograd: the graph is recorded once here; each call runs only its backward, with
        # autograd's bookkeeping on top (see the module docstring).
        x_leaf = x.detach().requires_grad_(True)
        gamma_leaf = gamma.detach().requires_grad_(True)
        y = torch.nn.functional.rms_norm(x_leaf, (n_cols,), gamma_leaf, EPS)
        grad = torch.autograd.grad

        def call():
            return grad(y, (x_leaf, gamma_leaf), dy, retain_graph=True)

    return Prepared(call, output_mode(out_buffer, False), threads=num_threads,
                    result_arrays=lambda grads: tuple(g.numpy() for g in grads),
                    before_sample=torch_thread_setter(torch, num_threads))


# --- ONNX Runtime --------------------------------------------------------------------------------

def onnx_supports_rms_normalization():
    """True when the installed onnx and onnxruntime both know RMSNormalization (opset 23)."""
    import onnxruntime
    from onnx import defs

    try:
        defs.get_schema("RMSNormalization", ONNX_RMS_OPSET, "")
    except Exception:  # onnx < 1.18
        return False
    # onnxruntime 1.22 was the first release to implement opset 23.
    version = tuple(int(part) for part in onnxruntime.__version__.split(".")[:2]
                    if part.isdigit())
    return version >= (1, 22)


def _onnx_rms_norm_model(dtype):
    """RMSNormalization (opset 23) over the last axis of (rows, cols)."""
    from onnx import helper

    element_type = onnx_element_type(dtype)
    graph = helper.make_graph(
        [helper.make_node("RMSNormalization", ["x", "scale"], ["y"], axis=-1, epsilon=EPS)],
        "rms_norm",
        [helper.make_tensor_value_info("x", element_type, ["rows", "cols"]),
         helper.make_tensor_value_info("scale", element_type, ["cols"])],
        [helper.make_tensor_value_info("y", element_type, ["rows", "cols"])],
    )
    model = helper.make_model(graph,
                              opset_imports=[helper.make_opsetid("", ONNX_RMS_OPSET)])
    model.ir_version = min(model.ir_version, 10)  # the IR of opset 23
    return model


def prepare_onnxruntime_forward(inputs, num_threads, out_buffer):
    if not onnx_supports_rms_normalization():
        raise RuntimeError("the installed onnx/onnxruntime have no RMSNormalization "
                           f"(opset {ONNX_RMS_OPSET}; onnxruntime >= 1.22)")
    x, gamma = as_rows(inputs.x), inputs.gamma
    session = onnxruntime_session(("rms_norm", x.dtype), lambda: _onnx_rms_norm_model(x.dtype),
                                  num_threads)
    if not out_buffer:
        feed = {"x": x, "scale": gamma}
        return Prepared(lambda: session.run(None, feed)[0], OUTPUT_NEW, threads=num_threads,
                        result_arrays=lambda y: (y.reshape(inputs.x.shape),))

    # IO binding: ONNX Runtime reads the NumPy inputs in place and writes into our buffer.
    y = np.empty_like(x)
    binding = session.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_cpu_input("scale", gamma)
    binding.bind_output("y", "cpu", 0, x.dtype, list(y.shape), y.ctypes.data)
    run_with_binding = session.run_with_iobinding

    def call():
        run_with_binding(binding)
        return y

    return Prepared(call, OUTPUT_REUSED, threads=num_threads,
                    result_arrays=lambda y: (y.reshape(inputs.x.shape),))


# --- the operations ------------------------------------------------------------------------------

RMS_FORWARD = Operation(
    name="rms_forward",
    title="rms_norm forward",
    make_inputs=make_forward_inputs,
    bytes_moved=forward_bytes_moved,
    # x; one output each for fastln, numpy-inplace, torch/onnxruntime; numpy-naive's temporaries.
    memory_factor=8,
    implementations=(
        Implementation("fastln", "fastln", prepare_fastln_forward, "fastln.rms_norm"),
        Implementation("numpy-naive", "numpy", prepare_numpy_naive_forward,
                       "(x**2).mean and broadcasting", uses_threads=False),
        Implementation("numpy-inplace", "numpy", prepare_numpy_inplace_forward,
                       "NumPy in place into preallocated buffers", uses_threads=False),
        Implementation("torch", "torch", prepare_torch_forward,
                       "torch.nn.functional.rms_norm"),
        Implementation("onnxruntime", "onnxruntime", prepare_onnxruntime_forward,
                       f"RMSNormalization, opset {ONNX_RMS_OPSET}"),
    ),
)

RMS_BACKWARD = Operation(
    name="rms_backward",
    title="rms_norm backward",
    make_inputs=make_backward_inputs,
    bytes_moved=backward_bytes_moved,
    # x and dy; dx for fastln, numpy-inplace (plus scratch) and torch; numpy-naive's temporaries.
    memory_factor=11,
    implementations=(
        Implementation("fastln", "fastln", prepare_fastln_backward,
                       "fastln.rms_norm_backward"),
        Implementation("numpy-naive", "numpy", prepare_numpy_naive_backward,
                       "broadcasting, one temporary per term", uses_threads=False),
        Implementation("numpy-inplace", "numpy", prepare_numpy_inplace_backward,
                       "NumPy in place, one preallocated scratch array", uses_threads=False),
        Implementation("torch", "torch", prepare_torch_backward,
                       "autograd.grad of F.rms_norm (aten._fused_rms_norm_backward "
                       "where it has a CPU kernel)"),
    ),
)

OPERATIONS = (RMS_FORWARD, RMS_BACKWARD)
