"""BatchNorm in training mode, forward (running statistics updated) and backward, and every
implementation the benchmark compares.

Shapes: the feature axis is axis 1, as in PyTorch's BatchNorm1d/2d and ONNX's
BatchNormalization: (N, C) activations or (N, C, H, W, ...) images, one mean and one (biased)
variance per feature over every other axis (m = size / C values each). ``--shapes 4096x768`` is
4096 samples of 768 features; ``--shapes 32x64x28x28`` is NCHW with 64 channels. fastln gets
``axis=1``.

Operations (--ops names) and the bytes they must move, for the effective bandwidth (n elements
of x, each of `itemsize` bytes; per-feature vectors are negligible). A feature's statistics
need all of its values before its first output can be written, so once x is larger than the
cache it must be read twice:
    batch_norm_train     read x twice (statistics, then normalize), write y     3 * n * itemsize
    batch_norm_backward  read dy and x twice (the two sums per feature, then dx), write dx
                                                                                5 * n * itemsize
For arrays that fit in the cache the second reads come from it, and the bandwidth column
overstates the memory traffic.

Training-mode forward: y = gamma * (x - mean) / sqrt(var + eps) + beta with the batch
statistics, and every implementation updates its own running statistics by
``running = MOMENTUM * running + (1 - MOMENTUM) * batch_stat`` (fastln's momentum, the weight
of the old value; PyTorch gets ``momentum = 1 - MOMENTUM``). The backward goes through the batch
statistics (dx, dgamma, dbeta), from a forward done once before timing.

The running statistics are checked too: each call updates them once more, so after k calls
they hold ``MOMENTUM**k * initial + (1 - MOMENTUM**k) * batch_stat``; the check compares the
batch statistics they imply (RunningStatistics.implied_batch_statistics), which are the same
whatever the number of calls (PyTorch's running variance is the unbiased one: converted back).

Implementations, by --peers name:
    fastln        fastln.batch_norm(training=True) / fastln.batch_norm_backward
    numpy         numpy-naive: x.mean, x.var over the batch axes and broadcasting;
                  numpy-inplace: the same maths written well, in place into preallocated
                  buffers, no full-size temporaries
    torch         torch.nn.functional.batch_norm(training=True); backward without autograd
                  through torch.ops.aten.native_batch_norm_backward
    onnxruntime   forward only: BatchNormalization (opset 15) with training_mode=1, which
                  returns the updated running statistics as new outputs (copied back into its
                  running arrays after each call, a few hundred values); its momentum is an
                  ONNX float32 attribute, float32(0.9), which the check allows for. ONNX has no
                  BatchNormalization gradient op that ONNX Runtime runs outside its training
                  builds, so there is no onnxruntime backward.
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
    fastln_threads,
    onnx_element_type,
    onnxruntime_session,
    output_mode,
    random_array,
    torch_thread_setter,
    torch_with_threads,
)

# fastln's momentum: the weight of the old running value.
MOMENTUM = 0.9
FEATURE_AXIS = 1


@dataclass
class BatchNormInputs:
    """x (features on axis 1), gamma, beta and the initial running statistics; dy as well for
    the backward."""

    x: np.ndarray
    gamma: np.ndarray
    beta: np.ndarray
    running_mean: np.ndarray
    running_var: np.ndarray
    dy: Optional[np.ndarray] = None

    @property
    def n_features(self):
        return self.x.shape[FEATURE_AXIS]

    @property
    def values_per_feature(self):
        return self.x.size // self.n_features


def make_forward_inputs(shape, dtype, rng):
    if len(shape) < 2:
        raise ValueError(f"batch norm needs (N, C, ...) shapes, got {shape}")
    n_features = shape[FEATURE_AXIS]
    # An offset and a spread other than 0 and 1, gamma/beta not ones/zeros and running
    # statistics not at their defaults, so that no implementation can skip work.
    x = random_array(rng, shape, dtype)
    x *= 2.0
    x += 0.5
    gamma = (1.0 + 0.1 * rng.standard_normal(n_features)).astype(dtype)
    beta = (0.1 * rng.standard_normal(n_features)).astype(dtype)
    running_mean = (0.1 * rng.standard_normal(n_features)).astype(dtype)
    running_var = (1.0 + 0.1 * np.abs(rng.standard_normal(n_features))).astype(dtype)
    return BatchNormInputs(x, gamma, beta, running_mean, running_var)


def make_backward_inputs(shape, dtype, rng):
    inputs = make_forward_inputs(shape, dtype, rng)
    inputs.dy = random_array(rng, shape, dtype)
    return inputs


def train_bytes_moved(shape, itemsize):
    """Read x twice (statistics, then normalize), write y."""
    return 3 * int(np.prod(shape)) * itemsize


def backward_bytes_moved(shape, itemsize):
    """Read dy and x twice (the per-feature sums, then dx), write dx."""
    return 5 * int(np.prod(shape)) * itemsize


def batch_axes(ndim):
    """Every axis but the feature axis: what a feature's statistics are taken over."""
    return (0,) + tuple(range(2, ndim))


