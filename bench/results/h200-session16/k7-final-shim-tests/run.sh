#!/usr/bin/env bash
# Session 16, k7: the final Python shim (dead watched storages reaped at each replay too): the
# compile tests and the graph tests.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
cd python/tests/gpu
timeout 300 python3 -m pytest -q -s --tb=short test_compile_gpu.py test_graphs_gpu.py > $r/compile-graphs.log 2>&1; echo "rc=$?" >> $r/compile-graphs.log
tail -n 3 $r/compile-graphs.log; grep -E "^FAILED" $r/compile-graphs.log
cd $OUT && tar czf r.tgz r && rm -rf r
