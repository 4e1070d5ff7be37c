#!/usr/bin/env bash
# Session 27, r4: the Python GPU tests on the build with split_joined, exact runs (4136d52):
# PyTorch on MoonBright (torch, graphs and graph trees, transformers, growable, paged
# attention), torch.compile, IPC and the LD_PRELOAD interposer.
r=$OUT/r; mkdir -p $r
SITE=${SITE:?a pip --target folder}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF="" MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so
SECONDS=0
cd python/tests/gpu
timeout 300 python3 -m pytest -q --tb=short --durations=5 test_torch_gpu.py test_graphs_gpu.py test_transformers_gpu.py test_growable_gpu.py test_paged_attention_gpu.py > $r/pygpu.log 2>&1; echo "pygpu rc=$? (${SECONDS}s)" | tee -a $r/pygpu.log
tail -n 3 $r/pygpu.log | head -2; grep -E "^FAILED|^ERROR" $r/pygpu.log | head
timeout 150 python3 -m pytest -q --tb=short test_compile_gpu.py > $r/compile.log 2>&1; echo "compile rc=$? (${SECONDS}s)" | tee -a $r/compile.log
tail -n 3 $r/compile.log | head -2; grep -E "^FAILED|^ERROR" $r/compile.log | head
timeout 120 python3 -m pytest -q --tb=short test_ipc_gpu.py test_preload_gpu.py > $r/ipc_preload.log 2>&1; echo "ipc_preload rc=$? (${SECONDS}s)" | tee -a $r/ipc_preload.log
tail -n 3 $r/ipc_preload.log | head -2; grep -E "^FAILED|^ERROR" $r/ipc_preload.log | head
cd - >/dev/null
cp carry/g4.sh $r/run.sh
sed -i "s|$SITE|\$SITE|g; s|$PWD|\$REPO|g" $r/*.log
cd $OUT && tar czf r.tgz r && rm -rf r
