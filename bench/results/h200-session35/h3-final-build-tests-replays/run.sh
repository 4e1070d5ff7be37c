#!/usr/bin/env bash
# Session 35, h3: the final build (1e036f3: the repeated-size lookup moved off the hit path,
# the tests that carve at 1.0 put every size under `carve`): the CUDA test binaries touched,
# and three passes of each trace, one round.
r=$OUT/r; mkdir -p $r; cp carry1/h3.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for t in "unit driver::cuda" "conformance" "faults" "streams" "capture" "growable"; do
  set -- $t; n=$1; shift
  timeout 150 "$B/$n" "$@" --test-threads 1 >"$r/test-$n.log" 2>&1
  echo "$n rc=$? $(grep -E '^test result' "$r/test-$n.log" | tail -1 | cut -c1-60) (${SECONDS}s)"
done
for t in resnet gpt2 llama; do
  n=replay_${t}_x3
  timeout 60 $B/moonbright replay --backend cuda --repeat 3 carry1/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
  echo "$t rc=$? (${SECONDS}s) $(grep -A3 '^ *rep ' $r/$n.log | tail -3 | awk '{printf "[%s %s %s %s] ", $3, $6, $10, $11}')"
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g; s|/tmp/c1/bin|\$BIN|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
