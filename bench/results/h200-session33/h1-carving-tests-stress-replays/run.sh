#!/usr/bin/env bash
# Session 33, h1: carving (option `carve`). CUDA tests of the build (conformance includes the
# cuda_carve suite), the GPU stress test with carving, then interleaved rounds of the
# fragmentation stress at carve 0 / 0.005 / 0.01 / 0.03, and three-pass replays of ResNet and GPT-2
# at carve 0 / 0.005 / 0.03 (the budget counts against the peak bytes in use).
r=$OUT/r; mkdir -p $r; cp carry1/h1.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
B=carry1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged" "ipc"; do
  set -- $t; n=$1; shift
  timeout 120 "$B/$n" "$@" --test-threads 1 >"$r/test-$n.log" 2>&1
  echo "$n rc=$? $(grep -E '^test result' "$r/test-$n.log" | tail -1 | cut -c1-60)"
done
echo "(${SECONDS}s)"
MOONBRIGHT_ALLOC_CONF="carve:0.1" timeout 120 $B/gpu_stress > $r/gpu_stress_carve0.1.log 2>&1
echo "gpu_stress carve:0.1 rc=$? $(tail -n 2 $r/gpu_stress_carve0.1.log | tr '\n' ' ') (${SECONDS}s)"
for round in 1 2 3; do
  for c in 0 0.005 0.01 0.03; do
    n=stress_carve${c}_$round
    MOONBRIGHT_ALLOC_CONF="carve:$c" timeout 100 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1
    echo "$round carve:$c rc=$? $(grep -E '^MoonBright  ' $r/$n.log | tr -s ' ') $(grep -oE 'request_maps [0-9]+|request_mapped_handles [0-9]+' $r/$n.log | tr '\n' ' ')"
  done
done
echo "(${SECONDS}s)"
for t in resnet gpt2; do
  for c in 0 0.005 0.03; do
    n=replay_${t}_carve$c
    timeout 100 $B/moonbright replay --backend cuda --conf carve:$c --repeat 3 carry1/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
    echo "$t carve:$c rc=$? $(grep -E 'MoonBright reserved' $r/$n.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/$n.log | cut -c16-) (${SECONDS}s)"
  done
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
