#!/usr/bin/env bash
# Session 25, g6: splitting a run of chunks off a larger cached range (4858795) against the
# build before it (8591f01, "-base"): the CUDA test binaries; the stress, three rounds of each
# interleaved; the ResNet and GPT-2 traces, two rounds of each; then latency and interference
# on the new build.
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
  for b in stress-base stress; do
    timeout 120 carry/bin/$b --no-baseline > $r/stress_${b}_$round.log 2>&1
    echo "$round $b rc=$? $(grep -E '^MoonBright  ' $r/stress_${b}_$round.log | tr -s ' ') | $(grep -oE 'request_maps [0-9]+|request_mapped_handles [0-9]+|cached_ranges_split [0-9]+' $r/stress_${b}_$round.log | head -3 | tr '\n' ' ')"
  done
done
echo "(${SECONDS}s)"
for round in 1 2; do
  for t in resnet gpt2; do
    for b in moonbright-base moonbright; do
      timeout 60 carry/bin/$b replay --backend cuda carry/trace_$t.csv.gz > $r/replay_${t}_${b}_$round.log 2>&1
      echo "$round $t $b rc=$? $(grep -E 'MoonBright reserved' $r/replay_${t}_${b}_$round.log | tr -s ' ') | $(grep -E '^alloc latency' $r/replay_${t}_${b}_$round.log) | $(grep -oE 'set_access [0-9]+' $r/replay_${t}_${b}_$round.log)"
    done
  done
done
echo "(${SECONDS}s)"
OUT=$r/steps BIN=carry/bin timeout 240 bash bench/run-h200.sh latency interference > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"; rm -f $r/steps/nvrtc.txt
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -iE "^target" $r/steps/interference.log | tail -1
cp carry/g6.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
