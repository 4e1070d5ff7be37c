#!/usr/bin/env bash
# Session 36, h4: the stress under the default (max_chunk_repeated 32 MiB) and under
# max_chunk_repeated:64MiB (session 35's chunks), interleaved, four rounds; the same build as h3.
r=$OUT/r; mkdir -p $r; cp carry1/h4.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for round in 1 2 3 4; do
  for c in default max_chunk_repeated:64MiB; do
    conf=$c; [ $c = default ] && conf=""
    n=stress_${c/:/}_$round
    MOONBRIGHT_ALLOC_CONF="$conf" timeout 90 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1
    echo "stress $c $round rc=$? $(grep -E '^MoonBright  ' $r/$n.log | tr -s ' ') | $(grep -oE 'request_mapped_handles [0-9]+' $r/$n.log | head -1) (${SECONDS}s)"
  done
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g; s|/tmp/c1/bin|\$BIN|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
