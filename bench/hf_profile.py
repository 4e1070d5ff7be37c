#!/usr/bin/env python3
"""Where a decode step of bench/hf_capacity.py's set-up spends its time, for one
allocator and cache per process: the wall time of `generate` at two lengths (so prefill and the
per-step cost separate), the GPU time of one decode step (CUDA events around a manual forward),
and the top operators of a few profiled decode steps (torch.profiler, by self CUDA time and by
self CPU time).

    python3 bench/hf_profile.py --alloc growable --batch 96 --out $OUT/prof_growable.json
    python3 bench/hf_profile.py --alloc default --cache static --compile --batch 72

--compile leaves transformers' automatic compilation of static-cache decoding on (the set-up in
which the issue's StaticCache baselines were probably measured); the first `generate` then
compiles and is not timed.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_capacity as hc  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alloc", choices=hc.ALLOCS, required=True)
    ap.add_argument("--cache", choices=("dynamic", "growable", "static"))
    ap.add_argument("--attn", choices=("sdpa", "gqa"), default="sdpa")
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--cap", default="12GiB")
    ap.add_argument("--steps", type=int, default=32, help="decode steps between the two timings")
    ap.add_argument("--compile", action="store_true", help="static cache: let generate compile")
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--profile-generate", type=int, default=0, metavar="N",
                    help="also profile a whole generate of N new tokens (CPU and CUDA), with "
                    "the time spent in GrowableCache's update and resize")
    ap.add_argument("--out")
    args = ap.parse_args()
    cache_kind = args.cache or ("growable" if args.alloc == "growable" else "dynamic")
    hc.set_environment(args.alloc, args.cap)
    import torch

    if args.alloc in ("moonbright", "growable"):
        import moonbright.torch

        moonbright.torch.enable()
    from transformers import LlamaForCausalLM, StaticCache

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    if args.alloc in ("default", "expandable"):
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, hc.parse_bytes(args.cap) / total), dev)
    cfg = hc.model_config(False)
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    if args.attn == "gqa":
        from moonbright.transformers import use_gqa_attention

        use_gqa_attention(model)
    prompts = hc.Prompts(torch, args.batch, 256, 1024, cfg.vocab_size, 0)
    ids, mask = prompts.batch(args.batch, dev)

    def make_cache(extra):
        if cache_kind == "growable":
            from moonbright.transformers import GrowableCache

            return GrowableCache(cfg)
        if cache_kind == "static":
            return StaticCache(config=cfg, max_cache_len=ids.shape[1] + extra)
        return None

    def generate(new):
        cache = make_cache(new)
        kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=0)
        if cache is not None:
            kw["past_key_values"] = cache
        if cache_kind == "static" and not args.compile:
            kw["disable_compile"] = True
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter() - t0
        if hasattr(cache, "release"):
            cache.release()
        return t

    res = {"alloc": args.alloc, "cache": cache_kind, "attn": args.attn, "batch": args.batch,
           "compile": args.compile,
           "padded_prompt": int(ids.shape[1]), "torch": torch.__version__}
    t = time.perf_counter()
    generate(4)  # warm-up (and compilation, with --compile)
    if args.compile:
        generate(args.steps + 1)
    res["warmup_s"] = time.perf_counter() - t
    t1 = generate(1)
    tn = generate(args.steps + 1)
    res["prefill_s"] = t1
    res["decode_step_ms"] = (tn - t1) / args.steps * 1e3
    res["tok_per_s_decode"] = args.batch / (res["decode_step_ms"] / 1e3)
    print(f"{args.alloc}/{cache_kind}/{args.attn}{' compiled' if args.compile else ''} "
          f"batch {args.batch}: "
          f"prefill {t1:.2f} s, decode {res['decode_step_ms']:.1f} ms/step "
          f"({res['tok_per_s_decode']:.0f} tok/s in decode)", flush=True)

    if not args.compile:
        # One decode step by hand, after a prefill: GPU time (events) and host time.
        cache = make_cache(args.profile_steps + 8)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            out = None  # the prefill's logits: gigabytes under the cap
            m = torch.cat([mask, torch.ones_like(nxt)], 1)
            pos = ids.shape[1]

            def step():
                nonlocal m, nxt, pos
                o = model(nxt, attention_mask=m, past_key_values=cache, use_cache=True,
                          cache_position=torch.tensor([pos], device=dev))
                nxt = o.logits[:, -1:].argmax(-1)
                m = torch.cat([m, torch.ones_like(nxt)], 1)
                pos += 1

            step()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            h0 = time.perf_counter()
            a.record()
            step()
            h1 = time.perf_counter()
            b.record()
            b.synchronize()
            res["manual_step_host_ms"] = (h1 - h0) * 1e3
            res["manual_step_gpu_ms"] = a.elapsed_time(b)
            print(f"one decode forward: host {res['manual_step_host_ms']:.1f} ms, "
                  f"events {res['manual_step_gpu_ms']:.1f} ms", flush=True)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.profile_steps):
                    step()
                torch.cuda.synchronize()
        ka = prof.key_averages()
        by_cuda = ka.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60)
        by_cpu = ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60)
        print(by_cuda)
        print(by_cpu)
        res["profile_top_cuda"] = [
            {"name": e.key, "self_cuda_ms": e.self_device_time_total / 1e3 / args.profile_steps,
             "count_per_step": e.count / args.profile_steps}
            for e in sorted(ka, key=lambda e: -e.self_device_time_total)[:18]]
        if hasattr(cache, "release"):
            cache.release()
    if args.profile_generate:
        profile_generate(args, res, torch, generate, cache_kind)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def profile_generate(args, res, torch, generate, cache_kind):
    """Profiles a whole generate (prefill included) and times GrowableCache's Python parts."""
    from torch.profiler import ProfilerActivity, profile

    spent = {"update": 0.0, "ensure": 0.0}
    restore = []
    if cache_kind == "growable":
        import moonbright.transformers as mt

        def timed(cls, name, key):
            orig = getattr(cls, name)

            def wrapper(*a, **kw):
                t = time.perf_counter()
                try:
                    return orig(*a, **kw)
                finally:
                    spent[key] += time.perf_counter() - t

            setattr(cls, name, wrapper)
            restore.append((cls, name, orig))

        timed(mt.GrowableLayer, "update", "update")
        timed(mt._TokenStore, "ensure", "ensure")
    n = args.profile_generate
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds = generate(n)
    for cls, name, orig in restore:
        setattr(cls, name, orig)
    ka = prof.key_averages()
    print(f"profiled generate of {n} new tokens: {seconds:.2f} s (profiler on); "
          f"GrowableCache update {spent['update'] * 1e3:.1f} ms, of which ensure "
          f"{spent['ensure'] * 1e3:.1f} ms", flush=True)
    print(ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    res["generate_profile"] = {"new_tokens": n, "seconds": seconds,
                               "update_s": spent["update"], "ensure_s": spent["ensure"]}


if __name__ == "__main__":
    sys.exit(main())
