"""fastln.show_config(): version, OpenMP on/off, default thread count, compiler flags."""
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import fastln


def _config_text(**kwargs):
    buf = io.StringIO()
    result = fastln.show_config(file=buf, **kwargs)
    assert result is None
    return buf.getvalue()


def _field(text, label):
    """The value after `label:` on its line (case-insensitive)."""
    match = re.search(rf"^\s*{label}\s*:\s*(.*)$", text, flags=re.IGNORECASE | re.MULTILINE)
    assert match, f"no {label!r} line in:\n{text}"
    return match.group(1).strip()


def test_show_config_prints_to_stdout(capsys):
    fastln.show_config()
    printed = capsys.readouterr().out
    assert printed.strip()
    assert printed == _config_text()


def test_version_is_printed():
    text = _config_text()
    assert isinstance(fastln.__version__, str) and re.match(r"^\d+\.\d+", fastln.__version__)
    assert fastln.__version__ in text.splitlines()[0]
    assert np.__version__ in text


def test_openmp_and_thread_count_fields():
    text = _config_text()
    openmp = _field(text, "OpenMP").lower()
    assert openmp.startswith("on") or openmp.startswith("off"), openmp
    threads = int(_field(text, "default num_threads"))
    assert threads >= 1
    if openmp.startswith("off"):
        assert threads == 1


def test_compile_flags_are_printed():
    text = _config_text()
    compile_args = _field(text, "compile args")
    assert compile_args and compile_args != "unknown"
    assert re.search(r"-O\d|/O\d", compile_args), compile_args
    # the default build is portable: no -march=native
    assert "-march=native" not in text and "-mcpu=native" not in text
    if _field(text, "OpenMP").lower().startswith("on"):
        assert "openmp" in compile_args.lower(), compile_args
        assert "openmp" in _field(text, "link args").lower()


def _run_show_config(env_update):
    env = dict(os.environ)
    env.update(env_update)
    result = subprocess.run(
        [sys.executable, "-c", "import fastln; fastln.show_config()"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("n", [1, 3])
def test_default_thread_count_follows_omp_num_threads(n):
    text = _run_show_config({"OMP_NUM_THREADS": str(n)})
    if _field(text, "OpenMP").lower().startswith("off"):
        assert int(_field(text, "default num_threads")) == 1
    else:
        assert int(_field(text, "default num_threads")) == n


def test_num_threads_none_is_the_default_team():
    """num_threads=None (the default team) gives the same bits as any explicit count."""
    x = np.random.default_rng(0).standard_normal((300, 300))
    threads = int(_field(_config_text(), "default num_threads"))
    np.testing.assert_array_equal(fastln.layer_norm(x), fastln.layer_norm(x, num_threads=threads))
