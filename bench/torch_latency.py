#!/usr/bin/env python3
"""Alloc+free latency of PyTorch's caching allocator (torch.cuda.caching_allocator_alloc /
caching_allocator_delete) for the six sizes of the Rust `latency` benchmark, with the same
repetition counts and percentiles; JSON rows in the same schema, so bench/plot.py draws them
beside MoonBright's. The allocator is whatever PYTORCH_ALLOC_CONF selects."""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summary, backend_label  # noqa: E402

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
SIZES = [256, 64 * KIB, 2 * MIB, 64 * MIB, GIB, 8 * GIB]


def reps(size, quick):
    if size <= 2 * MIB:
        w, r = 20, 200
    elif size <= 64 * MIB:
        w, r = 10, 100
    elif size <= GIB:
        w, r = 3, 30
    else:
        w, r = 1, 8
    return (min(w, 2), max(r // 4, 3)) if quick else (w, r)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("torch_latency: no GPU visible to PyTorch", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    label = backend_label(torch)
    stream = torch.cuda.current_stream(dev)
    clock = time.perf_counter_ns
    rows = []
    print(f"torch_latency [{label}] (us, host wall clock)")
    print(f"{'size':>8} {'alloc p50':>10} {'alloc p99':>10} {'free p50':>9} {'free p99':>9} "
          f"{'pair p50':>9} {'pair p99':>9}")
    for size in SIZES:
        warm, n = reps(size, args.quick)
        for _ in range(warm):
            torch.cuda.caching_allocator_delete(torch.cuda.caching_allocator_alloc(size, dev, stream))
        a, f, pair = [], [], []
        for _ in range(n):
            t0 = clock()
            p = torch.cuda.caching_allocator_alloc(size, dev, stream)
            t1 = clock()
            torch.cuda.caching_allocator_delete(p)
            t2 = clock()
            a.append((t1 - t0) / 1e3)
            f.append((t2 - t1) / 1e3)
            pair.append((t2 - t0) / 1e3)
        row = {"path": f"torch_{label}", "label": f"PyTorch caching ({label})", "size": size,
               "alloc_us": summary(a), "free_us": summary(f), "pair_us": summary(pair)}
        rows.append(row)
        name = f"{size // GIB} GiB" if size >= GIB else f"{size // MIB} MiB" if size >= MIB else \
            f"{size // KIB} KiB" if size >= KIB else f"{size} B"
        print(f"{name:>8} {row['alloc_us']['p50']:>10.2f} {row['alloc_us']['p99']:>10.2f} "
              f"{row['free_us']['p50']:>9.2f} {row['free_us']['p99']:>9.2f} "
              f"{row['pair_us']['p50']:>9.2f} {row['pair_us']['p99']:>9.2f}")
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                       "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""), "rows": rows},
                      fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
