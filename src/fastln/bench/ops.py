"""The benchmark's table of operations: every operation `fastln bench` knows, by its --ops name.

One row per operation: how to make its inputs, how many arrays of x's size it must move at the
least (the effective bandwidth counts those bytes), its peak memory, the dtypes fastln computes it
in, and fastln's call. The peers' implementations come from one module per peer
(fastln.bench.peers.numpy, .torch, .onnxruntime), each with an IMPLEMENTATIONS dict keyed by
these names; OPERATIONS joins them to the rows, fastln first, then the peers in --peers order.

Adding an operation is one row in TABLE with its fastln call, plus one entry in the
IMPLEMENTATIONS of each peer module that can compute it.

Bytes that must move (n elements of x): forward and rms_forward read x and write y (2 n);
backward and rms_backward read dy and x and write dx (3 n; dgamma, dbeta and the statistics are
one row each); the fused add + norm reads x and residual and writes y and s (4 n; an unfused
implementation moves more, and the column shows what fusing saves). A feature's batch
statistics need all of its values before its first output, so once x is larger than the cache
batch_norm_train reads x twice and writes y (3 n), batch_norm_backward reads dy and x twice and
writes dx (5 n); for arrays that fit in the cache those second reads come from it.
batch_norm_eval, from the running statistics, reads x once and writes y (2 n). Batch norm
reads a shape as (N, C) or (N, C, H, W, ...), features on axis 1 as in PyTorch. Group norm and
instance norm read it as (N, C, H, W, ...) - group_norm_last and group_norm_last_backward too,
the same tensor laid out channels last, (N, H, W, ..., C) in memory - in gcd(32, C) groups (the
diffusion models' 32), so that one shape times both layouts of the same tensor; a group larger
than the cache is read twice, as a batch-norm feature is, but the standard shapes' groups fit it
(2 n forward, 3 n backward).
"""
import math
import dataclasses
from functools import partial

import numpy as np

import fastln
from fastln._config import build_info
from fastln.bench.operation import (
    EPS,
    FEATURE_AXIS,
    MOMENTUM,
    OUTPUT_NEW,
    OUTPUT_NO_OUT,
    OUTPUT_REUSED,
    Implementation,
    Inputs,
    Operation,
    Prepared,
    RunningStatistics,
    check_rows,
    compare_results,
    make_inputs,
    output_mode,
)
from fastln.bench.peers import numpy as numpy_peer
from fastln.bench.peers import onnxruntime as onnxruntime_peer
from fastln.bench.peers import torch as torch_peer

# The peer modules in the order their implementations are listed (and --peers names them).
PEER_MODULES = (numpy_peer, torch_peer, onnxruntime_peer)


def fastln_threads(num_threads):
    """The threads a fastln call really uses: a build without OpenMP runs every call on one."""
    return num_threads if build_info()["openmp"] else 1


def _fastln(make_call, n_outputs=1):
    """prepare() for a fastln call: make_call(inputs, num_threads, *outs) -> call, where outs are
    None, or with --out-buffer one preallocated array of x's shape per full-size output."""
    def prepare(inputs, num_threads, out_buffer):
        outs = [np.empty_like(inputs.x) if out_buffer else None for _ in range(n_outputs)]
        return Prepared(make_call(inputs, num_threads, *outs), output_mode(out_buffer, True),
                        threads=fastln_threads(num_threads))
    return prepare


def _layer_norm(inputs, num_threads, out):
    return partial(fastln.layer_norm, inputs.x, inputs.gamma, inputs.beta, EPS, out=out,
                   num_threads=num_threads)


def _layer_norm_backward(inputs, num_threads, out):
    _, cache = fastln.layer_norm_forward(inputs.x, inputs.gamma, inputs.beta, EPS,
                                         num_threads=num_threads)
    return partial(fastln.layer_norm_backward, inputs.dy, cache, inputs.gamma, out=out,
                   num_threads=num_threads)


def _rms_norm(inputs, num_threads, out):
    return partial(fastln.rms_norm, inputs.x, inputs.gamma, EPS, out=out,
                   num_threads=num_threads)


def _rms_norm_backward(inputs, num_threads, out):
    _, cache = fastln.rms_norm_forward(inputs.x, inputs.gamma, EPS, num_threads=num_threads)
    return partial(fastln.rms_norm_backward, inputs.dy, cache, inputs.gamma, out=out,
                   num_threads=num_threads)


def _add_layer_norm(inputs, num_threads, out, sum_out):
    return partial(fastln.add_layer_norm, inputs.x, inputs.residual, inputs.gamma, inputs.beta,
                   EPS, out=out, sum_out=sum_out, num_threads=num_threads)


