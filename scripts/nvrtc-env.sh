# Sourced: finds a libnvrtc (CUDA install, PyTorch's nvidia wheels, PyPI's nvidia-cuda-nvrtc in
# target/nvrtc) and exports MOONBRIGHT_NVRTC, where MoonBright looks for it first (its directory
# goes on LD_LIBRARY_PATH too). Prints what it found; finding none is not an error here (the
# NVRTC tests then skip and are counted, or fail under MOONBRIGHT_REQUIRE_GPU=1, and a paged pool
# on the CUDA backend reports it).
_mb_find_nvrtc() {
  local d f py=${PYTHON:-python3}
  for d in $(echo "${LD_LIBRARY_PATH:-}" | tr ':' ' ') target/nvrtc/nvidia/*/lib \
           /usr/local/cuda/lib64 /usr/local/cuda-*/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           /usr/lib/x86_64-linux-gnu \
           $("$py" -c 'import glob, os, site
for s in site.getsitepackages():
    for p in glob.glob(os.path.join(s, "nvidia", "**", "libnvrtc.so*"), recursive=True): print(os.path.dirname(p))' 2>/dev/null | sort -u); do
    for f in "$d"/libnvrtc.so "$d"/libnvrtc.so.1[0-9]*; do
      [ -e "$f" ] && { echo "$f"; return 0; }
    done
  done
  ldconfig -p 2>/dev/null | awk '/libnvrtc\.so/ && !/builtins/ {print $NF; exit}'
}
_mb_nvrtc=$(_mb_find_nvrtc)
if [ -n "$_mb_nvrtc" ]; then
  export MOONBRIGHT_NVRTC="$(readlink -f "$_mb_nvrtc")"
  export LD_LIBRARY_PATH="$(dirname "$MOONBRIGHT_NVRTC"):${LD_LIBRARY_PATH:-}"
  echo "libnvrtc: $_mb_nvrtc"
else
  echo "libnvrtc: not found"
fi
