"""ONNX Runtime on the CPU: a one-node (or two-node) model built in memory for each forward. ONNX
has no gradient ops that ONNX Runtime runs outside its training builds: no backwards here.

    forward          LayerNormalization (opset 17)
    rms_forward      RMSNormalization (opset 23), when the installed onnx and onnxruntime know it
    add_layer_norm,  float32 and float16: the com.microsoft contrib ops SkipLayerNormalization /
    add_rms_norm     SkipSimplifiedLayerNormalization, ONNX Runtime's own fused kernels (they
                     also return the sum); float64, which they lack: Add + LayerNormalization
                     (opset 17) / Add + RMSNormalization (opset 23), the sum a second output
    batch_norm_train BatchNormalization (opset 15, training_mode=1), which returns the updated
                     running statistics as outputs (copied back into its running arrays after
                     each call, a few hundred values); its momentum is an ONNX float32
                     attribute, float32(0.9), which the check allows for
    batch_norm_eval  BatchNormalization (opset 15, training_mode=0), from the running statistics

Every session runs alike: intra_op_num_threads as for the other libraries, one inter-op thread,
sequential execution, idle workers that do not spin (SESSION_CONFIG). float32, float64 and float16
(bfloat16 arrays have no NumPy type ONNX Runtime's Python binding accepts). With --out-buffer
the inputs and outputs are bound in place (IO binding): ONNX Runtime reads the NumPy inputs and
writes into preallocated arrays.
"""
import numpy as np

from fastln.bench.operation import (
    EPS,
    FULL_DTYPES,
    MOMENTUM,
    OUTPUT_NEW,
    OUTPUT_REUSED,
    Implementation,
    Prepared,
    RunningStatistics,
)

# The first opset with RMSNormalization.
ONNX_RMS_OPSET = 23
DTYPES = FULL_DTYPES + ("float16",)

# ONNX Runtime's idle intra-op workers spin for tens of milliseconds after every run by default,
# on cores the next implementation needs: they are told not to spin at all (each run wakes them).
SESSION_CONFIG = {"session.intra_op.allow_spinning": "0"}


def _version(module):
    return tuple(int(part) if part.isdigit() else 0 for part in module.__version__.split(".")[:2])


def onnxruntime_spinning():
    """The session config entries for how ONNX Runtime's idle workers wait, as {key: value}."""
    return dict(SESSION_CONFIG)


def supports_rms_normalization():
    """True when the installed onnx and onnxruntime both know RMSNormalization (opset 23)."""
    import onnxruntime
    from onnx import defs

    try:
        defs.get_schema("RMSNormalization", ONNX_RMS_OPSET, "")
    except Exception:  # onnx < 1.18
        return False
    return _version(onnxruntime) >= (1, 22)  # the first release to implement opset 23


def element_type(dtype):
    """The ONNX TensorProto element type of a NumPy dtype."""
    from onnx import TensorProto

    return {"float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE,
            "float16": TensorProto.FLOAT16}[np.dtype(dtype).name]


def _model(nodes, inputs, outputs, opsets):
    """A model of `nodes` with inputs/outputs given as [(name, dtype, dims)] and opsets as
    [(domain, version)]; the oldest IR version its opsets allow, readable by older runtimes."""
    from onnx import helper

    def values(specs):
        return [helper.make_tensor_value_info(name, element_type(dtype), dims)
                for name, dtype, dims in specs]

    graph = helper.make_graph(nodes, "fastln_bench", values(inputs), values(outputs))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(domain, version)
                                                    for domain, version in opsets])
    newest_opset = max(version for domain, version in opsets if domain == "")
    model.ir_version = min(model.ir_version, 8 if newest_opset <= 17 else 10)
    return model


_sessions = {}


def session(key, build_model, num_threads):
    """A CPU InferenceSession for the model build_model() returns, cached by (key, num_threads)."""
    cache_key = (key, num_threads)
    if cache_key not in _sessions:
        import onnx
        import onnxruntime

        model = build_model()
        onnx.checker.check_model(model)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        for name, value in onnxruntime_spinning().items():
            options.add_session_config_entry(name, value)
        _sessions[cache_key] = onnxruntime.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return _sessions[cache_key]


