#!/usr/bin/env bash
# Session 34, h4: the h3 build (a1e189d) with larger carving budgets, for training loops:
# three passes of ResNet and GPT-2 and the stress at carve 0.01 and 0.02 beside the default.
r=$OUT/r; mkdir -p $r; cp carry1/h4.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for round in 1 2; do
  for c in 0.005 0.01 0.02; do
    for t in resnet gpt2; do
      n=replay_${t}_carve${c}_$round
      timeout 100 $B/moonbright replay --backend cuda --conf carve:$c --repeat 3 carry1/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
      echo "$round carve:$c $t rc=$? (${SECONDS}s) $(grep -A3 '^ *rep ' $r/$n.log | tail -3 | awk '{printf "[%s %s %s %s] ", $3, $6, $10, $11}')"
    done
    n=stress_carve${c}_$round
    MOONBRIGHT_ALLOC_CONF="carve:$c" timeout 100 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1
    echo "stress carve:$c $round rc=$? $(grep -E '^MoonBright  ' $r/$n.log | tr -s ' ') (${SECONDS}s)"
  done
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g; s|/tmp/c1/bin|\$BIN|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
