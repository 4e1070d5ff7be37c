#!/usr/bin/env bash
# Session 32, h1: the build with the loom clock (std Instant outside loom): CUDA test binaries,
# ResNet and GPT-2 replays (three passes), then the Python
# GPU tests of PyTorch on MoonBright.
r=$OUT/r; mkdir -p $r; cp carry1/h1.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
B=carry1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged" "ipc"; do
  set -- $t; n=$1; shift
  timeout 120 "$B/$n" "$@" --test-threads 1 >"$r/test-$n.log" 2>&1
  echo "$n rc=$? $(grep -E '^test result' "$r/test-$n.log" | tail -1 | cut -c1-60)"
done
echo "(${SECONDS}s)"
for t in resnet gpt2; do
  timeout 120 $B/moonbright replay --backend cuda --repeat 3 carry1/trace_$t.csv.gz --json $r/replay_$t.json > $r/replay_$t.log 2>&1
  echo "$t rc=$? $(grep -E 'MoonBright reserved' $r/replay_$t.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/replay_$t.log | cut -c16-) (${SECONDS}s)"
done
SITE=$(mktemp -d); export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target $SITE carry1/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
cd python/tests/gpu
left=$((585 - SECONDS))
timeout $left python3 -m pytest -v --tb=short --durations=5 test_torch_gpu.py test_graphs_gpu.py test_growable_gpu.py test_paged_attention_gpu.py test_transformers_gpu.py test_ipc_gpu.py > $r/pygpu.log 2>&1; echo "pygpu rc=$? (${SECONDS}s, limit ${left}s)" | tee -a $r/pygpu.log
tail -n 3 $r/pygpu.log | head -2; grep -E "FAILED|^ERROR" $r/pygpu.log | head
cd - >/dev/null
sed -i "s|$SITE|\$SITE|g; s|$PWD|\$REPO|g; s|$OUT|\$OUT|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
