#!/usr/bin/env bash
# Builds the release test binaries and the command here and copies them into carry/bin (ignored
# by git) for scripts/gpu-check.sh on a GPU machine without a Rust toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p carry/bin
cargo build --release -p moonbright-cli
cp target/release/moonbright carry/bin/
cargo test --release -p moonbright --no-run --message-format=json 2>/dev/null | python3 -c '
import sys, json, shutil
names = {"moonbright": "unit", "conformance": "conformance", "faults": "faults"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in names:
        shutil.copy(m["executable"], "carry/bin/" + names[m["target"]["name"]])
'
strip carry/bin/* 2>/dev/null || true
ls -la carry/bin
