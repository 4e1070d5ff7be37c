#!/usr/bin/env bash
# Session 38, h3: option grow_first as committed (new memory in one chunk before stealing while
# held memory stays within the fraction above the peak in use; carving may leave unused what
# room that budget has). The CUDA conformance suites (cuda_grow_first among them); the stress
# (its rows: default, no window, grow_first 0.3) and the stress at grow_first 0.1 and 0.2
# (first row), against PyTorch's default allocator on the same operations, two interleaved
# rounds; three passes of ResNet and GPT-2 at 0 and 0.3.
r=$OUT/r; mkdir -p $r; cp carry1/h3.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
timeout 300 $B/conformance cuda --test-threads 1 > $r/test-conformance-cuda.log 2>&1
echo "conformance cuda rc=$? $(grep -E '^test result' $r/test-conformance-cuda.log | tail -1 | cut -c1-70) (${SECONDS}s)"
$B/stress --dump-ops /tmp/ops.csv > /dev/null 2>&1
for round in 1 2; do
  for v in rows 0.1 0.2 torch; do
    n=stress_${v}_$round
    case $v in
      rows) MOONBRIGHT_ALLOC_CONF="" timeout 150 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1 ;;
      torch) timeout 150 env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF python3 bench/torch_stress.py --ops /tmp/ops.csv --json $r/$n.json > $r/$n.log 2>&1 ;;
      *) MOONBRIGHT_ALLOC_CONF="grow_first:$v" timeout 150 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1 ;;
    esac
    echo "$v r$round rc=$? (${SECONDS}s)"; grep -E '^MoonBright|torch_stress' $r/$n.log | tr -s ' ' | cut -c1-160
  done
done
for t in resnet gpt2; do
  for v in 0 0.3; do
    n=replay_${t}_grow${v}_x3
    timeout 100 $B/moonbright replay --backend cuda --conf "grow_first:$v" --repeat 3 carry1/traces/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
    echo "$t grow_first:$v rc=$? (${SECONDS}s) $(grep -A3 '^ *rep ' $r/$n.log | tail -3 | awk '{printf "[%s %s %s %s] ", $3, $6, $10, $11}')"
  done
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
