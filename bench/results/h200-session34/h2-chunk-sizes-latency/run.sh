#!/usr/bin/env bash
# Session 34, h2: the same build as h1 (1575a45). Chunk sizes over repeated passes of the
# recorded traces and the fragmentation stress, two more rounds, interleaved: the default
# (max_chunk 64 MiB, large_chunk 128 MiB), 16/64, 16/32 and 32/128 MiB; then the latency
# benchmark at the default and at 16/64.
r=$OUT/r; mkdir -p $r; cp carry1/h2.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
confs=("" "max_chunk:16MiB,large_chunk:64MiB" "max_chunk:16MiB,large_chunk:32MiB" "max_chunk:32MiB")
names=(default mc16lc64 mc16lc32 mc32)
for round in 3 4; do
  for i in 0 1 2 3; do
    c=${confs[$i]}; k=${names[$i]}
    for t in resnet gpt2 llama; do
      n=replay_${t}_${k}_$round
      timeout 120 $B/moonbright replay --backend cuda --conf "$c" --repeat 3 carry1/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
      echo "$round $k $t rc=$? (${SECONDS}s) $(grep -A3 '^ *rep ' $r/$n.log | tail -3 | awk '{printf "[%s %s %s] ", $3, $6, $10}')"
    done
    n=stress_${k}_$round
    MOONBRIGHT_ALLOC_CONF="$c" timeout 100 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1
    echo "stress $k $round rc=$? $(grep -E '^MoonBright  ' $r/$n.log | tr -s ' ') (${SECONDS}s)"
  done
done
for i in 0 1; do
  c=${confs[$i]}; k=${names[$i]}
  MOONBRIGHT_ALLOC_CONF="$c" timeout 200 $B/latency --json $r/latency_$k.json > $r/latency_$k.log 2>&1
  echo "latency $k rc=$? (${SECONDS}s)"; grep -E "\[MISSED\]" $r/latency_$k.log; grep -cE "\[(met|MISSED)\]" $r/latency_$k.log
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g; s|/tmp/c1/bin|\$BIN|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
