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


def make_forward_inputs(shape, dtype, rng):
    n_cols = shape[-1]
    # Rows with an offset and a spread other than 0 and 1, and a gamma/beta that are not
    # ones/zeros, so that no implementation can skip work.
    x = random_array(rng, shape, dtype)
    x *= 2.0
    x += 0.5
    gamma = (1.0 + 0.1 * rng.standard_normal(n_cols)).astype(dtype)
    beta = (0.1 * rng.standard_normal(n_cols)).astype(dtype)
    return LayerNormInputs(x, gamma, beta)


def make_backward_inputs(shape, dtype, rng):
    inputs = make_forward_inputs(shape, dtype, rng)
    inputs.dy = random_array(rng, shape, dtype)
    return inputs


def forward_bytes_moved(shape, itemsize):
    """Read x, write y."""
    return 2 * int(np.prod(shape)) * itemsize


def backward_bytes_moved(shape, itemsize):
    """Read dy and x, write dx (dgamma, dbeta, mean and rstd are one row each: negligible)."""
    return 3 * int(np.prod(shape)) * itemsize


# --- fastln --------------------------------------------------------------------------------------

def prepare_fastln_forward(inputs, num_threads, out_buffer):
    x, gamma, beta = inputs.x, inputs.gamma, inputs.beta
    out = np.empty_like(x) if out_buffer else None

    def call():
        return fastln.layer_norm(x, gamma, beta, EPS, out=out, num_threads=num_threads)

    return Prepared(call, output_mode(out_buffer, True), threads=fastln_threads(num_threads))


def prepare_fastln_backward(inputs, num_threads, out_buffer):
    _, cache = fastln.layer_norm_forward(inputs.x, inputs.gamma, inputs.beta, EPS,
                                         num_threads=num_threads)
    dy, gamma = inputs.dy, inputs.gamma
    out = np.empty_like(dy) if out_buffer else None

    def call():
        return fastln.layer_norm_backward(dy, cache, gamma, out=out, num_threads=num_threads)

    return Prepared(call, output_mode(out_buffer, True), threads=fastln_threads(num_threads),
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


def _numpy_statistics(x):
    """Per-row mean and rstd as (n_rows, 1) columns in x's dtype (what a forward would cache)."""
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + EPS)
    return mean.astype(x.dtype), rstd.astype(x.dtype)


def prepare_numpy_naive_forward(inputs, num_threads, out_buffer):
    x, gamma, beta = inputs.x, inputs.gamma, inputs.beta
    return Prepared(lambda: numpy_naive_forward(x, gamma, beta, EPS),
                    output_mode(out_buffer, False))


def prepare_numpy_naive_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = as_rows(inputs.x), as_rows(inputs.dy), inputs.gamma
    mean, rstd = _numpy_statistics(x)
    return Prepared(lambda: numpy_naive_backward(dy, x, mean, rstd, gamma),
                    output_mode(out_buffer, False), result_arrays=tuple)


def numpy_inplace_layer_norm(n_rows, dtype, gamma, beta):
    """normalize(x, y) -> y: LayerNorm of the rows of a 2-D x into y, in place.

    One (n_rows,) buffer per statistic, made here and kept across calls like a training loop
    would.
    """
    mean = np.empty(n_rows, dtype)
    rstd = np.empty(n_rows, dtype)
    mean_column, rstd_column = mean[:, None], rstd[:, None]

    def normalize(x, y):
        np.mean(x, axis=1, out=mean)
        np.subtract(x, mean_column, out=y)             # y holds x - mean
        row_dots(y, y, out=rstd)                       # rstd holds sum((x - mean)^2)
        np.divide(rstd, x.shape[1], out=rstd)
        np.add(rstd, EPS, out=rstd)
        np.sqrt(rstd, out=rstd)
        np.reciprocal(rstd, out=rstd)
        y *= rstd_column
        y *= gamma
        y += beta
        return y

    return normalize


def prepare_numpy_inplace_forward(inputs, num_threads, out_buffer):
    x = as_rows(inputs.x)
    normalize = numpy_inplace_layer_norm(x.shape[0], x.dtype, inputs.gamma, inputs.beta)
    preallocated = np.empty_like(x) if out_buffer else None

    def call():
        return normalize(x, preallocated if preallocated is not None else np.empty_like(x))

    return Prepared(call, output_mode(out_buffer, True),
                    result_arrays=lambda y: (y.reshape(inputs.x.shape),))


def prepare_numpy_inplace_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = as_rows(inputs.x), as_rows(inputs.dy), inputs.gamma
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
        row_dots(g, x_hat, out=g_xhat_mean)
        np.divide(g_xhat_mean, n_cols, out=g_xhat_mean)
        x_hat *= g_xhat_mean[:, None]
        g -= g_mean[:, None]
        g -= x_hat
        np.multiply(g, rstd, out=dx)
        return dx, dgamma, dbeta

    return Prepared(call, output_mode(out_buffer, True), result_arrays=tuple)


# --- PyTorch -------------------------------------------------------------------------------------

def _torch_tensors(torch, inputs):
    # from_numpy shares memory: no copy, and torch reads exactly the arrays the others read.
    x = torch.from_numpy(as_rows(inputs.x))
    gamma = torch.from_numpy(inputs.gamma)
    beta = torch.from_numpy(inputs.beta)
    return x, gamma, beta


def prepare_torch_forward(inputs, num_threads, out_buffer):
    torch = torch_with_threads(num_threads)
    n_cols = inputs.n_cols
    x, gamma, beta = _torch_tensors(torch, inputs)
    layer_norm = torch.nn.functional.layer_norm

    def call():
        return layer_norm(x, (n_cols,), gamma, beta, EPS)

    return Prepared(call, output_mode(out_buffer, False), threads=num_threads,
                    result_arrays=lambda y: (y.numpy(),),
                    before_sample=torch_thread_setter(torch, num_threads))


def prepare_torch_backward(inputs, num_threads, out_buffer):
    torch = torch_with_threads(num_threads)
    n_cols = inputs.n_cols
    x, gamma, beta = _torch_tensors(torch, inputs)
    dy = torch.from_numpy(as_rows(inputs.dy))
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [n_cols], gamma, beta, EPS)
    backward = torch.ops.aten.native_layer_norm_backward
    output_mask = [True, True, True]

    def call():
        return backward(dy, x, [n_cols], mean, rstd, gamma, beta, output_mask)

    return Prepared(call, output_mode(out_buffer, False), threads=num_threads,
                    result_arrays=lambda grads: tuple(g.numpy() for g in grads),
                    before_sample=torch_thread_setter(torch, num_threads))


# --- ONNX Runtime --------------------------------------------------------------------------------

def _onnx_layer_norm_model(dtype):
    """LayerNormalization (opset 17) over the last axis of (rows, cols)."""
    from onnx import helper

    element_type = onnx_element_type(dtype)
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
    return model


def _onnx_layer_norm_session(dtype, num_threads):
    """An InferenceSession for LayerNormalization (opset 17) over the last axis, cached."""
    return onnxruntime_session(("layer_norm", np.dtype(dtype)),
                               lambda: _onnx_layer_norm_model(dtype), num_threads)


def prepare_onnxruntime_forward(inputs, num_threads, out_buffer):
    x, gamma, beta = as_rows(inputs.x), inputs.gamma, inputs.beta
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


# --- the operations ------------------------------------------------------------------------------

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
