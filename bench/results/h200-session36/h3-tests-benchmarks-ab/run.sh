#!/usr/bin/env bash
# Session 36, h3: the build with max_chunk_repeated at 32 MiB by default (this commit): CUDA
# test binaries, every issue-3 benchmark (bench/run-h200.sh), three-pass replays of the three
# traces against `--conf max_chunk_repeated:64MiB` (session 35's chunks), interleaved, two
# rounds, single passes for the README's table, then the Python GPU tests.
r=$OUT/r; mkdir -p $r; cp carry1/h3.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged" "ipc"; do
  set -- $t; n=$1; shift
  timeout 120 "$B/$n" "$@" --test-threads 1 >"$r/test-$n.log" 2>&1
  echo "$n rc=$? $(grep -E '^test result' "$r/test-$n.log" | tail -1 | cut -c1-60)"
done
echo "(${SECONDS}s)"
OUT=$r/steps BIN=$B timeout 240 bash bench/run-h200.sh > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
grep -E "^== |ok \(|FAILED" $r/steps.log | paste - - | head -12
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright" $r/steps/stress.log | head -3; for f in $r/steps/torch_stress_*.log; do tail -n 2 $f | head -1; done
grep -iE "^target" $r/steps/interference.log | tail -1
grep -E "mismatch|ERROR SUMMARY|carved" $r/steps/gpu_stress*.log | head -4
for round in 1 2; do
  for t in resnet gpt2 llama; do
    for c in default max_chunk_repeated:64MiB; do
      conf=$c; [ $c = default ] && conf=""
      n=replay_${t}_${c/:/}_x3_$round
      timeout 100 $B/moonbright replay --backend cuda --conf "$conf" --repeat 3 carry1/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
      echo "$round $t $c rc=$? (${SECONDS}s) $(grep -A3 '^ *rep ' $r/$n.log | tail -3 | awk '{printf "[%s %s %s %s] ", $3, $6, $10, $11}') $(grep '^alloc latency' $r/$n.log | cut -c16-60)"
    done
  done
done
for round in 1 2; do
  for t in resnet gpt2 llama; do
    n=replay_${t}_$round
    timeout 100 $B/moonbright replay --backend cuda carry1/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
    echo "$round $t rc=$? $(grep -E 'MoonBright reserved' $r/$n.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/$n.log | cut -c16-) (${SECONDS}s)"
  done
done
SITE=$(mktemp -d); export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target $SITE carry1/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
cd python/tests/gpu
left=$((590 - SECONDS))
timeout $left python3 -m pytest -v --tb=short --durations=5 test_torch_gpu.py test_graphs_gpu.py test_growable_gpu.py test_paged_attention_gpu.py test_transformers_gpu.py test_ipc_gpu.py > $r/pygpu.log 2>&1; echo "pygpu rc=$? (${SECONDS}s, limit ${left}s)" | tee -a $r/pygpu.log
tail -n 3 $r/pygpu.log | head -2; grep -E "FAILED|^ERROR" $r/pygpu.log | head
cd - >/dev/null
sed -i "s|$SITE|\$SITE|g; s|$PWD|\$REPO|g; s|$OUT|\$OUT|g; s|/tmp/c1/bin|\$BIN|g" $r/*.log $r/steps/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
