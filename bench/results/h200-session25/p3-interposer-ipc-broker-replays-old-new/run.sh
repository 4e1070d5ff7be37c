#!/usr/bin/env bash
# Session 25, g3: the interposer's CUDA IPC after the broker's redesign (it exports again for
# each importer, holding no descriptor): the preload GPU tests, and bench/ipc_pairs.py with and
# without the interposer (its CUDA column is then the interposer's cudaIpc on MoonBright's
# memory). Then the traces replayed by this build and by 10e208c's (the README's old H200
# column), interleaved, to tell a change of build from a change of machine.
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
export MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so
(cd python/tests/gpu && timeout 300 python3 -m pytest -q -s --tb=short test_preload_gpu.py > $r/preload-tests.log 2>&1; echo "rc=$?" >> $r/preload-tests.log)
tail -n 3 $r/preload-tests.log; grep -E "^preload: \{\"seen" $r/preload-tests.log | cut -c1-300
echo "(${SECONDS}s)"
timeout 150 python3 bench/ipc_pairs.py --json $r/ipc_pairs_runtime.json > $r/ipc_pairs_runtime.log 2>&1; echo "runtime rc=$?"
LD_PRELOAD=$MOONBRIGHT_PRELOAD_LIB timeout 150 python3 bench/ipc_pairs.py --json $r/ipc_pairs_preload.json > $r/ipc_pairs_preload.log 2>&1; echo "preload rc=$?"
cat $r/ipc_pairs_runtime.log $r/ipc_pairs_preload.log | grep -vE "^\s*$"
echo "(${SECONDS}s)"
for round in 1 2; do
  for t in resnet gpt2 llama; do
    for b in moonbright-old moonbright; do
      timeout 60 carry/bin/$b replay --backend cuda carry/trace_$t.csv.gz > $r/replay_${t}_${b}_$round.log 2>&1
      echo "$round $t $b rc=$? $(grep -E 'MoonBright reserved' $r/replay_${t}_${b}_$round.log | tr -s ' ') | $(grep -E '^alloc latency' $r/replay_${t}_${b}_$round.log)"
    done
  done
done
echo "(${SECONDS}s)"
cp carry/g3.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
