#!/usr/bin/env python3
"""Records the allocation trace of one of bench/e2e.py's workloads under PyTorch's default
allocator, from before the model is built, for `moonbright replay`: the workload's fixed-shape
steps repeated, as a training loop runs them (the shared traces in traces/ vary their shapes).

    python3 bench/record_trace.py gpt2 --steps 12 --out trace_e2e_gpt2.json.gz

Writes PyTorch's snapshot JSON (gzipped; `moonbright replay` reads it) with only the device's
trace, and beside it `<out>.steps.json`: the number of trace events after the setup and after
each step, so that a replay limited to them (`--limit`) counts what each step cost. Also prints
PyTorch's peak reserved over peak allocated.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", help="a workload of bench/e2e.py: resnet50, gpt2, llama")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    import e2e

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=10_000_000)
    w = e2e.make_workload(args.workload, torch)
    torch.cuda.synchronize()

    def entries() -> int:
        # Each `_snapshot` call adds a "snapshot" entry of its own, which replay skips: the marks
        # count the others, so that they are the replay's event indices.
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        return sum(e["action"] != "snapshot" for e in trace)

    marks = [entries()]
    for _ in range(args.steps):
        w.step()
        torch.cuda.synchronize()
        marks.append(entries())
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [{k: e.get(k) for k in ("action", "addr", "size", "stream", "time_us")}
             for e in snap["device_traces"][0] if e["action"] != "snapshot"]
    with gzip.open(args.out, "wt") as f:
        json.dump({"segments": [], "device_traces": [trace]}, f)
    with open(args.out + ".steps.json", "w") as f:
        json.dump({"workload": args.workload, "setup_entries": marks[0], "step_entries": marks[1:],
                   "units_per_step": w.units_per_step}, f)
    peak_res, peak_alloc = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    print(f"{args.workload}: {len(trace)} entries, {args.steps} steps; PyTorch default: peak "
          f"reserved {peak_res / 2**30:.2f} GiB / allocated {peak_alloc / 2**30:.2f} GiB = "
          f"{peak_res / peak_alloc:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
