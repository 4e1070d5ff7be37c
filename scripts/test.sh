#!/usr/bin/env bash
# Every test MoonBright has that runs without a GPU: formatting, the generated results page,
# lints, the workspace's unit, conformance, stream, fault-injection, trace and C API tests, the
# loom model checks, the CPU tests again under the thread and address sanitizers, and the Python
# package's tests. GPU tests skip here, and are counted: the last lines this prints say how
# many Rust GPU tests skipped and why (pytest's summary, with -rs, lists the Python ones).
# scripts/gpu-check.sh runs them on a machine with a GPU, with MOONBRIGHT_REQUIRE_GPU=1, under
# which a GPU test that cannot reach a GPU fails instead.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each Rust GPU test that skips appends a line to this file (moonbright::testing explains why a
# file: the test harness hides a passing test's output).
gpu_skips=$PWD/target/gpu-skips.log
rm -f "$gpu_skips"
gpu_skip_count() { # "N Rust GPU tests skipped, not run: per binary", then each reason's count
  if [ ! -s "$gpu_skips" ]; then
    echo "0 Rust GPU tests skipped"
    return
  fi
  echo "$(wc -l <"$gpu_skips") Rust GPU tests skipped, not run:" \
    "$(cut -f1 "$gpu_skips" | sort | uniq -c | awk '{printf "%s%s %s", s, $2, $1; s=", "}')" \
    "(MOONBRIGHT_REQUIRE_GPU=1 makes them fail)"
  # Each reason's first clause (the log keeps them whole), with how many tests gave it.
  cut -f3 "$gpu_skips" | sed 's/; .*//' | cut -c1-120 | sort | uniq -c | sed 's/^ *\([0-9]*\) /  \1 x /'
}

cargo fmt --all -- --check
# docs/results.md is generated from bench/results/: fail if it is stale or a folder breaks the format.
python3 bench/results.py --check
# No two modules of a crate import each other, directly or around a cycle.
python3 scripts/check-modules.py --quiet
cargo clippy --workspace --all-targets -- -D warnings
# libnvrtc for the paged kernels' compile test (no GPU needed): PyPI's nvidia-cuda-nvrtc in
# target/nvrtc, pinned to the CUDA 13.0 release the H200 machine's driver runs (a newer NVRTC
# makes PTX that driver cannot load). If it cannot be installed, that test skips with a message.
ls target/nvrtc/nvidia/*/lib/libnvrtc.so* >/dev/null 2>&1 ||
  python3 -m pip install -q --target target/nvrtc "nvidia-cuda-nvrtc==13.0.88" ||
  echo "could not install nvidia-cuda-nvrtc: the NVRTC compile test will skip"
source scripts/nvrtc-env.sh
MOONBRIGHT_GPU_SKIP_LOG="$gpu_skips" cargo test --workspace --release
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
  cargo test -p moonbright --release --lib loom_model
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
  cargo test -p moonbright --test loom --release
# The same CPU tests under ThreadSanitizer and AddressSanitizer (a pinned nightly, installed if
# missing; skipped with a message if it cannot be).
bash scripts/sanitize.sh thread address

# The Python package as a user gets it: build the abi3 wheel, install it with its test extra
# into a fresh virtual environment, and run the CPU tests from a copy of python/tests outside the
# repository, so that nothing of the repository is on the path but the installed package.
python3 -m maturin --version >/dev/null 2>&1 || python3 -m pip install -q maturin
# The interposer, for the Python test that loads it (moonbright.preload).
cargo build --release -p moonbright-preload
rm -rf target/wheel
python3 -m maturin build --release --out target/wheel
repo=$PWD
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python3 -m venv "$scratch/venv"
"$scratch/venv/bin/python" -m pip install -q "$(ls target/wheel/moonbright-*.whl)[test]"
# pip installed the command too.
"$scratch/venv/bin/moonbright" --help >/dev/null
cp -r python/tests "$scratch/tests"
cd "$scratch"
"$scratch/venv/bin/python" -c 'import moonbright, sys
assert moonbright.__file__.startswith(sys.prefix), moonbright.__file__'
MOONBRIGHT_PRELOAD_LIB="$repo/target/release/libmoonbright_preload.so" \
  MOONBRIGHT_TEST_NVRTC_SITE="$repo/target/nvrtc" MOONBRIGHT_TEST_REPO="$repo" \
  "$scratch/venv/bin/python" -m pytest -q -rs -p no:cacheprovider --rootdir "$scratch/tests" tests
cd "$repo"
gpu_skip_count
