#!/usr/bin/env bash
# Session 20, n1: whole window chunks for large fresh requests. CUDA test binaries (the
# conformance suite has the new whole-chunk test), hitprobe --run 4 and the latency benchmark
# (no kernel part, no chunk table) with the build before (eb38758, bin-old) and after,
# interleaved, then the other issue-3 benchmarks with the new build.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
cat $r/tests.txt | tr '\n' ' '; echo "(${SECONDS}s)"
grep -E "whole_window|test result" $r/test-conformance.log
for b in old new; do
  bin=carry/bin; [ $b = old ] && bin=carry/bin-old
  timeout 100 $bin/hitprobe --run 4 > $r/hitprobe_run4_$b.log 2>&1; echo "hitprobe $b rc=$? (${SECONDS}s)"; grep -E "8 GiB" $r/hitprobe_run4_$b.log
done
for t in new_1 old_1 new_2 old_2; do
  bin=carry/bin; [ ${t%_*} = old ] && bin=carry/bin-old
  timeout 100 $bin/latency --no-kernel --no-chunks --json $r/latency_$t.json > $r/latency_$t.log 2>&1
  echo "latency $t rc=$? met $(grep -c '\[met\]' $r/latency_$t.log) (${SECONDS}s)"
  grep -E "window hit +[0-9.]+ +[0-9.]+" $r/latency_$t.log
  grep -E "MISSED" $r/latency_$t.log
done
OUT=$r/steps BIN=carry/bin timeout 150 bash bench/run-h200.sh stress interference gpu_stress sanitizer > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
grep -E "gpu_stress:|ERROR SUMMARY" $r/steps/gpu_stress*.log
grep -E "^MoonBright  " $r/steps/stress.log; grep -iE "target" $r/steps/interference.log | tail -1
cp carry/n1.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