def per_feature(vector, ndim):
    """A (C,) vector shaped to broadcast along axis 1 of an ndim-dimensional x."""
    return vector.reshape((-1,) + (1,) * (ndim - 2))


def _feature_dot_subscripts(ndim):
    """einsum subscripts of sum(a * b) over the batch axes, per feature: 'ab,ab->b', ..."""
    letters = "abcdefghijklmnop"[:ndim]
    return f"{letters},{letters}->{letters[FEATURE_AXIS]}"


class RunningStatistics:
    """One implementation's own running_mean and running_var, updated in place by its calls,
    and the count of those updates, so that the check can recover the batch statistics whatever
    the number of calls (see the module docstring)."""

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
        return (np.asarray(y),) + self.implied_batch_statistics()


# --- fastln --------------------------------------------------------------------------------------

def prepare_fastln_train(inputs, num_threads, out_buffer):
    x, gamma, beta = inputs.x, inputs.gamma, inputs.beta
    running = RunningStatistics(inputs)
    running_mean, running_var = running.mean, running.var
    out = np.empty_like(x) if out_buffer else None

    def call():
        running.updates += 1
        return fastln.batch_norm(x, gamma, beta, running_mean, running_var, training=True,
                                 momentum=MOMENTUM, eps=EPS, axis=FEATURE_AXIS, out=out,
                                 num_threads=num_threads)

    return Prepared(call, output_mode(out_buffer, True), threads=fastln_threads(num_threads),
                    result_arrays=running.result_arrays)


def prepare_fastln_backward(inputs, num_threads, out_buffer):
    _, cache = fastln.batch_norm_forward(inputs.x, inputs.gamma, inputs.beta, training=True,
                                         momentum=MOMENTUM, eps=EPS, axis=FEATURE_AXIS,
                                         num_threads=num_threads)
    dy, gamma = inputs.dy, inputs.gamma
    out = np.empty_like(dy) if out_buffer else None

    def call():
        return fastln.batch_norm_backward(dy, cache, gamma, out=out, num_threads=num_threads)

    return Prepared(call, output_mode(out_buffer, True), threads=fastln_threads(num_threads),
                    result_arrays=tuple)


# --- NumPy ---------------------------------------------------------------------------------------

def numpy_naive_train(x, gamma, beta, running_mean, running_var, momentum, eps):
    axes = batch_axes(x.ndim)
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * per_feature(gamma, x.ndim) + per_feature(beta, x.ndim)
    running_mean[:] = momentum * running_mean + (1 - momentum) * mean.ravel()
    running_var[:] = momentum * running_var + (1 - momentum) * var.ravel()
    return y


def numpy_naive_backward(dy, x, mean, rstd, gamma):
    axes = batch_axes(x.ndim)
    x_hat = (x - mean) * rstd
    dgamma = (dy * x_hat).sum(axis=axes)
    dbeta = dy.sum(axis=axes)
    dx_hat = dy * per_feature(gamma, x.ndim)
    dx = rstd * (dx_hat - dx_hat.mean(axis=axes, keepdims=True)
                 - x_hat * (dx_hat * x_hat).mean(axis=axes, keepdims=True))
    return dx, dgamma, dbeta