def _add_rms_norm(inputs, num_threads, out, sum_out):
    return partial(fastln.add_rms_norm, inputs.x, inputs.residual, inputs.gamma, EPS, out=out,
                   sum_out=sum_out, num_threads=num_threads)


def _prepare_batch_norm_train(inputs, num_threads, out_buffer):
    # Its own running statistics, updated by every call and checked through what they imply.
    running = RunningStatistics(inputs)
    out = np.empty_like(inputs.x) if out_buffer else None

    def call():
        running.updates += 1
        return fastln.batch_norm(inputs.x, inputs.gamma, inputs.beta, running.mean, running.var,
                                 training=True, momentum=MOMENTUM, eps=EPS, axis=FEATURE_AXIS,
                                 out=out, num_threads=num_threads)

    return Prepared(call, output_mode(out_buffer, True), threads=fastln_threads(num_threads),
                    result_arrays=running.result_arrays)


def _batch_norm_eval(inputs, num_threads, out):
    return partial(fastln.batch_norm, inputs.x, inputs.gamma, inputs.beta, inputs.running_mean,
                   inputs.running_var, training=False, eps=EPS, axis=FEATURE_AXIS, out=out,
                   num_threads=num_threads)


def _batch_norm_backward(inputs, num_threads, out):
    _, cache = fastln.batch_norm_forward(inputs.x, inputs.gamma, inputs.beta, training=True,
                                         momentum=MOMENTUM, eps=EPS, axis=FEATURE_AXIS,
                                         num_threads=num_threads)
    return partial(fastln.batch_norm_backward, inputs.dy, cache, inputs.gamma, out=out,
                   num_threads=num_threads)


def group_count(shape, channel_axis=1):
    """The groups of a group-norm case: gcd(32, C), 32 for the diffusion models' shapes."""
    return math.gcd(32, shape[channel_axis])


def _group_norm(inputs, num_threads, out):
    return partial(fastln.group_norm, inputs.x, group_count(inputs.x.shape), inputs.gamma,
                   inputs.beta, EPS, out=out, num_threads=num_threads)


def _channels_last_inputs(shape, dtype, rng, dy=False):
    """Inputs for an (N, C, H, W, ...) shape, x (and dy) laid out channels last: (N, H, W, ...,
    C)."""
    inputs = make_inputs(shape, dtype, rng, beta=True, per_channel=True, dy=dy)
    inputs.x = np.ascontiguousarray(np.moveaxis(inputs.x, 1, -1))
    if dy:
        inputs.dy = np.ascontiguousarray(np.moveaxis(inputs.dy, 1, -1))
    return inputs


def _group_norm_last(inputs, num_threads, out):
    return partial(fastln.group_norm, inputs.x, group_count(inputs.x.shape, -1), inputs.gamma,
                   inputs.beta, EPS, channel_axis=-1, out=out, num_threads=num_threads)


def _group_norm_backward(inputs, num_threads, out):
    _, cache = fastln.group_norm_forward(inputs.x, group_count(inputs.x.shape), inputs.gamma,
                                         inputs.beta, EPS, num_threads=num_threads)
    return partial(fastln.group_norm_backward, inputs.dy, cache, inputs.gamma, out=out,
                   num_threads=num_threads)


def _group_norm_last_backward(inputs, num_threads, out):
    _, cache = fastln.group_norm_forward(inputs.x, group_count(inputs.x.shape, -1), inputs.gamma,
                                         inputs.beta, EPS, channel_axis=-1,
                                         num_threads=num_threads)
    return partial(fastln.group_norm_backward, inputs.dy, cache, inputs.gamma, out=out,
                   num_threads=num_threads)


def _instance_norm(inputs, num_threads, out):
    return partial(fastln.instance_norm, inputs.x, inputs.gamma, inputs.beta, EPS, out=out,
                   num_threads=num_threads)


# Peak memory, in arrays of x's size: the inputs; one output each for fastln, numpy-inplace and
# a library peer; numpy-naive's temporaries (and numpy-inplace's scratch in a backward).
_FORWARD_MEMORY, _BACKWARD_MEMORY, _ADD_MEMORY = 8, 11, 12

