#!/usr/bin/env bash
# Session 17, l9: the record_stream test, whose control now takes blocks below a page until one
# overlaps the freed one (l8 failed its control: best fit took another hole first).
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
cd python/tests/gpu
timeout 200 python3 -m pytest -q -s --tb=short test_torch_gpu.py -k "record_stream" > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/python-gpu.log
tail -n 4 $r/python-gpu.log; grep -E "^FAILED|^ERROR|control" $r/python-gpu.log | head
cd - >/dev/null; cp carry/l9.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
