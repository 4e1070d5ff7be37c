#!/usr/bin/env bash
# Session 16, k4: transformers' static-cache generate with the forward compiled in mode
# "reduce-overhead", under each allocator (why the test failed in k3), then the other Python
# GPU tests on the final build.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
for m in pytorch moonbright; do
  timeout 100 python3 carry/static_gen.py $m > $r/static_$m.out 2> $r/static_$m.err; echo "static $m rc=$?"
  tail -c 300 $r/static_$m.out; grep -E "Error" $r/static_$m.err | tail -2
done
cd python/tests/gpu
timeout 370 python3 -m pytest -q -s --tb=short --ignore=test_compile_gpu.py . > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/python-gpu.log
tail -n 4 $r/python-gpu.log; grep -E "^FAILED|^ERROR" $r/python-gpu.log | head
cd $OUT && tar czf r.tgz r && rm -rf r
