r=$OUT/r; mkdir -p $r
export PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
source scripts/nvrtc-env.sh >/dev/null 2>&1
for t in "unit driver::cuda" "conformance cuda::" "paged" "capture" "streams"; do
  set -- $t; n=$1; shift
  timeout 120 carry/bin/$n "$@" --test-threads 1 > $r/test-$n.log 2>&1; echo "$n rc=$?" >> $r/tests.txt
done
timeout 300 python3 -m pytest -q -s -rA python/tests/gpu/test_multi_gpu.py python/tests/gpu/test_paged_attention_gpu.py > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/tests.txt
cat $r/tests.txt; grep -h "test result" $r/test-*.log; grep -E "PASSED|FAILED|passed|failed" $r/python-gpu.log | tail -9
cd $OUT && tar czf r.tgz r && rm -rf r
