"""Fused residual add + LayerNorm / RMSNorm (forward), and every implementation compared.

What a pre-norm transformer does at every sublayer in inference: ``s = x + residual`` (the new
residual stream) and ``y = norm(s)`` (the next sublayer's input). Both results are outputs and
both are checked against fastln's. Built like ``fastln.bench.ops.layer_norm`` (same eps,
threads and checks); statistics over the last axis, no bias.

Operations (--ops names) and the bytes they must move, for the effective bandwidth (n elements
of x, each of `itemsize` bytes; gamma and beta are one row each: negligible):
    add_layer_norm   read x and residual, write y and s     4 * n * itemsize
    add_rms_norm     read x and residual, write y and s     4 * n * itemsize
An unfused implementation moves more (the add writes s, the norm reads it back); the bandwidth
column counts only what a single pass must move, so it shows what fusing saves.

Implementations, by --peers name:
    fastln        fastln.add_layer_norm / fastln.add_rms_norm (one pass)
    numpy         numpy-naive: x + residual, then the naive norm of fastln.bench.ops.layer_norm /
                  rms_norm; numpy-inplace: np.add into s, then the in-place norm of those modules
                  (preallocated statistics, no avoidable temporaries)
    torch         torch.add, then torch.nn.functional.layer_norm / rms_norm (PyTorch has no fused
                  add + norm on the CPU)
    onnxruntime   float32: the com.microsoft contrib ops SkipLayerNormalization /
                  SkipSimplifiedLayerNormalization, ONNX Runtime's own fused kernels (the anchor
                  of fastln's API; they also return the sum). They have no float64 kernels, so
                  float64 runs the standard graph Add + LayerNormalization (opset 17) /
                  Add + RMSNormalization (opset 23), with the sum as a second output.
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

import fastln
from fastln.bench.ops import layer_norm, rms_norm
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
    torch_thread_setter,
    torch_with_threads,
)


@dataclass
class AddNormInputs:
    """The sublayer output x, the residual stream, gamma, and beta (None for RMSNorm)."""

    x: np.ndarray
    residual: np.ndarray
    gamma: np.ndarray
    beta: Optional[np.ndarray] = None

    @property
    def n_cols(self):
        return self.x.shape[-1]


def _make_inputs(shape, dtype, rng, with_beta):
    n_cols = shape[-1]
    # Offsets and spreads other than 0 and 1, gamma/beta not ones/zeros: no work can be skipped.
    x = random_array(rng, shape, dtype)
    x += 0.5
    residual = random_array(rng, shape, dtype)
    residual *= 2.0
    gamma = (1.0 + 0.1 * rng.standard_normal(n_cols)).astype(dtype)
    beta = (0.1 * rng.standard_normal(n_cols)).astype(dtype) if with_beta else None
    return AddNormInputs(x, residual, gamma, beta)


def make_add_layer_norm_inputs(shape, dtype, rng):
    return _make_inputs(shape, dtype, rng, with_beta=True)


def make_add_rms_norm_inputs(shape, dtype, rng):
    return _make_inputs(shape, dtype, rng, with_beta=False)


def bytes_moved(shape, itemsize):
    """Read x and residual, write y and s."""
    return 4 * int(np.prod(shape)) * itemsize


def _two_outputs(shape):
    """result_arrays for a (y, s) pair computed on rows: back in the inputs' shape."""
    return lambda result: tuple(np.asarray(array).reshape(shape) for array in result)


# --- fastln --------------------------------------------------------------------------------------

def prepare_fastln_add_layer_norm(inputs, num_threads, out_buffer):
    x, residual, gamma, beta = inputs.x, inputs.residual, inputs.gamma, inputs.beta
    out = np.empty_like(x) if out_buffer else None
    sum_out = np.empty_like(x) if out_buffer else None

    def call():
        return fastln.add_layer_norm(x, residual, gamma, beta, EPS, out=out, sum_out=sum_out,
                                     num_threads=num_threads)

    return Prepared(call, output_mode(out_buffer, True), threads=fastln_threads(num_threads),
                    result_arrays=tuple)


def prepare_fastln_add_rms_norm(inputs, num_threads, out_buffer):
    x, residual, gamma = inputs.x, inputs.residual, inputs.gamma
    out = np.empty_like(x) if out_buffer else None
    sum_out = np.empty_like(x) if out_buffer else None

    def call():
        return fastln.add_rms_norm(x, residual, gamma, EPS, out=out, sum_out=sum_out,
                                   num_threads=num_threads)

    return Prepared(call, output_mode(out_buffer, True), threads=fastln_threads(num_threads),
                    result_arrays=tuple)


# --- NumPy ---------------------------------------------------------------------------------------

def prepare_numpy_naive_add_layer_norm(inputs, num_threads, out_buffer):
    x, residual, gamma, beta = inputs.x, inputs.residual, inputs.gamma, inputs.beta

    def call():
        s = x + residual
        return layer_norm.numpy_naive_forward(s, gamma, beta, EPS), s

    return Prepared(call, output_mode(out_buffer, False), result_arrays=tuple)


