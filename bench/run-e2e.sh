#!/usr/bin/env bash
# Runs bench/e2e.py (PyTorch end to end) on a GPU machine with the wheel that
# scripts/pack-gpu.sh put in carry/wheel. The JSON and the workers' logs (as one .tgz) land in
# ${OUT:-bench-out}; arguments go to bench/e2e.py.
#
#   bash bench/run-e2e.sh                              # every workload, default configurations
#   bash bench/run-e2e.sh --workloads resnet50 --kernels --micro
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
site=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" carry/wheel/moonbright-*.whl
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
MOONBRIGHT_COMMIT=$(cat carry/COMMIT 2>/dev/null || true)
export MOONBRIGHT_COMMIT
mkdir -p "$out/e2e-logs"
python3 bench/e2e.py --json "$out/e2e.json" --log-dir "$out/e2e-logs" "$@"
rc=$?
tar czf "$out/e2e-logs.tgz" -C "$out" e2e-logs && rm -rf "$out/e2e-logs"
exit $rc
