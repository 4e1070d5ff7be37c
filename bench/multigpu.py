#!/usr/bin/env python3
"""Several GPUs, one process per GPU: torch.distributed and NCCL on MoonBright memory against
PyTorch's own allocator (issue 50), one set of processes per configuration and part.

Configurations (``--config``, repeat it): ``torch`` (PyTorch's caching allocator), ``mb``
(``moonbright.torch.enable()`` first thing in every rank), ``preload`` (``torch`` under the
LD_PRELOAD interposer, ``--preload-lib``). Parts (``--parts``, comma-separated):

- ``collectives``: all_reduce, all_gather_into_tensor and reduce_scatter_tensor of
  integer-valued float32 data, checked against values computed on the host (small sizes) or by
  the same formula on the device (the timed tensors); all-reduce bandwidth at ``--sizes``
  (64 MiB, 512 MiB, 2 GiB): warm-up, then the median of ``--iters`` iterations, each timed
  with CUDA events; bus bandwidth by nccl-tests' formula, 2(n-1)/n x bytes / time (0 on one
  GPU, so algorithm bandwidth, bytes / time, is reported too). ``--rounds`` repeats this part,
  configurations interleaved, and the table takes each one's median.
- ``register``: NCCL user-buffer registration. A ``torch.cuda.MemPool`` (``mb``: from
  ``moonbright.torch.pool()``, in processes of their own that do not call ``enable()``, which
  refuses pools; ``torch``/``preload``: PyTorch's default pool) holds tensors of
  ``--register-sizes`` (192 MiB, 1 GiB, 2 GiB), stitched from several physical chunks under
  ``--stitch-conf`` (by default MoonBright chunks of at most 64 MiB: 3, 16 and 32 chunks; the
  chunks behind each tensor are read from ``moonbright.snapshot()``); all-reduce bandwidth
  before and after ``ProcessGroupNCCL.register_mem_pool``; the three collectives correct on
  registered memory, and on a tensor allocated in the pool after registration (PyTorch's
  allocator hook registers it). Then ``ncclCommRegister`` direct, through ctypes on the
  libnccl PyTorch loaded, with a communicator of its own (``ncclGetUniqueId`` on rank 0, sent
  with ``broadcast_object_list``; ``ncclCommInitRank``; ``ncclAllReduce`` on PyTorch's
  current stream; ``ncclCommDeregister``; ``ncclCommDestroy``), on the same tensors (under
  ``mb`` also on tensors of ``enable()``'s global allocator), with bandwidth unregistered and
  registered. Every NCCL result is checked; a failure is reported with NCCL's message as a
  failed check, and the part goes on.
- ``ddp``: DistributedDataParallel training of an MLP for ``--steps`` steps on synthetic data,
  deterministic (fixed seeds, ``torch.use_deterministic_algorithms(True)``, no TF32); rank 0
  reports every loss (``float.hex``), every rank a SHA-256 of its parameters' bytes. The
  replicas must agree, and every configuration must match ``torch`` bit for bit.
- ``ipc``: two processes, whatever the world size: the sender on GPU 0 puts tensors (8 MiB,
  300 MiB, a strided view) on a ``torch.multiprocessing`` queue; the receiver, on GPU 1 (GPU 0
  when there is one), reads them (through peer access where they live on the other GPU),
  writes into them, and the sender sees the writes. Under ``mb`` they go by
  :mod:`moonbright.ipc`, which maps them on the receiver's GPU; under ``torch`` by PyTorch's
  CUDA IPC; under ``preload`` by the interposer's ``cudaIpc*``.
- ``sleep`` (``mb`` only): rank 0 tags 1 GiB of tensors, queues all-reduces that cannot finish
  until rank 1 joins (it waits ``--sleep-delay`` seconds), and puts the tag to sleep while they
  are in flight; all-reduces while it sleeps, wake, the tag's bytes intact, and an all-reduce of
  a woken tensor across all ranks, correct.

Every process set gets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 (NVLink multicast stays off), CUBLAS_WORKSPACE_CONFIG=:4096:8, and no
PYTORCH_ALLOC_CONF. World size: ``--nproc`` (default: every GPU). Output: a table, and with
``--json`` every rank's results, the provenance (cards, driver, topology, torch, CUDA, NCCL,
MoonBright, commit, command) and a summary. Exit status 1 if a correctness check failed or a
process set failed, 2 without a GPU.

    python3 bench/multigpu.py --json multigpu.json                  # every part, torch and mb
    python3 bench/multigpu.py --parts collectives --rounds 5
    python3 bench/multigpu.py --parts ipc --config torch --config mb --config preload \\
        --preload-lib carry/lib/libmoonbright_preload.so
    python3 bench/multigpu.py --cpu-dry-run --nproc 2                # the harness, no GPU

``--cpu-dry-run`` checks the harness without a GPU: gloo, CPU tensors, wall-clock timing, small
sizes; ``mb`` runs as ``torch`` there (no MoonBright), and the NCCL- and MoonBright-only parts
(``register``, ``sleep``, ``ipc`` under ``mb``) are skipped.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import importlib
import json
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from typing import Any, Callable

MIB = 1 << 20
PARTS = ["collectives", "register", "ddp", "ipc", "sleep"]
CONFIGS = ["torch", "mb", "preload"]
DEFAULT_CONFIGS = ["torch", "mb"]
# Parts whose bandwidth is compared between configurations, repeated --rounds times.
ROUNDED_PARTS = ("collectives",)
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# MoonBright chunks of at most 64 MiB, so that every registered tensor is stitched.
STITCH_CONF = "large_chunk:64MiB,largest_chunk:64MiB"
# Elements per rank of the collectives checked on the host: odd, unaligned, and 16 MiB.
CHECK_NUMELS = (7, 262_147, 4 << 20)
# All-reduce bus bandwidth MoonBright must reach, of PyTorch's allocator's (issue 50).
BANDWIDTH_TARGET = 0.97
SLEEP_TAG = "multigpu-sleep"
DRY_SIZES_MIB = (1, 8)
RANK_GRACE_S = 30
TEARDOWN_S = 60


# ---------------------------------------------------------------------------------------------
# Data the checks can recompute: integer-valued float32, exact under sums of a few ranks.


def pattern_values(torch: Any, q: Any, idx: Any, salt: int = 0) -> Any:
    """Rank ``q``'s values at int64 indices ``idx``: (3i + 11q + salt) mod 509, as float32
    (``q`` an int, or a tensor of ranks beside ``idx``)."""
    return ((idx * 3 + 11 * q + salt) % 509).to(torch.float32)


def fill_pattern(torch: Any, x: Any, q: int, salt: int = 0, step: int = 1 << 24) -> None:
    """Writes rank ``q``'s pattern into the 1-D float32 tensor ``x``, a slice at a time (no
    index tensor as large as ``x``)."""
    for start in range(0, x.numel(), step):
        idx = torch.arange(start, min(start + step, x.numel()), device=x.device)
        x[start:start + idx.numel()] = pattern_values(torch, q, idx, salt)


def mismatches(torch: Any, x: Any, expected: Callable[[Any], Any], on_host: bool,
               step: int = 1 << 24) -> dict:
    """Compares the 1-D tensor ``x`` with ``expected(idx)`` (int64 indices -> float32), a slice
    at a time, on the host (``x`` copied there) or on ``x``'s device. Returns the number of
    elements that differ and the first one's index (None if all match)."""
    device = "cpu" if on_host else x.device
    bad, first = 0, None
    for start in range(0, x.numel(), step):
        part = x[start:start + step].to(device)
        idx = torch.arange(start, start + part.numel(), device=device)
        diff = part != expected(idx)
        n = int(diff.sum())
        if n and first is None:
            first = start + int(diff.nonzero()[0, 0])
        bad += n
    return {"bad": bad, "first_bad": first}


