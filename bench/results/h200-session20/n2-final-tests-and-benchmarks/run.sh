#!/usr/bin/env bash
# Session 20, n2: whole window chunks (n1) and one context entry and capture-mode switch per
# batch of driver calls. CUDA test binaries; the latency benchmark (no kernel part, no chunk
# table) and the stress with the build before the session (eb38758, bin-old) and this one,
# interleaved; then the full latency benchmark and the other issue-3 benchmarks with this build;
# the traces replayed on the GPU; the Python GPU tests (compile tests left out).
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
cat $r/tests.txt | tr '\n' ' '; echo "(${SECONDS}s)"
grep -E "a_batch|whole_window" $r/test-unit.log $r/test-conformance.log
for t in new_1 old_1 new_2 old_2; do
  bin=carry/bin; [ ${t%_*} = old ] && bin=carry/bin-old
  timeout 60 $bin/latency --no-kernel --no-chunks --json $r/latency_$t.json > $r/latency_$t.log 2>&1
  echo "latency $t rc=$? met $(grep -c '\[met\]' $r/latency_$t.log) (${SECONDS}s)"
  grep -E "MISSED" $r/latency_$t.log
  timeout 60 $bin/stress --no-baseline > $r/stress_$t.log 2>&1
  echo "stress $t rc=$? $(grep -E '^MoonBright  ' $r/stress_$t.log | cut -c1-120) (${SECONDS}s)"
done
OUT=$r/steps BIN=carry/bin timeout 200 bash bench/run-h200.sh latency stress interference gpu_stress sanitizer > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "target" $r/steps/interference.log | tail -1
for t in resnet gpt2; do
  timeout 40 carry/bin/moonbright replay --backend cuda carry/trace_$t.csv.gz > $r/replay_$t.log 2>&1; echo "replay $t rc=$?"
  grep -E "reserved  |alloc latency" $r/replay_$t.log
done
echo "(${SECONDS}s)"
(cd python/tests/gpu && timeout 290 python3 -m pytest -q -s --tb=short --ignore=test_compile_gpu.py . > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/python-gpu.log)
tail -n 3 $r/python-gpu.log; grep -E "^FAILED|^ERROR" $r/python-gpu.log | head
cp carry/n2.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
