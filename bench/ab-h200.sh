#!/usr/bin/env bash
# A/B runs of two or more builds on one GPU machine, interleaved round by round so that a slow
# spell of the machine falls on every build: the recorded traces (`moonbright replay`) and the
# fragmentation stress. Builds are named by a suffix of the binaries in $BIN: "" is
# `moonbright` and `stress`, "-base" is `moonbright-base` and `stress-base` (copy an older
# build's binaries there under that name). Everything lands under ${OUT:-ab-out}; a summary line
# per run goes to stdout.
#
#   BIN=carry/bin OUT=$OUT/r bash bench/ab-h200.sh -base ""        # the defaults below
#   ROUNDS=2 TRACES="resnet" STRESS_ROUNDS=0 bash bench/ab-h200.sh -base ""
#   BACKEND=host TRACE_DIR=traces bash bench/ab-h200.sh "" # a dry run without a GPU
#
# ROUNDS (4) rounds of the traces in TRACES ("resnet gpt2", files trace_NAME.csv.gz in
# TRACE_DIR, default carry/), STRESS_ROUNDS (3) rounds of the stress; TESTS=1 first runs the
# CUDA test binaries of scripts/pack-gpu.sh found in $BIN (the suffix-less build's).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-carry/bin}
out=${OUT:-ab-out}
backend=${BACKEND:-cuda}
trace_dir=${TRACE_DIR:-carry}
mkdir -p "$out"
[ $# -ge 1 ] || { echo "usage: bench/ab-h200.sh SUFFIX [SUFFIX...]  (\"\" for the plain names)" >&2; exit 2; }
builds=("$@")
[ "$backend" = cuda ] && source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0

if [ "${TESTS:-0}" = 1 ]; then
  for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" \
           "streams" "paged" "ipc"; do
    set -- $t; n=$1; shift
    [ -x "$bin/$n" ] || { echo "$n: not in $bin"; continue; }
    timeout 120 "$bin/$n" "$@" --test-threads 1 >"$out/test-$n.log" 2>&1
    echo "$n rc=$? $(grep -E '^test result' "$out/test-$n.log" | tail -1 | cut -c1-60)"
  done
  echo "(${SECONDS}s)"
fi

for round in $(seq 1 "${ROUNDS:-4}"); do
  for t in ${TRACES:-resnet gpt2}; do
    for b in "${builds[@]}"; do
      name=replay_${t}_moonbright${b}_$round
      timeout 120 "$bin/moonbright$b" replay --backend "$backend" "$trace_dir/trace_$t.csv.gz" \
        --json "$out/$name.json" >"$out/$name.log" 2>&1
      echo "$round $t moonbright$b rc=$? $(grep -E 'MoonBright reserved' "$out/$name.log" | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' "$out/$name.log" | cut -c16-)"
    done
  done
done
[ "${ROUNDS:-4}" -gt 0 ] && echo "(${SECONDS}s)"

host=(); [ "$backend" = host ] && host=(--host)
for round in $(seq 1 "${STRESS_ROUNDS:-3}"); do
  for b in "${builds[@]}"; do
    name=stress_stress${b}_$round
    timeout 150 "$bin/stress$b" --no-baseline "${host[@]}" --json "$out/$name.json" >"$out/$name.log" 2>&1
    echo "$round stress$b rc=$? $(grep -E '^MoonBright  ' "$out/$name.log" | tr -s ' ')"
  done
done
[ "${STRESS_ROUNDS:-3}" -gt 0 ] && echo "(${SECONDS}s)"
exit 0
