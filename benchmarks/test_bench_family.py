"""The normalization family: fastln and every baseline, one pytest-benchmark group per
(operation, shape, dtype), as test_bench_layer_norm.py does for LayerNorm and with its harness
(same schedule, same checks against fastln's result, same groups).

    pytest benchmarks/test_bench_family.py -k "rms_forward and 4096x768"
    pytest benchmarks/ -k "batch_norm"

Operations are `fastln bench --ops` names (fastln.bench.ops): rms_forward, rms_backward,
add_layer_norm, add_rms_norm, batch_norm_train, batch_norm_backward. A modest set of shapes, so
that the whole suite stays at a few minutes: one small, one mid-sized and one larger than the
cache for the row operations; for batch norm (features on axis 1) a (N, C) batch of
activations and an NCHW batch of images.
"""
import pytest

from fastln.bench.ops import OPERATIONS
from test_bench_layer_norm import DTYPES, _shape_id, run_benchmark

ROW_SHAPES = ((64, 768), (4096, 768), (32768, 1024))
BATCH_NORM_SHAPES = ((4096, 768), (32, 64, 28, 28))


def _parametrize(op, shapes):
    names = [implementation.name for implementation in OPERATIONS[op].implementations]
    # Implementation varies fastest: the tests of one case run together and share its inputs.
    cases = [(shape, dtype, name) for shape in shapes for dtype in DTYPES for name in names]
    return pytest.mark.parametrize("shape, dtype, implementation_name", cases,
                                   ids=[f"{_shape_id(shape)}-{dtype}-{name}"
                                        for shape, dtype, name in cases])


@_parametrize("rms_forward", ROW_SHAPES)
def test_rms_forward(benchmark, input_cache, num_threads, shape, dtype, implementation_name):
    run_benchmark(benchmark, input_cache, num_threads, "rms_forward", shape, dtype,
                  implementation_name)


@_parametrize("rms_backward", ROW_SHAPES)
def test_rms_backward(benchmark, input_cache, num_threads, shape, dtype, implementation_name):
    run_benchmark(benchmark, input_cache, num_threads, "rms_backward", shape, dtype,
                  implementation_name)


@_parametrize("add_layer_norm", ROW_SHAPES)
def test_add_layer_norm(benchmark, input_cache, num_threads, shape, dtype, implementation_name):
    run_benchmark(benchmark, input_cache, num_threads, "add_layer_norm", shape, dtype,
                  implementation_name)


@_parametrize("add_rms_norm", ROW_SHAPES)
def test_add_rms_norm(benchmark, input_cache, num_threads, shape, dtype, implementation_name):
    run_benchmark(benchmark, input_cache, num_threads, "add_rms_norm", shape, dtype,
                  implementation_name)


@_parametrize("batch_norm_train", BATCH_NORM_SHAPES)
def test_batch_norm_train(benchmark, input_cache, num_threads, shape, dtype,
                          implementation_name):
    run_benchmark(benchmark, input_cache, num_threads, "batch_norm_train", shape, dtype,
                  implementation_name)


@_parametrize("batch_norm_backward", BATCH_NORM_SHAPES)
def test_batch_norm_backward(benchmark, input_cache, num_threads, shape, dtype,
                             implementation_name):
    run_benchmark(benchmark, input_cache, num_threads, "batch_norm_backward", shape, dtype,
                  implementation_name)
