#!/usr/bin/env bash
# Session 36, h2: new chunks of a repeated size cut at 32 MiB (temporary build, MB_REPDIV=2)
# against the default 64 MiB: three passes of each trace under both, interleaved, and the
# stress under both; three rounds.
r=$OUT/r; mkdir -p $r; cp carry1/h2.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for round in 1 2 3; do
  for t in resnet gpt2 llama; do
    for c in default repdiv2; do
      conf=""; export MB_REPDIV=1; [ $c = repdiv2 ] && export MB_REPDIV=2
      n=replay_${t}_${c/:/}_$round
      timeout 60 $B/moonbright replay --backend cuda --conf "$conf" --repeat 3 carry1/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
      echo "$round $t $c rc=$? (${SECONDS}s) $(grep -A3 '^ *rep ' $r/$n.log | tail -3 | awk '{printf "[%s %s %s %s] ", $3, $6, $10, $11}')"
    done
  done
  for c in default repdiv2; do
    conf=""; export MB_REPDIV=1; [ $c = repdiv2 ] && export MB_REPDIV=2
    n=stress_${c/:/}_$round
    MOONBRIGHT_ALLOC_CONF="$conf" timeout 90 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1
    echo "stress $c $round rc=$? $(grep -E '^MoonBright  ' $r/$n.log | tr -s ' ') (${SECONDS}s)"
  done
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g; s|/tmp/c1/bin|\$BIN|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
