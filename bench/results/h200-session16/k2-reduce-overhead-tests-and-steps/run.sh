#!/usr/bin/env bash
# Session 16, k2: the reduce-overhead tests (leak check counting cuBLAS's workspaces out), and
# step times of a launch-bound model under torch.compile, each process pinned to one core.
r=$OUT/r; mkdir -p $r
export SITE PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
for i in 1 2; do
  for m in moonbright pytorch; do
    timeout 90 taskset -c 5 python3 bench/torch_compile_graphs.py $m > $r/infer_${m}_$i.json 2> $r/infer_${m}_$i.err
    timeout 90 taskset -c 5 python3 bench/torch_compile_graphs.py $m --train > $r/train_${m}_$i.json 2> $r/train_${m}_$i.err
  done
done
for f in $r/*.json; do python3 -c "import json,sys; d=json.load(open('$f')); print('$(basename $f)', {k: round(d[k+'_us']['p50'],1) for k in ('eager','default','reduce-overhead')}, 'skips', d['cudagraph_skips'])" 2>&1 | tail -1; done
cd python/tests/gpu
timeout 300 python3 -m pytest -q -s --tb=long test_compile_gpu.py > $r/compile.log 2>&1; echo "compile rc=$?" >> $r/compile.log
tail -n 3 $r/compile.log
cd $OUT && tar czf r.tgz r && rm -rf r
