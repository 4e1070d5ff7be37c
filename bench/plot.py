#!/usr/bin/env python3
"""Draws the benchmark results as PNGs (matplotlib):

  latency.png      alloc+free p50 and p99 by size, one line per allocator path (from latency's
                   JSON and torch_latency's JSON files)
  latency_kernel.png  alloc and free time while a 50 ms kernel runs, by size and path
  chunks.png       set-access/map calls per GiB and alloc time, 1 GiB and 64 MiB chunks against 2 MiB pages
  stress.png       peak reserved / peak requested and alloc p99 per allocator (stress JSON files)
  interference.png kernel slowdown p50/p99 per condition

Usage: plot.py --out DIR FILE.json...   (each file is recognised by its keys)"""
import argparse
import json
import os
import sys

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def size_name(s):
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if s >= unit:
            return f"{s // unit} {name}"
    return f"{s} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    rows, kernel, chunks, stress, interference = [], [], [], [], []
    for path in args.files:
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            print(f"plot: skipping {path}: {e}", file=sys.stderr)
            continue
        rows += d.get("rows", [])
        kernel += d.get("during_kernel", [])
        chunks += d.get("chunks", [])
        stress += d.get("outcomes", [])
        if "conditions" in d:
            interference = d["conditions"]
    written = []

    if rows:
        fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
        labels = []
        for r in rows:
            if r["label"] not in labels:
                labels.append(r["label"])
        for ax, q in zip(axes, ("p50", "p99")):
            for label in labels:
                pts = sorted((r["size"], r["pair_us"][q]) for r in rows if r["label"] == label)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            sizes = sorted({r["size"] for r in rows})
            ax.set_xticks(sizes, [size_name(s) for s in sizes])
            ax.set_xlabel("allocation size")
            ax.set_ylabel(f"alloc+free {q} (us, host wall clock)")
            ax.set_title(f"alloc+free latency, {q}")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "latency.png"), dpi=120)
        written.append("latency.png")

    if kernel:
        fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
        labels = []
        for r in kernel:
            if r["label"] not in labels:
                labels.append(r["label"])
        for ax, key in zip(axes, ("alloc_us", "free_us")):
            for label in labels:
                pts = sorted((r["size"], max(r[key])) for r in kernel if r["label"] == label)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax.axhline(50_000, color="grey", linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            sizes = sorted({r["size"] for r in kernel})
            ax.set_xticks(sizes, [size_name(s) for s in sizes])
            ax.set_ylabel(f"{key.split('_')[0]} time, slowest trial (us)")
            ax.set_title(f"{key.split('_')[0]} while a 50 ms kernel runs (dashed: 50 ms)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "latency_kernel.png"), dpi=120)
        written.append("latency_kernel.png")

    if chunks:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        names = [f"{size_name(c['size'])}\nchunks of\n{size_name(c['max_chunk_bytes'])}" for c in chunks]
        x = range(len(chunks))
        axes[0].bar([i - 0.2 for i in x], [c["per_gib"].get("map", 0) for c in chunks], 0.4,
                    label="handles mapped (map calls) / GiB")
        axes[0].bar([i + 0.2 for i in x], [c["per_gib"].get("set_access", 0) for c in chunks], 0.4,
                    label="set-access calls / GiB")
        axes[0].set_xticks(list(x), names)
        axes[0].set_yscale("log")
        axes[0].legend(fontsize=8)
        axes[0].set_title("driver calls per GiB allocated (cold map)")
        axes[1].bar([i - 0.2 for i in x], [c["alloc_us"]["p50"] / 1e3 for c in chunks], 0.4,
                    label="alloc p50")
        axes[1].bar([i + 0.2 for i in x], [c["release_us"]["p50"] / 1e3 for c in chunks], 0.4,
                    label="unmap + release p50")
        axes[1].set_xticks(list(x), names)
        axes[1].set_yscale("log")
        axes[1].set_ylabel("ms")
        axes[1].legend(fontsize=8)
        axes[1].set_title("time")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "chunks.png"), dpi=120)
        written.append("chunks.png")

    if stress:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        names = [o["allocator"] for o in stress]
        x = range(len(stress))
        axes[0].bar(x, [o["reserved_over_requested"] for o in stress])
        axes[0].axhline(1.05, color="red", linestyle="--", linewidth=1, label="target 1.05")
        axes[0].set_ylim(0.9, max(1.3, max(o["reserved_over_requested"] for o in stress) + 0.05))
        axes[0].set_title("peak reserved / peak requested")
        axes[0].legend(fontsize=8)
        axes[1].bar([i - 0.2 for i in x], [o["alloc_us"]["p50"] for o in stress], 0.4, label="p50")
        axes[1].bar([i + 0.2 for i in x], [o["alloc_us"]["p99"] for o in stress], 0.4, label="p99")
        axes[1].set_yscale("log")
        axes[1].set_ylabel("alloc (us)")
        axes[1].legend(fontsize=8)
        axes[1].set_title("alloc latency in the stress")
        for ax in axes:
            ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "stress.png"), dpi=120)
        written.append("stress.png")

    if interference:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        names = [c["condition"] for c in interference]
        x = range(len(names))
        for off, key, lab in ((-0.3, "gather_slowdown_p50", "gather p50"),
                              (-0.1, "gather_slowdown_p99", "gather p99"),
                              (0.1, "copy_slowdown_p50", "copy p50"),
                              (0.3, "copy_slowdown_p99", "copy p99")):
            ax.bar([i + off for i in x], [c[key] for c in interference], 0.2, label=lab)
        ax.axhline(1.02, color="red", linestyle="--", linewidth=1, label="target 1.02")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("kernel time / alone")
        ax.set_title("kernel slowdown under allocation churn")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "interference.png"), dpi=120)
        written.append("interference.png")

    print("plot: wrote " + (", ".join(written) if written else "nothing") + f" in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
