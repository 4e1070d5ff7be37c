#!/usr/bin/env bash
# Session 18, m6: m5 missed the cold 1 GiB map in an empty allocator (1.54x raw VMM): the
# latency benchmark again, with the default threshold (128 MiB) and with large_chunk:1GiB,
# twice each, interleaved.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
for round in 1 2; do
  for conf in "" "large_chunk:1GiB"; do
    tag=${conf:-default}; tag=${tag#large_chunk:}
    MOONBRIGHT_ALLOC_CONF="$conf" timeout 120 carry/bin/latency --no-chunks --json $r/latency_${tag}_$round.json > $r/latency_${tag}_$round.log 2>&1
    echo "latency $tag $round rc=$? met $(grep -c '\[met\]' $r/latency_${tag}_$round.log)"
    grep -E "\[MISSED\]" $r/latency_${tag}_$round.log
    grep -E "1 GiB +cold, empty" $r/latency_${tag}_$round.log
  done
done
cp carry/m6.sh $r/run.sh
sed -i "s|$OUT|\$OUT|g" $r/*.log $r/*.json 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
