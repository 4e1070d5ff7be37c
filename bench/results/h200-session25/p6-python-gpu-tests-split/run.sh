#!/usr/bin/env bash
# Session 25, g7: the Python GPU tests of PyTorch on MoonBright (torch, graphs and graph trees,
# transformers, growable, paged attention) on the build with the cached-range split, which
# changes which ranges requests get back.
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_ALLOC_CONF=""
SECONDS=0
(cd python/tests/gpu && timeout 450 python3 -m pytest -q --tb=short --durations=5 test_torch_gpu.py test_graphs_gpu.py test_transformers_gpu.py test_growable_gpu.py test_paged_attention_gpu.py > $r/pygpu.log 2>&1; echo "pygpu rc=$?" >> $r/pygpu.log)
tail -n 9 $r/pygpu.log; grep -E "^FAILED|^ERROR" $r/pygpu.log | head
echo "(${SECONDS}s)"
cp carry/g7.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
