#!/usr/bin/env python3
"""What `torch.cuda.empty_cache()` in one thread costs a TLB-bound kernel in another, per
allocator, each configuration in its own process on the same card.

A random gather (``--reads`` random 4-byte reads through an index tensor, over a tensor of
``--gather-gib``, default 48 GiB) is timed by CUDA events, ``--reps`` times back to back on one
stream: alone, then while another thread on its own stream allocates and frees tensors of
2-512 MiB (log-uniform, at most ``--live-gib`` live, each free a random live tensor) and calls
``torch.cuda.empty_cache()`` every ``--every`` operations, then alone again. Configurations
(``--config``, repeat it): ``torch`` (PyTorch's caching allocator), ``torch-expandable``
(``expandable_segments:True``), ``torch-async`` (``backend:cudaMallocAsync``), ``mb``
(``moonbright.torch.enable()``; ``mb[CONF]`` with ``MOONBRIGHT_ALLOC_CONF=CONF``). Rounds
(``--rounds``) take turns over the configurations, each a fresh process.

Reports per configuration the gather's p50 and p99 alone and under churn, the slowdown at
p50 and p99 (churn over the two alone phases together, pooled over rounds), churn
operations per second, and the `empty_cache` calls made; ``--json F`` writes everything.

    python3 bench/empty_cache_interference.py --json ec.json
    python3 bench/empty_cache_interference.py --config torch --config mb --rounds 3
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import allocator_env, summary  # noqa: E402

CONFIGS = ["torch", "torch-expandable", "torch-async", "mb"]
MIB = 1 << 20
WARM_OPS = 16


def config_env(name):
    """The environment of a configuration's process: ours, with its allocator's settings."""
    env = dict(os.environ)
    for k, v in allocator_env(name, (), "empty_cache_interference").items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


# ---------------------------------------------------------------------------------------------
# One configuration's process.


def churn(torch, stop, args, out):
    """Allocates and frees on a stream of its own, with `empty_cache` every `args.every`
    operations, until `stop` is set."""
    rng = random.Random(20261206)
    stream = torch.cuda.Stream()
    live, live_bytes, ops, empties = [], 0, 0, 0
    lo, hi = math.log(2 * MIB), math.log(512 * MIB)
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        while not stop.is_set():
            size = int(math.exp(rng.uniform(lo, hi)))
            if live and (rng.random() < 0.5 or live_bytes + size > args.live_gib << 30):
                t = live.pop(rng.randrange(len(live)))
                live_bytes -= t.numel()
                del t
            else:
                t = torch.empty(size, dtype=torch.uint8, device="cuda")
                t[:1].fill_(1)  # used on the churn stream, as a real tensor is
                live.append(t)
                live_bytes += size
            ops += 1
            out["done"] = ops
            if ops % args.every == 0:
                torch.cuda.empty_cache()
                empties += 1
            if args.pace_us:
                time.sleep(args.pace_us / 1e6)
    live.clear()
    stream.synchronize()
    out.update(ops=ops, empty_cache_calls=empties, seconds=time.perf_counter() - t0)


def gather_phase(torch, data, idx, out_buf, reps, args, with_churn=False):
    """`reps` gathers queued back to back on the current stream behind a 50 ms spin (so that
    they run back to back however the threads share the interpreter), each between two
    events; with `with_churn`, the churn thread runs from before they are queued (once it
    has made `WARM_OPS` operations, or after 2 s) until they are done. Returns (ms each, the
    churn's report)."""
    stop, report, th = threading.Event(), {"done": 0}, None
    if with_churn:
        th = threading.Thread(target=churn, args=(torch, stop, args, report))
        th.start()
        t0 = time.perf_counter()
        while report["done"] < WARM_OPS and time.perf_counter() - t0 < 2.0:
            time.sleep(0.001)
        report["warm_s"] = time.perf_counter() - t0
    start_ops, t_start = report["done"], time.perf_counter()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    torch.cuda._sleep(100_000_000)  # about 50 ms on a Hopper's clock
    events[0].record()
    for i in range(reps):
        torch.index_select(data, 0, idx, out=out_buf)
        events[i + 1].record()
    # Poll rather than block, so the churn thread keeps the interpreter between polls.
    while not events[-1].query():
        time.sleep(0.0005)
    report["ops_during"] = report["done"] - start_ops
    report["during_s"] = time.perf_counter() - t_start
    if th is not None:
        stop.set()
        th.join()
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(reps)], report


