"""What the benchmark's table is made of: inputs, a prepared call, an implementation, an operation.

An Operation (one row of the table in fastln.bench.ops) says what is computed: how to make its
inputs, the bytes it must move at the least, how close two results must be, and fastln's call.
Each Implementation (fastln's, or one of a peer module's in fastln.bench.peers) turns those
inputs into one ready-to-time call, a Prepared. Everything every implementation shares lives
here: the eps and momentum, the inputs, the result check, batch norm's running statistics.
"""
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import numpy as np

# Every implementation of every operation gets the same eps; batch norm the same momentum
# (fastln's: the weight of the old running value) over features on axis 1, as in PyTorch.
EPS = 1e-5
MOMENTUM = 0.9
FEATURE_AXIS = 1

# How a call gets its output array, as the table shows it.
OUTPUT_NEW = "new"                        # allocates a fresh output on every call
OUTPUT_REUSED = "reused"                  # writes into one preallocated output (--out-buffer)
OUTPUT_NO_OUT = "new (no out=)"           # --out-buffer asked, but the implementation has no out=

# Results are compared with fastln's on the first rows only: enough to catch a peer computing
# something else (a wrong axis, a missing gamma), cheap even for 256 MiB arrays.
CHECK_ROWS = 64
# Largest difference from fastln's result, relative to the result's largest magnitude (at least
# 1), by dtype: a few units in the last place of each format, with room for the peers' own
# roundings (float16/bfloat16 peers round intermediate results to the half format).
CHECK_TOLERANCE = {"float16": 1e-2, "bfloat16": 8e-2, "float32": 1e-3, "float64": 1e-8}

HALF_DTYPES = ("float16", "bfloat16")
FULL_DTYPES = ("float32", "float64")


def numpy_dtype(name):
    """The NumPy dtype of a --dtypes name (bfloat16 comes from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dtype_name(dtype):
    """The --dtypes name of a NumPy dtype (or of a name)."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def compute_dtype(dtype):
    """The dtype arithmetic is done in: float32 for the half formats, else the dtype itself."""
    return np.dtype(np.float32) if dtype_name(dtype) in HALF_DTYPES else numpy_dtype(dtype)


@dataclass
class Inputs:
    """The arrays of one case. x, gamma always; the rest where the operation takes them: beta
    (LayerNorm, batch norm), dy (backwards), residual (the fused add + norm), running_mean and
    running_var (batch norm, their values before the first call)."""

    x: np.ndarray
    gamma: np.ndarray
    beta: Optional[np.ndarray] = None
    dy: Optional[np.ndarray] = None
    residual: Optional[np.ndarray] = None
    running_mean: Optional[np.ndarray] = None
    running_var: Optional[np.ndarray] = None

    @property
    def dtype(self):
        return dtype_name(self.x.dtype)

    @property
    def n_cols(self):
        return self.x.shape[-1]

    @property
    def n_features(self):
        return self.x.shape[FEATURE_AXIS]

    @property
    def values_per_feature(self):
        return self.x.size // self.n_features

    def rows(self, name):
        """The array `name` as (rows, last axis), a view for C-contiguous inputs."""
        array = getattr(self, name)
        return array.reshape(-1, array.shape[-1])


def random_array(rng, shape, dtype):
    """Standard normal values in `dtype`; generating in float32/float64 directly avoids a float64
    temporary, the half formats are rounded from float32."""
    generated = rng.standard_normal(shape, dtype=compute_dtype(dtype).type)
    return generated if compute_dtype(dtype) == numpy_dtype(dtype) else generated.astype(
        numpy_dtype(dtype))


