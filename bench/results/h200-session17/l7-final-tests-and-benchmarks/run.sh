#!/usr/bin/env bash
# Session 17, l7: the build with stable addresses: CUDA test binaries, the compile tests
# (static-cache generate: the second and third caches at the same addresses), the issue-3
# benchmarks.
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
cat $r/tests.txt | tr '\n' ' '; echo
(cd python/tests/gpu && timeout 300 python3 -m pytest -q -s --tb=short test_compile_gpu.py > $r/compile.log 2>&1; echo "compile rc=$?" >> $r/compile.log)
tail -n 3 $r/compile.log; grep -E "^FAILED|Error|graphs:" $r/compile.log | head -5
SECONDS=0
OUT=$r/steps BIN=carry/bin timeout 160 bash bench/run-h200.sh latency stress interference gpu_stress sanitizer > $r/steps.log 2>&1
echo "rc=$? in ${SECONDS}s" >> $r/steps.log
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
tail -1 $r/steps.log
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "(256 B|64 KiB|2 MiB) .*(cache hit|torch rules|Async \(warm\))" $r/steps/latency.log | head -12
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "target" $r/steps/interference.log | tail -1
cp carry/l7.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
