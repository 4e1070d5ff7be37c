#!/usr/bin/env bash
# Builds the benchmark binaries (release) here and copies them into carry/bin (ignored by git),
# for bench/run-h200.sh on a GPU machine without a Rust toolchain. Extra arguments go to cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
cargo build --release -p moonbright-bench "$@"
mkdir -p carry/bin
for b in latency stress interference gpu_stress vaprobe hitprobe ipccost scale paged_host; do
  cp "$target/release/$b" carry/bin/
  strip "carry/bin/$b" 2>/dev/null || true
done
ls -la carry/bin
