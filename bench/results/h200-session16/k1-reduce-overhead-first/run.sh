#!/usr/bin/env bash
# Session 16, k1: torch.compile(mode="reduce-overhead") under MoonBright (CUDA-graph trees), and
# the graph tests again.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
cd python/tests/gpu
timeout 380 python3 -m pytest -q -s --tb=long test_compile_gpu.py > $r/compile.log 2>&1; echo "compile rc=$?" >> $r/compile.log
tail -n 5 $r/compile.log
timeout 150 python3 -m pytest -q -s --tb=short test_graphs_gpu.py > $r/graphs.log 2>&1; echo "graphs rc=$?" >> $r/graphs.log
tail -n 3 $r/graphs.log
cd $OUT && tar czf r.tgz r && rm -rf r
