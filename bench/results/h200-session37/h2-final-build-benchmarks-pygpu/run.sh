#!/usr/bin/env bash
# Session 37, h2: the final build (carve 0.0025 by default; its CUDA tests passed in h1-): every
# issue-3 benchmark (bench/run-h200.sh), single-pass replays of ResNet and GPT-2, two rounds,
# for the README's table (Llama's figures did not move in h1-), then the Python GPU tests.
r=$OUT/r; mkdir -p $r; cp carry1/h2.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
OUT=$r/steps BIN=$B timeout 260 bash bench/run-h200.sh > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
grep -E "^== |ok \(|FAILED" $r/steps.log | paste - - | head -12
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright" $r/steps/stress.log | head -3; for f in $r/steps/torch_stress_*.log; do tail -n 2 $f | head -1; done
grep -iE "^target" $r/steps/interference.log | tail -1
grep -E "mismatch|ERROR SUMMARY|carved" $r/steps/gpu_stress*.log | head -4
for round in 1 2; do
  for t in resnet gpt2; do
    n=replay_${t}_$round
    timeout 100 $B/moonbright replay --backend cuda carry1/traces/trace_$t.csv.gz --json $r/$n.json > $r/$n.log 2>&1
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
