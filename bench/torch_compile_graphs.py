#!/usr/bin/env python3
"""What CUDA graphs buy a launch-bound model under torch.compile, with MoonBright as PyTorch's
allocator (`moonbright`) or with PyTorch's own (`pytorch`); both run Inductor's CUDA-graph trees
in mode "reduce-overhead" (under MoonBright through the allocator calls `moonbright.torch`
serves). One process per allocator; the ratios that matter are within a process (step time of
mode "reduce-overhead" over mode "default" and over eager), and across processes the step
times of one mode (pin both to one core, `taskset -c N`, on a noisy machine).

The model: `--layers` Linear+GELU layers of width `--width` on a batch of `--batch`, small
enough that kernel launches, not arithmetic, set the step time. A step is one forward pass
(inference) or forward, backward and SGD (`--train`). Prints one JSON line."""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import summary  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("allocator", choices=["moonbright", "pytorch"])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--train", action="store_true")
    a = ap.parse_args()

    import torch
    if a.allocator == "moonbright":
        import moonbright.torch
        moonbright.torch.enable()
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda()
    if not a.train:
        model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(a.batch, a.width, device="cuda")

    def timed(fn, warm=5):
        for _ in range(warm):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e6)
        return summary(times)

    def step_with(f):
        if a.train:
            def step():
                torch.compiler.cudagraph_mark_step_begin()
                opt.zero_grad(set_to_none=False)
                f(x).pow(2).mean().backward()
                opt.step()
        else:
            def step():
                torch.compiler.cudagraph_mark_step_begin()
                with torch.no_grad():
                    f(x)
        return step

    out = {"allocator": a.allocator, "train": a.train, "layers": a.layers, "width": a.width,
           "batch": a.batch, "steps": a.steps}
    out["eager_us"] = timed(step_with(model))
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        t = time.perf_counter()
        f = torch.compile(model, mode=mode)
        step_with(f)()
        torch.cuda.synchronize()
        out[f"{mode}_first_step_s"] = time.perf_counter() - t
        out[f"{mode}_us"] = timed(step_with(f))
    import torch._dynamo.utils as du
    import torch._inductor.config as ic
    out["cudagraph_trees"] = ic.triton.cudagraph_trees
    out["cudagraph_skips"] = du.counters["inductor"].get("cudagraph_skips", 0)
    p50 = {k: out[f"{k}_us"]["p50"] for k in ("eager", "default", "reduce-overhead")}
    out["reduce_overhead_over_default"] = p50["reduce-overhead"] / p50["default"]
    out["reduce_overhead_over_eager"] = p50["reduce-overhead"] / p50["eager"]
    out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
