#!/usr/bin/env bash
# Session 27, r1: A/B of the base build (e59f6dd, "-base") and split_joined (""), interleaved;
# the CUDA test binaries of the new build first.
r=$OUT/r; mkdir -p $r; cp carry/g1.sh $r/run.sh
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > $r/gpu.txt
BIN=carry/bin OUT=$r ROUNDS=3 STRESS_ROUNDS=3 TRACES="resnet gpt2" bash bench/ab-h200.sh -base "" 2>&1 | tee $r/ab.log
cd $OUT && tar czf r.tgz r && rm -rf r
