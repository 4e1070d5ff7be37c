#!/usr/bin/env python3
"""PyTorch end to end: real training and inference steps under each allocator configuration.

Each configuration runs in a process of its own (a *worker*) that builds its model, warms up
once and then waits for orders. The workers of one workload live side by side and take turns:
in round r every worker runs its timed steps once, in an order rotated by r, so that the
machine's drift meets every configuration alike. Between turns the GPU is left idle for a
moment so that nothing queued by one worker runs during the next one's turn.

Reported per workload and configuration: steps (or tokens) per second, median and spread over
the rounds, the ratio of the medians to PyTorch's default allocator, and the median of each
round's own ratio to PyTorch's turn in that round (drift slower than a round cancels out of
it: more rounds of fewer steps, ``--rounds 15 --steps 10``, measure it more finely); peak reserved and peak
allocated bytes; allocations per step; the CPU's work per step, as process CPU time and as
user-space instructions retired by every thread (``perf_event_open``, where allowed), each with
its paired ratio to PyTorch's turn (these do not move with the machine's clock rate or with time
its CPUs were lent elsewhere, which make wall-clock rounds spread), and the CPU time split by
thread (the launching thread, PyTorch's other threads, MoonBright's worker); for MoonBright, its
driver calls per step in the timed steps and its cache's state after each turn; and, with
``--kernels``, the GPU's kernel time per step (PyTorch's profiler), which says whether a step
is bound by the device or by the CPU's launch rate. ``--micro`` adds the CPU cost of one
allocation and one free through PyTorch's allocator interface
(``torch.cuda.caching_allocator_alloc`` / ``caching_allocator_delete``) for every configuration
and for a *null* pluggable allocator that does no work, which isolates the cost of PyTorch's
pluggable-allocator wrapper.

    python3 bench/e2e.py --json e2e.json                     # every workload, default configs
    python3 bench/e2e.py --workloads resnet50 --rounds 3
    python3 bench/e2e.py --config torch --config 'mb' --config 'mb[profile:latency]'

Configurations: ``torch`` (PyTorch's default caching allocator), ``torch-expandable``
(``expandable_segments:True``), ``torch-async`` (``backend:cudaMallocAsync``), ``mb``
(``moonbright.torch.enable()``, global mode), ``mb[CONF]`` (the same with
``MOONBRIGHT_ALLOC_CONF=CONF``), ``mb-pool`` (``moonbright.torch.pool()`` around everything:
PyTorch's caching allocator over MoonBright's segments). Any MoonBright configuration may end
in ``@DIR``: its worker imports the ``moonbright`` package installed in ``DIR`` (``pip install
--target DIR``), so that two builds run side by side in one call (``--config mb --config
mb@/tmp/site-before``).

Workloads: ``resnet50`` (torchvision ResNet-50 training, batch 64, bf16 autocast,
channels_last, SGD), ``gpt2`` (GPT-2 medium training, AdamW, bf16 autocast, batch 4 x 512),
``llama`` (Hugging Face ``generate`` on a Llama of 1.1B parameters with random weights, bf16,
batch 32, 128-token prompts, 256 new tokens, ``DynamicCache``), ``resnet50-compile``
(``resnet50`` under ``torch.compile``, default mode).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import allocator_env, is_moonbright  # noqa: E402

DEFAULT_CONFIGS = ["torch", "torch-expandable", "mb", "mb-pool"]
WORKLOADS = ["resnet50", "gpt2", "llama", "resnet50-compile"]
# Timed steps per turn and untimed steps before them, per workload.
TURN = {"resnet50": (30, 3), "resnet50-compile": (30, 3), "gpt2": (12, 2), "llama": (1, 0)}
SETUP_TIMEOUT_S = 900
TURN_TIMEOUT_S = 300
SETTLE_S = 0.3
# Objects PyTorch holds raw pointers to (the null pluggable allocator).
_KEEP: list = []


# ---------------------------------------------------------------------------------------------
# Configurations.


def config_env(name: str) -> dict[str, str | None]:
    """The environment a configuration's worker starts with, over ours (None: unset)."""
    return allocator_env(name, ("mb-pool", "null-pluggable"), "e2e")


# ---------------------------------------------------------------------------------------------
# Workloads (run inside a worker).


class Workload:
    """A model and its step; `units` per step are what the rate counts (steps or tokens)."""

    unit = "steps"
    units_per_step = 1

    def step(self) -> None:
        raise NotImplementedError


