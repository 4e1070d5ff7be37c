#!/usr/bin/env python3
"""Sleep and wake side by side: torch_memory_saver (its torch hook mode) against MoonBright
(``moonbright.torch.enable()`` and ``moonbright.tag``), one process per allocator on the same
card, one after the other, on the same scenario.

The scenario: ``--size-gib`` of *weights* in tensors of ``--tensor-mib`` (filled with
seeded random bytes), put to sleep with a backup to host memory, and as many bytes of *KV
cache* in ``--kv-tensors`` tensors, discarded at sleep. Each cycle puts the weights to sleep,
then the KV cache, then wakes the weights, then the KV cache, timing each call until it has
returned and the device is idle (``torch.cuda.synchronize()`` after the call; the device is
idle before it). After each wake the weights are compared with their seeds' bytes (and a
checksum of each tensor with the one taken before the first sleep) and the KV cache is written.
The first cycle is reported apart from the later ones (their median), since both allocators
set up host memory at the first sleep.

In the same process, after the cycles: the raw bandwidth of a pinned copy of ``--raw-gib``
(default: the weights' size, at most 16 GiB) between one device tensor and one pinned host
tensor, device to host and host to device, best of three; sleep and wake of the weights are
reported against it. Free device memory (``torch.cuda.mem_get_info``) and host memory (VmRSS
and the other ``/proc/self/status`` memory lines) are read at the start, awake, asleep and
after each wake; MoonBright's sleep and pinned-pool statistics are added where it reports them.

    python3 bench/sleep.py --json sleep.json                  # 16 GiB + 16 GiB, 5 cycles
    python3 bench/sleep.py --size-gib 1 --cycles 3            # a quick run
    python3 bench/sleep.py --allocators moonbright            # one of them

Allocators: ``moonbright`` (``MOONBRIGHT_ALLOC_CONF`` is passed through),
``moonbright-pinned`` (the same, with the weights' host memory pinned ahead by
``moonbright.reserve_host_memory``, timed apart: the first sleep then pins nothing), ``tms``
(``torch_memory_saver``, ``hook_mode = "torch"``: tensors of a region come from a
``torch.cuda.MemPool`` over its pluggable allocator, no ``LD_PRELOAD``; each region's pool is
keyed by tag and backup, so weights and KV cache never share a segment). Neither worker sees
``PYTORCH_CUDA_ALLOC_CONF`` (torch_memory_saver refuses expandable segments).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time

GIB = 1 << 30
MIB = 1 << 20
ALLOCATORS = ["moonbright", "moonbright-pinned", "tms"]
TAGS = (("weights", True), ("kv", False))
STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin")


# ---------------------------------------------------------------------------------------------
# The allocators, behind one small interface: scope(tag, backup), sleep(tag, backup), wake(tag).


class MoonBright:
    name = "moonbright"

    def __init__(self) -> None:
        import moonbright
        import moonbright.torch

        moonbright.torch.enable()
        self.mb = moonbright

    def version(self) -> str:
        return self.mb.__version__

    def scope(self, tag: str, backup: bool):
        return self.mb.tag(tag)

    def sleep(self, tag: str, backup: bool):
        return self.mb.sleep(tag, backup=backup)

    def wake(self, tag: str):
        return self.mb.wake(tag)

    def stats(self) -> dict:
        """The pinned host memory MoonBright holds for sleeps, and its statistics on them."""
        s = self.mb.memory_stats()
        out = {k: v for k, v in s.items() if re.search(r"asleep|sleep|wake|backup|pinned", k)}
        out["host_memory"] = self.mb.host_memory()
        return out


class MoonBrightPinned(MoonBright):
    """MoonBright with the weights' host memory pinned ahead (`reserve_host_memory`), as a
    program that knows what it will put to sleep does while it loads: the first sleep then
    pins nothing."""

    name = "moonbright-pinned"

    def prepare(self, backup_bytes: int) -> float:
        t0 = time.perf_counter()
        self.mb.reserve_host_memory(backup_bytes)
        return time.perf_counter() - t0


class TorchMemorySaver:
    name = "tms"

    def __init__(self) -> None:
        from torch_memory_saver import torch_memory_saver

        # The in-process mode: a pluggable allocator under a MemPool per region, no LD_PRELOAD
        # (the default, "preload", needs the library preloaded into the process).
        torch_memory_saver.hook_mode = "torch"
        self.tms = torch_memory_saver

    def version(self) -> str:
        from importlib.metadata import version

        return version("torch_memory_saver")

    def scope(self, tag: str, backup: bool):
        return self.tms.region(tag=tag, enable_cpu_backup=backup)

    def sleep(self, tag: str, backup: bool):
        return self.tms.pause(tag)

    def wake(self, tag: str):
        return self.tms.resume(tag)

    def stats(self) -> dict:
        return {}


# ---------------------------------------------------------------------------------------------
# The worker: one allocator, one process.


def proc_status() -> dict[str, int]:
    """The memory lines of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(value.split()[0]) * 1024
    return out


