#!/usr/bin/env bash
# Session 23, p6: the final build. The interposer's GPU tests (the child's configuration now
# its own: p1-p5 found the CPU tests' host-backend MOONBRIGHT_ALLOC_CONF inherited, which the
# interposer now refuses); the compile tests (not run since session 16; moonbright.torch uses
# moonbright::devices now); gpu_stress and its memcheck run.
r=$OUT/r; mkdir -p $r
SITE=${SITE:-/tmp/site}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
export MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so
(cd python/tests/gpu && timeout 200 python3 -m pytest -q -s --tb=short --durations=6 test_preload_gpu.py > $r/preload.log 2>&1; echo "preload rc=$?" >> $r/preload.log)
grep -E " B: alloc|passed|failed|rc=" $r/preload.log; echo "(${SECONDS}s)"
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
(cd python/tests/gpu && timeout 300 python3 -m pytest -q -s --tb=short --durations=6 test_compile_gpu.py > $r/compile.log 2>&1; echo "compile rc=$?" >> $r/compile.log)
grep -E "passed|failed|rc=" $r/compile.log | tail -3; grep -E "^FAILED|^ERROR" $r/compile.log | head; echo "(${SECONDS}s)"
OUT=$r/steps BIN=carry/bin timeout $((560 - SECONDS)) bash bench/run-h200.sh gpu_stress sanitizer > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
cp carry/g6.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