class ResNet50(Workload):
    def __init__(self, torch, compiled: bool) -> None:
        import torch.nn.functional as F
        import torchvision

        self.torch, self.F = torch, F
        torch.manual_seed(0)
        model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
        self.model = torch.compile(model) if compiled else model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.x = torch.randn(64, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        self.y = torch.randint(0, 1000, (64,), device="cuda")

    def step(self) -> None:
        torch = self.torch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.F.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class GPT2(Workload):
    def __init__(self, torch) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        self.torch = torch
        torch.manual_seed(0)
        cfg = GPT2Config(n_positions=1024, n_embd=1024, n_layer=24, n_head=16)
        self.model = GPT2LMHeadModel(cfg).cuda().train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.ids = torch.randint(0, cfg.vocab_size, (4, 512), device="cuda")

    def step(self) -> None:
        torch = self.torch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class LlamaGenerate(Workload):
    unit = "tokens"
    BATCH, PROMPT, NEW = 32, 128, 256

    def __init__(self, torch) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch = torch
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
            num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
        )
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                self.model = LlamaForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(default)
        self.ids = torch.randint(3, cfg.vocab_size, (self.BATCH, self.PROMPT), device="cuda")
        self.mask = torch.ones_like(self.ids)
        self.units_per_step = self.BATCH * self.NEW

    def step(self) -> None:
        with self.torch.inference_mode():
            out = self.model.generate(
                input_ids=self.ids, attention_mask=self.mask, max_new_tokens=self.NEW,
                min_new_tokens=self.NEW, do_sample=False, pad_token_id=0,
            )
        assert out.shape == (self.BATCH, self.PROMPT + self.NEW), out.shape


def make_workload(name: str, torch) -> Workload:
    if name == "resnet50":
        return ResNet50(torch, compiled=False)
    if name == "resnet50-compile":
        return ResNet50(torch, compiled=True)
    if name == "gpt2":
        return GPT2(torch)
    if name == "llama":
        return LlamaGenerate(torch)
    raise SystemExit(f"e2e: unknown workload {name!r}")


# ---------------------------------------------------------------------------------------------
# The worker.


NULL_ALLOCATOR_C = r"""
#include <stdint.h>
#include <sys/types.h>
/* A pluggable allocator that does no work: distinct fake addresses, never touched. */
static uintptr_t next_addr = 0x7e0000000000ull;
void* null_alloc(ssize_t size, int device, void* stream) {
  (void)device; (void)stream;
  uintptr_t p = next_addr;
  next_addr += ((uintptr_t)size + 511u) & ~(uintptr_t)511u;
  if (next_addr > 0x7e8000000000ull) next_addr = 0x7e0000000000ull;
  return (void*)p;
}
void null_free(void* ptr, ssize_t size, int device, void* stream) {
  (void)ptr; (void)size; (void)device; (void)stream;
}
"""


def null_pluggable(torch):
    """PyTorch's CUDAPluggableAllocator over a C allocator that does nothing (built with cc)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="e2e-null-")
    src, lib = os.path.join(d, "null.c"), os.path.join(d, "libnull.so")
    with open(src, "w") as f:
        f.write(NULL_ALLOCATOR_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib, "null_alloc", "null_free")
    torch.cuda.memory.change_current_allocator(alloc)
    return alloc


# MoonBright's state at the end of a turn (not per step): how many ranges its cache and its
# unmap queue hold, its window, its mapped handles and live allocations.
MB_GAUGES = ("moonbright.cached_ranges.current", "moonbright.retired_ranges.current",
             "moonbright.window_bytes.current", "moonbright.mapped_handles.current",
             "moonbright.allocations.current")


def mb_counters(moonbright) -> dict[str, int]:
    s = moonbright.memory_stats()
    keep = {k: v for k, v in s.items() if k.startswith("moonbright.driver_calls.")}
    for k in ("moonbright.request_maps", "moonbright.request_mapped_handles",
              "moonbright.cache_hits", "moonbright.window_hits",
              "moonbright.subpage_allocations", "moonbright.carved_allocations",
              "moonbright.unmap_batches", "moonbright.pending_free_waits"):
        keep[k] = s.get(k, 0)
    keep.update({k: s[k] for k in MB_GAUGES if k in s})
    return keep


def micro(torch) -> dict[str, dict[str, float]]:
    """ns per allocation and per free through torch.cuda.caching_allocator_alloc/delete (PyTorch's
    raw_alloc_with_stream / raw_delete), best of 7 batches of 200 of each, after a warm-up."""
    stream = torch.cuda.current_stream()
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
    out = {}
    for size in (512, 1 << 20, 8 << 20, 64 << 20):
        n = 200
        best_a = best_f = float("inf")
        for rep in range(9):
            t0 = time.perf_counter_ns()
            ptrs = [alloc(size, 0, stream) for _ in range(n)]
            t1 = time.perf_counter_ns()
            for p in ptrs:
                delete(p)
            t2 = time.perf_counter_ns()
            if rep >= 2:
                best_a, best_f = min(best_a, (t1 - t0) / n), min(best_f, (t2 - t1) / n)
        t0 = time.perf_counter_ns()
        for _ in range(2000):
            delete(alloc(size, 0, stream))
        pair = (time.perf_counter_ns() - t0) / 2000
        out[str(size)] = {"alloc_ns": round(best_a), "free_ns": round(best_f), "pair_ns": round(pair)}
    return out


def kernel_ms_per_step(torch, w: Workload, steps: int) -> float:
    """Sum of the GPU's kernel times per step, from PyTorch's profiler (CUPTI)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            w.step()
        torch.cuda.synchronize()
    us = sum(e.time_range.elapsed_us() for e in prof.events()
             if e.device_type == DeviceType.CUDA)
    return us / 1000.0 / steps


