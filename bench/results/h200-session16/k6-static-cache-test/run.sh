#!/usr/bin/env bash
# Session 16, k6: the static-cache generate test as committed, through pytest.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
cd python/tests/gpu
timeout 250 python3 -m pytest -q -s --tb=short test_compile_gpu.py -k static_cache > $r/static-test.log 2>&1; echo "rc=$?" >> $r/static-test.log
tail -n 3 $r/static-test.log
cd $OUT && tar czf r.tgz r && rm -rf r