def jsonable(value):
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def run_worker(args) -> dict:
    api = {"moonbright": MoonBright, "moonbright-pinned": MoonBrightPinned,
           "tms": TorchMemorySaver}[args.worker]()
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    sync = torch.cuda.synchronize

    def free_bytes() -> int:
        return int(torch.cuda.mem_get_info()[0])

    def snapshot(label: str) -> dict:
        sync()
        return {"at": label, "free": free_bytes(), "host": proc_status(), "mb": api.stats()}

    tensor_bytes = args.tensor_mib * MIB
    n_weights = max(1, round(args.size_gib * GIB / tensor_bytes))
    kv_each = int(args.size_gib * GIB / args.kv_tensors) // (2 * MIB) * (2 * MIB)
    raw_bytes = int((args.raw_gib or min(args.size_gib, 16)) * GIB)
    seed0 = 20260949
    out = {
        "allocator": api.name,
        "version": api.version(),
        "torch": torch.__version__,
        "card": torch.cuda.get_device_name(),
        "total_bytes": int(torch.cuda.mem_get_info()[1]),
        "weights": {"tensors": n_weights, "bytes": n_weights * tensor_bytes},
        "kv": {"tensors": args.kv_tensors, "bytes": args.kv_tensors * kv_each},
        "memory": [snapshot("start")],
    }

    t0 = time.perf_counter()
    with api.scope("weights", True):
        weights = [torch.empty(tensor_bytes, dtype=torch.uint8, device="cuda")
                   for _ in range(n_weights)]
    with api.scope("kv", False):
        kv = [torch.empty(kv_each, dtype=torch.uint8, device="cuda")
              for _ in range(args.kv_tensors)]
    sync()
    out["allocate_s"] = time.perf_counter() - t0
    if hasattr(api, "prepare"):
        out["pin_ahead_s"] = api.prepare(n_weights * tensor_bytes)

    def seeded(i: int, into) -> None:
        into.random_(0, 256, generator=torch.Generator(device="cuda").manual_seed(seed0 + i))

    def checksums() -> str:
        # Each tensor's sum of 32-bit words, in int64 (no overflow below 2^32 words), in order.
        sums = torch.stack([w.view(torch.int32).sum(dtype=torch.int64) for w in weights])
        return hashlib.sha256(repr(sums.tolist()).encode()).hexdigest()

    def weights_equal_seeds() -> bool:
        scratch = torch.empty(tensor_bytes, dtype=torch.uint8, device="cuda")
        ok = True
        for i, w in enumerate(weights):
            seeded(i, scratch)
            ok = ok and bool(torch.equal(w, scratch))
        del scratch
        return ok

    for i, w in enumerate(weights):
        seeded(i, w)
    for t in kv:
        t.fill_(1)
    checksum = checksums()
    torch.cuda.empty_cache()  # the checks' scratch, untagged, out of the free-memory figures
    out["checksum"] = checksum
    out["memory"].append(snapshot("awake"))

    cycles = []
    for c in range(args.cycles):
        rec: dict = {"cycle": c}
        sync()
        rec["awake"] = snapshot("awake")
        for tag, backup in TAGS:
            t0 = time.perf_counter()
            r = api.sleep(tag, backup)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            rec[f"sleep_{tag}"] = {"s": t2 - t0, "call_s": t1 - t0, "result": jsonable(r)}
        rec["asleep"] = snapshot("asleep")
        for tag, _ in TAGS:
            t0 = time.perf_counter()
            r = api.wake(tag)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            rec[f"wake_{tag}"] = {"s": t2 - t0, "call_s": t1 - t0, "result": jsonable(r)}
        rec["woken"] = snapshot("woken")
        for t in kv:
            t.fill_(c & 0xFF)
        rec["checksum_equal"] = checksums() == checksum
        rec["weights_equal_seeds"] = weights_equal_seeds()
        torch.cuda.empty_cache()
        sync()
        cycles.append(rec)
        print(f"[{api.name}] cycle {c}: weights sleep {rec['sleep_weights']['s']:.3f} s, "
              f"wake {rec['wake_weights']['s']:.3f} s; kv sleep "
              f"{rec['sleep_kv']['s'] * 1e3:.1f} ms, wake {rec['wake_kv']['s'] * 1e3:.1f} ms; "
              f"intact {rec['weights_equal_seeds']}",
              file=sys.stderr, flush=True)
    out["cycles"] = cycles
    out["memory"].append(snapshot("end"))

    # The raw pinned copy, after the cycles so that its pinned buffer (which PyTorch's host
    # allocator keeps cached) stays out of the host-memory figures above.
    d = torch.empty(raw_bytes, dtype=torch.uint8, device="cuda")
    d.fill_(7)
    t0 = time.perf_counter()
    h = torch.empty(raw_bytes, dtype=torch.uint8, pin_memory=True)
    pin_s = time.perf_counter() - t0
    d2h, h2d = [], []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        h.copy_(d, non_blocking=True)
        sync()
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        d.copy_(h, non_blocking=True)
        sync()
        h2d.append(time.perf_counter() - t0)
    out["raw"] = {
        "bytes": raw_bytes,
        "pin_s": pin_s,
        "d2h_s": d2h,
        "h2d_s": h2d,
        "d2h_gib_s": raw_bytes / GIB / min(d2h),
        "h2d_gib_s": raw_bytes / GIB / min(h2d),
    }
    return out


