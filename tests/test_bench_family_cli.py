"""`fastln bench --ops` for the normalization family, with tiny configurations: every operation
runs through the command with the right columns, records, bytes and outputs; the peers' results
(the running statistics of batch norm included) are checked against fastln's before timing.

No timing is asserted; the runs take a few seconds (torch and ONNX Runtime are imported when
installed, to run their implementations too).
"""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from fastln import cli
from fastln.bench import command, peers, report, runner, timing
from fastln.bench.operation import RunningStatistics, batch_axes, check_rows
from fastln.bench.ops import OPERATIONS, Implementation, Prepared, compare_results
from fastln.bench.peers import onnxruntime as onnxruntime_peer
from fastln.bench.peers import torch as torch_peer
from test_bench_cli import TINY, run_main

FAMILY_OPS = ("rms_forward", "rms_backward", "add_layer_norm", "add_rms_norm",
              "batch_norm_train", "batch_norm_eval", "batch_norm_backward")
# Bytes each operation must move, in units of x's size (see fastln.bench.ops).
BYTES_FACTOR = {"rms_forward": 2, "rms_backward": 3, "add_layer_norm": 4, "add_rms_norm": 4,
                "batch_norm_train": 3, "batch_norm_eval": 2, "batch_norm_backward": 5}
# Every implementation, by operation; the peers that are not installed are left out below.
IMPLEMENTATIONS = {
    "rms_forward": ["fastln", "numpy-naive", "numpy-inplace", "torch", "onnxruntime"],
    "rms_backward": ["fastln", "numpy-naive", "numpy-inplace", "torch"],
    "add_layer_norm": ["fastln", "numpy-naive", "numpy-inplace", "torch", "onnxruntime"],
    "add_rms_norm": ["fastln", "numpy-naive", "numpy-inplace", "torch", "onnxruntime"],
    "batch_norm_train": ["fastln", "numpy-naive", "numpy-inplace", "torch", "onnxruntime"],
    "batch_norm_eval": ["fastln", "numpy-naive", "numpy-inplace", "torch", "onnxruntime"],
    "batch_norm_backward": ["fastln", "numpy-naive", "numpy-inplace", "torch"],
}
INSTALLED = ("numpy",) + tuple(peer for peer in ("torch", "onnxruntime")
                               if peers.is_installed(peer))
# 4x32 and 16x64 are rows x columns, or (N, C) for batch norm; 2x3x4x5 has leading dimensions
# for the row operations and is NCHW for batch norm.
SHAPES = "4x32,16x64,2x3x4x5"


def _tiny(*extra, shapes=SHAPES, peer_names=INSTALLED):
    argv = list(TINY)
    argv[argv.index("--shapes") + 1] = shapes
    argv[argv.index("--peers") + 1] = ",".join(peer_names)
    return argv + list(extra)


def _expected(op, peer_names=INSTALLED):
    return [name for name in IMPLEMENTATIONS[op]
            if OPERATIONS[op].implementation(name).peer in ("fastln",) + tuple(peer_names)]


@pytest.fixture(scope="module")
def family_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench_family")
    paths = {"json": directory / "family.json", "markdown": directory / "family.md"}
    argv = _tiny("--ops", ",".join(FAMILY_OPS), "--dtypes", "float32,float64",
                 "--json", str(paths["json"]), "--markdown", str(paths["markdown"]))
    status, stdout, stderr = run_main(argv)
    return {"status": status, "stdout": stdout, "stderr": stderr, "paths": paths,
            "json": json.loads(paths["json"].read_text())}


def test_every_implementation_is_registered_as_documented():
    for op in FAMILY_OPS:
        assert [i.name for i in OPERATIONS[op].implementations] == IMPLEMENTATIONS[op]
        assert OPERATIONS[op].implementations[0].peer == "fastln"


def test_family_ops_run_through_the_command_with_every_column(family_run):
    assert family_run["status"] == 0, family_run["stderr"]
    lines = family_run["stdout"].splitlines()
    header = next(line for line in lines if line.startswith("op "))
    positions = [header.index(column) for column in report.COLUMNS]
    assert positions == sorted(positions)
    table = "\n".join(lines)
    for op in FAMILY_OPS:
        assert op in table
    assert "not measured" not in table, table


