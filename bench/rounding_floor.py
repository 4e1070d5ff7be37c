"""The least any page-granular allocator can hold for a trace: its requests of a page or more
rounded up to whole pages, those below to 256 bytes, with nothing else held, at the peak over
the trace (the live set as it changes, freed at `free_completed`). Against the trace's peak of
live requested bytes, this is a floor for the reserved/requested ratio of an allocator that
maps whole pages per allocation and packs nothing else into their tails.

    python3 bench/rounding_floor.py traces/trace_resnet.csv.gz [--page-mib 2]
"""

import argparse
import csv
import gzip


def floor(path: str, page: int) -> tuple[int, int]:
    live: dict[int, tuple[int, int]] = {}
    requested = rounded = peak_requested = peak_rounded = 0
    with gzip.open(path, "rt") as f:
        for row in csv.DictReader(f):
            action = row["action"]
            if action == "alloc":
                size = int(row["size"])
                unit = page if size >= page else 256
                r = -(-size // unit) * unit
                live[int(row["addr"])] = (size, r)
                requested += size
                rounded += r
            elif action == "free_completed" and int(row["addr"]) in live:
                size, r = live.pop(int(row["addr"]))
                requested -= size
                rounded -= r
            else:
                continue
            peak_requested = max(peak_requested, requested)
            peak_rounded = max(peak_rounded, rounded)
    return peak_requested, peak_rounded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--page-mib", type=int, default=2)
    args = ap.parse_args()
    for path in args.traces:
        req, rnd = floor(path, args.page_mib << 20)
        print(f"{path}: peak requested {req / 2**30:.3f} GiB, peak rounded {rnd / 2**30:.3f} GiB, "
              f"floor {rnd / req:.4f}")


if __name__ == "__main__":
    main()