# ---------------------------------------------------------------------------------------------
# The driver: one worker process per allocator, then the table.


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "LD_PRELOAD"):
        env.pop(key, None)
    return env


def run_one(name: str, args, passthrough: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, *passthrough]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True,
                           timeout=args.worker_timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"allocator": name, "error": f"timed out after {args.worker_timeout} s",
                "stderr": err[-4000:]}
    sys.stderr.write(r.stderr)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"allocator": name, "error": f"exit status {r.returncode}",
                "stderr": r.stderr[-4000:]}
    res = json.loads(lines[-1])
    res["wall_s"] = time.perf_counter() - t0
    return res


def phase(res: dict, key: str) -> dict:
    """First cycle and the median of the later ones (the first again if there is one cycle)."""
    times = [c[key]["s"] for c in res["cycles"]]
    later = times[1:] or times
    return {"first": times[0], "steady": statistics.median(later)}


def summarise(res: dict) -> dict:
    if "error" in res:
        return {}
    w, kv = res["weights"]["bytes"], res["kv"]["bytes"]
    raw = res["raw"]
    s = {}
    for key, nbytes, raw_bw in (("sleep_weights", w, raw["d2h_gib_s"]),
                                ("wake_weights", w, raw["h2d_gib_s"])):
        p = phase(res, key)
        for which in ("first", "steady"):
            bw = nbytes / GIB / p[which]
            s[f"{key}.{which}"] = {"s": p[which], "gib_s": bw, "of_raw": bw / raw_bw}
    for key in ("sleep_kv", "wake_kv"):
        p = phase(res, key)
        for which in ("first", "steady"):
            s[f"{key}.{which}"] = {"s": p[which]}
    cyc = res["cycles"]
    awake = [c["awake"]["free"] for c in cyc]
    asleep = [c["asleep"]["free"] for c in cyc]
    woken = [c["woken"]["free"] for c in cyc]
    rss = lambda snap: snap["host"].get("VmRSS", 0)  # noqa: E731
    s["free"] = {"start": res["memory"][0]["free"], "awake": awake[0],
                 "asleep": statistics.median(asleep), "woken_first": woken[0],
                 "woken_last": woken[-1]}
    s["released_of_held"] = statistics.median(a - b for a, b in zip(asleep, awake)) / (w + kv)
    s["rss"] = {"start": rss(res["memory"][0]), "awake": rss(cyc[0]["awake"]),
                "asleep_first": rss(cyc[0]["asleep"]), "asleep_last": rss(cyc[-1]["asleep"]),
                "woken_first": rss(cyc[0]["woken"]), "woken_last": rss(cyc[-1]["woken"])}
    s["intact"] = all(c["weights_equal_seeds"] and c["checksum_equal"] for c in cyc)
    return s


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _rate(s: dict) -> str:
    return f"{s['s']:.3f} s {s['gib_s']:6.2f} GiB/s {s['of_raw']:.2f}x"


