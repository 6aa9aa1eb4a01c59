"""`fastln bench --accuracy`: the exact reference is exact, the error measures measure, every case
runs for every installed implementation, and fastln's errors stay at a few ulps, with no NaN and
the same bits on 1 and 2 threads (the numerics the command exists to show)."""
import json
import math
from fractions import Fraction

import numpy as np
import pytest

from fastln.bench import accuracy
from fastln.bench.ops import OPERATIONS
from test_bench_cli import run_main


@pytest.fixture(scope="module")
def small_report():
    # Small arrays: the same cases, a fraction of the time.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(accuracy, "N_ROWS", 48)
        patch.setattr(accuracy, "N_COLS", 96)
        yield accuracy.run_accuracy(progress=False)


def test_the_reference_agrees_with_rational_arithmetic():
    rng = np.random.default_rng(0)
    x = (1e6 + rng.standard_normal((3, 16))).astype(np.float32).astype(np.float64)
    dy = rng.standard_normal((3, 16))
    y, dx = accuracy.exact(x, dy, "layer", axis=1)
    for row in range(3):
        values = [Fraction(v) for v in x[row]]
        mean = sum(values) / 16
        var = sum((v - mean) ** 2 for v in values) / 16
        rstd = 1 / math.sqrt(float(var + Fraction(accuracy.EPS)))
        x_hat = np.array([float(v - mean) for v in values]) * rstd
        np.testing.assert_allclose(y[row], x_hat, rtol=0, atol=1e-12)
        g = dy[row]
        expected_dx = rstd * (g - g.mean() - x_hat * (g * x_hat).mean())
        np.testing.assert_allclose(dx[row], expected_dx, rtol=0, atol=1e-10)


def test_errors_count_ulps_at_the_row_scale_and_notice_nan():
    reference = np.array([[1.0, 0.5, -0.25], [2.0, 0.0, 1.0]])
    result = reference.copy()
    result[0, 1] += 2 * np.spacing(np.float32(1.0))  # two ulps at the row's largest value
    cell = accuracy.errors(result.astype(np.float32), reference, np.float32, axis=1)
    assert cell["max_ulps"] == pytest.approx(2.0) and not cell["nan"]
    result[1, 1] = np.nan
    cell = accuracy.errors(result, reference, np.float32, axis=1)
    assert cell["nan"] and cell["max_abs"] == np.inf
    # A row whose exact result is not a number is left out.
    reference[1, 2] = np.nan
    cell = accuracy.errors(result, reference, np.float32, axis=1)
    assert not cell["nan"] and cell["max_ulps"] == pytest.approx(2.0)
    assert "NaN" in accuracy.format_cell({**cell, "nan": True,
                                          "bitwise_same_1_and_2_threads": False})


def test_every_op_and_case_is_measured(small_report):
    seen = {(row["op"], row["case"]) for row in small_report["rows"]}
    # batch norm included: it runs in float16 too.
    assert seen == {(label, case) for label, _, _, _ in accuracy.OPS
                    for case, _, _ in accuracy.CASES}
    for row in small_report["rows"]:
        naive = OPERATIONS[row["bench_op"]].implementation("numpy-naive")
        assert "fastln" in row["results"]
        # NumPy's naive batch norm is float32/float64 only (in float16 it loses the variance).
        assert ("numpy-naive" in row["results"]) == (
            naive.dtypes is None or row["dtype"] in naive.dtypes)


def test_fastln_is_exact_nan_free_and_thread_independent(small_report):
    for row in small_report["rows"]:
        cell = row["results"]["fastln"]
        assert "error" not in cell, row
        assert cell["max_ulps"] is not None and cell["max_ulps"] <= 8, row
        assert not cell["nan"], row
        assert cell["bitwise_same_1_and_2_threads"] is True, row


def test_naive_numpy_loses_digits_at_large_offsets_and_fastln_does_not(small_report):
    row = next(r for r in small_report["rows"]
               if r["bench_op"] == "forward" and r["case"].startswith("float32 1e5"))
    assert row["results"]["numpy-naive"]["max_ulps"] > 100 * row["results"]["fastln"]["max_ulps"]


def test_accuracy_command_prints_the_table_and_writes_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setattr(accuracy, "N_ROWS", 16)
    monkeypatch.setattr(accuracy, "N_COLS", 32)
    paths = {"json": tmp_path / "acc.json", "markdown": tmp_path / "acc.md"}
    status, stdout, _ = run_main(["bench", "--accuracy", "--no-progress", "--json",
                                  str(paths["json"]), "--markdown", str(paths["markdown"])],
                                 cwd=tmp_path)
    assert status == 0
    assert stdout.startswith("accuracy against an exact reference")
    assert "reference: float64" in stdout and "float32 1e6 + N(0,1)" in stdout
    data = json.loads(paths["json"].read_text())
    assert data["schema"] == accuracy.SCHEMA and data["rows"]
    assert paths["markdown"].read_text().count("| layer_norm forward |") == len(accuracy.CASES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acc.json", "acc.md"]