def test_family_records(family_run):
    data = family_run["json"]
    assert data["settings"]["ops"] == list(FAMILY_OPS)
    assert data["settings"]["peers"] == list(INSTALLED)
    assert not data["skipped"]
    results = data["results"]
    by_case = {}
    for record in results:
        by_case.setdefault((record["op"], tuple(record["shape"]), record["dtype"]),
                           []).append(record)
    shapes = [tuple(map(int, shape.split("x"))) for shape in SHAPES.split(",")]
    assert set(by_case) == {(op, shape, dtype) for op in FAMILY_OPS for shape in shapes
                            for dtype in ("float32", "float64")}
    for (op, shape, dtype), records in by_case.items():
        assert [r["implementation"] for r in records] == _expected(op), (op, shape, dtype)
        for record in records:
            assert record["status"] == "ok", record
            assert record["threads"] == 1 and record["output"] == "new"
            itemsize = np.dtype(dtype).itemsize
            assert record["bytes_moved"] == BYTES_FACTOR[op] * int(np.prod(shape)) * itemsize
            assert record["bandwidth_bytes_per_second"] == pytest.approx(
                record["bytes_moved"] / record["median_s"])
            assert len(record["samples_s"]) == record["rounds"] == 2
            assert record["fastln_speedup"] > 0
            if record["implementation"] == "fastln":
                assert record["fastln_speedup"] == 1.0


