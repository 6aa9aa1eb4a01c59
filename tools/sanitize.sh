#!/usr/bin/env bash
# Build fastln with AddressSanitizer and UndefinedBehaviorSanitizer in a scratch copy of this
# tree and run the test suite against that build. The checkout's own build is never touched.
#
#   tools/sanitize.sh [pytest arguments...]
#
# Without arguments it runs the default suite (-m "not slow"). Examples:
#   tools/sanitize.sh tests/test_hostile_inputs.py -x     # one file, stop at the first failure
#   FASTLN_SANITIZE_DIR=/tmp/asan tools/sanitize.sh       # keep the copy somewhere else
#   FASTLN_SANITIZE_KEEP=1 tools/sanitize.sh              # keep the copy and the logs afterwards
#
# How it works (see tools/README.md):
# - the tree (working copy, uncommitted files included; no build products) is copied to
#   $FASTLN_SANITIZE_DIR (default: a fresh directory under /tmp);
# - `python setup.py build_ext --inplace` builds the extensions there with the project's own
#   flags plus FASTLN_EXTRA_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all
#   -fno-omit-frame-pointer -g" (setup.py appends FASTLN_EXTRA_CFLAGS/LDFLAGS);
# - Python itself is not instrumented, so the ASan runtime is loaded first with LD_PRELOAD
#   (with libstdc++, for C++ extensions such as matplotlib's); leak detection is off (CPython
#   keeps memory until exit on purpose);
# - every sanitizer report, from the test process or any child it starts, is written to a
#   log file (ASAN_OPTIONS/UBSAN_OPTIONS log_path), and the script fails if there is one.
#
# Exit status: 0 when the tests pass and no sanitizer reported anything; 1 when tests failed
# but no sanitizer reported anything; 2 when a sanitizer reported an error (or the run
# crashed); 3 when the build failed.
set -uo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="${FASTLN_SANITIZE_DIR:-$(mktemp -d /tmp/fastln-sanitize.XXXXXX)}"
if [[ -z "${FASTLN_SANITIZE_KEEP:-}" && -z "${FASTLN_SANITIZE_DIR:-}" ]]; then
    trap 'rm -rf "$work"' EXIT
fi

libasan="$(gcc -print-file-name=libasan.so)"
libubsan="$(gcc -print-file-name=libubsan.so)"
# libstdc++ is preloaded too: ASan intercepts __cxa_throw when it starts, and a C++ extension
# loaded later (matplotlib's, in the benchmark tests) would otherwise abort on its first throw.
libstdcxx="$(gcc -print-file-name=libstdc++.so.6)"
if [[ ! -e "$libasan" || ! -e "$libubsan" ]]; then
    echo "sanitize.sh: gcc's libasan/libubsan not found (install gcc with sanitizer support)" >&2
    exit 3
fi

echo "== copying $repo to $work/fastln"
mkdir -p "$work/fastln" "$work/logs"
rm -f "$work"/logs/*
(cd "$repo" && tar --exclude=./.git --exclude=./build --exclude='*.so' \
    --exclude='./src/fastln/_*.c' --exclude='__pycache__' --exclude='.pytest_cache' \
    --exclude='*.egg-info' -cf - .) | (cd "$work/fastln" && tar -xf -)

echo "== building with -fsanitize=address,undefined"
(
    cd "$work/fastln" &&
    FASTLN_EXTRA_CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g" \
    FASTLN_EXTRA_LDFLAGS="-fsanitize=address,undefined" \
    "$python" setup.py build_ext --inplace --build-temp "$work/build" > "$work/build.log" 2>&1
) || { tail -50 "$work/build.log"; echo "sanitize.sh: build failed (log: $work/build.log)" >&2; exit 3; }
grep -E "warning:" "$work/build.log" | grep -v "^/.*\.c:.*(Cython|__pyx)" | sort -u | head -20

export PYTHONPATH="$work/fastln/src"
export LD_PRELOAD="$libasan $libstdcxx"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$work/logs/asan:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$work/logs/ubsan"

echo "== checking that the sanitized build is the one imported"
"$python" - <<'EOF' || exit 3
import os, subprocess, fastln, fastln._kernels as k, fastln._output_cache as f
root = os.environ["PYTHONPATH"]
for module in (fastln, k, f):
    assert module.__file__.startswith(root), (module.__file__, root)
    if module.__file__.endswith(".so"):
        linked = subprocess.run(["ldd", module.__file__], capture_output=True, text=True).stdout
        assert "libasan" in linked and "libubsan" in linked, linked
print("fastln from", os.path.dirname(fastln.__file__), "- ASan and UBSan linked")
EOF

if [[ $# -eq 0 ]]; then
    set -- -m "not slow"
fi
echo "== running: python -m pytest $*"
cd "$work/fastln"
"$python" -m pytest -q "$@" 2>&1 | tee "$work/pytest.log"
status=${PIPESTATUS[0]}

reports=$(find "$work/logs" -type f | wc -l)
echo "== pytest exit status $status; sanitizer reports: $reports"
if [[ $reports -gt 0 ]]; then
    for log in "$work"/logs/*; do
        echo "---- $log"
        grep -E "ERROR: AddressSanitizer|runtime error|SUMMARY" "$log" | head -5
        grep -E "^    #[0-9]+ .* in " "$log" | head -12
    done
    echo "sanitize.sh: the sanitizers reported errors (logs in $work/logs)" >&2
    trap - EXIT
    exit 2
fi
if [[ $status -ne 0 && $status -ne 1 ]]; then
    echo "sanitize.sh: pytest ended abnormally (status $status)" >&2
    exit 2
fi
if [[ $status -eq 1 ]]; then
    echo "sanitize.sh: no sanitizer reports; some tests failed (see above)"
    exit 1
fi
echo "sanitize.sh: clean - all tests passed, no sanitizer reports"
exit 0
