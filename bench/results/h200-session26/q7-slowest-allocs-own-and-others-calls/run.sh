#!/usr/bin/env bash
# Session 26, g7: what the traces' slowest allocations wait for, with the replay's new split of
# each one's driver calls into its own and other threads' (edda948 and the ipc test fix; the
# allocator as 7669152): ResNet and GPT-2, three rounds each.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
for round in 1 2 3; do
  for t in resnet gpt2; do
    timeout 60 carry/bin/moonbright replay --backend cuda carry/trace_$t.csv.gz --json $r/replay_${t}_$round.json > $r/replay_${t}_$round.log 2>&1
    echo "$round $t rc=$? $(grep -E '^alloc latency' $r/replay_${t}_$round.log | cut -c16-)"
    grep -A5 "^slowest" $r/replay_${t}_$round.log | tail -5 | cut -c1-330
  done
done
cp carry/g7.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
