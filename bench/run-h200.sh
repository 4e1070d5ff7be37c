#!/usr/bin/env bash
# Runs the allocator benchmarks on a GPU machine without a Rust toolchain, from binaries built
# elsewhere by bench/pack.sh into carry/bin. Everything lands under ${OUT:-bench-out}: one log and
# one JSON per program, the stress's operation sequence, and the PNGs of bench/plot.py.
#
#   bash bench/run-h200.sh                  # everything (about 1-3 minutes on an H200)
#   bash bench/run-h200.sh latency stress   # only these steps
#   QUICK=1 bash bench/run-h200.sh          # smoke test: fewer repetitions everywhere
#
# Steps: stress torch_stress latency torch_latency interference gpu_stress sanitizer plot
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
bin=${BIN:-carry/bin}
py=${PYTHON:-python3}
mkdir -p "$out"
# Fail closed (as scripts/gpu-check.sh): a check that cannot run here (the memcheck step without
# compute-sanitizer) is a failure, not a skip; MOONBRIGHT_REQUIRE_GPU=0 makes it a skip again.
export MOONBRIGHT_REQUIRE_GPU=${MOONBRIGHT_REQUIRE_GPU:-1}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(stress torch_stress latency torch_latency interference gpu_stress sanitizer plot)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
quick=${QUICK:-}
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

# scripts/nvrtc-env.sh finds a libnvrtc and names it in MOONBRIGHT_NVRTC.
export PYTHON=$py
source scripts/nvrtc-env.sh >"$out/nvrtc.txt"
tee -a "$out/gpu.txt" <"$out/nvrtc.txt"

run() { # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local t0=$SECONDS
  if timeout "$limit" "$@" >"$out/$name.log" 2>&1; then
    echo "   ok ($((SECONDS - t0)) s)"
  else
    echo "   FAILED (status $?, $((SECONDS - t0)) s)"; status=1
  fi
  tail -n 4 "$out/$name.log" | sed 's/^/   /'
}

if want stress; then
  run stress 150 "$bin/stress" --dump-ops "$out/stress_ops.csv" --run --json "$out/stress.json"
fi
if want torch_stress; then
  [ -f "$out/stress_ops.csv" ] || "$bin/stress" --dump-ops "$out/stress_ops.csv"
  for conf in default expandable_segments:True backend:cudaMallocAsync; do
    tag=${conf%%:*}
    if [ "$conf" = default ]; then
      run "torch_stress_$tag" 120 env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF \
        "$py" bench/torch_stress.py --ops "$out/stress_ops.csv" --json "$out/torch_stress_$tag.json"
    else
      run "torch_stress_$tag" 120 env -u PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF="$conf" \
        "$py" bench/torch_stress.py --ops "$out/stress_ops.csv" --json "$out/torch_stress_$tag.json"
    fi
  done
fi
if want latency; then
  run latency 240 "$bin/latency" ${quick:+--quick} --json "$out/latency.json"
fi
if want torch_latency; then
  run torch_latency 60 env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF \
    "$py" bench/torch_latency.py ${quick:+--quick} --json "$out/torch_latency.json"
fi
if want interference; then
  if [ -n "$quick" ]; then
    run interference 120 "$bin/interference" --gather-reps 20 --copy-reps 40 --json "$out/interference.json"
  else
    run interference 150 "$bin/interference" --json "$out/interference.json"
  fi
fi
if want gpu_stress; then
  ops=3000; [ -n "$quick" ] && ops=500
  run gpu_stress 120 "$bin/gpu_stress" --threads 4 --ops "$ops" --json "$out/gpu_stress.json"
fi
if want sanitizer; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$cs" ]; then
    run gpu_stress_memcheck 180 "$cs" --tool memcheck --error-exitcode 3 \
      "$bin/gpu_stress" --threads 3 --ops 300 --max-mib 16 --live-gib 1 --cap-gib 8
  elif [ "$MOONBRIGHT_REQUIRE_GPU" = 0 ]; then
    echo "== gpu_stress_memcheck: skipped (compute-sanitizer not found)" | tee "$out/gpu_stress_memcheck.log"
  else
    echo "== gpu_stress_memcheck: FAILED (compute-sanitizer not found; MOONBRIGHT_REQUIRE_GPU is set)" |
      tee "$out/gpu_stress_memcheck.log"
    status=1
  fi
fi
if want plot; then
  files=()
  for f in latency torch_latency stress torch_stress_default torch_stress_expandable_segments \
           torch_stress_backend interference; do
    [ -f "$out/$f.json" ] && files+=("$out/$f.json")
  done
  [ ${#files[@]} -gt 0 ] && run plot 60 "$py" bench/plot.py --out "$out" "${files[@]}"
fi
for f in stress latency interference; do
  [ -f "$out/$f.log" ] && { echo; echo "---- $f"; cat "$out/$f.log"; }
done
exit $status
