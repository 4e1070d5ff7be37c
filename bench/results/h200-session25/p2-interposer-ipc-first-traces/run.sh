#!/usr/bin/env bash
# Session 25, g2: the interposer's CUDA IPC handles (torch.multiprocessing unmodified under
# LD_PRELOAD) with the rest of the interposer's GPU tests, and the three recorded traces
# replayed on the GPU (README's H200 column).
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
for t in resnet gpt2 llama; do
  timeout 120 carry/bin/moonbright replay --backend cuda carry/trace_$t.csv.gz > $r/replay_$t.log 2>&1; echo "replay $t rc=$? (${SECONDS}s)"
  grep -iE "ratio|reserved|p99" $r/replay_$t.log | head -6
done
export MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so
(cd python/tests/gpu && timeout 420 python3 -m pytest -q -s --tb=short -k "multiprocessing" test_preload_gpu.py > $r/preload-ipc.log 2>&1; echo "rc=$?" >> $r/preload-ipc.log)
tail -n 5 $r/preload-ipc.log; grep -E "^(preload|runtime):" $r/preload-ipc.log | cut -c1-600
echo "(${SECONDS}s)"
(cd python/tests/gpu && timeout 300 python3 -m pytest -q -s --tb=short -k "not multiprocessing" test_preload_gpu.py > $r/preload-rest.log 2>&1; echo "rc=$?" >> $r/preload-rest.log)
tail -n 4 $r/preload-rest.log
echo "(${SECONDS}s)"
cp carry/g2.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
