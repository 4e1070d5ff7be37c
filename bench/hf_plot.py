#!/usr/bin/env python3
"""Summarises bench/hf_capacity.py's JSON files: a Markdown table on stdout (always) and
hf_capacity.png in --out (largest batch and tokens per second per configuration and number of
new tokens; skipped with a message when matplotlib is missing).

Usage: hf_plot.py --out DIR FILE.json..."""
import argparse
import json
import os
import sys

ORDER = ["default/dynamic", "expandable/dynamic", "moonbright/dynamic", "growable/growable",
         "growable/growable/gqa"]
LABEL = {
    "default/dynamic": "PyTorch default, DynamicCache",
    "expandable/dynamic": "PyTorch expandable segments, DynamicCache",
    "moonbright/dynamic": "MoonBright, DynamicCache",
    "growable/growable": "MoonBright, GrowableCache",
    "growable/growable/gqa": "MoonBright, GrowableCache, gqa_attention",
}


def config_name(r):
    """alloc/cache, and /attn when the run did not use transformers' sdpa."""
    attn = r.get("attn", "sdpa")
    return f"{r['alloc']}/{r['cache']}" + ("" if attn == "sdpa" else f"/{attn}")


def load(paths):
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError) as e:
            print(f"hf_plot: skipping {path}: {e}", file=sys.stderr)
            continue
        if "trials" in r and "alloc" in r:
            runs.append(r)
    key = lambda r: (r["new_tokens"], ORDER.index(config_name(r))  # noqa: E731
                     if config_name(r) in ORDER else 99)
    return sorted(runs, key=key)


def table(runs):
    lines = [
        "| configuration | new tokens | largest batch | tok/s | first failing batch | trials | "
        "peak reserved (GiB) | KV bytes copied |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        name = config_name(r)
        best = r.get("best")
        if best:
            copied = best.get("kv_bytes_copied")
            copied = (f"{copied:,} (measured)" if copied is not None else
                      f"{best['kv_bytes_copied_computed']:,} (computed)"
                      if "kv_bytes_copied_computed" in best else "")
            cells = [str(best["batch"]) + ("" if r.get("converged") else " (not converged)"),
                     f"{best['tokens_per_s']:,.0f}"]
            peak = f"{best.get('peak_reserved', 0) / 2**30:.2f}"
        else:
            cells, copied, peak = ["none", ""], "", ""
        failed = r.get("smallest_failed")
        lines.append(
            f"| {LABEL.get(name, name)} | {r['new_tokens']} | {cells[0]} | {cells[1]} | "
            f"{failed if failed is not None else 'none seen'} | {len(r['trials'])} | {peak} | "
            f"{copied} |"
        )
    return "\n".join(lines)


def plot(runs, out):
    try:
        import matplotlib
    except ImportError:
        print("hf_plot: matplotlib is not installed; no PNG", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["new_tokens"] for r in runs})
    names = [n for n in ORDER if any(config_name(r) == n for r in runs)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        batch, rate = [], []
        for n in lengths:
            r = next((r for r in runs if r["new_tokens"] == n and config_name(r) == name), None)
            best = r.get("best") if r else None
            batch.append(best["batch"] if best else 0)
            rate.append(best["tokens_per_s"] if best else 0)
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(lengths))]
        axes[0].bar(xs, batch, width, label=LABEL.get(name, name))
        axes[1].bar(xs, rate, width, label=LABEL.get(name, name))
    for ax, title in zip(axes, ("largest batch under the cap", "tokens / s at that batch")):
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([f"{n} new tokens" for n in lengths])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    cap = runs[0].get("cap_bytes", 0) / 2**30
    fig.suptitle(f"Llama 1.1B generate, prompts 256-1024 tokens, {cap:.0f} GiB cap")
    fig.tight_layout()
    path = os.path.join(out, "hf_capacity.png")
    fig.savefig(path, dpi=110)
    print(f"hf_plot: wrote {path}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    runs = load(args.files)
    if not runs:
        print("hf_plot: no hf_capacity results", file=sys.stderr)
        return 1
    print(table(runs))
    os.makedirs(args.out, exist_ok=True)
    plot(runs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
