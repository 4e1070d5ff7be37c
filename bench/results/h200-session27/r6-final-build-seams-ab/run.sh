#!/usr/bin/env bash
# Session 27, r6: the final build (e6da5e8, joins found through the seams index) against the
# build before (4136d52, "-prev", the same policy with a scan of every cached range): the
# CUDA test binaries, then the traces and the stress interleaved.
r=$OUT/r; mkdir -p $r; cp carry/g6.sh $r/run.sh
BIN=carry/bin OUT=$r TESTS=1 ROUNDS=2 STRESS_ROUNDS=2 TRACES="resnet gpt2" bash bench/ab-h200.sh -prev "" 2>&1 | tee $r/ab.log
cd $OUT && tar czf r.tgz r && rm -rf r
