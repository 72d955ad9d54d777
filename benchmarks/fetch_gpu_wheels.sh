#!/usr/bin/env bash
# Fetch benchmarks/gpu_wheels.txt into .whl/ for the lent GPU machine (Python 3.12, x86-64), here where pip has the
# network; .whl/ is git-ignored locally and carried with run(carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform any)
grep -v '^#' benchmarks/gpu_wheels.txt | grep -v antlr4 | while read -r wheel; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d .whl "$wheel"
done
python3 -m pip wheel -q --no-deps -w .whl "$(grep '^antlr4' benchmarks/gpu_wheels.txt)"   # an sdist: built here
ls .whl
