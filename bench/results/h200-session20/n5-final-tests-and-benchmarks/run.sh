#!/usr/bin/env bash
# Session 20, n5: the final build (n2's, plus: a request takes whole window chunks back only if
# they fit, or one to split when no new memory can be made). CUDA test binaries, the issue-3
# benchmarks, and the Python GPU tests of transformers and growable buffers (the whole suite
# passed on n2's build, n3-).
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
grep -E "a_batch|whole_window|test result" $r/test-unit.log $r/test-conformance.log
OUT=$r/steps BIN=carry/bin timeout 200 bash bench/run-h200.sh latency stress interference gpu_stress sanitizer > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "target" $r/steps/interference.log | tail -1
(cd python/tests/gpu && timeout 200 python3 -m pytest -q -s --tb=short --durations=5 test_transformers_gpu.py test_growable_gpu.py > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/python-gpu.log)
tail -n 9 $r/python-gpu.log | cut -c1-160; grep -E "^FAILED|^ERROR" $r/python-gpu.log | head
echo "(${SECONDS}s)"
cp carry/n5.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