def worker(args):
    name = args.worker
    if name.startswith("mb"):
        import moonbright.torch as mbt

        mbt.enable()
    import torch

    torch.cuda.init()
    n = (args.gather_gib << 30) // 4
    data = torch.empty(n, dtype=torch.float32, device="cuda")
    data.fill_(1.0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    idx = torch.randint(0, n, (args.reads,), device="cuda", generator=gen)
    out_buf = torch.empty(args.reads, dtype=torch.float32, device="cuda")
    gather_phase(torch, data, idx, out_buf, 5, args)  # warm-up
    alone1, _ = gather_phase(torch, data, idx, out_buf, args.reps, args)
    churned, report = gather_phase(torch, data, idx, out_buf, args.reps, args, with_churn=True)
    alone2, _ = gather_phase(torch, data, idx, out_buf, args.reps, args)
    assert torch.equal(out_buf, torch.ones_like(out_buf)), "the gather read wrong values"
    result = {
        "config": name,
        "alone_ms": alone1 + alone2,
        "churn_ms": churned,
        "churn": report,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "allocator": torch.cuda.get_allocator_backend(),
    }
    if name.startswith("mb"):
        import moonbright

        result["moonbright_stats"] = {
            k: v for k, v in moonbright.memory_stats(0).items() if isinstance(v, (int, float))
        }
    print(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# The driver.


def run_one(name, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name]
    for k in ("gather_gib", "reads", "reps", "live_gib", "every", "pace_us"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    p = subprocess.run(cmd, env=config_env(name), capture_output=True, text=True,
                       timeout=args.timeout)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        return {"config": name, "error": f"exit status {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gather-gib", type=int, default=48)
    ap.add_argument("--reads", type=int, default=32 << 20)
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("--live-gib", type=int, default=8)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--pace-us", type=int, default=0, help="sleep between churn operations")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
    except Exception as e:  # noqa: BLE001 - any reason there is no GPU
        print(f"no GPU: {e}", file=sys.stderr)
        return 2
    configs = args.config or CONFIGS
    runs = []
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for name in order:
            res = run_one(name, args)
            res["round"] = r
            runs.append(res)
            print(f"round {r + 1} {name}: " + ("ERROR " + res["error"] if "error" in res else
                  f"alone p50 {summary(res['alone_ms'])['p50']:.3f} ms, churn p50 "
                  f"{summary(res['churn_ms'])['p50']:.3f} ms, {res['churn']['ops_during']} ops "
                  f"during the gathers, {res['churn']['warm_s']:.2f} s to the first "
                  f"{WARM_OPS}"),
                  flush=True)
    rows = []
    print("\n| configuration | gather alone p50 / p99 (ms) | under churn p50 / p99 (ms) | "
          "slowdown p50 / p99 | churn ops/s | empty_cache calls |")
    print("|---|---|---|---|---|---|")
    failed = False
    for name in configs:
        mine = [x for x in runs if x["config"] == name and "error" not in x]
        if len(mine) < sum(1 for x in runs if x["config"] == name):
            failed = True
        if not mine:
            continue
        alone = summary([t for x in mine for t in x["alone_ms"]])
        under = summary([t for x in mine for t in x["churn_ms"]])
        ops = sum(x["churn"]["ops_during"] for x in mine)
        secs = sum(x["churn"]["during_s"] for x in mine)
        row = {"config": name, "alone": alone, "churn": under,
               "slowdown_p50": under["p50"] / alone["p50"],
               "slowdown_p99": under["p99"] / alone["p99"],
               "churn_ops_per_s": ops / secs,
               "empty_cache_calls": sum(x["churn"]["empty_cache_calls"] for x in mine)}
        rows.append(row)
        print(f"| {name} | {alone['p50']:.3f} / {alone['p99']:.3f} | {under['p50']:.3f} / "
              f"{under['p99']:.3f} | {row['slowdown_p50']:.3f} / {row['slowdown_p99']:.3f} | "
              f"{row['churn_ops_per_s']:,.0f} | {row['empty_cache_calls']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"},
                       "commit": os.environ.get("MOONBRIGHT_COMMIT", ""),
                       "summary": rows, "runs": runs}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
