"""`fastln` and `fastln bench` with tiny configurations: columns, JSON schema, files, errors.

No timing is asserted (the numbers belong to the machine); the runs are small enough to take a
second or two.
"""
import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from fastln import cli
from fastln.bench import command, peers, report
from fastln.bench.ops import OPERATIONS

TINY = ["bench", "--shapes", "4x32,16x64", "--dtypes", "float32", "--threads", "1",
        "--peers", "numpy", "--repeat", "2", "--min-sample-ms", "0.2",
        "--copy-buffer-mib", "4", "--no-progress", "--no-files"]
IMPLEMENTATIONS = {"forward": ["fastln", "numpy-naive", "numpy-inplace"],
                   "backward": ["fastln", "numpy-naive", "numpy-inplace"]}
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_main(argv, cwd=None):
    """cli.main in this process: (exit status, stdout, stderr), run in `cwd` (a fresh temporary
    directory by default, so that default output files never land in the checkout)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(cwd or scratch)
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                status = cli.main(argv)
        finally:
            os.chdir(previous)
    return status, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench")
    paths = {"json": directory / "bench.json", "markdown": directory / "bench.md",
             "plot": directory / "bench.png"}
    argv = TINY + ["--json", str(paths["json"]), "--markdown", str(paths["markdown"])]
    if HAVE_MATPLOTLIB:
        argv += ["--plot", str(paths["plot"])]
    status, stdout, stderr = run_main(argv)
    return {"status": status, "stdout": stdout, "stderr": stderr, "paths": paths,
            "json": json.loads(paths["json"].read_text())}


def test_bench_exits_zero_and_prints_a_table_with_every_column(tiny_run):
    assert tiny_run["status"] == 0
    lines = tiny_run["stdout"].splitlines()
    header = next(line for line in lines if line.startswith("op "))
    positions = [header.index(column) for column in report.COLUMNS]
    assert positions == sorted(positions)
    table = "\n".join(lines)
    for op, names in IMPLEMENTATIONS.items():
        assert op in table
        for name in names:
            assert name in table
    assert "copy bandwidth" in table and "machine:" in table


def test_bench_json_schema(tiny_run):
    data = tiny_run["json"]
    assert data["schema"] == "fastln-bench/1"
    assert data["command"].startswith("fastln bench --shapes 4x32,16x64")
    assert data["duration_seconds"] > 0
    others = data["other_processes_cpus"]  # None where /proc/stat is missing
    assert others is None or others >= 0
    assert data["settings"]["shapes"] == [[4, 32], [16, 64]]
    assert data["settings"]["threads"] == [1]
    assert data["settings"]["peers"] == ["numpy"]

    described = data["machine"]
    for key in ("cpu_model", "logical_cpus", "usable_cpus", "instruction_sets", "caches",
                "last_level_cache_bytes", "memory_total_bytes", "python", "numpy", "peers",
                "load_average"):
        assert key in described
    assert described["usable_cpus"] >= 1
    for key in ("fastln", "numpy", "python", "openmp", "default_num_threads", "compile_args"):
        assert key in described["fastln"]

    assert data["copy_bandwidth"]
    for copy in data["copy_bandwidth"]:
        assert copy["threads"] == 1
        assert copy["stores"] in ("ordinary", "nontemporal")
        assert copy["bytes_per_second"] > 0
        assert copy["buffer_bytes"] == 4 << 20
        assert len(copy["samples_s"]) == 5

    results = data["results"]
    assert len(results) == 2 * 2 * 3  # ops x shapes x implementations
    assert not data["skipped"]
    for record in results:
        assert record["status"] == "ok", record
        assert record["op"] in OPERATIONS
        assert record["implementation"] in IMPLEMENTATIONS[record["op"]]
        assert record["dtype"] == "float32" and record["threads"] == 1
        assert len(record["samples_s"]) == record["rounds"] == 2
        assert record["calls_per_sample"] >= 1
        assert record["q1_s"] <= record["median_s"] <= record["q3_s"]
        assert record["min_s"] <= record["median_s"] <= record["max_s"]
        n_elements = record["shape"][0] * record["shape"][1]
        factor = 2 if record["op"] == "forward" else 3
        assert record["bytes_moved"] == factor * n_elements * 4
        assert record["bandwidth_bytes_per_second"] == pytest.approx(
            record["bytes_moved"] / record["median_s"])
        assert record["fraction_of_copy_bandwidth"] > 0
        assert record["fastln_speedup"] > 0
        if record["implementation"] == "fastln":
            assert record["fastln_speedup"] == 1.0
        assert record["output"] == "new"


def test_bench_markdown_has_the_table(tiny_run):
    text = tiny_run["paths"]["markdown"].read_text()
    assert text.startswith("- machine: ")
    assert "| " + " | ".join(report.COLUMNS) + " |" in text
    table_rows = [line for line in text.splitlines()
                  if line.startswith("| ") and not line.startswith("| op |")]
    assert len(table_rows) == 12


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")
def test_bench_plot_is_written(tiny_run):
    data = tiny_run["paths"]["plot"].read_bytes()
    assert data.startswith(b"\x89PNG")


def test_out_buffer_marks_which_outputs_are_reused(tmp_path):
    argv = [arg if arg != "4x32,16x64" else "8x32" for arg in TINY]
    path = tmp_path / "out_buffer.json"
    status, stdout, _ = run_main(argv + ["--ops", "forward", "--out-buffer", "--json", str(path)])
    assert status == 0
    outputs = {record["implementation"]: record["output"]
               for record in json.loads(path.read_text())["results"]}
    assert outputs == {"fastln": "reused", "numpy-inplace": "reused",
                       "numpy-naive": "new (no out=)"}
    assert "new (no out=)" in stdout


def test_numpy_is_timed_once_and_shown_at_every_thread_count(tmp_path):
    argv = [arg if arg != "4x32,16x64" else "8x32" for arg in TINY]
    argv[argv.index("--threads") + 1] = "1,2"
    path = tmp_path / "threads.json"
    status, _, _ = run_main(argv + ["--ops", "backward", "--json", str(path)])
    assert status == 0
    results = json.loads(path.read_text())["results"]
    assert [(r["threads"], r["implementation"]) for r in results] == [
        (threads, name) for threads in (1, 2) for name in IMPLEMENTATIONS["backward"]]
    by_key = {(r["threads"], r["implementation"]): r for r in results}
    for name in ("numpy-naive", "numpy-inplace"):
        assert by_key[(1, name)]["samples_s"] == by_key[(2, name)]["samples_s"]
        assert by_key[(1, name)]["measured_once_for_all_threads"]
        assert by_key[(2, name)]["threads_used"] == 1
    assert by_key[(2, "fastln")]["threads_used"] == 2
    assert not by_key[(2, "fastln")]["measured_once_for_all_threads"]


def test_a_wrong_or_failing_peer_is_reported_not_timed(monkeypatch):
    from fastln.bench import runner, timing
    from fastln.bench.ops import Implementation, Prepared

    def prepare_wrong(inputs, num_threads, out_buffer):
        return Prepared(lambda: inputs.x * 2.0)

    def prepare_failing(inputs, num_threads, out_buffer):
        raise RuntimeError("no kernel for this")

    forward = OPERATIONS["forward"]
    broken = dataclasses.replace(forward, implementations=forward.implementations[:1] + (
        Implementation("wrong", "numpy", prepare_wrong, uses_threads=False),
        Implementation("failing", "numpy", prepare_failing, uses_threads=False)))
    monkeypatch.setitem(runner.OPERATIONS, "forward", broken)
    config = runner.BenchConfig(ops=("forward",), shapes=((8, 32),), dtypes=("float64",),
                                threads=(1,), peers=("numpy",), progress=False,
                                schedule=timing.Schedule(min_sample_seconds=1e-4,
                                                         fixed_rounds=2),
                                copy_buffer_bytes=1 << 20, copy_repeats=1)
    result = runner.run_benchmark(config)
    statuses = {record["implementation"]: record["status"] for record in result["results"]}
    assert statuses["fastln"] == "ok"
    assert statuses["wrong"].startswith("mismatch: result 0 differs from fastln's")
    assert statuses["failing"] == "error: RuntimeError: no kernel for this"
    table = report.format_table(result)
    assert "not timed" in table and "no kernel for this" in table


@pytest.mark.parametrize("shapes", ["4096by768", "4096x", "0x768", "x768", "1.5x768", "768", ""])
def test_malformed_shapes_exit_2_naming_the_option(shapes, capsys):
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["bench", "--shapes", shapes])
    assert excinfo.value.code == 2
    assert "--shapes" in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [("--ops", "sideways"), ("--dtypes", "int32"),
                                           ("--threads", "0"), ("--threads", "two"),
                                           ("--peers", "tensorflow"), ("--repeat", "0")])
def test_bad_options_exit_2_naming_the_option(option, value, capsys):
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["bench", option, value])
    assert excinfo.value.code == 2
    assert option in capsys.readouterr().err


def test_a_run_that_measures_nothing_fails():
    """Every case skipped (too large for the memory): the table says why, the status is 1."""
    status, stdout, stderr = run_main(["bench", "--shapes", "100000x100000", "--dtypes",
                                       "float32", "--threads", "1", "--peers", "none",
                                       "--copy-buffer-mib", "4", "--no-progress", "--no-files"])
    assert status == 1
    assert "skipped forward 100000x100000 float32: needs about" in stdout
    assert "nothing was measured" in stderr


def test_missing_peer_is_skipped_with_a_warning(monkeypatch, capsys):
    monkeypatch.setattr(peers, "is_installed", lambda peer: peer == "numpy")
    args = cli.build_parser().parse_args(["bench", "--peers", "numpy,torch"])
    config = command.build_config(args)
    assert config.peers == ("numpy",)
    assert "--peers torch: not installed" in capsys.readouterr().err


def test_defaults_and_quick():
    parser = cli.build_parser()
    default = command.build_config(parser.parse_args(["bench"]))
    assert default.shapes == command.STANDARD_SHAPES
    assert default.ops == ("forward", "backward")
    assert default.dtypes == ("float32", "float64")
    assert default.threads[0] == 1
    quick = command.build_config(parser.parse_args(["bench", "--quick"]))
    assert quick.shapes == command.QUICK_SHAPES and len(quick.threads) == 1


def test_rounds_fit_the_budget():
    from fastln.bench.timing import Schedule

    schedule = Schedule()  # 5 to 25 rounds in 0.6 s; 3 when a round takes over a second
    assert schedule.rounds_for(0.001) == 25
    assert schedule.rounds_for(0.05) == 12
    assert schedule.rounds_for(0.5) == 5
    assert schedule.rounds_for(2.0) == 3
    assert Schedule(fixed_rounds=7).rounds_for(2.0) == 7


def test_times_are_written_with_three_digits_below_1000():
    assert report.format_seconds(5.47e-7) == "547 ns"
    assert report.format_seconds(9.996e-4) == "1 ms"
    assert report.format_seconds(0.0195) == "19.5 ms"
    assert report.format_seconds(1.58) == "1.58 s"


def test_fastln_alone_describes_the_build_and_the_worked_example():
    status, stdout, _ = run_main([])
    assert status == 0
    assert "OpenMP" in stdout
    assert "fastln.layer_norm(x) = [-0.9258 -0.4629 1.3887]" in stdout
    assert "fastln bench" in stdout


def _clean_environment(**extra):
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    environment.update(extra)
    return environment


def test_python_m_fastln_bench_measures_with_openmps_default_wait_policy(tmp_path):
    # What users get: nothing set, no child process with another policy.
    path = tmp_path / "default.json"
    result = subprocess.run([sys.executable, "-m", "fastln", *TINY, "--ops", "forward",
                             "--json", str(path)],
                            capture_output=True, text=True, timeout=120,
                            env=_clean_environment())
    assert result.returncode == 0, result.stderr
    assert "numpy-inplace" in result.stdout and "OpenMP's default wait policy" in result.stdout
    assert "ms and at least 3 untimed calls" in result.stdout
    data = json.loads(path.read_text())
    environment = data["machine"]["thread_environment"]
    assert "GOMP_SPINCOUNT" not in environment and "OMP_WAIT_POLICY" not in environment
    assert data["settings"]["warmup_seconds"] > 0 and data["settings"]["warmup_min_calls"] == 3
    assert data["settings"]["idle_wait_seconds"] >= 0


@pytest.mark.parametrize("name, value", [("GOMP_SPINCOUNT", "1234"),
                                         ("OMP_WAIT_POLICY", "PASSIVE")])
def test_a_wait_policy_set_by_the_user_is_kept(tmp_path, name, value):
    path = tmp_path / "mine.json"
    result = subprocess.run([sys.executable, "-m", "fastln", *TINY, "--ops", "forward",
                             "--json", str(path)],
                            capture_output=True, text=True, timeout=120,
                            env=_clean_environment(**{name: value}))
    assert result.returncode == 0, result.stderr
    assert f"{name}={value}" in result.stdout
    environment = json.loads(path.read_text())["machine"]["thread_environment"]
    assert environment[name] == value
    assert [key for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if key in environment] == [name]


def test_every_sample_follows_a_warm_up_except_for_long_calls():
    from fastln.bench import timing

    schedule = timing.Schedule()
    assert schedule.warmup_for(1e-5) == schedule.warmup_for(0.01) == 0.001
    assert schedule.warmup_for(0.05) == 0.0

    assert schedule.warmup_min_calls == 3

    log = []
    samples = timing.interleaved_samples([lambda: log.append("a"), lambda: log.append("b")],
                                         [3, 2], rounds=2, warmup=[0.002, 0.0],
                                         warmup_min_calls=3)
    assert [len(s) for s in samples] == [2, 2]
    # Round 0 starts with a, round 1 with b; a's warm-up adds at least three untimed calls, b
    # (no warm-up: a long call) none.
    first_b = log.index("b")
    assert first_b >= 3 + 3 and log[:first_b] == ["a"] * first_b
    assert log.count("b") == 2 * 2 and log.count("a") >= 2 * (3 + 3)

    calls = []
    timing.warm_up(lambda: calls.append(1), 0.0, 3)
    assert calls == []

    def slow_call():  # a call longer than the whole warm-up: still min_calls of them
        calls.append(1)
        time.sleep(0.002)

    timing.warm_up(slow_call, 0.001, 3)
    assert len(calls) == 3


def test_cpus_taken_by_other_processes():
    from fastln.bench import machine

    # 3 CPU-seconds of work in 2 s, 1 of them ours: other processes kept one CPU busy.
    assert machine.other_processes_cpus((10.0, 1.0), (13.0, 2.0), 2.0) == 1.0
    assert machine.other_processes_cpus((10.0, 1.0), (10.5, 2.0), 2.0) == 0.0  # tick rounding
    assert machine.other_processes_cpus(None, (13.0, 2.0), 2.0) is None
    reading = machine.busy_cpu_seconds()
    assert reading is None or (reading[0] >= 0 and reading[1] >= 0)


def test_the_header_says_how_idle_workers_waited():
    machine = {"thread_environment": {"GOMP_SPINCOUNT": "10000", "OMP_NUM_THREADS": "2"}}
    off = {"session.intra_op.allow_spinning": "0"}
    assert report.wait_policy({"machine": machine, "settings": {}}) == ["GOMP_SPINCOUNT=10000"]
    assert report.wait_policy({"machine": {"thread_environment": {}}, "settings": {}}) == [
        "OpenMP's default wait policy"]
    machine = {"thread_environment": {"OMP_WAIT_POLICY": "PASSIVE"}}
    assert report.wait_policy({"machine": machine,
                               "settings": {"onnxruntime_session_config": off}}) == [
        "OMP_WAIT_POLICY=PASSIVE", "onnxruntime spinning off"]


@pytest.mark.skipif(not peers.is_installed("onnxruntime"), reason="onnxruntime is not installed")
def test_onnxruntime_workers_never_spin(monkeypatch):
    from fastln.bench.peers import onnxruntime as onnxruntime_peer

    for policy in ("", "passive", "active"):
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        assert onnxruntime_peer.onnxruntime_spinning() == {
            "session.intra_op.allow_spinning": "0"}


def test_peers_that_are_not_selected_are_not_imported():
    code = ("import sys; from fastln.cli import main; "
            f"status = main({TINY + ['--ops', 'forward']!r}); "
            "assert 'torch' not in sys.modules and 'onnxruntime' not in sys.modules; "
            "sys.exit(status)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=_clean_environment(OMP_WAIT_POLICY="PASSIVE"))
    assert result.returncode == 0, result.stderr


def test_runs_without_the_optional_libraries():
    # tqdm and matplotlib hidden: a plain progress counter, a plain table, and --plot refused
    # before anything is measured.
    hide = "import sys; sys.modules['tqdm'] = None; sys.modules['matplotlib'] = None; "
    argv = [arg for arg in TINY if arg != "--no-progress"] + ["--ops", "forward"]
    code = hide + f"from fastln.cli import main; sys.exit(main({argv!r}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=_clean_environment(OMP_WAIT_POLICY="PASSIVE"))
    assert result.returncode == 0, result.stderr
    assert "[1/2] forward 4x32 float32" in result.stderr
    assert "numpy-inplace" in result.stdout

    code = hide + "from fastln.cli import main; sys.exit(main(['bench', '--plot', 'x.png']))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "--plot" in result.stderr and "matplotlib" in result.stderr


def test_bench_help():
    result = subprocess.run([sys.executable, "-m", "fastln", "bench", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--shapes" in result.stdout


# In a fresh process: page faults while writing a new 1 MiB array twice (each freed at once), with
# or without settle_allocator() first.
_FAULTS_SCRIPT = """
import resource, sys
import numpy as np
from fastln.bench.timing import settle_allocator
if sys.argv[1] == "settled":
    settle_allocator()
