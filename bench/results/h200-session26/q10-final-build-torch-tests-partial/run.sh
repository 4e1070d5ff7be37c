#!/usr/bin/env bash
# Session 26, g10: the final build's (8f666ce) Python GPU tests of PyTorch on MoonBright
# (test_torch_gpu.py only: the device time left).
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
(cd python/tests/gpu && timeout 120 python3 -m pytest -q --tb=short --durations=3 test_torch_gpu.py > $r/pygpu.log 2>&1; echo "pygpu rc=$?" >> $r/pygpu.log)
tail -n 7 $r/pygpu.log; grep -E "^FAILED|^ERROR" $r/pygpu.log | head
echo "(${SECONDS}s)"
cp carry/g10.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
