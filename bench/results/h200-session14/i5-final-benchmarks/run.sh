#!/usr/bin/env bash
# Session 14, i5: the issue-3 benchmarks on the final build (the latency table now has a cache
# hit under PyTorch's contract, captures_announced and deferred_free_events).
r=$OUT/r; mkdir -p $r
export SITE=$SITE PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
OUT=$r/steps BIN=carry/bin bash bench/run-h200.sh stress latency interference gpu_stress sanitizer > $r/steps.log 2>&1
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
grep -E "ok|FAILED" $r/steps.log | tail -8
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "cache hit" $r/steps/latency.log | grep -E "^ +[0-9]+ [KMG]?i?B +M" | head -14
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "target" $r/steps/interference.log | tail -1
cd $OUT && tar czf r.tgz r && rm -rf r
