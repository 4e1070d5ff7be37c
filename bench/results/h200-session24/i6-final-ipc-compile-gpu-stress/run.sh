#!/usr/bin/env bash
# Session 24, i6: the final build: the IPC GPU tests (untyped storages through
# torch.multiprocessing too); the compile tests and gpu_stress with its memcheck run, on chunks
# now created shareable (i2 ran everything else).
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
source scripts/nvrtc-env.sh >/dev/null 2>&1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
(cd python/tests/gpu && timeout 150 python3 -m pytest -q -s --tb=short test_ipc_gpu.py > $r/test_ipc.log 2>&1; echo "test rc=$?" >> $r/test_ipc.log)
tail -c 1500 $r/test_ipc.log; echo "(${SECONDS}s)"
(cd python/tests/gpu && timeout 250 python3 -m pytest -q -s --tb=short --durations=6 test_compile_gpu.py > $r/compile.log 2>&1; echo "compile rc=$?" >> $r/compile.log)
grep -E "passed|failed|rc=" $r/compile.log | tail -3; grep -E "^FAILED|^ERROR" $r/compile.log | head; echo "(${SECONDS}s)"
OUT=$r/steps BIN=carry/bin timeout $((540 - SECONDS)) bash bench/run-h200.sh gpu_stress sanitizer > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
cp carry/g6.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
