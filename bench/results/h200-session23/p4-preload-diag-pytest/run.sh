#!/usr/bin/env bash
# Session 23, p4: p1's preload failures under pytest against p3's standalone passes: the same
# environment as p1, standalone and from a parent that has initialised CUDA, then pytest again.
r=$OUT/r; mkdir -p $r
SITE=${SITE:-/tmp/site}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so L=$PWD/carry/lib/libmoonbright_preload.so
export CUBLAS_WORKSPACE_CONFIG=:4096:8
(env | sort | grep -E "^(SITE|PYTHON|LD_|CUDA|PATH|MOONBRIGHT|PYTORCH|TORCH)"; ls $SITE 2>&1 | head; which python3; nvidia-smi -q | grep -i "compute mode") > $r/env.txt 2>&1; cat $r/env.txt
python3 - <<'PY'
import sys; sys.path.insert(0, "python/tests/gpu")
import test_preload_gpu as t
open("/tmp/NO_CACHE.py", "w").write(t.PRELUDE + t.NO_CACHE)
PY
PYTORCH_NO_CUDA_MEMORY_CACHING=1 LD_PRELOAD=$L timeout 90 python3 /tmp/NO_CACHE.py > $r/nc-standalone.log 2>&1; echo "standalone rc=$?"; tail -c 300 $r/nc-standalone.log
cat > /tmp/parent.py <<'PY'
import os, subprocess, sys, torch
print("parent cuda", torch.cuda.is_available(), flush=True)
env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", LD_PRELOAD=os.environ["L"])
r = subprocess.run([sys.executable, "/tmp/NO_CACHE.py"], env=env, capture_output=True, text=True)
print("child rc", r.returncode, r.stdout[-200:], r.stderr[-600:])
if sys.argv[1:] == ["ctx"]:
    torch.zeros(1, device="cuda")
    r = subprocess.run([sys.executable, "/tmp/NO_CACHE.py"], env=env, capture_output=True, text=True)
    print("child after parent context rc", r.returncode, r.stdout[-200:], r.stderr[-600:])
PY
timeout 120 python3 /tmp/parent.py ctx > $r/parent.log 2>&1; echo "parent rc=$?"; cut -c1-400 $r/parent.log
(cd python/tests/gpu && timeout 150 python3 -m pytest -q -s --tb=short -k cache test_preload_gpu.py > $r/pytest.log 2>&1; echo "pytest rc=$?" >> $r/pytest.log)
grep -E "passed|failed|rc=|Error" $r/pytest.log | cut -c1-300 | head
cp carry/g4.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
