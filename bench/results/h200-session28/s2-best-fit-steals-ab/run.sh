#!/usr/bin/env bash
# Session 28, s2: the build that steals the cached range with the largest chunk that fits
# (c052955; its policy is 09f1e0b's) against 77fffd8 ("-first": the least recently freed range with a
# chunk that fits) and 0416462 ("-base": every range in freeing order): the CUDA test binaries
# (ipc left out for room), four interleaved rounds of the traces and of the stress, gpu_stress.
r=$OUT/r; mkdir -p $r; cp carry/g2.sh $r/run.sh
BIN=carry/bin OUT=$r TESTS=1 ROUNDS=4 STRESS_ROUNDS=4 TRACES="resnet gpt2" bash bench/ab-h200.sh -base -first "" 2>&1 | tee $r/ab.log
SECONDS=0
OUT=$r/steps BIN=carry/bin timeout 200 bash bench/run-h200.sh gpu_stress sanitizer > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"; rm -f $r/steps/nvrtc.txt
grep -E "mismatch|ERROR SUMMARY" $r/steps/gpu_stress*.log | head -4
cd $OUT && tar czf r.tgz r && rm -rf r