def all_reduce_expected(torch: Any, world: int, salt: int = 0) -> Callable[[Any], Any]:
    return lambda idx: sum(pattern_values(torch, q, idx, salt) for q in range(world))


def tensor_digest(tensors: list) -> str:
    """SHA-256 of the tensors' bytes, in order (copied to the host; no NumPy needed)."""
    h = hashlib.sha256()
    for t in tensors:
        c = t.detach().cpu().contiguous()
        h.update(ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# A rank's surroundings.


class Rank:
    """What a part needs in a rank: torch, the process group, its device, the timer, and the
    checks it has made (name -> passed) and the errors it met."""

    def __init__(self, rank: int, spec: dict) -> None:
        import torch

        self.torch = torch
        self.rank = rank
        self.world = spec["nproc"]
        self.mode = spec["mode"]
        self.opts = spec["opts"]
        self.dry = spec["dry"]
        self.cuda = not self.dry
        self.device_index = 0
        self.checks: dict[str, bool] = {}
        self.errors: list[str] = []
        self.dist: Any = None

    @property
    def device(self) -> Any:
        if self.cuda:
            return self.torch.device("cuda", self.device_index)
        return self.torch.device("cpu")

    def init_group(self, init_file: str) -> None:
        """The process group: NCCL bound to this rank's GPU (eager, as ``register_mem_pool``
        needs a communicator), gloo in a dry run."""
        import torch.distributed as dist

        self.dist = dist
        if self.cuda:
            self.device_index = self.rank
            self.torch.cuda.set_device(self.device_index)
            dist.init_process_group("nccl", init_method="file://" + init_file, rank=self.rank,
                                    world_size=self.world, device_id=self.device)
        else:
            dist.init_process_group("gloo", init_method="file://" + init_file, rank=self.rank,
                                    world_size=self.world)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def check(self, name: str, passed: bool, detail: Any = None) -> bool:
        self.checks[name] = bool(passed)
        if not passed:
            self.errors.append(f"{name}: failed" + (f" ({detail})" if detail is not None else ""))
        return bool(passed)

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a collective over the process group), so that
        every rank takes the same branch and no collective is left waiting for a peer."""
        flag = self.torch.tensor([0 if ok else 1], device=self.device)
        self.dist.all_reduce(flag)
        return int(flag.item()) == 0

    def timed(self, run: Callable[[], Any], warmup: int, iters: int) -> dict:
        """Seconds per call of ``run`` (one collective): median, mean and least of ``iters``
        calls after ``warmup``, all ranks starting together. On a GPU each call is timed by
        CUDA events on the current stream (PyTorch makes it wait for NCCL's), the mean from
        the first event to the last; in a dry run by the wall clock."""
        for _ in range(warmup):
            run()
        self.sync()
        self.dist.barrier()
        self.sync()
        if not self.cuda:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            mean = sum(times) / iters
        else:
            Event = self.torch.cuda.Event
            starts = [Event(enable_timing=True) for _ in range(iters)]
            ends = [Event(enable_timing=True) for _ in range(iters)]
            for s, e in zip(starts, ends):
                s.record()
                run()
                e.record()
            self.torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
            mean = starts[0].elapsed_time(ends[-1]) / 1e3 / iters
        return {"median_s": statistics.median(times), "mean_s": mean, "min_s": min(times)}

    def handles_behind(self, t: Any) -> dict | None:
        """The MoonBright segment that holds tensor ``t``'s storage: its physical chunks
        (handles), size and kind, from ``moonbright.snapshot()``; None outside MoonBright."""
        if self.mode not in ("mb", "mb-pool") or not self.cuda:
            return None
        import moonbright

        ptr = t.untyped_storage().data_ptr()
        for s in moonbright.snapshot(self.device_index)["segments"]:
            if s["address"] <= ptr < s["address"] + s["total_size"]:
                return {"chunks": s["moonbright_chunks"], "segment_bytes": s["total_size"],
                        "kind": s["moonbright_kind"], "offset": ptr - s["address"]}
        return None


def sizes_mib(ctx: Rank, key: str) -> list[int]:
    return list(ctx.opts[key])


# ---------------------------------------------------------------------------------------------
# Part a: collectives.


def check_collectives(ctx: Rank, tag: str, make: Callable[[int], Any], numel: int,
                      on_host: bool) -> None:
    """all_reduce, all_gather_into_tensor and reduce_scatter_tensor of ``numel`` elements per
    rank, on tensors ``make(n)`` gives, against the pattern's sums."""
    torch, dist, n, r = ctx.torch, ctx.dist, ctx.world, ctx.rank
    x = make(numel)
    fill_pattern(torch, x, r)
    dist.all_reduce(x)
    m = mismatches(torch, x, all_reduce_expected(torch, n), on_host)
    ctx.check(f"all_reduce[{tag}{numel}]", m["bad"] == 0, m)
    del x
    x, out = make(numel), make(n * numel)
    fill_pattern(torch, x, r, salt=1)
    dist.all_gather_into_tensor(out, x)
    m = mismatches(torch, out, lambda idx: pattern_values(torch, idx // numel, idx % numel, 1),
                   on_host)
    ctx.check(f"all_gather_into_tensor[{tag}{numel}]", m["bad"] == 0, m)
    del x, out
    x, out = make(n * numel), make(numel)
    fill_pattern(torch, x, r, salt=2)
    dist.reduce_scatter_tensor(out, x)
    m = mismatches(torch, out, lambda idx: all_reduce_expected(torch, n, 2)(idx + r * numel),
                   on_host)
    ctx.check(f"reduce_scatter_tensor[{tag}{numel}]", m["bad"] == 0, m)
    del x, out


def all_reduce_bandwidth(ctx: Rank, make: Callable[[int], Any], sizes: list[int]) -> dict:
    """All-reduce timing at each size (MiB), then one all-reduce of the pattern in the same
    tensor, checked on the device."""
    torch, dist = ctx.torch, ctx.dist
    out = {}
    for mib in sizes:
        numel = mib * MIB // 4
        x = make(numel)
        x.zero_()
        timing = ctx.timed(partial(dist.all_reduce, x), ctx.opts["warmup"], ctx.opts["iters"])
        fill_pattern(torch, x, ctx.rank)
        dist.all_reduce(x)
        m = mismatches(torch, x, all_reduce_expected(torch, ctx.world), on_host=False)
        ctx.check(f"all_reduce[{mib} MiB timed tensor]", m["bad"] == 0, m)
        out[str(mib)] = {"bytes": numel * 4, **timing, "handles": ctx.handles_behind(x)}
    return out


def part_collectives(ctx: Rank, extra: dict) -> dict:
    torch = ctx.torch

    def make(numel: int) -> Any:
        return torch.empty(numel, dtype=torch.float32, device=ctx.device)

    for numel in CHECK_NUMELS:
        check_collectives(ctx, "", make, numel, on_host=True)
    out: dict[str, Any] = {"bandwidth": all_reduce_bandwidth(ctx, make, sizes_mib(ctx, "sizes"))}
    if ctx.cuda:
        out["peers"] = [j for j in range(torch.cuda.device_count())
                        if j != ctx.device_index
                        and torch.cuda.can_device_access_peer(ctx.device_index, j)]
    return out


# ---------------------------------------------------------------------------------------------
# Part b: registration. NCCL through ctypes first.


class NcclError(RuntimeError):
    pass


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]  # NCCL_UNIQUE_ID_BYTES


def nccl_library_path() -> str:
    """The libnccl this process loaded with PyTorch (its mappings), else the one of the
    nvidia-nccl wheel, else whatever the loader finds."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "/libnccl.so" in path:
                    return path
    except OSError:
        pass
    try:
        import nvidia.nccl

        for base in nvidia.nccl.__path__:
            path = os.path.join(base, "lib", "libnccl.so.2")
            if os.path.exists(path):
                return path
    except ImportError:
        pass
    import ctypes.util

    return ctypes.util.find_library("nccl") or "libnccl.so.2"


class Nccl:
    """The few NCCL calls the registration part makes, on the library PyTorch loaded; each
    result is checked and a failure raises NcclError with ``ncclGetErrorString`` and the
    communicator's ``ncclGetLastError``."""

    FLOAT32, SUM = 7, 0  # ncclFloat32, ncclSum

    def __init__(self) -> None:
        self.path = nccl_library_path()
        lib = self.lib = ctypes.CDLL(self.path)
        p, cp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetLastError.restype = ctypes.c_char_p
        lib.ncclGetLastError.argtypes = [p]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
        lib.ncclCommInitRank.argtypes = [cp, ctypes.c_int, NcclUniqueId, ctypes.c_int]
        lib.ncclCommRegister.argtypes = [p, p, ctypes.c_size_t, cp]
        lib.ncclCommDeregister.argtypes = [p, p]
        lib.ncclAllReduce.argtypes = [p, p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, p, p]
        lib.ncclCommGetAsyncError.argtypes = [p, ctypes.POINTER(ctypes.c_int)]
        lib.ncclCommDestroy.argtypes = [p]
        for f in ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommRegister",
                  "ncclCommDeregister", "ncclAllReduce", "ncclCommGetAsyncError",
                  "ncclCommDestroy"):
            getattr(lib, f).restype = ctypes.c_int

    def check(self, call: str, result: int, comm: Any = None) -> None:
        if result == 0:
            return
        text = (self.lib.ncclGetErrorString(result) or b"").decode(errors="replace")
        last = (self.lib.ncclGetLastError(comm) or b"").decode(errors="replace")
        raise NcclError(f"{call} returned {result} ({text})" + (f": {last}" if last else ""))

    def version(self) -> int:
        v = ctypes.c_int()
        self.check("ncclGetVersion", self.lib.ncclGetVersion(ctypes.byref(v)))
        return v.value

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self.check("ncclGetUniqueId", self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid)  # all 128 bytes (`uid.internal` would stop at the first NUL)

    def init_rank(self, world: int, uid: bytes, rank: int) -> ctypes.c_void_p:
        comm = ctypes.c_void_p()
        self.check("ncclCommInitRank", self.lib.ncclCommInitRank(
            ctypes.byref(comm), world, NcclUniqueId.from_buffer_copy(uid), rank))
        return comm

    def register(self, comm: Any, ptr: int, nbytes: int) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self.check("ncclCommRegister", self.lib.ncclCommRegister(
            comm, ctypes.c_void_p(ptr), nbytes, ctypes.byref(handle)), comm)
        return handle

    def deregister(self, comm: Any, handle: Any) -> None:
        self.check("ncclCommDeregister", self.lib.ncclCommDeregister(comm, handle), comm)

    def all_reduce_sum_f32(self, comm: Any, ptr: int, count: int, stream: int) -> None:
        self.check("ncclAllReduce", self.lib.ncclAllReduce(
            ctypes.c_void_p(ptr), ctypes.c_void_p(ptr), count, self.FLOAT32, self.SUM, comm,
            ctypes.c_void_p(stream)), comm)

    def async_error(self, comm: Any) -> None:
        err = ctypes.c_int()
        self.check("ncclCommGetAsyncError",
                   self.lib.ncclCommGetAsyncError(comm, ctypes.byref(err)), comm)
        self.check("the communicator's asynchronous error", err.value, comm)

    def destroy(self, comm: Any) -> None:
        self.check("ncclCommDestroy", self.lib.ncclCommDestroy(comm), comm)


