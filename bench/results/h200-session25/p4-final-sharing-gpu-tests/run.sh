#!/usr/bin/env bash
# Session 25, g5: the final build's Python GPU tests of sharing: moonbright.ipc (a typed storage
# through torch.multiprocessing; the two-GPU test skips on one GPU) and the interposer's
# (moonbright.preload.report() now reads its report).
r=$OUT/r; mkdir -p $r
SITE=${SITE:-$SITE}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
export MOONBRIGHT_ALLOC_CONF=""
export MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so
SECONDS=0
(cd python/tests/gpu && timeout 540 python3 -m pytest -q -s -rs --tb=short test_ipc_gpu.py test_preload_gpu.py > $r/pygpu.log 2>&1; echo "rc=$?" >> $r/pygpu.log)
tail -n 6 $r/pygpu.log; grep -E '"typed"|^FAILED|^ERROR' $r/pygpu.log | cut -c1-300
echo "(${SECONDS}s)"
cp carry/g5.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
