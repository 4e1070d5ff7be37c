#!/usr/bin/env bash
r=$OUT/r; mkdir -p $r
export PYTHONPATH=$SITE  # SITE: a folder to install the wheel into
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
cd python/tests/gpu
timeout 300 python3 -m pytest -q --tb=short test_graphs_gpu.py test_torch_gpu.py -k "graph or captured or pool_allocates" > $r/python-graphs.log 2>&1; echo "python rc=$?"
cd - >/dev/null
sed -e 's/^/| /' $r/python-graphs.log | cut -c1-400 | tail -80
