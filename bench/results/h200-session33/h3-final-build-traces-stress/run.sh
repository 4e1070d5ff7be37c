#!/usr/bin/env bash
# Session 33, h3: the final build (0def21f, carve 0.005 by default): three single-pass replays
# of each recorded trace for the README's table, Llama three passes at the default and at
# carve:0, and two more rounds of the fragmentation stress.
r=$OUT/r; mkdir -p $r; cp carry1/h3.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for round in 1 2 3; do
  for t in resnet gpt2 llama; do
    n=replay_${t}_$round
    timeout 100 $B/moonbright replay --backend cuda carry1/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
    echo "$round $t rc=$? $(grep -E 'MoonBright reserved' $r/$n.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/$n.log | cut -c16-) (${SECONDS}s)"
  done
done
for c in 0.005 0; do
  n=replay_llama_repeat3_carve$c
  timeout 100 $B/moonbright replay --backend cuda --conf carve:$c --repeat 3 carry1/trace_llama.csv.gz > $r/$n.log 2>&1
  echo "llama x3 carve:$c rc=$? $(grep -E 'MoonBright reserved' $r/$n.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/$n.log | cut -c16-) (${SECONDS}s)"
  grep -A4 "^ *rep " $r/$n.log
done
for round in 2 3; do
  timeout 100 $B/stress --no-baseline --json $r/stress_$round.json > $r/stress_$round.log 2>&1
  echo "stress $round rc=$? $(grep -E '^MoonBright  ' $r/stress_$round.log | tr -s ' ') (${SECONDS}s)"
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g; s|/tmp/c1/bin|\$BIN|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
