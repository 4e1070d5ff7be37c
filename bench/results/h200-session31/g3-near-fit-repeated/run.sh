#!/usr/bin/env bash
# Session 31, g3: option near_fit (0.125, the default; 0.25; 0.5) over repeated replays of
# ResNet-50 and GPT-2 (`moonbright replay --repeat 5`), the three settings interleaved, two
# rounds.
r=$OUT/r; mkdir -p $r; cp carry1/g3.sh $r/run.sh
SECONDS=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for round in 1 2; do
  for n in resnet gpt2; do
    for nf in 0.125 0.25 0.5; do
      name=${n}_near-${nf}_$round
      timeout 100 carry1/bin/moonbright replay --backend cuda carry1/trace_$n.csv.gz --repeat 5 \
        --conf near_fit:$nf --json $r/$name.json > $r/$name.log 2>&1
      echo "$name rc=$? (${SECONDS}s)"; sed -n '/^   rep/,/^$/p' $r/$name.log
    done
  done
done 2>&1 | tee $r/g3.log
sed -i "s|$PWD|\$REPO|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