def _rows():
    """(label, cell(run, summary)) for each line of the table."""
    for key, label in (("sleep_weights", "weights sleep"), ("wake_weights", "weights wake")):
        for which in ("first", "steady"):
            yield f"{label}, {which}", lambda r, s, k=f"{key}.{which}": _rate(s[k])
    for key, label in (("sleep_kv", "kv sleep"), ("wake_kv", "kv wake")):
        for which in ("first", "steady"):
            yield f"{label}, {which}", lambda r, s, k=f"{key}.{which}": f"{s[k]['s'] * 1e3:.1f} ms"
    yield "host memory pinned ahead", \
        lambda r, s: f"{r['pin_ahead_s']:.3f} s" if "pin_ahead_s" in r else "-"
    yield "raw pinned D2H / H2D", \
        lambda r, s: f"{r['raw']['d2h_gib_s']:.1f} / {r['raw']['h2d_gib_s']:.1f} GiB/s"
    yield "free GiB: start / awake", \
        lambda r, s: f"{_gib(s['free']['start'])} / {_gib(s['free']['awake'])}"
    yield "free GiB: asleep", lambda r, s: _gib(s["free"]["asleep"])
    yield "free GiB: woken first / last", \
        lambda r, s: f"{_gib(s['free']['woken_first'])} / {_gib(s['free']['woken_last'])}"
    yield "released asleep / held", lambda r, s: f"{s['released_of_held']:.4f}"
    for a, b in (("start", "awake"), ("asleep_first", "asleep_last"),
                 ("woken_first", "woken_last")):
        label = "RSS GiB: " + (f"{a} / {b}" if a == "start" else
                               f"{a.split('_')[0]} first / last")
        yield label, lambda r, s, a=a, b=b: f"{_gib(s['rss'][a])} / {_gib(s['rss'][b])}"
    yield "weights intact every cycle", lambda r, s: str(s["intact"])


def table(doc: dict) -> str:
    runs = doc["runs"]
    sums = [summarise(r) for r in runs]
    lines = []
    ok = [r for r in runs if "error" not in r]
    if ok:
        r0 = ok[0]
        lines.append(
            f"sleep/wake on {r0['card']}: weights {_gib(r0['weights']['bytes'])} GiB in "
            f"{r0['weights']['tensors']} tensors (backed up), KV {_gib(r0['kv']['bytes'])} GiB "
            f"in {r0['kv']['tensors']} (discarded), {len(r0['cycles'])} cycles; "
            f"torch {r0['torch']}")
    lines.append("".ljust(30) + "".join(r["allocator"].rjust(32) for r in runs))
    for label, cell in _rows():
        cells = [("error: " + r["error"])[:30] if "error" in r else cell(r, s)
                 for r, s in zip(runs, sums)]
        lines.append(label.ljust(30) + "".join(c.rjust(32) for c in cells))
    lines.append("GiB/s: the weights' bytes over the time until the device is idle after the "
                 "call; x: that over the raw pinned copy's best in the same process (device to "
                 "host for sleep, host to device for wake). Steady: median of cycles 2 on.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--size-gib", type=float, default=16.0,
                    help="bytes of weights, and as many of KV cache (default 16)")
    ap.add_argument("--tensor-mib", type=int, default=100, help="size of each weight tensor")
    ap.add_argument("--kv-tensors", type=int, default=1, help="tensors the KV cache is split in")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--raw-gib", type=float, default=0.0,
                    help="size of the raw pinned copy (default: the weights', at most 16)")
    ap.add_argument("--worker-timeout", type=int, default=270,
                    help="seconds each worker may run")
    ap.add_argument("--json")
    ap.add_argument("--worker", choices=ALLOCATORS, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        res = run_worker(args)
        sys.stdout.write(json.dumps(res) + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip teardown: pools and pinned buffers of tens of GiB, which neither needs freed.
        os._exit(0)

    passthrough = ["--size-gib", str(args.size_gib), "--tensor-mib", str(args.tensor_mib),
                   "--kv-tensors", str(args.kv_tensors), "--cycles", str(args.cycles),
                   "--raw-gib", str(args.raw_gib)]
    names = [n for n in args.allocators.split(",") if n]
    for n in names:
        if n not in ALLOCATORS:
            raise SystemExit(f"sleep.py: unknown allocator {n!r} (known: {', '.join(ALLOCATORS)})")
    doc = {
        "benchmark": "sleep",
        "args": vars(args),
        "commit": os.environ.get("MOONBRIGHT_COMMIT", ""),
        "moonbright_alloc_conf": os.environ.get("MOONBRIGHT_ALLOC_CONF", ""),
        "date": time.strftime("%Y-%m-%d"),
        "runs": [],
    }
    for n in names:
        print(f"== {n}", file=sys.stderr, flush=True)
        doc["runs"].append(run_one(n, args, passthrough))
    doc["summary"] = {r["allocator"]: summarise(r) for r in doc["runs"]}
    text = table(doc)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all("error" not in r for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