def test_family_markdown_has_a_row_per_record(family_run):
    text = family_run["paths"]["markdown"].read_text()
    assert "| " + " | ".join(report.COLUMNS) + " |" in text
    rows = [line for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| op |")]
    assert len(rows) == len(family_run["json"]["results"])


def test_default_run_is_layer_norm_only_and_family_ops_are_accepted():
    parser = cli.build_parser()
    assert command.build_config(parser.parse_args(["bench"])).ops == ("forward", "backward")
    assert command.build_config(parser.parse_args(["bench", "--quick"])).ops == (
        "forward", "backward")
    config = command.build_config(parser.parse_args(["bench", "--ops", ",".join(FAMILY_OPS)]))
    assert config.ops == FAMILY_OPS
    assert set(FAMILY_OPS) <= set(command.OPS)


def test_unknown_op_lists_the_family(capsys):
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["bench", "--ops", "rms_sideways"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "--ops" in err
    for op in FAMILY_OPS:
        assert op in err


def test_help_documents_the_family_ops():
    result = subprocess.run([sys.executable, "-m", "fastln", "bench", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # argparse wraps the help text
    for op in FAMILY_OPS:
        assert op in text
    assert "default: forward,backward" in text


def test_out_buffer_marks_which_family_outputs_are_reused(tmp_path):
    path = tmp_path / "out_buffer.json"
    status, _, _ = run_main(_tiny("--ops", ",".join(FAMILY_OPS), "--out-buffer",
                                  "--json", str(path), shapes="8x32,2x3x4x5"))
    assert status == 0
    expected = {"fastln": "reused", "numpy-inplace": "reused", "numpy-naive": "new (no out=)",
                "torch": "new (no out=)", "onnxruntime": "reused"}
    for record in json.loads(path.read_text())["results"]:
        assert record["status"] == "ok", record
        assert record["output"] == expected[record["implementation"]], record


def test_numpy_is_timed_once_for_every_thread_count(tmp_path):
    path = tmp_path / "threads.json"
    argv = _tiny("--ops", "add_rms_norm,batch_norm_backward", "--json", str(path),
                 shapes="8x32", peer_names=("numpy",))
    argv[argv.index("--threads") + 1] = "1,2"
    status, _, _ = run_main(argv)
    assert status == 0
    results = json.loads(path.read_text())["results"]
    for op in ("add_rms_norm", "batch_norm_backward"):
        by_key = {(r["threads"], r["implementation"]): r for r in results if r["op"] == op}
        assert sorted(by_key) == sorted((threads, name) for threads in (1, 2)
                                        for name in ("fastln", "numpy-naive", "numpy-inplace"))
        for name in ("numpy-naive", "numpy-inplace"):
            assert by_key[(1, name)]["samples_s"] == by_key[(2, name)]["samples_s"]


# --- the checks before timing ------------------------------------------------------------------

def _reference(operation, inputs):
    fastln_call = operation.implementation("fastln").prepare(inputs, 1, False)
    return tuple(check_rows(array) for array in fastln_call.result_arrays(fastln_call.call()))


def _installed_implementations(op):
    return [implementation for implementation in OPERATIONS[op].implementations
            if implementation.peer == "fastln" or peers.is_installed(implementation.peer)]


@pytest.mark.parametrize("op", FAMILY_OPS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("out_buffer", [False, True])
def test_every_implementation_matches_fastln_after_many_calls(op, dtype, out_buffer):
    # The runner checks after one call; the pytest-benchmark suite after all of its timed
    # calls, which update batch norm's running statistics many times over.
    operation = OPERATIONS[op]
    shape = (2, 6, 3, 5) if op.startswith("batch_norm") else (6, 40)
    inputs = operation.make_inputs(shape, dtype, np.random.default_rng(1))
    reference = _reference(operation, inputs)
    for implementation in _installed_implementations(op):
        prepared = implementation.prepare(inputs, 1, out_buffer)
        for _ in range(7):
            result = prepared.call()
        mismatch = compare_results(prepared.result_arrays(result), reference, dtype)
        assert mismatch is None, f"{implementation.name}: {mismatch}"


def _run_with(monkeypatch, op, extra_implementations, shape=(8, 32), dtype="float64",
              peer_names=("numpy",)):
    """{implementation: status} of a run of op with fastln and extra_implementations only."""
    result = _report_with(monkeypatch, op, extra_implementations, shape, dtype, peer_names)
    return {record["implementation"]: record["status"] for record in result["results"]}


def _report_with(monkeypatch, op, extra_implementations, shape=(8, 32), dtype="float64",
                 peer_names=("numpy",)):
    operation = OPERATIONS[op]
    patched = dataclasses.replace(operation, implementations=operation.implementations[:1]
                                  + tuple(extra_implementations))
    monkeypatch.setitem(runner.OPERATIONS, op, patched)
    config = runner.BenchConfig(ops=(op,), shapes=(shape,), dtypes=(dtype,), threads=(1,),
                                peers=peer_names, progress=False,
                                schedule=timing.Schedule(min_sample_seconds=1e-4,
                                                         fixed_rounds=2),
                                copy_buffer_bytes=1 << 20, copy_repeats=1)
    return runner.run_benchmark(config)


def test_wrong_running_statistics_are_reported_not_timed(monkeypatch):
    import fastln

    def prepare_wrong_momentum(inputs, num_threads, out_buffer):
        # Right y, running statistics updated with PyTorch's momentum unconverted.
        running = RunningStatistics(inputs)

        def call():
            running.updates += 1
            return fastln.batch_norm(inputs.x, inputs.gamma, inputs.beta, running.mean,
                                     running.var, training=True, momentum=0.1, axis=1)

        return Prepared(call, result_arrays=running.result_arrays)

    statuses = _run_with(monkeypatch, "batch_norm_train", [
        Implementation("wrong-momentum", "numpy", prepare_wrong_momentum, uses_threads=False)])
    assert statuses["fastln"] == "ok"
    assert statuses["wrong-momentum"].startswith("mismatch: result 1 differs from fastln's")


def test_a_missing_sum_is_reported_not_timed(monkeypatch):
    import fastln

    def prepare_residual_as_sum(inputs, num_threads, out_buffer):
        # Right y, but the residual returned where the sum belongs.
        def call():
            y, _ = fastln.add_layer_norm(inputs.x, inputs.residual, inputs.gamma, inputs.beta)
            return y, inputs.residual

        return Prepared(call, result_arrays=tuple)

    statuses = _run_with(monkeypatch, "add_layer_norm", [
        Implementation("no-sum", "numpy", prepare_residual_as_sum, uses_threads=False)])
    assert statuses["no-sum"].startswith("mismatch: result 1 differs from fastln's")


def _backward_with_error(dx_error, dgamma_error):
    import fastln

    def prepare(inputs, num_threads, out_buffer):
        _, cache = fastln.layer_norm_forward(inputs.x, inputs.gamma, inputs.beta)

        def call():
            dx, dgamma, dbeta = fastln.layer_norm_backward(inputs.dy, cache, inputs.gamma)
            return dx * (1 + dx_error), dgamma * (1 + dgamma_error), dbeta

        return Prepared(call, result_arrays=tuple)

    return prepare


def _run_backward_with(monkeypatch, implementation):
    result = _report_with(monkeypatch, "backward", [implementation], dtype="float32")
    return {record["implementation"]: record for record in result["results"]}, result


def test_batch_sums_outside_the_tolerance_are_timed_and_reported(monkeypatch):
    records, result = _run_backward_with(monkeypatch, Implementation(
        "rough-dgamma", "numpy", _backward_with_error(0.0, 0.05), uses_threads=False))
    rough = records["rough-dgamma"]
    assert rough["status"] == "ok" and rough["median_s"] > 0
    assert rough["inexact"].startswith("result 1 differs from fastln's by 5.0")
    assert records["fastln"]["inexact"] is None
    lines = report.format_table(result).splitlines()
    at = lines.index("timed, though their sums over the batch are outside the check's tolerance:")
    assert lines[at + 1].startswith("  rough-dgamma backward 8x32 float32 threads=1: result 1")
    assert "rough-dgamma backward 8x32 float32 threads=1: result 1" in (
        report.format_markdown(result))


def test_a_wrong_dx_is_still_refused_whatever_the_batch_sums(monkeypatch):
    records, result = _run_backward_with(monkeypatch, Implementation(
        "wrong-dx", "numpy", _backward_with_error(0.05, 0.0), uses_threads=False))
    assert records["wrong-dx"]["status"].startswith("mismatch: result 0 differs from fastln's")
    assert "median_s" not in records["wrong-dx"]
    assert "timed, though" not in report.format_table(result)


@pytest.mark.skipif(not peers.is_installed("onnxruntime"), reason="onnxruntime is not installed")
def test_onnxruntime_without_rms_normalization_is_an_error_not_a_crash(monkeypatch):
    monkeypatch.setattr(onnxruntime_peer, "supports_rms_normalization", lambda: False)
    implementation = OPERATIONS["rms_forward"].implementation("onnxruntime")
    statuses = _run_with(monkeypatch, "rms_forward", [implementation],
                         peer_names=("onnxruntime",))
    assert statuses["fastln"] == "ok"
    assert statuses["onnxruntime"].startswith("error: RuntimeError:")
    assert "RMSNormalization" in statuses["onnxruntime"]


@pytest.mark.skipif(not peers.is_installed("torch"), reason="torch is not installed")
@pytest.mark.parametrize("fused", [False, True])
def test_torch_rms_backward_both_ways(monkeypatch, fused):
    # Autograd, or aten._fused_rms_norm_backward where it has a CPU kernel.
    if fused and not torch_peer.fused_rms_backward_runs():
        pytest.skip("this PyTorch has no CPU kernel for aten._fused_rms_norm_backward")
    monkeypatch.setitem(torch_peer._fused_backward_runs, "cpu", fused)
    operation = OPERATIONS["rms_backward"]
    inputs = operation.make_inputs((6, 40), "float64", np.random.default_rng(2))
    prepared = operation.implementation("torch").prepare(inputs, 1, False)
    for _ in range(3):  # the recorded graph is reused call after call
        result = prepared.call()
    assert compare_results(prepared.result_arrays(result), _reference(operation, inputs),
                           "float64") is None


def test_batch_norm_shapes_put_the_features_on_axis_1():
    inputs = OPERATIONS["batch_norm_train"].make_inputs((2, 3, 4, 5), "float64",
                                                        np.random.default_rng(0))
    assert inputs.n_features == 3 and inputs.values_per_feature == 40
    assert inputs.gamma.shape == inputs.running_mean.shape == (3,)
    assert batch_axes(4) == (0, 2, 3)


def test_group_norm_shapes_give_both_layouts_the_same_tensor():
    """group_norm_last reads an (N, C, H, W) shape as group_norm does and lays the tensor out
    channels last, so that one shape times both layouts of the same tensor."""
    shape = (2, 6, 4, 5)
    first = OPERATIONS["group_norm"].make_inputs(shape, "float32", np.random.default_rng(0))
    last = OPERATIONS["group_norm_last"].make_inputs(shape, "float32", np.random.default_rng(0))
    assert first.x.shape == shape and last.x.shape == (2, 4, 5, 6)
    assert last.x.flags.c_contiguous and last.gamma.shape == last.beta.shape == (6,)
    assert np.array_equal(last.x, np.moveaxis(first.x, 1, -1))


def test_add_norm_bytes_count_both_inputs_and_both_outputs():
    assert OPERATIONS["add_layer_norm"].bytes_moved((4, 8), 4) == 4 * 32 * 4
    assert OPERATIONS["add_rms_norm"].bytes_moved((4, 8), 4) == 4 * 32 * 4
    assert OPERATIONS["batch_norm_train"].bytes_moved((2, 3, 4, 5), 8) == 3 * 120 * 8
    assert OPERATIONS["batch_norm_backward"].bytes_moved((16, 8), 4) == 5 * 128 * 4
