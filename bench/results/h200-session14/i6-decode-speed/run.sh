#!/usr/bin/env bash
# Session 14, i6: greedy decoding of a small random-weight Llama at batch 1 (bf16, 12 layers,
# 256 new tokens, five timed runs a process), under PyTorch's allocator, MoonBright's defaults
# and MoonBright under PyTorch's contract; two processes of each, interleaved.
r=$OUT/r; mkdir -p $r
export SITE=$SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
C="captures_announced:true,deferred_free_events:true"
for i in 1 2; do
  timeout 90 python3 carry/exp/decode_speed.py pytorch > $r/decode_pytorch_$i.json 2> $r/decode_pytorch_$i.err
  timeout 90 python3 carry/exp/decode_speed.py moonbright > $r/decode_default_$i.json 2> $r/decode_default_$i.err
  MOONBRIGHT_ALLOC_CONF=$C timeout 90 python3 carry/exp/decode_speed.py moonbright > $r/decode_contract_$i.json 2> $r/decode_contract_$i.err
done
cat $r/decode_*.json; tail -n 3 $r/decode_*_1.err
cd $OUT && tar czf r.tgz r && rm -rf r