class Instructions:
    """User-space instructions retired by this process and every thread it starts afterwards
    (``perf_event_open``, inherited), or None where the kernel or a sandbox refuses it. Unlike
    time, the count does not move with the clock rate or with time the CPU was lent elsewhere,
    so it compares the CPU work of one step under two allocators on a noisy machine."""

    # linux/perf_event.h: PERF_TYPE_HARDWARE, PERF_COUNT_HW_INSTRUCTIONS, and the attr flag
    # bits inherit (1), exclude_kernel (5), exclude_hv (6).
    _FLAGS = (1 << 1) | (1 << 5) | (1 << 6)
    _SYSCALL = {"x86_64": 298, "aarch64": 241}

    def __init__(self) -> None:
        import ctypes
        import platform
        import struct

        self.fd = None
        self.error = None
        nr = self._SYSCALL.get(platform.machine())
        if nr is None:
            self.error = f"no perf_event_open number for {platform.machine()}"
            return
        attr = bytearray(128)  # PERF_ATTR_SIZE_VER8 and below fit; the rest stays zero
        struct.pack_into("IIQ", attr, 0, 0, len(attr), 1)
        struct.pack_into("Q", attr, 40, self._FLAGS)
        buf = (ctypes.c_char * len(attr)).from_buffer(attr)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        fd = libc.syscall(ctypes.c_long(nr), buf, ctypes.c_int(0), ctypes.c_int(-1),
                          ctypes.c_int(-1), ctypes.c_ulong(8))  # PERF_FLAG_FD_CLOEXEC
        if fd < 0:
            self.error = f"perf_event_open: {os.strerror(ctypes.get_errno())}"
        else:
            self.fd = fd

    def read(self) -> int | None:
        if self.fd is None:
            return None
        return int.from_bytes(os.read(self.fd, 8), "little")


def threads_cpu_ns() -> dict[str, int]:
    """CPU time so far of this process's threads, in ns, by kind: ``main`` (the thread that
    launches the steps' forward passes), ``moonbright`` (MoonBright's background worker) and
    ``other`` (PyTorch's autograd threads, which run the backward passes, and the rest). Each
    thread's CPU clock is read with ``clock_gettime`` (Linux's clock id of a thread of this
    process: ``(~tid << 3) | 6``); empty where that fails. A thread that ended between two
    reads drops out of ``other``, so take the split of a turn, not of a run."""
    out = {"main": 0, "moonbright": 0, "other": 0}
    pid = os.getpid()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return {}
    for tid in tids:
        try:
            ns = time.clock_gettime_ns(((~tid) << 3) | 6)
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue  # ended meanwhile
        kind = "main" if tid == pid else "moonbright" if comm.startswith("moonbright") else "other"
        out[kind] += ns
    return out