def prepare_numpy_naive_add_rms_norm(inputs, num_threads, out_buffer):
    x, residual, gamma = inputs.x, inputs.residual, inputs.gamma

    def call():
        s = x + residual
        return rms_norm.numpy_naive_forward(s, gamma, EPS), s

    return Prepared(call, output_mode(out_buffer, False), result_arrays=tuple)


def _prepare_numpy_inplace(inputs, out_buffer, normalize):
    x, residual = as_rows(inputs.x), as_rows(inputs.residual)
    y_buffer = np.empty_like(x) if out_buffer else None
    s_buffer = np.empty_like(x) if out_buffer else None

    def call():
        if y_buffer is None:
            s = np.add(x, residual)
            return normalize(s, np.empty_like(x)), s
        np.add(x, residual, out=s_buffer)
        return normalize(s_buffer, y_buffer), s_buffer

    return Prepared(call, output_mode(out_buffer, True),
                    result_arrays=_two_outputs(inputs.x.shape))


def prepare_numpy_inplace_add_layer_norm(inputs, num_threads, out_buffer):
    n_rows = as_rows(inputs.x).shape[0]
    normalize = layer_norm.numpy_inplace_layer_norm(n_rows, inputs.x.dtype, inputs.gamma,
                                                    inputs.beta)
    return _prepare_numpy_inplace(inputs, out_buffer, normalize)


def prepare_numpy_inplace_add_rms_norm(inputs, num_threads, out_buffer):
    n_rows = as_rows(inputs.x).shape[0]
    normalize = rms_norm.numpy_inplace_rms_norm(n_rows, inputs.x.dtype, inputs.gamma)
    return _prepare_numpy_inplace(inputs, out_buffer, normalize)


# --- PyTorch -------------------------------------------------------------------------------------

def _prepare_torch(inputs, num_threads, out_buffer, norm):
    """norm(torch, s) -> y; the call is torch.add, then norm."""
    torch = torch_with_threads(num_threads)
    # from_numpy shares memory: no copy, and torch reads exactly the arrays the others read.
    x = torch.from_numpy(as_rows(inputs.x))
    residual = torch.from_numpy(as_rows(inputs.residual))
    add = torch.add

    def call():
        s = add(x, residual)
        return norm(s), s

    return Prepared(call, output_mode(out_buffer, False), threads=num_threads,
                    result_arrays=lambda result: tuple(t.numpy().reshape(inputs.x.shape)
                                                       for t in result),
                    before_sample=torch_thread_setter(torch, num_threads))


def prepare_torch_add_layer_norm(inputs, num_threads, out_buffer):
    import torch

    gamma, beta = torch.from_numpy(inputs.gamma), torch.from_numpy(inputs.beta)
    normalized_shape = (inputs.n_cols,)
    layer_norm_function = torch.nn.functional.layer_norm
    return _prepare_torch(inputs, num_threads, out_buffer,
                          lambda s: layer_norm_function(s, normalized_shape, gamma, beta, EPS))


def prepare_torch_add_rms_norm(inputs, num_threads, out_buffer):
    import torch

    gamma = torch.from_numpy(inputs.gamma)
    normalized_shape = (inputs.n_cols,)
    rms_norm_function = torch.nn.functional.rms_norm
    return _prepare_torch(inputs, num_threads, out_buffer,
                          lambda s: rms_norm_function(s, normalized_shape, gamma, EPS))


# --- ONNX Runtime --------------------------------------------------------------------------------

# The fused contrib ops (domain com.microsoft), float32 (and float16) only.
CONTRIB_OPS = {"layer_norm": "SkipLayerNormalization",
               "rms_norm": "SkipSimplifiedLayerNormalization"}
# The standard ops of the unfused float64 graph, with their opsets.
STANDARD_OPS = {"layer_norm": ("LayerNormalization", 17),
                "rms_norm": ("RMSNormalization", rms_norm.ONNX_RMS_OPSET)}


def _onnx_add_norm_model(norm, dtype):
    """(x, skip, gamma[, beta]) -> (y, s): the fused contrib op for float32, Add + the standard
    normalization for float64."""
    from onnx import helper

    element_type = onnx_element_type(dtype)
    params = ["gamma", "beta"] if norm == "layer_norm" else ["gamma"]
    rows = helper.make_tensor_value_info
    inputs = ([rows(name, element_type, ["rows", "cols"]) for name in ("x", "skip")]
              + [rows(name, element_type, ["cols"]) for name in params])
    outputs = [rows(name, element_type, ["rows", "cols"]) for name in ("y", "s")]
    if np.dtype(dtype) == np.float32:
        # Outputs of SkipLayerNormalization: output, mean, inv_std_var, input_skip_bias_sum.
        nodes = [helper.make_node(CONTRIB_OPS[norm], ["x", "skip"] + params, ["y", "", "", "s"],
                                  domain="com.microsoft", epsilon=EPS)]
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        ir_version = 8
    else:
        op_type, opset = STANDARD_OPS[norm]
        nodes = [helper.make_node("Add", ["x", "skip"], ["s"]),
                 helper.make_node(op_type, ["s"] + params, ["y"], axis=-1, epsilon=EPS)]
        opsets = [helper.make_opsetid("", opset)]
        ir_version = 8 if opset <= 17 else 10
    graph = helper.make_graph(nodes, "add_" + norm, inputs, outputs)
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = min(model.ir_version, ir_version)  # readable by older runtimes too
    return model


