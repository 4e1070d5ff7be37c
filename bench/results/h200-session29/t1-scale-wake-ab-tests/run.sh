#!/usr/bin/env bash
# Session 29, call 1: the whole device in one-page chunks (scale), the wake A/B, CUDA tests.
set -u
r=$OUT/r; mkdir -p $r
B=carry/bin
source scripts/nvrtc-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
SECONDS=0
# 1. The whole device, new build, with the raw driver baseline.
timeout 240 $B/scale --json $r/scale.json > $r/scale.log 2>&1; echo "scale rc=$? (${SECONDS}s)"
tail -30 $r/scale.log
# 2. The wake A/B: fill phase's own time, base (wakes after every new range) and new, two rounds.
for round in 1 2; do
  for b in -base ""; do
    timeout 200 $B/scale$b --no-baseline --json $r/scale${b}_ab_$round.json > $r/scale${b}_ab_$round.log 2>&1
    echo "ab $round scale$b rc=$? $(grep -E '^fill' $r/scale${b}_ab_$round.log | tr -s ' ') | $(grep -A1 '^fill' $r/scale${b}_ab_$round.log | tail -1 | tr -s ' ')"
  done
done
echo "(${SECONDS}s)"
# 3. CUDA tests, then traces and stress A/B.
BIN=$B OUT=$r/ab TESTS=1 ROUNDS=2 STRESS_ROUNDS=3 bash bench/ab-h200.sh -base "" 2>&1
echo "(${SECONDS}s)"
cd $OUT && tar czf r.tgz r && rm -rf r
