#!/usr/bin/env bash
# Session 17, l2: the static-cache generate under MoonBright with stable addresses: cache
# addresses and graphs (history on, as l1), then the test's script under both allocators.
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
# addr_gen.py: as in l1-.
TORCH_LOGS=cudagraphs timeout 150 python3 carry/addr_gen.py moonbright $r/trace_moonbright.json.gz > $r/addr_moonbright.out 2> $r/addr_moonbright.err; echo "moonbright rc=$?"
cat $r/addr_moonbright.out; grep -c "Re-recording" $r/addr_moonbright.err
timeout 400 python3 -m pytest -q -x python/tests/gpu/test_compile_gpu.py -k static -s > $r/static_test.log 2>&1; echo "static test rc=$?"; tail -5 $r/static_test.log
cp carry/addr_gen.py carry/addr2.sh $r/
cd $OUT && tar czf r.tgz r && rm -rf r
