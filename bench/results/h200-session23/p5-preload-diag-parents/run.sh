#!/usr/bin/env bash
# Session 23, p5: what makes the preload child fail under pytest: a runtime child first, the
# script given with -c rather than as a file, the working directory.
r=$OUT/r; mkdir -p $r
SITE=${SITE:-/tmp/site}; export SITE PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
source scripts/nvrtc-env.sh >/dev/null 2>&1
export MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so L=$PWD/carry/lib/libmoonbright_preload.so
export CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 - <<'PY'
import sys; sys.path.insert(0, "python/tests/gpu")
import test_preload_gpu as t
open("/tmp/NO_CACHE.py", "w").write(t.PRELUDE + t.NO_CACHE)
PY
cat > /tmp/parent.py <<'PY'
import os, subprocess, sys
code = open("/tmp/NO_CACHE.py").read()
def child(how, preload):
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = os.environ["L"]
    args = [sys.executable, "-c", code] if how == "c" else [sys.executable, "/tmp/NO_CACHE.py"]
    r = subprocess.run(args, env=env, capture_output=True, text=True)
    err = [l for l in r.stderr.splitlines() if "error" in l.lower()][:2]
    print(f"{how:5} preload={preload} rc={r.returncode} {err}", flush=True)
for case in sys.argv[1:]:
    how, first = case.split(",")
    if first == "runtime":
        child(how, False)
    child(how, True)
PY
for d in . python/tests/gpu; do
  echo "== cwd $d"; (cd $d && timeout 200 python3 /tmp/parent.py file,none c,none file,runtime c,runtime 2>&1 | tee -a $r/parent.log)
done
cp carry/g5.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
