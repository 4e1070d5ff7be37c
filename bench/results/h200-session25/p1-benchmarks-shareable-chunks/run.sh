#!/usr/bin/env bash
# Session 25, g1: the issue-3 benchmarks on the current build (chunks created shareable, the
# default since session 24): stress against PyTorch's three backends, latency at every size with
# the 50 ms kernel, PyTorch's own latency, interference, plots.
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
OUT=$r/steps BIN=carry/bin timeout 570 bash bench/run-h200.sh stress torch_stress latency torch_latency interference plot > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
grep -E "^== |ok \(|FAILED" $r/steps.log | head -30
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright|^PyTorch|alloc99" $r/steps/stress.log | head; for f in $r/steps/torch_stress_*.log; do tail -n 3 $f; done
grep -iE "target|slowdown" $r/steps/interference.log | tail -4
cp carry/g1.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
