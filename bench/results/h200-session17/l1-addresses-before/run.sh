#!/usr/bin/env bash
# Static-cache addresses and traces under each allocator (session 17, l1).
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
for m in moonbright pytorch; do
  TORCH_LOGS=cudagraphs timeout 150 python3 carry/addr_gen.py $m $r/trace_$m.json.gz > $r/addr_$m.out 2> $r/addr_$m.err; echo "$m rc=$?"
  tail -c 1500 $r/addr_$m.out; echo
  grep -i "re-record\|pointer changed" $r/addr_$m.err | head -12
done
cp carry/addr_gen.py carry/addr.sh $r/
cd $OUT && tar czf r.tgz r && rm -rf r
