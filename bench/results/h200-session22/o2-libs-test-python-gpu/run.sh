#!/usr/bin/env bash
# Session 22, g2: the libs unit test made independent of libthread_db (absent on this image),
# what the image has of glibc's extra libraries, then the Python GPU tests (compile tests
# left out, as in session 20) with this session's wheel.
r=$OUT/r; mkdir -p $r
SITE=$SITE; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
( head -3 /etc/os-release; ldd --version | head -1
  ldconfig -p | grep -E "thread_db|libanl|BrokenLocale|nss_compat|nss_hesiod" ) > $r/glibc.txt 2>&1
cat $r/glibc.txt
source scripts/nvrtc-env.sh >/dev/null 2>&1
timeout 60 carry/bin/unit libs driver::cuda --test-threads 1 --nocapture > $r/test-unit-libs.log 2>&1; echo "unit rc=$?"
grep -E "skipping|test result" $r/test-unit-libs.log
python3 -m pip install -q --upgrade --no-index --no-deps --target $SITE carry/wheel/moonbright-*.whl
(cd python/tests/gpu && timeout 480 python3 -m pytest -q -s --tb=short --durations=12 --ignore=test_compile_gpu.py . > $r/python-gpu.log 2>&1; echo "python rc=$?" >> $r/python-gpu.log)
tail -n 18 $r/python-gpu.log | cut -c1-160; grep -E "^FAILED|^ERROR" $r/python-gpu.log | head
cp carry/g2.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
