#!/usr/bin/env bash
# Session 18, m1: large chunks of the largest power of two a need holds (largest_chunk, default
# 64 GiB) against the rule before (largest_chunk:1GiB): the latency benchmark with each, and
# replays of a synthetic mix of large allocations (bench/large_mix.py) and of GPT-2's trace.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $r/gpu.txt
python3 bench/large_mix.py $r/large_mix.csv.gz > $r/large_mix.txt
for conf in "" "largest_chunk:1GiB"; do
  tag=${conf:-default}; tag=${tag%%:*}
  for t in large_mix gpt2; do
    f=$r/large_mix.csv.gz; [ $t = gpt2 ] && f=/dev/null
    [ $t = gpt2 ] && f=carry/trace_gpt2.csv.gz
    timeout 120 carry/bin/moonbright replay --backend cuda --conf "$conf" --json $r/replay_${t}_$tag.json $f > $r/replay_${t}_$tag.log 2>&1
    echo "replay $t $tag rc=$?"; grep -E "reserved  |alloc latency|driver calls|splits" $r/replay_${t}_$tag.log
  done
done
for conf in "" "largest_chunk:1GiB"; do
  tag=${conf:-default}; tag=${tag%%:*}
  MOONBRIGHT_ALLOC_CONF="$conf" timeout 200 carry/bin/latency --json $r/latency_$tag.json > $r/latency_$tag.log 2>&1
  echo "latency $tag rc=$?"
  grep -E "\[MISSED\]" $r/latency_$tag.log; grep -E "\[(met|MISSED)\]" $r/latency_$tag.log | wc -l
  grep -E "^ +8 GiB +(MoonBright cold|MB cold|raw VMM, (one|empty))" $r/latency_$tag.log | grep -v round
done
cp carry/m1.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
