#!/usr/bin/env bash
# Session 16, k5: transformers' static-cache generate, which compiles its decoding forward in
# mode "reduce-overhead" itself, under each allocator; then the test.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
for m in moonbright pytorch; do
  timeout 120 python3 carry/static_gen.py $m > $r/static_$m.out 2> $r/static_$m.err; echo "static $m rc=$?"
  python3 -c "import json; d=json.loads(open('$r/static_$m.out').read().splitlines()[-1]); print({k: v for k, v in d.items() if k != 'tokens'}, d['tokens'][0][0][-8:])" 2>&1 | tail -1
  grep -E "Error" $r/static_$m.err | tail -2
done
cd $OUT && tar czf r.tgz r && rm -rf r
