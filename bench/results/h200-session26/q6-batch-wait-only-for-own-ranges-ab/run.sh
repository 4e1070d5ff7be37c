#!/usr/bin/env bash
# Session 26, g6: a request waits for the worker's unmap batch only when that batch holds its
# ranges, and the stopped batch waits for it (7669152, no suffix), against the commit before
# (66417da, "-prev"): the CUDA test binaries; the ResNet and GPT-2 traces, four rounds of each
# build, interleaved; the stress, three rounds of each.
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
    for b in moonbright-prev moonbright; do
      timeout 60 carry/bin/$b replay --backend cuda carry/trace_$t.csv.gz --json $r/replay_${t}_${b}_$round.json > $r/replay_${t}_${b}_$round.log 2>&1
      echo "$round $t $b rc=$? $(grep -E 'MoonBright reserved' $r/replay_${t}_${b}_$round.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/replay_${t}_${b}_$round.log | cut -c16-)"
    done
  done
done
echo "(${SECONDS}s)"
for round in 1 2 3; do
  for b in stress-prev stress; do
    timeout 120 carry/bin/$b --no-baseline > $r/stress_${b}_$round.log 2>&1
    echo "$round $b rc=$? $(grep -E '^MoonBright  ' $r/stress_${b}_$round.log | tr -s ' ')"
  done
done
echo "(${SECONDS}s)"
cp carry/g6.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
