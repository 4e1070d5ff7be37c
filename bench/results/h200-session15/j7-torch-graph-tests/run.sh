#!/usr/bin/env bash
# Session 15, j7: the PyTorch and graph GPU tests on the final build (the worker's 2 ms tick).
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
cd python/tests/gpu
timeout 165 python3 -m pytest -q -s --tb=short test_torch_gpu.py test_graphs_gpu.py > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/python-gpu.log
tail -n 4 $r/python-gpu.log; grep -E "FAILED|Error" $r/python-gpu.log | head
cd $OUT && tar czf r.tgz r && rm -rf r
