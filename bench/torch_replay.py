#!/usr/bin/env python3
"""Replays an allocation trace (our CSV, gzipped or not: `seq,action,addr,size,stream,dt_us`)
through PyTorch's allocator, as `moonbright replay --repeat N` replays it through MoonBright: each
`alloc` a torch.cuda.caching_allocator_alloc of its size on its stream, each `free_completed` a
caching_allocator_delete, other events skipped; the blocks live at the end of a repetition are
freed before the next. Set PYTORCH_ALLOC_CONF before starting it (one process per
configuration): unset (default) or expandable_segments:True.

Per repetition it prints PyTorch's peak reserved so far over the trace's peak of live requested
bytes (the figure `moonbright replay` gives, whose allocated bytes are the requested ones) and
the repetition's alloc p50 / p99 / max. The recorded figures in traces/README.md come
from the training runs themselves; this replays the same sequence the way MoonBright's replay
does, so both allocators see exactly the same requests."""
import argparse
import csv
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summary, backend_label  # noqa: E402


def load(path):
    """(is_alloc, addr, size, stream) for every alloc and free_completed, and the peak of live
    requested bytes."""
    opener = gzip.open if path.endswith(".gz") else open
    ops, live, peak, sizes = [], 0, 0, {}
    with opener(path, "rt", newline="") as f:
        for r in csv.DictReader(f):
            action, addr, size = r["action"], int(r["addr"]), int(r["size"])
            if action == "alloc":
                ops.append((True, addr, size, int(r["stream"])))
                live += size - sizes.get(addr, 0)
                sizes[addr] = size
                peak = max(peak, live)
            elif action == "free_completed" and addr in sizes:
                ops.append((False, addr, 0, int(r["stream"])))
                live -= sizes.pop(addr)
    return ops, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--repeat", type=int, default=1, help="repetitions through one allocator")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be 1 or more")

    import torch
    if not torch.cuda.is_available():
        print("torch_replay: no GPU visible to PyTorch", file=sys.stderr)
        return 2
    ops, peak_requested = load(args.trace)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.cuda.init()
    label = backend_label(torch)
    streams = {}

    def stream(ident):
        # The recorder's stream ids: its first one is the current stream, others new streams.
        if ident not in streams:
            streams[ident] = (torch.cuda.current_stream(dev) if not streams
                              else torch.cuda.Stream(dev))
        return streams[ident]

    torch.cuda.reset_peak_memory_stats(dev)
    clock = time.perf_counter_ns
    reps = []
    for rep in range(args.repeat):
        live, alloc_us, failed = {}, [], 0
        start = clock()
        for is_alloc, addr, size, sid in ops:
            if is_alloc:
                s = stream(sid)
                t = clock()
                try:
                    p = torch.cuda.caching_allocator_alloc(size, dev, s)
                except torch.OutOfMemoryError:
                    failed += 1
                    continue
                alloc_us.append((clock() - t) / 1e3)
                old = live.pop(addr, None)
                if old is not None:  # an address reused without a free: drop the old block
                    torch.cuda.caching_allocator_delete(old)
                live[addr] = p
            else:
                p = live.pop(addr, None)
                if p is not None:
                    torch.cuda.caching_allocator_delete(p)
        seconds = (clock() - start) / 1e9
        for p in live.values():
            torch.cuda.caching_allocator_delete(p)
        torch.cuda.synchronize(dev)
        reserved = torch.cuda.max_memory_reserved(dev)
        lat = summary(alloc_us)
        reps.append({"failed_allocs": failed, "peak_reserved": reserved,
                     "reserved_over_requested_so_far": reserved / peak_requested,
                     "alloc_us": lat, "seconds": seconds})
        print(f"torch_replay [{label}] {os.path.basename(args.trace)} rep {rep + 1}: "
              f"reserved/requested so far {reserved / peak_requested:.4f}, alloc p50 "
              f"{lat['p50']:.2f} p99 {lat['p99']:.1f} max {lat['max']:.0f} us, failed {failed}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "allocator": f"PyTorch {label}",
                       "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
                       "torch": torch.__version__, "trace": os.path.basename(args.trace),
                       "peak_requested": peak_requested, "repetitions": reps}, f, indent=2)
    return 1 if any(r["failed_allocs"] for r in reps) else 0


if __name__ == "__main__":
    sys.exit(main())
