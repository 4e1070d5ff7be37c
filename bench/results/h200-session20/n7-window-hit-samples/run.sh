#!/usr/bin/env bash
# Session 20, n7: per-sample window-hit times at 1 and 8 GiB inside the latency benchmark
# (`--samples`), with the defaults twice and with captures_announced (a hit makes no driver
# call) once, to see which hits of a run are slow.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in default_1 announced default_2; do
  conf=""; [ $t = announced ] && conf="captures_announced:true"
  MOONBRIGHT_ALLOC_CONF=$conf timeout 60 carry/bin/latency --sizes 1073741824,8589934592 --no-kernel --no-chunks --samples --json $r/latency_$t.json > $r/latency_$t.log 2>&1
  echo "$t rc=$?"; grep -E "window hit +[0-9.]+ +[0-9.]+" $r/latency_$t.log
done
cp carry/n7.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