def _numpy_statistics(x):
    """Per-feature mean and rstd, broadcastable along axis 1, in x's dtype (a forward's cache)."""
    axes = batch_axes(x.ndim)
    mean = x.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(axis=axes, keepdims=True) + EPS)
    return mean.astype(x.dtype), rstd.astype(x.dtype)


def prepare_numpy_naive_train(inputs, num_threads, out_buffer):
    x, gamma, beta = inputs.x, inputs.gamma, inputs.beta
    running = RunningStatistics(inputs)

    def call():
        running.updates += 1
        return numpy_naive_train(x, gamma, beta, running.mean, running.var, MOMENTUM, EPS)

    return Prepared(call, output_mode(out_buffer, False), result_arrays=running.result_arrays)


def prepare_numpy_naive_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = inputs.x, inputs.dy, inputs.gamma
    mean, rstd = _numpy_statistics(x)
    return Prepared(lambda: numpy_naive_backward(dy, x, mean, rstd, gamma),
                    output_mode(out_buffer, False), result_arrays=tuple)


def prepare_numpy_inplace_train(inputs, num_threads, out_buffer):
    x, gamma, beta = inputs.x, inputs.gamma, inputs.beta
    ndim, m = x.ndim, inputs.values_per_feature
    axes, feature_dot = batch_axes(ndim), _feature_dot_subscripts(ndim)
    running = RunningStatistics(inputs)
    running_mean, running_var = running.mean, running.var
    # Per-feature buffers, kept across calls like a training loop would.
    mean, var, scale, scratch = (np.empty(inputs.n_features, x.dtype) for _ in range(4))
    mean_f, scale_f, beta_f = (per_feature(v, ndim) for v in (mean, scale, beta))
    preallocated = np.empty_like(x) if out_buffer else None

    def call():
        running.updates += 1
        y = preallocated if preallocated is not None else np.empty_like(x)
        np.mean(x, axis=axes, out=mean)
        np.subtract(x, mean_f, out=y)                  # y holds x - mean
        np.einsum(feature_dot, y, y, out=var)          # var holds sum((x - mean)^2)
        np.divide(var, m, out=var)
        np.multiply(running_mean, MOMENTUM, out=running_mean)
        np.add(running_mean, np.multiply(mean, 1.0 - MOMENTUM, out=scratch), out=running_mean)
        np.multiply(running_var, MOMENTUM, out=running_var)
        np.add(running_var, np.multiply(var, 1.0 - MOMENTUM, out=scratch), out=running_var)
        np.add(var, EPS, out=scale)
        np.sqrt(scale, out=scale)
        np.divide(gamma, scale, out=scale)             # scale = gamma * rstd
        y *= scale_f
        y += beta_f
        return y

    return Prepared(call, output_mode(out_buffer, True), result_arrays=running.result_arrays)


def prepare_numpy_inplace_backward(inputs, num_threads, out_buffer):
    x, dy, gamma = inputs.x, inputs.dy, inputs.gamma
    ndim, m = x.ndim, inputs.values_per_feature
    axes, feature_dot = batch_axes(ndim), _feature_dot_subscripts(ndim)
    mean, rstd = _numpy_statistics(x)
    # With g = dy * gamma, mean(g) = gamma * dbeta / m and mean(g * x_hat) = gamma * dgamma / m,
    # so dx = gamma * rstd * (dy - dbeta / m - x_hat * dgamma / m): x_hat lives in dx, no
    # full-size scratch is needed.
    dgamma, dbeta, scratch = (np.empty(inputs.n_features, x.dtype) for _ in range(3))
    scratch_f = per_feature(scratch, ndim)
    preallocated = np.empty_like(x) if out_buffer else None

    def call():
        dx = preallocated if preallocated is not None else np.empty_like(x)
        x_hat = np.subtract(x, mean, out=dx)
        x_hat *= rstd
        np.einsum(feature_dot, dy, x_hat, out=dgamma)
        np.sum(dy, axis=axes, out=dbeta)
        np.divide(dgamma, m, out=scratch)
        x_hat *= scratch_f                             # dx holds x_hat * dgamma / m
        np.subtract(dy, dx, out=dx)
        np.divide(dbeta, m, out=scratch)
        dx -= scratch_f
        np.multiply(gamma, rstd.ravel(), out=scratch)
        dx *= scratch_f
        return dx, dgamma, dbeta

    return Prepared(call, output_mode(out_buffer, True), result_arrays=tuple)


