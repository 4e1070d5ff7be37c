#!/usr/bin/env bash
# Session 15, j2: every CUDA test and every Python GPU test on this session's build (the fast
# path without a clock, empty_cache waiting for pending frees, graph-pool keys released).
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $r/gpu.txt
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
cd python/tests/gpu
timeout 440 python3 -m pytest -q -s --tb=short . > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/tests.txt
cd - >/dev/null
cat $r/tests.txt; tail -n 4 $r/python-gpu.log
grep -E "test result" $r/test-*.log
grep -E "FAILED|Error" $r/python-gpu.log | head -20
cd $OUT && tar czf r.tgz r && rm -rf r
