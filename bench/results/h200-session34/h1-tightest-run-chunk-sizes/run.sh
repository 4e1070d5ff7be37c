#!/usr/bin/env bash
# Session 34, h1: carving's tightest run (1575a45) over repeated passes of the recorded traces
# and the fragmentation stress, at the default chunks (64 MiB) and with smaller ones
# (max_chunk 16 MiB; and with large_chunk 64 MiB), interleaved.
r=$OUT/r; mkdir -p $r; cp carry1/h1.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
confs=("" "max_chunk:16MiB" "max_chunk:16MiB,large_chunk:64MiB")
names=(default mc16 mc16lc64)
for round in 1 2; do
  for i in 0 1 2; do
    c=${confs[$i]}; k=${names[$i]}
    for t in resnet gpt2 llama; do
      n=replay_${t}_${k}_$round
      timeout 120 $B/moonbright replay --backend cuda --conf "$c" --repeat 3 carry1/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
      echo "$round $k $t rc=$? (${SECONDS}s)"; grep -A4 "^ *rep " $r/$n.log
    done
    n=stress_${k}_$round
    MOONBRIGHT_ALLOC_CONF="$c" timeout 100 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1
    echo "stress $k $round rc=$? $(grep -E '^MoonBright  ' $r/$n.log | tr -s ' ') (${SECONDS}s)"
    grep -E "request_maps" $r/$n.log | head -1 | grep -oE "request_mapped_handles [0-9]+|request_maps [0-9]+" | tr '\n' ' '; echo
  done
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g; s|/tmp/c1/bin|\$BIN|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
