#!/usr/bin/env bash
# Runs bench/multigpu.py (torch.distributed and NCCL on MoonBright memory, one process per GPU)
# on a GPU machine, with the wheel scripts/pack-gpu.sh put in carry/wheel (installed into
# ${SITE:-/tmp/site} unless that wheel is there already). Every part under torch and mb; then,
# when the interposer is in carry/lib (or MOONBRIGHT_PRELOAD_LIB), the IPC part under it too.
# The JSON, the table, the cards and their topology, and the process sets' logs (one .tgz)
# land in ${OUT:-bench-out}; arguments go to bench/multigpu.py (a --config among them replaces
# the default torch and mb; --parts skips the interposer's run unless it names ipc).
# NCCL_SUBSYS=REG (or INIT,REG) logs NCCL's INFO lines of those subsystems in every rank.
#
#   OUT=$OUT bash bench/run-multigpu.sh                    # every part, every GPU
#   OUT=$OUT bash bench/run-multigpu.sh --nproc 1          # the same programs on one GPU
#   OUT=$OUT bash bench/run-multigpu.sh --parts collectives --rounds 5
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-bench-out}
site=${SITE:-/tmp/site}
wheels=(carry/wheel/moonbright-*.whl)
wheel=${wheels[0]}
if [ ! -f "$wheel" ]; then
  echo "run-multigpu: no wheel in carry/wheel (bash scripts/pack-gpu.sh builds it)" >&2
  exit 2
fi
stamp="$site/.moonbright-wheel.sha256"
want=$(sha256sum "$wheel" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$wheel" || exit 2
  echo "$want" >"$stamp"
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
MOONBRIGHT_COMMIT=$(cat carry/COMMIT 2>/dev/null || true)
export MOONBRIGHT_COMMIT
mkdir -p "$out"
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m; } >"$out/multigpu-gpu.txt" 2>&1
cat "$out/multigpu-gpu.txt"

# What the arguments ask for, as far as the interposer's run needs to know.
nproc=() dry=() parts="" own_configs=0
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --nproc) nproc=(--nproc "${args[i + 1]:-}") ;;
    --nproc=*) nproc=("${args[i]}") ;;
    --parts) parts=${args[i + 1]:-} ;;
    --parts=*) parts=${args[i]#--parts=} ;;
    --config | --config=*) own_configs=1 ;;
    --cpu-dry-run) dry=(--cpu-dry-run) ;;
  esac
done
common=(--timeout 180)
[ -n "${NCCL_SUBSYS:-}" ] && common+=(--nccl-debug "$NCCL_SUBSYS")
configs=(--config torch --config mb)
[ $own_configs = 1 ] && configs=()
python3 bench/multigpu.py ${configs[@]+"${configs[@]}"} "${common[@]}" \
  --log-dir "$out/multigpu-logs/main" --json "$out/multigpu.json" "$@" \
  2>"$out/multigpu.log" | tee "$out/multigpu.txt"
rc=${PIPESTATUS[0]}
tail -n 20 "$out/multigpu.log"

lib=${MOONBRIGHT_PRELOAD_LIB:-carry/lib/libmoonbright_preload.so}
if [ ! -f "$lib" ]; then
  echo "run-multigpu: no interposer at $lib: the IPC part under it did not run" >&2
elif [ $own_configs = 0 ] && { [ -z "$parts" ] || [[ ,$parts, == *,ipc,* ]]; }; then
  # Only the part the interposer's cudaIpc* serve, beside PyTorch's own; its own JSON.
  python3 bench/multigpu.py --parts ipc --config torch --config preload --preload-lib "$lib" \
    ${nproc[@]+"${nproc[@]}"} ${dry[@]+"${dry[@]}"} "${common[@]}" \
    --log-dir "$out/multigpu-logs/preload" --json "$out/multigpu-preload.json" \
    2>"$out/multigpu-preload.log" | tee "$out/multigpu-preload.txt"
  prc=${PIPESTATUS[0]}
  tail -n 20 "$out/multigpu-preload.log"
  [ "$rc" = 0 ] && rc=$prc
fi
if [ -d "$out/multigpu-logs" ]; then
  tar czf "$out/multigpu-logs.tgz" -C "$out" multigpu-logs && rm -rf "$out/multigpu-logs"
fi
exit "$rc"
