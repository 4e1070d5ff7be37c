#!/usr/bin/env python3
"""Capacity of Hugging Face `generate` under a fixed memory cap: the largest batch that
completes, and its tokens per second, for one allocator configuration per process.

A Llama of TinyLlama-1.1B's shape (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV
heads, vocab 32000) with random weights, bf16, sdpa attention, generates greedily
(min_new_tokens = max_new_tokens) for left-padded prompts of random length 256-1024 (fixed seed;
batch b takes the first b prompts of one list). Configurations (--alloc):

  default      PyTorch's allocator, capped with torch.cuda.set_per_process_memory_fraction
  expandable   the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  moonbright   MoonBright as PyTorch's allocator (moonbright.torch.enable), cap:CAP, DynamicCache
  growable     MoonBright as PyTorch's allocator, cap:CAP, moonbright.transformers.GrowableCache

The model is built once; batch sizes are then probed: the first at --start, the next from the
peak memory of the last success (fixed memory plus a per-sequence share), then bisection down to
--resolution. An out-of-memory error frees everything and the search goes on. No trial starts
that would not end within --time-budget (counted from the start of the process); the JSON is
written after every trial, so a run cut short keeps what it measured. Tokens per second = new
tokens generated / wall time of `generate` (prefill included) at the largest batch that completed.

KV bytes copied: measured by GrowableCache (kv_stats); for DynamicCache computed (each decode step
torch.cat copies every layer's cached K and V). --tiny runs a toy model on the CPU to check the
script itself.
"""
import argparse
import gc
import json
import os
import platform
import sys
import time

ALLOCS = ("default", "expandable", "moonbright", "growable")
START = {"default": 80, "expandable": 96, "moonbright": 100, "growable": 104}


def parse_bytes(text):
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    t = text.strip().upper()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def set_environment(alloc, cap_text):
    """Allocator settings go in the environment before torch (or moonbright) starts."""
    for key in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        os.environ.pop(key, None)
    if alloc == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if alloc in ("moonbright", "growable"):
        conf = [kv for kv in os.environ.get("MOONBRIGHT_ALLOC_CONF", "").split(",") if kv]
        conf = [kv for kv in conf if not kv.startswith(("cap:", "cap_fraction:", "backend:"))]
        os.environ["MOONBRIGHT_ALLOC_CONF"] = ",".join(conf + ["backend:cuda", f"cap:{cap_text}"])