def attempt(ctx: Rank, name: str, f: Callable[[], Any]) -> dict:
    """Runs ``f``; its outcome as ``{"ok", "s", "error"}``, recorded as check ``name``."""
    t0 = time.perf_counter()
    try:
        value = f()
        res = {"ok": True, "s": time.perf_counter() - t0, "error": None, "value": value}
    except Exception as e:  # noqa: BLE001 - a failure here is a finding, reported as such
        res = {"ok": False, "s": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"}
    ctx.checks[name] = res["ok"]
    if not res["ok"]:
        ctx.errors.append(f"{name}: {res['error']}")
    return res


def outcome(res: dict) -> dict:
    """An ``attempt``'s record without the value it returned."""
    return {k: v for k, v in res.items() if k != "value"}


def register_direct(ctx: Rank, tensors: dict[str, Any]) -> dict:
    """``ncclCommRegister`` of each tensor on a communicator of its own, all-reduce bandwidth
    unregistered and registered, the registered all-reduce checked. Every rank takes the same
    steps (``ctx.agree``) whatever failed where, so none waits for a peer that gave up."""
    out: dict[str, Any] = {}
    loaded = attempt(ctx, "direct: load libnccl", Nccl)
    if not ctx.agree(loaded["ok"]):
        return {"load": outcome(loaded)}
    nccl = loaded["value"]
    out["library"] = nccl.path
    out["version"] = attempt(ctx, "direct: ncclGetVersion", nccl.version).get("value")
    uid = attempt(ctx, "direct: ncclGetUniqueId", nccl.unique_id) if ctx.rank == 0 else None
    shared = [uid["value"] if uid and uid["ok"] else None]
    ctx.dist.broadcast_object_list(shared, src=0)
    if shared[0] is None:
        out["unique_id"] = outcome(uid) if uid else "rank 0 failed"
        return out
    init = attempt(ctx, "direct: ncclCommInitRank",
                   lambda: nccl.init_rank(ctx.world, shared[0], ctx.rank))
    out["init"] = outcome(init)
    if not ctx.agree(init["ok"]):
        return out
    comm = init["value"]
    out["sizes"] = {}
    for key, x in tensors.items():
        out["sizes"][key] = rec = {"bytes": x.numel() * 4, "handles": ctx.handles_behind(x)}
        if not register_one(ctx, nccl, comm, key, x, rec):
            break
    ctx.sync()
    out["destroy"] = outcome(attempt(ctx, "direct: ncclCommDestroy",
                                     lambda: nccl.destroy(comm)))
    return out


def register_one(ctx: Rank, nccl: Nccl, comm: Any, key: str, x: Any, rec: dict) -> bool:
    """One tensor of ``register_direct``, recorded in ``rec``; whether every rank may go on."""
    torch = ctx.torch
    ptr, count = x.data_ptr(), x.numel()

    def run() -> None:
        nccl.all_reduce_sum_f32(comm, ptr, count, torch.cuda.current_stream(ctx.device).cuda_stream)

    def timed() -> dict:
        return ctx.timed(run, ctx.opts["warmup"], ctx.opts["iters"])

    def reduce_and_check() -> dict:
        run()
        torch.cuda.synchronize(ctx.device)
        nccl.async_error(comm)
        return mismatches(torch, x, all_reduce_expected(torch, ctx.world), on_host=False)

    x.zero_()
    t = attempt(ctx, f"direct: unregistered all-reduce [{key}]", timed)
    rec["unregistered"] = t.get("value") or t["error"]
    if not ctx.agree(t["ok"]):
        return False
    reg = attempt(ctx, f"direct: ncclCommRegister [{key}]",
                  lambda: nccl.register(comm, ptr, count * 4))
    rec["register"] = outcome(reg)
    fill_pattern(torch, x, ctx.rank)
    m = attempt(ctx, f"direct: all-reduce call [{key}]", reduce_and_check)
    if m["ok"]:
        ctx.check(f"direct: all-reduce correct [{key}]", m["value"]["bad"] == 0, m["value"])
    if not ctx.agree(m["ok"]):
        return False
    x.zero_()
    t = attempt(ctx, f"direct: registered all-reduce [{key}]", timed)
    rec["registered"] = t.get("value") or t["error"]
    if reg["ok"]:
        rec["deregister"] = outcome(attempt(ctx, f"direct: ncclCommDeregister [{key}]",
                                            lambda: nccl.deregister(comm, reg["value"])))
    return ctx.agree(t["ok"])


def part_register(ctx: Rank, extra: dict) -> dict:
    torch, dist = ctx.torch, ctx.dist
    sizes = sizes_mib(ctx, "register_sizes")

    def make(numel: int) -> Any:
        return torch.empty(numel, dtype=torch.float32, device=ctx.device)

    out: dict[str, Any] = {"mode": ctx.mode}
    if ctx.mode == "mb":
        # enable()'s global allocator refuses pools: registration direct only.
        out["pool"] = None
        tensors = {f"{mib} MiB": make(mib * MIB // 4) for mib in sizes}
        out["direct"] = register_direct(ctx, tensors)
        return out
    if ctx.mode == "mb-pool":
        import moonbright.torch

        pool = moonbright.torch.pool()
        out["pool"] = "moonbright.torch.pool()"
    else:
        pool = torch.cuda.MemPool()
        out["pool"] = "torch.cuda.MemPool() (PyTorch's allocator)"
    backend = dist.group.WORLD._get_backend(ctx.device)
    gather = ctx.opts["register_gather_mib"] * MIB // 4 // ctx.world
    with torch.cuda.use_mem_pool(pool):
        tensors = {f"{mib} MiB": make(mib * MIB // 4) for mib in sizes}
    out["handles"] = {k: ctx.handles_behind(t) for k, t in tensors.items()}
    out["unregistered"] = {}
    for key, x in tensors.items():
        x.zero_()
        out["unregistered"][key] = ctx.timed(partial(dist.all_reduce, x), ctx.opts["warmup"],
                                             ctx.opts["iters"])
    reg = attempt(ctx, "register_mem_pool", lambda: backend.register_mem_pool(pool))
    out["register_mem_pool"] = outcome(reg)
    # The same steps whether it failed or not, on every rank.
    for key, x in tensors.items():
        fill_pattern(torch, x, ctx.rank)
        dist.all_reduce(x)
        m = mismatches(torch, x, all_reduce_expected(torch, ctx.world), on_host=False)
        ctx.check(f"registered all_reduce [{key}]", m["bad"] == 0, m)

    def make_in_pool(numel: int) -> Any:
        with torch.cuda.use_mem_pool(pool):
            return make(numel)

    # Allocated after registration: PyTorch's allocator hook registers their segments.
    check_collectives(ctx, "pool, after registration: ", make_in_pool, gather, on_host=False)
    out["registered"] = {}
    for key, x in tensors.items():
        x.zero_()
        out["registered"][key] = ctx.timed(partial(dist.all_reduce, x), ctx.opts["warmup"],
                                           ctx.opts["iters"])
    if reg["ok"]:
        out["deregister_mem_pool"] = outcome(attempt(
            ctx, "deregister_mem_pool", lambda: backend.deregister_mem_pool(pool)))
    ctx.sync()
    out["direct"] = register_direct(ctx, tensors)
    del tensors
    gc.collect()
    ctx.sync()
    return out


# ---------------------------------------------------------------------------------------------
# Part c: DDP.


def part_ddp(ctx: Rank, extra: dict) -> dict:
    torch = ctx.torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(20260050)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    nn = torch.nn
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                          nn.Linear(1024, 10)).to(ctx.device)
    # Small buckets: several all-reduces per step, each over a bucket of its own.
    ddp = DistributedDataParallel(model, device_ids=[ctx.device_index] if ctx.cuda else None,
                                  bucket_cap_mb=1)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    losses = []
    for step in range(ctx.opts["steps"]):
        g = torch.Generator().manual_seed(1000 + step * ctx.world + ctx.rank)
        x = torch.randn(64, 256, generator=g).to(ctx.device)
        y = torch.randint(0, 10, (64,), generator=g).to(ctx.device)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    values = torch.stack(losses).cpu().tolist()
    ctx.check("losses finite", all(math.isfinite(v) for v in values))
    out = {"steps": len(values), "final_loss": values[-1] if values else None,
           "weights_sha256": tensor_digest(list(model.parameters()))}
    if ctx.rank == 0:
        out["losses"] = [float(v).hex() for v in values]
    return out


# ---------------------------------------------------------------------------------------------
# Part d: IPC between two processes.


def part_ipc(ctx: Rank, extra: dict) -> dict:
    """Rank 0 sends, rank 1 receives (see the module documentation). No process group. The
    tensors are pickled by the sender's own thread (a queue's feeder thread would only print
    an error and drop them), as ``multiprocessing``'s queues pickle them."""
    from multiprocessing.reduction import ForkingPickler

    torch = ctx.torch
    # PyTorch's reductions of tensors (under mb, enable() has put moonbright.ipc's in front
    # of them for MoonBright's memory).
    importlib.import_module("torch.multiprocessing")
    count = torch.cuda.device_count() if ctx.cuda else 1
    sender_dev, receiver_dev = 0, min(1, count - 1)
    to_receiver, to_sender = extra["to_receiver"], extra["to_sender"]
    timeout = ctx.opts["ipc_timeout"]
    # int32 elements (8 MiB); bytes (300 MiB); int64 elements (4 MiB: MoonBright shares
    # allocations of a page or more).
    n_small, n_big, n_base = 2 * MIB, 300 * MIB, MIB // 2
    out: dict[str, Any] = {"sender_device": sender_dev, "receiver_device": receiver_dev}
    if ctx.rank == 0:
        ctx.device_index = sender_dev
        if ctx.cuda:
            torch.cuda.set_device(sender_dev)
        small = torch.arange(n_small, dtype=torch.int32, device=ctx.device)
        big = torch.full((n_big,), 3, dtype=torch.uint8, device=ctx.device)
        base = torch.arange(n_base, dtype=torch.int64, device=ctx.device)
        view = base[3:-5:3]
        out["handles"] = {"small": ctx.handles_behind(small), "big": ctx.handles_behind(big),
                          "base": ctx.handles_behind(base)}
        ctx.sync()
        try:
            message = ("tensors", bytes(ForkingPickler.dumps((small, big, view))))
        except Exception as e:  # noqa: BLE001 - reported, and the receiver told
            message = ("error", f"pickling the tensors: {type(e).__name__}: {e}")
            ctx.check("the tensors pickle", False, message[1])
        to_receiver.put(message)
        if message[0] == "error":
            return out
        reply = to_sender.get(timeout=timeout)
        ctx.sync()
        out["receiver_said"] = reply
        if "error" in reply:
            ctx.check("the receiver got the tensors", False, reply["error"])
            return out
        expect = torch.arange(n_base, dtype=torch.int64)
        expect[3:-5:3] *= -1
        ctx.check("sender sees the receiver's writes",
                  int(big[:16].sum()) == 16 * 9 and int(big[16:32].sum()) == 16 * 3
                  and torch.equal(base.cpu(), expect))
        return out
    ctx.device_index = receiver_dev
    if ctx.cuda:
        # Before the tensors are unpickled: MoonBright maps them on the current device.
        torch.cuda.set_device(receiver_dev)
        out["peer_access"] = torch.cuda.can_device_access_peer(receiver_dev, sender_dev) \
            if receiver_dev != sender_dev else None
    kind, payload = to_receiver.get(timeout=timeout)
    if kind == "error":
        out["sender_said"] = payload
        return out
    try:
        small, big, view = ForkingPickler.loads(payload)
    except BaseException as e:
        # The sender waits for an answer: give it this one rather than a time-out.
        to_sender.put({"error": f"{type(e).__name__}: {e}"})
        raise
    devices = sorted({str(t.device) for t in (small, big, view)})
    out["received_on"] = devices
    if ctx.cuda:
        for d in devices:
            torch.cuda.synchronize(d)
    # Read where they live (a kernel through peer access when that is the other GPU), then
    # copied to this process's GPU.
    ctx.check("small read in place", torch.equal(
        small, torch.arange(n_small, dtype=torch.int32, device=small.device)))
    ctx.check("small copied here", torch.equal(
        small.to(ctx.device), torch.arange(n_small, dtype=torch.int32, device=ctx.device)))
    ctx.check("big read in place", int(big.sum(dtype=torch.int64)) == 3 * n_big)
    ctx.check("view read in place", view.stride() == (3,) and torch.equal(
        view.cpu(), torch.arange(n_base, dtype=torch.int64)[3:-5:3]))
    big[:16].fill_(9)
    view.mul_(-1)
    if ctx.cuda:
        for d in devices:
            torch.cuda.synchronize(d)
    del small, big, view
    gc.collect()
    if ctx.cuda and ctx.mode != "mb":
        torch.cuda.ipc_collect()
    to_sender.put({"received_on": devices, "checks": dict(ctx.checks)})
    return out


# ---------------------------------------------------------------------------------------------
# Part e: sleep and wake beside collectives.


def part_sleep(ctx: Rank, extra: dict) -> dict:
    import moonbright

    torch, dist, n, r = ctx.torch, ctx.dist, ctx.world, ctx.rank
    numel = ctx.opts["sleep_tensor_mib"] * MIB // 4
    count = ctx.opts["sleep_tensors"]
    k = 4
    out: dict[str, Any] = {}

    def make(m: int) -> Any:
        return torch.empty(m, dtype=torch.float32, device=ctx.device)

    warm = make(16 * MIB // 4).zero_()
    dist.all_reduce(warm)
    weights = []
    if r == 0:
        with moonbright.tag(SLEEP_TAG):
            weights = [make(numel) for _ in range(count)]
        for i, w in enumerate(weights):
            fill_pattern(torch, w, i, salt=5)
        out["handles"] = [ctx.handles_behind(w) for w in weights]
    ys = [make(16 * MIB // 4) for _ in range(k)]
    for i, y in enumerate(ys):
        fill_pattern(torch, y, r, salt=10 + i)
    ctx.sync()
    dist.barrier()
    ctx.sync()
    if r != 0:
        time.sleep(ctx.opts["sleep_delay"])  # rank 0's all-reduces wait for this rank
    works = [dist.all_reduce(y, async_op=True) for y in ys]
    if r == 0:
        free_awake = torch.cuda.mem_get_info(ctx.device)[0]
        t0 = time.perf_counter()
        slept = attempt(ctx, "sleep", lambda: moonbright.sleep(SLEEP_TAG))
        out["sleep"] = {k2: v for k2, v in slept.items() if k2 != "value"}
        out["sleep"]["result"] = slept.get("value")
        out["sleep"]["collectives_in_flight_when_it_returned"] = not all(
            w.is_completed() for w in works)
        out["sleep"]["call_s"] = time.perf_counter() - t0
        out["free_bytes"] = {"awake": free_awake,
                             "asleep": torch.cuda.mem_get_info(ctx.device)[0]}
    for w in works:
        w.wait()
    ctx.sync()
    for i, y in enumerate(ys):
        m = mismatches(torch, y, all_reduce_expected(torch, n, 10 + i), on_host=False)
        ctx.check(f"all-reduce in flight during the sleep [{i}]", m["bad"] == 0, m)
    z = make(64 * MIB // 4)
    fill_pattern(torch, z, r, salt=20)
    dist.all_reduce(z)
    m = mismatches(torch, z, all_reduce_expected(torch, n, 20), on_host=False)
    ctx.check("all-reduce while asleep", m["bad"] == 0, m)
    dist.barrier()
    if r == 0:
        woke = attempt(ctx, "wake", lambda: moonbright.wake(SLEEP_TAG))
        out["wake"] = {k2: v for k2, v in woke.items() if k2 != "value"}
        out["wake"]["result"] = woke.get("value")
        out["free_bytes"]["woken"] = torch.cuda.mem_get_info(ctx.device)[0]
        if woke["ok"] or not slept["ok"]:
            for i, w in enumerate(weights):
                m = mismatches(torch, w, lambda idx, i=i: pattern_values(torch, i, idx, 5),
                               on_host=False)
                ctx.check(f"tagged tensor {i} intact after wake", m["bad"] == 0, m)
            src = weights[0]
        else:  # still asleep: its memory is unmapped, so the all-reduce below uses another
            src = make(numel)
            fill_pattern(torch, src, 0, salt=5)
    else:
        src = make(numel)
        fill_pattern(torch, src, 0, salt=5)
    ctx.sync()
    dist.all_reduce(src)
    m = mismatches(torch, src, lambda idx: n * pattern_values(torch, 0, idx, 5), on_host=False)
    ctx.check("all-reduce of a woken tensor", m["bad"] == 0, m)
    ctx.sync()
    return out


PART_FUNCS: dict[str, Callable[[Rank, dict], dict]] = {
    "collectives": part_collectives,
    "register": part_register,
    "ddp": part_ddp,
    "ipc": part_ipc,
    "sleep": part_sleep,
}


# ---------------------------------------------------------------------------------------------
# A rank process, and the launcher that starts one per rank.


def driver_version() -> str | None:
    """The CUDA driver's version (cuDriverGetVersion), e.g. "13.0"."""
    try:
        v = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return None


def run_rank(rank: int, spec: dict, extra: dict) -> dict:
    if spec["mode"] == "mb" and not spec["dry"]:
        import moonbright.torch

        moonbright.torch.enable()  # first thing, before anything touches CUDA
    ctx = Rank(rank, spec)
    torch = ctx.torch
    part = spec["part"]
    if part != "ipc":
        ctx.init_group(spec["init_file"])
    t0 = time.perf_counter()
    try:
        out = PART_FUNCS[part](ctx, extra)
    finally:
        if ctx.dist is not None and ctx.dist.is_initialized():
            if ctx.cuda:
                torch.cuda.synchronize(ctx.device)
            ctx.dist.destroy_process_group()
    out["s"] = time.perf_counter() - t0
    out["device"] = ctx.device_index if ctx.cuda else "cpu"
    if ctx.cuda:
        out["card"] = torch.cuda.get_device_name(ctx.device_index)
        out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        if rank == 0:
            out["driver"] = driver_version()
        if spec["mode"] in ("mb", "mb-pool"):
            out["moonbright"] = moonbright_state(ctx)
    out["checks"] = ctx.checks
    out["errors"] = ctx.errors
    return out


def moonbright_state(ctx: Rank) -> dict:
    """MoonBright's deferred errors (each one a failure), peak and chunk options on this rank's
    GPU, after its invariants are checked."""
    import moonbright

    d = ctx.device_index
    attempt(ctx, "MoonBright's invariants", lambda: moonbright.check_invariants(d))
    s = moonbright.memory_stats(d)
    return {
        "deferred_errors": s.get("moonbright.deferred_errors"),
        "peak_reserved": s.get("reserved_bytes.all.peak"),
        "options": {k: v for k, v in moonbright.options(d).items()
                    if k in ("max_chunk", "large_chunk", "largest_chunk", "ipc", "peer_access")},
    }


def rank_entry(rank: int, spec: dict, results: Any, extra: dict) -> None:
    try:
        results.put(("ok", rank, run_rank(rank, spec, extra)))
    except BaseException:  # noqa: BLE001 - the launcher reports it
        results.put(("error", rank, traceback.format_exc()))


def launch(spec: dict) -> dict:
    """A set of rank processes for one part and mode (``spec``): what each reported, and how
    they ended."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    n = spec["nproc"]
    results = ctx.Queue()
    extra = {"to_receiver": ctx.Queue(), "to_sender": ctx.Queue()} if spec["part"] == "ipc" else {}
    with tempfile.TemporaryDirectory(prefix="multigpu-") as scratch:
        spec = dict(spec, init_file=os.path.join(scratch, "init"))  # the ranks' FileStore
        ranks, teardown = run_ranks(ctx, spec, results, extra)
    return {"mode": spec["mode"], "part": spec["part"], "nproc": n,
            "ranks": [ranks[r] for r in range(n)], "teardown": teardown}


def run_ranks(ctx: Any, spec: dict, results: Any, extra: dict) -> tuple[dict, list]:
    """Starts one process per rank (spawn), gathers what each reports, and stops the others
    ``RANK_GRACE_S`` after one failed (a peer left waiting in a collective never returns)."""
    n = spec["nproc"]
    procs = [ctx.Process(target=rank_entry, args=(r, spec, results, extra), name=f"rank{r}")
             for r in range(n)]
    for p in procs:
        p.start()
    ranks: dict[int, dict] = {}
    failed_at = None

    def take(timeout: float) -> bool:
        try:
            kind, r, payload = results.get(timeout=timeout)
        except queue.Empty:
            return False
        ranks[r] = payload if kind == "ok" else {"error": payload}
        return True

    while len(ranks) < n:
        take(1.0)
        for r, p in enumerate(procs):
            if r not in ranks and p.exitcode is not None:
                while take(2.0):  # a result sent just before the exit
                    pass
                if r not in ranks:
                    ranks[r] = {"error": f"rank {r} exited with status {p.exitcode} "
                                         "without a result"}
        if failed_at is None and any("error" in v for v in ranks.values()):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > RANK_GRACE_S:
            for r, p in enumerate(procs):
                if r not in ranks:
                    p.kill()
                    ranks[r] = {"error": f"rank {r} stopped {RANK_GRACE_S} s after a peer "
                                         "failed (left waiting in a collective?)"}
    teardown = []
    for r, p in enumerate(procs):
        p.join(TEARDOWN_S)
        if p.exitcode is None:
            p.kill()
            teardown.append(f"rank {r} killed: still running {TEARDOWN_S} s after its result")
        elif p.exitcode != 0:
            teardown.append(f"rank {r} exited with status {p.exitcode}")
    return ranks, teardown


# ---------------------------------------------------------------------------------------------
# The driver: one launcher per configuration, mode and part; the summary and the table.


def modes_of(config: str, part: str) -> list[str]:
    """The process sets a configuration runs a part in: MoonBright's registration needs both
    its global allocator (direct registration) and its pool (``register_mem_pool``)."""
    if config == "mb" and part == "register":
        return ["mb", "mb-pool"]
    return [config]


def skip_reason(config: str, part: str, args: argparse.Namespace) -> str | None:
    if args.cpu_dry_run:
        if part in ("register", "sleep"):
            return "needs NCCL and a GPU"
        if config == "preload" or (config == "mb" and part == "ipc"):
            return "needs MoonBright on a GPU"
    if part == "sleep" and config != "mb":
        return "MoonBright only"
    return None


def base_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "LD_PRELOAD"):
        env.pop(key, None)
    env.update(MULTICAST_OFF)
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if args.nccl_debug:
        env["NCCL_DEBUG"] = "INFO"
        env["NCCL_DEBUG_SUBSYS"] = args.nccl_debug
    return env


def mode_env(mode: str, part: str, args: argparse.Namespace) -> dict[str, str]:
    env = base_env(args)
    conf = os.environ.get("MOONBRIGHT_ALLOC_CONF", "")
    if mode in ("mb", "mb-pool") and part == "register" and args.stitch_conf:
        conf = ",".join(c for c in (conf, args.stitch_conf) if c)
    env["MOONBRIGHT_ALLOC_CONF"] = conf
    if mode == "preload":
        env["LD_PRELOAD"] = os.path.abspath(args.preload_lib)
    return env


def run_set(mode: str, part: str, args: argparse.Namespace, opts: dict, label: str) -> dict:
    """One launcher process (and its ranks) in a session of its own, killed whole on time-out."""
    nproc = 2 if part == "ipc" else args.nproc
    spec = {"mode": mode, "part": part, "nproc": nproc, "dry": args.cpu_dry_run, "opts": opts}
    cmd = [sys.executable, os.path.abspath(__file__), "--launch", json.dumps(spec)]
    log_path = os.path.join(args.log_dir, f"{label}.log") if args.log_dir else None
    t0 = time.perf_counter()
    with open(log_path, "w") if log_path else contextlib.nullcontext() as log:
        p = subprocess.Popen(cmd, env=mode_env(mode, part, args), stdout=subprocess.PIPE,
                             stderr=log or subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = p.communicate(timeout=args.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = p.communicate()
            timed_out = True
    wall = time.perf_counter() - t0
    lines = [line for line in (stdout or "").splitlines() if line.startswith("{")]
    if timed_out or p.returncode != 0 or not lines:
        why = f"timed out after {args.timeout} s" if timed_out else f"exit status {p.returncode}"
        res = {"mode": mode, "part": part, "nproc": nproc, "error": why,
               "stderr": (stderr or "")[-4000:]}
        sys.stderr.write(f"[{label}] failed: {why}\n{(stderr or '')[-2000:]}\n")
    else:
        res = json.loads(lines[-1])
    res["wall_s"] = wall
    return res


def failures_of(run: dict) -> list[str]:
    """Every correctness failure a process set reports: its own error, a rank's error or failed
    check, and MoonBright's deferred errors."""
    label = f"{run['part']}/{run['mode']}"
    if "error" in run:
        return [f"{label}: {run['error']}"]
    out = []
    for r, rank in enumerate(run["ranks"]):
        if "error" in rank:
            out.append(f"{label} rank {r}: {rank['error'].strip().splitlines()[-1]}")
            continue
        out += [f"{label} rank {r}: {e}" for e in rank.get("errors", [])]
        mb = rank.get("moonbright") or {}
        if mb.get("deferred_errors"):
            out.append(f"{label} rank {r}: MoonBright deferred errors: {mb['deferred_errors']}")
    return out


def bus_bandwidth(nbytes: int, seconds: float, n: int) -> dict:
    """GB/s (10^9 bytes): algorithm bandwidth and nccl-tests' all-reduce bus bandwidth."""
    alg = nbytes / seconds / 1e9
    return {"algbw": alg, "busbw": alg * 2 * (n - 1) / n}


def rank_mean(ranks: list[dict], *path: str) -> float:
    """The mean over ranks of the median time at ``path`` in each rank's results."""
    def at(rank: dict) -> float:
        for key in path:
            rank = rank[key]
        return rank["median_s"]

    return statistics.mean(at(r) for r in ranks)


def summarise(runs: list[dict], n: int) -> dict:
    ok = [r for r in runs if "error" not in r and all("error" not in x for x in r["ranks"])]
    summary: dict[str, Any] = {}
    # Collectives: per configuration and size, the median over rounds of the ranks' mean
    # median time.
    coll: dict[str, dict[str, list]] = {}
    for run in ok:
        if run["part"] != "collectives":
            continue
        for size, first in run["ranks"][0]["bandwidth"].items():
            t = rank_mean(run["ranks"], "bandwidth", size)
            coll.setdefault(run["mode"], {}).setdefault(size, []).append(
                {**bus_bandwidth(first["bytes"], t, n), "s": t,
                 "handles": (first.get("handles") or {}).get("chunks")})
    if coll:
        table = {}
        for mode, sizes in coll.items():
            table[mode] = {}
            for size, rounds in sizes.items():
                table[mode][size] = {
                    "busbw": statistics.median(x["busbw"] for x in rounds),
                    "algbw": statistics.median(x["algbw"] for x in rounds),
                    "rounds_busbw": [x["busbw"] for x in rounds],
                    "handles": rounds[0]["handles"]}
        base = table.get("torch", {})
        for mode, sizes in table.items():
            for size, row in sizes.items():
                ref = base.get(size, {}).get("algbw")
                if mode != "torch" and ref:
                    row["vs_torch"] = row["algbw"] / ref
                    row["target_met"] = row["vs_torch"] >= BANDWIDTH_TARGET
        summary["collectives"] = table
    # Registration: per mode and size, bandwidth unregistered and registered.
    reg = {}
    for run in ok:
        if run["part"] != "register":
            continue
        r0 = run["ranks"][0]
        row: dict[str, Any] = {"pool": r0.get("pool"),
                               "register_mem_pool": (r0.get("register_mem_pool") or {}).get("ok"),
                               "sizes": {}}
        for key in (r0.get("unregistered") or {}):
            t_u = rank_mean(run["ranks"], "unregistered", key)
            t_r = rank_mean(run["ranks"], "registered", key)
            nbytes = int(key.split()[0]) * MIB
            row["sizes"][key] = {
                "handles": ((r0.get("handles") or {}).get(key) or {}).get("chunks"),
                "unregistered_algbw": bus_bandwidth(nbytes, t_u, n)["algbw"],
                "registered_algbw": bus_bandwidth(nbytes, t_r, n)["algbw"],
                "gain": t_u / t_r}
        direct = {}
        for key, d in ((r0.get("direct") or {}).get("sizes") or {}).items():
            rec: dict[str, Any] = {"handles": (d.get("handles") or {}).get("chunks"),
                                   "registered": (d.get("register") or {}).get("ok"),
                                   "error": (d.get("register") or {}).get("error")}
            if isinstance(d.get("unregistered"), dict) and isinstance(d.get("registered"), dict):
                rec["unregistered_algbw"] = d["bytes"] / d["unregistered"]["median_s"] / 1e9
                rec["registered_algbw"] = d["bytes"] / d["registered"]["median_s"] / 1e9
                rec["gain"] = d["unregistered"]["median_s"] / d["registered"]["median_s"]
            direct[key] = rec
        row["direct"] = direct
        reg[run["mode"]] = row
    if reg:
        summary["register"] = reg
    # DDP: replicas agree; every configuration matches torch bit for bit.
    ddp = {}
    for run in ok:
        if run["part"] == "ddp":
            r0 = run["ranks"][0]
            hashes = {r["weights_sha256"] for r in run["ranks"]}
            ddp[run["mode"]] = {"losses": r0["losses"], "replicas_agree": len(hashes) == 1,
                                "weights_sha256": r0["weights_sha256"],
                                "final_loss": r0["final_loss"]}
    if ddp:
        ref = ddp.get("torch")
        for mode, row in ddp.items():
            if mode != "torch" and ref:
                row["identical_to_torch"] = (row["losses"] == ref["losses"]
                                             and row["weights_sha256"] == ref["weights_sha256"])
                if row["losses"] != ref["losses"]:
                    row["first_different_step"] = next(
                        (i for i, (a, b) in enumerate(zip(row["losses"], ref["losses"])) if a != b),
                        min(len(row["losses"]), len(ref["losses"])))
        summary["ddp"] = {m: {k: v for k, v in row.items() if k != "losses"}
                          for m, row in ddp.items()}
    ipc = {}
    for run in ok:
        if run["part"] == "ipc":
            s, r = run["ranks"]
            ipc[run["mode"]] = {"from": s.get("sender_device"), "to": r.get("receiver_device"),
                                "received_on": r.get("received_on"),
                                "peer_access": r.get("peer_access"),
                                "ok": all(s["checks"].values()) and all(r["checks"].values())}
    if ipc:
        summary["ipc"] = ipc
    for run in ok:
        if run["part"] == "sleep":
            r0 = run["ranks"][0]
            summary["sleep"] = {
                "sleep_s": (r0.get("sleep") or {}).get("s"),
                "wake_s": (r0.get("wake") or {}).get("s"),
                "in_flight_when_sleep_returned":
                    (r0.get("sleep") or {}).get("collectives_in_flight_when_it_returned"),
                "freed_bytes": (r0["free_bytes"]["asleep"] - r0["free_bytes"]["awake"])
                if r0.get("free_bytes") else None,
                "ok": all(all(x["checks"].values()) for x in run["ranks"])}
    return summary


def table(doc: dict) -> str:
    s = doc["summary"]
    host = doc["host"]
    cards = ", ".join(sorted(set(host.get("cards") or ["?"])))
    lines = [f"multigpu: {host['world_size']} x {cards}"
             f"; torch {host.get('torch')}, NCCL {host.get('nccl')}, driver {host.get('driver')}"
             + ("; CPU DRY RUN (gloo, wall clock)" if doc["cpu_dry_run"] else "")]
    if "collectives" in s:
        lines.append("\nall-reduce, GB/s: busbw (algbw) [chunks behind the tensor]; ratio: algbw "
                     f"over torch's, target >= {BANDWIDTH_TARGET}")
        modes = list(s["collectives"])
        sizes = list(next(iter(s["collectives"].values())))
        lines.append("size MiB".ljust(10) + "".join(m.rjust(30) for m in modes))
        for size in sizes:
            cells = []
            for m in modes:
                row = s["collectives"][m].get(size)
                if not row:
                    cells.append("-")
                    continue
                cell = f"{row['busbw']:.1f} ({row['algbw']:.1f})"
                if row.get("handles"):
                    cell += f" [{row['handles']}]"
                if "vs_torch" in row:
                    cell += f" {row['vs_torch']:.3f} " + ("met" if row["target_met"] else "MISSED")
                cells.append(cell)
            lines.append(size.ljust(10) + "".join(c.rjust(30) for c in cells))
    if "register" in s:
        lines.append("\nregistration: algbw GB/s unregistered -> registered (gain) [chunks]")
        for mode, row in s["register"].items():
            rmp = row["register_mem_pool"]
            lines.append(f"  {mode}: pool {row['pool'] or '- (global allocator)'}; "
                         "register_mem_pool " + ("-" if rmp is None else "ok" if rmp else
                                                 "FAILED"))
            for key, v in row["sizes"].items():
                lines.append(f"    pool   {key:>9}: {v['unregistered_algbw']:7.1f} -> "
                             f"{v['registered_algbw']:7.1f} ({v['gain']:.3f}) [{v['handles']}]")
            for key, v in row["direct"].items():
                if "gain" in v:
                    lines.append(f"    direct {key:>9}: {v['unregistered_algbw']:7.1f} -> "
                                 f"{v['registered_algbw']:7.1f} ({v['gain']:.3f}) "
                                 f"[{v['handles']}] ncclCommRegister "
                                 + ("ok" if v["registered"] else f"FAILED: {v['error']}"))
                else:
                    lines.append(f"    direct {key:>9}: [{v['handles']}] ncclCommRegister "
                                 + ("ok" if v["registered"] else f"FAILED: {v['error']}"))
    if "ddp" in s:
        lines.append("\nDDP: final loss, weights' SHA-256, replicas agree, identical to torch")
        for mode, row in s["ddp"].items():
            ident = row.get("identical_to_torch")
            lines.append(f"  {mode:>8}: {row['final_loss']:.6f} {row['weights_sha256'][:16]} "
                         f"{row['replicas_agree']} "
                         + ("-" if ident is None else "yes" if ident else
                            f"NO (first step that differs: {row.get('first_different_step')})"))
    if "ipc" in s:
        lines.append("\nIPC: sender GPU -> receiver GPU, received on, peer access, correct")
        for mode, row in s["ipc"].items():
            lines.append(f"  {mode:>8}: {row['from']} -> {row['to']}, {row['received_on']}, "
                         f"{row['peer_access']}, {row['ok']}")
    if "sleep" in s:
        v = s["sleep"]
        lines.append(f"\nsleep beside collectives (mb): sleep {v['sleep_s']} s, wake "
                     f"{v['wake_s']} s, collectives still in flight when sleep returned: "
                     f"{v['in_flight_when_sleep_returned']}, freed {v['freed_bytes']} B, "
                     f"correct {v['ok']}")
    for run in doc["runs"]:
        if "skipped" in run:
            lines.append(f"skipped {run['part']}/{run['config']}: {run['skipped']}")
    fails = doc["failures"]
    lines.append(f"\n{len(fails)} failure(s)" + "".join(f"\n  FAIL {f}" for f in fails))
    return "\n".join(lines)


def host_info(args: argparse.Namespace, torch: Any) -> dict:
    info: dict[str, Any] = {"world_size": args.nproc, "torch": torch.__version__,
                            "cuda": torch.version.cuda}
    try:
        info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a CPU build has none
        info["nccl"] = None
    try:
        import moonbright

        info["moonbright"] = moonbright.__version__
    except ImportError:
        info["moonbright"] = None
    if not args.cpu_dry_run:
        # nvidia-smi in this process: the driver itself makes no CUDA context.
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, check=False)
        rows = [[c.strip() for c in line.split(",")] for line in q.stdout.splitlines() if line]
        info["cards"] = [r[0] for r in rows[:args.nproc]]
        info["memory"] = [r[2] for r in rows[:args.nproc] if len(r) > 2]
        info["driver"] = rows[0][1] if rows and len(rows[0]) > 1 else None
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                              check=False)
        info["topology"] = topo.stdout
    return info


def options_for(args: argparse.Namespace) -> dict:
    def mib_list(text: str | None, dry: tuple) -> list[int]:
        if text:
            return [int(x) for x in text.split(",") if x]
        return list(dry)

    dry = args.cpu_dry_run
    return {
        "sizes": mib_list(args.sizes, DRY_SIZES_MIB if dry else (64, 512, 2048)),
        "register_sizes": mib_list(args.register_sizes,
                                   DRY_SIZES_MIB if dry else (192, 1024, 2048)),
        "register_gather_mib": 192 if not dry else 8,
        "warmup": args.warmup,
        "iters": args.iters,
        "steps": args.steps,
        "ipc_timeout": min(args.timeout, 300),
        "sleep_tensor_mib": 256,
        "sleep_tensors": 4,
        "sleep_delay": args.sleep_delay,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", choices=CONFIGS,
                    help="a configuration (repeat); default: " + ", ".join(DEFAULT_CONFIGS))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--nproc", type=int, default=0, help="world size (default: every GPU)")
    ap.add_argument("--sizes", help="all-reduce sizes in MiB (default 64,512,2048)")
    ap.add_argument("--register-sizes", help="registered tensors' sizes in MiB "
                    "(default 192,1024,2048)")
    ap.add_argument("--stitch-conf", default=STITCH_CONF,
                    help="MOONBRIGHT_ALLOC_CONF added for the register part (default "
                    f"{STITCH_CONF!r}; '' for MoonBright's own chunks)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3,
                    help="times the collectives part runs per configuration, interleaved")
    ap.add_argument("--steps", type=int, default=300, help="DDP training steps")
    ap.add_argument("--sleep-delay", type=float, default=0.5,
                    help="seconds rank 1 waits before joining the all-reduces rank 0 sleeps beside")
    ap.add_argument("--preload-lib", help="libmoonbright_preload.so, for --config preload")
    ap.add_argument("--nccl-debug", help="NCCL_DEBUG=INFO with this NCCL_DEBUG_SUBSYS (e.g. "
                    "INIT,REG) in every rank; see --log-dir")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per set of processes")
    ap.add_argument("--log-dir", help="each set of processes' stderr goes to a file here")
    ap.add_argument("--json")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="check the harness without a GPU: gloo, CPU tensors, small sizes")
    ap.add_argument("--launch", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.launch:
        print(json.dumps(launch(json.loads(args.launch))), flush=True)
        return 0
    try:
        import torch
    except ImportError:
        print("multigpu: PyTorch is not installed", file=sys.stderr)
        return 2
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("multigpu: no GPU visible to PyTorch (use --cpu-dry-run to check the script)",
              file=sys.stderr)
        return 2
    available = 2 if args.cpu_dry_run else torch.cuda.device_count()
    args.nproc = args.nproc or available
    if not args.cpu_dry_run and args.nproc > available:
        print(f"multigpu: --nproc {args.nproc} but PyTorch sees {available} GPU(s)",
              file=sys.stderr)
        return 2
    configs = args.config or DEFAULT_CONFIGS
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown} (known: {', '.join(PARTS)})")
    if "preload" in configs and not args.cpu_dry_run and not (
            args.preload_lib and os.path.isfile(args.preload_lib)):
        ap.error("--config preload needs --preload-lib, the interposer's library")
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    opts = options_for(args)
    doc: dict[str, Any] = {
        "benchmark": "multigpu",
        "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "args": vars(args),
        "options": opts,
        "commit": os.environ.get("MOONBRIGHT_COMMIT", ""),
        "moonbright_alloc_conf": os.environ.get("MOONBRIGHT_ALLOC_CONF", ""),
        "env": {k: os.environ.get(k) for k in ("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
                                               "NCCL_CUMEM_ENABLE", "NCCL_LOCAL_REGISTER",
                                               "NCCL_P2P_LEVEL")} | MULTICAST_OFF,
        "date": time.strftime("%Y-%m-%d"),
        "cpu_dry_run": args.cpu_dry_run,
        "host": host_info(args, torch),
        "runs": [],
    }
    del torch  # the ranks import their own
    for part in parts:
        rounds = args.rounds if part in ROUNDED_PARTS else 1
        for rnd in range(rounds):
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
            for config in order:
                why = skip_reason(config, part, args)
                if why:
                    if rnd == 0:
                        doc["runs"].append({"part": part, "config": config, "skipped": why})
                    continue
                for mode in modes_of(config, part):
                    label = f"{part}-{mode}-r{rnd}"
                    print(f"== {label}", file=sys.stderr, flush=True)
                    res = run_set(mode, part, args, opts, label)
                    res.update(config=config, round=rnd)
                    doc["runs"].append(res)
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump(doc, f, indent=1)
    ran = [r for r in doc["runs"] if "skipped" not in r]
    doc["summary"] = summarise(ran, args.nproc)
    failures = [f for r in ran for f in failures_of(r)]
    for mode, row in doc["summary"].get("ddp", {}).items():
        if not row["replicas_agree"]:
            failures.append(f"ddp/{mode}: the ranks' weights differ")
        if row.get("identical_to_torch") is False:
            failures.append(f"ddp/{mode}: losses or weights differ from torch's "
                            f"(first step that differs: {row.get('first_different_step')})")
    doc["failures"] = failures
    text = table(doc)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
