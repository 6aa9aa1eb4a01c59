"""LayerNorm forward and backward, and every implementation the benchmark compares.

Each ``prepare_*`` function does the untimed setup for one case (buffers, an ONNX Runtime
session, the forward pass a backward needs) and returns the call to time. All of them get the
same inputs, the same eps and the same thread count; NumPy has no threads of its own, so its
baselines run on one and are measured once for every thread count (uses_threads=False).

Implementations, by --peers name:
    fastln        fastln.layer_norm / fastln.layer_norm_backward
    numpy         numpy-naive: x.mean, x.var and broadcasting, as commonly written;
                  numpy-inplace: the same maths written well, in place into preallocated buffers,
                  no avoidable temporaries
    torch         torch.nn.functional.layer_norm; backward without autograd through
                  torch.ops.aten.native_layer_norm_backward
    onnxruntime   a LayerNormalization (opset 17) model built in memory; forward only
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

import fastln
from fastln.bench.ops.base import (
    OUTPUT_NEW,
    OUTPUT_NO_OUT,
    OUTPUT_REUSED,
    Implementation,
    Operation,
    Prepared,
)

EPS = 1e-5


@dataclass
class LayerNormInputs:
    """x, gamma and beta for the forward; dy as well for the backward."""

    x: np.ndarray
    gamma: np.ndarray
    beta: np.ndarray
    dy: Optional[np.ndarray] = None

    @property
    def n_cols(self):
        return self.x.shape[-1]


def _random(rng, shape, dtype):
    # Generating in the target dtype avoids a float64 temporary the size of x.
    return rng.standard_normal(shape, dtype=np.dtype(dtype).type)


def make_forward_inputs(shape, dtype, rng):
    n_cols = shape[-1]
    # Rows with an offset and a spread other than 0 and 1, and a gamma/beta that are not
    # ones/zeros, so that no implementation can skip work.
    x = _random(rng, shape, dtype)
    x *= 2.0
    x += 0.5
    gamma = (1.0 + 0.1 * rng.standard_normal(n_cols)).astype(dtype)
    beta = (0.1 * rng.standard_normal(n_cols)).astype(dtype)
    return LayerNormInputs(x, gamma, beta)


def make_backward_inputs(shape, dtype, rng):
    inputs = make_forward_inputs(shape, dtype, rng)
    inputs.dy = _random(rng, shape, dtype)
    return inputs


def forward_bytes_moved(shape, itemsize):
    """Read x, write y."""
    return 2 * int(np.prod(shape)) * itemsize


def backward_bytes_moved(shape, itemsize):
    """Read dy and x, write dx (dgamma, dbeta, mean and rstd are one row each: negligible)."""
    return 3 * int(np.prod(shape)) * itemsize


def _output_mode(out_buffer, has_out):
    if not out_buffer:
        return OUTPUT_NEW
    return OUTPUT_REUSED if has_out else OUTPUT_NO_OUT


# --- fastln ------------------------------------------------------------------------------------

def prepare_fastln_forward(inputs, num_threads, out_buffer):
    x, gamma, beta = inputs.x, inputs.gamma, inputs.beta
    out = np.empty_like(x) if out_buffer else None

    def call():
        return fastln.layer_norm(x, gamma, beta, EPS, out=out, num_threads=num_threads)

    return Prepared(call, _output_mode(out_buffer, True), threads=num_threads)


def prepare_fastln_backward(inputs, num_threads, out_buffer):
    _, cache = fastln.layer_norm_forward(inputs.x, inputs.gamma, inputs.beta, EPS,
                                         num_threads=num_threads)
    dy, gamma = inputs.dy, inputs.gamma
    out = np.empty_like(dy) if out_buffer else None

    def call():
        return fastln.layer_norm_backward(dy, cache, gamma, out=out, num_threads=num_threads)

    return Prepared(call, _output_mode(out_buffer, True), threads=num_threads,
                    result_arrays=tuple)


# --- NumPy ---------------------------------------------------------------------------------------

def numpy_naive_forward(x, gamma, beta, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def numpy_naive_backward(dy, x, mean, rstd, gamma):
    x_hat = (x - mean) * rstd
    dgamma = (dy * x_hat).sum(axis=0)
    dbeta = dy.sum(axis=0)
    dx_hat = dy * gamma
    dx = rstd * (dx_hat - dx_hat.mean(axis=-1, keepdims=True)
                 - x_hat * (dx_hat * x_hat).mean(axis=-1, keepdims=True))
    return dx, dgamma, dbeta


def _row_dots(a, b, out):
    """sum(a * b, axis=-1) into out without an (n_rows, n_cols) temporary."""
    if hasattr(np, "vecdot"):  # NumPy >= 2.0, the faster of the two
        return np.vecdot(a, b, out=out)
    return np.einsum("ij,ij->i", a, b, out=out)


def _numpy_statistics(x):
    """Per-row mean and rstd as (n_rows, 1) columns in x's dtype (what a forward would cache)."""
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + EPS)
    return mean.astype(x.dtype), rstd.astype(x.dtype)


