#!/usr/bin/env bash
# Session 20, n3: the Python GPU tests (compile tests left out) with n2's build, timed per test
# (in n2 they ran past its 290 s limit on a machine slower than session 19's).
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
(cd python/tests/gpu && timeout 540 python3 -m pytest -q -s --tb=short --durations=12 --ignore=test_compile_gpu.py . > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/python-gpu.log)
tail -n 18 $r/python-gpu.log | cut -c1-160; grep -E "^FAILED|^ERROR" $r/python-gpu.log | head
cp carry/n3.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