def make_inputs(shape, dtype, rng, *, beta=False, dy=False, residual=False, running=False,
                per_channel=False):
    """Inputs for one case, with the optional arrays the operation takes.

    Offsets and spreads other than 0 and 1, gamma and beta that are not ones and zeros, running
    statistics not at their defaults: no implementation can skip work. The parameters are one
    value per column (per feature on axis 1 for batch norm and per_channel, group norm's NCHW).
    """
    n_params = shape[FEATURE_AXIS] if running or per_channel else shape[-1]
    x = random_array(rng, shape, compute_dtype(dtype))
    if not residual:
        x *= 2.0
    x += 0.5
    x = x.astype(numpy_dtype(dtype), copy=False)
    inputs = Inputs(x, (1.0 + 0.1 * rng.standard_normal(n_params)).astype(numpy_dtype(dtype)))
    if beta:
        inputs.beta = (0.1 * rng.standard_normal(n_params)).astype(numpy_dtype(dtype))
    if residual:
        inputs.residual = (2.0 * random_array(rng, shape, compute_dtype(dtype))).astype(
            numpy_dtype(dtype), copy=False)
    if running:
        # float32 for the half formats: batch norm's statistics are kept in float32 then (as in
        # PyTorch's mixed-precision batch norm).
        inputs.running_mean = (0.1 * rng.standard_normal(n_params)).astype(compute_dtype(dtype))
        inputs.running_var = (1.0 + 0.1 * np.abs(rng.standard_normal(n_params))).astype(
            compute_dtype(dtype))
    if dy:
        inputs.dy = random_array(rng, shape, dtype)
    return inputs


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
    result_arrays: Callable[[object], Tuple[np.ndarray, ...]] = None
    before_sample: Optional[Callable[[], None]] = None

    def __post_init__(self):
        if self.result_arrays is None:
            self.result_arrays = as_arrays


@dataclass(frozen=True)
class Implementation:
    """A way of computing an operation.

    name: shown in the table ("fastln", "numpy-naive", "torch", ...).
    peer: what ``--peers`` selects it by ("fastln" is always measured).
    prepare(inputs, num_threads, out_buffer) -> Prepared: all the setup that must not be timed
        (buffers, sessions, the forward pass a backward needs).
    uses_threads: False for single-threaded code (NumPy), which is then measured once for all
        thread counts instead of once per count.
    dtypes: the --dtypes it can compute (None: every dtype of its operation).
    """

    name: str
    peer: str
    prepare: Callable[[Inputs, int, bool], Prepared]
    description: str = ""
    uses_threads: bool = True
    dtypes: Optional[Tuple[str, ...]] = None

    def supports(self, dtype):
        return self.dtypes is None or dtype_name(dtype) in self.dtypes


@dataclass(frozen=True)
class Operation:
    """One row of the table: something to benchmark, with every implementation of it.

    name: the ``--ops`` name.
    make_inputs(shape, dtype, rng): the Inputs every implementation receives.
    streams: how many arrays of x's size it must read or write at the least; bytes_moved is that
        times x's bytes, for the effective bandwidth.
    memory_factor: peak memory of a case in units of one input-sized array (inputs, outputs,
        NumPy's temporaries), so that cases too big for this machine are skipped, not swapped.
    tolerance: {dtype: relative tolerance} of the check against fastln's result (CHECK_TOLERANCE
        where not given).
    batch_sums: the indices of the results that are sums over the batch (a backward's dgamma and
        dbeta). A peer whose other results pass the check is timed even when these do not, and
        the difference is reported with its time: PyTorch sums them in the half formats
        themselves, which puts them percents off over a few thousand rows, and a comparison of
        speed should still show it.
    fastln: fastln's prepare(inputs, num_threads, out_buffer) -> Prepared; fastln_call names it.
    """

    name: str
    title: str
    make_inputs: Callable[[Tuple[int, ...], str, np.random.Generator], Inputs]
    streams: int
    memory_factor: float
    fastln: Callable[[Inputs, int, bool], Prepared] = None
    fastln_call: str = ""
    tolerance: dict = field(default_factory=dict)
    batch_sums: Tuple[int, ...] = ()
    implementations: Tuple[Implementation, ...] = field(default_factory=tuple)

    def bytes_moved(self, shape, itemsize):
        return self.streams * int(np.prod(shape)) * itemsize

    def tolerance_for(self, dtype):
        return self.tolerance.get(dtype_name(dtype), CHECK_TOLERANCE[dtype_name(dtype)])

    def implementation(self, name):
        for implementation in self.implementations:
            if implementation.name == name:
                return implementation
        raise KeyError(name)