def _run(the_session, feeds, outputs, num_threads, out_buffer, after_run=None,
         result_arrays=None):
    """Prepared for running the session on `feeds` ({name: array}); `outputs` are the output
    names with an array of each one's shape and dtype (bound in place with --out-buffer);
    after_run(results) runs inside the timed call (batch norm's running statistics)."""
    if not out_buffer:
        run = the_session.run

        def call():
            results = run(None, feeds)
            if after_run is not None:
                after_run(results)
            return results[0] if len(results) == 1 else tuple(results)

        return Prepared(call, OUTPUT_NEW, threads=num_threads, result_arrays=result_arrays)

    binding = the_session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    buffers = [np.empty_like(like) for like in outputs.values()]
    for name, buffer in zip(outputs, buffers):
        binding.bind_output(name, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
    run_with_binding = the_session.run_with_iobinding

    def call():
        run_with_binding(binding)
        if after_run is not None:
            after_run(buffers)
        return buffers[0] if len(buffers) == 1 else tuple(buffers)

    return Prepared(call, OUTPUT_REUSED, threads=num_threads, result_arrays=result_arrays)


def _row_model(op_type, opset, dtype, with_bias):
    """LayerNormalization / RMSNormalization over the last axis of (rows, cols)."""
    from onnx import helper

    params = ["scale", "bias"] if with_bias else ["scale"]
    return _model([helper.make_node(op_type, ["x"] + params, ["y"], axis=-1, epsilon=EPS)],
                  [("x", dtype, ["rows", "cols"])] + [(name, dtype, ["cols"]) for name in params],
                  [("y", dtype, ["rows", "cols"])], [("", opset)])


def _forward(inputs, num_threads, out_buffer):
    x = inputs.rows("x")
    the_session = session(("layer_norm", x.dtype),
                          lambda: _row_model("LayerNormalization", 17, x.dtype, True),
                          num_threads)
    return _run(the_session, {"x": x, "scale": inputs.gamma, "bias": inputs.beta}, {"y": x},
                num_threads, out_buffer)


def _rms_forward(inputs, num_threads, out_buffer):
    if not supports_rms_normalization():
        raise RuntimeError("the installed onnx/onnxruntime have no RMSNormalization "
                           f"(opset {ONNX_RMS_OPSET}; onnxruntime >= 1.22)")
    x = inputs.rows("x")
    the_session = session(("rms_norm", x.dtype),
                          lambda: _row_model("RMSNormalization", ONNX_RMS_OPSET, x.dtype, False),
                          num_threads)
    return _run(the_session, {"x": x, "scale": inputs.gamma}, {"y": x}, num_threads,
                out_buffer)


# The fused contrib ops (domain com.microsoft), without float64 kernels; the standard ops of the
# unfused float64 graph, with their opsets.
CONTRIB_OPS = {"layer_norm": "SkipLayerNormalization",
               "rms_norm": "SkipSimplifiedLayerNormalization"}
STANDARD_OPS = {"layer_norm": ("LayerNormalization", 17),
                "rms_norm": ("RMSNormalization", ONNX_RMS_OPSET)}


def _add_norm_model(kind, dtype):
    """(x, skip, gamma[, beta]) -> (y, s): the fused contrib op, or for float64 Add + the
    standard normalization."""
    from onnx import helper

    params = ["gamma", "beta"] if kind == "layer_norm" else ["gamma"]
    inputs = ([(name, dtype, ["rows", "cols"]) for name in ("x", "skip")]
              + [(name, dtype, ["cols"]) for name in params])
    outputs = [(name, dtype, ["rows", "cols"]) for name in ("y", "s")]
    if np.dtype(dtype) != np.float64:
        # Outputs of SkipLayerNormalization: output, mean, inv_std_var, input_skip_bias_sum.
        nodes = [helper.make_node(CONTRIB_OPS[kind], ["x", "skip"] + params, ["y", "", "", "s"],
                                  domain="com.microsoft", epsilon=EPS)]
        return _model(nodes, inputs, outputs, [("", 17), ("com.microsoft", 1)])
    op_type, opset = STANDARD_OPS[kind]
    nodes = [helper.make_node("Add", ["x", "skip"], ["s"]),
             helper.make_node(op_type, ["s"] + params, ["y"], axis=-1, epsilon=EPS)]
    return _model(nodes, inputs, outputs, [("", opset)])


def _add_norm(kind):
    def prepare(inputs, num_threads, out_buffer):
        x = inputs.rows("x")
        if kind == "rms_norm" and x.dtype == np.float64 and not supports_rms_normalization():
            raise RuntimeError("float64 needs RMSNormalization (opset 23), which the installed "
                               "onnx/onnxruntime do not have")
        the_session = session(("add_" + kind, x.dtype), lambda: _add_norm_model(kind, x.dtype),
                              num_threads)
        feeds = {"x": x, "skip": inputs.rows("residual"), "gamma": inputs.gamma}
        if kind == "layer_norm":
            feeds["beta"] = inputs.beta
        return _run(the_session, feeds, {"y": x, "s": x}, num_threads, out_buffer)
    return prepare


def _batch_norm_model(dtype, ndim, training=True):
    """BatchNormalization (opset 15) over (N, C, ...): in training mode y and the updated running
    statistics; in evaluation mode y from the running statistics."""
    from onnx import helper

    dims, vector = ["n", "c"] + [f"d{axis}" for axis in range(2, ndim)], ["c"]
    statistics = ("scale", "bias", "input_mean", "input_var")
    outputs = [("y", dtype, dims)]
    if training:
        outputs += [("running_mean", dtype, vector), ("running_var", dtype, vector)]
    node = helper.make_node("BatchNormalization", ["x", *statistics],
                            [name for name, _, _ in outputs],
                            epsilon=EPS, momentum=MOMENTUM, training_mode=int(training))
    return _model([node], [("x", dtype, dims)] + [(name, dtype, vector) for name in statistics],
                  outputs, [("", 15)])


def _batch_norm_eval(inputs, num_threads, out_buffer):
    x = inputs.x
    the_session = session(("batch_norm_eval", x.dtype, x.ndim),
                          lambda: _batch_norm_model(x.dtype, x.ndim, training=False), num_threads)
    # float16: ONNX Runtime's kernel takes the statistics in float16 too (fastln's are float32).
    feeds = {"x": x, "scale": inputs.gamma, "bias": inputs.beta,
             "input_mean": inputs.running_mean.astype(x.dtype, copy=False),
             "input_var": inputs.running_var.astype(x.dtype, copy=False)}
    return _run(the_session, feeds, {"y": x}, num_threads, out_buffer)


def _batch_norm_train(inputs, num_threads, out_buffer):
    x = inputs.x
    the_session = session(("batch_norm_train", x.dtype, x.ndim),
                          lambda: _batch_norm_model(x.dtype, x.ndim), num_threads)
    # ONNX attributes are float32: ONNX Runtime's momentum is float32(0.9) = 0.89999998, which
    # its float64 updates show; the check uses the momentum it really applies.
    running = RunningStatistics(inputs, momentum=float(np.float32(MOMENTUM)))

    def update_running(results):
        running.updates += 1
        np.copyto(running.mean, results[1])
        np.copyto(running.var, results[2])

    # The feed refers to running.mean / running.var: each run reads their current values.
    feeds = {"x": x, "scale": inputs.gamma, "bias": inputs.beta, "input_mean": running.mean,
             "input_var": running.var}
    return _run(the_session, feeds,
                {"y": x, "running_mean": running.mean, "running_var": running.var},
                num_threads, out_buffer, after_run=update_running,
                result_arrays=lambda result: running.result_arrays(result[0]))


def _channel_norm_model(op_type, opset, dtype, ndim, **attributes):
    """GroupNormalization / InstanceNormalization over (N, C, ...): (x, scale, bias) -> y."""
    from onnx import helper

    dims = ["n", "c"] + [f"d{axis}" for axis in range(2, ndim)]
    node = helper.make_node(op_type, ["x", "scale", "bias"], ["y"], epsilon=EPS, **attributes)
    return _model([node], [("x", dtype, dims), ("scale", dtype, ["c"]), ("bias", dtype, ["c"])],
                  [("y", dtype, dims)], [("", opset)])


def _group_norm(inputs, num_threads, out_buffer):
    from fastln.bench.ops import group_count

    x = inputs.x
    groups = group_count(x.shape)
    the_session = session(("group_norm", x.dtype, x.ndim, groups), lambda: _channel_norm_model(
        "GroupNormalization", 21, x.dtype, x.ndim, num_groups=groups), num_threads)
    return _run(the_session, {"x": x, "scale": inputs.gamma, "bias": inputs.beta}, {"y": x},
                num_threads, out_buffer)


def _instance_norm(inputs, num_threads, out_buffer):
    x = inputs.x
    the_session = session(("instance_norm", x.dtype, x.ndim), lambda: _channel_norm_model(
        "InstanceNormalization", 6, x.dtype, x.ndim), num_threads)
    return _run(the_session, {"x": x, "scale": inputs.gamma, "bias": inputs.beta}, {"y": x},
                num_threads, out_buffer)


def _onnxruntime(prepare, description, dtypes=DTYPES):
    return (Implementation("onnxruntime", "onnxruntime", prepare, description, dtypes=dtypes),)


IMPLEMENTATIONS = {
    "forward": _onnxruntime(_forward, "LayerNormalization, opset 17"),
    "rms_forward": _onnxruntime(_rms_forward, f"RMSNormalization, opset {ONNX_RMS_OPSET}"),
    "add_layer_norm": _onnxruntime(
        _add_norm("layer_norm"), "SkipLayerNormalization (com.microsoft) for float32/float16; "
                                 "Add + LayerNormalization (opset 17) for float64"),
    "add_rms_norm": _onnxruntime(
        _add_norm("rms_norm"), "SkipSimplifiedLayerNormalization (com.microsoft) for "
                               f"float32/float16; Add + RMSNormalization (opset {ONNX_RMS_OPSET}) "
                               "for float64"),
    "batch_norm_eval": _onnxruntime(_batch_norm_eval,
                                    "BatchNormalization (opset 15, training_mode=0)"),
    "batch_norm_train": _onnxruntime(_batch_norm_train,
                                     "BatchNormalization, opset 15, training_mode=1",
                                     FULL_DTYPES),
    "group_norm": _onnxruntime(_group_norm, "GroupNormalization, opset 21 (as ONNX Runtime's "
                                            "CPU provider runs it: its function expansion)"),
    "instance_norm": _onnxruntime(_instance_norm, "InstanceNormalization, opset 6"),
}
