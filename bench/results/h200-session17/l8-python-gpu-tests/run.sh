#!/usr/bin/env bash
# Session 17, l8: the other Python GPU tests on the build with stable addresses.
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
cd python/tests/gpu
timeout 480 python3 -m pytest -q -s --tb=short --ignore=test_compile_gpu.py . > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/python-gpu.log
tail -n 4 $r/python-gpu.log; grep -E "^FAILED|^ERROR" $r/python-gpu.log | head
cd - >/dev/null; cp carry/l8.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
