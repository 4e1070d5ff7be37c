#!/usr/bin/env bash
# Session 38, h1: the stress's alloc p99 against held memory. MoonBright's default, unbounded
# carving and near fits (carve:1,carve_repeated:1,near_fit:1), and a temporary build
# (stress-grow, not committed) that creates new chunks instead of stealing cached ranges while
# held memory stays under MB_GROW x the peak allocated (with carve:1,carve_repeated:1), against
# PyTorch's default allocator on the same operations; two interleaved rounds.
r=$OUT/r; mkdir -p $r; cp carry1/h1.sh $r/run.sh
source scripts/nvrtc-env.sh >/dev/null 2>&1
SECONDS=0
mkdir -p /tmp/c1 && tar xJf carry1/bin.tar.xz -C /tmp/c1; B=/tmp/c1/bin
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $r/gpu.txt 2>&1
$B/stress --dump-ops /tmp/ops.csv > /dev/null 2>&1
for round in 1 2; do
  for v in default carve1near1 grow1.2 grow1.3 torch; do
    n=stress_${v}_$round
    case $v in
      default) MOONBRIGHT_ALLOC_CONF="" timeout 120 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1 ;;
      carve1near1) MOONBRIGHT_ALLOC_CONF="carve:1,carve_repeated:1,near_fit:1" timeout 120 $B/stress --no-baseline --json $r/$n.json > $r/$n.log 2>&1 ;;
      grow*) MB_GROW=${v#grow} MOONBRIGHT_ALLOC_CONF="carve:1,carve_repeated:1" timeout 120 $B/stress-grow --no-baseline --json $r/$n.json > $r/$n.log 2>&1 ;;
      torch) timeout 150 env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF python3 bench/torch_stress.py --ops /tmp/ops.csv --json $r/$n.json > $r/$n.log 2>&1 ;;
    esac
    echo "$v r$round rc=$? (${SECONDS}s) $(grep -E '^MoonBright  |torch_stress' $r/$n.log | tr -s ' ' | cut -c1-200) $(grep -oE 'request_maps [0-9]+|request_mapped_handles [0-9]+' $r/$n.log | head -2 | tr '\n' ' ')"
  done
done
sed -i "s|$PWD|\$REPO|g; s|$OUT|\$OUT|g" $r/*.log 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
