#!/usr/bin/env bash
# Session 28, s4: the final build (c052955): the Python GPU tests of torch.compile, IPC and the
# LD_PRELOAD interposer (the others ran in s3).
r=$OUT/r; mkdir -p $r; cp carry/g4.sh $r/run.sh
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF="" MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so
SECONDS=0
cd python/tests/gpu
timeout 160 python3 -m pytest -v --tb=short test_ipc_gpu.py test_preload_gpu.py > $r/ipc_preload.log 2>&1; echo "ipc_preload rc=$? (${SECONDS}s)" | tee -a $r/ipc_preload.log
tail -n 2 $r/ipc_preload.log | head -1; grep -E "FAILED|^ERROR" $r/ipc_preload.log | head
timeout 240 python3 -m pytest -v --tb=short test_compile_gpu.py > $r/compile.log 2>&1; echo "compile rc=$? (${SECONDS}s)" | tee -a $r/compile.log
tail -n 2 $r/compile.log | head -1; grep -E "FAILED|^ERROR" $r/compile.log | head
cd - >/dev/null
sed -i "s|$SITE|\$SITE|g; s|$PWD|\$REPO|g" $r/*.log
cd $OUT && tar czf r.tgz r && rm -rf r
