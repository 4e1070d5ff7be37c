#!/usr/bin/env bash
# Session 36, h5: the final library (e7bdc05: max_chunk_repeated opt-in, 0 by default): the
# CUDA and host test binaries, then three passes of each trace under the default and under
# max_chunk_repeated:32MiB, one round.
r=$OUT/r; mkdir -p $r; cp carry1/h5.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for t in "unit driver::cuda" "conformance" "faults" "capture" "growable" "streams" "paged" "ipc"; do
  set -- $t; n=$1; shift
  timeout 120 "$B/$n" "$@" --test-threads 1 >"$r/test-$n.log" 2>&1
  echo "$n rc=$? $(grep -E '^test result' "$r/test-$n.log" | tail -1 | cut -c1-60)"
done
echo "(${SECONDS}s)"
for t in resnet gpt2 llama; do
  for c in default max_chunk_repeated:32MiB; do
    conf=$c; [ $c = default ] && conf=""
    n=replay_${t}_${c/:/}_x3
    timeout 100 $B/moonbright replay --backend cuda --conf "$conf" --repeat 3 carry1/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
    echo "$t $c rc=$? (${SECONDS}s) $(grep -A3 '^ *rep ' $r/$n.log | tail -3 | awk '{printf "[%s %s %s %s] ", $3, $6, $10, $11}')"
  done
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g; s|/tmp/c1/bin|\$BIN|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
