#!/usr/bin/env bash
# Session 23, p9: the interposer's GPU tests with cudaMemGetInfo interposed (MoonBright's held-unused
# memory counted as free, its cap applied) and the plain CUDA program.
r=$OUT/r; mkdir -p $r
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so
SECONDS=0
(cd python/tests/gpu && timeout 250 python3 -m pytest -q -s --tb=short --durations=6 test_preload_gpu.py > $r/preload.log 2>&1; echo "preload rc=$?" >> $r/preload.log)
grep -E "^preload=|passed|failed|rc=|^E " $r/preload.log | cut -c1-700 | head -20; echo "(${SECONDS}s)"
cp carry/g8.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
