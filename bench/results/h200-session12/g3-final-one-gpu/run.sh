r=$OUT/r; mkdir -p $r
export PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in "unit driver::cuda" "conformance cuda::" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
timeout 300 python3 -m pytest -q -s python/tests/gpu > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/tests.txt
OUT=$r/steps BIN=carry/bin bash bench/run-h200.sh stress latency interference gpu_stress sanitizer > $r/steps.log 2>&1
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
timeout 60 python3 carry/exp/cold_probe.py 2 > $r/cold_probe_2.jsonl 2>&1; timeout 60 python3 carry/exp/cold_probe.py 64 > $r/cold_probe_64.jsonl 2>&1
cat $r/tests.txt; tail -n 2 $r/python-gpu.log; grep -E "ok|FAILED" $r/steps.log
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -A40 "== targets" $r/steps/latency.log | grep -E "MISSED"
grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "slowdown|p50.*x" $r/steps/interference.log | tail -4
cut -c1-400 $r/cold_probe_2.jsonl $r/cold_probe_64.jsonl
cd $OUT && tar czf r.tgz r && rm -rf r
