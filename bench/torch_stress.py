#!/usr/bin/env python3
"""Replays the fragmentation stress written by `stress --dump-ops` through PyTorch's allocator
(torch.cuda.caching_allocator_alloc / caching_allocator_delete) and reports the figures the Rust
`stress` reports. Set PYTORCH_ALLOC_CONF before starting it (one process per configuration):
unset (default), expandable_segments:True, or backend:cudaMallocAsync.

Peak reserved comes from torch.cuda.max_memory_reserved(); with the cudaMallocAsync backend
PyTorch fills it from the pool's cudaMemPoolAttrReservedMemHigh (the script says which source it
used, and falls back to memory_stats keys if that reads 0)."""
import argparse
import csv
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summary, backend_label  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ops", required=True, help="CSV from `stress --dump-ops` (op,id,size)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import torch
    if not torch.cuda.is_available():
        print("torch_stress: no GPU visible to PyTorch", file=sys.stderr)
        return 2
    with open(args.ops) as f:
        ops = [(r["op"], int(r["id"]), int(r["size"])) for r in csv.DictReader(f)]
    live_bytes = peak_requested = 0
    for op, _, size in ops:
        live_bytes += size if op == "a" else -size
        peak_requested = max(peak_requested, live_bytes)

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.cuda.init()
    label = backend_label(torch)
    stream = torch.cuda.current_stream(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    live = {}
    alloc_us, big_us, free_us = [], [], []
    ooms, first_oom = 0, None
    clock = time.perf_counter_ns
    start = clock()
    for op, ident, size in ops:
        if op == "a":
            t = clock()
            try:
                p = torch.cuda.caching_allocator_alloc(size, dev, stream)
            except torch.OutOfMemoryError as e:
                ooms += 1
                first_oom = first_oom or f"alloc {size} B: {str(e).splitlines()[0]}"
                continue
            us = (clock() - t) / 1e3
            alloc_us.append(us)
            if size >= 64 << 20:
                big_us.append(us)
            live[ident] = p
        else:
            p = live.pop(ident, None)
            if p is not None:
                t = clock()
                torch.cuda.caching_allocator_delete(p)
                free_us.append((clock() - t) / 1e3)
    seconds = (clock() - start) / 1e9
    for p in live.values():
        torch.cuda.caching_allocator_delete(p)
    torch.cuda.synchronize(dev)

    stats = torch.cuda.memory_stats(dev)
    reserved = torch.cuda.max_memory_reserved(dev)
    allocated = torch.cuda.max_memory_allocated(dev)
    source = "torch.cuda.max_memory_reserved"
    if label == "cudaMallocAsync":
        source += " (cudaMallocAsync backend: the pool's cudaMemPoolAttrReservedMemHigh)"
    if reserved == 0:
        for key in ("reserved_bytes.all.peak", "reserved_bytes.large_pool.peak"):
            if stats.get(key):
                reserved, source = stats[key], f"memory_stats['{key}']"
                break
        else:
            source = "not tracked by this backend (0)"
    out = {
        "allocator": f"PyTorch {label}",
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
        "torch": torch.__version__,
        "ops": len(ops),
        "seconds": seconds,
        "ops_per_s": len(ops) / seconds,
        "peak_requested": peak_requested,
        "peak_reserved": reserved,
        "peak_allocated": allocated,
        "reserved_over_requested": reserved / peak_requested,
        "reserved_over_allocated": reserved / max(allocated, 1),
        "reserved_source": source,
        "alloc_us": summary(alloc_us),
        "alloc_ge_64mib_us": summary(big_us),
        "free_us": summary(free_us),
        "ooms": ooms,
        "first_oom": first_oom,
    }
    print(f"torch_stress [{out['allocator']}]: peak reserved {reserved / 2**30:.2f} GiB "
          f"(source: {source}), res/req {out['reserved_over_requested']:.3f}, "
          f"res/alloc {out['reserved_over_allocated']:.3f}, alloc p50 {out['alloc_us']['p50']:.2f} "
          f"p99 {out['alloc_us']['p99']:.1f} us, >=64 MiB p99 {out['alloc_ge_64mib_us']['p99']:.1f} "
          f"us, {out['ops_per_s']:.0f} ops/s, OOMs {ooms}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "outcomes": [out]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
