#!/usr/bin/env bash
# Session 18, m3: the threshold for large chunks. The fragmentation stress (MoonBright only,
# three rounds, the settings interleaved) and bench/large_mix.py's trace, with large_chunk at
# its default (1 GiB), 128 MiB and 64 MiB (largest_chunk 64 GiB throughout).
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $r/gpu.txt
python3 bench/large_mix.py $r/large_mix.csv.gz > $r/large_mix.txt
for round in 1 2 3; do
  for conf in "" "large_chunk:128MiB" "large_chunk:64MiB"; do
    tag=${conf:-default}; tag=${tag#large_chunk:}
    MOONBRIGHT_ALLOC_CONF="$conf" timeout 100 carry/bin/stress --no-baseline --json $r/stress_${tag}_$round.json > $r/stress_${tag}_$round.log 2>&1
    echo "stress $tag round $round rc=$? $(grep -E '^MoonBright  ' $r/stress_${tag}_$round.log)"
    if [ $round = 1 ]; then
      timeout 120 carry/bin/moonbright replay --backend cuda --conf "$conf" $r/large_mix.csv.gz > $r/replay_large_mix_$tag.log 2>&1
      echo "large_mix $tag rc=$? $(grep -E 'alloc latency' $r/replay_large_mix_$tag.log)"
    fi
  done
done
rm -f $r/large_mix.csv.gz
cp carry/m3.sh $r/run.sh
sed -i "s|$OUT|\$OUT|g" $r/*.log $r/*.txt $r/*.json 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
