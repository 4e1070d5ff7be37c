"""Sharing one allocation with another process: MoonBright (moonbright.ipc: one file
descriptor per chunk over a Unix socket, imported and mapped there) against CUDA's own IPC
(cudaIpcGetMemHandle on cudaMalloc memory, its 64-byte handle over the same socket,
cudaIpcOpenMemHandle there), on one GPU.

Per repetition the parent sends, the child opens (imports and maps, or cudaIpcOpenMemHandle),
reads 4 bytes back with a copy, closes and answers; the parent times the whole round trip and
the child its open, copy and close. The two ways alternate within each round, after two untimed
repetitions of each (MoonBright's first export of a chunk costs about 0.9 ms, later ones reuse
its descriptor). Sizes: 2 MiB,
64 MiB, 1 GiB (one chunk each under MoonBright's defaults) and 64 MiB stitched from 32
scattered 2 MiB pages. Prints p50/p99 in µs and the ratios; writes JSON with --json.

Under the LD_PRELOAD interposer (libmoonbright_preload.so) the CUDA side's cudaMalloc, cudaFree
and cudaIpc* calls are taken from the process's global scope, that is the interposer's: its
memory is then MoonBright's, and its handles the interposer's (the child runs it too), so that
column measures what an unmodified program gets from the interposer's CUDA IPC.

    python3 bench/ipc_pairs.py --json out.json
    LD_PRELOAD=libmoonbright_preload.so python3 bench/ipc_pairs.py --json preload.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import struct
import subprocess
import sys
import time

MIB = 1 << 20
SIZES = [("2 MiB", 2 * MIB), ("64 MiB", 64 * MIB), ("1 GiB", 1024 * MIB), ("64 MiB x32", 64 * MIB)]


def cudart():
    """The CUDA runtime PyTorch loaded (found in /proc/self/maps), with the IPC calls typed."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    path = next(
        line.split()[-1]
        for line in open("/proc/self/maps")
        if "libcudart.so" in line.split()[-1]
    )
    rt = ctypes.CDLL(path)
    if interposed():
        # The interposer's definitions: ctypes calls into libcudart directly would bypass it.
        glob = ctypes.CDLL(None)
        for name in ("cudaMalloc", "cudaFree", "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle",
                     "cudaIpcCloseMemHandle"):
            setattr(rt, name, getattr(glob, name))
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    rt.cudaFree.argtypes = [ctypes.c_void_p]
    rt.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(Handle), ctypes.c_void_p]
    rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), Handle, ctypes.c_uint]
    rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
    rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return rt


def interposed():
    """Whether the LD_PRELOAD interposer is in this process."""
    from moonbright.preload import report

    return report() is not None


class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what} failed: cudaError {r}")


def recv_exact(s, n):
    raw = b""
    while len(raw) < n:
        part = s.recv(n - len(raw))
        if not part:
            raise ConnectionError("the other process closed the socket")
        raw += part
    return raw


def read4(rt, ptr):
    out = ctypes.c_uint32()
    ck(rt.cudaMemcpy(ctypes.addressof(out), ctypes.c_void_p(ptr), 4, 2), "cudaMemcpy")
    return out.value


def child(fd: int) -> None:
    from moonbright import _moonbright

    rt = cudart()
    s = socket.socket(fileno=fd)
    s.settimeout(300)
    s.sendall(b"r")  # ready: PyTorch and the runtime are loaded
    while True:
        cmd = s.recv(1)
        if cmd in (b"", b"q"):
            return
        t0 = time.perf_counter_ns()
        if cmd == b"m":
            ptr, _ = _moonbright.ipc_recv(s.fileno(), 0)
            close = lambda: _moonbright.ipc_close(ptr, 0)  # noqa: E731
        else:
            h = Handle()
            raw = recv_exact(s, 64)
            ctypes.memmove(ctypes.addressof(h), raw, 64)
            p = ctypes.c_void_p()
            ck(rt.cudaIpcOpenMemHandle(ctypes.byref(p), h, 1), "cudaIpcOpenMemHandle")
            ptr = p.value
            close = lambda: ck(rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "close")  # noqa: E731
        t1 = time.perf_counter_ns()
        word = read4(rt, ptr)
        t2 = time.perf_counter_ns()
        close()
        t3 = time.perf_counter_ns()
        s.sendall(struct.pack("<QQQI", t1 - t0, t2 - t1, t3 - t2, word))


