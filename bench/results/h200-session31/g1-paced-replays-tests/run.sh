#!/usr/bin/env bash
# Session 31, g1: the CUDA tests of this build (the request path's wait clock changed), then
# the ResNet and GPT-2 traces replayed as fast as they go and at their recorded pace
# (`--pace 1`), two rounds interleaved, and one round of the stress.
r=$OUT/r; mkdir -p $r/ab; cp carry1/g1.sh $r/run.sh
SECONDS=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "streams"; do
  set -- $t; n=$1; shift
  timeout 120 carry1/bin/$n "$@" --test-threads 1 > $r/ab/test-$n.log 2>&1
  echo "$n rc=$? $(grep -E '^test result' $r/ab/test-$n.log | tail -1 | cut -c1-60)"
done | tee $r/ab.log
echo "(${SECONDS}s)" | tee -a $r/ab.log
for round in 1 2; do
  for t in resnet gpt2; do
    for pace in none 1; do
      name=replay_${t}_pace-${pace}_$round
      p=(); [ $pace != none ] && p=(--pace $pace)
      timeout 120 carry1/bin/moonbright replay --backend cuda carry1/trace_$t.csv.gz "${p[@]}" \
        --json $r/ab/$name.json > $r/ab/$name.log 2>&1
      echo "$round $t pace=$pace rc=$? $(grep -E 'MoonBright reserved' $r/ab/$name.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/ab/$name.log | cut -c16-)" | tee -a $r/ab.log
    done
  done
done
echo "(${SECONDS}s)" | tee -a $r/ab.log
timeout 150 carry1/bin/stress --no-baseline --json $r/ab/stress.json > $r/ab/stress.log 2>&1
echo "stress rc=$? $(grep -E '^MoonBright  ' $r/ab/stress.log | tr -s ' ')" | tee -a $r/ab.log
echo "(${SECONDS}s)" | tee -a $r/ab.log
sed -i "s|$PWD|\$REPO|g" $r/*.log $r/ab/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
