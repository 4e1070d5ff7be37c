"""What-if model: would splitting and coalescing mapped ranges, as PyTorch's caching allocator splits
its segments, serve the fragmentation stress without driver calls, within 1.05x of the memory?

It replays the stress's operation sequence (``stress --dump-ops ops.csv``) over a model of mapped
segments. Requests of a page or more only (sub-page ones go to MoonBright's arenas):

- a request takes the best-fitting free block of any segment and splits it, page-granular, with no
  driver call; a free coalesces with its free neighbours in the segment;
- when no block fits, a new segment is stitched from bare chunks, then from chunks lying wholly
  inside free blocks (stolen: the segment is cut around them), then from new chunks of at most
  ``--max-chunk-pages``; every chunk in it counts as one handle the request maps;
- optionally, between operations, a background mapper stitches stolen chunks into a free block of
  ``--window-pages`` when no free block is that large, at ``--budget`` handles per operation.

It prints peak held over peak requested bytes, hits, maps and handles by class. On the default
sequence (docs/design.md, Known limits): with 64 MiB chunks about 1,000 of 4,556
requests still map and held memory reaches 1.12-1.17x; with 2 MiB chunks memory stays at 1.012x
but a miss maps hundreds of handles.

``--trace T --repeat N`` replays a recorded trace (our CSV, ``traces/``) N times instead,
each pass's live blocks freed before the next, as ``moonbright replay --repeat N`` does: the maps
of passes 2..N are those of N passes less those of one (docs/design.md, "Over repeated
passes").
"""
import argparse
import csv
import gzip
import itertools

PAGE = 2 << 20


class Segment:
    def __init__(self, chunks):
        self.chunks = chunks  # [(chunk id, pages)] in address order
        self.blocks = {}  # start page -> [pages, live, freed seq]
        self.pages = sum(p for _, p in chunks)


