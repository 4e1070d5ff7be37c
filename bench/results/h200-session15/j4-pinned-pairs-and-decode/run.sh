#!/usr/bin/env bash
# Session 15, j4: (a) the latency table with large_chunk_bytes at 8 GiB instead of 1 GiB (a cold
# 8 GiB request then maps one handle, as raw VMM's does); (b) j1's pairs and decoding again, each
# process pinned to one core (taskset -c 5), since unpinned runs were bimodal.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
MOONBRIGHT_ALLOC_CONF=large_chunk_bytes:8589934592 timeout 150 carry/bin/latency --no-kernel --json $r/latency_large8.json > $r/latency_large8.log 2>&1
echo "latency rc=$?"
C="captures_announced:true,deferred_free_events:true"
P="taskset -c 5"
for i in 1 2; do
  $P timeout 60 python3 carry/exp/eager_overhead.py pytorch > $r/eager_pytorch_$i.json 2>$r/eager_pytorch_$i.err
  $P timeout 60 python3 carry/exp/eager_overhead.py minimal > $r/eager_minimal_$i.json 2>$r/eager_minimal_$i.err
  MOONBRIGHT_ALLOC_CONF=$C $P timeout 60 python3 carry/exp/eager_overhead.py moonbright > $r/eager_contract_$i.json 2>$r/eager_contract_$i.err
  $P timeout 60 python3 carry/exp/eager_overhead.py moonbright > $r/eager_default_$i.json 2>$r/eager_default_$i.err
done
$P timeout 90 python3 carry/exp/decode_speed.py pytorch > $r/decode_pytorch_1.json 2> $r/decode_pytorch_1.err
$P timeout 90 python3 carry/exp/decode_speed.py minimal > $r/decode_minimal_1.json 2> $r/decode_minimal_1.err
MOONBRIGHT_ALLOC_CONF=$C $P timeout 90 python3 carry/exp/decode_speed.py moonbright > $r/decode_contract_1.json 2> $r/decode_contract_1.err
grep -E "8 GiB +(MoonBright cold|MB cold|raw VMM, one)" $r/latency_large8.log | tail -3; grep -E "\[MISSED\]" $r/latency_large8.log
for f in $r/eager_*.json; do echo $(basename $f) $(python3 -c "
import json; d=json.load(open('$f')); print([d.get(k) for k in ('pair_default_4096','pair_default_16777216','pair_side_4096','pair_side_1048576','pair_side_16777216','forward_default_us','forward_side_us')])" 2>&1 | tail -1); done
for f in $r/decode_*.json; do echo $(basename $f) $(python3 -c "
import json; d=json.load(open('$f')); print(round(d['median_tok_s'],1), [round(x) for x in d['tok_s']], d['tokens_hash'])" 2>&1 | tail -1); done
cd $OUT && tar czf r.tgz r && rm -rf r
