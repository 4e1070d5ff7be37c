#!/usr/bin/env bash
# Every test MoonBright has that runs without a GPU: formatting, lints, the workspace's unit,
# conformance, fault-injection and C API tests, and the loom model checks. GPU tests skip with a
# message here; scripts/gpu-check.sh runs them on a machine with a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --release
RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
  cargo test -p moonbright --test loom --release