# --- results ------------------------------------------------------------------------------------

def to_numpy(value):
    """A result as a NumPy array: arrays as they are, torch tensors through .numpy() (bfloat16
    tensors as float32, which NumPy has no type for)."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch"):
        tensor = value.detach()
        if str(tensor.dtype) == "torch.bfloat16":
            tensor = tensor.float()
        return tensor.numpy()
    return np.asarray(value)


def as_arrays(result):
    """What a call returned (one array or tensor, or a tuple of them) as a tuple of arrays."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    return tuple(to_numpy(item) for item in items)


def check_rows(array):
    """The part of a result the check compares: the first CHECK_ROWS rows, or all of a 1-D one."""
    array = np.asarray(array)
    if array.ndim < 2:
        return np.array(array, copy=True)
    return np.array(array.reshape(-1, array.shape[-1])[:CHECK_ROWS], copy=True)


def compare_results(arrays, reference_arrays, dtype, tolerance=None, indices=None):
    """None when `arrays` (those at `indices`, by default all) match fastln's within the
    tolerance (by default the dtype's), else what differs."""
    if len(arrays) != len(reference_arrays):
        return f"returned {len(arrays)} arrays, expected {len(reference_arrays)}"
    if tolerance is None:
        tolerance = CHECK_TOLERANCE[dtype_name(dtype)]
    for index, (array, reference) in enumerate(zip(arrays, reference_arrays)):
        if indices is not None and index not in indices:
            continue
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


def output_mode(out_buffer, has_out):
    """The output column for an implementation that can (has_out) or cannot reuse an output."""
    if not out_buffer:
        return OUTPUT_NEW
    return OUTPUT_REUSED if has_out else OUTPUT_NO_OUT


# --- batch norm ---------------------------------------------------------------------------------

def batch_axes(ndim):
    """Every axis but the feature axis: what a feature's statistics are taken over."""
    return (0,) + tuple(range(2, ndim))


def per_feature(vector, ndim):
    """A (C,) vector shaped to broadcast along axis 1 of an ndim-dimensional x."""
    return vector.reshape((-1,) + (1,) * (ndim - 2))


class RunningStatistics:
    """One implementation's own running_mean and running_var, updated in place by its calls,
    and the count of those updates, so that the check can recover the batch statistics whatever
    the number of calls.

    Each call updates them once more, so after k calls they hold
    ``MOMENTUM**k * initial + (1 - MOMENTUM**k) * batch_stat``; the check compares the batch
    statistics they imply, which are the same whatever the number of calls (PyTorch's running
    variance is the unbiased one: converted back with unbiased_variance=True).
    """

    def __init__(self, inputs, unbiased_variance=False, momentum=MOMENTUM):
        self.initial_mean = inputs.running_mean
        self.initial_var = inputs.running_var
        self.mean = inputs.running_mean.copy()
        self.var = inputs.running_var.copy()
        self.updates = 0
        self.momentum = momentum
        m = inputs.values_per_feature
        # PyTorch's running variance takes var * m / (m - 1).
        self.variance_factor = (m - 1) / m if unbiased_variance and m > 1 else 1.0

    def implied_batch_statistics(self):
        """(batch mean, biased batch variance) that the updates so far imply, in float64."""
        if self.updates == 0:
            raise RuntimeError("the running statistics were never updated")
        decay = self.momentum ** self.updates
        mean = (self.mean.astype(np.float64) - decay * self.initial_mean) / (1.0 - decay)
        var = (self.var.astype(np.float64) - decay * self.initial_var) / (1.0 - decay)
        return mean, var * self.variance_factor

    def result_arrays(self, y):
        """For Prepared.result_arrays: y, then the implied batch statistics."""
        return (to_numpy(y),) + self.implied_batch_statistics()
