"""Documentation and types: the doctests, docs/api.md, the type stub, mypy on a user script.

- Every docstring example and every example in docs/api.md runs (sections that need an
  optional package are skipped without it).
- docs/api.md names every public function, and every public function has a docstring with an
  Examples section, its shared paragraphs (fastln._docs) filled in.
- The stub fastln/__init__.pyi has exactly the runtime's names and signatures (parameter names,
  kinds and defaults of every overload).
- mypy accepts a user script and infers the documented types, and rejects a wrong one.
"""
import ast
import doctest
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastln
import fastln.reference

ROOT = Path(__file__).resolve().parents[1]
API_MD = ROOT / "docs" / "api.md"
STUB = Path(fastln.__file__).with_name("__init__.pyi")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _available(module):
    return importlib.util.find_spec(module) is not None


# (module, the optional packages it needs)
DOCTEST_MODULES = [
    ("fastln._row_norms", []),
    ("fastln._batch_norm", []),
    ("fastln._group_norm", []),
    ("fastln._threads", []),
    ("fastln._memory", []),
    ("fastln.torch", ["torch"]),
    ("fastln.dask", ["dask"]),
]

# Public callables of the optional modules (checked only when their package is installed).
OPTIONAL_PUBLIC = {"fastln.torch": "torch", "fastln.dask": "dask"}


def _run_doctests(test, clear_globs=True):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    runner.run(test, clear_globs=clear_globs)
    return runner.summarize(verbose=False)


@pytest.mark.parametrize("name, requires", DOCTEST_MODULES, ids=[m for m, _ in DOCTEST_MODULES])
def test_docstring_examples_run(name, requires):
    for package in requires:
        pytest.importorskip(package)
    module = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
    assert tests, f"{name} has no docstring examples"
    failed = attempted = 0
    for test in tests:
        result = _run_doctests(test)
        failed += result.failed
        attempted += result.attempted
    assert attempted > 0
    assert failed == 0, f"{failed} of {attempted} examples in {name} failed (see output)"


def _api_sections():
    """docs/api.md cut at its '## ' headings: [(title, text)]."""
    text = API_MD.read_text()
    parts = re.split(r"^## ", text, flags=re.M)
    return [(part.splitlines()[0].strip(), part) for part in parts[1:]]


SECTION_NEEDS = {"fastln.torch": "torch", "fastln.dask": "dask"}


def test_api_md_examples_run():
    """The examples of docs/api.md, in order, in one namespace (like a reader's session)."""
    parser = doctest.DocTestParser()
    globs = {}
    ran = 0
    for title, text in _api_sections():
        needs = [pkg for key, pkg in SECTION_NEEDS.items() if title.startswith(key)]
        if "import ml_dtypes" in text:
            needs.append("ml_dtypes")
        if "threadpoolctl" in text:
            needs.append("threadpoolctl")
        if not all(_available(pkg) for pkg in needs):
            # Run the section's examples up to the first that needs a missing package.
            text = text.split("With ml_dtypes:")[0].split("With threadpoolctl")[0]
            if any(key in title for key in SECTION_NEEDS):
                continue
        test = parser.get_doctest(text, globs, f"api.md: {title}", str(API_MD), 0)
        result = _run_doctests(test, clear_globs=False)
        globs = test.globs  # the DocTest ran in a copy: carry its names to the next section
        assert result.failed == 0, f"examples of section {title!r} failed (see output)"
        ran += result.attempted
    assert ran >= 40


def _public_names():
    """(qualified name, object) of everything public in fastln, fastln.torch, fastln.dask."""
    names = [(f"fastln.{n}", getattr(fastln, n)) for n in fastln.__all__ if n != "__version__"]
    for module_name, package in OPTIONAL_PUBLIC.items():
        if _available(package):
            module = importlib.import_module(module_name)
            names += [(f"{module_name}.{n}", getattr(module, n)) for n in module.__all__]
    return names


def test_api_md_covers_every_public_name():
    text = API_MD.read_text()
    missing = [name for name, _ in _public_names() if name not in text]
    assert not missing, f"docs/api.md does not mention {missing}"
    for module in ("fastln.reference", "fastln.torch", "fastln.dask"):
        assert f"## {module}" in text
    for name in fastln.reference.__all__:
        assert f"fastln.reference.{name}" in text or f"/ {name}" in text, name


