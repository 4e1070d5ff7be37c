#!/usr/bin/env bash
# Session 19, m3: a window hit no longer removes the segment it empties (window.rs). hitprobe
# --run 4 (every position of runs of four fresh hits; idle: the run empties the window) with the
# build before and after, then the latency benchmark twice with the new build (no kernel part,
# no chunk table) and once with the old, interleaved.
r=$OUT/r; mkdir -p $r
source scripts/nvrtc-env.sh >/dev/null 2>&1
for b in old new; do
  bin=carry/bin; [ $b = old ] && bin=carry/bin-old
  timeout 120 $bin/hitprobe --run 4 > $r/hitprobe_run4_$b.log 2>&1; echo "hitprobe $b rc=$?"; tail -12 $r/hitprobe_run4_$b.log
done
for t in new_1 old_1 new_2; do
  bin=carry/bin; [ ${t%_*} = old ] && bin=carry/bin-old
  timeout 140 $bin/latency --no-kernel --no-chunks --json $r/latency_$t.json > $r/latency_$t.log 2>&1
  echo "latency $t rc=$? met $(grep -c '\[met\]' $r/latency_$t.log)"
  grep -E "window hit +[0-9.]+ +[0-9.]+" $r/latency_$t.log
  grep -E "MISSED" $r/latency_$t.log
done
cp carry/m3.sh $r/run.sh
sed -i "s|$OUT|\$OUT|g" $r/*.log $r/*.json 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
