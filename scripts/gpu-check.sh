#!/usr/bin/env bash
# The GPU checks, on a machine with a GPU and no Rust toolchain, from what scripts/pack-gpu.sh
# put in carry/. Logs go under ${OUT:-gpu-out}/check and are packed into check.tgz.
#   bash scripts/gpu-check.sh            # everything
#   bash scripts/gpu-check.sh rust py    # some groups: rust, demo, replay, stress, py, dist, paged, hf
# (hf: only the Hugging Face GrowableCache GPU test, which py runs too; it needs transformers;
# dist: torch.distributed and NCCL, one process per GPU, which py leaves out)
set -uo pipefail
cd "$(dirname "$0")/.."
# Fail closed: a GPU test that cannot reach the GPU (no driver, a broken probe, no PyTorch or
# CUDA in Python, no libnvrtc, no interposer library) fails here rather than skip as a pass
# (moonbright::testing for Rust, python/tests/gpu/conftest.py for Python). The Rust GPU tests of
# one binary also run one at a time whatever --test-threads says (a global-mode graph capture is
# invalidated by another test's synchronous calls): moonbright::testing::gpu() holds a lock.
export MOONBRIGHT_REQUIRE_GPU=1
# The interposer the Python GPU tests of LD_PRELOAD load (they look in target/release otherwise).
export MOONBRIGHT_PRELOAD_LIB=${MOONBRIGHT_PRELOAD_LIB:-$PWD/carry/lib/libmoonbright_preload.so}
out=${OUT:-gpu-out}/check
mkdir -p "$out"
bin=carry/bin
groups=("$@")
[ ${#groups[@]} -eq 0 ] && groups=(rust demo replay stress py dist paged)
want() { local g; for g in "${groups[@]}"; do [ "$g" = "$1" ] && return 0; done; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# The paged pool compiles its kernels with NVRTC at run time.
source scripts/nvrtc-env.sh >"$out/nvrtc.txt"
tee -a "$out/gpu.txt" <"$out/nvrtc.txt"
status=0
run() { # name, timeout, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  if timeout "$limit" "$@" >"$out/$name.log" 2>&1; then
    echo "== $name: ok ($((SECONDS - t0)) s)"
  else
    echo "== $name: FAILED (status $?, $((SECONDS - t0)) s)"; status=1
  fi
  grep -E "test result|result:|MoonBright reserved|alloc latency|PASSED|passed|failed|skipping|matched" "$out/$name.log" | tail -n 4 | sed 's/^/   /'
}
if want rust; then
  run unit-cuda 120 "$bin/unit" driver::cuda --test-threads 1
  run conformance-cuda 300 "$bin/conformance" cuda --test-threads 1  # every CUDA configuration
  run capture-cuda 60 "$bin/capture" --nocapture
  run growable-cuda 120 "$bin/growable" cuda_ --test-threads 1
fi
if want demo; then
  run demo-cuda 120 "$bin/moonbright" demo --backend cuda --cap-mib 16384 --block-mib 64
fi
if want replay; then
  for t in llama gpt2 resnet; do
    run "replay-$t" 200 "$bin/moonbright" replay --backend cuda "traces/trace_$t.csv.gz" \
      --json "$out/replay-$t.json"
  done
fi
if want stress; then
  BIN=$bin OUT=$out bash bench/run-h200.sh gpu_stress sanitizer >"$out/bench-steps.log" 2>&1 \
    || status=1
  grep -E "^==|FAILED|PASSED" "$out/bench-steps.log" | head
fi
if want py; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site carry/wheel/moonbright-*.whl
  run python-gpu 600 env PYTHONPATH=/tmp/site python3 -m pytest -x -q -rs python/tests/gpu \
    --ignore=python/tests/gpu/test_distributed_gpu.py
fi
if want dist; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site carry/wheel/moonbright-*.whl
  run python-dist 400 env PYTHONPATH=/tmp/site python3 -m pytest -x -q -rs \
    python/tests/gpu/test_distributed_gpu.py
fi
if want hf; then
  site=${SITE:-$(mktemp -d)}
  python3 -m pip install -q --no-index --no-deps --target "$site" carry/wheel/moonbright-*.whl
  run python-gpu-hf 400 env PYTHONPATH="$site" python3 -m pytest -x -q -rs \
    python/tests/gpu/test_transformers_gpu.py
fi
if want paged; then
  run paged-nvrtc 60 "$bin/paged-unit" --nocapture
  run paged-cuda 300 "$bin/paged" --test-threads 1 --nocapture
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site carry/wheel/moonbright-*.whl
  run python-paged 300 env PYTHONPATH=/tmp/site python3 -m pytest -x -q -rs -s \
    python/tests/gpu/test_paged_attention_gpu.py
fi
tar czf "${OUT:-gpu-out}/check.tgz" -C "$out" .
exit $status