def test_every_public_function_has_an_example():
    lacking = []
    for name, obj in _public_names():
        if inspect.isclass(obj) and not hasattr(obj, "forward"):  # caches: attributes only
            continue
        doc = inspect.getdoc(obj) or ""
        if name == "fastln.show_config":  # its output is the machine's: example in api.md
            continue
        if not doc or "Examples\n--------" not in doc:
            lacking.append(name)
    assert not lacking, f"no NumPy-style Examples section in the docstring of {lacking}"


def test_shared_paragraphs_are_filled_in():
    """A ``{name}`` line of fastln._docs left in a docstring is a paragraph the reader lacks."""
    unfilled = [name for name, obj in _public_names()
                if re.search(r"^ *\{\w+\}$", inspect.getdoc(obj) or "", flags=re.M)]
    assert not unfilled, f"shared docstring paragraphs left as placeholders in {unfilled}"


# ---------------------------------------------------------------------------------------------
# The stub against the runtime
# ---------------------------------------------------------------------------------------------

def _stub_tree():
    return ast.parse(STUB.read_text())


def _stub_signatures(tree):
    """{function name: [ast.arguments of each definition]} for top-level defs."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found.setdefault(node.name, []).append(node.args)
    return found


def _describe_stub(args):
    """[(name, kind, default)] like inspect's, from a stub's ast.arguments."""
    described = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(positional, defaults):
        described.append((arg.arg, "POSITIONAL_OR_KEYWORD",
                          None if default is None else ast.literal_eval(default)))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        described.append((arg.arg, "KEYWORD_ONLY",
                          None if default is None else ast.literal_eval(default)))
    return described


def _describe_runtime(func):
    described = []
    for p in inspect.signature(func).parameters.values():
        default = None if p.default is inspect.Parameter.empty else p.default
        described.append((p.name, p.kind.name, default))
    return described


def test_stub_names_match_the_runtime():
    tree = _stub_tree()
    stub_all = next(ast.literal_eval(node.value) for node in tree.body
                    if isinstance(node, ast.Assign) and node.targets[0].id == "__all__")
    assert sorted(stub_all) == sorted(fastln.__all__)
    defined = set(_stub_signatures(tree)) | {n.name for n in tree.body
                                              if isinstance(n, ast.ClassDef)}
    defined |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    assert set(fastln.__all__) <= defined


@pytest.mark.parametrize("name", [n for n in fastln.__all__
                                  if inspect.isfunction(getattr(fastln, n))
                                  or inspect.isfunction(getattr(getattr(fastln, n), "__wrapped__",
                                                                None))])
def test_stub_signatures_match_the_runtime(name):
    runtime = _describe_runtime(getattr(fastln, name))
    definitions = _stub_signatures(_stub_tree())[name]
    for args in definitions:
        assert _describe_stub(args) == runtime, f"stub of {name} differs from the runtime"


def test_stub_cache_classes_match_the_runtime():
    tree = _stub_tree()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            init = next(f for f in node.body if isinstance(f, ast.FunctionDef)
                        and f.name == "__init__")
            assert _describe_stub(init.args) == _describe_runtime(
                getattr(fastln, node.name).__init__), node.name
            annotated = {f.target.id for f in node.body if isinstance(f, ast.AnnAssign)}
            runtime = set(getattr(getattr(fastln, node.name), "__slots__", ()))
            assert runtime - {"_dtype"} <= annotated | {"dtype"}, node.name


# ---------------------------------------------------------------------------------------------
# mypy on a user's script
# ---------------------------------------------------------------------------------------------

GOOD_SCRIPT = textwrap.dedent("""
    import numpy as np
    import fastln

    x = np.ones((4, 8), np.float32)
    y = fastln.layer_norm(x, np.ones(8, np.float32), axis=-1, num_threads=2)
    reveal_type(y)
    y64 = fastln.rms_norm(np.ones((2, 3), np.int64))
    reveal_type(y64)
    y2, cache = fastln.layer_norm_forward(x)
    dx, dgamma, dbeta = fastln.layer_norm_backward(np.ones_like(y2), cache)
    reveal_type(dx)
    reveal_type(cache.rstd)
    ys, s = fastln.add_rms_norm(x, x, sum_out=x)
    reveal_type(s)
    with fastln.num_threads(2) as n:
        reveal_type(n)
    fastln.set_num_threads(fastln.get_num_threads())
