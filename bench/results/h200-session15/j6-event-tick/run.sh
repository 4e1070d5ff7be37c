#!/usr/bin/env bash
# Session 15, j6: the worker's 2 ms tick while frees only wait for their events (200 µs
# before): batch-1 decoding pinned to one core and not, the CUDA tests, and the issue-3
# benchmarks.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
C="captures_announced:true,deferred_free_events:true"
P="taskset -c 5"
MOONBRIGHT_ALLOC_CONF=$C $P timeout 90 python3 carry/exp/decode_probe.py > $r/probe_contract_pinned.json 2> $r/probe_contract_pinned.err
$P timeout 90 python3 carry/exp/decode_probe.py > $r/probe_default_pinned.json 2> $r/probe_default_pinned.err
$P timeout 90 python3 carry/exp/decode_speed.py pytorch > $r/decode_pytorch_pinned.json 2> $r/decode_pytorch_pinned.err
MOONBRIGHT_ALLOC_CONF=$C timeout 90 python3 carry/exp/decode_speed.py moonbright > $r/decode_contract.json 2> $r/decode_contract.err
timeout 90 python3 carry/exp/decode_speed.py pytorch > $r/decode_pytorch.json 2> $r/decode_pytorch.err
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
SECONDS=0
OUT=$r/steps BIN=carry/bin timeout 200 bash bench/run-h200.sh latency stress interference gpu_stress sanitizer > $r/steps.log 2>&1
echo "rc=$? in ${SECONDS}s" >> $r/steps.log
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
cat $r/tests.txt | tr '\n' ' '; echo; tail -1 $r/steps.log
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "target" $r/steps/interference.log | tail -1
for f in $r/probe_*.json; do echo $(basename $f) $(python3 -c "
import json; d=json.load(open('$f')); print(round(d['tok_s'],1), d['per_token'].get('moonbright.driver_calls.total'))" 2>&1 | tail -1); done
for f in $r/decode_*.json; do echo $(basename $f) $(python3 -c "
import json; d=json.load(open('$f')); print(round(d['median_tok_s'],1), [round(x) for x in d['tok_s']], d['tokens_hash'], d.get('driver_calls_per_token'))" 2>&1 | tail -1); done
cd $OUT && tar czf r.tgz r && rm -rf r
