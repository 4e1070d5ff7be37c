#!/usr/bin/env bash
# Session 19, m6: the final build (window hits leave emptied segments to the mapper; reservations
# of 1 GiB or more aligned to 1 GiB):
# CUDA test binaries, the issue-3 benchmarks, the Python GPU tests (compile tests left out: no
# change touches them), the traces replayed on the GPU.
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
cat $r/tests.txt | tr '\n' ' '; echo
SECONDS=0
OUT=$r/steps BIN=carry/bin timeout 170 bash bench/run-h200.sh latency stress interference gpu_stress sanitizer > $r/steps.log 2>&1
echo "rc=$? in ${SECONDS}s" >> $r/steps.log
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
tail -1 $r/steps.log
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "target" $r/steps/interference.log | tail -1
grep -E "reservations_start" $r/test-conformance.log
(cd python/tests/gpu && timeout 330 python3 -m pytest -q -s --tb=short --ignore=test_compile_gpu.py . > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/python-gpu.log)
tail -n 3 $r/python-gpu.log; grep -E "^FAILED|^ERROR" $r/python-gpu.log | head
for t in resnet gpt2; do
  timeout 60 carry/bin/moonbright replay --backend cuda carry/trace_$t.csv.gz > $r/replay_$t.log 2>&1; echo "replay $t rc=$?"
  grep -E "reserved  |alloc latency" $r/replay_$t.log
done
cp carry/m6.sh $r/run.sh
# (machine paths in the logs are replaced after the copy back: see ../README.md)
cd $OUT && tar czf r.tgz r && rm -rf r
