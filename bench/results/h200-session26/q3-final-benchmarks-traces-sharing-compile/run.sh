#!/usr/bin/env bash
# Session 26, g3: the final build (1ecff38): every issue-3 benchmark (stress against PyTorch's
# three backends, latency, PyTorch's latency, interference, gpu_stress and its memcheck run,
# plots); the three traces; the Python GPU tests of the interposer, of moonbright.ipc and of
# torch.compile.
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
export MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so
SECONDS=0
OUT=$r/steps BIN=carry/bin timeout 300 bash bench/run-h200.sh > $r/steps.log 2>&1
echo "steps rc=$? (${SECONDS}s)"
rm -f $r/steps/stress_ops.csv $r/steps/nvrtc.txt
grep -E "^== |ok \(|FAILED" $r/steps.log | paste - - | head -20
grep -E "\[MISSED\]" $r/steps/latency.log; grep -E "\[(met|MISSED)\]" $r/steps/latency.log | wc -l
grep -E "^MoonBright|^PyTorch" $r/steps/stress.log | head -3; for f in $r/steps/torch_stress_*.log; do tail -n 2 $f; done
grep -iE "target|slowdown" $r/steps/interference.log | tail -3
grep -E "mismatch|ERROR SUMMARY" $r/steps/gpu_stress*.log | head -4
for t in llama gpt2 resnet; do
  timeout 120 carry/bin/moonbright replay --backend cuda carry/trace_$t.csv.gz --json $r/replay_$t.json > $r/replay_$t.log 2>&1
  echo "$t rc=$? $(grep -E 'MoonBright reserved' $r/replay_$t.log | tr -s ' ' | cut -d' ' -f5-) | $(grep -E '^alloc latency' $r/replay_$t.log | cut -c16-)"
done
echo "(${SECONDS}s)"
(cd python/tests/gpu && timeout 200 python3 -m pytest -q -rs --tb=short test_ipc_gpu.py test_preload_gpu.py > $r/pygpu_sharing.log 2>&1; echo "rc=$?" >> $r/pygpu_sharing.log)
tail -n 4 $r/pygpu_sharing.log; echo "(${SECONDS}s)"
(cd python/tests/gpu && timeout 250 python3 -m pytest -q -s --tb=short --durations=6 test_compile_gpu.py > $r/pygpu_compile.log 2>&1; echo "rc=$?" >> $r/pygpu_compile.log)
grep -E "passed|failed|rc=" $r/pygpu_compile.log | tail -2; echo "(${SECONDS}s)"
cp carry/g3.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
