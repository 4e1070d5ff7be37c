#!/usr/bin/env bash
# Session 27, r2: A/B/C of the base build (e59f6dd, "-base"), split_joined with split_cached's
# slack ("-slack", 6c0d0d7-ish) and split_joined with exact runs (""), interleaved.
r=$OUT/r; mkdir -p $r; cp carry/g2.sh $r/run.sh
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > $r/gpu.txt
BIN=carry/bin OUT=$r ROUNDS=4 STRESS_ROUNDS=3 TRACES="resnet gpt2" bash bench/ab-h200.sh -base -slack "" 2>&1 | tee $r/ab.log
cd $OUT && tar czf r.tgz r && rm -rf r
