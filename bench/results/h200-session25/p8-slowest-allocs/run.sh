#!/usr/bin/env bash
# Session 25, g9: what the slowest allocations of the GPT-2 and ResNet replays are made of
# (the replay now lists the five slowest with the driver calls made meanwhile).
r=$OUT/r; mkdir -p $r
export MOONBRIGHT_ALLOC_CONF=""
for round in 1 2; do
  for t in gpt2 resnet; do
    timeout 60 carry/bin/moonbright replay --backend cuda carry/trace_$t.csv.gz > $r/replay_${t}_$round.log 2>&1
    echo "== $round $t rc=$? $(grep -E '^alloc latency' $r/replay_${t}_$round.log)"
    grep -A5 "^slowest allocs" $r/replay_${t}_$round.log | tail -5 | cut -c1-230
  done
done
cp carry/g9.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
