#!/usr/bin/env bash
# Session 14, i1: graph-pool statistics, a forked capture, and torch.compile's reduce-overhead
# mode through Inductor's plain CUDA graphs; then the CUDA test binaries.
r=$OUT/r; mkdir -p $r
export SITE=$SITE PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $r/gpu.txt
python3 -c "import time, torch; t=time.perf_counter(); import torch._inductor.config; print('import torch._inductor.config s', round(time.perf_counter()-t, 3))" > $r/inductor_import.txt 2>&1
cd python/tests/gpu
timeout 330 python3 -m pytest -q -s --tb=short test_compile_gpu.py test_graphs_gpu.py > $r/python-graphs-compile.log 2>&1; echo "python graphs+compile rc=$?" >> $r/tests.txt
cd - >/dev/null
for m in moonbright pytorch; do
  timeout 60 python3 bench/torch_compile_graphs.py $m > $r/compile_bench_$m.json 2> $r/compile_bench_$m.err
  timeout 60 python3 bench/torch_compile_graphs.py $m --train > $r/compile_bench_train_$m.json 2> $r/compile_bench_train_$m.err
done
for t in "capture --nocapture" "unit driver::cuda" "conformance cuda::" "faults" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 60 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
cat $r/tests.txt $r/inductor_import.txt; tail -n 5 $r/python-graphs-compile.log
grep -E "test result" $r/test-*.log
for f in $r/compile_bench*.json; do echo $f; python3 -c "import json,sys; d=json.load(open('$f')); print({k: (v['p50'] if isinstance(v, dict) else v) for k, v in d.items()})" 2>&1 | tail -1; done
tail -n 3 $r/compile_bench*.err
cd $OUT && tar czf r.tgz r && rm -rf r
