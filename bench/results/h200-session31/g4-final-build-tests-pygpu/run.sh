#!/usr/bin/env bash
# Session 31, g4: the final build: CUDA test binaries, the latency benchmark's cold maps at the
# three small sizes (the request path's wait clock changed), a ResNet replay, then the Python
# GPU tests of PyTorch on MoonBright.
r=$OUT/r; mkdir -p $r; cp carry1/g4.sh $r/run.sh
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
timeout 120 $B/latency --sizes 256,65536,2097152 --no-kernel --no-chunks --json $r/latency.json > $r/latency.log 2>&1
echo "latency rc=$? (${SECONDS}s)"; grep -E "cold, beside|alloc p50 over raw" -A0 $r/latency.log | tail -4
timeout 60 $B/moonbright replay --backend cuda carry1/trace_resnet.csv.gz > $r/replay_resnet.log 2>&1
echo "resnet rc=$? $(grep -E 'MoonBright reserved' $r/replay_resnet.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/replay_resnet.log | cut -c16-)"
SITE=$(mktemp -d); export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target $SITE carry1/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
cd python/tests/gpu
left=$((585 - SECONDS))
timeout $left python3 -m pytest -v --tb=short --durations=5 test_torch_gpu.py test_graphs_gpu.py test_growable_gpu.py test_paged_attention_gpu.py test_transformers_gpu.py test_ipc_gpu.py > $r/pygpu.log 2>&1; echo "pygpu rc=$? (${SECONDS}s, limit ${left}s)" | tee -a $r/pygpu.log
tail -n 3 $r/pygpu.log | head -2; grep -E "FAILED|^ERROR" $r/pygpu.log | head
cd - >/dev/null
sed -i "s|$SITE|\$SITE|g; s|$PWD|\$REPO|g; s|$OUT|\$OUT|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
