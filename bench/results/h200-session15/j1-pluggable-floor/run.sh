#!/usr/bin/env bash
# Session 15, j1: the floor of PyTorch's pluggable-allocator interface (a minimal per-size cache
# over cuMemAlloc, carry/exp/minimal_alloc.cpp) beside PyTorch's allocator and MoonBright (defaults
# and PyTorch's contract): alloc/free pairs through torch.empty, and batch-1 decoding.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $r/gpu.txt
which perf gdb py-spy >> $r/gpu.txt 2>&1; nproc >> $r/gpu.txt
C="captures_announced:true,deferred_free_events:true"
for i in 1 2; do
  timeout 60 python3 carry/exp/eager_overhead.py pytorch > $r/eager_pytorch_$i.json 2>$r/eager_pytorch_$i.err
  timeout 60 python3 carry/exp/eager_overhead.py minimal > $r/eager_minimal_$i.json 2>$r/eager_minimal_$i.err
  MOONBRIGHT_ALLOC_CONF=$C timeout 60 python3 carry/exp/eager_overhead.py moonbright > $r/eager_contract_$i.json 2>$r/eager_contract_$i.err
  timeout 60 python3 carry/exp/eager_overhead.py moonbright > $r/eager_default_$i.json 2>$r/eager_default_$i.err
done
for i in 1; do
  timeout 90 python3 carry/exp/decode_speed.py pytorch > $r/decode_pytorch_$i.json 2> $r/decode_pytorch_$i.err
  timeout 90 python3 carry/exp/decode_speed.py minimal > $r/decode_minimal_$i.json 2> $r/decode_minimal_$i.err
  MOONBRIGHT_ALLOC_CONF=$C timeout 90 python3 carry/exp/decode_speed.py moonbright > $r/decode_contract_$i.json 2> $r/decode_contract_$i.err
done
cat $r/gpu.txt
for f in $r/eager_*.json; do echo $(basename $f) $(python3 -c "
import json; d=json.load(open('$f')); print([d.get(k) for k in ('pair_default_4096','pair_default_16777216','pair_side_4096','pair_side_1048576','pair_side_16777216','forward_default_us','forward_side_us')])" 2>&1 | tail -1); done
for f in $r/decode_*.json; do echo $(basename $f) $(python3 -c "
import json; d=json.load(open('$f')); print(round(d['median_tok_s'],1), [round(x) for x in d['tok_s']], d['tokens_hash'])" 2>&1 | tail -1); done
tail -n 3 $r/*minimal_1.err
cd $OUT && tar czf r.tgz r && rm -rf r
