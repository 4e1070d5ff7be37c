#!/usr/bin/env bash
# Session 29, call 2: scale with the flush phase and per-call growth; the wake A/B again.
set -u
r=$OUT/r; mkdir -p $r
B=carry/bin
SECONDS=0
timeout 240 $B/scale --json $r/scale.json > $r/scale.log 2>&1; echo "scale rc=$? (${SECONDS}s)"
cat $r/scale.log
for round in 1 2 3; do
  for b in -base ""; do
    timeout 200 $B/scale$b --no-baseline --json $r/scale${b}_ab_$round.json > $r/scale${b}_ab_$round.log 2>&1
    echo "ab $round scale$b rc=$? $(grep -E '^fill' $r/scale${b}_ab_$round.log | tr -s ' ') | $(grep 'malloc, all' $r/scale${b}_ab_$round.log | tr -s ' ')"
  done
done
echo "(${SECONDS}s)"
cd $OUT && tar czf r.tgz r && rm -rf r
