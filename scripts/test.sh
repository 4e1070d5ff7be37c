#!/usr/bin/env bash
# Every test MoonBright has that runs without a GPU: formatting, the generated results page,
# lints, the workspace's unit, conformance, stream, fault-injection, trace and C API tests, the
# loom model checks, the CPU tests again under the thread and address sanitizers, and the Python
# package's tests. GPU tests skip with a message here; scripts/gpu-check.sh runs them on a
# machine with a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
# docs/results.md is generated from bench/results/: fail if it is stale or a folder breaks the format.
python3 bench/results.py --check
cargo clippy --workspace --all-targets -- -D warnings
# libnvrtc for the paged kernels' compile test (no GPU needed): PyPI's nvidia-cuda-nvrtc in
# target/nvrtc, pinned to the CUDA 13.0 release the H200 machine's driver runs (a newer NVRTC
# makes PTX that driver cannot load). If it cannot be installed, that test skips with a message.
ls target/nvrtc/nvidia/*/lib/libnvrtc.so* >/dev/null 2>&1 ||
  python3 -m pip install -q --target target/nvrtc "nvidia-cuda-nvrtc==13.0.88" ||
  echo "could not install nvidia-cuda-nvrtc: the NVRTC compile test will skip"
source scripts/nvrtc-env.sh
cargo test --workspace --release
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
  cargo test -p moonbright --release --lib loom_model
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
  cargo test -p moonbright --test loom --release
# The same CPU tests under ThreadSanitizer and AddressSanitizer (a pinned nightly, installed if
# missing; skipped with a message if it cannot be).
bash scripts/sanitize.sh thread address

# The Python package: build the abi3 wheel, install it into a private folder, run pytest.
python3 -m maturin --version >/dev/null 2>&1 || python3 -m pip install -q maturin
python3 -m pytest --version >/dev/null 2>&1 || python3 -m pip install -q pytest
# The paged pool's Python tests build their tables with numpy.
python3 -c "import numpy" >/dev/null 2>&1 || python3 -m pip install -q numpy
# The interposer, for the Python test that loads it (moonbright.preload).
cargo build --release -p moonbright-preload
rm -rf target/wheel target/pysite
python3 -m maturin build --release --out target/wheel
python3 -m pip install -q --no-deps --target target/pysite target/wheel/moonbright-*.whl
PYTHONPATH=target/pysite python3 -m pytest -q python/tests