def worker(args) -> int:
    # The protocol goes over the original stdout; everything printed after goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**kw) -> None:
        proto.write(json.dumps(kw) + "\n")

    t_start = time.perf_counter()
    instructions = Instructions()  # before torch starts threads, so that they are counted
    import torch

    moonbright = None
    pool_ctx = None
    if args.config == "null-pluggable":
        _KEEP.append(null_pluggable(torch))  # PyTorch keeps a raw pointer to it
    elif args.config.split("@")[0] == "mb-pool":
        import moonbright
        import moonbright.torch

        pool_ctx = torch.cuda.use_mem_pool(moonbright.torch.pool())
        pool_ctx.__enter__()
    elif is_moonbright(args.config):
        import moonbright
        import moonbright.torch

        moonbright.torch.enable()
    torch.cuda.init()
    if args.workload == "none":
        w = None
    else:
        w = make_workload(args.workload, torch)
        for _ in range(args.warmup):
            w.step()
        torch.cuda.synchronize()
    reply(ready=True, setup_s=round(time.perf_counter() - t_start, 2))

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        try:
            if op == "run":
                for _ in range(cmd["warmup"]):
                    w.step()
                torch.cuda.synchronize()
                a0 = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
                m0 = mb_counters(moonbright) if moonbright else {}
                t0 = time.perf_counter()
                c0, i0 = time.process_time(), instructions.read()
                th0 = threads_cpu_ns()
                for _ in range(cmd["steps"]):
                    w.step()
                # The CPU's work for the steps: every thread's, up to the last launch (the
                # wait for the GPU below would add spinning that depends on the GPU's lag).
                c1, i1 = time.process_time(), instructions.read()
                th1 = threads_cpu_ns()
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                a1 = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
                m1 = mb_counters(moonbright) if moonbright else {}
                n = cmd["steps"]
                per_step = {k: round((m1[k] - m0.get(k, 0)) / n, 2) for k in m1
                            if m1[k] != m0.get(k, 0) and k not in MB_GAUGES}
                gauges = {k: m1[k] for k in MB_GAUGES if k in m1}
                reply(rate=n * w.units_per_step / dt, step_ms=1000 * dt / n,
                      cpu_ms_per_step=1000 * (c1 - c0) / n,
                      instructions_per_step=(i1 - i0) / n if i0 is not None else None,
                      instructions_error=instructions.error,
                      thread_cpu_ms_per_step={k: (th1[k] - th0[k]) / 1e6 / n for k in th1
                                              if k in th0},
                      allocs_per_step=(a1 - a0) / n, moonbright_per_step=per_step,
                      moonbright_after=gauges)
            elif op == "kernels":
                reply(kernel_ms_per_step=kernel_ms_per_step(torch, w, cmd["steps"]))
            elif op == "micro":
                reply(micro=micro(torch))
            elif op == "final":
                out = {
                    "peak_reserved": torch.cuda.max_memory_reserved(),
                    "peak_allocated": torch.cuda.max_memory_allocated(),
                }
                if moonbright is not None:
                    out["moonbright_package"] = os.path.dirname(moonbright.__file__)
                    s = moonbright.memory_stats()
                    out["moonbright_peak_reserved"] = s.get("reserved_bytes.all.peak")
                    out["moonbright_peak_allocated"] = s.get("allocated_bytes.all.peak")
                    out["moonbright_options"] = {
                        k: str(v) for k, v in moonbright.options().items()
                    }
                reply(**out)
                break
            else:
                reply(error=f"unknown command {op!r}")
        except Exception as e:  # noqa: BLE001 - reported to the coordinator
            import traceback

            traceback.print_exc()
            reply(error=f"{type(e).__name__}: {e}")
    if pool_ctx is not None:
        pool_ctx.__exit__(None, None, None)
    proto.close()
    return 0


# ---------------------------------------------------------------------------------------------
# The coordinator.


