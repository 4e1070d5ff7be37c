#!/usr/bin/env bash
# Session 26, g2: the worker's stopped unmap batch commits and goes on (68983c0, no suffix)
# against the first try, which stopped and left the rest for later (e6ff721, "-v1"), and the
# build before both (2f2e24c, "-base"): the CUDA test binaries; the ResNet and GPT-2 traces,
# four rounds of each build, interleaved; the stress, three rounds of each, interleaved.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged" "ipc"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$? $(grep -E '^test result' $r/test-$n.log | tail -1 | cut -c1-60)"
done
echo "(${SECONDS}s)"
for round in 1 2 3 4; do
  for t in resnet gpt2; do
    for b in moonbright-base moonbright-v1 moonbright; do
      timeout 60 carry/bin/$b replay --backend cuda carry/trace_$t.csv.gz --json $r/replay_${t}_${b}_$round.json > $r/replay_${t}_${b}_$round.log 2>&1
      echo "$round $t $b rc=$? $(grep -E 'MoonBright reserved' $r/replay_${t}_${b}_$round.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/replay_${t}_${b}_$round.log | cut -c16-) | $(grep -oE 'chunk splits [0-9]+( \([^)]*\))?|unmap batches [0-9]+' $r/replay_${t}_${b}_$round.log | tr '\n' ' ')"
    done
  done
done
echo "(${SECONDS}s)"
for round in 1 2 3; do
  for b in stress-base stress-v1 stress; do
    timeout 120 carry/bin/$b --no-baseline > $r/stress_${b}_$round.log 2>&1
    echo "$round $b rc=$? $(grep -E '^MoonBright  ' $r/stress_${b}_$round.log | tr -s ' ') | $(grep -oE '(flushes_for_split|targeted_flushes|unmap_batches|unmap_calls_in_batches) [0-9]+' $r/stress_${b}_$round.log | head -4 | tr '\n' ' ')"
  done
done
echo "(${SECONDS}s)"
cp carry/g2.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
