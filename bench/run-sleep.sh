#!/usr/bin/env bash
# Runs bench/sleep.py (sleep and wake: MoonBright against torch_memory_saver) on a GPU machine,
# with the MoonBright wheel scripts/pack-gpu.sh put in carry/wheel and torch_memory_saver's
# wheel in carry/extra-wheels (fetched where there is a network, with
#   pip download torch_memory_saver==0.0.10 --no-deps --only-binary=:all: \
#     --python-version 3.12 --platform manylinux2014_x86_64 -d carry/extra-wheels
# : an abi3 wheel, for any CPython from 3.9). The JSON, the table and the workers' logs land in
# ${OUT:-bench-out}; arguments go to bench/sleep.py.
#
#   bash bench/run-sleep.sh                       # 16 GiB of weights and 16 GiB of KV cache
#   bash bench/run-sleep.sh --size-gib 1 --cycles 3
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
site=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" carry/wheel/moonbright-*.whl
python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" \
  carry/extra-wheels/torch_memory_saver-*.whl
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
MOONBRIGHT_COMMIT=$(cat carry/COMMIT 2>/dev/null || true)
export MOONBRIGHT_COMMIT
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/sleep-gpu.txt"
python3 bench/sleep.py --json "$out/sleep.json" "$@" >"$out/sleep.txt" 2>"$out/sleep.log"
rc=$?
cat "$out/sleep-gpu.txt" "$out/sleep.txt"
tail -n 20 "$out/sleep.log"
exit $rc