np.ones(1 << 17)  # the first 1 MiB block: mapped either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
np.ones(1 << 17)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _glibc():
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (AttributeError, ValueError):
        return False


@pytest.mark.skipif(not _glibc(), reason="glibc's mmap threshold is what settle_allocator acts on")
def test_settle_allocator_serves_new_arrays_without_page_faults():
    """The bench times NumPy's baselines as a long-running process would run them: a fresh
    process maps (and page-faults) every new array of 128 KiB or more; after settle_allocator a
    second 1 MiB array reuses the first one's memory."""
    def faults(state):
        done = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, state], check=True,
                              capture_output=True, text=True)
        return int(done.stdout)

    # 256 pages of 4 KiB: ~216 faults here, once 194 (the kernel maps some pages ahead)
    assert faults("fresh") >= 128
    assert faults("settled") < 50


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("kind", ["json", "markdown", "plot"])
def test_a_file_that_cannot_be_written_is_one_line_and_status_2(kind, tmp_path):
    """/dev/full opens, and fails only when written: that was a traceback (status 1) for
    --json and --markdown, and nothing at all for --plot (matplotlib's PNG writer does not
    report a failed write: status 0, no plot). The other files are still written."""
    if kind == "plot" and not HAVE_MATPLOTLIB:
        pytest.skip("needs matplotlib")
    other = "markdown" if kind == "json" else "json"
    status, stdout, stderr = run_main(TINY + [f"--{kind}", "/dev/full",
                                              f"--{other}", str(tmp_path / "other")])
    assert status == 2
    assert (f"fastln bench: error: argument --{kind}: cannot write '/dev/full': "
            in stderr) and "Traceback" not in stderr
    assert (tmp_path / "other").stat().st_size > 0 and f"wrote {other} " in stdout


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="needs matplotlib")
def test_the_plot_is_written_under_the_name_given(tmp_path, capsys):
    """--plot NAME without a suffix wrote NAME.png (matplotlib's doing) and reported NAME; an
    image format matplotlib does not know failed only after the measurements."""
    status, stdout, _ = run_main(TINY + ["--plot", str(tmp_path / "speed")])
    assert status == 0 and (tmp_path / "speed").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "speed.png").exists()
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["bench", "--plot", str(tmp_path / "speed.foo")])
    assert excinfo.value.code == 2
    assert "--plot" in capsys.readouterr().err and not (tmp_path / "speed.foo").exists()
