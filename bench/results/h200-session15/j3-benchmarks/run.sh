#!/usr/bin/env bash
# Session 15, j3: the issue-3 benchmarks on this session's build.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
OUT=$r/steps BIN=carry/bin timeout 510 bash bench/run-h200.sh latency stress interference gpu_stress sanitizer > $r/steps.log 2>&1
echo "rc=$? in ${SECONDS}s" >> $r/steps.log
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
tail -3 $r/steps.log
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "cache hit" $r/steps/latency.log | grep -E "^ +[0-9]+ [KMG]?i?B +M" | head -14
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "target" $r/steps/interference.log | tail -1
cd $OUT && tar czf r.tgz r && rm -rf r
