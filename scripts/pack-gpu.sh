#!/usr/bin/env bash
# Builds everything the GPU machine (no Rust toolchain, no network) runs, and copies it into
# carry/ (ignored by git): the release test binaries of the core and of the paged pool
# (moonbright-paged's unit tests as paged-unit, its integration tests as paged) and the
# `moonbright` command (carry/bin),
# the benchmark binaries (bench/pack.sh), the LD_PRELOAD interposer (carry/lib), and the abi3
# wheel (carry/wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p carry/bin carry/lib carry/wheel
cargo build --release -p moonbright-cli -p moonbright-preload
cp target/release/moonbright carry/bin/
cp target/release/libmoonbright_preload.so carry/lib/
cargo test --release -p moonbright -p moonbright-paged --no-run --message-format=json 2>/dev/null | python3 -c '
import sys, json, shutil
names = {"moonbright": "unit", "conformance": "conformance", "faults": "faults", "streams": "streams",
         "capture": "capture", "growable": "growable", "ipc": "ipc",
         "moonbright_paged": "paged-unit", "paged": "paged"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in names:
        shutil.copy(m["executable"], "carry/bin/" + names[m["target"]["name"]])
'
bash bench/pack.sh >/dev/null
rm -f carry/wheel/*.whl
python3 -m maturin build --release --out carry/wheel >/dev/null
strip carry/bin/* 2>/dev/null || true
strip --strip-unneeded carry/lib/*.so 2>/dev/null || true
du -sh carry; ls carry/bin carry/lib carry/wheel
