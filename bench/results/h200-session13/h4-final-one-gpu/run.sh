#!/usr/bin/env bash
# Session 13, h4: the final build on one H200: every CUDA test, every Python GPU test, the
# issue-3 benchmarks, and torch.compile's reduce-overhead mode again.
r=$OUT/r; mkdir -p $r
export PYTHONPATH=$SITE  # SITE: a folder to install the wheel into
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in "unit driver::cuda" "conformance cuda::" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
timeout 60 python3 carry/exp/compile_ro.py moonbright > $r/compile_reduce_overhead.log 2>&1
cd python/tests/gpu
timeout 330 python3 -m pytest -q -s --tb=short . > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/tests.txt
cd - >/dev/null
OUT=$r/steps BIN=carry/bin bash bench/run-h200.sh stress latency interference gpu_stress sanitizer > $r/steps.log 2>&1
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
cat $r/tests.txt; tail -n 3 $r/python-gpu.log; grep -E "ok|FAILED" $r/steps.log
grep -E "test result" $r/test-*.log
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -A40 "== targets" $r/steps/latency.log | grep -E "MISSED"
grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "target" $r/steps/interference.log | tail -1
tail -c 400 $r/compile_reduce_overhead.log
cd $OUT && tar czf r.tgz r && rm -rf r
