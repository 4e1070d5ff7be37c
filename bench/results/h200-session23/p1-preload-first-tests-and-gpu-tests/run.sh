#!/usr/bin/env bash
# Session 23, p1: the LD_PRELOAD interposer under unmodified PyTorch (caching allocator,
# no caching, backend:cudaMallocAsync, OOM), each against the CUDA runtime's own calls; the CUDA
# test binaries (malloc now on NO_STREAM); the Python GPU tests (devices moved into the core;
# compile tests in p2).
r=$OUT/r; mkdir -p $r
SITE=${SITE:-/tmp/site}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
export MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so
(cd python/tests/gpu && timeout 230 python3 -m pytest -q -s --tb=long --durations=6 test_preload_gpu.py > $r/preload.log 2>&1; echo "preload rc=$?" >> $r/preload.log)
grep -E "^(runtime|preload):" $r/preload.log | cut -c1-400; grep -E " B: alloc|passed|failed|rc=" $r/preload.log; echo "(${SECONDS}s)"
for t in "unit driver::cuda libs devices" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 100 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
cat $r/tests.txt | tr '\n' ' '; echo "(${SECONDS}s)"
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
(cd python/tests/gpu && timeout $((570 - SECONDS)) python3 -m pytest -q -s --tb=short --durations=8 --ignore=test_compile_gpu.py --ignore=test_preload_gpu.py . > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/python-gpu.log)
tail -n 4 $r/python-gpu.log | cut -c1-160; grep -E "^FAILED|^ERROR" $r/python-gpu.log | head; echo "(${SECONDS}s)"
cp carry/g1.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
