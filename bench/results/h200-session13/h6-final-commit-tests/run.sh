#!/usr/bin/env bash
# Session 13, h6: the final commit: the CUDA tests and the graph tests.
r=$OUT/r; mkdir -p $r
export PYTHONPATH=$SITE  # SITE: a folder to install the wheel into
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in "unit driver::cuda" "conformance cuda::" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
cd python/tests/gpu
timeout 200 python3 -m pytest -q --tb=short test_graphs_gpu.py test_torch_gpu.py -k "graph or captured or pool_allocates" > $r/python-graphs.log 2>&1; echo "python rc=$?" >> $r/tests.txt
cd - >/dev/null
cat $r/tests.txt; tail -n 2 $r/python-graphs.log; grep -E "test result" $r/test-*.log
cd $OUT && tar czf r.tgz r && rm -rf r
