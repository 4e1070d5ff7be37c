#!/usr/bin/env bash
# Session 38, h2: option grow_first (new memory in one chunk before stealing cached ranges,
# while held memory stays within the fraction above the peak in use). The stress at 0 (the
# default), 0.1, 0.2 and 0.3 against PyTorch's default allocator on the same operations, two
# interleaved rounds; then three passes of ResNet and GPT-2 at 0 and 0.1.
r=$OUT/r; mkdir -p $r; cp carry1/h2.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
$B/stress --dump-ops /tmp/ops.csv > /dev/null 2>&1
for round in 1 2; do
  for v in 0 0.1 0.2 0.3 torch; do
    n=stress_grow${v}_$round
    if [ $v = torch ]; then
      n=stress_torch_$round
      timeout 150 env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF python3 bench/torch_stress.py --ops /tmp/ops.csv --json $r/$n.json > $r/$n.log 2>&1
    else
      MOONBRIGHT_ALLOC_CONF="grow_first:$v" timeout 120 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1
    fi
    echo "$v r$round rc=$? (${SECONDS}s) $(grep -E '^MoonBright  |torch_stress' $r/$n.log | tr -s ' ' | cut -c1-200) $(grep -oE 'request_maps [0-9]+|request_mapped_handles [0-9]+' $r/$n.log | head -2 | tr '\n' ' ')"
  done
done
for t in resnet gpt2; do
  for v in 0 0.1; do
    n=replay_${t}_grow${v}_x3
    timeout 100 $B/moonbright replay --backend cuda --conf "grow_first:$v" --repeat 3 carry1/traces/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
    echo "$t grow_first:$v rc=$? (${SECONDS}s) $(grep -A3 '^ *rep ' $r/$n.log | tail -3 | awk '{printf "[%s %s %s %s] ", $3, $6, $10, $11}')"
  done
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