class Worker:
    def __init__(self, workload: str, config: str, warmup: int, log_dir: str | None) -> None:
        self.workload, self.config = workload, config
        env = dict(os.environ)
        for k, v in config_env(config).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        env["PYTHONUNBUFFERED"] = "1"
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in config)
        self.log_path = os.path.join(log_dir, f"{workload}.{safe}.log") if log_dir else os.devnull
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--workload", workload,
             "--config", config, "--warmup", str(1 if workload == "llama" else warmup)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
        )
        self.dead: str | None = None

    def ask(self, timeout: float, **cmd) -> dict:
        if self.dead:
            return {"error": self.dead}
        if cmd:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.dead = "timed out" if not ready else f"exited ({self.proc.poll()})"
            self.dead += f"; see {self.log_path}"
            self.proc.kill()
            return {"error": self.dead}
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def run_workload(workload: str, configs: list[str], args) -> dict:
    steps, warm = TURN[workload]
    steps = args.steps or steps
    print(f"== {workload}: starting {len(configs)} workers", flush=True)
    workers: dict[str, Worker] = {}
    setup: dict[str, dict] = {}
    first = configs[:1] if workload.endswith("-compile") else []
    # A compiled workload's first worker fills the compile cache the others then read.
    for c in first:
        workers[c] = Worker(workload, c, args.warmup, args.log_dir)
        setup[c] = workers[c].ask(SETUP_TIMEOUT_S)
    for c in configs[len(first):]:
        workers[c] = Worker(workload, c, args.warmup, args.log_dir)
    for c in configs[len(first):]:
        setup[c] = workers[c].ask(SETUP_TIMEOUT_S)
    for c in configs:
        print(f"   {c}: setup {setup[c]}", flush=True)
    turns: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        for c in order:
            res = workers[c].ask(TURN_TIMEOUT_S, cmd="run", steps=steps, warmup=warm)
            turns[c].append(res)
            time.sleep(SETTLE_S)
        line = "  ".join(f"{c} {turns[c][-1].get('rate', float('nan')):.1f}" for c in configs)
        print(f"   round {r + 1}: {line}", flush=True)
    extra: dict[str, dict] = {c: {} for c in configs}
    if args.kernels:
        for c in configs:
            extra[c].update(workers[c].ask(TURN_TIMEOUT_S, cmd="kernels", steps=min(steps, 5)))
    if args.micro and workload == args.micro_workload:
        for c in configs:
            extra[c].update(workers[c].ask(TURN_TIMEOUT_S, cmd="micro"))
    finals = {c: workers[c].ask(120, cmd="final") for c in configs}
    for w in workers.values():
        w.close()
    rows = {}
    for c in configs:
        ok = [t for t in turns[c] if "rate" in t]
        rows[c] = {
            "setup": setup[c],
            "turns": turns[c],
            "rate": spread([t["rate"] for t in ok]) if ok else None,
            "allocs_per_step": statistics.median([t["allocs_per_step"] for t in ok]) if ok else None,
            "moonbright_per_step": ok[-1]["moonbright_per_step"] if ok else None,
            "errors": [t["error"] for t in turns[c] if "error" in t],
            **extra[c],
            **finals[c],
        }
    base = rows.get("torch", {}).get("rate")
    for c in configs:
        if base and rows[c]["rate"]:
            rows[c]["rate_vs_torch"] = rows[c]["rate"]["median"] / base["median"]
        # Each round's own ratio to PyTorch's turn in the same round: drift slower than a round
        # cancels out of it.
        paired = [t["rate"] / b["rate"] for t, b in zip(turns[c], turns.get("torch", []))
                  if "rate" in t and "rate" in b]
        if paired and c != "torch":
            rows[c]["paired_vs_torch"] = spread(paired)
        # The CPU's work per step, and each round's ratio of it to PyTorch's (above 1: more).
        for key in ("cpu_ms_per_step", "instructions_per_step"):
            xs = [t[key] for t in turns[c] if t.get(key) is not None]
            if xs:
                rows[c][key] = spread(xs)
            ratios = [t[key] / b[key] for t, b in zip(turns[c], turns.get("torch", []))
                      if t.get(key) is not None and b.get(key)]
            if ratios and c != "torch":
                rows[c][key + "_vs_torch"] = spread(ratios)
        # The same CPU time by thread: PyTorch's (main and autograd) against MoonBright's worker.
        split = [t["thread_cpu_ms_per_step"] for t in turns[c] if t.get("thread_cpu_ms_per_step")]
        if split:
            rows[c]["thread_cpu_ms_per_step"] = {
                k: spread([x[k] for x in split if k in x]) for k in split[0]}
    unit = "tokens" if workload == "llama" else "steps"
    return {"workload": workload, "unit": unit, "steps_per_turn": steps, "rows": rows}


def run_null_micro(args) -> dict:
    w = Worker("none", "null-pluggable", 0, args.log_dir)
    setup = w.ask(SETUP_TIMEOUT_S)
    res = w.ask(TURN_TIMEOUT_S, cmd="micro")
    w.ask(60, cmd="final")
    w.close()
    return {"setup": setup, **res}


def gib(x) -> str:
    return f"{x / 2**30:.2f}" if isinstance(x, (int, float)) else "-"