class Model:
    def __init__(self, max_chunk_pages):
        self.max_chunk = max_chunk_pages
        self.seq = itertools.count()
        self.chunk_ids = itertools.count()
        self.seg_ids = itertools.count()
        self.chunk_pages = {}
        self.bare = {}
        self.segs = {}
        self.free_blocks = set()  # (segment, start)
        self.live = {}  # op id -> [segment, start, pages, bytes]
        self.held = self.peak_held = self.alloc = self.peak_alloc = 0
        self.hits = self.maps = self.handles = self.created = self.stolen = 0
        self.classes = {}
        self.bg_maps = self.bg_handles = 0

    def new_chunk(self, pages):
        c = next(self.chunk_ids)
        self.chunk_pages[c] = pages
        self.held += pages
        self.created += 1
        return c

    def best_fit(self, n):
        best = None
        for sid, st in self.free_blocks:
            b = self.segs[sid].blocks[st]
            if b[0] >= n and (best is None or (b[0], b[2]) < best[0]):
                best = ((b[0], b[2]), sid, st)
        return best

    def take(self, sid, st, n, key, size):
        s = self.segs[sid]
        b = s.blocks.pop(st)
        self.free_blocks.discard((sid, st))
        s.blocks[st] = [n, True, 0]
        if b[0] > n:
            s.blocks[st + n] = [b[0] - n, False, b[2]]
            self.free_blocks.add((sid, st + n))
        self.live[key] = [sid, st, n, size]

    def steal(self, need):
        """Chunks lying wholly inside free blocks, least recently freed blocks first."""
        got = []
        for sid, st in sorted(self.free_blocks, key=lambda k: self.segs[k[0]].blocks[k[1]][2]):
            if need <= 0:
                break
            s = self.segs[sid]
            lo, hi = st, st + s.blocks[st][0]
            o = 0
            for c, p in s.chunks:
                if o >= lo and o + p <= hi and need > 0:
                    got.append(c)
                    need -= p
                o += p
        stolen = set(got)
        for sid in [sid for sid, s in self.segs.items() if any(c in stolen for c, _ in s.chunks)]:
            self.cut(sid, stolen)
        self.stolen += len(got)
        return got

    def cut(self, sid, stolen):
        """Replaces segment `sid` by the runs of its chunks that were not stolen."""
        s = self.segs.pop(sid)
        for st in s.blocks:
            self.free_blocks.discard((sid, st))
        pieces, cur, start, o = [], [], 0, 0
        for c, p in s.chunks:
            if c in stolen:
                if cur:
                    pieces.append((start, cur))
                cur, start = [], o + p
            else:
                cur.append((c, p))
            o += p
        if cur:
            pieces.append((start, cur))
        for start, chunks in pieces:
            ns, nid = Segment(chunks), next(self.seg_ids)
            self.segs[nid] = ns
            end = start + ns.pages
            for bst, b in s.blocks.items():
                a, e = max(bst, start), min(bst + b[0], end)
                if a >= e:
                    continue
                ns.blocks[a - start] = [e - a, b[1], b[2]]
                if not b[1]:
                    self.free_blocks.add((nid, a - start))
                else:
                    for v in self.live.values():
                        if v[0] == sid and v[1] == bst:
                            v[0], v[1] = nid, a - start

    def stitch(self, n, limit=None):
        chunks, need = [], n
        for c in sorted(self.bare, key=lambda c: -self.bare[c]):
            if need <= 0 or (limit is not None and len(chunks) >= limit):
                break
            chunks.append(c)
            need -= self.bare.pop(c)
        if need > 0 and (limit is None or len(chunks) < limit):
            for c in self.steal(need):
                chunks.append(c)
                need -= self.chunk_pages[c]
        while need > 0 and limit is None:
            p = min(need, self.max_chunk)
            chunks.append(self.new_chunk(p))
            need -= p
        if not chunks:
            return None
        s, sid = Segment([(c, self.chunk_pages[c]) for c in chunks]), next(self.seg_ids)
        self.segs[sid] = s
        s.blocks[0] = [s.pages, False, next(self.seq)]
        self.free_blocks.add((sid, 0))
        self.peak_held = max(self.peak_held, self.held)
        return sid, len(chunks)

    def malloc(self, key, size):
        n = -(-size // PAGE)
        self.alloc += size
        self.peak_alloc = max(self.peak_alloc, self.alloc)
        fit = self.best_fit(n)
        if fit:
            self.hits += 1
            self.take(fit[1], fit[2], n, key, size)
            return
        sid, handles = self.stitch(n)
        self.maps += 1
        self.handles += handles
        cls = min(handles.bit_length(), 6)
        self.classes[cls] = self.classes.get(cls, 0) + 1
        self.take(sid, 0, n, key, size)

    def free(self, key):
        sid, st, _, size = self.live.pop(key)
        self.alloc -= size
        s = self.segs[sid]
        b = s.blocks[st]
        b[1], b[2] = False, next(self.seq)
        nxt = st + b[0]
        if nxt in s.blocks and not s.blocks[nxt][1]:
            b[0] += s.blocks.pop(nxt)[0]
            self.free_blocks.discard((sid, nxt))
        prev = [k for k in s.blocks if k < st and k + s.blocks[k][0] == st]
        if prev and not s.blocks[prev[0]][1]:
            s.blocks[prev[0]][0] += b[0]
            s.blocks[prev[0]][2] = b[2]
            del s.blocks[st]
        else:
            self.free_blocks.add((sid, st))

    def largest_free(self):
        return max((self.segs[s].blocks[st][0] for s, st in self.free_blocks), default=0)


def trace_ops(path, repeat):
    """A recorded trace's allocs and completed frees as (op, id, size), `repeat` times over, each
    pass's blocks still live freed at its end (an address allocated again drops its old block)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", newline="") as f:
        rows = [(r["action"] == "alloc", int(r["addr"]), int(r["size"]))
                for r in csv.DictReader(f) if r["action"] in ("alloc", "free_completed")]
    ids = itertools.count(1)
    for _ in range(repeat):
        live = {}
        for is_alloc, addr, size in rows:
            if addr in live:  # its completed free, or its address allocated again without one
                yield {"op": "f", "id": live.pop(addr), "size": 0}
            if is_alloc:
                live[addr] = next(ids)
                yield {"op": "a", "id": live[addr], "size": size}
        for key in live.values():
            yield {"op": "f", "id": key, "size": 0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ops", nargs="?", help="CSV from `stress --dump-ops` (op,id,size)")
    ap.add_argument("--trace", help="a recorded trace instead (our CSV, gzipped or not)")
    ap.add_argument("--repeat", type=int, default=1, help="with --trace: passes over it")
    ap.add_argument("--max-chunk-pages", type=int, default=32)
    ap.add_argument("--window-pages", type=int, default=0)
    ap.add_argument("--budget", type=float, default=0.0, help="background handles per operation")
    a = ap.parse_args()
    if (a.ops is None) == (a.trace is None):
        ap.error("give an ops CSV or --trace")
    ops = trace_ops(a.trace, a.repeat) if a.trace else csv.DictReader(open(a.ops))
    m = Model(a.max_chunk_pages)
    budget = 0.0
    for op in ops:
        key = int(op["id"])
        budget = min(budget + a.budget, 64)
        if a.window_pages and budget >= 1 and m.largest_free() < a.window_pages:
            made = m.stitch(a.window_pages, limit=int(budget))
            if made:
                budget -= made[1]
                m.bg_maps += 1
                m.bg_handles += made[1]
        if op["op"] == "a":
            if int(op["size"]) >= PAGE:
                m.malloc(key, int(op["size"]))
        elif key in m.live:
            m.free(key)
    names = ["0", "1", "2-3", "4-7", "8-15", "16-31", "32+"]
    classes = ", ".join(f"{names[c]}: {k}" for c, k in sorted(m.classes.items()))
    print(
        f"max chunk {a.max_chunk_pages} pages, window {a.window_pages} pages, budget {a.budget}: "
        f"held/requested {m.peak_held * PAGE / m.peak_alloc:.3f}, hits {m.hits}, maps {m.maps} "
        f"(handles {m.handles}; by handles {classes}), background maps {m.bg_maps} "
        f"({m.bg_handles} handles)"
    )


if __name__ == "__main__":
    main()