""")

BAD_SCRIPT = textwrap.dedent("""
    import numpy as np
    import numpy.typing as npt
    import fastln

    fastln.layer_norm(np.ones(3), axis="last")
    fastln.set_num_threads("2")
    fastln.rms_norm(np.ones(3), eps="small")
    fastln.layer_norm_backward(np.ones(3), object())
""")


def _mypy(tmp_path, cache_dir, source):
    script = tmp_path / "user_script.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache_dir), "--no-error-summary",
         "--hide-error-context", str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "MYPYPATH"})


@pytest.fixture(scope="module")
def mypy_cache(request, tmp_path_factory):
    pytest.importorskip("mypy")
    if getattr(request.config, "cache", None) is None:  # -p no:cacheprovider
        return tmp_path_factory.mktemp("mypy-cache")
    return request.config.cache.mkdir("fastln-mypy")  # kept between runs: mypy is faster


def test_mypy_accepts_a_user_script_and_infers_dtypes(tmp_path, mypy_cache):
    done = _mypy(tmp_path, mypy_cache, GOOD_SCRIPT)
    notes = [line for line in done.stdout.splitlines() if "Revealed type" in line]
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert not errors, done.stdout
    revealed = [line.split("Revealed type is ", 1)[1] for line in notes]
    assert len(revealed) == 6, done.stdout + done.stderr
    assert "32Bit" in revealed[0] or "float32" in revealed[0], revealed[0]    # float32 kept
    assert "float64" in revealed[1], revealed[1]                              # int -> float64
    assert "32Bit" in revealed[2] or "float32" in revealed[2], revealed[2]
    assert "ndarray" in revealed[3]
    assert "32Bit" in revealed[4] or "float32" in revealed[4], revealed[4]
    assert revealed[5] in ('"builtins.int"', '"int"'), revealed[5]


def test_mypy_rejects_wrong_calls(tmp_path, mypy_cache):
    done = _mypy(tmp_path, mypy_cache, BAD_SCRIPT)
    error_lines = sorted({int(m.group(1)) for m in
                          re.finditer(r"user_script\.py:(\d+): error", done.stdout)})
    # axis="last", set_num_threads("2"), eps="small", a cache that is not one
    assert error_lines == [6, 7, 8, 9], done.stdout


# ---------------------------------------------------------------------------------------------
# The README and the guide: every Python block runs as written, in a fresh interpreter
# ---------------------------------------------------------------------------------------------

RUNNABLE_DOCS = [ROOT / "README.md", ROOT / "docs" / "guide.md"]
NEEDS_YOUR_DATA = "# needs your data"


def _python_blocks():
    blocks = []
    for path in RUNNABLE_DOCS:
        for index, match in enumerate(re.finditer(r"^```python\n(.*?)^```", path.read_text(),
                                                  flags=re.M | re.S)):
            blocks.append(pytest.param(match.group(1), id=f"{path.name}-{index}"))
    return blocks


def _imported_packages(code):
    packages = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            packages.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            packages.add(node.module.split(".")[0])
    return packages


def test_the_docs_have_python_blocks_to_run():
    assert len(_python_blocks()) >= 8


@pytest.mark.parametrize("code", _python_blocks())
def test_python_blocks_run_as_written(code, tmp_path):
    compile(code, "<block>", "exec")  # every block, those that need the reader's files too
    if NEEDS_YOUR_DATA in code:
        return
    missing = sorted(name for name in _imported_packages(code) if not _available(name))
    if missing:
        pytest.skip(f"the block imports {', '.join(missing)}, which is not installed")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                                  *sorted((ROOT / "examples").glob("*.py")),
                                  *sorted((ROOT / "src" / "fastln").rglob("*.py")),
                                  *sorted((ROOT / "src" / "fastln").rglob("*.pyx")),
                                  *sorted((ROOT / "include" / "fastln").glob("*.h")),
                                  *sorted(path for path in (ROOT / "tests").glob("*.py")
                                          if path.name != "test_docs.py")],
                         ids=lambda path: str(path.relative_to(ROOT)))
def test_no_reference_to_teaching_material_outside_the_repository(path):
    assert "lesson" not in path.read_text().lower()


def test_the_readme_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"^```bash\n(.*?)^```", text, flags=re.M | re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ['pip install ".[bench]" && fastln bench',
                        'pip install ".[test]" && python -m pytest']
