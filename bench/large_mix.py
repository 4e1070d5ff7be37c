#!/usr/bin/env python3
"""Writes a synthetic trace of large allocations of mixed sizes, for `moonbright replay`.

What it is for: the price of large chunks. A need of `large_chunk` (1 GiB) or more is created
in chunks of the largest power of two it holds (`largest_chunk`, docs/design.md, Chunks), so a
cold 8 GiB allocation maps one handle; but a chunk is mapped whole, and a freed 8 GiB chunk
serves a smaller request only after a release-and-recreate split, where 1 GiB chunks are
stolen as they are. This trace makes that happen as often as a workload of large tensors of
changing sizes could: sizes log-uniform from 512 MiB to 16 GiB, rounded to MiB, each freed at a
random later point, at most `--live-gib` live at once (a random live one is freed first when
the next would pass it). Replay it with the defaults and with `--conf largest_chunk:1GiB` (the
rule before) and compare latency, driver calls and reserved memory.

Output is our CSV (`seq,action,addr,size,stream,dt_us`), gzipped when the name ends in `.gz`.
"""

import argparse
import gzip
import math
import random

MIB = 1 << 20
GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--allocs", type=int, default=400)
    ap.add_argument("--live-gib", type=float, default=64.0)
    ap.add_argument("--min-mib", type=int, default=512)
    ap.add_argument("--max-gib", type=int, default=16)
    ap.add_argument("--seed", type=int, default=20261130)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    lo, hi = math.log(args.min_mib * MIB), math.log(args.max_gib * GIB)
    budget = int(args.live_gib * GIB)
    live: dict[int, int] = {}  # addr -> size
    rows = []
    next_addr = 1 << 40

    def free(addr: int) -> None:
        rows.append(("free_completed", addr, live.pop(addr)))

    for _ in range(args.allocs):
        size = max(MIB, round(math.exp(rng.uniform(lo, hi)) / MIB) * MIB)
        while live and sum(live.values()) + size > budget:
            free(rng.choice(sorted(live)))
        addr, next_addr = next_addr, next_addr + size
        live[addr] = size
        rows.append(("alloc", addr, size))
        # About one free for each allocation on average, at random times.
        if live and rng.random() < 0.5:
            free(rng.choice(sorted(live)))
    for addr in sorted(live):
        free(addr)

    opener = gzip.open if args.out.endswith(".gz") else open
    with opener(args.out, "wt") as f:
        f.write("seq,action,addr,size,stream,dt_us\n")
        for seq, (action, addr, size) in enumerate(rows):
            f.write(f"{seq},{action},{addr},{size},0,\n")
    allocs = sum(1 for r in rows if r[0] == "alloc")
    print(f"wrote {args.out}: {allocs} allocations, {len(rows)} events, at most {args.live_gib} GiB live")


if __name__ == "__main__":
    main()
