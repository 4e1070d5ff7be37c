#!/usr/bin/env bash
# Session 29, t4: the final build's CUDA tests, gpu_stress (and under memcheck), two traces, one
# stress; scale with the scatter's ranges left retired, this build against 3b989d0 (a request
# with no addresses unmapped every retired range first).
r=$OUT/r; mkdir -p $r; cp carry/g4.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
B=carry/bin
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged" "ipc"; do
  set -- $t; n=$1; shift
  timeout 120 "$B/$n" "$@" --test-threads 1 >"$r/test-$n.log" 2>&1
  echo "$n rc=$? $(grep -E '^test result' "$r/test-$n.log" | tail -1 | cut -c1-60)"
done
echo "(${SECONDS}s)"
timeout 120 $B/gpu_stress --json $r/gpu_stress.json > $r/gpu_stress.log 2>&1; echo "gpu_stress rc=$? $(tail -1 $r/gpu_stress.log)"
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout 200 "$cs" --tool memcheck --error-exitcode 3 $B/gpu_stress --threads 3 --ops 300 --max-mib 16 --live-gib 1 --cap-gib 8 > $r/gpu_stress_memcheck.log 2>&1; echo "memcheck rc=$? $(grep -E 'PASSED|ERROR SUMMARY' $r/gpu_stress_memcheck.log | tr '\n' ' ')"
for t in gpt2 resnet; do
  timeout 120 $B/moonbright replay --backend cuda carry/trace_$t.csv.gz --json $r/replay_$t.json > $r/replay_$t.log 2>&1
  echo "$t rc=$? $(grep -E 'MoonBright reserved' $r/replay_$t.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/replay_$t.log | cut -c16-)"
done
timeout 150 $B/stress --no-baseline --json $r/stress.json > $r/stress.log 2>&1; echo "stress rc=$? $(grep -E '^MoonBright  ' $r/stress.log | tr -s ' ')"
echo "(${SECONDS}s)"
for b in -base ""; do
  timeout 200 $B/scale$b --no-baseline --keep-retired --json $r/scale${b}_keep_retired.json > $r/scale${b}_keep_retired.log 2>&1
  echo "scale$b rc=$? $(grep -E '^whole' $r/scale${b}_keep_retired.log | tr -s ' ')"
done
echo "(${SECONDS}s)"
sed -i "s|$PWD|\$REPO|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