# --- PyTorch -------------------------------------------------------------------------------------

def _torch_tensors(torch, inputs):
    # from_numpy shares memory: no copy, and torch reads exactly the arrays the others read.
    return tuple(torch.from_numpy(array) for array in (inputs.x, inputs.gamma, inputs.beta))


def prepare_torch_train(inputs, num_threads, out_buffer):
    torch = torch_with_threads(num_threads)
    x, gamma, beta = _torch_tensors(torch, inputs)
    running = RunningStatistics(inputs, unbiased_variance=True)
    # Views of running.mean / running.var: torch's in-place updates land in them.
    running_mean, running_var = torch.from_numpy(running.mean), torch.from_numpy(running.var)
    batch_norm = torch.nn.functional.batch_norm
    torch_momentum = 1.0 - MOMENTUM  # PyTorch's momentum weighs the new value

    def call():
        running.updates += 1
        return batch_norm(x, running_mean, running_var, gamma, beta, True, torch_momentum, EPS)

    return Prepared(call, output_mode(out_buffer, False), threads=num_threads,
                    result_arrays=lambda y: running.result_arrays(y.numpy()),
                    before_sample=torch_thread_setter(torch, num_threads))


def prepare_torch_backward(inputs, num_threads, out_buffer):
    torch = torch_with_threads(num_threads)
    x, gamma, beta = _torch_tensors(torch, inputs)
    dy = torch.from_numpy(inputs.dy)
    _, save_mean, save_invstd = torch.ops.aten.native_batch_norm(
        x, gamma, beta, None, None, True, 1.0 - MOMENTUM, EPS)
    backward = torch.ops.aten.native_batch_norm_backward
    output_mask = [True, True, True]

    def call():
        return backward(dy, x, gamma, None, None, save_mean, save_invstd, True, EPS,
                        output_mask)

    return Prepared(call, output_mode(out_buffer, False), threads=num_threads,
                    result_arrays=lambda grads: tuple(g.numpy() for g in grads),
                    before_sample=torch_thread_setter(torch, num_threads))


# --- ONNX Runtime --------------------------------------------------------------------------------

