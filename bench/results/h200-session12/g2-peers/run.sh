r=$OUT/r; mkdir -p $r
export PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > $r/gpus.txt
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in "unit driver::cuda" "conformance cuda::" "capture --nocapture" "streams" "faults"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 --nocapture > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
timeout 400 python3 -m pytest -q -s -rA python/tests/gpu/test_multi_gpu.py > $r/multi-gpu.log 2>&1; echo "multi-gpu rc=$?" >> $r/tests.txt
timeout 120 python3 bench/peer_cost.py > $r/peer_cost.json 2> $r/peer_cost.err; echo "peer_cost rc=$?" >> $r/tests.txt
cat $r/tests.txt; grep -E "passed|failed" $r/multi-gpu.log | tail -3; grep -E "test result" $r/test-*.log
python3 -c "import json; d=json.load(open('$r/peer_cost.json')); [print(k, round(v['median_no_peer'],1), round(v['median_one_peer'],1), round(v['ratio'],3)) for k,v in d['sizes'].items()]"
cd $OUT && tar czf r.tgz r && rm -rf r