def pct(xs, p):
    v = sorted(xs)
    return v[max(0, min(len(v) - 1, int(round(p / 100 * len(v) + 0.5)) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child)

    import moonbright
    import torch
    from moonbright import _moonbright

    rt = cudart()
    lib = ctypes.CDLL(moonbright.library_path())
    lib.moonbright_alloc.restype = ctypes.c_void_p
    lib.moonbright_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    parent, other = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", str(other.fileno())], pass_fds=[other.fileno()]
    )
    other.close()
    parent.settimeout(120)

    def fill(ptr, size, word):
        torch.cuda.synchronize()
        buf = (ctypes.c_uint32 * 1)(word)
        ck(rt.cudaMemcpy(ctypes.c_void_p(ptr), ctypes.addressof(buf), 4, 1), "cudaMemcpy")

    mb, cu = {}, {}
    for name, size in SIZES:
        if name.endswith("x32"):
            holes = [lib.moonbright_alloc(2 * MIB, 0, None) for _ in range(64)]
            for h in holes[::2]:
                _moonbright_free(lib, h)
            cap = moonbright.cap()
            moonbright.set_cap(moonbright.memory_stats()["reserved_bytes.all.current"])
            mb[name] = lib.moonbright_alloc(size, 0, None)
            moonbright.set_cap(cap)
        else:
            mb[name] = lib.moonbright_alloc(size, 0, None)
        p = ctypes.c_void_p()
        ck(rt.cudaMalloc(ctypes.byref(p), size), "cudaMalloc")
        cu[name] = p.value
        fill(mb[name], size, 0xC0FFEE)
        fill(cu[name], size, 0xC0FFEE)
    before = moonbright.memory_stats()["moonbright.driver_calls.export"]

    def ask(cmd, ptr):
        t0 = time.perf_counter_ns()
        parent.sendall(cmd)
        if cmd == b"m":
            _moonbright.ipc_send(ptr, parent.fileno(), 0)
        else:
            h = Handle()
            ck(rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
            parent.sendall(ctypes.string_at(ctypes.addressof(h), 64))
        raw = recv_exact(parent, 28)
        t1 = time.perf_counter_ns()
        open_ns, copy_ns, close_ns, word = struct.unpack("<QQQI", raw)
        assert word == 0xC0FFEE, f"the child read {word:#x}"
        return (t1 - t0) / 1e3, open_ns / 1e3, copy_ns / 1e3, close_ns / 1e3

    assert recv_exact(parent, 1) == b"r"
    for name, _size in SIZES:  # warm-up, untimed: first exports, first imports
        for cmd in (b"m", b"c"):
            for _ in range(2):
                ask(cmd, mb[name] if cmd == b"m" else cu[name])
    samples = {}
    for _ in range(args.rounds):
        for name, _size in SIZES:
            for rep in range(args.reps):
                order = [b"m", b"c"] if rep % 2 == 0 else [b"c", b"m"]
                for cmd in order:
                    ptr = mb[name] if cmd == b"m" else cu[name]
                    way = "moonbright" if cmd == b"m" else "cudaIpc"
                    for k, v in zip(("round_trip", "open", "copy", "close"), ask(cmd, ptr)):
                        samples.setdefault((name, way, k), []).append(v)
    parent.sendall(b"q")
    proc.wait(timeout=60)
    exports = moonbright.memory_stats()["moonbright.driver_calls.export"] - before
    per_rep = args.rounds * args.reps
    via = "the interposer's" if interposed() else "the runtime's"
    print(f"{torch.cuda.get_device_name()}: {args.rounds} rounds x {args.reps} reps, µs; "
          f"cudaMalloc and cudaIpc* are {via}")
    print(f"{'size':>11} {'way':>11} {'round trip p50/p99':>20} {'open p50':>9} {'close p50':>10}")
    out = {"gpu": torch.cuda.get_device_name(), "reps": per_rep, "exports_per_rep": {}, "us": {},
           "cuda_ipc_via": "interposer" if interposed() else "runtime"}
    for name, _size in SIZES:
        for way in ("moonbright", "cudaIpc"):
            rt_ = samples[(name, way, "round_trip")]
            row = {k: {"p50": pct(samples[(name, way, k)], 50), "p99": pct(samples[(name, way, k)], 99)}
                   for k in ("round_trip", "open", "copy", "close")}
            out["us"][f"{name} {way}"] = row
            print(f"{name:>11} {way:>11} {pct(rt_, 50):9.1f} {pct(rt_, 99):9.1f} "
                  f"{row['open']['p50']:9.1f} {row['close']['p50']:10.1f}")
        r = pct(samples[(name, "moonbright", "round_trip")], 50) / pct(samples[(name, "cudaIpc", "round_trip")], 50)
        out["us"][f"{name} ratio round trip p50 moonbright/cudaIpc"] = r
        print(f"{name:>11} round trip p50 moonbright / cudaIpc = {r:.2f}")
    out["exports_total"] = exports
    print(f"descriptors exported: {exports} in {per_rep * len(SIZES)} sends")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _moonbright_free(lib, ptr):
    lib.moonbright_free.restype = None
    lib.moonbright_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.moonbright_free(ptr, 0, 0, None)


if __name__ == "__main__":
    main()
