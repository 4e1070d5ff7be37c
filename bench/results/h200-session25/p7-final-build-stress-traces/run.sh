#!/usr/bin/env bash
# Session 25, g8: the final build (the split's search bounded, 4332d09): the stress once, and
# the three traces replayed twice.
r=$OUT/r; mkdir -p $r
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
timeout 120 carry/bin/stress --no-baseline > $r/stress.log 2>&1
echo "stress rc=$? $(grep -E '^MoonBright  ' $r/stress.log | tr -s ' ' | head -1) | $(grep -oE 'request_maps [0-9]+|cached_ranges_split [0-9]+' $r/stress.log | head -2 | tr '\n' ' ')"
for round in 1 2; do
  for t in resnet gpt2 llama; do
    timeout 60 carry/bin/moonbright replay --backend cuda carry/trace_$t.csv.gz > $r/replay_${t}_$round.log 2>&1
    echo "$round $t rc=$? $(grep -E 'MoonBright reserved' $r/replay_${t}_$round.log | tr -s ' ') | $(grep -E '^alloc latency' $r/replay_${t}_$round.log) | $(grep -oE 'set_access [0-9]+' $r/replay_${t}_$round.log)"
  done
done
echo "(${SECONDS}s)"
cp carry/g8.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
