#!/usr/bin/env bash
# The fragmentation benchmark: replays every trace in a directory through MoonBright and writes
# bench/results/traces-BACKEND/results.md and results.json, with PyTorch's recorded figures
# (default allocator and expandable segments, from traces/README.md) beside ours.
#
#   bash bench/traces.sh [TRACE_DIR (default traces)] [BACKEND (default host)] [ARGS...]
#
# On a machine without a Rust toolchain (the H200), run the carried binary directly:
#   ./moonbright bench-traces traces --backend cuda --out bench/results/traces-cuda
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-traces}"
backend="${2:-host}"
shift $(( $# > 2 ? 2 : $# ))
cargo build --release -q -p moonbright-cli
bin="${CARGO_TARGET_DIR:-target}/release/moonbright"
"$bin" bench-traces "$dir" --backend "$backend" --out "bench/results/traces-$backend" "$@"
