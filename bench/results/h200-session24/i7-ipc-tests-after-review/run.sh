#!/usr/bin/env bash
# Session 24, i7: the IPC GPU tests after the review (one subprocess runner).
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
source scripts/nvrtc-env.sh >/dev/null 2>&1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
(cd python/tests/gpu && timeout 150 python3 -m pytest -q -s --tb=short test_ipc_gpu.py > $r/test_ipc.log 2>&1; echo "test rc=$?" >> $r/test_ipc.log)
tail -c 1500 $r/test_ipc.log; echo "(${SECONDS}s)"
cp carry/g7.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
