#!/usr/bin/env bash
# Runs bench/hf_capacity.py on one H200: the four allocator configurations (PyTorch
# default, expandable segments, MoonBright with DynamicCache, MoonBright with GrowableCache) x
# {256, 1024} new tokens, each in its own process, under a 12 GiB cap. Logs and JSON land under
# ${OUT:-bench-out}/hf, with the plots of bench/hf_plot.py and summary.txt.
#
#   bash bench/hf-h200.sh             # everything (about 25 minutes: split it, see below)
#   bash bench/hf-h200.sh 256         # only the 256-token runs (about 6 minutes)
#   bash bench/hf-h200.sh 1024        # only the 1024-token runs (starts from the 256 results if there,
#                                     # or START_default=.. START_expandable=.. etc.)
#   QUICK=1 bash bench/hf-h200.sh     # at most 3 trials a configuration, resolution 8
#   ALLOCS="growable moonbright" bash bench/hf-h200.sh 256
#   ATTN=gqa ALLOCS=growable bash bench/hf-h200.sh 256   # with moonbright.transformers.gqa_attention
#
# Budgets (seconds per process, model load included): BUDGET_256 (110), BUDGET_1024 (300); a first
# trial always runs. The moonbright wheel comes from carry/wheel (scripts/pack-gpu.sh) unless
# moonbright is importable already. Needs torch and transformers on the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}/hf
py=${PYTHON:-python3}
mkdir -p "$out"
lens=("$@")
[ ${#lens[@]} -eq 0 ] && lens=(256 1024)
allocs=(${ALLOCS:-default expandable moonbright growable})
quick=${QUICK:+--quick}
status=0

if ! "$py" -c "import moonbright" 2>/dev/null; then
  site=${SITE:-$(mktemp -d)}
  "$py" -m pip install -q --no-index --no-deps --target "$site" carry/wheel/moonbright-*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# First batch of a run: START_<alloc> if set (START_growable=80); for a 1024-token run, else 3/4
# of the same configuration's 256-token result in this output folder, if any.
start_for() { # alloc
  local var="START_$1"
  [ -n "${!var:-}" ] && { echo "${!var}"; return; }
  "$py" - "$out/hf_$1${ATTN:+_$ATTN}_256.json" <<'PY' 2>/dev/null
import json, sys
best = json.load(open(sys.argv[1]))["best"]
print(max(4, best["batch"] * 3 // 4 // 4 * 4))
PY
}

for n in "${lens[@]}"; do
  budget=${BUDGET_256:-110}; [ "$n" -ge 1024 ] && budget=${BUDGET_1024:-300}
  for a in "${allocs[@]}"; do
    name="hf_${a}${ATTN:+_$ATTN}_${n}"
    start=()
    var="START_$a"
    if [ "$n" != 256 ] || [ -n "${!var:-}" ]; then s=$(start_for "$a"); [ -n "$s" ] && start=(--start "$s"); fi
    echo "== $name (budget ${budget} s${start:+, start ${start[1]}})"
    t0=$SECONDS
    # The hard limit leaves room for one trial begun just inside the budget.
    if timeout $((budget + 120)) "$py" bench/hf_capacity.py --alloc "$a" --new-tokens "$n" \
        ${ATTN:+--attn "$ATTN"} --time-budget "$budget" $quick "${start[@]}" --out "$out/$name.json" >"$out/$name.log" 2>&1; then
      echo "   ok ($((SECONDS - t0)) s)"
    else
      echo "   FAILED (status $?, $((SECONDS - t0)) s)"; status=1
    fi
    grep -E "^RESULT|^moonbright stats" "$out/$name.log" | sed 's/^/   /'
    [ -s "$out/$name.log" ] && ! grep -q "^RESULT" "$out/$name.log" && tail -n 5 "$out/$name.log" | sed 's/^/   /'
  done
done
"$py" bench/hf_plot.py --out "$out" "$out"/hf_*.json | tee "$out/summary.txt" || status=1
exit $status