def _as_rows(array):
    return array.reshape(-1, array.shape[-1])


def prepare_numpy_naive_forward(inputs, num_threads, out_buffer):
    x, gamma, beta = inputs.x, inputs.gamma, inputs.beta
    return Prepared(lambda: numpy_naive_forward(x, gamma, beta, EPS),
                    _output_mode(out_buffer, False))


def prepare_numpy_naive_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = _as_rows(inputs.x), _as_rows(inputs.dy), inputs.gamma
    mean, rstd = _numpy_statistics(x)
    return Prepared(lambda: numpy_naive_backward(dy, x, mean, rstd, gamma),
                    _output_mode(out_buffer, False), result_arrays=tuple)


def prepare_numpy_inplace_forward(inputs, num_threads, out_buffer):
    x, gamma, beta = _as_rows(inputs.x), inputs.gamma, inputs.beta
    n_rows, n_cols = x.shape
    # One (n_rows,) buffer per statistic, kept across calls like a training loop would.
    mean = np.empty(n_rows, x.dtype)
    rstd = np.empty(n_rows, x.dtype)
    mean_column, rstd_column = mean[:, None], rstd[:, None]
    preallocated = np.empty_like(x) if out_buffer else None

    def call():
        y = preallocated if preallocated is not None else np.empty_like(x)
        np.mean(x, axis=1, out=mean)
        np.subtract(x, mean_column, out=y)             # y holds x - mean
        _row_dots(y, y, out=rstd)                      # rstd holds sum((x - mean)^2)
        np.divide(rstd, n_cols, out=rstd)
        np.add(rstd, EPS, out=rstd)
        np.sqrt(rstd, out=rstd)
        np.reciprocal(rstd, out=rstd)
        y *= rstd_column
        y *= gamma
        y += beta
        return y

    return Prepared(call, _output_mode(out_buffer, True),
                    result_arrays=lambda y: (y.reshape(inputs.x.shape),))


def prepare_numpy_inplace_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = _as_rows(inputs.x), _as_rows(inputs.dy), inputs.gamma
    n_rows, n_cols = x.shape
    mean, rstd = _numpy_statistics(x)
    # dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with g = dy * gamma needs two full
    # arrays at once: x_hat lives in dx, g in one scratch buffer kept across calls.
    scratch = np.empty_like(x)
    g_mean = np.empty(n_rows, x.dtype)
    g_xhat_mean = np.empty(n_rows, x.dtype)
    dgamma = np.empty(n_cols, x.dtype)
    dbeta = np.empty(n_cols, x.dtype)
    preallocated = np.empty_like(x) if out_buffer else None

    def call():
        dx = preallocated if preallocated is not None else np.empty_like(x)
        x_hat = dx
        np.subtract(x, mean, out=x_hat)
        x_hat *= rstd
        np.einsum("ij,ij->j", dy, x_hat, out=dgamma)
        np.sum(dy, axis=0, out=dbeta)
        g = np.multiply(dy, gamma, out=scratch)
        np.mean(g, axis=1, out=g_mean)
        _row_dots(g, x_hat, out=g_xhat_mean)
        np.divide(g_xhat_mean, n_cols, out=g_xhat_mean)
        x_hat *= g_xhat_mean[:, None]
        g -= g_mean[:, None]
        g -= x_hat
        np.multiply(g, rstd, out=dx)
        return dx, dgamma, dbeta

    return Prepared(call, _output_mode(out_buffer, True), result_arrays=tuple)


# --- PyTorch -------------------------------------------------------------------------------------

def _torch_with_threads(num_threads):
    import torch

    torch.set_num_threads(num_threads)
    return torch


def _torch_thread_setter(torch, num_threads):
    # Process-wide: set again before each sample, as calls with other counts may run between.
    return lambda: torch.set_num_threads(num_threads)


def _torch_tensors(torch, inputs):
    # from_numpy shares memory: no copy, and torch reads exactly the arrays the others read.
    x = torch.from_numpy(_as_rows(inputs.x))
    gamma = torch.from_numpy(inputs.gamma)
    beta = torch.from_numpy(inputs.beta)
    return x, gamma, beta


def prepare_torch_forward(inputs, num_threads, out_buffer):
    torch = _torch_with_threads(num_threads)
    n_cols = inputs.n_cols
    x, gamma, beta = _torch_tensors(torch, inputs)
    layer_norm = torch.nn.functional.layer_norm

    def call():
        return layer_norm(x, (n_cols,), gamma, beta, EPS)

    return Prepared(call, _output_mode(out_buffer, False), threads=num_threads,
                    result_arrays=lambda y: (y.numpy(),),
                    before_sample=_torch_thread_setter(torch, num_threads))


