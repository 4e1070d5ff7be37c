#!/usr/bin/env bash
# Session 22, g1: e63a7f6 on the H200. CUDA test binaries (incl. libs: libcuda/libnvrtc checked
# once and kept loaded); window hits at 1 and 8 GiB per sample, builds before (9be5904) and after
# (e63a7f6) the worker grew the heap's tables ahead (8cd85c7), interleaved, three rounds each;
# then the issue-3 benchmarks.
r=$OUT/r; mkdir -p $r/ab
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
for t in "unit driver::cuda libs" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
cat $r/tests.txt | tr '\n' ' '; echo "(${SECONDS}s)"
grep -E "test result" $r/test-unit.log
for i in 1 2 3; do
  for b in old new; do
    bin=carry/bin/latency; [ $b = old ] && bin=carry/old/latency
    timeout 60 $bin --sizes 1073741824,8589934592 --no-kernel --no-chunks --samples --json $r/ab/latency_${b}_$i.json > $r/ab/latency_${b}_$i.log 2>&1
    echo "$b $i rc=$? (${SECONDS}s)"; grep -E "window hit +[0-9.]+ +[0-9.]+" $r/ab/latency_${b}_$i.log
  done
done
OUT=$r/steps BIN=carry/bin timeout 220 bash bench/run-h200.sh latency stress interference gpu_stress sanitizer > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "target" $r/steps/interference.log | tail -1
cp carry/g1.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