def model_config(tiny):
    from transformers import LlamaConfig

    if tiny:
        shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    else:
        shape = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                     max_position_embeddings=2048)
    return LlamaConfig(**shape, rms_norm_eps=1e-5, attn_implementation="sdpa", pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


class Prompts:
    """A fixed list of prompts; batch b is the first b, left-padded to the longest of them."""

    def __init__(self, torch, n, lo, hi, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
        self.tokens = [torch.randint(3, vocab, (k,), generator=g) for k in self.lengths]
        self.torch = torch

    def batch(self, b, device):
        torch = self.torch
        width = max(self.lengths[:b])
        ids = torch.zeros((b, width), dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i in range(b):
            k = self.lengths[i]
            ids[i, width - k:] = self.tokens[i]
            mask[i, width - k:] = 1
        return ids.to(device), mask.to(device)


class HostBuffer:
    """For --tiny: moonbright.Growable's interface over CPU memory, all of it usable at once."""

    def __init__(self, capacity, device):
        import numpy

        self.capacity, self.size, self.committed = capacity, 0, 0
        self._mem = numpy.zeros(capacity, dtype=numpy.uint8)
        self.ptr = self._mem.ctypes.data
        self.__array_interface__ = self._mem.__array_interface__

    def resize(self, nbytes, stream=None):
        self.size = self.committed = nbytes

    def release(self, stream=None):
        self.size = self.committed = 0


def dynamic_copy_bytes(cfg, batch, prompt, new, elem):
    """Bytes of cached K and V that DynamicCache's torch.cat copies: at each decode step, every
    layer's K and V of all tokens cached so far (prompt + tokens generated before it)."""
    row = batch * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * elem
    cached = sum(prompt + i for i in range(new - 1))
    return 2 * cfg.num_hidden_layers * row * cached


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--alloc", choices=ALLOCS, required=True)
    ap.add_argument("--cache", choices=("dynamic", "growable", "static"),
                    help="default: growable for --alloc growable, dynamic otherwise")
    ap.add_argument("--attn", choices=("sdpa", "gqa"), default="sdpa",
                    help="gqa: moonbright.transformers.gqa_attention (decode reads K and V in "
                    "place instead of expanding them to every query head)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--cap", default="12GiB", help="memory cap (default 12GiB)")
    ap.add_argument("--start", type=int, help="first batch size tried (default per --alloc)")
    ap.add_argument("--step", type=int, default=8, help="step up or down before a bracket exists")
    ap.add_argument("--resolution", type=int, default=4, help="stop when the bracket is this narrow")
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--max-trials", type=int, default=12)
    ap.add_argument("--time-budget", type=float, default=180.0, help="seconds for the whole process")
    ap.add_argument("--prompt-min", type=int, default=256)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="resolution 8, at most 3 trials")
    ap.add_argument("--tiny", action="store_true", help="a toy model on the CPU (checks the script)")
    ap.add_argument("--tiny-oom-above", type=int, help="with --tiny: batches above this fail "
                    "as out of memory (checks the search)")
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    cache_kind = args.cache or ("growable" if args.alloc == "growable" else "dynamic")
    if args.quick:
        args.resolution, args.max_trials = max(args.resolution, 8), min(args.max_trials, 3)
    if args.tiny:
        args.prompt_min, args.prompt_max = min(args.prompt_min, 8), min(args.prompt_max, 24)
    cap = parse_bytes(args.cap)
    if not args.tiny:
        set_environment(args.alloc, args.cap)

    import torch

    if not args.tiny and args.alloc in ("moonbright", "growable"):
        import moonbright.torch

        moonbright.torch.enable()
    import transformers
    from transformers import LlamaForCausalLM, StaticCache

    if args.tiny:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("hf_capacity: no GPU visible to PyTorch (use --tiny to check the script)",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        if args.alloc in ("default", "expandable"):
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    cuda = device.type == "cuda"

    cfg = model_config(args.tiny)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    if args.attn == "gqa":
        from moonbright.transformers import use_gqa_attention

        use_gqa_attention(model)
    elem = 2
    prompts = Prompts(torch, args.max_batch, args.prompt_min, args.prompt_max, cfg.vocab_size,
                      args.seed)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def free():
        gc.collect()
        sync()
        if cuda:
            torch.cuda.empty_cache()

    def moonbright_stats():
        if args.tiny or args.alloc not in ("moonbright", "growable"):
            return {}
        import moonbright

        s = moonbright.memory_stats()
        keep = ("reserved_bytes.all.peak", "allocated_bytes.all.peak", "num_ooms",
                "num_sync_all_streams", "moonbright.cap_bytes",
                "moonbright.reserved_over_allocated_peak", "moonbright.cache_hits",
                "moonbright.cached_ranges_stolen", "moonbright.unmap_batches",
                "moonbright.driver_calls.map", "moonbright.driver_calls.unmap",
                "moonbright.driver_calls.create", "moonbright.driver_calls.set_access")
        return {k: v for k, v in s.items() if k in keep or "growable" in k}

    def make_cache(ids):
        if cache_kind == "growable":
            from moonbright.transformers import GrowableCache

            if args.tiny:
                return GrowableCache(cfg, buffer_factory=HostBuffer)
            return GrowableCache(cfg)  # capacity: max_position_embeddings, reserved, not committed
        if cache_kind == "static":
            return StaticCache(config=cfg, max_cache_len=ids.shape[1] + args.new_tokens)
        return None  # generate makes its default DynamicCache

    def run_generate(b, new):
        ids, mask = prompts.batch(b, device)
        cache = make_cache(ids)
        kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=0)
        if cache is not None:
            kw["past_key_values"] = cache
        if cache_kind == "static":
            kw["disable_compile"] = True
        try:
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, **kw)
            sync()
            seconds = time.perf_counter() - t0
            generated = int(out.shape[1] - ids.shape[1])
            kv = cache.kv_stats() if hasattr(cache, "kv_stats") else None
            return seconds, generated, int(ids.shape[1]), kv
        finally:
            if hasattr(cache, "release"):
                cache.release()

    # Warm-up: kernels, cuBLAS handles, the allocator's first pages.
    run_generate(2, 4)
    free()
    base = torch.cuda.memory_allocated(device) if cuda else 0

    result = {
        "alloc": args.alloc, "cache": cache_kind, "attn": args.attn, "new_tokens": args.new_tokens,
        "cap_bytes": cap,
        "prompt_lengths": [args.prompt_min, args.prompt_max], "seed": args.seed,
        "model": {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size",
                                               "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "vocab_size")},
        "params": sum(p.numel() for p in model.parameters()), "dtype": "bfloat16",
        "fixed_bytes": base, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
        "allocator_env": {k: os.environ[k] for k in ("PYTORCH_CUDA_ALLOC_CONF",
                                                      "MOONBRIGHT_ALLOC_CONF") if k in os.environ},
        "trials": [], "best": None, "smallest_failed": None, "converged": False,
    }

    def write():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    def trial(b):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        row = {"batch": b, "ok": False}
        t0 = time.perf_counter()
        try:
            if args.tiny and args.tiny_oom_above is not None and b > args.tiny_oom_above:
                raise torch.OutOfMemoryError(f"--tiny-oom-above {args.tiny_oom_above}")
            seconds, generated, width, kv = run_generate(b, args.new_tokens)
            row.update(ok=True, seconds=seconds, generated=generated, padded_prompt=width,
                       tokens_per_s=b * generated / seconds)
            if kv is not None:
                row["kv"] = kv
                row["kv_bytes_copied"] = kv["kv_bytes_copied"]
            elif cache_kind == "dynamic":
                row["kv_bytes_copied_computed"] = dynamic_copy_bytes(
                    cfg, b, width, generated, elem)
        except (torch.OutOfMemoryError, MemoryError) as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        except RuntimeError as e:
            if "out of memory" not in str(e).lower():
                raise
            row["error"] = f"RuntimeError: {str(e).splitlines()[0][:300]}"
        row["wall_s"] = time.perf_counter() - t0
        if cuda:
            row["peak_allocated"] = torch.cuda.max_memory_allocated(device)
            row["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        row["moonbright"] = moonbright_stats()
        free()
        return row

    def estimate(row):
        """The batch that the cap would fit, from a success's peak: fixed + b * per sequence."""
        if not cuda:
            return row["batch"] * 2
        # Under MoonBright the growable cache's pages are counted in the allocated and
        # reserved bytes already; with another allocator's stats they are not.
        kv = row.get("kv", {}).get("peak_committed_bytes", 0)
        if args.alloc in ("moonbright", "growable"):
            kv = 0
        peak = max(row["peak_reserved"], row["peak_allocated"] + kv)
        per_seq = max(peak - base, 1) / row["batch"]
        return int((cap - base) / per_seq)

    def choose(lo, hi):
        """The next batch to try, or None when done: lo is the largest success, hi the smallest
        failure so far."""
        res = args.resolution
        if lo is None:  # only failures: step down
            x = hi - 2 * args.step if hi > 2 * args.step else hi // 2
            return x if 0 < x < hi else None
        est = estimate(result["best"])
        if hi is None:  # only successes: up, to the estimate, by a step at least
            if lo >= args.max_batch:
                return None
            x = max(lo + args.step, min(est, int(lo * 1.5) + args.step))
            return min(lo + (x - lo) // res * res, args.max_batch)
        if hi - lo <= res:
            return None
        x = est if lo < est < hi else (lo + hi) // 2
        x = lo + max(res, (x - lo) // res * res)
        if x >= hi:
            x = (lo + hi) // 2
        return x if lo < x < hi else None

    print(f"hf_capacity: {args.alloc} allocator, {cache_kind} cache, {args.attn} attention, "
          f"{args.new_tokens} new tokens, "
          f"cap {cap / 2**30:.1f} GiB, {result['params'] / 1e9:.2f} B parameters, "
          f"fixed {base / 2**30:.2f} GiB, {result['gpu']}", flush=True)
    print(f"{'batch':>6} {'ok':>4} {'seconds':>8} {'tok/s':>9} {'peak alloc':>11} "
          f"{'peak resv':>10} {'KV copied':>10}", flush=True)
    lo = hi = None
    b = min(args.start or (4 if args.tiny else START[args.alloc]), args.max_batch)
    last_rate = None  # seconds per (sequence x new token) of the latest success
    while b is not None and len(result["trials"]) < args.max_trials:
        elapsed = time.perf_counter() - t_start
        if result["trials"] and last_rate is not None:
            if elapsed + last_rate * b * args.new_tokens * 1.1 > args.time_budget:
                result["stopped"] = f"time budget: trial at {b} would not end in time"
                break
        elif result["trials"] and elapsed > args.time_budget:
            result["stopped"] = "time budget"
            break
        row = trial(b)
        result["trials"].append(row)
        copied = row.get("kv_bytes_copied", row.get("kv_bytes_copied_computed"))
        print(f"{b:>6} {'yes' if row['ok'] else 'OOM':>4} {row['wall_s']:>8.1f} "
              f"{row.get('tokens_per_s', 0):>9.0f} {row.get('peak_allocated', 0) / 2**30:>10.2f}G "
              f"{row.get('peak_reserved', 0) / 2**30:>9.2f}G "
              f"{'' if copied is None else f'{copied / 2**30:.2f}G':>10}", flush=True)
        if row["ok"]:
            lo = b if lo is None else max(lo, b)
            last_rate = row["seconds"] / (b * args.new_tokens)
            if lo == b:
                result["best"] = row
        else:
            hi = b if hi is None else min(hi, b)
            result["smallest_failed"] = hi
        write()
        b = choose(lo, hi)
        if b is None:
            result["converged"] = True

    best = result["best"]
    write()
    print(f"RESULT {args.alloc}/{cache_kind} new={args.new_tokens}: largest batch "
          f"{best['batch'] if best else 'none'}"
          + (f" at {best['tokens_per_s']:.0f} tok/s" if best else "")
          + (f", {hi} failed" if hi is not None else ", no failure seen")
          + ("" if result["converged"] else " (not converged)")
          + (f", KV copied {best.get('kv_bytes_copied', best.get('kv_bytes_copied_computed', 0)):,}"
             " B" if best else ""), flush=True)
    if best and best.get("moonbright"):
        print("moonbright stats at the best batch: " + json.dumps(best["moonbright"]), flush=True)
    return 0 if best else 1


if __name__ == "__main__":
    sys.exit(main())
