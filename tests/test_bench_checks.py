"""`fastln bench` refuses every bad option before any work, and measures what users get: thread
counts it can honour, the previous library's workers idle before each sample, suspect
measurements taken again and flagged, a closing summary, files written by default.

No timing is asserted; the runs are tiny.
"""
import hashlib
import json
import threading
import time

import numpy as np
import pytest

from fastln import cli
from fastln.bench import command, report, runner, timing
from fastln.bench.machine import usable_cpus
from test_bench_cli import TINY, run_main

NUMERIC_FLAGS = ("--repeat", "--min-sample-ms", "--copy-buffer-mib", "--seed", "--threads")
BAD_NUMBERS = ("inf", "-inf", "nan", "-5", "0", "1e999", "99999999999999999999999",
               "\u0661\u0662", "1_0", " ", "12abc")


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if anything is measured or any copy is made."""
    def refuse(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(runner, "run_benchmark", refuse)
    monkeypatch.setattr("fastln.bench.bandwidth.measure_copy_bandwidth", refuse)


def _refused(argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        cli.main(argv)
    err = capsys.readouterr().err
    return excinfo.value.code, err


@pytest.mark.parametrize("flag, value", [(flag, value) for flag in NUMERIC_FLAGS
                                         for value in BAD_NUMBERS
                                         if (flag, value) != ("--seed", "0")])  # a valid seed
def test_every_bad_number_is_one_line_naming_the_flag(flag, value, capsys, no_work):
    status, err = _refused(["bench", f"{flag}={value}"], capsys)
    assert status == 2
    assert flag in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flag, value", [("--min-sample-ms", "60001"),
                                         ("--repeat", "10001"),
                                         ("--seed", str(2**63)),
                                         ("--copy-buffer-mib", "99999999")])
def test_numbers_beyond_their_range_are_refused(flag, value, capsys, no_work):
    status, err = _refused(["bench", flag, value], capsys)
    assert status == 2 and flag in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("shapes", ["\u0661\u0662x768", "1_0x768", "4096x7\u0666\u0668",
                                    "+4x8", "4x 8"])
def test_shapes_take_ascii_decimal_digits_only(shapes, capsys, no_work):
    status, err = _refused(["bench", "--shapes", shapes], capsys)
    assert status == 2 and "--shapes" in err


@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
@pytest.mark.parametrize("where", ["missing-directory", "a-directory", "read-only"])
def test_every_unwritable_path_is_refused_before_any_work(flag, where, tmp_path, capsys,
                                                          no_work):
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    path = {"missing-directory": tmp_path / "no" / "such" / "file.out",
            "a-directory": tmp_path,
            "read-only": "/proc/fastln-bench.out"}[where]
    status, err = _refused(["bench", flag, str(path)], capsys)
    assert status == 2 and flag in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "no").exists()


def test_a_writable_path_is_checked_without_leaving_a_file(tmp_path):
    path = tmp_path / "results.json"
    assert command.writable_path(str(path)) == str(path)
    assert not path.exists()
    path.write_text("kept")
    command.writable_path(str(path))
    assert path.read_text() == "kept"


def test_thread_counts_beyond_the_cpus_are_lowered_and_reported_truthfully(tmp_path):
    path = tmp_path / "threads.json"
    argv = [arg for arg in TINY]
    argv[argv.index("--threads") + 1] = "1,100000"
    argv[argv.index("--shapes") + 1] = "8x32"
    status, _, stderr = run_main(argv + ["--ops", "forward", "--json", str(path)])
    assert status == 0
    assert "--threads 100000" in stderr and f"measuring with {usable_cpus()} threads" in stderr
    data = json.loads(path.read_text())
    assert data["settings"]["threads"] == list(dict.fromkeys([1, usable_cpus()]))
    for record in data["results"]:
        assert record["threads_used"] <= usable_cpus()
    for copy in data["copy_bandwidth"]:
        assert copy["threads_used"] <= usable_cpus()


def test_the_copy_probe_never_starts_more_threads_than_cpus():
    from fastln.bench import bandwidth

    results = bandwidth.measure_copy_bandwidth([100000], 1 << 20, repeats=1)
    assert {result["threads_used"] for result in results} <= set(range(1, usable_cpus() + 1))


# --- waiting for idle workers ---------------------------------------------------------------

def _busy_thread(until):
    """A thread that keeps a CPU busy without holding the GIL (hashlib releases it for large
    buffers) while until() is true; started and running when this returns."""
    data, running = bytes(8 << 20), threading.Event()

    def work():
        running.set()
        while until():
            hashlib.sha256(data).digest()

    worker = threading.Thread(target=work)
    worker.start()
    running.wait()
    return worker


def test_wait_for_idle_threads_waits_for_a_busy_thread():
    if timing._other_threads_running() is None:
        pytest.skip("no /proc/self/task here: the wait is a fixed pause")
    stop = time.perf_counter() + 0.05
    worker = _busy_thread(lambda: time.perf_counter() < stop)
    try:
        waited, idle = timing.wait_for_idle_threads(timeout=2.0)
    finally:
        worker.join()
    assert idle and waited >= 0.01


def test_wait_for_idle_threads_gives_up_on_a_thread_that_never_sleeps():
    if timing._other_threads_running() is None:
        pytest.skip("no /proc/self/task here: the wait is a fixed pause")
    done = threading.Event()
    worker = _busy_thread(lambda: not done.is_set())
    try:
        waited, idle = timing.wait_for_idle_threads(timeout=0.02)
    finally:
        done.set()
        worker.join()
    assert not idle and 0.02 <= waited < 0.5


# --- anomalies ------------------------------------------------------------------------------

def test_find_anomalies_spots_disagreeing_rounds_and_thread_slowdowns():
    steady = [1.0e-5] * 10
    bimodal = [0.85e-3] * 4 + [7e-6] * 6  # samples like the ones of issue 19
    found = runner.find_anomalies({("fastln", 1): steady, ("fastln", 2): bimodal,
                                   ("torch", 1): steady, ("torch", 2): [1.5e-5] * 10,
                                   ("numpy-naive", None): steady})
    assert set(found) == {("fastln", 2), ("torch", 2)}
    assert found[("fastln", 2)].startswith("rounds disagree")
    assert found[("torch", 2)] == "1.50x slower with 2 threads than with 1"
    assert runner.find_anomalies({("fastln", 1): steady, ("fastln", 2): [1.2e-5] * 10}) == {}


def _run_with_samples(monkeypatch, sample_sets, threads=(1, 2)):
    """run_benchmark with interleaved_samples replaced: the n-th measurement of the group
    returns sample_sets[min(n, last)] for every contestant (fastln, numpy-naive, numpy-inplace)."""
    calls = []

    def fake_interleaved(calls_list, calls_per_sample, rounds, **kwargs):
        chosen = sample_sets[min(len(calls), len(sample_sets) - 1)]
        calls.append(rounds)
        return [list(chosen(index)) for index in range(len(calls_list))]

    monkeypatch.setattr(timing, "interleaved_samples", fake_interleaved)
    config = runner.BenchConfig(ops=("forward",), shapes=((8, 32),), dtypes=("float64",),
                                threads=threads, peers=("numpy",), progress=False,
                                schedule=timing.Schedule(min_sample_seconds=1e-4,
                                                         fixed_rounds=4),
                                copy_buffer_bytes=1 << 20, copy_repeats=1)
    return runner.run_benchmark(config), calls


def test_a_suspect_group_is_measured_again_and_kept_when_it_settles(monkeypatch):
    bad = lambda index: [1e-3, 1e-5, 1e-3, 1e-5]  # noqa: E731
    good = lambda index: [1e-5, 1.1e-5, 1e-5, 0.9e-5]  # noqa: E731
    result, calls = _run_with_samples(monkeypatch, [bad, good])
    assert len(calls) == 2
    for record in result["results"]:
        assert record["remeasured"] == 1 and record["anomaly"] is None
    assert "flagged:" not in report.format_table(result)


def test_what_stays_suspect_is_flagged_in_the_table_and_the_json(monkeypatch):
    bad = lambda index: [1e-3, 1e-5, 1e-3, 1e-5]  # noqa: E731
    result, calls = _run_with_samples(monkeypatch, [bad])
    assert len(calls) == 1 + runner.MAX_REMEASURES
    assert all(record["anomaly"].startswith("rounds disagree") for record in result["results"])
    table = report.format_table(result)
    assert "flagged:" in table and "(measured 3 times)" in table
    flag_column = report.COLUMNS.index("flag")
    assert {row[flag_column] for row in report.table_rows(result)} == {"spread"}
    summary = {entry["implementation"]: entry for entry in result["summary"]}
    assert summary["numpy-naive"]["cases"] == 0
    assert summary["numpy-naive"]["flagged_cases_left_out"] == 2


# --- summary and files ----------------------------------------------------------------------

def test_the_summary_gives_median_and_minimum_speed_up_per_op_dtype_and_peer():
    def record(shape, threads, name, speedup, op="forward", dtype="float32"):
        return {"op": op, "dtype": dtype, "shape": list(shape), "threads": threads,
                "implementation": name, "status": "ok", "fastln_speedup": speedup,
                "anomaly": None}

    results = [record((1, 8), 1, "fastln", 1.0), record((1, 8), 1, "torch", 3.0),
               record((4, 8), 1, "torch", 0.8), record((4, 8), 2, "torch", 2.0),
               record((1, 8), 1, "torch", 9.0, op="backward")]
    summary = {(e["op"], e["implementation"]): e for e in runner.speedup_summary(results)}
    forward = summary[("forward", "torch")]
    assert forward["median_speedup"] == 2.0 and forward["min_speedup"] == 0.8
    assert forward["min_case"] == {"shape": [4, 8], "threads": 1} and forward["cases"] == 3
    assert summary[("backward", "torch")]["median_speedup"] == 9.0
    lines = report.summary_lines({"summary": runner.speedup_summary(results),
                                  "machine": {"cpu_model": "Test CPU"}})
    assert "Test CPU" in lines[0]
    assert any("2.00x (min 0.80x at 4x8, 1T)" in line for line in lines)


def test_the_summary_closes_the_table(tmp_path):
    path = tmp_path / "s.json"
    status, stdout, _ = run_main(TINY + ["--json", str(path)])
    assert status == 0
    lines = stdout.rstrip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("summary: fastln's"))
    # The summary's column header, one row per op and dtype, then where the files went.
    assert lines[start + 1].split() == ["op", "dtype", "vs", "numpy-naive", "vs",
                                        "numpy-inplace"]
    assert [line.split()[:2] for line in lines[start + 2:start + 4]] == [
        ["forward", "float32"], ["backward", "float32"]]
    assert lines[start + 4:] == ["", f"wrote json {path}"]
    data = json.loads(path.read_text())
    assert {(e["op"], e["implementation"]) for e in data["summary"]} == {
        (op, name) for op in ("forward", "backward") for name in ("numpy-naive", "numpy-inplace")}
    for entry in data["summary"]:
        records = [r for r in data["results"]
                   if (r["op"], r["implementation"]) == (entry["op"], entry["implementation"])]
        # Flagged measurements are left out of the summary, and counted (on a noisy machine a
        # tiny run may flag some).
        speedups = [r["fastln_speedup"] for r in records if not r.get("anomaly")]
        assert entry["flagged_cases_left_out"] == len(records) - len(speedups)
        assert entry["cases"] == len(speedups)
        if not speedups:
            assert "median_speedup" not in entry
            continue
        assert entry["min_speedup"] == min(speedups)
        assert entry["median_speedup"] == pytest.approx(float(np.median(speedups)))


def test_json_and_plot_are_written_by_default_and_the_end_says_where(tmp_path):
    argv = [arg for arg in TINY if arg != "--no-files"] + ["--ops", "forward"]
    status, stdout, _ = run_main(argv, cwd=tmp_path)
    assert status == 0
    last = stdout.rstrip().splitlines()[-1]
    assert last.startswith("wrote json ") and str(tmp_path / command.DEFAULT_JSON) in last
    data = json.loads((tmp_path / command.DEFAULT_JSON).read_text())
    assert data["results"]
    if "plot" in command.output_files(cli.build_parser().parse_args(["bench"])):
        assert (tmp_path / command.DEFAULT_PLOT).read_bytes().startswith(b"\x89PNG")
        assert str(tmp_path / command.DEFAULT_PLOT) in last


def test_no_files_writes_nothing(tmp_path):
    status, stdout, _ = run_main(TINY + ["--ops", "forward"], cwd=tmp_path)
    assert status == 0 and list(tmp_path.iterdir()) == [] and "wrote" not in stdout