def _onnx_batch_norm_model(dtype, ndim):
    """BatchNormalization (opset 15) in training mode over (N, C, ...): y and the updated
    running statistics."""
    from onnx import helper

    element_type = onnx_element_type(dtype)
    dims = ["n", "c"] + [f"d{axis}" for axis in range(2, ndim)]
    vector = ["c"]
    graph = helper.make_graph(
        [helper.make_node("BatchNormalization",
                          ["x", "scale", "bias", "input_mean", "input_var"],
                          ["y", "running_mean", "running_var"],
                          epsilon=EPS, momentum=MOMENTUM, training_mode=1)],
        "batch_norm_train",
        [helper.make_tensor_value_info("x", element_type, dims)]
        + [helper.make_tensor_value_info(name, element_type, vector)
           for name in ("scale", "bias", "input_mean", "input_var")],
        [helper.make_tensor_value_info("y", element_type, dims),
         helper.make_tensor_value_info("running_mean", element_type, vector),
         helper.make_tensor_value_info("running_var", element_type, vector)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = min(model.ir_version, 8)  # readable by older runtimes too
    return model


def prepare_onnxruntime_train(inputs, num_threads, out_buffer):
    x, gamma, beta = inputs.x, inputs.gamma, inputs.beta
    session = onnxruntime_session(("batch_norm_train", x.dtype, x.ndim),
                                  lambda: _onnx_batch_norm_model(x.dtype, x.ndim), num_threads)
    # ONNX attributes are float32: ONNX Runtime's momentum is float32(0.9) = 0.89999998, which
    # its float64 updates show; the check uses the momentum it really applies.
    running = RunningStatistics(inputs, momentum=float(np.float32(MOMENTUM)))
    running_mean, running_var = running.mean, running.var
    copyto = np.copyto
    if not out_buffer:
        # The feed refers to running.mean / running.var: each run reads their current values.
        feed = {"x": x, "scale": gamma, "bias": beta, "input_mean": running_mean,
                "input_var": running_var}
        run = session.run

        def call():
            running.updates += 1
            y, new_mean, new_var = run(None, feed)
            copyto(running_mean, new_mean)
            copyto(running_var, new_var)
            return y

        return Prepared(call, OUTPUT_NEW, threads=num_threads,
                        result_arrays=running.result_arrays)

    # IO binding: ONNX Runtime reads the NumPy inputs in place (the running statistics too, so
    # it sees every update) and writes into our buffers.
    y = np.empty_like(x)
    new_mean, new_var = np.empty_like(running_mean), np.empty_like(running_var)
    binding = session.io_binding()
    for name, array in (("x", x), ("scale", gamma), ("bias", beta),
                        ("input_mean", running_mean), ("input_var", running_var)):
        binding.bind_cpu_input(name, array)
    for name, array in (("y", y), ("running_mean", new_mean), ("running_var", new_var)):
        binding.bind_output(name, "cpu", 0, x.dtype, list(array.shape), array.ctypes.data)
    run_with_binding = session.run_with_iobinding

    def call():
        running.updates += 1
        run_with_binding(binding)
        copyto(running_mean, new_mean)
        copyto(running_var, new_var)
        return y

    return Prepared(call, OUTPUT_REUSED, threads=num_threads,
                    result_arrays=running.result_arrays)


# --- the operations ------------------------------------------------------------------------------

BATCH_NORM_TRAIN = Operation(
    name="batch_norm_train",
    title="batch_norm forward, training mode (running statistics updated)",
    make_inputs=make_forward_inputs,
    bytes_moved=train_bytes_moved,
    # x; one output each for fastln, numpy-inplace, torch, onnxruntime; numpy-naive's
    # temporaries.
    memory_factor=8,
    implementations=(
        Implementation("fastln", "fastln", prepare_fastln_train,
                       "fastln.batch_norm(training=True)"),
        Implementation("numpy-naive", "numpy", prepare_numpy_naive_train,
                       "x.mean / x.var over the batch axes and broadcasting",
                       uses_threads=False),
        Implementation("numpy-inplace", "numpy", prepare_numpy_inplace_train,
                       "NumPy in place into preallocated buffers", uses_threads=False),
        Implementation("torch", "torch", prepare_torch_train,
                       "torch.nn.functional.batch_norm(training=True)"),
        Implementation("onnxruntime", "onnxruntime", prepare_onnxruntime_train,
                       "BatchNormalization, opset 15, training_mode=1"),
    ),
)

BATCH_NORM_BACKWARD = Operation(
    name="batch_norm_backward",
    title="batch_norm backward, training mode",
    make_inputs=make_backward_inputs,
    bytes_moved=backward_bytes_moved,
    # x and dy; dx for fastln, numpy-inplace and torch; numpy-naive's temporaries.
    memory_factor=11,
    implementations=(
        Implementation("fastln", "fastln", prepare_fastln_backward,
                       "fastln.batch_norm_backward"),
        Implementation("numpy-naive", "numpy", prepare_numpy_naive_backward,
                       "broadcasting, one temporary per term", uses_threads=False),
        Implementation("numpy-inplace", "numpy", prepare_numpy_inplace_backward,
                       "NumPy in place, no full-size scratch", uses_threads=False),
        Implementation("torch", "torch", prepare_torch_backward,
                       "aten.native_batch_norm_backward (no autograd)"),
    ),
)

OPERATIONS = (BATCH_NORM_TRAIN, BATCH_NORM_BACKWARD)
