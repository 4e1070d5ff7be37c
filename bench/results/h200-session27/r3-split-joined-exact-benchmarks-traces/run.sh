#!/usr/bin/env bash
# Session 27, r3: the build with split_joined, exact runs (4136d52): every issue-3 benchmark (stress against PyTorch's
# three backends, latency, PyTorch's latency, interference, gpu_stress and its memcheck run,
# plots) and the three traces.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
OUT=$r/steps BIN=carry/bin timeout 300 bash bench/run-h200.sh > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
grep -E "^== |ok \(|FAILED" $r/steps.log | paste - - | head -12
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright" $r/steps/stress.log | head -3; for f in $r/steps/torch_stress_*.log; do tail -n 2 $f | head -1; done
grep -iE "^target" $r/steps/interference.log | tail -1
grep -E "mismatch|ERROR SUMMARY" $r/steps/gpu_stress*.log | head -4
for t in llama gpt2 resnet; do
  timeout 120 carry/bin/moonbright replay --backend cuda carry/trace_$t.csv.gz --json $r/replay_$t.json > $r/replay_$t.log 2>&1
  echo "$t rc=$? $(grep -E 'MoonBright reserved' $r/replay_$t.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/replay_$t.log | cut -c16-)"
done
echo "(${SECONDS}s)"
cp carry/g3.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
