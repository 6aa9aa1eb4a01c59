#!/usr/bin/env bash
# Build a previous revision of fastln as the package `fastln_previous`, into the active Python
# environment, so that tools/compare_builds.py can hold the working tree's build against it in
# one process (bit for bit, and timed interleaved).
#
#   tools/build_previous.sh [REV]        # default: HEAD (the last commit)
#
# The revision is exported to a scratch directory (never this checkout), its package renamed
# (src/fastln -> src/fastln_previous, and every import of it), and installed with pip.
set -euo pipefail
rev="${1:-HEAD}"
here="$(cd "$(dirname "$0")/.." && pwd)"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
git -C "$here" archive "$rev" | tar -x -C "$scratch"
cd "$scratch"
mv src/fastln src/fastln_previous
find src -type f \( -name '*.py' -o -name '*.pyx' -o -name '*.pxd' -o -name '*.pyi' \) -exec sed -i -E \
    's/\bfastln\./fastln_previous./g; s/\bimport fastln\b/import fastln_previous/g; s/\bfrom fastln /from fastln_previous /g' {} +
sed -i -E 's/"fastln\._/"fastln_previous._/g; s/"fastln\.bench\._/"fastln_previous.bench._/g; s#src/fastln/#src/fastln_previous/#g; s#"src", "fastln"#"src", "fastln_previous"#' setup.py
sed -i -E 's/^name = "fastln"/name = "fastln-previous"/; s/^fastln = "fastln.cli:main"/fastln-previous = "fastln_previous.cli:main"/; s/^fastln = \[/fastln_previous = [/' pyproject.toml
pip install --quiet --no-build-isolation --no-deps .
echo "installed fastln_previous from $(git -C "$here" rev-parse --short "$rev")"
