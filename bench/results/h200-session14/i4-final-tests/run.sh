#!/usr/bin/env bash
# Session 14, i4: every CUDA test (the conformance suite twice: default options, and PyTorch's
# contract), every Python GPU test (some under PyTorch's contract too), and alloc/free pairs
# through PyTorch under the default options, the contract, and PyTorch's own allocator.
r=$OUT/r; mkdir -p $r
export SITE=$SITE PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $r/gpu.txt
for t in "unit driver::cuda" "conformance cuda" "faults" "capture --nocapture" "growable cuda_" "streams" "paged"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
C="captures_announced:true,deferred_free_events:true"
for i in 1 2 3; do
  timeout 60 python3 carry/exp/eager_overhead.py moonbright > $r/eager_default_$i.json 2>&1
  MOONBRIGHT_ALLOC_CONF=$C timeout 60 python3 carry/exp/eager_overhead.py moonbright > $r/eager_contract_$i.json 2>&1
  timeout 60 python3 carry/exp/eager_overhead.py pytorch > $r/eager_pytorch_$i.json 2>&1
done
cd python/tests/gpu
timeout 400 python3 -m pytest -q -s --tb=short . > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/tests.txt
cd - >/dev/null
cat $r/tests.txt; tail -n 4 $r/python-gpu.log
grep -E "test result" $r/test-*.log
for f in $r/eager_*.json; do echo $(basename $f) $(python3 -c "
import json; d=json.load(open('$f')); print([d.get(k) for k in ('pair_default_4096','pair_side_4096','pair_side_1048576','forward_default_us','forward_side_us')], d.get('driver_calls_per_forward'))" 2>&1 | tail -1); done
cd $OUT && tar czf r.tgz r && rm -rf r