TABLE = (
    Operation("forward", "layer_norm forward", partial(make_inputs, beta=True),
              streams=2, memory_factor=_FORWARD_MEMORY,
              fastln=_fastln(_layer_norm), fastln_call="fastln.layer_norm"),
    Operation("backward", "layer_norm backward", partial(make_inputs, beta=True, dy=True),
              streams=3, memory_factor=_BACKWARD_MEMORY, batch_sums=(1, 2),
              fastln=_fastln(_layer_norm_backward), fastln_call="fastln.layer_norm_backward"),
    Operation("rms_forward", "rms_norm forward", make_inputs,
              streams=2, memory_factor=_FORWARD_MEMORY,
              fastln=_fastln(_rms_norm), fastln_call="fastln.rms_norm"),
    Operation("rms_backward", "rms_norm backward", partial(make_inputs, dy=True),
              streams=3, memory_factor=_BACKWARD_MEMORY, batch_sums=(1,),
              fastln=_fastln(_rms_norm_backward), fastln_call="fastln.rms_norm_backward"),
    Operation("add_layer_norm", "add_layer_norm (residual add + layer_norm) forward",
              partial(make_inputs, beta=True, residual=True),
              streams=4, memory_factor=_ADD_MEMORY,
              fastln=_fastln(_add_layer_norm, 2), fastln_call="fastln.add_layer_norm"),
    Operation("add_rms_norm", "add_rms_norm (residual add + rms_norm) forward",
              partial(make_inputs, residual=True),
              streams=4, memory_factor=_ADD_MEMORY,
              fastln=_fastln(_add_rms_norm, 2), fastln_call="fastln.add_rms_norm"),
    Operation("batch_norm_train",
              "batch_norm forward, training mode (running statistics updated)",
              partial(make_inputs, beta=True, running=True),
              streams=3, memory_factor=_FORWARD_MEMORY,
              fastln=_prepare_batch_norm_train, fastln_call="fastln.batch_norm(training=True)"),
    Operation("batch_norm_eval", "batch_norm forward, evaluation mode (running statistics)",
              partial(make_inputs, beta=True, running=True),
              streams=2, memory_factor=_FORWARD_MEMORY,
              fastln=_fastln(_batch_norm_eval), fastln_call="fastln.batch_norm(training=False)"),
    Operation("batch_norm_backward", "batch_norm backward, training mode",
              partial(make_inputs, beta=True, running=True, dy=True),
              streams=5, memory_factor=_BACKWARD_MEMORY, batch_sums=(1, 2),
              fastln=_fastln(_batch_norm_backward), fastln_call="fastln.batch_norm_backward"),
    Operation("group_norm", "group_norm forward, (N, C, H, W), gcd(32, C) groups",
              partial(make_inputs, beta=True, per_channel=True),
              streams=2, memory_factor=_FORWARD_MEMORY,
              fastln=_fastln(_group_norm), fastln_call="fastln.group_norm"),
    Operation("group_norm_last", "group_norm forward, channels last ((N, C, H, W) laid out "
              "(N, H, W, C))", _channels_last_inputs,
              streams=2, memory_factor=_FORWARD_MEMORY,
              fastln=_fastln(_group_norm_last), fastln_call="fastln.group_norm(channel_axis=-1)"),
    Operation("group_norm_backward", "group_norm backward, (N, C, H, W)",
              partial(make_inputs, beta=True, per_channel=True, dy=True),
              streams=3, memory_factor=_BACKWARD_MEMORY, batch_sums=(1, 2),
              fastln=_fastln(_group_norm_backward), fastln_call="fastln.group_norm_backward"),
    Operation("group_norm_last_backward", "group_norm backward, channels last ((N, C, H, W) "
              "laid out (N, H, W, C))", partial(_channels_last_inputs, dy=True),
              streams=3, memory_factor=_BACKWARD_MEMORY, batch_sums=(1, 2),
              fastln=_fastln(_group_norm_last_backward),
              fastln_call="fastln.group_norm_backward (channels-last cache)"),
    Operation("instance_norm", "instance_norm forward, (N, C, H, W)",
              partial(make_inputs, beta=True, per_channel=True),
              streams=2, memory_factor=_FORWARD_MEMORY,
              fastln=_fastln(_instance_norm), fastln_call="fastln.instance_norm"),
)


def _with_implementations(operation):
    """The row with its implementations: fastln's, then each peer module's."""
    implementations = [Implementation("fastln", "fastln", operation.fastln,
                                      operation.fastln_call)]
    for module in PEER_MODULES:
        implementations += module.IMPLEMENTATIONS.get(operation.name, ())
    return dataclasses.replace(operation, implementations=tuple(implementations))


OPERATIONS = {operation.name: _with_implementations(operation) for operation in TABLE}

__all__ = [
    "OPERATIONS",
    "OUTPUT_NEW",
    "OUTPUT_NO_OUT",
    "OUTPUT_REUSED",
    "Implementation",
    "Inputs",
    "Operation",
    "Prepared",
    "check_rows",
    "compare_results",
]
