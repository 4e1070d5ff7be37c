r=$OUT/r; mkdir -p $r
export PYTHONPATH=$SITE
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
python3 -c "import accelerate, transformers; print('accelerate', accelerate.__version__, 'transformers', transformers.__version__)" > $r/versions.txt 2>&1
timeout 300 python3 -m pytest -q -s -rA python/tests/gpu/test_multi_gpu.py > $r/multi-gpu.log 2>&1; echo "multi-gpu rc=$?" >> $r/tests.txt
cd carry/exp && timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 ddp_check.py moonbright  # ddp_check.py: bench/results/h200-session11/f8-ddp-two-gpus/ > $r/ddp_moonbright.log 2>&1; echo "ddp rc=$?" >> $r/tests.txt; cd ../..
source scripts/nvrtc-env.sh >/dev/null 2>&1
timeout 200 carry/bin/latency --window-idle --no-kernel --no-chunks --json $r/latency_window_idle.json > $r/latency_window_idle.log 2>&1; echo "latency rc=$?" >> $r/tests.txt
cat $r/tests.txt $r/versions.txt; grep -E "passed|failed|SKIP" $r/multi-gpu.log | tail -5; grep -E '^\{' $r/ddp_moonbright.log | cut -c1-300
grep -E "window hit" $r/latency_window_idle.log | grep -v "pair p50 " | head -8; grep MISSED $r/latency_window_idle.log
cd $OUT && tar czf r.tgz r && rm -rf r
