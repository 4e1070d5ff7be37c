#!/usr/bin/env bash
# Session 24, i5: torch.multiprocessing carries MoonBright's tensors (moonbright.ipc's reducer,
# installed by moonbright.torch.enable()), and the socket test again.
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
(cd python/tests/gpu && timeout 400 python3 -m pytest -q -s --tb=short test_ipc_gpu.py > $r/test_ipc.log 2>&1; echo "test rc=$?" >> $r/test_ipc.log)
tail -c 4000 $r/test_ipc.log; echo "(${SECONDS}s)"
cp carry/g5.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
