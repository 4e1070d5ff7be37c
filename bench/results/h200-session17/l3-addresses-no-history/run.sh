#!/usr/bin/env bash
# Session 17, l3: the static-cache generate without memory history: cache addresses and graphs,
# three runs under MoonBright, one under PyTorch's allocator.
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
for run in moonbright:1 moonbright:2 moonbright:3 pytorch:1; do
  m=${run%:*}; n=${run#*:}
  TORCH_LOGS=cudagraphs timeout 150 python3 carry/addr_gen.py $m none nohist > $r/addr_${m}_$n.out 2> $r/addr_${m}_$n.err; echo "$run rc=$?"
  cat $r/addr_${m}_$n.out; grep -c "Re-recording" $r/addr_${m}_$n.err
done
cp carry/addr_gen.py carry/addr3.sh $r/
cd $OUT && tar czf r.tgz r && rm -rf r
