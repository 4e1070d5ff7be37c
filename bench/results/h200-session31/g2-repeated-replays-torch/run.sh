#!/usr/bin/env bash
# Session 31, g2: each trace replayed several times through one allocator, MoonBright
# (`moonbright replay --repeat`) and PyTorch's default and expandable-segments allocators
# (`bench/torch_replay.py --repeat`, one process each), the same requests for all three.
r=$OUT/r; mkdir -p $r; cp carry1/g2.sh $r/run.sh
SECONDS=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for t in resnet:5 gpt2:5 llama:3; do
  n=${t%%:*}; k=${t##*:}
  timeout 150 carry1/bin/moonbright replay --backend cuda carry1/trace_$n.csv.gz --repeat $k \
    --json $r/mb_$n.json > $r/mb_$n.log 2>&1
  echo "$n moonbright rc=$? (${SECONDS}s)"; sed -n '/^repeated/,/^$/p' $r/mb_$n.log
  for conf in "" "expandable_segments:True"; do
    tag=${conf:+expandable}; tag=${tag:-default}
    PYTORCH_ALLOC_CONF=$conf timeout 200 python3 bench/torch_replay.py carry1/trace_$n.csv.gz \
      --repeat $k --json $r/torch_${tag}_$n.json > $r/torch_${tag}_$n.log 2>&1
    echo "$n torch $tag rc=$? (${SECONDS}s)"; cat $r/torch_${tag}_$n.log | tail -$k
  done
done 2>&1 | tee $r/g2.log
sed -i "s|$PWD|\$REPO|g; s|<$OUT on that machine>|\$OUT|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
