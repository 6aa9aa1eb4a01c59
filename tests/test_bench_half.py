"""`fastln bench --dtypes float16,bfloat16`: the half formats run through the command like
float32 (fastln on half arrays against PyTorch's half tensors and NumPy's naive code in float32
on a converted copy), every peer's result checked against fastln's; the per-channel ops (batch,
group and instance norm) too, against PyTorch and ONNX Runtime. No timing is asserted."""
import json

import numpy as np
import pytest

from fastln.bench import peers
from fastln.bench.operation import HALF_DTYPES, check_rows, compare_results, numpy_dtype
from fastln.bench.ops import OPERATIONS
from test_bench_cli import TINY, run_main

pytest.importorskip("ml_dtypes")

HALF_OPS = ("forward", "backward", "rms_forward", "rms_backward", "add_layer_norm",
            "add_rms_norm")
INSTALLED = ("numpy",) + tuple(peer for peer in ("torch", "onnxruntime")
                               if peers.is_installed(peer))


def _run_half(tmp_path_factory, ops, shape):
    """status, stdout, stderr and the JSON report of `fastln bench` on ops at shape, in float16
    and bfloat16, with every installed peer."""
    path = tmp_path_factory.mktemp("bench_half") / "half.json"
    argv = list(TINY)
    argv[argv.index("--dtypes") + 1] = "float16,bfloat16"
    argv[argv.index("--peers") + 1] = ",".join(INSTALLED)
    argv[argv.index("--shapes") + 1] = shape
    argv += ["--ops", ",".join(ops), "--json", str(path)]
    status, stdout, stderr = run_main(argv)
    return status, stdout, stderr, json.loads(path.read_text())


@pytest.fixture(scope="module")
def half_run(tmp_path_factory):
    return _run_half(tmp_path_factory, HALF_OPS, "4x32")


CHANNEL_OPS = ("batch_norm_train", "batch_norm_eval", "batch_norm_backward", "group_norm",
               "group_norm_last", "group_norm_backward", "group_norm_last_backward",
               "instance_norm")


@pytest.fixture(scope="module")
def channel_run(tmp_path_factory):
    return _run_half(tmp_path_factory, CHANNEL_OPS, "2x32x3x3")


def test_half_formats_run_every_row_op(half_run):
    status, stdout, stderr, data = half_run
    assert status == 0, stderr
    assert data["settings"]["dtypes"] == ["float16", "bfloat16"]
    seen = {(record["op"], record["dtype"]) for record in data["results"]}
    assert seen == {(op, dtype) for op in HALF_OPS for dtype in HALF_DTYPES}
    for record in data["results"]:
        assert record["status"] == "ok", record
        # Two bytes an element: the bandwidth counts the half arrays as they are.
        assert record["bytes_moved"] == OPERATIONS[record["op"]].streams * 4 * 32 * 2
        assert record["implementation"] != "numpy-inplace"  # float32/float64 only
    implementations = {record["implementation"] for record in data["results"]}
    assert {"fastln", "numpy-naive"} <= implementations
    if "torch" in INSTALLED:
        assert "torch" in implementations
    if "onnxruntime" in INSTALLED:  # float16 only
        assert {record["dtype"] for record in data["results"]
                if record["implementation"] == "onnxruntime"} == {"float16"}


def test_per_channel_ops_run_in_half_against_their_peers(channel_run):
    status, stdout, stderr, data = channel_run
    assert status == 0, stderr
    assert data["skipped"] == []
    assert {(record["op"], record["dtype"]) for record in data["results"]
            if record["implementation"] == "fastln"} == {
        (op, dtype) for op in CHANNEL_OPS for dtype in HALF_DTYPES}
    for record in data["results"]:
        assert record["status"] == "ok", record
        # NumPy's half arithmetic is no peer: its float16 batch variance is off by 100%.
        assert record["implementation"] in ("fastln", "torch", "onnxruntime"), record
    if "torch" in INSTALLED:
        assert {(record["op"], record["dtype"]) for record in data["results"]
                if record["implementation"] == "torch"} == {
            (op, dtype) for op in CHANNEL_OPS for dtype in HALF_DTYPES}


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_batch_norm_statistics_are_float32_in_half(dtype):
    inputs = OPERATIONS["batch_norm_train"].make_inputs((4, 6), dtype, np.random.default_rng(2))
    assert inputs.x.dtype == numpy_dtype(dtype)
    assert inputs.running_mean.dtype == inputs.running_var.dtype == np.float32


@pytest.mark.parametrize("op", HALF_OPS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_naive_numpy_computes_in_float32_and_rounds_back(op, dtype):
    operation = OPERATIONS[op]
    inputs = operation.make_inputs((6, 40), dtype, np.random.default_rng(3))
    assert inputs.x.dtype == numpy_dtype(dtype)
    fastln_call = operation.implementation("fastln").prepare(inputs, 1, False)
    reference = tuple(check_rows(a) for a in fastln_call.result_arrays(fastln_call.call()))
    naive = operation.implementation("numpy-naive").prepare(inputs, 1, False)
    arrays = naive.result_arrays(naive.call())
    # Full-size results come back in the half format, like fastln's; the float32 ones stay.
    assert [a.dtype for a in arrays] == [r.dtype for r in reference]
    assert compare_results(arrays, reference, dtype, operation.tolerance_for(dtype)) is None
    # ... and the check would catch a wrong result at this tolerance.
    wrong = tuple(a.astype(np.float32) * 1.2 for a in arrays)
    assert compare_results(wrong, reference, dtype, operation.tolerance_for(dtype))


def test_bfloat16_without_ml_dtypes_is_refused_before_any_work(capsys, monkeypatch):
    import importlib.util

    from fastln import cli

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ml_dtypes" else real_find_spec(name, *a))
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["bench", "--dtypes", "bfloat16"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "--dtypes" in err and "ml_dtypes" in err
