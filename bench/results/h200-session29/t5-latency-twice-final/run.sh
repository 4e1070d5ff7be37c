#!/usr/bin/env bash
# Session 29, t5: the latency benchmark twice more on the final build (the cold-map rows' spread).
r=$OUT/r; mkdir -p $r; cp carry/g5.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
for i in 1 2; do
  timeout 200 carry/bin/latency --json $r/latency_$i.json > $r/latency_$i.log 2>&1
  echo "latency $i rc=$? (${SECONDS}s) $(grep -cE '\[met\]' $r/latency_$i.log) met"
  grep -E "\[MISSED\]" $r/latency_$i.log
  grep -A7 "alloc p50 over raw VMM's, in its own" $r/latency_$i.log
done
sed -i -E "s|$PWD|\$REPO|g; s#/tmp/tmp\.[A-Za-z0-9]+#\$TMPDIR#g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
