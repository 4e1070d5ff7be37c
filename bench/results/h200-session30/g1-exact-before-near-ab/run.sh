#!/usr/bin/env bash
# Session 30, g1: exact before near (88efd48) against 572a670, interleaved: the CUDA
# conformance, fault and stream tests of the new build, then the three traces (ResNet and GPT-2
# three rounds, Llama one) and the fragmentation stress (three rounds).
r=$OUT/r; mkdir -p $r; cp carry1/g1.sh $r/run.sh
SECONDS=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
BIN=carry1/bin OUT=$r/ab TESTS=1 ROUNDS=3 TRACES="resnet gpt2" STRESS_ROUNDS=0 TRACE_DIR=carry1 \
  timeout 300 bash bench/ab-h200.sh -base "" 2>&1 | tee $r/ab.log
BIN=carry1/bin OUT=$r/ab ROUNDS=1 TRACES="llama" STRESS_ROUNDS=3 TRACE_DIR=carry1 \
  timeout 250 bash bench/ab-h200.sh -base "" 2>&1 | tee -a $r/ab.log
echo "(${SECONDS}s)"
sed -i "s|$PWD|\$REPO|g" $r/*.log $r/ab/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
