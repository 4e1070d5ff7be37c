r=$OUT/r; mkdir -p $r
export PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
timeout 400 python3 -m pytest -q -s -rA python/tests/gpu/test_multi_gpu.py > $r/multi-gpu.log 2>&1; echo "multi-gpu rc=$?" >> $r/tests.txt
cat $r/tests.txt; grep -E "PASSED|FAILED|passed|failed" $r/multi-gpu.log | tail -9
cd $OUT && tar czf r.tgz r && rm -rf r