def print_table(results: list[dict]) -> None:
    print()
    print("| workload | config | rate median (min-max) | vs torch | paired rounds vs torch | "
          "CPU ms/step (paired vs torch) | threads' CPU ms/step: main, other, MB worker | "
          "user instructions M/step (paired vs torch) | "
          "peak reserved GiB | peak alloc GiB | allocs/step | MB driver calls/step | "
          "kernel ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for wl in results:
        for c, r in wl["rows"].items():
            rate = r["rate"]
            rtxt = (f"{rate['median']:.1f} ({rate['min']:.1f}-{rate['max']:.1f}) {wl['unit']}/s"
                    if rate else "error: " + "; ".join(r["errors"] or [str(r["setup"])]))
            mb = r.get("moonbright_per_step") or {}
            calls = mb.get("moonbright.driver_calls.total", "-" if not is_moonbright(c) else 0)
            ks = r.get("kernel_ms_per_step")
            pr = r.get("paired_vs_torch")
            ptxt = f"{pr['median']:.3f} ({pr['min']:.3f}-{pr['max']:.3f})" if pr else "-"
            cpu = r.get("cpu_ms_per_step")
            ctxt = f"{cpu['median']:.2f}" if cpu else "-"
            if r.get("cpu_ms_per_step_vs_torch"):
                ctxt += f" ({r['cpu_ms_per_step_vs_torch']['median']:.3f})"
            th = r.get("thread_cpu_ms_per_step") or {}
            ttxt = ", ".join(f"{th[k]['median']:.2f}" if k in th else "-"
                             for k in ("main", "other", "moonbright")) if th else "-"
            ins = r.get("instructions_per_step")
            itxt = f"{ins['median'] / 1e6:.2f}" if ins else "-"
            if r.get("instructions_per_step_vs_torch"):
                v = r["instructions_per_step_vs_torch"]
                itxt += f" ({v['median']:.4f}, {v['min']:.4f}-{v['max']:.4f})"
            print(f"| {wl['workload']} | {c} | {rtxt} | {r.get('rate_vs_torch', float('nan')):.3f} "
                  f"| {ptxt} | {ctxt} | {ttxt} | {itxt} "
                  f"| {gib(r.get('moonbright_peak_reserved') or r.get('peak_reserved'))} "
                  f"| {gib(r.get('peak_allocated'))} | {r['allocs_per_step'] or 0:.0f} | {calls} "
                  f"| {f'{ks:.2f}' if isinstance(ks, float) else '-'} |")


def coordinator(args) -> int:
    configs = args.config or DEFAULT_CONFIGS
    for c in configs:
        config_env(c)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    import torch  # only for the provenance; the workers import their own

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "rounds": args.rounds,
        "configs": configs,
        "commit": os.environ.get("MOONBRIGHT_COMMIT", ""),
    }
    try:
        meta["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        meta["driver"] = None
    del torch
    results = []
    out = {"meta": meta, "workloads": results}
    for wl in args.workloads.split(","):
        results.append(run_workload(wl, configs, args))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if args.micro:
        out["null_pluggable_micro"] = run_null_micro(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print_table(results)
    if args.micro:
        print("\nCPU ns per alloc / free through torch.cuda.caching_allocator_alloc/delete:")
        for wl in results:
            for c, r in wl["rows"].items():
                if "micro" in r:
                    print(f"  {c:>24}: " + "  ".join(
                        f"{int(s) >> 10}KiB {m['alloc_ns']}/{m['free_ns']} pair {m['pair_ns']}"
                        for s, m in r["micro"].items()))
        nm = out["null_pluggable_micro"].get("micro", {})
        print(f"  {'null-pluggable':>24}: " + "  ".join(
            f"{int(s) >> 10}KiB {m['alloc_ns']}/{m['free_ns']} pair {m['pair_ns']}"
            for s, m in nm.items()))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--config", action="append", help="a configuration (repeat); default: "
                    + ", ".join(DEFAULT_CONFIGS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=0, help="timed steps per turn (0: per workload)")
    ap.add_argument("--warmup", type=int, default=5, help="steps each worker runs before round 1")
    ap.add_argument("--kernels", action="store_true", help="GPU kernel time per step (profiler)")
    ap.add_argument("--micro", action="store_true", help="CPU cost per allocation and free")
    ap.add_argument("--micro-workload", default="resnet50",
                    help="the workload whose workers run --micro")
    ap.add_argument("--json")
    ap.add_argument("--log-dir", help="each worker's stderr goes to a file here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.config = args.config[0]
        return worker(args)
    return coordinator(args)


if __name__ == "__main__":
    sys.exit(main())
