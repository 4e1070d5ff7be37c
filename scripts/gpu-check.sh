#!/usr/bin/env bash
# Runs the GPU checks on a machine with a GPU and no Rust toolchain, from binaries built
# elsewhere with scripts/pack-gpu.sh into carry/bin. Writes logs under ${OUT:-gpu-out}.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
bin=carry/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
status=0
run() { # name, command...
  local name=$1; shift
  echo "== $name"
  if "$@" >"$out/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED"; status=1; fi
  tail -n 3 "$out/$name.log"
}
run unit-cuda "$bin/unit" driver::cuda --test-threads 1 --nocapture
run conformance-cuda "$bin/conformance" cuda:: --test-threads 1 --nocapture
run conformance-host "$bin/conformance" host::
run demo-cuda "$bin/moonbright" demo --backend cuda --cap-mib 16384 --block-mib 64
run demo-host "$bin/moonbright" demo --backend host
cat "$out/demo-cuda.log"
exit $status
