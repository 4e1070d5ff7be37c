#!/usr/bin/env bash
# Session 18, m4: more rounds of m3's comparison. The fragmentation stress (MoonBright only, five
# rounds, the settings interleaved) and bench/large_mix.py's trace (two rounds), with
# large_chunk at its default (1 GiB) and 128 MiB (largest_chunk 64 GiB throughout).
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $r/gpu.txt
python3 bench/large_mix.py $r/large_mix.csv.gz > $r/large_mix.txt
for round in 1 2 3 4 5; do
  for conf in "" "large_chunk:128MiB"; do
    tag=${conf:-default}; tag=${tag#large_chunk:}
    MOONBRIGHT_ALLOC_CONF="$conf" timeout 100 carry/bin/stress --no-baseline --json $r/stress_${tag}_$round.json > $r/stress_${tag}_$round.log 2>&1
    echo "stress $tag round $round rc=$? $(grep -E '^MoonBright  ' $r/stress_${tag}_$round.log)"
    if [ $round -le 2 ]; then
      timeout 120 carry/bin/moonbright replay --backend cuda --conf "$conf" $r/large_mix.csv.gz > $r/replay_large_mix_${tag}_$round.log 2>&1
      echo "large_mix $tag rc=$? $(grep -E 'alloc latency' $r/replay_large_mix_${tag}_$round.log)"
    fi
  done
done
rm -f $r/large_mix.csv.gz
cp carry/m4.sh $r/run.sh
sed -i "s|$OUT|\$OUT|g" $r/*.log $r/*.txt $r/*.json 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
