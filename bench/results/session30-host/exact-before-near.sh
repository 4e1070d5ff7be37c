#!/bin/bash
# Exact runs before near fits (session 30), host backend: the recorded traces replayed
# deterministically (no background worker) and with the worker, and the fragmentation stress
# over three seeds, by two builds side by side.
#   bash exact-before-near.sh BASE_DIR NEW_DIR   (each holding `moonbright` and `stress`)
set -eu
base=$1 new=$2 traces=${TRACES:-../shared/traces}
fig() { grep -E "MoonBright reserved|^driver calls|^alloc latency|^cache hits"; }
for t in resnet gpt2 llama; do
  for b in base new; do
    dir=$base; [ $b = new ] && dir=$new
    echo "== $t, $b, background:false"
    "$dir/moonbright" replay --backend host --conf background:false "$traces/trace_$t.csv.gz" 2>&1 | fig
  done
done
for t in resnet gpt2; do
  for r in 1 2 3; do
    for b in base new; do
      dir=$base; [ $b = new ] && dir=$new
      echo "== $t, $b, with the worker, round $r"
      "$dir/moonbright" replay --backend host "$traces/trace_$t.csv.gz" 2>&1 | fig
    done
  done
done
for s in 1 2 3; do
  for b in base new; do
    dir=$base; [ $b = new ] && dir=$new
    echo "== stress seed $s, $b"
    "$dir/stress" --host --no-baseline --seed "$s" 2>&1 | grep -E "^allocator|^MoonBright|request_maps"
  done
done
