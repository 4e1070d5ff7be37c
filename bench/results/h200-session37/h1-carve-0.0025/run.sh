#!/usr/bin/env bash
# Session 37, h1: carve 0.0025 by default (was 0.005). The CUDA test binaries of this build;
# then the stress under carve:0.005 (the old default) and the new default, interleaved, three
# rounds, at the benchmark's seed and at seed 4 (which held 1.049-1.057 on the host backend
# with 0.005); then three passes of each trace under both, one round.
r=$OUT/r; mkdir -p $r; cp carry1/h1.sh $r/run.sh
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
for round in 1 2 3; do
  for seed in 20261129 4; do
    for c in carve:0.005 default; do
      conf=$c; [ $c = default ] && conf=""
      n=stress_${c/:/}_seed${seed}_$round
      MOONBRIGHT_ALLOC_CONF="$conf" timeout 90 $B/stress --no-baseline --seed $seed --json $r/$n.json > $r/$n.log 2>&1
      echo "stress $c seed $seed r$round rc=$? $(grep -E '^MoonBright  ' $r/$n.log | tr -s ' ') | $(grep -oE 'request_maps [0-9]+|request_mapped_handles [0-9]+' $r/$n.log | head -2 | tr '\n' ' ') (${SECONDS}s)"
    done
  done
done
for t in resnet gpt2 llama; do
  for c in carve:0.005 default; do
    conf=$c; [ $c = default ] && conf=""
    n=replay_${t}_${c/:/}_x3
    timeout 100 $B/moonbright replay --backend cuda --conf "$conf" --repeat 3 carry1/traces/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
    echo "$t $c rc=$? (${SECONDS}s) $(grep -A3 '^ *rep ' $r/$n.log | tail -3 | awk '{printf "[%s %s %s %s] ", $3, $6, $10, $11}')"
  done
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
