#!/usr/bin/env bash
# Session 28, s1: the build that steals only cached ranges with a chunk a plan can map and
# finds joins through groups of cached neighbours by size (77fffd8) against the build before
# (0416462, "-base"): the CUDA test binaries, four interleaved rounds of the traces and of the
# stress, then gpu_stress, its memcheck run and the interference benchmark on the new build.
r=$OUT/r; mkdir -p $r; cp carry/g1.sh $r/run.sh
BIN=carry/bin OUT=$r TESTS=1 ROUNDS=4 STRESS_ROUNDS=4 TRACES="resnet gpt2" bash bench/ab-h200.sh -base "" 2>&1 | tee $r/ab.log
SECONDS=0
OUT=$r/steps BIN=carry/bin timeout 330 bash bench/run-h200.sh gpu_stress sanitizer interference > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
rm -f $r/steps/nvrtc.txt
grep -E "^== |ok \(|FAILED" $r/steps.log | paste - - | head -12
grep -iE "^target" $r/steps/interference.log | tail -3
grep -E "mismatch|ERROR SUMMARY" $r/steps/gpu_stress*.log | head -4
cd $OUT && tar czf r.tgz r && rm -rf r
