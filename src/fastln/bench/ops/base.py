"""The pieces of the benchmark registry: an operation, its implementations, a prepared call.

An Operation says what is computed (its inputs, the bytes it must move at the least, how close two
results must be); each Implementation turns those inputs into one ready-to-time call. Adding an
operation means writing one module like ``fastln.bench.ops.layer_norm`` (``rms_norm``,
``add_norm`` and ``batch_norm`` are built the same way) and adding it to MODULES in
``fastln.bench.ops``. The helpers at the end (outputs, threads, rows, torch's thread count, ONNX
Runtime sessions) are shared by those modules, so that every operation is measured alike.
"""
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from fastln import _kernels

# Every implementation of every operation gets the same eps.
EPS = 1e-5

# How a call gets its output array, as the table shows it.
OUTPUT_NEW = "new"                        # allocates a fresh output on every call
OUTPUT_REUSED = "reused"                  # writes into one preallocated output (--out-buffer)
OUTPUT_NO_OUT = "new (no out=)"           # --out-buffer asked, but the implementation has no out=

# Results are compared with fastln's on the first rows only: enough to catch a peer computing
# something else (a wrong axis, a missing gamma), cheap even for 256 MiB arrays.
CHECK_ROWS = 64
CHECK_TOLERANCE = {np.dtype(np.float32): 1e-3, np.dtype(np.float64): 1e-8}


@dataclass
class Prepared:
    """One implementation, set up for one case: `call()` is what gets timed.

    ``result_arrays(result)`` turns what ``call()`` returned into NumPy arrays (in the operation's
    order) for the correctness check; ``threads`` is how many threads the call really uses;
    ``before_sample()``, when given, runs untimed before every sample (torch's thread count is
    process-wide and must be set again when calls with other counts ran in between).
    """

    call: Callable[[], object]
    output: str = OUTPUT_NEW
    threads: int = 1
    result_arrays: Callable[[object], Tuple[np.ndarray, ...]] = lambda result: (result,)
    before_sample: Optional[Callable[[], None]] = None


@dataclass(frozen=True)
class Implementation:
    """A way of computing an operation.

    name: shown in the table ("fastln", "numpy-naive", "torch", ...).
    peer: what ``--peers`` selects it by ("fastln" is always measured).
    prepare(inputs, num_threads, out_buffer) -> Prepared: all the setup that must not be timed
        (buffers, sessions, caches of a forward pass).
    uses_threads: False for single-threaded code (NumPy), which is then measured once for all
        thread counts instead of once per count.
    """

    name: str
    peer: str
    prepare: Callable[[object, int, bool], Prepared]
    description: str = ""
    uses_threads: bool = True


@dataclass(frozen=True)
class Operation:
    """Something to benchmark, with every implementation of it.

    name: the ``--ops`` name.
    make_inputs(shape, dtype, rng): the arguments every implementation receives.
    bytes_moved(shape, itemsize): the memory traffic no implementation can avoid, for the
        effective bandwidth.
    memory_factor: peak memory of a case in units of one input-sized array (inputs, outputs,
        NumPy's temporaries), so that cases too big for this machine are skipped, not swapped.
    """

    name: str
    title: str
    make_inputs: Callable[[Tuple[int, ...], np.dtype, np.random.Generator], object]
    bytes_moved: Callable[[Tuple[int, ...], int], int]
    memory_factor: float
    implementations: Tuple[Implementation, ...] = field(default_factory=tuple)

    def implementation(self, name):
        for implementation in self.implementations:
            if implementation.name == name:
                return implementation
        raise KeyError(name)


def check_rows(array):
    """The part of a result the check compares: the first CHECK_ROWS rows, or all of a 1-D one."""
    array = np.asarray(array)
    if array.ndim < 2:
        return np.array(array, copy=True)
    return np.array(array.reshape(-1, array.shape[-1])[:CHECK_ROWS], copy=True)


def compare_results(arrays, reference_arrays, dtype):
    """None when `arrays` match fastln's within the dtype's tolerance, else what differs."""
    if len(arrays) != len(reference_arrays):
        return f"returned {len(arrays)} arrays, expected {len(reference_arrays)}"
    tolerance = CHECK_TOLERANCE[np.dtype(dtype)]
    for index, (array, reference) in enumerate(zip(arrays, reference_arrays)):
        array = check_rows(array)
        if array.shape != reference.shape:
            return f"result {index} has shape {array.shape}, expected {reference.shape}"
        reference64 = reference.astype(np.float64)
        scale = max(float(np.max(np.abs(reference64), initial=0.0)), 1.0)
        error = float(np.max(np.abs(array.astype(np.float64) - reference64), initial=0.0)) / scale
        if not error <= tolerance:  # also catches NaN
            return (f"result {index} differs from fastln's by {error:.2e} "
                    f"(tolerance {tolerance:.0e})")
    return None


