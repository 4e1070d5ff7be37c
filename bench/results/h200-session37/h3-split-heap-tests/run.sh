#!/usr/bin/env bash
# Session 37, h3: the final build after heap.rs was split into modules (code moved as it was):
# its CUDA test binaries, the stress once, and three passes of ResNet and GPT-2.
r=$OUT/r; mkdir -p $r; cp carry1/h3.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for t in "unit driver::cuda" "conformance" "faults" "capture" "growable" "streams" "paged" "ipc"; do
  set -- $t; n=$1; shift
  timeout 120 "$B/$n" "$@" --test-threads 1 >"$r/test-$n.log" 2>&1
  echo "$n rc=$? $(grep -E '^test result' "$r/test-$n.log" | tail -1 | cut -c1-60)"
done
echo "(${SECONDS}s)"
timeout 90 $B/stress --no-baseline --json $r/stress.json > $r/stress.log 2>&1
echo "stress rc=$? $(grep -E '^MoonBright  ' $r/stress.log | tr -s ' ') | $(grep -oE 'request_maps [0-9]+|request_mapped_handles [0-9]+' $r/stress.log | head -2 | tr '\n' ' ') (${SECONDS}s)"
for t in resnet gpt2; do
  n=replay_${t}_x3
  timeout 100 $B/moonbright replay --backend cuda --repeat 3 carry1/traces/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
  echo "$t rc=$? (${SECONDS}s) $(grep -A3 '^ *rep ' $r/$n.log | tail -3 | awk '{printf "[%s %s %s %s] ", $3, $6, $10, $11}')"
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g; s|/tmp/c1/bin|\$BIN|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
