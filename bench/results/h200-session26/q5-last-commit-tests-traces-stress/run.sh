#!/usr/bin/env bash
# Session 26, g5: the last commit (66417da: a request that goes on to map drops its wait for
# unmaps at once): the CUDA test binaries; the ResNet and GPT-2 traces, three rounds; the
# stress, twice.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged" "ipc"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$? $(grep -E '^test result' $r/test-$n.log | tail -1 | cut -c1-60)"
done
echo "(${SECONDS}s)"
for round in 1 2 3; do
  for t in resnet gpt2; do
    timeout 60 carry/bin/moonbright replay --backend cuda carry/trace_$t.csv.gz --json $r/replay_${t}_$round.json > $r/replay_${t}_$round.log 2>&1
    echo "$round $t rc=$? $(grep -E 'MoonBright reserved' $r/replay_${t}_$round.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/replay_${t}_$round.log | cut -c16-)"
  done
done
echo "(${SECONDS}s)"
for round in 1 2; do
  timeout 120 carry/bin/stress --no-baseline > $r/stress_$round.log 2>&1
  echo "$round stress rc=$? $(grep -E '^MoonBright  ' $r/stress_$round.log | tr -s ' ')"
done
echo "(${SECONDS}s)"
cp carry/g5.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
