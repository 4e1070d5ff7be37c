#!/usr/bin/env bash
# Session 23, p3: the failing preload tests' own scripts, with and without scripts/nvrtc-env.sh
# (which puts a CUDA install's lib64 on LD_LIBRARY_PATH), with CUDA_LAUNCH_BLOCKING, under
# compute-sanitizer; which libcudart each loads.
r=$OUT/r; mkdir -p $r
export MOONBRIGHT_PRELOAD_LIB=$PWD/carry/lib/libmoonbright_preload.so L=$PWD/carry/lib/libmoonbright_preload.so
export CUBLAS_WORKSPACE_CONFIG=:4096:8 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 - <<'PY'
import sys; sys.path.insert(0, "python/tests/gpu")
import test_preload_gpu as t
maps = "\nimport atexit\natexit.register(lambda: print('cudart:', sorted({l.split()[-1] for l in open('/proc/self/maps') if 'cudart' in l}), flush=True))\n"
for n in ("LLAMA", "NO_CACHE", "ASYNC"):
    open(f"/tmp/{n}.py", "w").write(t.PRELUDE + maps + getattr(t, n))
PY
run() { # name, env..., script
  local n=$1; shift
  env "$@" > $r/$n.log 2>&1; echo "rc=$?" >> $r/$n.log
  echo "== $n"; grep -E "^cudart|^rc=|Error|error|^\{" $r/$n.log | cut -c1-300 | head -8
}
run nc-plain PYTORCH_NO_CUDA_MEMORY_CACHING=1 LD_PRELOAD=$L timeout 90 python3 /tmp/NO_CACHE.py
run llama-plain LD_PRELOAD=$L timeout 90 python3 /tmp/LLAMA.py
run async-plain PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync LD_PRELOAD=$L timeout 90 python3 /tmp/ASYNC.py
source scripts/nvrtc-env.sh
run nc-nvrtcenv PYTORCH_NO_CUDA_MEMORY_CACHING=1 LD_PRELOAD=$L timeout 90 python3 /tmp/NO_CACHE.py
run llama-nvrtcenv LD_PRELOAD=$L timeout 90 python3 /tmp/LLAMA.py
run llama-nvrtcenv-runtime timeout 90 python3 /tmp/LLAMA.py
run nc-nvrtcenv-blocking CUDA_LAUNCH_BLOCKING=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 LD_PRELOAD=$L timeout 90 python3 /tmp/NO_CACHE.py
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 $CS --tool memcheck --print-limit 3 env LD_PRELOAD=$L python3 /tmp/NO_CACHE.py > $r/cs.log 2>&1; echo "rc=$?" >> $r/cs.log
grep -vE "^\s*$" $r/cs.log | grep -vE "^=========     (Host Frame|Device Frame)" | cut -c1-250 | head -40
cp carry/g3.sh $r/run.sh
cd $OUT && tar czf r.tgz r && rm -rf r
