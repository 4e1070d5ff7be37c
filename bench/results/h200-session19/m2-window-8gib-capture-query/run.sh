#!/usr/bin/env bash
# Session 19, m2: why the 8 GiB window hit misses (1.3-2.6x of the warm cuMemAllocAsync pair,
# not explained since session 8). The latency benchmark (no kernel part, no chunk table) with
# the defaults and with captures_announced:true (a request then makes no capture query, so a
# window hit makes no driver call at all), twice each, interleaved.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
for round in 1 2; do
  for conf in "" "captures_announced:true"; do
    tag=${conf:-default}; tag=${tag%%:*}
    MOONBRIGHT_ALLOC_CONF="$conf" timeout 140 carry/bin/latency --no-kernel --no-chunks --json $r/latency_${tag}_$round.json > $r/latency_${tag}_$round.log 2>&1
    echo "latency $tag $round rc=$? met $(grep -c '\[met\]' $r/latency_${tag}_$round.log)"
    grep -E "window hit +[0-9.]+ +[0-9.]+" $r/latency_${tag}_$round.log
    grep -E "MISSED" $r/latency_${tag}_$round.log
  done
done
cp carry/m2.sh $r/run.sh
sed -i "s|$OUT|\$OUT|g" $r/*.log $r/*.json 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
