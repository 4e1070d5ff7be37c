#!/usr/bin/env bash
# Session 27, r5: the CUDA test binaries on the final build (4136d52), and its stress once more.
r=$OUT/r; mkdir -p $r; cp carry/g5.sh $r/run.sh
BIN=carry/bin OUT=$r TESTS=1 ROUNDS=0 STRESS_ROUNDS=1 bash bench/ab-h200.sh "" 2>&1 | tee $r/ab.log
cd $OUT && tar czf r.tgz r && rm -rf r
