#!/usr/bin/env bash
# Session 26, g4: the final build's (1ecff38) Python GPU tests of PyTorch on MoonBright (torch,
# graphs and graph trees, transformers, growable, paged attention).
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl 2>&1 | grep -v WARNING
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
(cd python/tests/gpu && timeout 560 python3 -m pytest -q --tb=short --durations=5 test_torch_gpu.py test_graphs_gpu.py test_transformers_gpu.py test_growable_gpu.py test_paged_attention_gpu.py > $r/pygpu.log 2>&1; echo "pygpu rc=$?" >> $r/pygpu.log)
tail -n 9 $r/pygpu.log; grep -E "^FAILED|^ERROR" $r/pygpu.log | head
echo "(${SECONDS}s)"
cp carry/g4.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
