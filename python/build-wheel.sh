#!/usr/bin/env bash
# Builds the abi3 wheel (one wheel for CPython 3.11 and later) into dist/, for carrying to the
# GPU machine: there, `pip install dist/moonbright-*.whl` and
# `python3 -m pytest python/tests/gpu -x -q`.
set -euo pipefail
cd "$(dirname "$0")/.."
maturin build --release --out dist "$@"
ls -l dist/moonbright-*.whl
