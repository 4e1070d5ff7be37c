#!/usr/bin/env bash
# Session 14, i3: option captures_announced: eager alloc/free pairs and a launch-bound forward
# through PyTorch (MoonBright default, MoonBright captures_announced, PyTorch's allocator), and
# the graph tests (one of them under the option).
r=$OUT/r; mkdir -p $r
export SITE=$SITE PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
for i in 1 2; do
  timeout 100 python3 carry/exp/eager_overhead.py moonbright > $r/eager_moonbright_$i.json 2>&1
  MOONBRIGHT_ALLOC_CONF=captures_announced:true timeout 100 python3 carry/exp/eager_overhead.py moonbright > $r/eager_moonbright_announced_$i.json 2>&1
  timeout 100 python3 carry/exp/eager_overhead.py pytorch > $r/eager_pytorch_$i.json 2>&1
done
cd python/tests/gpu
timeout 300 python3 -m pytest -q -s --tb=short test_graphs_gpu.py > $r/python-graphs.log 2>&1; echo "python graphs rc=$?" >> $r/tests.txt
cd - >/dev/null
cat $r/tests.txt; tail -n 3 $r/python-graphs.log
for f in $r/eager_*.json; do echo $(basename $f); python3 -c "
import json; d=json.load(open('$f')); print({k: v for k, v in d.items() if k.startswith(('pair_default_4096','pair_side_4096','forward','driver'))})"; done
cd $OUT && tar czf r.tgz r && rm -rf r