# --- helpers shared by the operation modules -----------------------------------------------------

def random_array(rng, shape, dtype):
    """Standard normal values; generating in the target dtype avoids a float64 temporary."""
    return rng.standard_normal(shape, dtype=np.dtype(dtype).type)


def output_mode(out_buffer, has_out):
    """The output column for an implementation that can (has_out) or cannot reuse an output."""
    if not out_buffer:
        return OUTPUT_NEW
    return OUTPUT_REUSED if has_out else OUTPUT_NO_OUT


def fastln_threads(num_threads):
    """The threads a fastln call really uses: a build without OpenMP runs every call on one."""
    return num_threads if _kernels.openmp_enabled() else 1


def as_rows(array):
    """The array as (rows, last axis), a view for C-contiguous inputs."""
    return array.reshape(-1, array.shape[-1])


def row_dots(a, b, out):
    """sum(a * b, axis=-1) of two 2-D arrays into out without an (n_rows, n_cols) temporary."""
    if hasattr(np, "vecdot"):  # NumPy >= 2.0, the faster of the two
        return np.vecdot(a, b, out=out)
    return np.einsum("ij,ij->i", a, b, out=out)


def torch_with_threads(num_threads):
    """torch, imported (only when a torch implementation is prepared) with its thread count set."""
    import torch

    torch.set_num_threads(num_threads)
    return torch


def torch_thread_setter(torch, num_threads):
    """Prepared.before_sample for torch: the count is process-wide and must be set again before
    each sample, as calls with other counts may run in between."""
    return lambda: torch.set_num_threads(num_threads)


def onnx_element_type(dtype):
    """The ONNX TensorProto element type of float32 or float64."""
    from onnx import TensorProto

    return {np.dtype(np.float32): TensorProto.FLOAT,
            np.dtype(np.float64): TensorProto.DOUBLE}[np.dtype(dtype)]


_onnx_sessions: Dict[object, object] = {}

# How long ONNX Runtime's idle intra-op workers spin before they sleep: about as long as libgomp's
# under the bench's GOMP_SPINCOUNT (fastln.bench.command), so that every library keeps its
# workers awake between back-to-back calls and lets the cores go soon after its last one.
ONNXRUNTIME_SPIN_MICROSECONDS = 200
# session.intra_op.spin_duration_us came with microsoft/onnxruntime#27916 (March 2026) and is
# listed among the new keys of 1.27; an older release would ignore it and spin for tens of
# milliseconds after every run, so there the workers do not spin at all.
ONNXRUNTIME_SPIN_DURATION_VERSION = (1, 27)


def onnxruntime_spinning():
    """The session config entries for how ONNX Runtime's idle workers wait, as {key: value}.

    With OMP_WAIT_POLICY=passive (the user's choice: idle OpenMP workers sleep at once) ONNX
    Runtime's sleep at once too; otherwise they spin for ONNXRUNTIME_SPIN_MICROSECONDS.
    """
    import onnxruntime

    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"
    version = tuple(int(part) if part.isdigit() else 0
                    for part in onnxruntime.__version__.split(".")[:2])
    if passive or version < ONNXRUNTIME_SPIN_DURATION_VERSION:
        return {"session.intra_op.allow_spinning": "0"}
    return {"session.intra_op.allow_spinning": "1",
            "session.intra_op.spin_duration_us": str(ONNXRUNTIME_SPIN_MICROSECONDS)}


def onnxruntime_session(key, build_model, num_threads):
    """A CPU InferenceSession for the model build_model() returns, cached by (key, num_threads).

    Every ONNX Runtime implementation runs with these options, so that they are measured alike:
    intra_op_num_threads as for the other libraries, one inter-op thread, sequential execution,
    and idle workers that spin only briefly (onnxruntime_spinning).
    """
    cache_key = (key, num_threads)
    if cache_key in _onnx_sessions:
        return _onnx_sessions[cache_key]
    import onnx
    import onnxruntime

    model = build_model()
    onnx.checker.check_model(model)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = num_threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    # By default ONNX Runtime's idle workers spin for tens of milliseconds after every run:
    # measured interleaved, they would take the cores away from whichever implementation runs
    # next.
    for key, value in onnxruntime_spinning().items():
        options.add_session_config_entry(key, value)
    session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    _onnx_sessions[cache_key] = session
    return session