def _prepare_onnxruntime(inputs, num_threads, out_buffer, norm):
    x, residual = as_rows(inputs.x), as_rows(inputs.residual)
    if (norm == "rms_norm" and x.dtype == np.float64
            and not rms_norm.onnx_supports_rms_normalization()):
        raise RuntimeError("float64 needs RMSNormalization (opset 23), which the installed "
                           "onnx/onnxruntime do not have")
    session = onnxruntime_session(("add_" + norm, x.dtype),
                                  lambda: _onnx_add_norm_model(norm, x.dtype), num_threads)
    params = {"gamma": inputs.gamma}
    if norm == "layer_norm":
        params["beta"] = inputs.beta
    result_arrays = _two_outputs(inputs.x.shape)
    if not out_buffer:
        feed = dict(x=x, skip=residual, **params)
        return Prepared(lambda: session.run(None, feed), OUTPUT_NEW, threads=num_threads,
                        result_arrays=result_arrays)

    # IO binding: ONNX Runtime reads the NumPy inputs in place and writes into our buffers.
    y, s = np.empty_like(x), np.empty_like(x)
    binding = session.io_binding()
    for name, array in dict(x=x, skip=residual, **params).items():
        binding.bind_cpu_input(name, array)
    for name, array in (("y", y), ("s", s)):
        binding.bind_output(name, "cpu", 0, x.dtype, list(array.shape), array.ctypes.data)
    run_with_binding = session.run_with_iobinding

    def call():
        run_with_binding(binding)
        return y, s

    return Prepared(call, OUTPUT_REUSED, threads=num_threads, result_arrays=result_arrays)


def prepare_onnxruntime_add_layer_norm(inputs, num_threads, out_buffer):
    return _prepare_onnxruntime(inputs, num_threads, out_buffer, "layer_norm")


def prepare_onnxruntime_add_rms_norm(inputs, num_threads, out_buffer):
    return _prepare_onnxruntime(inputs, num_threads, out_buffer, "rms_norm")


# --- the operations ------------------------------------------------------------------------------

# x and residual; y and s for fastln, numpy-inplace and torch/onnxruntime; numpy-naive's
# temporaries (s, and those of the naive norm).
_MEMORY_FACTOR = 12

ADD_LAYER_NORM = Operation(
    name="add_layer_norm",
    title="add_layer_norm (residual add + layer_norm) forward",
    make_inputs=make_add_layer_norm_inputs,
    bytes_moved=bytes_moved,
    memory_factor=_MEMORY_FACTOR,
    implementations=(
        Implementation("fastln", "fastln", prepare_fastln_add_layer_norm,
                       "fastln.add_layer_norm"),
        Implementation("numpy-naive", "numpy", prepare_numpy_naive_add_layer_norm,
                       "x + residual, then mean / var and broadcasting", uses_threads=False),
        Implementation("numpy-inplace", "numpy", prepare_numpy_inplace_add_layer_norm,
                       "np.add into s, then LayerNorm in place", uses_threads=False),
        Implementation("torch", "torch", prepare_torch_add_layer_norm,
                       "torch.add, then torch.nn.functional.layer_norm"),
        Implementation("onnxruntime", "onnxruntime", prepare_onnxruntime_add_layer_norm,
                       "SkipLayerNormalization (com.microsoft) for float32; "
                       "Add + LayerNormalization (opset 17) for float64"),
    ),
)

ADD_RMS_NORM = Operation(
    name="add_rms_norm",
    title="add_rms_norm (residual add + rms_norm) forward",
    make_inputs=make_add_rms_norm_inputs,
    bytes_moved=bytes_moved,
    memory_factor=_MEMORY_FACTOR,
    implementations=(
        Implementation("fastln", "fastln", prepare_fastln_add_rms_norm, "fastln.add_rms_norm"),
        Implementation("numpy-naive", "numpy", prepare_numpy_naive_add_rms_norm,
                       "x + residual, then (s**2).mean and broadcasting", uses_threads=False),
        Implementation("numpy-inplace", "numpy", prepare_numpy_inplace_add_rms_norm,
                       "np.add into s, then RMSNorm in place", uses_threads=False),
        Implementation("torch", "torch", prepare_torch_add_rms_norm,
                       "torch.add, then torch.nn.functional.rms_norm"),
        Implementation("onnxruntime", "onnxruntime", prepare_onnxruntime_add_rms_norm,
                       "SkipSimplifiedLayerNormalization (com.microsoft) for float32; "
                       "Add + RMSNormalization (opset 23) for float64"),
    ),
)

OPERATIONS = (ADD_LAYER_NORM, ADD_RMS_NORM)
