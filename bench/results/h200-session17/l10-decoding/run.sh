#!/usr/bin/env bash
# Session 17, l10: batch-1 decoding pinned to one core (session 15's decode_probe.py and
# decode_speed.py, copied to carry/exp/ from
# bench/results/h200-session15/j5-large-chunks-and-decode-probe/ and j1-pluggable-floor/): driver calls a token and tokens a second with sub-page frees
# held in their arenas, under PyTorch's contract and the defaults, and PyTorch's allocator.
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
C="captures_announced:true,deferred_free_events:true"
P="taskset -c 5"
MOONBRIGHT_ALLOC_CONF=$C $P timeout 90 python3 carry/exp/decode_probe.py > $r/probe_contract_pinned.json 2> $r/probe_contract_pinned.err
$P timeout 90 python3 carry/exp/decode_probe.py > $r/probe_default_pinned.json 2> $r/probe_default_pinned.err
$P timeout 90 python3 carry/exp/decode_speed.py pytorch > $r/decode_pytorch_pinned.json 2> $r/decode_pytorch_pinned.err
for f in $r/probe_*.json; do echo $(basename $f) $(python3 -c "
import json; d=json.load(open('$f')); p=d['per_token']; print(round(d['tok_s'],1), p.get('moonbright.driver_calls.total'), p.get('moonbright.driver_calls.event_record'))" 2>&1 | tail -1); done
tail -c 400 $r/decode_pytorch_pinned.json; echo
cp carry/l10.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
