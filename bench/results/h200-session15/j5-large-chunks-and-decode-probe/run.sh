#!/usr/bin/env bash
# Session 15, j5: (a) the latency table with large_chunk (8 GiB instead of 1 GiB); (b) what
# changes in MoonBright's statistics per token of batch-1 decoding, pinned to one core.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
MOONBRIGHT_ALLOC_CONF=large_chunk:8589934592 timeout 150 carry/bin/latency --no-kernel --json $r/latency_large8.json > $r/latency_large8.log 2>&1
echo "latency rc=$?"
C="captures_announced:true,deferred_free_events:true"
P="taskset -c 5"
MOONBRIGHT_ALLOC_CONF=$C $P timeout 90 python3 carry/exp/decode_probe.py > $r/probe_contract.json 2> $r/probe_contract.err
$P timeout 90 python3 carry/exp/decode_probe.py > $r/probe_default.json 2> $r/probe_default.err
MOONBRIGHT_ALLOC_CONF=$C,background:false $P timeout 90 python3 carry/exp/decode_probe.py > $r/probe_contract_nobg.json 2> $r/probe_contract_nobg.err
grep -E "8 GiB +(MoonBright cold|MB cold|raw VMM, one)" $r/latency_large8.log | tail -3; grep -E "\[MISSED\]" $r/latency_large8.log
cat $r/probe_*.json; tail -n 3 $r/probe_*.err
cd $OUT && tar czf r.tgz r && rm -rf r