def prepare_torch_backward(inputs, num_threads, out_buffer):
    torch = _torch_with_threads(num_threads)
    n_cols = inputs.n_cols
    x, gamma, beta = _torch_tensors(torch, inputs)
    dy = torch.from_numpy(_as_rows(inputs.dy))
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [n_cols], gamma, beta, EPS)
    backward = torch.ops.aten.native_layer_norm_backward
    output_mask = [True, True, True]

    def call():
        return backward(dy, x, [n_cols], mean, rstd, gamma, beta, output_mask)

    return Prepared(call, _output_mode(out_buffer, False), threads=num_threads,
                    result_arrays=lambda grads: tuple(g.numpy() for g in grads),
                    before_sample=_torch_thread_setter(torch, num_threads))


# --- ONNX Runtime --------------------------------------------------------------------------------

_onnx_sessions = {}


def _onnx_layer_norm_session(dtype, num_threads):
    """An InferenceSession for LayerNormalization (opset 17) over the last axis, cached."""
    key = (np.dtype(dtype), num_threads)
    if key in _onnx_sessions:
        return _onnx_sessions[key]
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    element_type = {np.dtype(np.float32): TensorProto.FLOAT,
                    np.dtype(np.float64): TensorProto.DOUBLE}[np.dtype(dtype)]
    graph = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"],
                          axis=-1, epsilon=EPS)],
        "layer_norm",
        [helper.make_tensor_value_info("x", element_type, ["rows", "cols"]),
         helper.make_tensor_value_info("scale", element_type, ["cols"]),
         helper.make_tensor_value_info("bias", element_type, ["cols"])],
        [helper.make_tensor_value_info("y", element_type, ["rows", "cols"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 8)  # readable by older runtimes too
    onnx.checker.check_model(model)

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = num_threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    # ONNX Runtime's idle workers spin, waiting for the next run: measured interleaved, they
    # would take the cores away from whichever implementation runs next. fastln's and torch's
    # OpenMP workers spin only briefly before they sleep; let ONNX Runtime's sleep too.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    _onnx_sessions[key] = session
    return session


def prepare_onnxruntime_forward(inputs, num_threads, out_buffer):
    x, gamma, beta = _as_rows(inputs.x), inputs.gamma, inputs.beta
    session = _onnx_layer_norm_session(x.dtype, num_threads)
    if not out_buffer:
        feed = {"x": x, "scale": gamma, "bias": beta}
        return Prepared(lambda: session.run(None, feed)[0], OUTPUT_NEW, threads=num_threads)

    # IO binding: ONNX Runtime reads the NumPy inputs in place and writes into our buffer.
    y = np.empty_like(x)
    binding = session.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_cpu_input("scale", gamma)
    binding.bind_cpu_input("bias", beta)
    binding.bind_output("y", "cpu", 0, x.dtype, list(y.shape), y.ctypes.data)
    run_with_binding = session.run_with_iobinding

    def call():
        run_with_binding(binding)
        return y

    return Prepared(call, OUTPUT_REUSED, threads=num_threads)


# --- the operations --------------------------------------------------------------------------------

FORWARD = Operation(
    name="forward",
    title="layer_norm forward",
    make_inputs=make_forward_inputs,
    bytes_moved=forward_bytes_moved,
    # x; one output each for fastln, numpy-inplace, torch/onnxruntime; numpy-naive's temporaries.
    memory_factor=8,
    implementations=(
        Implementation("fastln", "fastln", prepare_fastln_forward,
                       "fastln.layer_norm"),
        Implementation("numpy-naive", "numpy", prepare_numpy_naive_forward,
                       "x.mean / x.var and broadcasting", uses_threads=False),
        Implementation("numpy-inplace", "numpy", prepare_numpy_inplace_forward,
                       "NumPy in place into preallocated buffers", uses_threads=False),
        Implementation("torch", "torch", prepare_torch_forward,
                       "torch.nn.functional.layer_norm"),
        Implementation("onnxruntime", "onnxruntime", prepare_onnxruntime_forward,
                       "LayerNormalization, opset 17"),
    ),
)

BACKWARD = Operation(
    name="backward",
    title="layer_norm backward",
    make_inputs=make_backward_inputs,
    bytes_moved=backward_bytes_moved,
    # x and dy; dx for fastln, numpy-inplace (plus scratch) and torch; numpy-naive's temporaries.
    memory_factor=11,
    implementations=(
        Implementation("fastln", "fastln", prepare_fastln_backward,
                       "fastln.layer_norm_backward"),
        Implementation("numpy-naive", "numpy", prepare_numpy_naive_backward,
                       "broadcasting, one temporary per term", uses_threads=False),
        Implementation("numpy-inplace", "numpy", prepare_numpy_inplace_backward,
                       "NumPy in place, one preallocated scratch array", uses_threads=False),
        Implementation("torch", "torch", prepare_torch_backward,
                       "aten.native_layer_norm_backward (no autograd)"),
    ),
)

OPERATIONS = (FORWARD, BACKWARD)
