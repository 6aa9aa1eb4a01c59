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


# Each operation with its shapes, in the order the tests run.
OPERATION_SHAPES = {
    "rms_forward": ROW_SHAPES,
    "rms_backward": ROW_SHAPES,
    "add_layer_norm": ROW_SHAPES,
    "add_rms_norm": ROW_SHAPES,
    "batch_norm_train": BATCH_NORM_SHAPES,
    "batch_norm_backward": BATCH_NORM_SHAPES,
}
# Implementation varies fastest: the tests of one case run together and share its inputs.
CASES = [(op, shape, dtype, implementation.name)
         for op, shapes in OPERATION_SHAPES.items() for shape in shapes for dtype in DTYPES
         for implementation in OPERATIONS[op].implementations]


@pytest.mark.parametrize("op, shape, dtype, implementation_name", CASES,
                         ids=[f"{op}-{_shape_id(shape)}-{dtype}-{name}"
                              for op, shape, dtype, name in CASES])
def test_operation(benchmark, input_cache, num_threads, op, shape, dtype, implementation_name):
    run_benchmark(benchmark, input_cache, num_threads, op, shape, dtype, implementation_name)
