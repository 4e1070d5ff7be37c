#!/usr/bin/env bash
# Session 24, i1: shareable handles on the H200: their cost (ipccost), the two-process tensor
# test, and the cross-process round trip against cudaIpc (bench/ipc_pairs.py).
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
source scripts/nvrtc-env.sh >/dev/null
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
timeout 120 carry/bin/ipccost --json $r/ipccost.json > $r/ipccost.log 2>&1; echo "ipccost rc=$? (${SECONDS}s)" >> $r/ipccost.log
cat $r/ipccost.log
(cd python/tests/gpu && timeout 200 python3 -m pytest -q -s --tb=short test_ipc_gpu.py > $r/test_ipc.log 2>&1; echo "test rc=$?" >> $r/test_ipc.log)
tail -c 3000 $r/test_ipc.log; echo "(${SECONDS}s)"
timeout 200 python3 bench/ipc_pairs.py --json $r/ipc_pairs.json > $r/ipc_pairs.log 2>&1; echo "pairs rc=$?" >> $r/ipc_pairs.log
cat $r/ipc_pairs.log | tail -c 3000; echo "(${SECONDS}s)"
cp carry/g1.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
