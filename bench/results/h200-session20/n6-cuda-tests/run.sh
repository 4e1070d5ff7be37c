#!/usr/bin/env bash
# Session 20, n6: the last commit's CUDA test binaries (the conformance suite gained a test of a
# failed whole window refill since n5).
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
cat $r/tests.txt | tr '\n' ' '; echo
grep -E "whole_window|test result" $r/test-conformance.log
cp carry/n6.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
